"""KernelVariant -> fake-tensor signature -> cute.compile for sm_90a -> export_to_c (header, .o).

Imports cutlass, the stdlib, jaxflash.config and the kernel classes (never jax). Runs on a host
without a GPU; docs/build.md describes the pipeline.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import pathlib
import re
import struct
import threading
import time

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

from jaxflash import config
from jaxflash.kernels import mod_codegen
from jaxflash.kernels.bwd_postprocess import FlashAttentionBackwardPostprocess
from jaxflash.kernels.bwd_preprocess import FlashAttentionBackwardPreprocess
from jaxflash.kernels.bwd_sm90 import FlashAttentionBackwardSm90
from jaxflash.kernels.chunked_sm90 import FlashAttentionChunkedSm90
from jaxflash.kernels.decode_sm90 import FlashAttentionDecodeSm90
from jaxflash.kernels.fwd_fp8_sm90 import FlashAttentionForwardFp8Sm90
from jaxflash.kernels.fwd_sm90 import FlashAttentionForwardSm90
from jaxflash.kernels.sm90_gemm import DTYPES

_GPU_ARCH = {"sm90a": "sm_90a"}
# TMA needs 16-byte aligned base addresses; XLA buffers are at least that aligned.
_ASSUMED_ALIGN = 16
_runtime_lock = threading.Lock()
_runtime_loaded = False


@dataclasses.dataclass(frozen=True)
class ExportedKernel:
  """What `export_variant` wrote: link `object_path`, include `header_path`.

  The header declares `<function_prefix>_Kernel_Module_Load/Unload` and
  `cute_dsl_<function_prefix>_wrapper(...)`; `cubin` is the embedded device code (for SASS
  inspection), `compile_seconds` the wall time of cute.compile + export. `defines` are the
  -D flags that compile the variant's glue (`glue_source`: variant_fwd.cc, variant_bwd.cc or
  variant_decode.cc by direction; see the top of that file).
  """

  variant: config.KernelVariant
  header_path: pathlib.Path
  object_path: pathlib.Path
  function_prefix: str
  cubin: bytes
  compile_seconds: float
  defines: tuple[str, ...]
  # Backward variants link three exported objects: object_path / header_path / cubin are the
  # main kernel's, these the preprocess and postprocess ones (in that order).
  extra_object_paths: tuple[pathlib.Path, ...] = ()
  extra_cubins: tuple[bytes, ...] = ()
  glue_source: str = "variant_fwd.cc"


def function_prefix(variant: config.KernelVariant) -> str:
  """C identifier unique per variant key (several variants may link into one library)."""
  return "jaxflash_" + re.sub(r"[^0-9A-Za-z]", "_", variant.key)


def load_dsl_runtime() -> None:
  """Loads libcute_dsl_runtime.so with RTLD_GLOBAL once per process (docs/build.md).

  Call it before the first cute.compile of the process (export_variant does).

  Without it export_to_c fails on a driverless host ("Symbols not found: _cuKernelGetAttribute").
  """
  global _runtime_loaded
  with _runtime_lock:
    if _runtime_loaded:
      return
    ctypes.CDLL(load_dsl_runtime_path(), mode=ctypes.RTLD_GLOBAL)
    _runtime_loaded = True


def load_dsl_runtime_path() -> str:
  """Path of libcute_dsl_runtime.so; its folder also holds libcuda_dialect_runtime_static.a."""
  found = [p for p in cute.runtime.find_runtime_libraries(enable_tvm_ffi=False)
           if os.path.basename(p) == "libcute_dsl_runtime.so" and os.path.exists(p)]
  if not found:
    raise RuntimeError("libcute_dsl_runtime.so not found in the nvidia-cutlass-dsl install")
  return found[0]


def _dense(shape, last_dim, dtype):
  """A fake dense (b, s, h, last_dim) tensor: every non-unit stride is a 64-bit SymInt and a
  multiple of last_dim, in mode order, with a unit last stride (how the C glue fills them)."""
  strides = tuple(cute.sym_int64(divisibility=last_dim) for _ in shape[:-2]) + (last_dim, 1)
  return make_fake_tensor(dtype, shape, strides, assumed_align=_ASSUMED_ALIGN)


def mask_signature(batch, row_tile: int, col_tile: int):
  """Fake run-time mask operands of a masked variant (block_ranges.py), by argument name:
  row_ids (batch, tiles * row_tile) and col_ids (batch, blocks * col_tile) int32 segment ids
  padded to whole tiles / blocks of the tiled side and the other; ranges (batch, tiles, 4)
  int32; order (batch * tiles,) int32; window_left / window_right Int32 scalars; softcap a
  Float32 scalar (0: off)."""
  rows = cute.sym_int32(divisibility=row_tile)
  cols = cute.sym_int32(divisibility=col_tile)
  tiles = cute.sym_int32()
  ids = lambda n: make_fake_tensor(cutlass.Int32, (batch, n), (cute.sym_int64(), 1),
                                   assumed_align=_ASSUMED_ALIGN)
  return dict(
      row_ids=ids(rows), col_ids=ids(cols),
      ranges=make_fake_tensor(cutlass.Int32, (batch, tiles, 4), (cute.sym_int64(), 4, 1),
                              assumed_align=_ASSUMED_ALIGN),
      order=make_fake_tensor(cutlass.Int32, (cute.sym_int32(),), (1,),
                             assumed_align=_ASSUMED_ALIGN),
      window_left=cutlass.Int32(0), window_right=cutlass.Int32(0),
      softcap=cutlass.Float32(0.0))


# A dense variant's mask operands: None each.
_NO_MASK = dict.fromkeys(("row_ids", "col_ids", "ranges", "order", "window_left",
                          "window_right", "softcap"))


def takes_tile_counter(variant: config.KernelVariant) -> bool:
  """Whether the variant's kernel claims its tiles from a counter (a dynamic forward schedule)."""
  return variant.direction == "fwd" and getattr(variant.schedule, "dynamic", False)


# A bias variant's bias operands, in argument order (None each for other variants).
BIAS_ARGUMENTS = ("bias", "bias_batch_planes", "bias_head_planes", "bias_query_step")


def bias_signature(variant: config.KernelVariant, batch, num_heads, seqlen_q, seqlen_k) -> dict:
  """Fake bias operands of a variant, by name (BIAS_ARGUMENTS, and the backward's dbias); None
  each for variants without a bias. bias: the (rows, seqlen_k, planes) view of the buffer (a
  plane per (batch, head) it does not broadcast, rows: its queries or 1; kernels/bias.py),
  whose row stride is the buffer's last extent, a multiple of 8 (16-byte rows for TMA); the
  plane and row steps are Int32 scalars (the C glue's BiasPlanes fills all four). dbias
  (backward): (batch, num_heads, seqlen_q, seqlen_k) in the input dtype, dense with rows of
  that same padded length."""
  if not variant.bias:
    return dict.fromkeys(BIAS_ARGUMENTS + ("dbias",))
  dtype = DTYPES[variant.dtype]
  out = dict(
      bias=make_fake_tensor(dtype, (cute.sym_int32(), seqlen_k, cute.sym_int32()),
                            (cute.sym_int64(divisibility=8), 1, cute.sym_int64(divisibility=8)),
                            assumed_align=_ASSUMED_ALIGN),
      bias_batch_planes=cutlass.Int32(0), bias_head_planes=cutlass.Int32(0),
      bias_query_step=cutlass.Int32(1))
  if variant.direction == "bwd":
    strides = tuple(cute.sym_int64(divisibility=8) for _ in range(3)) + (1,)
    out["dbias"] = make_fake_tensor(dtype, (batch, num_heads, seqlen_q, seqlen_k), strides,
                                    assumed_align=_ASSUMED_ALIGN)
  return out


def mod_array_tensors(variant: config.KernelVariant) -> tuple:
  """Fake closed-over arrays of a mods variant (config.MOD_MAX_ARRAYS slots, None past the
  last): each of its own element type and rank (rank 0 as (1,)), every extent dynamic, dense
  row-major with dynamic 64-bit strides and a unit last stride."""
  arrays = mod_codegen.parse(variant.mods)["arrays"] if variant.mods else ()
  tensors = []
  for dtype, rank in arrays:
    element = mod_codegen.storage_type(dtype)
    rank = max(rank, 1)
    tensors.append(make_fake_tensor(
        element, tuple(cute.sym_int32() for _ in range(rank)),
        tuple(cute.sym_int64() for _ in range(rank - 1)) + (1,),
        assumed_align=max(element.width // 8, 1)))
  return tuple(tensors) + (None,) * (config.MOD_MAX_ARRAYS - len(tensors))


def fwd_signature(variant: config.KernelVariant):
  """Fake (q, k, v, out, lse, sink, q_ids, k_ids, ranges, order, tile_counter, *BIAS_ARGUMENTS,
  mod arrays) operands and the (window_left, window_right, softcap) scalars of the forward
  kernel; shapes dynamic, head dims static. The mask operands and softcap are None for dense
  variants, the tile counter ((1,) int32) for static schedules, the bias operands for variants
  without one (bias_signature); sink (num_heads,) float32 is there for every variant. The mod
  arrays are a tuple (mod_array_tensors, config.MOD_MAX_ARRAYS slots, None past the last).

  Extents that must be equal share one SymInt. Strides are explicit 64-bit SymInts in mode
  order (batch, seq, heads) for q/k/v/out and (batch, heads) for lse, with a unit last stride:
  that is exactly the `dynamic_strides` order of the exported tensor structs (the C glue fills
  them from the dense row-major shapes).
  """
  dtype = DTYPES[variant.dtype]
  d, dv = variant.head_dim, variant.head_dim_v
  batch, seqlen_q, seqlen_k = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
  num_heads, num_kv_heads = cute.sym_int32(), cute.sym_int32()
  q = _dense((batch, seqlen_q, num_heads, d), d, dtype)
  k = _dense((batch, seqlen_k, num_kv_heads, d), d, dtype)
  v = _dense((batch, seqlen_k, num_kv_heads, dv), dv, dtype)
  out = _dense((batch, seqlen_q, num_heads, dv), dv, dtype)
  lse = make_fake_tensor(cutlass.Float32, (batch, num_heads, seqlen_q),
                         (cute.sym_int64(), cute.sym_int64(), 1), assumed_align=_ASSUMED_ALIGN)
  # The learnable sink: one logit per query head, read only when has_sink (run time) is 1.
  sink = make_fake_tensor(cutlass.Float32, (cute.sym_int32(),), (1,), assumed_align=4)
  masking = (mask_signature(batch, variant.schedule.tile_m, variant.schedule.tile_n)
             if variant.masked else _NO_MASK)
  counter = (make_fake_tensor(cutlass.Int32, (cute.sym_int32(),), (1,), assumed_align=4)
             if takes_tile_counter(variant) else None)
  bias = bias_signature(variant, batch, num_heads, seqlen_q, seqlen_k)
  return (q, k, v, out, lse, sink, masking["row_ids"], masking["col_ids"], masking["ranges"],
          masking["order"], counter, *(bias[name] for name in BIAS_ARGUMENTS),
          mod_array_tensors(variant), masking["window_left"], masking["window_right"],
          masking["softcap"])


def fp8_fwd_signature(variant: config.KernelVariant):
  """Fake (q, k, v, out, lse, sink, q_descale, kv_descale) of the FP8 forward: e4m3 q, k, v,
  bf16 out (it carries float16 bits when the kernel's out_float16 is 1), q_descale (batch,
  num_heads, q chunks) and kv_descale (batch, num_kv_heads, 4 * key chunks) float32 (chunk
  extents dynamic, as the C glue's Dense3 fills them); the rest as fwd_signature."""
  fp8, d, dv = cutlass.Float8E4M3FN, variant.head_dim, variant.head_dim_v
  batch, seqlen_q, seqlen_k = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
  num_heads, num_kv_heads = cute.sym_int32(), cute.sym_int32()
  q = _dense((batch, seqlen_q, num_heads, d), d, fp8)
  k = _dense((batch, seqlen_k, num_kv_heads, d), d, fp8)
  v = _dense((batch, seqlen_k, num_kv_heads, dv), dv, fp8)
  out = _dense((batch, seqlen_q, num_heads, dv), dv, cutlass.BFloat16)
  lse = make_fake_tensor(cutlass.Float32, (batch, num_heads, seqlen_q),
                         (cute.sym_int64(), cute.sym_int64(), 1), assumed_align=_ASSUMED_ALIGN)
  sink = make_fake_tensor(cutlass.Float32, (cute.sym_int32(),), (1,), assumed_align=4)
  # 16-byte aligned: each key block's chunk values leave by one bulk copy.
  q_descale = make_fake_tensor(cutlass.Float32, (batch, num_heads, cute.sym_int32()),
                               (cute.sym_int64(), cute.sym_int64(), 1), assumed_align=16)
  kv_descale = make_fake_tensor(cutlass.Float32, (batch, num_kv_heads, cute.sym_int32()),
                                (cute.sym_int64(), cute.sym_int64(), 1), assumed_align=16)
  return q, k, v, out, lse, sink, q_descale, kv_descale


def decode_signature(variant: config.KernelVariant):
  """Fake (q, k, v, page_table, lengths, sink, out_partial, lse_partial, out, lse, k_descale,
  v_descale) tensors of the split-KV decode call (kernel_abi.h, JaxflashDecodeArgs); shapes
  dynamic, head dims static:

    q           (batch, num_kv_heads, rows, d)              fp16/bf16
    k           (num_pages, page_size, num_kv_heads, d)     same dtype, or e4m3 (kv_dtype)
    v           (num_pages, page_size, num_kv_heads, dv)    as k
    page_table  (batch, max_pages)                          int32
    lengths     (batch,)                                    int32
    sink        (num_kv_heads, group)                       float32
    out_partial (batch, num_splits, num_kv_heads, rows, dv) float32
    lse_partial (batch, num_splits, num_kv_heads, rows)     float32
    out         (batch, num_kv_heads, rows, dv)             q's dtype
    lse         (batch, num_kv_heads, rows)                 float32
    k_descale   (descale_rows, num_kv_heads)                float32 (read by e4m3 variants)
    v_descale   (descale_rows, num_kv_heads)                float32

  Extents that must be equal share one SymInt (batch, rows, num_kv_heads, num_splits, and
  num_pages / page_size of k and v). page_size may be any size with one page per sequence (a
  contiguous cache), else a power of two from 16 (the glue checks it). Every tensor is dense
  row-major with a unit last stride; its other strides are 64-bit SymInts in mode order, but
  that of the mode before a static head dim, which is the head dim (the C glue's Dense fills
  them so). q, k, v, the outputs and the float32 partials are 16-byte aligned, the page table,
  lengths and sink 4-byte.
  """
  dtype = DTYPES[variant.dtype]
  d, dv = variant.head_dim, variant.head_dim_v
  batch, rows, num_kv_heads = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
  num_pages, page_size = cute.sym_int32(), cute.sym_int32()
  max_pages, num_splits, group = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()

  def dense(shape, inner, dt, align):
    """Dense row-major: dynamic strides for the leading modes, `inner` (a static head dim, or
    1) for the last dynamic one, 1 for the last."""
    if inner == 1:  # the last mode is a dynamic extent with a unit stride
      strides = tuple(cute.sym_int64() for _ in shape[:-1]) + (1,)
    else:  # (..., rows or kv heads, head dim)
      strides = tuple(cute.sym_int64(divisibility=inner) for _ in shape[:-2]) + (inner, 1)
    return make_fake_tensor(dt, shape, strides, assumed_align=align)

  kv_dtype = dtype if variant.kv_dtype is None else DTYPES[variant.kv_dtype]
  q = dense((batch, num_kv_heads, rows, d), d, dtype, _ASSUMED_ALIGN)
  k = dense((num_pages, page_size, num_kv_heads, d), d, kv_dtype, _ASSUMED_ALIGN)
  v = dense((num_pages, page_size, num_kv_heads, dv), dv, kv_dtype, _ASSUMED_ALIGN)
  page_table = dense((batch, max_pages), 1, cutlass.Int32, 4)
  lengths = make_fake_tensor(cutlass.Int32, (batch,), (1,), assumed_align=4)
  sink = dense((num_kv_heads, group), 1, cutlass.Float32, 4)
  out_partial = dense((batch, num_splits, num_kv_heads, rows, dv), dv, cutlass.Float32,
                      _ASSUMED_ALIGN)
  lse_partial = dense((batch, num_splits, num_kv_heads, rows), 1, cutlass.Float32,
                      _ASSUMED_ALIGN)
  out = dense((batch, num_kv_heads, rows, dv), dv, dtype, _ASSUMED_ALIGN)
  lse = dense((batch, num_kv_heads, rows), 1, cutlass.Float32, _ASSUMED_ALIGN)
  # Pages of a pool, or sequences of contiguous caches: the glue passes either (NULL and no
  # row for 16-bit caches).
  descale_rows = cute.sym_int32()
  k_descale = dense((descale_rows, num_kv_heads), 1, cutlass.Float32, 4)
  v_descale = dense((descale_rows, num_kv_heads), 1, cutlass.Float32, 4)
  return (q, k, v, page_table, lengths, sink, out_partial, lse_partial, out, lse, k_descale,
          v_descale)


def _checked(variant: config.KernelVariant, kernel_class) -> config.KernelVariant:
  """`variant`, or ValueError when its arch has no compiler target or the kernel refuses it."""
  if variant.arch not in _GPU_ARCH:
    raise ValueError(f"variant.arch: {variant.arch!r} unsupported; accepted: {tuple(_GPU_ARCH)}")
  ok, reason = kernel_class.can_implement(variant)
  if not ok:
    raise ValueError(f"variant {variant.key}: {reason}")
  return variant


def build_kernel(variant: config.KernelVariant) -> FlashAttentionForwardSm90:
  """The forward kernel object of a variant, or ValueError with the reason."""
  if variant.dtype == config.FP8_DTYPE:
    return FlashAttentionForwardFp8Sm90(_checked(variant, FlashAttentionForwardFp8Sm90))
  return FlashAttentionForwardSm90(_checked(variant, FlashAttentionForwardSm90))


def build_decode_kernel(variant: config.KernelVariant) -> FlashAttentionDecodeSm90:
  """The kernel object of a decode-direction variant (split-KV decode, or chunked prefill when
  its schedule is chunked), or ValueError with the reason."""
  kernel_class = (FlashAttentionChunkedSm90 if getattr(variant.schedule, "chunked", False)
                  else FlashAttentionDecodeSm90)
  return kernel_class(_checked(variant, kernel_class))


def export_variant(variant: config.KernelVariant, out_dir, kernel=None) -> ExportedKernel:
  """Compiles one variant for its arch and writes `<key>.h` and `<key>.o` into out_dir.
  kernel: a forward kernel object to compile in place of build_kernel(variant) (tests compare
  a variant's SASS against the kernel with one attribute changed).

  A backward variant writes `<key>-{pre,main,post}.{h,o}` (see export_bwd_variant).
  """
  if variant.direction == "bwd":
    return export_bwd_variant(variant, out_dir)
  decode = variant.direction == "decode"
  if kernel is None:
    kernel = build_decode_kernel(variant) if decode else build_kernel(variant)
  load_dsl_runtime()
  out_dir = pathlib.Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  prefix = function_prefix(variant)
  start = time.perf_counter()
  options = f"--gpu-arch {_GPU_ARCH[variant.arch]}"
  if decode:
    # softmax_scale, seqlen_q, window_left, window_right, softcap: run-time scalars.
    compiled = cute.compile(kernel, *decode_signature(variant), cutlass.Float32(1.0),
                            cutlass.Int32(1), cutlass.Int32(0), cutlass.Int32(0),
                            cutlass.Float32(0.0), make_fake_stream(), options=options)
  elif variant.dtype == config.FP8_DTYPE:
    compiled = cute.compile(kernel, *fp8_fwd_signature(variant), cutlass.Float32(1.0),
                            cutlass.Int32(0), cutlass.Int32(0), make_fake_stream(),
                            options=options)
  else:
    *tensors, mods, left, right, cap = fwd_signature(variant)
    compiled = cute.compile(kernel, *tensors, *mods, cutlass.Float32(1.0), cutlass.Int32(0),
                            left, right, cap, make_fake_stream(), options=options)
  compiled.export_to_c(str(out_dir), variant.key, prefix)
  seconds = time.perf_counter() - start
  object_path = out_dir / f"{variant.key}.o"
  header_path = (out_dir / f"{variant.key}.h").resolve()
  return ExportedKernel(
      variant=variant, header_path=header_path, object_path=object_path.resolve(),
      function_prefix=prefix, cubin=extract_cubin(object_path), compile_seconds=seconds,
      defines=glue_defines(variant, {"main": (prefix, header_path)}),
      glue_source="variant_decode.cc" if decode else "variant_fwd.cc")


_DIRECTION_CODE = {"fwd": 0, "bwd": 1, "decode": 2}
# kernel_abi.h's JAXFLASH_MOD_* codes of the closed-over arrays' dtypes.
MOD_DTYPE_CODES = {"bool": 0, "int8": 1, "int16": 2, "int32": 3, "uint8": 4, "uint16": 5,
                   "uint32": 6, "float16": 7, "bfloat16": 8, "float32": 9}
_DTYPE_CODE = {"float16": 0, "bfloat16": 1, config.FP8_DTYPE: 2}


def glue_defines(variant: config.KernelVariant, parts: dict) -> tuple[str, ...]:
  """The -D flags of a variant's glue (jaxflash/ffi/variant_{fwd,bwd,decode}.cc; argv items, no
  shell quoting): what the library reports through jaxflash_variant_info, and for each exported
  part ("main", and "pre" / "post" of the backward) its function prefix and header:
  parts = {part: (prefix, header_path)}."""
  schedule = variant.schedule
  defines = [f'-DJAXFLASH_VARIANT_KEY="{variant.key}"',
             f"-DJAXFLASH_DIRECTION={_DIRECTION_CODE[variant.direction]}",
             f"-DJAXFLASH_DTYPE={_DTYPE_CODE[variant.dtype]}",
             f"-DJAXFLASH_HEAD_DIM={variant.head_dim}",
             f"-DJAXFLASH_HEAD_DIM_V={variant.head_dim_v}",
             f"-DJAXFLASH_CAUSAL={int(variant.causal)}",
             f"-DJAXFLASH_DETERMINISTIC={int(variant.deterministic)}",
             f"-DJAXFLASH_TILE_M={schedule.tile_m}",
             f"-DJAXFLASH_TILE_N={schedule.tile_n}",
             f"-DJAXFLASH_MAX_DQ_COPIES="
             f"{schedule.dq_copies if variant.direction == 'bwd' else 1}",
             f"-DJAXFLASH_MASKED={int(variant.masked)}",
             f"-DJAXFLASH_TILE_COUNTER={int(takes_tile_counter(variant))}",
             f"-DJAXFLASH_KV_FP8={int(variant.kv_dtype is not None)}",
             f"-DJAXFLASH_BIAS={int(variant.bias)}"]
  arrays = mod_codegen.parse(variant.mods)["arrays"] if variant.mods else ()
  pad = (0,) * (config.MOD_MAX_ARRAYS - len(arrays))
  defines += [f"-DJAXFLASH_MOD_ARRAYS={len(arrays)}",
              "-DJAXFLASH_MOD_DTYPES={" + ",".join(
                  str(c) for c in (*(MOD_DTYPE_CODES[d] for d, _ in arrays), *pad)) + "}",
              "-DJAXFLASH_MOD_RANKS={" + ",".join(
                  str(c) for c in (*(r for _, r in arrays), *pad)) + "}"]
  for part, (prefix, header) in parts.items():
    defines += [f"-DJAXFLASH_PREFIX_{part.upper()}={prefix}",
                f'-DJAXFLASH_HEADER_{part.upper()}="{header}"']
  return tuple(defines)


def extract_cubin(object_path) -> bytes:
  """The device code embedded in an exported object (ELF64 symbol `*kernels_binary*`)."""
  data = pathlib.Path(object_path).read_bytes()
  if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
    raise ValueError(f"object_path: {object_path} is not a little-endian ELF64 object")
  shoff, = struct.unpack_from("<Q", data, 0x28)
  shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
  sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
  for sec in sections:
    if sec[1] != 2:  # SHT_SYMTAB
      continue
    strtab = sections[sec[6]]
    for off in range(sec[4], sec[4] + sec[5], sec[9]):
      name_off, _, _, shndx, value, size = struct.unpack_from("<IBBHQQ", data, off)
      end = data.index(b"\0", strtab[4] + name_off)
      name = data[strtab[4] + name_off:end].decode()
      if "kernels_binary" in name and size > 0 and shndx < shnum:
        target = sections[shndx]
        blob = data[target[4] + value:target[4] + value + size]
        # The payload is the cubin itself (an ELF); skip any length prefix before it.
        start = blob.find(b"\x7fELF")
        if start < 0:
          raise ValueError(f"{object_path}: kernels_binary holds no ELF cubin")
        return blob[start:]
  raise ValueError(f"{object_path}: no kernels_binary symbol")


def find_tool(name: str) -> str:
  """Path of cuobjdump / nvdisasm from the PyPI nvidia-cuda-* wheels, else from PATH."""
  try:
    import nvidia  # namespace package of the CUDA wheels
    for root in nvidia.__path__:
      for sub in ("cu13/bin", "cuda_nvdisasm/bin", "cuda_cuobjdump/bin"):
        candidate = pathlib.Path(root) / sub / name
        if candidate.exists():
          return str(candidate)
  except ImportError:
    pass
  import shutil
  found = shutil.which(name) or (f"/usr/local/cuda/bin/{name}"
                                 if os.path.exists(f"/usr/local/cuda/bin/{name}") else None)
  if not found:
    raise FileNotFoundError(f"{name} not found (pip install nvidia-cuda-{name[:6]}...)")
  return found


def disassemble(cubin: bytes, work_dir) -> str:
  """SASS text of a cubin (nvdisasm)."""
  import subprocess
  path = pathlib.Path(work_dir) / "kernel.cubin"
  path.write_bytes(cubin)
  return subprocess.run([find_tool("nvdisasm"), "-c", str(path)], check=True,
                        capture_output=True, text=True).stdout


def resource_usage(cubin: bytes, work_dir) -> str:
  """cuobjdump -res-usage of a cubin: registers, shared memory, stack per kernel."""
  import subprocess
  path = pathlib.Path(work_dir) / "kernel.cubin"
  path.write_bytes(cubin)
  return subprocess.run([find_tool("cuobjdump"), "-res-usage", str(path)], check=True,
                        capture_output=True, text=True).stdout


# ---------------------------------------------------------------------------------------------
# Backward: three kernels (preprocess, main, postprocess) per variant, one glue
# (jaxflash/ffi/variant_bwd.cc) that launches them in order on the caller's stream.

_BWD_PARTS = ("pre", "main", "post")


def bwd_signature(variant: config.KernelVariant) -> dict:
  """Fake tensors of the backward kernels, by argument name; shapes dynamic, head dims static.

  q/k/v/out/d_out/dq/dk/dv are dense (batch, seq, heads, dim); lse/d_lse (batch, heads, seqlen_q);
  the scratch tensors follow config.bwd_scratch_shapes: lse_log2/delta (batch, heads,
  seqlen_q_rounded), dq_accum (batch, heads, copies * seqlen_q_rounded, head_dim), dq_semaphore
  (batch, heads, copies * seqlen_q_rounded / tile_m) or None. Dynamic strides are listed in
  mode order with a unit last stride, as the C glue fills them.
  """
  dtype = DTYPES[variant.dtype]
  d, dv = variant.head_dim, variant.head_dim_v
  batch, seqlen_q, seqlen_k = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
  num_heads, num_kv_heads = cute.sym_int32(), cute.sym_int32()
  seqlen_q_rounded = cute.sym_int32(divisibility=variant.schedule.tile_m)
  accum_rows = cute.sym_int32(divisibility=variant.schedule.tile_m)  # copies * seqlen_q_rounded

  def dense(shape, last_dim, dt=dtype):
    return _dense(shape, last_dim, dt)

  def rows(shape, dt=cutlass.Float32, align=_ASSUMED_ALIGN):
    strides = (cute.sym_int64(), cute.sym_int64(), 1)
    return make_fake_tensor(dt, shape, strides, assumed_align=align)

  sem = None
  if variant.deterministic:
    sem = rows((batch, num_heads, cute.sym_int32()), cutlass.Int32, 4)
  signature = dict(
      q=dense((batch, seqlen_q, num_heads, d), d),
      k=dense((batch, seqlen_k, num_kv_heads, d), d),
      v=dense((batch, seqlen_k, num_kv_heads, dv), dv),
      out=dense((batch, seqlen_q, num_heads, dv), dv),
      d_out=dense((batch, seqlen_q, num_heads, dv), dv),
      lse=rows((batch, num_heads, seqlen_q)),
      d_lse=rows((batch, num_heads, seqlen_q)),
      lse_log2=rows((batch, num_heads, seqlen_q_rounded)),
      delta=rows((batch, num_heads, seqlen_q_rounded)),
      dq_accum=dense((batch, num_heads, accum_rows, d), d, cutlass.Float32),
      dq=dense((batch, seqlen_q, num_heads, d), d),
      dk=dense((batch, seqlen_k, num_kv_heads, d), d),
      dv=dense((batch, seqlen_k, num_kv_heads, dv), dv),
      dq_semaphore=sem,
  )
  # Masked: query ids padded to query blocks (columns), key ids to key blocks (rows: the CTAs),
  # ranges and order per key block, and (deterministic) the ranks per (key, query) block.
  masking = (mask_signature(batch, variant.schedule.tile_n, variant.schedule.tile_m)
             if variant.masked else _NO_MASK)
  ranks = None
  if variant.masked and variant.deterministic:
    ranks = rows((batch, cute.sym_int32(), cute.sym_int32()), cutlass.Int32, _ASSUMED_ALIGN)
  signature.update(key_ids=masking["row_ids"], query_ids=masking["col_ids"],
                   ranges=masking["ranges"], order=masking["order"], ranks=ranks,
                   window_left=masking["window_left"], window_right=masking["window_right"],
                   softcap=masking["softcap"],
                   **bias_signature(variant, batch, num_heads, seqlen_q, seqlen_k))
  return signature


def build_bwd_kernels(variant: config.KernelVariant):
  """(preprocess, main, postprocess) kernel objects of a backward variant, or ValueError."""
  variant = _checked(variant, FlashAttentionBackwardSm90)
  return (FlashAttentionBackwardPreprocess(variant), FlashAttentionBackwardSm90(variant),
          FlashAttentionBackwardPostprocess(variant))


def export_bwd_variant(variant: config.KernelVariant, out_dir) -> ExportedKernel:
  """Compiles the three backward kernels and writes `<key>-{pre,main,post}.{h,o}`."""
  pre, main, post = build_bwd_kernels(variant)
  key = variant.key
  load_dsl_runtime()
  out_dir = pathlib.Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  prefix = function_prefix(variant)
  sig = bwd_signature(variant)
  scale, stream = cutlass.Float32(1.0), make_fake_stream()
  arguments = {
      "pre": (pre, sig["out"], sig["d_out"], sig["lse"], sig["d_lse"], sig["lse_log2"],
              sig["delta"], sig["dq_accum"], sig["dq_semaphore"], stream),
      "main": (main, sig["q"], sig["k"], sig["v"], sig["d_out"], sig["lse_log2"], sig["delta"],
               sig["dq_accum"], sig["dk"], sig["dv"], sig["dq_semaphore"], sig["query_ids"],
               sig["key_ids"], sig["ranges"], sig["order"], sig["ranks"],
               *(sig[name] for name in BIAS_ARGUMENTS + ("dbias",)),
               *mod_array_tensors(variant), scale,
               sig["window_left"], sig["window_right"], sig["softcap"], stream),
      "post": (post, sig["dq_accum"], sig["dq"], sig["dq_semaphore"], scale, stream),
  }
  start = time.perf_counter()
  parts = {}
  for part in _BWD_PARTS:
    kernel, *args = arguments[part]
    compiled = cute.compile(kernel, *args, options=f"--gpu-arch {_GPU_ARCH[variant.arch]}")
    compiled.export_to_c(str(out_dir), f"{key}-{part}", f"{prefix}_{part}")
    parts[part] = (f"{prefix}_{part}", (out_dir / f"{key}-{part}.h").resolve())
  seconds = time.perf_counter() - start
  objects = {part: (out_dir / f"{key}-{part}.o").resolve() for part in _BWD_PARTS}
  return ExportedKernel(
      variant=variant, header_path=parts["main"][1], object_path=objects["main"],
      function_prefix=prefix, cubin=extract_cubin(objects["main"]), compile_seconds=seconds,
      defines=glue_defines(variant, parts), extra_object_paths=(objects["pre"], objects["post"]),
      extra_cubins=(extract_cubin(objects["pre"]), extract_cubin(objects["post"])),
      glue_source="variant_bwd.cc")
