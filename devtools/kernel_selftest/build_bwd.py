"""Builds backward variant libraries + bwd_selftest into .selftest/bwd/ for one GPU call.

devtools, not shipped. Writes the git-ignored folder .selftest/bwd/: bwd_selftest (binary) and
libs.tar.xz (stripped bwd libraries, plus bf16 forward libraries for fwd+bwd timing). On the GPU
host: `bash devtools/kernel_selftest/run_bwd.sh` (carry .selftest/bwd).

  python devtools/kernel_selftest/build_bwd.py                       # every shipped bwd variant
  python devtools/kernel_selftest/build_bwd.py --dtypes bf16 --head-dims 128 --no-fwd
"""

from __future__ import annotations

import argparse
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile
import time

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from jaxflash import build as jaxflash_build, config  # noqa: E402

def _forward_builder():
  """devtools/kernel_selftest/build.py, loaded by path (a `build/` folder must not shadow it)."""
  import importlib.util
  spec = importlib.util.spec_from_file_location("selftest_build",
                                                pathlib.Path(__file__).with_name("build.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module

_DTYPE = {"bf16": "bfloat16", "f16": "float16"}
_SASS_OP = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)", re.M)


def _selected(direction, dtypes, head_dims, det_modes):
  for v in config.shipped_variants("sm90a", direction):
    if (v.dtype in dtypes and v.head_dim in head_dims
        and (direction == "fwd" or v.deterministic in det_modes)):
      yield v


def build_one(variant, work: pathlib.Path) -> pathlib.Path:
  """Exports, links and strips one variant; prints compile time and SASS facts."""
  from jaxflash.kernels import compile as kc

  t = time.perf_counter()
  exp = kc.export_variant(variant, work / "obj")
  lib = work / f"{variant.key}.so"
  jaxflash_build.link_variant(exp, variant, lib)
  subprocess.run(["strip", "--strip-unneeded", str(lib)], check=True)
  facts = []
  for name, cubin in zip(("main", "pre", "post"), (exp.cubin, *exp.extra_cubins)):
    sass = kc.disassemble(cubin, work / "obj")
    (work / "obj" / f"{variant.key}-{name}.sass").write_text(sass)
    ops = [m.group(1).split(".")[0] for m in _SASS_OP.finditer(sass)]
    counts = {op: ops.count(op) for op in ("HGMMA", "UTMALDG", "UBLKRED", "LDL", "STL")}
    regs = re.search(r"REG:(\d+)", kc.resource_usage(cubin, work / "obj"))
    facts.append(f"{name}: regs {regs and regs.group(1)} {counts}")
    if counts["LDL"] or counts["STL"]:
      print(f"  WARNING: local-memory traffic in {variant.key} ({name})")
  print(f"{variant.key}: compile {exp.compile_seconds:.1f}s total "
        f"{time.perf_counter() - t:.1f}s; " + "; ".join(facts), flush=True)
  return lib


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--work", default="/tmp/jaxflash_selftest_bwd_work")
  p.add_argument("--dtypes", default="bf16,f16")
  p.add_argument("--head-dims", default=",".join(str(d) for d in config.BWD_KERNEL_HEAD_DIMS))
  p.add_argument("--det", default="both", choices=("both", "0", "1"))
  p.add_argument("--no-fwd", action="store_true", help="skip the forward libraries (timing)")
  p.add_argument("--fwd-from", help="take already built forward libraries (fwd-*.so) from here")
  args = p.parse_args()
  work = pathlib.Path(args.work)
  shutil.rmtree(work, ignore_errors=True)
  (work / "obj").mkdir(parents=True)
  dtypes = [_DTYPE[x] for x in args.dtypes.split(",")]
  head_dims = [int(x) for x in args.head_dims.split(",")]
  det_modes = {"both": (False, True), "0": (False,), "1": (True,)}[args.det]
  # bf16 first: run_bwd.sh runs the libraries in archive order.
  dtypes.sort(key=lambda d: d != "bfloat16")
  libs = [("bwd", build_one(v, work)) for dt in dtypes
          for v in _selected("bwd", (dt,), head_dims, det_modes)]
  if args.fwd_from:
    # Any tile: bwd_selftest picks the forward library by dtype, head_dim and causal only.
    libs += [("fwd", lib) for d in head_dims
             for lib in sorted(pathlib.Path(args.fwd_from).glob(f"fwd-sm90a-bf16-d{d}-dv{d}-*.so"))]
  elif not args.no_fwd:
    libs += [("fwd", build_one(v, work))
             for v in _selected("fwd", ("bfloat16",), head_dims, (False,))]
  out = REPO / ".selftest" / "bwd"
  shutil.rmtree(out, ignore_errors=True)
  out.mkdir(parents=True)
  _forward_builder().compile_selftest("bwd_selftest.cc", out / "bwd_selftest")
  with tarfile.open(out / "libs.tar.xz", "w:xz") as tar:
    for i, (kind, lib) in enumerate(libs):
      # The numeric prefix keeps the build order when run_bwd.sh globs the files.
      tar.add(lib, arcname=f"{kind}/{i:02d}_{lib.name}" if kind == "bwd" else f"fwd/{lib.name}")
  size = sum(f.stat().st_size for f in out.iterdir())
  print(f"packed {len(libs)} libraries into {out}: {size / 1e6:.1f} MB")


if __name__ == "__main__":
  main()
