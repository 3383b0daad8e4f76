"""jaxflash.split_kv on a CPU host: the split count, the packing, and the merge of the splits'
partials (decode_kernel.merge_splits, the reference of the merge kernel)."""

import jax
import numpy as np
import pytest

from jaxflash import decode_kernel, split_kv


@pytest.mark.parametrize("tiles, key_blocks, max_blocks, expected", [
    (32, 256, 64, 4),  # 8 x 32k keys, 4 kv heads, d128: 128 CTAs in one wave
    (8, 1024, 64, 16),  # 1 x 128k keys, 8 kv heads: 15 splits would leave 69 blocks per CTA
    (512, 32, 64, 1),  # 64 x 4k, 8 kv heads: four waves of whole sequences already
    (32, 512, 128, 4),  # 8 x 32k keys in blocks of 64 (head_dim 256)
    # 32 x 32k, 4 kv heads: one wave of whole caches, but at most 8k keys a split
    (128, 256, 64, 4),
    (128, 256, 1024, 1),  # the same without the cap
    (1, 1, 64, 1), (0, 0, 64, 1), (3, 2, 64, 2), (1, 100000, 64, split_kv.MAX_SPLITS),
])
def test_split_count_minimises_waves_times_blocks(tiles, key_blocks, max_blocks, expected):
  assert split_kv.choose_num_splits(tiles, key_blocks, 132, max_blocks) == expected


def test_split_count_stays_within_the_blocks_and_the_limit():
  for tiles in (1, 5, 64, 300):
    for blocks in (1, 7, 100, 4096):
      for max_blocks in (1, 64, 10 ** 6):
        s = split_kv.choose_num_splits(tiles, blocks, 132, max_blocks)
        assert 1 <= s <= min(blocks, split_kv.MAX_SPLITS)
        if s < split_kv.MAX_SPLITS:
          assert -(-blocks // s) <= max_blocks


def _partials(keys, splits, q, k, v, scale):
  """Each split's (out normalised over its keys, lse) as the kernel writes them, float64."""
  outs, lses = [], []
  for part in np.array_split(np.arange(keys), splits):
    s = scale * q @ k[part].T  # (rows, keys)
    if part.size == 0:
      outs.append(np.zeros((q.shape[0], v.shape[1])))
      lses.append(np.full(q.shape[0], -np.inf))
      continue
    top = s.max(axis=1, keepdims=True)
    p = np.exp(s - top)
    outs.append(p @ v[part] / p.sum(axis=1, keepdims=True))
    lses.append(top[:, 0] + np.log(p.sum(axis=1)))
  return np.stack(outs), np.stack(lses)


@pytest.mark.parametrize("with_sink", [False, True])
def test_merge_matches_one_softmax_over_all_keys(with_sink):
  jax.config.update("jax_enable_x64", True)
  try:
    rng = np.random.default_rng(0)
    seq_q, group, hk, d, keys, splits = 2, 3, 2, 8, 5, 4  # one split holds no key
    heads, rows = hk * group, seq_q * group
    q = rng.standard_normal((1, seq_q, heads, d))
    k = rng.standard_normal((keys, hk, d))
    v = rng.standard_normal((keys, hk, d))
    # The merge takes sink logits in float32 (as the public API): these are exact there.
    sink = rng.standard_normal(heads).astype(np.float32).astype(np.float64) if with_sink else None
    packed = np.asarray(split_kv.pack_query(q, hk))[0]  # (hk, rows, d)
    out_p = np.zeros((1, splits, hk, rows, d))
    lse_p = np.zeros((1, splits, hk, rows))
    for h in range(hk):
      o, l = _partials(keys, splits, packed[h], k[:, h], v[:, h], 0.5)
      out_p[0, :, h], lse_p[0, :, h] = o, l
    sink_packed = None if sink is None else sink.reshape(hk, group)
    merged = decode_kernel.merge_splits(out_p, lse_p, sink_packed, seq_q)
    out, lse = split_kv.unpack(*merged, seq_q)
    for i in range(seq_q):
      for head in range(heads):
        s = 0.5 * k[:, head // group] @ q[0, i, head]
        logits = np.concatenate([s, [sink[head]]]) if with_sink else s
        p = np.exp(logits - logits.max())
        p /= p.sum()
        np.testing.assert_allclose(np.asarray(out)[0, i, head], p[:keys] @ v[:, head // group],
                                   rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(np.asarray(lse)[0, head, i],
                                   logits.max() + np.log(np.exp(logits - logits.max()).sum()),
                                   rtol=1e-12)
  finally:
    jax.config.update("jax_enable_x64", False)


def test_merge_of_rows_without_keys_is_zero_with_lse_minus_inf():
  out_p = np.full((1, 2, 1, 2, 4), 7.0, np.float32)  # whatever a split left there
  lse_p = np.full((1, 2, 1, 2), -np.inf, np.float32)
  out, lse = decode_kernel.merge_splits(out_p, lse_p, None, 1)
  assert np.all(np.asarray(out) == 0) and np.all(np.asarray(lse) == -np.inf)


def test_pack_and_unpack_are_inverse_and_reshapes_at_one_token():
  x = np.arange(2 * 3 * 8 * 4, dtype=np.float32).reshape(2, 3, 8, 4)  # (b, seq_q, heads, d)
  packed = np.asarray(split_kv.pack_query(x, 2))
  assert packed.shape == (2, 2, 12, 4)
  # Row i * group + j of kv head h: token i of query head h * group + j.
  np.testing.assert_array_equal(packed[1, 1, 2 * 4 + 3], x[1, 2, 1 * 4 + 3])
  lse = packed[..., 0]
  out, lse_out = split_kv.unpack(packed, lse, 3)
  np.testing.assert_array_equal(np.asarray(out), x)
  np.testing.assert_array_equal(np.asarray(lse_out), np.swapaxes(x[..., 0], 1, 2))
  one = x[:, :1]
  np.testing.assert_array_equal(np.asarray(split_kv.pack_query(one, 2)).ravel(), one.ravel())
