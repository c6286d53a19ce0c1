// flash_attn_bf16: the full-attention layers' softmax(q·kᵀ·scale + bias)·v in one kernel, the
// scores never leaving the multiprocessor (the matmul form wrote them, read them for the
// softmax, wrote the probabilities and read them again: four passes over [B, Hq, T, S + T]).
//
// Keys and values of batch row b: first the S of a past (row owners[b] of kp/vp, the state row
// a branch row continues; row b without owners), then the L of its own (kn/vn). Query t (of T,
// the last T of those L) sees keys j ≤ S + L − T + t, plus the additive key bias [B, S + L]
// (0 or −inf: padding; rows are right-padded, so a query whose own key is masked is padding: it
// reads no key and its output is zero). Each K/V source is [rows, Hkv, steps, 256] at its own
// strides (in elements, steps at 16-byte multiples), so the values can stay a view of the
// projection.
//
// A block takes 64 query rows of one (b, kv head): the rep = Hq / Hkv query heads of a kv head
// are one run of rep·T rows, so GQA reads each key and value tile once for all of them. Its 4
// warps take 16 rows each; per tile of 64 keys: S = Q·Kᵀ (m16n8k16, f32), the online softmax in
// f32 (base 2, as flash attention), then O += P·V with P rounded to bf16. Shared memory holds
// the Q, K and V tiles (101 KB: two blocks a multiprocessor, one loading while the other
// computes: loading the next tile during this one's P·V measured slower). Causality ends a
// block's key loop at its last real row's last key; tiles wholly before a row's last key skip the
// causal compare.
#if __CUDA_ARCH__ >= 800

// From the launcher (-D defines, backend/cuda/catalog.rs): FLASH_HEAD_DIM the head dim, FLASH_ROWS query rows
// per block, FLASH_THREADS, FLASH_SMEM the dynamic shared memory (101632 bytes, checked below).
#define FLASH_KEYS 64                  // keys per tile
#define FLASH_PITCH (FLASH_HEAD_DIM + 8)          // tile pitch (elements): 528 bytes ≡ 16 (mod 128), see ldsm4
static_assert(FLASH_SMEM == 3 * FLASH_ROWS * FLASH_PITCH * 2 + FLASH_KEYS * 4, "FLASH_SMEM: the Q, K and V tiles and the key bias");
#define FLASH_NEG_INF __int_as_float(0xff800000)

struct FaSource {
    const bf16_t* p;
    long row, head, step;  // strides in elements
    __device__ __forceinline__ const bf16_t* at(long r, int h, long j) const {
        return p + r * row + h * head + j * step;
    }
};

__device__ void flash_attn(const bf16_t* __restrict__ q, FaSource kp, FaSource vp,
                           const unsigned* __restrict__ owners, FaSource kn, FaSource vn,
                           const float* __restrict__ bias, bf16_t* __restrict__ out, int hq,
                           int hkv, int T, int S, int L, float scale_log2) {
    extern __shared__ __align__(16) unsigned char smb[];
    bf16_t* q_s = reinterpret_cast<bf16_t*>(smb);
    bf16_t* k_s = q_s + FLASH_ROWS * FLASH_PITCH;
    bf16_t* v_s = k_s + FLASH_KEYS * FLASH_PITCH;
    float* bias_s = reinterpret_cast<float*>(v_s + FLASH_KEYS * FLASH_PITCH);
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, c = lane % 4;
    const int b = blockIdx.z, kvh = blockIdx.y, rep = hq / hkv;
    const int rows = rep * T, r0 = blockIdx.x * FLASH_ROWS;
    const long past_row = owners ? (long)owners[b] : (long)b;
    const int keys = S + L, seen0 = S + L - T;  // query t sees keys j < seen0 + t + 1
    // Loads: a row is 32 16-byte columns, one a lane; warp w moves rows w, w + 4, ...
    const int col = 8 * lane;

    // The block's query rows (row r: head kvh·rep + r / T, step r % T), zeros past the last.
    for (int rr = warp; rr < FLASH_ROWS; rr += FLASH_THREADS / 32) {
        const int r = r0 + rr;
        const bool ok = r < rows;
        const bf16_t* src =
            ok ? q + (((long)b * hq + kvh * rep + r / T) * T + r % T) * FLASH_HEAD_DIM + col : q;
        cp_async16(&q_s[rr * FLASH_PITCH + col], src, ok ? 16 : 0);
    }
    // This thread's two rows (g, g + 8 of its warp's 16): the last key each sees (−1: a row past
    // the block's end, or padding: a query whose own key is masked), the fewest keys any row of
    // the warp sees (tiles below need no mask), and the most any row of the block sees (the key
    // loop's end: a block of padding reads no key).
    __shared__ int block_lim;
    if (tid == 0) block_lim = -1;
    int lim[2];
    #pragma unroll
    for (int h = 0; h < 2; h++) {
        const int r = r0 + 16 * warp + g + 8 * h;
        const int own = seen0 + r % T;
        lim[h] = r < rows && bias[(long)b * keys + own] != FLASH_NEG_INF ? own : -1;
    }
    int warp_lim = min(lim[0], lim[1]), warp_max = max(lim[0], lim[1]);
    #pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        warp_lim = min(warp_lim, __shfl_xor_sync(0xffffffffu, warp_lim, off));
        warp_max = max(warp_max, __shfl_xor_sync(0xffffffffu, warp_max, off));
    }
    __syncthreads();
    if (lane == 0) atomicMax(&block_lim, warp_max);
    __syncthreads();
    const int kv_end = block_lim + 1;
    // Each lane's column of key j's row: the past's (row owners[b]) before S, then its own.
    const bf16_t* kp0 = kp.p + past_row * kp.row + kvh * kp.head + col;
    const bf16_t* vp0 = vp.p + past_row * vp.row + kvh * vp.head + col;
    const bf16_t* kn0 = kn.p + b * kn.row + kvh * kn.head + col;
    const bf16_t* vn0 = vn.p + b * vn.row + kvh * vn.head + col;

    float o[FLASH_HEAD_DIM / 8][4];
    #pragma unroll
    for (int n = 0; n < FLASH_HEAD_DIM / 8; n++)
        #pragma unroll
        for (int i = 0; i < 4; i++) o[n][i] = 0.f;
    float m[2] = {FLASH_NEG_INF, FLASH_NEG_INF}, l[2] = {0.f, 0.f};
    const bf16_t* qa = ldsm_a(q_s, FLASH_PITCH, 16 * warp, lane);
    const bf16_t* kb = ldsm_b2(k_s, FLASH_PITCH, 0, lane);
    // V is stored [key][dim]: its B fragments come transposed (ldsm4t), tiles keys +0/+8, then
    // dims +8.
    const bf16_t* vb = v_s + ((lane & 7) + 8 * ((lane >> 3) & 1)) * FLASH_PITCH + 8 * (lane >> 4);

    for (int kv0 = 0; kv0 < kv_end; kv0 += FLASH_KEYS) {
        __syncthreads();  // the previous tile is consumed
        for (int jj = warp; jj < FLASH_KEYS; jj += FLASH_THREADS / 32) {
            const int j = kv0 + jj;
            const bool ok = j < kv_end, past = j < S;
            const bf16_t* ks = past ? kp0 + j * kp.step : kn0 + (j - S) * kn.step;
            const bf16_t* vs = past ? vp0 + j * vp.step : vn0 + (j - S) * vn.step;
            cp_async16(&k_s[jj * FLASH_PITCH + col], ok ? ks : q, ok ? 16 : 0);
            cp_async16(&v_s[jj * FLASH_PITCH + col], ok ? vs : q, ok ? 16 : 0);
        }
        cp_async_commit();
        if (tid < FLASH_KEYS) {
            const int j = kv0 + tid;
            bias_s[tid] = j < kv_end ? bias[(long)b * keys + j] * 1.4426950408889634f : FLASH_NEG_INF;
        }
        cp_async_wait<0>();
        __syncthreads();

        // S = Q·Kᵀ for this warp's 16 rows and the tile's 64 keys.
        float s[FLASH_KEYS / 8][4];
        #pragma unroll
        for (int n = 0; n < FLASH_KEYS / 8; n++)
            #pragma unroll
            for (int i = 0; i < 4; i++) s[n][i] = 0.f;
        #pragma unroll
        for (int k0 = 0; k0 < FLASH_HEAD_DIM; k0 += 16) {
            unsigned a[4];
            ldsm4(a, qa + k0);
            #pragma unroll
            for (int n = 0; n < FLASH_KEYS / 8; n += 2) {
                unsigned bf[4];
                ldsm4(bf, kb + 8 * n * FLASH_PITCH + k0);
                mma16(s[n], a, {bf[0], bf[1]});
                mma16(s[n + 1], a, {bf[2], bf[3]});
            }
        }
        // Scaled to base 2 with the bias, masked where the tile passes a row's last key, and the
        // rows' running maxima (a row's 4 lanes agree).
        const bool masked = kv0 + FLASH_KEYS - 1 > warp_lim;
        float mx[2] = {m[0], m[1]};
        #pragma unroll
        for (int n = 0; n < FLASH_KEYS / 8; n++) {
            const float2 bj = *reinterpret_cast<const float2*>(&bias_s[8 * n + 2 * c]);
            #pragma unroll
            for (int i = 0; i < 4; i++) {
                const int jj = 8 * n + 2 * c + (i & 1), h = i >> 1;
                float v = s[n][i] * scale_log2 + ((i & 1) ? bj.y : bj.x);
                if (masked && kv0 + jj > lim[h]) v = FLASH_NEG_INF;
                s[n][i] = v;
                mx[h] = fmaxf(mx[h], v);
            }
        }
        float base[2], alpha[2];
        #pragma unroll
        for (int h = 0; h < 2; h++) {
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
            base[h] = mx[h] == FLASH_NEG_INF ? 0.f : mx[h];  // no key seen yet: keep zeros
            alpha[h] = exp2f(m[h] - base[h]);
            m[h] = mx[h];
            l[h] *= alpha[h];
        }
        // Rescaled only when a row's maximum rose (in a causal state's later tiles it rarely does).
        if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
            #pragma unroll
            for (int n = 0; n < FLASH_HEAD_DIM / 8; n++)
                #pragma unroll
                for (int i = 0; i < 4; i++) o[n][i] *= alpha[i >> 1];
        }
        // P = 2^(S − max), summed in f32 and rounded to bf16 as the A operand of P·V: n-tiles
        // 2kk and 2kk + 1 of S are k-step kk's A fragment.
        #pragma unroll
        for (int kk = 0; kk < FLASH_KEYS / 16; kk++) {
            float p[2][4];
            #pragma unroll
            for (int u = 0; u < 2; u++)
                #pragma unroll
                for (int i = 0; i < 4; i++) {
                    p[u][i] = exp2f(s[2 * kk + u][i] - base[i >> 1]);
                    l[i >> 1] += p[u][i];
                }
            const unsigned a[4] = {bf16x2(p[0][0], p[0][1]), bf16x2(p[0][2], p[0][3]),
                                   bf16x2(p[1][0], p[1][1]), bf16x2(p[1][2], p[1][3])};
            #pragma unroll
            for (int n = 0; n < FLASH_HEAD_DIM / 8; n += 2) {
                unsigned bf[4];
                ldsm4t(bf, vb + 16 * kk * FLASH_PITCH + 8 * n);
                mma16(o[n], a, {bf[0], bf[1]});
                mma16(o[n + 1], a, {bf[2], bf[3]});
            }
        }
    }

    // A block of padding ran no tile: its query tile's copies land before the block ends.
    cp_async_wait<0>();
    // O / l, stored as bf16 at [b, head, t, :] (rows with no key seen: zeros).
    #pragma unroll
    for (int h = 0; h < 2; h++) {
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
        const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
        const int r = r0 + 16 * warp + g + 8 * h;
        if (r >= rows) continue;
        bf16_t* dst = out + (((long)b * hq + kvh * rep + r / T) * T + r % T) * FLASH_HEAD_DIM;
        #pragma unroll
        for (int n = 0; n < FLASH_HEAD_DIM / 8; n++)
            *reinterpret_cast<unsigned*>(dst + 8 * n + 2 * c) =
                bf16x2(o[n][2 * h] * inv, o[n][2 * h + 1] * inv);
    }
}

extern "C" __global__ void __launch_bounds__(FLASH_THREADS, 2) flash_attn_bf16(
    const bf16_t* q, const bf16_t* kp, long kp_row, long kp_head, long kp_step, const bf16_t* vp,
    long vp_row, long vp_head, long vp_step, const unsigned* owners, const bf16_t* kn,
    long kn_row, long kn_head, long kn_step, const bf16_t* vn, long vn_row, long vn_head,
    long vn_step, const float* bias, bf16_t* out, int hq, int hkv, int T, int S, int L,
    float scale_log2) {
    flash_attn(q, FaSource{kp, kp_row, kp_head, kp_step}, FaSource{vp, vp_row, vp_head, vp_step},
               owners, FaSource{kn, kn_row, kn_head, kn_step},
               FaSource{vn, vn_row, vn_head, vn_step}, bias, out, hq, hkv, T, S, L, scale_log2);
}

#endif
