"""Programmable attention: an additive bias, score_mod and mask_mod written in JAX.

Checks the arguments and decides where score_mod / mask_mod run. The kernels take them when
mod_ir can translate them (kernel_config; the forward kernel then runs them, mods_core.py); the
pure-JAX blocked path (reference.ScoreMods) runs any of them, and JAX differentiates it, so the
bias and every float array the functions close over get their gradients. A call with a bias
alone runs as any other call (jaxflash.attention: the bias variants of the kernels, or the
reference with its own backward). Imports jax, mod_ir, reference, checks and sink only.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np

from jaxflash import _jax_internal, checks, mod_ir, reference, user_warning
from jaxflash.config import AttentionConfig
from jaxflash.sink import add_learnable_sink

log = logging.getLogger("jaxflash")

BIAS_DTYPES = ("float32", "bfloat16", "float16")


def check_mods(bias, score_mod, mask_mod, query, key, dtype: str):
  """reference.ScoreMods of a call, or None when it has none. Raises TypeError / ValueError
  naming the argument: bias must be a float array of rank 4 broadcastable to (batch, heads,
  seq_q, seq_k) with seq_k in full; the functions must be callables that JAX can trace on
  scalars (a Python branch on an argument fails here, at trace time, not in a kernel)."""
  if bias is None and score_mod is None and mask_mod is None:
    return None
  b, seq_q, h, _ = query.shape
  seq_k = key.shape[1]
  if bias is not None:
    checks.check_array("bias", bias, 4, "(batch or 1, heads or 1, seq_q or 1, seq_k)")
    accepted = BIAS_DTYPES + (("float64",) if dtype == "float64" else ())
    if np.dtype(bias.dtype).name not in accepted:
      raise TypeError(f"bias: dtype {bias.dtype} not supported; accepted: {', '.join(accepted)}")
    want = (b, h, seq_q, seq_k)
    if any(got not in (1, full) for got, full in zip(bias.shape[:3], want[:3])) or (
        bias.shape[3] != seq_k):
      raise ValueError(f"bias: shape {tuple(bias.shape)} does not broadcast to (batch, heads, "
                       f"seq_q, seq_k) = {want}; each of the first three dims may be 1, seq_k "
                       f"must be {seq_k}")
  mods = reference.ScoreMods(bias, score_mod, mask_mod)
  _check_traceable(mods, dtype)
  return mods


def bias_dims(bias, query) -> tuple[bool, bool, bool]:
  """Which of a checked bias's (batch, heads, seq_q) dims are full (AttentionConfig.bias_dims):
  those equal to the query's (a dim of 1 on both sides counts as full)."""
  b, seq_q, h, _ = query.shape
  return tuple(got == full for got, full in zip(bias.shape[:3], (b, h, seq_q)))


def functions_only(mods) -> bool:
  """Whether checked mods have score_mod or mask_mod (else a bias at most)."""
  return mods is not None and (mods.score_mod is not None or mods.mask_mod is not None)


def _check_traceable(mods: reference.ScoreMods, dtype: str) -> None:
  """Traces score_mod / mask_mod once on scalars: each must return one scalar (a float score,
  a boolean mask) and be expressible as a jaxpr."""
  score = jax.ShapeDtypeStruct((), jnp.promote_types(dtype, jnp.float32))  # the scores' dtype
  index = jax.ShapeDtypeStruct((), jnp.int32)
  for name, fn, args, want in (
      ("score_mod", mods.score_mod, (score,) + (index,) * 4, "a float scalar"),
      ("mask_mod", mods.mask_mod, (index,) * 4, "a boolean scalar")):
    if fn is None:
      continue
    if not callable(fn):
      raise TypeError(f"{name}: expected a function, got {type(fn).__name__}")
    try:
      out = jax.eval_shape(fn, *args)
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerBoolConversionError,
            jax.errors.TracerIntegerConversionError) as e:
      raise ValueError(f"{name}: must be a JAX function of scalars without Python control "
                       f"flow on its arguments (use jnp.where or lax.select); tracing it "
                       f"raised {type(e).__name__}") from e
    except TypeError as e:
      raise TypeError(f"{name}: calling it as {name}({', '.join(_ARG_NAMES[name])}) raised: "
                      f"{e}") from e
    ok = (hasattr(out, "shape") and out.shape == ()
          and (jnp.issubdtype(out.dtype, jnp.floating) if name == "score_mod"
               else out.dtype == jnp.bool_))
    if not ok:
      raise TypeError(f"{name}: must return {want}, got {out}")


_ARG_NAMES = {"score_mod": ("score", "batch", "head", "q_idx", "kv_idx"),
              "mask_mod": ("batch", "head", "q_idx", "kv_idx")}


def kernel_config(config: AttentionConfig, mods: reference.ScoreMods, requested):
  """(config with .mods set, the closed-over arrays, "") for a call whose score_mod / mask_mod
  the kernels can run, else (None, (), why not); the config without .mods for a score_mod that
  returns its score unchanged and no mask_mod (the plain call). requested: the call's
  implementation."""
  if requested == "reference":
    return None, (), "implementation='reference'"
  if mods.bias is not None:
    return None, (), "score_mod / mask_mod: no kernel takes them together with a bias"
  try:
    traced = mod_ir.trace_mods(mods.score_mod, mods.mask_mod)
  except mod_ir.UnsupportedModError as e:
    return None, (), str(e)
  spec = traced.spec
  if spec.mask is None and not spec.score.eqns and spec.score.output == ("in", "score"):
    return config, (), ""  # a score_mod that returns its score: the plain call's config
  return config.replace(mods=spec.canonical()), traced.arrays, ""


def reference_instead(requested, reason: str) -> str:
  """'reference' for a call kernel_config refused: implementation='cute' raises with the reason;
  auto says why where the kernels would otherwise run (a Hopper GPU)."""
  if requested == "cute":
    raise ValueError(f"implementation='cute': {reason}; use implementation=None (auto) or "
                     f"'reference'")
  if requested is None and _jax_internal.has_hopper_device():
    user_warning.warn(f"jaxflash: score_mod / mask_mod run on the reference implementation: "
                      f"{reason}")
  return "reference"


def attention(config: AttentionConfig, mods: reference.ScoreMods, query, key, value,
              q_segment_ids, kv_segment_ids, learnable_sink):
  """(out, lse) of a call with score modifiers, on the blocked pure-JAX path."""
  out, lse = reference.blocked_forward(query, key, value, config, q_segment_ids,
                                       kv_segment_ids, mods=mods)
  if learnable_sink is not None:
    out, lse = add_learnable_sink(out, lse, learnable_sink)
  return out, lse
