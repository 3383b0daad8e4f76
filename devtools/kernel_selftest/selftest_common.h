// Helpers shared by the standalone kernel self-tests (fwd_selftest.cc, bwd_selftest.cc):
// CUDA error checks, the failure counter, opening a variant library, fp16/bf16 bit conversions
// and random fills, a deadline-bounded device sync and a parallel-for for the float64
// references. Included by exactly one .cc per binary.
#ifndef JAXFLASH_DEVTOOLS_SELFTEST_COMMON_H_
#define JAXFLASH_DEVTOOLS_SELFTEST_COMMON_H_

#include <cuda_runtime.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kernel_abi.h"

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
typedef const JaxflashVariantInfo* (*InfoFn)(void);

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

// The info of a library of this ABI version, or nullptr (with the reason printed).
const JaxflashVariantInfo* Info(void* lib, const std::string& path) {
  auto version = reinterpret_cast<VersionFn>(dlsym(lib, "jaxflash_variant_abi_version"));
  auto info = reinterpret_cast<InfoFn>(dlsym(lib, "jaxflash_variant_info"));
  if (!version || !info || version() != JAXFLASH_KERNEL_ABI_VERSION) {
    printf("%s: not a kernel ABI %d library (abi %d)\n", path.c_str(), JAXFLASH_KERNEL_ABI_VERSION,
           version ? version() : -1);
    return nullptr;
  }
  return info();
}

// A variant library under test: its key, its info and the kernel_abi.h functions a self-test
// calls (`entry`: jaxflash_variant_fwd or _bwd, as an Entry).
template <typename Entry>
struct VariantLibrary {
  std::string key;
  const JaxflashVariantInfo* info = nullptr;
  LoadFn load = nullptr;
  Entry entry = nullptr;
};

// Opens the library at `path` as a variant of `direction` (JaxflashVariantInfo.direction: 0
// forward, 1 backward) that exports `entry_name`; false, with the reason printed, when it is not
// one.
template <typename Entry>
bool OpenVariant(const std::string& path, int32_t direction, const char* entry_name,
                 VariantLibrary<Entry>* out) {
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    printf("dlopen %s: %s\n", path.c_str(), dlerror());
    return false;
  }
  auto key_fn = reinterpret_cast<KeyFn>(dlsym(lib, "jaxflash_variant_key"));
  out->info = Info(lib, path);
  out->load = reinterpret_cast<LoadFn>(dlsym(lib, "jaxflash_variant_load"));
  out->entry = reinterpret_cast<Entry>(dlsym(lib, entry_name));
  if (!out->info || !key_fn || !out->load || !out->entry || out->info->direction != direction) {
    printf("%s: not a %s variant library (kernel_abi.h)\n", path.c_str(),
           direction == 0 ? "forward" : "backward");
    return false;
  }
  out->key = key_fn();
  return true;
}

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

// Random half-precision bits, normal with standard deviation sigma: a table of samples indexed by
// a fast generator (the benchmark tensors hold 100M elements; drawing each from
// std::normal_distribution is slow).
void FillRandom(std::vector<uint16_t>& x, uint64_t seed, float sigma = 1.f) {
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::normal_distribution<float> nd(0.f, sigma);
  std::vector<uint16_t> table(1 << 16);
  for (auto& t : table) t = ToHalfBits(nd(rng));
  uint64_t state = seed * 0x9E3779B97F4A7C15ull + 1;
  for (auto& v : x) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    v = table[state & 0xFFFF];
  }
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
