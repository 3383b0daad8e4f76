"""Pure-JAX attention: the naive test oracle and the blocked O(seq)-memory forward/backward.

Imports jax and jaxflash.config only. Layout BTNH, as in jax.nn.dot_product_attention.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax

from jaxflash.config import AttentionConfig

# Key/value rows per step of the blocked scan. 512 keeps CPU matmuls efficient while the
# score block (batch, heads, seq_q, 512) stays far below a (seq_q x seq_k) buffer at long seq.
DEFAULT_BLOCK_K = 512


def _compute_dtype(dtype) -> jnp.dtype:
  """Accumulate in float32, or in the input dtype when it is wider (float64 oracle runs)."""
  return jnp.promote_types(dtype, jnp.float32)


def visible_mask(config: AttentionConfig, seq_q: int, seq_k: int, rows, cols,
                 q_segment_ids=None, kv_segment_ids=None):
  """Boolean (…, rows, cols) mask of the keys each query sees.

  `rows`/`cols` are integer query/key positions. Causal and window are measured from the
  bottom-right aligned diagonal: query i sits at key position i + seq_k - seq_q.
  """
  col = cols[None, :]
  mask = _band(config, col < seq_k, col, rows[:, None] + (seq_k - seq_q))
  if q_segment_ids is not None:
    # (batch, rows, cols) once segment ids enter.
    mask = mask[None] & (q_segment_ids[:, :, None] == kv_segment_ids[:, None, :])
  return mask


def _band(config: AttentionConfig, mask, col, position):
  """mask restricted to the keys `col` that causal and the window let a query at key position
  `position` see (broadcasting shapes)."""
  if config.causal:
    mask &= col <= position
  if config.window_right is not None:
    mask &= col <= position + config.window_right
  if config.window_left is not None:
    mask &= col >= position - config.window_left
  return mask


def _split_groups(q, num_kv_heads):
  """(b, s, h, d) -> (b, s, h_kv, g, d): query heads grouped by the kv head they read."""
  b, s, h, d = q.shape
  return q.reshape(b, s, num_kv_heads, h // num_kv_heads, d)


def _scores(config: AttentionConfig, qg, k, cdt):
  """Scaled (and soft-capped) scores (b, h_kv, g, s_q, s_k) plus the pre-cap tanh for the bwd."""
  s = jnp.einsum("bqhgd,bkhd->bhgqk", qg.astype(cdt), k.astype(cdt),
                 precision=lax.Precision.HIGHEST) * config.softmax_scale
  if config.softcap is None:
    return s, None
  t = jnp.tanh(s / config.softcap)
  return config.softcap * t, t


class ScoreMods(NamedTuple):
  """A call's programmable score modifiers (checked by jaxflash/programmable.py), applied in
  this order after the scale and softcap: scores + bias, then score_mod, then the built-in
  masks and mask_mod. None: absent.

  bias: (batch or 1, heads or 1, seq_q or 1, seq_k) array added to the scores.
  score_mod(score, batch, head, q_idx, kv_idx) -> score and mask_mod(batch, head, q_idx,
  kv_idx) -> bool: JAX functions of scalars (int32 indices; q_idx in [0, seq_q), kv_idx in
  [0, seq_k)), mapped over every (batch, head, query, key) with vmap.
  """

  bias: Any = None
  score_mod: Optional[Callable] = None
  mask_mod: Optional[Callable] = None


def _map_bhqk(fn, scores, b: int, h: int, seq_q: int, cols):
  """fn over every (batch, head, query, key) index, key innermost: fn(score, b, h, q, kv) with
  scores (b, h, seq_q, len(cols)), or fn(b, h, q, kv) with scores None. Returns (b, h, seq_q,
  len(cols))."""
  idx = tuple(jnp.arange(n, dtype=jnp.int32) for n in (b, h, seq_q)) + (cols,)
  lead = () if scores is None else (0,)
  args = (() if scores is None else (scores,)) + idx
  f = fn
  for axis in (3, 2, 1, 0):  # kv innermost, batch outermost
    f = jax.vmap(f, in_axes=lead + tuple(0 if i == axis else None for i in range(4)))
  return f(*args)


def _modify(mods: ScoreMods, s, mask, bias_block, start: int, seq_k: int):
  """Scores s (b, h_kv, g, s_q, block) and their mask with `mods` applied; bias_block: the
  bias's columns of this block (b|1, h|1, s_q|1, block) or None. Key columns past seq_k (the
  last block's padding) call the functions with kv_idx = seq_k - 1; the mask drops them."""
  b, h_kv, g, seq_q, block = s.shape
  if bias_block is not None:
    s = s + _grouped_bias(bias_block, h_kv, g).astype(s.dtype)
  cols = jnp.minimum(start + jnp.arange(block, dtype=jnp.int32), seq_k - 1)
  if mods.score_mod is not None:
    s4 = _map_bhqk(mods.score_mod, s.reshape(b, h_kv * g, seq_q, block), b, h_kv * g, seq_q,
                   cols)
    s = s4.astype(s.dtype).reshape(s.shape)
  if mods.mask_mod is not None:
    keep = _map_bhqk(mods.mask_mod, None, b, h_kv * g, seq_q, cols)
    mask = mask & keep.reshape(b, h_kv, g, seq_q, block)
  return s, mask


def _grouped_bias(bias_block, h_kv: int, g: int):
  """A bias block (b|1, h|1, s_q|1, cols) viewed against scores (b, h_kv, g, s_q, cols)."""
  return bias_block.reshape(bias_block.shape[0], -1 if bias_block.shape[1] == 1 else h_kv,
                            1 if bias_block.shape[1] == 1 else g, *bias_block.shape[2:])


def _bias_blocks(bias, num_blocks: int, block_k: int):
  """(b|1, h|1, s_q|1, s_k) -> (num_blocks, b|1, h|1, s_q|1, block_k): each key block's
  columns, the scan's leading axis (padding columns are masked by col < seq_k)."""
  return jnp.moveaxis(_pad_keys(bias, num_blocks, block_k, axis=3).reshape(
      *bias.shape[:3], num_blocks, block_k), 3, 0)


def reduce_bias_grad(ds, bias_shape):
  """The gradient of a bias of shape (b|1, h|1, s_q|1, cols) from the gradient of the scores
  it was added to, ds (b, h, s_q, cols): summed over the bias's broadcast dims, in float32 at
  least (16-bit ds: the kernels' dbias scratch); ds itself where nothing is broadcast."""
  axes = tuple(i for i in range(3) if bias_shape[i] == 1 and ds.shape[i] != 1)
  if not axes:
    return ds
  return jnp.sum(ds, axis=axes, keepdims=True, dtype=jnp.promote_types(ds.dtype, jnp.float32))


def _expand_mask(mask):
  """Broadcast a (rows, cols) or (b, rows, cols) mask against (b, h_kv, g, rows, cols)."""
  if mask.ndim == 2:
    return mask
  return mask[:, None, None]


def naive_attention(query, key, value, config: AttentionConfig, q_segment_ids=None,
                    kv_segment_ids=None, compute_dtype=None, learnable_sink=None):
  """Materialises all scores: the test oracle. Returns (out, lse).

  compute_dtype: None = float32 (float64 for float64 inputs); pass the input dtype to get the
  "same math done naively in the input dtype" that bounds kernel error in tests.
  learnable_sink: (num_heads,) logits, each an extra column of its head's softmax with no value
  (written out here as that column, independently of jaxflash/sink.py).
  """
  cdt = compute_dtype or _compute_dtype(query.dtype)
  b, seq_q, h, _ = query.shape
  seq_k, h_kv = key.shape[1], key.shape[2]
  qg = _split_groups(query, h_kv)
  s, _ = _scores(config, qg, key, cdt)
  mask = _expand_mask(visible_mask(config, seq_q, seq_k, jnp.arange(seq_q), jnp.arange(seq_k),
                                   q_segment_ids, kv_segment_ids))
  return _naive_softmax(query, s, mask, value, learnable_sink, cdt)


def _naive_softmax(query, s, mask, value, learnable_sink, cdt):
  """(out, lse) from all scores s (b, h_kv, g, s_q, s_k) and their visibility mask."""
  b, seq_q, h, _ = query.shape
  h_kv = s.shape[1]
  s = jnp.where(mask, s, -jnp.inf).astype(cdt)
  if learnable_sink is not None:
    sink = jnp.broadcast_to(learnable_sink.astype(cdt).reshape(1, h_kv, h // h_kv, 1, 1),
                            s.shape[:-1] + (1,))
    s = jnp.concatenate([s, sink], axis=-1)
  m = jnp.max(s, axis=-1, keepdims=True)
  m_safe = jnp.where(jnp.isfinite(m), m, 0)
  p = jnp.exp(s - m_safe)
  l = jnp.sum(p, axis=-1, keepdims=True)
  p = p / jnp.where(l > 0, l, 1)
  if learnable_sink is not None:
    p = p[..., :-1]  # the sink's column has no value
  out = jnp.einsum("bhgqk,bkhd->bqhgd", p, value.astype(cdt), precision=lax.Precision.HIGHEST)
  out = out.reshape(b, seq_q, h, value.shape[-1])
  # No key: l = 0, lse -inf. A NaN score makes l NaN, and lse NaN like out.
  lse = jnp.where(l[..., 0] == 0, -jnp.inf, m_safe[..., 0] + jnp.log(l[..., 0]))
  return out.astype(query.dtype), lse.reshape(b, h, seq_q).astype(_compute_dtype(cdt))


def _varying_axes(*xs) -> frozenset:
  """shard_map manual axes the arrays vary over (jax 0.10+: typeof().mat.varying; older: vma)."""
  axes = set()
  for x in xs:
    if x is None:
      continue
    t = jax.typeof(x)
    mat = getattr(t, "mat", None)
    axes |= set(mat.varying if mat is not None else getattr(t, "vma", ()))
  return frozenset(axes)


def _vary_like(carry, *refs):
  """Marks a scan's initial carry as varying like `refs`: inside shard_map (check_vma=True)
  the carry out varies over the inputs' manual axes, and scan needs equal carry types."""
  axes = _varying_axes(*refs)

  def cast(x):
    missing = tuple(sorted(axes - _varying_axes(x)))
    return lax.pcast(x, missing, to="varying") if missing else x

  return jax.tree_util.tree_map(cast, carry)


def _block_k(seq_k: int, block_k: Optional[int]) -> int:
  return max(1, min(block_k or DEFAULT_BLOCK_K, seq_k))


def _pad_keys(x, num_blocks: int, block_k: int, axis: int = 1):
  """Pads the key axis to num_blocks * block_k; padded columns are masked by col < seq_k."""
  pad = num_blocks * block_k - x.shape[axis]
  if pad == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  return jnp.pad(x, widths)


def _key_blocks(x, num_blocks: int, block_k: int):
  """(b, s_k, ...) -> (num_blocks, b, block_k, ...), the scan's leading axis."""
  x = _pad_keys(x, num_blocks, block_k)
  x = x.reshape(x.shape[0], num_blocks, block_k, *x.shape[2:])
  return jnp.moveaxis(x, 1, 0)


def _block_mask(config, seq_q, seq_k, start, block_k, q_segment_ids, kv_seg_block):
  cols = start + jnp.arange(block_k)
  return _expand_mask(visible_mask(config, seq_q, seq_k, jnp.arange(seq_q), cols,
                                   q_segment_ids, kv_seg_block))


def blocked_forward(query, key, value, config: AttentionConfig, q_segment_ids=None,
                    kv_segment_ids=None, block_k: Optional[int] = None,
                    mods: Optional[ScoreMods] = None):
  """Online-softmax forward over key blocks; never builds a (seq_q x seq_k) buffer.

  Returns (out in the query dtype, lse float32 (batch, heads, seq_q), -inf where no key).
  mods: bias / score_mod / mask_mod (ScoreMods), or None. With them the function is meant to
  be differentiated by JAX itself (gradients of the bias and of the arrays the functions close
  over included): each key block's step is rematerialised, so the backward keeps one carry per
  block, not the blocks' scores.
  """
  cdt = _compute_dtype(query.dtype)
  b, seq_q, h, _ = query.shape
  seq_k, h_kv, dv = key.shape[1], key.shape[2], value.shape[-1]
  g = h // h_kv
  bk = _block_k(seq_k, block_k)
  nblocks = -(-seq_k // bk)
  qg = _split_groups(query, h_kv).astype(cdt)
  segs = _key_blocks(kv_segment_ids, nblocks, bk) if kv_segment_ids is not None else None
  bias = None if mods is None else mods.bias
  if bias is not None:  # (nblocks, b|1, h|1, s_q|1, bk): the bias's columns of each block
    bias = _bias_blocks(bias, nblocks, bk)
  xs = (jnp.arange(nblocks) * bk, _key_blocks(key, nblocks, bk),
        _key_blocks(value, nblocks, bk), segs, bias)

  def step(carry, x):
    start, kb, vb, segb, bias_block = x
    s, _ = _scores(config, qg, kb, cdt)
    mask = _block_mask(config, seq_q, seq_k, start, bk, q_segment_ids, segb)
    if mods is not None:
      s, mask = _modify(mods, s, mask, bias_block, start, seq_k)
    return _online_step(carry, s, mask, vb, cdt), None

  init = _vary_like(_online_init(b, h_kv, g, seq_q, dv, cdt), query, key, value,
                    q_segment_ids, kv_segment_ids)
  carry, _ = lax.scan(step if mods is None else jax.checkpoint(step), init, xs)
  return _online_result(carry, query, cdt)


def _online_init(b, h_kv, g, seq_q, dv, cdt):
  """The online softmax's carry before any key: row max -inf, row sum 0, accumulator 0."""
  return (jnp.full((b, h_kv, g, seq_q), -jnp.inf, cdt), jnp.zeros((b, h_kv, g, seq_q), cdt),
          jnp.zeros((b, h_kv, g, seq_q, dv), cdt))


def _online_step(carry, s, mask, vb, cdt):
  """One key block of the online softmax: scores s (b, h_kv, g, s_q, block), its mask, and
  the block's values vb (b, block, h_kv, dv)."""
  m, l, acc = carry
  s = jnp.where(mask, s, -jnp.inf)
  m_new = jnp.maximum(m, jnp.max(s, axis=-1))
  m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0)  # rows with no key yet: keep p = 0
  p = jnp.exp(s - m_safe[..., None])
  alpha = jnp.exp(jnp.where(jnp.isfinite(m), m, m_safe) - m_safe)
  l = l * alpha + jnp.sum(p, axis=-1)
  pv = jnp.einsum("bhgqk,bkhd->bhgqd", p, vb.astype(cdt), precision=lax.Precision.HIGHEST)
  return m_new, l, acc * alpha[..., None] + pv


def _online_result(carry, query, cdt):
  """(out in the query dtype (b, s_q, h, dv), lse (b, h, s_q)) of the online softmax's carry."""
  m, l, acc = carry
  b, seq_q, h, _ = query.shape
  dv = acc.shape[-1]
  seen = l > 0
  out = acc / jnp.where(seen, l, 1)[..., None]
  out = jnp.moveaxis(out, 3, 1).reshape(b, seq_q, h, dv)  # (b, s_q, h_kv, g, dv) -> BTNH
  # No key: l = 0, lse -inf. A NaN score makes l NaN, and lse NaN like out (the row max may
  # have skipped the NaN: XLA's CPU max can return the other operand).
  lse = jnp.where(l == 0, -jnp.inf, m + jnp.log(jnp.where(l == 0, 1, l)))
  lse_dtype = jnp.promote_types(cdt, jnp.float32)
  return out.astype(query.dtype), lse.reshape(b, h, seq_q).astype(lse_dtype)


def blocked_backward(query, key, value, out, lse, d_out, d_lse, config: AttentionConfig,
                     q_segment_ids=None, kv_segment_ids=None, block_k: Optional[int] = None,
                     bias=None):
  """FlashAttention-2 style backward: recomputes P from the saved lse, one key block at a time.

  d_lse is the cotangent of the lse output (zeros when the caller did not use lse); since
  d lse / d s = P it enters as a shift of the row term delta. Returns (dq, dk, dv), and with a
  bias (b|1, h|1, s_q|1, s_k) (added after the scale and softcap, as blocked_forward's
  ScoreMods) also dbias: the gradient of the biased scores, P * (dP - delta), summed over the
  bias's broadcast dims, in the bias's dtype.
  """
  cdt = _compute_dtype(query.dtype)
  b, seq_q, h, d = query.shape
  seq_k, h_kv = key.shape[1], key.shape[2]
  g = h // h_kv
  bk = _block_k(seq_k, block_k)
  nblocks = -(-seq_k // bk)
  qg = _split_groups(query, h_kv).astype(cdt)
  dog = _split_groups(d_out, h_kv).astype(cdt)
  lse_g = lse.reshape(b, h_kv, g, seq_q).astype(cdt)
  lse_safe = jnp.where(jnp.isfinite(lse_g), lse_g, 0)  # -inf rows have an all-false mask
  delta = jnp.einsum("bqhgd,bqhgd->bhgq", dog, _split_groups(out, h_kv).astype(cdt),
                     precision=lax.Precision.HIGHEST)
  delta = delta - d_lse.reshape(b, h_kv, g, seq_q).astype(cdt)
  segs = _key_blocks(kv_segment_ids, nblocks, bk) if kv_segment_ids is not None else None
  bias_blocks = None if bias is None else _bias_blocks(bias, nblocks, bk)
  xs = (jnp.arange(nblocks) * bk, _key_blocks(key, nblocks, bk),
        _key_blocks(value, nblocks, bk), segs, bias_blocks)

  def step(dq, x):
    start, kb, vb, segb, bias_block = x
    s, t = _scores(config, qg, kb, cdt)
    if bias_block is not None:
      s = s + _grouped_bias(bias_block, h_kv, g).astype(cdt)
    mask = _block_mask(config, seq_q, seq_k, start, bk, q_segment_ids, segb)
    p = jnp.where(mask, jnp.exp(jnp.where(mask, s, 0) - lse_safe[..., None]), 0)
    dv_b = jnp.einsum("bhgqk,bqhgd->bkhd", p, dog, precision=lax.Precision.HIGHEST)
    dp = jnp.einsum("bqhgd,bkhd->bhgqk", dog, vb.astype(cdt), precision=lax.Precision.HIGHEST)
    ds = p * (dp - delta[..., None])
    dbias_b = None
    if bias_block is not None:
      dbias_b = reduce_bias_grad(ds.reshape(b, h, seq_q, bk), bias_block.shape)
    if t is not None:
      ds = ds * (1 - t * t)  # d/dx of c*tanh(x/c)
    ds = ds * config.softmax_scale
    dq = dq + jnp.einsum("bhgqk,bkhd->bqhgd", ds, kb.astype(cdt), precision=lax.Precision.HIGHEST)
    dk_b = jnp.einsum("bhgqk,bqhgd->bkhd", ds, qg, precision=lax.Precision.HIGHEST)
    return dq, (dk_b, dv_b, dbias_b)

  dq0 = _vary_like(jnp.zeros_like(qg), query, key, value, out, lse, d_out, d_lse, q_segment_ids,
                  kv_segment_ids, bias)
  dq, (dk, dv, dbias) = lax.scan(step, dq0, xs)

  def unblock(x, like):
    x = jnp.moveaxis(x, 0, 1).reshape(b, nblocks * bk, *x.shape[3:])
    return x[:, :seq_k].astype(like.dtype)

  grads = (dq.reshape(b, seq_q, h, d).astype(query.dtype), unblock(dk, key), unblock(dv, value))
  if bias is None:
    return grads
  # (nblocks, b|1, h|1, s_q|1, bk) -> (b|1, h|1, s_q|1, s_k)
  dbias = jnp.moveaxis(dbias, 0, 3).reshape(*bias.shape[:3], nblocks * bk)[..., :seq_k]
  return grads + (dbias.astype(bias.dtype),)


# ---------------------------------------------------------------------------------------------
# KV caches (jaxflash.kv_cache_attention): keys live in a cache of per-sequence lengths, the
# queries are its last tokens. Contiguous caches are (batch, capacity, h_kv, d); paged ones a
# pool (num_pages, page_size, h_kv, d) with a page table (batch, pages per sequence).

def cache_capacity(k_cache, page_table=None) -> int:
  """Keys a sequence can hold: max_len, or pages per sequence * page_size."""
  if page_table is None:
    return k_cache.shape[1]
  return page_table.shape[1] * k_cache.shape[1]


def cache_rows(cache, page_table, positions, descale=None):
  """The cache rows of logical `positions` (b, n) of each sequence: (b, n, h_kv, d).

  Paged: position p of sequence b is row p % page_size of page page_table[b, p // page_size];
  page-table entries outside the pool are clamped into it, as are positions past the
  capacity (their keys are masked by the length, which never exceeds the capacity).
  descale: float8_e4m3fn caches' (num_pages or batch, h_kv) float32 descales: the rows come
  back dequantized, in float32 (row * descale of its page or sequence and kv head).
  """
  if page_table is None:
    rows = jnp.clip(positions, 0, cache.shape[1] - 1)
    owner = jnp.broadcast_to(jnp.arange(cache.shape[0])[:, None], positions.shape)
    out = jnp.take_along_axis(cache, rows[:, :, None, None], axis=1)
  else:
    page_size = cache.shape[1]
    column = jnp.clip(positions // page_size, 0, page_table.shape[1] - 1)
    owner = jnp.clip(jnp.take_along_axis(page_table, column, axis=1), 0, cache.shape[0] - 1)
    out = cache[owner, positions % page_size]
  if descale is None:
    return out
  return out.astype(jnp.float32) * descale[owner][..., None]


def cache_mask(config: AttentionConfig, lengths, seq_q: int, cols):
  """(b, s_q, cols) mask of the cache keys each query sees: keys below the sequence's length,
  with causal and the window measured from the query's position lengths[b] - s_q + i."""
  position = (lengths[:, None] - seq_q + jnp.arange(seq_q))[:, :, None]
  col = cols[None, None, :]
  return _band(config, col < lengths[:, None, None], col, position)


def naive_kv_cache_attention(query, k_cache, v_cache, lengths, config: AttentionConfig,
                             page_table=None, compute_dtype=None, learnable_sink=None,
                             descales=(None, None)):
  """Materialises every key of the caches' capacity: the test oracle. `lengths` must already
  be within [0, capacity]. Returns (out, lse) as naive_attention. descales: (k, v) descales of
  float8_e4m3fn caches (cache_rows), or Nones."""
  cdt = compute_dtype or _compute_dtype(query.dtype)
  b, seq_q, _, _ = query.shape
  capacity = cache_capacity(k_cache, page_table)
  cols = jnp.broadcast_to(jnp.arange(capacity), (b, capacity))
  key, value = (cache_rows(c, page_table, cols, d) for c, d in zip((k_cache, v_cache), descales))
  s, _ = _scores(config, _split_groups(query, key.shape[2]), key, cdt)
  mask = cache_mask(config, lengths, seq_q, jnp.arange(capacity))[:, None, None]
  return _naive_softmax(query, s, mask, value, learnable_sink, cdt)


def blocked_kv_cache_forward(query, k_cache, v_cache, lengths, config: AttentionConfig,
                             page_table=None, block_k: Optional[int] = None,
                             descales=(None, None)):
  """Online-softmax forward over key blocks of the caches: memory of one block at a time.
  `lengths` must already be within [0, capacity]. Returns (out, lse) as blocked_forward.
  descales: (k, v) descales of float8_e4m3fn caches, each block dequantized as it is read."""
  cdt = _compute_dtype(query.dtype)
  b, seq_q, h, _ = query.shape
  h_kv, dv = k_cache.shape[2], v_cache.shape[-1]
  capacity = cache_capacity(k_cache, page_table)
  bk = _block_k(capacity, block_k)
  qg = _split_groups(query, h_kv).astype(cdt)

  def step(carry, start):
    cols = start + jnp.arange(bk)
    positions = jnp.broadcast_to(cols, (b, bk))
    kb, vb = (cache_rows(c, page_table, positions, d)
              for c, d in zip((k_cache, v_cache), descales))
    s, _ = _scores(config, qg, kb, cdt)
    mask = cache_mask(config, lengths, seq_q, cols)[:, None, None]
    return _online_step(carry, s, mask, vb, cdt), None

  init = _vary_like(_online_init(b, h_kv, h // h_kv, seq_q, dv, cdt), query, k_cache, v_cache,
                    lengths, page_table)
  carry, _ = lax.scan(step, init, jnp.arange(-(-capacity // bk)) * bk)
  return _online_result(carry, query, cdt)
