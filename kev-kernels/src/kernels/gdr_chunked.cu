// The gated delta rule in chunked form (QWEN35.md §8.2), two kernels. The step-by-step kernel
// (ops.cu) is bound by one step's latency; this form does the same work as small dense products
// per chunk of CH steps, so a row of T steps is T/CH sequential rounds instead of T.
//
// Per (batch row, value head) and chunk, with G_t = Σ_{s≤t} g_s inside the chunk and S the state
// at the chunk start (k̂, q̂ l2-normalised, q̂ scaled by 1/√Dk, as in the recurrent kernel):
//   A[t,s] = β_t·e^{G_t−G_s}·k̂_t·k̂_s (s < t),  Tm = (I + A)⁻¹,  W = Tm·diag(β·e^G)·K̂,  U = Tm·diag(β)·V
//   Δ      = U − W·S                     (row t: the step's δ_t of the recurrence)
//   O      = Q'·S + Aqk·Δ                Q'_t = e^{G_t}·q̂_t,  Aqk[t,s] = e^{G_t−G_s}·q̂_t·k̂_s (s ≤ t)
//   S     ← e^{G_CH}·S + K'ᵀ·Δ          K'_t = e^{G_CH−G_t}·k̂_t
// Steps at or past a row's length get g = β = 0 and k̂ = q̂ = v = 0: they output 0 and leave the
// state alone, like the recurrent kernel. Everything is f32; the output is rounded to the dtype.
// Dk and Dv are at most 128 (zero-padded to it inside).
//
// Every product is register-tiled (each thread a 4×4 to 4×16 block of outputs, operands read as
// float4 from shared memory): with one output per thread the kernels were bound by shared-memory
// bandwidth and ran slower than the step-by-step kernel.
//
// gdrc_prep_<dtype>: grid = (NC, B·Hv), block = 128, dynamic shared memory PREP_SMEM. One block
//   per chunk writes what does not depend on S to f32 scratch, per (row·head, chunk) `c`:
//   wt [c][128][CH] Wᵀ,  qt [c][128][CH] Q'ᵀ,  kd [c][CH][128] K',  at [c][CH][CH] Aqkᵀ (zero where
//   s > t),  u [c][CH][Dv] U,  gtot [c] e^{G_CH}.
// gdrc_scan_<dtype>: grid = (ceil(Dv/32), B·Hv), block = 128, dynamic shared memory SCAN_SMEM.
//   One block per 32 state columns walks the chunks in order; S lives in registers (an 8×4 tile
//   per thread) and is mirrored to shared memory as the operand of W·S and Q'·S.

#define CH 32            // steps per chunk
#define CH_THREADS 128
#define DM 128           // Dk and Dv, padded
#define TP (CH + 4)      // row pitch of [DM][CH] tiles: float4-aligned, rows in different banks

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

// Shared memory of the preparation kernel, in floats (offsets multiples of 4).
// A and Tmᵀ live in the k̂ᵀ tile, which nothing reads after step 2: 70016 bytes, so three
// blocks fit on an SM instead of two.
#define P_QT 0                          // q̂ᵀ [DM][TP]
#define P_KT (P_QT + DM * TP)           // k̂ᵀ [DM][TP] (steps 1–2)
#define P_A P_KT                        // A [CH][CH+1] (steps 2–3)
#define P_TT (P_A + CH * (CH + 1))      // Tmᵀ [CH][TP] (steps 3–4)
#define P_K (P_KT + DM * TP)            // k̂ [CH][DM]
#define P_V (P_K + CH * DM)             // v [CH][DM]
#define P_G (P_V + CH * DM)             // G, β, β·e^G [CH] each
#define PREP_SMEM ((P_G + 3 * CH) * 4)  // 70016 bytes: GDRC_PREP_SMEM in cuda.rs

template <typename D>
__device__ void gdrc_prep(const typename D::T* __restrict__ qkv, const float* __restrict__ gb,
                          const unsigned int* __restrict__ lengths, float* __restrict__ wt,
                          float* __restrict__ u, float* __restrict__ qt, float* __restrict__ kd,
                          float* __restrict__ atq, float* __restrict__ gtot, int T, int hk, int hv,
                          int dk, int dv) {
    extern __shared__ __align__(16) float sm[];
    float(*qT)[TP] = reinterpret_cast<float(*)[TP]>(sm + P_QT);
    float(*kT)[TP] = reinterpret_cast<float(*)[TP]>(sm + P_KT);
    float(*kr)[DM] = reinterpret_cast<float(*)[DM]>(sm + P_K);
    float(*vr)[DM] = reinterpret_cast<float(*)[DM]>(sm + P_V);
    float(*a)[CH + 1] = reinterpret_cast<float(*)[CH + 1]>(sm + P_A);
    float(*tT)[TP] = reinterpret_cast<float(*)[TP]>(sm + P_TT);
    float *g_s = sm + P_G, *beta_s = g_s + CH, *bg_s = beta_s + CH;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int chunk = blockIdx.x, nc = gridDim.x;
    const int bh = blockIdx.y, b = bh / hv, h = bh % hv, kh = h / (hv / hk);
    const int channels = 2 * hk * dk + hv * dv;
    const int len = lengths ? min((int)lengths[b], T) : T;
    const int t0 = chunk * CH;
    const float scale = rsqrtf((float)dk);
    const size_t c = (size_t)bh * nc + chunk;  // this chunk's scratch block

    // 1. q̂, k̂ (both layouts), v, g, β of the chunk's steps; a warp per step (unrolled: the
    //    loads of a warp's steps are in flight together).
    #pragma unroll
    for (int step = 0; step < CH / (CH_THREADS / 32); step++) {
        const int i = warp + step * (CH_THREADS / 32), t = t0 + i;
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
            vr[i][r] = valid && r < dv ? D::load(row + 2 * hk * dk + h * dv + r) : 0.f;
        }
        qq = warp_sum(qq);
        kk = warp_sum(kk);
        const float qn = scale / sqrtf(qq + L2NORM_EPS), kn = 1.f / sqrtf(kk + L2NORM_EPS);
        #pragma unroll
        for (int x = 0; x < 4; x++) {
            const int r = lane + 32 * x;
            qT[r][i] = q[x] * qn;
            kT[r][i] = k[x] * kn;
            kr[i][r] = k[x] * kn;
        }
        if (lane == 0) {
            const float* g = gb + (((size_t)b * T + (valid ? t : 0)) * hv + h) * 2;
            g_s[i] = valid ? g[0] : 0.f;
            beta_s[i] = valid ? g[1] : 0.f;
        }
    }
    __syncthreads();
    if (tid == 0) {
        float acc = 0.f;
        for (int i = 0; i < CH; i++) {
            g_s[i] = acc += g_s[i];
            bg_s[i] = beta_s[i] * expf(acc);
        }
    }
    __syncthreads();

    // 2. K̂K̂ᵀ (threads 0–63) and Q̂K̂ᵀ (64–127), a 4×4 tile each → A (shared) and Aqkᵀ (global).
    {
        const int i = tid % 64, ta = 4 * (i / 8), sa = 4 * (i % 8);
        const bool is_k = tid < 64;
        const float(*lhs)[TP] = is_k ? kT : qT;
        float acc[4][4] = {};
        #pragma unroll 4
        for (int r = 0; r < DM; r++) {
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
                    atq[(c * CH + s) * CH + t] = decay * acc[p][q];
            }
        }
    }
    __syncthreads();

    // 3. Warp 0: Tm = (I + A)⁻¹ by forward substitution, lane j solving column j in registers
    //    (fully unrolled, so every lane runs the same code and reads A as broadcasts: above the
    //    diagonal the column is zero and adds nothing). Two partial sums halve the chain of
    //    dependent FMAs. The other warps meanwhile write Q'ᵀ and K'.
    if (warp == 0) {
        float x[CH];
        #pragma unroll
        for (int i = 0; i < CH; i++) {
            float even = i == lane ? 1.f : 0.f, odd = 0.f;
            #pragma unroll
            for (int s = 0; s + 1 < i; s += 2) {
                even -= a[i][s] * x[s];
                odd -= a[i][s + 1] * x[s + 1];
            }
            if (i % 2 == 1) even -= a[i][i - 1] * x[i - 1];
            x[i] = even + odd;
        }
        #pragma unroll
        for (int i = 0; i < CH; i += 4) st4(&tT[lane][i], x[i], x[i + 1], x[i + 2], x[i + 3]);
    } else {
        const float gc = g_s[CH - 1];
        for (int e = tid - 32; e < DM * CH / 4; e += CH_THREADS - 32) {
            const int r = e / (CH / 4), t = 4 * (e % (CH / 4));
            st4(&qt[(c * DM + r) * CH + t], expf(g_s[t]) * qT[r][t], expf(g_s[t + 1]) * qT[r][t + 1],
                expf(g_s[t + 2]) * qT[r][t + 2], expf(g_s[t + 3]) * qT[r][t + 3]);
            const int t2 = e / (DM / 4), r2 = 4 * (e % (DM / 4));
            const float f = expf(gc - g_s[t2]);
            st4(&kd[(c * CH + t2) * DM + r2], f * kr[t2][r2], f * kr[t2][r2 + 1], f * kr[t2][r2 + 2],
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
        for (int s = 0; s < CH; s++) {
            const float4 x = ld4(&tT[s][ta]);
            const float fs = f[s];
            const float* brow = is_w ? &kr[s][ca] : &vr[s][ca - DM];
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
                st4(&wt[(c * DM + ca + q) * CH + ta], acc[0][q], acc[1][q], acc[2][q], acc[3][q]);
        } else {
            #pragma unroll
            for (int p = 0; p < 4; p++)
                #pragma unroll
                for (int q = 0; q < 16; q++) {
                    const int col = ca - DM + q;
                    if (col < dv) u[(c * CH + ta + p) * dv + col] = acc[p][q];
                }
        }
    }
}

// Shared memory of the scan kernel, in floats.
#define S_S 0                    // S [DM][32] (the block's columns)
#define S_WT (S_S + DM * 32)     // Wᵀ [DM][CH]
#define S_QT (S_WT + DM * CH)    // Q'ᵀ [DM][CH]
#define S_K (S_QT + DM * CH)     // K' [CH][DM]
#define S_AT (S_K + CH * DM)     // Aqkᵀ [CH][CH]
#define S_U (S_AT + CH * CH)     // U [CH][32]
#define S_D (S_U + CH * 32)      // Δ [CH][32]
#define SCAN_SMEM ((S_D + CH * 32) * 4)  // 77824 bytes: GDRC_SCAN_SMEM in cuda.rs

template <typename D>
__device__ void gdrc_scan(const float* __restrict__ wt, const float* __restrict__ u,
                          const float* __restrict__ qt, const float* __restrict__ kd,
                          const float* __restrict__ atq, const float* __restrict__ gtot,
                          float* __restrict__ state, typename D::T* __restrict__ out, int T,
                          int hv, int dk, int dv, int nc) {
    extern __shared__ __align__(16) float sm[];
    float(*s_s)[32] = reinterpret_cast<float(*)[32]>(sm + S_S);
    float(*wt_s)[CH] = reinterpret_cast<float(*)[CH]>(sm + S_WT);
    float(*qt_s)[CH] = reinterpret_cast<float(*)[CH]>(sm + S_QT);
    float(*k_s)[DM] = reinterpret_cast<float(*)[DM]>(sm + S_K);
    float(*at_s)[CH] = reinterpret_cast<float(*)[CH]>(sm + S_AT);
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
    // The next chunk's operands are loaded into registers while this chunk computes, and stored
    // to shared memory at the top of the next round: the loads' latency hides behind the products.
    constexpr int N4 = DM * CH / 4 / CH_THREADS, NA = CH * CH / 4 / CH_THREADS, NU = CH * 32 / CH_THREADS;
    float4 wv[N4], qv[N4], kv[N4], av[NA];
    float uv[NU], gnext;
    auto fetch = [&](int chunk) {
        const size_t c = (size_t)bh * nc + chunk;
        const float4* w4 = reinterpret_cast<const float4*>(wt + c * DM * CH);
        const float4* q4 = reinterpret_cast<const float4*>(qt + c * DM * CH);
        const float4* k4 = reinterpret_cast<const float4*>(kd + c * CH * DM);
        const float4* a4 = reinterpret_cast<const float4*>(atq + c * CH * CH);
        #pragma unroll
        for (int k = 0; k < N4; k++) {
            wv[k] = w4[tid + k * CH_THREADS];
            qv[k] = q4[tid + k * CH_THREADS];
            kv[k] = k4[tid + k * CH_THREADS];
        }
        #pragma unroll
        for (int k = 0; k < NA; k++) av[k] = a4[tid + k * CH_THREADS];
        #pragma unroll
        for (int k = 0; k < NU; k++) {
            const int e = tid + k * CH_THREADS, col = c0 + e % 32;
            uv[k] = col < dv ? u[(c * CH + e / 32) * dv + col] : 0.f;
        }
        gnext = gtot[c];
    };
    fetch(0);
    for (int chunk = 0; chunk < nc; chunk++) {
        #pragma unroll
        for (int p = 0; p < 8; p++) st4(&s_s[ra + p][cs], s[p][0], s[p][1], s[p][2], s[p][3]);
        #pragma unroll
        for (int k = 0; k < N4; k++) {
            reinterpret_cast<float4*>(sm + S_WT)[tid + k * CH_THREADS] = wv[k];
            reinterpret_cast<float4*>(sm + S_QT)[tid + k * CH_THREADS] = qv[k];
            reinterpret_cast<float4*>(sm + S_K)[tid + k * CH_THREADS] = kv[k];
        }
        #pragma unroll
        for (int k = 0; k < NA; k++) reinterpret_cast<float4*>(sm + S_AT)[tid + k * CH_THREADS] = av[k];
        #pragma unroll
        for (int k = 0; k < NU; k++) (&u_s[0][0])[tid + k * CH_THREADS] = uv[k];
        const float gc = gnext;
        __syncthreads();
        if (chunk + 1 < nc) fetch(chunk + 1);

        // Δ = U − W·S (threads 0–63), P = Q'·S (64–127).
        float acc[4][4] = {};
        {
            const float(*lhs)[CH] = is_delta ? wt_s : qt_s;
            #pragma unroll 4
            for (int r = 0; r < DM; r++) {
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
            for (int j = 0; j < CH; j++) {
                outer4(acc, ld4(&at_s[j][ta]), ld4(&d_s[j][ca]));
            }
            #pragma unroll
            for (int p = 0; p < 4; p++) {
                const int tt = chunk * CH + ta + p;
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
        for (int t = 0; t < CH; t++) {
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

#define GDRC(TAG, D)                                                                              \
    extern "C" __global__ void __launch_bounds__(CH_THREADS) gdrc_prep_##TAG(                     \
        const D::T* qkv, const float* gb, const unsigned int* lengths, float* wt, float* u,       \
        float* qt, float* kd, float* atq, float* gtot, int T, int hk, int hv, int dk, int dv) {   \
        gdrc_prep<D>(qkv, gb, lengths, wt, u, qt, kd, atq, gtot, T, hk, hv, dk, dv);              \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(CH_THREADS) gdrc_scan_##TAG(                     \
        const float* wt, const float* u, const float* qt, const float* kd, const float* atq,      \
        const float* gtot, float* state, D::T* out, int T, int hv, int dk, int dv, int nc) {      \
        gdrc_scan<D>(wt, u, qt, kd, atq, gtot, state, out, T, hv, dk, dv, nc);                    \
    }
GDRC(f32, F32)
GDRC(bf16, BF16)
GDRC(f16, F16)

// The host's copies of the shared-memory sizes must match.
static_assert(PREP_SMEM == 70016, "PREP_SMEM");
static_assert(P_TT + CH * TP <= P_K, "A and Tm^T fit in the k^T tile");
static_assert(P_TT % 4 == 0, "Tm^T is float4-aligned");
static_assert(SCAN_SMEM == 77824, "SCAN_SMEM");
