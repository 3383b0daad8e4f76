// Per-variant glue of the split-KV decode kernel: implements kernel_abi.h's decode entry on top
// of ONE exported object (macros and link: variant_common.h).

#include <stdint.h>

#include "kernel_abi.h"
#include "tensor_args.h"
#include "variant_common.h"

namespace {

using jaxflash::Aligned;
using jaxflash::Dense;
using jaxflash::kSignatureMatches;

using TensorQ = JF_MAIN(_Tensor_mQ_t);
using TensorK = JF_MAIN(_Tensor_mK_t);
using TensorV = JF_MAIN(_Tensor_mV_t);
using TensorPageTable = JF_MAIN(_Tensor_mPageTable_t);
using TensorLengths = JF_MAIN(_Tensor_mLengths_t);
using TensorSink = JF_MAIN(_Tensor_mSink_t);
using TensorOPart = JF_MAIN(_Tensor_mOPart_t);
using TensorLsePart = JF_MAIN(_Tensor_mLSEPart_t);
using TensorO = JF_MAIN(_Tensor_mO_t);
using TensorLse = JF_MAIN(_Tensor_mLSE_t);
using TensorKDescale = JF_MAIN(_Tensor_mKDescale_t);
using TensorVDescale = JF_MAIN(_Tensor_mVDescale_t);

// q, k, v: 3 dynamic extents and 2 dynamic strides each; the others are checked by Dense against
// the extents it fills (page_table, sink and the descales 2 / 1, lengths 1 / 0, out_partial and
// lse_partial 4 / 3, out and lse 3 / 2).
static_assert(kSignatureMatches<TensorQ> && kSignatureMatches<TensorK> &&
                  kSignatureMatches<TensorV>,
              "exported tensor structs do not match jaxflash.kernels.compile.decode_signature");
static_assert(JAXFLASH_DIRECTION == 2, "variant_decode.cc builds decode variants");

// CUDA's limit on gridDim.y and gridDim.z.
constexpr int64_t kMaxGridYZ = 65535;
// Chunked prefill: two consumer warpgroups of 64 rows (config.DecodeSchedule.chunked).
constexpr bool kChunked = JAXFLASH_TILE_M > 64;

// cudaErrorInvalidValue for what the kernel cannot take, else 0.
int32_t Validate(const JaxflashDecodeArgs* a) {
  const int32_t kInvalid = static_cast<int32_t>(cudaErrorInvalidValue);
  if (a == nullptr || a->head_dim != JAXFLASH_HEAD_DIM || a->head_dim_v != JAXFLASH_HEAD_DIM_V) {
    return kInvalid;
  }
  // An empty grid is not a valid launch, and TMA descriptors need every extent >= 1: the
  // caller handles empty tensors (no pages: out_partial = 0, lse_partial = -inf).
  if (a->batch <= 0 || a->rows <= 0 || a->num_kv_heads <= 0 || a->num_pages <= 0 ||
      a->page_size <= 0 || a->max_pages < 0) {
    return kInvalid;
  }
  // Chunked-prefill variants (128-row tiles, kernels/chunked_sm90.py) run no split and write
  // out and lse per tile: out_partial / lse_partial hold 0 splits. The others split the keys.
  if (kChunked ? a->num_splits != 0 : a->num_splits <= 0) return kInvalid;
  // No page-table column: contiguous caches, sequence b in page b.
  if (a->max_pages == 0 && a->num_pages < a->batch) return kInvalid;
  // rows = seqlen_q * (query heads per kv head).
  if (a->seqlen_q <= 0 || a->rows % a->seqlen_q != 0) return kInvalid;
  // Pages: powers of two from 16 keys (kernels/decode_sm90.py, _load_block), or one page per
  // sequence of any size (a contiguous cache; TMA fills past its end).
  if ((a->page_size < 16 || (a->page_size & (a->page_size - 1)) != 0) && a->max_pages > 1) {
    return kInvalid;
  }
  // Grid (row tiles, splits, batch * kv heads).
  const int64_t row_tiles = (static_cast<int64_t>(a->rows) + JAXFLASH_TILE_M - 1) / JAXFLASH_TILE_M;
  if (row_tiles > INT32_MAX || a->num_splits > kMaxGridYZ ||
      static_cast<int64_t>(a->batch) * a->num_kv_heads > kMaxGridYZ) {
    return kInvalid;
  }
  // TMA needs 16-byte aligned global addresses (q, k, v); the outputs and float32 partials
  // are 16-byte aligned as every XLA buffer is; the int32 page table and lengths and the sink
  // are read as scalars.
  // A chunked variant's partials are empty (never read or written, whatever their address).
  const bool partials_aligned =
      kChunked || (Aligned(a->out_partial, 16) && Aligned(a->lse_partial, 16));
  if (!Aligned(a->q, 16) || !Aligned(a->k, 16) || !Aligned(a->v, 16) || !partials_aligned ||
      !Aligned(a->out, 16) ||
      !Aligned(a->lse, 16) || !Aligned(a->page_table, 4) || !Aligned(a->lengths, 4) ||
      !Aligned(a->sink, 4) || (a->page_table == nullptr && a->max_pages > 0) ||
      a->lengths == nullptr) {
    return kInvalid;
  }
  // FP8 caches read a descale per (page, kv head); 16-bit ones none.
  const bool descales = a->k_descale != nullptr && a->v_descale != nullptr &&
                        Aligned(a->k_descale, 4) && Aligned(a->v_descale, 4);
  if (JAXFLASH_KV_FP8 ? !descales : (a->k_descale != nullptr || a->v_descale != nullptr)) {
    return kInvalid;
  }
  return 0;
}

}  // namespace

JF_EXPORT int32_t jaxflash_variant_load(void) { return jaxflash::LoadOnce(LoadMainModule); }

JF_EXPORT int32_t jaxflash_variant_decode(const JaxflashDecodeArgs* args, void* stream) {
  if (int32_t status = jaxflash::RefuseOrLoad(Validate(args)); status != 0) return status;

  const int32_t b = args->batch, rows = args->rows, hk = args->num_kv_heads;
  const int32_t pages = args->num_pages, page_size = args->page_size;
  const int32_t splits = args->num_splits;
  TensorQ q = Dense<TensorQ>(args->q, {b, hk, rows}, JAXFLASH_HEAD_DIM);
  TensorK k = Dense<TensorK>(args->k, {pages, page_size, hk}, JAXFLASH_HEAD_DIM);
  TensorV v = Dense<TensorV>(args->v, {pages, page_size, hk}, JAXFLASH_HEAD_DIM_V);
  TensorPageTable page_table = Dense<TensorPageTable>(args->page_table, {b, args->max_pages});
  TensorLengths lengths = Dense<TensorLengths>(args->lengths, {b});
  // No sink: an empty tensor, which the merge never reads.
  TensorSink sink = Dense<TensorSink>(args->sink, {hk, args->sink ? rows / args->seqlen_q : 0});
  TensorOPart o_part = Dense<TensorOPart>(args->out_partial, {b, splits, hk, rows},
                                          JAXFLASH_HEAD_DIM_V);
  TensorLsePart lse_part = Dense<TensorLsePart>(args->lse_partial, {b, splits, hk, rows});
  TensorO out = Dense<TensorO>(args->out, {b, hk, rows}, JAXFLASH_HEAD_DIM_V);
  TensorLse lse = Dense<TensorLse>(args->lse, {b, hk, rows});
  // A descale row per page (a contiguous cache's page is its sequence); none for 16-bit caches.
  const int32_t descale_rows = JAXFLASH_KV_FP8 ? pages : 0;
  TensorKDescale k_descale = Dense<TensorKDescale>(args->k_descale, {descale_rows, hk});
  TensorVDescale v_descale = Dense<TensorVDescale>(args->v_descale, {descale_rows, hk});
  return JF_WRAPPER(JAXFLASH_PREFIX_MAIN)(&g_main, &q, &k, &v, &page_table, &lengths, &sink,
                                          &o_part, &lse_part, &out, &lse, &k_descale, &v_descale,
                                          args->softmax_scale, args->seqlen_q,
                                          args->window_left, args->window_right, args->softcap,
                                          static_cast<cudaStream_t>(stream));
}
