#!/bin/bash
# GPU host side of the kernel self-test: unpacks .selftest/libs.tar.xz (made by build.py --pack),
# runs fwd_selftest on each library in its own process (a hang or crash costs one library, not
# the run; after a hang the rest of that tag is skipped, a deadlock usually hits every variant
# of a build), writes the full log to $OUT/selftest.log ($OUT defaults to /tmp) and prints a
# TFLOP/s table, then an A/B view (each variant's tags side by side, ratios to the first tag,
# worst errors) last.
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
    echo "RESULT $name SKIPPED 0 0 0 0" >>"$log"; continue
  fi
  if [ $((SECONDS - start)) -gt "$budget" ]; then
    echo "RESULT $name NO-TIME 0 0 0 0" >>"$log"; status=1; continue
  fi
  echo "== $name" >>"$log"
  timeout 120 .selftest/fwd_selftest "$lib" >>"$log" 2>&1
  rc=$?
  if [ $rc -ne 0 ]; then
    status=1
    if [ $rc -eq 3 ] || [ $rc -eq 124 ]; then hung_tag=$tag; fi
    # Exit 1 = checks failed (its RESULT line is printed); anything else died before that.
    if [ $rc -ne 1 ]; then echo "RESULT $name EXIT$rc 0 0 0 0" >>"$log"; fi
  fi
done
echo "elapsed $((SECONDS - start)) s"
grep -E "FAIL|HANG|error" "$log" | head -30
echo "| tag | variant | check | seq 1k | seq 2k | seq 4k | seq 16k |"
echo "|---|---|---|---|---|---|---|"
tag=""
while read -r line; do
  case "$line" in
    "== "*) tag=${line#== }; tag=${tag%%/*} ;;
    RESULT*) set -- $line; echo "| $tag | $2 | $3 | $4 | $7 | $5 | $6 |" ;;
  esac
done <"$log"
# A/B view (several tags): per variant (dtype, head dims, mask: the key without its schedule
# token and '+field=value' suffix, so tags built with other tiles line up), each tag's TFLOP/s
# as a ratio to the first tag's, and the worst rel_l2 / LSE error of its checks.
awk '
  /^== / { split($2, p, "/"); tag = p[1]; next }
  /rel_l2=/ { for (i = 1; i <= NF; i++) {
      if ($i ~ /^rel_l2=/) { v = substr($i, 8) + 0; if (v > rel[tag]) rel[tag] = v }
      if ($i ~ /^lse_maxerr=/) { v = substr($i, 12) + 0; if (v > lse[tag]) lse[tag] = v } } }
  /^RESULT / { key = $2; sub(/\+.*/, "", key); sub(/-m[0-9]+n[0-9]+s[0-9]+$/, "", key)
    if (!(key in t1)) {
      order[++n] = key; t1[key] = $4; t2[key] = $7; t4[key] = $5; t16[key] = $6 }
    line[key] = line[key] sprintf(" | %s %s %s/%s/%s/%s (x%.3f/%.3f/%.3f/%.3f) rel_l2 %.1e lse %.1e",
      tag, $3, $4, $7, $5, $6, t1[key] > 0 ? $4 / t1[key] : 0, t2[key] > 0 ? $7 / t2[key] : 0,
      t4[key] > 0 ? $5 / t4[key] : 0, t16[key] > 0 ? $6 / t16[key] : 0, rel[tag] + 0, lse[tag] + 0)
    rel[tag] = 0; lse[tag] = 0 }
  END { if (n) {
    print "A/B per variant: tag check 1k/2k/4k/16k (ratio to the first tag) worst rel_l2, lse error"
    for (i = 1; i <= n; i++) print "| " order[i] line[order[i]] " |" } }' "$log"
exit $status
