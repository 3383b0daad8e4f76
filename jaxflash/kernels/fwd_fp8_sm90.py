"""Hopper (sm_90a) FP8 forward: e4m3 Q, K, V with descales per 64 tokens of each head; bf16 or
fp16 O (a run-time choice).

Imports cutlass, jaxflash.config and the sibling helper modules only (never jax).
"""

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass.cute.nvgpu import warpgroup

from jaxflash import config
from jaxflash.kernels import fp8_operands
from jaxflash.kernels import sm90_gemm
from jaxflash.kernels import softmax
from jaxflash.kernels import tile_scheduler
from jaxflash.kernels.fwd_sm90 import FlashAttentionForwardSm90

FP8 = cutlass.Float8E4M3FN
# Warps 1-3 of the producer warpgroup transpose V (warp 0 issues the TMA loads).
_TRANSPOSE_WARPS = 3
# (producer, consumer) registers per thread by consumer warpgroups. The transposing warps hold
# two addresses (fp8_operands.unit_constants) and four 32-bit registers per unit in flight, so
# the producers fit 24 registers with two consumer warpgroups, which then get 240 (head_dim
# 256's 128 x 128 and head_dim 128's 128 x 224 need them: at 224 they spill).
_REGISTER_SPLIT = {2: (24, 240), 3: (32, 160)}
# P = 2^(s - max + 8) <= 256 < 448 (e4m3's largest): small probabilities keep their bits.
_P_OFFSET_LOG2 = 8.0
# The row max moves only when a block's max exceeds it by more than this (log2 units): P then
# stays <= 2^8.8 < 448, and warps skip more O rescales than with 0 (1.00-1.05x, the RMSE within
# 0.3 %: docs/kernels.md, "FP8 forward").
_THRESHOLD_LOG2 = 0.8
# Descales come per chunk of this many query rows or keys (config.FP8_DESCALE_ROWS); the
# kv descale operand holds softmax.CHUNK_VALUES floats per key chunk.
_CHUNK = config.FP8_DESCALE_ROWS
_KV_VALUES = softmax.CHUNK_VALUES
# A row's max in four FMNMX chains (softmax.row_max): the FMA exp2 share at head_dim 64 was
# measured with them; the 16-bit kernels keep one (four measured the same there, and the masked
# head_dim 256 variant spills with them).
_MAX_CHAINS = 4
# The keys one e4m3 WGMMA of P V sums over (its K extent, 32 bytes).
_PV_K = 32


def transpose_units(variant: config.KernelVariant) -> int:
  """The V^T units (fp8_operands.UNIT_KEYS x UNIT_DIMS) of one V stage."""
  return (variant.schedule.tile_n // fp8_operands.UNIT_KEYS
          * (variant.head_dim_v // fp8_operands.UNIT_DIMS))


def _smem_layout(variant: config.KernelVariant) -> tuple[int, bool]:
  """(shared memory of one CTA, whether O's bf16 tile takes the V ring's bytes).

  Q, the K, V and V^T rings (e4m3), O, the key chunks' descales, mbarriers, each aligned. O
  takes the V ring's bytes only where a buffer of its own would not fit shared memory (head_dim
  256 on 128 x 128 tiles). One CTA per tile, and the ring is done once the last V stage was
  transposed, before either warpgroup's last P V GEMM.
  """
  aligned = sm90_gemm.smem_aligned
  s, d, dv = variant.schedule, variant.head_dim, variant.head_dim_v
  rest = (aligned(s.tile_m * d) + aligned(s.num_stages * s.tile_n * d)
          + 2 * aligned(s.num_stages * s.tile_n * dv)
          + (aligned(s.num_stages * s.tile_n // _CHUNK * _KV_VALUES * 4)
             if variant.block_descales else 0)
          + sm90_gemm.SMEM_ALIGN)
  o_bytes = aligned(s.tile_m * dv * 2)
  over_ring = (rest + o_bytes > sm90_gemm.SMEM_CAPACITY
               and o_bytes <= s.num_stages * s.tile_n * dv)
  return rest + (0 if over_ring else o_bytes), over_ring


def o_over_v_ring(variant: config.KernelVariant) -> bool:
  """Whether O's bf16 tile takes the V ring's bytes (_smem_layout)."""
  return _smem_layout(variant)[1]


class FlashAttentionForwardFp8Sm90(FlashAttentionForwardSm90):
  """The forward of fwd_sm90 with e4m3 operands for both GEMMs.

  - Descales per chunk of 64 tokens: q_descale (batch, num_heads, chunks of the query tiles)
    and, per key chunk, (k descale, log2 ratio, 1 / ratio, v max) with ratio = v descale / v
    max of the (batch, kv head) (jaxflash/fp8_kernel.py builds both from per-head or block
    descales). A warpgroup's 64 rows are one query chunk. Per-head variants read the first key
    chunk's k descale once per tile; block variants (variant.block_descales) have the producer
    copy each key block's chunk values into the K stage with the K tile.
  - S = Q K^T in e4m3 (both K-major, as TMA loads them), scaled in the softmax by
    softmax_scale * q_descale * k_descale (per chunk in block variants:
    softmax.ChunkScaledSoftmax).
  - P: exp2 against the row max (which moves only when a block's exceeds it by more than 0.8 in
    log2 units) times 2^8 (times the chunk's value ratio in block variants), then packed to
    e4m3 in registers in the key order of fp8_operands; row sums and lse carry and then drop
    the 2^8.
  - V: TMA brings each key block with head_dim_v contiguous; warps 1-3 of the producer
    warpgroup write V^T (keys contiguous, the same key order) into a second ring that the
    consumers' P V GEMM reads. V ring: TMA -> transposers; V^T ring: transposers -> consumers.
  - O = P V * v max / row sum, stored as bf16 or fp16 (out_float16, run time) through a shared
    buffer: its own, or the V ring's bytes where that would not fit (o_over_v_ring).
  Dense, causal or not, GQA/MQA. Not causal with per-head descales and O in a buffer of its own
  (head_dim 64 and 128): a persistent tile list, the softmax's scale set per tile and Q released
  to the next tile's load once every warpgroup is past its last Q K^T; otherwise one CTA per
  tile.
  """

  def __init__(self, variant: config.KernelVariant):
    super().__init__(variant)
    self.dtype = FP8
    self.out_dtype = cutlass.BFloat16
    self.num_producer_regs, self.num_mma_regs = _REGISTER_SPLIT[self.num_mma_warpgroups]
    self.transpose_units = transpose_units(variant)
    self.o_in_v_ring = o_over_v_ring(variant)
    self.tiles_from_last_row = False  # query descale chunks start at row 0
    # O has a buffer of its own (or the V ring's bytes): a persistent list releases Q at the
    # epilogue barrier, so the next tile's Q loads while this one's O is stored.
    self.release_q_at_epilogue = self.persistent
    assert self.q_stages == 1, variant.key  # O has a buffer of its own (or the V ring's)
    self.fma_exp2_per_8 = variant.schedule.fma_exp2_per_8
    self.block_descales = variant.block_descales

  @staticmethod
  def smem_bytes(variant: config.KernelVariant) -> int:
    """Q, the K, V and V^T rings (e4m3), O (bf16; over the V ring where o_over_v_ring), the key
    chunks' descales, mbarriers, alignment."""
    return _smem_layout(variant)[0]

  @staticmethod
  def can_implement(variant: config.KernelVariant) -> tuple[bool, str]:
    if variant.direction != "fwd" or variant.dtype != config.FP8_DTYPE:
      return False, f"variant {variant.key} is not an FP8 forward variant"
    if variant.masked:
      return False, f"variant {variant.key}: FP8 runs dense tiles"
    if variant.schedule.persistent and (variant.block_descales or o_over_v_ring(variant)):
      return False, (f"variant {variant.key}: a persistent FP8 variant needs per-head descales "
                     "and an O buffer of its own (O over the V ring: one tile per CTA)")
    s = variant.schedule
    # A warpgroup's 64 rows are one query chunk; block variants read whole key chunks; the
    # P V GEMM steps over keys _PV_K at a time.
    if (s.tile_m % _CHUNK or s.tile_n % (_CHUNK if variant.block_descales else _PV_K)
        or variant.head_dim_v % fp8_operands.UNIT_DIMS):
      return False, (f"variant {variant.key}: tile_m % {_CHUNK}, tile_n % {_PV_K} (% {_CHUNK} "
                     f"with block descales) and head_dim_v % {fp8_operands.UNIT_DIMS} must be 0")
    return True, ""

  def _setup_attributes(self):
    k_major = warpgroup.OperandMajorMode.K
    atoms = (self.num_mma_warpgroups, 1, 1)
    self.tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
        FP8, FP8, k_major, k_major, Float32, atoms, (64, self.tile_n))
    self.tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
        FP8, FP8, k_major, k_major, Float32, atoms, (64, self.head_dim_v),
        a_source=warpgroup.OperandSource.RMEM)
    self.sQ_layout = sm90_gemm.smem_layout(FP8, self.tile_m, self.head_dim)
    self.sK_layout = sm90_gemm.smem_layout(FP8, self.tile_n, self.head_dim, self.num_stages)
    # The TMA tile of V: (head_dim_v, tile_n), head_dim_v contiguous; V^T: keys contiguous.
    self.sV_layout = sm90_gemm.smem_layout(FP8, self.head_dim_v, self.tile_n, self.num_stages,
                                           col_major=True)
    self.sVt_layout = sm90_gemm.smem_layout(FP8, self.head_dim_v, self.tile_n, self.num_stages)
    self.sO_layout = sm90_gemm.smem_layout(self.out_dtype, self.tile_m, self.head_dim_v)
    self.tma_bytes_q = cute.size_in_bytes(FP8, self.sQ_layout)
    self.tma_bytes_k = cute.size_in_bytes(FP8, cute.slice_(self.sK_layout, (None, None, 0)))
    self.tma_bytes_v = cute.size_in_bytes(FP8, cute.slice_(self.sV_layout, (None, None, 0)))
    # Block variants: each K stage also carries its key block's chunk descales (one bulk copy).
    self.kv_descale_floats = self.tile_n // _CHUNK * _KV_VALUES
    if self.block_descales:
      self.tma_bytes_k += self.kv_descale_floats * 4
    stages, align = self.num_stages, sm90_gemm.SMEM_ALIGN
    buffers = {name: (FP8, cute.cosize(layout), align)
               for name, layout in (("sQ", self.sQ_layout), ("sK", self.sK_layout),
                                    ("sV", self.sV_layout), ("sVt", self.sVt_layout))}
    if not self.o_in_v_ring:
      buffers["sO"] = (self.out_dtype, cute.cosize(self.sO_layout), align)
    if self.block_descales:
      buffers["sKVDescale"] = (Float32, self.kv_descale_floats * stages, 16)
    self.shared_storage = sm90_gemm.shared_storage(
        dict(mbar_q=1, mbar_k=stages, mbar_v=stages, mbar_vt=stages), buffers)

  @cute.jit
  def __call__(
      self,
      mQ: cute.Tensor,  # (batch, seqlen_q, num_heads, head_dim) e4m3
      mK: cute.Tensor,  # (batch, seqlen_k, num_kv_heads, head_dim) e4m3
      mV: cute.Tensor,  # (batch, seqlen_k, num_kv_heads, head_dim_v) e4m3
      mO: cute.Tensor,  # (batch, seqlen_q, num_heads, head_dim_v) bf16
      mLSE: cute.Tensor,  # (batch, num_heads, seqlen_q) float32
      mSink: cute.Tensor,  # (num_heads,) float32, read when has_sink
      mQDescale: cute.Tensor,  # (batch, num_heads, q chunks) float32: per 64 query rows
      mKVDescale: cute.Tensor,  # (batch, num_kv_heads, 4 * key chunks) float32: per 64 keys
      softmax_scale: Float32,
      has_sink: Int32,
      out_float16: Int32,  # 1: O's bits are float16 (mO's bfloat16 type only carries them)
      stream: cuda.CUstream,
  ):
    if const_expr(not (mQ.element_type == mK.element_type == mV.element_type == FP8
                       and mO.element_type == self.out_dtype)):
      raise TypeError(f"q, k, v must be {FP8} and out {self.out_dtype}")
    if const_expr(not (mLSE.element_type == mSink.element_type == mQDescale.element_type
                       == mKVDescale.element_type == Float32)):
      raise TypeError("lse, sink and descales must be Float32")
    self._setup_attributes()
    (tma_q, tma_k, tma_v, tma_o), (tma_atom_q, tma_atom_k, tma_atom_v, tma_atom_o), mLSE, grid = (
        self._tma_operands(mQ, mK, mV, mO, mLSE))
    # (q chunks, num_heads, batch) and (4 * key chunks, num_kv_heads, batch)
    mQDescale, mKVDescale = [sm90_gemm.select_modes(t, [2, 1, 0]) for t in (mQDescale, mKVDescale)]
    self.kernel(
        tma_q, tma_k, tma_v, tma_o, mLSE, mSink, mQDescale, mKVDescale,
        tma_atom_q, tma_atom_k, tma_atom_v, tma_atom_o, softmax_scale, has_sink, out_float16,
        self.sQ_layout, self.sK_layout, self.sV_layout, self.sVt_layout, self.sO_layout,
        self.tiled_mma_qk, self.tiled_mma_pv,
    ).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream, min_blocks_per_mp=1)

  @cute.kernel
  def kernel(
      self,
      mQ: cute.Tensor,
      mK: cute.Tensor,
      mV: cute.Tensor,
      mO: cute.Tensor,
      mLSE: cute.Tensor,
      mSink: cute.Tensor,
      mQDescale: cute.Tensor,  # (q chunks, num_heads, batch)
      mKVDescale: cute.Tensor,  # (4 * key chunks, num_kv_heads, batch)
      tma_atom_q: cute.CopyAtom,
      tma_atom_k: cute.CopyAtom,
      tma_atom_v: cute.CopyAtom,
      tma_atom_o: cute.CopyAtom,
      softmax_scale: Float32,
      has_sink: Int32,
      out_float16: Int32,
      sQ_layout: cute.ComposedLayout,
      sK_layout: cute.ComposedLayout,
      sV_layout: cute.ComposedLayout,
      sVt_layout: cute.ComposedLayout,
      sO_layout: cute.ComposedLayout,
      tiled_mma_qk: cute.TiledMma,
      tiled_mma_pv: cute.TiledMma,
  ):
    tidx, _, _ = cute.arch.thread_idx()
    warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    sm90_gemm.prefetch_descriptors(warp_idx, (tma_atom_q, tma_atom_k, tma_atom_v, tma_atom_o))
    storage = cutlass.utils.SmemAllocator().allocate(self.shared_storage)
    pipeline_q, pipeline_k, pipeline_v = self._make_pipelines(storage, _TRANSPOSE_WARPS)
    pipeline_vt = pipeline.PipelineAsync.create(
        barrier_storage=storage.mbar_vt.data_ptr(), num_stages=self.num_stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                 _TRANSPOSE_WARPS * sm90_gemm.WARP_THREADS),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_mma_threads),
        defer_sync=True)
    sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
    sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
    sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
    sVt = storage.sVt.get_tensor(sVt_layout.outer, swizzle=sVt_layout.inner)
    if const_expr(self.o_in_v_ring):
      sO = cute.make_tensor(cute.recast_ptr(storage.sV.data_ptr(), sO_layout.inner,
                                            dtype=self.out_dtype), sO_layout.outer)
    else:
      sO = storage.sO.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
    sKVDescale = None
    if const_expr(self.block_descales):
      sKVDescale = storage.sKVDescale.get_tensor(
          cute.make_layout((self.kv_descale_floats, self.num_stages)))
    cute.arch.mbarrier_init_fence()
    cute.arch.sync_threads()

    make_scheduler = lambda: tile_scheduler.StaticTileScheduler(
        cute.ceil_div(mQ.shape[0], self.tile_m), mQ.shape[2], mQ.shape[3], mK.shape[0],
        kv_bytes_per_key=self.head_dim + self.head_dim_v, lpt=self.lpt,
        persistent=self.persistent)
    # Block variants: each role builds the tile scheduler after its register reallocation;
    # built before it, the scheduler's extents stayed live across the split and spilled in the
    # producer warpgroup (56 registers) at head_dim 128.
    shared_scheduler = None
    if const_expr(not self.block_descales):
      shared_scheduler = make_scheduler()
    self.q_descale, self.kv_descale, self.kv_descale_smem = mQDescale, mKVDescale, sKVDescale
    self.softmax_scale = softmax_scale
    self.out_float16 = out_float16
    self.q_per_kv = mQ.shape[2] // mK.shape[2]
    warpgroup_idx = cute.arch.make_warp_uniform(tidx // sm90_gemm.WARPGROUP_THREADS)
    if warpgroup_idx == 0:
      cute.arch.setmaxregister_decrease(self.num_producer_regs)
      scheduler = self._role_scheduler(shared_scheduler, make_scheduler)
      if warp_idx == 0:
        self.load(mQ, mK, mV, tma_atom_q, tma_atom_k, tma_atom_v, sQ, sK, sV,
                  pipeline_q, pipeline_k, pipeline_v, scheduler, None)
      else:
        self.transpose_v(storage.sV.data_ptr(), sV_layout, storage.sVt.data_ptr(), sVt_layout,
                         pipeline_v, pipeline_vt, scheduler, mQ.shape[0], mK.shape[0],
                         warp_idx - 1)
    else:
      cute.arch.setmaxregister_increase(self.num_mma_regs)
      scheduler = self._role_scheduler(shared_scheduler, make_scheduler)
      self.mma(mO, mLSE, mSink, has_sink, tma_atom_o, sQ, sK, sVt, sO, tiled_mma_qk,
               tiled_mma_pv, pipeline_q, pipeline_k, pipeline_vt, softmax_scale, scheduler,
               mQ.shape[0], mK.shape[0], None)

  def _role_scheduler(self, shared_scheduler, make_scheduler):
    """The scheduler a role uses: the one built before the split, or (block variants) its own."""
    return make_scheduler() if self.block_descales else shared_scheduler

  @cute.jit
  def transpose_v(self, v_ptr: cute.Pointer, sV_layout: cute.ComposedLayout,
                  vt_ptr: cute.Pointer, sVt_layout: cute.ComposedLayout, pipeline_v,
                  pipeline_vt, scheduler, seqlen_q: Int32, seqlen_k: Int32, warp: Int32):
    """Warps 1-3: each V stage the TMA filled becomes a V^T stage (fp8_operands), in the order
    the loader fills them (the key blocks of each tile, last first)."""
    units_n = self.tile_n // fp8_operands.UNIT_KEYS
    units = self.transpose_units
    # Warp w takes units w, w + 3, ..., each warp its own compile-time list: a unit's addresses
    # are the lane's addresses of unit (0, 0) in the stage, XOR a constant, plus a constant that
    # the ldmatrix / stmatrix take as their immediate offset (fp8_operands.unit_constants).
    src0, dst0 = fp8_operands.unit_offsets(sV_layout, sVt_layout, 0, 0, cute.arch.lane_idx())
    v_stage_bytes = cute.cosize(sV_layout) // self.num_stages
    vt_stage_bytes = cute.cosize(sVt_layout) // self.num_stages
    v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
    vt_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
    tile = scheduler.first_tile()
    while tile < scheduler.total_tiles:
      _, _, _, n_min, n_max, _ = self._tile_and_key_blocks(scheduler, tile, None, seqlen_q,
                                                        seqlen_k)
      for _ in cutlass.range(n_max - n_min, unroll=1):
        pipeline_v.consumer_wait(v_state)
        pipeline_vt.producer_acquire(vt_state)
        src = Int32(v_ptr.toint() + v_state.index * v_stage_bytes) + src0
        dst = Int32(vt_ptr.toint() + vt_state.index * vt_stage_bytes) + dst0
        for w in cutlass.range_constexpr(_TRANSPOSE_WARPS):
          if warp == w:
            # The warp's units in the order of their flips, so that each flipped address is live
            # for consecutive units only (in unit order ptxas kept the few distinct ones all
            # live and the 24-register producers spilled at head_dim 256).
            consts = sorted(
                (fp8_operands.unit_constants(sV_layout, sVt_layout,
                                             *fp8_operands.unit_origin(u, units_n))
                 for u in range(w, units, _TRANSPOSE_WARPS)),
                key=lambda c: (c[1][0], c[0][0]))
            for (flip_v, add_v), (flip_vt, add_vt) in consts:
              fp8_operands.transpose_v_unit(src ^ flip_v, add_v, dst ^ flip_vt, add_vt)
        # stmatrix writes are generic-proxy; the consumers' WGMMA reads through the async one.
        cute.arch.fence_proxy("async.shared", space="cta")
        pipeline_vt.producer_commit(vt_state)
        sm90_gemm.release_after_lane_loads(pipeline_v, v_state)
        v_state.advance()
        vt_state.advance()
      tile = scheduler.next_tile(tile)

  def _p_fragment(self, thr_mma_pv, acc_shape_s):
    return cute.make_rmem_tensor(thr_mma_pv.partition_shape_A((self.tile_m, self.tile_n)), FP8)

  def _convert_p(self, acc_s: cute.Tensor, p: cute.Tensor):
    fp8_operands.convert_p(acc_s, p)

  def _online_softmax(self, softmax_scale: Float32, num_rows: int, scheduler):
    """The softmax state. One tile per CTA: its scale from that tile (_tile_scale_log2);
    persistent: set per tile (_start_tile)."""
    if const_expr(self.persistent):
      scale_log2 = softmax_scale * softmax.LOG2_E  # replaced by each tile's
    else:
      tile = scheduler.decode(scheduler.first_tile())
      scale_log2 = self._tile_scale_log2(softmax_scale, *tile)
    if const_expr(not self.block_descales):
      return softmax.OnlineSoftmax.create(
          scale_log2, num_rows, threshold_log2=_THRESHOLD_LOG2, p_offset_log2=_P_OFFSET_LOG2,
          fma_exp2_per_8=self.fma_exp2_per_8, max_chains=_MAX_CHAINS,
          per_tile_scale=self.persistent)
    return softmax.ChunkScaledSoftmax.create_chunked(  # one tile per CTA (can_implement)
        scale_log2, num_rows, self.kv_descale_smem, threshold_log2=_THRESHOLD_LOG2,
        p_offset_log2=_P_OFFSET_LOG2, fma_exp2_per_8=self.fma_exp2_per_8,
        max_chains=_MAX_CHAINS)

  def _tile_scale_log2(self, softmax_scale: Float32, m_block: Int32, head: Int32,
                       batch: Int32) -> Float32:
    """A tile's softmax scale in log2 units: softmax_scale times the query descale of the
    warpgroup's 64 rows (one chunk), times the k descale (per-head variants; block variants
    apply the key chunks' per key block)."""
    tidx, _, _ = cute.arch.thread_idx()
    wg = cute.arch.make_warp_uniform(tidx // sm90_gemm.WARPGROUP_THREADS) - 1
    q_descale = self.q_descale[m_block * (self.tile_m // _CHUNK) + wg, head, batch]
    if const_expr(not self.block_descales):
      k_descale = self.kv_descale[0, head // self.q_per_kv, batch]
      return softmax_scale * q_descale * k_descale * softmax.LOG2_E
    return softmax_scale * q_descale * softmax.LOG2_E

  def _start_tile(self, online, m_block: Int32, head: Int32, batch: Int32):
    if const_expr(self.persistent):
      online.set_scale(self._tile_scale_log2(self.softmax_scale, m_block, head, batch))

  @cute.jit
  def _load_key_block_data(self, masking, pipeline_k, kv_state, n_block: Int32, head_kv: Int32,
                           batch: Int32):
    """The chunk descales of key block n_block into its K stage: one bulk copy on the K
    stage's barrier (tma_bytes_k includes them). Block variants only."""
    if const_expr(self.block_descales):
      # 32-bit offsets (the operand is far below 2^31 floats): fewer registers for the
      # producer warpgroup's 56.
      stride = self.kv_descale.layout.stride
      offset = (Int32(stride[1]) * head_kv + Int32(stride[2]) * batch
                + n_block * self.kv_descale_floats)
      with cute.arch.elect_one():
        sm90_gemm.bulk_copy_g2s(self.kv_descale_smem[None, kv_state.index].iterator,
                                self.kv_descale.iterator + offset, self.kv_descale_floats * 4,
                                pipeline_k.producer_get_barrier(kv_state))

  def _read_key_block_data(self, c, k_state):
    if const_expr(self.block_descales):
      c.online.set_stage(k_state.index)

  @cute.jit
  def _output_fragment(self, acc_o: cute.Tensor) -> cute.Tensor:
    """O as bfloat16, or as float16 bits in the same registers (out_float16): shared memory and
    the TMA store move 16-bit words whatever they hold."""
    r_o = cute.make_rmem_tensor(acc_o.layout.shape, self.out_dtype)
    if self.out_float16 != 0:
      cute.recast_tensor(r_o, cutlass.Float16).store(acc_o.load().to(cutlass.Float16))
    else:
      r_o.store(acc_o.load().to(self.out_dtype))
    return r_o

  def _epilogue_thread_index(self) -> Int32:
    # Block variants: at head_dim 128 the epilogue addresses, computed at the start and kept
    # live, spilled one register (224 per thread).
    if const_expr(self.block_descales):
      return sm90_gemm.thread_index_here()
    return super()._epilogue_thread_index()

  @cute.jit
  def _release_k(self, c, kv_state, is_masked: cutlass.Constexpr,
                 after_softmax: cutlass.Constexpr):
    """Block variants: after the softmax, which reads the stage's chunk descales."""
    if const_expr(after_softmax == self.block_descales):
      if const_expr(after_softmax):
        sm90_gemm.release_after_lane_loads(c.pipeline_k, kv_state)
      else:
        c.pipeline_k.consumer_release(kv_state)

  def epilogue(self, mO: cute.Tensor, mLSE: cute.Tensor, mSink: cute.Tensor, has_sink: Int32,
               tma_atom_o: cute.CopyAtom, sO: cute.Tensor, tiled_mma_pv: cute.TiledMma,
               thr_mma_pv, acc_o: cute.Tensor, online, pipeline_q, q_state, m_block: Int32,
               head: Int32, batch: Int32, seqlen_q: Int32, mO_rows=None):
    """O *= the (batch, kv head)'s v max descale, then fwd_sm90's epilogue (normalise, lse,
    16-bit store: _output_fragment)."""
    v_descale = self.kv_descale[_KV_VALUES - 1, head // self.q_per_kv, batch]
    for i in range(cute.size(acc_o)):
      acc_o[i] = acc_o[i] * v_descale
    super().epilogue(mO, mLSE, mSink, has_sink, tma_atom_o, sO, tiled_mma_pv, thr_mma_pv,
                     acc_o, online, pipeline_q, q_state, m_block, head, batch, seqlen_q, mO_rows)
