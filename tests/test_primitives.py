"""Primitives: abstract eval, jit, vmap at any axis, grad, remat names, memory, CUDA lowering."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_policies

import jaxflash
from jaxflash import primitives
from jaxflash.config import (BWD_TARGET, FWD_TARGET, LSE_CHECKPOINT_NAME,
                             OUT_CHECKPOINT_NAME)
from tests._cases import make_qkv, make_segments


def _attn(q, k, v, **kw):
  return jaxflash.attention(q, k, v, implementation="reference", **kw)


def test_abstract_eval_shapes_and_dtypes():
  q, k, v = make_qkv(0, 2, 7, 9, 6, 2, 16, 24, dtype=jnp.bfloat16)
  out, lse = jax.eval_shape(lambda q, k, v: _attn(q, k, v, return_lse=True), q, k, v)
  assert (out.shape, out.dtype) == ((2, 7, 6, 24), jnp.bfloat16)
  assert (lse.shape, lse.dtype) == ((2, 6, 7), jnp.float32)
  grads = jax.eval_shape(jax.grad(lambda q, k, v: jnp.sum(_attn(q, k, v).astype(jnp.float32)),
                                  argnums=(0, 1, 2)), q, k, v)
  assert [(g.shape, g.dtype) for g in grads] == [(x.shape, x.dtype) for x in (q, k, v)]


def test_jit_matches_eager():
  q, k, v = make_qkv(1)
  np.testing.assert_allclose(jax.jit(_attn)(q, k, v), _attn(q, k, v), rtol=1e-6, atol=1e-6)


def _stack(xs, axis):
  return jnp.stack(xs, axis=axis)


@pytest.mark.parametrize("axis", [0, 1, 2, 3, 4])
def test_vmap_over_any_axis_of_all_inputs(axis):
  sets = [make_qkv(s, 2, 11, 13, 4, 2, 8) for s in range(3)]
  batched = [_stack([s[i] for s in sets], axis) for i in range(3)]
  got = jax.vmap(_attn, in_axes=axis, out_axes=axis)(*batched)
  want = _stack([_attn(*s) for s in sets], axis)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_vmap_query_only_and_nested_leading_axes():
  q, k, v = make_qkv(2, 2, 11, 13, 4, 2, 8)
  qs = jnp.stack([jnp.stack([q * (i + 1) + j for j in range(3)]) for i in range(2)])  # (2,3,...)
  got = jax.vmap(jax.vmap(lambda q: _attn(q, k, v, causal=True)))(qs)
  for i in range(2):
    for j in range(3):
      np.testing.assert_allclose(got[i, j], _attn(qs[i, j], k, v, causal=True), rtol=1e-6,
                                 atol=1e-6)


def test_vmap_with_segments_and_lse():
  sets = [make_qkv(s, 2, 11, 13, 4, 2, 8) for s in range(3)]
  segs = [make_segments(10 + s, 2, 11, 13) for s in range(3)]
  q, k, v = (_stack([s[i] for s in sets], 2) for i in range(3))
  qseg, kseg = (_stack([s[i] for s in segs], 1) for i in range(2))
  f = lambda q, k, v, a, b: _attn(q, k, v, q_segment_ids=a, kv_segment_ids=b, return_lse=True)
  out, lse = jax.vmap(f, in_axes=(2, 2, 2, 1, 1), out_axes=(2, 0))(q, k, v, qseg, kseg)
  for i in range(3):
    o, l = f(*sets[i], *segs[i])
    np.testing.assert_allclose(out[:, :, i], o, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(lse[i], l, rtol=1e-6, atol=1e-6)


def test_vmap_of_grad_and_grad_of_vmap_agree():
  sets = [make_qkv(s, 1, 9, 9, 2, 1, 8) for s in range(3)]
  q, k, v = (jnp.stack([s[i] for s in sets]) for i in range(3))
  loss = lambda q, k, v: jnp.sum(_attn(q, k, v, causal=True) ** 2)
  per_example = jax.vmap(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
  summed = jax.grad(lambda q, k, v: jnp.sum(jax.vmap(loss)(q, k, v)), argnums=(0, 1, 2))(q, k, v)
  for a, b in zip(per_example, summed):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _count_forward_binds(jaxpr) -> int:
  text = str(jaxpr)
  return len(re.findall(r"\bjaxflash_fwd\[", text))


@pytest.mark.parametrize("policy,expected", [
    (checkpoint_policies.save_only_these_names(OUT_CHECKPOINT_NAME, LSE_CHECKPOINT_NAME), 1),
    (checkpoint_policies.nothing_saveable, 2),
], ids=["save_out_lse", "nothing_saveable"])
def test_remat_policies_see_the_residual_names(policy, expected):
  q, k, v = make_qkv(5, 1, 16, 16, 2, 1, 8)
  layer = jax.checkpoint(lambda q, k, v: jnp.sum(_attn(q, k, v) ** 2), policy=policy)
  grad_jaxpr = jax.make_jaxpr(jax.grad(layer, argnums=(0, 1, 2)))(q, k, v)
  # Saved residuals: the forward runs once; nothing saveable: it is recomputed in the backward.
  assert _count_forward_binds(grad_jaxpr) == expected
  g = jax.grad(layer)(q, k, v)
  g_plain = jax.grad(lambda q, k, v: jnp.sum(_attn(q, k, v) ** 2))(q, k, v)
  np.testing.assert_allclose(g, g_plain, rtol=1e-6, atol=1e-7)


def test_lse_residual_is_float32_for_half_inputs():
  q, k, v = make_qkv(6, dtype=jnp.bfloat16)
  _, vjp = jax.vjp(lambda q: _attn(q, k, v), q)
  leaves = [x for x in jax.tree_util.tree_leaves(vjp) if hasattr(x, "shape")]
  assert any(x.shape == (2, 4, 37) and x.dtype == jnp.float32 for x in leaves)


def _compiled_step(seq):
  spec = jax.ShapeDtypeStruct((1, seq, 2, 64), jnp.bfloat16)
  loss = lambda q, k, v: jnp.sum(_attn(q, k, v, causal=True).astype(jnp.float32))
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(spec, spec, spec).lower().compile()


def test_forward_backward_memory_is_linear_in_sequence():
  # seq 8k, hdim 64, 2 heads: one (seq_q x seq_k) float32 score buffer would be 512 MiB.
  big, small = _compiled_step(8192), _compiled_step(4096)
  hlo = big.as_text()
  assert not re.search(r"\b8192,8192\b|\b8192,\d+,8192\b", hlo), "found a seq x seq buffer"
  temp_big = big.memory_analysis().temp_size_in_bytes
  temp_small = small.memory_analysis().temp_size_in_bytes
  assert temp_big < 512 * 2**20, f"temp {temp_big} bytes: as large as one seq x seq buffer"
  # Linear memory doubles with the sequence; a quadratic buffer would quadruple it.
  assert temp_big < 2.5 * temp_small, f"temp {temp_small} -> {temp_big} bytes for 2x sequence"


def test_cuda_lowering_emits_the_stable_custom_call():
  q, k, v = make_qkv(7, 2, 128, 128, 4, 2, 128, dtype=jnp.bfloat16)
  f = jax.jit(lambda q, k, v: jaxflash.attention(q, k, v, causal=True, implementation="cute"))
  text = f.trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()
  assert f'"{FWD_TARGET}"' in text or f"@{FWD_TARGET}" in text or FWD_TARGET in text
  call = next(line for line in text.splitlines() if FWD_TARGET in line)
  for attr in ("variant", "softmax_scale", "causal = true", "head_dim = 128"):
    assert attr in call, f"{attr!r} missing from {call}"
  assert "fwd-sm90a-bf16-d128-dv128-causal" in call
  # q, k, v in; out and lse out.
  assert "tensor<2x128x4x128xbf16>" in call and "tensor<2x4x128xf32>" in call


def _grad_lowered_for_cuda(head_dim, head_dim_v=None, **kw):
  q, k, v = make_qkv(8, 2, 100, 64, 4, 2, head_dim, head_dim_v=head_dim_v, dtype=jnp.bfloat16)
  loss = lambda q, k, v: jnp.sum(jaxflash.attention(q, k, v, implementation="cute", **kw)
                                 .astype(jnp.float32))
  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  return grad.trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()


def _bwd_call_types(call):
  """The operand and result tensor types of a lowered backward custom call line."""
  operands, results = call.split(" -> ")
  operands = operands[operands.rindex(": (") + 3:]
  return (re.findall(r"tensor<[^>]+>", operands), re.findall(r"tensor<[^>]+>", results))


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("causal", [True, False])
def test_cuda_lowering_of_grad_emits_both_custom_calls(deterministic, causal):
  text = _grad_lowered_for_cuda(128, causal=causal, deterministic=deterministic)
  assert text.count(FWD_TARGET) >= 1
  (call,) = [line for line in text.splitlines() if f"@{BWD_TARGET}(" in line]
  det = "-det" if deterministic else ""
  # hdim 128: 80-row query tiles (config.bwd_schedule).
  tile_m = 80
  flags = ("-causal" if causal else "") + det
  assert f'variant = "bwd-sm90a-bf16-d128-dv128{flags}-m{tile_m}n128s2swap"' in call
  for attr in (f"causal = {str(causal).lower()}", f"deterministic = {str(deterministic).lower()}",
               "head_dim = 128", "head_dim_v = 128", "window_left = 1073741824", "softcap = 0.0"):
    assert attr in call, f"{attr!r} missing from {call}"
  # q, k, v, out, lse, d_out, d_lse in; dq, dk, dv, then the scratch of bwd_scratch_shapes
  # (seq_q 100 rounded up to tile_m: 128 or 160; 2 query blocks for the semaphore either way).
  operands, results = _bwd_call_types(call)
  assert operands == [
      "tensor<2x100x4x128xbf16>", "tensor<2x64x2x128xbf16>", "tensor<2x64x2x128xbf16>",
      "tensor<2x100x4x128xbf16>", "tensor<2x4x100xf32>", "tensor<2x100x4x128xbf16>",
      "tensor<2x4x100xf32>"]
  rows = -(-100 // tile_m) * tile_m
  want = ["tensor<2x100x4x128xbf16>", "tensor<2x64x2x128xbf16>", "tensor<2x64x2x128xbf16>",
          f"tensor<2x4x{rows}x128xf32>", f"tensor<2x4x{rows}xf32>", f"tensor<2x4x{rows}xf32>"]
  assert results == want + (["tensor<2x4x2xi32>"] if deterministic else [])


def test_cuda_lowering_of_grad_with_head_dim_v_not_head_dim_uses_the_bwd_kernel():
  """192 / 128 (MLA): v, out, d_out and dv carry head_dim_v; q, k, dq, dk and dq_accum head_dim."""
  text = _grad_lowered_for_cuda(192, head_dim_v=128, causal=True)
  (call,) = [line for line in text.splitlines() if f"@{BWD_TARGET}(" in line]
  assert 'variant = "bwd-sm90a-bf16-d192-dv128-causal-m64n64s2"' in call
  assert "head_dim = 192" in call and "head_dim_v = 128" in call
  operands, results = _bwd_call_types(call)
  assert operands == [
      "tensor<2x100x4x192xbf16>", "tensor<2x64x2x192xbf16>", "tensor<2x64x2x128xbf16>",
      "tensor<2x100x4x128xbf16>", "tensor<2x4x100xf32>", "tensor<2x100x4x128xbf16>",
      "tensor<2x4x100xf32>"]
  assert results == [
      "tensor<2x100x4x192xbf16>", "tensor<2x64x2x192xbf16>", "tensor<2x64x2x128xbf16>",
      "tensor<2x4x128x192xf32>", "tensor<2x4x128xf32>", "tensor<2x4x128xf32>"]


def test_cuda_lowering_of_grad_without_a_bwd_kernel_keeps_the_reference_backward(
    without_192_128_backward):
  text = _grad_lowered_for_cuda(192, head_dim_v=128)  # a forward kernel, no backward kernel
  assert text.count(FWD_TARGET) >= 1
  assert BWD_TARGET not in text


def test_cuda_lowering_of_softcap_runs_the_masked_forward_and_backward():
  text = _grad_lowered_for_cuda(128, causal=True, softcap=5.0)
  (call,) = [line for line in text.splitlines() if f"@{FWD_TARGET}(" in line]
  assert 'variant = "fwd-sm90a-bf16-d128-dv128-masked-m128n128s2"' in call
  assert "softcap = 5.000000e+00" in call and "causal = true" in call
  (call,) = [line for line in text.splitlines() if f"@{BWD_TARGET}(" in line]
  assert 'variant = "bwd-sm90a-bf16-d128-dv128-masked-m80n128s2swap"' in call
  assert "softcap = 5.000000e+00" in call and "causal = true" in call


def test_bwd_kernel_primitive_carries_scratch_only_on_the_kernel_path():
  q, k, v = make_qkv(10, 2, 100, 64, 4, 2, 64, dtype=jnp.bfloat16)
  out, lse = _attn(q, k, v, return_lse=True)
  args = (q, k, v, out, lse, out, lse)
  cute = jaxflash.config.AttentionConfig(softmax_scale=0.125, implementation="cute")
  inner = jax.eval_shape(lambda *a: primitives._flash_bwd_kernel_p.bind(*a, config=cute), *args)
  # dq, dk, dv, then dq_accum, lse_log2, delta with seq_q 100 rounded up to tile_m 64.
  assert [x.shape for x in inner] == [q.shape, k.shape, v.shape, (2, 4, 128, 64), (2, 4, 128),
                                      (2, 4, 128)]
  ref = cute.replace(implementation="reference")
  assert len(jax.eval_shape(lambda *a: primitives._flash_bwd_kernel_p.bind(*a, config=ref),
                            *args)) == 3
  # The outer primitive returns the gradients only; off-GPU the scratch is a zero stand-in.
  got = primitives.flash_bwd_p.bind(*args, config=cute)
  want = primitives.flash_bwd_p.bind(*args, config=ref)
  assert len(got) == 3
  for g, w in zip(got, want):
    np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("options,counter", [
    ({"causal": True}, True), ({"window_size": (16, 0)}, True), ({"softcap": 5.0}, True),
    ({}, False)], ids=["causal", "window", "softcap", "dense"])
def test_forward_custom_call_carries_the_tile_counter_of_dynamic_schedules(options, counter):
  """Causal and masked forwards claim their tiles from a counter: their custom call has a third
  result, int32 (1,), which the outer primitive drops; dense calls without the causal mask
  walk a static list and have none."""
  q, k, v = make_qkv(11, 2, 100, 64, 4, 2, 64, dtype=jnp.bfloat16)
  f = jax.jit(lambda q, k, v: jaxflash.attention(q, k, v, implementation="cute", **options))
  text = f.trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()
  (call,) = [line for line in text.splitlines() if f"@{FWD_TARGET}(" in line]
  results = re.findall(r"tensor<[^>]+>", call.split(" -> ")[1])
  assert results == ["tensor<2x100x4x64xbf16>", "tensor<2x4x100xf32>"] + (
      ["tensor<1xi32>"] if counter else [])
  cute = jaxflash.config.AttentionConfig(
      softmax_scale=0.125, implementation="cute", causal=options.get("causal", False),
      window_left=options.get("window_size", (None,))[0],
      window_right=options.get("window_size", (None, None))[1], softcap=options.get("softcap"))
  inner = jax.eval_shape(lambda *a: primitives._flash_fwd_kernel_p.bind(*a, config=cute),
                         q, k, v)
  assert [(x.shape, x.dtype) for x in inner[2:]] == ([((1,), jnp.int32)] if counter else [])
  ref = cute.replace(implementation="reference")
  assert len(jax.eval_shape(lambda *a: primitives._flash_fwd_kernel_p.bind(*a, config=ref),
                            q, k, v)) == 2


def test_primitive_binds_directly_with_a_config():
  q, k, v = make_qkv(9, 1, 5, 6, 2, 1, 8)
  cfg = jaxflash.config.AttentionConfig(softmax_scale=0.5)
  out, lse = primitives.flash_fwd_p.bind(q, k, v, config=cfg)
  want, want_lse = jaxflash.attention(q, k, v, softmax_scale=0.5, return_lse=True)
  np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(lse, want_lse, rtol=1e-6)


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "det"])
@pytest.mark.parametrize("options", [
    {"causal": True, "segments": True},
    {"window_size": (32, 8)},
    {"causal": True, "window_size": (16, None), "segments": True},
], ids=["packed_causal", "window", "causal_window_segments"])
def test_cuda_lowering_of_masked_calls_runs_the_masked_variants(options, deterministic):
  """Windows and segment ids take the masked variants (no reference path), their block ranges
  passed as the extra operands of kernel_abi.h's JaxflashMask: ids, ranges, order (and,
  deterministic backward, the ranks). With segment ids they are XLA ops in front of each custom
  call (a sort among them); a window alone gets them as constants."""
  options = dict(options)
  kw = {}
  segments = options.pop("segments", False)
  if segments:
    ids = jnp.asarray(np.repeat(np.arange(4), 25)[None].repeat(2, 0), jnp.int32)
    kw = dict(q_segment_ids=ids, kv_segment_ids=ids[:, :64])
  text = _grad_lowered_for_cuda(128, deterministic=deterministic, **options, **kw)
  (fwd,) = [line for line in text.splitlines() if f"@{FWD_TARGET}(" in line]
  (bwd,) = [line for line in text.splitlines() if f"@{BWD_TARGET}(" in line]
  det = "-det" if deterministic else ""
  assert 'variant = "fwd-sm90a-bf16-d128-dv128-masked-m128n128s2"' in fwd
  assert f'variant = "bwd-sm90a-bf16-d128-dv128-masked{det}-m80n128s2swap"' in bwd
  assert f"causal = {str(options.get('causal', False)).lower()}" in fwd
  left, right = options.get("window_size", (None, None))
  unbounded = jaxflash.config.WINDOW_UNBOUNDED
  assert f"window_left = {unbounded if left is None else left} : i32" in fwd
  assert f"window_right = {unbounded if right is None else right} : i32" in fwd
  fwd_operands = fwd.split(" -> ")[0]
  fwd_operands = re.findall(r"tensor<[^>]+>", fwd_operands[fwd_operands.rindex(": (") + 3:])
  # q, k, v; query ids (100 -> one 128-row tile), key ids (64 -> one 128-key block), ranges,
  # order.
  assert fwd_operands[3:] == ["tensor<2x128xi32>", "tensor<2x128xi32>", "tensor<2x1x4xi32>",
                              "tensor<2xi32>"]
  operands, _ = _bwd_call_types(bwd)
  # 7 tensors; key ids (one 128-key tile), query ids (100 -> two 80-row blocks), ranges,
  # order, and for the deterministic variant the ranks (2, key tiles, query blocks).
  want = ["tensor<2x128xi32>", "tensor<2x160xi32>", "tensor<2x1x4xi32>", "tensor<2xi32>"]
  assert operands[7:] == want + (["tensor<2x1x2xi32>"] if deterministic else [])
  assert ("stablehlo.sort" in text) == segments  # the ranges are computed on the device
