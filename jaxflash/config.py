"""Stable names shared by every layer: attention config, kernel variants, FFI target names.

Leaf module: imports the standard library only (kernels, ffi, build and primitives all read it).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Optional

# Stable XLA FFI custom-call targets. Serialized HLO refers to these names, never change them.
FWD_TARGET = "jaxflash_attention_fwd"
BWD_TARGET = "jaxflash_attention_bwd"
# Typed attributes of the forward custom call, in binding order (jaxflash/ffi/handlers.cc binds
# exactly these; tests/test_ffi.py checks the two lists agree).
FWD_ATTRIBUTE_NAMES = ("variant", "softmax_scale", "causal", "window_left", "window_right",
                       "softcap", "head_dim", "head_dim_v")

# Kernel cache layout: `python -m jaxflash.build` writes it, jaxflash.ffi reads it.
CACHE_DIR_ENV = "JAXFLASH_CACHE_DIR"
HANDLER_LIBRARY = "libjaxflash_ffi.so"  # in the cache root
VARIANT_LIBRARY = "libjaxflash_variant.so"  # in <cache>/<KernelVariant.key>/
VARIANT_MANIFEST = "manifest.json"  # next to it


def kernel_cache_dir(version: str) -> Path:
  """$JAXFLASH_CACHE_DIR, else ~/.cache/jaxflash/<version> (kernels are tied to the version)."""
  env = os.environ.get(CACHE_DIR_ENV)
  return Path(env).expanduser() if env else Path.home() / ".cache" / "jaxflash" / version


# Names of the remat checkpoints on the residuals the backward pass needs.
OUT_CHECKPOINT_NAME = "jaxflash_out"
LSE_CHECKPOINT_NAME = "jaxflash_lse"

IMPLEMENTATIONS = ("cute", "reference")
KERNEL_DTYPES = ("float16", "bfloat16")
REFERENCE_DTYPES = ("float16", "bfloat16", "float32")
# Hopper forward: head dims the sm90 kernel is built for (head_dim_v == head_dim for now).
KERNEL_HEAD_DIMS = (64, 128, 256)
KERNEL_ARCHS = ("sm90a",)

_DTYPE_SHORT = {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  """Every static parameter of one attention call; travels through primitives as `config=`."""

  softmax_scale: float
  causal: bool = False
  window_left: Optional[int] = None  # None: unbounded
  window_right: Optional[int] = None
  softcap: Optional[float] = None  # None: no soft-capping
  has_segment_ids: bool = False
  deterministic: bool = False
  implementation: str = "reference"  # resolved: "cute" or "reference"

  @property
  def has_window(self) -> bool:
    return self.window_left is not None or self.window_right is not None

  def replace(self, **changes) -> "AttentionConfig":
    return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class TileConfig:
  """CTA tile and pipeline depth of one kernel build."""

  tile_m: int
  tile_n: int
  num_stages: int

  @property
  def key(self) -> str:
    return f"m{self.tile_m}n{self.tile_n}s{self.num_stages}"


def default_tile(direction: str, arch: str, head_dim: int, head_dim_v: int, causal: bool) -> TileConfig:
  """Tile table. Each entry says where its numbers come from."""
  del arch, head_dim_v, causal  # one table for sm90 so far
  if direction != "fwd":
    raise ValueError(f"direction: no kernel tiles for {direction!r} yet; accepted: 'fwd'")
  if head_dim <= 64:
    # 128x128, 2 stages: 2 x (16 + 16) KiB of K/V + 16 KiB Q fits easily; FA-4 uses 192x128 here
    # with intra-warpgroup overlap, which is the FA-3 schedule issue's job.
    return TileConfig(128, 128, 2)
  if head_dim <= 128:
    # 128x128, 2 stages: FA-4's Hopper choice for hdim 128 (perf-anchors.md).
    return TileConfig(128, 128, 2)
  # hdim 256: 128x80 in FA-4 (perf-anchors.md); 64-wide N keeps 2 stages of K+V in 228 KiB.
  return TileConfig(128, 64, 2)


@dataclasses.dataclass(frozen=True)
class KernelVariant:
  """One compiled kernel: everything that is static in the cubin. Shapes stay dynamic."""

  direction: str  # "fwd" (backward kernels come later)
  arch: str  # "sm90a"
  dtype: str  # "float16" | "bfloat16"
  head_dim: int
  head_dim_v: int
  causal: bool
  tile: TileConfig
  has_window: bool = False
  has_softcap: bool = False
  has_segment_ids: bool = False
  deterministic: bool = False

  @property
  def key(self) -> str:
    """Readable, unique name: folder in the kernel cache and the FFI `variant` attribute."""
    flags = "".join(
        f for f, on in (("-causal", self.causal), ("-window", self.has_window),
                        ("-softcap", self.has_softcap), ("-segids", self.has_segment_ids),
                        ("-det", self.deterministic)) if on)
    return (f"{self.direction}-{self.arch}-{_DTYPE_SHORT[self.dtype]}-d{self.head_dim}"
            f"-dv{self.head_dim_v}{flags}-{self.tile.key}")

  @classmethod
  def for_call(cls, direction: str, arch: str, dtype: str, head_dim: int, head_dim_v: int,
               config: AttentionConfig) -> "KernelVariant":
    return cls(
        direction=direction, arch=arch, dtype=dtype, head_dim=head_dim, head_dim_v=head_dim_v,
        causal=config.causal,
        tile=default_tile(direction, arch, head_dim, head_dim_v, config.causal),
        has_window=config.has_window, has_softcap=config.softcap is not None,
        has_segment_ids=config.has_segment_ids,
        deterministic=config.deterministic and direction == "bwd")


def kernel_support(direction: str, dtype: str, head_dim: int, head_dim_v: int,
                   config: AttentionConfig) -> tuple[bool, str]:
  """Whether a CuTe kernel exists for this call; the reason text is shown to users and in skips."""
  if direction != "fwd":
    return False, "the CuTe backward kernel is not built yet; the backward pass uses the reference"
  if dtype not in KERNEL_DTYPES:
    return False, f"dtype {dtype} has no kernel; accepted: {', '.join(KERNEL_DTYPES)}"
  if head_dim not in KERNEL_HEAD_DIMS:
    return False, f"head_dim {head_dim} has no kernel; accepted: {KERNEL_HEAD_DIMS}"
  if head_dim_v != head_dim:
    return False, f"head_dim_v {head_dim_v} != head_dim {head_dim} has no kernel yet"
  unsupported = [name for name, on in (("window_size", config.has_window),
                                       ("softcap", config.softcap is not None),
                                       ("q_segment_ids/kv_segment_ids", config.has_segment_ids))
                 if on]
  if unsupported:
    return False, f"{', '.join(unsupported)} not supported by the CuTe kernel yet"
  return True, ""


def shipped_variants(arch: str = "sm90a") -> list[KernelVariant]:
  """The variants `python -m jaxflash.build --all` builds and the CPU compile tests check."""
  out = []
  for dtype in KERNEL_DTYPES:
    for head_dim in KERNEL_HEAD_DIMS:
      for causal in (False, True):
        cfg = AttentionConfig(softmax_scale=1.0, causal=causal)
        out.append(KernelVariant.for_call("fwd", arch, dtype, head_dim, head_dim, cfg))
  return out
