#!/bin/bash
# GPU host side: Nsight Compute profile of one backward call (preprocess, main, postprocess) of
# variant libraries at the backward self-test's seq 16k shape (batch 1, seqlen 16384,
# heads = 2048 / head_dim), with the warp-stall breakdown per role.
# Needs, carried to the GPU host: .selftest/bwd/bwd_selftest (build_bwd.py, any selection) and
# .kcache (`scripts/gpu_check.sh build`) for variant KEY arguments. An argument may also be a
# library path: an A/B library as run_bwd.sh unpacks it (/tmp/jaxflash_selftest_bwd_libs/bwd/),
# or FA-4's .selftest/fa4/fa4-sm90a-bf16-d128-dv128-m80n128.so (devtools/fa4_compare; carry
# .selftest/fa4).
#   bash devtools/kernel_selftest/ncu_bwd.sh KEY_OR_LIBRARY...
# About 40 s per key. Writes $OUT/ncu_KEY_details.txt (every section of the three kernels) and
# ncu_KEY_sass.csv (per-instruction samples), and prints the details' headline metrics and
# ncu_stalls.py's breakdown of each kernel. The report (.ncu-rep) and ncu's own output stay in
# /tmp unless NCU_KEEP_REP=1 (then they go to $OUT too).
# Clocks are left alone (--clock-control none), so durations are at whatever clock the GPU ran:
# compare kernels of one report, not reports of two runs.
set -u
out=${OUT:-/tmp}
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
selftest=.selftest/bwd/bwd_selftest
[ -x "$selftest" ] || { echo "no $selftest: run build_bwd.py on the build host" >&2; exit 2; }
[ $# -gt 0 ] || { echo "usage: $0 KEY_OR_LIBRARY.so..." >&2; exit 2; }
# bwd_selftest --no-check launches nothing before its benchmark, which times seq 4k, 16k, 1k,
# each 9 x 5 calls of pre + main + post (with one dQ accumulator first): skip the 4k calls
# (135 launches) and two 16k calls, take the third one's three kernels. NCU_SEQ=4k or 1k
# profiles that sequence's third call instead.
case "${NCU_SEQ:-16k}" in
  4k) skip=6 ;; 16k) skip=141 ;; 1k) skip=276 ;;
  *) echo "NCU_SEQ: ${NCU_SEQ}; accepted: 4k, 16k, 1k" >&2; exit 2 ;;
esac
filter='regex:FlashAttentionBackward(Preprocess|Sm90|Postprocess)'
status=0
for key in "$@"; do
  # A variant key (its library in .kcache) or a library path (e.g. devtools/fa4_compare's).
  case "$key" in
    *.so) lib=$key; key=$(basename "$key" .so) ;;
    *) lib=.kcache/$key/libjaxflash_variant.so ;;
  esac
  if [ ! -f "$lib" ]; then echo "$key: no $lib" >&2; status=1; continue; fi
  # Plain file names: an A/B key's '+', '=' and ',' become '_'.
  rep=$out/ncu_$(printf %s "$key${NCU_SEQ:+_$NCU_SEQ}" | tr -c 'A-Za-z0-9._-' _)
  work=$rep
  [ "${NCU_KEEP_REP:-0}" = 1 ] || work=/tmp/${rep##*/}
  timeout 300 "$ncu" --clock-control none --kernel-name "$filter" --launch-skip $skip \
    --launch-count 3 --set full --import-source no -f -o "$work" \
    "$selftest" --no-check "$(realpath "$lib")" >"${work}_run.txt" 2>&1 || {
    echo "$key: ncu failed (tail of ${work}_run.txt):"; tail -5 "${work}_run.txt"
    status=1; continue; }
  "$ncu" --import "$work.ncu-rep" --page details >"${rep}_details.txt" 2>&1
  echo "== $key"
  headline="^  [a-z_]+kernel|Duration|SM Frequency|Compute \(SM\) Throughput|Issue Slots Busy"
  grep -E "$headline|DRAM Throughput" "${rep}_details.txt" | sed -E 's/_object_at_.*//'
  "$ncu" --import "$work.ncu-rep" --page source --print-source sass --csv >"${rep}_sass.csv" 2>&1
  python3 devtools/kernel_selftest/ncu_stalls.py "${rep}_sass.csv" --top 8 || status=1
done
exit $status
