// Kernel times of a CUDA program's profiled range at the cost of a trace, not of a replay: a CUDA
// injection library (CUDA_INJECTION64_PATH) that records every kernel's GPU start and end through
// CUPTI's activity API between cuProfilerStart and cuProfilerStop (`bench --profile-timed`), and
// writes them to $KEV_TRACE_OUT as CSV (name, start_ns, end_ns, stream). ncu serializes and
// instruments each launch (~0.2 s a launch on the H100), which a varied pass of thousands of
// launches cannot afford; bench/kernel_summary.py --trace sums the trace per kernel and gives the GPU's
// idle time in the range.
//
// Built and run by `bench/run_gpu.sh trace` (g++ against the machine's CUDA and CUPTI headers;
// KEV_KERNEL_RECORD names the newest kernel record of that CUPTI: CUpti_ActivityKernel10 in
// CUDA 13, 9 in 12), then:
//   CUDA_INJECTION64_PATH=$PWD/kernel_trace.so KEV_TRACE_OUT=trace.csv .gpu/bench ... --profile-timed
#include <cupti.h>

#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#ifndef KEV_KERNEL_RECORD
#define KEV_KERNEL_RECORD CUpti_ActivityKernel10
#endif

namespace {

struct Kernel {
  std::string name;
  unsigned long long start, end;
  unsigned stream;
};

std::mutex mu;
std::vector<Kernel> kernels;
CUpti_SubscriberHandle subscriber;
constexpr size_t kBufferBytes = 8 << 20;

void check(CUptiResult r, const char* what) {
  if (r == CUPTI_SUCCESS) return;
  const char* msg = nullptr;
  cuptiGetResultString(r, &msg);
  std::fprintf(stderr, "kernel_trace: %s: %s\n", what, msg ? msg : "?");
}

void CUPTIAPI requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = kBufferBytes;
  *max_records = 0;
}

void CUPTIAPI completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  CUpti_Activity* record = nullptr;
  std::lock_guard<std::mutex> lock(mu);
  while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
    if (record->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) continue;
    auto* k = reinterpret_cast<const KEV_KERNEL_RECORD*>(record);
    kernels.push_back({k->name ? k->name : "?", k->start, k->end, k->streamId});
  }
  size_t dropped = 0;
  cuptiActivityGetNumDroppedRecords(nullptr, 0, &dropped);
  if (dropped) std::fprintf(stderr, "kernel_trace: %zu records dropped\n", dropped);
  std::free(buffer);
}

// The profiled range: kernel records on from cuProfilerStart, off (and flushed) at cuProfilerStop.
void CUPTIAPI on_api(void*, CUpti_CallbackDomain, CUpti_CallbackId id, const void* data) {
  auto* info = static_cast<const CUpti_CallbackData*>(data);
  if (id == CUPTI_DRIVER_TRACE_CBID_cuProfilerStart && info->callbackSite == CUPTI_API_ENTER) {
    check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "enable");
  } else if (id == CUPTI_DRIVER_TRACE_CBID_cuProfilerStop && info->callbackSite == CUPTI_API_EXIT) {
    check(cuptiActivityDisable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "disable");
    check(cuptiActivityFlushAll(1), "flush");
  }
}

void write_out() {
  check(cuptiActivityFlushAll(1), "flush at exit");
  const char* path = std::getenv("KEV_TRACE_OUT");
  FILE* f = std::fopen(path ? path : "kernel_trace.csv", "w");
  if (!f) {
    std::perror("kernel_trace: the output");
    return;
  }
  std::lock_guard<std::mutex> lock(mu);
  std::fprintf(f, "name,start_ns,end_ns,stream\n");
  for (const auto& k : kernels) {
    std::string name = k.name;
    for (auto& c : name)
      if (c == ',' || c == '"' || c == '\n') c = ' ';
    std::fprintf(f, "%s,%llu,%llu,%u\n", name.c_str(), k.start, k.end, k.stream);
  }
  std::fclose(f);
  std::fprintf(stderr, "kernel_trace: %zu kernels to %s\n", kernels.size(),
               path ? path : "kernel_trace.csv");
}

}  // namespace

extern "C" int InitializeInjection() {
  check(cuptiActivityRegisterCallbacks(requested, completed), "register buffers");
  check(cuptiSubscribe(&subscriber, on_api, nullptr), "subscribe");
  check(cuptiEnableCallback(1, subscriber, CUPTI_CB_DOMAIN_DRIVER_API,
                            CUPTI_DRIVER_TRACE_CBID_cuProfilerStart),
        "cuProfilerStart callback");
  check(cuptiEnableCallback(1, subscriber, CUPTI_CB_DOMAIN_DRIVER_API,
                            CUPTI_DRIVER_TRACE_CBID_cuProfilerStop),
        "cuProfilerStop callback");
  std::atexit(write_out);
  return 1;
}
