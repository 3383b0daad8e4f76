"""Runs the 16-bit forward kernels on fixed inputs and saves out and lse, or compares two saves.

For kernel changes that must not change a result (an instruction reordering, an exact
reduction in another order): run it with the kernels before and after (two kernel wheels or
caches, one process each), then compare; every array must be bitwise equal.

  python devtools/kernel_selftest/bitwise_outputs.py --save before.npz   # GPU host
  python devtools/kernel_selftest/bitwise_outputs.py --compare before.npz after.npz

The cases reach every 16-bit forward variant of one dtype: each (head_dim, head_dim_v) pair,
dense, causal (seq_q != seq_k) and masked (segment ids with a window, and softcap), at lengths
that straddle the tiles, GQA 2:1, with a NaN in one query row.
"""

import argparse
import sys

import numpy as np


def cases():
  """(name, head_dim, head_dim_v, seq_q, seq_k, kwargs) for every forward variant kind."""
  from jaxflash import config
  pairs = config.KERNEL_HEAD_DIM_PAIRS["fwd"]
  for d, dv in pairs:
    yield f"d{d}-dv{dv}-dense", d, dv, 1000, 1000, {}
    yield f"d{d}-dv{dv}-causal", d, dv, 700, 1000, {"causal": True}
    yield f"d{d}-dv{dv}-segments-window", d, dv, 1000, 1000, {"segments": True,
                                                              "window_size": (300, 0)}
    yield f"d{d}-dv{dv}-softcap", d, dv, 1000, 1000, {"softcap": 20.0}


def save(path: str, dtype: str):
  import jax
  import jax.numpy as jnp

  import jaxflash
  results = {}
  for name, d, dv, seq_q, seq_k, kwargs in cases():
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(d * 1000 + dv), 3)
    q = jax.random.normal(kq, (2, seq_q, 4, d), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (2, seq_k, 2, d), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (2, seq_k, 2, dv), jnp.float32).astype(dtype)
    q = q.at[1, 5, 3, 0].set(jnp.nan)
    kwargs = dict(kwargs)
    if kwargs.pop("segments", False):
      ids = (jnp.arange(seq_k)[None, :] >= jnp.array([[400], [650]])).astype(jnp.int32)
      kwargs.update(q_segment_ids=ids[:, :seq_q], kv_segment_ids=ids)
    out, lse = jaxflash.attention(q, k, v, return_lse=True, implementation="cute", **kwargs)
    results[f"{name}-out"] = np.asarray(out.astype(jnp.float32))
    results[f"{name}-lse"] = np.asarray(lse)
    print(name, flush=True)
  np.savez(path, **results)


def compare(a_path: str, b_path: str) -> int:
  a, b = np.load(a_path), np.load(b_path)
  if sorted(a.files) != sorted(b.files):
    print(f"different arrays: {sorted(set(a.files) ^ set(b.files))}")
    return 1
  bad = 0
  for name in sorted(a.files):
    x, y = a[name], b[name]
    same = x.shape == y.shape and x.tobytes() == y.tobytes()
    if not same:
      bad += 1
      diff = np.nanmax(np.abs(x - y)) if x.shape == y.shape else "shape"
      print(f"DIFFERENT {name}: max |diff| {diff}")
  print(f"{len(a.files) - bad} of {len(a.files)} arrays bitwise equal")
  return 1 if bad else 0


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  group = parser.add_mutually_exclusive_group(required=True)
  group.add_argument("--save", metavar="NPZ")
  group.add_argument("--compare", nargs=2, metavar="NPZ")
  parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
  args = parser.parse_args()
  if args.save:
    save(args.save, args.dtype)
    return 0
  return compare(*args.compare)


if __name__ == "__main__":
  sys.exit(main())
