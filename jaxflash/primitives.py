"""JAX primitives for attention: abstract eval, lowerings, batching, and the custom_vjp core.

Two primitives per direction (docs/design.md): the inner one lowers to the FFI custom call on CUDA
(reference elsewhere); the outer one carries the batching rule and the sharding wiring.
Imports ffi, reference, block_ranges, sharding and config; never Flax.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.interpreters import batching, mlir

from jaxflash import _jax_internal, block_mask, block_ranges, mod_ir, reference
from jaxflash.sink import add_learnable_sink, learnable_sink_grad
from jaxflash.config import (AttentionConfig, BWD_TARGET, FWD_TARGET, KernelVariant,
                             LSE_CHECKPOINT_NAME, OUT_CHECKPOINT_NAME, bias_row_length,
                             bwd_scratch_shapes, fwd_scratch_shapes, kernel_support, mods_arrays,
                             mods_inputs)

log = logging.getLogger("jaxflash")


def _split_segments(args, config: AttentionConfig):
  """Positional operands -> (tensors, (q_segment_ids, kv_segment_ids) or (None, None))."""
  if config.has_segment_ids:
    return args[:-2], tuple(args[-2:])
  return args, (None, None)


def _split_sink(args, config: AttentionConfig):
  """The forward's operands (q, k, v[, q_seg, kv_seg][, bias][, sink]) -> (the rest, sink or
  None)."""
  if config.has_sink:
    return args[:-1], args[-1]
  return args, None


def mod_array_count(config: AttentionConfig) -> int:
  """How many closed-over arrays of score_mod / mask_mod a call's operands carry."""
  return len(mods_arrays(config.mods))


def _split_mods(args, config: AttentionConfig):
  """The forward's operands after _split_sink, ending in the score_mod / mask_mod arrays when
  config.has_mods -> (the rest, arrays)."""
  n = mod_array_count(config)
  if n:
    return args[:-n], tuple(args[-n:])
  return args, ()


def _reference_mods(config: AttentionConfig, bias, arrays):
  """reference.ScoreMods of a call's bias and score_mod / mask_mod IR (over `arrays`), or
  None."""
  score_mod = mask_mod = None
  if config.has_mods:
    score_mod, mask_mod = mod_ir.functions(mod_ir.parse_spec(config.mods), arrays)
  if bias is None and score_mod is None and mask_mod is None:
    return None
  return reference.ScoreMods(bias, score_mod, mask_mod)


def mods_block_mask(config: AttentionConfig, arrays, batch: int, heads: int, seq_q: int,
                    seq_k: int):
  """The block mask of the call's mask_mod over its arrays (block_mask.py), or None without
  one. The kernels' block ranges narrow to it: its empty blocks are never visited, and its full
  ones run without mask_mod (the mods variants apply mask_mod outside the full range only)."""
  if not config.has_mods or min(batch, heads, seq_q, seq_k) < 1:
    return None
  _, mask_mod = mod_ir.functions(mod_ir.parse_spec(config.mods), arrays)
  if mask_mod is None:
    return None
  return block_mask.create_block_mask(mask_mod, batch, heads, seq_q, seq_k)


def _split_bias(args, config: AttentionConfig):
  """Operands ending in the bias when config.has_bias (the forward's after _split_sink, the
  backward's) -> (the rest, bias or None)."""
  if config.has_bias:
    return args[:-1], args[-1]
  return args, None


# ---------------------------------------------------------------------------------------------
# Abstract evaluation (shared by inner and outer primitives, except the backward kernel scratch)

def _fwd_abstract(q, k, v, *segment_ids, config):
  del segment_ids, config
  b, seq_q, h, _ = q.shape
  out = _jax_internal.shaped_like(q, (b, seq_q, h, v.shape[-1]), q.dtype, (q, k, v))
  # float32, or float64 for float64 inputs (reference-only oracle runs).
  lse_dtype = np.promote_types(q.dtype, np.float32)
  lse = _jax_internal.shaped_like(q, (b, h, seq_q), lse_dtype, (q, k, v))
  return out, lse


def _bwd_abstract(q, k, v, out, lse, d_out, d_lse, *rest, config):
  """(dq, dk, dv[, dbias]): dbias has the bias's shape and dtype (reduced over its broadcast
  dims). The score_mod / mask_mod arrays (config.mods) get no gradient here (mods_core)."""
  rest, _ = _split_mods(rest, config)
  _, bias = _split_bias(rest, config)
  ins = (q, k, v, out, lse, d_out, d_lse)
  grads = (q, k, v) if bias is None else (q, k, v, bias)
  return tuple(_jax_internal.shaped_like(x, x.shape, x.dtype, ins) for x in grads)


def _kernel_variant(direction: str, q, v, config: AttentionConfig, seq_k=None):
  """The KernelVariant a CUDA lowering of this call runs in `direction`, or None (reference).
  seq_k: the call's keys per sequence (picks among forward variants)."""
  if config.implementation != "cute":
    return None
  dtype, head_dim, head_dim_v = np.dtype(q.dtype).name, q.shape[-1], v.shape[-1]
  if not kernel_support(direction, dtype, head_dim, head_dim_v, config)[0]:
    return None
  return KernelVariant.for_call(direction, "sm90a", dtype, head_dim, head_dim_v, config, seq_k)


def _fwd_scratch(q, k, v, config: AttentionConfig) -> tuple:
  """((shape, dtype), ...) of the forward kernel's scratch results (a dynamic schedule's tile
  counter); () on the reference path. From config and avals only, as _bwd_scratch."""
  variant = _kernel_variant("fwd", q, v, config, k.shape[1])
  if variant is None:
    return ()
  return tuple((shape, np.dtype(dt)) for _, shape, dt in fwd_scratch_shapes(variant))


def _fwd_kernel_abstract(q, k, v, *rest, config):
  """(out, lse, *scratch): XLA allocates the kernel's scratch as extra custom-call results."""
  out, lse = _fwd_abstract(q, k, v, *rest, config=config)
  scratch = tuple(_jax_internal.shaped_like(q, shape, dtype, (q, k, v))
                  for shape, dtype in _fwd_scratch(q, k, v, config))
  return (out, lse) + scratch


def _bwd_scratch(q, k, v, config: AttentionConfig) -> tuple:
  """((shape, dtype), ...) of the kernel's scratch results; () on the reference path.

  Decided from config and avals only, so that it is the same on every platform: the abstract
  eval cannot know which platform lowers the call.
  """
  variant = _kernel_variant("bwd", q, v, config)
  if variant is None:
    return ()
  b, seq_q, h, _ = q.shape
  return tuple((shape, np.dtype(dtype))
               for _, shape, dtype in bwd_scratch_shapes(variant, b, seq_q, h, k.shape[1]))


def _bwd_kernel_abstract(q, k, v, out, lse, d_out, d_lse, *rest, config):
  """(dq, dk, dv[, dbias], *scratch): XLA allocates the kernel's scratch as extra custom-call
  results."""
  grads = _bwd_abstract(q, k, v, out, lse, d_out, d_lse, *rest, config=config)
  ins = (q, k, v, out, lse, d_out, d_lse)
  scratch = tuple(_jax_internal.shaped_like(q, shape, dtype, ins)
                  for shape, dtype in _bwd_scratch(q, k, v, config))
  return grads + scratch


# ---------------------------------------------------------------------------------------------
# Reference implementations bound by the lowerings

def _fwd_reference(q, k, v, *rest, config):
  rest, sink = _split_sink(rest, config)
  rest, arrays = _split_mods(rest, config)
  rest, bias = _split_bias(rest, config)
  _, (q_seg, kv_seg) = _split_segments((q, k, v) + rest, config)
  mods = _reference_mods(config, bias, arrays)
  out, lse = reference.blocked_forward(q, k, v, config, q_seg, kv_seg, mods=mods)
  if sink is not None:
    out, lse = add_learnable_sink(out, lse, sink)
  # Zero stand-ins for the kernel scratch the abstract eval promised (dropped by the outer
  # primitive, then removed by XLA).
  return (out, lse) + tuple(jnp.zeros(shape, dtype) for shape, dtype in
                            _fwd_scratch(q, k, v, config))


def _bwd_reference(q, k, v, out, lse, d_out, d_lse, *rest, config):
  # mods_core binds the backward with score_mod / mask_mod only where the kernel takes them.
  assert not config.has_mods, "flash_bwd_p with score_mod / mask_mod lowers for CUDA only"
  segment_ids, bias = _split_bias(rest, config)
  _, (q_seg, kv_seg) = _split_segments((q,) + segment_ids, config)
  grads = reference.blocked_backward(q, k, v, out, lse, d_out, d_lse, config, q_seg, kv_seg,
                                     bias=bias)
  # Zero stand-ins for the kernel scratch the abstract eval promised; the outer primitive drops
  # them, so XLA removes them again.
  return tuple(grads) + tuple(jnp.zeros(shape, dtype) for shape, dtype in
                              _bwd_scratch(q, k, v, config))


_fwd_lower_reference = mlir.lower_fun(_fwd_reference, multiple_results=True)
_bwd_lower_reference = mlir.lower_fun(_bwd_reference, multiple_results=True)


def _dtype_name(aval) -> str:
  return np.dtype(aval.dtype).name


def _fwd_lower_cuda(ctx, q, k, v, *rest, config):
  """CUDA: the stable FFI custom call when the kernel exists, the reference otherwise.
  Masked variants (windows, segment ids, softcap, bias, score_mod / mask_mod) get their block
  ranges here: from segment ids as XLA ops in front of the custom call, otherwise as constants
  (block_ranges.py). The bias follows the mask operands (_kernel_bias), then the score_mod /
  mask_mod arrays; the sink comes last."""
  if config.implementation != "cute":
    return _fwd_lower_reference(ctx, q, k, v, *rest, config=config)
  segment_ids, sink = _split_sink(rest, config)
  segment_ids, arrays = _split_mods(segment_ids, config)
  segment_ids, bias = _split_bias(segment_ids, config)
  sink = () if sink is None else (sink,)  # the custom call's last operand
  bias = () if bias is None else (bias,)
  q_aval, _, v_aval = ctx.avals_in[:3]
  dtype, head_dim, head_dim_v = _dtype_name(q_aval), q_aval.shape[-1], v_aval.shape[-1]
  ok, reason = kernel_support("fwd", dtype, head_dim, head_dim_v, config)
  if not ok:  # attention.py checks this at trace time; this guards direct primitive use.
    raise ValueError(f"implementation='cute': {reason}")
  (b, seq_q), seq_k = q_aval.shape[:2], ctx.avals_in[1].shape[1]
  variant = KernelVariant.for_call("fwd", "sm90a", dtype, head_dim, head_dim_v, config, seq_k)
  from jaxflash import ffi  # imported on first CUDA lowering only: keeps `import jaxflash` light
  if _jax_internal.has_cuda_device():
    ffi.ensure_variant(variant)  # cross-lowering on a CPU host needs no library
  attrs = ffi.fwd_attributes(variant, config)
  if not variant.masked:
    return jax.ffi.ffi_lowering(FWD_TARGET)(ctx, q, k, v, *sink, **attrs)

  def call(q, k, v, *rest):
    segment_ids, sink = _split_sink(rest, config)
    segment_ids, arrays = _split_mods(segment_ids, config)
    segment_ids, bias = _split_bias(segment_ids, config)
    operands = block_ranges.forward_operands(
        variant, config, b, seq_q, seq_k, segment_ids,
        mods_block_mask(config, arrays, b, q_aval.shape[2], seq_q, seq_k))
    if bias is not None:
      operands = operands + (_kernel_bias(bias),)
    operands = operands + arrays
    if sink is not None:
      operands = operands + (sink,)
    return jax.ffi.ffi_call(FWD_TARGET, _result_types(ctx))(q, k, v, *operands, **attrs)

  return mlir.lower_fun(call, multiple_results=True)(ctx, q, k, v, *segment_ids, *bias,
                                                     *arrays, *sink)


def _result_types(ctx):
  return tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in ctx.avals_out)


def _kernel_bias(bias):
  """The bias operand of a bias variant's custom call: the primitive's bias with its rows padded
  to config.bias_row_length (16-byte rows for TMA; a no-op when seq_k is a multiple of 8). The
  padding is never read."""
  pad = bias_row_length(bias.shape[-1]) - bias.shape[-1]
  return jnp.pad(bias, ((0, 0),) * 3 + ((0, pad),)) if pad else bias


def _dbias_from_kernel(ds, bias):
  """The primitive's dbias from a bias variant's dbias scratch (d loss / d score per (batch,
  head, query, key) in the input dtype, rows padded to bias_row_length): the padding dropped,
  summed over the bias's broadcast dims in float32 (reference.reduce_bias_grad), in the bias's
  dtype. A bias of the scores' full shape takes the scratch as it is."""
  ds = ds[..., :bias.shape[-1]]
  return reference.reduce_bias_grad(ds, bias.shape).astype(bias.dtype)


def _bwd_lower_cuda(ctx, q, k, v, out, lse, d_out, d_lse, *rest, config):
  """CUDA: the backward custom call when a backward kernel exists, the reference otherwise.

  The forward decides implementation='cute'; a backward the kernels lack (a head-dim pair
  without one) falls back to the reference here. Its variant is found (or built) here, and only
  here: a call without a gradient never needs one. Masked variants get their block ranges here,
  as in the forward (block_ranges.py). Bias variants take the bias after the mask operands
  (_kernel_bias) and return dbias per score as their last scratch result, which becomes the
  primitive's dbias here (_dbias_from_kernel). Mods variants take the score_mod / mask_mod
  arrays after the mask operands.
  """
  q_aval, k_aval, v_aval = ctx.avals_in[:3]
  variant = _kernel_variant("bwd", q_aval, v_aval, config)
  if variant is None:
    return _bwd_lower_reference(ctx, q, k, v, out, lse, d_out, d_lse, *rest, config=config)
  from jaxflash import ffi  # imported on first CUDA lowering only: keeps `import jaxflash` light
  if _jax_internal.has_cuda_device():  # cross-lowering on a CPU host needs no library
    try:
      ffi.ensure_variant(variant)
    except RuntimeError as e:
      raise RuntimeError(f"jaxflash: the gradient of this attention call runs the backward "
                         f"kernel variant {variant.key}, which is unavailable here "
                         f"(implementation='reference' computes the call without kernels):\n"
                         f"{e}") from e
  attrs = ffi.bwd_attributes(variant, config)
  if not variant.masked:
    return jax.ffi.ffi_lowering(BWD_TARGET)(ctx, q, k, v, out, lse, d_out, d_lse, **attrs)
  (b, seq_q), seq_k = q_aval.shape[:2], k_aval.shape[1]
  results = _result_types(ctx)
  if variant.bias:  # the custom call's results: no dbias of the bias's shape, dbias per score
    results = results[:3] + results[4:]

  def call(q, k, v, out, lse, d_out, d_lse, *rest):
    rest, arrays = _split_mods(rest, config)
    segment_ids, bias = _split_bias(rest, config)
    operands = block_ranges.backward_operands(
        variant, config, b, seq_q, seq_k, q_aval.shape[2], k_aval.shape[2], segment_ids,
        mods_block_mask(config, arrays, b, q_aval.shape[2], seq_q, seq_k))
    outs = jax.ffi.ffi_call(BWD_TARGET, results)(
        q, k, v, out, lse, d_out, d_lse, *operands,
        *(() if bias is None else (_kernel_bias(bias),)), *arrays, **attrs)
    if bias is None:
      return outs
    return tuple(outs[:3]) + (_dbias_from_kernel(outs[-1], bias),) + tuple(outs[3:])

  return mlir.lower_fun(call, multiple_results=True)(ctx, q, k, v, out, lse, d_out, d_lse,
                                                     *rest)


def reject_cute_off_gpu(lower_reference, refusal: str):
  """Non-CUDA lowering: the reference, unless the caller insisted on the kernels (then
  ValueError(refusal))."""

  def rule(ctx, *args, config):
    if config.implementation == "cute":
      raise ValueError(refusal)
    return lower_reference(ctx, *args, config=config)

  return rule


# ---------------------------------------------------------------------------------------------
# Batching: fold every mapped axis into the batch axis (exact for attention).

def _fold_batch(args, dims):
  """Moves each mapped axis to the front and merges it into batch; broadcasts unmapped args."""
  size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
  folded = []
  for a, d in zip(args, dims):
    a = jnp.broadcast_to(a, (size,) + a.shape) if d is None else jnp.moveaxis(a, d, 0)
    folded.append(a.reshape((size * a.shape[1],) + a.shape[2:]))
  return size, folded


def _unfold(size, outs):
  return [o.reshape((size, o.shape[0] // size) + o.shape[1:]) for o in outs]


def _batch_rule(prim):
  def rule(args, dims, *, config):
    size, folded = _fold_batch(args, dims)
    outs = prim.bind(*folded, config=config)
    return _unfold(size, outs), (0,) * len(outs)

  return rule


def _bias_index(config: AttentionConfig, first: int) -> int:
  """Position of the bias among a primitive's operands: after `first` tensors and the segment
  ids."""
  return first + (2 if config.has_segment_ids else 0)


def _unbroadcast_bias_batch(args, dims, config: AttentionConfig, index: int):
  """(args, config) with a bias of batch 1 broadcast to the query's batch, so that folding the
  mapped axes into batch keeps each folded batch element's own bias rows (exact, at the cost of
  the broadcast's memory, under vmap only)."""
  q, q_dim = args[0], dims[0]
  batch = q.shape[1 if q_dim == 0 else 0]  # q's batch axis without the mapped one
  bias, bias_dim = args[index], dims[index]
  axis = 1 if bias_dim == 0 else 0
  if bias.shape[axis] == batch:
    return args, config.replace(bias_dims=(True,) + config.bias_dims[1:])
  shape = list(bias.shape)
  shape[axis] = batch
  args = list(args)
  args[index] = jnp.broadcast_to(bias, tuple(shape))
  return args, config.replace(bias_dims=(True,) + config.bias_dims[1:])


def bwd_batch_rule(prim):
  """The batching of flash_bwd_p: fold every mapped axis into batch; a bias of batch 1 is
  broadcast first, and its gradient summed back over that batch."""
  def rule(args, dims, *, config):
    n = mod_array_count(config)
    if n:  # the arrays end the operands (no bias with them)
      if any(d is not None for d in dims[-n:]):
        raise ValueError("score_mod / mask_mod: an array they close over varies along a "
                         "vmapped axis; use implementation='reference'")
      inner = _WithArrays(prim, args[-n:], len(args) - n)
      args, dims = args[:-n], dims[:-n]
      if "batch" in mods_inputs(config.mods):
        return _map_calls(inner, args, dims, config)
      return _batch_rule(inner)(args, dims, config=config)
    if not config.has_bias:
      return _batch_rule(prim)(args, dims, config=config)
    index = _bias_index(config, 7)
    bias_batch = args[index].shape[1 if dims[index] == 0 else 0]
    args, full = _unbroadcast_bias_batch(args, dims, config, index)
    size, folded = _fold_batch(args, dims)
    outs = _unfold(size, prim.bind(*folded, config=full))
    if bias_batch == 1:
      outs[3] = jnp.sum(outs[3], axis=1, keepdims=True)
    return outs, (0,) * len(outs)

  return rule


def fwd_batch_rule(prim):
  """The batching of a forward primitive (flash_fwd_p, the FP8 one) whose operands all lead
  with batch but the optional last, the sink: the sink (one logit per head) stays out of the
  batch fold. A sink that is itself mapped differs per folded batch element, which the
  kernel's one logit per head cannot hold: the call then runs without it and the sink rescales
  each row in XLA (sink.add_learnable_sink, exact). The arrays score_mod / mask_mod close over
  are shared by every batch element (replicated operands): they stay out of the fold and must
  not be mapped."""
  def rule(args, dims, *, config):
    n = mod_array_count(config)
    if not n:
      return _fwd_batch(prim, args, dims, config)
    index = _bias_index(config, 3) + (1 if config.has_bias else 0)  # the first array
    arrays, array_dims = args[index:index + n], dims[index:index + n]
    if any(d is not None for d in array_dims):
      raise ValueError("score_mod / mask_mod: an array they close over varies along a vmapped "
                       "axis; the kernels take one copy for every batch element. Index it by "
                       "the `batch` argument instead, or use implementation='reference'")
    inner = _WithArrays(prim, arrays, index)
    args, dims = args[:index] + args[index + n:], dims[:index] + dims[index + n:]
    if "batch" in mods_inputs(config.mods):
      # Folding would renumber the batch that the functions read: one call per mapped index.
      return _map_calls(inner, args, dims, config)
    return _fwd_batch(inner, args, dims, config)
  return rule


def _map_calls(prim, args, dims, config):
  """The batched call as a sequence of unbatched ones (lax.map over the mapped axis)."""
  size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
  moved = tuple(jnp.broadcast_to(a, (size,) + a.shape) if d is None else jnp.moveaxis(a, d, 0)
                for a, d in zip(args, dims))
  outs = jax.lax.map(lambda xs: tuple(prim.bind(*xs, config=config)), moved)
  return list(outs), (0,) * len(outs)


class _WithArrays:
  """Binds `prim` with fixed operands (the score_mod / mask_mod arrays) inserted at `index`."""

  def __init__(self, prim, arrays, index: int):
    self.prim, self.arrays, self.index = prim, tuple(arrays), index

  def bind(self, *args, config):
    return self.prim.bind(*args[:self.index], *self.arrays, *args[self.index:], config=config)


def _fwd_batch(prim, args, dims, config):
  """fwd_batch_rule's fold of (q, k, v[, segments][, bias][, sink]); prim.bind adds any mods
  arrays."""
  if config.has_bias:
    args, config = _unbroadcast_bias_batch(args, dims, config, _bias_index(config, 3))
  if not config.has_sink:
    return _batch_rule(prim)(args, dims, config=config)
  (*args, sink), (*dims, sink_dim) = args, dims
  if all(d is None for d in dims):  # only the sink is mapped
    size = sink.shape[sink_dim]
    args = [jnp.broadcast_to(a, (size,) + a.shape) for a in args]
    dims = [0] * len(args)
  size, folded = _fold_batch(args, dims)
  if sink_dim is None:
    outs = prim.bind(*folded, sink, config=config)
    return _unfold(size, outs), (0, 0)
  out, lse = _unfold(size, prim.bind(*folded, config=config.replace(has_sink=False)))
  sink = jnp.moveaxis(sink, sink_dim, 0)  # (size, heads)
  out, lse = jax.vmap(add_learnable_sink)(out, lse, sink)
  return (out, lse), (0, 0)


# ---------------------------------------------------------------------------------------------
# Registration

def make_primitive(name: str, abstract):
  p = jax.extend.core.Primitive(name)
  p.multiple_results = True
  p.def_abstract_eval(abstract)
  p.def_impl(functools.partial(_jax_internal.apply_primitive, p))
  return p


_flash_fwd_kernel_p = make_primitive("jaxflash_fwd_kernel", _fwd_kernel_abstract)
_flash_bwd_kernel_p = make_primitive("jaxflash_bwd_kernel", _bwd_kernel_abstract)
flash_fwd_p = make_primitive("jaxflash_fwd", _fwd_abstract)
flash_bwd_p = make_primitive("jaxflash_bwd", _bwd_abstract)

mlir.register_lowering(_flash_fwd_kernel_p, reject_cute_off_gpu(
    _fwd_lower_reference, "implementation='cute' needs an NVIDIA Hopper GPU, but this computation "
    "is lowered for platform 'cpu'; use implementation=None (auto) or 'reference'"))
mlir.register_lowering(_flash_fwd_kernel_p, _fwd_lower_cuda, platform="cuda")
mlir.register_lowering(_flash_bwd_kernel_p, _bwd_lower_reference)
mlir.register_lowering(_flash_bwd_kernel_p, _bwd_lower_cuda, platform="cuda")

batching.primitive_batchers[flash_fwd_p] = fwd_batch_rule(flash_fwd_p)
batching.primitive_batchers[flash_bwd_p] = bwd_batch_rule(flash_bwd_p)


# ---- sharding wiring: owned by the sharding helper (jaxflash/sharding.py) ----
# The outer primitives lower through custom_partitioning (Shardy rules), whose per-shard
# function binds the inner primitive: batch/head sharding runs shard-local, no collectives.
from jax.experimental.custom_partitioning import custom_partitioning  # noqa: E402

from jaxflash import sharding  # noqa: E402


def _partitioned(inner, rule_fn: Callable, partition_fn: Callable, num_results):
  """custom_partitioning of `inner` under a rule and partition function of jaxflash.sharding;
  the first num_results results are kept (the kernels' scratch is dropped). num_results: a
  count, or a function of the config that gives it."""
  count = num_results if callable(num_results) else (lambda config: num_results)

  def impl(config, *args):
    return tuple(inner.bind(*args, config=config))[:count(config)]

  def partition(config, mesh, arg_shapes, result_shapes):
    del result_shapes
    compute = lambda *a: tuple(inner.bind(*a, config=config))[:count(config)]
    arg_shardings, result_shardings, per_shard = partition_fn(config, mesh, arg_shapes, compute)
    return mesh, per_shard, result_shardings, arg_shardings

  def rule(config, mesh, operand_types, result_types):
    del result_types
    return rule_fn(config, operand_types[0].shape[2], operand_types[1].shape[2],
                   tuple(mesh.shape.values()))

  partitioned = custom_partitioning(impl, static_argnums=(0,))
  partitioned.def_partition(partition=partition, sharding_rule=rule)
  return partitioned


def partitioned_lowering(inner, rule_fn: Callable, partition_fn: Callable, num_results):
  """The lowering of an outer primitive: `inner` per shard, through custom_partitioning."""
  partitioned = _partitioned(inner, rule_fn, partition_fn, num_results)

  def lower(ctx, *args, config):
    return mlir.lower_fun(lambda *a: partitioned(config, *a), multiple_results=True)(ctx, *args)

  return lower


mlir.register_lowering(flash_fwd_p, partitioned_lowering(
    _flash_fwd_kernel_p, sharding.fwd_sharding_rule, sharding.fwd_partition, 2))  # (out, lse)
mlir.register_lowering(flash_bwd_p, partitioned_lowering(  # dq, dk, dv[, dbias]
    _flash_bwd_kernel_p, sharding.bwd_sharding_rule, sharding.bwd_partition,
    lambda config: 3 + config.has_bias))
_jax_internal.require_devices_during_lowering(flash_fwd_p, flash_bwd_p)
# ---- end sharding wiring ----


# ---------------------------------------------------------------------------------------------
# custom_vjp core

@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def attention_core(config: AttentionConfig, q, k, v, q_segment_ids, kv_segment_ids,
                   sink=None, bias=None):
  """(out, lse) of one attention call; differentiable in q, k, v, the sink (when
  config.has_sink), the bias (when config.has_bias: (batch|1, heads|1, seq_q|1, seq_k), any
  float dtype) and through the lse."""
  return _bind_fwd(config, q, k, v, q_segment_ids, kv_segment_ids, sink, bias)


def _segments(config, q_segment_ids, kv_segment_ids):
  return (q_segment_ids, kv_segment_ids) if config.has_segment_ids else ()


def _operand_bias(config: AttentionConfig, q, bias) -> tuple:
  """The primitives' bias operand: () without one; the kernels read it in q's dtype."""
  if not config.has_bias:
    return ()
  return (bias.astype(q.dtype) if config.implementation == "cute" else bias,)


def _bind_fwd(config, q, k, v, q_segment_ids, kv_segment_ids, sink, bias=None):
  sink = (sink,) if config.has_sink else ()
  out, lse = flash_fwd_p.bind(q, k, v, *_segments(config, q_segment_ids, kv_segment_ids),
                              *_operand_bias(config, q, bias), *sink, config=config)
  return out, lse


def _core_fwd(config, q, k, v, q_segment_ids, kv_segment_ids, sink=None, bias=None):
  out, lse = _bind_fwd(config, q, k, v, q_segment_ids, kv_segment_ids, sink, bias)
  # Named so that remat policies (save_only_these_names, ...) can keep or drop the residuals.
  # The named values are also the primal outputs, so a policy that keeps them needs no
  # recomputation for the caller's own use of `out` either.
  out = checkpoint_name(out, OUT_CHECKPOINT_NAME)
  lse = checkpoint_name(lse, LSE_CHECKPOINT_NAME)
  return (out, lse), (q, k, v, q_segment_ids, kv_segment_ids, sink, out, lse, bias)


def attention_core_bwd(config, residuals, cotangents):
  """attention_core's backward: (dq, dk, dv, None, None, d_sink, d_bias) from the residuals
  (q, k, v, q_segment_ids, kv_segment_ids, sink, out, lse, bias) and the cotangents of
  (out, lse). d_bias comes in the bias's dtype, reduced over its broadcast dims."""
  # lse includes the sink, so the backward's probabilities exp(s - lse) are the sink-normalised
  # ones: the kernels need nothing else, and the sink's own gradient is a reduction in XLA.
  q, k, v, q_segment_ids, kv_segment_ids, sink, out, lse, bias = residuals
  d_out, d_lse = cotangents
  grads = flash_bwd_p.bind(q, k, v, out, lse, d_out.astype(out.dtype), d_lse.astype(lse.dtype),
                           *_segments(config, q_segment_ids, kv_segment_ids),
                           *_operand_bias(config, q, bias), config=config)
  dq, dk, dv = grads[:3]
  d_bias = grads[3].astype(bias.dtype) if config.has_bias else None
  d_sink = learnable_sink_grad(out, lse, d_out, d_lse, sink) if config.has_sink else None
  return dq, dk, dv, None, None, d_sink, d_bias


attention_core.defvjp(_core_fwd, attention_core_bwd)
