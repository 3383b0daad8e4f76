"""Which jaxflash.attention calls run their forward on the decode kernel (jaxflash/few_rows.py),
what they lower to for CUDA from this CPU host, and the backward of a length-masked call.

The kernels' values are checked on the GPU (tests/test_gpu_few_rows.py).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from jaxflash import checks, few_rows
from jaxflash.config import BWD_TARGET, DECODE_TARGET, FWD_TARGET
from tests._cases import make_qkv


def _config(implementation="cute", **options):
  cfg = checks.check_options(options.pop("causal", False), None,
                             options.pop("window_size", (None, None)), None, False, False,
                             implementation, 128)
  return cfg.replace(implementation=implementation, **options)


@pytest.mark.parametrize("seq_q,heads,kv_heads,cfg,dtype,kv_lengths,want", [
    (1, 32, 4, _config(), "bfloat16", False, True),
    (8, 32, 4, _config(causal=True), "float16", False, True),  # 64 packed rows
    (9, 32, 4, _config(causal=True), "bfloat16", False, False),  # 72 packed rows
    (64, 4, 4, _config(), "bfloat16", False, True),
    (65, 4, 4, _config(), "bfloat16", False, False),
    (1, 8, 1, _config("reference"), "bfloat16", False, False),
    (1, 8, 1, _config(), "float32", False, False),
    (1, 8, 1, _config(has_segment_ids=True), "bfloat16", False, False),
    (1, 8, 1, _config(), "bfloat16", True, True),
    (1, 8, 1, _config(causal=True), "bfloat16", True, False),  # masks align to seq_k
    (1, 8, 1, _config(window_size=(16, 0)), "bfloat16", True, False),
], ids=["decode", "64_rows", "72_rows", "mha_64", "mha_65", "reference", "float32",
        "segment_ids", "kv_lengths", "kv_lengths_causal", "kv_lengths_window"])
def test_takes_few_packed_rows_of_kernel_dtypes(seq_q, heads, kv_heads, cfg, dtype, kv_lengths,
                                                want):
  got = few_rows.takes(cfg, dtype, (2, seq_q, heads, 128), (2, 4096, kv_heads, 128), 128,
                       kv_lengths=kv_lengths)
  assert got == want


def test_head_dims_without_a_decode_kernel_take_the_prefill_path():
  assert not few_rows.takes(_config(), "bfloat16", (1, 1, 8, 32), (1, 64, 8, 32), 32)


def _targets(fn, *args):
  text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  return set(re.findall(r"custom_call @(\w+)\(", text))


def _grad(fn):
  return jax.grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32)), argnums=(0, 1, 2))


QKV = make_qkv(0, 2, 3, 300, 8, 2, 64, dtype=jnp.bfloat16)


def test_a_decoding_call_lowers_to_the_decode_kernel_and_its_gradient_to_the_backward():
  attend = lambda q, k, v: jaxflash.attention(q, k, v, causal=True, softcap=10.0,
                                              implementation="cute")
  assert _targets(attend, *QKV) == {DECODE_TARGET}
  assert _targets(_grad(attend), *QKV) == {DECODE_TARGET, BWD_TARGET}
  batched = jax.vmap(attend, in_axes=(0, None, None))
  assert _targets(batched, jnp.stack([QKV[0]] * 3), *QKV[1:]) == {DECODE_TARGET}


def test_many_rows_and_segment_ids_keep_the_prefill_kernel():
  q, k, v = make_qkv(1, 2, 65, 300, 4, 4, 64, dtype=jnp.bfloat16)
  assert _targets(lambda q, k, v: jaxflash.attention(q, k, v, implementation="cute"),
                  q, k, v) == {FWD_TARGET}
  ids = jnp.zeros(QKV[0].shape[:2], jnp.int32), jnp.zeros(QKV[1].shape[:2], jnp.int32)
  attend = lambda q, k, v: jaxflash.attention(q, k, v, q_segment_ids=ids[0],
                                              kv_segment_ids=ids[1], implementation="cute")
  assert _targets(attend, *QKV) == {FWD_TARGET}


def test_drop_in_decoding_with_key_value_lengths_lowers_to_the_decode_kernel():
  lengths = jnp.asarray([0, 200], jnp.int32)
  nn = lambda q, k, v, **kw: jaxflash.dot_product_attention(q, k, v, implementation="cudnn",
                                                            **kw)
  assert _targets(lambda *a: nn(*a, key_value_seq_lengths=lengths), *QKV) == {DECODE_TARGET}
  assert _targets(_grad(lambda *a: nn(*a, key_value_seq_lengths=lengths)), *QKV) == {
      DECODE_TARGET, BWD_TARGET}
  # Query lengths too: segment ids on the prefill kernel.
  assert _targets(lambda *a: nn(*a, key_value_seq_lengths=lengths, query_seq_lengths=lengths),
                  *QKV) == {FWD_TARGET}


def test_length_masked_backward_is_the_segment_id_gradient():
  """few_rows' backward turns kv_lengths into segment ids for the backward kernel (here its
  reference lowering): the gradients equal those of the reference with the same mask."""
  q, k, v = (x.astype(jnp.float32) for x in QKV)
  lengths = jnp.asarray([0, 129], jnp.int32)
  kv_ids = (jnp.arange(k.shape[1])[None] >= lengths[:, None]).astype(jnp.int32)
  q_ids = jnp.zeros(q.shape[:2], jnp.int32)
  rng = np.random.default_rng(2)
  d_out = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
  d_lse = jnp.asarray(rng.standard_normal((2, 8, 3)), jnp.float32)
  ref = lambda q, k, v: jaxflash.attention(q, k, v, q_segment_ids=q_ids, kv_segment_ids=kv_ids,
                                           return_lse=True, implementation="reference")
  (out, lse), vjp = jax.vjp(ref, q, k, v)
  want = vjp((d_out, d_lse))
  cfg = _config().replace(softmax_scale=64 ** -0.5)
  got = few_rows._core_bwd(cfg, (q, k, v, lengths, None, out, lse), (d_out, d_lse))
  assert got[3] is None and got[4] is None
  for g, w in zip(got[:3], want):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
