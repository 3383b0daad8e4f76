// XLA FFI handlers of jaxflash, one per stable custom-call target (names in jaxflash/config.py).
// Kernels live in per-variant libraries behind kernel_abi.h, registered by key from Python; this
// file never includes an exported kernel header.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "cuda_runtime_api.h"
#include "kernel_abi.h"
#include "variant_registry.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxflash {
namespace {

constexpr std::string_view kFwdTarget = "jaxflash_attention_fwd";
constexpr std::string_view kBwdTarget = "jaxflash_attention_bwd";
constexpr std::string_view kDecodeTarget = "jaxflash_kv_cache_attention";
// A window side without a bound (config.WINDOW_UNBOUNDED); -1 also reads as unbounded for the
// dense variants (programs serialized before the masked variants existed).
constexpr int32_t kUnbounded = 1 << 30;
// JaxflashVariantInfo.dtype of the FP8 forward variants (e4m3 q, k, v; bf16 or fp16 out).
constexpr int32_t kFp8Dtype = 2;

// "jaxflash_attention_fwd[variant=<key>]: ": every error names the target and the variant.
std::string Where(std::string_view target, std::string_view variant) {
  return std::string(target) + "[variant=" + std::string(variant) + "]: ";
}

std::string Shape(const ffi::AnyBuffer& buffer) {
  std::string out = "(";
  auto dims = buffer.dimensions();
  for (size_t i = 0; i < dims.size(); ++i) {
    out += (i ? ", " : "") + std::to_string(dims[i]);
  }
  return out + (dims.size() == 1 ? ",)" : ")");
}

// A nonzero status from a variant library's launcher, with the shapes of the call.
ffi::Error LaunchError(const std::string& where, int32_t status, const ffi::AnyBuffer& q,
                       const ffi::AnyBuffer& k) {
  return ffi::Error::Internal(where + "kernel launch failed with status " +
                              std::to_string(status) + " (as a CUDA error: " +
                              cudaGetErrorName(static_cast<cudaError_t>(status)) + ") for q " +
                              Shape(q) + ", k " + Shape(k));
}

const char* DtypeName(ffi::DataType dtype) {
  switch (dtype) {
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::F8E4M3FN: return "float8_e4m3fn";
    case ffi::DataType::S32: return "int32";
    case ffi::DataType::PRED: return "bool";
    case ffi::DataType::S8: return "int8";
    case ffi::DataType::S16: return "int16";
    case ffi::DataType::U8: return "uint8";
    case ffi::DataType::U16: return "uint16";
    case ffi::DataType::U32: return "uint32";
    default: return "an unsupported dtype";
  }
}

// The static part of one call: everything in the HLO attributes, and the target it came from.
struct CallAttrs {
  std::string_view variant;
  float softmax_scale;
  bool causal;
  int32_t window_left, window_right;
  float softcap;
  int32_t head_dim, head_dim_v;
  std::string_view target = kFwdTarget;
  bool deterministic = false;  // backward only
};

std::string Where(const CallAttrs& a) { return Where(a.target, a.variant); }

ffi::Error Invalid(const CallAttrs& a, const std::string& what) {
  return ffi::Error::InvalidArgument(Where(a) + what);
}

// q's dtype and the head-dim attributes must be those the variant library was built for
// (forward, backward and decode variants alike).
ffi::Error CheckBuiltFor(const CallAttrs& a, const JaxflashVariantInfo& info,
                         ffi::DataType dtype) {
  const ffi::DataType built_for = info.dtype == 2   ? ffi::DataType::F8E4M3FN
                                  : info.dtype == 1 ? ffi::DataType::BF16
                                                    : ffi::DataType::F16;
  if (dtype != built_for) {
    return Invalid(a, std::string("q has dtype ") + DtypeName(dtype) + ", the variant was built for " +
                          DtypeName(built_for));
  }
  if (a.head_dim != info.head_dim || a.head_dim_v != info.head_dim_v) {
    return Invalid(a, "attributes head_dim=" + std::to_string(a.head_dim) + ", head_dim_v=" +
                          std::to_string(a.head_dim_v) + " do not match the variant's " +
                          std::to_string(info.head_dim) + ", " + std::to_string(info.head_dim_v));
  }
  return ffi::Error::Success();
}

// Kernels that take the window at run time (masked and decode variants): each side within
// +-kUnbounded, the value that means unbounded.
ffi::Error CheckWindowSides(const CallAttrs& a) {
  if (std::abs(static_cast<int64_t>(a.window_left)) > kUnbounded ||
      std::abs(static_cast<int64_t>(a.window_right)) > kUnbounded) {
    return Invalid(a, "window (" + std::to_string(a.window_left) + ", " +
                          std::to_string(a.window_right) + "): each side needs |w| <= " +
                          std::to_string(kUnbounded) + " (the unbounded value)");
  }
  return ffi::Error::Success();
}

// softcap (0 = off; a finite value > 0 where the variant takes it at run time) and a finite
// softmax_scale.
ffi::Error CheckSoftcapAndScale(const CallAttrs& a, bool takes_softcap) {
  if (a.softcap != 0 && !(takes_softcap && std::isfinite(a.softcap) && a.softcap > 0)) {
    return Invalid(a, "softcap " + std::to_string(a.softcap) + (takes_softcap
                          ? ": expected a finite value > 0, or 0 (off)"
                          : ": this variant runs without softcap only (0); softcap takes a "
                            "masked variant"));
  }
  if (!std::isfinite(a.softmax_scale)) {
    return Invalid(a, "softmax_scale " + std::to_string(a.softmax_scale) + " is not finite");
  }
  return ffi::Error::Success();
}

// The attributes and q's dtype must describe the variant the library was built for.
ffi::Error CheckAttrs(const CallAttrs& a, const JaxflashVariantInfo& info, ffi::DataType dtype) {
  if (ffi::Error e = CheckBuiltFor(a, info, dtype); e.failure()) return e;
  auto flag = [](bool on) { return on ? std::string("true") : std::string("false"); };
  // Masked variants take causal, like the window, at run time.
  if (!info.masked && a.causal != (info.causal != 0)) {
    return Invalid(a, "attribute causal=" + flag(a.causal) + " does not match the variant's " +
                          flag(info.causal != 0));
  }
  if (a.deterministic != (info.deterministic != 0)) {
    return Invalid(a, "attribute deterministic=" + flag(a.deterministic) +
                          " does not match the variant's " + flag(info.deterministic != 0));
  }
  auto unbounded = [](int32_t w) { return w == kUnbounded || w == -1; };
  if (!info.masked && !(unbounded(a.window_left) && unbounded(a.window_right))) {
    return Invalid(a, "window (" + std::to_string(a.window_left) + ", " +
                          std::to_string(a.window_right) + "): this variant runs unbounded "
                          "windows only (" + std::to_string(kUnbounded) + "); windows take a "
                          "masked variant");
  }
  if (info.masked) {
    if (ffi::Error e = CheckWindowSides(a); e.failure()) return e;
  }
  // Soft-capping: masked variants, forward and backward.
  return CheckSoftcapAndScale(a, info.masked);
}

// `buffer` must have exactly `dims` and `dtype`.
ffi::Error CheckExact(const CallAttrs& a, const char* name, const ffi::AnyBuffer& buffer,
                      std::initializer_list<int64_t> dims, ffi::DataType dtype) {
  auto have = buffer.dimensions();
  bool ok = have.size() == dims.size() && buffer.element_type() == dtype;
  size_t i = 0;
  for (int64_t d : dims) ok = ok && have[i++] == d;
  if (ok) return ffi::Error::Success();
  std::string want = "(";
  i = 0;
  for (int64_t d : dims) want += (i++ ? ", " : "") + std::to_string(d);
  return Invalid(a, std::string(name) + " is " + DtypeName(buffer.element_type()) + " " +
                        Shape(buffer) + ", expected " + DtypeName(dtype) + " " + want + ")");
}

// Checks ranks, dtypes and dims of every buffer against the attributes and each other, then
// fills the shape fields of `args`.
ffi::Error CheckBuffers(const CallAttrs& a, const JaxflashVariantInfo& info,
                        const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                        const ffi::AnyBuffer& v, const ffi::AnyBuffer& out,
                        const ffi::AnyBuffer& lse, JaxflashFwdArgs* args) {
  struct Named { const char* name; const ffi::AnyBuffer* buffer; size_t rank; };
  for (const Named& n : {Named{"q", &q, 4}, Named{"k", &k, 4}, Named{"v", &v, 4},
                         Named{"out", &out, 4}, Named{"lse", &lse, 3}}) {
    if (n.buffer->dimensions().size() != n.rank) {
      return Invalid(a, std::string(n.name) + " has shape " + Shape(*n.buffer) +
                              ", expected rank " + std::to_string(n.rank));
    }
  }
  const ffi::DataType dtype = q.element_type();
  const bool fp8 = dtype == ffi::DataType::F8E4M3FN;
  if (dtype != ffi::DataType::F16 && dtype != ffi::DataType::BF16 && !fp8) {
    return Invalid(a, std::string("q has ") + DtypeName(dtype) +
                            ", accepted: float16, bfloat16, float8_e4m3fn");
  }
  for (const Named& n : {Named{"k", &k, 4}, Named{"v", &v, 4}}) {
    if (n.buffer->element_type() != dtype) {
      return Invalid(a, std::string(n.name) + " has " + DtypeName(n.buffer->element_type()) +
                              ", q has " + DtypeName(dtype));
    }
  }
  // FP8 calls write bfloat16 or float16 (a run-time choice of the kernel), 16-bit ones q's dtype.
  const ffi::DataType out_dtype = out.element_type();
  if (fp8 ? out_dtype != ffi::DataType::BF16 && out_dtype != ffi::DataType::F16
          : out_dtype != dtype) {
    return Invalid(a, std::string("out has ") + DtypeName(out_dtype) + ", expected " +
                          (fp8 ? "bfloat16 or float16" : DtypeName(dtype)) + " for q of " +
                          DtypeName(dtype));
  }
  args->out_float16 = fp8 && out_dtype == ffi::DataType::F16 ? 1 : 0;
  if (lse.element_type() != ffi::DataType::F32) {
    return Invalid(a, std::string("lse has ") + DtypeName(lse.element_type()) +
                            ", expected float32");
  }
  if (ffi::Error e = CheckAttrs(a, info, dtype); e.failure()) return e;

  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  const int64_t b = qd[0], sq = qd[1], h = qd[2], sk = kd[1], hk = kd[2];
  const bool ok_q = qd[3] == a.head_dim;
  const bool ok_k = kd[0] == b && kd[3] == a.head_dim;
  const bool ok_v = vd[0] == b && vd[1] == sk && vd[2] == hk && vd[3] == a.head_dim_v;
  if (!ok_q || !ok_k || !ok_v) {
    return Invalid(a, "q " + Shape(q) + ", k " + Shape(k) + ", v " + Shape(v) +
                            " do not fit q (b, sq, h, " + std::to_string(a.head_dim) +
                            "), k (b, sk, hk, " + std::to_string(a.head_dim) +
                            "), v (b, sk, hk, " + std::to_string(a.head_dim_v) + ")");
  }
  if (hk == 0 ? h != 0 : h % hk != 0) {
    return Invalid(a, "num_heads " + std::to_string(h) + " is not a multiple of num_kv_heads " +
                            std::to_string(hk));
  }
  // The dtypes of out and lse are checked above.
  if (ffi::Error e = CheckExact(a, "out", out, {b, sq, h, a.head_dim_v}, out_dtype);
      e.failure()) {
    return e;
  }
  if (ffi::Error e = CheckExact(a, "lse", lse, {b, h, sq}, ffi::DataType::F32); e.failure()) {
    return e;
  }
  for (int64_t d : {b, sq, sk, h, hk}) {
    // The kernel ABI takes int32 extents; larger ones would silently wrap.
    if (d > std::numeric_limits<int32_t>::max()) {
      return Invalid(a, "dimension " + std::to_string(d) + " exceeds the int32 range");
    }
  }
  args->batch = static_cast<int32_t>(b);
  args->seqlen_q = static_cast<int32_t>(sq);
  args->seqlen_k = static_cast<int32_t>(sk);
  args->num_heads = static_cast<int32_t>(h);
  args->num_kv_heads = static_cast<int32_t>(hk);
  args->head_dim = a.head_dim;
  args->head_dim_v = a.head_dim_v;
  return ffi::Error::Success();
}

// cuMemsetD32Async(CUdeviceptr, unsigned int, size_t, CUstream) -> CUresult (0 = success),
// spelled without cuda.h, which not every CUDA runtime wheel ships.
using MemsetD32 = int (*)(unsigned long long, unsigned int, size_t, cudaStream_t);

// The runtime API has no 32-bit memset; fetch the driver's once (no libcuda link needed).
MemsetD32 GetMemsetD32() {
  static MemsetD32 fn = [] {
    void* found_fn = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    cudaGetDriverEntryPointByVersion("cuMemsetD32Async", &found_fn, 12000, cudaEnableDefault,
                                     &found);
    return found == cudaDriverEntryPointSuccess ? reinterpret_cast<MemsetD32>(found_fn) : nullptr;
  }();
  return fn;
}

// No keys (seqlen_k == 0, or a decode call's empty cache): every row is empty, so out = 0 and
// lse = -inf, without a launch (a TMA descriptor cannot describe a zero-length tensor). `where`
// names the call (Where), out_name and lse_name the two buffers.
ffi::Error FillEmptyRows(const std::string& where, cudaStream_t stream, ffi::AnyBuffer out,
                         ffi::AnyBuffer lse, const char* out_name = "out",
                         const char* lse_name = "lse") {
  if (cudaError_t e = cudaMemsetAsync(out.untyped_data(), 0, out.size_bytes(), stream);
      e != cudaSuccess) {
    return ffi::Error::Internal(where + "zeroing " + out_name + " failed: " +
                                cudaGetErrorString(e));
  }
  MemsetD32 memset_d32 = GetMemsetD32();
  const float neg_inf = -std::numeric_limits<float>::infinity();
  unsigned int bits;
  static_assert(sizeof(bits) == sizeof(neg_inf));
  std::memcpy(&bits, &neg_inf, sizeof(bits));
  if (memset_d32 == nullptr ||
      memset_d32(reinterpret_cast<uintptr_t>(lse.untyped_data()), bits, lse.element_count(),
                 stream) != 0) {
    return ffi::Error::Internal(where + "filling " + lse_name + " with -inf failed");
  }
  return ffi::Error::Success();
}

// Makes the call's device (XLA's device ordinal, the device of its stream) current for the
// call, restoring the previous one afterwards. The ordinal comes from XLA rather than from a
// query on the stream, which would be one more runtime call on a stream under capture.
class ScopedStreamDevice {
 public:
  explicit ScopedStreamDevice(int32_t device) {
    if (cudaGetDevice(&previous_) == cudaSuccess && previous_ != device &&
        cudaSetDevice(device) == cudaSuccess) {
      restore_ = true;
    }
  }
  ~ScopedStreamDevice() {
    if (restore_) cudaSetDevice(previous_);
  }

 private:
  int previous_ = 0;
  bool restore_ = false;
};

// A call whose variant is in none of the kernel folders or did not load from them: `where`
// names the call, `reason` is RegisterFromFolders' account; the message ends with the fixes.
ffi::Error VariantMissing(const std::string& where, std::string_view key,
                          const std::string& reason) {
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                    where + reason + ". Build it with `python -m jaxflash.build --variants " +
                        std::string(key) + "` (or install the kernel wheel), and call "
                        "jaxflash.ffi.register() before running this program.");
}

// The library of the call's variant, which must export the target's entry point. A variant
// this process has not registered yet is loaded from the kernel folders on its first call.
ffi::Error FindLibrary(const CallAttrs& a, const VariantLibrary** library) {
  const std::string key(a.variant);
  *library = FindVariant(a.variant);
  if (*library == nullptr) {
    std::string error = RegisterFromFolders(a.variant);
    *library = FindVariant(a.variant);
    if (*library == nullptr) return VariantMissing(Where(a), a.variant, error);
  }
  const VariantLibrary& found = **library;
  const bool bwd = a.target == kBwdTarget, decode = a.target == kDecodeTarget;
  const bool exported = bwd ? found.bwd != nullptr : decode ? found.decode != nullptr
                                                            : found.fwd != nullptr;
  if (!exported) {
    // A library exports one direction's entry: a variant of another direction, or a stale build.
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      Where(a) + "the library registered for '" + key + "' (" + found.path +
                          ") does not export jaxflash_variant_" +
                          (bwd ? "bwd" : decode ? "decode" : "fwd") + " (it is a " +
                          (found.fwd ? "forward" : found.bwd ? "backward" : "decode") +
                          " variant); pass a " +
                          (bwd ? "backward" : decode ? "decode" : "forward") +
                          " variant, or rebuild it with `python -m jaxflash.build --force "
                          "--variants " + key + "`");
  }
  return ffi::Error::Success();
}

// The masked variants' operands (kernel_abi.h JaxflashMask) after the tensors: their number,
// dtypes and shapes against the variant and the call; fills `mask` and the band (causal folded
// into window_right, as block_ranges.window_bounds does). A forward call may add one operand
// after them, the learnable sink (CheckSink).
ffi::Error CheckMask(const CallAttrs& a, const JaxflashVariantInfo& info,
                     const ffi::RemainingArgs& extra, int64_t b, int64_t sq, int64_t sk,
                     JaxflashMask* mask, int32_t* window_left, int32_t* window_right) {
  const bool bwd = a.target == kBwdTarget;
  const size_t want = info.masked ? (bwd && info.deterministic ? 5 : 4) : 0;
  const size_t fixed = want + (!bwd && info.dtype == kFp8Dtype ? 2 : 0) + (info.bias ? 1 : 0) +
                       static_cast<size_t>(info.mod_arrays);
  if (extra.size() != fixed && !(!bwd && extra.size() == fixed + 1)) {
    return Invalid(a, std::to_string(extra.size()) + " operands after the tensors, expected " +
                          (info.dtype == kFp8Dtype
                               ? std::string("the descales q_descale and kv_descale")
                               : std::to_string(want) + " mask operands for this variant "
                                 "(row_ids, col_ids, ranges, order, and ranks when "
                                 "deterministic)") +
                          (info.bias ? ", then the bias" : "") +
                          (info.mod_arrays ? ", then " + std::to_string(info.mod_arrays) +
                                                 " score_mod / mask_mod arrays"
                                           : std::string()) +
                          (bwd ? "" : ", then optionally the learnable sink"));
  }
  *mask = JaxflashMask{};
  *window_left = a.window_left;
  *window_right = a.causal ? std::min(a.window_right, 0) : a.window_right;
  if (!info.masked) return ffi::Error::Success();
  const int64_t m_blocks = (sq + info.tile_m - 1) / info.tile_m;
  const int64_t n_blocks = (sk + info.tile_n - 1) / info.tile_n;
  // The backward tiles the keys (rows) against query blocks (columns).
  const int64_t row_tiles = bwd ? n_blocks : m_blocks, row_tile = bwd ? info.tile_n : info.tile_m;
  const int64_t col_blocks = bwd ? m_blocks : n_blocks, col_tile = bwd ? info.tile_m : info.tile_n;
  const ffi::DataType s32 = ffi::DataType::S32;
  const char* names[] = {"row_ids", "col_ids", "ranges", "order", "ranks"};
  const int32_t* pointers[5] = {};
  for (size_t i = 0; i < want; ++i) {
    auto got = extra.get<ffi::AnyBuffer>(i);
    if (got.has_error()) return got.error();
    const ffi::AnyBuffer& buffer = got.value();
    ffi::Error e = ffi::Error::Success();
    switch (i) {
      case 0: e = CheckExact(a, names[i], buffer, {b, row_tiles * row_tile}, s32); break;
      case 1: e = CheckExact(a, names[i], buffer, {b, col_blocks * col_tile}, s32); break;
      case 2: e = CheckExact(a, names[i], buffer, {b, row_tiles, 4}, s32); break;
      case 3: e = CheckExact(a, names[i], buffer, {b * row_tiles}, s32); break;
      default: e = CheckExact(a, names[i], buffer, {b, row_tiles, col_blocks}, s32); break;
    }
    if (e.failure()) return e;
    pointers[i] = static_cast<const int32_t*>(buffer.untyped_data());
  }
  *mask = JaxflashMask{pointers[0], pointers[1], pointers[2], pointers[3], pointers[4]};
  return ffi::Error::Success();
}

// The last extent of a bias and dbias buffer: seqlen_k rounded up to a multiple of 8 (kernel_abi.h
// JaxflashBias; jaxflash.config.bias_row_length).
int64_t BiasRowLength(int64_t seqlen_k) { return (seqlen_k + 7) / 8 * 8; }

// Bias variants: the operand after the mask operands is the bias (kernel_abi.h JaxflashBias), in
// q's dtype, (batch or 1, num_heads or 1, seqlen_q or 1, BiasRowLength(seqlen_k)). Sets
// bias->bias and its extents (NULL for other variants); dbias is the backward's to set.
ffi::Error CheckBias(const CallAttrs& a, const JaxflashVariantInfo& info,
                     const ffi::RemainingArgs& extra, size_t index, ffi::DataType dtype,
                     int64_t b, int64_t h, int64_t sq, int64_t sk, JaxflashBias* bias) {
  *bias = JaxflashBias{};
  if (!info.bias) return ffi::Error::Success();
  auto got = extra.get<ffi::AnyBuffer>(index);
  if (got.has_error()) return got.error();
  const ffi::AnyBuffer& buffer = got.value();
  auto d = buffer.dimensions();
  const int64_t row_length = BiasRowLength(sk);
  const bool ok = d.size() == 4 && buffer.element_type() == dtype && (d[0] == 1 || d[0] == b) &&
                  (d[1] == 1 || d[1] == h) && (d[2] == 1 || d[2] == sq) && d[3] == row_length;
  if (!ok) {
    return Invalid(a, std::string("bias is ") + DtypeName(buffer.element_type()) + " " +
                          Shape(buffer) + ", expected " + DtypeName(dtype) + " (" +
                          std::to_string(b) + " or 1, " + std::to_string(h) + " or 1, " +
                          std::to_string(sq) + " or 1, " + std::to_string(row_length) +
                          ": seqlen_k " + std::to_string(sk) + " rounded up to 8)");
  }
  *bias = JaxflashBias{buffer.untyped_data(), static_cast<int32_t>(d[0]),
                       static_cast<int32_t>(d[1]), static_cast<int32_t>(d[2]),
                       static_cast<int32_t>(row_length), nullptr};
  return ffi::Error::Success();
}

// score_mod / mask_mod variants: the info.mod_arrays operands from `index` on are the arrays
// the functions close over (kernel_abi.h JaxflashModArrays), each of the dtype and rank the
// variant was compiled for, every extent in [1, INT32_MAX]. Fills `mods` (all NULL for other
// variants).
ffi::Error CheckModArrays(const CallAttrs& a, const JaxflashVariantInfo& info,
                          const ffi::RemainingArgs& extra, size_t index, JaxflashModArrays* mods) {
  *mods = JaxflashModArrays{};
  static const ffi::DataType kTypes[] = {
      ffi::DataType::PRED, ffi::DataType::S8, ffi::DataType::S16, ffi::DataType::S32,
      ffi::DataType::U8, ffi::DataType::U16, ffi::DataType::U32, ffi::DataType::F16,
      ffi::DataType::BF16, ffi::DataType::F32};
  for (int32_t k = 0; k < info.mod_arrays && k < JAXFLASH_MAX_MOD_ARRAYS; ++k) {
    auto got = extra.get<ffi::AnyBuffer>(index + k);
    if (got.has_error()) return got.error();
    const ffi::AnyBuffer& buffer = got.value();
    auto d = buffer.dimensions();
    const int32_t code = info.mod_dtypes[k], rank = info.mod_ranks[k];
    bool ok = code >= 0 && code < 10 && buffer.element_type() == kTypes[code] &&
              static_cast<int32_t>(d.size()) == rank && rank <= JAXFLASH_MAX_MOD_RANK;
    for (size_t i = 0; ok && i < d.size(); ++i) ok = d[i] >= 1 && d[i] <= INT32_MAX;
    if (!ok) {
      return Invalid(a, "score_mod / mask_mod array " + std::to_string(k) + " is " +
                            DtypeName(buffer.element_type()) + " " + Shape(buffer) +
                            ", the variant reads " +
                            (code >= 0 && code < 10 ? DtypeName(kTypes[code]) : "?") +
                            " of rank " + std::to_string(rank) + " with every extent >= 1");
    }
    mods->data[k] = buffer.untyped_data();
    for (size_t i = 0; i < d.size(); ++i) mods->extents[k][i] = static_cast<int32_t>(d[i]);
  }
  return ffi::Error::Success();
}

// FP8 variants: the two operands after the tensors are the descales (kernel_abi.h), float32
// q_descale (batch, num_heads, q chunks) and kv_descale (batch, num_kv_heads, k chunks, 4).
// Sets args->q_descale and args->kv_descale (NULL for other variants).
ffi::Error CheckDescale(const CallAttrs& a, const JaxflashVariantInfo& info,
                        const ffi::RemainingArgs& extra, JaxflashFwdArgs* args) {
  args->q_descale = nullptr;
  args->kv_descale = nullptr;
  if (info.dtype != kFp8Dtype) return ffi::Error::Success();
  const int64_t q_chunks = jaxflash_fp8_descale_chunks(args->seqlen_q, info.tile_m);
  const int64_t k_chunks = jaxflash_fp8_descale_chunks(args->seqlen_k, info.tile_n);
  auto q_got = extra.get<ffi::AnyBuffer>(0);
  if (q_got.has_error()) return q_got.error();
  if (ffi::Error e = CheckExact(a, "q_descale", q_got.value(),
                                {args->batch, args->num_heads, q_chunks}, ffi::DataType::F32);
      e.failure()) {
    return e;
  }
  auto kv_got = extra.get<ffi::AnyBuffer>(1);
  if (kv_got.has_error()) return kv_got.error();
  if (ffi::Error e = CheckExact(a, "kv_descale", kv_got.value(),
                                {args->batch, args->num_kv_heads, k_chunks, 4},
                                ffi::DataType::F32);
      e.failure()) {
    return e;
  }
  args->q_descale = static_cast<const float*>(q_got.value().untyped_data());
  args->kv_descale = static_cast<const float*>(kv_got.value().untyped_data());
  return ffi::Error::Success();
}

// The forward's optional last operand after the mask operands (or the FP8 descales): the
// learnable sink, float32 (num_heads,). Sets args->sink (NULL without one).
ffi::Error CheckSink(const CallAttrs& a, const JaxflashVariantInfo& info,
                     const ffi::RemainingArgs& extra, int64_t num_heads, JaxflashFwdArgs* args) {
  const size_t fixed = info.masked ? 4 + (info.bias ? 1 : 0) + info.mod_arrays
                                   : info.dtype == kFp8Dtype ? 2 : 0;
  args->sink = nullptr;
  if (extra.size() == fixed) return ffi::Error::Success();
  auto got = extra.get<ffi::AnyBuffer>(fixed);
  if (got.has_error()) return got.error();
  if (ffi::Error e = CheckExact(a, "sink", got.value(), {num_heads}, ffi::DataType::F32);
      e.failure()) {
    return e;
  }
  args->sink = static_cast<const float*>(got.value().untyped_data());
  return ffi::Error::Success();
}

ffi::Error Zero(const CallAttrs& a, cudaStream_t stream, const char* name, ffi::AnyBuffer buffer) {
  if (cudaError_t e = cudaMemsetAsync(buffer.untyped_data(), 0, buffer.size_bytes(), stream);
      e != cudaSuccess) {
    return ffi::Error::Internal(Where(a) + "zeroing " + name + " failed: " + cudaGetErrorString(e));
  }
  return ffi::Error::Success();
}

// The forward's results after out and lse: the tile counter, an int32 (1,) scratch result of
// the variants whose info has tile_counter 1 (kernel_abi.h), none for the others. Sets
// args->tile_counter (NULL without one); the caller zeroes it on the stream before the launch.
ffi::Error CheckTileCounter(const CallAttrs& a, const JaxflashVariantInfo& info,
                            const ffi::RemainingRets& scratch, JaxflashFwdArgs* args,
                            ffi::AnyBuffer* counter) {
  args->tile_counter = nullptr;
  const size_t want = info.tile_counter ? 1 : 0;
  if (scratch.size() != want) {
    return Invalid(a, "the call has " + std::to_string(scratch.size()) +
                          " results after out and lse, the variant takes " +
                          std::to_string(want) + (want ? " (its tile counter)" : ""));
  }
  if (!want) return ffi::Error::Success();
  auto got = scratch.get<ffi::AnyBuffer>(0);
  if (got.has_error()) return got.error();
  *counter = **got;
  if (ffi::Error e = CheckExact(a, "tile_counter", *counter, {1}, ffi::DataType::S32);
      e.failure()) {
    return e;
  }
  args->tile_counter = static_cast<int32_t*>(counter->untyped_data());
  return ffi::Error::Success();
}

ffi::Error AttentionFwd(cudaStream_t stream, int32_t device_ordinal, ffi::AnyBuffer q,
                        ffi::AnyBuffer k, ffi::AnyBuffer v,
                        ffi::RemainingArgs mask_operands, ffi::Result<ffi::AnyBuffer> out,
                        ffi::Result<ffi::AnyBuffer> lse, ffi::RemainingRets scratch,
                        std::string_view variant, float softmax_scale, bool causal,
                        int32_t window_left, int32_t window_right, float softcap,
                        int32_t head_dim, int32_t head_dim_v) {
  const CallAttrs attrs{variant, softmax_scale, causal, window_left, window_right,
                        softcap, head_dim, head_dim_v};
  const VariantLibrary* library = nullptr;
  if (ffi::Error e = FindLibrary(attrs, &library); e.failure()) return e;
  JaxflashFwdArgs args{};
  if (ffi::Error e = CheckBuffers(attrs, library->info, q, k, v, *out, *lse, &args);
      e.failure()) {
    return e;
  }
  if (ffi::Error e = CheckMask(attrs, library->info, mask_operands, args.batch, args.seqlen_q,
                               args.seqlen_k, &args.mask, &args.window_left,
                               &args.window_right);
      e.failure()) {
    return e;
  }
  if (ffi::Error e = CheckDescale(attrs, library->info, mask_operands, &args); e.failure()) {
    return e;
  }
  if (ffi::Error e = CheckBias(attrs, library->info, mask_operands, 4, q.element_type(),
                               args.batch, args.num_heads, args.seqlen_q, args.seqlen_k,
                               &args.bias);
      e.failure()) {
    return e;
  }
  if (ffi::Error e = CheckModArrays(attrs, library->info, mask_operands,
                                    4 + (library->info.bias ? 1 : 0), &args.mods);
      e.failure()) {
    return e;
  }
  if (ffi::Error e = CheckSink(attrs, library->info, mask_operands, args.num_heads, &args);
      e.failure()) {
    return e;
  }
  ffi::AnyBuffer counter = *out;  // replaced by the tile counter where the variant takes one
  if (ffi::Error e = CheckTileCounter(attrs, library->info, scratch, &args, &counter);
      e.failure()) {
    return e;
  }
  if (out->element_count() == 0) return ffi::Error::Success();  // b, sq or h is 0

  ScopedStreamDevice device(device_ordinal);
  if (args.seqlen_k == 0) {
    // lse of an empty row is its sink: a per-head fill, which jaxflash.attention does in XLA.
    if (args.sink != nullptr) {
      return Invalid(attrs, "seqlen_k is 0 and a sink is given: empty calls with a sink are "
                            "handled before the custom call (jaxflash.attention)");
    }
    return FillEmptyRows(Where(attrs), stream, *out, *lse);
  }

  args.q = q.untyped_data();
  args.k = k.untyped_data();
  args.v = v.untyped_data();
  args.out = out->untyped_data();
  args.lse = static_cast<float*>(lse->untyped_data());
  args.softmax_scale = softmax_scale;
  args.softcap = softcap;
  if (args.tile_counter != nullptr) {
    if (ffi::Error e = Zero(attrs, stream, "tile_counter", counter); e.failure()) return e;
  }
  if (int32_t status = library->fwd(&args, stream); status != 0) {
    return LaunchError(Where(attrs), status, q, k);
  }
  return ffi::Error::Success();
}

// Backward outputs and scratch against the (already checked) forward tensors.
ffi::Error CheckBwdBuffers(const CallAttrs& a, const JaxflashVariantInfo& info,
                           const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                           const ffi::AnyBuffer& v, const ffi::AnyBuffer& out,
                           const ffi::AnyBuffer& lse, const ffi::AnyBuffer& d_out,
                           const ffi::AnyBuffer& d_lse, const ffi::AnyBuffer& dq,
                           const ffi::AnyBuffer& dk, const ffi::AnyBuffer& dv,
                           const ffi::AnyBuffer& dq_accum, const ffi::AnyBuffer& lse_log2,
                           const ffi::AnyBuffer& delta, const ffi::AnyBuffer* dq_semaphore,
                           int32_t* dq_copies) {
  auto same = [&](const char* name, const ffi::AnyBuffer& buffer, const ffi::AnyBuffer& like) {
    auto d = like.dimensions();
    return d.size() == 4 ? CheckExact(a, name, buffer, {d[0], d[1], d[2], d[3]},
                                      like.element_type())
                         : CheckExact(a, name, buffer, {d[0], d[1], d[2]}, like.element_type());
  };
  struct Pair { const char* name; const ffi::AnyBuffer* buffer; const ffi::AnyBuffer* like; };
  for (const Pair& p : {Pair{"d_out", &d_out, &out}, Pair{"d_lse", &d_lse, &lse},
                        Pair{"dq", &dq, &q}, Pair{"dk", &dk, &k}, Pair{"dv", &dv, &v}}) {
    if (ffi::Error e = same(p.name, *p.buffer, *p.like); e.failure()) return e;
  }
  const int64_t tile_m = info.tile_m;
  auto qd = q.dimensions();
  const int64_t b = qd[0], sq = qd[1], h = qd[2];
  const int64_t sqr = (sq + tile_m - 1) / tile_m * tile_m;
  // The dQ accumulator holds 1 to max_dq_copies copies of sqr rows (config.dq_accum_copies
  // decides per call, the scratch shape carries it).
  const auto acc_dims = dq_accum.dimensions();
  int64_t copies = 1;
  if (acc_dims.size() == 4 && sqr > 0 && acc_dims[2] % sqr == 0 && acc_dims[2] / sqr >= 1 &&
      acc_dims[2] / sqr <= info.max_dq_copies) {
    copies = acc_dims[2] / sqr;
  }
  *dq_copies = static_cast<int32_t>(copies);
  const ffi::DataType f32 = ffi::DataType::F32;
  if (ffi::Error e = CheckExact(a, "dq_accum", dq_accum, {b, h, copies * sqr, a.head_dim}, f32);
      e.failure()) {
    return e;
  }
  if (ffi::Error e = CheckExact(a, "lse_log2", lse_log2, {b, h, sqr}, f32); e.failure()) return e;
  if (ffi::Error e = CheckExact(a, "delta", delta, {b, h, sqr}, f32); e.failure()) return e;
  if (a.deterministic != (dq_semaphore != nullptr)) {
    return Invalid(a, a.deterministic ? "a deterministic call needs the dq_semaphore result"
                                      : "dq_semaphore is a result of deterministic calls only");
  }
  if (dq_semaphore != nullptr) {
    return CheckExact(a, "dq_semaphore", *dq_semaphore, {b, h, copies * sqr / tile_m},
                      ffi::DataType::S32);
  }
  return ffi::Error::Success();
}

ffi::Error AttentionBwd(cudaStream_t stream, int32_t device_ordinal, ffi::AnyBuffer q,
                        ffi::AnyBuffer k, ffi::AnyBuffer v,
                        ffi::AnyBuffer out, ffi::AnyBuffer lse, ffi::AnyBuffer d_out,
                        ffi::AnyBuffer d_lse, ffi::RemainingArgs mask_operands,
                        ffi::Result<ffi::AnyBuffer> dq,
                        ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                        ffi::Result<ffi::AnyBuffer> dq_accum, ffi::Result<ffi::AnyBuffer> lse_log2,
                        ffi::Result<ffi::AnyBuffer> delta, ffi::RemainingRets semaphore,
                        std::string_view variant, float softmax_scale, bool causal,
                        int32_t window_left, int32_t window_right, float softcap,
                        int32_t head_dim, int32_t head_dim_v, bool deterministic) {
  const CallAttrs attrs{variant, softmax_scale, causal,     window_left,   window_right,
                        softcap, head_dim,      head_dim_v, kBwdTarget,    deterministic};
  const VariantLibrary* library = nullptr;
  if (ffi::Error e = FindLibrary(attrs, &library); e.failure()) return e;
  JaxflashFwdArgs shape{};
  if (ffi::Error e = CheckBuffers(attrs, library->info, q, k, v, out, lse, &shape);
      e.failure()) {
    return e;
  }
  // After delta: dq_semaphore (deterministic calls), then dbias (bias variants).
  const size_t want_rets = (deterministic ? 1 : 0) + (library->info.bias ? 1 : 0);
  if (semaphore.size() != want_rets) {
    return Invalid(attrs, std::to_string(6 + semaphore.size()) +
                              " results, expected dq, dk, dv, dq_accum, lse_log2, delta, then "
                              "dq_semaphore when deterministic and dbias for bias variants");
  }
  std::optional<ffi::Result<ffi::AnyBuffer>> sem;
  if (deterministic) {
    auto got = semaphore.get<ffi::AnyBuffer>(0);
    if (got.has_error()) return got.error();
    sem = got.value();
  }
  std::optional<ffi::Result<ffi::AnyBuffer>> dbias;
  if (library->info.bias) {
    auto got = semaphore.get<ffi::AnyBuffer>(want_rets - 1);
    if (got.has_error()) return got.error();
    dbias = got.value();
    if (ffi::Error e = CheckExact(attrs, "dbias", **dbias,
                                  {shape.batch, shape.num_heads, shape.seqlen_q,
                                   BiasRowLength(shape.seqlen_k)},
                                  q.element_type());
        e.failure()) {
      return e;
    }
  }
  int32_t dq_copies = 1;
  if (ffi::Error e = CheckBwdBuffers(attrs, library->info, q, k, v, out, lse, d_out, d_lse, *dq,
                                     *dk, *dv, *dq_accum, *lse_log2, *delta,
                                     sem ? &**sem : nullptr, &dq_copies);
      e.failure()) {
    return e;
  }
  JaxflashBwdArgs args{};
  if (ffi::Error e = CheckMask(attrs, library->info, mask_operands, shape.batch, shape.seqlen_q,
                               shape.seqlen_k, &args.mask, &args.window_left,
                               &args.window_right);
      e.failure()) {
    return e;
  }
  if (ffi::Error e = CheckBias(attrs, library->info, mask_operands,
                               library->info.deterministic ? 5 : 4, q.element_type(),
                               shape.batch, shape.num_heads, shape.seqlen_q, shape.seqlen_k,
                               &args.bias);
      e.failure()) {
    return e;
  }
  if (ffi::Error e = CheckModArrays(attrs, library->info, mask_operands,
                                    (library->info.deterministic ? 5 : 4) +
                                        (library->info.bias ? 1 : 0),
                                    &args.mods);
      e.failure()) {
    return e;
  }

  ScopedStreamDevice device(device_ordinal);
  // Empty problems launch nothing (a TMA descriptor cannot describe a zero-length tensor): no
  // keys gives dq = 0, no queries dk = dv = 0; the rest of an empty output is empty anyway.
  if (shape.batch == 0 || shape.num_heads == 0 || shape.seqlen_q == 0 || shape.seqlen_k == 0) {
    for (auto [name, buffer] : {std::pair{"dq", *dq}, std::pair{"dk", *dk},
                                std::pair{"dv", *dv}}) {
      if (buffer.size_bytes() == 0) continue;
      if (ffi::Error e = Zero(attrs, stream, name, buffer); e.failure()) return e;
    }
    if (dbias && (*dbias)->size_bytes() != 0) {
      if (ffi::Error e = Zero(attrs, stream, "dbias", **dbias); e.failure()) return e;
    }
    return ffi::Error::Success();
  }

  args.q = q.untyped_data();
  args.k = k.untyped_data();
  args.v = v.untyped_data();
  args.out = out.untyped_data();
  args.lse = static_cast<const float*>(lse.untyped_data());
  args.d_out = d_out.untyped_data();
  args.d_lse = static_cast<const float*>(d_lse.untyped_data());
  args.dq = dq->untyped_data();
  args.dk = dk->untyped_data();
  args.dv = dv->untyped_data();
  args.dq_accum = static_cast<float*>(dq_accum->untyped_data());
  args.lse_log2 = static_cast<float*>(lse_log2->untyped_data());
  args.delta = static_cast<float*>(delta->untyped_data());
  args.dq_semaphore = sem ? static_cast<int32_t*>((*sem)->untyped_data()) : nullptr;
  args.batch = shape.batch;
  args.seqlen_q = shape.seqlen_q;
  args.seqlen_k = shape.seqlen_k;
  args.num_heads = shape.num_heads;
  args.num_kv_heads = shape.num_kv_heads;
  args.head_dim = shape.head_dim;
  args.head_dim_v = shape.head_dim_v;
  args.softmax_scale = softmax_scale;
  args.softcap = softcap;
  args.dq_copies = dq_copies;
  if (dbias) {
    // The kernel writes every element inside seqlen_k: dS where a key tile visits a query
    // block, zeros where its mask skips one.
    args.bias.dbias = (*dbias)->untyped_data();
  }
  if (int32_t status = library->bwd(&args, stream); status != 0) {
    return LaunchError(Where(attrs), status, q, k);
  }
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// Split-KV decode (kernel_abi.h, JaxflashDecodeArgs): q (batch, num_kv_heads, rows, head_dim),
// k / v pages (num_pages, page_size, num_kv_heads, head_dim[_v]), page_table (batch, max_pages)
// and lengths (batch,) int32, sink (num_kv_heads, group) float32 in; out (batch, num_kv_heads,
// rows, head_dim_v) in q's dtype and lse (batch, num_kv_heads, rows) float32 out, with the
// scratch out_partial (batch, num_splits, num_kv_heads, rows, head_dim_v) and lse_partial
// (batch, num_splits, num_kv_heads, rows) float32. Variants over float8_e4m3fn caches
// (info.kv_fp8) take k / v in e4m3 and two more operands after the sink: k_descale and
// v_descale (num_pages, num_kv_heads) float32.

// The decode attributes against the variant library and q's dtype.
ffi::Error CheckDecodeAttrs(const CallAttrs& a, const JaxflashVariantInfo& info,
                            ffi::DataType dtype, int32_t seqlen_q) {
  if (ffi::Error e = CheckBuiltFor(a, info, dtype); e.failure()) return e;
  if (seqlen_q < 1) {
    return Invalid(a, "attribute seqlen_q=" + std::to_string(seqlen_q) +
                          ": expected >= 1 (the new tokens per sequence)");
  }
  if (ffi::Error e = CheckWindowSides(a); e.failure()) return e;
  return CheckSoftcapAndScale(a, /*takes_softcap=*/true);
}

// Ranks, dtypes and shapes of the decode buffers against the attributes and each other; fills
// the extents of `args`.
ffi::Error CheckDecodeBuffers(const CallAttrs& a, const JaxflashVariantInfo& info,
                              int32_t seqlen_q, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                              const ffi::AnyBuffer& v, const ffi::AnyBuffer& page_table,
                              const ffi::AnyBuffer& lengths, const ffi::AnyBuffer& sink,
                              const ffi::RemainingArgs& descales, const ffi::AnyBuffer& out,
                              const ffi::AnyBuffer& lse, const ffi::AnyBuffer& out_partial,
                              const ffi::AnyBuffer& lse_partial, JaxflashDecodeArgs* args) {
  struct Named { const char* name; const ffi::AnyBuffer* buffer; size_t rank; const char* layout; };
  for (const Named& n : {
           Named{"q", &q, 4, "(batch, num_kv_heads, rows, head_dim)"},
           Named{"k", &k, 4, "(num_pages, page_size, num_kv_heads, head_dim)"},
           Named{"v", &v, 4, "(num_pages, page_size, num_kv_heads, head_dim_v)"},
           Named{"page_table", &page_table, 2, "(batch, max_pages)"},
           Named{"lengths", &lengths, 1, "(batch,)"},
           Named{"sink", &sink, 2, "(num_kv_heads, group)"},
           Named{"out", &out, 4, "(batch, num_kv_heads, rows, head_dim_v)"},
           Named{"lse", &lse, 3, "(batch, num_kv_heads, rows)"},
           Named{"out_partial", &out_partial, 5,
                 "(batch, num_splits, num_kv_heads, rows, head_dim_v)"},
           Named{"lse_partial", &lse_partial, 4, "(batch, num_splits, num_kv_heads, rows)"}}) {
    if (n.buffer->dimensions().size() != n.rank) {
      return Invalid(a, std::string(n.name) + " has shape " + Shape(*n.buffer) +
                            ", expected rank " + std::to_string(n.rank) + ": " + n.layout);
    }
  }
  const ffi::DataType dtype = q.element_type();
  if (dtype != ffi::DataType::F16 && dtype != ffi::DataType::BF16) {
    return Invalid(a, std::string("q has ") + DtypeName(dtype) + ", accepted: float16, bfloat16");
  }
  // The caches: q's dtype, or e4m3 for info.kv_fp8 variants.
  const ffi::DataType kv_dtype = info.kv_fp8 ? ffi::DataType::F8E4M3FN : dtype;
  for (const Named& n : {Named{"k", &k, 4, ""}, Named{"v", &v, 4, ""}}) {
    if (n.buffer->element_type() != kv_dtype) {
      return Invalid(a, std::string(n.name) + " has " + DtypeName(n.buffer->element_type()) +
                            ", the variant reads " + DtypeName(kv_dtype) + " caches (q has " +
                            DtypeName(dtype) + ")");
    }
  }
  if (ffi::Error e = CheckDecodeAttrs(a, info, dtype, seqlen_q); e.failure()) return e;

  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  const int64_t b = qd[0], hk = qd[1], rows = qd[2];
  const int64_t pages = kd[0], page_size = kd[1];
  const bool ok_q = qd[3] == a.head_dim;
  const bool ok_k = kd[2] == hk && kd[3] == a.head_dim;
  const bool ok_v = vd[0] == pages && vd[1] == page_size && vd[2] == hk && vd[3] == a.head_dim_v;
  if (!ok_q || !ok_k || !ok_v) {
    return Invalid(a, "q " + Shape(q) + ", k " + Shape(k) + ", v " + Shape(v) +
                          " do not fit q (batch, num_kv_heads, rows, " +
                          std::to_string(a.head_dim) + "), k (num_pages, page_size, "
                          "num_kv_heads, " + std::to_string(a.head_dim) + "), v (num_pages, "
                          "page_size, num_kv_heads, " + std::to_string(a.head_dim_v) + ")");
  }
  if (rows % seqlen_q != 0) {
    return Invalid(a, "q has " + std::to_string(rows) + " rows, not a multiple of seqlen_q " +
                          std::to_string(seqlen_q) + " (rows = seqlen_q * query heads per kv "
                          "head)");
  }
  const ffi::DataType s32 = ffi::DataType::S32, f32 = ffi::DataType::F32;
  auto pd = page_table.dimensions();
  if (page_table.element_type() != s32 || pd[0] != b) {
    return Invalid(a, std::string("page_table is ") + DtypeName(page_table.element_type()) + " " +
                          Shape(page_table) + ", expected int32 (" + std::to_string(b) +
                          ", max_pages): batch as q's");
  }
  // Pages smaller than a key block go in boxes of 16 rows, which must not straddle pages, and
  // a key block must start at a page boundary: powers of two from 16 (a single page, e.g. a
  // contiguous cache, may have any size).
  if ((page_size < 16 || (page_size & (page_size - 1)) != 0) && pd[1] > 1) {
    return Invalid(a, "k has page_size " + std::to_string(page_size) + " (dim 1), expected a "
                          "power of two >= 16 when page_table has more than one column");
  }
  const int64_t max_pages = pd[1];
  // No page-table column: contiguous caches, sequence b in page b.
  if (max_pages == 0 && pages != b) {
    return Invalid(a, "page_table " + Shape(page_table) + " has no column (contiguous caches) "
                          "but k " + Shape(k) + " does not hold one page per sequence");
  }
  if (ffi::Error e = CheckExact(a, "lengths", lengths, {b}, s32); e.failure()) return e;
  // No sink: (num_kv_heads, 0).
  const int64_t sink_group = sink.element_count() == 0 ? 0 : rows / seqlen_q;
  if (ffi::Error e = CheckExact(a, "sink", sink, {hk, sink_group}, f32); e.failure()) {
    return e;
  }
  if (ffi::Error e = CheckExact(a, "out", out, {b, hk, rows, a.head_dim_v}, dtype); e.failure()) {
    return e;
  }
  if (ffi::Error e = CheckExact(a, "lse", lse, {b, hk, rows}, f32); e.failure()) return e;
  const int64_t splits = out_partial.dimensions()[1];
  if (ffi::Error e = CheckExact(a, "out_partial", out_partial,
                                {b, splits, hk, rows, a.head_dim_v}, f32);
      e.failure()) {
    return e;
  }
  if (ffi::Error e = CheckExact(a, "lse_partial", lse_partial, {b, splits, hk, rows}, f32);
      e.failure()) {
    return e;
  }
  const size_t want_descales = info.kv_fp8 ? 2 : 0;
  if (descales.size() != want_descales) {
    return Invalid(a, std::to_string(descales.size()) + " operands after the sink, expected " +
                          std::to_string(want_descales) + (info.kv_fp8 ? " (k_descale, v_descale)"
                                                                        : ""));
  }
  const char* descale_names[] = {"k_descale", "v_descale"};
  for (size_t i = 0; i < want_descales; ++i) {
    auto got = descales.get<ffi::AnyBuffer>(i);
    if (got.has_error()) return got.error();
    // A row per page; contiguous caches: per sequence (their pages).
    if (ffi::Error e = CheckExact(a, descale_names[i], *got, {pages, hk}, f32); e.failure()) {
      return e;
    }
  }
  for (int64_t d : {b, rows, hk, pages, page_size, max_pages, splits}) {
    // The kernel ABI takes int32 extents; larger ones would silently wrap.
    if (d > std::numeric_limits<int32_t>::max()) {
      return Invalid(a, "dimension " + std::to_string(d) + " exceeds the int32 range");
    }
  }
  // The grid is (row tiles, splits, batch * kv heads): CUDA caps gridDim.y and .z at 65535.
  if (splits > 65535) {
    return Invalid(a, "num_splits " + std::to_string(splits) + " (out_partial dim 1) exceeds "
                          "65535");
  }
  if (b * hk > 65535) {
    return Invalid(a, "batch * num_kv_heads = " + std::to_string(b) + " * " + std::to_string(hk) +
                          " exceeds 65535; split the call over batch");
  }
  args->batch = static_cast<int32_t>(b);
  args->rows = static_cast<int32_t>(rows);
  args->num_kv_heads = static_cast<int32_t>(hk);
  args->head_dim = a.head_dim;
  args->head_dim_v = a.head_dim_v;
  args->num_pages = static_cast<int32_t>(pages);
  args->page_size = static_cast<int32_t>(page_size);
  args->max_pages = static_cast<int32_t>(max_pages);
  args->num_splits = static_cast<int32_t>(splits);
  args->seqlen_q = seqlen_q;
  return ffi::Error::Success();
}

ffi::Error KvCacheAttention(cudaStream_t stream, int32_t device_ordinal, ffi::AnyBuffer q,
                            ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer page_table,
                            ffi::AnyBuffer lengths, ffi::AnyBuffer sink,
                            ffi::RemainingArgs descales, ffi::Result<ffi::AnyBuffer> out,
                            ffi::Result<ffi::AnyBuffer> lse,
                            ffi::Result<ffi::AnyBuffer> out_partial,
                            ffi::Result<ffi::AnyBuffer> lse_partial, std::string_view variant,
                            float softmax_scale, int32_t seqlen_q, int32_t window_left,
                            int32_t window_right, float softcap, int32_t head_dim,
                            int32_t head_dim_v) {
  // Causal is window_right = 0: the attribute stays false.
  const CallAttrs attrs{variant, softmax_scale, false,      window_left,  window_right,
                        softcap, head_dim,      head_dim_v, kDecodeTarget};
  const VariantLibrary* library = nullptr;
  if (ffi::Error e = FindLibrary(attrs, &library); e.failure()) return e;
  JaxflashDecodeArgs args{};
  if (ffi::Error e = CheckDecodeBuffers(attrs, library->info, seqlen_q, q, k, v, page_table,
                                        lengths, sink, descales, *out, *lse, *out_partial,
                                        *lse_partial, &args);
      e.failure()) {
    return e;
  }
  // batch, rows or num_kv_heads is 0: nothing to write.
  if (out->element_count() == 0) return ffi::Error::Success();
  // Chunked-prefill variants (128-row tiles, kernels/chunked_sm90.py) write out and lse per
  // tile and take partials of 0 splits; the split-KV ones at least one split.
  const bool chunked = library->info.tile_m > 64;
  if (chunked != (args.num_splits == 0)) {
    return Invalid(attrs, "out_partial " + Shape(*out_partial) + " has " +
                              std::to_string(args.num_splits) + " splits (dim 1); the variant " +
                              (chunked ? "is a chunked one, which takes 0"
                                       : "splits the keys, it needs at least 1"));
  }
  if (args.num_pages == 0 || args.page_size == 0) {
    // TMA cannot describe an empty cache; jaxflash computes such calls without the kernel
    // (jaxflash/decode_kernel.py).
    return Invalid(attrs, "an empty cache (k " + Shape(k) + ", page_table " +
                              Shape(page_table) + "): the kernel needs keys to read");
  }

  ScopedStreamDevice device(device_ordinal);
  args.q = q.untyped_data();
  args.k = k.untyped_data();
  args.v = v.untyped_data();
  args.page_table = static_cast<const int32_t*>(page_table.untyped_data());
  args.lengths = static_cast<const int32_t*>(lengths.untyped_data());
  args.out_partial = static_cast<float*>(out_partial->untyped_data());
  args.lse_partial = static_cast<float*>(lse_partial->untyped_data());
  args.sink = sink.element_count() == 0 ? nullptr : static_cast<const float*>(sink.untyped_data());
  args.out = out->untyped_data();
  args.lse = static_cast<float*>(lse->untyped_data());
  args.softmax_scale = softmax_scale;
  args.window_left = window_left;
  args.window_right = window_right;
  args.softcap = softcap;
  if (library->info.kv_fp8) {
    args.k_descale = static_cast<const float*>(descales.get<ffi::AnyBuffer>(0)->untyped_data());
    args.v_descale = static_cast<const float*>(descales.get<ffi::AnyBuffer>(1)->untyped_data());
  }
  if (int32_t status = library->decode(&args, stream); status != 0) {
    return LaunchError(Where(attrs), status, q, k);
  }
  return ffi::Error::Success();
}

// The instantiate stage of `target`: registers the call's variant from the kernel folders
// unless Python already did (jaxflash.attention's lowering does; a deserialized program's calls
// arrive here).
ffi::Error LoadCallVariant(std::string_view target, ffi::Dictionary attrs) {
  ffi::ErrorOr<std::string_view> variant = attrs.get<std::string_view>("variant");
  if (variant.has_error()) return variant.error();
  if (std::string error = RegisterFromFolders(*variant); !error.empty()) {
    return VariantMissing(Where(target, *variant), *variant, error);
  }
  return ffi::Error::Success();
}

// One instantiate handler per target, so that its errors name the target like execute's do.
ffi::Error LoadFwdCallVariant(ffi::Dictionary attrs) { return LoadCallVariant(kFwdTarget, attrs); }
ffi::Error LoadBwdCallVariant(ffi::Dictionary attrs) { return LoadCallVariant(kBwdTarget, attrs); }
ffi::Error LoadDecodeCallVariant(ffi::Dictionary attrs) {
  return LoadCallVariant(kDecodeTarget, attrs);
}

// What every execute binding below starts with: the stream XLA runs the call on, the device of
// that stream, and the operands q, k, v (their layouts: each binding's comment).
auto BindStreamAndQkv() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()  // stream XLA runs this call on
      .Ctx<ffi::DeviceOrdinal>()                 // the device of that stream
      .Arg<ffi::AnyBuffer>()                     // q
      .Arg<ffi::AnyBuffer>()                     // k
      .Arg<ffi::AnyBuffer>();                    // v
}

// The attributes of the forward target (config.FWD_ATTRIBUTE_NAMES, CallAttrs), bound after the
// buffers of `binding`; the backward target binds them too, then deterministic.
template <typename Binding>
auto BindAttentionAttrs(Binding binding) {
  return std::move(binding)
      .template Attr<std::string_view>("variant")  // KernelVariant.key of the kernel to run
      .template Attr<float>("softmax_scale")       // multiplies q.k before the softmax
      .template Attr<bool>("causal")               // bottom-right aligned causal mask
      .template Attr<int32_t>("window_left")       // keys visible left of the diagonal, 2^30: all
      .template Attr<int32_t>("window_right")      // keys visible right of the diagonal, 2^30: all
      .template Attr<float>("softcap")             // softcap * tanh(s / softcap); 0: off
      .template Attr<int32_t>("head_dim")          // q/k head dim the variant was built for
      .template Attr<int32_t>("head_dim_v");       // v/out head dim the variant was built for
}

}  // namespace
}  // namespace jaxflash

extern "C" {

// Initializes this library's CUDA runtime and driver entry points. Python calls it once on a
// GPU host, before any handler runs, so that no first-time initialization happens inside
// CUDA-graph capture. 0 on success, else the cudaError_t.
int32_t jaxflash_ffi_prepare(void) {
  int device = 0;
  cudaError_t status = cudaGetDevice(&device);
  if (status == cudaSuccess && jaxflash::GetMemsetD32() == nullptr) status = cudaErrorUnknown;
  return static_cast<int32_t>(status);
}

}  // extern "C"

// Instantiate stage of each target: XLA calls it once per custom call when it creates the
// executable's thunks, before the first run and before any command-buffer recording. It loads
// the call's variant library (dlopen and module load), so that execute only looks the variant
// up and launches: nothing in execute is illegal under stream capture, which is what lets the
// handlers below be recorded into XLA's command buffers (CUDA graphs).
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxflashAttentionFwdInstantiate, jaxflash::LoadFwdCallVariant,
    ffi::Ffi::BindInstantiate().Attrs());
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxflashAttentionBwdInstantiate, jaxflash::LoadBwdCallVariant,
    ffi::Ffi::BindInstantiate().Attrs());
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxflashKvCacheAttentionInstantiate, jaxflash::LoadDecodeCallVariant,
    ffi::Ffi::BindInstantiate().Attrs());

// Command-buffer compatible: each call launches the same device work for the same attributes
// and buffer shapes (Python registers the targets with that trait).
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxflashAttentionFwd, jaxflash::AttentionFwd,
    jaxflash::BindAttentionAttrs(
        jaxflash::BindStreamAndQkv()  // q (batch, seqlen_q, num_heads, head_dim),
                                      // k (batch, seqlen_k, num_kv_heads, head_dim),
                                      // v (batch, seqlen_k, num_kv_heads, head_dim_v)
            .RemainingArgs()          // masked: JaxflashMask operands; bias variants: the
                                      // bias (b|1, h|1, sq|1, sk rounded up to 8) in q's
                                      // dtype; mods variants: their arrays
                                      // (JaxflashModArrays); then, optional, the sink
                                      // (num_heads,) float32
            .Ret<ffi::AnyBuffer>()    // out (batch, seqlen_q, num_heads, head_dim_v)
            .Ret<ffi::AnyBuffer>()    // lse (batch, num_heads, seqlen_q) float32
            .RemainingRets()),        // dynamic schedules: tile_counter (1,) int32
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxflashAttentionBwd, jaxflash::AttentionBwd,
    jaxflash::BindAttentionAttrs(
        jaxflash::BindStreamAndQkv()  // q (batch, seqlen_q, num_heads, head_dim),
                                      // k (batch, seqlen_k, num_kv_heads, head_dim),
                                      // v (batch, seqlen_k, num_kv_heads, head_dim_v)
            .Arg<ffi::AnyBuffer>()    // out   (batch, seqlen_q, num_heads, head_dim_v)
            .Arg<ffi::AnyBuffer>()    // lse   (batch, num_heads, seqlen_q) float32
            .Arg<ffi::AnyBuffer>()    // d_out (like out)
            .Arg<ffi::AnyBuffer>()    // d_lse (like lse)
            .RemainingArgs()          // masked variants: JaxflashMask operands; bias
                                      // variants: then the bias (b|1, h|1, sq|1, sk rounded
                                      // up to 8)
            .Ret<ffi::AnyBuffer>()    // dq    (like q)
            .Ret<ffi::AnyBuffer>()    // dk    (like k), summed over a GQA group
            .Ret<ffi::AnyBuffer>()    // dv    (like v)
            .Ret<ffi::AnyBuffer>()    // dq_accum (batch, heads, sq_rounded, d) f32
            .Ret<ffi::AnyBuffer>()    // lse_log2 (batch, heads, sq_rounded) f32
            .Ret<ffi::AnyBuffer>()    // delta    (batch, heads, sq_rounded) f32
            .RemainingRets())         // dq_semaphore int32, deterministic only; dbias
                                      // (b, h, sq, sk rounded up to 8) in q's dtype, bias
                                      // variants only
        .Attr<bool>("deterministic"),  // dq accumulated in a fixed order
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxflashKvCacheAttention, jaxflash::KvCacheAttention,
    jaxflash::BindStreamAndQkv()  // q (batch, num_kv_heads, rows, head_dim),
                                  // k (num_pages, page_size, num_kv_heads, head_dim),
                                  // v (num_pages, page_size, num_kv_heads, head_dim_v)
        .Arg<ffi::AnyBuffer>()                     // page_table (batch, max_pages) int32; no
                                                   // column: contiguous caches
        .Arg<ffi::AnyBuffer>()                     // lengths    (batch,) int32
        .Arg<ffi::AnyBuffer>()                     // sink (num_kv_heads, group or 0: none) f32
        .RemainingArgs()                           // e4m3 caches: k_descale, v_descale
                                                   // (num_pages, num_kv_heads) f32
        .Ret<ffi::AnyBuffer>()                     // out (batch, num_kv_heads, rows, dv), q's dtype
        .Ret<ffi::AnyBuffer>()                     // lse (batch, num_kv_heads, rows) f32
        .Ret<ffi::AnyBuffer>()                     // out_partial (batch, splits, hk, rows, dv) f32
        .Ret<ffi::AnyBuffer>()                     // lse_partial (batch, splits, hk, rows) f32
        .Attr<std::string_view>("variant")         // KernelVariant.key of the kernel to run
        .Attr<float>("softmax_scale")              // multiplies q.k before the softmax
        .Attr<int32_t>("seqlen_q")                 // new tokens per sequence (rows / group)
        .Attr<int32_t>("window_left")              // keys visible left of a query, 2^30: all
        .Attr<int32_t>("window_right")             // keys visible right of a query; 0: causal
        .Attr<float>("softcap")                    // softcap * tanh(s / softcap); 0: off
        .Attr<int32_t>("head_dim")                 // q/k head dim the variant was built for
        .Attr<int32_t>("head_dim_v"),              // v/out head dim the variant was built for
    {ffi::Traits::kCmdBufferCompatible});
