"""Shared test inputs: fresh random q/k/v/segment ids, FP8 tensors with value blocks, x64 scope,
and readable option sets."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np

import jaxflash
from jaxflash import fp8, reference
from jaxflash.config import AttentionConfig


@contextlib.contextmanager
def x64():
  """float64 enabled inside the block only (the oracle runs)."""
  with jax.enable_x64(True):
    yield


def make_qkv(seed, batch=2, seq_q=37, seq_k=45, heads=4, kv_heads=2, head_dim=16,
             head_dim_v=None, dtype=jnp.float32):
  """Fresh normal inputs (never zeros), generated in float64 then cast to `dtype`."""
  rng = np.random.default_rng(seed)
  shapes = ((batch, seq_q, heads, head_dim), (batch, seq_k, kv_heads, head_dim),
            (batch, seq_k, kv_heads, head_dim_v or head_dim))
  return tuple(jnp.asarray(rng.standard_normal(s), dtype) for s in shapes)


def quantize_value_blocks_too(q, k, v, block_size=None):
  """jaxflash.quantize_fp8's tensors with the value quantized per block of its own as well
  (descales that differ between blocks: the FP8 kernel's P carries their ratios); per head
  when block_size is None, as quantize_fp8's."""
  q8, k8, _, qd, kd, _ = jaxflash.quantize_fp8(q, k, v, block_size=block_size)
  v8, vd = fp8.quantize_tensor(v, block_size)
  return q8, k8, v8, qd, kd, vd


def make_segments(seed, batch, seq_q, seq_k, num_segments=3):
  """Sorted segment ids (packed documents), so every query has some same-segment keys."""
  rng = np.random.default_rng(seed)

  def ids(seq):
    return np.sort(rng.integers(0, num_segments, (batch, seq)), axis=1).astype(np.int32)

  return jnp.asarray(ids(seq_q)), jnp.asarray(ids(seq_k))


# name -> keyword arguments of jaxflash.attention
OPTION_SETS = {
    "plain": {},
    "causal": {"causal": True},
    "window": {"window_size": (7, 3)},
    "causal_window": {"causal": True, "window_size": (9, None)},
    "softcap": {"softcap": 1.5},
    "scale": {"softmax_scale": 0.37},
    "everything": {"causal": True, "window_size": (11, 0), "softcap": 2.0, "softmax_scale": 0.2},
}


def config_for(head_dim, options, has_segments=False) -> AttentionConfig:
  """The AttentionConfig jaxflash.attention derives from keyword `options`."""
  left, right = options.get("window_size", (None, None))
  return AttentionConfig(
      softmax_scale=options.get("softmax_scale", head_dim ** -0.5),
      causal=options.get("causal", False), window_left=left, window_right=right,
      softcap=options.get("softcap"), has_segment_ids=has_segments)


def oracle_for(q, k, v, options, segments=(None, None), learnable_sink=None):
  """(out, lse) of reference.naive_attention for keyword `options`: the test oracle (float64
  inputs give the float64 oracle)."""
  cfg = config_for(q.shape[-1], options, segments[0] is not None)
  return reference.naive_attention(q, k, v, cfg, *segments, learnable_sink=learnable_sink)
