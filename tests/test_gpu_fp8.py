"""The FP8 forward kernels on a Hopper GPU against the float64 oracle of the dequantized inputs.

Each call's out error must be at most 2x that of the naive FP8 computation
(fp8.naive_fp8_attention: S of the e4m3 inputs, P rounded to e4m3, out rounded to the kernel's
bf16 or fp16). lse has its own bound (assert_lse_close): the e4m3 WGMMA sums a score's products with
fewer bits than float32. Outputs are poisoned: the raw FFI call writes into donated NaN-filled
buffers (checked to be the same memory).
Run with prebuilt kernels (scripts/gpu_check.sh).
"""

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from jaxflash import config, ffi, fp8, fp8_kernel, reference
from jaxflash.config import FWD_TARGET, AttentionConfig
from tests._cases import quantize_value_blocks_too, x64
from tests._oracle import assert_close_to_oracle

pytestmark = pytest.mark.gpu

FP8_VARIANTS = [v for v in config.shipped_variants() if v.dtype == config.FP8_DTYPE]
VARIANTS = [v for v in FP8_VARIANTS if not v.block_descales]  # per-head descales
BLOCK_VARIANTS = [v for v in FP8_VARIANTS if v.block_descales]
SHAPES = {  # name -> (batch, seq_q, seq_k, heads, kv_heads)
    "s1": (3, 1, 1, 4, 4),
    "s17_gqa8": (2, 17, 17, 8, 1),
    "q300_k200": (2, 300, 200, 4, 2),
    "q200_k300_mqa": (1, 200, 300, 4, 1),
    "s4097": (1, 4097, 4097, 2, 2),
    "q1000_k17": (1, 1000, 17, 4, 4),  # causal: the first 983 rows see no key
    # More tiles than SMs: a persistent variant's CTAs run several, each with its own descales.
    "tiles_gqa4": (3, 1100, 1100, 8, 2),
}


@pytest.fixture(scope="module", autouse=True)
def _registered():
  for variant in FP8_VARIANTS:
    ffi.ensure_variant(variant)  # fails with the build command if the cache lacks one


def _inputs(seed, shape, head_dim, block_size=None):
  """Fresh bf16 inputs quantized per (batch, kv head), or per block with block descales that
  differ: each (batch, head), or each block of 64 tokens of a head, is scaled by 2^u, u uniform
  in [-1, 0] for the query and [-1, 1] for key and value (value ratios down to 1/4), so the
  scores stay within twice those of N(0, 1) inputs and every tile has descales of its own."""
  b, seq_q, seq_k, h, hk = shape
  rng = np.random.default_rng(seed)

  def draw(seq, heads, low, high):
    x = rng.standard_normal((b, seq, heads, head_dim))
    if block_size is not None:
      x = x * np.repeat(np.exp2(rng.uniform(low, high, (b, -(-seq // 64), heads, 1))), 64,
                        axis=1)[:, :seq]
    else:
      x = x * np.exp2(rng.uniform(low, high, (b, 1, heads, 1)))
    return jnp.asarray(x, jnp.bfloat16)

  # With blocks the value is quantized per block of its own too: P carries the ratios.
  return quantize_value_blocks_too(draw(seq_q, h, -1, 0), draw(seq_k, hk, -1, 1),
                                   draw(seq_k, hk, -1, 1), block_size)


@functools.partial(jax.jit, static_argnames=("variant", "cfg"), donate_argnums=(5, 6),
                   keep_unused=True)
def _fwd_into(q8, k8, v8, q_chunks, kv_chunks, out_buffer, lse_buffer, *sink, variant, cfg):
  b, seq_q, h, d = q8.shape
  # The out buffer's dtype (bf16 or fp16) is the one the handler hands the kernel.
  result = (jax.ShapeDtypeStruct((b, seq_q, h, d), out_buffer.dtype),
            jax.ShapeDtypeStruct((b, h, seq_q), jnp.float32))
  del out_buffer, lse_buffer  # donated: XLA writes the results into their memory
  return jax.ffi.ffi_call(FWD_TARGET, result)(q8, k8, v8, q_chunks, kv_chunks, *sink,
                                              **ffi.fwd_attributes(variant, cfg))


def poisoned_fp8_fwd(q8, k8, v8, qd, kd, vd, variant, cfg, sink=None, block_size=None,
                     out_dtype=jnp.bfloat16):
  """The raw custom call (the kernel's descales, then the sink when given) into NaN-filled
  buffers; out in out_dtype (bfloat16 or float16)."""
  b, seq_q, h, d = q8.shape
  out_buffer = jnp.full((b, seq_q, h, d), jnp.nan, out_dtype)
  lse_buffer = jnp.full((b, h, seq_q), jnp.nan, jnp.float32)
  pointers = (out_buffer.unsafe_buffer_pointer(), lse_buffer.unsafe_buffer_pointer())
  descales = fp8_kernel.kernel_descales(qd, kd, vd, block_size, q8.shape, k8.shape, cfg.causal)
  out, lse = _fwd_into(q8, k8, v8, *descales, out_buffer, lse_buffer,
                       *(() if sink is None else (sink,)), variant=variant, cfg=cfg)
  assert (out.unsafe_buffer_pointer(), lse.unsafe_buffer_pointer()) == pointers, (
      "XLA did not write into the poisoned buffers: the test would miss unwritten elements")
  return out, lse


# The e4m3 WGMMA's float32 accumulator keeps fewer bits of a score's sum of products than a
# float32 sum: one-key calls, whose lse is q.k, miss by up to 1.6e-4 of the sum of |products|
# (docs/kernels.md, "FP8 forward"; a float32 sum: 5e-8). lse moves by at most its largest score
# error, so a row's lse may miss by 2^-12 (2.4e-4) of its largest sum of |products|.
SCORE_SUM_BITS = 12


def assert_lse_close(lse, want64, naive, deq, cfg):
  """Per row: |lse - oracle| <= 2 |naive - oracle| + 2^-SCORE_SUM_BITS * scale * max over
  visible keys of sum_i |q_i k_i| (dequantized), + 1e-6 |oracle|. Rows without keys (and a
  sink's rows) match the oracle's -inf exactly; NaN never passes."""
  a, e, n = (np.asarray(x, np.float64) for x in (lse, want64, naive))
  assert not np.isnan(a).any(), f"lse: {int(np.isnan(a).sum())} NaN entries"
  inf = ~np.isfinite(e)
  assert np.array_equal(a[inf], e[inf]), "lse: infinite oracle entries not matched"
  q, k = (np.abs(np.asarray(x, np.float64)) for x in deq[:2])
  group = q.shape[2] // k.shape[2]
  terms = np.matmul(q.transpose(0, 2, 1, 3),  # (b, h, seq_q, seq_k)
                    np.repeat(k, group, axis=2).transpose(0, 2, 3, 1)) * cfg.softmax_scale
  seq_q, seq_k = q.shape[1], k.shape[1]
  visible = np.asarray(reference.visible_mask(cfg, seq_q, seq_k, jnp.arange(seq_q),
                                              jnp.arange(seq_k)))
  largest = np.where(visible, terms, 0.0).max(axis=-1)  # (b, h, seq_q)
  finite = lambda x: np.where(inf, 0.0, x)  # rows without keys: matched above
  bound = finite(2 * np.abs(n - e) + 1e-6 * np.abs(e)) + 2.0 ** -SCORE_SUM_BITS * largest
  err = finite(np.abs(a - e))
  worst = np.unravel_index(np.argmax(err - bound), err.shape)
  assert (err <= bound).all(), (
      f"lse: {int((err > bound).sum())} rows over the bound; worst {worst}: error "
      f"{err[worst]:.3e} > bound {bound[worst]:.3e}")


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("variant", VARIANTS, ids=[v.key for v in VARIANTS])
def test_fp8_forward_matches_float64_oracle(variant, shape):
  _assert_matches_oracle(variant, *_inputs(zlib.crc32(f"{variant.key}{shape}".encode()), shape,
                                           variant.head_dim), None)


def _assert_matches_oracle(variant, q8, k8, v8, qd, kd, vd, block_size,
                           out_dtype=jnp.bfloat16):
  """The raw call against the oracle (2x the naive FP8 error; assert_lse_close), and the public
  path bitwise equal to it (the same kernel); returns (out, lse)."""
  cfg = AttentionConfig(softmax_scale=variant.head_dim ** -0.5, causal=variant.causal,
                        implementation="cute")
  raw_out, raw_lse = poisoned_fp8_fwd(q8, k8, v8, qd, kd, vd, variant, cfg,
                                      block_size=block_size, out_dtype=out_dtype)
  assert raw_out.dtype == out_dtype
  descales = fp8.check_descales(q8, k8, v8, qd, kd, vd)
  # Sequences within one block infer the kernel's smallest block: the same descales per token.
  assert descales.block_size == block_size or (
      block_size and descales.block_size == fp8.KERNEL_MIN_BLOCK and max(
          q8.shape[1], k8.shape[1]) <= fp8.KERNEL_MIN_BLOCK)
  naive_out, naive_lse = fp8.naive_fp8_attention(q8, k8, v8, descales, cfg)
  naive_out = naive_out.astype(out_dtype)  # round the naive out as the kernel rounds its own
  deq = fp8.dequantize_inputs(q8, k8, v8, qd, kd, vd, block_size)
  with x64():
    want_out, want_lse = (np.asarray(x) for x in reference.naive_attention(
        *(x.astype(jnp.float64) for x in deq), cfg.replace(implementation="reference")))
  assert_close_to_oracle(raw_out, want_out, naive_out, name="out")
  assert_lse_close(raw_lse, want_lse, naive_lse, deq, cfg)
  out, lse = jaxflash.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                                causal=variant.causal, out_dtype=out_dtype, return_lse=True,
                                implementation="cute")
  np.testing.assert_array_equal(out, raw_out)
  np.testing.assert_array_equal(lse, raw_lse)
  return raw_out, raw_lse


BLOCK_SHAPES = {k: SHAPES[k] for k in ("s17_gqa8", "q300_k200", "q200_k300_mqa", "q1000_k17")}


@pytest.mark.parametrize("block_size", [64, 128])
@pytest.mark.parametrize("shape", BLOCK_SHAPES.values(), ids=BLOCK_SHAPES.keys())
@pytest.mark.parametrize("variant", BLOCK_VARIANTS, ids=[v.key for v in BLOCK_VARIANTS])
def test_fp8_forward_with_block_descales_matches_float64_oracle(variant, shape, block_size):
  """Block descales that differ by up to 4x between blocks: each query row and key takes its
  block's descale, P carries each key's v descale / v max."""
  seed = zlib.crc32(f"block{variant.key}{shape}{block_size}".encode())
  _assert_matches_oracle(variant, *_inputs(seed, shape, variant.head_dim, block_size), block_size)


@pytest.mark.parametrize("variant", FP8_VARIANTS, ids=[v.key for v in FP8_VARIANTS])
def test_fp8_forward_writes_float16_out(variant):
  """out_dtype float16: the same kernel, its O converted to float16 (the naive error rounded to
  float16: a bound tighter than bf16's); each value within bf16's rounding of the bf16 call's
  (the bits are float16 of the same sums, not bf16 words read as float16), lse bit-equal."""
  block_size = 64 if variant.block_descales else None
  inputs = _inputs(zlib.crc32(f"f16{variant.key}".encode()), SHAPES["q300_k200"],
                   variant.head_dim, block_size)
  out16, lse16 = _assert_matches_oracle(variant, *inputs, block_size, out_dtype=jnp.float16)
  out_bf16, lse_bf16 = _assert_matches_oracle(variant, *inputs, block_size)
  np.testing.assert_array_equal(lse16, lse_bf16)
  a, b = np.asarray(out16, np.float32), np.asarray(out_bf16, np.float32)
  assert np.all(np.abs(a - b) <= 2.0 ** -8 * np.abs(a) + 2.0 ** -24), "fp16 and bf16 outs differ"
  nonzero = b != 0  # rows without keys are 0 in both
  assert np.mean(a[nonzero] != b[nonzero]) > 0.5, "float16 out has no more precision than bf16"


@pytest.mark.parametrize("variant", VARIANTS[:1], ids=[v.key for v in VARIANTS[:1]])
def test_handler_refuses_an_fp8_out_other_than_bfloat16_or_float16(variant):
  q8, k8, v8, qd, kd, vd = _inputs(5, SHAPES["s17_gqa8"], variant.head_dim)
  cfg = AttentionConfig(softmax_scale=variant.head_dim ** -0.5, causal=variant.causal,
                        implementation="cute")
  with pytest.raises(Exception, match="out has float32, expected bfloat16 or float16 for q of "
                                      "float8_e4m3fn"):
    jax.block_until_ready(poisoned_fp8_fwd(q8, k8, v8, qd, kd, vd, variant, cfg,
                                           out_dtype=jnp.float32))


@pytest.mark.parametrize("variant", VARIANTS[:2], ids=[v.key for v in VARIANTS[:2]])
def test_fp8_forward_is_bitwise_reproducible(variant):
  q8, k8, v8, qd, kd, vd = _inputs(7, (2, 700, 700, 4, 2), variant.head_dim)
  cfg = AttentionConfig(softmax_scale=variant.head_dim ** -0.5, causal=variant.causal,
                        implementation="cute")
  first = poisoned_fp8_fwd(q8, k8, v8, qd, kd, vd, variant, cfg)
  second = poisoned_fp8_fwd(q8, k8, v8, qd, kd, vd, variant, cfg)
  for a, b in zip(first, second):
    np.testing.assert_array_equal(a, b)


SINK_SHAPES = {"q300_k200_gqa": (2, 300, 200, 4, 2), "q1000_k17": (1, 1000, 17, 4, 4)}


@pytest.mark.parametrize("shape", SINK_SHAPES.values(), ids=SINK_SHAPES.keys())
@pytest.mark.parametrize("variant", VARIANTS, ids=[v.key for v in VARIANTS])
def test_fp8_forward_with_learnable_sink_matches_float64_oracle(variant, shape):
  """Head 0 has no sink (-inf, bit-equal to the call without one), head 1's sink (40)
  dominates every row, the rest N(1, 2); rows without keys output 0 with lse = their sink."""
  q8, k8, v8, qd, kd, vd = _inputs(zlib.crc32(f"sink{variant.key}{shape}".encode()), shape,
                                   variant.head_dim)
  h = shape[3]
  sink = jnp.asarray([-np.inf, 40.0, *np.random.default_rng(3).normal(1.0, 2.0, h - 2)],
                     jnp.float32)
  cfg = AttentionConfig(softmax_scale=variant.head_dim ** -0.5, causal=variant.causal,
                        implementation="cute")
  raw_out, raw_lse = poisoned_fp8_fwd(q8, k8, v8, qd, kd, vd, variant, cfg, sink)
  descales = fp8.check_descales(q8, k8, v8, qd, kd, vd)
  naive_out, naive_lse = fp8.naive_fp8_attention(q8, k8, v8, descales, cfg, sink)
  naive_out = naive_out.astype(jnp.bfloat16)
  deq = fp8.dequantize_inputs(q8, k8, v8, qd, kd, vd, None)
  with x64():
    want_out, want_lse = (np.asarray(x) for x in reference.naive_attention(
        *(x.astype(jnp.float64) for x in deq), cfg.replace(implementation="reference"),
        learnable_sink=sink.astype(jnp.float64)))
  assert_close_to_oracle(raw_out, want_out, naive_out, name="out")
  assert_lse_close(raw_lse, want_lse, naive_lse, deq, cfg)
  plain_out, plain_lse = poisoned_fp8_fwd(q8, k8, v8, qd, kd, vd, variant, cfg)
  np.testing.assert_array_equal(raw_out[:, :, 0], plain_out[:, :, 0])
  np.testing.assert_array_equal(raw_lse[:, 0], plain_lse[:, 0])
  no_key = np.isneginf(np.asarray(plain_lse))
  if no_key.any():
    assert not np.asarray(raw_out, np.float32)[np.moveaxis(no_key, 1, 2)].any()
    sinks = np.broadcast_to(np.asarray(sink)[None, :, None], no_key.shape)
    np.testing.assert_allclose(np.asarray(raw_lse)[no_key], sinks[no_key], rtol=1e-6)
  out, lse = jaxflash.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                                learnable_sink=sink, causal=variant.causal, return_lse=True,
                                implementation="cute")
  np.testing.assert_array_equal(out, raw_out)
  np.testing.assert_array_equal(lse, raw_lse)
