"""AOT compile of every shipped forward variant for sm_90a on a GPU-less host, SASS checks, link.

Needs nvidia-cutlass-dsl (skipped elsewhere). Each variant compiles once per session.
"""

import ctypes
import dataclasses
import pathlib
import re
import subprocess

import pytest

pytest.importorskip("cutlass")

from jaxflash import build, config  # noqa: E402
from jaxflash.kernels import compile as kernel_compile  # noqa: E402
from jaxflash.kernels.fwd_sm90 import FlashAttentionForwardSm90  # noqa: E402

pytestmark = pytest.mark.cutlass

VARIANTS = config.shipped_variants("sm90a")
_SASS_OP = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)", re.M)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  """Compiles lazily, once per variant and session: {key: (ExportedKernel, sass opcodes)}."""
  out_dir = tmp_path_factory.mktemp("kernels")
  cache = {}

  def get(variant):
    if variant.key not in cache:
      exp = kernel_compile.export_variant(variant, out_dir)
      sass = kernel_compile.disassemble(exp.cubin, out_dir)
      cache[variant.key] = (exp, [m.group(1) for m in _SASS_OP.finditer(sass)])
    return cache[variant.key]

  return get


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.key)
def test_sass_uses_wgmma_and_tma_without_spills(exported, variant):
  exp, opcodes = exported(variant)
  assert exp.cubin[:4] == b"\x7fELF"
  counts = {op: opcodes.count(op) for op in ("HGMMA", "UTMALDG", "UTMASTG", "LDL", "STL")}
  assert counts["HGMMA"] > 0 and counts["UTMALDG"] > 0 and counts["UTMASTG"] > 0, counts
  assert counts["LDL"] == 0 and counts["STL"] == 0, f"local-memory spills: {counts}"


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.key)
def test_header_declares_wrapper_and_tensor_structs(exported, variant):
  exp, _ = exported(variant)
  header = exp.header_path.read_text()
  prefix = exp.function_prefix
  assert f"int32_t cute_dsl_{prefix}_wrapper(" in header
  assert f"{prefix}_Kernel_Module_Load" in header
  for name in ("mQ", "mK", "mV", "mO", "mLSE"):
    assert re.search(rf"int32_t dynamic_shapes\[3\];\s*int64_t dynamic_strides\[2\];\s*\}}"
                     rf" {prefix}_Tensor_{name}_t;", header), name
  assert exp.object_path.stat().st_size > 0


def test_causal_variant_differs_from_non_causal(exported):
  """The causal flag reaches the device code (the mask adds instructions)."""
  causal = next(v for v in VARIANTS if v.causal)
  plain = dataclasses.replace(causal, causal=False)
  assert exported(causal)[0].cubin != exported(plain)[0].cubin


def test_linked_library_exports_the_kernel_abi(exported, tmp_path):
  variant = next(v for v in VARIANTS if v.causal and v.head_dim == 128)
  exp, _ = exported(variant)
  lib_path = tmp_path / f"{variant.key}.so"
  build.link_variant(exp, variant, lib_path)
  nm = subprocess.run(["nm", "-D", "--defined-only", str(lib_path)], check=True,
                      capture_output=True, text=True).stdout
  exported_names = {line.split()[-1] for line in nm.splitlines() if line.strip()}
  assert exported_names == {"jaxflash_variant_abi_version", "jaxflash_variant_key",
                            "jaxflash_variant_load", "jaxflash_variant_fwd"}
  # Version and key need no GPU; argument validation answers before any CUDA call.
  lib = ctypes.CDLL(str(lib_path))
  lib.jaxflash_variant_key.restype = ctypes.c_char_p
  assert lib.jaxflash_variant_key().decode() == variant.key
  assert lib.jaxflash_variant_abi_version() == _abi_version_in_header()
  assert lib.jaxflash_variant_fwd(None, None) == 1  # cudaErrorInvalidValue


def _abi_version_in_header():
  text = (pathlib.Path(kernel_compile.__file__).parents[1] / "ffi" / "kernel_abi.h").read_text()
  return int(re.search(r"#define JAXFLASH_KERNEL_ABI_VERSION (\d+)", text).group(1))


@pytest.mark.parametrize("head_dim,head_dim_v,tile,reason", [
    (80, 80, config.TileConfig(128, 128, 2), "head_dim 80"),
    (192, 64, config.TileConfig(128, 128, 2), "head_dim_v 64"),
    (128, 128, config.TileConfig(192, 128, 2), "tile_m 192"),
    (96, 96, config.TileConfig(192, 128, 2), "tile_m 192"),
    (256, 256, config.TileConfig(128, 128, 2), "shared memory"),
    # 128 x 128 fits hdim 192 only with head_dim_v 128 (208 KiB); dv 192 needs 240 KiB.
    (192, 192, config.TileConfig(128, 128, 2), "shared memory"),
])
def test_can_implement_names_the_problem(head_dim, head_dim_v, tile, reason):
  ok, text = FlashAttentionForwardSm90.can_implement("bfloat16", head_dim, head_dim_v, False,
                                                     tile)
  assert not ok and reason in text


def test_shipped_variants_cover_every_forward_head_dim_pair():
  pairs = {(v.head_dim, v.head_dim_v) for v in VARIANTS}
  assert pairs == set(config.KERNEL_HEAD_DIM_PAIRS)
  assert (192, 128) in pairs  # head_dim_v != head_dim (DeepSeek MLA shape)


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.key)
def test_wgmma_shapes_follow_tile_n_and_head_dim_v(exported, variant):
  """S = Q K^T is 64 x tile_n per warpgroup, O += P V is 64 x head_dim_v (not head_dim)."""
  exp, _ = exported(variant)
  sass = kernel_compile.disassemble(exp.cubin, exp.object_path.parent)
  shapes = set(re.findall(r"\bHGMMA\.(\d+x\d+x\d+)\.", sass))
  assert shapes == {f"64x{variant.tile.tile_n}x16", f"64x{variant.head_dim_v}x16"}, shapes
  assert exp.defines[-2:] == (f"-DJAXFLASH_HEAD_DIM={variant.head_dim}",
                              f"-DJAXFLASH_HEAD_DIM_V={variant.head_dim_v}")


def test_shipped_variants_fit():
  for v in VARIANTS:
    assert FlashAttentionForwardSm90.can_implement(v.dtype, v.head_dim, v.head_dim_v, v.causal,
                                                   v.tile) == (True, "")
