"""Chunked prefill (kernels/chunked_sm90.py, through jaxflash.kv_cache_attention) on the GPU.

Every call is checked against the per-sequence float64 oracle with the 2x-naive rule
(tests/test_gpu_kv_cache.py's _check): chunks of 1, 127, 128, 129 and 600 tokens, GQA 8:1 and
1:1, lengths 0, shorter than the chunk (queries at negative positions), straddling key blocks
and pages, full caches, different per sequence; contiguous caches and permuted pools of pages of
16, 64 and 256 keys; windows, softcap and sinks. The cases force the chunked variant (the
routing would send small calls to the split-KV kernel); one call takes it by the routing. The
raw call writes into NaN-poisoned buffers, and NaN in cache rows past a length never reaches
the output.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from jaxflash import config, ffi, split_kv
from tests._cases import x64
from tests._oracle import assert_close_to_oracle
from tests.test_gpu_kv_cache import _check, _inputs, _pool
from tests.test_kv_cache import _oracle

pytestmark = pytest.mark.gpu


@pytest.fixture
def chunked(monkeypatch):
  """kv_cache_attention takes the chunked variant at every shape it covers."""
  monkeypatch.setattr(split_kv, "use_chunked", lambda *args, **kwargs: True)


CASES = {  # name -> (dtype, batch, seq_q, heads, kv heads, d, capacity, lengths, options)
    "q1_gqa8_d128": ("bfloat16", 4, 1, 16, 2, 128, 700, (0, 1, 129, 700), {}),
    "q127_gqa8_d128": ("bfloat16", 3, 127, 16, 2, 128, 800, (0, 100, 800), {}),
    "q128_mha_d64": ("float16", 3, 128, 4, 4, 64, 520, (128, 200, 520), {}),
    "q129_gqa8_d96": ("bfloat16", 2, 129, 8, 1, 96, 400, (129, 385), {}),
    "q600_gqa8_d128": ("bfloat16", 3, 600, 16, 2, 128, 1100, (300, 600, 1100), {}),
    "q600_mha_d64_full": ("float16", 2, 600, 2, 2, 64, 900, (0, 777), {"causal": False}),
    "q200_window_softcap": ("bfloat16", 2, 200, 8, 2, 128, 600, (150, 600),
                            {"window_size": (100, 0), "softcap": 20.0}),
}


@pytest.mark.parametrize("page_size", [None, 16, 64, 128, 256],
                         ids=["contiguous", "p16", "p64", "p128", "p256"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_chunked_kernel_matches_float64_oracle(chunked, case, page_size):
  dtype, b, seq_q, h, h_kv, d, capacity, lengths, options = case
  q, k, v = _inputs(11, b, seq_q, h, h_kv, d, d, capacity, dtype)
  _check(q, k, v, jnp.asarray(lengths, jnp.int32), options, page_size)


@pytest.mark.parametrize("page_size", [None, 64], ids=["contiguous", "p64"])
def test_sinks_with_empty_sequences_and_negative_positions(chunked, page_size):
  q, k, v = _inputs(12, 4, 300, 8, 2, 128, 128, 1024, "bfloat16")
  lengths = jnp.asarray([0, 1, 299, 1024], jnp.int32)
  sink = jnp.asarray(np.random.default_rng(13).standard_normal(8), jnp.float32)
  _check(q, k, v, lengths, {}, page_size=page_size, sink=sink)


def test_a_long_chunk_takes_the_chunked_variant_by_the_routing():
  """8 sequences of 512 new tokens, 32 / 8 heads: 1024 tiles of 128 rows, past the routing's
  threshold; pages of 128 keys (whole key blocks, which the routing asks for), lengths from 512
  to the capacity."""
  q, k, v = _inputs(14, 8, 512, 32, 8, 128, 128, 1536, "bfloat16")
  lengths = jnp.asarray([512, 513, 640, 700, 1023, 1024, 1300, 1536], jnp.int32)
  k_pool, table = _pool(k, 128, 15)
  v_pool, _ = _pool(v, 128, 15)
  hlo = jax.jit(lambda *a: jaxflash.kv_cache_attention(*a[:4], page_table=a[4])).lower(
      q, k_pool, v_pool, lengths, table).as_text()
  assert config.chunked_variant("bfloat16", 128, 128).key in hlo
  _check(q, k, v, lengths, {}, page_size=128)


# keep_unused: jit would otherwise drop the unread buffers, and their donation with them.
@functools.partial(jax.jit, static_argnums=(7,), donate_argnums=(5, 6), keep_unused=True)
def _raw_chunked(q, k, v, table, lengths, out_buffer, lse_buffer, seq_q):
  """The raw custom call of the chunked variant (packed rows, partials of 0 splits), its out
  and lse written into the donated buffers' memory."""
  del out_buffer, lse_buffer  # donated: XLA writes the results into their memory
  variant = config.chunked_variant(str(q.dtype), q.shape[-1], v.shape[-1])
  b, hk, rows, _ = q.shape
  dv = v.shape[-1]
  results = (jax.ShapeDtypeStruct((b, hk, rows, dv), q.dtype),
             jax.ShapeDtypeStruct((b, hk, rows), jnp.float32),
             jax.ShapeDtypeStruct((b, 0, hk, rows, dv), jnp.float32),
             jax.ShapeDtypeStruct((b, 0, hk, rows), jnp.float32))
  if table is None:  # contiguous caches: a table of no column
    table = jnp.zeros((b, 0), jnp.int32)
  no_sink = jnp.zeros((hk, 0), jnp.float32)
  attributes = ffi.decode_attributes(variant, 0.1, seq_q, None, 0, None)
  return jax.ffi.ffi_call(config.DECODE_TARGET, results)(q, k, v, table, lengths, no_sink,
                                                         **attributes)[:2]


@pytest.mark.parametrize("page_size", [None, 16, 256], ids=["contiguous", "p16", "p256"])
def test_every_output_element_is_written(page_size):
  """The raw call (packed rows) into NaN-filled buffers that XLA reuses for its results:
  every row, those past the last full tile and those without a key included, is written."""
  b, seq_q, h, hk, d, capacity = 3, 161, 8, 2, 128, 700
  q, k, v = _inputs(16, b, seq_q, h, hk, d, d, capacity, "bfloat16")
  lengths = jnp.asarray([0, 100, 700], jnp.int32)
  table = None
  if page_size is not None:
    (k, table), (v, _) = _pool(k, page_size, 17), _pool(v, page_size, 17)
  packed = split_kv.pack_query(q, hk)
  rows = packed.shape[2]
  out_buffer = jnp.full((b, hk, rows, d), jnp.nan, q.dtype)
  lse_buffer = jnp.full((b, hk, rows), jnp.nan, jnp.float32)
  pointers = (out_buffer.unsafe_buffer_pointer(), lse_buffer.unsafe_buffer_pointer())
  out, lse = _raw_chunked(packed, k, v, table, lengths, out_buffer, lse_buffer, seq_q)
  assert (out.unsafe_buffer_pointer(), lse.unsafe_buffer_pointer()) == pointers, (
      "XLA did not write into the poisoned buffers: the test would miss unwritten elements")
  out, lse = split_kv.unpack(out, lse, seq_q)
  out32, lse32 = np.asarray(out, np.float32), np.asarray(lse)
  assert not np.isnan(out32).any() and not np.isnan(lse32).any()
  # Sequence 0 has no key; sequence 1's first 61 queries sit at negative positions.
  assert not out32[0].any() and np.all(lse32[0] == -np.inf)
  assert not out32[1, :61].any() and np.all(lse32[1, :, :61] == -np.inf)
  dense_k, dense_v = _inputs(16, b, seq_q, h, hk, d, d, capacity, "bfloat16")[1:]
  options = {"softmax_scale": 0.1}
  naive_out, naive_lse = _oracle(q, dense_k, dense_v, lengths, options,
                                 compute_dtype=np.dtype(q.dtype))
  with x64():
    up = lambda x: jnp.asarray(np.asarray(x, np.float64))
    want_out, want_lse = _oracle(up(q), up(dense_k), up(dense_v), lengths, options)
  assert_close_to_oracle(out, want_out, naive_out, name="out")
  assert_close_to_oracle(lse, want_lse, naive_lse, name="lse")


def test_cache_rows_past_the_length_are_never_used(chunked):
  """NaN in every cache row at or past a sequence's length (inside the last key block and the
  last 16-key box too) must not reach the output; page-table entries past the length point
  anywhere. Bitwise the same as the call over finite caches, and run to run (one CTA per
  tile, no split)."""
  q, k, v = _inputs(18, 3, 130, 8, 2, 128, 128, 300, "bfloat16")
  lengths = jnp.asarray([131, 145, 290], jnp.int32)
  past = jnp.arange(300)[None, :, None, None] >= lengths[:, None, None, None]
  k_nan, v_nan = (jnp.where(past, jnp.nan, x).astype(x.dtype) for x in (k, v))
  call = jax.jit(lambda *a: jaxflash.kv_cache_attention(*a, causal=False,
                                                        implementation="cute"))
  out = call(q, k_nan, v_nan, lengths)
  want = call(q, k, v, lengths)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
  np.testing.assert_array_equal(np.asarray(call(q, k, v, lengths)), np.asarray(want))
  for page_size in (16, 256):
    k_pool, table = _pool(k_nan, page_size, 19)
    v_pool, _ = _pool(v_nan, page_size, 19)
    # Entries of pages wholly past a sequence's length point anywhere: clamped, never read.
    past_pages = jnp.arange(table.shape[1])[None, :] * page_size >= lengths[:, None]
    table = jnp.where(past_pages, 10 ** 6, table)
    paged = jaxflash.kv_cache_attention(q, k_pool, v_pool, lengths, page_table=table,
                                        causal=False, implementation="cute")
    assert not np.isnan(np.asarray(paged, np.float32)).any()
  _check(q, k, v, lengths, {"causal": False}, page_size=16)
