"""score_mod / mask_mod compiled into the kernels, on a Hopper GPU, against the float64 oracle
(the reference evaluating the same functions in float64): the forward and every gradient (dq,
dk, dv from the backward kernel where score_mod's derivative is a constant, else the
reference; the closed-over float arrays' gradients from the reference) for each recipe, at
lengths that straddle tiles, seq_q != seq_k, GQA 8:1, rows that see no key, a NaN in a
closed-over array, and the raw custom call into poisoned buffers.

The variants build on first use (nvidia-cutlass-dsl), or come from JAXFLASH_CACHE_DIR
(`kernel_variants()` lists them for a prebuild).
"""

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from jaxflash import block_ranges, config, ffi, mod_ir, nn, primitives
from jaxflash.config import BWD_TARGET, FWD_TARGET, AttentionConfig, KernelVariant
from tests import _mod_recipes as recipes
from tests._cases import make_qkv, x64
from tests._oracle import assert_close_to_oracle

pytestmark = pytest.mark.gpu


def _docs(b, s, seed=0):
  rng = np.random.default_rng(seed)
  return np.sort(rng.integers(0, 5, size=(b, s)), axis=1).astype(np.int32)


# name -> (recipe, its arrays from (batch, seq_q, seq_k, heads)). Each maker returns
# (score_mod, mask_mod) of the arrays, which stay float32 / int32 in every dtype.
RECIPES = {
    "identity": (lambda: (recipes.identity, None), lambda b, sq, sk, h: ()),
    "alibi": (lambda sl: (recipes.alibi(sl), None),
              lambda b, sq, sk, h: (recipes.alibi_slopes(h),)),
    "t5": (lambda tb: (recipes.t5(tb), None),
           lambda b, sq, sk, h: (np.random.default_rng(1).normal(size=(32, h)).astype(
               np.float32),)),
    "t5_distance": (lambda dt: (recipes.t5_by_distance(dt), None),
                    lambda b, sq, sk, h: (np.asarray(recipes.t5_distance_table(
                        np.random.default_rng(2).normal(size=(32, h)).astype(np.float32))),)),
    "softcap": (lambda: (recipes.softcap(5.0), None), lambda b, sq, sk, h: ()),
    "prefix_lm": (lambda p: (None, recipes.prefix_lm(p)),
                  lambda b, sq, sk, h: (np.arange(b, dtype=np.int32) * 37 + 5,)),
    "document": (lambda d: (None, recipes.document(d)), lambda b, sq, sk, h: (_docs(b, sk),)),
    "window": (lambda: (None, recipes.sliding_window(96)), lambda b, sq, sk, h: ()),
    "chunked": (lambda: (None, recipes.chunked(128)), lambda b, sq, sk, h: ()),
    "causal": (lambda: (None, recipes.causal), lambda b, sq, sk, h: ()),
    "alibi_document": (lambda sl, d: (recipes.alibi(sl), recipes.document(d)),
                       lambda b, sq, sk, h: (recipes.alibi_slopes(h), _docs(b, sk))),
    # jaxflash.dot_product_attention's boolean mask (batch, 1, seq_q, seq_k) as a mask_mod;
    # about 2 % of the pairs kept, so that some rows keep no key.
    "bool_mask": (lambda m: (None, nn._mask_mod(m)),
                  lambda b, sq, sk, h: (np.random.default_rng(74).random((b, 1, sq, sk)) < 0.02,)),
    # Rows q_idx % 7 == 0 see no key: out 0, lse -inf (as the built-in masks give).
    "empty_rows": (lambda: (None, lambda b, h, q, k: (q % 7 != 0) & (k <= q + 50)),
                   lambda b, sq, sk, h: ()),
}

# name -> (dtype, head_dim, (batch, seq_q, seq_k, heads, kv_heads), recipe, options)
CASES = {
    "alibi_bf16_d128_s1000": ("bfloat16", 128, (2, 1000, 1000, 8, 8), "alibi", {}),
    "alibi_f16_d64_q127_k1000_gqa8": ("float16", 64, (2, 127, 1000, 8, 1), "alibi", {}),
    "t5_bf16_d64_s129": ("bfloat16", 64, (3, 129, 129, 4, 2), "t5", {}),
    "t5_f16_d128_q1000_k257": ("float16", 128, (2, 1000, 257, 4, 4), "t5", {}),
    "t5_distance_bf16_d128_s1000": ("bfloat16", 128, (2, 1000, 1000, 8, 2), "t5_distance", {}),
    "softcap_bf16_d128_s700": ("bfloat16", 128, (2, 700, 700, 4, 2), "softcap", {}),
    "identity_bf16_d128_causal": ("bfloat16", 128, (2, 513, 513, 4, 4), "identity",
                                  {"causal": True}),
    "alibi_bf16_d128_causal": ("bfloat16", 128, (2, 513, 513, 4, 4), "alibi", {"causal": True}),
    "prefix_lm_f16_d128_s300": ("float16", 128, (3, 300, 300, 4, 1), "prefix_lm", {}),
    "document_bf16_d64_s1000": ("bfloat16", 64, (2, 1000, 1000, 8, 2), "document", {}),
    "window_bf16_d128_s777": ("bfloat16", 128, (2, 777, 777, 4, 4), "window", {}),
    "chunked_bf16_d64_s600": ("bfloat16", 64, (2, 600, 600, 4, 4), "chunked", {}),
    "causal_f16_d64_q1_k129": ("float16", 64, (3, 1, 129, 4, 2), "causal", {}),
    "alibi_document_bf16_d128_sink": ("bfloat16", 128, (2, 400, 400, 4, 2), "alibi_document",
                                      {"sink": True}),
    "empty_rows_bf16_d64": ("bfloat16", 64, (2, 300, 200, 4, 4), "empty_rows", {}),
    # The variant of tests/test_nn_dot_product_attention.py's GPU boolean-mask case.
    "bool_mask_bf16_d128_gqa": ("bfloat16", 128, (2, 300, 520, 8, 1), "bool_mask", {}),
}


def _case(name):
  dtype, d, (b, sq, sk, h, h_kv), recipe, options = CASES[name]
  seed = zlib.crc32(name.encode())
  q, k, v = make_qkv(seed, b, sq, sk, h, h_kv, d, dtype=jnp.dtype(dtype))
  make, arrays = RECIPES[recipe]
  arrays = tuple(jnp.asarray(a) for a in arrays(b, sq, sk, h))
  rng = np.random.default_rng(seed + 1)
  w_out = jnp.asarray(jnp.asarray(rng.standard_normal(q.shape), q.dtype), jnp.float32)
  w_lse = jnp.asarray(rng.standard_normal((b, h, sq)), jnp.float32)
  kwargs = {"causal": options.get("causal", False)}
  if options.get("sink"):
    kwargs["learnable_sink"] = jnp.asarray(rng.normal(1.0, 2.0, h), jnp.float32)
  return q, k, v, make, arrays, w_out, w_lse, kwargs


def case_variant(name, direction: str = "fwd"):
  """The variant a case runs in `direction` (from the functions' IR, as jaxflash.attention
  finds it), or None where that direction runs the reference."""
  q, k, v, make, arrays, _, _, kwargs = _case(name)
  d, dtype = q.shape[-1], np.dtype(q.dtype).name
  cfg = AttentionConfig(softmax_scale=d ** -0.5, causal=kwargs["causal"],
                        has_sink="learnable_sink" in kwargs)
  if CASES[name][3] != "identity":  # the identity score_mod runs the plain call's variant
    cfg = cfg.replace(mods=mod_ir.trace_mods(*make(*arrays)).spec.canonical())
  if not config.kernel_support(direction, dtype, d, d, cfg)[0]:
    return None
  return KernelVariant.for_call(direction, "sm90a", dtype, d, d, cfg, k.shape[1])


def kernel_variants() -> list:
  """Every variant these tests run, for a prebuild (python -m jaxflash.build --spec)."""
  found = (case_variant(name, direction) for name in CASES for direction in ("fwd", "bwd"))
  return list({v.key: v for v in found if v is not None}.values())


def _attend(make, kwargs, implementation="cute"):
  def attend(q, k, v, *arrays):
    score_mod, mask_mod = make(*arrays)
    return jaxflash.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod,
                              return_lse=True, implementation=implementation, **kwargs)
  return attend


def _float_argnums(arrays):
  return (0, 1, 2) + tuple(3 + i for i, a in enumerate(arrays)
                           if jnp.issubdtype(a.dtype, jnp.floating))


def _loss(attend, w_out, w_lse):
  def loss(q, k, v, *arrays):
    out, lse = attend(q, k, v, *arrays)
    lse_term = jnp.where(jnp.isfinite(lse), lse * w_lse.astype(lse.dtype), 0)
    return jnp.sum(out * w_out.astype(out.dtype)) + jnp.sum(lse_term)
  return loss


def _reference(q, k, v, make, arrays, w_out, w_lse, kwargs, dtype):
  """out, lse and the gradients on the reference, in `dtype` (float64: the oracle)."""
  kw = dict(kwargs)
  if "learnable_sink" in kw:
    kw["learnable_sink"] = kw["learnable_sink"].astype(jnp.promote_types(dtype, jnp.float32))
  attend = _attend(make, kw, "reference")
  argnums = _float_argnums(arrays)
  args = (q, k, v) + arrays
  outs = tuple(attend(*args)) + tuple(jax.grad(_loss(attend, w_out, w_lse), argnums)(*args))
  return tuple(np.asarray(x, np.float64) for x in outs)


@pytest.mark.parametrize("name", CASES, ids=CASES.keys())
def test_forward_and_gradients_match_float64_oracle(name):
  q, k, v, make, arrays, w_out, w_lse, kwargs = _case(name)
  attend = jax.jit(_attend(make, kwargs))
  assert case_variant(name).key in attend.lower(q, k, v, *arrays).as_text()
  argnums = _float_argnums(arrays)
  grads = jax.jit(jax.grad(_loss(_attend(make, kwargs), w_out, w_lse), argnums))
  bwd = case_variant(name, "bwd")
  grad_text = grads.lower(q, k, v, *arrays).as_text()
  if bwd is None:  # score_mod's derivative varies: the reference backward
    assert BWD_TARGET not in grad_text
  else:
    assert bwd.key in grad_text
  got = tuple(attend(q, k, v, *arrays)) + tuple(grads(q, k, v, *arrays))
  naive = _reference(q, k, v, make, arrays, w_out, w_lse, kwargs, q.dtype)
  with x64():
    wide = tuple(jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v))
    wide_arrays = tuple(jnp.asarray(np.asarray(a, np.float64)) if jnp.issubdtype(
        a.dtype, jnp.floating) else a for a in arrays)
    exact = _reference(*wide, make, wide_arrays, w_out, w_lse, kwargs, jnp.float64)
  labels = ("out", "lse", "dq", "dk", "dv") + tuple(f"d_array{i - 3}" for i in argnums[3:])
  for label, g, e, n in zip(labels, got, exact, naive):
    assert_close_to_oracle(g, e, n, name=f"{name} {label}")
  if CASES[name][3] == "empty_rows":
    out, lse = got[:2]
    rows = np.arange(q.shape[1]) % 7 == 0
    assert np.all(np.asarray(out, np.float32)[:, rows] == 0)
    assert np.all(np.isneginf(np.asarray(lse)[:, :, rows]))


def test_nan_in_a_closed_over_array_reaches_only_its_scores():
  """ALiBi with a NaN slope for head 1: head 1's rows are NaN, the other heads match the
  call without the NaN (a NaN is never masked away or clamped)."""
  q, k, v, make, (slopes,), _, _, kwargs = _case("alibi_bf16_d128_s1000")
  attend = jax.jit(_attend(make, kwargs))
  poisoned = slopes.at[1].set(jnp.nan)
  out, _ = attend(q, k, v, poisoned)
  clean, _ = attend(q, k, v, slopes)
  out, clean = np.asarray(out, np.float32), np.asarray(clean, np.float32)
  assert np.isnan(out[:, :, 1]).all()
  others = [h for h in range(q.shape[2]) if h != 1]
  np.testing.assert_array_equal(out[:, :, others], clean[:, :, others])


# keep_unused: jit would otherwise drop the unread buffers, and their donation with them.
@functools.partial(jax.jit, static_argnames=("variant", "cfg"), donate_argnums=(3, 4),
                   keep_unused=True)
def _fwd_into(q, k, v, out_buffer, lse_buffer, *arrays, variant, cfg):
  del out_buffer, lse_buffer  # donated: XLA writes the results into their memory
  b, seq_q, h, _ = q.shape
  result = (jax.ShapeDtypeStruct((b, seq_q, h, variant.head_dim_v), q.dtype),
            jax.ShapeDtypeStruct((b, h, seq_q), jnp.float32))
  result += tuple(jax.ShapeDtypeStruct(shape, dt)
                  for _, shape, dt in config.fwd_scratch_shapes(variant))
  # The block mask of mask_mod, as the lowering passes it: the full range skips mask_mod.
  operands = block_ranges.forward_operands(
      variant, cfg, b, seq_q, k.shape[1], (),
      primitives.mods_block_mask(cfg, arrays, b, h, seq_q, k.shape[1]))
  return jax.ffi.ffi_call(FWD_TARGET, result)(q, k, v, *operands, *arrays,
                                              **ffi.fwd_attributes(variant, cfg))[:2]


@pytest.mark.parametrize("name", ["t5_bf16_d64_s129", "alibi_document_bf16_d128_sink"])
def test_raw_forward_writes_every_element_of_poisoned_buffers(name):
  """The mods variant's custom call into NaN-filled donated buffers: every out and lse element
  is written and matches the reference call."""
  q, k, v, make, arrays, _, _, _ = _case(name)
  variant = case_variant(name)
  ffi.ensure_variant(variant)
  cfg = AttentionConfig(softmax_scale=q.shape[-1] ** -0.5, implementation="cute",
                        mods=variant.mods)
  out_buffer = jnp.full(q.shape[:3] + (variant.head_dim_v,), jnp.nan, q.dtype)
  lse_buffer = jnp.full((q.shape[0], q.shape[2], q.shape[1]), jnp.nan, jnp.float32)
  pointers = (out_buffer.unsafe_buffer_pointer(), lse_buffer.unsafe_buffer_pointer())
  traced = mod_ir.trace_mods(*make(*arrays))
  out, lse = _fwd_into(q, k, v, out_buffer, lse_buffer, *traced.arrays, variant=variant,
                       cfg=cfg)
  assert (out.unsafe_buffer_pointer(), lse.unsafe_buffer_pointer()) == pointers, (
      "XLA did not write into the poisoned buffers: the test would miss unwritten elements")
  want_out, want_lse = _attend(make, {}, "reference")(q, k, v, *arrays)
  naive = (np.asarray(want_out, np.float64), np.asarray(want_lse, np.float64))
  with x64():
    wide = tuple(jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v))
    exact = _attend(make, {}, "reference")(*wide, *arrays)
  assert_close_to_oracle(out, exact[0], naive[0], name="out")
  assert_close_to_oracle(lse, exact[1], naive[1], name="lse")


def test_a_second_process_loads_the_cached_variant(tmp_path):
  """First use builds (or finds) the variant; a new process finds it in the cache by the
  functions' hash and builds nothing."""
  import subprocess
  import sys
  import textwrap
  name = "t5_bf16_d64_s129"
  ffi.ensure_variant(case_variant(name))
  script = textwrap.dedent(f"""
      import time, jax
      from tests import test_gpu_mods as t
      q, k, v, make, arrays, _, _, kwargs = t._case({name!r})
      start = time.perf_counter()
      jax.block_until_ready(jax.jit(t._attend(make, kwargs))(q, k, v, *arrays))
      print("SECONDS", time.perf_counter() - start)
  """)
  proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                        env=dict(__import__("os").environ, JAXFLASH_BUILD_ON_DEMAND="0"),
                        cwd=str(__import__("pathlib").Path(__file__).parents[1]))
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
  assert "building kernel variant" not in proc.stderr
