"""Masked attention on one GPU: jaxflash (segment ids, windows) vs cuDNN, one run; table + JSON.

Cases (bf16, head_dim 128, 16 heads; batch 1 unless noted):
  packed8: 8 documents of 2048 tokens packed in 16384, causal within documents;
  packed11: documents of 128-4096 tokens (numpy default_rng(0)) packed in 16384, causal;
  window: 32768 tokens, causal with a 4096-key window; window128k: the same at 131072 tokens;
  bidir: 16384 tokens, window (1024, 1024), not causal;
  padded: batch 4 x 16384, valid lengths 60-100 % of the row (default_rng(1)), causal;
  dense: 16384 tokens, causal, no mask (the dense kernel the masked ones are measured against).
Implementations: jaxflash (segment ids / window_size, `deterministic=True` as "jaxflash-det"),
cuDNN (packed: jax's private cuDNN entry with q_offsets / kv_offsets and per-document lengths,
MaskType.PADDING_CAUSAL; windows: jax.nn.dot_product_attention(local_window_size=...), which
cuDNN takes for left windows only; padded: jax.nn with query / key lengths), FlashAttention-3
("fa3", devtools/fa3_binding.py, where its library is found; packed: its varlen kernels over
the same offsets, as jit arguments; windows and dense: its window and causal arguments), and for
packed8 jaxflash's dense causal kernel on the same documents as a batch ("jaxflash-batched").
Effective TFLOP/s count only the (query, key) pairs the mask keeps: forward 4 * h * d * pairs,
forward + backward 3.5x that. Timing as benchmarks/bench_attention.py (its time_ms). Segment
ids, document offsets and lengths are jit arguments, as in a training step: the block-range
preparation runs in every timed call. `--prep` also times the block-range preparation (the XLA
ops in front of each masked custom call, jaxflash/block_ranges.py) alone for each case with
segment ids: its device time per call, from a chain of them in one program (prep_chain).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import jaxflash
from jaxflash import block_ranges
from jaxflash.config import AttentionConfig, KernelVariant

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling bench_attention.py
import bench_attention  # noqa: E402
import fa3_binding  # noqa: E402  (bench_attention put devtools/ on the path)

HEADS, HEAD_DIM = 16, 128


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


def window_pairs(seq: int, left: int, right: int = 0) -> int:
  i = np.arange(seq)
  return int(np.minimum(i, left).sum() + np.minimum(seq - 1 - i, right).sum() + seq)


def _window_impls(left, right, causal):
  def flash(deterministic):
    return lambda q, k, v, data: jaxflash.attention(
        q, k, v, causal=causal, window_size=(left, right), deterministic=deterministic,
        implementation="cute")
  window = (left, 0) if causal else (left, right)
  return {"jaxflash": flash(False), "jaxflash-det": flash(True),
          "fa3": lambda q, k, v, data: fa3_binding.attention(q, k, v, causal=causal,
                                                            window_size=(left, right)),
          "cudnn": lambda q, k, v, data: jax.nn.dot_product_attention(
              q, k, v, is_causal=causal, local_window_size=window, implementation="cudnn")}


def _segment_impls(causal=True):
  """jaxflash on data = (q ids, kv ids)."""
  def flash(deterministic):
    return lambda q, k, v, data: jaxflash.attention(
        q, k, v, causal=causal, q_segment_ids=data[0], kv_segment_ids=data[1],
        deterministic=deterministic, implementation="cute")
  return {"jaxflash": flash(False), "jaxflash-det": flash(True)}


def _fa3_packed(longest: int):
  """FA-3's varlen kernels on the rows of data[2] = document offsets (1, documents + 1), the
  tokens of the one row packed as (tokens, heads, head_dim); longest: the longest document."""
  def attend(q, k, v, data):
    fold = lambda x: x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])
    out = fa3_binding.varlen_attention(fold(q), fold(k), fold(v), data[2][0], longest,
                                       causal=True)
    return out.reshape(q.shape[:2] + out.shape[1:])
  return attend


def _cudnn_packed(q, k, v, data):
  """jax's private cuDNN attention over packed rows: data[2:] = document offsets, lengths."""
  from jax._src.cudnn import fused_attention_stablehlo as cudnn
  offsets, seqlens = data[2:]
  return cudnn.dot_product_attention(
      q, k, v, q_seqlen=seqlens, kv_seqlen=seqlens, q_offsets=offsets, kv_offsets=offsets,
      scale=HEAD_DIM ** -0.5, mask_type=cudnn.MaskType.PADDING_CAUSAL, qkv_layout="BTNH")


class Case(NamedTuple):
  """shape (b, s); impls: name -> attend(q, k, v, data); pairs the mask keeps; data: the
  call's run-time mask operands (segment ids first, where the case has them), passed as jit
  arguments as a training step would."""

  shape: tuple
  impls: dict
  pairs: int
  data: tuple = ()


def cases():
  out = {}
  for name in ("packed8", "packed11"):
    lengths = packed_lengths(name)
    ids = jnp.asarray([np.repeat(np.arange(len(lengths)), lengths)], jnp.int32)
    offsets = jnp.asarray([np.concatenate([[0], np.cumsum(lengths)])], jnp.int32)
    impls = dict(_segment_impls(), cudnn=_cudnn_packed, fa3=_fa3_packed(max(lengths)))
    if len(set(lengths)) == 1:
      n = len(lengths)

      def batched(q, k, v, data, n=n):
        fold = lambda x: x.reshape(n, x.shape[1] // n, *x.shape[2:])
        out = jaxflash.attention(fold(q), fold(k), fold(v), causal=True, implementation="cute")
        return out.reshape(q.shape[0], q.shape[1], *out.shape[2:])
      impls["jaxflash-batched"] = batched
    out[name] = Case((1, 16384), impls, causal_pairs(lengths),
                     (ids, ids, offsets, jnp.asarray([lengths], jnp.int32)))
  out["window"] = Case((1, 32768), _window_impls(4096, 0, True), window_pairs(32768, 4096))
  out["window128k"] = Case((1, 131072), _window_impls(4096, 0, True),
                           window_pairs(131072, 4096))
  out["bidir"] = Case((1, 16384), _window_impls(1024, 1024, False),
                      window_pairs(16384, 1024, 1024))
  seq = 16384
  valid = np.random.default_rng(1).integers(int(0.6 * seq), seq + 1, 4)
  # Valid tokens have id 1; padding queries (0) see no key, padding keys (2) no query.
  real = np.arange(seq)[None, :] < valid[:, None]
  impls = dict(_segment_impls(), cudnn=lambda q, k, v, data: jax.nn.dot_product_attention(
      q, k, v, is_causal=True, query_seq_lengths=data[2], key_value_seq_lengths=data[2],
      implementation="cudnn"))
  out["padded"] = Case((4, seq), impls, sum(causal_pairs([int(n)]) for n in valid),
                       (jnp.asarray(np.where(real, 1, 0), jnp.int32),
                        jnp.asarray(np.where(real, 1, 2), jnp.int32),
                        jnp.asarray(valid, jnp.int32)))
  out["dense"] = Case((1, seq), {
      "jaxflash": lambda q, k, v, data: jaxflash.attention(q, k, v, causal=True,
                                                           implementation="cute"),
      "cudnn": lambda q, k, v, data: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                                  implementation="cudnn"),
      "fa3": lambda q, k, v, data: fa3_binding.attention(q, k, v, causal=True),
  }, causal_pairs([seq]))
  return out


def fwd_bwd_fn(attend, cotangent):
  """Gradient of sum(out * cotangent) w.r.t. q, k, v (the mask data not differentiated)."""
  def loss(q, k, v, data):
    return jnp.sum((attend(q, k, v, data) * cotangent).astype(jnp.float32))
  return jax.grad(loss, argnums=(0, 1, 2))


CASES = ("packed8", "packed11", "window", "window128k", "bidir", "padded", "dense")


PREP_CHAIN = 16


def prep_chain(direction: str, batch: int, seq: int):
  """A jitted program of PREP_CHAIN block-range preparations of one direction, as its lowering
  computes them for these cases' calls, in a chain: each one's ids are offset by its
  predecessor's first block range entry shifted right by 30 bits, zero at run time (a block
  index is below 2**30) but unknown to the compiler, which can therefore neither merge the
  preparations nor hoist them. Returns the last one's operands."""
  config = AttentionConfig(softmax_scale=HEAD_DIM ** -0.5, causal=True, has_segment_ids=True)
  variant = KernelVariant.for_call(direction, "sm90a", "bfloat16", HEAD_DIM, HEAD_DIM, config)
  operands = dict(fwd=block_ranges.forward_operands, bwd=block_ranges.backward_operands)[direction]
  heads = () if direction == "fwd" else (HEADS, HEADS)  # backward: heads, kv heads (MHA)

  def chain(q_ids, kv_ids):
    for _ in range(PREP_CHAIN):
      results = operands(variant, config, batch, seq, seq, *heads, (q_ids, kv_ids))
      zero = jnp.right_shift(results[2][0, 0, 0], 30)
      q_ids, kv_ids = q_ids + zero, kv_ids + zero
    return results
  return jax.jit(chain)


def prep_ms(q_ids, kv_ids) -> dict:
  """Device ms of one call's block-range operands per direction: a chain's time over its length,
  that of one preparation's kernels back to back as in a step, rather than of a dispatch."""
  return {f"prep {d}": bench_attention.time_ms(prep_chain(d, *q_ids.shape), q_ids, kv_ids)
          / PREP_CHAIN for d in ("fwd", "bwd")}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
  p.add_argument("--prep", action="store_true", help="also time the block-range preparation")
  p.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
  p.add_argument("--skip-fa3", action="store_true", help="skip the FlashAttention-3 column")
  p.add_argument("--skip-det", action="store_true", help="skip the deterministic jaxflash column")
  bench_attention.add_run_arguments(p)
  args = p.parse_args(argv)
  fa3_ok, fa3_where = (False, "--skip-fa3") if args.skip_fa3 else fa3_binding.availability()
  print(f"FA-3 column: {fa3_where}" if fa3_ok else f"no FA-3 column: {fa3_where}", flush=True)
  if fa3_ok:
    fa3_binding.register()
  bench_attention.spin_up(args.spin_up)
  rng = np.random.default_rng(0)
  records = []
  all_cases = cases()
  for name in args.cases:
    case = all_cases[name]
    (b, s), pairs = case.shape, case.pairs
    q, k, v, ct = (jnp.asarray(rng.standard_normal((b, s, HEADS, HEAD_DIM)), jnp.bfloat16)
                   for _ in range(4))
    for impl, attend in case.impls.items():
      if (impl == "fa3" and not fa3_ok) or (impl == "jaxflash-det" and args.skip_det):
        continue
      for mode in args.modes:
        if mode == "fwd" and impl == "jaxflash-det":
          continue
        fn = jax.jit(attend if mode == "fwd" else fwd_bwd_fn(attend, ct))
        rec = dict(case=name, impl=impl, mode=mode, pairs=pairs, ms=None, tflops=None)
        try:
          rec["ms"] = bench_attention.time_ms(fn, q, k, v, case.data)
          flops = 4.0 * HEADS * HEAD_DIM * pairs * (1.0 if mode == "fwd" else 3.5)
          rec["tflops"] = flops / (rec["ms"] * 1e-3) / 1e12
        except Exception as e:  # report it and keep going
          rec["note"] = bench_attention.failure_note(e)
        records.append(rec)
        print(json.dumps(rec), flush=True)
    if args.prep and case.data:
      for mode, ms in prep_ms(*case.data[:2]).items():
        rec = dict(case=name, impl="prep", mode=mode, pairs=pairs, ms=ms, tflops=None)
        records.append(rec)
        print(json.dumps(rec), flush=True)
  args.out.mkdir(parents=True, exist_ok=True)
  (args.out / "bench_masked.json").write_text(json.dumps(records, indent=1))
  print("| case | mode | " + " | ".join(sorted({r["impl"] for r in records} - {"prep"})) + " |")
  for name in args.cases:
    for mode in args.modes:
      row = {r["impl"]: r for r in records if r["case"] == name and r["mode"] == mode}
      cells = [f"{row[i]['tflops']:.0f}" if i in row and row[i]["tflops"] else "-"
               for i in sorted({r["impl"] for r in records} - {"prep"})]
      print(f"| {name} | {mode} | " + " | ".join(cells) + " |")
  for r in records:
    if r["impl"] == "prep":
      print(f"{r['case']}: {r['mode']} {r['ms']:.3f} ms")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
