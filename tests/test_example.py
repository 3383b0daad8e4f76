"""Smoke test of examples/flax_transformer: the tiny config trains, checkpoints and resumes.

The runs are subprocesses so that they get 4 fake CPU devices (a 2 x 2 data x tensor mesh).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("flax")
pytest.importorskip("optax")
pytest.importorskip("orbax.checkpoint")

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Small enough for 2 CPU cores; warmup 4 so the loss falls within a dozen steps.
OVERRIDES = ["seq_len=64", "batch_size=8", "checkpoint_every=6", "eval_every=6",
             "eval_batches=1", "warmup_steps=4", "decay_steps=16"]


def _run(workdir, steps, attention="jaxflash"):
  cmd = [sys.executable, "-m", "examples.flax_transformer.main", "--config", "tiny",
         "--workdir", str(workdir), "--steps", str(steps), "--attention", attention,
         "--tensor_parallel", "2", "--no_progress"]
  for item in OVERRIDES:
    cmd += ["--set", item]
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=4")
  proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
  return json.loads((pathlib.Path(workdir) / "metrics.json").read_text())


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("resume")
  return workdir, _run(workdir, 12)


def test_trains_on_a_data_tensor_mesh(first_run):
  workdir, metrics = first_run
  assert metrics["mesh"] == {"data": 2, "tensor": 2}
  assert metrics["final_step"] == 12 and [s for s, _ in metrics["train"]] == list(range(1, 13))
  losses = np.array([loss for _, loss in metrics["train"]])
  assert np.isfinite(losses).all()
  assert losses[-3:].mean() < losses[0] - 1.0, losses  # bytes: ln 256 = 5.5 nats at the start
  assert [s for s, _ in metrics["eval"]] == [6, 12]
  assert metrics["tokens_per_s"] > 0
  assert (workdir / "loss.png").stat().st_size > 0
  assert sorted(p.name for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()) == [
      "12", "6"]


def test_resume_restores_step_and_params(first_run, tmp_path):
  workdir, first = first_run
  resumed = _run(workdir, 16)
  assert resumed["start_step"] == 12 and resumed["final_step"] == 16
  assert resumed["restored_checksum"] == first["param_checksum"]
  assert resumed["train"][:12] == first["train"]
  # Resuming is exact: the same losses as one uninterrupted run of 16 steps.
  straight = _run(tmp_path / "straight", 16)
  np.testing.assert_allclose([l for _, l in resumed["train"]],
                             [l for _, l in straight["train"]], rtol=1e-5)


def _loss_and_grads(config, kind, inputs, targets):
  """Cross-entropy and its parameter gradients of a fresh model with `kind` attention."""
  import jax
  from examples.flax_transformer import train
  setup = train.make_setup(config, train.make_mesh(1), kind)
  params = train.init_state(setup, config)["params"]

  def loss(params):
    logits = setup.model.apply({"params": params}, inputs)
    log_probs = jax.nn.log_softmax(logits)
    return -jax.numpy.take_along_axis(log_probs, targets[..., None], axis=-1).mean()

  return jax.jit(jax.value_and_grad(loss))(params)


def test_jaxflash_and_xla_attention_give_the_same_loss_and_gradients():
  import jax
  from examples.flax_transformer import configs, train
  config = configs.apply_overrides(configs.get_config("tiny"), OVERRIDES)
  inputs, targets = train.sample_batch(train.load_corpus(config)[0], config, seed=0)
  loss_a, grads_a = _loss_and_grads(config, "jaxflash", inputs, targets)
  loss_b, grads_b = _loss_and_grads(config, "xla", inputs, targets)
  np.testing.assert_allclose(loss_a, loss_b, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_b)):
    np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5)
