// Fills the tensor structs that CuTe DSL's export_to_c generates ({data, dynamic_shapes[],
// dynamic_strides[]}, dynamic modes only, in mode order) for dense row-major tensors as XLA
// hands them over. Shared by the per-variant glue (variant_fwd.cc, variant_bwd.cc).
#ifndef JAXFLASH_FFI_TENSOR_ARGS_H_
#define JAXFLASH_FFI_TENSOR_ARGS_H_

#include <stdint.h>

namespace jaxflash {

// Every tensor of the kernels' fake signatures (jaxflash.kernels.compile) has 3 dynamic extents
// and 2 dynamic strides; the glue checks each exported struct, so that a changed signature
// fails to compile instead of at run time.
template <typename T>
constexpr bool kSignatureMatches =
    sizeof(T::dynamic_shapes) == 3 * sizeof(int32_t) &&
    sizeof(T::dynamic_strides) == 2 * sizeof(int64_t);

// (d0, d1, d2, dim) dense row-major: dynamic extents (d0, d1, d2), dynamic strides of d0, d1;
// the stride of d2 (dim) and the unit stride are static in the kernel signature.
template <typename T>
T Dense4(const void* data, int32_t d0, int32_t d1, int32_t d2, int32_t dim) {
  T t = {};
  t.data = const_cast<void*>(data);
  t.dynamic_shapes[0] = d0;
  t.dynamic_shapes[1] = d1;
  t.dynamic_shapes[2] = d2;
  t.dynamic_strides[0] = static_cast<int64_t>(d1) * d2 * dim;
  t.dynamic_strides[1] = static_cast<int64_t>(d2) * dim;
  return t;
}

// (d0, d1, d2) dense row-major: all extents dynamic, strides of d0 and d1 dynamic.
template <typename T>
T Dense3(const void* data, int32_t d0, int32_t d1, int32_t d2) {
  T t = {};
  t.data = const_cast<void*>(data);
  t.dynamic_shapes[0] = d0;
  t.dynamic_shapes[1] = d1;
  t.dynamic_shapes[2] = d2;
  t.dynamic_strides[0] = static_cast<int64_t>(d1) * d2;
  t.dynamic_strides[1] = d2;
  return t;
}

// (d0, d1) dense row-major: both extents dynamic, the stride of d0 dynamic.
template <typename T>
T Dense2(const void* data, int32_t d0, int32_t d1) {
  T t = {};
  t.data = const_cast<void*>(data);
  t.dynamic_shapes[0] = d0;
  t.dynamic_shapes[1] = d1;
  t.dynamic_strides[0] = d1;
  return t;
}

// (d0, d1, dim) dense row-major with a static last extent: extents d0, d1 and the stride of d0
// dynamic (the masked variants' block ranges, dim = 4).
template <typename T>
T Dense2Static(const void* data, int32_t d0, int32_t d1, int32_t dim) {
  T t = {};
  t.data = const_cast<void*>(data);
  t.dynamic_shapes[0] = d0;
  t.dynamic_shapes[1] = d1;
  t.dynamic_strides[0] = static_cast<int64_t>(d1) * dim;
  return t;
}

// (n,) contiguous: the extent dynamic.
template <typename T>
T Vector(const void* data, int32_t n) {
  T t = {};
  t.data = const_cast<void*>(data);
  t.dynamic_shapes[0] = n;
  return t;
}

// TMA needs 16-byte aligned global addresses; fp32 scratch needs 4.
inline bool Aligned(const void* p, uintptr_t bytes) {
  return (reinterpret_cast<uintptr_t>(p) & (bytes - 1)) == 0;
}

}  // namespace jaxflash

#endif  // JAXFLASH_FFI_TENSOR_ARGS_H_
