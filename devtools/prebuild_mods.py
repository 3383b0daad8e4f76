"""Builds the score_mod / mask_mod variants that tests/test_gpu_mods.py and
`benchmarks/bench_modifiers.py --mods` run into a kernel cache, so that a GPU host runs them
without nvidia-cutlass-dsl or a first-use build.

Mods variants are never shipped (config.py declares none): each is keyed by the digest of its
functions' IR, which is found here the way jaxflash.attention finds it (mod_ir.trace_mods, then
KernelVariant.for_call). This tree comes first on sys.path, ahead of an installed jaxflash:
`python devtools/prebuild_mods.py --cache-dir .kcache [--jobs 1] [--list]`; then on the GPU
host `JAXFLASH_CACHE_DIR=.kcache python -m pytest -m gpu tests/test_gpu_mods.py`.
"""

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this tree's jaxflash and tests, before any installed copy
sys.path.insert(1, str(ROOT / "benchmarks"))

import jax.numpy as jnp  # noqa: E402

from jaxflash import build, config, mod_ir  # noqa: E402


def bench_variants() -> list:
  """The mods variants of bench_modifiers.py --mods (bf16, BIAS_SHAPE's head_dim, forward and
  backward): the identity, ALiBi and T5 score_mods and the causal and window mask_mods."""
  import bench_modifiers as bench  # imports bench_attention (devtools/ on its path)
  h, d = bench.BIAS_SHAPE["heads"], bench.BIAS_SHAPE["head_dim"]
  slopes = jnp.zeros((h,), jnp.float32)
  table = jnp.zeros((bench.T5_BUCKETS, h), jnp.float32)
  window = bench.MODS_WINDOW
  functions = {
      "identity": (lambda s, b, h, i, j: s, None),
      "alibi": (lambda s, b, h, i, j: s + slopes[h] * (j - i).astype(jnp.float32), None),
      "t5": (lambda s, b, h, i, j: s + table[bench.t5_bucket(j - i), h], None),
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
  parser.add_argument("--cache-dir", type=Path, required=True)
  parser.add_argument("--jobs", type=int, default=1)
  parser.add_argument("--list", action="store_true", help="print the keys and their state only")
  args = parser.parse_args()
  from tests import test_gpu_mods
  variants = {v.key: v for v in test_gpu_mods.kernel_variants() + bench_variants()}
  if args.list:
    for key, v in variants.items():
      print(f"{key}  {build.variant_state(v, args.cache_dir.resolve())}")
    return 0
  build.build(list(variants.values()), args.cache_dir.resolve(), jobs=args.jobs)
  return 0


if __name__ == "__main__":
  sys.exit(main())
