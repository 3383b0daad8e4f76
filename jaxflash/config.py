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
# Typed attributes of the backward custom call (same checks; "deterministic" picks the variant).
BWD_ATTRIBUTE_NAMES = FWD_ATTRIBUTE_NAMES + ("deterministic",)

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
# Hopper forward: the (head_dim, head_dim_v) pairs the sm90 kernel is built for. 192/128 is the
# DeepSeek MLA training shape (q and k carry a 64-wide rotary part that v lacks).
KERNEL_HEAD_DIM_PAIRS = ((64, 64), (96, 96), (128, 128), (192, 128), (192, 192), (256, 256))
# The q/k head dims among them.
KERNEL_HEAD_DIMS = tuple(sorted({d for d, _ in KERNEL_HEAD_DIM_PAIRS}))
# Hopper backward: the (head_dim, head_dim_v) pairs with a kernel, every forward pair (192 and
# 256 use the head-dim split warpgroup mapping of kernels/bwd_sm90.py, which takes head_dim_v
# for V, dO, dP and dV). A name of its own: tests take a pair out of the backward only.
BWD_KERNEL_HEAD_DIM_PAIRS = KERNEL_HEAD_DIM_PAIRS
BWD_KERNEL_HEAD_DIMS = tuple(sorted({d for d, _ in BWD_KERNEL_HEAD_DIM_PAIRS}))
DIRECTIONS = ("fwd", "bwd")
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
  """CTA tile, pipeline depth and warpgroup schedule of one kernel build.

  swap_sdp (backward, head_dim <= 128 only): each consumer warpgroup computes S^T and dP^T, so
  P^T and dS^T feed the dV / dK GEMMs from registers (kernels/bwd_sm90.py). The key ends in
  "swap" then; the FFI handler reads tile_m from the digits after the "m" of the key's last token.
  """

  tile_m: int
  tile_n: int
  num_stages: int
  swap_sdp: bool = False

  @property
  def key(self) -> str:
    return f"m{self.tile_m}n{self.tile_n}s{self.num_stages}" + ("swap" if self.swap_sdp else "")


def default_tile(direction: str, arch: str, head_dim: int, head_dim_v: int, causal: bool) -> TileConfig:
  """Tile table. Each entry says where its numbers come from."""
  del arch  # one table for sm90 so far
  if direction == "bwd":
    return _default_bwd_tile(head_dim, causal)
  if direction != "fwd":
    raise ValueError(f"direction: no kernel tiles for {direction!r}; accepted: {DIRECTIONS}")
  # Forward numbers: H200, bf16, 16k tokens, TFLOP/s at seq 1k/4k/16k (docs/perf-notes.md).
  if head_dim <= 64:
    # 192x128, 2 stages (3 consumer warpgroups, FA-4's choice): 380/505/518 against 384/456/452
    # for 128x128; causal 232/428/534 against 247/389/436. A 3rd stage changed nothing.
    return TileConfig(192, 128, 2)
  if head_dim <= 96:
    # hdim 96: 128x128, 2 stages (121 KiB of shared memory). FA-3 and FA-4
    # run 192 x 128/144 here but with P passed through shared memory; this kernel keeps P in
    # registers (RS GEMM), which FA-4's notes (flash_attn/cute/interface.py) measure as about
    # half the speed with 192-row tiles on H100 (3 consumer warpgroups get 160 registers each).
    # So 2 consumer warpgroups, FA-3's earlier 128x128 hdim-96 choice. Measured (through JAX,
    # seq 1k/4k): 428/566 (causal 275/461) vs cuDNN 396/480. Self-test A/B (seq 1k/4k/16k):
    # 128x128 481/590/556 (median of 3; causal 313/509/594), 128x160 450/588/558 (causal
    # 289/499/587), 128x176 476/601/577 (one run; causal 288/497/546): 128x128 kept.
    return TileConfig(128, 128, 2)
  if head_dim <= 128:
    # Non-causal: 128x176 (FA-3's Hopper choice; 176 keys = 11 WGMMA K steps of P V). Self-test
    # A/B (seq 1k/4k/16k): 128x128 549/667/633 (median of 3 interleaved runs), 128x160
    # 526/686/655 (median of 3), 128x176 547/689/655 (one run): fewer barriers and waits per
    # key, and 176 leaves <= 3 % of a block unused at seq 512-16k where 160 wastes up to 25 %.
    # Causal: 128x128: 372/604/700 against 338/598/728 (176) and 341/591/710 (160); the
    # diagonal blocks favour the smaller tile at short sequences. 3 stages: same or slower.
    # Shared memory at 176: Q 32 KiB + K, V 2 x 44 each = 208 KiB.
    return TileConfig(128, 128 if causal else 176, 2)
  if head_dim <= 192:
    # hdim 192: FA-3 (hopper/tile_size.h) and FA-4 (Hopper) use these tiles. Measured through
    # JAX at seq 1k/4k: dv 192 539/719 (causal 345/606), dv 128 533/674 (337/572), 1.07-1.24x
    # cuDNN; no other tile was tried.
    # head_dim_v 128 (DeepSeek shape): 128x128, 2 stages: Q 48 KiB + K 96 + V 64 (209 KiB with
    # barriers and alignment). head_dim_v 192: 128x112, 2 stages: 48 + 84 + 84 (217 KiB);
    # 128x128 would need 241 KiB of the 227.
    # Registers per consumer thread: O 96 + S 56 + P 28 fp32 at dv 192 (hdim 256: 128+40+20).
    return TileConfig(128, 128 if head_dim_v <= 128 else 112, 2)
  # hdim 256: 128x80, 2 stages (FA-4's choice; K+V stages fill 224 KiB): 651/780/747 against
  # 633/739/663 for 128x64; causal 459/702/756 against 463/684/747 (self-test). Through JAX
  # with conditional rescaling: 596/744/813, causal 348/650/791.
  return TileConfig(128, 80, 2)


@dataclasses.dataclass(frozen=True)
class KernelVariant:
  """One compiled kernel: everything that is static in the cubin. Shapes stay dynamic."""

  direction: str  # "fwd" | "bwd"
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


def _head_dim_pairs(direction: str) -> tuple[tuple[int, int], ...]:
  """(head_dim, head_dim_v) pairs with a kernel (read at call time: tests replace them)."""
  return KERNEL_HEAD_DIM_PAIRS if direction == "fwd" else BWD_KERNEL_HEAD_DIM_PAIRS


def kernel_support(direction: str, dtype: str, head_dim: int, head_dim_v: int,
                   config: AttentionConfig) -> tuple[bool, str]:
  """Whether a CuTe kernel exists for this call; the reason text is shown to users and in skips."""
  if direction not in DIRECTIONS:
    return False, f"direction {direction!r} unknown; accepted: {DIRECTIONS}"
  if dtype not in KERNEL_DTYPES:
    return False, f"dtype {dtype} has no kernel; accepted: {', '.join(KERNEL_DTYPES)}"
  pairs = _head_dim_pairs(direction)
  head_dims = tuple(sorted({d for d, _ in pairs}))
  if head_dim not in head_dims:
    return False, f"head_dim {head_dim} has no {direction} kernel; accepted: {head_dims}"
  if (head_dim, head_dim_v) not in pairs:
    accepted = tuple(dv for d, dv in pairs if d == head_dim)
    return False, (f"head_dim_v {head_dim_v} with head_dim {head_dim} has no {direction} "
                   f"kernel; accepted head_dim_v: {accepted}")
  unsupported = [name for name, on in (("window_size", config.has_window),
                                       ("softcap", config.softcap is not None),
                                       ("q_segment_ids/kv_segment_ids", config.has_segment_ids))
                 if on]
  if unsupported:
    return False, f"{', '.join(unsupported)} not supported by the CuTe kernel yet"
  return True, ""


def shipped_variants(arch: str = "sm90a", direction: str = "fwd") -> list[KernelVariant]:
  """The variants `python -m jaxflash.build --all` builds and the CPU compile tests check.

  direction="bwd" lists the backward variants (non-deterministic and deterministic).
  """
  if direction not in DIRECTIONS:
    raise ValueError(f"direction: {direction!r} unknown; accepted: {DIRECTIONS}")
  out = []
  for dtype in KERNEL_DTYPES:
    for head_dim, head_dim_v in _head_dim_pairs(direction):
      for causal in (False, True):
        for deterministic in (False, True) if direction == "bwd" else (False,):
          cfg = AttentionConfig(softmax_scale=1.0, causal=causal, deterministic=deterministic)
          out.append(KernelVariant.for_call(direction, arch, dtype, head_dim, head_dim_v, cfg))
  return out


def _default_bwd_tile(head_dim: int, causal: bool) -> TileConfig:
  """Backward tiles (sm90): tile_m query rows x tile_n key rows per step, Q/dO ring depth."""
  if head_dim > 128:
    # hdim 192 and 256: 64 x 64 with the head-dim split warpgroup mapping
    # (kernels/bwd_sm90.py), where num_stages counts Q stages and dO has a ring of its own.
    # hdim 256: one dO stage (FA-3's Hopper hdim-256 backward: 2 Q stages, 1 dO stage). Shared
    # memory: K + V 64 KiB, Q 2 x 32, dO 32, P + dS 16, fp32 dQ staging 32 (half a block, two
    # pieces per warpgroup): 209 KiB of the 227. hdim 192: K + V 48, Q 2 x 24, dO 2 x 24,
    # P + dS 16, dQ staging 48 (whole block): 209 KiB. FA-3 runs 64 x 96 / 64 x 80 there.
    # Measured fwd+bwd through JAX (bf16, seq 1k/4k/16k): hdim 256 313/430/465 (causal
    # 221/378/456) vs cuDNN 307/409/412; hdim 192 seq 1k 313 vs 275. No other tile was tried.
    return TileConfig(64, 64, 2)
  if head_dim <= 64:
    # hdim 64: 128 x 128 (FA-4's Hopper tile), two 64-row WGMMA blocks of queries per step, so
    # the per-step fixed costs (dS barriers, dQ handoff, Q/dO waits) are paid per 128 rows; the
    # two consumer warpgroups still own 64 key rows each. Registers: S + dP 2 x 64, dK + dV
    # 2 x 32 fp32 per thread. Self-test on the H200 (bf16, backward TFLOP/s at seq 4k / 16k,
    # same call): 128 x 128 404 / 435 (causal 352 / 429; deterministic 350 / 433, causal
    # 348 / 412) against 64 x 128 369 / 402 (causal 326 / 395; deterministic 323 / 403, causal
    # 325 / 386).
    # Swapped (swap_sdp, FA-4's SdP_swapAB at hdim 64; then with dS from the rounded P,
    # gradient rel. L2 vs float64 3.6e-3, bf16), one call, seq 4k / 16k / 1k: 479 / 494 /
    # 373 against 413 / 439 / 327; deterministic 465 / 493 / 368 vs 409 / 435 / 326; causal
    # 411 / 470 / 259 vs 366 / 434 / 239; causal deterministic 409 / 460 / 255 vs 362 / 420 /
    # 237. Shared memory: K + V 32 KiB, Q + dO 2 x 2 x 16, dS 2 x 32, dQ staging 32, lse2 /
    # delta rows 2 KiB: 195 KiB.
    # The dV GEMM issued after dS (bwd_sm90 dv_after_ds; dS from the fp32 P: 2.5e-3), ninth
    # session: 527 / 535 / 421 vs 526 / 526 / 408, causal 483 / 524 / 309 vs 449 / 497 / 294.
    return TileConfig(128, 128, 2, swap_sdp=True)
  # hdim 96 and 128: 64 or 80 query rows x 128 keys, each of the two consumer warpgroups owns
  # 64 key rows, so dK + dV stay in registers (2 x 64 fp32 per thread at hdim 128), and the
  # swapped S / dP schedule (swap_sdp: S^T, dP^T per warpgroup; P^T, dS^T to the dV / dK GEMMs
  # from registers, no P buffer, FA-4's SdP_swapAB). Self-test on the H200, one call (bf16,
  # backward TFLOP/s at seq 4k / 16k, swap against the unswapped 64 x 128 of the previous
  # release): hdim 128 swap 64 x 128 521 / 572 vs 486 / 535, deterministic 482 / 559 vs
  # 461 / 525, causal 450 / 552 vs 423 / 529, causal deterministic 425 / 520 vs 423 / 502;
  # hdim 96 468 / 510 vs 438 / 465, deterministic 434 / 497 vs 403 / 464, causal 411 / 487 vs
  # 379 / 452, causal deterministic 382 / 465 vs 377 / 446.
  # hdim 128 without the causal mask: 80 x 128 (FA-3 / FA-4's tile there): 534 / 582,
  # deterministic 499 / 573. 80 rows need the transposed dQ GEMM (dQ^T = K^T dS^T), and the
  # dV GEMM issued after dS (bwd_sm90 dv_after_ds, FA-4's order; with it issued before, dS had
  # to take the rounded P: gradient error vs float64 2.9e-3 instead of 2.4e-3, bf16): ninth
  # session 582 / 619 / 494 vs 561 / 586 / 469 (seq 4k / 16k / 1k). With the causal mask 80
  # rows spilled (LDL / STL) while dV came before dS; with dv_after_ds they compile clean, and
  # (tenth session, seq 4k / 8k / 16k / 1k) 527 / 582 / 591 / 339 against 64 rows' 528 / 529 /
  # 578 / 347, deterministic 533 / 563 / 564 / 361 against 523 / 518 / 547 / 369.
  # Shared memory: hdim 128 64 x 128 194 KiB, 80 x 128 226 KiB; hdim 96 154 KiB (dQ split 48
  # columns per warpgroup).
  if head_dim == 128:
    return TileConfig(80, 128, 2, swap_sdp=True)
  return TileConfig(64, 128, 2, swap_sdp=True)


def bwd_scratch_shapes(variant: KernelVariant, batch: int, seq_q: int,
                       num_heads: int) -> tuple[tuple[str, tuple[int, ...], str], ...]:
  """Scratch buffers of one backward call, in custom-call result order after dq, dk, dv.

  Returns ((name, shape, dtype), ...). seq_q is rounded up to the variant's tile_m. The kernels
  never read what they have not written, so XLA may hand over uninitialised memory: the
  preprocess zeroes dq_semaphore, and dq_accum in the default mode; deterministic variants
  store each dq_accum block's first contribution and the postprocess skips blocks whose
  semaphore counts none. dq_semaphore exists only for deterministic variants.
  """
  if variant.direction != "bwd":
    raise ValueError(f"variant.direction: {variant.direction!r}; scratch exists for 'bwd' only")
  tile_m = variant.tile.tile_m
  seq_q_rounded = -(-seq_q // tile_m) * tile_m
  rows = (batch, num_heads, seq_q_rounded)
  copies = dq_accum_copies(variant, seq_q)
  shapes = (("dq_accum", (batch, num_heads, copies * seq_q_rounded, variant.head_dim),
             "float32"),
            ("lse_log2", rows, "float32"),
            ("delta", rows, "float32"))
  if variant.deterministic:
    shapes += (("dq_semaphore", (batch, num_heads, copies * seq_q_rounded // tile_m), "int32"),)
  return shapes


# Deterministic backward at head_dim > 128: up to DET_DQ_COPIES dQ accumulators per
# (batch, head) (JAXFLASH_DET_DQ_COPIES in jaxflash/ffi/kernel_abi.h; a CPU test keeps the two
# equal). Key block n adds into copy n % copies, each copy in its own fixed order, and the
# postprocess sums the copies in index order, so the result stays bitwise reproducible.
# Each key block waits only for the previous one of its copy: a query block's chain of
# hand-offs (dQ write, MEMBAR, semaphore poll per hop), which with 64 x 64 tiles bounded the
# step time, is half as long. H200 self-test, deterministic backward TFLOP/s 4k / 16k / 1k,
# 2 copies vs 1 without a mask: hdim 192 403 / 426 / 316 vs 344 / 428 / 286 (default mode
# 424 / 440 / 350), hdim 256 387 / 402 / 308 vs 372 / 403 / 306. Elsewhere the chain was not
# the bound and the second copy cost 3-15 %: hdim 128 530 / 576 / 423 vs 588 / 572 / 463,
# causal 492 / 533 / 293 vs 524 / 565 / 346; hdim 256 causal 349 / 353 / 232 vs 361 / 390 /
# 248 (eighth session, perf-notes.md).
DET_DQ_COPIES = 2
# hdim 192 with the causal mask: two copies up to this seq_q (by head_dim_v), one above. H200
# self-test (tenth session, two calls), deterministic backward TFLOP/s at seq 1k / 4k / 8k /
# 16k, two copies vs one (default mode in the same call): dv 192 279 / 397 / 389 / 403 vs
# 266 / 366 / 400 / 415 (283 / 417 / 436 / 443), with the shipped kernels 276 / 391 / 394 /
# 398 vs 267 / 368 / 392 / 412 (282 / 412 / 428 / 438); dv 128 264 / 369 / 393 / 383 vs 241 /
# 332 / 378 / 396 (266 / 389 / 418 / 430), shipped 260 / 366 / 383 / 386 vs 243 / 336 / 377 /
# 389 (266 / 389 / 414 / 424). Between 4k and 8k it was not measured.
CAUSAL_TWO_DQ_COPIES_MAX_SEQ_Q = {192: 4096, 128: 8192}


def max_dq_accum_copies(deterministic: bool, causal: bool, head_dim: int) -> int:
  """dQ accumulator copies a backward variant is built for: the most one call may use
  (DET_DQ_COPIES for deterministic variants above head_dim 128, except hdim 256 with the
  causal mask, where two were slower at every length; else 1)."""
  if not deterministic or head_dim <= 128 or (causal and head_dim > 192):
    return 1
  return DET_DQ_COPIES


def dq_accum_copies(variant: KernelVariant, seq_q: int) -> int:
  """dQ accumulator copies of one backward call (the scratch shape carries it; a kernel built
  for more reads the count from it): max_dq_accum_copies, or 1 for causal calls longer than
  CAUSAL_TWO_DQ_COPIES_MAX_SEQ_Q."""
  most = max_dq_accum_copies(variant.deterministic, variant.causal, variant.head_dim)
  if most > 1 and variant.causal and seq_q > CAUSAL_TWO_DQ_COPIES_MAX_SEQ_Q.get(
      variant.head_dim_v, 0):
    return 1
  return most
