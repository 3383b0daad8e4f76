"""Block masks of mask_mods (jaxflash/block_mask.py) against every (query, key) pair evaluated
in NumPy, and the block ranges they give the masked kernels' tilings: a range never drops a
visible pair, a full run never holds a masked one, and contiguous masks lose no empty block."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflash import block_mask, block_ranges, config
from jaxflash.block_mask import BLOCK, create_block_mask, tile_ranges

RNG = np.random.default_rng(7)
DOCS = jnp.asarray(np.sort(RNG.integers(0, 4, size=(2, 200))), jnp.int32)  # (batch, tokens)


def causal(b, h, q, k):
  return k <= q


def documents(b, h, q, k):
  return (DOCS[b, q] == DOCS[b, k]) & (k <= q)


def prefix_lm(b, h, q, k):
  return (k <= q) | (k < 37)


def chunked(b, h, q, k):  # Llama 4's chunked attention, chunks of 48 tokens
  return (q // 48 == k // 48) & (k <= q)


def window_per_head(b, h, q, k):
  return (k <= q) & (q - k < 24 * (h + 1))


def dilated(b, h, q, k):  # visible blocks with holes between them
  return (k % 64) < 8


def _pairs(mask_mod, batch, heads, seq_q, seq_k):
  """(batch, heads, seq_q, seq_k) bool, every pair by itself."""
  fn = np.vectorize(lambda b, h, q, k: bool(mask_mod(b, h, q, k)))
  b, h, q, k = np.meshgrid(np.arange(batch), np.arange(heads), np.arange(seq_q),
                           np.arange(seq_k), indexing="ij")
  if mask_mod is documents:
    docs = np.asarray(DOCS)
    return (docs[b, q] == docs[b, k]) & (k <= q)
  return fn(b, h, q, k)


MODS = [(causal, (1, 1)), (documents, (2, 1)), (prefix_lm, (1, 1)), (chunked, (1, 1)),
        (window_per_head, (1, 3)), (dilated, (1, 1))]


@pytest.mark.parametrize("mask_mod, kept", MODS, ids=[m.__name__ for m, _ in MODS])
@pytest.mark.parametrize("seq_q, seq_k", [(200, 200), (33, 161), (160, 17)])
def test_block_mask_matches_every_pair(mask_mod, kept, seq_q, seq_k):
  """visit / full per 16 x 16 block equal any / all of the pairs inside seq_q x seq_k; an
  argument mask_mod ignores leaves a dim of 1."""
  batch, heads = 2, 3
  got = create_block_mask(mask_mod, batch, heads, seq_q, seq_k)
  assert got.visit.shape[:2] == kept and (got.seq_q, got.seq_k) == (seq_q, seq_k)
  pairs = _pairs(mask_mod, *kept, seq_q, seq_k)
  nq, nk = -(-seq_q // BLOCK), -(-seq_k // BLOCK)
  for i in range(nq):
    for j in range(nk):
      block = pairs[:, :, i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK]
      np.testing.assert_array_equal(got.visit[:, :, i, j], block.any(axis=(2, 3)))
      np.testing.assert_array_equal(got.full[:, :, i, j], block.all(axis=(2, 3)))


def test_block_mask_under_jit_in_small_steps(monkeypatch):
  """Made inside jit, a chunk of one query block per step (the memory bound), equal to the
  eager result, and a pytree a jitted function takes as an argument."""
  monkeypatch.setattr(block_mask, "_PAIRS_PER_STEP", 1)
  eager = create_block_mask(chunked, 1, 1, 150, 150)
  jitted = jax.jit(lambda: create_block_mask(chunked, 1, 1, 150, 150))()
  np.testing.assert_array_equal(eager.visit, jitted.visit)
  np.testing.assert_array_equal(eager.full, jitted.full)
  count = jax.jit(lambda m: m.visit.sum())(jitted)
  assert count == np.asarray(eager.visit).sum()


def _check_ranges(ranges, pairs, row_tile, col_tile, exact_hull):
  """ranges (batch, tiles, 4) for tiles of rows x blocks of columns of pairs (batch, heads,
  rows, cols): nothing visible outside [start, end), every pair visible in [full_lo, full_hi)
  (padding pairs excluded: the band's rules cover them), and with exact_hull, start / end
  the first / last visible block."""
  ranges = np.asarray(ranges)
  batch, _, rows, cols = pairs.shape
  for b in range(ranges.shape[0]):
    for t in range(ranges.shape[1]):
      start, end, full_lo, full_hi = ranges[b, t]
      assert start <= full_lo <= full_hi <= end or full_lo == full_hi == start
      tile = pairs[min(b, batch - 1), :, t * row_tile:(t + 1) * row_tile]
      seen = [tile[:, :, c * col_tile:(c + 1) * col_tile].any()
              for c in range(-(-cols // col_tile))]
      visible = np.flatnonzero(seen)
      assert all(start <= c < end for c in visible), (b, t, ranges[b, t], visible)
      if exact_hull:
        assert (start, end) == ((visible[0], visible[-1] + 1) if len(visible) else (0, 0))
        whole = [tile[:, :, c * col_tile:(c + 1) * col_tile].all() for c in range(len(seen))]
        longest = max((len(r) for r in "".join("1" if w else "0" for w in whole).split("0")),
                      default=0)
        assert full_hi - full_lo == longest, (b, t, ranges[b, t], whole)
      for c in range(full_lo, full_hi):
        assert tile[:, :, c * col_tile:(c + 1) * col_tile].all(), (b, t, c)


@pytest.mark.parametrize("mask_mod, kept", MODS, ids=[m.__name__ for m, _ in MODS])
@pytest.mark.parametrize("tiles", [(128, 128), (64, 80), (80, 128), (128, 176)])
def test_tile_ranges_cover_every_visible_pair(mask_mod, kept, tiles):
  """Forward tiles (rows queries) and backward tiles (rows keys), batch 2: the hull of the
  tile's visible blocks over every head, full runs only where every head sees every pair;
  exact for the masks with contiguous blocks per tile."""
  seq_q, seq_k = 200, 190
  mask = create_block_mask(mask_mod, 2, 3, seq_q, seq_k)
  pairs = np.broadcast_to(_pairs(mask_mod, *kept, seq_q, seq_k), (2,) + kept[1:] + (seq_q,
                                                                                    seq_k))
  tm, tn = tiles
  fwd = block_ranges.forward_tiling(tm, tn, seq_q, seq_k, (config.WINDOW_UNBOUNDED,) * 2)
  bwd = block_ranges.backward_tiling(tm, tn, seq_q, seq_k, (config.WINDOW_UNBOUNDED,) * 2)
  exact = mask_mod is not dilated
  _check_ranges(tile_ranges(mask, fwd, 2, transpose=False), pairs, tm, tn, exact)
  _check_ranges(tile_ranges(mask, bwd, 2, transpose=True), pairs.transpose(0, 1, 3, 2), tn,
                tm, exact)


def test_holes_are_visited_and_masked():
  """A mask with empty blocks between visible ones: the range spans them (the kernel visits
  and masks them elementwise) and no full run is claimed."""
  mask = create_block_mask(dilated, 1, 1, 128, 256)
  tiling = block_ranges.forward_tiling(128, 64, 128, 256, (config.WINDOW_UNBOUNDED,) * 2)
  np.testing.assert_array_equal(tile_ranges(mask, tiling, 1, transpose=False),
                                [[[0, 4, 0, 0]]])


@pytest.mark.parametrize("causal_call", [False, True])
def test_forward_and_backward_operands_narrow_to_the_block_mask(causal_call):
  """A causal mask_mod on a masked call without causal: the operands' ranges equal the built-in
  causal call's (the block mask gives what the band would); with causal too, the same."""
  b, seq_q, seq_k, h = 2, 1000, 1000, 4
  masked = config.AttentionConfig(softmax_scale=1.0, has_segment_ids=True)
  plain = config.AttentionConfig(softmax_scale=1.0, causal=causal_call)
  builtin = config.AttentionConfig(softmax_scale=1.0, causal=True)
  mask = create_block_mask(causal, b, h, seq_q, seq_k)
  for direction, operands, heads in (("fwd", block_ranges.forward_operands, ()),
                                     ("bwd", block_ranges.backward_operands, (h, h))):
    variant = config.KernelVariant.for_call(direction, "sm90a", "bfloat16", 128, 128, masked)
    assert variant.masked
    got = operands(variant, plain, b, seq_q, seq_k, *heads, block_mask=mask)
    want = operands(variant, builtin, b, seq_q, seq_k, *heads)
    for x, y in zip(got[2:], want[2:]):  # ranges, launch order (and ranks)
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y), direction)


def test_segment_ranges_and_a_block_mask_intersect():
  """Packed documents as segment ids and a prefix-LM mask_mod: visited blocks are those both
  visit, full runs those full in both."""
  a = np.array([[[0, 6, 1, 4], [2, 5, 2, 2], [0, 0, 0, 0]]], np.int32)
  b = np.array([[[3, 8, 3, 8], [0, 2, 0, 2], [1, 3, 1, 3]]], np.int32)
  np.testing.assert_array_equal(block_mask.intersect_ranges(a, b),
                                [[[3, 6, 3, 4], [0, 0, 0, 0], [0, 0, 0, 0]]])


def test_errors_name_the_argument():
  with pytest.raises(ValueError, match=r"create_block_mask: seq_q must be an int >= 1, got 0"):
    create_block_mask(causal, 1, 1, 0, 16)
  with pytest.raises(ValueError, match=r"create_block_mask: heads must be an int >= 1, got 2.0"):
    create_block_mask(causal, 1, 2.0, 16, 16)
  mask = create_block_mask(window_per_head, 1, 3, 64, 64)
  mask.check_call(8, 3, 64, 64)
  with pytest.raises(ValueError, match=r"block_mask: made for batch 1, heads 3, seq_q 64, "
                                       r"seq_k 64; the call has batch 8, heads 4"):
    mask.check_call(8, 4, 64, 64)
  with pytest.raises(ValueError, match=r"tiles of 72 x 128 are not whole 16 x 16 blocks"):
    tiling = block_ranges.forward_tiling(72, 128, 64, 64, (config.WINDOW_UNBOUNDED,) * 2)
    tile_ranges(mask, tiling, 1, transpose=False)
  with pytest.raises(ValueError, match=r"mask_mod: must return one boolean scalar per pair"):
    create_block_mask(lambda b, h, q, k: jnp.stack([k <= q, k > q]), 1, 1, 16, 16)
