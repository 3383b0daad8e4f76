#!/usr/bin/env bash
# GPU checks of jaxflash against prebuilt kernels: a kernel wheel in .kcpack/ (git-ignored), or
# a kernel cache folder in .kcache/ (or packed as .kcpack/kcache.tar.xz).
#
# On the build host (nvidia-cutlass-dsl, g++, CUDA headers; no GPU needed), from the repo root:
#   scripts/gpu_check.sh wheel          # the kernel wheel of every shipped variant into .kcpack/
#                                       #   (built through .kcache; carry .kcpack, ~26 MiB)
#   scripts/gpu_check.sh build          # = python -m jaxflash.build --all --cache-dir .kcache,
#                                       #   then packs the libraries into .kcpack/kcache.tar.xz
# On the GPU host (jax with CUDA + pytest + pytest-xdist; installs nothing from the network),
# from the repo root. A wheel in .kcpack/ is pip-installed into .kwheel/ and used with no cache
# folder at all (JAXFLASH_CACHE_DIR unset, an empty HOME); else .kcache/ is used:
#   scripts/gpu_check.sh [all]          # GPU tests, then the forward benchmark (full grid)
#   scripts/gpu_check.sh tests [ARGS]   # every `gpu` test in parallel workers, then one summary
#                                       #   line (passed / failed / skipped and why); ARGS go to
#                                       #   pytest (JAXFLASH_GPU_WORKERS workers, default 12)
#   scripts/gpu_check.sh sanitize [FAMILY...]  # compute-sanitizer's memcheck, racecheck,
#                                       #   synccheck and initcheck on jaxflash's kernels
#                                       #   (devtools/sanitize/calls.py): one line per tool and
#                                       #   family, with where its reports are, in
#                                       #   sanitize_summary.txt (sanitize_runs.txt as runs end);
#                                       #   the logs in sanitize_logs.tar.gz; a last verdict line
#                                       #   (exit 1 unless clean). JAXFLASH_SANITIZE_JOBS runs at a
#                                       #   time (8), each JAXFLASH_SANITIZE_TIMEOUT s at most (240);
#                                       #   all of it took 2 minutes on the H200
#   scripts/gpu_check.sh bench [ARGS]   # benchmarks/bench_attention.py ARGS (e.g. --bwd-only)
#   scripts/gpu_check.sh masked [ARGS]  # benchmarks/bench_masked.py ARGS
#   scripts/gpu_check.sh decode [ARGS]  # benchmarks/bench_decode.py ARGS (KV-cache attention)
# Logs, JSON and PNG go to $OUT (default ./gpu_out). Exit status: that of the first failure.
set -uo pipefail
cd "$(dirname "$0")/.."
mode="${1:-all}"
[ $# -gt 0 ] && shift
case "$mode" in
  build|all|tests|sanitize|bench|masked|decode|wheel) ;;
  *) echo "unknown mode '$mode': use build, wheel, all, tests, sanitize, bench, masked or decode" >&2
     exit 2 ;;
esac
py="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python)}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's jaxflash, not an install

if [ "$mode" = build ]; then
  "$py" -m jaxflash.build --all --cache-dir .kcache "$@" || exit $?
  mkdir -p .kcpack
  (cd .kcache && tar -cf - libjaxflash_ffi.so libjaxflash_ffi.json */libjaxflash_variant.so \
     */manifest.json) | xz -T2 -6 > .kcpack/kcache.tar.xz || exit $?
  echo "carry .kcpack: $(du -sh .kcpack | cut -f1) (the device carry limit is 64 MiB)"
  exit 0
fi
if [ "$mode" = wheel ]; then
  mkdir -p .kcpack && rm -f .kcpack/*.whl
  "$py" -m jaxflash.build --all --cache-dir .kcache --wheel .kcpack "$@" || exit $?
  # The sanitizer's probe of the shared-memory hand-off (devtools/sanitize/bulk_copy_probe.cu).
  nvcc -arch=sm_90a -o .kcpack/bulk_copy_probe devtools/sanitize/bulk_copy_probe.cu || exit $?
  echo "carry .kcpack: $(du -sh .kcpack | cut -f1) (the device carry limit is 64 MiB)"
  exit 0
fi

out="${OUT:-$PWD/gpu_out}"
mkdir -p "$out"
# The kernels: the wheel if one was carried, else the cache folder.
source scripts/kernels_env.sh || exit $?
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  "$py" -c "import sys, jax; print(sys.version.split()[0], 'jax', jax.__version__, jax.devices())"
  echo "kernels: $kernels"
  "$py" -m jaxflash.build --list | awk '{print $2, $3}' | sort | uniq -c
} 2>&1 | tee "$out/environment.txt"

status=0
if [ "$mode" = tests ] || [ "$mode" = all ]; then
  # Workers share the GPU: XLA allocates on demand instead of preallocating (tests/conftest.py
  # sets this for xdist workers too). The suite compiles a few XLA programs per test (oracles,
  # raw calls): without GEMM autotuning and Triton GEMMs those compile in a fraction of the
  # time, and the tests compare against a float64 oracle whatever algorithm XLA picks.
  XLA_PYTHON_CLIENT_PREALLOCATE=false \
  XLA_FLAGS="--xla_gpu_autotune_level=0 --xla_gpu_enable_triton_gemm=false ${XLA_FLAGS:-}" \
    "$py" -m pytest -m gpu -q -p no:cacheprovider -p no:benchmark -rs \
    -n "${JAXFLASH_GPU_WORKERS:-12}" --durations=25 "$@" 2>&1 | tee "$out/pytest_gpu.log"
  rc=${PIPESTATUS[0]}
  [ "$status" -eq 0 ] && status=$rc
  "$py" - "$out/pytest_gpu.log" <<'EOF'
import collections, re, sys
text = open(sys.argv[1]).read()
# pytest's last line: "[=== ]529 passed, 4 skipped, 60 warnings in 194.12s[ (0:03:14)][ ===]"
final = re.findall(r"^=* ?(\d+ (?:passed|failed|skipped|errors?)\b.*) in ([\d.]+)s", text, re.M)
counts = dict((k, int(n)) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)\b",
                                                   final[-1][0] if final else ""))
reasons = collections.Counter()
for n, reason in re.findall(r"^SKIPPED \[(\d+)\] [^:]+:\d+: (.*)$", text, re.M):
  reasons[reason] += int(n)
why = "; ".join(f"{n}: {r}" for r, n in reasons.most_common()) or "none"
print(f"GPU suite: {counts.get('passed', 0)} passed, {counts.get('failed', 0)} failed, "
      f"{counts.get('error', 0) + counts.get('errors', 0)} errors, {counts.get('skipped', 0)} "
      f"skipped ({why}) in {final[-1][1] if final else '?'} s")
EOF
fi
if [ "$mode" = sanitize ]; then
  families=("$@")
  [ ${#families[@]} -eq 0 ] && read -r -a families <<< "$("$py" devtools/sanitize/calls.py list)"
  tools=(memcheck racecheck synccheck initcheck)
  mkdir -p "$out/sanitize"
  run_one() {  # tool family: one sanitizer run, its log in $out/sanitize/
    local log="$out/sanitize/$1-$2.log" report=(--print-limit 10000) filter=(cat)
    local kernels=(--kernel-name kns=jaxflashkernels)
    if [ "$1" = racecheck ]; then  # every hazard, condensed to one line per access pair
      report=(--racecheck-report hazard --print-limit 0)
      filter=(awk -f devtools/sanitize/hazard_pairs.awk)
    fi
    # initcheck knows a byte is written only from the kernels it instruments (and host copies):
    # filtered to jaxflash's kernels, every input an XLA kernel wrote (packed queries, page
    # tables, sinks, dO) would read as uninitialized. So it instruments XLA's kernels too; the
    # summary lists its reports per kernel.
    [ "$1" = initcheck ] && kernels=()
    # One device allocation per XLA buffer (no pooling), so memcheck sees each buffer's bounds;
    # no GEMM autotuning and no CUDA graphs in XLA's own programs (kernels launched one by one);
    # XLA compiles on one thread, and the tool attaches to Python only, not to the processes
    # XLA's compiler starts (otherwise compiles stalled at random, "Very slow compile", until
    # the run's limit); no host backtraces (a report names the kernel and PC).
    local start=$SECONDS
    XLA_PYTHON_CLIENT_ALLOCATOR=platform \
    XLA_FLAGS="--xla_gpu_autotune_level=0 --xla_gpu_enable_triton_gemm=false \
               --xla_gpu_enable_command_buffer= --xla_gpu_force_compilation_parallelism=1 \
               ${XLA_FLAGS:-}" \
      timeout "${JAXFLASH_SANITIZE_TIMEOUT:-240}" \
      compute-sanitizer --tool "$1" "${kernels[@]}" --target-processes application-only \
      --show-backtrace no "${report[@]}" \
      --error-exitcode 99 "$py" devtools/sanitize/calls.py "$2" 2>&1 | "${filter[@]}" > "$log"
    echo "rc=${PIPESTATUS[0]} seconds=$((SECONDS - start))" >> "$log"
    summarize_one "$1" "$2" >> "$out/sanitize_runs.txt"  # one write: runs end in any order
  }
  summarize_one() {  # tool family: the run's summary line, then where its reports are
    local log="$out/sanitize/$1-$2.log" summary done_line rc sites
    summary=$(grep -E "(ERROR|RACECHECK|SYNCCHECK|INITCHECK) SUMMARY" "$log" | tail -1)
    done_line=$(grep -c "calls.py $2: done" "$log")
    rc=$(grep -o "^rc=[0-9]* seconds=[0-9]*" "$log" | tail -1)
    # (type, kernel, PCs) with counts, the most frequent first.
    if [ "$1" = racecheck ]; then sites=$(grep "^hazards " "$log")
    else sites=$(awk -f devtools/sanitize/error_sites.awk "$log" | grep "^reports \|^host-API")
    fi
    printf 'sanitize %s %s: %s (%s, calls finished: %s)\n%s\n' "$1" "$2" \
      "${summary:-no summary}" "${rc:-not finished}" "$done_line" \
      "$(printf '%s\n' "$sites" | sort -k2,2nr | head -8 | sed '/^$/d; s/^/    /')" | sed '/^$/d'
  }
  export -f run_one summarize_one
  export out py
  # Independent runs share the GPU, several at a time, family by family in calls.py's order.
  # Each run's summary lands in sanitize_runs.txt as it ends (what a killed call leaves); the
  # full summary, tool by tool, follows.
  : > "$out/sanitize_runs.txt"
  for f in "${families[@]}"; do for t in "${tools[@]}"; do echo "$t $f"; done; done \
    | xargs -P "${JAXFLASH_SANITIZE_JOBS:-8}" -n 2 bash -c 'run_one "$0" "$1"'
  for t in "${tools[@]}"; do
    for f in "${families[@]}"; do summarize_one "$t" "$f"; done
  done | tee "$out/sanitize_summary.txt"
  # The verdict: every run finished its calls; memcheck and synccheck found nothing; every
  # racecheck hazard is a WAR whose reader is not lane 0 of its warp, the ring slots' side-buffer
  # hand-off (docs/kernels.md, "Sanitizer"). initcheck's reports (reads of memory that only bulk
  # copies wrote, same section) are listed above and not judged here.
  problems=$( { grep -E "^sanitize (memcheck|synccheck) .*rc=[1-9]" "$out/sanitize_summary.txt"
                grep -E "calls finished: 0|not finished" "$out/sanitize_summary.txt"
                grep -h "^hazards " "$out"/sanitize/racecheck-*.log | grep -v " WAR .*reader_lane0=0$"
              } | wc -l )
  if [ "$problems" -eq 0 ]; then
    echo "sanitize verdict: clean (memcheck and synccheck 0 errors, every racecheck hazard the" \
         "side-buffer hand-off, every run finished)" | tee -a "$out/sanitize_summary.txt"
  else
    echo "sanitize verdict: $problems line(s) to look at: an unfinished run, a memcheck or" \
         "synccheck error, or a racecheck hazard other than the side-buffer hand-off" \
      | tee -a "$out/sanitize_summary.txt"
    status=1
  fi
  # The hand-off in miniature: which orderings racecheck follows (docs/kernels.md, "Sanitizer").
  if [ -x .kcpack/bulk_copy_probe ]; then
    for m in lane0 all nowait; do
      compute-sanitizer --tool racecheck --racecheck-report all --print-limit 4 \
        .kcpack/bulk_copy_probe "$m" > "$out/sanitize/probe-$m.log" 2>&1
      echo "sanitize probe $m: $(grep -E "probe $m:" "$out/sanitize/probe-$m.log")" \
        "$(grep -E "RACECHECK SUMMARY" "$out/sanitize/probe-$m.log" | tail -1)" \
        "$(grep -oE "(RAW|WAR|WAW) hazard" "$out/sanitize/probe-$m.log" | sort | uniq -c \
           | tr -s ' ' | tr '\n' ';')"
    done | tee -a "$out/sanitize_summary.txt"
  fi
  # The per-run logs as one file.
  tar -czf "$out/sanitize_logs.tar.gz" -C "$out" sanitize && rm -rf "$out/sanitize"
fi
if [ "$mode" = decode ]; then
  "$py" benchmarks/bench_decode.py --out "$out" "$@" 2>&1 | tee "$out/bench_decode.log"
  rc=${PIPESTATUS[0]}
  [ "$status" -eq 0 ] && status=$rc
fi
if [ "$mode" = masked ]; then
  "$py" benchmarks/bench_masked.py --out "$out" "$@" 2>&1 | tee "$out/bench_masked.log"
  rc=${PIPESTATUS[0]}
  [ "$status" -eq 0 ] && status=$rc
fi
if [ "$mode" = bench ] || [ "$mode" = all ]; then
  extra=("$@")
  [ "$mode" = all ] && extra=(--fwd-only)  # forward+backward: a separate 'bench --bwd-only' run
  "$py" benchmarks/bench_attention.py --out "$out" "${extra[@]}" 2>&1 | tee "$out/bench.log"
  rc=${PIPESTATUS[0]}
  [ "$status" -eq 0 ] && status=$rc
fi
exit "$status"
