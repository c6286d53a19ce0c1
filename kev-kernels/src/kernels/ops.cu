// Kev's CUDA kernels, compiled at run time with NVRTC (no CUDA headers: bf16 and f16 are read
// and written as 16-bit integers).
//
// gdr_<dtype>_nk<NK>: the gated delta rule, recurrent form (docs/BACKBONE.md §3 step 7).
//   grid  = (ceil(Dv / (WARPS·COLS)), B·Hv), block = 32·WARPS threads.
//   One warp owns COLS state columns S[:, j] of one (batch row, value head); lane l keeps the NK
//   elements S[l + 32·i, j] of each in registers for the whole sequence (Dk ≤ 32·NK).
//   Inputs:  qkv [B, T, 2·Hk·Dk + Hv·Dv] (dtype), gb [B, T, Hv, 2] f32 (g, beta), lengths [B] u32
//            (null: no row is padded).
//   In/out:  state [B, Hv, Dk, Dv] f32 (read at start, written at end).
//   Output:  out [B, T, Hv, Dv] (dtype); steps t >= lengths[b] write 0 and leave the state alone.
//   gdr_chunked.cu has the chunked form of the same recurrence.
//
// conv_<dtype>: causal depthwise conv1d + SiLU, one thread per output element.
//   Inputs: x [B, K-1+T, C] (dtype, the K-1 cached steps first), w [C, K] (dtype).
//   Output: y [B, T, C] (dtype), accumulated in f32.

#define WARPS 8

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
    constexpr int BC = WARPS * COLS;       // state columns per block
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
        for (int i = warp; i < n; i += WARPS) {
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
        D::store(y + idx, silu<D>(acc));
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

#define CONV(TAG, D)                                                                              \
    extern "C" __global__ void conv_##TAG(const D::T* x, const D::T* w, D::T* y, int B, int T, \
                                          int C, int K) {                                         \
        conv<D>(x, w, y, B, T, C, K);                                                             \
    }
CONV(f32, F32)
CONV(bf16, BF16)
CONV(f16, F16)

// ---- Fused elementwise kernels (norm.rs, gates.rs, swiglu.rs). Inputs marked "rows" are
// [rows, cols] views whose rows start `stride` elements apart (a slice of a wider projection).
// Rounding to the activation dtype happens exactly where HF's PyTorch code rounds.

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

// gates_<dtype>: ba rows (stride s) of [b (hv) | a (hv)] → gb [rows, hv, 2] f32:
//   g = neg_a·softplus(a + dt_bias) (f32, torch's threshold 20), β = round(sigmoid(b)).
template <typename D>
__device__ void gates(const typename D::T* ba, long s, const float* dt_bias, const float* neg_a,
                      float* gb, int rows, int hv) {
    const size_t n = (size_t)rows * hv;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const int h = i % hv;
        const typename D::T* row = ba + (i / hv) * s;
        const float b = D::load(row + h), a = D::load(row + hv + h) + dt_bias[h];
        const float sp = a > 20.f ? a : log1pf(expf(a));
        gb[2 * i] = neg_a[h] * sp;
        gb[2 * i + 1] = D::round(sigmoid<D>(b));
    }
}

// swiglu_<dtype>: gu [rows, 2·inter] contiguous ([gate | up] per row) → out [rows, inter]:
//   round(round(silu(gate)) · up)   (HF: act_fn(gate_proj(x)) * up_proj(x) in the dtype)
// Blocks stride over rows and threads over columns: no 64-bit division per element (a flat
// grid-stride loop spent more time dividing indices than moving data).
template <typename D>
__device__ void swiglu(const typename D::T* gu, typename D::T* out, int rows, int inter) {
    typedef Vec16<D> V;
    const bool vec = inter % V::N == 0 && aligned16(gu) && aligned16(out);
    for (int r = blockIdx.x; r < rows; r += gridDim.x) {
        const typename D::T* g = gu + (size_t)r * 2 * inter;
        const typename D::T* u = g + inter;
        typename D::T* o = out + (size_t)r * inter;
        if (vec) {
            for (int c = threadIdx.x * V::N; c < inter; c += blockDim.x * V::N) {
                float gv[V::N], uv[V::N];
                V::load(g + c, gv);
                V::load(u + c, uv);
                #pragma unroll
                for (int i = 0; i < V::N; ++i) gv[i] = D::round(silu<D>(gv[i])) * uv[i];
                V::store(o + c, gv);
            }
        } else {
            for (int c = threadIdx.x; c < inter; c += blockDim.x) {
                const float gv = D::load(g + c);
                D::store(o + c, D::round(silu<D>(gv)) * D::load(u + c));
            }
        }
    }
}

#define FUSED(TAG, D)                                                                           \
    extern "C" __global__ void rmsnorm_##TAG(const D::T* x, long xs, const D::T* h, long hs,   \
                                             const float* w1, D::T* out, int rows, int cols,  \
                                             float eps) {                                      \
        rmsnorm<D>(x, xs, h, hs, w1, out, rows, cols, eps);                                    \
    }                                                                                          \
    extern "C" __global__ void gnorm_##TAG(const D::T* x, const D::T* z, long zs, const D::T* w, \
                                           D::T* out, int groups, int heads, int dv, float eps) { \
        gnorm<D>(x, z, zs, w, out, groups, heads, dv, eps);                                    \
    }                                                                                          \
    extern "C" __global__ void gates_##TAG(const D::T* ba, long s, const float* dt_bias,       \
                                           const float* neg_a, float* gb, int rows, int hv) {  \
        gates<D>(ba, s, dt_bias, neg_a, gb, rows, hv);                                         \
    }                                                                                          \
    extern "C" __global__ void swiglu_##TAG(const D::T* gu, D::T* out, int rows, int inter) { \
        swiglu<D>(gu, out, rows, inter);                                                       \
    }
FUSED(f32, F32)
FUSED(bf16, BF16)
FUSED(f16, F16)

// ---- Full-attention steps (attention.rs).

// qknorm_rope_<dtype>: one warp per (b, h, t): x [B, T, H, hd] (strides sb, st, sh; the last dim
// contiguous) → out [B, H, T, hd] contiguous:
//   n = round(x̂·w1)  (zero-centred RMSNorm, w1 = 1 + w in f32)
//   out[c] = round(round(n[c]·cos[c]) + round(rot(n)[c]·sin[c]))  for c < rot  (NeoX rotate_half)
//   out[c] = n[c]                                                  otherwise
// cos/sin [B, T, rot] in the dtype (HF rotates in the activation dtype).
#define ROPE_WARPS 4
#define NEG_INF __int_as_float(0xff800000)
#define ROPE_MAX_HD 512
template <typename D>
__device__ void qknorm_rope(const typename D::T* x, long sb, long st, long sh, const float* w1,
                            const typename D::T* cosv, const typename D::T* sinv,
                            typename D::T* out, int B, int T, int H, int hd, int rot, float eps) {
    __shared__ float buf[ROPE_WARPS][ROPE_MAX_HD];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const long r = (long)blockIdx.x * ROPE_WARPS + warp;  // (b, h, t) in output order
    if (r >= (long)B * H * T) return;
    const int t = r % T, h = (r / T) % H, b = r / ((long)T * H);
    const typename D::T* xr = x + b * sb + t * st + h * sh;
    float* n = buf[warp];
    float ss = 0.f;
    for (int c = lane; c < hd; c += 32) {
        const float v = D::load(xr + c);
        n[c] = v;
        ss += v * v;
    }
    const float inv = rsqrtf(warp_sum(ss) / hd + eps);
    for (int c = lane; c < hd; c += 32) n[c] = D::round(n[c] * inv * w1[c]);
    __syncwarp();
    const int half = rot / 2;
    const typename D::T* cr = cosv + ((size_t)b * T + t) * rot;
    const typename D::T* sr = sinv + ((size_t)b * T + t) * rot;
    typename D::T* o = out + (size_t)r * hd;
    for (int c = lane; c < hd; c += 32) {
        float v = n[c];
        if (c < rot) {
            const float rotated = c < half ? -n[c + half] : n[c - half];
            v = D::round(D::round(v * D::load(cr + c)) + D::round(rotated * D::load(sr + c)));
        }
        D::store(o + c, v);
    }
}

// causal_softmax_<dtype>: one warp per row of scores [B, G, T, S] (dtype, contiguous; G = heads
// as the caller groups them; the T queries are the last T of the S keys), key_bias [B, S] f32
// (0 or −inf per key) → probs, same shape and dtype:
//   p = round(softmax_f32(round(s·scale) + key_bias)) over the keys up to the query's own;
// later keys get 0. Only the [B, S] bias crosses from the host, not a [B, T, S] mask.
// A warp per row (blocks of 8 rows) with 16-byte loads where rows are aligned: a block per row
// spent its time in block reductions and scheduling, 20 µs a launch for a 512-key state at 4B
// (ncu, session 9). The three passes re-read the row, from L1 after the first.
template <typename D, int S_>
__device__ __forceinline__ float softmax_max(const typename D::T* sr, const float* mr, int seen,
                                             float scale, int lane) {
    float mx = NEG_INF;
    for (int c = lane * S_; c < seen; c += 32 * S_) {
        float v[S_];
        Run<D, S_>::load(sr + c, v);
        #pragma unroll
        for (int i = 0; i < S_; i++)
            if (c + i < seen) mx = fmaxf(mx, D::round(v[i] * scale) + mr[c + i]);
    }
    #pragma unroll
    for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    return mx;
}
template <typename D, int S_>
__device__ __forceinline__ void softmax_row(const typename D::T* sr, const float* mr,
                                            typename D::T* pr, int S, int seen, float scale,
                                            int lane) {
    const float mx = softmax_max<D, S_>(sr, mr, seen, scale, lane);
    float sum = 0.f;
    for (int c = lane * S_; c < seen; c += 32 * S_) {
        float v[S_];
        Run<D, S_>::load(sr + c, v);
        #pragma unroll
        for (int i = 0; i < S_; i++)
            if (c + i < seen) sum += exp_d<D>(D::round(v[i] * scale) + mr[c + i] - mx);
    }
    const float inv = 1.f / warp_sum(sum);
    for (int c = lane * S_; c < S; c += 32 * S_) {
        float v[S_];
        if (c < seen) Run<D, S_>::load(sr + c, v);
        #pragma unroll
        for (int i = 0; i < S_; i++)
            v[i] = c + i < seen ? exp_d<D>(D::round(v[i] * scale) + mr[c + i] - mx) * inv : 0.f;
        Run<D, S_>::store(pr + c, v);
    }
}
template <typename D>
__device__ void causal_softmax(const typename D::T* s, const float* key_bias, typename D::T* p,
                               int G, int T, int S, float scale, long rows) {
    const long r = (long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (r >= rows) return;  // whole warps
    const int lane = threadIdx.x % 32, t = r % T;
    const long b = r / ((long)G * T);
    const int seen = S - T + t + 1;  // keys this query may see
    const typename D::T* sr = s + r * S;
    const float* mr = key_bias + (size_t)b * S;
    typename D::T* pr = p + r * S;
    constexpr int N = Vec16<D>::N;
    if (S % N == 0 && aligned16(s) && aligned16(p))
        softmax_row<D, N>(sr, mr, pr, S, seen, scale, lane);
    else
        softmax_row<D, 1>(sr, mr, pr, S, seen, scale, lane);
}

// attn_gate_<dtype>: o [B, H, T, hd] contiguous, gate [B, T, H, hd] (strides sb, st, sh) →
// out [B, T, H·hd]: round(o · round(sigmoid(gate))). Blocks stride over the B·T output rows,
// threads over a row's H·hd values (32-bit index math, no 64-bit division per element).
template <typename D>
__device__ void attn_gate(const typename D::T* o, const typename D::T* g, long sb, long st,
                          long sh, typename D::T* out, int B, int T, int H, int hd) {
    for (int row = blockIdx.x; row < B * T; row += gridDim.x) {
        const int b = row / T, t = row % T;
        const typename D::T* gr = g + b * sb + t * st;
        typename D::T* outr = out + (size_t)row * H * hd;
        for (int i = threadIdx.x; i < H * hd; i += blockDim.x) {
            const int h = i / hd, c = i - h * hd;
            const float gv = D::load(gr + h * sh + c);
            const float ov = D::load(o + (((size_t)b * H + h) * T + t) * hd + c);
            D::store(outr + i, ov * D::round(sigmoid<D>(gv)));
        }
    }
}

#define ATTN(TAG, D)                                                                              \
    extern "C" __global__ void qknorm_rope_##TAG(                                                \
        const D::T* x, long sb, long st, long sh, const float* w1, const D::T* cosv,            \
        const D::T* sinv, D::T* out, int B, int T, int H, int hd, int rot, float eps) {          \
        qknorm_rope<D>(x, sb, st, sh, w1, cosv, sinv, out, B, T, H, hd, rot, eps);               \
    }                                                                                            \
    extern "C" __global__ void causal_softmax_##TAG(const D::T* s, const float* key_bias,       \
                                                    D::T* p, int G, int T, int S, float scale,   \
                                                    long rows) {                                 \
        causal_softmax<D>(s, key_bias, p, G, T, S, scale, rows);                                 \
    }                                                                                            \
    extern "C" __global__ void attn_gate_##TAG(const D::T* o, const D::T* g, long sb, long st, \
                                               long sh, D::T* out, int B, int T, int H, int hd) { \
        attn_gate<D>(o, g, sb, st, sh, out, B, T, H, hd);                                        \
    }
ATTN(f32, F32)
ATTN(bf16, BF16)
ATTN(f16, F16)

// conv_cached_<dtype>: the causal conv + SiLU over [cache; x] without building that window, and
// the next cache in the same launch. x rows (stride xs) [B, T, C]; cache [B, K-1, C]; w [C, K].
// out = [y: B·T·C | next: B·(K-1)·C]: y as conv_<dtype>; next[b, r] = window row lengths[b] + r
// (the K-1 raw inputs before row b's end; lengths null: every row has T).
// grid = (ceil(C / (CONV_VEC·blockDim.x)), B, ceil(T / CONV_RUN) + 1). A thread owns CONV_VEC
// channels of a run of CONV_RUN steps and slides the window along it, so each input is read once
// per run, not K times; the last z slice writes the next cache. With K = 4 and 16-byte aligned
// rows a thread moves its channels as 16-byte vectors (2-byte loads left the kernel far from DRAM
// bandwidth); otherwise it walks them one by one. Runs of 4 steps, not 8: with 8, a 512-step
// state gave each multiprocessor too few warps to hide the loads' latency (11–22 µs a launch on
// the H200, ncu, session 9).
#define CONV_RUN 4
#define CONV_VEC 8
template <typename D>
__device__ __forceinline__ void load8(const typename D::T* p, float* v) {
    #pragma unroll
    for (int j = 0; j < CONV_VEC; j += Vec16<D>::N) Vec16<D>::load(p + j, v + j);
}
template <typename D>
__device__ __forceinline__ void store8(typename D::T* p, const float* v) {
    #pragma unroll
    for (int j = 0; j < CONV_VEC; j += Vec16<D>::N) Vec16<D>::store(p + j, v + j);
}
// conv_run's vector path for 16-bit dtypes: the weights, the window and the outputs stay packed
// (16 + 28 + 16 registers where f32 copies took 32 + 56 + 8), a channel at a time widened where
// it is used. Unpacked, the conv needed 96 registers a thread, which held the split conv to 31 %
// occupancy with its loads' latency unhidden (ncu, 4B: 102 µs a layer at 38 % of DRAM
// bandwidth, session 11). The same products in the same order, so the same numbers.
template <typename D, typename Row>
__device__ __forceinline__ void conv_run_packed(const Row& row, const typename D::T* __restrict__ w,
                                                typename D::T* __restrict__ y, int t0, int t1,
                                                int c0, int C) {
    uint4 wq[4];  // w[c0..c0+8, 0..4]: weight (i, j) is value 4i + j
    #pragma unroll
    for (int j = 0; j < 4; j++)
        wq[j] = *reinterpret_cast<const uint4*>(w + (size_t)c0 * 4 + j * CONV_VEC);
    uint4 win[CONV_RUN + 3];
    #pragma unroll
    for (int p = 0; p < CONV_RUN + 3; p++) {
        const typename D::T* src = t0 + p < t1 + 3 ? row(t0 + p, c0) : nullptr;
        win[p] = src ? *reinterpret_cast<const uint4*>(src) : make_uint4(0u, 0u, 0u, 0u);
    }
    unsigned out[CONV_RUN][CONV_VEC / 2];  // two outputs a word
    #pragma unroll
    for (int i = 0; i < CONV_VEC; i++) {
        const uint4& wi = wq[i / 2];
        const int k = 4 * (i % 2);
        const float w0 = unpack8<D>(wi, k), w1 = unpack8<D>(wi, k + 1), w2 = unpack8<D>(wi, k + 2),
                    w3 = unpack8<D>(wi, k + 3);
        #pragma unroll
        for (int r = 0; r < CONV_RUN; r++) {
            const float acc = w0 * unpack8<D>(win[r], i) + w1 * unpack8<D>(win[r + 1], i) +
                              w2 * unpack8<D>(win[r + 2], i) + w3 * unpack8<D>(win[r + 3], i);
            const unsigned h = pack16<D>(silu<D>(acc));
            out[r][i / 2] = i % 2 ? out[r][i / 2] | (h << 16) : h;
        }
    }
    #pragma unroll
    for (int r = 0; r < CONV_RUN; r++)
        if (t0 + r < t1)
            *reinterpret_cast<uint4*>(y + (size_t)(t0 + r) * C + c0) =
                make_uint4(out[r][0], out[r][1], out[r][2], out[r][3]);
}
// One thread's run of the conv: steps t0..t1 (at most CONV_RUN) of channels c0..c0+nc, window
// row p (row 0 is K−1 steps before step 0) read through `row(p, c)`: a pointer, or null for a
// zero row. Outputs at y (row pitch C). `vec`: 8 channels as 16-byte vectors and K = 4.
template <typename D, typename Row>
__device__ __forceinline__ void conv_run(const Row& row, const typename D::T* __restrict__ w,
                                         typename D::T* __restrict__ y, int t0, int t1, int c0,
                                         int nc, int C, int K, bool vec) {
    if constexpr (sizeof(typename D::T) == 2) {
        if (vec) {
            conv_run_packed<D>(row, w, y, t0, t1, c0, C);
            return;
        }
    }
    if (vec) {
        float raw[4 * CONV_VEC];  // w[c0..c0+8, 0..4] by channel
        #pragma unroll
        for (int j = 0; j < 4; j++) load8<D>(w + (size_t)c0 * 4 + j * CONV_VEC, raw + j * CONV_VEC);
        // The run's K-1+CONV_RUN window rows, all loads in flight at once (a loop that loads
        // row by row waits a memory round trip per step).
        float win[CONV_RUN + 3][CONV_VEC], o[CONV_VEC];
        #pragma unroll
        for (int p = 0; p < CONV_RUN + 3; p++)
            if (t0 + p < t1 + 3) {
                const typename D::T* src = row(t0 + p, c0);
                if (src) {
                    load8<D>(src, win[p]);
                } else {
                    #pragma unroll
                    for (int i = 0; i < CONV_VEC; i++) win[p][i] = 0.f;
                }
            }
        #pragma unroll
        for (int r = 0; r < CONV_RUN; r++) {
            if (t0 + r >= t1) break;
            #pragma unroll
            for (int i = 0; i < CONV_VEC; i++) {
                const float acc = raw[4 * i] * win[r][i] + raw[4 * i + 1] * win[r + 1][i] +
                                  raw[4 * i + 2] * win[r + 2][i] + raw[4 * i + 3] * win[r + 3][i];
                o[i] = silu<D>(acc);
            }
            store8<D>(y + (size_t)(t0 + r) * C + c0, o);
        }
        return;
    }
    for (int c = c0; c < c0 + nc; c++)
        for (int t = t0; t < t1; t++) {
            float acc = 0.f;
            for (int j = 0; j < K; j++) {
                const typename D::T* src = row(t + j, c);
                acc += D::load(w + c * K + j) * (src ? D::load(src) : 0.f);
            }
            D::store(y + (size_t)t * C + c, silu<D>(acc));
        }
}

template <typename D>
__device__ void conv_cached(const typename D::T* __restrict__ x, long xs,
                            const typename D::T* __restrict__ cache,
                            const typename D::T* __restrict__ w,
                            const unsigned int* __restrict__ lengths,
                            typename D::T* __restrict__ out, int B, int T, int C, int K) {
    typedef typename D::T E;
    const int c0 = (blockIdx.x * blockDim.x + threadIdx.x) * CONV_VEC, b = blockIdx.y;
    if (c0 >= C) return;
    const int nc = min(CONV_VEC, C - c0);
    const int end = lengths ? (int)lengths[b] : T;
    const int t0 = blockIdx.z * CONV_RUN, t1 = min(t0 + CONV_RUN, T);
    // Row p of batch row b's window, from channel c: K-1 cached rows, then x.
    auto row = [&](int p, int c) -> const E* {
        return p < K - 1 ? cache + ((size_t)b * (K - 1) + p) * C + c
                         : x + ((size_t)b * T + p - (K - 1)) * xs + c;
    };
    const bool vec = nc == CONV_VEC && K == 4 && aligned16(x) && aligned16(cache) && aligned16(w) &&
                     aligned16(out) && (xs * sizeof(E)) % 16 == 0 && (C * sizeof(E)) % 16 == 0;
    if (blockIdx.z == gridDim.z - 1) {  // the next cache: window rows end..end+K-1
        E* next = out + (size_t)B * T * C + (size_t)b * (K - 1) * C;
        if (vec) {  // K - 1 = 3 rows
            float v[3][CONV_VEC];
            #pragma unroll
            for (int r = 0; r < 3; r++) load8<D>(row(end + r, c0), v[r]);
            #pragma unroll
            for (int r = 0; r < 3; r++) store8<D>(next + (size_t)r * C + c0, v[r]);
        } else {
            for (int c = c0; c < c0 + nc; c++)
                for (int r = 0; r < K - 1; r++) next[(size_t)r * C + c] = *row(end + r, c);
        }
        return;
    }
    conv_run<D>(row, w, out + (size_t)b * T * C, t0, t1, c0, nc, C, K, vec);
}

// conv_split_<dtype>: the one-pass forward's conv, the records' states and their branches in one
// launch. xs rows (stride ss) [R, S, C]: state row r has len_s[r] real steps (null: all S) and
// starts from zeros; xb rows (stride bs) [B, T, C]: branch row b continues the last K-1 real
// inputs of state row owners[b] (null: row 0), read in place; w [C, K] → out [R·S + B·T, C]: the
// states' rows, then each branch's. No next cache: nothing keeps one. grid = (ceil(C /
// (CONV_VEC·blockDim.x)), 1, R·ceil(S / CONV_RUN) + B·ceil(T / CONV_RUN)). It replaces two conv
// launches and the copy of the states' windows to the branch rows, with the same arithmetic per
// output.
template <typename D>
__device__ void conv_split(const typename D::T* __restrict__ xs, long ss, int R, int S,
                           const unsigned int* __restrict__ len_s,
                           const typename D::T* __restrict__ xb, long bs, int B, int T,
                           const unsigned int* __restrict__ owners,
                           const typename D::T* __restrict__ w, typename D::T* __restrict__ out,
                           int C, int K) {
    typedef typename D::T E;
    const int c0 = (blockIdx.x * blockDim.x + threadIdx.x) * CONV_VEC;
    if (c0 >= C) return;
    const int nc = min(CONV_VEC, C - c0);
    const bool vec = nc == CONV_VEC && K == 4 && aligned16(xs) && aligned16(xb) && aligned16(w) &&
                     aligned16(out) && (ss * sizeof(E)) % 16 == 0 &&
                     (bs * sizeof(E)) % 16 == 0 && (C * sizeof(E)) % 16 == 0;
    const int runs_s = (S + CONV_RUN - 1) / CONV_RUN, runs_b = (T + CONV_RUN - 1) / CONV_RUN;
    const int z = blockIdx.z;
    if (z < R * runs_s) {
        const int r = z / runs_s, t0 = (z % runs_s) * CONV_RUN;
        const E* x = xs + (size_t)r * S * ss;
        auto row = [&](int p, int c) -> const E* {
            const int t = p - (K - 1);
            return t >= 0 ? x + (size_t)t * ss + c : nullptr;
        };
        conv_run<D>(row, w, out + (size_t)r * S * C, t0, min(t0 + CONV_RUN, S), c0, nc, C, K,
                    vec);
        return;
    }
    const int b = (z - R * runs_s) / runs_b, t0 = ((z - R * runs_s) % runs_b) * CONV_RUN;
    const int o = owners ? (int)owners[b] : 0, end = len_s ? (int)len_s[o] : S;
    const E* x = xs + (size_t)o * S * ss;
    auto row = [&](int p, int c) -> const E* {
        const int t = p - (K - 1);
        if (t >= 0) return xb + ((size_t)b * T + t) * bs + c;
        return end + t >= 0 ? x + (size_t)(end + t) * ss + c : nullptr;
    };
    conv_run<D>(row, w, out + ((size_t)R * S + (size_t)b * T) * C, t0, min(t0 + CONV_RUN, T), c0,
                nc, C, K, vec);
}

// The 16-bit kernels run 8 blocks of 128 threads (CONV_CACHED_BLOCK in cuda.rs) per
// multiprocessor: 64 registers with the packed vector path (bf16 without spills, f16 with 8
// bytes). f32 keeps its 118 registers (capped at 64 it spilled 0.5 KB).
#define CONV_CACHED(TAG, D, MINB)                                                               \
    extern "C" __global__ void __launch_bounds__(128, MINB) conv_cached_##TAG(                  \
        const D::T* x, long xs, const D::T* cache, const D::T* w, const unsigned int* lengths,  \
        D::T* out, int B, int T, int C, int K) {                                                \
        conv_cached<D>(x, xs, cache, w, lengths, out, B, T, C, K);                              \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(128, MINB) conv_split_##TAG(                   \
        const D::T* xs, long ss, int R, int S, const unsigned int* len_s, const D::T* xb,       \
        long bs, int B, int T, const unsigned int* owners, const D::T* w, D::T* out, int C,     \
        int K) {                                                                                \
        conv_split<D>(xs, ss, R, S, len_s, xb, bs, B, T, owners, w, out, C, K);                 \
    }
CONV_CACHED(f32, F32, 1)
CONV_CACHED(bf16, BF16, 8)
CONV_CACHED(f16, F16, 8)

// gather_rows16: out row r = src row idx[r], rows of `units` 16-byte words (any dtype). An index
// at or past `rows` (the host checks them) writes zeros rather than reading outside the source.
// grid = (word blocks, output rows).
extern "C" __global__ void gather_rows16(const uint4* src, const unsigned int* idx, uint4* out,
                                         long units, int rows) {
    const unsigned int from = idx[blockIdx.y];
    const uint4* s = src + (size_t)from * units;
    uint4* o = out + (size_t)blockIdx.y * units;
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < units;
         i += (long)gridDim.x * blockDim.x)
        o[i] = from < (unsigned int)rows ? s[i] : make_uint4(0u, 0u, 0u, 0u);
}

// gather_cat16: out[b, h] = src[idx[b], h] followed by tail[b, h] (any dtype), `us` and `ut`
// 16-byte words a (row, head) of src and of tail: attention's keys or values for a branch row, its
// state row's then its own, in one copy. An index at or past `rows` (the host checks them) gives
// zeros for the src part. grid = (word blocks, B·heads).
extern "C" __global__ void gather_cat16(const uint4* src, const unsigned int* idx, const uint4* tail,
                                        uint4* out, int heads, long us, long ut, int rows) {
    const int bh = blockIdx.y, h = bh % heads;
    const unsigned int from = idx[bh / heads];
    const uint4* s = src + ((size_t)from * heads + h) * us;
    const uint4* t = tail + (size_t)bh * ut;
    uint4* o = out + (size_t)bh * (us + ut);
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < us + ut;
         i += (long)gridDim.x * blockDim.x)
        o[i] = i >= us ? t[i - us] : from < (unsigned int)rows ? s[i] : make_uint4(0u, 0u, 0u, 0u);
}
