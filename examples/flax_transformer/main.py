"""Command line of the example, intentionally short: parse flags, call train.train.

  python -m examples.flax_transformer.main --config tiny --workdir /tmp/jaxflash-tiny
"""

from __future__ import annotations

import argparse
import logging

from examples.flax_transformer import configs, train
from examples.flax_transformer.model import ATTENTION_KINDS


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="tiny", choices=sorted(configs.CONFIGS))
  parser.add_argument("--workdir", required=True, help="checkpoints and metrics; resumes")
  parser.add_argument("--attention", default="jaxflash", choices=ATTENTION_KINDS)
  parser.add_argument("--implementation", default=None, choices=("cute", "reference"),
                      help="force a jaxflash implementation (default: auto)")
  parser.add_argument("--tensor_parallel", type=int, default=1)
  parser.add_argument("--packing", action="store_true",
                      help="train on whole documents packed into rows with segment ids")
  parser.add_argument("--steps", type=int, default=None, help="total steps (overrides config)")
  parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                      help="override a config field; repeatable")
  parser.add_argument("--no_progress", action="store_true")
  args = parser.parse_args(argv)
  logging.basicConfig(format="%(name)s: %(message)s")
  logging.getLogger("jaxflash").setLevel(logging.INFO)  # says when jaxflash uses no kernel
  config = configs.apply_overrides(configs.get_config(args.config), args.set)
  if args.steps is not None:
    config = config.replace(steps=args.steps)
  metrics = train.train(config, args.workdir, attention=args.attention,
                        tensor_parallel=args.tensor_parallel,
                        implementation=args.implementation, packing=args.packing,
                        progress=not args.no_progress)
  last_eval = metrics["eval"][-1][1] if metrics["eval"] else float("nan")
  rate = metrics["tokens_per_s"] or 0.0
  print(f"done: step {metrics['final_step']}, eval loss {last_eval:.4f}, "
        f"{rate:,.0f} tokens/s ({args.attention}); metrics in {args.workdir}/metrics.json")


if __name__ == "__main__":
  main()
