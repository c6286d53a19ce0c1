// Compiled by nvcc (build.rs) or NVRTC, common.cuh, mma.cuh and moe_rows.cuh prepended, for GPUs
// with tensor cores (compute_80 and up); the MOE_* constants come as -D defines
// (backend/cuda/catalog.rs). The tensor-core form of moe.cu's products.

#if __CUDA_ARCH__ >= 800
// d += a·b for one 16×8 tile over k = 16 on f16 operands (mma16 is the bf16 one).
__device__ __forceinline__ void mma16_f16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Shared-memory rows of MOE_BK 16-bit values plus 16 bytes: 80-byte pitches put ldmatrix's 8
// rows in distinct banks.
#define MOE_PITCH (MOE_BK + 8)

// moe_mm_<bf16|f16>_<gu|down>: the products of moe_mm_simt on tensor cores (mma.sync m16n8k16,
// f32 accumulators). A block is MOE_BM rows × MOE_BN columns of W (`_gu`: MOE_BN / 2 gate and
// the matching up columns), MOE_BK deep per stage, MOE_STAGES stages of cp.async; 4 warps as
// 2 × 2, each 32 rows × 64 columns (`_gu`: 32 gate and their 32 up columns, so that SwiGLU
// pairs them in registers). Needs kdim % 8 == 0 (16-byte rows; the launcher checks).
template <typename D, bool F16, bool GATE_UP>
__device__ void moe_mm(const bf16_t* a, const bf16_t* w, bf16_t* c, const unsigned* order,
                       const int* tile_expert, int n, int kdim, int per_token) {
    __shared__ __align__(16) bf16_t sa[MOE_STAGES][MOE_BM * MOE_PITCH];
    __shared__ __align__(16) bf16_t sb[MOE_STAGES][MOE_BN * MOE_PITCH];
    __shared__ int arow[MOE_BM], crow[MOE_BM];
    const int tile = blockIdx.y, e = tile_expert[tile];
    if (e < 0) return;
    moe_tile_rows<GATE_UP>(order, tile, per_token, arow, crow);
    __syncthreads();
    const bf16_t* we = w + (size_t)e * (GATE_UP ? 2 * n : n) * kdim;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wm = warp >> 1, wn = warp & 1;
    constexpr int HALF = MOE_BN / 2, CHUNKS = MOE_BK / 8;
    auto wrow = [&](int i) {
        if (GATE_UP) {
            const int col = blockIdx.x * HALF + (i % HALF);
            return col < n ? (i < HALF ? col : n + col) : -1;
        }
        const int col = blockIdx.x * MOE_BN + i;
        return col < n ? col : -1;
    };
    auto load = [&](int stage, int k0) {
        for (int x = tid; x < MOE_BM * CHUNKS; x += MOE_THREADS) {
            const int r = x / CHUNKS, kc = (x % CHUNKS) * 8, row = arow[r];
            const bool ok = row >= 0 && k0 + kc < kdim;
            cp_async16(&sa[stage][r * MOE_PITCH + kc], ok ? a + (size_t)row * kdim + k0 + kc : a,
                       ok ? 16 : 0);
        }
        for (int x = tid; x < MOE_BN * CHUNKS; x += MOE_THREADS) {
            const int i = x / CHUNKS, kc = (x % CHUNKS) * 8, row = wrow(i);
            const bool ok = row >= 0 && k0 + kc < kdim;
            cp_async16(&sb[stage][i * MOE_PITCH + kc], ok ? we + (size_t)row * kdim + k0 + kc : w,
                       ok ? 16 : 0);
        }
    };
    // B-tile row of this warp's n-tiles q, q + 1 (q even).
    auto brow = [&](int q) { return GATE_UP ? (q >> 2) * HALF + wn * 32 + (q & 3) * 8 : wn * 64 + q * 8; };
    float acc[2][8][4] = {};
    const int ktiles = (kdim + MOE_BK - 1) / MOE_BK;
    #pragma unroll
    for (int s = 0; s < MOE_STAGES - 1; ++s) {
        if (s < ktiles) load(s, s * MOE_BK);
        cp_async_commit();
    }
    for (int kt = 0; kt < ktiles; ++kt) {
        cp_async_wait<MOE_STAGES - 2>();
        __syncthreads();  // stage kt is in; every warp is done with the stage refilled next
        const int next = kt + MOE_STAGES - 1;
        if (next < ktiles) load(next % MOE_STAGES, next * MOE_BK);
        cp_async_commit();
        const bf16_t* A = sa[kt % MOE_STAGES];
        const bf16_t* B = sb[kt % MOE_STAGES];
        #pragma unroll
        for (int kk = 0; kk < MOE_BK; kk += 16) {
            unsigned af[2][4];
            #pragma unroll
            for (int mi = 0; mi < 2; ++mi) ldsm4(af[mi], ldsm_a(A + kk, MOE_PITCH, wm * 32 + mi * 16, lane));
            #pragma unroll
            for (int q = 0; q < 8; q += 2) {
                unsigned bf[4];
                ldsm4(bf, ldsm_b2(B + kk, MOE_PITCH, brow(q), lane));
                const unsigned b0[2] = {bf[0], bf[1]}, b1[2] = {bf[2], bf[3]};
                #pragma unroll
                for (int mi = 0; mi < 2; ++mi) {
                    if (F16) {
                        mma16_f16(acc[mi][q], af[mi], b0);
                        mma16_f16(acc[mi][q + 1], af[mi], b1);
                    } else {
                        mma16(acc[mi][q], af[mi], b0);
                        mma16(acc[mi][q + 1], af[mi], b1);
                    }
                }
            }
        }
    }
    cp_async_wait<0>();
    // Accumulator (mi, q, 2h + v): row wm·32 + mi·16 + lane/4 + 8h, n-tile column 2(lane % 4) + v.
    const int g = lane >> 2, c2 = 2 * (lane & 3);
    #pragma unroll
    for (int mi = 0; mi < 2; ++mi)
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int out = crow[wm * 32 + mi * 16 + g + 8 * h];
            if (out < 0) continue;
            bf16_t* cr = c + (size_t)out * n;
            if (GATE_UP) {
                #pragma unroll
                for (int q = 0; q < 4; ++q)
                    #pragma unroll
                    for (int v = 0; v < 2; ++v) {
                        const int col = blockIdx.x * HALF + wn * 32 + q * 8 + c2 + v;
                        if (col < n)
                            D::store(cr + col, moe_swiglu<D>(acc[mi][q][2 * h + v], acc[mi][q + 4][2 * h + v]));
                    }
            } else {
                #pragma unroll
                for (int q = 0; q < 8; ++q)
                    #pragma unroll
                    for (int v = 0; v < 2; ++v) {
                        const int col = blockIdx.x * MOE_BN + wn * 64 + q * 8 + c2 + v;
                        if (col < n) D::store(cr + col, acc[mi][q][2 * h + v]);
                    }
            }
        }
}
#endif

#if __CUDA_ARCH__ >= 800
#define MOE_MM_BODY(D, F16, GU) moe_mm<D, F16, GU>(a, w, c, order, tiles, n, kdim, per_token);
#else
#define MOE_MM_BODY(D, F16, GU)
#endif
#define MOE_MM(TAG, D, F16)                                                                         \
    extern "C" __global__ void __launch_bounds__(MOE_THREADS)                                      \
        moe_mm_##TAG##_gu(const unsigned short* a, const unsigned short* w, unsigned short* c,     \
                          const unsigned* order, const int* tiles, int n, int kdim, int per_token) { \
        MOE_MM_BODY(D, F16, true)                                                                  \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(MOE_THREADS)                                      \
        moe_mm_##TAG##_down(const unsigned short* a, const unsigned short* w, unsigned short* c,   \
                            const unsigned* order, const int* tiles, int n, int kdim, int per_token) { \
        MOE_MM_BODY(D, F16, false)                                                                 \
    }
MOE_MM(bf16, BF16, false)
MOE_MM(f16, F16, true)

