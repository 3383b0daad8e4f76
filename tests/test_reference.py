"""The pure-JAX path (blocked forward, explicit backward) against the naive float64 oracle."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax.test_util import check_grads

import jaxflash
from jaxflash import reference
from jaxflash.config import AttentionConfig
from tests._cases import OPTION_SETS, config_for, make_qkv, make_segments, oracle_for, x64
from tests._oracle import assert_close_to_oracle, relative_l2

SHAPES = {  # name -> (seq_q, seq_k, heads, kv_heads, head_dim, head_dim_v)
    "self": (45, 45, 4, 4, 16, 16),
    "q_shorter": (17, 45, 4, 2, 16, 16),
    "q_longer": (45, 17, 4, 1, 16, 8),
    "dv_wider": (33, 40, 6, 3, 8, 24),
    "one_token": (1, 1, 2, 1, 8, 8),
}


# Every shape with every option set without segment ids; with them, every option set on two
# of the shapes in turn (segment ids change which keys a row sees, not how shapes are handled).
_SHAPE_NAMES = list(SHAPES)
_FORWARD_CASES = {
    **{f"dense-{option}-{name}": (SHAPES[name], OPTION_SETS[option], False)
       for option in OPTION_SETS for name in SHAPES},
    **{f"segments-{option}-{_SHAPE_NAMES[(i + j) % len(SHAPES)]}":
           (SHAPES[_SHAPE_NAMES[(i + j) % len(SHAPES)]], OPTION_SETS[option], True)
       for i, option in enumerate(OPTION_SETS) for j in (0, 2)},
}


@pytest.mark.parametrize("shape,options,segmented", _FORWARD_CASES.values(),
                         ids=_FORWARD_CASES.keys())
def test_forward_matches_float64_oracle(shape, options, segmented):
  seq_q, seq_k, h, h_kv, d, dv = shape
  with x64():
    q, k, v = make_qkv(1, 2, seq_q, seq_k, h, h_kv, d, dv, dtype=jnp.float64)
    segs = make_segments(2, 2, seq_q, seq_k) if segmented else (None, None)
    cfg = config_for(d, options, segmented)
    want_out, want_lse = oracle_for(q, k, v, options, segs)
    # block_k=8 forces several key blocks and a ragged last block.
    out, lse = reference.blocked_forward(q, k, v, cfg, *segs, block_k=8)
    np.testing.assert_allclose(out, want_out, rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(want_lse))
    np.testing.assert_allclose(np.where(np.isinf(lse), 0, lse),
                               np.where(np.isinf(want_lse), 0, want_lse), rtol=1e-10)
    api_out, api_lse = jaxflash.attention(
        q, k, v, q_segment_ids=segs[0], kv_segment_ids=segs[1], return_lse=True,
        implementation="reference", **options)
    np.testing.assert_allclose(api_out, want_out, rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(np.isinf(api_lse), np.isinf(want_lse))
    np.testing.assert_allclose(np.where(np.isinf(api_lse), 0, api_lse),
                               np.where(np.isinf(want_lse), 0, want_lse), rtol=1e-10)


@pytest.mark.parametrize("options", OPTION_SETS.values(), ids=OPTION_SETS.keys())
@pytest.mark.parametrize("shape", [SHAPES["q_shorter"], SHAPES["q_longer"], SHAPES["dv_wider"]],
                         ids=["q_shorter", "q_longer", "dv_wider"])
def test_gradients_match_oracle_float64(options, shape):
  seq_q, seq_k, h, h_kv, d, dv = shape
  with x64():
    q, k, v = make_qkv(3, 2, seq_q, seq_k, h, h_kv, d, dv, dtype=jnp.float64)
    segs = make_segments(4, 2, seq_q, seq_k)
    rng = np.random.default_rng(5)
    w_out = jnp.asarray(rng.standard_normal((2, seq_q, h, dv)))
    w_lse = jnp.asarray(rng.standard_normal((2, h, seq_q)))

    def loss(fn):
      def f(q, k, v):
        out, lse = fn(q, k, v)
        # lse enters the loss too: its cotangent must reach q and k. Empty rows (lse = -inf)
        # are excluded since d(-inf) is meaningless.
        return jnp.sum(out * w_out) + jnp.sum(jnp.where(jnp.isinf(lse), 0, lse) * w_lse)
      return f

    api = loss(lambda q, k, v: jaxflash.attention(
        q, k, v, q_segment_ids=segs[0], kv_segment_ids=segs[1], return_lse=True,
        implementation="reference", **options))
    oracle = loss(lambda q, k, v: oracle_for(q, k, v, options, segs))
    got = jax.jit(jax.grad(api, argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(oracle, argnums=(0, 1, 2))(q, k, v)
    for name, g, w in zip("qkv", got, want):
      assert not np.isnan(np.asarray(g)).any(), f"d{name} has NaN"
      np.testing.assert_allclose(g, w, rtol=1e-8, atol=1e-10, err_msg=f"d{name}")


@pytest.mark.parametrize("options", [{}, {"causal": True, "softcap": 3.0, "window_size": (5, 2)}],
                         ids=["plain", "masked_softcap"])
def test_check_grads_numerically(options):
  with x64():
    q, k, v = make_qkv(6, 1, 9, 11, 2, 1, 4, 4, dtype=jnp.float64)
    f = lambda q, k, v: jaxflash.attention(q, k, v, implementation="reference", **options)
    check_grads(f, (q, k, v), order=1, modes=("rev",), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("options", [{}, {"causal": True}, {"softcap": 2.0, "window_size": (8, 8)}],
                         ids=["plain", "causal", "softcap_window"])
def test_half_precision_within_naive_error(dtype, options):
  # Tolerance: the reference accumulates in float32, so it must be at least as accurate as
  # the naive computation done in the input dtype (2x + 1e-5 floor, the shared oracle rule).
  with x64():
    q, k, v = make_qkv(7, 2, 64, 80, 4, 2, 32, 32, dtype=dtype)
    q64, k64, v64 = (x.astype(jnp.float64) for x in (q, k, v))
    want, want_lse = oracle_for(q64, k64, v64, options)
    naive, naive_lse = reference.naive_attention(q, k, v, config_for(32, options),
                                                 compute_dtype=dtype)
  out, lse = jaxflash.attention(q, k, v, return_lse=True, implementation="reference", **options)
  assert out.dtype == dtype and lse.dtype == jnp.float32
  assert_close_to_oracle(out, want, naive, name="out")
  assert_close_to_oracle(lse, want_lse, naive_lse, name="lse")
  # The check must be able to fail: an output off by one ulp-ish scale is caught.
  assert relative_l2(out.astype(jnp.float32) * 1.02, want) > 2 * relative_l2(naive, want) + 1e-5


def test_rows_that_see_no_key_are_zero_in_forward_and_backward():
  # seq_q > seq_k with causal: the first seq_q - seq_k rows see no key (bottom-right aligned);
  # segment 9 in the queries has no key at all.
  q, k, v = make_qkv(8, 2, 20, 12, 2, 1, 8, 8)
  q_seg = jnp.zeros((2, 20), jnp.int32).at[:, -3:].set(9)
  kv_seg = jnp.zeros((2, 12), jnp.int32)
  f = lambda q, k, v: jaxflash.attention(q, k, v, causal=True, q_segment_ids=q_seg,
                                         kv_segment_ids=kv_seg, return_lse=True,
                                         implementation="reference")
  out, lse = f(q, k, v)
  empty = np.zeros((2, 20), bool)
  empty[:, :8] = True
  empty[:, -3:] = True
  assert np.all(np.asarray(out)[empty] == 0)
  assert np.all(np.isneginf(np.asarray(lse).transpose(0, 2, 1)[empty]))
  assert np.all(np.isfinite(np.asarray(out)))
  grads = jax.grad(lambda q, k, v: jnp.sum(f(q, k, v)[0] ** 2), argnums=(0, 1, 2))(q, k, v)
  for g in grads:
    assert np.all(np.isfinite(np.asarray(g)))
  assert np.all(np.asarray(grads[0])[empty] == 0)


@pytest.mark.parametrize("causal", [False, True])
def test_nan_inputs_give_nan_out_and_lse_in_the_rows_that_see_them(causal):
  """A NaN in one query row and in one key: out and lse are NaN in exactly the rows whose
  scores hold the NaN (the query's row; the rows that see the key), in the naive and the
  blocked forward alike; rows without keys keep lse -inf."""
  q, k, v = make_qkv(3, 2, 40, 32, 4, 2, 16, dtype=jnp.float32)
  q = q.at[0, 15, 1, 3].set(jnp.nan)  # query 15 sees keys 0-7 when causal
  k = k.at[1, 20, 0, 7].set(jnp.nan)  # kv head 0: query heads 0 and 1
  cfg = AttentionConfig(softmax_scale=0.25, causal=causal)
  want = np.zeros((2, 4, 40), bool)  # (batch, head, query)
  want[0, 1, 15] = True
  rows = np.arange(40) + 32 - 40 >= 20 if causal else np.ones(40, bool)  # bottom-right aligned
  want[1, :2, rows] = True
  for fn in (reference.naive_attention, reference.blocked_forward):
    out, lse = fn(q, k, v, cfg)
    np.testing.assert_array_equal(np.isnan(np.asarray(lse)), want, err_msg=fn.__name__)
    np.testing.assert_array_equal(np.isnan(np.asarray(out)).any(-1),
                                  np.moveaxis(want, 1, 2), err_msg=fn.__name__)
    if causal:  # queries 0-7 see no key
      assert np.all(np.isneginf(np.asarray(lse)[:, :, :8])), fn.__name__


def test_no_key_at_all_gives_zeros():
  q, k, v = make_qkv(9, 2, 5, 0, 2, 1, 8, 8)
  out, lse = jaxflash.attention(q, k, v, return_lse=True)
  assert out.shape == (2, 5, 2, 8) and np.all(np.asarray(out) == 0)
  assert np.all(np.isneginf(np.asarray(lse)))
  dq = jax.grad(lambda q: jnp.sum(jaxflash.attention(q, k, v)))(q)
  assert np.all(np.asarray(dq) == 0)


@settings(max_examples=25, deadline=None)
@given(seq_q=st.integers(1, 24), seq_k=st.integers(1, 24), group=st.sampled_from([1, 2, 3]),
       kv_heads=st.integers(1, 2), head_dim=st.sampled_from([4, 8]),
       causal=st.booleans(), left=st.one_of(st.none(), st.integers(0, 10)),
       right=st.one_of(st.none(), st.integers(-2, 10)),
       softcap=st.one_of(st.none(), st.floats(0.5, 5.0)), segmented=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_any_shape_and_options_match_oracle(seq_q, seq_k, group, kv_heads, head_dim, causal,
                                            left, right, softcap, segmented, seed):
  options = {"causal": causal, "window_size": (left, right), "softcap": softcap}
  with x64():
    q, k, v = make_qkv(seed, 2, seq_q, seq_k, kv_heads * group, kv_heads, head_dim,
                       dtype=jnp.float64)
    segs = make_segments(seed + 1, 2, seq_q, seq_k) if segmented else (None, None)

    def ours(q, k, v, segs):
      return jaxflash.attention(q, k, v, q_segment_ids=segs[0], kv_segment_ids=segs[1],
                                return_lse=True, implementation="reference", **options)

    def both(q, k, v, segs):
      """(ours, oracle) of out, lse and d/dq sum(out^2): one compiled program per example
      (op-by-op dispatch would compile each of ~90 ops for the example's shapes)."""
      oracle = lambda q: oracle_for(q, k, v, options, segs)
      dq, dq_want = (jax.grad(lambda q: jnp.sum(f(q)[0] ** 2))(q)
                     for f in (lambda q: ours(q, k, v, segs), oracle))
      return ours(q, k, v, segs), oracle(q), dq, dq_want

    (out, lse), (want, want_lse), dq, dq_want = jax.jit(both)(q, k, v, segs)
    np.testing.assert_allclose(out, want, rtol=1e-9, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    np.testing.assert_allclose(dq, dq_want, rtol=1e-8, atol=1e-10)
