"""Online softmax in the exp2 domain, and the register-fragment views it works on.

Imports cutlass only. Scores stay raw in the S accumulator; softmax_scale * log2(e) is folded
into one FFMA per element before ex2, so there is no separate scaling pass.
"""

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)
# The 4 lanes of a quad hold the columns of one accumulator row (WGMMA C fragment layout).
_THREADS_PER_ROW = 4


def make_acc_mn_view(acc: cute.Tensor) -> cute.Tensor:
  """Views a WGMMA accumulator fragment ((2, 2, V), MMA_M, MMA_N) as (rows, cols).

  Mode 0 of the fragment is (column pair, row +8, column group of 8); rows are (row +8, MMA_M),
  columns (pair, group, MMA_N).
  """
  l = acc.layout
  mn = cute.make_layout(
      ((l.shape[0][1], l.shape[1]), (l.shape[0][0], l.shape[0][2], l.shape[2])),
      stride=((l.stride[0][1], l.stride[1]), (l.stride[0][0], l.stride[0][2], l.stride[2])))
  return cute.make_tensor(acc.iterator, mn)


@cute.jit
def acc_to_operand_a(acc: cute.Tensor, dtype: cutlass.Constexpr) -> cute.Tensor:
  """Converts the fp32 S accumulator to `dtype` and views it as the A operand of an RS WGMMA.

  For 16-bit types a C fragment column-group pair (8 + 8 columns) holds exactly the registers
  of one k=16 A fragment ((2 k, 2 rows, 2 k-halves)), so only the view changes.
  """
  r = cute.make_rmem_tensor(acc.layout.shape, dtype)
  r.store(acc.load().to(dtype))
  l = r.layout
  a_layout = cute.make_layout(
      ((l.shape[0][0], l.shape[0][1], 2), l.shape[1], (l.shape[0][2] // 2, l.shape[2])),
      stride=((l.stride[0][0], l.stride[0][1], l.stride[0][2]), l.stride[1],
              (l.stride[0][2] * 2, l.stride[2])))
  return cute.make_tensor(r.iterator, a_layout)


class OnlineSoftmax:
  """Running row max and row sum of one thread's rows; rows are shared by a quad of lanes.

  row_max is kept in raw-score units; row_sum is this thread's partial sum (its columns only),
  reduced over the quad once, in `finalize`.
  """

  def __init__(self, scale_log2: Float32, num_rows: int):
    self.scale_log2 = scale_log2
    self.num_rows = num_rows
    self.row_max = cute.make_rmem_tensor(num_rows, Float32)
    self.row_sum = cute.make_rmem_tensor(num_rows, Float32)
    self.row_max.fill(-Float32.inf)
    self.row_sum.fill(0.0)

  @cute.jit
  def online_softmax(self, acc_s_mn: cute.Tensor, row_scale: cute.Tensor):
    """Overwrites acc_s_mn with exp2 of the scaled, max-shifted scores.

    Writes into row_scale the factor by which the O accumulator and row sums must shrink.
    A row whose max is still -inf (fully masked so far) uses 0 as its shift, so it yields
    p = 0 and scale = 0 instead of NaN.
    """
    for i in cutlass.range_constexpr(cute.size(acc_s_mn, mode=[0])):
      prev_max = self.row_max[i]
      cur_max = prev_max
      for j in cutlass.range_constexpr(cute.size(acc_s_mn, mode=[1])):
        cur_max = cute.arch.fmax(cur_max, acc_s_mn[i, j])
      cur_max = cute.arch.warp_reduction_max(cur_max, threads_in_group=_THREADS_PER_ROW)
      self.row_max[i] = cur_max
      safe_max = cur_max
      if cur_max == -Float32.inf:
        safe_max = Float32(0.0)
      shift = safe_max * self.scale_log2
      scale = cute.math.exp2(prev_max * self.scale_log2 - shift, fastmath=True)
      row_scale[i] = scale
      row_sum = Float32(0.0)
      for j in cutlass.range_constexpr(cute.size(acc_s_mn, mode=[1])):
        p = cute.math.exp2(acc_s_mn[i, j] * self.scale_log2 - shift, fastmath=True)
        acc_s_mn[i, j] = p
        row_sum += p
      self.row_sum[i] = self.row_sum[i] * scale + row_sum

  @cute.jit
  def finalize(self, row_inv: cute.Tensor, lse: cute.Tensor):
    """Writes 1/rowsum (0 for empty rows) and the natural-log LSE (-inf for empty rows).

    lse = max * softmax_scale + ln(sum) = (max * scale_log2 + log2(sum)) * ln(2).
    """
    for i in cutlass.range_constexpr(self.num_rows):
      row_sum = cute.arch.warp_reduction_sum(self.row_sum[i], threads_in_group=_THREADS_PER_ROW)
      # Any visible key contributes exp2(0) = 1, so a sum that is not > 0 (0, or NaN from a
      # caller's NaN input) means no usable key: output 0, lse -inf.
      inv = Float32(0.0)
      row_lse = -Float32.inf
      if row_sum > 0.0:
        inv = cute.arch.rcp_approx(row_sum)
        row_lse = (self.row_max[i] * self.scale_log2
                   + cute.math.log2(row_sum, fastmath=True)) * LN_2
      row_inv[i] = inv
      lse[i] = row_lse


@cute.jit
def scale_rows(acc_mn: cute.Tensor, row_scale: cute.Tensor):
  """acc_mn[i, j] *= row_scale[i] (rescales or normalises the O accumulator)."""
  for i in cutlass.range_constexpr(cute.size(acc_mn, mode=[0])):
    for j in cutlass.range_constexpr(cute.size(acc_mn, mode=[1])):
      acc_mn[i, j] = acc_mn[i, j] * row_scale[i]
