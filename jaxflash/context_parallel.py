"""Context-parallel (ring) attention over one mesh axis, built on the public jaxflash.attention.

Uses the public API, shard_map and lax collectives only (docs/design.md): no primitives.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from jaxflash.attention import attention
from jaxflash.sink import add_learnable_sink

_PASSED_OPTIONS = ("softmax_scale", "window_size", "softcap", "deterministic", "implementation")
_ACCEPTED_OPTIONS = _PASSED_OPTIONS + ("q_segment_ids", "kv_segment_ids", "learnable_sink",
                                       "return_lse")


# ---------------------------------------------------------------------------------------------
# Static schedule

@dataclasses.dataclass(frozen=True)
class _Block:
  """One attention call of a ring step: rows [q_start, q_start+q_len) of the local queries
  against rows [k_start, k_start+k_len) of the visiting keys, with a local mask."""

  q_start: int
  q_len: int
  k_start: int
  k_len: int
  causal: bool = False
  window: tuple = (None, None)


@dataclasses.dataclass(frozen=True)
class _Ring:
  """Everything static about one ring: hashable, so it is custom_vjp's nondiff argument.

  steps[s] lists the candidate blocks of step s (None: nothing visible, skipped); device r
  runs candidate `1 if r < s else 0` (the visiting kv chunk wrapped around the ring or not).
  """

  axis_name: str
  axis_size: int
  steps: tuple
  options: tuple  # sorted (name, value) pairs passed to jaxflash.attention

  def kwargs(self, block: _Block) -> dict:
    kw = dict(self.options)
    kw.update(causal=block.causal, window_size=block.window)
    return kw


def _block_visible(c_q: int, c_k: int, delta: int, left, right) -> bool:
  """Whether any (query i, key j) of a block with key offset j - i in [delta - left,
  delta + right] (None: unbounded) exists for i < c_q, j < c_k."""
  lo = -(c_q - 1) if left is None else max(-(c_q - 1), delta - left)
  hi = c_k - 1 if right is None else min(c_k - 1, delta + right)
  return lo <= hi


def _zigzag_steps(n: int, c: int) -> tuple:
  """Causal load-balanced ring: device r holds chunks (r, 2n-1-r) of 2n, each c tokens.

  Step 0 is the local causal block. At step s the keys come from device j = (r - s) mod n:
  j < r (no wrap): both query chunks see key chunk j only; j > r (wrap): only query chunk
  2n-1-r sees anything, and it sees both key chunks. Either way 2 c x c of work: balanced.
  """
  steps = [(_Block(0, 2 * c, 0, 2 * c, causal=True),)]
  for _ in range(1, n):
    steps.append((_Block(0, 2 * c, 0, c), _Block(c, c, 0, 2 * c)))
  return tuple(steps)


def _window_steps(n: int, c: int, left, right) -> tuple:
  """Natural-order ring with a (left, right) band around the diagonal (None: unbounded).

  A visiting chunk from device r - delta sits delta*c tokens before the local queries: the
  global band [i - left, i + right] is the local band [i - (left - delta*c), i + right +
  delta*c] (negative windows shift the band, as jaxflash.attention allows). Blocks outside
  the band are skipped, and the ring stops after the last step that sees anything.
  """
  def block(delta):
    if not _block_visible(c, c, delta * c, left, right):
      return None
    w = (None if left is None else left - delta * c, None if right is None else right + delta * c)
    return _Block(0, c, 0, c, window=w)

  steps = [(block(0),)] + [(block(s), block(s - n)) for s in range(1, n)]
  while len(steps) > 1 and all(b is None for b in steps[-1]):
    steps.pop()
  return tuple(steps)


def _plain_steps(n: int, c_q: int, c_k: int) -> tuple:
  return tuple((_Block(0, c_q, 0, c_k),) for _ in range(n))


# ---------------------------------------------------------------------------------------------
# One block, forward and backward

def _slice(x, start, length, axis=1):
  return None if x is None else lax.slice_in_dim(x, start, start + length, axis=axis)


def _pad_rows(x, start, total, axis, value):
  pad = [(0, 0)] * x.ndim
  pad[axis] = (start, total - start - x.shape[axis])
  return jnp.pad(x, pad, constant_values=value)


def _acc_dtype(x):
  """Accumulate in float32, or wider for wider inputs (float64 test runs)."""
  return jnp.promote_types(x.dtype, jnp.float32)


def _run_block(ring, block, q, k, v, q_seg, kv_seg):
  """(out (b, tq, h, dv), lse (b, h, tq)) of one block in the accumulation dtype, padded to
  all local query rows."""
  seg = {}
  if q_seg is not None:
    seg = dict(q_segment_ids=_slice(q_seg, block.q_start, block.q_len),
               kv_segment_ids=_slice(kv_seg, block.k_start, block.k_len))
  out, lse = attention(_slice(q, block.q_start, block.q_len),
                       _slice(k, block.k_start, block.k_len),
                       _slice(v, block.k_start, block.k_len),
                       return_lse=True, **seg, **ring.kwargs(block))
  tq = q.shape[1]
  acc = _acc_dtype(q)
  return (_pad_rows(out.astype(acc), block.q_start, tq, 1, 0.0),
          _pad_rows(lse.astype(acc), block.q_start, tq, 2, -jnp.inf))


def _empty_out(q, v):
  b, tq, h, _ = q.shape
  acc = _acc_dtype(q)
  return jnp.zeros((b, tq, h, v.shape[-1]), acc), jnp.full((b, h, tq), -jnp.inf, acc)


def _weight(lse_part, lse_total):
  """exp(lse_part - lse_total), 0 where the part (or the whole row) saw no key."""
  ok = jnp.isfinite(lse_part) & jnp.isfinite(lse_total)
  return jnp.where(ok, jnp.exp(jnp.where(ok, lse_part - lse_total, 0.0)), 0.0)


def _to_rows(w):
  """(b, h, t) -> (b, t, h, 1), to scale an output laid out (b, t, h, d)."""
  return jnp.swapaxes(w, 1, 2)[..., None]


def _block_grad(ring, block, q, k, v, q_seg, kv_seg, out, lse, d_out, d_lse):
  """(dq, dk, dv) of one block's share of the loss, accumulation dtype, local shapes.

  The global output is sum_j w_j out_j with w_j = exp(lse_j - lse): the block receives
  d out_j = w_j d_out and d lse_j = w_j (d_out . (out_j - out) + d_lse), and its own VJP
  (which recomputes the block forward) turns those into dq, dk, dv.
  """
  rows = lambda x, axis=1: _slice(x, block.q_start, block.q_len, axis)
  cols = lambda x: _slice(x, block.k_start, block.k_len)
  seg = {}
  if q_seg is not None:
    seg = dict(q_segment_ids=rows(q_seg), kv_segment_ids=cols(kv_seg))
  fn = lambda q_, k_, v_: attention(q_, k_, v_, return_lse=True, **seg, **ring.kwargs(block))
  (out_j, lse_j), vjp = jax.vjp(fn, rows(q), cols(k), cols(v))
  acc = _acc_dtype(q)
  w = _weight(lse_j.astype(acc), rows(lse, 2))
  d_out_b = rows(d_out).astype(acc)
  d_out_j = (_to_rows(w) * d_out_b).astype(out_j.dtype)
  dot = jnp.sum(d_out_b * (out_j.astype(acc) - rows(out).astype(acc)), -1)
  d_lse_j = w * (jnp.swapaxes(dot, 1, 2) + rows(d_lse, 2))
  dq, dk, dv = vjp((d_out_j, d_lse_j.astype(lse_j.dtype)))
  tq, tk = q.shape[1], k.shape[1]
  return (_pad_rows(dq.astype(acc), block.q_start, tq, 1, 0.0),
          _pad_rows(dk.astype(acc), block.k_start, tk, 1, 0.0),
          _pad_rows(dv.astype(acc), block.k_start, tk, 1, 0.0))


def _zero_grads(q, k, v):
  zeros = lambda x: jnp.zeros(x.shape, _acc_dtype(q))
  return zeros(q), zeros(k), zeros(v)


def _ids_meet(block, q_seg, kv_seg):
  """Whether some query of the block can share a segment id with some key of it (their id
  spans [min, max] overlap in some batch row): a traced bool; False skips the block."""
  q_ids = _slice(q_seg, block.q_start, block.q_len)
  kv_ids = _slice(kv_seg, block.k_start, block.k_len)
  meet = ((jnp.min(q_ids, axis=1) <= jnp.max(kv_ids, axis=1))
          & (jnp.min(kv_ids, axis=1) <= jnp.max(q_ids, axis=1)))
  return jnp.any(meet)


def _step(ring, s, fn, empty, q_seg=None, kv_seg=None):
  """Runs fn(block) for this device's candidate of step s, empty() for a block the schedule
  skips (outside the band) or, with segment ids, one where no query meets a key of its id
  (packed documents: the chunks of other documents)."""
  def run(b):
    if b is None:
      return empty
    if q_seg is None:
      return functools.partial(fn, b)
    return lambda: lax.cond(_ids_meet(b, q_seg, kv_seg), functools.partial(fn, b), empty)

  branches = [run(b) for b in ring.steps[s]]
  if len(branches) == 1:
    return branches[0]()
  wrapped = lax.axis_index(ring.axis_name) < s
  return lax.switch(wrapped.astype(jnp.int32), [lambda f=f: f() for f in branches])


# ---------------------------------------------------------------------------------------------
# The ring: forward, and a backward that rotates dk/dv with the keys (custom_vjp)

def _shift(ring, x, by=1):
  n = ring.axis_size
  perm = [(i, (i + by) % n) for i in range(n)]
  return jax.tree.map(lambda a: None if a is None else lax.ppermute(a, ring.axis_name, perm), x)


def _ring_forward(ring, q, k, v, q_seg, kv_seg):
  o_acc, lse_acc = _empty_out(q, v)
  kv = (k, v, kv_seg)
  for s in range(len(ring.steps)):
    # Send the next keys before computing this step: the transfer overlaps the compute.
    kv_next = _shift(ring, kv) if s + 1 < len(ring.steps) else None
    o_s, lse_s = _step(ring, s, lambda b: _run_block(ring, b, q, *kv[:2], q_seg, kv[2]),
                       lambda: _empty_out(q, v), q_seg, kv[2])
    lse_new = jnp.logaddexp(lse_acc, lse_s)  # -inf where both are -inf
    o_acc = (o_acc * _to_rows(_weight(lse_acc, lse_new))
             + o_s * _to_rows(_weight(lse_s, lse_new)))
    lse_acc, kv = lse_new, kv_next
  return o_acc.astype(q.dtype), lse_acc.astype(jnp.promote_types(q.dtype, jnp.float32))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring_attention(ring, q, k, v, q_seg, kv_seg):
  return _ring_forward(ring, q, k, v, q_seg, kv_seg)


def _ring_fwd(ring, q, k, v, q_seg, kv_seg):
  out, lse = _ring_forward(ring, q, k, v, q_seg, kv_seg)
  return (out, lse), (q, k, v, q_seg, kv_seg, out, lse)


def _ring_bwd(ring, residuals, cotangents):
  q, k, v, q_seg, kv_seg, out, lse = residuals
  d_out, d_lse = cotangents
  acc = _acc_dtype(q)
  d_lse = jnp.zeros(lse.shape, acc) if d_lse is None else d_lse.astype(acc)
  dq, kv = jnp.zeros(q.shape, acc), (k, v, kv_seg)
  dkv = (jnp.zeros(k.shape, acc), jnp.zeros(v.shape, acc))
  last = len(ring.steps) - 1
  for s in range(last + 1):
    kv_next = _shift(ring, kv) if s < last else None
    grads = _step(ring, s,
                  lambda b: _block_grad(ring, b, q, *kv[:2], q_seg, kv[2], out, lse, d_out, d_lse),
                  lambda: _zero_grads(q, k, v), q_seg, kv[2])
    dq = dq + grads[0]
    dkv = (dkv[0] + grads[1], dkv[1] + grads[2])
    if s < last:  # dk/dv accumulators travel with the keys they belong to
      dkv, kv = _shift(ring, dkv), kv_next
  if last:  # back to the owner: the chunk of device r - last is here
    dkv = _shift(ring, dkv, by=-last)
  return (dq.astype(q.dtype), dkv[0].astype(k.dtype), dkv[1].astype(v.dtype), None, None)


_ring_attention.defvjp(_ring_fwd, _ring_bwd)


# ---------------------------------------------------------------------------------------------
# Zig-zag token order: device r holds chunks r and 2n-1-r of 2n (natural order holds 2r, 2r+1)

def _zigzag_home(chunk: int, n: int) -> int:
  return chunk if chunk < n else 2 * n - 1 - chunk


def _to_zigzag(x, axis_name, n, axis):
  """Natural -> zig-zag along `axis`. Each device receives one even and one odd chunk."""
  if x is None:
    return None
  even, odd = jnp.split(x, 2, axis=axis)
  even = lax.ppermute(even, axis_name, [(r, _zigzag_home(2 * r, n)) for r in range(n)])
  odd = lax.ppermute(odd, axis_name, [(r, _zigzag_home(2 * r + 1, n)) for r in range(n)])
  r_even = lax.axis_index(axis_name) % 2 == 0  # chunk r (slot 0) is even iff r is
  return jnp.where(r_even, jnp.concatenate([even, odd], axis), jnp.concatenate([odd, even], axis))


def _from_zigzag(x, axis_name, n, axis):
  """Zig-zag -> natural along `axis` (the inverse of _to_zigzag)."""
  first, second = jnp.split(x, 2, axis=axis)
  r_even = lax.axis_index(axis_name) % 2 == 0
  even, odd = jnp.where(r_even, first, second), jnp.where(r_even, second, first)
  even = lax.ppermute(even, axis_name, [(_zigzag_home(2 * r, n), r) for r in range(n)])
  odd = lax.ppermute(odd, axis_name, [(_zigzag_home(2 * r + 1, n), r) for r in range(n)])
  return jnp.concatenate([even, odd], axis)


# ---------------------------------------------------------------------------------------------
# Public entry point

def _shard_map(fn, mesh, in_specs, out_specs):
  # check_vma off: the ring's lax.switch on axis_index mixes varying and invariant values.
  if hasattr(jax, "shard_map"):
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
  from jax.experimental.shard_map import shard_map  # jax < 0.6
  return shard_map(fn, mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


def _visible_axes(x, dim: int):
  """Mesh axes sharding dimension `dim` of x, where they can be seen at trace time."""
  sharding = getattr(x, "sharding", None)  # concrete jax.Array
  if sharding is None:
    try:
      sharding = jax.typeof(x).sharding  # explicit-sharding mode inside jit
    except Exception:  # noqa: BLE001 - an aval without sharding info: nothing visible
      return ()
  spec = getattr(sharding, "spec", None)
  if spec is None or len(spec) <= dim or spec[dim] is None:
    return ()
  entry = spec[dim]
  return (entry,) if isinstance(entry, str) else tuple(entry)


def _axes_arg(name, value, mesh, axis_name):
  if value is None:
    return None
  axes = (value,) if isinstance(value, str) else tuple(value)
  for a in axes:
    if a not in mesh.axis_names or a == axis_name:
      raise ValueError(f"{name}: mesh axis {a!r} is not usable; accepted: axes of the mesh "
                       f"other than axis_name {axis_name!r}: "
                       f"{[n for n in mesh.axis_names if n != axis_name]}")
  return axes


def _choose_axes(mesh, axis_name, batch_axes, head_axes, query, key):
  """(batch axes, head axes): the arguments if given, else what the query's sharding shows
  (trailing axes that do not divide drop); heads must divide into whole kv heads."""
  sizes = dict(mesh.shape)
  size = lambda axes: math.prod(sizes[a] for a in axes)
  explicit_b, explicit_h = batch_axes is not None, head_axes is not None
  usable = lambda axes: tuple(a for a in axes if a in sizes and a != axis_name)
  if not explicit_b:
    batch_axes = usable(_visible_axes(query, 0))
  if not explicit_h:
    head_axes = tuple(a for a in usable(_visible_axes(query, 2)) if a not in batch_axes)
  batch, heads, kv_heads = query.shape[0], query.shape[2], key.shape[2]
  checks = (("batch_axes", batch_axes, explicit_b, lambda n: batch % n == 0,
             f"a size dividing batch {batch}"),
            ("head_axes", head_axes, explicit_h,
             lambda n: heads % n == 0 and kv_heads % n == 0,
             f"a size dividing num_heads {heads} and num_kv_heads {kv_heads}"))
  out = []
  for name, axes, explicit, ok, accepted in checks:
    if explicit and not ok(size(axes)):
      raise ValueError(f"{name}: {axes!r} has size {size(axes)}; accepted: {accepted}")
    while not ok(size(axes)):
      axes = axes[:-1]
    out.append(axes)
  if set(out[0]) & set(out[1]):
    raise ValueError(f"head_axes: {out[1]!r} overlaps batch_axes {out[0]!r}")
  return tuple(out)


def _check_mesh(mesh, axis_name, options):
  if not (hasattr(mesh, "axis_names") and hasattr(mesh, "shape")):
    raise TypeError(f"mesh: expected a jax.sharding.Mesh, got {type(mesh).__name__}")
  if axis_name not in mesh.axis_names:
    raise ValueError(f"axis_name: {axis_name!r} is not an axis of the mesh; accepted: "
                     f"{list(mesh.axis_names)}")
  unknown = sorted(set(options) - set(_ACCEPTED_OPTIONS))
  if unknown:
    raise TypeError(f"context_parallel_attention: unexpected keyword argument(s) {unknown}; "
                    f"accepted: mesh, axis_name, causal, batch_axes, head_axes, "
                    f"{', '.join(_ACCEPTED_OPTIONS)}")


def _check_ring_shapes(mesh, axis_name, causal, query, key, options):
  """(axis size, window) after checking the sequence lengths against the ring layout."""
  n = mesh.shape[axis_name]
  seq_q, seq_k = query.shape[1], key.shape[1]
  window = tuple(options.get("window_size", (None, None)))
  positional = causal or window != (None, None)
  if positional and seq_q != seq_k:
    raise ValueError(f"key: with causal or window_size, context_parallel_attention needs "
                     f"seq_k == seq_q (self-attention), got seq_q {seq_q}, seq_k {seq_k}")
  chunks = 2 * n if causal and window == (None, None) else n
  for name, seq in (("query", seq_q), ("key", seq_k)):
    if seq % chunks:
      what = "2 x " if chunks == 2 * n else ""
      raise ValueError(f"{name}: sequence length {seq} must be a multiple of {what}the size "
                       f"{n} of mesh axis {axis_name!r} (= {chunks}) for "
                       f"{'causal zig-zag' if chunks == 2 * n else 'ring'} attention")
  return n, window


def context_parallel_attention(query, key, value, *, mesh, axis_name, causal: bool = False,
                               batch_axes=None, head_axes=None, **attention_kwargs):
  """jaxflash.attention with the sequence sharded over mesh axis `axis_name` (ring attention).

  Each device keeps its chunk of queries and passes key/value chunks around the ring
  (lax.ppermute, sent one step ahead so the transfer overlaps the compute); partial results
  merge through their log-sum-exp. Causal attention runs on a zig-zag token layout (device r
  computes chunks r and 2n-1-r of 2n) so every device does the same work; blocks that the
  mask hides are skipped. The backward pass rotates dk/dv accumulators with the keys and keeps
  only the local chunk's activations. Tokens are in natural order in and out.

  Args:
    query: (batch, seq_q, num_heads, head_dim), sharded (or to be sharded) along seq over
      `axis_name`.
    key: (batch, seq_k, num_kv_heads, head_dim).
    value: (batch, seq_k, num_kv_heads, head_dim_v).
    mesh: the jax.sharding.Mesh holding `axis_name`.
    axis_name: the mesh axis of the sequence shards (size n). seq must be a multiple of 2n
      for causal (zig-zag) and of n otherwise.
    causal: as in jaxflash.attention (needs seq_k == seq_q here).
    batch_axes: mesh axes that shard the batch (None: those the query's sharding shows at
      trace time, i.e. on concrete arrays or explicit-sharding meshes; else none).
    head_axes: mesh axes that shard the heads of q and of k/v alike (None: as batch_axes).
      Their size must divide num_kv_heads.
    **attention_kwargs: softmax_scale, window_size (needs seq_k == seq_q; bands are skipped
      block by block and the ring stops once the band is passed), softcap, q_segment_ids and
      kv_segment_ids (batch, seq) sharded like the tokens (the key ids travel around the ring
      with their keys; a block where no query id meets a key id, e.g. another device's packed
      documents, is skipped at run time), learnable_sink (applied once, to the merged result of
      the ring: the ring steps compute attention without it), deterministic, return_lse,
      implementation: as in jaxflash.attention.

  Returns:
    out (batch, seq_q, num_heads, head_dim_v), or (out, lse) with return_lse=True; sharded
    like the query along seq.
  """
  _check_mesh(mesh, axis_name, attention_kwargs)
  q_seg = attention_kwargs.pop("q_segment_ids", None)
  kv_seg = attention_kwargs.pop("kv_segment_ids", None)
  return_lse = attention_kwargs.pop("return_lse", False)
  sink = attention_kwargs.pop("learnable_sink", None)
  # The public API checks every argument on the global shapes (named errors, no ring yet).
  jax.eval_shape(functools.partial(attention, causal=causal, q_segment_ids=q_seg,
                                   kv_segment_ids=kv_seg, learnable_sink=sink,
                                   **attention_kwargs),
                 query, key, value)
  n, window = _check_ring_shapes(mesh, axis_name, causal, query, key, attention_kwargs)
  batch_axes = _axes_arg("batch_axes", batch_axes, mesh, axis_name)
  head_axes = _axes_arg("head_axes", head_axes, mesh, axis_name)
  batch_axes, head_axes = _choose_axes(mesh, axis_name, batch_axes, head_axes, query, key)

  c_q, c_k = query.shape[1] // n, key.shape[1] // n
  zigzag = causal and window == (None, None) and n > 1
  if zigzag:
    steps = _zigzag_steps(n, c_q // 2)
  elif causal or window != (None, None):
    right = window[1]
    if causal:  # causal = a band that ends at the diagonal
      right = 0 if right is None else min(right, 0)
    steps = _window_steps(n, c_q, window[0], right)
  else:
    steps = _plain_steps(n, c_q, c_k)
  options = tuple(sorted((k, v) for k, v in attention_kwargs.items() if k in _PASSED_OPTIONS
                         and k != "window_size"))
  ring = _Ring(axis_name=axis_name, axis_size=n, steps=steps, options=options)

  b = None if not batch_axes else (batch_axes[0] if len(batch_axes) == 1 else batch_axes)
  h = None if not head_axes else (head_axes[0] if len(head_axes) == 1 else head_axes)
  tokens = PartitionSpec(b, axis_name, h, None)
  seg_spec = PartitionSpec(b, axis_name)
  lse_spec = PartitionSpec(b, h, axis_name)

  def local(q, k, v, q_seg, kv_seg):
    if zigzag:
      q, k, v, q_seg, kv_seg = (_to_zigzag(x, axis_name, n, 1) for x in (q, k, v, q_seg, kv_seg))
    out, lse = _ring_attention(ring, q, k, v, q_seg, kv_seg)
    if zigzag:
      out, lse = _from_zigzag(out, axis_name, n, 1), _from_zigzag(lse, axis_name, n, 2)
    return out, lse

  seg_specs = (seg_spec, seg_spec) if q_seg is not None else (None, None)
  mapped = _shard_map(local, mesh, (tokens, tokens, tokens) + seg_specs, (tokens, lse_spec))
  if q_seg is not None:
    q_seg, kv_seg = jnp.asarray(q_seg, jnp.int32), jnp.asarray(kv_seg, jnp.int32)
  out, lse = mapped(query, key, value, q_seg, kv_seg)
  if sink is not None:
    # Once, on the merged rows: a sink in every step's partial result would count n times.
    out, lse = add_learnable_sink(out, lse, sink)
  return (out, lse) if return_lse else out
