// Prepended to moe.cu and moe_mm.cu (backend/cuda/catalog.rs): the slot sentinel and what both
// product kernels share.

#define MOE_NONE 0xffffffffu

__device__ __forceinline__ float moe_nan() { return __uint_as_float(0x7fc00000u); }

// The tile's rows (shared by both product kernels): per row, the row of `a` it reads (-1:
// padding, read as zeros) and the row of `c` it writes (-1: none). `_gu` reads the slot's token
// and writes the tile row; `_down` reads the tile row and writes the slot.
template <bool GATE_UP>
__device__ __forceinline__ void moe_tile_rows(const unsigned* order, int tile, int per_token,
                                              int* arow, int* crow) {
    for (int i = threadIdx.x; i < MOE_BM; i += blockDim.x) {
        const int r = tile * MOE_BM + i;
        const unsigned s = order[r];
        if (s == MOE_NONE) {
            arow[i] = -1;
            crow[i] = -1;
        } else {
            arow[i] = GATE_UP ? (int)(s / per_token) : r;
            crow[i] = GATE_UP ? r : (int)s;
        }
    }
}

// The z = SwiGLU value of a gate and an up sum, rounded where the reference rounds.
template <typename D>
__device__ __forceinline__ float moe_swiglu(float g, float u) {
    return D::round(D::round(silu<D>(D::round(g))) * D::round(u));
}

