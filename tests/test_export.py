"""jax.export round trips of a training step that uses jaxflash.

CPU: export, serialize, run in a fresh process (no jaxflash import there), same numbers.
CUDA: an export made on this CPU host holds the stable custom call `jaxflash_attention_fwd`
with its attributes; on a GPU host, `jaxflash.ffi.register()` is all a fresh process needs.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.export import DisabledSafetyCheck

import jaxflash
from jaxflash.config import (BWD_TARGET, DECODE_TARGET, FWD_ATTRIBUTE_NAMES, FWD_TARGET,
                             AttentionConfig, KernelVariant)
from tests import _multidevice

pytest.importorskip("flatbuffers", reason="jax.export serialization needs flatbuffers")

# What an export with jaxflash custom calls must allow (docs/export.md): the targets are not on
# jax.export's list of custom calls with a stability guarantee, jaxflash gives its own.
DISABLED_CHECKS = [DisabledSafetyCheck.custom_call(FWD_TARGET),
                   DisabledSafetyCheck.custom_call(BWD_TARGET)]
_ROOT = pathlib.Path(__file__).resolve().parent.parent


def _params_and_batch(dtype, d_model=32, heads=4, kv_heads=2, head_dim=16, batch=2, seq=64):
  rng = np.random.default_rng(21)
  init = lambda *s: jnp.asarray(rng.standard_normal(s) / np.sqrt(s[0]), dtype)
  params = {"wq": init(d_model, heads, head_dim), "wk": init(d_model, kv_heads, head_dim),
            "wv": init(d_model, kv_heads, head_dim), "wo": init(heads, head_dim, d_model)}
  x = jnp.asarray(rng.standard_normal((batch, seq, d_model)), dtype)
  target = jnp.asarray(rng.standard_normal((batch, seq, d_model)), dtype)
  return params, x, target


def _train_step(params, x, target, implementation=None):
  """One SGD step of a causal GQA attention layer: (loss, new params)."""
  def loss_fn(p):
    q = jnp.einsum("btd,dhk->bthk", x, p["wq"])
    k = jnp.einsum("btd,dhk->bthk", x, p["wk"])
    v = jnp.einsum("btd,dhk->bthk", x, p["wv"])
    out = jaxflash.attention(q, k, v, causal=True, implementation=implementation)
    y = jnp.einsum("bthk,hkd->btd", out, p["wo"])
    return jnp.mean(jnp.square(y.astype(jnp.float32) - target.astype(jnp.float32)))

  loss, grads = jax.value_and_grad(loss_fn)(params)
  return loss, jax.tree.map(lambda w, g: w - 0.1 * g.astype(w.dtype), params, grads)


_CHILD = textwrap.dedent("""
    import sys
    import jax, numpy as np
    exported = jax.export.deserialize(bytearray(open(sys.argv[1], "rb").read()))
    inputs = np.load(sys.argv[2])
    # npz stores bfloat16 as raw 2-byte voids: view them back as the exported input dtypes.
    flat = [inputs[f"a{i}"].view(aval.dtype) for i, aval in enumerate(exported.in_avals)]
    args = jax.tree.unflatten(exported.in_tree, flat)
    flat = jax.tree.leaves(exported.call(*args[0], **args[1]))
    np.savez(sys.argv[3], *[np.asarray(x) for x in flat])
    assert "jaxflash" not in sys.modules, "the exported module must run without jaxflash"
    """)


def test_training_step_round_trip_in_fresh_process(tmp_path):
  params, x, target = _params_and_batch(jnp.float32)
  step = jax.jit(_train_step)
  exported = jax.export.export(step)(params, x, target)
  # The CPU (reference) lowering is plain StableHLO: nothing to register where it runs.
  text = exported.mlir_module()
  assert FWD_TARGET not in text and "CustomSPMDPartitioning" not in text
  blob = tmp_path / "step.jaxexport"
  blob.write_bytes(exported.serialize())
  flat_in = jax.tree.leaves(((params, x, target), {}))
  np.savez(tmp_path / "in.npz", **{f"a{i}": np.asarray(a) for i, a in enumerate(flat_in)})
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", _CHILD, str(blob), str(tmp_path / "in.npz"),
                         str(tmp_path / "out.npz")], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-4000:]
  child = np.load(tmp_path / "out.npz")
  child = [child[f"arr_{i}"] for i in range(len(child))]
  here = [np.asarray(a) for a in jax.tree.leaves(exported.call(params, x, target))]
  direct = [np.asarray(a) for a in jax.tree.leaves(step(params, x, target))]
  assert len(child) == len(here) == len(direct) == 5  # loss + 4 weights
  for c, h, d in zip(child, here, direct):
    np.testing.assert_array_equal(c, h)  # same module, same compiler: identical
    np.testing.assert_allclose(h, d, rtol=1e-6, atol=1e-7)


def _cuda_export(disabled_checks):
  params, x, target = _params_and_batch(jnp.bfloat16, head_dim=64)
  specs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (params, x, target))
  step = jax.jit(lambda p, x, t: _train_step(p, x, t, implementation="cute"))
  return jax.export.export(step, platforms=("cuda",), disabled_checks=disabled_checks)(*specs)


def test_cuda_export_from_cpu_host_holds_the_stable_target():
  exported = _cuda_export(DISABLED_CHECKS)
  assert exported.platforms == ("cuda",)
  restored = jax.export.deserialize(exported.serialize())
  text = restored.mlir_module()
  calls = [l for l in text.splitlines() if f"custom_call @{FWD_TARGET}(" in l]
  assert len(calls) == 1, calls  # one forward; the backward does not recompute it
  for name in FWD_ATTRIBUTE_NAMES:
    assert f"{name} = " in calls[0], (name, calls[0])
  cfg = AttentionConfig(softmax_scale=64 ** -0.5, causal=True, implementation="cute")
  key = KernelVariant.for_call("fwd", "sm90a", "bfloat16", 64, 64, cfg).key
  assert f'variant = "{key}"' in calls[0]
  assert "CustomSPMDPartitioning" not in text


def test_cuda_export_without_disabled_check_names_the_target():
  with pytest.raises(ValueError, match=FWD_TARGET):
    _cuda_export([])


def test_cuda_export_of_a_decoding_step_holds_the_decode_target():
  """A one-token call runs on the decode kernel (jaxflash/few_rows.py): its export names
  DECODE_TARGET, which must be allowed too, and needs no partitioner."""
  q = jax.ShapeDtypeStruct((2, 1, 8, 64), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 300, 2, 64), jnp.bfloat16)
  step = jax.jit(lambda q, k, v: jaxflash.attention(q, k, v, implementation="cute"))
  with pytest.raises(ValueError, match=DECODE_TARGET):
    jax.export.export(step, platforms=("cuda",), disabled_checks=DISABLED_CHECKS)(q, kv, kv)
  exported = jax.export.export(
      step, platforms=("cuda",),
      disabled_checks=DISABLED_CHECKS + [DisabledSafetyCheck.custom_call(DECODE_TARGET)])(
          q, kv, kv)
  text = jax.export.deserialize(exported.serialize()).mlir_module()
  assert f"custom_call @{DECODE_TARGET}(" in text and "CustomSPMDPartitioning" not in text


def test_cuda_export_of_a_kv_cache_decoding_step_with_num_splits():
  """A decoding step over a paged cache (update_kv_cache, then kv_cache_attention on the decode
  kernel) exports for a GPU elsewhere when num_splits is given: the count is then no function
  of this host's devices, and the custom call's partial results carry it. Without num_splits
  the same export names the argument (tests/test_kv_cache.py)."""
  pages, page_size, kv_heads, d = 12, 64, 2, 128
  q = jax.ShapeDtypeStruct((3, 1, 8, d), jnp.bfloat16)
  new_kv = jax.ShapeDtypeStruct((3, 1, kv_heads, d), jnp.bfloat16)
  pool = jax.ShapeDtypeStruct((pages, page_size, kv_heads, d), jnp.bfloat16)
  table = jax.ShapeDtypeStruct((3, 4), jnp.int32)
  lengths = jax.ShapeDtypeStruct((3,), jnp.int32)

  def step(q, new_k, new_v, k_pool, v_pool, page_table, lengths):
    k_pool, v_pool, lengths = jaxflash.update_kv_cache(k_pool, v_pool, new_k, new_v, lengths,
                                                       page_table=page_table)
    out = jaxflash.kv_cache_attention(q, k_pool, v_pool, lengths, page_table=page_table,
                                      num_splits=5, implementation="cute")
    return out, k_pool, v_pool, lengths

  exported = jax.export.export(
      jax.jit(step, donate_argnums=(3, 4)), platforms=("cuda",),
      disabled_checks=[DisabledSafetyCheck.custom_call(DECODE_TARGET)])(
          q, new_kv, new_kv, pool, pool, table, lengths)
  text = jax.export.deserialize(exported.serialize()).mlir_module()
  calls = [l for l in text.splitlines() if f"custom_call @{DECODE_TARGET}(" in l]
  assert len(calls) == 1, calls
  # out_partial (batch, num_splits, kv heads, rows, head_dim_v): the given count, 5.
  assert f"tensor<3x5x{kv_heads}x4x{d}xf32>" in calls[0], calls[0]
  assert exported.out_avals[0].shape == (3, 1, 8, d)


def test_sharded_export_through_shard_map():
  """Multi-device export: attention inside shard_map serializes (docs/export.md)."""
  r = _multidevice.run_worker("tests.test_export")
  assert r["error"] <= 1e-6 and not r["has_partitioner_call"], r


_GPU_CHILD = textwrap.dedent("""
    import sys
    import jax, numpy as np
    import jaxflash.ffi
    jaxflash.ffi.register()  # the one line a deserializing process needs
    exported = jax.export.deserialize(bytearray(open(sys.argv[1], "rb").read()))
    inputs = np.load(sys.argv[2])
    # npz stores bfloat16 as raw 2-byte voids: view them back as the exported input dtypes.
    flat = [inputs[f"a{i}"].view(aval.dtype) for i, aval in enumerate(exported.in_avals)]
    args = jax.tree.unflatten(exported.in_tree, flat)
    flat = jax.tree.leaves(exported.call(*args[0], **args[1]))
    np.savez(sys.argv[3], *[np.asarray(x, np.float32) for x in flat])
    # Which variants Python registered (none: register() loads no library), and which the
    # handler library loaded on its own (at XLA's instantiate stage of each custom call).
    import json, re
    keys = sorted(set(re.findall(r'variant = "([^"]+)"', exported.mlir_module())))
    handler = jaxflash.ffi._load_handler()
    print("LOADED " + json.dumps({
        "keys": keys, "python": sorted(jaxflash.ffi.registered_variants()),
        "handler": [k for k in keys if handler.jaxflash_ffi_is_registered(k.encode())]}))
    """)


@pytest.mark.gpu
def test_cuda_export_runs_in_fresh_process_after_register(tmp_path):
  params, x, target = _params_and_batch(jnp.bfloat16, head_dim=64)
  step = jax.jit(lambda p, x, t: _train_step(p, x, t, implementation="cute"))
  exported = jax.export.export(step, platforms=("cuda",),
                               disabled_checks=DISABLED_CHECKS)(params, x, target)
  assert f"@{FWD_TARGET}(" in exported.mlir_module()
  (tmp_path / "step.jaxexport").write_bytes(exported.serialize())
  flat_in = jax.tree.leaves(((params, x, target), {}))
  np.savez(tmp_path / "in.npz", **{f"a{i}": np.asarray(a) for i, a in enumerate(flat_in)})
  proc = subprocess.run([sys.executable, "-c", _GPU_CHILD, str(tmp_path / "step.jaxexport"),
                         str(tmp_path / "in.npz"), str(tmp_path / "out.npz")], cwd=_ROOT,
                        capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-4000:]
  loaded = json.loads(proc.stdout.split("LOADED ")[-1])
  assert len(loaded["keys"]) == 2, loaded  # the forward and the backward variant
  assert loaded["python"] == [] and loaded["handler"] == loaded["keys"], loaded
  child = np.load(tmp_path / "out.npz")
  here = [np.asarray(a, np.float32) for a in jax.tree.leaves(exported.call(params, x, target))]
  for i, h in enumerate(here):
    np.testing.assert_array_equal(child[f"arr_{i}"], h)


# ---------------------------------------------------------------------------------------------
# Worker (runs under `python -m tests.test_export` with 8 fake devices)

def _worker():
  from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P
  mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"),
              axis_types=(AxisType.Auto,) * 2)
  spec = P("data", None, "model")
  sharding = NamedSharding(mesh, spec)
  attend = lambda q, k, v: jaxflash.attention(q, k, v, causal=True)
  fn = jax.jit(jax.shard_map(attend, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec,
                             check_vma=False))
  rng = np.random.default_rng(5)
  q, k, v = (jax.device_put(jnp.asarray(rng.standard_normal((4, 32, 8, 16)), jnp.float32),
                            sharding) for _ in range(3))
  exported = jax.export.export(fn)(q, k, v)
  restored = jax.export.deserialize(exported.serialize())
  got = restored.call(q, k, v)
  _multidevice.emit({
      "error": float(np.abs(np.asarray(got) - np.asarray(jax.jit(attend)(q, k, v))).max()),
      "has_partitioner_call": "CustomSPMDPartitioning" in exported.mlir_module()})


if __name__ == "__main__":
  _worker()
