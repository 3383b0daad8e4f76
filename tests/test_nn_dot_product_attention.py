"""jaxflash.nn.dot_product_attention against jax.nn.dot_product_attention.

The first part ports the cases of JAX's own tests (tests/nn_test.py, testDotProductAttention*)
onto the jaxflash function. The second compares with jax.nn's XLA path over a grid of options
(T != S, windows, lengths, GQA), outputs, residuals and gradients, by the float64-oracle rule.
"""

from __future__ import annotations

import functools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from jaxflash.nn import dot_product_attention
from tests._cases import x64
from tests._oracle import assert_close_to_oracle

jax_nn_xla = functools.partial(jax.nn.dot_product_attention, implementation="xla")


def _normal(seed, shape, dtype):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def _vjp_all(fn, args, cotangent):
  """(outputs, gradients of args) of fn at args for one cotangent.

  Eager on purpose: jax.nn falls back from the F16_F16_F32 dot algorithm, which CPU lacks,
  only outside jit.
  """
  out, vjp = jax.vjp(fn, *args)
  return out, vjp(cotangent)


def _upcast(tree):
  return jax.tree.map(lambda x: x.astype(jnp.float64) if jnp.issubdtype(x.dtype, jnp.floating)
                      else x, tree)


def _assert_matches_jax_nn(ours, jax_nn, args, cotangent, name, residual=False):
  """ours(*args) against jax_nn(*args): float64 oracle, naive = jax_nn in the input dtype.

  The output and every gradient go through assert_close_to_oracle. With residual=True both
  functions return (out, residual); the residual is checked by _assert_residual_matches.
  """
  if residual:  # the residual has no gradient: a zero cotangent for it
    cotangent = (cotangent, jnp.zeros(cotangent.shape[:-1], cotangent.dtype))
  out, grads = _vjp_all(ours, args, cotangent)
  naive_out, naive_grads = _vjp_all(jax_nn, args, cotangent)
  with x64():
    oracle_out, oracle_grads = _vjp_all(jax_nn, _upcast(args), _upcast(cotangent))
    oracle_out, oracle_grads = jax.device_get((oracle_out, oracle_grads))
  if residual:
    _assert_residual_matches(out[1], oracle_out[1], naive_out[1], name)
    out, naive_out, oracle_out = out[0], naive_out[0], oracle_out[0]
  names = ["out"] + [f"d_arg{i}" for i in range(len(args))]
  for what, a, e, n in zip(names, (out,) + tuple(grads), (oracle_out,) + tuple(oracle_grads),
                           (naive_out,) + tuple(naive_grads)):
    assert a.dtype == n.dtype, f"{name} {what}: dtype {a.dtype} != jax.nn's {n.dtype}"
    assert_close_to_oracle(a, e, n, name=f"{name} {what}")


def _assert_residual_matches(ours, oracle64, naive, name):
  """Residuals: rows jax.nn masks entirely hold a huge negative (or -inf in float16) logit
  sum that must equal jax.nn's bitwise; the other rows follow the oracle rule."""
  ours, naive = np.asarray(ours.astype(jnp.float32)), np.asarray(naive.astype(jnp.float32))
  masked = np.abs(np.asarray(oracle64)) > 1e30
  np.testing.assert_array_equal(ours[masked], naive[masked], err_msg=f"{name} masked rows")
  assert_close_to_oracle(ours[~masked], np.asarray(oracle64)[~masked], naive[~masked],
                         name=f"{name} residual")


# --------------------------------------------------------------------------------------------
# Port of JAX's testDotProductAttention* (same cases; impl 'cudnn' maps to jaxflash's kernels).

# On a CPU implementation None and "xla" both run jaxflash's reference: the grid takes None,
# test_xla_implementation_is_the_reference checks "xla" against it.
_CPU_IMPLS = [None]
_GPU_IMPL = pytest.param("cudnn", marks=pytest.mark.gpu, id="cudnn")


def test_xla_implementation_is_the_reference():
  """implementation="xla" runs jaxflash's pure-JAX reference: on a CPU the same results as the
  automatic choice, bitwise, forward and gradients."""
  q, k, v = (_normal(i, (2, 24, 4, 16), jnp.bfloat16) for i in range(3))
  k, v = k[:, :, :2], v[:, :, :2]
  grad = _normal(3, (2, 24, 4, 16), jnp.bfloat16)
  results = [_vjp_all(functools.partial(dot_product_attention, is_causal=True,
                                        implementation=impl), (q, k, v), grad)
             for impl in (None, "xla")]
  for a, b in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1])):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("impl", _CPU_IMPLS + [_GPU_IMPL])
@pytest.mark.parametrize("use_vmap", [False, True], ids=["batched", "vmap"])
@pytest.mark.parametrize("group_num", [1, 2, 4], ids=lambda g: f"groups{g}")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
def test_dot_product_attention(dtype, group_num, use_vmap, impl):
  # JAX uses H=32; jaxflash's kernels start at 64, so the GPU case runs with 64.
  B, S, T, N, H, G = 2, 128, 128, 4, (64 if impl == "cudnn" else 32), group_num
  q = _normal(0, (B, T, N, H), dtype)
  k = _normal(1, (B, S, N // G, H), dtype)
  v = _normal(2, (B, S, N // G, H), dtype)
  grad = _normal(3, (B, T, N, H), dtype)
  lse_grad = _normal(4, (B, T, N), dtype)

  ours = functools.partial(dot_product_attention, implementation=impl, return_residual=True)
  if use_vmap:
    ours = jax.vmap(ours)
  jax_nn_lse = functools.partial(jax_nn_xla, return_residual=True)
  _assert_matches_jax_nn(ours, jax_nn_lse, (q, k, v), grad, "out", residual=True)
  out, lse = ours(q, k, v)
  assert out.shape == (B, T, N, H) and lse.shape == (B, T, N) and lse.dtype == dtype

  # The residual carries no gradient, as in jax.nn: its cotangent changes nothing.
  _, grads = _vjp_all(ours, (q, k, v), (grad, lse_grad))
  _, grads_without = _vjp_all(ours, (q, k, v), (grad, jnp.zeros_like(lse_grad)))
  for a, b in zip(grads, grads_without):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


_MASK_MODES = ["bias", "causal", "padding", "custom", ("causal", "padding"), ("custom", "padding"),
               ("bias", "causal"), ("causal", "sliding_window")]


@pytest.mark.parametrize("mask_mode", _MASK_MODES,
                         ids=lambda m: m if isinstance(m, str) else "+".join(m))
def test_dot_product_attention_mask(mask_mode):
  mask_mode = (mask_mode,) if isinstance(mask_mode, str) else mask_mode
  dtype = jnp.bfloat16
  B, S, T, N, H = 2, 128, 128, 4, 32
  q, k, v = (_normal(i, shape, dtype) for i, shape in
             enumerate([(B, T, N, H), (B, S, N, H), (B, S, N, H)]))
  grad = _normal(3, (B, T, N, H), dtype)
  bias = mask = q_seqlen = kv_seqlen = window = None
  is_causal = "causal" in mask_mode
  if "padding" in mask_mode:
    q_seqlen = jnp.array([T // 2, T // 4], jnp.int32)
    kv_seqlen = jnp.array([S // 4, S // 2], jnp.int32)
  if "custom" in mask_mode:
    mask = jnp.tril(jnp.ones((T, S), jnp.bool_))[None, None]
  if "bias" in mask_mode:
    bias = _normal(4, (1, N, T, S), dtype)
  if "sliding_window" in mask_mode:
    window = (3, 2) if is_causal else (3, 0)

  def make(sdpa):
    def call(q, k, v, *maybe_bias):  # the bias is differentiated when there is one
      return sdpa(q, k, v, maybe_bias[0] if maybe_bias else None, mask, is_causal=is_causal,
                  query_seq_lengths=q_seqlen, key_value_seq_lengths=kv_seqlen,
                  local_window_size=window)
    return call

  args = (q, k, v) + (() if bias is None else (bias,))
  _assert_matches_jax_nn(make(dot_product_attention), make(jax_nn_xla), args, grad,
                         "+".join(mask_mode))


def test_dot_product_attention_float64_mask_debug_infs():
  # JAX regression test for jax-ml/jax#37422: a float64 masked call raises no inf warning.
  with x64():
    T, S, K, N, H = 5, 7, 3, 6, 11
    mask = jnp.arange(S) <= S // 2
    with warnings.catch_warnings():
      warnings.simplefilter("error")
      with jax.debug_infs(True):
        out = dot_product_attention(jnp.zeros((T, N, H), jnp.float64),
                                    jnp.zeros((S, K, H), jnp.float64),
                                    jnp.zeros((S, K, H), jnp.float64), mask=mask)
        out.block_until_ready()
    assert out.shape == (T, N, H) and out.dtype == jnp.float64


@pytest.mark.parametrize("use_vmap", [False, True], ids=["batched", "vmap"])
@pytest.mark.parametrize("batch_size", [1, 16], ids=lambda b: f"batch{b}")
def test_dot_product_attention_bias_gradient(batch_size, use_vmap):
  dtype = jnp.bfloat16
  B, S, N, H = batch_size, 128, 4, 32
  x = _normal(0, (B, S, N, H), dtype)
  bias = _normal(1, (B, N, S, S), dtype)
  mask = jnp.ones((1, 1, S), jnp.bool_)

  def attention(sdpa, x, bias):
    return sdpa(query=x, key=x, value=x, bias=bias, mask=mask, is_causal=False)

  ours, ref = (functools.partial(attention, f) for f in (dot_product_attention, jax_nn_xla))
  if use_vmap:
    ours, ref = jax.vmap(ours), jax.vmap(ref)
  _assert_matches_jax_nn(jax.jit(ours), jax.jit(ref), (x, bias), x, "bias")


# --------------------------------------------------------------------------------------------
# Grid: jaxflash's mapping of jax.nn's masks, outputs, residuals and gradients.

_OPTIONS = {
    "plain": {},
    "causal": {"is_causal": True},
    "window_3_2": {"local_window_size": (3, 2)},
    "window_int_2": {"local_window_size": 2},
    "window_left_only": {"local_window_size": (4, 0)},
    "window_shifted": {"local_window_size": (-2, 5)},
    "window_empty_band": {"local_window_size": (2, -3)},
    "causal_window": {"is_causal": True, "local_window_size": (4, 1)},
    "scale": {"scale": 0.3},
    "q_lengths": {"query_seq_lengths": [5, 11]},
    "kv_lengths": {"key_value_seq_lengths": [0, 9]},
    "lengths_causal": {"is_causal": True, "query_seq_lengths": [11, 3],
                       "key_value_seq_lengths": [7, 16]},
    "lengths_window": {"local_window_size": (2, 2), "query_seq_lengths": [11, 0],
                       "key_value_seq_lengths": [6, 1]},
}
# T == S is the ported tests' shape; these are the two sides of T != S.
_SHAPES = {"t8_s16": (8, 16), "t16_s6": (16, 6)}


def _options(name, seq_q, seq_k):
  """The option set with lengths clipped to the sequence lengths, as int32 arrays."""
  out = dict(_OPTIONS[name])
  for key, seq in (("query_seq_lengths", seq_q), ("key_value_seq_lengths", seq_k)):
    if key in out:
      out[key] = jnp.minimum(jnp.asarray(out[key], jnp.int32), seq)
  return out


def _check_grid_case(option, seq_q, seq_k, num_heads, kv_heads):
  q = _normal(10, (2, seq_q, num_heads, 16), jnp.float32)
  k = _normal(11, (2, seq_k, kv_heads, 16), jnp.float32)
  v = _normal(12, (2, seq_k, kv_heads, 16), jnp.float32)
  grad = _normal(13, (2, seq_q, num_heads, 16), jnp.float32)
  kw = dict(_options(option, seq_q, seq_k), return_residual=True)
  _assert_matches_jax_nn(functools.partial(dot_product_attention, **kw),
                         functools.partial(jax_nn_xla, **kw), (q, k, v), grad, option,
                         residual=True)


@pytest.mark.parametrize("shape", list(_SHAPES), ids=str)
@pytest.mark.parametrize("option", list(_OPTIONS), ids=str)
def test_matches_jax_nn(option, shape):
  _check_grid_case(option, *_SHAPES[shape], num_heads=4, kv_heads=2)


@pytest.mark.parametrize("heads", [(4, 4), (4, 1)], ids=["mha", "mqa"])
@pytest.mark.parametrize("option", ["causal", "lengths_window"], ids=str)
def test_matches_jax_nn_head_layouts(option, heads):
  _check_grid_case(option, 16, 6, *heads)


def _random_mask(seed, shape, keep=0.3):
  """A boolean mask keeping about `keep` of the pairs, so that some rows keep no key."""
  return jnp.asarray(np.random.default_rng(seed).random(shape) < keep)


def _half_inputs(dtype):
  """q (2, 16, 4, 32), k and v (2, 24, 2, 32) in dtype."""
  return tuple(_normal(20 + i, (2, s, h, 32), dtype)
               for i, (s, h) in enumerate([(16, 4), (24, 2), (24, 2)]))


@pytest.mark.parametrize("option", ["causal", "lengths_window", "window_shifted"], ids=str)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
def test_matches_jax_nn_half_precision(dtype, option):
  q, k, v = _half_inputs(dtype)
  grad = _normal(23, q.shape, dtype)
  seq_q, seq_k = q.shape[1], k.shape[1]
  kw = _options(option, seq_q, seq_k)
  _assert_matches_jax_nn(functools.partial(dot_product_attention, **kw),
                         functools.partial(jax_nn_xla, **kw), (q, k, v), grad, option)


# Boolean masks of float16 / bfloat16 inputs run in jaxflash as mask_mods (rows that keep no
# key get jax.nn's average of all values): name -> (mask shape, the other options, dtype).
_MASKS = {
    "full": ((2, 4, 16, 24), "plain", jnp.bfloat16),
    "rank2_causal": ((16, 24), "causal", jnp.float16),
    "heads_lengths": ((1, 4, 16, 24), "lengths_causal", jnp.bfloat16),
    "rows_kv_lengths": ((2, 1, 16, 1), "kv_lengths", jnp.float16),
    "keys_window": ((2, 1, 1, 24), "window_3_2", jnp.bfloat16),
}


@pytest.mark.parametrize("name", list(_MASKS), ids=str)
def test_boolean_mask_matches_jax_nn(name):
  shape, others, dtype = _MASKS[name]
  q, k, v = _half_inputs(dtype)
  grad = _normal(23, q.shape, dtype)
  seq_q, seq_k = q.shape[1], k.shape[1]
  kw = dict(_options(others, seq_q, seq_k), mask=_random_mask(24, shape), return_residual=True)
  _assert_matches_jax_nn(functools.partial(dot_product_attention, **kw),
                         functools.partial(jax_nn_xla, **kw), (q, k, v), grad, name,
                         residual=True)


def test_a_boolean_mask_runs_in_the_kernels_as_a_mask_mod():
  """implementation="cudnn" on a CPU host lowers for CUDA: a boolean mask is an operand of the
  mods variant's forward and backward custom calls (i1), and masks of one rank and one
  pattern of broadcast dims share that variant whatever their sequence lengths."""
  from jaxflash.config import BWD_TARGET, FWD_TARGET
  def lowered(seq, mask_shape):
    q, k, v = (_normal(i, (2, seq, 4, 64), jnp.bfloat16) for i in range(3))
    mask = _random_mask(1, mask_shape(seq), keep=0.5)
    loss = lambda q, k, v: jnp.sum(dot_product_attention(q, k, v, mask=mask,
                                                         implementation="cudnn"))
    return jax.jit(jax.grad(loss, (0, 1, 2))).trace(q, k, v).lower(
        lowering_platforms=("cuda",)).as_text()
  keys = []
  for seq in (96, 200):
    text = lowered(seq, lambda s: (2, 1, s, s))
    calls = [line for line in text.splitlines() if f"@{FWD_TARGET}(" in line
             or f"@{BWD_TARGET}(" in line]
    assert len(calls) == 2, calls
    assert all(f"tensor<2x1x{seq}x{seq}xi1>" in c for c in calls), calls
    keys.append(sorted(set(re.findall(r"(?:fwd|bwd)-sm90a-[\w-]*-mods\w+", text))))
  assert len(keys[0]) == 2 and keys[0] == keys[1], keys
  other = lowered(96, lambda s: (1, 4, s, s))  # another pattern of broadcast dims
  assert keys[0][0] not in other


def test_the_mask_mod_runs_on_the_float64_reference():
  """The mask's mask_mod on the blocked reference with x64 on (the oracle of the GPU tests,
  whose key indices are int64 there) equals jax.nn with the same mask."""
  from jaxflash.nn import _mask_mod
  with x64():
    q, k, v = (_normal(80 + i, (2, s, 2, 16), jnp.float64) for i, s in enumerate((5, 9, 9)))
    mask = _random_mask(83, (2, 1, 5, 9), keep=0.6)
    out = jaxflash.attention(q, k, v, mask_mod=_mask_mod(mask), implementation="reference")
    want = jax_nn_xla(q, k, v, mask=mask)
    rows = np.asarray(jnp.any(mask, axis=-1))[:, 0]  # rows with a key (jax.nn fills the rest)
    np.testing.assert_allclose(np.asarray(out)[rows], np.asarray(want)[rows], rtol=1e-5,
                               atol=1e-6)


_GPU_MASK_SHAPE = (2, 300, 520, 8, 1)  # tests/test_gpu_mods.py's bool_mask case runs its variant


@pytest.mark.gpu
def test_boolean_mask_on_the_kernels_matches_jax_nn():
  """A boolean mask (batch, 1, T, S) with rows that keep no key, GQA 8:1, lengths that straddle
  tiles, on the mods kernels (implementation="cudnn"): out, residual and gradients against
  jax.nn's float64 oracle."""
  b, seq_q, seq_k, heads, kv_heads = _GPU_MASK_SHAPE
  q = _normal(70, (b, seq_q, heads, 128), jnp.bfloat16)
  k, v = (_normal(71 + i, (b, seq_k, kv_heads, 128), jnp.bfloat16) for i in range(2))
  grad = _normal(73, q.shape, jnp.bfloat16)
  mask = _random_mask(74, (b, 1, seq_q, seq_k), keep=0.02)
  kw = dict(mask=mask, return_residual=True)
  ours = jax.jit(functools.partial(dot_product_attention, implementation="cudnn", **kw))
  assert "-mods" in ours.lower(q, k, v).as_text()
  _assert_matches_jax_nn(ours, functools.partial(jax_nn_xla, **kw), (q, k, v), grad,
                         "bool_mask", residual=True)


def test_rank3_inputs_and_residual_shape():
  q, k, v = (_normal(30 + i, (s, 4, 16), jnp.float32) for i, s in enumerate([9, 13, 13]))
  out, res = dot_product_attention(q, k, v, is_causal=True, return_residual=True)
  ref_out, ref_res = jax_nn_xla(q, k, v, is_causal=True, return_residual=True)
  assert out.shape == (9, 4, 16) and res.shape == (9, 4)
  with x64():
    oracle_out, oracle_res = jax_nn_xla(*_upcast((q, k, v)), is_causal=True,
                                        return_residual=True)
  assert_close_to_oracle(out, oracle_out, ref_out)
  assert_close_to_oracle(res, oracle_res, ref_res, name="residual")


def test_under_jit_with_traced_lengths():
  q, k, v = (_normal(40 + i, (2, 10, 2, 16), jnp.float32) for i in range(3))
  lengths = jnp.array([4, 10], jnp.int32)
  fn = jax.jit(lambda q, k, v, n: dot_product_attention(q, k, v, query_seq_lengths=n,
                                                        key_value_seq_lengths=n))
  with x64():
    oracle = jax_nn_xla(*_upcast((q, k, v)), query_seq_lengths=lengths,
                        key_value_seq_lengths=lengths)
  naive = jax_nn_xla(q, k, v, query_seq_lengths=lengths, key_value_seq_lengths=lengths)
  assert_close_to_oracle(fn(q, k, v, lengths), oracle, naive)


def test_traced_scale_runs_jax_nn():
  q, k, v = (_normal(50 + i, (1, 8, 2, 16), jnp.float32) for i in range(3))
  fn = jax.jit(lambda s: dot_product_attention(q, k, v, scale=s))
  np.testing.assert_array_equal(fn(0.5), jax.jit(lambda s: jax_nn_xla(q, k, v, scale=s))(0.5))


@pytest.mark.parametrize("scale", [0.0, -0.5])
def test_non_positive_scale_runs_jax_nn(scale):
  q, k, v = (_normal(60 + i, (1, 8, 2, 16), jnp.float32) for i in range(3))
  np.testing.assert_array_equal(dot_product_attention(q, k, v, scale=scale, is_causal=True),
                                jax_nn_xla(q, k, v, scale=scale, is_causal=True))


# --------------------------------------------------------------------------------------------
# Errors.

def _qkv(shape_q=(1, 8, 2, 16), shape_k=(1, 8, 2, 16), dtype=jnp.float32):
  return _normal(0, shape_q, dtype), _normal(1, shape_k, dtype), _normal(2, shape_k, dtype)


@pytest.mark.parametrize("kwargs, match", [
    ({"implementation": "pallas"}, "implementation"),
    ({"local_window_size": (1, 2, 3)}, "local_window_size"),
    ({"local_window_size": 1.5}, "local_window_size"),
    ({"query_seq_lengths": jnp.array([3], jnp.int64 if jax.config.jax_enable_x64
                                     else jnp.float32)}, "query_seq_lengths"),
    ({"key_value_seq_lengths": jnp.array([3, 4], jnp.int32)}, "key_value_seq_lengths"),
], ids=["implementation", "window_len3", "window_float", "lengths_dtype", "lengths_shape"])
def test_bad_arguments(kwargs, match):
  with pytest.raises(ValueError, match=match):
    dot_product_attention(*_qkv(), **kwargs)


@pytest.mark.parametrize("shapes, match", [
    (((8, 2, 16), (1, 8, 2, 16)), "key"),
    (((1, 8, 3, 16), (1, 8, 2, 16)), "multiple"),
    (((1, 8, 2, 32), (1, 8, 2, 16)), "head_dim"),
    (((2, 8, 2, 16), (1, 8, 2, 16)), "batch"),
    (((8, 16), (8, 16)), "rank"),
], ids=["rank_mismatch", "heads", "head_dim", "batch", "rank2"])
def test_bad_shapes(shapes, match):
  with pytest.raises(ValueError, match=match):
    dot_product_attention(*_qkv(*shapes))


def test_value_shape_and_dtype_mismatch():
  q, k, _ = _qkv()
  with pytest.raises(ValueError, match="value"):
    dot_product_attention(q, k, _normal(3, (1, 8, 2, 8), jnp.float32))
  with pytest.raises(ValueError, match="dtypes"):
    dot_product_attention(q, k, k.astype(jnp.bfloat16))


@pytest.mark.parametrize("kwargs", [{"bias": jnp.zeros((1, 2, 8, 8), jnp.int32)},
                                    {"bias": jnp.zeros((1, 2, 3, 8))},
                                    {"mask": jnp.ones((1, 1, 8, 8), jnp.int32)},
                                    {"mask": jnp.ones((1, 1, 3, 8), bool)},
                                    {"mask": jnp.ones((1, 1, 8, 8), bool),
                                     "bias": jnp.zeros((1, 2, 8, 8))}],
                         ids=["bias_int", "bias_rows", "mask_int", "mask_rows",
                              "mask_with_bias"])
def test_cudnn_refuses_dense_masks(kwargs):
  with pytest.raises(ValueError, match="implementation=None/'xla'"):
    dot_product_attention(*_qkv(dtype=jnp.bfloat16), implementation="cudnn", **kwargs)


def test_float_bias_runs_in_jaxflash_with_its_gradient():
  """A float bias (rank 3 here: (N, T, S), padded to 4 in front) is an operand of jaxflash's
  attention primitive, not jax.nn's materialised path; out and d bias match jax.nn's."""
  from jaxflash import primitives
  q, k, v = _qkv()
  bias = _normal(5, (q.shape[2], q.shape[1], k.shape[1]), jnp.float32)
  loss = lambda sdpa: lambda q, b: jnp.sum(sdpa(q, k, v, b, is_causal=True) ** 2)
  text = str(jax.make_jaxpr(jax.grad(loss(dot_product_attention), argnums=1))(q, bias))
  assert f"{primitives.flash_fwd_p.name}[" in text and "bias_dims" in text
  ours = jax.value_and_grad(loss(dot_product_attention), argnums=(0, 1))(q, bias)
  want = jax.value_and_grad(loss(jax.nn.dot_product_attention), argnums=(0, 1))(q, bias)
  np.testing.assert_allclose(ours[0], want[0], rtol=1e-5)
  for got, w in zip(ours[1], want[1]):
    np.testing.assert_allclose(got, w, rtol=2e-4, atol=2e-5)


def test_exported_as_jaxflash_dot_product_attention():
  # jax.nn users switch by changing the import: jaxflash.dot_product_attention is this one.
  assert jaxflash.dot_product_attention is dot_product_attention
