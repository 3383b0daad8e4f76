#!/bin/bash
# GPU host side of the backward self-test: unpacks .selftest/bwd/libs.tar.xz (made by
# build_bwd.py), runs bwd_selftest on each backward library in its own process (a hang or crash
# costs one library), writes the full log to $OUT/bwd_selftest.log and prints a table last.
# Usage, from the repo root: bash devtools/kernel_selftest/run_bwd.sh [extra bwd_selftest flags]
# f16 libraries are checked but not timed. After two hangs the remaining libraries are skipped.
# BWD_ONLY=<glob> runs only the libraries whose name matches *<glob>* (e.g. BWD_ONLY=d256, or
# BWD_ONLY='-d[19][69]' for hdim 96 and 192), to split the run over several device calls.
set -u
shopt -s nullglob  # a BWD_ONLY that matches nothing runs nothing
out=${OUT:-/tmp}
log="$out/bwd_selftest.log"
work=/tmp/jaxflash_selftest_bwd_libs
rm -rf "$work" && mkdir -p "$work"
python3 -c "import tarfile; tarfile.open('.selftest/bwd/libs.tar.xz').extractall('$work')" || exit 2
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv \
  | tee "$log"
status=0
hangs=0
for lib in "$work"/bwd/*${BWD_ONLY:-}*.so; do
  name=${lib##*/}
  if [ $hangs -ge 2 ]; then
    echo "RESULT ${name} SKIPPED 0 0 0 0 0 0" >>"$log"
    continue
  fi
  flags=()
  case "$name" in *-f16-*) flags=(--no-bench) ;; esac
  echo "== $name" >>"$log"
  timeout 60 .selftest/bwd/bwd_selftest ${flags[@]+"${flags[@]}"} "$@" "$lib" >>"$log" 2>&1
  rc=$?
  if [ $rc -ne 0 ]; then
    status=1
    # Exit 1 is a failed check (bwd_selftest printed its RESULT line); others are crashes/hangs.
    [ $rc -ne 1 ] && echo "RESULT ${name} EXIT$rc 0 0 0 0 0 0" >>"$log"
    if [ $rc -eq 3 ] || [ $rc -eq 124 ]; then hangs=$((hangs + 1)); fi
  fi
done
# Second pass: fwd+bwd timing of the bf16 non-deterministic libraries that passed, with the
# forward library of the same variant (a forward hang cannot hide a backward result).
# (Skipped when build_bwd.py packed no forward library, --no-fwd: it would only rerun the
# backward timing.)
fwd_libs=("$work"/fwd/*.so)
for lib in "$work"/bwd/*bf16*${BWD_ONLY:-}*.so; do
  [ ${#fwd_libs[@]} -gt 0 ] || break
  name=${lib##*/}
  case "$name" in *-det-*) continue ;; esac
  key=${name#*_}
  grep -q "^RESULT ${key%.so} PASS" "$log" || continue
  echo "== $name (fwd+bwd timing)" >>"$log"
  timeout 40 .selftest/bwd/bwd_selftest --no-check --fwd-dir "$work/fwd" "$lib" >>"$log" 2>&1
done
grep -E "FAIL|HANG|error|rel_l2=[0-9.e+-]+ .*nan=[1-9]" "$log" | head -60
echo "| library | check | bwd TF/s 4k | bwd 16k | fwd+bwd 4k | fwd+bwd 16k | bwd 1k | fwd+bwd 1k |"
echo "|---|---|---|---|---|---|---|---|"
grep "^RESULT" "$log" | while read -r _ key res a b c d e f; do
  echo "| $key | $res | $a | $b | $c | $d | ${e:-} | ${f:-} |"
done
exit $status
