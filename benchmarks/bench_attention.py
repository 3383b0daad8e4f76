"""TFLOP/s of jaxflash (CuTe kernels) vs cuDNN vs XLA attention on one GPU; table, JSON, PNG.

Timing (docs/perf-anchors.md): 2 warm-ups, then 7 repetitions of 5 calls dispatched back to back
and blocked on the last; the median per-call time counts. Shapes: batch * seq = 16384 tokens,
heads = 2048 / head_dim. Needs the jaxflash kernels in JAXFLASH_CACHE_DIR (scripts/gpu_check.sh).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jaxflash

TOKENS, WIDTH = 16384, 2048
WARMUPS, REPS, CALLS = 2, 7, 5
IMPLS = ("jaxflash", "cudnn", "xla")
LABELS = {"jaxflash": "jaxflash", "cudnn": "cuDNN", "xla": "XLA"}
# Which head dims have a CuTe backward kernel decides what jaxflash's fwd+bwd column measures.
_BWD_KERNEL_HDIMS = tuple(
    d for d in jaxflash.config.KERNEL_HEAD_DIMS
    if jaxflash.config.kernel_support("bwd", "bfloat16", d, d,
                                      jaxflash.config.AttentionConfig(softmax_scale=1.0))[0])
BWD_NOTE = (f"jaxflash fwd+bwd = CuTe forward + CuTe backward for head_dim {_BWD_KERNEL_HDIMS}, "
            f"pure-JAX reference backward for other head dims")


def attention_fn(impl: str, causal: bool):
  if impl == "jaxflash":
    return lambda q, k, v: jaxflash.attention(q, k, v, causal=causal, implementation="cute")
  return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                      implementation=impl)


def fwd_bwd_fn(attn, cotangent):
  """Gradient of sum(out * cotangent) w.r.t. q, k, v: one forward plus one backward."""
  def loss(q, k, v):
    return jnp.sum((attn(q, k, v) * cotangent).astype(jnp.float32))
  return jax.grad(loss, argnums=(0, 1, 2))


def time_ms(fn, *args) -> float:
  """Median ms per call; CALLS calls per repetition, blocking on the last one only."""
  for _ in range(WARMUPS):
    jax.block_until_ready(fn(*args))
  samples = []
  for _ in range(REPS):
    start = time.perf_counter()
    for _ in range(CALLS):
      result = fn(*args)
    jax.block_until_ready(result)
    samples.append((time.perf_counter() - start) / CALLS * 1e3)
  return statistics.median(samples)


def fwd_flops(batch, heads, seq, head_dim, causal) -> float:
  flops = 4.0 * batch * heads * seq * seq * head_dim
  return flops / 2 if causal else flops


def relative_l2(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def run_cell(head_dim, seq, causal, dtype, modes, impls, xla_max_scores, rng):
  """All (impl, mode) timings of one shape; returns result records."""
  batch, heads = TOKENS // seq, WIDTH // head_dim
  shape = (batch, seq, heads, head_dim)
  q, k, v, ct = (jnp.asarray(rng.standard_normal(shape), dtype) for _ in range(4))
  base = {"head_dim": head_dim, "seq": seq, "causal": causal, "batch": batch, "heads": heads,
          "dtype": jnp.dtype(dtype).name}
  records, outputs = [], {}
  for impl in impls:
    attn = attention_fn(impl, causal)
    for mode in modes:
      rec = dict(base, impl=impl, mode=mode, ms=None, tflops=None, note="")
      records.append(rec)
      if impl == "xla" and batch * heads * seq * seq > xla_max_scores:
        rec["note"] = f"skipped: {batch * heads * seq * seq:.2e} scores > --xla-max-scores"
        continue
      fn = jax.jit(attn if mode == "fwd" else fwd_bwd_fn(attn, ct))
      try:
        if impl in ("jaxflash", "cudnn"):  # out (fwd) or (dq, dk, dv), compared below
          outputs[(impl, mode)] = np.concatenate(
              [np.asarray(x, np.float32).ravel() for x in jax.tree_util.tree_leaves(fn(q, k, v))])
        rec["ms"] = time_ms(fn, q, k, v)
      except Exception as e:  # report it and keep going
        rec["note"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        continue
      flops = fwd_flops(batch, heads, seq, head_dim, causal) * (1.0 if mode == "fwd" else 3.5)
      rec["tflops"] = flops / (rec["ms"] * 1e-3) / 1e12
      if mode != "fwd" and impl == "jaxflash" and head_dim not in _BWD_KERNEL_HDIMS:
        rec["note"] = "bwd = reference"
  for rec in records:
    ours, theirs = (outputs.get((i, rec["mode"])) for i in ("jaxflash", "cudnn"))
    if rec["impl"] == "jaxflash" and ours is not None and theirs is not None:
      rec["rel_l2_vs_cudnn"] = relative_l2(ours, theirs)
  return records


def _fmt(x, digits=0):
  return "-" if x is None else f"{x:.{digits}f}"


def markdown(records, modes, impls) -> str:
  """One row per shape: TFLOP/s per (mode, impl), jaxflash/cuDNN ratios, output error."""
  cols = [(m, i) for m in modes for i in impls]
  head = ["hdim", "seq", "causal"] + [f"{LABELS[i]} {m}" for m, i in cols]
  head += [f"jaxflash/cuDNN {m}" for m in modes] + [f"rel. L2 vs cuDNN {m}" for m in modes]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  cells = {}
  for r in records:
    cells.setdefault((r["head_dim"], r["seq"], r["causal"]), {})[(r["mode"], r["impl"])] = r
  for (d, s, c), row in cells.items():
    vals = [_fmt(row.get(col, {}).get("tflops")) for col in cols]
    for m in modes:
      jf, cu = (row.get((m, i), {}).get("tflops") for i in ("jaxflash", "cudnn"))
      vals.append(_fmt(jf / cu, 2) if jf and cu else "-")
    for m in modes:
      err = row.get((m, "jaxflash"), {}).get("rel_l2_vs_cudnn")
      vals.append("-" if err is None else f"{err:.1e}")
    lines.append("| " + " | ".join([str(d), str(s), "yes" if c else "no"] + vals) + " |")
  return "\n".join(lines)


def plot(records, modes, impls, path: Path) -> str:
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return "matplotlib is not installed: no plot written"
  hdims = sorted({r["head_dim"] for r in records})
  causals = sorted({r["causal"] for r in records})
  fig, axes = plt.subplots(len(causals), len(hdims), figsize=(5 * len(hdims), 4 * len(causals)),
                           squeeze=False)
  for row, causal in enumerate(causals):
    for col, d in enumerate(hdims):
      ax = axes[row][col]
      for color, impl in zip(("tab:red", "tab:blue", "tab:gray"), impls):
        for mode in modes:
          pts = sorted((r["seq"], r["tflops"]) for r in records
                       if r["impl"] == impl and r["mode"] == mode and r["head_dim"] == d
                       and r["causal"] == causal and r["tflops"])
          if pts:
            ax.plot(*zip(*pts), marker="o", linestyle="-" if mode == "fwd" else "--",
                    color=color, label=f"{LABELS[impl]} {mode}")
      seqs = sorted({r["seq"] for r in records})
      ax.set_xscale("log", base=2)
      ax.set_xticks(seqs, [f"{s // 1024}k" if s >= 1024 else str(s) for s in seqs])
      ax.set_title(f"hdim {d}, {'causal' if causal else 'non-causal'}")
      ax.set_xlabel("seq length (batch * seq = 16k)")
      ax.set_ylabel("TFLOP/s")
      ax.grid(alpha=0.3)
      ax.legend(fontsize=7)
  fig.suptitle(f"{jax.devices()[0].device_kind}\n{BWD_NOTE}" if "fwd+bwd" in modes
               else jax.devices()[0].device_kind, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  return f"plot: {path}"


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
  p.add_argument("--hdim", type=int, nargs="+", default=[64, 128, 256])
  p.add_argument("--seq", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
  p.add_argument("--causal", type=int, nargs="+", default=[0, 1], choices=(0, 1))
  only = p.add_mutually_exclusive_group()
  only.add_argument("--fwd-only", action="store_true", help="skip forward+backward")
  only.add_argument("--bwd-only", action="store_true", help="forward+backward only")
  p.add_argument("--skip-xla", action="store_true")
  p.add_argument("--quick", action="store_true", help="seq 1024 and 4096 only")
  p.add_argument("--xla-max-scores", type=float, default=2.0**31,
                 help="skip XLA where batch*heads*seq^2 exceeds this (it materializes scores)")
  p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "bench_out"))
  args = p.parse_args(argv)
  if args.quick:
    args.seq = [1024, 4096]
  modes = ("fwd",) if args.fwd_only else ("fwd+bwd",) if args.bwd_only else ("fwd", "fwd+bwd")
  impls = tuple(i for i in IMPLS if not (args.skip_xla and i == "xla"))
  dtype = jnp.dtype(args.dtype)
  device = jax.devices()[0]
  print(f"device: {device.device_kind}; jax {jax.__version__}; jaxflash {jaxflash.__version__}; "
        f"{args.dtype}; {WARMUPS} warm-ups, median of {REPS} x {CALLS} pipelined calls",
        flush=True)
  rng = np.random.default_rng(0)
  records, start = [], time.perf_counter()
  for d in args.hdim:
    for s in args.seq:
      for c in args.causal:
        cell = run_cell(d, s, bool(c), dtype, modes, impls, args.xla_max_scores, rng)
        records += cell
        summary = ", ".join(f"{r['impl']} {r['mode']} {_fmt(r['tflops'])}" for r in cell)
        print(f"  hdim {d} seq {s} causal {c}: {summary} TFLOP/s "
              f"({time.perf_counter() - start:.0f} s)", flush=True)
  table = markdown(records, modes, impls)
  notes = sorted({f"{r['impl']} {r['mode']} hdim {r['head_dim']} seq {r['seq']}: {r['note']}"
                  for r in records if r["note"].startswith(("skipped", "failed"))})
  print("\n" + table + "\n")
  if "fwd+bwd" in modes:
    print(f"note: {BWD_NOTE}")
  for n in notes:
    print(f"note: {n}")
  args.out.mkdir(parents=True, exist_ok=True)
  meta = {"device": device.device_kind, "jax": jax.__version__, "jaxflash": jaxflash.__version__,
          "dtype": args.dtype, "timing": f"{WARMUPS} warm-ups, median of {REPS} x {CALLS} calls",
          "flops": "fwd 4*b*h*s*s*d (halved if causal); fwd+bwd 3.5x fwd",
          "note": BWD_NOTE, "date": datetime.datetime.now().isoformat(timespec="seconds"),
          "seconds": round(time.perf_counter() - start, 1)}
  (args.out / "bench_attention.json").write_text(
      json.dumps({"meta": meta, "results": records}, indent=1) + "\n")
  (args.out / "bench_attention.md").write_text(table + "\n")
  print(plot(records, modes, impls, args.out / "bench_attention.png"))
  print(f"wrote {args.out}/bench_attention.{{json,md}} in {time.perf_counter() - start:.0f} s")
  return 0


if __name__ == "__main__":
  sys.exit(main())
