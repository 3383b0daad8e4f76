"""bias / score_mod / mask_mod of jaxflash.attention: the recipes against a float64 oracle
(forward and every gradient, the closed-over arrays' included), argument errors, edge rows."""

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
import pytest

import jaxflash
from jaxflash import reference
from tests._cases import x64
from tests._oracle import assert_close_to_oracle

B, S, H, H_KV, D = 2, 70, 4, 2, 16


@pytest.fixture(autouse=True)
def small_key_blocks(monkeypatch):
  """Blocks of 32 keys: 70 keys make three blocks, the last one padded."""
  monkeypatch.setattr(reference, "DEFAULT_BLOCK_K", 32)


def _inputs(seed, dtype=jnp.float32, seq_k=S):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((B, S, H, D))
  k, v = (rng.standard_normal((B, seq_k, H_KV, D)) for _ in range(2))
  return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def _oracle(q, k, v, *, causal=False, bias=None, score_mod=None, mask_mod=None, sink=None,
            dtype=jnp.float64):
  """(out, lse) with every score materialised, in `dtype`; the functions are called once on
  broadcast index grids (not mapped per element as the implementation does)."""
  q, k, v = (x.astype(dtype) for x in (q, k, v))
  g = q.shape[2] // k.shape[2]
  k, v = (jnp.repeat(x, g, axis=2) for x in (k, v))
  seq_q, seq_k = q.shape[1], k.shape[1]
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
  bi, hi, qi, ki = (jnp.arange(n, dtype=jnp.int32).reshape(shape) for n, shape in (
      (q.shape[0], (-1, 1, 1, 1)), (q.shape[2], (1, -1, 1, 1)), (seq_q, (1, 1, -1, 1)),
      (seq_k, (1, 1, 1, -1))))
  if bias is not None:
    s = s + bias.astype(dtype)
  if score_mod is not None:
    s = score_mod(s, bi, hi, qi, ki).astype(dtype)
  keep = jnp.ones(s.shape, bool)
  if causal:
    keep &= ki <= qi + (seq_k - seq_q)
  if mask_mod is not None:
    keep &= mask_mod(bi, hi, qi, ki)
  s = jnp.where(keep, s, -jnp.inf)
  if sink is not None:
    s = jnp.concatenate([s, jnp.broadcast_to(sink.astype(dtype)[None, :, None, None],
                                             s.shape[:3] + (1,))], axis=-1)
  m = jnp.max(s, axis=-1, keepdims=True)
  p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0))
  l = jnp.sum(p, axis=-1, keepdims=True)
  p = (p / jnp.where(l > 0, l, 1))[..., :seq_k]
  out = jnp.einsum("bhqk,bkhd->bqhd", p, v)
  lse = jnp.where(l[..., 0] > 0, jnp.log(jnp.where(l[..., 0] > 0, l[..., 0], 1)) + m[..., 0],
                  -jnp.inf)
  return out, lse


def _loss(attend, cotangent):
  def loss(*args):
    out, lse = attend(*args)
    return jnp.sum(out * cotangent) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0))
  return loss


def _slopes():
  return jnp.asarray(2.0 ** -np.arange(1, H + 1), jnp.float32)


def _t5_table():
  return jnp.asarray(np.random.default_rng(7).standard_normal((8, H)) * 0.5, jnp.float32)


def _t5_bucket(qi, ki):
  """Distance back (q - kv, causal side) in 8 buckets: 0-3 exact, then [4, 8), [8, 16),
  [16, 32), 32 and more (T5's logarithmic buckets, in integer thresholds)."""
  rel = jnp.maximum(qi - ki, 0)
  return jnp.where(rel < 4, rel, 3 + (rel >= 4).astype(jnp.int32) + (rel >= 8) + (rel >= 16)
                   + (rel >= 32))


def _t5_by_distance(table):
  """T5 buckets the way the kernels run them fast: the table's entry per distance q - kv in
  [0, 32] (the buckets are constant from 32 on and 0 on the other side), gathered once per
  call, so jax.grad reaches `table` through the gather, and read per score."""
  distance = jnp.arange(33)
  rel = table[_t5_bucket(distance, jnp.zeros_like(distance))].T  # (H, 33)
  return dict(causal=True, score_mod=lambda s, b, h, q, k: s + rel[h, jnp.clip(q - k, 0, 32)])


_DOCS = np.repeat(np.arange(3), [25, 30, 15])

# name: (extra float arrays the recipe differentiates, attention kwargs built from them).
RECIPES = {
    "alibi": ((_slopes,), lambda slopes: dict(
        causal=True, score_mod=lambda s, b, h, q, k: s + slopes[h] * (k - q))),
    "t5_buckets": ((_t5_table,), lambda table: dict(
        causal=True, score_mod=lambda s, b, h, q, k: s + table[_t5_bucket(q, k), h])),
    "t5_by_distance": ((_t5_table,), _t5_by_distance),
    "prefix_lm": ((), lambda: dict(mask_mod=lambda b, h, q, k: (k < 20) | (k <= q))),
    "chunked": ((), lambda: dict(mask_mod=lambda b, h, q, k: (q // 16 == k // 16) & (k <= q))),
    "documents": ((), lambda: dict(mask_mod=lambda b, h, q, k: (
        jnp.asarray(_DOCS)[q] == jnp.asarray(_DOCS)[k]) & (k <= q))),
    "sliding_window": ((), lambda: dict(mask_mod=lambda b, h, q, k: (k <= q) & (q - k <= 9))),
    "pair_bias": ((lambda: jnp.asarray(np.random.default_rng(3).standard_normal((B, H, S, S)),
                                       jnp.float32),), lambda bias: dict(bias=bias)),
    "bias_per_head_row": ((lambda: jnp.asarray(
        np.random.default_rng(4).standard_normal((1, H, 1, S)), jnp.float32),),
        lambda bias: dict(bias=bias, causal=True)),
}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_forward_and_gradients_match_the_float64_oracle(name):
  """The output, lse and the gradients of q, k, v and of every float array of the recipe
  (ALiBi slopes, a T5 bucket table, a bias) within 2x the error of the same math done naively
  in float32, against float64."""
  makers, options = RECIPES[name]
  arrays = tuple(make() for make in makers)
  q, k, v = _inputs(hash(name) % 1000)
  cot = jnp.asarray(np.random.default_rng(1).standard_normal((B, S, H, D)), jnp.float32)

  def ours(q, k, v, *arrays):
    return jaxflash.attention(q, k, v, return_lse=True, **options(*arrays))

  def oracle(dtype):
    return lambda q, k, v, *arrays: _oracle(q, k, v, dtype=dtype, **options(*arrays))

  args = (q, k, v) + arrays
  with x64():
    wide = tuple(x.astype(jnp.float64) for x in args)
    assert all(x.dtype == jnp.float64 for x in wide)
    want = oracle(jnp.float64)(*wide)
    want_grads = jax.grad(_loss(oracle(jnp.float64), cot.astype(jnp.float64)),
                          argnums=tuple(range(len(args))))(*wide)
    naive = oracle(jnp.float32)(*args)
    naive_grads = jax.grad(_loss(oracle(jnp.float32), cot), argnums=tuple(range(len(args))))(
        *args)
  got = jax.jit(ours)(*args)
  got_grads = jax.jit(jax.grad(_loss(ours, cot), argnums=tuple(range(len(args)))))(*args)
  for i, label in enumerate(("out", "lse")):
    assert_close_to_oracle(got[i], want[i], naive[i], name=f"{name} {label}")
  labels = ("dq", "dk", "dv") + tuple(f"d{m.__name__.strip('_')}" for m in makers)
  for label, g, w, n in zip(labels, got_grads, want_grads, naive_grads):
    assert g.shape == w.shape and g.dtype == jnp.float32, label
    assert_close_to_oracle(g, w, n, name=f"{name} {label}")


def test_bias_gradient_is_reduced_over_its_broadcast_dims():
  """A (1, 1, 1, seq_k) bias gets the sum over batch, heads and queries of the full bias's
  gradient."""
  q, k, v = _inputs(5)
  rng = np.random.default_rng(6)
  small = jnp.asarray(rng.standard_normal((1, 1, 1, S)), jnp.float32)
  loss = lambda bias: jnp.sum(jaxflash.attention(q, k, v, bias=bias) ** 2)
  full = jax.grad(loss)(jnp.broadcast_to(small, (B, H, S, S)))
  np.testing.assert_allclose(jax.grad(loss)(small), full.sum(axis=(0, 1, 2), keepdims=True),
                             rtol=1e-5, atol=1e-6)


def test_functions_see_only_key_indices_below_seq_k():
  """The last key block is padded past seq_k; its columns reach score_mod as kv_idx = seq_k - 1,
  so a function undefined past seq_k (NaN there) leaves the gradients of what it closes over
  finite."""
  q, k, v = _inputs(13)
  w = jnp.asarray([0.3], jnp.float32)
  loss = lambda w: jnp.sum(jaxflash.attention(
      q, k, v, score_mod=lambda s, b, h, i, j: s + w[0] * jnp.where(j < S, 1.0, jnp.nan)))
  assert np.isfinite(np.asarray(jax.grad(loss)(w))).all()


def test_mask_mod_window_equals_the_built_in_window():
  q, k, v = _inputs(8)
  built_in = jaxflash.attention(q, k, v, causal=True, window_size=(9, 0))
  as_mod = jaxflash.attention(q, k, v, mask_mod=lambda b, h, i, j: (j <= i) & (i - j <= 9))
  np.testing.assert_allclose(as_mod, built_in, rtol=1e-6, atol=1e-6)


def test_rows_that_see_no_key_are_zero_with_finite_gradients():
  """mask_mod hiding every key from the even queries: their output is 0, their lse -inf, and
  no gradient is NaN; the odd rows match the oracle."""
  q, k, v = _inputs(9)
  mask_mod = lambda b, h, i, j: (i % 2 == 1) & (j <= i)
  out, lse = jaxflash.attention(q, k, v, mask_mod=mask_mod, return_lse=True)
  assert (np.asarray(out[:, 0::2]) == 0).all() and np.isneginf(np.asarray(lse[:, :, 0::2])).all()
  with x64():
    want, _ = _oracle(q.astype(jnp.float64), k.astype(jnp.float64), v.astype(jnp.float64),
                      mask_mod=mask_mod)
  np.testing.assert_allclose(out[:, 1::2], want[:, 1::2], rtol=2e-5, atol=2e-6)
  grads = jax.grad(lambda q, k, v: jnp.sum(jaxflash.attention(
      q, k, v, mask_mod=mask_mod) ** 2), argnums=(0, 1, 2))(q, k, v)
  assert all(np.isfinite(np.asarray(g)).all() for g in grads)


def test_score_mod_with_segment_ids_sinks_softcap_and_gqa_under_vmap():
  """The built-in modifiers apply before score_mod (softcap) and around it (segment ids, the
  sink's column), and vmap over a leading axis maps the whole call."""
  q, k, v = _inputs(10)
  ids = jnp.asarray(np.repeat([[0, 1]], [40, 30], axis=1).repeat(B, 0), jnp.int32)
  sink = jnp.asarray([0.5, -1.0, 0.0, 2.0], jnp.float32)
  slopes = _slopes()
  mod = lambda s, b, h, i, j: s - slopes[h] * jnp.abs(i - j)
  got = jaxflash.attention(q, k, v, softcap=5.0, q_segment_ids=ids, kv_segment_ids=ids,
                           learnable_sink=sink, score_mod=mod)
  capped = lambda s, b, h, i, j: mod(5.0 * jnp.tanh(s / 5.0), b, h, i, j)
  same_doc = lambda b, h, i, j: jnp.asarray(ids)[b, i] == jnp.asarray(ids)[b, j]
  want, _ = _oracle(q, k, v, score_mod=capped, mask_mod=same_doc, sink=sink, dtype=jnp.float32)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
  stacked = jax.vmap(lambda q, k, v: jaxflash.attention(q, k, v, score_mod=mod))(
      q[None].repeat(2, 0), k[None].repeat(2, 0), v[None].repeat(2, 0))
  np.testing.assert_allclose(stacked[1], jaxflash.attention(q, k, v, score_mod=mod),
                             rtol=1e-6, atol=1e-6)


def _branching_mask(b, h, i, j):
  if i >= j:  # a Python branch on a traced value
    return True
  return False


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(bias=jnp.zeros((H, S, S))), ValueError, "bias: expected rank 4"),
    (dict(bias=jnp.zeros((B, H, S, S - 1))), ValueError, r"bias: shape \(2, 4, 70, 69\)"),
    (dict(bias=jnp.zeros((B, 3, S, S))), ValueError, "each of the first three dims may be 1"),
    (dict(bias=jnp.zeros((1, 1, 1, S), jnp.int32)), TypeError, "bias: dtype int32"),
    (dict(score_mod="alibi"), TypeError, "score_mod: expected a function"),
    (dict(score_mod=lambda s, b, h, i: s), TypeError, r"score_mod: calling it as score_mod\("),
    (dict(score_mod=lambda s, b, h, i, j: i > j), TypeError, "score_mod: must return a float"),
    (dict(mask_mod=lambda b, h, i, j: i - j), TypeError, "mask_mod: must return a boolean"),
    (dict(mask_mod=_branching_mask), ValueError, "mask_mod: must be a JAX function of scalars"),
    (dict(mask_mod=lambda b, h, i, j: lax.cond(i > j, lambda: True, lambda: j == 0),
          implementation="cute"), ValueError,
     "implementation='cute': mask_mod: unsupported primitive cond"),
    (dict(score_mod=lambda s, b, h, i, j: s, bias=jnp.zeros((1, 1, 1, S)),
          implementation="cute"), ValueError,
     "implementation='cute': score_mod / mask_mod: no kernel takes them together with a bias"),
], ids=["bias_rank", "bias_seq_k", "bias_heads", "bias_dtype", "score_mod_not_callable",
        "score_mod_arity", "score_mod_bool", "mask_mod_int", "mask_mod_branch",
        "cute_unsupported_primitive", "cute_with_bias"])
def test_bad_modifiers_raise_errors_naming_the_argument(kwargs, error, match):
  q, k, v = _inputs(11)
  with pytest.raises(error, match=match):
    jax.jit(lambda q, k, v: jaxflash.attention(q, k, v, **kwargs))(q, k, v)


def test_fp8_inputs_take_no_modifiers():
  q, k, v = (x.astype(jnp.float8_e4m3fn) for x in _inputs(12))
  with pytest.raises(TypeError, match="score_mod: float8_e4m3fn inputs take no score_mod"):
    jaxflash.attention(q, k, v, score_mod=lambda s, b, h, i, j: s)
