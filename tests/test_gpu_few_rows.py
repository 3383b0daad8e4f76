"""Attention calls with few query rows on the GPU (jaxflash/few_rows.py): the forward of
jaxflash.attention and of the jax.nn drop-in runs on the split-KV decode kernel (the lowering
shows it), the gradient on the prefill backward kernels with the decode kernel's out and lse.

Values, lse and dq / dk / dv against the float64 oracle with the 2x-naive rule: one query token
and a few, GQA 8:1 and MHA at the 64-row bound, causal with more queries than keys (empty rows),
windows, softcap and sinks, head-dim pairs, and the drop-in's key_value_seq_lengths with a
length of 0 and one past a key block.
"""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from jaxflash import checks, few_rows, reference
from jaxflash.attention import attention_with_kv_lengths
from jaxflash.config import DECODE_TARGET, FWD_TARGET
from tests._cases import make_qkv, x64
from tests._oracle import assert_close_to_oracle

pytestmark = pytest.mark.gpu

CASES = {  # name -> (dtype, batch, seq_q, seq_k, heads, kv heads, d, dv, options)
    "decode_gqa8_d128": ("bfloat16", 3, 1, 1000, 16, 2, 128, 128, {}),
    "decode_gqa8_causal_long": ("bfloat16", 2, 1, 4100, 32, 4, 128, 128, {"causal": True}),
    "verify4_gqa4_d64_causal": ("float16", 3, 4, 333, 8, 2, 64, 64, {"causal": True}),
    "mha_64_rows_d96": ("bfloat16", 2, 64, 700, 4, 4, 96, 96, {}),
    "more_queries_than_keys_causal": ("bfloat16", 2, 5, 3, 8, 8, 64, 64, {"causal": True}),
    "window_softcap_sink_d256": ("float16", 2, 2, 600, 8, 2, 256, 256,
                                 {"causal": True, "window_size": (100, 0), "softcap": 20.0,
                                  "sink": True}),
    "window_both_sides_d128": ("bfloat16", 1, 3, 500, 4, 2, 128, 128, {"window_size": (40, 7)}),
    "mla_d192_dv128": ("bfloat16", 2, 1, 300, 8, 1, 192, 128, {}),
}


def _case(name):
  dtype, b, seq_q, seq_k, h, h_kv, d, dv, options = CASES[name]
  seed = zlib.crc32(name.encode())
  q, k, v = make_qkv(seed, b, seq_q, seq_k, h, h_kv, d, head_dim_v=dv, dtype=jnp.dtype(dtype))
  options = dict(options)
  sink = None
  if options.pop("sink", False):
    sink = jnp.asarray(np.random.default_rng(seed).standard_normal(h), jnp.float32)
  rng = np.random.default_rng(seed + 1)
  # Representable in the input dtype: the backward's d_out is the cotangent cast to it.
  w_out = np.asarray(jnp.asarray(rng.standard_normal((b, seq_q, h, dv)), dtype), np.float64)
  w_lse = rng.standard_normal((b, h, seq_q))
  return q, k, v, sink, options, w_out, w_lse


def _loss(attend, w_out, w_lse):
  """sum(out * w_out) + sum(lse * w_lse) over rows that see a key: d_out and d_lse."""

  def loss(q, k, v):
    out, lse = attend(q, k, v)
    total = jnp.sum(out.astype(w_out.dtype) * w_out)
    return total + jnp.sum(jnp.where(jnp.isinf(lse), 0, lse).astype(w_lse.dtype) * w_lse)

  return loss


def _value_and_grads(attend, q, k, v, w_out, w_lse):
  loss = _loss(attend, jnp.asarray(w_out, w_out.dtype), jnp.asarray(w_lse, w_lse.dtype))
  return attend(q, k, v), jax.grad(loss, argnums=(0, 1, 2))(q, k, v)


def _oracle(q, k, v, sink, options, w_out, w_lse, kv_ids=None):
  """((out, lse), (dq, dk, dv)) in float64 of the rounded inputs, and the same computed
  naively in the input dtype."""
  cfg = checks.check_options(options.get("causal", False), None,
                             options.get("window_size", (None, None)), options.get("softcap"),
                             False, True, "reference", q.shape[-1])
  q_ids = None if kv_ids is None else jnp.zeros(q.shape[:2], jnp.int32)
  cfg = cfg.replace(has_segment_ids=kv_ids is not None)

  def run(q, k, v, sink, compute_dtype, w_out, w_lse):
    attend = lambda q, k, v: reference.naive_attention(
        q, k, v, cfg, q_ids, kv_ids, compute_dtype=compute_dtype, learnable_sink=sink)
    return jax.jit(lambda q, k, v: _value_and_grads(attend, q, k, v, w_out, w_lse))(q, k, v)

  naive = run(q, k, v, sink, np.dtype(q.dtype), w_out.astype(np.float32),
              w_lse.astype(np.float32))
  with x64():
    up = lambda x: None if x is None else jnp.asarray(np.asarray(x, np.float64))
    exact = run(up(q), up(k), up(v), up(sink), None, w_out, w_lse)
    exact = jax.tree.map(np.asarray, exact)
  return exact, jax.tree.map(lambda x: np.asarray(x, np.float64), naive)


def _check(got, exact, naive):
  (out, lse), grads = got
  (want_out, want_lse), want_grads = exact
  (naive_out, naive_lse), naive_grads = naive
  assert out.shape == want_out.shape
  assert_close_to_oracle(out, want_out, naive_out, name="out")
  assert_close_to_oracle(lse, want_lse, naive_lse, name="lse")
  for name, g, w, n in zip(("dq", "dk", "dv"), grads, want_grads, naive_grads):
    assert_close_to_oracle(g, w, n, name=name)


@pytest.mark.parametrize("name", CASES)
def test_attention_matches_float64_oracle_on_the_decode_kernel(name):
  q, k, v, sink, options, w_out, w_lse = _case(name)
  attend = lambda q, k, v: jaxflash.attention(q, k, v, learnable_sink=sink, return_lse=True,
                                              implementation="cute", **options)
  run = jax.jit(lambda q, k, v: _value_and_grads(attend, q, k, v, w_out.astype(np.float32),
                                                 w_lse.astype(np.float32)))
  text = run.lower(q, k, v).as_text()
  assert f"@{DECODE_TARGET}(" in text and f"@{FWD_TARGET}(" not in text
  _check(run(q, k, v), *_oracle(q, k, v, sink, options, w_out, w_lse))


def test_more_rows_than_a_tile_take_the_prefill_kernel():
  q, k, v = make_qkv(3, 1, few_rows.MAX_PACKED_ROWS // 8 + 1, 256, 16, 2, 128,
                     dtype=jnp.bfloat16)
  text = jax.jit(lambda q, k, v: jaxflash.attention(q, k, v, implementation="cute")).lower(
      q, k, v).as_text()
  assert f"@{FWD_TARGET}(" in text and f"@{DECODE_TARGET}(" not in text


def test_drop_in_key_value_seq_lengths_on_the_decode_kernel():
  """jax.nn-style decoding: one query token, keys masked by run-time lengths (0: jax.nn's mean
  of all values; one past a key block; full)."""
  q, k, v, _, _, w_out, w_lse = _case("decode_gqa8_d128")
  seq_k = k.shape[1]
  lengths = jnp.asarray([0, 129, seq_k], jnp.int32)
  attend = lambda q, k, v: jaxflash.dot_product_attention(q, k, v, key_value_seq_lengths=lengths,
                                                          implementation="cudnn")
  run = jax.jit(attend)
  text = run.lower(q, k, v).as_text()
  assert f"@{DECODE_TARGET}(" in text and f"@{FWD_TARGET}(" not in text
  out = run(q, k, v)
  want = jax.nn.dot_product_attention(*(x.astype(jnp.float32) for x in (q, k, v)),
                                      key_value_seq_lengths=lengths, implementation="xla")
  np.testing.assert_allclose(np.asarray(out[0], np.float32), np.asarray(want[0]), atol=2e-2)
  # Sequences with keys: out, lse and gradients against the oracle with the same mask.
  kv_ids = (jnp.arange(seq_k)[None] >= lengths[:, None]).astype(jnp.int32)[1:]
  args = (q[1:], k[1:], v[1:])
  cut = lengths[1:]
  attend_lse = lambda q, k, v: attention_with_kv_lengths(q, k, v, cut, return_lse=True,
                                                         implementation="cute")
  got = jax.jit(lambda q, k, v: _value_and_grads(attend_lse, q, k, v,
                                                 w_out[1:].astype(np.float32),
                                                 w_lse[1:].astype(np.float32)))(*args)
  _check(got, *_oracle(*args, None, {}, w_out[1:], w_lse[1:], kv_ids=kv_ids))
