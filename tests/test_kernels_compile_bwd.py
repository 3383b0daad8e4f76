"""AOT compile of every shipped backward variant for sm_90a on a GPU-less host, SASS, glue link.

The compile tests need nvidia-cutlass-dsl (marker `cutlass`, skipped elsewhere); the scratch
shape and support-table tests need only the config leaf. Each variant compiles once per session.
"""

import ctypes
import dataclasses
import pathlib
import re
import subprocess
import sys

import pytest

from jaxflash import build, config

VARIANTS = config.shipped_variants("sm90a", "bwd")
_SASS_OP = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)", re.M)


def _opcodes(sass, modifiers=False):
  """The SASS opcodes of a disassembly, in order (predicates dropped; modifiers cut unless
  `modifiers`, e.g. STS.128)."""
  return [m.group(1) if modifiers else m.group(1).split(".")[0] for m in _SASS_OP.finditer(sass)]


_ABI = {"jaxflash_variant_abi_version", "jaxflash_variant_key", "jaxflash_variant_load",
        "jaxflash_variant_bwd"}


def _with_opcodes(exp, out_dir):
  """(exp, {part: sass opcodes}, {part: sass opcodes with their modifiers}) of an exported
  backward variant, parts main / pre / post."""
  kernel_compile = pytest.importorskip("jaxflash.kernels.compile")
  ops, full = {}, {}
  for part, cubin in zip(("main", "pre", "post"), (exp.cubin, *exp.extra_cubins)):
    sass = kernel_compile.disassemble(cubin, out_dir)
    ops[part] = _opcodes(sass)
    full[part] = _opcodes(sass, modifiers=True)
  return exp, ops, full


def _export_ab(variant, out_dir, **main_args):
  """_with_opcodes of a devtools A/B build: FlashAttentionBackwardSm90 arguments main_args,
  key variant.key + '+NAME=VALUE' per argument (build.py's rule)."""
  kernel_compile = pytest.importorskip("jaxflash.kernels.compile")
  key = variant.key + "".join(f"+{name}={int(value) if isinstance(value, bool) else value}"
                              for name, value in main_args.items())
  exp = kernel_compile.export_bwd_variant(variant, out_dir, main_args=main_args, key=key)
  return _with_opcodes(exp, out_dir)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  """Compiles lazily, once per variant: {key: (ExportedKernel, {part: sass opcodes},
  {part: sass opcodes with their modifiers})}."""
  kernel_compile = pytest.importorskip("jaxflash.kernels.compile")
  out_dir = tmp_path_factory.mktemp("bwd_kernels")
  cache = {}

  def get(variant):
    if variant.key not in cache:
      cache[variant.key] = _with_opcodes(kernel_compile.export_variant(variant, out_dir), out_dir)
    return cache[variant.key]

  return get


@pytest.mark.cutlass
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.key)
def test_sass_uses_wgmma_tma_and_bulk_reduction_without_spills(exported, variant):
  exp, ops, full = exported(variant)
  main = {op: ops["main"].count(op) for op in ("HGMMA", "UTMALDG", "UTMASTG", "UBLKRED")}
  # Loads of K/V/Q/dO, stores of dK/dV, the dQ bulk reduction, five GEMMs per step.
  assert all(main.values()), main
  assert "REDG" in ops["main"] if variant.deterministic else "REDG" not in ops["main"]
  for part, opcodes in ops.items():
    spills = opcodes.count("LDL") + opcodes.count("STL")
    assert spills == 0, f"{part}: {spills} local-memory instructions"
  # GEMM operand descriptors on the uniform datapath, not moved there before each HGMMA:
  # 4-69 R2UR per kernel (88-204 with per-thread operand slices; 69: hdim 256 deterministic,
  # whose dQ writer and release warps take the call's dQ copy count at run time).
  assert ops["main"].count("R2UR") <= 72, ops["main"].count("R2UR")
  # The dQ accumulator moves in 4-float chunks (bwd_common.fragment_chunks): the consumers
  # stage it with 128-bit shared stores and the postprocess reads it with 128-bit loads only.
  assert full["main"].count("STS.128") >= 8, full["main"].count("STS.128")
  # Deterministic: besides, one 32-bit load of each accumulator copy's semaphore (first_store).
  # (The postprocess of a kernel built for two copies loads both; a one-copy call reads copy
  # 0 twice and drops the second.)
  copies = config.max_dq_accum_copies(variant.deterministic, variant.causal, variant.head_dim)
  assert "LDG.E.128" in full["post"], full["post"]
  assert full["post"].count("LDG.E") == (copies if variant.deterministic else 0), full["post"]
  # The postprocess writes dQ through shared memory (stmatrix) and TMA stores, not with
  # per-element global stores.
  assert "UTMASTG" in ops["post"] and "STSM" in ops["post"] and "STG" not in ops["post"]
  assert exp.cubin[:4] == b"\x7fELF" and all(c[:4] == b"\x7fELF" for c in exp.extra_cubins)


@pytest.mark.cutlass
@pytest.mark.parametrize("variant", VARIANTS[:2], ids=lambda v: v.key)
def test_headers_declare_three_wrappers(exported, variant):
  exp, *_ = exported(variant)
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
  exp, *_ = exported(variant)
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


def _assert_ds_stored_from_dk_operand_registers(sass):
  """swap_sdp: each stmatrix.trans x4 of dS^T stores one k block of the dK GEMM's A operand.

  Its four registers hold (key r, queries q, q + 1), (key r + 8, same), (key r, q + 8, q + 9),
  (key r + 8, same), which is what stmatrix.trans expects of matrices 0-3 here, so the store
  needs no repacking. A repacked source (PRMT into other registers) put key r + 8 of query q
  at query q + 1 (wrong dQ on the GPU; probe_ds_store_ptx.py shows it on the PTX).
  """
  sources = re.findall(r"STSM\.16\.MT88\.4 \[[^\]]*\], (R\d+)", sass)
  operands = set(re.findall(r"HGMMA\.64x\d+x16\.F32\.BF16 R\d+, (R\d+), gdesc", sass))
  assert sources and set(sources) <= operands, (sources, sorted(operands))


def _swap_variant(causal, deterministic, tile_m=64, head_dim=128):
  variant = next(v for v in VARIANTS if v.head_dim == head_dim and v.dtype == "bfloat16"
                 and v.causal == causal and v.deterministic == deterministic)
  return dataclasses.replace(variant, tile=config.TileConfig(tile_m, 128, 2, swap_sdp=True))


def test_hdim_64_to_128_ship_the_swapped_schedule():
  """swap_sdp up to hdim 128 (128 query rows at hdim 64, 80 at hdim 128)."""
  for v in VARIANTS:
    want = {64: (128, True), 96: (64, True), 128: (80, True)}.get(v.head_dim,
                                                                  (v.tile.tile_m, False))
    assert (v.tile.tile_m, v.tile.swap_sdp) == want, v.key
    assert v.key.endswith("swap") == v.tile.swap_sdp
  assert config.TileConfig(80, 128, 2, swap_sdp=True).key == "m80n128s2swap"


@pytest.mark.cutlass
@pytest.mark.parametrize("causal,deterministic", [(False, False), (True, True)],
                         ids=["plain", "causal-det"])
def test_swap_sdp_compiles_to_register_operand_gemms_without_spills(tmp_path, causal,
                                                                     deterministic):
  """swap_sdp at 64 x 128: RS WGMMA for dV / dK, no P store, no spills."""
  kernel_compile = pytest.importorskip("jaxflash.kernels.compile")
  variant = _swap_variant(causal, deterministic)
  exp = kernel_compile.export_bwd_variant(variant, tmp_path)
  sass = kernel_compile.disassemble(exp.cubin, tmp_path)
  ops, full = _opcodes(sass), _opcodes(sass, modifiers=True)
  assert f'-DJAXFLASH_VARIANT_KEY="{variant.key}"' in exp.defines
  assert ops.count("LDL") + ops.count("STL") == 0
  # dV and dK take A from registers: "HGMMA.64x128x16.F32.BF16 Rd, Ra, gdesc[..]".
  assert re.search(r"HGMMA\.64x128x16\.F32\.BF16 R\d+, R\d+, gdesc", sass)
  # Bulk copies of the lse2 / delta rows, the dQ reduction (deterministic: also the first
  # contribution's bulk store, UBLKCP.G.S); only dS is stored by stmatrix in the loop (4 per
  # step and loop copy) next to the 16 of the dK / dV epilogue.
  assert full.count("UBLKCP.S.G") == 2 and ops.count("UBLKRED") == 2
  assert full.count("UBLKCP.G.S") == (2 if deterministic else 0)
  assert ops.count("STSM") == 2 * 4 + 16
  _assert_ds_stored_from_dk_operand_registers(sass)


@pytest.mark.cutlass
def test_devtools_override_builds_the_unswapped_schedule(tmp_path):
  """main_args={"swap_sdp": False} (devtools A/B) builds the P-through-shared-memory kernel."""
  kernel_compile = pytest.importorskip("jaxflash.kernels.compile")
  variant = _swap_variant(True, False)
  exp = kernel_compile.export_bwd_variant(variant, tmp_path, main_args={"swap_sdp": False},
                                          key=variant.key + "+swap_sdp=0")
  ops = _opcodes(kernel_compile.disassemble(exp.cubin, tmp_path))
  # No lse2 / delta bulk copies; P and dS both stored by stmatrix (4 + 4 per step and loop copy).
  assert ops.count("UBLKCP") == 0 and ops.count("STSM") == 2 * 8 + 16


@pytest.mark.cutlass
def test_swap_sdp_80_query_rows_compile_with_a_transposed_dq_gemm(exported):
  """tile 80 x 128 (swap_sdp, hdim 128): S^T 64 x 80, dV / dK with K = 80, dQ^T = K^T dS^T."""
  kernel_compile = pytest.importorskip("jaxflash.kernels.compile")
  variant = next(v for v in VARIANTS if v.head_dim == 128 and v.dtype == "bfloat16"
                 and not v.causal and not v.deterministic)
  assert variant.tile == config.TileConfig(80, 128, 2, swap_sdp=True)
  exp, *_ = exported(variant)
  sass = kernel_compile.disassemble(exp.cubin, exp.header_path.parent)
  ops = _opcodes(sass)
  assert ops.count("LDL") + ops.count("STL") == 0
  assert "-DJAXFLASH_TILE_M=80" in exp.defines
  # Per step S^T 8 + dP^T 8 (64x80x16), dV 5 + dK 5 (64x128x16, A from registers), dQ^T 8
  # (64x80x16, A = K^T transposed): 34, in the masked and the unmasked loop.
  assert ops.count("HGMMA") == 68
  assert len(re.findall(r"HGMMA\.64x80x16\.F32\.BF16 R\d+, gdesc\[UR\d+\]\.tnspA", sass)) == 16
  assert len(re.findall(r"HGMMA\.64x128x16\.F32\.BF16 R\d+, R\d+, gdesc", sass)) == 20
  # Not serialized: one WARPGROUP.ARRIVE per GEMM group (5 per step, two loop copies).
  assert sass.count("WARPGROUP.ARRIVE") == 10
  _assert_ds_stored_from_dk_operand_registers(sass)


@pytest.mark.cutlass
@pytest.mark.parametrize("variant", [v for v in VARIANTS if v.head_dim == 64
                                     and v.dtype == "bfloat16"], ids=lambda v: v.key)
def test_swap_sdp_128_query_rows_at_head_dim_64(exported, variant):
  """hdim 64, 128 x 128 swapped: S^T / dP^T 64 x 128 per warpgroup, dV / dK from registers,
  dS^T stored into both 64-row blocks of the dS tile, the dQ GEMM split by rows (dq_split_m):
  one 64-row block of all 64 columns per warpgroup."""
  kernel_compile = pytest.importorskip("jaxflash.kernels.compile")
  assert variant.tile == config.TileConfig(128, 128, 2, swap_sdp=True)
  exp, ops, full = exported(variant)
  sass = kernel_compile.disassemble(exp.cubin, exp.header_path.parent)
  # Per step and loop copy: S^T 4 + dP^T 4 (64x128x16), dV 8 + dK 8 (64x64x16, A from
  # registers), dQ 8 (64x64x16, A = dS from shared memory).
  assert len(re.findall(r"HGMMA\.64x128x16\.F32\.BF16 R\d+, gdesc", sass)) == 16
  assert len(re.findall(r"HGMMA\.64x64x16\.F32\.BF16 R\d+, R\d+, gdesc", sass)) == 32
  assert len(re.findall(r"HGMMA\.64x64x16\.F32\.BF16 R\d+, gdesc", sass)) == 16
  assert "HGMMA.64x32x16" not in sass and ops["main"].count("HGMMA") == 64
  # dS^T: 8 stmatrix.trans per step and loop copy; the dK / dV epilogue 8 plain ones.
  assert sass.count("STSM.16.MT88.4") == 16 and sass.count("STSM.16.M88.4") == 8
  _assert_ds_stored_from_dk_operand_registers(sass)
  # Not serialized (5 GEMM groups per step, two loop copies); each warpgroup's dQ block
  # reduced whole.
  assert sass.count("WARPGROUP.ARRIVE") == 10
  assert ops["main"].count("UBLKRED") == 2 and full["main"].count("UBLKCP.S.G") == 2
  assert full["main"].count("UBLKCP.G.S") == (2 if variant.deterministic else 0)
  assert ops["main"].count("LDL") + ops["main"].count("STL") == 0


@pytest.mark.cutlass
def test_tile_m_80_only_with_swap_sdp_at_head_dim_128():
  bwd_sm90 = pytest.importorskip("jaxflash.kernels.bwd_sm90")
  import cutlass
  kernel = bwd_sm90.FlashAttentionBackwardSm90
  tile = config.TileConfig(80, 128, 2)
  swapped = config.TileConfig(80, 128, 2, swap_sdp=True)
  assert kernel.can_implement("bfloat16", 128, 128, False, swapped) == (True, "")
  assert kernel.can_implement("bfloat16", 128, 128, False, tile, swap_sdp=True) == (True, "")
  for head_dim, t in ((128, tile), (96, swapped)):
    ok, text = kernel.can_implement("bfloat16", head_dim, head_dim, False, t)
    assert not ok and "tile 80x128 unsupported" in text
  with pytest.raises(ValueError, match="tile_m 80 needs swap_sdp and head_dim 128"):
    kernel(cutlass.BFloat16, 128, 128, tile, False)
  with pytest.raises(ValueError, match="tile_m 80 needs swap_sdp and head_dim 128"):
    kernel(cutlass.BFloat16, 128, 128, swapped, False, swap_sdp=False)
  # K + V 64 KiB, Q + dO 2 x 2 x 20, dS 2 x 20, dQ staging 40, lse2 / delta 1.25, + 1 KiB.
  assert kernel.smem_bytes(128, 128, swapped) == 231680 <= 232448


@pytest.mark.cutlass
@pytest.mark.parametrize("head_dim,tile_m", [(192, 64), (96, 128), (64, 80)])
def test_swap_sdp_names_what_it_needs(head_dim, tile_m):
  bwd_sm90 = pytest.importorskip("jaxflash.kernels.bwd_sm90")
  import cutlass
  tile = config.TileConfig(tile_m, 128, 2, swap_sdp=True)
  with pytest.raises(ValueError, match=f"swap_sdp: accepted: .*; got head_dim {head_dim}, "
                                       f"tile_m {tile_m}"):
    bwd_sm90.FlashAttentionBackwardSm90(cutlass.BFloat16, head_dim, head_dim, tile, False)
  ok, text = bwd_sm90.FlashAttentionBackwardSm90.can_implement(
      "bfloat16", head_dim, head_dim, False,
      dataclasses.replace(tile, tile_n=64 if head_dim > 128 else 128))
  # 192: the swap check names it; 96 x 128 rows and 64 x 80 rows: the tile check comes first.
  assert not ok and f"head_dim {head_dim}" in text
  assert ("swap_sdp" in text) == (head_dim == 192)


@pytest.mark.cutlass
def test_swap_sdp_accepts_128_query_rows_up_to_head_dim_64():
  kernel = pytest.importorskip("jaxflash.kernels.bwd_sm90").FlashAttentionBackwardSm90
  tile = config.TileConfig(128, 128, 2, swap_sdp=True)
  assert kernel.can_implement("bfloat16", 64, 64, True, tile) == (True, "")
  # K + V 32 KiB, Q + dO 2 x 2 x 16, dS 2 x 32 (no P), dQ staging 32, lse2 / delta 2, + 1 KiB.
  assert kernel.smem_bytes(64, 64, tile) == 195 * 1024


@pytest.mark.cutlass
def test_swap_sdp_shared_memory():
  """hdim 128, 64 x 128 x 2: no P, two dS buffers (16 KiB each), 1 KiB of lse2 / delta rows."""
  kernel = pytest.importorskip("jaxflash.kernels.bwd_sm90").FlashAttentionBackwardSm90
  tile = config.TileConfig(64, 128, 2)
  assert kernel.smem_bytes(128, 128, tile) == 193 * 1024
  assert kernel.smem_bytes(128, 128, tile, swap_sdp=True) == 193 * 1024 + 1024
  assert kernel.smem_bytes(128, 128, dataclasses.replace(tile, swap_sdp=True)) == 194 * 1024


@pytest.mark.cutlass
def test_forward_rejects_a_swapped_tile():
  kernel_compile = pytest.importorskip("jaxflash.kernels.compile")
  variant = config.shipped_variants("sm90a", "fwd")[0]
  variant = dataclasses.replace(variant, tile=dataclasses.replace(variant.tile, swap_sdp=True))
  with pytest.raises(ValueError, match="swap_sdp is a backward schedule"):
    kernel_compile.build_kernel(variant)


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
  combos = {(v.dtype, v.head_dim, v.head_dim_v, v.causal, v.deterministic) for v in VARIANTS}
  assert len(combos) == len(VARIANTS) == 2 * len(config.BWD_KERNEL_HEAD_DIM_PAIRS) * 2 * 2
  assert {(v.head_dim, v.head_dim_v) for v in VARIANTS} == {
      (64, 64), (96, 96), (128, 128), (192, 128), (192, 192), (256, 256)}
  assert all(v.direction == "bwd" and v.key.startswith("bwd-") for v in VARIANTS)
  assert [v for v in VARIANTS if v.deterministic] and all(
      "-det" in v.key for v in VARIANTS if v.deterministic)


@pytest.mark.parametrize("head_dim,rows", [(128, 160), (256, 192)])
@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "det"])
def test_bwd_scratch_shapes_round_seq_q_to_the_tile(deterministic, head_dim, rows):
  """seq_q 130 rounds up to 2 query blocks of 80 rows (hdim 128) or 3 of 64 (hdim 256)."""
  cfg = config.AttentionConfig(softmax_scale=0.1, causal=True, deterministic=deterministic)
  variant = config.KernelVariant.for_call("bwd", "sm90a", "bfloat16", head_dim, head_dim, cfg)
  shapes = config.bwd_scratch_shapes(variant, batch=2, seq_q=130, num_heads=3)
  # causal at these head dims: one dQ accumulator even when deterministic
  expected = [("dq_accum", (2, 3, rows, head_dim), "float32"),
              ("lse_log2", (2, 3, rows), "float32"),
              ("delta", (2, 3, rows), "float32")]
  if deterministic:
    expected.append(("dq_semaphore", (2, 3, rows // variant.tile.tile_m), "int32"))
  assert list(shapes) == expected
  with pytest.raises(ValueError, match="direction"):
    config.bwd_scratch_shapes(dataclasses.replace(variant, direction="fwd"), 1, 1, 1)


@pytest.mark.parametrize("head_dim,causal,seq_q_rounded",
                         [(128, False, 160), (128, True, 160), (96, True, 128)])
def test_bwd_scratch_rows_follow_the_80_or_64_row_tile(head_dim, causal, seq_q_rounded):
  """seq_q 100 rounds up to 160 with hdim 128's 80-row tile, to 128 with hdim 96's 64 rows."""
  cfg = config.AttentionConfig(softmax_scale=0.1, causal=causal, deterministic=True)
  variant = config.KernelVariant.for_call("bwd", "sm90a", "bfloat16", head_dim, head_dim, cfg)
  shapes = dict((name, shape) for name, shape, _ in
                config.bwd_scratch_shapes(variant, batch=1, seq_q=100, num_heads=2))
  assert shapes["dq_accum"] == (1, 2, seq_q_rounded, head_dim)
  assert shapes["dq_semaphore"] == (1, 2, 2)


@pytest.mark.parametrize("head_dim,head_dim_v", [(192, 192), (192, 128), (256, 256)])
def test_deterministic_scratch_holds_two_dq_copies_above_hdim_128(head_dim, head_dim_v):
  """Copy c of the accumulator and its semaphores follow copy c - 1 in each (batch, head).
  Two copies without a mask; with the causal mask at hdim 192 up to
  CAUSAL_TWO_DQ_COPIES_MAX_SEQ_Q (4096 at head_dim_v 192, 8192 at 128) and one above; hdim
  256 causal and the default mode one."""
  two_causal = 2 if head_dim == 192 else 1
  limit = config.CAUSAL_TWO_DQ_COPIES_MAX_SEQ_Q.get(head_dim_v)
  assert limit == {192: 4096, 128: 8192}.get(head_dim_v)
  limit = limit or 4096  # hdim 256: a causal call holds one copy at any length
  cases = ((False, True, 100, 2), (False, True, 3 * limit, 2), (True, True, 100, two_causal),
           (True, True, limit, two_causal), (True, True, limit + 1, 1), (False, False, 100, 1),
           (True, False, 100, 1))
  for causal, deterministic, seq_q, copies in cases:
    cfg = config.AttentionConfig(softmax_scale=0.1, causal=causal, deterministic=deterministic)
    variant = config.KernelVariant.for_call("bwd", "sm90a", "bfloat16", head_dim, head_dim_v,
                                            cfg)
    assert config.max_dq_accum_copies(deterministic, causal, head_dim) == (
        2 if deterministic and (not causal or head_dim == 192) else 1)
    assert config.dq_accum_copies(variant, seq_q) == copies
    rows = -(-seq_q // 64) * 64
    shapes = dict((name, shape) for name, shape, _ in
                  config.bwd_scratch_shapes(variant, batch=2, seq_q=seq_q, num_heads=3))
    assert shapes["dq_accum"] == (2, 3, copies * rows, head_dim)
    assert shapes["lse_log2"] == shapes["delta"] == (2, 3, rows)
    assert shapes.get("dq_semaphore") == ((2, 3, copies * rows // 64) if deterministic else None)


def test_dq_copies_agree_between_config_and_the_kernel_abi():
  """The handler takes the copies from the scratch shape (config) and accepts 1 to
  JAXFLASH_DET_DQ_COPIES (kernel_abi.h); the library refuses more than it was built for."""
  header = (pathlib.Path(config.__file__).parent / "ffi" / "kernel_abi.h").read_text()
  found = re.search(r"#define JAXFLASH_DET_DQ_COPIES (\d+)", header)
  assert found and int(found.group(1)) == config.DET_DQ_COPIES == 2


@pytest.mark.cutlass
def test_each_backward_main_kernel_uses_configs_dq_copies():
  """The variant library is built for config's most copies (the handler passes the scratch
  shape's count and the library refuses more); only deterministic kernels take more than one,
  hdim 256 causal not."""
  kernel_compile = pytest.importorskip("jaxflash.kernels.compile")
  for v in VARIANTS:
    pre, main, post = kernel_compile.build_bwd_kernels(v)
    assert main.dq_copies == config.max_dq_accum_copies(v.deterministic, v.causal, v.head_dim)
    assert main.dq_copies == pre.dq_copies == post.dq_copies == (
        2 if v.deterministic and v.head_dim > 128 and not (v.causal and v.head_dim > 192) else 1)
  with pytest.raises(ValueError, match="dq_copies: 2; accepted"):
    kernel_compile.build_bwd_kernels(next(v for v in VARIANTS if not v.deterministic),
                                     {"dq_copies": 2})


def test_kernel_support_for_the_backward():
  cfg = config.AttentionConfig(softmax_scale=0.1)
  assert config.kernel_support("bwd", "bfloat16", 128, 128, cfg) == (True, "")
  assert config.kernel_support("bwd", "float16", 64, 64, cfg.replace(deterministic=True))[0]
  assert config.kernel_support("bwd", "bfloat16", 256, 256, cfg) == (True, "")
  ok, reason = config.kernel_support("bwd", "bfloat16", 160, 160, cfg)
  assert not ok and "head_dim 160" in reason
  assert config.kernel_support("bwd", "bfloat16", 192, 128, cfg) == (True, "")
  ok, reason = config.kernel_support("bwd", "bfloat16", 128, 96, cfg)
  assert not ok and "head_dim_v 96" in reason and "(128,)" in reason
  ok, reason = config.kernel_support("bwd", "bfloat16", 128, 128, cfg.replace(softcap=5.0))
  assert not ok and "softcap" in reason


@pytest.mark.cutlass
def test_det_sync_is_validated_and_only_the_devtools_values_change_the_code(exported, tmp_path):
  """det_sync (devtools measurements of the deterministic ordering): "ordered" is the shipped
  code; "no_wait" / "no_flush" drop the semaphore wait (and the write wait) from the SASS."""
  kernel_compile = pytest.importorskip("jaxflash.kernels.compile")
  bwd_sm90 = pytest.importorskip("jaxflash.kernels.bwd_sm90")
  import cutlass
  det = next(v for v in VARIANTS if v.deterministic and not v.causal and v.head_dim == 64)
  with pytest.raises(ValueError, match=r"det_sync: 'fast'; accepted: \('ordered'"):
    bwd_sm90.FlashAttentionBackwardSm90(cutlass.BFloat16, 64, 64, det.tile, False, True,
                                        det_sync="fast")
  with pytest.raises(ValueError, match="det_sync 'no_wait' needs deterministic=True"):
    bwd_sm90.FlashAttentionBackwardSm90(cutlass.BFloat16, 64, 64, det.tile, False, False,
                                        det_sync="no_wait")
  shipped = exported(det)[0].cubin
  cubins = {}
  for sync in ("ordered", "no_wait", "no_flush"):
    exp = kernel_compile.export_bwd_variant(det, tmp_path / sync, main_args={"det_sync": sync},
                                            key=f"{det.key}+det_sync={sync}")
    ops = _opcodes(kernel_compile.disassemble(exp.cubin, tmp_path))
    assert ops.count("LDL") + ops.count("STL") == 0 and "REDG" in ops, sync
    cubins[sync] = exp.cubin
  assert cubins["ordered"] == shipped
  assert len({cubins["ordered"], cubins["no_wait"], cubins["no_flush"]}) == 3


@pytest.mark.cutlass
def test_rotated_query_order_is_the_deterministic_default_without_a_mask(exported, tmp_path):
  """rotate_m: None (shipped) rotates the query-block walk of the deterministic variants without
  a mask only; forcing it either way changes the code, and the causal order cannot rotate."""
  kernel_compile = pytest.importorskip("jaxflash.kernels.compile")
  bwd_sm90 = pytest.importorskip("jaxflash.kernels.bwd_sm90")
  import cutlass
  det = next(v for v in VARIANTS if v.deterministic and not v.causal and v.head_dim == 128)
  plain = dataclasses.replace(det, deterministic=False)
  with pytest.raises(ValueError, match="rotate_m=True needs causal=False"):
    bwd_sm90.FlashAttentionBackwardSm90(cutlass.BFloat16, 128, 128, det.tile, True, True,
                                        rotate_m=True)

  def build(variant, rotate):
    return kernel_compile.export_bwd_variant(
        variant, tmp_path / f"{variant.key}{rotate}", main_args={"rotate_m": rotate},
        key=f"{variant.key}+rotate_m={int(rotate)}").cubin

  assert build(det, True) == exported(det)[0].cubin != build(det, False)
  assert build(plain, False) == exported(plain)[0].cubin != build(plain, True)


@pytest.mark.cutlass
def test_early_dq_buffer_hand_back_is_deterministic_only(exported, tmp_path):
  """early_dq_empty (shipped True): only the deterministic writer's code changes with it."""
  kernel_compile = pytest.importorskip("jaxflash.kernels.compile")
  det = next(v for v in VARIANTS if v.deterministic and v.causal and v.head_dim == 192)
  plain = dataclasses.replace(det, deterministic=False)

  def build(variant, early):
    return kernel_compile.export_bwd_variant(
        variant, tmp_path / f"{variant.key}{early}", main_args={"early_dq_empty": early},
        key=f"{variant.key}+early_dq_empty={int(early)}").cubin

  assert build(det, True) == exported(det)[0].cubin != build(det, False)
  assert build(plain, False) == exported(plain)[0].cubin


@pytest.mark.cutlass
def test_dq_split_m_is_the_tile_m_128_default_and_only_changes_the_dq_gemm(exported, tmp_path):
  """dq_split_m (on by default at tile_m 128, hdim 64): True builds the shipped cubin; False
  (devtools A/B) splits the dQ GEMM by head_dim again: 16 64 x 32 x 16 per step instead of 8
  64 x 64 x 16, and each warpgroup's two 64-row blocks leave in two bulk reductions."""
  kernel_compile = pytest.importorskip("jaxflash.kernels.compile")
  bwd_sm90 = pytest.importorskip("jaxflash.kernels.bwd_sm90")
  import cutlass
  with pytest.raises(ValueError, match="dq_split_m: needs tile_m 128 .* got tile_m 64, "
                                       "head_dim 128"):
    bwd_sm90.FlashAttentionBackwardSm90(cutlass.BFloat16, 128, 128,
                                        config.TileConfig(64, 128, 2, swap_sdp=True), False,
                                        dq_split_m=True)
  variant = next(v for v in VARIANTS if v.head_dim == 64 and v.dtype == "bfloat16"
                 and v.causal and v.deterministic)

  def build(split):
    return kernel_compile.export_bwd_variant(
        variant, tmp_path / str(split), main_args={"dq_split_m": split},
        key=f"{variant.key}+dq_split_m={int(split)}")

  assert build(True).cubin == exported(variant)[0].cubin
  exp = build(False)
  sass = kernel_compile.disassemble(exp.cubin, tmp_path)
  ops = _opcodes(sass)
  assert ops.count("LDL") + ops.count("STL") == 0
  assert len(re.findall(r"HGMMA\.64x32x16\.F32\.BF16 R\d+, gdesc", sass)) == 32
  assert ops.count("HGMMA") == 80 and ops.count("UBLKRED") == 4


@pytest.mark.cutlass
def test_dq_split_m_keeps_the_accumulator_layout():
  """devtools/kernel_selftest/probe_dq_split_m.py: every dQ value of the row split lands where
  the postprocess reads its (row, column); the head_dim split passes the same check, and the
  row split with the head_dim split's writer addresses must fail it."""
  probe = (pathlib.Path(__file__).parents[1] / "devtools" / "kernel_selftest"
           / "probe_dq_split_m.py")
  run = subprocess.run([sys.executable, str(probe)], capture_output=True, text=True, timeout=600)
  assert run.returncode == 0, run.stdout + run.stderr
  assert "row split: 0 of 8192 values mismatched" in run.stdout
  assert "negative: row split, head_dim split writer: 4096 of 8192" in run.stdout


@pytest.mark.cutlass
@pytest.mark.parametrize("causal,deterministic", [(False, False), (True, True)],
                         ids=["plain", "causal-det"])
def test_head_dim_192_with_head_dim_v_128_compiles(exported, causal, deterministic):
  """192 / 128 (MLA): built by the head-dim split like 192 / 192, with dV's and dP's GEMMs over
  128 columns."""
  kernel = pytest.importorskip("jaxflash.kernels.bwd_sm90").FlashAttentionBackwardSm90
  assert kernel.can_implement("bfloat16", 192, 128, causal, config.TileConfig(64, 64, 2)) == (
      True, "")
  ok, text = kernel.can_implement("bfloat16", 128, 96, causal, config.TileConfig(64, 128, 2))
  assert not ok and "head_dim_v 96 with head_dim 128" in text and "(192, 128)" in text
  variant = next(v for v in VARIANTS if (v.head_dim, v.head_dim_v) == (192, 128)
                 and v.dtype == "bfloat16" and v.causal == causal
                 and v.deterministic == deterministic)
  exp, ops, _ = exported(variant)
  sass = pytest.importorskip("jaxflash.kernels.compile").disassemble(
      exp.cubin, exp.header_path.parent)
  assert f'-DJAXFLASH_VARIANT_KEY="{variant.key}"' in exp.defines
  assert all(ops[part].count("LDL") + ops[part].count("STL") == 0 for part in ops)
  # Per step and loop copy, per warpgroup: S (K = 192) 12 + dP (K = 128) 8 of 64x32x16 (its
  # 32 keys); dV (N = 64, half of 128) 4 of 64x64x16; dK and dQ (N = 96) 4 + 4 of 64x96x16.
  assert len(re.findall(r"HGMMA\.64x32x16\.F32\.BF16", sass)) == 40
  assert len(re.findall(r"HGMMA\.64x64x16\.F32\.BF16", sass)) == 8
  assert len(re.findall(r"HGMMA\.64x96x16\.F32\.BF16", sass)) == 16


@pytest.mark.cutlass
@pytest.mark.parametrize("causal", [False, True])
def test_deterministic_release_on_its_own_warp_and_two_dq_copies_above_hdim_128(exported,
                                                                                 tmp_path,
                                                                                 causal):
  """Shipped deterministic kernels hand each semaphore release to producer warp 2 (named
  barriers 8 / 9 of 64 threads); release_warp=False puts it back on the writer. The hdim 192
  variants are built for two dQ accumulators (a call may hold one): the preprocess resets a
  second semaphore per block, the postprocess loads twice what the one-copy build does, all
  in 128-bit loads besides one semaphore load per copy."""
  kernel_compile = pytest.importorskip("jaxflash.kernels.compile")
  det = next(v for v in VARIANTS if v.deterministic and v.causal == causal and v.head_dim == 192
             and v.head_dim_v == 192 and v.dtype == "bfloat16")
  shipped, ops, full = exported(det)
  handoff = re.compile(r"BAR\.(?:SYNC\S*|ARV) 0x[89], 0x40")

  def sass(exp):
    return kernel_compile.disassemble(exp.cubin, tmp_path)

  assert len(handoff.findall(sass(shipped))) >= 4  # sync + arrive on each side
  own = kernel_compile.export_bwd_variant(det, tmp_path / "own", main_args={"release_warp": False},
                                          key=f"{det.key}+release_warp=0")
  assert "REDG" in _opcodes(sass(own)) and not handoff.search(sass(own))
  one, one_ops, _ = _export_ab(det, tmp_path / "one", dq_copies=1)
  assert ops["post"].count("LDG") == 2 * one_ops["post"].count("LDG") > 0
  assert full["post"].count("LDG.E.128") == ops["post"].count("LDG") - 2 == 24
  assert ops["pre"].count("STG") > one_ops["pre"].count("STG")
  assert "-DJAXFLASH_MAX_DQ_COPIES=2" in shipped.defines
  assert "-DJAXFLASH_MAX_DQ_COPIES=1" in one.defines


@pytest.mark.cutlass
@pytest.mark.parametrize("head_dim,causal", [(128, False), (192, False), (64, True)])
def test_deterministic_first_contribution_is_a_store_and_nothing_zeroes_the_accumulator(
    exported, tmp_path, head_dim, causal):
  """first_store (deterministic default): the rank-0 key block of each dQ accumulator block
  writes it with a bulk store (UBLKCP), the others add (UBLKRED); the preprocess then writes
  lse2 / delta and the semaphores only, and the postprocess reads a block only where its
  semaphore (one 32-bit load per copy) counts a contribution. first_store=0 is the
  zero-then-reduce build; the default mode never stores."""
  bwd_sm90 = pytest.importorskip("jaxflash.kernels.bwd_sm90")
  import cutlass
  det = next(v for v in VARIANTS if v.deterministic and v.causal == causal
             and v.head_dim == v.head_dim_v == head_dim and v.dtype == "bfloat16")
  plain = dataclasses.replace(det, deterministic=False)
  copies = config.max_dq_accum_copies(True, causal, head_dim)
  shipped, ops, full = exported(det)
  zeroing, z_ops, z_full = _export_ab(det, tmp_path / "zero", first_store=False)
  z_main = z_full["main"]
  # UBLKCP.G.S: shared -> global bulk copy (UBLKCP.S.G loads the lse2 / delta rows).
  assert "UBLKCP.G.S" in full["main"] and "UBLKRED.G.S.ADD.F32.RN" in full["main"]
  assert "UBLKCP.G.S" not in z_main and "UBLKCP.G.S" not in exported(plain)[2]["main"]
  assert "UBLKRED.G.S.ADD.F32.RN" in z_main
  # Per CTA: one lse2 and one delta store per row pass, one semaphore per copy; the zeroing
  # build adds tile_m * head_dim / 256 floats per copy (at least 32 stores).
  assert ops["pre"].count("STG") + 32 * copies <= z_ops["pre"].count("STG")
  assert ops["post"].count("LDG") == z_ops["post"].count("LDG") + copies
  assert "-DJAXFLASH_FIRST_STORE=1" in shipped.defines
  assert "-DJAXFLASH_FIRST_STORE=0" in zeroing.defines
  assert "-DJAXFLASH_FIRST_STORE=0" in exported(plain)[0].defines
  assert "_Tensor_mSem_t" in shipped.extra_object_paths[1].with_suffix(".h").read_text()
  assert "_Tensor_mSem_t" not in zeroing.extra_object_paths[1].with_suffix(".h").read_text()
  with pytest.raises(ValueError, match="first_store=True needs deterministic=True"):
    bwd_sm90.FlashAttentionBackwardSm90(cutlass.BFloat16, head_dim, head_dim, det.tile, causal,
                                        False, first_store=True)


@pytest.mark.cutlass
@pytest.mark.parametrize("head_dim,causal", [(128, False), (64, True)])
def test_dv_gemm_after_ds_at_80_and_128_query_rows(exported, tmp_path, head_dim, causal):
  """dv_after_ds (default at 80 / 128 query rows): the dV GEMM is issued after dS^T is stored,
  so dS takes the fp32 P; the dv_after_ds=0 build computes dS from the rounded P, whose bf16
  -> fp32 unpacking costs ~100-190 SASS instructions (PRMT / IMAD). Both keep 10 WGMMA
  groups per loop copy and no spills (issued before the dS^T store, ptxas serialized every
  WGMMA and spilled). 64-row tiles keep it off."""
  bwd_sm90 = pytest.importorskip("jaxflash.kernels.bwd_sm90")
  import cutlass
  variant = next(v for v in VARIANTS if v.head_dim == v.head_dim_v == head_dim
                 and v.causal == causal and not v.deterministic and v.dtype == "bfloat16")
  assert variant.tile.tile_m in (80, 128)
  _, ops, _ = exported(variant)
  before_ops = _export_ab(variant, tmp_path, dv_after_ds=False)[1]["main"]
  for opcodes in (ops["main"], before_ops):
    assert opcodes.count("LDL") + opcodes.count("STL") == 0
    assert opcodes.count("WARPGROUP") == 18, opcodes.count("WARPGROUP")
  assert ops["main"].count("HGMMA") == before_ops.count("HGMMA")
  assert len(ops["main"]) + 100 <= len(before_ops), (len(ops["main"]), len(before_ops))
  assert ops["main"].count("PRMT") + 40 <= before_ops.count("PRMT")
  tile64 = next(v for v in VARIANTS if v.tile.tile_m == 64 and v.tile.swap_sdp)
  assert not bwd_sm90.FlashAttentionBackwardSm90(cutlass.BFloat16, tile64.head_dim,
                                                 tile64.head_dim_v, tile64.tile,
                                                 tile64.causal).dv_after_ds
  with pytest.raises(ValueError, match="dv_after_ds=True needs swap_sdp"):
    bwd_sm90.FlashAttentionBackwardSm90(cutlass.BFloat16, 192, 192, config.TileConfig(64, 64, 2),
                                        False, dv_after_ds=True)
