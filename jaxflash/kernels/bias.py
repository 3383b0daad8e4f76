"""The additive attention bias on the S accumulator (forward) and its gradient (backward).

Imports cutlass only. The bias is a (seqlen_q, seqlen_k) view of one (batch, head) of a
(batch, heads, seqlen_q, seqlen_k) tensor whose broadcast dims have stride 0; each thread reads
the elements of its own accumulator fragment by their (query, key) coordinates. Query rows past
seqlen_q (the last tile's padding) read row seqlen_q - 1 and key columns past seqlen_k (only in
the blocks that need the mask) read column seqlen_k - 1: nothing is read out of bounds, and
those scores are masked or never stored.
"""

import dataclasses

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


@dataclasses.dataclass(frozen=True)
class TransposedBias:
  """The bias and dbias of one (batch, query head) as the backward's S^T fragments see them
  (rows keys, columns queries), for one (query block, key tile) step (a trace-time bundle).
  bias: (seqlen_q, seqlen_k) in the input dtype; dbias: (seqlen_q, seqlen_k) float32;
  query_base / key_base: the step's first query and key; tile_m / tile_n: its extents."""

  bias: cute.Tensor
  dbias: cute.Tensor
  query_base: Int32
  key_base: Int32
  seqlen_q: Int32
  seqlen_k: Int32
  tile_m: int
  tile_n: int

  @cute.jit
  def load(self, coord_mn: cute.Tensor, i, j) -> Float32:
    """bias[query, key] of fragment element (i, j) (coord_mn: (key, query) in the tile), both
    indices clamped into the bias: a query past seqlen_q has P = 0 (its lse2 is +inf), a key
    past seqlen_k is masked."""
    query = cutlass.min(self.query_base + coord_mn[0, j][1], self.seqlen_q - 1)
    key = cutlass.min(self.key_base + coord_mn[i, 0][0], self.seqlen_k - 1)
    return self.bias[query, key].to(Float32)

  @cute.jit
  def store_all(self, p_mn: cute.Tensor, dp_mn: cute.Tensor, coord_mn: cute.Tensor,
                delta_smem: cute.Tensor, stage: Int32):
    """dS^T = P^T (dP^T - delta) into dp_mn (delta of the column's query, from the stage's
    delta rows) and into dbias[query, key] for every pair inside (seqlen_q, seqlen_k): each
    pair belongs to one thread of one step, so each element is written once."""
    num_rows, num_cols = cute.size(dp_mn, mode=[0]), cute.size(dp_mn, mode=[1])
    for j in cutlass.range_constexpr(num_cols):
      delta = delta_smem[coord_mn[0, j][1], stage]
      for i in cutlass.range_constexpr(num_rows):
        dp_mn[i, j] = p_mn[i, j] * (dp_mn[i, j] - delta)
    inside = (self.query_base + self.tile_m <= self.seqlen_q
              and self.key_base + self.tile_n <= self.seqlen_k)
    if inside:
      for j in cutlass.range_constexpr(num_cols):
        query = self.query_base + coord_mn[0, j][1]
        for i in cutlass.range_constexpr(num_rows):
          self.dbias[query, self.key_base + coord_mn[i, 0][0]] = dp_mn[i, j]
    else:
      for j in cutlass.range_constexpr(num_cols):
        query = self.query_base + coord_mn[0, j][1]
        for i in cutlass.range_constexpr(num_rows):
          key = self.key_base + coord_mn[i, 0][0]
          if query < self.seqlen_q and key < self.seqlen_k:
            self.dbias[query, key] = dp_mn[i, j]
