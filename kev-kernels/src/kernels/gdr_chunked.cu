// The gated delta rule in chunked form (QWEN35.md §8.2), two kernels. The step-by-step kernel
// (ops.cu) is bound by one step's latency; this form does the same work as small dense products
// per chunk of CH steps, so a row of T steps is T/CH sequential rounds instead of T.
//
// Per (batch row, value head) and chunk, with G_t = Σ_{s≤t} g_s inside the chunk and S the state
// at the chunk start (k̂, q̂ l2-normalised, q̂ scaled by 1/√Dk, as in the recurrent kernel):
//   A[t,s]   = β_t·e^{G_t−G_s}·k̂_t·k̂_s  (s < t),   (I + A)·W = diag(β·e^G)·K̂,   (I + A)·U = diag(β)·V
//   Δ        = U − W·S                     (row t: the step's δ_t of the recurrence)
//   O        = Q'·S + Aqk·Δ                Q'_t = e^{G_t}·q̂_t,  Aqk[t,s] = e^{G_t−G_s}·q̂_t·k̂_s (s ≤ t)
//   S       ← e^{G_CH}·S + K'ᵀ·Δ          K'_t = e^{G_CH−G_t}·k̂_t
// Steps at or past a row's length get g = β = 0 and k̂ = q̂ = v = 0: they output 0 and leave the
// state alone, like the recurrent kernel. Everything is f32; the output is rounded to the dtype.
//
// gdrc_prep_<dtype>_nk<NK>: grid = (NC, B·Hv), block = 128. One block per chunk: everything that
//   does not depend on S, written to f32 scratch ("rows" are B·Hv·NC·CH chunk steps):
//   wk [rows, DKM] W,  u [rows, Dv] U,  qd [rows, DKM] Q',  kd [rows, DKM] K',
//   aqk [rows, CH] Aqk (zero above the diagonal),  gtot [B·Hv·NC] e^{G_CH}.   DKM = 32·NK ≥ Dk.
// gdrc_scan_<dtype>_nk<NK>: grid = (ceil(Dv/32), B·Hv), block = 128. One block per 32 state
//   columns, walking the chunks in order with S in registers: thread (warp w, lane l) owns column
//   32·blockIdx.x + 8w + l%8 and rows (l/8)·DKM/4 + i; the four row groups of a column are lanes
//   of one warp and add up their partial dot products with two shuffles.

#define CH 32
#define CH_THREADS 128

template <typename D, int NK>
__device__ void gdrc_prep(const typename D::T* __restrict__ qkv, const float* __restrict__ gb,
                          const unsigned int* __restrict__ lengths, float* __restrict__ wk,
                          float* __restrict__ u, float* __restrict__ qd, float* __restrict__ kd,
                          float* __restrict__ aqk, float* __restrict__ gtot, int T, int hk, int hv,
                          int dk, int dv) {
    constexpr int DKM = 32 * NK;
    __shared__ float q_s[CH][DKM + 1], k_s[CH][DKM + 1];  // +1: rows start in different banks
    __shared__ float a_s[CH][CH + 1];
    __shared__ float g_s[CH], beta_s[CH];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int chunk = blockIdx.x, nc = gridDim.x;
    const int bh = blockIdx.y, b = bh / hv, h = bh % hv, kh = h / (hv / hk);
    const int channels = 2 * hk * dk + hv * dv;
    const int len = lengths ? min((int)lengths[b], T) : T;
    const int t0 = chunk * CH;
    const float scale = rsqrtf((float)dk);
    const size_t base = ((size_t)bh * nc + chunk) * CH;  // this chunk's first scratch row

    for (int i = warp; i < CH; i += CH_THREADS / 32) {
        const int t = t0 + i;
        const bool valid = t < len;
        const typename D::T* row = qkv + ((size_t)b * T + (valid ? t : 0)) * channels;
        float q[NK], k[NK], qq = 0.f, kk = 0.f;
        #pragma unroll
        for (int x = 0; x < NK; x++) {
            const int r = lane + 32 * x;
            q[x] = valid && r < dk ? D::load(row + kh * dk + r) : 0.f;
            k[x] = valid && r < dk ? D::load(row + (hk + kh) * dk + r) : 0.f;
            qq += q[x] * q[x];
            kk += k[x] * k[x];
        }
        qq = warp_sum(qq);
        kk = warp_sum(kk);
        const float qn = scale / sqrtf(qq + L2NORM_EPS), kn = 1.f / sqrtf(kk + L2NORM_EPS);
        #pragma unroll
        for (int x = 0; x < NK; x++) {
            q_s[i][lane + 32 * x] = q[x] * qn;
            k_s[i][lane + 32 * x] = k[x] * kn;
        }
        if (lane == 0) {
            const float* g = gb + (((size_t)b * T + (valid ? t : 0)) * hv + h) * 2;
            g_s[i] = valid ? g[0] : 0.f;
            beta_s[i] = valid ? g[1] : 0.f;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float acc = 0.f;
        for (int i = 0; i < CH; i++) g_s[i] = acc += g_s[i];
    }
    __syncthreads();

    {  // A and Aqk: thread → row t, columns s ≡ threadIdx.x (mod 4)
        const int t = threadIdx.x / 4, sg = threadIdx.x % 4;
        const float gt = g_s[t], bt = beta_s[t];
        for (int j = 0; j < CH / 4; j++) {
            const int s = sg + 4 * j;
            float kk = 0.f, qk = 0.f;
            #pragma unroll 8
            for (int r = 0; r < DKM; r++) {
                kk += k_s[t][r] * k_s[s][r];
                qk += q_s[t][r] * k_s[s][r];
            }
            const float decay = s <= t ? expf(gt - g_s[s]) : 0.f;  // masked before exp
            a_s[t][s] = s < t ? bt * decay * kk : 0.f;
            aqk[(base + t) * CH + s] = decay * qk;
        }
    }
    const float gc = g_s[CH - 1];
    for (int idx = threadIdx.x; idx < CH * DKM; idx += CH_THREADS) {
        const int i = idx / DKM, r = idx % DKM;
        qd[(base + i) * DKM + r] = expf(g_s[i]) * q_s[i][r];
        kd[(base + i) * DKM + r] = expf(gc - g_s[i]) * k_s[i][r];
    }
    if (threadIdx.x == 0) gtot[(size_t)bh * nc + chunk] = expf(gc);
    __syncthreads();  // a_s complete

    // W and U by forward substitution, one right-hand-side column per thread, the column kept in
    // shared memory (q_s is free now; rows of x are read in order, so no bank conflicts).
    float(*x_s)[CH_THREADS] = reinterpret_cast<float(*)[CH_THREADS]>(&q_s[0][0]);
    __syncthreads();  // q_s is read above
    for (int c = threadIdx.x; c < DKM + dv; c += CH_THREADS) {
        const int xc = threadIdx.x;
        for (int i = 0; i < CH; i++) {
            const int t = t0 + i;
            float acc;
            if (c < DKM)
                acc = beta_s[i] * expf(g_s[i]) * k_s[i][c];
            else
                acc = t < len ? beta_s[i] * D::load(qkv + ((size_t)b * T + t) * channels +
                                                    2 * hk * dk + h * dv + (c - DKM))
                              : 0.f;
            for (int j = 0; j < i; j++) acc -= a_s[i][j] * x_s[j][xc];
            x_s[i][xc] = acc;
            if (c < DKM)
                wk[(base + i) * DKM + c] = acc;
            else
                u[(base + i) * dv + c - DKM] = acc;
        }
    }
}

__device__ __forceinline__ float dot4(float4 a, const float* s) {
    return a.x * s[0] + a.y * s[1] + a.z * s[2] + a.w * s[3];
}

template <typename D, int NK>
__device__ void gdrc_scan(const float* __restrict__ wk, const float* __restrict__ u,
                          const float* __restrict__ qd, const float* __restrict__ kd,
                          const float* __restrict__ aqk, const float* __restrict__ gtot,
                          float* __restrict__ state, typename D::T* __restrict__ out, int T,
                          int hv, int dk, int dv, int nc) {
    constexpr int DKM = 32 * NK, RG = DKM / 4;  // state rows per thread
    __shared__ __align__(16) float m_s[CH][DKM];  // W, then K'
    __shared__ __align__(16) float q_s[CH][DKM];
    __shared__ float u_s[CH][32], a_s[CH][CH], d_s[CH][32];  // u_s then holds Q'·S
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int bh = blockIdx.y, b = bh / hv, h = bh % hv;
    const int cl = warp * 8 + lane % 8, rg = lane / 8;
    const int c0 = blockIdx.x * 32, col = c0 + cl;
    const bool active = col < dv;
    float* st = state + (size_t)bh * dk * dv;
    float s[RG];
    #pragma unroll
    for (int i = 0; i < RG; i++) {
        const int r = rg * RG + i;
        s[i] = active && r < dk ? st[(size_t)r * dv + col] : 0.f;
    }
    for (int chunk = 0; chunk < nc; chunk++) {
        const size_t base = ((size_t)bh * nc + chunk) * CH;
        __syncthreads();  // the previous chunk's K' is consumed
        {
            const float4* w4 = reinterpret_cast<const float4*>(wk + base * DKM);
            const float4* q4 = reinterpret_cast<const float4*>(qd + base * DKM);
            for (int i = threadIdx.x; i < CH * DKM / 4; i += CH_THREADS) {
                reinterpret_cast<float4*>(&m_s[0][0])[i] = w4[i];
                reinterpret_cast<float4*>(&q_s[0][0])[i] = q4[i];
            }
            for (int i = threadIdx.x; i < CH * 32; i += CH_THREADS) {
                const int t = i / 32, c = i % 32;
                u_s[t][c] = c0 + c < dv ? u[(base + t) * dv + c0 + c] : 0.f;
            }
            for (int i = threadIdx.x; i < CH * CH; i += CH_THREADS) (&a_s[0][0])[i] = aqk[base * CH + i];
        }
        const float gc = gtot[(size_t)bh * nc + chunk];
        __syncthreads();

        // Δ = U − W·S and Q'·S, reduced over the column's four lanes; kept in shared memory
        // (loops over steps stay rolled: NVRTC time and registers).
        #pragma unroll 1
        for (int t = 0; t < CH; t++) {
            float pw = 0.f, pq = 0.f;
            #pragma unroll
            for (int i = 0; i < RG; i += 4) {
                pw += dot4(*reinterpret_cast<const float4*>(&m_s[t][rg * RG + i]), &s[i]);
                pq += dot4(*reinterpret_cast<const float4*>(&q_s[t][rg * RG + i]), &s[i]);
            }
            pw += __shfl_xor_sync(0xffffffffu, pw, 8);
            pq += __shfl_xor_sync(0xffffffffu, pq, 8);
            pw += __shfl_xor_sync(0xffffffffu, pw, 16);
            pq += __shfl_xor_sync(0xffffffffu, pq, 16);
            if (rg == 0) {
                d_s[t][cl] = u_s[t][cl] - pw;
                u_s[t][cl] = pq;
            }
        }
        __syncwarp();  // a column's d_s / u_s entries come from lanes of the same warp
        // O = Q'·S + Aqk·Δ: the column's four lanes take every fourth step.
        #pragma unroll 1
        for (int t = rg; t < CH; t += 4) {
            float acc = u_s[t][cl];
            for (int j = 0; j <= t; j++) acc += a_s[t][j] * d_s[j][cl];
            const int tt = chunk * CH + t;
            if (active && tt < T) D::store(out + (((size_t)b * T + tt) * hv + h) * dv + col, acc);
        }
        __syncthreads();  // W is consumed
        {
            const float4* k4 = reinterpret_cast<const float4*>(kd + base * DKM);
            for (int i = threadIdx.x; i < CH * DKM / 4; i += CH_THREADS)
                reinterpret_cast<float4*>(&m_s[0][0])[i] = k4[i];
        }
        __syncthreads();
        #pragma unroll
        for (int i = 0; i < RG; i++) s[i] *= gc;
        #pragma unroll 1
        for (int t = 0; t < CH; t++) {
            const float dt = d_s[t][cl];
            #pragma unroll
            for (int i = 0; i < RG; i += 4) {
                const float4 k4 = *reinterpret_cast<const float4*>(&m_s[t][rg * RG + i]);
                s[i] += k4.x * dt;
                s[i + 1] += k4.y * dt;
                s[i + 2] += k4.z * dt;
                s[i + 3] += k4.w * dt;
            }
        }
    }
    #pragma unroll
    for (int i = 0; i < RG; i++) {
        const int r = rg * RG + i;
        if (active && r < dk) st[(size_t)r * dv + col] = s[i];
    }
}

#define GDRC(TAG, D, NK)                                                                          \
    extern "C" __global__ void __launch_bounds__(CH_THREADS) gdrc_prep_##TAG##_nk##NK(           \
        const D::T* qkv, const float* gb, const unsigned int* lengths, float* wk, float* u,       \
        float* qd, float* kd, float* aqk, float* gtot, int T, int hk, int hv, int dk, int dv) {   \
        gdrc_prep<D, NK>(qkv, gb, lengths, wk, u, qd, kd, aqk, gtot, T, hk, hv, dk, dv);          \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(CH_THREADS) gdrc_scan_##TAG##_nk##NK(           \
        const float* wk, const float* u, const float* qd, const float* kd, const float* aqk,      \
        const float* gtot, float* state, D::T* out, int T, int hv, int dk, int dv, int nc) {      \
        gdrc_scan<D, NK>(wk, u, qd, kd, aqk, gtot, state, out, T, hv, dk, dv, nc);                \
    }
// One instantiation: Dk ≤ 128 (Qwen3.5 has 128; smaller heads are zero-padded to it).
GDRC(f32, F32, 4)
GDRC(bf16, BF16, 4)
GDRC(f16, F16, 4)
