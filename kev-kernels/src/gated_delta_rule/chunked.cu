// The gated delta rule, chunked (docs/BACKBONE.md §8.2), two kernels. The step-by-step kernel
// (recurrent.cu) is bound by one step's latency; this form does the same work as small dense products
// per chunk of CHUNK steps, so a row of T steps is T/CHUNK sequential rounds instead of T.
//
// Per (batch row, value head) and chunk, with G_t = Σ_{s≤t} g_s inside the chunk and S the state
// at the chunk start (k̂, q̂ l2-normalised, q̂ scaled by 1/√Dk, as in the recurrent kernel):
//   A[t,s] = β_t·e^{G_t−G_s}·k̂_t·k̂_s (s < t),  Tm = (I + A)⁻¹,  W = Tm·diag(β·e^G)·K̂,  U = Tm·diag(β)·V
//   Δ      = U − W·S                     (row t: the step's δ_t of the recurrence)
//   O      = Q'·S + Aqk·Δ                Q'_t = e^{G_t}·q̂_t,  Aqk[t,s] = e^{G_t−G_s}·q̂_t·k̂_s (s ≤ t)
//   S     ← e^{G_CH}·S + K'ᵀ·Δ          K'_t = e^{G_CH−G_t}·k̂_t
// Steps at or past a row's length get g = β = 0 and k̂ = q̂ = v = 0: they output 0 and leave the
// state alone, like the recurrent kernel. Everything is f32 (the tensor-core pair below: f32 with
// exact products of q and k as loaded, 16-bit, with their norms applied after, and TF32 ones for
// W and U in the preparation; bf16 ones in the scan); the output is rounded to the dtype.
// Dk and Dv are at most 128 (zero-padded to it inside).
//
// Every product is register-tiled (each thread a 4×4 to 4×16 block of outputs, operands read as
// float4 from shared memory): with one output per thread the kernels were bound by shared-memory
// bandwidth and ran slower than the step-by-step kernel.
//
// gdrc_prep_<dtype>: grid = (NC, B·Hv), block = 128, dynamic shared memory PREPARE_SMEM. One block
//   per chunk writes what does not depend on S to f32 scratch, per (row·head, chunk) `c`:
//   wt [c][128][CHUNK] Wᵀ,  qt [c][128][CHUNK] Q'ᵀ,  kd [c][CHUNK][128] K',  at [c][CHUNK][CHUNK] Aqkᵀ (zero where
//   s > t),  u [c][CHUNK][Dv] U,  gtot [c] e^{G_CH}.
// gdrc_scan_<dtype>: grid = (ceil(Dv/32), B·Hv), block = 128, dynamic shared memory SCAN_SMEM.
//   One block per 32 state columns walks the chunks in order; S lives in registers (an 8×4 tile
//   per thread) and is mirrored to shared memory as the operand of W·S and Q'·S.
// gdrc_prep_tc_<dtype>, gdrc_scan_tc{64,,16}_<dtype> (bf16/f16, compute capability ≥ 8.0): the
//   same on tensor cores, PREPARE_MMA_SMEM and ScanTc<NCOL>::BYTES; the scan with NCOL = 64, 32 or 16
//   columns per block (grid.x = ceil(Dv/NCOL)), W, Q' and Aqk by rows and K' transposed in
//   scratch (for ldmatrix), in bf16. See the tensor-core section below.

// From the launcher (-D defines, backend/cuda/catalog.rs): CHUNK steps per chunk, FMA_THREADS
// threads of the FMA kernels, MMA_THREADS of the tensor-core kernels (8 warps share a chunk's
// work, so one block, what a short call has per multiprocessor, issues from every scheduler), MAX_DIM
// the padded Dk and Dv; the shared memory of each kernel (checked against the layouts below);
// the SCAN_* mode bits and L2NORM_EPS.
#define A_P 36           // row pitch of A [CHUNK][CHUNK]: rows float4-aligned for the solve's loads
#define TP (CHUNK + 4)      // row pitch of [MAX_DIM][CHUNK] tiles: float4-aligned, rows in different banks

__device__ __forceinline__ float4 ld4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ void st4(float* p, float a, float b, float c, float d) {
    *reinterpret_cast<float4*>(p) = make_float4(a, b, c, d);
}
__device__ __forceinline__ float at(const float4& v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}
// acc += x ⊗ y: one step of a 4×4 register tile.
__device__ __forceinline__ void outer4(float (&acc)[4][4], const float4& x, const float4& y) {
    #pragma unroll
    for (int p = 0; p < 4; p++)
        #pragma unroll
        for (int q = 0; q < 4; q++) acc[p][q] += at(x, p) * at(y, q);
}

// Where step 1 of a preparation kernel puts a chunk's inputs in shared memory: q̂ᵀ and k̂ᵀ
// [MAX_DIM][tp] in f32 (qT, kT), or q and k as loaded, 16-bit, with their norms' factors qn, kn [CHUNK]
// (q16, k16, swizzled: see swz below); k̂ [CHUNK][kp] (optional), v [CHUNK][vp], and G, β, β·e^G [CHUNK]
// each; optionally e^G and e^{G_CH−G} [CHUNK] each (eg, egc), so later steps read the chunk's
// decays instead of recomputing them per element.
struct StepTiles {
    float *qT, *kT, *kr, *vr, *g, *beta, *bg, *eg, *egc;
    int tp, kp, vp;
    unsigned short *q16, *k16;
    float *qn, *kn;
};

// The column of step t in row r of the tensor-core preparation's 16-bit qᵀ and kᵀ tiles (pitch
// PT_P16 elements, 20 words ≡ 20 mod 32): t with its bits 1–2 XORed by r / 8. A warp stores one
// step's 128 features at once; unswizzled, rows r, r + 8, r + 16, r + 24 share a bank (4-way
// conflicts). Swizzled, those stores hit 32 banks, and the products' fragment loads (8
// consecutive steps of rows r..r+3, r / 8 the same for all) stay conflict-free.
__device__ __forceinline__ int swz(int r, int t) { return t ^ (((r >> 3) & 3) << 1); }

// A 16-bit activation's bits (the f32 instantiation has no 16-bit tiles).
__device__ __forceinline__ unsigned short bits16(unsigned short x) { return x; }
__device__ __forceinline__ unsigned short bits16(float) { return 0; }

// The end of step 1, warp 0 with a lane per step (CHUNK = 32): the step's g and β (zeros at or
// past `len`), the norms' factors qn, kn from the sums of squares the loaders left in them (16-bit
// tiles only), then the cumulative G and β·e^G (and e^G, e^{G_CH−G}) as a warp scan. Done here,
// a lane per step, so that the loaders' warps do not each run that serial tail (two loads, IEEE
// square roots and divisions) on one lane per step. Ends with the block synchronised.
__device__ __forceinline__ void chunk_decays(const StepTiles& s, const float* __restrict__ gb,
                                             int T, int len, int t0, int b, int h, int hv,
                                             int dk) {
    const int lane = threadIdx.x % 32;
    if (threadIdx.x / 32 == 0) {
        const int t = t0 + lane;
        const bool valid = t < len;
        const float* gbt = gb + (((size_t)b * T + (valid ? t : 0)) * hv + h) * 2;
        const float beta = valid ? gbt[1] : 0.f;
        if (s.qn) {
            s.qn[lane] = rsqrtf((float)dk) / sqrtf(s.qn[lane] + L2NORM_EPS);
            s.kn[lane] = 1.f / sqrtf(s.kn[lane] + L2NORM_EPS);
        }
        float acc = valid ? gbt[0] : 0.f;
        #pragma unroll
        for (int off = 1; off < 32; off *= 2) {
            const float up = __shfl_up_sync(0xffffffffu, acc, off);
            if (lane >= off) acc += up;
        }
        s.g[lane] = acc;
        s.beta[lane] = beta;
        const float e = expf(acc);
        s.bg[lane] = beta * e;
        if (s.eg) {
            s.eg[lane] = e;
            s.egc[lane] = expf(__shfl_sync(0xffffffffu, acc, CHUNK - 1) - acc);
        }
    }
    __syncthreads();
}

// Step 1 of both preparation kernels: the chunk's q̂, k̂ (l2-normalised, q̂ scaled by 1/√Dk; for
// 16-bit tiles q, k as loaded and their sums of squares), v, a warp per step (unrolled: the loads
// of a warp's steps are in flight together); then chunk_decays. Ends with the block
// synchronised. UNROLL: steps a warp has in flight (1 in the tensor-core preparation, whose four
// blocks per multiprocessor leave no registers for more and hide the loads' latency with one
// another).
template <typename D, int NTHREADS, int UNROLL = CHUNK / (NTHREADS / 32)>
__device__ __forceinline__ void load_chunk(const typename D::T* __restrict__ qkv,
                                           const float* __restrict__ gb, const StepTiles& s,
                                           int T, int len, int t0, int b, int h, int kh, int hk,
                                           int hv, int dk, int dv) {
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int channels = 2 * hk * dk + hv * dv;
    const float scale = rsqrtf((float)dk);
    #pragma unroll UNROLL
    for (int step = 0; step < CHUNK / (NTHREADS / 32); step++) {
        const int i = warp + step * (NTHREADS / 32), t = t0 + i;
        const bool valid = t < len;
        const typename D::T* row = qkv + ((size_t)b * T + (valid ? t : 0)) * channels;
        float q[4], k[4], qq = 0.f, kk = 0.f;
        #pragma unroll
        for (int x = 0; x < 4; x++) {
            const int r = lane + 32 * x;
            q[x] = valid && r < dk ? D::load(row + kh * dk + r) : 0.f;
            k[x] = valid && r < dk ? D::load(row + (hk + kh) * dk + r) : 0.f;
            qq += q[x] * q[x];
            kk += k[x] * k[x];
            s.vr[i * s.vp + r] = valid && r < dv ? D::load(row + 2 * hk * dk + h * dv + r) : 0.f;
        }
        qq = warp_sum(qq);
        kk = warp_sum(kk);
        if (s.q16) {
            // q and k as loaded (exact in 16 bits, and in TF32) and their sums of squares,
            // which chunk_decays makes the norms' factors.
            #pragma unroll
            for (int x = 0; x < 4; x++) {
                const int r = lane + 32 * x;
                const bool in = valid && r < dk;
                s.q16[r * s.tp + swz(r, i)] = in ? bits16(row[kh * dk + r]) : 0;
                s.k16[r * s.tp + swz(r, i)] = in ? bits16(row[(hk + kh) * dk + r]) : 0;
            }
            if (lane == 0) {
                s.qn[i] = qq;
                s.kn[i] = kk;
            }
        } else {
            const float qn = scale / sqrtf(qq + L2NORM_EPS), kn = 1.f / sqrtf(kk + L2NORM_EPS);
            #pragma unroll
            for (int x = 0; x < 4; x++) {
                const int r = lane + 32 * x;
                s.qT[r * s.tp + i] = q[x] * qn;
                s.kT[r * s.tp + i] = k[x] * kn;
                if (s.kr) s.kr[i * s.kp + r] = k[x] * kn;
            }
        }
    }
    __syncthreads();
    chunk_decays(s, gb, T, len, t0, b, h, hv, dk);
}

// Where the fused conv's preparation (gdrc_prep2c_tc_<dtype>) reads its inputs: a part's raw
// in_proj rows `[q | k | v | ..]` at row pitch `pitch` (elements), before the causal depthwise
// conv + SiLU (docs/BACKBONE.md §3), weight w [C, 4]. The steps before a row's first: zeros
// for a state row (hist null); for a branch row, the last 3 real raw rows of the state row it
// continues, `owners[b]` (null: row 0) of the state part `hist` (rows of hist_t steps at pitch
// hist_pitch, hist_len real ones; null: all).
template <typename D>
struct ConvIn {
    const typename D::T* w;
    long pitch;
    const typename D::T* hist;
    long hist_pitch;
    const unsigned int* owners;
    const unsigned int* hist_len;
    int hist_t;
};

// Step 1 of the tensor-core preparation with the conv fused (conv_split's arithmetic per
// output, so the same numbers as that kernel followed by load_chunk). A thread takes 4 channels
// (8-byte loads) of a run of 4 steps: it reads the run's 4 + 3 raw rows once, and writes the
// outputs to the tiles instead of the conv writing them to memory and load_chunk reading them
// back. With Dk = Dv = 128 that is 3 runs a thread, in 64 registers without spills for bf16
// (f16's conversions spill 60 bytes; with 8 channels a thread bf16 spilled 180). q and k runs
// are spread step-fastest over a warp, v's channel-fastest: either way a warp's stores to the
// tiles share few banks. Then the norms' sums of squares from the tiles, summed as load_chunk
// sums them, and chunk_decays. The wrapper guarantees 8-byte aligned rows, a 16-byte aligned
// weight and 4 | Dk, Dv (16-bit dtypes only). Ends with the block synchronised.
template <typename D>
__device__ __forceinline__ void load_chunk_conv(const typename D::T* __restrict__ qkv,
                                                ConvIn<D> cv, const float* __restrict__ gb,
                                                const StepTiles& s, int T, int len, int t0, int b,
                                                int h, int kh, int hk, int hv, int dk, int dv) {
    typedef typename D::T E;
    constexpr int RUN = 4, RUNS = CHUNK / RUN, NCH = 4;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const E* x = qkv + (size_t)b * T * cv.pitch;
    const E* hist = nullptr;
    int hist_end = 0;
    if (cv.hist) {
        const int o = cv.owners ? (int)cv.owners[b] : 0;
        hist = cv.hist + (size_t)o * cv.hist_t * cv.hist_pitch;
        hist_end = cv.hist_len ? min((int)cv.hist_len[o], cv.hist_t) : cv.hist_t;
    }
    // Raw step t of the row (t < 0: its history), or null for a zero row. Steps at or past
    // `len` feed only steps that output zeros, so they are not read.
    auto raw = [&](int t) -> const E* {
        if (t >= len) return nullptr;
        if (t >= 0) return x + (size_t)t * cv.pitch;
        return hist && hist_end + t >= 0 ? hist + (size_t)(hist_end + t) * cv.hist_pitch : nullptr;
    };
    // Tile rows past Dk and columns past Dv are zeros, as load_chunk leaves them.
    for (int e = tid; e < (MAX_DIM - dk) * CHUNK; e += MMA_THREADS) {
        const int r = dk + e / CHUNK, i = e % CHUNK;
        s.q16[r * s.tp + swz(r, i)] = 0;
        s.k16[r * s.tp + swz(r, i)] = 0;
    }
    for (int e = tid; e < (MAX_DIM - dv) * CHUNK; e += MMA_THREADS) s.vr[(e % CHUNK) * s.vp + dv + e / CHUNK] = 0.f;
    // Items laid out for MAX_DIM channels a head, so that every index below is a shift or a
    // mask (for Dk or Dv below MAX_DIM the items past them skip; their tiles are zeros).
    constexpr int G = MAX_DIM / NCH, NQK = 2 * G * RUNS;  // groups of NCH channels a head
    #pragma unroll 1
    for (int item = tid; item < NQK + G * RUNS; item += MMA_THREADS) {
        const bool is_v = item >= NQK;
        const int grp = is_v ? (item - NQK) % G : item / RUNS;  // of NCH channels
        const int i0 = RUN * (is_v ? (item - NQK) / G : item % RUNS);
        const bool is_k = !is_v && grp >= G;
        const int r0 = NCH * (is_k ? grp - G : grp);  // the channel in its head
        if (r0 >= (is_v ? dv : dk)) continue;
        const int c0 = is_v ? 2 * hk * dk + h * dv + r0 : (is_k ? hk + kh : kh) * dk + r0;
        uint2 win[RUN + 3];
        const int tw = t0 + i0 - 3;  // the window's first step
        if (tw >= 0 && tw + RUN + 3 <= len) {
            // The whole window inside the row (most items): one pointer, no per-step checks.
            const E* src = x + (size_t)tw * cv.pitch + c0;
            #pragma unroll
            for (int p = 0; p < RUN + 3; p++, src += cv.pitch)
                win[p] = *reinterpret_cast<const uint2*>(src);
        } else {
            #pragma unroll
            for (int p = 0; p < RUN + 3; p++) {
                const E* src = raw(tw + p);
                win[p] = src ? *reinterpret_cast<const uint2*>(src + c0) : make_uint2(0u, 0u);
            }
        }
        // The run's outputs, rounded to the dtype in pairs of steps (zero past len), before
        // any store: q and k go out as a word per pair of steps, v as 4 channels of a step.
        unsigned y[NCH][RUN / 2];
        #pragma unroll
        for (int c = 0; c < NCH; c++) {
            // w[c0 + c, 0..4], read with its pair's (16 bytes). Loaded per channel: kept for
            // both channels of a pair, the preparation spilled.
            const uint4 wc = *reinterpret_cast<const uint4*>(cv.w + (size_t)(c0 + c - c % 2) * 4);
            const int tap0 = 4 * (c % 2);
            const float w0 = unpack8<D>(wc, tap0), w1 = unpack8<D>(wc, tap0 + 1),
                        w2 = unpack8<D>(wc, tap0 + 2), w3 = unpack8<D>(wc, tap0 + 3);
            float o[RUN];
            #pragma unroll
            for (int j = 0; j < RUN; j++) {
                const float acc = w0 * unpack4<D>(win[j], c) + w1 * unpack4<D>(win[j + 1], c) +
                                  w2 * unpack4<D>(win[j + 2], c) + w3 * unpack4<D>(win[j + 3], c);
                // Computed for every step and then selected: a branch per output cost more
                // instructions than the SiLU it skips (ncu).
                const float y_j = silu<D>(acc);
                o[j] = t0 + i0 + j < len ? y_j : 0.f;
            }
            #pragma unroll
            for (int j = 0; j < RUN; j += 2) y[c][j / 2] = D::pack2(o[j], o[j + 1]);
        }
        if (is_v) {
            #pragma unroll
            for (int j = 0; j < RUN; j++) {
                float v[NCH];
                #pragma unroll
                for (int c = 0; c < NCH; c++) v[c] = unpack4<D>(make_uint2(y[c][j / 2], 0u), j % 2);
                st4(&s.vr[(i0 + j) * s.vp + r0], v[0], v[1], v[2], v[3]);
            }
        } else {
            // The run's channels share r / 8 (4 | r0), so one swizzled column per pair of
            // steps serves all four rows (swz keeps a pair's two steps side by side).
            unsigned short* tile = (is_k ? s.k16 : s.q16) + r0 * s.tp;
            #pragma unroll
            for (int j = 0; j < RUN; j += 2) {
                const int col = swz(r0, i0 + j);
                #pragma unroll
                for (int c = 0; c < NCH; c++)
                    *reinterpret_cast<unsigned*>(&tile[c * s.tp + col]) = y[c][j / 2];
            }
        }
    }
    __syncthreads();
    // The norms' sums of squares from the tiles, a warp per step and the lanes' channels as
    // load_chunk sums them.
    #pragma unroll 1
    for (int i = warp; i < CHUNK; i += MMA_THREADS / 32) {
        float qq = 0.f, kk = 0.f;
        #pragma unroll
        for (int xi = 0; xi < 4; xi++) {
            const int r = lane + 32 * xi;
            const float q = D::load(&s.q16[r * s.tp + swz(r, i)]);
            const float k = D::load(&s.k16[r * s.tp + swz(r, i)]);
            qq += q * q;
            kk += k * k;
        }
        qq = warp_sum(qq);
        kk = warp_sum(kk);
        if (lane == 0) {
            s.qn[i] = qq;
            s.kn[i] = kk;
        }
    }
    __syncthreads();
    chunk_decays(s, gb, T, len, t0, b, h, hv, dk);
}

// Step 3, warp 0: Tm = (I + A)⁻¹ for A strictly lower triangular (pitch A_P), by forward
// substitution, lane j solving column j in registers (fully unrolled, so every lane runs the same
// code and reads A as broadcasts, four entries per load: above the diagonal the column is zero
// and adds nothing). Two partial sums (even and odd s) halve the chain of dependent FMAs.
// Written transposed: tT[j·tp + i] = Tm[i][j].
__device__ __forceinline__ void solve_unit_lower(const float* a, float* tT, int tp, int lane) {
    float x[CHUNK];
    #pragma unroll
    for (int i = 0; i < CHUNK; i++) {
        float even = i == lane ? 1.f : 0.f, odd = 0.f;
        #pragma unroll
        for (int s = 0; s < i; s += 4) {
            const float4 r = ld4(&a[i * A_P + s]);
            even -= r.x * x[s];
            if (s + 1 < i) odd -= r.y * x[s + 1];
            if (s + 2 < i) even -= r.z * x[s + 2];
            if (s + 3 < i) odd -= r.w * x[s + 3];
        }
        x[i] = even + odd;
    }
    #pragma unroll
    for (int i = 0; i < CHUNK; i += 4) st4(&tT[lane * tp + i], x[i], x[i + 1], x[i + 2], x[i + 3]);
}

// A scan's operands of one chunk (W, Q', K', Aqk in the kernel pair's layout, the block's NCOL
// columns of U, e^{G_CH}), loaded into registers a chunk ahead and stored to shared memory at the
// top of the next round: the loads' latency hides behind the products.
template <int NCOL, int NTHREADS>
struct ChunkOperands {
    static constexpr int N4 = MAX_DIM * CHUNK / 4 / NTHREADS, NA = CHUNK * CHUNK / 4 / NTHREADS,
                         NU = CHUNK * NCOL / NTHREADS;
    float4 w[N4], q[N4], k[N4], a[NA];
    float u[NU], gtot;

    __device__ __forceinline__ void fetch(const float* __restrict__ wt, const float* __restrict__ u_,
                                          const float* __restrict__ qt, const float* __restrict__ kd,
                                          const float* __restrict__ atq,
                                          const float* __restrict__ gt, size_t c, int c0, int dv) {
        const int tid = threadIdx.x;
        const float4* w4 = reinterpret_cast<const float4*>(wt + c * MAX_DIM * CHUNK);
        const float4* q4 = reinterpret_cast<const float4*>(qt + c * MAX_DIM * CHUNK);
        const float4* k4 = reinterpret_cast<const float4*>(kd + c * CHUNK * MAX_DIM);
        const float4* a4 = reinterpret_cast<const float4*>(atq + c * CHUNK * CHUNK);
        #pragma unroll
        for (int j = 0; j < N4; j++) {
            w[j] = w4[tid + j * NTHREADS];
            q[j] = q4[tid + j * NTHREADS];
            k[j] = k4[tid + j * NTHREADS];
        }
        #pragma unroll
        for (int j = 0; j < NA; j++) a[j] = a4[tid + j * NTHREADS];
        #pragma unroll
        for (int j = 0; j < NU; j++) {
            const int e = tid + j * NTHREADS, col = c0 + e % NCOL;
            u[j] = col < dv ? u_[(c * CHUNK + e / NCOL) * dv + col] : 0.f;
        }
        gtot = gt[c];
    }
};

// Shared memory of the preparation kernel, in floats (offsets multiples of 4).
// A and Tmᵀ live in the k̂ᵀ tile, which nothing reads after step 2: 70016 bytes, so three
// blocks fit on an SM instead of two.
#define P_QT 0                          // q̂ᵀ [MAX_DIM][TP]
#define P_KT (P_QT + MAX_DIM * TP)           // k̂ᵀ [MAX_DIM][TP] (steps 1–2)
#define P_A P_KT                        // A [CHUNK][A_P] (steps 2–3)
#define P_TT (P_A + CHUNK * A_P)           // Tmᵀ [CHUNK][TP] (steps 3–4)
#define P_K (P_KT + MAX_DIM * TP)            // k̂ [CHUNK][MAX_DIM]
#define P_V (P_K + CHUNK * MAX_DIM)             // v [CHUNK][MAX_DIM]
#define P_G (P_V + CHUNK * MAX_DIM)             // G, β, β·e^G [CHUNK] each
// PREPARE_SMEM = (P_G + 3 * CHUNK) * 4 = 70016 bytes.

template <typename D>
__device__ void gdrc_prep(const typename D::T* __restrict__ qkv, const float* __restrict__ gb,
                          const unsigned int* __restrict__ lengths, float* __restrict__ wt,
                          float* __restrict__ u, float* __restrict__ qt, float* __restrict__ kd,
                          float* __restrict__ atq, float* __restrict__ gtot, int T, int hk, int hv,
                          int dk, int dv) {
    extern __shared__ __align__(16) float sm[];
    float(*qT)[TP] = reinterpret_cast<float(*)[TP]>(sm + P_QT);
    float(*kT)[TP] = reinterpret_cast<float(*)[TP]>(sm + P_KT);
    float(*kr)[MAX_DIM] = reinterpret_cast<float(*)[MAX_DIM]>(sm + P_K);
    float(*vr)[MAX_DIM] = reinterpret_cast<float(*)[MAX_DIM]>(sm + P_V);
    float(*a)[A_P] = reinterpret_cast<float(*)[A_P]>(sm + P_A);
    float(*tT)[TP] = reinterpret_cast<float(*)[TP]>(sm + P_TT);
    float *g_s = sm + P_G, *beta_s = g_s + CHUNK, *bg_s = beta_s + CHUNK;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int chunk = blockIdx.x, nc = gridDim.x;
    const int bh = blockIdx.y, b = bh / hv, h = bh % hv, kh = h / (hv / hk);
    const int len = lengths ? min((int)lengths[b], T) : T;
    const int t0 = chunk * CHUNK;
    const size_t c = (size_t)bh * nc + chunk;  // this chunk's scratch block

    // 1. q̂, k̂ (both layouts), v, g, β of the chunk's steps.
    load_chunk<D, FMA_THREADS>(qkv, gb, StepTiles{&qT[0][0], &kT[0][0], &kr[0][0], &vr[0][0], g_s, beta_s, bg_s, nullptr, nullptr, TP, MAX_DIM, MAX_DIM, nullptr, nullptr, nullptr, nullptr},
                  T, len, t0, b, h, kh, hk, hv, dk, dv);

    // 2. K̂K̂ᵀ (threads 0–63) and Q̂K̂ᵀ (64–127), a 4×4 tile each → A (shared) and Aqkᵀ (global).
    {
        const int i = tid % 64, ta = 4 * (i / 8), sa = 4 * (i % 8);
        const bool is_k = tid < 64;
        const float(*lhs)[TP] = is_k ? kT : qT;
        float acc[4][4] = {};
        #pragma unroll 4
        for (int r = 0; r < MAX_DIM; r++) {
            outer4(acc, ld4(&lhs[r][ta]), ld4(&kT[r][sa]));
        }
        __syncthreads();  // A overwrites k̂ᵀ
        #pragma unroll
        for (int p = 0; p < 4; p++) {
            #pragma unroll
            for (int q = 0; q < 4; q++) {
                const int t = ta + p, s = sa + q;
                const float decay = s <= t ? expf(g_s[t] - g_s[s]) : 0.f;  // masked before exp
                if (is_k)
                    a[t][s] = s < t ? beta_s[t] * decay * acc[p][q] : 0.f;
                else
                    atq[(c * CHUNK + s) * CHUNK + t] = decay * acc[p][q];
            }
        }
    }
    __syncthreads();

    // 3. Warp 0: Tm = (I + A)⁻¹. The other warps meanwhile write Q'ᵀ and K'.
    if (warp == 0) {
        solve_unit_lower(&a[0][0], &tT[0][0], TP, lane);
    } else {
        const float gc = g_s[CHUNK - 1];
        for (int e = tid - 32; e < MAX_DIM * CHUNK / 4; e += FMA_THREADS - 32) {
            const int r = e / (CHUNK / 4), t = 4 * (e % (CHUNK / 4));
            st4(&qt[(c * MAX_DIM + r) * CHUNK + t], expf(g_s[t]) * qT[r][t], expf(g_s[t + 1]) * qT[r][t + 1],
                expf(g_s[t + 2]) * qT[r][t + 2], expf(g_s[t + 3]) * qT[r][t + 3]);
            const int t2 = e / (MAX_DIM / 4), r2 = 4 * (e % (MAX_DIM / 4));
            const float f = expf(gc - g_s[t2]);
            st4(&kd[(c * CHUNK + t2) * MAX_DIM + r2], f * kr[t2][r2], f * kr[t2][r2 + 1], f * kr[t2][r2 + 2],
                f * kr[t2][r2 + 3]);
        }
        if (tid == 32) gtot[c] = expf(gc);
    }
    __syncthreads();

    // 4. [W | U] = Tm·[diag(β·e^G)·K̂ | diag(β)·V]: a 4×16 tile per thread over 32 × 256 outputs.
    {
        const int ta = 4 * (tid / 16), cg = tid % 16, ca = 16 * cg;
        const bool is_w = cg < 8;
        const float* f = is_w ? bg_s : beta_s;
        float acc[4][16] = {};
        #pragma unroll 2
        for (int s = 0; s < CHUNK; s++) {
            const float4 x = ld4(&tT[s][ta]);
            const float fs = f[s];
            const float* brow = is_w ? &kr[s][ca] : &vr[s][ca - MAX_DIM];
            #pragma unroll
            for (int j4 = 0; j4 < 4; j4++) {
                const float4 y = ld4(brow + 4 * j4);
                #pragma unroll
                for (int p = 0; p < 4; p++) {
                    const float xp = at(x, p) * fs;
                    #pragma unroll
                    for (int q = 0; q < 4; q++) acc[p][4 * j4 + q] += xp * at(y, q);
                }
            }
        }
        if (is_w) {
            #pragma unroll
            for (int q = 0; q < 16; q++)
                st4(&wt[(c * MAX_DIM + ca + q) * CHUNK + ta], acc[0][q], acc[1][q], acc[2][q], acc[3][q]);
        } else {
            #pragma unroll
            for (int p = 0; p < 4; p++)
                #pragma unroll
                for (int q = 0; q < 16; q++) {
                    const int col = ca - MAX_DIM + q;
                    if (col < dv) u[(c * CHUNK + ta + p) * dv + col] = acc[p][q];
                }
        }
    }
}

// Shared memory of the scan kernel, in floats.
#define S_S 0                    // S [MAX_DIM][32] (the block's columns)
#define S_WT (S_S + MAX_DIM * 32)     // Wᵀ [MAX_DIM][CHUNK]
#define S_QT (S_WT + MAX_DIM * CHUNK)    // Q'ᵀ [MAX_DIM][CHUNK]
#define S_K (S_QT + MAX_DIM * CHUNK)     // K' [CHUNK][MAX_DIM]
#define S_AT (S_K + CHUNK * MAX_DIM)     // Aqkᵀ [CHUNK][CHUNK]
#define S_U (S_AT + CHUNK * CHUNK)     // U [CHUNK][32]
#define S_D (S_U + CHUNK * 32)      // Δ [CHUNK][32]
// SCAN_SMEM = (S_D + CHUNK * 32) * 4 = 77824 bytes.

template <typename D>
__device__ void gdrc_scan(const float* __restrict__ wt, const float* __restrict__ u,
                          const float* __restrict__ qt, const float* __restrict__ kd,
                          const float* __restrict__ atq, const float* __restrict__ gtot,
                          float* __restrict__ state, typename D::T* __restrict__ out, int T,
                          int hv, int dk, int dv, int nc) {
    extern __shared__ __align__(16) float sm[];
    float(*s_s)[32] = reinterpret_cast<float(*)[32]>(sm + S_S);
    float(*wt_s)[CHUNK] = reinterpret_cast<float(*)[CHUNK]>(sm + S_WT);
    float(*qt_s)[CHUNK] = reinterpret_cast<float(*)[CHUNK]>(sm + S_QT);
    float(*k_s)[MAX_DIM] = reinterpret_cast<float(*)[MAX_DIM]>(sm + S_K);
    float(*at_s)[CHUNK] = reinterpret_cast<float(*)[CHUNK]>(sm + S_AT);
    float(*u_s)[32] = reinterpret_cast<float(*)[32]>(sm + S_U);
    float(*d_s)[32] = reinterpret_cast<float(*)[32]>(sm + S_D);
    const int tid = threadIdx.x;
    const int bh = blockIdx.y, b = bh / hv, h = bh % hv;
    const int c0 = blockIdx.x * 32;
    // The state tile this thread updates: rows ra..ra+7, columns cs..cs+3 of the block's 32.
    const int ra = 8 * (tid / 8), cs = 4 * (tid % 8);
    // Its 4×4 tile of Δ (threads 0–63) or of Q'·S and O (64–127).
    const int i = tid % 64, ta = 4 * (i / 8), ca = 4 * (i % 8);
    const bool is_delta = tid < 64;
    float* st = state + (size_t)bh * dk * dv;
    float s[8][4];
    #pragma unroll
    for (int p = 0; p < 8; p++)
        #pragma unroll
        for (int q = 0; q < 4; q++) {
            const int r = ra + p, col = c0 + cs + q;
            s[p][q] = r < dk && col < dv ? st[(size_t)r * dv + col] : 0.f;
        }
    typedef ChunkOperands<32, FMA_THREADS> Ops;
    Ops next;  // the next chunk's operands, in flight while this one computes
    next.fetch(wt, u, qt, kd, atq, gtot, (size_t)bh * nc, c0, dv);
    for (int chunk = 0; chunk < nc; chunk++) {
        #pragma unroll
        for (int p = 0; p < 8; p++) st4(&s_s[ra + p][cs], s[p][0], s[p][1], s[p][2], s[p][3]);
        #pragma unroll
        for (int k = 0; k < Ops::N4; k++) {
            reinterpret_cast<float4*>(sm + S_WT)[tid + k * FMA_THREADS] = next.w[k];
            reinterpret_cast<float4*>(sm + S_QT)[tid + k * FMA_THREADS] = next.q[k];
            reinterpret_cast<float4*>(sm + S_K)[tid + k * FMA_THREADS] = next.k[k];
        }
        #pragma unroll
        for (int k = 0; k < Ops::NA; k++) reinterpret_cast<float4*>(sm + S_AT)[tid + k * FMA_THREADS] = next.a[k];
        #pragma unroll
        for (int k = 0; k < Ops::NU; k++) (&u_s[0][0])[tid + k * FMA_THREADS] = next.u[k];
        const float gc = next.gtot;
        __syncthreads();
        if (chunk + 1 < nc) next.fetch(wt, u, qt, kd, atq, gtot, (size_t)bh * nc + chunk + 1, c0, dv);

        // Δ = U − W·S (threads 0–63), P = Q'·S (64–127).
        float acc[4][4] = {};
        {
            const float(*lhs)[CHUNK] = is_delta ? wt_s : qt_s;
            #pragma unroll 4
            for (int r = 0; r < MAX_DIM; r++) {
                outer4(acc, ld4(&lhs[r][ta]), ld4(&s_s[r][ca]));
            }
        }
        if (is_delta) {
            #pragma unroll
            for (int p = 0; p < 4; p++)
                st4(&d_s[ta + p][ca], u_s[ta + p][ca] - acc[p][0], u_s[ta + p][ca + 1] - acc[p][1],
                    u_s[ta + p][ca + 2] - acc[p][2], u_s[ta + p][ca + 3] - acc[p][3]);
        }
        __syncthreads();

        // O = P + Aqk·Δ (threads 64–127), stored.
        if (!is_delta) {
            #pragma unroll 4
            for (int j = 0; j < CHUNK; j++) {
                outer4(acc, ld4(&at_s[j][ta]), ld4(&d_s[j][ca]));
            }
            #pragma unroll
            for (int p = 0; p < 4; p++) {
                const int tt = chunk * CHUNK + ta + p;
                if (tt >= T) break;
                typename D::T* o = out + (((size_t)b * T + tt) * hv + h) * dv;
                #pragma unroll
                for (int q = 0; q < 4; q++)
                    if (c0 + ca + q < dv) D::store(o + c0 + ca + q, acc[p][q]);
            }
        }
        // S ← e^{G_CH}·S + K'ᵀ·Δ on this thread's tile.
        #pragma unroll
        for (int p = 0; p < 8; p++)
            #pragma unroll
            for (int q = 0; q < 4; q++) s[p][q] *= gc;
        #pragma unroll 4
        for (int t = 0; t < CHUNK; t++) {
            const float4 k0 = ld4(&k_s[t][ra]), k1 = ld4(&k_s[t][ra + 4]), d = ld4(&d_s[t][cs]);
            #pragma unroll
            for (int p = 0; p < 4; p++)
                #pragma unroll
                for (int q = 0; q < 4; q++) {
                    s[p][q] += at(k0, p) * at(d, q);
                    s[p + 4][q] += at(k1, p) * at(d, q);
                }
        }
        __syncthreads();  // everything of this chunk in shared memory is consumed
    }
    #pragma unroll
    for (int p = 0; p < 8; p++)
        #pragma unroll
        for (int q = 0; q < 4; q++) {
            const int r = ra + p, col = c0 + cs + q;
            if (r < dk && col < dv) st[(size_t)r * dv + col] = s[p][q];
        }
}

#if __CUDA_ARCH__ >= 800  // mma.sync on TF32 and bf16 (compiled for compute_80 where the GPU has it)
// ---- Tensor-core kernels (bf16 and f16 models) ----
// The same two kernels with every product a warp-wide mma.sync (f32 accumulate). The FMA forms
// above issue thousands of instructions per thread and chunk at low occupancy and are bound by
// their latency (ncu, 4B heads: prep 0.45 ms and scan 0.71 ms for 4096 steps). The preparation
// multiplies q and k as loaded in their 16-bit dtype (m16n8k8, mma_qk: exact products) and W, U
// on TF32 operands (m16n8k8, mma8): its products build the triangular solve's inputs. The scan
// multiplies bf16 operands (m16n8k16, mma16 in mma.cuh): half the bytes and instructions of TF32, the
// rounding flash-linear-attention's chunked kernels apply; its state is accumulated in f32 (the
// mma's C operand), so the rounding does not compound across chunks. f32 models keep the FMA
// kernels (full f32 products).
// The preparation's scalar fragment loads read shared memory at pitches that put the 32 lanes in
// 32 different banks: ≡ 8 (mod 32) for tiles read along their rows' index, ≡ 4 across it.
// Scratch layout: each scan operand with k along its rows, as ldmatrix reads it (ldsm4 in mma.cuh), in
// bf16: W and Q' by rows (wt, qt [c][CHUNK][128]: the A operands of W·S and Q'·S), K'ᵀ (kd
// [c][128][CHUNK]: the A operand of the state update), Aqk by rows (at [c][CHUNK][CHUNK], the A operand
// of Aqk·Δ); U by rows, in bf16 too (as flash-linear-attention keeps it: the scan rounds
// Δ = U − W·S to bf16 anyway). e^{G_CH} in f32.

__device__ __forceinline__ float tf32r(float x) {
    unsigned r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return __uint_as_float(r);
}
// An operand element: already rounded to TF32 in shared memory (R = false) or rounded here.
template <bool R>
__device__ __forceinline__ unsigned tf(float x) {
    return __float_as_uint(R ? tf32r(x) : x);
}
// d += a·b for one 16×8 tile over k = 8 (fragments as in the PTX ISA's m16n8k8 .tf32 layout;
// lane (g, c) = (lane / 4, lane % 4)).
__device__ __forceinline__ void mma8(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
// The B fragment (rows k0.., columns n0..) of a matrix stored by rows (x[k][n], pitch ≡ 8).
template <bool R>
__device__ __forceinline__ void frag_b(unsigned (&b)[2], const float* x, int p, int k0, int n0,
                                       int g, int c) {
    b[0] = tf<R>(x[(k0 + c) * p + n0 + g]);
    b[1] = tf<R>(x[(k0 + c + 4) * p + n0 + g]);
}
// d += a·b for one 16×8 tile over k = 8 on 16-bit operands of dtype D (bf16 or f16; PTX ISA
// m16n8k8 fragments: a0 row g, a1 row g + 8, each k 2c, 2c + 1; b0 k 2c, 2c + 1 of column g).
template <typename D>
struct Is16;  // whether the 16-bit dtype D is bf16 (else f16): the mma's operand type
template <>
struct Is16<BF16> { static constexpr bool BF = true; };
template <>
struct Is16<F16> { static constexpr bool BF = false; };
template <typename D>
__device__ __forceinline__ void mma8h(float (&d)[4], unsigned a0, unsigned a1, unsigned b0) {
    if constexpr (Is16<D>::BF)
        asm("mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, "
            "{%0,%1,%2,%3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a0), "r"(a1), "r"(b0));
    else
        asm("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, "
            "{%0,%1,%2,%3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a0), "r"(a1), "r"(b0));
}
// acc[n] += Σ_r x[r][m0 + i]·y[r][n0 + 8n + j] over the MAX_DIM features r (i < 16, j < 8, n < 2):
// a warp's 16 × 16 block of XᵀY for the preparation's qᵀ and kᵀ tiles (16-bit as loaded, pitch
// p ≡ 16 (mod 128) bytes, swizzled: swz). Products of 16-bit values are exact in f32.
// ldmatrix.trans hands lane (g, c) features 2c, 2c + 1 of the step at position g of an 8 × 8
// tile, which is the m16n8k8 fragment; but swz puts step t at position t ^ S in a feature
// block whose S = swz(r, 0) is one of 4 values, so the mma's rows and columns are those
// positions. Blocks of one S go to one accumulator, which is then moved by shuffles to
// the lanes of the steps it holds and added.
template <typename D>
__device__ __forceinline__ void mma_qk(float (&acc)[2][4], const unsigned short* x,
                                       const unsigned short* y, int p, int m0, int n0, int lane) {
    static_assert(MAX_DIM % 64 == 0, "feature blocks in groups of 4 S values, 2 a load");
    const int g = lane / 4, c = lane % 4;
    // Tiles of a load: lanes 8i.. address tile i = (block +0 / +4, steps +0 / +8).
    const int row = (lane & 7) + 32 * (lane >> 4), col = 8 * ((lane >> 3) & 1);
    const unsigned short* xa = x + row * p + m0 + col;
    const unsigned short* yb = y + row * p + n0 + col;
    #pragma unroll 1
    for (int s = 0; s < 4; s++) {  // blocks s, s + 4, ...: rows 8s.. of each 32
        float part[2][4] = {};
        #pragma unroll
        for (int b = 8 * s; b < MAX_DIM; b += 64) {
            unsigned a[4], bf[4];
            ldsm4t(a, xa + b * p);   // block b: a[0], a[1]; block b + 32: a[2], a[3]
            ldsm4t(bf, yb + b * p);  // block b: n-tiles 0, 1; block b + 32: n-tiles 0, 1
            mma8h<D>(part[0], a[0], a[1], bf[0]);
            mma8h<D>(part[1], a[0], a[1], bf[1]);
            mma8h<D>(part[0], a[2], a[3], bf[2]);
            mma8h<D>(part[1], a[2], a[3], bf[3]);
        }
        // The lane holding steps (g, 2c) at positions (g ^ S, 2c ^ S), S = 2s.
        const int src = 4 * (g ^ (2 * s)) + (c ^ s);
        #pragma unroll
        for (int n = 0; n < 2; n++)
            #pragma unroll
            for (int i = 0; i < 4; i++) acc[n][i] += __shfl_sync(0xffffffffu, part[n][i], src);
    }
}

// Shared memory of the tensor-core preparation kernel, in floats. q and k stay 16-bit as loaded
// (their l2 norms are per-step factors applied to the products), half the bytes of f32 q̂ᵀ and
// k̂ᵀ: 48512 bytes, four blocks per multiprocessor instead of three (68736 bytes with f32 tiles;
// 64 registers a thread allow four).
#define PT_P16 40                        // pitch of qᵀ, kᵀ [MAX_DIM][..] (16-bit elements)
#define PT_P 40                          // pitch of Tmᵀ [CHUNK][..]
#define PT_VP 136                        // pitch of v [CHUNK][..]
#define PT_QT 0                          // qᵀ (16-bit)
#define PT_KT (PT_QT + MAX_DIM * PT_P16 / 2)  // kᵀ (16-bit)
#define PT_A (PT_KT + MAX_DIM * PT_P16 / 2)   // A [CHUNK][A_P]
#define PT_TT (PT_A + CHUNK * A_P)          // Tmᵀ
#define PT_V (PT_TT + CHUNK * PT_P)         // v
#define PT_G (PT_V + CHUNK * PT_VP)         // G, β, β·e^G, e^G, e^{G_CH−G}, q's and k's norm
                                         // factors [CHUNK] each
#define PT_WS 132                        // pitch of W [CHUNK][..] on its way out in v's tile
#define PT_QS 136                        // pitch of Q' [CHUNK][..] (bf16) on its way out in kᵀ's
                                         // tile (68 words: a store's 4·t + c banks are distinct)
// PREPARE_MMA_SMEM = (PT_G + 7 * CHUNK) * 4 = 48512 bytes.

// MMA_THREADS (8 warps) per block; the products split as 16 × 16 (step 2) and 32 × 32 (step 4)
// tiles per warp. The block prepares chunk `chunk` of (row · head) `bh` into scratch block `cb`.
// CONV: `qkv` holds the raw rows `cv` describes, and step 1 runs the conv on them.
template <typename D, bool CONV = false>
__device__ void gdrc_prep_tc_at(const typename D::T* __restrict__ qkv, ConvIn<D> cv,
                                const float* __restrict__ gb,
                                const unsigned int* __restrict__ lengths, float* __restrict__ wt,
                                float* __restrict__ u, float* __restrict__ qt,
                                float* __restrict__ kd, float* __restrict__ atq,
                                float* __restrict__ gtot, int T, int hk, int hv, int dk, int dv,
                                int chunk, int bh, size_t cb) {
    extern __shared__ __align__(16) float sm[];
    unsigned short* qT = reinterpret_cast<unsigned short*>(sm + PT_QT);
    unsigned short* kT = reinterpret_cast<unsigned short*>(sm + PT_KT);
    float *vr = sm + PT_V, *a_s = sm + PT_A, *tT = sm + PT_TT;
    float *g_s = sm + PT_G, *beta_s = g_s + CHUNK, *bg_s = beta_s + CHUNK, *eg_s = bg_s + CHUNK;
    float *egc_s = eg_s + CHUNK, *qn_s = egc_s + CHUNK, *kn_s = qn_s + CHUNK;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, c = lane % 4;
    const int b = bh / hv, h = bh % hv, kh = h / (hv / hk);
    const int len = lengths ? min((int)lengths[b], T) : T;
    const int t0 = chunk * CHUNK;
    // A chunk wholly past the row's length: the scan stops before it (gdrc_scan_tc).
    if (t0 >= len) return;
    // The scan's operands, bf16 in the f32 scratch's parts (half of each part's floats).
    bf16_t *w16 = reinterpret_cast<bf16_t*>(wt), *q16 = reinterpret_cast<bf16_t*>(qt);
    bf16_t *k16 = reinterpret_cast<bf16_t*>(kd), *a16 = reinterpret_cast<bf16_t*>(atq);

    // 1. qᵀ, kᵀ (16-bit) and their norms' factors, v, g, β of the chunk's steps.
    const StepTiles tiles{nullptr, nullptr, nullptr, vr,     g_s, beta_s, bg_s, eg_s,
                          egc_s,   PT_P16,  0,       PT_VP, qT,  kT,     qn_s, kn_s};
    if constexpr (CONV)
        load_chunk_conv<D>(qkv, cv, gb, tiles, T, len, t0, b, h, kh, hk, hv, dk, dv);
    else
        load_chunk<D, MMA_THREADS, 1>(qkv, gb, tiles, T, len, t0, b, h, kh, hk, hv, dk, dv);

    // 2. K̂K̂ᵀ (warps 0–3) and Q̂K̂ᵀ (warps 4–7), 16 steps × 16 each → A (shared), Aqk (global):
    //    KKᵀ and QKᵀ of the loaded q, k, then the steps' norm factors.
    {
        const bool is_k = warp < 4;
        const int mt = 16 * (warp % 2), nt = 16 * ((warp / 2) % 2);
        const float* lhs_n = is_k ? kn_s : qn_s;
        float acc[2][4] = {};
        mma_qk<D>(acc, is_k ? kT : qT, kT, PT_P16, mt, nt, lane);
        #pragma unroll
        for (int n = 0; n < 2; n++)
            #pragma unroll
            for (int i = 0; i < 4; i++) {
                const int t = mt + g + 8 * (i / 2), s = nt + 8 * n + 2 * c + i % 2;
                const float decay = s <= t ? expf(g_s[t] - g_s[s]) : 0.f;  // masked before exp
                const float dot = lhs_n[t] * kn_s[s] * acc[n][i];
                if (is_k)
                    a_s[t * A_P + s] = s < t ? beta_s[t] * decay * dot : 0.f;
                else
                    acc[n][i] = decay * dot;
            }
        if (!is_k)  // Aqk by rows, a word per pair of steps s, s + 1
            #pragma unroll
            for (int n = 0; n < 2; n++)
                #pragma unroll
                for (int hf = 0; hf < 2; hf++) {
                    const int t = mt + g + 8 * hf, s = nt + 8 * n + 2 * c;
                    *reinterpret_cast<unsigned*>(&a16[(cb * CHUNK + t) * CHUNK + s]) =
                        bf16x2(acc[n][2 * hf], acc[n][2 * hf + 1]);
                }
    }
    __syncthreads();

    // 3. Warp 0: Tm = (I + A)⁻¹. The other warps write K'ᵀ, a row of kᵀ per warp and a step per
    //    lane; warp 1 first folds k's norm factor into W's row factor β·e^G.
    if (warp == 0) {
        solve_unit_lower(a_s, tT, PT_P, lane);
    } else {
        // A half warp per row and a lane per pair of steps (swz keeps pairs side by side).
        const int t = 2 * (lane % 16);
        const float kf0 = egc_s[t] * kn_s[t], kf1 = egc_s[t + 1] * kn_s[t + 1];
        if (warp == 1) bg_s[lane] *= kn_s[lane];
        for (int r = 2 * (warp - 1) + lane / 16; r < MAX_DIM; r += 2 * (MMA_THREADS / 32 - 1)) {
            const uint2 pair = make_uint2(*reinterpret_cast<const unsigned*>(&kT[r * PT_P16 + swz(r, t)]), 0u);
            *reinterpret_cast<unsigned*>(&k16[(cb * MAX_DIM + r) * CHUNK + t]) =
                bf16x2(kf0 * unpack4<D>(pair, 0), kf1 * unpack4<D>(pair, 1));
        }
        if (tid == 32) gtot[cb] = expf(g_s[CHUNK - 1]);
    }
    __syncthreads();

    // 4. [W | U] = Tm·[diag(β·e^G)·K̂ | diag(β)·V]: warps 0–3 W's columns 32·warp.., warps 4–7
    //    U's columns 32·(warp − 4).., all 32 steps; the row factor (for W with k's norm factor,
    //    step 3) is folded into Tm's fragment.
    //    W and Q' (rows of 128) go out through shared memory, so that a warp writes whole rows:
    //    written from the fragments or a column of q̂ᵀ, 4- to 16-byte pieces land in parts of
    //    32-byte sectors of many rows, and the kernel takes twice as long (ncu).
    {
        const bool is_w = warp < 4;
        const int c0 = 32 * (warp % 4);
        const float* f = is_w ? bg_s : beta_s;
        float acc[2][4][4] = {};
        #pragma unroll
        for (int k0 = 0; k0 < CHUNK; k0 += 8) {
            const float f0 = f[k0 + c], f1 = f[k0 + c + 4];
            unsigned a[2][4];
            #pragma unroll
            for (int mi = 0; mi < 2; mi++) {
                const int m = 16 * mi + g;
                a[mi][0] = tf<true>(tT[(k0 + c) * PT_P + m] * f0);
                a[mi][1] = tf<true>(tT[(k0 + c) * PT_P + m + 8] * f0);
                a[mi][2] = tf<true>(tT[(k0 + c + 4) * PT_P + m] * f1);
                a[mi][3] = tf<true>(tT[(k0 + c + 4) * PT_P + m + 8] * f1);
            }
            #pragma unroll
            for (int n = 0; n < 4; n++) {
                unsigned bf[2];
                if (is_w) {  // kᵀ's rows c0 + 8n.., swizzled
                    const int r = c0 + 8 * n + g;
                    bf[0] = tf<false>(D::load(&kT[r * PT_P16 + swz(r, k0 + c)]));
                    bf[1] = tf<false>(D::load(&kT[r * PT_P16 + swz(r, k0 + c + 4)]));
                } else
                    frag_b<true>(bf, vr, PT_VP, k0, c0 + 8 * n, g, c);
                #pragma unroll
                for (int mi = 0; mi < 2; mi++) mma8(acc[mi][n], a[mi], bf);
            }
        }
        __syncthreads();  // kᵀ, A, Tmᵀ and v are consumed: they hold W and Q' on their way out
        float* w_st = vr;
        bf16_t* q_st = reinterpret_cast<bf16_t*>(sm + PT_KT);
        // U goes straight out in bf16, a pair of columns per store.
        const bool pairs = dv % 2 == 0;
        bf16_t* u16 = reinterpret_cast<bf16_t*>(u);
        #pragma unroll
        for (int mi = 0; mi < 2; mi++)
            #pragma unroll
            for (int n = 0; n < 4; n++)
                #pragma unroll
                for (int i = 0; i < 4; i += 2) {
                    const int t = 16 * mi + g + 8 * (i / 2), col = c0 + 8 * n + 2 * c;
                    const float v0 = acc[mi][n][i], v1 = acc[mi][n][i + 1];
                    bf16_t* ur = u16 + (cb * CHUNK + t) * dv;
                    if (is_w) {
                        w_st[t * PT_WS + col] = v0;
                        w_st[t * PT_WS + col + 1] = v1;
                    } else if (pairs && col < dv) {
                        *reinterpret_cast<unsigned*>(ur + col) = bf16x2(v0, v1);
                    } else if (!pairs) {
                        if (col < dv) ur[col] = bf16r(v0);
                        if (col + 1 < dv) ur[col + 1] = bf16r(v1);
                    }
                }
        // Q' = diag(e^G)·Q̂, transposed from qᵀ by ldmatrix.trans: each of qᵀ's 64 tiles of 8
        // features × 8 steps (16 bytes of a row: swz permutes steps only within them) gives lane
        // (g, c) features 2c, 2c + 1 of the tile's step at position g; a word per pair to q_st.
        constexpr int Q_LOADS = MAX_DIM / 8 / (MMA_THREADS / 32);  // feature blocks a warp
        #pragma unroll
        for (int k = 0; k < Q_LOADS; k++) {
            const int r0 = 8 * (Q_LOADS * warp + k);  // 4 tiles: features r0.., each step block
            unsigned v[4];
            ldsm4t(v, qT + (r0 + (lane & 7)) * PT_P16 + 8 * (lane >> 3));
            #pragma unroll
            for (int m = 0; m < 4; m++) {
                const int t = swz(r0, 8 * m + g);
                const float f = eg_s[t] * qn_s[t];
                const uint2 pair = make_uint2(v[m], 0u);
                *reinterpret_cast<unsigned*>(&q_st[t * PT_QS + r0 + 2 * c]) =
                    bf16x2(f * unpack4<D>(pair, 0), f * unpack4<D>(pair, 1));
            }
        }
        __syncthreads();
        for (int e = tid; e < CHUNK * MAX_DIM / 8; e += MMA_THREADS) {  // 8 bf16 (16 bytes) a thread
            const int t = e / (MAX_DIM / 8), r = 8 * (e % (MAX_DIM / 8));
            const float4 lo = ld4(&w_st[t * PT_WS + r]), hi = ld4(&w_st[t * PT_WS + r + 4]);
            *reinterpret_cast<uint4*>(&w16[(cb * CHUNK + t) * MAX_DIM + r]) =
                make_uint4(bf16x2(lo.x, lo.y), bf16x2(lo.z, lo.w), bf16x2(hi.x, hi.y),
                           bf16x2(hi.z, hi.w));
        }
        for (int e = tid; e < CHUNK * MAX_DIM / 8; e += MMA_THREADS) {  // 8 bf16 a thread
            const int t = e / (MAX_DIM / 8), r = 8 * (e % (MAX_DIM / 8));
            *reinterpret_cast<uint4*>(&q16[(cb * CHUNK + t) * MAX_DIM + r]) =
                *reinterpret_cast<const uint4*>(&q_st[t * PT_QS + r]);
        }
    }
}

// One block per chunk (grid.x) and (row · head) (grid.y).
template <typename D>
__device__ void gdrc_prep_tc(const typename D::T* __restrict__ qkv, const float* __restrict__ gb,
                             const unsigned int* __restrict__ lengths, float* __restrict__ wt,
                             float* __restrict__ u, float* __restrict__ qt, float* __restrict__ kd,
                             float* __restrict__ atq, float* __restrict__ gtot, int T, int hk,
                             int hv, int dk, int dv) {
    gdrc_prep_tc_at<D>(qkv, ConvIn<D>{}, gb, lengths, wt, u, qt, kd, atq, gtot, T, hk, hv, dk, dv,
                       blockIdx.x, blockIdx.y, (size_t)blockIdx.y * gridDim.x + blockIdx.x);
}

// Two calls' chunks in one grid (gdrc_prep2_tc_<dtype>): the records' state rows (a: nc_a chunks of
// each of their bh_a row·heads, padded past len_a) and their branch rows (b: nc_b chunks each,
// padded past len_b). They do not depend on each other, and one launch fills the GPU where the
// states alone leave it half idle. Linear block i is scratch block i: the state's blocks first, so the
// branches' scan reads its operands from scratch block nc_a·bh_a on.
// CONV (gdrc_prep2c_tc_<dtype>): the parts are raw in_proj rows at row pitches `pitch_a`, `pitch_b`,
// run through the conv with weight `w` first (ConvIn); the branches' windows start in their
// owners' rows.
template <typename D, bool CONV = false>
__device__ void gdrc_prep2_tc(const typename D::T* qkv_a, const float* gb_a,
                              const unsigned int* len_a, int t_a, int nc_a, int bh_a,
                              const typename D::T* qkv_b, const float* gb_b,
                              const unsigned int* len_b, int t_b, int nc_b, float* wt, float* u,
                              float* qt, float* kd, float* atq, float* gtot, int hk, int hv,
                              int dk, int dv, const unsigned int* owners = nullptr,
                              const typename D::T* w = nullptr, long pitch_a = 0,
                              long pitch_b = 0) {
    // The part's arguments are selected and the body called once: a call per part inlines the
    // body twice, and a short call (one request) then stalls on instruction fetch (ncu).
    const int i = blockIdx.x, na = nc_a * bh_a;
    const bool st = i < na;
    const int j = st ? i : i - na, nc = st ? nc_a : nc_b;
    // Built field by field: a struct selected whole loses its pointers' global address space,
    // and their loads become generic ones.
    const ConvIn<D> cv{w, st ? pitch_a : pitch_b, st ? nullptr : qkv_a, pitch_a,
                       st ? nullptr : owners, st ? nullptr : len_a, st ? 0 : t_a};
    gdrc_prep_tc_at<D, CONV>(st ? qkv_a : qkv_b, cv, st ? gb_a : gb_b, st ? len_a : len_b, wt, u,
                             qt, kd, atq, gtot, st ? t_a : t_b, hk, hv, dk, dv, j % nc, j / nc, i);
}

// The scan's tensor-core blocks (bf16/f16 models): NCOL (16, 32 or 64) state columns per block of
// 8 warps (bf16 operands, f32 state: see above). One chunk's operands arrive by cp.async into one
// of two buffers while the previous chunk computes (no registers held for them, so 64 columns fit
// in two blocks per multiprocessor: a batch's states then take one wave instead of two). S and Δ are kept by rows in bf16 (pairs
// stored as one word, no bank shared) and read as B operands by ldmatrix.trans; O goes out
// through shared memory as 16-byte rows.
#define TB_LP 136  // W, Q' [CHUNK][..]: rows of MAX_DIM (bf16 elements; ≡ 16 mod 128 bytes for ldmatrix)
#define TB_CP 40   // K'ᵀ [MAX_DIM][..], Aqk [CHUNK][..]: rows of CHUNK (bf16 elements)
template <int NCOL>
struct ScanTc {  // shared memory, in bytes
    static constexpr int SP = NCOL + 8;  // S [MAX_DIM][..], Δ and U [CHUNK][..] (bf16): rows of NCOL
    static constexpr int UP = NCOL + 4;  // O [CHUNK][..] (f32)
    // One chunk's operands (one buffer): W, Q', K'ᵀ, Aqk, U.
    static constexpr int W = 0, Q = W + CHUNK * TB_LP * 2, K = Q + CHUNK * TB_LP * 2;
    static constexpr int A = K + MAX_DIM * TB_CP * 2, U = A + CHUNK * TB_CP * 2, BUF = U + CHUNK * SP * 2;
    static constexpr int S = 2 * BUF, DLT = S + MAX_DIM * SP * 2, O = DLT + CHUNK * SP * 2;  // S, Δ, O
    static constexpr int BYTES = O + CHUNK * UP * 4;
};

// acc[n] += X[m0..m0+15, 0..K)·Y[0..K, n0 + 8n ..) for n < NT (1 or even): X by rows (x[m][k],
// ldmatrix), Y by rows too (y[k][n]: its B fragments by ldmatrix.trans), both bf16; a warp's
// 16 × 8·NT product, fully unrolled. One n-tile alternates its k-steps between two accumulators
// (added at the end): two chains of dependent mmas, as two n-tiles give.
template <int K, int NT>
__device__ __forceinline__ void mma_kn(float (&acc)[NT][4], const bf16_t* x, int xp, int m0,
                                       const bf16_t* y, int yp, int n0, int lane) {
    static_assert(NT == 1 || NT % 2 == 0, "one n-tile or pairs");
    const bf16_t* xa = ldsm_a(x, xp, m0, lane);
    if constexpr (NT == 1) {
        static_assert(K % 32 == 0, "two k-steps a load");
        const bf16_t* yb = y + ((lane & 7) + 8 * (lane >> 3)) * yp + n0;  // tiles k +0, 8, 16, 24
        float odd[4] = {};
        #pragma unroll
        for (int k0 = 0; k0 < K; k0 += 32) {
            unsigned a0[4], a1[4], b[4];
            ldsm4(a0, xa + k0);
            ldsm4(a1, xa + k0 + 16);
            ldsm4t(b, yb + k0 * yp);
            mma16(acc[0], a0, {b[0], b[1]});
            mma16(odd, a1, {b[2], b[3]});
        }
        #pragma unroll
        for (int i = 0; i < 4; i++) acc[0][i] += odd[i];
    } else {
        // Tiles k +0/+8 of n-tile n, then of n-tile n + 1.
        const bf16_t* yb = y + ((lane & 7) + 8 * ((lane >> 3) & 1)) * yp + n0 + 8 * (lane >> 4);
        #pragma unroll
        for (int k0 = 0; k0 < K; k0 += 16) {
            unsigned a[4];
            ldsm4(a, xa + k0);
            #pragma unroll
            for (int n = 0; n < NT; n += 2) {
                unsigned b[4];
                ldsm4t(b, yb + k0 * yp + 8 * n);
                mma16(acc[n], a, {b[0], b[1]});
                mma16(acc[n + 1], a, {b[2], b[3]});
            }
        }
    }
}

// Chunk `c`'s operands (scratch block c) into the buffer at `buf`, as one cp.async group: W, Q'
// by rows and K'ᵀ, Aqk in bf16 as the preparation lays them out, the block's NCOL columns of U
// (zeros past Dv; element by element where Dv rows are not 16-byte aligned).
template <int NCOL>
__device__ __forceinline__ void scan_tc_fetch(unsigned char* buf, const bf16_t* __restrict__ wt,
                                              const bf16_t* __restrict__ u,
                                              const bf16_t* __restrict__ qt,
                                              const bf16_t* __restrict__ kd,
                                              const bf16_t* __restrict__ atq, size_t c, int c0,
                                              int dv) {
    typedef ScanTc<NCOL> L;
    const int tid = threadIdx.x;
    #pragma unroll
    for (int e = tid; e < CHUNK * MAX_DIM / 8; e += MMA_THREADS) {  // 16-byte pieces
        const int t = e / (MAX_DIM / 8), p = 8 * (e % (MAX_DIM / 8));
        cp_async16(buf + L::W + (t * TB_LP + p) * 2, wt + (c * CHUNK + t) * MAX_DIM + p, 16);
        cp_async16(buf + L::Q + (t * TB_LP + p) * 2, qt + (c * CHUNK + t) * MAX_DIM + p, 16);
        const int r = e / (CHUNK / 8), q = 8 * (e % (CHUNK / 8));
        cp_async16(buf + L::K + (r * TB_CP + q) * 2, kd + (c * MAX_DIM + r) * CHUNK + q, 16);
    }
    if (tid < CHUNK * CHUNK / 8) {
        const int t = tid / (CHUNK / 8), q = 8 * (tid % (CHUNK / 8));
        cp_async16(buf + L::A + (t * TB_CP + q) * 2, atq + (c * CHUNK + t) * CHUNK + q, 16);
    }
    bf16_t* u_s = reinterpret_cast<bf16_t*>(buf + L::U);
    if (dv % 8 == 0) {
        #pragma unroll
        for (int e = tid; e < CHUNK * NCOL / 8; e += MMA_THREADS) {
            const int t = e / (NCOL / 8), col = 8 * (e % (NCOL / 8));
            const bool in = c0 + col < dv;
            cp_async16(u_s + t * L::SP + col, in ? u + (c * CHUNK + t) * dv + c0 + col : u, in ? 16 : 0);
        }
    } else {
        for (int e = tid; e < CHUNK * NCOL; e += MMA_THREADS) {
            const int t = e / NCOL, col = e % NCOL;
            u_s[t * L::SP + col] = c0 + col < dv ? u[(c * CHUNK + t) * dv + c0 + col] : 0;
        }
    }
    cp_async_commit();
}

// Chunk `chunk`'s O, staged in shared memory (o_s [CHUNK][UP] f32), to its rows of `out`: 8
// columns (16 bytes) a piece where Dv rows allow.
template <typename D, int NCOL>
__device__ __forceinline__ void scan_tc_out(const float* o_s, typename D::T* __restrict__ out,
                                            int chunk, int b, int h, int T, int hv, int dv,
                                            int c0) {
    typedef ScanTc<NCOL> L;
    for (int e = threadIdx.x; e < CHUNK * NCOL / 8; e += MMA_THREADS) {
        const int t = e / (NCOL / 8), col = 8 * (e % (NCOL / 8));
        const int tt = chunk * CHUNK + t, gc = c0 + col;
        if (tt >= T || gc >= dv) continue;
        const float4 lo = *reinterpret_cast<const float4*>(o_s + t * L::UP + col);
        const float4 hi = *reinterpret_cast<const float4*>(o_s + t * L::UP + col + 4);
        const float v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
        typename D::T* o = out + (((size_t)b * T + tt) * hv + h) * dv + gc;
        if (dv % 8 == 0) {
            Vec16<D>::store(o, v);
        } else {
            for (int j = 0; j < 8 && gc + j < dv; j++) D::store(o + j, v[j]);
        }
    }
}

// One block of MMA_THREADS per NCOL state columns. Warp w of 8, with h = (w / 2) % 2 the half of
// the block's columns it takes: Δ = U − W·S for steps 16·(w % 2).. (w < 4) or P = Q'·S for those
// steps (w ≥ 4); then O = P + Aqk·Δ (w ≥ 4); then S[16w..16w+15, :] += K'ᵀ·Δ on all the block's
// columns, S held in mma accumulators (f32). Fewer columns per block give a call with few
// (row, head) pairs (a long state) more blocks, at the price of reading each chunk's W, Q', K',
// Aqk more often. S and Δ are rounded to bf16 as they are stored to shared memory.
// `mode` (SCAN_*): whether the state is read first (else it starts at zero), written at the end,
// and shared between rows (head h of row b reads row owners[b]'s, row 0's if owners is null:
// branches continuing their records' states, none of them writing it back): SCAN_READ,
// SCAN_WRITE, SCAN_SHARED. `lengths` (null: every row nc_all chunks) ends each row's walk at its
// last real chunk.
template <typename D, int NCOL = 32>
__device__ void gdrc_scan_tc(const float* __restrict__ wt_, const float* __restrict__ u_,
                             const float* __restrict__ qt_, const float* __restrict__ kd_,
                             const float* __restrict__ atq_, const float* __restrict__ gtot,
                             float* __restrict__ state, const unsigned int* __restrict__ owners,
                             const unsigned int* __restrict__ lengths,
                             typename D::T* __restrict__ out, int T, int hv, int dk, int dv,
                             int nc_all, int mode) {
    typedef ScanTc<NCOL> L;
    extern __shared__ __align__(16) unsigned char smb[];
    bf16_t* s_s = reinterpret_cast<bf16_t*>(smb + L::S);
    bf16_t* d_s = reinterpret_cast<bf16_t*>(smb + L::DLT);
    float* o_s = reinterpret_cast<float*>(smb + L::O);
    const bf16_t *wt = reinterpret_cast<const bf16_t*>(wt_), *qt = reinterpret_cast<const bf16_t*>(qt_);
    const bf16_t *kd = reinterpret_cast<const bf16_t*>(kd_), *atq = reinterpret_cast<const bf16_t*>(atq_);
    const bf16_t* u = reinterpret_cast<const bf16_t*>(u_);
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, c = lane % 4;
    const int bh = blockIdx.y, b = bh / hv, h = bh % hv;
    // The row's own chunks: those past its length are padding, identity steps the preparation
    // skipped; their output is zero (below), the state after them the state before.
    const int nc = lengths ? min(nc_all, (min((int)lengths[b], T) + CHUNK - 1) / CHUNK) : nc_all;
    constexpr int NS = NCOL / 8;   // n-tiles of the block's columns (the state update)
    constexpr int NH = NCOL / 16;  // n-tiles of this warp's half (Δ, P, O)
    const int c0 = blockIdx.x * NCOL;
    const bool is_delta = warp < 4;
    const int mt = 16 * (warp % 2);                // the steps of this warp's Δ or P rows
    const int ch = (NCOL / 2) * ((warp / 2) % 2);  // its half of the block's columns
    const int rs = 16 * warp;                      // its rows of S
    const int row = mode & SCAN_SHARED ? (owners ? (int)owners[b] : 0) : b;
    float* st = state + ((size_t)row * hv + h) * dk * dv;
    const size_t first = (size_t)bh * nc_all;  // this (row, head)'s first scratch block
    if (nc > 0) scan_tc_fetch<NCOL>(smb, wt, u, qt, kd, atq, first, c0, dv);
    // S rows rs + g (+8), columns 8·n + 2c (+1): accumulator element i of [n].
    float s[NS][4];
    #pragma unroll
    for (int n = 0; n < NS; n++)
        #pragma unroll
        for (int i = 0; i < 4; i++) {
            const int r = rs + g + 8 * (i / 2), col = c0 + 8 * n + 2 * c + i % 2;
            s[n][i] = (mode & SCAN_READ) && r < dk && col < dv ? st[(size_t)r * dv + col] : 0.f;
        }
    // The bf16 copy of S, the B operand of W·S and Q'·S: a word per pair of columns.
    auto store_s = [&]() {
        #pragma unroll
        for (int n = 0; n < NS; n++)
            #pragma unroll
            for (int hf = 0; hf < 2; hf++)
                *reinterpret_cast<unsigned*>(&s_s[(rs + g + 8 * hf) * L::SP + 8 * n + 2 * c]) =
                    bf16x2(s[n][2 * hf], s[n][2 * hf + 1]);
    };
    store_s();
    for (int chunk = 0; chunk < nc; chunk++) {
        const unsigned char* buf = smb + (chunk % 2) * L::BUF;
        const bf16_t* w_s = reinterpret_cast<const bf16_t*>(buf + L::W);
        const bf16_t* q_s = reinterpret_cast<const bf16_t*>(buf + L::Q);
        const bf16_t* k_s = reinterpret_cast<const bf16_t*>(buf + L::K);
        const bf16_t* a_s = reinterpret_cast<const bf16_t*>(buf + L::A);
        const bf16_t* u_s = reinterpret_cast<const bf16_t*>(buf + L::U);
        cp_async_wait<0>();
        __syncthreads();  // this chunk's operands, S and the last chunk's O are in shared memory
        // The next chunk's operands into the other buffer (last read in the previous round).
        if (chunk + 1 < nc)
            scan_tc_fetch<NCOL>(smb + ((chunk + 1) % 2) * L::BUF, wt, u, qt, kd, atq,
                                first + chunk + 1, c0, dv);
        if (chunk > 0) scan_tc_out<D, NCOL>(o_s, out, chunk - 1, b, h, T, hv, dv, c0);
        const float gc = gtot[first + chunk];

        // Δ = U − W·S (warps 0–3) or P = Q'·S (warps 4–7): 16 steps × NCOL/2 columns per warp.
        float acc[NH][4] = {};
        mma_kn<MAX_DIM, NH>(acc, is_delta ? w_s : q_s, TB_LP, mt, s_s, L::SP, ch, lane);
        if (is_delta) {
            #pragma unroll
            for (int n = 0; n < NH; n++)
                #pragma unroll
                for (int hf = 0; hf < 2; hf++) {
                    const int t = mt + g + 8 * hf, col = ch + 8 * n + 2 * c;
                    const unsigned uu = *reinterpret_cast<const unsigned*>(&u_s[t * L::SP + col]);
                    *reinterpret_cast<unsigned*>(&d_s[t * L::SP + col]) =
                        bf16x2(__uint_as_float(uu << 16) - acc[n][2 * hf],
                               __uint_as_float(uu & 0xffff0000u) - acc[n][2 * hf + 1]);
                }
        }
        __syncthreads();  // Δ is complete; S's copy and O's stage are free

        // O = P + Aqk·Δ (warps 4–7), staged in shared memory.
        if (!is_delta) {
            mma_kn<CHUNK, NH>(acc, a_s, TB_CP, mt, d_s, L::SP, ch, lane);
            #pragma unroll
            for (int n = 0; n < NH; n++)
                #pragma unroll
                for (int hf = 0; hf < 2; hf++) {
                    const int t = mt + g + 8 * hf, col = ch + 8 * n + 2 * c;
                    *reinterpret_cast<float2*>(&o_s[t * L::UP + col]) =
                        make_float2(acc[n][2 * hf], acc[n][2 * hf + 1]);
                }
        }
        // S ← e^{G_CH}·S + K'ᵀ·Δ on this warp's 16 rows, then its bf16 copy for the next chunk.
        #pragma unroll
        for (int n = 0; n < NS; n++)
            #pragma unroll
            for (int i = 0; i < 4; i++) s[n][i] *= gc;
        mma_kn<CHUNK, NS>(s, k_s, TB_CP, rs, d_s, L::SP, 0, lane);
        store_s();
    }
    __syncthreads();
    if (nc > 0) scan_tc_out<D, NCOL>(o_s, out, nc - 1, b, h, T, hv, dv, c0);
    // The padding's output: zeros, finite for the row-wise layers and attention keys after.
    for (int e = nc * CHUNK * NCOL + tid; e < T * NCOL; e += MMA_THREADS) {
        const int tt = e / NCOL, gc = c0 + e % NCOL;
        if (gc < dv) D::store(out + (((size_t)b * T + tt) * hv + h) * dv + gc, 0.f);
    }
    if (!(mode & SCAN_WRITE)) return;
    #pragma unroll
    for (int n = 0; n < NS; n++)
        #pragma unroll
        for (int i = 0; i < 4; i++) {
            const int r = rs + g + 8 * (i / 2), col = c0 + 8 * n + 2 * c + i % 2;
            if (r < dk && col < dv) st[(size_t)r * dv + col] = s[n][i];
        }
}

#endif

// Entry points: gdrc_{prep,scan}_<dtype> (FMA) and, on tensor cores, gdrc_prep_tc_<dtype>,
// gdrc_prep2_tc_<dtype> (two calls' chunks in one grid) and gdrc_scan_tc{,16}_<dtype> (32 or 16
// state columns per block, with a SCAN_* mode).
#define GDRC_PREP(NAME, BODY, THREADS, MINB, D)                                                   \
    extern "C" __global__ void __launch_bounds__(THREADS, MINB) NAME(                             \
        const D::T* qkv, const float* gb, const unsigned int* lengths, float* wt, float* u,       \
        float* qt, float* kd, float* atq, float* gtot, int T, int hk, int hv, int dk, int dv) {   \
        BODY<D>(qkv, gb, lengths, wt, u, qt, kd, atq, gtot, T, hk, hv, dk, dv);                   \
    }
#define GDRC(TAG, D)                                                                              \
    GDRC_PREP(gdrc_prep_##TAG, gdrc_prep, FMA_THREADS, 1, D)                                       \
    extern "C" __global__ void __launch_bounds__(FMA_THREADS, 1) gdrc_scan_##TAG(                  \
        const float* wt, const float* u, const float* qt, const float* kd, const float* atq,      \
        const float* gtot, float* state, D::T* out, int T, int hv, int dk, int dv, int nc) {      \
        gdrc_scan<D>(wt, u, qt, kd, atq, gtot, state, out, T, hv, dk, dv, nc);                    \
    }
GDRC(f32, F32)
GDRC(bf16, BF16)
GDRC(f16, F16)
#if __CUDA_ARCH__ >= 800
// The tensor-core scans: two blocks per SM (registers capped at 128), as their shared memory allows.
#define GDRC_SCAN_TC(NAME, NCOL, D)                                                               \
    extern "C" __global__ void __launch_bounds__(MMA_THREADS, 2) NAME(                             \
        const float* wt, const float* u, const float* qt, const float* kd, const float* atq,      \
        const float* gtot, float* state, const unsigned int* owners,                              \
        const unsigned int* lengths, D::T* out, int T, int hv, int dk, int dv, int nc,            \
        int mode) {                                                                               \
        gdrc_scan_tc<D, NCOL>(wt, u, qt, kd, atq, gtot, state, owners, lengths, out, T, hv, dk,   \
                              dv, nc, mode);                                                      \
    }
#define GDRC_TC(TAG, D)                                                                           \
    GDRC_PREP(gdrc_prep_tc_##TAG, gdrc_prep_tc, MMA_THREADS, 4, D)                                 \
    extern "C" __global__ void __launch_bounds__(MMA_THREADS, 4) gdrc_prep2_tc_##TAG(              \
        const D::T* qkv_a, const float* gb_a, const unsigned int* len_a, int t_a, int nc_a,       \
        int bh_a, const D::T* qkv_b, const float* gb_b, const unsigned int* len_b, int t_b,       \
        int nc_b, float* wt, float* u, float* qt, float* kd, float* atq, float* gtot, int hk,     \
        int hv, int dk, int dv) {                                                                 \
        gdrc_prep2_tc<D>(qkv_a, gb_a, len_a, t_a, nc_a, bh_a, qkv_b, gb_b, len_b, t_b, nc_b, wt,  \
                         u, qt, kd, atq, gtot, hk, hv, dk, dv);                                   \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(MMA_THREADS, 4) gdrc_prep2c_tc_##TAG(             \
        const D::T* qkv_a, const float* gb_a, const unsigned int* len_a, int t_a, int nc_a,       \
        int bh_a, const D::T* qkv_b, const float* gb_b, const unsigned int* len_b, int t_b,       \
        int nc_b, const unsigned int* owners, const D::T* w, long pitch_a, long pitch_b,          \
        float* wt, float* u, float* qt, float* kd, float* atq, float* gtot, int hk, int hv,       \
        int dk, int dv) {                                                                         \
        gdrc_prep2_tc<D, true>(qkv_a, gb_a, len_a, t_a, nc_a, bh_a, qkv_b, gb_b, len_b, t_b,      \
                               nc_b, wt, u, qt, kd, atq, gtot, hk, hv, dk, dv, owners, w,         \
                               pitch_a, pitch_b);                                                 \
    }                                                                                             \
    GDRC_SCAN_TC(gdrc_scan_tc64_##TAG, 64, D)                                                     \
    GDRC_SCAN_TC(gdrc_scan_tc_##TAG, 32, D)                                                       \
    GDRC_SCAN_TC(gdrc_scan_tc16_##TAG, 16, D)
GDRC_TC(bf16, BF16)
GDRC_TC(f16, F16)
static_assert(CHUNK == 32, "the preparation's warps take a step per lane (decays) or a pair per lane "
                            "of a half warp (K'), and Q' four 8-step blocks");
static_assert(PREPARE_MMA_SMEM == (PT_G + 7 * CHUNK) * 4, "PREPARE_MMA_SMEM");
static_assert(CHUNK * PT_WS <= CHUNK * PT_VP && PT_KT + CHUNK * PT_QS / 2 <= PT_V, "W and Q' fit where they leave");
static_assert(PT_A % 4 == 0 && PT_TT % 4 == 0 && PT_V % 4 == 0, "float4-aligned tiles");
static_assert(ScanTc<64>::BYTES == SCAN_MMA64_SMEM && ScanTc<32>::BYTES == SCAN_MMA32_SMEM &&
                  ScanTc<16>::BYTES == SCAN_MMA16_SMEM,
              "ScanTc<NCOL>::BYTES");
#endif

// The launcher's shared-memory sizes must match the layouts.
static_assert(PREPARE_SMEM == (P_G + 3 * CHUNK) * 4, "PREPARE_SMEM");
static_assert(P_TT + CHUNK * TP <= P_K, "A and Tm^T fit in the k^T tile");
static_assert(P_TT % 4 == 0, "Tm^T is float4-aligned");
static_assert(SCAN_SMEM == (S_D + CHUNK * 32) * 4, "SCAN_SMEM");
