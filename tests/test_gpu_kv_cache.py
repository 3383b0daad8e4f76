"""The split-KV decode kernel (jaxflash.kv_cache_attention, implementation="cute") on the GPU.

Every call is checked against the per-sequence float64 oracle of tests/test_kv_cache.py with
the 2x-naive rule (the same math in the input dtype): lengths 0, 1, around a page and a key
block, full caches; pages permuted in the pool with unused pages between; GQA 8:1 and MQA;
seq_q 1, 3 and 16 with causal; windows, softcap and sinks with empty sequences; split counts.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from tests._cases import x64
from tests._oracle import assert_close_to_oracle
from tests.test_kv_cache import _oracle, _paged

pytestmark = pytest.mark.gpu


def _pool(cache, page_size, seed):
  """The cache in a pool of pages of page_size rows, permuted, unused pages between."""
  return _paged(cache, seed, page_size=page_size)


def _check(q, k, v, lengths, options, page_size=None, sink=None, num_splits=None):
  """The kernel's (out, lse) against the float64 oracle, within 2x the naive error; returns
  them."""
  dtype = np.dtype(q.dtype)
  caches, table = (k, v), None
  if page_size is not None:
    (k_pool, table), (v_pool, _) = _pool(k, page_size, 5), _pool(v, page_size, 5)
    caches = (k_pool, v_pool)
  out, lse = jaxflash.kv_cache_attention(q, *caches, lengths, page_table=table,
                                         learnable_sink=sink, num_splits=num_splits,
                                         return_lse=True, implementation="cute", **options)
  naive_out, naive_lse = _oracle(q, k, v, lengths, options, sink=sink, compute_dtype=dtype)
  with x64():
    up = lambda x: jnp.asarray(np.asarray(x, np.float64))
    want_out, want_lse = _oracle(up(q), up(k), up(v), lengths, options,
                                 sink=None if sink is None else up(sink))
  assert out.dtype == q.dtype and out.shape == want_out.shape
  assert_close_to_oracle(out, want_out, naive_out, name="out")
  assert_close_to_oracle(lse, want_lse, naive_lse, name="lse")
  return out, lse


def _inputs(seed, b, seq_q, h, h_kv, d, dv, capacity, dtype):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((b, seq_q, h, d)), dtype)
  k = jnp.asarray(rng.standard_normal((b, capacity, h_kv, d)), dtype)
  v = jnp.asarray(rng.standard_normal((b, capacity, h_kv, dv)), dtype)
  return q, k, v


CASES = {  # name -> (dtype, batch, seq_q, heads, kv heads, d, dv, capacity, lengths, options)
    "decode_gqa8_d128": ("bfloat16", 6, 1, 16, 2, 128, 128, 1100,
                         (0, 1, 15, 129, 1000, 1100), {"causal": False}),
    "decode_mqa_d64_causal": ("float16", 4, 1, 8, 1, 64, 64, 520, (1, 255, 257, 520), {}),
    "verify_3_d96": ("bfloat16", 3, 3, 4, 2, 96, 96, 300, (3, 100, 300), {}),
    "chunk_16_d192_dv128": ("bfloat16", 2, 16, 8, 2, 192, 128, 400, (16, 333), {}),
    "window_softcap_d256": ("float16", 3, 3, 4, 1, 256, 256, 600, (0, 70, 600),
                            {"window_size": (50, 0), "softcap": 20.0}),
    "window_both_sides_d192": ("bfloat16", 2, 4, 4, 2, 192, 192, 260, (4, 260),
                               {"causal": False, "window_size": (40, 3)}),
}


@pytest.mark.parametrize("page_size", [None, 16, 64, 256], ids=["contiguous", "p16", "p64",
                                                               "p256"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_kernel_matches_float64_oracle(case, page_size):
  dtype, b, seq_q, h, h_kv, d, dv, capacity, lengths, options = case
  q, k, v = _inputs(1, b, seq_q, h, h_kv, d, dv, capacity, dtype)
  _check(q, k, v, jnp.asarray(lengths, jnp.int32), options, page_size)


def test_sinks_with_empty_sequences_and_split_counts():
  q, k, v = _inputs(2, 4, 1, 8, 2, 128, 128, 2048, "bfloat16")
  lengths = jnp.asarray([0, 1, 700, 2048], jnp.int32)
  sink = jnp.asarray(np.random.default_rng(3).standard_normal(8), jnp.float32)
  results = [_check(q, k, v, lengths, {}, page_size=64, sink=sink, num_splits=n)[0]
             for n in (1, 3, 16)]
  # Splits change only the rounding.
  np.testing.assert_allclose(np.asarray(results[0], np.float32),
                             np.asarray(results[2], np.float32), atol=2e-2)


def test_fixed_split_count_is_bitwise_reproducible():
  q, k, v = _inputs(4, 2, 1, 32, 4, 128, 128, 8192, "bfloat16")
  lengths = jnp.asarray([5000, 8192], jnp.int32)
  call = jax.jit(lambda q, k, v, n: jaxflash.kv_cache_attention(
      q, k, v, n, num_splits=7, return_lse=True, implementation="cute"))
  first = call(q, k, v, lengths)
  for _ in range(3):
    again = call(q, k, v, lengths)
    for a, b in zip(first, again):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_cache_rows_past_the_length_are_never_used():
  """NaN in every cache row at or past a sequence's length (inside the last key box too) must
  not reach the output; page-table entries past the length point anywhere."""
  q, k, v = _inputs(6, 3, 1, 8, 2, 64, 64, 300, "bfloat16")
  lengths = jnp.asarray([1, 17, 290], jnp.int32)
  past = jnp.arange(300)[None, :, None, None] >= lengths[:, None, None, None]
  k_nan, v_nan = (jnp.where(past, jnp.nan, x).astype(x.dtype) for x in (k, v))
  out = jaxflash.kv_cache_attention(q, k_nan, v_nan, lengths, causal=False,
                                    implementation="cute")
  want = jaxflash.kv_cache_attention(q, k, v, lengths, causal=False, implementation="cute")
  np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
  k_pool, table = _pool(k_nan, 16, 7)
  v_pool, _ = _pool(v_nan, 16, 7)
  # Entries of pages wholly past a sequence's length point anywhere: clamped, never read.
  past_pages = jnp.arange(table.shape[1])[None, :] * 16 >= lengths[:, None]
  table = jnp.where(past_pages, 10 ** 6, table)
  paged = jaxflash.kv_cache_attention(q, k_pool, v_pool, lengths, page_table=table,
                                      causal=False, implementation="cute")
  assert not np.isnan(np.asarray(paged, np.float32)).any()
  _check(q, k, v, lengths, {"causal": False}, page_size=16)


def test_auto_mode_takes_the_kernel_under_jit_and_vmap():
  q, k, v = _inputs(8, 2, 1, 8, 2, 128, 128, 512, "float16")
  lengths = jnp.asarray([300, 512], jnp.int32)
  auto = jax.jit(lambda *a: jaxflash.kv_cache_attention(*a))
  hlo = auto.lower(q, k, v, lengths).as_text()
  assert "jaxflash_kv_cache_attention" in hlo
  want = jaxflash.kv_cache_attention(q, k, v, lengths, implementation="cute")
  np.testing.assert_array_equal(np.asarray(auto(q, k, v, lengths)), np.asarray(want))
  stacked = jax.vmap(lambda *a: jaxflash.kv_cache_attention(*a, implementation="cute"))(
      q[None], k[None], v[None], lengths[None])
  np.testing.assert_array_equal(np.asarray(stacked[0]), np.asarray(want))


def test_lengths_outside_the_capacity_are_clamped_by_the_kernel():
  """The lengths reach the kernel unclamped (jaxflash/kv_cache.py): negative ones read no key
  and ones past the capacity read the whole cache, contiguous and paged, as the clamped
  lengths do."""
  q, k, v = _inputs(9, 3, 1, 8, 2, 128, 128, 256, "bfloat16")
  wild = jnp.asarray([-5, 256 + 100, 2 ** 31 - 1], jnp.int32)
  clamped = jnp.asarray([0, 256, 256], jnp.int32)
  for page_size in (None, 64):
    caches, table = (k, v), None
    if page_size is not None:
      (k_pool, table), (v_pool, _) = _pool(k, page_size, 3), _pool(v, page_size, 3)
      caches = (k_pool, v_pool)
    got = jaxflash.kv_cache_attention(q, *caches, wild, page_table=table, causal=False,
                                      return_lse=True, implementation="cute")
    want = jaxflash.kv_cache_attention(q, *caches, clamped, page_table=table, causal=False,
                                       return_lse=True, implementation="cute")
    for g, w in zip(got, want):
      np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
  _check(q, k, v, clamped, {"causal": False})
