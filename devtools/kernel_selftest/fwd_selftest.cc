// Standalone GPU self-test and benchmark of jaxflash forward variant libraries (no Python, no JAX).
//
// Built by devtools/kernel_selftest/build.py (on the build host, no GPU needed); run by run.sh on
// the GPU host:
//   fwd_selftest [--no-check] [--no-bench] lib1.so [lib2.so ...]
// For each library: reads dtype / head_dim / head_dim_v / causal from its jaxflash_variant_info
// (kernel_abi.h); runs a list of small shapes (GQA/MQA, ragged lengths, seqlen 1,
// seqlen_q > seqlen_k, more tiles than SMs) against a float64 reference, checks that guard
// regions after out/lse stay poisoned, that empty rows give 0 / -inf and that reruns are bitwise
// identical. Then times 16384 tokens per call: seqlen_q = seqlen_k = seq at seq 1024, 4096,
// 16384 and 2048, batch = 16384 / seq, heads = 2048 / head_dim (no GQA), random data, counting
// 2 * (head_dim + head_dim_v) flops per score (half the scores when causal): 5 launches back to
// back per repetition, median of 7 repetitions after 2 warm-up repetitions; each timed output is
// checked for unwritten (NaN-poisoned) elements and sampled rows are compared with the float64
// reference.
// A kernel that does not finish within a deadline ends the process (exit 3). Prints one
// "RESULT <key> <PASS|FAIL> <tflops 1k> <4k> <16k> <2k>" line per library; exit code 0 iff all
// passed.
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <functional>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kernel_abi.h"
#include "selftest_common.h"

namespace {

typedef int32_t (*FwdFn)(const JaxflashFwdArgs*, void*);

// A kernel that does not finish within this many seconds ends the process.
constexpr double kDeadline = 5.0;

struct Shape {
  int b, sq, sk, h, hk;
};

// Host copies of one problem: bits of q/k/v (b, s, h, d) row-major, out and lse from the kernel.
struct Problem {
  Shape s;
  int d, dv;
  bool causal;
  float scale;
  const uint16_t *q, *k, *v, *o;
  const float* lse;
};

struct RowError {
  double err2 = 0, ref2 = 0, lse_err = 0;
  long nan = 0, empty = 0, empty_bad = 0;
  void Add(const RowError& r) {
    err2 += r.err2;
    ref2 += r.ref2;
    lse_err = std::max(lse_err, r.lse_err);
    nan += r.nan;
    empty += r.empty;
    empty_bad += r.empty_bad;
  }
};

// float64 reference of one output row (b, h, i), compared with the kernel's.
RowError CheckRow(const Problem& p, int b, int h, int i, std::vector<double>& scores) {
  const Shape& s = p.s;
  RowError r;
  int g = h / (s.h / s.hk);
  const uint16_t* qi = &p.q[((static_cast<size_t>(b) * s.sq + i) * s.h + h) * p.d];
  int limit = p.causal ? std::min(s.sk, i + s.sk - s.sq + 1) : s.sk;
  const uint16_t* oi = &p.o[((static_cast<size_t>(b) * s.sq + i) * s.h + h) * p.dv];
  float lse_k = p.lse[(static_cast<size_t>(b) * s.h + h) * s.sq + i];
  if (limit <= 0) {
    r.empty = 1;
    bool ok = std::isinf(lse_k) && lse_k < 0;
    for (int c = 0; c < p.dv; ++c) ok &= FromHalfBits(oi[c]) == 0.0f;
    r.empty_bad = !ok;
    return r;
  }
  std::vector<double> qd(p.d);
  for (int c = 0; c < p.d; ++c) qd[c] = FromHalfBits(qi[c]);
  double mx = -INFINITY;
  for (int j = 0; j < limit; ++j) {
    const uint16_t* kj = &p.k[((static_cast<size_t>(b) * s.sk + j) * s.hk + g) * p.d];
    double acc = 0;
    for (int c = 0; c < p.d; ++c) acc += qd[c] * FromHalfBits(kj[c]);
    scores[j] = acc * p.scale;
    mx = std::max(mx, scores[j]);
  }
  double sum = 0;
  for (int j = 0; j < limit; ++j) {
    scores[j] = std::exp(scores[j] - mx);
    sum += scores[j];
  }
  std::vector<double> o(p.dv, 0.0);
  for (int j = 0; j < limit; ++j) {
    const uint16_t* vj = &p.v[((static_cast<size_t>(b) * s.sk + j) * s.hk + g) * p.dv];
    double w = scores[j] / sum;
    for (int c = 0; c < p.dv; ++c) o[c] += w * FromHalfBits(vj[c]);
  }
  if (std::isnan(lse_k)) r.nan++;
  r.lse_err = std::fabs(mx + std::log(sum) - lse_k);
  for (int c = 0; c < p.dv; ++c) {
    float got = FromHalfBits(oi[c]);
    if (std::isnan(got)) r.nan++;
    r.err2 += (got - o[c]) * (got - o[c]);
    r.ref2 += o[c] * o[c];
  }
  return r;
}

// Checks rows [(b, h, i) for the given linear ids] in parallel; returns the summed error.
RowError CheckRows(const Problem& p, const std::vector<long>& rows) {
  std::mutex mu;
  RowError total;
  const int chunk = 16;
  int nchunks = static_cast<int>((rows.size() + chunk - 1) / chunk);
  ParallelFor(nchunks, [&](int c) {
    std::vector<double> scores(p.s.sk);
    RowError part;
    for (size_t k = c * chunk; k < std::min(rows.size(), static_cast<size_t>(c + 1) * chunk); ++k) {
      long id = rows[k];
      int i = id % p.s.sq, h = (id / p.s.sq) % p.s.h, b = id / (static_cast<long>(p.s.sq) * p.s.h);
      part.Add(CheckRow(p, b, h, i, scores));
    }
    std::lock_guard<std::mutex> lock(mu);
    total.Add(part);
  });
  return total;
}

bool Report(const char* label, const RowError& e) {
  double rel = e.ref2 > 0 ? std::sqrt(e.err2 / e.ref2) : std::sqrt(e.err2);
  double tol = g_bf16 ? 1.5e-2 : 3e-3;
  printf("  %s: rel_l2=%.2e lse_maxerr=%.2e nan=%ld empty_rows=%ld\n", label, rel, e.lse_err, e.nan,
         e.empty);
  int before = g_failures;
  EXPECT(e.nan == 0, "NaN in output");
  EXPECT(rel <= tol, "rel_l2 %.3e > %.1e", rel, tol);
  EXPECT(e.lse_err <= 5e-3, "lse error %.3e", e.lse_err);
  EXPECT(e.empty_bad == 0, "%ld empty rows not (0, -inf)", e.empty_bad);
  return g_failures == before;
}

int32_t* g_tile_counter = nullptr;  // the library under test's (TileCounter), or nullptr

JaxflashFwdArgs MakeArgs(const void* q, const void* k, const void* v, void* o, float* lse,
                         const Shape& s, int d, int dv, float scale) {
  JaxflashFwdArgs a = {};
  a.q = q; a.k = k; a.v = v; a.out = o; a.lse = lse;
  a.batch = s.b; a.seqlen_q = s.sq; a.seqlen_k = s.sk; a.num_heads = s.h; a.num_kv_heads = s.hk;
  a.head_dim = d; a.head_dim_v = dv; a.softmax_scale = scale;
  a.window_left = -1; a.window_right = -1;
  a.tile_counter = g_tile_counter;
  return a;
}

void CheckShape(FwdFn fwd, int d, int dv, bool causal, Shape s, float scale, std::mt19937& rng) {
  size_t nq = static_cast<size_t>(s.b) * s.sq * s.h * d, nk = static_cast<size_t>(s.b) * s.sk * s.hk * d;
  size_t nv = static_cast<size_t>(s.b) * s.sk * s.hk * dv, no = static_cast<size_t>(s.b) * s.sq * s.h * dv;
  size_t nl = static_cast<size_t>(s.b) * s.h * s.sq;
  const size_t guard = 4096;
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<uint16_t> hq(nq), hk(nk), hv(nv);
  for (auto& x : hq) x = ToHalfBits(nd(rng));
  for (auto& x : hk) x = ToHalfBits(nd(rng));
  for (auto& x : hv) x = ToHalfBits(nd(rng));
  void *dq, *dk, *dvv, *dout;
  float* dlse;
  CK(cudaMalloc(&dq, nq * 2));
  CK(cudaMalloc(&dk, nk * 2));
  CK(cudaMalloc(&dvv, nv * 2));
  CK(cudaMalloc(&dout, (no + guard) * 2));
  CK(cudaMalloc(reinterpret_cast<void**>(&dlse), (nl + guard) * 4));
  CK(cudaMemcpy(dq, hq.data(), nq * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dk, hk.data(), nk * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dvv, hv.data(), nv * 2, cudaMemcpyHostToDevice));
  // Poison: 0xFF bytes are NaN in fp16, bf16 and fp32.
  CK(cudaMemset(dout, 0xFF, (no + guard) * 2));
  CK(cudaMemset(dlse, 0xFF, (nl + guard) * 4));
  JaxflashFwdArgs a = MakeArgs(dq, dk, dvv, dout, dlse, s, d, dv, scale);
  int32_t st = LaunchForward(fwd, &a, nullptr);
  EXPECT(st == 0, "launch status %d", st);
  SyncOrDie("check launch", kDeadline);
  std::vector<uint16_t> ho(no + guard), ho2(no + guard);
  std::vector<float> hl(nl + guard), hl2(nl + guard);
  CK(cudaMemcpy(ho.data(), dout, (no + guard) * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(hl.data(), dlse, (nl + guard) * 4, cudaMemcpyDeviceToHost));
  st = LaunchForward(fwd, &a, nullptr);
  SyncOrDie("check rerun", kDeadline);
  CK(cudaMemcpy(ho2.data(), dout, (no + guard) * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(hl2.data(), dlse, (nl + guard) * 4, cudaMemcpyDeviceToHost));
  EXPECT(memcmp(ho.data(), ho2.data(), no * 2) == 0 && memcmp(hl.data(), hl2.data(), nl * 4) == 0,
         "rerun not bitwise identical");
  bool guard_ok = true;
  for (size_t i = no; i < no + guard; ++i) guard_ok &= ho[i] == 0xFFFF;
  for (size_t i = nl; i < nl + guard; ++i) {
    uint32_t u;
    memcpy(&u, &hl[i], 4);
    guard_ok &= u == 0xFFFFFFFFu;
  }
  EXPECT(guard_ok, "write past the end of out/lse");
  Problem p = {s, d, dv, causal, scale, hq.data(), hk.data(), hv.data(), ho.data(), hl.data()};
  std::vector<long> rows(nl);
  for (size_t i = 0; i < nl; ++i) rows[i] = static_cast<long>(i);
  char label[128];
  snprintf(label, sizeof(label), "b=%d sq=%d sk=%d h=%d hk=%d", s.b, s.sq, s.sk, s.h, s.hk);
  Report(label, CheckRows(p, rows));
  CK(cudaFree(dq)); CK(cudaFree(dk)); CK(cudaFree(dvv)); CK(cudaFree(dout)); CK(cudaFree(dlse));
}

// Times the benchmark shapes (top of the file); returns TFLOP/s per sequence length (0 where
// it failed).
std::vector<double> Bench(FwdFn fwd, int d, int dv, bool causal, bool check) {
  const int tokens = 16384, seqs[] = {1024, 4096, 16384, 2048};
  const int heads = 2048 / d;  // q/k and v/out share tokens and heads; dv may differ from d
  size_t nq = static_cast<size_t>(tokens) * heads * d, nv = static_cast<size_t>(tokens) * heads * dv;
  size_t nl = static_cast<size_t>(tokens) * heads;
  std::vector<uint16_t> hq(nq), hk(nq), hv(nv);
  FillRandom(hq, 11);
  FillRandom(hk, 22);
  FillRandom(hv, 33);
  void *q, *k, *v, *o;
  float* l;
  CK(cudaMalloc(&q, nq * 2)); CK(cudaMalloc(&k, nq * 2)); CK(cudaMalloc(&v, nv * 2));
  CK(cudaMalloc(&o, nv * 2)); CK(cudaMalloc(reinterpret_cast<void**>(&l), nl * 4));
  CK(cudaMemcpy(q, hq.data(), nq * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(k, hk.data(), nq * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(v, hv.data(), nv * 2, cudaMemcpyHostToDevice));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::vector<double> out;
  std::vector<uint16_t> ho(check ? nv : 0);
  std::vector<float> hl(check ? nl : 0);
  std::mt19937 rng(5);
  for (int seq : seqs) {
    Shape s = {tokens / seq, seq, seq, heads, heads};
    float scale = 1.0f / std::sqrt(static_cast<float>(d));
    JaxflashFwdArgs a = MakeArgs(q, k, v, o, l, s, d, dv, scale);
    CK(cudaMemset(o, 0xFF, nv * 2));
    CK(cudaMemset(l, 0xFF, nl * 4));
    const int per_rep = 5, warm = 2, reps = 7;
    std::vector<float> ms;
    bool ok = true;
    for (int r = 0; r < warm + reps; ++r) {
      CK(cudaEventRecord(e0, nullptr));
      for (int i = 0; i < per_rep; ++i) ok &= LaunchForward(fwd, &a, nullptr) == 0;
      CK(cudaEventRecord(e1, nullptr));
      SyncOrDie("benchmark", 15.0);
      float t;
      CK(cudaEventElapsedTime(&t, e0, e1));
      if (r >= warm) ms.push_back(t / per_rep);
    }
    EXPECT(ok, "benchmark launch failed (seq %d)", seq);
    std::sort(ms.begin(), ms.end());
    double med = ms[ms.size() / 2];
    // Q K^T is 2 * sq * sk * d flops per head, P V 2 * sq * sk * dv.
    double flops = 2.0 * s.b * s.h * static_cast<double>(s.sq) * s.sk * (d + dv) *
                   (causal ? 0.5 : 1.0);
    double tflops = flops / (med * 1e-3) / 1e12;
    printf("  bench b=%d s=%d h=%d d=%d dv=%d causal=%d: median %.3f ms (min %.3f max %.3f), "
           "%.0f TFLOP/s\n", s.b, s.sq, s.h, d, dv, static_cast<int>(causal), med, ms.front(),
           ms.back(), tflops);
    bool valid = ok;
    if (check) {
      CK(cudaMemcpy(ho.data(), o, nv * 2, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(hl.data(), l, nl * 4, cudaMemcpyDeviceToHost));
      long unwritten = 0;
      for (size_t i = 0; i < nv; ++i) unwritten += ho[i] == 0xFFFF;
      EXPECT(unwritten == 0, "%ld output elements never written (seq %d)", unwritten, seq);
      valid &= unwritten == 0;
      // Sampled rows, biased to both ends of each sequence (first / last m blocks, causal edges).
      std::vector<long> rows;
      std::uniform_int_distribution<long> any(0, static_cast<long>(nl) - 1);
      for (int r = 0; r < 48; ++r) {
        long id = any(rng);
        if (r % 3 == 1) id = id - id % seq;  // row 0 of a (b, h)
        if (r % 3 == 2) id = id - id % seq + seq - 1 - (id % 97);  // near the last row
        rows.push_back(id);
      }
      Problem p = {s, d, dv, causal, scale, hq.data(), hk.data(), hv.data(), ho.data(), hl.data()};
      char label[128];
      snprintf(label, sizeof(label), "bench seq=%d sampled rows", seq);
      valid &= Report(label, CheckRows(p, rows));
    }
    out.push_back(valid ? tflops : 0.0);
  }
  CK(cudaFree(q)); CK(cudaFree(k)); CK(cudaFree(v)); CK(cudaFree(o)); CK(cudaFree(l));
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  bool check = true, bench = true;
  std::vector<std::string> libs;
  for (int i = 1; i < argc; ++i) {
    if (!strcmp(argv[i], "--no-check")) check = false;
    else if (!strcmp(argv[i], "--no-bench")) bench = false;
    else libs.push_back(argv[i]);
  }
  if (libs.empty()) {
    printf("usage: %s [--no-check] [--no-bench] variant.so [...]\n", argv[0]);
    return 2;
  }
  for (const std::string& path : libs) {
    int failures_before = g_failures;
    VariantLibrary<FwdFn> lib;
    if (!OpenVariant(path, 0, "jaxflash_variant_fwd", &lib)) {
      printf("RESULT %s FAIL 0 0 0 0\n", path.c_str());
      g_failures++;
      continue;
    }
    const std::string& key = lib.key;
    const JaxflashVariantInfo* info = lib.info;
    const LoadFn load = lib.load;
    const FwdFn fwd = lib.entry;
    printf("%s (abi %d): dtype %s head_dim %d head_dim_v %d causal %d\n", key.c_str(),
           JAXFLASH_KERNEL_ABI_VERSION, info->dtype == 1 ? "bf16" : "f16", info->head_dim,
           info->head_dim_v, info->causal);
    g_bf16 = info->dtype == 1;
    const bool causal = info->causal != 0;
    const int d = info->head_dim, dv = info->head_dim_v;
    g_tile_counter = TileCounter(info->tile_counter != 0);
    int32_t ls = load();
    EXPECT(ls == 0, "load status %d", ls);
    if (ls != 0) {
      printf("RESULT %s FAIL 0 0 0 0\n", key.c_str());
      continue;
    }
    if (check) {
      std::mt19937 rng(1234);
      float scale = 1.0f / std::sqrt(static_cast<float>(d));
      const Shape shapes[] = {{1, 128, 128, 1, 1},  {2, 257, 131, 4, 2}, {1, 1, 1, 2, 1},
                              {1, 1, 300, 2, 2},    {1, 300, 1, 2, 2},   {2, 200, 77, 3, 1},
                              {1, 77, 200, 2, 2},   {1, 384, 384, 2, 2}, {1, 700, 650, 4, 4},
                              {3, 129, 64, 2, 1},   {1, 1000, 1000, 2, 1},
                              // More (m block, head, batch) tiles than the 132 SMs.
                              {3, 200, 330, 64, 8}};
      for (const Shape& s : shapes) CheckShape(fwd, d, dv, causal, s, scale, rng);
      // Scores 8x larger: a row max then jumps by more than 8 log2 units between key blocks
      // (ragged first blocks hold a few keys), past the conditional rescaling's threshold
      // (jaxflash/kernels/softmax.py, RESCALE_THRESHOLD_LOG2); at 1/sqrt(d) random data never
      // gets there.
      const Shape spiky[] = {{2, 257, 131, 4, 2}, {1, 700, 650, 4, 4}, {1, 77, 200, 2, 2}};
      for (const Shape& s : spiky) CheckShape(fwd, d, dv, causal, s, 8 * scale, rng);
    }
    std::vector<double> tf(4, 0.0);
    if (bench) tf = Bench(fwd, d, dv, causal, check);
    printf("RESULT %s %s %.0f %.0f %.0f %.0f\n", key.c_str(),
           g_failures == failures_before ? "PASS" : "FAIL", tf[0], tf[1], tf[2], tf[3]);
    fflush(stdout);
  }
  printf(g_failures ? "FAILED (%d)\n" : "ALL PASSED\n", g_failures);
  return g_failures ? 1 : 0;
}
