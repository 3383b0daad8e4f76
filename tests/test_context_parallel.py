"""Ring attention: schedule and argument checks here, 8 fake CPU devices in a child process.

Every case must equal unsharded jaxflash.attention (float64, forward, lse and gradients with a
nonzero lse cotangent), and the ring must move data with collective-permutes only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, AxisType, PartitionSpec as P

import jaxflash
from jaxflash import context_parallel as cp
from tests import _multidevice

# ---------------------------------------------------------------------------------------------
# Static schedule (no devices)


def test_zigzag_steps_balance_work():
  n, c = 4, 8
  steps = cp._zigzag_steps(n, c)
  assert len(steps) == n
  assert steps[0] == (cp._Block(0, 2 * c, 0, 2 * c, causal=True),)
  for candidates in steps[1:]:
    # Both candidates (keys from before / after the local chunks) cost 2 c x c.
    assert [b.q_len * b.k_len for b in candidates] == [2 * c * c, 2 * c * c]
    assert not any(b.causal for b in candidates)


def test_window_steps_skip_hidden_blocks_and_stop_early():
  n, c = 4, 16
  # Causal band of 20 tokens: the chunk 1 and 2 behind are visible, nothing ahead.
  steps = cp._window_steps(n, c, 20, 0)
  assert len(steps) == 3
  assert all(candidates[1] is None for candidates in steps[1:])
  assert steps[1][0].window == (20 - c, c) and steps[2][0].window == (20 - 2 * c, 2 * c)
  # A band that reaches 3 tokens ahead needs the chunk after: it arrives at the last step.
  steps = cp._window_steps(n, c, 10, 3)
  assert len(steps) == n and steps[2] == (None, None) and steps[3][0] is None
  assert steps[3][1].window == (10 + c, 3 - c)


@pytest.mark.parametrize("delta,left,right,visible", [
    (0, None, None, True), (16, 10, 0, True), (32, 10, 0, False), (-16, None, 0, False),
    (-16, None, -13, False), (-16, None, -1, False), (-16, 0, 3, True)])
def test_block_visible(delta, left, right, visible):
  # c = 16: key offsets j - i within a block range over [-15, 15].
  assert cp._block_visible(16, 16, delta, left, right) is visible


# ---------------------------------------------------------------------------------------------
# Argument checks (an abstract mesh: the checks run before any device is touched)

MESH = AbstractMesh((2, 4), ("data", "sp"), axis_types=(AxisType.Auto,) * 2)


def _qkv(seq_q=64, seq_k=64, heads=4, kv_heads=2):
  return (jnp.zeros((2, seq_q, heads, 16)), jnp.zeros((2, seq_k, kv_heads, 16)),
          jnp.zeros((2, seq_k, kv_heads, 16)))


BAD_ARGS = {  # name -> (qkv kwargs, call kwargs, error type, message fragment)
    "mesh_type": ({}, dict(mesh=None), TypeError, "mesh"),
    "axis_name": ({}, dict(axis_name="seq"), ValueError, "axis_name: 'seq'"),
    "causal_seq_multiple": (dict(seq_q=36, seq_k=36), dict(causal=True), ValueError,
                            "multiple of 2 x the size 4"),
    "seq_multiple": (dict(seq_q=30, seq_k=30), {}, ValueError, "multiple of the size 4"),
    "causal_cross_lengths": (dict(seq_k=32), dict(causal=True), ValueError, "seq_k == seq_q"),
    "window_cross_lengths": (dict(seq_k=32), dict(window_size=(4, 0)), ValueError,
                             "seq_k == seq_q"),
    "unknown_option": ({}, dict(bias=1.0), TypeError, "unexpected keyword argument(s) ['bias']"),
    "head_axes_vs_kv_heads": (dict(kv_heads=1), dict(head_axes="data"), ValueError,
                              "head_axes"),
    "batch_axes_is_axis_name": ({}, dict(batch_axes="sp"), ValueError, "batch_axes"),
    "overlapping_axes": ({}, dict(batch_axes="data", head_axes="data"), ValueError,
                         "overlaps batch_axes"),
    "window_type": ({}, dict(window_size=3), ValueError, "window_size"),
    "one_segment_ids": ({}, dict(q_segment_ids=jnp.zeros((2, 64), jnp.int32)), ValueError,
                        "q_segment_ids/kv_segment_ids"),
}


@pytest.mark.parametrize("case", BAD_ARGS.values(), ids=BAD_ARGS.keys())
def test_bad_arguments_raise_named_errors(case):
  shape_kwargs, kwargs, error, fragment = case
  kwargs = dict(dict(mesh=MESH, axis_name="sp"), **kwargs)
  with pytest.raises(error) as info:
    cp.context_parallel_attention(*_qkv(**shape_kwargs), **kwargs)
  assert fragment in str(info.value)


# ---------------------------------------------------------------------------------------------
# 8 fake devices

# name -> (heads, kv_heads, seq_q, seq_k, options); mesh (data 2, sp 4) unless "ring8".
CASES = {
    "plain": (4, 4, 64, 64, {}),
    "causal": (4, 4, 64, 64, {"causal": True}),
    "causal_gqa": (4, 2, 64, 64, {"causal": True}),
    "mqa": (4, 1, 64, 64, {}),
    "causal_gqa_segments": (4, 2, 64, 64, {"causal": True, "segments": True}),
    "window": (4, 2, 64, 64, {"window_size": (10, 3)}),
    "causal_window": (4, 2, 64, 64, {"causal": True, "window_size": (20, None)}),
    "window_rows_without_keys": (4, 2, 64, 64, {"window_size": (None, -1)}),
    "softcap_scale": (4, 2, 64, 64, {"causal": True, "softcap": 1.5, "softmax_scale": 0.3}),
    "cross_lengths": (4, 2, 64, 32, {}),
    "heads_sharded": (4, 2, 64, 64, {"causal": True, "head_axes": "data", "batch_axes": ()}),
    "ring8": (4, 2, 64, 64, {"causal": True, "ring8": True}),
    "float32": (4, 2, 64, 64, {"causal": True, "dtype": "float32"}),
    "eager_inferred_axes": (4, 2, 64, 64, {"causal": True, "eager": True}),
    "explicit_mesh": (4, 2, 64, 64, {"causal": True, "explicit": True}),
    # The sink joins the merged result once; a sink per ring step would count it 4 times.
    "causal_gqa_segments_sink": (4, 2, 64, 64, {"causal": True, "segments": True,
                                                "sink": True}),
    "window_rows_without_keys_sink": (4, 2, 64, 64, {"window_size": (None, -1), "sink": True}),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  return _multidevice.worker_results(tmp_path_factory, "tests.test_context_parallel")


@pytest.mark.parametrize("name", CASES.keys())
def test_ring_equals_unsharded(results, name):
  r = results[name]
  bound = 1e-5 if r["dtype"] == "float32" else 1e-10
  assert r["error"] <= bound, f"{name}: relative L2 {r['error']:.3e} > {bound:g}"


@pytest.mark.parametrize("name", ["plain", "causal", "causal_gqa_segments", "ring8",
                                  "heads_sharded"])
def test_ring_moves_data_with_permutes_only(results, name):
  counts = dict(results[name]["collectives"])
  assert counts.pop("collective-permute") > 0
  assert counts == dict.fromkeys(counts, 0), results[name]["collectives"]


@pytest.mark.parametrize("name", ["eager_inferred_axes", "explicit_mesh"])
def test_batch_sharding_is_kept(results, name):
  """Axes the inputs show (concrete arrays, explicit-axis meshes) are kept: batch on 'data'."""
  assert results[name]["out_spec"][:2] == ["data", "sp"], results[name]


def test_bfloat16_ring_is_as_accurate_as_naive_bfloat16(results):
  """The project's oracle rule (tests/_oracle.py) on the ring: out and gradients in bfloat16."""
  assert results["bfloat16_vs_oracle"] == "ok", results["bfloat16_vs_oracle"]


@pytest.mark.parametrize("name,blocks", [
    # One document per 16-token shard: each of the 8 devices (2 batch x 4 sequence shards)
    # runs its own block only, at step 0; the 3 other steps are skipped.
    ("blocks_docs16_full", 8),
    # Causal zig-zag, documents of 8 inside each of the 8 chunks: the local step only.
    ("blocks_docs8_causal", 8),
    # Documents of 24 straddle the shards 0/1 and 1/2: those pairs (both ways) run too.
    ("blocks_docs24_full", 8 + 2 * 4)])
def test_ring_skips_blocks_without_a_shared_segment(results, name, blocks):
  r = results[name]
  assert r["error"] <= 1e-10, r
  assert r["blocks"] == blocks, r


def test_rows_without_keys_are_zero_with_lse_minus_inf(results):
  r = results["window_rows_without_keys"]
  assert r["lse_neg_inf_rows"] > 0 and r["out_zero_on_those_rows"]


# ---------------------------------------------------------------------------------------------
# Worker (runs under `python -m tests.test_context_parallel` with 8 fake devices)

def _mesh(options):
  from jax.sharding import Mesh
  axis_type = AxisType.Explicit if options.get("explicit") else AxisType.Auto
  if options.get("ring8"):
    return Mesh(np.array(jax.devices()), ("sp",), axis_types=(axis_type,))
  return Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "sp"), axis_types=(axis_type,) * 2)


def _run_case(heads, kv_heads, seq_q, seq_k, options):
  from jax.sharding import NamedSharding

  from tests._cases import make_qkv, make_segments

  options = dict(options)
  dtype = options.pop("dtype", "float64")
  mesh = _mesh(options)
  b, d = 2, 16
  q, k, v = make_qkv(11, b, seq_q, seq_k, heads, kv_heads, d, dtype=dtype)
  rng = np.random.default_rng(12)
  d_out = jnp.asarray(rng.standard_normal(q.shape), dtype)
  d_lse = jnp.asarray(rng.standard_normal((b, heads, seq_q)), dtype)
  segs = make_segments(13, b, seq_q, seq_k) if options.pop("segments", False) else (None, None)
  sink = (jnp.asarray(rng.normal(0.5, 2.0, heads), dtype) if options.pop("sink", False)
          else None)
  eager, explicit, ring8 = (options.pop(k, False) for k in ("eager", "explicit", "ring8"))
  kw = dict(options)
  if not (eager or explicit or ring8):
    kw.setdefault("batch_axes", "data")
  attn_kw = {k: v for k, v in kw.items() if k not in ("batch_axes", "head_axes")}

  def reference(q, k, v, q_seg, kv_seg, sink):
    return jaxflash.attention(q, k, v, q_segment_ids=q_seg, kv_segment_ids=kv_seg,
                              learnable_sink=sink, return_lse=True, **attn_kw)

  def ring(q, k, v, q_seg, kv_seg, sink):
    return cp.context_parallel_attention(q, k, v, mesh=mesh, axis_name="sp", q_segment_ids=q_seg,
                                         kv_segment_ids=kv_seg, learnable_sink=sink,
                                         return_lse=True, **kw)

  def step(attend, q, k, v, d_out, d_lse, q_seg, kv_seg, sink=None):
    # With a sink, its gradient is compared too (the last result).
    diff = (q, k, v) + (() if sink is None else (sink,))
    (out, lse), vjp = jax.vjp(lambda q, k, v, *s: attend(q, k, v, q_seg, kv_seg, *s or (None,)),
                              *diff)
    d_lse = jnp.where(jnp.isfinite(lse), d_lse, 0.0)
    return (out, lse) + vjp((d_out, d_lse))

  args = (q, k, v, d_out, d_lse) + segs + (() if sink is None else (sink,))
  want = jax.jit(lambda *a: step(reference, *a))(*args)
  batch = None if ring8 else "data"
  specs = [P(batch, "sp")] * 4 + [P(batch, None, "sp")] + [P(batch, "sp")] * 2 + [P()]
  if kw.get("head_axes"):
    specs = [P(None, "sp", "data")] * 4 + [P(None, "data", "sp")] + [P(None, "sp")] * 2 + [P()]
  placed = tuple(None if a is None else jax.device_put(a, NamedSharding(mesh, s))
                 for a, s in zip(args, specs))
  fn = jax.jit(lambda *a: step(ring, *a))
  if eager:  # forward only: under jax.vjp the inputs would be tracers, not sharded arrays
    got = ring(*placed[:3], *placed[5:7], None)
    want = want[:2]
  elif explicit:
    with jax.set_mesh(mesh):
      got = fn(*placed)
  else:
    got = fn(*placed)
  result = {"dtype": dtype, "error": _multidevice.max_relative_l2(got, want),
            "out_spec": [e if e is None or isinstance(e, str) else list(e)
                         for e in tuple(got[0].sharding.spec) + (None,) * 4][:4]}
  if not (eager or explicit):
    result["collectives"] = _multidevice.collective_counts(fn.lower(*placed).compile().as_text())
  lse, out = np.asarray(got[1]), np.asarray(got[0])
  empty = np.isneginf(lse)  # (b, h, t)
  result["lse_neg_inf_rows"] = int(empty.sum())
  result["out_zero_on_those_rows"] = bool(np.all(np.swapaxes(out, 1, 2)[empty] == 0))
  return result


def _bfloat16_vs_oracle():
  """Causal GQA ring in bfloat16 against the float64 oracle, bounded by naive bfloat16 math."""
  from jaxflash import reference
  from tests._cases import config_for, make_qkv
  from tests._oracle import assert_close_to_oracle

  mesh = _mesh({})
  q, k, v = make_qkv(17, 2, 64, 64, 4, 2, 16, dtype=jnp.bfloat16)
  d_out = jnp.asarray(np.random.default_rng(18).standard_normal(q.shape), jnp.bfloat16)
  cfg = config_for(16, {"causal": True})

  def grads(attend, dtype):
    args = [x.astype(dtype) for x in (q, k, v)]
    out, vjp = jax.vjp(attend, *args)
    return (out,) + vjp(d_out.astype(dtype))

  oracle = grads(lambda *a: reference.naive_attention(*a, cfg)[0], jnp.float64)
  naive = grads(lambda *a: reference.naive_attention(*a, cfg, compute_dtype=jnp.bfloat16)[0],
                jnp.bfloat16)
  ring = jax.jit(lambda: grads(lambda *b: cp.context_parallel_attention(
      *b, mesh=mesh, axis_name="sp", causal=True, batch_axes="data"), jnp.bfloat16))()
  try:
    for name, got, want, bound in zip(("out", "dq", "dk", "dv"), ring, oracle, naive):
      assert_close_to_oracle(got, want, bound, name=name)
  except AssertionError as e:
    return str(e)
  return "ok"


def _blocks_run(doc_len: int, causal: bool) -> dict:
  """How many ring blocks run (forward; counted by a callback inside the block's attention),
  documents of doc_len tokens packed in rows of 64 over 4 shards, and the error against the
  unsharded call."""
  import threading
  from jax.sharding import NamedSharding

  from tests._cases import make_qkv

  mesh = _mesh({})
  q, k, v = make_qkv(19, 2, 64, 64, 4, 2, 16, dtype="float64")
  ids = jnp.broadcast_to(jnp.arange(64) // doc_len, (2, 64)).astype(jnp.int32)
  calls, lock = [0], threading.Lock()

  def count():
    with lock:
      calls[0] += 1

  def counted(*args, **kwargs):
    jax.debug.callback(count)
    return jaxflash.attention(*args, **kwargs)

  ring = lambda q, k, v, ids: cp.context_parallel_attention(
      q, k, v, mesh=mesh, axis_name="sp", causal=causal, batch_axes="data", q_segment_ids=ids,
      kv_segment_ids=ids)
  placed = [jax.device_put(x, NamedSharding(mesh, P("data", "sp"))) for x in (q, k, v, ids)]
  original, cp.attention = cp.attention, counted
  try:
    got = jax.block_until_ready(jax.jit(ring)(*placed))
  finally:
    cp.attention = original
  want = jaxflash.attention(q, k, v, causal=causal, q_segment_ids=ids, kv_segment_ids=ids)
  return {"blocks": calls[0], "error": _multidevice.max_relative_l2(got, want)}


def _worker():
  jax.config.update("jax_enable_x64", True)
  assert jax.device_count() == _multidevice.NUM_DEVICES, jax.devices()
  results = {name: _run_case(*case) for name, case in CASES.items()}
  results["bfloat16_vs_oracle"] = _bfloat16_vs_oracle()
  for doc_len, causal in ((16, False), (8, True), (24, False)):
    results[f"blocks_docs{doc_len}_{'causal' if causal else 'full'}"] = _blocks_run(doc_len,
                                                                                    causal)
  _multidevice.emit(results)


if __name__ == "__main__":
  _worker()
