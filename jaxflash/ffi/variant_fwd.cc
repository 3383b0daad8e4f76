// Per-variant glue of the forward kernel: implements kernel_abi.h on top of ONE exported object.
//
// This single source is compiled once per KernelVariant; the variant comes in through macros,
// all of which `jaxflash.kernels.compile.export_variant(...).defines` lists ready to pass:
//   -DJAXFLASH_PREFIX=<function_prefix>        C prefix given to export_to_c (no quotes)
//   -DJAXFLASH_HEADER="\"<out_dir>/<key>.h\""  the generated header, as a quoted string
//   -DJAXFLASH_VARIANT_KEY="\"<key>\""         KernelVariant.key, as a quoted string
//   -DJAXFLASH_HEAD_DIM=<d> -DJAXFLASH_HEAD_DIM_V=<dv>   static head dims of the cubin
// Link (docs/aot-pipeline.md step 5; jaxflash.build.link_variant runs it), one library per variant:
//   g++ -std=c++17 -O2 -shared -fPIC -fvisibility=hidden <macros> jaxflash/ffi/variant_fwd.cc \
//       <out_dir>/<key>.o -I jaxflash/ffi -I<CUDA include dir> \
//       <dsl lib dir>/libcuda_dialect_runtime_static.a <CUDA lib dir>/libcudart_static.a \
//       -ldl -lrt -lpthread -o <key>.so
// (<dsl lib dir>: nvidia_cutlass_dsl/cu13/lib; the library then needs only libc, libstdc++ and,
// at run time, libcuda.) Only the four kernel_abi.h functions are exported.

#include <stdint.h>

#include <mutex>

#include "kernel_abi.h"
#include "tensor_args.h"
#include JAXFLASH_HEADER

#if !defined(JAXFLASH_PREFIX) || !defined(JAXFLASH_VARIANT_KEY) || \
    !defined(JAXFLASH_HEAD_DIM) || !defined(JAXFLASH_HEAD_DIM_V)
#error "define JAXFLASH_PREFIX, JAXFLASH_HEADER, JAXFLASH_VARIANT_KEY, JAXFLASH_HEAD_DIM(_V)"
#endif

#define JF_CAT2(a, b) a##b
#define JF_CAT(a, b) JF_CAT2(a, b)
#define JF_NAME(suffix) JF_CAT(JAXFLASH_PREFIX, suffix)

#define JF_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

using jaxflash::Aligned;
using jaxflash::Dense3;
using jaxflash::Dense4;

using Module = JF_NAME(_Kernel_Module_t);
using TensorQ = JF_NAME(_Tensor_mQ_t);
using TensorK = JF_NAME(_Tensor_mK_t);
using TensorV = JF_NAME(_Tensor_mV_t);
using TensorO = JF_NAME(_Tensor_mO_t);
using TensorLse = JF_NAME(_Tensor_mLSE_t);

// The fake-tensor signature (compile.fwd_signature) has 3 dynamic extents and 2 dynamic
// strides per tensor: a changed signature must fail here, not at run time.
template <typename T>
constexpr bool kSignatureMatches =
    sizeof(T::dynamic_shapes) == 3 * sizeof(int32_t) &&
    sizeof(T::dynamic_strides) == 2 * sizeof(int64_t);
static_assert(kSignatureMatches<TensorQ> && kSignatureMatches<TensorK> &&
                  kSignatureMatches<TensorV> && kSignatureMatches<TensorO> &&
                  kSignatureMatches<TensorLse>,
              "exported tensor structs do not match jaxflash.kernels.compile.fwd_signature");

Module g_module = {};
std::once_flag g_load_once;
int32_t g_load_status = -1;

void LoadOnce() {
  // Module_Load walks every device and may leave another one current; restore the caller's.
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    g_load_status = static_cast<int32_t>(cudaErrorNoDevice);
    return;
  }
  JF_NAME(_Kernel_Module_Load)(&g_module);
  cudaSetDevice(device);
  // The generated loader only prints its errors; a null library handle is how failure shows.
  g_load_status = g_module.module != nullptr ? 0 : static_cast<int32_t>(cudaErrorInvalidKernelImage);
}

}  // namespace

JF_EXPORT int32_t jaxflash_variant_abi_version(void) { return JAXFLASH_KERNEL_ABI_VERSION; }

JF_EXPORT const char* jaxflash_variant_key(void) { return JAXFLASH_VARIANT_KEY; }

JF_EXPORT int32_t jaxflash_variant_load(void) {
  std::call_once(g_load_once, LoadOnce);
  return g_load_status;
}

JF_EXPORT int32_t jaxflash_variant_fwd(const JaxflashFwdArgs* args, void* stream) {
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
  // Grid is (m blocks, num_heads, batch): CUDA caps gridDim.y and gridDim.z at 65535.
  if (args->num_heads > 65535 || args->batch > 65535) return kInvalid;
  if (!Aligned(args->q, 16) || !Aligned(args->k, 16) ||
      !Aligned(args->v, 16) || !Aligned(args->out, 16) ||
      !Aligned(args->lse, 16)) {
    return kInvalid;  // TMA needs 16-byte aligned global addresses
  }
  const int32_t status = jaxflash_variant_load();
  if (status != 0) return status;

  const int32_t b = args->batch, sq = args->seqlen_q, sk = args->seqlen_k;
  const int32_t h = args->num_heads, hk = args->num_kv_heads;
  TensorQ q = Dense4<TensorQ>(args->q, b, sq, h, JAXFLASH_HEAD_DIM);
  TensorK k = Dense4<TensorK>(args->k, b, sk, hk, JAXFLASH_HEAD_DIM);
  TensorV v = Dense4<TensorV>(args->v, b, sk, hk, JAXFLASH_HEAD_DIM_V);
  TensorO o = Dense4<TensorO>(args->out, b, sq, h, JAXFLASH_HEAD_DIM_V);
  TensorLse lse = Dense3<TensorLse>(args->lse, b, h, sq);  // (batch, heads, seqlen_q)
  return JF_CAT(JF_CAT(cute_dsl_, JAXFLASH_PREFIX), _wrapper)(
      &g_module, &q, &k, &v, &o, &lse, args->softmax_scale, static_cast<cudaStream_t>(stream));
}
