// What the forward, backward and decode glue of a variant library share: the build macros, the
// exported version / key / info functions, the MAIN object's module and its load (once, with
// variant_load.h) and the check of the mask operands.
//
// The glue sources (variant_fwd.cc, variant_bwd.cc, variant_decode.cc) are compiled once per
// KernelVariant; the variant comes in through macros that
// `jaxflash.kernels.compile.glue_defines` lists:
//   -DJAXFLASH_VARIANT_KEY="\"<key>\""   KernelVariant.key, as a quoted string
//   -DJAXFLASH_DIRECTION=<0 fwd | 1 bwd | 2 decode>
//   -DJAXFLASH_DTYPE=<0 float16 | 1 bfloat16 | 2 e4m3>
//   -DJAXFLASH_HEAD_DIM=<d>  -DJAXFLASH_HEAD_DIM_V=<dv>  -DJAXFLASH_CAUSAL=<0|1>
//   -DJAXFLASH_DETERMINISTIC=<0|1>  -DJAXFLASH_TILE_M=<query rows per tile>
//   -DJAXFLASH_TILE_N=<key rows per block>  -DJAXFLASH_MAX_DQ_COPIES=<1|2>
//   -DJAXFLASH_MASKED=<0|1>  -DJAXFLASH_TILE_COUNTER=<0|1>  -DJAXFLASH_KV_FP8=<0|1>
//   -DJAXFLASH_BIAS=<0|1>
//   -DJAXFLASH_PREFIX_<PART>=<prefix>  -DJAXFLASH_HEADER_<PART>="\"<out_dir>/<file>.h\""
//     for each exported object: MAIN (every direction), PRE and POST (backward)
// Link: jaxflash.build.link_variant (docs/build.md). Only the kernel_abi.h functions are
// exported.
#ifndef JAXFLASH_FFI_VARIANT_COMMON_H_
#define JAXFLASH_FFI_VARIANT_COMMON_H_

#include <stdint.h>

#include "cuda_runtime_api.h"
#include "kernel_abi.h"
#include "variant_load.h"

#if !defined(JAXFLASH_VARIANT_KEY) || !defined(JAXFLASH_DIRECTION) || !defined(JAXFLASH_DTYPE) || \
    !defined(JAXFLASH_HEAD_DIM) || !defined(JAXFLASH_HEAD_DIM_V) || !defined(JAXFLASH_CAUSAL) ||  \
    !defined(JAXFLASH_DETERMINISTIC) || !defined(JAXFLASH_TILE_M) ||                               \
    !defined(JAXFLASH_TILE_N) || !defined(JAXFLASH_MAX_DQ_COPIES) ||                                \
    !defined(JAXFLASH_MASKED) || !defined(JAXFLASH_TILE_COUNTER) || !defined(JAXFLASH_KV_FP8) ||  \
    !defined(JAXFLASH_BIAS) ||                                                                     \
    !defined(JAXFLASH_PREFIX_MAIN) || !defined(JAXFLASH_HEADER_MAIN)
#error "define the JAXFLASH_* macros listed at the top of variant_common.h"
#endif

#include JAXFLASH_HEADER_MAIN

#define JF_CAT2(a, b) a##b
#define JF_CAT(a, b) JF_CAT2(a, b)
// <prefix><suffix>: a name that export_to_c generated for the MAIN object.
#define JF_MAIN(suffix) JF_CAT(JAXFLASH_PREFIX_MAIN, suffix)
// cute_dsl_<prefix>_wrapper: the launcher export_to_c generates for an exported object.
#define JF_WRAPPER(prefix) JF_CAT(JF_CAT(cute_dsl_, prefix), _wrapper)
#define JF_EXPORT extern "C" __attribute__((visibility("default")))

JF_EXPORT int32_t jaxflash_variant_abi_version(void) { return JAXFLASH_KERNEL_ABI_VERSION; }

JF_EXPORT const char* jaxflash_variant_key(void) { return JAXFLASH_VARIANT_KEY; }

JF_EXPORT const JaxflashVariantInfo* jaxflash_variant_info(void) {
  static const JaxflashVariantInfo info = {
      JAXFLASH_DIRECTION, JAXFLASH_DTYPE,         JAXFLASH_HEAD_DIM, JAXFLASH_HEAD_DIM_V,
      JAXFLASH_CAUSAL,    JAXFLASH_DETERMINISTIC, JAXFLASH_TILE_M,   JAXFLASH_MAX_DQ_COPIES,
      JAXFLASH_MASKED,    JAXFLASH_TILE_N,        JAXFLASH_TILE_COUNTER, JAXFLASH_KV_FP8,
      JAXFLASH_BIAS};
  return &info;
}

namespace {

// The module of the MAIN object: the kernel of a forward or decode variant, the backward's main
// kernel.
JF_MAIN(_Kernel_Module_t) g_main = {};

// Loads g_main (its generated Module_Load); whether its handle is set.
bool LoadMainModule() {
  JF_MAIN(_Kernel_Module_Load)(&g_main);
  return g_main.module != nullptr;
}

}  // namespace

namespace jaxflash {

// The masked operands must all be there for a masked variant (ranks only when deterministic)
// and absent otherwise.
inline bool MaskOperandsMatch(const JaxflashMask& m) {
  const bool any = m.row_ids || m.col_ids || m.ranges || m.order;
  const bool all = m.row_ids && m.col_ids && m.ranges && m.order;
  const bool ranks_ok = (m.ranks != nullptr) == (JAXFLASH_MASKED && JAXFLASH_DETERMINISTIC &&
                                                 JAXFLASH_DIRECTION == 1);
  return (JAXFLASH_MASKED ? all : !any) && ranks_ok;
}

// The bias (and dbias) must be there exactly for bias variants.
inline bool BiasOperandsMatch(const JaxflashBias& b, bool backward) {
  if (!JAXFLASH_BIAS) return b.bias == nullptr && b.dbias == nullptr;
  return b.bias != nullptr && (b.dbias != nullptr) == backward && b.batch >= 1 && b.heads >= 1 &&
         b.rows >= 1;
}

// A bias tensor struct (batch, heads, seqlen_q, seqlen_k) of export_to_c (4 dynamic extents, 3
// dynamic strides) over a dense (b_extent, h_extent, rows, seqlen_k) buffer: a dim of extent 1
// gets stride 0, so the kernel reads index 0 for every batch, head or row.
template <typename T>
T BiasTensor(const void* data, int32_t batch, int32_t heads, int32_t seqlen_q, int32_t seqlen_k,
             int32_t b_extent, int32_t h_extent, int32_t rows) {
  static_assert(sizeof(T::dynamic_shapes) == 4 * sizeof(int32_t) &&
                    sizeof(T::dynamic_strides) == 3 * sizeof(int64_t),
                "the bias is (batch, heads, seqlen_q, seqlen_k) with 3 dynamic strides in "
                "jaxflash.kernels.compile.bias_tensor");
  T t = {};
  t.data = const_cast<void*>(data);
  t.dynamic_shapes[0] = batch;
  t.dynamic_shapes[1] = heads;
  t.dynamic_shapes[2] = seqlen_q;
  t.dynamic_shapes[3] = seqlen_k;
  const int64_t row = seqlen_k, head = row * rows, item = head * h_extent;
  t.dynamic_strides[0] = b_extent == 1 ? 0 : item;
  t.dynamic_strides[1] = h_extent == 1 ? 0 : head;
  t.dynamic_strides[2] = rows == 1 ? 0 : row;
  return t;
}

}  // namespace jaxflash

#endif  // JAXFLASH_FFI_VARIANT_COMMON_H_
