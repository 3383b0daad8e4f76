#!/usr/bin/env bash
# The Flax example on one GPU with three attentions: jaxflash, jax.nn cuDNN and jax.nn XLA.
#
# On the GPU host (jax with CUDA, flax, optax, orbax-checkpoint, matplotlib; installs nothing),
# from the repo root, with the kernels carried as scripts/gpu_check.sh takes them (.kcpack/):
#   scripts/gpu_flax_compare.sh [STEPS] [CONFIG]     # default: 200 small
# Trains with each attention and prints tokens/s of each run and the max |difference| of their
# loss curves; then generates from the jaxflash run's checkpoint with each attention's KV-cache
# decoding, and jaxflash's over float8_e4m3fn caches (GEN_BATCH sequences, default 8, of
# GEN_TOKENS new tokens, default 256), and prints their decode tokens/s. Writes to $OUT (default ./gpu_out): flax_<attention>_metrics.json /
# _loss.png / .log, flax_generate_<attention>.log, flax_compare.json, flax_compare.png.
# Checkpoints stay in a temporary directory (hundreds of MB each).
# Exit status: nonzero if any run failed.
set -uo pipefail
cd "$(dirname "$0")/.."
steps="${1:-200}"
config="${2:-small}"
py="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python)}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's jaxflash, not an install
source scripts/kernels_env.sh || exit $?
echo "kernels: $kernels"
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

# Decoding: the jaxflash run's weights with each attention's cache attention, so the rates (and
# the greedy texts) compare the attentions alone.
if [ -d "$work/jaxflash/checkpoints" ]; then
  for attention in jaxflash jaxflash-fp8 cudnn xla; do
    echo "=== generate with $attention"
    "$py" -m examples.flax_transformer.generate --workdir "$work/jaxflash" --config "$config" \
        --attention "$attention" --batch "${GEN_BATCH:-8}" --tokens "${GEN_TOKENS:-256}" \
        2>&1 | tee "$out/flax_generate_${attention}.log" | tail -1
    rc=${PIPESTATUS[0]}
    [ "$rc" -ne 0 ] && { echo "=== generate with $attention failed (exit $rc)"; status=$rc; }
  done
fi

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
# generate.py's last line: "decode: N tokens x batch B in S s, R tokens/s (attention=KIND)".
summary["decode_tokens_per_s"] = {}
texts = {}
for kind in ("jaxflash", "jaxflash-fp8", "cudnn", "xla"):
  path = out / f"flax_generate_{kind}.log"
  if path.exists():
    log = path.read_text()
    rate = [l for l in log.splitlines() if l.startswith("decode:") and "tokens/s" in l]
    if rate:
      summary["decode_tokens_per_s"][kind] = float(
          rate[-1].split(" tokens/s")[0].rsplit(" ", 1)[1].replace(",", ""))
    texts[kind] = log.split("decode:")[0]
for kind, rate in summary["decode_tokens_per_s"].items():
  same = "same text as jaxflash" if texts.get(kind) == texts.get("jaxflash") else (
      "text differs from jaxflash's")
  print(f"decode {kind:12s} {rate:14,.0f} tokens/s   ({same})")
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
