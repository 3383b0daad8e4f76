"""Block masks of a mask_mod: which blocks of (query, key) pairs it leaves empty, partial or full.

create_block_mask evaluates mask_mod(batch, head, q_idx, kv_idx) on every pair, a chunk of
query rows at a time, and keeps per block of BLOCK x BLOCK pairs whether any pair is visible
and whether all are. It is a pytree of two boolean arrays, made once per step and passed to
every layer's call (FlexAttention's BlockMask plays the same part), or made by the call itself.
A mask_mod that ignores its batch or head argument gets a block mask of batch or head 1.

The masked kernels visit, per tile, one contiguous range of blocks and skip the elementwise
mask inside a run of blocks that need none (jaxflash/block_ranges.py). tile_ranges turns a
block mask into those ranges for a kernel's tiling, which must be whole blocks: the hull of
the tile's visible blocks (an empty block between two visible ones is visited and masked
elementwise) and the longest run of full blocks, over all heads of the batch, since the
kernels take one range per (batch, tile). Masks whose visible blocks per tile are contiguous
(causal, windows, documents, prefix-LM, chunked attention) skip every empty block.
Imports jax and numpy only.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np

if TYPE_CHECKING:
  from jaxflash.block_ranges import Tiling

# Pairs per block side. Every kernel tile (64, 80, 96, 128, 176 and 192 rows or columns) is a
# whole number of blocks.
BLOCK = 16
# Pairs evaluated per step of create_block_mask (bounds its memory, not its work).
_PAIRS_PER_STEP = 1 << 26


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockMask:
  """visit[b, h, i, j]: some pair of query block i and key block j is visible; full[b, h, i,
  j]: every pair of the block (inside seq_q x seq_k) is. Shapes (batch or 1, heads or 1,
  ceil(seq_q / BLOCK), ceil(seq_k / BLOCK)), a dim of 1 where mask_mod ignores that argument.
  """

  visit: jax.Array
  full: jax.Array
  seq_q: int = dataclasses.field(metadata=dict(static=True))
  seq_k: int = dataclasses.field(metadata=dict(static=True))

  def check_call(self, batch: int, heads: int, seq_q: int, seq_k: int) -> None:
    """Raises ValueError naming block_mask where it was made for another call's shape."""
    b, h = self.visit.shape[:2]
    if (self.seq_q, self.seq_k) != (seq_q, seq_k) or b not in (1, batch) or h not in (1, heads):
      raise ValueError(
          f"block_mask: made for batch {b}, heads {h}, seq_q {self.seq_q}, seq_k {self.seq_k}; "
          f"the call has batch {batch}, heads {heads}, seq_q {seq_q}, seq_k {seq_k} (batch and "
          "heads may be 1 in the block mask)")


def _used_args(mask_mod: Callable, num_args: int) -> tuple[bool, ...]:
  """Which scalar int32 arguments the traced mask_mod reads (an argument that only reaches
  a nested call counts as read)."""
  index = jax.ShapeDtypeStruct((), jnp.int32)
  jaxpr = jax.make_jaxpr(mask_mod)(*(index,) * num_args).jaxpr
  read = set()
  for eqn in jaxpr.eqns:
    read.update(v for v in eqn.invars if isinstance(v, jax.extend.core.Var))
  read.update(v for v in jaxpr.outvars if isinstance(v, jax.extend.core.Var))
  return tuple(v in read for v in jaxpr.invars)


def create_block_mask(mask_mod: Callable, batch: int, heads: int, seq_q: int,
                      seq_k: int) -> BlockMask:
  """The BlockMask of mask_mod(batch, head, q_idx, kv_idx) -> bool over (batch, heads, seq_q,
  seq_k) pairs (raw positions: q_idx in [0, seq_q), kv_idx in [0, seq_k)).

  Runs in XLA (under jit too), query rows in chunks, every pair once: make it once per step
  and pass it to every layer's call with the same mask_mod and shapes.
  """
  for name, value in (("batch", batch), ("heads", heads), ("seq_q", seq_q), ("seq_k", seq_k)):
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
      raise ValueError(f"create_block_mask: {name} must be an int >= 1, got {value!r}")
  uses_batch, uses_head, _, _ = _used_args(mask_mod, 4)
  b = batch if uses_batch else 1
  h = heads if uses_head else 1
  nq, nk = -(-seq_q // BLOCK), -(-seq_k // BLOCK)
  cols = nk * BLOCK
  # Query blocks per step: at least one, at most what keeps a step's pairs bounded.
  step_blocks = int(max(1, min(nq, _PAIRS_PER_STEP // (b * h * BLOCK * cols))))
  steps = -(-nq // step_blocks)

  fn = jax.vmap(mask_mod, in_axes=(None, None, None, 0))  # keys
  fn = jax.vmap(fn, in_axes=(None, None, 0, None))  # queries
  fn = jax.vmap(fn, in_axes=(None, 0, None, None))  # heads
  fn = jax.vmap(fn, in_axes=(0, None, None, None))  # batch
  bi, hi = jnp.arange(b, dtype=jnp.int32), jnp.arange(h, dtype=jnp.int32)
  kv = jnp.arange(cols, dtype=jnp.int32)

  def chunk(first_block):
    q = first_block * BLOCK + jnp.arange(step_blocks * BLOCK, dtype=jnp.int32)
    seen = fn(bi, hi, q, kv).astype(bool)
    if seen.shape != (b, h, q.shape[0], cols):
      raise ValueError(f"mask_mod: must return one boolean scalar per pair, got shape "
                       f"{seen.shape[4:]} per pair")
    inside = (q < seq_q)[:, None] & (kv < seq_k)[None, :]
    seen = (seen & inside).reshape(b, h, step_blocks, BLOCK, nk, BLOCK)
    # Pairs outside seq_q x seq_k count as visible for `full` (they are never stored).
    whole = (seen | ~inside.reshape(step_blocks, BLOCK, nk, BLOCK)).all(axis=(3, 5))
    return seen.any(axis=(3, 5)), whole

  visit, full = jax.lax.map(chunk, jnp.arange(steps, dtype=jnp.int32) * step_blocks)
  # (steps, b, h, step_blocks, nk) -> (b, h, nq, nk)
  visit, full = (x.transpose(1, 2, 0, 3, 4).reshape(b, h, steps * step_blocks, nk)[:, :, :nq]
                 for x in (visit, full))
  return BlockMask(visit, full & visit, seq_q, seq_k)


def tile_ranges(block_mask: BlockMask, tiling: Tiling, batch: int, transpose: bool):
  """(batch, tiles, 4) int32 block ranges (block_ranges.block_ranges' layout) of one side's
  tiles from the block mask: [start, end) the hull of the blocks the tile visits, [full_lo,
  full_hi) the longest run of full blocks in it (start, start if none), both over every head.

  tiling: forward tiles (rows queries) or, transpose, the backward's (rows keys); its tile
  and block sizes must be multiples of BLOCK. Padding rows and columns are the caller's (the
  band ranges' rules, intersected with these by intersect_ranges)."""
  rt, ct = tiling.row_tile, tiling.col_tile
  if rt % BLOCK or ct % BLOCK:
    raise ValueError(f"block_mask: tiles of {rt} x {ct} are not whole {BLOCK} x {BLOCK} blocks")
  visit, full = block_mask.visit.any(axis=1), block_mask.full.all(axis=1)  # over heads
  if transpose:
    visit, full = visit.transpose(0, 2, 1), full.transpose(0, 2, 1)
  b, rows, cols = visit.shape
  r, c = rt // BLOCK, ct // BLOCK
  tiles, blocks = -(-rows // r), -(-cols // c)

  def coarse(x, fill, reduce):
    x = jnp.pad(x, ((0, 0), (0, tiles * r - rows), (0, blocks * c - cols)),
                constant_values=fill)
    return reduce(x.reshape(b, tiles, r, blocks, c), axis=(2, 4))

  visit = coarse(visit, False, jnp.any)
  full = coarse(full, True, jnp.all) & visit
  blk = jnp.arange(blocks, dtype=jnp.int32)
  seen = visit.any(axis=-1)
  start = jnp.where(seen, jnp.min(jnp.where(visit, blk, blocks), axis=-1), 0)
  end = jnp.where(seen, jnp.max(jnp.where(visit, blk, -1), axis=-1) + 1, 0)
  # The longest run of full blocks: runs[k] = full blocks ending at k (k minus the last block
  # at or before k that is not full; a cumulative max, one XLA op rather than a loop over
  # blocks); ties take the first.
  last_partial = jax.lax.cummax(jnp.where(full, -1, blk), axis=full.ndim - 1)
  runs = blk - last_partial  # (b, tiles, blocks)
  longest = runs.max(axis=-1)
  full_hi = jnp.argmax(runs, axis=-1).astype(jnp.int32) + 1
  full_lo = full_hi - longest
  full_lo, full_hi = (jnp.where(longest > 0, x, start) for x in (full_lo, full_hi))
  ranges = jnp.stack([start, end, full_lo, full_hi], axis=-1).astype(jnp.int32)
  return jnp.broadcast_to(ranges, (batch, tiles, 4))


def intersect_ranges(a, b):
  """Block ranges visited by both: [max start, min end) and the full runs' overlap, each
  range empty (start = end = 0, full = start) where nothing is left. a, b: (batch or 1,
  tiles, 4) int32, NumPy or jax arrays."""
  start = jnp.maximum(a[..., 0], b[..., 0])
  end = jnp.minimum(a[..., 1], b[..., 1])
  seen = start < end
  start, end = jnp.where(seen, start, 0), jnp.where(seen, end, 0)
  full_lo = jnp.maximum(a[..., 2], b[..., 2])
  full_hi = jnp.minimum(a[..., 3], b[..., 3])
  has_full = seen & (full_lo < full_hi)
  full_lo, full_hi = jnp.where(has_full, full_lo, start), jnp.where(has_full, full_hi, start)
  return jnp.stack([start, end, full_lo, full_hi], axis=-1).astype(jnp.int32)
