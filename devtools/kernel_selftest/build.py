"""Builds forward variant libraries and the fwd_selftest binary for one GPU run (devtools).

`--tag T` exports, links and strips the selected forward variants into <work>/T/ and prints
each one's compile time, registers, shared memory and SASS counts. `--pack T1,T2,...` writes
the git-ignored folder .selftest/ at the repo root: fwd_selftest (the binary) and libs.tar.xz
(the libraries of those tags, in that order). On the GPU host, with .selftest carried:
`bash devtools/kernel_selftest/run.sh`.

  python devtools/kernel_selftest/build.py --tag base                  # every shipped variant
  python devtools/kernel_selftest/build.py --tag n160 --dtypes bf16 --head-dims 128 --causal 0 \\
      --schedule 128:tile_n=160
  python devtools/kernel_selftest/build.py --pack base,n160

--schedule D[xDV]:field=value[,field=value...] (repeatable) replaces fields of the schedule
(jaxflash.config.FwdSchedule) of every selected variant of head dims D x DV (DV defaults to
D); ints are plain numbers, bools 0 or 1. Such an A/B library's key, and its file name, get
the suffix '+field=value,...' (sorted). build_bwd.py shares these helpers.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import typing

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from jaxflash import build as jaxflash_build, config  # noqa: E402

ARCH = "sm90a"
DTYPES = {"bf16": "bfloat16", "f16": "float16"}
CAUSAL_MODES = {"both": (False, True), "0": (False,), "1": (True,)}
_SASS_OP = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)", re.M)


class SpecError(ValueError):
  """A bad command-line value; the message names it and what is accepted."""


class BuildFailed(RuntimeError):
  """A variant the kernel refused (an assertion on its schedule) or that failed to build."""


# ---------------------------------------------------------------------------------------------
# Command-line values

def parse_dtypes(text: str) -> list[str]:
  """'bf16,f16' -> ['bfloat16', 'float16']."""
  out = []
  for item in text.split(","):
    if item not in DTYPES:
      raise SpecError(f"--dtypes: {item!r} unknown; accepted: {', '.join(DTYPES)}")
    out.append(DTYPES[item])
  return out


def parse_head_dims(text: str) -> list[tuple[int, int]]:
  """'64,192x128' -> [(64, 64), (192, 128)]: head_dim, or head_dim x head_dim_v."""
  pairs = []
  for item in text.split(","):
    d, _, dv = item.partition("x")
    if not d.isdigit() or not (dv.isdigit() or dv == ""):
      raise SpecError(f"head dims {item!r}: expected D or DxDV (e.g. 128 or 192x128)")
    pairs.append((int(d), int(dv or d)))
  return pairs


def format_head_dims(pairs) -> str:
  """[(64, 64), (192, 128)] -> '64,192x128' (the inverse of parse_head_dims)."""
  return ",".join(str(d) if d == dv else f"{d}x{dv}" for d, dv in pairs)


def check_shipped(direction: str, pairs) -> None:
  """SpecError unless every (head_dim, head_dim_v) pair has a `direction` kernel."""
  shipped = config.KERNEL_HEAD_DIM_PAIRS[direction]
  unknown = [p for p in pairs if p not in shipped]
  if unknown:
    raise SpecError(f"--head-dims: {format_head_dims(unknown)} has no {direction} kernel; "
                    f"accepted: {format_head_dims(shipped)}")


def _parse_field(schedule_cls, name: str, text: str):
  """The value of schedule field `name` from its command-line text, by the field's type."""
  kind = typing.get_type_hints(schedule_cls)[name]
  optional = type(None) in typing.get_args(kind)
  if optional:
    (kind,) = [t for t in typing.get_args(kind) if t is not type(None)]
    if text == "none":
      return None
  if kind is bool:
    if text in ("0", "1"):
      return text == "1"
    accepted = "0 or 1"
  elif kind is int:
    if re.fullmatch(r"-?\d+", text):
      return int(text)
    accepted = "an integer"
  else:
    raise SpecError(f"--schedule: field {name} ({kind}) cannot be set from the command line")
  accepted += " or none" if optional else ""
  raise SpecError(f"--schedule: {name}={text!r}: {name} takes {accepted}")


def parse_schedules(items, schedule_cls) -> dict[tuple[int, int], dict]:
  """['128:tile_n=160', '192x128:num_stages=1,pingpong=0'] -> {(128, 128): {'tile_n': 160},
  (192, 128): {'num_stages': 1, 'pingpong': False}}; fields of `schedule_cls` only, values
  parsed by each field's type. Several items for one pair are merged (the last value wins)."""
  fields = [f.name for f in dataclasses.fields(schedule_cls)]
  out: dict[tuple[int, int], dict] = {}
  for item in items:
    dims, sep, assignments = item.partition(":")
    if not sep or not assignments:
      raise SpecError(f"--schedule {item!r}: expected D[xDV]:field=value[,field=value...]")
    pairs = parse_head_dims(dims)
    if len(pairs) != 1:
      raise SpecError(f"--schedule {item!r}: one head-dim pair per --schedule")
    for assignment in assignments.split(","):
      name, eq, text = assignment.partition("=")
      if name not in fields:
        raise SpecError(f"--schedule {item!r}: unknown field {name!r} of "
                        f"{schedule_cls.__name__}; accepted: {', '.join(fields)}")
      if not eq:
        raise SpecError(f"--schedule {item!r}: expected {name}=VALUE")
      out.setdefault(pairs[0], {})[name] = _parse_field(schedule_cls, name, text)
  return out


def check_schedule_pairs(schedules: dict, pairs) -> None:
  """SpecError when a --schedule names head dims that --head-dims does not select."""
  unused = [p for p in schedules if p not in pairs]
  if unused:
    raise SpecError(f"--schedule for {format_head_dims(unused)}: not among --head-dims "
                    f"{format_head_dims(pairs)}")


def _value_text(value) -> str:
  if value is None:
    return "none"
  return str(int(value)) if isinstance(value, bool) else str(value)


def ab_suffix(overrides: dict) -> str:
  """'+field=value,...' (sorted; bools as 0/1) of an A/B build, '' without overrides."""
  if not overrides:
    return ""
  return "+" + ",".join(f"{k}={_value_text(v)}" for k, v in sorted(overrides.items()))


def with_schedule(variant: config.KernelVariant, overrides: dict) -> config.KernelVariant:
  """`variant` with `overrides` applied to its schedule."""
  if not overrides:
    return variant
  return dataclasses.replace(variant, schedule=dataclasses.replace(variant.schedule, **overrides))


# ---------------------------------------------------------------------------------------------
# Building

def fwd_variants(dtypes, pairs, causal_modes):
  """The forward variants of the selection, with their shipped schedules."""
  for dtype in dtypes:
    for d, dv in pairs:
      for causal in causal_modes:
        cfg = config.AttentionConfig(softmax_scale=1.0, causal=causal)
        yield config.KernelVariant.for_call("fwd", ARCH, dtype, d, dv, cfg)


def _sass_facts(kc, cubin: bytes, work: pathlib.Path, name: str, ops_of_interest) -> str:
  sass = kc.disassemble(cubin, work)
  (work / f"{name}.sass").write_text(sass)
  ops = [m.group(1).split(".")[0] for m in _SASS_OP.finditer(sass)]
  counts = {op: ops.count(op) for op in ops_of_interest}
  res = kc.resource_usage(cubin, work)
  found = {k: re.search(rf"{k}:(\d+)", res) for k in ("REG", "SHARED", "STACK")}
  regs, smem, stack = (m and m.group(1) for m in found.values())
  # Launch registers vs the highest register the code touches (setmaxnreg moves the bound).
  top = max((int(r) for r in re.findall(r"\bR(\d+)\b", sass)), default=0)
  warn = " WARNING: local-memory traffic" if counts.get("LDL") or counts.get("STL") else ""
  return f"{name}: regs {regs} max R{top} static-smem {smem} stack {stack} {counts}{warn}"


def build_library(variant: config.KernelVariant, overrides: dict,
                  work: pathlib.Path) -> pathlib.Path:
  """Exports, links and strips one library into work/<key>.so; prints compile time and SASS
  facts. `variant` carries the shipped schedule; `overrides` (an A/B build) are applied to it
  and its library key gets ab_suffix(overrides)."""
  from jaxflash.kernels import compile as kc

  start = time.perf_counter()
  variant = with_schedule(variant, overrides)
  key = variant.key + ab_suffix(overrides)
  # Build paths without the suffix's ',' (g++ splits -Wl,... options at commas).
  obj = work / "obj" / re.sub(r"[^0-9A-Za-z._-]", "_", key)
  shutil.rmtree(obj, ignore_errors=True)
  try:
    exported = kc.export_variant(variant, obj)
  except Exception as e:  # the kernels assert what a schedule must satisfy
    raise BuildFailed(f"{key}: export failed ({type(e).__name__}: {e})") from e
  if overrides:
    old = f'"{variant.key}"'
    defines = tuple(d.replace(old, f'"{key}"') if d.startswith("-DJAXFLASH_VARIANT_KEY=") else d
                    for d in exported.defines)
    assert defines != exported.defines, "no -DJAXFLASH_VARIANT_KEY define to rename"
    exported = dataclasses.replace(exported, defines=defines)
  linked = obj / "variant.so"
  jaxflash_build.link_variant(exported, variant, linked)
  subprocess.run(["strip", "--strip-unneeded", str(linked)], check=True)
  lib = work / f"{key}.so"
  linked.replace(lib)
  if variant.direction == "fwd":
    parts, ops = ("main",), ("HGMMA", "MUFU", "BAR", "LDL", "STL")
  else:
    parts, ops = ("main", "pre", "post"), ("HGMMA", "UTMALDG", "UBLKRED", "LDL", "STL")
  facts = [_sass_facts(kc, cubin, obj, name, ops)
           for name, cubin in zip(parts, (exported.cubin, *exported.extra_cubins))]
  print(f"{key}: compile {exported.compile_seconds:.1f}s total "
        f"{time.perf_counter() - start:.1f}s\n  " + "\n  ".join(facts), flush=True)
  return lib


def compile_selftest(source: str, output: pathlib.Path) -> None:
  """Builds a self-test binary (a .cc beside this file) against the static CUDA runtime, with
  the toolchain the variant libraries are linked with (jaxflash.build.find_toolchain)."""
  tc = jaxflash_build.find_toolchain()
  subprocess.run([tc.cxx, "-std=c++17", "-O2", "-pthread",
                  str(pathlib.Path(__file__).with_name(source)),
                  "-I", str(REPO / "jaxflash" / "ffi"), "-isystem", str(tc.cuda_include),
                  str(tc.cudart_static), "-ldl", "-lrt", "-lpthread", "-o", str(output)],
                 check=True)


def default_work(name: str) -> pathlib.Path:
  return pathlib.Path(tempfile.gettempdir()) / name


# ---------------------------------------------------------------------------------------------
# Driver

def build(args) -> None:
  dtypes = parse_dtypes(args.dtypes)
  pairs = parse_head_dims(args.head_dims)
  check_shipped("fwd", pairs)
  schedules = parse_schedules(args.schedule, config.FwdSchedule)
  check_schedule_pairs(schedules, pairs)
  tag_dir = pathlib.Path(args.work) / args.tag
  shutil.rmtree(tag_dir, ignore_errors=True)
  (tag_dir / "obj").mkdir(parents=True)
  for v in fwd_variants(dtypes, pairs, CAUSAL_MODES[args.causal]):
    build_library(v, schedules.get((v.head_dim, v.head_dim_v), {}), tag_dir)


def pack(args) -> None:
  out = REPO / ".selftest"
  out.mkdir(exist_ok=True)
  for name in ("fwd_selftest", "libs.tar.xz"):
    (out / name).unlink(missing_ok=True)
  tags = args.pack.split(",")
  missing = [t for t in tags if not (pathlib.Path(args.work) / t).is_dir()]
  if missing:
    raise SpecError(f"--pack: no build for tag(s) {', '.join(missing)} in {args.work}")
  compile_selftest("fwd_selftest.cc", out / "fwd_selftest")
  with tarfile.open(out / "libs.tar.xz", "w:xz") as tar:
    for i, tag in enumerate(tags):
      # The numeric prefix keeps the packing order when run.sh globs the folders.
      for lib in sorted((pathlib.Path(args.work) / tag).glob("*.so")):
        tar.add(lib, arcname=f"{i:02d}_{tag}/{lib.name}")
  sizes = sum((out / n).stat().st_size for n in ("fwd_selftest", "libs.tar.xz"))
  print(f"packed {args.pack} into {out}: {sizes / 1e6:.1f} MB")


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--tag", help="build the selected variants into <work>/<tag>")
  p.add_argument("--pack", help="comma-separated tags to pack into .selftest/")
  p.add_argument("--work", default=str(default_work("jaxflash_selftest_fwd")),
                 help="folder of the tags (default: %(default)s)")
  p.add_argument("--dtypes", default="bf16,f16", help=f"comma-separated: {', '.join(DTYPES)}")
  p.add_argument("--head-dims", default=format_head_dims(config.KERNEL_HEAD_DIM_PAIRS["fwd"]),
                 help="comma-separated D or DxDV (head_dim x head_dim_v); default: every "
                      "shipped pair")
  p.add_argument("--causal", default="both", choices=tuple(CAUSAL_MODES))
  p.add_argument("--schedule", action="append", default=[], metavar="SPEC",
                 help="D[xDV]:field=value[,...]: FwdSchedule fields of the variants of D x DV "
                      "(A/B builds; repeatable)")
  p.add_argument("--capture-probe", action="store_true",
                  help="also compile .selftest/capture_probe (see capture_probe.sh)")
  args = p.parse_args()
  if not args.tag and not args.pack and not args.capture_probe:
    p.error("give --tag, --pack and/or --capture-probe")
  if args.capture_probe:
    (REPO / ".selftest").mkdir(exist_ok=True)
    compile_selftest("capture_probe.cc", REPO / ".selftest" / "capture_probe")
    print(f"built {REPO / '.selftest' / 'capture_probe'}")
  try:
    if args.tag:
      build(args)
    if args.pack:
      pack(args)
  except SpecError as e:
    p.error(str(e))
  except BuildFailed as e:
    sys.exit(f"build.py: error: {e}")


if __name__ == "__main__":
  main()
