"""Chunked prefill on a CPU host: which kv_cache_attention calls take the chunked variant, the
custom call they lower to for CUDA (no partials, no num_splits needed to export), and the call
around the kernel computed elsewhere (decode_p's reference with 0 splits) against the reference
attention. The kernel itself runs on a GPU only (tests/test_gpu_chunked_prefill.py)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.export import DisabledSafetyCheck

import jaxflash
from jaxflash import config, split_kv
from jaxflash.decode_kernel import decode_attention
from tests.test_decode_kernel import check_against_reference

CHUNKED = config.chunked_variant("bfloat16", 128, 128)


@pytest.mark.parametrize("shape, expected", [
    # (batch, seq_q, heads, kv heads): rows = seq_q * heads / kv heads; tiles of 128 rows.
    ((16, 512, 32, 8), True),   # 16 * 8 * 16 tiles
    ((1, 4096, 32, 8), True),   # 8 * 128 tiles
    ((1, 512, 32, 8), True),    # 128 tiles >= 0.75 * 132
    ((1, 128, 32, 8), False),   # 32 tiles: the decode kernel's splits fill the SMs
    ((64, 31, 32, 8), False),   # 124 rows: less than one tile
    ((64, 32, 32, 8), True),    # 128 rows, 512 tiles
    ((200, 128, 8, 8), True),   # MHA: 128 rows, 1600 tiles
    ((200, 127, 8, 8), False),
])
def test_routing_by_rows_and_tiles(shape, expected):
  b, seq_q, h, hk = shape
  assert split_kv.use_chunked(b, seq_q, h, hk, "bfloat16", 128, 128, sms=132) == expected


@pytest.mark.parametrize("page_size, expected", [
    (None, True), (16, False), (64, False), (128, True), (256, True), (1024, True)])
def test_routing_takes_pools_whose_pages_hold_whole_key_blocks(page_size, expected):
  # Pages smaller than a 128-key block load in 16-key boxes, below the split-KV kernel's speed.
  assert split_kv.use_chunked(16, 512, 32, 8, "bfloat16", 128, 128, sms=132,
                              page_size=page_size) == expected


def test_routing_keeps_what_no_chunked_variant_covers_on_the_decode_kernel():
  big = (16, 512, 32, 8)
  assert split_kv.use_chunked(*big, "float16", 64, 64, sms=132)
  assert not split_kv.use_chunked(*big, "bfloat16", 256, 256, sms=132)
  assert not split_kv.use_chunked(*big, "bfloat16", 192, 128, sms=132)
  assert not split_kv.use_chunked(*big, "bfloat16", 128, 128, config.FP8_DTYPE, sms=132)
  assert not split_kv.use_chunked(*big, "float32", 128, 128, sms=132)
  assert config.chunked_support("bfloat16", 128, 128, config.FP8_DTYPE) == (
      False, "float8_e4m3fn caches run on the decode kernel")
  with pytest.raises(ValueError, match=r"\(256, 256\) has no chunked prefill schedule"):
    config.chunked_variant("bfloat16", 256, 256)


def _custom_calls(text):
  return [line for line in text.splitlines() if "stablehlo.custom_call" in line]


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
def test_a_long_chunk_lowers_to_the_chunked_variant_without_partials(paged):
  """Cross-lowered for CUDA on a CPU host with implementation='cute' and no num_splits (a
  chunked call runs no split, so nothing depends on this host's devices): one custom call of
  config.DECODE_TARGET naming the chunked variant, whose partial results have 0 splits."""
  b, seq_q, h, hk, d = 8, 512, 16, 4, 128  # rows 2048: 16 tiles per kv head, 512 tiles
  q = jax.ShapeDtypeStruct((b, seq_q, h, d), jnp.bfloat16)
  if paged:
    cache = jax.ShapeDtypeStruct((40, 256, hk, d), jnp.bfloat16)
    table = jax.ShapeDtypeStruct((b, 5), jnp.int32)
  else:
    cache, table = jax.ShapeDtypeStruct((b, 1280, hk, d), jnp.bfloat16), None
  lengths = jax.ShapeDtypeStruct((b,), jnp.int32)
  call = lambda q, k, v, n, t: jaxflash.kv_cache_attention(q, k, v, n, page_table=t,
                                                           implementation="cute")
  text = jax.jit(call).trace(q, cache, cache, lengths, table).lower(
      lowering_platforms=("cuda",)).as_text()
  calls = _custom_calls(text)
  assert len(calls) == 1 and f"@{config.DECODE_TARGET}(" in calls[0], calls
  assert f'variant = "{CHUNKED.key}"' in calls[0]
  rows = seq_q * h // hk
  assert re.search(rf"tensor<{b}x0x{hk}x{rows}x{d}xf32>, tensor<{b}x0x{hk}x{rows}xf32>\)",
                   calls[0]), calls[0]


def test_a_short_chunk_keeps_the_split_kernel_and_its_num_splits_rule():
  """Few rows per kv head: the split-KV variant, which needs num_splits to lower for a GPU
  elsewhere (its automatic count comes from the SM count)."""
  q = jax.ShapeDtypeStruct((2, 16, 16, 128), jnp.bfloat16)
  cache = jax.ShapeDtypeStruct((2, 1024, 4, 128), jnp.bfloat16)
  lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
  with pytest.raises(ValueError, match="num_splits: None"):
    jax.jit(lambda *a: jaxflash.kv_cache_attention(*a, implementation="cute")).trace(
        q, cache, cache, lengths).lower(lowering_platforms=("cuda",))
  text = jax.jit(lambda *a: jaxflash.kv_cache_attention(*a, num_splits=3,
                                                        implementation="cute")).trace(
      q, cache, cache, lengths).lower(lowering_platforms=("cuda",)).as_text()
  calls = _custom_calls(text)
  assert len(calls) == 1
  assert f'variant = "{config.decode_variant("bfloat16", 128, 128).key}"' in calls[0]
  assert "tensor<2x3x4x64x128xf32>" in calls[0]


def test_a_given_num_splits_keeps_a_long_chunk_on_the_split_kernel():
  """The rows and tiles of a chunked call, with num_splits given: the split-KV variant with
  that many splits (a given count is never ignored)."""
  b, seq_q, h, hk, d = 8, 512, 16, 4, 128
  q = jax.ShapeDtypeStruct((b, seq_q, h, d), jnp.bfloat16)
  cache = jax.ShapeDtypeStruct((b, 1280, hk, d), jnp.bfloat16)
  lengths = jax.ShapeDtypeStruct((b,), jnp.int32)
  assert split_kv.use_chunked(b, seq_q, h, hk, "bfloat16", d, d, sms=132)
  text = jax.jit(lambda *a: jaxflash.kv_cache_attention(*a, num_splits=2,
                                                        implementation="cute")).trace(
      q, cache, cache, lengths).lower(lowering_platforms=("cuda",)).as_text()
  calls = _custom_calls(text)
  assert len(calls) == 1
  assert f'variant = "{config.decode_variant("bfloat16", d, d).key}"' in calls[0]
  assert f"tensor<{b}x2x{hk}x{seq_q * h // hk}x{d}xf32>" in calls[0], calls[0]


def test_a_chunked_call_exports_from_a_host_without_a_gpu():
  """jax.export of a prefill chunk over a paged cache (update, then attention) for CUDA, with
  no num_splits: the chunked variant's call, serialized and read back."""
  b, chunk, h, hk, d, pages, page_size = 2, 1024, 8, 2, 128, 20, 256
  q = jax.ShapeDtypeStruct((b, chunk, h, d), jnp.bfloat16)
  new_kv = jax.ShapeDtypeStruct((b, chunk, hk, d), jnp.bfloat16)
  pool = jax.ShapeDtypeStruct((pages, page_size, hk, d), jnp.bfloat16)
  table = jax.ShapeDtypeStruct((b, 10), jnp.int32)
  lengths = jax.ShapeDtypeStruct((b,), jnp.int32)

  def step(q, new_k, new_v, k_pool, v_pool, page_table, lengths):
    k_pool, v_pool, lengths = jaxflash.update_kv_cache(k_pool, v_pool, new_k, new_v, lengths,
                                                       page_table=page_table)
    return jaxflash.kv_cache_attention(q, k_pool, v_pool, lengths, page_table=page_table,
                                       implementation="cute")

  exported = jax.export.export(
      jax.jit(step), platforms=("cuda",),
      disabled_checks=[DisabledSafetyCheck.custom_call(config.DECODE_TARGET)])(
          q, new_kv, new_kv, pool, pool, table, lengths)
  text = jax.export.deserialize(exported.serialize()).mlir_module()
  calls = [l for l in text.splitlines() if f"custom_call @{config.DECODE_TARGET}(" in l]
  assert len(calls) == 1 and CHUNKED.key in calls[0], calls


def test_chunked_variants_take_no_split_count():
  q = jnp.zeros((1, 2, 256, 128), jnp.bfloat16)
  k = jnp.zeros((4, 64, 2, 128), jnp.bfloat16)
  table, lengths = jnp.zeros((1, 4), jnp.int32), jnp.zeros((1,), jnp.int32)
  options = dict(variant=CHUNKED, softmax_scale=0.1, seqlen_q=64, window_left=None,
                 window_right=0, softcap=None)
  with pytest.raises(ValueError, match=r"num_splits: a chunked variant .* expected 0, got 3"):
    decode_attention(q, k, k, table, lengths, num_splits=3, **options)
  with pytest.raises(ValueError, match=r"num_splits: expected an int from 1 to 65535, got 0"):
    decode_attention(q, k, k, table, lengths, num_splits=0,
                     **dict(options, variant=config.decode_variant("bfloat16", 128, 128)))


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
@pytest.mark.parametrize("options", [dict(), dict(window_left=40, softcap=5.0),
                                     dict(window_right=None)],
                         ids=["causal", "window_softcap", "full"])
def test_the_chunked_call_elsewhere_is_the_reference_attention(paged, options):
  """Off CUDA, decode_p of a chunked variant computes its tiles in XLA (one split) and returns
  partials of 0 splits: kv_cache_attention's reference result over lengths 0, shorter than the
  chunk (queries at negative positions), inside and at the end of the cache, with sinks and
  GQA 4:1 (two 128-row tiles per kv head, the second partial)."""
  kw = dict(variant=config.chunked_variant("bfloat16", 64, 64), softmax_scale=0.125,
            seqlen_q=40, window_left=None, window_right=0, softcap=None, num_splits=0)
  kw.update(options)
  check_against_reference(np.random.default_rng(5), (4, 40, 4, 2, 64), 16, 6,
                          jnp.asarray([0, 25, 70, 96], jnp.int32), kw, paged)


def test_the_public_call_on_the_chunked_path_under_jit_and_vmap(monkeypatch):
  """kv_cache_attention(implementation="cute") routed to the chunked variant, computed on this
  host by decode_p's reference lowering: the reference implementation's result, under jit and
  under vmap over sequences with their own paged pool entries (folded into the batch)."""
  monkeypatch.setattr(split_kv, "use_chunked", lambda *args, **kwargs: True)
  rng = np.random.default_rng(9)
  b, seq_q, h, hk, d, page_size, pages = 3, 33, 8, 2, 64, 16, 4
  bf16 = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
  q = bf16(2, b, seq_q, h, d)
  pool_k, pool_v = bf16(2 * b * pages, page_size, hk, d), bf16(2 * b * pages, page_size, hk, d)
  tables = jnp.asarray(rng.permutation(2 * b * pages).reshape(2, b, pages), jnp.int32)
  lengths = jnp.asarray([[0, 20, 64], [33, 40, 50]], jnp.int32)

  def call(implementation):
    return lambda q, t, n: jaxflash.kv_cache_attention(q, pool_k, pool_v, n, page_table=t,
                                                       return_lse=True,
                                                       implementation=implementation)

  text = jax.jit(call("cute")).trace(q[0], tables[0], lengths[0]).lower(
      lowering_platforms=("cuda",)).as_text()
  assert config.chunked_variant("bfloat16", d, d).key in text
  got = jax.jit(jax.vmap(call("cute")))(q, tables, lengths)
  want = jax.vmap(call("reference"))(q, tables, lengths)
  np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32),
                             rtol=2e-2, atol=2e-2)
  np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-4, atol=1e-4)
  assert not np.asarray(got[0][0, 0], np.float32).any()  # length 0: zeros, lse -inf
  assert np.all(np.asarray(got[1][0, 0]) == -np.inf)
