"""`python -m jaxflash.build`: variant -> CuTe DSL export -> linked library; kernel wheels.

Only variant builds import `jaxflash.kernels` (nvidia-cutlass-dsl), lazily; the handler library
needs g++ and CUDA headers alone. Nothing imports this module at `import jaxflash`.
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import contextlib
import dataclasses
import datetime
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Callable, Optional, Sequence

from jaxflash import config, kernel_store
from jaxflash.config import (HANDLER_LIBRARY, VARIANT_LIBRARY, VARIANT_MANIFEST,
                             KernelVariant)
from jaxflash.kernel_store import abi_version, read_json

_FFI_SRC = Path(__file__).resolve().parent / "ffi"
_KERNELS_SRC = Path(__file__).resolve().parent / "kernels"
_HANDLER_SOURCES = ("handlers.cc", "variant_registry.cc")
_HANDLER_HEADERS = ("kernel_abi.h", "variant_registry.h")
_VARIANT_SOURCES = ("variant_fwd.cc", "variant_bwd.cc", "variant_decode.cc")
_VARIANT_HEADERS = ("kernel_abi.h", "tensor_args.h", "variant_common.h", "variant_load.h")
_CXXFLAGS = ("-std=c++17", "-O2", "-shared", "-fPIC")
# Hide the static CUDA runtime's symbols: each library keeps its own copy, and nothing outside
# it can bind to them. -s strips the static symbol table (the dynamic one stays).
_LDFLAGS = ("-Wl,--exclude-libs,ALL", "-s", "-ldl", "-lrt", "-lpthread")
_CUTLASS_DIST = "nvidia-cutlass-dsl"
# The C ABI of kernel_abi.h that every variant library must export: the common functions plus
# the entry of its direction.
_COMMON_ABI_SYMBOLS = ("jaxflash_variant_abi_version", "jaxflash_variant_key",
                       "jaxflash_variant_info", "jaxflash_variant_load")
VARIANT_ABI_SYMBOLS = _COMMON_ABI_SYMBOLS + ("jaxflash_variant_fwd",)
BWD_VARIANT_ABI_SYMBOLS = _COMMON_ABI_SYMBOLS + ("jaxflash_variant_bwd",)
DECODE_VARIANT_ABI_SYMBOLS = _COMMON_ABI_SYMBOLS + ("jaxflash_variant_decode",)


def variant_abi_symbols(direction: str) -> tuple[str, ...]:
  """The dynamic symbols a variant library of `direction` (config.DIRECTIONS) exports, exactly."""
  symbols = {"fwd": VARIANT_ABI_SYMBOLS, "bwd": BWD_VARIANT_ABI_SYMBOLS,
             "decode": DECODE_VARIANT_ABI_SYMBOLS}
  if direction not in symbols:
    raise ValueError(f"direction: {direction!r} unknown; accepted: {config.DIRECTIONS}")
  return symbols[direction]


class BuildError(RuntimeError):
  """A missing tool or a failed build step; the message names the fix."""


# ---------------------------------------------------------------------------------------------
# Tools

@dataclasses.dataclass(frozen=True)
class Toolchain:
  """What linking needs: a C++ compiler, CUDA headers and the static CUDA runtime."""

  cxx: str
  cuda_include: Path
  cudart_static: Path
  ffi_include: Path


def _cuda_roots() -> list[Path]:
  roots = [os.environ.get(v) for v in ("CUDA_HOME", "CUDA_PATH")]
  roots.append("/usr/local/cuda")
  nvcc = shutil.which("nvcc")
  if nvcc:
    roots.append(str(Path(nvcc).resolve().parent.parent))
  # CUDA runtime wheels: nvidia-cuda-runtime (cu13 layout, then cu12 layout).
  purelib = Path(sysconfig.get_paths()["purelib"])
  roots += [str(purelib / "nvidia" / "cu13"), str(purelib / "nvidia" / "cuda_runtime")]
  return [Path(r) for r in roots if r]


def find_toolchain() -> Toolchain:
  """Locates g++ (or $CXX), cuda_runtime_api.h and libcudart_static.a; BuildError if missing."""
  cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
  if not cxx or not shutil.which(cxx):
    raise BuildError("no C++ compiler found (looked for $CXX, g++, c++): install one, e.g. "
                     "`apt-get install g++`, or set CXX=/path/to/g++")
  roots = _cuda_roots()
  include = next((r / "include" for r in roots if (r / "include" / "cuda_runtime_api.h").is_file()),
                 None)
  where = ", ".join(str(r) for r in roots)
  if include is None:
    raise BuildError(f"CUDA headers (cuda_runtime_api.h) not found under {where}: install the CUDA "
                     "toolkit or `pip install nvidia-cuda-runtime`, or set CUDA_HOME")
  candidates = [r / sub / "libcudart_static.a"
                for r in roots for sub in ("lib64", "lib", "lib/x64")]
  cudart = next((c for c in candidates if c.is_file()), None)
  if cudart is None:
    raise BuildError(f"the static CUDA runtime libcudart_static.a was not found under {where}: "
                     "install the CUDA toolkit (cuda-cudart-dev), or set CUDA_HOME")
  import jax.ffi  # jax is a dependency; only its FFI header folder is needed here
  return Toolchain(cxx=cxx, cuda_include=include, cudart_static=cudart,
                   ffi_include=Path(jax.ffi.include_dir()))


def cutlass_version() -> Optional[str]:
  """The installed nvidia-cutlass-dsl version, or None."""
  try:
    return importlib.metadata.version(_CUTLASS_DIST)
  except importlib.metadata.PackageNotFoundError:
    return None


def require_cutlass() -> str:
  version = cutlass_version()
  if version is None or importlib.util.find_spec("cutlass") is None:
    raise BuildError("building kernel variants needs nvidia-cutlass-dsl: `pip install "
                     "'jaxflash[build]'` (or `pip install nvidia-cutlass-dsl[cu13]`); a host "
                     "without it can use prebuilt kernels through JAXFLASH_CACHE_DIR")
  return version


def _dsl_runtime_static() -> Path:
  """libcuda_dialect_runtime_static.a: defines the runtime calls the exported object makes."""
  from cutlass.runtime import find_runtime_libraries
  for lib in find_runtime_libraries(enable_tvm_ffi=False):
    path = Path(lib).parent / "libcuda_dialect_runtime_static.a"
    if path.is_file():
      return path
  raise BuildError("libcuda_dialect_runtime_static.a not found next to the CuTe DSL runtime "
                   "(`python -m cutlass.cute.export.aot_config --libdir`); reinstall "
                   "nvidia-cutlass-dsl[cu13]")


def _find_cuobjdump() -> Optional[str]:
  found = shutil.which("cuobjdump")
  if found:
    return found
  purelib = Path(sysconfig.get_paths()["purelib"])
  for cand in (purelib / "nvidia" / "cu13" / "bin" / "cuobjdump",
               purelib / "nvidia" / "cuda_cuobjdump" / "bin" / "cuobjdump",
               Path("/usr/local/cuda/bin/cuobjdump")):
    if cand.is_file():
      return str(cand)
  return None


def _run(cmd: Sequence[str], what: str) -> str:
  proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, check=False)
  if proc.returncode != 0:
    raise BuildError(f"{what} failed (exit {proc.returncode}):\n  {' '.join(map(str, cmd))}\n"
                     f"{proc.stdout}{proc.stderr}")
  return proc.stdout


# ---------------------------------------------------------------------------------------------
# Helpers

def _sha256(paths: Sequence[Path]) -> str:
  h = hashlib.sha256()
  for p in paths:
    h.update(p.name.encode())
    h.update(p.read_bytes())
  return h.hexdigest()


def _write_json(path: Path, data: dict) -> None:
  tmp = path.with_suffix(path.suffix + ".tmp")
  tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
  os.replace(tmp, path)


@contextlib.contextmanager
def _locked(path: Path):
  """Serializes builds of one artifact across processes (lowering may build concurrently)."""
  path.parent.mkdir(parents=True, exist_ok=True)
  with open(path, "w") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def exported_symbols(library: Path) -> set[str]:
  """Defined dynamic symbols of a shared library (nm -D)."""
  nm = shutil.which("nm")
  if nm is None:
    raise BuildError("`nm` not found: install binutils")
  out = _run([nm, "-D", "--defined-only", library], "nm")
  return {line.split()[-1] for line in out.splitlines() if line.strip()}


# ---------------------------------------------------------------------------------------------
# Handler library

def _handler_sources() -> list[Path]:
  return [_FFI_SRC / n for n in _HANDLER_SOURCES + _HANDLER_HEADERS]


def _handler_stamp() -> dict:
  return {"sources_sha256": _sha256(_handler_sources()), "abi_version": abi_version()}


def handler_library_is_current(folder: Path, stamp: Optional[dict] = None) -> bool:
  """<folder>/libjaxflash_ffi.so was built from this package's handler sources and ABI
  (`stamp`: _handler_stamp(), when the caller has it already)."""
  lib = Path(folder) / HANDLER_LIBRARY
  have = read_json(lib.with_suffix(".json")) or {}
  want = _handler_stamp() if stamp is None else stamp
  return lib.is_file() and all(have.get(k) == v for k, v in want.items())


def build_handler_library(cache: Path, *, force: bool = False,
                          toolchain: Optional[Toolchain] = None) -> tuple[Path, bool]:
  """Compiles ffi/handlers.cc into <cache>/libjaxflash_ffi.so; returns (path, rebuilt)."""
  cache = Path(cache)
  lib = cache / HANDLER_LIBRARY
  stamp = lib.with_suffix(".json")
  want = _handler_stamp()
  with _locked(cache / ".locks" / "handler.lock"):
    if not force and handler_library_is_current(cache, want):
      return lib, False
    tc = toolchain or find_toolchain()
    tmp = lib.with_name(f".{lib.name}.{os.getpid()}.tmp")
    _run([tc.cxx, *_CXXFLAGS, "-o", tmp, *(_FFI_SRC / s for s in _HANDLER_SOURCES),
          "-isystem", tc.ffi_include, "-isystem", tc.cuda_include, tc.cudart_static, *_LDFLAGS],
         "compiling the FFI handler library")
    os.replace(tmp, lib)
    _write_json(stamp, dict(want, jax=importlib.metadata.version("jax"), cxx=tc.cxx,
                            built_at=datetime.datetime.now().isoformat(timespec="seconds")))
  return lib, True


# ---------------------------------------------------------------------------------------------
# Variant libraries

def variant_spec(variant: KernelVariant) -> dict:
  return dataclasses.asdict(variant)


def _variant_sources() -> list[Path]:
  """Everything a variant library is made from besides its spec: a change forces a rebuild."""
  return sorted(_KERNELS_SRC.rglob("*.py")) + [_FFI_SRC / n for n in (*_VARIANT_SOURCES,
                                                                      *_VARIANT_HEADERS)]


def _expected_manifest(variant: KernelVariant) -> dict:
  import jaxflash
  return {"key": variant.key, "spec": variant_spec(variant), "abi_version": abi_version(),
          "jaxflash_version": jaxflash.__version__, "cutlass_version": cutlass_version(),
          "source_sha256": _sha256(_variant_sources())}


def manifest_is_current(variant: KernelVariant, cache: Path) -> bool:
  """True when <cache>/<key> holds a library built from this spec, sources and tools."""
  folder = Path(cache) / variant.key
  have = read_json(folder / VARIANT_MANIFEST)
  if have is None or not (folder / VARIANT_LIBRARY).is_file():
    return False
  return all(have.get(k) == v for k, v in _expected_manifest(variant).items())


def cubin_resources(cubin: Path) -> Optional[dict]:
  """Registers, static shared memory, local memory and LDL/STL count per kernel (cuobjdump)."""
  tool = _find_cuobjdump()
  if tool is None:
    return None
  usage = _run([tool, "--dump-resource-usage", cubin], "cuobjdump --dump-resource-usage")
  kernels = []
  for name, fields in re.findall(r"Function ([^\s:]+):\s*\n\s*(.+)", usage):
    values = dict(re.findall(r"([A-Z_\[\]0-9]+):(\d+)", fields))
    kernels.append({"name": name, "registers": int(values.get("REG", -1)),
                    "shared_static_bytes": int(values.get("SHARED", -1)),
                    "local_bytes": int(values.get("LOCAL", -1)),
                    "stack_bytes": int(values.get("STACK", -1))})
  sass = _run([tool, "-sass", cubin], "cuobjdump -sass")
  spills = len(re.findall(r"\b(?:LDL|STL)\b", sass))
  return {"kernels": kernels, "local_memory_instructions": spills}


def link_variant(exported, variant: KernelVariant, out: Path,
                 tc: Optional[Toolchain] = None) -> None:
  """g++ links the glue (variant_{fwd,bwd,decode}.cc, per variant via macros) with the exported
  objects.

  A backward variant has three objects (preprocess, main, postprocess): all are linked. The one
  link line of the project: the cache build, the compile tests and the self-test builders use it.
  """
  tc = tc or find_toolchain()
  dsl_static = _dsl_runtime_static()
  out = Path(out)
  # Export the kernel_abi.h functions only: the exported object's own symbols and the static
  # runtimes stay private, so variants never bind to each other's copies. -Bsymbolic binds the
  # library's calls to its own exported functions (an entry point's RefuseOrLoad calls
  # jaxflash_variant_load) inside it: loaded RTLD_GLOBAL after another variant, it would
  # otherwise call that variant's loader.
  script = out.with_suffix(".map")
  script.write_text("{ global: jaxflash_variant_*; local: *; };\n")
  _run([tc.cxx, *_CXXFLAGS, "-fvisibility=hidden", "-o", out, *exported.defines,
        _FFI_SRC / exported.glue_source, exported.object_path, *exported.extra_object_paths,
        "-I", _FFI_SRC,
        "-isystem", tc.cuda_include, dsl_static, tc.cudart_static,
        f"-Wl,--version-script={script}", "-Wl,-Bsymbolic", *_LDFLAGS],
       f"linking variant {variant.key}")
  missing = set(variant_abi_symbols(variant.direction)) - exported_symbols(out)
  if missing:
    raise BuildError(f"variant {variant.key}: {out.name} does not export {sorted(missing)}")


@contextlib.contextmanager
def _staged(cache: Path, name: str):
  """Yields an empty staging folder in `cache`; on success it replaces <cache>/<name> by renames.

  A reader sees the old folder or the complete new one, never a half-written one (a rebuild
  leaves a moment with neither, which a reader takes as missing). The caller holds the lock.
  """
  for left in cache.glob(f".{name}.staging-*"):  # from a killed build; the lock is ours
    shutil.rmtree(left, ignore_errors=True)
  staging = Path(tempfile.mkdtemp(prefix=f".{name}.staging-", dir=cache))
  try:
    yield staging
    target = cache / name
    if target.exists():
      retired = Path(tempfile.mkdtemp(prefix=f".{name}.retired-", dir=cache))
      os.rename(target, retired / name)  # a loaded library stays valid: its inode lives on
      os.rename(staging, target)
      shutil.rmtree(retired, ignore_errors=True)
    else:
      os.rename(staging, target)
  except BaseException:
    shutil.rmtree(staging, ignore_errors=True)
    raise


def install_once(cache: Path, name: str, is_current: Callable[[], bool],
                 produce: Callable[[Path], None]) -> bool:
  """Makes <cache>/<name> with `produce(staging_folder)` unless `is_current()`; True if it did.

  A file lock (<cache>/.locks/<name>.lock) makes processes that need the same folder build it
  once: the others wait, then find it current. The folder appears by one rename (`_staged`).
  """
  cache = Path(cache)
  cache.mkdir(parents=True, exist_ok=True)
  with _locked(cache / ".locks" / f"{name}.lock"):
    if is_current():
      return False
    with _staged(cache, name) as staging:
      produce(staging)
  return True


def _produce_variant(variant: KernelVariant, folder: Path) -> dict:
  """Exports and links `variant` into the empty `folder`; writes and returns its manifest."""
  require_cutlass()
  tc = find_toolchain()
  from jaxflash.kernels import compile as kernel_compile
  start = time.perf_counter()
  with tempfile.TemporaryDirectory(prefix=".export-", dir=folder) as tmp:
    exported = kernel_compile.export_variant(variant, tmp)
    link_variant(exported, variant, Path(tmp) / VARIANT_LIBRARY, tc)
    os.replace(Path(tmp) / VARIANT_LIBRARY, folder / VARIANT_LIBRARY)
  cubin = folder / "kernel.cubin"
  cubin.write_bytes(exported.cubin)
  # Backward: the preprocess and postprocess kernels' device code, next to the main one.
  extra_cubins = {}
  for name, blob in zip(("kernel-pre.cubin", "kernel-post.cubin"), exported.extra_cubins):
    (folder / name).write_bytes(blob)
    extra_cubins[name] = hashlib.sha256(blob).hexdigest()
  try:
    resources = cubin_resources(cubin)
    for name in extra_cubins if resources else ():  # one table over all kernels
      more = cubin_resources(folder / name)
      resources["kernels"] += more["kernels"]
      resources["local_memory_instructions"] += more["local_memory_instructions"]
  except BuildError as e:  # inspection is informative only; the library is fine
    resources = {"error": str(e)}
  manifest = dict(
      _expected_manifest(variant), library=VARIANT_LIBRARY,
      library_sha256=hashlib.sha256((folder / VARIANT_LIBRARY).read_bytes()).hexdigest(),
      cubin="kernel.cubin",
      cubin_sha256=hashlib.sha256(exported.cubin).hexdigest(), extra_cubins=extra_cubins,
      function_prefix=exported.function_prefix, resources=resources,
      compile_seconds=round(exported.compile_seconds, 2),
      build_seconds=round(time.perf_counter() - start, 2),
      built_at=datetime.datetime.now().isoformat(timespec="seconds"),
      jax_version=importlib.metadata.version("jax"), cxx=tc.cxx)
  _write_json(folder / VARIANT_MANIFEST, manifest)
  return manifest


def build_variant(variant: KernelVariant, cache: Path, *, force: bool = False) -> dict:
  """Exports, links and describes one variant into <cache>/<key>/; returns its manifest.

  Skips the work (returns the stored manifest with "up_to_date": True) when it is current,
  also when another process built it meanwhile (`install_once`).
  """
  cache = Path(cache)
  made = {}
  built = install_once(cache, variant.key,
                       lambda: not force and manifest_is_current(variant, cache),
                       lambda staging: made.update(_produce_variant(variant, staging)))
  if not built:
    return dict(read_json(cache / variant.key / VARIANT_MANIFEST), up_to_date=True)
  return dict(made, up_to_date=False)


# ---------------------------------------------------------------------------------------------
# Driver

def _summary(manifest: dict) -> str:
  res = manifest.get("resources")
  if not res or "error" in res:
    return "no resource info (cuobjdump missing or failed)"
  regs = max((k["registers"] for k in res["kernels"]), default=-1)
  smem = max((k["shared_static_bytes"] for k in res["kernels"]), default=-1)
  spill = res["local_memory_instructions"]
  return f"regs {regs}, static smem {smem} B, " + (f"{spill} LDL/STL" if spill else "no spills")


def _build_one(variant: KernelVariant, cache: str, force: bool) -> dict:
  """Process-pool entry (top level so that it pickles)."""
  return build_variant(variant, Path(cache), force=force)


def build(variants: Sequence[KernelVariant], cache: Path, *, force: bool = False, jobs: int = 1,
          log: Callable[[str], None] = print) -> list[dict]:
  """Builds the handler library and `variants` into `cache`, printing one line per variant.

  Raises BuildError after trying every variant if any failed.
  """
  cache = Path(cache)
  cache.mkdir(parents=True, exist_ok=True)
  start = time.perf_counter()
  lib, rebuilt = build_handler_library(cache, force=force)
  log(f"  handler library {lib.name}: {'built' if rebuilt else 'up to date'} "
      f"({time.perf_counter() - start:.1f} s)")
  total, results, failures = len(variants), [], []
  width = len(str(total))

  def report(i, variant, started, manifest, error):
    if error is not None:
      failures.append(variant.key)
      log(f"  [{i:>{width}}/{total}] {variant.key}: FAILED: {error}")
      return
    results.append(manifest)
    state = ("up to date" if manifest["up_to_date"] else
             f"built in {time.perf_counter() - started:.1f} s, {_summary(manifest)}")
    log(f"  [{i:>{width}}/{total}] {variant.key}: {state}")

  if jobs <= 1:
    for i, variant in enumerate(variants, 1):
      started = time.perf_counter()
      try:
        report(i, variant, started, build_variant(variant, cache, force=force), None)
      except Exception as e:  # report it, then try the others
        report(i, variant, started, None, e)
  else:
    # Separate processes: the DSL compiler holds the GIL; "spawn" avoids forking its state.
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
      started = time.perf_counter()
      futs = {pool.submit(_build_one, v, str(cache), force): v for v in variants}
      for i, fut in enumerate(concurrent.futures.as_completed(futs), 1):
        error = fut.exception()
        report(i, futs[fut], started, None if error else fut.result(), error)
  if failures:
    raise BuildError(f"{len(failures)} of {total} variants failed: {', '.join(failures)}")
  return results


def cache_size_bytes(cache: Path) -> int:
  return sum(p.stat().st_size for p in Path(cache).rglob("*") if p.is_file())


def prune_cache(cache: Path) -> list[str]:
  """Removes variant folders whose key no shipped variant has (e.g. after a tile-table change).

  Only folders holding a variant manifest or library are touched. Returns the removed keys.
  """
  shipped = {v.key for arch in config.KERNEL_ARCHS for direction in config.DIRECTIONS
             for v in config.shipped_variants(arch, direction=direction)}
  removed = []
  for folder in sorted(Path(cache).iterdir()) if Path(cache).is_dir() else ():
    is_variant = (folder / VARIANT_MANIFEST).is_file() or (folder / VARIANT_LIBRARY).is_file()
    if folder.name.startswith("."):
      continue  # a build's staging folder, or the locks
    if folder.is_dir() and is_variant and folder.name not in shipped:
      shutil.rmtree(folder)
      removed.append(folder.name)
  return removed


def variant_state(variant: KernelVariant, cache_dir: Optional[Path] = None) -> str:
  """`--list`'s state of `variant`: "ready (wheel)", "ready (cache)", "stale (cache)" or "missing".

  "stale" only on a build host (nvidia-cutlass-dsl installed) whose kernel sources or tools
  differ from the cached build's; its first use rebuilds it. `cache_dir` stands in for
  $JAXFLASH_CACHE_DIR.
  """
  found = kernel_store.locate(variant.key, variant.arch, cache_dir)
  if found is None:
    return "missing"
  if (found.kind == "cache" and cutlass_version() is not None
      and not manifest_is_current(variant, found.path)):
    return "stale (cache)"
  return f"ready ({found.kind})"


# ---------------------------------------------------------------------------------------------
# Kernel wheel

_WHEEL_INIT = '''"""Prebuilt jaxflash kernels for {arch} (jaxflash {version}, kernel ABI {abi}).

Made by `python -m jaxflash.build --wheel`. jaxflash finds this folder by itself (see
jaxflash.kernel_store); nothing here is meant to be imported.
"""
'''


def _wheel_platform_tag() -> str:
  return sysconfig.get_platform().replace("-", "_").replace(".", "_")


def _record_hash(data: bytes) -> str:
  digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
  return "sha256=" + digest.decode()


def write_wheel(variants: Sequence[KernelVariant], cache: Path, out_dir: Path) -> Path:
  """Packs the handler library and the built `variants` of `cache` into a kernel wheel.

  The wheel installs the package jaxflash_kernels_<arch>: a kernel folder (config's layout,
  without the cubins, which the libraries embed) plus kernels.json: the jaxflash version, kernel
  ABI, arch and variant keys it holds. Every variant must be current in `cache` (BuildError if
  not). The bytes depend on the inputs only (fixed timestamps). Returns the wheel's path.
  """
  cache, out_dir = Path(cache), Path(out_dir)
  arches = {v.arch for v in variants}
  if len(arches) != 1:
    raise BuildError(f"a kernel wheel holds one arch; the variants span {sorted(arches)}")
  (arch,) = arches
  stale = [v.key for v in variants if not manifest_is_current(v, cache)]
  if stale or not handler_library_is_current(cache):
    raise BuildError(f"{cache} lacks current builds of {stale or [HANDLER_LIBRARY]}: build "
                     f"them first")
  package, version, abi = (kernel_store.wheel_package(arch), kernel_store.jaxflash_version(),
                           abi_version())
  info = {"jaxflash_version": version, "kernel_abi": abi, "arch": arch,
          "variants": sorted(v.key for v in variants)}
  handler_stamp = Path(HANDLER_LIBRARY).with_suffix(".json").name
  files = [
      (f"{package}/__init__.py", _WHEEL_INIT.format(arch=arch, version=version, abi=abi).encode()),
      (f"{package}/{config.KERNEL_WHEEL_INFO}",
       (json.dumps(info, indent=2, sort_keys=True) + "\n").encode()),
      (f"{package}/{HANDLER_LIBRARY}", (cache / HANDLER_LIBRARY).read_bytes()),
      (f"{package}/{handler_stamp}", (cache / handler_stamp).read_bytes()),
  ]
  for v in sorted(variants, key=lambda v: v.key):
    for name in (VARIANT_LIBRARY, VARIANT_MANIFEST):
      files.append((f"{package}/{v.key}/{name}", (cache / v.key / name).read_bytes()))
  tag = f"py3-none-{_wheel_platform_tag()}"
  dist_info = f"{package}-{version}.dist-info"
  metadata = (f"Metadata-Version: 2.1\nName: {package.replace('_', '-')}\nVersion: {version}\n"
              f"Summary: Prebuilt jaxflash {version} attention kernels for {arch} "
              f"({len(variants)} variants, kernel ABI {abi})\n")
  files += [
      (f"{dist_info}/METADATA", metadata.encode()),
      (f"{dist_info}/WHEEL", (f"Wheel-Version: 1.0\nGenerator: jaxflash.build\n"
                              f"Root-Is-Purelib: false\nTag: {tag}\n").encode()),
      (f"{dist_info}/top_level.txt", f"{package}\n".encode()),
  ]
  record = "".join(f"{name},{_record_hash(data)},{len(data)}\n" for name, data in files)
  files.append((f"{dist_info}/RECORD", (record + f"{dist_info}/RECORD,,\n").encode()))
  out_dir.mkdir(parents=True, exist_ok=True)
  wheel = out_dir / f"{package}-{version}-{tag}.whl"
  tmp = wheel.with_name(f".{wheel.name}.{os.getpid()}.tmp")
  with zipfile.ZipFile(tmp, "w") as zf:
    for name, data in files:
      entry = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
      entry.external_attr = (0o755 if name.endswith(".so") else 0o644) << 16
      entry.compress_type = zipfile.ZIP_DEFLATED
      zf.writestr(entry, data)
  os.replace(tmp, wheel)
  return wheel


def _select(args) -> list[KernelVariant]:
  if args.spec:
    # A variant that is never shipped (score_mod / mask_mod ones): its spec as a JSON file.
    try:
      return [config.variant_from_spec(read_json(args.spec) or {})]
    except ValueError as e:
      raise SystemExit(f"jaxflash.build: --spec {args.spec}: {e}") from e
  shipped = [v for direction in config.DIRECTIONS
             for v in config.shipped_variants(args.arch, direction=direction)]
  if not args.variants:
    return shipped
  by_key = {v.key: v for v in shipped}
  unknown = [k for k in args.variants if k not in by_key]
  if unknown:
    raise SystemExit(f"jaxflash.build: unknown variant key(s) {unknown}; known for {args.arch}:\n  "
                     + "\n  ".join(by_key))
  return [by_key[k] for k in args.variants]


def main(argv: Optional[Sequence[str]] = None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m jaxflash.build",
      description="Prebuild jaxflash kernel variants (CuTe DSL -> linked library) into the cache.")
  parser.add_argument("--arch", default="sm90a", choices=config.KERNEL_ARCHS)
  which = parser.add_mutually_exclusive_group()
  which.add_argument("--variants", nargs="+", metavar="KEY", help="variant keys to build")
  which.add_argument("--all", action="store_true", help="every shipped variant (the default)")
  which.add_argument("--spec", type=Path, metavar="JSON",
                     help="the variant whose spec (dataclasses.asdict of a KernelVariant) this "
                          "file holds: one that is not shipped, e.g. a score_mod / mask_mod "
                          "variant")
  parser.add_argument("--cache-dir", type=Path, default=None,
                      help="default: $JAXFLASH_CACHE_DIR or ~/.cache/jaxflash/<version>")
  parser.add_argument("--jobs", type=int, default=1, help="parallel build processes")
  parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
  parser.add_argument("--list", action="store_true",
                      help="list variant keys and their state: ready (wheel), ready (cache), "
                           "stale (cache) or missing")
  parser.add_argument("--wheel", type=Path, metavar="OUTDIR",
                      help="build the variants, then write a kernel wheel of them into OUTDIR")
  parser.add_argument("--prune", action="store_true",
                      help="also delete cached variants that are no longer shipped (stale keys)")
  args = parser.parse_args(argv)
  cache = (args.cache_dir or kernel_store.build_dir()).expanduser().resolve()
  variants = _select(args)
  if args.list:
    given = args.cache_dir and cache
    for v in variants:
      print(f"{v.key}  {variant_state(v, given)}")
    return 0
  print(f"jaxflash.build: {len(variants)} variant(s) for {args.arch} into {cache} "
        f"(jobs {args.jobs})")
  start = time.perf_counter()
  try:
    results = build(variants, cache, force=args.force, jobs=args.jobs)
  except BuildError as e:
    print(f"jaxflash.build: error: {e}", file=sys.stderr)
    return 1
  if args.prune:
    for key in prune_cache(cache):
      print(f"pruned stale variant {key}")
  built = sum(not r["up_to_date"] for r in results)
  print(f"done: {len(results)} variant(s), {built} built, {len(results) - built} up to date, in "
        f"{time.perf_counter() - start:.1f} s; cache {cache_size_bytes(cache) / 2**20:.1f} MiB")
  if args.wheel:
    try:
      wheel = write_wheel(variants, cache, args.wheel.expanduser())
    except BuildError as e:
      print(f"jaxflash.build: error: {e}", file=sys.stderr)
      return 1
    print(f"kernel wheel: {wheel} ({wheel.stat().st_size / 2**20:.1f} MiB); install it on a GPU "
          f"host with `pip install {wheel.name}`")
  return 0


if __name__ == "__main__":
  sys.exit(main())
