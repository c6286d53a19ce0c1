// Gated delta rule recurrence (Gated DeltaNet), sequential over time. Contract of `src/metal.rs`;
// the math is the CPU op's (`src/gated_delta_rule.rs`):
//   q ← l2norm(q)·scale, k ← l2norm(k)   (eps on Σx², scale = 1/√Dk)
//   S ← exp(g)·S;  δ ← β·(v − Sᵀk);  S ← S + k ⊗ δ;  o = Sᵀq
//
// Grid: threadgroups (ceil(Dv / COLS), Hv, B), threadgroup (32·COLS, 1, 1), COLS = the number of
// simdgroups per threadgroup (the host uses 4). Apple GPUs run 32-wide simdgroups (the host checks
// the pipeline's threadExecutionWidth).
// Each simdgroup owns one (batch b, value head h, value column j), j = tg.x·COLS + simdgroup index.
// Lane l holds the state column S[i, j] for i = l + 32·r, r < NK (NK = ceil(Dk/32) rounded up to a
// compiled variant; rows i ≥ Dk are held as 0 and never stored), in registers for the whole
// sequence. Per step, two simd_sum give the l2 norms of q and k, one gives Sᵀk, one gives Sᵀq;
// lane 0 writes o. No threadgroup memory, no threadgroup barriers: simdgroups are independent.
// A simdgroup whose column j ≥ Dv returns at once (uniformly across its lanes).
//
// Buffers (all contiguous, element offsets already applied by the host):
//   0 qkv     [B, T, 2·Hk·Dk + Hv·Dv]  T (f32 | bf16 as ushort | f16)   input
//             packed [q (Hk·Dk) | k (Hk·Dk) | v (Hv·Dv)]; value head h reads key head h / (Hv/Hk)
//   1 gb      [B, T, Hv, 2] f32, (g = log decay, β)                     input
//   2 state   [B, Hv, Dk, Dv] f32                                       input AND output (in place)
//   3 o       [B, T, Hv, Dv] T                                          output
//   4 lengths [B] u32: steps t ≥ lengths[b] are skipped (state untouched, o = 0)   input
//   5 params  GdrParams                                                 input (set_bytes)
//
// Entry points: gated_delta_rule_{f32,bf16,f16}_nk{1,2,4,8} (Dk ≤ 32·NK).

#include <metal_stdlib>
using namespace metal;

struct GdrParams {
    uint b;      // batch
    uint t;      // steps
    uint hk;     // key heads
    uint hv;     // value heads (a multiple of hk)
    uint dk;     // key head size (≤ 256)
    uint dv;     // value head size
    float scale; // query scale, 1/√Dk
    float eps;   // l2norm epsilon, added to Σx²
};

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

constant uint SIMD_W = 32;

template <typename T, uint NK>
inline void gdr_impl(
    const device T* qkv,
    const device float* gb,
    device float* state,
    device T* o,
    constant uint* lengths,
    constant GdrParams& p,
    uint3 tg,
    uint sg,
    uint sgs,
    uint lane
) {
    const uint j = tg.x * sgs + sg;
    const uint h = tg.y;
    const uint b = tg.z;
    if (j >= p.dv) {
        return; // the whole simdgroup: j does not depend on the lane
    }
    const uint kh = h / (p.hv / p.hk);
    const uint channels = 2 * p.hk * p.dk + p.hv * p.dv;
    const uint len = min(lengths[b], p.t);

    device float* s_col = state + (ulong(b) * p.hv + h) * p.dk * p.dv + j;
    float s[NK];
    for (uint r = 0; r < NK; ++r) {
        const uint i = lane + SIMD_W * r;
        s[r] = i < p.dk ? s_col[ulong(i) * p.dv] : 0.0f;
    }

    for (uint t = 0; t < len; ++t) {
        const ulong bt = ulong(b) * p.t + t;
        const device T* row = qkv + bt * channels;
        float q[NK];
        float k[NK];
        float qq = 0.0f;
        float kk = 0.0f;
        for (uint r = 0; r < NK; ++r) {
            const uint i = lane + SIMD_W * r;
            q[r] = i < p.dk ? to_f32(row[kh * p.dk + i]) : 0.0f;
            k[r] = i < p.dk ? to_f32(row[(p.hk + kh) * p.dk + i]) : 0.0f;
            qq += q[r] * q[r];
            kk += k[r] * k[r];
        }
        qq = simd_sum(qq);
        kk = simd_sum(kk);
        const float q_scale = p.scale * rsqrt(qq + p.eps);
        const float k_scale = rsqrt(kk + p.eps);

        const device float* gate = gb + (bt * p.hv + h) * 2;
        const float decay = exp(gate[0]);
        const float beta = gate[1];

        // Decay the state and read it with k.
        float kv = 0.0f;
        for (uint r = 0; r < NK; ++r) {
            k[r] *= k_scale;
            s[r] *= decay;
            kv += s[r] * k[r];
        }
        kv = simd_sum(kv);
        const float v = to_f32(row[2 * p.hk * p.dk + h * p.dv + j]);
        const float delta = beta * (v - kv);

        // Rank-1 update, then read with q.
        float out = 0.0f;
        for (uint r = 0; r < NK; ++r) {
            s[r] += k[r] * delta;
            out += s[r] * (q[r] * q_scale);
        }
        out = simd_sum(out);
        if (lane == 0) {
            o[(bt * p.hv + h) * p.dv + j] = from_f32<T>(out);
        }
    }
    // Padded steps of this row: zero output.
    if (lane == 0) {
        for (uint t = len; t < p.t; ++t) {
            o[((ulong(b) * p.t + t) * p.hv + h) * p.dv + j] = from_f32<T>(0.0f);
        }
    }

    for (uint r = 0; r < NK; ++r) {
        const uint i = lane + SIMD_W * r;
        if (i < p.dk) {
            s_col[ulong(i) * p.dv] = s[r];
        }
    }
}

#define GDR_ENTRY(TNAME, T, NK)                                                                 \
    kernel void gated_delta_rule_##TNAME##_nk##NK(                                              \
        const device T* qkv [[buffer(0)]],                                                      \
        const device float* gb [[buffer(1)]],                                                   \
        device float* state [[buffer(2)]],                                                      \
        device T* o [[buffer(3)]],                                                              \
        constant uint* lengths [[buffer(4)]],                                                   \
        constant GdrParams& p [[buffer(5)]],                                                    \
        uint3 tg [[threadgroup_position_in_grid]],                                              \
        uint sg [[simdgroup_index_in_threadgroup]],                                             \
        uint sgs [[simdgroups_per_threadgroup]],                                                \
        uint lane [[thread_index_in_simdgroup]]                                                 \
    ) {                                                                                         \
        gdr_impl<T, NK>(qkv, gb, state, o, lengths, p, tg, sg, sgs, lane);                      \
    }

#define GDR_ENTRIES(TNAME, T)                                                                   \
    GDR_ENTRY(TNAME, T, 1)                                                                      \
    GDR_ENTRY(TNAME, T, 2)                                                                      \
    GDR_ENTRY(TNAME, T, 4)                                                                      \
    GDR_ENTRY(TNAME, T, 8)

GDR_ENTRIES(f32, float)
GDR_ENTRIES(bf16, ushort)
GDR_ENTRIES(f16, half)
