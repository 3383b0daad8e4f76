"""Which blocks a masked kernel visits: per-tile block ranges from segment ids and windows.

The masked kernels (config.KernelVariant.masked) visit, for each tile of one side (query tiles
in the forward, key tiles in the backward), a contiguous range of blocks of the other side, and
apply the elementwise mask only outside a sub-range where every (query, key) pair of the tile
pair is visible. Segment ids are run-time data, so the primitive's CUDA lowering computes these
ranges on the device with the XLA ops below, never at trace time. Contiguous segments (packed
documents, trailing padding) get tight ranges; other ids stay correct through the elementwise
mask over the hull of their keys. Imports jax and config only.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxflash.config import WINDOW_UNBOUNDED as UNBOUNDED
from jaxflash.config import L2_BYTES_FOR_REUSE, AttentionConfig, KernelVariant


def window_bounds(config: AttentionConfig) -> tuple[int, int]:
  """(left, right) of the call's band, causal folded in: query i sees keys j with
  i' - left <= j <= i' + right, i' = i + seq_k - seq_q; UNBOUNDED where a side has no bound."""
  left = UNBOUNDED if config.window_left is None else config.window_left
  right = UNBOUNDED if config.window_right is None else config.window_right
  if config.causal:
    right = min(right, 0)
  return max(min(left, UNBOUNDED), -UNBOUNDED), max(min(right, UNBOUNDED), -UNBOUNDED)


@dataclasses.dataclass(frozen=True)
class Tiling:
  """One side's tiles against the other side's blocks (sizes static, from the schedule).

  Row r of the tiled side sees column c of the other side iff r + lo_offset <= c <= r +
  hi_offset, their ids are equal, and c < num_cols. Padding rows of the last tile (r >=
  num_rows) are ignored, unless `row_padding_masked` (then a tile holding them is never
  free of the mask); columns >= num_cols are masked unless `col_padding_harmless`.
  """

  row_tile: int
  col_tile: int
  lo_offset: int
  hi_offset: int
  row_padding_masked: bool
  col_padding_harmless: bool


def forward_tiling(tile_m: int, tile_n: int, seq_q: int, seq_k: int,
                   bounds: tuple[int, int]) -> Tiling:
  """Query tiles of tile_m rows against key blocks of tile_n: padding queries are not stored,
  padding keys must be masked."""
  left, right = bounds
  off = seq_k - seq_q
  return Tiling(tile_m, tile_n, off - left, off + right, row_padding_masked=False,
                col_padding_harmless=False)


def backward_tiling(tile_m: int, tile_n: int, seq_q: int, seq_k: int,
                    bounds: tuple[int, int]) -> Tiling:
  """Key tiles of tile_n rows against query blocks of tile_m: key j sees query i iff
  i' - left <= j <= i' + right, i.e. j - off - right <= i <= j - off + left. Padding keys must
  be masked (their P would multiply zero-filled K rows); padding queries are harmless (the
  preprocess gives them lse2 = +inf, so P = 0)."""
  left, right = bounds
  off = seq_k - seq_q
  return Tiling(tile_n, tile_m, -off - right, -off + left, row_padding_masked=True,
                col_padding_harmless=True)


def _id_hulls(row_ids, col_ids):
  """For every row id: (first, last + 1, count) of the columns with that id, (0, 0, 0) if none.

  row_ids (b, rows), col_ids (b, cols) int32. A stable sort of the columns by id keeps equal
  ids in index order, so the first and last of a run in sorted order are the first and last
  index."""
  num_cols = col_ids.shape[1]
  order = jnp.argsort(col_ids, axis=-1, stable=True)
  sorted_ids = jnp.take_along_axis(col_ids, order, axis=-1)
  # method="sort": one sort, no while loop (XLA runs a loop's condition on the host: the
  # default binary search cost ~0.6 ms per call at 16k tokens on the H200).
  search = lambda side: jax.vmap(lambda s, v: jnp.searchsorted(s, v, side=side, method="sort"))
  left = search("left")(sorted_ids, row_ids)
  right = search("right")(sorted_ids, row_ids)
  count = right - left
  first = jnp.take_along_axis(order, jnp.clip(left, 0, num_cols - 1), axis=-1)
  last = jnp.take_along_axis(order, jnp.clip(right - 1, 0, num_cols - 1), axis=-1)
  some = count > 0
  return (jnp.where(some, first, 0).astype(jnp.int32),
          jnp.where(some, last + 1, 0).astype(jnp.int32), count.astype(jnp.int32))


def _floor_div(a, b: int):
  return jnp.floor_divide(a, b)


def _ceil_div(a, b: int):
  return -jnp.floor_divide(-a, b)


def block_ranges(row_ids, col_ids, tiling: Tiling):
  """(b, tiles, 4) int32: per row tile [start, end) of the column blocks holding a visible
  column, and [full_lo, full_hi) within it, the blocks where every pair is visible (the rest
  need the elementwise mask); start = end (no block) for a tile that sees nothing.

  row_ids (b, num_rows), col_ids (b, num_cols) int32 segment ids.
  """
  b, num_rows = row_ids.shape
  num_cols = col_ids.shape[1]
  rt, ct = tiling.row_tile, tiling.col_tile
  tiles = -(-num_rows // rt)
  first, end_id, count = _id_hulls(row_ids, col_ids)
  rows = jnp.arange(num_rows, dtype=jnp.int32)[None, :]
  lo = jnp.maximum(jnp.maximum(rows + tiling.lo_offset, first), 0)
  hi = jnp.minimum(jnp.minimum(rows + tiling.hi_offset + 1, end_id), num_cols)
  seen = lo < hi

  def per_tile(x, fill):
    """(b, num_rows) -> (b, tiles, rt), padding rows set to `fill`."""
    x = jnp.pad(x, ((0, 0), (0, tiles * rt - num_rows)), constant_values=fill)
    return x.reshape(b, tiles, rt)

  big = jnp.iinfo(jnp.int32).max
  start = jnp.min(per_tile(jnp.where(seen, lo, big), big), axis=-1)
  end = jnp.max(per_tile(jnp.where(seen, hi, 0), 0), axis=-1)
  any_seen = start < end
  start_blk = jnp.where(any_seen, _floor_div(start, ct), 0)
  end_blk = jnp.where(any_seen, _ceil_div(end, ct), 0)

  # Blocks free of the mask. Window: every column of the block inside every row's band.
  tile_idx = jnp.arange(tiles, dtype=jnp.int32)
  r_min = tile_idx * rt
  r_max = jnp.minimum(r_min + rt, num_rows) - 1
  full_lo = _ceil_div(r_max + tiling.lo_offset, ct)
  full_hi = _floor_div(r_min + tiling.hi_offset + 1, ct)
  if not tiling.col_padding_harmless:
    full_hi = jnp.minimum(full_hi, num_cols // ct)
  if tiling.row_padding_masked:
    full_hi = jnp.where(r_min + rt > num_rows, full_lo, full_hi)
  full_lo, full_hi = full_lo[None, :], full_hi[None, :]
  # Segments: one id in the tile's rows, whose columns are one contiguous run.
  ids = per_tile(row_ids, 0)
  valid = per_tile(jnp.ones_like(row_ids, dtype=bool), False)
  id_min = jnp.min(jnp.where(valid, ids, big), axis=-1)
  id_max = jnp.max(jnp.where(valid, ids, -big - 1), axis=-1)
  run_first = per_tile(first, 0)[:, :, 0]
  run_end = per_tile(end_id, 0)[:, :, 0]
  run_count = per_tile(count, 0)[:, :, 0]
  one_run = (id_min == id_max) & (run_count > 0) & (run_count == run_end - run_first)
  full_lo = jnp.maximum(jnp.maximum(full_lo, _ceil_div(run_first, ct)), start_blk)
  full_hi = jnp.minimum(jnp.minimum(full_hi, _floor_div(run_end, ct)), end_blk)
  has_full = one_run & (full_lo < full_hi)
  full_lo = jnp.where(has_full, full_lo, start_blk)
  full_hi = jnp.where(has_full, full_hi, start_blk)
  return jnp.stack([start_blk, end_blk, full_lo, full_hi], axis=-1).astype(jnp.int32)


def longest_first(ranges, section_blocks: int):
  """(b * tiles,) int32 launch order: entry b * tiles + t names tile t of batch b.

  Longest first (most blocks) within sections of tiles whose ranges start in the same
  `section_blocks` blocks, whose data therefore stays in L2 while they run (a global
  longest-first order over packed documents mixes all documents and thrashed it); batches
  in order, sections from the last down (the causal LPT order of the dense kernels)."""
  b, tiles = ranges.shape[:2]
  work = ranges[..., 1] - ranges[..., 0]
  section = ranges[..., 0] // max(section_blocks, 1)
  batch = jnp.arange(b, dtype=jnp.int32)[:, None]
  # Sort keys, most significant first: batch, section (descending), work (descending).
  order = jnp.lexsort((-work.reshape(-1), -section.reshape(-1),
                       jnp.broadcast_to(batch, (b, tiles)).reshape(-1)))
  return order.astype(jnp.int32)


def descending_tiles(batch: int, tiles: int):
  """(batch * tiles,) int32: each batch's tiles from the last down (the deterministic backward's
  launch order: a key block waits only for key blocks launched before it)."""
  t = jnp.arange(tiles - 1, -1, -1, dtype=jnp.int32)
  return (jnp.arange(batch, dtype=jnp.int32)[:, None] * tiles + t[None, :]).reshape(-1)


def descending_ranks(ranges, num_blocks: int):
  """(b, tiles, num_blocks) int32: rank[b, t, m] = how many tiles t' > t of batch b visit block
  m (m in [start, end) of t'): the position of tile t's contribution to block m in the
  deterministic backward's fixed order (descending tiles)."""
  m = jnp.arange(num_blocks, dtype=jnp.int32)
  visits = ((ranges[..., 0:1] <= m) & (m < ranges[..., 1:2])).astype(jnp.int32)
  after = jnp.cumsum(visits[:, ::-1], axis=1)[:, ::-1] - visits
  return after.astype(jnp.int32)


def padded_ids(ids, multiple: int):
  """(b, n) int32 ids padded with zeros to a multiple of `multiple` (the kernels copy whole
  blocks of them; padding positions are masked or harmless)."""
  n = ids.shape[1]
  pad = -(-n // multiple) * multiple - n
  return jnp.pad(ids.astype(jnp.int32), ((0, 0), (0, pad)))


def _ids_or_zeros(segment_ids, seq_q: int, seq_k: int, batch: int):
  """(q_ids, kv_ids) int32; zeros (one segment) for a call without segment ids."""
  if segment_ids:
    return tuple(jnp.asarray(ids, jnp.int32) for ids in segment_ids)
  return jnp.zeros((batch, seq_q), jnp.int32), jnp.zeros((batch, seq_k), jnp.int32)


def forward_operands(variant: KernelVariant, config: AttentionConfig, batch: int, seq_q: int,
                     seq_k: int, num_kv_heads: int, segment_ids=()):
  """The masked forward's operands, in custom-call order (kernel_abi.h JaxflashMask): query
  ids, key ids (padded to tiles / blocks), block ranges per query tile, tile order."""
  s = variant.schedule
  q_ids, kv_ids = _ids_or_zeros(segment_ids, seq_q, seq_k, batch)
  tiling = forward_tiling(s.tile_m, s.tile_n, seq_q, seq_k, window_bounds(config))
  ranges = block_ranges(q_ids, kv_ids, tiling)
  section = _section_blocks(num_kv_heads, variant.head_dim + variant.head_dim_v, s.tile_n)
  return (padded_ids(q_ids, s.tile_m), padded_ids(kv_ids, s.tile_n), ranges,
          longest_first(ranges, section))


def _section_blocks(heads: int, dims: int, block: int) -> int:
  """Blocks of the visited side whose tensors (heads x dims 16-bit values per position) fit
  the L2 budget together."""
  return max(1, L2_BYTES_FOR_REUSE // (heads * dims * 2 * block))


def backward_operands(variant: KernelVariant, config: AttentionConfig, batch: int, seq_q: int,
                      seq_k: int, num_heads: int, segment_ids=()):
  """The masked backward's operands, in custom-call order: key ids, query ids (padded to key
  tiles / query blocks), block ranges per key tile, CTA order (deterministic: each batch's key
  tiles from the last down, else longest first), and for deterministic variants the ranks."""
  s = variant.schedule
  q_ids, kv_ids = _ids_or_zeros(segment_ids, seq_q, seq_k, batch)
  tiling = backward_tiling(s.tile_m, s.tile_n, seq_q, seq_k, window_bounds(config))
  ranges = block_ranges(kv_ids, q_ids, tiling)
  tiles = ranges.shape[1]
  if variant.deterministic:
    order = descending_tiles(batch, tiles)
  else:
    order = longest_first(ranges, _section_blocks(num_heads, variant.head_dim
                                                  + variant.head_dim_v, s.tile_m))
  operands = (padded_ids(kv_ids, s.tile_n), padded_ids(q_ids, s.tile_m), ranges, order)
  if variant.deterministic:
    operands += (descending_ranks(ranges, -(-seq_q // s.tile_m)),)
  return operands
