"""Small demo: jaxflash.attention against jax.nn.dot_product_attention (error and timing).

Runs anywhere: on a CPU-only machine jaxflash takes its reference path; on a Hopper GPU the
CuTe kernels (when built) and jax.nn's cuDNN path are compared too.
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxflash


def _time(fn, *args, reps=5):
  jax.block_until_ready(fn(*args))  # compile + warm up
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--batch", type=int, default=2)
  parser.add_argument("--seq", type=int, default=1024)
  parser.add_argument("--heads", type=int, default=8)
  parser.add_argument("--kv-heads", type=int, default=2)
  parser.add_argument("--head-dim", type=int, default=64)
  parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
  parser.add_argument("--causal", action="store_true")
  args = parser.parse_args()

  keys = jax.random.split(jax.random.key(0), 3)
  shape_q = (args.batch, args.seq, args.heads, args.head_dim)
  shape_kv = (args.batch, args.seq, args.kv_heads, args.head_dim)
  q = jax.random.normal(keys[0], shape_q, args.dtype)
  k = jax.random.normal(keys[1], shape_kv, args.dtype)
  v = jax.random.normal(keys[2], shape_kv, args.dtype)
  exact = jax.nn.dot_product_attention(q.astype(jnp.float32), k.astype(jnp.float32),
                                       v.astype(jnp.float32), is_causal=args.causal)

  impls = {
      "jaxflash (auto)": jax.jit(lambda q, k, v: jaxflash.attention(q, k, v, causal=args.causal)),
      "jax.nn (xla)": jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, is_causal=args.causal, implementation="xla")),
  }
  if jax.default_backend() == "gpu":
    impls["jax.nn (cudnn)"] = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=args.causal, implementation="cudnn"))
  flops = 4 * args.batch * args.heads * args.seq ** 2 * args.head_dim / (2 if args.causal else 1)
  print(f"backend {jax.default_backend()}, q {shape_q}, kv {shape_kv}, {args.dtype}, "
        f"causal={args.causal}")
  print(f"{'implementation':<18} {'rel. L2 error':>14} {'ms':>9} {'TFLOP/s':>9}")
  for name, fn in impls.items():
    out = fn(q, k, v).astype(jnp.float32)
    err = float(jnp.linalg.norm(out - exact) / jnp.linalg.norm(exact))
    seconds = _time(fn, q, k, v)
    print(f"{name:<18} {err:>14.2e} {seconds * 1e3:>9.2f} {flops / seconds / 1e12:>9.3f}")


if __name__ == "__main__":
  main()
