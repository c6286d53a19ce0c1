// Row gathers (gather/mod.rs), any dtype, moved in units of 4 bytes (uint) where every row and
// start allows it, else 2 bytes (ushort). Contract of `gather/metal.rs`; what gather.cu does.
//
// Grid: threadgroups (ceil(total units / 256), 1, 1), threadgroup (256, 1, 1); one thread per
// output unit; threads past the end return at once. No barriers.
//
// gather_rows_{u16,u32}: out row r = src row idx[r], rows of `units` units. An index at or past
// `src_rows` (the host checks them) writes zeros rather than reading outside the source.
//   0 src [src_rows, units]  1 idx [n] u32  2 out [n, units] (output)  3 params GatherRowsParams
//
// gather_cat_{u16,u32}: out[b, h] = src[idx[b], h] (`us` units) followed by tail[b, h] (`ut`
// units): a branch row's attention keys or values, its state row's then its own. An index at or
// past `src_rows` gives zeros for the src part.
//   0 src [src_rows, heads, us]  1 idx [n] u32  2 tail [n, heads, ut]
//   3 out [n, heads, us + ut] (output)  4 params GatherCatParams

#include <metal_stdlib>
using namespace metal;

struct GatherRowsParams {
    uint n;        // output rows
    uint units;    // units a row
    uint src_rows; // rows of src
};

struct GatherCatParams {
    uint n;        // output rows
    uint heads;
    uint us;       // units of a (row, head) of src
    uint ut;       // units of a (row, head) of tail
    uint src_rows; // rows of src
};

template <typename U>
inline void gather_rows_impl(const device U* src, const device uint* idx, device U* out,
                             constant GatherRowsParams& p, uint gid) {
    if (gid >= p.n * p.units) {
        return;
    }
    const uint r = gid / p.units, i = gid % p.units;
    const uint from = idx[r];
    out[gid] = from < p.src_rows ? src[ulong(from) * p.units + i] : U(0);
}

template <typename U>
inline void gather_cat_impl(const device U* src, const device uint* idx, const device U* tail,
                            device U* out, constant GatherCatParams& p, uint gid) {
    const uint row = p.us + p.ut;
    if (gid >= p.n * p.heads * row) {
        return;
    }
    const uint bh = gid / row, i = gid % row;
    const uint h = bh % p.heads, from = idx[bh / p.heads];
    U v;
    if (i >= p.us) {
        v = tail[ulong(bh) * p.ut + (i - p.us)];
    } else {
        v = from < p.src_rows ? src[(ulong(from) * p.heads + h) * p.us + i] : U(0);
    }
    out[gid] = v;
}

#define GATHER_ENTRIES(NAME, U)                                                                 \
    kernel void gather_rows_##NAME(                                                             \
        const device U* src [[buffer(0)]],                                                      \
        const device uint* idx [[buffer(1)]],                                                   \
        device U* out [[buffer(2)]],                                                            \
        constant GatherRowsParams& p [[buffer(3)]],                                             \
        uint gid [[thread_position_in_grid]]                                                    \
    ) {                                                                                         \
        gather_rows_impl<U>(src, idx, out, p, gid);                                             \
    }                                                                                           \
    kernel void gather_cat_##NAME(                                                              \
        const device U* src [[buffer(0)]],                                                      \
        const device uint* idx [[buffer(1)]],                                                   \
        const device U* tail [[buffer(2)]],                                                     \
        device U* out [[buffer(3)]],                                                            \
        constant GatherCatParams& p [[buffer(4)]],                                              \
        uint gid [[thread_position_in_grid]]                                                    \
    ) {                                                                                         \
        gather_cat_impl<U>(src, idx, tail, out, p, gid);                                        \
    }

GATHER_ENTRIES(u16, ushort)
GATHER_ENTRIES(u32, uint)
