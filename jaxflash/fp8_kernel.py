"""The FP8 forward kernel as a JAX primitive: e4m3 q, k, v and their descales in, bfloat16 out
(float16 with config.out_float16) and float32 lse out.

The kernel takes descales per chunk of config.FP8_DESCALE_ROWS (64) tokens of a head:
`kernel_descales` maps per-(batch, kv head) descales and block descales of 64 tokens or more
onto them exactly: q_descale (batch, num_heads, query chunks) and kv_descale (batch,
num_kv_heads, key chunks, 4) = (k descale, log2 ratio, 1 / ratio, v max) with ratio = v
descale / v max, v max the largest v descale of the (batch, kv head) (kernels/softmax.py,
ChunkScaledSoftmax). The chunk counts cover the query and key tiles of the variant.

Two primitives, as the 16-bit ones (primitives.py): the outer `fp8_fwd_p` lowers through
custom_partitioning (sharding.fp8_fwd_partition: batch and head sharding run shard-local, the
descales sharded like the kv heads), whose per-shard function binds the inner kernel primitive.
CUDA lowers that to the forward custom call (jaxflash_attention_fwd) of an FP8 variant
(kernels/fwd_fp8_sm90.py), with q_descale and kv_descale after the tensors and, when
config.has_sink, the learnable sink (num_heads,) last. Elsewhere it
runs the dequantized float32 reference when config.implementation is 'reference' and refuses
'cute': jaxflash.attention sends FP8 calls here only with implementation 'cute' (its reference
path dequantizes before the 16-bit primitives). vmap folds the mapped axis into the batch
(primitives.fwd_batch_rule: a mapped sink, one per folded element, rescales the rows in XLA).
Imports config, primitives, reference, sharding, ffi (at lowering) and _jax_internal; never Flax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import batching, mlir

from jaxflash import _jax_internal, primitives, reference, sharding
from jaxflash.config import (FP8_DESCALE_ROWS, FP8_DTYPE, FWD_TARGET, AttentionConfig,
                             KernelVariant, fp8_descale_chunks, fp8_fwd_schedule)
from jaxflash.sink import add_learnable_sink

# The smallest value ratio kept (log2 -24): P times a smaller one is below e4m3's smallest
# subnormal (2^-9) anyway, and 1 / ratio stays finite.
_MIN_RATIO = 2.0 ** -24


def fp8_forward(config: AttentionConfig, q8, k8, v8, q_descale, k_descale, v_descale,
                learnable_sink=None, block_size=None):
  """(out bfloat16, or float16 with config.out_float16; lse float32) of the FP8 kernel;
  descales (batch, num_kv_heads) float32 when block_size is None, else per block
  (fp8.check_descales) with block_size >= 64; learnable_sink (num_heads,) float32 or None
  (config.has_sink must say which)."""
  q_chunks, kv_chunks = kernel_descales(q_descale, k_descale, v_descale, block_size,
                                        q8.shape, k8.shape, config.causal)
  config = config.replace(block_descales=block_size is not None)  # the -blk variants
  sink = () if learnable_sink is None else (learnable_sink,)
  return tuple(fp8_fwd_p.bind(q8, k8, v8, q_chunks, kv_chunks, *sink, config=config))


def kernel_descales(q_descale, k_descale, v_descale, block_size, q_shape, k_shape,
                    causal: bool):
  """(q_descale (batch, num_heads, query chunks), kv_descale (batch, num_kv_heads, key chunks,
  4)) of the kernel (module docstring) from per-head (block_size None) or block descales."""
  b, seq_q, h, d = q_shape
  seq_k, hk = k_shape[1], k_shape[2]
  schedule = fp8_fwd_schedule(d, causal, block_size is not None)
  q_chunks = fp8_descale_chunks(seq_q, schedule.tile_m)
  k_chunks = fp8_descale_chunks(seq_k, schedule.tile_n)

  def per_chunk(descale, chunks, group=1):
    descale = jnp.asarray(descale, jnp.float32)
    if block_size is None:  # (b, kv heads): one value per head
      return jnp.broadcast_to(jnp.repeat(descale, group, axis=1)[..., None],
                              descale.shape[:1] + (descale.shape[1] * group, chunks))
    if block_size % FP8_DESCALE_ROWS:
      raise ValueError(f"block_size: the FP8 kernel takes blocks of at least "
                       f"{FP8_DESCALE_ROWS} tokens, got {block_size}")
    x = jnp.repeat(descale, block_size // FP8_DESCALE_ROWS, axis=2)[:, :, :chunks]
    # Chunks past the sequence hold masked rows or keys: they repeat the last block's descale,
    # which keeps them positive and the largest v descale that of a real block.
    return jnp.pad(x, ((0, 0), (0, 0), (0, chunks - x.shape[2])), mode="edge")

  q = per_chunk(q_descale, q_chunks, h // hk)
  k, v = per_chunk(k_descale, k_chunks), per_chunk(v_descale, k_chunks)
  v_max = jnp.max(v, axis=2, keepdims=True)
  ratio = jnp.maximum(value_ratio(v, v_max), _MIN_RATIO)
  kv = jnp.stack([k, jnp.log2(ratio), 1.0 / ratio, jnp.broadcast_to(v_max, v.shape)], axis=-1)
  return q, kv


def value_ratio(v_descale, v_max):
  """v_descale / v_max (the head's largest v descale), 1 where v_max is 0: the factor P carries
  in an FP8 kernel so that P V sums in units of v max."""
  return jnp.where(v_max > 0, v_descale / jnp.where(v_max > 0, v_max, 1.0), 1.0)


def _dequantized(q8, k8, v8, q_chunks, kv_chunks):
  """q, k, v in float32 from the kernel's descales: each token takes its chunk's."""
  per_token = lambda d, seq: jnp.transpose(
      jnp.repeat(d, FP8_DESCALE_ROWS, axis=2)[:, :, :seq], (0, 2, 1))[..., None]
  seq_q, seq_k = q8.shape[1], k8.shape[1]
  v_descale = kv_chunks[..., 3] / kv_chunks[..., 2]  # v max * ratio
  return (q8.astype(jnp.float32) * per_token(q_chunks, seq_q),
          k8.astype(jnp.float32) * per_token(kv_chunks[..., 0], seq_k),
          v8.astype(jnp.float32) * per_token(v_descale, seq_k))


def _out_dtype(config: AttentionConfig):
  return jnp.float16 if config.out_float16 else jnp.bfloat16


def _abstract(q8, k8, v8, q_chunks, kv_chunks, *sink, config):
  del sink
  b, seq_q, h, _ = q8.shape
  ins = (q8, k8, v8, q_chunks, kv_chunks)
  out = _jax_internal.shaped_like(q8, (b, seq_q, h, v8.shape[-1]), np.dtype(_out_dtype(config)),
                                  ins)
  lse = _jax_internal.shaped_like(q8, (b, h, seq_q), np.dtype(np.float32), ins)
  return out, lse


def _variant(q_aval, config: AttentionConfig) -> KernelVariant:
  return KernelVariant.for_call("fwd", "sm90a", FP8_DTYPE, q_aval.shape[-1], q_aval.shape[-1],
                                config)


def _lower_cuda(ctx, q8, k8, v8, q_chunks, kv_chunks, *sink, config):
  variant = _variant(ctx.avals_in[0], config)
  from jaxflash import ffi  # imported on first CUDA lowering only: keeps `import jaxflash` light
  if _jax_internal.has_cuda_device():
    ffi.ensure_variant(variant)  # cross-lowering on a CPU host needs no library
  return jax.ffi.ffi_lowering(FWD_TARGET)(ctx, q8, k8, v8, q_chunks, kv_chunks, *sink,
                                          **ffi.fwd_attributes(variant, config))


def _reference(q8, k8, v8, q_chunks, kv_chunks, *sink, config):
  """The kernel's math in float32: dequantized inputs, blocked attention, the sink, 16-bit out."""
  q, k, v = _dequantized(q8, k8, v8, q_chunks, kv_chunks)
  out, lse = reference.blocked_forward(q, k, v, config)
  if sink:
    out, lse = add_learnable_sink(out, lse, sink[0])
  return out.astype(_out_dtype(config)), lse


_fp8_fwd_kernel_p = primitives.make_primitive("jaxflash_fp8_fwd_kernel", _abstract)
mlir.register_lowering(_fp8_fwd_kernel_p, primitives.reject_cute_off_gpu(
    mlir.lower_fun(_reference, multiple_results=True),
    "implementation='cute': the FP8 kernel needs an NVIDIA Hopper GPU, but this computation is "
    "lowered for a platform other than cuda; use implementation=None (auto) or 'reference'"))
mlir.register_lowering(_fp8_fwd_kernel_p, _lower_cuda, platform="cuda")
fp8_fwd_p = primitives.make_primitive("jaxflash_fp8_fwd", _abstract)
batching.primitive_batchers[fp8_fwd_p] = primitives.fwd_batch_rule(fp8_fwd_p)
mlir.register_lowering(fp8_fwd_p, primitives.partitioned_lowering(
    _fp8_fwd_kernel_p, sharding.fp8_fwd_sharding_rule, sharding.fp8_fwd_partition, 2))
_jax_internal.require_devices_during_lowering(fp8_fwd_p)
