#!/bin/bash
# GPU host side of the kernel self-test: unpacks .selftest/libs.tar.xz (made by build.py --pack),
# runs fwd_selftest on each library in its own process (a hang or crash costs one library, not
# the call; after a hang the rest of that tag is skipped, a deadlock usually hits every variant
# of a build), writes the full log to $OUT/selftest.log and prints a TFLOP/s table last.
# Usage, from the repo root: bash devtools/kernel_selftest/run.sh [seconds budget, default 200]
set -u
out=${OUT:-/tmp}
budget=${1:-200}
work=/tmp/jaxflash_selftest_libs
log="$out/selftest.log"
rm -rf "$work" && mkdir -p "$work"
python3 -c "import tarfile; tarfile.open('.selftest/libs.tar.xz').extractall('$work')" || exit 2
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv \
  | tee "$log"
status=0
hung_tag=""
start=$SECONDS
for lib in "$work"/*/*.so; do
  name=${lib#$work/}
  tag=${name%%/*}
  if [ "$tag" = "$hung_tag" ]; then
    echo "RESULT $name SKIPPED 0 0 0" >>"$log"; continue
  fi
  if [ $((SECONDS - start)) -gt "$budget" ]; then
    echo "RESULT $name NO-TIME 0 0 0" >>"$log"; status=1; continue
  fi
  echo "== $name" >>"$log"
  timeout 120 .selftest/fwd_selftest "$lib" >>"$log" 2>&1
  rc=$?
  if [ $rc -ne 0 ]; then
    status=1
    if [ $rc -eq 3 ] || [ $rc -eq 124 ]; then hung_tag=$tag; fi
    # Exit 1 = checks failed (its RESULT line is printed); anything else died before that.
    if [ $rc -ne 1 ]; then echo "RESULT $name EXIT$rc 0 0 0" >>"$log"; fi
  fi
done
echo "elapsed $((SECONDS - start)) s"
grep -E "FAIL|HANG|error" "$log" | head -30
echo "| tag | variant | check | seq 1k | seq 4k | seq 16k |"
echo "|---|---|---|---|---|---|"
tag=""
while read -r line; do
  case "$line" in
    "== "*) tag=${line#== }; tag=${tag%%/*} ;;
    RESULT*) set -- $line; echo "| $tag | $2 | $3 | $4 | $5 | $6 |" ;;
  esac
done <"$log"
exit $status
