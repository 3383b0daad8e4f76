"""Decoder-only byte-level transformer in flax.linen on jaxflash's attention block.

Parameters carry tensor-parallel partition names ('tensor'); the residual stream is sharded
over 'data' (batch). The attention kernel is chosen by `make_attention`. Called with a
`KVCache`, the model decodes: the new tokens attend to the cached keys and values through
`make_cache_attention`, with the training path's parameters.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

import jaxflash
import jaxflash.flax

from examples.flax_transformer.configs import Config

ATTENTION_KINDS = ("jaxflash", "cudnn", "xla")
# Decoding: the training kinds' cache attention, and jaxflash over float8_e4m3fn caches.
CACHE_KINDS = ATTENTION_KINDS + ("jaxflash-fp8",)
# Rows per page of the float8_e4m3fn caches' pools: a write requantizes only the pages it
# touches, where a contiguous cache's descale would cover (and rescale) a whole sequence.
FP8_PAGE_SIZE = 64


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


class KVCache(NamedTuple):
  """Keys and values of the tokens seen so far, for decoding.

  keys, values: one (batch, max_len, num_kv_heads, head_dim) array per layer (keys after
  RoPE) in the activation dtype, or for float8_e4m3fn caches one (page pool (batch * pages,
  FP8_PAGE_SIZE, num_kv_heads, head_dim), descale (batch * pages, num_kv_heads) float32) pair
  per layer, sequence b owning pages [b * pages, (b + 1) * pages); lengths: (batch,) int32,
  the valid positions of each sequence (all layers alike).
  """

  keys: tuple
  values: tuple
  lengths: jax.Array


def training_kind(kind: str) -> str:
  """The attention kind (ATTENTION_KINDS) that trains a model decoded with cache kind `kind`."""
  if kind not in CACHE_KINDS:
    raise ValueError(f"attention: expected one of {CACHE_KINDS}, got {kind!r}")
  return "jaxflash" if kind == "jaxflash-fp8" else kind


def init_cache(config: Config, batch: int, max_len: int, kind: str = "jaxflash") -> KVCache:
  """An empty cache for cache kind `kind` (CACHE_KINDS): in the model's activation dtype, or
  for jaxflash-fp8 float8_e4m3fn page pools with zero descales (max_len rounded up to whole
  pages of FP8_PAGE_SIZE rows)."""
  shape = (batch, max_len, config.num_kv_heads, config.head_dim)
  training_kind(kind)  # checks the kind
  if kind == "jaxflash-fp8":
    pages = batch * -(-max_len // FP8_PAGE_SIZE)
    layer = lambda: (jnp.zeros((pages, FP8_PAGE_SIZE) + shape[2:], jnp.float8_e4m3fn),
                     jnp.zeros((pages, config.num_kv_heads), jnp.float32))
  else:
    layer = lambda: jnp.zeros(shape, config.dtype)
  caches = lambda: tuple(layer() for _ in range(config.num_layers))
  return KVCache(caches(), caches(), jnp.zeros((batch,), jnp.int32))


def make_cache_attention(kind: str) -> Callable:
  """fn(query, key, value, k_cache, v_cache, lengths) -> (out, k_cache, v_cache), backed by
  `kind` (CACHE_KINDS): writes the new tokens' key/value (batch, n, num_kv_heads, head_dim)
  into the caches after the `lengths` valid positions, then attends the n queries causally to
  the cache.

  jaxflash: `jaxflash.kv_cache_attention` (any lengths and n). jaxflash-fp8: the same over
  float8_e4m3fn page pools, each layer's k_cache / v_cache a (pool, descale) pair, sequence b
  owning its run of pages (`update_kv_cache` quantizes the new tokens). cudnn / xla:
  `jax.nn.dot_product_attention`; one token (n == 1) attends to the cache with
  key_value_seq_lengths; a prompt (n > 1) must go into an empty cache, and attends to its own
  keys with jax.nn's causal mask (top-left aligned, right for an empty cache only).
  """
  training_kind(kind)  # checks the kind

  def cache_attention(query, key, value, k_cache, v_cache, lengths):
    if kind == "jaxflash-fp8":
      (k_cache, k_descale), (v_cache, v_descale) = k_cache, v_cache
      batch = query.shape[0]
      table = jnp.arange(k_cache.shape[0], dtype=jnp.int32).reshape(batch, -1)
      k_cache, v_cache, new_lengths, k_descale, v_descale = jaxflash.update_kv_cache(
          k_cache, v_cache, key, value, lengths, page_table=table, k_descale=k_descale,
          v_descale=v_descale)
      out = jaxflash.kv_cache_attention(query, k_cache, v_cache, new_lengths, causal=True,
                                        page_table=table,
                                        k_descale=k_descale, v_descale=v_descale)
      return out, (k_cache, k_descale), (v_cache, v_descale)
    k_cache, v_cache, new_lengths = jaxflash.update_kv_cache(k_cache, v_cache, key, value,
                                                             lengths)
    if kind == "jaxflash":
      out = jaxflash.kv_cache_attention(query, k_cache, v_cache, new_lengths, causal=True)
    elif query.shape[1] == 1:
      out = jax.nn.dot_product_attention(query, k_cache, v_cache,
                                         key_value_seq_lengths=new_lengths,
                                         implementation=kind)
    else:
      out = jax.nn.dot_product_attention(query, key, value, is_causal=True,
                                         implementation=kind)
    return out, k_cache, v_cache

  return cache_attention


def _partitioned(names):
  return nn.with_partitioning(nn.initializers.lecun_normal(), names)


# Megatron split: q/k/v by heads, the out projection by its head input axis.
_QKV_INIT = _partitioned((None, "tensor", None))
_OUT_INIT = _partitioned(("tensor", None, None))


class CachedAttention(nn.Module):
  """The decoding form of the blocks' `jaxflash.flax.LinenAttention`, with its parameters
  (query, key, value, out): RoPE at each new token's absolute position (lengths + i), then
  `cache_attention` (see make_cache_attention) over the layer's caches.

  (x, k_cache, v_cache, lengths) -> (out, k_cache, v_cache); x (batch, n, d_model) are the
  tokens that follow the `lengths` cached ones.
  """

  config: Config
  cache_attention: Callable

  @nn.compact
  def __call__(self, x, k_cache, v_cache, lengths):
    cfg = self.config
    dtype = jnp.dtype(cfg.dtype)
    project = lambda heads, name: nn.DenseGeneral(
        (heads, cfg.head_dim), use_bias=False, dtype=dtype, kernel_init=_QKV_INIT,
        name=name)(x)
    q = project(cfg.num_heads, "query")
    k = project(cfg.num_kv_heads, "key")
    v = project(cfg.num_kv_heads, "value")
    positions = lengths[:, None] + jnp.arange(x.shape[1], dtype=jnp.int32)
    q = jaxflash.flax.apply_rope(q, positions, cfg.rope_base)
    k = jaxflash.flax.apply_rope(k, positions, cfg.rope_base)
    out, k_cache, v_cache = self.cache_attention(q, k, v, k_cache, v_cache, lengths)
    out = nn.DenseGeneral(cfg.d_model, axis=(-2, -1), use_bias=False, dtype=dtype,
                          kernel_init=_OUT_INIT, name="out")(out)
    return out, k_cache, v_cache


class Block(nn.Module):
  """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x)).

  cache: None (x is whole sequences), or this layer's (k_cache, v_cache, lengths) to decode
  with, through `cache_attention`; then it returns (x, k_cache, v_cache).
  """

  config: Config
  attention_fn: Callable
  act_sharding: Optional[jax.sharding.Sharding] = None
  cache_attention: Optional[Callable] = None

  @nn.compact
  def __call__(self, x, segment_ids=None, positions=None, cache=None):
    cfg = self.config
    dtype = jnp.dtype(cfg.dtype)
    h = nn.RMSNorm(dtype=dtype, name="attn_norm")(x)
    if cache is None:
      h = jaxflash.flax.LinenAttention(
          num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, causal=True,
          rope_base=cfg.rope_base, dtype=dtype, kernel_init=_QKV_INIT,
          out_kernel_init=_OUT_INIT, attention_fn=self.attention_fn,
          name="attention")(h, segment_ids=segment_ids, positions=positions)
    else:
      h, k_cache, v_cache = CachedAttention(cfg, self.cache_attention, name="attention")(
          h, *cache)
    x = self._constrain(x + h)
    h = nn.RMSNorm(dtype=dtype, name="mlp_norm")(x)
    dense = lambda features, names, name: nn.Dense(
        features, use_bias=False, dtype=dtype, kernel_init=_partitioned(names), name=name)
    gate = dense(cfg.mlp_dim, (None, "tensor"), "gate")(h)
    up = dense(cfg.mlp_dim, (None, "tensor"), "up")(h)
    h = dense(cfg.d_model, ("tensor", None), "down")(nn.silu(gate) * up)
    x = self._constrain(x + h)
    return x if cache is None else (x, k_cache, v_cache)

  def _constrain(self, x):
    if self.act_sharding is None:
      return x
    return jax.lax.with_sharding_constraint(x, self.act_sharding)


class Transformer(nn.Module):
  """tokens (batch, seq) int32 -> logits (batch, seq, vocab) float32.

  segment_ids / positions (batch, seq), optional: packed documents attend only within their
  own document, with RoPE positions restarting in each (default: one sequence, arange).

  cache: a KVCache to decode with (needs `cache_attention`, from make_cache_attention):
  tokens follow each sequence's cached ones, and the call returns (logits, updated cache)
  with lengths + seq; keep lengths + seq <= max_len."""

  config: Config
  attention_fn: Callable
  act_sharding: Optional[jax.sharding.Sharding] = None
  cache_attention: Optional[Callable] = None

  @nn.compact
  def __call__(self, tokens, segment_ids=None, positions=None, cache: Optional[KVCache] = None):
    cfg = self.config
    dtype = jnp.dtype(cfg.dtype)
    if cache is not None and self.cache_attention is None:
      raise ValueError("cache: decoding needs Transformer(cache_attention=...), see "
                       "make_cache_attention")
    x = nn.Embed(cfg.vocab_size, cfg.d_model, dtype=dtype,
                 embedding_init=nn.initializers.normal(1.0), name="embed")(tokens)
    keys, values = [], []
    for i in range(cfg.num_layers):
      block = Block(cfg, self.attention_fn, self.act_sharding, self.cache_attention,
                    name=f"block_{i}")
      if cache is None:
        x = block(x, segment_ids, positions)
      else:
        x, k, v = block(x, cache=(cache.keys[i], cache.values[i], cache.lengths))
        keys.append(k)
        values.append(v)
    x = nn.RMSNorm(dtype=dtype, name="final_norm")(x)
    logits = nn.Dense(cfg.vocab_size, use_bias=False, dtype=dtype, name="head")(x)
    logits = logits.astype(jnp.float32)
    if cache is None:
      return logits
    return logits, KVCache(tuple(keys), tuple(values), cache.lengths + tokens.shape[1])
