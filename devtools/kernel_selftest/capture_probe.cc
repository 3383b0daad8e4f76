// Can a forward variant library's launch be recorded into a CUDA graph by stream capture, as XLA
// records a command-buffer-compatible FFI handler? One scenario per process:
//   capture_probe --mode global|thread|relaxed --warm 0|1 --thread same|other
//                 [--to-graph 0|1] [--get-device 0|1] LIB.so
// mode: the cudaStreamCaptureMode (XLA traces a handler in thread-local mode); warm 1: launch
// once outside capture first (0: the first launch of the process happens inside the capture, as
// on XLA's first execution); thread other: capture on another thread than the one that loaded
// the library; to-graph 1: capture into an existing graph (cudaStreamBeginCaptureToGraph, as XLA
// records its command buffers); get-device 1: query the capturing stream's device
// (cudaStreamGetDevice) before the launch. Loads the library (jaxflash_variant_load), captures one call on a fresh stream,
// instantiates and replays the graph, and compares its output bitwise with a direct launch.
// Prints "PROBE <mode> warm=<0|1> thread=<same|other> to_graph=<0|1> get_device=<status|->
// launch=<status> end_capture=<status> replay=<ok|status> match=<yes|no|->".
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <string>
#include <thread>
#include <vector>

#include "kernel_abi.h"

namespace {

typedef int32_t (*FwdFn)(const JaxflashFwdArgs*, void*);
typedef const JaxflashVariantInfo* (*InfoFn)(void);
typedef int32_t (*LoadFn)(void);

const char* Name(cudaError_t e) { return e == cudaSuccess ? "ok" : cudaGetErrorName(e); }

int Usage() {
  fprintf(stderr, "usage: capture_probe --mode global|thread|relaxed --warm 0|1 "
                  "--thread same|other [--to-graph 0|1] [--get-device 0|1] LIB.so\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::string mode_name = "thread", thread = "same", lib;
  int warm = 0, to_graph = 0, get_device = 0;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--mode" && i + 1 < argc) mode_name = argv[++i];
    else if (a == "--warm" && i + 1 < argc) warm = atoi(argv[++i]);
    else if (a == "--thread" && i + 1 < argc) thread = argv[++i];
    else if (a == "--to-graph" && i + 1 < argc) to_graph = atoi(argv[++i]);
    else if (a == "--get-device" && i + 1 < argc) get_device = atoi(argv[++i]);
    else if (a[0] != '-') lib = a;
    else return Usage();
  }
  cudaStreamCaptureMode mode;
  if (mode_name == "global") mode = cudaStreamCaptureModeGlobal;
  else if (mode_name == "thread") mode = cudaStreamCaptureModeThreadLocal;
  else if (mode_name == "relaxed") mode = cudaStreamCaptureModeRelaxed;
  else return Usage();
  if (lib.empty() || (thread != "same" && thread != "other")) return Usage();

  void* handle = dlopen(lib.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!handle) {
    printf("cannot open %s: %s\n", lib.c_str(), dlerror());
    return 2;
  }
  auto info = reinterpret_cast<InfoFn>(dlsym(handle, "jaxflash_variant_info"))();
  auto load = reinterpret_cast<LoadFn>(dlsym(handle, "jaxflash_variant_load"));
  auto fwd = reinterpret_cast<FwdFn>(dlsym(handle, "jaxflash_variant_fwd"));
  if (!info || !load || !fwd || info->direction != 0 || info->masked) {
    printf("%s: not a dense forward variant library\n", lib.c_str());
    return 2;
  }
  if (int32_t s = load(); s != 0) {
    printf("jaxflash_variant_load failed with %d\n", s);
    return 2;
  }

  const int b = 1, s = 256, h = 8, d = info->head_dim, dv = info->head_dim_v;
  const size_t nq = size_t(b) * s * h * d, nv = size_t(b) * s * h * dv;
  std::vector<uint16_t> host(std::max(nq, nv));
  for (size_t i = 0; i < host.size(); ++i) host[i] = 0x3c00 ^ uint16_t((i * 2654435761u) & 0x03ff);
  void *q, *k, *v, *out, *out_graph;
  float *lse, *lse_graph;
  cudaMalloc(&q, nq * 2);
  cudaMalloc(&k, nq * 2);
  cudaMalloc(&v, nv * 2);
  cudaMalloc(&out, nv * 2);
  cudaMalloc(&out_graph, nv * 2);
  cudaMalloc(&lse, size_t(b) * h * s * 4);
  cudaMalloc(&lse_graph, size_t(b) * h * s * 4);
  cudaMemcpy(q, host.data(), nq * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(k, host.data(), nq * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(v, host.data(), nv * 2, cudaMemcpyHostToDevice);
  cudaMemset(out_graph, 0xff, nv * 2);  // poisoned: a replay that writes nothing cannot match

  JaxflashFwdArgs args = {};
  args.q = q;
  args.k = k;
  args.v = v;
  args.batch = b;
  args.seqlen_q = args.seqlen_k = s;
  args.num_heads = args.num_kv_heads = h;
  args.head_dim = d;
  args.head_dim_v = dv;
  args.softmax_scale = 0.125f;
  args.window_left = args.window_right = 1 << 30;
  // A library that claims its tiles (info tile_counter) gets a counter, zeroed on the stream
  // before each launch as the FFI handler does (inside the capture too).
  if (info->tile_counter) cudaMalloc(reinterpret_cast<void**>(&args.tile_counter), 4);
  auto launch_fwd = [&](cudaStream_t stream) {
    if (args.tile_counter) cudaMemsetAsync(args.tile_counter, 0, 4, stream);
    return fwd(&args, stream);
  };

  if (warm) {
    args.out = out;
    args.lse = lse;
    int32_t st = launch_fwd(nullptr);
    cudaError_t e = cudaDeviceSynchronize();
    if (st != 0 || e != cudaSuccess) {
      printf("warm launch failed: %d %s\n", st, Name(e));
      return 2;
    }
  }

  cudaError_t launch = cudaSuccess, end = cudaSuccess, replay = cudaSuccess;
  const char* device_query = "-";
  bool replayed = false;
  cudaGraph_t graph = nullptr;
  auto capture = [&] {
    cudaStream_t stream;
    cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    args.out = out_graph;
    args.lse = lse_graph;
    cudaError_t begin;
    if (to_graph) {
      cudaGraphCreate(&graph, 0);
      begin = cudaStreamBeginCaptureToGraph(stream, graph, nullptr, nullptr, 0, mode);
    } else {
      begin = cudaStreamBeginCapture(stream, mode);
    }
    if (begin != cudaSuccess) {
      launch = begin;
      return;
    }
    if (get_device) {
      int device = -1;
      device_query = Name(cudaStreamGetDevice(stream, &device));
    }
    launch = static_cast<cudaError_t>(launch_fwd(stream));
    end = cudaStreamEndCapture(stream, &graph);
    if (launch == cudaSuccess && end == cudaSuccess) {
      replayed = true;
      cudaGraphExec_t exec;
      replay = cudaGraphInstantiate(&exec, graph, 0);
      if (replay == cudaSuccess) replay = cudaGraphLaunch(exec, stream);
      if (replay == cudaSuccess) replay = cudaStreamSynchronize(stream);
    }
  };
  if (thread == "other") {
    std::thread t(capture);
    t.join();
  } else {
    capture();
  }

  const char* match = "-";
  if (replayed && replay == cudaSuccess) {
    if (!warm) {  // the reference launch, after the capture
      args.out = out;
      args.lse = lse;
      launch_fwd(nullptr);
      cudaDeviceSynchronize();
    }
    std::vector<uint16_t> a(nv), g(nv);
    cudaMemcpy(a.data(), out, nv * 2, cudaMemcpyDeviceToHost);
    cudaMemcpy(g.data(), out_graph, nv * 2, cudaMemcpyDeviceToHost);
    match = memcmp(a.data(), g.data(), nv * 2) == 0 ? "yes" : "no";
  }
  printf("PROBE %s warm=%d thread=%s to_graph=%d get_device=%s launch=%s end_capture=%s "
         "replay=%s match=%s\n", mode_name.c_str(), warm, thread.c_str(), to_graph,
         device_query, Name(launch), Name(end), replayed ? Name(replay) : "-", match);
  return strcmp(match, "yes") == 0 ? 0 : 1;
}
