"""Learnable attention sinks (`learnable_sink=`) against the float64 oracle with a sink column."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxflash
from jaxflash import reference
from tests._cases import OPTION_SETS, config_for, make_qkv, make_segments, oracle_for, x64
from tests._oracle import assert_close_to_oracle, relative_l2

SHAPES = {  # name -> (seq_q, seq_k, heads, kv_heads, head_dim, head_dim_v)
    "q_shorter": (17, 45, 4, 2, 16, 16),
    "gqa4_q_longer": (45, 17, 4, 1, 16, 8),
    "dv_wider": (33, 40, 6, 3, 8, 24),
}


def _sink(seed, heads, dtype=jnp.float32):
  # Large enough to matter against the scores (|logits| ~ a few units).
  return jnp.asarray(np.random.default_rng(seed).normal(0.5, 2.0, heads), dtype)


def _api(q, k, v, sink, options, segments=(None, None)):
  return jaxflash.attention(q, k, v, q_segment_ids=segments[0], kv_segment_ids=segments[1],
                            learnable_sink=sink, return_lse=True, implementation="reference",
                            **options)


# Every option set, dense and with segment ids, each on a different shape of SHAPES in turn
# (every shape meets every mode): the sink's algebra does not depend on the shape, and the
# reference's shape handling is tested over the whole product in test_reference.py.
_SHAPE_NAMES = list(SHAPES)
_ORACLE_CASES = {
    f"{mode}-{option}-{_SHAPE_NAMES[(i + j) % len(_SHAPE_NAMES)]}":
        (SHAPES[_SHAPE_NAMES[(i + j) % len(_SHAPE_NAMES)]], OPTION_SETS[option], j == 1)
    for i, option in enumerate(OPTION_SETS) for j, mode in enumerate(["dense", "segments"])}


@pytest.mark.parametrize("shape,options,segmented", _ORACLE_CASES.values(),
                         ids=_ORACLE_CASES.keys())
def test_values_lse_and_all_four_gradients_match_float64_oracle(shape, options, segmented):
  seq_q, seq_k, h, h_kv, d, dv = shape
  with x64():
    q, k, v = make_qkv(11, 2, seq_q, seq_k, h, h_kv, d, dv, dtype=jnp.float64)
    sink = _sink(3, h, jnp.float64)
    segs = make_segments(12, 2, seq_q, seq_k) if segmented else (None, None)
    want_out, want_lse = oracle_for(q, k, v, options, segs, learnable_sink=sink)
    out, lse = _api(q, k, v, sink, options, segs)
    np.testing.assert_allclose(out, want_out, rtol=1e-10, atol=1e-12)
    # With a finite sink every row has a finite lse (rows that see no key: the sink).
    assert np.isfinite(np.asarray(lse)).all()
    np.testing.assert_allclose(lse, want_lse, rtol=1e-10)

    rng = np.random.default_rng(13)
    w_out = jnp.asarray(rng.standard_normal(out.shape))
    w_lse = jnp.asarray(rng.standard_normal(lse.shape))

    def loss(fn):
      def f(q, k, v, sink):
        o, l = fn(q, k, v, sink)
        return jnp.sum(o * w_out) + jnp.sum(l * w_lse)
      return f

    api = lambda q, k, v, s: _api(q, k, v, s, options, segs)
    want_fn = lambda q, k, v, s: oracle_for(q, k, v, options, segs, learnable_sink=s)
    got = jax.jit(jax.grad(loss(api), argnums=(0, 1, 2, 3)))(q, k, v, sink)
    want = jax.grad(loss(want_fn), argnums=(0, 1, 2, 3))(q, k, v, sink)
    for name, g, w in zip(("dq", "dk", "dv", "dsink"), got, want):
      assert not np.isnan(np.asarray(g)).any(), f"{name} has NaN"
      np.testing.assert_allclose(g, w, rtol=1e-8, atol=1e-10, err_msg=name)


def test_sink_gradient_is_the_documented_formula():
  # d sink[h] = -sum over batch and rows of exp(sink[h] - lse) * rowsum(dO * O) (loss on out).
  with x64():
    q, k, v = make_qkv(14, 2, 20, 24, 4, 2, 8, 8, dtype=jnp.float64)
    sink = _sink(15, 4, jnp.float64)
    d_out = jnp.asarray(np.random.default_rng(16).standard_normal((2, 20, 4, 8)))
    out, lse = _api(q, k, v, sink, {"causal": True})
    got = jax.grad(lambda s: jnp.sum(_api(q, k, v, s, {"causal": True})[0] * d_out))(sink)
    row = jnp.einsum("bqhd,bqhd->bhq", d_out, out)
    want = -jnp.sum(jnp.exp(sink[None, :, None] - lse) * row, axis=(0, 2))
    np.testing.assert_allclose(got, want, rtol=1e-10)


@pytest.mark.parametrize("mapped", ["sink", "inputs", "both"])
def test_vmap_over_sinks_and_inputs_matches_a_loop(mapped):
  """The forward primitive keeps the sink out of its batch fold; a mapped sink (one per vmapped
  element) runs the call without it and rescales in XLA."""
  n = 3
  q, k, v = make_qkv(31, 2, 20, 24, 4, 2, 8, 8, dtype=jnp.float32)
  qs = jnp.stack([q * (i + 1) for i in range(n)])
  sinks = jnp.stack([_sink(32 + i, 4, jnp.float32) for i in range(n)])
  attend = lambda q, s: jaxflash.attention(q, k, v, learnable_sink=s, causal=True,
                                           return_lse=True, implementation="reference")
  in_axes = {"sink": (None, 0), "inputs": (0, None), "both": (0, 0)}[mapped]
  q_arg = q if in_axes[0] is None else qs
  sink_arg = sinks[0] if in_axes[1] is None else sinks
  got = jax.jit(jax.vmap(attend, in_axes=in_axes))(q_arg, sink_arg)
  for i in range(n):
    want = attend(q_arg if in_axes[0] is None else qs[i],
                  sink_arg if in_axes[1] is None else sinks[i])
    for g, w in zip(got, want):
      np.testing.assert_allclose(g[i], w, rtol=1e-6, atol=1e-6)


def test_sink_gradient_helper_is_the_autodiff_gradient():
  """sink.learnable_sink_grad (the custom VJP's d sink) against autodiff of the reference
  rescale, with an lse cotangent and rows that see no key."""
  from jaxflash.sink import add_learnable_sink, learnable_sink_grad
  with x64():
    rng = np.random.default_rng(33)
    out = jnp.asarray(rng.standard_normal((2, 6, 3, 4)))
    lse = jnp.asarray(rng.standard_normal((2, 3, 6))).at[0, 1, 2].set(-np.inf)
    sink = jnp.asarray([0.5, -1.0, 2.0])
    d_out = jnp.asarray(rng.standard_normal((2, 6, 3, 4)))
    d_lse = jnp.asarray(rng.standard_normal((2, 3, 6)))
    # out and lse of the call with the sink, as the kernel returns them
    out_s, lse_s = add_learnable_sink(out, lse, sink)
    # autodiff through the rescale from the sink-free (out, lse), which stay fixed
    _, vjp = jax.vjp(lambda s: add_learnable_sink(out, lse, s), sink)
    want = vjp((d_out, d_lse))[0]
    got = learnable_sink_grad(out_s, lse_s, d_out, d_lse, sink)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


def test_rows_that_see_no_key_output_zeros_with_lse_equal_to_the_sink():
  # seq_q > seq_k, causal: the first 8 rows see no key; segment 9 has no key at all.
  q, k, v = make_qkv(17, 2, 20, 12, 4, 2, 8, 8)
  sink = _sink(18, 4)
  q_seg = jnp.zeros((2, 20), jnp.int32).at[:, -3:].set(9)
  kv_seg = jnp.zeros((2, 12), jnp.int32)
  f = lambda q, k, v, s: jaxflash.attention(q, k, v, causal=True, q_segment_ids=q_seg,
                                            kv_segment_ids=kv_seg, learnable_sink=s,
                                            return_lse=True, implementation="reference")
  out, lse = f(q, k, v, sink)
  empty = np.zeros((2, 20), bool)
  empty[:, :8] = True
  empty[:, -3:] = True
  assert np.all(np.asarray(out)[empty] == 0)
  lse_rows = np.asarray(lse).transpose(0, 2, 1)  # (b, q, h)
  np.testing.assert_array_equal(lse_rows[empty], np.broadcast_to(sink, lse_rows[empty].shape))
  grads = jax.grad(lambda *a: jnp.sum(f(*a)[0] ** 2) + jnp.sum(f(*a)[1]),
                   argnums=(0, 1, 2, 3))(q, k, v, sink)
  for g in grads:
    assert np.all(np.isfinite(np.asarray(g)))
  assert np.all(np.asarray(grads[0])[empty] == 0)


def test_a_sink_of_minus_infinity_is_no_sink_even_on_empty_rows():
  q, k, v = make_qkv(19, 1, 10, 6, 2, 1, 8, 8)
  sink = jnp.full((2,), -jnp.inf, jnp.float32)
  out, lse = jaxflash.attention(q, k, v, causal=True, learnable_sink=sink, return_lse=True,
                                implementation="reference")
  want_out, want_lse = jaxflash.attention(q, k, v, causal=True, return_lse=True,
                                          implementation="reference")
  np.testing.assert_array_equal(out, want_out)
  np.testing.assert_array_equal(lse, want_lse)  # -inf on the 4 empty rows, no NaN


def test_check_grads_numerically_with_sink():
  with x64():
    q, k, v = make_qkv(20, 1, 9, 11, 2, 1, 4, 4, dtype=jnp.float64)
    sink = _sink(21, 2, jnp.float64)
    f = lambda q, k, v, s: jaxflash.attention(q, k, v, causal=True, window_size=(5, 2),
                                              learnable_sink=s, implementation="reference")
    check_grads(f, (q, k, v, sink), order=1, modes=("rev",), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["fp16", "bf16"])
def test_half_precision_with_sink_within_naive_error(dtype):
  q, k, v = make_qkv(22, 2, 64, 80, 4, 2, 32, 32, dtype=dtype)
  sink = _sink(23, 4)
  options = {"causal": True}
  with x64():
    q64, k64, v64 = (x.astype(jnp.float64) for x in (q, k, v))
    want, want_lse = oracle_for(q64, k64, v64, options,
                                learnable_sink=sink.astype(jnp.float64))
  naive, naive_lse = reference.naive_attention(q, k, v, config_for(32, options),
                                               compute_dtype=dtype, learnable_sink=sink)
  out, lse = _api(q, k, v, sink, options)
  assert out.dtype == dtype and lse.dtype == jnp.float32
  assert_close_to_oracle(out, want, naive, name="out")
  assert_close_to_oracle(lse, want_lse, naive_lse, name="lse")
  # The sink matters at this size: leaving it out is far outside the tolerance.
  plain = jaxflash.attention(q, k, v, implementation="reference", **options)
  assert relative_l2(plain, want) > 2 * relative_l2(naive, want) + 1e-5


def test_no_query_or_key_at_all():
  q, k, v = make_qkv(24, 1, 3, 0, 2, 1, 8, 8)
  sink = _sink(25, 2)
  out, lse = jaxflash.attention(q, k, v, learnable_sink=sink, return_lse=True)
  assert np.all(np.asarray(out) == 0)
  np.testing.assert_array_equal(lse, np.broadcast_to(sink[None, :, None], (1, 2, 3)))


@pytest.mark.parametrize("sink,error,match", [
    (np.zeros(3, np.float32), ValueError, r"learnable_sink: expected shape \(num_heads,\) = "
                                          r"\(4,\), got \(3,\)"),
    (np.zeros((4, 1), np.float32), ValueError, r"got \(4, 1\)"),
    (np.zeros(4, np.float16), TypeError, "learnable_sink: expected dtype float32, got float16"),
    ([0.0] * 4, TypeError, "learnable_sink: expected a float32 array"),
])
def test_bad_sink_is_refused_with_a_named_error(sink, error, match):
  q, k, v = make_qkv(26, 1, 5, 5, 4, 2, 8, 8)
  with pytest.raises(error, match=match):
    jaxflash.attention(q, k, v, learnable_sink=sink)
