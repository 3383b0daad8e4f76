"""CuTe kernels on a Hopper GPU: every shipped forward and backward variant vs the float64 oracle.

Outputs are poisoned: the raw FFI call writes into donated NaN-filled buffers (checked to be the
same memory), so an element the kernel leaves unwritten shows up as NaN.
Run with JAXFLASH_CACHE_DIR pointing at prebuilt kernels (scripts/gpu_check.sh). The public
calls here take the prefill kernels at every shape, few query rows included (which
jaxflash.attention otherwise runs on the decode kernel: tests/test_gpu_few_rows.py).
"""

import functools
import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from jaxflash import block_ranges, config, few_rows, ffi, reference
from jaxflash.config import FWD_TARGET, AttentionConfig, KernelVariant
from tests._cases import make_qkv, x64
from tests._oracle import assert_close_to_oracle
from tests.conftest import FWD_ONLY_PAIR

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def _prefill_kernels_only():
  """No call of this module on the decode kernel: these tests are the prefill kernels' own."""
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(few_rows, "MAX_PACKED_ROWS", 0)
    yield

# Dense fp16/bf16; masked: below; FP8: tests/test_gpu_fp8.py.
VARIANTS = [v for v in config.shipped_variants() if not v.masked and v.dtype != config.FP8_DTYPE]
SHAPES = {  # name -> (batch, seq_q, seq_k, heads, kv_heads)
    "s1": (3, 1, 1, 4, 4),
    "s17_gqa": (2, 17, 17, 8, 2),
    "s1000_mqa": (1, 1000, 1000, 4, 1),
    "s4097": (1, 4097, 4097, 2, 2),
    "q17_k1000_gqa": (2, 17, 1000, 4, 2),
    "q1000_k17": (1, 1000, 17, 4, 4),  # causal: the first 983 rows see no key
    # More tiles than SMs: persistent CTAs walk several tiles (cycling their Q slots), and
    # causal tiles start above row 0 (700 is no multiple of a tile).
    "s700_gqa_tiles_over_sms": (2, 700, 700, 40, 8),
    # Causal: the longest calls that still run as a tile list (config.CAUSAL_PERSISTENT_MAX_KEYS).
    "s1543_list": (2, 1543, 1543, 8, 2),
}


def _config(variant: KernelVariant) -> AttentionConfig:
  return AttentionConfig(softmax_scale=variant.head_dim ** -0.5, causal=variant.causal,
                         implementation="cute")


def _ffi_call(q, k, v, variant, cfg, segment_ids=(), sink=None):
  """The raw forward custom call's (out, lse); a masked variant gets its operands from the
  segment ids; the learnable sink, when given, is the last operand; the variant's scratch
  (config.fwd_scratch_shapes) is allocated as further results."""
  b, seq_q, h, _ = q.shape
  result = (jax.ShapeDtypeStruct((b, seq_q, h, variant.head_dim_v), q.dtype),
            jax.ShapeDtypeStruct((b, h, seq_q), jnp.float32))
  result += tuple(jax.ShapeDtypeStruct(shape, dtype)
                  for _, shape, dtype in config.fwd_scratch_shapes(variant))
  operands = ()
  if variant.masked:
    operands = block_ranges.forward_operands(variant, cfg, b, seq_q, k.shape[1], segment_ids)
  if sink is not None:
    operands = tuple(operands) + (sink,)
  return jax.ffi.ffi_call(FWD_TARGET, result)(q, k, v, *operands,
                                              **ffi.fwd_attributes(variant, cfg))[:2]


# keep_unused: jit would otherwise drop the unread buffers, and their donation with them.
@functools.partial(jax.jit, static_argnames=("variant", "cfg"), donate_argnums=(3, 4),
                   keep_unused=True)
def _fwd_into(q, k, v, out_buffer, lse_buffer, *segment_ids, variant, cfg, sink=None):
  del out_buffer, lse_buffer  # donated: XLA writes the results into their memory
  return _ffi_call(q, k, v, variant, cfg, segment_ids, sink)


def poisoned_fwd(q, k, v, variant, cfg, segment_ids=(), sink=None):
  """The raw custom call, writing into NaN-filled buffers; fails if XLA did not reuse them."""
  b, seq_q, h, _ = q.shape
  out_buffer = jnp.full((b, seq_q, h, variant.head_dim_v), jnp.nan, q.dtype)
  lse_buffer = jnp.full((b, h, seq_q), jnp.nan, jnp.float32)
  pointers = (out_buffer.unsafe_buffer_pointer(), lse_buffer.unsafe_buffer_pointer())
  out, lse = _fwd_into(q, k, v, out_buffer, lse_buffer, *segment_ids, variant=variant, cfg=cfg,
                       sink=sink)
  if out.size and lse.size:
    assert (out.unsafe_buffer_pointer(), lse.unsafe_buffer_pointer()) == pointers, (
        "XLA did not write into the poisoned buffers: the test would miss unwritten elements")
  return out, lse


_naive = jax.jit(reference.naive_attention, static_argnums=(3,),
                 static_argnames=("compute_dtype",))


def _oracle(q, k, v, cfg, segment_ids=(None, None), sink=None):
  """(float64 out, lse) of the rounded inputs, and the naive in-dtype (out, lse)."""
  cfg = cfg.replace(implementation="reference")
  naive = _naive(q, k, v, cfg, *segment_ids, compute_dtype=np.dtype(q.dtype),
                 learnable_sink=sink)
  with x64():
    q64, k64, v64 = (jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v))
    sink64 = None if sink is None else jnp.asarray(np.asarray(sink, np.float64))
    exact = tuple(np.asarray(x) for x in _naive(q64, k64, v64, cfg, *segment_ids,
                                                learnable_sink=sink64))
  return exact, tuple(np.asarray(x, np.float64) for x in naive)


@pytest.fixture(scope="module", autouse=True)
def _registered():
  for direction in ("fwd", "bwd"):  # the attention variants these tests run
    for variant in config.shipped_variants(direction=direction):
      ffi.ensure_variant(variant)  # fails with the build command if the cache lacks one


def _public_runs(variant, cfg, seq_k):
  """The forward variant jaxflash.attention runs for `cfg` over seq_k keys, in `variant`'s dtype
  and head dims."""
  return KernelVariant.for_call("fwd", "sm90a", variant.dtype, variant.head_dim,
                                variant.head_dim_v, cfg, seq_k)


def _check_public_path(public, raw, variant, cfg, seq_k, oracle):
  """jaxflash.attention's (out, lse) against the raw call of `variant`: bitwise where the public
  path runs that variant (same kernel, same attributes); where config.fwd_schedule picks
  another variant of these head dims for this call, against the oracle ((want, naive))."""
  runs = _public_runs(variant, cfg, seq_k)
  for name, got, raw_x, want, naive in zip(("out", "lse"), public, raw, *oracle):
    if runs == variant:
      np.testing.assert_array_equal(got, raw_x)
    else:
      assert_close_to_oracle(got, want, naive, name=f"public {name} ({runs.key})")


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("variant", VARIANTS, ids=[v.key for v in VARIANTS])
def test_forward_matches_float64_oracle(variant, shape):
  b, seq_q, seq_k, h, h_kv = shape
  dtype = jnp.dtype(variant.dtype)
  q, k, v = make_qkv(zlib.crc32(f"{variant.key}{shape}".encode()), b, seq_q, seq_k, h, h_kv,
                     variant.head_dim, head_dim_v=variant.head_dim_v, dtype=dtype)
  cfg = _config(variant)
  out, lse = jaxflash.attention(q, k, v, causal=variant.causal, return_lse=True,
                                implementation="cute")
  raw_out, raw_lse = poisoned_fwd(q, k, v, variant, cfg)
  (want_out, want_lse), (naive_out, naive_lse) = _oracle(q, k, v, cfg)
  assert_close_to_oracle(raw_out, want_out, naive_out, name="out")
  assert_close_to_oracle(raw_lse, want_lse, naive_lse, name="lse")
  _check_public_path((out, lse), (raw_out, raw_lse), variant, cfg, seq_k,
                     ((want_out, want_lse), (naive_out, naive_lse)))
  again_out, again_lse = jaxflash.attention(q, k, v, causal=variant.causal, return_lse=True,
                                            implementation="cute")
  np.testing.assert_array_equal(again_out, out)
  np.testing.assert_array_equal(again_lse, lse)
  if variant.causal and seq_q > seq_k:
    empty = seq_q - seq_k  # bottom-right alignment: these rows see no key
    assert not np.asarray(raw_out[:, :empty], np.float32).any()
    assert np.all(np.asarray(raw_lse[:, :, :empty]) == -np.inf)


def test_poisoned_buffers_are_the_custom_call_results():
  """No copy between the custom call and the donated buffers, so the kernel writes into NaNs."""
  variant = VARIANTS[0]
  q, k, v = make_qkv(6, 1, 64, 64, 2, 2, variant.head_dim, dtype=jnp.dtype(variant.dtype))
  out_buffer = jnp.zeros((1, 64, 2, variant.head_dim_v), q.dtype)
  lse_buffer = jnp.zeros((1, 2, 64), jnp.float32)
  hlo = _fwd_into.lower(q, k, v, out_buffer, lse_buffer, variant=variant,
                        cfg=_config(variant)).compile().as_text()
  assert FWD_TARGET in hlo
  assert not re.search(r"\bcopy(-start)?\(", hlo), hlo


def test_no_keys_gives_zero_output_and_neg_inf_lse():
  variant = VARIANTS[0]
  q, k, v = make_qkv(7, 2, 5, 0, 2, 2, variant.head_dim, dtype=jnp.dtype(variant.dtype))
  out, lse = poisoned_fwd(q, k, v, variant, _config(variant))
  assert not np.asarray(out, np.float32).any()
  assert np.all(np.asarray(lse) == -np.inf)


@pytest.mark.parametrize("mask", ["plain", "causal", "segments"])
def test_nan_inputs_give_nan_where_the_reference_does(mask):
  """A NaN in one query row and one key (the dense, causal and masked kernels): out and lse are
  NaN exactly where the reference's are, and match it elsewhere."""
  q, k, v = make_qkv(11, 2, 300, 300, 4, 2, 128, dtype=jnp.bfloat16)
  q = q.at[0, 5, 1, 3].set(jnp.nan)  # batch 0, query 5, head 1
  k = k.at[1, 200, 0, 7].set(jnp.nan)  # batch 1, key 200, kv head 0: heads 0 and 1 see it
  kwargs = {"causal": mask == "causal"}
  if mask == "segments":
    ids = jnp.broadcast_to((jnp.arange(300) >= 150).astype(jnp.int32), (2, 300))
    kwargs.update(q_segment_ids=ids, kv_segment_ids=ids)
  got = jaxflash.attention(q, k, v, return_lse=True, implementation="cute", **kwargs)
  want = jaxflash.attention(q, k, v, return_lse=True, implementation="reference", **kwargs)
  for name, g, w in zip(("out", "lse"), got, want):
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    assert np.isnan(w).any(), f"{name}: the case must have NaN rows"
    np.testing.assert_array_equal(np.isnan(g), np.isnan(w), err_msg=name)
    finite = ~np.isnan(w)
    np.testing.assert_allclose(g[finite], w[finite], rtol=2e-2, atol=2e-2, err_msg=name)


def test_empty_batch_is_a_no_op():
  variant = VARIANTS[0]
  q, k, v = make_qkv(8, 0, 5, 6, 2, 2, variant.head_dim, dtype=jnp.dtype(variant.dtype))
  out, lse = jax.block_until_ready(jax.jit(_ffi_call, static_argnums=(3, 4))(
      q, k, v, variant, _config(variant)))
  assert out.shape == (0, 5, 2, variant.head_dim_v) and lse.shape == (0, 2, 5)


def _run_raw(q, k, v, kernel, cfg, scratch=(), **attr_changes):
  """The raw forward call with out, lse and the results `scratch` ((shape, dtype), ...)."""
  attrs = dict(ffi.fwd_attributes(kernel, cfg), **attr_changes)
  b, seq_q, h, _ = q.shape
  result = (jax.ShapeDtypeStruct((b, seq_q, h, v.shape[-1]), q.dtype),
            jax.ShapeDtypeStruct((b, h, seq_q), jnp.float32))
  result += tuple(jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in scratch)
  return jax.block_until_ready(
      jax.jit(lambda *a: jax.ffi.ffi_call(FWD_TARGET, result)(*a, **attrs))(q, k, v))


def test_handler_rejects_inconsistent_calls_with_named_errors():
  variant = next(v for v in VARIANTS if v.head_dim == 128 and not v.causal)
  cfg = _config(variant)
  dtype = jnp.dtype(variant.dtype)
  q, k, v = make_qkv(9, 2, 16, 16, 4, 2, 128, dtype=dtype)
  with pytest.raises(Exception, match=r"jaxflash_attention_fwd\[variant=.*head_dim=64"):
    _run_raw(q, k, v, variant, cfg, head_dim=np.int32(64))
  with pytest.raises(Exception, match=r"causal=true does not match"):
    _run_raw(q, k, v, variant, cfg, causal=True)
  bad_k = k[:1]
  with pytest.raises(Exception, match=r"do not fit q"):
    _run_raw(q, bad_k, v[:1], variant, cfg)
  q3 = make_qkv(10, 2, 16, 16, 3, 2, 128, dtype=dtype)[0]
  with pytest.raises(Exception, match=r"num_heads 3 is not a multiple of num_kv_heads 2"):
    _run_raw(q3, k, v, variant, cfg)
  unknown = variant.key.replace("m128", "m64")
  with pytest.raises(Exception, match=rf"'{unknown}' is in none of the kernel folders.*"
                                      rf"--variants {unknown}"):
    _run_raw(q, k, v, variant, cfg, variant=unknown)


def test_handler_checks_the_tile_counter_of_dynamic_schedules():
  """A dynamic schedule's call carries its tile counter as a third result (int32 (1,)); a
  static one carries none. Anything else is refused with the count or shape it saw."""
  dynamic = next(v for v in VARIANTS if v.schedule.dynamic)
  static = next(v for v in VARIANTS if not v.schedule.dynamic)
  for variant, scratch, match in (
      (dynamic, (), r"0 results after out and lse, the variant takes 1 \(its tile counter\)"),
      (dynamic, (((2,), jnp.int32),), r"tile_counter is int32 \(2,\), expected int32 \(1\)"),
      (static, (((1,), jnp.int32),), r"1 results after out and lse, the variant takes 0")):
    cfg = _config(variant)
    q, k, v = make_qkv(14, 1, 200, 200, 2, 2, variant.head_dim, dtype=jnp.dtype(variant.dtype))
    with pytest.raises(Exception, match=match):
      _run_raw(q, k, v[..., :variant.head_dim_v], variant, cfg, scratch)


def test_command_buffer_moving_buffers():
  """A jitted chain of calls over inputs that move. The handlers are command-buffer compatible,
  so XLA records the chain into a CUDA graph by stream capture and replays it; a handler that
  makes a call illegal under capture fails here (cudaErrorStreamCaptureInvalidated)."""
  variant = next(v for v in VARIANTS if v.head_dim == 64 and v.causal)
  cfg = _config(variant)
  dtype = jnp.dtype(variant.dtype)
  chain = 6  # above XLA's minimum command-buffer size

  @jax.jit
  def many(qs, k, v):
    return [_ffi_call(qs[i], k, v, variant, cfg)[0] for i in range(chain)]

  single = jax.jit(lambda q, k, v: _ffi_call(q, k, v, variant, cfg)[0])
  runs = []
  for seed in (11, 12, 11):
    rng = np.random.default_rng(seed)
    qs = jnp.asarray(rng.standard_normal((chain, 1, 300, 4, 64)), dtype)
    _, k, v = make_qkv(seed, 1, 300, 300, 4, 2, 64, dtype=dtype)
    outs = jax.block_until_ready(many(qs, k, v))
    runs.append((qs, k, v, outs))
  for qs, k, v, outs in runs:  # earlier outputs must not have been overwritten later
    for i in range(chain):
      np.testing.assert_array_equal(outs[i], single(qs[i], k, v))
  np.testing.assert_array_equal(runs[0][3][0], runs[2][3][0])


def test_handler_checks_v_and_out_against_head_dim_v():
  """A head_dim_v != head_dim variant: v and out must carry head_dim_v, not head_dim."""
  variant = next(v for v in VARIANTS if v.head_dim != v.head_dim_v)
  cfg = _config(variant)
  d, dv = variant.head_dim, variant.head_dim_v
  q, k, v_wrong = make_qkv(13, 1, 16, 16, 2, 2, d, dtype=jnp.dtype(variant.dtype))
  with pytest.raises(Exception, match=rf"do not fit q .*v \(b, sk, hk, {dv}\)"):
    _run_raw(q, k, v_wrong, variant, cfg)
  v = v_wrong[..., :dv]
  result = (jax.ShapeDtypeStruct((1, 16, 2, d), q.dtype),
            jax.ShapeDtypeStruct((1, 2, 16), jnp.float32))
  with pytest.raises(Exception, match=rf"out is {variant.dtype} \(1, 16, 2, {d}\), expected "
                                      rf"{variant.dtype} \(1, 16, 2, {dv}\)"):
    jax.block_until_ready(jax.jit(lambda *a: jax.ffi.ffi_call(FWD_TARGET, result)(
        *a, **ffi.fwd_attributes(variant, cfg)))(q, k, v))


# Forward variants without a backward kernel: jax.grad runs the forward kernel and the
# reference backward (primitives._bwd_lower_cuda). Every forward pair has a backward kernel
# now: conftest.without_192_128_backward takes (192, 128)'s away for this test.
_FWD_ONLY = [v for v in VARIANTS if v.dtype == "bfloat16" and (v.head_dim, v.head_dim_v)
             == FWD_ONLY_PAIR]


@pytest.mark.parametrize("variant", _FWD_ONLY, ids=lambda v: v.key)
def test_grad_of_a_forward_only_variant_runs_the_reference_backward(variant,
                                                                     without_192_128_backward):
  b, seq_q, seq_k, h, h_kv = (1, 300, 70, 4, 2) if variant.causal else (2, 200, 200, 4, 2)
  dtype = jnp.dtype(variant.dtype)
  seed = zlib.crc32(f"fwd-only{variant.key}".encode())
  q, k, v = make_qkv(seed, b, seq_q, seq_k, h, h_kv, variant.head_dim,
                     head_dim_v=variant.head_dim_v, dtype=dtype)
  rng = np.random.default_rng(seed + 1)
  w_out = np.asarray(jnp.asarray(rng.standard_normal((b, seq_q, h, variant.head_dim_v)), dtype),
                     np.float64)
  w_lse = rng.standard_normal((b, h, seq_q))
  args = (q, k, v, jnp.asarray(w_out, jnp.float32), jnp.asarray(w_lse, jnp.float32))
  kw = dict(causal=variant.causal, deterministic=False, with_lse=True)
  hlo = _cute_grads.lower(*args, **kw).as_text()
  assert variant.key in hlo and config.BWD_TARGET not in hlo
  got = _cute_grads(*args, **kw)
  want, naive = _grad_oracle(q, k, v, w_out, w_lse, variant, with_lse=True)
  for name, g, x, w, n in zip(("dq", "dk", "dv"), got, (q, k, v), want, naive):
    assert g.shape == x.shape and g.dtype == x.dtype, (name, g.shape, g.dtype)
    assert_close_to_oracle(g, w, n, name=name)


# ---------------------------------------------------------------------------------------------
# Backward kernels: gradients through jax.grad(jaxflash.attention(..., implementation="cute")).

BWD_VARIANTS = [v for v in config.shipped_variants(direction="bwd") if not v.masked]
BWD_SHAPES = {  # name -> (batch, seq_q, seq_k, heads, kv_heads); none a multiple of a tile
    "s200_gqa": (2, 200, 200, 8, 2),
    "q70_k300_mqa": (1, 70, 300, 4, 1),
    "q300_k70": (1, 300, 70, 4, 4),  # causal: the first 230 rows see no key
}
# Deterministic mode. Long enough that many key blocks add into each dq row block (the order that
# can vary). Without a mask, seq_q >= seq_k runs bwd_sm90's rotated order (each key block starts
# on another query block; hdim 128: 8 key blocks over 13 query blocks), seq_k > seq_q the
# ascending one.
_DET_SHAPES = {"k2048_q1024": (1, 1024, 2048, 8, 2), "s1000_rotated": (1, 1000, 1000, 8, 2)}


def _grad_inputs(variant, shape, seed_text):
  """q, k, v and the cotangents of out (bf16/fp16-exact) and of lse, for one case."""
  b, seq_q, seq_k, h, h_kv = shape
  dtype = jnp.dtype(variant.dtype)
  seed = zlib.crc32(seed_text.encode())
  q, k, v = make_qkv(seed, b, seq_q, seq_k, h, h_kv, variant.head_dim,
                     head_dim_v=variant.head_dim_v, dtype=dtype)
  rng = np.random.default_rng(seed + 1)
  # Representable in the input dtype: the kernel's d_out is the cotangent cast to it.
  w_out = np.asarray(jnp.asarray(rng.standard_normal((b, seq_q, h, variant.head_dim_v)), dtype),
                     np.float64)
  w_lse = rng.standard_normal((b, h, seq_q))
  return q, k, v, w_out, w_lse


def _loss(attend, w_out, w_lse, with_lse):
  """sum(out * w_out) [+ sum(lse * w_lse) over rows that see a key]: d_out and d_lse."""

  def loss(q, k, v):
    out, lse = attend(q, k, v)
    total = jnp.sum(out.astype(w_out.dtype) * w_out)
    if with_lse:
      total += jnp.sum(jnp.where(jnp.isinf(lse), 0, lse).astype(w_lse.dtype) * w_lse)
    return total

  return loss


@functools.partial(jax.jit, static_argnames=("causal", "deterministic", "with_lse"))
def _cute_grads(q, k, v, w_out, w_lse, *, causal, deterministic, with_lse):
  attend = lambda q, k, v: jaxflash.attention(q, k, v, causal=causal, return_lse=True,
                                              deterministic=deterministic, implementation="cute")
  return jax.grad(_loss(attend, w_out, w_lse, with_lse), argnums=(0, 1, 2))(q, k, v)


@functools.partial(jax.jit, static_argnames=("cfg", "with_lse", "compute_dtype"))
def _naive_grads(q, k, v, w_out, w_lse, q_ids=None, kv_ids=None, *, cfg, with_lse,
                 compute_dtype):
  attend = lambda q, k, v: reference.naive_attention(q, k, v, cfg, q_ids, kv_ids,
                                                     compute_dtype=compute_dtype)
  return jax.grad(_loss(attend, w_out, w_lse, with_lse), argnums=(0, 1, 2))(q, k, v)


def _grad_oracle(q, k, v, w_out, w_lse, variant, with_lse, cfg=None, segment_ids=(None, None)):
  """(float64 dq, dk, dv of the rounded inputs, naive in-dtype dq, dk, dv)."""
  cfg = (cfg or _config(variant)).replace(implementation="reference")
  dtype = np.dtype(q.dtype)
  naive = _naive_grads(q, k, v, jnp.asarray(w_out, jnp.float32), jnp.asarray(w_lse, jnp.float32),
                       *segment_ids, cfg=cfg, with_lse=with_lse, compute_dtype=dtype)
  with x64():
    args = [jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v)]
    exact = _naive_grads(*args, jnp.asarray(w_out), jnp.asarray(w_lse), *segment_ids, cfg=cfg,
                         with_lse=with_lse, compute_dtype=None)
    exact = tuple(np.asarray(g) for g in exact)
  return exact, tuple(np.asarray(g, np.float64) for g in naive)


def _check_grads(variant, shape, with_lse):
  q, k, v, w_out, w_lse = _grad_inputs(variant, shape, f"bwd{variant.key}{shape}")
  got = _cute_grads(q, k, v, jnp.asarray(w_out, jnp.float32), jnp.asarray(w_lse, jnp.float32),
                    causal=variant.causal, deterministic=variant.deterministic,
                    with_lse=with_lse)
  want, naive = _grad_oracle(q, k, v, w_out, w_lse, variant, with_lse)
  for name, g, x, w, n in zip(("dq", "dk", "dv"), got, (q, k, v), want, naive):
    assert g.shape == x.shape and g.dtype == x.dtype, (name, g.shape, g.dtype)
    assert_close_to_oracle(g, w, n, name=name)
  return got


def test_cute_grad_lowers_to_the_backward_kernel():
  variant = BWD_VARIANTS[0]
  q, k, v, w_out, w_lse = _grad_inputs(variant, BWD_SHAPES["s200_gqa"], "lowering")
  hlo = _cute_grads.lower(q, k, v, jnp.asarray(w_out, jnp.float32),
                          jnp.asarray(w_lse, jnp.float32), causal=variant.causal,
                          deterministic=variant.deterministic, with_lse=False).as_text()
  assert config.BWD_TARGET in hlo and variant.key in hlo


# Every variant on two shapes; with and without determinism together they cover all three for
# each dtype / head_dim / causal (kept short: every case compiles its own program).
_BWD_CASES = [(v, s) for v in BWD_VARIANTS for s in BWD_SHAPES
              if s == "s200_gqa" or (s == "q70_k300_mqa") == v.deterministic]


@pytest.mark.parametrize("variant,shape", _BWD_CASES,
                         ids=[f"{v.key}-{s}" for v, s in _BWD_CASES])
def test_backward_matches_float64_oracle(variant, shape):
  _check_grads(variant, BWD_SHAPES[shape], with_lse=False)


@pytest.mark.parametrize("variant", [v for v in BWD_VARIANTS if v.deterministic
                                     and not v.causal and v.dtype == "bfloat16"],
                         ids=lambda v: v.key)
def test_rotated_deterministic_backward_matches_float64_oracle(variant):
  """Every query block gets the contributions of all its key blocks in the rotated order."""
  _check_grads(variant, _DET_SHAPES["s1000_rotated"], with_lse=False)


@pytest.mark.parametrize("variant", [v for v in BWD_VARIANTS if not v.deterministic
                                     and v.dtype == "bfloat16"],
                         ids=lambda v: v.key)
def test_backward_through_lse_matches_float64_oracle(variant):
  """A loss that uses lse: d_lse reaches the kernel (delta = rowsum(dO * O) - d_lse)."""
  _check_grads(variant, BWD_SHAPES["q300_k70"] if variant.causal else BWD_SHAPES["s200_gqa"],
               with_lse=True)


_COPY_CASES = [(v, c) for v in BWD_VARIANTS if v.deterministic and v.causal
               and v.dtype == "bfloat16" and v.schedule.dq_copies > 1
               for c in (1, 2)]


@pytest.mark.parametrize("variant,copies", _COPY_CASES,
                         ids=[f"{v.key}-copies{c}" for v, c in _COPY_CASES])
def test_causal_deterministic_backward_with_one_or_two_dq_copies(variant, copies, monkeypatch):
  """hdim 192 with the causal mask keeps two dQ accumulators up to the schedule's
  two_dq_copies_max_seq_q and one above, in the same kernels: both counts against the oracle
  and bitwise over repeats (config.dq_accum_copies patched to 1 sends this short call down the
  one-copy path; seq_q > seq_k leaves query blocks without a key block)."""
  if copies == 1:
    monkeypatch.setattr(config, "dq_accum_copies", lambda variant, seq_q: 1)
  # JAX caches the backward's trace, scratch shapes included, per input shape: the limit
  # (a constant outside this test) is read anew only after this.
  jax.clear_caches()
  try:
    _check_one_or_two_dq_copies(variant, copies)
  finally:
    jax.clear_caches()


def _check_one_or_two_dq_copies(variant, copies):
  shape = (1, 700, 640, 4, 2)
  q, k, v, w_out, w_lse = _grad_inputs(variant, shape, f"dq copies {copies}")
  attend = lambda q, k, v: jaxflash.attention(q, k, v, causal=True, return_lse=True,
                                              deterministic=True, implementation="cute")
  loss = _loss(attend, jnp.asarray(w_out, jnp.float32), jnp.asarray(w_lse, jnp.float32), True)
  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  rows = -(-shape[1] // variant.schedule.tile_m) * variant.schedule.tile_m
  assert f"x{copies * rows}x{variant.head_dim}xf32>" in grads.lower(q, k, v).as_text()
  got = [np.asarray(g) for g in grads(q, k, v)]
  want, naive = _grad_oracle(q, k, v, w_out, w_lse, variant, with_lse=True)
  for name, g, w, n in zip(("dq", "dk", "dv"), got, want, naive):
    assert_close_to_oracle(g, w, n, name=name)
  for _ in range(2):
    for name, a, b in zip(("dq", "dk", "dv"), got, grads(q, k, v)):
      np.testing.assert_array_equal(np.asarray(b), a, err_msg=name)


# hdim 128 and 256: both warpgroup mappings of the backward kernel.
@pytest.mark.parametrize("shape", _DET_SHAPES.values(), ids=_DET_SHAPES.keys())
@pytest.mark.parametrize("variant", [v for v in BWD_VARIANTS if v.deterministic
                                     and v.dtype == "bfloat16" and v.head_dim in (128, 256)],
                         ids=lambda v: v.key)
def test_deterministic_backward_is_bitwise_reproducible(variant, shape):
  q, k, v, w_out, w_lse = _grad_inputs(variant, shape, "determinism")
  args = (q, k, v, jnp.asarray(w_out, jnp.float32), jnp.asarray(w_lse, jnp.float32))
  kw = dict(causal=variant.causal, deterministic=True, with_lse=True)
  first = [np.asarray(g) for g in _cute_grads(*args, **kw)]
  assert not any(np.isnan(np.asarray(g, np.float32)).any() for g in first)
  for _ in range(4):
    for name, a, b in zip(("dq", "dk", "dv"), first, _cute_grads(*args, **kw)):
      np.testing.assert_array_equal(np.asarray(b), a, err_msg=name)


# ---------------------------------------------------------------------------------------------
# Masked variants: windows and segment ids, causal at run time; block ranges on the device.
# The bias variants (masked too) take the bias operand: tests/test_gpu_bias.py.

MASKED = [v for v in config.shipped_variants() if v.masked and not v.bias]
MASKED_BWD = [v for v in config.shipped_variants(direction="bwd") if v.masked and not v.bias]
MASK_CASES = {  # name -> ((batch, seq_q, seq_k, heads, kv_heads), options, segment ids kind)
    "packed_causal": ((2, 1000, 1000, 4, 2), {"causal": True}, "packed"),
    "packed_gqa8": ((1, 777, 777, 8, 1), {}, "packed"),
    "window_q700_k1000": ((1, 700, 1000, 4, 2), {"window_size": (100, 20)}, None),
    "causal_window_4097": ((1, 4097, 4097, 2, 2), {"causal": True, "window_size": (300, None)},
                           None),
    "padding_causal_q300_k500": ((2, 300, 500, 4, 4), {"causal": True}, "padding"),
    "arbitrary_shifted_window": ((2, 257, 300, 4, 2), {"window_size": (-3, 64)}, "arbitrary"),
    "s1": ((3, 1, 1, 4, 4), {"window_size": (0, 0)}, None),
    # A band of 129 keys: head_dim 64 runs the narrow-band variant (config.NARROW_BAND_MAX_KEYS).
    "packed_causal_window_128_gqa8": ((2, 1000, 1000, 8, 1),
                                      {"causal": True, "window_size": (128, None)}, "packed"),
}
# No mask at all: every key block but the last (900 = 7 x 128 + 4) needs no elementwise mask,
# the blocks whose softmax _MASK_CASES mostly leave to the rotation.
FULL_BLOCKS_CASE = ((2, 700, 900, 4, 2), {}, None)
NARROW_CASE = "packed_causal_window_128_gqa8"


def _segment_ids(kind, batch, seq_q, seq_k, seed):
  """(q_ids, kv_ids) int32 or (None, None): packed documents of random lengths (the same
  packing for queries and keys), trailing padding (padding queries and keys see nothing of
  each other: empty rows), or arbitrary ids (not contiguous)."""
  rng = np.random.default_rng(seed)
  if kind is None:
    return None, None
  if kind == "packed":
    assert seq_q == seq_k
    ids = np.stack([np.searchsorted(np.sort(rng.choice(np.arange(1, seq_q), 6, replace=False)),
                                    np.arange(seq_q), side="right") for _ in range(batch)])
    return jnp.asarray(ids, jnp.int32), jnp.asarray(ids, jnp.int32)
  if kind == "padding":
    real_q = np.arange(seq_q)[None] < rng.integers(1, seq_q, batch)[:, None]
    real_k = np.arange(seq_k)[None] < rng.integers(1, seq_k, batch)[:, None]
    return (jnp.asarray(np.where(real_q, 1, 0), jnp.int32),
            jnp.asarray(np.where(real_k, 1, 2), jnp.int32))
  return (jnp.asarray(rng.integers(0, 3, (batch, seq_q)), jnp.int32),
          jnp.asarray(rng.integers(0, 3, (batch, seq_k)), jnp.int32))


def _mask_config(variant, options, segment_ids, deterministic=False):
  left, right = options.get("window_size", (None, None))
  return AttentionConfig(softmax_scale=variant.head_dim ** -0.5,
                         causal=options.get("causal", False), window_left=left,
                         window_right=right, has_segment_ids=segment_ids[0] is not None,
                         deterministic=deterministic, implementation="cute")


def _attend(cfg, segment_ids):
  return lambda q, k, v: jaxflash.attention(
      q, k, v, causal=cfg.causal, window_size=(cfg.window_left, cfg.window_right),
      softcap=cfg.softcap, q_segment_ids=segment_ids[0], kv_segment_ids=segment_ids[1],
      deterministic=cfg.deterministic, return_lse=True, implementation="cute")



def _rotated(variants, per_variant):
  """(variant, case) pairs: each variant on `per_variant` cases, the cases rotating over the
  variants so that every case meets several head dims and both dtypes (each case compiles its
  own programs: the full product would take too long)."""
  names = list(MASK_CASES)
  return [(v, names[(i * per_variant + j) % len(names)]) for i, v in enumerate(variants)
          for j in range(per_variant)]


def _with_narrow_case(pairs):
  """`pairs` plus the narrow-band case on each forward variant that only a narrow band picks
  (the rotation gives it other cases too: the kernel takes any mask at run time)."""
  narrow = [v for v in MASKED if v.schedule != config.fwd_schedule(
      v.head_dim, v.head_dim_v, v.causal, v.masked)]
  assert narrow, "no forward variant of narrow bands ships"
  return pairs + [(v, NARROW_CASE) for v in narrow if (v, NARROW_CASE) not in pairs]


_MASK_FWD_CASES = _with_narrow_case(_rotated(MASKED, 2))


def _masked_fwd_case(variant, case, seed_text, q_scale=1.0, softcap=None):
  """Inputs of one masked forward case (a name of MASK_CASES, or FULL_BLOCKS_CASE): (q, k, v,
  segment ids, cfg). The raw calls run `variant` whatever the mask (it is run-time data); the
  public path runs the variant cfg picks (_check_public_path)."""
  (b, seq_q, seq_k, h, h_kv), options, kind = (case if case == FULL_BLOCKS_CASE
                                               else MASK_CASES[case])
  seed = zlib.crc32(seed_text.encode())
  dtype = jnp.dtype(variant.dtype)
  q, k, v = make_qkv(seed, b, seq_q, seq_k, h, h_kv, variant.head_dim,
                     head_dim_v=variant.head_dim_v, dtype=dtype)
  q = (q.astype(jnp.float32) * q_scale).astype(dtype)
  segment_ids = _segment_ids(kind, b, seq_q, seq_k, seed)
  cfg = _mask_config(variant, options, segment_ids).replace(softcap=softcap)
  return q, k, v, segment_ids, cfg


def _check_poisoned_masked_fwd(q, k, v, variant, cfg, segment_ids):
  """The kernel's raw (out, lse) into NaN-poisoned buffers against the float64 oracle; returns
  them and the oracle ((want out, lse), (naive out, lse))."""
  passed = () if segment_ids[0] is None else segment_ids
  raw_out, raw_lse = poisoned_fwd(q, k, v, variant, cfg, passed)
  (want_out, want_lse), (naive_out, naive_lse) = _oracle(q, k, v, cfg, segment_ids)
  assert_close_to_oracle(raw_out, want_out, naive_out, name="out")
  assert_close_to_oracle(raw_lse, want_lse, naive_lse, name="lse")
  empty = np.isinf(want_lse)  # rows that see no key: exactly zero
  assert not np.asarray(raw_out, np.float32)[np.moveaxis(empty, 1, 2)].any()
  return (raw_out, raw_lse), ((want_out, want_lse), (naive_out, naive_lse))


@pytest.mark.parametrize("variant,case", _MASK_FWD_CASES,
                         ids=[f"{v.key}-{c}" for v, c in _MASK_FWD_CASES])
def test_masked_forward_matches_float64_oracle(variant, case):
  q, k, v, segment_ids, cfg = _masked_fwd_case(variant, case, f"{variant.key}{case}")
  attend = jax.jit(_attend(cfg, segment_ids))
  assert _public_runs(variant, cfg, k.shape[1]).key in attend.lower(q, k, v).as_text()
  raw, oracle = _check_poisoned_masked_fwd(q, k, v, variant, cfg, segment_ids)
  _check_public_path(attend(q, k, v), raw, variant, cfg, k.shape[1], oracle)


def _masked_grads(w_out, w_lse, cfg):
  """jit(grad) of the masked loss at (q, k, v, segment_ids): the ids are run-time arguments,
  so the block ranges are computed on the device, as in training."""
  def loss(q, k, v, segment_ids):
    return _loss(_attend(cfg, segment_ids), jnp.asarray(w_out, jnp.float32),
                 jnp.asarray(w_lse, jnp.float32), True)(q, k, v)
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


# Deterministic variants are also checked bitwise over repeats.
_MASK_BWD_CASES = _rotated(MASKED_BWD, 1)


def _check_masked_backward(variant, case, seed_text, q_scale=1.0, softcap=None):
  """jit(grad) through the masked kernels against the float64 oracle; deterministic variants
  also bitwise over repeats. q_scale > 1 with softcap: scores deep in tanh's saturation."""
  shape, options, kind = MASK_CASES[case]
  b, seq_q, seq_k, _, _ = shape
  q, k, v, w_out, w_lse = _grad_inputs(variant, shape, seed_text)
  q = (q.astype(jnp.float32) * q_scale).astype(q.dtype)
  segment_ids = _segment_ids(kind, b, seq_q, seq_k, zlib.crc32(case.encode()))
  cfg = _mask_config(variant, options, segment_ids, variant.deterministic)
  cfg = cfg.replace(softcap=softcap)
  assert KernelVariant.for_call("bwd", "sm90a", variant.dtype, variant.head_dim,
                                variant.head_dim_v, cfg) == variant
  grads = _masked_grads(w_out, w_lse, cfg)
  assert variant.key in grads.lower(q, k, v, segment_ids).as_text()
  got = [np.asarray(g) for g in grads(q, k, v, segment_ids)]
  want, naive = _grad_oracle(q, k, v, w_out, w_lse, variant, True, cfg, segment_ids)
  for name, g, w, n in zip(("dq", "dk", "dv"), got, want, naive):
    assert_close_to_oracle(g, w, n, name=name)
  if variant.deterministic:
    for _ in range(2):
      for name, a, again in zip(("dq", "dk", "dv"), got, grads(q, k, v, segment_ids)):
        np.testing.assert_array_equal(np.asarray(again), a, err_msg=name)


@pytest.mark.parametrize("variant,case", _MASK_BWD_CASES,
                         ids=[f"{v.key}-{c}" for v, c in _MASK_BWD_CASES])
def test_masked_backward_matches_float64_oracle(variant, case):
  _check_masked_backward(variant, case, f"masked-bwd{variant.key}{case}")


# ---------------------------------------------------------------------------------------------
# Learnable sinks on the kernel path: an operand of every forward variant, added to each row's
# denominator in the epilogue; its gradient is a reduction in XLA (jaxflash/sink.py)

SINK_CASES = {  # name -> (dtype, head_dim, (batch, seq_q, seq_k, heads, kv_heads), options)
    "bf16_d64_causal_q300_k200": ("bfloat16", 64, (2, 300, 200, 8, 1), {"causal": True}),
    "bf16_d128_window_gqa": ("bfloat16", 128, (1, 1000, 1000, 8, 2),
                             {"causal": True, "window_size": (128, None)}),
    "f16_d256_plain_q17_k300": ("float16", 256, (2, 17, 300, 4, 4), {}),
}


def _sink_logits(h, seed):
  """One logit per head: -inf on head 0 (no sink), 40 on head 1 (the sink dominates every row,
  beyond exp's float32 range relative to the scores), N(1, 2) on the rest."""
  logits = np.random.default_rng(seed).normal(1.0, 2.0, h)
  logits[0], logits[1] = -np.inf, 40.0
  return jnp.asarray(logits, jnp.float32)


_SINK_VARIANTS = [(v, None) for v in VARIANTS] + [(v, "padding_causal_q300_k500")
                                                  for v in MASKED]


@pytest.mark.parametrize("variant,case", _SINK_VARIANTS,
                         ids=[v.key for v, _ in _SINK_VARIANTS])
def test_sink_operand_of_every_forward_variant_matches_float64_oracle(variant, case):
  """The sink operand in the kernel epilogue: NaN-poisoned outputs against the oracle, head 0
  (-inf) bitwise equal to the call without the operand, rows without keys (padding) at lse =
  their sink, and jaxflash.attention running the same kernel bitwise (_check_public_path)."""
  if case is None:
    b, seq_q, seq_k, h, h_kv = 2, 130, 200, 4, 2  # lengths straddle the tiles; GQA
    q, k, v = make_qkv(zlib.crc32(f"sink{variant.key}".encode()), b, seq_q, seq_k, h, h_kv,
                       variant.head_dim, head_dim_v=variant.head_dim_v,
                       dtype=jnp.dtype(variant.dtype))
    cfg, segment_ids, options = _config(variant), (None, None), {"causal": variant.causal}
  else:
    q, k, v, segment_ids, cfg = _masked_fwd_case(variant, case, f"sink{variant.key}")
    options = dict(causal=cfg.causal, q_segment_ids=segment_ids[0],
                   kv_segment_ids=segment_ids[1])
    h = q.shape[2]
  sink = _sink_logits(h, zlib.crc32(variant.key.encode()))
  passed = () if segment_ids[0] is None else segment_ids
  raw_out, raw_lse = poisoned_fwd(q, k, v, variant, cfg, passed, sink=sink)
  (want_out, want_lse), (naive_out, naive_lse) = _oracle(q, k, v, cfg, segment_ids, sink)
  assert_close_to_oracle(raw_out, want_out, naive_out, name="out")
  assert_close_to_oracle(raw_lse, want_lse, naive_lse, name="lse")
  plain_out, plain_lse = poisoned_fwd(q, k, v, variant, cfg, passed)
  np.testing.assert_array_equal(raw_out[:, :, 0], plain_out[:, :, 0])
  np.testing.assert_array_equal(raw_lse[:, 0], plain_lse[:, 0])
  no_key = np.isneginf(np.asarray(plain_lse))  # rows that see no key: lse = the sink
  if no_key.any():
    assert not np.asarray(raw_out, np.float32)[np.moveaxis(no_key, 1, 2)].any()
    sinks = np.broadcast_to(np.asarray(sink)[None, :, None], no_key.shape)
    np.testing.assert_allclose(np.asarray(raw_lse)[no_key], sinks[no_key], rtol=1e-6)
  out, lse = jaxflash.attention(q, k, v, learnable_sink=sink, return_lse=True,
                                implementation="cute", **options)
  _check_public_path((out, lse), (raw_out, raw_lse), variant, cfg, k.shape[1],
                     ((want_out, want_lse), (naive_out, naive_lse)))


@pytest.mark.parametrize("case", SINK_CASES.keys())
def test_learnable_sink_on_the_kernels_matches_float64_oracle(case):
  dtype, d, (b, seq_q, seq_k, h, h_kv), options = SINK_CASES[case]
  q, k, v = make_qkv(zlib.crc32(case.encode()), b, seq_q, seq_k, h, h_kv, d,
                     dtype=jnp.dtype(dtype))
  rng = np.random.default_rng(7)
  sink = jnp.asarray(rng.normal(1.0, 2.0, h), jnp.float32)
  w_out = jnp.asarray(rng.standard_normal((b, seq_q, h, d)), jnp.dtype(dtype)).astype(jnp.float32)
  w_lse = jnp.asarray(rng.standard_normal((b, h, seq_q)), jnp.float32)
  cfg = AttentionConfig(softmax_scale=d ** -0.5, causal=options.get("causal", False),
                        window_left=options.get("window_size", (None, None))[0])

  def loss(attend):
    def f(q, k, v, s):
      out, lse = attend(q, k, v, s)
      return jnp.sum(out.astype(jnp.float32) * w_out) + jnp.sum(lse.astype(jnp.float32) * w_lse)
    return f

  cute = lambda q, k, v, s: jaxflash.attention(q, k, v, learnable_sink=s, return_lse=True,
                                               implementation="cute", **options)
  naive = lambda dt: lambda q, k, v, s: reference.naive_attention(
      q, k, v, cfg, compute_dtype=dt, learnable_sink=s)
  # Every computation jitted: op-by-op oracle gradients took minutes per case on the GPU host.
  grad = lambda attend: jax.jit(jax.grad(loss(attend), argnums=(0, 1, 2, 3)))
  fn = jax.jit(jax.value_and_grad(loss(cute), argnums=(0, 1, 2, 3)))
  assert "jaxflash_attention_fwd" in fn.lower(q, k, v, sink).as_text()
  out, lse = jax.jit(cute)(q, k, v, sink)
  grads = fn(q, k, v, sink)[1]
  naive_out, naive_lse = jax.jit(naive(jnp.dtype(dtype)))(q, k, v, sink)
  naive_grads = grad(naive(jnp.dtype(dtype)))(q, k, v, sink)
  with x64():
    args = [jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v, sink)]
    want_out, want_lse = (np.asarray(x) for x in jax.jit(naive(jnp.float64))(*args))
    want_grads = [np.asarray(g) for g in grad(naive(jnp.float64))(*args)]
  assert_close_to_oracle(out, want_out, naive_out, name="out")
  assert_close_to_oracle(lse, want_lse, naive_lse, name="lse")
  for name, g, w, n in zip(("dq", "dk", "dv", "dsink"), grads, want_grads, naive_grads):
    assert_close_to_oracle(g, w, n, name=name)


# ---------------------------------------------------------------------------------------------
# Soft-capping: the masked variants take softcap at run time, forward and backward

SOFTCAP = 5.0
_SOFTCAP_CASES = _rotated(MASKED, 1)


@pytest.mark.parametrize("variant,case", _SOFTCAP_CASES,
                         ids=[f"{v.key}-{c}" for v, c in _SOFTCAP_CASES])
def test_masked_forward_soft_caps_saturated_scores(variant, case):
  # q x 8: scaled scores ~ N(0, 64), so tanh saturates.
  q, k, v, segment_ids, cfg = _masked_fwd_case(variant, case, f"softcap{variant.key}{case}",
                                               q_scale=8.0, softcap=SOFTCAP)
  scores = np.einsum("qd,kd->qk", np.asarray(q[0, :64, 0], np.float32),
                     np.asarray(k[0, :, 0], np.float32)) * cfg.softmax_scale
  if scores.size >= 64:  # (a one-token case has one score)
    assert np.mean(np.abs(scores) > 2 * SOFTCAP) > 0.1, "the test must reach the saturated range"
  raw, oracle = _check_poisoned_masked_fwd(q, k, v, variant, cfg, segment_ids)
  _check_public_path(jax.jit(_attend(cfg, segment_ids))(q, k, v), raw, variant, cfg,
                     k.shape[1], oracle)


@pytest.mark.parametrize("variant", MASKED, ids=[v.key for v in MASKED])
def test_masked_forward_soft_caps_blocks_without_mask(variant):
  """Soft-capped key blocks that need no elementwise mask (their own softmax path in the
  kernel), saturated as above, on every masked forward variant."""
  q, k, v, segment_ids, cfg = _masked_fwd_case(variant, FULL_BLOCKS_CASE,
                                               f"softcap-full{variant.key}", q_scale=8.0,
                                               softcap=SOFTCAP)
  _check_poisoned_masked_fwd(q, k, v, variant, cfg, segment_ids)


# Softcaps of Grok-1 (30) and Gemma 2 (50) with the rows' scores at the bottom of the capped
# range: half the query rows point away from every key (k > 0, q < 0 elementwise), scaled so
# that their scores lie near -3 softcap, where every capped score of the row is close to
# -softcap. bf16 values are scaled by 2^-20, so that a softmax whose P fell far below 1 in those
# rows would lose the products P V (fp16 cannot hold such values as normal numbers, and its P
# cannot fall that far).
_CAP_MAGNITUDES = (30.0, 50.0)


@pytest.mark.parametrize("variant,softcap", [
    (v, _CAP_MAGNITUDES[i % len(_CAP_MAGNITUDES)]) for i, v in enumerate(MASKED)],
                         ids=lambda x: getattr(x, "key", f"softcap{x}"))
def test_masked_forward_soft_caps_rows_at_the_bottom_of_the_range(variant, softcap):
  q, k, v, segment_ids, cfg = _masked_fwd_case(variant, FULL_BLOCKS_CASE,
                                               f"softcap-low{variant.key}{softcap}",
                                               softcap=softcap)
  dtype = q.dtype
  q32, k32 = np.asarray(q, np.float32), np.abs(np.asarray(k, np.float32)) + 1.0
  # E[(|x| + 1)^2] ~ 3.2 per dimension: scaled scores ~ -3.2 sqrt(d) a per row pointing away.
  away = -(np.abs(q32) + 1.0) * (3.0 * softcap / (3.2 * variant.head_dim ** 0.5))
  q32[:, 0::2] = away[:, 0::2]
  q, k = jnp.asarray(q32, dtype), jnp.asarray(k32, dtype)
  if dtype == jnp.bfloat16:
    v = (v.astype(jnp.float32) * 2.0 ** -20).astype(dtype)
  scores = np.einsum("qd,kd->qk", np.asarray(q[0, 0:64:2, 0], np.float32),
                     np.asarray(k[0, :, 0], np.float32)) * cfg.softmax_scale
  assert np.mean(scores < -2 * softcap) > 0.9, "the rows must reach the bottom of the range"
  _check_poisoned_masked_fwd(q, k, v, variant, cfg, segment_ids)


@pytest.mark.parametrize("variant,softcap", [
    (v, _CAP_MAGNITUDES[i % len(_CAP_MAGNITUDES)] if v.dtype == "bfloat16" else 10.0)
    for i, v in enumerate(MASKED)], ids=lambda x: getattr(x, "key", f"softcap{x}"))
def test_masked_forward_soft_caps_rows_on_one_key(variant, softcap):
  """Soft-capped rows whose weight sits on one key return that key's value as exactly as the
  naive computation does (bound: the oracle's floor). Key 0 of each head points along every
  query, the other keys away, so the capped scores are near +-softcap. Under a fixed row max no
  key's p is exactly 1, so this holds only if the row sums add P as rounded for P V. bf16: 30
  and 50 (both under the fixed max); fp16: 10, the largest the fixed max takes there."""
  q, k, v, segment_ids, cfg = _masked_fwd_case(variant, FULL_BLOCKS_CASE,
                                               f"softcap-one{variant.key}", softcap=softcap)
  dtype = q.dtype
  q32, k32 = np.abs(np.asarray(q, np.float32)) + 1.0, -np.abs(np.asarray(k, np.float32)) - 1.0
  k32[:, 0] = -k32[:, 0]
  # E[(|x| + 1)^2] ~ 3.2 per dimension: scaled scores ~ +-4 softcap.
  q32 *= 4.0 * softcap / (3.2 * variant.head_dim ** 0.5)
  q, k = jnp.asarray(q32, dtype), jnp.asarray(k32, dtype)
  capped = softcap * np.tanh(np.einsum("qd,kd->qk", np.asarray(q[0, :64, 0], np.float32),
                                       np.asarray(k[0, :, 0], np.float32))
                             * cfg.softmax_scale / softcap)
  assert np.min(capped[:, 0] - capped[:, 1:].max(axis=1)) > 1.8 * softcap, "one key per row"
  _check_poisoned_masked_fwd(q, k, v, variant, cfg, segment_ids)


_SOFTCAP_BWD_CASES = _rotated(MASKED_BWD, 1)


@pytest.mark.parametrize("variant,case", _SOFTCAP_BWD_CASES,
                         ids=[f"{v.key}-{c}" for v, c in _SOFTCAP_BWD_CASES])
def test_masked_backward_soft_caps_saturated_scores(variant, case):
  """The backward kernels' tanh derivative, with q x 4: scaled scores ~ N(0, 16) against
  softcap 5, so many sit where 1 - tanh^2 is small."""
  _check_masked_backward(variant, case, f"softcap-bwd{variant.key}{case}", q_scale=4.0,
                         softcap=SOFTCAP)


_MASKED_BWD_NONDET = [v for v in MASKED_BWD if not v.deterministic]


@pytest.mark.parametrize("variant", _MASKED_BWD_NONDET, ids=[v.key for v in _MASKED_BWD_NONDET])
def test_masked_backward_soft_caps_rows_on_one_key(variant):
  """One query on one key (case s1) under softcap 5: the row's P is 1, so dV = dO. The backward
  recomputes P from the forward's LSE, which must come from the unrounded row sums where the
  forward rounds P under a fixed row max (from the rounded sums P was 1 +- 2^-8 and dV missed
  the oracle). Every non-deterministic masked backward variant, each with the forward variant
  the call picks (deterministic variants share the forward and the tanh derivative)."""
  _check_masked_backward(variant, "s1", f"softcap-bwd-one{variant.key}", q_scale=4.0,
                         softcap=SOFTCAP)
