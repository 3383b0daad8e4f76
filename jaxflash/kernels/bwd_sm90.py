"""Hopper (sm_90a) FlashAttention backward main kernel: dK, dV per key block, dQ by fp32 reduction.

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

from jaxflash import config
from jaxflash.kernels import bias as score_bias
from jaxflash.kernels import mod_codegen
from jaxflash.kernels import bwd_common
from jaxflash.kernels import mask
from jaxflash.kernels import sm90_gemm
from jaxflash.kernels import softmax

_select = sm90_gemm.select_modes
DTYPES = sm90_gemm.DTYPES

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)
_WG = sm90_gemm.WARPGROUP_THREADS
_NUM_WG = bwd_common.NUM_MMA_WARPGROUPS
# Named barriers (0 is __syncthreads). The dS tile is shared by both consumer warpgroups: it must
# be complete before the dQ GEMM and free again before it is overwritten.
_DS_FULL_BARRIER = 1
_DS_EMPTY_BARRIER = 2
_EPILOGUE_BARRIER = 3
# + warpgroup: the warpgroup's half of the dQ staging buffer is full / free again. Each is shared
# by that consumer warpgroup and the dQ writer warp (128 + 32 threads).
_DQ_FULL_BARRIER = 4
_DQ_EMPTY_BARRIER = 4 + _NUM_WG
_DQ_BARRIER_THREADS = _WG + sm90_gemm.WARP_THREADS
# Deterministic: the dQ writer warp hands each step's semaphore release to the release warp
# (full: this step's dQ writes have landed; empty: the previous release is issued), 2 warps.
_DQ_RELEASE_FULL_BARRIER = 4 + 2 * _NUM_WG
_DQ_RELEASE_EMPTY_BARRIER = _DQ_RELEASE_FULL_BARRIER + 1
_DQ_RELEASE_BARRIER_THREADS = 2 * sm90_gemm.WARP_THREADS
_DQ_WRITER_WARP, _DQ_RELEASE_WARP = 1, 2
# Bias variants (never deterministic): the warp that writes dbias's zeros where a key block
# skips query blocks.
_DBIAS_ZERO_WARP = 2
# Producer warpgroup keeps 24 registers (TMA only); the two consumers get 240 (FA-3's split).
_PRODUCER_REGS, _MMA_REGS = 24, 240
# Deterministic without a mask: key block n walks the query blocks starting at (M - n) mod M
# (M query blocks), so the key blocks of a head start on different query blocks instead of
# queueing on block 0 (one dQ write and semaphore hop each: the ascending order lost 13 % at
# seq 1k / 4k, hdim 128). The order at a query block is then the arrival order (_dq_rank), in
# which key block 0 waits for blocks launched after it: every key block of a head must be
# resident at once, so this runs only up to this many key blocks (every sm_90 part has more SMs,
# and a backward CTA holds a whole SM's shared memory) and with no more key blocks than query
# blocks; above, the ascending order stays.
_DET_ROTATE_MAX_KEY_BLOCKS = 64


@dataclasses.dataclass(frozen=True)
class _Masking(mask.MaskOperands):
  """The backward's mask operands (rows: key tiles; ranges: m_min, m_max, full_lo, full_hi)."""

  ranks: cute.Tensor  # deterministic: (m blocks, n blocks, batch), else None
  query_ids_smem: cute.Tensor  # swap_sdp: (tile_m, num_stages) per Q/dO stage, else None
  p_scale_log2: Float32  # P = exp2(S' * p_scale_log2 - lse2): (softcap or softmax_scale) log2 e
  inv_cap_log2: Float32  # 1 / (softcap * log2 e): t = (log2 P + lse2) * inv_cap_log2
  # Bias variants: the bias (P = exp2(S' * p_scale_log2 + bias * log2 e - lse2)) and dbias.
  bias: Optional["_BiasOperands"] = None
  # Mods variants: the closed-over arrays and the S registers' scale and its inverse.
  mod_arrays: tuple = ()
  mod_scale: Optional[Float32] = None
  mod_inv_scale: Optional[Float32] = None


@dataclasses.dataclass(frozen=True)
class _BiasOperands:
  """A bias variant's bias and dbias (a trace-time bundle). tma / tma_atom: the TMA coordinates
  of the (rows, seqlen_k, planes) view (kernels/bias.py) and its load atom; planes: where each
  (batch, head, query) is in it; tiles: the dS ring (tile_m x tile_n per Q/dO stage), into
  which the producer loads each step's bias tile (smem: the same as a tensor, the TMA
  destination); dbias: (seqlen_q, seqlen_k, heads, batch) in the input dtype, d loss / d score
  per (batch, head, query, key); dbias_tma / dbias_atom: its TMA coordinates and store atom."""

  tma: cute.Tensor
  tma_atom: cute.CopyAtom
  planes: score_bias.BiasPlanes
  tiles: score_bias.SharedTiles
  smem: cute.Tensor
  dbias: cute.Tensor
  dbias_tma: cute.Tensor
  dbias_atom: cute.CopyAtom


def _smem_buffers(variant: config.KernelVariant) -> dict:
  """The backward's shared buffers after its mbarriers, in storage order: {name: (element type,
  count, alignment)}. swap_sdp: no P buffer (P stays in registers), one dS buffer per Q stage
  (bias variants: the producer loads the stage's bias tile into it, which the step's dS then
  overwrites), and per Q/dO stage the block's lse2 and delta rows (read by the columns of S^T /
  dP^T) and, masked, its query segment ids."""
  dtype, s = DTYPES[variant.dtype], variant.schedule
  m, n, stages = s.tile_m, s.tile_n, s.num_stages
  d, dv, align = variant.head_dim, variant.head_dim_v, sm90_gemm.SMEM_ALIGN
  buffers = dict(sK=(dtype, n * d, align), sV=(dtype, n * dv, align),
                 sQ=(dtype, stages * m * d, align), sdO=(dtype, s.do_stages * m * dv, align))
  if not s.swap_sdp:
    buffers["sP"] = (dtype, m * n, align)
  buffers["sdS"] = (dtype, (stages if s.swap_sdp else 1) * m * n, align)
  buffers["sdQ"] = (Float32, m * d // s.dq_pieces, align)
  if s.swap_sdp:
    buffers["sLSE2"] = (Float32, m * stages, 128)
    buffers["sDelta"] = (Float32, m * stages, 128)
    if variant.masked:
      buffers["sQIds"] = (Int32, m * stages, 128)
  return buffers


class FlashAttentionBackwardSm90:
  """FA-3 style backward main kernel; one CTA per (key block, kv head, batch).

  Warpgroup 0 produces: warp 0 loads K and V once, then Q and dO blocks (TMA) for every query
  head of the kv head's group and every query block that sees the key block; warp 1 (the dQ
  writer) adds the staged dQ blocks into the fp32 accumulator (bulk reductions), so neither the
  reduction nor the deterministic-mode semaphore wait sits on the consumers' path.
  Per query block: S = Q K^T and dP = dO V^T (WGMMA), P = exp2(S * scale * log2 e - lse *
  log2 e), dS = P (dP - delta); dV += P^T dO, dK += dS^T Q (registers, whole loop); dQ = dS K
  is staged in shared memory and added into the fp32 accumulator (bwd_common describes its
  layout). Two warpgroup mappings, from the schedule (config.BwdSchedule):
  swap_sdp (head_dim <= 128, FA-4's "SdP swapAB"): consumer warpgroup w owns key rows
  [64 w, 64 w + 64) of the tile and computes S^T = K Q^T and dP^T = V dO^T (64 keys x tile_m
  queries), so P^T and dS^T are already in the layout of the A operand of dV += P^T dO and
  dK += dS^T Q, which read it from registers (RS WGMMA); P never goes to shared memory, dS^T is
  written transposed (stmatrix.trans) into the dS tile of the dQ GEMM, double buffered by Q
  stage. The per-query lse2 / delta are per fragment column: the producer copies the block's
  rows into shared memory with Q and dO. At tile_m 80 dQ is computed transposed, dQ^T = K^T
  dS^T (80 is no multiple of WGMMA's M = 64), so the accumulator holds 80-row dQ^T blocks (the
  postprocess reads them the same way); at tile_m 128 S^T and dP^T take two 64-row WGMMA blocks
  of queries and the dQ GEMM splits its rows between the warpgroups (dq_split_m).
  Head-dim split (head_dim > 128, after FA-3's Hopper hdim-256 layout): tile_n = 64; S and dP
  are split along the key mode (64 x 32 per warpgroup) but dV, dK and dQ along head_dim: each
  warpgroup accumulates dK and dV of all 64 key rows for its head_dim half, so both read all of
  P and dS, and P is written only once both finished the previous step's dV GEMM. dO gets its
  own ring, released as soon as the dV GEMM is done (at hdim 256 it has one stage and each
  warpgroup hands its dQ over in two pieces, to fit 227 KiB).
  GQA: the group's query heads are looped inside the CTA, so dK/dV are written once, in the
  input dtype, by TMA.
  With `deterministic`, the dQ reductions into one (batch, head, m block) happen in a fixed
  key-block order, gated by an int32 semaphore per (batch, head, m block); key block n adds
  into accumulator copy n % copies (the call's count, at most the schedule's dq_copies), each
  copy with its own order and semaphores. The first contribution in a block's order is a bulk
  store, so nothing zeroes the accumulator, and producer warp 2 issues each semaphore release
  (its MEMBAR.GPU took a quarter of the writer's time). With the causal mask the order is
  descending, and CTAs launch the last key block first, so every CTA only waits for CTAs
  launched before it (no deadlock) that reached the block earlier (no stall). Without a mask,
  key block n walks the query blocks from (M - n) mod M and the order at a query block is the
  arrival order, so no key block queues behind the others at the start (_m_rotation, _dq_rank);
  key block 0 then also waits for later CTAs, so this needs the head's key blocks resident
  together: up to _DET_ROTATE_MAX_KEY_BLOCKS of them, else the ascending order.
  Masked variants (windows, segment ids; config.KernelVariant.masked) take per key block a
  range of query blocks [m_min, m_max) and a sub-range [full_lo, full_hi) that needs no
  elementwise mask (jaxflash/block_ranges.py; they stand in launch order), the CTA order, the
  query and key segment ids and the band as run-time operands; their deterministic order at a
  query block is the CTA launch order, each contribution's rank in it read from a table of the
  same module (launch_ranks), so a CTA waits only for CTAs launched before it.
  """

  def __init__(self, variant: config.KernelVariant):
    schedule = variant.schedule
    self.dtype = DTYPES[variant.dtype]
    self.head_dim = variant.head_dim
    self.head_dim_v = variant.head_dim_v
    self.head_dim_padded = (variant.head_dim + 15) // 16 * 16
    self.causal = variant.causal
    self.deterministic = variant.deterministic
    self.tile_m = schedule.tile_m
    self.tile_n = schedule.tile_n
    self.num_stages = schedule.num_stages
    self.swap_sdp = schedule.swap_sdp
    self.do_stages = schedule.do_stages
    self.dq_pieces = schedule.dq_pieces
    self.dv_after_ds = schedule.dv_after_ds
    self.dq_split_m = schedule.dq_split_m
    self.dq_transposed = schedule.dq_transposed
    self.dq_copies = schedule.dq_copies
    # The dQ copy index is a shift and a mask (_dq_copy_layout); with more than 64 query rows,
    # fp32 S^T, dP^T and P^T fit next to dK and dV only while no dV GEMM is in flight.
    assert self.dq_copies in (1, 2) and (self.dv_after_ds or self.tile_m == 64), schedule
    self.masked = variant.masked
    # Bias variants (masked, swap_sdp schedules): the bias tile comes with each Q/dO stage into
    # the stage's dS buffer, dbias leaves from there (kernels/bias.py; mma_step_swapped).
    self.bias = variant.bias
    assert not variant.bias or (variant.masked and schedule.swap_sdp), variant.key
    # Mods variants (masked, swap_sdp schedules, score_mod's derivative a constant c): S^T gets
    # score_mod and mask_mod before P (kernels/mod_codegen.py), dS^T the factor c.
    self.mods = mod_codegen.parse(variant.mods) if variant.mods else None
    self.mods_ds_factor = None
    if variant.mods:
      self.mods_ds_factor = mod_codegen.constant_derivative(self.mods)
      assert variant.masked and schedule.swap_sdp and not variant.bias, variant.key
      assert self.mods_ds_factor is not None, f"{variant.key}: score_mod's derivative varies"
    self.variant = variant
    self.rotate_m = variant.deterministic and not variant.causal and not variant.masked
    self.num_mma_threads = _NUM_WG * _WG
    self.num_threads = self.num_mma_threads + _WG
    self.split_head_dim = not schedule.swap_sdp
    # Rows of one dQ accumulator block (bwd_common): 64, or the whole 80-row tile when dQ is
    # computed transposed. A 128-row query block holds two, one per warpgroup (dq_split_m).
    self.dq_rows = self.tile_m if self.dq_transposed else bwd_common.TILE_M
    assert self.tile_m in (self.dq_rows, _NUM_WG * self.dq_rows) and (
        self.dq_split_m == (self.tile_m == _NUM_WG * bwd_common.TILE_M)), schedule
    # swap_sdp: one dS buffer per Q stage; the head-dim split has one P and one dS buffer.
    self.ds_stages = self.num_stages if self.swap_sdp else 1

  @staticmethod
  def smem_bytes(variant: config.KernelVariant) -> int:
    """Shared memory of one CTA: mbarriers, K, V, the Q and dO rings, P, dS, the fp32 dQ
    staging buffer, alignment (_smem_buffers)."""
    return sm90_gemm.smem_bytes(_smem_buffers(variant))

  @staticmethod
  def can_implement(variant: config.KernelVariant) -> tuple[bool, str]:
    """Whether this kernel runs the variant (config.kernel_support decides)."""
    return sm90_gemm.variant_support(variant, "bwd")

  def _setup_attributes(self):
    """Tiled MMAs, shared layouts, TMA byte counts and the shared storage struct."""
    k_major, mn_major = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
    half_n = self.tile_n // _NUM_WG
    if self.swap_sdp:
      # S^T = K Q^T and dP^T = V dO^T: warpgroups stacked along the key (M) mode, all tile_m
      # queries as N. The accumulators are P^T / dS^T in the A-operand register layout of
      # the dV / dK GEMMs, which therefore read A from registers.
      self.tiled_mma_sdp = sm90_utils.make_trivial_tiled_mma(
          self.dtype, self.dtype, k_major, k_major, Float32, (_NUM_WG, 1, 1), (64, self.tile_m))
      self.tiled_mma_dk, self.tiled_mma_dv = [
          sm90_utils.make_trivial_tiled_mma(
              self.dtype, self.dtype, k_major, mn_major, Float32, (_NUM_WG, 1, 1), (64, dim),
              a_source=warpgroup.OperandSource.RMEM)
          for dim in (self.head_dim, self.head_dim_v)]
    else:
      # S = Q K^T and dP = dO V^T: warpgroups side by side along the key (N) mode.
      self.tiled_mma_sdp = sm90_utils.make_trivial_tiled_mma(
          self.dtype, self.dtype, k_major, k_major, Float32, (1, _NUM_WG, 1), (64, half_n))
      # dK = dS^T Q and dV = P^T dO, both operands the smem tiles read transposed (MN-major):
      # both warpgroups cover all key rows (M = tile_n = 64), each half of head_dim (N).
      self.tiled_mma_dk = sm90_utils.make_trivial_tiled_mma(
          self.dtype, self.dtype, mn_major, mn_major, Float32, (1, _NUM_WG, 1),
          (64, self.head_dim // _NUM_WG))
      self.tiled_mma_dv = sm90_utils.make_trivial_tiled_mma(
          self.dtype, self.dtype, mn_major, mn_major, Float32, (1, _NUM_WG, 1),
          (64, self.head_dim_v // _NUM_WG))
    if const_expr(self.dq_split_m):
      self.tiled_mma_dq = bwd_common.dq_tiled_mma(self.dtype, self.head_dim, rows=self.tile_m,
                                                  split_rows=True)
    else:
      self.tiled_mma_dq = bwd_common.dq_tiled_mma(self.dtype, self.head_dim, rows=self.dq_rows,
                                                  transposed=self.dq_transposed)
    m, n, s = self.tile_m, self.tile_n, self.num_stages
    # Head-dim split: the dK / dV GEMMs read Q / dO transposed with head_dim split between the
    # warpgroups, so each half must be whole swizzle atoms.
    q_major = self.head_dim // _NUM_WG if self.split_head_dim else None
    do_major = self.head_dim_v // _NUM_WG if self.split_head_dim else None
    self.sQ_layout = sm90_gemm.smem_layout(self.dtype, m, self.head_dim, s, major_size=q_major)
    self.sdO_layout = sm90_gemm.smem_layout(self.dtype, m, self.head_dim_v, self.do_stages,
                                            major_size=do_major)
    # K is also read transposed by dQ = dS K with head_dim split between the warpgroups.
    self.sK_layout = sm90_gemm.smem_layout(self.dtype, n, self.head_dim,
                                           major_size=self.head_dim // _NUM_WG)
    # dV leaves through sV: with the head-dim split each warpgroup stores half of head_dim_v.
    self.sV_layout = sm90_gemm.smem_layout(self.dtype, n, self.head_dim_v, major_size=do_major)
    # P and dS are read transposed with the key mode split between the warpgroups (whole
    # swizzle atoms per half); the head-dim split reads all 64 keys: one 128-byte atom.
    self.sPdS_layout = sm90_gemm.smem_layout(
        self.dtype, m, n, self.ds_stages if self.swap_sdp else None,
        major_size=n if self.split_head_dim else half_n)
    self.tma_bytes_kv = (cute.size_in_bytes(self.dtype, self.sK_layout)
                         + cute.size_in_bytes(self.dtype, self.sV_layout))
    self.tma_bytes_q = cute.size_in_bytes(self.dtype, cute.slice_(self.sQ_layout, (None, None, 0)))
    self.tma_bytes_do = cute.size_in_bytes(self.dtype,
                                           cute.slice_(self.sdO_layout, (None, None, 0)))
    self.tma_bytes_qdo = self.tma_bytes_q + self.tma_bytes_do
    if self.swap_sdp:
      # The block's lse2 and delta rows (and, masked, query ids) ride on the Q/dO stage (one
      # bulk copy each).
      self.tma_bytes_qdo += (3 if self.masked else 2) * self.tile_m * 4
    if self.bias:
      # So does the block's bias tile, into the stage's dS buffer (the layout of dS).
      self.tma_bytes_qdo += cute.size_in_bytes(self.dtype,
                                               cute.slice_(self.sPdS_layout, (None, None, 0)))
    tiles = dict(sK=(self.sK_layout,), sV=(self.sV_layout,), sQ=(self.sQ_layout,),
                 sdO=(self.sdO_layout,), sdS=(self.sPdS_layout,))
    if not self.swap_sdp:
      tiles["sP"] = (self.sPdS_layout,)
    # One pipeline list for both schedules: mbar_do is the separate dO ring of the head-dim
    # split (unused otherwise).
    self.shared_storage = sm90_gemm.shared_storage(
        dict(mbar_kv=1, mbar_qdo=self.num_stages, mbar_do=self.do_stages),
        _smem_buffers(self.variant), tiles)

  @cute.jit
  def __call__(
      self,
      mQ: cute.Tensor,  # (batch, seqlen_q, num_heads, head_dim)
      mK: cute.Tensor,  # (batch, seqlen_k, num_kv_heads, head_dim)
      mV: cute.Tensor,  # (batch, seqlen_k, num_kv_heads, head_dim_v)
      mdO: cute.Tensor,  # (batch, seqlen_q, num_heads, head_dim_v)
      mLSE2: cute.Tensor,  # (batch, num_heads, seqlen_q_rounded) float32, lse * log2(e)
      mDelta: cute.Tensor,  # (batch, num_heads, seqlen_q_rounded) float32
      mdQaccum: cute.Tensor,  # (batch, num_heads, copies * seqlen_q_rounded, head_dim) float32
      mdK: cute.Tensor,  # (batch, seqlen_k, num_kv_heads, head_dim)
      mdV: cute.Tensor,  # (batch, seqlen_k, num_kv_heads, head_dim_v)
      mSem: cute.Tensor,  # (batch, num_heads, copies * seqlen_q_rounded / tile_m) int32, or None
      mQIds: cute.Tensor,  # masked: (batch, m blocks * tile_m) int32 query ids, or None
      mKIds: cute.Tensor,  # masked: (batch, n blocks * tile_n) int32 key ids, or None
      mRanges: cute.Tensor,  # masked: (batch, n blocks, 4) int32 block ranges in launch order
      mOrder: cute.Tensor,  # masked: (batch * n blocks,) int32 CTA order, or None
      mRanks: cute.Tensor,  # masked deterministic: (batch, n blocks, m blocks) int32, or None
      mBias: Optional[cute.Tensor],  # bias: (rows, seqlen_k, planes) in dtype (kernels/bias.py)
      bias_batch_planes: Optional[Int32],  # bias: its planes per batch (0: broadcast), or None
      bias_head_planes: Optional[Int32],  # bias: its planes per head (0: broadcast)
      bias_query_step: Optional[Int32],  # bias: 1, or 0 for one row per (batch, head)
      mdBias: Optional[cute.Tensor],  # bias: (batch, num_heads, seqlen_q, seqlen_k) in dtype
      mMod0: Optional[cute.Tensor],  # mods: the closed-over arrays in operand order (their own
      mMod1: Optional[cute.Tensor],  # dtypes and ranks, rank 0 as (1,)), None past the last
      mMod2: Optional[cute.Tensor],
      mMod3: Optional[cute.Tensor],
      softmax_scale: Float32,
      window_left: Optional[Int32],  # masked: the band (block_ranges.window_bounds), or None
      window_right: Optional[Int32],
      softcap: Optional[Float32],  # masked: scores are softcap * tanh(s / softcap); 0: off
      stream: cuda.CUstream,
  ):
    if const_expr(not (mQ.element_type == mK.element_type == mV.element_type
                       == mdO.element_type == mdK.element_type == mdV.element_type
                       == self.dtype)):
      raise TypeError(f"q, k, v, d_out, dk and dv must all be {self.dtype}")
    if const_expr(not (mLSE2.element_type == mDelta.element_type == mdQaccum.element_type
                       == Float32)):
      raise TypeError("lse_log2, delta and dq_accum must be Float32")
    if const_expr(self.deterministic != (mSem is not None)):
      raise TypeError("the dQ semaphore is passed exactly when deterministic")
    if const_expr(self.bias != (mBias is not None) or self.bias != (mdBias is not None)):
      raise TypeError("the bias and dbias are passed exactly to bias variants")
    if const_expr(self.bias and not (mBias.element_type == mdBias.element_type == self.dtype)):
      raise TypeError(f"bias and dbias must be {self.dtype}")
    mMods = tuple(t for t in (mMod0, mMod1, mMod2, mMod3) if const_expr(t is not None))
    want = self.mods["arrays"] if const_expr(self.mods is not None) else ()
    if const_expr(len(mMods) != len(want)):
      raise TypeError(f"the mods' arrays: {len(want)} expected, got {len(mMods)}")
    self._setup_attributes()
    # Kernel-side order puts the tile modes first: (seqlen, dim, heads, batch).
    mQ, mK, mV, mdO, mdK, mdV = [_select(t, [1, 3, 2, 0]) for t in (mQ, mK, mV, mdO, mdK, mdV)]
    mLSE2, mDelta = [_select(t, [2, 1, 0]) for t in (mLSE2, mDelta)]
    mdQaccum = _select(mdQaccum, [2, 3, 1, 0])  # (copies * rows, head_dim, heads, batch)
    if const_expr(self.deterministic):
      mSem = _select(mSem, [2, 1, 0])  # (copies * m blocks, heads, batch)
    if const_expr(self.masked != (mRanges is not None)
                  or (mRanks is not None) != (self.masked and self.deterministic)):
      raise TypeError("the mask operands are passed exactly to masked variants, the ranks to "
                      "deterministic ones")
    if const_expr(self.masked):
      mQIds, mKIds = [_select(t, [1, 0]) for t in (mQIds, mKIds)]  # (positions, batch)
      mRanges = _select(mRanges, [2, 1, 0])  # (4, n blocks, batch)
      if const_expr(self.deterministic):
        mRanks = _select(mRanks, [2, 1, 0])  # (m blocks, n blocks, batch)

    load_op, store_op = cpasync.CopyBulkTensorTileG2SOp(), cpasync.CopyBulkTensorTileS2GOp()
    q_tile, do_tile = (self.tile_m, self.head_dim), (self.tile_m, self.head_dim_v)
    k_tile, v_tile = (self.tile_n, self.head_dim), (self.tile_n, self.head_dim_v)
    tma_atom_q, tma_q = cpasync.make_tiled_tma_atom(
        load_op, mQ, cute.slice_(self.sQ_layout, (None, None, 0)), q_tile)
    tma_atom_do, tma_do = cpasync.make_tiled_tma_atom(
        load_op, mdO, cute.slice_(self.sdO_layout, (None, None, 0)), do_tile)
    tma_atom_k, tma_k = cpasync.make_tiled_tma_atom(load_op, mK, self.sK_layout, k_tile)
    tma_atom_v, tma_v = cpasync.make_tiled_tma_atom(load_op, mV, self.sV_layout, v_tile)
    # dK/dV leave through sK/sV; TMA stores clip rows >= seqlen_k.
    tma_atom_dk, tma_dk = cpasync.make_tiled_tma_atom(store_op, mdK, self.sK_layout, k_tile)
    tma_atom_dv, tma_dv = cpasync.make_tiled_tma_atom(store_op, mdV, self.sV_layout, v_tile)

    tma_atom_bias = tma_atom_dbias = mdBias_tma = None
    if const_expr(self.bias):
      # The step's bias tile into the dS buffer of its stage, and dS out of it into dbias
      # (kernel order (seqlen_q, seqlen_k, heads, batch)): keys past seqlen_k load as zeros
      # (masked), and the stores clip rows past seqlen_q and keys past seqlen_k.
      ds_slot = cute.slice_(self.sPdS_layout, (None, None, 0))
      tma_atom_bias, mBias = cpasync.make_tiled_tma_atom(load_op, mBias, ds_slot,
                                                         (self.tile_m, self.tile_n))
      mdBias = _select(mdBias, [2, 3, 1, 0])
      tma_atom_dbias, mdBias_tma = cpasync.make_tiled_tma_atom(store_op, mdBias, ds_slot,
                                                               (self.tile_m, self.tile_n))
    grid = (cute.ceil_div(cute.size(mK.shape[0]), self.tile_n), cute.size(mK.shape[2]),
            cute.size(mK.shape[3]))
    if const_expr(self.masked):
      # One CTA per (key block, kv head), in the order of _launch_entry.
      grid = (grid[0] * grid[1] * grid[2], 1, 1)
    self.kernel(
        tma_q, tma_k, tma_v, tma_do, tma_dk, tma_dv, mLSE2, mDelta, mdQaccum, mSem,
        tma_atom_q, tma_atom_k, tma_atom_v, tma_atom_do, tma_atom_dk, tma_atom_dv,
        softmax_scale,
        self.sQ_layout, self.sK_layout, self.sV_layout, self.sdO_layout, self.sPdS_layout,
        self.tiled_mma_sdp, self.tiled_mma_dk, self.tiled_mma_dv, self.tiled_mma_dq,
        mQIds, mKIds, mRanges, mOrder, mRanks, window_left, window_right, softcap, mBias,
        tma_atom_bias, bias_batch_planes, bias_head_planes, bias_query_step, mdBias, mdBias_tma,
        tma_atom_dbias, mMods,
    ).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream, min_blocks_per_mp=1)

  @cute.kernel
  def kernel(
      self,
      mQ: cute.Tensor,  # TMA coordinates of (seqlen_q, head_dim, num_heads, batch)
      mK: cute.Tensor,  # TMA coordinates of (seqlen_k, head_dim, num_kv_heads, batch)
      mV: cute.Tensor,  # TMA coordinates of (seqlen_k, head_dim_v, num_kv_heads, batch)
      mdO: cute.Tensor,  # TMA coordinates of (seqlen_q, head_dim_v, num_heads, batch)
      mdK: cute.Tensor,  # TMA coordinates of (seqlen_k, head_dim, num_kv_heads, batch)
      mdV: cute.Tensor,  # TMA coordinates of (seqlen_k, head_dim_v, num_kv_heads, batch)
      mLSE2: cute.Tensor,  # (seqlen_q_rounded, num_heads, batch)
      mDelta: cute.Tensor,  # (seqlen_q_rounded, num_heads, batch)
      mdQaccum: cute.Tensor,  # (copies * seqlen_q_rounded, head_dim, num_heads, batch)
      mSem: cute.Tensor,  # (copies * m blocks, num_heads, batch) or None
      tma_atom_q: cute.CopyAtom,
      tma_atom_k: cute.CopyAtom,
      tma_atom_v: cute.CopyAtom,
      tma_atom_do: cute.CopyAtom,
      tma_atom_dk: cute.CopyAtom,
      tma_atom_dv: cute.CopyAtom,
      softmax_scale: Float32,
      sQ_layout: cute.ComposedLayout,
      sK_layout: cute.ComposedLayout,
      sV_layout: cute.ComposedLayout,
      sdO_layout: cute.ComposedLayout,
      sPdS_layout: cute.ComposedLayout,
      tiled_mma_sdp: cute.TiledMma,
      tiled_mma_dk: cute.TiledMma,
      tiled_mma_dv: cute.TiledMma,
      tiled_mma_dq: cute.TiledMma,
      mQIds: cute.Tensor,  # masked: (m blocks * tile_m, batch), or None (also the rest)
      mKIds: cute.Tensor,  # (n blocks * tile_n, batch)
      mRanges: cute.Tensor,  # (4, n blocks, batch): m_min, m_max, full_lo, full_hi
      mOrder: cute.Tensor,  # (batch * n blocks,)
      mRanks: cute.Tensor,  # deterministic: (m blocks, n blocks, batch)
      window_left: Optional[Int32],
      window_right: Optional[Int32],
      softcap: Optional[Float32],
      mBias: Optional[cute.Tensor],  # bias: TMA coordinates of (rows, seqlen_k, planes), or None
      tma_atom_bias: Optional[cute.CopyAtom],
      bias_batch_planes: Optional[Int32],  # bias: kernels/bias.py BiasPlanes
      bias_head_planes: Optional[Int32],
      bias_query_step: Optional[Int32],
      mdBias: Optional[cute.Tensor],  # bias: (seqlen_q, seqlen_k, num_heads, batch) in dtype
      mdBias_tma: Optional[cute.Tensor],  # its TMA coordinates
      tma_atom_dbias: Optional[cute.CopyAtom],
      mMods: tuple,  # mods: the closed-over arrays; else ()
  ):
    tidx, _, _ = cute.arch.thread_idx()
    warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    atoms = (tma_atom_q, tma_atom_k, tma_atom_v, tma_atom_do, tma_atom_dk, tma_atom_dv)
    if const_expr(self.bias):
      atoms = atoms + (tma_atom_bias, tma_atom_dbias)
    sm90_gemm.prefetch_descriptors(warp_idx, atoms)

    storage = cutlass.utils.SmemAllocator().allocate(self.shared_storage)
    # pipeline_qdo carries Q and dO, or Q only when dO has its own ring (head-dim split).
    pipeline_kv, pipeline_qdo, pipeline_do = self._make_pipelines(storage)
    buffers = (("sQ", sQ_layout), ("sK", sK_layout), ("sV", sV_layout), ("sdO", sdO_layout),
               ("sP", sPdS_layout), ("sdS", sPdS_layout))
    if const_expr(self.swap_sdp):
      buffers = tuple(b for b in buffers if b[0] != "sP")
    smem = {name: getattr(storage, name).get_tensor(layout.outer, swizzle=layout.inner)
            for name, layout in buffers}
    sdQ = storage.sdQ.get_tensor(cute.make_layout(self.tile_m * self.head_dim // self.dq_pieces))
    stats = None
    if const_expr(self.swap_sdp):
      stats_layout = cute.make_layout((self.tile_m, self.num_stages))
      stats = (mLSE2, mDelta, storage.sLSE2.get_tensor(stats_layout),
               storage.sDelta.get_tensor(stats_layout))
    masking = None
    if const_expr(self.masked):
      query_ids_smem = None
      if const_expr(self.swap_sdp):
        query_ids_smem = storage.sQIds.get_tensor(cute.make_layout((self.tile_m,
                                                                    self.num_stages)))
      # Soft-capping (the forward's): S' = softcap * tanh(S * softmax_scale / softcap). P takes
      # t = tanh(S * tanh_scale) scaled by softcap; dS gets the chain factor 1 - t^2 (the
      # softmax_scale factor is applied to dK and dQ as without softcap).
      capped = softcap > Float32(0.0)
      tanh_scale = Float32(0.0)
      p_scale_log2 = softmax_scale * LOG2_E
      inv_cap_log2 = Float32(0.0)
      if capped:
        tanh_scale = softmax_scale / softcap
        p_scale_log2 = softcap * LOG2_E
        inv_cap_log2 = Float32(1.0) / p_scale_log2
      # score_mod sees the score: S' * (p_scale_log2 ln 2) in, its result divided by that out.
      mod_scale = None
      mod_inv_scale = None
      if const_expr(self.mods is not None):
        mod_scale = p_scale_log2 * LN_2
        mod_inv_scale = Float32(1.0) / mod_scale
      bias = None
      if const_expr(self.bias):
        bias = _BiasOperands(
            tma=mBias, tma_atom=tma_atom_bias,
            planes=score_bias.BiasPlanes(bias_batch_planes, bias_head_planes, bias_query_step),
            tiles=score_bias.SharedTiles(Int32(storage.sdS.data_ptr().toint()), sPdS_layout),
            smem=smem["sdS"],
            dbias=mdBias, dbias_tma=mdBias_tma, dbias_atom=tma_atom_dbias)
      masking = _Masking(query_ids=mQIds, key_ids=mKIds, ranges=mRanges, order=mOrder,
                         window_left=window_left, window_right=window_right,
                         capped=Int32(capped), tanh_scale=tanh_scale, ranks=mRanks,
                         query_ids_smem=query_ids_smem, p_scale_log2=p_scale_log2,
                         inv_cap_log2=inv_cap_log2, bias=bias, mod_arrays=mMods,
                         mod_scale=mod_scale, mod_inv_scale=mod_inv_scale)
    # Barrier inits (deferred in _make_pipelines) must be visible before anyone waits on them.
    cute.arch.mbarrier_init_fence()
    cute.arch.sync_threads()

    seqlen_q, seqlen_k = mQ.shape[0], mK.shape[0]
    group = mQ.shape[2] // mK.shape[2]  # GQA/MQA: query heads per kv head

    # The block coordinates are computed by each role after its register resize: computed
    # before it, they are live into the producer's 24 registers, which spilled them (causal +
    # deterministic at 128 query rows, swapped).
    warpgroup_idx = cute.arch.make_warp_uniform(tidx // _WG)
    if warpgroup_idx == 0:
      cute.arch.setmaxregister_decrease(_PRODUCER_REGS)
      n_block, head_kv, batch, m_min, m_max, m_rot = self._work_coords(seqlen_q, seqlen_k,
                                                                       masking)
      if warp_idx == 0:
        self.load(mQ, mK, mV, mdO, tma_atom_q, tma_atom_k, tma_atom_v, tma_atom_do,
                  smem["sQ"], smem["sK"], smem["sV"], smem["sdO"], pipeline_kv, pipeline_qdo,
                  pipeline_do, n_block, head_kv, batch, group, m_min, m_max, m_rot, stats,
                  masking)
      if warp_idx == _DQ_WRITER_WARP:
        self.store_dq(mdQaccum, mSem, sdQ, n_block, head_kv, batch, group, m_min, m_max,
                      m_rot, seqlen_q, seqlen_k, masking)
      if const_expr(self.deterministic):
        if warp_idx == _DQ_RELEASE_WARP:
          self.release_dq(mdQaccum, mSem, n_block, head_kv, batch, group, m_min, m_max, m_rot,
                          seqlen_q)
      if const_expr(self.bias):
        if warp_idx == _DBIAS_ZERO_WARP:
          self.zero_dbias(masking.bias.dbias, n_block, head_kv, batch, group, m_min, m_max,
                          seqlen_q, seqlen_k)
    else:
      cute.arch.setmaxregister_increase(_MMA_REGS)
      n_block, head_kv, batch, m_min, m_max, m_rot = self._work_coords(seqlen_q, seqlen_k,
                                                                       masking)
      if const_expr(self.swap_sdp):
        self.mma_swapped(mdK, mdV, stats[2], stats[3], tma_atom_dk, tma_atom_dv, smem, sdQ,
                         tiled_mma_sdp, tiled_mma_dk, tiled_mma_dv, tiled_mma_dq,
                         pipeline_kv, pipeline_qdo, softmax_scale,
                         n_block, head_kv, batch, group, m_rot, seqlen_q, seqlen_k, masking)
      else:
        self.mma(mdK, mdV, mLSE2, mDelta, tma_atom_dk, tma_atom_dv, smem, sdQ,
                 tiled_mma_sdp, tiled_mma_dk, tiled_mma_dv, tiled_mma_dq,
                 pipeline_kv, pipeline_qdo, pipeline_do, softmax_scale,
                 n_block, head_kv, batch, group, m_min, m_max, m_rot, seqlen_q, seqlen_k,
                 masking)

  def _make_pipelines(self, storage):
    """TMA pipelines: one elected producer thread arrives; lane 0 of each consumer warp releases."""
    producer = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
    consumer = pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                         self.num_mma_threads // sm90_gemm.WARP_THREADS)
    kv = pipeline.PipelineTmaAsync.create(
        barrier_storage=storage.mbar_kv.data_ptr(), num_stages=1, producer_group=producer,
        consumer_group=consumer, tx_count=self.tma_bytes_kv, defer_sync=True)
    if not self.split_head_dim:
      qdo = pipeline.PipelineTmaAsync.create(
          barrier_storage=storage.mbar_qdo.data_ptr(), num_stages=self.num_stages,
          producer_group=producer, consumer_group=consumer, tx_count=self.tma_bytes_qdo,
          defer_sync=True)
      return kv, qdo, None
    q = pipeline.PipelineTmaAsync.create(
        barrier_storage=storage.mbar_qdo.data_ptr(), num_stages=self.num_stages,
        producer_group=producer, consumer_group=consumer, tx_count=self.tma_bytes_q,
        defer_sync=True)
    do = pipeline.PipelineTmaAsync.create(
        barrier_storage=storage.mbar_do.data_ptr(), num_stages=self.do_stages,
        producer_group=producer, consumer_group=consumer, tx_count=self.tma_bytes_do,
        defer_sync=True)
    return kv, q, do

  @cute.jit
  def _launch_entry(self, masking):
    """Masked: (entry, kv head, batch, slot) of this CTA. Each entry of the CTA order names
    (batch, key block). kv heads slowest, then the entries: the CTAs in flight at once share
    one kv head's queries, dO and dQ accumulator, where kv heads fastest spread them over every
    head's (2.4x the DRAM traffic on 8 packed documents; docs/kernels.md, "Masked variants").
    Deterministic variants keep the kv heads of one entry consecutive: their CTAs in flight then
    mostly add into different heads' dQ, where one kv head's key tiles would queue on the same
    query blocks' semaphores. Each batch's entries are consecutive, so batch and slot (the
    entry's place in its batch's part, where its block range stands: the ranges are in launch
    order) need no load."""
    cta, _, _ = cute.arch.block_idx()
    num_entries = masking.order.shape[0]
    if const_expr(self.deterministic):
      num_kv_heads = cute.arch.grid_dim()[0] // num_entries
      entry = cta // num_kv_heads
      head_kv = cta - entry * num_kv_heads
    else:
      head_kv = cta // num_entries
      entry = cta - head_kv * num_entries
    num_n = masking.ranges.shape[1]
    batch = entry // num_n
    return entry, head_kv, batch, entry - batch * num_n

  @cute.jit
  def _work_coords(self, seqlen_q: Int32, seqlen_k: Int32, masking):
    """This CTA's key block, kv head and batch, and its query blocks [m_min, m_max), rotation."""
    if const_expr(self.masked):
      entry, head_kv, batch, slot = self._launch_entry(masking)
      n_block = masking.order[entry] - batch * masking.ranges.shape[1]
      m_min = masking.ranges[0, slot, batch]
      m_max = masking.ranges[1, slot, batch]
      m_rot = None
    else:
      n_block, head_kv, batch = cute.arch.block_idx()
      if const_expr(self.causal and self.deterministic):
        # Shortest first: the last key block (fewest query blocks) is launched first.
        n_block = cute.ceil_div(seqlen_k, self.tile_n) - 1 - n_block
      m_min, m_max = self._m_block_range(n_block, seqlen_q, seqlen_k)
      m_rot = self._m_rotation(n_block, seqlen_q, seqlen_k)
    return n_block, head_kv, batch, m_min, m_max, m_rot

  @cute.jit
  def _m_block_range(self, n_block: Int32, seqlen_q: Int32, seqlen_k: Int32):
    """Query blocks [m_min, m_max) that see some key of n_block (bottom-right causal)."""
    m_max = cute.ceil_div(seqlen_q, self.tile_m)
    m_min = Int32(0)
    if const_expr(self.causal):
      # Query row i sees key j iff j <= i + seqlen_k - seqlen_q: the block's first key is first
      # seen by row n_block * tile_n - (seqlen_k - seqlen_q).
      first_row = n_block * self.tile_n - seqlen_k + seqlen_q
      if first_row > 0:
        m_min = cutlass.min(first_row // self.tile_m, m_max)
    return m_min, m_max

  @cute.jit
  def _first_unmasked_m_block(self, n_block: Int32, m_min: Int32, m_max: Int32,
                              seqlen_q: Int32, seqlen_k: Int32) -> Int32:
    """Query blocks from m_min up to the result need the elementwise mask (in [m_min, m_max]).

    A key block past seqlen_k masks every query block. Causal: query block m sees all of
    n_block iff its first row i = m * tile_m sees the block's last key, (n_block + 1) * tile_n - 1
    <= i + seqlen_k - seqlen_q; so m needs the mask iff m * tile_m < limit below.
    """
    m_split = m_min
    if (n_block + 1) * self.tile_n > seqlen_k:
      m_split = m_max
    elif const_expr(self.causal):
      limit = (n_block + 1) * self.tile_n - 1 - seqlen_k + seqlen_q
      if limit > 0:
        m_split = cutlass.min(cutlass.max((limit + self.tile_m - 1) // self.tile_m, m_min), m_max)
    return m_split

  @cute.jit
  def _m_rotation(self, n_block: Int32, seqlen_q: Int32, seqlen_k: Int32):
    """Deterministic without a mask: this key block's first query block, (M - n_block) mod M,
    or 0 where the order stays ascending (_DET_ROTATE_MAX_KEY_BLOCKS); else None (a
    compile-time no-op)."""
    m_rot = None
    if const_expr(self.rotate_m):
      m_rot = Int32(0)
      num_m, rotates = self._rotates(seqlen_q, seqlen_k)
      n_mod = n_block % cutlass.max(num_m, 1)
      if rotates and n_mod > 0:
        m_rot = num_m - n_mod
    return m_rot

  @cute.jit
  def _rotates(self, seqlen_q: Int32, seqlen_k: Int32):
    """(query blocks M, whether the rotated deterministic order runs: key blocks N <= M and
    N <= _DET_ROTATE_MAX_KEY_BLOCKS); _m_rotation and _dq_rank must agree on it."""
    num_n = cute.ceil_div(seqlen_k, self.tile_n)
    num_m = cute.ceil_div(seqlen_q, self.tile_m)
    return num_m, cutlass.max(num_n - num_m, num_n - _DET_ROTATE_MAX_KEY_BLOCKS) <= 0

  @cute.jit
  def _m_block_at(self, i: Int32, m_rot, m_max: Int32) -> Int32:
    """The query block of step i in [0, m_max) (no mask, so m_min = 0): i rotated by m_rot."""
    m_block = i
    if const_expr(m_rot is not None):
      m_block = i + m_rot
      if m_block >= m_max:
        m_block = m_block - m_max
    return m_block

  @cute.jit
  def load(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
           tma_atom_q: cute.CopyAtom, tma_atom_k: cute.CopyAtom, tma_atom_v: cute.CopyAtom,
           tma_atom_do: cute.CopyAtom, sQ: cute.Tensor, sK: cute.Tensor, sV: cute.Tensor,
           sdO: cute.Tensor, pipeline_kv, pipeline_qdo, pipeline_do, n_block: Int32,
           head_kv: Int32, batch: Int32, group: Int32, m_min: Int32, m_max: Int32, m_rot,
           stats, masking):
    """Producer warp: K and V once, then Q and dO per (query head of the group, query block).

    stats (swap_sdp): (mLSE2, mDelta, sLSE2, sDelta); the block's lse2 / delta rows (and the
    masked variants' query ids) go with Q and dO into the same stage.
    """
    one_cta = cute.make_layout(1)
    gK = cute.local_tile(mK[None, None, head_kv, batch], (self.tile_n, self.head_dim),
                         (n_block, 0))
    gV = cute.local_tile(mV[None, None, head_kv, batch], (self.tile_n, self.head_dim_v),
                         (n_block, 0))
    tKsK, tKgK = cpasync.tma_partition(
        tma_atom_k, 0, one_cta, cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2))
    tVsV, tVgV = cpasync.tma_partition(
        tma_atom_v, 0, one_cta, cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2))
    kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
    pipeline_kv.producer_acquire(kv_state)
    cute.copy(tma_atom_k, tKgK, tKsK, tma_bar_ptr=pipeline_kv.producer_get_barrier(kv_state))
    cute.copy(tma_atom_v, tVgV, tVsV, tma_bar_ptr=pipeline_kv.producer_get_barrier(kv_state))

    qdo_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
    if const_expr(self.split_head_dim):
      do_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.do_stages)
    for g in cutlass.range(group, unroll=1):
      head = head_kv * group + g
      gQ = cute.local_tile(mQ[None, None, head, batch], (self.tile_m, self.head_dim), (None, 0))
      gdO = cute.local_tile(mdO[None, None, head, batch], (self.tile_m, self.head_dim_v),
                            (None, 0))
      tQsQ, tQgQ = cpasync.tma_partition(
          tma_atom_q, 0, one_cta, cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2))
      tOsdO, tOgdO = cpasync.tma_partition(
          tma_atom_do, 0, one_cta, cute.group_modes(sdO, 0, 2), cute.group_modes(gdO, 0, 2))
      for step in cutlass.range(m_min, m_max, unroll=1):
        m_block = self._m_block_at(step, m_rot, m_max)
        if const_expr(not self.split_head_dim):
          # Q and dO of one block share a slot (one barrier, tx = both byte counts).
          pipeline_qdo.producer_acquire(qdo_state)
          barrier = pipeline_qdo.producer_get_barrier(qdo_state)
          cute.copy(tma_atom_q, tQgQ[None, m_block], tQsQ[None, qdo_state.index],
                    tma_bar_ptr=barrier)
          cute.copy(tma_atom_do, tOgdO[None, m_block], tOsdO[None, qdo_state.index],
                    tma_bar_ptr=barrier)
          if const_expr(stats is not None):
            with cute.arch.elect_one():
              for src, dst in ((stats[0], stats[2]), (stats[1], stats[3])):
                sm90_gemm.bulk_copy_g2s(
                    dst[None, qdo_state.index].iterator,
                    src[None, head, batch].iterator + m_block * self.tile_m,
                    self.tile_m * 4, barrier)
              if const_expr(self.masked):
                sm90_gemm.bulk_copy_g2s(
                    masking.query_ids_smem[None, qdo_state.index].iterator,
                    masking.query_ids[None, batch].iterator + m_block * self.tile_m,
                    self.tile_m * 4, barrier)
          self._load_bias_tile(masking, batch, head, m_block, n_block, qdo_state.index,
                               barrier)
          qdo_state.advance()
        else:
          # Q runs ahead in its deeper ring; dO waits for the previous block's dV GEMM.
          pipeline_qdo.producer_acquire(qdo_state)
          cute.copy(tma_atom_q, tQgQ[None, m_block], tQsQ[None, qdo_state.index],
                    tma_bar_ptr=pipeline_qdo.producer_get_barrier(qdo_state))
          qdo_state.advance()
          pipeline_do.producer_acquire(do_state)
          cute.copy(tma_atom_do, tOgdO[None, m_block], tOsdO[None, do_state.index],
                    tma_bar_ptr=pipeline_do.producer_get_barrier(do_state))
          do_state.advance()

  @cute.jit
  def _load_bias_tile(self, masking, batch: Int32, head: Int32, m_block: Int32, n_block: Int32,
                      stage: Int32, barrier):
    """Bias variants: the (query block, key block) bias tile into the stage's dS buffer, on
    the Q/dO stage's barrier (its transaction bytes include it)."""
    if const_expr(self.bias):
      b = masking.bias
      plane = b.tma[None, None, b.planes.plane(batch, head)]
      gBias = cute.local_tile(
          cute.domain_offset((b.planes.row(m_block * self.tile_m), 0), plane),
          (self.tile_m, self.tile_n), (0, n_block))
      tBsB, tBgB = cpasync.tma_partition(b.tma_atom, 0, cute.make_layout(1),
                                         cute.group_modes(b.smem, 0, 2),
                                         cute.group_modes(gBias, 0, 2))
      cute.copy(b.tma_atom, tBgB, tBsB[None, stage], tma_bar_ptr=barrier)

  @cute.jit
  def zero_dbias(self, dbias: cute.Tensor, n_block: Int32, head_kv: Int32, batch: Int32,
                 group: Int32, m_min: Int32, m_max: Int32, seqlen_q: Int32, seqlen_k: Int32):
    """Bias variants, one producer warp: dbias = 0 over the rows of every query head of the
    group that this key block skips (the query blocks outside [m_min, m_max), whose scores its
    mask hides), so that each dbias element inside (seqlen_q, seqlen_k) is written once by one
    CTA: these zeros, or a visited block's dS."""
    for g in cutlass.range(group, unroll=1):
      rows = dbias[None, None, head_kv * group + g, batch]
      for first, last in ((Int32(0), m_min * self.tile_m),
                          (m_max * self.tile_m, seqlen_q)):  # a trace-time loop
        score_bias.zero_skipped_rows(rows, first, cutlass.min(last, seqlen_q),
                                     n_block * self.tile_n, seqlen_k, self.tile_n)

  @cute.jit
  def _zeroed_dk_dv(self, thr_dk, thr_dv):
    """This consumer thread's dK / dV accumulators (registers for the whole loop), zeroed."""
    acc_dk = thr_dk.make_fragment_C(thr_dk.partition_shape_C((self.tile_n, self.head_dim)))
    acc_dv = thr_dv.make_fragment_C(thr_dv.partition_shape_C((self.tile_n, self.head_dim_v)))
    acc_dk.fill(0.0)
    acc_dv.fill(0.0)
    return acc_dk, acc_dv

  def _p_scale_and_cap(self, softmax_scale: Float32, masking):
    """(scale_log2, cap) of the consumer steps: P = exp2(S' * scale_log2 - lse2), where
    scale_log2 is softmax_scale log2 e, or in masked variants the call's
    masking.p_scale_log2; cap (masked variants, else None): (capped, tanh_scale,
    inv_cap_log2)."""
    scale_log2 = softmax_scale * LOG2_E
    cap = None
    if const_expr(self.masked):
      scale_log2 = masking.p_scale_log2
      cap = (masking.capped, masking.tanh_scale, masking.inv_cap_log2)
    return scale_log2, cap

  @cute.jit
  def _capped_scores(self, acc_s: cute.Tensor, cap) -> cute.Tensor:
    """S (or S^T) as (rows, columns), soft-capped first where the call's softcap is on (masked
    variants: t = tanh(S * tanh_scale) in place, cap as in mma_step)."""
    if const_expr(self.masked):
      if cap[0] != 0:
        softmax.soft_cap(acc_s, cap[1])
    return softmax.make_acc_mn_view(acc_s)

  @cute.jit
  def _wait_for_k_v(self, pipeline_kv):
    """Waits for the CTA's K and V tiles; returns the consumer state of the Q/dO ring."""
    kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
    pipeline_kv.consumer_wait(kv_state)
    return pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)

  @cute.jit
  def mma(self, mdK: cute.Tensor, mdV: cute.Tensor, mLSE2: cute.Tensor, mDelta: cute.Tensor,
          tma_atom_dk: cute.CopyAtom, tma_atom_dv: cute.CopyAtom, smem, sdQ: cute.Tensor,
          tiled_mma_sdp: cute.TiledMma, tiled_mma_dk: cute.TiledMma, tiled_mma_dv: cute.TiledMma,
          tiled_mma_dq: cute.TiledMma, pipeline_kv, pipeline_qdo, pipeline_do,
          softmax_scale: Float32, n_block: Int32, head_kv: Int32, batch: Int32, group: Int32,
          m_min: Int32, m_max: Int32, m_rot, seqlen_q: Int32, seqlen_k: Int32, masking):
    """Consumer warpgroups of the head-dim split: the five GEMMs per query block, then the
    dK/dV epilogue."""
    tidx, _, _ = cute.arch.thread_idx()
    mma_tidx = tidx - _WG
    sQ, sK, sV, sdO = smem["sQ"], smem["sK"], smem["sV"], smem["sdO"]
    sP, sdS = smem["sP"], smem["sdS"]
    wg_idx = cute.arch.make_warp_uniform(mma_tidx // _WG)
    (thr_sdp, thr_dk, thr_dv, thr_dq), (wg_sdp, wg_dk, wg_dv, wg_dq) = sm90_gemm.mma_slices(
        (tiled_mma_sdp, tiled_mma_dk, tiled_mma_dv, tiled_mma_dq), mma_tidx, wg_idx)
    frags = dict(
        tSrQ=wg_sdp.make_fragment_A(wg_sdp.partition_A(sQ)),
        tSrK=wg_sdp.make_fragment_B(wg_sdp.partition_B(sK)),
        tdPrdO=wg_sdp.make_fragment_A(wg_sdp.partition_A(sdO)),
        tdPrV=wg_sdp.make_fragment_B(wg_sdp.partition_B(sV)),
        tdVrPt=wg_dv.make_fragment_A(wg_dv.partition_A(sm90_gemm.transpose_view(sP))),
        tdVrdOt=wg_dv.make_fragment_B(wg_dv.partition_B(sm90_gemm.transpose_view(sdO))),
        tdKrdSt=wg_dk.make_fragment_A(wg_dk.partition_A(sm90_gemm.transpose_view(sdS))),
        tdKrQt=wg_dk.make_fragment_B(wg_dk.partition_B(sm90_gemm.transpose_view(sQ))),
        tdQrdS=wg_dq.make_fragment_A(wg_dq.partition_A(sdS)),
        tdQrKt=wg_dq.make_fragment_B(wg_dq.partition_B(sm90_gemm.transpose_view(sK))),
    )
    acc_dk, acc_dv = self._zeroed_dk_dv(thr_dk, thr_dv)
    tScS_mn = softmax.make_acc_mn_view(
        thr_sdp.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n))))
    scale_log2, cap = self._p_scale_and_cap(softmax_scale, masking)

    qdo_state = self._wait_for_k_v(pipeline_kv)
    do_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.do_stages)
    ids = None
    if const_expr(self.masked):
      # Query blocks [full_lo, full_hi) need no elementwise mask; the masked steps compare the
      # rows' query ids with the CTA's key ids.
      _, _, _, slot = self._launch_entry(masking)
      full_lo = masking.ranges[2, slot, batch]
      full_hi = masking.ranges[3, slot, batch]
      segments = ((m_min, full_lo, True), (full_lo, full_hi, False), (full_hi, m_max, True))
      ids = (masking.query_ids[None, batch],
             cute.local_tile(masking.key_ids[None, batch], (self.tile_n,), (n_block,)),
             masking.window_left, masking.window_right)
    else:
      # Query blocks [m_min, m_split) need the elementwise mask, [m_split, m_max) none: two
      # loops, so the unmasked (most common) steps carry no mask code or registers.
      m_split = self._first_unmasked_m_block(n_block, m_min, m_max, seqlen_q, seqlen_k)
      segments = ((m_min, m_split, True), (m_split, m_max, False))
    for g in cutlass.range(group, unroll=1):
      head = head_kv * group + g
      lse2_head = mLSE2[None, head, batch]
      delta_head = mDelta[None, head, batch]
      for lo, hi, is_masked in segments:  # a trace-time loop: one step loop per segment
        for step in cutlass.range(lo, hi, unroll=1):
          m_block = step
          if const_expr(not self.masked):
            m_block = self._m_block_at(step, m_rot, m_max)
          self.mma_step(tiled_mma_sdp, tiled_mma_dk, tiled_mma_dv, tiled_mma_dq, frags,
                        acc_dk, acc_dv, tScS_mn, sP, sdS, sdQ, lse2_head, delta_head,
                        pipeline_qdo, qdo_state, pipeline_do, do_state, scale_log2, m_block,
                        n_block, seqlen_q, seqlen_k, wg_idx, is_masked, ids, cap)
          qdo_state.advance()
          do_state.advance()

    self.epilogue(mdK, mdV, tma_atom_dk, tma_atom_dv, sK, sV, tiled_mma_dk, tiled_mma_dv,
                  acc_dk, acc_dv, softmax_scale, n_block, head_kv, batch)

  @cute.jit
  def mma_step(self, tiled_mma_sdp: cute.TiledMma, tiled_mma_dk: cute.TiledMma,
               tiled_mma_dv: cute.TiledMma, tiled_mma_dq: cute.TiledMma, frags,
               acc_dk: cute.Tensor, acc_dv: cute.Tensor, tScS_mn: cute.Tensor,
               sP: cute.Tensor, sdS: cute.Tensor, sdQ: cute.Tensor, lse2_head: cute.Tensor,
               delta_head: cute.Tensor, pipeline_qdo, qdo_state, pipeline_do, do_state,
               scale_log2: Float32, m_block: Int32, n_block: Int32, seqlen_q: Int32,
               seqlen_k: Int32, wg_idx: Int32, is_masked: cutlass.Constexpr, ids=None,
               cap=None):
    """One (query head, query block) against this CTA's key block; `is_masked`: apply the mask.
    ids (masked variants): (query ids of the batch, key ids of the key block, window_left,
    window_right); cap (masked variants): (capped, tanh_scale, inv_cap_log2)."""
    tidx, _, _ = cute.arch.thread_idx()
    mma_tidx = tidx - _WG
    stage = qdo_state.index
    do_stage = do_state.index
    num_rows = cute.size(tScS_mn, mode=[0])
    # Row statistics straight from global memory (L2-resident, written by the preprocess);
    # issued before the GEMMs so their latency hides behind them. Rows >= seqlen_q hold
    # lse2 = +inf, delta = 0 (P = 0), so they need no bounds check.
    lse2 = cute.make_rmem_tensor(num_rows, Float32)
    delta = cute.make_rmem_tensor(num_rows, Float32)
    for i in cutlass.range_constexpr(num_rows):
      row = m_block * self.tile_m + tScS_mn[i, 0][0]
      lse2[i] = lse2_head[row]
      delta[i] = delta_head[row]

    acc_shape_s = tiled_mma_sdp.get_slice(mma_tidx).partition_shape_C((self.tile_m, self.tile_n))
    acc_s = cute.make_rmem_tensor(acc_shape_s, Float32)
    acc_dp = cute.make_rmem_tensor(acc_shape_s, Float32)
    pipeline_qdo.consumer_wait(qdo_state)
    sm90_gemm.gemm(tiled_mma_sdp, acc_s, frags["tSrQ"][None, None, None, stage], frags["tSrK"],
                   zero_init=True)
    pipeline_do.consumer_wait(do_state)
    sm90_gemm.gemm(tiled_mma_sdp, acc_dp, frags["tdPrdO"][None, None, None, do_stage],
                   frags["tdPrV"], zero_init=True)
    warpgroup.wait_group(1)

    # P = exp2(S * scale * log2(e) - lse * log2(e)); masked scores are -inf, so P = 0 there.
    acc_s_mn = self._capped_scores(acc_s, cap)
    if const_expr(is_masked):
      if const_expr(self.masked):
        query_ids, key_ids, window_left, window_right = ids
        row_ids = cute.make_rmem_tensor(num_rows, Int32)
        for i in cutlass.range_constexpr(num_rows):
          row_ids[i] = query_ids[m_block * self.tile_m + tScS_mn[i, 0][0]]
        mask.apply_band_and_ids(acc_s_mn, tScS_mn, m_block, n_block, seqlen_q, seqlen_k,
                                self.tile_m, self.tile_n, window_left, window_right, row_ids,
                                key_ids)
      else:
        mask.apply_mask(acc_s_mn, tScS_mn, m_block, n_block, seqlen_q, seqlen_k, self.tile_m,
                        self.tile_n, self.causal)
    for i in cutlass.range_constexpr(num_rows):
      for j in cutlass.range_constexpr(cute.size(acc_s_mn, mode=[1])):
        acc_s_mn[i, j] = cute.math.exp2(acc_s_mn[i, j] * scale_log2 - lse2[i], fastmath=True)

    # dS = P * (dP - delta)
    warpgroup.wait_group(0)
    acc_dp_mn = softmax.make_acc_mn_view(acc_dp)
    for i in cutlass.range_constexpr(num_rows):
      for j in cutlass.range_constexpr(cute.size(acc_dp_mn, mode=[1])):
        acc_dp_mn[i, j] = acc_s_mn[i, j] * (acc_dp_mn[i, j] - delta[i])
    if const_expr(self.masked):
      if cap[0] != 0:
        for i in cutlass.range_constexpr(num_rows):
          for j in cutlass.range_constexpr(cute.size(acc_dp_mn, mode=[1])):
            acc_dp_mn[i, j] = acc_dp_mn[i, j] * softmax.tanh_derivative(
                acc_s_mn[i, j], lse2[i], cap[2])
    # The other warpgroup's dQ GEMM of the previous step reads all of dS.
    cute.arch.barrier(barrier_id=_DS_EMPTY_BARRIER, number_of_threads=self.num_mma_threads)
    # Both warpgroups' dV GEMMs read all of P; both finished (barrier above).
    sm90_gemm.store_acc_to_smem(tiled_mma_sdp, mma_tidx, acc_s, sP, self.dtype)
    sm90_gemm.store_acc_to_smem(tiled_mma_sdp, mma_tidx, acc_dp, sdS, self.dtype)
    # Generic-proxy smem writes must be visible to the async proxy (WGMMA) of both warpgroups.
    cute.arch.fence_proxy("async.shared", space="cta")
    cute.arch.barrier(barrier_id=_DS_FULL_BARRIER, number_of_threads=self.num_mma_threads)

    acc_dq = cute.make_rmem_tensor(
        tiled_mma_dq.get_slice(mma_tidx).partition_shape_C((self.tile_m, self.head_dim)),
        Float32)
    # dV first: once it is done, dO's slot goes back to the producer for the next block.
    sm90_gemm.gemm(tiled_mma_dv, acc_dv, frags["tdVrPt"],
                   frags["tdVrdOt"][None, None, None, do_stage], zero_init=False)
    sm90_gemm.gemm(tiled_mma_dq, acc_dq, frags["tdQrdS"], frags["tdQrKt"], zero_init=True)
    sm90_gemm.gemm(tiled_mma_dk, acc_dk, frags["tdKrdSt"],
                   frags["tdKrQt"][None, None, None, stage], zero_init=False)
    warpgroup.wait_group(2)
    pipeline_do.consumer_release(do_state)
    warpgroup.wait_group(1)
    self.stage_dq(acc_dq, sdQ, wg_idx)
    warpgroup.wait_group(0)
    pipeline_qdo.consumer_release(qdo_state)

  @cute.jit
  def mma_swapped(self, mdK: cute.Tensor, mdV: cute.Tensor, sLSE2: cute.Tensor,
                  sDelta: cute.Tensor, tma_atom_dk: cute.CopyAtom, tma_atom_dv: cute.CopyAtom,
                  smem, sdQ: cute.Tensor, tiled_mma_sdp: cute.TiledMma,
                  tiled_mma_dk: cute.TiledMma, tiled_mma_dv: cute.TiledMma,
                  tiled_mma_dq: cute.TiledMma, pipeline_kv, pipeline_qdo,
                  softmax_scale: Float32, n_block: Int32, head_kv: Int32, batch: Int32,
                  group: Int32, m_rot, seqlen_q: Int32, seqlen_k: Int32, masking):
    """mma with swap_sdp: the same loop and epilogue around mma_step_swapped.

    sLSE2 / sDelta: (tile_m, num_stages) lse2 / delta rows of the Q/dO stages (the producer
    copies them with Q and dO).
    """
    tidx, _, _ = cute.arch.thread_idx()
    mma_tidx = tidx - _WG
    sQ, sK, sV, sdO, sdS = smem["sQ"], smem["sK"], smem["sV"], smem["sdO"], smem["sdS"]
    wg_idx = cute.arch.make_warp_uniform(mma_tidx // _WG)
    (thr_sdp, thr_dk, thr_dv, thr_dq), (wg_sdp, wg_dk, wg_dv, wg_dq) = sm90_gemm.mma_slices(
        (tiled_mma_sdp, tiled_mma_dk, tiled_mma_dv, tiled_mma_dq), mma_tidx, wg_idx)
    # S^T = K Q^T and dP^T = V dO^T (K, V are the A operands); dV and dK take A (P^T, dS^T)
    # from registers; dQ = dS K as without the swap, dS from one of ds_stages buffers.
    frags = dict(
        tSrK=wg_sdp.make_fragment_A(wg_sdp.partition_A(sK)),
        tSrQ=wg_sdp.make_fragment_B(wg_sdp.partition_B(sQ)),
        tdPrV=wg_sdp.make_fragment_A(wg_sdp.partition_A(sV)),
        tdPrdO=wg_sdp.make_fragment_B(wg_sdp.partition_B(sdO)),
        tdVrdOt=wg_dv.make_fragment_B(wg_dv.partition_B(sm90_gemm.transpose_view(sdO))),
        tdKrQt=wg_dk.make_fragment_B(wg_dk.partition_B(sm90_gemm.transpose_view(sQ))),
    )
    if const_expr(self.dq_transposed):
      # dQ^T = K^T dS^T: A = K^T (head_dim contiguous: MN-major), B = the dS tile (K-major).
      frags["tdQrdS"] = wg_dq.make_fragment_B(wg_dq.partition_B(sdS))
      frags["tdQrKt"] = wg_dq.make_fragment_A(
          wg_dq.partition_A(sm90_gemm.transpose_view(sK)))
    else:
      frags["tdQrdS"] = wg_dq.make_fragment_A(wg_dq.partition_A(sdS))
      frags["tdQrKt"] = wg_dq.make_fragment_B(
          wg_dq.partition_B(sm90_gemm.transpose_view(sK)))
    acc_dk, acc_dv = self._zeroed_dk_dv(thr_dk, thr_dv)
    # (key, query) coordinates of this thread's S^T values.
    tStS_mn = softmax.make_acc_mn_view(
        thr_sdp.partition_C(cute.make_identity_tensor((self.tile_n, self.tile_m))))
    scale_log2, cap = self._p_scale_and_cap(softmax_scale, masking)

    ids = None
    if const_expr(self.masked):
      # The masked steps compare this thread's key rows' ids with the stage's query ids.
      key_row_ids = cute.make_rmem_tensor(cute.size(tStS_mn, mode=[0]), Int32)
      for i in cutlass.range_constexpr(cute.size(key_row_ids)):
        key_row_ids[i] = masking.key_ids[n_block * self.tile_n + tStS_mn[i, 0][0], batch]
      ids = (key_row_ids, masking.query_ids_smem, masking.window_left, masking.window_right)
    qdo_state = self._wait_for_k_v(pipeline_kv)
    for g in cutlass.range(group, unroll=1):
      if const_expr(self.masked):
        # [m_min, full_lo) and [full_hi, m_max) masked, [full_lo, full_hi) not.
        _, _, _, slot = self._launch_entry(masking)
        m_min = masking.ranges[0, slot, batch]
        m_max = masking.ranges[1, slot, batch]
        full_lo = masking.ranges[2, slot, batch]
        full_hi = masking.ranges[3, slot, batch]
        segments = ((m_min, full_lo, True), (full_lo, full_hi, False), (full_hi, m_max, True))
      else:
        # The query block range, recomputed per head (cheap integer math on kernel
        # parameters).
        m_min, m_max = self._m_block_range(n_block, seqlen_q, seqlen_k)
        m_split = self._first_unmasked_m_block(n_block, m_min, m_max, seqlen_q, seqlen_k)
        segments = ((m_min, m_split, True), (m_split, m_max, False))
      for lo, hi, is_masked in segments:  # a trace-time loop: one step loop per segment
        for step in cutlass.range(lo, hi, unroll=1):
          m_block = step
          if const_expr(not self.masked):
            m_block = self._m_block_at(step, m_rot, m_max)
          self.mma_step_swapped(tiled_mma_sdp, tiled_mma_dk, tiled_mma_dv, tiled_mma_dq,
                                frags, acc_dk, acc_dv, tStS_mn, sdS, sdQ, sLSE2, sDelta,
                                pipeline_qdo, qdo_state, scale_log2, m_block, n_block,
                                seqlen_q, seqlen_k, wg_idx, is_masked, ids, cap,
                                (batch, head_kv * group + g, masking))
          qdo_state.advance()

    self.epilogue(mdK, mdV, tma_atom_dk, tma_atom_dv, sK, sV, tiled_mma_dk, tiled_mma_dv,
                  acc_dk, acc_dv, softmax_scale, n_block, head_kv, batch)

  @cute.jit
  def _ds_transposed(self, acc_s_mn: cute.Tensor, acc_dp_mn: cute.Tensor, tStS_mn: cute.Tensor,
                     sDelta: cute.Tensor, sLSE2: cute.Tensor, stage: Int32, inv_cap_log2,
                     capped: cutlass.Constexpr):
    """dS^T = P^T (dP^T - delta) into acc_dp_mn, delta of the column's query; `capped`: times
    the soft-capping factor 1 - t^2 (softmax.tanh_derivative), in the same pass."""
    for j in cutlass.range_constexpr(cute.size(acc_dp_mn, mode=[1])):
      delta = sDelta[tStS_mn[0, j][1], stage]
      if const_expr(capped):
        lse2 = sLSE2[tStS_mn[0, j][1], stage]
        for i in cutlass.range_constexpr(cute.size(acc_dp_mn, mode=[0])):
          acc_dp_mn[i, j] = (acc_s_mn[i, j] * (acc_dp_mn[i, j] - delta)
                             * softmax.tanh_derivative(acc_s_mn[i, j], lse2, inv_cap_log2))
      else:
        for i in cutlass.range_constexpr(cute.size(acc_dp_mn, mode=[0])):
          acc_dp_mn[i, j] = acc_s_mn[i, j] * (acc_dp_mn[i, j] - delta)

  @cute.jit
  def _for_each_bias(self, bias_tile, tStS_mn: cute.Tensor, sLSE2: cute.Tensor, stage: Int32,
                     body):
    """body(i, j, bias, lse2) over this thread's S^T fragment (rows i, columns j), with the
    score's bias (as Float32, from the step's bias tile: one ldmatrix.trans per 4 columns) and
    its query's lse2 (from the stage's copy of the preprocess output: rows >= seqlen_q hold
    +inf, so P = 0 there)."""
    assert cute.size(tStS_mn, mode=[0]) == 2, "rows r and r + 8 of a warp's 16 keys"
    for c in cutlass.range_constexpr(cute.size(tStS_mn, mode=[1]) // 4):
      values = [bias_tile.unpack(r) for r in bias_tile.load(c)]
      # Fragment block (h, g) -> the register holding it: rows h, columns 2 g + {0, 1}.
      register = {score_bias.x4_register_block(k, c): k for k in range(4)}
      for j in cutlass.range_constexpr(4 * c, 4 * c + 4):
        lse2 = sLSE2[tStS_mn[0, j][1], stage]
        for i in cutlass.range_constexpr(2):
          body(i, j, values[register[(i, j // 2)]][j % 2], lse2)

  @cute.jit
  def _biased_p(self, acc_s_mn: cute.Tensor, tStS_mn: cute.Tensor, sLSE2: cute.Tensor,
                stage: Int32, scale_log2: Float32, bias_tile):
    """P^T = exp2(S' * scale_log2 + bias log2 e - lse2) in place: the bias in the log2 domain,
    one FFMA more than without it."""

    def body(i, j, bias, lse2):
      acc_s_mn[i, j] = cute.math.exp2(acc_s_mn[i, j] * scale_log2 + (bias * LOG2_E - lse2),
                                      fastmath=True)

    self._for_each_bias(bias_tile, tStS_mn, sLSE2, stage, body)

  @cute.jit
  def _ds_transposed_bias(self, acc_s_mn: cute.Tensor, acc_dp_mn: cute.Tensor,
                          tStS_mn: cute.Tensor, sDelta: cute.Tensor, sLSE2: cute.Tensor,
                          stage: Int32, cap, bias_tile, dbias: cute.Tensor, m_block: Int32,
                          n_block: Int32, seqlen_q: Int32, seqlen_k: Int32):
    """_ds_transposed of a bias variant: dS^T = P^T (dP^T - delta), the gradient of the biased
    score, which is dbias; where the call's softcap is on, that is stored here (dbias: the
    (seqlen_q, seqlen_k) view of the step's (batch, head)), and dS then gets the soft-capping
    factor 1 - t^2: P was exp2(t * softcap log2 e + bias log2 e - lse2), so t comes back from
    log2 P with the bias (read again from the tile) taken out. Without softcap the dS tile is
    dbias's tile (_store_dbias_tile)."""
    self._ds_transposed(acc_s_mn, acc_dp_mn, tStS_mn, sDelta, sLSE2, stage, None, False)
    if cap[0] != 0:
      score_bias.write_dbias_transposed(acc_dp_mn, tStS_mn, dbias, m_block * self.tile_m,
                                        n_block * self.tile_n, seqlen_q, seqlen_k, self.dtype)

      def body(i, j, bias, lse2):
        acc_dp_mn[i, j] = acc_dp_mn[i, j] * softmax.tanh_derivative(
            acc_s_mn[i, j], lse2 - bias * LOG2_E, cap[2])

      self._for_each_bias(bias_tile, tStS_mn, sLSE2, stage, body)

  @cute.jit
  def _store_dbias_tile(self, bias, cap, batch: Int32, head: Int32, m_block: Int32,
                        n_block: Int32, ds_stage: Int32):
    """Bias variants without softcap: the step's dS tile (both warpgroups' halves, past the
    dS-full barrier) is dbias's (query block, key block) tile, stored from shared memory by one
    TMA store of the first consumer warp (it waits for the read before the stage's release:
    _wait_dbias_store)."""
    if cap[0] == 0:
      warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
      if warp_idx == _WG // sm90_gemm.WARP_THREADS:
        gdBias = cute.local_tile(bias.dbias_tma[None, None, head, batch],
                                 (self.tile_m, self.tile_n), (m_block, n_block))
        tBsB, tBgB = cpasync.tma_partition(bias.dbias_atom, 0, cute.make_layout(1),
                                           cute.group_modes(bias.smem, 0, 2),
                                           cute.group_modes(gdBias, 0, 2))
        cute.copy(bias.dbias_atom, tBsB[None, ds_stage], tBgB)
        cute.arch.cp_async_bulk_commit_group()

  @cute.jit
  def _wait_dbias_store(self):
    """Bias variants: the first consumer warp waits until its dbias TMA store has read the dS
    buffer (the producer loads a later step's bias tile there once the stage is released)."""
    if const_expr(self.bias):
      warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
      if warp_idx == _WG // sm90_gemm.WARP_THREADS:
        cute.arch.cp_async_bulk_wait_group(0, read=True)

  @cute.jit
  def mma_step_swapped(self, tiled_mma_sdp: cute.TiledMma, tiled_mma_dk: cute.TiledMma,
                       tiled_mma_dv: cute.TiledMma, tiled_mma_dq: cute.TiledMma, frags,
                       acc_dk: cute.Tensor, acc_dv: cute.Tensor, tStS_mn: cute.Tensor,
                       sdS: cute.Tensor, sdQ: cute.Tensor, sLSE2: cute.Tensor,
                       sDelta: cute.Tensor, pipeline_qdo, qdo_state, scale_log2: Float32,
                       m_block: Int32, n_block: Int32, seqlen_q: Int32, seqlen_k: Int32,
                       wg_idx: Int32, is_masked: cutlass.Constexpr, ids=None, cap=None,
                       where=None):
    """mma_step with swap_sdp (FA-3/FA-4's "SdP swapAB" with register-operand dV / dK).

    Each warpgroup computes S^T = K Q^T and dP^T = V dO^T for its 64 keys (rows) x tile_m
    queries (columns), so the row statistics lse2 / delta belong to the fragment's columns.
    The fp32 accumulators are then P^T / dS^T in the register layout of an RS WGMMA A operand:
    dV += P^T dO is issued as soon as P is converted (it runs while dS is computed), or with
    dv_after_ds once dS^T is stored (FA-4's order: at 80 / 128 query columns fp32 S^T, dP^T
    and P^T fit next to dK and dV only while no dV GEMM is in flight); dK += dS^T Q from
    registers too. Only dS goes to shared memory (stmatrix.trans into the (tile_m, tile_n) dS
    tile the dQ = dS K GEMM reads). With two Q stages dS is double buffered by the Q stage
    index: a warpgroup's dQ GEMM of step s has finished before it reaches the dS-full barrier
    of step s + 1, which the other warpgroup passes before it writes the same buffer at step
    s + 2, so the dS-empty barrier goes away. tile_m 80: dQ^T = K^T dS^T instead of dQ = dS K.
    where: (batch, query head, masking) of the step; bias variants read the bias into P and
    write dS (before the softcap's factor) to dbias (kernels/bias.py).
    """
    tidx, _, _ = cute.arch.thread_idx()
    mma_tidx = tidx - _WG
    stage = qdo_state.index
    ds_stage = stage if const_expr(self.ds_stages > 1) else 0
    num_cols = cute.size(tStS_mn, mode=[1])
    acc_shape = tiled_mma_sdp.get_slice(mma_tidx).partition_shape_C((self.tile_n, self.tile_m))
    acc_s = cute.make_rmem_tensor(acc_shape, Float32)
    acc_dp = cute.make_rmem_tensor(acc_shape, Float32)
    pipeline_qdo.consumer_wait(qdo_state)
    sm90_gemm.gemm(tiled_mma_sdp, acc_s, frags["tSrK"], frags["tSrQ"][None, None, None, stage],
                   zero_init=True)
    sm90_gemm.gemm(tiled_mma_sdp, acc_dp, frags["tdPrV"],
                   frags["tdPrdO"][None, None, None, stage], zero_init=True)
    warpgroup.wait_group(1)

    # P^T = exp2(S^T * scale * log2(e) - lse * log2(e)), lse of the column's query.
    acc_s_mn = self._capped_scores(acc_s, cap)
    if const_expr(self.mods is not None):
      # score_mod as in the forward, in every block, before the masks; mask_mod outside the
      # full range (the block mask keeps every pair of a block inside it).
      batch, head, masking = where
      mod_codegen.apply_mods(self.mods, acc_s_mn, tStS_mn, masking.mod_arrays,
                             n_block * self.tile_n, m_block * self.tile_m, seqlen_q, seqlen_k,
                             batch, head, masking.mod_scale, masking.mod_inv_scale,
                             transposed=True, with_mask=is_masked)
    if const_expr(is_masked):
      if const_expr(self.masked):
        # ids: (this thread's key ids, the stages' query ids, window_left, window_right).
        key_row_ids, query_ids_smem, window_left, window_right = ids
        mask.apply_band_and_ids_transposed(acc_s_mn, tStS_mn, m_block, n_block, seqlen_q,
                                           seqlen_k, self.tile_m, self.tile_n, window_left,
                                           window_right, key_row_ids,
                                           query_ids_smem[None, stage])
      else:
        mask.apply_mask_transposed(acc_s_mn, tStS_mn, m_block, n_block, seqlen_q, seqlen_k,
                                   self.tile_m, self.tile_n, self.causal)
    # Per-query statistics of this thread's columns come from the stage's copy of the
    # preprocess output (rows >= seqlen_q hold lse2 = +inf, delta = 0: P = 0 there), read
    # where used: 16 columns per thread, too many to hold both in registers (read into
    # registers before the GEMM wait, as FA-4 does, measured 1-6 % slower).
    bias_tile = None
    if const_expr(self.bias):
      # The step's bias tile sits in its stage's dS buffer; warp w of the consumers holds keys
      # [16 w, 16 w + 16) of the tile.
      consumer_warp = (cute.arch.make_warp_uniform(cute.arch.warp_idx())
                       - _WG // sm90_gemm.WARP_THREADS)
      bias_tile = score_bias.TransposedBiasTile(
          where[2].bias.tiles, ds_stage, consumer_warp * 16, where[2].bias.planes.query_step,
          self.dtype == cutlass.BFloat16)
      self._biased_p(acc_s_mn, tStS_mn, sLSE2, stage, scale_log2, bias_tile)
    else:
      for j in cutlass.range_constexpr(num_cols):
        lse2 = sLSE2[tStS_mn[0, j][1], stage]
        for i in cutlass.range_constexpr(cute.size(acc_s_mn, mode=[0])):
          acc_s_mn[i, j] = cute.math.exp2(acc_s_mn[i, j] * scale_log2 - lse2, fastmath=True)
    # dV += P^T dO, A from registers.
    t_p = cute.make_rmem_tensor(acc_shape, self.dtype)
    r_p = softmax.operand_a_view(t_p)
    # Masked variants with the dV GEMM after dS convert P after dS: the soft-capping factor's
    # extra registers then fit (converted first, P in both precisions spilled).
    late_p = self.masked and self.dv_after_ds
    if const_expr(not late_p):
      softmax.convert_p(acc_s, r_p)
    if const_expr(not self.dv_after_ds):
      # Issued now, it runs while dS is computed.
      self._dv_gemm(tiled_mma_dv, acc_dv, r_p, frags, stage)

    # dS^T = P^T (dP^T - delta); dP (the older group) is done once at most the dV GEMM is
    # pending.
    warpgroup.wait_group(0 if const_expr(self.dv_after_ds) else 1)
    acc_dp_mn = softmax.make_acc_mn_view(acc_dp)
    if const_expr(self.bias):
      batch, head, masking = where
      self._ds_transposed_bias(acc_s_mn, acc_dp_mn, tStS_mn, sDelta, sLSE2, stage, cap,
                               bias_tile, masking.bias.dbias[None, None, head, batch], m_block,
                               n_block, seqlen_q, seqlen_k)
    elif const_expr(self.masked):
      if cap[0] != 0:
        self._ds_transposed(acc_s_mn, acc_dp_mn, tStS_mn, sDelta, sLSE2, stage, cap[2], True)
      else:
        self._ds_transposed(acc_s_mn, acc_dp_mn, tStS_mn, sDelta, sLSE2, stage, None, False)
    else:
      self._ds_transposed(acc_s_mn, acc_dp_mn, tStS_mn, sDelta, sLSE2, stage, None, False)
    if const_expr(self.mods is not None and self.mods_ds_factor != 1.0):
      # d score_mod / d score, a constant: the chain rule's factor on dS.
      for i in cutlass.range_constexpr(cute.size(acc_dp_mn)):
        acc_dp_mn[i] = acc_dp_mn[i] * Float32(self.mods_ds_factor)
    if const_expr(late_p):
      softmax.convert_p(acc_s, r_p)
    t_ds = cute.make_rmem_tensor(acc_shape, self.dtype)
    r_ds = softmax.operand_a_view(t_ds)
    softmax.convert_p(acc_dp, r_ds)
    if const_expr(self.ds_stages == 1):
      # One dS buffer: the other warpgroup's dQ GEMM of the previous step reads all of it.
      cute.arch.barrier(barrier_id=_DS_EMPTY_BARRIER, number_of_threads=self.num_mma_threads)
    sm90_gemm.store_frag_transposed(tiled_mma_sdp, mma_tidx, t_ds,
                                    sm90_gemm.transpose_view(sdS[None, None, ds_stage]))
    if const_expr(self.dv_after_ds):
      # FA-4's place: issued before the stmatrix, ptxas serialized every WGMMA and spilled.
      self._dv_gemm(tiled_mma_dv, acc_dv, r_p, frags, stage)
    # Generic-proxy smem writes must be visible to the async proxy (WGMMA, TMA) of both
    # warpgroups.
    cute.arch.fence_proxy("async.shared", space="cta")
    cute.arch.barrier(barrier_id=_DS_FULL_BARRIER, number_of_threads=self.num_mma_threads)
    if const_expr(self.bias):
      self._store_dbias_tile(where[2].bias, cap, where[0], where[1], m_block, n_block, ds_stage)

    if const_expr(self.dq_transposed):
      acc_dq = cute.make_rmem_tensor(
          tiled_mma_dq.get_slice(mma_tidx).partition_shape_C((self.head_dim, self.tile_m)),
          Float32)
      sm90_gemm.gemm(tiled_mma_dq, acc_dq, frags["tdQrKt"],
                     frags["tdQrdS"][None, None, None, ds_stage], zero_init=True)
    else:
      acc_dq = cute.make_rmem_tensor(
          tiled_mma_dq.get_slice(mma_tidx).partition_shape_C((self.tile_m, self.head_dim)),
          Float32)
      sm90_gemm.gemm(tiled_mma_dq, acc_dq, frags["tdQrdS"][None, None, None, ds_stage],
                     frags["tdQrKt"], zero_init=True)
    sm90_gemm.gemm(tiled_mma_dk, acc_dk, r_ds, frags["tdKrQt"][None, None, None, stage],
                   zero_init=False)
    # Pending: dV, dQ, dK (in that order); dQ is done once only dK may be.
    warpgroup.wait_group(1)
    self.stage_dq(acc_dq, sdQ, wg_idx)
    warpgroup.wait_group(0)
    self._wait_dbias_store()
    # The slot's lse2 / delta rows (and masked: query ids; bias: the bias tile) were read with
    # shared loads.
    sm90_gemm.release_after_lane_loads(pipeline_qdo, qdo_state)

  @cute.jit
  def _dv_gemm(self, tiled_mma_dv: cute.TiledMma, acc_dv: cute.Tensor, r_p: cute.Tensor, frags,
               stage):
    """dV += P^T dO (swap_sdp: P^T from registers, dO^T of the stage from shared memory)."""
    sm90_gemm.gemm(tiled_mma_dv, acc_dv, r_p, frags["tdVrdOt"][None, None, None, stage],
                   zero_init=False)

  @cute.jit
  def stage_dq(self, acc_dq: cute.Tensor, sdQ: cute.Tensor, wg: Int32):
    """Writes this warpgroup's dQ half to its staging buffer for the dQ writer warp.

    In dq_pieces pieces (values [p * n, (p + 1) * n) of every thread: a contiguous run of the
    accumulator layout) when the buffer holds only a piece.
    """
    tidx, _, _ = cute.arch.thread_idx()
    buf = self.tile_m * self.head_dim // _NUM_WG // self.dq_pieces
    per_piece = cute.size(acc_dq) // self.dq_pieces
    bufs = cute.make_tensor(sdQ.iterator, cute.make_layout((buf, _NUM_WG)))
    # This thread's 4-float chunks of its warpgroup's buffer: 128-bit stores, and a warp's 32
    # chunks fill 512 consecutive bytes (conflict-free).
    tdQsdQ = bwd_common.fragment_chunks(bufs[None, wg], tidx % _WG)
    for p in cutlass.range_constexpr(self.dq_pieces):
      # The writer has seen the previous reduction of this buffer read out (bulk read done).
      cute.arch.barrier(barrier_id=_DQ_EMPTY_BARRIER + wg, number_of_threads=_DQ_BARRIER_THREADS)
      piece = cute.make_tensor(acc_dq.iterator + p * per_piece, cute.make_layout(tdQsdQ.shape))
      cute.autovec_copy(piece, tdQsdQ)
      # Generic-proxy smem writes must be visible to the bulk copy (async proxy).
      cute.arch.fence_proxy("async.shared", space="cta")
      cute.arch.barrier_arrive(barrier_id=_DQ_FULL_BARRIER + wg,
                               number_of_threads=_DQ_BARRIER_THREADS)

  @cute.jit
  def store_dq(self, mdQaccum: cute.Tensor, mSem: cute.Tensor, sdQ: cute.Tensor,
               n_block: Int32, head_kv: Int32, batch: Int32, group: Int32, m_min: Int32,
               m_max: Int32, m_rot, seqlen_q: Int32, seqlen_k: Int32, masking):
    """dQ writer warp: adds each staged dQ block into the fp32 accumulator (bwd_common layout).

    Visits the (query head, query block) steps in the consumers' order. Lane 0 issues the bulk
    reductions (bulk-async groups belong to the issuing thread); the whole warp takes part in
    the named barriers.
    """
    lane = cute.arch.lane_idx()
    # Floats of one warpgroup's half of an accumulator block (bwd_common; dq_split_m: a query
    # block holds two 64-row blocks, each staged whole by one warpgroup).
    half = self.dq_rows * self.head_dim // _NUM_WG
    buf = self.tile_m * self.head_dim // _NUM_WG // self.dq_pieces  # floats per staging buffer
    piece = half // self.dq_pieces  # floats per bulk reduction
    # Deterministic: the buffers are handed back for the next step before the wait for this
    # step's writes (the release), so the consumers stage the next dQ block meanwhile.
    early_empty = self.deterministic
    shift, copy_blocks = self._dq_copy_layout(mdQaccum, seqlen_q)
    for g in cutlass.range(group, unroll=1):
      head = head_kv * group + g
      for step in cutlass.range(m_min, m_max, unroll=1):
        m_block = self._m_block_at(step, m_rot, m_max)
        for p in cutlass.range_constexpr(self.dq_pieces):
          if const_expr(early_empty and p == 0):
            if g == 0 and step == m_min:
              self._hand_back_dq_buffers(lane)
          else:
            self._hand_back_dq_buffers(lane)
          if const_expr(p == 0):
            acc_block = self._dq_accum_block(m_block, n_block, shift, copy_blocks)
            rank = None
            gdQ = cute.local_tile(mdQaccum[None, None, head, batch],
                                  (self.tile_m, self.head_dim), (acc_block, 0))
            if const_expr(self.deterministic):
              sem = mSem[None, head, batch].iterator + acc_block
              if const_expr(self.masked):
                rank = masking.ranks[m_block, n_block, batch]
              else:
                rank = self._dq_rank(m_block, n_block, seqlen_q, seqlen_k, shift)
              if lane == 0:
                bwd_common.wait_at_least(sem, rank)
                cute.arch.fence_proxy("async.global")
          for wg in cutlass.range_constexpr(_NUM_WG):
            cute.arch.barrier(barrier_id=_DQ_FULL_BARRIER + wg,
                              number_of_threads=_DQ_BARRIER_THREADS)
            if lane == 0:
              if const_expr(self.dq_split_m):
                # Warpgroup wg staged 64-row block wg whole (both halves, in order).
                self._add_dq(gdQ.iterator + wg * _NUM_WG * half, sdQ.iterator + wg * buf,
                             buf * 4, rank)
              else:
                # Piece p of warpgroup wg's half of the block: floats [p * piece,
                # (p + 1) * piece) of that half.
                self._add_dq(gdQ.iterator + wg * half + p * piece, sdQ.iterator + wg * buf,
                             piece * 4, rank)
              cute.arch.cp_async_bulk_commit_group()
        if const_expr(early_empty):
          if g < group - 1 or step < m_max - 1:
            self._hand_back_dq_buffers(lane)
        if const_expr(self.deterministic):
          if lane == 0:
            # Written (not only read) before the next key block may add to the same floats.
            cute.arch.cp_async_bulk_wait_group(0)
            cute.arch.fence_proxy("async.global")
          # The named barrier orders the landed writes before the release warp's red.release
          # (a release is cumulative). Its previous release must be issued first: a thread
          # may not arrive twice on a barrier before it completes.
          if g > 0 or step > m_min:
            cute.arch.barrier(barrier_id=_DQ_RELEASE_EMPTY_BARRIER,
                              number_of_threads=_DQ_RELEASE_BARRIER_THREADS)
          cute.arch.barrier_arrive(barrier_id=_DQ_RELEASE_FULL_BARRIER,
                                   number_of_threads=_DQ_RELEASE_BARRIER_THREADS)
    # Shared memory must outlive every bulk read of it.
    if lane == 0:
      cute.arch.cp_async_bulk_wait_group(0, read=True)

  @cute.jit
  def _add_dq(self, gmem: cute.Pointer, smem: cute.Pointer, num_bytes: int, rank):
    """One bulk reduction of staged dQ floats into the accumulator; deterministic, the block's
    first contribution in the fixed order (rank 0) is a plain bulk store.
    rank: _dq_rank of the block (None unless deterministic)."""
    if const_expr(self.deterministic):
      bwd_common.bulk_store_or_add_f32(gmem, smem, num_bytes, Int32(rank == 0))
    else:
      bwd_common.bulk_reduce_add_f32(gmem, smem, num_bytes)

  @cute.jit
  def release_dq(self, mdQaccum: cute.Tensor, mSem: cute.Tensor, n_block: Int32,
                 head_kv: Int32, batch: Int32, group: Int32, m_min: Int32, m_max: Int32, m_rot,
                 seqlen_q: Int32):
    """Release warp (deterministic): one semaphore increment per step of store_dq, in its order,
    each once the writer has seen that step's dQ writes land."""
    lane = cute.arch.lane_idx()
    shift, copy_blocks = self._dq_copy_layout(mdQaccum, seqlen_q)
    for g in cutlass.range(group, unroll=1):
      head = head_kv * group + g
      for step in cutlass.range(m_min, m_max, unroll=1):
        m_block = self._m_block_at(step, m_rot, m_max)
        cute.arch.barrier(barrier_id=_DQ_RELEASE_FULL_BARRIER,
                          number_of_threads=_DQ_RELEASE_BARRIER_THREADS)
        if lane == 0:
          acc_block = self._dq_accum_block(m_block, n_block, shift, copy_blocks)
          bwd_common.add_release(mSem[None, head, batch].iterator + acc_block, 1)
        if g < group - 1 or step < m_max - 1:
          cute.arch.barrier_arrive(barrier_id=_DQ_RELEASE_EMPTY_BARRIER,
                                   number_of_threads=_DQ_RELEASE_BARRIER_THREADS)

  @cute.jit
  def _hand_back_dq_buffers(self, lane: Int32):
    """dQ writer: each staging buffer is free again (its pending bulk reduction has read it)."""
    for wg in cutlass.range_constexpr(_NUM_WG):
      # Groups complete in order: the previous reduction out of buffer wg has been read once at
      # most _NUM_WG - 1 - wg groups are pending.
      if lane == 0:
        cute.arch.cp_async_bulk_wait_group(_NUM_WG - 1 - wg, read=True)
      cute.arch.barrier_arrive(barrier_id=_DQ_EMPTY_BARRIER + wg,
                               number_of_threads=_DQ_BARRIER_THREADS)

  def _dq_copy_layout(self, mdQaccum: cute.Tensor, seqlen_q: Int32):
    """(shift, query blocks per copy) of this call's dQ accumulator, copies = 1 << shift: (0,
    None) for a kernel built for one copy, else from the count the scratch shape holds
    (1 or 2, __init__: 2 when the accumulator holds more rows than one copy). Shifts and a
    compare, no division: runtime divisions cost the writer and release warps 96-152 SASS
    instructions and up to 25 R2UR."""
    if self.dq_copies == 1:
      return 0, None
    copy_blocks = cute.ceil_div(seqlen_q, self.tile_m)
    return Int32(mdQaccum.shape[0] > copy_blocks * self.tile_m), copy_blocks

  def _copy_mask(self, shift):
    """copies - 1 (copies = 1 << shift, _dq_copy_layout)."""
    return 0 if self.dq_copies == 1 else (Int32(1) << shift) - 1

  def _copy_div(self, x, shift):
    """x // copies for x >= 0 (copies = 1 << shift, _dq_copy_layout)."""
    return x if self.dq_copies == 1 else x >> shift

  @cute.jit
  def _dq_accum_block(self, m_block: Int32, n_block: Int32, shift, copy_blocks) -> Int32:
    """Block of the dQ accumulator (and semaphore) that key block n_block adds query block
    m_block into: m_block of copy n_block % copies (_dq_copy_layout)."""
    block = m_block
    if const_expr(self.dq_copies > 1):
      block = m_block + (n_block & self._copy_mask(shift)) * copy_blocks
    return block

  @cute.jit
  def _dq_rank(self, m_block: Int32, n_block: Int32, seqlen_q: Int32, seqlen_k: Int32,
               shift) -> Int32:
    """Position of this key block among those adding into query block m_block of its dQ
    accumulator copy, c = n_block % copies (deterministic; copies = 1 << shift,
    _dq_copy_layout).

    The key blocks seen by a query block are exactly [0, n_block_max): without a mask they add
    in ascending order, with the causal mask in descending order (see the class docstring);
    the rank counts only the blocks of copy c before this one. Rotated (_m_rotation): key block
    n reaches query block m at step (m + n) mod M, and they add in that order: ascending n
    where m + N <= M (no step wraps), else the blocks n >= s = M - m (wrapped, steps
    m + n - M) first. With count(x) = the copy-c blocks in [0, x) = (x + copies - 1 - c) //
    copies (count(n_block) = n_block // copies), the rank is count(n) - count(s) for n >= s
    and count(N) - count(s) + count(n) for n < s. Every divided value is >= 0.
    """
    rank = self._copy_div(n_block, shift)
    if const_expr(self.rotate_m):
      num_m, rotates = self._rotates(seqlen_q, seqlen_k)
      num_n = cute.ceil_div(seqlen_k, self.tile_n)
      if rotates and m_block + num_n > num_m:
        mask_bits = self._copy_mask(shift)
        skipped = mask_bits - (n_block & mask_bits)
        rank = (self._copy_div(n_block, shift)
                - self._copy_div(num_m - m_block + skipped, shift))
        if rank < 0:
          rank = rank + self._copy_div(num_n + skipped, shift)
    if const_expr(self.causal):
      n_end = mask.n_block_max(m_block, seqlen_q, seqlen_k, self.tile_m, self.tile_n, True)
      rank = self._copy_div(n_end - 1 - n_block, shift)
    return rank

  @cute.jit
  def epilogue(self, mdK: cute.Tensor, mdV: cute.Tensor, tma_atom_dk: cute.CopyAtom,
               tma_atom_dv: cute.CopyAtom, sK: cute.Tensor, sV: cute.Tensor,
               tiled_mma_dk: cute.TiledMma, tiled_mma_dv: cute.TiledMma, acc_dk: cute.Tensor,
               acc_dv: cute.Tensor, softmax_scale: Float32, n_block: Int32, head_kv: Int32,
               batch: Int32):
    """dK = scale * sum dS^T Q and dV leave through sK / sV and two TMA stores."""
    mma_tidx = bwd_common.fresh_thread_idx() - _WG
    # Every GEMM reading sK / sV (both warpgroups) is done before they are overwritten.
    cute.arch.barrier(barrier_id=_EPILOGUE_BARRIER, number_of_threads=self.num_mma_threads)
    acc_dk.store(acc_dk.load() * softmax_scale)
    sm90_gemm.store_acc_to_smem(tiled_mma_dk, mma_tidx, acc_dk, sK, self.dtype)
    sm90_gemm.store_acc_to_smem(tiled_mma_dv, mma_tidx, acc_dv, sV, self.dtype)
    cute.arch.fence_proxy("async.shared", space="cta")
    cute.arch.barrier(barrier_id=_EPILOGUE_BARRIER, number_of_threads=self.num_mma_threads)

    warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    if warp_idx == _WG // sm90_gemm.WARP_THREADS:
      one_cta = cute.make_layout(1)
      for atom, m, s, dim in ((tma_atom_dk, mdK, sK, self.head_dim),
                              (tma_atom_dv, mdV, sV, self.head_dim_v)):
        g = cute.local_tile(m[None, None, head_kv, batch], (self.tile_n, dim), (n_block, 0))
        t_s, t_g = cpasync.tma_partition(atom, 0, one_cta, cute.group_modes(s, 0, 2),
                                         cute.group_modes(g, 0, 2))
        cute.copy(atom, t_s, t_g)
      cute.arch.cp_async_bulk_commit_group()
      # The copies were issued by an elected lane; the whole warp waits, which covers it.
      cute.arch.cp_async_bulk_wait_group(0, read=True)
