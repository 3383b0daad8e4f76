r"""Builds backward variant libraries and the bwd_selftest binary for one GPU run (devtools).

Writes the git-ignored folder .selftest/bwd/: bwd_selftest (the binary) and libs.tar.xz (the
stripped backward libraries under bwd/, in build order, plus bf16 forward libraries under fwd/
for the fwd+bwd timing). On the GPU host, with .selftest/bwd carried:
`bash devtools/kernel_selftest/run_bwd.sh`.

  python devtools/kernel_selftest/build_bwd.py                       # every shipped variant
  python devtools/kernel_selftest/build_bwd.py --dtypes bf16 --head-dims 128 --no-fwd
  python devtools/kernel_selftest/build_bwd.py --dtypes bf16 --head-dims 64 --causal 1 --det 0 \
      --no-fwd --schedule 64:tile_m=64,dq_split_m=0 --ab
  python devtools/kernel_selftest/build_bwd.py --dtypes bf16 --head-dims 192x128 --no-fwd \
      --append --schedule 192x128:dq_copies=1

--schedule D[xDV]:field=value[,field=value...] (repeatable) replaces fields of the schedule
(jaxflash.config.BwdSchedule) of every selected backward variant of head dims D x DV; such an
A/B library's key and file name get '+field=value,...' (build.py's rules). --ab packs each
A/B library right after the default library of the same variant (one GPU run compares them).
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import pathlib
import shutil
import sys
import tarfile

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from jaxflash import config  # noqa: E402


def _load_forward_builder():
  """devtools/kernel_selftest/build.py (its helpers), loaded by path: a `build/` folder on
  sys.path must not shadow it."""
  spec = importlib.util.spec_from_file_location("selftest_build",
                                                pathlib.Path(__file__).with_name("build.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


fb = _load_forward_builder()


def bwd_variants(dtypes, pairs, causal_modes, det_modes):
  """The backward variants of the selection, with their shipped schedules."""
  for dtype in dtypes:
    for d, dv in pairs:
      for causal in causal_modes:
        for det in det_modes:
          cfg = config.AttentionConfig(softmax_scale=1.0, causal=causal, deterministic=det)
          yield config.KernelVariant.for_call("bwd", fb.ARCH, dtype, d, dv, cfg)


def build_libraries(args, dtypes, pairs, schedules, work):
  """[(kind, library path)] in packing order: "bwd" then "fwd" (for the fwd+bwd timing)."""
  libs = []
  for v in bwd_variants(dtypes, pairs, fb.CAUSAL_MODES[args.causal],
                        fb.CAUSAL_MODES[args.det]):
    overrides = schedules.get((v.head_dim, v.head_dim_v), {})
    if args.ab and overrides:
      libs.append(("bwd", fb.build_library(v, {}, work)))
    libs.append(("bwd", fb.build_library(v, overrides, work)))
  if args.fwd_from:
    # Any schedule: bwd_selftest picks the forward library by what it reports (dtype, head
    # dims, causal), preferring a library without an A/B suffix.
    libs += [("fwd", lib) for d, dv in pairs
             for lib in sorted(pathlib.Path(args.fwd_from).glob(f"fwd-*-bf16-d{d}-dv{dv}-*.so"))]
  elif not args.no_fwd:
    libs += [("fwd", fb.build_library(v, {}, work))
             for v in fb.fwd_variants(("bfloat16",), pairs, fb.CAUSAL_MODES[args.causal])]
  return libs


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--work", default=str(fb.default_work("jaxflash_selftest_bwd")),
                 help="build folder (default: %(default)s)")
  p.add_argument("--dtypes", default="bf16,f16", help=f"comma-separated: {', '.join(fb.DTYPES)}")
  p.add_argument("--head-dims", default=fb.format_head_dims(config.KERNEL_HEAD_DIM_PAIRS["bwd"]),
                 help="comma-separated D or DxDV (head_dim x head_dim_v); default: every "
                      "shipped pair")
  p.add_argument("--det", default="both", choices=tuple(fb.CAUSAL_MODES),
                 help="non-deterministic (0) / deterministic (1) variants")
  p.add_argument("--causal", default="both", choices=tuple(fb.CAUSAL_MODES),
                 help="variants without (0) / with (1) the causal mask")
  p.add_argument("--schedule", action="append", default=[], metavar="SPEC",
                 help="D[xDV]:field=value[,...]: BwdSchedule fields of the variants of D x DV "
                      "(A/B builds; repeatable)")
  p.add_argument("--ab", action="store_true",
                 help="with --schedule: also build the default library of each A/B variant and "
                      "pack it right before it (A/B in one GPU run)")
  p.add_argument("--no-fwd", action="store_true",
                 help="no forward libraries (run_bwd.sh then skips the fwd+bwd timing)")
  p.add_argument("--fwd-from", help="take already built forward libraries (fwd-*.so) from here")
  p.add_argument("--append", action="store_true",
                 help="keep the libraries already packed in .selftest/bwd and add these "
                      "(several --schedule sets in one GPU run)")
  args = p.parse_args()
  try:
    dtypes = fb.parse_dtypes(args.dtypes)
    pairs = fb.parse_head_dims(args.head_dims)
    fb.check_shipped("bwd", pairs)
    schedules = fb.parse_schedules(args.schedule, config.BwdSchedule)
    fb.check_schedule_pairs(schedules, pairs)
  except fb.SpecError as e:
    p.error(str(e))
  if args.ab and not schedules:
    p.error("--ab compares against --schedule builds: give at least one --schedule")
  work = pathlib.Path(args.work)
  shutil.rmtree(work, ignore_errors=True)
  (work / "obj").mkdir(parents=True)
  # bf16 first: run_bwd.sh runs the libraries in archive order.
  dtypes.sort(key=lambda d: d != "bfloat16")
  try:
    libs = build_libraries(args, dtypes, pairs, schedules, work)
  except fb.BuildFailed as e:
    sys.exit(f"build_bwd.py: error: {e}")
  out = REPO / ".selftest" / "bwd"
  kept = {}  # arcname -> bytes of the libraries already packed (--append)
  if args.append and (out / "libs.tar.xz").exists():
    with tarfile.open(out / "libs.tar.xz") as old:
      kept = {m.name: old.extractfile(m).read() for m in old.getmembers() if m.isfile()}
  shutil.rmtree(out, ignore_errors=True)
  out.mkdir(parents=True)
  fb.compile_selftest("bwd_selftest.cc", out / "bwd_selftest")
  first = sum(name.startswith("bwd/") for name in kept)
  added = 0
  with tarfile.open(out / "libs.tar.xz", "w:xz") as tar:
    for name, data in kept.items():
      info = tarfile.TarInfo(name)
      info.size = len(data)
      tar.addfile(info, io.BytesIO(data))
    for i, (kind, lib) in enumerate(libs, start=first):
      # The numeric prefix keeps the build order when run_bwd.sh globs the files.
      name = f"bwd/{i:03d}_{lib.name}" if kind == "bwd" else f"fwd/{lib.name}"
      if name not in kept:
        tar.add(lib, arcname=name)
        added += 1
  size = sum(f.stat().st_size for f in out.iterdir())
  print(f"packed {added + len(kept)} libraries into {out}: {size / 1e6:.1f} MB")


if __name__ == "__main__":
  main()
