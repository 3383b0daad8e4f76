"""Decoding attention on one GPU: jaxflash.kv_cache_attention vs cuDNN and XLA, one run.

Each case is (batch, seq_q, cache length, query heads / kv heads, head_dim), in each dtype of
`--dtypes` (bf16): the new tokens of every sequence against its cache. Columns:
  jaxflash: kv_cache_attention on contiguous caches (max_len = the longest length);
  paged64 / paged256: the same keys in a pool of 64- / 256-token pages, in a random order;
  fp8 / fp8-paged64 / fp8-paged256: the same three over float8_e4m3fn caches (the keys and
    values quantized with a descale per sequence, or per page, and kv head); their bandwidth
    counts the e4m3 bytes (half the 16-bit ones);
  attention: jaxflash.attention(causal=True) over the whole caches (not for ragged lengths),
    which few-row calls run on the decode kernel (jaxflash/few_rows.py);
  prefill: the same call on the prefill kernel (few_rows.MAX_PACKED_ROWS set to 0 while it is
    traced): what the routing gains;
  nn: jaxflash.dot_product_attention with key_value_seq_lengths, as the cudnn column calls jax.nn
    (seq_q 1 only);
  cudnn / xla: jax.nn.dot_product_attention (implementation "cudnn" / "xla") over the caches
    with key_value_seq_lengths; not causal (jax.nn aligns causal top-left, so a one-token query
    would see key 0 only) unless seq_q > 1, where no jax.nn column is comparable and they are
    left out; they never take softcap or sinks (the softcap_sink case's jax.nn columns are the
    plain call).
  split<N>: kv_cache_attention with num_splits=N on contiguous caches (`--splits N ...`);
  read: XLA's float32 sums of K and V over the whole caches (not for ragged lengths or
    `--layers`), a plain read of the same bytes: what this GPU streams in this run.
Bandwidth = the K and V bytes of the valid keys / time (H200 HBM: 4.8 TB/s). Timing as
benchmarks/bench_attention.py (warm-ups, calls back to back, median of REPS), with a case's
columns taking turns within each repetition, but `--calls` (20) calls per repetition: a
decoding call is short, and the host's latency before the first call reaches the GPU then
weighs on the mean (on the H200, the same program at 8 x 1 x 32k took 179 us per call over 5
calls and 151 us over 20; a generation loop runs in the steady state). `--layers L` makes
each column one program of L calls, each layer with its own copy of the caches (a model's
decoding step: `layered`), and reports the time per call. Results go to
OUT/bench_decode.json (rewritten after each case, with each case's table row on stderr, so a
run cut short keeps what it measured) and a markdown table on stdout.
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
import numpy as np

import jaxflash
from jaxflash import few_rows
from jaxflash.fp8 import quantize_tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling bench_attention.py
import bench_attention  # noqa: E402

HBM_TB_PER_S = 4.8


class Case(NamedTuple):
  batch: int
  seq_q: int
  length: int  # cache length of every sequence, or the longest with `ragged`
  heads: int
  kv_heads: int
  head_dim: int = 128
  ragged: bool = False  # lengths spread over 1..length (numpy default_rng(0))
  softcap_sink: bool = False  # jaxflash columns with softcap 30 and a learnable sink


CASES = {
    "b8_q1_32k_gqa8": Case(8, 1, 32768, 32, 4),
    "b1_q1_128k_gqa4": Case(1, 1, 131072, 32, 8),
    "b64_q1_4k_gqa4": Case(64, 1, 4096, 32, 8),
    "b8_q4_32k_gqa8": Case(8, 4, 32768, 32, 4),
    "ragged32_q1_32k": Case(32, 1, 32768, 32, 4, ragged=True),
    "b8_q1_32k_gqa8_d64": Case(8, 1, 32768, 32, 4, head_dim=64),
    "b8_q1_32k_gqa8_d256": Case(8, 1, 32768, 32, 4, head_dim=256),
    "b8_q1_32k_gqa8_softcap_sink": Case(8, 1, 32768, 32, 4, softcap_sink=True),
    # The bound of the few-row routing: 64 packed rows (8 tokens x 8 heads a group; 64 tokens
    # of one head).
    "b8_q8_8k_gqa8": Case(8, 8, 8192, 32, 4),
    "b4_q64_8k_mha": Case(4, 64, 8192, 16, 16),
    # One layer of the Flax example's small config decoding at batch 64 (6 / 2 heads, d128),
    # at the last step of bench_generate.py's defaults (767 cached positions).
    "b64_q1_767_small": Case(64, 1, 767, 6, 2),
}
IMPLS = ("jaxflash", "paged64", "paged256", "fp8", "fp8-paged64", "fp8-paged256", "attention",
         "prefill", "nn", "cudnn", "xla", "read")
FP8_IMPLS = ("fp8", "fp8-paged64", "fp8-paged256")


def lengths_of(case: Case) -> np.ndarray:
  if case.ragged:
    return np.random.default_rng(0).integers(1, case.length + 1, case.batch).astype(np.int32)
  return np.full(case.batch, case.length, np.int32)


def kv_bytes(case: Case, dtype) -> int:
  """Bytes of K and V of every valid key (dtype: the caches')."""
  per_key = 2 * case.kv_heads * case.head_dim * np.dtype(dtype).itemsize
  return int(lengths_of(case).sum()) * per_key


def paged(cache, page_size: int, seed: int):
  """(pool, page_table) holding `cache`'s rows in pages of page_size, in a random order."""
  b, max_len = cache.shape[:2]
  pages = -(-max_len // page_size)
  padded = jnp.pad(cache, ((0, 0), (0, pages * page_size - max_len), (0, 0), (0, 0)))
  order = np.random.default_rng(seed).permutation(b * pages)
  pool = jnp.zeros((b * pages, page_size) + cache.shape[2:], cache.dtype)
  pool = pool.at[order].set(padded.reshape(b * pages, page_size, *cache.shape[2:]))
  return pool, jnp.asarray(order.reshape(b, pages), jnp.int32)


def _on_prefill(trace):
  """trace() with no call on the decode kernel: the prefill kernel's time of a few-row call."""
  bound, few_rows.MAX_PACKED_ROWS = few_rows.MAX_PACKED_ROWS, 0
  try:
    return trace()
  finally:
    few_rows.MAX_PACKED_ROWS = bound


def calls(case: Case, dtype, impls, splits=(), layers=1) -> dict:
  """impl -> (jitted fn, args) for the case (and split<N> for each N of `splits`). layers > 1:
  each fn is a decoding step of that many attention calls in one program, each with its own
  query and its own copy of the caches (`layered`)."""
  rng = np.random.default_rng(1)
  q = jnp.asarray(rng.standard_normal((case.batch, case.seq_q, case.heads, case.head_dim)),
                  dtype)
  shape = (case.batch, case.length, case.kv_heads, case.head_dim)
  k, v = (jnp.asarray(rng.standard_normal(shape), dtype) for _ in range(2))
  lengths = jnp.asarray(lengths_of(case))
  options = {}
  if case.softcap_sink:
    options = dict(softcap=30.0, learnable_sink=jnp.asarray(rng.standard_normal(case.heads),
                                                            jnp.float32))
  out = {}
  if "jaxflash" in impls:
    out["jaxflash"] = (jax.jit(lambda q, k, v, n: jaxflash.kv_cache_attention(
        q, k, v, n, **options)), (q, k, v, lengths))
  for name, page_size in (("paged64", 64), ("paged256", 256)):
    if name in impls:
      (k_pool, table), (v_pool, _) = paged(k, page_size, 2), paged(v, page_size, 2)
      fn = jax.jit(lambda q, k, v, n, t: jaxflash.kv_cache_attention(q, k, v, n, page_table=t,
                                                                     **options))
      out[name] = (fn, (q, k_pool, v_pool, lengths, table))
  for name, page_size in (("fp8", None), ("fp8-paged64", 64), ("fp8-paged256", 256)):
    if name in impls:
      (k_pool, table), (v_pool, _) = ((paged(x, page_size, 2) for x in (k, v)) if page_size
                                      else ((k, None), (v, None)))
      # A descale per (row, kv head): a contiguous cache's sequence or a pool's page.
      (k8, kd), (v8, vd) = quantize_tensor(k_pool), quantize_tensor(v_pool)
      fn = jax.jit(lambda q, k, v, n, t, kd, vd: jaxflash.kv_cache_attention(
          q, k, v, n, page_table=t, k_descale=kd, v_descale=vd, **options))
      out[name] = (fn, (q, k8, v8, lengths, table, kd, vd))
  if "attention" in impls and not case.ragged:
    out["attention"] = (jax.jit(lambda q, k, v: jaxflash.attention(q, k, v, causal=True,
                                                                    **options)), (q, k, v))
  if "prefill" in impls and not case.ragged:
    out["prefill"] = (jax.jit(lambda q, k, v: _on_prefill(lambda: jaxflash.attention(
        q, k, v, causal=True, **options))), (q, k, v))
  if case.seq_q == 1 and "nn" in impls:
    out["nn"] = (jax.jit(lambda q, k, v, n: jaxflash.dot_product_attention(
        q, k, v, key_value_seq_lengths=n)), (q, k, v, lengths))
  for n in splits:
    out[f"split{n}"] = (jax.jit(lambda q, k, v, lengths, n=n: jaxflash.kv_cache_attention(
        q, k, v, lengths, num_splits=n, **options)), (q, k, v, lengths))
  if case.seq_q == 1:
    for impl in ("cudnn", "xla"):
      if impl in impls:
        fn = jax.jit(lambda q, k, v, n, impl=impl: jax.nn.dot_product_attention(
            q, k, v, key_value_seq_lengths=n, implementation=impl))
        out[impl] = (fn, (q, k, v, lengths))
  if "read" in impls and not case.ragged and layers == 1:
    out["read"] = (jax.jit(lambda k, v: (jnp.sum(k, dtype=jnp.float32),
                                         jnp.sum(v, dtype=jnp.float32))), (k, v))
  if layers > 1:
    queries = [q] + [jnp.asarray(rng.standard_normal(q.shape), dtype) for _ in range(layers - 1)]
    copies = {}  # one copy of each cache per layer, shared by the columns
    out = {impl: layered(fn, args, queries, copies) for impl, (fn, args) in out.items()}
  return out


def layered(fn, args, queries, copies: dict):
  """(fn, args) -> (step, step_args): one program of a call of fn per layer, layer l with the
  query queries[l] (in place of args[0]) and its own copy of each float array of args (the
  caches; integer lengths and page tables are shared), returning every output: the per-call
  time of a model's decoding step, whose layers are one executable with a cache each (with
  one cache XLA would fuse the layers' jax.nn attentions into one read of it). `copies` maps
  id(array) to its per-layer copies, so columns over the same caches share them."""
  def copied(a):
    if a is None or not jnp.issubdtype(a.dtype, jnp.floating):  # no table, lengths, tables
      return [a] * len(queries)
    if id(a) not in copies:
      copies[id(a)] = [a] + [jnp.array(a, copy=True) for _ in queries[1:]]
    return copies[id(a)]

  rest = [copied(a) for a in args[1:]]
  layer_args = tuple((q,) + tuple(r[l] for r in rest) for l, q in enumerate(queries))
  step = jax.jit(lambda per_layer: tuple(fn(*a) for a in per_layer))
  return step, (layer_args,)


def run(case_names, dtypes, impls, splits=(), num_calls=20, layers=1,
        on_case=None) -> list[dict]:
  """Every case's records; on_case(records so far), if given, after each case (main writes
  them out then, so a run cut short keeps the cases it finished)."""
  records = []
  for dtype in dtypes:
    for name in case_names:
      records += _run_case(name, dtype, impls, splits, num_calls, layers)
      if on_case is not None:
        on_case(records)
  return records


def _run_case(name, dtype, impls, splits, num_calls, layers=1) -> list[dict]:
  """One case's columns, timed round-robin (every column once per repetition, the median of
  REPS), so a drift of the GPU's clock during the case reaches every column alike."""
  records, ready = [], {}
  case = CASES[name]
  moved = kv_bytes(case, dtype)
  if dtype != jnp.bfloat16:
    name = f"{name} {jnp.dtype(dtype).name}"

  def failed(impl, e):  # a failing column is reported, the rest still run
    records.append({"case": name, "impl": impl, "error": f"{type(e).__name__}: {e}"[:300]})

  for impl, (fn, args) in calls(case, dtype, impls, splits, layers).items():
    try:
      for _ in range(bench_attention.WARMUPS):
        jax.block_until_ready(fn(*args))
      ready[impl] = (fn, args, [])
    except Exception as e:  # noqa: BLE001
      failed(impl, e)
  for _ in range(bench_attention.REPS):
    for impl, (fn, args, samples) in list(ready.items()):
      try:
        start = time.perf_counter()
        for _ in range(num_calls):
          result = fn(*args)
        jax.block_until_ready(result)
        samples.append((time.perf_counter() - start) / (num_calls * layers))
      except Exception as e:  # noqa: BLE001
        failed(impl, e)
        del ready[impl]
  for impl, (_, _, samples) in ready.items():
    seconds = statistics.median(samples)
    read = kv_bytes(case, jnp.float8_e4m3fn) if impl in FP8_IMPLS else moved
    records.append({"case": name, "impl": impl, "us": seconds * 1e6,
                    "tb_per_s": read / seconds / 1e12,
                    "hbm_limit_us": moved / (HBM_TB_PER_S * 1e12) * 1e6})
  return records


def markdown(records, impls) -> str:
  cases = list(dict.fromkeys(r["case"] for r in records))
  lines = ["| case | HBM limit | " + " | ".join(impls) + " |",
           "|---" * (len(impls) + 2) + "|"]
  for name in cases:
    cells, limit = [], ""
    for impl in impls:
      r = next((r for r in records if r["case"] == name and r["impl"] == impl), None)
      if r is None:
        cells.append("")
      elif "error" in r:
        cells.append("error")
      else:
        cells.append(f"{r['us']:.0f} us ({r['tb_per_s']:.2f} TB/s)")
        limit = f"{r['hbm_limit_us']:.0f} us"
    lines.append(f"| {name} | {limit} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
  p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
  p.add_argument("--dtypes", nargs="+", default=["bfloat16"], choices=("bfloat16", "float16"))
  p.add_argument("--splits", nargs="*", type=int, default=[], metavar="N",
                 help="also time kv_cache_attention with num_splits=N (columns split<N>)")
  p.add_argument("--calls", type=int, default=20, help="calls back to back per repetition")
  p.add_argument("--layers", type=int, default=1,
                 help="attention calls per program (a model's decoding step of this many "
                      "layers); times are per attention call")
  bench_attention.add_run_arguments(p)
  args = p.parse_args(argv)
  bench_attention.spin_up(args.spin_up)
  if args.calls < 1 or args.layers < 1 or any(n < 1 for n in args.splits):
    p.error(f"--calls, --layers and --splits take integers >= 1, got {args.calls}, "
            f"{args.layers} and {args.splits}")
  args.out.mkdir(parents=True, exist_ok=True)
  columns = list(args.impls) + [f"split{n}" for n in args.splits]

  def finished(records):  # the JSON and the table so far, after each case
    (args.out / "bench_decode.json").write_text(json.dumps(records, indent=1))
    print(markdown(records, columns).splitlines()[-1], file=sys.stderr, flush=True)

  records = run(args.cases, [jnp.dtype(d) for d in args.dtypes], args.impls, args.splits,
                args.calls, args.layers, on_case=finished)
  print(markdown(records, columns))
  return 0


if __name__ == "__main__":
  sys.exit(main())
