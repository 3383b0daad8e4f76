"""Maps CTAs to (m_block, head, batch) work tiles over a linear tile index (1-D grid).

Imports cutlass and jaxflash.config only. Static schedules: the producer warp and the consumer
warpgroups walk the same tile sequence: tile = first_tile(); while tile < total_tiles: ...;
tile = next_tile(tile). Dynamic schedules: the producer warp claims each next tile from a
counter in global memory (first_claim, claim) and hands it to the consumers (the forward kernel
puts it beside the tile's Q).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from jaxflash import config

# Persistent grids launch at most this many CTAs: the SM count of H100 SXM / H200, the largest
# sm_90 parts. Smaller parts (H100 PCIe: 114 SMs) are handled in-kernel with %nsmid.
MAX_PERSISTENT_CTAS = 132
# Bytes of L2 that the K and V of one head section may fill.
_L2_BYTES_FOR_KV = config.L2_BYTES_FOR_REUSE


class StaticTileScheduler:
  """Static schedule of num_m_blocks * num_heads * batch tiles over a 1-D grid.

  Order without `lpt`: m_block fastest, then head, then batch (the CTAs in flight share K/V of
  one head in L2). With `lpt` (causal): batch outermost, then sections of (batch, head) pairs
  whose K and V fit in L2 together, and inside a section m_block from the last (most keys) down,
  heads fastest: longest-processing-time first, with L2 reuse of each section's K/V.
  `persistent`: grid = min(tiles, MAX_PERSISTENT_CTAS); each CTA walks every stride-th tile
  (its next tile's loads overlap its epilogue), or, with a dynamic schedule, claims its next
  tile (first_claim, claim); else one CTA per tile.
  """

  def __init__(self, num_m_blocks: Int32, num_heads: Int32, batch: Int32, seqlen_k: Int32,
               kv_bytes_per_key: cutlass.Constexpr, lpt: cutlass.Constexpr,
               persistent: cutlass.Constexpr):
    self.num_m_blocks = num_m_blocks
    self.num_heads = num_heads
    self.num_hb = num_heads * batch
    self.total_tiles = num_m_blocks * self.num_hb
    self.lpt = lpt
    self.persistent = persistent
    self.section = Int32(1)
    if cutlass.const_expr(lpt):
      self.section = _heads_per_section(seqlen_k, _L2_BYTES_FOR_KV // kv_bytes_per_key)
    self.stride = self.total_tiles
    if cutlass.const_expr(persistent):
      # %nsmid < grid: the CTAs past it would only run after the others finished; let the
      # first nsmid CTAs take all the tiles instead. A grid of every tile (at most
      # MAX_PERSISTENT_CTAS tiles): one tile per CTA.
      grid = cute.arch.grid_dim()[0]
      stride = cutlass.min(grid, cute.arch.nsmid())
      self.stride = stride + (self.total_tiles - stride) * Int32(grid >= self.total_tiles)

  # Run-time fields: the DSL carries the object through the tile loop as these values.
  _DYNAMIC_FIELDS = ("num_m_blocks", "num_heads", "num_hb", "total_tiles", "section", "stride")

  def __extract_mlir_values__(self):
    return [Int32(getattr(self, f)).ir_value() for f in self._DYNAMIC_FIELDS]

  def __new_from_mlir_values__(self, values):
    new = object.__new__(StaticTileScheduler)
    new.lpt, new.persistent = self.lpt, self.persistent
    for field, value in zip(self._DYNAMIC_FIELDS, values):
      setattr(new, field, Int32(value))
    return new

  @staticmethod
  def grid_shape(num_m_blocks, num_heads, batch, persistent: bool):
    """Host side: the launch grid (a 1-D grid has no 65535 limit on heads or batch)."""
    total = num_m_blocks * num_heads * batch
    if persistent:
      return (cutlass.min(total, MAX_PERSISTENT_CTAS), 1, 1)
    return (total, 1, 1)

  @cute.jit
  def first_tile(self) -> Int32:
    """This CTA's first tile index; total_tiles when it has none."""
    bidx = cute.arch.block_idx()[0]
    tile = bidx
    if bidx >= self.stride:
      tile = self.total_tiles
    return tile

  @cute.jit
  def next_tile(self, tile: Int32) -> Int32:
    return tile + self.stride

  @cute.jit
  def first_claim(self, counter: cute.Tensor) -> Int32:
    """Dynamic schedules (a persistent grid): this CTA's first tile, its own index where it is
    one of the first stride CTAs (those resident at once), else claimed (claim)."""
    tile = cute.arch.block_idx()[0]
    if tile >= self.stride:
      tile = self.claim(counter)
    return tile

  @cute.jit
  def claim(self, counter: cute.Tensor) -> Int32:
    """Dynamic schedules: the next unclaimed tile, stride + the counter's old value (counter: one
    int32 in global memory, zero at launch). Lane 0 of the calling warp adds 1 to it, the whole
    warp gets the tile. Tiles are claimed in index order (with `lpt`, longest first), each by
    the first CTA that asks: a greedy schedule, as the hardware's one CTA per tile, whose CTAs
    keep their shared memory, barriers and next tile's loads across tiles. Past total_tiles:
    no more work."""
    old = Int32(0)
    if cute.arch.lane_idx() == 0:
      old = cute.arch.atomic_add(counter.iterator, Int32(1), sem="relaxed", scope="gpu")
    return cute.arch.shuffle_sync(old, 0) + self.stride

  @cute.jit
  def decode(self, tile: Int32):
    """(m_block, head, batch) of a tile index < total_tiles."""
    m_idx = tile % self.num_m_blocks
    hb = tile // self.num_m_blocks
    m_block = m_idx
    if cutlass.const_expr(self.lpt):
      per_section = self.section * self.num_m_blocks
      sec = tile // per_section
      rem = tile - sec * per_section
      first_hb = sec * self.section
      # The last section may hold fewer (batch, head) pairs.
      size = cutlass.min(self.section, self.num_hb - first_hb)
      m_idx = rem // size
      hb = first_hb + rem - m_idx * size
      m_block = self.num_m_blocks - 1 - m_idx
    batch = hb // self.num_heads
    head = hb - batch * self.num_heads
    return m_block, head, batch

  @cute.jit
  def decode_ordered(self, tile: Int32, order: cute.Tensor):
    """(m_block, head, batch, slot) of a tile index < total_tiles when a tile list sets the
    order (masked variants): entry tile // num_heads of `order` holds batch * num_m_blocks +
    m_block, the heads of one entry are consecutive tiles, and each batch's num_m_blocks entries
    are consecutive (batch = entry // num_m_blocks, known before the order is read). slot: the
    entry's place in its batch's part of the order, where the block ranges stand in launch
    order (jaxflash/block_ranges.py in_launch_order)."""
    entry = tile // self.num_heads
    head = tile - entry * self.num_heads
    batch = entry // self.num_m_blocks
    slot = entry - batch * self.num_m_blocks
    return order[entry] - batch * self.num_m_blocks, head, batch, slot


@cute.jit
def _heads_per_section(seqlen_k: Int32, keys_in_l2: cutlass.Constexpr) -> Int32:
  """How many heads' K and V (seqlen_k keys each) fit in the L2 budget, as a power of 2 >= 1."""
  n = cutlass.max(Int32(keys_in_l2) // cutlass.max(seqlen_k, Int32(1)), Int32(1))
  # Round down to a power of 2: smear the top bit right, then keep only it.
  n = n | (n >> 1)
  n = n | (n >> 2)
  n = n | (n >> 4)
  n = n | (n >> 8)
  n = n | (n >> 16)
  return n - (n >> 1)
