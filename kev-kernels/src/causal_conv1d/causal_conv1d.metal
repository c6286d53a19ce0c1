// Depthwise causal conv1d (kernel K, no bias) followed by SiLU. Contract of `src/metal.rs`; the
// math is the CPU op's (`src/causal_conv1d.rs`):
//   y[b, t, c] = silu(Σ_{j<K} w[c, j] · x[b, t + j, c])      accumulated in f32, j in order
//
// Grid: threadgroups (ceil(B·T·C / 256), 1, 1), threadgroup (256, 1, 1).
// Each thread owns one output element, gid = (b·T + t)·C + c (channels fastest, so neighbouring
// threads read neighbouring channels); threads with gid ≥ B·T·C return at once.
// No threadgroup memory, no barriers.
//
// Buffers (all contiguous, element offsets already applied by the host):
//   0 x       [B, K−1+T, C]  X (f32 | bf16 as ushort | f16): the K−1 previous inputs, then T new   input
//   1 w       [C, K]         W (f32 | bf16 | f16), the last tap multiplies the current step          input
//   2 y       [B, T, C]      X                                                                    output
//   3 params  ConvParams                                                                          input (set_bytes)
//
// Entry points: causal_conv1d_{x}_{w} for x, w ∈ {f32, bf16, f16}.

#include <metal_stdlib>
using namespace metal;

struct ConvParams {
    uint b; // batch
    uint t; // output steps
    uint c; // channels
    uint k; // kernel size
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

template <typename X, typename W>
inline void conv_impl(
    const device X* x,
    const device W* w,
    device X* y,
    constant ConvParams& p,
    uint gid
) {
    if (gid >= p.b * p.t * p.c) {
        return;
    }
    const uint c = gid % p.c;
    const uint bt = gid / p.c;
    const uint t = bt % p.t;
    const uint b = bt / p.t;
    const device X* xs = x + (ulong(b) * (p.t + p.k - 1) + t) * p.c + c;
    const device W* ws = w + ulong(c) * p.k;
    float acc = 0.0f;
    for (uint j = 0; j < p.k; ++j) {
        acc += to_f32(ws[j]) * to_f32(xs[ulong(j) * p.c]);
    }
    y[gid] = from_f32<X>(acc / (1.0f + exp(-acc)));
}

#define CONV_ENTRY(XNAME, X, WNAME, W)                                                          \
    kernel void causal_conv1d_##XNAME##_##WNAME(                                                \
        const device X* x [[buffer(0)]],                                                        \
        const device W* w [[buffer(1)]],                                                        \
        device X* y [[buffer(2)]],                                                              \
        constant ConvParams& p [[buffer(3)]],                                                   \
        uint gid [[thread_position_in_grid]]                                                    \
    ) {                                                                                         \
        conv_impl<X, W>(x, w, y, p, gid);                                                       \
    }

#define CONV_ENTRIES(XNAME, X)                                                                  \
    CONV_ENTRY(XNAME, X, f32, float)                                                            \
    CONV_ENTRY(XNAME, X, bf16, ushort)                                                          \
    CONV_ENTRY(XNAME, X, f16, half)

CONV_ENTRIES(f32, float)
CONV_ENTRIES(bf16, ushort)
CONV_ENTRIES(f16, half)
