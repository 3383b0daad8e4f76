// kernel_abi.h (jaxflash) forward entry on top of FlashAttention-4's own Hopper forward kernel
// (FlashAttentionForwardSm90), exported ahead of time by build_fwd_kernels.py: bf16, dense, one
// head_dim (= head_dim_v), causal or not, one object per GQA group size (qhead_per_kvhead is
// compile-time in FA-4; group sizes above 1 run FA-4's pack_gqa, as FA-4 picks).
//
// build.sh compiles this file once per (head_dim, causal) with the generated fa4_fwd_kernels.h
// of that build, which includes the group objects' headers and defines
//   FA4_FWD_GROUPS(X)       X(G) for every group size compiled
//   FA4_FWD_NAME(G, suffix) the exported names of group G's object (fa4_fwd_d{D}_c{C}_g{G}...)
//   FA4_FWD_WRAPPER(G)      its launch wrapper
//   FA4_HEAD_DIM, FA4_CAUSAL, FA4_TILE_M, FA4_TILE_N, FA4_KEY
// One launch per call on the caller's stream; out (b, sq, h, d) and lse (b, h, sq) have FA-4's
// layouts, so the buffers pass straight through. Calls the kernel does not implement (another
// head dim, masks, softcap, sinks, FP8 descales, a group size not compiled) are refused with
// cudaErrorInvalidValue before any CUDA call.

#include <cuda_runtime.h>
#include <stdint.h>

#include "fa4_fwd_kernels.h"
#include "fa4_glue_common.h"
#include "kernel_abi.h"
#include "tensor_args.h"  // jaxflash::Dense, jaxflash::Aligned

namespace {

using jaxflash::Aligned;
using jaxflash::Dense;

using fa4_glue::kInvalid;

#define FA4_DECLARE_MODULE(G) FA4_FWD_NAME(G, _Kernel_Module_t) g_module_g##G = {};
FA4_FWD_GROUPS(FA4_DECLARE_MODULE)
#undef FA4_DECLARE_MODULE

// Loads every group's module (jaxflash::LoadOnce runs it once); whether all loaded.
bool LoadModules() {
  bool ok = true;
#define FA4_LOAD_MODULE(G)                              \
  FA4_FWD_NAME(G, _Kernel_Module_Load)(&g_module_g##G); \
  ok = ok && g_module_g##G.module != nullptr;
  FA4_FWD_GROUPS(FA4_LOAD_MODULE)
#undef FA4_LOAD_MODULE
  return ok;
}

int32_t Validate(const JaxflashFwdArgs* a) {
  if (a == nullptr || a->head_dim != FA4_HEAD_DIM || a->head_dim_v != FA4_HEAD_DIM) {
    return kInvalid;
  }
  if (!fa4_glue::ValidShape(a->batch, a->seqlen_q, a->seqlen_k, a->num_heads,
                           a->num_kv_heads) ||
      !FA4_GROUP_SUPPORTED(FA4_FWD_GROUPS, a->num_heads / a->num_kv_heads)) {
    return kInvalid;
  }
  // What the dense FA-4 kernel does not take: masks, soft-capping, sinks, FP8.
  const JaxflashMask& m = a->mask;
  if (m.row_ids || m.col_ids || m.ranges || m.order || m.ranks || a->softcap != 0.0f ||
      a->sink || a->q_descale || a->kv_descale || a->out_float16) {
    return kInvalid;
  }
  const void* aligned16[] = {a->q, a->k, a->v, a->out};
  for (const void* p : aligned16) {
    if (p == nullptr || !Aligned(p, 16)) return kInvalid;
  }
  if (a->lse == nullptr || !Aligned(a->lse, 4)) return kInvalid;
  return 0;
}

#define FA4_DEFINE_LAUNCH(G)                                                                 \
  int32_t Launch_g##G(const JaxflashFwdArgs& a, cudaStream_t stream) {                       \
    const int32_t b = a.batch, sq = a.seqlen_q, sk = a.seqlen_k, h = a.num_heads;            \
    const int32_t hk = a.num_kv_heads, d = FA4_HEAD_DIM;                                     \
    auto q = Dense<FA4_FWD_NAME(G, _Tensor_mQ_t)>(a.q, {b, sq, h, d});                       \
    auto k = Dense<FA4_FWD_NAME(G, _Tensor_mK_t)>(a.k, {b, sk, hk, d});                      \
    auto v = Dense<FA4_FWD_NAME(G, _Tensor_mV_t)>(a.v, {b, sk, hk, d});                      \
    auto o = Dense<FA4_FWD_NAME(G, _Tensor_mO_t)>(a.out, {b, sq, h, d});                     \
    auto lse = Dense<FA4_FWD_NAME(G, _Tensor_mLSE_t)>(a.lse, {b, h, sq});                    \
    return FA4_FWD_WRAPPER(G)(&g_module_g##G, &q, &k, &v, &o, &lse, a.softmax_scale, stream); \
  }
FA4_FWD_GROUPS(FA4_DEFINE_LAUNCH)
#undef FA4_DEFINE_LAUNCH

}  // namespace

FA4_EXPORT int32_t jaxflash_variant_abi_version(void) { return JAXFLASH_KERNEL_ABI_VERSION; }

// jaxflash's key of the same (dtype, head dims, causal, tile) with "+fa4": the self-test's A/B
// view lines it up with jaxflash's variant.
FA4_EXPORT const char* jaxflash_variant_key(void) { return FA4_KEY; }

FA4_EXPORT const JaxflashVariantInfo* jaxflash_variant_info(void) {
  static const JaxflashVariantInfo info = {/*direction=*/0, /*dtype=*/1, FA4_HEAD_DIM,
                                           FA4_HEAD_DIM, FA4_CAUSAL, /*deterministic=*/0,
                                           FA4_TILE_M, /*max_dq_copies=*/0, /*masked=*/0,
                                           FA4_TILE_N};
  return &info;
}

FA4_EXPORT int32_t jaxflash_variant_load(void) { return jaxflash::LoadOnce(LoadModules); }

FA4_EXPORT int32_t jaxflash_variant_fwd(const JaxflashFwdArgs* args, void* stream_ptr) {
  if (int32_t status = jaxflash::RefuseOrLoad(Validate(args)); status != 0) return status;
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const int32_t g = args->num_heads / args->num_kv_heads;
#define FA4_DISPATCH(G) \
  if (g == G) return Launch_g##G(*args, stream);
  FA4_FWD_GROUPS(FA4_DISPATCH)
#undef FA4_DISPATCH
  return kInvalid;
}
