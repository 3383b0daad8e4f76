"""The CuTe kernels' bias variants on a Hopper GPU against the float64 oracle: the forward
(public call and the raw custom call into poisoned buffers) and every gradient (dq, dk, dv,
dbias), for each broadcast shape of the bias, lengths that straddle tiles, seq_q != seq_k,
causal, softcap, segment ids, sinks, GQA 8:1, and 16-bit biases with bfloat16 inputs.

Run with JAXFLASH_CACHE_DIR pointing at prebuilt kernels (scripts/gpu_check.sh).
"""

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from jaxflash import block_ranges, config, ffi
from jaxflash.config import BWD_TARGET, FWD_TARGET, AttentionConfig, KernelVariant
from tests._bias_oracle import oracle_and_naive, reference_oracle_and_naive
from tests._cases import make_qkv, make_segments
from tests._oracle import assert_close_to_oracle

pytestmark = pytest.mark.gpu

BIAS_FWD = [v for v in config.shipped_variants(direction="fwd") if v.bias]
BIAS_BWD = [v for v in config.shipped_variants(direction="bwd") if v.bias]


@pytest.fixture(scope="module", autouse=True)
def _registered():
  for variant in BIAS_FWD + BIAS_BWD:
    ffi.ensure_variant(variant)  # fails with the build command if the cache lacks one


# name -> (dtype, head_dim, (batch, seq_q, seq_k, heads, kv_heads), bias shape as a string of
# dims "bhqk" (a capital: full), bias dtype, options)
CASES = {
    "bf16_d128_1x1_s1000": ("bfloat16", 128, (2, 1000, 1000, 4, 4), "11QK", "float32", {}),
    "bf16_d128_Bx1_s129_causal": ("bfloat16", 128, (3, 129, 129, 4, 2), "B1QK", "bfloat16",
                                  {"causal": True}),
    "f16_d128_1xH_q127_k1000_gqa8": ("float16", 128, (2, 127, 1000, 8, 1), "1HQK", "float16",
                                     {}),
    "bf16_d64_BxH_q1000_k127_causal": ("bfloat16", 64, (2, 1000, 127, 4, 4), "BHQK", "float32",
                                       {"causal": True}),
    "f16_d64_1x1_q1_k129": ("float16", 64, (3, 1, 129, 4, 2), "11QK", "float32", {}),
    "bf16_d64_BxH_s1_f16bias": ("bfloat16", 64, (2, 1, 1, 4, 4), "BHQK", "float16", {}),
    "bf16_d128_rows1_s4097_f16bias": ("bfloat16", 128, (1, 300, 4097, 2, 2), "BH1K", "float16",
                                      {}),
    "bf16_d64_1xH_softcap_window": ("bfloat16", 64, (2, 500, 700, 8, 1), "1HQK", "bfloat16",
                                    {"softcap": 2.0, "window_size": (200, 50)}),
    "f16_d128_segments_sink": ("float16", 128, (2, 700, 700, 4, 2), "B1QK", "float32",
                               {"segments": True, "sink": True}),
    "bf16_d128_neg_inf_rows": ("bfloat16", 128, (2, 257, 300, 4, 4), "BHQK", "bfloat16",
                               {"neg_inf": True, "causal": True}),
    # The soft-capped backward stores dbias from registers (the dS tile holds the softcap's
    # factor); keys 333 pad the bias rows to 336.
    "bf16_d128_BxH_softcap_causal_k333": ("bfloat16", 128, (2, 300, 333, 4, 2), "BHQK",
                                          "bfloat16", {"softcap": 3.0, "causal": True}),
    # One bias row per batch (every head and query): the tiles read row 0 of their plane.
    "f16_d64_Bx1_rows1_segments": ("float16", 64, (2, 200, 203, 4, 4), "B11K", "float16",
                                   {"segments": True}),
}


def case_inputs(name):
  dtype, d, (b, seq_q, seq_k, h, h_kv), dims, bias_dtype, options = CASES[name]
  seed = zlib.crc32(name.encode())
  q, k, v = make_qkv(seed, b, seq_q, seq_k, h, h_kv, d, dtype=jnp.dtype(dtype))
  rng = np.random.default_rng(seed + 1)
  shape = tuple(n if c.isupper() else 1 for c, n in zip(dims, (b, h, seq_q, seq_k)))
  bias = rng.standard_normal(shape) * 2.0
  if options.get("neg_inf"):  # a bias that masks: -inf on some keys, on every key of a row
    bias[..., ::3] = -np.inf
    bias[:, :, 5, :] = -np.inf
  bias = jnp.asarray(bias, jnp.dtype(bias_dtype))
  # Representable in the input dtype: the kernel's d_out is the cotangent cast to it.
  w_out = jnp.asarray(jnp.asarray(rng.standard_normal(q.shape), q.dtype), jnp.float32)
  w_lse = jnp.asarray(rng.standard_normal((b, h, seq_q)), jnp.float32)
  kwargs = {k_: v_ for k_, v_ in options.items() if k_ in ("causal", "softcap", "window_size")}
  if options.get("segments"):
    q_ids, kv_ids = make_segments(seed + 2, b, seq_q, seq_k)
    kwargs.update(q_segment_ids=q_ids, kv_segment_ids=kv_ids)
  if options.get("sink"):
    kwargs["learnable_sink"] = jnp.asarray(rng.normal(1.0, 2.0, h), jnp.float32)
  return q, k, v, bias, w_out, w_lse, kwargs


def _attend(kwargs):
  return lambda q, k, v, bias: jaxflash.attention(q, k, v, bias=bias, return_lse=True,
                                                  implementation="cute", **kwargs)


def _oracle_options(kwargs):
  """bias_attention's options for a case's jaxflash keyword arguments (no window or sink: the
  cases with them compare with the reference implementation instead)."""
  out = {k: v for k, v in kwargs.items() if k in ("causal", "softcap")}
  if "q_segment_ids" in kwargs:
    out["segment_ids"] = (kwargs["q_segment_ids"], kwargs["kv_segment_ids"])
  return out


def _grads(kwargs, w_out, w_lse):
  def loss(q, k, v, bias):
    out, lse = _attend(kwargs)(q, k, v, bias)
    lse_term = jnp.where(jnp.isfinite(lse), lse * w_lse, 0)
    return jnp.sum(out.astype(jnp.float32) * w_out) + jnp.sum(lse_term)
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))


@pytest.mark.parametrize("name", CASES, ids=CASES.keys())
def test_forward_and_gradients_match_float64_oracle(name):
  q, k, v, bias, w_out, w_lse, kwargs = case_inputs(name)
  dtype, d = CASES[name][0], CASES[name][1]
  cfg = AttentionConfig(softmax_scale=d ** -0.5, bias_dims=(True,) * 3,
                        causal=kwargs.get("causal", False))
  variant = KernelVariant.for_call("fwd", "sm90a", dtype, d, d, cfg, k.shape[1])
  attend = jax.jit(_attend(kwargs))
  assert variant.key in attend.lower(q, k, v, bias).as_text()
  grads = _grads(kwargs, w_out, w_lse)
  grad_text = grads.lower(q, k, v, bias).as_text()
  if "bwd" in config.BIAS_DIRECTIONS:
    bwd = KernelVariant.for_call("bwd", "sm90a", dtype, d, d, cfg)
    assert bwd.key in grad_text
  else:  # the forward kernel with the reference backward
    assert BWD_TARGET not in grad_text
  got = tuple(attend(q, k, v, bias)) + tuple(grads(q, k, v, bias))
  if "window_size" in kwargs or "learnable_sink" in kwargs:
    exact, naive = reference_oracle_and_naive(q, k, v, bias, w_out, w_lse, kwargs)
  else:
    exact, naive = oracle_and_naive(q, k, v, bias, w_out, w_lse, **_oracle_options(kwargs))
  for label, g, e, n in zip(("out", "lse", "dq", "dk", "dv", "dbias"), got, exact, naive):
    assert_close_to_oracle(g, e, n, name=label)
  assert got[-1].shape == bias.shape and got[-1].dtype == bias.dtype
  again = tuple(attend(q, k, v, bias)) + tuple(grads(q, k, v, bias))
  for label, a, b in zip(("out", "lse", "dq", "dk", "dv", "dbias"), got, again):
    if label in ("out", "lse", "dbias") or "bwd" not in config.BIAS_DIRECTIONS:
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=label)


# keep_unused: jit would otherwise drop the unread buffers, and their donation with them.
@functools.partial(jax.jit, static_argnames=("variant", "cfg"), donate_argnums=(4, 5),
                   keep_unused=True)
def _fwd_into(q, k, v, bias, out_buffer, lse_buffer, *, variant, cfg):
  del out_buffer, lse_buffer  # donated: XLA writes the results into their memory
  b, seq_q, h, _ = q.shape
  result = (jax.ShapeDtypeStruct((b, seq_q, h, variant.head_dim_v), q.dtype),
            jax.ShapeDtypeStruct((b, h, seq_q), jnp.float32))
  result += tuple(jax.ShapeDtypeStruct(shape, dt)
                  for _, shape, dt in config.fwd_scratch_shapes(variant))
  operands = block_ranges.forward_operands(variant, cfg, b, seq_q, k.shape[1], ())
  return jax.ffi.ffi_call(FWD_TARGET, result)(q, k, v, *operands, bias,
                                              **ffi.fwd_attributes(variant, cfg))[:2]


@pytest.mark.parametrize("variant", BIAS_FWD, ids=[v.key for v in BIAS_FWD])
@pytest.mark.parametrize("dims", ["11QK", "BHQK", "1H1K"])
def test_raw_forward_writes_every_element_of_poisoned_buffers(variant, dims):
  """The custom call of each bias variant into NaN-filled donated buffers (the same memory):
  every out and lse element is written, and matches the oracle; the bias is read with stride 0
  along its broadcast dims."""
  b, seq_q, seq_k, h = 2, 333, 261, 4
  dtype = jnp.dtype(variant.dtype)
  q, k, v = make_qkv(zlib.crc32(f"{variant.key}{dims}".encode()), b, seq_q, seq_k, h, 2,
                     variant.head_dim, dtype=dtype)
  shape = tuple(n if c.isupper() else 1 for c, n in zip(dims, (b, h, seq_q, seq_k)))
  bias = jnp.asarray(np.random.default_rng(5).standard_normal(shape), dtype)
  cfg = AttentionConfig(softmax_scale=variant.head_dim ** -0.5, causal=True,
                        implementation="cute", bias_dims=(True,) * 3)
  out_buffer = jnp.full((b, seq_q, h, variant.head_dim_v), jnp.nan, dtype)
  lse_buffer = jnp.full((b, h, seq_q), jnp.nan, jnp.float32)
  pointers = (out_buffer.unsafe_buffer_pointer(), lse_buffer.unsafe_buffer_pointer())
  row = config.bias_row_length(seq_k)  # the ABI's row: seqlen_k rounded up to 16 bytes
  padded = jnp.pad(bias, ((0, 0),) * 3 + ((0, row - seq_k),))
  out, lse = _fwd_into(q, k, v, padded, out_buffer, lse_buffer, variant=variant, cfg=cfg)
  assert (out.unsafe_buffer_pointer(), lse.unsafe_buffer_pointer()) == pointers, (
      "XLA did not write into the poisoned buffers: the test would miss unwritten elements")
  exact, naive = oracle_and_naive(q, k, v, bias, None, None, grads=False, causal=True)
  assert_close_to_oracle(out, exact[0], naive[0], name="out")
  assert_close_to_oracle(lse, exact[1], naive[1], name="lse")


# keep_unused: jit would otherwise drop the unread buffer, and its donation with it.
@functools.partial(jax.jit, static_argnames=("variant", "cfg"), donate_argnums=(8,),
                   keep_unused=True)
def _bwd_into(q, k, v, out, lse, d_out, d_lse, bias, dbias_buffer, *, variant, cfg):
  """The raw backward custom call of a bias variant, its dbias scratch in dbias_buffer's memory
  (donated); returns that scratch."""
  del dbias_buffer  # donated: XLA writes the scratch result into its memory
  b, seq_q, h, _ = q.shape
  seq_k, h_kv = k.shape[1], k.shape[2]
  result = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
            jax.ShapeDtypeStruct(v.shape, v.dtype))
  result += tuple(jax.ShapeDtypeStruct(shape, dt) for _, shape, dt in
                  config.bwd_scratch_shapes(variant, b, seq_q, h, seq_k))
  operands = block_ranges.backward_operands(variant, cfg, b, seq_q, seq_k, h, h_kv)
  return jax.ffi.ffi_call(BWD_TARGET, result)(q, k, v, out, lse, d_out, d_lse, *operands, bias,
                                              **ffi.bwd_attributes(variant, cfg))[-1]


@pytest.mark.parametrize("variant", BIAS_BWD, ids=[v.key for v in BIAS_BWD])
def test_raw_backward_writes_every_dbias_element_of_a_poisoned_buffer(variant):
  """The backward custom call of each bias variant with its dbias scratch in a NaN-filled
  donated buffer: under the causal mask the key tiles skip the query blocks above the diagonal,
  and every element inside seqlen_k is still written (the skipped blocks' zeros come from a
  producer warp); with a (B, H, S, S) bias the scratch is the bias's gradient, which matches
  the oracle. 333 keys: rows padded to 336, whose last 3 columns stay unwritten."""
  b, seq_q, seq_k, h, h_kv = 2, 333, 333, 4, 2
  dtype = jnp.dtype(variant.dtype)
  q, k, v = make_qkv(zlib.crc32(variant.key.encode()), b, seq_q, seq_k, h, h_kv,
                     variant.head_dim, dtype=dtype)
  rng = np.random.default_rng(7)
  bias = jnp.asarray(rng.standard_normal((b, h, seq_q, seq_k)), dtype)
  w_out = jnp.asarray(rng.standard_normal(q.shape), dtype)
  out, lse = jaxflash.attention(q, k, v, bias=bias, causal=True, return_lse=True,
                                implementation="cute")
  cfg = AttentionConfig(softmax_scale=variant.head_dim ** -0.5, causal=True,
                        implementation="cute", bias_dims=(True,) * 3)
  row = config.bias_row_length(seq_k)
  padded = jnp.pad(bias, ((0, 0),) * 3 + ((0, row - seq_k),))
  dbias_buffer = jnp.full((b, h, seq_q, row), jnp.nan, dtype)
  pointer = dbias_buffer.unsafe_buffer_pointer()
  got = _bwd_into(q, k, v, out, lse, w_out, jnp.zeros_like(lse), padded, dbias_buffer,
                  variant=variant, cfg=cfg)
  assert got.unsafe_buffer_pointer() == pointer, (
      "XLA did not write into the poisoned buffer: the test would miss unwritten elements")
  got = np.asarray(got[..., :seq_k], np.float64)
  assert np.isfinite(got).all(), f"{int((~np.isfinite(got)).sum())} unwritten dbias elements"
  above = np.triu(np.ones((seq_q, seq_k), bool), k=1)  # seq_q == seq_k: no key seen there
  assert (got[:, :, above] == 0).all()
  exact, naive = oracle_and_naive(q, k, v, bias, w_out, jnp.zeros_like(lse), causal=True)
  assert_close_to_oracle(got, exact[-1], naive[-1], name="dbias")


def test_nan_in_the_bias_gives_nan_where_the_reference_does():
  """A NaN bias element poisons its own row (out and lse), as in the reference, and no other."""
  q, k, v = make_qkv(21, 2, 300, 300, 4, 2, 128, dtype=jnp.bfloat16)
  bias = jnp.zeros((1, 4, 300, 300), jnp.bfloat16).at[0, 1, 7, 250].set(jnp.nan)
  got = jaxflash.attention(q, k, v, bias=bias, return_lse=True, implementation="cute")
  want = jaxflash.attention(q, k, v, bias=bias, return_lse=True, implementation="reference")
  for name, g, w in zip(("out", "lse"), got, want):
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    np.testing.assert_array_equal(np.isnan(g), np.isnan(w), err_msg=name)
    assert np.isnan(g).any(), name


def test_nan_in_one_head_s_bias_stays_out_of_other_kv_heads_gradients():
  """A NaN in head 2's bias (row 7) stays in the gradients of its kv head (1 of 2): the padding
  query rows of another head's last tile (300 queries: rows 300-319 of the 80-row tiles) read
  zeros past the head's bias plane, not the next head's rows, whose NaN would reach the P of
  those rows and through it dK and dV of kv head 0."""
  q, k, v = make_qkv(22, 2, 300, 300, 4, 2, 128, dtype=jnp.bfloat16)
  bias = jnp.zeros((1, 4, 300, 300), jnp.bfloat16).at[0, 2, 7, 250].set(jnp.nan)
  w_out = jnp.asarray(np.random.default_rng(8).standard_normal(q.shape), jnp.float32)

  def loss(q, k, v, bias):
    out = jaxflash.attention(q, k, v, bias=bias, implementation="cute")
    return jnp.sum(out.astype(jnp.float32) * w_out)

  dq, dk, dv, dbias = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, bias)
  for name, g in (("dq heads 0-1", dq[:, :, :2]), ("dk kv head 0", dk[:, :, 0]),
                  ("dv kv head 0", dv[:, :, 0]), ("dbias heads 0-1", dbias[:, :2])):
    assert np.isfinite(np.asarray(g, np.float32)).all(), name
  assert np.isnan(np.asarray(dk[:, :, 1], np.float32)).any()
