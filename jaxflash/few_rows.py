"""Attention calls with few query rows (decoding through `jaxflash.attention` or the jax.nn
drop-in) on the split-KV decode kernel, with the prefill backward for their gradient.

The prefill forward gives each (batch, query head) its own tiles of 128 query rows and splits no
sequence across CTAs: at one query token a tile uses one row, every query head of a GQA group
reads the group's keys again, and a long sequence runs on few CTAs. The decode kernel packs the
group's query heads into the rows of one tile and splits the keys (jaxflash/split_kv.py). Its
(out, lse) are what the prefill forward returns, so the backward kernels take them as they are.

Imports jax, config, _jax_internal, primitives and split_kv (ffi at trace time on a CUDA host).
"""

from __future__ import annotations

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.interpreters import batching, mlir

from jaxflash import _jax_internal, primitives, split_kv
from jaxflash.config import (AttentionConfig, KERNEL_DTYPES, LSE_CHECKPOINT_NAME,
                             OUT_CHECKPOINT_NAME, decode_variant, kernel_support)

# Calls whose packed rows (seq_q x query heads per kv head) fit one decode tile of 64 rows take
# the decode kernel: docs/kernels.md, "Few-row calls", has the measurements behind the bound.
MAX_PACKED_ROWS = 64


def takes(config: AttentionConfig, dtype: str, query_shape, key_shape, head_dim_v: int,
          kv_lengths: bool = False) -> bool:
  """Whether a resolved jaxflash.attention call runs its forward on the decode kernel.

  config: the call's options with implementation resolved; kv_lengths: the keys are masked by
  run-time lengths (the jax.nn drop-in's key_value_seq_lengths) instead of segment ids.
  """
  if (config.implementation != "cute" or dtype not in KERNEL_DTYPES or config.has_segment_ids
      or config.has_bias):
    return False
  if kv_lengths and (config.causal or config.has_window):
    return False  # the decode kernel aligns masks to each run-time length, attention to seq_k
  _, seq_q, heads, head_dim = query_shape
  if seq_q * (heads // key_shape[2]) > MAX_PACKED_ROWS:
    return False
  if not kernel_support("decode", dtype, head_dim, head_dim_v)[0]:
    return False
  if not _jax_internal.has_cuda_device():
    return True  # lowering for CUDA on another host: the kernel is looked up where it runs
  from jaxflash import ffi  # only on a CUDA host: keeps `import jaxflash` light
  return ffi.variant_available(decode_variant(dtype, head_dim, head_dim_v))[0]


def _refuse_off_gpu(ctx, x):
  del x
  platforms = ", ".join(repr(p) for p in ctx.module_context.platforms)
  raise ValueError(f"implementation='cute' needs an NVIDIA Hopper GPU, but this computation "
                   f"(a few-row call, on the decode kernel) is lowered for platform "
                   f"{platforms}; use implementation=None (auto) or 'reference'")


# The identity on CUDA; elsewhere the refusal of implementation='cute' that the prefill
# forward's lowering gives (the decode kernel's own lowering off CUDA computes its partials in
# XLA ops, for kv_cache_attention's tests).
_on_gpu_p = jax.extend.core.Primitive("jaxflash_few_rows_on_gpu")
_on_gpu_p.def_abstract_eval(lambda x: x)
_on_gpu_p.def_impl(functools.partial(_jax_internal.apply_primitive, _on_gpu_p))
mlir.register_lowering(_on_gpu_p, lambda ctx, x: [x], platform="cuda")
mlir.register_lowering(_on_gpu_p, _refuse_off_gpu)
batching.primitive_batchers[_on_gpu_p] = lambda args, dims: (_on_gpu_p.bind(*args), dims[0])


def _lengths(key, kv_lengths):
  """The decode kernel's lengths: kv_lengths (the kernel clamps them to [0, seq_k]), or seq_k
  as a constant (no XLA kernel fills it at run time)."""
  batch, seq_k = key.shape[:2]
  if kv_lengths is None:
    return np.full((batch,), seq_k, np.int32)
  return jnp.asarray(kv_lengths, jnp.int32)


def length_segment_ids(batch: int, seq_q: int, seq_k: int, kv_lengths):
  """(q_ids (batch, seq_q), kv_ids (batch, seq_k)) int32: the mask "keys at or past
  kv_lengths[b]" as segment ids (queries 0; keys 0 below the length, 1 past it)."""
  kv_ids = jnp.arange(seq_k)[None] >= jnp.asarray(kv_lengths, jnp.int32)[:, None]
  return jnp.zeros((batch, seq_q), jnp.int32), kv_ids.astype(jnp.int32)


def _forward(config, q, k, v, kv_lengths, sink):
  return split_kv.kernel_forward(config, _on_gpu_p.bind(q), k, v, _lengths(k, kv_lengths), None,
                                 sink, None, chunked=False)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def attention_core(config: AttentionConfig, q, k, v, kv_lengths, sink=None):
  """(out, lse) of a call that `takes`, keys at or past kv_lengths (batch,) masked (None: every
  key); differentiable in q, k, v, the sink and through the lse, as primitives.attention_core."""
  return _forward(config, q, k, v, kv_lengths, sink)


def _core_fwd(config, q, k, v, kv_lengths, sink=None):
  out, lse = _forward(config, q, k, v, kv_lengths, sink)
  out = checkpoint_name(out, OUT_CHECKPOINT_NAME)
  lse = checkpoint_name(lse, LSE_CHECKPOINT_NAME)
  return (out, lse), (q, k, v, kv_lengths, sink, out, lse)


def _core_bwd(config, residuals, cotangents):
  q, k, v, kv_lengths, sink, out, lse = residuals
  q_ids = kv_ids = None
  if kv_lengths is not None:  # the backward kernels take the mask as segment ids
    q_ids, kv_ids = length_segment_ids(*q.shape[:2], k.shape[1], kv_lengths)
    config = config.replace(has_segment_ids=True)
  dq, dk, dv, _, _, d_sink, _ = primitives.attention_core_bwd(
      config, (q, k, v, q_ids, kv_ids, sink, out, lse, None), cotangents)
  return dq, dk, dv, None, d_sink


attention_core.defvjp(_core_fwd, _core_bwd)

