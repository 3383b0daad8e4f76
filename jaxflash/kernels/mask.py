"""Attention masks on the S accumulator and the key-block ranges they imply.

Imports cutlass only. Causal masks are aligned bottom-right: query row i sees key j iff
j <= i + seqlen_k - seqlen_q (the FlashAttention 2/3/4 convention). The masked variants take a
band (window_left, window_right, the same alignment; causal folded into window_right) and
segment ids as run-time data: query i sees key j iff i' - left <= j <= i' + right (i' = i +
seqlen_k - seqlen_q) and their ids are equal.
"""

import dataclasses

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import arith


@dataclasses.dataclass(frozen=True)
class MaskOperands:
  """The run-time operands of a masked variant: ids, block ranges and launch order
  (jaxflash/block_ranges.py computes them), the band, and the soft-capping.

  A CTA tiles one side ("rows": queries in the forward, keys in the backward) and visits blocks
  of the other ("columns"). The kernels extend this with what only one direction needs.
  """

  query_ids: cute.Tensor  # (m blocks * tile_m, batch) int32
  key_ids: cute.Tensor  # (n blocks * tile_n, batch) int32
  ranges: cute.Tensor  # (4, row tiles, batch): column blocks [start, end), unmasked [lo, hi)
  order: cute.Tensor  # (batch * row tiles,): the launch order of the row tiles
  window_left: Int32
  window_right: Int32
  capped: Int32  # 1: soft-capping on (the call's softcap > 0)
  tanh_scale: Float32  # softmax_scale / softcap: t = tanh(S * tanh_scale), in softcap units


@cute.jit
def n_block_max(m_block: Int32, seqlen_q: Int32, seqlen_k: Int32, tile_m: cutlass.Constexpr,
                tile_n: cutlass.Constexpr, causal: cutlass.Constexpr) -> Int32:
  """One past the last key block this query block needs (0: it sees no key at all)."""
  n_max = (seqlen_k + tile_n - 1) // tile_n
  if cutlass.const_expr(causal):
    # Last visible key of the block's last row, +1; may be <= 0 when seqlen_q > seqlen_k.
    key_end = (m_block + 1) * tile_m + seqlen_k - seqlen_q
    n_causal = Int32(0)
    if key_end > 0:
      n_causal = (key_end + tile_n - 1) // tile_n
    n_max = cutlass.min(n_max, n_causal)
  return n_max


@cute.jit
def num_masked_blocks(m_block: Int32, n_max: Int32, seqlen_q: Int32, seqlen_k: Int32,
                      tile_m: cutlass.Constexpr, tile_n: cutlass.Constexpr,
                      causal: cutlass.Constexpr) -> Int32:
  """How many of the highest key blocks [n_max - count, n_max) need the elementwise mask.

  The loop walks key blocks from n_max-1 down, so the masked ones come first. Only the last key
  block can hold columns >= seqlen_k; under causal, every block crossing the first row's diagonal
  needs the mask too (and that range always contains the seqlen_k boundary block).
  """
  count = cutlass.min(n_max, Int32(1))
  if cutlass.const_expr(causal):
    # Block n is fully visible to each row of the tile iff (n+1)*tile_n - 1 <= m_block*tile_m + off.
    first_key_limit = m_block * tile_m + seqlen_k - seqlen_q + 1
    first_masked = Int32(0)
    if first_key_limit > 0:
      first_masked = first_key_limit // tile_n
    count = cutlass.max(count, n_max - cutlass.min(first_masked, n_max))
  return count


@cute.jit
def apply_mask(acc_s_mn: cute.Tensor, coord_mn: cute.Tensor, m_block: Int32, n_block: Int32,
               seqlen_q: Int32, seqlen_k: Int32, tile_m: cutlass.Constexpr,
               tile_n: cutlass.Constexpr, causal: cutlass.Constexpr):
  """Sets masked scores to -inf in place.

  acc_s_mn: this thread's S fragment viewed as (rows, cols); coord_mn: the matching (row, col)
  coordinates inside the (tile_m, tile_n) tile.
  """
  col_base = n_block * tile_n
  for i in cutlass.range_constexpr(cute.size(acc_s_mn, mode=[0])):
    col_limit = seqlen_k - col_base  # exclusive, relative to the block
    if cutlass.const_expr(causal):
      row = m_block * tile_m + coord_mn[i, 0][0]
      col_limit = cutlass.min(col_limit, row + seqlen_k - seqlen_q + 1 - col_base)
    for j in cutlass.range_constexpr(cute.size(acc_s_mn, mode=[1])):
      if coord_mn[0, j][1] >= col_limit:
        acc_s_mn[i, j] = -Float32.inf


@cute.jit
def apply_mask_transposed(acc_t_mn: cute.Tensor, coord_mn: cute.Tensor, m_block: Int32,
                          n_block: Int32, seqlen_q: Int32, seqlen_k: Int32,
                          tile_m: cutlass.Constexpr, tile_n: cutlass.Constexpr,
                          causal: cutlass.Constexpr):
  """apply_mask on S^T: rows are keys, columns queries (the backward's swapped S).

  coord_mn: the (key, query) coordinates inside the (tile_n, tile_m) tile. The key limit
  depends on the column only, so it is computed once per column.
  """
  row_base = n_block * tile_n
  for j in cutlass.range_constexpr(cute.size(acc_t_mn, mode=[1])):
    key_limit = seqlen_k - row_base  # exclusive, relative to the block
    if cutlass.const_expr(causal):
      query = m_block * tile_m + coord_mn[0, j][1]
      key_limit = cutlass.min(key_limit, query + seqlen_k - seqlen_q + 1 - row_base)
    for i in cutlass.range_constexpr(cute.size(acc_t_mn, mode=[0])):
      if coord_mn[i, 0][0] >= key_limit:
        acc_t_mn[i, j] = -Float32.inf


def _outside(offset: Int32, width: Int32) -> cutlass.Boolean:
  """offset >= width as unsigned: outside [0, width) for a width >= 0, a negative offset
  wrapping above any width; one unsigned ISETP. (The DSL compares Int32 and Uint32 values
  signed, and its adds assume no signed overflow, so the compare is built here.)"""
  return cutlass.Boolean(arith.cmpi(arith.CmpIPredicate.uge, Int32(offset).ir_value(),
                                    Int32(width).ir_value()))


@cute.jit
def _single_id(ids: cute.Tensor, size: cutlass.Constexpr):
  """(whether a block's `size` ids are all one value, that value), the same in every lane of
  the warp: each lane compares 4 of them per 128 (16-byte loads: the block starts 16-byte
  aligned, `size` is a multiple of 4) with the first and the warp votes."""
  first = ids[0]
  spread = Int32(0)
  vals = cute.make_rmem_tensor(4, Int32)
  for c in cutlass.range_constexpr((size + 127) // 128):
    chunk = cutlass.min(cute.arch.lane_idx() + 32 * c, Int32(size // 4 - 1))
    cute.autovec_copy(cute.local_tile(ids, (4,), (chunk,)), vals)
    spread = spread | (vals[0] ^ first) | (vals[1] ^ first) | (vals[2] ^ first) | (
        vals[3] ^ first)
  return cute.arch.vote_all_sync(spread == 0), first


@cute.jit
def apply_band_and_ids(acc_s_mn: cute.Tensor, coord_mn: cute.Tensor, m_block: Int32,
                       n_block: Int32, seqlen_q: Int32, seqlen_k: Int32,
                       tile_m: cutlass.Constexpr, tile_n: cutlass.Constexpr,
                       window_left: Int32, window_right: Int32, row_ids: cute.Tensor,
                       col_ids: cute.Tensor):
  """The masked variants' mask on S (rows queries, columns keys), in place.

  row_ids: this thread's rows' query ids (registers, one per row of acc_s_mn); col_ids: the
  key block's ids (tile_n, shared memory). Columns outside the row's band or >= seqlen_k, or
  with another id, become -inf.
  """
  col_base = n_block * tile_n
  offset = seqlen_k - seqlen_q
  num_rows = cute.size(acc_s_mn, mode=[0])
  # Row i sees columns [col_lo, col_lo + width) of the block: one unsigned compare per score
  # (_outside), where two signed ones would test both ends.
  col_lo = cute.make_rmem_tensor(num_rows, Int32)
  width = cute.make_rmem_tensor(num_rows, Int32)
  for i in cutlass.range_constexpr(num_rows):
    row = m_block * tile_m + coord_mn[i, 0][0] + offset - col_base
    col_lo[i] = row - window_left  # first visible column, relative to the block
    col_hi = cutlass.min(row + window_right + 1, seqlen_k - col_base)  # one past the last
    width[i] = cutlass.max(col_hi - col_lo[i], Int32(0))
  num_cols = cute.size(acc_s_mn, mode=[1])
  # A block of one id (every block of a call without segment ids, any block inside a document):
  # the ids decide per row, a row of another id sees none of it.
  one_id, block_id = _single_id(col_ids, tile_n)
  if one_id:
    for i in cutlass.range_constexpr(num_rows):
      if row_ids[i] != block_id:
        width[i] = Int32(0)
    for j in cutlass.range_constexpr(num_cols):
      col = coord_mn[0, j][1]
      for i in cutlass.range_constexpr(num_rows):
        if _outside(col - col_lo[i], width[i]):
          acc_s_mn[i, j] = -Float32.inf
  else:
    for j in cutlass.range_constexpr(num_cols):
      col = coord_mn[0, j][1]
      for i in cutlass.range_constexpr(num_rows):
        if _outside(col - col_lo[i], width[i]) or col_ids[col] != row_ids[i]:
          acc_s_mn[i, j] = -Float32.inf


@cute.jit
def apply_band_and_ids_transposed(acc_t_mn: cute.Tensor, coord_mn: cute.Tensor,
                                  m_block: Int32, n_block: Int32, seqlen_q: Int32,
                                  seqlen_k: Int32, tile_m: cutlass.Constexpr,
                                  tile_n: cutlass.Constexpr, window_left: Int32,
                                  window_right: Int32, row_ids: cute.Tensor,
                                  col_ids: cute.Tensor):
  """apply_band_and_ids on S^T (rows keys, columns queries: the backward's swapped S).

  coord_mn: the (key, query) coordinates inside the (tile_n, tile_m) tile; row_ids: this
  thread's keys' ids (registers); col_ids: the query block's ids (tile_m, shared memory). Key
  j is visible to query i iff i' - left <= j <= i' + right and j < seqlen_k, ids equal.
  """
  row_base = n_block * tile_n
  offset = seqlen_k - seqlen_q
  num_rows, num_cols = cute.size(acc_t_mn, mode=[0]), cute.size(acc_t_mn, mode=[1])
  # Query j sees keys [key_lo, key_lo + width) of the block (one unsigned compare per score, as
  # in apply_band_and_ids).
  key_lo = cute.make_rmem_tensor(num_cols, Int32)
  width = cute.make_rmem_tensor(num_cols, Int32)
  for j in cutlass.range_constexpr(num_cols):
    aligned = m_block * tile_m + coord_mn[0, j][1] + offset - row_base
    key_lo[j] = aligned - window_left  # first visible key, relative to the block
    key_hi = cutlass.min(aligned + window_right + 1, seqlen_k - row_base)
    width[j] = cutlass.max(key_hi - key_lo[j], Int32(0))
  # A query block of one id: a key row of another id moves to the first key past seqlen_k,
  # which no query sees.
  one_id, block_id = _single_id(col_ids, tile_m)
  if one_id:
    keys = cute.make_rmem_tensor(num_rows, Int32)
    for i in cutlass.range_constexpr(num_rows):
      keys[i] = coord_mn[i, 0][0]
      if row_ids[i] != block_id:
        keys[i] = seqlen_k - row_base
    for j in cutlass.range_constexpr(num_cols):
      for i in cutlass.range_constexpr(num_rows):
        if _outside(keys[i] - key_lo[j], width[j]):
          acc_t_mn[i, j] = -Float32.inf
  else:
    for j in cutlass.range_constexpr(num_cols):
      query_id = col_ids[coord_mn[0, j][1]]
      for i in cutlass.range_constexpr(num_rows):
        if _outside(coord_mn[i, 0][0] - key_lo[j], width[j]) or row_ids[i] != query_id:
          acc_t_mn[i, j] = -Float32.inf
