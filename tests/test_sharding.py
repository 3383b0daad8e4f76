"""Sharding rules: pure resolution tests here, and 8 fake CPU devices in a child process.

Every sharding pattern must equal the unsharded result (float64, forward and gradients, the
lse cotangent included); batch/head patterns must compile without any collective (the
TransformerEngine idea of counting collectives in the compiled HLO).
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxflash import sharding
from jaxflash.config import AttentionConfig
from tests import _multidevice

MESH = {"data": 2, "model": 4}


# ---------------------------------------------------------------------------------------------
# Pure rules (no devices)

def _resolve(q, k=None, batch=8, heads=8, kv_heads=8):
  ax = lambda spec: sharding.spec_axes(spec, 4)
  k = q if k is None else k
  return sharding.resolve(MESH, ax(q), ax(k), ax(k), batch=batch, num_heads=heads,
                          num_kv_heads=kv_heads)


RESOLVE_CASES = {  # name -> (resolve kwargs, expected (batch_axes, head_axes, kv_replicated))
    "batch": (dict(q=P("data")), (("data",), (), False)),
    "heads": (dict(q=P(None, None, "model")), ((), ("model",), False)),
    "batch_heads": (dict(q=P("data", None, "model")), (("data",), ("model",), False)),
    "gqa_divisible": (dict(q=P(None, None, "model"), kv_heads=4), ((), ("model",), False)),
    "gqa_kv_replicated": (dict(q=P(None, None, "model"), kv_heads=2), ((), ("model",), True)),
    "mqa_two_axes": (dict(q=P(None, None, ("data", "model")), kv_heads=1),
                     ((), ("data", "model"), True)),
    "kv_heads_incompatible": (dict(q=P(None, None, "model"), heads=12, kv_heads=3),
                              ((), (), False)),
    "batch_not_divisible": (dict(q=P(("data", "model")), batch=2), (("data",), (), False)),
    "axis_used_twice": (dict(q=P("model", None, "model")), (("model",), (), False)),
    "seq_and_head_dim_dropped": (dict(q=P(None, "data", None, "model")), ((), (), False)),
    "batch_from_key": (dict(q=P(), k=P("data")), (("data",), (), False)),
    "q_wins_conflict": (dict(q=P("data", None, "model"), k=P("model", None, "data")),
                        (("data",), ("model",), False)),
}


@pytest.mark.parametrize("case", RESOLVE_CASES.values(), ids=RESOLVE_CASES.keys())
def test_resolve(case):
  kwargs, (batch_axes, head_axes, kv_replicated) = case
  plan = _resolve(**kwargs)
  assert (plan.batch_axes, plan.head_axes, plan.kv_replicated) == (batch_axes, head_axes,
                                                                   kv_replicated)


def test_specs_follow_the_plan():
  plan = _resolve(q=P("data", None, "model"), kv_heads=2)
  args, results = sharding.fwd_specs(plan, has_segment_ids=True)
  assert args == (P("data", None, "model", None), P("data", None, None, None),
                  P("data", None, None, None), P("data", None), P("data", None))
  assert results == (P("data", None, "model", None), P("data", "model", None))
  args, results = sharding.bwd_specs(plan, has_segment_ids=False)
  assert len(args) == 7 and args[4] == P("data", "model", None)
  assert results == (args[0], args[1], args[2])


def test_the_sink_follows_the_query_heads():
  plan = _resolve(q=P("data", None, "model"), kv_heads=2)
  args, _ = sharding.fwd_specs(plan, has_segment_ids=True, has_sink=True)
  assert len(args) == 6 and args[-1] == P("model")  # after the segment ids, as the operands
  cfg = AttentionConfig(softmax_scale=1.0, has_sink=True)
  rule, _ = sharding.fwd_sharding_rule(cfg, 8, 8, (2, 4))
  assert rule.split(" -> ")[0].endswith(", heads")
  rule, _ = sharding.fwd_sharding_rule(cfg, 8, 4, (2, 2))  # GQA: the compound head factor
  assert rule.split(" -> ")[0].endswith(", (kv_heads q_per_kv)")


def test_rule_strings_name_their_factors():
  cfg = AttentionConfig(softmax_scale=1.0, has_segment_ids=True)
  rule, kw = sharding.fwd_sharding_rule(cfg, 8, 8, (2, 4))
  assert rule == ("batch seq_q heads head_dim, batch seq_k heads head_dim, "
                  "batch seq_k heads head_dim_v, batch seq_q, batch seq_k -> "
                  "batch seq_q heads head_dim_v, batch heads seq_q")
  # Shardy's verifier rejects special factors out of order of first appearance.
  assert kw == {"need_replication_factors": ("seq_q", "head_dim", "seq_k", "head_dim_v")}
  rule, kw = sharding.fwd_sharding_rule(cfg.replace(has_segment_ids=False), 8, 4, (2, 2))
  assert rule.startswith("batch seq_q (kv_heads q_per_kv) head_dim, batch seq_k kv_heads")
  assert kw["q_per_kv"] == 2
  # kv heads that a mesh axis could split: independent factors, `resolve` aligns them.
  rule, kw = sharding.bwd_sharding_rule(cfg.replace(has_segment_ids=False), 8, 2, (2, 4))
  assert "q_per_kv" not in rule and "q_per_kv" not in kw
  assert rule.endswith("-> batch seq_q heads head_dim, batch seq_k kv_heads head_dim, "
                       "batch seq_k kv_heads head_dim_v")


# ---------------------------------------------------------------------------------------------
# 8 fake devices: equality with the unsharded result and collective counts

# name -> (num_heads, num_kv_heads, q spec, k/v spec, options)
CASES = {
    "batch": (8, 8, P("data"), P("data"), {}),
    "heads": (8, 8, P(None, None, "model"), P(None, None, "model"), {"causal": True}),
    "batch_heads": (8, 8, P("data", None, "model"), P("data", None, "model"), {}),
    "gqa_heads": (8, 4, P("data", None, "model"), P("data", None, "model"), {"causal": True}),
    # 8 kv heads divide every mesh-axis product: the rule uses the (kv_heads q_per_kv) factor.
    "gqa_compound_factor": (16, 8, P("data", None, "model"), P("data", None, "model"), {}),
    "segments": (8, 8, P("data", None, "model"), P("data", None, "model"), {"segments": True}),
    "float32": (8, 4, P("data", None, "model"), P("data", None, "model"),
                {"dtype": "float32", "causal": True}),
    "gqa_kv_not_divisible": (8, 2, P("data", None, "model"), P("data"), {"causal": True}),
    "mqa_heads_on_two_axes": (8, 1, P(None, None, ("data", "model")), P(), {}),
    "kv_conflicts_with_q": (8, 8, P("data", None, "model"), P("model", None, "data"), {}),
    "head_dim_sharded": (8, 8, P("data", None, None, "model"), P("data", None, None, "model"),
                         {}),
    "seq_sharded": (8, 8, P("data", "model"), P("data", "model"), {"causal": True}),
    "partial_manual_shard_map": (8, 8, P("data", None, "model"), P("data", None, "model"),
                                 {"shard_map_axes": ("data",)}),
    # Mesh with Explicit axes (jax.make_mesh's default): avals carry shardings.
    "explicit_batch_heads": (8, 8, P("data", None, "model"), P("data", None, "model"),
                             {"explicit": True}),
    "explicit_gqa_kv_not_divisible": (8, 2, P("data", None, "model"), P("data"),
                                      {"explicit": True, "causal": True}),
    # An additive bias (batch, heads, seq_q, seq_k) sharded like q's batch and heads; one
    # broadcast over the batch, whose gradient each batch shard adds to (one all-reduce).
    "bias_batch_heads": (8, 4, P("data", None, "model"), P("data", None, "model"),
                         {"bias": "BH", "causal": True}),
    "bias_broadcast_batch": (8, 8, P("data", None, "model"), P("data", None, "model"),
                             {"bias": "1H"}),
}
NO_COLLECTIVES = ("batch", "heads", "batch_heads", "gqa_heads", "gqa_compound_factor",
                  "segments", "float32", "explicit_batch_heads", "bias_batch_heads")
REPLICATED_KV = ("gqa_kv_not_divisible", "mqa_heads_on_two_axes", "explicit_gqa_kv_not_divisible")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  return _multidevice.worker_results(tmp_path_factory, "tests.test_sharding")


@pytest.mark.parametrize("name", CASES.keys())
def test_sharded_equals_unsharded(results, name):
  r = results[name]
  bound = 1e-5 if r["dtype"] == "float32" else 1e-10
  assert r["error"] <= bound, f"{name}: relative L2 {r['error']:.3e} > {bound:g}"


@pytest.mark.parametrize("name", NO_COLLECTIVES)
def test_batch_and_head_sharding_adds_no_collective(results, name):
  counts = results[name]["collectives"]
  assert counts == dict.fromkeys(_multidevice.COLLECTIVES, 0), counts


@pytest.mark.parametrize("name", NO_COLLECTIVES)
def test_outputs_keep_the_input_sharding(results, name):
  q_spec, k_spec = CASES[name][2], CASES[name][3]
  r = results[name]
  assert tuple(r["out_spec"]) == _multidevice.padded_spec(q_spec), r
  assert tuple(r["dk_spec"]) == _multidevice.padded_spec(k_spec), r


@pytest.mark.parametrize("name", REPLICATED_KV)
def test_replicated_kv_heads_only_sum_dk_dv(results, name):
  """kv heads fewer than head shards: the only collective is the dk/dv sum, of k's shape."""
  r = results[name]
  counts = dict(r["collectives"])
  assert counts.pop("all-reduce") >= 1
  assert counts == dict.fromkeys(counts, 0), r["collectives"]
  for shape in r["all_reduce_shapes"]:
    assert shape == r["local_kv_shape"], r


def test_a_bias_broadcast_over_sharded_batches_sums_its_gradient_only(results):
  """A (1, H, S, S) bias under batch sharding: the only collective is dbias's sum over the
  batch shards, of the bias's local shape (heads split by the model axis)."""
  r = results["bias_broadcast_batch"]
  counts = dict(r["collectives"])
  assert counts.pop("all-reduce") >= 1
  assert counts == dict.fromkeys(counts, 0), r["collectives"]
  assert set(r["all_reduce_shapes"]) == {"1,2,32,32"}, r


@pytest.mark.parametrize("name", ["head_dim_sharded", "seq_sharded"])
def test_unsupported_dims_are_gathered(results, name):
  """head_dim/seq sharding resolves by gathering those dims (docs/sharding.md)."""
  assert results[name]["collectives"]["all-gather"] > 0


# KV caches (jaxflash.kv_cache_attention): name -> (query spec, cache spec, paged). A pool is
# split by kv heads, contiguous caches by batch or heads; the page table and lengths follow
# the batch (a pool is shared by the batch: replicated along it).
KV_CACHE_CASES = {
    "kv_cache_batch": (P("data"), P("data"), False),
    "kv_cache_batch_heads": (P("data", None, "model"), P("data", None, "model"), False),
    "kv_cache_paged_heads": (P(None, None, "model"), P(None, None, "model"), True),
}


@pytest.mark.parametrize("name", KV_CACHE_CASES.keys())
def test_kv_cache_attention_runs_per_shard(results, name):
  """Each shard attends over its own part of the caches: the unsharded result, no
  collective (the caches are never gathered)."""
  r = results[name]
  assert r["error"] <= 1e-12, r
  assert r["collectives"] == dict.fromkeys(_multidevice.COLLECTIVES, 0), r["collectives"]
  assert tuple(r["out_spec"]) == _multidevice.padded_spec(KV_CACHE_CASES[name][0]), r


DECODE_CALL_CASES = {  # the kernel path's call (decode_attention), its CPU lowering per shard
    "decode_call_batch": (P("data"), P("data"), False, False),
    "decode_call_batch_heads_sink": (P("data", None, "model"), P("data", None, "model"), False,
                                     True),
    "decode_call_paged_batch_heads_sink": (P("data", None, "model"), P(None, None, "model"),
                                           True, True),
    # float8_e4m3fn caches: their descales (pages or sequences, kv heads) shard as the caches.
    "decode_call_fp8_batch_heads": (P("data", None, "model"), P("data", None, "model"), False,
                                    False, True),
    "decode_call_fp8_paged_heads": (P("data", None, "model"), P(None, None, "model"), True,
                                    False, True),
    # The chunked-prefill variant (no split, no partials) partitions as the split one.
    "decode_call_chunked_paged_batch_heads_sink": (P("data", None, "model"),
                                                   P(None, None, "model"), True, True, False,
                                                   True),
}


@pytest.mark.parametrize("name", DECODE_CALL_CASES.keys())
def test_decode_call_runs_per_shard(results, name):
  """The decode kernel's call partitions like the reference path: per shard of batch and kv
  heads (a page pool by kv heads), the unsharded result, no collective, no gathered cache."""
  r = results[name]
  assert r["error"] <= 1e-6, r
  assert r["collectives"] == dict.fromkeys(_multidevice.COLLECTIVES, 0), r["collectives"]
  assert tuple(r["out_spec"]) == _multidevice.padded_spec(DECODE_CALL_CASES[name][0]), r


@pytest.mark.gpu
def test_kernels_run_per_shard_on_gpus():
  """Batch sharding over real GPUs: the FFI kernel runs per shard, no collective, same result."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import AxisType, Mesh, NamedSharding

  import jaxflash
  from tests._cases import make_qkv

  gpus = jax.devices("gpu")
  if len(gpus) < 2:
    pytest.skip("needs 2 or more GPUs")
  mesh = Mesh(np.array(gpus), ("data",), axis_types=(AxisType.Auto,))
  q, k, v = make_qkv(31, 2 * len(gpus), 512, 512, 4, 2, 128, dtype=jnp.bfloat16)
  d_out = jnp.asarray(np.random.default_rng(32).standard_normal(q.shape), jnp.bfloat16)

  def step(q, k, v, d_out):
    attend = lambda q, k, v: jaxflash.attention(q, k, v, causal=True, implementation="cute")
    out, vjp = jax.vjp(attend, q, k, v)
    return (out,) + vjp(d_out)

  fn = jax.jit(step)
  want = fn(q, k, v, d_out)
  placed = [jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (q, k, v, d_out)]
  got = fn(*placed)
  hlo = fn.lower(*placed).compile().as_text()
  assert "jaxflash_attention_fwd" in hlo
  assert _multidevice.collective_counts(hlo) == dict.fromkeys(_multidevice.COLLECTIVES, 0)
  assert _multidevice.max_relative_l2(got, want) <= 1e-6


# ---------------------------------------------------------------------------------------------
# Worker (runs under `python -m tests.test_sharding` with 8 fake devices)

def _spec_json(sharding_):
  return _multidevice.padded_spec(sharding_.spec)


def _run_case(name, heads, kv_heads, q_spec, kv_spec, options):
  import jax
  import jax.numpy as jnp
  from jax.sharding import AxisType, Mesh, NamedSharding

  import jaxflash
  from tests._cases import make_qkv, make_segments

  dtype = options.get("dtype", "float64")
  axis_types = (AxisType.Explicit if options.get("explicit") else AxisType.Auto,) * 2
  mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"), axis_types=axis_types)
  b, t, d = 8, 32, 16
  q, k, v = make_qkv(7, b, t, t, heads, kv_heads, d, dtype=dtype)
  rng = np.random.default_rng(8)
  d_out = jnp.asarray(rng.standard_normal(q.shape), dtype)
  d_lse = jnp.asarray(rng.standard_normal((b, heads, t)), dtype)
  segs = make_segments(9, b, t, t) if options.get("segments") else (None, None)
  causal = options.get("causal", False)
  kind = options.get("bias")
  bias = None
  if kind:  # "BH": (b, heads, t, t); "1H": (1, heads, t, t)
    bias = jnp.asarray(rng.standard_normal((b if kind[0] == "B" else 1, heads, t, t)), dtype)

  def attend(q, k, v, q_seg, kv_seg, bias=None):
    return jaxflash.attention(q, k, v, causal=causal, q_segment_ids=q_seg,
                              kv_segment_ids=kv_seg, bias=bias, return_lse=True)

  if options.get("shard_map_axes"):  # jaxflash inside a shard_map manual over some axes
    spec, body = P("data"), attend
    attend = jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3 + (None, None),
                           out_specs=(spec, spec), axis_names=set(options["shard_map_axes"]),
                           check_vma=False)

  def step(q, k, v, d_out, d_lse, q_seg, kv_seg, *bias):
    (out, lse), vjp = jax.vjp(lambda q, k, v, *bias: attend(q, k, v, q_seg, kv_seg, *bias),
                              q, k, v, *bias)
    return (out, lse) + vjp((d_out, d_lse))

  args = (q, k, v, d_out, d_lse) + segs + (() if bias is None else (bias,))
  want = jax.jit(step)(*args)
  qs = tuple(q_spec) + (None,) * (4 - len(tuple(q_spec)))
  lse_spec = P(qs[0], qs[2], qs[1])
  specs = (q_spec, kv_spec, kv_spec, q_spec, lse_spec) + ((P(qs[0]),) * 2 if segs[0] is not None
                                                        else (None, None))
  if bias is not None:
    specs += (P(qs[0] if kind[0] == "B" else None, qs[2]),)
  placed = tuple(None if a is None else jax.device_put(a, NamedSharding(mesh, s))
                 for a, s in zip(args, specs))
  fn = jax.jit(step)
  got = fn(*placed)
  hlo = fn.lower(*placed).compile().as_text()
  reduce_shapes = []
  for line in hlo.splitlines():
    m = re.search(r"=\s*\(?(\w+\[[\d,]*\])[^=]*?\sall-reduce(?:-start)?\(", line)
    if m:
      reduce_shapes.append(m.group(1).split("[")[1].rstrip("]"))
  local_kv = list(k.shape)
  local_kv[0] //= MESH["data"] if "data" in sharding.spec_axes(kv_spec, 4)[0] else 1
  return {
      "dtype": dtype,
      "error": _multidevice.max_relative_l2(got, want),
      "collectives": _multidevice.collective_counts(hlo),
      "out_spec": _spec_json(got[0].sharding),
      "dk_spec": _spec_json(got[3].sharding),
      "all_reduce_shapes": reduce_shapes,
      "local_kv_shape": ",".join(map(str, local_kv)),
  }


def _run_cache_case(q_spec, cache_spec, paged, attend, dtype, head_dim, seed):
  """attend(q, k_cache, v_cache, lengths, page_table) on 8 x 2 new tokens, 8 / 4 heads, caches
  of 48 keys (pages of 16, permuted in the pool when paged), placed per the specs, against the
  unsharded call."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import AxisType, Mesh, NamedSharding

  mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"),
              axis_types=(AxisType.Auto,) * 2)
  rng = np.random.default_rng(seed)
  b, seq_q, h, h_kv, d, page_size, pages = 8, 2, 8, 4, head_dim, 16, 3
  q = jnp.asarray(rng.standard_normal((b, seq_q, h, d)), dtype)
  cache_shape = (b * pages, page_size, h_kv, d) if paged else (b, pages * page_size, h_kv, d)
  k_cache, v_cache = (jnp.asarray(rng.standard_normal(cache_shape), dtype) for _ in range(2))
  lengths = jnp.asarray(rng.integers(0, pages * page_size + 1, b), jnp.int32)
  table = (jnp.asarray(rng.permutation(b * pages).reshape(b, pages), jnp.int32) if paged
           else None)
  want = jax.jit(attend)(q, k_cache, v_cache, lengths, table)
  batch = P(q_spec[0]) if len(q_spec) and q_spec[0] else P()
  specs = (q_spec, cache_spec, cache_spec, batch, None if table is None else batch)
  placed = tuple(None if a is None else jax.device_put(a, NamedSharding(mesh, s))
                 for a, s in zip((q, k_cache, v_cache, lengths, table), specs))
  fn = jax.jit(attend)
  got = fn(*placed)
  return {"error": _multidevice.max_relative_l2(got, want),
          "collectives": _multidevice.collective_counts(fn.lower(*placed).compile().as_text()),
          "out_spec": _spec_json(got[0].sharding)}


def _run_kv_cache_case(q_spec, cache_spec, paged):
  import jaxflash

  def attend(q, k_cache, v_cache, lengths, table):
    return jaxflash.kv_cache_attention(q, k_cache, v_cache, lengths, page_table=table,
                                       window_size=(20, None), return_lse=True)

  return _run_cache_case(q_spec, cache_spec, paged, attend, np.float64, 16, 10)


def _run_decode_call_case(q_spec, cache_spec, paged, with_sink, fp8=False, chunked=False):
  """split_kv.kernel_forward's call (decode_attention) on bf16 caches, with_sink a learnable
  sink, which shards with the kv heads; fp8: the caches quantized to float8_e4m3fn inside the
  call, a descale per (page or sequence, kv head); chunked: on the chunked-prefill variant. On
  CPU its results come from decode_p's XLA lowering."""
  import jax.numpy as jnp

  from jaxflash import split_kv
  from jaxflash.config import AttentionConfig
  from jaxflash.fp8 import quantize_tensor

  cfg = AttentionConfig(causal=True, softmax_scale=64 ** -0.5, window_left=20)

  sink = jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float32) if with_sink else None

  def attend(q, k_cache, v_cache, lengths, table):
    if not fp8:
      return split_kv.kernel_forward(cfg, q, k_cache, v_cache, lengths, table, sink, 3,
                                     chunked=chunked)
    (k8, kd), (v8, vd) = quantize_tensor(k_cache), quantize_tensor(v_cache)
    return split_kv.kernel_forward(cfg, q, k8, v8, lengths, table, sink, 3, kd, vd)

  return _run_cache_case(q_spec, cache_spec, paged, attend, jnp.bfloat16, 64, 11)


def _worker():
  import jax
  jax.config.update("jax_enable_x64", True)
  assert jax.device_count() == _multidevice.NUM_DEVICES, jax.devices()
  results = {name: _run_case(name, *case) for name, case in CASES.items()}
  results.update({name: _run_kv_cache_case(*case) for name, case in KV_CACHE_CASES.items()})
  results.update({name: _run_decode_call_case(*case) for name, case in DECODE_CALL_CASES.items()})
  _multidevice.emit(results)


if __name__ == "__main__":
  _worker()
