"""The split-KV decode kernel's call from JAX: `decode_partials`.

One call of the decode kernel (kernels/decode_sm90.py, kernel_abi.h's JaxflashDecodeArgs): the
query rows of each (batch, kv head), the query heads of the kv head packed into them, against
num_splits parts of each sequence's keys in a KV cache read through a page table, giving each
split's output and lse. The caller (jaxflash/kv_cache.py) packs the rows, picks num_splits,
combines the partials and shards the call (jax.shard_map); nothing here does.

A primitive whose CUDA lowering emits the FFI custom call config.DECODE_TARGET after making the
variant's library present (ffi.ensure_variant, as the forward's lowering does); a lowering for
any other platform raises, since there is no reference path here. Under vmap the call runs once
per mapped element (a sequential `lax.map`): the page table and lengths index the one page pool
per call, so a mapped axis cannot fold into the batch in general. Imports config, primitives,
_jax_internal and ffi (at lowering); never Flax.
"""

from __future__ import annotations

import numbers
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import batching, mlir

from jaxflash import _jax_internal, primitives
from jaxflash.config import DECODE_TARGET, KernelVariant


def decode_partials(q_packed, k_pool, v_pool, page_table, lengths, *, variant: KernelVariant,
                    softmax_scale: float, seqlen_q: int, window_left: Optional[int],
                    window_right: Optional[int], softcap: Optional[float], num_splits: int):
  """(out_partial, lse_partial) of the split-KV decode kernel.

  Args:
    q_packed: (batch, rows, num_kv_heads, head_dim) in the variant's dtype (float16 /
      bfloat16): rows = seqlen_q * group (group = query heads per kv head); row i * group + j
      is query token i of query head kv * group + j.
    k_pool, v_pool: (num_pages, page_size, num_kv_heads, head_dim) and (..., head_dim_v) in
      the same dtype, page_size a power of two >= 16. A contiguous cache (batch, max_len, ...) is a
      pool of batch pages of max_len keys with page_table[b] = [b].
    page_table: (batch, max_pages) int32: key position p of sequence b is row p % page_size of
      page page_table[b, p // page_size]; the entries of pages that hold keys below the length
      must lie in [0, num_pages) (the kernel clamps entries into the pool).
    lengths: (batch,) int32: valid keys per sequence, in [0, max_pages * page_size].
    variant: the decode KernelVariant (config.decode_variant) of the dtype and head dims.
    softmax_scale: multiplies q.k before the softmax.
    seqlen_q: new tokens per sequence; token i of sequence b sits at position lengths[b] -
      seqlen_q + i.
    window_left, window_right: keys visible left / right of a query's position (None:
      unbounded); causal is window_right = 0.
    softcap: scores become softcap * tanh(s / softcap); None: off.
    num_splits: parts each sequence's keys are split into (1 to 65535).

  Returns:
    out_partial (batch, num_splits, rows, num_kv_heads, head_dim_v) float32, each split's
    output over its keys, and lse_partial (batch, num_splits, num_kv_heads, rows) float32, its
    log-sum-exp (natural log; -inf where a split holds no key a row sees, out_partial 0 there).

  Raises:
    TypeError, ValueError: an argument the kernel does not take (the message names it).
    ValueError: at lowering, for a platform other than CUDA.
  """
  _check(q_packed, k_pool, v_pool, page_table, lengths, variant, seqlen_q, num_splits)
  params = dict(variant=variant, softmax_scale=float(softmax_scale), seqlen_q=int(seqlen_q),
                window_left=None if window_left is None else int(window_left),
                window_right=None if window_right is None else int(window_right),
                softcap=None if softcap is None else float(softcap), num_splits=int(num_splits))
  return tuple(decode_p.bind(q_packed, k_pool, v_pool, page_table, lengths, **params))


def _check(q, k, v, page_table, lengths, variant, seqlen_q, num_splits):
  if not isinstance(variant, KernelVariant) or variant.direction != "decode":
    seen = variant.key if isinstance(variant, KernelVariant) else repr(variant)
    raise ValueError(f"variant: expected a decode KernelVariant (config.decode_variant), got "
                     f"{seen}")
  for name, x, rank, layout in (
      ("q_packed", q, 4, "(batch, rows, num_kv_heads, head_dim)"),
      ("k_pool", k, 4, "(num_pages, page_size, num_kv_heads, head_dim)"),
      ("v_pool", v, 4, "(num_pages, page_size, num_kv_heads, head_dim_v)"),
      ("page_table", page_table, 2, "(batch, max_pages)"), ("lengths", lengths, 1, "(batch,)")):
    if np.ndim(x) != rank:
      raise ValueError(f"{name}: expected rank {rank} {layout}, got shape {np.shape(x)}")
  for name, x in (("q_packed", q), ("k_pool", k), ("v_pool", v)):
    if np.dtype(x.dtype).name != variant.dtype:
      raise TypeError(f"{name}: dtype {np.dtype(x.dtype).name} differs from the variant's "
                      f"{variant.dtype} ({variant.key})")
  for name, x in (("page_table", page_table), ("lengths", lengths)):
    if np.dtype(x.dtype) != np.int32:
      raise TypeError(f"{name}: expected int32, got {np.dtype(x.dtype).name}")
  b, rows, hk, d = q.shape
  if d != variant.head_dim:
    raise ValueError(f"q_packed: head_dim {d} differs from the variant's {variant.head_dim}")
  if tuple(k.shape[2:]) != (hk, variant.head_dim):
    raise ValueError(f"k_pool: shape {tuple(k.shape)} must end in (num_kv_heads, head_dim) = "
                     f"{(hk, variant.head_dim)}")
  if tuple(v.shape) != tuple(k.shape[:3]) + (variant.head_dim_v,):
    raise ValueError(f"v_pool: expected shape {tuple(k.shape[:3]) + (variant.head_dim_v,)} "
                     f"(k_pool's with head_dim_v {variant.head_dim_v}), got {tuple(v.shape)}")
  page_size = k.shape[1]
  if (page_size < 16 or page_size & (page_size - 1)) and page_table.shape[1] != 1:
    raise ValueError(f"k_pool: page_size {page_size} (dim 1) must be a power of two >= 16 when "
                     f"page_table has more than one column (a single page may have any size)")
  if page_table.shape[0] != b:
    raise ValueError(f"page_table: batch {page_table.shape[0]} differs from q_packed's {b}")
  if tuple(lengths.shape) != (b,):
    raise ValueError(f"lengths: expected shape ({b},), got {tuple(lengths.shape)}")
  if not _is_int(seqlen_q) or seqlen_q < 1 or rows % seqlen_q:
    raise ValueError(f"seqlen_q: expected an int >= 1 that divides q_packed's {rows} rows "
                     f"(rows = seqlen_q * query heads per kv head), got {seqlen_q!r}")
  if not _is_int(num_splits) or not 1 <= num_splits <= 65535:
    raise ValueError(f"num_splits: expected an int from 1 to 65535, got {num_splits!r}")


def _is_int(x) -> bool:
  return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _abstract(q, k, v, page_table, lengths, *, variant, num_splits, **_):
  b, rows, hk, _ = q.shape
  ins = (q, k, v, page_table, lengths)
  f32 = np.dtype(np.float32)
  out = _jax_internal.shaped_like(q, (b, num_splits, rows, hk, variant.head_dim_v), f32, ins)
  lse = _jax_internal.shaped_like(q, (b, num_splits, hk, rows), f32, ins)
  return out, lse


def _lower_cuda(ctx, q, k, v, page_table, lengths, *, variant, softmax_scale, seqlen_q,
                window_left, window_right, softcap, num_splits):
  del num_splits  # out_partial's dim 1 carries it
  from jaxflash import ffi  # imported on first CUDA lowering only: keeps `import jaxflash` light
  if _jax_internal.has_cuda_device():
    ffi.ensure_variant(variant)  # cross-lowering on a CPU host needs no library
  attrs = ffi.decode_attributes(variant, softmax_scale, seqlen_q, window_left, window_right,
                                softcap)
  return jax.ffi.ffi_lowering(DECODE_TARGET)(ctx, q, k, v, page_table, lengths, **attrs)


def _lower_elsewhere(ctx, *args, **params):
  del ctx, args, params
  raise ValueError("decode_partials: the split-KV decode kernel needs an NVIDIA Hopper GPU, but "
                   "this computation is lowered for a platform other than cuda; use "
                   "kv_cache_attention's reference implementation there")


def _batch_sequential(args, dims, **params):
  """vmap: one call per mapped element (lax.map), unmapped operands shared by every call."""
  mapped = [jnp.moveaxis(a, d, 0) for a, d in zip(args, dims) if d is not None]

  def one(xs):
    xs = iter(xs)
    operands = [a if d is None else next(xs) for a, d in zip(args, dims)]
    return tuple(decode_p.bind(*operands, **params))

  return jax.lax.map(one, mapped), (0, 0)


decode_p = primitives.make_primitive("jaxflash_decode_kernel", _abstract)
mlir.register_lowering(decode_p, _lower_elsewhere)
mlir.register_lowering(decode_p, _lower_cuda, platform="cuda")
batching.primitive_batchers[decode_p] = _batch_sequential
