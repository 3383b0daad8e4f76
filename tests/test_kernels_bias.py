"""The bias tiles' shared-memory reads (kernels/bias.py) on a GPU-less host: ldmatrix emulated
with the kernels' lane and register mapping must hand every thread the bias of exactly the
scores its WGMMA accumulator fragment holds (coordinates from CuTe's partition of the tiled
MMA), in the forward (S, ldmatrix) and the backward (S^T, ldmatrix.trans).

Needs nvidia-cutlass-dsl (marker `cutlass`, skipped elsewhere).
"""

import numpy as np
import pytest

cutlass = pytest.importorskip("cutlass")

import cutlass.cute as cute  # noqa: E402
import cutlass.utils.hopper_helpers as sm90_utils  # noqa: E402

from jaxflash.kernels import bias as score_bias  # noqa: E402
from jaxflash.kernels import softmax  # noqa: E402

pytestmark = pytest.mark.cutlass

_THREADS = 256  # two consumer warpgroups


def _fragment_coords(rows: int, cols: int) -> dict:
  """{consumer thread: [[(row, col) of fragment element (i, j)]]} of the kernels' tiled MMA
  with two 64-row warpgroups over a (rows, cols) accumulator (the forward's S: queries x keys;
  the backward's S^T: keys x queries), read at trace time."""
  out = {}

  @cute.jit
  def probe():
    k_major = cute.nvgpu.OperandMajorMode.K
    mma = sm90_utils.make_trivial_tiled_mma(cutlass.BFloat16, cutlass.BFloat16, k_major,
                                            k_major, cutlass.Float32, (2, 1, 1), (64, cols))
    for t in cutlass.range_constexpr(_THREADS):
      c = softmax.make_acc_mn_view(mma.get_slice(t).partition_C(
          cute.make_identity_tensor((rows, cols))))
      out[t] = [[tuple(c[i, j]) for j in range(cute.size(c, mode=[1]))]
                for i in range(cute.size(c, mode=[0]))]

  cute.compile(probe, options="--gpu-arch sm_90a")
  return out


def _ldmatrix_x4(stored: np.ndarray, addresses, transposed: bool):
  """ldmatrix.x4 [.trans] of a warp: addresses[lane] = (row, col) of the 16-byte row (8
  elements) that lane gives; returns regs[lane][i] = (low, high) as PTX defines them."""
  regs = [[None] * 4 for _ in range(32)]
  for i in range(4):
    rows = [addresses[8 * i + r] for r in range(8)]
    for t in range(32):
      if transposed:  # column t // 4, rows 2 (t % 4) and 2 (t % 4) + 1 of block i
        pair = [stored[rows[2 * (t % 4) + p][0], rows[2 * (t % 4) + p][1] + t // 4]
                for p in range(2)]
      else:  # row t // 4, columns 2 (t % 4) and 2 (t % 4) + 1 of block i
        pair = [stored[rows[t // 4][0], rows[t // 4][1] + 2 * (t % 4) + p] for p in range(2)]
      regs[t][i] = tuple(pair)
  return regs


def _bias(rows: int, cols: int) -> np.ndarray:
  """A (queries, keys) bias whose every element is unique: query * 10000 + key."""
  return np.arange(rows)[:, None] * 10000 + np.arange(cols)[None, :]


def _assert_ldmatrix_lands_on_fragments(bias, coords, reads, address, transposed, element):
  """ldmatrix.x4 number c (of reads) of each warp w at address(lane, c, 16 w): each register
  lands on the fragment block x4_register_block names, holding element(*its coordinates)."""
  for warp in range(_THREADS // 32):
    for c in range(reads):
      regs = _ldmatrix_x4(bias, [address(lane, c, 16 * warp) for lane in range(32)],
                          transposed=transposed)
      for lane in range(32):
        frag = coords[32 * warp + lane]
        for i in range(4):
          h, g = score_bias.x4_register_block(i, c)
          for p in range(2):
            assert regs[lane][i][p] == element(*frag[h][2 * g + p]), (warp, lane, c, i, p)


@pytest.mark.parametrize("query_step", [1, 0])
def test_forward_ldmatrix_hands_each_thread_its_scores_bias(query_step):
  """add_bias_tile: ldmatrix.x4 number c of warp w reads the rows of the bias tile that
  x4_forward_row names (query_step 0: one bias row per head, row 0 for every query); each
  register lands on the fragment block x4_register_block names, at the coordinates of the S
  accumulator (128 queries x 128 keys) of warp w's first row 16 w."""
  tile_m, tile_n = 128, 128
  bias = _bias(tile_m, tile_n)
  _assert_ldmatrix_lands_on_fragments(
      bias, _fragment_coords(tile_m, tile_n), tile_n // 16,
      lambda lane, c, row0: score_bias.x4_forward_row(lane, c, row0, query_step),
      False, lambda query, key: bias[query * query_step, key])


@pytest.mark.parametrize("tile_m", [64, 80])
@pytest.mark.parametrize("query_step", [1, 0])
def test_backward_ldmatrix_trans_hands_each_thread_its_scores_bias(tile_m, query_step):
  """TransposedBiasTile.load: ldmatrix.x4.trans number c of warp w reads the query rows of the
  (tile_m queries, 128 keys) bias tile that x4_transposed_row names; each register lands on
  the S^T fragment (keys x queries) block x4_register_block names, warp w's first key 16 w."""
  tile_n = 128
  bias = _bias(tile_m, tile_n)
  _assert_ldmatrix_lands_on_fragments(
      bias, _fragment_coords(tile_n, tile_m), tile_m // 16,
      lambda lane, c, row0: score_bias.x4_transposed_row(lane, c, row0, query_step),
      True, lambda key, query: bias[query * query_step, key])


def test_bias_planes_of_each_broadcast_shape():
  """BiasPlanes: the (plane, row) of (batch, head, query) in the (rows, keys, planes) view of a
  (B|1, H|1, S|1, keys) buffer, with the steps the C glue (variant_common.h BiasPlanes) passes:
  a broadcast dim's step is 0."""
  batch, heads, seq_q = 3, 4, 5
  for b_ext, h_ext, q_ext in [(3, 4, 5), (1, 4, 5), (3, 1, 5), (1, 1, 5), (3, 4, 1), (1, 1, 1)]:
    planes = score_bias.BiasPlanes(batch_planes=0 if b_ext == 1 else h_ext,
                                   head_planes=0 if h_ext == 1 else 1,
                                   query_step=0 if q_ext == 1 else 1)
    index = np.arange(b_ext * h_ext * q_ext).reshape(b_ext, h_ext, q_ext)
    want = np.broadcast_to(index, (batch, heads, seq_q))
    for b in range(batch):
      for h in range(heads):
        for q in range(seq_q):
          got = planes.plane(b, h) * q_ext + planes.row(q)
          assert got == want[b, h, q], (b_ext, h_ext, q_ext, b, h, q)
