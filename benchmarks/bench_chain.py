"""Per-call cost of small attention calls chained in one jit: jaxflash vs cuDNN vs XLA, one run.

A training step of a small model runs many short attention calls; when each costs more to issue
than to compute, the step is bound by dispatch. This times CHAIN calls in one jitted program,
each call's output the next call's query (batch 1, seq 256, 8 heads, head_dim 128, bf16,
causal), and reports microseconds per call: the jitted program's median time (warm-up,
back-to-back runs blocked on the last, bench_attention.time_ms) over CHAIN. XLA records
command-buffer-compatible custom calls, cuDNN calls and fusions into CUDA graphs, so this is
where a handler that cannot be recorded shows. `--xla-flags` adds XLA flags for one run (e.g.
--xla_gpu_enable_command_buffer= to compare without command buffers). Table + JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

SHAPE = dict(batch=1, seq=256, heads=8, head_dim=128)
CHAIN = 24
IMPLS = ("jaxflash", "cudnn", "xla")


def attend_fn(impl: str, implementation: str = "cute"):
  """attend(q, k, v) -> out for one implementation (jaxflash's `implementation` for CPU tests)."""
  import jax
  import jaxflash
  if impl == "jaxflash":
    return lambda q, k, v: jaxflash.attention(q, k, v, causal=True,
                                              implementation=implementation)
  return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                      implementation=impl)


def chain_fn(attend, chain: int):
  """One program of `chain` dependent calls: each output is the next query."""
  def run(q, k, v):
    for _ in range(chain):
      q = attend(q, k, v)
    return q
  return run


def inputs(dtype, seed: int = 0):
  import jax
  import jax.numpy as jnp
  keys = jax.random.split(jax.random.PRNGKey(seed), 3)
  shape = (SHAPE["batch"], SHAPE["seq"], SHAPE["heads"], SHAPE["head_dim"])
  return tuple(jax.random.normal(key, shape, jnp.float32).astype(dtype) for key in keys)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
  p.add_argument("--chain", type=int, default=CHAIN)
  p.add_argument("--xla-flags", default="", help="appended to XLA_FLAGS for this run")
  sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling bench_attention.py
  import bench_attention
  bench_attention.add_run_arguments(p)
  args = p.parse_args(argv)
  if args.chain < 1:
    p.error(f"--chain must be >= 1, got {args.chain}")
  if args.xla_flags:  # before jax initializes its backend
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {args.xla_flags}".strip()
  import jax
  import jax.numpy as jnp

  if jax.default_backend() != "gpu":
    print("bench_chain needs a GPU", file=sys.stderr)
    return 2
  args.out.mkdir(parents=True, exist_ok=True)
  bench_attention.spin_up(args.spin_up)
  q, k, v = inputs(jnp.bfloat16)
  rows = []
  for impl in args.impls:
    run = jax.jit(chain_fn(attend_fn(impl), args.chain))
    try:
      ms = bench_attention.time_ms(run, q, k, v)
    except Exception as error:  # an implementation this host cannot run: say so, keep going
      print(f"{impl}: {bench_attention.failure_note(error)}", file=sys.stderr)
      continue
    rows.append(dict(impl=impl, chain=args.chain, us_per_call=ms * 1e3 / args.chain,
                     xla_flags=os.environ.get("XLA_FLAGS", ""), **SHAPE))
  lines = [f"{args.chain} chained causal calls in one jit, batch {SHAPE['batch']}, seq "
           f"{SHAPE['seq']}, {SHAPE['heads']} heads, head_dim {SHAPE['head_dim']}, bf16",
           "", "| implementation | us per call |", "|---|---|"]
  lines += [f"| {r['impl']} | {r['us_per_call']:.1f} |" for r in rows]
  print("\n".join(lines))
  (args.out / "bench_chain.json").write_text(json.dumps(rows, indent=1))
  return 0 if len(rows) == len(args.impls) else 1


if __name__ == "__main__":
  sys.exit(main())
