// The RMSNorms (norm/mod.rs): the zero-centred norm, optionally after a residual add, and the
// DeltaNet's gated output norm. Contract of `norm/metal.rs`; the math and rounding are the CPU
// op's and norm.cu's (statistics and products in f32, rounded where HF's PyTorch code rounds).
//
// Grid: threadgroups (ceil(rows / 8), 1, 1), threadgroup (256, 1, 1): one simdgroup (32 lanes) per
// row, row = threadgroup · 8 + simdgroup index; a simdgroup past the last row returns at once
// (uniformly). Lane l handles columns l, l + 32, ...; one simd_sum gives Σx². No threadgroup
// memory, no barriers.
//
// rms_norm_{f32,bf16,f16}:
//   0 x       [rows, cols] T, row r at r·x_stride (a slice of a wider tensor)   input
//   1 h       [rows, cols] T, row r at r·h_stride: the residual (bound to x when unused)  input
//   2 w1      [cols] f32 (1 + w)                                               input
//   3 out     residual: [2, rows, cols] T = (round(x + h), its norm); else [rows, cols] T   output
//   4 params  RmsNormParams                                                    input (set_bytes)
//   out = v · rsqrt(mean(v²) + eps) · w1, v = x or round(x + h)
//
// gated_rms_norm_{f32,bf16,f16}: one simdgroup per group of dv values
//   0 x       [groups, dv] T contiguous                                        input
//   1 z       rows of heads·dv T, row r at r·z_stride; group g reads row g / heads, head g % heads
//   2 w       [dv] T                                                           input
//   3 out     [groups, dv] T                                                   output
//   4 params  GatedNormParams                                                  input (set_bytes)
//   out = round(round(round(x̂)·w) · silu(z))   (HF Qwen3_5RMSNormGated)

#include <metal_stdlib>
using namespace metal;

struct RmsNormParams {
    uint rows;
    uint cols;
    uint x_stride; // elements between row starts of x
    uint h_stride; // elements between row starts of h
    uint residual; // 1: add h first and write [sum, normed]
    float eps;
};

struct GatedNormParams {
    uint groups;
    uint heads;    // groups per row of z
    uint dv;
    uint z_stride; // elements between row starts of z
    float eps;
};

constant uint NORM_SIMD = 32;
constant uint NORM_ROWS_PER_GROUP = 8;

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

inline float silu(float x) { return x / (1.0f + exp(-x)); }

template <typename T>
inline void rms_norm_impl(const device T* x, const device T* h, const device float* w1,
                          device T* out, constant RmsNormParams& p, uint row, uint lane) {
    if (row >= p.rows) {
        return;
    }
    const device T* xr = x + ulong(row) * p.x_stride;
    const device T* hr = h + ulong(row) * p.h_stride;
    device T* sum = out + ulong(row) * p.cols;
    device T* normed = out + (p.residual != 0 ? ulong(p.rows) * p.cols : 0) + ulong(row) * p.cols;
    float ss = 0.0f;
    for (uint c = lane; c < p.cols; c += NORM_SIMD) {
        float v = to_f32(xr[c]);
        if (p.residual != 0) {
            v = round_to<T>(v + to_f32(hr[c]));
            sum[c] = from_f32<T>(v);
        }
        ss += v * v;
    }
    const float inv = rsqrt(simd_sum(ss) / float(p.cols) + p.eps);
    // Each lane re-reads only the sums it wrote itself.
    for (uint c = lane; c < p.cols; c += NORM_SIMD) {
        const float v = p.residual != 0 ? to_f32(sum[c]) : to_f32(xr[c]);
        normed[c] = from_f32<T>(v * inv * w1[c]); // HF's order
    }
}

template <typename T>
inline void gated_rms_norm_impl(const device T* x, const device T* z, const device T* w,
                                device T* out, constant GatedNormParams& p, uint group, uint lane) {
    if (group >= p.groups) {
        return;
    }
    const device T* xr = x + ulong(group) * p.dv;
    const device T* zr = z + ulong(group / p.heads) * p.z_stride + ulong(group % p.heads) * p.dv;
    device T* o = out + ulong(group) * p.dv;
    float ss = 0.0f;
    for (uint c = lane; c < p.dv; c += NORM_SIMD) {
        const float v = to_f32(xr[c]);
        ss += v * v;
    }
    const float inv = rsqrt(simd_sum(ss) / float(p.dv) + p.eps);
    for (uint c = lane; c < p.dv; c += NORM_SIMD) {
        const float n = round_to<T>(round_to<T>(to_f32(xr[c]) * inv) * to_f32(w[c]));
        o[c] = from_f32<T>(n * silu(to_f32(zr[c])));
    }
}

#define NORM_ENTRIES(NAME, T)                                                                   \
    kernel void rms_norm_##NAME(                                                                \
        const device T* x [[buffer(0)]],                                                        \
        const device T* h [[buffer(1)]],                                                        \
        const device float* w1 [[buffer(2)]],                                                   \
        device T* out [[buffer(3)]],                                                            \
        constant RmsNormParams& p [[buffer(4)]],                                                \
        uint tg [[threadgroup_position_in_grid]],                                               \
        uint sg_index [[simdgroup_index_in_threadgroup]],                                       \
        uint lane [[thread_index_in_simdgroup]]                                                 \
    ) {                                                                                         \
        rms_norm_impl<T>(x, h, w1, out, p, tg * NORM_ROWS_PER_GROUP + sg_index, lane);          \
    }                                                                                           \
    kernel void gated_rms_norm_##NAME(                                                          \
        const device T* x [[buffer(0)]],                                                        \
        const device T* z [[buffer(1)]],                                                        \
        const device T* w [[buffer(2)]],                                                        \
        device T* out [[buffer(3)]],                                                            \
        constant GatedNormParams& p [[buffer(4)]],                                              \
        uint tg [[threadgroup_position_in_grid]],                                               \
        uint sg_index [[simdgroup_index_in_threadgroup]],                                       \
        uint lane [[thread_index_in_simdgroup]]                                                 \
    ) {                                                                                         \
        gated_rms_norm_impl<T>(x, z, w, out, p, tg * NORM_ROWS_PER_GROUP + sg_index, lane);     \
    }

NORM_ENTRIES(f32, float)
NORM_ENTRIES(bf16, ushort)
NORM_ENTRIES(f16, half)
