// Compiled by nvcc (build.rs) or NVRTC, common.cuh prepended (no CUDA headers: bf16 and f16 are
// read and written as 16-bit integers); the constants shared with the Rust launcher come as
// -D defines (backend/cuda/catalog.rs).
//
// Inputs marked "rows" are [rows, cols] views whose rows start `stride` elements apart (a slice
// of a wider projection). Rounding to the activation dtype happens exactly where HF's PyTorch
// code rounds.

// Sum over a block of blockDim.x threads (a multiple of 32, at most 1024).
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float part[32];
    const int lane = threadIdx.x % 32, w = threadIdx.x / 32, nw = blockDim.x / 32;
    v = warp_sum(v);
    __syncthreads();  // `part` may still be read by a previous call
    if (lane == 0) part[w] = v;
    __syncthreads();
    return warp_sum(lane < nw ? part[lane] : 0.f);
}

// rmsnorm_<dtype>: zero-centred RMSNorm, x̂·(1+w) in f32, one block per row. Without a residual
// (`h` null) out = [rows, cols] normed; with one, the residual sum x+h (rounded, as the dtype add)
// is normed and out = [2, rows, cols]: the sum, then the normed sum.
template <typename D>
__device__ void rmsnorm(const typename D::T* x, long xs, const typename D::T* h, long hs,
                        const float* w1, typename D::T* out, int rows, int cols, float eps) {
    typedef Vec16<D> V;
    const int r = blockIdx.x;
    const typename D::T* xr = x + (size_t)r * xs;
    const typename D::T* hr = h ? h + (size_t)r * hs : nullptr;
    typename D::T* sum = out + (size_t)r * cols;
    typename D::T* normed = out + (h ? (size_t)rows * cols : 0) + (size_t)r * cols;
    const typename D::T* src = h ? sum : xr;  // what the second pass normalises
    // Whole rows in 16-byte vectors where every row start is aligned (the usual case). Each
    // thread re-reads in the second pass exactly what it wrote in the first.
    const bool vec = cols % V::N == 0 && xs % V::N == 0 && aligned16(x) && aligned16(out) &&
                     (!h || (hs % V::N == 0 && aligned16(h)));
    float ss = 0.f;
    // A thread's first vector stays in registers for the second pass (with the launch's block
    // size, cols / N threads up to 1024, usually its only one): no second round trip through
    // the caches for it.
    float first[V::N];
    if (vec) {
        for (int c = threadIdx.x * V::N; c < cols; c += blockDim.x * V::N) {
            float v[V::N];
            V::load(xr + c, v);
            if (hr) {
                float hv[V::N];
                V::load(hr + c, hv);
                #pragma unroll
                for (int i = 0; i < V::N; ++i) v[i] = D::round(v[i] + hv[i]);
                V::store(sum + c, v);
            }
            #pragma unroll
            for (int i = 0; i < V::N; ++i) ss += v[i] * v[i];
            if (c == threadIdx.x * V::N) {
                #pragma unroll
                for (int i = 0; i < V::N; ++i) first[i] = v[i];
            }
        }
    } else {
        for (int c = threadIdx.x; c < cols; c += blockDim.x) {
            float v = D::load(xr + c);
            if (hr) {
                v = D::round(v + D::load(hr + c));
                D::store(sum + c, v);
            }
            ss += v * v;
        }
    }
    const float inv = rsqrtf(block_sum(ss) / cols + eps);
    if (vec) {
        const bool w4 = aligned16(w1);  // the weight as float4s (N is a multiple of 4)
        for (int c = threadIdx.x * V::N; c < cols; c += blockDim.x * V::N) {
            float v[V::N], wv[V::N];
            if (c == threadIdx.x * V::N) {
                #pragma unroll
                for (int i = 0; i < V::N; ++i) v[i] = first[i];
            } else {
                V::load(src + c, v);
            }
            if (w4) {
                #pragma unroll
                for (int i = 0; i < V::N; i += 4) {
                    const float4 q = *reinterpret_cast<const float4*>(w1 + c + i);
                    wv[i] = q.x, wv[i + 1] = q.y, wv[i + 2] = q.z, wv[i + 3] = q.w;
                }
            } else {
                #pragma unroll
                for (int i = 0; i < V::N; ++i) wv[i] = w1[c + i];
            }
            #pragma unroll
            for (int i = 0; i < V::N; ++i) v[i] = v[i] * inv * wv[i];  // HF's order
            V::store(normed + c, v);
        }
    } else {
        for (int c = threadIdx.x; c < cols; c += blockDim.x) {
            D::store(normed + c, D::load(src + c) * inv * w1[c]);
        }
    }
}

// gnorm_<dtype>: the DeltaNet output norm, one half-warp per (row, head): x [rows·heads, dv]
// contiguous, z rows (stride zs) holding heads·dv gate values, w [dv] in the dtype.
//   out = round(round(round(x̂)·w) · silu(z))   (HF Qwen3_5RMSNormGated)
// Aligned rows move as 16-byte vectors (a lane S = N values at a time); others element by element
// (S = 1). Half a warp per row: a 128-wide bf16 row is 16 vectors, so a whole warp left half its
// lanes idle. When a row is exactly one vector per lane (Qwen3.5's heads), x, z and w are all
// loaded before the reduction and x stays in registers: one memory round trip, not two.
// Sum over the 16 lanes of a half-warp (both halves of the warp must call it).
__device__ __forceinline__ float half_warp_sum(float v) {
    #pragma unroll
    for (int off = 8; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}
template <typename D, int S>
__device__ __forceinline__ void gnorm_out(const float* v, const float* wv, const float* g,
                                          float inv, typename D::T* o) {
    float r[S];
    #pragma unroll
    for (int i = 0; i < S; i++) r[i] = D::round(D::round(v[i] * inv) * wv[i]) * silu<D>(g[i]);
    Run<D, S>::store(o, r);
}
template <typename D, int S>
__device__ __forceinline__ void gnorm_row(const typename D::T* xr, const typename D::T* zr,
                                          const typename D::T* w, typename D::T* orow, int dv,
                                          float eps, int sub, bool active) {
    if (dv == 16 * S) {  // one run per lane
        float v[S] = {}, wv[S] = {}, g[S] = {}, ss = 0.f;
        if (active) {
            Run<D, S>::load(xr + sub * S, v);
            Run<D, S>::load(w + sub * S, wv);
            Run<D, S>::load(zr + sub * S, g);
        }
        #pragma unroll
        for (int i = 0; i < S; i++) ss += v[i] * v[i];
        const float inv = rsqrtf(half_warp_sum(ss) / dv + eps);
        if (active) gnorm_out<D, S>(v, wv, g, inv, orow + sub * S);
        return;
    }
    float ss = 0.f;
    for (int c = sub * S; active && c < dv; c += 16 * S) {
        float v[S];
        Run<D, S>::load(xr + c, v);
        #pragma unroll
        for (int i = 0; i < S; i++) ss += v[i] * v[i];
    }
    const float inv = rsqrtf(half_warp_sum(ss) / dv + eps);
    for (int c = sub * S; active && c < dv; c += 16 * S) {
        float v[S], wv[S], g[S];
        Run<D, S>::load(xr + c, v);
        Run<D, S>::load(w + c, wv);
        Run<D, S>::load(zr + c, g);
        gnorm_out<D, S>(v, wv, g, inv, orow + c);
    }
}
template <typename D>
__device__ void gnorm(const typename D::T* x, const typename D::T* z, long zs,
                      const typename D::T* w, typename D::T* out, int groups, int heads, int dv,
                      float eps) {
    constexpr int N = Vec16<D>::N;
    const int gi = blockIdx.x * (blockDim.x / 16) + threadIdx.x / 16, sub = threadIdx.x % 16;
    if (blockIdx.x * (blockDim.x / 16) + (threadIdx.x / 32) * 2 >= groups) return;  // whole warps
    const bool active = gi < groups;
    const int row = active ? gi : 0;
    const typename D::T* xr = x + (size_t)row * dv;
    const typename D::T* zr = z + (size_t)(row / heads) * zs + (size_t)(row % heads) * dv;
    typename D::T* orow = out + (size_t)row * dv;
    if (dv % N == 0 && aligned16(x) && aligned16(z) && aligned16(w) && aligned16(out) &&
        (zs * sizeof(typename D::T)) % 16 == 0)
        gnorm_row<D, N>(xr, zr, w, orow, dv, eps, sub, active);
    else
        gnorm_row<D, 1>(xr, zr, w, orow, dv, eps, sub, active);
}

#define NORM(TAG, D)                                                                            \
    extern "C" __global__ void rmsnorm_##TAG(const D::T* x, long xs, const D::T* h, long hs,   \
                                             const float* w1, D::T* out, int rows, int cols,  \
                                             float eps) {                                      \
        rmsnorm<D>(x, xs, h, hs, w1, out, rows, cols, eps);                                    \
    }                                                                                          \
    extern "C" __global__ void gnorm_##TAG(const D::T* x, const D::T* z, long zs, const D::T* w, \
                                           D::T* out, int groups, int heads, int dv, float eps) { \
        gnorm<D>(x, z, zs, w, out, groups, heads, dv, eps);                                    \
    }
NORM(f32, F32)
NORM(bf16, BF16)
NORM(f16, F16)
