"""The FP8 forward primitive's sharding rule: rule strings and specs here, and 8 fake CPU
devices in a child process, where the primitive runs its reference lowering
(implementation 'reference': the dequantized float32 math of the kernel).

Batch and head sharding must run shard-local (no collective) with the descales sharded like
the kv heads, also when the kv heads are replicated over the head shards (MQA); every pattern
must equal the unsharded result.
"""

from __future__ import annotations

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxflash import sharding
from jaxflash.config import AttentionConfig
from tests import _multidevice

MESH = {"data": 2, "model": 4}


def test_rule_names_the_descales_by_batch_and_heads():
  cfg = AttentionConfig(softmax_scale=1.0)
  rule, kw = sharding.fp8_fwd_sharding_rule(cfg, 8, 4, (2, 2))
  assert rule == ("batch seq_q (kv_heads q_per_kv) head_dim, batch seq_k kv_heads head_dim, "
                  "batch seq_k kv_heads head_dim_v, batch (kv_heads q_per_kv) q_chunks, "
                  "batch kv_heads k_chunks chunk_values -> "
                  "batch seq_q (kv_heads q_per_kv) head_dim_v, batch (kv_heads q_per_kv) seq_q")
  assert kw == {"q_per_kv": 2, "need_replication_factors": (
      "seq_q", "head_dim", "seq_k", "head_dim_v", "q_chunks", "k_chunks", "chunk_values")}
  rule, _ = sharding.fp8_fwd_sharding_rule(cfg.replace(has_sink=True), 8, 8, (2, 4))
  assert rule.split(" -> ")[0].endswith(
      "batch heads q_chunks, batch heads k_chunks chunk_values, heads")


def test_descales_follow_the_kv_heads():
  ax = lambda spec: sharding.spec_axes(spec, 4)
  plan = sharding.resolve(MESH, ax(P("data", None, "model")), ax(P("data")), ax(P("data")),
                          batch=8, num_heads=8, num_kv_heads=4)
  assert plan.q_descale_spec() == P("data", "model", None)
  assert plan.kv_descale_spec() == P("data", "model", None, None)
  plan = sharding.resolve(MESH, ax(P("data", None, "model")), ax(P("data")), ax(P("data")),
                          batch=8, num_heads=8, num_kv_heads=2)
  assert plan.kv_replicated and plan.kv_descale_spec() == P("data", None, None, None)
  assert plan.q_descale_spec() == P("data", "model", None)


# ---------------------------------------------------------------------------------------------
# 8 fake devices

# name -> (num_heads, num_kv_heads, q spec, k/v spec, with a sink)
CASES = {
    "batch_heads": (8, 8, P("data", None, "model"), P("data", None, "model"), False),
    "gqa_heads_sink": (8, 4, P("data", None, "model"), P("data", None, "model"), True),
    "gqa_kv_replicated": (8, 2, P("data", None, "model"), P("data"), False),
    "mqa_heads_on_two_axes": (8, 1, P(None, None, ("data", "model")), P(), True),
    "seq_sharded": (8, 8, P("data", "model"), P("data", "model"), False),
}
NO_COLLECTIVES = ("batch_heads", "gqa_heads_sink", "gqa_kv_replicated", "mqa_heads_on_two_axes")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  return _multidevice.worker_results(tmp_path_factory, "tests.test_fp8_sharding")


@pytest.mark.parametrize("name", CASES.keys())
def test_sharded_equals_unsharded(results, name):
  assert results[name]["error"] <= 1e-6, results[name]


@pytest.mark.parametrize("name", NO_COLLECTIVES)
def test_batch_and_head_sharding_run_shard_local(results, name):
  r = results[name]
  assert r["collectives"] == dict.fromkeys(_multidevice.COLLECTIVES, 0), r
  assert tuple(r["out_spec"]) == _multidevice.padded_spec(CASES[name][2]), r


def test_sequence_sharding_is_gathered(results):
  assert results["seq_sharded"]["collectives"]["all-gather"] > 0


# ---------------------------------------------------------------------------------------------
# Worker (runs under `python -m tests.test_fp8_sharding` with 8 fake devices)

def _run_case(heads, kv_heads, q_spec, kv_spec, with_sink):
  import jax
  import jax.numpy as jnp
  from jax.sharding import AxisType, Mesh, NamedSharding

  import jaxflash
  from jaxflash import fp8_kernel

  mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"),
              axis_types=(AxisType.Auto,) * 2)
  b, t, d = 8, 48, 16
  rng = np.random.default_rng(heads * 10 + kv_heads)
  q = jnp.asarray(rng.standard_normal((b, t, heads, d)), jnp.bfloat16)
  k, v = (jnp.asarray(rng.standard_normal((b, t, kv_heads, d)), jnp.bfloat16) for _ in range(2))
  q8, k8, v8, qd, kd, vd = jaxflash.quantize_fp8(q, k, v)
  sink = jnp.asarray(rng.normal(0.0, 2.0, heads), jnp.float32) if with_sink else None
  cfg = AttentionConfig(softmax_scale=d ** -0.5, causal=True, implementation="reference",
                        has_sink=with_sink)

  def attend(q8, k8, v8, qd, kd, vd, sink):
    return fp8_kernel.fp8_forward(cfg, q8, k8, v8, qd, kd, vd, sink)

  args = (q8, k8, v8, qd, kd, vd, sink)
  want = jax.jit(attend)(*args)
  d_spec = P(tuple(kv_spec)[0] if len(tuple(kv_spec)) else None,
             tuple(kv_spec)[2] if len(tuple(kv_spec)) > 2 else None)
  specs = (q_spec, kv_spec, kv_spec, d_spec, d_spec, d_spec, P())
  placed = tuple(None if a is None else jax.device_put(a, NamedSharding(mesh, s))
                 for a, s in zip(args, specs))
  fn = jax.jit(attend)
  got = fn(*placed)
  hlo = fn.lower(*placed).compile().as_text()
  return {"error": _multidevice.max_relative_l2(got, want),
          "collectives": _multidevice.collective_counts(hlo),
          "out_spec": _multidevice.padded_spec(got[0].sharding.spec)}


def _worker():
  import jax
  assert jax.device_count() == _multidevice.NUM_DEVICES, jax.devices()
  _multidevice.emit({name: _run_case(*case) for name, case in CASES.items()})


if __name__ == "__main__":
  _worker()
