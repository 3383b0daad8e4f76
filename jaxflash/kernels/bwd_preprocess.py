"""Backward preprocess: delta = rowsum(dO * O) - d_lse, lse * log2(e), zeroed dQ accumulator /
semaphores.

Imports cutlass, jaxflash.config and sibling helpers only (never jax).
"""

import math

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from jaxflash import config
from jaxflash.kernels import bwd_common
from jaxflash.kernels import sm90_gemm

_select = sm90_gemm.select_modes

LOG2_E = math.log2(math.e)
_NUM_THREADS = 256
# 16 bytes per thread per load: the widest global access.
_VEC = 8


class FlashAttentionBackwardPreprocess:
  """One CTA per (main-kernel query block of tile_m rows, head, batch), over seqlen_q_rounded.

  Writes, for every row of the block (rows >= seqlen_q included, so the main kernel never needs
  a bounds check): lse2 = lse * log2(e), or +inf where lse = -inf or the row is padding (P = 0
  in the main kernel), and delta = sum_c dO * O - d_lse (0 for padding). In the default mode it
  zeroes the block's dQ accumulator floats; deterministic variants store each block's first
  contribution instead (bwd_sm90), so it zeroes only the block's dQ semaphore, in each
  accumulator copy the call holds (at most the schedule's dq_copies; the count comes from the
  scratch shape, config.dq_accum_copies).
  """

  def __init__(self, variant: config.KernelVariant):
    self.dtype = sm90_gemm.DTYPES[variant.dtype]
    self.head_dim = variant.head_dim
    self.head_dim_v = variant.head_dim_v
    self.deterministic = variant.deterministic
    # The main kernel's query block (a multiple of bwd_common.TILE_M): one dQ semaphore each.
    self.tile_m = variant.schedule.tile_m
    self.dq_copies = variant.schedule.dq_copies
    self.zero_dq_accum = not variant.deterministic
    # A row of dO / O is read by head_dim_v / 8 consecutive lanes, 16 bytes each; the lanes per
    # row are a power of two (the shuffle reduction's group), the extra ones idle (hdim 96, 192).
    self.chunks = self.head_dim_v // _VEC
    self.threads_per_row = 1 << (self.chunks - 1).bit_length()
    self.rows_per_pass = _NUM_THREADS // self.threads_per_row
    # One pass of the CTA's threads covers at most tile_m rows (head_dim_v >= 32), and the
    # block's dQ floats split evenly over the threads.
    assert self.rows_per_pass <= self.tile_m and self.head_dim_v % _VEC == 0, variant

  @cute.jit
  def __call__(
      self,
      mO: cute.Tensor,  # (batch, seqlen_q, num_heads, head_dim_v)
      mdO: cute.Tensor,  # (batch, seqlen_q, num_heads, head_dim_v)
      mLSE: cute.Tensor,  # (batch, num_heads, seqlen_q) float32, natural log
      mdLSE: cute.Tensor,  # (batch, num_heads, seqlen_q) float32
      mLSE2: cute.Tensor,  # (batch, num_heads, seqlen_q_rounded) float32 out
      mDelta: cute.Tensor,  # (batch, num_heads, seqlen_q_rounded) float32 out
      mdQaccum: cute.Tensor,  # (batch, num_heads, copies * seqlen_q_rounded, head_dim) f32 out
      mSem: cute.Tensor,  # (batch, num_heads, copies * seqlen_q_rounded / tile_m) int32, or None
      stream: cuda.CUstream,
  ):
    if const_expr(not (mO.element_type == mdO.element_type == self.dtype)):
      raise TypeError(f"out and d_out must be {self.dtype}")
    if const_expr(self.deterministic != (mSem is not None)):
      raise TypeError("the dQ semaphore is passed exactly when deterministic")
    mO, mdO = [_select(t, [1, 3, 2, 0]) for t in (mO, mdO)]  # (seqlen, dim, heads, batch)
    mLSE, mdLSE, mLSE2, mDelta = [_select(t, [2, 1, 0]) for t in (mLSE, mdLSE, mLSE2, mDelta)]
    mdQaccum = _select(mdQaccum, [2, 3, 1, 0])  # (seqlen_q_rounded, head_dim, heads, batch)
    if const_expr(self.deterministic):
      mSem = _select(mSem, [2, 1, 0])
    grid = (cute.ceil_div(cute.size(mLSE2.shape[0]), self.tile_m), cute.size(mLSE2.shape[1]),
            cute.size(mLSE2.shape[2]))
    self.kernel(mO, mdO, mLSE, mdLSE, mLSE2, mDelta, mdQaccum, mSem).launch(
        grid=grid, block=[_NUM_THREADS, 1, 1], stream=stream)

  @cute.kernel
  def kernel(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mdLSE: cute.Tensor,
             mLSE2: cute.Tensor, mDelta: cute.Tensor, mdQaccum: cute.Tensor, mSem: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    m_block, head, batch = cute.arch.block_idx()
    seqlen_q = mO.shape[0]
    chunk = tidx % self.threads_per_row
    for p in cutlass.range_constexpr(self.tile_m // self.rows_per_pass):
      row = m_block * self.tile_m + p * self.rows_per_pass + tidx // self.threads_per_row
      dot = Float32(0.0)
      if row < seqlen_q:
        if const_expr(self.threads_per_row == self.chunks):
          dot = self._chunk_dot(mO, mdO, row, chunk, head, batch)
        else:
          if chunk < self.chunks:
            dot = self._chunk_dot(mO, mdO, row, chunk, head, batch)
      # The lanes of one row are consecutive: reduce over that group only.
      dot = cute.arch.warp_reduction_sum(dot, threads_in_group=self.threads_per_row)
      if chunk == 0:
        lse2 = Float32.inf
        delta = Float32(0.0)
        if row < seqlen_q:
          lse = mLSE[row, head, batch]
          if lse != -Float32.inf:
            lse2 = lse * LOG2_E
          delta = dot - mdLSE[row, head, batch]
        mLSE2[row, head, batch] = lse2
        mDelta[row, head, batch] = delta

    # Copy c starts a seqlen_q_rounded (= lse2 rows) after copy c - 1; a kernel built for more
    # copies than the call holds skips the missing ones (bwd_common.dq_copy_count).
    self._reset_copy(mdQaccum, mSem, m_block, head, batch, tidx)
    if const_expr(self.dq_copies > 1):
      copies = bwd_common.dq_copy_count(mdQaccum, mLSE2.shape[0])
      for c in cutlass.range_constexpr(1, self.dq_copies):
        if c < copies:
          self._reset_copy(mdQaccum, mSem, m_block + c * (mLSE2.shape[0] // self.tile_m), head,
                           batch, tidx)

  @cute.jit
  def _reset_copy(self, mdQaccum: cute.Tensor, mSem: cute.Tensor, block: Int32, head: Int32,
                  batch: Int32, tidx: Int32):
    """Zeroes accumulator block `block` (unless zero_dq_accum is off) and its semaphore."""
    if const_expr(self.zero_dq_accum):
      # The block's dQ accumulator floats are contiguous (bwd_common): coalesced zero stores.
      gdQ = cute.local_tile(mdQaccum[None, None, head, batch], (self.tile_m, self.head_dim),
                            (block, 0))
      flat = cute.make_tensor(gdQ.iterator, cute.make_layout(self.tile_m * self.head_dim))
      for i in cutlass.range_constexpr(self.tile_m * self.head_dim // _NUM_THREADS):
        flat[i * _NUM_THREADS + tidx] = Float32(0.0)
    if const_expr(self.deterministic):
      if tidx == 0:
        mSem[block, head, batch] = Int32(0)

  @cute.jit
  def _chunk_dot(self, mO: cute.Tensor, mdO: cute.Tensor, row: Int32, chunk: Int32, head: Int32,
                 batch: Int32) -> Float32:
    """sum over 8 columns (16 bytes) of dO * O in one row, in fp32."""
    r_o = cute.make_rmem_tensor((_VEC,), self.dtype)
    r_do = cute.make_rmem_tensor((_VEC,), self.dtype)
    cute.autovec_copy(cute.local_tile(mO[row, None, head, batch], (_VEC,), (chunk,)), r_o)
    cute.autovec_copy(cute.local_tile(mdO[row, None, head, batch], (_VEC,), (chunk,)), r_do)
    o = r_o.load().to(Float32)
    do = r_do.load().to(Float32)
    dot = Float32(0.0)
    for i in cutlass.range_constexpr(_VEC):
      dot += o[i] * do[i]
    return dot
