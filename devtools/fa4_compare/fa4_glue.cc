// kernel_abi.h (jaxflash) backward entry on top of FlashAttention-4's own Hopper backward kernels,
// exported ahead of time by build_kernels.py (bf16, head_dim 128, non-causal, non-deterministic,
// FA-4's sm90 config: tile_m 80, tile_n 128).
//
// Launch order per call, all on the caller's stream, as flash_attn/cute/interface.py
// _flash_attn_bwd does for arch 9x:
//   [GQA only] cudaMemsetAsync(dk_accum, dv_accum, 0)   (FA-4: torch.zeros)
//   1. FlashAttentionBackwardPreprocess: delta = rowsum(O*dO) - dLSE, lse*log2(e), dq_accum = 0
//   2. FlashAttentionBackwardSm90 (qhead_per_kvhead = G is compile-time in FA-4: one object per G)
//   3. FlashAttentionBackwardPostprocess: dq = scale * dq_accum
//   [GQA only] 4./5. the same postprocess (tile 128) for dk = scale * dk_accum, dv = dv_accum
//
// Scratch: jaxflash's dq_accum (b, h, roundup(sq, 80), 128) f32 and lse_log2 / delta
// (b, h, roundup(sq, 80)) f32 have exactly the size and layout FA-4 allocates for this config
// (dq_accum is (b, h, seqlen_q_rounded * head_dim_rounded) there, same bytes), so they are passed
// straight through. GQA needs FA-4's dk_accum / dv_accum (b, h_kv, roundup(sk, 128) * 128) f32:
// allocated here with cudaMalloc, one buffer per device, cached and grown only when a call needs
// more (never freed until process exit).

#include <cuda_runtime.h>
#include <stdint.h>

#include <mutex>

#include "fa4_glue_common.h"
#include "kernel_abi.h"
#include "tensor_args.h"  // jaxflash::Dense, jaxflash::Aligned
#include "fa4_bwd_pre.h"
#include "fa4_bwd_main_g1.h"
#include "fa4_bwd_main_g2.h"
#include "fa4_bwd_main_g3.h"
#include "fa4_bwd_main_g4.h"
#include "fa4_bwd_main_g8.h"
#include "fa4_bwd_post.h"
#include "fa4_bwd_postkv.h"

// The GQA group sizes (num_heads / num_kv_heads) compiled by build_kernels.py (FA4_GQA_GROUPS).
#define FA4_GROUPS(X) X(1) X(2) X(3) X(4) X(8)

namespace {

using jaxflash::Aligned;
using jaxflash::Dense;

constexpr int32_t kHeadDim = 128;   // = head_dim_v
constexpr int32_t kTileM = 80;      // FA-4 _tile_size_bwd_sm90(128, 128, causal=False).m_block_size
constexpr int32_t kTileN = 128;     // ... .n_block_size
constexpr int32_t kHeadDimRounded = 128;  // FA-4: (head_dim + 31) // 32 * 32
using fa4_glue::kInvalid;

int32_t RoundUp(int32_t x, int32_t m) { return (x + m - 1) / m * m; }

fa4_bwd_pre_Kernel_Module_t g_pre = {};
fa4_bwd_post_Kernel_Module_t g_post = {};
fa4_bwd_postkv_Kernel_Module_t g_postkv = {};
#define FA4_DECLARE_MODULE(G) fa4_bwd_main_g##G##_Kernel_Module_t g_main_g##G = {};
FA4_GROUPS(FA4_DECLARE_MODULE)
#undef FA4_DECLARE_MODULE

// Loads every module (jaxflash::LoadOnce runs it once); whether all loaded.
bool LoadModules() {
  fa4_bwd_pre_Kernel_Module_Load(&g_pre);
  fa4_bwd_post_Kernel_Module_Load(&g_post);
  fa4_bwd_postkv_Kernel_Module_Load(&g_postkv);
  bool ok = g_pre.module != nullptr && g_post.module != nullptr && g_postkv.module != nullptr;
#define FA4_LOAD_MODULE(G)                                 \
  fa4_bwd_main_g##G##_Kernel_Module_Load(&g_main_g##G); \
  ok = ok && g_main_g##G.module != nullptr;
  FA4_GROUPS(FA4_LOAD_MODULE)
#undef FA4_LOAD_MODULE
  return ok;
}

int32_t Validate(const JaxflashBwdArgs* a) {
  if (a == nullptr || a->head_dim != kHeadDim || a->head_dim_v != kHeadDim ||
      a->dq_copies != 1) {
    return kInvalid;
  }
  if (!fa4_glue::ValidShape(a->batch, a->seqlen_q, a->seqlen_k, a->num_heads,
                           a->num_kv_heads) ||
      !FA4_GROUP_SUPPORTED(FA4_GROUPS, a->num_heads / a->num_kv_heads)) {
    return kInvalid;
  }
  // Grids are (blocks, heads, batch): gridDim.y / .z <= 65535.
  if (a->num_heads > 65535 || a->batch > 65535 || a->seqlen_q > INT32_MAX - kTileM ||
      a->seqlen_k > INT32_MAX - kTileN) {
    return kInvalid;
  }
  // Extents are int32 in the exported signatures: the flattened accumulators must fit.
  if (static_cast<int64_t>(RoundUp(a->seqlen_q, kTileM)) * kHeadDimRounded > INT32_MAX ||
      static_cast<int64_t>(RoundUp(a->seqlen_k, kTileN)) * kHeadDimRounded > INT32_MAX) {
    return kInvalid;
  }
  const void* aligned16[] = {a->q, a->k, a->v, a->out, a->d_out, a->dq, a->dk, a->dv,
                             a->dq_accum, a->lse_log2, a->delta};
  for (const void* p : aligned16) {
    if (p == nullptr || !Aligned(p, 16)) return kInvalid;
  }
  const void* aligned4[] = {a->lse, a->d_lse};
  for (const void* p : aligned4) {
    if (p == nullptr || !Aligned(p, 4)) return kInvalid;
  }
  if (a->dq_semaphore != nullptr) return kInvalid;  // non-deterministic library
  return 0;
}

// GQA dk_accum / dv_accum: one cached buffer per device, grown on demand.
struct Scratch {
  void* ptr = nullptr;
  size_t bytes = 0;
};
constexpr int kMaxDevices = 64;
std::mutex g_scratch_mutex;
Scratch g_scratch[kMaxDevices];

int32_t GetScratch(size_t bytes, void** out) {
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return static_cast<int32_t>(err);
  if (device < 0 || device >= kMaxDevices) return kInvalid;
  std::lock_guard<std::mutex> lock(g_scratch_mutex);
  Scratch& s = g_scratch[device];
  if (s.bytes < bytes) {
    if (s.ptr != nullptr) cudaFree(s.ptr);  // synchronizes: earlier launches are done with it
    s.ptr = nullptr;
    s.bytes = 0;
    err = cudaMalloc(&s.ptr, bytes);
    if (err != cudaSuccess) {
      s.ptr = nullptr;
      return static_cast<int32_t>(err);
    }
    s.bytes = bytes;
  }
  *out = s.ptr;
  return 0;
}

// Main kernel for group size G. dK/dV go straight to dk/dv (G == 1, TMA store) or into the
// float32 accumulators (G > 1), as in FA-4.
#define FA4_DEFINE_MAIN(G)                                                                      \
  int32_t Main_g##G(const JaxflashBwdArgs& a, int32_t sqr, float* dk_acc, float* dv_acc,        \
                    int32_t skr, cudaStream_t stream) {                                         \
    const int32_t b = a.batch, sq = a.seqlen_q, sk = a.seqlen_k, h = a.num_heads;               \
    const int32_t hk = a.num_kv_heads, d = kHeadDim;                                            \
    auto q = Dense<fa4_bwd_main_g##G##_Tensor_mQ_t>(a.q, {b, sq, h, d});                        \
    auto k = Dense<fa4_bwd_main_g##G##_Tensor_mK_t>(a.k, {b, sk, hk, d});                       \
    auto v = Dense<fa4_bwd_main_g##G##_Tensor_mV_t>(a.v, {b, sk, hk, d});                       \
    auto dout = Dense<fa4_bwd_main_g##G##_Tensor_mdO_t>(a.d_out, {b, sq, h, d});                \
    auto lse2 = Dense<fa4_bwd_main_g##G##_Tensor_mLSE_t>(a.lse_log2, {b, h, sqr});              \
    auto dpsum = Dense<fa4_bwd_main_g##G##_Tensor_mdPsum_t>(a.delta, {b, h, sqr});              \
    auto acc = Dense<fa4_bwd_main_g##G##_Tensor_mdQaccum_t>(a.dq_accum,                         \
                                                            {b, h, sqr * kHeadDimRounded});     \
    MAIN_DKDV_##G                                                                               \
    return cute_dsl_fa4_bwd_main_g##G##_wrapper(&g_main_g##G, &q, &k, &v, &dout, &lse2, &dpsum, \
                                                &acc, &dk, &dv, a.softmax_scale, stream);       \
  }

#define MAIN_DKDV_DIRECT(G)                                                 \
  auto dk = Dense<fa4_bwd_main_g##G##_Tensor_mdK_t>(a.dk, {b, sk, hk, d}); \
  auto dv = Dense<fa4_bwd_main_g##G##_Tensor_mdV_t>(a.dv, {b, sk, hk, d}); \
  (void)dk_acc; (void)dv_acc; (void)skr;
#define MAIN_DKDV_ACCUM(G)                                                                    \
  auto dk = Dense<fa4_bwd_main_g##G##_Tensor_mdK_t>(dk_acc, {b, hk, skr * kHeadDimRounded}); \
  auto dv = Dense<fa4_bwd_main_g##G##_Tensor_mdV_t>(dv_acc, {b, hk, skr * kHeadDimRounded});
#define MAIN_DKDV_1 MAIN_DKDV_DIRECT(1)
#define MAIN_DKDV_2 MAIN_DKDV_ACCUM(2)
#define MAIN_DKDV_3 MAIN_DKDV_ACCUM(3)
#define MAIN_DKDV_4 MAIN_DKDV_ACCUM(4)
#define MAIN_DKDV_8 MAIN_DKDV_ACCUM(8)
FA4_GROUPS(FA4_DEFINE_MAIN)
#undef FA4_DEFINE_MAIN

int32_t Main(const JaxflashBwdArgs& a, int32_t sqr, float* dk_acc, float* dv_acc, int32_t skr,
             cudaStream_t stream) {
  const int32_t g = a.num_heads / a.num_kv_heads;
#define FA4_DISPATCH(G) \
  if (g == G) return Main_g##G(a, sqr, dk_acc, dv_acc, skr, stream);
  FA4_GROUPS(FA4_DISPATCH)
#undef FA4_DISPATCH
  return kInvalid;
}

}  // namespace

FA4_EXPORT int32_t jaxflash_variant_abi_version(void) { return JAXFLASH_KERNEL_ABI_VERSION; }

FA4_EXPORT const char* jaxflash_variant_key(void) { return "fa4-sm90a-bf16-d128-dv128-m80n128"; }

FA4_EXPORT const JaxflashVariantInfo* jaxflash_variant_info(void) {
  // Backward, bf16, head_dim = head_dim_v = 128, non-causal, non-deterministic; the scratch rows
  // are seqlen_q rounded up to tile_m 80; one dQ accumulator copy; no mask operands.
  static const JaxflashVariantInfo info = {/*direction=*/1, /*dtype=*/1, kHeadDim, kHeadDim,
                                           /*causal=*/0, /*deterministic=*/0, kTileM,
                                           /*max_dq_copies=*/1, /*masked=*/0, kTileN};
  return &info;
}

FA4_EXPORT int32_t jaxflash_variant_load(void) { return jaxflash::LoadOnce(LoadModules); }

FA4_EXPORT int32_t jaxflash_variant_bwd(const JaxflashBwdArgs* args, void* stream_ptr) {
  int32_t status = jaxflash::RefuseOrLoad(Validate(args));
  if (status != 0) return status;

  const JaxflashBwdArgs& a = *args;
  const int32_t b = a.batch, sq = a.seqlen_q, sk = a.seqlen_k, h = a.num_heads;
  const int32_t hk = a.num_kv_heads, d = kHeadDim;
  const int32_t sqr = RoundUp(sq, kTileM), skr = RoundUp(sk, kTileN);
  const bool gqa = h != hk;
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);

  float* dk_acc = nullptr;
  float* dv_acc = nullptr;
  if (gqa) {
    const size_t each = static_cast<size_t>(b) * hk * skr * kHeadDimRounded * sizeof(float);
    void* base = nullptr;
    status = GetScratch(2 * each, &base);
    if (status != 0) return status;
    dk_acc = static_cast<float*>(base);
    dv_acc = reinterpret_cast<float*>(static_cast<char*>(base) + each);
    cudaError_t err = cudaMemsetAsync(base, 0, 2 * each, stream);
    if (err != cudaSuccess) return static_cast<int32_t>(err);
  }

  {  // 1. preprocess
    auto o = Dense<fa4_bwd_pre_Tensor_mO_t>(a.out, {b, sq, h, d});
    auto dout = Dense<fa4_bwd_pre_Tensor_mdO_t>(a.d_out, {b, sq, h, d});
    auto dpsum = Dense<fa4_bwd_pre_Tensor_mPdPsum_t>(a.delta, {b, h, sqr});
    auto lse = Dense<fa4_bwd_pre_Tensor_mLSE_t>(a.lse, {b, h, sq});
    auto lse2 = Dense<fa4_bwd_pre_Tensor_mLSElog2_t>(a.lse_log2, {b, h, sqr});
    auto acc = Dense<fa4_bwd_pre_Tensor_mdQaccum_t>(a.dq_accum, {b, h, sqr * kHeadDimRounded});
    auto dlse = Dense<fa4_bwd_pre_Tensor_mdLSE_t>(a.d_lse, {b, h, sq});
    status = cute_dsl_fa4_bwd_pre_wrapper(&g_pre, &o, &dout, &dpsum, &lse, &lse2, &acc, &dlse,
                                          stream);
    if (status != 0) return status;
  }
  // 2. main
  status = Main(a, sqr, dk_acc, dv_acc, skr, stream);
  if (status != 0) return status;
  {  // 3. dq
    auto acc = Dense<fa4_bwd_post_Tensor_mdQaccum_t>(a.dq_accum, {b, h, sqr * kHeadDimRounded});
    auto dq = Dense<fa4_bwd_post_Tensor_mdQ_t>(a.dq, {b, sq, h, d});
    status = cute_dsl_fa4_bwd_post_wrapper(&g_post, &acc, &dq, a.softmax_scale, stream);
    if (status != 0) return status;
  }
  if (gqa) {  // 4. dk (scaled), 5. dv (scale 1)
    auto kacc = Dense<fa4_bwd_postkv_Tensor_mdQaccum_t>(dk_acc, {b, hk, skr * kHeadDimRounded});
    auto dk = Dense<fa4_bwd_postkv_Tensor_mdQ_t>(a.dk, {b, sk, hk, d});
    status = cute_dsl_fa4_bwd_postkv_wrapper(&g_postkv, &kacc, &dk, a.softmax_scale, stream);
    if (status != 0) return status;
    auto vacc = Dense<fa4_bwd_postkv_Tensor_mdQaccum_t>(dv_acc, {b, hk, skr * kHeadDimRounded});
    auto dv = Dense<fa4_bwd_postkv_Tensor_mdQ_t>(a.dv, {b, sk, hk, d});
    status = cute_dsl_fa4_bwd_postkv_wrapper(&g_postkv, &vacc, &dv, 1.0f, stream);
  }
  return status;
}
