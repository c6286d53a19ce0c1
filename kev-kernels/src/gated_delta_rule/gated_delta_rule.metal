// Gated delta rule recurrence (Gated DeltaNet): sequential over time here, chunked on simdgroup
// matrices further down (`gated_delta_rule_chunked_*`). Contract of `metal.rs` beside this file;
// the math is the CPU op's (`cpu.rs`):
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
//
// The split form (records' state rows, then branch rows continuing them: two dispatches, the
// second ordered after the first by the buffer it reads) has two more entry points per variant,
// the same buffers and grid, the state's role changed (GDR_FROM_ZERO, GDR_FROM_OWNER below):
//   gated_delta_rule_states_*: each row starts from a zero state; state [B, Hv, Dk, Dv] is
//     output only (the rows' final states).
//   gated_delta_rule_branches_*: row b starts from state row owners[b] (buffer 6, [B] u32) of
//     state [R, Hv, Dk, Dv], the states' final states; state is input only, nothing is stored.
// The arithmetic is the in-place entry's: the numbers of a zero state filled, or of the state
// rows copied to the branch rows, then the in-place entry.

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

// Where a row's initial state comes from and where its final state goes.
constexpr constant uint GDR_IN_PLACE = 0;   // read state row b, write it back
constexpr constant uint GDR_FROM_ZERO = 1;  // start from zeros, write state row b
constexpr constant uint GDR_FROM_OWNER = 2; // start from state row owners[b], store nothing

template <typename T, uint NK, uint MODE>
inline void gdr_impl(
    const device T* qkv,
    const device float* gb,
    device float* state,
    device T* o,
    constant uint* lengths,
    constant GdrParams& p,
    const device uint* owners,
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

    const uint source = MODE == GDR_FROM_OWNER ? owners[b] : b;
    device float* s_col = state + (ulong(source) * p.hv + h) * p.dk * p.dv + j;
    float s[NK];
    for (uint r = 0; r < NK; ++r) {
        const uint i = lane + SIMD_W * r;
        s[r] = MODE != GDR_FROM_ZERO && i < p.dk ? s_col[ulong(i) * p.dv] : 0.0f;
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
        if (MODE != GDR_FROM_OWNER && i < p.dk) {
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
        gdr_impl<T, NK, GDR_IN_PLACE>(qkv, gb, state, o, lengths, p, nullptr, tg, sg, sgs,      \
                                      lane);                                                    \
    }                                                                                           \
    kernel void gated_delta_rule_states_##TNAME##_nk##NK(                                       \
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
        gdr_impl<T, NK, GDR_FROM_ZERO>(qkv, gb, state, o, lengths, p, nullptr, tg, sg, sgs,     \
                                       lane);                                                   \
    }                                                                                           \
    kernel void gated_delta_rule_branches_##TNAME##_nk##NK(                                     \
        const device T* qkv [[buffer(0)]],                                                      \
        const device float* gb [[buffer(1)]],                                                   \
        device float* state [[buffer(2)]],                                                      \
        device T* o [[buffer(3)]],                                                              \
        constant uint* lengths [[buffer(4)]],                                                   \
        constant GdrParams& p [[buffer(5)]],                                                    \
        const device uint* owners [[buffer(6)]],                                                \
        uint3 tg [[threadgroup_position_in_grid]],                                              \
        uint sg [[simdgroup_index_in_threadgroup]],                                             \
        uint sgs [[simdgroups_per_threadgroup]],                                                \
        uint lane [[thread_index_in_simdgroup]]                                                 \
    ) {                                                                                         \
        gdr_impl<T, NK, GDR_FROM_OWNER>(qkv, gb, state, o, lengths, p, owners, tg, sg, sgs,     \
                                        lane);                                                  \
    }

#define GDR_ENTRIES(TNAME, T)                                                                   \
    GDR_ENTRY(TNAME, T, 1)                                                                      \
    GDR_ENTRY(TNAME, T, 2)                                                                      \
    GDR_ENTRY(TNAME, T, 4)                                                                      \
    GDR_ENTRY(TNAME, T, 8)

GDR_ENTRIES(f32, float)
GDR_ENTRIES(bf16, ushort)
GDR_ENTRIES(f16, half)

// ---------------------------------------------------------------- the chunked form
// The same recurrence in chunked (UT/WY) form, docs/BACKBONE.md §8.2 and chunked.cu: T/CHUNK
// dependent rounds of small dense products on the simdgroup matrix units instead of T dependent
// steps. Per (row b, value head h) and chunk of CHUNK steps, with S the state at the chunk start,
// G_t = Σ_{s≤t} g_s inside the chunk and G_L its last:
//   A[t,s]   = β_t·e^{G_t−G_s}·k̂_t·k̂_s (s < t, else 0),  Tm = (I + A)⁻¹
//   W        = Tm·diag(β·e^G)·K̂,  U = Tm·diag(β)·V
//   Δ        = U − W·S                                 (row t: the step's δ_t of the recurrence)
//   O        = diag(e^G)·Q̂·S + Aqk·Δ,  Aqk[t,s] = e^{G_t−G_s}·q̂_t·k̂_s (s ≤ t, else 0)
//   S       ← e^{G_L}·S + (diag(e^{G_L−G})·K̂)ᵀ·Δ
// A is strictly lower triangular (A^CHUNK = 0), so Tm = (I − A)(I + A²)(I + A⁴)(I + A⁸): products
// of CHUNK×CHUNK matrices, no sequential solve. Steps at or past a row's length get
// g = β = 0 and q̂ = k̂ = v = 0: they leave the state alone and output exactly 0, as above.
// Everything is f32 (inputs widened on load, simdgroup_float8x8 products accumulating in f32);
// the output is rounded to T once. The l2 norms and scales are the recurrent kernel's.
//
// Grid: threadgroups (ceil(Dv / (8·SG)), Hv, B), threadgroup (32·SG, 1, 1), SG simdgroups (the host
// uses 4). Simdgroup sg owns the 8 state columns j0 = 8·(tg.x·SG + sg) .. j0 + 7 (its slab): it
// keeps S[:, slab] in registers as DKP/8 8×8 matrices for the whole sequence and computes the
// slab's Δ, O and state update. The state-free part of a chunk (q̂, k̂, A, Aqk, Tm, W) is shared
// by the threadgroup's simdgroups through threadgroup memory, each taking tiles in turn; a
// simdgroup whose slab starts at or past Dv takes its share of that and skips the slab's work.
//
// Threadgroup memory [[threadgroup(0)]], f32, DKP = Dk rounded up to the variant (32, 64, 128),
// C = CHUNK (the host sizes it with the same formula):
//   qs [C][DKP]  q̂, then e^G·q̂, then −β·e^G·k̂, then −W     ks [C][DKP]  k̂, then e^{G_L−G}·k̂
//   pw0, pw1 [C][C]  A and its powers (ping-pong)          aqk [C][C]   Aqk
//   inv0, inv1 [C][C]  the partial products of Tm (ping-pong)
//   gates [8][C]  G, g, β, e^G, β·e^G, e^{G_L−G}, e^{G_L} (first element), unused
//   stage [SG][C][8]  each simdgroup's staging of v, o and state tiles to and from device memory
// Buffers 0–5 as the recurrent kernel's.
//
// Entry points: gated_delta_rule_chunked_{f32,bf16,f16}_dk{32,64,128} (Dk ≤ the suffix), and the
// split form's gated_delta_rule_chunked_{states,branches}_* as the recurrent kernel's above.

// Steps per chunk. 16 so that the chunk's q̂ and k̂ at Dk = 128 (2·16·128 f32) and the rest
// (about 7 KiB with 4 simdgroups) fit in 32 KiB, every Apple GPU's threadgroup memory.
constexpr constant uint GDRC_CHUNK = 16;
constexpr constant uint GDRC_TILES = GDRC_CHUNK / 8; // 8×8 tiles along a chunk

// to = x·y, or x + x·y: C×C matrices in threadgroup memory, one 8×8 tile of `to` per simdgroup
// in turn.
inline void gdrc_chunk_product(
    const threadgroup float* x,
    const threadgroup float* y,
    threadgroup float* to,
    bool plus_x,
    uint sg,
    uint sgs
) {
    constexpr uint C = GDRC_CHUNK;
    for (uint tile = sg; tile < GDRC_TILES * GDRC_TILES; tile += sgs) {
        const uint ti = tile / GDRC_TILES;
        const uint tj = tile % GDRC_TILES;
        simdgroup_float8x8 acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
        if (plus_x) {
            simdgroup_load(acc, x + ti * 8 * C + tj * 8, C);
        }
        for (uint kk = 0; kk < GDRC_TILES; ++kk) {
            simdgroup_float8x8 xa;
            simdgroup_float8x8 yb;
            simdgroup_load(xa, x + ti * 8 * C + kk * 8, C);
            simdgroup_load(yb, y + kk * 8 * C + tj * 8, C);
            simdgroup_multiply_accumulate(acc, xa, yb, acc);
        }
        simdgroup_store(acc, to + ti * 8 * C + tj * 8, C);
    }
}

template <typename T, uint KT, uint MODE>
inline void gdrc_impl(
    const device T* qkv,
    const device float* gb,
    device float* state,
    device T* o,
    constant uint* lengths,
    constant GdrParams& p,
    const device uint* owners,
    threadgroup float* shared,
    uint3 tg,
    uint sg,
    uint sgs,
    uint lane
) {
    constexpr uint C = GDRC_CHUNK;
    constexpr uint CT = GDRC_TILES;
    constexpr uint DKP = 8 * KT; // Dk padded with zero features
    constexpr uint FEATURES_PER_LANE = DKP / SIMD_W;
    const uint tid = sg * SIMD_W + lane;
    const uint threads = sgs * SIMD_W;

    threadgroup float* qs = shared;
    threadgroup float* ks = qs + C * DKP;
    threadgroup float* pw0 = ks + C * DKP;
    threadgroup float* pw1 = pw0 + C * C;
    threadgroup float* aqk = pw1 + C * C;
    threadgroup float* inv0 = aqk + C * C;
    threadgroup float* inv1 = inv0 + C * C;
    threadgroup float* cum = inv1 + C * C;
    threadgroup float* raw_g = cum + C;
    threadgroup float* beta = raw_g + C;
    threadgroup float* eg = beta + C;
    threadgroup float* bg = eg + C;
    threadgroup float* egc = bg + C;
    threadgroup float* e_last = egc + C;
    threadgroup float* stage = cum + 8 * C + sg * C * 8;

    const uint h = tg.y;
    const uint b = tg.z;
    const uint j0 = (tg.x * sgs + sg) * 8;
    const bool live = j0 < p.dv; // uniform across the simdgroup
    const uint kh = h / (p.hv / p.hk);
    const uint channels = 2 * p.hk * p.dk + p.hv * p.dv;
    const uint len = min(lengths[b], p.t);
    const uint source = MODE == GDR_FROM_OWNER ? owners[b] : b;
    device float* s_head = state + (ulong(source) * p.hv + h) * p.dk * p.dv;

    // The slab of the state, 8 rows a matrix; rows ≥ Dk and columns ≥ Dv held as 0.
    simdgroup_float8x8 s[KT];
    if (live) {
        for (uint r = 0; r < KT; ++r) {
            for (uint e = lane; e < 64; e += SIMD_W) {
                const uint i = r * 8 + e / 8;
                const uint j = j0 + e % 8;
                stage[e] = MODE != GDR_FROM_ZERO && i < p.dk && j < p.dv ? s_head[ulong(i) * p.dv + j]
                                                                          : 0.0f;
            }
            simdgroup_barrier(mem_flags::mem_threadgroup);
            simdgroup_load(s[r], stage, 8);
            simdgroup_barrier(mem_flags::mem_threadgroup);
        }
    }

    const uint chunks = (len + C - 1) / C;
    for (uint c = 0; c < chunks; ++c) {
        const uint t0 = c * C;
        // 1. q̂, k̂, g and β of the chunk's steps, a simdgroup per step.
        for (uint i = sg; i < C; i += sgs) {
            const uint t = t0 + i;
            const bool valid = t < len;
            const ulong bt = ulong(b) * p.t + (valid ? t : 0);
            const device T* row = qkv + bt * channels;
            float q[FEATURES_PER_LANE];
            float k[FEATURES_PER_LANE];
            float qq = 0.0f;
            float kk = 0.0f;
            for (uint r = 0; r < FEATURES_PER_LANE; ++r) {
                const uint f = lane + SIMD_W * r;
                q[r] = valid && f < p.dk ? to_f32(row[kh * p.dk + f]) : 0.0f;
                k[r] = valid && f < p.dk ? to_f32(row[(p.hk + kh) * p.dk + f]) : 0.0f;
                qq += q[r] * q[r];
                kk += k[r] * k[r];
            }
            qq = simd_sum(qq);
            kk = simd_sum(kk);
            const float q_scale = p.scale * rsqrt(qq + p.eps);
            const float k_scale = rsqrt(kk + p.eps);
            for (uint r = 0; r < FEATURES_PER_LANE; ++r) {
                const uint f = lane + SIMD_W * r;
                qs[i * DKP + f] = q[r] * q_scale;
                ks[i * DKP + f] = k[r] * k_scale;
            }
            if (lane == 0) {
                const device float* gate = gb + (bt * p.hv + h) * 2;
                raw_g[i] = valid ? gate[0] : 0.0f;
                beta[i] = valid ? gate[1] : 0.0f;
            }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);

        // 2. The cumulative decays (simdgroup 0, a lane per step); K̂K̂ᵀ into pw0 and Q̂K̂ᵀ into
        //    aqk, a tile per simdgroup in turn.
        if (sg == 0) {
            const float g = lane < C ? raw_g[lane] : 0.0f;
            const float big_g = simd_prefix_inclusive_sum(g);
            const float g_last = simd_broadcast(big_g, ushort(C - 1));
            if (lane < C) {
                const float e = exp(big_g);
                cum[lane] = big_g;
                eg[lane] = e;
                bg[lane] = beta[lane] * e;
                egc[lane] = exp(g_last - big_g);
            }
            if (lane == 0) {
                e_last[0] = exp(g_last);
            }
        }
        for (uint job = sg; job < 2 * CT * CT; job += sgs) {
            const bool keys = job < CT * CT;
            const uint ti = (job % (CT * CT)) / CT;
            const uint tj = job % CT;
            const threadgroup float* x = (keys ? ks : qs) + ti * 8 * DKP;
            simdgroup_float8x8 acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
            for (uint kk = 0; kk < KT; ++kk) {
                simdgroup_float8x8 xa;
                simdgroup_float8x8 kt;
                simdgroup_load(xa, x + kk * 8, DKP);
                simdgroup_load(kt, ks + tj * 8 * DKP + kk * 8, DKP, 0, true); // a tile of K̂ᵀ
                simdgroup_multiply_accumulate(acc, xa, kt, acc);
            }
            simdgroup_store(acc, (keys ? pw0 : aqk) + ti * 8 * C + tj * 8, C);
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);

        // 3. The decays and masks on A and Aqk, I − A (Tm's first factor), Q̂ → e^G·Q̂.
        for (uint e = tid; e < C * C; e += threads) {
            const uint t = e / C;
            const uint s_ = e % C;
            const float decay = s_ <= t ? exp(cum[t] - cum[s_]) : 0.0f;
            const float a = s_ < t ? beta[t] * decay * pw0[e] : 0.0f;
            pw0[e] = a;
            aqk[e] = s_ <= t ? decay * aqk[e] : 0.0f;
            inv0[e] = (t == s_ ? 1.0f : 0.0f) - a;
        }
        for (uint e = tid; e < C * DKP; e += threads) {
            qs[e] *= eg[e / DKP];
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);

        // 4. This slab's e^G·Q̂·S (the part of O from the chunk's initial state), then Tm by
        //    doubling: P ← P², Tm ← Tm + Tm·P while the span of P stays under C.
        simdgroup_float8x8 o_acc[CT];
        if (live) {
            for (uint ri = 0; ri < CT; ++ri) {
                o_acc[ri] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
                for (uint kk = 0; kk < KT; ++kk) {
                    simdgroup_float8x8 qa;
                    simdgroup_load(qa, qs + ri * 8 * DKP + kk * 8, DKP);
                    simdgroup_multiply_accumulate(o_acc[ri], qa, s[kk], o_acc[ri]);
                }
            }
        }
        threadgroup float* power = pw0;
        threadgroup float* power_next = pw1;
        threadgroup float* tm = inv0;
        threadgroup float* tm_next = inv1;
        // One barrier a round: the next round's square writes the power this round's product
        // does not read, and the next round's product waits on the next square's barrier. The
        // last product is ordered before step 6's reads by step 5's barrier.
        for (uint span = 1; span * 2 < C; span *= 2) {
            gdrc_chunk_product(power, power, power_next, false, sg, sgs);
            threadgroup_barrier(mem_flags::mem_threadgroup);
            gdrc_chunk_product(tm, power_next, tm_next, true, sg, sgs);
            threadgroup float* swap = power;
            power = power_next;
            power_next = swap;
            swap = tm;
            tm = tm_next;
            tm_next = swap;
        }

        // 5. qs ← −β·e^G·K̂ (step 4's reads of e^G·Q̂ ended at its barriers).
        for (uint e = tid; e < C * DKP; e += threads) {
            qs[e] = -bg[e / DKP] * ks[e];
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);

        // 6. −W = Tm·(−β·e^G·K̂) in place, a column of tiles per simdgroup in turn (a simdgroup
        //    reads and writes only its own columns); K̂ → e^{G_L−G}·K̂.
        for (uint ct = sg; ct < KT; ct += sgs) {
            simdgroup_float8x8 kb[CT];
            for (uint s_ = 0; s_ < CT; ++s_) {
                simdgroup_load(kb[s_], qs + s_ * 8 * DKP + ct * 8, DKP);
            }
            for (uint ri = 0; ri < CT; ++ri) {
                simdgroup_float8x8 w = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
                for (uint s_ = 0; s_ < CT; ++s_) {
                    simdgroup_float8x8 tm_tile;
                    simdgroup_load(tm_tile, tm + ri * 8 * C + s_ * 8, C);
                    simdgroup_multiply_accumulate(w, tm_tile, kb[s_], w);
                }
                simdgroup_store(w, qs + ri * 8 * DKP + ct * 8, DKP);
            }
        }
        for (uint e = tid; e < C * DKP; e += threads) {
            ks[e] *= egc[e / DKP];
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);

        // 7. The slab: Δ = Tm·(β·V) − W·S, O = e^G·Q̂·S + Aqk·Δ, S ← e^{G_L}·S + K'ᵀ·Δ.
        if (live) {
            for (uint e = lane; e < C * 8; e += SIMD_W) {
                const uint t = t0 + e / 8;
                const uint j = j0 + e % 8;
                const ulong at = (ulong(b) * p.t + t) * channels + 2 * p.hk * p.dk + h * p.dv + j;
                stage[e] = t < len && j < p.dv ? beta[e / 8] * to_f32(qkv[at]) : 0.0f;
            }
            simdgroup_barrier(mem_flags::mem_threadgroup);
            simdgroup_float8x8 bv[CT];
            for (uint s_ = 0; s_ < CT; ++s_) {
                simdgroup_load(bv[s_], stage + s_ * 64, 8);
            }
            simdgroup_barrier(mem_flags::mem_threadgroup);
            simdgroup_float8x8 delta[CT];
            for (uint ri = 0; ri < CT; ++ri) {
                delta[ri] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
                for (uint s_ = 0; s_ < CT; ++s_) {
                    simdgroup_float8x8 tm_tile;
                    simdgroup_load(tm_tile, tm + ri * 8 * C + s_ * 8, C);
                    simdgroup_multiply_accumulate(delta[ri], tm_tile, bv[s_], delta[ri]);
                }
                for (uint kk = 0; kk < KT; ++kk) {
                    simdgroup_float8x8 w;
                    simdgroup_load(w, qs + ri * 8 * DKP + kk * 8, DKP);
                    simdgroup_multiply_accumulate(delta[ri], w, s[kk], delta[ri]);
                }
            }
            for (uint ri = 0; ri < CT; ++ri) {
                for (uint s_ = 0; s_ < CT; ++s_) {
                    simdgroup_float8x8 aq;
                    simdgroup_load(aq, aqk + ri * 8 * C + s_ * 8, C);
                    simdgroup_multiply_accumulate(o_acc[ri], aq, delta[s_], o_acc[ri]);
                }
            }
            simdgroup_float8x8 decay_last(e_last[0]);
            for (uint kk = 0; kk < KT; ++kk) {
                simdgroup_float8x8 next;
                simdgroup_multiply(next, s[kk], decay_last);
                for (uint s_ = 0; s_ < CT; ++s_) {
                    simdgroup_float8x8 kt;
                    simdgroup_load(kt, ks + s_ * 8 * DKP + kk * 8, DKP, 0, true); // a tile of K'ᵀ
                    simdgroup_multiply_accumulate(next, kt, delta[s_], next);
                }
                s[kk] = next;
            }
            for (uint ri = 0; ri < CT; ++ri) {
                simdgroup_store(o_acc[ri], stage + ri * 64, 8);
            }
            simdgroup_barrier(mem_flags::mem_threadgroup);
            for (uint e = lane; e < C * 8; e += SIMD_W) {
                const uint t = t0 + e / 8;
                const uint j = j0 + e % 8;
                if (t < p.t && j < p.dv) {
                    o[((ulong(b) * p.t + t) * p.hv + h) * p.dv + j] = from_f32<T>(t < len ? stage[e] : 0.0f);
                }
            }
            simdgroup_barrier(mem_flags::mem_threadgroup);
        }
        // The chunk's shared tiles are read up to here.
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }

    if (live) {
        // Steps after the last chunk (padding): zero output.
        const uint tail = min(chunks * C, p.t);
        for (uint e = lane; e < (p.t - tail) * 8; e += SIMD_W) {
            const uint t = tail + e / 8;
            const uint j = j0 + e % 8;
            if (j < p.dv) {
                o[((ulong(b) * p.t + t) * p.hv + h) * p.dv + j] = from_f32<T>(0.0f);
            }
        }
        for (uint r = 0; r < KT; ++r) {
            simdgroup_store(s[r], stage, 8);
            simdgroup_barrier(mem_flags::mem_threadgroup);
            for (uint e = lane; e < 64; e += SIMD_W) {
                const uint i = r * 8 + e / 8;
                const uint j = j0 + e % 8;
                if (MODE != GDR_FROM_OWNER && i < p.dk && j < p.dv) {
                    s_head[ulong(i) * p.dv + j] = stage[e];
                }
            }
            simdgroup_barrier(mem_flags::mem_threadgroup);
        }
    }
}

#define GDRC_ENTRY_AS(NAME, T, DK, MODE, OWNERS_PARAM, OWNERS)                                 \
    kernel void NAME(                                                                           \
        const device T* qkv [[buffer(0)]],                                                      \
        const device float* gb [[buffer(1)]],                                                   \
        device float* state [[buffer(2)]],                                                      \
        device T* o [[buffer(3)]],                                                              \
        constant uint* lengths [[buffer(4)]],                                                   \
        constant GdrParams& p [[buffer(5)]],                                                    \
        OWNERS_PARAM                                                                            \
        threadgroup float* shared [[threadgroup(0)]],                                           \
        uint3 tg [[threadgroup_position_in_grid]],                                              \
        uint sg [[simdgroup_index_in_threadgroup]],                                             \
        uint sgs [[simdgroups_per_threadgroup]],                                                \
        uint lane [[thread_index_in_simdgroup]]                                                 \
    ) {                                                                                         \
        gdrc_impl<T, DK / 8, MODE>(qkv, gb, state, o, lengths, p, OWNERS, shared, tg, sg, sgs,  \
                                   lane);                                                       \
    }

#define GDRC_OWNERS_BUFFER const device uint* owners [[buffer(6)]],

#define GDRC_ENTRY(TNAME, T, DK)                                                                \
    GDRC_ENTRY_AS(gated_delta_rule_chunked_##TNAME##_dk##DK, T, DK, GDR_IN_PLACE, , nullptr)    \
    GDRC_ENTRY_AS(gated_delta_rule_chunked_states_##TNAME##_dk##DK, T, DK, GDR_FROM_ZERO, ,     \
                  nullptr)                                                                      \
    GDRC_ENTRY_AS(gated_delta_rule_chunked_branches_##TNAME##_dk##DK, T, DK, GDR_FROM_OWNER,    \
                  GDRC_OWNERS_BUFFER, owners)

#define GDRC_ENTRIES(TNAME, T)                                                                  \
    GDRC_ENTRY(TNAME, T, 32)                                                                    \
    GDRC_ENTRY(TNAME, T, 64)                                                                    \
    GDRC_ENTRY(TNAME, T, 128)

GDRC_ENTRIES(f32, float)
GDRC_ENTRIES(bf16, ushort)
GDRC_ENTRIES(f16, half)
