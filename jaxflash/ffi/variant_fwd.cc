// Per-variant glue of the forward kernel: implements kernel_abi.h on top of ONE exported object
// (macros and link: variant_common.h).

#include <stdint.h>

#include "kernel_abi.h"
#include "tensor_args.h"
#include "variant_common.h"

// FP8 variants (float8_e4m3fn q, k, v; bf16 or fp16 out) also take the descales and the out
// dtype.
#define JAXFLASH_FP8 (JAXFLASH_DTYPE == 2)

namespace {

using jaxflash::Aligned;
using jaxflash::Dense;

using TensorQ = JF_MAIN(_Tensor_mQ_t);
using TensorK = JF_MAIN(_Tensor_mK_t);
using TensorV = JF_MAIN(_Tensor_mV_t);
using TensorO = JF_MAIN(_Tensor_mO_t);
using TensorLse = JF_MAIN(_Tensor_mLSE_t);
using TensorSink = JF_MAIN(_Tensor_mSink_t);
#if JAXFLASH_FP8
using TensorQDescale = JF_MAIN(_Tensor_mQDescale_t);
using TensorKVDescale = JF_MAIN(_Tensor_mKVDescale_t);
#endif
#if JAXFLASH_MASKED
using TensorQIds = JF_MAIN(_Tensor_mQIds_t);
using TensorKIds = JF_MAIN(_Tensor_mKIds_t);
using TensorRanges = JF_MAIN(_Tensor_mRanges_t);
using TensorOrder = JF_MAIN(_Tensor_mOrder_t);
#endif
#if JAXFLASH_TILE_COUNTER
using TensorTileCounter = JF_MAIN(_Tensor_mTileCounter_t);
#endif
#if JAXFLASH_BIAS
using TensorBias = JF_MAIN(_Tensor_mBias_t);
static_assert(JAXFLASH_MASKED, "bias variants are masked variants");
#endif

#if JAXFLASH_MOD_ARRAYS
static_assert(JAXFLASH_MASKED, "score_mod / mask_mod variants are masked variants");
#endif
using jaxflash::kSignatureMatches;

static_assert(kSignatureMatches<TensorQ> && kSignatureMatches<TensorK> &&
                  kSignatureMatches<TensorV> && kSignatureMatches<TensorO> &&
                  kSignatureMatches<TensorLse>,
              "exported tensor structs do not match jaxflash.kernels.compile.fwd_signature");
static_assert(sizeof(TensorSink::dynamic_shapes) == sizeof(int32_t),
              "the sink is a (num_heads,) vector in jaxflash.kernels.compile.fwd_signature");
static_assert(JAXFLASH_DIRECTION == 0, "variant_fwd.cc builds forward variants");

// cudaErrorInvalidValue for what the kernel cannot take, else 0.
int32_t Validate(const JaxflashFwdArgs* args) {
  const int32_t kInvalid = static_cast<int32_t>(cudaErrorInvalidValue);
  if (args == nullptr || args->head_dim != JAXFLASH_HEAD_DIM ||
      args->head_dim_v != JAXFLASH_HEAD_DIM_V) {
    return kInvalid;
  }
  // An empty grid is not a valid launch, and TMA descriptors need every extent >= 1: the
  // caller handles empty tensors (seqlen_k == 0 means out = 0, lse = -inf; not done here).
  if (args->batch <= 0 || args->seqlen_q <= 0 || args->seqlen_k <= 0 || args->num_heads <= 0 ||
      args->num_kv_heads <= 0 || args->num_heads % args->num_kv_heads != 0) {
    return kInvalid;
  }
  // The kernel's tile index over the 1-D grid (m blocks * heads * batch) is an int32.
  const int64_t tiles = static_cast<int64_t>((args->seqlen_q + JAXFLASH_TILE_M - 1) /
                                             JAXFLASH_TILE_M) * args->num_heads * args->batch;
  if (tiles > INT32_MAX) return kInvalid;
  if (!Aligned(args->q, 16) || !Aligned(args->k, 16) ||
      !Aligned(args->v, 16) || !Aligned(args->out, 16) ||
      !Aligned(args->lse, 16) || !Aligned(args->sink, 4)) {
    return kInvalid;  // TMA needs 16-byte aligned global addresses
  }
  // Masked: every mask operand, 16-byte aligned (the key ids leave by bulk copies).
  if (!jaxflash::MaskOperandsMatch(args->mask) || !Aligned(args->mask.row_ids, 16) ||
      !Aligned(args->mask.col_ids, 16) || !Aligned(args->mask.ranges, 16) ||
      !Aligned(args->mask.order, 16)) {
    return kInvalid;
  }
  if (!jaxflash::BiasOperandsMatch(args->bias, false, args->seqlen_k)) return kInvalid;
  // The closed-over arrays: exactly the variant's, each at least element-aligned (4 bytes
  // covers every dtype up to float32; XLA's buffers are more aligned).
  if (!jaxflash::ModArraysMatch(args->mods)) return kInvalid;
  for (int i = 0; i < JAXFLASH_MOD_ARRAYS; ++i) {
    if (!Aligned(args->mods.data[i], 4)) return kInvalid;
  }
  // Dynamic schedules claim their tiles from a zeroed counter; the others take none.
  if ((args->tile_counter != nullptr) != (JAXFLASH_TILE_COUNTER != 0) ||
      !Aligned(args->tile_counter, 4)) {
    return kInvalid;
  }
#if JAXFLASH_FP8
  // 16 bytes: each key block's descales leave by one bulk copy.
  if (args->q_descale == nullptr || args->kv_descale == nullptr ||
      !Aligned(args->q_descale, 16) || !Aligned(args->kv_descale, 16)) {
    return kInvalid;
  }
#endif
  return 0;
}

}  // namespace

JF_EXPORT int32_t jaxflash_variant_load(void) { return jaxflash::LoadOnce(LoadMainModule); }

JF_EXPORT int32_t jaxflash_variant_fwd(const JaxflashFwdArgs* args, void* stream) {
  if (int32_t status = jaxflash::RefuseOrLoad(Validate(args)); status != 0) return status;

  const int32_t b = args->batch, sq = args->seqlen_q, sk = args->seqlen_k;
  const int32_t h = args->num_heads, hk = args->num_kv_heads;
  TensorQ q = Dense<TensorQ>(args->q, {b, sq, h}, JAXFLASH_HEAD_DIM);
  TensorK k = Dense<TensorK>(args->k, {b, sk, hk}, JAXFLASH_HEAD_DIM);
  TensorV v = Dense<TensorV>(args->v, {b, sk, hk}, JAXFLASH_HEAD_DIM_V);
  TensorO o = Dense<TensorO>(args->out, {b, sq, h}, JAXFLASH_HEAD_DIM_V);
  TensorLse lse = Dense<TensorLse>(args->lse, {b, h, sq});  // (batch, heads, seqlen_q)
  // The kernel reads the sink only when has_sink is 1; without one it gets a valid dummy.
  const int32_t has_sink = args->sink != nullptr ? 1 : 0;
  TensorSink sink = Dense<TensorSink>(has_sink ? args->sink : args->lse, {h});
#if JAXFLASH_TILE_COUNTER
  TensorTileCounter counter = Dense<TensorTileCounter>(args->tile_counter, {1});
#define JF_TILE_COUNTER &counter,
#else
#define JF_TILE_COUNTER
#endif
#if JAXFLASH_MASKED
  const int32_t m_blocks = (sq + JAXFLASH_TILE_M - 1) / JAXFLASH_TILE_M;
  const int32_t n_blocks = (sk + JAXFLASH_TILE_N - 1) / JAXFLASH_TILE_N;
  const JaxflashMask& m = args->mask;
  TensorQIds q_ids = Dense<TensorQIds>(m.row_ids, {b, m_blocks * JAXFLASH_TILE_M});
  TensorKIds k_ids = Dense<TensorKIds>(m.col_ids, {b, n_blocks * JAXFLASH_TILE_N});
  TensorRanges ranges = Dense<TensorRanges>(m.ranges, {b, m_blocks}, 4);
  TensorOrder order = Dense<TensorOrder>(m.order, {b * m_blocks});
#if JAXFLASH_BIAS
  auto bias = jaxflash::BiasPlanes<TensorBias>(args->bias, sk);
#define JF_BIAS &bias.planes, bias.batch_planes, bias.head_planes, bias.query_step,
#else
#define JF_BIAS
#endif
  JF_MOD_DECLS(args->mods)
  return JF_WRAPPER(JAXFLASH_PREFIX_MAIN)(&g_main, &q, &k, &v, &o, &lse, &sink, &q_ids,
                                          &k_ids, &ranges, &order, JF_TILE_COUNTER JF_BIAS
                                          JF_MODS
                                          args->softmax_scale,
                                          has_sink, args->window_left, args->window_right,
                                          args->softcap, static_cast<cudaStream_t>(stream));
#elif JAXFLASH_FP8
  const int32_t q_chunks = static_cast<int32_t>(jaxflash_fp8_descale_chunks(sq, JAXFLASH_TILE_M));
  const int32_t k_chunks = static_cast<int32_t>(jaxflash_fp8_descale_chunks(sk, JAXFLASH_TILE_N));
  TensorQDescale q_descale = Dense<TensorQDescale>(args->q_descale, {b, h, q_chunks});
  // (batch, hk, k_chunks, 4) seen as (batch, hk, 4 * k_chunks).
  TensorKVDescale kv_descale = Dense<TensorKVDescale>(args->kv_descale, {b, hk, 4 * k_chunks});
  return JF_WRAPPER(JAXFLASH_PREFIX_MAIN)(&g_main, &q, &k, &v, &o, &lse, &sink, &q_descale,
                                          &kv_descale, args->softmax_scale, has_sink,
                                          args->out_float16 != 0 ? 1 : 0,
                                          static_cast<cudaStream_t>(stream));
#else
  return JF_WRAPPER(JAXFLASH_PREFIX_MAIN)(&g_main, &q, &k, &v, &o, &lse, &sink,
                                          JF_TILE_COUNTER args->softmax_scale, has_sink,
                                          static_cast<cudaStream_t>(stream));
#endif
}
