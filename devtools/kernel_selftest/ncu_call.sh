#!/bin/bash
# GPU host side, with the kernels installed (a kernel wheel or JAXFLASH_CACHE_DIR): Nsight
# Compute on the kernels of one jitted call (profile_call.py: compiled and warmed up first,
# then one call inside a profiler range).
#   bash devtools/kernel_selftest/ncu_call.sh LABEL times -- decode b8_q1_32k_gqa8 cudnn
#   bash devtools/kernel_selftest/ncu_call.sh LABEL full REGEX -- fwd 128 1024 jaxflash --causal
# `times`: every kernel of the call, one line each: duration, DRAM bytes read / written and
# their rate, grid and block (a call's XLA kernels next to its attention kernel).
# `full`: `--set full` on the kernels whose name matches REGEX, the headline metrics and
# ncu_stalls.py's breakdown per warp role. REGEX matches the function's base name (every CUTLASS
# kernel of FlashAttention-3 is `device_kernel`); prefixed `demangled:` it matches the demangled
# name with its template arguments instead, e.g. 'demangled:FlashAttnBwdSm90' for FA-3's
# backward main kernel alone.
# Writes $OUT/ncu_LABEL_*.txt (and _sass.csv); the report stays in /tmp. Clocks are left alone
# (--clock-control none) and caches are flushed before each kernel (ncu's default).
set -u
out=${OUT:-/tmp}
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
label=$1 mode=$2
shift 2
regex=
if [ "$mode" = full ]; then regex=$1; shift; fi
[ "${1:-}" = "--" ] && shift
work=/tmp/ncu_$label
rep=$out/ncu_$label
if [ "$mode" = times ]; then
  metrics=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,launch__grid_size
  metrics+=,launch__block_size,launch__registers_per_thread
  timeout 300 "$ncu" --clock-control none --profile-from-start off --metrics "$metrics" \
    --csv --page raw python devtools/kernel_selftest/profile_call.py "$@" \
    >"${rep}_times.csv" 2>"${work}_run.txt" || {
    echo "$label: ncu failed:"; tail -5 "${work}_run.txt"; exit 1; }
  python3 - "${rep}_times.csv" "$label" <<'EOF'
import csv, re, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 5]
head, units, data = rows[0], rows[1], rows[2:]
col = {h: i for i, h in enumerate(head)}
scale = {"B": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "byte": 1,
         "ns": 1e-3, "usecond": 1, "us": 1, "msecond": 1e3, "ms": 1e3}
def value(r, name):
  return float(r[col[name]].replace(",", "")) * scale.get(units[col[name]], 1)
total = 0.0
print(f"== {sys.argv[2]}")
for r in data:
  name = r[col["Kernel Name"]]
  short = re.search(r"([A-Z][A-Za-z0-9]*)_object", name)
  short = short.group(1) if short else name[:48]
  us = value(r, "gpu__time_duration.sum")
  rd, wr = value(r, "dram__bytes_read.sum"), value(r, "dram__bytes_write.sum")
  total += us
  print(f"  {us:8.1f} us  read {rd / 1e6:8.2f} MB  write {wr / 1e6:7.2f} MB  "
        f"{(rd + wr) / us / 1e6:5.2f} TB/s  grid {r[col['launch__grid_size']]:>6} x "
        f"{r[col['launch__block_size']]:>4}  regs {r[col['launch__registers_per_thread']]:>3}  {short}")
print(f"  {total:8.1f} us in {len(data)} kernels")
EOF
  exit $?
fi
base=function
case "$regex" in demangled:*) base=demangled; regex=${regex#demangled:} ;; esac
timeout 400 "$ncu" --clock-control none --profile-from-start off --kernel-name-base "$base" \
  --kernel-name "regex:$regex" \
  --set full --import-source no -f -o "$work" \
  python devtools/kernel_selftest/profile_call.py "$@" >"${work}_run.txt" 2>&1 || {
  echo "$label: ncu failed:"; tail -5 "${work}_run.txt"; exit 1; }
"$ncu" --import "$work.ncu-rep" --page details >"${rep}_details.txt" 2>&1
"$ncu" --import "$work.ncu-rep" --page source --print-source sass --csv >"${rep}_sass.csv" 2>&1
echo "== $label"
grep -E "Duration|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|Issue Slots Busy|Achieved Occupancy|Grid Size|Waves Per SM" \
  "${rep}_details.txt" | sed -E 's/  +/ /g'
python3 devtools/kernel_selftest/ncu_stalls.py "${rep}_sass.csv" --top 10
