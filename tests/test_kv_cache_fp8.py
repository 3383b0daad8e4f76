"""float8_e4m3fn KV caches (jaxflash/fp8_cache.py) on the CPU: update_kv_cache quantizes on
write with descales that only grow, kv_cache_attention reads them dequantized; accuracy
against a float64 oracle over the unquantized keys and values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from jaxflash import reference
from tests._cases import config_for, x64
from tests._oracle import assert_close_to_oracle, relative_l2
from tests.test_kv_cache import CASES, PAGE, _inputs, _oracle

FP8 = jnp.float8_e4m3fn


def _empty(b, capacity, h_kv, d, dv, paged, seed=0, spare_pages=3):
  """Zeroed FP8 caches, zero descales and the page table (a permuted pool) or None."""
  if not paged:
    caches = tuple(jnp.zeros((b, capacity, h_kv, x), FP8) for x in (d, dv))
    return caches, tuple(jnp.zeros((b, h_kv), jnp.float32) for _ in range(2)), None
  pages = -(-capacity // PAGE)
  order = np.random.default_rng(seed).permutation(b * pages + spare_pages)
  table = jnp.asarray(order[:b * pages].reshape(b, pages), jnp.int32)
  caches = tuple(jnp.zeros((b * pages + spare_pages, PAGE, h_kv, x), FP8) for x in (d, dv))
  return caches, tuple(jnp.zeros((b * pages + spare_pages, h_kv), jnp.float32)
                       for _ in range(2)), table


def _fill(k, v, lengths, paged, chunks=(7, 30)):
  """FP8 caches holding the first lengths[b] keys / values of k, v (float), written by
  update_kv_cache in chunks of 7 and 30 tokens by turns (each write straddles pages and grows
  descales), jitted and donated. Returns (k_cache, v_cache, k_descale, v_descale, table)."""
  b, capacity, h_kv, d = k.shape
  (kc, vc), (kd, vd), table = _empty(b, capacity, h_kv, d, v.shape[-1], paged)
  update = jax.jit(lambda kc, vc, nk, nv, n, kd, vd: jaxflash.update_kv_cache(
      kc, vc, nk, nv, n, page_table=table, k_descale=kd, v_descale=vd),
      donate_argnums=(0, 1, 5, 6))
  written = np.zeros(b, np.int32)
  lengths = np.asarray(lengths)
  i = 0
  while (written < lengths).any():
    n = chunks[i % len(chunks)]
    i += 1
    # Each sequence writes min(n, what it still lacks) real tokens; the rest of its chunk are
    # past its length and later overwritten or never read.
    nk = jnp.stack([jax.lax.dynamic_slice_in_dim(jnp.pad(k[j], ((0, n), (0, 0), (0, 0))),
                                                 int(written[j]), n) for j in range(b)])
    nv = jnp.stack([jax.lax.dynamic_slice_in_dim(jnp.pad(v[j], ((0, n), (0, 0), (0, 0))),
                                                 int(written[j]), n) for j in range(b)])
    kc, vc, _, kd, vd = update(kc, vc, nk.astype(jnp.float32), nv.astype(jnp.float32),
                               jnp.asarray(written), kd, vd)
    written = np.minimum(written + n, lengths)
  return kc, vc, kd, vd, table


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_fp8_caches_within_twice_the_error_of_dequantize_then_attend(case, paged):
  """Against float64 attention over the unquantized keys and values (with a learnable sink):
  the error is at most twice that of dequantizing in float32 and attending naively, and the
  quantization's own (a few percent)."""
  b, seq_q, h, h_kv, d, capacity, lengths, options = case
  q, k, v = _inputs(5, b, seq_q, h, h_kv, d, capacity, dv=d + 8, dtype=jnp.float32)
  sink = jnp.asarray(np.linspace(-1.0, 1.0, h), jnp.float32)
  lengths = jnp.asarray(lengths, jnp.int32)
  kc, vc, kd, vd, table = _fill(k, v, lengths, paged)
  out, lse = jax.jit(lambda *a: jaxflash.kv_cache_attention(
      *a, page_table=table, k_descale=kd, v_descale=vd, learnable_sink=sink, return_lse=True,
      **options))(q, kc, vc, lengths)
  cfg = config_for(d, {"causal": True, **options})
  naive_out, naive_lse = reference.naive_kv_cache_attention(
      q, kc, vc, lengths, cfg, table, compute_dtype=jnp.float32, learnable_sink=sink,
      descales=(kd, vd))
  with x64():
    up = lambda x: jnp.asarray(np.asarray(x, np.float64))
    want_out, want_lse = _oracle(up(q), up(k), up(v), lengths, options, sink=up(sink))
  assert out.dtype == q.dtype
  assert_close_to_oracle(out, want_out, naive_out, name="out")
  assert_close_to_oracle(lse, want_lse, naive_lse, name="lse")
  # A wrong descale or a page read at another's scale is off by far more: e4m3 rounds each
  # element by at most 1/16 of its value, requantization once more.
  assert relative_l2(out, want_out) < 0.08


def test_a_descale_grows_and_requantizes_the_rows_already_written():
  """Small values, then values 100x larger into the same page: the page's descale grows to
  the new amax / 448 and the first tokens still read back within e4m3's precision; smaller
  values later leave it as it is."""
  rng = np.random.default_rng(6)
  (kc, vc), (kd, vd), table = _empty(1, 2 * PAGE, 1, 8, 8, paged=True, spare_pages=0)
  small, large, tiny = (jnp.asarray(rng.standard_normal((1, n, 1, 8)) * s, jnp.float32)
                        for n, s in ((3, 1.0), (4, 100.0), (2, 0.01)))
  update = lambda kc, vc, new, n, kd, vd: jax.jit(jaxflash.update_kv_cache)(
      kc, vc, new, new, jnp.asarray([n], jnp.int32), page_table=table, k_descale=kd,
      v_descale=vd)
  kc, vc, _, kd, vd = update(kc, vc, small, 0, kd, vd)
  page = int(table[0, 0])
  np.testing.assert_allclose(kd[page, 0], np.abs(small).max() / 448, rtol=1e-6)
  kc, vc, _, kd, vd = update(kc, vc, large, 3, kd, vd)
  np.testing.assert_allclose(kd[page, 0], np.abs(large).max() / 448, rtol=1e-6)
  kc, vc, _, kd2, vd = update(kc, vc, tiny, 7, kd, vd)
  np.testing.assert_array_equal(kd2, kd)  # only grows
  rows = reference.cache_rows(kc, table, jnp.arange(9)[None], kd2)[0]
  want = jnp.concatenate([small, large, tiny], axis=1)[0]
  # e4m3 keeps 3 mantissa bits (relative step 1/8); values far below the descale lose more.
  np.testing.assert_allclose(rows[3:7], want[3:7], rtol=1 / 16, atol=1e-6)
  assert relative_l2(rows[:3], want[:3]) < 0.25  # requantized once at 100x the scale
  assert relative_l2(rows, want) < 0.05


def _primitives(jaxpr) -> set:
  """Names of the primitives in a (closed) jaxpr, its sub-jaxprs' included."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  names = set()
  for eqn in jaxpr.eqns:
    names.add(eqn.primitive.name)
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
          names |= _primitives(sub)
  return names


def test_a_page_pool_write_runs_no_conditional_and_keeps_pages_whose_descale_stays():
  """A decoding step's write into a page pool requantizes the pages it touches without a
  conditional (XLA reads a conditional's predicate on the host); a contiguous cache's write,
  whose descale covers the whole sequence, rescales K and V under one. A page whose descale does not
  grow keeps its rows bit for bit."""
  rng = np.random.default_rng(8)
  (kc, vc), (kd, vd), table = _empty(2, 2 * PAGE, 1, 8, 8, paged=True, spare_pages=0)
  first = jnp.asarray(rng.standard_normal((2, 5, 1, 8)), jnp.float32)
  update = lambda kc, vc, new, n, kd, vd, table: jaxflash.update_kv_cache(
      kc, vc, new, new, n, page_table=table, k_descale=kd, v_descale=vd)
  kc, vc, _, kd, vd = update(kc, vc, first, jnp.zeros(2, jnp.int32), kd, vd, table)
  step = jnp.asarray(rng.standard_normal((2, 1, 1, 8)), jnp.float32)
  step = step.at[1].multiply(0.01)  # sequence 1's page keeps its descale, 0's grows
  step = step.at[0].multiply(10.0)
  lengths = jnp.full(2, 5, jnp.int32)
  assert not {"cond", "switch"} & _primitives(jax.make_jaxpr(update)(
      kc, vc, step, lengths, kd, vd, table))
  kc2, _, _, kd2, _ = update(kc, vc, step, lengths, kd, vd, table)
  grown, kept = int(table[0, 0]), int(table[1, 0])
  assert kd2[grown, 0] > kd[grown, 0] and kd2[kept, 0] == kd[kept, 0]
  np.testing.assert_array_equal(np.asarray(kc2[kept, :5]).view(np.uint8),
                                np.asarray(kc[kept, :5]).view(np.uint8))
  assert (np.asarray(kc2[grown, :5]).view(np.uint8)
          != np.asarray(kc[grown, :5]).view(np.uint8)).any()
  (kc, vc), (kd, vd), _ = _empty(2, 2 * PAGE, 1, 8, 8, paged=False)
  contiguous = jax.make_jaxpr(update)(kc, vc, step, lengths, kd, vd, None).jaxpr
  # One conditional for K and V together: one predicate for the host to read per write.
  assert [e.primitive.name for e in contiguous.eqns].count("cond") == 1


def test_a_page_without_valid_keys_starts_from_its_new_tokens():
  """A page reused from a sequence that held large values (its descale stale): a write from
  length 0 sets the descale from the new tokens alone; the same for a contiguous sequence."""
  for paged in (True, False):
    (kc, vc), (kd, vd), table = _empty(1, PAGE, 1, 8, 8, paged=paged, spare_pages=0)
    kd, vd = kd + 50.0, vd + 50.0
    new = jnp.full((1, 2, 1, 8), 4.48, jnp.float32)
    kc, vc, _, kd, vd = jaxflash.update_kv_cache(kc, vc, new, new, jnp.asarray([0], jnp.int32),
                                                 page_table=table, k_descale=kd, v_descale=vd)
    np.testing.assert_allclose(kd, 0.01, rtol=1e-6)
    np.testing.assert_allclose(reference.cache_rows(kc, table, jnp.arange(2)[None], kd), new,
                               rtol=1e-6)


def test_tokens_past_the_capacity_change_no_descale():
  (kc, vc), (kd, vd), _ = _empty(1, 4, 1, 8, 8, paged=False)
  kd, vd = kd + 0.5, vd + 0.5
  new = jnp.full((1, 3, 1, 8), 1000.0, jnp.float32)
  kc2, vc2, n, kd2, vd2 = jaxflash.update_kv_cache(kc, vc, new, new,
                                                   jnp.asarray([4], jnp.int32),
                                                   k_descale=kd, v_descale=vd)
  assert int(n[0]) == 4
  np.testing.assert_array_equal(kd2, kd)
  np.testing.assert_array_equal(np.asarray(kc2, np.float32), np.asarray(kc, np.float32))


def _call_args():
  (kc, vc), (kd, vd), table = _empty(2, 32, 2, 8, 8, paged=True)
  q = jnp.zeros((2, 1, 4, 8), jnp.bfloat16)
  return dict(query=q, k_cache=kc, v_cache=vc, cache_lengths=jnp.asarray([3, 5], jnp.int32),
              page_table=table, k_descale=kd, v_descale=vd)


@pytest.mark.parametrize("changes, error, pattern", [
    (dict(k_descale=None), TypeError, r"k_descale: float8_e4m3fn caches need float32 descales "
                                      r"\(num_pages, num_kv_heads\)"),
    (dict(v_descale=jnp.zeros((2, 2), jnp.float32)), ValueError,
     r"v_descale: expected shape \(num_pages, num_kv_heads\) = \(7, 2\), got \(2, 2\)"),
    (dict(k_descale=jnp.zeros((7, 2), jnp.bfloat16)), TypeError, "k_descale: expected float32"),
    (dict(k_cache=jnp.zeros((7, PAGE, 2, 8), jnp.bfloat16)), TypeError,
     "k_cache / v_cache: both float8_e4m3fn or neither"),
    (dict(implementation="cute"), ValueError,
     "implementation='cute': head_dim 8 has no decode kernel"),
], ids=["missing_descale", "descale_shape", "descale_dtype", "mixed_caches", "cute"])
def test_fp8_cache_bad_input_raises_a_named_error(changes, error, pattern):
  args = {**_call_args(), **changes}
  with pytest.raises(error, match=pattern):
    jaxflash.kv_cache_attention(**args)


def test_descales_with_16_bit_caches_and_bad_new_tokens_raise():
  q = jnp.zeros((1, 1, 2, 8), jnp.bfloat16)
  k = jnp.zeros((1, 16, 2, 8), jnp.bfloat16)
  with pytest.raises(TypeError, match="k_descale: applies to float8_e4m3fn caches only"):
    jaxflash.kv_cache_attention(q, k, k, jnp.asarray([1], jnp.int32),
                                k_descale=jnp.ones((1, 2), jnp.float32))
  args = _call_args()
  new = jnp.zeros((2, 1, 2, 8), jnp.int32)
  with pytest.raises(TypeError, match="new_k: float8_e4m3fn caches take new tokens in float16"):
    jaxflash.update_kv_cache(args["k_cache"], args["v_cache"], new, new, args["cache_lengths"],
                             page_table=args["page_table"], k_descale=args["k_descale"],
                             v_descale=args["v_descale"])
