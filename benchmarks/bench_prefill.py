"""Prefill forwards against their bars: each row times jaxflash and the call it is measured
against in the same process, over alternated rounds; table of per-round ratios and the median.

Rows (forward only; bf16 unless FP8; batch * seq = 16384 tokens and heads = 2048 / head_dim as
in bench_attention.py, which also times them):
  d64-1k-causal, d128-1k-causal, d128-1k: dense seq 1k against cuDNN (jax.nn);
  packed8, packed11: bench_masked.py's packed documents (ids as jit arguments) against cuDNN's
    packed layout; packed8-vs-batch: the same call against our dense causal kernel on the
    documents as a batch of 8 x 2048;
  gpt-oss: bench_modifiers.py's gpt-oss shape at 16k (causal window 128 + learnable sinks)
    against cuDNN's window without sinks (jax.nn takes no sinks);
  softcap-d64, softcap-d128: softcap 30, batch 4 x 4096, not causal, against our plain call
    (jax.nn takes no softcap);
  fp8-4k-d64 ... fp8-16k-d256: FP8 e4m3 with per-head descales against cuDNN FP8
    (bench_fp8.py's columns), not causal.
A ratio is the other call's time over jaxflash's: above 1 jaxflash is faster. The bar is the
ratio each row is held to (1.0 against cuDNN, 1.05 at head_dim 128 seq 1k, 0.95 against our
batch, 0.75 / 0.85 for softcap at head_dim 64 / 128). Where FlashAttention-3's library is found
(devtools/fa3_binding.py), the dense, packed and gpt-oss rows also time FA-3's own kernels on the
same inputs (its varlen kernels over the documents' offsets; gpt-oss's sinks applied outside its
kernel) and give FA-3's time over jaxflash's per round and its median. Rounds alternate which
call of a row goes first. Timing: bench_attention.time_ms. Needs the kernels (JAXFLASH_CACHE_DIR
or the kernel wheel; scripts/gpu_check.sh).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benchmarks
import bench_attention  # noqa: E402
import bench_fp8  # noqa: E402
import bench_masked  # noqa: E402
import bench_modifiers  # noqa: E402
import fa3_binding  # noqa: E402  (bench_attention put devtools/ on the path)

TOKENS, WIDTH = bench_attention.TOKENS, bench_attention.WIDTH  # the same shapes
SOFTCAP_SEQ = 4096


class Row(NamedTuple):
  """make(rng) -> ((jaxflash fn, args), (other fn, args)); the ratio is other / jaxflash time.
  fa3() -> FA-3's fn of the same args as jaxflash's, where it has the row's call."""
  bar: float
  versus: str
  make: Callable
  fa3: Optional[Callable] = None


def _fa3_dense(causal: bool):
  return lambda: lambda q, k, v: fa3_binding.attention(q, k, v, causal=causal)


def _fa3_packed(name: str):
  return lambda: bench_masked.cases()[name].impls["fa3"]


def _fa3_gpt_oss():
  window = (bench_modifiers.GPT_OSS["window"], 0)
  return lambda q, k, v, sink: fa3_binding.attention(q, k, v, causal=True, window_size=window,
                                                     learnable_sink=sink)


def _dense(head_dim: int, causal: bool, seq: int = 1024):
  def make(rng):
    shape = (TOKENS // seq, seq, WIDTH // head_dim, head_dim)
    args = tuple(jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for _ in range(3))
    return ((bench_attention.attention_fn("jaxflash", causal, head_dim, head_dim), args),
            (bench_attention.attention_fn("cudnn", causal, head_dim, head_dim), args))
  return make


def _packed(name: str, other: str):
  def make(rng):
    case = bench_masked.cases()[name]
    b, s = case.shape
    q, k, v = (jnp.asarray(rng.standard_normal((b, s, bench_masked.HEADS, bench_masked.HEAD_DIM)),
                           jnp.bfloat16) for _ in range(3))
    args = (q, k, v, case.data)
    return (case.impls["jaxflash"], args), (case.impls[other], args)
  return make


def _gpt_oss(rng):
  args = bench_modifiers.gpt_oss_inputs(TOKENS, rng)
  return ((bench_modifiers.gpt_oss_fn("window+sink"), args),
          (bench_modifiers.gpt_oss_fn("cudnn window"), args))


def _softcap(head_dim: int):
  def make(rng):
    h = WIDTH // head_dim
    args = bench_modifiers.inputs(SOFTCAP_SEQ, h, h, head_dim, rng)
    return ((bench_modifiers.attend_fn("softcap", False), args),
            (bench_modifiers.attend_fn("jaxflash", False), args))
  return make


def _fp8(head_dim: int, seq: int):
  def make(rng):
    calls = bench_fp8.calls(head_dim, seq, False, rng)
    return calls["fp8"], calls["cudnn-fp8"]
  return make


ROWS = {
    "d64-1k-causal": Row(1.0, "cuDNN", _dense(64, True), _fa3_dense(True)),
    "d128-1k-causal": Row(1.05, "cuDNN", _dense(128, True), _fa3_dense(True)),
    "d128-1k": Row(1.05, "cuDNN", _dense(128, False), _fa3_dense(False)),
    "packed8": Row(1.0, "cuDNN packed", _packed("packed8", "cudnn"), _fa3_packed("packed8")),
    "packed8-vs-batch": Row(0.95, "jaxflash batch", _packed("packed8", "jaxflash-batched")),
    "packed11": Row(1.0, "cuDNN packed", _packed("packed11", "cudnn"), _fa3_packed("packed11")),
    "gpt-oss": Row(1.0, "cuDNN window", _gpt_oss, _fa3_gpt_oss),
    "softcap-d64": Row(0.75, "jaxflash plain", _softcap(64)),
    "softcap-d128": Row(0.85, "jaxflash plain", _softcap(128)),
    **{f"fp8-{seq // 1024}k-d{d}": Row(1.0, "cuDNN FP8", _fp8(d, seq))
       for seq in (4096, 16384) for d in (64, 128, 256)},
}


def time_row(ours, other, other_first: bool, fa3=None) -> dict:
  """The calls' median ms, other / ours and (with FA-3's call) fa3 / ours; a failure is noted,
  not raised. other_first reverses the order of the calls."""
  rec = dict(ms=None, other_ms=None, ratio=None)
  order = [("ms", ours), ("other_ms", other)] + ([("fa3_ms", fa3)] if fa3 else [])
  if fa3:
    rec.update(fa3_ms=None, fa3_ratio=None)
  try:
    for key, (fn, args) in order[::-1] if other_first else order:
      rec[key] = bench_attention.time_ms(fn, *args)
    rec["ratio"] = rec["other_ms"] / rec["ms"]
    if fa3:
      rec["fa3_ratio"] = rec["fa3_ms"] / rec["ms"]
  except Exception as e:  # report it and keep going
    rec["note"] = bench_attention.failure_note(e)
  return rec


def _median(values: list) -> Optional[float]:
  done = [x for x in values if x is not None]
  return statistics.median(done) if done else None


def table(records: list, names: list, rounds: int) -> str:
  """Markdown: a row per benchmark row, a column per round, the median and whether the median
  reaches the bar; where FA-3 ran, its ratios per round and their median."""
  fa3 = any("fa3_ratio" in r for r in records)
  head = ["row", "against"] + [f"round {r + 1}" for r in range(rounds)] + ["median", "bar", "met"]
  head += [f"FA-3 round {r + 1}" for r in range(rounds)] + ["FA-3 median"] if fa3 else []
  lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
  fmt = lambda x: "-" if x is None else f"{x:.3f}"
  for name in names:
    rows = [r for r in records if r["row"] == name]
    ratios = [r["ratio"] for r in rows]
    median = _median(ratios)
    bar = ROWS[name].bar
    met = "-" if median is None else ("yes" if median >= bar else "no")
    cells = [name, ROWS[name].versus] + [fmt(x) for x in ratios] + [fmt(median), str(bar), met]
    if fa3:
      theirs = [r.get("fa3_ratio") for r in rows]
      cells += [fmt(x) for x in theirs] + [fmt(_median(theirs))]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
  p.add_argument("--rounds", type=int, default=3, help="times every row this many times")
  p.add_argument("--skip-fa3", action="store_true", help="skip the FlashAttention-3 column")
  bench_attention.add_run_arguments(p)
  args = p.parse_args(argv)
  if args.rounds < 1:
    p.error(f"--rounds: {args.rounds} is not a positive count")
  fa3_ok, fa3_where = (False, "--skip-fa3") if args.skip_fa3 else fa3_binding.availability()
  print(f"FA-3 column: {fa3_where}" if fa3_ok else f"no FA-3 column: {fa3_where}", flush=True)
  if fa3_ok:
    fa3_binding.register()
  bench_attention.spin_up(args.spin_up)
  rng = np.random.default_rng(0)
  calls = {}
  for name in args.rows:
    try:
      (ours, ours_args), (other, other_args) = ROWS[name].make(rng)
      calls[name] = ((jax.jit(ours), ours_args), (jax.jit(other), other_args))
      if fa3_ok and ROWS[name].fa3 is not None:
        calls[name] += ((jax.jit(ROWS[name].fa3()), ours_args),)
    except Exception as e:  # a row that cannot be built is reported in every round
      calls[name] = e
  records = []
  for r in range(args.rounds):
    for name in args.rows:
      built = calls[name]
      if isinstance(built, Exception):
        rec = dict(ms=None, other_ms=None, ratio=None, note=bench_attention.failure_note(built))
      else:
        fa3 = built[2] if len(built) > 2 else None
        rec = time_row(built[0], built[1], other_first=r % 2 == 1, fa3=fa3)
      rec = dict(row=name, round=r + 1, versus=ROWS[name].versus, bar=ROWS[name].bar, **rec)
      records.append(rec)
      print(json.dumps(rec), flush=True)
  args.out.mkdir(parents=True, exist_ok=True)
  (args.out / "bench_prefill.json").write_text(json.dumps(records, indent=1))
  print(table(records, args.rows, args.rounds))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
