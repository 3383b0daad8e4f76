// Standalone GPU self-test and benchmark of jaxflash backward variant libraries (no Python/JAX).
//
// Built by devtools/kernel_selftest/build_bwd.py (on the build host, no GPU needed) into
// .selftest/bwd/; run by run_bwd.sh on the GPU host:
//   bwd_selftest [--no-check] [--no-bench] [--fwd-dir DIR] [--seq N]... lib.so...
// For each library (dtype, head dims, causal, deterministic, tile_m and the most dQ accumulator
// copies it takes: its jaxflash_variant_info, kernel_abi.h):
//  - shapes with GQA/MQA, ragged lengths, seqlen_q != seqlen_k both ways, seqlen 1: out and lse
//    come from a float64 forward (rounded as the forward kernel would hand them over), d_out and
//    d_lse are random; dq/dk/dv (and the scratch) are poisoned with NaN bytes first; dq/dk/dv are
//    compared with a float64 backward by relative L2 error per gradient, guard regions after each
//    output must stay poisoned, NaN fails; the preprocess scratch (lse * log2 e, delta) is checked;
//  - determinism: 5 calls on a shape with many CTAs per query block; deterministic variants must
//    give bitwise identical dq/dk/dv, the others identical dk/dv (dq differences are counted);
//  - every dQ accumulator count from 1 to the library's max_dq_copies is checked and timed (a
//    count above it and a count of 0 must be refused before any launch);
//  - benchmark: 16384 tokens per call, seqlen_q = seqlen_k = seq at seq 4096, 16384 and 1024
//    (then any --seq N), batch = 16384 / seq, heads = 2048 / head_dim (no GQA) on random data;
//    5 launches back to back per repetition, median of 7 after 2 warm-ups. Backward TFLOP/s
//    count 2 b h sq sk (3 d + 2 dv) flops (2.5x the forward's 4 b h sq sk d when dv == d;
//    halved when causal); with --fwd-dir the matching forward library (same dtype, head dims
//    and mask, by its jaxflash_variant_info) is timed too and fwd+bwd TFLOP/s printed.
// With --no-check the first launches are the benchmark's (devtools/kernel_selftest/ncu_bwd.sh
// counts on that). A kernel that does not finish within a deadline ends the process (exit 3).
// Prints one "RESULT <key> <PASS|FAIL> <bwd tflops 4k> <bwd 16k> <fwd+bwd 4k> <fwd+bwd 16k>
// <bwd 1k> <fwd+bwd 1k>" line per library and dQ count ("<key>+copies=N" when it takes more
// than one).
#include <cuda_runtime.h>
#include <dirent.h>
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

typedef int32_t (*BwdFn)(const JaxflashBwdArgs*, void*);
typedef int32_t (*FwdFn)(const JaxflashFwdArgs*, void*);

// A kernel that does not finish within this many seconds ends the process.
constexpr double kDeadline = 20.0;
// Of the library under test (jaxflash_variant_info): the scratch rows are seqlen_q rounded up
// to tile_m (config.bwd_scratch_shapes); dq_accum / dq_semaphore are allocated for
// max_dq_copies, and a call with fewer copies uses a prefix of them.
int g_tile_m = 64;
int g_max_dq_copies = 1;
int g_dq_copies = 1;  // the count the calls pass (JaxflashBwdArgs.dq_copies)

struct Shape {
  int b, sq, sk, h, hk;
};

int RoundUp(int x, int m) { return (x + m - 1) / m * m; }

// A device buffer with a poisoned guard region after its payload.
struct DevBuf {
  void* p = nullptr;
  size_t bytes = 0;
  static const size_t kGuard = 4096;
  explicit DevBuf(size_t n) : bytes(n) {
    CK(cudaMalloc(&p, bytes + kGuard));
    CK(cudaMemset(p, 0xFF, bytes + kGuard));  // 0xFF bytes: NaN in fp16, bf16, fp32; -1 int32
  }
  ~DevBuf() { cudaFree(p); }
  void Upload(const void* h) { CK(cudaMemcpy(p, h, bytes, cudaMemcpyHostToDevice)); }
  template <typename T>
  std::vector<T> Download() const {
    std::vector<T> h((bytes + kGuard) / sizeof(T));
    CK(cudaMemcpy(h.data(), p, bytes + kGuard, cudaMemcpyDeviceToHost));
    return h;
  }
  bool GuardIntact() const {
    std::vector<uint8_t> g(kGuard);
    CK(cudaMemcpy(g.data(), static_cast<char*>(p) + bytes, kGuard, cudaMemcpyDeviceToHost));
    for (uint8_t x : g)
      if (x != 0xFF) return false;
    return true;
  }
};

// Host problem: inputs as bits, out / lse from a float64 forward, float64 gradients.
struct Problem {
  Shape s;
  int d, d_v;  // head_dim (Q, K, dQ, dK) and head_dim_v (V, O, dO, dV)
  bool causal;
  float scale;
  std::vector<uint16_t> q, k, v, o, dout;
  std::vector<float> lse, dlse;
  std::vector<double> dq, dk, dv, delta;  // references
};

size_t Idx(const Shape& s, int b, int i, int h, int heads, int seq, int dim) {
  return ((static_cast<size_t>(b) * seq + i) * heads + h) * dim;
}

// Forward (out, lse) then backward, in float64, one (batch, kv head) group per task. The
// backward uses exactly the kernel's inputs: P = exp(s * scale - lse) with the float32 lse, and
// delta = rowsum(dO * O) - d_lse with the rounded O.
void Reference(Problem& p) {
  const Shape& s = p.s;
  const int d = p.d, dv = p.d_v, group = s.h / s.hk;
  p.o.assign(static_cast<size_t>(s.b) * s.sq * s.h * dv, 0);
  p.lse.assign(static_cast<size_t>(s.b) * s.h * s.sq, 0.f);
  p.dq.assign(p.q.size(), 0.0);
  p.dk.assign(p.k.size(), 0.0);
  p.dv.assign(p.v.size(), 0.0);
  p.delta.assign(p.lse.size(), 0.0);
  ParallelFor(s.b * s.hk, [&](int task) {
    const int b = task / s.hk, g = task % s.hk;
    std::vector<double> sc(s.sk), pr(s.sk), qi(d), doi(dv), acc(dv), acc_q(d);
    for (int hh = 0; hh < group; ++hh) {
      const int h = g * group + hh;
      for (int i = 0; i < s.sq; ++i) {
        const size_t lrow = (static_cast<size_t>(b) * s.h + h) * s.sq + i;
        const int limit = p.causal ? std::min(s.sk, i + s.sk - s.sq + 1) : s.sk;
        const size_t qoff = Idx(s, b, i, h, s.h, s.sq, d);
        const size_t ooff = Idx(s, b, i, h, s.h, s.sq, dv);  // O and dO rows
        for (int c = 0; c < d; ++c) qi[c] = FromHalfBits(p.q[qoff + c]);
        for (int c = 0; c < dv; ++c) doi[c] = FromHalfBits(p.dout[ooff + c]);
        if (limit <= 0) {  // sees no key: out 0, lse -inf, no gradient
          p.lse[lrow] = -INFINITY;
          p.delta[lrow] = -p.dlse[lrow];
          continue;
        }
        double mx = -INFINITY;
        for (int j = 0; j < limit; ++j) {
          const size_t koff = Idx(s, b, j, g, s.hk, s.sk, d);
          double a = 0;
          for (int c = 0; c < d; ++c) a += qi[c] * FromHalfBits(p.k[koff + c]);
          sc[j] = a * p.scale;
          mx = std::max(mx, sc[j]);
        }
        double sum = 0;
        for (int j = 0; j < limit; ++j) sum += std::exp(sc[j] - mx);
        std::fill(acc.begin(), acc.end(), 0.0);
        for (int j = 0; j < limit; ++j) {
          const size_t voff = Idx(s, b, j, g, s.hk, s.sk, dv);
          const double w = std::exp(sc[j] - mx) / sum;
          for (int c = 0; c < dv; ++c) acc[c] += w * FromHalfBits(p.v[voff + c]);
        }
        const float lse = static_cast<float>(mx + std::log(sum));
        p.lse[lrow] = lse;
        double delta = 0;
        for (int c = 0; c < dv; ++c) {
          p.o[ooff + c] = ToHalfBits(static_cast<float>(acc[c]));
          delta += doi[c] * FromHalfBits(p.o[ooff + c]);
        }
        delta -= p.dlse[lrow];
        p.delta[lrow] = delta;
        std::fill(acc_q.begin(), acc_q.end(), 0.0);
        for (int j = 0; j < limit; ++j) {
          const size_t koff = Idx(s, b, j, g, s.hk, s.sk, d);
          const size_t voff = Idx(s, b, j, g, s.hk, s.sk, dv);
          const double pj = std::exp(sc[j] - static_cast<double>(lse));
          double dp = 0;
          for (int c = 0; c < dv; ++c) dp += doi[c] * FromHalfBits(p.v[voff + c]);
          const double ds = pj * (dp - delta) * p.scale;
          for (int c = 0; c < d; ++c) {
            acc_q[c] += ds * FromHalfBits(p.k[koff + c]);
            p.dk[koff + c] += ds * qi[c];
          }
          for (int c = 0; c < dv; ++c) p.dv[voff + c] += pj * doi[c];
        }
        for (int c = 0; c < d; ++c) p.dq[qoff + c] = acc_q[c];
      }
    }
  });
}

struct Device {
  DevBuf q, k, v, o, dout, lse, dlse, dq, dk, dv, acc, lse2, delta, sem;
  Device(const Shape& s, int d, int dv_)
      : q(2ul * s.b * s.sq * s.h * d), k(2ul * s.b * s.sk * s.hk * d),
        v(2ul * s.b * s.sk * s.hk * dv_), o(2ul * s.b * s.sq * s.h * dv_), dout(o.bytes),
        lse(4ul * s.b * s.h * s.sq), dlse(lse.bytes), dq(q.bytes), dk(k.bytes),
        dv(v.bytes), acc(4ul * s.b * s.h * g_max_dq_copies * RoundUp(s.sq, g_tile_m) * d),
        lse2(4ul * s.b * s.h * RoundUp(s.sq, g_tile_m)), delta(lse2.bytes),
        sem(4ul * s.b * s.h * g_max_dq_copies * (RoundUp(s.sq, g_tile_m) / g_tile_m)) {}
  JaxflashBwdArgs Args(const Shape& s, int d, int dv_, float scale, bool det) {
    JaxflashBwdArgs a = {};
    a.q = q.p; a.k = k.p; a.v = v.p; a.out = o.p; a.lse = static_cast<float*>(lse.p);
    a.d_out = dout.p; a.d_lse = static_cast<float*>(dlse.p);
    a.dq = dq.p; a.dk = dk.p; a.dv = dv.p;
    a.dq_accum = static_cast<float*>(acc.p); a.lse_log2 = static_cast<float*>(lse2.p);
    a.delta = static_cast<float*>(delta.p);
    a.dq_semaphore = det ? static_cast<int32_t*>(sem.p) : nullptr;
    a.batch = s.b; a.seqlen_q = s.sq; a.seqlen_k = s.sk; a.num_heads = s.h;
    a.num_kv_heads = s.hk; a.head_dim = d; a.head_dim_v = dv_; a.softmax_scale = scale;
    a.window_left = -1; a.window_right = -1;
    a.dq_copies = g_dq_copies;
    return a;
  }
};

// Relative L2 error of a kernel gradient (bits) against the float64 reference, with diagnostics.
bool Compare(const char* name, const std::vector<uint16_t>& got, const std::vector<double>& ref,
             const Shape& s, int heads, int seq, int d) {
  double err2 = 0, ref2 = 0, max_err = 0, max_ref = 0;
  long nan = 0, worst = -1;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double g = FromHalfBits(got[i]);
    if (std::isnan(g)) {
      if (nan++ == 0) worst = static_cast<long>(i);
      continue;
    }
    const double e = std::fabs(g - ref[i]);
    err2 += e * e;
    ref2 += ref[i] * ref[i];
    max_ref = std::max(max_ref, std::fabs(ref[i]));
    if (e > max_err && nan == 0) {
      max_err = e;
      worst = static_cast<long>(i);
    }
  }
  const double rel = ref2 > 0 ? std::sqrt(err2 / ref2) : std::sqrt(err2);
  const double tol = g_bf16 ? 1e-2 : 2e-3;
  int c = worst >= 0 ? static_cast<int>(worst % d) : -1;
  long r = worst >= 0 ? worst / d : 0;
  int h = static_cast<int>(r % heads), i = static_cast<int>((r / heads) % seq);
  int b = static_cast<int>(r / heads / seq);
  printf("    %s: rel_l2=%.2e max_err=%.2e (max|ref| %.2e) nan=%ld worst at b=%d s=%d h=%d c=%d "
         "got %.4g ref %.4g\n", name, rel, max_err, max_ref, nan, b, i, h, c,
         worst >= 0 ? FromHalfBits(got[worst]) : 0.0, worst >= 0 ? ref[worst] : 0.0);
  int before = g_failures;
  EXPECT(nan == 0, "%s: %ld NaN (unwritten or poisoned) elements", name, nan);
  EXPECT(rel <= tol, "%s: rel_l2 %.3e > %.1e", name, rel, tol);
  (void)s;
  return g_failures == before;
}

void FillNormal(std::vector<uint16_t>& x, std::mt19937& rng, float sigma = 1.f) {
  std::normal_distribution<float> nd(0.f, sigma);
  for (auto& e : x) e = ToHalfBits(nd(rng));
}

void CheckShape(BwdFn bwd, int d, int dv, bool causal, bool det, Shape s, std::mt19937& rng) {
  printf("  b=%d sq=%d sk=%d h=%d hk=%d\n", s.b, s.sq, s.sk, s.h, s.hk);
  Problem p;
  p.s = s; p.d = d; p.d_v = dv; p.causal = causal;
  p.scale = 1.0f / std::sqrt(static_cast<float>(d));
  p.q.resize(static_cast<size_t>(s.b) * s.sq * s.h * d);
  p.k.resize(static_cast<size_t>(s.b) * s.sk * s.hk * d);
  p.v.resize(static_cast<size_t>(s.b) * s.sk * s.hk * dv);
  p.dout.resize(static_cast<size_t>(s.b) * s.sq * s.h * dv);
  FillNormal(p.q, rng); FillNormal(p.k, rng); FillNormal(p.v, rng); FillNormal(p.dout, rng);
  p.dlse.resize(static_cast<size_t>(s.b) * s.h * s.sq);
  std::normal_distribution<float> nd(0.f, 0.3f);
  for (auto& x : p.dlse) x = nd(rng);
  Reference(p);

  Device dev(s, d, dv);
  dev.q.Upload(p.q.data()); dev.k.Upload(p.k.data()); dev.v.Upload(p.v.data());
  dev.o.Upload(p.o.data()); dev.dout.Upload(p.dout.data());
  dev.lse.Upload(p.lse.data()); dev.dlse.Upload(p.dlse.data());
  JaxflashBwdArgs a = dev.Args(s, d, dv, p.scale, det);
  int32_t st = bwd(&a, nullptr);
  EXPECT(st == 0, "launch status %d", st);
  SyncOrDie("check launch", kDeadline);

  Compare("dq", dev.dq.Download<uint16_t>(), p.dq, s, s.h, s.sq, d);
  Compare("dk", dev.dk.Download<uint16_t>(), p.dk, s, s.hk, s.sk, d);
  Compare("dv", dev.dv.Download<uint16_t>(), p.dv, s, s.hk, s.sk, dv);
  bool guards = dev.dq.GuardIntact() && dev.dk.GuardIntact() && dev.dv.GuardIntact() &&
                dev.acc.GuardIntact() && dev.lse2.GuardIntact() && dev.delta.GuardIntact() &&
                (!det || dev.sem.GuardIntact());
  EXPECT(guards, "write past the end of an output or scratch buffer");

  // Preprocess scratch: lse * log2(e) (+inf for empty and padding rows), delta (0 for padding).
  const int sqr = RoundUp(s.sq, g_tile_m);
  auto lse2 = dev.lse2.Download<float>();
  auto delta = dev.delta.Download<float>();
  long bad_lse2 = 0, bad_delta = 0;
  double max_delta_err = 0;
  for (int b = 0; b < s.b; ++b)
    for (int h = 0; h < s.h; ++h)
      for (int i = 0; i < sqr; ++i) {
        const size_t at = (static_cast<size_t>(b) * s.h + h) * sqr + i;
        if (i >= s.sq) {
          bad_lse2 += !(std::isinf(lse2[at]) && lse2[at] > 0);
          bad_delta += delta[at] != 0.0f;
          continue;
        }
        const size_t row = (static_cast<size_t>(b) * s.h + h) * s.sq + i;
        const float lse = p.lse[row];
        const double want = std::isinf(lse) ? INFINITY : lse * 1.4426950408889634;
        bad_lse2 += std::isinf(want) ? !(std::isinf(lse2[at]) && lse2[at] > 0)
                                     : std::fabs(lse2[at] - want) > 1e-5 * (1 + std::fabs(want));
        const double e = std::fabs(delta[at] - p.delta[row]);
        max_delta_err = std::max(max_delta_err, e / (1 + std::fabs(p.delta[row])));
      }
  bad_delta += max_delta_err > 1e-3;
  printf("    scratch: bad lse_log2 rows %ld, bad delta rows %ld (max rel err %.2e)\n", bad_lse2,
         bad_delta, max_delta_err);
  EXPECT(bad_lse2 == 0 && bad_delta == 0, "preprocess scratch wrong");
}

// Repeated calls on one input: bitwise identical results? Returns differing dq elements.
void CheckDeterminism(BwdFn bwd, int d, int dv, bool det, std::mt19937& rng) {
  Shape s = {2, 1536, 1536, 8, 2};  // 12 (tile_n 64: 24) key blocks add into every query block
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  Device dev(s, d, dv);
  // Sized for the larger of head_dim / head_dim_v (Upload copies the buffer's own size).
  std::vector<uint16_t> x(std::max(dev.q.bytes, dev.o.bytes) / 2);
  std::vector<uint16_t> kv(std::max(dev.k.bytes, dev.v.bytes) / 2);
  for (DevBuf* buf : {&dev.q, &dev.dout}) { FillNormal(x, rng); buf->Upload(x.data()); }
  for (DevBuf* buf : {&dev.k, &dev.v}) { FillNormal(kv, rng); buf->Upload(kv.data()); }
  FillNormal(x, rng, 0.5f);
  dev.o.Upload(x.data());
  std::vector<float> lse(dev.lse.bytes / 4, 6.0f), dlse(lse.size(), 0.1f);
  dev.lse.Upload(lse.data());
  dev.dlse.Upload(dlse.data());
  JaxflashBwdArgs a = dev.Args(s, d, dv, scale, det);
  std::vector<uint16_t> dq0, dk0, dv0;
  long dq_diff = 0, dkv_diff = 0, nan = 0;
  for (int r = 0; r < 5; ++r) {
    EXPECT(bwd(&a, nullptr) == 0, "launch failed");
    SyncOrDie("determinism", kDeadline);
    auto dq = dev.dq.Download<uint16_t>(), dk = dev.dk.Download<uint16_t>();
    auto dv = dev.dv.Download<uint16_t>();
    if (r == 0) {
      for (auto* t : {&dq, &dk, &dv})
        for (size_t i = 0; i < t->size() - DevBuf::kGuard / 2; ++i)
          nan += std::isnan(FromHalfBits((*t)[i]));
      dq0 = dq; dk0 = dk; dv0 = dv;
      continue;
    }
    for (size_t i = 0; i < dq.size(); ++i) dq_diff += dq[i] != dq0[i];
    // dk and dv differ in size when head_dim_v != head_dim.
    for (size_t i = 0; i < dk.size(); ++i) dkv_diff += dk[i] != dk0[i];
    for (size_t i = 0; i < dv.size(); ++i) dkv_diff += dv[i] != dv0[i];
  }
  printf("  determinism (5 calls, b=%d s=%d h=%d hk=%d): dq elements differing %ld, dk/dv %ld, "
         "NaN %ld\n", s.b, s.sq, s.h, s.hk, dq_diff, dkv_diff, nan);
  EXPECT(nan == 0, "NaN in the determinism run");
  EXPECT(dkv_diff == 0, "dk/dv differ between calls");
  if (det) EXPECT(dq_diff == 0, "deterministic variant: dq differs between calls");
}

template <typename Fn>
double MedianMs(Fn launch) {
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  const int per_rep = 5, warm = 2, reps = 7;
  std::vector<float> ms;
  for (int r = 0; r < warm + reps; ++r) {
    CK(cudaEventRecord(e0, nullptr));
    for (int i = 0; i < per_rep; ++i) launch();
    CK(cudaEventRecord(e1, nullptr));
    SyncOrDie("benchmark", kDeadline);
    float t;
    CK(cudaEventElapsedTime(&t, e0, e1));
    if (r >= warm) ms.push_back(t / per_rep);
  }
  std::sort(ms.begin(), ms.end());
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  return ms[ms.size() / 2];
}

// Returns {bwd TF/s 4k, bwd 16k, fwd+bwd 4k, fwd+bwd 16k, bwd 1k, fwd+bwd 1k} (0 where not
// measured or failed).
// --seq N adds seq N after those (its numbers are only in the log's bench lines).
std::vector<int> g_extra_seqs;

int32_t* g_fwd_tile_counter = nullptr;  // the timing forward's tile counter (TileCounter)

std::vector<double> Bench(BwdFn bwd, FwdFn fwd, int d, int dv, bool causal, bool det) {
  // seq 1k last: the RESULT line keeps its 4k / 16k columns and appends the 1k ones.
  const int tokens = 16384, heads = 2048 / d;
  std::vector<int> seqs = {4096, 16384, 1024};
  seqs.insert(seqs.end(), g_extra_seqs.begin(), g_extra_seqs.end());
  const size_t nl = static_cast<size_t>(tokens) * heads, n = nl * std::max(d, dv);
  std::vector<double> bwd_tf, both_tf;
  for (int seq : seqs) {
    Shape s = {tokens / seq, seq, seq, heads, heads};
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    Device dev(s, d, dv);
    std::vector<uint16_t> x(n);
    uint64_t seed = 1;
    for (DevBuf* buf : {&dev.q, &dev.k, &dev.v, &dev.dout}) {
      FillRandom(x, seed++, 1.0f);
      buf->Upload(x.data());
    }
    FillRandom(x, seed++, 0.3f);
    dev.o.Upload(x.data());
    // lse ~ log(seq) + a margin keeps P = exp(s - lse) in range for these random inputs.
    std::vector<float> lse(nl, std::log(static_cast<float>(seq)) + 4.0f), dlse(nl, 0.0f);
    dev.lse.Upload(lse.data());
    dev.dlse.Upload(dlse.data());
    JaxflashBwdArgs a = dev.Args(s, d, dv, scale, det);
    bool ok = true;
    double ms = MedianMs([&] { ok &= bwd(&a, nullptr) == 0; });
    EXPECT(ok, "benchmark launch failed (seq %d)", seq);
    long nan = 0;
    for (DevBuf* buf : {&dev.dq, &dev.dk, &dev.dv}) {
      auto h = buf->Download<uint16_t>();
      for (size_t i = 0; i < buf->bytes / 2; ++i) nan += std::isnan(FromHalfBits(h[i]));
    }
    EXPECT(nan == 0, "%ld NaN / unwritten gradient elements in the benchmark (seq %d)", nan, seq);
    // 2 b h sq sk per unit of head dim, halved when causal: the forward's GEMMs span d + dv,
    // the backward's 3 d + 2 dv (S, dK, dQ over d; dP, dV over dv): 2.5x / 3.5x the forward
    // when dv == d.
    const double unit = 2.0 * s.b * s.h * static_cast<double>(s.sq) * s.sk * (causal ? 0.5 : 1.0);
    const double fwd_flops = unit * (d + dv), bwd_flops = unit * (3 * d + 2 * dv);
    const double tf = bwd_flops / (ms * 1e-3) / 1e12;
    double both = 0, fwd_ms = 0;
    if (fwd != nullptr) {
      JaxflashFwdArgs f = {};
      f.q = dev.q.p; f.k = dev.k.p; f.v = dev.v.p; f.out = dev.o.p;
      f.lse = static_cast<float*>(dev.lse.p);
      f.batch = s.b; f.seqlen_q = s.sq; f.seqlen_k = s.sk; f.num_heads = s.h;
      f.num_kv_heads = s.hk; f.head_dim = d; f.head_dim_v = dv; f.softmax_scale = scale;
      f.window_left = -1; f.window_right = -1;
      f.tile_counter = g_fwd_tile_counter;
      bool fok = true;
      fwd_ms = MedianMs([&] { fok &= LaunchForward(fwd, &f, nullptr) == 0; });
      EXPECT(fok, "forward benchmark launch failed");
      both = (fwd_flops + bwd_flops) / ((ms + fwd_ms) * 1e-3) / 1e12;
    }
    printf("  bench b=%d s=%d h=%d d=%d dv=%d causal=%d det=%d: bwd %.3f ms = %.0f TFLOP/s; fwd "
           "%.3f ms; fwd+bwd %.0f TFLOP/s\n", s.b, s.sq, s.h, d, dv,
           static_cast<int>(causal), static_cast<int>(det), ms, tf, fwd_ms, both);
    bwd_tf.push_back(ok && nan == 0 ? tf : 0.0);
    both_tf.push_back(both);
  }
  return {bwd_tf[0], bwd_tf[1], both_tf[0], both_tf[1], bwd_tf[2], both_tf[2]};
}

// The forward library in dir built for the same dtype, head dims and mask as `want`, or "";
// one whose key has no A/B suffix ('+') wins over one that has.
std::string FindForward(const std::string& dir, const JaxflashVariantInfo& want) {
  DIR* dp = opendir(dir.c_str());
  if (!dp) return "";
  std::vector<std::string> names;
  while (dirent* e = readdir(dp)) {
    const std::string name = e->d_name;
    if (name.size() > 3 && name.compare(name.size() - 3, 3, ".so") == 0) names.push_back(name);
  }
  closedir(dp);
  std::sort(names.begin(), names.end());
  std::string found;
  for (const std::string& name : names) {
    const std::string path = dir + "/" + name;
    void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    const JaxflashVariantInfo* info = lib ? Info(lib, path) : nullptr;
    auto key_fn = lib ? reinterpret_cast<KeyFn>(dlsym(lib, "jaxflash_variant_key")) : nullptr;
    if (info && key_fn && info->direction == 0 && info->dtype == want.dtype &&
        info->head_dim == want.head_dim && info->head_dim_v == want.head_dim_v &&
        info->causal == want.causal) {
      if (found.empty()) found = path;
      if (strchr(key_fn(), '+') == nullptr) return path;
    }
  }
  return found;
}

}  // namespace

int main(int argc, char** argv) {
  bool check = true, bench = true;
  std::string fwd_dir;
  std::vector<std::string> libs;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--no-check") check = false;
    else if (arg == "--no-bench") bench = false;
    else if (arg == "--fwd-dir" && i + 1 < argc) fwd_dir = argv[++i];
    else if (arg == "--seq" && i + 1 < argc) g_extra_seqs.push_back(atoi(argv[++i]));
    else libs.push_back(arg);
  }
  if (libs.empty()) {
    printf("usage: %s [--no-check] [--no-bench] [--fwd-dir DIR] [--seq N]... bwd_variant.so...\n",
           argv[0]);
    return 2;
  }
  for (const std::string& path : libs) {
    const int before = g_failures;
    VariantLibrary<BwdFn> lib;
    if (!OpenVariant(path, 1, "jaxflash_variant_bwd", &lib)) {
      printf("RESULT %s FAIL 0 0 0 0 0 0\n", path.c_str());
      g_failures++;
      continue;
    }
    const std::string& key = lib.key;
    const JaxflashVariantInfo* info = lib.info;
    const LoadFn load = lib.load;
    const BwdFn bwd = lib.entry;
    printf("%s (abi %d): dtype %s head_dim %d head_dim_v %d causal %d deterministic %d tile_m %d "
           "max_dq_copies %d\n", key.c_str(), JAXFLASH_KERNEL_ABI_VERSION,
           info->dtype == 1 ? "bf16" : "f16", info->head_dim, info->head_dim_v, info->causal,
           info->deterministic, info->tile_m, info->max_dq_copies);
    fflush(stdout);
    g_bf16 = info->dtype == 1;
    const bool causal = info->causal != 0, det = info->deterministic != 0;
    const int d = info->head_dim, dv = info->head_dim_v;
    g_tile_m = info->tile_m;
    g_max_dq_copies = info->max_dq_copies;
    const bool valid_info = g_tile_m > 0 && g_max_dq_copies >= 1 && d > 0 && dv > 0;
    EXPECT(valid_info, "invalid jaxflash_variant_info");
    EXPECT(det || g_max_dq_copies == 1, "a non-deterministic library takes %d dQ counts",
           g_max_dq_copies);
    const int32_t ls = valid_info ? load() : -1;
    EXPECT(ls == 0, "load status %d", ls);
    if (ls != 0) {
      printf("RESULT %s FAIL 0 0 0 0 0 0\n", key.c_str());
      continue;
    }
    {  // Invalid arguments, and dQ counts outside 1..max_dq_copies, are refused before any
       // launch (so with --no-check the benchmark's launches are the first).
      JaxflashBwdArgs bad = {};
      EXPECT(bwd(&bad, nullptr) != 0 && bwd(nullptr, nullptr) != 0, "invalid args accepted");
      const Shape s{1, 128, 128, 1, 1};
      Device dev(s, d, dv);
      for (int copies : {0, g_max_dq_copies + 1}) {
        g_dq_copies = copies;
        JaxflashBwdArgs a = dev.Args(s, d, dv, 0.125f, det);
        EXPECT(bwd(&a, nullptr) != 0, "dq_copies %d accepted (max_dq_copies %d)", copies,
               g_max_dq_copies);
      }
      SyncOrDie("dq_copies refusal", kDeadline);
    }
    std::vector<int> counts;
    for (int copies = 1; copies <= g_max_dq_copies; ++copies) counts.push_back(copies);
    FwdFn fwd = nullptr;
    std::string fwd_path = fwd_dir.empty() || !bench ? "" : FindForward(fwd_dir, *info);
    if (!fwd_path.empty()) {
      void* flib = dlopen(fwd_path.c_str(), RTLD_NOW | RTLD_LOCAL);
      auto fload = flib ? reinterpret_cast<LoadFn>(dlsym(flib, "jaxflash_variant_load")) : nullptr;
      if (fload && fload() == 0) fwd = reinterpret_cast<FwdFn>(dlsym(flib, "jaxflash_variant_fwd"));
      auto finfo = flib ? reinterpret_cast<InfoFn>(dlsym(flib, "jaxflash_variant_info")) : nullptr;
      g_fwd_tile_counter = TileCounter(finfo != nullptr && finfo()->tile_counter != 0);
      printf("  forward for timing: %s%s\n", fwd_path.c_str(), fwd ? "" : " (failed to load)");
    }
    // Every count is checked and timed; with more than one, each gets its own RESULT line.
    for (int copies : counts) {
      g_dq_copies = copies;
      printf("  dq_copies %d\n", copies);
      std::mt19937 rng(1234);
      if (check) {
        const Shape shapes[] = {{1, 128, 128, 1, 1},  {2, 257, 131, 4, 2}, {1, 1, 1, 2, 1},
                                {1, 1, 300, 2, 2},    {1, 300, 1, 2, 2},   {2, 200, 77, 3, 1},
                                {1, 77, 200, 2, 2},   {1, 384, 384, 2, 2}, {1, 700, 650, 4, 4},
                                {3, 129, 64, 2, 1},   {1, 64, 1000, 4, 2}, {1, 1000, 300, 2, 2}};
        for (const Shape& s : shapes) {
          CheckShape(bwd, d, dv, causal, det, s, rng);
          fflush(stdout);
        }
        CheckDeterminism(bwd, d, dv, det, rng);
      }
      std::vector<double> tf = {0, 0, 0, 0, 0, 0};
      if (bench) tf = Bench(bwd, fwd, d, dv, causal, det);
      // An A/B key already has a '+field=value' suffix: the count joins it.
      const std::string sep = key.find('+') == std::string::npos ? "+" : ",";
      const std::string name =
          key + (counts.size() > 1 ? sep + "copies=" + std::to_string(copies) : std::string());
      const bool pass = g_failures == before;  // a failure at an earlier count stays
      printf("RESULT %s %s %.0f %.0f %.0f %.0f %.0f %.0f\n", name.c_str(), pass ? "PASS" : "FAIL",
             tf[0], tf[1], tf[2], tf[3], tf[4], tf[5]);
      fflush(stdout);
    }
  }
  printf(g_failures ? "FAILED (%d)\n" : "ALL PASSED\n", g_failures);
  return g_failures ? 1 : 0;
}
