"""Decoder-only byte-level transformer in flax.linen on jaxflash's attention block.

Parameters carry tensor-parallel partition names ('tensor'); the residual stream is sharded
over 'data' (batch). The attention kernel is chosen by `make_attention`.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

import jaxflash
import jaxflash.flax

from examples.flax_transformer.configs import Config

ATTENTION_KINDS = ("jaxflash", "cudnn", "xla")


def make_attention(kind: str, implementation: Optional[str] = None) -> Callable:
  """An attention function with jaxflash.attention's signature, backed by `kind`.

  jaxflash: `jaxflash.attention` (implementation None = auto). cudnn / xla:
  `jax.nn.dot_product_attention` with that implementation; with q_len == kv_len, as here, its
  top-left causal mask equals jaxflash's bottom-right one.
  """
  if kind == "jaxflash":
    return functools.partial(jaxflash.attention, implementation=implementation)
  if kind not in ATTENTION_KINDS:
    raise ValueError(f"attention: expected one of {ATTENTION_KINDS}, got {kind!r}")

  def jax_nn_attention(query, key, value, *, causal=False, window_size=(None, None),
                       softcap=None, q_segment_ids=None, kv_segment_ids=None):
    if tuple(window_size) != (None, None) or softcap is not None or q_segment_ids is not None:
      raise ValueError(f"attention={kind!r}: window_size, softcap and segment ids need "
                       f"attention='jaxflash'")
    del kv_segment_ids
    return jax.nn.dot_product_attention(query, key, value, is_causal=causal,
                                        implementation=kind)

  return jax_nn_attention


def _partitioned(names):
  return nn.with_partitioning(nn.initializers.lecun_normal(), names)


class Block(nn.Module):
  """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

  config: Config
  attention_fn: Callable
  act_sharding: Optional[jax.sharding.Sharding] = None

  @nn.compact
  def __call__(self, x, segment_ids=None, positions=None):
    cfg = self.config
    dtype = jnp.dtype(cfg.dtype)
    h = nn.RMSNorm(dtype=dtype, name="attn_norm")(x)
    # Megatron split: q/k/v by heads, the out projection by its head input axis.
    h = jaxflash.flax.LinenAttention(
        num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, causal=True,
        rope_base=cfg.rope_base, dtype=dtype,
        kernel_init=_partitioned((None, "tensor", None)),
        out_kernel_init=_partitioned(("tensor", None, None)),
        attention_fn=self.attention_fn, name="attention")(h, segment_ids=segment_ids,
                                                          positions=positions)
    x = self._constrain(x + h)
    h = nn.RMSNorm(dtype=dtype, name="mlp_norm")(x)
    dense = lambda features, names, name: nn.Dense(
        features, use_bias=False, dtype=dtype, kernel_init=_partitioned(names), name=name)
    gate = dense(cfg.mlp_dim, (None, "tensor"), "gate")(h)
    up = dense(cfg.mlp_dim, (None, "tensor"), "up")(h)
    h = dense(cfg.d_model, ("tensor", None), "down")(nn.silu(gate) * up)
    return self._constrain(x + h)

  def _constrain(self, x):
    if self.act_sharding is None:
      return x
    return jax.lax.with_sharding_constraint(x, self.act_sharding)


class Transformer(nn.Module):
  """tokens (batch, seq) int32 -> logits (batch, seq, vocab) float32.

  segment_ids / positions (batch, seq), optional: packed documents attend only within their
  own document, with RoPE positions restarting in each (default: one sequence, arange)."""

  config: Config
  attention_fn: Callable
  act_sharding: Optional[jax.sharding.Sharding] = None

  @nn.compact
  def __call__(self, tokens, segment_ids=None, positions=None):
    cfg = self.config
    dtype = jnp.dtype(cfg.dtype)
    x = nn.Embed(cfg.vocab_size, cfg.d_model, dtype=dtype,
                 embedding_init=nn.initializers.normal(1.0), name="embed")(tokens)
    for i in range(cfg.num_layers):
      x = Block(cfg, self.attention_fn, self.act_sharding, name=f"block_{i}")(x, segment_ids,
                                                                              positions)
    x = nn.RMSNorm(dtype=dtype, name="final_norm")(x)
    logits = nn.Dense(cfg.vocab_size, use_bias=False, dtype=dtype, name="head")(x)
    return logits.astype(jnp.float32)
