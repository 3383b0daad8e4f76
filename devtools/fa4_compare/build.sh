#!/usr/bin/env bash
# Builds FlashAttention-4's own Hopper backward (bf16, hdim 128, non-causal, non-deterministic,
# FA-4's sm90 config: 80 x 128, SdP / dQ swapAB) into a library with jaxflash's variant ABI
# (jaxflash/ffi/kernel_abi.h), so the backward self-test (bwd_selftest, run_bwd.sh) and
# devtools/kernel_selftest/ncu_bwd.sh run it next to jaxflash's kernels on the GPU host.
# devtools only: FA-4 and quack sources come from git mirrors at pinned commits at build time;
# nothing of theirs is kept in this repository. See README.md here.
#
#   bash devtools/fa4_compare/build.sh      # from the repo root; about 15 s plus the checks
#
# Writes .selftest/fa4/fa4-sm90a-bf16-d128-dv128-m80n128.so and, when .selftest/bwd/libs.tar.xz
# exists (build_bwd.py), adds the library to it under bwd/, so run_bwd.sh checks and times it.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
PY=${PY:-$REPO/.venv/bin/python}
FA_GIT=${FA_GIT:-/work/.mirror/Dao-AILab+flash-attention/repo}
QUACK_GIT=${QUACK_GIT:-/work/.mirror/Dao-AILab+quack/repo}
FA_REV=${FA_REV:-0251105a2fb19d2957484b7f023cd8c115286ced}
QUACK_REV=${QUACK_REV:-c8ec3170057987da0ec99883736f381ea1937cf3}
WORK=${WORK:-/tmp/jaxflash_fa4_compare}
KEY=fa4-sm90a-bf16-d128-dv128-m80n128
SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
DSL_LIB="$SITE/nvidia_cutlass_dsl/cu13/lib"
CUDA=${CUDA:-/usr/local/cuda}
for git_dir in "$FA_GIT" "$QUACK_GIT"; do
  [ -d "$git_dir" ] || { echo "no git mirror at $git_dir (set FA_GIT / QUACK_GIT)" >&2; exit 2; }
done

rm -rf "$WORK" && mkdir -p "$WORK/src" "$WORK/build"
# (git archive of the flash-attention mirror may warn about an LFS pdf; the sources are whole.)
git --git-dir="$FA_GIT" archive "$FA_REV" flash_attn/cute | tar -x -C "$WORK/src"
git --git-dir="$QUACK_GIT" archive "$QUACK_REV" quack | tar -x -C "$WORK/src"

# 1. compile + export (FA4_GQA_GROUPS must match FA4_GROUPS in fa4_glue.cc)
FA4_SRC="$WORK/src" FA4_GQA_GROUPS=1,2,3,4,8 "$PY" "$HERE/build_kernels.py" "$WORK/build"

# 2. link: only the four ABI functions are exported
out="$REPO/.selftest/fa4"
mkdir -p "$out"
g++ -std=c++17 -O2 -shared -fPIC -fvisibility=hidden \
  -o "$out/$KEY.so" "$HERE/fa4_glue.cc" \
  -I"$WORK/build" -I"$REPO/jaxflash/ffi" -I"$CUDA/include" \
  "$WORK"/build/fa4_bwd_*.o \
  "$DSL_LIB/libcuda_dialect_runtime_static.a" "$CUDA/lib64/libcudart_static.a" \
  -Wl,--version-script="$HERE/exports.map" -Wl,--exclude-libs,ALL -s -ldl -lrt -lpthread

# 3. CPU checks: SASS counts per kernel, ABI smoke test (dlopen; no GPU needed)
"$PY" "$HERE/inspect_sass.py" "$WORK/build" | tee "$out/sass_summary.txt"
gcc -O1 -o "$WORK/build/abi_check" "$HERE/abi_check.c" -I"$REPO/jaxflash/ffi" -ldl
"$WORK/build/abi_check" "$out/$KEY.so"
nm -D --defined-only "$out/$KEY.so"
ls -l "$out/$KEY.so"

# 4. into the backward self-test's pack, if there is one
pack="$REPO/.selftest/bwd/libs.tar.xz"
if [ -f "$pack" ]; then
  "$PY" - "$pack" "$out/$KEY.so" <<'PYEOF'
import io, pathlib, sys, tarfile
pack, lib = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
with tarfile.open(pack) as old:
  kept = [(m, old.extractfile(m).read()) for m in old.getmembers() if m.isfile()
          and m.name != f"bwd/{lib.name}"]
with tarfile.open(pack, "w:xz") as tar:
  for m, data in kept + [(tarfile.TarInfo(f"bwd/{lib.name}"), lib.read_bytes())]:
    m.size = len(data)
    tar.addfile(m, io.BytesIO(data))
print(f"added bwd/{lib.name} to {pack}")
PYEOF
fi
