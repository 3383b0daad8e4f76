"""Stable names shared by every layer, and the one table of the kernels that ship.

Leaf module: imports the standard library only (kernels, ffi, build and primitives all read it).
A kernel variant is (direction, arch, dtype, head dims, mask flags) plus the schedule the table
below gives it; the kernel classes read the schedule and derive nothing of their own. The
measurements behind each table row are in docs/kernels.md.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Optional, Union

# Stable XLA FFI custom-call targets. Serialized HLO refers to these names, never change them.
FWD_TARGET = "jaxflash_attention_fwd"
BWD_TARGET = "jaxflash_attention_bwd"
# Typed attributes of the forward custom call, in binding order (jaxflash/ffi/handlers.cc binds
# exactly these; tests/test_ffi.py checks the two lists agree).
FWD_ATTRIBUTE_NAMES = ("variant", "softmax_scale", "causal", "window_left", "window_right",
                       "softcap", "head_dim", "head_dim_v")
# Typed attributes of the backward custom call (same checks; "deterministic" picks the variant).
BWD_ATTRIBUTE_NAMES = FWD_ATTRIBUTE_NAMES + ("deterministic",)
# The split-KV decode kernel: per-split partial outputs and lses of a few query rows over a KV
# cache (contiguous or paged), which the caller combines. Its typed attributes, in binding order
# (handlers.cc binds exactly these; tests/test_ffi.py checks).
DECODE_TARGET = "jaxflash_kv_cache_attention"
DECODE_ATTRIBUTE_NAMES = ("variant", "softmax_scale", "seqlen_q", "window_left", "window_right",
                          "softcap", "head_dim", "head_dim_v")
# The window_left / window_right attribute of a side without a bound. Large enough that no
# sequence reaches it, small enough that the kernels' int32 arithmetic (row + offset +- window)
# cannot overflow.
WINDOW_UNBOUNDED = 1 << 30

# Bytes of L2 (50 MB on H100, 60 MB on H200) that the tiles running at once may fill with the
# K and V (or Q and dO) they share: the kernels' tile orders keep such groups together.
L2_BYTES_FOR_REUSE = 40 * 1024 * 1024

# Kernel folder layout (a cache, or the package of a kernel wheel): `python -m jaxflash.build`
# writes it, jaxflash.kernel_store finds it, jaxflash.ffi loads from it.
CACHE_DIR_ENV = "JAXFLASH_CACHE_DIR"
HANDLER_LIBRARY = "libjaxflash_ffi.so"  # in the folder's root
VARIANT_LIBRARY = "libjaxflash_variant.so"  # in <folder>/<KernelVariant.key>/
VARIANT_MANIFEST = "manifest.json"  # next to it
# The kernel wheel: one importable package per arch whose folder is a kernel folder, plus this
# file saying what it was built for (jaxflash version, kernel ABI, arch, variant keys).
KERNEL_WHEEL_PACKAGE = "jaxflash_kernels_{arch}"
KERNEL_WHEEL_INFO = "kernels.json"
# "0" turns off building a missing variant at first use (auto mode then runs the reference).
BUILD_ON_DEMAND_ENV = "JAXFLASH_BUILD_ON_DEMAND"


def kernel_cache_dir(version: str) -> Path:
  """$JAXFLASH_CACHE_DIR, else ~/.cache/jaxflash/<version> (kernels are tied to the version)."""
  env = os.environ.get(CACHE_DIR_ENV)
  return Path(env).expanduser() if env else Path.home() / ".cache" / "jaxflash" / version


# Names of the remat checkpoints on the residuals the backward pass needs.
OUT_CHECKPOINT_NAME = "jaxflash_out"
LSE_CHECKPOINT_NAME = "jaxflash_lse"

IMPLEMENTATIONS = ("cute", "reference")
REFERENCE_DTYPES = ("float16", "bfloat16", "float32")
# Kernel directions: the forward and backward of attention, and the split-KV decode over a KV
# cache (forward only).
DIRECTIONS = ("fwd", "bwd", "decode")

_DTYPE_SHORT = {"float16": "f16", "bfloat16": "bf16", "float32": "f32", "float8_e4m3fn": "e4m3"}


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  """Every static parameter of one attention call; travels through primitives as `config=`."""

  softmax_scale: float
  causal: bool = False
  window_left: Optional[int] = None  # None: unbounded
  window_right: Optional[int] = None
  softcap: Optional[float] = None  # None: no soft-capping
  has_segment_ids: bool = False
  # A learnable sink operand (num_heads,) float32 follows the forward's operands: every forward
  # variant takes it at run time (the epilogue adds it to each row's denominator).
  has_sink: bool = False
  deterministic: bool = False
  implementation: str = "reference"  # resolved: "cute" or "reference"
  # FP8 inputs: the descales vary along the sequence (block quantization), so the kernel takes
  # one per 64 tokens (the -blk variants) instead of one per (batch, kv head).
  block_descales: bool = False
  # FP8 inputs: out is float16, else bfloat16 (the kernel's choice at run time, from the out
  # buffer's dtype: no variant of its own).
  out_float16: bool = False
  # An additive bias operand (after the segment ids, before the sink): None without one, else
  # which of its (batch, heads, seq_q) dims are full (False: size 1, broadcast). Its last dim is
  # always seq_k. The kernels read broadcast dims with stride 0; the backward reduces dbias
  # over them in XLA.
  bias_dims: Optional[tuple[bool, bool, bool]] = None
  # score_mod / mask_mod compiled into the kernels: the canonical JSON of their IR
  # (jaxflash/mod_ir.py, ModSpec), or None. Their closed-over arrays are operands after the bias
  # and before the sink, one per entry of the spec's "arrays".
  mods: Optional[str] = None

  @property
  def has_mods(self) -> bool:
    return self.mods is not None

  @property
  def has_window(self) -> bool:
    return self.window_left is not None or self.window_right is not None

  @property
  def has_bias(self) -> bool:
    return self.bias_dims is not None

  @property
  def window_sides(self) -> tuple[Optional[int], Optional[int]]:
    """(left, right) of the band, the causal mask folded into the right side (right <= 0):
    query i sees keys j with i' - left <= j <= i' + right, i' = i + seq_k - seq_q; None where a
    side is unbounded."""
    right = self.window_right
    if self.causal:
      right = 0 if right is None else min(right, 0)
    return self.window_left, right

  @property
  def band(self) -> Optional[int]:
    """The most keys one query sees under the window (left + right + 1 of window_sides), or None
    where a side is unbounded."""
    left, right = self.window_sides
    if left is None or right is None:
      return None
    return max(left + right + 1, 0)

  def replace(self, **changes) -> "AttentionConfig":
    return dataclasses.replace(self, **changes)


# ---------------------------------------------------------------------------------------------
# What ships: archs, dtypes, head dims, and one schedule per variant.

KERNEL_ARCHS = ("sm90a",)
KERNEL_DTYPES = ("float16", "bfloat16")
# (head_dim, head_dim_v) pairs with a kernel, per direction. 192 / 128 is DeepSeek's MLA
# training shape (q and k carry a 64-wide rotary part that v lacks). Decode runs the forward's
# pairs, so that a model decodes with the head dims it was trained with.
KERNEL_HEAD_DIM_PAIRS = {
    "fwd": ((64, 64), (96, 96), (128, 128), (192, 128), (192, 192), (256, 256)),
    "bwd": ((64, 64), (96, 96), (128, 128), (192, 128), (192, 192), (256, 256)),
    "decode": ((64, 64), (96, 96), (128, 128), (192, 128), (192, 192), (256, 256)),
}


@dataclasses.dataclass(frozen=True)
class FwdSchedule:
  """How the Hopper forward kernel (kernels/fwd_sm90.py) runs one variant."""

  tile_m: int  # query rows per CTA, 64 per consumer warpgroup (2 or 3 of them)
  tile_n: int  # key rows per step
  num_stages: int  # depth of the K and V rings
  pingpong: bool  # the consumer warpgroups take turns issuing their GEMMs
  persistent: bool  # grid = #SMs, each CTA walks a static tile list; else one CTA per tile
  lpt: bool  # tiles longest first, in (batch, head) sections whose K and V fit in L2
  rescale_o_before_pv: bool  # rescale O while Q K^T runs (else after the P V GEMM)
  # Of every 8 score columns, this many take exp2 on the FMA pipe (kernels/softmax.exp2_fma)
  # instead of MUFU.EX2.
  fma_exp2_per_8: int = 0
  # Q slots (O of a tile is staged in its Q slot): 2 lets a persistent CTA load the next
  # tile's Q while the current tile still computes (16-bit kernel, head_dim == head_dim_v).
  q_stages: int = 1
  # persistent: each CTA claims its next tile from a counter in global memory (in the order of
  # the tiles: longest first with lpt or a masked call's tile order) instead of a static list.
  dynamic: bool = False

  @property
  def key(self) -> str:
    fma = f"e{self.fma_exp2_per_8}" if self.fma_exp2_per_8 else ""
    return f"m{self.tile_m}n{self.tile_n}s{self.num_stages}{fma}"


@dataclasses.dataclass(frozen=True)
class BwdSchedule:
  """How the Hopper backward kernels (kernels/bwd_*.py) run one variant.

  Two warpgroup mappings (kernels/bwd_sm90.py): head_dim <= 128 splits the key rows between
  the two consumer warpgroups and computes S^T and dP^T (swap_sdp, FA-4's SdP_swapAB);
  above 128 each warpgroup takes half of head_dim of dK, dV and dQ (head-dim split).
  """

  tile_m: int  # query rows per step: 64, 80 (dQ computed transposed) or 128
  tile_n: int  # key rows per CTA
  num_stages: int  # depth of the Q ring (and of dO's, which shares it, under swap_sdp)
  swap_sdp: bool  # S^T / dP^T per warpgroup, P^T / dS^T from registers (else head-dim split)
  do_stages: int  # depth of the dO ring (head-dim split: a ring of its own)
  dq_pieces: int  # a warpgroup hands its dQ to the writer warp in this many pieces
  dv_after_ds: bool  # swap_sdp: the dV GEMM is issued after dS^T is stored (FA-4's order)
  dq_split_m: bool  # the dQ GEMM splits query rows between the warpgroups (else head_dim)
  dq_transposed: bool  # dQ^T = K^T dS^T (tile_m is no multiple of WGMMA's M = 64)
  dq_copies: int  # fp32 dQ accumulators (deterministic: summed in index order), 1 or 2
  two_dq_copies_max_seq_q: Optional[int] = None  # above this seq_q a call uses one copy

  @property
  def key(self) -> str:
    return f"m{self.tile_m}n{self.tile_n}s{self.num_stages}" + ("swap" if self.swap_sdp else "")


@dataclasses.dataclass(frozen=True)
class DecodeSchedule:
  """How the Hopper split-KV decode kernel (kernels/decode_sm90.py) runs one variant.

  A CTA takes the query rows of one (batch, kv head) (the query heads of the kv head packed
  into the rows, JaxflashDecodeArgs) against one split of that sequence's keys.
  """

  tile_m: int  # packed query rows per CTA: 64 (one consumer warpgroup), 128 when chunked
  tile_n: int  # key rows per step
  num_stages: int  # depth of the K and V rings (in the query's dtype)
  # FP8 caches: depth of the e4m3 rings that TMA fills and six converting warps
  # (kernels/decode_sm90.py) turn into the 16-bit rings; 0: 16-bit caches (TMA fills the 16-bit
  # rings).
  fp8_stages: int = 0
  # Chunked prefill (kernels/chunked_sm90.py): the forward's 128-row tiles, two consumer
  # warpgroups taking turns at their GEMMs, one CTA per tile over all of its keys (no split),
  # out and lse written by the tile itself; the call's scratch partials have 0 splits.
  chunked: bool = False

  @property
  def key(self) -> str:
    return f"m{self.tile_m}n{self.tile_n}s{self.num_stages}" + (
        f"e{self.fp8_stages}" if self.fp8_stages else "")


Schedule = Union[FwdSchedule, BwdSchedule, DecodeSchedule]

# Decode: the deepest K / V ring, up to 4 stages, whose stages and the 64-row Q tile fit the
# 227 KiB of shared memory of a Hopper CTA (tests/test_config.py recomputes it).
_DECODE_STAGES = {(64, 64): 4, (96, 96): 4, (128, 128): 3, (192, 128): 4, (192, 192): 4,
                  (256, 256): 3}


# Decode over FP8 caches: two 16-bit K / V stages (the converted blocks the GEMMs read) and the
# deepest e4m3 ring, up to 4 stages, that fits beside them and the Q tile.
_DECODE_FP8_STAGES = {64: 4, 128: 2, 256: 2}


# Chunked prefill: the (head_dim, head_dim_v) pairs with a chunked variant; larger head dims and
# FP8 caches run every call on the split-KV decode kernel.
CHUNKED_HEAD_DIM_PAIRS = ((64, 64), (96, 96), (128, 128))
# A kv_cache_attention call takes the chunked variant when each (sequence, kv head) has at least
# this many packed query rows (seq_q * query heads per kv head: one whole 128-row tile; fewer
# rows would leave part of a tile idle where the decode kernel's 64-row tiles fill) and its
# tiles, batch * kv heads * row tiles, fill at least CHUNKED_MIN_WAVE of the SMs: below that
# the decode kernel splits the keys across the idle SMs instead (docs/kernels.md, "Chunked
# prefill").
CHUNKED_MIN_ROWS = 128
CHUNKED_MIN_WAVE = 0.75
# Paged caches take the chunked variant only when their page size is a multiple of this: the
# chunked kernel loads such pages whole per key block or in boxes of 64 keys (2 per 128-key
# block, kernels/chunked_sm90.py); smaller pages would go in 16-key boxes, with which it ran
# below the split-KV kernel (docs/kernels.md, "Chunked prefill").
CHUNKED_PAGE_MULTIPLE = 64


def chunked_schedule(head_dim: int, head_dim_v: int) -> DecodeSchedule:
  """The chunked-prefill schedule: the forward's causal tile at head_dim 96 and 128, 128 x 128
  with two K / V stages (fwd_schedule: a third stage never helped), two consumer warpgroups;
  also at head_dim 64, where the forward's tile is 192 x 128 over three warpgroups (the
  chunked kernel has two)."""
  if (head_dim, head_dim_v) not in CHUNKED_HEAD_DIM_PAIRS:
    raise ValueError(f"(head_dim, head_dim_v): ({head_dim}, {head_dim_v}) has no chunked "
                     f"prefill schedule; accepted: {CHUNKED_HEAD_DIM_PAIRS}")
  return DecodeSchedule(tile_m=128, tile_n=128, num_stages=2, chunked=True)


def chunked_support(dtype: str, head_dim: int, head_dim_v: int,
                    kv_dtype: Optional[str] = None) -> tuple[bool, str]:
  """Whether a chunked-prefill variant covers a kv_cache_attention call's dtypes and head dims
  (the rest of its routing: split_kv.use_chunked)."""
  if kv_dtype is not None:
    return False, f"{kv_dtype} caches run on the decode kernel"
  if dtype not in KERNEL_DTYPES:
    return False, f"dtype {dtype} has no kernel; accepted: {', '.join(KERNEL_DTYPES)}"
  if (head_dim, head_dim_v) not in CHUNKED_HEAD_DIM_PAIRS:
    return False, (f"(head_dim, head_dim_v) ({head_dim}, {head_dim_v}) has no chunked "
                   f"variant; accepted: {CHUNKED_HEAD_DIM_PAIRS}")
  return True, ""


def decode_schedule(head_dim: int, head_dim_v: int, fp8_cache: bool = False) -> DecodeSchedule:
  """The decode schedule table: 64 packed query rows per CTA (one consumer warpgroup: a decode
  step has few rows, the query heads of a kv head times the new tokens), key tiles of 128 up
  to head dim 128 and of 64 above, and the deepest K / V ring up to 4 stages that fits 227 KiB
  of shared memory with the Q tile (decoding streams the cache: a deep ring keeps loads in
  flight). FP8 caches (head_dim = head_dim_v in FP8_HEAD_DIMS): two 16-bit stages and the
  e4m3 ring of _DECODE_FP8_STAGES."""
  tile_n = 128 if max(head_dim, head_dim_v) <= 128 else 64
  if fp8_cache:
    if head_dim != head_dim_v or head_dim not in _DECODE_FP8_STAGES:
      raise ValueError(f"(head_dim, head_dim_v): ({head_dim}, {head_dim_v}) has no decode "
                       f"schedule over {FP8_DTYPE} caches; accepted: head_dim = head_dim_v in "
                       f"{tuple(_DECODE_FP8_STAGES)}")
    return DecodeSchedule(tile_m=64, tile_n=tile_n, num_stages=2,
                          fp8_stages=_DECODE_FP8_STAGES[head_dim])
  stages = _DECODE_STAGES.get((head_dim, head_dim_v))
  if stages is None:
    raise ValueError(f"(head_dim, head_dim_v): ({head_dim}, {head_dim_v}) has no decode "
                     f"schedule; accepted: {tuple(_DECODE_STAGES)}")
  return DecodeSchedule(tile_m=64, tile_n=tile_n, num_stages=stages)


# The FP8 forward (kernels/fwd_fp8_sm90.py): e4m3 q, k, v, bf16 or fp16 out (a run-time choice);
# head_dim = head_dim_v.
FP8_DTYPE = "float8_e4m3fn"
FP8_HEAD_DIMS = (64, 128, 256)
# The FP8 kernel takes its descales per chunk of this many query rows or keys of a head: per
# (batch, kv head) descales and block descales of a block this size or larger map onto it
# exactly (jaxflash/fp8_kernel.py). Block descales run their own variants (-blk): scaling
# scores and P per chunk measured 0.87x / 0.94x at head_dim 128 / 256 on per-head descales
# (docs/kernels.md, "FP8 forward"), so per-head calls keep one scale per tile.
FP8_DESCALE_ROWS = 64


def fp8_descale_chunks(length: int, tile: int) -> int:
  """The FP8 kernel's descale chunks over `length` query rows or keys in tiles of `tile`: enough
  to cover every tile (a per-head variant's key tile may end inside a chunk). The FFI library
  counts them the same way (ffi/kernel_abi.h, jaxflash_fp8_descale_chunks)."""
  covered = -(-length // tile) * tile  # whole tiles
  return -(-covered // FP8_DESCALE_ROWS)


def fp8_fwd_schedule(head_dim: int, causal: bool, block_descales: bool = False) -> FwdSchedule:
  """The FP8 forward's schedule: a persistent tile list where the call is not causal, the
  descales are per head and O has a buffer of its own (head_dim 64 and 128; 1.01-1.04x one CTA
  per tile at 64, 0.98-1.06x at 128, seq 4k and 16k), else one CTA per tile; ping-pong consumer
  warpgroups except at head_dim 128. head_dim 64: 192 x 128 (three warpgroups share the
  MUFU-bound softmax); 128: 128 x 224 (FA-3's FP8 tile; 1.02-1.09x 128 x 192 causal at
  seq 4k and 16k, 0.98-1.06x not causal), the two warpgroups issuing freely (0.99-1.05x
  ping-pong), and 128 x 192 with block descales, whose chunks of 64 keys must tile a key
  block; 256: 128 x 128 (1.12-1.14x 128 x 64), with O's bf16 tile over the V ring (Q, K, V and
  V^T fill 224 KiB). At head_dim 64 the softmax's MUFU.EX2 time is twice the GEMMs': 2 of 8
  exp2 go to the FMA pipe (1.10x; 3 of 8, and any share at 128, measured slower:
  docs/kernels.md, "FP8 forward")."""
  tile_n = {64: 128, 128: 192 if block_descales else 224}.get(head_dim, 128)
  return FwdSchedule(tile_m=192 if head_dim <= 64 else 128, tile_n=tile_n, num_stages=2,
                     pingpong=head_dim != 128,
                     persistent=not causal and not block_descales and head_dim <= 128,
                     lpt=causal, rescale_o_before_pv=False,
                     fma_exp2_per_8=2 if head_dim <= 64 else 0)


def fp8_fwd_variant(head_dim: int, causal: bool, arch: str = "sm90a",
                    block_descales: bool = False) -> "KernelVariant":
  return KernelVariant(direction="fwd", arch=arch, dtype=FP8_DTYPE, head_dim=head_dim,
                       head_dim_v=head_dim, causal=causal,
                       schedule=fp8_fwd_schedule(head_dim, causal, block_descales),
                       block_descales=block_descales)


# Dense head_dim 128 forwards without the causal mask over at most this many keys per sequence
# run a variant of their own: 128 x 128 tiles with two Q slots (two slots do not fit beside
# 176-key stages), against 128 x 176 with one above (self-test, 2026-12-05: 1.09x at 1k, 1.02x
# at 2k, 0.98x at 4k, 0.91x at 16k; docs/kernels.md, "Forward tiles").
SHORT_DENSE_HEAD_DIMS = (128,)
SHORT_DENSE_MAX_KEYS = 2048

# Masked head_dim 64 forwards whose band (window_left + window_right + 1 keys, both sides
# bounded: a static shape) is at most this wide run a variant of their own: 128 x 128 tiles with
# two Q slots. A 128-row tile under a causal window of 128 visits 2 key blocks, a 192-row tile
# about 3.5, so the wider tile computes 1.75x the scores per row; the tiles are short, so the
# second Q slot hides the next tile's setup. gpt-oss's forward at 16k (window 128 + sinks,
# 2026-12-05): 0.400 ms against 0.529 ms for 192 x 128, cuDNN's window 0.446 ms
# (docs/kernels.md, "Forward tiles"; only the 129-key band was measured).
NARROW_BAND_HEAD_DIMS = (64,)
NARROW_BAND_MAX_KEYS = 256


# Opt-in shared memory of a Hopper CTA (kernels/sm90_gemm.SMEM_CAPACITY).
SMEM_BYTES = 227 * 1024


def _second_q_slot_fits(tile_m: int, tile_n: int, num_stages: int, head_dim: int,
                        head_dim_v: int, bias: bool = False) -> bool:
  """Whether two 16-bit Q slots and the K / V rings fit (1 KiB left for the mbarriers); bias:
  with a tile_m x tile_n bias tile per K stage."""
  bias_tiles = num_stages * tile_m * tile_n if bias else 0
  return 2 * (2 * tile_m * head_dim + num_stages * tile_n * (head_dim + head_dim_v)
              + bias_tiles) + 1024 <= SMEM_BYTES


def fwd_schedule(head_dim: int, head_dim_v: int, causal: bool, masked: bool = False,
                 seq_k: Optional[int] = None, band: Optional[int] = None,
                 bias: bool = False, mods: bool = False) -> FwdSchedule:
  """The forward schedule table (H200 measurements in docs/kernels.md, "Forward tiles").

  masked: the variant for windows, segment ids and softcap, causal or not (all run-time data);
  it takes the causal tiles, claimed in the order of the call's block-range operands (each
  batch's tiles from the last down: jaxflash/block_ranges.py, forward_operands).
  seq_k: the call's keys per sequence (static), or None (a long call): dense calls without the
  causal mask at SHORT_DENSE_HEAD_DIMS up to SHORT_DENSE_MAX_KEYS keys take a schedule of their
  own.
  band: the most keys one query sees under the call's window (static; None: a side is
  unbounded): masked calls at NARROW_BAND_HEAD_DIMS up to NARROW_BAND_MAX_KEYS take a schedule
  of their own.
  bias: a bias variant (masked), whose tile ignores the band.
  mods: a score_mod / mask_mod variant (masked): the bias variants' tile, whatever the band,
  with the Q slots of a masked variant (no bias tiles in shared memory).
  """
  short = (not causal and not masked and head_dim in SHORT_DENSE_HEAD_DIMS
           and seq_k is not None and seq_k <= SHORT_DENSE_MAX_KEYS)
  narrow = (masked and head_dim in NARROW_BAND_HEAD_DIMS and band is not None
            and band <= NARROW_BAND_MAX_KEYS)
  causal = causal or masked
  if head_dim <= 64:
    # 192 x 128, 3 consumer warpgroups (FA-4's tile): +11 % at 4k over 128 x 128; narrow bands
    # visit fewer key blocks per row on 128-row tiles. Bias variants: 128 x 128, as the bias
    # loads spilled the three-warpgroup tile's 160 registers per thread; mods variants take the
    # same tile (their per-score code was compiled on 128 x 128 only).
    tile_m, tile_n = (128, 128) if narrow or bias or mods else (192, 128)
  elif head_dim <= 96:
    # 128 x 128: FA-3/FA-4's 192-row tiles pass P through shared memory, ours keeps P in
    # registers; 128 x 160 and 128 x 176 were no faster.
    tile_m, tile_n = 128, 128
  elif head_dim <= 128:
    # 128 x 176 (FA-3's): fewer steps per key; 128 x 128 wins at short sequences (causal ones
    # have few keys per tile; short dense ones then fit two Q slots).
    tile_m, tile_n = 128, 128 if causal or short else 176
  elif head_dim <= 192:
    # FA-3/FA-4's tiles; 112 is the widest tile_n whose two K + V stages fit 227 KiB at dv 192.
    tile_m, tile_n = 128, 128 if head_dim_v <= 128 else 112
  else:
    # 128 x 80 (FA-4's; K + V stages fill 224 KiB): +4 % at 4k, +9 % at 16k over 128 x 64.
    tile_m, tile_n = 128, 80
  num_stages = 2  # a third stage never helped
  return FwdSchedule(
      tile_m=tile_m, tile_n=tile_n, num_stages=num_stages,
      # Off above hdim 128 (as FA-3/FA-4): measured equal at hdim 256.
      pingpong=head_dim <= 128,
      # Every variant runs a persistent grid. Uniform tiles (no causal mask) walk a static list
      # (+3-10 % over one CTA per tile at seq 1k). Causal and masked tiles differ in length:
      # each CTA claims its next tile from a counter (dynamic), in LPT order for causal calls
      # and in the order of the block ranges for masked ones, so the tiles go out as the
      # hardware hands one CTA per tile to SMs while a CTA's next Q and K loads overlap its
      # current tile. Against the static lists up to 2048 keys and one CTA per tile above them
      # (H100, two alternated rounds, 2026-12-06): head_dim 128 causal +12 % at 2k, +20 % at
      # 4k, +2 % at 16k; 64 +5 % at 4k; 256 +3 % at 4k; 11 packed documents +10 %; the rest
      # within noise (docs/kernels.md, "Forward tiles").
      persistent=True, dynamic=causal, lpt=causal and not masked,
      # Two Q slots (a persistent CTA loads the next tile's Q during the current tile) where a
      # second slot fits: causal and masked tiles, short dense ones and head_dim 96 (+7-25 % at
      # 1k). At head_dim 64 not causal two slots gained nothing at 1k and measured 0.95x at 4k
      # and 16k, so one slot there. Bias variants at head_dim 128: one slot, as the two K
      # stages' 32 KiB bias tiles fill the second's place (a K stage without its bias tile would
      # leave the softmax waiting on each block's bias load; not measured).
      q_stages=2 if (causal or short or head_dim == 96) and (
          _second_q_slot_fits(tile_m, tile_n, num_stages, head_dim, head_dim_v, bias)) else 1,
      # O of head_dim_v > 128 is 128+ registers: its rescale runs under the Q K^T GEMM.
      rescale_o_before_pv=head_dim_v > 128)


def bwd_schedule(head_dim: int, head_dim_v: int, causal: bool, deterministic: bool,
                 masked: bool = False, bias: bool = False, mods: bool = False) -> BwdSchedule:
  """The backward schedule table (H200 measurements in docs/kernels.md, "Backward tiles").

  masked: the variant for windows and segment ids takes the causal tiles and one dQ accumulator.
  bias: a bias variant (masked). mods: a score_mod / mask_mod variant (masked).
  """
  causal = causal or masked
  if head_dim <= 64 and not bias and not mods:
    # 128 x 128 (FA-4's), two 64-row WGMMA blocks of queries per step, dQ split by rows
    # (FA-4's AtomLayoutMdQ = 2); dV after dS: +0-8 %, dS from the fp32 P.
    return BwdSchedule(tile_m=128, tile_n=128, num_stages=2, swap_sdp=True, do_stages=2,
                       dq_pieces=1, dv_after_ds=True, dq_split_m=True, dq_transposed=False,
                       dq_copies=1)
  if head_dim <= 96 or (mods and head_dim <= 128):
    # 64 x 128 swapped: +6-9 % over the unswapped schedule. Also the mods variants at head_dim
    # 128: on the 80 x 128 tile the document mask spilled 110 LDL / STL, T5 buckets 144; here
    # none (ALiBi with a document mask: 64). Also head_dim 64's bias variants:
    # the bias loads spilled its 128 x 128 tile (64 fp32 S^T and dP^T values per thread each;
    # 34 LDL / 20 STL).
    return BwdSchedule(tile_m=64, tile_n=128, num_stages=2, swap_sdp=True, do_stages=2,
                       dq_pieces=1, dv_after_ds=False, dq_split_m=False, dq_transposed=False,
                       dq_copies=1)
  if head_dim <= 128:
    # 80 x 128 (FA-3/FA-4's), dQ^T = K^T dS^T since 80 is no multiple of 64; dV after dS
    # (+4-6 %; with the causal mask the only order that compiles without spills).
    return BwdSchedule(tile_m=80, tile_n=128, num_stages=2, swap_sdp=True, do_stages=2,
                       dq_pieces=1, dv_after_ds=True, dq_split_m=False, dq_transposed=True,
                       dq_copies=1)
  # Head-dim split, 64 x 64 (FA-3's hdim-256 layout). Deterministic: two dQ accumulators halve
  # the chain of semaphore hand-offs per query block (+15-18 % at hdim 192 4k); at hdim 256
  # causal two were slower at every length, at hdim 192 causal only up to seq_q 4096 (dv 192)
  # or 8192 (dv 128).
  two_copies = deterministic and not masked and not (causal and head_dim > 192)
  if head_dim <= 192:
    # Two Q and two dO stages, the whole dQ block staged: 209 KiB.
    return BwdSchedule(tile_m=64, tile_n=64, num_stages=2, swap_sdp=False, do_stages=2,
                       dq_pieces=1, dv_after_ds=False, dq_split_m=False, dq_transposed=False,
                       dq_copies=2 if two_copies else 1,
                       two_dq_copies_max_seq_q=(4096 if head_dim_v > 128 else 8192)
                       if two_copies and causal else None)
  # hdim 256: one dO stage and half a dQ block staged at a time, to fit 227 KiB (209 KiB).
  return BwdSchedule(tile_m=64, tile_n=64, num_stages=2, swap_sdp=False, do_stages=1,
                     dq_pieces=2, dv_after_ds=False, dq_split_m=False, dq_transposed=False,
                     dq_copies=2 if two_copies else 1)


@dataclasses.dataclass(frozen=True)
class KernelVariant:
  """One compiled kernel: everything that is static in the cubin. Shapes stay dynamic."""

  direction: str  # "fwd" | "bwd" | "decode"
  arch: str  # "sm90a"
  dtype: str  # "float16" | "bfloat16" | FP8_DTYPE (forward)
  head_dim: int
  head_dim_v: int
  causal: bool  # the compile-time causal mask (masked variants take it at run time)
  schedule: Schedule
  deterministic: bool = False  # backward only
  # Windows and segment ids: run-time operands (block ranges, ids, window sizes) that the
  # kernel masks and skips by; causal or not is then run-time data too. They also take softcap
  # at run time. (Decode variants take windows, causal and softcap at run time as scalars, and
  # no mask operands: masked stays False.)
  masked: bool = False
  # FP8 forward only: descales per 64 tokens (block quantization), not per (batch, kv head).
  block_descales: bool = False
  # Decode only: FP8_DTYPE caches (float32 descales per page or sequence and kv head), the
  # query and out in dtype; None: caches in dtype.
  kv_dtype: Optional[str] = None
  # An additive bias (batch|1, heads|1, seq_q|1, seq_k) in dtype, read per score (forward and
  # backward; the backward also writes dbias per score). Bias variants are masked variants:
  # causal, windows, segment ids and softcap come with them at run time.
  bias: bool = False
  # score_mod / mask_mod: the canonical JSON of their IR (mod_ir.ModSpec), emitted into the
  # score step (kernels/mod_codegen.py); None: none. Mods variants are masked variants built on
  # demand (never shipped), keyed by mods_digest.
  mods: Optional[str] = None

  @property
  def key(self) -> str:
    """Readable, unique name: folder in the kernel cache and the FFI `variant` attribute."""
    flags = "".join(f for f, on in (("-causal", self.causal), ("-masked", self.masked),
                                    ("-bias", self.bias),
                                    (f"-mods{mods_digest(self.mods or '')}",
                                     self.mods is not None),
                                    ("-det", self.deterministic),
                                    ("-blk", self.block_descales),
                                    (f"-kv{_DTYPE_SHORT.get(self.kv_dtype)}",
                                     self.kv_dtype is not None)) if on)
    return (f"{self.direction}-{self.arch}-{_DTYPE_SHORT[self.dtype]}-d{self.head_dim}"
            f"-dv{self.head_dim_v}{flags}-{self.schedule.key}")

  @classmethod
  def for_call(cls, direction: str, arch: str, dtype: str, head_dim: int, head_dim_v: int,
               config: AttentionConfig, seq_k: Optional[int] = None,
               kv_dtype: Optional[str] = None) -> "KernelVariant":
    """The variant that runs one call (kernel_support must have accepted it). A decode variant
    depends on dtype, head dims and the caches' dtype (kv_dtype: FP8_DTYPE, or None for caches
    in dtype) only (its options are run-time scalars). seq_k: the call's keys per sequence,
    which picks among forward variants (fwd_schedule); None for a long call."""
    if direction == "decode":
      return decode_variant(dtype, head_dim, head_dim_v, arch, kv_dtype)
    if dtype == FP8_DTYPE:
      return fp8_fwd_variant(head_dim, config.causal, arch, config.block_descales)
    deterministic = config.deterministic and direction == "bwd"
    # Soft-capping runs on the masked variants (a run-time value, like the window); so does a
    # bias (one bias variant per dtype and head dims takes every mask at run time).
    # score_mod / mask_mod too, on the bias variants' tiles (per-score work in the score step).
    masked = (config.has_window or config.has_segment_ids or config.softcap is not None
              or config.has_bias or config.has_mods)
    causal = config.causal and not masked
    per_score = config.has_bias or config.has_mods
    if direction == "fwd":
      # Bias and mods variants keep one schedule whatever the band.
      band = None if per_score else config.band
      schedule = fwd_schedule(head_dim, head_dim_v, causal, masked, seq_k, band,
                              config.has_bias, config.has_mods)
    else:
      schedule = bwd_schedule(head_dim, head_dim_v, causal, deterministic, masked,
                              config.has_bias, config.has_mods)
    return cls(direction=direction, arch=arch, dtype=dtype, head_dim=head_dim,
               head_dim_v=head_dim_v, causal=causal, schedule=schedule,
               deterministic=deterministic, masked=masked, bias=config.has_bias,
               mods=config.mods)


def variant_from_spec(spec: dict) -> KernelVariant:
  """The KernelVariant of a spec as dataclasses.asdict writes it (a build request, a
  manifest's "spec"); ValueError names a spec that is not one."""
  schedules = {"fwd": FwdSchedule, "bwd": BwdSchedule, "decode": DecodeSchedule}
  try:
    fields = dict(spec)
    schedule = schedules[fields["direction"]](**fields.pop("schedule"))
    return KernelVariant(schedule=schedule, **fields)
  except (KeyError, TypeError) as e:
    raise ValueError(f"spec: not a kernel variant spec ({type(e).__name__}: {e}); keys seen: "
                     f"{sorted(spec)}") from e


def kernel_support(direction: str, dtype: str, head_dim: int, head_dim_v: int,
                   config: Optional[AttentionConfig] = None) -> tuple[bool, str]:
  """Whether a CuTe kernel runs this call: the one answer, for users (the reason is shown in
  errors), the kernels' can_implement, the lowering and the tests' skips. config: the call's
  options (None: a plain call)."""
  if direction not in DIRECTIONS:
    return False, f"direction {direction!r} unknown; accepted: {DIRECTIONS}"
  if dtype == FP8_DTYPE:
    return _fp8_kernel_support(direction, head_dim, head_dim_v, config)
  if dtype not in KERNEL_DTYPES:
    return False, f"dtype {dtype} has no kernel; accepted: {', '.join(KERNEL_DTYPES)}"
  pairs = KERNEL_HEAD_DIM_PAIRS[direction]
  head_dims = tuple(sorted({d for d, _ in pairs}))
  if head_dim not in head_dims:
    return False, f"head_dim {head_dim} has no {direction} kernel; accepted: {head_dims}"
  if (head_dim, head_dim_v) not in pairs:
    accepted = tuple(dv for d, dv in pairs if d == head_dim)
    return False, (f"head_dim_v {head_dim_v} with head_dim {head_dim} has no {direction} "
                   f"kernel; accepted head_dim_v: {accepted}")
  if direction == "decode" and config is not None and config.has_segment_ids:
    return False, "the decode kernels take no segment ids"
  if config is not None and config.has_mods:
    return _mods_kernel_support(direction, head_dim, head_dim_v, config)
  if config is not None and config.has_bias:
    return _bias_kernel_support(direction, head_dim, head_dim_v, config)
  return True, ""


# (head_dim, head_dim_v) pairs with bias variants (forward and backward, float16 and bfloat16):
# the head dims of the models that train with a bias (T5, ALiBi models, AlphaFold-style pair
# bias: 64 and 128). Each pair adds a forward and a backward variant per dtype; other pairs run
# the reference (docs/kernels.md, "Bias").
BIAS_HEAD_DIM_PAIRS = ((64, 64), (128, 128))
# The backward of a bias call with deterministic=True runs the reference (no deterministic bias
# variant ships); the bias's own gradient is written once per score in either case.
BIAS_DIRECTIONS = ("fwd", "bwd")


def _bias_kernel_support(direction: str, head_dim: int, head_dim_v: int,
                         config: AttentionConfig) -> tuple[bool, str]:
  if direction not in BIAS_DIRECTIONS:
    return False, f"bias: the {direction} kernels take no bias"
  if (head_dim, head_dim_v) not in BIAS_HEAD_DIM_PAIRS:
    return False, (f"bias: (head_dim, head_dim_v) ({head_dim}, {head_dim_v}) has no bias "
                   f"kernel; accepted: {BIAS_HEAD_DIM_PAIRS}")
  if direction == "bwd" and config.deterministic:
    return False, "bias: no deterministic backward kernel takes a bias"
  return True, ""


# The most arrays a score_mod / mask_mod may close over in the kernels (their operand slots).
MOD_MAX_ARRAYS = 4
# Directions whose kernels take score_mod / mask_mod. The backward kernel takes them where
# score_mod's derivative by the score is a constant (mods_derivative) and the call has no
# softcap and is not deterministic; otherwise the backward runs the reference (JAX
# differentiates score_mod and mask_mod there).
MODS_DIRECTIONS = ("fwd", "bwd")


@functools.lru_cache(maxsize=256)
def mods_derivative(mods: str) -> Optional[float]:
  """score_mod's derivative by the score where its IR is a literal (ALiBi, T5 buckets, an added
  bias: 1.0; no score_mod: 1.0), else None."""
  dscore = json.loads(mods)["dscore"]
  if dscore is None:
    return 1.0
  output = dscore["output"]
  if output[0] != "lit":
    return None
  return float.fromhex(output[1]) if isinstance(output[1], str) else float(output[1])


@functools.lru_cache(maxsize=256)
def mods_arrays(mods: Optional[str]) -> tuple:
  """((dtype, rank), ...) of the arrays a mods spec (AttentionConfig.mods) reads; () for None."""
  if mods is None:
    return ()
  return tuple(tuple(a) for a in json.loads(mods)["arrays"])


@functools.lru_cache(maxsize=256)
def mods_inputs(mods: Optional[str]) -> frozenset:
  """The inputs ("score", "batch", "head", "q_idx", "kv_idx") a mods spec's IRs read: a call
  whose functions read "batch" or "head" runs whole along that dim (sharding, vmap), since the
  kernels see the indices of their own operands."""
  found = set()

  def walk(x):
    if isinstance(x, list):
      if len(x) == 2 and x[0] == "in" and isinstance(x[1], str):
        found.add(x[1])
      for item in x:
        walk(item)
    elif isinstance(x, dict):
      for item in x.values():
        walk(item)

  if mods is not None:
    data = json.loads(mods)
    walk([data["score"], data["dscore"], data["mask"]])
  return frozenset(found)


def mods_digest(mods: str) -> str:
  """The variant-key digest of a mods spec's canonical JSON (mod_ir.ModSpec.digest)."""
  return hashlib.sha256(mods.encode()).hexdigest()[:16]


def _mods_kernel_support(direction: str, head_dim: int, head_dim_v: int,
                         config: AttentionConfig) -> tuple[bool, str]:
  if direction not in MODS_DIRECTIONS:
    return False, f"score_mod / mask_mod: the {direction} kernels take neither"
  if (head_dim, head_dim_v) not in BIAS_HEAD_DIM_PAIRS:
    return False, (f"score_mod / mask_mod: (head_dim, head_dim_v) ({head_dim}, {head_dim_v}) "
                   f"has no kernel; accepted: {BIAS_HEAD_DIM_PAIRS}")
  if config.has_bias:
    return False, "score_mod / mask_mod: no kernel takes them with a bias"
  if direction == "bwd":
    if mods_derivative(config.mods) is None:
      return False, ("score_mod / mask_mod: the backward kernels take a score_mod whose "
                     "derivative by the score is a constant only")
    if config.softcap is not None:
      return False, "score_mod / mask_mod: no backward kernel takes them with a softcap"
    if config.deterministic:
      return False, "score_mod / mask_mod: no deterministic backward kernel takes them"
  return True, ""


def _fp8_kernel_support(direction: str, head_dim: int, head_dim_v: int,
                        config: Optional[AttentionConfig]) -> tuple[bool, str]:
  if direction != "fwd":
    return False, f"{FP8_DTYPE} has a forward kernel only"
  if head_dim not in FP8_HEAD_DIMS or head_dim_v != head_dim:
    return False, (f"{FP8_DTYPE} kernels take head_dim {FP8_HEAD_DIMS} with head_dim_v equal "
                   f"to it; got {head_dim}, {head_dim_v}")
  if config is not None:
    used = [name for name, on in (("window_size", config.has_window),
                                  ("segment ids", config.has_segment_ids),
                                  ("softcap", config.softcap is not None)) if on]
    if used:
      return False, f"the {FP8_DTYPE} kernels run dense or causal calls only, not {used}"
  return True, ""


def decode_variant(dtype: str, head_dim: int, head_dim_v: int, arch: str = "sm90a",
                   kv_dtype: Optional[str] = None) -> KernelVariant:
  """The split-KV decode variant of a query dtype, head-dim pair and cache dtype (kv_dtype:
  FP8_DTYPE, or None for caches in dtype); causal, windows and softcap are run-time scalars
  of the call."""
  if kv_dtype is not None and kv_dtype != FP8_DTYPE:
    raise ValueError(f"kv_dtype: expected None (caches in {dtype}) or {FP8_DTYPE!r}, got "
                     f"{kv_dtype!r}")
  return KernelVariant(direction="decode", arch=arch, dtype=dtype, head_dim=head_dim,
                       head_dim_v=head_dim_v, causal=False,
                       schedule=decode_schedule(head_dim, head_dim_v, kv_dtype is not None),
                       kv_dtype=kv_dtype)


def decode_launched(variant: KernelVariant) -> KernelVariant:
  """The decode variant whose kernel runs a call of `variant`: a bfloat16 query over FP8_DTYPE
  caches runs the float16 one, its query and values scaled by powers of two into float16's
  range (decode_kernel._bfloat16_over_fp8: e4m3 -> float16 is one conversion per pair, ->
  bfloat16 four); any other variant runs itself."""
  if variant.direction == "decode" and variant.kv_dtype is not None and (
      variant.dtype == "bfloat16"):
    return dataclasses.replace(variant, dtype="float16")
  return variant


def chunked_variant(dtype: str, head_dim: int, head_dim_v: int,
                    arch: str = "sm90a") -> KernelVariant:
  """The chunked-prefill variant of a query dtype and head-dim pair (CHUNKED_HEAD_DIM_PAIRS):
  a decode-direction variant (the decode call's operands and FFI target) whose schedule is
  chunked; causal, windows and softcap are run-time scalars as in decode_variant."""
  return KernelVariant(direction="decode", arch=arch, dtype=dtype, head_dim=head_dim,
                       head_dim_v=head_dim_v, causal=False,
                       schedule=chunked_schedule(head_dim, head_dim_v))


def decode_fp8_support(dtype: str, head_dim: int, head_dim_v: int) -> tuple[bool, str]:
  """Whether a decode kernel reads FP8_DTYPE caches with a dtype query: float16 / bfloat16
  queries, head_dim = head_dim_v in FP8_HEAD_DIMS."""
  if dtype not in KERNEL_DTYPES:
    return False, (f"a {dtype} query has no decode kernel over {FP8_DTYPE} caches; accepted: "
                   f"{', '.join(KERNEL_DTYPES)}")
  if head_dim != head_dim_v or head_dim not in FP8_HEAD_DIMS:
    return False, (f"{FP8_DTYPE} caches have decode kernels for head_dim = head_dim_v in "
                   f"{FP8_HEAD_DIMS}; got {head_dim}, {head_dim_v}")
  return True, ""


def shipped_variants(arch: str = "sm90a", direction: str = "fwd") -> list[KernelVariant]:
  """The variants `python -m jaxflash.build --all` builds and the CPU compile tests check.

  direction="bwd" lists the backward variants (non-deterministic and deterministic),
  direction="decode" the split-KV decode variants (one per dtype and head-dim pair, and one per
  FP8 head dim over FP8 caches: float16, which bfloat16 queries run too, decode_launched), then
  the chunked-prefill ones (one per dtype and pair of CHUNKED_HEAD_DIM_PAIRS).
  """
  if direction not in DIRECTIONS:
    raise ValueError(f"direction: {direction!r} unknown; accepted: {DIRECTIONS}")
  if direction == "decode":  # caches in the query's dtype, FP8 caches, chunked prefill
    return ([decode_variant(dtype, d, dv, arch) for dtype in KERNEL_DTYPES
             for d, dv in KERNEL_HEAD_DIM_PAIRS["decode"]]
            + [decode_variant("float16", d, d, arch, FP8_DTYPE) for d in FP8_HEAD_DIMS]
            + [chunked_variant(dtype, d, dv, arch) for dtype in KERNEL_DTYPES
               for d, dv in CHUNKED_HEAD_DIM_PAIRS])
  out = []
  # Dense (causal or not), then masked (windows, segment ids: causal at run time), then masked
  # with a narrow band where that differs; forward variants of long calls, then those of short
  # ones where they differ (fwd_schedule).
  masks = ({"causal": False}, {"causal": True}, {"window_left": 0},
           {"window_left": NARROW_BAND_MAX_KEYS - 1, "window_right": 0})
  for dtype in KERNEL_DTYPES:
    for head_dim, head_dim_v in KERNEL_HEAD_DIM_PAIRS[direction]:
      for mask in masks:
        for deterministic in (False, True) if direction == "bwd" else (False,):
          cfg = AttentionConfig(softmax_scale=1.0, deterministic=deterministic, **mask)
          for seq_k in (None, SHORT_DENSE_MAX_KEYS) if direction == "fwd" else (None,):
            variant = KernelVariant.for_call(direction, arch, dtype, head_dim, head_dim_v, cfg,
                                             seq_k)
            if variant not in out:
              out.append(variant)
  # Bias variants (masked: every mask at run time), not deterministic.
  for dtype in KERNEL_DTYPES if direction in BIAS_DIRECTIONS else ():
    for head_dim, head_dim_v in BIAS_HEAD_DIM_PAIRS:
      cfg = AttentionConfig(softmax_scale=1.0, bias_dims=(True, True, True))
      out.append(KernelVariant.for_call(direction, arch, dtype, head_dim, head_dim_v, cfg))
  if direction == "fwd":  # FP8: dense, causal or not; per-head or block descales
    out += [fp8_fwd_variant(d, causal, arch, blocks) for blocks in (False, True)
            for d in FP8_HEAD_DIMS for causal in (False, True)]
  return out


def fwd_scratch_shapes(variant: KernelVariant) -> tuple[tuple[str, tuple[int, ...], str], ...]:
  """Scratch results of one forward call, in custom-call result order after out and lse:
  ((name, shape, dtype), ...). A dynamic schedule claims its tiles from tile_counter, which the
  handler zeroes before each launch (so its content need not be initialised)."""
  if variant.direction != "fwd":
    raise ValueError(f"variant.direction: {variant.direction!r}; this is the forward's scratch")
  dynamic = isinstance(variant.schedule, FwdSchedule) and variant.schedule.dynamic
  return (("tile_counter", (1,), "int32"),) if dynamic else ()


def bwd_scratch_shapes(variant: KernelVariant, batch: int, seq_q: int, num_heads: int,
                       seq_k: Optional[int] = None) -> tuple[tuple[str, tuple[int, ...], str], ...]:
  """Scratch buffers of one backward call, in custom-call result order after dq, dk, dv.

  Returns ((name, shape, dtype), ...). seq_q is rounded up to the schedule's tile_m. The kernels
  never read what they have not written, so XLA may hand over uninitialised memory: the
  preprocess zeroes dq_semaphore, and dq_accum in the default mode; deterministic variants
  store each dq_accum block's first contribution and the postprocess skips blocks whose
  semaphore counts none. dq_semaphore exists only for deterministic variants. Bias variants
  end with dbias (batch, num_heads, seq_q, bias_row_length(seq_k)) in the input dtype (seq_k
  required): d loss / d score of every (batch, query head, query, key < seq_k), which the kernel
  writes once each (the blocks a key tile's mask skips as zeros); the padding columns stay
  unwritten.
  """
  if variant.direction != "bwd":
    raise ValueError(f"variant.direction: {variant.direction!r}; scratch exists for 'bwd' only")
  tile_m = variant.schedule.tile_m
  seq_q_rounded = -(-seq_q // tile_m) * tile_m
  rows = (batch, num_heads, seq_q_rounded)
  copies = dq_accum_copies(variant, seq_q)
  shapes = (("dq_accum", (batch, num_heads, copies * seq_q_rounded, variant.head_dim),
             "float32"),
            ("lse_log2", rows, "float32"),
            ("delta", rows, "float32"))
  if variant.deterministic:
    shapes += (("dq_semaphore", (batch, num_heads, copies * seq_q_rounded // tile_m), "int32"),)
  if variant.bias:
    if seq_k is None:
      raise ValueError(f"seq_k: a bias variant's scratch holds dbias per key; got None "
                       f"({variant.key})")
    shapes += (("dbias", (batch, num_heads, seq_q, bias_row_length(seq_k)), variant.dtype),)
  return shapes


def bias_row_length(seq_k: int) -> int:
  """The last extent of a bias variant's bias operand and dbias scratch: seq_k rounded up to a
  multiple of 8, so that each row starts 16 bytes after the last (TMA's global strides are
  multiples of 16 bytes). kernel_abi.h JaxflashBias; the primitive pads the bias to it."""
  return -(-seq_k // 8) * 8


def dq_accum_copies(variant: KernelVariant, seq_q: int) -> int:
  """dQ accumulator copies of one backward call: the schedule's, or one above its
  two_dq_copies_max_seq_q. The scratch shape carries the count to the kernels."""
  schedule = variant.schedule
  limit = schedule.two_dq_copies_max_seq_q
  return 1 if limit is not None and seq_q > limit else schedule.dq_copies
