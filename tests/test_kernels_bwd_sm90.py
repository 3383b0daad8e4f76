"""The Hopper backward kernels (kernels/bwd_sm90.py, bwd_preprocess.py, bwd_postprocess.py)
compiled for sm_90a on a GPU-less host.

Every shipped variant is exported once per session (three cubins each); the SASS checks assert
the structure each schedule relies on (WGMMA operands, bulk copies, the dQ hand-off, no
local-memory spills), not instruction counts. Needs nvidia-cutlass-dsl (marker `cutlass`).
"""

import dataclasses
import re

import pytest

pytest.importorskip("cutlass")

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402

from jaxflash import build, config  # noqa: E402
from jaxflash.kernels import bwd_common, sm90_gemm  # noqa: E402
from jaxflash.kernels import compile as kernel_compile  # noqa: E402
from jaxflash.kernels.bwd_sm90 import FlashAttentionBackwardSm90  # noqa: E402
from tests import _sass  # noqa: E402

pytestmark = pytest.mark.cutlass

VARIANTS = config.shipped_variants("sm90a", "bwd")
# A register-operand WGMMA: "HGMMA.64x128x16.F32[.BF16] Rd, Ra, gdesc[...]" (fp16: no suffix).
_RS_GEMM = re.compile(r"HGMMA\.64x\d+x16\.F32(?:\.BF16)? R\d+, (R\d+), gdesc")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  return _sass.exporter(tmp_path_factory)


def _find(**fields):
  return next(v for v in VARIANTS if v.dtype == "bfloat16"
              and all(getattr(v, k) == want for k, want in fields.items()))


@pytest.mark.parametrize("variant", _sass.compiled_variants(VARIANTS), ids=lambda v: v.key)
def test_sass_of_each_compiled_variant(exported, variant):
  e = exported(variant)
  main, pre, post = e.ops(), e.ops("pre"), e.ops("post")
  for part in ("main", "pre", "post"):
    _sass.assert_no_spills(e.ops(part), f"{variant.key} {part}")
  # TMA loads of K / V / Q / dO, TMA stores of dK / dV, bulk reductions of dQ.
  assert {"HGMMA", "UTMALDG", "UTMASTG", "UBLKRED"} <= set(main)
  _sass.assert_wgmma_not_serialized(e.sass["main"])
  _sass.assert_operand_descriptors_uniform(e.sass["main"])
  # The dQ accumulator moves in 4-float chunks (bwd_common.fragment_chunks): 128-bit shared
  # stores to stage it, 128-bit loads in the postprocess.
  assert "STS.128" in e.ops(modifiers=True)
  post_full = e.ops("post", modifiers=True)
  assert "LDG.E.128" in post_full
  # The postprocess leaves through stmatrix and one TMA store, never per-element stores.
  assert {"UTMASTG", "STSM"} <= set(post) and "STG" not in post
  # Deterministic: semaphore releases (REDG) and one 32-bit semaphore load per dQ copy in the
  # postprocess; the default mode has neither.
  copies = variant.schedule.dq_copies
  assert ("REDG" in main) == variant.deterministic
  assert post_full.count("LDG.E") == (copies if variant.deterministic else 0)
  assert "STG" in pre


@pytest.mark.parametrize("variant", [v for v in _sass.compiled_variants(VARIANTS)
                                     if v.schedule.swap_sdp], ids=lambda v: v.key)
def test_swapped_schedule_feeds_dv_and_dk_from_registers(exported, variant):
  """swap_sdp: S^T / dP^T per warpgroup; dV and dK take A (P^T, dS^T) from registers; dS^T is
  stored by stmatrix.trans straight from the dK GEMM's A registers; the block's lse2 / delta
  rows arrive by bulk copy with Q and dO; with dv_after_ds the dV GEMM follows that store."""
  e = exported(variant)
  sass, s = e.sass["main"], variant.schedule
  rs_operands = _RS_GEMM.findall(sass)
  assert rs_operands, "no register-operand WGMMA"
  # Each stmatrix.trans x4 of dS^T stores one k block of the dK GEMM's A operand: key r,
  # queries q, q + 1 / key r + 8 / queries q + 8, q + 9 ... with no repacking in between
  # (a repacked source put key r + 8 of query q at query q + 1).
  sources = re.findall(r"STSM\.16\.MT88\.4 \[[^\]]*\], (R\d+)", sass)
  assert sources and set(sources) <= set(rs_operands), (sources, sorted(set(rs_operands)))
  assert "UBLKCP.S.G" in e.ops(modifiers=True)
  ops = e.ops(modifiers=True)
  first_rs = next(i for i, line in enumerate(_sass.opcodes(sass, modifiers=True))
                  if line.startswith("HGMMA") and _rs_at(sass, i))
  assert ("STSM.16.MT88.4" in ops[:first_rs]) == s.dv_after_ds
  shapes = _sass.wgmma_shapes(sass)
  assert f"64x{s.tile_m}x16" in shapes  # S^T, dP^T: 64 keys x tile_m queries
  if s.dq_transposed:  # dQ^T = K^T dS^T, A = K^T read transposed
    assert re.search(rf"HGMMA\.64x{s.tile_m}x16\.F32\S* R\d+, gdesc\[UR\d+\]\.tnspA", sass)
  if s.dq_split_m:  # each warpgroup one 64-row block of all of head_dim
    assert f"64x{variant.head_dim // 2}x16" not in shapes


def _rs_at(sass, index):
  """Whether SASS instruction `index` (in opcodes() order) is a register-operand HGMMA."""
  lines = [m.group(0) for m in re.finditer(
      r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P[T0-9]+\s+)?[A-Z].*$", sass, re.M)]
  return bool(_RS_GEMM.search(lines[index]))


@pytest.mark.parametrize("variant", [v for v in VARIANTS if not v.schedule.swap_sdp
                                     and v.dtype == "bfloat16"], ids=lambda v: v.key)
def test_head_dim_split_gemm_shapes(exported, variant):
  """Head-dim split (hdim > 128): S and dP 64 x 32 per warpgroup (its half of 64 keys); dV over
  half of head_dim_v, dK and dQ over half of head_dim, all 64 keys, A from shared memory."""
  sass = exported(variant).sass["main"]
  assert _sass.wgmma_shapes(sass) == {"64x32x16", f"64x{variant.head_dim_v // 2}x16",
                                      f"64x{variant.head_dim // 2}x16"}
  assert not _RS_GEMM.search(sass)


@pytest.mark.parametrize("head_dim,causal", [(64, True), (128, False), (192, True), (256, False)])
def test_deterministic_hand_off(exported, head_dim, causal):
  """Deterministic: the writer warp hands each semaphore release to producer warp 2 (named
  barriers 8 / 9 of 64 threads); the first contribution to each accumulator block is a bulk
  store (UBLKCP.G.S), so the preprocess zeroes no accumulator, only semaphores. The default
  mode only adds (UBLKRED), and its preprocess zeroes the accumulator."""
  det = exported(_find(head_dim=head_dim, causal=causal, deterministic=True))
  plain = exported(_find(head_dim=head_dim, causal=causal, deterministic=False))
  handoff = re.compile(r"BAR\.(?:SYNC\S*|ARV) 0x[89], 0x40")
  assert len(handoff.findall(det.sass["main"])) >= 4 and not handoff.search(plain.sass["main"])
  assert "UBLKCP.G.S" in det.ops(modifiers=True)
  assert "UBLKCP.G.S" not in plain.ops(modifiers=True)
  # The zeroing takes at least tile_m * head_dim / 256 = 32 stores per CTA.
  assert det.ops("pre").count("STG") + 32 <= plain.ops("pre").count("STG") + 2


def test_two_dq_copies_are_read_and_summed_by_the_postprocess(exported):
  """Deterministic hdim 192 keeps two dQ accumulators (the call's count comes from the scratch
  shape): the postprocess loads both with 128-bit loads."""
  det = exported(_find(head_dim=192, head_dim_v=192, causal=False, deterministic=True))
  plain = exported(_find(head_dim=192, head_dim_v=192, causal=False, deterministic=False))
  assert det.exp.variant.schedule.dq_copies == 2
  loads = [e.ops("post", modifiers=True).count("LDG.E.128") for e in (det, plain)]
  assert loads[0] == 2 * loads[1] > 0, loads
  assert "-DJAXFLASH_MAX_DQ_COPIES=2" in det.exp.defines


def test_causal_and_deterministic_reach_the_device_code(exported):
  plain = exported(_find(head_dim=128, causal=False, deterministic=False)).exp.cubin
  for flag in ("causal", "deterministic"):
    other = _find(head_dim=128, **{"causal": False, "deterministic": False, flag: True})
    assert exported(other).exp.cubin != plain, flag


@pytest.mark.parametrize("variant", [_find(head_dim=64, causal=False, deterministic=False),
                                     _find(head_dim=64, causal=True, deterministic=True)],
                         ids=lambda v: v.key)
def test_headers_declare_three_wrappers(exported, variant):
  exp = exported(variant).exp
  for path in (exp.header_path, *(p.with_suffix(".h") for p in exp.extra_object_paths)):
    header = path.read_text()
    prefix = re.search(r"int32_t cute_dsl_(\w+)_wrapper\(", header).group(1)
    assert prefix.startswith(exp.function_prefix) and prefix.endswith(("_pre", "_main", "_post"))
    assert f"{prefix}_Kernel_Module_Load" in header
  assert ("_Tensor_mSem_t" in exp.header_path.read_text()) == variant.deterministic


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "det"])
def test_linked_library_exports_the_bwd_abi_and_describes_its_variant(exported, tmp_path,
                                                                       deterministic):
  variant = _find(head_dim=192, head_dim_v=128, causal=True, deterministic=deterministic)
  lib_path = tmp_path / "bwd.so"
  build.link_variant(exported(variant).exp, variant, lib_path)
  assert build.exported_symbols(lib_path) == set(build.variant_abi_symbols("bwd"))
  lib, info = _sass.library_info(lib_path)
  assert lib.jaxflash_variant_key().decode() == variant.key
  assert lib.jaxflash_variant_abi_version() == _sass.abi_version()
  assert info == dict(direction=1, dtype=1, head_dim=192, head_dim_v=128, causal=1,
                      deterministic=int(deterministic), tile_m=64,
                      max_dq_copies=2 if deterministic else 1, masked=0, tile_n=64,
                      tile_counter=0, kv_fp8=0)
  assert lib.jaxflash_variant_bwd(None, None) == 1  # cudaErrorInvalidValue


def test_every_backward_schedule_fits_in_shared_memory():
  for v in VARIANTS:
    smem = FlashAttentionBackwardSm90.smem_bytes(v)
    assert smem <= sm90_gemm.SMEM_CAPACITY, (v.key, smem)
  # hdim 128 at 80 rows: K + V 64 KiB, Q + dO 2 x 2 x 20, dS 2 x 20, dQ staging 40, lse2 /
  # delta 1.25, + 1 KiB alignment: the largest schedule.
  v = _find(head_dim=128, causal=False, deterministic=False)
  assert FlashAttentionBackwardSm90.smem_bytes(v) == 231680


def test_can_implement_is_kernel_support():
  variant = VARIANTS[0]
  assert FlashAttentionBackwardSm90.can_implement(variant) == (True, "")
  odd = dataclasses.replace(variant, head_dim=160, head_dim_v=160)
  assert FlashAttentionBackwardSm90.can_implement(odd) == config.kernel_support(
      "bwd", variant.dtype, 160, 160)
  with pytest.raises(ValueError, match="head_dim 160 has no bwd kernel"):
    kernel_compile.build_bwd_kernels(odd)
  with pytest.raises(ValueError, match="not a backward variant"):
    kernel_compile.build_bwd_kernels(config.shipped_variants("sm90a", "fwd")[0])


def test_dq_split_m_lands_every_value_where_the_postprocess_reads_it():
  """tile_m 128 (hdim 64): warpgroup w computes 64-row block w of dQ for all of head_dim and
  stages it whole; the writer adds buffer w at floats [w * 64 * head_dim, ...) of the m block.
  The postprocess reads each 64-row block through bwd_common.dq_tiled_mma. For every thread and
  value, the (row, column) the postprocess assigns to the float a value lands in must be the
  one the main kernel computed there; staging by the head_dim split's writer map must not."""
  variant = _find(head_dim=64, causal=False, deterministic=False)
  assert variant.schedule.dq_split_m and variant.schedule.tile_m == 128
  main = FlashAttentionBackwardSm90(variant)
  d, threads = variant.head_dim, 2 * sm90_gemm.WARPGROUP_THREADS
  half = bwd_common.TILE_M * d // 2  # floats of a warpgroup's half of a 64-row block
  results = {}

  def coords(tiled_mma, t, shape):
    c = tiled_mma.get_slice(t).partition_C(cute.make_identity_tensor(shape))
    return [tuple(int(x) for x in c[i]) for i in range(cute.size(c))]

  def staged(w, lane, i):  # float of warpgroup w's staging buffer holding value i of `lane`
    return (i // 4) * 512 + 4 * lane + i % 4

  def postprocess_reads():  # accumulator float -> (row, column) of the 128-row m block
    post_mma = bwd_common.dq_tiled_mma(main.dtype, d)
    read = {}
    for block in range(2):
      for t in range(threads):
        w, lane = divmod(t, sm90_gemm.WARPGROUP_THREADS)
        for i, (row, col) in enumerate(coords(post_mma, t, (bwd_common.TILE_M, d))):
          read[block * 2 * half + w * half + staged(w, lane, i)] = (block * 64 + row, col)
    return read

  def mismatches(writer, read):
    bad = total = 0
    for t in range(threads):
      w, lane = divmod(t, sm90_gemm.WARPGROUP_THREADS)
      for i, coord in enumerate(coords(main.tiled_mma_dq, t, (128, d))):
        total += 1
        bad += read.get(writer(w, staged(w, lane, i))) != coord
    return bad, total

  def check():  # plain Python over trace-time values (the DSL rewrites loops of a jit body)
    main._setup_attributes()
    read = postprocess_reads()
    results["row split"] = mismatches(lambda w, p: w * 2 * half + p, read)
    results["head_dim split writer"] = mismatches(
        lambda w, p: (p // half) * 2 * half + w * half + p % half, read)

  @cute.jit
  def probe():
    check()

  cute.compile(probe, options="--gpu-arch sm_90a")
  assert results["row split"] == (0, 128 * d)
  assert results["head_dim split writer"][0] > 0


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v.masked and v.dtype == "bfloat16"],
                         ids=lambda v: v.key)
def test_masked_backward_takes_the_query_ids_with_each_stage(exported, variant):
  """Masked variants: the swapped schedule's Q/dO stage carries one more bulk copy (the query
  block's ids, next to its lse2 / delta rows); deterministic ones keep the semaphore hand-off
  and the first-contribution store of the dense kernels."""
  e = exported(variant)
  masked = e.ops(modifiers=True)
  dense = exported(_find(head_dim=variant.head_dim, head_dim_v=variant.head_dim_v, causal=True,
                         deterministic=variant.deterministic)).ops(modifiers=True)
  if variant.schedule.swap_sdp:
    assert masked.count("UBLKCP.S.G") > dense.count("UBLKCP.S.G") > 0
  assert ("REDG" in e.ops()) == ("UBLKCP.G.S" in masked) == variant.deterministic


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v.masked and v.dtype == "bfloat16"],
                         ids=lambda v: v.key)
def test_masked_backward_soft_caps_with_the_tanh_derivative(exported, variant):
  """Masked variants take softcap at run time: per score of each step one MUFU.TANH (the
  capped score) and one MUFU.LG2 (t recovered from P for dS's factor 1 - t^2), behind a branch
  the call's softcap decides for the whole CTA; the dense variants have neither."""
  ops = exported(variant).ops(modifiers=True)
  assert ops.count("MUFU.TANH") == ops.count("MUFU.LG2") > 0
  dense = exported(_find(head_dim=variant.head_dim, head_dim_v=variant.head_dim_v, causal=True,
                         deterministic=variant.deterministic)).ops(modifiers=True)
  assert "MUFU.TANH" not in dense and "MUFU.LG2" not in dense


# The bfloat16 bias variants: a float16 twin compiles to the same code with the other
# element type (_sass.compiled_variants).
@pytest.mark.parametrize("variant", [v for v in _sass.compiled_variants(VARIANTS) if v.bias],
                         ids=lambda v: v.key)
def test_bias_backward_stages_the_bias_in_the_ds_buffer_and_stores_dbias_with_tma(exported,
                                                                                  variant):
  """Bias variants: the producer loads each step's bias tile (tile_m x 128 keys: two TMA boxes
  of 64 keys) with Q and dO, into the stage's dS buffer; each of the three step loops reads a
  thread's bias values with ldmatrix.x4.trans (tile_m / 16 per read: one read for P, one for
  the softcap's factor) and stores the step's dS tile to dbias with TMA (two boxes); only the
  soft-capped path stores dbias from registers (one 16-bit store per score); one producer warp
  writes the skipped blocks' zeros (16-byte stores, two row ranges). No bias load from global
  memory, no float32 dbias store; the other masked variants have none of it."""
  ops = exported(variant).ops(modifiers=True)
  s = variant.schedule
  boxes = s.tile_n * 2 // 128
  per_thread_scores = 64 * s.tile_m // 128
  plain = next(v for v in VARIANTS if v.masked and not v.bias and not v.deterministic
               and v.dtype == variant.dtype and v.head_dim == variant.head_dim)
  plain_ops = exported(plain).ops(modifiers=True)
  assert ops.count("UTMALDG.3D") == boxes
  assert ops.count("LDSM.16.MT88.4") == 3 * 2 * s.tile_m // 16
  assert ops.count("UTMASTG.4D") - plain_ops.count("UTMASTG.4D") == 3 * boxes
  assert ops.count("STG.E.U16") == 3 * per_thread_scores
  assert ops.count("STG.E.128") == 2
  assert not [op for op in ops if op.startswith("LDG.E.U16") or op == "STG.E"]
  for op in ("UTMALDG.3D", "LDSM.16.MT88.4", "STG.E.U16", "STG.E.128"):
    assert op not in plain_ops, op
  assert FlashAttentionBackwardSm90.smem_bytes(variant) <= sm90_gemm.SMEM_CAPACITY
