"""`dot_product_attention`: a drop-in for `jax.nn.dot_product_attention` built on jaxflash.

Same signature and results as jax.nn's XLA path (top-left causal, its window and length rules).
Imports jax, jaxflash/attention.py and jaxflash/kv_cache.py.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxflash.attention import attention, attention_with_kv_lengths
from jaxflash.kv_cache import kv_cache_attention

# jax.nn.dot_product_attention's implementation names -> jaxflash's.
_IMPLEMENTATIONS = {None: None, "xla": "reference", "cudnn": "cute"}

# jax.nn writes this (times float32 max) into masked logits, so a row with no visible key
# becomes a uniform average over all keys; its log-sum-exp is this number + log(seq_k).
_JAX_NN_MASK_FACTOR = -0.7


@dataclasses.dataclass(frozen=True)
class _Band:
  """jax.nn's mask as a band: query i sees keys j with i - left <= j <= i + right (None: open)."""

  left: Optional[int]
  right: Optional[int]

  @classmethod
  def from_jax_nn(cls, is_causal: bool, local_window_size) -> "_Band":
    left = right = None
    if local_window_size is not None:
      left, right = local_window_size
    if is_causal:
      right = 0 if right is None else min(right, 0)
    return cls(left, right)

  def row_bounds(self, seq_q: int, seq_k: int):
    """First and last visible key of each query row (numpy, (seq_q,)); empty where lo > hi."""
    rows = np.arange(seq_q)
    lo = np.zeros(seq_q, np.int64) if self.left is None else np.maximum(rows - self.left, 0)
    hi = np.full(seq_q, seq_k - 1) if self.right is None else np.minimum(rows + self.right,
                                                                         seq_k - 1)
    return lo, hi

  def to_jaxflash(self, seq_q: int, seq_k: int):
    """The same band as jaxflash arguments on a prefix of queries and keys.

    Keys past the last visible one and queries past the last non-empty row are cut off, which
    also makes the bottom-right (jaxflash) window offsets non-negative. Returns
    (seq_q kept, seq_k kept, causal, window_size); (0, 0, ...) when no row sees any key.
    """
    if self.left is not None and self.right is not None and self.left + self.right < 0:
      return 0, 0, False, (None, None)
    keep_k = seq_k if self.right is None else min(seq_k, seq_q + self.right)
    keep_q = seq_q if self.left is None else min(seq_q, keep_k + self.left)
    if keep_k <= 0 or keep_q <= 0:
      return 0, 0, False, (None, None)
    shift = keep_k - keep_q  # jaxflash's diagonal sits at key i + shift
    left = None if self.left is None else self.left + shift
    right = None if self.right is None else self.right - shift
    assert (left is None or left >= 0) and (right is None or right >= 0), (self, seq_q, seq_k)
    if right == 0:  # the causal kernels are the fast path
      return keep_q, keep_k, True, (left, None)
    return keep_q, keep_k, False, (left, right)


def _check_inputs(query, key, value, query_seq_lengths, key_value_seq_lengths):
  """jax.nn's shape and dtype rules, with errors that name the argument."""
  if query.ndim not in (3, 4):
    raise ValueError(f"query: expected rank 4 (B, T, N, H) or 3 (T, N, H), got shape "
                     f"{query.shape}")
  for name, x in (("key", key), ("value", value)):
    if x.ndim != query.ndim:
      raise ValueError(f"{name}: expected rank {query.ndim} like query, got shape {x.shape}")
  if value.shape != key.shape:
    raise ValueError(f"value: expected the key's shape {key.shape}, got {value.shape}")
  if not query.dtype == key.dtype == value.dtype:
    raise ValueError(f"query/key/value: dtypes must match, got {query.dtype}, {key.dtype}, "
                     f"{value.dtype}")
  if query.shape[-1] != key.shape[-1] or (query.ndim == 4 and query.shape[0] != key.shape[0]):
    raise ValueError(f"query: expected batch and head_dim equal to the key's {key.shape}, got "
                     f"{query.shape}")
  if query.shape[-2] % key.shape[-2]:
    raise ValueError(f"query: the number of heads {query.shape[-2]} must be a multiple of the "
                     f"key/value heads {key.shape[-2]}")
  batch = query.shape[0] if query.ndim == 4 else 1
  for name, lengths in (("query_seq_lengths", query_seq_lengths),
                        ("key_value_seq_lengths", key_value_seq_lengths)):
    if lengths is not None and (lengths.shape != (batch,) or lengths.dtype != np.int32):
      raise ValueError(f"{name}: expected int32 of shape ({batch},), got {lengths.dtype} "
                       f"{lengths.shape}")


def _check_window(local_window_size):
  if local_window_size is None:
    return None
  if isinstance(local_window_size, numbers.Integral):
    local_window_size = (local_window_size, local_window_size)
  if (not isinstance(local_window_size, (tuple, list)) or len(local_window_size) != 2
      or not all(isinstance(w, numbers.Integral) for w in local_window_size)):
    raise ValueError(f"local_window_size: expected an int or (left, right) ints, got "
                     f"{local_window_size!r}")
  return tuple(int(w) for w in local_window_size)


def _static_scale(scale, head_dim: int) -> Optional[float]:
  """The scale as a Python float; None when jaxflash cannot take it (traced, or <= 0)."""
  if scale is None:
    return 1.0 / float(np.sqrt(head_dim))
  try:
    scale = float(scale)
  except (TypeError, jax.errors.ConcretizationTypeError):
    return None
  return scale if np.isfinite(scale) and scale > 0 else None


def _segment_ids(lengths, seq: int, batch: int, pad_id: int):
  """Lengths -> ids 0 for real tokens, pad_id after them (q and kv pads use different ids)."""
  if lengths is None:
    return jnp.zeros((batch, seq), jnp.int32)
  return jnp.where(jnp.arange(seq)[None, :] < lengths[:, None], 0, pad_id).astype(jnp.int32)


def _row_states(band: _Band, seq_q: int, seq_k: int, q_lengths, kv_lengths, mask=None):
  """(valid (B|1, seq_q), nonempty (B|1, seq_q, N|1)) per row, None when every row is both
  (static). mask: None or _kernel_mask's (B|1, N|1, T|1, S|1): a row is empty where it keeps
  no key of the band below the length."""
  lo, hi = band.row_bounds(seq_q, seq_k)
  if mask is None and q_lengths is None and kv_lengths is None:
    if np.all(lo <= hi):
      return None
    nonempty = jnp.asarray(lo <= hi)[None, :, None]
    return jnp.ones(nonempty.shape[:2], bool), nonempty
  rows = jnp.arange(seq_q)[None]
  valid = rows < q_lengths[:, None] if q_lengths is not None else jnp.ones((1, seq_q), bool)
  if mask is None:
    hi = jnp.asarray(hi)[None]
    if kv_lengths is not None:
      hi = jnp.minimum(hi, kv_lengths[:, None] - 1)
    return valid, (valid & (jnp.asarray(lo)[None] <= hi))[..., None]
  keys = np.arange(seq_k)
  seen = jnp.asarray((lo[:, None] <= keys) & (keys <= hi[:, None]))[None, None]  # (1, 1, T, S)
  if kv_lengths is not None:
    seen = seen & (keys < kv_lengths[:, None, None, None])
  nonempty = jnp.any(mask & seen, axis=3)  # (B|1, N|1, T)
  return valid, valid[..., None] & jnp.swapaxes(nonempty, 1, 2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _mean_of_values(key, value, needed, heads: int, implementation):
  """(batch, 1, heads, head_dim_v) in value's dtype: each head's mean of all of its values
  where `needed` (batch,) is set, zeros elsewhere.

  kv_cache_attention of a zero query (equal scores: the uniform average) over all keys of the
  needed sequences and none of the others, so a decoding step whose sequences all have keys
  reads no value twice (a mean over every sequence would read the values again).
  """
  batch, seq_k = key.shape[:2]
  zero = jnp.zeros((batch, 1, heads, key.shape[3]), value.dtype)
  lengths = jnp.where(needed, seq_k, 0).astype(jnp.int32)
  # Auto for "cute": off a GPU (lowering for CUDA elsewhere) the reference computes the mean.
  return kv_cache_attention(zero, key, value, lengths, causal=False,
                            implementation=None if implementation == "cute" else implementation)


def _mean_fwd(key, value, needed, heads, implementation):
  return _mean_of_values(key, value, needed, heads, implementation), (key, value, needed)


def _mean_bwd(heads, implementation, residuals, cotangent):
  """The mean's gradient: each value row of a needed sequence gets its heads' cotangents /
  seq_k."""
  del implementation
  key, value, needed = residuals
  batch, seq_k, kv_heads, dv = value.shape
  per_kv = cotangent.astype(jnp.float32).reshape(batch, kv_heads, heads // kv_heads, dv)
  per_kv = jnp.where(needed[:, None, None], per_kv.sum(axis=2) / seq_k, 0.0)
  d_value = jnp.broadcast_to(per_kv[:, None], value.shape).astype(value.dtype)
  return jnp.zeros_like(key), d_value, None


_mean_of_values.defvjp(_mean_fwd, _mean_bwd)


_BIAS_DTYPES = ("float32", "bfloat16", "float16")


def _rank4(x, query, key):
  """x padded to rank 4 in front, (B|1, N|1, T|1, S|1), or None where it has a rank above 4 or
  dims that do not broadcast to (B, N, T, S)."""
  if x.ndim > 4:
    return None
  batch = query.shape[0] if query.ndim == 4 else 1
  full = (batch, query.shape[-2], query.shape[-3], key.shape[-3])  # (B, N, T, S)
  x = x.reshape((1,) * (4 - x.ndim) + x.shape)
  return x if all(d in (1, f) for d, f in zip(x.shape, full)) else None


def _kernel_bias(bias, query, key):
  """jax.nn's bias as jaxflash.attention takes it, (B|1, N|1, T|1, S) (_rank4, a key dim of 1
  broadcast to S), or None where jaxflash cannot take it (another dtype, rank above 4, dims
  that do not broadcast): such calls run jax.nn's XLA path."""
  bias = jnp.asarray(bias)
  if np.dtype(bias.dtype).name not in _BIAS_DTYPES:
    return None
  bias = _rank4(bias, query, key)
  if bias is not None and bias.shape[3] != key.shape[-3]:
    bias = jnp.broadcast_to(bias, bias.shape[:3] + (key.shape[-3],))
  return bias


def _kernel_mask(mask, query, key):
  """jax.nn's boolean mask as (B|1, N|1, T|1, S|1) (_rank4), or None where the kernels cannot
  take it as a mask_mod (not boolean, rank above 4, dims that do not broadcast, float32 inputs,
  which jax.nn's materialised path serves as well): such calls run jax.nn's XLA path."""
  mask = jnp.asarray(mask)
  if mask.dtype != jnp.bool_ or np.dtype(query.dtype).name not in ("float16", "bfloat16"):
    return None
  return _rank4(mask, query, key)


def _mask_mod(mask):
  """The mask_mod that reads _kernel_mask's mask at (batch, head, q_idx, kv_idx), index 0 on
  its dims of size 1. The kernels call it with indices inside the call's (prefix of the)
  sequences, so the read takes no negative-index wrap: one variant serves every mask with the
  same dims of size 1, whatever its extents."""
  def mask_mod(b, h, i, j):
    # int32 indices: the reference's blocked path may pass int64 ones when x64 is on.
    index = tuple(jax.lax.convert_element_type(x, jnp.int32) if n != 1 else jnp.int32(0)
                  for x, n in zip((b, h, i, j), mask.shape))
    return jax.lax.dynamic_slice(mask, index, (1, 1, 1, 1),
                                 allow_negative_indices=False).reshape(())
  return mask_mod


def _mapped_attention(query, key, value, band: _Band, scale: float, q_lengths, kv_lengths,
                      implementation, return_residual, bias=None, mask=None):
  """jaxflash on the kept prefix, then jax.nn's values for rows that see no key. bias: None or
  _kernel_bias's (B|1, N|1, T|1, S); mask: None or _kernel_mask's (B|1, N|1, T|1, S|1), a
  mask_mod of the call (its rows that keep no key are found in XLA, _row_states)."""
  batch, seq_q, heads, _ = query.shape
  seq_k, kv_heads = key.shape[1], key.shape[2]
  keep_q, keep_k, causal, window = band.to_jaxflash(seq_q, seq_k)
  filled = None  # (batch,): sequences whose rows got jax.nn's fill in the attention call
  if keep_q:
    options = dict(causal=causal, softmax_scale=scale, window_size=window,
                   return_lse=return_residual, implementation=implementation)
    if bias is not None:  # the kept rows and keys of the bias
      options["bias"] = bias[:, :, :keep_q if bias.shape[2] != 1 else 1, :keep_k]
    if mask is not None:
      options["mask_mod"] = _mask_mod(mask)
    q, k, v = query[:, :keep_q], key[:, :keep_k], value[:, :keep_k]
    if q_lengths is None and kv_lengths is not None and mask is None:
      # decoding: lengths reach the kernel
      lengths = kv_lengths
      if band == _Band(None, None):
        # jax.nn's fill for a sequence with no key, the uniform average of all its values, is
        # the attention of a zero query over all its keys: such sequences join the same call
        # (exact in the gradient too: no gradient reaches q or k through a zero query).
        filled = kv_lengths <= 0
        q = jnp.where(filled[:, None, None, None], jnp.zeros((), q.dtype), q)
        lengths = jnp.where(filled, seq_k, kv_lengths)
      result = attention_with_kv_lengths(q, k, v, lengths, **options)
    elif q_lengths is not None or kv_lengths is not None:
      q_ids = _segment_ids(q_lengths, seq_q, batch, 1)[:, :keep_q]
      kv_ids = _segment_ids(kv_lengths, seq_k, batch, 2)[:, :keep_k]
      result = attention(q, k, v, q_segment_ids=q_ids, kv_segment_ids=kv_ids, **options)
    else:
      result = attention(q, k, v, **options)
    out, lse = result if return_residual else (result, None)
    # Rows cut off the end see no key: zeros here, jax.nn's fill below.
    out = jnp.pad(out, ((0, 0), (0, seq_q - keep_q), (0, 0), (0, 0)))
    if return_residual:
      lse = jnp.pad(lse, ((0, 0), (0, 0), (0, seq_q - keep_q)), constant_values=-jnp.inf)
  else:
    out = jnp.zeros(query.shape, query.dtype)
    lse = jnp.full((batch, heads, seq_q), -jnp.inf, jnp.float32)
  states = _row_states(band, seq_q, seq_k, q_lengths, kv_lengths, mask)
  if states is not None and filled is None:
    valid, nonempty = states
    # jax.nn masks with a finite logit, so a real query with no visible key averages all
    # values uniformly; padded queries (past query_seq_lengths) are zeroed.
    if kv_lengths is None:  # no lengths: every sequence's mean over all of its keys
      mean = jnp.mean(value.astype(jnp.float32), axis=1)  # (batch, kv_heads, head_dim)
      mean = jnp.repeat(mean, heads // kv_heads, axis=1).astype(query.dtype)[:, None]
    else:
      needed = jnp.any(valid[..., None] & ~nonempty, axis=(1, 2))
      mean = _mean_of_values(key, value, needed, heads, implementation)
    fill = jnp.where(valid[..., None, None], mean, jnp.zeros((), query.dtype))
    out = jnp.where(nonempty[..., None], out, fill)
  if not return_residual:
    return out
  masked_lse = jnp.float32(_JAX_NN_MASK_FACTOR * np.finfo(np.float32).max) + jnp.log(
      jnp.float32(seq_k))
  residual = jnp.swapaxes(lse, 1, 2)  # (batch, seq_q, heads), as jax.nn
  if states is not None:
    residual = jnp.where(states[1], residual, masked_lse)
  # jax.nn returns the residual in the input dtype and without a gradient.
  return out, jax.lax.stop_gradient(residual.astype(query.dtype))


def dot_product_attention(
    query,
    key,
    value,
    bias=None,
    mask=None,
    *,
    scale: Optional[float] = None,
    is_causal: bool = False,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    local_window_size=None,
    implementation: Optional[str] = None,
    return_residual: bool = False,
):
  """`jax.nn.dot_product_attention` with jaxflash underneath; same arguments, same results.

  Semantics are those of jax.nn's XLA path, including where they differ from
  `jaxflash.attention`: `is_causal` is aligned top-left (query i sees keys j <= i, also when
  T != S), `local_window_size=(left, right)` keeps keys in [i - left, i + right] of that same
  diagonal, a real query that sees no key gets the mean of all values (jax.nn masks with a
  finite logit), and queries past `query_seq_lengths` are zero.

  Args:
    query: (B, T, N, H) or (T, N, H).
    key: (B, S, K, H) or (S, K, H); N % K == 0 (MQA/GQA).
    value: same shape as key.
    bias: optional, broadcastable to (B, N, T, S); added to the scaled logits.
    mask: optional boolean, broadcastable to (B, N, T, S); True keeps a logit.
    scale: logit scale; default 1 / sqrt(H).
    is_causal: top-left causal mask.
    query_seq_lengths: optional int32 (B,); queries at or past the length output zeros.
    key_value_seq_lengths: optional int32 (B,); keys at or past the length are masked.
    local_window_size: an int w (= (w, w)) or (left, right).
    implementation: None (jaxflash's choice: CuTe kernels on a supported GPU, else the
      pure-JAX reference), "xla" (jaxflash's pure-JAX reference), or "cudnn" (the fused
      jaxflash kernels, or an error saying why not; jax.nn's cuDNN is not called).
    return_residual: also return the log-sum-exp, (B, T, N) or (T, N), in the input dtype
      and without a gradient, as jax.nn does.

  Returns:
    The output, shaped like query; or (output, residual) if return_residual.

  A float `bias` (float32 / bfloat16 / float16, rank up to 4, broadcastable to (B, N, T, S))
  runs in jaxflash (the kernels' bias variants, or the reference), differentiable in the bias.
  A boolean `mask` of float16 / bfloat16 inputs without a bias runs in jaxflash as a mask_mod
  that reads it (block-sparse kernels: blocks the mask empties are skipped), its rows that keep
  no key filled with jax.nn's average of all values. A mask with a bias or of float32 inputs,
  a bias jaxflash cannot take, or a traced or non-positive `scale` cannot be expressed to
  jaxflash: with implementation None or "xla" such a call runs jax.nn's own XLA attention
  (materialised scores, same results); with "cudnn" it raises a ValueError.
  """
  query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
  if query_seq_lengths is not None:
    query_seq_lengths = jnp.asarray(query_seq_lengths)
  if key_value_seq_lengths is not None:
    key_value_seq_lengths = jnp.asarray(key_value_seq_lengths)
  if implementation not in _IMPLEMENTATIONS:
    raise ValueError(f"implementation: expected None, 'xla' or 'cudnn', got {implementation!r}")
  _check_inputs(query, key, value, query_seq_lengths, key_value_seq_lengths)
  local_window_size = _check_window(local_window_size)
  static_scale = _static_scale(scale, query.shape[-1])
  kernel_bias = None if bias is None else _kernel_bias(bias, query, key)
  kernel_mask = None if mask is None or bias is not None else _kernel_mask(mask, query, key)
  dense = [name for name, on in (
      ("bias (dtype or shape)", bias is not None and kernel_bias is None),
      ("mask (with a bias, not boolean, float32 inputs or shape)",
       mask is not None and kernel_mask is None),
      ("scale (traced or <= 0)", static_scale is None)) if on]
  if dense:
    if implementation == "cudnn":
      raise ValueError(f"{', '.join(dense)}: the jaxflash kernels take a bias in float32 / "
                       f"bfloat16 / float16 broadcastable to (B, N, T, S), a boolean mask of "
                       f"float16 / bfloat16 inputs broadcastable to (B, N, T, S) without a "
                       f"bias, and only a static scale > 0; use is_causal, local_window_size "
                       f"and the *_seq_lengths arguments, or implementation=None/'xla' for "
                       f"materialised scores")
    return jax.nn.dot_product_attention(
        query, key, value, bias, mask, scale=scale, is_causal=is_causal,
        query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=local_window_size, implementation="xla",
        return_residual=return_residual)
  squeeze = query.ndim == 3
  if squeeze:
    query, key, value = query[None], key[None], value[None]
  band = _Band.from_jax_nn(bool(is_causal), local_window_size)
  result = _mapped_attention(query, key, value, band, static_scale, query_seq_lengths,
                             key_value_seq_lengths, _IMPLEMENTATIONS[implementation],
                             return_residual, kernel_bias, kernel_mask)
  if squeeze:
    result = jax.tree.map(lambda x: x[0], result)
  return result
