"""Masked attention on one GPU: jaxflash (segment ids, windows) vs cuDNN, one run; table + JSON.

Cases (bf16, head_dim 128, 16 heads; batch 1 unless noted):
  packed8: 8 documents of 2048 tokens packed in 16384, causal within documents;
  packed11: documents of 128-4096 tokens (numpy default_rng(0)) packed in 16384, causal;
  window: 32768 tokens, causal with a 4096-key window;
  padded: batch 4 x 4096 with 0-1023 trailing padding tokens per row (default_rng(1)), causal.
Implementations: jaxflash (segment ids / window_size, `deterministic=True` as "jaxflash det."),
cuDNN (packed: jax's private cuDNN entry with q_offsets / kv_offsets and per-document lengths,
MaskType.PADDING_CAUSAL; window: jax.nn.dot_product_attention(local_window_size=(4096, 0));
padded: jax.nn with query / key lengths), and for the packed cases jaxflash's dense causal
kernel on the same documents as a batch ("jaxflash batched", where their lengths are equal).
Effective TFLOP/s count only the (query, key) pairs the mask keeps: forward 4 * h * d * pairs,
forward + backward 3.5x that. Timing as benchmarks/bench_attention.py (its time_ms).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jaxflash

HEADS, HEAD_DIM = 16, 128


def _bench_attention():
  path = Path(__file__).with_name("bench_attention.py")
  spec = importlib.util.spec_from_file_location("bench_attention", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def packed_lengths(name: str, tokens: int = 16384) -> list[int]:
  """Document lengths of a packed row."""
  if name == "packed8":
    return [tokens // 8] * 8
  rng = np.random.default_rng(0)
  lengths = []
  while sum(lengths) < tokens:
    lengths.append(int(rng.integers(128, 4097)))
  lengths[-1] -= sum(lengths) - tokens
  return lengths


def causal_pairs(lengths) -> int:
  return sum(n * (n + 1) // 2 for n in lengths)


def window_pairs(seq: int, left: int) -> int:
  i = np.arange(seq)
  return int(np.minimum(i, left).sum() + seq)


def _cudnn_packed(lengths, seq):
  """jax's private cuDNN attention over a packed row: offsets and lengths of each document."""
  from jax._src.cudnn import fused_attention_stablehlo as cudnn
  offsets = jnp.asarray([np.concatenate([[0], np.cumsum(lengths)])], jnp.int32)
  seqlens = jnp.asarray([lengths], jnp.int32)

  def attend(q, k, v):
    return cudnn.dot_product_attention(
        q, k, v, q_seqlen=seqlens, kv_seqlen=seqlens, q_offsets=offsets, kv_offsets=offsets,
        scale=HEAD_DIM ** -0.5, mask_type=cudnn.MaskType.PADDING_CAUSAL, qkv_layout="BTNH")
  return attend


def cases():
  """name -> (shape (b, s), {impl: attend(q, k, v)}, pairs kept)."""
  out = {}
  for name in ("packed8", "packed11"):
    lengths = packed_lengths(name)
    ids = jnp.asarray([np.repeat(np.arange(len(lengths)), lengths)], jnp.int32)
    impls = {
        "jaxflash": lambda q, k, v, ids=ids: jaxflash.attention(
            q, k, v, causal=True, q_segment_ids=ids, kv_segment_ids=ids,
            implementation="cute"),
        "jaxflash-det": lambda q, k, v, ids=ids: jaxflash.attention(
            q, k, v, causal=True, q_segment_ids=ids, kv_segment_ids=ids, deterministic=True,
            implementation="cute"),
        "cudnn": _cudnn_packed(lengths, 16384),
    }
    if len(set(lengths)) == 1:
      n = len(lengths)

      def batched(q, k, v, n=n):
        fold = lambda x: x.reshape(n, x.shape[1] // n, *x.shape[2:])
        out = jaxflash.attention(fold(q), fold(k), fold(v), causal=True, implementation="cute")
        return out.reshape(q.shape[0], q.shape[1], *out.shape[2:])
      impls["jaxflash-batched"] = batched
    out[name] = ((1, 16384), impls, causal_pairs(lengths))
  out["window"] = ((1, 32768), {
      "jaxflash": lambda q, k, v: jaxflash.attention(q, k, v, causal=True,
                                                     window_size=(4096, 0),
                                                     implementation="cute"),
      "jaxflash-det": lambda q, k, v: jaxflash.attention(q, k, v, causal=True,
                                                         window_size=(4096, 0),
                                                         deterministic=True,
                                                         implementation="cute"),
      "cudnn": lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, is_causal=True, local_window_size=(4096, 0), implementation="cudnn"),
  }, window_pairs(32768, 4096))
  valid = 4096 - np.random.default_rng(1).integers(0, 1024, 4)
  # Valid tokens have id 1; padding queries (0) see no key, padding keys (2) no query.
  real = np.arange(4096)[None, :] < valid[:, None]
  q_ids = jnp.asarray(np.where(real, 1, 0), jnp.int32)
  kv_ids = jnp.asarray(np.where(real, 1, 2), jnp.int32)
  lengths = jnp.asarray(valid, jnp.int32)
  out["padded"] = ((4, 4096), {
      "jaxflash": lambda q, k, v: jaxflash.attention(q, k, v, causal=True, q_segment_ids=q_ids,
                                                     kv_segment_ids=kv_ids,
                                                     implementation="cute"),
      "jaxflash-det": lambda q, k, v: jaxflash.attention(q, k, v, causal=True,
                                                         q_segment_ids=q_ids,
                                                         kv_segment_ids=kv_ids,
                                                         deterministic=True,
                                                         implementation="cute"),
      "cudnn": lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, is_causal=True, query_seq_lengths=lengths, key_value_seq_lengths=lengths,
          implementation="cudnn"),
  }, sum(causal_pairs([int(n)]) for n in valid))
  return out


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--cases", nargs="+", default=["packed8", "packed11", "window", "padded"])
  p.add_argument("--spin-up", type=float, default=5.0, metavar="SECONDS")
  p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "bench_out"))
  args = p.parse_args(argv)
  bench = _bench_attention()
  bench.spin_up(args.spin_up)
  rng = np.random.default_rng(0)
  records = []
  all_cases = cases()
  for name in args.cases:
    (b, s), impls, pairs = all_cases[name]
    q, k, v, ct = (jnp.asarray(rng.standard_normal((b, s, HEADS, HEAD_DIM)), jnp.bfloat16)
                   for _ in range(4))
    for impl, attend in impls.items():
      for mode in ("fwd", "fwd+bwd"):
        if mode == "fwd" and impl == "jaxflash-det":
          continue
        fn = jax.jit(attend if mode == "fwd" else bench.fwd_bwd_fn(attend, ct))
        rec = dict(case=name, impl=impl, mode=mode, pairs=pairs, ms=None, tflops=None)
        try:
          rec["ms"] = bench.time_ms(fn, q, k, v)
          flops = 4.0 * HEADS * HEAD_DIM * pairs * (1.0 if mode == "fwd" else 3.5)
          rec["tflops"] = flops / (rec["ms"] * 1e-3) / 1e12
        except Exception as e:  # report it and keep going
          rec["note"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        records.append(rec)
        print(json.dumps(rec), flush=True)
  args.out.mkdir(parents=True, exist_ok=True)
  (args.out / "bench_masked.json").write_text(json.dumps(records, indent=1))
  print("| case | mode | " + " | ".join(sorted({r["impl"] for r in records})) + " |")
  for name in args.cases:
    for mode in ("fwd", "fwd+bwd"):
      row = {r["impl"]: r for r in records if r["case"] == name and r["mode"] == mode}
      cells = [f"{row[i]['tflops']:.0f}" if i in row and row[i]["tflops"] else "-"
               for i in sorted({r["impl"] for r in records})]
      print(f"| {name} | {mode} | " + " | ".join(cells) + " |")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
