"""Generation throughput of the example's model: tokens/s of the compiled decoding loop per
cache attention kind and batch, one run.

examples/flax_transformer/generate.py's `generate`: the prompt fills the caches in one call,
then the further tokens come from one compiled loop (`lax.scan` over the steps, the caches
carried and donated). Columns are the cache kinds (jaxflash: kv_cache_attention on the
decode kernel; jaxflash-fp8: the same over float8_e4m3fn page pools; cudnn / xla:
jax.nn.dot_product_attention with key_value_seq_lengths), rows the batch sizes. The model is
--config (small: 6 layers, head_dim 128, 6 / 2 heads) with random parameters (the speed does
not depend on them), the prompt --prompt random bytes, --tokens new tokens, greedy. A cell is
the median of --runs timed runs of the loop after its compile (generate's timed_runs):
tokens/s = batch * (tokens - 1) / seconds. Results go to OUT/bench_generate.json and a
markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import flax.linen as nn
import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's examples
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling bench_attention.py
import bench_attention  # noqa: E402
from examples.flax_transformer import configs, generate, model  # noqa: E402


def make_model(config_name: str, kind: str, prompt_len: int, seed: int = 0):
  """(model, params) of the config with cache attention `kind` and random parameters."""
  config = configs.get_config(config_name)
  transformer = model.Transformer(config, model.make_attention(model.training_kind(kind)),
                                  cache_attention=model.make_cache_attention(kind))
  tokens = np.zeros((1, prompt_len), np.int32)
  params = nn.unbox(jax.jit(transformer.init)(jax.random.PRNGKey(seed), tokens)["params"])
  return transformer, params


def run(config_name: str, kinds, batches, prompt_len: int, num_tokens: int,
        runs: int) -> list[dict]:
  records = []
  for kind in kinds:
    try:
      transformer, params = make_model(config_name, kind, prompt_len)
    except Exception as e:  # noqa: BLE001  (a kind this host cannot run is reported)
      records += [{"kind": kind, "batch": b, "error": f"{type(e).__name__}: {e}"[:300]}
                  for b in batches]
      continue
    for batch in batches:
      # The same prompt for every kind.
      prompt = np.random.default_rng(batch).integers(0, 256, (batch, prompt_len)).astype(
          np.int32)
      try:
        tokens, _, seconds = generate.generate(transformer, params, prompt, num_tokens,
                                               cache_kind=kind, timed_runs=runs)
        records.append({"kind": kind, "batch": batch, "seconds": seconds,
                        "tokens_per_s": batch * (num_tokens - 1) / seconds,
                        "first_tokens": tokens[0, :8].tolist()})
      except Exception as e:  # noqa: BLE001
        records.append({"kind": kind, "batch": batch, "error": f"{type(e).__name__}: {e}"[:300]})
  return records


def markdown(records, kinds, batches) -> str:
  lines = ["| batch | " + " | ".join(kinds) + " |", "|---" * (len(kinds) + 1) + "|"]
  for batch in batches:
    cells = []
    for kind in kinds:
      r = next((r for r in records if r["kind"] == kind and r["batch"] == batch), None)
      cells.append("" if r is None else "error" if "error" in r
                   else f"{r['tokens_per_s']:,.0f} tok/s ({1e3 * r['seconds']:.1f} ms)")
    lines.append(f"| {batch} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--config", default="small", choices=sorted(configs.CONFIGS))
  p.add_argument("--kinds", nargs="+", default=list(model.CACHE_KINDS),
                 choices=model.CACHE_KINDS)
  p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 64])
  p.add_argument("--prompt", type=int, default=512, help="prompt bytes")
  p.add_argument("--tokens", type=int, default=256, help="new tokens per sequence")
  p.add_argument("--runs", type=int, default=3, help="timed runs of each loop (median)")
  bench_attention.add_run_arguments(p)
  args = p.parse_args(argv)
  if args.prompt < 1 or args.tokens < 2 or args.runs < 1 or min(args.batches) < 1:
    p.error("--prompt, --runs and --batches take integers >= 1, --tokens >= 2")
  bench_attention.spin_up(args.spin_up)
  records = run(args.config, args.kinds, args.batches, args.prompt, args.tokens, args.runs)
  args.out.mkdir(parents=True, exist_ok=True)
  (args.out / "bench_generate.json").write_text(json.dumps(records, indent=1))
  print(markdown(records, args.kinds, args.batches))
  return 0


if __name__ == "__main__":
  sys.exit(main())
