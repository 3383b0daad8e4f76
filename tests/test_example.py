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


def _run(workdir, steps, attention="jaxflash", extra=()):
  cmd = [sys.executable, "-m", "examples.flax_transformer.main", "--config", "tiny",
         "--workdir", str(workdir), "--steps", str(steps), "--attention", attention,
         "--tensor_parallel", "2", "--no_progress", *extra]
  for item in OVERRIDES:
    cmd += ["--set", item]
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=os.environ.get("XLA_FLAGS", "") +
             " --xla_force_host_platform_device_count=4")
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


def _model_and_params(config, kind="jaxflash"):
  from examples.flax_transformer import train
  setup = train.make_setup(config, train.make_mesh(1), kind)
  return setup.model, train.init_state(setup, config)["params"]


def _loss_and_grads(config, kind, batch):
  """Cross-entropy and its parameter gradients of a fresh model with `kind` attention."""
  import jax
  from examples.flax_transformer import train
  model, params = _model_and_params(config, kind)
  loss = lambda params: train.token_losses(model, params, batch).mean()
  return jax.jit(jax.value_and_grad(loss))(params)


def _tiny_config():
  from examples.flax_transformer import configs
  return configs.apply_overrides(configs.get_config("tiny"), OVERRIDES)


def test_jaxflash_and_xla_attention_give_the_same_loss_and_gradients():
  import jax
  from examples.flax_transformer import train
  config = _tiny_config()
  batch = train.sample_batch(train.load_corpus(config)[0], config, seed=0)
  loss_a, grads_a = _loss_and_grads(config, "jaxflash", batch)
  loss_b, grads_b = _loss_and_grads(config, "xla", batch)
  np.testing.assert_allclose(loss_a, loss_b, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_b)):
    np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5)


# ------------------------------------------------------------------------------- --packing

def test_documents_split_at_blank_lines_and_pack_with_ids_positions_and_weights():
  from examples.flax_transformer import train
  data = np.frombuffer(b"ab\n\ncde\n\n\nf\n", np.uint8)
  docs = train.split_documents(data)
  assert [bytes(d) for d in docs] == [b"ab\n", b"cde\n", b"f\n"]
  row = train.pack_row(docs, 8)
  assert bytes(row["tokens"].astype(np.uint8)) == b"ab\ncde\nf"
  assert row["segment_ids"].tolist() == [1, 1, 1, 2, 2, 2, 2, 3]
  assert row["positions"].tolist() == [0, 1, 2, 0, 1, 2, 3, 0]
  batch = train.packed_batch([row])
  # Inputs predict the next token of their own document only: no weight across a boundary.
  assert batch["inputs"].shape == batch["weights"].shape == (1, 7)
  assert batch["weights"][0].tolist() == [1, 1, 0, 1, 1, 1, 0]
  with pytest.raises(ValueError, match="docs: 9 tokens do not fill a row of 10"):
    train.pack_row(docs, 10)


def test_a_packed_documents_loss_does_not_depend_on_its_neighbours():
  """The same document after different neighbours (so at other offsets in the row) gets the
  same per-token losses; without segment ids and positions it does not (the check can fail)."""
  from examples.flax_transformer import train
  config = _tiny_config()
  docs = [d for d in train.split_documents(train.load_corpus(config)[0]) if 8 <= len(d) <= 24]
  target, before_a, after = docs[0], docs[1], docs[4:40]
  before_b = np.concatenate([docs[2], docs[3]])  # one longer document
  assert len(before_a) != len(before_b) and len(before_b) + len(target) <= config.seq_len
  length = config.seq_len + 1
  batch = train.packed_batch([train.pack_row([before_a, target, *after], length),
                              train.pack_row([before_b, target, *after], length)])
  model, params = _model_and_params(config)
  losses = np.asarray(train.token_losses(model, params, batch))
  spans = [slice(len(before), len(before) + len(target) - 1) for before in (before_a, before_b)]
  np.testing.assert_allclose(losses[0, spans[0]], losses[1, spans[1]], rtol=1e-5, atol=1e-6)
  plain = {k: batch[k] for k in ("inputs", "targets")}
  leaky = np.asarray(train.token_losses(model, params, plain))
  assert np.abs(leaky[0, spans[0]] - leaky[1, spans[1]]).max() > 1e-3


def test_packing_trains_from_the_command_line(tmp_path):
  metrics = _run(tmp_path, 4, extra=["--packing"])
  assert metrics["packing"] and metrics["final_step"] == 4
  assert np.isfinite([loss for _, loss in metrics["train"]]).all()


def test_packing_needs_jaxflash_attention(tmp_path):
  from examples.flax_transformer import train
  with pytest.raises(ValueError, match="packing: needs attention='jaxflash'"):
    train.train(_tiny_config(), tmp_path, attention="xla", packing=True)
