"""Finds the jaxflash FFI libraries, loads them and registers the XLA target and kernel variants.

Knows variant keys, library paths and jax.ffi; nothing of primitives, sharding or Flax.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import threading
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from jaxflash import config
from jaxflash.config import (BWD_ATTRIBUTE_NAMES, BWD_TARGET, FWD_ATTRIBUTE_NAMES, FWD_TARGET,
                             HANDLER_LIBRARY, VARIANT_LIBRARY, VARIANT_MANIFEST, AttentionConfig,
                             KernelVariant)

log = logging.getLogger("jaxflash")

# XLA_FFI_DEFINE_HANDLER_SYMBOL names in handlers.cc
_FWD_HANDLER_SYMBOL = "JaxflashAttentionFwd"
_BWD_HANDLER_SYMBOL = "JaxflashAttentionBwd"
_lock = threading.RLock()
_handler: Optional[ctypes.CDLL] = None
_variants: dict[str, Path] = {}  # key -> library registered in this process
_prepared = False  # jaxflash_ffi_prepare ran (GPU hosts only)


def cache_dir() -> Path:
  """The kernel cache: $JAXFLASH_CACHE_DIR, else ~/.cache/jaxflash/<jaxflash version>."""
  import jaxflash  # at call time: the package is initialized by now
  return config.kernel_cache_dir(jaxflash.__version__)


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


def _handler_library(cache: Path) -> Path:
  """The handler library, (re)built first where g++ and CUDA headers exist and it is stale."""
  from jaxflash import build
  path = cache / HANDLER_LIBRARY
  try:
    return build.build_handler_library(cache)[0]  # no-op (no tools needed) when current
  except (build.BuildError, OSError) as e:
    if path.is_file():
      return path  # prebuilt, and no toolchain (or no write access) here: use it as it is
    raise RuntimeError(
        f"jaxflash: the FFI handler library {path} is missing and cannot be built here: {e}\n"
        f"Build it (with the kernels) on a build host with `{build_command()}` and point "
        f"JAXFLASH_CACHE_DIR at that folder.") from e


def _load_handler(cache: Path) -> ctypes.CDLL:
  """Loads libjaxflash_ffi.so once per process and registers FWD_TARGET, BWD_TARGET for CUDA."""
  global _handler
  if _handler is not None:
    return _handler
  lib = ctypes.CDLL(str(_handler_library(cache)))
  lib.jaxflash_ffi_register_variant.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
  lib.jaxflash_ffi_register_variant.restype = ctypes.c_int32
  lib.jaxflash_ffi_last_error.restype = ctypes.c_char_p
  lib.jaxflash_ffi_prepare.restype = ctypes.c_int32
  import jax.ffi
  # Without a CUDA plugin (CPU-only jaxlib) jax queues this registration; nothing runs it.
  for target, symbol in ((FWD_TARGET, _FWD_HANDLER_SYMBOL), (BWD_TARGET, _BWD_HANDLER_SYMBOL)):
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="CUDA")
  _handler = lib
  return lib


def _register_variant(key: str, library: Path) -> None:
  """dlopens `library` in the handler's registry, checks ABI and key, loads its cubin."""
  global _prepared
  lib = _load_handler(library.parent.parent)
  if not _prepared:
    # CUDA runtime initialization of the handler library, here rather than in graph capture.
    status = lib.jaxflash_ffi_prepare()
    if status != 0:
      raise RuntimeError(f"jaxflash: initializing the CUDA runtime of {HANDLER_LIBRARY} failed "
                         f"with cudaError {status}: is a GPU with a CUDA 13 driver visible?")
    _prepared = True
  if lib.jaxflash_ffi_register_variant(key.encode(), str(library).encode()) != 0:
    raise RuntimeError(f"jaxflash: {lib.jaxflash_ffi_last_error().decode()}")
  _variants[key] = library


def register() -> None:
  """Registers the jaxflash FFI targets and every kernel variant in the cache with XLA.

  Call it once before running a deserialized `jax.export` module that holds jaxflash custom
  calls (lowering through `jaxflash.attention` does it on its own). Idempotent. Without a CUDA
  device only the targets are registered (if its library exists): nothing could run the kernels.
  A variant library that fails to load is skipped with a warning; `ensure_variant` raises.
  """
  cache = cache_dir()
  with _lock:
    if not _cuda_device_present():
      if (cache / HANDLER_LIBRARY).is_file():
        _load_handler(cache)
      return
    _load_handler(cache)
    for manifest in sorted(cache.glob(f"*/{VARIANT_MANIFEST}")):
      key, library = manifest.parent.name, manifest.parent / VARIANT_LIBRARY
      if key in _variants or not library.is_file():
        continue
      try:
        _register_variant(key, library)
      except RuntimeError as e:
        log.warning("%s (skipped)", e)


def _cutlass_available() -> bool:
  return importlib.util.find_spec("cutlass") is not None


def _is_cached(key: str, cache: Path) -> bool:
  return (cache / key / VARIANT_LIBRARY).is_file() and (cache / key / VARIANT_MANIFEST).is_file()


def _missing_message(key: str, cache: Path) -> str:
  return (f"jaxflash: kernel variant {key} is not built in {cache}, and nvidia-cutlass-dsl is "
          f"not installed here to build it. On a build host (no GPU needed) run\n"
          f"  {build_command([key], cache)}\nand copy that folder here (or set "
          f"JAXFLASH_CACHE_DIR to it); or `pip install 'jaxflash[build]'` to build on first use.")


def variant_available(variant: KernelVariant) -> tuple[bool, str]:
  """Whether ensure_variant can provide `variant` here (registered, cached, or buildable).

  Returns (ok, reason); the reason names the command that builds the variant. Loads nothing.
  """
  key, cache = variant.key, cache_dir()
  with _lock:
    if key in _variants or _is_cached(key, cache) or _cutlass_available():
      return True, ""
  return False, _missing_message(key, cache)


def ensure_variant(variant: KernelVariant) -> Path:
  """Makes `variant` runnable in this process and returns its library path.

  Registers it from the cache; builds it first where nvidia-cutlass-dsl is installed and the
  cached build is missing or stale. Call only where a CUDA device is present.

  Raises:
    RuntimeError: the variant is not in the cache and cannot be built here (the message has the
      command that builds it), or its library does not load.
  """
  key = variant.key
  with _lock:
    if key in _variants:
      return _variants[key]
    cache = cache_dir()
    library = cache / key / VARIANT_LIBRARY
    built = _is_cached(key, cache)
    if _cutlass_available():
      from jaxflash import build
      if not (built and build.manifest_is_current(variant, cache)):
        log.info("jaxflash: building kernel variant %s into %s", key, cache)
        try:
          build.build_variant(variant, cache)
        except build.BuildError as e:
          raise RuntimeError(f"jaxflash: building kernel variant {key} failed: {e}") from e
    elif not built:
      raise RuntimeError(_missing_message(key, cache))
    _register_variant(key, library)
    return library


def registered_variants() -> dict[str, Path]:
  """Variant key -> library of every variant registered in this process."""
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
