"""Learnable attention sinks: one logit per query head that joins every row's softmax.

The sink is a column with a logit and no value: a row's weights are exp(score - lse) over its
visible keys, with lse = log(sum(exp(scores)) + exp(sink)), so they sum to less than one. Given
the (out, lse) of attention without the sink, the sink only rescales each row:
lse' = logaddexp(lse, sink), out' = out * exp(lse - lse'). Applying that once to merged partial
results (a ring's, or the blocks of one call) gives the exact result, so the sink never enters
a partial result twice. Imports jax only.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def check_learnable_sink(learnable_sink, num_heads: int, accept_float64: bool = False):
  """Raises TypeError/ValueError unless learnable_sink is a float32 array (num_heads,)."""
  if not hasattr(learnable_sink, "shape") or not hasattr(learnable_sink, "dtype"):
    raise TypeError(f"learnable_sink: expected a float32 array (num_heads,) = ({num_heads},), "
                    f"got {type(learnable_sink).__name__}")
  if tuple(learnable_sink.shape) != (num_heads,):
    raise ValueError(f"learnable_sink: expected shape (num_heads,) = ({num_heads},), got "
                     f"{tuple(learnable_sink.shape)}")
  accepted = ("float32", "float64") if accept_float64 else ("float32",)
  if np.dtype(learnable_sink.dtype).name not in accepted:
    raise TypeError(f"learnable_sink: expected dtype {' or '.join(accepted)}, got "
                    f"{learnable_sink.dtype}")


def add_learnable_sink(out, lse, learnable_sink):
  """(out, lse) of attention without the sink -> with it.

  out (batch, seq_q, heads, head_dim_v); lse (batch, heads, seq_q), -inf for rows that see no
  key (their out stays 0 and their lse becomes the sink); learnable_sink (heads,). The row
  factor is computed in lse's precision, out is rescaled in float32 (or wider) and returned in
  its own dtype. Differentiable: d sink[h] = sum over rows of exp(sink[h] - lse') times the
  row's lse' cotangent minus its (d out . out).
  """
  sink = learnable_sink.astype(lse.dtype)[None, :, None]
  lse_with = jnp.logaddexp(lse, sink)
  # 0 where lse = -inf, also when the sink is -inf too (then lse' = -inf: no NaN from -inf + inf).
  row = jnp.exp(lse - jnp.where(jnp.isneginf(lse_with), 0, lse_with))
  wide = jnp.promote_types(out.dtype, jnp.float32)
  out = (out.astype(wide) * jnp.swapaxes(row, 1, 2)[..., None].astype(wide)).astype(out.dtype)
  return out, lse_with


def learnable_sink_grad(out, lse, d_out, d_lse, learnable_sink):
  """d learnable_sink of attention with the sink, from its (out, lse) and their cotangents.

  With lse = log(sum_j exp(s_j) + exp(sink)) and out = sum_j exp(s_j - lse) v_j:
  d lse / d sink = exp(sink - lse) and d out / d sink = -exp(sink - lse) out, so
  d sink[h] = sum over batch and rows of exp(sink[h] - lse) (d_lse - rowsum(d_out * out)).
  A row with lse = -inf (no key and no finite sink) contributes 0. Returns (heads,) in the
  sink's dtype.
  """
  wide = jnp.promote_types(lse.dtype, jnp.float32)
  lse = lse.astype(wide)
  sink = learnable_sink.astype(wide)[None, :, None]
  weight = jnp.where(jnp.isneginf(lse), 0, jnp.exp(sink - jnp.where(jnp.isneginf(lse), 0, lse)))
  row_dot = jnp.einsum("bshd,bshd->bhs", d_out.astype(wide), out.astype(wide))
  grad = jnp.sum(weight * (d_lse.astype(wide) - row_dot), axis=(0, 2))
  return grad.astype(learnable_sink.dtype)
