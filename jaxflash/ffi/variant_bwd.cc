// Per-variant glue of the backward kernels: implements kernel_abi.h's backward entry on top of
// THREE exported objects (preprocess, main, postprocess), launched in order on one stream
// (macros and link: variant_common.h).

#include <stdint.h>

#include "kernel_abi.h"
#include "tensor_args.h"
#include "variant_common.h"
#include JAXFLASH_HEADER_PRE
#include JAXFLASH_HEADER_POST

#if !defined(JAXFLASH_PREFIX_PRE) || !defined(JAXFLASH_PREFIX_POST)
#error "a backward variant needs JAXFLASH_PREFIX_PRE / _POST and their headers"
#endif
static_assert(JAXFLASH_DIRECTION == 1, "variant_bwd.cc builds backward variants");

#define JF_PRE(suffix) JF_CAT(JAXFLASH_PREFIX_PRE, suffix)
#define JF_POST(suffix) JF_CAT(JAXFLASH_PREFIX_POST, suffix)

namespace {

using jaxflash::Aligned;
using jaxflash::Dense;

using jaxflash::kSignatureMatches;

#define JF_CHECK_SIGNATURE(T) \
  static_assert(kSignatureMatches<T>, #T " does not match compile.bwd_signature")
JF_CHECK_SIGNATURE(JF_PRE(_Tensor_mO_t));
JF_CHECK_SIGNATURE(JF_PRE(_Tensor_mdO_t));
JF_CHECK_SIGNATURE(JF_PRE(_Tensor_mLSE_t));
JF_CHECK_SIGNATURE(JF_PRE(_Tensor_mdLSE_t));
JF_CHECK_SIGNATURE(JF_PRE(_Tensor_mLSE2_t));
JF_CHECK_SIGNATURE(JF_PRE(_Tensor_mDelta_t));
JF_CHECK_SIGNATURE(JF_PRE(_Tensor_mdQaccum_t));
JF_CHECK_SIGNATURE(JF_MAIN(_Tensor_mQ_t));
JF_CHECK_SIGNATURE(JF_MAIN(_Tensor_mK_t));
JF_CHECK_SIGNATURE(JF_MAIN(_Tensor_mV_t));
JF_CHECK_SIGNATURE(JF_MAIN(_Tensor_mdO_t));
JF_CHECK_SIGNATURE(JF_MAIN(_Tensor_mLSE2_t));
JF_CHECK_SIGNATURE(JF_MAIN(_Tensor_mDelta_t));
JF_CHECK_SIGNATURE(JF_MAIN(_Tensor_mdQaccum_t));
JF_CHECK_SIGNATURE(JF_MAIN(_Tensor_mdK_t));
JF_CHECK_SIGNATURE(JF_MAIN(_Tensor_mdV_t));
JF_CHECK_SIGNATURE(JF_POST(_Tensor_mdQaccum_t));
JF_CHECK_SIGNATURE(JF_POST(_Tensor_mdQ_t));
#if JAXFLASH_DETERMINISTIC
JF_CHECK_SIGNATURE(JF_PRE(_Tensor_mSem_t));
JF_CHECK_SIGNATURE(JF_MAIN(_Tensor_mSem_t));
#endif
#if JAXFLASH_BIAS
static_assert(JAXFLASH_MASKED, "bias variants are masked variants");
#endif

JF_PRE(_Kernel_Module_t) g_pre = {};
JF_POST(_Kernel_Module_t) g_post = {};

int32_t Validate(const JaxflashBwdArgs* a) {
  const int32_t kInvalid = static_cast<int32_t>(cudaErrorInvalidValue);
  if (a == nullptr || a->head_dim != JAXFLASH_HEAD_DIM || a->head_dim_v != JAXFLASH_HEAD_DIM_V ||
      a->dq_copies < 1 || a->dq_copies > JAXFLASH_MAX_DQ_COPIES) {
    return kInvalid;
  }
  // Empty grids are not valid launches and TMA descriptors need extents >= 1: the caller
  // handles empty tensors (dq = 0 when seqlen_k == 0, dk = dv = 0 when seqlen_q == 0).
  if (a->batch <= 0 || a->seqlen_q <= 0 || a->seqlen_k <= 0 || a->num_heads <= 0 ||
      a->num_kv_heads <= 0 || a->num_heads % a->num_kv_heads != 0) {
    return kInvalid;
  }
  // Grids are (blocks, heads, batch): CUDA caps gridDim.y and gridDim.z at 65535; the rounded
  // query length (times the dQ accumulator copies) must fit int32.
  if (a->num_heads > 65535 || a->batch > 65535 ||
      a->seqlen_q > INT32_MAX / JAXFLASH_MAX_DQ_COPIES - JAXFLASH_TILE_M) {
    return kInvalid;
  }
  // TMA and the bulk reduction need 16-byte aligned global addresses.
  const void* aligned16[] = {a->q, a->k, a->v, a->out, a->d_out, a->dq, a->dk, a->dv,
                             a->dq_accum};
  for (const void* p : aligned16) {
    if (p == nullptr || !Aligned(p, 16)) return kInvalid;
  }
  const void* aligned4[] = {a->lse, a->d_lse, a->lse_log2, a->delta};
  for (const void* p : aligned4) {
    if (p == nullptr || !Aligned(p, 4)) return kInvalid;
  }
  const bool has_sem = a->dq_semaphore != nullptr && Aligned(a->dq_semaphore, 4);
  if (JAXFLASH_DETERMINISTIC && !has_sem) return kInvalid;
  // Masked: every mask operand, 16-byte aligned (the query ids leave by bulk copies).
  const JaxflashMask& m = a->mask;
  if (!jaxflash::MaskOperandsMatch(m) || !Aligned(m.row_ids, 16) || !Aligned(m.col_ids, 16) ||
      !Aligned(m.ranges, 16) || !Aligned(m.order, 16) || !Aligned(m.ranks, 16)) {
    return kInvalid;
  }
  if (!jaxflash::BiasOperandsMatch(a->bias, true, a->seqlen_k)) return kInvalid;
  // The closed-over arrays of a score_mod / mask_mod variant, exactly its own.
  if (!jaxflash::ModArraysMatch(a->mods)) return kInvalid;
  for (int i = 0; i < JAXFLASH_MOD_ARRAYS; ++i) {
    if (!Aligned(a->mods.data[i], 4)) return kInvalid;
  }
  return 0;
}

}  // namespace

JF_EXPORT int32_t jaxflash_variant_load(void) {
  return jaxflash::LoadOnce([] {
    JF_PRE(_Kernel_Module_Load)(&g_pre);
    const bool main_loaded = LoadMainModule();
    JF_POST(_Kernel_Module_Load)(&g_post);
    return g_pre.module != nullptr && main_loaded && g_post.module != nullptr;
  });
}

JF_EXPORT int32_t jaxflash_variant_bwd(const JaxflashBwdArgs* args, void* stream_ptr) {
  int32_t status = jaxflash::RefuseOrLoad(Validate(args));
  if (status != 0) return status;

  const JaxflashBwdArgs& a = *args;
  const int32_t b = a.batch, sq = a.seqlen_q, sk = a.seqlen_k, h = a.num_heads;
  const int32_t hk = a.num_kv_heads, d = JAXFLASH_HEAD_DIM, dv = JAXFLASH_HEAD_DIM_V;
  const int32_t sqr = (sq + JAXFLASH_TILE_M - 1) / JAXFLASH_TILE_M * JAXFLASH_TILE_M;
  const int32_t acc_rows = a.dq_copies * sqr;  // the dQ accumulator copies (Validate)
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);

  {  // delta, lse * log2(e), zeroed dQ semaphores (deterministic) or accumulator (default)
    auto o = Dense<JF_PRE(_Tensor_mO_t)>(a.out, {b, sq, h}, dv);
    auto dout = Dense<JF_PRE(_Tensor_mdO_t)>(a.d_out, {b, sq, h}, dv);
    auto lse = Dense<JF_PRE(_Tensor_mLSE_t)>(a.lse, {b, h, sq});
    auto dlse = Dense<JF_PRE(_Tensor_mdLSE_t)>(a.d_lse, {b, h, sq});
    auto lse2 = Dense<JF_PRE(_Tensor_mLSE2_t)>(a.lse_log2, {b, h, sqr});
    auto delta = Dense<JF_PRE(_Tensor_mDelta_t)>(a.delta, {b, h, sqr});
    auto acc = Dense<JF_PRE(_Tensor_mdQaccum_t)>(a.dq_accum, {b, h, acc_rows}, d);
#if JAXFLASH_DETERMINISTIC
    auto sem =
        Dense<JF_PRE(_Tensor_mSem_t)>(a.dq_semaphore, {b, h, acc_rows / JAXFLASH_TILE_M});
    status = JF_WRAPPER(JAXFLASH_PREFIX_PRE)(&g_pre, &o, &dout, &lse, &dlse, &lse2, &delta, &acc,
                                             &sem, stream);
#else
    status = JF_WRAPPER(JAXFLASH_PREFIX_PRE)(&g_pre, &o, &dout, &lse, &dlse, &lse2, &delta, &acc,
                                             stream);
#endif
    if (status != 0) return status;
  }
  {  // dK, dV, and dQ into the fp32 accumulator
    auto q = Dense<JF_MAIN(_Tensor_mQ_t)>(a.q, {b, sq, h}, d);
    auto k = Dense<JF_MAIN(_Tensor_mK_t)>(a.k, {b, sk, hk}, d);
    auto v = Dense<JF_MAIN(_Tensor_mV_t)>(a.v, {b, sk, hk}, dv);
    auto dout = Dense<JF_MAIN(_Tensor_mdO_t)>(a.d_out, {b, sq, h}, dv);
    auto lse2 = Dense<JF_MAIN(_Tensor_mLSE2_t)>(a.lse_log2, {b, h, sqr});
    auto delta = Dense<JF_MAIN(_Tensor_mDelta_t)>(a.delta, {b, h, sqr});
    auto acc = Dense<JF_MAIN(_Tensor_mdQaccum_t)>(a.dq_accum, {b, h, acc_rows}, d);
    auto dk = Dense<JF_MAIN(_Tensor_mdK_t)>(a.dk, {b, sk, hk}, d);
    auto dvt = Dense<JF_MAIN(_Tensor_mdV_t)>(a.dv, {b, sk, hk}, dv);
#if JAXFLASH_DETERMINISTIC
    auto sem =
        Dense<JF_MAIN(_Tensor_mSem_t)>(a.dq_semaphore, {b, h, acc_rows / JAXFLASH_TILE_M});
#define JF_SEM &sem,
#else
#define JF_SEM
#endif
#if JAXFLASH_MASKED
    // The backward tiles the keys (rows) against query blocks (columns).
    const int32_t m_blocks = sqr / JAXFLASH_TILE_M;
    const int32_t n_blocks = (sk + JAXFLASH_TILE_N - 1) / JAXFLASH_TILE_N;
    const JaxflashMask& m = a.mask;
    auto q_ids = Dense<JF_MAIN(_Tensor_mQIds_t)>(m.col_ids, {b, sqr});
    auto k_ids = Dense<JF_MAIN(_Tensor_mKIds_t)>(m.row_ids, {b, n_blocks * JAXFLASH_TILE_N});
    auto ranges = Dense<JF_MAIN(_Tensor_mRanges_t)>(m.ranges, {b, n_blocks}, 4);
    auto order = Dense<JF_MAIN(_Tensor_mOrder_t)>(m.order, {b * n_blocks});
#if JAXFLASH_DETERMINISTIC
    auto ranks = Dense<JF_MAIN(_Tensor_mRanks_t)>(m.ranks, {b, n_blocks, m_blocks});
#define JF_RANKS &ranks,
#else
#define JF_RANKS
#endif
#if JAXFLASH_BIAS
    // The bias as planes of rows with their steps; dbias (b, h, sq, sk) with the bias's row
    // length.
    auto bias = jaxflash::BiasPlanes<JF_MAIN(_Tensor_mBias_t)>(a.bias, sk);
    auto dbias = jaxflash::DbiasTensor<JF_MAIN(_Tensor_mdBias_t)>(a.bias.dbias, b, h, sq, sk,
                                                                  a.bias.row_length);
#define JF_BIAS &bias.planes, bias.batch_planes, bias.head_planes, bias.query_step, &dbias,
#else
#define JF_BIAS
#endif
    JF_MOD_DECLS(a.mods)
    status = JF_WRAPPER(JAXFLASH_PREFIX_MAIN)(&g_main, &q, &k, &v, &dout, &lse2, &delta, &acc,
                                              &dk, &dvt, JF_SEM &q_ids, &k_ids, &ranges,
                                              &order, JF_RANKS JF_BIAS JF_MODS a.softmax_scale,
                                              a.window_left, a.window_right, a.softcap, stream);
#else
    status = JF_WRAPPER(JAXFLASH_PREFIX_MAIN)(&g_main, &q, &k, &v, &dout, &lse2, &delta, &acc,
                                              &dk, &dvt, JF_SEM a.softmax_scale, stream);
#endif
    if (status != 0) return status;
  }
  {  // dQ = softmax_scale * accumulator, in the input dtype
    auto acc = Dense<JF_POST(_Tensor_mdQaccum_t)>(a.dq_accum, {b, h, acc_rows}, d);
    auto dq = Dense<JF_POST(_Tensor_mdQ_t)>(a.dq, {b, sq, h}, d);
#if JAXFLASH_DETERMINISTIC
    // The accumulator was not zeroed: blocks whose semaphore counts no contribution read as 0.
    auto sem =
        Dense<JF_POST(_Tensor_mSem_t)>(a.dq_semaphore, {b, h, acc_rows / JAXFLASH_TILE_M});
    status = JF_WRAPPER(JAXFLASH_PREFIX_POST)(&g_post, &acc, &dq, &sem, a.softmax_scale, stream);
#else
    status = JF_WRAPPER(JAXFLASH_PREFIX_POST)(&g_post, &acc, &dq, a.softmax_scale, stream);
#endif
  }
  return status;
}
