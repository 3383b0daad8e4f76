"""What a process pays before its first attention result: import, registration, first call.

Each measurement runs in a fresh interpreter (`--repeats` of them; the median counts), with the
kernels already built (a warm kernel cache or an installed kernel wheel):
- `import jax`, then `import jaxflash` on top of it;
- `jaxflash.ffi.register()`: what a process running a deserialized `jax.export` module calls
  first (it registers the FFI targets and the kernel folders' variants);
- the first call: `jax.jit(jaxflash.attention)` on bf16 inputs (batch 1, seq 1024, 8 heads,
  head_dim 128, causal) until the result is on the host: tracing, the variant's library load,
  XLA's compile and the run; then the second call of the same function, for comparison.
Table + JSON. Needs a GPU and the kernels (JAXFLASH_CACHE_DIR or the kernel wheel).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

_PROBE = r"""
import json, sys, time
t0 = time.perf_counter()
import jax
t1 = time.perf_counter()
import jaxflash
import jaxflash.ffi
t2 = time.perf_counter()
out = {"import jax": t1 - t0, "import jaxflash": t2 - t1}
if sys.argv[1] == "register":
  jax.devices()
  t3 = time.perf_counter()
  jaxflash.ffi.register()
  out["register()"] = time.perf_counter() - t3
  out["variants loaded"] = len(jaxflash.ffi.registered_variants())
else:
  import jax.numpy as jnp
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  q, k, v = (jax.random.normal(key, (1, 1024, 8, 128), jnp.bfloat16) for key in keys)
  jax.block_until_ready((q, k, v))
  f = jax.jit(lambda q, k, v: jaxflash.attention(q, k, v, causal=True))
  t3 = time.perf_counter()
  f(q, k, v).block_until_ready()
  t4 = time.perf_counter()
  f(q, k, v).block_until_ready()
  out["first call"] = t4 - t3
  out["second call"] = time.perf_counter() - t4
  out["variants loaded"] = len(jaxflash.ffi.registered_variants())
print("STARTUP " + json.dumps(out))
"""


def measure(kind: str) -> dict:
  proc = subprocess.run([sys.executable, "-c", _PROBE, kind], capture_output=True, text=True,
                        timeout=600)
  lines = [l for l in proc.stdout.splitlines() if l.startswith("STARTUP ")]
  if proc.returncode != 0 or not lines:
    raise RuntimeError(f"startup probe '{kind}' failed (exit {proc.returncode}):\n"
                       f"{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
  return json.loads(lines[-1][len("STARTUP "):])


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "bench_out"))
  args = p.parse_args(argv)
  if args.repeats < 1:
    p.error(f"--repeats must be >= 1, got {args.repeats}")
  runs = {kind: [measure(kind) for _ in range(args.repeats)] for kind in ("register", "call")}
  rows = []
  for kind, samples in runs.items():
    for name in samples[0]:
      values = [s[name] for s in samples]
      rows.append(dict(process=kind, what=name, median=statistics.median(values),
                       samples=values))
  lines = [f"median of {args.repeats} fresh processes (seconds; 'variants loaded' is a count)",
           "", "| process | what | median |", "|---|---|---|"]
  lines += [f"| {r['process']} | {r['what']} | {r['median']:.3g} |" for r in rows]
  print("\n".join(lines))
  args.out.mkdir(parents=True, exist_ok=True)
  (args.out / "bench_startup.json").write_text(json.dumps(rows, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
