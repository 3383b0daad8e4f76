"""float8_e4m3fn KV caches: descale checks and quantization on write (update_kv_cache).

A cache of float8_e4m3fn keys or values carries a float32 descale per (page, kv head) for a
page pool, per (sequence, kv head) for contiguous caches: key j of sequence b is
`cache[its page or sequence, row, kv head] * descale[its page or sequence, kv head]`. A write
sets the descale of each page (or sequence) it touches to the largest of its descale and
amax(new tokens) / 448 (e4m3's largest finite value), requantizing the rows already there when
it grows; a page (or sequence) that holds no valid key before the write starts afresh from the
new tokens' amax. Imports jax, numpy, checks and fp8 (the e4m3 dtype and its range) only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxflash import checks
from jaxflash.fp8 import FP8_DTYPE, FP8_MAX

NEW_TOKEN_DTYPES = ("float16", "bfloat16", "float32")


def is_fp8(x) -> bool:
  return np.dtype(x.dtype).name == FP8_DTYPE


def check_descales(k_cache, v_cache, k_descale, v_descale, paged: bool) -> bool:
  """True for float8_e4m3fn caches (their descales checked: float32 (num_pages, num_kv_heads)
  with a page table, (batch, num_kv_heads) without), False for 16-bit caches (descales must
  be None). TypeError / ValueError name the argument."""
  fp8 = (is_fp8(k_cache), is_fp8(v_cache))
  if fp8[0] != fp8[1]:
    raise TypeError(f"k_cache / v_cache: both {FP8_DTYPE} or neither, got {k_cache.dtype} and "
                    f"{v_cache.dtype}")
  descales = (("k_descale", k_descale), ("v_descale", v_descale))
  if not fp8[0]:
    for name, x in descales:
      if x is not None:
        raise TypeError(f"{name}: applies to {FP8_DTYPE} caches only; these are "
                        f"{k_cache.dtype} (pass None)")
    return False
  layout = "(num_pages, num_kv_heads)" if paged else "(batch, num_kv_heads)"
  want = (k_cache.shape[0], k_cache.shape[2])
  for name, x in descales:
    if x is None:
      raise TypeError(f"{name}: {FP8_DTYPE} caches need float32 descales {layout} = {want}; "
                      f"got None")
    checks.check_array(name, x, 2, layout)
    if np.dtype(x.dtype).name != "float32":
      raise TypeError(f"{name}: expected float32, got {x.dtype}")
    if tuple(x.shape) != want:
      raise ValueError(f"{name}: expected shape {layout} = {want}, got {tuple(x.shape)}")
  return True


def check_new_tokens(name: str, new) -> None:
  if np.dtype(new.dtype).name not in NEW_TOKEN_DTYPES:
    raise TypeError(f"{name}: {FP8_DTYPE} caches take new tokens in "
                    f"{', '.join(NEW_TOKEN_DTYPES)} (quantized on write), got {new.dtype}")


def write(caches, descales, news, lengths, owner, row, page_table):
  """(caches, descales) after writing each of `news` (b, n, h_kv, d) at (owner, row) (b, n)
  each into its cache (K and V: the same owners and rows): owner the page (or sequence) of
  each token, num_owners = cache.shape[0] for a dropped token; lengths (b,): the valid keys
  before the write.

  A page pool's touched pages are requantized unconditionally (a page whose descale stays
  scatters nothing back), so a decoding step runs no conditional: XLA evaluates a conditional's
  predicate on the host, one round trip per layer and step. A contiguous cache's descale
  covers its whole sequence, so its rows are requantized under a conditional (one for all the
  caches), only when a descale grows."""
  num_owners, rows_per_owner = caches[0].shape[:2]
  b, n, h = news[0].shape[:3]
  news = [new.astype(jnp.float32) for new in news]
  positions = lengths[:, None] + jnp.arange(n, dtype=jnp.int32)
  # The owner holds valid keys of its sequence before the write unless its first position
  # (page start; 0 for a contiguous row) lies at or past the sequence's length.
  start = (positions // rows_per_owner) * rows_per_owner if page_table is not None else 0
  fresh = jnp.broadcast_to(start >= lengths[:, None], (b, n)).astype(jnp.float32)
  # One scatter gathers every owner's statistics: each cache's new-token amax per kv head,
  # whether a token lands there, whether it starts afresh (alike for every token of one owner).
  width = len(news) * h + 2
  stats = jnp.concatenate([jnp.max(jnp.abs(new), axis=-1) for new in news]
                          + [jnp.ones((b, n, 1), jnp.float32), fresh[..., None]], axis=-1)
  stats = jnp.zeros((num_owners, width), jnp.float32).at[owner.reshape(-1)].max(
      stats.reshape(b * n, width), mode="drop")
  touched, starts_fresh = stats[:, -2:-1] > 0, stats[:, -1:] > 0
  owners = _touched_owners(owner, lengths, n, rows_per_owner, page_table, num_owners)
  grown, ratios = [], []
  for i, descale in enumerate(descales):
    kept = jnp.where(starts_fresh, 0.0, descale)
    grown.append(jnp.where(touched, jnp.maximum(kept, stats[:, i * h:(i + 1) * h] / FP8_MAX),
                           descale))
    # Rows already in a touched owner whose descale grew: requantized to the new descale.
    ratios.append(jnp.where(touched & ~starts_fresh & (grown[i] > descale),
                            descale / jnp.where(grown[i] > 0, grown[i], 1.0), 1.0))
  rescale_all = lambda cs, rs: [_rescale(c, r, owners) for c, r in zip(cs, rs)]
  if page_table is not None:
    caches = rescale_all(caches, ratios)
  else:  # one conditional for all the caches: one predicate for the host to read
    caches = jax.lax.cond(jnp.any(jnp.stack([jnp.any(r < 1) for r in ratios])), rescale_all,
                          lambda cs, _: list(cs), list(caches), ratios)
  clipped = jnp.clip(owner, 0, num_owners - 1)
  out_caches = []
  for cache, scale_of, new in zip(caches, grown, news):
    scale = jnp.take(scale_of, clipped, axis=0)  # (b, n, h_kv)
    quantized = _to_e4m3(new / jnp.where(scale > 0, scale, 1.0)[..., None])
    out_caches.append(cache.at[owner, row].set(quantized, mode="drop"))
  return out_caches, grown


def _touched_owners(owner, lengths, n: int, rows_per_owner: int, page_table, num_owners: int):
  """(b, t) owners whose rows a write may rescale: a contiguous cache's sequences (t = 1), or
  the pages of a paged one that the write's positions fall in (t static: the most pages n
  consecutive positions span), num_owners (dropped) past the page table."""
  if page_table is None:
    return owner[:, :1]
  t = min((n + rows_per_owner - 2) // rows_per_owner + 1, page_table.shape[1])
  column = lengths[:, None] // rows_per_owner + jnp.arange(t, dtype=jnp.int32)
  pages = jnp.take_along_axis(page_table, jnp.clip(column, 0, page_table.shape[1] - 1), axis=1)
  pages = jnp.clip(pages, 0, num_owners - 1)
  last = (lengths + n - 1) // rows_per_owner  # the last column the write reaches
  return jnp.where((column < page_table.shape[1]) & (column <= last[:, None]), pages,
                   num_owners)


def _rescale(cache, ratio, owners):
  """cache with the rows of `owners` (b, t) multiplied by their ratio (num_owners, h_kv) and
  quantized again; owners = num_owners and owners whose ratio is 1 everywhere are skipped."""
  num_owners = cache.shape[0]
  clipped = jnp.clip(owners, 0, num_owners - 1)
  r = jnp.take(ratio, clipped, axis=0)  # (b, t, h_kv)
  owners = jnp.where(jnp.all(r == 1, axis=-1), num_owners, owners)
  rows = jnp.take(cache, clipped, axis=0).astype(jnp.float32)
  return cache.at[owners].set(_to_e4m3(rows * r[:, :, None, :, None]), mode="drop")


def _to_e4m3(x):
  return jnp.clip(x, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
