"""AOT compile of every shipped backward variant for sm_90a on a GPU-less host, SASS, glue link.

The compile tests need nvidia-cutlass-dsl (marker `cutlass`, skipped elsewhere); the scratch
shape and support-table tests need only the config leaf. Each variant compiles once per session.
"""

import ctypes
import dataclasses
import pathlib
import re
import subprocess

import pytest

from jaxflash import build, config

VARIANTS = config.shipped_variants("sm90a", "bwd")
_SASS_OP = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)", re.M)
_ABI = {"jaxflash_variant_abi_version", "jaxflash_variant_key", "jaxflash_variant_load",
        "jaxflash_variant_bwd"}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  """Compiles lazily, once per variant: {key: (ExportedKernel, {part: sass opcodes})}."""
  kernel_compile = pytest.importorskip("jaxflash.kernels.compile")
  out_dir = tmp_path_factory.mktemp("bwd_kernels")
  cache = {}

  def get(variant):
    if variant.key not in cache:
      exp = kernel_compile.export_variant(variant, out_dir)
      ops = {}
      for part, cubin in zip(("main", "pre", "post"), (exp.cubin, *exp.extra_cubins)):
        sass = kernel_compile.disassemble(cubin, out_dir)
        ops[part] = [m.group(1) for m in _SASS_OP.finditer(sass)]
      cache[variant.key] = (exp, ops)
    return cache[variant.key]

  return get


@pytest.mark.cutlass
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.key)
def test_sass_uses_wgmma_tma_and_bulk_reduction_without_spills(exported, variant):
  exp, ops = exported(variant)
  main = {op: ops["main"].count(op) for op in ("HGMMA", "UTMALDG", "UTMASTG", "UBLKRED")}
  # Loads of K/V/Q/dO, stores of dK/dV, the dQ bulk reduction, five GEMMs per step.
  assert all(main.values()), main
  assert "REDG" in ops["main"] if variant.deterministic else "REDG" not in ops["main"]
  for part, opcodes in ops.items():
    spills = opcodes.count("LDL") + opcodes.count("STL")
    assert spills == 0, f"{part}: {spills} local-memory instructions"
  assert exp.cubin[:4] == b"\x7fELF" and all(c[:4] == b"\x7fELF" for c in exp.extra_cubins)


@pytest.mark.cutlass
@pytest.mark.parametrize("variant", VARIANTS[:2], ids=lambda v: v.key)
def test_headers_declare_three_wrappers(exported, variant):
  exp, _ = exported(variant)
  for path in (exp.header_path, *(p.with_suffix(".h") for p in exp.extra_object_paths)):
    header = path.read_text()
    prefix = re.search(r"int32_t cute_dsl_(\w+)_wrapper\(", header).group(1)
    assert prefix.startswith(exp.function_prefix) and prefix.endswith(("_pre", "_main", "_post"))
    assert f"{prefix}_Kernel_Module_Load" in header
  main = exp.header_path.read_text()
  assert ("_Tensor_mSem_t" in main) == variant.deterministic


@pytest.mark.cutlass
def test_causal_and_deterministic_reach_the_device_code(exported):
  plain = next(v for v in VARIANTS if not v.causal and not v.deterministic)
  for flag in ("causal", "deterministic"):
    other = dataclasses.replace(plain, **{flag: True})
    assert exported(other)[0].cubin != exported(plain)[0].cubin, flag


@pytest.mark.cutlass
@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "det"])
def test_linked_library_exports_the_bwd_abi(exported, tmp_path, deterministic):
  kernel_compile = pytest.importorskip("jaxflash.kernels.compile")
  variant = next(v for v in VARIANTS if v.causal and v.head_dim == 128
                 and v.deterministic == deterministic)
  exp, _ = exported(variant)
  lib_path = tmp_path / f"{variant.key}.so"
  build.link_variant(exp, variant, lib_path)
  nm = subprocess.run(["nm", "-D", "--defined-only", str(lib_path)], check=True,
                      capture_output=True, text=True).stdout
  assert {line.split()[-1] for line in nm.splitlines() if line.strip()} == _ABI
  # Key, version and argument validation answer before any CUDA call.
  lib = ctypes.CDLL(str(lib_path))
  lib.jaxflash_variant_key.restype = ctypes.c_char_p
  assert lib.jaxflash_variant_key().decode() == variant.key
  header = (pathlib.Path(kernel_compile.__file__).parents[1] / "ffi" / "kernel_abi.h").read_text()
  version = int(re.search(r"#define JAXFLASH_KERNEL_ABI_VERSION (\d+)", header).group(1))
  assert lib.jaxflash_variant_abi_version() == version
  assert lib.jaxflash_variant_bwd(None, None) == 1  # cudaErrorInvalidValue


@pytest.mark.cutlass
@pytest.mark.parametrize("head_dim,head_dim_v,tile,reason", [
    (160, 160, config.TileConfig(64, 64, 1), "head_dim 160"),
    (192, 192, config.TileConfig(64, 128, 2), "tile 64x128 unsupported for head_dim 192"),
    (256, 256, config.TileConfig(64, 128, 1), "tile 64x128 unsupported for head_dim 256"),
    (128, 128, config.TileConfig(64, 64, 2), "tile 64x64 unsupported for head_dim 128"),
    (128, 64, config.TileConfig(64, 128, 2), "head_dim_v 64"),
    (128, 128, config.TileConfig(128, 128, 2), "tile 128x128"),
    (96, 96, config.TileConfig(128, 128, 2), "tile 128x128 unsupported for head_dim 96"),
    (64, 64, config.TileConfig(192, 128, 2), "accepted: 64x128 or 128x128"),
    (128, 128, config.TileConfig(64, 128, 3), "num_stages 3"),
])
def test_can_implement_names_the_problem(head_dim, head_dim_v, tile, reason):
  bwd_sm90 = pytest.importorskip("jaxflash.kernels.bwd_sm90")
  ok, text = bwd_sm90.FlashAttentionBackwardSm90.can_implement(
      "bfloat16", head_dim, head_dim_v, False, tile)
  assert not ok and reason in text


@pytest.mark.cutlass
@pytest.mark.parametrize("tile_m", [64, 128])
def test_head_dim_64_takes_64_or_128_query_rows(tile_m):
  bwd_sm90 = pytest.importorskip("jaxflash.kernels.bwd_sm90")
  tile = config.TileConfig(tile_m, 128, 2)
  assert bwd_sm90.FlashAttentionBackwardSm90.can_implement(
      "float16", 64, 64, True, tile) == (True, "")
  # 128 rows: K + V 32 KiB, Q + dO 2 x 2 x 16, P + dS 2 x 32, dQ staging 32, + 1 KiB alignment.
  if tile_m == 128:
    assert bwd_sm90.FlashAttentionBackwardSm90.smem_bytes(64, 64, tile) == 193 * 1024


@pytest.mark.cutlass
def test_head_dim_split_fits_two_q_stages():
  """hdim 256: one dO stage and half-block dQ staging leave room for 2 Q stages, not 3."""
  bwd_sm90 = pytest.importorskip("jaxflash.kernels.bwd_sm90")
  kernel = bwd_sm90.FlashAttentionBackwardSm90
  assert kernel.smem_bytes(256, 256, config.TileConfig(64, 64, 2)) <= 232448
  assert kernel.smem_bytes(256, 256, config.TileConfig(64, 64, 3)) > 232448


@pytest.mark.cutlass
def test_shipped_variants_fit():
  bwd_sm90 = pytest.importorskip("jaxflash.kernels.bwd_sm90")
  for v in VARIANTS:
    assert bwd_sm90.FlashAttentionBackwardSm90.can_implement(
        v.dtype, v.head_dim, v.head_dim_v, v.causal, v.tile) == (True, "")


def test_shipped_bwd_variants_cover_dtypes_head_dims_masks_and_determinism():
  combos = {(v.dtype, v.head_dim, v.causal, v.deterministic) for v in VARIANTS}
  assert len(combos) == len(VARIANTS) == 2 * len(config.BWD_KERNEL_HEAD_DIMS) * 2 * 2
  assert {v.head_dim for v in VARIANTS} == {64, 96, 128, 192, 256}
  assert all(v.direction == "bwd" and v.key.startswith("bwd-") for v in VARIANTS)
  assert [v for v in VARIANTS if v.deterministic] and all(
      "-det" in v.key for v in VARIANTS if v.deterministic)


@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "det"])
def test_bwd_scratch_shapes_round_seq_q_to_the_tile(deterministic, head_dim):
  cfg = config.AttentionConfig(softmax_scale=0.1, causal=True, deterministic=deterministic)
  variant = config.KernelVariant.for_call("bwd", "sm90a", "bfloat16", head_dim, head_dim, cfg)
  shapes = config.bwd_scratch_shapes(variant, batch=2, seq_q=130, num_heads=3)
  expected = [("dq_accum", (2, 3, 192, head_dim), "float32"),
              ("lse_log2", (2, 3, 192), "float32"),
              ("delta", (2, 3, 192), "float32")]
  if deterministic:
    expected.append(("dq_semaphore", (2, 3, 3), "int32"))
  assert list(shapes) == expected
  with pytest.raises(ValueError, match="direction"):
    config.bwd_scratch_shapes(dataclasses.replace(variant, direction="fwd"), 1, 1, 1)


def test_kernel_support_for_the_backward():
  cfg = config.AttentionConfig(softmax_scale=0.1)
  assert config.kernel_support("bwd", "bfloat16", 128, 128, cfg) == (True, "")
  assert config.kernel_support("bwd", "float16", 64, 64, cfg.replace(deterministic=True))[0]
  assert config.kernel_support("bwd", "bfloat16", 256, 256, cfg) == (True, "")
  ok, reason = config.kernel_support("bwd", "bfloat16", 160, 160, cfg)
  assert not ok and "head_dim 160" in reason
  ok, reason = config.kernel_support("bwd", "bfloat16", 192, 128, cfg)
  assert not ok and "head_dim_v 128" in reason
  ok, reason = config.kernel_support("bwd", "bfloat16", 128, 128, cfg.replace(softcap=5.0))
  assert not ok and "softcap" in reason
