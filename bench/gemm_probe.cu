// Times cuBLAS's default bf16 GEMM (the call candle makes) against every algorithm cuBLASLt's
// heuristic offers for the same product, on the backbone's projection shapes.
//
//   nvcc -O2 -std=c++20 -arch=sm_90 bench/gemm_probe.cu -lcublasLt -lcublas -o gemm_probe
//   [WS_MB=32] [NO_SPLITK=1] ./gemm_probe M,N,K [M,N,K ...]
//
// WS_MB: the workspace cuBLASLt's candidates may use (MiB); NO_SPLITK: skip candidates that
// split the sum over k (`kev_kernels::linear` times only those with neither).
//
// y[M,N] = x[M,K] · W[N,K]ᵀ, all row-major bf16, f32 accumulation: in cuBLAS's column-major
// terms C[N,M] = op(W)ᵀ·x with transa = T. Prints one JSON line per shape: the default call's
// µs, the heuristic's first choice, the fastest algorithm and its configuration, and the largest
// difference of its output from the default's (split-K sums in another order).
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cmath>

#define CK(x) do { auto e = (x); if ((int)e != 0) { fprintf(stderr, "%s:%d %s -> %d\n", __FILE__, __LINE__, #x, (int)e); exit(1); } } while (0)

__global__ void fill(__nv_bfloat16 *p, size_t n, unsigned seed) {
  size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  if (i < n) {
    unsigned h = (unsigned)i * 2654435761u ^ seed;
    h ^= h >> 13; h *= 0x5bd1e995u; h ^= h >> 15;
    p[i] = __float2bfloat16(((h & 0xffff) / 65536.0f - 0.5f) * 0.1f);
  }
}

static float time_us(cudaStream_t s, int reps, auto &&launch) {
  for (int i = 0; i < 10; i++) launch();
  cudaEvent_t a, b;
  cudaEventCreate(&a); cudaEventCreate(&b);
  cudaEventRecord(a, s);
  for (int i = 0; i < reps; i++) launch();
  cudaEventRecord(b, s);
  cudaEventSynchronize(b);
  float ms; cudaEventElapsedTime(&ms, a, b);
  return ms * 1000.0f / reps;
}

static float max_diff(const __nv_bfloat16 *x, const __nv_bfloat16 *y, size_t n) {
  std::vector<__nv_bfloat16> a(n), b(n);
  cudaMemcpy(a.data(), x, n * 2, cudaMemcpyDeviceToHost);
  cudaMemcpy(b.data(), y, n * 2, cudaMemcpyDeviceToHost);
  float m = 0;
  for (size_t i = 0; i < n; i++) m = fmaxf(m, fabsf(__bfloat162float(a[i]) - __bfloat162float(b[i])));
  return m;
}

int main(int argc, char **argv) {
  cudaStream_t s; cudaStreamCreate(&s);
  cublasHandle_t h; CK(cublasCreate(&h)); CK(cublasSetStream(h, s));
  cublasLtHandle_t lt; CK(cublasLtCreate(&lt));
  size_t ws_bytes = getenv("WS_MB") ? (size_t)atoi(getenv("WS_MB")) << 20 : 32u << 20;
  void *ws = nullptr; if (ws_bytes) cudaMalloc(&ws, ws_bytes);
  for (int a = 1; a < argc; a++) {
    int M, N, K;
    if (sscanf(argv[a], "%d,%d,%d", &M, &N, &K) != 3) { fprintf(stderr, "bad shape %s\n", argv[a]); return 2; }
    __nv_bfloat16 *x, *w, *y0, *y1;
    cudaMalloc(&x, (size_t)M * K * 2); cudaMalloc(&w, (size_t)N * K * 2);
    cudaMalloc(&y0, (size_t)M * N * 2); cudaMalloc(&y1, (size_t)M * N * 2);
    fill<<<(M * (size_t)K + 255) / 256, 256, 0, s>>>(x, (size_t)M * K, 1);
    fill<<<(N * (size_t)K + 255) / 256, 256, 0, s>>>(w, (size_t)N * K, 2);
    float one = 1, zero = 0;
    double flop = 2.0 * M * N * K;
    int reps = (int)fmax(20, fmin(2000, 2e11 / flop));
    float t_def = time_us(s, reps, [&] {
      CK(cublasGemmStridedBatchedEx(h, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &one, w, CUDA_R_16BF, K,
                                    (long long)N * K, x, CUDA_R_16BF, K, (long long)M * K, &zero, y0,
                                    CUDA_R_16BF, N, (long long)M * N, 1, CUBLAS_COMPUTE_32F,
                                    CUBLAS_GEMM_DEFAULT_TENSOR_OP));
    });
    cublasLtMatmulDesc_t desc;
    CK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    cublasLtMatrixLayout_t la, lb, lc;
    CK(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, K, N, K));
    CK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, K, M, K));
    CK(cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, N, M, N));
    cublasLtMatmulPreference_t pref;
    CK(cublasLtMatmulPreferenceCreate(&pref));
    CK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof ws_bytes));
    const int want = 32;
    cublasLtMatmulHeuristicResult_t res[want];
    int got = 0;
    CK(cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, lc, lc, pref, want, res, &got));
    float t_first = -1, t_best = 1e30f;
    int best = -1;
    for (int i = 0; i < got; i++) {
      if (res[i].state != CUBLAS_STATUS_SUCCESS) continue;
      int sk = 1; size_t sz;
      cublasLtMatmulAlgoConfigGetAttribute(&res[i].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &sk, sizeof sk, &sz);
      if (getenv("NO_SPLITK") && sk > 1) continue;
      bool ok = true;
      float t = time_us(s, reps, [&] {
        if (cublasLtMatmul(lt, desc, &one, w, la, x, lb, &zero, y1, lc, y1, lc, &res[i].algo, ws,
                           ws_bytes, s) != CUBLAS_STATUS_SUCCESS) ok = false;
      });
      if (!ok) continue;
      if (i == 0) t_first = t;
      if (t < t_best) { t_best = t; best = i; }
    }
    int tile = -1, splitk = -1, stages = -1, algo_id = -1, red = -1;
    float diff = -1;
    if (best >= 0) {
      size_t sz;
      cublasLtMatmulAlgoConfigGetAttribute(&res[best].algo, CUBLASLT_ALGO_CONFIG_ID, &algo_id, sizeof algo_id, &sz);
      cublasLtMatmulAlgoConfigGetAttribute(&res[best].algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof tile, &sz);
      cublasLtMatmulAlgoConfigGetAttribute(&res[best].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splitk, sizeof splitk, &sz);
      cublasLtMatmulAlgoConfigGetAttribute(&res[best].algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages, sizeof stages, &sz);
      cublasLtMatmulAlgoConfigGetAttribute(&res[best].algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &red, sizeof red, &sz);
      CK(cublasLtMatmul(lt, desc, &one, w, la, x, lb, &zero, y1, lc, y1, lc, &res[best].algo, ws, ws_bytes, s));
      cudaStreamSynchronize(s);
      diff = max_diff(y0, y1, (size_t)M * N);
    }
    printf("{\"m\":%d,\"n\":%d,\"k\":%d,\"algos\":%d,\"default_us\":%.2f,\"lt_first_us\":%.2f,"
           "\"lt_best_us\":%.2f,\"best_index\":%d,\"best_algo\":%d,\"best_tile\":%d,\"best_splitk\":%d,"
           "\"best_stages\":%d,\"best_reduction\":%d,\"default_tflops\":%.1f,\"best_tflops\":%.1f,"
           "\"max_diff\":%.3g}\n",
           M, N, K, got, t_def, t_first, t_best, best, algo_id, tile, splitk, stages, red,
           flop / t_def * 1e-6, flop / t_best * 1e-6, diff);
    fflush(stdout);
    cublasLtMatmulPreferenceDestroy(pref);
    cublasLtMatrixLayoutDestroy(la); cublasLtMatrixLayoutDestroy(lb); cublasLtMatrixLayoutDestroy(lc);
    cublasLtMatmulDescDestroy(desc);
    cudaFree(x); cudaFree(w); cudaFree(y0); cudaFree(y1);
  }
  return 0;
}
