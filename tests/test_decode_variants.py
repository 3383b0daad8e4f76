"""The split-KV decode variants compiled for sm_90a on a GPU-less host: every shipped one
exports with the signature the glue calls (jaxflash/ffi/variant_decode.cc), and a linked library
exports the decode ABI, describes its variant and refuses what the kernel cannot take.

Needs nvidia-cutlass-dsl (marker `cutlass`, skipped elsewhere). The kernel's own SASS checks
belong with the kernel (kernels/decode_sm90.py).
"""

import ctypes
import re

import pytest

pytest.importorskip("cutlass")

from jaxflash import build, config, ffi  # noqa: E402
from tests import _sass  # noqa: E402

pytestmark = pytest.mark.cutlass

VARIANTS = config.shipped_variants("sm90a", "decode")
# The exported launcher's parameters after the module, in order (compile.decode_signature, then
# the run-time scalars and the stream).
WRAPPER_PARAMETERS = [
    ("Tensor_mQ_t *", "mQ"), ("Tensor_mK_t *", "mK"), ("Tensor_mV_t *", "mV"),
    ("Tensor_mPageTable_t *", "mPageTable"), ("Tensor_mLengths_t *", "mLengths"),
    ("Tensor_mSink_t *", "mSink"), ("Tensor_mOPart_t *", "mOPart"),
    ("Tensor_mLSEPart_t *", "mLSEPart"), ("Tensor_mO_t *", "mO"), ("Tensor_mLSE_t *", "mLSE"),
    ("Tensor_mKDescale_t *", "mKDescale"), ("Tensor_mVDescale_t *", "mVDescale"),
    ("float", "softmax_scale"), ("int32_t", "seqlen_q"), ("int32_t", "window_left"),
    ("int32_t", "window_right"), ("float", "softcap"), ("cudaStream_t", "stream")]
# Dynamic extents and strides of each exported tensor struct (tensor_args.h's Dense fills them).
TENSOR_MODES = {"mQ": (3, 2), "mK": (3, 2), "mV": (3, 2), "mPageTable": (2, 1),
                "mLengths": (1, 0), "mSink": (2, 1), "mOPart": (4, 3), "mLSEPart": (4, 3),
                "mO": (3, 2), "mLSE": (3, 2), "mKDescale": (2, 1), "mVDescale": (2, 1)}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  return _sass.exporter(tmp_path_factory)


@pytest.mark.parametrize("variant", _sass.compiled_variants(VARIANTS), ids=lambda v: v.key)
def test_decode_variant_exports_the_signature_of_the_glue(exported, variant):
  e = exported(variant).exp
  assert e.cubin[:4] == b"\x7fELF" and e.glue_source == "variant_decode.cc"
  assert "-DJAXFLASH_DIRECTION=2" in e.defines
  assert f"-DJAXFLASH_KV_FP8={int(variant.kv_dtype is not None)}" in e.defines
  assert f"-DJAXFLASH_TILE_M={variant.schedule.tile_m}" in e.defines
  header = e.header_path.read_text()
  prefix = e.function_prefix
  wrapper = re.search(rf"cute_dsl_{prefix}_wrapper\((.*?)\)\s*{{", header, re.S).group(1)
  params = [p.strip() for p in wrapper.split(",")]
  assert params[0] == f"{prefix}_Kernel_Module_t *module"
  want = [f"{prefix}_{t}{name}" if t.startswith("Tensor") else f"{t} {name}"
          for t, name in WRAPPER_PARAMETERS]
  assert params[1:] == want
  for name, (extents, strides) in TENSOR_MODES.items():
    body = re.search(rf"typedef struct \{{(.*?)\}} {prefix}_Tensor_{name}_t;", header, re.S)
    assert f"int32_t dynamic_shapes[{extents}];" in body.group(1), name
    assert (f"int64_t dynamic_strides[{strides}];" in body.group(1)) == (strides > 0), name


@pytest.mark.parametrize("variant", _sass.compiled_variants(
    [v for v in VARIANTS if not v.schedule.chunked]), ids=lambda v: v.key)
def test_decode_variant_holds_the_split_kernel_and_the_merge_without_spills(exported,
                                                                                  variant):
  """One cubin, two kernels: the splits (TMA copies, WGMMAs) and their merge
  (kernels/decode_combine.py: warp shuffles, no shared memory). The chunked variants hold one
  kernel (tests/test_kernels_chunked_sm90.py)."""
  sass = exported(variant).sass["main"]
  parts = {}
  for name, body in re.findall(r"\.text\.(\S+?):\n(.*?)(?=\.text\.|\Z)", sass, re.S):
    kind = "combine" if "DecodeCombine" in name else "decode" if "DecodeSm90" in name else name
    parts[kind] = _sass.opcodes(body)
  assert set(parts) == {"decode", "combine"}, list(parts)
  for kind, ops in parts.items():
    _sass.assert_no_spills(ops, f"{variant.key} {kind}")
  assert "HGMMA" in parts["decode"] and "UTMALDG" in parts["decode"]
  # FP8 caches: the converting warps' e4m3 -> float16 conversions, with the register split
  # that lets a fourth warpgroup (six converting warps in all) share the file with the
  # consumers: 120 registers for the producer and converting warpgroups, 256 for the consumers.
  assert ("F2FP.F16.E4M3.UNPACK_B" in _sass.opcodes(sass, modifiers=True)) == (
      variant.kv_dtype is not None)
  if variant.kv_dtype is not None:
    assert "USETMAXREG.DEALLOC.CTAPOOL 0x78" in sass, variant.key
    assert re.search(r"USETMAXREG\.TRY_ALLOC\.CTAPOOL U?P\d, 0x100", sass), variant.key
  assert "SHFL" in parts["combine"] and "HGMMA" not in parts["combine"]
  assert not {"LDS", "STS", "BAR"} & set(parts["combine"])


class _DecodeArgs(ctypes.Structure):
  """kernel_abi.h's JaxflashDecodeArgs."""
  _fields_ = ([(name, ctypes.c_void_p) for name in (
      "q", "k", "v", "page_table", "lengths", "sink", "out_partial", "lse_partial", "out",
      "lse")]
              + [(name, ctypes.c_int32) for name in (
                  "batch", "rows", "num_kv_heads", "head_dim", "head_dim_v", "num_pages",
                  "page_size", "max_pages", "num_splits", "seqlen_q")]
              + [("softmax_scale", ctypes.c_float), ("window_left", ctypes.c_int32),
                 ("window_right", ctypes.c_int32), ("softcap", ctypes.c_float),
                 ("k_descale", ctypes.c_void_p), ("v_descale", ctypes.c_void_p)])


@pytest.mark.parametrize("kind", ["16bit_caches", "fp8_caches", "chunked"])
def test_linked_decode_library_exports_the_decode_abi_and_validates_calls(exported, tmp_path,
                                                                           kind):
  fp8, chunked = kind == "fp8_caches", kind == "chunked"
  # FP8 caches ship float16 variants only (bfloat16 queries run them: config.decode_launched).
  dtype = "float16" if fp8 else "bfloat16"
  variant = next(v for v in VARIANTS if v.head_dim == 128 and v.dtype == dtype
                 and (v.kv_dtype is not None) == fp8 and v.schedule.chunked == chunked)
  lib_path = tmp_path / "decode.so"
  build.link_variant(exported(variant).exp, variant, lib_path)
  assert build.exported_symbols(lib_path) == set(build.variant_abi_symbols("decode"))
  lib, info = _sass.library_info(lib_path)
  lib.jaxflash_variant_decode.argtypes = [ctypes.POINTER(_DecodeArgs), ctypes.c_void_p]
  assert lib.jaxflash_variant_key().decode() == variant.key
  assert lib.jaxflash_variant_abi_version() == _sass.abi_version()
  assert info == dict(
      direction=2, dtype=0 if fp8 else 1, head_dim=128, head_dim_v=128, causal=0,
      deterministic=0, tile_m=128 if chunked else 64, max_dq_copies=1, masked=0,
      tile_n=variant.schedule.tile_n, tile_counter=0,
      kv_fp8=int(fp8))

  invalid = 1  # cudaErrorInvalidValue, before any CUDA call
  assert lib.jaxflash_variant_decode(None, None) == invalid
  buffer = ctypes.create_string_buffer(1 << 12)
  base = (ctypes.addressof(buffer) + 255) // 256 * 256

  def call(**changes):
    fields = dict(q=base, k=base, v=base, page_table=base, lengths=base, sink=base,
                  out_partial=base, lse_partial=base, out=base, lse=base, batch=2, rows=8,
                  num_kv_heads=2, head_dim=128,
                  head_dim_v=128, num_pages=10, page_size=16, max_pages=5,
                  num_splits=0 if chunked else 3,
                  seqlen_q=2, softmax_scale=0.125, window_left=1 << 30, window_right=0,
                  softcap=0.0, k_descale=base if fp8 else None, v_descale=base if fp8 else None)
    fields.update(changes)
    return lib.jaxflash_variant_decode(ctypes.byref(_DecodeArgs(**fields)), None)

  # A chunked variant runs no split (0), the split-KV ones at least one.
  refused = [dict(head_dim=64), dict(head_dim_v=64), dict(batch=0), dict(rows=0),
             dict(num_pages=0), dict(page_size=0), dict(max_pages=-1),
             dict(num_splits=1 if chunked else 0),
             dict(max_pages=0, num_pages=1),  # contiguous: one page per sequence
             dict(seqlen_q=0), dict(seqlen_q=3), dict(page_size=24), dict(page_size=48),
             dict(num_splits=65536), dict(batch=40000), dict(q=base + 8), dict(k=base + 4),
             dict(out=base + 8), dict(lse=base + 4),
             dict(lengths=base + 2), dict(sink=base + 2), dict(page_table=None),
             dict(lengths=None)]
  if not chunked:  # a chunked variant's partials are empty, never read or written
    refused.append(dict(out_partial=base + 4))
  # FP8 caches need both descales (4-byte aligned); 16-bit caches take none.
  refused += ([dict(k_descale=None), dict(v_descale=None), dict(k_descale=base + 2)] if fp8
              else [dict(k_descale=base), dict(v_descale=base)])
  for changes in refused:
    assert call(**changes) == invalid, changes
  if not ffi._cuda_device_present():  # a GPU would launch on these host pointers
    # What passes validation goes on to the module load, which needs a GPU.
    for changes in (dict(page_table=base + 4, lengths=base + 4),
                    dict(max_pages=0, page_table=None, sink=None)):  # contiguous, no sink
      status = call(**changes)
      assert status != invalid and status != 0, changes
