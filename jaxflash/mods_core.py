"""The custom_vjp of a call whose score_mod / mask_mod run in the kernels.

The forward binds flash_fwd_p with the functions' closed-over arrays as operands (config.mods
holds their IR). The backward binds flash_bwd_p where a backward kernel takes the call
(config.kernel_support: score_mod's derivative a constant, no softcap, not deterministic) for
dq, dk and dv; the closed-over float arrays' gradients, and the whole backward elsewhere, come
from JAX's differentiation of the blocked reference evaluating the same IR (mod_ir.functions),
which XLA drops where nothing reads them. Imports jax, config, primitives, reference, mod_ir
and sink.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

import numpy as np

from jaxflash import mod_ir, reference
from jaxflash.config import (LSE_CHECKPOINT_NAME, OUT_CHECKPOINT_NAME, AttentionConfig,
                             kernel_support)
from jaxflash.primitives import flash_bwd_p, flash_fwd_p
from jaxflash.sink import add_learnable_sink, learnable_sink_grad


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def attention_core(config: AttentionConfig, q, k, v, q_segment_ids, kv_segment_ids, sink,
                   arrays: tuple):
  """(out, lse) of a call with config.mods; differentiable in q, k, v, the sink (when
  config.has_sink) and the float arrays (integer ones get no gradient)."""
  return _bind(config, q, k, v, q_segment_ids, kv_segment_ids, sink, arrays)


def _bind(config, q, k, v, q_segment_ids, kv_segment_ids, sink, arrays):
  segments = (q_segment_ids, kv_segment_ids) if config.has_segment_ids else ()
  sink = (sink,) if config.has_sink else ()
  out, lse = flash_fwd_p.bind(q, k, v, *segments, *arrays, *sink, config=config)
  return out, lse


def _core_fwd(config, q, k, v, q_segment_ids, kv_segment_ids, sink, arrays):
  out, lse = _bind(config, q, k, v, q_segment_ids, kv_segment_ids, sink, arrays)
  out = checkpoint_name(out, OUT_CHECKPOINT_NAME)
  lse = checkpoint_name(lse, LSE_CHECKPOINT_NAME)
  return (out, lse), (q, k, v, q_segment_ids, kv_segment_ids, sink, arrays, out, lse)


def reference_forward(config: AttentionConfig, q, k, v, q_segment_ids, kv_segment_ids, sink,
                      arrays):
  """(out, lse) of the call on the blocked reference, the mods evaluated from their IR."""
  score_mod, mask_mod = mod_ir.functions(mod_ir.parse_spec(config.mods), arrays)
  plain = config.replace(mods=None, implementation="reference")
  out, lse = reference.blocked_forward(q, k, v, plain, q_segment_ids, kv_segment_ids,
                                       mods=reference.ScoreMods(None, score_mod, mask_mod))
  if config.has_sink:
    out, lse = add_learnable_sink(out, lse, sink)
  return out, lse


def kernel_backward(config: AttentionConfig, q, v) -> bool:
  """Whether the backward of this call runs the backward kernel."""
  return config.implementation == "cute" and kernel_support(
      "bwd", np.dtype(q.dtype).name, q.shape[-1], v.shape[-1], config)[0]


def _core_bwd(config, residuals, cotangents):
  q, k, v, q_segment_ids, kv_segment_ids, sink, arrays, out, lse = residuals
  d_out, d_lse = cotangents
  floats = [i for i, a in enumerate(arrays) if jnp.issubdtype(a.dtype, jnp.floating)]
  if kernel_backward(config, q, v):
    segments = (q_segment_ids, kv_segment_ids) if config.has_segment_ids else ()
    dq, dk, dv = flash_bwd_p.bind(q, k, v, out, lse, d_out.astype(out.dtype),
                                  d_lse.astype(lse.dtype), *segments, *arrays, config=config)
    d_sink = learnable_sink_grad(out, lse, d_out, d_lse, sink) if config.has_sink else None
    d_arrays = [None] * len(arrays)
    if floats:
      def of_arrays(float_arrays):
        every = list(arrays)
        for i, a in zip(floats, float_arrays):
          every[i] = a
        return reference_forward(config, q, k, v, q_segment_ids, kv_segment_ids, sink, every)
      (ref_out, ref_lse), vjp = jax.vjp(of_arrays, [arrays[i] for i in floats])
      (d_floats,) = vjp((d_out.astype(ref_out.dtype), d_lse.astype(ref_lse.dtype)))
      for i, d in zip(floats, d_floats):
        d_arrays[i] = d
    return dq, dk, dv, None, None, d_sink, tuple(d_arrays)

  def forward(q, k, v, sink, float_arrays):
    every = list(arrays)
    for i, a in zip(floats, float_arrays):
      every[i] = a
    return reference_forward(config, q, k, v, q_segment_ids, kv_segment_ids, sink, every)

  (out, lse), vjp = jax.vjp(forward, q, k, v, sink, [arrays[i] for i in floats])
  dq, dk, dv, d_sink, d_floats = vjp((d_out.astype(out.dtype), d_lse.astype(lse.dtype)))
  d_arrays = [None] * len(arrays)
  for i, d in zip(floats, d_floats):
    d_arrays[i] = d
  return dq, dk, dv, None, None, d_sink, tuple(d_arrays)


attention_core.defvjp(_core_fwd, _core_bwd)
