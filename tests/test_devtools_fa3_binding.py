"""The FlashAttention-3 peer binding (devtools/fa3_binding.py): the custom calls it builds, its
errors, and its sink handling, on the CPU (FA-3's kernels themselves run on a Hopper GPU only)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests._scripts import load_script


@pytest.fixture(scope="module")
def fa3():
  return load_script("devtools/fa3_binding.py")


def test_forward_call_of_a_batch(fa3):
  call = fa3.fwd_call((2, 300, 8, 128), (2, 300, 2, 128), (2, 300, 2, 128), jnp.bfloat16,
                      causal=True, softmax_scale=0.125)
  assert call.target == "dew_flash3_mha_fwd"
  assert call.results == (((2, 300, 8, 128), np.dtype(jnp.bfloat16)),
                          ((2, 8, 300), np.dtype(np.float32)),
                          ((1, 1, 1, 1), np.dtype(np.float32)), ((1, 1, 1), np.dtype(np.float32)))
  assert call.attributes == dict(softmax_scale=0.125, is_causal=True, window_size_left=-1,
                                 window_size_right=0)
  # The types the targets bind: f64 scale, i64 window sides.
  assert isinstance(call.attributes["softmax_scale"], np.float64)
  assert isinstance(call.attributes["window_size_left"], np.int64)


@pytest.mark.parametrize("window,causal,want", [
    ((None, None), False, (-1, -1)), ((128, 0), True, (128, 0)), ((128, None), True, (128, 0)),
    ((1024, 1024), False, (1024, 1024)), ((5, 3), True, (5, 0)), ((None, 7), False, (-1, 7))])
def test_windows_in_flash_attentions_convention(fa3, window, causal, want):
  """jaxflash's None (unbounded) is FlashAttention's -1; causal bounds the right side at 0."""
  call = fa3.fwd_call((1, 64, 4, 64), (1, 64, 4, 64), (1, 64, 4, 64), jnp.float16,
                      causal=causal, softmax_scale=1.0, window_size=window)
  attrs = call.attributes
  assert (attrs["window_size_left"], attrs["window_size_right"]) == want


def test_packed_calls(fa3):
  """Varlen: (tokens, heads, head_dim) operands, lse (heads, tokens), the longest document as
  attributes; the backward's per-row scratch holds every document's rows rounded up to 128."""
  shape = (1017, 8, 128)
  fwd = fa3.fwd_call(shape, shape, shape, jnp.bfloat16, causal=True, softmax_scale=0.1,
                     max_seqlens=(700, 700))
  assert fwd.target == "dew_flash3_mha_varlen_fwd"
  assert fwd.results[1] == ((8, 1017), np.dtype(np.float32))
  assert (fwd.attributes["max_seqlen"], fwd.attributes["max_seqlen_k"]) == (700, 700)
  bwd = fa3.bwd_call(shape, shape, shape, jnp.bfloat16, causal=True, softmax_scale=0.1,
                     max_seqlens=(700, 700), documents=4)
  assert bwd.target == "dew_flash3_mha_varlen_bwd"
  assert [r[0] for r in bwd.results] == [shape] * 3 + [(8 * (1017 + 128 * 5),)] * 2
  dense = fa3.bwd_call((2, 300, 8, 64), (2, 300, 4, 64), (2, 300, 4, 64), jnp.bfloat16,
                       causal=False, softmax_scale=0.1)
  assert dense.target == "dew_flash3_mha_bwd"
  assert [r[0] for r in dense.results] == [(2, 300, 8, 64), (2, 300, 4, 64), (2, 300, 4, 64),
                                           (8 * (600 + 128 * 3),), (8 * (600 + 128 * 3),)]
  with pytest.raises(ValueError, match="documents"):
    fa3.bwd_call(shape, shape, shape, jnp.bfloat16, causal=True, softmax_scale=0.1,
                 max_seqlens=(700, 700))


@pytest.mark.parametrize("q,k,v,dtype,match", [
    ((1, 8, 4, 64), (1, 8, 4, 64), (1, 8, 4, 64), jnp.float32, "dtype"),
    ((1, 8, 4, 264), (1, 8, 4, 264), (1, 8, 4, 264), jnp.bfloat16, "head_dim"),
    ((1, 8, 4, 100), (1, 8, 4, 100), (1, 8, 4, 100), jnp.bfloat16, "head_dim"),
    ((1, 8, 4, 128), (1, 8, 4, 128), (1, 8, 4, 64), jnp.bfloat16, "k and v of one shape"),
    ((1, 8, 6, 64), (1, 8, 4, 64), (1, 8, 4, 64), jnp.bfloat16, "divide"),
    ((2, 8, 4, 64), (1, 8, 4, 64), (1, 8, 4, 64), jnp.bfloat16, "batch"),
])
def test_operands_the_targets_cannot_take_are_refused(fa3, q, k, v, dtype, match):
  """The kernels read k and v with q's strides: a wrong shape must fail here, not read out of
  bounds."""
  with pytest.raises(ValueError, match=match):
    fa3.fwd_call(q, k, v, dtype, causal=False, softmax_scale=1.0)
  with pytest.raises(ValueError, match="negative"):
    fa3.fwd_call((1, 8, 4, 64), (1, 8, 4, 64), (1, 8, 4, 64), jnp.bfloat16, causal=False,
                 softmax_scale=1.0, window_size=(-3, None))


def _custom_calls(fn, *args):
  text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  return re.findall(r"custom_call @(dew_flash3_\w+)\(([^)]*)\)", text)


def test_lowering_for_cuda_calls_the_forward_and_backward_targets(fa3):
  """Lowered on this CPU host for CUDA: one forward and one backward custom call, the backward
  taking d_out, q, k, v, out, lse (packed: and the offsets twice)."""
  q = jax.ShapeDtypeStruct((2, 256, 8, 64), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((2, 256, 2, 64), jnp.bfloat16)
  sink = jax.ShapeDtypeStruct((8,), jnp.float32)
  loss = lambda q, k, v, s: fa3.attention(q, k, v, causal=True, window_size=(128, 0),
                                          learnable_sink=s).astype(jnp.float32).sum()
  calls = _custom_calls(jax.grad(loss, argnums=(0, 1, 2, 3)), q, k, k, sink)
  assert [(name, operands.count("%") ) for name, operands in calls] == [
      ("dew_flash3_mha_fwd", 3), ("dew_flash3_mha_bwd", 6)]
  packed = jax.ShapeDtypeStruct((1000, 8, 128), jnp.bfloat16)
  offsets = jax.ShapeDtypeStruct((5,), jnp.int32)
  loss = lambda q, k, v, o: fa3.varlen_attention(q, k, v, o, 512, causal=True).astype(
      jnp.float32).sum()
  calls = _custom_calls(jax.grad(loss, argnums=(0, 1, 2)), packed, packed, packed, offsets)
  assert [(name, operands.count("%")) for name, operands in calls] == [
      ("dew_flash3_mha_varlen_fwd", 5), ("dew_flash3_mha_varlen_bwd", 8)]


def test_availability_names_what_is_missing(fa3, monkeypatch, tmp_path):
  monkeypatch.setenv(fa3.LIBRARY_ENV, str(tmp_path / "absent.so"))
  ok, why = fa3.availability()
  assert not ok and fa3.LIBRARY_ENV in why and "absent.so" in why
  (tmp_path / fa3.LIBRARY_NAME).write_bytes(b"")
  monkeypatch.setenv(fa3.LIBRARY_ENV, str(tmp_path / fa3.LIBRARY_NAME))
  ok, why = fa3.availability()  # found, but this host has no Hopper GPU
  assert not ok and "sm90a" in why


def _dense_kernels_in_jax(q, k, v, scale):
  """Stand-ins for FA-3's forward and backward kernels (no sink, causal), in float32 JAX: the
  forward's out and lse (batch, heads, seq); the backward from the lse it is given, as a
  FlashAttention backward computes it."""
  group = q.shape[2] // k.shape[2]
  expand = lambda x: jnp.repeat(x.astype(jnp.float32), group, axis=2)
  s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), expand(k)) * scale
  s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -jnp.inf)
  lse = jax.nn.logsumexp(s, axis=-1)
  out = jnp.einsum("bhqk,bkhd->bqhd", jnp.exp(s - lse[..., None]), expand(v))

  def backward(d_out, out, lse):
    p = jnp.exp(s - lse[..., None])
    d_out = d_out.astype(jnp.float32)
    dp = jnp.einsum("bqhd,bkhd->bhqk", d_out, expand(v))
    delta = jnp.einsum("bqhd,bqhd->bhq", d_out, out.astype(jnp.float32))
    ds = p * (dp - delta[..., None]) * scale
    dq = jnp.einsum("bhqk,bkhd->bqhd", ds, expand(k))
    fold = lambda x: x.reshape(x.shape[:2] + (k.shape[2], group, x.shape[-1])).sum(3)
    dk = fold(jnp.einsum("bhqk,bqhd->bkhd", ds, q.astype(jnp.float32)))
    dv = fold(jnp.einsum("bhqk,bqhd->bkhd", p, d_out))
    return dq, dk, dv
  return out, lse, backward


def test_sinks_outside_the_kernel_give_the_sink_softmax_and_its_gradients(fa3, monkeypatch):
  """The binding applies learnable sinks around FA-3's kernels (scaled output, the backward on
  the sink's lse, the sink's gradient in XLA). With the kernels replaced by the same math in
  JAX, out and every gradient (the sink's too) match jaxflash's reference with the sink."""
  import jaxflash
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32)
             for s in ((1, 40, 4, 16), (1, 40, 2, 16), (1, 40, 2, 16)))
  sink = jnp.asarray(rng.standard_normal(4) * 2, jnp.float32)
  cotangent = jnp.asarray(rng.standard_normal((1, 40, 4, 16)), jnp.float32)
  scale = 16 ** -0.5

  def forward(q, k, v, offsets, options):
    out, lse, _ = _dense_kernels_in_jax(q, k, v, scale)
    return out, lse

  def backward(d_out, q, k, v, out, lse, offsets, options):
    return _dense_kernels_in_jax(q, k, v, scale)[2](d_out, out, lse)

  monkeypatch.setattr(fa3, "_forward", forward)
  monkeypatch.setattr(fa3, "_backward", backward)

  def grads(attend):
    loss = lambda q, k, v, s: jnp.sum(attend(q, k, v, s) * cotangent)
    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(q, k, v, sink)

  got = grads(lambda q, k, v, s: fa3.attention(q, k, v, causal=True, learnable_sink=s))
  want = grads(lambda q, k, v, s: jaxflash.attention(q, k, v, causal=True, learnable_sink=s,
                                                     implementation="reference"))
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  for name, a, b in zip(("dq", "dk", "dv", "dsink"), got[1], want[1]):
    np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5, err_msg=name)
