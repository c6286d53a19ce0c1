// Compiled by nvcc (build.rs) or NVRTC, common.cuh prepended.

// count_differences_u16: how many of n 16-bit words differ between a and b, added to *count.
// The tuned matmul keeps a cuBLASLt algorithm only where its output equals cuBLAS's bit for
// bit. Grid-stride; one atomic add per warp.
extern "C" __global__ void count_differences_u16(const unsigned short* a, const unsigned short* b,
                                                 unsigned long long n, unsigned int* count) {
    unsigned int local = 0;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x)
        local += a[i] != b[i];
    for (int off = 16; off > 0; off >>= 1) local += __shfl_xor_sync(0xffffffffu, local, off);
    if ((threadIdx.x & 31) == 0 && local) atomicAdd(count, local);
}
