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
//
// causal_conv1d_cached_{x}_{w}: the conv continuing from a cache, reading the window [cache; x]
// in place, and the next cache, in one dispatch (the CPU op's and causal_conv1d.cu's contract).
// One thread per output element of y, then of the next cache (grid as above over
// B·T·C + B·(K−1)·C); window row p of batch row b is cache[b, p] for p < K−1, else x[b, p − K + 1].
//   0 x        [B·T, C] rows X, row r at r·x_stride (a slice of a wider projection)    input
//   1 cache    [B, K−1, C] X contiguous                                              input
//   2 w        [C, K] W                                                              input
//   3 lengths  [B] u32, real steps per row: the next cache is window rows len .. len+K−2
//   4 out      [y: B·T·C | next cache: B·(K−1)·C] X                                  output
//   5 params   ConvCachedParams                                                      set_bytes
//
// causal_conv1d_split_{x}_{w}: the records' convs in one dispatch (causal_conv1d.cu's
// conv_split): the state rows from zeros, then the branch rows, branch b continuing the last K−1
// real inputs of state row owners[b], read in place. One thread per output element (grid as
// above over (R·S + B·T)·C). Window row p of state row r is 0 for p < K−1, else xs[r, p − K + 1];
// of branch b, xb[b, p − K + 1] for p ≥ K−1, else xs[o, e + p − K + 1] (o = owners[b],
// e = state_lengths[o]) where that step is ≥ 0, else 0: the window the cached form reads after
// the state row's next cache is copied to the branch, so the same products in the same order.
//   0 xs             [R·S, C] rows X, row i at i·s_stride                             input
//   1 xb             [B·T, C] rows X, row i at i·b_stride                             input
//   2 w              [C, K] W                                                         input
//   3 state_lengths  [R] u32, the state rows' real steps                              input
//   4 owners         [B] u32, the state row each branch continues                     input
//   5 out            [R·S + B·T, C] X: the states' rows, then the branches'           output
//   6 params         ConvSplitParams                                                  set_bytes

#include <metal_stdlib>
using namespace metal;

struct ConvParams {
    uint b; // batch
    uint t; // output steps
    uint c; // channels
    uint k; // kernel size
};

struct ConvCachedParams {
    uint b;        // batch
    uint t;        // steps of x
    uint c;        // channels
    uint k;        // kernel size
    uint x_stride; // elements between rows of x
};

struct ConvSplitParams {
    uint r;        // state rows
    uint s;        // steps per state row
    uint b;        // branch rows
    uint t;        // steps per branch row
    uint c;        // channels
    uint k;        // kernel size
    uint s_stride; // elements between rows of xs
    uint b_stride; // elements between rows of xb
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

template <typename X>
inline float conv_window(const device X* x, const device X* cache, constant ConvCachedParams& p,
                         uint b, uint row, uint c) {
    return row < p.k - 1 ? to_f32(cache[(ulong(b) * (p.k - 1) + row) * p.c + c])
                         : to_f32(x[(ulong(b) * p.t + row - (p.k - 1)) * p.x_stride + c]);
}

template <typename X, typename W>
inline void conv_cached_impl(
    const device X* x,
    const device X* cache,
    const device W* w,
    const device uint* lengths,
    device X* out,
    constant ConvCachedParams& p,
    uint gid
) {
    const uint ny = p.b * p.t * p.c;
    if (gid < ny) {
        const uint c = gid % p.c;
        const uint bt = gid / p.c;
        const uint t = bt % p.t;
        const uint b = bt / p.t;
        const device W* ws = w + ulong(c) * p.k;
        float acc = 0.0f;
        for (uint j = 0; j < p.k; ++j) {
            acc += to_f32(ws[j]) * conv_window(x, cache, p, b, t + j, c);
        }
        out[gid] = from_f32<X>(acc / (1.0f + exp(-acc)));
        return;
    }
    const uint i = gid - ny;
    if (i >= p.b * (p.k - 1) * p.c) {
        return;
    }
    const uint c = i % p.c;
    const uint br = i / p.c;
    const uint r = br % (p.k - 1);
    const uint b = br / (p.k - 1);
    out[gid] = from_f32<X>(conv_window(x, cache, p, b, lengths[b] + r, c));
}

template <typename X, typename W>
inline void conv_split_impl(
    const device X* xs,
    const device X* xb,
    const device W* w,
    const device uint* state_lengths,
    const device uint* owners,
    device X* out,
    constant ConvSplitParams& p,
    uint gid
) {
    const uint n_state = p.r * p.s * p.c;
    if (gid >= n_state + p.b * p.t * p.c) {
        return;
    }
    const bool state = gid < n_state;
    const uint i = state ? gid : gid - n_state;
    const uint c = i % p.c;
    const uint token = i / p.c;
    const uint width = state ? p.s : p.t;
    const uint t = token % width;
    const uint row = token / width;
    const uint owner = state ? row : owners[row];
    // Where the owner's real inputs end (a branch's window starts before it); 0 for a state row,
    // whose window starts with zeros.
    const uint end = state ? 0 : state_lengths[owner];
    const device W* ws = w + ulong(c) * p.k;
    float acc = 0.0f;
    for (uint j = 0; j < p.k; ++j) {
        const uint q = t + j;
        float x = 0.0f;
        if (q >= p.k - 1) {
            const ulong step = q - (p.k - 1);
            x = state ? to_f32(xs[(ulong(row) * p.s + step) * p.s_stride + c])
                      : to_f32(xb[(ulong(row) * p.t + step) * p.b_stride + c]);
        } else if (end + q >= p.k - 1) {
            x = to_f32(xs[(ulong(owner) * p.s + end + q - (p.k - 1)) * p.s_stride + c]);
        }
        acc += to_f32(ws[j]) * x;
    }
    out[gid] = from_f32<X>(acc / (1.0f + exp(-acc)));
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
    }                                                                                           \
    kernel void causal_conv1d_cached_##XNAME##_##WNAME(                                         \
        const device X* x [[buffer(0)]],                                                        \
        const device X* cache [[buffer(1)]],                                                    \
        const device W* w [[buffer(2)]],                                                        \
        const device uint* lengths [[buffer(3)]],                                               \
        device X* out [[buffer(4)]],                                                            \
        constant ConvCachedParams& p [[buffer(5)]],                                             \
        uint gid [[thread_position_in_grid]]                                                    \
    ) {                                                                                         \
        conv_cached_impl<X, W>(x, cache, w, lengths, out, p, gid);                              \
    }                                                                                           \
    kernel void causal_conv1d_split_##XNAME##_##WNAME(                                          \
        const device X* xs [[buffer(0)]],                                                       \
        const device X* xb [[buffer(1)]],                                                       \
        const device W* w [[buffer(2)]],                                                        \
        const device uint* state_lengths [[buffer(3)]],                                         \
        const device uint* owners [[buffer(4)]],                                                \
        device X* out [[buffer(5)]],                                                            \
        constant ConvSplitParams& p [[buffer(6)]],                                              \
        uint gid [[thread_position_in_grid]]                                                    \
    ) {                                                                                         \
        conv_split_impl<X, W>(xs, xb, w, state_lengths, owners, out, p, gid);                   \
    }

#define CONV_ENTRIES(XNAME, X)                                                                  \
    CONV_ENTRY(XNAME, X, f32, float)                                                            \
    CONV_ENTRY(XNAME, X, bf16, ushort)                                                          \
    CONV_ENTRY(XNAME, X, f16, half)

CONV_ENTRIES(f32, float)
CONV_ENTRIES(bf16, ushort)
CONV_ENTRIES(f16, half)
