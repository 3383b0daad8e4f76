// What both FA-4 glues (fa4_glue.cc, the backward; fa4_fwd_glue.cc, the forward) share: the
// export attribute, the refusal status and the shape check. The load-once of the cubins and an
// entry's first step are jaxflash's own (jaxflash/ffi/variant_load.h): the glues implement the
// same kernel_abi.h.
#ifndef JAXFLASH_DEVTOOLS_FA4_GLUE_COMMON_H_
#define JAXFLASH_DEVTOOLS_FA4_GLUE_COMMON_H_

#include <cuda_runtime.h>
#include <stdint.h>

#include "variant_load.h"

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

}  // namespace fa4_glue

#endif  // JAXFLASH_DEVTOOLS_FA4_GLUE_COMMON_H_
