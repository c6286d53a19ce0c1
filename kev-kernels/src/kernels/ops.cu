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
    static __device__ __forceinline__ float round(float v) { return v; }
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
    static __device__ __forceinline__ float round(float v) {
        unsigned short h;
        store(&h, v);
        return load(&h);
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
    static __device__ __forceinline__ float round(float v) {
        unsigned short h;
        store(&h, v);
        return load(&h);
    }
};

__device__ __forceinline__ float warp_sum(float v) {
    #pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

// One step's inputs for the columns a warp owns, loaded a step ahead of their use so the loads
// overlap the previous step's arithmetic.
template <typename D, int NK, int COLS>
struct GdrStep {
    float q[NK], k[NK], v[COLS], g, beta;
    __device__ __forceinline__ void load(const typename D::T* row, const float* gbt, int lane,
                                         int qoff, int koff, int voff, int dk) {
        #pragma unroll
        for (int i = 0; i < NK; i++) {
            const int r = lane + 32 * i;
            q[i] = r < dk ? D::load(row + qoff + r) : 0.f;
            k[i] = r < dk ? D::load(row + koff + r) : 0.f;
        }
        #pragma unroll
        for (int c = 0; c < COLS; c++) v[c] = D::load(row + voff + c);
        g = gbt[0];
        beta = gbt[1];
    }
};

// Per step, one warp-wide reduction round carries every sum the step needs: |q|², |k|², and per
// column S·k and S·q (S already decayed), plus k·q. With k̂ = k/|k|, q̂ = q·scale/|q|:
//   δ = β(v − Sᵀk̂),  S ← S + k̂δ,  o = Sᵀq̂ = (Sᵀq + δ·(k·q)/|k|)·scale/|q|
// so the output needs no second reduction after the update.
template <typename D, int NK, int COLS>
__device__ void gdr(const typename D::T* __restrict__ qkv, const float* __restrict__ gb,
                    float* __restrict__ state, typename D::T* __restrict__ out,
                    const unsigned int* __restrict__ lengths,
                    int T, int hk, int hv, int dk, int dv) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int j0 = (blockIdx.x * WARPS + warp) * COLS;
    if (j0 >= dv) return;  // whole warps leave together; dv is a multiple of COLS
    const int bh = blockIdx.y, b = bh / hv, h = bh % hv, kh = h / (hv / hk);
    const int channels = 2 * hk * dk + hv * dv;
    const float scale = rsqrtf((float)dk);
    float* st = state + (size_t)bh * dk * dv;
    const int len = min((int)lengths[b], T);
    for (int t = len + lane; t < T; t += 32) {
        #pragma unroll
        for (int c = 0; c < COLS; c++)
            D::store(out + (((size_t)b * T + t) * hv + h) * dv + j0 + c, 0.f);
    }
    if (len == 0) return;
    float s[COLS][NK];
    #pragma unroll
    for (int i = 0; i < NK; i++) {
        const int r = lane + 32 * i;
        #pragma unroll
        for (int c = 0; c < COLS; c++) s[c][i] = r < dk ? st[(size_t)r * dv + j0 + c] : 0.f;
    }
    const int qoff = kh * dk, koff = (hk + kh) * dk, voff = 2 * hk * dk + h * dv + j0;
    const typename D::T* rows = qkv + (size_t)b * T * channels;
    const float* gates = gb + ((size_t)b * T * hv + h) * 2;
    GdrStep<D, NK, COLS> next;
    next.load(rows, gates, lane, qoff, koff, voff, dk);
    for (int t = 0; t < len; t++) {
        const GdrStep<D, NK, COLS> cur = next;
        if (t + 1 < len)
            next.load(rows + (size_t)(t + 1) * channels, gates + (size_t)(t + 1) * hv * 2, lane,
                      qoff, koff, voff, dk);
        const float decay = expf(cur.g);
        float qq = 0.f, kk = 0.f, kq = 0.f, sk[COLS], sq[COLS];
        #pragma unroll
        for (int c = 0; c < COLS; c++) sk[c] = sq[c] = 0.f;
        #pragma unroll
        for (int i = 0; i < NK; i++) {
            qq += cur.q[i] * cur.q[i];
            kk += cur.k[i] * cur.k[i];
            kq += cur.k[i] * cur.q[i];
            #pragma unroll
            for (int c = 0; c < COLS; c++) {
                s[c][i] *= decay;
                sk[c] += s[c][i] * cur.k[i];
                sq[c] += s[c][i] * cur.q[i];
            }
        }
        #pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            qq += __shfl_xor_sync(0xffffffffu, qq, off);
            kk += __shfl_xor_sync(0xffffffffu, kk, off);
            kq += __shfl_xor_sync(0xffffffffu, kq, off);
            #pragma unroll
            for (int c = 0; c < COLS; c++) {
                sk[c] += __shfl_xor_sync(0xffffffffu, sk[c], off);
                sq[c] += __shfl_xor_sync(0xffffffffu, sq[c], off);
            }
        }
        const float ks = 1.f / sqrtf(kk + L2NORM_EPS);
        const float qs = scale / sqrtf(qq + L2NORM_EPS);
        typename D::T* o = out + (((size_t)b * T + t) * hv + h) * dv + j0;
        #pragma unroll
        for (int c = 0; c < COLS; c++) {
            const float delta = (cur.v[c] - sk[c] * ks) * cur.beta;
            const float kd = ks * delta;
            #pragma unroll
            for (int i = 0; i < NK; i++) s[c][i] += cur.k[i] * kd;
            if (lane == 0) D::store(o + c, qs * (sq[c] + kd * kq));
        }
    }
    #pragma unroll
    for (int i = 0; i < NK; i++) {
        const int r = lane + 32 * i;
        #pragma unroll
        for (int c = 0; c < COLS; c++)
            if (r < dk) st[(size_t)r * dv + j0 + c] = s[c][i];
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
    const int r = blockIdx.x;
    const typename D::T* xr = x + (size_t)r * xs;
    typename D::T* sum = out + (size_t)r * cols;
    typename D::T* normed = out + (h ? (size_t)rows * cols : 0) + (size_t)r * cols;
    float ss = 0.f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        float v = D::load(xr + c);
        if (h) {
            v = D::round(v + D::load(h + (size_t)r * hs + c));
            D::store(sum + c, v);
        }
        ss += v * v;
    }
    const float inv = rsqrtf(block_sum(ss) / cols + eps);
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        const float v = h ? D::load(sum + c) : D::load(xr + c);
        D::store(normed + c, v * inv * w1[c]);
    }
}

// gnorm_<dtype>: the DeltaNet output norm, one warp per (row, head): x [rows·heads, dv]
// contiguous, z rows (stride zs) holding heads·dv gate values, w [dv] in the dtype.
//   out = round(round(round(x̂)·w) · silu(z))   (HF Qwen3_5RMSNormGated)
template <typename D>
__device__ void gnorm(const typename D::T* x, const typename D::T* z, long zs,
                      const typename D::T* w, typename D::T* out, int groups, int heads, int dv,
                      float eps) {
    const int gi = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (gi >= groups) return;
    const typename D::T* xr = x + (size_t)gi * dv;
    const typename D::T* zr = z + (size_t)(gi / heads) * zs + (size_t)(gi % heads) * dv;
    float ss = 0.f;
    for (int c = lane; c < dv; c += 32) {
        const float v = D::load(xr + c);
        ss += v * v;
    }
    const float inv = rsqrtf(warp_sum(ss) / dv + eps);
    for (int c = lane; c < dv; c += 32) {
        const float n = D::round(D::round(D::load(xr + c) * inv) * D::load(w + c));
        const float g = D::load(zr + c);
        D::store(out + (size_t)gi * dv + c, n * (g / (1.f + expf(-g))));
    }
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
        gb[2 * i + 1] = D::round(1.f / (1.f + expf(-b)));
    }
}

// swiglu_<dtype>: gu [rows, 2·inter] contiguous ([gate | up] per row) → out [rows, inter]:
//   round(round(silu(gate)) · up)   (HF: act_fn(gate_proj(x)) * up_proj(x) in the dtype)
template <typename D>
__device__ void swiglu(const typename D::T* gu, typename D::T* out, int rows, int inter) {
    const size_t n = (size_t)rows * inter;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t r = i / inter, c = i % inter;
        const float g = D::load(gu + r * 2 * inter + c), u = D::load(gu + r * 2 * inter + inter + c);
        D::store(out + i, D::round(g / (1.f + expf(-g))) * u);
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

// masked_softmax_<dtype>: one block per row of scores [B, G, T, S] (dtype, contiguous; G = heads
// as the caller groups them), mask [B, T, S] f32 (0 or −inf) → probs, same shape and dtype:
//   p = round(softmax_f32(round(s·scale) + mask))
template <typename D>
__device__ void masked_softmax(const typename D::T* s, const float* mask, typename D::T* p,
                               int G, int T, int S, float scale) {
    __shared__ float red[32];
    const long r = blockIdx.x;
    const int t = r % T, b = r / ((long)G * T);
    const typename D::T* sr = s + r * S;
    const float* mr = mask + ((size_t)b * T + t) * S;
    const int lane = threadIdx.x % 32, w = threadIdx.x / 32, nw = blockDim.x / 32;
    float mx = NEG_INF;
    for (int c = threadIdx.x; c < S; c += blockDim.x)
        mx = fmaxf(mx, D::round(D::load(sr + c) * scale) + mr[c]);
    #pragma unroll
    for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    if (lane == 0) red[w] = mx;
    __syncthreads();
    mx = lane < nw ? red[lane] : NEG_INF;
    #pragma unroll
    for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    float sum = 0.f;
    for (int c = threadIdx.x; c < S; c += blockDim.x)
        sum += expf(D::round(D::load(sr + c) * scale) + mr[c] - mx);
    sum = block_sum(sum);
    const float inv = 1.f / sum;
    for (int c = threadIdx.x; c < S; c += blockDim.x)
        D::store(p + r * S + c, expf(D::round(D::load(sr + c) * scale) + mr[c] - mx) * inv);
}

// attn_gate_<dtype>: o [B, H, T, hd] contiguous, gate [B, T, H, hd] (strides sb, st, sh) →
// out [B, T, H·hd]: round(o · round(sigmoid(gate))).
template <typename D>
__device__ void attn_gate(const typename D::T* o, const typename D::T* g, long sb, long st,
                          long sh, typename D::T* out, int B, int T, int H, int hd) {
    const size_t n = (size_t)B * T * H * hd;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const int c = i % hd, h = (i / hd) % H, t = (i / ((size_t)hd * H)) % T;
        const int b = i / ((size_t)hd * H * T);
        const float gv = D::load(g + b * sb + t * st + h * sh + c);
        const float ov = D::load(o + (((size_t)b * H + h) * T + t) * hd + c);
        D::store(out + i, ov * D::round(1.f / (1.f + expf(-gv))));
    }
}

#define ATTN(TAG, D)                                                                              \
    extern "C" __global__ void qknorm_rope_##TAG(                                                \
        const D::T* x, long sb, long st, long sh, const float* w1, const D::T* cosv,            \
        const D::T* sinv, D::T* out, int B, int T, int H, int hd, int rot, float eps) {          \
        qknorm_rope<D>(x, sb, st, sh, w1, cosv, sinv, out, B, T, H, hd, rot, eps);               \
    }                                                                                            \
    extern "C" __global__ void masked_softmax_##TAG(const D::T* s, const float* mask, D::T* p,  \
                                                    int G, int T, int S, float scale) {          \
        masked_softmax<D>(s, mask, p, G, T, S, scale);                                           \
    }                                                                                            \
    extern "C" __global__ void attn_gate_##TAG(const D::T* o, const D::T* g, long sb, long st, \
                                               long sh, D::T* out, int B, int T, int H, int hd) { \
        attn_gate<D>(o, g, sb, st, sh, out, B, T, H, hd);                                        \
    }
ATTN(f32, F32)
ATTN(bf16, BF16)
ATTN(f16, F16)
