"""The additive attention bias: its tiles in shared memory (forward and backward) and dbias.

Imports cutlass and sm90_gemm only. The bias reaches the kernels as a 3-D (rows, seqlen_k,
planes) view of its buffer (batch|1, heads|1, seq_q|1, row_length): a plane per (batch, head)
that it does not broadcast, whose rows are its queries (or one row for all of them); BiasPlanes
finds the plane and first row of a tile. Rows past the plane's last (queries past seqlen_q) and
keys past seqlen_k are out of bounds: TMA fills them with zeros, so a tile never reads another
plane's rows (a NaN there would reach P of the backward's padding queries). The producer warp
loads the (query tile, key block) tile of each step with TMA into a 128B-swizzled shared tile
(the layout of sm90_gemm.smem_layout: 8 x 64 atoms, rows then column halves), and the consumers
read their accumulator fragment of it with ldmatrix: a thread's fragment holds pairs of
adjacent columns of 8 x 8 blocks, exactly what ldmatrix (forward: rows queries) and
ldmatrix.trans (backward: the S^T fragment, rows keys) hand each lane. A bias broadcast over
queries has one row per (batch, head): its tile is loaded from that row (the others are out of
bounds) and the consumers read row 0 of it for every query.
"""

import dataclasses

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from jaxflash.kernels import sm90_gemm

# ldmatrix moves 8 x 8 blocks of 16-bit elements: 8 elements (16 bytes) per row and lane.
_CHUNK = 8


@dataclasses.dataclass(frozen=True)
class BiasPlanes:
  """Where (batch, head, query) is in the 3-D bias view: plane batch * batch_planes + head *
  head_planes, row query * query_step (each step 0 along a broadcast dim: query_step is 1, or 0
  for a bias with one row per (batch, head)). Int32 kernel parameters (a trace-time bundle)."""

  batch_planes: Int32
  head_planes: Int32
  query_step: Int32

  def plane(self, batch: Int32, head: Int32) -> Int32:
    return batch * self.batch_planes + head * self.head_planes

  def row(self, query: Int32) -> Int32:
    """The row of `query` (a TMA box of a query tile starts at the row of its first query)."""
    return query * self.query_step


@dataclasses.dataclass(frozen=True)
class SharedTiles:
  """A ring of bias tiles in shared memory (a trace-time bundle): the ring's shared address and
  its swizzled (rows, cols, stages) layout (sm90_gemm.smem_layout: cols, the keys, contiguous),
  read with ldmatrix at the addresses of sm90_gemm.swizzled_byte_offset."""

  addr: Int32
  layout: cute.ComposedLayout

  def chunk_addr(self, row: Int32, col: Int32, stage: Int32) -> Int32:
    """Shared address of the 16 bytes at (row, col..col + 7) of a stage (col a multiple of
    8: the swizzle moves whole 16-byte chunks)."""
    return self.addr + sm90_gemm.swizzled_byte_offset(self.layout, (row, col, stage), 2)


@dsl_user_op
def ldmatrix_x4(smem_addr: Int32, transposed: bool, *, loc=None, ip=None) -> tuple:
  """Four 8 x 8 blocks of 16-bit elements from shared memory (ldmatrix .x4 [.trans]): lanes
  8i..8i+7 give the 16-byte rows of block i; register i of lane t holds block i's row t / 4,
  columns 2 (t % 4) and 2 (t % 4) + 1 (low half first), or with `transposed` its column t / 4,
  rows 2 (t % 4) and 2 (t % 4) + 1."""
  trans = ".trans" if transposed else ""
  # With side effects: two reads of one tile (the backward's P and softcap factor) stay two
  # loads; merged, LLVM kept 40 bias values live across the step and ptxas spilled them.
  res = llvm.inline_asm(
      llvm.StructType.get_literal([T.i32()] * 4), [Int32(smem_addr).ir_value(loc=loc, ip=ip)],
      f"ldmatrix.sync.aligned.m8n8.x4{trans}.shared.b16 {{$0, $1, $2, $3}}, [$4];",
      "=r,=r,=r,=r,r", has_side_effects=True, is_align_stack=False,
      asm_dialect=llvm.AsmDialect.AD_ATT)
  return tuple(Int32(llvm.extractvalue(T.i32(), res, [k], loc=loc, ip=ip)) for k in range(4))


@dsl_user_op
def lane_here(*, loc=None, ip=None) -> Int32:
  """%laneid read where it is called (a volatile read): the ldmatrix addresses derived from it
  are computed at each load instead of hoisted to the kernel's start and kept live (or spilled)
  across the main loop."""
  return Int32(llvm.inline_asm(T.i32(), [], "mov.u32 $0, %laneid;", "=r", has_side_effects=True,
                               is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def unpack_pair(packed: Int32, is_bf16: bool, *, loc=None, ip=None) -> tuple:
  """(low, high) 16-bit halves of a register as Float32: bfloat16 by two integer ops (its bits
  are a float's high half), float16 by two conversions."""
  if is_bf16:
    body = "shl.b32 $0, $2, 16;\nand.b32 $1, $2, 0xffff0000;"
  else:
    body = ("{ .reg .b16 l, h;\n"
            "mov.b32 {l, h}, $2;\n"
            "cvt.f32.f16 $0, l;\n"
            "cvt.f32.f16 $1, h; }")
  res = llvm.inline_asm(
      llvm.StructType.get_literal([T.f32()] * 2), [Int32(packed).ir_value(loc=loc, ip=ip)],
      body, "=f,=f,r", has_side_effects=False, is_align_stack=False,
      asm_dialect=llvm.AsmDialect.AD_ATT)
  return tuple(Float32(llvm.extractvalue(T.f32(), res, [k], loc=loc, ip=ip)) for k in range(2))


# A thread's accumulator fragment (rows, cols) of a 64-row WGMMA (softmax.make_acc_mn_view):
# rows 16 w + lane // 4 + 8 h (h = 0, 1) of its warp w, columns 8 g + 2 (lane % 4) + p (column
# j = 2 g + p), in 8 x 8 blocks (h, g) that hold exactly what ldmatrix hands lane `lane` of an
# 8 x 8 block: its row lane // 4, columns 2 (lane % 4) + p. One ldmatrix.x4 (number c) moves the
# blocks h = 0, 1 of groups 2c and 2c + 1; the two functions below say which block a register
# holds and which block row a lane addresses, the two after them where that row is in the bias
# tile. tests/test_kernels_bias.py emulates ldmatrix with them against the WGMMA fragment's
# coordinates.


def x4_register_block(i: int, c: int) -> tuple:
  """(h, g): the fragment block that register i of ldmatrix.x4 number c holds."""
  return i % 2, 2 * c + i // 2


def x4_lane_block(lane, c: int) -> tuple:
  """(h, g, r): lane `lane` of ldmatrix.x4 number c gives the address of row r of block (h, g)
  (lanes 8i..8i+7 address block i, register i)."""
  h, g = x4_register_block(lane // _CHUNK, c)
  return h, g, lane % _CHUNK


def x4_forward_row(lane, c: int, warp_row, query_step) -> tuple:
  """(query row, first key) in the forward's bias tile of the 16 bytes that lane `lane` gives
  ldmatrix.x4 number c: the S fragment's block (h, g) is the bias at queries warp_row + 8 h..
  (warp_row: the warp's first row), keys 8 g.., as stored. query_step 0 (one bias row per
  head): row 0."""
  h, g, r = x4_lane_block(lane, c)
  return (warp_row + h * _CHUNK + r) * query_step, g * _CHUNK


def x4_transposed_row(lane, c: int, warp_key, query_step) -> tuple:
  """(query row, first key) in the backward's bias tile of the 16 bytes that lane `lane` gives
  ldmatrix.x4.trans number c: the S^T fragment's block (h, g) is the bias at keys warp_key +
  8 h.. (warp_key: the warp's first key), queries 8 g.., transposed from the 8 query rows."""
  h, g, r = x4_lane_block(lane, c)
  return (g * _CHUNK + r) * query_step, warp_key + h * _CHUNK


@cute.jit
def add_bias_tile(acc_s_mn: cute.Tensor, tiles: SharedTiles, stage: Int32, warp_row: Int32,
                  query_step: Int32, scale: Float32, is_bf16: cutlass.Constexpr):
  """Forward: S[i, j] += bias * scale over this thread's S fragment, from stage `stage` of the
  bias tiles (tile_m queries x tile_n keys, keys contiguous). warp_row: the tile row of the
  warp's first row (64 * warpgroup + 16 * warp); query_step: BiasPlanes's (x4_forward_row).
  """
  lane = lane_here()
  for c in cutlass.range_constexpr(cute.size(acc_s_mn, mode=[1]) // 4):
    row, col = x4_forward_row(lane, c, warp_row, query_step)
    regs = ldmatrix_x4(tiles.chunk_addr(row, col, stage), False)
    for i in cutlass.range_constexpr(4):
      lo, hi = unpack_pair(regs[i], is_bf16)
      rh, rg = x4_register_block(i, c)
      acc_s_mn[rh, 2 * rg] = acc_s_mn[rh, 2 * rg] + lo * scale
      acc_s_mn[rh, 2 * rg + 1] = acc_s_mn[rh, 2 * rg + 1] + hi * scale


@dataclasses.dataclass(frozen=True)
class TransposedBiasTile:
  """Backward: the bias tile of one step (tile_m queries x tile_n keys, keys contiguous, in the
  stage's dS buffer) as a thread's S^T fragment sees it (rows keys, columns queries), a
  trace-time bundle. warp_key: the tile key of the warp's first row (64 * warpgroup + 16 *
  warp); query_step as BiasPlanes."""

  tiles: SharedTiles
  stage: Int32
  warp_key: Int32
  query_step: Int32
  is_bf16: bool

  @cute.jit
  def load(self, c: cutlass.Constexpr) -> tuple:
    """The packed bias of ldmatrix.x4.trans number c: register i holds fragment block
    x4_register_block(i, c) (x4_transposed_row)."""
    query, key = x4_transposed_row(lane_here(), c, self.warp_key, self.query_step)
    return ldmatrix_x4(self.tiles.chunk_addr(query, key, self.stage), True)

  def unpack(self, packed: Int32) -> tuple:
    return unpack_pair(packed, self.is_bf16)


@cute.jit
def write_dbias_transposed(ds_mn: cute.Tensor, coord_mn: cute.Tensor, dbias: cute.Tensor,
                           query_base: Int32, key_base: Int32, seqlen_q: Int32,
                           seqlen_k: Int32, dtype: cutlass.Constexpr):
  """dbias[query, key] = dS^T[key, query] of this thread's fragment (coord_mn: (key, query) in
  the tile), one 16-bit store per score inside (seqlen_q, seqlen_k). The soft-capped path only
  (the others store the dS tile with TMA): there the dS tile holds dS times the softcap's
  factor, which is not dbias."""
  for j in cutlass.range_constexpr(cute.size(ds_mn, mode=[1])):
    query = query_base + coord_mn[0, j][1]
    if query < seqlen_q:
      for i in cutlass.range_constexpr(cute.size(ds_mn, mode=[0])):
        key = key_base + coord_mn[i, 0][0]
        if key < seqlen_k:
          dbias[query, key] = ds_mn[i, j].to(dtype)


@dsl_user_op
def store_zero_16b(gmem_ptr: cute.Pointer, *, loc=None, ip=None) -> None:
  """16 zero bytes to a 16-byte aligned global address (one st.global.v4)."""
  llvm.inline_asm(
      None, [gmem_ptr.toint(loc=loc, ip=ip).ir_value()],
      "{ .reg .b32 z;\nmov.b32 z, 0;\nst.global.v4.b32 [$0], {z, z, z, z}; }", "l",
      has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


@cute.jit
def zero_skipped_rows(dbias: cute.Tensor, first: Int32, last: Int32, key_base: Int32,
                      seqlen_k: Int32, tile_n: cutlass.Constexpr):
  """One warp: dbias[first:last, key_base:key_base + tile_n] = 0 for the keys inside seqlen_k
  (in 16-byte chunks: rows are 16-byte aligned, their length a multiple of 8), the rows of a
  key block that its query-block range skips. Lane l writes chunk l % (tile_n / 8) of every
  (32 / (tile_n / 8))-th row from first + l // (tile_n / 8): 512 bytes per warp store."""
  lane = cute.arch.lane_idx()
  chunks_per_row = tile_n // _CHUNK
  rows_per_step = 32 // chunks_per_row
  key = key_base + (lane % chunks_per_row) * _CHUNK
  if key < seqlen_k:
    for row in cutlass.range(first + lane // chunks_per_row, last, rows_per_step, unroll=1):
      store_zero_16b(dbias.iterator + cute.crd2idx((row, key), dbias.layout))
