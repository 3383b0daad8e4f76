"""Backward postprocess: dQ = softmax_scale * (fp32 accumulator), converted to the input dtype.

Imports cutlass, jaxflash.config and sibling helpers only (never jax).
"""

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from jaxflash.kernels import bwd_common
from jaxflash.kernels import sm90_gemm

_select = sm90_gemm.select_modes

_NUM_THREADS = bwd_common.NUM_MMA_WARPGROUPS * sm90_gemm.WARPGROUP_THREADS


class FlashAttentionBackwardPostprocess:
  """One CTA per (query block, head, batch); thread t plays MMA thread t of the main kernel.

  Reading the accumulator in fragment order (bwd_common) is a coalesced stream; the tiled MMA's
  coordinate partition then says where each value goes in dQ. Rows >= seqlen_q are dropped.
  """

  def __init__(self, dtype, head_dim: int, tile_m: int = bwd_common.TILE_M,
               transposed: bool = False):
    """tile_m / transposed: the main kernel's dQ accumulator blocks (bwd_common.dq_tiled_mma's
    rows / transposed; bwd_sm90 swap_sdp with 80-row tiles writes 80-row dQ^T blocks)."""
    self.dtype = dtype
    self.head_dim = head_dim
    self.tile_m = tile_m
    self.transposed = transposed

  @staticmethod
  def can_implement(dtype: str, head_dim: int) -> tuple[bool, str]:
    """Whether this kernel can be built for the arguments; the reason text is user-facing."""
    del dtype
    if head_dim % (8 * bwd_common.NUM_MMA_WARPGROUPS):
      return False, f"head_dim {head_dim} unsupported; accepted: multiples of 16"
    return True, ""

  @cute.jit
  def __call__(
      self,
      mdQaccum: cute.Tensor,  # (batch, num_heads, seqlen_q_rounded, head_dim) float32
      mdQ: cute.Tensor,  # (batch, seqlen_q, num_heads, head_dim) out
      softmax_scale: Float32,
      stream: cuda.CUstream,
  ):
    if const_expr(mdQ.element_type != self.dtype):
      raise TypeError(f"dq must be {self.dtype}")
    if const_expr(mdQaccum.element_type != Float32):
      raise TypeError("dq_accum must be Float32")
    mdQaccum = _select(mdQaccum, [2, 3, 1, 0])  # (seqlen_q_rounded, head_dim, heads, batch)
    mdQ = _select(mdQ, [1, 3, 2, 0])  # (seqlen_q, head_dim, heads, batch)
    tiled_mma = bwd_common.dq_tiled_mma(self.dtype, self.head_dim, rows=self.tile_m,
                                        transposed=self.transposed)
    grid = (cute.ceil_div(cute.size(mdQ.shape[0]), self.tile_m), cute.size(mdQ.shape[2]),
            cute.size(mdQ.shape[3]))
    self.kernel(mdQaccum, mdQ, softmax_scale, tiled_mma).launch(
        grid=grid, block=[_NUM_THREADS, 1, 1], stream=stream)

  @cute.kernel
  def kernel(self, mdQaccum: cute.Tensor, mdQ: cute.Tensor, softmax_scale: Float32,
             tiled_mma: cute.TiledMma):
    tidx, _, _ = cute.arch.thread_idx()
    m_block, head, batch = cute.arch.block_idx()
    seqlen_q = mdQ.shape[0]
    gdQaccum = cute.local_tile(mdQaccum[None, None, head, batch], (self.tile_m, self.head_dim),
                               (m_block, 0))
    # tCcC[i] = (row, col) of value i of this thread in the main kernel's dQ accumulator
    # ((col, row) of its dQ^T accumulator when transposed).
    shape = (self.tile_m, self.head_dim)
    tCcC = tiled_mma.get_slice(tidx).partition_C(
        cute.make_identity_tensor(shape[::-1] if const_expr(self.transposed) else shape))
    row_mode, col_mode = (1, 0) if const_expr(self.transposed) else (0, 1)
    half = self.tile_m * self.head_dim // bwd_common.NUM_MMA_WARPGROUPS
    halves = cute.make_tensor(gdQaccum.iterator,
                              cute.make_layout((half, bwd_common.NUM_MMA_WARPGROUPS)))
    src = bwd_common.fragment_chunks(halves[None, tidx // sm90_gemm.WARPGROUP_THREADS],
                                     tidx % sm90_gemm.WARPGROUP_THREADS)
    values = cute.make_rmem_tensor(src.shape, Float32)
    cute.autovec_copy(src, values)  # 128-bit loads
    for i in cutlass.range_constexpr(cute.size(tCcC)):
      row = m_block * self.tile_m + tCcC[i][row_mode]
      if row < seqlen_q:
        mdQ[row, tCcC[i][col_mode], head, batch] = (values[i] * softmax_scale).to(self.dtype)
