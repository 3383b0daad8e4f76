"""The FP8 forward kernel as a JAX primitive: e4m3 q, k, v and per-(batch, kv head) descales in,
bfloat16 out and float32 lse out.

Two primitives, as the 16-bit ones (primitives.py): the outer `fp8_fwd_p` lowers through
custom_partitioning (sharding.fp8_fwd_partition: batch and head sharding run shard-local, the
descales sharded like the kv heads), whose per-shard function binds the inner kernel primitive.
CUDA lowers that to the forward custom call (jaxflash_attention_fwd) of an FP8 variant
(kernels/fwd_fp8_sm90.py), with the descales stacked as one (3, batch, num_kv_heads) operand
after the tensors and, when config.has_sink, the learnable sink (num_heads,) last. Elsewhere it
runs the dequantized float32 reference when config.implementation is 'reference' and refuses
'cute': jaxflash.attention sends FP8 calls here only with implementation 'cute' (its reference
path dequantizes before the 16-bit primitives). vmap folds the mapped axis into the batch (a
mapped sink, one per folded element, rescales the rows in XLA instead: sink.add_learnable_sink).
Imports config, primitives, reference, sharding, ffi (at lowering) and _jax_internal; never Flax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import batching, mlir

from jaxflash import _jax_internal, primitives, reference, sharding
from jaxflash.config import FP8_DTYPE, FWD_TARGET, AttentionConfig, KernelVariant
from jaxflash.sink import add_learnable_sink


def fp8_forward(config: AttentionConfig, q8, k8, v8, q_descale, k_descale, v_descale,
                learnable_sink=None):
  """(out bfloat16, lse float32) of the FP8 kernel; descales (batch, num_kv_heads) float32;
  learnable_sink (num_heads,) float32 or None (config.has_sink must say which)."""
  descale = jnp.stack([q_descale, k_descale, v_descale])
  sink = () if learnable_sink is None else (learnable_sink,)
  return tuple(fp8_fwd_p.bind(q8, k8, v8, descale, *sink, config=config))


def _abstract(q8, k8, v8, descale, *sink, config):
  del sink, config
  b, seq_q, h, _ = q8.shape
  ins = (q8, k8, v8, descale)
  out = _jax_internal.shaped_like(q8, (b, seq_q, h, v8.shape[-1]), np.dtype(jnp.bfloat16), ins)
  lse = _jax_internal.shaped_like(q8, (b, h, seq_q), np.dtype(np.float32), ins)
  return out, lse


def _variant(q_aval, config: AttentionConfig) -> KernelVariant:
  return KernelVariant.for_call("fwd", "sm90a", FP8_DTYPE, q_aval.shape[-1], q_aval.shape[-1],
                                config)


def _lower_cuda(ctx, q8, k8, v8, descale, *sink, config):
  variant = _variant(ctx.avals_in[0], config)
  from jaxflash import ffi  # imported on first CUDA lowering only: keeps `import jaxflash` light
  if _jax_internal.has_cuda_device():
    ffi.ensure_variant(variant)  # cross-lowering on a CPU host needs no library
  return jax.ffi.ffi_lowering(FWD_TARGET)(ctx, q8, k8, v8, descale, *sink,
                                          **ffi.fwd_attributes(variant, config))


def _reference(q8, k8, v8, descale, *sink, config):
  """The kernel's math in float32: dequantized inputs (each descale over its batch and kv head;
  q's over the kv head's query heads), blocked attention, the sink, bf16 out."""
  group = q8.shape[2] // k8.shape[2]
  scale = lambda x, d, g: x.astype(jnp.float32) * jnp.repeat(d, g, axis=1)[:, None, :, None]
  q, k, v = scale(q8, descale[0], group), scale(k8, descale[1], 1), scale(v8, descale[2], 1)
  out, lse = reference.blocked_forward(q, k, v, config)
  if sink:
    out, lse = add_learnable_sink(out, lse, sink[0])
  return out.astype(jnp.bfloat16), lse


def _batch(args, dims, *, config):
  """Folds the mapped axis into batch: q, k, v (batch first) and the descales (batch second).
  An unmapped sink stays one logit per head; a mapped one rescales each element's rows."""
  (*args, sink), (*dims, sink_dim) = ((args, dims) if config.has_sink
                                      else ((*args, None), (*dims, None)))
  size = next(a.shape[d] for a, d in zip((*args, sink), (*dims, sink_dim)) if d is not None)
  q8, k8, v8, descale = (jnp.broadcast_to(a, (size,) + a.shape) if d is None
                         else jnp.moveaxis(a, d, 0) for a, d in zip(args, dims))
  fold = lambda x: x.reshape((size * x.shape[1],) + x.shape[2:])
  descale = jnp.moveaxis(descale, 0, 1)  # (3, size, batch, kv heads)
  descale = descale.reshape((3, size * descale.shape[2]) + descale.shape[3:])
  in_kernel = () if sink is None or sink_dim is not None else (sink,)
  out, lse = fp8_fwd_p.bind(fold(q8), fold(k8), fold(v8), descale, *in_kernel,
                            config=config.replace(has_sink=bool(in_kernel)))
  unfold = lambda x: x.reshape((size, x.shape[0] // size) + x.shape[1:])
  out, lse = unfold(out), unfold(lse)
  if sink is not None and sink_dim is not None:
    out, lse = jax.vmap(add_learnable_sink)(out, lse, jnp.moveaxis(sink, sink_dim, 0))
  return (out, lse), (0, 0)


_fp8_fwd_kernel_p = primitives.make_primitive("jaxflash_fp8_fwd_kernel", _abstract)
mlir.register_lowering(_fp8_fwd_kernel_p, primitives.reject_cute_off_gpu(
    mlir.lower_fun(_reference, multiple_results=True),
    "implementation='cute': the FP8 kernel needs an NVIDIA Hopper GPU, but this computation is "
    "lowered for a platform other than cuda; use implementation=None (auto) or 'reference'"))
mlir.register_lowering(_fp8_fwd_kernel_p, _lower_cuda, platform="cuda")
fp8_fwd_p = primitives.make_primitive("jaxflash_fp8_fwd", _abstract)
batching.primitive_batchers[fp8_fwd_p] = _batch
mlir.register_lowering(fp8_fwd_p, primitives.partitioned_lowering(
    _fp8_fwd_kernel_p, sharding.fp8_fwd_sharding_rule, sharding.fp8_fwd_partition, 2))
_jax_internal.require_devices_during_lowering(fp8_fwd_p)
