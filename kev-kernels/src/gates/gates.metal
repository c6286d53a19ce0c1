// The per-step gates of a Gated DeltaNet layer (gates/mod.rs). Contract of `gates/metal.rs`; the
// math is the CPU op's and gates.cu's:
//   g = neg_a · softplus(a + dt_bias)   (f32, torch's threshold 20)
//   β = round(sigmoid(b))               (rounded to the activation dtype, stored as f32)
//
// Grid: threadgroups (ceil(rows·hv / 256), 1, 1), threadgroup (256, 1, 1); one thread per
// (row, head), gid = row·hv + h; threads past rows·hv return at once. No barriers.
//
//   0 ba       rows of [b (hv) | a (hv)] T, row r at r·stride     input
//   1 dt_bias  [hv] f32                                           input
//   2 neg_a    [hv] f32 (−exp(A_log))                             input
//   3 gb       [rows, hv, 2] f32, (g, β)                          output
//   4 params   GatesParams                                        input (set_bytes)
//
// Entry points: deltanet_gates_{f32,bf16,f16}.

#include <metal_stdlib>
using namespace metal;

struct GatesParams {
    uint rows;
    uint hv;
    uint stride; // elements between row starts of ba
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

// x rounded to T and widened again: where HF's PyTorch code holds a value in the activation dtype.
template <typename T> inline float round_to(float x) { return to_f32(from_f32<T>(x)); }

// log(1 + eˣ) for x ≤ 20: MSL has no log1p; log(u)·e/(u − 1) with u = 1 + e recovers what
// rounding 1 + e loses (exact to a few ulp, and e itself where u rounds to 1).
inline float softplus_below_threshold(float x) {
    const float e = exp(x);
    const float u = 1.0f + e;
    return u == 1.0f ? e : log(u) * (e / (u - 1.0f));
}

template <typename T>
inline void gates_impl(const device T* ba, const device float* dt_bias, const device float* neg_a,
                       device float* gb, constant GatesParams& p, uint gid) {
    if (gid >= p.rows * p.hv) {
        return;
    }
    const uint h = gid % p.hv;
    const device T* row = ba + ulong(gid / p.hv) * p.stride;
    const float b = to_f32(row[h]);
    const float a = to_f32(row[p.hv + h]) + dt_bias[h];
    const float sp = a > 20.0f ? a : softplus_below_threshold(a);
    gb[2 * ulong(gid)] = neg_a[h] * sp;
    gb[2 * ulong(gid) + 1] = round_to<T>(1.0f / (1.0f + exp(-b)));
}

#define GATES_ENTRY(NAME, T)                                                                    \
    kernel void deltanet_gates_##NAME(                                                          \
        const device T* ba [[buffer(0)]],                                                       \
        const device float* dt_bias [[buffer(1)]],                                              \
        const device float* neg_a [[buffer(2)]],                                                \
        device float* gb [[buffer(3)]],                                                         \
        constant GatesParams& p [[buffer(4)]],                                                  \
        uint gid [[thread_position_in_grid]]                                                    \
    ) {                                                                                         \
        gates_impl<T>(ba, dt_bias, neg_a, gb, p, gid);                                          \
    }

GATES_ENTRY(f32, float)
GATES_ENTRY(bf16, ushort)
GATES_ENTRY(f16, half)
