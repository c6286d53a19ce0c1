// Compiled by nvcc (build.rs) or NVRTC, common.cuh prepended (no CUDA headers: bf16 and f16 are
// read and written as 16-bit integers); the constants shared with the Rust launcher come as
// -D defines (backend/cuda/catalog.rs).
//
// Inputs marked "rows" are [rows, cols] views whose rows start `stride` elements apart (a slice
// of a wider projection). Rounding to the activation dtype happens exactly where HF's PyTorch
// code rounds.

// gates_<dtype>: ba rows (stride s) of [b (hv) | a (hv)] → gb [rows, hv, 2] f32:
//   g = neg_a·softplus(a + dt_bias) (f32, torch's threshold 20), β = round(sigmoid(b)).
template <typename D>
__device__ void gates(const typename D::T* ba, long s, const float* dt_bias, const float* neg_a,
                      float* gb, int rows, int hv) {
    const size_t n = (size_t)rows * hv;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const int h = i % hv;
        const typename D::T* row = ba + (i / hv) * s;
        const float b = D::load(row + h), a = D::load(row + hv + h) + dt_bias[h];
        const float sp = a > 20.f ? a : log1pf(expf(a));
        gb[2 * i] = neg_a[h] * sp;
        gb[2 * i + 1] = D::round(sigmoid<D>(b));
    }
}

#define GATES(TAG, D)                                                                           \
    extern "C" __global__ void gates_##TAG(const D::T* ba, long s, const float* dt_bias,       \
                                           const float* neg_a, float* gb, int rows, int hv) {  \
        gates<D>(ba, s, dt_bias, neg_a, gb, rows, hv);                                         \
    }
GATES(f32, F32)
GATES(bf16, BF16)
GATES(f16, F16)
