// bf16 tensor-core helpers shared by the chunked delta rule and flash attention (prepended
// after common.cuh to the sources compiled for compute_80): packing, mma.sync m16n8k16 on bf16
// operands with f32 accumulators, ldmatrix and cp.async.
#if __CUDA_ARCH__ >= 800

typedef unsigned short bf16_t;
// x rounded to bf16 (nearest even), and two values packed with `lo` in the low half.
__device__ __forceinline__ bf16_t bf16r(float x) {
    bf16_t h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}
__device__ __forceinline__ unsigned bf16x2(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
// d += a·b for one 16×8 tile over k = 16 (the PTX ISA's m16n8k16 .bf16 fragments).
__device__ __forceinline__ void mma16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// ldmatrix: lane (g, c) receives word (g, c) of each of four 8 × 8 tiles of 16-bit elements,
// which is the m16n8k16 fragment of a matrix stored with k along its rows (A as x[m][k], B as
// y[n][k]). Lanes 8i..8i+7 give the row addresses of tile i; rows 16-byte aligned, and a pitch
// ≡ 16 (mod 128) bytes keeps a tile's 8 rows in distinct banks.
__device__ __forceinline__ void ldsm4(unsigned (&r)[4], const bf16_t* p) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}
// This lane's row address for an A fragment (tiles: rows +0/+8, then k +0/+8) of x[m][k].
__device__ __forceinline__ const bf16_t* ldsm_a(const bf16_t* x, int p, int m0, int lane) {
    return x + (m0 + (lane & 7) + 8 * ((lane >> 3) & 1)) * p + 8 * (lane >> 4);
}
// ... for the B fragments of two n-tiles (tiles: k +0/+8 of rows n0.., then of rows n0+8..)
// of y[n][k]: registers {0, 1} are n-tile 0's fragment, {2, 3} n-tile 1's.
__device__ __forceinline__ const bf16_t* ldsm_b2(const bf16_t* y, int p, int n0, int lane) {
    return y + (n0 + (lane & 7) + 8 * (lane >> 4)) * p + 8 * ((lane >> 3) & 1);
}
// ... with each 8 × 8 tile transposed: the B fragment of a matrix stored with n along its rows
// (y[k][n]); lanes give row addresses as for ldsm4.
__device__ __forceinline__ void ldsm4t(unsigned (&r)[4], const bf16_t* p) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

// 16 bytes from global to shared memory without passing through registers; `bytes` = 0 writes
// zeros (and reads nothing at `src`). Issued copies form a group at cp_async_commit; waiting
// with N leaves the N most recent groups in flight.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int bytes) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(a), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

#endif
