// Fills the tensor structs that CuTe DSL's export_to_c generates ({data, dynamic_shapes[],
// dynamic_strides[]}, dynamic modes only, in mode order) for dense row-major tensors as XLA
// hands them over. Shared by the per-variant glue (variant_fwd.cc, variant_bwd.cc).
#ifndef JAXFLASH_FFI_TENSOR_ARGS_H_
#define JAXFLASH_FFI_TENSOR_ARGS_H_

#include <stddef.h>
#include <stdint.h>

namespace jaxflash {

// The 3- and 4-mode tensors of the kernels' fake signatures (jaxflash.kernels.compile) have 3
// dynamic extents and 2 dynamic strides; the glue checks each such exported struct, so that a
// changed signature fails to compile instead of at run time (Dense checks every struct it fills
// against the extents it is given).
template <typename T>
constexpr bool kSignatureMatches =
    sizeof(T::dynamic_shapes) == 3 * sizeof(int32_t) &&
    sizeof(T::dynamic_strides) == 2 * sizeof(int64_t);

// A dense row-major tensor (e[0], ..., e[N-1], inner): the N extents e are dynamic in the
// kernel signature, the `inner` trailing elements of each index of e[N-1] static (a head dim,
// the 4 entries of a block range; 1 when e[N-1] is the contiguous mode). Fills the N extents
// and the N - 1 dynamic strides, of e[0] to e[N-2]; the stride of e[N-1] (inner) is static.
// The struct must have exactly that many of each.
template <typename T, size_t N>
T Dense(const void* data, const int32_t (&extents)[N], int32_t inner = 1) {
  static_assert(sizeof(T::dynamic_shapes) == N * sizeof(int32_t),
                "the struct has another number of dynamic extents");
  T t = {};
  t.data = const_cast<void*>(data);
  for (size_t i = 0; i < N; ++i) t.dynamic_shapes[i] = extents[i];
  if constexpr (N > 1) {  // a 1-mode struct has no dynamic_strides member
    static_assert(sizeof(T::dynamic_strides) == (N - 1) * sizeof(int64_t),
                  "the struct has another number of dynamic strides");
    int64_t stride = inner;
    for (size_t i = N - 1; i-- > 0;) {
      stride *= extents[i + 1];
      t.dynamic_strides[i] = stride;
    }
  }
  return t;
}

// TMA needs 16-byte aligned global addresses; fp32 scratch needs 4.
inline bool Aligned(const void* p, uintptr_t bytes) {
  return (reinterpret_cast<uintptr_t>(p) & (bytes - 1)) == 0;
}

}  // namespace jaxflash

#endif  // JAXFLASH_FFI_TENSOR_ARGS_H_
