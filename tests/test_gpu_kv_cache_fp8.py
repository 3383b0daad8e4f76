"""The split-KV decode kernel over float8_e4m3fn caches (jaxflash.kv_cache_attention with
descales, implementation="cute") on the GPU.

Each call is checked twice against float64 oracles: over the dequantized caches (what the
kernel must compute) with the 2x-naive rule, the naive result attending the dequantized caches
in the query dtype; and over the unquantized keys and values with the rule of the CPU tests
(twice the error of dequantizing in float32 and attending naively). Caches are quantized per
(page or sequence, kv head); rows past each length hold e4m3 NaN and the pool's unused pages
NaN data and NaN descales, which the kernel must never use. Lengths 0, 1, a page and a key
block +- 1, full; pages of 16, 64, 256 permuted in the pool; GQA 8:1 and MQA; seq_q 1 and 3;
windows, softcap and sinks.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from jaxflash import reference
from tests._cases import config_for, x64
from tests._oracle import assert_close_to_oracle, relative_l2
from tests.test_kv_cache import _oracle

pytestmark = pytest.mark.gpu

FP8 = jnp.float8_e4m3fn
FP8_NAN = np.uint8(0x7F)
E4M3_MAX = 448.0


def _quantize(x, lengths, page_size):
  """(e4m3 cache, float32 descales) of x (batch, capacity, kv heads, d): a descale per (page,
  kv head) (page_size None: per sequence), amax / 448 over the valid rows; rows at or past each
  length become e4m3 NaN. Returns the cache and descales in x's layout, pages per sequence:
  (batch, pages, page_size, kv heads, d) and (batch, pages, kv heads)."""
  b, capacity, h_kv, d = x.shape
  size = page_size or capacity
  pages = -(-capacity // size)
  valid = np.arange(pages * size)[None, :] < np.asarray(lengths)[:, None]  # (b, rows)
  x = np.pad(np.asarray(x, np.float32), ((0, 0), (0, pages * size - capacity), (0, 0), (0, 0)))
  x = np.where(valid[..., None, None], x, 0.0).reshape(b, pages, size, h_kv, d)
  amax = np.abs(x).max(axis=(2, 4))  # (b, pages, kv heads)
  descale = np.where(amax > 0, amax / E4M3_MAX, 1.0).astype(np.float32)
  bits = np.asarray(jnp.asarray(x / descale[:, :, None, :, None], FP8)).view(np.uint8)
  bits = np.where(valid.reshape(b, pages, size)[..., None, None], bits, FP8_NAN)
  return bits, descale


def _layout(bits, descale, page_size, seed, spare_pages=3):
  """The kernel's operands: contiguous caches (batch, capacity, kv heads, d) and (batch, kv
  heads) descales, or a permuted pool with spare pages of NaN data and NaN descales and its
  page table."""
  b, pages, size, h_kv, d = bits.shape
  if page_size is None:
    return (jnp.asarray(bits.reshape(b, size, h_kv, d).view(FP8)), jnp.asarray(descale[:, 0]),
            None)
  order = np.random.default_rng(seed).permutation(b * pages + spare_pages)
  table = order[:b * pages].reshape(b, pages)
  pool = np.full((b * pages + spare_pages, size, h_kv, d), FP8_NAN, np.uint8)
  pool[table.reshape(-1)] = bits.reshape(b * pages, size, h_kv, d)
  scales = np.full((b * pages + spare_pages, h_kv), np.nan, np.float32)
  scales[table.reshape(-1)] = descale.reshape(b * pages, h_kv)
  return jnp.asarray(pool.view(FP8)), jnp.asarray(scales), jnp.asarray(table, jnp.int32)


def _dequantized(bits, descale, capacity):
  """The caches the kernel must attend to, contiguous float64 (batch, capacity, kv heads, d)."""
  b, pages, size, h_kv, d = bits.shape
  x = bits.view(FP8).astype(np.float64) * descale[:, :, None, :, None]
  return x.reshape(b, pages * size, h_kv, d)[:, :capacity]


def _check(q, k, v, lengths, options, page_size, sink=None, seed=5, num_splits=None):
  """The kernel's (out, lse) against both oracles (module docstring)."""
  capacity = k.shape[1]
  k_bits, k_scale = _quantize(k, lengths, page_size)
  v_bits, v_scale = _quantize(v, lengths, page_size)
  kc, kd, table = _layout(k_bits, k_scale, page_size, seed)
  vc, vd, _ = _layout(v_bits, v_scale, page_size, seed)
  lengths = jnp.asarray(lengths, jnp.int32)
  out, lse = jax.jit(lambda *a: jaxflash.kv_cache_attention(
      *a, page_table=table, k_descale=kd, v_descale=vd, learnable_sink=sink, return_lse=True,
      num_splits=num_splits, implementation="cute", **options))(q, kc, vc, lengths)
  assert out.dtype == q.dtype
  k_deq, v_deq = (_dequantized(*x, capacity) for x in ((k_bits, k_scale), (v_bits, v_scale)))
  # Rows past the lengths dequantize to NaN: the oracles read only the valid ones.
  naive_out, naive_lse = _oracle(q, jnp.asarray(k_deq, q.dtype), jnp.asarray(v_deq, q.dtype),
                                 lengths, options, sink=sink, compute_dtype=q.dtype)
  with x64():
    up = lambda x: jnp.asarray(np.asarray(x, np.float64))
    up_sink = None if sink is None else up(sink)
    want_out, want_lse = _oracle(up(q), up(k_deq), up(v_deq), lengths, options, sink=up_sink)
    raw_out, raw_lse = _oracle(up(q), up(k), up(v), lengths, options, sink=up_sink)
  err = assert_close_to_oracle(out, want_out, naive_out, name="out")
  assert_close_to_oracle(lse, want_lse, naive_lse, name="lse")
  # Against the unquantized keys and values: as the CPU tests bound the reference, by
  # dequantizing in float32 and attending naively.
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  deq_out, deq_lse = _oracle(q, f32(k_deq), f32(v_deq), lengths, options, sink=sink,
                             compute_dtype=jnp.float32)
  assert_close_to_oracle(out, raw_out, deq_out, name="out vs unquantized")
  assert_close_to_oracle(lse, raw_lse, deq_lse, name="lse vs unquantized")
  assert relative_l2(out, raw_out) < 0.08
  return err


def _inputs(seed, b, seq_q, h, h_kv, d, capacity, dtype):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((b, seq_q, h, d)), dtype)
  # Keys and values of different magnitudes per kv head and along the sequence: descales
  # differ between heads and between the pages (and 16-key boxes) of one block.
  scale = np.geomspace(0.1, 30.0, h_kv)[None, None, :, None]
  along = np.geomspace(0.3, 3.0, capacity)[None, :, None, None]
  k = rng.standard_normal((b, capacity, h_kv, d)) * scale * along
  v = rng.standard_normal((b, capacity, h_kv, d)) * scale[..., ::-1, :] * along[:, ::-1]
  return q, k.astype(np.float32), v.astype(np.float32)


CASES = {  # name -> (dtype, batch, seq_q, heads, kv heads, d, capacity, lengths, options)
    "decode_gqa8_d128": ("bfloat16", 6, 1, 16, 2, 128, 1100, (0, 1, 127, 129, 1000, 1100),
                         {"causal": False}),
    "decode_mqa_d64_causal": ("float16", 4, 1, 8, 1, 64, 520, (1, 255, 257, 520), {}),
    "verify_3_d256_window_softcap": ("bfloat16", 3, 3, 4, 1, 256, 600, (0, 70, 600),
                                     {"window_size": (50, 0), "softcap": 20.0}),
    "decode_gqa4_d128_f16": ("float16", 3, 1, 8, 2, 128, 700, (63, 65, 700), {}),
}


@pytest.mark.parametrize("page_size", [None, 16, 64, 256], ids=["contiguous", "p16", "p64",
                                                               "p256"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_fp8_cache_kernel_matches_float64_oracles(case, page_size):
  dtype, b, seq_q, h, h_kv, d, capacity, lengths, options = case
  q, k, v = _inputs(1, b, seq_q, h, h_kv, d, capacity, dtype)
  _check(q, k, v, lengths, options, page_size)


@pytest.mark.parametrize("page_size", [None, 64], ids=["contiguous", "p64"])
def test_fp8_cache_kernel_over_a_long_cache_in_one_split(page_size):
  """One split of 160 key blocks per CTA: every ring stage is reused dozens of times, so a
  converting warp that arrives on a stage's barrier more or fewer times than counted puts the
  pipelines' phases apart within the call (the cases above hold at most 9 blocks)."""
  q, k, v = _inputs(3, 2, 1, 16, 2, 128, 20480, "bfloat16")
  _check(q, k, v, (20480, 19999), {"causal": False}, page_size, num_splits=1)


def test_fp8_cache_kernel_with_sinks_and_auto_mode():
  """Sinks join each row's denominator, with the automatic split count and with one split
  (whose tiles write out and lse themselves, v reference included: no merge); implementation=
  None takes the kernel (the result is bitwise the explicit kernel's) under jit."""
  q, k, v = _inputs(2, 4, 1, 8, 2, 128, 600, "bfloat16")
  sink = jnp.asarray(np.linspace(-1.0, 2.0, 8), jnp.float32)
  lengths = (0, 1, 300, 600)
  _check(q, k, v, lengths, {}, 64, sink=sink)
  _check(q, k, v, lengths, {}, 64, sink=sink, num_splits=1)
  k_bits, k_scale = _quantize(k, lengths, 64)
  v_bits, v_scale = _quantize(v, lengths, 64)
  kc, kd, table = _layout(k_bits, k_scale, 64, 5)
  vc, vd, _ = _layout(v_bits, v_scale, 64, 5)
  call = lambda impl: jax.jit(lambda *a: jaxflash.kv_cache_attention(
      *a, page_table=table, k_descale=kd, v_descale=vd, learnable_sink=sink,
      num_splits=3, implementation=impl))(q, kc, vc, jnp.asarray(lengths, jnp.int32))
  np.testing.assert_array_equal(np.asarray(call(None)), np.asarray(call("cute")))


def test_fp8_caches_written_by_update_kv_cache():
  """A pool filled by update_kv_cache in chunks (descales that grow, rows requantized), read
  by the kernel: as the reference reads it, within 2x the naive error of the dequantized
  caches."""
  rng = np.random.default_rng(4)
  b, h, h_kv, d, pages, page = 3, 8, 2, 128, 6, 64
  table = jnp.asarray(rng.permutation(b * pages + 2)[:b * pages].reshape(b, pages), jnp.int32)
  kc, vc = (jnp.zeros((b * pages + 2, page, h_kv, d), FP8) for _ in range(2))
  kd, vd = (jnp.zeros((b * pages + 2, h_kv), jnp.float32) for _ in range(2))
  lengths = jnp.zeros((b,), jnp.int32)
  update = jax.jit(lambda kc, vc, nk, nv, n, kd, vd: jaxflash.update_kv_cache(
      kc, vc, nk, nv, n, page_table=table, k_descale=kd, v_descale=vd),
      donate_argnums=(0, 1, 5, 6))
  for step, n in enumerate((37, 100, 1, 90)):
    grow = 1.0 + 3.0 * step  # later chunks are larger: the pages' descales grow
    nk, nv = (jnp.asarray(rng.standard_normal((b, n, h_kv, d)) * grow, jnp.bfloat16)
              for _ in range(2))
    kc, vc, lengths, kd, vd = update(kc, vc, nk, nv, lengths, kd, vd)
  q = jnp.asarray(rng.standard_normal((b, 1, h, d)), jnp.bfloat16)
  attend = lambda impl: jaxflash.kv_cache_attention(
      q, kc, vc, lengths, page_table=table, k_descale=kd, v_descale=vd, return_lse=True,
      implementation=impl)
  out, lse = attend("cute")
  cfg = config_for(d, {"causal": True})
  naive_out, naive_lse = reference.naive_kv_cache_attention(
      q, kc, vc, lengths, cfg, table, compute_dtype=jnp.bfloat16, descales=(kd, vd))
  with x64():
    want_out, want_lse = reference.naive_kv_cache_attention(
        q.astype(jnp.float64), kc, vc, lengths, cfg, table, compute_dtype=jnp.float64,
        descales=(kd.astype(jnp.float64), vd.astype(jnp.float64)))
  assert_close_to_oracle(out, want_out, naive_out, name="out")
  assert_close_to_oracle(lse, want_lse, naive_lse, name="lse")
