"""One jitted FP8 forward call for a profiler (devtools, not shipped): quantize_fp8's per-head
e4m3 tensors of N(0, 1) inputs, batch 1, seq 16k, heads 2048 / head_dim, through the kernel.

  python devtools/kernel_selftest/fp8_fwd_call.py HEAD_DIM [--causal] [--block-size B]
"""
import argparse

import jax
import jax.numpy as jnp

import jaxflash


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("head_dim", type=int, choices=(64, 128, 256))
  parser.add_argument("--causal", action="store_true")
  parser.add_argument("--block-size", type=int, default=None)
  parser.add_argument("--seq", type=int, default=16384)
  args = parser.parse_args()
  heads = 2048 // args.head_dim
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  q, k, v = (jax.random.normal(key, (1, args.seq, heads, args.head_dim), jnp.bfloat16)
             for key in keys)
  q8, k8, v8, qd, kd, vd = jaxflash.quantize_fp8(q, k, v, block_size=args.block_size)
  call = jax.jit(lambda q8, k8, v8, qd, kd, vd: jaxflash.attention(
      q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, causal=args.causal,
      implementation="cute"))
  call(q8, k8, v8, qd, kd, vd).block_until_ready()


if __name__ == "__main__":
  main()
