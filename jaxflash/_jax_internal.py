"""The only module allowed to touch jax._src; one comment per hook says why it is needed."""

from __future__ import annotations

import functools

import jax
from jax import core


def shaped_like(ref, shape, dtype, inputs):
  """A ShapedArray for a primitive output that keeps shard_map's varying manual axes.

  Inside shard_map, outputs must vary over the manual axes their inputs vary over (else the
  custom_vjp cotangent types mismatch: jax#36008; JAX's cuDNN attention does the same). jax 0.10
  spells this `manual_axis_type`/`.mat`, earlier releases `vma`: both are handled here.
  """
  del ref
  from jax._src import core as src_core  # ManualAxisType is not re-exported by jax.core
  from jax.sharding import NamedSharding, PartitionSpec
  if hasattr(src_core, "ManualAxisType"):
    varying = frozenset().union(*(a.mat.varying for a in inputs if hasattr(a, "mat")))
    if not varying:
      return core.ShapedArray(shape, dtype)
    mesh = next(a.sharding.mesh for a in inputs if a.mat.varying)
    return core.ShapedArray(shape, dtype, sharding=NamedSharding(mesh, PartitionSpec()),
                            manual_axis_type=src_core.ManualAxisType(varying=varying))
  varying = frozenset().union(*(getattr(a, "vma", frozenset()) for a in inputs))
  if not varying:
    return core.ShapedArray(shape, dtype)
  mesh = next(a.sharding.mesh for a in inputs if getattr(a, "vma", None))
  return core.ShapedArray(shape, dtype, sharding=NamedSharding(mesh, PartitionSpec()),
                          vma=varying)


def apply_primitive(prim, *args, **params):
  # Eager execution of a custom primitive: jit-compile it once per signature, as jax's own
  # primitives do (jax._src.dispatch.apply_primitive is not exported).
  from jax._src import dispatch
  return dispatch.apply_primitive(prim, *args, **params)


@functools.lru_cache(maxsize=None)
def has_cuda_device() -> bool:
  """Whether this process has a CUDA backend with at least one device (probed once, lazily)."""
  try:
    return len(jax.devices("cuda")) > 0
  except RuntimeError:
    return False


@functools.lru_cache(maxsize=None)
def has_hopper_device() -> bool:
  """Whether the CUDA devices are Hopper (compute capability 9.x): the sm_90a kernels run there."""
  if not has_cuda_device():
    return False
  caps = {getattr(d, "compute_capability", "") for d in jax.devices("cuda")}
  return bool(caps) and all(str(c).startswith("9.") for c in caps)


def require_devices_during_lowering(*prims):
  # custom_partitioning needs the device assignment while lowering; JAX passes it only for
  # primitives in this registry (jax._src.dispatch, no public equivalent; cuDNN attention and
  # TE register their outer primitives the same way).
  from jax._src import dispatch
  for p in prims:
    dispatch.prim_requires_devices_during_lowering.add(p)
