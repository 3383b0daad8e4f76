"""The additive-bias oracles of the bias tests: attention with every score materialised, and its
gradients (dq, dk, dv, dbias) by JAX's differentiation of that, in any compute dtype; and the
jaxflash reference as the oracle for the options that one lacks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jaxflash
from tests._cases import x64


def bias_attention(q, k, v, bias, *, causal=False, softcap=None, softmax_scale=None,
                   segment_ids=None, dtype=jnp.float64):
  """(out, lse) in `dtype`: s = softcap(q k^T * scale) + bias, then causal (bottom-right) and
  segment masks, softmax; rows without a key give out 0, lse -inf."""
  q, k, v, bias = (x.astype(dtype) for x in (q, k, v, bias))
  g = q.shape[2] // k.shape[2]
  k, v = (jnp.repeat(x, g, axis=2) for x in (k, v))
  seq_q, seq_k = q.shape[1], k.shape[1]
  scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=jax.lax.Precision.HIGHEST) * scale
  if softcap is not None:
    s = softcap * jnp.tanh(s / softcap)
  s = s + bias
  keep = jnp.ones((1, 1, seq_q, seq_k), bool)
  if causal:
    keep &= (jnp.arange(seq_k)[None, :] <= jnp.arange(seq_q)[:, None] + seq_k - seq_q)
  if segment_ids is not None:
    q_ids, kv_ids = segment_ids
    keep = keep & (q_ids[:, None, :, None] == kv_ids[:, None, None, :])
  s = jnp.where(keep, s, -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True)
  p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0))
  l = jnp.sum(p, axis=-1, keepdims=True)
  p = p / jnp.where(l > 0, l, 1)
  out = jnp.einsum("bhqk,bkhd->bqhd", p, v, precision=jax.lax.Precision.HIGHEST)
  lse = jnp.where(l[..., 0] > 0, jnp.log(jnp.where(l[..., 0] > 0, l[..., 0], 1)) + m[..., 0],
                  -jnp.inf)
  return out, lse


def loss_of(attend, w_out, w_lse):
  """sum(out * w_out) + sum(lse * w_lse over the finite lse): a loss that sends cotangents into
  both outputs."""
  def loss(q, k, v, bias):
    out, lse = attend(q, k, v, bias)
    lse_term = jnp.where(jnp.isfinite(lse), lse * w_lse.astype(lse.dtype), 0)
    return jnp.sum(out.astype(jnp.float32) * w_out.astype(jnp.float32)) + jnp.sum(
        lse_term.astype(jnp.float32))
  return loss


def oracle_and_naive(q, k, v, bias, w_out, w_lse, grads=True, **options):
  """((out, lse[, dq, dk, dv, dbias]) in float64 from the given (rounded) inputs, the same
  computed naively in q's dtype), as NumPy float64 arrays."""
  def run(dtype, arrays):
    attend = lambda q, k, v, bias: bias_attention(q, k, v, bias, dtype=dtype, **options)
    outs = attend(*arrays)
    if grads:
      def loss(q, k, v, bias):
        out, lse = attend(q, k, v, bias)
        lse_term = jnp.where(jnp.isfinite(lse), lse * w_lse.astype(dtype), 0)
        return jnp.sum(out * w_out.astype(dtype)) + jnp.sum(lse_term)
      outs = tuple(outs) + tuple(jax.grad(loss, argnums=(0, 1, 2, 3))(*arrays))
    return tuple(np.asarray(x, np.float64) for x in outs)

  naive = run(q.dtype, (q, k, v, bias))
  with x64():
    exact = run(jnp.float64, tuple(jnp.asarray(np.asarray(x, np.float64))
                                   for x in (q, k, v, bias)))
  return exact, naive


def reference_oracle_and_naive(q, k, v, bias, w_out, w_lse, kwargs):
  """(float64, naive in q's dtype) of (out, lse, dq, dk, dv, dbias) from the jaxflash reference,
  for options bias_attention lacks (windows, sinks; kwargs: jaxflash.attention's): the
  reference in float64 is the oracle there, and the naive run takes the bias rounded to q's
  dtype, as oracle_and_naive's does and as the kernels read it. Without that rounding a float32
  bias stays float32 in the reference, whose scores then carry none of the bias's rounding
  (f16_d128_segments_sink of test_gpu_bias: out error 2.6e-4 against 7.5e-4 from rounding the
  bias to float16 alone; tests/test_bias.py)."""
  def run(arrays, dtype):
    q, k, v, bias = arrays
    kw = dict(kwargs)
    if "learnable_sink" in kw:
      kw["learnable_sink"] = kw["learnable_sink"].astype(
          jnp.float64 if dtype == jnp.float64 else jnp.float32)
    attend = lambda q, k, v, bias: jaxflash.attention(q, k, v, bias=bias, return_lse=True,
                                                      implementation="reference", **kw)

    def loss(q, k, v, bias):
      out, lse = attend(q, k, v, bias)
      lse_term = jnp.where(jnp.isfinite(lse), lse * w_lse.astype(lse.dtype), 0)
      return jnp.sum(out * w_out.astype(out.dtype)) + jnp.sum(lse_term)
    outs = tuple(attend(*arrays)) + tuple(jax.grad(loss, argnums=(0, 1, 2, 3))(*arrays))
    return tuple(np.asarray(x, np.float64) for x in outs)

  naive = run((q, k, v, bias.astype(q.dtype)), q.dtype)
  with x64():
    exact = run(tuple(jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v, bias)),
                jnp.float64)
  return exact, naive
