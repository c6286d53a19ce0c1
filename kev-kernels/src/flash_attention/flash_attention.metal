// Causal attention in one pass (flash_attention/mod.rs): softmax(q·kᵀ·scale + key_bias)·v with an
// online softmax, no score matrix in memory. Contract of `flash_attention/metal.rs`; the math is
// the CUDA kernel's contract (flash_attention.cu) with every step in f32 (scores, probabilities,
// the weighted sum) and only the output rounded to the dtype.
//
// Grid: threadgroups (ceil(B·Hq·T / 8), 1, 1), threadgroup (256, 1, 1): one simdgroup (32 lanes)
// per query row r = (b, hq, t), r = threadgroup·8 + simdgroup index; a simdgroup past the last
// row returns at once (uniformly). Lane l holds q and the output's running sum for head dims
// l, l + 32, ... (hd ≤ 32·PER_LANE; the entry points take PER_LANE = 8, hd ≤ 256). Per key, one
// simd_sum gives q·k; the running max and sum are then the same in every lane. No threadgroup
// memory, no barriers.
//
// Query t (the last T of this step's L keys) of batch row b, query head hq (kv head
// hq / (Hq/Hkv)), sees the past's S keys (row owners[b] of k_past / v_past), then this step's
// keys 0 ..= L − T + t. key_bias [B, S + L] is added to the scaled scores (−∞ hides a key); a
// row that sees no key gets zeros.
//
//   0 q        [B, Hq, T, hd] T contiguous                                      input
//   1 k        [B, Hkv, L, hd] T at b·k_sb + h·k_sh + l·k_sl (head dims contiguous)   input
//   2 v        [B, Hkv, L, hd] T, strides v_s*                                   input
//   3 k_past   [R, Hkv, S, hd] T, strides kp_s* (bound to q when S = 0)           input
//   4 v_past   [R, Hkv, S, hd] T, strides vp_s* (bound to q when S = 0)           input
//   5 owners   [B] u32: the past row of batch row b (bound to q when S = 0)       input
//   6 key_bias [B, S + L] f32                                                     input
//   7 out      [B, Hq, T, hd] T                                                   output
//   8 params   FlashParams                                                        input (set_bytes)
//
// Entry points: flash_attention_{f32,bf16,f16}.

#include <metal_stdlib>
using namespace metal;

struct FlashParams {
    uint b;
    uint hq;
    uint hkv;
    uint t;  // queries
    uint l;  // this step's keys (the queries are the last t of them)
    uint s;  // past keys per row (0: none)
    uint hd;
    uint k_sb, k_sh, k_sl;
    uint v_sb, v_sh, v_sl;
    uint kp_sb, kp_sh, kp_sl;
    uint vp_sb, vp_sh, vp_sl;
    float scale;
};

constant uint FLASH_SIMD = 32;
constant uint FLASH_ROWS_PER_GROUP = 8;

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

// One key: its score from q (each lane's part, summed over the simdgroup), then the online
// softmax update of the running max `m`, sum `l` and weighted values `acc`.
template <typename T, uint PER_LANE>
inline void flash_key(const thread float* qv, const device T* kr, const device T* vr, float bias,
                      float scale, uint hd, uint lane, thread float& m, thread float& l,
                      thread float* acc) {
    float part = 0.0f;
    for (uint i = 0; i < PER_LANE; ++i) {
        const uint c = lane + i * FLASH_SIMD;
        if (c < hd) {
            part += qv[i] * to_f32(kr[c]);
        }
    }
    const float score = simd_sum(part) * scale + bias;
    if (score == -INFINITY) {
        return; // a hidden key (the same in every lane)
    }
    const float m_new = max(m, score);
    const float correction = exp(m - m_new);
    const float p = exp(score - m_new);
    l = l * correction + p;
    for (uint i = 0; i < PER_LANE; ++i) {
        const uint c = lane + i * FLASH_SIMD;
        if (c < hd) {
            acc[i] = acc[i] * correction + p * to_f32(vr[c]);
        }
    }
    m = m_new;
}

template <typename T, uint PER_LANE>
inline void flash_impl(const device T* q, const device T* k, const device T* v,
                       const device T* k_past, const device T* v_past, const device uint* owners,
                       const device float* key_bias, device T* out, constant FlashParams& p,
                       uint r, uint lane) {
    if (r >= p.b * p.hq * p.t) {
        return;
    }
    const uint t = r % p.t, hq = (r / p.t) % p.hq, b = r / (p.t * p.hq);
    const uint h = hq / (p.hq / p.hkv);
    const device T* qr = q + ulong(r) * p.hd;
    float qv[PER_LANE], acc[PER_LANE];
    for (uint i = 0; i < PER_LANE; ++i) {
        const uint c = lane + i * FLASH_SIMD;
        qv[i] = c < p.hd ? to_f32(qr[c]) : 0.0f;
        acc[i] = 0.0f;
    }
    float m = -INFINITY, l = 0.0f;
    const device float* bias = key_bias + ulong(b) * (p.s + p.l);
    if (p.s > 0) {
        const ulong owner = owners[b];
        const device T* kp = k_past + owner * p.kp_sb + ulong(h) * p.kp_sh;
        const device T* vp = v_past + owner * p.vp_sb + ulong(h) * p.vp_sh;
        for (uint j = 0; j < p.s; ++j) {
            flash_key<T, PER_LANE>(qv, kp + ulong(j) * p.kp_sl, vp + ulong(j) * p.vp_sl, bias[j],
                                   p.scale, p.hd, lane, m, l, acc);
        }
    }
    const device T* kn = k + ulong(b) * p.k_sb + ulong(h) * p.k_sh;
    const device T* vn = v + ulong(b) * p.v_sb + ulong(h) * p.v_sh;
    const uint seen = p.l - p.t + t + 1;
    for (uint j = 0; j < seen; ++j) {
        flash_key<T, PER_LANE>(qv, kn + ulong(j) * p.k_sl, vn + ulong(j) * p.v_sl, bias[p.s + j],
                               p.scale, p.hd, lane, m, l, acc);
    }
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    device T* o = out + ulong(r) * p.hd;
    for (uint i = 0; i < PER_LANE; ++i) {
        const uint c = lane + i * FLASH_SIMD;
        if (c < p.hd) {
            o[c] = from_f32<T>(acc[i] * inv);
        }
    }
}

#define FLASH_ENTRY(NAME, T)                                                                    \
    kernel void flash_attention_##NAME(                                                         \
        const device T* q [[buffer(0)]],                                                        \
        const device T* k [[buffer(1)]],                                                        \
        const device T* v [[buffer(2)]],                                                        \
        const device T* k_past [[buffer(3)]],                                                   \
        const device T* v_past [[buffer(4)]],                                                   \
        const device uint* owners [[buffer(5)]],                                                \
        const device float* key_bias [[buffer(6)]],                                             \
        device T* out [[buffer(7)]],                                                            \
        constant FlashParams& p [[buffer(8)]],                                                  \
        uint tg [[threadgroup_position_in_grid]],                                               \
        uint sg_index [[simdgroup_index_in_threadgroup]],                                       \
        uint lane [[thread_index_in_simdgroup]]                                                 \
    ) {                                                                                         \
        flash_impl<T, 8>(q, k, v, k_past, v_past, owners, key_bias, out, p,                     \
                      tg * FLASH_ROWS_PER_GROUP + sg_index, lane);                              \
    }

FLASH_ENTRY(f32, float)
FLASH_ENTRY(bf16, ushort)
FLASH_ENTRY(f16, half)
