// Shared by Kev's CUDA sources (prepended to each before nvcc or NVRTC compiles it): the activation
// dtypes, read and written as 16-bit integers (no CUDA headers), and warp reductions.

// `FAST`: whether SiLU, sigmoid and the softmax's exp may use the fast intrinsics (see `silu`
// below).
struct F32 {
    typedef float T;
    static constexpr bool FAST = false;
    static __device__ __forceinline__ float load(const float* p) { return *p; }
    static __device__ __forceinline__ void store(float* p, float v) { *p = v; }
    static __device__ __forceinline__ float round(float v) { return v; }
};

struct BF16 {
    typedef unsigned short T;
    static constexpr bool FAST = true;
    static __device__ __forceinline__ float load(const unsigned short* p) {
        return __uint_as_float(((unsigned int)*p) << 16);
    }
    // Rounded to nearest, ties to even (NaN stays NaN): one conversion instruction where the GPU
    // has it; the integer form took ~7, which bound the elementwise kernels by issue (ncu).
    static __device__ __forceinline__ void store(unsigned short* p, float v) {
#if __CUDA_ARCH__ >= 800
        unsigned short h;
        asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
        *p = h;
#else
        unsigned int u = __float_as_uint(v);
        if ((u & 0x7fffffffu) > 0x7f800000u) { *p = 0x7fc0; return; }  // NaN
        u += 0x7fffu + ((u >> 16) & 1u);                               // round to nearest even
        *p = (unsigned short)(u >> 16);
#endif
    }
    static __device__ __forceinline__ float round(float v) {
        unsigned short h;
        store(&h, v);
        return load(&h);
    }
    // Two values rounded and packed, `lo` in the low half: one instruction where the GPU has it.
    static __device__ __forceinline__ unsigned pack2(float lo, float hi) {
#if __CUDA_ARCH__ >= 800
        unsigned r;
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
#else
        unsigned short a, b;
        store(&a, lo);
        store(&b, hi);
        return a | ((unsigned)b << 16);
#endif
    }
};

struct F16 {
    typedef unsigned short T;
    static constexpr bool FAST = true;
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
    static __device__ __forceinline__ float round(float v) {
        unsigned short h;
        store(&h, v);
        return load(&h);
    }
    static __device__ __forceinline__ unsigned pack2(float lo, float hi) {
        unsigned short a, b;
        store(&a, lo);
        store(&b, hi);
        return a | ((unsigned)b << 16);
    }
};

// 16-byte vectors of a dtype (8 bf16/f16 or 4 f32 values): one load instruction moves 8× (4×)
// the bytes of a scalar one, which keeps enough bytes in flight to stream at DRAM bandwidth.
// `p` must be 16-byte aligned.
template <typename D>
struct Vec16 {
    static constexpr int N = 16 / sizeof(typename D::T);
    union Raw {
        uint4 word;
        typename D::T e[N];
    };
    static __device__ __forceinline__ void load(const typename D::T* p, float* v) {
        Raw r;
        r.word = *reinterpret_cast<const uint4*>(p);
        #pragma unroll
        for (int i = 0; i < N; ++i) v[i] = D::load(&r.e[i]);
    }
    static __device__ __forceinline__ void store(typename D::T* p, const float* v) {
        Raw r;
        #pragma unroll
        for (int i = 0; i < N; ++i) D::store(&r.e[i], v[i]);
        *reinterpret_cast<uint4*>(p) = r.word;
    }
};

// S values at a time: one 16-byte vector (S = N), or one scalar (S = 1); the gated norm's and
// the causal softmax's rows.
template <typename D, int S>
struct Run {  // S values at a time: one 16-byte vector (S = N)
    static __device__ __forceinline__ void load(const typename D::T* p, float* v) { Vec16<D>::load(p, v); }
    static __device__ __forceinline__ void store(typename D::T* p, const float* v) { Vec16<D>::store(p, v); }
};
template <typename D>
struct Run<D, 1> {  // or one scalar
    static __device__ __forceinline__ void load(const typename D::T* p, float* v) { v[0] = D::load(p); }
    static __device__ __forceinline__ void store(typename D::T* p, const float* v) { D::store(p, v[0]); }
};

// Value i of the 8 16-bit values packed in v, as f32.
template <typename D>
__device__ __forceinline__ float unpack8(const uint4& v, int i) {
    const unsigned w = i < 2 ? v.x : i < 4 ? v.y : i < 6 ? v.z : v.w;
    const typename D::T h = (typename D::T)((i & 1) ? w >> 16 : w & 0xffffu);
    return D::load(&h);
}
// Value i of the 4 16-bit values packed in v, as f32.
template <typename D>
__device__ __forceinline__ float unpack4(const uint2& v, int i) {
    const unsigned w = i < 2 ? v.x : v.y;
    const typename D::T h = (typename D::T)((i & 1) ? w >> 16 : w & 0xffffu);
    return D::load(&h);
}
// The bits of v rounded to the 16-bit dtype D.
template <typename D>
__device__ __forceinline__ unsigned pack16(float v) {
    typename D::T h;
    D::store(&h, v);
    return h;
}

// Whether `p` is 16-byte aligned.
__device__ __forceinline__ bool aligned16(const void* p) { return ((size_t)p & 15) == 0; }

// SiLU and sigmoid in f32, for results rounded to the dtype D. For bf16 and f16 (8 and 11
// significant bits) they use the approximate e^x (ex2.approx, as __expf) and __fdividef: a few
// f32 ulp off torch's expf and IEEE division, which moves a rounded result by one unit of the
// dtype about once in 10^4 (bf16) to 10^3 (f16) values, far inside what parity allows; and the
// elementwise kernels around them were bound by issuing expf's and the division's instructions,
// not by memory (ncu). f32 keeps torch's exact formula, which the f32 parity checks hold to 1e-5.
// e^{−x} only enters them as 1 + e^{−x}, so exp_neg's flush of results below 2^−126 to zero
// (ex2.approx.ftz: two instructions, against five for __expf's subnormal fix-up) leaves the f32
// sum, and so the result, exactly as __expf gives it.
__device__ __forceinline__ float exp_neg(float x) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x * -1.4426950408889634f));
    return r;
}
template <typename D>
__device__ __forceinline__ float silu(float x) {
    return D::FAST ? __fdividef(x, 1.f + exp_neg(x)) : x / (1.f + expf(-x));
}
template <typename D>
__device__ __forceinline__ float sigmoid(float x) {
    return D::FAST ? __fdividef(1.f, 1.f + exp_neg(x)) : 1.f / (1.f + expf(-x));
}

// e^x for probabilities rounded to the dtype D, as silu above.
template <typename D>
__device__ __forceinline__ float exp_d(float x) {
    return D::FAST ? __expf(x) : expf(x);
}

__device__ __forceinline__ float warp_sum(float v) {
    #pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

