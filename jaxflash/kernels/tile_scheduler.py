"""Maps CTAs to (m_block, head, batch) work tiles; one class per scheduling policy.

Imports cutlass only. A persistent LPT scheduler can replace SingleTileScheduler behind the same
`grid_shape` / `work_tile` interface.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32


class SingleTileScheduler:
  """One CTA per (m_block, head, batch) tile; grid = (num_m_blocks, num_heads, batch).

  With `reverse_m`, CTA x handles m_block num_m_blocks-1-x: under a causal mask the last m blocks
  see the most keys, and launching them first shortens the tail of the grid (poor man's LPT).
  """

  def __init__(self, reverse_m: bool):
    self.reverse_m = reverse_m

  @staticmethod
  def grid_shape(num_m_blocks, num_heads, batch):
    return (num_m_blocks, num_heads, batch)

  @cute.jit
  def work_tile(self, num_m_blocks: Int32):
    """The (m_block, head, batch) of this CTA."""
    bidx, bidy, bidz = cute.arch.block_idx()
    m_block = bidx
    if cutlass.const_expr(self.reverse_m):
      m_block = num_m_blocks - 1 - bidx
    return m_block, bidy, bidz
