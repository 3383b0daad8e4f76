"""Builds the score_mod / mask_mod variants that tests/test_gpu_mods.py and
`benchmarks/bench_modifiers.py --mods` run into a kernel cache, so that a GPU host runs them
without nvidia-cutlass-dsl or a first-use build.

Mods variants are never shipped (config.py declares none): each is keyed by the digest of its
functions' IR, which is found here the way jaxflash.attention finds it (mod_ir.trace_mods, then
KernelVariant.for_call). This tree comes first on sys.path, ahead of an installed jaxflash:
`python devtools/prebuild_mods.py --cache-dir .kcache [--jobs 1] [--list]`; then on the GPU
host `JAXFLASH_CACHE_DIR=.kcache python -m pytest -m gpu tests/test_gpu_mods.py`.

The digest covers the derivative's IR, which is JAX's differentiation of score_mod and may
differ between JAX versions (0.11 differentiates tanh into `one_minus_square`, 0.10 into
arithmetic): where the GPU host's JAX is not this host's, trace there or under the same
version (`--write-specs DIR`: one JSON spec per variant, no build, nvidia-cutlass-dsl not
needed) and build those specs here (`--from-specs DIR --cache-dir .kcache`).
"""

import argparse
import dataclasses
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this tree's jaxflash and tests, before any installed copy
sys.path.insert(1, str(ROOT / "benchmarks"))

import jax.numpy as jnp  # noqa: E402

from jaxflash import build, config, mod_ir  # noqa: E402


def bench_variants() -> list:
  """The mods variants of bench_modifiers.py --mods (bf16, BIAS_SHAPE's head_dim, forward and
  backward): the identity, ALiBi, T5 (the bucket's log per score, and a table by distance)
  score_mods and the causal and window mask_mods."""
  import bench_modifiers as bench  # imports bench_attention (devtools/ on its path)
  h, d = bench.BIAS_SHAPE["heads"], bench.BIAS_SHAPE["head_dim"]
  slopes = jnp.zeros((h,), jnp.float32)
  table = jnp.zeros((bench.T5_BUCKETS, h), jnp.float32)
  window = bench.MODS_WINDOW
  m = bench.T5_MAX_DISTANCE
  distance = bench.t5_distance_table(table)
  functions = {
      "identity": (lambda s, b, h, i, j: s, None),
      "alibi": (lambda s, b, h, i, j: s + slopes[h] * (j - i).astype(jnp.float32), None),
      "t5": (lambda s, b, h, i, j: s + table[bench.t5_bucket(j - i), h], None),
      "t5 by distance": (lambda s, b, h, i, j: s + distance[h, jnp.clip(j - i, -m, m) + m],
                         None),
      "causal mask_mod": (None, lambda b, h, i, j: j <= i),
      "window mask_mod": (None, lambda b, h, i, j: (j <= i) & (i - j <= window)),
  }
  found = []
  for score_mod, mask_mod in functions.values():
    spec = mod_ir.trace_mods(score_mod, mask_mod).spec
    cfg = config.AttentionConfig(softmax_scale=d ** -0.5, mods=spec.canonical())
    for direction in ("fwd", "bwd"):
      if config.kernel_support(direction, "bfloat16", d, d, cfg)[0]:
        found.append(config.KernelVariant.for_call(direction, "sm90a", "bfloat16", d, d, cfg,
                                                   None))
  return found


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--cache-dir", type=Path,
                      help="the kernel cache to build into or list (not with --write-specs)")
  parser.add_argument("--jobs", type=int, default=1)
  parser.add_argument("--list", action="store_true", help="print the keys and their state only")
  parser.add_argument("--write-specs", type=Path, metavar="DIR",
                      help="write each variant's spec to DIR/<key>.json and build nothing")
  parser.add_argument("--from-specs", type=Path, metavar="DIR",
                      help="the variants of the specs in DIR (written by --write-specs under "
                           "another JAX) instead of tracing here")
  args = parser.parse_args()
  if args.cache_dir is None and not args.write_specs:
    parser.error("--cache-dir is required unless --write-specs is given")
  if args.from_specs:
    files = sorted(args.from_specs.glob("*.json"))
    if not files:
      raise SystemExit(f"--from-specs {args.from_specs}: no *.json spec in it")
    variants = {}
    for f in files:
      try:
        v = config.variant_from_spec(json.loads(f.read_text()))
      except ValueError as e:
        raise SystemExit(f"--from-specs {f}: {e}") from e
      variants[v.key] = v
  else:
    from tests import test_gpu_mods
    variants = {v.key: v for v in test_gpu_mods.kernel_variants() + bench_variants()}
  if args.write_specs:
    args.write_specs.mkdir(parents=True, exist_ok=True)
    for key, v in variants.items():
      (args.write_specs / f"{key}.json").write_text(json.dumps(dataclasses.asdict(v)))
    print(f"wrote {len(variants)} spec(s) to {args.write_specs}")
    return 0
  if args.list:
    for key, v in variants.items():
      print(f"{key}  {build.variant_state(v, args.cache_dir.resolve())}")
    return 0
  build.build(list(variants.values()), args.cache_dir.resolve(), jobs=args.jobs)
  return 0


if __name__ == "__main__":
  sys.exit(main())
