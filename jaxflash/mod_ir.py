"""score_mod / mask_mod as a neutral IR: the jaxpr of each function, flattened into a tuple of
scalar equations that kernels/mod_codegen.py turns into CuTe DSL code. Imports jax only.

IR (`ModIR`, hashable and JSON-serialisable): inputs named "score" (float32; score_mod only),
"batch", "head" (the query head), "q_idx", "kv_idx" (int32, raw positions); closed-over arrays
are operands ("arr", k) into `TracedMods.arrays`, read at computed indices by the op "read".
Each equation is (op, operand refs, params, dtype) and defines the ref ("v", its index); a
literal is ("lit", value, dtype) with floats written as float.hex(), so NaN and infinities
survive JSON. The semantics of every op are XLA's (lax), which `evaluate` reproduces and the
kernels follow: integer div rounds toward zero (x / 0 = -1, x % 0 = x), float -> int casts
truncate and saturate (NaN -> 0), max / min propagate NaN, "read" clamps each index into the
array ("clip") or yields the fill value when any index is outside it ("fill").
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxflash import config, mod_refs

IR_VERSION = 1
# The highest rank of a closed-over array the kernels read (kernel_abi.h JAXFLASH_MAX_MOD_RANK).
MAX_RANK = 4
SCORE_INPUTS = ("score", "batch", "head", "q_idx", "kv_idx")
MASK_INPUTS = ("batch", "head", "q_idx", "kv_idx")
# Scalar dtypes the IR carries (the kernels compute in these; float64 / int64 are not).
DTYPES = ("bool", "int8", "int16", "int32", "uint8", "uint16", "uint32", "float16", "bfloat16",
          "float32")

# jax primitive -> IR op, for ops that map one to one (operands in the same order).
_UNARY = ("neg", "abs", "sign", "exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic",
          "sqrt", "rsqrt", "floor", "ceil", "not", "square", "one_minus_square", "is_finite")
_BINARY = ("add", "sub", "mul", "div", "rem", "max", "min", "eq", "ne", "lt", "le", "gt", "ge",
           "and", "or", "xor", "shift_left", "shift_right_arithmetic", "shift_right_logical")
_DIRECT = frozenset(_UNARY + _BINARY + ("select_n", "clamp"))
# Primitives that are another op under a different name (add_any: the sum of cotangents).
_RENAMED = {"add_any": "add"}
# Primitives with params the IR keeps, and those that rewrite into IR ops.
_SPECIAL = ("round", "integer_pow", "convert_element_type", "dynamic_slice", "gather",
            "squeeze", "reshape", "broadcast_in_dim", "concatenate", "copy", "copy_p",
            "pjit", "jit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call",
            "custom_vjp_call_jaxpr", "remat", "checkpoint")
SUPPORTED_PRIMITIVES = tuple(sorted(_DIRECT | frozenset(_SPECIAL) | frozenset(_RENAMED)))


class UnsupportedModError(ValueError):
  """A score_mod / mask_mod that the kernels cannot run (an unsupported primitive, a value that
  is not a scalar, a dtype outside DTYPES). The reference implementation still runs it."""


@dataclasses.dataclass(frozen=True)
class ModIR:
  """One traced function: inputs (names), eqns ((op, refs, params, dtype), ...), output ref.
  Refs: ("in", name), ("arr", k), ("dim", k, axis), ("v", i), ("lit", value, dtype)
  (mod_refs.py)."""

  inputs: tuple
  eqns: tuple
  output: tuple

  def to_json(self) -> dict:
    return {"inputs": list(self.inputs), "eqns": [list(e) for e in self.eqns],
            "output": list(self.output)}

  @classmethod
  def from_json(cls, data: dict) -> "ModIR":
    return cls(tuple(data["inputs"]), tuple(_tuplify(e) for e in data["eqns"]),
               _tuplify(data["output"]))


def _tuplify(x):
  return tuple(_tuplify(i) for i in x) if isinstance(x, list) else x


@dataclasses.dataclass(frozen=True)
class ModSpec:
  """The compile-time part of a call's mods: the IRs (score_mod, its derivative by the score,
  mask_mod; None where absent) and each closed-over array's (dtype, rank). Hashable and
  JSON-serialisable; `digest` keys the kernel variant (array values and shapes excluded)."""

  score: Optional[ModIR]
  dscore: Optional[ModIR]
  mask: Optional[ModIR]
  arrays: tuple  # ((dtype, rank), ...)

  def to_json(self) -> dict:
    ir = lambda x: None if x is None else x.to_json()
    return {"version": IR_VERSION, "score": ir(self.score), "dscore": ir(self.dscore),
            "mask": ir(self.mask), "arrays": [list(a) for a in self.arrays]}

  @classmethod
  def from_json(cls, data: dict) -> "ModSpec":
    if data.get("version") != IR_VERSION:
      raise ValueError(f"mods: IR version {data.get('version')!r}; this jaxflash reads "
                       f"{IR_VERSION}")
    ir = lambda x: None if x is None else ModIR.from_json(x)
    return cls(ir(data["score"]), ir(data["dscore"]), ir(data["mask"]),
               tuple(tuple(a) for a in data["arrays"]))

  def canonical(self) -> str:
    return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))

  @property
  def digest(self) -> str:
    return config.mods_digest(self.canonical())


@functools.lru_cache(maxsize=256)
def parse_spec(text: str) -> ModSpec:
  """The ModSpec of a canonical JSON (AttentionConfig.mods), cached."""
  return ModSpec.from_json(json.loads(text))


def functions(spec: ModSpec, arrays) -> tuple:
  """(score_mod, mask_mod) evaluating the spec's IRs over `arrays` (None where absent): the
  functions the reference runs for a kernel call, differentiable in the arrays."""
  score_mod = mask_mod = None
  if spec.score is not None:
    score_mod = lambda s, b, h, q, k: evaluate(
        spec.score, dict(zip(SCORE_INPUTS, (s.astype(jnp.float32), b, h, q, k))), arrays)
  if spec.mask is not None:
    mask_mod = lambda b, h, q, k: evaluate(spec.mask, dict(zip(MASK_INPUTS, (b, h, q, k))),
                                           arrays)
  return score_mod, mask_mod


@dataclasses.dataclass(frozen=True)
class TracedMods:
  """spec plus the closed-over arrays themselves (jax arrays or tracers), in operand order."""

  spec: ModSpec
  arrays: tuple


def trace_mods(score_mod: Optional[Callable], mask_mod: Optional[Callable]) -> TracedMods:
  """The IR of score_mod (and of its derivative by the score, from jax.grad) and of mask_mod,
  traced on scalars. Raises UnsupportedModError naming the first primitive (or value) the
  kernels cannot run; a Python branch on an argument fails in JAX's tracing first."""
  builder = _Builder()
  f32, i32 = jax.ShapeDtypeStruct((), jnp.float32), jax.ShapeDtypeStruct((), jnp.int32)
  score = dscore = mask = None
  if score_mod is not None:
    score = builder.trace("score_mod", score_mod, SCORE_INPUTS, (f32,) + (i32,) * 4, "float32")
    grad = jax.grad(lambda s, *idx: score_mod(s, *idx).astype(jnp.float32))
    dscore = builder.trace("score_mod", grad, SCORE_INPUTS, (f32,) + (i32,) * 4, "float32")
  if mask_mod is not None:
    mask = builder.trace("mask_mod", mask_mod, MASK_INPUTS, (i32,) * 4, "bool")
  arrays = tuple((np.dtype(a.dtype).name, len(a.shape)) for a in builder.arrays)
  return TracedMods(ModSpec(score, dscore, mask, arrays), tuple(builder.arrays))


class _Builder:
  """Flattens jaxprs into ModIRs; shares one array-operand list across the traces."""

  def __init__(self):
    self.arrays: list = []  # the operands (a rank-0 value as shape (1,))
    self.originals: list = []  # the values as closed over, for deduplication by identity

  def array_ref(self, value, fn_name: str):
    dtype = np.dtype(value.dtype).name
    if dtype not in DTYPES:
      raise UnsupportedModError(f"{fn_name}: closes over an array of dtype {dtype} (shape "
                                f"{tuple(value.shape)}); the kernels accept {', '.join(DTYPES)}")
    if len(value.shape) > MAX_RANK:
      raise UnsupportedModError(f"{fn_name}: closes over an array of rank {len(value.shape)} "
                                f"(shape {tuple(value.shape)}); the kernels read ranks up to "
                                f"{MAX_RANK}")
    for k, a in enumerate(self.originals):
      if a is value:
        return ("arr", k)
    if 0 in tuple(value.shape):
      raise UnsupportedModError(f"{fn_name}: closes over an empty array (shape "
                                f"{tuple(value.shape)}); the kernels read at least one element")
    if len(self.arrays) == config.MOD_MAX_ARRAYS:
      raise UnsupportedModError(f"score_mod and mask_mod: close over more than "
                                f"{config.MOD_MAX_ARRAYS} arrays; the kernels take at most "
                                f"{config.MOD_MAX_ARRAYS} (concatenate tables into one)")
    self.originals.append(value)
    self.arrays.append(jnp.reshape(value, (1,)) if len(value.shape) == 0 else value)
    return ("arr", len(self.arrays) - 1)

  def trace(self, fn_name, fn, names, avals, out_dtype) -> ModIR:
    closed = jax.make_jaxpr(fn)(*avals)
    t = _Trace(self, fn_name)
    env = {}
    for var, const in zip(closed.jaxpr.constvars, closed.consts):
      env[var] = t.const(const)
    for var, name in zip(closed.jaxpr.invars, names):
      env[var] = ("in", name)
    out = t.run(closed.jaxpr, env)
    if len(out) != 1:
      raise UnsupportedModError(f"{fn_name}: returns {len(out)} values; expected one scalar")
    ref = out[0]
    if t.dtype(ref) != out_dtype:
      ref = t.emit("convert", (ref,), (("new_dtype", out_dtype),), out_dtype)
    return _prune(_fold(ModIR(tuple(names), tuple(t.eqns), ref)))


class _Trace:
  """One jaxpr's equations, inlined into a flat list."""

  def __init__(self, builder: _Builder, fn_name: str):
    self.builder, self.fn_name, self.eqns = builder, fn_name, []
    self.dtypes = []  # each equation's dtype, in order

  def error(self, what: str) -> UnsupportedModError:
    return UnsupportedModError(
        f"{self.fn_name}: {what}; the kernels support scalar code with the primitives "
        f"{', '.join(SUPPORTED_PRIMITIVES)} (and reads of closed-over arrays at computed "
        f"indices). The reference implementation (implementation='reference') runs any "
        f"function.")

  def emit(self, op, refs, params, dtype):
    self.eqns.append((op, tuple(refs), tuple(params), dtype))
    self.dtypes.append(dtype)
    return ("v", len(self.eqns) - 1)

  def dtype(self, ref) -> str:
    return mod_refs.dtype(ref, self.dtypes)

  def const(self, value):
    """A closed-over value: an array operand; a rank-0 one is the operand of shape (1,), read
    once (a scalar)."""
    ref = self.builder.array_ref(value, self.fn_name)
    if len(value.shape) == 0:
      return self.emit("read", (ref, ("lit", 0, "int32")), (("mode", "clip"), ("fill", None)),
                       np.dtype(value.dtype).name)
    return ref

  def scalar_dtype(self, aval) -> str:
    dtype = np.dtype(aval.dtype).name
    if dtype not in DTYPES:
      raise self.error(f"a value of dtype {dtype} (the kernels compute in {', '.join(DTYPES)})")
    return dtype

  def literal(self, lit):
    dtype = self.scalar_dtype(lit.aval)
    if int(np.prod(np.shape(lit.val))) != 1:
      raise self.error(f"a literal of shape {np.shape(lit.val)}")
    value = np.asarray(lit.val).reshape(()).item()
    if dtype == "bool":
      value = bool(value)
    elif dtype.startswith(("int", "uint")):
      value = int(value)
    else:
      value = float(value).hex()
    return ("lit", value, dtype)

  def run(self, jaxpr, env) -> list:
    from jax.extend import core as jcore
    read = lambda v: self.literal(v) if isinstance(v, jcore.Literal) else env[v]
    for eqn in jaxpr.eqns:
      refs = [read(v) for v in eqn.invars]
      outs = self.equation(eqn, refs)
      for var, ref in zip(eqn.outvars, outs):
        env[var] = ref
    return [read(v) for v in jaxpr.outvars]

  def equation(self, eqn, refs) -> list:
    name, params = eqn.primitive.name, eqn.params
    name = _RENAMED.get(name, name)
    inner = _inner_jaxpr(name, params)
    if inner is not None:
      jaxpr, consts = inner
      env = {v: self.const(c) for v, c in zip(jaxpr.constvars, consts)}
      env.update(zip(jaxpr.invars, refs))
      return self.run(jaxpr, env)
    if name in ("squeeze", "reshape", "copy", "copy_p", "broadcast_in_dim"):
      self.check_single(eqn)
      return [refs[0]]
    if name == "concatenate":  # index vectors for gather: a tuple of scalar refs
      return [tuple(r for ref in refs for r in (ref if isinstance(ref[0], tuple) else (ref,)))]
    if name == "dynamic_slice":
      return [self.dynamic_slice(eqn, refs)]
    if name == "gather":
      return [self.gather(eqn, refs)]
    if len(eqn.outvars) != 1 or eqn.outvars[0].aval.shape != ():
      if name in _DIRECT or name in _SPECIAL:
        raise self.error(f"primitive {name} makes a value of shape "
                         f"{eqn.outvars[0].aval.shape}, not a scalar")
      raise self.error(f"unsupported primitive {name}")
    dtype = self.scalar_dtype(eqn.outvars[0].aval)
    if any(r[0] == "arr" for r in refs):
      raise self.error(f"primitive {name} applied to a whole closed-over array (read it at "
                       f"scalar indices, e.g. table[i, j])")
    if name in _DIRECT:
      return [self.emit(name, refs, (), dtype)]
    if name == "round":
      return [self.emit("round", refs, (("rounding_method", int(params["rounding_method"])),),
                        dtype)]
    if name == "integer_pow":
      return [self.emit("integer_pow", refs, (("y", int(params["y"])),), dtype)]
    if name == "convert_element_type":
      if self.dtype(refs[0]) == dtype:
        return [refs[0]]
      return [self.emit("convert", refs, (("new_dtype", dtype),), dtype)]
    raise self.error(f"unsupported primitive {name}")

  def check_single(self, eqn):
    for v in (*eqn.invars, *eqn.outvars):
      if int(np.prod(v.aval.shape)) != 1:
        raise self.error(f"primitive {eqn.primitive.name} on a value of shape {v.aval.shape} "
                         f"(only scalars)")

  def dynamic_slice(self, eqn, refs):
    """x[i, j] of a closed-over x: dynamic_slice of ones (XLA clamps each start index)."""
    array, indices = refs[0], refs[1:]
    if array[0] != "arr" or any(s != 1 for s in eqn.params["slice_sizes"]):
      raise self.error(f"dynamic_slice of sizes {eqn.params['slice_sizes']} of a computed "
                       f"value (only single elements of closed-over arrays)")
    dtype = self.scalar_dtype(eqn.outvars[0].aval)
    self.run_time_extents(array, indices, eqn.invars[0].aval.shape)
    return self.emit("read", (array, *indices), (("mode", "clip"), ("fill", None)), dtype)

  def run_time_extents(self, array, indices, shape):
    """JAX writes a read at a traced index i with the wrap select_n(i < 0, i, i + n), n the
    extent of the array along that axis: its literal n becomes the ref ("dim", k, axis), the
    extent at run time, so the IR (and the variant's digest) holds no extent and one variant
    serves arrays of every extent (a document mask of any sequence length)."""
    eqn = lambda ref: self.eqns[ref[1]] if ref[0] == "v" else (None, (), (), None)
    for axis, (index, n) in enumerate(zip(indices, shape)):
      op, refs, _, _ = eqn(index)
      if op != "select_n" or len(refs) != 3:
        continue
      pred, x, wrapped = refs
      (lt, lt_refs, _, _), (add, add_refs, add_params, add_dtype) = eqn(pred), eqn(wrapped)
      if (lt == "lt" and len(lt_refs) == 2 and lt_refs[0] == x and lt_refs[1][:2] == ("lit", 0)
          and add == "add" and add_refs == (x, ("lit", n, add_dtype))):
        self.eqns[wrapped[1]] = (add, (x, ("dim", array[1], axis)), add_params, add_dtype)

  def gather(self, eqn, refs):
    """A single element of a closed-over array at a vector of scalar indices."""
    array, indices = refs
    p = eqn.params
    dn = p["dimension_numbers"]
    rank = len(eqn.invars[0].aval.shape)
    mode = str(p["mode"]).rsplit(".", 1)[-1]
    ok = (array[0] == "arr" and tuple(dn.offset_dims) == () and not dn.operand_batching_dims
          and sorted(dn.collapsed_slice_dims) == list(range(rank))
          and sorted(dn.start_index_map) == list(range(rank))
          and all(s == 1 for s in p["slice_sizes"]) and eqn.outvars[0].aval.shape == ()
          and mode in ("CLIP", "PROMISE_IN_BOUNDS", "FILL_OR_DROP"))
    if not ok:
      raise self.error(f"gather with {dn}, mode {mode} (only one element of a closed-over "
                       f"array, mode clip, promise_in_bounds or fill)")
    vector = indices if isinstance(indices[0], tuple) else (indices,)
    ordered = [None] * rank
    for k, dim in enumerate(dn.start_index_map):
      ordered[dim] = vector[k]
    dtype = self.scalar_dtype(eqn.outvars[0].aval)
    self.run_time_extents(array, ordered, eqn.invars[0].aval.shape)
    if mode != "FILL_OR_DROP":
      return self.emit("read", (array, *ordered), (("mode", "clip"), ("fill", None)), dtype)
    fill = p["fill_value"]
    if fill is None:  # jax's defaults for mode="fill"
      fill = (np.nan if dtype.startswith(("float", "bfloat")) else True if dtype == "bool"
              else np.iinfo(dtype).min if dtype.startswith("int") else np.iinfo(dtype).max)
    fill_lit = self.literal_of(fill, dtype)
    return self.emit("read", (array, *ordered), (("mode", "fill"), ("fill", fill_lit)), dtype)

  def literal_of(self, value, dtype):
    if dtype == "bool":
      return ("lit", bool(value), dtype)
    if dtype.startswith(("int", "uint")):
      return ("lit", int(value), dtype)
    return ("lit", float(np.asarray(value, np.float32)).hex(), dtype)


def _inner_jaxpr(name, params):
  """(jaxpr, consts) of a call-like primitive that is inlined, or None."""
  if name in ("pjit", "jit", "closed_call", "core_call", "remat", "checkpoint"):
    j = params.get("jaxpr") or params.get("call_jaxpr")
  elif name == "custom_jvp_call":
    j = params["call_jaxpr"]
  elif name in ("custom_vjp_call", "custom_vjp_call_jaxpr"):
    j = params.get("call_jaxpr") or params.get("fun_jaxpr")
  else:
    return None
  if hasattr(j, "jaxpr"):  # a ClosedJaxpr
    return j.jaxpr, j.consts
  return j, ()


def _fold(ir: ModIR) -> ModIR:
  """Equations of literals only become literals, evaluated here as XLA folds them when it
  compiles the reference (e.g. jnp.log(16.0), or jax.grad's 2.0 * 1.0)."""
  known = {}
  eqns = []
  fix = lambda r: known.get(r[1], r) if r[0] == "v" else r
  for i, (op, refs, params, dtype) in enumerate(ir.eqns):
    refs = tuple(fix(r) for r in refs)
    if op != "read" and refs and all(r[0] == "lit" for r in refs):
      with jax.ensure_compile_time_eval():  # concrete values also under an outer jit trace
        value = np.asarray(_apply(op, [literal_value(r) for r in refs], dict(params), dtype))
      known[i] = _literal_ref(value.reshape(()).item(), dtype)
    eqns.append((op, refs, params, dtype))
  return ModIR(ir.inputs, tuple(eqns), fix(ir.output))


def _literal_ref(value, dtype: str):
  if dtype == "bool":
    return ("lit", bool(value), dtype)
  if dtype.startswith(("int", "uint")):
    return ("lit", int(value), dtype)
  return ("lit", float(value).hex(), dtype)


def _prune(ir: ModIR) -> ModIR:
  """Drops the equations the output does not depend on and renumbers the rest."""
  live = set()
  stack = [ir.output]
  while stack:
    ref = stack.pop()
    if not isinstance(ref, tuple) or ref[0] != "v" or ref[1] in live:
      continue
    live.add(ref[1])
    op, refs, params, _ = ir.eqns[ref[1]]
    stack.extend(refs)
    stack.extend(v for _, v in params if isinstance(v, tuple))
  order = sorted(live)
  new = {old: i for i, old in enumerate(order)}
  fix = lambda r: ("v", new[r[1]]) if r[0] == "v" else r
  eqns = tuple((op, tuple(fix(r) for r in refs), params, dtype)
               for op, refs, params, dtype in (ir.eqns[i] for i in order))
  return ModIR(ir.inputs, eqns, fix(ir.output))


# ---------------------------------------------------------------------------------------------
# The IR's semantics in lax: the oracle of the codegen's translation, and a function of the
# closed-over arrays that JAX differentiates (the arrays' gradients).

def literal_value(ref):
  """The Python value of a ("lit", value, dtype) ref, in its dtype."""
  _, value, dtype = ref
  if isinstance(value, str):
    value = float.fromhex(value)
  return jnp.asarray(value, dtype)


def evaluate(ir: ModIR, inputs: dict, arrays) -> Any:
  """The IR's output for scalar inputs {name: value} and the closed-over arrays (operand order).
  Traceable, vmappable, differentiable in the float inputs and arrays."""
  values = []
  get = lambda ref: mod_refs.resolve(ref, inputs, values, arrays, literal_value,
                                     lambda array, axis: jnp.int32(array.shape[axis]))
  for op, refs, params, dtype in ir.eqns:
    args = [get(r) for r in refs]
    values.append(_apply(op, args, dict(params), dtype))
  return get(ir.output)


_LAX = {"neg": lax.neg, "abs": lax.abs, "sign": lax.sign, "exp": lax.exp, "exp2": lax.exp2,
        "log": lax.log, "log1p": lax.log1p, "expm1": lax.expm1, "tanh": lax.tanh,
        "logistic": lax.logistic, "sqrt": lax.sqrt, "rsqrt": lax.rsqrt, "floor": lax.floor,
        "ceil": lax.ceil, "not": lax.bitwise_not, "square": lax.square,
        "is_finite": lax.is_finite, "add": lax.add, "sub": lax.sub, "mul": lax.mul,
        "div": lax.div, "rem": lax.rem, "max": lax.max, "min": lax.min, "eq": lax.eq,
        "ne": lax.ne, "lt": lax.lt, "le": lax.le, "gt": lax.gt, "ge": lax.ge,
        "and": lax.bitwise_and, "or": lax.bitwise_or, "xor": lax.bitwise_xor,
        "shift_left": lax.shift_left, "shift_right_arithmetic": lax.shift_right_arithmetic,
        "shift_right_logical": lax.shift_right_logical, "clamp": lax.clamp}


def _apply(op, args, params, dtype):
  if op in _LAX:
    return _LAX[op](*args)
  if op == "one_minus_square":  # jax.grad of tanh: (1 + x) (1 - x), as JAX computes it
    one = lax.full_like(args[0], 1)
    return lax.mul(lax.add(one, args[0]), lax.sub(one, args[0]))
  if op == "select_n":
    return lax.select_n(*args)
  if op == "round":
    return lax.round(args[0], lax.RoundingMethod(params["rounding_method"]))
  if op == "integer_pow":
    return lax.integer_pow(args[0], params["y"])
  if op == "convert":
    return lax.convert_element_type(args[0], params["new_dtype"])
  if op == "read":
    array, idx = args[0], args[1:]
    if not idx:
      return array
    dims = array.shape
    clipped = tuple(jnp.clip(i, 0, d - 1) for i, d in zip(idx, dims))
    value = array[clipped]
    if params["mode"] == "fill":
      inside = jnp.all(jnp.stack([(i >= 0) & (i < d) for i, d in zip(idx, dims)]))
      value = jnp.where(inside, value, literal_value(params["fill"]))
    return value
  raise ValueError(f"IR op {op!r} unknown")
