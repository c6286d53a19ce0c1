// Compiled by nvcc (build.rs) or NVRTC, common.cuh and moe_rows.cuh prepended; the constants shared
// with the Rust launcher come as -D defines (backend/cuda/catalog.rs).
//
// A MoE layer's routed experts with no round trip to the host:
//   moe_route_*      router logits → each token's k experts (ascending) and renormalised weights
//   moe_align        the slots (token, j) grouped by expert into runs padded to MOE_BM rows, and
//                    each tile's expert (-1 past the last used tile)
//   moe_mm_* (tensor cores, 16-bit) and moe_mm_simt_* (CUDA cores, any dtype): per tile, its
//                    expert's [gate | up] product with SwiGLU on rows gathered from the tokens
//                    (`_gu`), or its down product on the SwiGLU rows, written to the slots (`_down`)
//   moe_combine_*    per token: its experts' outputs times their weights, added in expert order,
//                    and the shared expert's output behind its sigmoid gate
// Rounding is transformers' eager loop in the dtype: the products rounded, silu(gate) rounded,
// times up rounded, times the weight (rounded) rounded, and each add into the token rounded.
// A slot's row depends on nothing but its own inputs, so the order atomics give the slots
// within an expert's run changes no number.

// moe_route_<dtype>: logits [T, E] → ids [T, k] (ascending expert; MOE_NONE where the logits
// hold a NaN) and weights [T, k] (f32 values rounded to the dtype: the reference rounds the
// renormalised probabilities to the router's dtype). One warp per token: the softmax in f32,
// then k rounds, round j taking the most probable expert after round j-1's in the order
// (probability descending, index ascending).
template <typename D>
__device__ void moe_route(const typename D::T* logits, unsigned* ids, float* weights, int tokens,
                          int experts, int k) {
    const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    for (int t = blockIdx.x * warps + (threadIdx.x >> 5); t < tokens; t += gridDim.x * warps) {
        const typename D::T* row = logits + (size_t)t * experts;
        float m = -__uint_as_float(0x7f800000u);
        for (int e = lane; e < experts; e += 32) m = fmaxf(m, D::load(row + e));
        #pragma unroll
        for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
        float s = 0.f;
        for (int e = lane; e < experts; e += 32) s += expf(D::load(row + e) - m);
        s = warp_sum(s);  // NaN if a logit is: then no expert is picked and every weight is NaN
        unsigned pick[MOE_MAX_K];
        float prob[MOE_MAX_K];
        float last_p = __uint_as_float(0x7f800000u), total = 0.f;
        int last_e = -1;
        for (int j = 0; j < k; ++j) {
            float bp = -1.f;
            int be = experts;
            for (int e = lane; e < experts; e += 32) {
                const float p = expf(D::load(row + e) - m) / s;
                const bool after = p < last_p || (p == last_p && e > last_e);
                if (after && (p > bp || (p == bp && e < be))) {
                    bp = p;
                    be = e;
                }
            }
            #pragma unroll
            for (int off = 16; off > 0; off >>= 1) {
                const float op = __shfl_xor_sync(0xffffffffu, bp, off);
                const int oe = __shfl_xor_sync(0xffffffffu, be, off);
                if (op > bp || (op == bp && oe < be)) {
                    bp = op;
                    be = oe;
                }
            }
            last_p = bp;
            last_e = be;
            pick[j] = be < experts ? (unsigned)be : MOE_NONE;
            prob[j] = be < experts ? bp : moe_nan();
            total += prob[j];
        }
        if (lane == 0) {
            for (int a = 1; a < k; ++a)  // ascending expert: the order the reference adds them in
                for (int b = a; b > 0 && pick[b - 1] > pick[b]; --b) {
                    const unsigned pe = pick[b];
                    pick[b] = pick[b - 1];
                    pick[b - 1] = pe;
                    const float pp = prob[b];
                    prob[b] = prob[b - 1];
                    prob[b - 1] = pp;
                }
            for (int j = 0; j < k; ++j) {
                ids[(size_t)t * k + j] = pick[j];
                weights[(size_t)t * k + j] = D::round(prob[j] / total);
            }
        }
    }
}

// moe_align: ids [slots] → order [tiles · MOE_BM] (each expert's slots in a run of whole tiles,
// MOE_NONE for padding) and tile_expert [tiles] (-1 past the last used tile). One block; the
// caller sizes `tiles` ≥ ⌈slots / MOE_BM⌉ + min(experts, slots), which every routing fits.
extern "C" __global__ void __launch_bounds__(MOE_ALIGN_THREADS)
    moe_align(const unsigned* ids, int slots, int experts, unsigned* order, int* tile_expert, int tiles) {
    __shared__ int count[MOE_MAX_EXPERTS];
    __shared__ int first[MOE_MAX_EXPERTS + 1];
    for (int e = threadIdx.x; e < experts; e += blockDim.x) count[e] = 0;
    for (int r = threadIdx.x; r < tiles * MOE_BM; r += blockDim.x) order[r] = MOE_NONE;
    __syncthreads();
    for (int s = threadIdx.x; s < slots; s += blockDim.x) {
        const unsigned e = ids[s];
        if (e < (unsigned)experts) atomicAdd(&count[e], 1);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int at = 0;
        for (int e = 0; e < experts; ++e) {
            first[e] = at;
            at += (count[e] + MOE_BM - 1) / MOE_BM;
        }
        first[experts] = at;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < experts; e += blockDim.x) {
        for (int t = first[e]; t < first[e + 1]; ++t) tile_expert[t] = e;
        count[e] = 0;
    }
    for (int t = first[experts] + threadIdx.x; t < tiles; t += blockDim.x) tile_expert[t] = -1;
    __syncthreads();
    for (int s = threadIdx.x; s < slots; s += blockDim.x) {
        const unsigned e = ids[s];
        if (e < (unsigned)experts) order[first[e] * MOE_BM + atomicAdd(&count[e], 1)] = s;
    }
}

// moe_mm_simt_<dtype>_<gu|down>: C rows = A rows · W[e]ᵀ for each tile (blockIdx.y) of expert
// e = tile_expert[tile], on CUDA cores. `n`: `_gu` the expert width I (W [E, 2I, K], C
// [tiles · MOE_BM, I] of SwiGLU values), `_down` the hidden size (W [E, n, K], C [slots, n]).
// A block is MOE_BM rows × 64 columns of W (`_gu`: 32 gate and the 32 matching up columns),
// 256 threads, each 4 rows × 4 columns; the sum runs in f32 over k in order.
template <typename D, bool GATE_UP>
__device__ void moe_mm_simt(const typename D::T* a, const typename D::T* w, typename D::T* c,
                            const unsigned* order, const int* tile_expert, int n, int kdim,
                            int per_token) {
    __shared__ float sa[16][MOE_BM + 4];
    __shared__ float sb[16][64 + 4];
    __shared__ int arow[MOE_BM], crow[MOE_BM];
    const int tile = blockIdx.y, e = tile_expert[tile];
    if (e < 0) return;
    moe_tile_rows<GATE_UP>(order, tile, per_token, arow, crow);
    __syncthreads();
    const typename D::T* we = w + (size_t)e * (GATE_UP ? 2 * n : n) * kdim;
    const int tr = threadIdx.x >> 4, tc = threadIdx.x & 15;
    // The W row of B-tile column i (-1 past the end).
    auto wrow = [&](int i) {
        if (GATE_UP) {
            const int col = blockIdx.x * 32 + (i & 31);
            return col < n ? (i < 32 ? col : n + col) : -1;
        }
        const int col = blockIdx.x * 64 + i;
        return col < n ? col : -1;
    };
    int bcol[4];
    #pragma unroll
    for (int j = 0; j < 4; ++j) bcol[j] = GATE_UP ? (j >> 1) * 32 + tc * 2 + (j & 1) : tc * 4 + j;
    float acc[4][4] = {};
    for (int k0 = 0; k0 < kdim; k0 += 16) {
        for (int x = threadIdx.x; x < MOE_BM * 16; x += blockDim.x) {
            const int r = x >> 4, kk = x & 15, row = arow[r];
            sa[kk][r] = row >= 0 && k0 + kk < kdim ? D::load(a + (size_t)row * kdim + k0 + kk) : 0.f;
        }
        for (int x = threadIdx.x; x < 64 * 16; x += blockDim.x) {
            const int i = x >> 4, kk = x & 15, row = wrow(i);
            sb[kk][i] = row >= 0 && k0 + kk < kdim ? D::load(we + (size_t)row * kdim + k0 + kk) : 0.f;
        }
        __syncthreads();
        #pragma unroll
        for (int kk = 0; kk < 16; ++kk) {
            float av[4], bv[4];
            #pragma unroll
            for (int i = 0; i < 4; ++i) av[i] = sa[kk][tr * 4 + i];
            #pragma unroll
            for (int j = 0; j < 4; ++j) bv[j] = sb[kk][bcol[j]];
            #pragma unroll
            for (int i = 0; i < 4; ++i)
                #pragma unroll
                for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
        }
        __syncthreads();
    }
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int out = crow[tr * 4 + i];
        if (out < 0) continue;
        typename D::T* cr = c + (size_t)out * n;
        if (GATE_UP) {
            #pragma unroll
            for (int j = 0; j < 2; ++j) {
                const int col = blockIdx.x * 32 + tc * 2 + j;
                if (col < n) D::store(cr + col, moe_swiglu<D>(acc[i][j], acc[i][j + 2]));
            }
        } else {
            #pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int col = blockIdx.x * 64 + tc * 4 + j;
                if (col < n) D::store(cr + col, acc[i][j]);
            }
        }
    }
}

#define MOE_MM_SIMT(TAG, D)                                                                        \
    extern "C" __global__ void moe_mm_simt_##TAG##_gu(const D::T* a, const D::T* w, D::T* c,       \
                                                      const unsigned* order, const int* tiles,    \
                                                      int n, int kdim, int per_token) {           \
        moe_mm_simt<D, true>(a, w, c, order, tiles, n, kdim, per_token);                           \
    }                                                                                              \
    extern "C" __global__ void moe_mm_simt_##TAG##_down(const D::T* a, const D::T* w, D::T* c,     \
                                                        const unsigned* order, const int* tiles,  \
                                                        int n, int kdim, int per_token) {         \
        moe_mm_simt<D, false>(a, w, c, order, tiles, n, kdim, per_token);                          \
    }
MOE_MM_SIMT(f32, F32)
MOE_MM_SIMT(bf16, BF16)
MOE_MM_SIMT(f16, F16)

// moe_combine_<dtype>: y [slots, H] (expert outputs; rows of MOE_NONE slots never written),
// ids / weights [T, k], the shared expert's output [T, H] and gate logit [T, 1] → out [T, H]:
// Σ_j round(y · w) in j order (ascending expert), each add rounded, plus
// round(round(sigmoid(gate)) · shared), rounded; a slot with no expert makes its token's row
// NaN, which the forward refuses.
template <typename D>
__device__ void moe_combine(const typename D::T* y, const unsigned* ids, const float* weights,
                            const typename D::T* shared, const typename D::T* gate,
                            typename D::T* out, int tokens, int k, int h) {
    for (int t = blockIdx.y; t < tokens; t += gridDim.y) {
        const float g = D::round(sigmoid<D>(D::load(gate + t)));
        for (int col = blockIdx.x * blockDim.x + threadIdx.x; col < h; col += gridDim.x * blockDim.x) {
            float acc = 0.f;
            for (int j = 0; j < k; ++j) {
                const size_t s = (size_t)t * k + j;
                const float v = ids[s] == MOE_NONE ? moe_nan() : D::round(D::load(y + s * h + col) * weights[s]);
                acc = D::round(acc + v);
            }
            const size_t o = (size_t)t * h + col;
            D::store(out + o, acc + D::round(g * D::load(shared + o)));
        }
    }
}

#define MOE_TYPED(TAG, D)                                                                          \
    extern "C" __global__ void moe_route_##TAG(const D::T* logits, unsigned* ids, float* weights,  \
                                               int tokens, int experts, int k) {                   \
        moe_route<D>(logits, ids, weights, tokens, experts, k);                                    \
    }                                                                                              \
    extern "C" __global__ void moe_combine_##TAG(const D::T* y, const unsigned* ids,               \
                                                 const float* weights, const D::T* shared,         \
                                                 const D::T* gate, D::T* out, int tokens, int k,   \
                                                 int h) {                                          \
        moe_combine<D>(y, ids, weights, shared, gate, out, tokens, k, h);                          \
    }
MOE_TYPED(f32, F32)
MOE_TYPED(bf16, BF16)
MOE_TYPED(f16, F16)
