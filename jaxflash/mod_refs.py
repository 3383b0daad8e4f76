"""Operand references of the score_mod / mask_mod IR: how an equation names what it reads.
mod_ir.py writes them; mod_ir.evaluate (in JAX) and kernels/mod_codegen.py (in the CuTe DSL)
read them through `resolve` and `dtype`. Imports nothing (the kernels side imports no jax).

  ("in", name)             an input: "score" (float32), "batch", "head", "q_idx", "kv_idx" (int32)
  ("lit", value, dtype)    a literal (floats as float.hex() strings)
  ("arr", k)               closed-over array k (operand order), read by the op "read"
  ("dim", k, axis)         the extent of array k along axis, at run time (int32)
  ("v", i)                 the value of equation i
"""

from __future__ import annotations

from typing import Any, Callable, Sequence


def resolve(ref, inputs: dict, values: Sequence, arrays: Sequence,
            literal: Callable[[tuple], Any], extent: Callable[[Any, int], Any]):
  """The value `ref` names: inputs[name], literal(ref), arrays[k], extent(arrays[k], axis) or
  values[i] (the caller's representation of each: JAX values or DSL values)."""
  kind = ref[0]
  if kind == "in":
    return inputs[ref[1]]
  if kind == "lit":
    return literal(ref)
  if kind == "arr":
    return arrays[ref[1]]
  if kind == "dim":
    return extent(arrays[ref[1]], ref[2])
  return values[ref[1]]


def dtype(ref, value_dtypes: Sequence[str]) -> str:
  """The dtype of a scalar ref (not "arr"): value_dtypes[i] for ("v", i)."""
  kind = ref[0]
  if kind == "in":
    return "float32" if ref[1] == "score" else "int32"
  if kind == "lit":
    return ref[2]
  if kind == "dim":
    return "int32"
  return value_dtypes[ref[1]]
