"""Loads the jaxflash FFI libraries and registers the XLA targets and kernel variants.

Takes each library from the first kernel folder that has it (`jaxflash.kernel_store`: the
developer's cache, the kernel wheel, the user cache) and builds a missing variant at its first
use where the build tools are installed. Knows variant keys, library paths and jax.ffi; nothing
of primitives, sharding or Flax.
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib.util
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from jaxflash import config, kernel_store
from jaxflash.config import (BWD_ATTRIBUTE_NAMES, BWD_TARGET, DECODE_ATTRIBUTE_NAMES,
                             DECODE_TARGET, FWD_ATTRIBUTE_NAMES, FWD_TARGET, HANDLER_LIBRARY,
                             VARIANT_LIBRARY, AttentionConfig, KernelVariant)

log = logging.getLogger("jaxflash")

# XLA_FFI_DEFINE_HANDLER_SYMBOL names in handlers.cc
_FWD_HANDLER_SYMBOL = "JaxflashAttentionFwd"
_BWD_HANDLER_SYMBOL = "JaxflashAttentionBwd"
_DECODE_HANDLER_SYMBOL = "JaxflashKvCacheAttention"
# The targets' instantiate stages: one per target, so that their errors name it.
_FWD_INSTANTIATE_SYMBOL = "JaxflashAttentionFwdInstantiate"
_BWD_INSTANTIATE_SYMBOL = "JaxflashAttentionBwdInstantiate"
_DECODE_INSTANTIATE_SYMBOL = "JaxflashKvCacheAttentionInstantiate"
# (target, instantiate symbol, execute symbol) of every target the handler library serves.
_TARGETS = ((FWD_TARGET, _FWD_INSTANTIATE_SYMBOL, _FWD_HANDLER_SYMBOL),
            (BWD_TARGET, _BWD_INSTANTIATE_SYMBOL, _BWD_HANDLER_SYMBOL),
            (DECODE_TARGET, _DECODE_INSTANTIATE_SYMBOL, _DECODE_HANDLER_SYMBOL))
_lock = threading.RLock()
_handler: Optional[ctypes.CDLL] = None
_variants: dict[str, Path] = {}  # key -> library registered in this process
# key -> why its on-demand build failed in this process: a later lowering raises it at once
# instead of rerunning a build of minutes, and variant_available reports it (so auto mode runs
# the reference). A new process builds again.
_failed_builds: dict[str, str] = {}
_prepared = False  # jaxflash_ffi_prepare ran (GPU hosts only)


def _cutlass_available() -> bool:
  return importlib.util.find_spec("cutlass") is not None


def cache_dir() -> Path:
  """Where this process builds kernels: $JAXFLASH_CACHE_DIR, else ~/.cache/jaxflash/<version>."""
  return kernel_store.build_dir()


def build_command(keys: Sequence[str] = (), cache: Optional[Path] = None) -> str:
  """The shell command that builds `keys` (every shipped variant if empty) into `cache`."""
  which = f"--variants {' '.join(keys)}" if keys else "--all"
  return f"python -m jaxflash.build {which} --cache-dir {cache or cache_dir()}"


def _cuda_device_present() -> bool:
  import jax
  try:
    return len(jax.devices("cuda")) > 0
  except RuntimeError:  # no CUDA backend in this jaxlib, or no device
    return False


def _handler_library() -> Path:
  """The handler library: the first current one in search order, else (re)built into the cache.

  Without a toolchain (a run host) an existing library from other sources is used as it is:
  the registry still checks each variant library's ABI version when it opens it.
  """
  from jaxflash import build
  folders = kernel_store.search_path()
  for folder in folders:
    if build.handler_library_is_current(folder.path):
      return folder.path / HANDLER_LIBRARY
  try:
    return build.build_handler_library(cache_dir())[0]
  except (build.BuildError, OSError) as e:
    existing = [f.path / HANDLER_LIBRARY for f in folders if (f.path / HANDLER_LIBRARY).is_file()]
    if existing:
      return existing[0]
    raise RuntimeError(
        f"jaxflash: the FFI handler library {HANDLER_LIBRARY} is in none of "
        f"{[str(f.path) for f in folders]} and cannot be built here: {e}\n"
        f"Install a kernel wheel (`python -m jaxflash.build --wheel OUTDIR` on any host), or "
        f"build on a build host with `{build_command()}` and point JAXFLASH_CACHE_DIR at that "
        f"folder.") from e


def _load_handler() -> ctypes.CDLL:
  """Loads libjaxflash_ffi.so once per process and registers FWD_TARGET, BWD_TARGET and
  DECODE_TARGET for CUDA."""
  global _handler
  if _handler is not None:
    return _handler
  lib = ctypes.CDLL(str(_handler_library()))
  lib.jaxflash_ffi_register_variant.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
  lib.jaxflash_ffi_register_variant.restype = ctypes.c_int32
  lib.jaxflash_ffi_last_error.restype = ctypes.c_char_p
  lib.jaxflash_ffi_prepare.restype = ctypes.c_int32
  lib.jaxflash_ffi_set_kernel_folders.argtypes = [ctypes.POINTER(ctypes.c_char_p), ctypes.c_int32]
  lib.jaxflash_ffi_set_kernel_folders.restype = ctypes.c_int32
  _set_kernel_folders(lib)
  import jax.ffi
  from jaxlib import xla_client  # CustomCallTargetTraits: jax.ffi does not re-export it
  # The instantiate stage loads each call's variant when XLA creates the executable, so execute
  # only launches and XLA may record the calls into command buffers (CUDA graphs).
  # Without a CUDA plugin (CPU-only jaxlib) jax queues this registration; nothing runs it.
  for target, instantiate, execute in _TARGETS:
    stages = {"instantiate": jax.ffi.pycapsule(getattr(lib, instantiate)),
              "execute": jax.ffi.pycapsule(getattr(lib, execute))}
    jax.ffi.register_ffi_target(
        target, stages, platform="CUDA",
        traits=xla_client.CustomCallTargetTraits.COMMAND_BUFFER_COMPATIBLE)
  _handler = lib
  return lib


def _set_kernel_folders(lib: ctypes.CDLL) -> None:
  """Tells the handler library where to find the variants it has not seen (search order)."""
  folders = [str(f.path).encode() for f in kernel_store.search_path()]
  array = (ctypes.c_char_p * len(folders))(*folders)
  if lib.jaxflash_ffi_set_kernel_folders(array, len(folders)) != 0:
    raise RuntimeError(f"jaxflash: {lib.jaxflash_ffi_last_error().decode()}")


def _prepare(lib: ctypes.CDLL) -> None:
  """CUDA runtime initialization of the handler library, once, here rather than in graph
  capture or a handler's first call."""
  global _prepared
  if not _prepared:
    status = lib.jaxflash_ffi_prepare()
    if status != 0:
      raise RuntimeError(f"jaxflash: initializing the CUDA runtime of {HANDLER_LIBRARY} failed "
                         f"with cudaError {status}: is a GPU with a CUDA 13 driver visible?")
    _prepared = True


def _register_variant(key: str, library: Path) -> None:
  """dlopens `library` in the handler's registry, checks ABI and key, loads its cubin."""
  lib = _load_handler()
  _prepare(lib)
  if lib.jaxflash_ffi_register_variant(key.encode(), str(library).encode()) != 0:
    raise RuntimeError(f"jaxflash: {lib.jaxflash_ffi_last_error().decode()}")
  _variants[key] = library


def register() -> None:
  """Registers the jaxflash FFI targets with XLA; the kernel variants load on first use.

  Call it once before running a deserialized `jax.export` module that holds jaxflash custom
  calls (lowering through `jaxflash.attention` does it on its own). Idempotent. It loads the
  handler library and gives it the kernel folders in search order (`jaxflash.kernel_store`);
  a handler then loads each variant the program runs from the first folder that has it, on the
  variant's first call, so no library is loaded that the program does not use. Without a CUDA
  device only the targets are registered (if a handler library exists).
  """
  with _lock:
    folders = kernel_store.search_path()
    if not _cuda_device_present():
      if any((f.path / HANDLER_LIBRARY).is_file() for f in folders):
        _load_handler()
      return
    lib = _load_handler()
    _set_kernel_folders(lib)  # the search path may have changed since the library loaded
    _prepare(lib)


def on_demand_blocker() -> str:
  """Why a missing variant cannot be built here at first use; "" when it can.

  Needs JAXFLASH_BUILD_ON_DEMAND unset or "1", nvidia-cutlass-dsl (the `build` extra), a C++
  compiler and the CUDA headers with the static runtime.
  """
  value = os.environ.get(config.BUILD_ON_DEMAND_ENV, "1")
  if value not in ("0", "1", ""):
    raise ValueError(f"{config.BUILD_ON_DEMAND_ENV}={value!r}: accepted values are '1' (build a "
                     f"missing kernel variant at first use, the default) and '0' (never)")
  if value == "0":
    return f"on-demand builds are off ({config.BUILD_ON_DEMAND_ENV}=0)"
  from jaxflash import build
  try:
    build.require_cutlass()
    build.find_toolchain()
  except build.BuildError as e:
    return str(e)
  return ""


def _missing_message(key: str, blocker: str) -> str:
  folders = ", ".join(f"{f.path} ({f.kind})" for f in kernel_store.search_path())
  return (f"jaxflash: kernel variant {key} is in none of the kernel folders ({folders}) and "
          f"cannot be built here at first use: {blocker}.\nTo get the kernels, install a kernel "
          f"wheel made on any host with `python -m jaxflash.build --wheel OUTDIR` (then "
          f"`pip install OUTDIR/{kernel_store.wheel_package('sm90a')}-*.whl`); or `pip install "
          f"'jaxflash[build]'` with g++ and the CUDA headers, and the variants build at first "
          f"use; or build this one with\n  {build_command([key])}")


def variant_available(variant: KernelVariant) -> tuple[bool, str]:
  """Whether ensure_variant can provide `variant` here (registered, found, or buildable).

  Returns (ok, reason); the reason says where it looked and how to get the kernels. Loads
  nothing and builds nothing.
  """
  key = variant.key
  with _lock:
    if key in _failed_builds:
      return False, _failed_builds[key]
    if key in _variants or kernel_store.locate(key, variant.arch) is not None:
      return True, ""
    blocker = on_demand_blocker()
  return (True, "") if not blocker else (False, _missing_message(key, blocker))


def _abridged(text: str, head: int = 1500, tail: int = 3000) -> str:
  """`text`, or its beginning and end when long (an error's first and last lines both matter)."""
  if len(text) <= head + tail:
    return text
  return f"{text[:head]}\n[... {len(text) - head - tail} characters ...]\n{text[-tail:]}"


def _build_on_demand(variant: KernelVariant) -> Path:
  """Builds `variant` into the cache in a child process, with one progress line on stderr.

  The child (`python -m jaxflash.build`) keeps the DSL compiler out of this process; its file
  lock makes concurrent processes build a variant once. Returns the cache folder.
  """
  cache = cache_dir()
  cmd = [sys.executable, "-m", "jaxflash.build", "--arch", variant.arch, "--cache-dir",
         str(cache)]
  if variant.mods is None:
    cmd += ["--variants", variant.key]
  else:
    # A score_mod / mask_mod variant is built from its spec (its IR is in it), not by key.
    specs = cache / ".specs"
    specs.mkdir(parents=True, exist_ok=True)
    spec = specs / f"{variant.key}.json"
    tmp = spec.with_name(f".{spec.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(dataclasses.asdict(variant), sort_keys=True))
    os.replace(tmp, spec)
    cmd += ["--spec", str(spec)]
  sys.stderr.write(f"jaxflash: building kernel variant {variant.key} into {cache} (first use "
                   f"on this host) ... ")
  sys.stderr.flush()
  start = time.perf_counter()
  proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
  seconds = time.perf_counter() - start
  if proc.returncode != 0 or not kernel_store.variant_is_usable(cache, variant.key):
    sys.stderr.write(f"failed after {seconds:.0f} s\n")
    raise RuntimeError(f"jaxflash: building kernel variant {variant.key} failed (exit "
                       f"{proc.returncode}) running\n  {' '.join(cmd)}\n"
                       f"{_abridged(proc.stdout + proc.stderr)}")
  sys.stderr.write(f"ready in {seconds:.0f} s\n")
  return cache


def _build_once(variant: KernelVariant) -> Path:
  """_build_on_demand at most once per variant and process: a failure is remembered in
  _failed_builds and raised again, with a note, by every later call."""
  if variant.key in _failed_builds:
    raise RuntimeError(_failed_builds[variant.key])
  try:
    return _build_on_demand(variant)
  except RuntimeError as e:
    _failed_builds[variant.key] = (f"{e}\n(This build failed earlier in this process and is "
                                   f"not retried; a new process builds it again.)")
    raise


def _locate_or_build(variant: KernelVariant) -> kernel_store.KernelFolder:
  """The first kernel folder (search order) that holds `variant`, after building it into the
  cache where it is missing, or its cached build is stale on a build host (the kernel sources
  or tools changed), unless `on_demand_blocker()` says no.

  Raises:
    RuntimeError: the variant is nowhere and cannot be built here (the message says how to get
      it), or the build failed (now or earlier in this process).
  """
  key = variant.key
  with _lock:
    found = kernel_store.locate(key, variant.arch)
    stale = False
    if found is not None and found.kind == "cache" and _cutlass_available():
      from jaxflash import build
      stale = not build.manifest_is_current(variant, found.path)
    if found is None or stale:
      blocker = on_demand_blocker()
      if not blocker:
        found = kernel_store.KernelFolder("cache", _build_once(variant))
      elif found is None:
        raise RuntimeError(_missing_message(key, blocker))
    return found


def ensure_variant(variant: KernelVariant) -> Path:
  """Makes `variant` runnable in this process and returns its library path.

  Takes it from the first kernel folder in search order (`jaxflash.kernel_store`). Where the
  variant is missing, or its cached build is stale on a build host (the kernel sources or
  tools changed), it is built into the cache first unless `on_demand_blocker()` says no. Call
  only where a CUDA device is present.

  Raises:
    RuntimeError: the variant is nowhere and cannot be built here (the message says how to get
      it), the build failed, or its library does not load.
  """
  key = variant.key
  with _lock:
    if key in _variants:
      return _variants[key]
    library = _locate_or_build(variant).path / key / VARIANT_LIBRARY
    _register_variant(key, library)
    return library


def registered_variants() -> dict[str, Path]:
  """Variant key -> library of every variant this process registered through Python (the
  lowering); the ones a handler loaded on first call are not listed."""
  with _lock:
    return dict(_variants)


def _window(side) -> int:
  """A window side as its attribute: config.WINDOW_UNBOUNDED for None, clipped to +-it."""
  if side is None:
    return config.WINDOW_UNBOUNDED
  return max(-config.WINDOW_UNBOUNDED, min(side, config.WINDOW_UNBOUNDED))


def fwd_attributes(variant: KernelVariant, cfg: AttentionConfig) -> dict:
  """Typed attributes of the forward custom call (names: config.FWD_ATTRIBUTE_NAMES)."""
  attrs = {
      "variant": variant.key,
      "softmax_scale": np.float32(cfg.softmax_scale),
      "causal": bool(cfg.causal),
      "window_left": np.int32(_window(cfg.window_left)),
      "window_right": np.int32(_window(cfg.window_right)),
      "softcap": np.float32(0.0 if cfg.softcap is None else cfg.softcap),
      "head_dim": np.int32(variant.head_dim),
      "head_dim_v": np.int32(variant.head_dim_v),
  }
  assert tuple(attrs) == FWD_ATTRIBUTE_NAMES, "keep in step with config.FWD_ATTRIBUTE_NAMES"
  return attrs


def bwd_attributes(variant: KernelVariant, cfg: AttentionConfig) -> dict:
  """Typed attributes of the backward custom call (names: config.BWD_ATTRIBUTE_NAMES)."""
  attrs = dict(fwd_attributes(variant, cfg), deterministic=bool(variant.deterministic))
  assert tuple(attrs) == BWD_ATTRIBUTE_NAMES, "keep in step with config.BWD_ATTRIBUTE_NAMES"
  return attrs


def decode_attributes(variant: KernelVariant, softmax_scale: float, seqlen_q: int,
                      window_left: Optional[int], window_right: Optional[int],
                      softcap: Optional[float]) -> dict:
  """Typed attributes of the split-KV decode custom call (names: config.DECODE_ATTRIBUTE_NAMES).

  A window side of None is unbounded (config.WINDOW_UNBOUNDED); causal is window_right = 0.
  softcap None is off (0).
  """
  if variant.direction != "decode":
    raise ValueError(f"variant: {variant.key} is a {variant.direction!r} variant; the decode "
                     f"call takes a 'decode' variant (config.decode_variant)")
  attrs = {
      "variant": variant.key,
      "softmax_scale": np.float32(softmax_scale),
      "seqlen_q": np.int32(seqlen_q),
      "window_left": np.int32(_window(window_left)),
      "window_right": np.int32(_window(window_right)),
      "softcap": np.float32(0.0 if softcap is None else softcap),
      "head_dim": np.int32(variant.head_dim),
      "head_dim_v": np.int32(variant.head_dim_v),
  }
  assert tuple(attrs) == DECODE_ATTRIBUTE_NAMES, "keep in step with config.DECODE_ATTRIBUTE_NAMES"
  return attrs
