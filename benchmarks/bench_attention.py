"""TFLOP/s of jaxflash (CuTe kernels) vs FlashAttention-3 vs cuDNN vs XLA attention on one GPU;
table, JSON, PNG.

Timing: 2 warm-ups, then 7 repetitions of 5 calls dispatched back to back
and blocked on the last; the median per-call time counts. Before the first cell, --spin-up
seconds of matmuls bring the GPU clock up from idle. Shapes: batch * seq = 16384 tokens,
heads = 2048 / head_dim. Needs the jaxflash kernels in JAXFLASH_CACHE_DIR (scripts/gpu_check.sh).
--hdim takes head dims (64) or head_dim x head_dim_v pairs (192x128, the DeepSeek MLA shape).
Flops: forward 2*b*h*s^2*(d + dv) (= 4*b*h*s^2*d when dv == d), halved if causal; forward +
backward 2*b*h*s^2*(4d + 3dv) (3.5x the forward when dv == d), halved if causal.
Forward+backward rows also time jaxflash with deterministic=True ("jaxflash det.", --skip-det
leaves it out) and give its ratio to the default backward. --heads / --q-per-kv set the query
heads and how many share a kv head (GQA). FA-3 = FlashAttention-3's own Hopper kernels through
devtools/fa3_binding.py, where its library is found (JAXFLASH_FA3_LIBRARY); the run says why
the column is missing otherwise.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "devtools"))
import fa3_binding  # noqa: E402

TOKENS, WIDTH = 16384, 2048
WARMUPS, REPS, CALLS = 2, 7, 5
IMPLS = ("jaxflash", "jaxflash-det", "fa3", "cudnn", "xla")
LABELS = {"jaxflash": "jaxflash", "jaxflash-det": "jaxflash det.", "fa3": "FA-3", "cudnn": "cuDNN",
          "xla": "XLA"}
# jaxflash-det = deterministic=True: only its backward differs, so it is timed in fwd+bwd only.
FWD_BWD_ONLY = ("jaxflash-det",)
# Which head dims have a CuTe backward kernel decides what jaxflash's fwd+bwd column measures.
_BWD_KERNEL_HDIMS = tuple(
    (d, dv) for d, dv in jaxflash.config.KERNEL_HEAD_DIM_PAIRS["fwd"]
    if jaxflash.config.kernel_support("bwd", "bfloat16", d, dv)[0])
BWD_NOTE = (f"jaxflash fwd+bwd = CuTe forward + CuTe backward for head_dim "
            f"{tuple(d for d, _ in _BWD_KERNEL_HDIMS)} (= head_dim_v), pure-JAX reference "
            f"backward for other head dims")
# jax.nn.dot_product_attention wants v's head dim equal to q/k's. With head_dim_v != head_dim,
# cuDNN runs through jax's own cuDNN entry point, which passes a smaller v head dim to cuDNN
# (its MLA support: cuDNN >= 9.10 on Hopper); XLA gets v zero-padded to head_dim (the output
# sliced back), so its column pays for the padded P V product.
DV_NOTES = {"cudnn": "head_dim_v != head_dim: jax._src.cudnn dot_product_attention (jax.nn "
                     "needs equal head dims)",
            "xla": "head_dim_v != head_dim: v zero-padded to head_dim (jax.nn needs equal "
                   "head dims); flops counted unpadded"}


def parse_hdim(text: str) -> tuple[int, int]:
  """'128' -> (128, 128); '192x128' -> (192, 128): head_dim [x head_dim_v]."""
  d, sep, dv = text.partition("x")
  try:
    pair = (int(d), int(dv) if sep else int(d))
  except ValueError:
    raise argparse.ArgumentTypeError(
        f"--hdim: {text!r} is not D or DxDV (e.g. 128, 192x128)") from None
  if min(pair) <= 0:
    raise argparse.ArgumentTypeError(f"--hdim: {text!r} needs positive head dims")
  return pair


def hdim_label(head_dim: int, head_dim_v: int) -> str:
  return str(head_dim) if head_dim == head_dim_v else f"{head_dim}x{head_dim_v}"


def attention_fn(impl: str, causal: bool, head_dim: int, head_dim_v: int):
  if impl in ("jaxflash", "jaxflash-det"):
    return lambda q, k, v: jaxflash.attention(q, k, v, causal=causal, implementation="cute",
                                              deterministic=impl == "jaxflash-det")
  if impl == "fa3":
    if head_dim_v != head_dim:
      raise ValueError(f"FA-3's targets take head_dim_v = head_dim, not {head_dim_v} != "
                       f"{head_dim}")
    return lambda q, k, v: fa3_binding.attention(q, k, v, causal=causal)
  if head_dim_v != head_dim and impl == "cudnn":
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention
    mask = cudnn_attention.MaskType.CAUSAL if causal else cudnn_attention.MaskType.NO_MASK
    return lambda q, k, v: cudnn_attention.dot_product_attention(
        q, k, v, scale=head_dim ** -0.5, mask_type=mask, qkv_layout="BTNH")
  if head_dim_v != head_dim:
    def padded(q, k, v):
      v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, head_dim - head_dim_v)))
      out = jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=impl)
      return out[..., :head_dim_v]
    return padded
  return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                      implementation=impl)


def fwd_bwd_fn(attn, cotangent):
  """Gradient of sum(out * cotangent) w.r.t. q, k, v: one forward plus one backward."""
  def loss(q, k, v):
    return jnp.sum((attn(q, k, v) * cotangent).astype(jnp.float32))
  return jax.grad(loss, argnums=(0, 1, 2))


def spin_up(seconds: float, size: int = 8192) -> int:
  """Runs bf16 matmuls for `seconds` before the first timed cell; returns how many ran.

  An idle GPU starts at a low clock (nvidia-smi read 345 MHz at the start of a device call):
  the first cells of a run then measure the clock ramp, not the kernels. 0 skips it.
  """
  if seconds <= 0:
    return 0
  a = jnp.ones((size, size), jnp.bfloat16)
  matmul = jax.jit(lambda x: x @ x)
  jax.block_until_ready(matmul(a))  # compile outside the timed loop
  runs, start = 0, time.perf_counter()
  while time.perf_counter() - start < seconds:
    jax.block_until_ready(matmul(a))
    runs += 1
  return runs


def _non_negative(text: str) -> float:
  value = float(text)
  if not value >= 0:  # also rejects nan
    raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {text!r}")
  return value


def failure_note(e: Exception) -> str:
  """A result's note for a cell that raised: the exception's type and first line (200 chars)."""
  return f"failed: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"


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


def fwd_flops(batch, heads, seq, head_dim, head_dim_v, causal) -> float:
  """Q K^T (2 s^2 d) + P V (2 s^2 dv) per (batch, head)."""
  flops = 2.0 * batch * heads * seq * seq * (head_dim + head_dim_v)
  return flops / 2 if causal else flops


def fwd_bwd_flops(batch, heads, seq, head_dim, head_dim_v, causal) -> float:
  """Forward plus backward: Q K^T, dQ, dK in d (3 GEMMs), dO V^T and dV in dv (2)."""
  bwd = 2.0 * batch * heads * seq * seq * (3 * head_dim + 2 * head_dim_v)
  return fwd_flops(batch, heads, seq, head_dim, head_dim_v, causal) + (bwd / 2 if causal else bwd)


def relative_l2(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def run_cell(head_dim, head_dim_v, seq, causal, dtype, modes, impls, xla_max_scores, rng,
             heads=None, q_per_kv=1):
  """All (impl, mode) timings of one shape (heads: query heads, default WIDTH // head_dim;
  q_per_kv of them share a kv head); returns result records."""
  batch, heads = TOKENS // seq, heads or WIDTH // head_dim
  kv_heads = heads // q_per_kv
  shape, shape_v = (batch, seq, heads, head_dim), (batch, seq, heads, head_dim_v)
  q, ct = (jnp.asarray(rng.standard_normal(s), dtype) for s in (shape, shape_v))
  k, v = (jnp.asarray(rng.standard_normal(s[:2] + (kv_heads, s[3])), dtype)
          for s in (shape, shape_v))
  base = {"head_dim": head_dim, "head_dim_v": head_dim_v, "seq": seq, "causal": causal,
          "batch": batch, "heads": heads, "kv_heads": kv_heads, "dtype": jnp.dtype(dtype).name}
  records, outputs = [], {}
  for impl in impls:
    try:
      attn = attention_fn(impl, causal, head_dim, head_dim_v)
    except ValueError as e:  # an implementation without this shape
      records += [dict(base, impl=impl, mode=m, ms=None, tflops=None, note=f"skipped: {e}")
                  for m in modes if not (m == "fwd" and impl in FWD_BWD_ONLY)]
      continue
    for mode in modes:
      if mode == "fwd" and impl in FWD_BWD_ONLY:
        continue
      rec = dict(base, impl=impl, mode=mode, ms=None, tflops=None,
                 note=DV_NOTES.get(impl, "") if head_dim_v != head_dim else "")
      records.append(rec)
      if impl == "xla" and batch * heads * seq * seq > xla_max_scores:
        rec["note"] = f"skipped: {batch * heads * seq * seq:.2e} scores > --xla-max-scores"
        continue
      fn = jax.jit(attn if mode == "fwd" else fwd_bwd_fn(attn, ct))
      try:
        if impl != "xla":  # out (fwd) or (dq, dk, dv), compared with cuDNN's below
          outputs[(impl, mode)] = np.concatenate(
              [np.asarray(x, np.float32).ravel() for x in jax.tree_util.tree_leaves(fn(q, k, v))])
        rec["ms"] = time_ms(fn, q, k, v)
      except Exception as e:  # report it and keep going
        rec["note"] = failure_note(e)
        continue
      count = fwd_flops if mode == "fwd" else fwd_bwd_flops
      flops = count(batch, heads, seq, head_dim, head_dim_v, causal)
      rec["tflops"] = flops / (rec["ms"] * 1e-3) / 1e12
      if (mode != "fwd" and impl.startswith("jaxflash")
          and (head_dim, head_dim_v) not in _BWD_KERNEL_HDIMS):
        rec["note"] = "bwd = reference"
  for rec in records:
    ours, theirs = (outputs.get((i, rec["mode"])) for i in (rec["impl"], "cudnn"))
    if rec["impl"].startswith("jaxflash") and ours is not None and theirs is not None:
      rec["rel_l2_vs_cudnn"] = relative_l2(ours, theirs)
  return records


def _fmt(x, digits=0):
  return "-" if x is None else f"{x:.{digits}f}"


def markdown(records, modes, impls) -> str:
  """One row per shape: TFLOP/s per (mode, impl), jaxflash/cuDNN ratios, output error."""
  cols = [(m, i) for m in modes for i in impls if not (m == "fwd" and i in FWD_BWD_ONLY)]
  det = "fwd+bwd" in modes and "jaxflash-det" in impls
  head = ["hdim", "seq", "causal"] + [f"{LABELS[i]} {m}" for m, i in cols]
  fa3 = "fa3" in impls
  head += [f"jaxflash/cuDNN {m}" for m in modes] + [f"jaxflash/FA-3 {m}" for m in modes] * fa3
  head += ["det./default fwd+bwd"] * det
  head += [f"rel. L2 vs cuDNN {m}" for m in modes]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  cells = {}
  for r in records:
    key = (hdim_label(r["head_dim"], r["head_dim_v"]), r["seq"], r["causal"])
    cells.setdefault(key, {})[(r["mode"], r["impl"])] = r
  for (d, s, c), row in cells.items():
    vals = [_fmt(row.get(col, {}).get("tflops")) for col in cols]
    for other in ("cudnn", "fa3") if fa3 else ("cudnn",):
      for m in modes:
        jf, them = (row.get((m, i), {}).get("tflops") for i in ("jaxflash", other))
        vals.append(_fmt(jf / them, 2) if jf and them else "-")
    if det:
      jd, jf = (row.get(("fwd+bwd", i), {}).get("tflops") for i in ("jaxflash-det", "jaxflash"))
      vals.append(_fmt(jd / jf, 2) if jd and jf else "-")
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
  hdims = sorted({(r["head_dim"], r["head_dim_v"]) for r in records})
  causals = sorted({r["causal"] for r in records})
  fig, axes = plt.subplots(len(causals), len(hdims), figsize=(5 * len(hdims), 4 * len(causals)),
                           squeeze=False)
  for row, causal in enumerate(causals):
    for col, d in enumerate(hdims):
      ax = axes[row][col]
      for color, impl in zip(("tab:red", "tab:orange", "tab:green", "tab:blue", "tab:gray"),
                             impls):
        for mode in modes:
          pts = sorted((r["seq"], r["tflops"]) for r in records
                       if r["impl"] == impl and r["mode"] == mode
                       and (r["head_dim"], r["head_dim_v"]) == d and r["causal"] == causal
                       and r["tflops"])
          if pts:
            ax.plot(*zip(*pts), marker="o", linestyle="-" if mode == "fwd" else "--",
                    color=color, label=f"{LABELS[impl]} {mode}")
      seqs = sorted({r["seq"] for r in records})
      ax.set_xscale("log", base=2)
      ax.set_xticks(seqs, [f"{s // 1024}k" if s >= 1024 else str(s) for s in seqs])
      ax.set_title(f"hdim {hdim_label(*d)}, {'causal' if causal else 'non-causal'}")
      ax.set_xlabel("seq length (batch * seq = 16k)")
      ax.set_ylabel("TFLOP/s")
      ax.grid(alpha=0.3)
      ax.legend(fontsize=7)
  fig.suptitle(f"{jax.devices()[0].device_kind}\n{BWD_NOTE}" if "fwd+bwd" in modes
               else jax.devices()[0].device_kind, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  return f"plot: {path}"


def add_run_arguments(p: argparse.ArgumentParser) -> None:
  """--spin-up and --out, which every benchmark script of this folder takes."""
  p.add_argument("--spin-up", type=_non_negative, default=5.0, metavar="SECONDS",
                 help="bf16 matmuls before the first cell so the GPU clock has ramped up "
                      "(0: none)")
  p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "bench_out"))


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
  p.add_argument("--hdim", type=parse_hdim, nargs="+", default=[(64, 64), (128, 128), (256, 256)],
                 help="head dims: D (head_dim_v = D) or DxDV, e.g. 64 96 192 192x128")
  p.add_argument("--seq", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
  p.add_argument("--causal", type=int, nargs="+", default=[0, 1], choices=(0, 1))
  only = p.add_mutually_exclusive_group()
  only.add_argument("--fwd-only", action="store_true", help="skip forward+backward")
  only.add_argument("--bwd-only", action="store_true", help="forward+backward only")
  p.add_argument("--heads", type=int, default=None,
                 help="query heads (default 2048 / head_dim)")
  p.add_argument("--q-per-kv", type=int, default=1,
                 help="query heads per kv head (GQA; must divide the query heads)")
  p.add_argument("--skip-xla", action="store_true")
  p.add_argument("--skip-fa3", action="store_true", help="skip the FlashAttention-3 column")
  p.add_argument("--skip-det", action="store_true",
                 help="skip the deterministic-backward jaxflash column (fwd+bwd)")
  p.add_argument("--quick", action="store_true", help="seq 1024 and 4096 only")
  p.add_argument("--xla-max-scores", type=float, default=2.0**31,
                 help="skip XLA where batch*heads*seq^2 exceeds this (it materializes scores)")
  add_run_arguments(p)
  args = p.parse_args(argv)
  if args.quick:
    args.seq = [1024, 4096]
  for d, _ in args.hdim:
    heads = args.heads or WIDTH // d
    if args.q_per_kv < 1 or heads % args.q_per_kv:
      p.error(f"--q-per-kv: {args.q_per_kv} does not divide the {heads} query heads of head_dim "
              f"{d}")
  modes = ("fwd",) if args.fwd_only else ("fwd+bwd",) if args.bwd_only else ("fwd", "fwd+bwd")
  fa3_ok, fa3_where = (False, "--skip-fa3") if args.skip_fa3 else fa3_binding.availability()
  impls = tuple(i for i in IMPLS if not (args.skip_xla and i == "xla")
                and not ((args.skip_det or args.fwd_only) and i == "jaxflash-det")
                and not (i == "fa3" and not fa3_ok))
  if fa3_ok:
    fa3_binding.register()
  dtype = jnp.dtype(args.dtype)
  device = jax.devices()[0]
  print(f"device: {device.device_kind}; jax {jax.__version__}; jaxflash {jaxflash.__version__}; "
        f"{args.dtype}; {WARMUPS} warm-ups, median of {REPS} x {CALLS} pipelined calls",
        flush=True)
  print(f"FA-3 column: {fa3_where}" if fa3_ok else f"no FA-3 column: {fa3_where}", flush=True)
  runs = spin_up(args.spin_up)
  if runs:
    print(f"spin-up: {runs} matmuls in {args.spin_up:g} s before the first cell", flush=True)
  rng = np.random.default_rng(0)
  records, start = [], time.perf_counter()
  for d, dv in args.hdim:
    for s in args.seq:
      for c in args.causal:
        cell = run_cell(d, dv, s, bool(c), dtype, modes, impls, args.xla_max_scores, rng,
                        args.heads, args.q_per_kv)
        records += cell
        summary = ", ".join(f"{r['impl']} {r['mode']} {_fmt(r['tflops'])}" for r in cell)
        print(f"  hdim {hdim_label(d, dv)} seq {s} causal {c}: {summary} TFLOP/s "
              f"({time.perf_counter() - start:.0f} s)", flush=True)
  table = markdown(records, modes, impls)
  notes = sorted({f"{r['impl']} {r['mode']} hdim {hdim_label(r['head_dim'], r['head_dim_v'])} "
                  f"seq {r['seq']}: {r['note']}"
                  for r in records if r["note"].startswith(("skipped", "failed"))})
  notes += sorted({f"{LABELS[r['impl']]} hdim {hdim_label(r['head_dim'], r['head_dim_v'])}: "
                   f"{DV_NOTES[r['impl']]}" for r in records
                   if r["head_dim_v"] != r["head_dim"] and r["impl"] in DV_NOTES})
  print("\n" + table + "\n")
  if "fwd+bwd" in modes:
    print(f"note: {BWD_NOTE}")
  for n in notes:
    print(f"note: {n}")
  args.out.mkdir(parents=True, exist_ok=True)
  meta = {"device": device.device_kind, "jax": jax.__version__, "jaxflash": jaxflash.__version__,
          "dtype": args.dtype, "timing": f"{WARMUPS} warm-ups, median of {REPS} x {CALLS} calls",
          "flops": "fwd 2*b*h*s*s*(d+dv), fwd+bwd 2*b*h*s*s*(4d+3dv); halved if causal",
          "note": BWD_NOTE, "fa3": fa3_where,
          "date": datetime.datetime.now().isoformat(timespec="seconds"),
          "seconds": round(time.perf_counter() - start, 1)}
  (args.out / "bench_attention.json").write_text(
      json.dumps({"meta": meta, "results": records}, indent=1) + "\n")
  (args.out / "bench_attention.md").write_text(table + "\n")
  print(plot(records, modes, impls, args.out / "bench_attention.png"))
  print(f"wrote {args.out}/bench_attention.{{json,md}} in {time.perf_counter() - start:.0f} s")
  return 0


if __name__ == "__main__":
  sys.exit(main())
