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


def row_max(acc_s_mn: cute.Tensor, i: int, init, chains: int = 1, cols=None) -> Float32:
  """max(init, acc_s_mn[i, lo:hi]) over this thread's columns (cols = (lo, hi), default all;
  init None: no initial value), in `chains` independent FMNMX chains combined at the end (one chain
  is a dependent sequence as long as the columns). Exact: max does not round, so the order
  changes nothing, NaN elements included."""
  cols = list(range(*cols)) if cols else list(range(cute.size(acc_s_mn, mode=[1])))
  if chains == 1:
    m = acc_s_mn[i, cols[0]] if init is None else init
    for j in cols[(1 if init is None else 0):]:
      m = cute.arch.fmax(m, acc_s_mn[i, j])
    return m
  parts = [acc_s_mn[i, j] for j in cols[:chains]]
  for k in range(len(parts), len(cols)):
    parts[k % chains] = cute.arch.fmax(parts[k % chains], acc_s_mn[i, cols[k]])
  while len(parts) > 1:
    parts = [cute.arch.fmax(parts[k], parts[k + 1]) if k + 1 < len(parts) else parts[k]
             for k in range(0, len(parts), 2)]
  return parts[0] if init is None else cute.arch.fmax(init, parts[0])


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


# 2^f on [-0.5, 0.5], degree 3, fitted for relative error (max 7.6e-5, below half an fp16 ulp).
_EXP2_POLY = (0.99992818, 0.69326096, 0.24260935, 0.05517084)


@dsl_user_op
def exp2_fma(x: Float32, *, loc=None, ip=None) -> Float32:
  """2^x on the FMA and integer pipes, without MUFU.EX2 (for x <= 127; NaN stays NaN).

  x is clamped to -127 and split as n + f with n = round(x) (adding 1.5 * 2^23 leaves n in the
  low mantissa bits) and f in [-0.5, 0.5]; 2^f is _EXP2_POLY, and 2^n is the float whose
  exponent field is n + 127, so the result is one FMUL: +0 at n = -127 (so -inf gives 0 and a
  row without keys keeps a zero sum), NaN for a NaN x. The FP8 forward takes part of each
  step's exponentials here: its GEMMs take half the 16-bit time, so MUFU.EX2 (16 per clock per
  SM) bounds the step.
  """
  c0, c1, c2, c3 = (f"0f{struct.unpack('<I', struct.pack('<f', c))[0]:08X}" for c in _EXP2_POLY)
  return Float32(llvm.inline_asm(
      T.f32(), [Float32(x).ir_value(loc=loc, ip=ip)],
      "{ .reg .f32 xc, t, n, f, p; .reg .b32 e;\n"
      "max.NaN.f32 xc, $1, 0fC2FE0000;\n"  # -127: n = -127 gives 2^n = +0
      "add.rn.f32 t, xc, 0f4B400000;\n"  # 1.5 * 2^23: round(xc) in t's low bits
      "sub.rn.f32 n, t, 0f4B400000;\n"
      "sub.rn.f32 f, xc, n;\n"
      f"fma.rn.f32 p, f, {c3}, {c2};\n"
      f"fma.rn.f32 p, p, f, {c1};\n"
      f"fma.rn.f32 p, p, f, {c0};\n"
      "shl.b32 e, t, 23;\n"  # n << 23: the 1.5 * 2^23 bits shift out
      "add.s32 e, e, 1065353216;\n"  # + 127 << 23: the float 2^n
      "mul.rn.f32 $0, p, e; }",
      "=f,f", has_side_effects=False, is_align_stack=False,
      asm_dialect=llvm.AsmDialect.AD_ATT))


@cute.jit
def convert_p(acc_s: cute.Tensor, p: cute.Tensor):
  """p = acc_s (fp32 accumulator layout) converted to p's type; p is in the A-operand layout."""
  src = operand_a_view(acc_s)
  dst = cute.recast_tensor(p, Int32)
  to_bf16 = p.element_type == cutlass.BFloat16
  for i in cutlass.range_constexpr(cute.size(dst)):
    dst[i] = _cvt_pack(src[2 * i], src[2 * i + 1], to_bf16)


# FA-4's conditional rescaling: a row's max moves only when a block's max exceeds it by more
# than this (log2 units, after scaling), so P <= 2^8 and most blocks skip the O rescale. Its
# vote branch also keeps ptxas from hoisting the PV wait above the softmax exps (fwd_sm90).
# An fp16 P stays finite (fp16 max 65504) with room for the fp32 row sums of long rows.
RESCALE_THRESHOLD_LOG2 = 8.0


@dataclasses.dataclass(frozen=True)
class OnlineSoftmax:
  """Running row max and row sum of one thread's rows; rows are shared by a quad of lanes.

  row_max is kept in raw-score units; row_sum is this thread's partial sum (its columns only),
  reduced over the quad once, in `finalize`. Frozen: the DSL passes a read-only frozen dataclass
  through run-time loops unchanged (the register tensors inside are updated in place).

  Conditional rescaling (FA-4): row_max is the max the row's exponentials are taken against,
  and it only moves when a new block's max exceeds it by more than RESCALE_THRESHOLD_LOG2;
  otherwise P is exp2'd against the stale max and may reach 2^threshold. Rows that keep their
  max get scale exactly 1, and `rescale` skips the O multiply when no row of the warp moved (a
  warp-uniform branch). row_sum is accumulated against the same max, so finalize's 1/rowsum
  and LSE stay exact.
  """

  scale_log2: Float32
  num_rows: int
  row_max: cute.Tensor
  row_sum: cute.Tensor
  # Trace-time constants: how far a block's max may exceed row_max before row_max moves, and
  # a power of two every P carries (log2 units; the FP8 kernel's P fills e4m3's range with 8
  # and threshold 0.8, so P <= 2^8.8 < 448). row_sum carries it too, and finalize removes it.
  threshold_log2: float = RESCALE_THRESHOLD_LOG2
  p_offset_log2: float = 0.0
  # Of every 8 columns, this many take exp2_fma instead of MUFU.EX2; a row's max runs in
  # max_chains FMNMX chains (row_max).
  fma_exp2_per_8: int = 0
  max_chains: int = 1
  # Where the scale changes from tile to tile (the FP8 kernel's descales): one register holding
  # it (set_scale); scale_log2 is then only its first value.
  tile_scale: cute.Tensor = None
  # Where P may be rounded to its 16-bit type for the row sums (p_dtype): per row, this thread's
  # sum of p minus rounded p. row_sum (the rounded weights) normalises O; LSE takes row_sum plus
  # this gap, the sum of the p the backward recomputes from LSE, so there a row's P sums to 1
  # (a row on one key gets p = 1 exactly, as under the running max). Only blocks under a fixed
  # max, which never moves, add to it, so it is never rescaled; elsewhere it stays 0.
  round_gap: cute.Tensor = None

  @staticmethod
  def create(scale_log2: Float32, num_rows: int, threshold_log2: float = RESCALE_THRESHOLD_LOG2,
             p_offset_log2: float = 0.0, fma_exp2_per_8: int = 0, max_chains: int = 1,
             per_tile_scale: bool = False, rounded_p: bool = False) -> "OnlineSoftmax":
    """rounded_p: online_softmax / capped_softmax may round P (p_dtype; round_gap)."""
    s = OnlineSoftmax(scale_log2, num_rows, cute.make_rmem_tensor(num_rows, Float32),
                      cute.make_rmem_tensor(num_rows, Float32), threshold_log2, p_offset_log2,
                      fma_exp2_per_8, max_chains,
                      cute.make_rmem_tensor(1, Float32) if per_tile_scale else None,
                      cute.make_rmem_tensor(num_rows, Float32) if rounded_p else None)
    s.reset()
    if const_expr(per_tile_scale):
      s.set_scale(scale_log2)
    return s

  def set_scale(self, scale_log2: Float32):
    """The scale of the next tile (created with per_tile_scale)."""
    self.tile_scale[0] = scale_log2

  def _scale(self) -> Float32:
    """scale_log2, or the current tile's (set_scale)."""
    if const_expr(self.tile_scale is None):
      return self.scale_log2
    return self.tile_scale[0]

  def reset(self, start_max=None):
    """Starts a new tile: sum 0, max start_max (raw-score units; None: -inf, no key seen)."""
    self.row_max.fill(-Float32.inf if start_max is None else start_max)
    self.row_sum.fill(0.0)
    if const_expr(self.round_gap is not None):
      self.round_gap.fill(0.0)

  @cute.jit
  def online_softmax(self, acc_s_mn: cute.Tensor, row_scale: cute.Tensor,
                     p_dtype: cutlass.Constexpr = None):
    """Overwrites acc_s_mn with exp2 of the scaled, max-shifted scores.

    p_dtype (P's 16-bit type; None: off): each p is rounded to it here, and the row sums add
    the rounded values, the weights P V will use (round_p_pair); round_gap takes the
    difference. Only under a fixed max (threshold +inf).

    Writes into row_scale the factor by which the O accumulator and row sums must shrink. Per
    row the max moves only when the block's max exceeds it by more than the threshold (a
    select, no branch); rows that keep their max get scale 1.0 exactly. Only when some row of
    the warp moved does the warp take the branch (uniform: a warp vote) that computes the
    scale exponentials and rescales the old row sums. A row whose max is still -inf (fully
    masked so far) uses 0 as its shift, so it yields p = 0 instead of NaN.
    """
    assert p_dtype is None or (self.round_gap is not None and self.threshold_log2 == math.inf)
    num_rows = cute.size(acc_s_mn, mode=[0])
    prev_max = cute.make_rmem_tensor(num_rows, Float32)
    block_sum = cute.make_rmem_tensor(num_rows, Float32)
    moved = Int32(0)
    scale_log2 = self._scale()
    for i in cutlass.range_constexpr(num_rows):
      prev = self.row_max[i]
      prev_max[i] = prev
      cur_max = row_max(acc_s_mn, i, prev, self.max_chains)
      cur_max = cute.arch.warp_reduction_max(cur_max, threads_in_group=_THREADS_PER_ROW)
      # +inf when the row had no visible key yet (prev -inf): the max moves; NaN when it still
      # has none: the max stays -inf and the row's p stay 0 (shift 0 below).
      grow = (cur_max - prev) * scale_log2
      safe_max, moved = self._move_max(i, prev, cur_max, grow, moved)
      shift = safe_max * scale_log2
      if const_expr(self.p_offset_log2 != 0.0):
        shift = shift - self.p_offset_log2
      row_sum = Float32(0.0)
      if const_expr(p_dtype is None):
        for j in cutlass.range_constexpr(cute.size(acc_s_mn, mode=[1])):
          p = self._exp2(acc_s_mn[i, j] * scale_log2 - shift, j)
          acc_s_mn[i, j] = p
          row_sum += p
      else:
        row_sum = self._rounded_row(
            acc_s_mn, i, p_dtype,
            lambda j: (self._exp2(acc_s_mn[i, j] * scale_log2 - shift, j),
                       self._exp2(acc_s_mn[i, j + 1] * scale_log2 - shift, j + 1)))
      block_sum[i] = row_sum
      row_scale[i] = Float32(1.0)
    self._commit(prev_max, block_sum, moved, row_scale)

  @cute.jit
  def _move_max(self, i: int, prev: Float32, cur_max: Float32, grow: Float32, moved: Int32):
    """Row i's max after a block: the block's max cur_max where its growth over the old max
    prev (grow, in log2 units) exceeds threshold_log2, which sets moved to 1; else prev.
    Returns (the max the row's exponentials take, moved): the new max, or 0 while it is still
    -inf (no visible key yet), so that the row's p are 0, not NaN."""
    new_max = prev
    if grow > self.threshold_log2:
      new_max = cur_max
      moved = Int32(1)
    self.row_max[i] = new_max
    safe_max = new_max
    if new_max == -Float32.inf:
      safe_max = Float32(0.0)
    return safe_max, moved

  def _exp2(self, x: Float32, column: int) -> Float32:
    """2^x: exp2_fma for fma_exp2_per_8 of every 8 columns, MUFU.EX2 for the others."""
    if const_expr(column % 8 < self.fma_exp2_per_8):
      return exp2_fma(x)
    return cute.math.exp2(x, fastmath=True)

  @cute.jit
  def capped_softmax(self, acc_s_mn: cute.Tensor, row_scale: cute.Tensor, tanh_scale: Float32,
                     shift: Float32, p_dtype: cutlass.Constexpr):
    """online_softmax of soft-capped scores whose rows all keep the max they started from.

    acc_s_mn holds raw scores; each becomes t = tanh(s * tanh_scale) in [-1, 1] and then
    p = 2^(t * scale_log2 - shift), shift = start_max * scale_log2: no row max, so each
    score's tanh and exp2 follow each other with nothing between them. Valid only on a state
    reset with start_max = capped_start_max(...) whose masked blocks keep it too (online_softmax
    with a threshold of +inf): every p then stays a normal number of P's type. Each p is rounded
    to P's type (round_p_pair), as no key's p is exactly 1 here; round_gap takes the difference.
    row_scale becomes 1.
    """
    def capped_pair(i: int, j: int) -> tuple:
      t0 = cute.math.tanh(acc_s_mn[i, j] * tanh_scale, fastmath=True)
      t1 = cute.math.tanh(acc_s_mn[i, j + 1] * tanh_scale, fastmath=True)
      return (self._exp2(t0 * self._scale() - shift, j),
              self._exp2(t1 * self._scale() - shift, j + 1))

    for i in cutlass.range_constexpr(cute.size(acc_s_mn, mode=[0])):
      row_sum = self._rounded_row(acc_s_mn, i, p_dtype, lambda j: capped_pair(i, j))
      self.row_sum[i] = self.row_sum[i] + row_sum
      row_scale[i] = Float32(1.0)

  def _rounded_row(self, acc_s_mn: cute.Tensor, i: int, p_dtype, exp_pair) -> Float32:
    """Row i's p, column pair by pair (exp_pair(j) gives columns j and j + 1), rounded to P's
    type (round_p_pair) into acc_s_mn; round_gap[i] takes the sum of p minus rounded p.
    Returns the row's sum of the rounded p."""
    row_sum = Float32(0.0)
    p_sum = Float32(0.0)
    for j in range(0, cute.size(acc_s_mn, mode=[1]), 2):  # a trace-time loop
      e0, e1 = exp_pair(j)
      p0, p1 = round_p_pair(e0, e1, p_dtype == cutlass.BFloat16)
      acc_s_mn[i, j] = p0
      acc_s_mn[i, j + 1] = p1
      row_sum += p0 + p1
      p_sum += e0 + e1
    self.round_gap[i] = self.round_gap[i] + (p_sum - row_sum)
    return row_sum

  @cute.jit
  def _commit(self, prev_max: cute.Tensor, block_sum: cute.Tensor, moved: Int32,
              row_scale: cute.Tensor):
    """Ends a block: where a row's max moved, row_scale = 2^(old - new max) and the old row sum
    shrinks by it; then the block's sums join the row sums."""
    # A quad agrees on each row (same reduced max), so lanes differ only across rows; the vote
    # makes the branch warp-uniform.
    num_rows = cute.size(prev_max)
    if cute.arch.vote_any_sync(moved != 0):
      for i in cutlass.range_constexpr(num_rows):
        safe_max = self.row_max[i]
        if safe_max == -Float32.inf:
          safe_max = Float32(0.0)
        scale = cute.math.exp2(self._gap_log2(prev_max[i], safe_max), fastmath=True)
        if prev_max[i] == self.row_max[i]:
          scale = Float32(1.0)
        row_scale[i] = scale
        self.row_sum[i] = self.row_sum[i] * scale
    for i in cutlass.range_constexpr(num_rows):
      self.row_sum[i] = self.row_sum[i] + block_sum[i]

  def _gap_log2(self, old_max: Float32, new_max: Float32) -> Float32:
    """old_max - new_max in log2 units (row_max is in raw-score units here)."""
    return (old_max - new_max) * self._scale()

  def _max_log2(self, i: int) -> Float32:
    """Row i's max in log2 units."""
    return self.row_max[i] * self._scale()

  @cute.jit
  def rescale(self, acc_mn: cute.Tensor, row_scale: cute.Tensor):
    """acc_mn[i, j] *= row_scale[i]: the O accumulator after an online_softmax step.

    Skipped when no row of the warp moved its max (all scales are exactly 1): a vote makes the
    branch warp-uniform, so no lane diverges near the WGMMAs.
    """
    moved = Int32(0)
    for i in cutlass.range_constexpr(cute.size(row_scale)):
      if row_scale[i] != 1.0:
        moved = Int32(1)
    if cute.arch.vote_any_sync(moved != 0):
      scale_rows(acc_mn, row_scale)

  @cute.jit
  def finalize(self, row_inv: cute.Tensor, lse: cute.Tensor, sink_log2):
    """Writes each row's output factor and its natural-log LSE, with the learnable sink.

    The sink is one more logit in every row's softmax, in log2 units (sink * log2 e; -inf: no
    sink; one Float32 for every row, or a tensor of one per row: packed query heads), whose
    column has no value: with a = row_max * scale_log2 and m = max(a, sink_log2),
    the denominator is 2^m (row_sum 2^(a - m) + 2^(sink_log2 - m)), so the output factor is
    2^(a - m) / that sum and lse = (m + log2(sum)) * ln 2. Without a sink m = a, the factor is
    1/rowsum and lse = (a + log2(rowsum)) * ln 2, bit for bit as without the operand. LSE's sum
    adds round_gap (the sum of the unrounded p, which the backward recomputes). A row
    with no visible key outputs 0 and has lse = the sink (-inf without one); a row whose sum is
    NaN (a NaN in the caller's inputs) outputs NaN and lse NaN, as the reference does.
    """
    per_row = isinstance(sink_log2, cute.Tensor)
    for i in cutlass.range_constexpr(self.num_rows):
      sink_i = sink_log2[i] if const_expr(per_row) else sink_log2
      row_sum = cute.arch.warp_reduction_sum(self.row_sum[i], threads_in_group=_THREADS_PER_ROW)
      gap = Float32(0.0)
      if const_expr(self.round_gap is not None):
        gap = cute.arch.warp_reduction_sum(self.round_gap[i], threads_in_group=_THREADS_PER_ROW)
      # Any visible key contributes at least exp2(0) = 1 under the running max, 2^lowest under a
      # fixed one (capped_start_max): a sum of 0 means no visible key. NaN compares unequal to 0
      # and flows through the factor and lse.
      inv = Float32(0.0)
      row_lse = sink_i * LN_2
      if row_sum != 0.0:
        a = self._max_log2(i)
        if const_expr(self.p_offset_log2 != 0.0):
          a = a - self.p_offset_log2
        m = cute.arch.fmax(a, sink_i)
        keep = cute.math.exp2(a - m, fastmath=True)  # 1 unless the sink dominates
        sink = cute.math.exp2(sink_i - m, fastmath=True)
        total = row_sum * keep + sink
        inv = cute.arch.rcp_approx(total) * keep
        if const_expr(self.round_gap is not None):
          total = (row_sum + gap) * keep + sink
        row_lse = (m + cute.math.log2(total, fastmath=True)) * LN_2
      row_inv[i] = inv
      lse[i] = row_lse


# Floats per key chunk in ChunkScaledSoftmax.chunk_values: k descale, log2 ratio, 1 / ratio, and
# the head's v max (read by the FP8 epilogue, not here).
CHUNK_VALUES = 4


@dataclasses.dataclass(frozen=True)
class ChunkScaledSoftmax(OnlineSoftmax):
  """OnlineSoftmax of block-quantized scores: the columns of a block fall into `chunks` equal
  chunks of keys, each with its own key descale and value ratio (FP8 block quantization).

  Score j of chunk c is s * scale_log2 * k_descale[c] in log2 units (scale_log2 holds the
  rows' query descale), so row_max is kept in log2 units of the scaled scores: a block's max is
  the max over chunks of the chunk's raw max times its factor (descales are positive). P of
  chunk c is 2^(x - max + p_offset) * ratio[c] (log2 ratio[c] joins the FFMA's shift, so each
  score still costs one FFMA and one exp2), where ratio[c] = v_descale[c] / the head's largest
  v_descale <= 1: the P V GEMM then sums P V8 in units of that largest descale, which the
  epilogue applies. The row sums take each chunk's sum times 1 / ratio[c] (exact: the sum of
  the unscaled P). chunk_values: shared memory (CHUNK_VALUES floats per chunk, one column per
  K stage); stage (a register)
  names the current block's column (set_stage).
  """

  chunk_values: cute.Tensor = None
  stage: cute.Tensor = None
  chunks: int = 1

  @staticmethod
  def create_chunked(scale_log2: Float32, num_rows: int, chunk_values: cute.Tensor,
                     threshold_log2: float, p_offset_log2: float, fma_exp2_per_8: int,
                     max_chains: int) -> "ChunkScaledSoftmax":
    chunks = cute.size(chunk_values, mode=[0]) // CHUNK_VALUES
    s = ChunkScaledSoftmax(scale_log2, num_rows, cute.make_rmem_tensor(num_rows, Float32),
                           cute.make_rmem_tensor(num_rows, Float32), threshold_log2,
                           p_offset_log2, fma_exp2_per_8, max_chains, chunk_values=chunk_values,
                           stage=cute.make_rmem_tensor(1, Int32), chunks=chunks)
    s.reset()
    return s

  def set_stage(self, stage: Int32):
    """The next online_softmax reads the chunk values of K stage `stage`."""
    self.stage[0] = stage

  @cute.jit
  def online_softmax(self, acc_s_mn: cute.Tensor, row_scale: cute.Tensor):
    """OnlineSoftmax.online_softmax with the chunks' factors (see the class)."""
    num_rows = cute.size(acc_s_mn, mode=[0])
    per_chunk = cute.size(acc_s_mn, mode=[1]) // self.chunks
    values = self.chunk_values[None, self.stage[0]]
    factor = cute.make_rmem_tensor(self.chunks, Float32)
    for c in cutlass.range_constexpr(self.chunks):
      factor[c] = self._scale() * values[CHUNK_VALUES * c]
    prev_max = cute.make_rmem_tensor(num_rows, Float32)
    block_sum = cute.make_rmem_tensor(num_rows, Float32)
    moved = Int32(0)
    for i in cutlass.range_constexpr(num_rows):
      prev = self.row_max[i]
      prev_max[i] = prev
      cur_max = prev
      for c in cutlass.range_constexpr(self.chunks):
        chunk_max = row_max(acc_s_mn, i, None, self.max_chains,
                            (c * per_chunk, (c + 1) * per_chunk))
        cur_max = cute.arch.fmax(cur_max, chunk_max * factor[c])
      cur_max = cute.arch.warp_reduction_max(cur_max, threads_in_group=_THREADS_PER_ROW)
      # As OnlineSoftmax: +inf growth when the row had no visible key yet, NaN when it still
      # has none (the max stays -inf and the shift is 0).
      safe_max, moved = self._move_max(i, prev, cur_max, cur_max - prev, moved)
      total = Float32(0.0)
      for c in cutlass.range_constexpr(self.chunks):
        shift = safe_max - self.p_offset_log2 - values[CHUNK_VALUES * c + 1]
        chunk_sum = Float32(0.0)
        for j in cutlass.range_constexpr(c * per_chunk, (c + 1) * per_chunk):
          p = self._exp2(acc_s_mn[i, j] * factor[c] - shift, j)
          acc_s_mn[i, j] = p
          chunk_sum += p
        total = total + chunk_sum * values[CHUNK_VALUES * c + 2]
      block_sum[i] = total
      row_scale[i] = Float32(1.0)
    self._commit(prev_max, block_sum, moved, row_scale)

  def _gap_log2(self, old_max: Float32, new_max: Float32) -> Float32:
    return old_max - new_max  # row_max is in log2 units

  def _max_log2(self, i: int) -> Float32:
    return self.row_max[i]


def capped_p_range_log2(p_dtype) -> tuple:
  """(lowest, highest) log2 of the P values a soft-capped softmax with a fixed row max may
  produce in P's 16-bit type. bf16: [2^-80, 2^66], so that P V (fp32 products and sums) stays
  normal for values down to 2^-46 and finite while a row's sum of |V| stays below 2^61; fp16:
  P normal and finite, [2^-14, 2^15]."""
  if p_dtype == cutlass.BFloat16:
    return -80.0, 66.0
  return -14.0, 15.0


@cute.jit
def capped_start_max(scale_log2: Float32, lowest_log2: cutlass.Constexpr,
                     highest_log2: cutlass.Constexpr) -> Float32:
  """The row max (in t = tanh units) a soft-capped softmax can start every row from and keep,
  or -inf where P's range cannot hold the call's scores (the running max then).

  scale_log2 = softcap * log2 e, so the scores t * scale_log2 lie within [-scale_log2,
  scale_log2]: a row max m gives P = 2^((t - m) scale_log2) <= 2^((1 - m) scale_log2). m is
  chosen so that P spans [2^lowest_log2, 2^offset] with the smallest offset >= 0, which needs
  the span 2 * scale_log2 <= highest_log2 - lowest_log2 (softcap <= 50.6 in bf16, 10 in fp16).
  """
  span = scale_log2 * Float32(2.0)
  start = -Float32.inf
  if span <= Float32(highest_log2 - lowest_log2):
    offset = cute.arch.fmax(span + Float32(lowest_log2), Float32(0.0))
    start = Float32(1.0) - offset / scale_log2
  return start


@dsl_user_op
def round_p_pair(p0: Float32, p1: Float32, to_bf16: bool, *, loc=None, ip=None) -> tuple:
  """(p0, p1) rounded to P's 16-bit type (round to nearest even) and back to Float32.

  A softmax whose row sums add the rounded values divides P V by the sum of the weights P V
  actually used, so a row whose weight sits on one key returns that key's value exactly, as
  the running max does by giving its max key p = 1 exactly; P's later conversion for the GEMM
  is then exact. One packed conversion per pair (F2FP, as P's own packing) and two integer or
  FMA-pipe ops to widen: a scalar conversion compiles to F2F, which shares the MUFU pipe that
  bounds the soft-capped softmax (measured: 0.80x of the running max's forward at head_dim 128).
  """
  if to_bf16:
    body = ("{ .reg .b32 r;\n"
            "cvt.rn.bf16x2.f32 r, $3, $2;\n"
            "shl.b32 $0, r, 16;\n"
            "and.b32 $1, r, 0xffff0000; }")
  else:
    body = ("{ .reg .b32 r; .reg .b16 l, h;\n"
            "cvt.rn.f16x2.f32 r, $3, $2;\n"
            "mov.b32 {l, h}, r;\n"
            "cvt.f32.f16 $0, l;\n"
            "cvt.f32.f16 $1, h; }")
  res = llvm.inline_asm(
      llvm.StructType.get_literal([T.f32()] * 2),
      [Float32(p0).ir_value(loc=loc, ip=ip), Float32(p1).ir_value(loc=loc, ip=ip)],
      body, "=f,=f,f,f", has_side_effects=False, is_align_stack=False,
      asm_dialect=llvm.AsmDialect.AD_ATT)
  return tuple(Float32(llvm.extractvalue(T.f32(), res, [k], loc=loc, ip=ip)) for k in range(2))


@cute.jit
def soft_cap(acc: cute.Tensor, tanh_scale: Float32):
  """acc[i] = tanh(acc[i] * tanh_scale) (MUFU.TANH): soft-capped scores in units of softcap,
  which the caller's softmax scale (softcap * log2 e) turns back into softcap * tanh(.)."""
  for i in cutlass.range_constexpr(cute.size(acc)):
    acc[i] = cute.math.tanh(acc[i] * tanh_scale, fastmath=True)


@cute.jit
def tanh_derivative(p: Float32, lse2: Float32, inv_cap_log2: Float32) -> Float32:
  """1 - t^2 for the soft-capped score t that gave P = exp2(t * softcap * log2 e - lse2).

  The backward overwrites t with P, so t comes back as (log2 P + lse2) * inv_cap_log2 (one
  MUFU.LG2). Where P = 0 (masked, underflowed, or a row with lse2 = +inf) t is +-inf or NaN;
  the NaN-quiet min makes the factor 0 there, and dS = P (dP - delta) is 0 anyway.
  """
  t = (cute.math.log2(p, fastmath=True) + lse2) * inv_cap_log2
  return Float32(1.0) - cute.arch.fmin(t * t, Float32(1.0))


@cute.jit
def scale_rows(acc_mn: cute.Tensor, row_scale: cute.Tensor):
  """acc_mn[i, j] *= row_scale[i] (rescales or normalises the O accumulator)."""
  for i in cutlass.range_constexpr(cute.size(acc_mn, mode=[0])):
    for j in cutlass.range_constexpr(cute.size(acc_mn, mode=[1])):
      acc_mn[i, j] = acc_mn[i, j] * row_scale[i]
