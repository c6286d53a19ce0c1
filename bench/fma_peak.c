// The CPU's f32 FMA peak, the "hardware limit" the CPU figures are a fraction of: 12 independent
// FMA chains per thread in registers (no memory traffic), AVX2 (8 lanes) and AVX-512 (16 lanes),
// on 1 and 2 threads.
//
//   gcc -O3 -funroll-all-loops -mavx512f -mfma -o /tmp/fma_peak bench/fma_peak.c -lpthread && /tmp/fma_peak
//
// (Without -funroll-all-loops gcc keeps the accumulators in memory and measures stores.) On a CPU
// without AVX-512 the AVX-512 half dies with an illegal instruction after the AVX2 lines.
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <time.h>

#define FMAS 200000000L  // per thread and lane width, over 12 chains

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void* chains512(void* out) {
    __m512 acc[12], x = _mm512_set1_ps(0.9999f), y = _mm512_set1_ps(1e-5f);
    for (int i = 0; i < 12; i++) acc[i] = _mm512_set1_ps(i * 1e-3f);
    for (long n = 0; n < FMAS / 16; n++)
        for (int i = 0; i < 12; i++) acc[i] = _mm512_fmadd_ps(acc[i], x, y);
    float s = 0;
    for (int i = 0; i < 12; i++) s += _mm512_reduce_add_ps(acc[i]);
    *(float*)out = s;  // keeps the chains alive
    return 0;
}

static void* chains256(void* out) {
    __m256 acc[12], x = _mm256_set1_ps(0.9999f), y = _mm256_set1_ps(1e-5f);
    for (int i = 0; i < 12; i++) acc[i] = _mm256_set1_ps(i * 1e-3f);
    for (long n = 0; n < FMAS / 16; n++)
        for (int i = 0; i < 12; i++) acc[i] = _mm256_fmadd_ps(acc[i], x, y);
    float lanes[8], s = 0;
    for (int i = 0; i < 12; i++) {
        _mm256_storeu_ps(lanes, acc[i]);
        for (int j = 0; j < 8; j++) s += lanes[j];
    }
    *(float*)out = s;
    return 0;
}

int main(void) {
    for (int wide = 0; wide < 2; wide++)
        for (int threads = 1; threads <= 2; threads++) {
            pthread_t t[2];
            float sink[2];
            double t0 = now();
            for (int i = 0; i < threads; i++)
                pthread_create(&t[i], 0, wide ? chains512 : chains256, &sink[i]);
            for (int i = 0; i < threads; i++) pthread_join(t[i], 0);
            double flops = (double)threads * (FMAS / 16) * 12 * (wide ? 16 : 8) * 2;
            printf("%s, %d thread%s: %.1f GFLOP/s\n", wide ? "AVX-512" : "AVX2", threads,
                   threads > 1 ? "s" : "", flops / (now() - t0) / 1e9);
        }
    return 0;
}
