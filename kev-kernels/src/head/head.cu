// Compiled by nvcc (build.rs) or NVRTC, common.cuh prepended (backend/cuda/catalog.rs).

// rows_f32_<dtype>: out row r (f32) = src row idx[r] (row r where idx is null), `cols` values a
// row, widened exactly. An index at or past `rows` (the host checks them) gives zeros rather
// than a read outside the source. grid = (column blocks, up to 65535 rows, striding).
template <typename D>
__device__ void rows_f32(const typename D::T* src, const unsigned int* idx, float* out, int n,
                         long cols, int rows) {
    for (int r = blockIdx.y; r < n; r += gridDim.y) {
        const unsigned int from = idx ? idx[r] : (unsigned int)r;
        const typename D::T* s = src + (size_t)from * cols;
        float* o = out + (size_t)r * cols;
        for (long c = (long)blockIdx.x * blockDim.x + threadIdx.x; c < cols;
             c += (long)gridDim.x * blockDim.x)
            o[c] = from < (unsigned int)rows ? D::load(s + c) : 0.f;
    }
}

#define ROWS_F32(TAG, D)                                                                      \
    extern "C" __global__ void rows_f32_##TAG(const D::T* src, const unsigned int* idx,       \
                                              float* out, int n, long cols, int rows) {       \
        rows_f32<D>(src, idx, out, n, cols, rows);                                            \
    }
ROWS_F32(f32, F32)
ROWS_F32(bf16, BF16)
ROWS_F32(f16, F16)

// pointer_logits: logit m = scale · Σ_d (q[owner[m], d] + q_bias[d]) · (k[m, d] + k_bias[d]),
// all f32: the head's query of option m's question against the option's key. One warp an
// option, lanes striding over d; an owner at or past `questions` (the host checks them) gives
// a NaN logit, never a read outside q. block = 32·warps, grid = options / warps.
extern "C" __global__ void pointer_logits(const float* q, const float* k, const float* q_bias,
                                          const float* k_bias, const unsigned int* owner,
                                          float* out, int options, int dim, int questions,
                                          float scale) {
    const int m = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (m >= options) return;
    const unsigned int o = owner[m];
    if (o >= (unsigned int)questions) {
        if (lane == 0) out[m] = __int_as_float(0x7fc00000);
        return;
    }
    const float* qr = q + (size_t)o * dim;
    const float* kr = k + (size_t)m * dim;
    float acc = 0.f;
    for (int d = lane; d < dim; d += 32) acc += (qr[d] + q_bias[d]) * (kr[d] + k_bias[d]);
    acc = warp_sum(acc);
    if (lane == 0) out[m] = acc * scale;
}
