"""The additive attention bias on the S accumulator (forward) and its gradient (backward).

Imports cutlass only. The bias is a (seqlen_q, seqlen_k) view of one (batch, head) of a
(batch, heads, seqlen_q, seqlen_k) tensor whose broadcast dims have stride 0; each thread reads
the elements of its own accumulator fragment by their (query, key) coordinates. Query rows past
seqlen_q (the last tile's padding) read row seqlen_q - 1 and key columns past seqlen_k (only in
the blocks that need the mask) read column seqlen_k - 1: nothing is read out of bounds, and
those scores are masked or never stored.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32


@cute.jit
def add_bias(acc_s_mn: cute.Tensor, coord_mn: cute.Tensor, bias: cute.Tensor, row_base: Int32,
             col_base: Int32, seqlen_q: Int32, seqlen_k: Int32, scale: Float32,
             tile_n: cutlass.Constexpr, check_cols: cutlass.Constexpr):
  """S[i, j] += bias[row, col] * scale in place (S rows queries, columns keys).

  acc_s_mn: this thread's S fragment as (rows, cols); coord_mn: the matching (row, col) inside
  the tile; bias: the (seqlen_q, seqlen_k) view of the tile's (batch, head); row_base / col_base:
  the tile's first query row and the block's first key. check_cols: the block may hold keys >=
  seqlen_k (a block that needs the mask).

  Every load is unconditional, so ptxas issues them together. A thread's columns are its first
  column plus constants, so each row's loads are one address plus immediate offsets; only the
  last key block of a sequence whose length is no multiple of tile_n (a warp-uniform branch)
  loads key by key, skipping the keys >= seqlen_k (the mask sets them to -inf).
  """
  num_rows, num_cols = cute.size(acc_s_mn, mode=[0]), cute.size(acc_s_mn, mode=[1])
  first_col = coord_mn[0, 0][1]
  inside = True
  if cutlass.const_expr(check_cols):
    inside = col_base + tile_n <= seqlen_k
  if inside:
    for i in cutlass.range_constexpr(num_rows):
      row = cutlass.min(row_base + coord_mn[i, 0][0], seqlen_q - 1)
      row_bias = cute.domain_offset((row, col_base + first_col), bias)
      for j in cutlass.range_constexpr(num_cols):
        # coord_mn[0, j][1] - first_col folds to a constant.
        value = row_bias[0, coord_mn[0, j][1] - first_col].to(Float32)
        acc_s_mn[i, j] = acc_s_mn[i, j] + value * scale
  else:
    # One load per key inside seqlen_k, each behind its own branch: few registers (this
    # block runs once per query tile; loads issued together here spilled at 240 registers).
    for i in cutlass.range_constexpr(num_rows):
      row = cutlass.min(row_base + coord_mn[i, 0][0], seqlen_q - 1)
      for j in cutlass.range_constexpr(num_cols):
        col = col_base + coord_mn[0, j][1]
        if col < seqlen_k:
          acc_s_mn[i, j] = acc_s_mn[i, j] + bias[row, col].to(Float32) * scale


@cute.jit
def add_bias_transposed(acc_t_mn: cute.Tensor, coord_mn: cute.Tensor, bias: cute.Tensor,
                        row_base: Int32, col_base: Int32, seqlen_q: Int32, seqlen_k: Int32,
                        scale: Float32):
  """add_bias on S^T (rows keys, columns queries: the backward's swapped S). row_base: the key
  tile's first key; col_base: the query block's first row. Both indices are clamped (the
  backward's key tile and query block may both pass the ends)."""
  num_rows, num_cols = cute.size(acc_t_mn, mode=[0]), cute.size(acc_t_mn, mode=[1])
  for j in cutlass.range_constexpr(num_cols):
    query = cutlass.min(col_base + coord_mn[0, j][1], seqlen_q - 1)
    for i in cutlass.range_constexpr(num_rows):
      key = cutlass.min(row_base + coord_mn[i, 0][0], seqlen_k - 1)
      acc_t_mn[i, j] = acc_t_mn[i, j] + bias[query, key].to(Float32) * scale


@cute.jit
def store_dbias_transposed(ds_t_mn: cute.Tensor, coord_mn: cute.Tensor, dbias: cute.Tensor,
                           row_base: Int32, col_base: Int32, seqlen_q: Int32, seqlen_k: Int32,
                           scale: Float32):
  """dbias[query, key] = dS^T[i, j] * scale for the pairs inside (seqlen_q, seqlen_k) (rows
  keys, columns queries). dbias: one (batch, head)'s (seqlen_q, seqlen_k) float32 view; each
  element belongs to exactly one thread of one CTA, so every element is written once."""
  num_rows, num_cols = cute.size(ds_t_mn, mode=[0]), cute.size(ds_t_mn, mode=[1])
  for j in cutlass.range_constexpr(num_cols):
    query = col_base + coord_mn[0, j][1]
    for i in cutlass.range_constexpr(num_rows):
      key = row_base + coord_mn[i, 0][0]
      if query < seqlen_q and key < seqlen_k:
        dbias[query, key] = ds_t_mn[i, j] * scale
