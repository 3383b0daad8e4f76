// Helpers shared by the standalone kernel self-tests (fwd_selftest.cc, bwd_selftest.cc):
// CUDA error checks, the failure counter, fp16/bf16 bit conversions, a deadline-bounded device
// sync and a parallel-for for the float64 references. Included by exactly one .cc per binary.
#ifndef JAXFLASH_DEVTOOLS_SELFTEST_COMMON_H_
#define JAXFLASH_DEVTOOLS_SELFTEST_COMMON_H_

#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <thread>
#include <vector>

#define CK(x)                                                                          \
  do {                                                                                 \
    cudaError_t e_ = (x);                                                              \
    if (e_ != cudaSuccess) {                                                           \
      printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); \
      fflush(stdout);                                                                  \
      _exit(2);                                                                        \
    }                                                                                  \
  } while (0)

namespace {

typedef int32_t (*VersionFn)(void);
typedef const char* (*KeyFn)(void);
typedef int32_t (*LoadFn)(void);

bool g_bf16 = true;  // the library under test is bf16 (else fp16)

// A forward library whose info has tile_counter 1 claims its tiles from a zeroed int32
// (kernel_abi.h): TileCounter(wanted) is one device int32 for it (nullptr when not wanted), and
// LaunchForward zeroes the args' counter on the stream before each launch, as the FFI handler
// does.
int32_t* TileCounter(bool wanted) {
  static int32_t* counter = nullptr;
  if (wanted && counter == nullptr) CK(cudaMalloc(reinterpret_cast<void**>(&counter), 4));
  return wanted ? counter : nullptr;
}

template <typename Fn, typename Args>
int32_t LaunchForward(Fn fwd, Args* args, cudaStream_t stream) {
  if (args->tile_counter != nullptr &&
      cudaMemsetAsync(args->tile_counter, 0, sizeof(int32_t), stream) != cudaSuccess) {
    return -1;
  }
  return fwd(args, stream);
}
int g_failures = 0;

#define EXPECT(cond, ...)  \
  do {                     \
    if (!(cond)) {         \
      printf("  FAIL: ");  \
      printf(__VA_ARGS__); \
      printf("\n");        \
      g_failures++;        \
    }                      \
  } while (0)

uint16_t ToHalfBits(float f) {
  if (g_bf16) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return static_cast<uint16_t>((u + 0x7fff + ((u >> 16) & 1)) >> 16);
  }
  _Float16 h = static_cast<_Float16>(f);
  uint16_t b;
  memcpy(&b, &h, 2);
  return b;
}

float FromHalfBits(uint16_t b) {
  if (g_bf16) {
    uint32_t u = static_cast<uint32_t>(b) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
  }
  _Float16 h;
  memcpy(&h, &b, 2);
  return static_cast<float>(h);
}

// Waits for the device with a deadline: a hung kernel (a pipeline, barrier or semaphore deadlock)
// must not eat the whole GPU lease. cudaDeviceSynchronize would block forever.
void SyncOrDie(const char* what, double seconds) {
  cudaEvent_t ev;
  CK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  CK(cudaEventRecord(ev, nullptr));
  auto start = std::chrono::steady_clock::now();
  while (true) {
    cudaError_t e = cudaEventQuery(ev);
    if (e == cudaSuccess) break;
    if (e != cudaErrorNotReady) {
      printf("CUDA error %s during %s\n", cudaGetErrorString(e), what);
      fflush(stdout);
      _exit(2);
    }
    double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (dt > seconds) {
      printf("HANG: %s did not finish within %.0f s\n", what, seconds);
      fflush(stdout);
      _exit(3);
    }
    usleep(200);
  }
  CK(cudaEventDestroy(ev));
  CK(cudaGetLastError());
}

// Runs fn(i) for i in [0, n) on all cores.
void ParallelFor(int n, const std::function<void(int)>& fn) {
  int workers = std::max(1u, std::min(std::thread::hardware_concurrency(), 32u));
  std::atomic<int> next(0);
  std::vector<std::thread> pool;
  for (int w = 0; w < workers; ++w)
    pool.emplace_back([&] {
      for (int i = next++; i < n; i = next++) fn(i);
    });
  for (auto& t : pool) t.join();
}

}  // namespace

#endif  // JAXFLASH_DEVTOOLS_SELFTEST_COMMON_H_
