// Compiled at run time with NVRTC, common.cuh prepended (no CUDA headers: bf16 and f16 are
// read and written as 16-bit integers); the constants shared with the Rust launcher come as
// -D defines (backend/cuda/sources.rs).

// gather_rows16: out row r = src row idx[r], rows of `units` 16-byte words (any dtype). An index
// at or past `rows` (the host checks them) writes zeros rather than reading outside the source.
// grid = (word blocks, output rows).
extern "C" __global__ void gather_rows16(const uint4* src, const unsigned int* idx, uint4* out,
                                         long units, int rows) {
    const unsigned int from = idx[blockIdx.y];
    const uint4* s = src + (size_t)from * units;
    uint4* o = out + (size_t)blockIdx.y * units;
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < units;
         i += (long)gridDim.x * blockDim.x)
        o[i] = from < (unsigned int)rows ? s[i] : make_uint4(0u, 0u, 0u, 0u);
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
