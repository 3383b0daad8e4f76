"""FP8 forward throughput on one GPU: jaxflash's e4m3 kernel, its bf16 kernel and cuDNN's bf16
and FP8 forwards, one run; table + JSON.

Shapes as benchmarks/bench_attention.py: batch * seq = 16384 tokens, heads = 2048 / head_dim,
causal or not (--causal). Implementations: "fp8" (jaxflash.attention of quantize_fp8's e4m3
tensors, bf16 out or --out-dtype float16; per-head descales, or per block of --block-size
tokens), "bf16" (jaxflash, bf16 inputs), "cudnn" (jax.nn, bf16), "cudnn-fp8"
(jax's cuDNN attention with use_fp8=True, unit scales; it writes e4m3). TFLOP/s count the
forward's flops (4 b h s^2 d, halved when causal). Timing: bench_attention.time_ms. Needs the
kernels built (python -m jaxflash.build) and a Hopper GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jaxflash

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benchmark modules
import bench_attention  # noqa: E402
from bench_modifiers import timed_record  # noqa: E402

TOKENS, WIDTH = 16384, 2048
IMPLS = ("fp8", "bf16", "cudnn", "cudnn-fp8")


def cudnn_fp8_fn(causal: bool, scale: float):
  """jax's cuDNN FP8 forward (private API) with unit scales: (q8, k8, v8) -> e4m3 out."""
  from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention
  one = jnp.ones((1, 1, 1, 1), jnp.float32)
  params = {key: one for key in cudnn_attention.fp8_params_keys}
  mask = cudnn_attention.MaskType.CAUSAL if causal else cudnn_attention.MaskType.NO_MASK

  def attend(q8, k8, v8):
    return cudnn_attention.dot_product_attention(q8, k8, v8, fp8_params=params, scale=scale,
                                                 mask_type=mask, use_fp8=True)[0]
  return attend


def calls(head_dim: int, seq: int, causal: bool, rng, block_size=None,
          out_dtype="bfloat16") -> dict:
  """{impl: (fn, args)} of one shape, every column of IMPLS; the fp8 call writes out_dtype."""
  b, h = TOKENS // seq, WIDTH // head_dim
  q, k, v = (jnp.asarray(rng.standard_normal((b, seq, h, head_dim)), jnp.bfloat16)
             for _ in range(3))
  q8, k8, v8, qd, kd, vd = jax.jit(jaxflash.quantize_fp8, static_argnames="block_size")(
      q, k, v, block_size=block_size)
  scale = head_dim ** -0.5
  return {
      "fp8": (lambda *a: jaxflash.attention(*a[:3], q_descale=a[3], k_descale=a[4],
                                            v_descale=a[5], causal=causal, out_dtype=out_dtype,
                                            implementation="cute"), (q8, k8, v8, qd, kd, vd)),
      "bf16": (lambda *a: jaxflash.attention(*a, causal=causal, implementation="cute"),
               (q, k, v)),
      "cudnn": (lambda *a: jax.nn.dot_product_attention(*a, is_causal=causal,
                                                        implementation="cudnn"), (q, k, v)),
      "cudnn-fp8": (cudnn_fp8_fn(causal, scale), (q8, k8, v8)),
  }


def cells(head_dim: int, seq: int, causal: bool, rng, block_size=None, impls=IMPLS,
          out_dtype="bfloat16") -> list:
  """The timed cells of one shape, in the order of impls; the fp8 cell writes out_dtype."""
  fns = calls(head_dim, seq, causal, rng, block_size, out_dtype)
  flops = bench_attention.fwd_flops(TOKENS // seq, WIDTH // head_dim, seq, head_dim, head_dim,
                                    causal)
  return [timed_record(jax.jit(fns[impl][0]), fns[impl][1], flops, head_dim=head_dim, seq=seq,
                       causal=causal, impl=impl) for impl in impls]


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--hdim", type=int, nargs="+", default=[64, 128, 256])
  p.add_argument("--seq", type=int, nargs="+", default=[1024, 4096, 16384])
  p.add_argument("--causal", action="store_true")
  p.add_argument("--block-size", type=int, default=None,
                 help="block descales of this many tokens for the fp8 column (default per head)")
  p.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS),
                 help="the columns to time (default all)")
  p.add_argument("--out-dtype", choices=("bfloat16", "float16"), default="bfloat16",
                 help="the fp8 column's output dtype")
  bench_attention.add_run_arguments(p)
  args = p.parse_args(argv)
  bench_attention.spin_up(args.spin_up)
  rng = np.random.default_rng(0)
  records = [r for d in args.hdim for s in args.seq
             for r in cells(d, s, args.causal, rng, args.block_size, args.impls, args.out_dtype)]
  for r in records:
    r["block_size"] = args.block_size
    r["fp8_out_dtype"] = args.out_dtype
  args.out.mkdir(parents=True, exist_ok=True)
  (args.out / "bench_fp8.json").write_text(json.dumps(records, indent=1))
  print("| head_dim | seq | " + " | ".join(args.impls) + " | fp8 / bf16 | fp8 / cudnn-fp8 |")
  for d in args.hdim:
    for s in args.seq:
      row = {r["impl"]: r for r in records if (r["head_dim"], r["seq"]) == (d, s)}
      tf = lambda i: row[i]["tflops"] if i in row else None
      ratio = lambda a, b: f"{tf(a) / tf(b):.2f}" if tf(a) and tf(b) else "-"
      print(f"| {d} | {s} | " + " | ".join(f"{tf(i):.0f}" if tf(i) else "-" for i in args.impls)
            + f" | {ratio('fp8', 'bf16')} | {ratio('fp8', 'cudnn-fp8')} |")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
