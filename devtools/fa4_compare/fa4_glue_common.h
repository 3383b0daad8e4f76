// What both FA-4 glues (fa4_glue.cc, the backward; fa4_fwd_glue.cc, the forward) share: the
// export attribute, the refusal status, the shape check and the load-once of the cubins.
#ifndef JAXFLASH_DEVTOOLS_FA4_GLUE_COMMON_H_
#define JAXFLASH_DEVTOOLS_FA4_GLUE_COMMON_H_

#include <cuda_runtime.h>
#include <stdint.h>

#include <mutex>

#define FA4_EXPORT extern "C" __attribute__((visibility("default")))

// Whether group size g is one of GROUPS(X) (X(G) for each group size a glue compiled).
#define FA4_GROUP_SUPPORTED(GROUPS, g) \
  ([](int32_t group) {                  \
    GROUPS(FA4_RETURN_IF_GROUP)         \
    return false;                       \
  }(g))
#define FA4_RETURN_IF_GROUP(G) \
  if (group == G) return true;

namespace fa4_glue {

constexpr int32_t kInvalid = static_cast<int32_t>(cudaErrorInvalidValue);

// Positive extents, and whole groups of query heads per kv head.
inline bool ValidShape(int32_t batch, int32_t seqlen_q, int32_t seqlen_k, int32_t num_heads,
                       int32_t num_kv_heads) {
  return batch > 0 && seqlen_q > 0 && seqlen_k > 0 && num_heads > 0 && num_kv_heads > 0 &&
         num_heads % num_kv_heads == 0;
}

// Runs `load` (which loads each cubin on every visible device, may leave another device
// current, and returns whether every module loaded) once per library (each glue is its own
// shared object with hidden symbols), keeping the caller's current device; every call returns
// the first call's status.
template <typename Load>
int32_t LoadOnce(Load load) {
  static std::once_flag once;
  static int32_t status = -1;
  std::call_once(once, [&] {
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess) {
      status = static_cast<int32_t>(cudaErrorNoDevice);
      return;
    }
    const bool ok = load();
    cudaSetDevice(device);
    status = ok ? 0 : static_cast<int32_t>(cudaErrorInvalidKernelImage);
  });
  return status;
}

}  // namespace fa4_glue

#endif  // JAXFLASH_DEVTOOLS_FA4_GLUE_COMMON_H_
