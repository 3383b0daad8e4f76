#!/bin/bash
# GPU host side: Nsight Compute profile of one FP8 forward call per head_dim
# (fp8_fwd_call.py: batch 1, seq 16k, heads 2048 / head_dim, per-head descales) with the
# installed kernels (a kernel wheel, or JAXFLASH_CACHE_DIR), printing the headline metrics,
# the pipes' shares and ncu_stalls.py's breakdown per warp role. Extra arguments after `--` go
# to fp8_fwd_call.py (--causal, --block-size B).
#   bash devtools/kernel_selftest/ncu_fp8_fwd.sh 128 256 [-- --causal]
# About 15 s per head_dim. Writes $OUT/ncu_fp8_dD_{details,raw}.txt and _sass.csv; the report
# stays in /tmp. Clocks are left alone (--clock-control none): compare kernels of one report or
# ratios, not durations of two runs.
set -u
out=${OUT:-/tmp}
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
dims=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do dims+=("$1"); shift; done
[ $# -gt 0 ] && shift
[ ${#dims[@]} -gt 0 ] || { echo "usage: $0 HEAD_DIM... [-- fp8_fwd_call.py flags]" >&2; exit 2; }
pipes='sm__inst_executed_pipe_(xu|fma|alu|lsu|uniform)\.avg\.pct_of_peak_sustained_active |'
pipes+='sm__pipe_tensor_cycles_active_realtime\.avg\.pct_of_peak_sustained_elapsed |'
pipes+='sm__pipe_shared_cycles_active\.avg\.pct_of_peak_sustained_active '
status=0
for d in "${dims[@]}"; do
  rep=$out/ncu_fp8_d$d
  work=/tmp/${rep##*/}
  timeout 300 "$ncu" --clock-control none --kernel-name regex:FlashAttentionForward \
    --launch-count 1 --set full --import-source no -f -o "$work" \
    python devtools/kernel_selftest/fp8_fwd_call.py "$d" "$@" >"${work}_run.txt" 2>&1 || {
    echo "head_dim $d: ncu failed (tail of ${work}_run.txt):"; tail -5 "${work}_run.txt"
    status=1; continue; }
  "$ncu" --import "$work.ncu-rep" --page details >"${rep}_details.txt" 2>&1
  "$ncu" --import "$work.ncu-rep" --page raw >"${rep}_raw.txt" 2>&1
  echo "== head_dim $d"
  grep -E "Duration|SM Frequency|Compute \(SM\) Throughput|Issue Slots Busy" "${rep}_details.txt"
  grep -E "$pipes" "${rep}_raw.txt" | sed -E 's/^ *(TPC\.TriageCompute\.)?//; s/  +/ /g'
  "$ncu" --import "$work.ncu-rep" --page source --print-source sass --csv >"${rep}_sass.csv" 2>&1
  python3 devtools/kernel_selftest/ncu_stalls.py "${rep}_sass.csv" --top 8 || status=1
done
exit $status
