"""Training loop of the example: data x tensor mesh, sharded jit step, orbax resume, metrics.

Writes under the work directory: checkpoints/ (orbax), metrics.json and loss.png.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from examples.flax_transformer.configs import Config
from examples.flax_transformer.model import Transformer, make_attention


# ------------------------------------------------------------------------------- data

def load_corpus(config: Config):
  """The corpus as bytes (tokens 0..255), split into (train, eval) at 1 - eval_fraction."""
  data = np.frombuffer(pathlib.Path(config.corpus).read_bytes(), dtype=np.uint8)
  split = int(len(data) * (1 - config.eval_fraction))
  if min(split, len(data) - split) <= config.seq_len + 1:
    raise ValueError(f"corpus: {len(data)} bytes is too short for seq_len {config.seq_len}")
  return data[:split], data[split:]


def sample_batch(data, config: Config, seed: int) -> dict:
  """Random windows of data: {'inputs', 'targets'} int32 (batch, seq); a pure function of seed."""
  starts = np.random.default_rng(seed).integers(0, len(data) - config.seq_len - 1,
                                                config.batch_size)
  windows = np.stack([data[s:s + config.seq_len + 1] for s in starts]).astype(np.int32)
  return {"inputs": windows[:, :-1], "targets": windows[:, 1:]}


def split_documents(data) -> list:
  """The corpus cut at blank lines: a list of byte arrays, each ending with its newline."""
  breaks = np.flatnonzero((data[:-1] == 10) & (data[1:] == 10))  # the first '\n' of '\n\n'
  starts = np.concatenate([[0], breaks + 2])
  ends = np.concatenate([breaks + 1, [len(data)]])
  return [data[a:b] for a, b in zip(starts, ends) if b > a]


def pack_row(docs, length: int) -> dict:
  """Documents packed into one row of `length` tokens (the last one cut): tokens, segment ids
  (1, 2, ... per document) and positions (restarting at 0 in each document)."""
  tokens, ids, positions = [], [], []
  for i, doc in enumerate(docs):
    tokens.append(doc)
    ids.append(np.full(len(doc), i + 1))
    positions.append(np.arange(len(doc)))
    if sum(map(len, tokens)) >= length:
      break
  else:
    raise ValueError(f"docs: {sum(map(len, tokens))} tokens do not fill a row of {length}")
  cut = lambda parts: np.concatenate(parts)[:length].astype(np.int32)
  return {"tokens": cut(tokens), "segment_ids": cut(ids), "positions": cut(positions)}


def packed_batch(rows) -> dict:
  """Training batch of packed rows (pack_row of seq_len + 1 tokens): inputs, targets, segment
  ids, positions, and weights that drop the targets across a document boundary."""
  tokens, ids, positions = (np.stack([r[key] for r in rows])
                            for key in ("tokens", "segment_ids", "positions"))
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": ids[:, :-1],
          "positions": positions[:, :-1],
          "weights": (ids[:, :-1] == ids[:, 1:]).astype(np.float32)}


def sample_packed_batch(docs, config: Config, seed: int) -> dict:
  """Rows of consecutive documents from random starting documents; a pure function of seed."""
  rng = np.random.default_rng(seed)
  rows = []
  for first in rng.integers(0, len(docs), config.batch_size):
    order = (docs[(first + i) % len(docs)] for i in range(len(docs)))
    rows.append(pack_row(order, config.seq_len + 1))
  return packed_batch(rows)


def batch_sampler(data, config: Config, packing: bool):
  """seed -> batch: random windows of data, or (packing) documents packed with segment ids."""
  if not packing:
    return lambda seed: sample_batch(data, config, seed)
  docs = split_documents(data)
  return lambda seed: sample_packed_batch(docs, config, seed)


# ------------------------------------------------------------------------------- mesh and state

def make_mesh(tensor_parallel: int) -> Mesh:
  """All local devices as a (data, tensor) mesh."""
  devices = jax.devices()
  if tensor_parallel < 1 or len(devices) % tensor_parallel:
    raise ValueError(f"tensor_parallel: must divide the {len(devices)} devices, got "
                     f"{tensor_parallel}")
  grid = np.asarray(devices).reshape(len(devices) // tensor_parallel, tensor_parallel)
  return Mesh(grid, ("data", "tensor"))


def make_optimizer(config: Config):
  decay_steps = config.decay_steps or config.steps
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, config.learning_rate, config.warmup_steps, max(decay_steps, config.warmup_steps + 1),
      end_value=0.1 * config.learning_rate)
  # No weight decay on norms (1-D parameters).
  decay_mask = lambda params: jax.tree.map(lambda p: p.ndim > 1, params)
  return optax.chain(
      optax.clip_by_global_norm(config.grad_clip),
      optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=config.weight_decay, mask=decay_mask))


@dataclasses.dataclass
class Setup:
  """The static pieces of a run: model, optimiser, mesh and the state's shardings."""

  model: Transformer
  optimizer: Any
  mesh: Mesh
  state_shardings: Any  # {'step', 'params', 'opt_state'} of NamedSharding
  batch_sharding: NamedSharding


def make_setup(config: Config, mesh: Mesh, attention: str,
               implementation: Optional[str] = None) -> Setup:
  batch_sharding = NamedSharding(mesh, P("data", None))
  if config.batch_size % mesh.shape["data"]:
    raise ValueError(f"batch_size: {config.batch_size} must be a multiple of the data axis "
                     f"size {mesh.shape['data']}")
  model = Transformer(config, make_attention(attention, implementation),
                      act_sharding=NamedSharding(mesh, P("data", None, None)))
  optimizer = make_optimizer(config)
  tokens = jax.ShapeDtypeStruct((config.batch_size, config.seq_len), jnp.int32)
  boxed = jax.eval_shape(model.init, jax.random.PRNGKey(0), tokens)["params"]
  param_shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec),
                                 nn.get_partition_spec(boxed))
  replicated = NamedSharding(mesh, P())
  opt_shapes = jax.eval_shape(optimizer.init, nn.unbox(boxed))
  opt_shardings = optax.tree_map_params(
      optimizer, lambda _, sharding: sharding, opt_shapes, param_shardings,
      transform_non_params=lambda _: replicated)
  state_shardings = {"step": replicated, "params": param_shardings, "opt_state": opt_shardings}
  return Setup(model, optimizer, mesh, state_shardings, batch_sharding)


def init_state(setup: Setup, config: Config):
  """Fresh parameters and optimiser state, created directly in their shardings."""
  tokens = jnp.zeros((config.batch_size, config.seq_len), jnp.int32)

  def init(rng):
    params = nn.unbox(setup.model.init(rng, tokens)["params"])
    return {"step": jnp.zeros((), jnp.int32), "params": params,
            "opt_state": setup.optimizer.init(params)}

  return jax.jit(init, out_shardings=setup.state_shardings)(jax.random.PRNGKey(config.seed))


def abstract_state(setup: Setup, config: Config):
  """Shapes, dtypes and shardings of the state: the target orbax restores into."""
  shapes = jax.eval_shape(lambda: init_state(setup, config))
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                      shapes, setup.state_shardings)


def param_checksum(params) -> float:
  """Sum of squares of all parameters in float64: equal before save and after restore."""
  return float(sum(np.sum(np.square(np.asarray(x, np.float64)))
                   for x in jax.tree.leaves(jax.device_get(params))))


# ------------------------------------------------------------------------------- steps

def make_steps(setup: Setup):
  """jit-compiled (train_step, eval_step) with explicit in/out shardings."""
  model, optimizer = setup.model, setup.optimizer
  replicated = NamedSharding(setup.mesh, P())

  def loss_fn(params, batch):
    losses = token_losses(model, params, batch)
    if "weights" not in batch:
      return losses.mean()
    return jnp.sum(losses * batch["weights"]) / jnp.maximum(jnp.sum(batch["weights"]), 1.0)

  def train_step(state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch)
    updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    return {"step": state["step"] + 1, "params": params, "opt_state": opt_state}, loss

  # The batch sharding is a prefix: it applies to every array of the batch dictionary.
  train = jax.jit(train_step, in_shardings=(setup.state_shardings, setup.batch_sharding),
                  out_shardings=(setup.state_shardings, replicated), donate_argnums=0)
  evaluate = jax.jit(loss_fn, in_shardings=(setup.state_shardings["params"],
                                            setup.batch_sharding), out_shardings=replicated)
  return train, evaluate


def token_losses(model, params, batch):
  """Cross-entropy of every target (batch, seq); packed batches pass segment ids and positions
  to the attention, so no token sees another document."""
  logits = model.apply({"params": params}, batch["inputs"], segment_ids=batch.get("segment_ids"),
                       positions=batch.get("positions"))
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])


# ------------------------------------------------------------------------------- the run

def _checkpoint_manager(workdir: pathlib.Path):
  # Synchronous saves: the next train step donates the state's buffers.
  options = ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=False)
  return ocp.CheckpointManager((workdir / "checkpoints").absolute(), options=options)


def _load_history(workdir: pathlib.Path, start_step: int):
  """Loss history of earlier runs in workdir, up to the step we resume from."""
  path = workdir / "metrics.json"
  if not start_step or not path.exists():
    return [], []
  old = json.loads(path.read_text())
  return ([r for r in old["train"] if r[0] <= start_step],
          [r for r in old["eval"] if r[0] <= start_step])


def _evaluate(evaluate, params, sample_eval, setup: Setup, config: Config) -> float:
  losses = []
  for i in range(config.eval_batches):  # the same held-out batches at every evaluation
    losses.append(evaluate(params, _put(setup, sample_eval(10**9 + i))))
  return float(np.mean(jax.device_get(losses)))


def _put(setup: Setup, batch: dict) -> dict:
  return jax.device_put(batch, setup.batch_sharding)


def train(config: Config, workdir, *, attention: str = "jaxflash", tensor_parallel: int = 1,
          implementation: Optional[str] = None, packing: bool = False,
          progress: bool = True) -> dict:
  """Trains (or resumes) to config.steps; returns and writes the metrics dictionary.

  packing: rows of whole documents (the corpus cut at blank lines) with segment ids, instead
  of random windows; needs attention='jaxflash'."""
  if packing and attention != "jaxflash":
    raise ValueError(f"packing: needs attention='jaxflash' (segment ids), got {attention!r}")
  workdir = pathlib.Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  train_data, eval_data = load_corpus(config)
  sample_train = batch_sampler(train_data, config, packing)
  sample_eval = batch_sampler(eval_data, config, packing)
  mesh = make_mesh(tensor_parallel)
  setup = make_setup(config, mesh, attention, implementation)
  train_step, evaluate = make_steps(setup)
  manager = _checkpoint_manager(workdir)
  start = manager.latest_step() or 0
  restored_checksum = None
  if start:
    state = manager.restore(start, args=ocp.args.StandardRestore(abstract_state(setup, config)))
    restored_checksum = param_checksum(state["params"])
  else:
    state = init_state(setup, config)
  history, evals = _load_history(workdir, start)
  timed_tokens, timed_seconds = 0, 0.0
  steps = range(start, config.steps)
  bar = _progress(steps, progress, start, config.steps)
  for step in bar:
    batch = _put(setup, sample_train(config.seed * 10**6 + step))
    t0 = time.perf_counter()
    state, loss = train_step(state, batch)
    loss = float(loss)  # waits for the step
    if step - start >= 2:  # the first steps include compilation
      timed_seconds += time.perf_counter() - t0
      timed_tokens += config.batch_size * config.seq_len
    history.append((step + 1, loss))
    tokens_per_s = timed_tokens / timed_seconds if timed_seconds else 0.0
    if hasattr(bar, "set_postfix"):
      bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_s:,.0f}")
    if (step + 1) % config.eval_every == 0 or step + 1 == config.steps:
      evals.append((step + 1, _evaluate(evaluate, state["params"], sample_eval, setup, config)))
    if (step + 1) % config.checkpoint_every == 0 or step + 1 == config.steps:
      manager.save(step + 1, args=ocp.args.StandardSave(state), force=True)
  manager.wait_until_finished()
  metrics = {
      "config": dataclasses.asdict(config), "attention": attention,
      "implementation": implementation, "packing": packing,
      "devices": [str(d) for d in jax.devices()], "mesh": dict(mesh.shape), "start_step": start, "final_step": int(state["step"]),
      "train": history, "eval": evals,
      "tokens_per_s": timed_tokens / timed_seconds if timed_seconds else None,
      "param_checksum": param_checksum(state["params"]),
      "restored_checksum": restored_checksum,
  }
  (workdir / "metrics.json").write_text(json.dumps(metrics, indent=1))
  plot_losses(metrics, workdir / "loss.png")
  return metrics


def _progress(steps, enabled: bool, start: int, total: int):
  if not enabled:
    return steps
  from tqdm import tqdm  # only the interactive path needs it
  return tqdm(steps, initial=start, total=total, unit="step", dynamic_ncols=True)


def plot_losses(metrics: dict, path) -> None:
  """Train and eval loss against step, with tokens/s in the title."""
  import matplotlib
  matplotlib.use("Agg")  # headless
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(7, 4))
  if metrics["train"]:
    ax.plot(*zip(*metrics["train"]), label="train", lw=1)
  if metrics["eval"]:
    ax.plot(*zip(*metrics["eval"]), "o-", label="eval")
  rate = metrics["tokens_per_s"]
  ax.set(xlabel="step", ylabel="loss (nats/byte)",
         title=f"{metrics['attention']}: {rate:,.0f} tokens/s" if rate else metrics["attention"])
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
