"""jaxflash.kv_cache_attention and update_kv_cache (jaxflash/kv_cache.py) on the CPU.

The oracle is independent of the cache code: each sequence's valid keys, cut out of the
dense cache by hand, go through reference.naive_attention, whose bottom-right causal and
window alignment puts query i of a length-L sequence at position L - seq_q + i, the cache's
rule. Paged caches hold the same keys in permuted pages and must give the same result.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from jaxflash import reference
from tests._cases import config_for, x64
from tests._oracle import assert_close_to_oracle

PAGE = 16


def _inputs(seed, b, seq_q, h, h_kv, d, capacity, dv=None, dtype=jnp.float64):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((b, seq_q, h, d)), dtype)
  k = jnp.asarray(rng.standard_normal((b, capacity, h_kv, d)), dtype)
  v = jnp.asarray(rng.standard_normal((b, capacity, h_kv, dv or d)), dtype)
  return q, k, v


def _paged(cache, seed, spare_pages=3, page_size=PAGE):
  """The contiguous cache's keys in a pool of pages (page_size rows) in a random order, with
  unused pages in between; returns (pool, page_table)."""
  b, capacity = cache.shape[:2]
  pages = -(-capacity // page_size)
  padded = jnp.pad(cache, ((0, 0), (0, pages * page_size - capacity), (0, 0), (0, 0)))
  order = np.random.default_rng(seed).permutation(b * pages + spare_pages)
  table = order[:b * pages].reshape(b, pages)
  pool = jnp.zeros((b * pages + spare_pages, page_size) + cache.shape[2:], cache.dtype)
  pool = pool.at[table.reshape(-1)].set(padded.reshape(b * pages, page_size,
                                                       *cache.shape[2:]))
  return pool, jnp.asarray(table, jnp.int32)


def _oracle(q, k, v, lengths, options, sink=None, compute_dtype=None):
  """(out, lse) per sequence from its first lengths[b] keys (naive_attention); causal unless
  the options say otherwise, as kv_cache_attention."""
  cfg = config_for(q.shape[-1], {"causal": True, **options})
  outs, lses = [], []
  for i, n in enumerate(np.asarray(lengths)):
    row_sink = sink
    if n == 0:  # no key: zeros, lse -inf (or the sink)
      out = jnp.zeros(q.shape[1:3] + v.shape[-1:], q.dtype)[None]
      lse = jnp.full((1, q.shape[2], q.shape[1]), -jnp.inf, jnp.promote_types(q.dtype, "f4"))
      if sink is not None:
        out, lse = jaxflash.sink.add_learnable_sink(out, lse, sink)
    else:
      out, lse = reference.naive_attention(q[i:i + 1], k[i:i + 1, :n], v[i:i + 1, :n], cfg,
                                           compute_dtype=compute_dtype,
                                           learnable_sink=row_sink)
    outs.append(out)
    lses.append(lse)
  return jnp.concatenate(outs), jnp.concatenate(lses)


CASES = {  # name -> (batch, seq_q, heads, kv_heads, head_dim, capacity, lengths, options)
    "decode_gqa8": (4, 1, 8, 1, 16, 50, (0, 1, 17, 50), {"causal": False}),
    "decode_causal_pages_pm1": (3, 1, 4, 2, 8, 48, (PAGE - 1, PAGE + 1, 2 * PAGE), {}),
    "verify_3": (3, 3, 4, 2, 8, 40, (2, 3, 40), {}),
    "chunk_16_mqa": (2, 16, 4, 1, 8, 40, (16, 37), {}),
    "window_softcap": (3, 3, 4, 2, 8, 40, (0, 9, 40), {"window_size": (5, 0), "softcap": 2.0}),
    "window_both_sides": (2, 4, 2, 2, 8, 36, (4, 36), {"causal": False, "window_size": (6, 2)}),
}


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_matches_per_sequence_float64_oracle(case, paged):
  b, seq_q, h, h_kv, d, capacity, lengths, options = case
  with x64():
    q, k, v = _inputs(1, b, seq_q, h, h_kv, d, capacity, dv=d + 8)
    lengths = jnp.asarray(lengths, jnp.int32)
    want_out, want_lse = _oracle(q, k, v, lengths, options)
    caches, table = (k, v), None
    if paged:
      (k_pool, table), (v_pool, _) = _paged(k, 2), _paged(v, 2)
      caches = (k_pool, v_pool)
    out, lse = jaxflash.kv_cache_attention(q, *caches, lengths, page_table=table,
                                           return_lse=True, **options)
    np.testing.assert_allclose(out, want_out, rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    np.testing.assert_allclose(np.where(np.isinf(lse), 0, lse),
                               np.where(np.isinf(want_lse), 0, want_lse), rtol=1e-10)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_within_naive_error(dtype):
  b, seq_q, h, h_kv, d, capacity = 3, 2, 8, 2, 32, 300
  lengths = jnp.asarray([1, 129, 300], jnp.int32)
  q, k, v = _inputs(3, b, seq_q, h, h_kv, d, capacity, dtype=dtype)
  out, lse = jaxflash.kv_cache_attention(q, k, v, lengths, return_lse=True)
  naive_out, naive_lse = _oracle(q, k, v, lengths, {}, compute_dtype=np.dtype(dtype))
  with x64():
    up = lambda x: jnp.asarray(np.asarray(x, np.float64))
    want_out, want_lse = _oracle(up(q), up(k), up(v), lengths, {})
  assert out.dtype == q.dtype
  assert_close_to_oracle(out, want_out, naive_out, name="out")
  assert_close_to_oracle(lse, want_lse, naive_lse, name="lse")


def test_learnable_sink_and_empty_sequences():
  with x64():
    q, k, v = _inputs(4, 3, 2, 4, 2, 8, 40)
    lengths = jnp.asarray([0, 1, 33], jnp.int32)
    sink = jnp.asarray([0.5, -1.0, 2.0, 0.0])
    want_out, want_lse = _oracle(q, k, v, lengths, {}, sink=sink)
    out, lse = jaxflash.kv_cache_attention(q, k, v, lengths, learnable_sink=sink,
                                           return_lse=True)
    np.testing.assert_allclose(out, want_out, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-10)
    assert not np.asarray(out[0]).any()  # length 0: zeros, lse = the sink
    np.testing.assert_array_equal(lse[0], jnp.broadcast_to(sink[:, None], (4, 2)))


def test_lengths_and_page_table_entries_are_clamped():
  """Lengths past the capacity read the full cache, negative ones none; page-table entries
  outside the pool are clamped into it (here: only entries past every length)."""
  with x64():
    q, k, v = _inputs(5, 3, 1, 2, 2, 8, 32)
    full = jnp.asarray([32, 0, 32], jnp.int32)
    want = jaxflash.kv_cache_attention(q, k, v, full)
    got = jaxflash.kv_cache_attention(q, k, v, jnp.asarray([1000, -5, 32], jnp.int32))
    np.testing.assert_array_equal(got, want)
    (k_pool, table), (v_pool, _) = _paged(k, 6), _paged(v, 6)
    lengths = jnp.asarray([PAGE, 0, 5], jnp.int32)
    want = jaxflash.kv_cache_attention(q, k_pool, v_pool, lengths, page_table=table)
    wild = table.at[0, 1].set(10 ** 6).at[1, :].set(-7).at[2, 1].set(-1)
    got = jaxflash.kv_cache_attention(q, k_pool, v_pool, lengths, page_table=wild)
    np.testing.assert_array_equal(got, want)
    assert np.isfinite(np.asarray(got)).all()


def test_jit_vmap_and_traced_lengths():
  q, k, v = _inputs(7, 2, 1, 4, 2, 8, 24, dtype=jnp.float32)
  lengths = jnp.asarray([5, 24], jnp.int32)
  want = jaxflash.kv_cache_attention(q, k, v, lengths)
  np.testing.assert_array_equal(jax.jit(jaxflash.kv_cache_attention)(q, k, v, lengths), want)
  stacked = jax.vmap(jaxflash.kv_cache_attention, in_axes=(0, None, None, None))(
      jnp.stack([q, 2 * q]), k, v, lengths)
  np.testing.assert_allclose(stacked[0], want, rtol=1e-6)
  np.testing.assert_allclose(stacked[1], jaxflash.kv_cache_attention(2 * q, k, v, lengths),
                             rtol=1e-6)


def test_differentiating_raises_a_clear_error():
  q, k, v = _inputs(8, 1, 1, 2, 2, 8, 16, dtype=jnp.float32)
  lengths = jnp.asarray([9], jnp.int32)
  with pytest.raises(TypeError, match="kv_cache_attention is forward only"):
    jax.grad(lambda q: jaxflash.kv_cache_attention(q, k, v, lengths).sum())(q)


def test_decoding_step_by_step_equals_causal_attention():
  """Prefill 5 tokens, then decode 3 one at a time through update_kv_cache (contiguous and
  paged): each output equals causal attention over the whole sequence so far."""
  b, h, h_kv, d, total = 2, 4, 2, 8, 8
  q_all, k_all, v_all = _inputs(9, b, total, h, h_kv, d, total, dtype=jnp.float32)
  k_all, v_all = k_all[:, :, :h_kv], v_all[:, :, :h_kv]
  want = jaxflash.attention(q_all, k_all, v_all, causal=True)
  for paged in (False, True):
    shape = (2 * b + 1, PAGE, h_kv, d) if paged else (b, 20, h_kv, d)
    k_cache = v_cache = jnp.zeros(shape, jnp.float32)
    table = jnp.asarray([[3, 1], [0, 4]], jnp.int32) if paged else None
    lengths = jnp.zeros((b,), jnp.int32)
    for start, stop in ((0, 5), (5, 6), (6, 7), (7, 8)):
      k_cache, v_cache, lengths = jaxflash.update_kv_cache(
          k_cache, v_cache, k_all[:, start:stop], v_all[:, start:stop], lengths,
          page_table=table)
      out = jaxflash.kv_cache_attention(q_all[:, start:stop], k_cache, v_cache, lengths,
                                        page_table=table)
      np.testing.assert_allclose(out, want[:, start:stop], rtol=2e-6, atol=2e-6,
                                 err_msg=f"paged={paged} tokens {start}:{stop}")
    np.testing.assert_array_equal(lengths, [total, total])


def test_update_drops_tokens_past_the_capacity_and_writes_in_place_when_donated():
  k_cache = jnp.zeros((2, 6, 1, 4), jnp.float32)
  v_cache = jnp.ones((2, 6, 1, 4), jnp.float32)
  new = jnp.arange(2 * 3 * 4, dtype=jnp.float32).reshape(2, 3, 1, 4) + 1
  k2, v2, lengths = jaxflash.update_kv_cache(k_cache, v_cache, new, new,
                                             jnp.asarray([1, 5], jnp.int32))
  np.testing.assert_array_equal(lengths, [4, 6])
  np.testing.assert_array_equal(k2[0, 1:4], new[0])
  np.testing.assert_array_equal(k2[1, 5], new[1, 0])  # positions 6 and 7 are dropped
  assert not np.asarray(k2[0, 4:]).any() and not np.asarray(k2[1, :5]).any()
  np.testing.assert_array_equal(v2[0, 0], 1)
  # Lengths outside [0, capacity] are clamped first: a negative one writes at 0.
  k4, _, lengths = jaxflash.update_kv_cache(k_cache, v_cache, new, new,
                                            jnp.asarray([-3, 9], jnp.int32))
  np.testing.assert_array_equal(lengths, [3, 6])
  np.testing.assert_array_equal(k4[0, :3], new[0])
  assert not np.asarray(k4[0, 3:]).any() and not np.asarray(k4[1]).any()

  step = jax.jit(jaxflash.update_kv_cache, donate_argnums=(0, 1))
  before = k_cache.unsafe_buffer_pointer()
  k3, _, _ = step(k_cache, v_cache, new, new, jnp.asarray([0, 0], jnp.int32))
  assert k3.unsafe_buffer_pointer() == before  # no copy of the cache


BAD_CALLS = [  # (description, keyword changes, error type, message pattern)
    ("query rank", dict(query=jnp.zeros((2, 1, 4))), ValueError, r"query: expected rank 4"),
    ("head_dim", dict(k_cache=jnp.zeros((2, 16, 2, 4))), ValueError, r"k_cache: head_dim 4"),
    ("v shape", dict(v_cache=jnp.zeros((2, 15, 2, 8))), ValueError, r"v_cache: shape"),
    ("heads", dict(k_cache=jnp.zeros((2, 16, 3, 8)), v_cache=jnp.zeros((2, 16, 3, 8))),
     ValueError, r"num_heads 4 must be a multiple of num_kv_heads 3"),
    ("batch", dict(k_cache=jnp.zeros((3, 16, 2, 8)), v_cache=jnp.zeros((3, 16, 2, 8))),
     ValueError, r"k_cache: batch 3 differs from the query's 2"),
    ("dtype", dict(v_cache=jnp.zeros((2, 16, 2, 8), jnp.bfloat16)), TypeError,
     r"query/k_cache/v_cache: dtypes must match"),
    ("lengths dtype", dict(cache_lengths=jnp.zeros((2,))), TypeError,
     r"cache_lengths: expected an integer dtype"),
    ("lengths shape", dict(cache_lengths=jnp.zeros((3,), jnp.int32)), ValueError,
     r"cache_lengths: expected shape \(2,\)"),
    ("page size", dict(k_cache=jnp.zeros((5, 24, 2, 8)), v_cache=jnp.zeros((5, 24, 2, 8)),
                       page_table=jnp.zeros((2, 2), jnp.int32)), ValueError,
     r"k_cache: page_size 24 .* power of two from 16 to 512"),
    ("page table rank", dict(k_cache=jnp.zeros((5, 16, 2, 8)), v_cache=jnp.zeros((5, 16, 2, 8)),
                             page_table=jnp.zeros((2,), jnp.int32)), ValueError,
     r"page_table: expected rank 2"),
    ("num_splits", dict(num_splits=0), ValueError, r"num_splits: expected None .* got 0"),
    ("cute float32", dict(implementation="cute"), ValueError,
     r"implementation='cute': dtype float32 has no kernel"),
    ("cute without a GPU or num_splits", dict(query=jnp.zeros((2, 1, 4, 64), jnp.bfloat16),
                                              k_cache=jnp.zeros((2, 16, 2, 64), jnp.bfloat16),
                                              v_cache=jnp.zeros((2, 16, 2, 64), jnp.bfloat16),
                                              implementation="cute"), ValueError,
     r"num_splits: None \(automatic\) is chosen from the GPU's SM count, and no CUDA device"),
    ("implementation", dict(implementation="cudnn"), ValueError, r"implementation: expected"),
    ("sink", dict(learnable_sink=jnp.zeros((3,))), ValueError, r"learnable_sink: expected shape"),
    ("window", dict(window_size=(1,)), ValueError, r"window_size: expected \(left, right\)"),
]


@pytest.mark.parametrize("description, changes, error, pattern", BAD_CALLS,
                         ids=[c[0] for c in BAD_CALLS])
def test_bad_input_raises_a_named_error(description, changes, error, pattern):
  del description
  args = dict(query=jnp.zeros((2, 1, 4, 8)), k_cache=jnp.zeros((2, 16, 2, 8)),
              v_cache=jnp.zeros((2, 16, 2, 8)), cache_lengths=jnp.zeros((2,), jnp.int32))
  args.update(changes)
  with pytest.raises(error, match=pattern):
    jaxflash.kv_cache_attention(args.pop("query"), args.pop("k_cache"), args.pop("v_cache"),
                                args.pop("cache_lengths"), **args)


def test_update_bad_input_raises_a_named_error():
  k = jnp.zeros((2, 16, 2, 8))
  lengths = jnp.zeros((2,), jnp.int32)
  with pytest.raises(ValueError, match=r"new_k: shape .* must end in the cache's"):
    jaxflash.update_kv_cache(k, k, jnp.zeros((2, 1, 2, 4)), jnp.zeros((2, 1, 2, 8)), lengths)
  with pytest.raises(TypeError, match=r"new_v: dtype bfloat16 differs"):
    jaxflash.update_kv_cache(k, k, jnp.zeros((2, 1, 2, 8)),
                             jnp.zeros((2, 1, 2, 8), jnp.bfloat16), lengths)
  with pytest.raises(ValueError, match=r"k_cache / v_cache: batch 2 / 2 differs from new_k's 3"):
    jaxflash.update_kv_cache(k, k, jnp.zeros((3, 1, 2, 8)), jnp.zeros((3, 1, 2, 8)),
                             jnp.zeros((3,), jnp.int32))
