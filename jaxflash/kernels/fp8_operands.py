"""FP8 (e4m3) operands of the Hopper forward's P V GEMM: V transposed in shared memory, and P
packed from the fp32 S accumulator, with one key order that makes both cheap.

Imports cutlass only. An 8-bit WGMMA reads both operands K-major, so P V needs V^T (head_dim_v
rows, keys contiguous), while TMA brings V with head_dim_v contiguous; and the 8-bit A
fragment holds 4 consecutive k per register, where the accumulator holds 2 consecutive columns
per column group of 8. Both fit one permutation of the keys inside every 16-key group:

    k position 4j + i  <->  key 2j + (i & 1) + 8 (i >> 1)      (j < 4, i < 4)

- P: a thread's register of k positions 4j..4j+3 is its accumulator pairs of column groups g
  and g + 1 (keys 2j, 2j + 1 and 8 + 2j, 9 + 2j): two cvt.e4m3x2 and one move, no shuffle.
- V^T: ldmatrix.trans on 16-bit pairs of V gives a thread two keys (2j, 2j + 1) of one
  head_dim pair; a byte permute of the registers of keys 0-7 and 8-15 yields exactly the bytes
  of k positions 4j..4j+3 of one V^T row, which stmatrix writes (its row addresses are free, so
  even and odd head_dim rows are two of its matrices).
The GEMM sums over k, so the permutation cancels: O = P V exactly.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

# One transpose unit: 16 keys x 32 bytes of head_dim (one ldmatrix.x4 and one stmatrix.x4).
UNIT_KEYS, UNIT_DIMS = 16, 32


@dsl_user_op
def pack_e4m3x4(x0: Float32, x1: Float32, x2: Float32, x3: Float32, *, loc=None,
                ip=None) -> Int32:
  """Four fp32 -> four e4m3 bytes of one register, x0 in the lowest (round to nearest,
  saturating: P <= 2^8 fits e4m3's 448)."""
  args = [Float32(x).ir_value(loc=loc, ip=ip) for x in (x0, x1, x2, x3)]
  return Int32(llvm.inline_asm(
      T.i32(), args,
      "{ .reg .b16 lo, hi;\n"
      "cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;\n"  # the first source goes to the high byte
      "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;\n"
      "mov.b32 $0, {lo, hi}; }",
      "=r,f,f,f,f", has_side_effects=True, is_align_stack=False,
      asm_dialect=llvm.AsmDialect.AD_ATT))


@cute.jit
def convert_p(acc_s: cute.Tensor, p: cute.Tensor):
  """p (e4m3, the 8-bit RS A fragment ((4, 2, 2), 1, tile_n / 32)) = acc_s (fp32 accumulator
  ((2, 2, tile_n / 8), 1, 1)) in the permuted key order (module docstring).

  Register (row half h, k half kh) of k block s packs the column pairs of groups 4s + 2kh and
  4s + 2kh + 1 of row half h.
  """
  words = cute.recast_tensor(p, Int32)  # ((1, 2, 2), 1, tile_n / 32): h + 2 kh + 4 s
  for s in cutlass.range_constexpr(cute.size(p, mode=[2])):
    for kh in cutlass.range_constexpr(2):
      for h in cutlass.range_constexpr(2):
        g = 4 * s + 2 * kh
        words[h + 2 * kh + 4 * s] = pack_e4m3x4(
            acc_s[(0, h, g), 0, 0], acc_s[(1, h, g), 0, 0],
            acc_s[(0, h, g + 1), 0, 0], acc_s[(1, h, g + 1), 0, 0])


@dsl_user_op
def _ldmatrix_x4_trans(addr: Int32, offset: int, *, loc=None, ip=None):
  res = llvm.inline_asm(
      llvm.StructType.get_literal([T.i32()] * 4), [Int32(addr).ir_value(loc=loc, ip=ip)],
      f"ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {{$0, $1, $2, $3}}, [$4+{offset}];",
      "=r,=r,=r,=r,r", has_side_effects=True, is_align_stack=False,
      asm_dialect=llvm.AsmDialect.AD_ATT)
  return [Int32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip)) for i in range(4)]


@dsl_user_op
def _stmatrix_x4(addr: Int32, offset: int, r0: Int32, r1: Int32, r2: Int32, r3: Int32, *,
                 loc=None, ip=None) -> None:
  llvm.inline_asm(
      None, [Int32(x).ir_value(loc=loc, ip=ip) for x in (addr, r0, r1, r2, r3)],
      f"stmatrix.sync.aligned.m8n8.x4.shared.b16 [$0+{offset}], {{$1, $2, $3, $4}};",
      "r,r,r,r,r", has_side_effects=True, is_align_stack=False,
      asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def _prmt(a: Int32, b: Int32, selector: int, *, loc=None, ip=None) -> Int32:
  return Int32(llvm.inline_asm(
      T.i32(), [Int32(a).ir_value(loc=loc, ip=ip), Int32(b).ir_value(loc=loc, ip=ip)],
      f"prmt.b32 $0, $1, $2, {selector};", "=r,r,r", has_side_effects=False,
      is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


def _v_coord(lane: Int32, n0, d0):
  """The (head_dim, key, stage) coordinate lane 8i + r loads in V for the unit at keys n0,
  head_dim d0 (unit_offsets)."""
  r = lane % 8
  i = lane // 8
  return (d0 + 16 * (i // 2), n0 + 8 * (i % 2) + r, 0)


def _vt_coord(lane: Int32, n0, d0):
  """The (head_dim, key, stage) coordinate lane 8i + r stores in V^T for the unit at keys n0,
  head_dim d0 (unit_offsets)."""
  r = lane % 8
  i = lane // 8
  return (d0 + 16 * (i // 2) + 2 * r + i % 2, n0, 0)


def unit_origin(unit, units_n: int):
  """(n0, d0) of a stage's unit `unit`, the units numbered along the keys first (units_n per
  UNIT_DIMS of head_dim)."""
  return (unit % units_n) * UNIT_KEYS, (unit // units_n) * UNIT_DIMS


@cute.jit
def unit_offsets(v_layout: cute.ComposedLayout, vt_layout: cute.ComposedLayout, n0: Int32,
                 d0: Int32, lane: Int32):
  """A lane's byte offsets (in V's stage 0, in V^T's stage 0) for the transpose unit of keys
  n0..n0+15 and head_dim d0..d0+31.

  v_layout: (head_dim_v, tile_n, stages) with head_dim_v contiguous (the TMA tile);
  vt_layout: (head_dim_v, tile_n, stages) with tile_n contiguous (the GEMM's K-major B), both
  swizzled e4m3 byte layouts. Lane 8i + r addresses row r of matrix i: keys n0 + 8 (i & 1) + r
  at head_dim d0 + 16 (i >> 1) to load; V^T row d0 + 16 (i >> 1) + 2r + (i & 1) at k position
  n0 to store. A stage's swizzle is stage 0's shifted by the stage size (a multiple of the
  1024-byte swizzle period), so the offsets hold for every stage.
  """
  src = cute.crd2idx(_v_coord(lane, n0, d0), v_layout)
  dst = cute.crd2idx(_vt_coord(lane, n0, d0), vt_layout)
  return Int32(src), Int32(dst)


@cute.jit
def unit_constants(v_layout: cute.ComposedLayout, vt_layout: cute.ComposedLayout, n0: int,
                   d0: int):
  """Compile-time ((flip, add) in V, (flip, add) in V^T) of the unit at keys n0, head_dim d0: a
  lane's address of that unit is its address of unit (0, 0) (unit_offsets), XOR flip, plus add.

  A layout's swizzle XORs its target bits (the 16-byte chunk in a row) with bits of the row
  (Swizzle<B, 4, 3>: bits 4.. ^= bits 7..). A unit's own unswizzled offset (the part its keys and
  head_dims add to every lane's) splits into the bits the swizzle targets, which flip the lane's
  chunk, and the rest, which the swizzle does not read: an add. In V only the head_dim part
  flips (a unit's keys are whole rows, 16 of them, a multiple of the 8-row swizzle period); in
  V^T both can. The flip touches bits below 7 and stage bases are multiples of 1024, so it
  applies to the address with its stage base added.
  """
  def split(layout, offset):
    sw = layout.inner
    target = ((1 << sw.num_bits) - 1) << sw.num_base
    return offset & target, offset & ~target

  flip_v, add_v = split(v_layout, cute.crd2idx((d0, 0, 0), v_layout.outer))
  add_v += cute.crd2idx((0, n0, 0), v_layout.outer)
  return (flip_v, add_v), split(vt_layout, cute.crd2idx((d0, n0, 0), vt_layout.outer))


@cute.jit
def transpose_v_unit(src: Int32, src_add: int, dst: Int32, dst_add: int):
  """One warp: the unit whose shared-memory addresses are src + src_add in V and dst + dst_add
  in V^T (the adds compile-time: the instructions' immediate offsets): one ldmatrix.trans, four
  byte permutes, one stmatrix."""
  m0, m1, m2, m3 = _ldmatrix_x4_trans(src, src_add)
  # m0 / m1: keys 2j, 2j + 1 of the first 8 / last 8 keys, head_dim pair d0 + 2c (bytes lo, hi):
  # the even bytes are head_dim d0 + 2c, the odd ones d0 + 2c + 1 (m2 / m3: d0 + 16 + 2c).
  _stmatrix_x4(dst, dst_add, _prmt(m0, m1, 0x6420), _prmt(m0, m1, 0x7531),
               _prmt(m2, m3, 0x6420), _prmt(m2, m3, 0x7531))
