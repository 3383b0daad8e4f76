"""The FP8 forward kernel as a JAX primitive: e4m3 q, k, v and per-(batch, kv head) descales in,
bfloat16 out and float32 lse out.

CUDA lowers it to the forward custom call (jaxflash_attention_fwd) of an FP8 variant
(kernels/fwd_fp8_sm90.py), with the descales stacked as one (3, batch, num_kv_heads) operand
after the tensors and, when config.has_sink, the learnable sink (num_heads,) last. Other platforms refuse it: jaxflash.attention sends FP8 calls here only
with implementation 'cute' (and the reference path otherwise). vmap folds the mapped axis into
the batch (a mapped sink, one per folded element, rescales the rows in XLA instead:
sink.add_learnable_sink). There is no sharding rule: under jit with sharded inputs XLA gathers them.
Imports config, ffi (at lowering) and _jax_internal; never Flax.
"""

from __future__ import annotations

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from jax.interpreters import batching, mlir

from jaxflash import _jax_internal
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


def _refuse(platform):
  def rule(ctx, *args, config):
    raise ValueError(f"implementation='cute': the FP8 kernel needs an NVIDIA Hopper GPU, but "
                     f"this computation is lowered for a platform {platform}; use "
                     f"implementation=None (auto) or 'reference'")
  return rule


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


fp8_fwd_p = jax.extend.core.Primitive("jaxflash_fp8_fwd")
fp8_fwd_p.multiple_results = True
fp8_fwd_p.def_abstract_eval(_abstract)
fp8_fwd_p.def_impl(functools.partial(_jax_internal.apply_primitive, fp8_fwd_p))
batching.primitive_batchers[fp8_fwd_p] = _batch
mlir.register_lowering(fp8_fwd_p, _refuse("other than cuda"))
mlir.register_lowering(fp8_fwd_p, _lower_cuda, platform="cuda")
