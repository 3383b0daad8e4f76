"""Builds forward variant libraries + the self-test binary for one GPU call (devtools, not shipped).

Libraries go to a work folder (one subfolder per --tag); `--pack` writes the git-ignored folder
.selftest/ at the repo root: fwd_selftest (binary) and libs.tar.xz (the stripped libraries of the
packed tags, a few MB). On the GPU host: `bash devtools/kernel_selftest/run.sh` (carry .selftest).

  python devtools/kernel_selftest/build.py --tag v1                 # the shipped variants
  python devtools/kernel_selftest/build.py --tag mla --head-dims 192x128 --tile 192x128=128x96x2
  python devtools/kernel_selftest/build.py --tag t64 --dtypes bf16 --head-dims 64 --tile 64=192x128x2
  python devtools/kernel_selftest/build.py --tag pp0 --kernel-arg pingpong=0 --head-dims 128
  python devtools/kernel_selftest/build.py --tag r8 --rescale-threshold 8 --dtypes bf16
  python devtools/kernel_selftest/build.py --pack v1,t64,pp0
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
import time

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from jaxflash import build as jaxflash_build, config  # noqa: E402

_DTYPE = {"bf16": "bfloat16", "f16": "float16"}
_SASS_OP = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)", re.M)


def _parse_head_dims(text):
  """'64,192x128' -> [(64, 64), (192, 128)]: head_dim, or head_dim x head_dim_v."""
  pairs = []
  for item in text.split(","):
    d, _, dv = item.partition("x")
    pairs.append((int(d), int(dv or d)))
  return pairs


def _format_head_dims(pairs):
  """[(64, 64), (192, 128)] -> '64,192x128' (the inverse of _parse_head_dims)."""
  return ",".join(str(d) if d == dv else f"{d}x{dv}" for d, dv in pairs)


def parse_tile_spec(spec: str) -> config.TileConfig:
  """'192x128x2' -> TileConfig(192, 128, 2); a 'swap' suffix sets swap_sdp (backward only)."""
  m, n, s = (int(x) for x in spec.removesuffix("swap").split("x"))
  return config.TileConfig(m, n, s, swap_sdp=spec.endswith("swap"))


def _parse_tiles(items):
  """['64=192x128x2', '192x128=128x96x2'] -> {(64, 64): TileConfig(192, 128, 2), ...}."""
  tiles = {}
  for item in items:
    dims, spec = item.split("=")
    (pair,) = _parse_head_dims(dims)
    tiles[pair] = parse_tile_spec(spec)
  return tiles


def _parse_kernel_args(items):
  """['pingpong=0', 'x=2.5', 'det_sync=no_wait'] -> {'pingpong': False, 'x': 2.5, 'det_sync':
  'no_wait'}; 0/1 become bools, numbers int or float, anything else stays a string."""
  out = {}
  for item in items:
    name, value = item.split("=")
    if value in ("0", "1"):
      out[name] = bool(int(value))
    elif re.fullmatch(r"-?\d+", value):
      out[name] = int(value)
    else:
      try:
        out[name] = float(value)
      except ValueError:
        out[name] = value
  return out


def key_with_args(key: str, kernel_args: dict) -> str:
  """A variant key plus '+name=value,...' of an A/B build's kernel arguments (sorted)."""
  return key + "+" + ",".join(f"{k}={_arg_text(v)}" for k, v in sorted(kernel_args.items()))


def _arg_text(value) -> str:
  """Kernel argument in a library key: bools as 0/1, numbers in shortest form (8.0 -> 8)."""
  if isinstance(value, str):
    return value
  return str(int(value)) if isinstance(value, bool) else f"{value:g}"


def variants(dtypes, head_dim_pairs, causal_modes, tiles):
  for dtype in dtypes:
    for d, dv in head_dim_pairs:
      for causal in causal_modes:
        cfg = config.AttentionConfig(softmax_scale=1.0, causal=causal)
        v = config.KernelVariant.for_call("fwd", "sm90a", _DTYPE[dtype], d, dv, cfg)
        if (d, dv) in tiles:
          v = dataclasses.replace(v, tile=tiles[(d, dv)])
        yield v


def export(variant, kernel_args, out_dir):
  """compile.export_variant, plus kernel constructor arguments for A/B builds."""
  import cutlass
  import cutlass.cute as cute
  from cutlass.cute.runtime import make_fake_stream
  from jaxflash.kernels import compile as kc
  from jaxflash.kernels.fwd_sm90 import DTYPES, FlashAttentionForwardSm90

  if not kernel_args:
    return kc.export_variant(variant, out_dir)
  kc.build_kernel(variant)  # same validation as the shipped path
  kernel = FlashAttentionForwardSm90(DTYPES[variant.dtype], variant.head_dim, variant.head_dim_v,
                                     variant.tile, variant.causal, **kernel_args)
  kc.load_dsl_runtime()
  prefix = kc.function_prefix(variant)
  start = time.perf_counter()
  compiled = cute.compile(kernel, *kc.fwd_signature(variant), cutlass.Float32(1.0),
                          make_fake_stream(), options="--gpu-arch sm_90a")
  compiled.export_to_c(str(out_dir), variant.key, prefix)
  seconds = time.perf_counter() - start
  obj = pathlib.Path(out_dir) / f"{variant.key}.o"
  header = (pathlib.Path(out_dir) / f"{variant.key}.h").resolve()
  key = key_with_args(variant.key, kernel_args)
  defines = tuple(f'-DJAXFLASH_VARIANT_KEY="{key}"' if d.startswith("-DJAXFLASH_VARIANT_KEY")
                  else d for d in kc.glue_defines(variant, prefix, header))
  return kc.ExportedKernel(variant=variant, header_path=header, object_path=obj.resolve(),
                           function_prefix=prefix, cubin=kc.extract_cubin(obj),
                           compile_seconds=seconds, defines=defines)


def compile_selftest(source: str, output: pathlib.Path) -> None:
  """g++ builds a self-test binary (a .cc beside this file) against the static CUDA runtime."""
  subprocess.run(["g++", "-std=c++17", "-O2", "-pthread",
                  str(pathlib.Path(__file__).with_name(source)),
                  f"-I{REPO / 'jaxflash' / 'ffi'}", "-I/usr/local/cuda/include",
                  "/usr/local/cuda/lib64/libcudart_static.a", "-ldl", "-lrt", "-lpthread",
                  "-o", str(output)], check=True)


def build(args):
  from jaxflash.kernels import compile as kc

  tag_dir = pathlib.Path(args.work) / args.tag
  shutil.rmtree(tag_dir, ignore_errors=True)
  (tag_dir / "obj").mkdir(parents=True)
  kernel_args = _parse_kernel_args(args.kernel_arg)
  if args.rescale_threshold is not None:
    kernel_args["rescale_threshold_log2"] = args.rescale_threshold
  causal_modes = {"both": (False, True), "0": (False,), "1": (True,)}[args.causal]
  for v in variants(args.dtypes.split(","), _parse_head_dims(args.head_dims),
                    causal_modes, _parse_tiles(args.tile)):
    t = time.perf_counter()
    exp = export(v, kernel_args, tag_dir / "obj")
    lib = tag_dir / f"{v.key}.so"
    jaxflash_build.link_variant(exp, v, lib)
    subprocess.run(["strip", "--strip-unneeded", str(lib)], check=True)
    sass = kc.disassemble(exp.cubin, tag_dir / "obj")
    (tag_dir / "obj" / f"{v.key}.sass").write_text(sass)
    ops = [m.group(1).split(".")[0] for m in _SASS_OP.finditer(sass)]
    counts = {op: ops.count(op) for op in ("HGMMA", "MUFU", "BAR", "LDL", "STL")}
    res = kc.resource_usage(exp.cubin, tag_dir / "obj")
    regs = re.search(r"REG:(\d+)", res)
    smem = re.search(r"SHARED:(\d+)", res)
    stack = re.search(r"STACK:(\d+)", res)
    print(f"{v.key}: compile {exp.compile_seconds:.1f}s total {time.perf_counter() - t:.1f}s "
          f"regs {regs and regs.group(1)} static-smem {smem and smem.group(1)} "
          f"stack {stack and stack.group(1)} {counts}", flush=True)
    if counts["LDL"] or counts["STL"]:
      print(f"  WARNING: local-memory traffic in {v.key}")


def pack(args):
  out = REPO / ".selftest"
  out.mkdir(exist_ok=True)
  for name in ("fwd_selftest", "libs.tar.xz"):
    (out / name).unlink(missing_ok=True)
  compile_selftest("fwd_selftest.cc", out / "fwd_selftest")
  with tarfile.open(out / "libs.tar.xz", "w:xz") as tar:
    for i, tag in enumerate(args.pack.split(",")):
      # The numeric prefix keeps the packing order when run.sh globs the folders.
      for lib in sorted((pathlib.Path(args.work) / tag).glob("*.so")):
        tar.add(lib, arcname=f"{i:02d}_{tag}/{lib.name}")
  sizes = sum((out / n).stat().st_size for n in ("fwd_selftest", "libs.tar.xz"))
  print(f"packed {args.pack} into {out}: {sizes / 1e6:.1f} MB")


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--tag", help="build the variants into <work>/<tag>")
  p.add_argument("--work", default="/tmp/jaxflash_selftest_work")
  p.add_argument("--dtypes", default="f16,bf16")
  p.add_argument("--head-dims", help="comma-separated D or DxDV (head_dim x head_dim_v)",
                 default=_format_head_dims(config.KERNEL_HEAD_DIM_PAIRS))
  p.add_argument("--causal", default="both", choices=("both", "0", "1"))
  p.add_argument("--tile", action="append", default=[],
                 help="D=MxNxSTAGES or DxDV=MxNxSTAGES tile override")
  p.add_argument("--kernel-arg", action="append", default=[],
                 help="NAME=VALUE passed to FlashAttentionForwardSm90 (A/B builds)")
  p.add_argument("--rescale-threshold", type=float,
                 help="rescale_threshold_log2 of the kernel (0 = rescale on every max change, "
                      "8 = FA-4's conditional rescaling); the library keys get "
                      "'+rescale_threshold_log2=T'")
  p.add_argument("--pack", help="comma-separated tags to pack into .selftest/")
  args = p.parse_args()
  if args.tag:
    build(args)
  if args.pack:
    pack(args)
  if not args.tag and not args.pack:
    p.error("give --tag and/or --pack")


if __name__ == "__main__":
  main()
