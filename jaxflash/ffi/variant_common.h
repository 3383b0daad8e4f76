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
//   -DJAXFLASH_MOD_ARRAYS=<n> -DJAXFLASH_MOD_DTYPES={<code> x4} -DJAXFLASH_MOD_RANKS={<rank> x4}
//     (score_mod / mask_mod variants: the closed-over arrays; n = 0 and zeros otherwise)
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
    !defined(JAXFLASH_BIAS) || !defined(JAXFLASH_MOD_ARRAYS) ||                                    \
    !defined(JAXFLASH_MOD_DTYPES) || !defined(JAXFLASH_MOD_RANKS) ||                               \
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
      JAXFLASH_BIAS,      JAXFLASH_MOD_ARRAYS,    JAXFLASH_MOD_DTYPES, JAXFLASH_MOD_RANKS};
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

// The bias (and dbias) must be there exactly for bias variants, 16-byte aligned with 16-byte
// rows of at least seqlen_k elements (TMA).
inline bool BiasOperandsMatch(const JaxflashBias& b, bool backward, int32_t seqlen_k) {
  if (!JAXFLASH_BIAS) return b.bias == nullptr && b.dbias == nullptr;
  const bool aligned = (reinterpret_cast<uintptr_t>(b.bias) & 15) == 0 &&
                       (reinterpret_cast<uintptr_t>(b.dbias) & 15) == 0;
  const int64_t planes = static_cast<int64_t>(b.batch) * b.heads;
  return b.bias != nullptr && (b.dbias != nullptr) == backward && b.batch >= 1 && b.heads >= 1 &&
         b.rows >= 1 && planes <= INT32_MAX && b.row_length >= seqlen_k && b.row_length % 8 == 0 &&
         aligned;
}

// The mods arrays must be there exactly for the variant's info.mod_arrays slots.
inline bool ModArraysMatch(const JaxflashModArrays& m) {
  for (int k = 0; k < JAXFLASH_MAX_MOD_ARRAYS; ++k) {
    if ((m.data[k] != nullptr) != (k < JAXFLASH_MOD_ARRAYS)) return false;
  }
  return true;
}

// An exported tensor struct of a closed-over array (jaxflash.kernels.compile.mod_array_tensors:
// N >= 1 dynamic extents, N - 1 dynamic strides, dense row-major) from its extents; a rank-0
// array is the (1,) tensor.
template <typename T>
T ModArrayTensor(const void* data, const int32_t* extents, int32_t rank) {
  constexpr size_t N = sizeof(T::dynamic_shapes) / sizeof(int32_t);
  T t = {};
  t.data = const_cast<void*>(data);
  for (size_t i = 0; i < N; ++i) t.dynamic_shapes[i] = rank == 0 ? 1 : extents[i];
  if constexpr (N > 1) {
    int64_t stride = 1;
    for (size_t i = N - 1; i-- > 0;) {
      stride *= t.dynamic_shapes[i + 1];
      t.dynamic_strides[i] = stride;
    }
  }
  return t;
}

// The bias operands of a bias variant's kernel (jaxflash.kernels.compile.bias_signature): the
// (rows, seqlen_k, planes) view of the buffer, a plane per (batch, head) it does not broadcast
// and its rows (the queries, or 1) row_length apart, and the steps of batch and head in planes
// and of query in rows (0 along a broadcast dim; kernels/bias.py BiasPlanes).
template <typename T>
struct BiasOperands {
  T planes;
  int32_t batch_planes, head_planes, query_step;
};

template <typename T>
BiasOperands<T> BiasPlanes(const JaxflashBias& b, int32_t seqlen_k) {
  static_assert(sizeof(T::dynamic_shapes) == 3 * sizeof(int32_t) &&
                    sizeof(T::dynamic_strides) == 2 * sizeof(int64_t),
                "the bias is (rows, seqlen_k, planes) with dynamic row and plane strides in "
                "jaxflash.kernels.compile.bias_signature");
  BiasOperands<T> out = {};
  out.planes.data = const_cast<void*>(b.bias);
  out.planes.dynamic_shapes[0] = b.rows;
  out.planes.dynamic_shapes[1] = seqlen_k;
  out.planes.dynamic_shapes[2] = b.batch * b.heads;
  out.planes.dynamic_strides[0] = b.row_length;
  out.planes.dynamic_strides[1] = static_cast<int64_t>(b.rows) * b.row_length;
  out.query_step = b.rows == 1 ? 0 : 1;
  out.head_planes = b.heads == 1 ? 0 : 1;
  out.batch_planes = b.batch == 1 ? 0 : b.heads;
  return out;
}

// The backward's dbias (batch, heads, seqlen_q, seqlen_k), dense with rows row_length apart.
template <typename T>
T DbiasTensor(void* data, int32_t batch, int32_t heads, int32_t seqlen_q, int32_t seqlen_k,
              int32_t row_length) {
  static_assert(sizeof(T::dynamic_shapes) == 4 * sizeof(int32_t) &&
                    sizeof(T::dynamic_strides) == 3 * sizeof(int64_t),
                "dbias is (batch, heads, seqlen_q, seqlen_k) with 3 dynamic strides in "
                "jaxflash.kernels.compile.bias_signature");
  T t = {};
  t.data = data;
  t.dynamic_shapes[0] = batch;
  t.dynamic_shapes[1] = heads;
  t.dynamic_shapes[2] = seqlen_q;
  t.dynamic_shapes[3] = seqlen_k;
  t.dynamic_strides[2] = row_length;
  t.dynamic_strides[1] = t.dynamic_strides[2] * seqlen_q;
  t.dynamic_strides[0] = t.dynamic_strides[1] * heads;
  return t;
}

}  // namespace jaxflash

// The score_mod / mask_mod arrays' tensor structs and wrapper arguments: JF_MOD_DECLS(mm)
// declares mod0.. (JAXFLASH_MOD_ARRAYS of them) from a JaxflashModArrays mm, JF_MODS passes
// them (the exported signature has no argument where a slot is None).
#define JF_MOD_DECL(k, mm) \
  auto mod##k = jaxflash::ModArrayTensor<JF_MAIN(_Tensor_mMod##k##_t)>((mm).data[k], \
                                                                      (mm).extents[k], kModRanks[k]);
#if JAXFLASH_MOD_ARRAYS > 0
#define JF_MOD_DECL0(mm) JF_MOD_DECL(0, mm)
#define JF_MOD_ARG0 &mod0,
#else
#define JF_MOD_DECL0(mm)
#define JF_MOD_ARG0
#endif
#if JAXFLASH_MOD_ARRAYS > 1
#define JF_MOD_DECL1(mm) JF_MOD_DECL(1, mm)
#define JF_MOD_ARG1 &mod1,
#else
#define JF_MOD_DECL1(mm)
#define JF_MOD_ARG1
#endif
#if JAXFLASH_MOD_ARRAYS > 2
#define JF_MOD_DECL2(mm) JF_MOD_DECL(2, mm)
#define JF_MOD_ARG2 &mod2,
#else
#define JF_MOD_DECL2(mm)
#define JF_MOD_ARG2
#endif
#if JAXFLASH_MOD_ARRAYS > 3
#define JF_MOD_DECL3(mm) JF_MOD_DECL(3, mm)
#define JF_MOD_ARG3 &mod3,
#else
#define JF_MOD_DECL3(mm)
#define JF_MOD_ARG3
#endif
#define JF_MOD_DECLS(mm)                                                              \
  static const int32_t kModRanks[JAXFLASH_MAX_MOD_ARRAYS] = JAXFLASH_MOD_RANKS;       \
  (void)kModRanks;                                                                    \
  JF_MOD_DECL0(mm) JF_MOD_DECL1(mm) JF_MOD_DECL2(mm) JF_MOD_DECL3(mm)
#define JF_MODS JF_MOD_ARG0 JF_MOD_ARG1 JF_MOD_ARG2 JF_MOD_ARG3

#endif  // JAXFLASH_FFI_VARIANT_COMMON_H_
