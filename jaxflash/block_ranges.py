"""Which blocks a masked kernel visits: per-tile block ranges from segment ids and windows.

The masked kernels (config.KernelVariant.masked) visit, for each tile of one side (query tiles
in the forward, key tiles in the backward), a contiguous range of blocks of the other side, and
apply the elementwise mask only outside a sub-range where every (query, key) pair of the tile
pair is visible. Segment ids are run-time data, so for a call with them the primitive's CUDA
lowering computes these ranges on the device with the XLA ops below. A call without them
(windows, softcap) has ranges that depend on static shapes alone: band_ranges gives them in
closed form at trace time, the backward's longest_first and launch_ranks run on those NumPy
arrays, and the program takes the results as constants, with no preparation kernels.
Contiguous segments (packed documents, trailing padding) get tight ranges; other ids stay
correct through the elementwise mask over the hull of their keys. A mask_mod's block mask
(jaxflash/block_mask.py) narrows the ranges further. Imports jax, numpy, block_mask and config
only.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jaxflash import block_mask as block_masks
from jaxflash.config import WINDOW_UNBOUNDED as UNBOUNDED
from jaxflash.config import L2_BYTES_FOR_REUSE, AttentionConfig, KernelVariant


def window_bounds(config: AttentionConfig) -> tuple[int, int]:
  """(left, right) of the call's band, causal folded in: query i sees keys j with
  i' - left <= j <= i' + right, i' = i + seq_k - seq_q; UNBOUNDED where a side has no bound."""
  return tuple(UNBOUNDED if side is None else max(min(side, UNBOUNDED), -UNBOUNDED)
               for side in config.window_sides)


@dataclasses.dataclass(frozen=True)
class Tiling:
  """One side's tiles against the other side's blocks (sizes static, from the schedule).

  Row r of the tiled side sees column c of the other side iff r + lo_offset <= c <= r +
  hi_offset, their ids are equal, and c < num_cols. Padding rows of the last tile (r >=
  num_rows) are ignored, unless `row_padding_masked` (then a tile holding them is never
  free of the mask); a block holding columns >= num_cols always runs the elementwise mask.
  """

  row_tile: int
  col_tile: int
  lo_offset: int
  hi_offset: int
  row_padding_masked: bool


def forward_tiling(tile_m: int, tile_n: int, seq_q: int, seq_k: int,
                   bounds: tuple[int, int]) -> Tiling:
  """Query tiles of tile_m rows against key blocks of tile_n: padding queries are not stored,
  padding keys must be masked."""
  left, right = bounds
  off = seq_k - seq_q
  return Tiling(tile_m, tile_n, off - left, off + right, row_padding_masked=False)


def backward_tiling(tile_m: int, tile_n: int, seq_q: int, seq_k: int,
                    bounds: tuple[int, int]) -> Tiling:
  """Key tiles of tile_n rows against query blocks of tile_m: key j sees query i iff
  i' - left <= j <= i' + right, i.e. j - off - right <= i <= j - off + left. Padding keys must
  be masked (their P would multiply zero-filled K rows); padding queries are not stored."""
  left, right = bounds
  off = seq_k - seq_q
  return Tiling(tile_n, tile_m, -off - right, -off + left, row_padding_masked=True)


def _xp(*arrays):
  """The array namespace of the operands: numpy when every one is a NumPy array (trace-time
  constants from band_ranges), jax.numpy otherwise (run-time data, computed on the device)."""
  return np if all(isinstance(a, np.ndarray) for a in arrays) else jnp


def _id_span(ids, tile: int):
  """(min, max) of the ids in each tile of `tile` positions: (b, n) -> two (b, ceil(n / tile));
  positions past n (the last tile's padding) count for neither."""
  b, n = ids.shape
  tiles = -(-n // tile)
  big = jnp.iinfo(jnp.int32).max
  pad = ((0, 0), (0, tiles * tile - n))
  lo = jnp.pad(ids, pad, constant_values=big).reshape(b, tiles, tile)
  hi = jnp.pad(ids, pad, constant_values=-big - 1).reshape(b, tiles, tile)
  return jnp.min(lo, axis=-1), jnp.max(hi, axis=-1)


def block_ranges(row_ids, col_ids, tiling: Tiling):
  """(b, tiles, 4) int32: per row tile [start, end) of the column blocks it visits, and
  [full_lo, full_hi) within it, blocks where every pair is visible (the others need the
  elementwise mask); start = end (no block) for a tile that sees nothing.

  Works on (tile, block) pairs, not tokens: a pair is visited if the block meets the tile's
  band and the two id spans [min, max] overlap, and free of the mask if the block lies inside
  every row's band and tile and block hold one and the same id. Exact for ids in contiguous
  runs (packed documents, padding); for other ids the visited range is the hull of the
  overlapping spans. No per-token sort: a few fused XLA reductions per call.

  row_ids (b, num_rows), col_ids (b, num_cols) int32 segment ids.
  """
  num_rows, num_cols = row_ids.shape[1], col_ids.shape[1]
  rt, ct = tiling.row_tile, tiling.col_tile
  tiles, blocks = -(-num_rows // rt), -(-num_cols // ct)
  r_min = jnp.arange(tiles, dtype=jnp.int32)[:, None] * rt  # (tiles, 1)
  r_max = jnp.minimum(r_min + rt, num_rows) - 1
  blk = jnp.arange(blocks, dtype=jnp.int32)[None, :]  # (1, blocks)
  # Band: the tile's rows see columns [r_min + lo_offset, r_max + hi_offset].
  in_band = ((blk * ct <= r_max + tiling.hi_offset)
             & ((blk + 1) * ct - 1 >= r_min + tiling.lo_offset)
             & (r_min + tiling.lo_offset <= r_max + tiling.hi_offset))
  band_full = ((blk * ct >= r_max + tiling.lo_offset)
               & ((blk + 1) * ct - 1 <= r_min + tiling.hi_offset) & ((blk + 1) * ct <= num_cols))
  if tiling.row_padding_masked:
    band_full &= r_min + rt <= num_rows
  # Ids: (b, tiles, 1) against (b, 1, blocks).
  row_lo, row_hi = (x[:, :, None] for x in _id_span(row_ids, rt))
  col_lo, col_hi = (x[:, None, :] for x in _id_span(col_ids, ct))
  visit = in_band[None] & (row_lo <= col_hi) & (col_lo <= row_hi)
  full = band_full[None] & (row_lo == row_hi) & (col_lo == col_hi) & (row_lo == col_lo)

  def first_last(mask):
    """(first, last + 1, count) of the blocks set in mask (b, tiles, blocks)."""
    first = jnp.min(jnp.where(mask, blk, blocks), axis=-1)
    last = jnp.max(jnp.where(mask, blk, -1), axis=-1)
    return first, last + 1, jnp.sum(mask, axis=-1, dtype=jnp.int32)

  start, end, seen = first_last(visit)
  start = jnp.where(seen > 0, start, 0)
  end = jnp.where(seen > 0, end, 0)
  full_lo, full_hi, count = first_last(full)
  # One run of mask-free blocks, or none (ids that leave gaps run every block masked).
  has_full = (count > 0) & (count == full_hi - full_lo)
  full_lo = jnp.where(has_full, full_lo, start)
  full_hi = jnp.where(has_full, full_hi, start)
  return jnp.stack([start, end, full_lo, full_hi], axis=-1).astype(jnp.int32)


def band_ranges(num_rows: int, num_cols: int, tiling: Tiling) -> np.ndarray:
  """(1, tiles, 4) int32: block_ranges of one batch without segment ids (every row and column
  in one segment), in closed form per tile: the band alone decides, so a tile visits the blocks
  between its first row's lowest and its last row's highest column, and runs unmasked those
  inside every row's band that hold no padding column. O(tiles) at trace time, where
  block_ranges works on every (tile, block) pair (tests/test_block_ranges.py checks that the
  two agree)."""
  rt, ct = tiling.row_tile, tiling.col_tile
  tiles, blocks = -(-num_rows // rt), -(-num_cols // ct)
  r_min = np.arange(tiles, dtype=np.int64) * rt
  r_max = np.minimum(r_min + rt, num_rows) - 1
  lo, hi = r_min + tiling.lo_offset, r_max + tiling.hi_offset  # the tile's columns [lo, hi]
  start = np.maximum(lo // ct, 0)
  end = np.minimum(hi // ct + 1, blocks)
  seen = (lo <= hi) & (start < end)
  start, end = np.where(seen, start, 0), np.where(seen, end, 0)
  # Unmasked blocks: inside [r_max + lo_offset, r_min + hi_offset] (every row's band) and
  # below num_cols (no padding column).
  full_lo = np.maximum(-((-(r_max + tiling.lo_offset)) // ct), 0)
  full_hi = np.minimum((r_min + tiling.hi_offset + 1) // ct, num_cols // ct)
  has_full = full_lo < full_hi
  if tiling.row_padding_masked:
    has_full &= r_min + rt <= num_rows
  full_lo, full_hi = np.where(has_full, full_lo, start), np.where(has_full, full_hi, start)
  return np.stack([start, end, full_lo, full_hi], axis=-1)[None].astype(np.int32)


def longest_first(ranges, section_blocks: int):
  """(b * tiles,) int32 launch order: entry b * tiles + t names tile t of batch b.

  Longest first (most blocks) within sections of tiles whose ranges start in the same
  `section_blocks` blocks, whose data therefore stays in L2 while they run (a global
  longest-first order over packed documents mixes all documents and thrashed it); batches
  in order, sections from the last down (the causal LPT order of the dense kernels)."""
  xp = _xp(ranges)
  b, tiles = ranges.shape[:2]
  work = ranges[..., 1] - ranges[..., 0]
  section = ranges[..., 0] // max(section_blocks, 1)
  batch = xp.arange(b, dtype=np.int32)[:, None]
  # Sort keys, most significant first: batch, section (descending), work (descending). Both
  # namespaces sort stably: ties keep tile order.
  order = xp.lexsort((-work.reshape(-1), -section.reshape(-1),
                      xp.broadcast_to(batch, (b, tiles)).reshape(-1)))
  return order.astype(np.int32)


def in_launch_order(ranges, order):
  """(b, tiles, 4) int32: the ranges of the launch order's tiles, entry b * tiles + k holding
  those of tile order[b * tiles + k] (a tile of batch b: the order keeps batches in order). A
  CTA reads its tile's range at its own entry, in parallel with the order's entry, rather than
  after it (a second dependent load before its first copy).

  order: a launch order (longest_first's), batches in order, entry b * tiles + t."""
  b, tiles = ranges.shape[:2]
  flat = ranges.reshape(b * tiles, 4)
  if _xp(ranges, order) is np:
    return flat[order].reshape(b, tiles, 4)
  return jnp.take(flat, order, axis=0, mode="clip").reshape(b, tiles, 4)


def launch_ranks(ranges, order, num_blocks: int):
  """(b, tiles, num_blocks) int32: rank[b, t, m] = how many tiles of batch b that visit block m
  (m in [start, end) of theirs) the launch order puts before tile t: the position of tile t's
  contribution to block m in the deterministic backward's fixed order. Each CTA then waits only
  for CTAs launched before it, whatever the order.

  order: a launch order (longest_first's), batches in order, entry b * tiles + t."""
  xp = _xp(ranges, order)
  b, tiles = ranges.shape[:2]
  m = xp.arange(num_blocks, dtype=np.int32)
  visits = ((ranges[..., 0:1] <= m) & (m < ranges[..., 1:2])).astype(np.int32)
  local = order.reshape(b, tiles) - xp.arange(b, dtype=np.int32)[:, None] * tiles
  launched = xp.take_along_axis(visits, local[..., None], axis=1)  # rows in launch order
  before = xp.cumsum(launched, axis=1, dtype=np.int32) - launched
  # position[b, t]: where tile t stands in its batch's launch order (local's inverse).
  if xp is np:
    position = np.argsort(local, axis=1)
  else:
    position = jnp.zeros((b, tiles), jnp.int32).at[jnp.arange(b)[:, None], local].set(
        jnp.arange(tiles, dtype=jnp.int32)[None, :])
  return xp.take_along_axis(before, position[..., None], axis=1).astype(np.int32)


def padded_ids(ids, multiple: int):
  """(b, n) int32 ids padded with zeros to a multiple of `multiple` (the kernels copy whole
  blocks of them; padding positions are masked or harmless)."""
  n = ids.shape[1]
  pad = -(-n // multiple) * multiple - n
  return jnp.pad(ids.astype(jnp.int32), ((0, 0), (0, pad)))


def _zero_ids(batch: int, n: int, multiple: int):
  """The padded ids of a call without segment ids (one segment): a zero fill on the device,
  not a literal of batch x n in the program."""
  return jnp.zeros((batch, -(-n // multiple) * multiple), jnp.int32)


def _ranges_and_ids(segment_ids, tiling: Tiling, batch: int, rows: int, cols: int,
                    row_multiple: int, col_multiple: int):
  """(row ids, col ids, ranges) of one side's tiles: from the segment ids (row side's, col
  side's; run-time data) on the device, or without them at trace time (band_ranges), one
  batch's ranges repeated (every batch has the same single segment)."""
  if segment_ids:
    row_ids, col_ids = (jnp.asarray(ids, jnp.int32) for ids in segment_ids)
    return (padded_ids(row_ids, row_multiple), padded_ids(col_ids, col_multiple),
            block_ranges(row_ids, col_ids, tiling))
  return (_zero_ids(batch, rows, row_multiple), _zero_ids(batch, cols, col_multiple),
          np.repeat(band_ranges(rows, cols, tiling), batch, axis=0))


def last_first(batch: int, tiles: int) -> np.ndarray:
  """(batch * tiles,) int32 launch order: each batch's tiles from the last down, batches in
  order. The masked forward's order: a causal query tile sees more keys than the tiles before
  it in its document, so this is longest first within each document, one document at a time
  (whose K and V the tiles in flight share in L2), and it needs no sort on the device."""
  tiles_of = np.arange(tiles - 1, -1, -1, dtype=np.int32)
  return (np.arange(batch, dtype=np.int32)[:, None] * tiles + tiles_of).reshape(-1)


def forward_operands(variant: KernelVariant, config: AttentionConfig, batch: int, seq_q: int,
                     seq_k: int, segment_ids=(), block_mask=None):
  """The masked forward's operands, in custom-call order (kernel_abi.h JaxflashMask): query
  ids, key ids (padded to tiles / blocks), block ranges of the query tiles in launch order,
  the launch order (last_first: a constant, so the ranges in launch order are the ranges
  reversed along the tiles). block_mask: a mask_mod's block_mask.BlockMask, whose ranges
  narrow those of the segment ids and the band (a call with a mask_mod must pass it: blocks
  in the full range skip the elementwise mask, mask_mod's included)."""
  s = variant.schedule
  tiling = forward_tiling(s.tile_m, s.tile_n, seq_q, seq_k, window_bounds(config))
  q_ids, kv_ids, ranges = _ranges_and_ids(segment_ids, tiling, batch, seq_q, seq_k, s.tile_m,
                                          s.tile_n)
  if block_mask is not None:
    ranges = _narrowed(ranges, block_mask, tiling, batch, transpose=False)
  return q_ids, kv_ids, ranges[:, ::-1], last_first(batch, ranges.shape[1])


def _narrowed(ranges, block_mask, tiling: Tiling, batch: int, transpose: bool):
  """ranges (NumPy constants or device arrays, batch or 1 rows) intersected with the block
  mask's ranges for the same tiling, on the device."""
  return block_masks.intersect_ranges(
      jnp.asarray(ranges), block_masks.tile_ranges(block_mask, tiling, batch, transpose))


def _section_blocks(heads: int, dims: int, block: int) -> int:
  """Blocks of the visited side whose tensors (heads x dims 16-bit values per position) fit
  the L2 budget together."""
  return max(1, L2_BYTES_FOR_REUSE // (heads * dims * 2 * block))


def backward_operands(variant: KernelVariant, config: AttentionConfig, batch: int, seq_q: int,
                      seq_k: int, num_heads: int, num_kv_heads: int, segment_ids=(),
                      block_mask=None):
  """The masked backward's operands, in custom-call order: key ids, query ids (padded to key
  tiles / query blocks), block ranges of the key tiles in launch order, the CTA launch order
  (longest first), and for deterministic variants the ranks of each contribution in that
  order. A section holds the query blocks of the heads whose key tiles run together: one kv
  head's query heads (the kernel runs one kv head at a time), or every head for deterministic
  variants (the kv heads of an entry run together; bwd_sm90 _launch_entry). block_mask: as
  forward_operands'."""
  s = variant.schedule
  tiling = backward_tiling(s.tile_m, s.tile_n, seq_q, seq_k, window_bounds(config))
  kv_ids, q_ids, ranges = _ranges_and_ids(segment_ids[::-1], tiling, batch, seq_k, seq_q,
                                          s.tile_n, s.tile_m)
  if block_mask is not None:
    ranges = _narrowed(ranges, block_mask, tiling, batch, transpose=True)
  heads = num_heads if variant.deterministic else num_heads // num_kv_heads
  order = longest_first(ranges, _section_blocks(heads, variant.head_dim + variant.head_dim_v,
                                                s.tile_m))
  operands = (kv_ids, q_ids, in_launch_order(ranges, order), order)
  if variant.deterministic:
    operands += (_ranks_operand(ranges, order, -(-seq_q // s.tile_m)),)
  return operands


# The largest rank table (bytes, one batch) that a call without segment ids takes as a constant.
RANKS_CONSTANT_BYTES = 1 << 20


def _ranks_operand(ranges, order, num_blocks: int):
  """launch_ranks for the custom call. Trace-time ranges (NumPy, a call without segment ids) are
  alike in every batch: one batch's ranks become a constant, broadcast on the device, unless it
  would pass RANKS_CONSTANT_BYTES (sequences of tens of thousands), where the device computes
  the table from the constant ranges and order rather than the program carrying megabytes."""
  if _xp(ranges, order) is jnp:
    return launch_ranks(ranges, order, num_blocks)
  b, tiles = ranges.shape[:2]
  if tiles * num_blocks * 4 > RANKS_CONSTANT_BYTES:
    return launch_ranks(jnp.asarray(ranges), jnp.asarray(order), num_blocks)
  return jnp.broadcast_to(launch_ranks(ranges[:1], order[:tiles], num_blocks),
                          (b, tiles, num_blocks))
