// Kev's CUDA kernels, compiled at run time with NVRTC (no CUDA headers: bf16 and f16 are read
// and written as 16-bit integers).
//
// gdr_<dtype>_nk<NK>: the gated delta rule, recurrent form (QWEN35.md §3 step 7).
//   grid  = (ceil(Dv / WARPS), B·Hv), block = 32·WARPS threads.
//   One warp owns one state column S[:, j] of one (batch row, value head); lane l keeps the NK
//   elements S[l + 32·i, j] in registers for the whole sequence (Dk ≤ 32·NK).
//   Inputs:  qkv [B, T, 2·Hk·Dk + Hv·Dv] (dtype), gb [B, T, Hv, 2] f32 (g, beta), lengths [B] u32.
//   In/out:  state [B, Hv, Dk, Dv] f32 (read at start, written at end).
//   Output:  out [B, T, Hv, Dv] (dtype); steps t >= lengths[b] write 0 and leave the state alone.
//
// conv_<dtype>: causal depthwise conv1d + SiLU, one thread per output element.
//   Inputs: x [B, K-1+T, C] (dtype, the K-1 cached steps first), w [C, K] (dtype).
//   Output: y [B, T, C] (dtype), accumulated in f32.

#define WARPS 4
#define L2NORM_EPS 1e-6f

struct F32 {
    typedef float T;
    static __device__ __forceinline__ float load(const float* p) { return *p; }
    static __device__ __forceinline__ void store(float* p, float v) { *p = v; }
};

struct BF16 {
    typedef unsigned short T;
    static __device__ __forceinline__ float load(const unsigned short* p) {
        return __uint_as_float(((unsigned int)*p) << 16);
    }
    static __device__ __forceinline__ void store(unsigned short* p, float v) {
        unsigned int u = __float_as_uint(v);
        if ((u & 0x7fffffffu) > 0x7f800000u) { *p = 0x7fc0; return; }  // NaN
        u += 0x7fffu + ((u >> 16) & 1u);                               // round to nearest even
        *p = (unsigned short)(u >> 16);
    }
};

struct F16 {
    typedef unsigned short T;
    static __device__ __forceinline__ float load(const unsigned short* p) {
        float f;
        asm("{ cvt.f32.f16 %0, %1; }" : "=f"(f) : "h"(*p));
        return f;
    }
    static __device__ __forceinline__ void store(unsigned short* p, float v) {
        unsigned short h;
        asm("{ cvt.rn.f16.f32 %0, %1; }" : "=h"(h) : "f"(v));
        *p = h;
    }
};

__device__ __forceinline__ float warp_sum(float v) {
    #pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

template <typename D, int NK>
__device__ void gdr(const typename D::T* __restrict__ qkv, const float* __restrict__ gb,
                    float* __restrict__ state, typename D::T* __restrict__ out,
                    const unsigned int* __restrict__ lengths,
                    int T, int hk, int hv, int dk, int dv) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int j = blockIdx.x * WARPS + warp;
    if (j >= dv) return;  // whole warps leave together
    const int bh = blockIdx.y, b = bh / hv, h = bh % hv, kh = h / (hv / hk);
    const int channels = 2 * hk * dk + hv * dv;
    const float scale = rsqrtf((float)dk);
    float* st = state + (size_t)bh * dk * dv;
    float s[NK];
    #pragma unroll
    for (int i = 0; i < NK; i++) {
        const int r = lane + 32 * i;
        s[i] = r < dk ? st[(size_t)r * dv + j] : 0.f;
    }
    const int len = min((int)lengths[b], T);
    for (int t = 0; t < T; t++) {
        typename D::T* o = out + (((size_t)b * T + t) * hv + h) * dv + j;
        if (t >= len) {
            if (lane == 0) D::store(o, 0.f);
            continue;
        }
        const typename D::T* row = qkv + ((size_t)b * T + t) * channels;
        float q[NK], k[NK], qq = 0.f, kk = 0.f;
        #pragma unroll
        for (int i = 0; i < NK; i++) {
            const int r = lane + 32 * i;
            q[i] = r < dk ? D::load(row + kh * dk + r) : 0.f;
            k[i] = r < dk ? D::load(row + (hk + kh) * dk + r) : 0.f;
            qq += q[i] * q[i];
            kk += k[i] * k[i];
        }
        const float qs = scale / sqrtf(warp_sum(qq) + L2NORM_EPS);
        const float ks = 1.f / sqrtf(warp_sum(kk) + L2NORM_EPS);
        const float* g = gb + (((size_t)b * T + t) * hv + h) * 2;
        const float decay = expf(g[0]), beta = g[1];
        float kv = 0.f;
        #pragma unroll
        for (int i = 0; i < NK; i++) {
            k[i] *= ks;
            s[i] *= decay;
            kv += s[i] * k[i];
        }
        kv = warp_sum(kv);
        const float delta = (D::load(row + 2 * hk * dk + h * dv + j) - kv) * beta;
        float ov = 0.f;
        #pragma unroll
        for (int i = 0; i < NK; i++) {
            s[i] += k[i] * delta;
            ov += s[i] * q[i] * qs;
        }
        ov = warp_sum(ov);
        if (lane == 0) D::store(o, ov);
    }
    #pragma unroll
    for (int i = 0; i < NK; i++) {
        const int r = lane + 32 * i;
        if (r < dk) st[(size_t)r * dv + j] = s[i];
    }
}

template <typename D>
__device__ void conv(const typename D::T* __restrict__ x, const typename D::T* __restrict__ w,
                     typename D::T* __restrict__ y, int B, int T, int C, int K) {
    const size_t n = (size_t)B * T * C;
    for (size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x; idx < n;
         idx += (size_t)gridDim.x * blockDim.x) {
        const int c = idx % C;
        const size_t bt = idx / C;
        const int t = bt % T, b = bt / T;
        const typename D::T* xs = x + ((size_t)b * (T + K - 1) + t) * C + c;
        float acc = 0.f;
        for (int j = 0; j < K; j++) acc += D::load(w + c * K + j) * D::load(xs + (size_t)j * C);
        D::store(y + idx, acc / (1.f + expf(-acc)));
    }
}

#define GDR(NAME, D, NK)                                                                        \
    extern "C" __global__ void NAME(const D::T* qkv, const float* gb, float* state, D::T* out, \
                                    const unsigned int* lengths, int T, int hk, int hv, int dk, \
                                    int dv) {                                                   \
        gdr<D, NK>(qkv, gb, state, out, lengths, T, hk, hv, dk, dv);                            \
    }
#define GDR_ALL(TAG, D) \
    GDR(gdr_##TAG##_nk1, D, 1) GDR(gdr_##TAG##_nk2, D, 2) GDR(gdr_##TAG##_nk4, D, 4) GDR(gdr_##TAG##_nk8, D, 8)
GDR_ALL(f32, F32)
GDR_ALL(bf16, BF16)
GDR_ALL(f16, F16)

#define CONV(TAG, D)                                                                              \
    extern "C" __global__ void conv_##TAG(const D::T* x, const D::T* w, D::T* y, int B, int T, \
                                          int C, int K) {                                         \
        conv<D>(x, w, y, B, T, C, K);                                                             \
    }
CONV(f32, F32)
CONV(bf16, BF16)
CONV(f16, F16)
