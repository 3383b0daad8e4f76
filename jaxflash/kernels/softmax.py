"""Online softmax in the exp2 domain, and the register-fragment views it works on.

Imports cutlass only. Scores stay raw in the S accumulator; softmax_scale * log2(e) is folded
into one FFMA per element before ex2, so there is no separate scaling pass.
"""

import dataclasses
import math
import struct

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

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


def operand_a_view(acc: cute.Tensor) -> cute.Tensor:
  """Views a WGMMA accumulator-layout fragment as the A operand of an RS WGMMA (k = 16 blocks).

  A C fragment column-group pair (8 + 8 columns) holds exactly the registers of one k=16 A
  fragment ((2 k, 2 rows, 2 k-halves)), so only the view changes.
  """
  l = acc.layout
  a_layout = cute.make_layout(
      ((l.shape[0][0], l.shape[0][1], 2), l.shape[1], (l.shape[0][2] // 2, l.shape[2])),
      stride=((l.stride[0][0], l.stride[0][1], l.stride[0][2]), l.stride[1],
              (l.stride[0][2] * 2, l.stride[2])))
  return cute.make_tensor(acc.iterator, a_layout)


def make_p_fragment(acc_shape, dtype) -> cute.Tensor:
  """Registers for P = softmax(S) in `dtype`, in the RS WGMMA A-operand layout.

  Allocated once per warpgroup: with intra-warpgroup overlap P lives across loop iterations.
  """
  return operand_a_view(cute.make_rmem_tensor(acc_shape, dtype))


@dsl_user_op
def _cvt_pack(lo: Float32, hi: Float32, to_bf16: bool, *, loc=None, ip=None) -> Int32:
  """Two fp32 -> one packed bf16x2 / f16x2 register (lo in the low half).

  Inline asm with side effects: LLVM keeps it after the wgmma.wait_group before it; a plain
  conversion was sunk into the next loop iteration, carrying 64 fp32 registers across the
  back-edge instead of 32 packed ones (seen in the PTX).
  """
  kind = "bf16x2" if to_bf16 else "f16x2"
  return Int32(llvm.inline_asm(
      T.i32(), [Float32(lo).ir_value(loc=loc, ip=ip), Float32(hi).ir_value(loc=loc, ip=ip)],
      f"cvt.rn.{kind}.f32 $0, $2, $1;", "=r,f,f", has_side_effects=True, is_align_stack=False,
      asm_dialect=llvm.AsmDialect.AD_ATT))


@cute.jit
def convert_p(acc_s: cute.Tensor, p: cute.Tensor):
  """p = acc_s (fp32 accumulator layout) converted to p's type; p is in the A-operand layout."""
  src = operand_a_view(acc_s)
  dst = cute.recast_tensor(p, Int32)
  to_bf16 = p.element_type == cutlass.BFloat16
  for i in cutlass.range_constexpr(cute.size(dst)):
    dst[i] = _cvt_pack(src[2 * i], src[2 * i + 1], to_bf16)


# 2^f for f in [0, 1): 1 + c1 f + c2 f^2 + c3 f^3, a minimax fit of the relative error (8.6e-5,
# about 2^-13.5, below the bf16 / fp16 rounding of P). c0 = 1 exactly makes x = -127 give +0.
_EXP2_POLY = (0.69511684, 0.22764474, 0.07706727)
# 1.5 * 2^23: adding it (rounding down) leaves floor(x) in the low mantissa bits.
_ROUND_BIAS = 12582912.0


def _ptx_f32(value: float) -> str:
  return "0f%08X" % struct.unpack("<I", struct.pack("<f", value))[0]


@dsl_user_op
def exp2_fma(x: Float32, *, loc=None, ip=None) -> Float32:
  """2^x on the FMA and integer pipes instead of MUFU.EX2, for x <= 127.

  2^floor(x) goes into the exponent field by an integer add, the fraction through a cubic. x is
  clamped at -127: x <= -127 (also -inf, and NaN) gives exactly +0, like ex2.approx.ftz for such
  x. About 10 instructions against MUFU's one, on pipes with 8x MUFU's throughput.
  """
  bias = _ptx_f32(_ROUND_BIAS)
  c1, c2, c3 = (_ptx_f32(c) for c in _EXP2_POLY)
  return Float32(llvm.inline_asm(
      T.f32(), [Float32(x).ir_value(loc=loc, ip=ip)],
      "{\n\t.reg .f32 xc, r, fl, fr, p;\n\t.reg .b32 ri, pi, e;\n\t"
      "max.ftz.f32 xc, $1, 0fC2FE0000;\n\t"
      f"add.rm.ftz.f32 r, xc, {bias};\n\t"
      f"sub.rn.ftz.f32 fl, r, {bias};\n\t"
      "sub.rn.ftz.f32 fr, xc, fl;\n\t"
      f"fma.rn.ftz.f32 p, fr, {c3}, {c2};\n\t"
      f"fma.rn.ftz.f32 p, p, fr, {c1};\n\t"
      "fma.rn.ftz.f32 p, p, fr, 0f3F800000;\n\t"
      "mov.b32 ri, r;\n\tmov.b32 pi, p;\n\t"
      "shl.b32 e, ri, 23;\n\t"
      "add.s32 e, e, pi;\n\t"
      "mov.b32 $0, e;\n\t}",
      "=f,f", has_side_effects=False, is_align_stack=False,
      asm_dialect=llvm.AsmDialect.AD_ATT))


def check_exp2_emulation_every(exp2_emulation_every) -> int:
  """The emulation period as an int, or ValueError/TypeError naming the argument."""
  if isinstance(exp2_emulation_every, bool) or not isinstance(exp2_emulation_every, int):
    raise TypeError(f"exp2_emulation_every: expected an int, got {exp2_emulation_every!r}")
  if exp2_emulation_every < 0:
    raise ValueError(f"exp2_emulation_every: {exp2_emulation_every} out of range; accepted: 0 "
                     f"(every exp2 on MUFU) or n >= 1 (one exp2 in n on the FMA pipe)")
  return exp2_emulation_every


# Largest accepted rescale threshold: P may reach 2^threshold, and an fp16 P must stay finite
# (fp16 max 65504 < 2^16) with room for the fp32 row sums of long rows.
MAX_RESCALE_THRESHOLD_LOG2 = 15.0


def check_rescale_threshold(rescale_threshold_log2) -> float:
  """The threshold as a float, or ValueError/TypeError naming the argument."""
  if isinstance(rescale_threshold_log2, bool) or not isinstance(rescale_threshold_log2,
                                                                (int, float)):
    raise TypeError(f"rescale_threshold_log2: expected a float, got {rescale_threshold_log2!r}")
  value = float(rescale_threshold_log2)
  if not 0.0 <= value <= MAX_RESCALE_THRESHOLD_LOG2:
    raise ValueError(f"rescale_threshold_log2: {rescale_threshold_log2!r} out of range; accepted: "
                     f"0 (rescale on every max change) to {MAX_RESCALE_THRESHOLD_LOG2}")
  return value


@dataclasses.dataclass(frozen=True)
class OnlineSoftmax:
  """Running row max and row sum of one thread's rows; rows are shared by a quad of lanes.

  row_max is kept in raw-score units; row_sum is this thread's partial sum (its columns only),
  reduced over the quad once, in `finalize`. Frozen: the DSL passes a read-only frozen dataclass
  through run-time loops unchanged (the register tensors inside are updated in place).

  rescale_threshold_log2 > 0 (FA-4's conditional rescaling): row_max is the max the row's
  exponentials are taken against, and it only moves when a new block's max exceeds it by more
  than the threshold (in log2 units, after scaling); otherwise P is exp2'd against the stale max
  and may reach 2^threshold. Rows that keep their max get scale exactly 1, and `rescale` skips
  the O multiply when no row of the warp moved (a warp-uniform branch). row_sum is accumulated
  against the same max, so finalize's 1/rowsum and LSE stay exact.
  """

  scale_log2: Float32
  num_rows: int
  row_max: cute.Tensor
  row_sum: cute.Tensor
  rescale_threshold_log2: float = 0.0
  exp2_emulation_every: int = 0

  @staticmethod
  def create(scale_log2: Float32, num_rows: int, rescale_threshold_log2: float = 0.0,
             exp2_emulation_every: int = 0) -> "OnlineSoftmax":
    s = OnlineSoftmax(scale_log2, num_rows, cute.make_rmem_tensor(num_rows, Float32),
                      cute.make_rmem_tensor(num_rows, Float32),
                      check_rescale_threshold(rescale_threshold_log2),
                      check_exp2_emulation_every(exp2_emulation_every))
    s.reset()
    return s

  def _exp2(self, x: Float32, column: int) -> Float32:
    """exp2 of one score: MUFU, or with exp2_emulation_every = n, the FMA-pipe version for
    every n-th column of the thread's fragment (a trace-time choice: no branch)."""
    n = self.exp2_emulation_every
    if n > 0 and column % n == n - 1:
      return exp2_fma(x)
    return cute.math.exp2(x, fastmath=True)

  def reset(self):
    """Starts a new tile: max -inf, sum 0."""
    self.row_max.fill(-Float32.inf)
    self.row_sum.fill(0.0)

  @cute.jit
  def online_softmax(self, acc_s_mn: cute.Tensor, row_scale: cute.Tensor):
    """Overwrites acc_s_mn with exp2 of the scaled, max-shifted scores.

    Writes into row_scale the factor by which the O accumulator and row sums must shrink.
    A row whose max is still -inf (fully masked so far) uses 0 as its shift, so it yields
    p = 0 and scale = 0 instead of NaN.
    """
    if const_expr(self.rescale_threshold_log2 > 0.0):
      self._online_softmax_lazy(acc_s_mn, row_scale)
    else:
      self._online_softmax_always(acc_s_mn, row_scale)

  @cute.jit
  def _online_softmax_lazy(self, acc_s_mn: cute.Tensor, row_scale: cute.Tensor):
    """online_softmax with a stale max (rescale_threshold_log2 > 0).

    Per row: the max moves only when the block's max exceeds it by more than the threshold.
    The decision is per row (a select, no branch); rows that keep their max get scale 1.0
    exactly. Only when some row of the warp moved does the warp take the branch (uniform: a
    warp vote) that computes the scale exponentials and rescales the old row sums.
    """
    num_rows = cute.size(acc_s_mn, mode=[0])
    prev_max = cute.make_rmem_tensor(num_rows, Float32)
    block_sum = cute.make_rmem_tensor(num_rows, Float32)
    moved = Int32(0)
    for i in cutlass.range_constexpr(num_rows):
      prev = self.row_max[i]
      prev_max[i] = prev
      cur_max = prev
      for j in cutlass.range_constexpr(cute.size(acc_s_mn, mode=[1])):
        cur_max = cute.arch.fmax(cur_max, acc_s_mn[i, j])
      cur_max = cute.arch.warp_reduction_max(cur_max, threads_in_group=_THREADS_PER_ROW)
      # +inf when the row had no visible key yet (prev -inf): the max moves; NaN when it still
      # has none: the max stays -inf and the row's p stay 0 (shift 0 below).
      grow = (cur_max - prev) * self.scale_log2
      new_max = prev
      if grow > self.rescale_threshold_log2:
        new_max = cur_max
        moved = Int32(1)
      self.row_max[i] = new_max
      safe_max = new_max
      if new_max == -Float32.inf:
        safe_max = Float32(0.0)
      shift = safe_max * self.scale_log2
      row_sum = Float32(0.0)
      for j in cutlass.range_constexpr(cute.size(acc_s_mn, mode=[1])):
        p = self._exp2(acc_s_mn[i, j] * self.scale_log2 - shift, j)
        acc_s_mn[i, j] = p
        row_sum += p
      block_sum[i] = row_sum
      row_scale[i] = Float32(1.0)
    # A quad agrees on each row (same reduced max), so lanes differ only across rows; the vote
    # makes the branch warp-uniform.
    if cute.arch.vote_any_sync(moved != 0):
      for i in cutlass.range_constexpr(num_rows):
        safe_max = self.row_max[i]
        if safe_max == -Float32.inf:
          safe_max = Float32(0.0)
        scale = cute.math.exp2((prev_max[i] - safe_max) * self.scale_log2, fastmath=True)
        if prev_max[i] == self.row_max[i]:
          scale = Float32(1.0)
        row_scale[i] = scale
        self.row_sum[i] = self.row_sum[i] * scale
    for i in cutlass.range_constexpr(num_rows):
      self.row_sum[i] = self.row_sum[i] + block_sum[i]

  @cute.jit
  def _online_softmax_always(self, acc_s_mn: cute.Tensor, row_scale: cute.Tensor):
    """online_softmax that rescales whenever the row max changes (FA-3)."""
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
        p = self._exp2(acc_s_mn[i, j] * self.scale_log2 - shift, j)
        acc_s_mn[i, j] = p
        row_sum += p
      self.row_sum[i] = self.row_sum[i] * scale + row_sum

  @cute.jit
  def rescale(self, acc_mn: cute.Tensor, row_scale: cute.Tensor):
    """acc_mn[i, j] *= row_scale[i]: the O accumulator after an online_softmax step.

    With a rescale threshold, skipped when no row of the warp moved its max (all scales are
    exactly 1): a vote makes the branch warp-uniform, so no lane diverges near the WGMMAs.
    """
    if const_expr(self.rescale_threshold_log2 > 0.0):
      moved = Int32(0)
      for i in cutlass.range_constexpr(cute.size(row_scale)):
        if row_scale[i] != 1.0:
          moved = Int32(1)
      if cute.arch.vote_any_sync(moved != 0):
        scale_rows(acc_mn, row_scale)
    else:
      scale_rows(acc_mn, row_scale)

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
