"""The merge of the split-KV decode kernel's partial results (kernels/decode_sm90.py launches it
right after the splits): each query row's splits weighted by their lse, with the sink.

Imports cutlass and the sibling helper modules only (never jax).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from jaxflash.kernels import softmax

_WARP = 32


class DecodeCombine:
  """Merges the num_splits partial results of each packed query row into its output and its lse.

  One warp per (row, kv head, batch). Each lane takes the splits lane, lane + 32, ... and keeps
  their largest lse and the sum of their weights against it; two warp reductions give the
  row's largest lse m (the learnable sink, one logit per query head with no value, joins it)
  and the sum of all weights exp(lse_s - m). Then, 32 splits at a time, lane t computes split
  t's weight once and shuffles hand it to the warp, whose lanes own head_dim_v / 32 output
  columns each: the weighted sum of the splits' partial outputs over the weights' sum, in the
  output dtype. A row that no split gave a key and that has no sink writes 0 and lse -inf; with
  a sink, 0 and the sink. A NaN in a split's lse or output reaches the row's output and lse.
  An empty sink tensor (num_kv_heads, 0) means no sink.
  """

  def __init__(self, dtype, head_dim_v: int):
    assert head_dim_v % _WARP == 0, head_dim_v
    self.dtype = dtype
    self.head_dim_v = head_dim_v
    self.cols_per_lane = head_dim_v // _WARP

  @cute.jit
  def __call__(
      self,
      mOPart: cute.Tensor,  # (batch, num_splits, num_kv_heads, rows, head_dim_v) float32
      mLSEPart: cute.Tensor,  # (batch, num_splits, num_kv_heads, rows) float32
      mSink: cute.Tensor,  # (num_kv_heads, group or 0) float32: query head kv * group + j's
      mO: cute.Tensor,  # (batch, num_kv_heads, rows, head_dim_v) in the output dtype
      mLSE: cute.Tensor,  # (batch, num_kv_heads, rows) float32
      stream,
  ):
    grid = (mO.shape[2], mO.shape[1], mO.shape[0])
    self.kernel(mOPart, mLSEPart, mSink, mO, mLSE).launch(grid=grid, block=[_WARP, 1, 1],
                                                          stream=stream)

  @cute.kernel
  def kernel(self, mOPart: cute.Tensor, mLSEPart: cute.Tensor, mSink: cute.Tensor,
             mO: cute.Tensor, mLSE: cute.Tensor):
    lane, _, _ = cute.arch.thread_idx()
    row, head_kv, batch = cute.arch.block_idx()
    num_splits = mOPart.shape[1]
    # Row i * group + j holds query head kv * group + j: its sink, in log2 units.
    sink_log2 = -Float32.inf
    if mSink.shape[1] > 0:
      sink_log2 = mSink[head_kv, row % mSink.shape[1]] * softmax.LOG2_E
    # This lane's splits: their largest lse (log2 units) and their weights' sum against it.
    lane_max = -Float32.inf
    lane_sum = Float32(0.0)
    for s in cutlass.range(lane, num_splits, _WARP, unroll=1):
      x = mLSEPart[batch, s, head_kv, row] * softmax.LOG2_E
      new_max = cute.arch.fmax(lane_max, x, nan=True)
      if new_max != -Float32.inf:
        lane_sum = (lane_sum * cute.math.exp2(lane_max - new_max, fastmath=True)
                    + cute.math.exp2(x - new_max, fastmath=True))
      lane_max = new_max
    top = cute.arch.warp_reduction_max(lane_max, threads_in_group=_WARP)
    top = cute.arch.fmax(top, sink_log2, nan=True)
    if top == -Float32.inf:  # no key and no sink: every weight is 0
      top = Float32(0.0)
    lane_sum = lane_sum * cute.math.exp2(lane_max - top, fastmath=True)
    total = cute.arch.warp_reduction_sum(lane_sum, threads_in_group=_WARP)
    total += cute.math.exp2(sink_log2 - top, fastmath=True)
    acc = cute.make_rmem_tensor(self.cols_per_lane, Float32)
    acc.fill(0.0)
    for base in cutlass.range(0, num_splits, _WARP, unroll=1):
      weight = Float32(0.0)
      if base + lane < num_splits:
        weight = cute.math.exp2(mLSEPart[batch, base + lane, head_kv, row] * softmax.LOG2_E
                                - top, fastmath=True)
      # Unrolled so that several splits' loads are in flight at once.
      for t in cutlass.range(cutlass.min(num_splits - base, _WARP), unroll=4):
        w = cute.arch.shuffle_sync(weight, t)
        for c in cutlass.range_constexpr(self.cols_per_lane):
          acc[c] += w * mOPart[batch, base + t, head_kv, row, lane + c * _WARP]
    inv = Float32(0.0)
    lse = -Float32.inf
    if total != 0.0:  # NaN compares unequal and flows on
      inv = cute.arch.rcp_approx(total)
      lse = (top + cute.math.log2(total, fastmath=True)) * softmax.LN_2
    for c in cutlass.range_constexpr(self.cols_per_lane):
      mO[batch, head_kv, row, lane + c * _WARP] = self.dtype(acc[c] * inv)
    if lane == 0:
      mLSE[batch, head_kv, row] = lse
