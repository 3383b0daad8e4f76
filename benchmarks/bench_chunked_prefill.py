"""Chunked prefill on one GPU: jaxflash.kv_cache_attention with long chunks vs the prefill kernel.

Each case is (chunk, cache length): `batch` sequences each get `chunk` new tokens at the end of
a cache holding `length` keys (the new ones included), GQA 32 / 8 heads, head_dim 128, causal at
each sequence's offset (query i at position length - chunk + i), in each dtype of `--dtypes`.
The batch keeps 16384 new tokens per call. Columns (TFLOP/s, causal FLOPs: 4 * head_dim * the
visible (query, key) pairs, per head):
  chunked / chunked-p128 / chunked-p256: kv_cache_attention on contiguous caches / pools of
    128- / 256-key pages in a random order, which the routing sends to the chunked-prefill
    variant (the column reports an error if the traced call names another variant);
  chunked-p64: pools of 64-key pages forced onto the chunked variant (split_kv.use_chunked true
    while traced; the routing sends pages smaller than a key block to the split-KV kernel);
  split / split-p64: the same calls on the split-KV decode kernel (split_kv.use_chunked false
    while they are traced): what the chunked path replaces;
  attention: jaxflash.attention(causal=True) on the same keys contiguous (seq_k = length:
    causal aligned bottom-right, the prefill forward kernel): the target's reference;
  cudnn-dense: jax.nn.dot_product_attention(implementation="cudnn") on the same keys, not
    causal (jax.nn aligns causal top-left and its cuDNN path takes no right window), with its
    own dense FLOPs (chunk * length pairs): the cuDNN kernel's rate, not the same work.
The ratio column is chunked / attention. Timing as benchmarks/bench_attention.py (warm-ups,
`--calls` calls back to back, the median of REPS, a case's columns taking turns within each
repetition). Results: OUT/bench_chunked_prefill.json (rewritten after each case) and a
markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp

import jaxflash
from jaxflash import config, split_kv

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benchmark scripts
import bench_attention  # noqa: E402
from bench_decode import paged  # noqa: E402

TOKENS_PER_CALL = 16384


class Case(NamedTuple):
  chunk: int
  length: int
  heads: int = 32
  kv_heads: int = 8
  head_dim: int = 128

  @property
  def batch(self) -> int:
    return max(1, TOKENS_PER_CALL // self.chunk)


CASES = {f"c{c}_{n // 1024}k": Case(c, n) for c in (512, 2048, 4096)
         for n in (8192, 16384, 32768)}
IMPLS = ("chunked", "chunked-p64", "chunked-p128", "chunked-p256", "split", "split-p64",
         "attention", "cudnn-dense")


def causal_flops(case: Case) -> float:
  """4 * head_dim * visible (query, key) pairs of every head and sequence: query i of the
  chunk sees length - chunk + i + 1 keys."""
  c, n = case.chunk, case.length
  pairs = c * (n - c) + c * (c + 1) / 2
  return 4.0 * case.head_dim * pairs * case.heads * case.batch


def dense_flops(case: Case) -> float:
  return 4.0 * case.head_dim * case.chunk * case.length * case.heads * case.batch


def _routed(chunked: bool):
  """trace -> trace() with kv_cache_attention's routing sending every call to the chunked
  (True) or the split-KV (False) kernel."""
  def wrap(trace):
    routing = split_kv.use_chunked
    split_kv.use_chunked = lambda *args, **kwargs: chunked
    try:
      return trace()
    finally:
      split_kv.use_chunked = routing
  return wrap


def _chunked_only(fn, args, dtype, case: Case):
  """fn, after checking that its traced call names the chunked variant."""
  text = fn.lower(*args).as_text()
  key = config.chunked_variant(jnp.dtype(dtype).name, case.head_dim, case.head_dim).key
  if key not in text:
    raise RuntimeError(f"the call did not take the chunked variant {key}")
  return fn


def calls(case: Case, dtype, impls) -> dict:
  """impl -> (jitted fn, args, flops) for the case."""
  b, d = case.batch, case.head_dim
  # On the device: the caches of the 512-token cases hold 2^30 elements each.
  keys = jax.random.split(jax.random.key(1), 3)
  q = jax.random.normal(keys[0], (b, case.chunk, case.heads, d), dtype)
  shape = (b, case.length, case.kv_heads, d)
  k, v = (jax.random.normal(key, shape, dtype) for key in keys[1:])
  lengths = jnp.full((b,), case.length, jnp.int32)
  pools = {}
  for page_size in (64, 128, 256):
    if any(impl.endswith(f"p{page_size}") for impl in impls):
      (k_pool, table), (v_pool, _) = paged(k, page_size, 2), paged(v, page_size, 2)
      pools[page_size] = (k_pool, v_pool, table)
  causal = causal_flops(case)
  out = {}
  for prefix in ("chunked", "split"):
    for suffix, page_size in (("", None), ("-p64", 64), ("-p128", 128), ("-p256", 256)):
      impl = prefix + suffix
      if impl not in impls:
        continue
      wrap = (_routed(False) if prefix == "split" else _routed(True) if page_size == 64
              else lambda trace: trace())
      if page_size is None:
        args = (q, k, v, lengths, None)
      else:
        k_pool, v_pool, table = pools[page_size]
        args = (q, k_pool, v_pool, lengths, table)
      fn = jax.jit(lambda q, k, v, n, t, wrap=wrap: wrap(
          lambda: jaxflash.kv_cache_attention(q, k, v, n, page_table=t)))
      if prefix == "chunked":
        fn = _chunked_only(fn, args, dtype, case)
      out[impl] = (fn, args, causal)
  if "attention" in impls:
    out["attention"] = (jax.jit(lambda q, k, v: jaxflash.attention(q, k, v, causal=True)),
                        (q, k, v), causal)
  if "cudnn-dense" in impls:
    out["cudnn-dense"] = (jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, implementation="cudnn")), (q, k, v), dense_flops(case))
  return out


def _run_case(name, dtype, impls, num_calls) -> list[dict]:
  """One case's columns, timed round-robin (every column once per repetition, the median of
  REPS)."""
  records, ready = [], {}
  case = CASES[name]
  if dtype != jnp.bfloat16:
    name = f"{name} {jnp.dtype(dtype).name}"

  def failed(impl, e):  # a failing column is reported, the rest still run
    records.append({"case": name, "impl": impl, "error": f"{type(e).__name__}: {e}"[:300]})

  try:
    built = calls(case, dtype, impls)
  except Exception as e:  # noqa: BLE001
    failed("setup", e)
    return records
  for impl, (fn, args, flops) in built.items():
    try:
      for _ in range(bench_attention.WARMUPS):
        jax.block_until_ready(fn(*args))
      ready[impl] = (fn, args, flops, [])
    except Exception as e:  # noqa: BLE001
      failed(impl, e)
  for _ in range(bench_attention.REPS):
    for impl, (fn, args, flops, samples) in list(ready.items()):
      try:
        start = time.perf_counter()
        for _ in range(num_calls):
          result = fn(*args)
        jax.block_until_ready(result)
        samples.append((time.perf_counter() - start) / num_calls)
      except Exception as e:  # noqa: BLE001
        failed(impl, e)
        del ready[impl]
  for impl, (_, _, flops, samples) in ready.items():
    seconds = statistics.median(samples)
    records.append({"case": name, "impl": impl, "batch": case.batch, "us": seconds * 1e6,
                    "tflops": flops / seconds / 1e12})
  return records


def markdown(records, impls) -> str:
  cases = list(dict.fromkeys(r["case"] for r in records))
  lines = ["| case | batch | " + " | ".join(impls) + " | chunked / attention |",
           "|---" * (len(impls) + 3) + "|"]
  for name in cases:
    rows = {r["impl"]: r for r in records if r["case"] == name}
    cells = []
    for impl in impls:
      r = rows.get(impl)
      cells.append("" if r is None else "error" if "error" in r
                   else f"{r['tflops']:.0f} ({r['us']:.0f} us)")
    batch = next((r["batch"] for r in rows.values() if "batch" in r), "")
    ratio = ""
    if all("tflops" in rows.get(i, {}) for i in ("chunked", "attention")):
      ratio = f"{rows['chunked']['tflops'] / rows['attention']['tflops']:.2f}"
    lines.append(f"| {name} | {batch} | " + " | ".join(cells) + f" | {ratio} |")
  return "\n".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
  p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
  p.add_argument("--dtypes", nargs="+", default=["bfloat16"], choices=("bfloat16", "float16"))
  p.add_argument("--calls", type=int, default=3, help="calls back to back per repetition")
  bench_attention.add_run_arguments(p)
  args = p.parse_args(argv)
  if args.calls < 1:
    p.error(f"--calls takes an integer >= 1, got {args.calls}")
  bench_attention.spin_up(args.spin_up)
  args.out.mkdir(parents=True, exist_ok=True)
  records = []
  for dtype in args.dtypes:
    for name in args.cases:
      records += _run_case(name, jnp.dtype(dtype), args.impls, args.calls)
      (args.out / "bench_chunked_prefill.json").write_text(json.dumps(records, indent=1))
      print(markdown(records, args.impls).splitlines()[-1], file=sys.stderr, flush=True)
  print(markdown(records, args.impls))
  return 0


if __name__ == "__main__":
  sys.exit(main())
