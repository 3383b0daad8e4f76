// The kernels' shared-memory hand-off in miniature, for compute-sanitizer racecheck: a producer
// lane fills ring slots by bulk copy (cp.async.bulk, completing on the slot's "full" mbarrier
// with transaction bytes) and the consumer warp reads them with plain shared loads, then
// releases the slot on its "empty" mbarrier, as PipelineTmaAsync does in the jaxflash kernels
// (the backward's lse2 / delta / query-id rows, the masked forward's key ids).
//
//   nvcc -arch=sm_90a -o probe devtools/sanitize/bulk_copy_probe.cu
//   compute-sanitizer --tool racecheck --racecheck-report all ./probe MODE
//
// MODE: "lane0"  one lane per consumer warp arrives on "empty" (the kernels' pattern);
//       "all"    every consumer lane arrives (arrive count 32), so each reading thread's own
//                release orders its reads before the producer's next copy;
//       "nowait" the consumer does not wait on "full" (a real race, the positive control).
// The program checks its sums, so a wrong hand-off also shows as "sum mismatch".
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cuda_runtime.h>

constexpr int kStages = 2, kFloats = 64, kIters = 8;

__device__ void mbar_init(unsigned long long* bar, unsigned count) {
  unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(bar));
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(a), "r"(count));
}
__device__ void mbar_wait(unsigned long long* bar, unsigned phase) {
  unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(bar));
  asm volatile("{ .reg .pred p; W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;"
               " @!p bra W; }" :: "r"(a), "r"(phase) : "memory");
}
__device__ void mbar_arrive(unsigned long long* bar) {
  unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(bar));
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(a) : "memory");
}
__device__ void mbar_expect_tx(unsigned long long* bar, unsigned bytes) {
  unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(bar));
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(a), "r"(bytes)
               : "memory");
}
__device__ void bulk_copy(float* dst, const float* src, unsigned bytes,
                          unsigned long long* bar) {
  unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  unsigned b = static_cast<unsigned>(__cvta_generic_to_shared(bar));
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
               " [%0], [%1], %2, [%3];" :: "r"(d), "l"(src), "r"(bytes), "r"(b) : "memory");
}

__global__ void probe(const float* in, float* out, int mode) {
  __shared__ alignas(128) float slot[kStages][kFloats];
  __shared__ alignas(8) unsigned long long full[kStages], empty[kStages];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], mode == 1 ? 32 : 1);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (warp == 0) {
    if (lane == 0) {
      for (int it = 0; it < kIters; ++it) {
        const int s = it % kStages;
        if (it >= kStages) mbar_wait(&empty[s], ((it / kStages) - 1) & 1);
        mbar_expect_tx(&full[s], kFloats * 4);
        bulk_copy(slot[s], in + it * kFloats, kFloats * 4, &full[s]);
      }
    }
  } else {
    float sum = 0.f;
    for (int it = 0; it < kIters; ++it) {
      const int s = it % kStages;
      if (mode != 2) mbar_wait(&full[s], (it / kStages) & 1);
      sum += slot[s][lane] + slot[s][lane + 32];
      __syncwarp();
      if (mode == 1 || lane == 0) mbar_arrive(&empty[s]);
    }
    if (mode == 2) mbar_wait(&full[(kIters - 1) % kStages], ((kIters - 1) / kStages) & 1);
    out[lane] = sum;
  }
}

int main(int argc, char** argv) {
  const char* names[] = {"lane0", "all", "nowait"};
  int mode = -1;
  for (int m = 0; m < 3; ++m) if (argc > 1 && !strcmp(argv[1], names[m])) mode = m;
  if (mode < 0) { fprintf(stderr, "usage: %s lane0|all|nowait\n", argv[0]); return 2; }
  float host[kIters * kFloats], result[32];
  for (int i = 0; i < kIters * kFloats; ++i) host[i] = static_cast<float>(i % 97);
  float *in, *out;
  cudaMalloc(&in, sizeof host);
  cudaMalloc(&out, sizeof result);
  cudaMemcpy(in, host, sizeof host, cudaMemcpyHostToDevice);
  probe<<<1, 64>>>(in, out, mode);
  cudaError_t err = cudaDeviceSynchronize();
  cudaMemcpy(result, out, sizeof result, cudaMemcpyDeviceToHost);
  int bad = 0;
  for (int lane = 0; lane < 32; ++lane) {
    float want = 0.f;
    for (int it = 0; it < kIters; ++it)
      want += host[it * kFloats + lane] + host[it * kFloats + lane + 32];
    bad += result[lane] != want;
  }
  printf("probe %s: %s, %s\n", names[mode], cudaGetErrorString(err),
         bad ? "sum mismatch" : "sums match");
  return err != cudaSuccess;
}
