"""Score modifiers on one GPU: jaxflash with softcap / a learnable sink vs the same call without,
and cuDNN without (it takes neither through jax), one run; table + JSON.

Shapes as benchmarks/bench_attention.py: bf16, batch * seq = 16384 tokens, heads = 2048 /
head_dim; causal or not (--causal). Implementations: "jaxflash" (plain), "masked" (segment ids
that put every token in one document: the masked variant, which softcap runs on, without
softcap; it separates the masked schedule's cost from the tanh's), "softcap" (--softcap, default
30: the masked variants take it at run time, forward and backward), "sink" (learnable_sink: every
forward variant's epilogue), "cudnn" (jax.nn, plain). TFLOP/s count the plain call's flops for
every column (forward 4 b h s^2 d, halved when causal; forward + backward 3.5x), so columns
compare as time ratios. Timing: that module's time_ms (warm-up, back-to-back calls, median).
--gpt-oss: gpt-oss's shape (windows and sinks). --bias: an additive bias at head_dim 128, batch
4, 16 heads (BIAS_SHAPE), bias (1, H, S, S) and (B, H, S, S) in bf16, jaxflash and cuDNN
(jax.nn.dot_product_attention(bias=...)), and tokamax's Mosaic GPU attention where tokamax
imports, next to each one's plain call; forward + backward differentiates the bias too.
--mods: score_mod / mask_mod at BIAS_SHAPE (MODS_IMPLS): the plain call, an identity
score_mod, ALiBi, T5 buckets, causal and a sliding window as mask_mods next to the built-in
causal mask and window, cuDNN plain and with ALiBi as a (1, H, S, S) bias; forward + backward
differentiates q, k and v. Needs the kernels in JAXFLASH_CACHE_DIR (the mods variants build on
first use where nvidia-cutlass-dsl is installed).
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

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling bench_attention.py
import bench_attention  # noqa: E402
import fa3_binding  # noqa: E402  (bench_attention put devtools/ on the path)

TOKENS, WIDTH = 16384, 2048
SOFTCAP = 30.0  # Grok-1's attention softcap (Gemma 2's is 50: --softcap)
IMPLS = ("jaxflash", "masked", "softcap", "sink", "cudnn")
# gpt-oss's attention: head_dim 64, 64 query heads on 8 kv heads, a causal window of 128 keys
# and one learnable sink per head, next to the same call without window and sinks.
GPT_OSS = dict(head_dim=64, heads=64, kv_heads=8, window=128)
GPT_OSS_IMPLS = ("causal", "window+sink", "window", "cudnn causal", "cudnn window")
# FlashAttention-3's window with the sinks applied outside its kernel (devtools/fa3_binding.py),
# timed where its library is found.
GPT_OSS_FA3 = "fa3 window+sink"
# --bias: batch, heads and head_dim of the bias rows (issue #65's: b4 h16 d128), and the bias
# shapes ("1H": (1, H, S, S), "BH": (B, H, S, S)).
BIAS_SHAPE = dict(batch=4, heads=16, head_dim=128)
BIAS_KINDS = ("1H", "BH")
BIAS_IMPLS = ("jaxflash", "jaxflash bias", "cudnn", "cudnn bias")
# tokamax's Pallas Mosaic GPU attention (tokamax.dot_product_attention(implementation="mosaic"),
# which raises where its kernel does not take a call), timed where tokamax imports.
TOKAMAX_BIAS_IMPLS = ("tokamax", "tokamax bias")
# --mods: the columns (issue #65's targets: identity >= 0.97x plain, ALiBi and T5 >= 0.85x,
# causal and window as mask_mods >= 0.95x the built-in ones), and the window's left size.
MODS_IMPLS = ("jaxflash", "identity", "alibi", "t5", "t5 by distance", "causal",
              "causal mask_mod", "window", "window mask_mod", "cudnn", "cudnn alibi bias")
MODS_WINDOW = 1024
T5_BUCKETS = 32
T5_MAX_DISTANCE = 128


def attend_fn(impl: str, causal: bool, implementation: str = "cute", softcap: float = SOFTCAP):
  """attend(q, k, v, sink) for one implementation (the sink is ignored but by "sink");
  `implementation` is jaxflash's (the CPU tests pass "reference")."""
  if impl == "cudnn":
    return lambda q, k, v, sink: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                              implementation="cudnn")
  options = {"softcap": softcap} if impl == "softcap" else {}
  use_sink = impl == "sink"

  def attend(q, k, v, sink):
    ids = {}
    if impl == "masked":  # one document: the masked variant with every block visible
      ids = dict(q_segment_ids=jnp.zeros(q.shape[:2], jnp.int32),
                 kv_segment_ids=jnp.zeros(k.shape[:2], jnp.int32))
    return jaxflash.attention(q, k, v, causal=causal, learnable_sink=sink if use_sink else None,
                              implementation=implementation, **options, **ids)
  return attend


def fwd_bwd_fn(attend, cotangent):
  """Gradients of sum(out * cotangent) w.r.t. q, k, v and the sink."""
  def loss(q, k, v, sink):
    return jnp.sum((attend(q, k, v, sink) * cotangent).astype(jnp.float32))
  return jax.grad(loss, argnums=(0, 1, 2, 3))


def timed_record(fn, args, flops: float, **fields) -> dict:
  """fields + the median ms of fn(*args) and its TFLOP/s; a failure is noted, not raised, so
  one cell cannot stop the table. Printed as a JSON line as soon as it is measured."""
  rec = dict(fields, ms=None, tflops=None)
  try:
    rec["ms"] = bench_attention.time_ms(fn, *args)
    rec["tflops"] = flops / (rec["ms"] * 1e-3) / 1e12
  except Exception as e:  # report it and keep going
    rec["note"] = bench_attention.failure_note(e)
  print(json.dumps(rec), flush=True)
  return rec


def gpt_oss_fn(impl: str, implementation: str = "cute"):
  """attend(q, k, v, sink) for one of GPT_OSS_IMPLS (cuDNN takes no sink)."""
  window = (GPT_OSS["window"], 0)
  if impl == GPT_OSS_FA3:
    return lambda q, k, v, sink: fa3_binding.attention(q, k, v, causal=True, window_size=window,
                                                       learnable_sink=sink)
  if impl.startswith("cudnn"):
    local = window if impl == "cudnn window" else None
    return lambda q, k, v, sink: jax.nn.dot_product_attention(
        q, k, v, is_causal=True, local_window_size=local, implementation="cudnn")
  options = {} if impl == "causal" else {"window_size": window}
  use_sink = impl == "window+sink"
  return lambda q, k, v, sink: jaxflash.attention(
      q, k, v, causal=True, learnable_sink=sink if use_sink else None,
      implementation=implementation, **options)


def bias_fn(impl: str, causal: bool, implementation: str = "cute"):
  """attend(q, k, v, bias) for one of BIAS_IMPLS (the plain ones ignore the bias);
  `implementation` is jaxflash's (the CPU tests pass "reference")."""
  with_bias = impl.endswith("bias")
  if impl.startswith("tokamax"):
    import tokamax  # a peer column: imported only where it is asked for
    return lambda q, k, v, bias: tokamax.dot_product_attention(
        q, k, v, bias if with_bias else None, is_causal=causal, implementation="mosaic")
  if impl.startswith("cudnn"):
    return lambda q, k, v, bias: jax.nn.dot_product_attention(
        q, k, v, bias if with_bias else None, is_causal=causal, implementation="cudnn")
  return lambda q, k, v, bias: jaxflash.attention(
      q, k, v, causal=causal, bias=bias if with_bias else None, implementation=implementation)


def t5_bucket(rel, num_buckets: int = T5_BUCKETS, max_distance: int = T5_MAX_DISTANCE):
  """T5's bidirectional relative-position bucket of rel = kv_idx - q_idx."""
  half = num_buckets // 2
  exact = half // 2
  a = jnp.abs(rel)
  large = exact + (jnp.log(a.astype(jnp.float32) / exact) / np.log(max_distance / exact)
                   * (half - exact)).astype(jnp.int32)
  return jnp.where(rel > 0, half, 0) + jnp.where(a < exact, a, jnp.minimum(large, half - 1))


def t5_distance_table(table, max_distance: int = T5_MAX_DISTANCE):
  """(heads, 2 max_distance + 1): table's entry for each kv_idx - q_idx in [-max_distance,
  max_distance], beyond which T5's buckets are constant ("t5 by distance" reads it per score
  instead of taking the bucket's log)."""
  rel = jnp.arange(-max_distance, max_distance + 1, dtype=jnp.int32)
  return table[t5_bucket(rel, max_distance=max_distance)].T


def mods_fn(impl: str, slopes, table, implementation: str = "cute"):
  """attend(q, k, v) for one of MODS_IMPLS; slopes (heads,) and table (T5_BUCKETS, heads)
  float32 are what ALiBi and T5 close over; `implementation` is jaxflash's (the CPU tests pass
  "reference")."""
  window = (MODS_WINDOW, 0)
  if impl.startswith("cudnn"):
    def cudnn(q, k, v):
      bias = None
      if impl == "cudnn alibi bias":
        pos = jnp.arange(q.shape[1])
        bias = (slopes[:, None, None] * (pos[None, :] - pos[:, None])[None]).astype(q.dtype)[None]
      return jax.nn.dot_product_attention(q, k, v, bias, implementation="cudnn")
    return cudnn
  if impl == "t5 by distance":
    def by_distance(q, k, v):  # the table's gather is part of every call
      distance = t5_distance_table(table)
      m = T5_MAX_DISTANCE
      return jaxflash.attention(
          q, k, v, implementation=implementation,
          score_mod=lambda s, b, h, i, j: s + distance[h, jnp.clip(j - i, -m, m) + m])
    return by_distance
  options = {
      "jaxflash": {},
      "identity": dict(score_mod=lambda s, b, h, i, j: s),
      "alibi": dict(score_mod=lambda s, b, h, i, j: s + slopes[h] * (j - i).astype(jnp.float32)),
      "t5": dict(score_mod=lambda s, b, h, i, j: s + table[t5_bucket(j - i), h]),
      "causal": dict(causal=True),
      "causal mask_mod": dict(mask_mod=lambda b, h, i, j: j <= i),
      "window": dict(causal=True, window_size=window),
      "window mask_mod": dict(mask_mod=lambda b, h, i, j: (j <= i) & (i - j <= MODS_WINDOW)),
  }[impl]
  return lambda q, k, v: jaxflash.attention(q, k, v, implementation=implementation, **options)


def run_mods(args, rng) -> list:
  """BIAS_SHAPE at each --seq, forward and forward + backward, every MODS_IMPLS column. TFLOP/s
  count the plain call's flops (halved for the causal and window columns' mask only in the
  ratio columns: each masked column is compared with its built-in twin)."""
  b, h, d = BIAS_SHAPE["batch"], BIAS_SHAPE["heads"], BIAS_SHAPE["head_dim"]
  slopes = jnp.asarray(2.0 ** (-8.0 * np.arange(1, h + 1) / h), jnp.float32)
  table = jnp.asarray(rng.standard_normal((T5_BUCKETS, h)), jnp.float32)
  records = []
  for s in args.seq:
    q, k, v = (jnp.asarray(rng.standard_normal((b, s, h, d)), jnp.bfloat16) for _ in range(3))
    ct = jnp.asarray(rng.standard_normal(q.shape), jnp.bfloat16)
    for mode in args.modes:
      flops = bench_attention.fwd_flops(b, h, s, d, d, False) * (1.0 if mode == "fwd" else 3.5)
      for impl in MODS_IMPLS:
        attend = mods_fn(impl, slopes, table)
        if mode == "fwd":
          fn = jax.jit(attend)
        else:
          loss = lambda q, k, v, attend=attend: jnp.sum((attend(q, k, v) * ct).astype(
              jnp.float32))
          fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        records.append(timed_record(fn, (q, k, v), flops, shape="mods", seq=s, mode=mode,
                                    impl=impl))
  pairs = (("identity", "jaxflash"), ("alibi", "jaxflash"), ("t5", "jaxflash"),
           ("t5 by distance", "jaxflash"),
           ("causal mask_mod", "causal"), ("window mask_mod", "window"),
           ("alibi", "cudnn alibi bias"))
  print("| seq | mode | " + " | ".join(f"{i} ms" for i in MODS_IMPLS) + " | "
        + " | ".join(f"{a} / {b_} (speed)" for a, b_ in pairs) + " |")
  for s in args.seq:
    for mode in args.modes:
      row = {r["impl"]: r for r in records if (r["seq"], r["mode"]) == (s, mode)}
      ms = lambda i: row.get(i, {}).get("ms")
      cells = [f"{ms(i):.3f}" if ms(i) else "-" for i in MODS_IMPLS]
      ratios = [f"{ms(b_) / ms(a):.2f}" if ms(a) and ms(b_) else "-" for a, b_ in pairs]
      print(f"| {s} | {mode} | " + " | ".join(cells + ratios) + " |")
  return records


def bias_fwd_bwd_fn(attend, cotangent):
  """Gradients of sum(out * cotangent) w.r.t. q, k, v and the bias."""
  def loss(q, k, v, bias):
    return jnp.sum((attend(q, k, v, bias) * cotangent).astype(jnp.float32))
  return jax.grad(loss, argnums=(0, 1, 2, 3))


def run_bias(args, rng) -> list:
  """BIAS_SHAPE at each --seq, each bias kind, forward and forward + backward; TFLOP/s of the
  plain call's flops, so a column's ratio to another is a time ratio."""
  b, h, d = BIAS_SHAPE["batch"], BIAS_SHAPE["heads"], BIAS_SHAPE["head_dim"]
  with_tokamax = tokamax_found()
  impls = BIAS_IMPLS + (TOKAMAX_BIAS_IMPLS if with_tokamax else ())
  records = []
  for s in args.seq:
    q, k, v = (jnp.asarray(rng.standard_normal((b, s, h, d)), jnp.bfloat16) for _ in range(3))
    ct = jnp.asarray(rng.standard_normal(q.shape), jnp.bfloat16)
    for kind in BIAS_KINDS:
      bias = jnp.asarray(rng.standard_normal(((1 if kind == "1H" else b), h, s, s)),
                         jnp.bfloat16)
      for mode in args.modes:
        flops = bench_attention.fwd_flops(b, h, s, d, d, args.causal)
        flops *= 1.0 if mode == "fwd" else 3.5
        for impl in impls:
          attend = bias_fn(impl, args.causal)
          fn = jax.jit(attend if mode == "fwd" else bias_fwd_bwd_fn(attend, ct))
          records.append(timed_record(fn, (q, k, v, bias), flops, shape="bias", seq=s,
                                      bias=kind, causal=args.causal, mode=mode, impl=impl))
  print("| seq | bias | mode | " + " | ".join(f"{i} ms" for i in impls)
        + " | bias / plain (jaxflash) | jaxflash bias / cudnn bias (speed-up) | jaxflash bias / "
        "tokamax bias (speed-up) |")
  for s in args.seq:
    for kind in BIAS_KINDS:
      for mode in args.modes:
        row = {r["impl"]: r for r in records if (r["seq"], r["bias"], r["mode"]) == (s, kind,
                                                                                      mode)}
        ms = lambda i: row.get(i, {}).get("ms")
        cells = [f"{ms(i):.3f}" if ms(i) else "-" for i in impls]
        ratio = lambda a, b: f"{ms(a) / ms(b):.2f}" if ms(a) and ms(b) else "-"
        print(f"| {s} | {kind} | {mode} | " + " | ".join(cells)
              + f" | {ratio('jaxflash bias', 'jaxflash')} | {ratio('cudnn bias', 'jaxflash bias')}"
              f" | {ratio('tokamax bias', 'jaxflash bias')} |")
  if not with_tokamax:
    print("tokamax: not importable here, no tokamax columns")
  return records


def tokamax_found() -> bool:
  """Whether tokamax imports (its columns are timed only then)."""
  try:
    import tokamax  # noqa: F401
  except ImportError:
    return False
  return True


def kept_pairs(seq: int, window=None) -> int:
  """(query, key) pairs a causal mask (with a left window) keeps in one (batch, head)."""
  if window is None:
    return seq * (seq + 1) // 2
  w = min(window, seq - 1)
  return w * (w + 1) // 2 + (seq - w) * (w + 1)


def inputs(seq: int, heads: int, kv_heads: int, head_dim: int, rng) -> tuple:
  """(q, k, v, sink) of one shape: batch * seq = TOKENS, random bf16 q / k / v and float32 sink
  logits, one per query head."""
  b = TOKENS // seq
  q = jnp.asarray(rng.standard_normal((b, seq, heads, head_dim)), jnp.bfloat16)
  k, v = (jnp.asarray(rng.standard_normal((b, seq, kv_heads, head_dim)), jnp.bfloat16)
          for _ in range(2))
  return q, k, v, jnp.asarray(rng.standard_normal(heads), jnp.float32)


def gpt_oss_inputs(seq: int, rng) -> tuple:
  """(q, k, v, sink) of gpt-oss's shape (GPT_OSS) at seq."""
  return inputs(seq, GPT_OSS["heads"], GPT_OSS["kv_heads"], GPT_OSS["head_dim"], rng)


def run_gpt_oss(args, rng) -> list:
  """gpt-oss's shape at each --seq (batch * seq = 16384 tokens); effective TFLOP/s over the
  pairs each call's mask keeps (forward 4 d per pair, forward + backward 3.5x that)."""
  d, h = GPT_OSS["head_dim"], GPT_OSS["heads"]
  fa3_ok, fa3_where = fa3_binding.availability()
  print(f"FA-3 column: {fa3_where}" if fa3_ok else f"no FA-3 column: {fa3_where}", flush=True)
  if fa3_ok:
    fa3_binding.register()
  impls = GPT_OSS_IMPLS + ((GPT_OSS_FA3,) if fa3_ok else ())
  records = []
  for s in args.seq:
    b = TOKENS // s
    q, k, v, sink = gpt_oss_inputs(s, rng)
    ct = jnp.asarray(rng.standard_normal(q.shape), jnp.bfloat16)
    for mode in args.modes:
      for impl in impls:
        pairs = kept_pairs(s, None if impl.endswith("causal") else GPT_OSS["window"])
        flops = 4.0 * d * pairs * b * h * (1.0 if mode == "fwd" else 3.5)
        attend = gpt_oss_fn(impl)
        fn = jax.jit(attend if mode == "fwd" else fwd_bwd_fn(attend, ct))
        records.append(timed_record(fn, (q, k, v, sink), flops, shape="gpt-oss", seq=s,
                                    mode=mode, impl=impl))
  print("| seq | mode | " + " | ".join(f"{i} ms" for i in impls)
        + " | window+sink / causal (time) |")
  for s in args.seq:
    for mode in args.modes:
      row = {r["impl"]: r for r in records if (r["seq"], r["mode"]) == (s, mode)}
      cells = [f"{row[i]['ms']:.3f}" if row[i].get("ms") else "-" for i in impls]
      ratio = (f"{row['window+sink']['ms'] / row['causal']['ms']:.3f}"
               if row["window+sink"].get("ms") and row["causal"].get("ms") else "-")
      print(f"| {s} | {mode} | " + " | ".join(cells) + f" | {ratio} |")
  return records


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--hdim", type=int, nargs="+", default=[64, 128, 256])
  p.add_argument("--seq", type=int, nargs="+", default=[1024, 4096, 16384])
  p.add_argument("--causal", action="store_true")
  p.add_argument("--softcap", type=float, default=SOFTCAP, help="the softcap column's softcap")
  p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
  p.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
  p.add_argument("--gpt-oss", action="store_true",
                 help="gpt-oss's shape (GPT_OSS) instead of the head_dim grid; --hdim, --causal "
                      "and --impls do not apply")
  p.add_argument("--bias", action="store_true",
                 help="the bias rows (BIAS_SHAPE, BIAS_KINDS) instead of the head_dim grid; "
                      "--hdim and --impls do not apply")
  p.add_argument("--mods", action="store_true",
                 help="the score_mod / mask_mod rows (BIAS_SHAPE, MODS_IMPLS) instead of the "
                      "head_dim grid; --hdim, --causal and --impls do not apply")
  bench_attention.add_run_arguments(p)
  args = p.parse_args(argv)
  bench_attention.spin_up(args.spin_up)
  rng = np.random.default_rng(0)
  if args.gpt_oss:
    records = run_gpt_oss(args, rng)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_modifiers_gpt_oss.json").write_text(json.dumps(records, indent=1))
    return 0
  if args.bias:
    records = run_bias(args, rng)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_modifiers_bias.json").write_text(json.dumps(records, indent=1))
    return 0
  if args.mods:
    records = run_mods(args, rng)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_modifiers_mods.json").write_text(json.dumps(records, indent=1))
    return 0
  records = []
  for d in args.hdim:
    for s in args.seq:
      b, h = TOKENS // s, WIDTH // d
      q, k, v, sink = inputs(s, h, h, d, rng)
      ct = jnp.asarray(rng.standard_normal(q.shape), jnp.bfloat16)
      for mode in args.modes:
        flops = bench_attention.fwd_flops(b, h, s, d, d, args.causal)
        flops *= 1.0 if mode == "fwd" else 3.5
        for impl in args.impls:
          attend = attend_fn(impl, args.causal, softcap=args.softcap)
          fn = jax.jit(attend if mode == "fwd" else fwd_bwd_fn(attend, ct))
          records.append(timed_record(fn, (q, k, v, sink), flops, head_dim=d, seq=s,
                                      causal=args.causal, mode=mode, impl=impl,
                                      softcap=args.softcap if impl == "softcap" else None))
  args.out.mkdir(parents=True, exist_ok=True)
  (args.out / "bench_modifiers.json").write_text(json.dumps(records, indent=1))
  print("| head_dim | seq | mode | " + " | ".join(args.impls)
        + " | masked / plain | softcap / plain | sink / plain |")
  for d in args.hdim:
    for s in args.seq:
      for mode in args.modes:
        row = {r["impl"]: r for r in records
               if (r["head_dim"], r["seq"], r["mode"]) == (d, s, mode)}
        cells = [f"{row[i]['tflops']:.0f}" if row.get(i, {}).get("tflops") else "-"
                 for i in args.impls]
        ratio = lambda i: (f"{row['jaxflash']['ms'] / row[i]['ms']:.2f}"
                           if row.get(i, {}).get("ms") and row.get("jaxflash", {}).get("ms")
                           else "-")
        print(f"| {d} | {s} | {mode} | " + " | ".join(cells)
              + f" | {ratio('masked')} | {ratio('softcap')} | {ratio('sink')} |")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
