#!/usr/bin/env bash
# GPU checks of jaxflash against the prebuilt kernels carried in .kcache/ (git-ignored).
#
# On the build host (nvidia-cutlass-dsl, g++, CUDA headers; no GPU needed), from the repo root:
#   scripts/gpu_check.sh build          # = python -m jaxflash.build --all --cache-dir .kcache,
#                                       #   then packs the libraries into .kcpack/kcache.tar.xz
#                                       #   (the static CUDA runtimes in them compress 30x)
# On the GPU host (jax with CUDA + pytest; installs nothing, needs no network), from the repo root:
#   scripts/gpu_check.sh [all]          # GPU tests, then the forward benchmark (full grid)
#   scripts/gpu_check.sh tests          # python -m pytest -m gpu -q
#   scripts/gpu_check.sh bench [ARGS]   # benchmarks/bench_attention.py ARGS (e.g. --bwd-only)
#   scripts/gpu_check.sh masked [ARGS]  # benchmarks/bench_masked.py ARGS
# The GPU host unpacks .kcpack/kcache.tar.xz into .kcache/ when .kcache/ is missing.
# The kernel wheel instead of the cache folder:
#   scripts/gpu_check.sh wheel          # build host: the kernel wheel of .kcache into .kcpack/
#   scripts/gpu_check.sh wheel-tests [ARGS]  # GPU host: pip-installs .kcpack/*.whl into .kwheel/,
#                                       #   then `--list` and `pytest -m gpu ARGS` with no cache
#                                       #   folder at all (JAXFLASH_CACHE_DIR unset, empty HOME)
# Logs, JSON and PNG go to $OUT (default ./gpu_out). Exit status: that of the first failure.
set -uo pipefail
cd "$(dirname "$0")/.."
mode="${1:-all}"
[ $# -gt 0 ] && shift
case "$mode" in
  build|all|tests|bench|masked|wheel|wheel-tests) ;;
  *) echo "unknown mode '$mode': use build, all, tests, bench, masked, wheel or wheel-tests" >&2
     exit 2 ;;
esac
py="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python)}"
export JAXFLASH_CACHE_DIR="$PWD/.kcache"
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
  echo "carry .kcpack: $(du -sh .kcpack | cut -f1) (the device carry limit is 64 MiB)"
  exit 0
fi
if [ "$mode" = wheel-tests ]; then
  out="${OUT:-$PWD/gpu_out}"
  mkdir -p "$out"
  rm -rf .kwheel && "$py" -m pip install -q --no-deps --no-index --target .kwheel .kcpack/*.whl \
    || exit $?
  unset JAXFLASH_CACHE_DIR
  export HOME="$(mktemp -d)" PYTHONPATH="$PWD/.kwheel:$PYTHONPATH"
  "$py" -m jaxflash.build --list > "$out/list_wheel.txt" || exit $?
  awk '{print $2, $3}' "$out/list_wheel.txt" | sort | uniq -c
  "$py" -m pytest -m gpu -q -p no:cacheprovider -rs "$@" 2>&1 | tee "$out/pytest_gpu_wheel.log"
  exit "${PIPESTATUS[0]}"
fi
if [ ! -d .kcache ] && [ -f .kcpack/kcache.tar.xz ]; then
  mkdir -p .kcache && xz -dc .kcpack/kcache.tar.xz | tar -C .kcache -xf - || exit $?
fi

out="${OUT:-$PWD/gpu_out}"
mkdir -p "$out"
if [ ! -f .kcache/libjaxflash_ffi.so ]; then
  echo "no prebuilt kernels in .kcache/: run 'scripts/gpu_check.sh build' on the build host" >&2
  exit 2
fi
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  "$py" -c "import sys, jax; print(sys.version.split()[0], 'jax', jax.__version__, jax.devices())"
  du -sh .kcache
} 2>&1 | tee "$out/environment.txt"

status=0
if [ "$mode" = tests ] || [ "$mode" = all ]; then
  "$py" -m pytest -m gpu -q -p no:cacheprovider -rs 2>&1 | tee "$out/pytest_gpu.log"
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
