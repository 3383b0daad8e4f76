"""Every bad input to jaxflash.attention raises a named error at trace time."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from tests._cases import make_qkv
from tests.conftest import FWD_ONLY_PAIR

Q, K, V = make_qkv(0, 2, 8, 8, 4, 2, 16)


def _call(**overrides):
  args = {"query": Q, "key": K, "value": V}
  args.update(overrides)
  return jaxflash.attention(args.pop("query"), args.pop("key"), args.pop("value"), **args)


BAD = {  # id -> (overrides, exception, words the message must contain)
    "query_rank": ({"query": Q[0]}, ValueError, ["query", "rank 4", "(8, 4, 16)"]),
    "key_not_array": ({"key": [[1.0]]}, TypeError, ["key", "list"]),
    "batch_mismatch": ({"key": K[:1], "value": V[:1]}, ValueError, ["batch", "2"]),
    "head_dim_mismatch": ({"key": K[..., :8]}, ValueError, ["key", "head_dim", "16"]),
    "value_seq_mismatch": ({"value": V[:, :5]}, ValueError, ["value", "seq_k"]),
    "heads_not_divisible": ({"key": jnp.ones((2, 8, 3, 16)), "value": jnp.ones((2, 8, 3, 16))},
                            ValueError, ["num_heads 4", "num_kv_heads 3"]),
    "dtype_mismatch": ({"key": K.astype(jnp.bfloat16)}, TypeError, ["dtypes must match"]),
    "int_dtype": ({"query": Q.astype(jnp.int32), "key": K.astype(jnp.int32),
                   "value": V.astype(jnp.int32)}, TypeError, ["int32", "float16"]),
    "causal_not_bool": ({"causal": 1}, TypeError, ["causal", "bool"]),
    "scale_negative": ({"softmax_scale": -1.0}, ValueError, ["softmax_scale", "-1.0"]),
    "scale_traced_like": ({"softmax_scale": jnp.float32(0.5)}, TypeError, ["softmax_scale"]),
    "window_shape": ({"window_size": (3,)}, ValueError, ["window_size", "(3,)"]),
    "window_float": ({"window_size": (3.5, None)}, ValueError, ["window_size", "3.5"]),
    "softcap_zero": ({"softcap": 0.0}, ValueError, ["softcap", "0.0"]),
    "softcap_string": ({"softcap": "1"}, TypeError, ["softcap"]),
    "one_segment_id": ({"q_segment_ids": jnp.zeros((2, 8), jnp.int32)}, ValueError,
                       ["q_segment_ids/kv_segment_ids", "both"]),
    "segment_shape": ({"q_segment_ids": jnp.zeros((2, 7), jnp.int32),
                       "kv_segment_ids": jnp.zeros((2, 8), jnp.int32)}, ValueError,
                      ["q_segment_ids", "(2, 8)", "(2, 7)"]),
    "segment_float": ({"q_segment_ids": jnp.zeros((2, 8)), "kv_segment_ids": jnp.zeros((2, 8))},
                      TypeError, ["q_segment_ids", "integer"]),
    "implementation_name": ({"implementation": "cudnn"}, ValueError,
                            ["implementation", "'cudnn'", "'reference'"]),
    "return_lse_not_bool": ({"return_lse": "yes"}, TypeError, ["return_lse"]),
    "cute_float32": ({"implementation": "cute"}, ValueError, ["cute", "float32"]),
    "cute_head_dim": ({"implementation": "cute", "query": Q.astype(jnp.bfloat16),
                       "key": K.astype(jnp.bfloat16), "value": V.astype(jnp.bfloat16)},
                      ValueError, ["cute", "head_dim 16", "64, 96, 128, 192, 256"]),
    "cute_head_dim_v": ({"implementation": "cute", "query": jnp.ones((1, 4, 2, 192), jnp.bfloat16),
                         "key": jnp.ones((1, 4, 2, 192), jnp.bfloat16),
                         "value": jnp.ones((1, 4, 2, 64), jnp.bfloat16)},
                        ValueError, ["cute", "head_dim_v 64", "head_dim 192", "(128, 192)"]),
}


@pytest.mark.parametrize("overrides,exc,words", BAD.values(), ids=BAD.keys())
def test_bad_input_raises_named_error(overrides, exc, words):
  with pytest.raises(exc) as info:
    _call(**overrides)
  for word in words:
    assert word in str(info.value), f"{word!r} missing from: {info.value}"


@pytest.mark.parametrize("overrides,exc,words", [BAD["query_rank"], BAD["one_segment_id"]],
                         ids=["query_rank", "one_segment_id"])
def test_errors_raise_at_trace_time_under_jit(overrides, exc, words):
  del words
  with pytest.raises(exc):
    jax.jit(lambda: _call(**overrides)).trace()


def test_cute_off_gpu_names_the_platform():
  q = jnp.ones((1, 4, 2, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="implementation='cute' needs an NVIDIA Hopper GPU.*cpu"):
    jaxflash.attention(q, q, q, implementation="cute")


def test_auto_uses_the_reference_on_cpu():
  out = jaxflash.attention(Q, K, V)
  want = jaxflash.attention(Q, K, V, implementation="reference")
  np.testing.assert_array_equal(out, want)


def test_defaults_and_return_types():
  out, lse = jaxflash.attention(Q, K, V, return_lse=True)
  assert out.shape == (2, 8, 4, 16) and out.dtype == Q.dtype
  assert lse.shape == (2, 4, 8) and lse.dtype == jnp.float32
  explicit = jaxflash.attention(Q, K, V, softmax_scale=16 ** -0.5)
  np.testing.assert_array_equal(out, explicit)


def test_import_needs_jax_only():
  import subprocess
  import sys
  code = ("import sys, jaxflash; jaxflash.attention; "
          "bad = [m for m in sys.modules if m.split('.')[0] in ('cutlass', 'flax', 'torch')"
          " or m.startswith('jaxflash.kernels') or m == 'jaxflash.build']; "
          "assert not bad, bad")
  subprocess.run([sys.executable, "-c", code], check=True)


def _pretend_hopper(monkeypatch, available):
  from jaxflash import _jax_internal, ffi
  monkeypatch.setattr(_jax_internal, "has_hopper_device", lambda: True)
  answer = lambda v: (available, "" if available else f"missing {v.key}: build it")
  monkeypatch.setattr(ffi, "variant_available", answer)


def test_auto_on_hopper_without_built_kernels_warns_and_runs_the_reference(monkeypatch):
  _pretend_hopper(monkeypatch, available=False)
  q = jnp.asarray(np.random.default_rng(1).standard_normal((1, 8, 2, 64)), jnp.bfloat16)
  with pytest.warns(RuntimeWarning, match="(?s)missing fwd-sm90a-bf16-d64.*reference"):
    out = jaxflash.attention(q, q, q, causal=True)
  np.testing.assert_array_equal(out, jaxflash.attention(q, q, q, causal=True,
                                                        implementation="reference"))


def test_fallback_warning_names_the_users_line(monkeypatch):
  """The fallback warning points at the user's call, through jaxflash's frames, for 16-bit and FP8
  inputs alike (the FP8 call runs through one more of them)."""
  import sys
  _pretend_hopper(monkeypatch, available=False)
  q = jnp.asarray(np.random.default_rng(2).standard_normal((1, 8, 2, 64)), jnp.bfloat16)
  q8, k8, v8, qd, kd, vd = jaxflash.quantize_fp8(q, q, q)
  for args, kwargs in (((q, q, q), {}),
                       ((q8, k8, v8), dict(q_descale=qd, k_descale=kd, v_descale=vd))):
    with pytest.warns(RuntimeWarning, match="reference") as seen:
      line = sys._getframe().f_lineno + 1
      jaxflash.attention(*args, causal=True, **kwargs)
    assert (seen[0].filename, seen[0].lineno) == (__file__, line), args[0].dtype


def test_auto_on_hopper_picks_the_kernels_when_they_can_be_had(monkeypatch):
  import sys
  from jaxflash.config import AttentionConfig
  attention_module = sys.modules["jaxflash.attention"]  # jaxflash.attention is the function
  _pretend_hopper(monkeypatch, available=True)
  cfg = AttentionConfig(softmax_scale=0.125, causal=True)
  assert attention_module._resolve_implementation(None, "bfloat16", 64, 64, cfg) == "cute"
  # Calls the kernels do not cover stay on the reference without any warning.
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert attention_module._resolve_implementation(None, "float32", 64, 64, cfg) == "reference"


# Forward-only head dims: the Hopper forward kernel covers them, the backward kernels do not;
# gradients then come from the reference backward (conftest.without_192_128_backward).
FWD_ONLY_HEAD_DIMS = [FWD_ONLY_PAIR]


def test_forward_only_fixture_leaves_the_forward_and_takes_the_backward_kernel(
    without_192_128_backward):
  cfg = jaxflash.config.AttentionConfig(softmax_scale=1.0)
  for d, dv in FWD_ONLY_HEAD_DIMS:
    assert jaxflash.config.kernel_support("fwd", "bfloat16", d, dv, cfg) == (True, "")
    ok, reason = jaxflash.config.kernel_support("bwd", "bfloat16", d, dv, cfg)
    assert not ok and f"head_dim_v {dv}" in reason


@pytest.mark.parametrize("head_dim,head_dim_v", FWD_ONLY_HEAD_DIMS)
def test_auto_on_hopper_needs_only_the_forward_kernel_of_a_forward_only_head_dim(
    monkeypatch, without_192_128_backward, head_dim, head_dim_v):
  import sys
  from jaxflash import _jax_internal, ffi
  from jaxflash.config import AttentionConfig, fwd_schedule
  attention_module = sys.modules["jaxflash.attention"]
  asked = []
  monkeypatch.setattr(_jax_internal, "has_hopper_device", lambda: True)
  monkeypatch.setattr(ffi, "variant_available", lambda v: (asked.append(v.key), (True, ""))[1])
  cfg = AttentionConfig(softmax_scale=0.1, causal=True)
  assert attention_module._resolve_implementation(None, "bfloat16", head_dim, head_dim_v,
                                                  cfg) == "cute"
  schedule = fwd_schedule(head_dim, head_dim_v, True)
  assert asked == [f"fwd-sm90a-bf16-d{head_dim}-dv{head_dim_v}-causal-{schedule.key}"]


@pytest.mark.parametrize("head_dim,head_dim_v", FWD_ONLY_HEAD_DIMS)
def test_cute_grad_of_a_forward_only_head_dim_lowers_to_the_forward_kernel_only(
    without_192_128_backward, head_dim, head_dim_v):
  from jaxflash.config import BWD_TARGET, FWD_TARGET
  q, k, v = make_qkv(8, 2, 100, 64, 4, 2, head_dim, head_dim_v=head_dim_v, dtype=jnp.bfloat16)
  loss = lambda q, k, v: jnp.sum(jaxflash.attention(q, k, v, causal=True, implementation="cute")
                                 .astype(jnp.float32))
  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  text = grad.trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()
  assert BWD_TARGET not in text
  (call,) = [line for line in text.splitlines() if f"@{FWD_TARGET}(" in line]
  assert f'variant = "fwd-sm90a-bf16-d{head_dim}-dv{head_dim_v}-causal-' in call
  assert f"head_dim = {head_dim} : i32" in call and f"head_dim_v = {head_dim_v} : i32" in call
  # q, k, v in; out (b, seq_q, h, head_dim_v), lse and the causal schedule's tile counter out.
  assert (f"tensor<2x64x2x{head_dim_v}xbf16>) -> (tensor<2x100x4x{head_dim_v}xbf16>, "
          f"tensor<2x4x100xf32>, tensor<1xi32>)") in call


@pytest.mark.parametrize("implementation", [None, "cute"], ids=["auto", "cute"])
def test_only_a_gradient_looks_up_the_backward_kernel(monkeypatch, implementation):
  """A call without a gradient (inference) looks up and loads forward variants only; the
  backward variant is looked up when a gradient lowers (a Hopper host with a CUDA device and
  every variant at hand, pretended; the calls lower for CUDA on this CPU host)."""
  from jaxflash import _jax_internal, ffi
  from jaxflash.config import BWD_TARGET, FWD_TARGET
  asked = []  # keys of the variants looked up (variant_available) or loaded (ensure_variant)
  monkeypatch.setattr(_jax_internal, "has_cuda_device", lambda: True)
  monkeypatch.setattr(_jax_internal, "has_hopper_device", lambda: True)
  monkeypatch.setattr(ffi, "variant_available", lambda v: (asked.append(v.key), (True, ""))[1])
  monkeypatch.setattr(ffi, "ensure_variant", lambda v: asked.append(v.key))
  # Every variant is at hand: nothing may be built (a lookup that bypassed the two above).
  monkeypatch.setattr(ffi, "_build_on_demand", lambda v: pytest.fail(f"built {v.key}"))
  q, k, v = make_qkv(11, 1, 96, 80, 2, 2, 64, dtype=jnp.bfloat16)
  call = lambda q, k, v: jaxflash.attention(q, k, v, causal=True, implementation=implementation)
  text = jax.jit(call).trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()
  assert FWD_TARGET in text and BWD_TARGET not in text
  assert asked and all(key.startswith("fwd-") for key in asked), asked
  asked.clear()
  loss = lambda q, k, v: jnp.sum(call(q, k, v).astype(jnp.float32))
  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  text = grad.trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()
  assert FWD_TARGET in text and BWD_TARGET in text
  backward = {key for key in asked if key.startswith("bwd-")}
  assert len(backward) == 1 and "-bf16-d64-dv64-causal-" in backward.pop(), asked


def test_grad_with_head_dim_v_not_head_dim_on_the_reference():
  from jaxflash import reference
  from jaxflash.config import AttentionConfig
  q, k, v = make_qkv(9, 1, 12, 10, 4, 2, 24, head_dim_v=8)
  loss = lambda q, k, v: jnp.sum(jaxflash.attention(q, k, v, causal=True) ** 2)
  grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
  assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
  naive = lambda q, k, v: jnp.sum(reference.naive_attention(
      q, k, v, AttentionConfig(softmax_scale=24 ** -0.5, causal=True))[0] ** 2)
  for got, want in zip(grads, jax.grad(naive, argnums=(0, 1, 2))(q, k, v)):
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
