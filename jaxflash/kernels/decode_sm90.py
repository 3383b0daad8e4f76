"""Hopper (sm_90a) split-KV attention of a few query rows over a KV cache, contiguous or paged.

Imports cutlass, jaxflash.config and the sibling helper modules only (never jax).
"""

import dataclasses

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cutlass_dsl import T, dsl_user_op

from jaxflash import config
from jaxflash.kernels import sm90_gemm
from jaxflash.kernels import softmax
from jaxflash.kernels.decode_combine import DecodeCombine
from jaxflash.kernels.fwd_sm90 import FlashAttentionForwardSm90

_select = sm90_gemm.select_modes
DTYPES = sm90_gemm.DTYPES
FP8 = cutlass.Float8E4M3FN
_WARPGROUP_THREADS = sm90_gemm.WARPGROUP_THREADS
# Keys move in boxes of this many rows: the smallest page (a page is a power of two from 16).
# FP8 caches' descales go per this many keys too (_scale_floats).
BOX_ROWS = 16
# Named barrier 1: the consumer warpgroups, after they zeroed V rows past the cache length; 2 + w:
# consumer warpgroup w's turn to issue its GEMMs (ping-pong, the chunked subclass), the
# forward's numbering (fwd_sm90's _scheduler_sync and _scheduler_arrive use these barriers).
_V_TAIL_BARRIER = 1
_SCHEDULER_BARRIER_BASE = 2
# (producer, consumer) registers per thread after setmaxnreg: one consumer warpgroup. The
# warps that convert FP8 caches keep 16-byte loads and their converted bytes in flight with
# their addresses: at 56 registers the variants spilled, so the producer warpgroup and the
# converting one keep 120 (the pool of 384 threads holds 2 x 120 + 256 per thread triple).
_PRODUCER_REGS, _CONSUMER_REGS = 56, 256
_FP8_PRODUCER_REGS = 120
# FP8 caches: warps 1-2 of the producer warpgroup (warp 0 issues the TMA loads, warp 3 idles)
# and a fourth warpgroup, after the consumers, convert the e4m3 blocks, 16 bytes of e4m3 per
# thread and step: six warps, at least one on each sub-partition, two on two of them.
_HEAD_CONVERT_WARPS = 2
_CONVERT_WARPS = _HEAD_CONVERT_WARPS + 4
_CONVERT_THREADS = _CONVERT_WARPS * sm90_gemm.WARP_THREADS
_CHUNK = 16
# The most chunks a converting thread loads before converting them (independent loads in
# flight; each chunk's three addresses and its last step stay in registers).
_CONVERT_GROUP = 4
# Keys of the 8-row swizzle period: a key offset that is a multiple of it adds a constant.
_SWIZZLE_ROWS = 8


def _convert_group(tile_n: int, keys_per_chunk_step: int) -> int:
  """Chunks a converting thread handles per step: g with g * keys_per_chunk_step keys a
  multiple of the swizzle period (so a step adds a constant to every address), at most
  _CONVERT_GROUP, the fewest keys converted past the block's end, then the most chunks."""
  def waste(g):
    keys = g * keys_per_chunk_step
    return -(-tile_n // keys) * keys - tile_n

  groups = [g for g in range(1, _CONVERT_GROUP + 1)
            if (g * keys_per_chunk_step) % _SWIZZLE_ROWS == 0
            and g * keys_per_chunk_step <= tile_n]
  if not groups:
    raise ValueError(f"no conversion group for tile_n {tile_n} and {keys_per_chunk_step} keys "
                     f"per chunk step")
  return min(groups, key=lambda g: (waste(g), -g))


def _swizzle_elems(dtype, major_size: int) -> int:
  """Elements of `dtype` per row of the swizzle atom sm90_gemm.smem_layout picks for a
  contiguous mode of major_size (128-, 64- or 32-byte swizzle): the widest TMA box column."""
  for width_bytes in (128, 64, 32):
    elems = width_bytes * 8 // dtype.width
    if major_size % elems == 0:
      return elems
  raise ValueError(f"contiguous mode of {major_size} elements has no swizzle atom")


def _smem_buffers(variant: config.KernelVariant) -> dict:
  """Shared buffers after the mbarriers, in storage order: {name: (type, count, alignment)}.
  FP8 caches add the e4m3 rings TMA fills (sK8, sV8)."""
  dtype, s = DTYPES[variant.dtype], variant.schedule
  align = sm90_gemm.SMEM_ALIGN
  buffers = dict(sQ=(dtype, s.tile_m * variant.head_dim, align),
                 sK=(dtype, s.num_stages * s.tile_n * variant.head_dim, align),
                 sV=(dtype, s.num_stages * s.tile_n * variant.head_dim_v, align))
  if variant.kv_dtype is not None:
    buffers.update(sK8=(FP8, s.fp8_stages * s.tile_n * variant.head_dim, align),
                   sV8=(FP8, s.fp8_stages * s.tile_n * variant.head_dim_v, align),
                   sScale=(Float32, _scale_floats(variant), 16))
  return buffers


def _scale_floats(variant: config.KernelVariant) -> int:
  """FP8 caches' descale buffer: per 16-bit K stage, the k descales then the v descales of
  the block's 16-key boxes; then the v reference (FlashAttentionDecodeSm90.convert_kv)."""
  s = variant.schedule
  return s.num_stages * 2 * (s.tile_n // BOX_ROWS) + 1


@dsl_user_op
def _ld_shared_v4(addr: Int32, *, loc=None, ip=None):
  """Four 32-bit words from shared memory at byte address addr (16-byte aligned)."""
  res = llvm.inline_asm(
      llvm.StructType.get_literal([T.i32()] * 4), [Int32(addr).ir_value(loc=loc, ip=ip)],
      "ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,r", has_side_effects=True,
      is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
  return [Int32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip)) for i in range(4)]


@dsl_user_op
def _st_shared_v4(addr: Int32, w0: Int32, w1: Int32, w2: Int32, w3: Int32, *, loc=None,
                  ip=None) -> None:
  llvm.inline_asm(
      None, [Int32(x).ir_value(loc=loc, ip=ip) for x in (addr, w0, w1, w2, w3)],
      "st.shared.v4.b32 [$0], {$1, $2, $3, $4};", "r,r,r,r,r", has_side_effects=True,
      is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


# e4m3 -> float16 is exact (cvt.rn.f16x2.e4m3x2: every e4m3 value, subnormals included, is a
# normal float16), and so is float16 -> float32 -> bfloat16 of such a value (3 mantissa bits).
_E4M3X4_TO_F16 = ("{ .reg .b16 lo, hi;\n"
                  "mov.b32 {lo, hi}, $2;\n"
                  "cvt.rn.f16x2.e4m3x2 $0, lo;\n"
                  "cvt.rn.f16x2.e4m3x2 $1, hi; }")
_E4M3X4_TO_BF16 = ("{ .reg .b16 lo, hi, h0, h1, h2, h3;\n"
                   ".reg .b32 p0, p1;\n"
                   ".reg .f32 f0, f1, f2, f3;\n"
                   "mov.b32 {lo, hi}, $2;\n"
                   "cvt.rn.f16x2.e4m3x2 p0, lo;\n"
                   "cvt.rn.f16x2.e4m3x2 p1, hi;\n"
                   "mov.b32 {h0, h1}, p0;\n"
                   "mov.b32 {h2, h3}, p1;\n"
                   "cvt.f32.f16 f0, h0;\n"
                   "cvt.f32.f16 f1, h1;\n"
                   "cvt.f32.f16 f2, h2;\n"
                   "cvt.f32.f16 f3, h3;\n"
                   "cvt.rn.bf16x2.f32 $0, f1, f0;\n"  # the first source goes to the high half
                   "cvt.rn.bf16x2.f32 $1, f3, f2; }")


@dsl_user_op
def _e4m3x4_to_16bit(word: Int32, bf16: bool, *, loc=None, ip=None):
  """Four e4m3 bytes (the lowest first) -> two words of two 16-bit values each (float16 or
  bfloat16), in the same order."""
  res = llvm.inline_asm(
      llvm.StructType.get_literal([T.i32()] * 2), [Int32(word).ir_value(loc=loc, ip=ip)],
      _E4M3X4_TO_BF16 if bf16 else _E4M3X4_TO_F16, "=r,=r,r", has_side_effects=False,
      is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
  return [Int32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip)) for i in range(2)]


class FlashAttentionDecodeSm90(FlashAttentionForwardSm90):
  """Attention of each sequence's new query tokens over its cached keys, split across CTAs.

  Query rows come packed (pack-GQA): the group of query heads sharing kv head h is one matrix
  of seqlen_q * group rows (row i * group + j: token i, query head h * group + j), so a tile of
  64 rows reads each key once for the whole group. CTA (m_block, split, batch * kv_heads + h)
  takes rows [64 m_block, 64 m_block + 64) and the split-th of num_splits equal runs of the key
  blocks the rows can see (from the sequence's length, read at run time, so work and bytes
  follow the valid lengths); it writes its rows' partial output (normalised over its keys) and
  lse in float32 (a split with no key writes 0 and lse -inf); a second kernel of the same call
  (DecodeCombine) merges each row's splits through their lse, with the learnable sink, into
  the output in the query dtype and its lse. With one split (num_splits, a run-time extent:
  large batches, short caches) each CTA sees all of its rows' keys and writes the output and
  lse itself (epilogue_final, as the chunked tiles do): the merge kernel is not launched and
  the float32 partials are neither written nor read.

  Keys are read through a page table: logical key p of sequence b is row p % page_size of page
  page_table[b, p / page_size] of the pool (a contiguous cache is a pool of `batch` pages of
  max_len rows with a page table of no column: sequence b is page b). When every key block
  lies in one page (a contiguous cache, or pages a multiple of tile_n) the producer warp
  copies each K / V block whole, with one page-table read; smaller pages (16 to tile_n / 2
  keys, powers of two) go in boxes of 16 keys, whose page-table reads are issued together
  before their copies, and boxes at or past the sequence's length become out-of-bounds TMA
  boxes (zero-filled, no memory read). Table
  entries are clamped into the pool. Query token i of a sequence of length L sits at position
  L - seqlen_q + i and sees the keys p with pos - window_left <= p <= pos + window_right
  (causal: window_right = 0) and p < L; soft-capping as in the masked forward. The consumer
  warpgroup runs the forward's S / softmax / PV overlap (FlashAttentionForwardSm90) on 64 x
  tile_n blocks, masking only blocks that cross a bound.

  FP8 caches (variant.kv_dtype): TMA copies the e4m3 blocks into rings of their own
  (schedule.fp8_stages deep), six converting warps (warps 1-2 of the producer warpgroup and a
  warpgroup after the consumers) convert each block exactly into the 16-bit rings the GEMMs
  read (the query's dtype), in the producer's order, and put each K block's 16-key boxes'
  descales beside its 16-bit stage (convert_kv); the consumers scale each key's scores by its
  k descale before the softmax and its P by its v descale (over a reference) after it (the row
  sums keep the unscaled P), float32 descales per (page, kv head): key j is k[...] *
  k_descale[its page, kv head]. A contiguous cache's page is its sequence.
  """

  # Heights (keys) of the TMA boxes that load pages smaller than a key block, widest first; the
  # last is BOX_ROWS, the smallest page. The producer takes the widest that divides the page
  # size (load_decode's rows). One height here; the chunked subclass has 64-key boxes too.
  box_rows = (BOX_ROWS,)

  def __init__(self, variant: config.KernelVariant):
    schedule = variant.schedule
    self.variant = variant
    self.dtype = DTYPES[variant.dtype]
    self.out_dtype = Float32
    self.head_dim = variant.head_dim
    self.head_dim_v = variant.head_dim_v
    self.head_dim_padded = (variant.head_dim + 15) // 16 * 16
    self.tile_m = schedule.tile_m
    self.tile_n = schedule.tile_n
    self.num_stages = schedule.num_stages
    self.q_stages = 1
    # 64 query rows per consumer warpgroup: one here, two in the chunked subclass.
    assert self.tile_m % 64 == 0 and self.box_rows[-1] == BOX_ROWS, (schedule, self.box_rows)
    assert all(self.tile_n % rows == 0 for rows in self.box_rows), (schedule, self.box_rows)
    self.causal = False  # run-time: window_right
    self.num_mma_warpgroups = self.tile_m // 64
    self.num_mma_threads = self.num_mma_warpgroups * _WARPGROUP_THREADS
    self.num_threads = self.num_mma_threads + _WARPGROUP_THREADS
    self.num_producer_regs, self.num_mma_regs = _PRODUCER_REGS, _CONSUMER_REGS
    if variant.kv_dtype is not None:
      self.num_producer_regs = _FP8_PRODUCER_REGS
      self.num_threads += _WARPGROUP_THREADS  # the converting warpgroup
    self.pingpong = False
    self.persistent = False
    self.lpt = False
    self.rescale_o_before_pv = variant.head_dim_v > 128
    # No side buffer rides the K stages: K is released as soon as its GEMM is done.
    self.masked = False
    self.bias = False
    self.mods = None
    self.fixed_capped_max = False  # the running max, soft-capped or not (_softmax)
    self.tiles_from_last_row = False
    self.fp8_cache = variant.kv_dtype is not None
    self.fp8_stages = schedule.fp8_stages
    self.kv_dtype = FP8 if self.fp8_cache else self.dtype  # what TMA copies
    self.k_box_cols = _swizzle_elems(self.kv_dtype, self.head_dim)
    self.v_box_rows = _swizzle_elems(self.kv_dtype, self.head_dim_v)

  @staticmethod
  def smem_bytes(variant: config.KernelVariant) -> int:
    """Shared memory of one CTA: mbarriers, Q, the K and V rings, alignment."""
    return sm90_gemm.smem_bytes(_smem_buffers(variant))

  @staticmethod
  def can_implement(variant: config.KernelVariant) -> tuple[bool, str]:
    ok, reason = sm90_gemm.variant_support(variant, "decode")
    if ok and variant.schedule.chunked:
      return False, f"variant {variant.key} is a chunked-prefill one (kernels/chunked_sm90.py)"
    if ok and variant.kv_dtype is not None:
      ok, reason = config.decode_fp8_support(variant.dtype, variant.head_dim, variant.head_dim_v)
    return ok, reason

  def _setup_attributes(self):
    """Tiled MMAs, shared layouts (the rings and the 16-key boxes TMA fills), byte counts."""
    k_major, mn_major = warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN
    # One 64 x N WGMMA atom per consumer warpgroup, stacked along M.
    atoms = (self.num_mma_warpgroups, 1, 1)
    self.tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
        self.dtype, self.dtype, k_major, k_major, Float32, atoms, (64, self.tile_n))
    self.tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
        self.dtype, self.dtype, k_major, mn_major, Float32, atoms, (64, self.head_dim_v),
        a_source=warpgroup.OperandSource.RMEM)
    self.sQ_layout = sm90_gemm.smem_layout(self.dtype, self.tile_m, self.head_dim)
    self.sK_layout = sm90_gemm.smem_layout(self.dtype, self.tile_n, self.head_dim,
                                           self.num_stages)
    self.sV_layout = sm90_gemm.smem_layout(self.dtype, self.head_dim_v, self.tile_n,
                                           self.num_stages, col_major=True)
    # The rings TMA fills: the 16-bit ones, or the e4m3 ones of FP8 caches.
    self.sK_load_layout, self.sV_load_layout = self.sK_layout, self.sV_layout
    pipelines = dict(mbar_q=1, mbar_k=self.num_stages, mbar_v=self.num_stages)
    tiles = dict(sQ=(self.sQ_layout,), sK=(self.sK_layout,), sV=(self.sV_layout,))
    if const_expr(self.fp8_cache):
      self.sK_load_layout = sm90_gemm.smem_layout(FP8, self.tile_n, self.head_dim,
                                                  self.fp8_stages)
      self.sV_load_layout = sm90_gemm.smem_layout(FP8, self.head_dim_v, self.tile_n,
                                                  self.fp8_stages, col_major=True)
      pipelines.update(mbar_k8=self.fp8_stages, mbar_v8=self.fp8_stages)
      tiles.update(sK8=(self.sK_load_layout,), sV8=(self.sV_load_layout,))
    # One TMA box per height of box_rows: that many keys by one swizzle atom's width of the head
    # dim. Inside a ring stage such a box sits at a multiple of the swizzle period, with exactly
    # this layout.
    self.sK_boxes = tuple(sm90_gemm.smem_layout(self.kv_dtype, rows, self.k_box_cols)
                          for rows in self.box_rows)
    self.sV_boxes = tuple(sm90_gemm.smem_layout(self.kv_dtype, self.v_box_rows, rows,
                                                col_major=True) for rows in self.box_rows)
    self.tma_bytes_q = cute.size_in_bytes(self.dtype, self.sQ_layout)
    self.tma_bytes_k = self.tile_n * self.head_dim * self.kv_dtype.width // 8
    self.tma_bytes_v = self.tile_n * self.head_dim_v * self.kv_dtype.width // 8
    self.shared_storage = sm90_gemm.shared_storage(pipelines, _smem_buffers(self.variant), tiles)

  @cute.jit
  def __call__(
      self,
      mQ: cute.Tensor,  # (batch, num_kv_heads, rows, head_dim): rows = seqlen_q * group
      mK: cute.Tensor,  # (num_pages, page_size, num_kv_heads, head_dim): q's dtype, or e4m3
      mV: cute.Tensor,  # (num_pages, page_size, num_kv_heads, head_dim_v): as k
      mPageTable: cute.Tensor,  # (batch, max_pages) int32; no column: contiguous caches
      mLengths: cute.Tensor,  # (batch,) int32 valid keys per sequence
      mSink: cute.Tensor,  # (num_kv_heads, group or 0: none) float32 learnable sinks
      mOPart: cute.Tensor,  # (batch, num_splits, num_kv_heads, rows, head_dim_v) float32
      mLSEPart: cute.Tensor,  # (batch, num_splits, num_kv_heads, rows) float32
      mO: cute.Tensor,  # (batch, num_kv_heads, rows, head_dim_v) in q's dtype
      mLSE: cute.Tensor,  # (batch, num_kv_heads, rows) float32
      mKDescale: cute.Tensor,  # FP8 caches: (num_pages, num_kv_heads) float32; else unread
      mVDescale: cute.Tensor,  # the same for v
      softmax_scale: Float32,
      seqlen_q: Int32,  # query tokens per sequence (rows / group)
      window_left: Int32,  # keys visible left of a query's position (config.WINDOW_UNBOUNDED)
      window_right: Int32,  # keys visible right of it: 0 is causal
      softcap: Float32,  # > 0: scores become softcap * tanh(s / softcap); 0: off
      stream: cuda.CUstream,
  ):
    if const_expr(not (mQ.element_type == self.dtype
                       and mK.element_type == mV.element_type == self.kv_dtype)):
      raise TypeError(f"q must be {self.dtype}, k and v {self.kv_dtype}")
    if const_expr(mOPart.element_type != Float32 or mLSEPart.element_type != Float32
                  or mLSE.element_type != Float32 or mSink.element_type != Float32
                  or mKDescale.element_type != Float32 or mVDescale.element_type != Float32):
      raise TypeError("the partial out and lse, the lse, the sink and the descales must be "
                      "Float32")
    if const_expr(mO.element_type != self.dtype):
      raise TypeError(f"out must be {self.dtype}")
    self._setup_attributes()
    # Kernel order puts the tile modes first.
    mQ = _select(mQ, [2, 3, 1, 0])  # (rows, head_dim, kv heads, batch)
    mK = _select(mK, [1, 3, 2, 0])  # (page_size, head_dim, kv heads, pages)
    mVt = _select(mV, [3, 1, 2, 0])  # (head_dim_v, page_size, kv heads, pages)
    load_op = cpasync.CopyBulkTensorTileG2SOp()
    tma_atom_q, tma_q = cpasync.make_tiled_tma_atom(
        load_op, mQ, self.sQ_layout, (self.tile_m, self.head_dim))
    # Boxes of the one height this class has (the chunked subclass launches its own).
    tma_atom_k, tma_k = cpasync.make_tiled_tma_atom(
        load_op, mK, self.sK_boxes[0], (BOX_ROWS, self.k_box_cols))
    tma_atom_v, tma_v = cpasync.make_tiled_tma_atom(
        load_op, mVt, self.sV_boxes[0], (self.v_box_rows, BOX_ROWS))
    # Whole key blocks, when every block lies in one page.
    tma_atom_kt, tma_kt = cpasync.make_tiled_tma_atom(
        load_op, mK, cute.slice_(self.sK_load_layout, (None, None, 0)),
        (self.tile_n, self.head_dim))
    tma_atom_vt, tma_vt = cpasync.make_tiled_tma_atom(
        load_op, mVt, cute.slice_(self.sV_load_layout, (None, None, 0)),
        (self.head_dim_v, self.tile_n))
    grid = (cute.ceil_div(mQ.shape[0], self.tile_m), mOPart.shape[1],
            mQ.shape[3] * mQ.shape[2])
    self.kernel(
        tma_q, tma_k, tma_v, tma_kt, tma_vt, tma_atom_q, tma_atom_k, tma_atom_v, tma_atom_kt,
        tma_atom_vt, mPageTable, mLengths,
        mSink, mOPart, mLSEPart, mO, mLSE, mKDescale, mVDescale, softmax_scale, seqlen_q,
        window_left, window_right, softcap, self.sQ_layout, self.sK_layout, self.sV_layout,
        self.sK_load_layout, self.sV_load_layout, self.tiled_mma_qk, self.tiled_mma_pv,
    ).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream, min_blocks_per_mp=1)
    # One split writes out and lse itself (epilogue_final): nothing to merge.
    if mOPart.shape[1] > 1:
      DecodeCombine(self.dtype, self.head_dim_v)(mOPart, mLSEPart, mSink, mO, mLSE, stream)

  @cute.kernel
  def kernel(
      self,
      mQ: cute.Tensor,  # TMA coordinates of (rows, head_dim, kv heads, batch)
      mK: cute.Tensor,  # TMA coordinates of (page_size, head_dim, kv heads, pages)
      mV: cute.Tensor,  # TMA coordinates of (head_dim_v, page_size, kv heads, pages)
      mKt: cute.Tensor,  # the same coordinates as mK, for whole-block copies
      mVt: cute.Tensor,  # the same coordinates as mV, for whole-block copies
      tma_atom_q: cute.CopyAtom,
      tma_atom_k: cute.CopyAtom,
      tma_atom_v: cute.CopyAtom,
      tma_atom_kt: cute.CopyAtom,
      tma_atom_vt: cute.CopyAtom,
      mPageTable: cute.Tensor,
      mLengths: cute.Tensor,
      mSink: cute.Tensor,
      mOPart: cute.Tensor,
      mLSEPart: cute.Tensor,
      mO: cute.Tensor,
      mLSE: cute.Tensor,
      mKDescale: cute.Tensor,
      mVDescale: cute.Tensor,
      softmax_scale: Float32,
      seqlen_q: Int32,
      window_left: Int32,
      window_right: Int32,
      softcap: Float32,
      sQ_layout: cute.ComposedLayout,
      sK_layout: cute.ComposedLayout,
      sV_layout: cute.ComposedLayout,
      sK_load_layout: cute.ComposedLayout,  # the ring TMA fills: sK_layout, or e4m3 (FP8)
      sV_load_layout: cute.ComposedLayout,
      tiled_mma_qk: cute.TiledMma,
      tiled_mma_pv: cute.TiledMma,
  ):
    tidx, _, _ = cute.arch.thread_idx()
    warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    sm90_gemm.prefetch_descriptors(warp_idx, (tma_atom_q, tma_atom_k, tma_atom_v, tma_atom_kt,
                                              tma_atom_vt))
    storage = cutlass.utils.SmemAllocator().allocate(self.shared_storage)
    pipeline_q, pipeline_k, pipeline_v, pipeline_k8, pipeline_v8 = self._decode_pipelines(
        storage)
    sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
    sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
    sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
    # The rings TMA fills (FP8 caches: the e4m3 ones, with their own pipelines).
    sK_load, sV_load, pipeline_k_load, pipeline_v_load = sK, sV, pipeline_k, pipeline_v
    if const_expr(self.fp8_cache):
      sK_load = storage.sK8.get_tensor(sK_load_layout.outer, swizzle=sK_load_layout.inner)
      sV_load = storage.sV8.get_tensor(sV_load_layout.outer, swizzle=sV_load_layout.inner)
      pipeline_k_load, pipeline_v_load = pipeline_k8, pipeline_v8
    # Soft-capping: the S registers hold t = tanh(S * scale / softcap), so the softmax scale
    # becomes softcap.
    capped = softcap > Float32(0.0)
    tanh_scale = Float32(0.0)
    if capped:
      tanh_scale = softmax_scale / softcap
      softmax_scale = softcap
    cute.arch.mbarrier_init_fence()
    cute.arch.sync_threads()

    m_block, split, batch_head = cute.arch.block_idx()
    num_kv_heads = mQ.shape[2]
    batch = batch_head // num_kv_heads
    head_kv = batch_head - batch * num_kv_heads
    work = self._work(mQ.shape[0], mK.shape[0], mPageTable, mLengths, mOPart.shape[1],
                      m_block, split, batch, seqlen_q, window_left, window_right)
    warpgroup_idx = cute.arch.make_warp_uniform(tidx // _WARPGROUP_THREADS)
    converting_wg = self.num_mma_warpgroups + 1  # FP8 caches: the last warpgroup
    producing = warpgroup_idx == 0
    if const_expr(self.fp8_cache):
      producing = producing | (warpgroup_idx == converting_wg)
    if producing:
      cute.arch.setmaxregister_decrease(self.num_producer_regs)
      if warp_idx == 0:
        self.load_decode(mQ, mK, mV, mKt, mVt, tma_atom_q, tma_atom_k, tma_atom_v,
                         tma_atom_kt, tma_atom_vt, sQ, sK_load, sV_load, pipeline_q,
                         pipeline_k_load, pipeline_v_load, mPageTable, work, m_block, head_kv,
                         batch, BOX_ROWS)
      if const_expr(self.fp8_cache):
        # Converting thread index: warps 1-2 first, then the converting warpgroup.
        thread = Int32(-1)
        if warpgroup_idx == converting_wg:
          thread = tidx - converting_wg * _WARPGROUP_THREADS + (
              _HEAD_CONVERT_WARPS * sm90_gemm.WARP_THREADS)
        elif (warp_idx > 0) & (warp_idx <= _HEAD_CONVERT_WARPS):
          thread = tidx - sm90_gemm.WARP_THREADS
        if thread >= 0:
          paging = self._paging(mPageTable, mK.shape[0], mK.shape[3], work, head_kv, batch)
          self.convert_kv(storage.sK8.data_ptr(), sK_load_layout, storage.sV8.data_ptr(),
                          sV_load_layout, storage.sK.data_ptr(), sK_layout,
                          storage.sV.data_ptr(), sV_layout, pipeline_k8, pipeline_v8,
                          pipeline_k, pipeline_v, work, thread,
                          _Descales(k=mKDescale, v=mVDescale, paging=paging,
                                    scales=self._scale_tensor(storage)))
    else:
      cute.arch.setmaxregister_increase(self.num_mma_regs)
      scales = None
      if const_expr(self.fp8_cache):
        scales = self._scale_tensor(storage)
      self.mma_decode(mOPart, mLSEPart, mSink, mO, mLSE, sQ, sK, sV, tiled_mma_qk,
                      tiled_mma_pv, pipeline_q, pipeline_k, pipeline_v, softmax_scale,
                      Int32(capped), tanh_scale, work, m_block, split, head_kv, batch,
                      seqlen_q, window_left, window_right, mQ.shape[0], scales)

  def _scale_tensor(self, storage) -> cute.Tensor:
    """FP8 caches' descale buffer (_scale_floats) as (2 * boxes, num_stages + 1): a column per
    16-bit K stage, the v reference at [0, num_stages]."""
    boxes = self.tile_n // BOX_ROWS
    return storage.sScale.get_tensor(cute.make_layout((2 * boxes, self.num_stages + 1)))

  def _decode_pipelines(self, storage):
    """(Q, K, V, e4m3 K, e4m3 V) pipelines: without FP8 caches the forward's three
    (_make_pipelines) and two Nones. FP8 caches: TMA fills the e4m3 rings (one elected producer
    thread), whose consumers are the converting warps (released per warp), and the 16-bit rings
    are PipelineAsync between the converting threads (producers, each arriving) and the
    consumer warpgroup's threads (Q as the forward's)."""
    if const_expr(not self.fp8_cache):
      return (*self._make_pipelines(storage), None, None)
    thread = pipeline.Agent.Thread
    producer = pipeline.CooperativeGroup(thread, 1)
    converters = pipeline.CooperativeGroup(thread, _CONVERT_WARPS)

    def tma(mbar, stages, tx, consumers):
      return pipeline.PipelineTmaAsync.create(
          barrier_storage=mbar.data_ptr(), num_stages=stages, producer_group=producer,
          consumer_group=consumers, tx_count=tx, defer_sync=True)

    def converted(mbar):
      return pipeline.PipelineAsync.create(
          barrier_storage=mbar.data_ptr(), num_stages=self.num_stages,
          producer_group=pipeline.CooperativeGroup(thread, _CONVERT_THREADS),
          consumer_group=pipeline.CooperativeGroup(thread, self.num_mma_threads),
          defer_sync=True)

    return (tma(storage.mbar_q, 1, self.tma_bytes_q, producer), converted(storage.mbar_k),
            converted(storage.mbar_v),
            tma(storage.mbar_k8, self.fp8_stages, self.tma_bytes_k, converters),
            tma(storage.mbar_v8, self.fp8_stages, self.tma_bytes_v, converters))

  @cute.jit
  def _work(self, rows: Int32, page_size: Int32, mPageTable: cute.Tensor, mLengths: cute.Tensor,
            num_splits: Int32, m_block: Int32, split: Int32, batch: Int32, seqlen_q: Int32,
            window_left: Int32, window_right: Int32):
    """This CTA's share of the keys, the same in the producer and the consumers.

    Returns a _Work: the sequence's length (clamped to [0, the table's capacity]), the key
    blocks [n_start, n_end) of this split, [full_lo, full_hi): the blocks every row of the
    tile sees whole (no elementwise mask), and whether every key block lies in one page (pages
    a multiple of tile_n, or one page per sequence: a contiguous cache). A page table of no
    column is a contiguous cache: sequence b is page b.
    """
    capacity = cutlass.max(mPageTable.shape[1], Int32(1)) * page_size
    whole_blocks = Int32(0)
    if page_size % self.tile_n == 0:
      whole_blocks = Int32(1)
    if mPageTable.shape[1] <= 1:
      whole_blocks = Int32(1)
    length = cutlass.min(cutlass.max(mLengths[batch], Int32(0)), capacity)
    group = rows // seqlen_q
    first_row = m_block * self.tile_m
    last_row = cutlass.min(first_row + self.tile_m, rows) - 1
    # Positions of the tile's first and last query tokens.
    pos_lo = length - seqlen_q + first_row // group
    pos_hi = length - seqlen_q + last_row // group
    key_lo = cutlass.max(pos_lo - window_left, Int32(0))
    key_hi = cutlass.min(pos_hi + window_right + 1, length)  # one past the last visible key
    n_lo = key_lo // self.tile_n
    n_hi = n_lo
    if key_hi > key_lo:
      n_hi = (key_hi + self.tile_n - 1) // self.tile_n
    per_split = (n_hi - n_lo + num_splits - 1) // num_splits
    n_start = cutlass.min(n_lo + split * per_split, n_hi)
    n_end = cutlass.min(n_start + per_split, n_hi)
    full_hi = cutlass.max(cutlass.min(pos_lo + window_right + 1, length), Int32(0)) // self.tile_n
    full_lo = (cutlass.max(pos_hi - window_left, Int32(0)) + self.tile_n - 1) // self.tile_n
    return _Work(length=length, n_start=n_start, n_end=n_end, full_lo=full_lo, full_hi=full_hi,
                 whole_blocks=whole_blocks)

  @cute.jit
  def load_decode(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mKt: cute.Tensor,
                  mVt: cute.Tensor, tma_atom_q: cute.CopyAtom, tma_atom_k: cute.CopyAtom,
                  tma_atom_v: cute.CopyAtom, tma_atom_kt: cute.CopyAtom,
                  tma_atom_vt: cute.CopyAtom, sQ: cute.Tensor, sK: cute.Tensor, sV: cute.Tensor,
                  pipeline_q, pipeline_k, pipeline_v, mPageTable: cute.Tensor, work,
                  m_block: Int32, head_kv: Int32, batch: Int32, rows: cutlass.Constexpr):
    """Producer warp: K(n_end-1), Q, then K(n-1), V(n) down the split, then V(n_start) (the
    consumers' overlap order, as the forward's producer). tma_atom_k / tma_atom_v copy boxes
    of `rows` keys (a height of box_rows that divides the page size), for pages smaller than a
    key block."""
    one_cta = cute.make_layout(1)
    gQ = cute.local_tile(mQ[None, None, head_kv, batch], (self.tile_m, self.head_dim),
                         (m_block, 0))
    tQsQ, tQgQ = cpasync.tma_partition(
        tma_atom_q, 0, one_cta, cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2))
    # Boxes: (rows keys, k_box_cols) of K, (v_box_rows, rows keys) of V^T; whole blocks:
    # (tile_n, head_dim) of K, (head_dim_v, tile_n) of V^T.
    box_k = (rows, self.k_box_cols)
    box_v = (self.v_box_rows, rows)
    tKsK, tKgK = cpasync.tma_partition(
        tma_atom_k, 0, one_cta, cute.group_modes(cute.flat_divide(sK, box_k), 0, 2),
        cute.group_modes(cute.flat_divide(mK, box_k), 0, 2))
    tVsV, tVgV = cpasync.tma_partition(
        tma_atom_v, 0, one_cta, cute.group_modes(cute.flat_divide(sV, box_v), 0, 2),
        cute.group_modes(cute.flat_divide(mV, box_v), 0, 2))
    tKsKt, tKgKt = cpasync.tma_partition(
        tma_atom_kt, 0, one_cta, cute.group_modes(sK, 0, 2),
        cute.group_modes(cute.flat_divide(mKt, (self.tile_n, self.head_dim)), 0, 2))
    tVsVt, tVgVt = cpasync.tma_partition(
        tma_atom_vt, 0, one_cta, cute.group_modes(sV, 0, 2),
        cute.group_modes(cute.flat_divide(mVt, (self.head_dim_v, self.tile_n)), 0, 2))
    k_copy = _BlockCopy(rows, tma_atom_k, tKgK, tKsK, tma_atom_kt, tKgKt, tKsKt)
    v_copy = _BlockCopy(rows, tma_atom_v, tVgV, tVsV, tma_atom_vt, tVgVt, tVsVt)
    paging = self._paging(mPageTable, mK.shape[0], mK.shape[3], work, head_kv, batch)
    q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
    kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
    n_start, n_end = work.n_start, work.n_end
    if n_end > n_start:
      pipeline_k.producer_acquire(kv_state)
      self._load_block(k_copy, pipeline_k, kv_state, paging, n_end - 1, True)
    pipeline_q.producer_acquire(q_state)
    cute.copy(tma_atom_q, tQgQ, tQsQ, tma_bar_ptr=pipeline_q.producer_get_barrier(q_state))
    for i in cutlass.range(n_end - 1 - n_start, unroll=1):
      n_block = n_end - 1 - i
      v_state = kv_state.clone()
      kv_state.advance()
      pipeline_k.producer_acquire(kv_state)
      self._load_block(k_copy, pipeline_k, kv_state, paging, n_block - 1, True)
      pipeline_v.producer_acquire(v_state)
      self._load_block(v_copy, pipeline_v, v_state, paging, n_block, False)
    if n_end > n_start:
      pipeline_v.producer_acquire(kv_state)
      self._load_block(v_copy, pipeline_v, kv_state, paging, n_start, False)

  @cute.jit
  def convert_kv(self, k8_ptr: cute.Pointer, sK8_layout: cute.ComposedLayout,
                 v8_ptr: cute.Pointer, sV8_layout: cute.ComposedLayout, k_ptr: cute.Pointer,
                 sK_layout: cute.ComposedLayout, v_ptr: cute.Pointer,
                 sV_layout: cute.ComposedLayout, pipeline_k8, pipeline_v8, pipeline_k,
                 pipeline_v, work, thread: Int32, descales):
    """The converting warps (FP8 caches; thread: 0-191 among them): each e4m3 K / V block
    TMA filled becomes a 16-bit block of the ring the consumers' GEMMs read, in the producer's
    order (K(n_end - 1), then K(n - 1) before V(n), then V(n_start)). With each K block go its
    boxes' k and v descales (the latter over the v reference), into the descale buffer's
    column of the 16-bit K stage; the v reference, 1 / (the v descale of the split's first
    key, or 1 where that is not positive and finite), goes to its own slot first.

    P is scaled by v descale / v reference and O by the reference at the end: P times a
    descale of 1e-3 would put small probabilities below float16's normal range (2^-14), P
    times such a ratio (1 where every key shares a descale: contiguous caches) keeps them in
    it."""
    scales, paging = descales.scales, descales.paging
    k8_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.fp8_stages)
    v8_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.fp8_stages)
    k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
    v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
    k_ring = (k8_ptr, sK8_layout, k_ptr, sK_layout, pipeline_k8, pipeline_k,
              self._convert_plan(sK8_layout, sK_layout, True, thread))
    v_ring = (v8_ptr, sV8_layout, v_ptr, sV_layout, pipeline_v8, pipeline_v,
              self._convert_plan(sV8_layout, sV_layout, False, thread))
    n_start, n_end = work.n_start, work.n_end
    if n_end > n_start:
      reference = Float32(1.0)
      first = descales.v[self._page(paging, (n_end - 1) * self.tile_n // paging.page_size),
                         paging.head_kv]
      if first > Float32(0.0):
        if first < Float32.inf:
          reference = first
      if thread == 0:  # published with the first K stage (its commit releases the write)
        scales[0, self.num_stages] = reference
      v_factor = Float32(1.0) / reference
      scale = self._block_descale(descales, n_end - 1, v_factor, thread)
      self._convert_block(k_ring, k8_state, k_state, True, thread, (scales, scale))
      k8_state.advance()
      k_state.advance()
      for i in cutlass.range(n_end - 1 - n_start, unroll=1):
        scale = self._block_descale(descales, n_end - 2 - i, v_factor, thread)
        self._convert_block(k_ring, k8_state, k_state, True, thread, (scales, scale))
        k8_state.advance()
        k_state.advance()
        self._convert_block(v_ring, v8_state, v_state, False, thread)
        v8_state.advance()
        v_state.advance()
      self._convert_block(v_ring, v8_state, v_state, False, thread)

  @cute.jit
  def _block_descale(self, descales, n_block: Int32, v_factor: Float32,
                     thread: Int32) -> Float32:
    """Thread b < boxes of the converting warps: the k descale of box b of key block n_block;
    thread boxes + b: its v descale times v_factor (others: unused). A box's descale is that
    of the page holding its first key (one per block where pages hold whole blocks); read
    before the block's conversion waits, stored once its 16-bit K stage is free
    (_convert_block)."""
    boxes = self.tile_n // BOX_ROWS
    paging = descales.paging
    box = thread % boxes
    page = self._page(paging, (n_block * self.tile_n + box * BOX_ROWS) // paging.page_size)
    value = descales.k[page, paging.head_kv]
    if thread >= boxes:
      value = descales.v[page, paging.head_kv] * v_factor
    return value

  def _convert_plan(self, src_layout: cute.ComposedLayout, dst_layout: cute.ComposedLayout,
                    is_k: cutlass.Constexpr, thread: Int32):
    """A converting thread's addresses in one ring (_convert_block): it converts the chunk of
    16 head dims at column (thread % per_key) * 16 of keys thread // per_key + j * kps (kps =
    converting threads / per_key, per_key = head dims / 16), `group` of them per step. Returns
    (per chunk of a step: byte offset in the e4m3 stage 0, the two 16-byte halves' offsets in
    the 16-bit stage 0, its last step inside the block), the static byte steps (keys per step
    in e4m3 and 16-bit, one stage of each) and the number of steps.

    A step's keys are a multiple of the 8-row swizzle period, so the swizzle of a chunk's
    address is the same every step and the step adds a constant; stages are whole periods
    apart. A chunk past the block's last key repeats its last step (the same bytes stored
    again)."""
    dim = self.head_dim if const_expr(is_k) else self.head_dim_v
    per_key = dim // _CHUNK
    kps = _CONVERT_THREADS // per_key
    group = _convert_group(self.tile_n, kps)
    step_keys = group * kps
    out_bytes = self.dtype.width // 8
    # (key, head_dim, stage) of K, (head_dim_v, key, stage) of V: head dims contiguous.
    crd = lambda key, c, stage: (key, c, stage) if const_expr(is_k) else (c, key, stage)
    key0 = thread // per_key
    col = (thread - key0 * per_key) * _CHUNK
    chunks = []
    for g in range(group):  # a Python loop: this method is no kernel function
      key = key0 + g * kps
      chunks.append((sm90_gemm.swizzled_byte_offset(src_layout, crd(key, col, 0), 1),
                     sm90_gemm.swizzled_byte_offset(dst_layout, crd(key, col, 0), out_bytes),
                     sm90_gemm.swizzled_byte_offset(dst_layout, crd(key, col + _CHUNK // 2, 0),
                                                    out_bytes),
                     (self.tile_n - 1 - key) // step_keys))
    steps = (cute.crd2idx(crd(step_keys, 0, 0), src_layout.outer),
             cute.crd2idx(crd(step_keys, 0, 0), dst_layout.outer) * out_bytes,
             cute.crd2idx(crd(0, 0, 1), src_layout.outer),
             cute.crd2idx(crd(0, 0, 1), dst_layout.outer) * out_bytes)
    return chunks, steps, -(-self.tile_n // step_keys)

  @cute.jit
  def _convert_block(self, ring, src_state, dst_state, is_k: cutlass.Constexpr, thread: Int32,
                     descale=None):
    """One block of `ring` (convert_kv) from e4m3 stage src_state to 16-bit stage dst_state:
    wait for the first and acquire the second, then per step (_convert_plan) load the group's
    16-byte chunks, convert each and store it as two 16-byte halves at the same (key,
    head_dim) coordinates of the 16-bit layout; release the first and publish the second.
    descale (K blocks): (the descale buffer, this thread's value of _block_descale), stored
    into the stage's column."""
    src_ptr, src_layout, dst_ptr, dst_layout, pipe8, pipe16, plan = ring
    chunks, (src_step, dst_step, src_stage, dst_stage), num_steps = plan
    bf16 = self.dtype == cutlass.BFloat16
    pipe8.consumer_wait(src_state)
    pipe16.producer_acquire(dst_state)
    if const_expr(descale is not None):
      scales, value = descale
      if thread < 2 * (self.tile_n // BOX_ROWS):
        scales[thread, dst_state.index] = value
    src_base = Int32(src_ptr.toint()) + src_state.index * src_stage
    dst_base = Int32(dst_ptr.toint()) + dst_state.index * dst_stage
    for step in cutlass.range(num_steps, unroll=1):
      loaded = []
      for src, _, _, last in chunks:
        loaded.append(_ld_shared_v4(src_base + src + cutlass.min(step, last) * src_step))
      for (_, dst0, dst1, last), words in zip(chunks, loaded):
        out = []
        for w in words:
          out += _e4m3x4_to_16bit(w, bf16)
        dst = dst_base + cutlass.min(step, last) * dst_step
        _st_shared_v4(dst + dst0, *out[:4])
        _st_shared_v4(dst + dst1, *out[4:])
    # The 16-bit stores are generic-proxy; the consumers' WGMMA reads through the async one.
    cute.arch.fence_proxy("async.shared", space="cta")
    sm90_gemm.release_after_lane_loads(pipe8, src_state)
    pipe16.producer_commit(dst_state)

  @cute.jit
  def _paging(self, mPageTable: cute.Tensor, page_size: Int32, num_pages: Int32, work,
              head_kv: Int32, batch: Int32):
    """What the producer needs to find a key block's pages (see _load_block)."""
    # Paged caches have power-of-two pages from 16 keys (the FFI checks it): a page of
    # 16 << box_shift keys holds 1 << box_shift boxes, and a smaller page than tile_n starts
    # at a block boundary.
    box_shift = Int32(0)
    for p in cutlass.range_constexpr(5, 10):
      if page_size >= (1 << p):
        box_shift = box_shift + 1
    return _Paging(table=mPageTable, page_size=page_size, num_pages=num_pages,
                   max_slot=mPageTable.shape[1] - 1, box_shift=box_shift,
                   whole_blocks=work.whole_blocks, length=work.length, head_kv=head_kv,
                   batch=batch)

  @cute.jit
  def _page(self, paging, slot: Int32) -> Int32:
    """Pool page of a sequence's slot-th page, both clamped (slot to the table, the entry to
    the pool); sequence b's page b when the table has no column (a contiguous cache)."""
    page = paging.batch
    if paging.max_slot >= 0:
      entry = paging.table[paging.batch, cutlass.min(slot, paging.max_slot)]
      page = cutlass.min(cutlass.max(entry, Int32(0)), paging.num_pages - 1)
    return page

  @cute.jit
  def _load_block(self, copy, pipe, state, paging, n_block: Int32, is_k: cutlass.Constexpr):
    """Copies key block n_block of K (is_k) or V into ring slot `state`.

    When every block lies in one page (paging.whole_blocks): one page-table read and one TMA
    copy for the block (a contiguous cache's last block may run past max_len: TMA fills those
    rows with zeros). Else (pages of 16 to tile_n / 2 keys, a multiple of copy.rows) box by box,
    copy.rows keys by a swizzle atom's columns each: the page-table reads of the block's boxes
    go out together (one per page), then a copy per box; boxes at or past the sequence's length
    are out of bounds (zero-filled, nothing read).
    """
    barrier = pipe.producer_get_barrier(state)
    key0 = n_block * self.tile_n
    if paging.whole_blocks != 0:
      slot = key0 // paging.page_size
      page = self._page(paging, slot)
      row_block = (key0 - slot * paging.page_size) // self.tile_n
      if const_expr(is_k):
        cute.copy(copy.atom_block, copy.g_block[None, row_block, 0, paging.head_kv, page],
                  copy.s_block[None, state.index], tma_bar_ptr=barrier)
      else:
        cute.copy(copy.atom_block, copy.g_block[None, 0, row_block, paging.head_kv, page],
                  copy.s_block[None, state.index], tma_bar_ptr=barrier)
    else:
      boxes = self.tile_n // copy.rows
      cols = self.head_dim // self.k_box_cols if const_expr(is_k) else (
          self.head_dim_v // self.v_box_rows)
      # log2(boxes per page): paging's count of 16-key boxes less log2(rows / 16) (rows divides
      # the page).
      box_shift = paging.box_shift
      if const_expr(copy.rows != BOX_ROWS):
        box_shift = box_shift - ((copy.rows // BOX_ROWS).bit_length() - 1)
      # Block n_block is pages [slot0, slot0 + pages per block) of the sequence.
      slot0 = n_block * (Int32(boxes) >> box_shift)
      box_mask = (Int32(1) << box_shift) - 1
      pages = cute.make_rmem_tensor(boxes, Int32)
      for b in cutlass.range_constexpr(boxes):
        pages[b] = self._page(paging, slot0 + (Int32(b) >> box_shift))
      for b in cutlass.range_constexpr(boxes):
        # Box index inside its page, or one past the page's last box: out of bounds.
        row_box = Int32(b) & box_mask
        if key0 + b * copy.rows >= paging.length:
          row_box = box_mask + 1
        for c in cutlass.range_constexpr(cols):
          if const_expr(is_k):
            cute.copy(copy.atom_box, copy.g_box[None, row_box, c, paging.head_kv, pages[b]],
                      copy.s_box[None, b, c, state.index], tma_bar_ptr=barrier)
          else:
            cute.copy(copy.atom_box, copy.g_box[None, c, row_box, paging.head_kv, pages[b]],
                      copy.s_box[None, c, b, state.index], tma_bar_ptr=barrier)

  @cute.jit
  def mma_decode(self, mOPart: cute.Tensor, mLSEPart: cute.Tensor, mSink: cute.Tensor,
                 mO: cute.Tensor, mLSE: cute.Tensor, sQ: cute.Tensor,
                 sK: cute.Tensor, sV: cute.Tensor, tiled_mma_qk: cute.TiledMma,
                 tiled_mma_pv: cute.TiledMma, pipeline_q, pipeline_k, pipeline_v,
                 softmax_scale: Float32, capped: Int32, tanh_scale: Float32, work,
                 m_block: Int32, split: Int32, head_kv: Int32, batch: Int32, seqlen_q: Int32,
                 window_left: Int32, window_right: Int32, rows: Int32, scales=None):
    """Consumer warpgroup: the tile's key blocks (run_tile), then the partial out and lse, or
    with one split the final out and lse (no merge follows). scales: FP8 caches' descale
    buffer (convert_kv)."""
    c, thr_mma_pv = self.run_tile(sQ, sK, sV, tiled_mma_qk, tiled_mma_pv, pipeline_q,
                                  pipeline_k, pipeline_v, softmax_scale, capped, tanh_scale,
                                  work, m_block, seqlen_q, window_left, window_right, rows,
                                  scales)
    out_scale = None
    if const_expr(self.fp8_cache):
      # The v reference; a split without keys has none (and O = 0).
      out_scale = Float32(1.0)
      if work.n_end > work.n_start:
        out_scale = scales[0, self.num_stages]
    if mOPart.shape[1] == 1:
      self.epilogue_final(mO, mLSE, mSink, thr_mma_pv, c.acc_o, c.online, m_block, head_kv,
                          batch, rows, seqlen_q, out_scale)
    else:
      self.epilogue_decode(mOPart, mLSEPart, thr_mma_pv, c.acc_o, c.online, m_block, split,
                           head_kv, batch, rows, out_scale)

  @cute.jit
  def run_tile(self, sQ: cute.Tensor, sK: cute.Tensor, sV: cute.Tensor,
               tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma, pipeline_q,
               pipeline_k, pipeline_v, softmax_scale: Float32, capped: Int32,
               tanh_scale: Float32, work, m_block: Int32, seqlen_q: Int32, window_left: Int32,
               window_right: Int32, rows: Int32, scales=None):
    """Consumer warpgroups: S = Q K^T, online softmax, O += P V over the work's key blocks
    (highest first), ping-pong between the warpgroups where the schedule has it. Returns the
    thread's _Consumer (O and the softmax state of the tile) and PV GEMM slice."""
    tidx, _, _ = cute.arch.thread_idx()
    mma_tidx = tidx - _WARPGROUP_THREADS
    wg = cute.arch.make_warp_uniform(mma_tidx // _WARPGROUP_THREADS)
    c, thr_mma_pv = self._consumer(mma_tidx, wg, tiled_mma_qk, tiled_mma_pv, sQ, sK, sV,
                                   pipeline_k, pipeline_v, softmax_scale, None)
    tScS_mn, online, acc_o = c.tScS_mn, c.online, c.acc_o
    num_rows = cute.size(tScS_mn, mode=[0])
    # The keys each of this thread's rows sees: [key_lo, key_hi).
    key_lo = cute.make_rmem_tensor(num_rows, Int32)
    key_hi = cute.make_rmem_tensor(num_rows, Int32)
    group = rows // seqlen_q
    for i in cutlass.range_constexpr(num_rows):
      pos = work.length - seqlen_q + (m_block * self.tile_m + tScS_mn[i, 0][0]) // group
      key_lo[i] = pos - window_left
      key_hi[i] = cutlass.min(pos + window_right + 1, work.length)
    band = _KeyBand(capped=capped, tanh_scale=tanh_scale, key_lo=key_lo, key_hi=key_hi,
                    length=work.length, whole_blocks=work.whole_blocks, sV=sV,
                    scales=scales)
    c = dataclasses.replace(c, masking=band)
    if const_expr(self.pingpong):
      # Warpgroup 0 takes the first turn: it arrives on its own barrier once.
      if wg == 0:
        cute.arch.barrier_arrive(barrier_id=_SCHEDULER_BARRIER_BASE,
                                 number_of_threads=2 * _WARPGROUP_THREADS)

    q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
    kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
    online.reset()
    acc_o.fill(0.0)
    pipeline_q.consumer_wait(q_state)
    n_start, n_end = work.n_start, work.n_end
    if n_end > n_start:
      top = n_end - 1
      self.first_block(c, kv_state, m_block, top, seqlen_q, work.length)
      # Masked blocks down to full_hi, whole ones down to full_lo, masked ones down to n_start.
      hi = cutlass.max(cutlass.min(work.full_hi, top), n_start)
      lo = cutlass.max(cutlass.min(work.full_lo, hi), n_start)
      for upper, lower, is_masked in ((top, hi, True), (hi, lo, False), (lo, n_start, True)):
        for i in cutlass.range(upper - lower, unroll=1):
          v_state = kv_state.clone()
          kv_state.advance()
          self.overlap_step(c, kv_state, v_state, wg, m_block, upper - 1 - i, seqlen_q,
                            work.length, is_masked)
      self.last_block(c, kv_state)
    return c, thr_mma_pv

  @cute.jit
  def _release_k(self, c, kv_state, is_masked: cutlass.Constexpr,
                 after_softmax: cutlass.Constexpr):
    """FP8 caches: after the softmax, which reads the stage's descales (each thread's arrive
    on the 16-bit PipelineAsync follows its own loads); else as the forward."""
    if const_expr(self.fp8_cache):
      if const_expr(after_softmax):
        c.pipeline_k.consumer_release(kv_state)
    else:
      FlashAttentionForwardSm90._release_k(self, c, kv_state, is_masked, after_softmax)

  @cute.jit
  def first_block(self, c, kv_state, m_block: Int32, n_block: Int32, seqlen_q: Int32,
                  seqlen_k: Int32):
    """The forward's first block, then: V rows past the cache length that were copied (the rest
    of a whole block, or of the last box: up to the next multiple of box_rows[0], the widest
    height, which covers the narrower ones) hold whatever the cache has there (maybe not
    finite), and P = 0 times such a value would still poison O: they are zeroed before the P V
    GEMM reads the stage."""
    FlashAttentionForwardSm90.first_block(self, c, kv_state, m_block, n_block, seqlen_q,
                                          seqlen_k)
    band = c.masking
    tail = band.length - n_block * self.tile_n  # valid keys in this block
    rows = self.box_rows[0]
    box_end = cutlass.min((tail + rows - 1) // rows * rows, self.tile_n)
    if band.whole_blocks != 0:
      box_end = self.tile_n
    if tail < box_end:
      c.pipeline_v.consumer_wait(kv_state)
      tidx, _, _ = cute.arch.thread_idx()
      sV_stage = band.sV[None, None, kv_state.index]  # (head_dim_v, tile_n)
      count = (box_end - tail) * self.head_dim_v
      # Every consumer thread zeroes its share (the consumer warpgroups read the same stage).
      for idx in cutlass.range(tidx - _WARPGROUP_THREADS, count, self.num_mma_threads,
                               unroll=1):
        key = tail + idx // self.head_dim_v
        sV_stage[idx - (key - tail) * self.head_dim_v, key] = self.dtype(0.0)
      # Generic-proxy writes, read next by WGMMA (async proxy) of every consumer warpgroup.
      cute.arch.fence_proxy("async.shared", space="cta")
      cute.arch.barrier(barrier_id=_V_TAIL_BARRIER, number_of_threads=self.num_mma_threads)

  @cute.jit
  def _softmax(self, c, acc_s: cute.Tensor, m_block: Int32, n_block: Int32, seqlen_q: Int32,
               seqlen_k: Int32, is_masked: cutlass.Constexpr, k_state,
               fixed_max: cutlass.Constexpr = False):
    """FP8 caches: scores times their keys' k descales. Soft-cap (when on), mask the keys
    outside each row's band (is_masked), online softmax; FP8 caches: P times the keys' v
    descales (the row sums keep the unscaled P). fixed_max is always False here: decode tiles
    keep the running max."""
    band = c.masking
    acc_s_mn = softmax.make_acc_mn_view(acc_s)
    if const_expr(self.fp8_cache):
      self._scale_by_descales(c, acc_s_mn, n_block, k_state, 0, False)
    if band.capped != 0:
      softmax.soft_cap(acc_s, band.tanh_scale)
    if const_expr(is_masked):
      col_base = n_block * self.tile_n
      for j in cutlass.range_constexpr(cute.size(acc_s_mn, mode=[1])):
        key = col_base + c.tScS_mn[0, j][1]
        for i in cutlass.range_constexpr(cute.size(acc_s_mn, mode=[0])):
          if key < band.key_lo[i] or key >= band.key_hi[i]:
            acc_s_mn[i, j] = -Float32.inf
    c.online.online_softmax(acc_s_mn, c.row_scale)
    if const_expr(self.fp8_cache):
      self._scale_by_descales(c, acc_s_mn, n_block, k_state, 1, is_masked)

  def _column_boxes(self, c) -> list:
    """The 16-key box of each of a thread's S columns, the same for every thread (trace time):
    a thread's columns are 8 k + 2 (lane % 4) + {0, 1}, so lanes differ by less than 8 inside
    one group of 8 keys, never across a box."""
    boxes = []
    for lane in (0, 3):  # the smallest and largest lane offset
      coords = softmax.make_acc_mn_view(c.tiled_mma_qk.get_slice(lane).partition_C(
          cute.make_identity_tensor((self.tile_m, self.tile_n))))
      boxes.append([int(coords[0, j][1]) // BOX_ROWS
                    for j in range(cute.size(coords, mode=[1]))])
    assert boxes[0] == boxes[1], boxes
    return boxes[0]

  @cute.jit
  def _scale_by_descales(self, c, acc_mn: cute.Tensor, n_block: Int32, k_state,
                         which: cutlass.Constexpr, past_length_zero: cutlass.Constexpr):
    """acc_mn's columns (keys of block n_block) times their boxes' descales, which (0: k, 1: v
    over the v reference) of the descale buffer's column of K stage k_state (convert_kv).
    past_length_zero (masked blocks, after the softmax): keys at or past the length get 0
    whatever the descale of the page the table names there (P is 0 for them, and 0 times a
    non-finite descale would poison O)."""
    band = c.masking
    num_boxes = self.tile_n // BOX_ROWS
    scales = cute.make_rmem_tensor(num_boxes, Float32)
    for b in cutlass.range_constexpr(num_boxes):
      scales[b] = band.scales[which * num_boxes + b, k_state.index]
    key0 = n_block * self.tile_n
    boxes = self._column_boxes(c)
    for j in cutlass.range_constexpr(cute.size(acc_mn, mode=[1])):
      col_scale = scales[boxes[j]]
      if const_expr(past_length_zero):
        if key0 + c.tScS_mn[0, j][1] >= band.length:
          col_scale = Float32(0.0)
      for i in cutlass.range_constexpr(cute.size(acc_mn, mode=[0])):
        acc_mn[i, j] = acc_mn[i, j] * col_scale

  @cute.jit
  def epilogue_decode(self, mOPart: cute.Tensor, mLSEPart: cute.Tensor, thr_mma_pv,
                      acc_o: cute.Tensor, online, m_block: Int32, split: Int32, head_kv: Int32,
                      batch: Int32, rows: Int32, out_scale=None):
    """Normalises O over this split's keys (times out_scale if given: FP8 caches' v
    reference, convert_kv) and stores it and the lse (float32, rows < rows): straight from
    registers, the rows are few."""
    acc_o_mn = softmax.make_acc_mn_view(acc_o)
    num_rows = cute.size(acc_o_mn, mode=[0])
    row_inv = cute.make_rmem_tensor(num_rows, Float32)
    lse = cute.make_rmem_tensor(num_rows, Float32)
    online.finalize(row_inv, lse, -Float32.inf)
    if const_expr(out_scale is not None):
      for i in cutlass.range_constexpr(num_rows):
        row_inv[i] = row_inv[i] * out_scale
    tOcO_mn = softmax.make_acc_mn_view(
        thr_mma_pv.partition_C(cute.make_identity_tensor((self.tile_m, self.head_dim_v))))
    for i in cutlass.range_constexpr(num_rows):
      row = m_block * self.tile_m + tOcO_mn[i, 0][0]
      if row < rows:
        # One lane of each quad (the one holding column 0) writes the row's lse.
        if tOcO_mn[0, 0][1] == 0:
          mLSEPart[batch, split, head_kv, row] = lse[i]
        for j in cutlass.range_constexpr(cute.size(acc_o_mn, mode=[1])):
          mOPart[batch, split, head_kv, row, tOcO_mn[i, j][1]] = acc_o_mn[i, j] * row_inv[i]


  @cute.jit
  def epilogue_final(self, mO: cute.Tensor, mLSE: cute.Tensor, mSink: cute.Tensor,
                     thr_mma_pv, acc_o: cute.Tensor, online, m_block: Int32, head_kv: Int32,
                     batch: Int32, rows: Int32, seqlen_q: Int32, out_scale=None):
    """A tile that saw all of its row's keys (one split, or a chunked tile): normalises O
    (each packed row's query head's sink, if any, joins its denominator; times out_scale if
    given: FP8 caches' v reference) and stores it in q's dtype and the lse (rows < rows) from
    registers, the merge's work done here: the tile's O is a few percent of the bytes its keys
    cost, and packed rows past the last token must not be written, which a TMA store of the
    whole tile would."""
    acc_o_mn = softmax.make_acc_mn_view(acc_o)
    num_rows = cute.size(acc_o_mn, mode=[0])
    row_inv = cute.make_rmem_tensor(num_rows, Float32)
    lse = cute.make_rmem_tensor(num_rows, Float32)
    tOcO_mn = softmax.make_acc_mn_view(
        thr_mma_pv.partition_C(cute.make_identity_tensor((self.tile_m, self.head_dim_v))))
    group = rows // seqlen_q
    # Row i * group + j: query head head_kv * group + j, whose sink is mSink[head_kv, j].
    sink_log2 = cute.make_rmem_tensor(num_rows, Float32)
    for i in cutlass.range_constexpr(num_rows):
      sink_log2[i] = -Float32.inf
      if mSink.shape[1] > 0:
        row = cutlass.min(m_block * self.tile_m + tOcO_mn[i, 0][0], rows - 1)
        sink_log2[i] = mSink[head_kv, row % group] * softmax.LOG2_E
    online.finalize(row_inv, lse, sink_log2)
    if const_expr(out_scale is not None):
      for i in cutlass.range_constexpr(num_rows):
        row_inv[i] = row_inv[i] * out_scale
    softmax.scale_rows(acc_o_mn, row_inv)
    r_o = cute.make_rmem_tensor(acc_o.layout.shape, self.dtype)
    r_o.store(acc_o.load().to(self.dtype))
    r_o_mn = softmax.make_acc_mn_view(r_o)
    for i in cutlass.range_constexpr(num_rows):
      row = m_block * self.tile_m + tOcO_mn[i, 0][0]
      if row < rows:
        # One lane of each quad (the one holding column 0) writes the row's lse.
        if tOcO_mn[0, 0][1] == 0:
          mLSE[batch, head_kv, row] = lse[i]
        for j in cutlass.range_constexpr(cute.size(r_o_mn, mode=[1])):
          mO[batch, head_kv, row, tOcO_mn[i, j][1]] = r_o_mn[i, j]


@dataclasses.dataclass(frozen=True)
class _Work:
  """A CTA's keys (see FlashAttentionDecodeSm90._work)."""

  length: Int32
  n_start: Int32
  n_end: Int32
  full_lo: Int32
  full_hi: Int32
  whole_blocks: Int32  # 1: each key block lies in one page (copied whole), 0: boxes of 16 keys


@dataclasses.dataclass(frozen=True)
class _BlockCopy:
  """The TMA copies of K or V: atom, global coordinates and ring partition, per box of `rows`
  keys and per whole block."""

  rows: int
  atom_box: cute.CopyAtom
  g_box: cute.Tensor
  s_box: cute.Tensor
  atom_block: cute.CopyAtom
  g_block: cute.Tensor
  s_block: cute.Tensor


@dataclasses.dataclass(frozen=True)
class _Paging:
  """Where a sequence's key blocks live (see FlashAttentionDecodeSm90._load_block)."""

  table: cute.Tensor  # (batch, max_pages) int32
  page_size: Int32
  num_pages: Int32
  max_slot: Int32  # max_pages - 1 (-1: a contiguous cache, sequence b in page b)
  box_shift: Int32  # log2(page_size / 16) for page sizes up to 512: 16-key boxes per page
  whole_blocks: Int32
  length: Int32
  head_kv: Int32
  batch: Int32


@dataclasses.dataclass(frozen=True)
class _KeyBand:
  """What the consumer's softmax and first block need of the call (in _Consumer.masking)."""

  capped: Int32  # 1: soft-capping on
  tanh_scale: Float32
  key_lo: cute.Tensor  # per row of this thread: first visible key (may be negative)
  key_hi: cute.Tensor  # one past the last visible key (<= the length)
  length: Int32
  whole_blocks: Int32  # _Work.whole_blocks
  sV: cute.Tensor  # the V ring (the first block zeroes rows past the length)
  scales: cute.Tensor = None  # FP8 caches: the descale buffer (convert_kv)


@dataclasses.dataclass(frozen=True)
class _Descales:
  """FP8 caches' descales, where a key's page is, and the descale buffer the converting warps
  fill (convert_kv)."""

  k: cute.Tensor  # (num_pages, num_kv_heads) float32
  v: cute.Tensor
  paging: _Paging
  scales: cute.Tensor
