"""The split-KV decode kernel's call from JAX: `decode_attention`.

One call of the decode kernels (kernels/decode_sm90.py and the merge kernels/decode_combine.py,
kernel_abi.h's JaxflashDecodeArgs): the query rows of each (batch, kv head), the query heads of
the kv head packed into them, against num_splits parts of each sequence's keys in a KV cache
(contiguous, or read through a page table), the splits merged through their lse into the
output and its lse. The caller (jaxflash/split_kv.py) packs and unpacks the rows and picks
num_splits.

Two primitives: decode_p is one kernel call, whose CUDA lowering emits the FFI custom call
config.DECODE_TARGET after making the variant's library present (ffi.ensure_variant, as the
forward's lowering does), and whose lowering elsewhere computes the same partials and merge in
XLA ops (_reference: tests of the call around the kernel on any host); its results include the
partials, the kernel's scratch. decode_call_p, which decode_attention binds, runs decode_p per
shard of batch and kv heads through custom_partitioning (jaxflash/sharding.py's decode rules),
so a sharded cache is never gathered, and returns the output and lse only. Under vmap a mapped
axis folds into the batch where every sequence keeps its keys: contiguous caches mapped with the
queries (each element's own caches), or one page pool that every element's page table indexes;
otherwise (a mapped pool, shared contiguous caches) the call runs once per mapped element (a
sequential `lax.map`). Imports config, primitives, sharding, _jax_internal and ffi (at
lowering); never Flax.
"""

from __future__ import annotations

import numbers
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import batching, mlir

from jax.experimental.custom_partitioning import custom_partitioning

from jaxflash import _jax_internal, primitives, sharding
from jaxflash.config import DECODE_TARGET, WINDOW_UNBOUNDED, KernelVariant, decode_launched


def decode_attention(q_packed, k_pool, v_pool, page_table, lengths, sink=None, k_descale=None,
                     v_descale=None, *, variant: KernelVariant, softmax_scale: float,
                     seqlen_q: int, window_left: Optional[int], window_right: Optional[int],
                     softcap: Optional[float], num_splits: int):
  """(out, lse) of the split-KV decode kernels, in the packed layout.

  Args:
    q_packed: (batch, num_kv_heads, rows, head_dim) in the variant's dtype (float16 /
      bfloat16): rows = seqlen_q * group (group = query heads per kv head); row i * group + j
      is query token i of query head kv * group + j.
    k_pool, v_pool: (num_pages, page_size, num_kv_heads, head_dim) and (..., head_dim_v) in
      the same dtype (float8_e4m3fn for a variant with kv_dtype), page_size a power of two
      >= 16; or, with page_table None, contiguous caches (batch, max_len, num_kv_heads,
      head_dim[_v]) of any max_len.
    page_table: (batch, max_pages) int32: key position p of sequence b is row p % page_size of
      page page_table[b, p // page_size] (the kernel clamps entries into the pool); None:
      contiguous caches.
    lengths: (batch,) int32: valid keys per sequence; the kernel clamps them to [0, max_pages *
      page_size].
    sink: (num_kv_heads, group) float32 learnable sinks (that of query head kv * group + j), or
      None.
    k_descale, v_descale: float8_e4m3fn caches (and only those): (num_pages, num_kv_heads)
      float32, a contiguous cache's page being its sequence: key p is its entry times the
      descale of its page and kv head.
    variant: the decode KernelVariant (config.decode_variant) of the dtype and head dims.
    softmax_scale: multiplies q.k before the softmax.
    seqlen_q: new tokens per sequence; token i of sequence b sits at position lengths[b] -
      seqlen_q + i.
    window_left, window_right: keys visible left / right of a query's position (None:
      unbounded); causal is window_right = 0.
    softcap: scores become softcap * tanh(s / softcap); None: off.
    num_splits: parts each sequence's keys are split into (1 to 65535); 0 for a chunked
      variant (config.chunked_variant: one CTA per 128-row tile over all of its keys, out and
      lse written by the tile, no partials).

  Returns:
    out (batch, num_kv_heads, rows, head_dim_v) in q's dtype and lse (batch, num_kv_heads,
    rows) float32 (natural log, the sink included; a row that sees no key: out 0, lse -inf or
    its sink).

  Under jit with shardings, the call runs per shard of batch and kv heads (a page pool split
  by kv heads; sharding.decode_partition): no cache is gathered.

  Raises:
    TypeError, ValueError: an argument the kernel does not take (the message names it).
  """
  paged = page_table is not None
  if not paged:
    page_table = jnp.zeros((np.shape(q_packed)[0], 1), jnp.int32)  # for the checks only
  _check(q_packed, k_pool, v_pool, page_table, lengths, sink, variant, seqlen_q, num_splits)
  descales = _check_descales(k_pool, k_descale, v_descale, variant)
  b, hk, rows, _ = q_packed.shape
  if sink is None:  # empty: no kernel fills it at run time
    sink = np.zeros((hk, 0), np.float32)
  if not paged and np.shape(k_pool)[0] != b:
    raise ValueError(f"k_pool: contiguous caches (page_table None) hold one sequence per row of "
                     f"dim 0: expected {b} (q_packed's batch), got shape "
                     f"{tuple(np.shape(k_pool))}")
  if 0 in (np.shape(k_pool)[0], np.shape(k_pool)[1], np.shape(page_table)[1]):
    # No key anywhere (TMA cannot describe an empty cache): each row is its sink.
    lse = jnp.full((b, hk, rows), -jnp.inf, jnp.float32)
    if sink.shape[1]:
      lse = jnp.broadcast_to(_sink_rows(sink, seqlen_q), (b, hk, rows))
    return jnp.zeros((b, hk, rows, variant.head_dim_v), q_packed.dtype), lse
  params = dict(variant=variant, softmax_scale=float(softmax_scale), seqlen_q=int(seqlen_q),
                window_left=None if window_left is None else int(window_left),
                window_right=None if window_right is None else int(window_right),
                softcap=None if softcap is None else float(softcap), num_splits=int(num_splits))
  tables = (page_table,) if paged else ()
  return tuple(decode_call_p.bind(q_packed, k_pool, v_pool, lengths, sink, *tables, *descales,
                                  paged=paged, **params))


def _check_descales(k, k_descale, v_descale, variant) -> tuple:
  """(k_descale, v_descale) of a variant over FP8 caches (float32 (num_pages, num_kv_heads)),
  () of one over 16-bit caches (which takes none)."""
  given = (k_descale, v_descale)
  if variant.kv_dtype is None:
    if any(x is not None for x in given):
      raise TypeError(f"k_descale / v_descale: variant {variant.key} reads {variant.dtype} "
                      f"caches, which take no descales")
    return ()
  want = (k.shape[0], k.shape[2])
  for name, x in zip(("k_descale", "v_descale"), given):
    if x is None or tuple(np.shape(x)) != want or np.dtype(x.dtype) != np.float32:
      seen = "None" if x is None else f"{np.dtype(x.dtype).name} {tuple(np.shape(x))}"
      raise ValueError(f"{name}: expected float32 of shape {want} (num_pages, num_kv_heads) "
                       f"for the {variant.kv_dtype} caches of {variant.key}, got {seen}")
  return given


def _check(q, k, v, page_table, lengths, sink, variant, seqlen_q, num_splits):
  if not isinstance(variant, KernelVariant) or variant.direction != "decode":
    seen = variant.key if isinstance(variant, KernelVariant) else repr(variant)
    raise ValueError(f"variant: expected a decode KernelVariant (config.decode_variant), got "
                     f"{seen}")
  for name, x, rank, layout in (
      ("q_packed", q, 4, "(batch, num_kv_heads, rows, head_dim)"),
      ("k_pool", k, 4, "(num_pages, page_size, num_kv_heads, head_dim)"),
      ("v_pool", v, 4, "(num_pages, page_size, num_kv_heads, head_dim_v)"),
      ("page_table", page_table, 2, "(batch, max_pages)"), ("lengths", lengths, 1, "(batch,)")):
    if np.ndim(x) != rank:
      raise ValueError(f"{name}: expected rank {rank} {layout}, got shape {np.shape(x)}")
  kv_dtype = variant.kv_dtype or variant.dtype
  for name, x, want in (("q_packed", q, variant.dtype), ("k_pool", k, kv_dtype),
                        ("v_pool", v, kv_dtype)):
    if np.dtype(x.dtype).name != want:
      raise TypeError(f"{name}: dtype {np.dtype(x.dtype).name} differs from the variant's "
                      f"{want} ({variant.key})")
  for name, x in (("page_table", page_table), ("lengths", lengths)):
    if np.dtype(x.dtype) != np.int32:
      raise TypeError(f"{name}: expected int32, got {np.dtype(x.dtype).name}")
  b, hk, rows, d = q.shape
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
  if variant.schedule.chunked:
    if num_splits != 0 or not _is_int(num_splits):
      raise ValueError(f"num_splits: a chunked variant ({variant.key}) runs no split: expected "
                       f"0, got {num_splits!r}")
  elif not _is_int(num_splits) or not 1 <= num_splits <= 65535:
    raise ValueError(f"num_splits: expected an int from 1 to 65535, got {num_splits!r}")
  group = rows // seqlen_q
  if sink is not None and (tuple(np.shape(sink)) != (hk, group)
                           or np.dtype(sink.dtype) != np.float32):
    raise ValueError(f"sink: expected float32 of shape {(hk, group)} (num_kv_heads, group), "
                     f"got {np.dtype(sink.dtype).name} {tuple(np.shape(sink))}")


def _is_int(x) -> bool:
  return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _abstract(q, k, v, page_table, lengths, sink, *descales, variant, num_splits, **_):
  """decode_p's results: out, lse, then the scratch out_partial and lse_partial."""
  b, hk, rows, _ = q.shape
  ins = (q, k, v, page_table, lengths, sink, *descales)
  f32 = np.dtype(np.float32)
  out = _jax_internal.shaped_like(q, (b, hk, rows, variant.head_dim_v), q.dtype, ins)
  lse = _jax_internal.shaped_like(q, (b, hk, rows), f32, ins)
  out_partial = _jax_internal.shaped_like(q, (b, num_splits, hk, rows, variant.head_dim_v), f32,
                                          ins)
  lse_partial = _jax_internal.shaped_like(q, (b, num_splits, hk, rows), f32, ins)
  return out, lse, out_partial, lse_partial


def _lower_cuda(ctx, q, k, v, page_table, lengths, sink, *descales, variant, softmax_scale,
                seqlen_q, window_left, window_right, softcap, num_splits):
  del num_splits  # out_partial's dim 1 carries it
  from jaxflash import ffi  # imported on first CUDA lowering only: keeps `import jaxflash` light
  if _jax_internal.has_cuda_device():
    ffi.ensure_variant(variant)  # cross-lowering on a CPU host needs no library
  attrs = ffi.decode_attributes(variant, softmax_scale, seqlen_q, window_left, window_right,
                                softcap)
  return jax.ffi.ffi_lowering(DECODE_TARGET)(ctx, q, k, v, page_table, lengths, sink, *descales,
                                            **attrs)


def _reference(q, k, v, page_table, lengths, sink, *descales, variant, softmax_scale, seqlen_q,
               window_left, window_right, softcap, num_splits):
  """The kernels' results in XLA ops: the same split of each row tile's key blocks
  (FlashAttentionDecodeSm90._work), masks and soft-capping for the float32 partials, merged as
  DecodeCombine does; FP8 caches dequantized by their descales. A chunked variant (num_splits
  0) computes its tiles as one split and returns partials of 0 splits. decode_p's lowering on
  platforms other than CUDA (tests of the call around the kernel; it gathers every sequence's
  keys)."""
  chunked = num_splits == 0
  num_splits = max(num_splits, 1)
  f32 = jnp.float32
  if descales:  # (num_pages, kv heads) per cache
    k = k.astype(f32) * descales[0][:, None, :, None]
    v = v.astype(f32) * descales[1][:, None, :, None]
  tile_m, tile_n = variant.schedule.tile_m, variant.schedule.tile_n
  b, hk, rows, d = q.shape
  num_pages, page_size = k.shape[:2]
  if page_table.shape[1] == 0:  # contiguous caches: sequence b is page b
    page_table = jnp.arange(b, dtype=jnp.int32)[:, None]
  capacity = page_table.shape[1] * page_size
  length = jnp.clip(lengths, 0, capacity)[:, None]  # (b, 1)
  pages = jnp.clip(page_table, 0, num_pages - 1)
  keys = k[pages].reshape(b, capacity, hk, d).astype(f32)
  values = v[pages].reshape(b, capacity, hk, v.shape[-1]).astype(f32)
  bound = lambda w: WINDOW_UNBOUNDED if w is None else max(-WINDOW_UNBOUNDED,
                                                           min(int(w), WINDOW_UNBOUNDED))
  left, right = bound(window_left), bound(window_right)
  group = rows // seqlen_q
  row, key = np.arange(rows), jnp.arange(capacity)
  pos = length - seqlen_q + row // group  # (b, rows)
  visible = ((key >= pos[..., None] - left) & (key <= pos[..., None] + right)
             & (key < length[..., None]))  # (b, rows, capacity)
  # Row tile m's key blocks [n_lo, n_hi), cut into num_splits runs of per_split blocks.
  first = row // tile_m * tile_m
  last = np.minimum(first + tile_m, rows) - 1
  key_lo = jnp.maximum(length - seqlen_q + first // group - left, 0)
  key_hi = jnp.minimum(length - seqlen_q + last // group + right + 1, length)
  n_lo = key_lo // tile_n
  n_hi = jnp.where(key_hi > key_lo, -(-key_hi // tile_n), n_lo)
  per_split = -(-(n_hi - n_lo) // num_splits)
  split = jnp.arange(num_splits)
  n_start = jnp.minimum(n_lo[..., None] + split * per_split[..., None], n_hi[..., None])
  n_end = jnp.minimum(n_start + per_split[..., None], n_hi[..., None])  # (b, rows, splits)
  block = (key // tile_n)[None, None, None]
  mine = (block >= n_start[..., None]) & (block < n_end[..., None])  # (b, rows, splits, cap)
  mask = jnp.moveaxis(mine & visible[:, :, None], 2, 1)[:, :, None]  # (b, s, 1, rows, cap)
  scores = jnp.einsum("bhrd,bkhd->bhrk", q.astype(f32), keys) * softmax_scale
  if softcap is not None:
    scores = softcap * jnp.tanh(scores / softcap)
  scores = jnp.where(mask, scores[:, None], -jnp.inf)  # (b, s, hk, rows, cap)
  top = jnp.max(scores, axis=-1)
  top = jnp.where(jnp.isfinite(top), top, 0.0)
  p = jnp.exp(scores - top[..., None])
  total = jnp.sum(p, axis=-1)  # (b, s, hk, rows)
  out_partial = jnp.einsum("bshrk,bkhe->bshre", p, values)
  out_partial = jnp.where(total[..., None] > 0,
                          out_partial / jnp.where(total > 0, total, 1.0)[..., None], 0.0)
  lse_partial = jnp.where(total > 0, top + jnp.log(total), -jnp.inf)
  out, lse = merge_splits(out_partial, lse_partial, sink if sink.shape[1] else None, seqlen_q)
  if chunked:
    out_partial, lse_partial = out_partial[:, :0], lse_partial[:, :0]
  return out.astype(q.dtype), lse, out_partial, lse_partial


def _sink_rows(sink, seq_q: int):
  """(kv heads, group) sinks -> (kv heads, seq_q * group) float32: each packed row's sink (row
  i * group + j: sink[kv, j])."""
  return jnp.tile(jnp.asarray(sink, jnp.float32), (1, seq_q))


def merge_splits(out_partial, lse_partial, sink, seq_q: int):
  """The splits' partial results merged through their lse, in the packed layout: what
  kernels/decode_combine.py computes (the decode call's reference and its tests).

  out_partial (batch, splits, kv heads, rows, dv) holds each split's output normalised over
  its keys, lse_partial (batch, splits, kv heads, rows) its lse (-inf: no key). sink (kv heads,
  group) float32 or None joins every row's denominator (row i * group + j: sink[kv, j]).
  Returns out (batch, kv heads, rows, dv) and lse (batch, kv heads, rows) float32; a row with
  no key at all has out 0 and lse -inf (or its sink).
  """
  top = jnp.max(lse_partial, axis=1)  # (b, hk, rows)
  if sink is not None:
    sink_rows = _sink_rows(sink, seq_q)[None]  # (1, hk, rows)
    top = jnp.maximum(top, sink_rows)
  top = jnp.where(jnp.isfinite(top), top, 0.0)  # no key and no sink: every weight is 0
  weights = jnp.exp(lse_partial - top[:, None])
  total = jnp.sum(weights, axis=1)
  if sink is not None:
    total = total + jnp.exp(sink_rows - top)
  out = jnp.einsum("bshr,bshrd->bhrd", weights, out_partial,
                   precision=jax.lax.Precision.HIGHEST)
  out = jnp.where(total[..., None] > 0, out / jnp.where(total > 0, total, 1.0)[..., None], 0.0)
  lse = jnp.where(total > 0, top + jnp.log(total), -jnp.inf)
  return out, lse


def _batch_sequential(prim):
  """vmap: one call per mapped element (lax.map), unmapped operands shared by every call."""

  def rule(args, dims, **params):
    mapped = [jnp.moveaxis(a, d, 0) for a, d in zip(args, dims) if d is not None]

    def one(xs):
      xs = iter(xs)
      operands = [a if d is None else next(xs) for a, d in zip(args, dims)]
      return tuple(prim.bind(*operands, **params))

    return jax.lax.map(one, mapped), (0, 0)

  return rule


# decode_p: one kernel call on whatever it is given (the CUDA custom call; elsewhere the XLA
# reference of its partials). Operands (q, k, v, page_table, lengths, sink), then k_descale and
# v_descale for FP8 caches.
decode_p = primitives.make_primitive("jaxflash_decode_kernel", _abstract)
mlir.register_lowering(decode_p, mlir.lower_fun(_reference, multiple_results=True))
mlir.register_lowering(decode_p, _lower_cuda, platform="cuda")
batching.primitive_batchers[decode_p] = _batch_sequential(decode_p)


# decode_call_p: decode_p per shard of batch and kv heads, through custom_partitioning
# (sharding.decode_sharding_rule / decode_partition), returning out and lse (the partials are
# decode_p's scratch). Operands (q, k, v, lengths, sink[, page_table][, k_descale, v_descale]):
# contiguous caches have no table operand, each shard numbering its own sequences' pages; FP8
# caches add their descales.
def _split_rest(rest, paged: bool):
  """(page_table or None, descales) of decode_call_p's operands after the sink."""
  return (rest[0] if paged else None), tuple(rest[1:] if paged else rest)


def _call_abstract(q, k, v, lengths, sink, *rest, paged, **params):
  table, descales = _split_rest(rest, paged)
  return _abstract(q, k, v, lengths if table is None else table, lengths, sink, *descales,
                   **params)[:2]


def _partitioned(static):
  paged, params = static[0], dict(static[1:])
  fp8 = params["variant"].kv_dtype is not None

  def compute(*args):  # (q, k, v, page_table, lengths, sink[, k_descale, v_descale]), a shard
    if decode_launched(params["variant"]) != params["variant"]:
      return _bfloat16_over_fp8(params, *args)
    return tuple(decode_p.bind(*args, **params))[:2]

  def impl(static, q, k, v, lengths, sink, *rest):
    del static
    table, descales = _split_rest(rest, paged)
    # Contiguous caches: a table of no column (sequence b is page b), which nothing fills.
    if table is None:
      table = jnp.zeros((q.shape[0], 0), jnp.int32)
    return compute(q, k, v, table, lengths, sink, *descales)

  def partition(static, mesh, arg_shapes, result_shapes):
    del static, result_shapes
    arg_shardings, result_shardings, per_shard = sharding.decode_partition(
        paged, mesh, arg_shapes, compute, fp8)
    return mesh, per_shard, result_shardings, arg_shardings

  def rule(static, mesh, operand_types, result_types):
    del static, mesh, operand_types, result_types
    return sharding.decode_sharding_rule(paged, fp8)

  partitioned = custom_partitioning(impl, static_argnums=(0,))
  partitioned.def_partition(partition=partition, sharding_rule=rule)
  return partitioned


def _bfloat16_over_fp8(params, q, k, v, page_table, lengths, sink, k_descale, v_descale):
  """decode_p of a bfloat16 query over float8_e4m3fn caches on the float16 variant, per shard:
  e4m3 -> float16 is one conversion per pair in the kernel, e4m3 -> bfloat16 four (through
  float16 and float32).

  Powers of two keep every value in float16's range without rounding it: the query is scaled by
  2^s so that its largest magnitude lies in [2^14, 2^15) (a bfloat16 value at least 2^-28 of
  that largest one is then a normal float16, exact: 8 significant bits; smaller ones become
  subnormal float16), and the k descales by 2^-s, so every
  score is unchanged; the v descales are scaled by 2^-t so that the largest value a valid key
  can hold (448 times the largest v descale of a page below a sequence's length) lies in [2^14,
  2^15), and the float16 output by 2^t in float32 before it becomes bfloat16 (an output is a
  convex combination of the values). Pages past the lengths never set t: their descales may
  hold anything. The maxima are the shard's own: no collective."""
  f32 = jnp.float32
  variant = decode_launched(params["variant"])
  q = q.astype(f32)
  s = _exponent_to(jnp.max(jnp.abs(q)), 15)
  t = -_exponent_to(_largest_valid(v_descale, lengths, page_table, k.shape[1]) * 448.0, 15)
  q = (q * jnp.ldexp(f32(1), s)).astype(jnp.float16)
  k_descale = k_descale * jnp.ldexp(f32(1), -s)
  v_descale = v_descale * jnp.ldexp(f32(1), -t)
  out, lse = decode_p.bind(q, k, v, page_table, lengths, sink, k_descale, v_descale,
                           **dict(params, variant=variant))[:2]
  return (out.astype(f32) * jnp.ldexp(f32(1), t)).astype(jnp.bfloat16), lse


def _exponent_to(amax, top: int):
  """The power of two s with amax * 2^s in [2^(top - 1), 2^top): int32, 0 where amax is 0 or
  not finite, and within [-100, 100] (so that 2^s and 2^-s times a descale stay normal)."""
  ok = jnp.isfinite(amax) & (amax > 0)
  _, e = jnp.frexp(jnp.where(ok, amax, 1.0).astype(jnp.float32))
  return jnp.clip(jnp.where(ok, top - e, 0), -100, 100).astype(jnp.int32)


def _largest_valid(descale, lengths, page_table, page_size: int):
  """The largest finite descale of a page (or contiguous sequence: a table of no column) that
  holds a key below its sequence's length, over every kv head; 0 if none. The kernel reads no
  other page."""
  if page_table.shape[1] == 0:  # (batch, kv heads): sequence b's own descales
    valid = jnp.broadcast_to((jnp.clip(lengths, 0, page_size) > 0)[:, None], descale.shape)
  else:
    length = jnp.clip(lengths, 0, page_size * page_table.shape[1])
    column = jnp.arange(page_table.shape[1]) * page_size
    valid = (column[None] < length[:, None])[..., None]  # (b, max_pages, 1)
    descale = jnp.take(descale, jnp.clip(page_table, 0, descale.shape[0] - 1), axis=0)
  keep = valid & jnp.isfinite(descale)
  return jnp.max(jnp.where(keep, jnp.abs(descale), 0.0), initial=0.0)


def _call_lowering(ctx, *args, paged, **params):
  static = (paged,) + tuple(sorted(params.items()))
  partitioned = _partitioned(static)
  return mlir.lower_fun(lambda *a: partitioned(static, *a), multiple_results=True)(ctx, *args)


def _batch_call(args, dims, *, paged, **params):
  """vmap of decode_call_p: one call over batch x the mapped size when that keeps every
  sequence's keys its own (mapped contiguous caches, or an unmapped page pool: the page table
  indexes the one pool whatever the batch row) and one sink for all, else one call per mapped
  element. The split count stays the call's. FP8 caches' descales go with their caches: a
  pool's stay whole (mapped, the call runs per element), contiguous caches' fold with them."""
  cache_dims = dims[1:3]
  descale_args = range(6, len(args)) if paged else range(5, len(args))
  if dims[4] is not None:  # the sink is per head: a mapped one has no batch row to fold into
    return _batch_sequential(decode_call_p)(args, dims, paged=paged, **params)
  if paged and any(dims[i] is not None for i in (1, 2, *descale_args)):
    return _batch_sequential(decode_call_p)(args, dims, paged=paged, **params)
  if not paged and any(d is None for d in cache_dims):  # folding would copy shared caches
    return _batch_sequential(decode_call_p)(args, dims, paged=paged, **params)
  size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)

  def fold(i, a, d):
    if (paged and i in (1, 2, *descale_args)) or i == 4:  # the pool and its descales, the sink
      return a
    a = jnp.broadcast_to(a, (size,) + a.shape) if d is None else jnp.moveaxis(a, d, 0)
    return a.reshape((size * a.shape[1],) + a.shape[2:])

  outs = decode_call_p.bind(*(fold(i, a, d) for i, (a, d) in enumerate(zip(args, dims))),
                            paged=paged, **params)
  return tuple(x.reshape((size, x.shape[0] // size) + x.shape[1:]) for x in outs), (0, 0)


decode_call_p = primitives.make_primitive("jaxflash_decode", _call_abstract)
mlir.register_lowering(decode_call_p, _call_lowering)
batching.primitive_batchers[decode_call_p] = _batch_call
_jax_internal.require_devices_during_lowering(decode_call_p)
