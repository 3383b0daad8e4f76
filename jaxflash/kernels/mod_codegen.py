"""score_mod / mask_mod IR (jaxflash/mod_ir.py) -> CuTe DSL code on the S accumulator.

Imports cutlass and jaxflash.mod_refs (no jax). The IR arrives as a KernelVariant's `mods`
(canonical JSON); each equation becomes DSL arithmetic while the kernel is traced, once per
accumulator element (identical subexpressions of a row or a column, e.g. slopes[head] or q_idx //
chunk, are left to LLVM's CSE). Values live as Float32 (float32, and float16 / bfloat16 rounded to
their type after every op), Int32 (int8 / int16 / int32 / uint8 / uint16, narrow ones wrapped to
their width after every op), Uint32 or Boolean. Every op follows XLA's semantics (mod_ir's module
docstring), with the guards that make LLVM's undefined cases defined: integer division by 0, shifts
by >= the width, float -> int casts of NaN or out-of-range values. Transcendentals use the accurate
libdevice functions (fastmath off).
"""

import json
import math

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32, Uint32
from cutlass._mlir.dialects import arith
from cutlass.cutlass_dsl import T

from jaxflash import mod_refs

FLOATS = ("float16", "bfloat16", "float32")
_NARROW = {"int8": (8, True), "int16": (16, True), "uint8": (8, False), "uint16": (16, False)}
_STORAGE = {"float16": cutlass.Float16, "bfloat16": cutlass.BFloat16,
            "float32": cutlass.Float32, "int8": cutlass.Int8, "int16": cutlass.Int16,
            "int32": cutlass.Int32, "uint8": cutlass.Uint8, "uint16": cutlass.Uint16,
            "uint32": cutlass.Uint32, "bool": cutlass.Uint8}  # bool arrays: one byte each


def parse(text: str):
  """The variant's mods JSON -> {"score", "dscore", "mask": (inputs, eqns, output) or None,
  "arrays": ((dtype, rank), ...)} with every list turned into a tuple."""
  data = json.loads(text)
  tup = lambda x: tuple(tup(i) for i in x) if isinstance(x, list) else x
  ir = lambda x: None if x is None else (tup(x["inputs"]), tup(x["eqns"]), tup(x["output"]))
  return {"score": ir(data["score"]), "dscore": ir(data["dscore"]), "mask": ir(data["mask"]),
          "arrays": tup(data["arrays"])}


def storage_type(dtype: str):
  """The element type of a closed-over array of `dtype` in the kernel's operand."""
  return _STORAGE[dtype]


def is_identity(ir) -> bool:
  """score_mod(score, ...) = score: nothing to emit."""
  return ir is None or (not ir[1] and ir[2] == ("in", "score"))


def is_all_true(ir) -> bool:
  """mask_mod = True (a literal): nothing to emit."""
  return ir is None or (ir[2][0] == "lit" and ir[2][1] is True)


def emit(ir, inputs: dict, arrays: tuple):
  """The DSL value of the IR's output: inputs {name: Float32 score or Int32 index}, arrays the
  closed-over arrays' tensors (operand order; a rank-0 array is a (1,) tensor)."""
  _, eqns, output = ir
  values, dtypes = [], []
  get = lambda ref: mod_refs.resolve(ref, inputs, values, arrays, _literal,
                                     lambda array, axis: Int32(array.shape[axis]))
  for op, refs, params, dtype in eqns:
    args = [get(r) for r in refs]
    arg_dtypes = [None if r[0] == "arr" else mod_refs.dtype(r, dtypes) for r in refs]
    values.append(_op(op, args, arg_dtypes, dict(params), dtype))
    dtypes.append(dtype)
  return get(output)


def _literal(ref):
  _, value, dtype = ref
  if dtype == "bool":
    return Boolean(bool(value))
  if dtype in FLOATS:
    return Float32(float.fromhex(value) if isinstance(value, str) else value)
  if dtype == "uint32":
    return Uint32(value)
  return Int32(value)


def _select(pred, a, b):
  """pred ? a : b, of a's DSL type."""
  return type(a)(cutlass.select_(pred, a, b))


def _fit(x, dtype: str):
  """x rounded (floats) or wrapped (narrow ints) to dtype after an op computed wider."""
  if dtype in ("float16", "bfloat16"):
    return x.to(_STORAGE[dtype]).to(Float32)
  if dtype in _NARROW:
    width, signed = _NARROW[dtype]
    if signed:
      shift = Int32(32 - width)
      return Int32(arith.shrsi(Int32(arith.shli(x.ir_value(), shift.ir_value())).ir_value(),
                               shift.ir_value()))
    return x & Int32((1 << width) - 1)
  return x


def _int_div(x, y, rem: bool):
  """XLA's integer div / rem: toward zero; x / 0 = -1, x % 0 = x (LLVM leaves them undefined)."""
  zero = y == type(y)(0)
  safe = _select(zero, type(y)(1), y)
  signed = not isinstance(x, Uint32)
  if rem:
    op = arith.remsi if signed else arith.remui
    return _select(zero, x, type(x)(op(x.ir_value(), safe.ir_value())))
  op = arith.divsi if signed else arith.divui
  return _select(zero, type(x)(-1) if signed else Uint32(0xFFFFFFFF),
                 type(x)(op(x.ir_value(), safe.ir_value())))


def _shift(op, x, amount, dtype: str):
  """XLA's shifts: amounts outside [0, width) give 0 (left, logical) or the sign (arithmetic)."""
  width = _NARROW.get(dtype, (32, True))[0]
  inside = Uint32(amount.ir_value()) < Uint32(width)
  safe = _select(inside, amount, type(amount)(0))
  if op == "shift_left":
    return _select(inside, type(x)(arith.shli(x.ir_value(), safe.ir_value())), type(x)(0))
  if op == "shift_right_logical":
    source = x & Int32((1 << width) - 1) if dtype in _NARROW else x
    return _select(inside, type(x)(arith.shrui(source.ir_value(), safe.ir_value())),
                   type(x)(0))
  sign = _select(x < type(x)(0), type(x)(-1), type(x)(0))
  return _select(inside, type(x)(arith.shrsi(x.ir_value(), safe.ir_value())), sign)


def _float_to_int(x, dtype: str):
  """XLA's float -> int: truncate, saturate at the type's range, NaN -> 0."""
  if dtype == "uint32":
    lo, hi_f, hi = 0.0, 4294967040.0, 0xFFFFFFFF  # the largest float32 below 2^32
    clamped = cutlass.min(cutlass.max(x, Float32(lo)), Float32(hi_f))
    value = Uint32(arith.fptoui(T.i32(), clamped.ir_value()))
    value = _select(x >= Float32(4294967296.0), Uint32(hi), value)
    return _select(x != x, Uint32(0), value)
  if dtype in _NARROW:
    width, signed = _NARROW[dtype]
    lo, hi = (-(1 << (width - 1)), (1 << (width - 1)) - 1) if signed else (0, (1 << width) - 1)
    hi_f = float(hi)
  else:
    lo, hi, hi_f = -(1 << 31), (1 << 31) - 1, 2147483520.0  # the largest float32 below 2^31
  clamped = cutlass.min(cutlass.max(x, Float32(float(lo))), Float32(hi_f))
  value = Int32(arith.fptosi(T.i32(), clamped.ir_value()))
  value = _select(x >= Float32(hi_f + 1.0) if dtype not in _NARROW else x > Float32(hi_f),
                  Int32(hi), value)
  return _select(x != x, Int32(0), value)


def _convert(x, src: str, dst: str):
  if src == dst:
    return x
  if dst == "bool":
    zero = Float32(0.0) if src in FLOATS else type(x)(0)
    return x != zero
  if src == "bool":
    if dst in FLOATS:
      return _select(x, Float32(1.0), Float32(0.0))
    return _select(x, Uint32(1), Uint32(0)) if dst == "uint32" else _select(x, Int32(1),
                                                                             Int32(0))
  if dst in FLOATS:
    if src in FLOATS:
      return _fit(x, dst)
    value = x.to(Float32)  # sitofp / uitofp by the source's signedness
    return _fit(value, dst)
  if src in FLOATS:
    return _float_to_int(x, dst)
  # int -> int: the same 32 bits, then wrapped to a narrow destination.
  value = Uint32(x.ir_value()) if dst == "uint32" else Int32(x.ir_value())
  return _fit(value, dst)


def _read(array, idx, params, dtype: str):
  """array[idx] with each index clamped into the array (always in bounds); mode fill: the fill
  value when any index was outside."""
  if not idx:
    raw = array[0]
  else:
    clamped = tuple(cutlass.max(cutlass.min(i, array.shape[k] - 1), Int32(0))
                    for k, i in enumerate(idx))
    raw = array[clamped]
  if dtype == "bool":
    value = raw != cutlass.Uint8(0)
  elif dtype in FLOATS:
    value = raw.to(Float32)
  elif dtype == "uint32":
    value = Uint32(raw)
  else:
    value = raw.to(Int32)
  if idx and params["mode"] == "fill":
    inside = Boolean(True)
    for k, i in enumerate(idx):
      inside = inside & (i >= Int32(0)) & (i < array.shape[k])
    value = _select(inside, value, _literal(params["fill"]))
  return value


_MATH = {"exp": cute.math.exp, "exp2": cute.math.exp2, "log": cute.math.log,
         "log1p": cute.math.log1p, "expm1": cute.math.expm1, "tanh": cute.math.tanh,
         "sqrt": cute.math.sqrt, "rsqrt": cute.math.rsqrt, "floor": cute.math.floor,
         "ceil": cute.math.ceil}
_COMPARE = {"eq": lambda a, b: a == b, "ne": lambda a, b: a != b, "lt": lambda a, b: a < b,
            "le": lambda a, b: a <= b, "gt": lambda a, b: a > b, "ge": lambda a, b: a >= b}


def _op(op, args, arg_dtypes, params, dtype):
  """One equation in DSL code (an unknown op is an internal error: mod_ir only makes these)."""
  is_float = dtype in FLOATS
  if op in _COMPARE:
    return _COMPARE[op](*args)
  if op == "read":
    return _read(args[0], args[1:], params, dtype)
  if op == "convert":
    return _convert(args[0], arg_dtypes[0], params["new_dtype"])
  if op == "select_n":
    pred, cases = args[0], args[1:]
    if arg_dtypes[0] == "bool":
      return _select(pred, cases[1], cases[0])
    result = cases[0]
    for k in range(1, len(cases)):
      result = _select(pred == Int32(k), cases[k], result)
    return result
  if op in _MATH:
    return _fit(Float32(_MATH[op](args[0], fastmath=False)), dtype)
  x = args[0]
  if op == "neg":
    return _fit(-x, dtype)
  if op == "abs":
    return _fit(_select(x < type(x)(0), -x, x), dtype) if not is_float else Float32(
        cute.math.absf(x))
  if op == "sign":
    one = type(x)(1)
    return _select(x > type(x)(0), one, _select(x < type(x)(0), -one, x))
  if op == "logistic":
    return _fit(Float32(1.0) / (Float32(1.0) + Float32(cute.math.exp(-x, fastmath=False))),
                dtype)
  if op == "not":
    return x ^ (Boolean(True) if dtype == "bool" else type(x)(-1) if not isinstance(x, Uint32)
                else Uint32(0xFFFFFFFF))
  if op == "square":
    return _fit(x * x, dtype)
  if op == "one_minus_square":  # jax.grad of tanh: (1 + x) (1 - x), as JAX computes it
    return _fit((Float32(1.0) + x) * (Float32(1.0) - x), dtype)
  if op == "is_finite":
    return Float32(cute.math.absf(x)) < Float32(math.inf)
  if op == "integer_pow":
    return _integer_pow(x, params["y"], dtype)
  if op == "round":
    fn = cute.math.round if params["rounding_method"] == 0 else cute.math.roundeven
    return Float32(fn(x, fastmath=False))
  if op == "clamp":
    lo, value, hi = args
    return cutlass.min(cutlass.max(value, lo), hi)
  y = args[1]
  if op == "add":
    return _fit(x + y, dtype)
  if op == "sub":
    return _fit(x - y, dtype)
  if op == "mul":
    return _fit(x * y, dtype)
  if op in ("div", "rem"):
    if is_float:
      return _fit(x / y if op == "div" else Float32(cute.math.rem(x, y, fastmath=False)),
                  dtype)
    return _fit(_int_div(x, y, op == "rem"), dtype)
  if op == "max":
    return cutlass.max(x, y)
  if op == "min":
    return cutlass.min(x, y)
  if op == "and":
    return x & y
  if op == "or":
    return x | y
  if op == "xor":
    return x ^ y
  if op.startswith("shift"):
    return _fit(_shift(op, x, y, dtype), dtype)
  raise AssertionError(f"IR op {op!r} has no code")


def _integer_pow(x, y: int, dtype: str):
  """x ** y by squaring (XLA's integer_pow); y < 0: 1 / x ** -y (floats)."""
  result, base, n = None, x, abs(y)
  while n:
    if n & 1:
      result = base if result is None else _fit(result * base, dtype)
    n >>= 1
    if n:
      base = _fit(base * base, dtype)
  if result is None:
    result = Float32(1.0) if dtype in FLOATS else type(x)(1)
  return _fit(Float32(1.0) / result, dtype) if y < 0 else result


def apply_mods(program: dict, acc_s_mn: cute.Tensor, coord_mn: cute.Tensor, arrays,
               row_base: Int32, col_base: Int32, seqlen_q: Int32, seqlen_k: Int32,
               batch: Int32, head: Int32, scale: Float32, inv_scale: Float32,
               transposed: bool = False, with_mask: bool = True):
  """score_mod and mask_mod on one S block in place: S rows queries and columns keys, or with
  `transposed` (the backward's S^T) rows keys and columns queries; row_base / col_base are the
  block's first row and column in those terms.

  acc_s_mn holds scores in the S registers' units: score = S * scale (scale: the softmax scale,
  or softcap when capped), so score_mod sees scale * S and its result enters divided by scale;
  mask_mod sets -inf. program: parse()'s dict (trace-time). Query rows past seqlen_q and keys
  past seqlen_k call the functions with the last position (the reference's convention; their
  scores are never stored or are masked). with_mask False: score_mod only, for blocks whose
  every pair mask_mod keeps (the full range of block ranges narrowed by the call's block mask,
  jaxflash/block_mask.py)."""
  score_ir, mask_ir = program["score"], program["mask"]
  num_rows, num_cols = cute.size(acc_s_mn, mode=[0]), cute.size(acc_s_mn, mode=[1])
  row_limit, col_limit = (seqlen_k, seqlen_q) if transposed else (seqlen_q, seqlen_k)
  rows = [cutlass.min(row_base + coord_mn[i, 0][0], row_limit - 1) for i in range(num_rows)]
  cols = [cutlass.min(col_base + coord_mn[0, j][1], col_limit - 1) for j in range(num_cols)]

  def index(i, j):
    q_idx, kv_idx = (cols[j], rows[i]) if transposed else (rows[i], cols[j])
    return {"batch": batch, "head": head, "q_idx": q_idx, "kv_idx": kv_idx}

  # score_mod over the block, then mask_mod over it: one function's values live at a time.
  # Trace-time loops: every element's code is emitted.
  if not is_identity(score_ir):
    for i in range(num_rows):
      for j in range(num_cols):
        inputs = dict(index(i, j), score=acc_s_mn[i, j] * scale)
        acc_s_mn[i, j] = emit(score_ir, inputs, arrays) * inv_scale
  if with_mask and not is_all_true(mask_ir):
    for i in range(num_rows):
      for j in range(num_cols):
        keep = emit(mask_ir, index(i, j), arrays)
        acc_s_mn[i, j] = _select(keep, acc_s_mn[i, j], -Float32.inf)


def constant_derivative(program: dict):
  """score_mod's derivative by the score when the IR makes it a constant (ALiBi, T5 buckets,
  any added bias: 1.0), else None; 1.0 without a score_mod."""
  dscore = program["dscore"]
  if dscore is None:
    return 1.0
  output = dscore[2]
  if output[0] != "lit":
    return None
  value = output[1]
  return float.fromhex(value) if isinstance(value, str) else float(value)
