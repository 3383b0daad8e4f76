"""Text generation from the example's latest checkpoint, with a KV cache per layer.

  python -m examples.flax_transformer.generate --workdir /tmp/jaxflash-tiny --prompt "ROMEO:"

The prompt fills the caches in one call (prefill), which also gives the first new token; the
further tokens come from one compiled loop (`lax.scan` over the steps, the caches carried and
donated), so decoding pays one dispatch in all rather than one per token.
"""

from __future__ import annotations

import argparse
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh

from examples.flax_transformer import configs, train
from examples.flax_transformer.configs import Config
from examples.flax_transformer.model import (CACHE_KINDS, init_cache, make_cache_attention,
                                             training_kind)


def load(config: Config, workdir, attention: str):
  """(model, params, step): the model of train.make_setup with cache attention of kind
  `attention` (model.CACHE_KINDS), and the parameters of the latest checkpoint train.train
  wrote in workdir, on one device."""
  workdir = pathlib.Path(workdir)
  directory = workdir / "checkpoints"
  manager = train._checkpoint_manager(workdir) if directory.is_dir() else None
  step = manager.latest_step() if manager else None
  if step is None:
    raise FileNotFoundError(
        f"no checkpoint in {directory.absolute()}: train one first, e.g. python -m "
        f"examples.flax_transformer.main --config tiny --workdir {workdir}")
  mesh = Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("data", "tensor"))
  setup = train.make_setup(config, mesh, training_kind(attention))
  state = manager.restore(step, args=ocp.args.StandardRestore(train.abstract_state(setup,
                                                                                   config)))
  model = setup.model.clone(cache_attention=make_cache_attention(attention))
  return model, state["params"], step


def generate(model, params, prompt, num_tokens: int, *, temperature: float = 0.0,
             seed: int = 0, cache_kind: str = "jaxflash", timed_runs: int = 1):
  """Continues prompt (batch, length) int32 by num_tokens >= 1 tokens.

  temperature 0 picks the most likely token (greedy), else samples softmax(logits /
  temperature). cache_kind: the model's cache attention kind (model.CACHE_KINDS), which
  decides the caches' dtype. Returns (tokens (batch, num_tokens) int32, logits (batch,
  num_tokens, vocab) float32 that each token was chosen from, seconds of the num_tokens - 1
  decode steps: their compiled loop timed timed_runs times (each on a copy of the prefilled
  caches, the last on the caches themselves), the median).
  """
  batch, length = prompt.shape
  # The last token is never fed back, so the cache holds all but it.
  cache = init_cache(model.config, batch, length + num_tokens - 1, cache_kind)

  def next_token(params, tokens, cache, key):
    logits, cache = model.apply({"params": params}, tokens, cache=cache)
    logits = logits[:, -1]
    if temperature == 0:
      token = jnp.argmax(logits, axis=-1)
    else:
      token = jax.random.categorical(key, logits / temperature)
    return token.astype(jnp.int32), logits, cache

  def decode(params, token, cache, keys):
    """The tokens after the first: one step per key, in one compiled loop."""
    def step(carry, key):
      token, cache = carry
      token, logits, cache = next_token(params, token[:, None], cache, key)
      return (token, cache), (token, logits)
    (_, cache), (tokens, logits) = jax.lax.scan(step, (token, cache), keys)
    # The caches are returned so that their donated buffers hold the loop's carry (a donated
    # input with no output of its shape would be copied into the loop instead).
    return tokens, logits, cache  # (steps, batch), (steps, batch, vocab), caches

  keys = jax.random.split(jax.random.PRNGKey(seed), num_tokens)
  token, logits, cache = jax.jit(next_token, donate_argnums=2)(
      params, jnp.asarray(prompt, jnp.int32), cache, keys[0])
  loop = jax.jit(decode, donate_argnums=2).lower(params, token, cache, keys[1:]).compile()
  samples = []
  for run in range(timed_runs):
    run_cache = cache if run == timed_runs - 1 else jax.tree.map(jnp.copy, cache)
    jax.block_until_ready((token, run_cache))
    start = time.perf_counter()
    tokens, step_logits, _ = loop(params, token, run_cache, keys[1:])
    jax.block_until_ready(tokens)
    samples.append(time.perf_counter() - start)
  seconds = float(np.median(samples))
  tokens = jnp.concatenate([token[None], tokens]).T
  logits = jnp.concatenate([logits[None], step_logits]).transpose(1, 0, 2)
  return np.asarray(tokens), np.asarray(logits), seconds


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workdir", required=True, help="the training run's work directory")
  parser.add_argument("--config", default="tiny", choices=sorted(configs.CONFIGS))
  parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                      help="config override; the model fields must match the training run's")
  parser.add_argument("--attention", default="jaxflash", choices=CACHE_KINDS,
                      help="the cache attention; jaxflash-fp8: float8_e4m3fn KV caches")
  parser.add_argument("--prompt", default="ROMEO:\n")
  parser.add_argument("--tokens", type=int, default=64, help="new tokens (bytes) per sequence")
  parser.add_argument("--batch", type=int, default=1, help="copies of the prompt decoded at once")
  parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
  parser.add_argument("--seed", type=int, default=0, help="sampling seed")
  args = parser.parse_args(argv)
  prompt = np.frombuffer(args.prompt.encode(), np.uint8).astype(np.int32)
  if not len(prompt) or args.tokens < 1 or args.batch < 1 or args.temperature < 0:
    parser.error("--prompt must be non-empty, --tokens and --batch >= 1, --temperature >= 0")
  if args.attention == "cudnn" and jax.default_backend() != "gpu":
    raise SystemExit(f"--attention cudnn: jax.nn's cuDNN attention needs an NVIDIA GPU; JAX "
                     f"runs on {jax.default_backend()!r} here (use --attention jaxflash or xla)")
  config = configs.apply_overrides(configs.get_config(args.config), args.set)
  try:
    model, params, step = load(config, args.workdir, args.attention)
  except FileNotFoundError as error:
    raise SystemExit(f"generate: {error}") from None
  tokens, _, seconds = generate(model, params, np.tile(prompt, (args.batch, 1)), args.tokens,
                                temperature=args.temperature, seed=args.seed,
                                cache_kind=args.attention)
  for i, row in enumerate(tokens):
    header = f"--- checkpoint step {step}" + (f", sequence {i}" if args.batch > 1 else "")
    print(f"{header} ---\n{args.prompt}{bytes(row.astype(np.uint8)).decode(errors='replace')}")
  steps = args.tokens - 1
  rate = f", {steps * args.batch / seconds:,.0f} tokens/s" if steps else ""
  print(f"decode: {steps} tokens x batch {args.batch} in {seconds:.2f} s{rate} "
        f"(attention={args.attention})")


if __name__ == "__main__":
  main()
