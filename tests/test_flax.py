"""jaxflash.flax: the attention_fn adapter and the linen/nnx blocks against Flax's own attention.

Each comparison follows the oracle rule: Flax's attention in float64 is the oracle, Flax's in
float32 the naive result, jaxflash's (reference path, float32) must be within 2x of it.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")
import flax.linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

import jaxflash  # noqa: E402
import jaxflash.flax as jf  # noqa: E402
from tests._cases import x64  # noqa: E402
from tests._oracle import assert_close_to_oracle  # noqa: E402

B, T, D, HEADS = 2, 12, 32, 4


def _normal(seed, shape):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _upcast(tree):
  return jax.tree.map(lambda x: jnp.asarray(x, jnp.float64)
                      if jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating) else x, tree)


def _value_and_grads(fn, params, x, cotangent):
  out, vjp = jax.vjp(fn, params, x)
  return out, vjp(cotangent)


def assert_matches_flax(ours, flax_fn, params, x, name):
  """ours(params, x) vs flax_fn(params, x): output and gradients w.r.t. params and x."""
  cotangent = _normal(99, jax.eval_shape(flax_fn, params, x).shape)
  out, grads = _value_and_grads(ours, params, x, cotangent)
  naive_out, naive_grads = _value_and_grads(flax_fn, params, x, cotangent)
  with x64():
    oracle = jax.device_get(_value_and_grads(flax_fn, _upcast(params), _upcast(x),
                                             _upcast(cotangent)))
  flat = lambda tree: jax.tree_util.tree_flatten_with_path(tree)[0]
  # A leaf whose exact value is 0 (the key projection's bias: softmax ignores a shift of all of
  # a row's scores) has no relative error, only float32 rounding: it must be 0 up to that
  # rounding of the gradients' scale.
  scale = max(float(np.linalg.norm(np.asarray(g, np.float64))) for g in jax.tree.leaves(oracle))
  for (path, a), (_, e), (_, n) in zip(flat((out, grads)), flat(oracle),
                                       flat((naive_out, naive_grads))):
    where = f"{name} {jax.tree_util.keystr(path)}"
    if np.linalg.norm(np.asarray(e, np.float64)) <= 1e-9 * scale:
      err = np.linalg.norm(np.asarray(a, np.float64) - np.asarray(e, np.float64))
      assert err <= 1e-5 * scale, f"{where}: {err:.3e} away from its exact 0 (scale {scale:.3e})"
      continue
    assert_close_to_oracle(a, e, n, name=where)


# --------------------------------------------------------------------------------------------
# make_attention_fn in flax.linen.MultiHeadDotProductAttention

@pytest.mark.parametrize("causal", [False, True], ids=["plain", "causal"])
def test_linen_mha_attention_fn(causal):
  x = _normal(0, (B, T, D))
  ours = nn.MultiHeadDotProductAttention(num_heads=HEADS,
                                         attention_fn=jf.make_attention_fn(causal=causal))
  theirs = nn.MultiHeadDotProductAttention(num_heads=HEADS)
  params = theirs.init(jax.random.PRNGKey(0), x)
  mask = lambda x: nn.make_causal_mask(x[..., 0]) if causal else None
  assert_matches_flax(lambda p, x: ours.apply(p, x), lambda p, x: theirs.apply(p, x, mask=mask(x)),
                      params, x, "linen")


def test_linen_mha_cross_attention_and_batch_dims():
  # Two leading batch dims and q_len != kv_len: the adapter folds them into one.
  xq, xkv = _normal(1, (2, 3, 5, D)), _normal(2, (2, 3, 9, D))
  ours = nn.MultiHeadDotProductAttention(num_heads=HEADS, attention_fn=jf.make_attention_fn())
  theirs = nn.MultiHeadDotProductAttention(num_heads=HEADS)
  params = theirs.init(jax.random.PRNGKey(0), xq, xkv)
  assert_matches_flax(lambda p, x: ours.apply(p, x, xkv), lambda p, x: theirs.apply(p, x, xkv),
                      params, xq, "linen cross")


def _padding_mask(x, valid, causal):
  """Flax's (batch, 1, q, kv) mask of valid[b] leading tokens, causal or not; with the key
  padding at the front (valid < 0: the last -valid tokens), causal rows before it keep none."""
  pos = jnp.arange(x.shape[1])
  keep = jnp.stack([pos < v if v >= 0 else pos >= x.shape[1] + v for v in valid])
  mask = nn.make_attention_mask(jnp.ones(x.shape[:2], bool), keep)
  return nn.combine_masks(mask, nn.make_causal_mask(x[..., 0])) if causal else mask


@pytest.mark.parametrize("causal", [False, True], ids=["padding", "padding_causal"])
def test_linen_mha_with_a_flax_mask_matches_flax(causal):
  """MultiHeadDotProductAttention's mask goes through the adapter: output and gradients
  against Flax's own attention under the oracle rule, rows whose mask keeps no key included
  (Flax and jax.nn give them the average of all values)."""
  x = _normal(12, (B, T, D))
  valid = [T - 3, -5]  # sequence 1: keys T-5..T-1, so its first causal rows keep none
  ours = nn.MultiHeadDotProductAttention(num_heads=HEADS, attention_fn=jf.make_attention_fn())
  theirs = nn.MultiHeadDotProductAttention(num_heads=HEADS)
  params = theirs.init(jax.random.PRNGKey(0), x)
  mask = lambda x: _padding_mask(x, valid, causal)
  assert_matches_flax(lambda p, x: ours.apply(p, x, mask=mask(x)),
                      lambda p, x: theirs.apply(p, x, mask=mask(x)), params, x, "linen mask")


def test_adapter_takes_a_bias_with_its_gradient():
  """A Flax bias (broadcast over batch) reaches jaxflash.dot_product_attention: output and the
  gradients of q, k, v and the bias against Flax's attention under the oracle rule."""
  q, k, v = (_normal(20 + i, (B, T, HEADS, 8)) for i in range(3))
  bias = _normal(23, (1, HEADS, T, T))
  fn = jf.make_attention_fn()
  ours = lambda args, x: fn(x, *args[:2], bias=args[2])
  theirs = lambda args, x: nn.dot_product_attention(x, *args[:2], bias=args[2])
  assert_matches_flax(ours, theirs, (k, v, bias), q, "bias")


def test_adapter_aligns_causal_bottom_right_with_a_mask():
  """make_attention_fn(causal=True, window_size=...) with q_len != kv_len and a mask that
  keeps every key: the same band as jaxflash.attention (bottom-right), not jax.nn's top-left."""
  q, kv = _normal(30, (B, 5, HEADS, 8)), _normal(31, (B, 11, HEADS, 8))
  keep_all = jnp.ones((B, 1, 5, 11), bool)
  for options in (dict(causal=True), dict(causal=True, window_size=(3, None)),
                  dict(window_size=(2, 1))):
    np.testing.assert_allclose(
        jf.make_attention_fn(**options)(q, kv, kv, mask=keep_all),
        jaxflash.attention(q, kv, kv, **options), rtol=2e-6, atol=2e-6, err_msg=str(options))


def test_adapter_refuses_an_unknown_implementation_with_a_mask():
  q = k = v = _normal(5, (B, T, HEADS, 8))
  with pytest.raises(ValueError, match="implementation: expected None, 'cute' or 'reference', "
                                       "got 'cudnn'"):
    jf.make_attention_fn(implementation="cudnn")(q, k, v, mask=jnp.ones((B, 1, T, T), bool))


def test_adapter_mask_with_batch_dims_and_a_head_mask():
  """Two leading batch dims folded, a mask of (batch..., heads, q, kv) with a different
  pattern per head: each folded sequence and head keeps its own keys."""
  q, kv = _normal(40, (2, 3, 4, HEADS, 8)), _normal(41, (2, 3, 6, HEADS, 8))
  mask = jnp.asarray(np.random.default_rng(42).random((2, 3, HEADS, 4, 6)) < 0.6)
  out = jf.make_attention_fn()(q, kv, kv, mask=mask)
  want = nn.dot_product_attention(q, kv, kv, mask=mask)
  np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)


def test_linen_inactive_dropout_is_accepted():
  x = _normal(3, (B, T, D))
  layer = nn.MultiHeadDotProductAttention(num_heads=HEADS, dropout_rate=0.1,
                                          attention_fn=jf.make_attention_fn())
  params = layer.init(jax.random.PRNGKey(0), x, deterministic=True)
  theirs = nn.MultiHeadDotProductAttention(num_heads=HEADS, dropout_rate=0.1)
  np.testing.assert_allclose(layer.apply(params, x, deterministic=True),
                             theirs.apply(params, x, deterministic=True), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------
# make_attention_fn in flax.nnx.MultiHeadAttention

def _nnx_functional(module, **call_kwargs):
  """(params, fn(params, x)) for an nnx module, so it can be differentiated like linen."""
  graphdef, params = nnx.split(module)
  return params, lambda p, x: nnx.merge(graphdef, p)(x, **call_kwargs)


@pytest.mark.skipif("is_causal" not in inspect.signature(nnx.MultiHeadAttention.__call__)
                    .parameters, reason="this Flax's nnx.MultiHeadAttention has no is_causal")
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_nnx_mha_attention_fn(kv_heads):
  x = _normal(4, (B, T, D))
  make = lambda **kw: nnx.MultiHeadAttention(
      num_heads=HEADS, in_features=D, num_kv_heads=kv_heads, decode=False,
      rngs=nnx.Rngs(0), **kw)
  params, theirs = _nnx_functional(make(), is_causal=True)
  _, ours = _nnx_functional(make(attention_fn=jf.make_attention_fn()), is_causal=True)
  assert_matches_flax(ours, theirs, params, x, "nnx")


# --------------------------------------------------------------------------------------------
# What the adapter refuses

def _adapter_call(**kwargs):
  q = k = v = _normal(5, (B, T, HEADS, 8))
  return jf.make_attention_fn()(q, k, v, **kwargs)


@pytest.mark.parametrize("kwargs, match", [
    ({"dropout_rate": 0.1, "deterministic": False}, "dropout"),
    ({"module": object()}, "sow_weights"),
    ({"qk_attn_weights_einsum": jnp.einsum}, "einsum"),
], ids=["dropout", "sow", "einsum"])
def test_adapter_refuses(kwargs, match):
  with pytest.raises(ValueError, match=match):
    _adapter_call(**kwargs)


@pytest.mark.parametrize("option", [dict(softcap=30.0), dict(deterministic=True),
                                    dict(mask_mod=lambda b, h, i, j: j <= i)],
                         ids=["softcap", "deterministic", "mask_mod"])
def test_adapter_refuses_a_dense_mask_with_options_jax_nn_lacks(option):
  q = k = v = _normal(5, (B, T, HEADS, 8))
  with pytest.raises(ValueError, match=f"mask: .*takes no {next(iter(option))}"):
    jf.make_attention_fn(**option)(q, k, v, mask=jnp.ones((B, 1, T, T), bool))


def test_adapter_takes_score_mod_and_mask_mod():
  """make_attention_fn(score_mod=..., mask_mod=...) runs them inside Flax's attention call:
  the same output as jaxflash.attention with them on the folded batch."""
  slopes = jnp.asarray([0.5, 0.25, 0.125, 0.0625][:HEADS], jnp.float32)
  options = dict(score_mod=lambda s, b, h, i, j: s + slopes[h] * (j - i),
                 mask_mod=lambda b, h, i, j: j <= i)
  q = k = v = _normal(8, (B, T, HEADS, 8))
  np.testing.assert_allclose(jf.make_attention_fn(**options)(q, k, v),
                             jaxflash.attention(q, k, v, **options), rtol=1e-6, atol=1e-6)


def test_adapter_refuses_top_left_causal_cross_attention():
  q, kv = _normal(6, (B, 4, HEADS, 8)), _normal(7, (B, 9, HEADS, 8))
  with pytest.raises(ValueError, match="top-left"):
    jf.make_attention_fn()(q, kv, kv, is_causal=True)


def test_adapter_unknown_option():
  with pytest.raises(TypeError, match="q_segment_ids"):
    jf.make_attention_fn(q_segment_ids=jnp.zeros((B, T), jnp.int32))


def test_linen_mha_sow_weights_raises():
  x = _normal(9, (B, T, D))
  layer = nn.MultiHeadDotProductAttention(num_heads=HEADS, attention_fn=jf.make_attention_fn())
  with pytest.raises(ValueError, match="sow_weights"):
    layer.init(jax.random.PRNGKey(0), x, sow_weights=True)


# --------------------------------------------------------------------------------------------
# The blocks

def test_linen_block_equals_flax_mha():
  x = _normal(10, (B, T, D))
  theirs = nn.MultiHeadDotProductAttention(num_heads=HEADS)
  params = theirs.init(jax.random.PRNGKey(1), x)
  block = jf.LinenAttention(num_heads=HEADS, use_bias=True, causal=True)
  assert jax.tree.map(jnp.shape, block.init(jax.random.PRNGKey(0), x)) == jax.tree.map(
      jnp.shape, params)
  assert_matches_flax(lambda p, x: block.apply(p, x),
                      lambda p, x: theirs.apply(p, x, mask=nn.make_causal_mask(x[..., 0])),
                      params, x, "linen block")


@pytest.mark.skipif("is_causal" not in inspect.signature(nnx.MultiHeadAttention.__call__)
                    .parameters, reason="this Flax's nnx.MultiHeadAttention has no is_causal")
def test_nnx_block_equals_flax_mha_gqa():
  x = _normal(11, (B, T, D))
  params, theirs = _nnx_functional(
      nnx.MultiHeadAttention(num_heads=HEADS, in_features=D, num_kv_heads=2, decode=False,
                             rngs=nnx.Rngs(1)), is_causal=True)
  block = jf.NnxAttention(D, HEADS, num_kv_heads=2, use_bias=True, causal=True, rngs=nnx.Rngs(0))
  graphdef, block_params = nnx.split(block)
  assert jax.tree.map(jnp.shape, block_params) == jax.tree.map(jnp.shape, params)
  ours = lambda p, x: nnx.merge(graphdef, p)(x)
  assert_matches_flax(ours, theirs, params, x, "nnx block")


def _rope_by_complex_numbers(x, positions, base):
  """RoPE written independently: pairs (x_i, x_{i+d/2}) rotate as complex numbers."""
  half = x.shape[-1] // 2
  freq = base ** (-np.arange(half) * 2.0 / x.shape[-1])
  z = (x[..., :half] + 1j * x[..., half:]) * jnp.exp(1j * positions[..., None, None] * freq)
  return jnp.concatenate([z.real, z.imag], axis=-1).astype(x.dtype)


def _reference_block(params, x, *, kv_heads, causal, rope_base, segment_ids, positions):
  """Projection einsums, RoPE, repeated kv heads, flax's masked attention, out projection."""
  p = params["params"]
  q, k, v = (jnp.einsum("bsd,dhf->bshf", x, p[n]["kernel"]) for n in ("query", "key", "value"))
  if rope_base is not None:
    q, k = (_rope_by_complex_numbers(t, positions, rope_base) for t in (q, k))
  k, v = (jnp.repeat(t, q.shape[2] // kv_heads, axis=2) for t in (k, v))
  mask = None
  if causal:
    mask = nn.make_causal_mask(x[..., 0])
  if segment_ids is not None:
    mask = nn.combine_masks(mask, nn.make_attention_mask(segment_ids, segment_ids, jnp.equal))
  out = nn.dot_product_attention(q, k, v, mask=mask)
  return jnp.einsum("bshf,hfd->bsd", out, p["out"]["kernel"])


@pytest.mark.parametrize("variant", ["gqa_rope", "mqa_segments", "rope_segments_positions"])
def test_linen_block_rope_gqa_segments(variant):
  x = _normal(12, (B, T, D))
  kv_heads = 1 if variant == "mqa_segments" else 2
  rope_base = None if variant == "mqa_segments" else 500.0
  segment_ids = positions = None
  if "segments" in variant:  # two packed documents per row, split at different places
    segment_ids = jnp.asarray((np.arange(T)[None] >= np.array([[5], [8]])).astype(np.int32))
  if "positions" in variant:  # positions restart in each document
    starts = jnp.where(segment_ids == 1, jnp.array([[5], [8]]), 0)
    positions = jnp.arange(T)[None] - starts
  ref_positions = positions if positions is not None else jnp.broadcast_to(jnp.arange(T), (B, T))
  block = jf.LinenAttention(num_heads=HEADS, num_kv_heads=kv_heads, causal=True,
                            rope_base=rope_base)
  params = block.init(jax.random.PRNGKey(2), x)
  ours = lambda p, x: block.apply(p, x, segment_ids=segment_ids, positions=positions)
  theirs = lambda p, x: _reference_block(p, x, kv_heads=kv_heads, causal=True,
                                         rope_base=rope_base, segment_ids=segment_ids,
                                         positions=ref_positions)
  assert_matches_flax(ours, theirs, params, x, variant)


def test_block_input_errors():
  block = jf.LinenAttention(num_heads=HEADS)
  with pytest.raises(ValueError, match="inputs_q"):
    block.init(jax.random.PRNGKey(0), _normal(13, (T, D)))
  with pytest.raises(ValueError, match="head_dim must be even"):
    jf.LinenAttention(num_heads=HEADS, head_dim=7, rope_base=10.0).init(
        jax.random.PRNGKey(0), _normal(14, (B, T, D)))
  with pytest.raises(ValueError, match="segment_ids"):
    block.init(jax.random.PRNGKey(0), _normal(15, (B, T, D)),
               kv_segment_ids=jnp.zeros((B, T), jnp.int32))


def _sink_reference_block(params, sink, x):
  """The projections, then naive softmax with the sink as an extra value-less column."""
  p = params["params"]
  q, k, v = (jnp.einsum("bsd,dhf->bshf", x, p[n]["kernel"]) for n in ("query", "key", "value"))
  s = jnp.einsum("bqhf,bkhf->bhqk", q, k) * q.shape[-1] ** -0.5
  s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, -jnp.inf)
  s = jnp.concatenate([s, jnp.broadcast_to(sink[None, :, None, None], s.shape[:-1] + (1,))], -1)
  w = jax.nn.softmax(s, axis=-1)[..., :-1]
  out = jnp.einsum("bhqk,bkhf->bqhf", w, v)
  return jnp.einsum("bshf,hfd->bsd", out, p["out"]["kernel"])


def test_linen_block_learnable_sink_parameter():
  x = _normal(16, (B, T, D))
  block = jf.LinenAttention(num_heads=HEADS, causal=True, learnable_sink=True)
  params = block.init(jax.random.PRNGKey(3), x)
  assert params["params"]["sink"].shape == (HEADS,)
  assert np.all(np.asarray(params["params"]["sink"]) == 0)  # zeros by default
  assert "sink" not in jf.LinenAttention(num_heads=HEADS).init(jax.random.PRNGKey(3),
                                                               x)["params"]
  # A non-zero sink, set through the initializer argument, and its gradient.
  init = lambda key, shape, dtype: jnp.linspace(-1.0, 2.0, shape[0], dtype=dtype)
  block = jf.LinenAttention(num_heads=HEADS, causal=True, learnable_sink=True, sink_init=init)
  params = block.init(jax.random.PRNGKey(3), x)
  np.testing.assert_allclose(params["params"]["sink"], init(None, (HEADS,), jnp.float32))
  ours = lambda p, x: block.apply(p, x)
  theirs = lambda p, x: _sink_reference_block(p, p["params"]["sink"], x)
  assert_matches_flax(ours, theirs, params, x, "linen_sink")
  grad = jax.grad(lambda p: jnp.sum(block.apply(p, x) ** 2))(params)["params"]["sink"]
  assert np.all(np.isfinite(np.asarray(grad))) and np.any(np.asarray(grad) != 0)


def test_nnx_block_learnable_sink_parameter():
  x = _normal(17, (B, T, D))
  init = lambda key, shape, dtype: jnp.linspace(-1.0, 2.0, shape[0], dtype=dtype)
  block = jf.NnxAttention(D, HEADS, causal=True, learnable_sink=True, sink_init=init,
                          rngs=nnx.Rngs(0))
  np.testing.assert_allclose(block.sink[...], init(None, (HEADS,), jnp.float32))
  params = {"params": {n: {"kernel": getattr(block, n).kernel[...]}
                       for n in ("query", "key", "value", "out")}}
  np.testing.assert_allclose(block(x), _sink_reference_block(params, block.sink[...], x),
                             rtol=2e-5, atol=2e-6)
  assert jf.NnxAttention(D, HEADS, rngs=nnx.Rngs(0)).sink is None
