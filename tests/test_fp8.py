"""FP8 inputs (CPU): the quantizer, the descale layouts, the reference path and the errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from jaxflash import config, fp8, fp8_kernel, reference
from tests._cases import config_for, make_qkv, quantize_value_blocks_too, x64
from tests._oracle import assert_close_to_oracle

FP8 = jnp.float8_e4m3fn
SHAPES = {  # name -> (seq_q, seq_k, heads, kv_heads, head_dim)
    "gqa8_q_shorter": (37, 100, 8, 1, 64),
    "q_longer_straddling": (130, 70, 4, 2, 128),
    "length_one": (1, 1, 2, 2, 64),
}


def _inputs(seed, shape, dtype=jnp.bfloat16):
  seq_q, seq_k, h, hk, d = shape
  return make_qkv(seed, batch=2, seq_q=seq_q, seq_k=seq_k, heads=h, kv_heads=hk, head_dim=d,
                  dtype=dtype)


# ---------------------------------------------------------------------------------------------
# Quantizer

@pytest.mark.parametrize("block_size", [None, 16, 64])
def test_quantizer_layouts_and_scales_cover_each_groups_amax(block_size):
  q, k, v = _inputs(0, SHAPES["gqa8_q_shorter"])
  q8, k8, v8, qd, kd, vd = jaxflash.quantize_fp8(q, k, v, block_size=block_size)
  b, seq_q, h, _ = q.shape
  seq_k, hk = k.shape[1], k.shape[2]
  assert q8.dtype == k8.dtype == v8.dtype == FP8 and q8.shape == q.shape
  assert qd.dtype == kd.dtype == vd.dtype == jnp.float32
  if block_size is None:
    assert qd.shape == kd.shape == vd.shape == (b, hk)
  else:
    assert qd.shape == (b, h, -(-seq_q // block_size))
    assert kd.shape == vd.shape == (b, hk, -(-seq_k // block_size))
  group = h // hk
  for x, x8, d, g in ((q, q8, qd, group), (k, k8, kd, 1), (v, v8, vd, 1)):
    # Each group's largest |x8| is the largest e4m3 value: its scale covers its amax exactly.
    scale = fp8._expand(d, x.shape, block_size, g)
    amax_ratio = np.asarray(jnp.abs(x.astype(jnp.float32)) / scale)
    assert amax_ratio.max() <= fp8.FP8_MAX * (1 + 1e-6)
    deq = np.asarray(fp8.dequantize(x8, d, block_size, g))
    x32 = np.asarray(x, np.float32)
    # e4m3: 3 mantissa bits, so a relative error of at most 2^-4 above the subnormals.
    tiny = np.asarray(jnp.broadcast_to(scale, x.shape)) * 2.0 ** -9
    assert np.all(np.abs(deq - x32) <= np.abs(x32) * 2.0 ** -4 + tiny)
  per_group_max = np.abs(np.asarray(k8, np.float32)).max(axis=(1, 3))  # (b, hk) per head
  if block_size is None:
    np.testing.assert_array_equal(per_group_max, fp8.FP8_MAX)
  else:  # the value's blocks take its head's descale; quantize_tensor gives it blocks of its own
    v8_head, vd_head = fp8.quantize_tensor(v)  # = quantize_fp8's per-head value
    np.testing.assert_array_equal(v8, v8_head)
    np.testing.assert_array_equal(vd, jnp.broadcast_to(vd_head[:, :, None], vd.shape))
    v8_blocks, vd_blocks = fp8.quantize_tensor(v, block_size)
    assert vd_blocks.shape == vd.shape and not np.array_equal(vd_blocks, vd)
    np.testing.assert_allclose(np.asarray(vd_blocks).max(axis=2), vd_head, rtol=1e-6)
    deq = np.asarray(fp8.dequantize(v8_blocks, vd_blocks, block_size))
    x32 = np.asarray(v, np.float32)
    tiny = np.asarray(jnp.broadcast_to(fp8._expand(vd_blocks, v.shape, block_size, 1),
                                       v.shape)) * 2.0 ** -9
    assert np.all(np.abs(deq - x32) <= np.abs(x32) * 2.0 ** -4 + tiny)
  with pytest.raises(ValueError, match="block_size: expected None or a power of two from 16 "
                                       "to .*, got 100"):
    fp8.quantize_tensor(v, 100)


def test_an_all_zero_group_gets_descale_one():
  q, k, v = _inputs(1, (16, 40, 2, 2, 64))
  k = k.at[:, :16].set(0)
  _, k8, _, _, kd, _ = jaxflash.quantize_fp8(q, k, v, block_size=16)
  assert np.all(np.asarray(kd[:, :, 0]) == 1.0) and not np.asarray(k8[:, :16], np.float32).any()


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_hadamard_rotation_is_orthogonal_and_keeps_qk(head_dim):
  r = fp8.hadamard_rotation(head_dim, seed=3)
  np.testing.assert_allclose(r @ r.T, np.eye(head_dim), atol=1e-6)
  np.testing.assert_array_equal(r, fp8.hadamard_rotation(head_dim, seed=3))
  assert not np.array_equal(r, fp8.hadamard_rotation(head_dim, seed=4))
  rng = np.random.default_rng(0)
  q, k = rng.standard_normal((2, 50, head_dim)).astype(np.float32)
  scores = q @ k.T
  rotated = (q @ r) @ (k @ r).T
  np.testing.assert_allclose(rotated, scores, rtol=0, atol=1e-4 * np.abs(scores).max())


def test_hadamard_quantization_rotates_query_and_key_only():
  q, k, v = _inputs(2, (40, 40, 4, 2, 64), jnp.float32)
  r = fp8.hadamard_rotation(64, 7)
  q8, k8, v8, qd, kd, vd = jaxflash.quantize_fp8(q, k, v, block_size=16, hadamard=True, seed=7)
  deq_q = np.asarray(fp8.dequantize(q8, qd, 16, 2))
  np.testing.assert_allclose(deq_q, np.asarray(q) @ r, atol=0.07 * np.abs(deq_q).max())
  np.testing.assert_allclose(np.asarray(fp8.dequantize(v8, vd, 16)), np.asarray(v),
                             atol=0.07 * np.abs(np.asarray(v)).max())


def test_block_quantization_with_hadamard_shrinks_the_error_on_outliers():
  """FlashAttention-3's outlier inputs: the rotation spreads them, so the error drops."""
  rng = np.random.default_rng(0)

  def outliers():
    x = rng.standard_normal((1, 1024, 2, 128))
    return jnp.asarray(x + (rng.random(x.shape) < 1e-3) * rng.normal(0, 10, x.shape),
                       jnp.bfloat16)

  q, k, v = outliers(), outliers(), outliers()
  with x64():
    oracle = reference.naive_attention(*(x.astype(jnp.float64) for x in (q, k, v)),
                                       config_for(128, {}))[0]

  def rmse(**kwargs):
    q8, k8, v8, qd, kd, vd = jaxflash.quantize_fp8(q, k, v, **kwargs)
    out = jaxflash.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd)
    return float(np.sqrt(np.mean((np.asarray(out, np.float64) - np.asarray(oracle)) ** 2)))

  plain, rotated = rmse(block_size=128), rmse(block_size=128, hadamard=True)
  assert rotated < 0.75 * plain, (plain, rotated)  # 0.64 with these inputs


@pytest.mark.parametrize("kwargs,match", [
    ({"block_size": 100}, "block_size: expected None or a power of two from 16"),
    ({"block_size": 8}, "block_size: expected None or a power of two from 16"),
    ({"block_size": True}, "block_size"),
    ({"hadamard": 1}, "hadamard: expected a Python bool"),
    ({"seed": 1.5}, "seed: expected a Python int"),
])
def test_quantizer_rejects_bad_options(kwargs, match):
  q, k, v = _inputs(0, (8, 8, 2, 2, 64))
  with pytest.raises((TypeError, ValueError), match=match):
    jaxflash.quantize_fp8(q, k, v, **kwargs)


def test_quantizer_rejects_bad_tensors():
  q, k, v = _inputs(0, (8, 8, 2, 2, 96))
  with pytest.raises(ValueError, match="hadamard=True: head_dim must be a power of two, got 96"):
    jaxflash.quantize_fp8(q, k, v, hadamard=True)
  with pytest.raises(TypeError, match="query: dtype float8_e4m3fn not supported"):
    jaxflash.quantize_fp8(q.astype(FP8), k.astype(FP8), v.astype(FP8))
  with pytest.raises(ValueError, match="num_heads 2 must be a multiple of num_kv_heads 3"):
    jaxflash.quantize_fp8(q, jnp.concatenate([k, k[:, :, :1]], 2),
                          jnp.concatenate([v, v[:, :, :1]], 2))


def test_quantizer_jits_with_static_options():
  q, k, v = _inputs(3, (20, 24, 4, 2, 64))
  f = jax.jit(jaxflash.quantize_fp8, static_argnames=("block_size", "hadamard", "seed"))
  for got, want in zip(f(q, k, v, block_size=16, hadamard=True),
                       jaxflash.quantize_fp8(q, k, v, block_size=16, hadamard=True)):
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


# ---------------------------------------------------------------------------------------------
# Attention of FP8 inputs

@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("block_size", [None, 16])
@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float16])
def test_fp8_attention_matches_the_dequantized_oracle(shape, block_size, causal, out_dtype):
  q, k, v = _inputs(4, shape)
  q8, k8, v8, qd, kd, vd = quantize_value_blocks_too(q, k, v, block_size)
  deq = fp8.dequantize_inputs(q8, k8, v8, qd, kd, vd, block_size)
  out, lse = jaxflash.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                                causal=causal, out_dtype=out_dtype, return_lse=True)
  assert out.dtype == out_dtype and lse.dtype == jnp.float32
  cfg = config_for(shape[-1], {"causal": causal})
  with x64():
    want_out, want_lse = reference.naive_attention(*(x.astype(jnp.float64) for x in deq), cfg)
  naive_out, naive_lse = reference.naive_attention(*deq, cfg)  # float32, then the output cast
  assert_close_to_oracle(out, want_out, naive_out.astype(out_dtype), name="out")
  assert_close_to_oracle(lse, want_lse, naive_lse, name="lse")


def test_fp8_attention_without_descales_uses_one():
  q, k, v = (x.astype(FP8) for x in _inputs(5, (20, 30, 4, 2, 64)))
  ones = jnp.ones((2, 2), jnp.float32)
  np.testing.assert_array_equal(
      np.asarray(jaxflash.attention(q, k, v), np.float32),
      np.asarray(jaxflash.attention(q, k, v, q_descale=ones, k_descale=ones, v_descale=ones),
                 np.float32))


def test_fp8_attention_jits_vmaps_and_handles_empty_inputs():
  q, k, v = _inputs(6, (20, 30, 4, 2, 64))
  q8, k8, v8, qd, kd, vd = jaxflash.quantize_fp8(q, k, v, block_size=16)
  call = lambda *a: jaxflash.attention(*a[:3], q_descale=a[3], k_descale=a[4], v_descale=a[5])
  eager = call(q8, k8, v8, qd, kd, vd)
  np.testing.assert_array_equal(np.asarray(jax.jit(call)(q8, k8, v8, qd, kd, vd), np.float32),
                                np.asarray(eager, np.float32))
  mapped = jax.vmap(lambda *a: call(*(x[None] for x in a))[0])(q8, k8, v8, qd, kd, vd)
  np.testing.assert_allclose(np.asarray(mapped, np.float32), np.asarray(eager, np.float32),
                             rtol=1e-2, atol=1e-2)
  ones = jnp.ones((2, 2), jnp.float32)
  empty = jaxflash.attention(q8, k8[:, :0], v8[:, :0], q_descale=ones, k_descale=ones,
                             v_descale=ones)
  assert empty.dtype == jnp.bfloat16 and not np.asarray(empty, np.float32).any()


def test_differentiating_fp8_attention_raises_and_stop_gradient_does_not():
  q, k, v = _inputs(7, (16, 16, 2, 2, 64))
  q8, k8, v8, qd, kd, vd = jaxflash.quantize_fp8(q, k, v)

  def loss(q_descale, weight=1.0):
    out = jaxflash.attention(q8, k8, v8, q_descale=q_descale, k_descale=kd, v_descale=vd)
    return weight * jnp.sum(out.astype(jnp.float32))

  with pytest.raises(ValueError, match="differentiating through attention of float8_e4m3fn"):
    jax.grad(loss)(qd)
  grad_w = jax.grad(lambda w: loss(jax.lax.stop_gradient(qd), w))(2.0)
  np.testing.assert_allclose(grad_w, loss(qd), rtol=1e-6)


def _fp8_inputs(shape=(20, 30, 4, 2, 64)):
  q, k, v = _inputs(8, shape)
  return jaxflash.quantize_fp8(q, k, v)


@pytest.mark.parametrize("kwargs,match", [
    ({"window_size": (8, 0)}, "window_size: not supported with float8_e4m3fn inputs; FP8 "
                              "attention takes dense or causal masks"),
    ({"softcap": 5.0}, "softcap: not supported with float8_e4m3fn"),
    ({"q_segment_ids": jnp.zeros((2, 20), jnp.int32),
      "kv_segment_ids": jnp.zeros((2, 30), jnp.int32)}, "q_segment_ids/kv_segment_ids: not "
                                                        "supported"),
    ({"learnable_sink": jnp.zeros((3,), jnp.float32)}, "learnable_sink: expected shape"),
    ({"out_dtype": jnp.float32}, "out_dtype: expected one of \\('bfloat16', 'float16'\\) for "
                                 "float8_e4m3fn inputs, got float32"),
    ({"out_dtype": "nonsense"}, "out_dtype: expected a dtype"),
    ({"implementation": "cute"}, "implementation='cute': the FP8 kernel needs an NVIDIA "
                                 "Hopper GPU, but this computation is lowered for a platform "
                                 "other than cuda"),
])
def test_fp8_attention_rejects_what_it_does_not_support(kwargs, match):
  q8, k8, v8, qd, kd, vd = _fp8_inputs()
  with pytest.raises((TypeError, ValueError), match=match):
    jaxflash.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, **kwargs)


def test_fp8_attention_takes_head_dim_64_128_256_only():
  q, k, v = _inputs(9, (8, 8, 2, 2, 96))
  with pytest.raises(ValueError, match="FP8 attention takes head_dim \\(64, 128, 256\\) with "
                                       "head_dim_v equal to it; got head_dim 96"):
    jaxflash.attention(q.astype(FP8), k.astype(FP8), v.astype(FP8))
  q, k, v = _inputs(9, (8, 8, 2, 2, 64))
  with pytest.raises(ValueError, match="got head_dim 64, head_dim_v 128"):
    jaxflash.attention(q.astype(FP8), k.astype(FP8),
                       jnp.concatenate([v, v], -1).astype(FP8))


def test_descales_are_checked():
  q8, k8, v8, qd, kd, vd = _fp8_inputs()
  call = lambda qd, kd, vd: jaxflash.attention(q8, k8, v8, q_descale=qd, k_descale=kd,
                                               v_descale=vd)
  ones = lambda *shape: jnp.ones(shape, jnp.float32)
  with pytest.raises(ValueError, match="k_descale, v_descale: pass all three descales or none"):
    call(qd, None, None)
  with pytest.raises(TypeError, match="k_descale: expected dtype float32, got bfloat16"):
    call(qd, kd.astype(jnp.bfloat16), vd)
  with pytest.raises(TypeError, match="v_descale: expected a float32 array, got float"):
    call(qd, kd, 1.0)
  with pytest.raises(ValueError, match="per-head descales must be \\(batch, num_kv_heads\\) = "
                                       "\\(2, 2\\)"):
    call(ones(2, 4), kd, vd)
  with pytest.raises(ValueError, match="expected all per head .* or all per block"):
    call(ones(2, 4, 2), kd, vd)
  # Block counts that no single power-of-two block gives for seq_q 20 and seq_k 30.
  with pytest.raises(ValueError, match="per-block descales must be q_descale .* for seq_q 20, "
                                       "seq_k 30"):
    call(ones(2, 4, 2), ones(2, 2, 1), ones(2, 2, 1))
  assert fp8.check_descales(q8, k8, v8, ones(2, 4, 2), ones(2, 2, 2),
                            ones(2, 2, 2)).block_size == 16


@pytest.mark.parametrize("block_size", [16, 64, 128])
def test_one_block_per_sequence_runs_blocks_the_kernel_takes(block_size):
  """Sequences of at most 32 tokens hold one block of 32 or more whatever its size: the
  descales mean one per head, and the call takes blocks of 64 (the kernel's smallest), never
  the reference's 32."""
  q, k, v = _inputs(12, (17, 30, 4, 2, 64))
  q8, k8, v8, qd, kd, vd = jaxflash.quantize_fp8(q, k, v, block_size=block_size)
  if block_size == 16:  # 2 blocks each: the size is known
    assert fp8.check_descales(q8, k8, v8, qd, kd, vd).block_size == 16
    return
  assert fp8.check_descales(q8, k8, v8, qd, kd, vd).block_size == fp8.KERNEL_MIN_BLOCK
  q_chunks, kv = fp8_kernel.kernel_descales(qd, kd, vd, fp8.KERNEL_MIN_BLOCK, q8.shape,
                                            k8.shape, False)
  want_q, want_kv = fp8_kernel.kernel_descales(qd, kd, vd, block_size, q8.shape, k8.shape,
                                               False)
  np.testing.assert_array_equal(q_chunks, want_q)
  np.testing.assert_array_equal(kv, want_kv)


@pytest.mark.parametrize("name", ["q_descale", "k_descale", "v_descale", "out_dtype"])
def test_fp8_arguments_are_refused_for_other_dtypes(name):
  q, k, v = _inputs(10, (8, 8, 2, 2, 64))
  value = jnp.bfloat16 if name == "out_dtype" else jnp.ones((2, 2), jnp.float32)
  with pytest.raises(TypeError, match=f"{name}: applies to float8_e4m3fn inputs only; these "
                                      f"are bfloat16"):
    jaxflash.attention(q, k, v, **{name: value})


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("block_size", [None, 16])
@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
def test_naive_fp8_attention_rounds_only_p_beyond_the_dequantized_inputs(shape, block_size,
                                                                          causal):
  """The FP8-kernel oracle: the dequantized attention but for P rounded to e4m3 (scaled by
  P_SCALE); its lse comes from the unrounded P."""
  q, k, v = _inputs(11, shape)
  q8, k8, v8, qd, kd, vd = quantize_value_blocks_too(q, k, v, block_size)
  descales = fp8.check_descales(q8, k8, v8, qd, kd, vd)
  cfg = config_for(shape[-1], {"causal": causal})
  out, lse = fp8.naive_fp8_attention(q8, k8, v8, descales, cfg)
  deq = fp8.dequantize_inputs(q8, k8, v8, qd, kd, vd, block_size)
  with x64():
    want_out, want_lse = reference.naive_attention(*(x.astype(jnp.float64) for x in deq), cfg)
  want_out, out = np.asarray(want_out), np.asarray(out, np.float64)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=1e-5, atol=1e-5)
  err = np.linalg.norm(out - want_out) / np.linalg.norm(want_out)
  if shape[1] == 1:  # one key: P = 1 exactly, nothing to round
    assert err < 1e-6
  else:
    assert 0 < err < 2.0 ** -4  # e4m3's relative rounding, averaged over each row


@pytest.mark.parametrize("block_size", [16, 32])
def test_the_fp8_kernel_takes_blocks_of_64_tokens_or_more(block_size):
  q, k, v = _inputs(10, (70, 90, 4, 2, 64))  # more than one block: the size is known
  q8, k8, v8, qd, kd, vd = jaxflash.quantize_fp8(q, k, v, block_size=block_size)
  with pytest.raises(ValueError, match=f"the FP8 kernel takes per-head descales .* or blocks of "
                                       f"64 tokens or more; this call has blocks of "
                                       f"{block_size}; use implementation=None"):
    jaxflash.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                       implementation="cute")


@pytest.mark.parametrize("block_size", [None, 64, 128, 512])
@pytest.mark.parametrize("head_dim", config.FP8_HEAD_DIMS)
def test_kernel_descales_give_each_token_its_descale(block_size, head_dim):
  """The kernel's per-64-token descales dequantize every token as the caller's do; the value
  ratios are at most 1 and their log2 and inverse agree."""
  q, k, v = _inputs(13, (300, 200, 8, 2, head_dim))
  scale = jnp.exp2(jnp.arange(300) // 64 % 5 - 2.0)[None, :, None, None]  # blocks differ
  q8, k8, v8, qd, kd, vd = quantize_value_blocks_too(q * scale, k * scale[:, :200],
                                                     v * scale[:, :200], block_size)
  q_chunks, kv = fp8_kernel.kernel_descales(qd, kd, vd, block_size, q8.shape, k8.shape, False)
  schedule = config.fp8_fwd_schedule(head_dim, False, block_size is not None)
  assert q_chunks.shape == (2, 8, config.fp8_descale_chunks(300, schedule.tile_m))
  assert kv.shape == (2, 2, config.fp8_descale_chunks(200, schedule.tile_n), 4)
  got = fp8_kernel._dequantized(q8, k8, v8, q_chunks, kv)
  want = fp8.dequantize_inputs(q8, k8, v8, qd, kd, vd, block_size)
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6)
  ratio = np.exp2(np.asarray(kv[..., 1]))
  assert (ratio <= 1).all() and np.allclose(ratio * np.asarray(kv[..., 2]), 1.0, rtol=1e-5)
  assert (np.asarray(kv[..., 3]) == np.asarray(kv[..., 3:4, 3])).all()  # one v max per head
  # v max is the largest v descale the caller gave (padding chunks add none), so the largest
  # ratio is 1: P keeps e4m3's full range where the values are largest.
  v_max = np.max(np.asarray(vd).reshape(2, 2, -1), axis=-1)
  np.testing.assert_array_equal(np.asarray(kv[:, :, 0, 3]), v_max)
  np.testing.assert_allclose(ratio.max(axis=2), 1.0, rtol=1e-6)
  # Chunks past the sequence (masked keys and rows) still hold positive, finite descales.
  for x in (q_chunks, kv[..., 0], kv[..., 2], kv[..., 3]):
    assert np.isfinite(np.asarray(x)).all() and (np.asarray(x) > 0).all()


@pytest.mark.parametrize("block_size", [None, 64, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
def test_fp8_kernel_primitive_off_gpu_is_the_dequantized_attention(block_size, causal):
  """The FP8 kernel primitive's reference lowering (GQA, seq_q != seq_k, block descales that
  differ from block to block) is the attention of the dequantized inputs."""
  q, k, v = _inputs(14, (150, 250, 4, 2, 64))
  scale = jnp.exp2(jnp.arange(250) // 64 % 3 - 1.0)[None, :, None, None]
  q8, k8, v8, qd, kd, vd = quantize_value_blocks_too(q * scale[:, :150], k * scale, v / scale,
                                                     block_size)
  cfg = config.AttentionConfig(softmax_scale=0.125, causal=causal, implementation="reference")
  out, lse = jax.jit(lambda *a: fp8_kernel.fp8_forward(cfg, *a, block_size=block_size))(
      q8, k8, v8, qd, kd, vd)
  deq = fp8.dequantize_inputs(q8, k8, v8, qd, kd, vd, block_size)
  want_out, want_lse = jaxflash.attention(*deq, softmax_scale=0.125, causal=causal,
                                          return_lse=True, implementation="reference")
  np.testing.assert_allclose(np.asarray(out, np.float32),
                             np.asarray(want_out.astype(jnp.bfloat16), np.float32),
                             rtol=2e-2, atol=2e-2)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("causal,out_dtype", [(False, None), (True, None),
                                              (False, jnp.float16)])
def test_fp8_kernel_call_lowers_to_the_forward_custom_call_with_the_descales(causal, out_dtype):
  """On CUDA the FP8 kernel is the forward custom call of an e4m3 variant: q8, k8, v8, then
  q_descale (batch, num_heads, query chunks of 64) and kv_descale (batch, num_kv_heads, key
  chunks, 4) float32 over the variant's 128-row and 224-key tiles; bfloat16 out (float16 when
  asked: the same variant, the out buffer's dtype tells the kernel), float32 lse."""
  q8, k8, v8, qd, kd, vd = _fp8_inputs((20, 30, 4, 2, 128))
  f = jax.jit(lambda *a: jaxflash.attention(*a[:3], q_descale=a[3], k_descale=a[4],
                                            v_descale=a[5], causal=causal, return_lse=True,
                                            out_dtype=out_dtype, implementation="cute"))
  text = f.trace(q8, k8, v8, qd, kd, vd).lower(lowering_platforms=("cuda",)).as_text()
  call = next(line for line in text.splitlines() if "custom_call @jaxflash_attention_fwd" in line)
  variant = config.fp8_fwd_variant(128, causal).key
  assert f'variant = "{variant}"' in call and f"causal = {str(causal).lower()}" in call
  # The descales after q, k, v: 2 chunks cover a 128-row tile, 4 a 224-key tile.
  assert "tensor<2x4x2xf32>, tensor<2x2x4x4xf32>)" in call
  out_type = "f16" if out_dtype == jnp.float16 else "bf16"
  assert f"-> (tensor<2x20x4x128x{out_type}>, tensor<2x4x20xf32>)" in call


def test_vmap_of_the_fp8_kernel_folds_the_mapped_axis_into_the_batch():
  q8, k8, v8, qd, kd, vd = _fp8_inputs((20, 30, 4, 2, 64))
  cfg = config.AttentionConfig(softmax_scale=0.125, implementation="cute")
  stack = lambda x: jnp.stack([x, x, x])
  out, lse = jax.eval_shape(jax.vmap(lambda *a: fp8_kernel.fp8_forward(cfg, *a)),
                            *(stack(x) for x in (q8, k8, v8, qd, kd, vd)))
  assert (out.shape, out.dtype) == ((3, 2, 20, 4, 64), jnp.bfloat16)
  assert (lse.shape, lse.dtype) == ((3, 2, 4, 20), jnp.float32)
  text = jax.jit(jax.vmap(lambda *a: fp8_kernel.fp8_forward(cfg, *a),
                          in_axes=(0, 0, 0, None, None, None))).trace(
      stack(q8), stack(k8), stack(v8), qd, kd, vd).lower(
      lowering_platforms=("cuda",)).as_text()
  call = next(line for line in text.splitlines() if "custom_call @jaxflash_attention_fwd" in line)
  # head_dim 64: 192-row and 128-key tiles, so 3 query chunks and 2 key chunks.
  assert "tensor<6x20x4x64xf8E4M3FN>" in call and "tensor<6x4x3xf32>, tensor<6x2x2x4xf32>" in call


@pytest.mark.parametrize("causal", [False, True])
def test_fp8_learnable_sink_is_the_dequantized_attention_with_the_sink(causal):
  """The reference FP8 path with a sink is the dequantized call with it; rows that see no key
  output zeros and have lse = their sink."""
  q8, k8, v8, qd, kd, vd = _fp8_inputs((40, 20, 4, 2, 64))  # causal: 20 rows see no key
  sink = jnp.asarray([0.5, -1.0, 3.0, -jnp.inf], jnp.float32)
  out, lse = jaxflash.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                                learnable_sink=sink, causal=causal, return_lse=True)
  q, k, v = fp8.dequantize_inputs(q8, k8, v8, qd, kd, vd, None)
  want_out, want_lse = jaxflash.attention(q, k, v, learnable_sink=sink, causal=causal,
                                          return_lse=True, implementation="reference")
  np.testing.assert_array_equal(out, want_out.astype(jnp.bfloat16))
  np.testing.assert_array_equal(lse, want_lse)
  if causal:
    assert not np.asarray(out[:, :20], np.float32).any()
    np.testing.assert_array_equal(np.asarray(lse)[:, :, :20],
                                  np.broadcast_to(np.asarray(sink)[None, :, None], (2, 4, 20)))


@pytest.mark.parametrize("causal", [False, True])
def test_naive_fp8_attention_takes_the_sink_in_the_row_sums(causal):
  q, k, v = _inputs(12, (40, 20, 4, 2, 64))
  q8, k8, v8, qd, kd, vd = jaxflash.quantize_fp8(q, k, v)
  sink = jnp.asarray([0.5, -1.0, 30.0, -jnp.inf], jnp.float32)
  cfg = config_for(64, {"causal": causal})
  out, lse = fp8.naive_fp8_attention(q8, k8, v8, fp8.check_descales(q8, k8, v8, qd, kd, vd), cfg,
                                     sink)
  deq = fp8.dequantize_inputs(q8, k8, v8, qd, kd, vd, None)
  with x64():
    want_out, want_lse = reference.naive_attention(*(x.astype(jnp.float64) for x in deq), cfg,
                                                   learnable_sink=sink.astype(jnp.float64))
  np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=1e-5, atol=1e-5)
  want_out, out = np.asarray(want_out), np.asarray(out, np.float64)
  assert np.linalg.norm(out - want_out) <= 2.0 ** -4 * np.linalg.norm(want_out)
  # Head 2's sink dominates: its rows keep almost nothing of the values.
  assert np.abs(out[:, :, 2]).max() < 1e-6 * np.abs(out[:, :, 0]).max() + 1e-12


def test_fp8_kernel_call_takes_the_sink_after_the_descales():
  q8, k8, v8, qd, kd, vd = _fp8_inputs((20, 30, 4, 2, 128))
  sink = jnp.zeros((4,), jnp.float32)
  f = jax.jit(lambda *a: jaxflash.attention(*a[:3], q_descale=a[3], k_descale=a[4],
                                            v_descale=a[5], learnable_sink=a[6],
                                            implementation="cute"))
  text = f.trace(q8, k8, v8, qd, kd, vd, sink).lower(lowering_platforms=("cuda",)).as_text()
  call = next(line for line in text.splitlines() if "custom_call @jaxflash_attention_fwd" in line)
  assert "tensor<2x2x4x4xf32>, tensor<4xf32>) ->" in call


@pytest.mark.parametrize("sink_axis", [None, 0])
def test_vmap_of_the_fp8_kernel_keeps_an_unmapped_sink_in_the_kernel(sink_axis):
  """One sink for every mapped element stays the kernel's operand; a sink per element runs the
  kernel without it and rescales the rows in XLA."""
  q8, k8, v8, qd, kd, vd = _fp8_inputs((20, 30, 4, 2, 64))
  cfg = config.AttentionConfig(softmax_scale=0.125, implementation="cute", has_sink=True)
  stack = lambda x: jnp.stack([x, x, x])
  sink = jnp.zeros((4,), jnp.float32)
  sink = sink if sink_axis is None else stack(sink)
  f = jax.jit(jax.vmap(lambda *a: fp8_kernel.fp8_forward(cfg, *a),
                       in_axes=(0, 0, 0, None, None, None, sink_axis)))
  args = (stack(q8), stack(k8), stack(v8), qd, kd, vd, sink)
  out, lse = jax.eval_shape(f, *args)
  assert (out.shape, out.dtype, lse.shape) == ((3, 2, 20, 4, 64), jnp.bfloat16, (3, 2, 4, 20))
  text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  call = next(line for line in text.splitlines() if "custom_call @jaxflash_attention_fwd" in line)
  assert ("tensor<4xf32>) ->" in call) == (sink_axis is None)
