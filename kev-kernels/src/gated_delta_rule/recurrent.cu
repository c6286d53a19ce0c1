// Compiled by nvcc (build.rs) or NVRTC, common.cuh prepended (no CUDA headers: bf16 and f16 are
// read and written as 16-bit integers); the constants shared with the Rust launcher come as
// -D defines (backend/cuda/catalog.rs).
//
// gdr_<dtype>_nk<NK>: the gated delta rule, recurrent form (docs/BACKBONE.md §3 step 7).
//   grid  = (ceil(Dv / (RECURRENT_WARPS·COLS)), B·Hv), block = 32·RECURRENT_WARPS threads.
//   One warp owns COLS state columns S[:, j] of one (batch row, value head); lane l keeps the NK
//   elements S[l + 32·i, j] of each in registers for the whole sequence (Dk ≤ 32·NK).
//   Inputs:  qkv [B, T, 2·Hk·Dk + Hv·Dv] (dtype), gb [B, T, Hv, 2] f32 (g, beta), lengths [B] u32
//            (null: no row is padded).
//   In/out:  state [B, Hv, Dk, Dv] f32 (read at start, written at end).
//   Output:  out [B, T, Hv, Dv] (dtype); steps t >= lengths[b] write 0 and leave the state alone.
//   chunked.cu has the chunked form of the same recurrence.

// The recurrence runs in tiles of TS steps. Per tile the block first stages, once for all its
// warps, what every state column needs from a step: q̂ = q·scale/|q| and k̂ = k/|k| (the l2norm
// fused here), exp(g), β, k̂·q̂ and the v entries of the block's columns, all in shared memory.
// Then each warp walks the tile over its columns, with one warp-wide reduction round per step:
//   S ← exp(g)·S,  δ = β(v − Sᵀk̂),  S ← S + k̂δ,  o = Sᵀq̂ = (old S)ᵀq̂ + δ·(k̂·q̂)
// so the output needs no second reduction after the update. Outputs go through shared memory
// and leave coalesced at the end of the tile.
template <typename D, int NK, int COLS>
__device__ void gdr(const typename D::T* __restrict__ qkv, const float* __restrict__ gb,
                    float* __restrict__ state, typename D::T* __restrict__ out,
                    const unsigned int* __restrict__ lengths,
                    int T, int hk, int hv, int dk, int dv) {
    constexpr int TS = NK <= 4 ? 32 : 16;  // steps per tile
    constexpr int DKM = 32 * NK;           // dk ≤ DKM
    constexpr int BC = RECURRENT_WARPS * COLS;       // state columns per block
    __shared__ float qn_s[TS][DKM], kn_s[TS][DKM];
    __shared__ float decay_s[TS], beta_s[TS], kq_s[TS];
    __shared__ float v_s[TS][BC], o_s[TS][BC];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int bh = blockIdx.y, b = bh / hv, h = bh % hv, kh = h / (hv / hk);
    const int c0 = blockIdx.x * BC;          // the block's first column
    const int j0 = c0 + warp * COLS;         // this warp's first column
    const bool active = j0 < dv;             // dv is a multiple of COLS
    const int channels = 2 * hk * dk + hv * dv;
    const float scale = rsqrtf((float)dk);
    const int len = lengths ? min((int)lengths[b], T) : T;
    for (int i = threadIdx.x; i < (T - len) * BC; i += blockDim.x) {
        const int t = len + i / BC, c = c0 + i % BC;
        if (c < dv) D::store(out + (((size_t)b * T + t) * hv + h) * dv + c, 0.f);
    }
    if (len == 0) return;  // the whole block: len is per batch row
    float* st = state + (size_t)bh * dk * dv;
    float s[COLS][NK];
    #pragma unroll
    for (int i = 0; i < NK; i++) {
        const int r = lane + 32 * i;
        #pragma unroll
        for (int c = 0; c < COLS; c++)
            s[c][i] = active && r < dk ? st[(size_t)r * dv + j0 + c] : 0.f;
    }
    for (int t0 = 0; t0 < len; t0 += TS) {
        const int n = min(TS, len - t0);
        __syncthreads();  // the previous tile is consumed
        for (int i = warp; i < n; i += RECURRENT_WARPS) {
            const typename D::T* row = qkv + ((size_t)b * T + t0 + i) * channels;
            float q[NK], k[NK], qq = 0.f, kk = 0.f, kq = 0.f;
            #pragma unroll
            for (int x = 0; x < NK; x++) {
                const int r = lane + 32 * x;
                q[x] = r < dk ? D::load(row + kh * dk + r) : 0.f;
                k[x] = r < dk ? D::load(row + (hk + kh) * dk + r) : 0.f;
                qq += q[x] * q[x];
                kk += k[x] * k[x];
                kq += k[x] * q[x];
            }
            #pragma unroll
            for (int off = 16; off > 0; off >>= 1) {
                qq += __shfl_xor_sync(0xffffffffu, qq, off);
                kk += __shfl_xor_sync(0xffffffffu, kk, off);
                kq += __shfl_xor_sync(0xffffffffu, kq, off);
            }
            const float qn = scale / sqrtf(qq + L2NORM_EPS), kn = 1.f / sqrtf(kk + L2NORM_EPS);
            #pragma unroll
            for (int x = 0; x < NK; x++) {
                const int r = lane + 32 * x;
                qn_s[i][r] = q[x] * qn;  // zero beyond dk
                kn_s[i][r] = k[x] * kn;
            }
            if (lane == 0) {
                const float* g = gb + (((size_t)b * T + t0 + i) * hv + h) * 2;
                decay_s[i] = expf(g[0]);
                beta_s[i] = g[1];
                kq_s[i] = kq * qn * kn;
            }
        }
        for (int i = threadIdx.x; i < n * BC; i += blockDim.x) {
            const int si = i / BC, c = i % BC;
            v_s[si][c] = c0 + c < dv
                ? D::load(qkv + ((size_t)b * T + t0 + si) * channels + 2 * hk * dk + h * dv + c0 + c)
                : 0.f;
        }
        __syncthreads();
        if (active) {
            for (int i = 0; i < n; i++) {
                const float decay = decay_s[i], beta = beta_s[i], kq = kq_s[i];
                float kr[NK], qr[NK], sk[COLS], sq[COLS];
                #pragma unroll
                for (int x = 0; x < NK; x++) {
                    kr[x] = kn_s[i][lane + 32 * x];
                    qr[x] = qn_s[i][lane + 32 * x];
                }
                #pragma unroll
                for (int c = 0; c < COLS; c++) {
                    sk[c] = sq[c] = 0.f;
                    #pragma unroll
                    for (int x = 0; x < NK; x++) {
                        s[c][x] *= decay;
                        sk[c] += s[c][x] * kr[x];
                        sq[c] += s[c][x] * qr[x];
                    }
                }
                #pragma unroll
                for (int off = 16; off > 0; off >>= 1) {
                    #pragma unroll
                    for (int c = 0; c < COLS; c++) {
                        sk[c] += __shfl_xor_sync(0xffffffffu, sk[c], off);
                        sq[c] += __shfl_xor_sync(0xffffffffu, sq[c], off);
                    }
                }
                #pragma unroll
                for (int c = 0; c < COLS; c++) {
                    const float delta = (v_s[i][warp * COLS + c] - sk[c]) * beta;
                    #pragma unroll
                    for (int x = 0; x < NK; x++) s[c][x] += kr[x] * delta;
                    if (lane == 0) o_s[i][warp * COLS + c] = sq[c] + delta * kq;
                }
            }
        }
        __syncthreads();
        for (int i = threadIdx.x; i < n * BC; i += blockDim.x) {
            const int si = i / BC, c = i % BC;
            if (c0 + c < dv)
                D::store(out + (((size_t)b * T + t0 + si) * hv + h) * dv + c0 + c, o_s[si][c]);
        }
    }
    #pragma unroll
    for (int i = 0; i < NK; i++) {
        const int r = lane + 32 * i;
        #pragma unroll
        for (int c = 0; c < COLS; c++)
            if (active && r < dk) st[(size_t)r * dv + j0 + c] = s[c][i];
    }
}

#define GDR(NAME, D, NK, COLS)                                                                  \
    extern "C" __global__ void NAME(const D::T* qkv, const float* gb, float* state, D::T* out, \
                                    const unsigned int* lengths, int T, int hk, int hv, int dk, \
                                    int dv) {                                                   \
        gdr<D, NK, COLS>(qkv, gb, state, out, lengths, T, hk, hv, dk, dv);                      \
    }
#define GDR_NK(TAG, D, COLS)                                                                    \
    GDR(gdr_##TAG##_nk1_c##COLS, D, 1, COLS) GDR(gdr_##TAG##_nk2_c##COLS, D, 2, COLS)           \
    GDR(gdr_##TAG##_nk4_c##COLS, D, 4, COLS) GDR(gdr_##TAG##_nk8_c##COLS, D, 8, COLS)
#define GDR_ALL(TAG, D) GDR_NK(TAG, D, 1) GDR_NK(TAG, D, 2) GDR_NK(TAG, D, 4)
GDR_ALL(f32, F32)
GDR_ALL(bf16, BF16)
GDR_ALL(f16, F16)
