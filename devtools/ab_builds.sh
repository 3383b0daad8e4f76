#!/usr/bin/env bash
# GPU host: one command run against several kernel builds in alternation, each run a process of
# its own, so that builds compare within one GPU call (absolute numbers drift between calls).
#
#   py=python; source scripts/kernels_env.sh      # the installed kernels (a carried wheel)
#   bash devtools/ab_builds.sh ROUNDS NAME=DIR [NAME=DIR ...] -- COMMAND [ARGS...]
#
# DIR is a kernel cache folder (`python -m jaxflash.build --cache-dir DIR --variants ...` on the
# build host, from the sources under test; carry it): its variants override the installed ones
# through JAXFLASH_CACHE_DIR, which serves the variants it lacks from the installed kernels.
# DIR "-" runs the installed kernels alone. Round r runs the builds in the order given, reversed
# in every second round, so that neither build always runs first. Each run's output goes to
# $OUT/ab_NAME_rR.log (OUT defaults to ./gpu_out); the table lines it printed (those starting
# with '|') are echoed as "NAME rR | ...". Exit status: 1 if any run failed, else 0.
set -uo pipefail
usage="usage: $0 ROUNDS NAME=DIR [NAME=DIR ...] -- COMMAND [ARGS...]"
rounds="${1:-}"
if ! [[ "$rounds" =~ ^[1-9][0-9]*$ ]]; then
  echo "ROUNDS: '$rounds' is not a positive count; $usage" >&2
  exit 2
fi
shift
names=() dirs=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
  if ! [[ "$1" =~ ^[A-Za-z0-9_.-]+=.+$ ]]; then
    echo "build '$1' is not NAME=DIR (NAME of letters, digits, '.', '_', '-'); $usage" >&2
    exit 2
  fi
  name="${1%%=*}" dir="${1#*=}"
  if [ "$dir" != "-" ] && [ ! -d "$dir" ]; then
    echo "build $name: '$dir' is not a folder (a kernel cache folder, or - for the installed kernels)" >&2
    exit 2
  fi
  names+=("$name") dirs+=("$dir")
  shift
done
if [ $# -lt 2 ] || [ ${#names[@]} -eq 0 ]; then
  echo "$usage" >&2
  exit 2
fi
shift  # the --
out="${OUT:-$PWD/gpu_out}"
mkdir -p "$out"
status=0
for ((r = 1; r <= rounds; r++)); do
  order=("${!names[@]}")
  if ((r % 2 == 0)); then
    order=()
    for ((i = ${#names[@]} - 1; i >= 0; i--)); do order+=("$i"); done
  fi
  for i in "${order[@]}"; do
    log="$out/ab_${names[$i]}_r$r.log"
    if [ "${dirs[$i]}" = "-" ]; then
      (unset JAXFLASH_CACHE_DIR; "$@") > "$log" 2>&1
    else
      JAXFLASH_CACHE_DIR="$(cd "${dirs[$i]}" && pwd)" "$@" > "$log" 2>&1
    fi
    rc=$?
    [ $rc -eq 0 ] || { status=1; echo "${names[$i]} r$r: exit $rc (log: $log)"; }
    grep '^|' "$log" | sed "s/^/${names[$i]} r$r /"
  done
done
exit $status
