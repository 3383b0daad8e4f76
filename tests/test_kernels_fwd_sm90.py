"""The Hopper forward kernel (kernels/fwd_sm90.py) compiled for sm_90a on a GPU-less host.

Every shipped variant is exported once per session; the SASS checks assert structure (WGMMA,
TMA, no local-memory spills, the overlap and rescale branches the schedule relies on), not
instruction counts. Needs nvidia-cutlass-dsl (marker `cutlass`, skipped elsewhere).
"""

import dataclasses
import math
import re

import pytest

cutlass = pytest.importorskip("cutlass")

from jaxflash import build, config  # noqa: E402
from jaxflash.kernels import compile as kernel_compile  # noqa: E402
from jaxflash.kernels import sm90_gemm, softmax  # noqa: E402
from jaxflash.kernels.fwd_sm90 import FlashAttentionForwardSm90  # noqa: E402
from tests import _sass  # noqa: E402

pytestmark = pytest.mark.cutlass

# The fp16/bf16 variants (the FP8 ones: tests/test_kernels_fwd_fp8_sm90.py).
VARIANTS = [v for v in config.shipped_variants("sm90a", "fwd") if v.dtype != config.FP8_DTYPE]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  return _sass.exporter(tmp_path_factory)


@pytest.mark.parametrize("variant", _sass.compiled_variants(VARIANTS), ids=lambda v: v.key)
def test_sass_uses_wgmma_and_tma_without_spills(exported, variant):
  e = exported(variant)
  ops = e.ops()
  assert e.exp.cubin[:4] == b"\x7fELF"
  assert {"HGMMA", "UTMALDG", "UTMASTG"} <= set(ops), "WGMMA, TMA loads and the O TMA store"
  _sass.assert_no_spills(ops, variant.key)
  _sass.assert_wgmma_not_serialized(e.sass["main"])
  # S = Q K^T is 64 x tile_n per warpgroup, O += P V is 64 x head_dim_v.
  assert _sass.wgmma_shapes(e.sass["main"]) == {f"64x{variant.schedule.tile_n}x16",
                                                f"64x{variant.head_dim_v}x16"}


@pytest.mark.parametrize("variant", _sass.compiled_variants(VARIANTS), ids=lambda v: v.key)
def test_overlapped_step_and_warp_uniform_rescale(exported, variant):
  """The steady step issues S(j+1) = Q K^T and O += P(j) V back to back and waits for the first
  alone (wait_group 1) before the softmax; each conditional-rescale skip branches on a VOTE.ANY
  predicate (warp-uniform), with no reconvergence barrier."""
  sass = exported(variant).sass["main"]
  assert "WARPGROUP.DEPBAR.LE gsb0, 0x1" in sass
  lines = sass.splitlines()
  votes = 0
  for i, line in enumerate(lines):
    m = re.search(r"VOTE\.ANY (U?P\d), (!?U?PT)?", line)
    if not m or m.group(2):
      # A vote of a constant decides nothing: ptxas's copy of the step under a fixed row max
      # (masked variants, softcap), where every row scale is 1.
      continue
    votes += 1
    pred = m.group(1)
    # The vote's predicate is next read (or overwritten) by the branch that skips the work,
    # with no reconvergence barrier set up in between.
    j = next((j for j in range(i + 1, len(lines)) if re.search(rf"\b{pred}\b", lines[j])),
             len(lines) - 1)
    assert re.search(rf"@!?{pred}\s+BRA\b", lines[j]), (line, lines[j])
    assert not any("BSSY" in l for l in lines[i:j]), lines[i:j + 1]
  # First block's softmax, then per steady step a softmax and an O vote.
  assert votes >= 3, votes


@pytest.mark.parametrize("variant", _sass.compiled_variants(VARIANTS), ids=lambda v: v.key)
def test_dynamic_schedules_claim_tiles_with_an_atomic_add(exported, variant):
  """A dynamic schedule's producer warp claims tiles with a global atomic add from one lane and
  broadcasts the tile: two sites, the claim after each tile's loads and the first
  claim of a CTA past the resident ones. A static schedule touches no counter."""
  sass = exported(variant).sass["main"]
  claims = re.findall(r"ATOMG\.E\.ADD\S*", sass)
  assert len(claims) == (2 if variant.schedule.dynamic else 0), claims
  assert all(".GPU" in c for c in claims), claims


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v.dtype == "bfloat16"],
                         ids=lambda v: v.key)
def test_pingpong_turns_are_named_barriers(exported, variant):
  """Ping-pong (up to hdim 128): each consumer warpgroup waits for its GEMM turn on named
  barrier 2 + w and hands it on with an arrive."""
  turns = _sass.pingpong_turns(exported(variant).sass["main"])
  assert bool(turns) == variant.schedule.pingpong, turns


@pytest.mark.parametrize("variant", [v for v in _sass.compiled_variants(VARIANTS)
                                     if v.dtype == "bfloat16" and v.head_dim in (64, 128)],
                         ids=lambda v: v.key)
def test_causal_first_tile_stores_o_from_registers(exported, variant):
  """Dense causal tiles end at the last row, so a call's first tile may start above row 0,
  where a TMA store faults: its O leaves by per-thread global stores (16-bit pairs, which
  ptxas merges into 32-bit STG.E), the other tiles by the TMA store. Other variants store O by
  TMA only (their STG.E are the LSE rows)."""
  sass = exported(variant).sass["main"]
  s = variant.schedule
  pairs_per_thread = s.tile_m * variant.head_dim_v // (s.tile_m // 64 * 128) // 2
  stores = len(re.findall(r"\bSTG\.E ", sass))
  assert "UTMASTG" in sass
  if variant.causal and not variant.masked:
    assert stores >= pairs_per_thread, (stores, pairs_per_thread)
  else:
    assert stores < pairs_per_thread, (stores, pairs_per_thread)


def test_causal_variant_differs_from_non_causal(exported):
  causal = next(v for v in _sass.compiled_variants(VARIANTS) if v.causal)
  plain = dataclasses.replace(causal, causal=False)
  assert exported(causal).exp.cubin != exported(plain).exp.cubin


@pytest.mark.parametrize("variant", _sass.compiled_variants(VARIANTS)[:2], ids=lambda v: v.key)
def test_header_declares_wrapper_and_tensor_structs(exported, variant):
  exp = exported(variant).exp
  header = exp.header_path.read_text()
  prefix = exp.function_prefix
  assert f"int32_t cute_dsl_{prefix}_wrapper(" in header
  assert f"{prefix}_Kernel_Module_Load" in header
  for name in ("mQ", "mK", "mV", "mO", "mLSE"):
    assert re.search(rf"int32_t dynamic_shapes\[3\];\s*int64_t dynamic_strides\[2\];\s*\}}"
                     rf" {prefix}_Tensor_{name}_t;", header), name
  # The learnable sink: a (num_heads,) vector of every variant, and the has_sink flag.
  assert re.search(rf"int32_t dynamic_shapes\[1\];\s*\}} {prefix}_Tensor_mSink_t;", header)
  wrapper = header[header.index(f"cute_dsl_{prefix}_wrapper("):]
  assert re.search(r"_Tensor_mSink_t \*mSink, .*float softmax_scale, int32_t has_sink", wrapper)


@pytest.mark.parametrize("masked", [False, True], ids=["causal", "masked"])
def test_linked_library_exports_the_kernel_abi_and_describes_its_variant(exported, tmp_path,
                                                                         masked):
  variant = next(v for v in VARIANTS if (v.masked if masked else v.causal)
                 and v.head_dim == 128 and v.dtype == "bfloat16")
  lib_path = tmp_path / "fwd.so"
  build.link_variant(exported(variant).exp, variant, lib_path)
  assert build.exported_symbols(lib_path) == set(build.variant_abi_symbols("fwd"))
  # Key, version, info and argument validation need no GPU.
  lib, info = _sass.library_info(lib_path)
  assert lib.jaxflash_variant_key().decode() == variant.key
  assert lib.jaxflash_variant_abi_version() == _sass.abi_version()
  assert info == dict(direction=0, dtype=1, head_dim=128, head_dim_v=128, causal=int(not masked),
                      deterministic=0, tile_m=variant.schedule.tile_m, max_dq_copies=1,
                      masked=int(masked), tile_n=variant.schedule.tile_n,
                      tile_counter=int(kernel_compile.takes_tile_counter(variant)), kv_fp8=0)
  assert lib.jaxflash_variant_fwd(None, None) == 1  # cudaErrorInvalidValue


def test_every_forward_schedule_fits_in_shared_memory():
  for v in VARIANTS:
    smem = FlashAttentionForwardSm90.smem_bytes(v)
    assert smem <= sm90_gemm.SMEM_CAPACITY, (v.key, smem)


def test_can_implement_is_kernel_support():
  variant = VARIANTS[0]
  assert FlashAttentionForwardSm90.can_implement(variant) == (True, "")
  odd = dataclasses.replace(variant, head_dim=80, head_dim_v=80)
  ok, reason = FlashAttentionForwardSm90.can_implement(odd)
  assert (ok, reason) == config.kernel_support("fwd", variant.dtype, 80, 80)
  with pytest.raises(ValueError, match="head_dim 80 has no fwd kernel"):
    kernel_compile.build_kernel(odd)
  bwd = config.shipped_variants("sm90a", "bwd")[0]
  with pytest.raises(ValueError, match="not a forward variant"):
    kernel_compile.build_kernel(bwd)


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v.masked and v.dtype == "bfloat16"],
                         ids=lambda v: v.key)
def test_masked_forward_copies_key_ids_with_each_k_stage(exported, variant):
  """Masked variants: each K stage also carries its key block's segment ids (a bulk copy,
  UBLKCP.S.G, on the K stage's barrier); the dense variants copy none. Masked variants claim
  their tiles (a dynamic schedule), causal at run time."""
  assert not variant.causal and variant.schedule.dynamic
  assert "UBLKCP.S.G" in exported(variant).ops(modifiers=True)
  dense = next(v for v in VARIANTS if not v.masked and v.causal and v.dtype == variant.dtype
               and (v.head_dim, v.head_dim_v) == (variant.head_dim, variant.head_dim_v))
  assert dense.schedule.tile_n == variant.schedule.tile_n
  assert "UBLKCP.S.G" not in exported(dense).ops(modifiers=True)


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v.masked and v.dtype == "bfloat16"],
                         ids=lambda v: v.key)
def test_masked_forward_soft_caps_behind_a_warp_uniform_branch(exported, variant):
  """Masked variants take softcap at run time: one MUFU.TANH per score of each step, behind
  branches the call's softcap decides for the whole CTA, at four softmax sites (the first
  block, the three step loops), and on two-warpgroup tiles at a fifth: the loop of blocks
  without the mask once more, with the fixed row max (not in bias variants: a bias has no
  bound, so they keep the running max). The dense variants have none."""
  e = exported(variant)
  ops = e.ops(modifiers=True)
  per_thread_scores = variant.schedule.tile_n // 2  # 64 rows x tile_n per warpgroup / 128
  sites = 5 if variant.schedule.tile_m == 128 and not variant.bias else 4
  assert ops.count("MUFU.TANH") == sites * per_thread_scores
  # The fixed max rounds P in packed pairs (F2FP): a scalar conversion (F2F) would share the MUFU
  # pipe with the tanh and exp2.
  assert not [op for op in ops if op.startswith("F2F.")]
  dense = next(v for v in VARIANTS if not v.masked and v.dtype == variant.dtype
               and (v.head_dim, v.head_dim_v) == (variant.head_dim, variant.head_dim_v))
  assert "MUFU.TANH" not in exported(dense).ops(modifiers=True)


@pytest.mark.parametrize("dtype,largest_softcap,softcap_over,normal_low,finite_high", [
    ("bfloat16", 50.0, 51.0, -126, 127),  # Gemma 2's 50 fits; V down to 2^-46, sums to 2^61
    ("float16", 10.0, 11.0, -14, 15)])
def test_fixed_capped_max_range_holds_the_softcaps_it_serves(dtype, largest_softcap,
                                                             softcap_over, normal_low,
                                                             finite_high):
  """softmax.capped_p_range_log2: a fixed row max serves a softcap whose capped scores span
  2 * softcap * log2 e within the range (capped_start_max), and the range keeps P (fp16) or
  P V's fp32 products and sums (bf16, for values in [2^-46, 2^61]) normal and finite."""
  low, high = softmax.capped_p_range_log2(cutlass.BFloat16 if dtype == "bfloat16"
                                          else cutlass.Float16)
  span = lambda softcap: 2.0 * softcap * math.log2(math.e)  # noqa: E731
  assert span(largest_softcap) <= high - low < span(softcap_over)
  if dtype == "bfloat16":
    assert low - 46 >= normal_low and high + 61 <= finite_high
  else:
    assert low >= normal_low and high <= finite_high


# The bfloat16 bias variants: a float16 twin compiles to the same code with the other
# element type (_sass.compiled_variants).
@pytest.mark.parametrize("variant", [v for v in _sass.compiled_variants(VARIANTS) if v.bias],
                         ids=lambda v: v.key)
def test_bias_forward_reads_each_k_stage_s_bias_tile_from_shared_memory(exported, variant):
  """Bias variants: the producer loads each key block's bias tile (tile_m x tile_n, as two TMA
  boxes of 64 keys: the 128-byte swizzle) with its K tile, at the two K loads of a tile; every
  softmax site (the first block, the three step loops) reads a thread's 64 bias values with 8
  ldmatrix.x4 (LDSM.16.M88.4) and loads no bias from global memory; the K stage carries the
  bias tile's bytes; smem fits. Other masked variants have none of it."""
  e = exported(variant)
  ops = e.ops(modifiers=True)
  boxes = variant.schedule.tile_n * 2 // 128
  assert ops.count("UTMALDG.3D") == 2 * boxes
  assert ops.count("LDSM.16.M88.4") == 4 * variant.schedule.tile_n // 16
  assert not [op for op in ops if op.startswith("LDG.E.U16") or op.startswith("LDG.E.16")]
  # The K stage's transaction bytes: K, its key ids and the bias tile.
  s = variant.schedule
  k_bytes = s.tile_n * variant.head_dim * 2 + s.tile_n * 4 + s.tile_m * s.tile_n * 2
  assert re.search(rf"IMAD\.MOV\.U32 R\d+, RZ, RZ, {k_bytes:#x}\b", e.sass["main"]), hex(k_bytes)
  assert FlashAttentionForwardSm90.smem_bytes(variant) <= sm90_gemm.SMEM_CAPACITY
  plain = next(v for v in VARIANTS if v.masked and not v.bias and v.dtype == variant.dtype
               and (v.head_dim, v.head_dim_v) == (variant.head_dim, variant.head_dim_v)
               and v.schedule.tile_m == variant.schedule.tile_m)
  plain_ops = exported(plain).ops(modifiers=True)
  assert "LDSM.16.M88.4" not in plain_ops and "UTMALDG.3D" not in plain_ops

