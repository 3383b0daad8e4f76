"""The score_mod / mask_mod recipes the tests share (ALiBi, T5 buckets, softcap, prefix-LM,
document, sliding window, chunked attention). Each maker takes the arrays it closes over."""

import jax.numpy as jnp
import numpy as np


def alibi_slopes(num_heads: int) -> np.ndarray:
  """ALiBi's geometric slopes 2^(-8 (h + 1) / num_heads)."""
  return (2.0 ** (-8.0 * np.arange(1, num_heads + 1) / num_heads)).astype(np.float32)


def alibi(slopes):
  def score_mod(score, b, h, q_idx, kv_idx):
    return score + slopes[h] * (kv_idx - q_idx).astype(jnp.float32)
  return score_mod


def t5_bucket(rel, num_buckets: int = 32, max_distance: int = 128):
  """T5's bidirectional relative-position bucket of rel = kv_idx - q_idx (int32 scalar)."""
  half = num_buckets // 2
  exact = half // 2
  offset = jnp.where(rel > 0, half, 0)
  a = jnp.abs(rel)
  large = exact + (jnp.log(a.astype(jnp.float32) / exact) / np.log(max_distance / exact)
                   * (half - exact)).astype(jnp.int32)
  large = jnp.minimum(large, half - 1)
  return offset + jnp.where(a < exact, a, large)


def t5(table, num_buckets: int = 32, max_distance: int = 128):
  """table: (num_buckets, heads) float."""
  def score_mod(score, b, h, q_idx, kv_idx):
    return score + table[t5_bucket(kv_idx - q_idx, num_buckets, max_distance), h].astype(
        score.dtype)
  return score_mod


def t5_distance_table(table, num_buckets: int = 32, max_distance: int = 128):
  """(heads, 2 max_distance + 1): table[bucket, h] for each kv_idx - q_idx in [-max_distance,
  max_distance] (T5's buckets are constant beyond), computed once per call in XLA, so the
  kernel's score_mod reads one entry per score instead of taking a log; jax.grad reaches
  `table` through this gather."""
  rel = jnp.arange(-max_distance, max_distance + 1, dtype=jnp.int32)
  return jnp.asarray(table)[t5_bucket(rel, num_buckets, max_distance)].T


def t5_by_distance(distance_table, max_distance: int = 128):
  """T5 buckets as a read of t5_distance_table's (heads, 2 max_distance + 1) array."""
  def score_mod(score, b, h, q_idx, kv_idx):
    rel = jnp.clip(kv_idx - q_idx, -max_distance, max_distance) + max_distance
    return score + distance_table[h, rel].astype(score.dtype)
  return score_mod


def softcap(cap: float):
  def score_mod(score, b, h, q_idx, kv_idx):
    return cap * jnp.tanh(score / cap)
  return score_mod


def identity(score, b, h, q_idx, kv_idx):
  return score


def prefix_lm(prefix_len):
  """prefix_len: (batch,) int32: the first prefix_len[b] keys are seen by every query."""
  def mask_mod(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) | (kv_idx < prefix_len[b])
  return mask_mod


def document(doc_ids):
  """doc_ids: (batch, seq) int32 (seq_q == seq_k): queries see keys of their own document."""
  def mask_mod(b, h, q_idx, kv_idx):
    return doc_ids[b, q_idx] == doc_ids[b, kv_idx]
  return mask_mod


def sliding_window(window: int):
  def mask_mod(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < window)
  return mask_mod


def causal(b, h, q_idx, kv_idx):
  return kv_idx <= q_idx


def chunked(chunk: int):
  """Llama 4's chunked attention: causal inside chunks of `chunk` positions."""
  def mask_mod(b, h, q_idx, kv_idx):
    return (q_idx // chunk == kv_idx // chunk) & (kv_idx <= q_idx)
  return mask_mod
