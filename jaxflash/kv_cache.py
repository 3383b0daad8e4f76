"""Attention over KV caches for generation: `kv_cache_attention` and `update_kv_cache`.

Argument checks, defaults and the choice of implementation: the decode kernels
(jaxflash/split_kv.py: split-KV decode, or chunked prefill for calls with many query rows) on a
Hopper GPU, else jaxflash/reference.py's cache forward;
float8_e4m3fn caches (jaxflash/fp8_cache.py) run on the reference. Imports jax and the
public-API layer's helpers (checks, attention's empty result, sink), config, reference,
fp8_cache and split_kv.
"""

from __future__ import annotations

import functools
import numbers
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxflash import _jax_internal, checks, fp8_cache, implementation, reference, split_kv
from jaxflash.attention import empty_result
from jaxflash.config import (AttentionConfig, IMPLEMENTATIONS, chunked_variant,
                             decode_fp8_support, decode_launched, decode_variant,
                             kernel_support)
from jaxflash.sink import add_learnable_sink, check_learnable_sink

# Accepted page sizes: powers of two, as FlashAttention's paged caches take them.
MIN_PAGE_SIZE, MAX_PAGE_SIZE = 16, 512


def _check_int_array(name: str, x, rank: int, layout: str):
  checks.check_array(name, x, rank, layout)
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"{name}: expected an integer dtype (int32), got {x.dtype}")


def _check_caches(query, k_cache, v_cache, cache_lengths, page_table, fp8: bool = False):
  """Ranks, shapes and dtypes of the cache operands against the query; returns the query's
  dtype (the caches' too, unless they are float8_e4m3fn: fp8)."""
  checks.check_array("query", query, 4, "(batch, seq_q, num_heads, head_dim)")
  paged = page_table is not None
  layout = ("(num_pages, page_size, num_kv_heads, head_dim)" if paged
            else "(batch, max_len, num_kv_heads, head_dim)")
  checks.check_array("k_cache", k_cache, 4, layout)
  checks.check_array("v_cache", v_cache, 4, layout.replace("head_dim)", "head_dim_v)"))
  b, _, h, d = query.shape
  if k_cache.shape[-1] != d:
    raise ValueError(f"k_cache: head_dim {k_cache.shape[-1]} differs from the query's {d}")
  if tuple(v_cache.shape[:3]) != tuple(k_cache.shape[:3]):
    raise ValueError(f"v_cache: shape {tuple(v_cache.shape)} must match k_cache "
                     f"{tuple(k_cache.shape)} but in the last dim (head_dim_v)")
  h_kv = k_cache.shape[2]
  if h_kv == 0 or h % h_kv:
    raise ValueError(f"query / k_cache: num_heads {h} must be a multiple of num_kv_heads {h_kv}")
  if paged:
    _check_int_array("page_table", page_table, 2, "(batch, max_pages_per_sequence)")
    if page_table.shape[0] != b:
      raise ValueError(f"page_table: batch {page_table.shape[0]} differs from the query's {b}")
    page_size = k_cache.shape[1]
    if (page_size < MIN_PAGE_SIZE or page_size > MAX_PAGE_SIZE
        or page_size & (page_size - 1)):
      raise ValueError(f"k_cache: page_size {page_size} (dim 1 of a paged cache) must be a "
                       f"power of two from {MIN_PAGE_SIZE} to {MAX_PAGE_SIZE}")
  elif k_cache.shape[0] != b:
    raise ValueError(f"k_cache: batch {k_cache.shape[0]} differs from the query's {b} (a "
                     f"contiguous cache is (batch, max_len, num_kv_heads, head_dim); pass "
                     f"page_table for a paged one)")
  _check_int_array("cache_lengths", cache_lengths, 1, "(batch,)")
  if tuple(cache_lengths.shape) != (b,):
    raise ValueError(f"cache_lengths: expected shape ({b},), got {tuple(cache_lengths.shape)}")
  if fp8:
    return checks.common_dtype({"query": query})
  return checks.common_dtype({"query": query, "k_cache": k_cache, "v_cache": v_cache})


def _check_options(causal, softmax_scale, window_size, softcap, num_splits, return_lse,
                   implementation, head_dim) -> AttentionConfig:
  for name, flag in (("causal", causal), ("return_lse", return_lse)):
    if not isinstance(flag, (bool, np.bool_)):
      raise TypeError(f"{name}: expected a Python bool, got {flag!r}")
  if num_splits is not None and (not isinstance(num_splits, numbers.Integral)
                                 or isinstance(num_splits, bool) or num_splits < 1):
    raise ValueError(f"num_splits: expected None (automatic) or an int >= 1, got "
                     f"{num_splits!r}")
  if implementation not in (None,) + IMPLEMENTATIONS:
    raise ValueError(f"implementation: expected None, 'cute' or 'reference', got "
                     f"{implementation!r}")
  # The same checks and defaults as jaxflash.attention's options.
  return checks.check_options(causal, softmax_scale, window_size, softcap, False, return_lse,
                              implementation, head_dim)


def _resolve_implementation(requested: Optional[str], dtype: str, head_dim: int,
                            head_dim_v: int, num_splits: Optional[int],
                            kv_dtype: Optional[str], chunked: bool) -> str:
  """'cute' or 'reference' (implementation.resolve): the decode kernels where one covers the
  call (fp16/bf16, the forward's head dims; float8_e4m3fn caches: head_dim = head_dim_v in
  config.FP8_HEAD_DIMS) and its variant (chunked: the chunked-prefill one, split_kv.use_chunked)
  is installed or buildable. 'cute' lowers without a CUDA device here (jax.export for a GPU
  elsewhere) only with num_splits given where the call runs the split-KV variant: the automatic
  count is chosen from the GPU's SM count (a chunked call runs no split). kv_dtype: the caches'
  dtype where it is FP8, else None."""
  def missing() -> str:
    from jaxflash import ffi  # only on a CUDA host: keeps `import jaxflash` light
    variant = (chunked_variant(dtype, head_dim, head_dim_v) if chunked
               else decode_launched(decode_variant(dtype, head_dim, head_dim_v,
                                                   kv_dtype=kv_dtype)))
    return ffi.variant_available(variant)[1]
  covered = kernel_support("decode", dtype, head_dim, head_dim_v)
  if covered[0] and kv_dtype is not None:
    covered = decode_fp8_support(dtype, head_dim, head_dim_v)
  if (requested == "cute" and covered[0] and num_splits is None and not chunked
      and not _jax_internal.has_cuda_device()):
    raise ValueError("num_splits: None (automatic) is chosen from the GPU's SM count, and no "
                     "CUDA device is visible; to lower implementation='cute' for a GPU "
                     "elsewhere (jax.export), give num_splits (an int >= 1), or use "
                     "implementation=None (auto) or 'reference'")
  return implementation.resolve(requested, covered, missing)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1, 2))
def _forward(config: AttentionConfig, num_splits: Optional[int], chunked: bool, query, k_cache,
             v_cache, lengths, page_table, sink, k_descale, v_descale):
  if config.implementation == "cute":  # the kernel clamps the lengths itself
    return split_kv.kernel_forward(config, query, k_cache, v_cache, lengths, page_table, sink,
                                   num_splits, k_descale, v_descale, chunked=chunked)
  capacity = reference.cache_capacity(k_cache, page_table)
  out, lse = reference.blocked_kv_cache_forward(query, k_cache, v_cache,
                                                jnp.clip(lengths, 0, capacity), config,
                                                page_table, descales=(k_descale, v_descale))
  if sink is not None:
    out, lse = add_learnable_sink(out, lse, sink)
  return out, lse


@_forward.defjvp
def _forward_jvp(config, num_splits, chunked, primals, tangents):
  del config, num_splits, chunked, primals, tangents
  raise TypeError("kv_cache_attention is forward only (inference): it has no gradient. To "
                  "differentiate attention, call jaxflash.attention on the keys and values.")


def kv_cache_attention(query, k_cache, v_cache, cache_lengths, *, page_table=None,
                       causal: bool = True, softmax_scale: Optional[float] = None,
                       window_size=(None, None), softcap: Optional[float] = None,
                       learnable_sink=None, k_descale=None, v_descale=None,
                       num_splits: Optional[int] = None, return_lse: bool = False,
                       implementation: Optional[str] = None):
  """Attention of new tokens over a KV cache (decoding, speculative verification, chunked
  prefill), contiguous or paged, with per-sequence lengths known at run time only.

  Args:
    query: (batch, seq_q, num_heads, head_dim), float16/bfloat16 (float32/float64 too): the
      new tokens, the last seq_q of each sequence.
    k_cache, v_cache: contiguous (batch, max_len, num_kv_heads, head_dim[_v]), or with
      `page_table` a page pool (num_pages, page_size, num_kv_heads, head_dim[_v]), page_size a
      power of two from 16 to 512. num_heads % num_kv_heads == 0 (GQA/MQA).
    cache_lengths: (batch,) integers: valid keys per sequence, the new tokens included. Keys
      at or past a sequence's length are never attended to, and the kernel reads no key block
      that lies wholly past it (work and bytes follow the lengths). Values are clamped to [0,
      capacity] (max_len, or max_pages_per_sequence * page_size). A sequence of length 0
      outputs zeros (lse -inf, or its sink).
    page_table: (batch, max_pages_per_sequence) integers: key position p of sequence b lives
      in row p % page_size of page page_table[b, p // page_size]; pages may sit anywhere in
      the pool. Entries outside [0, num_pages) are clamped into it (only entries that hold
      keys below the length matter). None: contiguous caches.
    causal: query i of sequence b sits at position cache_lengths[b] - seq_q + i and sees keys
      at or before it. False: every query sees every key below the length.
    softmax_scale, window_size, softcap, learnable_sink: as in `jaxflash.attention`, with the
      window measured from each query's position above.
    k_descale, v_descale: float8_e4m3fn caches only (and then required): float32 descales per
      (page, kv head), (num_pages, num_kv_heads), with a page table, per (sequence, kv head),
      (batch, num_kv_heads), without: key j of sequence b is its cache entry times the descale
      of its page (or sequence) and kv head (`update_kv_cache` writes both). The decode kernel
      reads them with a float16 / bfloat16 query and head_dim = head_dim_v in 64, 128, 256
      (it converts each block exactly to the query's dtype and applies the descales in
      float32); the reference dequantizes each block of keys as it reads it.
    num_splits: how many parts the split-KV decode kernel splits each sequence's keys into
      (None: chosen from the static shapes and the GPU's SM count, so implementation="cute"
      on a host without a GPU, e.g. jax.export for one elsewhere, needs it given for a call
      on that kernel); the result is the same up to rounding, and bitwise the same run to run
      for a given count. A given count always runs the split-KV kernel; with None, calls
      with many query rows per kv head run the chunked-prefill kernel (below: one CTA per
      query tile over all of its keys, no split). The reference computes in one pass.
    return_lse: also return lse (batch, num_heads, seq_q), float32 (natural log).
    implementation: None (auto): the decode kernels on a Hopper GPU for float16/bfloat16 and
      the forward kernels' head dims, else the reference; "cute": the kernel or an error;
      "reference": the pure-JAX implementation, on every platform, which reads the caches
      block by block (memory of one block of keys at a time).

  Returns:
    out (batch, seq_q, num_heads, head_dim_v) in the query dtype, or (out, lse).

  On the GPU a call whose packed query rows (seq_q * num_heads / num_kv_heads) fill at least
  one 128-row tile per (sequence, kv head), with enough such tiles to fill most of the GPU's
  SMs, runs the chunked-prefill kernel (the forward's 128-row tiles, two consumer warpgroups,
  keys through the page table; head dims (64, 64), (96, 96), (128, 128) over 16-bit caches,
  contiguous or in pages of a multiple of 128 keys) when num_splits is None. Other calls
  (decoding, short chunks, smaller pages, FP8 caches, larger head dims, a given num_splits) run
  the split-KV decode kernel. Both give the same result up to rounding
  (docs/kernels.md, "Chunked prefill over KV caches").

  Forward only: differentiating raises a TypeError. jit and vmap work; under `jit` with
  shardings over batch (contiguous caches) or heads (a pool split by kv heads) each shard
  reads only its own cache.
  """
  fp8 = fp8_cache.check_descales(k_cache, v_cache, k_descale, v_descale, page_table is not None)
  dtype = _check_caches(query, k_cache, v_cache, cache_lengths, page_table, fp8)
  config = _check_options(causal, softmax_scale, window_size, softcap, num_splits,
                          return_lse, implementation, query.shape[-1])
  if learnable_sink is not None:
    check_learnable_sink(learnable_sink, query.shape[2], accept_float64=dtype == "float64")
  capacity = reference.cache_capacity(k_cache, page_table)
  lengths = jnp.asarray(cache_lengths, jnp.int32)
  if page_table is not None:
    page_table = jnp.asarray(page_table, jnp.int32)
  b, seq_q, h, _ = query.shape
  if 0 in (b, seq_q, h) or capacity == 0 or k_cache.shape[0] == 0:
    out, lse = empty_result(query, v_cache)
    if learnable_sink is not None:
      out, lse = add_learnable_sink(out, lse, learnable_sink)
  else:
    kv_dtype = fp8_cache.FP8_DTYPE if fp8 else None
    # A given split count asks for the split-KV kernel; only automatic calls may go chunked.
    chunked = num_splits is None and split_kv.use_chunked(
        b, seq_q, h, k_cache.shape[2], dtype, query.shape[-1], v_cache.shape[-1], kv_dtype,
        page_size=None if page_table is None else k_cache.shape[1])
    impl = _resolve_implementation(implementation, dtype, query.shape[-1], v_cache.shape[-1],
                                   num_splits, kv_dtype, chunked)
    out, lse = _forward(config.replace(implementation=impl), num_splits, chunked, query,
                        k_cache, v_cache, lengths, page_table, learnable_sink, k_descale,
                        v_descale)
  return (out, lse) if return_lse else out


def update_kv_cache(k_cache, v_cache, new_k, new_v, cache_lengths, *, page_table=None,
                    k_descale=None, v_descale=None):
  """Writes new tokens into KV caches at each sequence's length.

  Args:
    k_cache, v_cache: as for `kv_cache_attention` (contiguous or a page pool).
    new_k: (batch, n, num_kv_heads, head_dim); new_v: (batch, n, num_kv_heads, head_dim_v), in
      the caches' dtype (float16 / bfloat16 / float32 for float8_e4m3fn caches, quantized on
      write): token t of sequence b goes to position cache_lengths[b] + t.
    cache_lengths: (batch,) integers: the valid keys before the new tokens.
    page_table: the page table of a paged pool, or None.
    k_descale, v_descale: float8_e4m3fn caches only (and then required): their float32
      descales, as `kv_cache_attention` takes them (zeros for a new pool or cache).

  Returns:
    (k_cache, v_cache, new_lengths): the updated caches (an XLA scatter, in place when the
    caches are donated, e.g. `jax.jit(..., donate_argnums=(0, 1))`) and cache_lengths + n as
    int32. Tokens whose position is at or past the capacity are dropped and the new lengths
    are clamped to it; paged: the page table must hold a page for every written position
    (entries outside the pool are clamped into it, as kv_cache_attention reads them), and a
    page is written by one sequence. float8_e4m3fn caches return (k_cache, v_cache,
    new_lengths, k_descale, v_descale): each page (or sequence) the write touches gets the
    descale max(its descale, amax of its new tokens per kv head / 448), the rows already in it
    requantized when that grows (a descale only grows while its page holds valid keys); a page
    (or sequence) that holds no valid key before the write starts from the new tokens' amax.
  """
  paged = page_table is not None
  layout = ("(num_pages, page_size, num_kv_heads, head_dim)" if paged
            else "(batch, max_len, num_kv_heads, head_dim)")
  checks.check_array("k_cache", k_cache, 4, layout)
  checks.check_array("v_cache", v_cache, 4, layout.replace("head_dim)", "head_dim_v)"))
  checks.check_array("new_k", new_k, 4, "(batch, n, num_kv_heads, head_dim)")
  checks.check_array("new_v", new_v, 4, "(batch, n, num_kv_heads, head_dim_v)")
  b, n = new_k.shape[:2]
  fp8 = fp8_cache.check_descales(k_cache, v_cache, k_descale, v_descale, paged)
  for name, new, cache in (("new_k", new_k, k_cache), ("new_v", new_v, v_cache)):
    if tuple(new.shape[2:]) != tuple(cache.shape[2:]):
      raise ValueError(f"{name}: shape {tuple(new.shape)} must end in the cache's "
                       f"(num_kv_heads, head_dim) = {tuple(cache.shape[2:])}")
    if fp8:
      fp8_cache.check_new_tokens(name, new)
    elif new.dtype != cache.dtype:
      raise TypeError(f"{name}: dtype {new.dtype} differs from the cache's {cache.dtype}")
  if tuple(new_v.shape[:2]) != (b, n):
    raise ValueError(f"new_v: batch and tokens {tuple(new_v.shape[:2])} differ from new_k's "
                     f"{(b, n)}")
  if paged:
    _check_int_array("page_table", page_table, 2, "(batch, max_pages_per_sequence)")
    if page_table.shape[0] != b:
      raise ValueError(f"page_table: batch {page_table.shape[0]} differs from new_k's {b}")
  elif k_cache.shape[0] != b or v_cache.shape[0] != b:
    raise ValueError(f"k_cache / v_cache: batch {k_cache.shape[0]} / {v_cache.shape[0]} "
                     f"differs from new_k's {b}")
  _check_int_array("cache_lengths", cache_lengths, 1, "(batch,)")
  if tuple(cache_lengths.shape) != (b,):
    raise ValueError(f"cache_lengths: expected shape ({b},), got {tuple(cache_lengths.shape)}")
  capacity = reference.cache_capacity(k_cache, page_table)
  lengths = jnp.clip(jnp.asarray(cache_lengths, jnp.int32), 0, capacity)
  positions = lengths[:, None] + jnp.arange(n, dtype=jnp.int32)  # (b, n)
  keep = positions < capacity
  if paged:
    page_size = k_cache.shape[1]
    column = jnp.clip(positions // page_size, 0, page_table.shape[1] - 1)
    pages = jnp.take_along_axis(jnp.asarray(page_table, jnp.int32), column, axis=1)
    pages = jnp.clip(pages, 0, k_cache.shape[0] - 1)
    index = (jnp.where(keep, pages, k_cache.shape[0]), positions % page_size)
  else:
    index = (jnp.broadcast_to(jnp.arange(b)[:, None], (b, n)),
             jnp.where(keep, positions, capacity))
  # Dropped tokens carry an index past the end, which mode="drop" skips.
  new_lengths = jnp.minimum(lengths + n, capacity)
  if fp8:
    table = jnp.asarray(page_table, jnp.int32) if paged else None
    owner = jnp.where(keep, index[0], k_cache.shape[0])  # a dropped token has no owner
    (k_cache, v_cache), (k_descale, v_descale) = fp8_cache.write(
        (k_cache, v_cache), (k_descale, v_descale), (new_k, new_v), lengths, owner, index[1],
        table)
    return k_cache, v_cache, new_lengths, k_descale, v_descale
  k_cache = k_cache.at[index].set(new_k, mode="drop")
  v_cache = v_cache.at[index].set(new_v, mode="drop")
  return k_cache, v_cache, new_lengths
