"""The decode kernels' call around them: query heads packed per kv head (and unpacked after),
the choice between the split-KV decode variant and the chunked-prefill one, and the split count.

Imports jax, config and jaxflash/decode_kernel.py (the custom call).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxflash import config, decode_kernel

MAX_SPLITS = 128
# A decode CTA's fixed cost in key blocks (choose_num_splits): 16 splits of 2 blocks each ran
# 1.3x slower than 1 split of 32 at 64 x 4k keys, 8 kv heads, on the H200.
_CTA_FIXED_BLOCKS = 1
# Keys one split may hold (choose_num_splits). Lengths are run-time values, so a batch of
# unequal lengths is costed as if every sequence were full; this cap splits its long sequences
# anyway, so that CTAs of short ones fill the SMs beside them: 32 sequences of 1..32k keys in
# 32k caches, 4 kv heads, ran in 299 us with 4 splits of 8k keys against 361 us with the one
# split of the full-cache cost (H200, docs/kernels.md, "Decode"); no full-length row of that
# table changed its count.
MAX_SPLIT_KEYS = 8192
# Streaming multiprocessors of an H100 / H200, when the device does not say.
_DEFAULT_SMS = 132


def num_sms() -> int:
  """Streaming multiprocessors of the first device (its core_count), else an H200's."""
  try:
    count = getattr(jax.devices()[0], "core_count", None)
  except RuntimeError:
    count = None
  return int(count) if count else _DEFAULT_SMS


def choose_num_splits(tiles: int, key_blocks: int, sms: int, max_blocks: int) -> int:
  """How many parts each (sequence, kv head, query tile) splits its key blocks into.

  With s splits, tiles * s CTAs run in ceil(tiles * s / sms) waves of one CTA per SM, and a CTA
  streams up to ceil(key_blocks / s) blocks plus a fixed cost (prologue, Q, epilogue) of about
  one block: the count with the least waves times that wins, the fewest splits among equals,
  among the counts that leave at most max_blocks blocks per split (MAX_SPLIT_KEYS).
  FlashAttention-3's wave-efficiency heuristic, which ignores the rounding of blocks per split
  and the fixed cost, picked 8 instead of 16 splits at 1 x 128k keys, 8 kv heads
  (docs/kernels.md, "Decode"). tiles: CTAs per split; key_blocks: blocks of the longest sequence
  the cache can hold (lengths are run-time values: a ragged batch is costed as if every
  sequence were full).
  """
  limit = max(1, min(MAX_SPLITS, key_blocks))
  fewest = min(limit, max(1, -(-key_blocks // max(1, max_blocks))))

  def cost(s):
    return math.ceil(tiles * s / sms) * (math.ceil(key_blocks / s) + _CTA_FIXED_BLOCKS)

  return min(range(fewest, limit + 1), key=lambda s: (cost(s), s))


def use_chunked(batch: int, seq_q: int, num_heads: int, num_kv_heads: int, dtype: str,
                head_dim: int, head_dim_v: int, kv_dtype=None, sms=None,
                page_size=None) -> bool:
  """Whether a kv_cache_attention call runs the chunked-prefill variant (the forward's 128-row
  tiles over all of a row tile's keys) instead of the split-KV decode one.

  It does where a chunked variant covers the dtypes and head dims (config.chunked_support),
  the caches are contiguous (page_size None) or their page size is a multiple of
  config.CHUNKED_PAGE_MULTIPLE (64: one TMA copy per key block, or 64-key boxes; smaller pages
  would take 16-key boxes, which ran the chunked variant below the split-KV kernel,
  docs/kernels.md "Chunked prefill"), each (sequence, kv head) has at least
  config.CHUNKED_MIN_ROWS packed query rows (seq_q * query heads per kv head: one whole tile),
  and its tiles fill at least config.CHUNKED_MIN_WAVE of the SMs (sms: num_sms() when None, the
  count of an H100 / H200 on a host without a GPU, so the choice is the same from static shapes
  wherever it is made): with fewer tiles the decode kernel's splits of the keys keep the other
  SMs busy.
  """
  if not config.chunked_support(dtype, head_dim, head_dim_v, kv_dtype)[0]:
    return False
  schedule = config.chunked_schedule(head_dim, head_dim_v)
  if page_size is not None and page_size % config.CHUNKED_PAGE_MULTIPLE:
    return False
  rows = seq_q * (num_heads // num_kv_heads)
  if rows < config.CHUNKED_MIN_ROWS:
    return False
  tiles = batch * num_kv_heads * -(-rows // schedule.tile_m)
  return tiles >= config.CHUNKED_MIN_WAVE * (num_sms() if sms is None else sms)


def pack_query(query, num_kv_heads: int):
  """(batch, seq_q, heads, d) -> (batch, kv heads, seq_q * group, d): row i * group + j of kv
  head kv holds token i of query head kv * group + j (the heads that share kv head kv). A
  reshape when seq_q is 1."""
  b, seq_q, h, d = query.shape
  group = h // num_kv_heads
  q = query.reshape(b, seq_q, num_kv_heads, group, d).transpose(0, 2, 1, 3, 4)
  return q.reshape(b, num_kv_heads, seq_q * group, d)


def unpack(out, lse, seq_q: int):
  """pack_query's inverse for the results: out (batch, kv heads, rows, dv) -> (batch, seq_q,
  heads, dv) and lse (batch, kv heads, rows) -> (batch, heads, seq_q). Reshapes when seq_q is
  1."""
  b, hk, rows, dv = out.shape
  group = rows // seq_q
  out = out.reshape(b, hk, seq_q, group, dv).transpose(0, 2, 1, 3, 4)
  lse = lse.reshape(b, hk, seq_q, group).transpose(0, 1, 3, 2)
  return out.reshape(b, seq_q, hk * group, dv), lse.reshape(b, hk * group, seq_q)


def kernel_forward(cfg: config.AttentionConfig, query, k_cache, v_cache, lengths, page_table,
                   sink, num_splits, k_descale=None, v_descale=None, chunked: bool = False):
  """kv_cache_attention on the decode kernels: (out, lse) as the reference returns them, with
  the sink. The kernel clamps the lengths to [0, capacity]; page_table None means contiguous
  caches; float8_e4m3fn caches come with their descales. chunked: run the chunked-prefill
  variant (True, as use_chunked chooses it; num_splits is then ignored) or the split-KV one
  (False)."""
  b, seq_q, h, d = query.shape
  hk, dv = k_cache.shape[2], v_cache.shape[-1]
  kv_dtype = None if k_cache.dtype == query.dtype else str(k_cache.dtype)
  if chunked:
    variant = config.chunked_variant(str(query.dtype), d, dv)
    num_splits = 0
  else:
    variant = config.decode_variant(str(query.dtype), d, dv, kv_dtype=kv_dtype)
  rows = seq_q * (h // hk)
  if num_splits is None:
    capacity = k_cache.shape[1] * (1 if page_table is None else page_table.shape[1])
    tiles = b * hk * -(-rows // variant.schedule.tile_m)
    tile_n = variant.schedule.tile_n
    num_splits = choose_num_splits(tiles, -(-capacity // tile_n), num_sms(),
                                   MAX_SPLIT_KEYS // tile_n)
  right = cfg.window_sides[1]  # causal: no key right of a query's position
  if sink is not None:  # query head kv * group + j's sink at [kv, j]
    sink = jnp.asarray(sink, jnp.float32).reshape(hk, h // hk)
  out, lse = decode_kernel.decode_attention(
      pack_query(query, hk), k_cache, v_cache, page_table, lengths, sink, k_descale, v_descale,
      variant=variant,
      softmax_scale=cfg.softmax_scale, seqlen_q=seq_q, window_left=cfg.window_left,
      window_right=right, softcap=cfg.softcap, num_splits=num_splits)
  return unpack(out, lse, seq_q)
