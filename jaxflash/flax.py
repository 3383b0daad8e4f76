"""Flax integration: an `attention_fn` for linen/nnx MultiHeadAttention, and attention blocks.

Uses Flax and jaxflash's public API only. `import jaxflash` never imports this module; users
write `import jaxflash.flax`.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

import jaxflash

# jaxflash.attention keywords that make sense as fixed options of an attention_fn.
_STATIC_OPTIONS = ("causal", "softmax_scale", "window_size", "softcap", "score_mod",
                   "mask_mod", "deterministic", "implementation")

default_kernel_init = nn.initializers.lecun_normal()  # Flax's MultiHeadAttention default


def make_attention_fn(**attention_options) -> Callable[..., jax.Array]:
  """An `attention_fn` for Flax's linen MultiHeadDotProductAttention and nnx MultiHeadAttention.

  Example:
    >>> import flax.linen as nn, jaxflash.flax
    >>> layer = nn.MultiHeadDotProductAttention(
    ...     num_heads=8, attention_fn=jaxflash.flax.make_attention_fn(causal=True))

  Args:
    **attention_options: fixed keywords of `jaxflash.attention`: causal, softmax_scale,
      window_size, softcap, score_mod / mask_mod (JAX functions of scalars; batch is the index
      into the folded batch dims; they run on the reference path), deterministic
      (bitwise-reproducible backward), implementation.

  Returns:
    fn(query, key, value, bias=None, mask=None, ...) with query (batch..., q_len, heads,
    head_dim) and key/value (batch..., kv_len, kv_heads, head_dim); leading batch dims are
    folded. A Flax `mask` (broadcastable to (batch..., heads, q_len, kv_len); a nonzero or
    True entry keeps a key) and / or `bias` (float, same shape) run through
    `jaxflash.dot_product_attention`: in the kernels where it takes them (a boolean mask of
    float16 / bfloat16 inputs as a block-sparse mask_mod, a bias with its gradient), with
    Flax's semantics for a row whose mask keeps no key (the average of all values); causal and
    window_size still apply (bottom-right aligned), softmax_scale and implementation too, while
    softcap, score_mod, mask_mod and deterministic cannot join a dense mask or bias and raise.
    Without them, jaxflash.attention runs the call. What cannot be expressed raises a
    ValueError instead of being ignored: active dropout, sowing attention weights, custom
    einsums. `precision` is not used (scores and accumulation are float32) and the softmax is
    always float32. An `is_causal=True` from the module (nnx) is honoured when q_len ==
    kv_len.
  """
  unknown = sorted(set(attention_options) - set(_STATIC_OPTIONS))
  if unknown:
    raise TypeError(f"make_attention_fn: unknown option(s) {unknown}; accepted: "
                    f"{', '.join(_STATIC_OPTIONS)} (segment ids are per call: use the "
                    f"jaxflash.flax blocks)")

  # The keywords are listed one by one: linen passes only those in this signature, so a
  # keyword missing here would be dropped silently instead of being checked.
  def attention_fn(query, key, value, bias=None, mask=None, broadcast_dropout=True,
                   dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
                   precision=None, module=None, is_causal=False,
                   force_fp32_for_softmax=False, qk_attn_weights_einsum=None,
                   attn_weights_value_einsum=None):
    del broadcast_dropout, dropout_rng, precision, force_fp32_for_softmax
    _reject_unsupported(dropout_rate, deterministic, module, qk_attn_weights_einsum,
                        attn_weights_value_einsum)
    if dtype is None:
      dtype = jnp.result_type(query, key, value)
    query, key, value = (jnp.asarray(x, dtype) for x in (query, key, value))
    options = dict(attention_options)
    if is_causal:
      if query.shape[-3] != key.shape[-3]:
        raise ValueError(
            f"is_causal=True with q_len {query.shape[-3]} != kv_len {key.shape[-3]}: Flax and "
            f"jax.nn align causal masks top-left, jaxflash bottom-right; use "
            f"make_attention_fn(causal=True) for bottom-right, or "
            f"jaxflash.dot_product_attention for top-left")
      options["causal"] = True
    if mask is not None or bias is not None:
      return _dense_mask_attention(query, key, value, bias, mask, options)
    return _folded_attention(query, key, value, options)

  return attention_fn


def _reject_unsupported(dropout_rate, deterministic, module, qk_einsum, value_einsum):
  if dropout_rate and not deterministic:
    raise ValueError(f"dropout_rate={dropout_rate}: jaxflash attention has no attention "
                     f"dropout; set dropout_rate=0.0 or deterministic=True")
  if module is not None:
    raise ValueError("sow_weights: jaxflash never materialises the attention weights, so "
                     "they cannot be sown; call without sow_weights")
  if qk_einsum is not None or value_einsum is not None:
    raise ValueError("qk_attn_weights_einsum/attn_weights_value_einsum: custom einsums "
                     "(e.g. quantised AQT) cannot run inside the fused attention")


def _dense_mask_attention(query, key, value, bias, mask, options):
  """A Flax mask and / or bias: jaxflash.dot_product_attention (jax.nn's semantics, which are
  Flax's for rows that keep no key) on the folded batch, with make_attention_fn's causal and
  window_size (bottom-right aligned) as jax.nn's top-left local_window_size."""
  refused = [name for name in ("softcap", "score_mod", "mask_mod")
             if options.get(name) is not None]
  if options.get("deterministic"):
    refused.append("deterministic")
  given = " and ".join(name for name, x in (("mask", mask), ("bias", bias)) if x is not None)
  if refused:
    raise ValueError(f"{given}: a dense Flax {given} runs through "
                     f"jaxflash.dot_product_attention, which takes no {', '.join(refused)}; "
                     f"express the {given} as make_attention_fn(mask_mod=..., score_mod=...) "
                     f"or drop {', '.join(refused)}")
  window = options.get("window_size", (None, None))
  if (not isinstance(window, (tuple, list)) or len(window) != 2
      or not all(w is None or isinstance(w, int) for w in window)):
    raise ValueError(f"window_size: expected (left, right), each None or an int, got "
                     f"{window!r}")
  left, right = window
  if options.get("causal"):
    right = 0 if right is None else min(right, 0)
  seq_q, seq_k = query.shape[-3], key.shape[-3]
  local_window_size = None
  if left is not None or right is not None:
    # jaxflash's diagonal sits at key i + seq_k - seq_q, jax.nn's at key i.
    shift, far = seq_k - seq_q, seq_q + seq_k
    local_window_size = (far if left is None else left - shift,
                         far if right is None else right + shift)
  implementations = {None: None, "cute": "cudnn", "reference": "xla"}  # jax.nn's names
  if options.get("implementation") not in implementations:
    raise ValueError(f"implementation: expected None, 'cute' or 'reference', got "
                     f"{options['implementation']!r}")
  batch_dims = query.shape[:-3]
  fold = lambda x: x.reshape((-1,) + x.shape[-3:])

  def fold_scores(x):  # broadcastable to (batch..., heads, q_len, kv_len) -> (batch | 1, ...)
    if x is None or x.ndim <= 3:
      return x
    if math.prod(x.shape[:-3]) > 1:
      x = jnp.broadcast_to(x, batch_dims + x.shape[-3:])
    return fold(x)

  if mask is not None:  # Flax keeps a key where the mask is nonzero (make_attention_mask: float)
    mask = jnp.asarray(mask).astype(bool)
  if bias is not None:
    bias = jnp.asarray(bias)
  out = jaxflash.dot_product_attention(
      fold(query), fold(key), fold(value), fold_scores(bias), fold_scores(mask),
      scale=options.get("softmax_scale"), local_window_size=local_window_size,
      implementation=implementations[options.get("implementation")])
  return out.reshape(batch_dims + out.shape[1:])


def _folded_attention(query, key, value, options):
  """jaxflash.attention on (batch..., len, heads, dim) inputs: batch dims folded into one."""
  if query.ndim < 3 or key.ndim != query.ndim or value.ndim != query.ndim:
    raise ValueError(f"query/key/value: expected (batch..., length, heads, head_dim) of equal "
                     f"rank, got {query.shape}, {key.shape}, {value.shape}")
  batch_dims = query.shape[:-3]
  batch = math.prod(batch_dims)
  fold = lambda x: x.reshape((batch,) + x.shape[-3:])
  out = jaxflash.attention(fold(query), fold(key), fold(value), **options)
  return out.reshape(batch_dims + out.shape[1:])


def apply_rope(x, positions, base: float = 10000.0):
  """Rotary position embedding (rotate-half form) on the last axis of x.

  Args:
    x: (batch, seq, heads, head_dim), head_dim even.
    positions: (batch, seq) integer positions.
    base: the wavelength base (theta).

  Returns:
    x rotated, in x's dtype (the angles are computed in float32).
  """
  head_dim = x.shape[-1]
  if head_dim % 2:
    raise ValueError(f"rope: head_dim must be even, got {head_dim}")
  inv_freq = base ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
  angles = positions.astype(jnp.float32)[..., None, None] * inv_freq  # (b, s, 1, d/2)
  sin, cos = jnp.sin(angles), jnp.cos(angles)
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _check_block_inputs(inputs_q, inputs_kv):
  for name, x in (("inputs_q", inputs_q), ("inputs_kv", inputs_kv)):
    if x.ndim != 3:
      raise ValueError(f"{name}: expected (batch, seq, features), got shape {x.shape}")


def _attend(attention_fn, q, k, v, *, causal, window_size, softcap, rope_base, segment_ids,
            kv_segment_ids, positions, kv_positions, sink=None):
  """RoPE, segment ids, the sink and the attention call shared by the linen and nnx blocks."""
  if rope_base is not None:
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(q.shape[1]), q.shape[:2])
    if kv_positions is None:
      kv_positions = positions if k.shape[1] == q.shape[1] else jnp.broadcast_to(
          jnp.arange(k.shape[1]), k.shape[:2])
    q, k = apply_rope(q, positions, rope_base), apply_rope(k, kv_positions, rope_base)
  # Only the options in use reach attention_fn (a custom one may not take the others).
  per_call = {}
  if segment_ids is not None or kv_segment_ids is not None:
    if segment_ids is None:
      raise ValueError("segment_ids: required when kv_segment_ids is given")
    per_call.update(q_segment_ids=segment_ids,
                    kv_segment_ids=segment_ids if kv_segment_ids is None else kv_segment_ids)
  if sink is not None:
    per_call["learnable_sink"] = jnp.asarray(sink, jnp.float32)
  return attention_fn(q, k, v, causal=causal, window_size=window_size, softcap=softcap,
                      **per_call)


class LinenAttention(nn.Module):
  """Multi-head (GQA/MQA) attention block for flax.linen on `jaxflash.attention`.

  The parameters `query`, `key`, `value`, `out` have the names and shapes of
  `flax.linen.MultiHeadDotProductAttention` (with num_kv_heads == num_heads), so weights
  move between the two.

  Attributes:
    num_heads: query heads.
    head_dim: per-head features; default features // num_heads.
    num_kv_heads: key/value heads (GQA); default num_heads.
    out_features: default the input features.
    causal: causal self-attention (bottom-right aligned when q_len != kv_len).
    window_size: (left, right) local attention, None = unbounded.
    softcap: soft-capping of the scores, None = off.
    learnable_sink: a learnable sink logit per query head (parameter `sink`, (num_heads,),
      gpt-oss's attention sinks; see jaxflash.attention); off by default.
    sink_init: the sink parameter's initializer (zeros: every sink starts at logit 0).
    rope_base: rotary embedding base applied to q and k; None = no RoPE.
    use_bias: biases in the projections.
    dtype: computation dtype (None: inferred); param_dtype: parameter dtype.
    kernel_init, out_kernel_init, bias_init: initializers (wrap them with
      `nn.with_partitioning` to shard the parameters).
    attention_fn: a function with jaxflash.attention's signature; default jaxflash.attention.
  """

  num_heads: int
  head_dim: Optional[int] = None
  num_kv_heads: Optional[int] = None
  out_features: Optional[int] = None
  causal: bool = False
  window_size: tuple = (None, None)
  softcap: Optional[float] = None
  learnable_sink: bool = False
  sink_init: Callable = nn.initializers.zeros_init()
  rope_base: Optional[float] = None
  use_bias: bool = False
  dtype: Any = None
  param_dtype: Any = jnp.float32
  kernel_init: Callable = default_kernel_init
  out_kernel_init: Optional[Callable] = None
  bias_init: Callable = nn.initializers.zeros_init()
  attention_fn: Optional[Callable] = None

  @nn.compact
  def __call__(self, inputs_q, inputs_kv=None, *, segment_ids=None, kv_segment_ids=None,
               positions=None, kv_positions=None):
    """Attends inputs_q (batch, q_len, features) to inputs_kv (default inputs_q).

    segment_ids (batch, q_len) / kv_segment_ids (batch, kv_len) restrict attention to equal
    ids (packing, padding); positions/kv_positions (batch, len) feed RoPE (default arange).
    Returns (batch, q_len, out_features).
    """
    inputs_kv = inputs_q if inputs_kv is None else inputs_kv
    _check_block_inputs(inputs_q, inputs_kv)
    features = inputs_q.shape[-1]
    head_dim = self.head_dim or features // self.num_heads
    num_kv_heads = self.num_kv_heads or self.num_heads
    dense = lambda heads, name: nn.DenseGeneral(
        features=(heads, head_dim), use_bias=self.use_bias, dtype=self.dtype,
        param_dtype=self.param_dtype, kernel_init=self.kernel_init, bias_init=self.bias_init,
        name=name)
    q = dense(self.num_heads, "query")(inputs_q)
    k = dense(num_kv_heads, "key")(inputs_kv)
    v = dense(num_kv_heads, "value")(inputs_kv)
    sink = None
    if self.learnable_sink:
      sink = self.param("sink", self.sink_init, (self.num_heads,), self.param_dtype)
    x = _attend(self.attention_fn or jaxflash.attention, q, k, v, causal=self.causal,
                window_size=self.window_size, softcap=self.softcap, rope_base=self.rope_base,
                segment_ids=segment_ids, kv_segment_ids=kv_segment_ids, positions=positions,
                kv_positions=kv_positions, sink=sink)
    return nn.DenseGeneral(
        features=self.out_features or features, axis=(-2, -1), use_bias=self.use_bias,
        dtype=self.dtype, param_dtype=self.param_dtype,
        kernel_init=self.out_kernel_init or self.kernel_init, bias_init=self.bias_init,
        name="out")(x)


class NnxAttention(nnx.Module):
  """Multi-head (GQA/MQA) attention block for flax.nnx on `jaxflash.attention`.

  Its `query`, `key`, `value`, `out` LinearGeneral layers have the shapes of
  `flax.nnx.MultiHeadAttention`'s, so weights move between the two. The arguments are those
  of `LinenAttention` plus `in_features` and `rngs`.
  """

  def __init__(self, in_features: int, num_heads: int, *, head_dim: Optional[int] = None,
               num_kv_heads: Optional[int] = None, out_features: Optional[int] = None,
               causal: bool = False, window_size=(None, None), softcap: Optional[float] = None,
               learnable_sink: bool = False,
               sink_init: Callable = nn.initializers.zeros_init(),
               rope_base: Optional[float] = None, use_bias: bool = False, dtype=None,
               param_dtype=jnp.float32, kernel_init: Callable = default_kernel_init,
               out_kernel_init: Optional[Callable] = None,
               bias_init: Callable = nn.initializers.zeros_init(),
               attention_fn: Optional[Callable] = None, rngs: nnx.Rngs):
    head_dim = head_dim or in_features // num_heads
    num_kv_heads = num_kv_heads or num_heads
    linear = lambda heads: nnx.LinearGeneral(
        in_features, (heads, head_dim), use_bias=use_bias, dtype=dtype,
        param_dtype=param_dtype, kernel_init=kernel_init, bias_init=bias_init, rngs=rngs)
    self.query, self.key, self.value = linear(num_heads), linear(num_kv_heads), linear(
        num_kv_heads)
    self.out = nnx.LinearGeneral(
        (num_heads, head_dim), out_features or in_features, axis=(-2, -1), use_bias=use_bias,
        dtype=dtype, param_dtype=param_dtype, kernel_init=out_kernel_init or kernel_init,
        bias_init=bias_init, rngs=rngs)
    self.causal, self.window_size, self.softcap = causal, tuple(window_size), softcap
    self.sink = (nnx.Param(sink_init(rngs.params(), (num_heads,), param_dtype))
                 if learnable_sink else None)
    self.rope_base = rope_base
    self.attention_fn = attention_fn or jaxflash.attention

  def __call__(self, inputs_q, inputs_kv=None, *, segment_ids=None, kv_segment_ids=None,
               positions=None, kv_positions=None):
    """As `LinenAttention.__call__`."""
    inputs_kv = inputs_q if inputs_kv is None else inputs_kv
    _check_block_inputs(inputs_q, inputs_kv)
    x = _attend(self.attention_fn, self.query(inputs_q), self.key(inputs_kv),
                self.value(inputs_kv), causal=self.causal, window_size=self.window_size,
                softcap=self.softcap, rope_base=self.rope_base, segment_ids=segment_ids,
                kv_segment_ids=kv_segment_ids, positions=positions, kv_positions=kv_positions,
                sink=None if self.sink is None else self.sink[...])
    return self.out(x)
