"""Hopper (sm_90a) FlashAttention forward kernel: a TMA producer warp and WGMMA consumer warpgroups.

Imports cutlass, jaxflash.config and the sibling helper modules only (never jax).
"""

import dataclasses
import math
from typing import Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.utils import LayoutEnum

from jaxflash import config
from jaxflash.kernels import bias as score_bias
from jaxflash.kernels import mask
from jaxflash.kernels import mod_codegen
from jaxflash.kernels import sm90_gemm
from jaxflash.kernels import softmax
from jaxflash.kernels import tile_scheduler

_select = sm90_gemm.select_modes
DTYPES = sm90_gemm.DTYPES

_WARPGROUP_THREADS = sm90_gemm.WARPGROUP_THREADS
_WARP_THREADS = sm90_gemm.WARP_THREADS
# Named barrier 0 is __syncthreads; 1 syncs the consumer warpgroups in the epilogue; 2 + w is
# consumer warpgroup w's turn to issue its GEMMs (ping-pong).
_EPILOGUE_BARRIER = 1
_SCHEDULER_BARRIER_BASE = 2
# (producer, consumer) registers per thread after setmaxnreg, by number of consumer warpgroups:
# the budget is 64K registers per SM for one CTA (FA-3's split; 24 suffices for a TMA-only warp).
_REGISTER_SPLIT = {1: (56, 256), 2: (24, 240), 3: (32, 160)}


def _smem_buffers(variant: config.KernelVariant) -> dict:
  """The shared buffers of the 16-bit forward after its mbarriers, in storage order: {name:
  (element type, count, alignment)}. Each Q slot also holds its tile's O (after the last QK^T
  GEMM); masked variants add each K stage's key block ids (one bulk copy with the K tile);
  dynamic schedules each Q slot's tile index (the producer claims it, the consumers read it);
  bias variants each K stage's bias tile (tile_m x tile_n, a TMA copy with the K tile)."""
  dtype, s = DTYPES[variant.dtype], variant.schedule
  align = sm90_gemm.SMEM_ALIGN
  buffers = dict(
      sQ=(dtype, s.q_stages * s.tile_m * max(variant.head_dim, variant.head_dim_v), align),
      sK=(dtype, s.num_stages * s.tile_n * variant.head_dim, align),
      sV=(dtype, s.num_stages * s.tile_n * variant.head_dim_v, align))
  if variant.masked:
    buffers["sKIds"] = (Int32, s.num_stages * s.tile_n, 128)
  if s.dynamic:
    buffers["sTile"] = (Int32, s.q_stages, 16)
  if variant.bias:
    buffers["sBias"] = (dtype, s.num_stages * s.tile_m * s.tile_n, align)
  return buffers


class FlashAttentionForwardSm90:
  """FA-3 style forward: warpgroup 0 produces (one warp issues TMA), the others consume.

  Each consumer warpgroup owns 64 query rows of the tile_m x tile_n block: S = Q K^T (WGMMA, both
  operands in shared memory), online softmax in registers, O += P V (WGMMA, P from registers).
  K and V ride two mbarrier pipelines of num_stages slots each; Q has a pipeline of q_stages
  slots (1 or 2), each released by the epilogue once the O store has left shared memory (O
  reuses its tile's Q slot): with two, a persistent CTA's producer loads the next tile's Q
  while the current tile computes. Dense causal variants tile the queries from the last row
  (_row_shift), so a partial tile is the first one, which sees the fewest keys.
  Key blocks overlap inside a warpgroup: S(j+1) = Q K(j+1)^T and O += P(j) V(j) are issued back
  to back and the softmax of j+1 runs while the PV GEMM is in flight (overlap_step).

  The schedule (config.FwdSchedule) sets the tile, the ping-pong of the consumer warpgroups
  (one's softmax overlaps the other's GEMMs), the persistent grid, the LPT tile order and where
  O is rescaled. Dynamic schedules (causal and masked variants) run a persistent grid whose
  producer warp claims each next tile from a counter in global memory (mTileCounter, zero at
  launch; tile_scheduler.claim) and publishes it in the Q slot it loads the tile's Q into: the
  consumers read each tile from the slot they wait on, and a tile index past the last ends
  their loop. Tiles go to CTAs in the order the hardware would hand one CTA per tile to SMs
  (longest first), while a CTA's next Q and K loads overlap its current tile.
  Masked variants (windows, segment ids; config.KernelVariant.masked) take per query tile a
  range of key blocks [n_start, n_end) and a sub-range [full_lo, full_hi) that needs no
  elementwise mask (jaxflash/block_ranges.py; they stand in launch order), the tile order
  (each batch's tiles from the last down), the query and key segment ids and the band as
  run-time operands. The producer copies each key block's ids into shared memory with its K
  tile; the blocks outside [full_lo, full_hi) are masked by band and ids
  (mask.apply_band_and_ids). They also take the
  call's softcap as a run-time Float32: when > 0, each S becomes tanh(S * scale / softcap),
  behind a branch that is uniform across every warp, and the softmax then scales by softcap, so
  max, sums and lse stay in the capped domain. Where P's type can hold every capped score's p
  under one fixed row max (softmax.capped_start_max: softcap <= 50.6 in bf16, 10 in fp16), every
  row keeps that max, and blocks without the mask take each score's tanh just before its exp2
  with no max search (OnlineSoftmax.capped_softmax). Otherwise the running max, after the tanh
  (softmax.soft_cap). Blocks that need the mask take the tanh before it.
  Bias variants (masked ones, config.KernelVariant.bias) add bias[b, h, i, j] to each score
  after the tanh and before the mask and keep the running max: each K stage also carries the
  (query tile, key block) tile of the bias, a TMA copy on the stage's barrier, which the
  consumers read from shared memory with ldmatrix (kernels/bias.py, _add_bias); they release
  the stage after the softmax.
  Every variant takes the learnable sink at run time (mSink, one float32 logit per query head,
  and has_sink): the epilogue adds the sink's term to each row's denominator
  (OnlineSoftmax.finalize), so out and lse come out with the sink, in no extra pass.
  """

  def __init__(self, variant: config.KernelVariant):
    schedule = variant.schedule
    self.dtype = DTYPES[variant.dtype]
    self.out_dtype = self.dtype  # O's type (the FP8 kernel writes bf16)
    self.head_dim = variant.head_dim
    self.head_dim_v = variant.head_dim_v
    # WGMMA's K step is 16 elements; the shipped head dims (64 to 256) are multiples of 32.
    self.head_dim_padded = (variant.head_dim + 15) // 16 * 16
    self.tile_m = schedule.tile_m
    self.tile_n = schedule.tile_n
    self.num_stages = schedule.num_stages
    self.q_stages = schedule.q_stages
    # O is staged in its tile's Q slot, so each slot must hold both.
    assert self.q_stages == 1 or variant.head_dim == variant.head_dim_v, variant.key
    self.causal = variant.causal
    self.num_mma_warpgroups = self.tile_m // 64
    self.num_mma_threads = self.num_mma_warpgroups * _WARPGROUP_THREADS
    self.num_threads = self.num_mma_threads + _WARPGROUP_THREADS
    self.num_producer_regs, self.num_mma_regs = _REGISTER_SPLIT[self.num_mma_warpgroups]
    self.pingpong = schedule.pingpong
    self.persistent = schedule.persistent
    self.dynamic = schedule.dynamic
    self.lpt = schedule.lpt
    self.rescale_o_before_pv = schedule.rescale_o_before_pv
    self.masked = variant.masked
    # Bias variants (masked ones) add bias[b, h, i, j] to every score (kernels/bias.py).
    self.bias = variant.bias
    # Mods variants (masked ones, never with a bias) run score_mod / mask_mod on every score
    # after the soft cap and before the band and segment-id mask (kernels/mod_codegen.py); the
    # parsed IR, or None.
    self.mods = mod_codegen.parse(variant.mods) if variant.mods else None
    assert not variant.mods or (variant.masked and not variant.bias), variant.key
    # Soft-capped calls may keep a fixed row max (softmax.capped_start_max) on two-warpgroup
    # tiles only: its rounding of P (softmax.round_p_pair) spilled the fp16 three-warpgroup tile
    # (head_dim 64, 192 x 128, 128 registers per thread: 28 LDL / STL). Those keep the running
    # max. A bias is unbounded, so capped scores plus a bias have no fixed max: bias variants
    # keep the running max too.
    # score_mod changes the range of the scores too.
    self.fixed_capped_max = (variant.masked and self.num_mma_warpgroups == 2
                             and not variant.bias and not variant.mods)
    # Dense causal: the query tiles end at the last row (_row_shift), so the partial tile is the
    # one with the fewest keys. The FP8 kernel keeps tiles from row 0 (its query descales come
    # in chunks of 64 rows from row 0).
    self.tiles_from_last_row = variant.causal and not variant.masked
    # O is staged in its tile's Q slot, so Q is released once O's store has read it. A kernel
    # whose O has a buffer of its own may release Q at the epilogue barrier instead.
    self.release_q_at_epilogue = False
    self.variant = variant

  @staticmethod
  def smem_bytes(variant: config.KernelVariant) -> int:
    """Shared memory of one CTA: mbarriers, Q (reused for O), the K and V rings (masked: with
    the key blocks' segment ids), alignment."""
    return sm90_gemm.smem_bytes(_smem_buffers(variant))

  @staticmethod
  def can_implement(variant: config.KernelVariant) -> tuple[bool, str]:
    """Whether this kernel runs the variant (config.kernel_support decides)."""
    return sm90_gemm.variant_support(variant, "fwd")

  def _setup_attributes(self):
    """Tiled MMAs, shared layouts, TMA byte counts and the shared storage struct."""
    k_major, mn_major = warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN
    # One 64 x N WGMMA atom per consumer warpgroup, stacked along M.
    atoms = (self.num_mma_warpgroups, 1, 1)
    self.tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
        self.dtype, self.dtype, k_major, k_major, Float32, atoms, (64, self.tile_n))
    # V is (seqlen_k, head_dim_v) with head_dim_v contiguous: MN-major B operand of P V.
    self.tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
        self.dtype, self.dtype, k_major, mn_major, Float32, atoms, (64, self.head_dim_v),
        a_source=warpgroup.OperandSource.RMEM)
    # With one Q slot the Q and O layouts have no slot mode (_q_slot).
    q_slots = None if self.q_stages == 1 else self.q_stages
    self.sQ_layout = sm90_gemm.smem_layout(self.dtype, self.tile_m, self.head_dim, q_slots)
    self.sK_layout = sm90_gemm.smem_layout(self.dtype, self.tile_n, self.head_dim, self.num_stages)
    # V^T tile: (head_dim_v, tile_n), head_dim_v contiguous.
    self.sV_layout = sm90_gemm.smem_layout(self.dtype, self.head_dim_v, self.tile_n,
                                           self.num_stages, col_major=True)
    self.sO_layout = sm90_gemm.smem_layout(self.dtype, self.tile_m, self.head_dim_v, q_slots)
    self.tma_bytes_q = cute.size_in_bytes(self.dtype, self._q_slot_layout(self.sQ_layout))
    self.tma_bytes_k = cute.size_in_bytes(self.dtype, cute.slice_(self.sK_layout, (None, None, 0)))
    self.tma_bytes_v = cute.size_in_bytes(self.dtype, cute.slice_(self.sV_layout, (None, None, 0)))
    if self.masked:
      self.tma_bytes_k += self.tile_n * 4  # the key block's ids ride on the K stage
    tiles = dict(sQ=(self.sQ_layout, self.sO_layout), sK=(self.sK_layout,), sV=(self.sV_layout,))
    if self.bias:
      # The bias tile of the K stage's key block: queries x keys, keys contiguous (the bias's
      # rows), TMA-swizzled as K is.
      self.sBias_layout = sm90_gemm.smem_layout(self.dtype, self.tile_m, self.tile_n,
                                                self.num_stages)
      self.tma_bytes_k += cute.size_in_bytes(self.dtype,
                                             cute.slice_(self.sBias_layout, (None, None, 0)))
      tiles["sBias"] = (self.sBias_layout,)
    # O reuses Q's buffer once every QK^T GEMM is done (an epilogue barrier orders that).
    self.shared_storage = sm90_gemm.shared_storage(
        dict(mbar_q=self.q_stages, mbar_k=self.num_stages, mbar_v=self.num_stages),
        _smem_buffers(self.variant), tiles)

  @cute.jit
  def __call__(
      self,
      mQ: cute.Tensor,  # (batch, seqlen_q, num_heads, head_dim)
      mK: cute.Tensor,  # (batch, seqlen_k, num_kv_heads, head_dim)
      mV: cute.Tensor,  # (batch, seqlen_k, num_kv_heads, head_dim_v)
      mO: cute.Tensor,  # (batch, seqlen_q, num_heads, head_dim_v)
      mLSE: cute.Tensor,  # (batch, num_heads, seqlen_q) float32
      mSink: cute.Tensor,  # (num_heads,) float32 learnable sink logits, read when has_sink
      mQIds: cute.Tensor,  # masked: (batch, m blocks * tile_m) int32 query segment ids, or None
      mKIds: cute.Tensor,  # masked: (batch, n blocks * tile_n) int32 key segment ids, or None
      mRanges: cute.Tensor,  # masked: (batch, m blocks, 4) int32 block ranges in launch order
      mOrder: cute.Tensor,  # masked: (batch * m blocks,) int32 tile order, or None
      mTileCounter: Optional[cute.Tensor],  # dynamic schedules: (1,) int32, zero; else None
      mBias: Optional[cute.Tensor],  # bias: (rows, seqlen_k, planes) in dtype (kernels/bias.py)
      bias_batch_planes: Optional[Int32],  # bias: its planes per batch (0: broadcast), or None
      bias_head_planes: Optional[Int32],  # bias: its planes per head (0: broadcast)
      bias_query_step: Optional[Int32],  # bias: 1, or 0 for one row per (batch, head)
      mMod0: Optional[cute.Tensor],  # mods: the closed-over arrays in operand order (their own
      mMod1: Optional[cute.Tensor],  # dtypes and ranks, rank 0 as (1,)), None past the last
      mMod2: Optional[cute.Tensor],
      mMod3: Optional[cute.Tensor],
      softmax_scale: Float32,
      has_sink: Int32,  # 1: each row's softmax also runs over mSink[head]; 0: no sink
      window_left: Optional[Int32],  # masked: the band (block_ranges.window_bounds), or None
      window_right: Optional[Int32],
      softcap: Optional[Float32],  # masked: scores become softcap * tanh(s / softcap); 0: off
      stream: cuda.CUstream,
  ):
    if const_expr(not (mQ.element_type == mK.element_type == mV.element_type
                       == mO.element_type == self.dtype)):
      raise TypeError(f"q, k, v and out must all be {self.dtype}")
    if const_expr(mLSE.element_type != Float32 or mSink.element_type != Float32):
      raise TypeError(f"lse and sink must be Float32, got {mLSE.element_type}, "
                      f"{mSink.element_type}")
    if const_expr(self.masked != (mRanges is not None)):
      raise TypeError("the mask operands are passed exactly to masked variants")
    if const_expr(self.dynamic != (mTileCounter is not None)):
      raise TypeError("the tile counter is passed exactly to dynamic schedules")
    if const_expr(self.bias != (mBias is not None)):
      raise TypeError("the bias is passed exactly to bias variants")
    if const_expr(self.bias and mBias.element_type != self.dtype):
      raise TypeError(f"bias must be {self.dtype}, got {mBias.element_type}")
    mMods = tuple(t for t in (mMod0, mMod1, mMod2, mMod3) if const_expr(t is not None))
    want = self.mods["arrays"] if const_expr(self.mods is not None) else ()
    if const_expr(len(mMods) != len(want)):
      raise TypeError(f"the mods' arrays: {len(want)} expected, got {len(mMods)}")
    for t, (dtype, rank) in zip(mMods, want):  # a trace-time loop
      if const_expr(t.element_type != mod_codegen.storage_type(dtype)
                    or cute.rank(t) != max(rank, 1)):
        raise TypeError(f"a mods array of {dtype} rank {rank} got {t.element_type} rank "
                        f"{cute.rank(t)}")
    self._setup_attributes()
    (tma_q, tma_k, tma_v, tma_o), (tma_atom_q, tma_atom_k, tma_atom_v, tma_atom_o), mLSE, grid = (
        self._tma_operands(mQ, mK, mV, mO, mLSE))
    if const_expr(self.masked):
      mQIds, mKIds = [_select(t, [1, 0]) for t in (mQIds, mKIds)]  # (positions, batch)
      mRanges = _select(mRanges, [2, 1, 0])  # (4, m blocks, batch)
    tma_atom_bias = None
    if const_expr(self.bias):
      # Keys past seqlen_k come in as zeros (out of bounds), and the mask hides them.
      tma_atom_bias, mBias = cpasync.make_tiled_tma_atom(
          cpasync.CopyBulkTensorTileG2SOp(), mBias,
          cute.slice_(self.sBias_layout, (None, None, 0)), (self.tile_m, self.tile_n))
    # O in kernel order for the stores a TMA store cannot make (a tile starting above row 0).
    mO_rows = _select(mO, [1, 3, 2, 0]) if const_expr(self.tiles_from_last_row) else None
    self.kernel(
        tma_q, tma_k, tma_v, tma_o, mLSE, mSink,
        tma_atom_q, tma_atom_k, tma_atom_v, tma_atom_o,
        softmax_scale, has_sink,
        self.sQ_layout, self.sK_layout, self.sV_layout, self.sO_layout,
        self.tiled_mma_qk, self.tiled_mma_pv,
        mQIds, mKIds, mRanges, mOrder, window_left, window_right, softcap, mO_rows, mTileCounter,
        mBias, tma_atom_bias, self.sBias_layout if const_expr(self.bias) else None,
        bias_batch_planes, bias_head_planes, bias_query_step, mMods,
    ).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream, min_blocks_per_mp=1)

  def _tma_operands(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                    mLSE: cute.Tensor):
    """The TMA coordinate tensors and atoms of Q, K, V (loads) and O (store), lse in kernel
    order, and the grid. Kernel-side order puts the tile modes first: (seqlen, head_dim, heads,
    batch); V as (head_dim_v, seqlen_k, num_kv_heads, batch); lse (seqlen_q, num_heads, batch).
    """
    mQ, mK, mO = [_select(t, [1, 3, 2, 0]) for t in (mQ, mK, mO)]
    mVt = _select(mV, [3, 1, 2, 0])
    load_op = cpasync.CopyBulkTensorTileG2SOp()
    tma_atom_q, tma_q = cpasync.make_tiled_tma_atom(
        load_op, mQ, self._q_slot_layout(self.sQ_layout), (self.tile_m, self.head_dim))
    tma_atom_k, tma_k = cpasync.make_tiled_tma_atom(
        load_op, mK, cute.slice_(self.sK_layout, (None, None, 0)), (self.tile_n, self.head_dim))
    tma_atom_v, tma_v = cpasync.make_tiled_tma_atom(
        load_op, mVt, cute.slice_(self.sV_layout, (None, None, 0)),
        (self.head_dim_v, self.tile_n))
    # TMA stores clip at the tensor bounds: rows >= seqlen_q are never written.
    tma_atom_o, tma_o = cpasync.make_tiled_tma_atom(
        cpasync.CopyBulkTensorTileS2GOp(), mO, self._q_slot_layout(self.sO_layout),
        (self.tile_m, self.head_dim_v))
    num_m_blocks = cute.ceil_div(cute.size(mQ.shape[0]), self.tile_m)
    grid = tile_scheduler.StaticTileScheduler.grid_shape(
        num_m_blocks, cute.size(mQ.shape[2]), cute.size(mQ.shape[3]), self.persistent)
    return ((tma_q, tma_k, tma_v, tma_o), (tma_atom_q, tma_atom_k, tma_atom_v, tma_atom_o),
            _select(mLSE, [2, 1, 0]), grid)

  @cute.kernel
  def kernel(
      self,
      mQ: cute.Tensor,  # TMA coordinates of (seqlen_q, head_dim, num_heads, batch)
      mK: cute.Tensor,  # TMA coordinates of (seqlen_k, head_dim, num_kv_heads, batch)
      mV: cute.Tensor,  # TMA coordinates of (head_dim_v, seqlen_k, num_kv_heads, batch)
      mO: cute.Tensor,  # TMA coordinates of (seqlen_q, head_dim_v, num_heads, batch)
      mLSE: cute.Tensor,  # (seqlen_q, num_heads, batch)
      mSink: cute.Tensor,  # (num_heads,)
      tma_atom_q: cute.CopyAtom,
      tma_atom_k: cute.CopyAtom,
      tma_atom_v: cute.CopyAtom,
      tma_atom_o: cute.CopyAtom,
      softmax_scale: Float32,
      has_sink: Int32,
      sQ_layout: cute.ComposedLayout,
      sK_layout: cute.ComposedLayout,
      sV_layout: cute.ComposedLayout,
      sO_layout: cute.ComposedLayout,
      tiled_mma_qk: cute.TiledMma,
      tiled_mma_pv: cute.TiledMma,
      mQIds: cute.Tensor,  # masked: (m blocks * tile_m, batch), or None (also the rest)
      mKIds: cute.Tensor,  # (n blocks * tile_n, batch)
      mRanges: cute.Tensor,  # (4, m blocks, batch): n_start, n_end, full_lo, full_hi
      mOrder: cute.Tensor,  # (batch * m blocks,)
      window_left: Optional[Int32],
      window_right: Optional[Int32],
      softcap: Optional[Float32],
      mO_rows: Optional[cute.Tensor],  # tiles_from_last_row: (seqlen_q, head_dim_v, heads, batch)
      mTileCounter: Optional[cute.Tensor],  # dynamic: (1,) int32, zero at launch; else None
      mBias: Optional[cute.Tensor],  # bias: TMA coordinates of (rows, seqlen_k, planes), or None
      tma_atom_bias: Optional[cute.CopyAtom],
      sBias_layout: Optional[cute.ComposedLayout],
      bias_batch_planes: Optional[Int32],  # bias: kernels/bias.py BiasPlanes
      bias_head_planes: Optional[Int32],
      bias_query_step: Optional[Int32],
      mMods: tuple,  # mods: the closed-over arrays; else ()
  ):
    tidx, _, _ = cute.arch.thread_idx()
    warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    atoms = (tma_atom_q, tma_atom_k, tma_atom_v, tma_atom_o)
    if const_expr(self.bias):
      atoms = atoms + (tma_atom_bias,)
    sm90_gemm.prefetch_descriptors(warp_idx, atoms)

    storage = cutlass.utils.SmemAllocator().allocate(self.shared_storage)
    pipeline_q, pipeline_k, pipeline_v = self._make_pipelines(storage)
    sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
    sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
    sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
    sO = cute.make_tensor(cute.recast_ptr(sQ.iterator, sO_layout.inner, self.dtype),
                          sO_layout.outer)
    # Dynamic schedules: the tile index of each Q slot.
    tiles = (_TileHandOff(storage.sTile.get_tensor(cute.make_layout(self.q_stages)), mTileCounter)
             if const_expr(self.dynamic) else None)
    masking = None
    if const_expr(self.masked):
      sKIds = storage.sKIds.get_tensor(cute.make_layout((self.tile_n, self.num_stages)))
      # Soft-capping: S' = softcap * tanh(S * softmax_scale / softcap). The kernel keeps
      # t = tanh(S * tanh_scale) in the S registers, so the softmax scale becomes softcap.
      capped = softcap > Float32(0.0)
      tanh_scale = Float32(0.0)
      start_max = -Float32.inf
      if capped:
        tanh_scale = softmax_scale / softcap
        softmax_scale = softcap
        if const_expr(self.fixed_capped_max):
          start_max = softmax.capped_start_max(softcap * softmax.LOG2_E,
                                               *softmax.capped_p_range_log2(self.dtype))
      # The bias joins the scores in the S registers' units: S * softmax_scale (or softcap *
      # t when capped) is the score, so the bias enters divided by that scale.
      bias = None
      if const_expr(self.bias):
        bias = _BiasOperands(
            tma=mBias, tma_atom=tma_atom_bias,
            planes=score_bias.BiasPlanes(bias_batch_planes, bias_head_planes, bias_query_step),
            smem=storage.sBias.get_tensor(sBias_layout.outer, swizzle=sBias_layout.inner),
            tiles=score_bias.SharedTiles(Int32(storage.sBias.data_ptr().toint()), sBias_layout),
            scale=Float32(1.0) / softmax_scale)
      # score_mod sees the score: S * softmax_scale in, its result / softmax_scale out.
      mod_scale = None
      mod_inv_scale = None
      if const_expr(self.mods is not None):
        mod_scale = softmax_scale
        mod_inv_scale = Float32(1.0) / softmax_scale
      masking = _Masking(query_ids=mQIds, key_ids=mKIds, ranges=mRanges, order=mOrder,
                         window_left=window_left, window_right=window_right,
                         capped=Int32(capped), tanh_scale=tanh_scale, key_ids_smem=sKIds,
                         start_max=start_max, bias=bias, mod_arrays=mMods,
                         mod_scale=mod_scale, mod_inv_scale=mod_inv_scale)
    # Barrier inits (deferred in _make_pipelines) must be visible before anyone waits on them.
    cute.arch.mbarrier_init_fence()
    cute.arch.sync_threads()

    scheduler = tile_scheduler.StaticTileScheduler(
        cute.ceil_div(mQ.shape[0], self.tile_m), mQ.shape[2], mQ.shape[3], mK.shape[0],
        kv_bytes_per_key=(self.head_dim + self.head_dim_v) * self.dtype.width // 8,
        lpt=self.lpt, persistent=self.persistent)
    warpgroup_idx = cute.arch.make_warp_uniform(tidx // _WARPGROUP_THREADS)
    if warpgroup_idx == 0:
      cute.arch.setmaxregister_decrease(self.num_producer_regs)
      if warp_idx == 0:
        self.load(mQ, mK, mV, tma_atom_q, tma_atom_k, tma_atom_v, sQ, sK, sV,
                  pipeline_q, pipeline_k, pipeline_v, scheduler, masking, tiles)
    else:
      cute.arch.setmaxregister_increase(self.num_mma_regs)
      self.mma(mO, mLSE, mSink, has_sink, tma_atom_o, sQ, sK, sV, sO, tiled_mma_qk,
               tiled_mma_pv, pipeline_q, pipeline_k, pipeline_v, softmax_scale, scheduler,
               mQ.shape[0], mK.shape[0], masking, mO_rows, tiles)

  def _make_pipelines(self, storage, v_consumer_warps: Optional[int] = None):
    """TMA pipelines (Q: q_stages slots): one elected producer thread arrives; consumers
    release per warp.

    K/V slots are released by lane 0 of every consumer warp (V's consumers: v_consumer_warps
    warps, default the MMA warps); a Q slot only by the warp that stores O (after the store
    has read shared memory, since O reuses its tile's Q slot).
    """
    producer = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
    consumer = pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                         self.num_mma_threads // _WARP_THREADS)
    v_consumer = consumer if v_consumer_warps is None else pipeline.CooperativeGroup(
        pipeline.Agent.Thread, v_consumer_warps)
    made = []
    for mbar, stages, tx, group in ((storage.mbar_q, self.q_stages, self.tma_bytes_q, producer),
                                    (storage.mbar_k, self.num_stages, self.tma_bytes_k, consumer),
                                    (storage.mbar_v, self.num_stages, self.tma_bytes_v,
                                     v_consumer)):
      made.append(pipeline.PipelineTmaAsync.create(
          barrier_storage=mbar.data_ptr(), num_stages=stages, producer_group=producer,
          consumer_group=group, tx_count=tx, defer_sync=True))
    return made

  @cute.jit
  def load(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor,
           tma_atom_q: cute.CopyAtom, tma_atom_k: cute.CopyAtom, tma_atom_v: cute.CopyAtom,
           sQ: cute.Tensor, sK: cute.Tensor, sV: cute.Tensor,
           pipeline_q, pipeline_k, pipeline_v, scheduler, masking, tiles=None):
    """Producer warp: per tile, Q once and the K/V blocks in the consumers' order.

    The overlapped consumers need K(j+1) before V(j): K(n_max-1), Q, then K(n-1), V(n) for
    n = n_max-1 .. n_min+1, then V(n_min) (n_min = 0 but in masked variants). Masked: each K
    stage also carries its key block's segment ids. Dynamic schedules (tiles): each tile is
    claimed once the previous one's loads are issued and published with its Q; past the last
    tile, the end (total_tiles) is published in the next Q slot.
    """
    seqlen_q, seqlen_k = mQ.shape[0], mK.shape[0]
    q_per_kv = mQ.shape[2] // mK.shape[2]
    one_cta = cute.make_layout(1)
    q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.q_stages)
    kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
    row_shift = self._row_shift(seqlen_q)
    tile = scheduler.first_claim(tiles.counter) if const_expr(self.dynamic) else (
        scheduler.first_tile())
    while tile < scheduler.total_tiles:
      m_block, head, batch, n_min, n_max, _ = self._tile_and_key_blocks(
          scheduler, tile, masking, seqlen_q + row_shift, seqlen_k)
      # GQA/MQA: q heads [g * ratio, (g + 1) * ratio) share kv head g.
      head_kv = head // q_per_kv
      mQ_head = mQ[None, None, head, batch]
      if const_expr(self.tiles_from_last_row):
        mQ_head = cute.domain_offset((-row_shift, 0), mQ_head)
      gQ = cute.local_tile(mQ_head, (self.tile_m, self.head_dim), (m_block, 0))
      gK = cute.local_tile(mK[None, None, head_kv, batch], (self.tile_n, self.head_dim), (None, 0))
      gV = cute.local_tile(mV[None, None, head_kv, batch], (self.head_dim_v, self.tile_n),
                           (0, None))
      tQsQ, tQgQ = cpasync.tma_partition(
          tma_atom_q, 0, one_cta, cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2))
      tQsQ = self._q_slot(tQsQ, q_state)
      tKsK, tKgK = cpasync.tma_partition(
          tma_atom_k, 0, one_cta, cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2))
      tVsV, tVgV = cpasync.tma_partition(
          tma_atom_v, 0, one_cta, cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2))
      bias_tiles = self._bias_tiles(masking, m_block, head, batch)

      if n_max > n_min:
        pipeline_k.producer_acquire(kv_state)
        cute.copy(tma_atom_k, tKgK[None, n_max - 1], tKsK[None, kv_state.index],
                  tma_bar_ptr=pipeline_k.producer_get_barrier(kv_state))
        self._load_key_block_data(masking, pipeline_k, kv_state, n_max - 1, head_kv, batch)
        self._load_bias_block(masking, bias_tiles, pipeline_k, kv_state, n_max - 1)
      # Q is loaded even when no key block is visible: the consumers always wait for it, so no
      # TMA write into sQ can still be in flight when the epilogue reuses sQ for O.
      if const_expr(self.dynamic):
        tiles.publish(pipeline_q, q_state, tile, True)
      else:
        pipeline_q.producer_acquire(q_state)
      cute.copy(tma_atom_q, tQgQ, tQsQ, tma_bar_ptr=pipeline_q.producer_get_barrier(q_state))
      q_state.advance()
      for i in cutlass.range(n_max - 1 - n_min, unroll=1):
        n_block = n_max - 1 - i
        v_state = kv_state.clone()
        kv_state.advance()
        pipeline_k.producer_acquire(kv_state)
        cute.copy(tma_atom_k, tKgK[None, n_block - 1], tKsK[None, kv_state.index],
                  tma_bar_ptr=pipeline_k.producer_get_barrier(kv_state))
        self._load_key_block_data(masking, pipeline_k, kv_state, n_block - 1, head_kv,
                                  batch)
        self._load_bias_block(masking, bias_tiles, pipeline_k, kv_state, n_block - 1)
        pipeline_v.producer_acquire(v_state)
        cute.copy(tma_atom_v, tVgV[None, n_block], tVsV[None, v_state.index],
                  tma_bar_ptr=pipeline_v.producer_get_barrier(v_state))
      if n_max > n_min:
        pipeline_v.producer_acquire(kv_state)
        cute.copy(tma_atom_v, tVgV[None, n_min], tVsV[None, kv_state.index],
                  tma_bar_ptr=pipeline_v.producer_get_barrier(kv_state))
        kv_state.advance()
      tile = scheduler.claim(tiles.counter) if const_expr(self.dynamic) else (
          scheduler.next_tile(tile))
    if const_expr(self.dynamic):
      tiles.publish(pipeline_q, q_state, scheduler.total_tiles, False)

  def _q_slot_layout(self, layout):
    """One Q slot's part of a Q or O shared layout (the layout itself with one slot)."""
    return layout if self.q_stages == 1 else cute.slice_(layout, (None, None, 0))

  def _q_slot(self, t: cute.Tensor, q_state) -> cute.Tensor:
    """The part of t (its last mode the Q slot) in slot q_state.index; t with one slot."""
    if const_expr(self.q_stages == 1):
      return t
    return t[(None,) * (cute.rank(t) - 1) + (q_state.index,)]

  def _consumer_for_slot(self, c, q_state):
    """The consumer bundle whose Q fragment reads slot q_state.index."""
    if const_expr(self.q_stages == 1):
      return c
    return dataclasses.replace(c, tSrQ=self._q_slot(c.tSrQ, q_state))

  @cute.jit
  def _row_shift(self, seqlen_q: Int32) -> Int32:
    """How many rows the query tiles start above row 0: tiles_from_last_row puts the last
    tile's end at seqlen_q, so only the first tile (the one that sees the fewest keys under
    causal) is partial, not the last (the one that sees them all). Tile m then holds rows
    [m * tile_m - shift, (m + 1) * tile_m - shift): its rows above 0 are zeros (TMA fills
    them), see no key and are never stored. The mask and block counts see seqlen_q + shift
    rows, which keeps the bottom-right alignment of every real row."""
    shift = Int32(0)
    if const_expr(self.tiles_from_last_row):
      shift = cute.ceil_div(seqlen_q, self.tile_m) * self.tile_m - seqlen_q
    return shift

  @cute.jit
  def _tile_and_key_blocks(self, scheduler, tile: Int32, masking, tiled_rows: Int32,
                           seqlen_k: Int32):
    """(m_block, head, batch, n_min, n_max, slot) of a tile: its key blocks are [n_min, n_max).
    Dense variants: from the causal mask over the tiles' rows (tiled_rows: seqlen_q plus
    _row_shift; n_min = 0, a trace-time constant; slot None); masked: from the call's tile
    order and its block ranges, which stand in launch order (slot: the tile's entry there), so
    both loads are issued together."""
    slot = None
    if const_expr(self.masked):
      m_block, head, batch, slot = scheduler.decode_ordered(tile, masking.order)
      n_min = masking.ranges[0, slot, batch]
      n_max = masking.ranges[1, slot, batch]
    else:
      m_block, head, batch = scheduler.decode(tile)
      n_min = 0
      n_max = mask.n_block_max(m_block, tiled_rows, seqlen_k, self.tile_m, self.tile_n,
                               self.causal)
    return m_block, head, batch, n_min, n_max, slot

  @cute.jit
  def _load_key_block_data(self, masking, pipeline_k, kv_state, n_block: Int32, head_kv: Int32,
                           batch: Int32):
    """What a K stage carries besides K. Masked: the segment ids of key block n_block, one bulk
    copy that completes on the K stage's barrier (its transaction bytes include them)."""
    if const_expr(self.masked):
      with cute.arch.elect_one():
        sm90_gemm.bulk_copy_g2s(masking.key_ids_smem[None, kv_state.index].iterator,
                                masking.key_ids[None, batch].iterator + n_block * self.tile_n,
                                self.tile_n * 4, pipeline_k.producer_get_barrier(kv_state))

  def _bias_tiles(self, masking, m_block: Int32, head: Int32, batch: Int32):
    """Bias variants: (shared, global) TMA partitions of the tile's bias blocks (the rows of its
    queries in its (batch, head)'s plane, kernels/bias.py BiasPlanes); None otherwise."""
    if const_expr(not self.bias):
      return None
    b = masking.bias
    plane = b.tma[None, None, b.planes.plane(batch, head)]
    gBias = cute.local_tile(cute.domain_offset((b.planes.row(m_block * self.tile_m), 0), plane),
                            (self.tile_m, self.tile_n), (0, None))
    return cpasync.tma_partition(b.tma_atom, 0, cute.make_layout(1),
                                 cute.group_modes(b.smem, 0, 2), cute.group_modes(gBias, 0, 2))

  @cute.jit
  def _load_bias_block(self, masking, bias_tiles, pipeline_k, kv_state, n_block: Int32):
    """Bias variants: the bias tile of key block n_block into K stage kv_state, on the stage's
    barrier (its transaction bytes include it)."""
    if const_expr(self.bias):
      tBsB, tBgB = bias_tiles
      cute.copy(masking.bias.tma_atom, tBgB[None, n_block], tBsB[None, kv_state.index],
                tma_bar_ptr=pipeline_k.producer_get_barrier(kv_state))

  @cute.jit
  def mma(self, mO: cute.Tensor, mLSE: cute.Tensor, mSink: cute.Tensor, has_sink: Int32,
          tma_atom_o: cute.CopyAtom,
          sQ: cute.Tensor, sK: cute.Tensor, sV: cute.Tensor, sO: cute.Tensor,
          tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma,
          pipeline_q, pipeline_k, pipeline_v, softmax_scale: Float32, scheduler,
          seqlen_q: Int32, seqlen_k: Int32, masking, mO_rows=None, tiles=None):
    """Consumer warpgroups: per tile, S = Q K^T, online softmax, O += P V, epilogue. Dynamic
    schedules (tiles): each tile is the one published with the Q slot waited on."""
    tidx, _, _ = cute.arch.thread_idx()
    wg = cute.arch.make_warp_uniform(tidx // _WARPGROUP_THREADS) - 1
    c, thr_mma_pv = self._consumer(tidx - _WARPGROUP_THREADS, wg, tiled_mma_qk, tiled_mma_pv, sQ,
                                   sK, sV, pipeline_k, pipeline_v, softmax_scale, scheduler)
    tScS_mn, online, acc_o = c.tScS_mn, c.online, c.acc_o
    num_rows = cute.size(tScS_mn, mode=[0])
    # Masked: the segment ids of this thread's query rows (per tile).
    row_ids = cute.make_rmem_tensor(num_rows, Int32) if const_expr(self.masked) else None
    c = dataclasses.replace(c, masking=masking, row_ids=row_ids)
    if const_expr(self.pingpong):
      # Warpgroup 0 takes the first turn: it arrives on its own barrier once.
      if wg == 0:
        cute.arch.barrier_arrive(barrier_id=_SCHEDULER_BARRIER_BASE,
                                 number_of_threads=2 * _WARPGROUP_THREADS)

    q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.q_stages)
    kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
    # The rows the tiles cover (_row_shift): what the mask and the block counts see.
    tiled_rows = seqlen_q + self._row_shift(seqlen_q)
    if const_expr(self.dynamic):
      tile = tiles.wait_and_read(pipeline_q, q_state)
    else:
      tile = scheduler.first_tile()
    while tile < scheduler.total_tiles:
      m_block, head, batch, n_min, n_max, slot = self._tile_and_key_blocks(
          scheduler, tile, masking, tiled_rows, seqlen_k)
      if const_expr(self.masked):
        # Blocks [full_lo, full_hi) of [n_min, n_max) need no elementwise mask.
        full_lo = masking.ranges[2, slot, batch]
        full_hi = masking.ranges[3, slot, batch]
        for i in cutlass.range_constexpr(num_rows):
          row_ids[i] = masking.query_ids[m_block * self.tile_m + tScS_mn[i, 0][0], batch]
      else:
        n_masked = mask.num_masked_blocks(m_block, n_max, tiled_rows, seqlen_k, self.tile_m,
                                          self.tile_n, self.causal)
      online.reset(masking.start_max if const_expr(self.masked) else None)
      self._start_tile(online, m_block, head, batch)
      acc_o.fill(0.0)
      if const_expr(not self.dynamic):
        pipeline_q.consumer_wait(q_state)
      tile_c = self._consumer_for_slot(c, q_state)
      if const_expr(self.mods is not None):
        tile_c = dataclasses.replace(tile_c, mod_batch=batch, mod_head=head)
      # Key blocks run from n_max-1 down, so the blocks needing the elementwise mask come first.
      if n_max > n_min:
        self.first_block(tile_c, kv_state, m_block, n_max - 1, tiled_rows, seqlen_k)
        # kv_state advances here, in the loop bodies: the DSL carries a state rebound in the
        # body, not one mutated inside a helper.
        if const_expr(self.masked):
          # Masked blocks down to full_hi, unmasked ones down to full_lo, masked ones down to
          # n_min (the first block, n_max - 1, is always masked).
          top = n_max - 1
          hi = cutlass.min(full_hi, top)
          lo = cutlass.min(full_lo, hi)
          for upper, lower, is_masked in ((top, hi, True), (hi, lo, False),
                                          (lo, n_min, True)):  # a trace-time loop
            runs = ((upper, upper - lower, False),)
            if const_expr(self.fixed_capped_max and not is_masked):
              # Unswitched on the call's fixed max: two loops, one with no step, so each
              # loop's body holds one softmax path.
              n_fixed = Int32(0)
              if masking.start_max != -Float32.inf:
                n_fixed = upper - lower
              runs = ((upper, n_fixed, True), (upper - n_fixed, upper - lower - n_fixed, False))
            for start, count, fixed in runs:  # a trace-time loop
              for i in cutlass.range(count, unroll=1):
                v_state = kv_state.clone()
                kv_state.advance()
                self.overlap_step(tile_c, kv_state, v_state, wg, m_block, start - 1 - i,
                                  tiled_rows, seqlen_k, is_masked, fixed)
        else:
          for i in cutlass.range(n_masked - 1, unroll=1):
            v_state = kv_state.clone()
            kv_state.advance()
            self.overlap_step(tile_c, kv_state, v_state, wg, m_block, n_max - 2 - i,
                              tiled_rows, seqlen_k, True)
          for i in cutlass.range(n_max - n_masked, unroll=1):
            v_state = kv_state.clone()
            kv_state.advance()
            self.overlap_step(tile_c, kv_state, v_state, wg, m_block, n_max - n_masked - 1 - i,
                              tiled_rows, seqlen_k, False)
        self.last_block(tile_c, kv_state)
        kv_state.advance()
      self.epilogue(mO, mLSE, mSink, has_sink, tma_atom_o, self._q_slot(sO, q_state),
                    tiled_mma_pv, thr_mma_pv, acc_o, online, pipeline_q, q_state, m_block, head,
                    batch, seqlen_q, mO_rows)
      q_state.advance()
      if const_expr(self.dynamic):
        tile = tiles.wait_and_read(pipeline_q, q_state)
      else:
        tile = scheduler.next_tile(tile)

  def _consumer(self, mma_tidx: Int32, wg: Int32, tiled_mma_qk: cute.TiledMma,
                tiled_mma_pv: cute.TiledMma, sQ: cute.Tensor, sK: cute.Tensor, sV: cute.Tensor,
                pipeline_k, pipeline_v, softmax_scale: Float32, scheduler):
    """(_Consumer, PV GEMM slice) of consumer thread mma_tidx of warpgroup wg (warp-uniform): the
    GEMMs' operand fragments (sm90_gemm.mma_slices), O's accumulator, the coordinates of S, the
    softmax state and P's registers; no mask operands (the caller adds its own)."""
    (thr_mma_qk, thr_mma_pv), (wg_mma_qk, wg_mma_pv) = sm90_gemm.mma_slices(
        (tiled_mma_qk, tiled_mma_pv), mma_tidx, wg)
    tSrQ = wg_mma_qk.make_fragment_A(wg_mma_qk.partition_A(sQ))
    tSrK = wg_mma_qk.make_fragment_B(wg_mma_qk.partition_B(sK))
    tOrV = wg_mma_pv.make_fragment_B(wg_mma_pv.partition_B(sV))
    acc_shape_s = thr_mma_qk.partition_shape_C((self.tile_m, self.tile_n))
    acc_o = thr_mma_pv.make_fragment_C(thr_mma_pv.partition_shape_C((self.tile_m,
                                                                      self.head_dim_v)))
    tScS_mn = softmax.make_acc_mn_view(
        thr_mma_qk.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n))))
    num_rows = cute.size(tScS_mn, mode=[0])
    online = self._online_softmax(softmax_scale, num_rows, scheduler)
    row_scale = cute.make_rmem_tensor(num_rows, Float32)
    # P of the previous key block: with intra-warpgroup overlap it lives across iterations.
    tOrP = self._p_fragment(thr_mma_pv, acc_shape_s)
    return _Consumer(tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrV, acc_shape_s, acc_o, tOrP,
                     tScS_mn, online, row_scale, pipeline_k, pipeline_v), thr_mma_pv

  @cute.jit
  def _scheduler_sync(self, wg: Int32):
    """Waits for this warpgroup's turn to issue GEMMs (ping-pong)."""
    if const_expr(self.pingpong):
      cute.arch.barrier(barrier_id=_SCHEDULER_BARRIER_BASE + wg,
                        number_of_threads=2 * _WARPGROUP_THREADS)

  @cute.jit
  def _scheduler_arrive(self, wg: Int32):
    """Hands the GEMM turn to the next consumer warpgroup (cyclic)."""
    if const_expr(self.pingpong):
      next_wg = wg + 1
      if next_wg == self.num_mma_warpgroups:
        next_wg = Int32(0)
      cute.arch.barrier_arrive(barrier_id=_SCHEDULER_BARRIER_BASE + next_wg,
                               number_of_threads=2 * _WARPGROUP_THREADS)

  @cute.jit
  def _softmax(self, c, acc_s: cute.Tensor, m_block: Int32, n_block: Int32, seqlen_q: Int32,
               seqlen_k: Int32, is_masked: cutlass.Constexpr, k_state,
               fixed_max: cutlass.Constexpr = False):
    """Mask (if needed) and online softmax of one S block; leaves P (fp32) in acc_s.
    k_state: the K stage of n_block (masked variants read the block's ids from it). fixed_max
    (blocks without the mask; the main loop's choice from the call's softcap): the rows keep
    the fixed capped max, and each score's tanh and exp2 follow each other (capped_softmax)."""
    acc_s_mn = softmax.make_acc_mn_view(acc_s)
    if const_expr(self.masked and not is_masked):
      m = c.masking
      if const_expr(fixed_max):
        c.online.capped_softmax(acc_s_mn, c.row_scale, m.tanh_scale,
                                m.start_max * c.online.scale_log2, self.dtype)
      else:
        # A warp-uniform branch: off, softcap costs a compare. The tanh first, then the
        # running max.
        if m.capped != 0:
          softmax.soft_cap(acc_s, m.tanh_scale)
        self._add_bias(c, acc_s_mn, k_state)
        # A block in the full range: mask_mod keeps all of it (block_mask.py), score_mod only.
        self._apply_mods(c, acc_s_mn, m_block, n_block, seqlen_q, seqlen_k, False)
        c.online.online_softmax(acc_s_mn, c.row_scale)
    elif const_expr(self.masked):
      # The tanh before the mask, which writes -inf. Under a fixed max P is rounded for its row
      # sums here too, as no key's p is exactly 1 (capped_softmax).
      m = c.masking
      if m.capped != 0:
        softmax.soft_cap(acc_s, m.tanh_scale)
      # The bias after the cap and before the mask (the mask's -inf stays -inf).
      self._add_bias(c, acc_s_mn, k_state)
      # score_mod and mask_mod after the bias; the band and ids' -inf after score_mod (a masked
      # score's value never matters, and mask_mod's -inf commutes with theirs).
      self._apply_mods(c, acc_s_mn, m_block, n_block, seqlen_q, seqlen_k, True)
      mask.apply_band_and_ids(acc_s_mn, c.tScS_mn, m_block, n_block, seqlen_q, seqlen_k,
                              self.tile_m, self.tile_n, m.window_left, m.window_right,
                              c.row_ids, m.key_ids_smem[None, k_state.index])
      if const_expr(self.fixed_capped_max):  # other tiles' state holds no round_gap
        if m.start_max != -Float32.inf:
          # The fixed max never moves: a threshold of +inf, a constant, so the max's move and
          # its rescale compile away here and the running max's path keeps its own constant.
          fixed = dataclasses.replace(c.online, threshold_log2=math.inf)
          fixed.online_softmax(acc_s_mn, c.row_scale, p_dtype=self.dtype)
        else:
          c.online.online_softmax(acc_s_mn, c.row_scale)
      else:
        c.online.online_softmax(acc_s_mn, c.row_scale)
    else:
      if const_expr(is_masked):
        mask.apply_mask(acc_s_mn, c.tScS_mn, m_block, n_block, seqlen_q, seqlen_k,
                        self.tile_m, self.tile_n, self.causal)
      c.online.online_softmax(acc_s_mn, c.row_scale)

  @cute.jit
  def _add_bias(self, c, acc_s_mn: cute.Tensor, k_state):
    """Bias variants: S += bias / scale over the block, from the bias tile of K stage k_state
    (kernels/bias.py add_bias_tile; keys past seqlen_k read zeros there, which the mask turns
    to -inf, and so do query rows past seqlen_q, which are never stored)."""
    if const_expr(self.bias):
      b = c.masking.bias
      # The consumer warp's first row: 16 rows per warp, warpgroup after warpgroup.
      warp = (cute.arch.make_warp_uniform(cute.arch.warp_idx())
              - _WARPGROUP_THREADS // _WARP_THREADS)
      score_bias.add_bias_tile(acc_s_mn, b.tiles, k_state.index, warp * 16, b.planes.query_step,
                               b.scale, self.dtype == cutlass.BFloat16)

  @cute.jit
  def _apply_mods(self, c, acc_s_mn: cute.Tensor, m_block: Int32, n_block: Int32,
                  seqlen_q: Int32, seqlen_k: Int32, with_mask: cutlass.Constexpr):
    """Mods variants: score_mod, and mask_mod with with_mask (blocks outside the full range),
    on every score of the block (the tile's batch and query head; kernels/mod_codegen.py)."""
    if const_expr(self.mods is not None):
      m = c.masking
      mod_codegen.apply_mods(self.mods, acc_s_mn, c.tScS_mn, m.mod_arrays,
                             m_block * self.tile_m, n_block * self.tile_n, seqlen_q, seqlen_k,
                             c.mod_batch, c.mod_head, m.mod_scale, m.mod_inv_scale,
                             with_mask=with_mask)

  @cute.jit
  def _release_k(self, c, kv_state, is_masked: cutlass.Constexpr,
                 after_softmax: cutlass.Constexpr):
    """Releases the K stage once its GEMM is done, or, where a masked variant's softmax still
    reads the stage's key ids, after the softmax (then the producer cannot overwrite them)."""
    # Bias variants read the stage's bias tile in the softmax of every block.
    if const_expr(after_softmax == ((self.masked and is_masked) or self.bias)):
      if const_expr(after_softmax):
        sm90_gemm.release_after_lane_loads(c.pipeline_k, kv_state)
      else:
        c.pipeline_k.consumer_release(kv_state)

  def _output_fragment(self, acc_o: cute.Tensor) -> cute.Tensor:
    """O (float32) in the registers the epilogue stores, as out_dtype."""
    r_o = cute.make_rmem_tensor(acc_o.layout.shape, self.out_dtype)
    r_o.store(acc_o.load().to(self.out_dtype))
    return r_o

  def _epilogue_thread_index(self) -> Int32:
    """The thread index the epilogue's shared-memory addresses derive from. Masked variants
    read it there (sm90_gemm.thread_index_here), so the addresses are not live across the main
    loop."""
    if const_expr(self.masked):
      return sm90_gemm.thread_index_here()
    tidx, _, _ = cute.arch.thread_idx()
    return tidx

  def _read_key_block_data(self, c, k_state):
    """Notes what the softmax needs of K stage k_state before the stage may be released
    (nothing here; the FP8 block variants note the stage whose chunk descales they read)."""

  # P's registers and the softmax state: the FP8 kernel (fwd_fp8_sm90) replaces these.
  def _p_fragment(self, thr_mma_pv, acc_shape_s):
    return softmax.make_p_fragment(acc_shape_s, self.dtype)

  def _convert_p(self, acc_s: cute.Tensor, p: cute.Tensor):
    softmax.convert_p(acc_s, p)

  def _online_softmax(self, softmax_scale: Float32, num_rows: int, scheduler):
    return softmax.OnlineSoftmax.create(softmax_scale * softmax.LOG2_E, num_rows,
                                        rounded_p=self.fixed_capped_max)

  def _start_tile(self, online, m_block: Int32, head: Int32, batch: Int32):
    """Per tile, after the softmax state's reset (the FP8 kernel sets the tile's scale)."""

  # The consumer GEMMs and O rescale, one place each (first_block, overlap_step and last_block
  # order them differently).
  def _new_acc_s(self, c):
    return c.tiled_mma_qk.get_slice(0).make_fragment_C(c.acc_shape_s)

  def _issue_qk(self, c, acc_s: cute.Tensor, k_state):
    """Issues S = Q K^T with K from slot k_state (the caller waits with wait_group)."""
    sm90_gemm.gemm(c.tiled_mma_qk, acc_s, c.tSrQ, c.tSrK[None, None, None, k_state.index],
                   zero_init=True)

  def _issue_pv(self, c, v_state):
    """Issues O += P V with P from registers and V from slot v_state."""
    sm90_gemm.gemm(c.tiled_mma_pv, c.acc_o, c.tOrP, c.tOrV[None, None, None, v_state.index],
                   zero_init=False)

  def _rescale_o(self, c):
    c.online.rescale(softmax.make_acc_mn_view(c.acc_o), c.row_scale)

  @cute.jit
  def first_block(self, c, kv_state, m_block: Int32, n_block: Int32, seqlen_q: Int32,
                  seqlen_k: Int32):
    """Overlap prologue: S and P of the first (always masked) key block; O is still 0."""
    acc_s = self._new_acc_s(c)
    pipeline_k = c.pipeline_k
    pipeline_k.consumer_wait(kv_state)
    self._issue_qk(c, acc_s, kv_state)
    warpgroup.wait_group(0)
    self._read_key_block_data(c, kv_state)
    self._release_k(c, kv_state, True, False)
    self._softmax(c, acc_s, m_block, n_block, seqlen_q, seqlen_k, True, kv_state)
    self._release_k(c, kv_state, True, True)
    self._convert_p(acc_s, c.tOrP)

  @cute.jit
  def overlap_step(self, c, kv_state, v_state, wg: Int32, m_block: Int32, n_block: Int32,
                   seqlen_q: Int32, seqlen_k: Int32, is_masked: cutlass.Constexpr,
                   fixed_max: cutlass.Constexpr = False):
    """S(n_block) = Q K^T (K slot kv_state) and O += P V of the previous block (V slot v_state)
    in flight together; the softmax of n_block runs while the PV GEMM is still going.
    fixed_max: a block without the mask under the fixed capped max (_softmax).

    SASS (ptxas 13, the shipped 16-bit tiles): ptxas places the WARPGROUP.DEPBAR of the
    wait_group(0) below after 50-55 of the block's exps (64 per thread) at the 128 x 128 tiles
    and at hdim 64's 192 x 128 without causal or mask, after all of them at 128 x 112 and
    128 x 80, and above all of them (after only the rows' scale exps) at hdim 128's 128 x 176
    and at hdim 64's 192 x 128 with causal or mask (the other warpgroups' GEMMs still hide that
    softmax: ping-pong); in the FP8 kernel, above all of them (keeping them above it measured no
    faster: docs/kernels.md, "Experiments that lost"). In the fixed_max loop (capped_softmax,
    no branch in the step) it sits above all but 0-9 of the 40-64 exps at every two-warpgroup
    masked tile. Predicating the wait made ptxas serialise every WGMMA; two P buffers (no wait
    here at all) spilled at 240 registers.
    """
    pipeline_k, pipeline_v = c.pipeline_k, c.pipeline_v
    acc_s = self._new_acc_s(c)
    pipeline_k.consumer_wait(kv_state)
    self._scheduler_sync(wg)
    self._issue_qk(c, acc_s, kv_state)
    if const_expr(self.rescale_o_before_pv):
      self._rescale_o(c)
    pipeline_v.consumer_wait(v_state)
    self._issue_pv(c, v_state)
    self._scheduler_arrive(wg)
    warpgroup.wait_group(1)
    self._read_key_block_data(c, kv_state)
    self._release_k(c, kv_state, is_masked, False)
    self._softmax(c, acc_s, m_block, n_block, seqlen_q, seqlen_k, is_masked, kv_state,
                  fixed_max)
    self._release_k(c, kv_state, is_masked, True)
    warpgroup.wait_group(0)
    pipeline_v.consumer_release(v_state)
    # P of the previous block is free only now (the PV GEMM read it from registers).
    self._convert_p(acc_s, c.tOrP)
    if const_expr(not self.rescale_o_before_pv):
      self._rescale_o(c)

  @cute.jit
  def last_block(self, c, kv_state):
    """Overlap epilogue: O += P V of the last key block."""
    if const_expr(self.rescale_o_before_pv):
      self._rescale_o(c)
    pipeline_v = c.pipeline_v
    pipeline_v.consumer_wait(kv_state)
    self._issue_pv(c, kv_state)
    warpgroup.wait_group(0)
    pipeline_v.consumer_release(kv_state)

  @cute.jit
  def epilogue(self, mO: cute.Tensor, mLSE: cute.Tensor, mSink: cute.Tensor, has_sink: Int32,
               tma_atom_o: cute.CopyAtom,
               sO: cute.Tensor, tiled_mma_pv: cute.TiledMma, thr_mma_pv, acc_o: cute.Tensor,
               online, pipeline_q, q_state, m_block: Int32, head: Int32, batch: Int32,
               seqlen_q: Int32, mO_rows=None):
    """Normalises O (the head's learnable sink joins each row's denominator), writes LSE (rows
    < seqlen_q), stores O (through shared memory + TMA, or from registers where the tile starts
    above row 0), then releases the Q slot (O used Q's buffer)."""
    mma_tidx = self._epilogue_thread_index() - _WARPGROUP_THREADS
    acc_o_mn = softmax.make_acc_mn_view(acc_o)
    num_rows = cute.size(acc_o_mn, mode=[0])
    row_inv = cute.make_rmem_tensor(num_rows, Float32)
    lse = cute.make_rmem_tensor(num_rows, Float32)
    sink_log2 = -Float32.inf
    if has_sink != 0:
      sink_log2 = mSink[head] * softmax.LOG2_E
    online.finalize(row_inv, lse, sink_log2)
    softmax.scale_rows(acc_o_mn, row_inv)

    tOcO_mn = softmax.make_acc_mn_view(
        thr_mma_pv.partition_C(cute.make_identity_tensor((self.tile_m, self.head_dim_v))))
    # One lane of each quad (the one holding column 0) writes its rows' LSE.
    shift = self._row_shift(seqlen_q)
    if tOcO_mn[0, 0][1] == 0:
      for i in cutlass.range_constexpr(num_rows):
        row = m_block * self.tile_m + tOcO_mn[i, 0][0] - shift
        if const_expr(self.tiles_from_last_row):
          if row < seqlen_q and row >= 0:
            mLSE[row, head, batch] = lse[i]
        elif row < seqlen_q:
          mLSE[row, head, batch] = lse[i]

    # sO aliases sQ: every warpgroup must be past its last QK^T GEMM before anyone writes O.
    cute.arch.barrier(barrier_id=_EPILOGUE_BARRIER, number_of_threads=self.num_mma_threads)
    if const_expr(self.release_q_at_epilogue):
      # O has a buffer of its own: past that barrier Q is free, so the producer can load the
      # next tile's while this one's O is stored.
      self._release_q(pipeline_q, q_state)
    r_o = self._output_fragment(acc_o)
    if const_expr(self.tiles_from_last_row):
      if m_block * self.tile_m < shift:
        self._store_o_rows(mO_rows, r_o, thr_mma_pv, pipeline_q, q_state, m_block, head, batch,
                           shift, seqlen_q)
      else:
        self._store_o_tma(mO, tma_atom_o, sO, r_o, tiled_mma_pv, mma_tidx, pipeline_q, q_state,
                          m_block, head, batch, shift)
    else:
      self._store_o_tma(mO, tma_atom_o, sO, r_o, tiled_mma_pv, mma_tidx, pipeline_q, q_state,
                        m_block, head, batch, shift)

  @cute.jit
  def _store_o_tma(self, mO: cute.Tensor, tma_atom_o: cute.CopyAtom, sO: cute.Tensor,
                   r_o: cute.Tensor, tiled_mma_pv: cute.TiledMma, mma_tidx: Int32, pipeline_q,
                   q_state, m_block: Int32, head: Int32, batch: Int32, shift: Int32):
    """O through shared memory (stmatrix into sO) and one TMA store, which clips rows >=
    seqlen_q; the storing warp then releases the Q slot. The tile's first row must be >= 0."""
    store_atom = sm90_utils.get_smem_store_op(LayoutEnum.ROW_MAJOR, self.out_dtype, Float32)
    tiled_copy_r2s = cute.make_tiled_copy_S(
        store_atom, cute.make_tiled_copy_C_atom(store_atom, tiled_mma_pv))
    thr_copy_r2s = tiled_copy_r2s.get_slice(mma_tidx)
    # retile() orders the values as the copy consumes them but nests the modes differently from
    # the smem partition; copy them by flat index into a fragment of the partition's shape.
    tRS_rO_retiled = tiled_copy_r2s.retile(r_o)
    tRS_rO = cute.make_rmem_tensor_like(thr_copy_r2s.partition_S(sO), self.out_dtype)
    for i in cutlass.range_constexpr(cute.size(tRS_rO)):
      tRS_rO[i] = tRS_rO_retiled[i]
    cute.copy(tiled_copy_r2s, tRS_rO, thr_copy_r2s.partition_D(sO))
    # Generic-proxy smem writes must be visible to the async proxy (TMA) before the store.
    cute.arch.fence_proxy("async.shared", space="cta")
    cute.arch.barrier(barrier_id=_EPILOGUE_BARRIER, number_of_threads=self.num_mma_threads)

    warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    if warp_idx == _WARPGROUP_THREADS // _WARP_THREADS:
      mO_head = mO[None, None, head, batch]
      if const_expr(self.tiles_from_last_row):
        mO_head = cute.domain_offset((-shift, 0), mO_head)
      gO = cute.local_tile(mO_head, (self.tile_m, self.head_dim_v), (m_block, 0))
      tOsO, tOgO = cpasync.tma_partition(
          tma_atom_o, 0, cute.make_layout(1), cute.group_modes(sO, 0, 2),
          cute.group_modes(gO, 0, 2))
      cute.copy(tma_atom_o, tOsO, tOgO)
      cute.arch.cp_async_bulk_commit_group()
      # sO must stay intact until the TMA engine has read it: only then may the producer load
      # the next tile's Q into it (sO aliasing sQ), the next tile's epilogue write it, or the CTA
      # exit. The elected lane issued the store; the warp sync orders its wait before lane 0's
      # release.
      cute.arch.cp_async_bulk_wait_group(0, read=True)
      cute.arch.sync_warp()
      if const_expr(not self.release_q_at_epilogue):
        pipeline_q.consumer_release(q_state)

  @cute.jit
  def _store_o_rows(self, mO_rows: cute.Tensor, r_o: cute.Tensor, thr_mma_pv, pipeline_q,
                    q_state, m_block: Int32, head: Int32, batch: Int32, shift: Int32,
                    seqlen_q: Int32):
    """O of a tile that starts above row 0 (tiles_from_last_row's first tile; a TMA store takes
    no negative coordinate, the GPU faults on one): each thread stores its own elements of the
    rows in [0, seqlen_q). sO is not used, so the Q slot is released at once (the epilogue
    barrier before this put every warpgroup past its last QK^T GEMM)."""
    tOcO = thr_mma_pv.partition_C(cute.make_identity_tensor((self.tile_m, self.head_dim_v)))
    for i in cutlass.range_constexpr(cute.size(r_o)):
      row = m_block * self.tile_m + tOcO[i][0] - shift
      if row >= 0 and row < seqlen_q:
        mO_rows[row, tOcO[i][1], head, batch] = r_o[i]
    if const_expr(not self.release_q_at_epilogue):
      self._release_q(pipeline_q, q_state)

  @cute.jit
  def _release_q(self, pipeline_q, q_state):
    """The first consumer warp releases the tile's Q slot."""
    warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    if warp_idx == _WARPGROUP_THREADS // _WARP_THREADS:
      cute.arch.sync_warp()
      pipeline_q.consumer_release(q_state)


@dataclasses.dataclass(frozen=True)
class _Consumer:
  """Per-thread fragments and pipelines of a consumer warpgroup (a trace-time bundle; frozen so
  that the DSL passes it through the run-time tile loop unchanged)."""

  tiled_mma_qk: cute.TiledMma
  tiled_mma_pv: cute.TiledMma
  tSrQ: cute.Tensor
  tSrK: cute.Tensor
  tOrV: cute.Tensor
  acc_shape_s: tuple
  acc_o: cute.Tensor
  tOrP: cute.Tensor
  tScS_mn: cute.Tensor
  online: softmax.OnlineSoftmax
  row_scale: cute.Tensor
  pipeline_k: pipeline.PipelineTmaAsync
  pipeline_v: pipeline.PipelineTmaAsync
  masking: "_Masking" = None  # masked variants only (also row_ids)
  row_ids: cute.Tensor = None  # segment ids of this thread's query rows in the current tile
  mod_batch: Int32 = None  # mods variants: the current tile's batch and query head
  mod_head: Int32 = None


@dataclasses.dataclass(frozen=True)
class _Masking(mask.MaskOperands):
  """The forward's mask operands (rows: query tiles; ranges: n_min, n_max, full_lo, full_hi)."""

  key_ids_smem: cute.Tensor  # (tile_n, num_stages): each K stage's key block ids
  # Soft-capped calls whose P range fits (softmax.capped_start_max): every row starts from
  # start_max and keeps it, and blocks without the mask take OnlineSoftmax.capped_softmax.
  # Otherwise the running max: start_max -inf.
  start_max: Float32
  bias: Optional["_BiasOperands"] = None  # bias variants only
  mod_arrays: tuple = ()  # mods variants: the closed-over arrays
  mod_scale: Optional[Float32] = None  # mods variants: the S registers' scale (softmax_scale)
  mod_inv_scale: Optional[Float32] = None  # mods variants: 1 / mod_scale


@dataclasses.dataclass(frozen=True)
class _BiasOperands:
  """A bias variant's bias (a trace-time bundle): the TMA coordinates of its (rows, seqlen_k,
  planes) view and the atom, where each (batch, head, query) is in it, each K stage's tile
  in shared memory (tile_m x tile_n per stage: the TMA destination, and the address and layout
  the consumers' ldmatrix reads) and the factor that brings the bias into the S registers'
  units (1 / softmax_scale, or 1 / softcap when capped: S * scale is the score)."""

  tma: cute.Tensor
  tma_atom: cute.CopyAtom
  planes: score_bias.BiasPlanes
  smem: cute.Tensor
  tiles: score_bias.SharedTiles
  scale: Float32


@dataclasses.dataclass(frozen=True)
class _TileHandOff:
  """Dynamic schedules: the counter the producer claims tiles from and, per Q slot, the tile
  whose Q the slot holds (a trace-time bundle)."""

  slots: cute.Tensor  # (q_stages,) int32 in shared memory
  counter: cute.Tensor  # (1,) int32 in global memory, zero at launch

  @cute.jit
  def publish(self, pipeline_q, q_state, tile: Int32, with_q: cutlass.Constexpr):
    """Producer warp: waits for Q slot q_state to be free, writes tile into it and arrives on
    the slot's full barrier, expecting Q's bytes (with_q: the caller's TMA load of Q follows)
    or not (the end of the tiles: the slot completes at once). The mbarrier arrive releases the
    write to the consumers that wait on the barrier."""
    pipeline_q.sync_object_empty.wait(q_state.index, q_state.phase)
    self.slots[q_state.index] = tile
    cute.arch.sync_warp()
    if const_expr(with_q):
      pipeline_q.sync_object_full.arrive(q_state.index, pipeline_q.producer_mask)
    else:
      with cute.arch.elect_one():
        cute.arch.mbarrier_arrive(pipeline_q.producer_get_barrier(q_state))

  @cute.jit
  def wait_and_read(self, pipeline_q, q_state) -> Int32:
    """Consumers: waits for Q slot q_state to be full and returns the tile it holds (its Q, or
    total_tiles at the end)."""
    pipeline_q.consumer_wait(q_state)
    return self.slots[q_state.index]
