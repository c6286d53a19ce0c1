// SwiGLU on a packed [gate | up] tensor (swiglu/mod.rs). Contract of `swiglu/metal.rs`; the math
// is the CPU op's and swiglu.cu's:
//   out = round(round(silu(gate)) · up)   (HF: act_fn(gate_proj(x)) * up_proj(x) in the dtype)
//
// Grid: threadgroups (ceil(rows·inter / 256), 1, 1), threadgroup (256, 1, 1); one thread per
// output element, gid = row·inter + c; threads past rows·inter return at once. No barriers.
//
//   0 gu      [rows, 2·inter] T contiguous, [gate | up] per row   input
//   1 out     [rows, inter] T                                     output
//   2 params  SwigluParams                                        input (set_bytes)
//
// Entry points: swiglu_{f32,bf16,f16}.

#include <metal_stdlib>
using namespace metal;

struct SwigluParams {
    uint rows;
    uint inter;
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

template <typename T>
inline void swiglu_impl(const device T* gu, device T* out, constant SwigluParams& p, uint gid) {
    if (gid >= p.rows * p.inter) {
        return;
    }
    const uint c = gid % p.inter;
    const device T* g = gu + ulong(gid / p.inter) * 2 * p.inter;
    const float gv = to_f32(g[c]);
    out[gid] = from_f32<T>(round_to<T>(gv / (1.0f + exp(-gv))) * to_f32(g[p.inter + c]));
}

#define SWIGLU_ENTRY(NAME, T)                                                                   \
    kernel void swiglu_##NAME(                                                                  \
        const device T* gu [[buffer(0)]],                                                       \
        device T* out [[buffer(1)]],                                                            \
        constant SwigluParams& p [[buffer(2)]],                                                 \
        uint gid [[thread_position_in_grid]]                                                    \
    ) {                                                                                         \
        swiglu_impl<T>(gu, out, p, gid);                                                        \
    }

SWIGLU_ENTRY(f32, float)
SWIGLU_ENTRY(bf16, ushort)
SWIGLU_ENTRY(f16, half)
