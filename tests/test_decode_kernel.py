"""jaxflash.decode_kernel on a CPU host: shapes, the custom call it lowers to for CUDA, vmap,
and the errors (the kernel itself runs on a GPU only)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflash import _jax_internal, config, ffi, split_kv
from jaxflash.decode_kernel import decode_attention, decode_call_p
from jaxflash.kv_cache import kv_cache_attention

VARIANT = config.decode_variant("bfloat16", 128, 128)
# batch 2, seqlen_q 2 x group 4 = 8 rows, 2 kv heads; a pool of 10 pages of 16 keys.
B, ROWS, HK, PAGES, PAGE_SIZE, MAX_PAGES, SPLITS = 2, 8, 2, 10, 16, 5, 3
OPTIONS = dict(variant=VARIANT, softmax_scale=0.125, seqlen_q=2, window_left=None,
               window_right=0, softcap=None, num_splits=SPLITS)


def _operands(variant=VARIANT, rows=ROWS, page_size=PAGE_SIZE):
  dtype = jnp.dtype(variant.dtype)
  return (jnp.zeros((B, HK, rows, variant.head_dim), dtype),
          jnp.zeros((PAGES, page_size, HK, variant.head_dim), dtype),
          jnp.zeros((PAGES, page_size, HK, variant.head_dim_v), dtype),
          jnp.zeros((B, MAX_PAGES), jnp.int32), jnp.zeros((B,), jnp.int32))


def _call(**changes):
  return lambda *args: decode_attention(*args, **dict(OPTIONS, **changes))


def test_out_has_the_query_dtype_and_lse_is_float32():
  variant = config.decode_variant("float16", 192, 128)
  out, lse = jax.eval_shape(_call(variant=variant), *_operands(variant))
  assert (out.shape, out.dtype) == ((B, HK, ROWS, 128), jnp.float16)
  assert (lse.shape, lse.dtype) == ((B, HK, ROWS), jnp.float32)


def test_cuda_lowering_is_the_decode_custom_call_with_typed_attributes():
  """Cross-lowered on a host without a GPU (no library needed): one custom call to
  config.DECODE_TARGET whose attributes are ffi.decode_attributes'."""
  text = jax.jit(_call(softcap=30.0, window_left=64)).trace(*_operands()).lower(
      lowering_platforms=("cuda",)).as_text()
  calls = [line for line in text.splitlines() if "stablehlo.custom_call" in line]
  assert len(calls) == 1 and f"@{config.DECODE_TARGET}(" in calls[0], calls
  for attribute in (f'variant = "{VARIANT.key}"', "seqlen_q = 2 : i32", "window_left = 64 : i32",
                    "window_right = 0 : i32", "softcap = 3.000000e+01 : f32",
                    "softmax_scale = 1.250000e-01 : f32", "head_dim = 128 : i32",
                    "head_dim_v = 128 : i32"):
    assert attribute in calls[0], attribute
  # Operands q, k, v, page table, lengths, sink (none: empty); results out, lse and the
  # float32 partials.
  assert re.search(r"\(tensor<2x2x8x128xbf16>, tensor<10x16x2x128xbf16>, "
                   r"tensor<10x16x2x128xbf16>, tensor<2x5xi32>, tensor<2xi32>, "
                   r"tensor<2x0xf32>\) -> \(tensor<2x2x8x128xbf16>, tensor<2x2x8xf32>, "
                   r"tensor<2x3x2x8x128xf32>, tensor<2x3x2x8xf32>\)", calls[0]), calls[0]


def test_cuda_lowering_provides_the_variant_on_a_gpu_host(monkeypatch):
  """As the forward's lowering: the variant's library is found or built before the call lowers
  (where a CUDA device is present)."""
  provided = []
  monkeypatch.setattr(_jax_internal, "has_cuda_device", lambda: True)
  monkeypatch.setattr(ffi, "ensure_variant", provided.append)
  jax.jit(_call()).trace(*_operands()).lower(lowering_platforms=("cuda",))
  assert provided == [VARIANT]


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
@pytest.mark.parametrize("options", [dict(), dict(window_left=5, softcap=3.0),
                                     dict(window_right=None, num_splits=7)],
                         ids=["causal", "window_softcap", "full_7_splits"])
def test_the_call_elsewhere_is_the_reference_attention(paged, options):
  """Off CUDA, decode_p computes the kernels' partials and merge in XLA: kv_cache_attention's
  reference result (lengths 0, 1, 17, a partial page, full), with a sink."""
  kw = dict(OPTIONS, window_left=None, seqlen_q=2)
  kw.update(options)
  check_against_reference(np.random.default_rng(3), (5, 2, 4, 2, 128), 16, 3,
                          jnp.asarray([0, 1, 17, 40, 48], jnp.int32), kw, paged)


def check_against_reference(rng, shape, page_size, pages, lengths, kw, paged):
  """decode_attention(**kw) on random bf16 inputs of shape (batch, seq_q, group, kv heads,
  head_dim) over caches of pages * page_size keys (a permuted pool of those pages when paged)
  with a learnable sink, unpacked: kv_cache_attention's reference result."""
  b, seq_q, group, hk, d = shape
  bf16 = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
  q = bf16(b, seq_q, hk * group, d)
  k, v = bf16(b, pages * page_size, hk, d), bf16(b, pages * page_size, hk, d)
  table = None
  k_in, v_in = k, v
  if paged:
    order = rng.permutation(b * pages)
    table = jnp.asarray(order.reshape(b, pages), jnp.int32)
    pool = lambda x: jnp.zeros((b * pages, page_size, hk, d), x.dtype).at[order].set(
        x.reshape(b * pages, page_size, hk, d))
    k_in, v_in = pool(k), pool(v)
  sink = jnp.asarray(rng.standard_normal(hk * group), jnp.float32)
  packed = jax.jit(lambda *a: decode_attention(*a, **kw))(
      split_kv.pack_query(q, hk), k_in, v_in, table, lengths, sink.reshape(hk, group))
  assert packed[0].dtype == jnp.bfloat16 and packed[0].shape == (b, hk, seq_q * group, d)
  out, lse = split_kv.unpack(*packed, seq_q)
  f32 = lambda x: x.astype(jnp.float32)
  want, want_lse = kv_cache_attention(
      f32(q), f32(k), f32(v), lengths, causal=kw["window_right"] == 0,
      softmax_scale=kw["softmax_scale"],
      window_size=(kw["window_left"], None if kw["window_right"] == 0 else kw["window_right"]),
      softcap=kw["softcap"], learnable_sink=sink, return_lse=True, implementation="reference")
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want), rtol=1e-2,
                             atol=1e-2)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=2e-5, atol=2e-5)


def _decode_calls(jaxpr):
  """(batch of each decode_call_p, lengths of each scan) in a jaxpr, scans' bodies included."""
  calls, scans = [], []
  for eqn in jaxpr.eqns:
    if eqn.primitive is decode_call_p:
      calls.append(eqn.outvars[0].aval.shape[0])
    elif eqn.primitive.name == "scan":
      scans.append(eqn.params["length"])
      inner = _decode_calls(eqn.params["jaxpr"].jaxpr)
      calls += inner[0]
      scans += inner[1]
  return calls, scans


def _random_operands(seed, paged):
  """Operands with values: q, k, v, the page table (None: contiguous caches) and lengths."""
  rng = np.random.default_rng(seed)
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
  lengths = jnp.asarray(rng.integers(0, MAX_PAGES * PAGE_SIZE + 1, B), jnp.int32)
  if paged:
    table = jnp.asarray(rng.permutation(PAGES)[:B * MAX_PAGES].reshape(B, MAX_PAGES),
                        jnp.int32)
    return (normal(B, HK, ROWS, 128), normal(PAGES, PAGE_SIZE, HK, 128),
            normal(PAGES, PAGE_SIZE, HK, 128), table, lengths)
  cap = MAX_PAGES * PAGE_SIZE
  return (normal(B, HK, ROWS, 128), normal(B, cap, HK, 128), normal(B, cap, HK, 128), None,
          lengths)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_vmap_folds_into_the_batch_where_each_sequence_keeps_its_keys(paged):
  """Contiguous caches mapped with the queries, or one pool that every element's page table
  indexes: one call of batch x mapped size, the results of the calls one by one."""
  elements = [_random_operands(seed, paged) for seed in range(3)]
  stacked = [None if x[0] is None else jnp.stack(x) for x in zip(*elements)]
  in_axes = [0, None, None, 0, 0] if paged else [0, 0, 0, None, 0]
  if paged:  # one pool for all: each element's table indexes it
    stacked[1], stacked[2] = elements[0][1], elements[0][2]
    elements = [(e[0], stacked[1], stacked[2], e[3], e[4]) for e in elements]
  mapped = jax.vmap(_call(), in_axes=in_axes)
  calls, scans = _decode_calls(jax.make_jaxpr(mapped)(*stacked).jaxpr)
  assert calls == [3 * B] and scans == []
  out, lse = jax.jit(mapped)(*stacked)
  for i, element in enumerate(elements):
    want_out, want_lse = jax.jit(_call())(*element)
    np.testing.assert_array_equal(np.asarray(out[i]), np.asarray(want_out))
    np.testing.assert_array_equal(np.asarray(lse[i]), np.asarray(want_lse))


def test_vmap_of_a_mapped_pool_or_shared_caches_runs_one_call_per_element():
  """A mapped pool (each element's table indexes its own pool) and contiguous caches shared by
  mapped queries (folding would copy them) run one call per element."""
  q, k, v, page_table, lengths = _operands()
  out, _ = jax.eval_shape(jax.vmap(_call(), in_axes=(None, 1, 1, None, None)), q,
                          jnp.stack([k] * 3, 1), jnp.stack([v] * 3, 1), page_table, lengths)
  assert out.shape == (3, B, HK, ROWS, 128)
  jaxpr = jax.make_jaxpr(jax.vmap(_call(), in_axes=(None, 1, 1, None, None)))(
      q, jnp.stack([k] * 3, 1), jnp.stack([v] * 3, 1), page_table, lengths)
  assert _decode_calls(jaxpr.jaxpr) == ([B], [3])
  q, k, v, _, lengths = _random_operands(0, paged=False)
  jaxpr = jax.make_jaxpr(jax.vmap(_call(), in_axes=(0, None, None, None, None)))(
      jnp.stack([q] * 4), k, v, None, lengths)
  assert _decode_calls(jaxpr.jaxpr) == ([B], [4])


@pytest.mark.parametrize("change,error", [
    (dict(variant=config.shipped_variants()[0]),
     "variant: expected a decode KernelVariant (config.decode_variant), got fwd-"),
    (dict(seqlen_q=3), "seqlen_q: expected an int >= 1 that divides q_packed's 8 rows"),
    (dict(seqlen_q=0), "seqlen_q: expected an int >= 1"),
    (dict(num_splits=0), "num_splits: expected an int from 1 to 65535, got 0"),
    (dict(num_splits=70000), "num_splits: expected an int from 1 to 65535, got 70000"),
    (dict(variant=config.decode_variant("float16", 128, 128)),
     "q_packed: dtype bfloat16 differs from the variant's float16"),
])
def test_options_the_kernel_does_not_take_are_named(change, error):
  with pytest.raises((ValueError, TypeError), match=re.escape(error)):
    _call(**change)(*_operands())


def test_operands_the_kernel_does_not_take_are_named():
  q, k, v, page_table, lengths = _operands()
  cases = [
      ((q[0], k, v, page_table, lengths), ValueError,
       "q_packed: expected rank 4 (batch, num_kv_heads, rows, head_dim), got shape (2, 8, 128)"),
      ((q, k[:, :, :1], v, page_table, lengths), ValueError,
       "k_pool: shape (10, 16, 1, 128) must end in (num_kv_heads, head_dim) = (2, 128)"),
      ((q, k, v[..., :64], page_table, lengths), ValueError,
       "v_pool: expected shape (10, 16, 2, 128)"),
      ((q, k[:, :8], v[:, :8], page_table, lengths), ValueError,
       "k_pool: page_size 8 (dim 1) must be a power of two >= 16"),
      ((q, jnp.concatenate([k, k[:, :8]], 1), jnp.concatenate([v, v[:, :8]], 1), page_table,
        lengths), ValueError, "k_pool: page_size 24 (dim 1) must be a power of two >= 16"),
      ((q, k, v, page_table[:1], lengths), ValueError,
       "page_table: batch 1 differs from q_packed's 2"),
      ((q, k, v, page_table, lengths[:1]), ValueError, "lengths: expected shape (2,), got (1,)"),
      ((q, k, v, page_table.astype(jnp.int16), lengths), TypeError,
       "page_table: expected int32, got int16"),
      ((q, k.astype(jnp.float16), v, page_table, lengths), TypeError,
       "k_pool: dtype float16 differs from the variant's bfloat16"),
      ((q, k, v, page_table, lengths, jnp.zeros((HK, 3), jnp.float32)), ValueError,
       "sink: expected float32 of shape (2, 4) (num_kv_heads, group), got float32 (2, 3)"),
      ((q, k, v, page_table, lengths, jnp.zeros((HK, 4), jnp.bfloat16)), ValueError,
       "sink: expected float32 of shape (2, 4) (num_kv_heads, group), got bfloat16 (2, 4)"),
  ]
  for args, kind, error in cases:
    with pytest.raises(kind, match=re.escape(error)):
      _call()(*args)


def test_an_empty_call_has_empty_results():
  """Empty extents pass through (the handler writes nothing)."""
  variant = VARIANT
  q = jnp.zeros((0, HK, ROWS, 128), jnp.bfloat16)
  out, lse = jax.eval_shape(_call(), q, *_operands(variant)[1:3],
                            jnp.zeros((0, MAX_PAGES), jnp.int32), jnp.zeros((0,), jnp.int32))
  assert out.shape == (0, HK, ROWS, 128) and lse.shape == (0, HK, ROWS)
  assert np.dtype(lse.dtype) == np.float32


def test_an_empty_cache_gives_each_row_its_sink_without_a_kernel_call():
  """TMA cannot describe an empty pool: such calls are computed in XLA (out 0, lse the sink or
  -inf), and lower to no custom call."""
  q, k, v, page_table, lengths = _operands()
  sink = jnp.asarray(np.arange(HK * 4, dtype=np.float32).reshape(HK, 4))
  empty = lambda x: x[:0]
  for args in ((q, empty(k), empty(v), page_table, lengths, sink),
               (q, k, v, page_table[:, :0], lengths, sink)):
    out, lse = _call()(*args)
    assert not np.asarray(out, np.float32).any()
    np.testing.assert_array_equal(np.asarray(lse), np.tile(np.asarray(sink), (1, 2))[None]
                                  .repeat(B, 0))
    text = jax.jit(_call()).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert config.DECODE_TARGET not in text
  _, lse = _call()(q, empty(k), empty(v), page_table, lengths)
  assert np.all(np.asarray(lse) == -np.inf)


def test_vmap_over_the_sink_runs_one_call_per_element():
  q, k, v, page_table, lengths = _random_operands(1, paged=True)
  sinks = jnp.asarray(np.random.default_rng(2).standard_normal((3, HK, 4)), jnp.float32)
  mapped = jax.vmap(lambda s: _call()(q, k, v, page_table, lengths, s))
  assert _decode_calls(jax.make_jaxpr(mapped)(sinks).jaxpr) == ([B], [3])
  out, lse = jax.jit(mapped)(sinks)
  for i in range(3):
    want_out, want_lse = jax.jit(_call())(q, k, v, page_table, lengths, sinks[i])
    np.testing.assert_array_equal(np.asarray(out[i]), np.asarray(want_out))
    np.testing.assert_array_equal(np.asarray(lse[i]), np.asarray(want_lse))


def test_contiguous_caches_and_no_sink_lower_without_a_kernel_filling_them():
  """Contiguous caches pass a page table of no column (sequence b is page b) and no sink an
  empty one: neither needs an XLA kernel before the call."""
  q, k, v, _, lengths = _random_operands(0, paged=False)
  text = jax.jit(_call()).trace(q, k, v, None, lengths).lower(
      lowering_platforms=("cuda",)).as_text()
  call = next(line for line in text.splitlines() if "stablehlo.custom_call" in line)
  assert "tensor<2x0xi32>, tensor<2xi32>, tensor<2x0xf32>) ->" in call, call
  assert "iota" not in text
