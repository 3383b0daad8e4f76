"""FP8 attention accuracy: output RMSE against a float64 oracle, per quantization scheme.

FlashAttention-3's setup: entries N(0, 1) plus N(0, 100) on 0.1 % of them (outliers), rounded
to bfloat16, which are the inputs a user has; the oracle is float64 attention of exactly those
bfloat16 values. Rows:
- "bf16": jaxflash.attention of the bfloat16 inputs (the kernel on a Hopper GPU, or an error);
- "fp8 per-tensor": one descale per tensor (max |x| / 448), the baseline;
- "fp8 per-head": jaxflash.quantize_fp8, one descale per (batch, kv head);
- "fp8 block B": quantize_fp8(block_size=B);
- "fp8 block B + Hadamard": quantize_fp8(block_size=B, hadamard=True);
- "fp8 block B + Hadamard, value blocks": the same with the value quantized per block too
  (fp8.quantize_tensor), so its descales differ between blocks and P carries their ratios.
Each FP8 row has two columns: "call", jaxflash.attention of the quantized inputs (the FP8
kernel on a Hopper GPU for per-head descales and blocks of 64 tokens or more, or an error;
otherwise the dequantized float32 reference, the error of the quantization alone), and "P in
e4m3", jaxflash.fp8.naive_fp8_attention (what an FP8 kernel computes, P rounded to e4m3 too).
--sink-like S gives every query a key 0 whose scaled score is about S above the others (an
attention-sink token): P of the other keys is then small next to the row max, the case where
the order of the key blocks decides how many of them survive e4m3 (the kernel visits key 0
last; naive_fp8_attention rounds against the final max).
Prints a table, writes JSON with --out.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jaxflash
from jaxflash import fp8, reference
from jaxflash.config import AttentionConfig

FP8_MAX = 448.0


def outlier_inputs(shape, seed: int):
  """q, k, v in bfloat16: N(0, 1) entries, plus N(0, 100) on 0.1 % of them."""
  rng = np.random.default_rng(seed)

  def one():
    x = rng.standard_normal(shape)
    x += (rng.random(shape) < 1e-3) * rng.normal(0.0, 10.0, shape)
    return jnp.asarray(x, jnp.bfloat16)

  return one(), one(), one()


def with_sink_like_key(q, k, score: float):
  """q + u and k with key 0 = u * score / sqrt(d) (u all ones): every query's scaled score on
  key 0 is about `score` (softmax_scale = 1 / sqrt(d)) above its mean over the other keys."""
  d = q.shape[-1]
  u = jnp.ones((d,), jnp.float32)
  q = (q.astype(jnp.float32) + u).astype(jnp.bfloat16)
  k = k.astype(jnp.float32).at[:, 0].set(u * score / np.sqrt(d)).astype(jnp.bfloat16)
  return q, k


def per_tensor(x, num_kv_heads: int):
  """The baseline: one descale for the whole tensor, in the per-head layout jaxflash takes."""
  x = x.astype(jnp.float32)
  descale = jnp.max(jnp.abs(x)) / FP8_MAX
  x8 = jnp.clip(x / descale, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
  return x8, jnp.full((x.shape[0], num_kv_heads), descale, jnp.float32)


def schemes(q, k, v, block_size: int):
  """name -> (q8, k8, v8, q_descale, k_descale, v_descale)."""
  hk = k.shape[2]
  (q8, qd), (k8, kd), (v8, vd) = (per_tensor(x, hk) for x in (q, k, v))
  rotated = jaxflash.quantize_fp8(q, k, v, block_size=block_size, hadamard=True)
  value_blocks = fp8.quantize_tensor(v, block_size)
  return {
      "fp8 per-tensor": (q8, k8, v8, qd, kd, vd),
      "fp8 per-head": jaxflash.quantize_fp8(q, k, v),
      f"fp8 block {block_size}": jaxflash.quantize_fp8(q, k, v, block_size=block_size),
      f"fp8 block {block_size} + Hadamard": rotated,
      f"fp8 block {block_size} + Hadamard, value blocks": (
          *rotated[:2], value_blocks[0], *rotated[3:5], value_blocks[1]),
  }


def call_implementation(block_size=None):
  """The implementation of a "call" (block_size: the FP8 inputs' blocks; None for the bf16 row):
  on a GPU the kernels ("cute": a missing kernel is an error, where auto would quietly run the
  reference; blocks under the FP8 kernel's smallest run auto, which dequantizes), elsewhere
  auto (the reference)."""
  if jax.default_backend() == "gpu" and (block_size is None
                                         or block_size >= fp8.KERNEL_MIN_BLOCK):
    return "cute"
  return None


def rmse_table(batch: int, seq: int, heads: int, head_dim: int, causal: bool, block_size: int,
               seed: int = 0, sink_like: float = 0.0) -> dict:
  q, k, v = outlier_inputs((batch, seq, heads, head_dim), seed)
  if sink_like:
    q, k = with_sink_like_key(q, k, sink_like)
  cfg = AttentionConfig(softmax_scale=head_dim ** -0.5, causal=causal)
  with jax.enable_x64(True):  # the oracle only; every jaxflash call is 16/8-bit
    oracle = np.asarray(
        reference.naive_attention(*(x.astype(jnp.float64) for x in (q, k, v)), cfg)[0])

  def rmse(out):
    return float(np.sqrt(np.mean((np.asarray(out, np.float64) - oracle) ** 2)))

  impl = call_implementation(block_size)
  rows = {"bf16": {"call": rmse(jaxflash.attention(q, k, v, causal=causal,
                                                   implementation=call_implementation()))}}
  for name, (q8, k8, v8, qd, kd, vd) in schemes(q, k, v, block_size).items():
    call = jaxflash.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                              causal=causal, implementation=impl)
    emulated = fp8.naive_fp8_attention(q8, k8, v8, fp8.check_descales(q8, k8, v8, qd, kd, vd),
                                       cfg)[0]
    rows[name] = {"call": rmse(call), "P in e4m3": rmse(emulated.astype(jnp.bfloat16))}
  return rows


def score_sum_table(head_dims=(64, 128, 256), seed: int = 0) -> dict:
  """The precision of the e4m3 GEMM's score sums: calls with one query and one key (lse = the
  scaled q8 . k8 times the descales), batch 64 x 8 heads of N(0, 1) inputs, per head_dim: lse's
  largest error over scale * sum_i |q_i k_i| (the terms' magnitude) and its relative RMS."""
  rows = {}
  for d in head_dims:
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.standard_normal((64, 1, 8, d)), jnp.bfloat16) for _ in range(3))
    q8, k8, v8, qd, kd, vd = jaxflash.quantize_fp8(q, k, v)
    _, lse = jaxflash.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                                return_lse=True)
    deq = [np.asarray(x, np.float64) for x in fp8.dequantize_inputs(q8, k8, v8, qd, kd, vd, None)]
    products = deq[0][:, 0] * deq[1][:, 0] * d ** -0.5  # (batch, heads, d)
    want = products.sum(-1)
    err = np.abs(np.asarray(lse, np.float64)[:, :, 0] - want)
    rows[d] = {"max error / sum |terms|": float((err / np.abs(products).sum(-1)).max()),
               "relative RMS": float(np.sqrt(np.mean(err ** 2) / np.mean(want ** 2)))}
  return rows


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--seq", type=int, default=4096)
  parser.add_argument("--heads", type=int, default=2)
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--block-size", type=int, default=128)
  parser.add_argument("--causal", action="store_true")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--sink-like", type=float, default=0.0,
                      help="key 0's scaled score above the others (0: no such key)")
  parser.add_argument("--score-sums", action="store_true",
                      help="instead: lse of one-query, one-key calls (score_sum_table)")
  parser.add_argument("--out", type=Path, help="folder for fp8_accuracy.json")
  args = parser.parse_args(argv)
  if args.score_sums:
    rows = score_sum_table(seed=args.seed)
    print(f"lse of one-query, one-key FP8 calls vs float64, {jax.devices()[0].platform}")
    for d, value in rows.items():
      print(f"head_dim {d}: " + ", ".join(f"{k} {x:.2e}" for k, x in value.items()))
    if args.out:
      args.out.mkdir(parents=True, exist_ok=True)
      (args.out / "fp8_score_sums.json").write_text(json.dumps(rows, indent=2))
    return 0
  rows = rmse_table(args.batch, args.seq, args.heads, args.head_dim, args.causal,
                    args.block_size, args.seed, args.sink_like)
  baseline = rows["fp8 per-tensor"]
  print(f"RMSE vs float64, {jax.devices()[0].platform}, batch {args.batch}, seq {args.seq}, "
        f"heads {args.heads}, head_dim {args.head_dim}, causal {args.causal}, "
        f"sink-like key {args.sink_like}")
  print(f"{'scheme':<42} {'call':>10} {'per-tensor/it':>14} {'P in e4m3':>10} "
        f"{'per-tensor/it':>14}")
  for name, value in rows.items():
    cells = [f"{value['call']:>10.3e}", f"{baseline['call'] / value['call']:>14.2f}"]
    if "P in e4m3" in value:
      e = value["P in e4m3"]
      cells += [f"{e:>10.3e}", f"{baseline['P in e4m3'] / e:>14.2f}"]
    print(f"{name:<42} " + " ".join(cells))
  if args.out:
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fp8_accuracy.json").write_text(json.dumps(
        {"args": {k: str(v) for k, v in vars(args).items()}, "rmse": rows}, indent=2))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
