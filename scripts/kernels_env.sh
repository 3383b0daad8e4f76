# Sourced by the GPU scripts (from the repo root, with $py set): makes jaxflash find its kernels.
# A kernel wheel in .kcpack/ is pip-installed into .kwheel/ and used with no cache folder at all
# (JAXFLASH_CACHE_DIR unset, an empty HOME); else the cache folder .kcache/ (unpacked from
# .kcpack/kcache.tar.xz if needed). Sets $kernels to what was used; returns 2 if there are none.
if compgen -G ".kcpack/*.whl" > /dev/null; then
  rm -rf .kwheel && "$py" -m pip install -q --no-deps --no-index --target .kwheel .kcpack/*.whl \
    || return $?
  unset JAXFLASH_CACHE_DIR
  export HOME="$(mktemp -d)" PYTHONPATH="$PWD/.kwheel:$PYTHONPATH"
  kernels="kernel wheel $(basename .kcpack/*.whl)"
else
  if [ ! -d .kcache ] && [ -f .kcpack/kcache.tar.xz ]; then
    mkdir -p .kcache && xz -dc .kcpack/kcache.tar.xz | tar -C .kcache -xf - || return $?
  fi
  if [ ! -f .kcache/libjaxflash_ffi.so ]; then
    echo "no kernels: carry .kcpack/ ('scripts/gpu_check.sh wheel' on the build host)" >&2
    return 2
  fi
  export JAXFLASH_CACHE_DIR="$PWD/.kcache"
  kernels="cache folder .kcache"
fi
