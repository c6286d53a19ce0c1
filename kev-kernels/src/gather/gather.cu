// Compiled by nvcc (build.rs) or NVRTC, common.cuh prepended (no CUDA headers: bf16 and f16 are
// read and written as 16-bit integers); the constants shared with the Rust launcher come as
// -D defines (backend/cuda/catalog.rs).

// gather_rows16: out row r = src row idx[r], rows of `units` 16-byte words (any dtype), n rows.
// An index at or past `rows` (the host checks them) writes zeros rather than reading outside the
// source. grid = (word blocks, up to 65535 output rows, striding).
extern "C" __global__ void gather_rows16(const uint4* src, const unsigned int* idx, uint4* out,
                                         long units, int rows, int n) {
    for (int r = blockIdx.y; r < n; r += gridDim.y) {
        const unsigned int from = idx[r];
        const uint4* s = src + (size_t)from * units;
        uint4* o = out + (size_t)r * units;
        for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < units;
             i += (long)gridDim.x * blockDim.x)
            o[i] = from < (unsigned int)rows ? s[i] : make_uint4(0u, 0u, 0u, 0u);
    }
}

// copy_rows16: a strided view made contiguous, whole rows of `units` 16-byte words (any dtype):
// row (a, b, c) of dims (d0, d1, d2) is read at a·s0 + b·s1 + c·s2 words and written at its
// place in row-major order. grid = (word blocks, up to 65535 rows, striding over d0·d1·d2).
extern "C" __global__ void copy_rows16(const uint4* src, uint4* out, long units, int d1, int d2,
                                       long s0, long s1, long s2, long rows) {
    for (long r = blockIdx.y; r < rows; r += gridDim.y) {
        const long c = r % d2, b = (r / d2) % d1, a = r / ((long)d1 * d2);
        const uint4* s = src + a * s0 + b * s1 + c * s2;
        uint4* o = out + r * units;
        for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < units;
             i += (long)gridDim.x * blockDim.x)
            o[i] = s[i];
    }
}

// gather_cat16: out[b, h] = src[idx[b], h] followed by tail[b, h] (any dtype), `us` and `ut`
// 16-byte words a (row, head) of src and of tail: attention's keys or values for a branch row, its
// state row's then its own, in one copy. An index at or past `rows` (the host checks them) gives
// zeros for the src part. grid = (word blocks, B·heads).
extern "C" __global__ void gather_cat16(const uint4* src, const unsigned int* idx, const uint4* tail,
                                        uint4* out, int heads, long us, long ut, int rows) {
    const int bh = blockIdx.y, h = bh % heads;
    const unsigned int from = idx[bh / heads];
    const uint4* s = src + ((size_t)from * heads + h) * us;
    const uint4* t = tail + (size_t)bh * ut;
    uint4* o = out + (size_t)bh * (us + ut);
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < us + ut;
         i += (long)gridDim.x * blockDim.x)
        o[i] = i >= us ? t[i - us] : from < (unsigned int)rows ? s[i] : make_uint4(0u, 0u, 0u, 0u);
}

// copy_runs16: run r copies `table[2n + r]` 16-byte words (any dtype) from address `table[r]` to
// address `table[n + r]`: views packed into buffers of their own, every run of every view in one
// launch. grid = (word blocks, up to 65535 runs, striding).
extern "C" __global__ void copy_runs16(const unsigned long long* table, int n) {
    for (int r = blockIdx.y; r < n; r += gridDim.y) {
        const uint4* s = (const uint4*)table[r];
        uint4* o = (uint4*)table[n + r];
        const long units = (long)table[2 * n + r];
        for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < units;
             i += (long)gridDim.x * blockDim.x)
            o[i] = s[i];
    }
}
