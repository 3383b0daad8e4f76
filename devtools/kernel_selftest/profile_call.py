"""One jitted attention call inside a CUDA profiler range, for Nsight Compute (devtools, not
shipped): the call is compiled and warmed up first, then run once between cuProfilerStart and
cuProfilerStop, so `ncu --profile-from-start off` sees exactly the kernels of one call.

  python devtools/kernel_selftest/profile_call.py decode CASE IMPL   # bench_decode.py's cases
  python devtools/kernel_selftest/profile_call.py fwd HDIM SEQ IMPL [--causal] [--grad]
                                      # batch*seq=16k; --grad: forward + backward (q, k, v)
  python devtools/kernel_selftest/profile_call.py masked CASE IMPL [--grad]
                                      # bench_masked.py's forward (--grad: forward + backward)
  python devtools/kernel_selftest/profile_call.py gpt-oss SEQ IMPL   # bench_modifiers --gpt-oss
  python devtools/kernel_selftest/profile_call.py modifier HDIM SEQ IMPL [--causal]
                                                          # bench_modifiers.py (softcap, sink)
  python devtools/kernel_selftest/profile_call.py fp8 HDIM SEQ IMPL [--causal]  # bench_fp8.py
  python devtools/kernel_selftest/profile_call.py chunked CASE IMPL   # bench_chunked_prefill.py

IMPL: a column of that benchmark (jaxflash, fa3, cudnn, xla, paged64, "window+sink", softcap,
cudnn-fp8, ...).
"""
import argparse
import ctypes
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_attention  # noqa: E402
import bench_chunked_prefill  # noqa: E402
import bench_decode  # noqa: E402
import bench_fp8  # noqa: E402
import bench_masked  # noqa: E402
import bench_modifiers  # noqa: E402


def decode_call(case: str, impl: str):
  calls = bench_decode.calls(bench_decode.CASES[case], jnp.bfloat16, [impl])
  if impl not in calls:
    raise SystemExit(f"bench_decode case {case} has no column {impl}")
  return calls[impl]


def chunked_call(case: str, impl: str):
  calls = bench_chunked_prefill.calls(bench_chunked_prefill.CASES[case], jnp.bfloat16, [impl])
  fn, call_args, _ = calls[impl]
  return fn, call_args


def fwd_call(head_dim: int, seq: int, impl: str, causal: bool, grad: bool):
  if impl == "fa3":  # FlashAttention-3's kernels (devtools/fa3_binding.py)
    bench_attention.fa3_binding.register()
  batch, heads = 16384 // seq, 2048 // head_dim
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  q, k, v, cotangent = (jax.random.normal(key, (batch, seq, heads, head_dim), jnp.bfloat16)
                        for key in keys)
  fn = bench_attention.attention_fn(impl, causal, head_dim, head_dim)
  if grad:  # bench_attention's forward + backward
    fn = bench_attention.fwd_bwd_fn(fn, cotangent)
  return jax.jit(fn), (q, k, v)


def masked_call(case: str, impl: str, grad: bool):
  spec = bench_masked.cases()[case]
  if impl not in spec.impls:
    raise SystemExit(f"bench_masked case {case} has no column {impl}")
  if impl == "fa3":
    bench_attention.fa3_binding.register()
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  q, k, v = (jax.random.normal(key, spec.shape + (16, 128), jnp.bfloat16) for key in keys)
  fn = spec.impls[impl]
  if grad:  # bench_masked's forward + backward
    fn = bench_masked.fwd_bwd_fn(fn, jax.random.normal(keys[0], q.shape, jnp.bfloat16))
  return jax.jit(fn), (q, k, v, spec.data)


def gpt_oss_call(seq: int, impl: str):
  if impl not in bench_modifiers.GPT_OSS_IMPLS:
    raise SystemExit(f"gpt-oss has no column {impl}: {', '.join(bench_modifiers.GPT_OSS_IMPLS)}")
  return (jax.jit(bench_modifiers.gpt_oss_fn(impl)),
          bench_modifiers.gpt_oss_inputs(seq, np.random.default_rng(0)))


def modifier_call(head_dim: int, seq: int, impl: str, causal: bool):
  if impl not in bench_modifiers.IMPLS:
    raise SystemExit(f"bench_modifiers has no column {impl}: {', '.join(bench_modifiers.IMPLS)}")
  heads = bench_modifiers.WIDTH // head_dim
  return (jax.jit(bench_modifiers.attend_fn(impl, causal)),
          bench_modifiers.inputs(seq, heads, heads, head_dim, np.random.default_rng(0)))


def fp8_call(head_dim: int, seq: int, impl: str, causal: bool):
  calls = bench_fp8.calls(head_dim, seq, causal, np.random.default_rng(0))
  if impl not in calls:
    raise SystemExit(f"bench_fp8 has no column {impl}: {', '.join(calls)}")
  fn, call_args = calls[impl]
  return jax.jit(fn), call_args


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  sub = p.add_subparsers(dest="kind", required=True)
  d = sub.add_parser("decode")
  d.add_argument("case", choices=list(bench_decode.CASES))
  d.add_argument("impl", choices=bench_decode.IMPLS)
  c = sub.add_parser("chunked")
  c.add_argument("case", choices=list(bench_chunked_prefill.CASES))
  c.add_argument("impl", choices=bench_chunked_prefill.IMPLS)
  f = sub.add_parser("fwd")
  f.add_argument("head_dim", type=int)
  f.add_argument("seq", type=int)
  f.add_argument("impl")
  f.add_argument("--causal", action="store_true")
  f.add_argument("--grad", action="store_true", help="forward + backward")
  m = sub.add_parser("masked")
  m.add_argument("case", choices=bench_masked.CASES)
  m.add_argument("impl")
  m.add_argument("--grad", action="store_true", help="forward + backward")
  g = sub.add_parser("gpt-oss")
  g.add_argument("seq", type=int)
  g.add_argument("impl")
  for kind in ("modifier", "fp8"):
    x = sub.add_parser(kind)
    x.add_argument("head_dim", type=int)
    x.add_argument("seq", type=int)
    x.add_argument("impl")
    x.add_argument("--causal", action="store_true")
  args = p.parse_args()
  if args.kind == "decode":
    fn, call_args = decode_call(args.case, args.impl)
  elif args.kind == "chunked":
    fn, call_args = chunked_call(args.case, args.impl)
  elif args.kind == "fwd":
    fn, call_args = fwd_call(args.head_dim, args.seq, args.impl, args.causal, args.grad)
  elif args.kind == "masked":
    fn, call_args = masked_call(args.case, args.impl, args.grad)
  elif args.kind == "gpt-oss":
    fn, call_args = gpt_oss_call(args.seq, args.impl)
  elif args.kind == "modifier":
    fn, call_args = modifier_call(args.head_dim, args.seq, args.impl, args.causal)
  else:
    fn, call_args = fp8_call(args.head_dim, args.seq, args.impl, args.causal)
  for _ in range(2):
    jax.block_until_ready(fn(*call_args))
  cuda = ctypes.CDLL("libcuda.so.1")
  cuda.cuProfilerStart()
  jax.block_until_ready(fn(*call_args))
  cuda.cuProfilerStop()
  np.asarray(jax.tree.leaves(fn(*call_args))[0]).ravel()[:1]  # the call ran to the end


if __name__ == "__main__":
  main()
