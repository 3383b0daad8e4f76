#!/usr/bin/env bash
# Builds FlashAttention-4's own Hopper kernels into libraries with jaxflash's variant ABI
# (jaxflash/ffi/kernel_abi.h), so that jaxflash's self-tests and profilers run them next to
# jaxflash's kernels on the GPU host:
#  - bwd: the backward (bf16, hdim 128, non-causal, non-deterministic, FA-4's sm90 config:
#    80 x 128, SdP / dQ swapAB) for the backward self-test (bwd_selftest, run_bwd.sh) and
#    devtools/kernel_selftest/ncu_bwd.sh;
#  - fwd: the forward (bf16, dense, head_dim 64 and 128, causal and not, FA-4's sm90 tiles), one
#    library each, into the forward self-test's tag folder fa4 (build.py --pack TAGS,fa4).
# The FA-4 and quack sources are taken from git clones at pinned commits at build time; nothing
# of theirs is kept in this repository. See README.md here.
#
#   bash devtools/fa4_compare/build.sh FLASH_ATTENTION_GIT_DIR QUACK_GIT_DIR   # from the repo root
#   FA_GIT=... QUACK_GIT=... bash devtools/fa4_compare/build.sh                # the same
#
# A *_GIT_DIR is a clone (its work tree or .git folder, or a bare clone) holding the pinned
# commit (FA_REV, QUACK_REV). FA4_PARTS: "bwd fwd" (default), "bwd" or "fwd". PY: the Python
# with nvidia-cutlass-dsl and jaxflash's dependencies (default: the repo's .venv/bin/python if
# present, else python3). WORK: scratch folder (default /tmp/jaxflash_fa4_compare).
# Writes .selftest/fa4/fa4-sm90a-bf16-d128-dv128-m80n128.so (bwd; added to
# .selftest/bwd/libs.tar.xz when that exists) and FWD_TAG_DIR/*.so (fwd; default
# /tmp/jaxflash_selftest_fwd/fa4, the tag fa4 of devtools/kernel_selftest/build.py's work folder).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
usage="usage: bash devtools/fa4_compare/build.sh FLASH_ATTENTION_GIT_DIR QUACK_GIT_DIR
       (or set FA_GIT and QUACK_GIT)"
FA_GIT=${1:-${FA_GIT:-}}
QUACK_GIT=${2:-${QUACK_GIT:-}}
missing=()
[ -n "$FA_GIT" ] || missing+=("the FlashAttention git directory (argument 1 or FA_GIT)")
[ -n "$QUACK_GIT" ] || missing+=("the quack git directory (argument 2 or QUACK_GIT)")
if [ ${#missing[@]} -gt 0 ]; then
  printf 'build.sh: missing %s\n' "${missing[@]}" >&2
  echo "$usage" >&2
  exit 2
fi
# A clone's work tree stands for its .git folder.
[ -d "$FA_GIT/.git" ] && FA_GIT=$FA_GIT/.git
[ -d "$QUACK_GIT/.git" ] && QUACK_GIT=$QUACK_GIT/.git
for git_dir in "$FA_GIT" "$QUACK_GIT"; do
  git --git-dir="$git_dir" rev-parse --git-dir >/dev/null 2>&1 || {
    echo "build.sh: $git_dir is not a git directory" >&2; echo "$usage" >&2; exit 2; }
done
if [ -z "${PY:-}" ]; then
  if [ -x "$REPO/.venv/bin/python" ]; then PY=$REPO/.venv/bin/python; else PY=python3; fi
fi
PARTS=${FA4_PARTS:-bwd fwd}
FA_REV=${FA_REV:-0251105a2fb19d2957484b7f023cd8c115286ced}
QUACK_REV=${QUACK_REV:-c8ec3170057987da0ec99883736f381ea1937cf3}
WORK=${WORK:-/tmp/jaxflash_fa4_compare}
KEY=fa4-sm90a-bf16-d128-dv128-m80n128

# The toolchain jaxflash links its variant libraries with (jaxflash.build.find_toolchain) and
# the CuTe DSL runtime's folder (it holds libcuda_dialect_runtime_static.a).
eval "$(PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "$PY" - <<'PYEOF'
import os, shlex
from jaxflash.build import find_toolchain
from jaxflash.kernels.compile import load_dsl_runtime_path
tc = find_toolchain()
for name, value in (("CXX", tc.cxx), ("CUDA_INCLUDE", tc.cuda_include),
                    ("CUDART_STATIC", tc.cudart_static),
                    ("DSL_LIB", os.path.dirname(load_dsl_runtime_path()))):
  print(f"{name}={shlex.quote(str(value))}")
PYEOF
)"

rm -rf "$WORK" && mkdir -p "$WORK/src" "$WORK/build"
# The subtree alone: a clone without its LFS objects cannot archive files outside it.
git --git-dir="$FA_GIT" archive --prefix=flash_attn/cute/ "$FA_REV:flash_attn/cute" \
  | tar -x -C "$WORK/src"
git --git-dir="$QUACK_GIT" archive "$QUACK_REV" quack | tar -x -C "$WORK/src"

if [[ " $PARTS " == *" bwd "* ]]; then
# 1. compile + export (FA4_GQA_GROUPS must match FA4_GROUPS in fa4_glue.cc)
FA4_SRC="$WORK/src" FA4_GQA_GROUPS=1,2,3,4,8 PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" \
  "$PY" "$HERE/build_kernels.py" "$WORK/build"

# 2. link: only the kernel_abi.h functions are exported
out="$REPO/.selftest/fa4"
mkdir -p "$out"
"$CXX" -std=c++17 -O2 -shared -fPIC -fvisibility=hidden \
  -o "$out/$KEY.so" "$HERE/fa4_glue.cc" \
  -I"$WORK/build" -I"$REPO/jaxflash/ffi" -isystem "$CUDA_INCLUDE" \
  "$WORK"/build/fa4_bwd_*.o \
  "$DSL_LIB/libcuda_dialect_runtime_static.a" "$CUDART_STATIC" \
  -Wl,--version-script="$HERE/exports.map" -Wl,--exclude-libs,ALL -s -ldl -lrt -lpthread

# 3. CPU checks: SASS counts per kernel, ABI smoke test (dlopen; no GPU needed)
PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "$PY" "$HERE/inspect_sass.py" "$WORK/build" \
  | tee "$out/sass_summary.txt"
"$CXX" -x c -O1 -o "$WORK/build/abi_check" "$HERE/abi_check.c" -I"$REPO/jaxflash/ffi" -ldl
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
fi

# The forward: one library per (head_dim, causal), each with the group sizes the forward
# self-test's shapes use (FA4_FWD_GROUPS here and FA4_GQA_GROUPS in build_fwd_kernels.py).
if [[ " $PARTS " == *" fwd "* ]]; then
  FWD_TAG_DIR=${FWD_TAG_DIR:-/tmp/jaxflash_selftest_fwd/fa4}
  groups=1,2,3,8
  build="$WORK/build_fwd"
  FA4_SRC="$WORK/src" FA4_FWD_CONFIGS=64:0,64:1,128:0,128:1 FA4_GQA_GROUPS=$groups \
    PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "$PY" "$HERE/build_fwd_kernels.py" "$build"
  "$CXX" -x c -O1 -o "$build/abi_check_fwd" "$HERE/abi_check_fwd.c" -I"$REPO/jaxflash/ffi" -ldl
  rm -rf "$FWD_TAG_DIR" && mkdir -p "$FWD_TAG_DIR"
  for cfg in 64:0 64:1 128:0 128:1; do
    d=${cfg%:*} c=${cfg#*:}
    name=d${d}_c${c}
    # FA-4's tile for this config (build_fwd_kernels.py wrote what it built with).
    read -r tm tn < <("$PY" - "$build/fwd_config.json" "$name" <<'PYEOF'
import json, sys
c = json.load(open(sys.argv[1]))["configs"][sys.argv[2]]
print(c["m_block_size"], c["n_block_size"])
PYEOF
)
    mask=""
    if [ "$c" = 1 ]; then mask=-causal; fi
    key=fwd-sm90a-bf16-d$d-dv$d$mask-m${tm}n${tn}s2+fa4
    mkdir -p "$build/$name"
    {
      for g in ${groups//,/ }; do echo "#include \"fa4_fwd_${name}_g$g.h\""; done
      printf '#define FA4_FWD_GROUPS(X)'; for g in ${groups//,/ }; do printf ' X(%s)' "$g"; done
      echo
      echo "#define FA4_FWD_NAME(G, suffix) fa4_fwd_${name}_g##G##suffix"
      echo "#define FA4_FWD_WRAPPER(G) cute_dsl_fa4_fwd_${name}_g##G##_wrapper"
      echo "#define FA4_HEAD_DIM $d"
      echo "#define FA4_CAUSAL $c"
      echo "#define FA4_TILE_M $tm"
      echo "#define FA4_TILE_N $tn"
      echo "#define FA4_KEY \"$key\""
    } >"$build/$name/fa4_fwd_kernels.h"
    objs=()
    for g in ${groups//,/ }; do objs+=("$build/fa4_fwd_${name}_g$g.o"); done
    "$CXX" -std=c++17 -O2 -shared -fPIC -fvisibility=hidden \
      -o "$FWD_TAG_DIR/$key.so" "$HERE/fa4_fwd_glue.cc" \
      -I"$build/$name" -I"$build" -I"$REPO/jaxflash/ffi" -isystem "$CUDA_INCLUDE" "${objs[@]}" \
      "$DSL_LIB/libcuda_dialect_runtime_static.a" "$CUDART_STATIC" \
      -Wl,--version-script="$HERE/exports_fwd.map" -Wl,--exclude-libs,ALL -s -ldl -lrt -lpthread
    "$build/abi_check_fwd" "$FWD_TAG_DIR/$key.so" "$key" "$d" "$c"
  done
  PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "$PY" "$HERE/inspect_sass.py" "$build" \
    | tee "$FWD_TAG_DIR/sass_summary.txt"
  ls -l "$FWD_TAG_DIR"
fi
