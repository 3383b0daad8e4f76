"""The decode kernel's call over float8_e4m3fn caches on a CPU host: the custom call it lowers
to for CUDA (descales as two more operands), its XLA lowering elsewhere (the caches
dequantized by page), vmap, the implementation choice of kv_cache_attention, and the errors.
The kernel itself runs on a GPU only (tests/test_gpu_kv_cache_fp8.py)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from jaxflash import config, split_kv
from jaxflash.decode_kernel import decode_attention
from tests.test_decode_kernel import _decode_calls

FP8 = jnp.float8_e4m3fn
VARIANT = config.decode_variant("bfloat16", 128, 128, kv_dtype=config.FP8_DTYPE)
VARIANT16 = config.decode_variant("float16", 128, 128, kv_dtype=config.FP8_DTYPE)
B, HK, GROUP, SEQ_Q, PAGES, PAGE, MAX_PAGES = 3, 2, 4, 1, 11, 16, 3
OPTIONS = dict(variant=VARIANT, softmax_scale=0.125, seqlen_q=SEQ_Q, window_left=None,
               window_right=0, softcap=None, num_splits=2)


def _operands(seed=0, paged=True, d=128):
  """q (packed), e4m3 caches (a pool of PAGES pages, or contiguous), float32 descales with a
  different value per page and kv head, the table (None: contiguous) and lengths."""
  rng = np.random.default_rng(seed)
  rows = B if not paged else PAGES
  cap = PAGE if paged else PAGE * MAX_PAGES
  q = jnp.asarray(rng.standard_normal((B, HK, SEQ_Q * GROUP, d)), jnp.bfloat16)
  k, v = (jnp.asarray(rng.standard_normal((rows, cap, HK, d)) * 50, FP8) for _ in range(2))
  kd, vd = (jnp.asarray(rng.uniform(0.01, 2.0, (rows, HK)), jnp.float32) for _ in range(2))
  table = (jnp.asarray(rng.permutation(PAGES)[:B * MAX_PAGES].reshape(B, MAX_PAGES), jnp.int32)
           if paged else None)
  lengths = jnp.asarray([0, 17, PAGE * MAX_PAGES], jnp.int32)
  return q, k, v, table, lengths, kd, vd


def _call(**changes):
  return lambda q, k, v, table, lengths, kd, vd, sink=None: decode_attention(
      q, k, v, table, lengths, sink, kd, vd, **dict(OPTIONS, **changes))


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
def test_cuda_lowering_passes_the_e4m3_caches_and_their_descales(paged):
  """One custom call to config.DECODE_TARGET for the -kve4m3 variant: operands q, the e4m3
  caches, page table, lengths, sink, then the (num_pages, num_kv_heads) float32 descales."""
  text = jax.jit(_call()).trace(*_operands(paged=paged)).lower(
      lowering_platforms=("cuda",)).as_text()
  calls = [line for line in text.splitlines() if "stablehlo.custom_call" in line]
  assert len(calls) == 1 and f"@{config.DECODE_TARGET}(" in calls[0], calls
  # A bfloat16 query runs the float16 variant (decode_kernel._bfloat16_over_fp8).
  assert f'variant = "{VARIANT16.key}"' in calls[0] and "-kve4m3-" in VARIANT16.key
  rows, cap = (PAGES, PAGE) if paged else (B, PAGE * MAX_PAGES)
  table = f"{B}x{MAX_PAGES}" if paged else f"{B}x0"
  assert re.search(
      rf"\(tensor<{B}x{HK}x4x128xf16>, tensor<{rows}x{cap}x{HK}x128xf8E4M3FN>, "
      rf"tensor<{rows}x{cap}x{HK}x128xf8E4M3FN>, tensor<{table}xi32>, tensor<{B}xi32>, "
      rf"tensor<{HK}x0xf32>, tensor<{rows}x{HK}xf32>, tensor<{rows}x{HK}xf32>\)", calls[0]), \
      calls[0]


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
def test_the_call_elsewhere_dequantizes_each_page_by_its_descales(paged):
  """Off CUDA, decode_p's XLA lowering: kv_cache_attention's reference over the same e4m3
  caches and descales (lengths 0, 17, full), with a sink."""
  q, k, v, table, lengths, kd, vd = _operands(3, paged)
  sink = jnp.asarray(np.linspace(-1, 1, HK * GROUP), jnp.float32)
  out, lse = split_kv.unpack(*jax.jit(_call())(q, k, v, table, lengths, kd, vd,
                                                sink.reshape(HK, GROUP)), SEQ_Q)
  query = jnp.moveaxis(q.reshape(B, HK, SEQ_Q, GROUP, 128), 2, 1).reshape(B, SEQ_Q, HK * GROUP,
                                                                          128)
  want, want_lse = jaxflash.kv_cache_attention(
      query, k, v, lengths, page_table=table, k_descale=kd, v_descale=vd, softmax_scale=0.125,
      learnable_sink=sink, return_lse=True, implementation="reference")
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32),
                             rtol=2e-2, atol=2e-2)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=1e-4, atol=1e-4)
  # The descales matter: without them the result is another one.
  ones = jnp.ones_like(kd)
  unscaled, _ = jax.jit(_call())(q, k, v, table, lengths, ones, ones)
  assert not np.allclose(np.asarray(unscaled[1:], np.float32),
                         np.asarray(jax.jit(_call())(q, k, v, table, lengths, kd, vd)[0][1:],
                                    np.float32), atol=1e-2)


def test_vmap_folds_contiguous_caches_with_their_descales_and_keeps_a_pool_whole():
  """Contiguous e4m3 caches mapped with their descales fold into one call; a pool and its
  descales shared by every element fold too; a mapped pool's descales run per element."""
  elements = [_operands(seed, paged=False) for seed in range(2)]
  stacked = [jnp.stack(x) if x[0] is not None else None for x in zip(*elements)]
  mapped = jax.vmap(_call(), in_axes=(0, 0, 0, None, 0, 0, 0))
  assert _decode_calls(jax.make_jaxpr(mapped)(*stacked).jaxpr) == ([2 * B], [])
  out, _ = jax.jit(mapped)(*stacked)
  for i, element in enumerate(elements):
    np.testing.assert_array_equal(np.asarray(out[i]), np.asarray(jax.jit(_call())(*element)[0]))
  q, k, v, table, lengths, kd, vd = _operands(1)
  shared = jax.vmap(_call(), in_axes=(0, None, None, 0, 0, None, None))
  args = (jnp.stack([q] * 2), k, v, jnp.stack([table] * 2), jnp.stack([lengths] * 2), kd, vd)
  assert _decode_calls(jax.make_jaxpr(shared)(*args).jaxpr) == ([2 * B], [])
  per_element = jax.vmap(_call(), in_axes=(None, None, None, None, None, 0, None))
  jaxpr = jax.make_jaxpr(per_element)(q, k, v, table, lengths, jnp.stack([kd] * 3), vd)
  assert _decode_calls(jaxpr.jaxpr) == ([B], [3])


def test_descales_the_variant_does_not_take_are_named():
  q, k, v, table, lengths, kd, vd = _operands()
  with pytest.raises(ValueError, match=re.escape(
      f"k_descale: expected float32 of shape ({PAGES}, {HK}) (num_pages, num_kv_heads) for the "
      f"float8_e4m3fn caches of {VARIANT.key}, got None")):
    _call()(q, k, v, table, lengths, None, vd)
  with pytest.raises(ValueError, match=re.escape(f"v_descale: expected float32 of shape "
                                                 f"({PAGES}, {HK})")):
    _call()(q, k, v, table, lengths, kd, vd[:, :1])
  with pytest.raises(TypeError, match="k_pool: dtype bfloat16 differs from the variant's "
                                      "float8_e4m3fn"):
    _call()(q, k.astype(jnp.bfloat16), v, table, lengths, kd, vd)
  plain = config.decode_variant("bfloat16", 128, 128)
  with pytest.raises(TypeError, match=f"k_descale / v_descale: variant {plain.key} reads "
                                      f"bfloat16 caches, which take no descales"):
    _call(variant=plain)(q, k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), table, lengths,
                         kd, vd)


def _fp8_call(d=128, **kwargs):
  q, k, v, table, lengths, kd, vd = _operands(d=d)
  query = q.reshape(B, SEQ_Q, HK * GROUP, d)
  return lambda: jaxflash.kv_cache_attention(query, k, v, lengths, page_table=table,
                                             k_descale=kd, v_descale=vd, **kwargs)


def test_kv_cache_attention_lowers_fp8_caches_to_the_kernel_for_a_gpu_elsewhere():
  """implementation='cute' with num_splits cross-lowers to the FP8 variant's custom call (a
  decoding step exported for a GPU); without num_splits it names the argument, as for 16-bit
  caches; head dims without an FP8 decode kernel are named."""
  text = jax.jit(_fp8_call(num_splits=4, implementation="cute")).trace().lower(
      lowering_platforms=("cuda",)).as_text()
  assert f'variant = "{VARIANT16.key}"' in text  # a bfloat16 query runs the float16 variant
  with pytest.raises(ValueError, match="num_splits: None .automatic. is chosen from the GPU's "
                                       "SM count"):
    _fp8_call(implementation="cute")()
  with pytest.raises(ValueError, match=re.escape(
      "implementation='cute': float8_e4m3fn caches have decode kernels for head_dim = "
      "head_dim_v in (64, 128, 256); got 96, 96")):
    _fp8_call(d=96, num_splits=4, implementation="cute")()


@pytest.mark.parametrize("q_scale, v_scale", [(1.0, 1.0), (1e6, 1.0), (1e-7, 1.0), (1.0, 1e3),
                                              (1.0, 1e-6)],
                         ids=["unit", "q_past_f16", "q_tiny", "v_past_f16", "v_tiny"])
def test_a_bfloat16_query_runs_the_float16_variant_scaled_by_powers_of_two(q_scale, v_scale):
  """decode_kernel's route for a bfloat16 query over e4m3 caches: a float16 query and output of the
  float16 variant, scaled by powers of two into float16's range (the call elsewhere rounds the
  query and the output to float16 as the kernel does): queries and values far past float16's
  largest or below its smallest normal value keep bfloat16's accuracy, and a page past every
  length with a huge v descale (1e20, never read) does not shrink the scale of the others."""
  q, k, v, table, lengths, kd, vd = _operands(3, True)
  query = (q.reshape(B, SEQ_Q, HK * GROUP, 128).astype(jnp.float32) * q_scale).astype(
      jnp.bfloat16)
  vd = vd * v_scale
  pages = np.asarray(table)  # lengths 0, 17, 48 read pages [1, :2] and [2, :]
  unread = np.setdiff1d(np.arange(PAGES), np.concatenate([pages[1, :2], pages[2]]))
  vd = vd.at[unread].set(1e20)
  kw = dict(page_table=table, k_descale=kd, v_descale=vd, softmax_scale=0.125 / q_scale,
            return_lse=True)
  text = jax.jit(lambda *a: jaxflash.kv_cache_attention(
      *a, implementation="cute", num_splits=2, **kw)).trace(query, k, v, lengths).lower(
          lowering_platforms=("cuda",)).as_text()
  assert f'variant = "{VARIANT16.key}"' in text and "f16>" in text
  out, lse = jax.jit(lambda *a: jaxflash.kv_cache_attention(
      *a, implementation="cute", num_splits=2, **kw))(query, k, v, lengths)
  want, want_lse = jaxflash.kv_cache_attention(query, k, v, lengths, implementation="reference",
                                               **kw)
  assert out.dtype == jnp.bfloat16
  out, want = np.asarray(out, np.float32), np.asarray(want, np.float32)
  assert np.isfinite(out).all()
  # bfloat16 rounding of the output: 2^-8 of the largest value.
  np.testing.assert_allclose(out, want, rtol=0, atol=np.abs(want).max() * 2.0**-7)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=1e-5, atol=1e-4)
