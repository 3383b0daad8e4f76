"""CPU coordinate probe of the register layouts bwd_sm90's swap_sdp relies on (devtools).

No GPU: the layouts are static, so every check evaluates CuTe layouts while tracing a
@cute.jit function on the host (python ints, nothing launched). For each of the 256 consumer
threads (both warpgroups) and the swapped S^T tiled MMA of the real kernel object:
  1. mn view: make_acc_mn_view of the S^T fragment has one key per row and one query per
     column (mask.apply_mask_transposed and the lse2 / delta column reads rely on it).
  2. RS operand: value (v, m, k) of softmax.operand_a_view(P^T registers), as the dV / dK RS
     GEMM consumes it, holds the (key, query) element that the dV / dK tiled MMA's A operand
     expects there (thr.partition_A of an identity tile).
  3. dS^T store: sm90_gemm._store_block's chunking with the stmatrix.trans atom: the value
     copied as (chunk c, value v) is the accumulator element with the tile coordinate the
     copy's source partition assigns to (v, c); and each stmatrix destination row of a
     thread is 8 consecutive keys of one query (contiguous in the transposed dS view).
     This check models cute.copy as taking the chunk's values in flat order; the compiled
     code did not (the swap_sdp dQ bug): probe_ds_store_ptx.py checks the emitted PTX.
  4. dK / dV: the RS tiled MMAs' accumulators hold the same elements per register as the SS
     ones of the unswapped kernel (the epilogue is unchanged).
  Checks 1-3 run for tile 64 and tile 80 (64 x 80 S^T per warpgroup), and for tile 80:
  5. the transposed dQ (dQ^T = K^T dS^T) accumulator: staged / reduced / postprocessed value
     order is a bijection onto the 80 x head_dim block, each warpgroup in its head_dim half.
  Control: check 3 for the unswapped S fragment with the row-major atom (GPU-verified path).
  Negative controls (must report mismatches, or the probe could not see a wrong layout): the
  unswapped S fragment as the RS operand; the swapped store with the non-transposed atom; the
  flat chunk order on a two-row-block accumulator (the bug the m128 patch fixed).
Prints mismatch counts; exits 1 on any mismatch (or a negative control without one). ~75 s.

  .venv/bin/python devtools/kernel_selftest/probe_swap_layouts.py [head_dim]
"""

import os
import pathlib
import sys

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
import cutlass.utils.hopper_helpers as sm90_utils  # noqa: E402
from cutlass import Float32  # noqa: E402
from cutlass.utils import LayoutEnum  # noqa: E402  (the kernels' import)

from jaxflash import config  # noqa: E402
from jaxflash.kernels import softmax  # noqa: E402
from jaxflash.kernels.bwd_sm90 import FlashAttentionBackwardSm90  # noqa: E402

THREADS = 256
RESULTS = {}
NEGATIVE = {}  # checks built to fail: they show the probe can see a wrong layout


def _coord(c):
  return tuple(int(x) for x in c)


def _store_check(tiled_mma, shape, layout_enum, dtype, name, contiguous_mode, into=None):
  """Check 3 for one tiled MMA: (mismatched values, bad destination rows) over all threads."""
  store_atom = sm90_utils.get_smem_store_op(layout_enum, dtype, Float32)
  tiled_copy = cute.make_tiled_copy_S(store_atom,
                                      cute.make_tiled_copy_C_atom(store_atom, tiled_mma))
  ident = cute.make_identity_tensor(shape)
  bad_values = bad_rows = total = 0
  for t in range(THREADS):
    thr = tiled_mma.get_slice(t)
    coord_c = thr.partition_C(ident)
    acc = cute.make_rmem_tensor(thr.partition_shape_C(shape), dtype)
    by_offset = {int(acc.layout(i)): _coord(coord_c[i]) for i in range(cute.size(acc))}
    thr_copy = tiled_copy.get_slice(t)
    src = thr_copy.partition_S(ident)
    src_chunks = cute.group_modes(src, 1, cute.rank(src))
    dst = thr_copy.partition_D(ident)
    dst_chunks = cute.group_modes(dst, 1, cute.rank(dst))
    retiled = tiled_copy.retile(acc)
    per_copy = cute.size(src_chunks, mode=[0])
    for c in range(cute.size(src_chunks, mode=[1])):
      for v in range(per_copy):
        total += 1
        held = by_offset[int(retiled.layout(c * per_copy + v))]
        if held != _coord(src_chunks[v, c]):
          bad_values += 1
      # stmatrix: each thread's destination values come in rows of 8 (16 bytes) that must
      # run along the tile's contiguous mode.
      row = [_coord(dst_chunks[v, c]) for v in range(cute.size(dst_chunks, mode=[0]))]
      for r in range(0, len(row), 8):
        run = row[r:r + 8]
        other = 1 - contiguous_mode
        ok = run[0][contiguous_mode] % 8 == 0 and all(
            run[k][contiguous_mode] == run[0][contiguous_mode] + k
            and run[k][other] == run[0][other] for k in range(len(run)))
        bad_rows += not ok
  (RESULTS if into is None else into)[name] = (bad_values, bad_rows, total)


@cute.jit
def probe(kernel: cutlass.Constexpr, plain: cutlass.Constexpr,
          plain_m128: cutlass.Constexpr, kernel80: cutlass.Constexpr):
  # The checks run as plain Python (not rewritten by the DSL preprocessor: python ints).
  _checks(kernel, plain, plain_m128, kernel80)


def _rs_check(src_mma, src_shape, tiled_mmas, ident):
  """Check 2: (mismatched, total) A-operand values over all threads and the given RS MMAs."""
  bad = total = 0
  for t in range(THREADS):
    thr = src_mma.get_slice(t)
    coord_c = thr.partition_C(cute.make_identity_tensor(src_shape))
    acc = cute.make_rmem_tensor(thr.partition_shape_C(src_shape), cutlass.BFloat16)
    by_offset = {int(acc.layout(i)): _coord(coord_c[i]) for i in range(cute.size(acc))}
    a_regs = softmax.operand_a_view(acc)
    for tiled in tiled_mmas:
      coord_a = tiled.get_slice(t).partition_A(ident)
      for k in range(cute.size(a_regs, mode=[2])):
        for mm in range(cute.size(a_regs, mode=[1])):
          for v in range(cute.size(a_regs, mode=[0])):
            total += 1
            bad += by_offset[int(a_regs.layout((v, mm, k)))] != _coord(coord_a[v, mm, k])
  return bad, total


def _swapped_checks(kernel, tag):
  """Checks 1-3 for one swap_sdp kernel object (tag names its tile in the results)."""
  m, n = kernel.tile_m, kernel.tile_n
  ident = cute.make_identity_tensor((n, m))  # S^T tile: (key, query)
  bad_mn = total_mn = 0
  for t in range(THREADS):
    thr = kernel.tiled_mma_sdp.get_slice(t)
    coord_c = thr.partition_C(ident)
    # 1. rows = keys, columns = queries of the mn view.
    mn = softmax.make_acc_mn_view(coord_c)
    for i in range(cute.size(mn, mode=[0])):
      for j in range(cute.size(mn, mode=[1])):
        total_mn += 1
        if _coord(mn[i, j]) != (_coord(mn[i, 0])[0], _coord(mn[0, j])[1]):
          bad_mn += 1
  RESULTS[f"{tag} mn view (cells)"] = (bad_mn, 0, total_mn)
  # 2. RS A operand of dV and dK from the S^T / dP^T registers.
  bad, total = _rs_check(kernel.tiled_mma_sdp, (n, m),
                         (kernel.tiled_mma_dv, kernel.tiled_mma_dk), ident)
  RESULTS[f"{tag} RS A operand dV+dK (values)"] = (bad, 0, total)
  # 3. dS^T store (stmatrix.trans into the (key, query) view whose key mode is contiguous).
  _store_check(kernel.tiled_mma_sdp, (n, m), LayoutEnum.COL_MAJOR, kernel.dtype,
               f"{tag} dS^T store", contiguous_mode=0)


def _dq_transposed_check(kernel):
  """5. (tile 80) The dQ^T accumulator: value i of thread t of warpgroup w sits at float
  w * half + (i // 4) * 512 + 4 t + i % 4 of the block (bwd_common.fragment_chunks, stage_dq /
  store_dq); the postprocess reads it back
  through the same tiled MMA with (head_dim, query) swapped. Every (query, head_dim) of the
  80 x head_dim block must be hit exactly once, warpgroup w only in its head_dim half."""
  m, d = kernel.tile_m, kernel.head_dim
  ident = cute.make_identity_tensor((d, m))
  seen = {}
  bad = 0
  half = m * d // 2
  for t in range(THREADS):
    wg, lane = divmod(t, 128)
    coord = kernel.tiled_mma_dq.get_slice(t).partition_C(ident)
    for i in range(cute.size(coord)):
      dd, q = _coord(coord[i])
      bad += not wg * d // 2 <= dd < (wg + 1) * d // 2
      seen.setdefault((q, dd), []).append(wg * half + (i // 4) * 512 + 4 * lane + i % 4)
  bad += sum(len(v) != 1 for v in seen.values()) + (m * d - len(seen))
  floats = sorted(v[0] for v in seen.values())
  bad += floats != list(range(m * d))
  RESULTS["tile 80 dQ^T accumulator <-> (query, head_dim) bijection"] = (bad, 0, m * d)


def _checks(kernel, plain, plain_m128, kernel80):
  kernel._setup_attributes()
  plain._setup_attributes()
  plain_m128._setup_attributes()
  kernel80._setup_attributes()
  m, n = kernel.tile_m, kernel.tile_n
  ident = cute.make_identity_tensor((n, m))  # S^T tile: (key, query)
  _swapped_checks(kernel, "tile 64")
  _swapped_checks(kernel80, "tile 80")
  _dq_transposed_check(kernel80)
  # Negative control: the unswapped (query, key) S fragment as the A operand must NOT match.
  bad, total = _rs_check(plain.tiled_mma_sdp, (m, n), (kernel.tiled_mma_dv,), ident)
  NEGATIVE["RS A operand from the unswapped S fragment"] = (bad, 0, total)
  # 4. dK / dV accumulators of the RS tiled MMAs: the same (key, head_dim) element per
  # register as the unswapped SS ones, so the epilogue stores them as before.
  bad = total = 0
  for rs, ss in ((kernel.tiled_mma_dk, plain.tiled_mma_dk), (kernel.tiled_mma_dv,
                                                             plain.tiled_mma_dv)):
    ident_kv = cute.make_identity_tensor((n, kernel.head_dim))
    for t in range(THREADS):
      a = rs.get_slice(t).partition_C(ident_kv)
      b = ss.get_slice(t).partition_C(ident_kv)
      for i in range(cute.size(a)):
        total += 1
        bad += _coord(a[i]) != _coord(b[i])
  RESULTS["dK/dV accumulators RS vs SS (values)"] = (bad, 0, total)
  # Control: unswapped S / dS store (row-major atom, (query, key) tile, key contiguous).
  _store_check(plain.tiled_mma_sdp, (m, n), LayoutEnum.ROW_MAJOR, plain.dtype,
               "P/dS store, unswapped (control)", contiguous_mode=1)
  # Negative controls, each must report mismatches: the swapped store with the non-transposed
  # atom (rows would run along queries), and the flat chunk order on a two-row-block
  # accumulator (the 128 x 128 hdim-64 tile, which store_acc_to_smem stores per block).
  _store_check(kernel.tiled_mma_sdp, (n, m), LayoutEnum.ROW_MAJOR, kernel.dtype,
               "dS^T store with the row-major atom", contiguous_mode=0, into=NEGATIVE)
  _store_check(plain_m128.tiled_mma_sdp, (128, 128), LayoutEnum.ROW_MAJOR, plain.dtype,
               "flat chunk order on MMA_M = 2", contiguous_mode=1, into=NEGATIVE)


def main():
  head_dim = int(sys.argv[1]) if len(sys.argv) > 1 else 128
  tile = config.TileConfig(64, 128, 2)
  kernel = FlashAttentionBackwardSm90(cutlass.BFloat16, head_dim, head_dim, tile, False,
                                      swap_sdp=True)
  plain = FlashAttentionBackwardSm90(cutlass.BFloat16, head_dim, head_dim, tile, False)
  plain_m128 = FlashAttentionBackwardSm90(cutlass.BFloat16, 64, 64, config.TileConfig(128, 128, 2),
                                          False)
  kernel80 = FlashAttentionBackwardSm90(cutlass.BFloat16, 128, 128,
                                        config.TileConfig(80, 128, 2), False, swap_sdp=True)
  cute.compile(probe, kernel, plain, plain_m128, kernel80)
  failed = False
  for name, (bad, bad_rows, total) in RESULTS.items():
    print(f"{name}: {bad} of {total} mismatched, {bad_rows} bad stmatrix rows")
    failed |= bool(bad or bad_rows) or total == 0
  for name, (bad, bad_rows, total) in NEGATIVE.items():
    print(f"negative control, {name}: {bad} of {total} mismatched, {bad_rows} bad stmatrix "
          "rows (must not be 0 / 0)")
    failed |= not (bad or bad_rows)
  sys.exit(1 if failed else 0)


if __name__ == "__main__":
  main()
