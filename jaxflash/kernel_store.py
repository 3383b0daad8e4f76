"""Where the kernel libraries are found: kernel folders and the installed kernel wheel.

A kernel folder holds the FFI handler library and one sub-folder per variant key (library and
manifest). Run-time search order, first match wins:

1. `$JAXFLASH_CACHE_DIR`, when set: a developer's own builds win;
2. the installed kernel wheel of the arch (package `jaxflash_kernels_sm90a`, made by
   `python -m jaxflash.build --wheel`), when it was built for this jaxflash version and kernel
   ABI; another one is ignored with one warning;
3. the user cache `~/.cache/jaxflash/<version>/`.

Builds (`python -m jaxflash.build`, on-demand builds) go to the first cache of that list: the
wheel is never written. Standard library only: no jax, no kernels.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import threading
from pathlib import Path
from typing import Optional

from jaxflash import config, user_warning
from jaxflash.config import VARIANT_LIBRARY, VARIANT_MANIFEST

_FFI_SRC = Path(__file__).resolve().parent / "ffi"
_warned_wheels: set[Path] = set()
_warn_lock = threading.Lock()


@dataclasses.dataclass(frozen=True)
class KernelFolder:
  """One place kernels are found: `kind` is "cache" (writable) or "wheel" (read-only)."""

  kind: str
  path: Path


def jaxflash_version() -> str:
  import jaxflash  # at call time: the package is initialized by now
  return jaxflash.__version__


def abi_version() -> int:
  """JAXFLASH_KERNEL_ABI_VERSION as written in ffi/kernel_abi.h (shipped with the package)."""
  text = (_FFI_SRC / "kernel_abi.h").read_text()
  return int(re.search(r"#define JAXFLASH_KERNEL_ABI_VERSION (\d+)", text).group(1))


def user_cache_dir() -> Path:
  return Path.home() / ".cache" / "jaxflash" / jaxflash_version()


def build_dir() -> Path:
  """Where builds go: $JAXFLASH_CACHE_DIR, else the user cache."""
  return config.kernel_cache_dir(jaxflash_version())


def wheel_package(arch: str) -> str:
  return config.KERNEL_WHEEL_PACKAGE.format(arch=arch)


def read_json(path: Path) -> Optional[dict]:
  """The JSON object in `path`, or None when it is missing or unreadable (a manifest, a stamp)."""
  try:
    return json.loads(path.read_text())
  except (OSError, ValueError):
    return None


def _warn_once(folder: Path, message: str) -> None:
  with _warn_lock:
    if folder in _warned_wheels:
      return
    _warned_wheels.add(folder)
  user_warning.warn(message)


def wheel_folder(arch: str = "sm90a") -> Optional[Path]:
  """The installed kernel wheel's folder for `arch` if it matches this jaxflash and ABI.

  Finds the package without importing it. A wheel for another jaxflash version or kernel ABI is
  ignored, with one RuntimeWarning per process that says which wheel and what it was built for.
  """
  spec = importlib.util.find_spec(wheel_package(arch))
  if spec is None or not spec.submodule_search_locations:
    return None
  folder = Path(next(iter(spec.submodule_search_locations)))
  info = read_json(folder / config.KERNEL_WHEEL_INFO) or {}
  want = {"jaxflash_version": jaxflash_version(), "kernel_abi": abi_version(), "arch": arch}
  have = {k: info.get(k) for k in want}
  if have != want:
    _warn_once(folder, f"jaxflash: ignoring the kernel wheel {wheel_package(arch)} at {folder}: "
               f"it was built for {have}, this installation needs {want}. Install the kernel "
               f"wheel of this version (`python -m jaxflash.build --wheel OUTDIR` on any host "
               f"with the build extra), or uninstall it.")
    return None
  return folder


def search_path(arch: str = "sm90a", cache_dir: Optional[Path] = None) -> list[KernelFolder]:
  """The kernel folders in run-time search order (see the module docstring).

  `cache_dir` stands in for $JAXFLASH_CACHE_DIR (the build CLI's --cache-dir).
  """
  env = cache_dir or (Path(os.environ[config.CACHE_DIR_ENV]).expanduser()
                      if os.environ.get(config.CACHE_DIR_ENV) else None)
  folders = [KernelFolder("cache", env)] if env else []
  wheel = wheel_folder(arch)
  if wheel is not None:
    folders.append(KernelFolder("wheel", wheel))
  user = user_cache_dir()
  if user != env:
    folders.append(KernelFolder("cache", user))
  return folders


def variant_is_usable(folder: Path, key: str) -> bool:
  """<folder>/<key> holds a library and a manifest for this key and kernel ABI."""
  manifest = read_json(folder / key / VARIANT_MANIFEST)
  return (manifest is not None and (folder / key / VARIANT_LIBRARY).is_file()
          and manifest.get("key") == key and manifest.get("abi_version") == abi_version())


def locate(key: str, arch: str = "sm90a",
           cache_dir: Optional[Path] = None) -> Optional[KernelFolder]:
  """The first kernel folder in search order with a usable build of variant `key`, or None."""
  return next((f for f in search_path(arch, cache_dir) if variant_is_usable(f.path, key)), None)
