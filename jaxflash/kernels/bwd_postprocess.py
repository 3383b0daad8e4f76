"""Backward postprocess: dQ = softmax_scale * (fp32 accumulator), converted to the input dtype.

Imports cutlass, jaxflash.config and sibling helpers only (never jax).
"""

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync

from jaxflash import config
from jaxflash.kernels import bwd_common
from jaxflash.kernels import sm90_gemm

_select = sm90_gemm.select_modes

_NUM_THREADS = bwd_common.NUM_MMA_WARPGROUPS * sm90_gemm.WARPGROUP_THREADS


class FlashAttentionBackwardPostprocess:
  """One CTA per (query block, head, batch); thread t plays MMA thread t of the main kernel.

  Reading the accumulator in fragment order (bwd_common) is a coalesced stream; the tiled MMA's
  fragment layout then puts each scaled, converted value in a shared (tile_m, head_dim) tile
  (stmatrix), which one TMA store writes to dQ (it drops rows >= seqlen_q). Storing from the
  fragment straight to global memory took 2-byte stores with per-element addresses: 86 us
  against FA-4's 46 us for one hdim 128 call of 16k tokens x 16 heads (H200, ncu).
  """

  def __init__(self, variant: config.KernelVariant):
    schedule = variant.schedule
    self.dtype = sm90_gemm.DTYPES[variant.dtype]
    self.head_dim = variant.head_dim
    # The main kernel's dQ accumulator blocks (bwd_common.dq_tiled_mma's rows / transposed):
    # 80-row dQ^T blocks at tile_m 80, else 64-row blocks.
    self.transposed = schedule.dq_transposed
    self.tile_m = schedule.tile_m if schedule.dq_transposed else bwd_common.TILE_M
    # The most accumulator copies a call holds; the count comes from the scratch shape
    # (config.dq_accum_copies), the copies are summed in index order.
    self.dq_copies = schedule.dq_copies
    # The main kernel's query block: a copy holds seqlen_q rounded up to a multiple of it.
    self.main_rows = schedule.tile_m
    # Deterministic: the main kernel stores each accumulator block's first contribution, so
    # the accumulator is not zeroed, and a block whose semaphore (one per main_rows rows)
    # counts no contribution reads as zero.
    self.sem_rows = schedule.tile_m if variant.deterministic else None

  @cute.jit
  def __call__(
      self,
      mdQaccum: cute.Tensor,  # (batch, num_heads, copies * seqlen_q_rounded, head_dim) f32
      mdQ: cute.Tensor,  # (batch, seqlen_q, num_heads, head_dim) out
      mSem: cute.Tensor,  # (batch, num_heads, copies * seqlen_q_rounded / sem_rows) int32 or None
      softmax_scale: Float32,
      stream: cuda.CUstream,
  ):
    if const_expr(mdQ.element_type != self.dtype):
      raise TypeError(f"dq must be {self.dtype}")
    if const_expr((self.sem_rows is not None) != (mSem is not None)):
      raise TypeError("the dQ semaphore is passed exactly when sem_rows is set")
    if const_expr(mSem is not None):
      mSem = _select(mSem, [2, 1, 0])  # (copies * m blocks, heads, batch)
    if const_expr(mdQaccum.element_type != Float32):
      raise TypeError("dq_accum must be Float32")
    mdQaccum = _select(mdQaccum, [2, 3, 1, 0])  # (seqlen_q_rounded, head_dim, heads, batch)
    mdQ = _select(mdQ, [1, 3, 2, 0])  # (seqlen_q, head_dim, heads, batch)
    tiled_mma = bwd_common.dq_tiled_mma(self.dtype, self.head_dim, rows=self.tile_m,
                                        transposed=self.transposed)
    tile = (self.tile_m, self.head_dim)
    # Each warpgroup's stmatrix stores cover whole swizzle atoms: its head_dim half (e.g. 48 or
    # 96 columns) sets the swizzle width; the transposed fragment covers all columns.
    sdQ_layout = sm90_gemm.smem_layout(
        self.dtype, *tile,
        major_size=None if const_expr(self.transposed)
        else self.head_dim // bwd_common.NUM_MMA_WARPGROUPS)
    tma_atom, tma_dq = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), mdQ,
                                                   sdQ_layout, tile)
    self.shared_storage = sm90_gemm.shared_storage(
        {}, dict(sdQ=(self.dtype, cute.cosize(sdQ_layout), sm90_gemm.SMEM_ALIGN)))
    grid = (cute.ceil_div(cute.size(mdQ.shape[0]), self.tile_m), cute.size(mdQ.shape[2]),
            cute.size(mdQ.shape[3]))
    self.kernel(mdQaccum, mSem, tma_dq, tma_atom, softmax_scale, sdQ_layout, tiled_mma).launch(
        grid=grid, block=[_NUM_THREADS, 1, 1], stream=stream)

  @cute.kernel
  def kernel(self, mdQaccum: cute.Tensor, mSem: cute.Tensor, mdQ: cute.Tensor,
             tma_atom: cute.CopyAtom, softmax_scale: Float32, sdQ_layout: cute.ComposedLayout,
             tiled_mma: cute.TiledMma):
    tidx, _, _ = cute.arch.thread_idx()
    m_block, head, batch = cute.arch.block_idx()
    warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    sm90_gemm.prefetch_descriptors(warp_idx, (tma_atom,))
    gdQaccum = cute.local_tile(mdQaccum[None, None, head, batch], (self.tile_m, self.head_dim),
                               (m_block, 0))
    half = self.tile_m * self.head_dim // bwd_common.NUM_MMA_WARPGROUPS
    halves = cute.make_tensor(gdQaccum.iterator,
                              cute.make_layout((half, bwd_common.NUM_MMA_WARPGROUPS)))
    src = bwd_common.fragment_chunks(halves[None, tidx // sm90_gemm.WARPGROUP_THREADS],
                                     tidx % sm90_gemm.WARPGROUP_THREADS)
    values = cute.make_rmem_tensor(src.shape, Float32)
    cute.autovec_copy(src, values)  # 128-bit loads
    copy_blocks = cute.ceil_div(mdQ.shape[0], self.main_rows)  # main-kernel query blocks
    values.store(self._kept(values.load(), mSem, m_block, 0, copy_blocks, head, batch))
    if const_expr(self.dq_copies > 1):
      # The other copies, added in index order (a fixed order: deterministic).
      copy_rows = copy_blocks * self.main_rows
      copies = bwd_common.dq_copy_count(mdQaccum, copy_rows)
      more = cute.make_rmem_tensor(src.shape, Float32)
      for c in cutlass.range_constexpr(1, self.dq_copies):
        # A copy the call does not hold: copy 0 is read again and dropped (loads behind a
        # branch compiled to 32-bit ones).
        present = c < copies
        copy = Int32(present) * c
        offset = cutlass.Int64(copy * copy_rows) * self.head_dim
        cute.autovec_copy(cute.make_tensor(src.iterator + offset, src.layout), more)
        values.store(values.load() + self._kept(more.load(), mSem, m_block, copy, copy_blocks,
                                                head, batch, present))
    # Flat value i of the fragment order is flat value i of the MMA accumulator fragment
    # ((col, row) of the dQ^T accumulator when transposed).
    shape = (self.head_dim, self.tile_m) if const_expr(self.transposed) else (self.tile_m,
                                                                               self.head_dim)
    acc_shape = tiled_mma.get_slice(tidx).partition_shape_C(shape)
    storage = cutlass.utils.SmemAllocator().allocate(self.shared_storage)
    sdQ = storage.sdQ.get_tensor(sdQ_layout.outer, swizzle=sdQ_layout.inner)
    if const_expr(self.transposed):
      frag = cute.make_rmem_tensor(acc_shape, self.dtype)
      for i in cutlass.range_constexpr(cute.size(frag)):
        frag[i] = (values[i] * softmax_scale).to(self.dtype)
      sm90_gemm.store_frag_transposed(tiled_mma, tidx, frag, sm90_gemm.transpose_view(sdQ))
    else:
      acc = cute.make_rmem_tensor(acc_shape, Float32)
      for i in cutlass.range_constexpr(cute.size(acc)):
        acc[i] = values[i] * softmax_scale
      sm90_gemm.store_acc_to_smem(tiled_mma, tidx, acc, sdQ, self.dtype)
    # Generic-proxy smem writes must be visible to the TMA store (async proxy).
    cute.arch.fence_proxy("async.shared", space="cta")
    cute.arch.sync_threads()
    if warp_idx == 0:
      g = cute.local_tile(mdQ[None, None, head, batch], (self.tile_m, self.head_dim),
                          (m_block, 0))
      t_s, t_g = cpasync.tma_partition(tma_atom, 0, cute.make_layout(1),
                                       cute.group_modes(sdQ, 0, 2), cute.group_modes(g, 0, 2))
      cute.copy(tma_atom, t_s, t_g)
      cute.arch.cp_async_bulk_commit_group()
      # Shared memory must stay valid until the store has read it.
      cute.arch.cp_async_bulk_wait_group(0, read=True)

  @cute.jit
  def _kept(self, copy_values, mSem, m_block, copy, copy_blocks, head, batch, present=None):
    """copy_values, or zeros where the call holds no copy `copy` (present false) or no key
    block added into block m_block of it (sem_rows set: the first contribution was stored, so
    an unwritten block holds whatever the scratch held; its semaphore counts the
    contributions). The loads stay unconditional: behind a branch they compiled to 32-bit
    loads."""
    keep = present
    if const_expr(self.sem_rows is not None):
      written = mSem[m_block * self.tile_m // self.sem_rows + copy * copy_blocks, head, batch] > 0
      if const_expr(present is None):
        keep = written
      else:
        keep = written & present
    if const_expr(keep is None):
      return copy_values
    return cute.where(cute.full(copy_values.shape, keep, cutlass.Boolean), copy_values,
                      Float32(0.0))
