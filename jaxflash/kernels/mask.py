"""Attention masks on the S accumulator and the key-block ranges they imply.

Imports cutlass only. Causal masks are aligned bottom-right: query row i sees key j iff
j <= i + seqlen_k - seqlen_q (the FlashAttention 2/3/4 convention).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32


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
    # Block n is fully visible to every row of the tile iff (n+1)*tile_n - 1 <= m_block*tile_m + off.
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
