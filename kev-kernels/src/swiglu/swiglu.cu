// Compiled by nvcc (build.rs) or NVRTC, common.cuh prepended (no CUDA headers: bf16 and f16 are
// read and written as 16-bit integers); the constants shared with the Rust launcher come as
// -D defines (backend/cuda/catalog.rs).
//
// Inputs marked "rows" are [rows, cols] views whose rows start `stride` elements apart (a slice
// of a wider projection). Rounding to the activation dtype happens exactly where HF's PyTorch
// code rounds.

// swiglu_<dtype>: gu [rows, 2·inter] contiguous ([gate | up] per row) → out [rows, inter]:
//   round(round(silu(gate)) · up)   (HF: act_fn(gate_proj(x)) * up_proj(x) in the dtype)
// Blocks stride over rows and threads over columns: no 64-bit division per element (a flat
// grid-stride loop spent more time dividing indices than moving data).
template <typename D>
__device__ void swiglu(const typename D::T* gu, typename D::T* out, int rows, int inter) {
    typedef Vec16<D> V;
    const bool vec = inter % V::N == 0 && aligned16(gu) && aligned16(out);
    for (int r = blockIdx.x; r < rows; r += gridDim.x) {
        const typename D::T* g = gu + (size_t)r * 2 * inter;
        const typename D::T* u = g + inter;
        typename D::T* o = out + (size_t)r * inter;
        if (vec) {
            for (int c = threadIdx.x * V::N; c < inter; c += blockDim.x * V::N) {
                float gv[V::N], uv[V::N];
                V::load(g + c, gv);
                V::load(u + c, uv);
                #pragma unroll
                for (int i = 0; i < V::N; ++i) gv[i] = D::round(silu<D>(gv[i])) * uv[i];
                V::store(o + c, gv);
            }
        } else {
            for (int c = threadIdx.x; c < inter; c += blockDim.x) {
                const float gv = D::load(g + c);
                D::store(o + c, D::round(silu<D>(gv)) * D::load(u + c));
            }
        }
    }
}

#define SWIGLU(TAG, D)                                                                          \
    extern "C" __global__ void swiglu_##TAG(const D::T* gu, D::T* out, int rows, int inter) { \
        swiglu<D>(gu, out, rows, inter);                                                       \
    }
SWIGLU(f32, F32)
SWIGLU(bf16, BF16)
SWIGLU(f16, F16)
