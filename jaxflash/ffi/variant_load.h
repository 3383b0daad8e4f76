// What every library behind kernel_abi.h does before it launches: check the call, then load its
// CUDA modules once. Needs none of the JAXFLASH_* build macros, so any glue that implements
// kernel_abi.h includes it (variant_common.h for jaxflash's own variants).
#ifndef JAXFLASH_FFI_VARIANT_LOAD_H_
#define JAXFLASH_FFI_VARIANT_LOAD_H_

#include <stdint.h>

#include <mutex>

#include "cuda_runtime_api.h"
#include "kernel_abi.h"

namespace jaxflash {
// Internal linkage: the statics of LoadOnce belong to the library that includes this file,
// whatever symbol visibility it is built with (two libraries in one process never share them).
namespace {

// Runs `load` (the generated <prefix>_Kernel_Module_Load calls) once per library, from its one
// jaxflash_variant_load, and restores the caller's device, which Module_Load may leave changed
// as it walks every device. The generated loaders only print their errors: `load` returns
// whether every module handle is set. Every call returns the first call's status, 0 on success.
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

}  // namespace

// An entry point's first step (jaxflash_variant_fwd / _bwd / _decode): a call that the library's
// checks refuse (`refusal`, their nonzero status) gets that status before any CUDA call; any
// other loads the modules (jaxflash_variant_load). 0 when the call may launch.
inline int32_t RefuseOrLoad(int32_t refusal) {
  return refusal != 0 ? refusal : jaxflash_variant_load();
}

}  // namespace jaxflash

#endif  // JAXFLASH_FFI_VARIANT_LOAD_H_
