// Compiled by nvcc (build.rs) or NVRTC, common.cuh prepended (no CUDA headers: bf16 and f16 are
// read and written as 16-bit integers); the constants shared with the Rust launcher come as
// -D defines (backend/cuda/catalog.rs).
//
// The full-attention steps.

// qknorm_rope_<dtype>: one warp per (b, h, t): x [B, T, H, hd] (strides sb, st, sh; the last dim
// contiguous) → out [B, H, T, hd] contiguous:
//   n = round(x̂·w1)  (zero-centred RMSNorm, w1 = 1 + w in f32)
//   out[c] = round(round(n[c]·cos[c]) + round(rot(n)[c]·sin[c]))  for c < rot  (NeoX rotate_half)
//   out[c] = n[c]                                                  otherwise
// cos/sin [B, T, rot] in the dtype (HF rotates in the activation dtype). ROPE_WARPS warps per
// block, hd at most ROPE_MAX_HEAD_DIM (-D defines).
#define NEG_INF __int_as_float(0xff800000)
template <typename D>
__device__ void qknorm_rope(const typename D::T* x, long sb, long st, long sh, const float* w1,
                            const typename D::T* cosv, const typename D::T* sinv,
                            typename D::T* out, int B, int T, int H, int hd, int rot, float eps) {
    __shared__ float buf[ROPE_WARPS][ROPE_MAX_HEAD_DIM];
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
// (ncu). The three passes re-read the row, from L1 after the first.
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
