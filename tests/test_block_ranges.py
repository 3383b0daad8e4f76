"""The masked kernels' block ranges (jaxflash/block_ranges.py) against a brute-force mask.

Every visible (query, key) pair must lie in a visited block, every pair of a block marked free
of the elementwise mask must be visible, and packed documents must get
tight ranges. The trace-time path of calls without segment ids (band_ranges, and the orders and
ranks on NumPy arrays) must give the device path's every value. CPU only.
"""

import itertools
import re

import jax
import numpy as np
import pytest

from jaxflash import block_ranges, config
from jaxflash.config import AttentionConfig


def _visible(q_ids, kv_ids, left, right):
  """(b, seq_q, seq_k) bool: the attention mask of jaxflash.attention."""
  seq_q, seq_k = q_ids.shape[1], kv_ids.shape[1]
  i = np.arange(seq_q)[:, None] + seq_k - seq_q
  j = np.arange(seq_k)[None, :]
  band = (j >= i - left) & (j <= i + right)
  return band[None] & (q_ids[:, :, None] == kv_ids[:, None, :])


def _check(ranges, visible, row_tile, col_tile, row_padding_masked, tight):
  """ranges of the row side (visible: (b, rows, cols)) against the brute-force mask; `tight`:
  the range is the smallest interval of the visible blocks (ids in contiguous runs)."""
  b, rows, cols = visible.shape
  tiles = -(-rows // row_tile)
  blocks = -(-cols // col_tile)
  assert ranges.shape == (b, tiles, 4)
  for bi, t in itertools.product(range(b), range(tiles)):
    start, end, full_lo, full_hi = (int(x) for x in ranges[bi, t])
    assert 0 <= start <= full_lo <= full_hi <= end <= blocks, (start, end, full_lo, full_hi)
    tile = visible[bi, t * row_tile:(t + 1) * row_tile]
    seen_blocks = {c // col_tile for c in np.nonzero(tile.any(axis=0))[0]}
    # Every visible pair is in a visited block; with contiguous ids the range is the tightest
    # interval (other ids: the hull of their keys).
    if seen_blocks:
      assert start <= min(seen_blocks) and max(seen_blocks) < end
      if tight:
        assert (start, end) == (min(seen_blocks), max(seen_blocks) + 1)
    elif tight:
      assert start == end
    padded_rows = (t + 1) * row_tile > rows
    for blk in range(full_lo, full_hi):
      assert not (row_padding_masked and padded_rows)
      block = tile[:, blk * col_tile:(blk + 1) * col_tile]
      assert (blk + 1) * col_tile <= cols
      assert block.all(), (bi, t, blk)


def _cases():
  rng = np.random.default_rng(0)
  yield "packed", np.repeat(np.arange(6), [70, 1, 3, 1, 118, 63])[None].repeat(2, 0), None
  docs = np.sort(rng.integers(0, 5, (2, 256)), axis=1)
  yield "sorted", docs, docs
  yield "arbitrary", rng.integers(0, 3, (2, 256)), rng.integers(0, 3, (2, 256))
  yield "padding", np.where(np.arange(256) < 200, 1, 0)[None].repeat(2, 0), None
  # Padding queries (0) see no key, padding keys (2) no query: empty rows.
  valid = np.arange(256)[None] < np.array([[200], [97]])
  yield "unseen_padding", np.where(valid, 1, 0), np.where(valid, 1, 2)
  yield "none", np.zeros((2, 256), np.int64), None


@pytest.mark.parametrize("name,q_ids,kv_ids", list(_cases()), ids=[c[0] for c in _cases()])
@pytest.mark.parametrize("window,causal", [((None, None), False), ((None, None), True),
                                           ((40, 7), False), ((100, None), True),
                                           ((0, 0), False), ((-5, 30), False)],
                         ids=["full", "causal", "band", "causal_left", "diagonal", "shifted"])
@pytest.mark.parametrize("seq_q_cut", [0, 57], ids=["square", "seq_q<seq_k"])
def test_ranges_cover_the_mask_and_full_blocks_need_no_mask(name, q_ids, kv_ids, window,
                                                           causal, seq_q_cut):
  kv_ids = q_ids if kv_ids is None else kv_ids
  q_ids = q_ids[:, seq_q_cut:]
  cfg = AttentionConfig(softmax_scale=1.0, causal=causal, window_left=window[0],
                        window_right=window[1])
  left, right = block_ranges.window_bounds(cfg)
  seq_q, seq_k = q_ids.shape[1], kv_ids.shape[1]
  visible = _visible(q_ids, kv_ids, left, right)
  q, kv = jax.numpy.asarray(q_ids, np.int32), jax.numpy.asarray(kv_ids, np.int32)
  for tile_m, tile_n in ((128, 128), (80, 128), (64, 64), (192, 128), (128, 176)):
    fwd_tiling = block_ranges.forward_tiling(tile_m, tile_n, seq_q, seq_k, (left, right))
    fwd = block_ranges.block_ranges(q, kv, fwd_tiling)
    tight = name != "arbitrary"
    _check(np.asarray(fwd), visible, tile_m, tile_n, False, tight)
    bwd_tiling = block_ranges.backward_tiling(tile_m, tile_n, seq_q, seq_k, (left, right))
    bwd = block_ranges.block_ranges(kv, q, bwd_tiling)
    _check(np.asarray(bwd), visible.transpose(0, 2, 1), tile_n, tile_m, True, tight)
    if name == "none":  # one segment: the closed form of calls without segment ids
      np.testing.assert_array_equal(block_ranges.band_ranges(seq_q, seq_k, fwd_tiling),
                                    np.asarray(fwd)[:1])
      np.testing.assert_array_equal(block_ranges.band_ranges(seq_k, seq_q, bwd_tiling),
                                    np.asarray(bwd)[:1])


def test_packed_documents_get_tight_full_blocks():
  """Four documents of 256 keys, causal, tiles of 128: an interior tile visits only its own
  document's blocks up to the diagonal, and all but the diagonal block run unmasked."""
  ids = np.repeat(np.arange(4), 256)[None]
  cfg = AttentionConfig(softmax_scale=1.0, causal=True, has_segment_ids=True)
  tiling = block_ranges.forward_tiling(128, 128, 1024, 1024, block_ranges.window_bounds(cfg))
  ranges = np.asarray(block_ranges.block_ranges(jax.numpy.asarray(ids, np.int32),
                                                jax.numpy.asarray(ids, np.int32), tiling))
  # Tile t of document t // 2: blocks [2 (t // 2), t + 1), the diagonal block t masked.
  for t in range(8):
    first = 2 * (t // 2)
    assert tuple(ranges[0, t]) == (first, t + 1, first, t), (t, ranges[0, t])


def test_window_bounds_fold_causal_and_clip():
  u = config.WINDOW_UNBOUNDED
  assert block_ranges.window_bounds(AttentionConfig(1.0)) == (u, u)
  assert block_ranges.window_bounds(AttentionConfig(1.0, causal=True)) == (u, 0)
  assert block_ranges.window_bounds(AttentionConfig(1.0, causal=True, window_left=4,
                                                    window_right=9)) == (4, 0)
  assert block_ranges.window_bounds(AttentionConfig(1.0, causal=True, window_right=-3)) == (u, -3)
  assert block_ranges.window_bounds(AttentionConfig(1.0, window_left=2 ** 40)) == (u, u)


def test_orders_and_ranks():
  ranges = np.array([[[0, 3, 0, 0], [1, 4, 1, 1], [2, 2, 2, 2], [0, 4, 0, 0]]], np.int32)
  order = np.asarray(block_ranges.longest_first(jax.numpy.asarray(ranges), 8))
  assert list(order) == [3, 0, 1, 2]  # one section: 4, 3, 3, 0 blocks; ties in index order
  # Sections of 2 blocks by start: {0, 3} start in [0, 2), {1} too, {2} in [2, 4): the last
  # section first, then longest first; batches in order.
  two = np.concatenate([ranges, ranges])
  order = np.asarray(block_ranges.longest_first(jax.numpy.asarray(two), 2))
  assert list(order) == [2, 3, 0, 1, 6, 7, 4, 5]
  visits = [[m in range(r[0], r[1]) for m in range(4)] for r in ranges[0]]
  two_orders = np.array([3, 0, 1, 2, 5, 4, 7, 6], np.int32)  # batch 1: 1, 0, 3, 2
  ranks = np.asarray(block_ranges.launch_ranks(jax.numpy.asarray(two), two_orders, 4))
  # Tile t's rank at block m: tiles of its batch launched before t that visit m.
  for b, launch in enumerate(([3, 0, 1, 2], [1, 0, 3, 2])):
    for t, m in itertools.product(range(4), range(4)):
      earlier = launch[:launch.index(t)]
      assert ranks[b, t, m] == sum(visits[u][m] for u in earlier), (b, t, m)


def test_ranges_in_launch_order_follow_the_order_within_each_batch():
  """The kernels read a tile's block range at its own entry of the launch order: entry
  b * tiles + k holds the range of tile order[b * tiles + k], which lies in batch b (the order
  keeps each batch's tiles together); NumPy and jax agree."""
  rng = np.random.default_rng(2)
  start = rng.integers(0, 12, (3, 40))
  ranges = np.stack([start, start + rng.integers(0, 4, (3, 40)), start,
                     start + rng.integers(0, 2, (3, 40))], axis=-1).astype(np.int32)
  for section in (1, 3, 64):
    order = block_ranges.longest_first(ranges, section)
    launched = block_ranges.in_launch_order(ranges, order)
    on_device = block_ranges.in_launch_order(jax.numpy.asarray(ranges), jax.numpy.asarray(order))
    assert isinstance(launched, np.ndarray) and launched.shape == ranges.shape
    np.testing.assert_array_equal(launched, np.asarray(on_device))
    for entry, tile in enumerate(order):
      b, k = divmod(entry, 40)
      assert tile // 40 == b, (section, entry, tile)
      np.testing.assert_array_equal(launched[b, k], ranges[b, tile % 40])


def test_operand_ranges_stand_in_launch_order():
  """forward_operands / backward_operands pass each tile's block range at the tile's entry of the
  launch order they pass (packed documents: an order that is no identity)."""
  cfg = AttentionConfig(softmax_scale=1.0, causal=True, has_segment_ids=True)
  ids = jax.numpy.asarray(np.repeat(np.arange(4), [100, 700, 250, 950])[None].repeat(2, 0),
                          jax.numpy.int32)
  for direction, operands, tiling in (
      ("fwd", block_ranges.forward_operands, block_ranges.forward_tiling),
      ("bwd", block_ranges.backward_operands, block_ranges.backward_tiling)):
    variant = config.KernelVariant.for_call(direction, "sm90a", "bfloat16", 128, 128, cfg)
    s = variant.schedule
    heads = () if direction == "fwd" else (2, 1)
    ranges, order = (np.asarray(x) for x in operands(variant, cfg, 2, 2000, 2000, *heads,
                                                     (ids, ids))[2:4])
    tiles = ranges.shape[1]
    by_tile = np.asarray(block_ranges.block_ranges(ids, ids, tiling(
        s.tile_m, s.tile_n, 2000, 2000, block_ranges.window_bounds(cfg))))
    assert (order != np.arange(order.size)).any(), direction
    for entry, tile in enumerate(order):
      b, k = divmod(entry, tiles)
      np.testing.assert_array_equal(ranges[b, k], by_tile[b, tile - b * tiles], direction)


def test_forward_runs_one_document_at_a_time_longest_tiles_first():
  """The masked forward launches each batch's query tiles from the last down: on packed causal
  documents the tiles in flight belong to one document (whose K and V they share in L2) and
  each document's tiles go longest first. The order is a constant even where the ranges are
  computed on the device (no sort there), and the ranges stand in that order."""
  lengths = [3000, 200, 4000, 900, 6000, 2100]
  ids = jax.numpy.asarray(np.repeat(np.arange(len(lengths)), lengths)[None].repeat(2, 0),
                          jax.numpy.int32)
  n = ids.shape[1]
  cfg = AttentionConfig(softmax_scale=1.0, causal=True, has_segment_ids=True)
  variant = config.KernelVariant.for_call("fwd", "sm90a", "bfloat16", 128, 128, cfg)
  _, _, launched, order = block_ranges.forward_operands(variant, cfg, 2, n, n, (ids, ids))
  assert isinstance(order, np.ndarray)
  tiles = -(-n // variant.schedule.tile_m)
  np.testing.assert_array_equal(order, block_ranges.last_first(2, tiles))
  launched = np.asarray(launched)
  for b in range(2):
    start, work = launched[b, :, 0], launched[b, :, 1] - launched[b, :, 0]
    assert (np.diff(start) <= 0).all()  # documents from the last down, one at a time
    same_document = np.diff(start) == 0
    assert (np.diff(work)[same_document] <= 0).all()  # longest first within a document
    assert len(set(start)) == len(lengths)


def test_backward_sections_hold_the_heads_whose_key_tiles_run_together():
  """The backward's launch order is longest first within L2-sized sections of the query
  blocks the key tiles in flight share: those of one kv head's query heads (the kernel runs one
  kv head at a time), of every head for deterministic variants (the kv heads of an entry run
  together). So 64 heads over 64 kv heads order like one head, and the deterministic order
  splits into sections that the one-head order spans."""
  lengths = [3000, 200, 4000, 900, 6000, 2100]
  ids = jax.numpy.asarray(np.repeat(np.arange(len(lengths)), lengths)[None], jax.numpy.int32)
  n = ids.shape[1]

  def order(deterministic, heads, kv_heads):
    cfg = AttentionConfig(softmax_scale=1.0, causal=True, has_segment_ids=True,
                          deterministic=deterministic)
    variant = config.KernelVariant.for_call("bwd", "sm90a", "bfloat16", 128, 128, cfg)
    return np.asarray(block_ranges.backward_operands(variant, cfg, 1, n, n, heads, kv_heads,
                                                     (ids, ids))[3])

  np.testing.assert_array_equal(order(False, 64, 64), order(False, 1, 1))
  np.testing.assert_array_equal(order(False, 64, 8), order(False, 8, 1))
  assert (order(True, 64, 64) != order(False, 64, 64)).any()
  np.testing.assert_array_equal(order(True, 1, 1), order(False, 1, 1))


def test_orders_and_ranks_on_the_host_match_the_device_path():
  """longest_first and launch_ranks on NumPy ranges (trace-time constants) give the jax path's
  values, ties included: ranges with many equal lengths in several sections and batches."""
  rng = np.random.default_rng(1)
  start = rng.integers(0, 12, (3, 40))
  ranges = np.stack([start, start + rng.integers(0, 4, (3, 40)), start, start],
                    axis=-1).astype(np.int32)
  for section in (1, 3, 64):
    on_host = block_ranges.longest_first(ranges, section)
    on_device = block_ranges.longest_first(jax.numpy.asarray(ranges), section)
    assert isinstance(on_host, np.ndarray) and on_host.dtype == np.int32
    np.testing.assert_array_equal(on_host, np.asarray(on_device))
    ranks = block_ranges.launch_ranks(ranges, on_host, 16)
    assert isinstance(ranks, np.ndarray) and ranks.dtype == np.int32
    np.testing.assert_array_equal(
        ranks, np.asarray(block_ranges.launch_ranks(jax.numpy.asarray(ranges), on_device, 16)))


def test_operands_match_the_kernel_abi_shapes():
  cfg = AttentionConfig(softmax_scale=1.0, causal=True, has_segment_ids=True,
                        deterministic=True)
  fwd = config.KernelVariant.for_call("fwd", "sm90a", "bfloat16", 128, 128, cfg)
  bwd = config.KernelVariant.for_call("bwd", "sm90a", "bfloat16", 128, 128, cfg)
  assert fwd.masked and bwd.masked and bwd.deterministic and not fwd.causal
  ids = (np.zeros((2, 300), np.int32), np.zeros((2, 250), np.int32))
  q_ids, k_ids, ranges, order = block_ranges.forward_operands(fwd, cfg, 2, 300, 250, ids)
  # forward tiles 128 x 128: 3 query tiles, 2 key blocks
  assert (q_ids.shape, k_ids.shape, ranges.shape, order.shape) == (
      (2, 384), (2, 256), (2, 3, 4), (6,))
  k_ids, q_ids, ranges, order, ranks = block_ranges.backward_operands(bwd, cfg, 2, 300, 250, 4,
                                                                      2, ids)
  # backward: key tiles of 128, query blocks of 80
  assert (k_ids.shape, q_ids.shape, ranges.shape, order.shape, ranks.shape) == (
      (2, 256), (2, 320), (2, 2, 4), (4,), (2, 2, 4))
  assert all(x.dtype == np.int32 for x in (k_ids, q_ids, ranges, order, ranks))


@pytest.mark.parametrize("table_limit", [None, 0], ids=["constant", "device_table"])
def test_operands_of_a_call_without_segment_ids_match_the_device_path(monkeypatch, table_limit):
  """Forward and deterministic backward operands from trace-time ranges (one batch's, repeated;
  the ranks table broadcast, or past the size limit computed on the device) equal those of the
  run-time path on all-zero ids, value for value."""
  if table_limit is not None:
    monkeypatch.setattr(block_ranges, "RANKS_CONSTANT_BYTES", table_limit)
  cfg = AttentionConfig(softmax_scale=1.0, causal=True, window_left=100, deterministic=True)
  zeros = tuple(jax.numpy.zeros((3, n), jax.numpy.int32) for n in (700, 900))
  for direction, operands in (("fwd", block_ranges.forward_operands),
                              ("bwd", block_ranges.backward_operands)):
    variant = config.KernelVariant.for_call(direction, "sm90a", "bfloat16", 64, 64, cfg)
    assert variant.masked and variant.deterministic == (direction == "bwd")
    heads = () if direction == "fwd" else (4, 2)
    static = operands(variant, cfg, 3, 700, 900, *heads)
    traced = operands(variant, cfg, 3, 700, 900, *heads, zeros)
    assert isinstance(static[2], np.ndarray) and isinstance(static[3], np.ndarray)
    assert len(static) == len(traced) == (5 if direction == "bwd" else 4)
    for got, want in zip(static, traced):
      assert got.shape == want.shape and got.dtype == want.dtype == np.int32, direction
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _stablehlo_ops(fn, *args):
  text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  return set(re.findall(r"stablehlo\.(\w+)", text))


def test_a_call_without_segment_ids_runs_no_preparation_ops():
  """Windowed forward and deterministic backward, cross-lowered for CUDA: the block ranges,
  tile orders and ranks are constants, so the program holds the two custom calls, constants,
  broadcasts (zero ids, the ranks table) and the loss, and none of the reductions and sorts
  that segment ids need on the device."""
  import jaxflash
  q = jax.numpy.zeros((2, 300, 4, 64), jax.numpy.bfloat16)
  kv = jax.numpy.zeros((2, 300, 2, 64), jax.numpy.bfloat16)
  ids = jax.numpy.zeros((2, 300), jax.numpy.int32)

  def grads(q, k, v, *segment_ids):
    options = (dict(q_segment_ids=segment_ids[0], kv_segment_ids=segment_ids[1])
               if segment_ids else dict(window_size=(64, 0)))
    loss = lambda q, k, v: jax.numpy.sum(jaxflash.attention(
        q, k, v, causal=True, deterministic=True, implementation="cute", **options))
    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

  preparation = {"reduce", "sort", "scatter", "gather", "reduce_window"}
  assert _stablehlo_ops(grads, q, kv, kv, ids, ids) >= preparation  # the run-time path
  assert not _stablehlo_ops(grads, q, kv, kv) & preparation


def test_band_ranges_are_block_ranges_without_segment_ids():
  """The closed form of a call without segment ids against block_ranges on all-zero ids, over
  random lengths, tiles and bands (from forward and backward tilings: padding rows masked or
  not), unbounded sides and empty bands included; the parametrized test above adds the windows
  and tiles of the masked variants ("none" ids)."""
  rng = np.random.default_rng(3)
  u = config.WINDOW_UNBOUNDED
  for _ in range(40):
    rows, cols = (int(x) for x in rng.integers(1, 700, 2))
    row_tile = int(rng.choice([64, 80, 128, 176, 192]))
    col_tile = int(rng.choice([64, 80, 112, 128, 176]))
    bounds = tuple(int(rng.choice([u, 0, -7, 5, 130, 1000])) for _ in range(2))
    if rng.integers(2):  # query tiles: rows are queries
      tiling = block_ranges.forward_tiling(row_tile, col_tile, rows, cols, bounds)
    else:  # key tiles: rows are keys, columns queries
      tiling = block_ranges.backward_tiling(col_tile, row_tile, cols, rows, bounds)
    want = jax.jit(block_ranges.block_ranges, static_argnums=2)(
        jax.numpy.zeros((1, rows), np.int32), jax.numpy.zeros((1, cols), np.int32), tiling)
    got = block_ranges.band_ranges(rows, cols, tiling)
    assert isinstance(got, np.ndarray) and got.dtype == np.int32
    np.testing.assert_array_equal(got, np.asarray(want), err_msg=f"{rows} {cols} {tiling}")
