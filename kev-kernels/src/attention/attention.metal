// The elementwise steps of a full-attention layer (attention/mod.rs). Contract of
// `attention/metal.rs`; the math and rounding are the CPU ops' and attention.cu's.
//
// qk_norm_rope_{f32,bf16,f16}: one simdgroup per output row r = (b, h, t), r = threadgroup·8 +
// simdgroup index (threadgroups (ceil(B·H·T / 8), 1, 1) of 256 threads); a simdgroup past the
// last row returns at once. One simd_sum gives Σx²; a lane recomputes the normed value its
// rotation partner needs from x (no threadgroup memory, no barriers).
//   0 x        [B, T, H, hd] T at b·sb + t·st + h·sh (the last dim contiguous)    input
//   1 w1       [hd] f32 (1 + w)                                                    input
//   2 cos_sin  [2, B, T, rot] T: cos, then sin                                     input
//   3 out      [B, H, T, hd] T                                                     output
//   4 params   QkNormRopeParams                                                    set_bytes
//   n = round(x̂·w1);  out[c] = round(round(n[c]·cos[c]) + round(rot(n)[c]·sin[c])) for c < rot
//   (NeoX rotate_half: rot(n)[c] = −n[c + rot/2] below rot/2, n[c − rot/2] above), n[c] beyond.
//
// causal_softmax_{f32,bf16,f16}: one simdgroup per score row (same grid over the rows), three
// passes over the row (max, sum, write) with simd_max / simd_sum.
//   0 s         [B, G, T, S] T contiguous; the T queries are the last T of the S keys   input
//   1 key_bias  [B, S] f32, 0 or −∞ per key                                          input
//   2 p         [B, G, T, S] T                                                       output
//   3 params    SoftmaxParams                                                        set_bytes
//   p = round(softmax_f32(round(s·scale) + key_bias)) over keys ..= S − T + t; later keys 0.
//
// attention_gate_{f32,bf16,f16}: one thread per output element (threadgroups of 256; threads past
// the end return at once).
//   0 o       [B, H, T, hd] T contiguous                                         input
//   1 gate    [B, T, H, hd] T at b·sb + t·st + h·sh (the last dim contiguous)    input
//   2 out     [B, T, H·hd] T                                                     output
//   3 params  GateParams                                                         set_bytes
//   out = round(o · round(sigmoid(gate)))

#include <metal_stdlib>
using namespace metal;

struct QkNormRopeParams {
    uint b;
    uint t;
    uint h;
    uint hd;
    uint rot;
    uint sb; // element strides of x
    uint st;
    uint sh;
    float eps;
};

struct SoftmaxParams {
    uint rows;   // B·G·T
    uint groups; // G
    uint t;      // queries
    uint s;      // keys
    float scale;
};

struct GateParams {
    uint b;
    uint t;
    uint h;
    uint hd;
    uint sb; // element strides of gate
    uint st;
    uint sh;
};

constant uint ATTN_SIMD = 32;
constant uint ATTN_ROWS_PER_GROUP = 8;

// bf16 travels as ushort: widen by shifting into the high half of an f32.
inline float to_f32(float x) { return x; }
inline float to_f32(half x) { return float(x); }
inline float to_f32(ushort x) { return as_type<float>(uint(x) << 16); }

template <typename T> inline T from_f32(float x);
template <> inline float from_f32<float>(float x) { return x; }
template <> inline half from_f32<half>(float x) { return half(x); }
// f32 → bf16, rounding to nearest even; NaNs stay (quiet) NaNs.
template <> inline ushort from_f32<ushort>(float x) {
    uint u = as_type<uint>(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return ushort((u >> 16) | 0x40u);
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    return ushort(u >> 16);
}

// x rounded to T and widened again: where HF's PyTorch code holds a value in the activation dtype.
template <typename T> inline float round_to(float x) { return to_f32(from_f32<T>(x)); }

template <typename T>
inline void qk_norm_rope_impl(const device T* x, const device float* w1, const device T* cos_sin,
                              device T* out, constant QkNormRopeParams& p, uint r, uint lane) {
    if (r >= p.b * p.h * p.t) {
        return;
    }
    const uint t = r % p.t, h = (r / p.t) % p.h, b = r / (p.t * p.h);
    const device T* xr = x + ulong(b) * p.sb + ulong(t) * p.st + ulong(h) * p.sh;
    float ss = 0.0f;
    for (uint c = lane; c < p.hd; c += ATTN_SIMD) {
        const float v = to_f32(xr[c]);
        ss += v * v;
    }
    const float inv = rsqrt(simd_sum(ss) / float(p.hd) + p.eps);
    const uint half_rot = p.rot / 2;
    const device T* cr = cos_sin + (ulong(b) * p.t + t) * p.rot;
    const device T* sr = cr + ulong(p.b) * p.t * p.rot;
    device T* o = out + ulong(r) * p.hd;
    for (uint c = lane; c < p.hd; c += ATTN_SIMD) {
        float v = round_to<T>(to_f32(xr[c]) * inv * w1[c]);
        if (c < p.rot) {
            const uint partner = c < half_rot ? c + half_rot : c - half_rot;
            const float n = round_to<T>(to_f32(xr[partner]) * inv * w1[partner]);
            const float rotated = c < half_rot ? -n : n;
            v = round_to<T>(round_to<T>(v * to_f32(cr[c])) + round_to<T>(rotated * to_f32(sr[c])));
        }
        o[c] = from_f32<T>(v);
    }
}

template <typename T>
inline void causal_softmax_impl(const device T* s, const device float* key_bias, device T* p,
                                constant SoftmaxParams& sp, uint r, uint lane) {
    if (r >= sp.rows) {
        return;
    }
    const uint t = r % sp.t, b = r / (sp.groups * sp.t);
    const uint seen = sp.s - sp.t + t + 1; // keys this query may see
    const device T* sr = s + ulong(r) * sp.s;
    const device float* mr = key_bias + ulong(b) * sp.s;
    device T* pr = p + ulong(r) * sp.s;
    float mx = -INFINITY;
    for (uint c = lane; c < seen; c += ATTN_SIMD) {
        mx = max(mx, round_to<T>(to_f32(sr[c]) * sp.scale) + mr[c]);
    }
    mx = simd_max(mx);
    float sum = 0.0f;
    for (uint c = lane; c < seen; c += ATTN_SIMD) {
        sum += exp(round_to<T>(to_f32(sr[c]) * sp.scale) + mr[c] - mx);
    }
    const float inv = 1.0f / simd_sum(sum);
    for (uint c = lane; c < sp.s; c += ATTN_SIMD) {
        float v = 0.0f;
        if (c < seen) {
            v = exp(round_to<T>(to_f32(sr[c]) * sp.scale) + mr[c] - mx) * inv;
        }
        pr[c] = from_f32<T>(v);
    }
}

template <typename T>
inline void attention_gate_impl(const device T* o, const device T* gate, device T* out,
                                constant GateParams& p, uint gid) {
    const uint width = p.h * p.hd;
    if (gid >= p.b * p.t * width) {
        return;
    }
    const uint i = gid % width, row = gid / width;
    const uint b = row / p.t, t = row % p.t, h = i / p.hd, c = i % p.hd;
    const float g = to_f32(gate[ulong(b) * p.sb + ulong(t) * p.st + ulong(h) * p.sh + c]);
    const float v = to_f32(o[((ulong(b) * p.h + h) * p.t + t) * p.hd + c]);
    out[gid] = from_f32<T>(v * round_to<T>(1.0f / (1.0f + exp(-g))));
}

#define ATTN_ENTRIES(NAME, T)                                                                   \
    kernel void qk_norm_rope_##NAME(                                                            \
        const device T* x [[buffer(0)]],                                                        \
        const device float* w1 [[buffer(1)]],                                                   \
        const device T* cos_sin [[buffer(2)]],                                                  \
        device T* out [[buffer(3)]],                                                            \
        constant QkNormRopeParams& p [[buffer(4)]],                                             \
        uint tg [[threadgroup_position_in_grid]],                                               \
        uint sg_index [[simdgroup_index_in_threadgroup]],                                       \
        uint lane [[thread_index_in_simdgroup]]                                                 \
    ) {                                                                                         \
        qk_norm_rope_impl<T>(x, w1, cos_sin, out, p, tg * ATTN_ROWS_PER_GROUP + sg_index, lane); \
    }                                                                                           \
    kernel void causal_softmax_##NAME(                                                          \
        const device T* s [[buffer(0)]],                                                        \
        const device float* key_bias [[buffer(1)]],                                             \
        device T* p [[buffer(2)]],                                                              \
        constant SoftmaxParams& sp [[buffer(3)]],                                               \
        uint tg [[threadgroup_position_in_grid]],                                               \
        uint sg_index [[simdgroup_index_in_threadgroup]],                                       \
        uint lane [[thread_index_in_simdgroup]]                                                 \
    ) {                                                                                         \
        causal_softmax_impl<T>(s, key_bias, p, sp, tg * ATTN_ROWS_PER_GROUP + sg_index, lane);  \
    }                                                                                           \
    kernel void attention_gate_##NAME(                                                          \
        const device T* o [[buffer(0)]],                                                        \
        const device T* gate [[buffer(1)]],                                                     \
        device T* out [[buffer(2)]],                                                            \
        constant GateParams& p [[buffer(3)]],                                                   \
        uint gid [[thread_position_in_grid]]                                                    \
    ) {                                                                                         \
        attention_gate_impl<T>(o, gate, out, p, gid);                                           \
    }

ATTN_ENTRIES(f32, float)
ATTN_ENTRIES(bf16, ushort)
ATTN_ENTRIES(f16, half)
