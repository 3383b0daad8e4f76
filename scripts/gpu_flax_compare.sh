#!/usr/bin/env bash
# The Flax example on one GPU with three attentions: jaxflash, jax.nn cuDNN and jax.nn XLA.
#
# On the GPU host (jax with CUDA, flax, optax, orbax-checkpoint, matplotlib; installs nothing),
# from the repo root, after `scripts/gpu_check.sh build` filled .kcache/ on the build host:
#   scripts/gpu_flax_compare.sh [STEPS] [CONFIG]     # default: 200 small
# Prints tokens/s of each run and the max |difference| of their loss curves. Writes to $OUT
# (default ./gpu_out): flax_<attention>_metrics.json / _loss.png / .log, flax_compare.json,
# flax_compare.png. Checkpoints stay in a temporary directory (hundreds of MB each).
# Exit status: nonzero if any run failed.
set -uo pipefail
cd "$(dirname "$0")/.."
steps="${1:-200}"
config="${2:-small}"
py="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python)}"
export JAXFLASH_CACHE_DIR="$PWD/.kcache"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's jaxflash, not an install
out="${OUT:-$PWD/gpu_out}"
mkdir -p "$out"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

status=0
for attention in jaxflash cudnn xla; do
  echo "=== $attention: $config, $steps steps"
  "$py" -m examples.flax_transformer.main --config "$config" --steps "$steps" \
      --attention "$attention" --workdir "$work/$attention" --no_progress \
      --set checkpoint_every="$steps" 2>&1 | tee "$out/flax_${attention}.log"
  rc=${PIPESTATUS[0]}
  if [ "$rc" -ne 0 ]; then
    echo "=== $attention failed (exit $rc)"
    status=$rc
    continue
  fi
  cp "$work/$attention/metrics.json" "$out/flax_${attention}_metrics.json"
  cp "$work/$attention/loss.png" "$out/flax_${attention}_loss.png"
done

"$py" - "$out" <<'EOF'
"""Compares the runs' tokens/s and loss curves; writes flax_compare.json and flax_compare.png."""
import itertools, json, pathlib, sys
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

out = pathlib.Path(sys.argv[1])
runs = {}
for kind in ("jaxflash", "cudnn", "xla"):
  path = out / f"flax_{kind}_metrics.json"
  if path.exists():
    runs[kind] = json.loads(path.read_text())
summary = {"tokens_per_s": {k: m["tokens_per_s"] for k, m in runs.items()},
           "final_eval_loss": {k: m["eval"][-1][1] for k, m in runs.items() if m["eval"]},
           "max_abs_loss_difference": {}}
for a, b in itertools.combinations(runs, 2):
  la = np.array([l for _, l in runs[a]["train"]])
  lb = np.array([l for _, l in runs[b]["train"]])
  n = min(len(la), len(lb))
  summary["max_abs_loss_difference"][f"{a}-{b}"] = float(np.max(np.abs(la[:n] - lb[:n])))
for kind, rate in summary["tokens_per_s"].items():
  print(f"{kind:9s} {rate or 0:14,.0f} tokens/s   final eval loss "
        f"{summary['final_eval_loss'].get(kind, float('nan')):.4f}")
for pair, diff in summary["max_abs_loss_difference"].items():
  print(f"max |loss difference| {pair}: {diff:.4g}")
(out / "flax_compare.json").write_text(json.dumps(summary, indent=1))
fig, ax = plt.subplots(figsize=(7, 4))
for kind, m in runs.items():
  ax.plot(*zip(*m["train"]), lw=1, label=f"{kind} ({m['tokens_per_s'] or 0:,.0f} tok/s)")
ax.set(xlabel="step", ylabel="train loss (nats/byte)", title="Flax example: attention backends")
ax.legend()
fig.tight_layout()
fig.savefig(out / "flax_compare.png", dpi=100)
EOF
exit $status
