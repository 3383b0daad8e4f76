r"""Builds backward variant libraries + bwd_selftest into .selftest/bwd/ for one GPU call.

devtools, not shipped. Writes the git-ignored folder .selftest/bwd/: bwd_selftest (binary) and
libs.tar.xz (stripped bwd libraries, plus bf16 forward libraries for fwd+bwd timing). On the GPU
host: `bash devtools/kernel_selftest/run_bwd.sh` (carry .selftest/bwd).

  python devtools/kernel_selftest/build_bwd.py                       # every shipped bwd variant
  python devtools/kernel_selftest/build_bwd.py --dtypes bf16 --head-dims 128 --no-fwd
  python devtools/kernel_selftest/build_bwd.py --head-dims 128 --kernel-arg swap_sdp=0 --ab
  python devtools/kernel_selftest/build_bwd.py --dtypes bf16 --head-dims 192x128   # MLA shape
  python devtools/kernel_selftest/build_bwd.py --head-dims 128 --causal 0 --no-fwd --append \
      --tile 128=64x128x2swap

--kernel-arg NAME=VALUE (A/B builds) passes an extra FlashAttentionBackwardSm90 constructor
argument to every selected variant; the libraries' keys get '+NAME=VALUE' (build.py's rule).
(swap_sdp=0 builds the unswapped schedule of a swap_sdp tile.)
--tile D=MxNxSTAGES[swap] replaces the default tile of head_dim D ("swap": swap_sdp).
"""

from __future__ import annotations

import argparse
import dataclasses
import io
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


def _selected(direction, dtypes, pairs, det_modes, tiles=None, causal_modes=(False, True)):
  """Variants of `direction` for the (head_dim, head_dim_v) pairs. A backward pair that ships no
  variant (head_dim_v != head_dim, e.g. 192x128 before its GPU check) takes the head_dim's
  shipped variants with head_dim_v replaced (the kernel's can_implement decides)."""
  shipped = config.shipped_variants("sm90a", direction)
  have = {(v.head_dim, v.head_dim_v) for v in shipped}
  for v in shipped:
    if not (v.dtype in dtypes and v.causal in causal_modes
            and (direction == "fwd" or v.deterministic in det_modes)):
      continue
    for d, dv in pairs:
      if (v.head_dim, v.head_dim_v) == (d, dv):
        chosen = v
      elif direction == "bwd" and (d, dv) not in have and v.head_dim == v.head_dim_v == d:
        chosen = dataclasses.replace(v, head_dim_v=dv)
      else:
        continue
      if direction == "bwd" and tiles and chosen.head_dim in tiles:
        chosen = dataclasses.replace(chosen, tile=tiles[chosen.head_dim])
      yield chosen


def _parse_tiles(items):
  """['128=64x128x2', '96=64x128x2swap'] -> {128: TileConfig(64, 128, 2), 96: ...swap_sdp=True}."""
  tiles = {}
  for item in items:
    d, spec = item.split("=")
    tiles[int(d)] = _forward_builder().parse_tile_spec(spec)
  return tiles


def build_one(variant, work: pathlib.Path, kernel_args=None) -> pathlib.Path:
  """Exports, links and strips one variant; prints compile time and SASS facts.

  kernel_args (backward only): extra main-kernel constructor arguments; the library key gets
  build.py's '+name=value' suffix so A/B libraries have distinct names.
  """
  from jaxflash.kernels import compile as kc

  t = time.perf_counter()
  key = variant.key
  if kernel_args:
    key = _forward_builder().key_with_args(key, kernel_args)
    exp = kc.export_bwd_variant(variant, work / "obj", main_args=kernel_args, key=key)
  else:
    exp = kc.export_variant(variant, work / "obj")
  lib = work / f"{key}.so"
  jaxflash_build.link_variant(exp, variant, lib)
  subprocess.run(["strip", "--strip-unneeded", str(lib)], check=True)
  facts = []
  for name, cubin in zip(("main", "pre", "post"), (exp.cubin, *exp.extra_cubins)):
    sass = kc.disassemble(cubin, work / "obj")
    (work / "obj" / f"{key}-{name}.sass").write_text(sass)
    ops = [m.group(1).split(".")[0] for m in _SASS_OP.finditer(sass)]
    counts = {op: ops.count(op) for op in ("HGMMA", "UTMALDG", "UBLKRED", "LDL", "STL")}
    regs = re.search(r"REG:(\d+)", kc.resource_usage(cubin, work / "obj"))
    # Launch registers (regs) vs the highest register the code touches: the consumer
    # warpgroups run under setmaxnreg 240, so that is their headroom.
    top = max((int(r) for r in re.findall(r"\bR(\d+)\b", sass)), default=0)
    facts.append(f"{name}: regs {regs and regs.group(1)} max R{top} {counts}")
    if counts["LDL"] or counts["STL"]:
      print(f"  WARNING: local-memory traffic in {key} ({name})")
  print(f"{key}: compile {exp.compile_seconds:.1f}s total "
        f"{time.perf_counter() - t:.1f}s; " + "; ".join(facts), flush=True)
  return lib


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--work", default="/tmp/jaxflash_selftest_bwd_work")
  p.add_argument("--dtypes", default="bf16,f16")
  p.add_argument("--head-dims",
                 default=_forward_builder()._format_head_dims(config.BWD_KERNEL_HEAD_DIM_PAIRS),
                 help="D or DxDV items (head_dim x head_dim_v), e.g. 64,128,192x128")
  p.add_argument("--det", default="both", choices=("both", "0", "1"))
  p.add_argument("--causal", default="both", choices=("both", "0", "1"),
                 help="backward variants without (0) / with (1) the causal mask")
  p.add_argument("--no-fwd", action="store_true", help="skip the forward libraries (timing)")
  p.add_argument("--fwd-from", help="take already built forward libraries (fwd-*.so) from here")
  p.add_argument("--kernel-arg", action="append", default=[],
                 help="NAME=VALUE passed to FlashAttentionBackwardSm90 (A/B builds)")
  p.add_argument("--tile", action="append", default=[],
                 help="D=MxNxSTAGES backward tile override for head_dim D")
  p.add_argument("--ab", action="store_true",
                 help="with --kernel-arg / --tile: also pack the default libraries, each right "
                      "before its variant (A/B in one GPU run)")
  p.add_argument("--append", action="store_true",
                 help="keep the libraries already packed in .selftest/bwd and add these "
                      "(several --kernel-arg / --tile sets in one GPU run)")
  args = p.parse_args()
  kernel_args = _forward_builder()._parse_kernel_args(args.kernel_arg)
  tiles = _parse_tiles(args.tile)
  work = pathlib.Path(args.work)
  shutil.rmtree(work, ignore_errors=True)
  (work / "obj").mkdir(parents=True)
  dtypes = [_DTYPE[x] for x in args.dtypes.split(",")]
  pairs = _forward_builder()._parse_head_dims(args.head_dims)
  det_modes = {"both": (False, True), "0": (False,), "1": (True,)}[args.det]
  causal_modes = {"both": (False, True), "0": (False,), "1": (True,)}[args.causal]
  # bf16 first: run_bwd.sh runs the libraries in archive order.
  dtypes.sort(key=lambda d: d != "bfloat16")
  libs = []
  for dt in dtypes:
    for v in _selected("bwd", (dt,), pairs, det_modes, tiles, causal_modes):
      if args.ab:
        default = next(d for d in _selected("bwd", (dt,), [(v.head_dim, v.head_dim_v)],
                                            (v.deterministic,)) if d.causal == v.causal)
        libs.append(("bwd", build_one(default, work)))
      libs.append(("bwd", build_one(v, work, kernel_args)))
  if args.fwd_from:
    # Any tile: bwd_selftest picks the forward library by dtype, head_dim and causal only.
    libs += [("fwd", lib) for d, dv in pairs
             for lib in sorted(pathlib.Path(args.fwd_from).glob(f"fwd-sm90a-bf16-d{d}-dv{dv}-*.so"))]
  elif not args.no_fwd:
    libs += [("fwd", build_one(v, work))
             for v in _selected("fwd", ("bfloat16",), pairs, (False,))]
  out = REPO / ".selftest" / "bwd"
  kept = {}  # arcname -> bytes of the libraries already packed (--append)
  if args.append and (out / "libs.tar.xz").exists():
    with tarfile.open(out / "libs.tar.xz") as old:
      kept = {m.name: old.extractfile(m).read() for m in old.getmembers() if m.isfile()}
  shutil.rmtree(out, ignore_errors=True)
  out.mkdir(parents=True)
  _forward_builder().compile_selftest("bwd_selftest.cc", out / "bwd_selftest")
  first = sum(name.startswith("bwd/") for name in kept)
  with tarfile.open(out / "libs.tar.xz", "w:xz") as tar:
    for name, data in kept.items():
      info = tarfile.TarInfo(name)
      info.size = len(data)
      tar.addfile(info, io.BytesIO(data))
    for i, (kind, lib) in enumerate(libs, start=first):
      # The numeric prefix keeps the build order when run_bwd.sh globs the files.
      name = f"{kind}/{i:02d}_{lib.name}" if kind == "bwd" else f"fwd/{lib.name}"
      if name not in kept:
        tar.add(lib, arcname=name)
  size = sum(f.stat().st_size for f in out.iterdir())
  print(f"packed {len(libs) + len(kept)} libraries into {out}: {size / 1e6:.1f} MB")


if __name__ == "__main__":
  main()
