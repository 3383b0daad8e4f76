"""Hopper (sm_90a) chunked prefill over a KV cache: the forward's 128-row query tiles over keys
read through a page table, one CTA per tile, no split.

Imports cutlass, jaxflash.config and the sibling helper modules only (never jax).
"""

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync

from jaxflash import config
from jaxflash.kernels import decode_sm90
from jaxflash.kernels import sm90_gemm
from jaxflash.kernels import softmax
from jaxflash.kernels.decode_sm90 import FlashAttentionDecodeSm90

_select = sm90_gemm.select_modes
_WARPGROUP_THREADS = sm90_gemm.WARPGROUP_THREADS
# (producer, consumer) registers per thread after setmaxnreg, within the SM's 64K for one CTA:
# the producer warp's page-table reads of a block's 16-key boxes (decode_sm90._load_block holds
# 8 pages) spilled at 32 (18 LDL / STL at the forward's 24 / 240 split plus 8), not at 40.
_PRODUCER_REGS, _CONSUMER_REGS = 40, 232
# Keys per TMA box of pages of 64 keys (any multiple of 64 below tile_n; the routing's
# config.CHUNKED_PAGE_MULTIPLE): a 128-key block is 2 such boxes per column box and 2
# page-table reads, against 8 of each in 16-key boxes.
WIDE_BOX_ROWS = config.CHUNKED_PAGE_MULTIPLE


class FlashAttentionChunkedSm90(FlashAttentionDecodeSm90):
  """Chunked prefill: many new query tokens per sequence over its cached keys, at the forward's
  speed.

  The decode call's operands (kernel_abi.h's JaxflashDecodeArgs, the query heads of a kv head
  packed into the rows: row i * group + j is token i of query head kv * group + j) on the
  forward kernel's tile: 128 rows, two consumer warpgroups that take turns issuing their GEMMs
  (ping-pong: one's softmax runs under the other's GEMMs) and the intra-warpgroup overlap of
  S(j+1), softmax and P V(j) (FlashAttentionForwardSm90.overlap_step). CTA (m, 0, b * kv_heads
  + h) takes the tile's rows against every key block they can see, [n_lo, n_hi) from the
  sequence's run-time length (the decode kernel's _work with one split), and writes out (q's
  dtype) and lse itself: no partials, no merge. The grid launches each (batch, kv head)'s tiles
  from the last (the most keys under causal) down, so the longest tiles start first and the
  tiles of one kv head, which read the same keys, run together (L2).

  Keys come through the decode kernel's producer (decode_sm90._load_block): a whole block per
  TMA copy and one page-table read when pages are a multiple of tile_n (or the cache is
  contiguous); else boxes of 64 keys (2 per block and column box, one page-table read per
  page) when pages are a multiple of 64, and boxes of 16 keys for smaller pages (16 or 32,
  which split_kv.use_chunked sends to the split-KV kernel; a forced call still runs them). The
  producer picks the box height once per CTA from the page size. Boxes at or past the length
  are out of bounds (zero-filled, nothing read); V rows past the length in the last block are
  zeroed up to the next multiple of 64 (the widest box) before its P V GEMM. Masks (causal at
  each sequence's offset, windows) and softcap are the decode kernel's run-time band
  (_KeyBand); the learnable sink joins each row's denominator in the epilogue (per packed row:
  its query head's sink).
  """

  # 64-key boxes for pages of 64, 16-key ones for smaller pages (decode_sm90._load_block).
  box_rows = (WIDE_BOX_ROWS, decode_sm90.BOX_ROWS)

  def __init__(self, variant: config.KernelVariant):
    super().__init__(variant)
    assert variant.schedule.chunked and variant.kv_dtype is None, variant.key
    self.num_producer_regs, self.num_mma_regs = _PRODUCER_REGS, _CONSUMER_REGS
    self.pingpong = True

  @staticmethod
  def can_implement(variant: config.KernelVariant) -> tuple[bool, str]:
    if variant.direction != "decode" or not variant.schedule.chunked:
      return False, f"variant {variant.key} is not a chunked-prefill variant"
    return config.chunked_support(variant.dtype, variant.head_dim, variant.head_dim_v,
                                  variant.kv_dtype)

  @cute.jit
  def __call__(
      self,
      mQ: cute.Tensor,  # (batch, num_kv_heads, rows, head_dim): rows = seqlen_q * group
      mK: cute.Tensor,  # (num_pages, page_size, num_kv_heads, head_dim)
      mV: cute.Tensor,  # (num_pages, page_size, num_kv_heads, head_dim_v)
      mPageTable: cute.Tensor,  # (batch, max_pages) int32; no column: contiguous caches
      mLengths: cute.Tensor,  # (batch,) int32 valid keys per sequence
      mSink: cute.Tensor,  # (num_kv_heads, group or 0: none) float32 learnable sinks
      mOPart: cute.Tensor,  # (batch, 0, num_kv_heads, rows, head_dim_v) float32: unused
      mLSEPart: cute.Tensor,  # (batch, 0, num_kv_heads, rows) float32: unused
      mO: cute.Tensor,  # (batch, num_kv_heads, rows, head_dim_v) in q's dtype
      mLSE: cute.Tensor,  # (batch, num_kv_heads, rows) float32
      mKDescale: cute.Tensor,  # FP8 caches only: unused
      mVDescale: cute.Tensor,  # FP8 caches only: unused
      softmax_scale: Float32,
      seqlen_q: Int32,  # query tokens per sequence (rows / group)
      window_left: Int32,  # keys visible left of a query's position (config.WINDOW_UNBOUNDED)
      window_right: Int32,  # keys visible right of it: 0 is causal
      softcap: Float32,  # > 0: scores become softcap * tanh(s / softcap); 0: off
      stream: cuda.CUstream,
  ):
    if const_expr(not (mQ.element_type == mK.element_type == mV.element_type
                       == mO.element_type == self.dtype)):
      raise TypeError(f"q, k, v and out must be {self.dtype}")
    if const_expr(mLSE.element_type != Float32 or mSink.element_type != Float32):
      raise TypeError("the lse and the sink must be Float32")
    self._setup_attributes()
    # Kernel order puts the tile modes first.
    mQ = _select(mQ, [2, 3, 1, 0])  # (rows, head_dim, kv heads, batch)
    mK = _select(mK, [1, 3, 2, 0])  # (page_size, head_dim, kv heads, pages)
    mVt = _select(mV, [3, 1, 2, 0])  # (head_dim_v, page_size, kv heads, pages)
    load_op = cpasync.CopyBulkTensorTileG2SOp()
    tma_atom_q, tma_q = cpasync.make_tiled_tma_atom(
        load_op, mQ, self.sQ_layout, (self.tile_m, self.head_dim))
    # Boxes of each height of box_rows: 64 keys, then 16.
    tma_atom_k, tma_k = cpasync.make_tiled_tma_atom(
        load_op, mK, self.sK_boxes[0], (self.box_rows[0], self.k_box_cols))
    tma_atom_v, tma_v = cpasync.make_tiled_tma_atom(
        load_op, mVt, self.sV_boxes[0], (self.v_box_rows, self.box_rows[0]))
    tma_atom_k16, tma_k16 = cpasync.make_tiled_tma_atom(
        load_op, mK, self.sK_boxes[1], (self.box_rows[1], self.k_box_cols))
    tma_atom_v16, tma_v16 = cpasync.make_tiled_tma_atom(
        load_op, mVt, self.sV_boxes[1], (self.v_box_rows, self.box_rows[1]))
    # Whole key blocks, when every block lies in one page.
    tma_atom_kt, tma_kt = cpasync.make_tiled_tma_atom(
        load_op, mK, cute.slice_(self.sK_layout, (None, None, 0)), (self.tile_n, self.head_dim))
    tma_atom_vt, tma_vt = cpasync.make_tiled_tma_atom(
        load_op, mVt, cute.slice_(self.sV_layout, (None, None, 0)),
        (self.head_dim_v, self.tile_n))
    grid = (cute.ceil_div(mQ.shape[0], self.tile_m), 1, mQ.shape[3] * mQ.shape[2])
    self.kernel(
        tma_q, tma_k, tma_v, tma_k16, tma_v16, tma_kt, tma_vt, tma_atom_q, tma_atom_k,
        tma_atom_v, tma_atom_k16, tma_atom_v16, tma_atom_kt, tma_atom_vt, mPageTable, mLengths,
        mSink, mO, mLSE, softmax_scale, seqlen_q, window_left, window_right, softcap,
        self.sQ_layout, self.sK_layout, self.sV_layout, self.tiled_mma_qk, self.tiled_mma_pv,
    ).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream, min_blocks_per_mp=1)

  @cute.kernel
  def kernel(
      self,
      mQ: cute.Tensor,  # TMA coordinates of (rows, head_dim, kv heads, batch)
      mK: cute.Tensor,  # TMA coordinates of (page_size, head_dim, kv heads, pages), 64-key boxes
      mV: cute.Tensor,  # TMA coordinates of (head_dim_v, page_size, kv heads, pages), the same
      mK16: cute.Tensor,  # the same coordinates as mK, for 16-key boxes
      mV16: cute.Tensor,  # the same coordinates as mV, for 16-key boxes
      mKt: cute.Tensor,  # the same coordinates as mK, for whole-block copies
      mVt: cute.Tensor,  # the same coordinates as mV, for whole-block copies
      tma_atom_q: cute.CopyAtom,
      tma_atom_k: cute.CopyAtom,
      tma_atom_v: cute.CopyAtom,
      tma_atom_k16: cute.CopyAtom,
      tma_atom_v16: cute.CopyAtom,
      tma_atom_kt: cute.CopyAtom,
      tma_atom_vt: cute.CopyAtom,
      mPageTable: cute.Tensor,
      mLengths: cute.Tensor,
      mSink: cute.Tensor,
      mO: cute.Tensor,
      mLSE: cute.Tensor,
      softmax_scale: Float32,
      seqlen_q: Int32,
      window_left: Int32,
      window_right: Int32,
      softcap: Float32,
      sQ_layout: cute.ComposedLayout,
      sK_layout: cute.ComposedLayout,
      sV_layout: cute.ComposedLayout,
      tiled_mma_qk: cute.TiledMma,
      tiled_mma_pv: cute.TiledMma,
  ):
    tidx, _, _ = cute.arch.thread_idx()
    warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    sm90_gemm.prefetch_descriptors(warp_idx, (tma_atom_q, tma_atom_k, tma_atom_v, tma_atom_k16,
                                              tma_atom_v16, tma_atom_kt, tma_atom_vt))
    storage = cutlass.utils.SmemAllocator().allocate(self.shared_storage)
    pipeline_q, pipeline_k, pipeline_v = self._make_pipelines(storage)
    sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
    sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
    sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
    # Soft-capping: the S registers hold t = tanh(S * scale / softcap), so the softmax scale
    # becomes softcap.
    capped = softcap > Float32(0.0)
    tanh_scale = Float32(0.0)
    if capped:
      tanh_scale = softmax_scale / softcap
      softmax_scale = softcap
    cute.arch.mbarrier_init_fence()
    cute.arch.sync_threads()

    block_m, _, batch_head = cute.arch.block_idx()
    # Each (batch, kv head)'s tiles from the last one down: the longest first under causal.
    m_block = cute.ceil_div(mQ.shape[0], self.tile_m) - 1 - block_m
    num_kv_heads = mQ.shape[2]
    batch = batch_head // num_kv_heads
    head_kv = batch_head - batch * num_kv_heads
    warpgroup_idx = cute.arch.make_warp_uniform(tidx // _WARPGROUP_THREADS)
    # Each role derives the tile's keys after its register reallocation: values live across
    # setmaxnreg would spill in the producer's small budget.
    if warpgroup_idx == 0:
      cute.arch.setmaxregister_decrease(self.num_producer_regs)
      if warp_idx == 0:
        work = self._work(mQ.shape[0], mK.shape[0], mPageTable, mLengths, Int32(1), m_block,
                          Int32(0), batch, seqlen_q, window_left, window_right)
        # The box height is chosen once, outside the producer's loop: a run-time choice per
        # block between 64- and 16-key boxes spilled 2 registers at 40 (n_start, n_end).
        if mK.shape[0] % WIDE_BOX_ROWS == 0:  # page_size
          self.load_decode(mQ, mK, mV, mKt, mVt, tma_atom_q, tma_atom_k, tma_atom_v,
                           tma_atom_kt, tma_atom_vt, sQ, sK, sV, pipeline_q, pipeline_k,
                           pipeline_v, mPageTable, work, m_block, head_kv, batch,
                           WIDE_BOX_ROWS)
        else:
          self.load_decode(mQ, mK16, mV16, mKt, mVt, tma_atom_q, tma_atom_k16, tma_atom_v16,
                           tma_atom_kt, tma_atom_vt, sQ, sK, sV, pipeline_q, pipeline_k,
                           pipeline_v, mPageTable, work, m_block, head_kv, batch,
                           decode_sm90.BOX_ROWS)
    else:
      cute.arch.setmaxregister_increase(self.num_mma_regs)
      work = self._work(mQ.shape[0], mK.shape[0], mPageTable, mLengths, Int32(1), m_block,
                        Int32(0), batch, seqlen_q, window_left, window_right)
      c, thr_mma_pv = self.run_tile(sQ, sK, sV, tiled_mma_qk, tiled_mma_pv, pipeline_q,
                                    pipeline_k, pipeline_v, softmax_scale, Int32(capped),
                                    tanh_scale, work, m_block, seqlen_q, window_left,
                                    window_right, mQ.shape[0])
      self.epilogue_final(mO, mLSE, mSink, thr_mma_pv, c.acc_o, c.online, m_block, head_kv,
                          batch, mQ.shape[0], seqlen_q)
