"""Partition rules of the attention primitives: pure functions of the config and the shardings.

Imports jax (sharding, lax) and jaxflash.config only; primitives.py wires these into
custom_partitioning. It never imports primitives (docs/design.md).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Mapping, Optional, Sequence

import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from jaxflash.config import AttentionConfig, mods_arrays, mods_inputs

# Shardy factor names. Query heads and kv heads are separate factors; when every head
# sharding the mesh allows keeps whole kv heads, the query-head dim is written as the compound
# (kv_heads q_per_kv) so that Shardy propagates a head sharding between q and k/v (every query
# group then stays with its kv head). Otherwise Shardy would split a mesh axis into sub-axes
# for kv_heads, which custom_partitioning cannot hand to Python (IndivisibleError), so the
# factors stay independent and `resolve` aligns them.
BATCH, SEQ_Q, SEQ_K = "batch", "seq_q", "seq_k"
HEADS, KV_HEADS, Q_PER_KV = "heads", "kv_heads", "q_per_kv"
HEAD_DIM, HEAD_DIM_V = "head_dim", "head_dim_v"
# The kernels hold a whole row of keys and a whole head: these factors are never sharded.
REPLICATED_FACTORS = (SEQ_Q, SEQ_K, HEAD_DIM, HEAD_DIM_V)
# A bias's broadcast dims (size 1, never sharded): one factor each.
BIAS_BATCH, BIAS_HEADS, BIAS_ROWS = "bias_batch", "bias_heads", "bias_rows"
# The FP8 primitive's descales: q_descale (batch, heads, query chunks) and kv_descale (batch,
# kv heads, key chunks, 4 values); the chunk and value dims are whole.
Q_CHUNKS, K_CHUNKS, CHUNK_VALUES = "q_chunks", "k_chunks", "chunk_values"


# ---------------------------------------------------------------------------------------------
# Shardy rules (einsum-like strings with named factors)

def _head_factors(num_heads: int, num_kv_heads: int, mesh_sizes: Sequence[int]):
  """(query-head mapping, kv-head mapping, factor sizes) for MHA or GQA/MQA."""
  if num_heads == num_kv_heads:
    return HEADS, HEADS, {}
  if num_kv_heads % math.prod(mesh_sizes) == 0:
    return f"({KV_HEADS} {Q_PER_KV})", KV_HEADS, {Q_PER_KV: num_heads // num_kv_heads}
  return HEADS, KV_HEADS, {}


def _operands(num_heads: int, num_kv_heads: int, has_segment_ids: bool, mesh_sizes):
  h, kv, sizes = _head_factors(num_heads, num_kv_heads, mesh_sizes)
  q = f"{BATCH} {SEQ_Q} {h} {HEAD_DIM}"
  k = f"{BATCH} {SEQ_K} {kv} {HEAD_DIM}"
  v = f"{BATCH} {SEQ_K} {kv} {HEAD_DIM_V}"
  out = f"{BATCH} {SEQ_Q} {h} {HEAD_DIM_V}"
  lse = f"{BATCH} {h} {SEQ_Q}"
  segments = [f"{BATCH} {SEQ_Q}", f"{BATCH} {SEQ_K}"] if has_segment_ids else []
  return q, k, v, out, lse, segments, sizes


def _rule(operands: Sequence[str], results: Sequence[str], sizes: Mapping[str, int],
          replicated: Sequence[str] = REPLICATED_FACTORS):
  rule = f"{', '.join(operands)} -> {', '.join(results)}"
  # Shardy's verifier wants special factors in order of first appearance in the rule.
  order = [f for f in rule.replace("(", " ").replace(")", " ").replace(",", " ").split()
           if f != "->"]
  replicated = tuple(sorted((f for f in dict.fromkeys(replicated) if f in order),
                           key=order.index))
  return rule, dict(sizes, need_replication_factors=replicated)


def _bias_factors(config: AttentionConfig, heads: str) -> list[str]:
  """[the bias's factors] ((batch|1, heads|1, seq_q|1, seq_k): a broadcast dim is a factor of
  its own), or [] without a bias."""
  if not config.has_bias:
    return []
  full_b, full_h, full_q = config.bias_dims
  return [" ".join((BATCH if full_b else BIAS_BATCH, heads if full_h else BIAS_HEADS,
                    SEQ_Q if full_q else BIAS_ROWS, SEQ_K))]


_BIAS_REPLICATED = (BIAS_BATCH, BIAS_HEADS, BIAS_ROWS)


def _replicated(config: AttentionConfig) -> tuple[str, ...]:
  """The factors a call never shards (_rule drops those its rule lacks)."""
  out = REPLICATED_FACTORS
  if config.has_bias:
    out += tuple(f for f, full in zip(_BIAS_REPLICATED, config.bias_dims) if not full)
  if config.has_mods:
    # The arrays are whole on every shard; the kernels see the batch and head indices of their
    # shard, so functions that read them keep those dims whole.
    out += tuple(f for factors in _mods_factors(config) for f in factors.split())
    reads = mods_inputs(config.mods)
    if "batch" in reads:
      out += (BATCH,)
    if "head" in reads:
      out += (HEADS, KV_HEADS, Q_PER_KV)
  return out


def _mods_factors(config: AttentionConfig) -> list[str]:
  """[each score_mod / mask_mod array's factors] (one of its own per dim: never sharded)."""
  return [" ".join(f"mod{k}_{i}" for i in range(rank))
          for k, (_, rank) in enumerate(mods_arrays(config.mods))]


def fwd_sharding_rule(config: AttentionConfig, num_heads: int, num_kv_heads: int,
                      mesh_sizes: Sequence[int] = ()):
  """(rule string, keyword arguments) of flash_fwd_p: (q, k, v[, q_seg, kv_seg][, bias]
  [, sink]) -> (out, lse).

  mesh_sizes: the sizes of the mesh axes (decides whether GQA heads use a compound factor).
  """
  q, k, v, out, lse, segments, sizes = _operands(num_heads, num_kv_heads,
                                                 config.has_segment_ids, mesh_sizes)
  heads = _head_factors(num_heads, num_kv_heads, mesh_sizes)[0]
  sink = [heads] if config.has_sink else []
  bias = _bias_factors(config, heads)
  mods = _mods_factors(config)
  return _rule([q, k, v, *segments, *bias, *mods, *sink], [out, lse], sizes,
               _replicated(config))


def fp8_fwd_sharding_rule(config: AttentionConfig, num_heads: int, num_kv_heads: int,
                          mesh_sizes: Sequence[int] = ()):
  """Rule of the FP8 forward primitive (fp8_kernel.fp8_fwd_p): (q8, k8, v8, q_descale (batch,
  num_heads, q chunks), kv_descale (batch, num_kv_heads, k chunks, 4)[, sink]) -> (out, lse)."""
  q, k, v, out, lse, _, sizes = _operands(num_heads, num_kv_heads, False, mesh_sizes)
  h, kv, _ = _head_factors(num_heads, num_kv_heads, mesh_sizes)
  sink = [h] if config.has_sink else []
  descales = [f"{BATCH} {h} {Q_CHUNKS}", f"{BATCH} {kv} {K_CHUNKS} {CHUNK_VALUES}"]
  return _rule([q, k, v, *descales, *sink], [out, lse], sizes,
               REPLICATED_FACTORS + (Q_CHUNKS, K_CHUNKS, CHUNK_VALUES))


def bwd_sharding_rule(config: AttentionConfig, num_heads: int, num_kv_heads: int,
                      mesh_sizes: Sequence[int] = ()):
  """Rule of flash_bwd_p: (q, k, v, out, lse, d_out, d_lse[, segs][, bias][, mods arrays]) ->
  (dq, dk, dv[, dbias])."""
  q, k, v, out, lse, segments, sizes = _operands(num_heads, num_kv_heads,
                                                 config.has_segment_ids, mesh_sizes)
  bias = _bias_factors(config, _head_factors(num_heads, num_kv_heads, mesh_sizes)[0])
  mods = _mods_factors(config)
  return _rule([q, k, v, out, lse, out, lse, *segments, *bias, *mods], [q, k, v, *bias], sizes,
               _replicated(config))


# ---------------------------------------------------------------------------------------------
# Resolution: from whatever shardings arrive to one valid per-shard layout

def spec_axes(spec: Optional[PartitionSpec], ndim: int) -> tuple[tuple[str, ...], ...]:
  """A PartitionSpec as one tuple of mesh-axis names per dimension (padded to ndim)."""
  entries = tuple(spec) if spec is not None else ()
  entries = entries + (None,) * (ndim - len(entries))
  out = []
  for e in entries[:ndim]:
    if e is None or e is PartitionSpec.UNCONSTRAINED:
      out.append(())
    elif isinstance(e, str):
      out.append((e,))
    else:
      out.append(tuple(e))
  return tuple(out)


def _entry(axes: tuple[str, ...]):
  if not axes:
    return None
  return axes[0] if len(axes) == 1 else axes


@dataclasses.dataclass(frozen=True)
class Plan:
  """How one attention call runs per shard.

  batch_axes shard the batch of every operand; head_axes shard the query heads. When the kv
  heads divide by the head shards, k/v are sharded by the same axes (kv_replicated False).
  Otherwise (MQA/GQA with fewer kv heads than head shards) k/v stay replicated over head_axes,
  each shard slices the one kv head its query heads read, and the backward sums dk/dv over
  head_axes (one all-reduce of k's size; Megatron does the same for MQA).
  """

  batch_axes: tuple[str, ...] = ()
  head_axes: tuple[str, ...] = ()
  kv_replicated: bool = False
  num_heads: int = 1
  num_kv_heads: int = 1
  head_shards: int = 1

  def q_spec(self) -> PartitionSpec:  # q, out, d_out, dq
    return PartitionSpec(_entry(self.batch_axes), None, _entry(self.head_axes), None)

  def kv_spec(self) -> PartitionSpec:  # k, v, dk, dv
    heads = None if self.kv_replicated else _entry(self.head_axes)
    return PartitionSpec(_entry(self.batch_axes), None, heads, None)

  def lse_spec(self) -> PartitionSpec:  # lse, d_lse
    return PartitionSpec(_entry(self.batch_axes), _entry(self.head_axes), None)

  def segment_spec(self) -> PartitionSpec:  # q_segment_ids, kv_segment_ids
    return PartitionSpec(_entry(self.batch_axes), None)

  def sink_spec(self) -> PartitionSpec:  # learnable_sink: one logit per query head
    return PartitionSpec(_entry(self.head_axes))

  def bias_spec(self, bias_dims) -> PartitionSpec:  # bias, dbias (batch|1, heads|1, s_q|1, s_k)
    full_b, full_h, _ = bias_dims
    return PartitionSpec(_entry(self.batch_axes) if full_b else None,
                         _entry(self.head_axes) if full_h else None, None, None)

  def reduce_dbias(self, dbias, bias_dims):
    """dbias of this shard -> the gradient of the bias as sharded by bias_spec: summed over the
    batch / head shards along which the bias is broadcast."""
    full_b, full_h, _ = bias_dims
    axes = (() if full_b else self.batch_axes) + (() if full_h else self.head_axes)
    if not axes:
      return dbias
    acc = jnp.promote_types(dbias.dtype, jnp.float32)
    return lax.psum(dbias.astype(acc), axes).astype(dbias.dtype)

  def q_descale_spec(self) -> PartitionSpec:  # FP8 q_descale (batch, heads, chunks)
    return self.lse_spec()  # lse's layout: (batch, heads, a whole dim)

  def kv_descale_spec(self) -> PartitionSpec:  # FP8 kv_descale (batch, kv heads, chunks, 4)
    heads = None if self.kv_replicated else _entry(self.head_axes)
    return PartitionSpec(_entry(self.batch_axes), heads, None, None)

  # -- per-shard helpers (run inside custom_partitioning's per-shard function) --

  def _kv_index(self):
    """Index of the kv head that this shard's query heads read (kv_replicated only)."""
    shard = lax.axis_index(self.head_axes if len(self.head_axes) > 1 else self.head_axes[0])
    group = self.num_heads // self.num_kv_heads
    return (shard * (self.num_heads // self.head_shards)) // group

  def select_kv(self, x, axis: int = 2):
    """Local k, v (kv heads in dim 2) or FP8 kv_descale (axis=1): the slice of kv heads this
    shard's query heads read."""
    if not self.kv_replicated:
      return x
    return lax.dynamic_slice_in_dim(x, self._kv_index(), 1, axis=axis)

  def reduce_dkv(self, dx):
    """dk or dv of the local kv slice -> the replicated gradient, summed over head shards."""
    if not self.kv_replicated:
      return dx
    acc = jnp.promote_types(dx.dtype, jnp.float32)  # sum the shards' parts in >= float32
    full = jnp.zeros(dx.shape[:2] + (self.num_kv_heads,) + dx.shape[3:], acc)
    full = lax.dynamic_update_slice_in_dim(full, dx.astype(acc), self._kv_index(), axis=2)
    axes = self.head_axes if len(self.head_axes) > 1 else self.head_axes[0]
    return lax.psum(full, axes).astype(dx.dtype)


def _divisible_prefix(axes: tuple[str, ...], mesh_shape: Mapping[str, int], ok) -> tuple[str, ...]:
  """The longest prefix of `axes` whose total size satisfies ok(size)."""
  for n in range(len(axes), -1, -1):
    if ok(math.prod(mesh_shape[a] for a in axes[:n])):
      return axes[:n]
  return ()


def resolve(mesh_shape: Mapping[str, int], q_axes, k_axes, v_axes, *, batch: int,
            num_heads: int, num_kv_heads: int) -> Plan:
  """One valid Plan from the per-dimension mesh axes of q, k and v (see `spec_axes`).

  Rules (documented in docs/sharding.md):
    * batch: q's batch axes, else k's, else v's; trailing axes that do not divide batch drop.
    * heads: q's head axes, else k's kv-head axes, else v's; axes already used by batch drop;
      trailing axes drop until their size divides num_heads and either divides num_kv_heads
      (k/v sharded alike) or is a multiple of it (k/v replicated over them, see Plan).
    * seq_q, seq_k, head_dim, head_dim_v are never sharded: such inputs are gathered.
  """
  known = lambda axes: tuple(a for a in axes if a in mesh_shape)
  batch_axes = known(q_axes[0] or k_axes[0] or v_axes[0])
  batch_axes = _divisible_prefix(batch_axes, mesh_shape, lambda n: batch % n == 0)
  head_axes = known(q_axes[2] or k_axes[2] or v_axes[2])
  head_axes = tuple(a for a in head_axes if a not in batch_axes)
  head_axes = _divisible_prefix(
      head_axes, mesh_shape,
      lambda n: num_heads % n == 0 and (num_kv_heads % n == 0 or n % num_kv_heads == 0))
  shards = math.prod(mesh_shape[a] for a in head_axes)
  return Plan(batch_axes=batch_axes, head_axes=head_axes,
              kv_replicated=num_kv_heads % shards != 0, num_heads=num_heads,
              num_kv_heads=num_kv_heads, head_shards=shards)


def _axes_of(shape_with_sharding, ndim: int):
  sharding = getattr(shape_with_sharding, "sharding", None)
  spec = sharding.spec if isinstance(sharding, NamedSharding) else None
  return spec_axes(spec, ndim)


def plan_for(mesh, arg_shapes, whole: tuple[int, ...] = ()) -> Plan:
  """The Plan for one call from its first three operands (q, k, v) as custom_partitioning
  passes them: ShapeDtypeStructs whose .sharding is a NamedSharding (or None / a sharding
  without a mesh, read as replicated). whole: dims of q, k, v (0 batch, 2 heads) that stay
  unsharded whatever the operands' shardings."""
  q, k, v = arg_shapes[:3]
  axes = [[() if d in whole else a for d, a in enumerate(_axes_of(x, 4))] for x in (q, k, v)]
  return resolve(dict(mesh.shape), *axes, batch=q.shape[0], num_heads=q.shape[2],
                 num_kv_heads=k.shape[2])


def _whole_dims(config: AttentionConfig) -> tuple[int, ...]:
  """The dims (0 batch, 2 heads) a call keeps whole: those score_mod / mask_mod read."""
  reads = mods_inputs(config.mods)
  return tuple(d for d, name in ((0, "batch"), (2, "head")) if name in reads)


def fwd_specs(plan: Plan, has_segment_ids: bool, has_sink: bool = False, bias_dims=None,
              mods=None):
  """(operand specs, result specs) of flash_fwd_p under `plan` (bias_dims, mods: the
  config's; score_mod / mask_mod arrays are replicated)."""
  segs = (plan.segment_spec(),) * 2 if has_segment_ids else ()
  sink = (plan.sink_spec(),) if has_sink else ()
  bias = (plan.bias_spec(bias_dims),) if bias_dims is not None else ()
  arrays = tuple(PartitionSpec(*(None,) * rank) for _, rank in mods_arrays(mods))
  args = (plan.q_spec(), plan.kv_spec(), plan.kv_spec()) + segs + bias + arrays + sink
  return args, (plan.q_spec(), plan.lse_spec())


def bwd_specs(plan: Plan, has_segment_ids: bool, bias_dims=None, mods=None):
  """(operand specs, result specs) of flash_bwd_p under `plan` (score_mod / mask_mod arrays
  replicated)."""
  segs = (plan.segment_spec(),) * 2 if has_segment_ids else ()
  bias = (plan.bias_spec(bias_dims),) if bias_dims is not None else ()
  arrays = tuple(PartitionSpec(*(None,) * rank) for _, rank in mods_arrays(mods))
  q, kv, lse = plan.q_spec(), plan.kv_spec(), plan.lse_spec()
  return (q, kv, kv, q, lse, q, lse) + segs + bias + arrays, (q, kv, kv) + bias


def fwd_partition(config: AttentionConfig, mesh, arg_shapes,
                  compute: Callable) -> tuple[tuple, tuple, Callable]:
  """custom_partitioning's decision for flash_fwd_p.

  `compute(*local_args) -> (out, lse)` runs one shard (primitives.py binds the inner
  primitive there). Returns (operand shardings, result shardings, per-shard function).
  """
  plan = plan_for(mesh, arg_shapes, _whole_dims(config))
  arg_specs, result_specs = fwd_specs(plan, config.has_segment_ids, config.has_sink,
                                      config.bias_dims, config.mods)

  def per_shard(q, k, v, *rest):  # rest: segment ids, bias, mods arrays, sink, as operands
    return tuple(compute(q, plan.select_kv(k), plan.select_kv(v), *rest))

  return _named(mesh, arg_specs), _named(mesh, result_specs), per_shard


def fp8_fwd_partition(config: AttentionConfig, mesh, arg_shapes,
                      compute: Callable) -> tuple[tuple, tuple, Callable]:
  """custom_partitioning's decision for the FP8 forward primitive: as flash_fwd_p's, with the
  q_descale sharded like the query heads, kv_descale like the kv heads of k and v."""
  plan = plan_for(mesh, arg_shapes)
  sink = (plan.sink_spec(),) if config.has_sink else ()
  arg_specs = (plan.q_spec(), plan.kv_spec(), plan.kv_spec(), plan.q_descale_spec(),
               plan.kv_descale_spec()) + sink
  result_specs = (plan.q_spec(), plan.lse_spec())

  def per_shard(q8, k8, v8, q_descale, kv_descale, *sink):
    return tuple(compute(q8, plan.select_kv(k8), plan.select_kv(v8), q_descale,
                         plan.select_kv(kv_descale, axis=1), *sink))

  return _named(mesh, arg_specs), _named(mesh, result_specs), per_shard


def bwd_partition(config: AttentionConfig, mesh, arg_shapes,
                  compute: Callable) -> tuple[tuple, tuple, Callable]:
  """custom_partitioning's decision for flash_bwd_p; `compute` returns (dq, dk, dv[, dbias])."""
  plan = plan_for(mesh, arg_shapes, _whole_dims(config))
  arg_specs, result_specs = bwd_specs(plan, config.has_segment_ids, config.bias_dims,
                                      config.mods)

  def per_shard(q, k, v, *rest):
    grads = compute(q, plan.select_kv(k), plan.select_kv(v), *rest)
    dq, dk, dv = grads[:3]
    dbias = (plan.reduce_dbias(grads[3], config.bias_dims),) if config.has_bias else ()
    return (dq, plan.reduce_dkv(dk), plan.reduce_dkv(dv)) + dbias

  return _named(mesh, arg_specs), _named(mesh, result_specs), per_shard


def _named(mesh, specs):
  return tuple(NamedSharding(mesh, s) for s in specs)



# ---------------------------------------------------------------------------------------------
# The split-KV decode call (jaxflash/decode_kernel.py): packed queries (batch, kv heads, rows,
# head_dim), caches contiguous (batch, max_len, kv heads, .) or a page pool (pages, page_size,
# kv heads, .), lengths (batch,), sinks (kv heads, query heads per kv head), the page table
# (batch, max_pages) when paged -> out (batch, kv heads, rows, head_dim_v), lse (batch, kv
# heads, rows).
ROWS, MAX_PAGES, PAGES, PAGE_ROWS = "rows", "max_pages", "pages", "page_rows"


def decode_sharding_rule(paged: bool, fp8: bool = False):
  """(rule string, keyword arguments) of the decode call (q, k, v, lengths, sink[, page_table]
  [, k_descale, v_descale]) -> (out, lse): batch and kv heads shard; a page pool shards by kv
  heads only (any sequence may own any page); FP8 caches' descales (pages or sequences, kv
  heads) shard as their caches."""
  q = f"{BATCH} {KV_HEADS} {ROWS} {HEAD_DIM}"
  cache = f"{PAGES} {PAGE_ROWS}" if paged else f"{BATCH} {SEQ_K}"
  operands = [q, f"{cache} {KV_HEADS} {HEAD_DIM}", f"{cache} {KV_HEADS} {HEAD_DIM_V}", BATCH,
              f"{KV_HEADS} {Q_PER_KV}"]
  if paged:
    operands.append(f"{BATCH} {MAX_PAGES}")
  if fp8:
    operands += [f"{PAGES if paged else BATCH} {KV_HEADS}"] * 2
  results = [f"{BATCH} {KV_HEADS} {ROWS} {HEAD_DIM_V}", f"{BATCH} {KV_HEADS} {ROWS}"]
  whole = (ROWS, HEAD_DIM, HEAD_DIM_V, Q_PER_KV) + (
      (PAGES, PAGE_ROWS, MAX_PAGES) if paged else (SEQ_K,))
  return _rule(operands, results, {}, whole)


def decode_partition(paged: bool, mesh, arg_shapes, compute: Callable,
                     fp8: bool = False) -> tuple[tuple, tuple, Callable]:
  """custom_partitioning's decision for the decode call.

  Batch: q's batch axes, else (contiguous caches) the cache's; kv heads: q's kv-head axes,
  else the cache's, those not used by batch; trailing axes drop until their size divides
  batch / kv heads. Everything else is gathered. `compute(q, k, v, page_table, lengths, sink[,
  k_descale, v_descale])` runs one shard; for contiguous caches the page table has no column
  (each shard's sequence b is its page b). FP8 caches' descales shard as their caches.
  """
  mesh_shape = dict(mesh.shape)
  q, k = arg_shapes[:2]
  known = lambda axes: tuple(a for a in axes if a in mesh_shape)
  q_axes, k_axes = _axes_of(q, 4), _axes_of(k, 4)
  batch_axes = known(q_axes[0] or (() if paged else k_axes[0]))
  batch_axes = _divisible_prefix(batch_axes, mesh_shape, lambda n: q.shape[0] % n == 0)
  head_axes = tuple(a for a in known(q_axes[1] or k_axes[2]) if a not in batch_axes)
  head_axes = _divisible_prefix(head_axes, mesh_shape, lambda n: q.shape[1] % n == 0)
  b, h = _entry(batch_axes), _entry(head_axes)
  cache = PartitionSpec(None if paged else b, None, h, None)
  args = (PartitionSpec(b, h, None, None), cache, cache, PartitionSpec(b),
          PartitionSpec(h, None))
  if paged:
    args += (PartitionSpec(b, None),)
  if fp8:
    args += (PartitionSpec(None if paged else b, h),) * 2
  results = (PartitionSpec(b, h, None, None), PartitionSpec(b, h, None))

  def per_shard(q, k, v, lengths, sink, *rest):
    # A table of no column for contiguous caches: sequence b is page b of the shard's caches.
    table = rest[0] if paged else jnp.zeros((q.shape[0], 0), jnp.int32)
    return tuple(compute(q, k, v, table, lengths, sink, *rest[int(paged):]))

  return _named(mesh, args), _named(mesh, results), per_shard
