// Compiled by nvcc (build.rs) or NVRTC, common.cuh prepended.

// One float to e4m3: rounded to nearest even, saturated to ±448, NaN to NaN (the conversion's
// first operand goes to the upper byte of the pair). FP8 products run on compute capability
// 9.0 only (the launcher checks), so other machine code never reaches this.
__device__ __forceinline__ unsigned char to_e4m3(float v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    unsigned short pair;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(0.0f), "f"(v));
    return (unsigned char)(pair & 0xff);
#else
    return 0x7f;
#endif
}

// fp8_quantize_rows_{bf16,f16}: x [m, k] → q [mp, k] e4m3 and scales [kb, mp] f32, token by token
// (cuBLASLt's layout for one scale per token and block of FP8_BLOCK inputs), kb = ⌈k / FP8_BLOCK⌉.
// A block's scale is its largest magnitude / 448 (1 for an all-zero block, as the CPU's
// `block_scale`), its values divided by it; rows m..mp are zeros of scale 1. One warp per
// (row, block), FP8_BLOCK / 32 values a lane; NaN values are left out of the largest magnitude
// and stay NaN.
template <typename D>
__device__ void fp8_quantize_rows(const typename D::T* x, unsigned char* q, float* scales, int m,
                                  int mp, int k) {
    const int kb = (k + FP8_BLOCK - 1) / FP8_BLOCK;
    const int lane = threadIdx.x & 31;
    const long long warps = (long long)gridDim.x * blockDim.x / 32;
    for (long long w = (blockIdx.x * (long long)blockDim.x + threadIdx.x) / 32;
         w < (long long)mp * kb; w += warps) {
        const int row = (int)(w / kb), block = (int)(w % kb);
        float v[FP8_BLOCK / 32];
        float amax = 0.0f;
#pragma unroll
        for (int i = 0; i < FP8_BLOCK / 32; i++) {
            const int c = block * FP8_BLOCK + i * 32 + lane;
            v[i] = row < m && c < k ? D::load(x + (long long)row * k + c) : 0.0f;
            amax = fmaxf(amax, fabsf(v[i]));
        }
        for (int off = 16; off > 0; off >>= 1)
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
        float s = amax / 448.0f;
        s = s > 0.0f ? s : 1.0f;
#pragma unroll
        for (int i = 0; i < FP8_BLOCK / 32; i++) {
            const int c = block * FP8_BLOCK + i * 32 + lane;
            if (c < k) q[(long long)row * k + c] = to_e4m3(v[i] / s);
        }
        if (lane == 0) scales[(long long)block * mp + row] = s;
    }
}

extern "C" __global__ void fp8_quantize_rows_bf16(const unsigned short* x, unsigned char* q,
                                                  float* scales, int m, int mp, int k) {
    fp8_quantize_rows<BF16>(x, q, scales, m, mp, k);
}

extern "C" __global__ void fp8_quantize_rows_f16(const unsigned short* x, unsigned char* q,
                                                 float* scales, int m, int mp, int k) {
    fp8_quantize_rows<F16>(x, q, scales, m, mp, k);
}
