"""The FP8 forward kernel (kernels/fwd_fp8_sm90.py) compiled for sm_90a on a GPU-less host, and
a numpy model of its operand layouts (kernels/fp8_operands.py).

The SASS checks assert structure (e4m3 WGMMA of both GEMMs, TMA, the transpose's ldmatrix /
byte permute / stmatrix, the e4m3 packs of P, no spills). The model replays, lane by lane, what
the PTX instructions hand each thread (ldmatrix.trans, prmt, stmatrix; the WGMMA accumulator
and 8-bit A fragments) with the kernel's addresses and register orders, and checks that the
GEMM over the permuted keys is P V. Needs nvidia-cutlass-dsl (marker `cutlass`) for the SASS.
"""

import numpy as np
import pytest

from jaxflash import config

FP8_VARIANTS = [v for v in config.shipped_variants("sm90a", "fwd")
                if v.dtype == config.FP8_DTYPE]


# ------------------------------------------------------------------------------------------
# The model (no DSL needed): one warp, one 16-key x 32-dim transpose unit, one 64 x 32 P slab.

def _ldmatrix_x4_trans(rows16):
  """rows16[i][r]: the 8 16-bit values of row r of matrix i (lane 8i + r's address). Returns
  regs[lane][i] as 2-tuples (low, high half): lane t gets column t // 4, rows 2 (t % 4) and
  2 (t % 4) + 1 of each matrix (PTX ldmatrix .trans)."""
  return [[(rows16[i][2 * (t % 4)][t // 4], rows16[i][2 * (t % 4) + 1][t // 4])
           for i in range(4)] for t in range(32)]


def _bytes(half):
  """A 16-bit value of two e4m3 bytes (lo, hi) -> the bytes."""
  return list(half)


def _prmt(a, b, selector):
  """prmt.b32: bytes 0-3 of a, 4-7 of b; result byte n = source byte (selector >> 4n) & 7."""
  src = a + b
  return [src[(selector >> (4 * n)) & 0xF] for n in range(4)]


def test_model_transpose_unit_writes_v_transposed_in_the_permuted_key_order():
  rng = np.random.default_rng(0)
  keys, dims = 16, 32
  v = rng.integers(0, 256, size=(keys, dims))  # V[key, dim], one byte each
  # ldmatrix: lane 8i + r addresses key 8 (i % 2) + r at dim 16 (i // 2): 8 pairs of bytes.
  rows16 = [[[(v[8 * (i % 2) + r, 16 * (i // 2) + 2 * c],
               v[8 * (i % 2) + r, 16 * (i // 2) + 2 * c + 1])
              for c in range(8)] for r in range(8)] for i in range(4)]
  regs = _ldmatrix_x4_trans(rows16)
  vt = np.full((dims, keys), -1)
  for lane in range(32):
    m = [_bytes(regs[lane][i][0]) + _bytes(regs[lane][i][1]) for i in range(4)]  # 4 bytes each
    out = [_prmt(m[0], m[1], 0x6420), _prmt(m[0], m[1], 0x7531), _prmt(m[2], m[3], 0x6420),
           _prmt(m[2], m[3], 0x7531)]
    # stmatrix: register i of lane t is row t // 4, bytes 4 (t % 4).. of matrix i, whose row r
    # lies at V^T row 16 (i // 2) + 2r + (i % 2) (the address of lane 8i + r).
    for i in range(4):
      row = 16 * (i // 2) + 2 * (lane // 4) + i % 2
      vt[row, 4 * (lane % 4): 4 * (lane % 4) + 4] = out[i]
  perm = [2 * (p // 4) + (p % 2) + 8 * ((p % 4) // 2) for p in range(16)]
  np.testing.assert_array_equal(vt, v[perm, :].T)  # V^T[d, position p] = V[perm[p], d]


def test_model_p_packing_and_the_transposed_v_give_p_times_v():
  """The A fragment convert_p builds, read as the 8-bit WGMMA reads it, times V^T in the
  permuted key order, is P V."""
  rng = np.random.default_rng(1)
  rows, cols, dims = 64, 32, 8
  p = rng.random((rows, cols))
  v = rng.standard_normal((cols, dims))
  perm = [16 * (k // 16) + 2 * ((k % 16) // 4) + (k % 2) + 8 * ((k % 4) // 2)
          for k in range(cols)]
  a = np.full((rows, cols), np.nan)
  for warp in range(4):
    for lane in range(32):
      r, j = 16 * warp + lane // 4, lane % 4
      # Accumulator: value (pair, h, g) is row r + 8h, column 8g + 2j + pair.
      acc = {(pair, h, g): p[r + 8 * h, 8 * g + 2 * j + pair]
             for pair in range(2) for h in range(2) for g in range(4)}
      for kh in range(2):
        for h in range(2):
          g = 2 * kh  # k block s = 0
          word = [acc[(0, h, g)], acc[(1, h, g)], acc[(0, h, g + 1)], acc[(1, h, g + 1)]]
          # 8-bit A fragment: register h + 2 kh holds row r + 8h, k 16 kh + 4j .. + 3.
          a[r + 8 * h, 16 * kh + 4 * j: 16 * kh + 4 * j + 4] = word
  assert not np.isnan(a).any()
  np.testing.assert_array_equal(a, p[:, perm])
  np.testing.assert_allclose(a @ v[perm, :], p @ v, rtol=1e-12)


# ------------------------------------------------------------------------------------------
# SASS of the shipped FP8 variants.

@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  pytest.importorskip("cutlass")
  from tests import _sass
  return _sass.exporter(tmp_path_factory)


@pytest.mark.cutlass
@pytest.mark.parametrize("variant", FP8_VARIANTS, ids=lambda v: v.key)
def test_sass_uses_e4m3_wgmma_tma_and_the_shared_memory_transpose(exported, variant):
  import re

  from tests import _sass
  e = exported(variant)
  sass = e.sass["main"]
  ops = e.ops(modifiers=True)
  assert {"UTMALDG.4D", "UTMASTG.4D"} <= set(ops), "TMA loads and the O TMA store"
  _sass.assert_no_spills(e.ops(), variant.key)
  # S = Q K^T is 64 x tile_n per warpgroup, O += P V is 64 x head_dim_v; both e4m3, k = 32.
  shapes = set(re.findall(r"\bQGMMA\.(\d+x\d+x\d+)\.F32\.E4M3\.E4M3", sass))
  assert shapes == {f"64x{variant.schedule.tile_n}x32", f"64x{variant.head_dim_v}x32"}
  qgmma = sum(op.startswith("QGMMA") for op in ops)
  assert 0 < ops.count("WARPGROUP.ARRIVE") <= qgmma // 2, "WGMMAs not serialized"
  # The transpose: per unit one ldmatrix.trans, four byte permutes, one stmatrix; every warp
  # runs its own list, so each unit appears once (its addresses: fp8_operands.unit_constants,
  # checked against the layouts below). P leaves the accumulator through e4m3 packs, not
  # shuffles.
  from jaxflash.kernels import fwd_fp8_sm90
  units = fwd_fp8_sm90.transpose_units(variant)
  assert ops.count("LDSM.16.MT88.4") == units
  assert ops.count("STSM.16.M88.4") >= units  # and the epilogue's bf16 O stores
  for selector in ("0x6420", "0x7531"):
    assert len(re.findall(rf"PRMT R\d+, R\d+(?:\.reuse)?, {selector}, R\d+", sass)) == 2 * units
  assert ops.count("F2FP.SATFINITE.E4M3.F32.PACK_AB_MERGE_C") > 0
  assert "SHFL.IDX" not in ops
  # Block variants: each K stage's chunk descales, one bulk copy with the first key block and
  # one in the loop; per-head variants read one k descale per tile.
  assert ops.count("UBLKCP.S.G") == (2 if variant.block_descales else 0)
  # Ping-pong GEMM turns where the schedule asks for them (not at head_dim 128).
  turns = _sass.pingpong_turns(sass)
  assert bool(turns) == variant.schedule.pingpong, turns


@pytest.mark.cutlass
@pytest.mark.parametrize("variant", FP8_VARIANTS, ids=lambda v: v.key)
def test_sass_takes_the_schedules_share_of_exp2_on_the_fma_pipe(exported, variant):
  """fma_exp2_per_8 of every 8 scores take softmax.exp2_fma (its clamp is the one FMNMX.NAN)
  instead of MUFU.EX2, at each of the step's softmax sites (2; 3 when causal); the other
  exp2s are the rescale's and the epilogue's."""
  ops = exported(variant).ops(modifiers=True)
  per_thread_scores = variant.schedule.tile_n // 2
  share = variant.schedule.fma_exp2_per_8
  sites = 3 if variant.causal else 2
  assert ops.count("FMNMX.NAN") == sites * per_thread_scores * share // 8
  score_ex2 = sites * per_thread_scores * (8 - share) // 8
  assert 0 <= ops.count("MUFU.EX2") - score_ex2 <= 12


@pytest.mark.cutlass
@pytest.mark.parametrize("variant", FP8_VARIANTS, ids=lambda v: v.key)
def test_fp8_variants_fit_shared_memory(variant):
  from jaxflash.kernels import sm90_gemm
  from jaxflash.kernels.fwd_fp8_sm90 import FlashAttentionForwardFp8Sm90
  assert FlashAttentionForwardFp8Sm90.can_implement(variant) == (True, "")
  assert FlashAttentionForwardFp8Sm90.smem_bytes(variant) <= sm90_gemm.SMEM_CAPACITY


@pytest.mark.cutlass
def test_largest_p_fits_e4m3():
  """P = 2^(score - row max + offset) reaches 2^(offset + threshold) while the row max stays
  behind a block's by up to the threshold: it must stay below e4m3's largest finite, 448 (the
  saturating pack would clip it), with exp2.approx's relative error 2^-22 on top."""
  from jaxflash.kernels import fwd_fp8_sm90
  largest = 2.0 ** (fwd_fp8_sm90._P_OFFSET_LOG2 + fwd_fp8_sm90._THRESHOLD_LOG2)
  assert largest * (1 + 2.0 ** -22) < 448.0, largest


@pytest.mark.cutlass
@pytest.mark.parametrize("variant", FP8_VARIANTS + [
    v for v in config.shipped_variants("sm90a", "fwd") if v.dtype != config.FP8_DTYPE],
    ids=lambda v: v.key)
def test_register_split_fits_the_ctas_register_pool(variant):
  """setmaxnreg moves registers inside the CTA's pool, which is what the launch allocated:
  the threads times the registers per thread that 64K allow (a multiple of 8). A split that
  asks for more makes the consumers' setmaxnreg.inc wait forever (a hang, not an error)."""
  from jaxflash.kernels import compile as kernel_compile
  kernel = kernel_compile.build_kernel(variant)
  pool = 65536 // kernel.num_threads // 8 * 8 * kernel.num_threads
  wanted = 128 * kernel.num_producer_regs + kernel.num_mma_threads * kernel.num_mma_regs
  assert wanted <= pool, (variant.key, wanted, pool)


@pytest.mark.cutlass
def test_transpose_addresses_from_unit_zero_equal_the_layouts():
  """The transposing warps' addresses (the lane's address of unit (0, 0) in a stage, XOR the
  unit's flip, plus its add: fp8_operands.unit_constants) equal the swizzled layouts' offsets
  (fp8_operands.unit_offsets) for every lane and unit of each FP8 tile shape, in both stages
  (evaluated at trace time: every coordinate is a Python int)."""
  cutlass = pytest.importorskip("cutlass")
  import cutlass.cute as cute

  from jaxflash.kernels import fp8_operands, sm90_gemm
  fp8 = cutlass.Float8E4M3FN
  shapes = sorted({(v.head_dim_v, v.schedule.tile_n) for v in FP8_VARIANTS} | {(256, 64)})
  pairs = []  # (where, got, want): compared after tracing

  @cute.jit
  def check():
    for case in cutlass.range_constexpr(len(shapes)):
      dv, tile_n = shapes[case]
      v_layout = sm90_gemm.smem_layout(fp8, dv, tile_n, 2, col_major=True)
      vt_layout = sm90_gemm.smem_layout(fp8, dv, tile_n, 2)
      stage_v, stage_vt = cute.cosize(v_layout) // 2, cute.cosize(vt_layout) // 2
      for lane in cutlass.range_constexpr(32):
        src0, dst0 = fp8_operands.unit_offsets(v_layout, vt_layout, 0, 0, lane)
        for stage in cutlass.range_constexpr(2):
          for n0 in cutlass.range_constexpr(0, tile_n, 16):
            for d0 in cutlass.range_constexpr(0, dv, 32):
              want = fp8_operands.unit_offsets(v_layout, vt_layout, n0, d0, lane)
              (flip_v, add_v), (flip_vt, add_vt) = fp8_operands.unit_constants(
                  v_layout, vt_layout, n0, d0)
              got = (((stage * stage_v + src0) ^ flip_v) + add_v - stage * stage_v,
                     ((stage * stage_vt + dst0) ^ flip_vt) + add_vt - stage * stage_vt)
              pairs.append(((dv, tile_n, lane, stage, n0, d0), [int(x) for x in got],
                            [int(x) for x in want]))

  check()
  assert len(pairs) == sum(2 * 32 * n // 16 * d // 32 for d, n in shapes)
  mismatches = [where for where, got, want in pairs if got != want]
  assert not mismatches, mismatches[:5]
