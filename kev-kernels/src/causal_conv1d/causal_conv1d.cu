// Compiled by nvcc (build.rs) or NVRTC, common.cuh prepended (no CUDA headers: bf16 and f16 are
// read and written as 16-bit integers); the constants shared with the Rust launcher come as
// -D defines (backend/cuda/catalog.rs).
//
// conv_<dtype>: causal depthwise conv1d + SiLU, one thread per output element.
//   Inputs: x [B, K-1+T, C] (dtype, the K-1 cached steps first), w [C, K] (dtype).
//   Output: y [B, T, C] (dtype), accumulated in f32.
//
// conv_cached_<dtype>: the causal conv + SiLU over [cache; x] without building that window, and
// the next cache in the same launch. x rows (stride xs) [B, T, C]; cache [B, K-1, C]; w [C, K].
// out = [y: B·T·C | next: B·(K-1)·C]: y as conv_<dtype>; next[b, r] = window row lengths[b] + r
// (the K-1 raw inputs before row b's end; lengths null: every row has T).
// grid = (ceil(C / (CONV_VEC·blockDim.x)), B, ceil(T / CONV_RUN) + 1). A thread owns CONV_VEC
// channels of a run of CONV_RUN steps and slides the window along it, so each input is read once
// per run, not K times; the last z slice writes the next cache. With K = 4 and 16-byte aligned
// rows a thread moves its channels as 16-byte vectors (2-byte loads left the kernel far from DRAM
// bandwidth); otherwise it walks them one by one. Runs of 4 steps, not 8: with 8, a 512-step
// state gave each multiprocessor too few warps to hide the loads' latency (11–22 µs a launch on
// the H200, ncu). CONV_RUN, CONV_VEC and CONV_CACHED_BLOCK are -D defines.

// ---- conv_<dtype>

template <typename D>
__device__ void conv(const typename D::T* __restrict__ x, const typename D::T* __restrict__ w,
                     typename D::T* __restrict__ y, int B, int T, int C, int K) {
    const size_t n = (size_t)B * T * C;
    for (size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x; idx < n;
         idx += (size_t)gridDim.x * blockDim.x) {
        const int c = idx % C;
        const size_t bt = idx / C;
        const int t = bt % T, b = bt / T;
        const typename D::T* xs = x + ((size_t)b * (T + K - 1) + t) * C + c;
        float acc = 0.f;
        for (int j = 0; j < K; j++) acc += D::load(w + c * K + j) * D::load(xs + (size_t)j * C);
        D::store(y + idx, silu<D>(acc));
    }
}

#define CONV(TAG, D)                                                                              \
    extern "C" __global__ void conv_##TAG(const D::T* x, const D::T* w, D::T* y, int B, int T, \
                                          int C, int K) {                                         \
        conv<D>(x, w, y, B, T, C, K);                                                             \
    }
CONV(f32, F32)
CONV(bf16, BF16)
CONV(f16, F16)

// ---- conv_cached_<dtype>, conv_split_<dtype>

template <typename D>
__device__ __forceinline__ void load8(const typename D::T* p, float* v) {
    #pragma unroll
    for (int j = 0; j < CONV_VEC; j += Vec16<D>::N) Vec16<D>::load(p + j, v + j);
}
template <typename D>
__device__ __forceinline__ void store8(typename D::T* p, const float* v) {
    #pragma unroll
    for (int j = 0; j < CONV_VEC; j += Vec16<D>::N) Vec16<D>::store(p + j, v + j);
}
// conv_run's vector path for 16-bit dtypes: the weights, the window and the outputs stay packed
// (16 + 28 + 16 registers where f32 copies took 32 + 56 + 8), a channel at a time widened where
// it is used. Unpacked, the conv needed 96 registers a thread, which held the split conv to 31 %
// occupancy with its loads' latency unhidden (ncu, 4B: 102 µs a layer at 38 % of DRAM
// bandwidth). The same products in the same order, so the same numbers.
template <typename D, typename Row>
__device__ __forceinline__ void conv_run_packed(const Row& row, const typename D::T* __restrict__ w,
                                                typename D::T* __restrict__ y, int t0, int t1,
                                                int c0, int C) {
    uint4 wq[4];  // w[c0..c0+8, 0..4]: weight (i, j) is value 4i + j
    #pragma unroll
    for (int j = 0; j < 4; j++)
        wq[j] = *reinterpret_cast<const uint4*>(w + (size_t)c0 * 4 + j * CONV_VEC);
    uint4 win[CONV_RUN + 3];
    #pragma unroll
    for (int p = 0; p < CONV_RUN + 3; p++) {
        const typename D::T* src = t0 + p < t1 + 3 ? row(t0 + p, c0) : nullptr;
        win[p] = src ? *reinterpret_cast<const uint4*>(src) : make_uint4(0u, 0u, 0u, 0u);
    }
    unsigned out[CONV_RUN][CONV_VEC / 2];  // two outputs a word
    #pragma unroll
    for (int i = 0; i < CONV_VEC; i++) {
        const uint4& wi = wq[i / 2];
        const int k = 4 * (i % 2);
        const float w0 = unpack8<D>(wi, k), w1 = unpack8<D>(wi, k + 1), w2 = unpack8<D>(wi, k + 2),
                    w3 = unpack8<D>(wi, k + 3);
        #pragma unroll
        for (int r = 0; r < CONV_RUN; r++) {
            const float acc = w0 * unpack8<D>(win[r], i) + w1 * unpack8<D>(win[r + 1], i) +
                              w2 * unpack8<D>(win[r + 2], i) + w3 * unpack8<D>(win[r + 3], i);
            const unsigned h = pack16<D>(silu<D>(acc));
            out[r][i / 2] = i % 2 ? out[r][i / 2] | (h << 16) : h;
        }
    }
    #pragma unroll
    for (int r = 0; r < CONV_RUN; r++)
        if (t0 + r < t1)
            *reinterpret_cast<uint4*>(y + (size_t)(t0 + r) * C + c0) =
                make_uint4(out[r][0], out[r][1], out[r][2], out[r][3]);
}
// One thread's run of the conv: steps t0..t1 (at most CONV_RUN) of channels c0..c0+nc, window
// row p (row 0 is K−1 steps before step 0) read through `row(p, c)`: a pointer, or null for a
// zero row. Outputs at y (row pitch C). `vec`: 8 channels as 16-byte vectors and K = 4.
template <typename D, typename Row>
__device__ __forceinline__ void conv_run(const Row& row, const typename D::T* __restrict__ w,
                                         typename D::T* __restrict__ y, int t0, int t1, int c0,
                                         int nc, int C, int K, bool vec) {
    if constexpr (sizeof(typename D::T) == 2) {
        if (vec) {
            conv_run_packed<D>(row, w, y, t0, t1, c0, C);
            return;
        }
    }
    if (vec) {
        float raw[4 * CONV_VEC];  // w[c0..c0+8, 0..4] by channel
        #pragma unroll
        for (int j = 0; j < 4; j++) load8<D>(w + (size_t)c0 * 4 + j * CONV_VEC, raw + j * CONV_VEC);
        // The run's K-1+CONV_RUN window rows, all loads in flight at once (a loop that loads
        // row by row waits a memory round trip per step).
        float win[CONV_RUN + 3][CONV_VEC], o[CONV_VEC];
        #pragma unroll
        for (int p = 0; p < CONV_RUN + 3; p++)
            if (t0 + p < t1 + 3) {
                const typename D::T* src = row(t0 + p, c0);
                if (src) {
                    load8<D>(src, win[p]);
                } else {
                    #pragma unroll
                    for (int i = 0; i < CONV_VEC; i++) win[p][i] = 0.f;
                }
            }
        #pragma unroll
        for (int r = 0; r < CONV_RUN; r++) {
            if (t0 + r >= t1) break;
            #pragma unroll
            for (int i = 0; i < CONV_VEC; i++) {
                const float acc = raw[4 * i] * win[r][i] + raw[4 * i + 1] * win[r + 1][i] +
                                  raw[4 * i + 2] * win[r + 2][i] + raw[4 * i + 3] * win[r + 3][i];
                o[i] = silu<D>(acc);
            }
            store8<D>(y + (size_t)(t0 + r) * C + c0, o);
        }
        return;
    }
    for (int c = c0; c < c0 + nc; c++)
        for (int t = t0; t < t1; t++) {
            float acc = 0.f;
            for (int j = 0; j < K; j++) {
                const typename D::T* src = row(t + j, c);
                acc += D::load(w + c * K + j) * (src ? D::load(src) : 0.f);
            }
            D::store(y + (size_t)t * C + c, silu<D>(acc));
        }
}

template <typename D>
__device__ void conv_cached(const typename D::T* __restrict__ x, long xs,
                            const typename D::T* __restrict__ cache,
                            const typename D::T* __restrict__ w,
                            const unsigned int* __restrict__ lengths,
                            typename D::T* __restrict__ out, int B, int T, int C, int K) {
    typedef typename D::T E;
    const int c0 = (blockIdx.x * blockDim.x + threadIdx.x) * CONV_VEC, b = blockIdx.y;
    if (c0 >= C) return;
    const int nc = min(CONV_VEC, C - c0);
    const int end = lengths ? (int)lengths[b] : T;
    const int t0 = blockIdx.z * CONV_RUN, t1 = min(t0 + CONV_RUN, T);
    // Row p of batch row b's window, from channel c: K-1 cached rows, then x.
    auto row = [&](int p, int c) -> const E* {
        return p < K - 1 ? cache + ((size_t)b * (K - 1) + p) * C + c
                         : x + ((size_t)b * T + p - (K - 1)) * xs + c;
    };
    const bool vec = nc == CONV_VEC && K == 4 && aligned16(x) && aligned16(cache) && aligned16(w) &&
                     aligned16(out) && (xs * sizeof(E)) % 16 == 0 && (C * sizeof(E)) % 16 == 0;
    if (blockIdx.z == gridDim.z - 1) {  // the next cache: window rows end..end+K-1
        E* next = out + (size_t)B * T * C + (size_t)b * (K - 1) * C;
        if (vec) {  // K - 1 = 3 rows
            float v[3][CONV_VEC];
            #pragma unroll
            for (int r = 0; r < 3; r++) load8<D>(row(end + r, c0), v[r]);
            #pragma unroll
            for (int r = 0; r < 3; r++) store8<D>(next + (size_t)r * C + c0, v[r]);
        } else {
            for (int c = c0; c < c0 + nc; c++)
                for (int r = 0; r < K - 1; r++) next[(size_t)r * C + c] = *row(end + r, c);
        }
        return;
    }
    conv_run<D>(row, w, out + (size_t)b * T * C, t0, t1, c0, nc, C, K, vec);
}

// conv_split_<dtype>: the one-pass forward's conv, the records' states and their branches in one
// launch. xs rows (stride ss) [R, S, C]: state row r has len_s[r] real steps (null: all S) and
// starts from zeros; xb rows (stride bs) [B, T, C]: branch row b continues the last K-1 real
// inputs of state row owners[b] (null: row 0), read in place; w [C, K] → out [R·S + B·T, C]: the
// states' rows, then each branch's. No next cache: nothing keeps one. grid = (ceil(C /
// (CONV_VEC·blockDim.x)), 1, R·ceil(S / CONV_RUN) + B·ceil(T / CONV_RUN)). It replaces two conv
// launches and the copy of the states' windows to the branch rows, with the same arithmetic per
// output.
template <typename D>
__device__ void conv_split(const typename D::T* __restrict__ xs, long ss, int R, int S,
                           const unsigned int* __restrict__ len_s,
                           const typename D::T* __restrict__ xb, long bs, int B, int T,
                           const unsigned int* __restrict__ owners,
                           const typename D::T* __restrict__ w, typename D::T* __restrict__ out,
                           int C, int K) {
    typedef typename D::T E;
    const int c0 = (blockIdx.x * blockDim.x + threadIdx.x) * CONV_VEC;
    if (c0 >= C) return;
    const int nc = min(CONV_VEC, C - c0);
    const bool vec = nc == CONV_VEC && K == 4 && aligned16(xs) && aligned16(xb) && aligned16(w) &&
                     aligned16(out) && (ss * sizeof(E)) % 16 == 0 &&
                     (bs * sizeof(E)) % 16 == 0 && (C * sizeof(E)) % 16 == 0;
    const int runs_s = (S + CONV_RUN - 1) / CONV_RUN, runs_b = (T + CONV_RUN - 1) / CONV_RUN;
    const int z = blockIdx.z;
    if (z < R * runs_s) {
        const int r = z / runs_s, t0 = (z % runs_s) * CONV_RUN;
        const E* x = xs + (size_t)r * S * ss;
        auto row = [&](int p, int c) -> const E* {
            const int t = p - (K - 1);
            return t >= 0 ? x + (size_t)t * ss + c : nullptr;
        };
        conv_run<D>(row, w, out + (size_t)r * S * C, t0, min(t0 + CONV_RUN, S), c0, nc, C, K,
                    vec);
        return;
    }
    const int b = (z - R * runs_s) / runs_b, t0 = ((z - R * runs_s) % runs_b) * CONV_RUN;
    const int o = owners ? (int)owners[b] : 0, end = len_s ? (int)len_s[o] : S;
    const E* x = xs + (size_t)o * S * ss;
    auto row = [&](int p, int c) -> const E* {
        const int t = p - (K - 1);
        if (t >= 0) return xb + ((size_t)b * T + t) * bs + c;
        return end + t >= 0 ? x + (size_t)(end + t) * ss + c : nullptr;
    };
    conv_run<D>(row, w, out + ((size_t)R * S + (size_t)b * T) * C, t0, min(t0 + CONV_RUN, T), c0,
                nc, C, K, vec);
}

// The 16-bit kernels run 8 blocks of CONV_CACHED_BLOCK (128) threads per
// multiprocessor: 64 registers with the packed vector path (bf16 without spills, f16 with 8
// bytes). f32 keeps its 118 registers (capped at 64 it spilled 0.5 KB).
#define CONV_CACHED(TAG, D, MINB)                                                               \
    extern "C" __global__ void __launch_bounds__(CONV_CACHED_BLOCK, MINB) conv_cached_##TAG(    \
        const D::T* x, long xs, const D::T* cache, const D::T* w, const unsigned int* lengths,  \
        D::T* out, int B, int T, int C, int K) {                                                \
        conv_cached<D>(x, xs, cache, w, lengths, out, B, T, C, K);                              \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(CONV_CACHED_BLOCK, MINB) conv_split_##TAG(     \
        const D::T* xs, long ss, int R, int S, const unsigned int* len_s, const D::T* xb,       \
        long bs, int B, int T, const unsigned int* owners, const D::T* w, D::T* out, int C,     \
        int K) {                                                                                \
        conv_split<D>(xs, ss, R, S, len_s, xb, bs, B, T, owners, w, out, C, K);                 \
    }
CONV_CACHED(f32, F32, 1)
CONV_CACHED(bf16, BF16, 8)
CONV_CACHED(f16, F16, 8)
