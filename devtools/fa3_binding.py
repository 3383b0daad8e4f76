"""FlashAttention-3's own Hopper kernels as a benchmark peer: a JAX binding of the XLA FFI
targets in `libdew_flash_attn3.so` (the `dew-flash-attn-cu13` wheel, sm90a). Benchmarks only;
jaxflash never imports it.

The library exports four XLA FFI handlers, `dew_flash3_mha_fwd`, `_bwd`, `_varlen_fwd` and
`_varlen_bwd`. It is found at $JAXFLASH_FA3_LIBRARY, else next to an installed `dew_flash_attn`
package (located without importing it: its module also loads a 337 MB FlashAttention-2
library). Carry the 17.8 MB library alone to a GPU host and point the variable at it.

What the targets take (read off the wheel's own Python module, 0.3.6):
- forward: q, k, v (batch, seq, heads, head_dim), k / v with fewer heads for GQA; results out
  (like q), lse float32 (batch, heads, seq_q), and two scratch results of shapes (1, 1, 1, 1)
  and (1, 1, 1) float32; attributes softmax_scale (f64), is_causal (bool), window_size_left /
  window_size_right (i64, -1 = unbounded; FlashAttention's convention, causal aligned to the
  last key). Varlen: packed q, k, v (tokens, heads, head_dim) and int32 cumulative offsets of
  the queries and the keys (documents + 1,), attributes max_seqlen / max_seqlen_k (i64); lse
  is (heads, tokens).
- backward: d_out, q, k, v, out, lse (the forward's layout), [offsets]; results dq, dk, dv (dk
  and dv per kv head) and two float32 scratch vectors of heads * (tokens + 128 * (documents +
  1)) elements (its per-row buffers, each document's rows rounded up to the kernel's row
  block); the forward's attributes.
- head dims up to 256 and multiples of 8; bf16 or fp16.
Learnable sinks are not a kernel feature: `attention` applies them outside the kernel (the
output scaled by each row's share e^lse / (e^lse + e^sink), and the backward run on the
sink-adjusted lse), as FA-3's users do.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import importlib.util
import os
import sys
from pathlib import Path
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

LIBRARY_ENV = "JAXFLASH_FA3_LIBRARY"
LIBRARY_NAME = "libdew_flash_attn3.so"
PACKAGE = "dew_flash_attn"
TARGETS = tuple(f"dew_flash3_mha{s}" for s in ("_fwd", "_bwd", "_varlen_fwd", "_varlen_bwd"))
DTYPES = ("bfloat16", "float16")
MAX_HEAD_DIM = 256
# Rows of the backward's per-row scratch beyond the tokens: each document's rows round up to
# the kernel's row block (at most 128), plus one block.
_SCRATCH_ROW_BLOCK = 128


def library_path() -> Optional[Path]:
  """$JAXFLASH_FA3_LIBRARY, else the library beside an installed dew_flash_attn; None if
  neither exists."""
  env = os.environ.get(LIBRARY_ENV)
  if env:
    return Path(env) if Path(env).is_file() else None
  spec = importlib.util.find_spec(PACKAGE)
  if spec is None or not spec.submodule_search_locations:
    return None
  path = Path(next(iter(spec.submodule_search_locations))) / LIBRARY_NAME
  return path if path.is_file() else None


def availability() -> tuple[bool, str]:
  """(True, the library's path) when the binding can run here, else (False, why not): the
  benchmarks print the reason in place of the column."""
  path = library_path()
  if path is None:
    where = os.environ.get(LIBRARY_ENV)
    return False, (f"FlashAttention-3 not found: {LIBRARY_ENV}={where!r} is no file" if where
                   else f"FlashAttention-3 not found: set {LIBRARY_ENV} to {LIBRARY_NAME} (the "
                        f"dew-flash-attn-cu13 wheel) or install that wheel")
  try:
    devices = jax.devices()
  except RuntimeError as e:
    return False, f"FlashAttention-3 needs a GPU: {e}"
  kind = devices[0].platform
  if kind != "gpu" or getattr(devices[0], "compute_capability", "") != "9.0":
    return False, (f"FlashAttention-3's library holds sm90a code only; the device here is "
                   f"{devices[0].device_kind}")
  return True, str(path)


def _preload_cudart() -> None:
  """Loads a libcudart.so.13 from the NVIDIA wheels on sys.path (jax's CUDA plugin ships one)
  so that the library's dependency resolves without LD_LIBRARY_PATH."""
  for entry in sys.path:
    for lib in sorted(glob.glob(os.path.join(entry, "nvidia", "*", "lib", "libcudart.so.13"))):
      ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
      return


@functools.cache
def register() -> Path:
  """Loads the library and registers its four targets with jax (once per process)."""
  ok, where = availability()
  if not ok:
    raise RuntimeError(where)
  try:
    library = ctypes.CDLL(where)
  except OSError:
    _preload_cudart()
    library = ctypes.CDLL(where)
  for name in TARGETS:
    jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(library, name)),
                                platform="CUDA")
  return Path(where)


class Call(NamedTuple):
  """One custom call: the target, its results (shape, dtype) in order, its attributes."""
  target: str
  results: tuple
  attributes: dict


def _window(window_size, causal: bool) -> tuple[int, int]:
  """jaxflash's (left, right), None = unbounded, as FlashAttention's (left, right), -1 =
  unbounded. Both align causal and windows to the last key and count the same keys."""
  left, right = window_size
  left = -1 if left is None else int(left)
  right = -1 if right is None else int(right)
  if min(left, right) < -1:
    raise ValueError(f"window_size: {window_size} has a negative side; accepted: None or >= 0")
  if causal:
    right = 0 if right == -1 else min(right, 0)
  return left, right


def _attributes(softmax_scale: float, causal: bool, window_size, max_seqlens) -> dict:
  """The targets' attributes, typed as they bind them (f64 scale, i64 window sides and, packed,
  i64 longest documents)."""
  left, right = _window(window_size, causal)
  attributes = dict(softmax_scale=np.float64(softmax_scale), is_causal=bool(causal),
                    window_size_left=np.int64(left), window_size_right=np.int64(right))
  if max_seqlens is not None:
    attributes.update(max_seqlen=np.int64(max_seqlens[0]), max_seqlen_k=np.int64(max_seqlens[1]))
  return attributes


def _check(q_shape, k_shape, v_shape, dtype, rank: int) -> None:
  """Raises ValueError unless the targets take these operands (their kernels read k and v with
  q's strides: a mismatch would read out of bounds, not fail)."""
  name = np.dtype(dtype).name
  if name not in DTYPES:
    raise ValueError(f"dtype: {name}; FlashAttention-3's targets take {DTYPES}")
  if len(q_shape) != rank or len(k_shape) != rank or tuple(k_shape) != tuple(v_shape):
    raise ValueError(f"q, k, v: rank-{rank} operands with k and v of one shape expected, got "
                     f"{q_shape}, {k_shape}, {v_shape}")
  if rank == 4 and q_shape[0] != k_shape[0]:
    raise ValueError(f"q, k: batch {q_shape[0]} != {k_shape[0]}")
  head_dim, heads, kv_heads = q_shape[-1], q_shape[-2], k_shape[-2]
  if k_shape[-1] != head_dim or head_dim % 8 or head_dim > MAX_HEAD_DIM:
    raise ValueError(f"head_dim: q {head_dim}, k {k_shape[-1]}; accepted: one head_dim, a "
                     f"multiple of 8 up to {MAX_HEAD_DIM} (head_dim_v = head_dim)")
  if kv_heads < 1 or heads % kv_heads:
    raise ValueError(f"heads: {heads} query heads on {kv_heads} kv heads; the kv heads must "
                     f"divide the query heads")


def fwd_call(q_shape, k_shape, v_shape, dtype, *, causal: bool, softmax_scale: float,
             window_size=(None, None), max_seqlens=None) -> Call:
  """The forward custom call of (batch, seq, heads, head_dim) operands, or with max_seqlens =
  (most queries, most keys) of a document, of packed (tokens, heads, head_dim) ones."""
  packed = max_seqlens is not None
  _check(q_shape, k_shape, v_shape, dtype, 3 if packed else 4)
  heads = q_shape[-2]
  lse = (heads, q_shape[0]) if packed else (q_shape[0], heads, q_shape[1])
  results = ((tuple(q_shape), np.dtype(dtype)), (lse, np.dtype(np.float32)),
             ((1, 1, 1, 1), np.dtype(np.float32)), ((1, 1, 1), np.dtype(np.float32)))
  return Call(TARGETS[2] if packed else TARGETS[0], results,
              _attributes(softmax_scale, causal, window_size, max_seqlens))


def bwd_call(q_shape, k_shape, v_shape, dtype, *, causal: bool, softmax_scale: float,
             window_size=(None, None), max_seqlens=None, documents: Optional[int] = None) -> Call:
  """The backward custom call (documents: the packed call's document count)."""
  packed = max_seqlens is not None
  _check(q_shape, k_shape, v_shape, dtype, 3 if packed else 4)
  if packed and documents is None:
    raise ValueError("documents: a packed backward needs its document count")
  tokens, sequences = ((q_shape[0], documents) if packed
                       else (q_shape[0] * q_shape[1], q_shape[0]))
  rows = q_shape[-2] * (tokens + _SCRATCH_ROW_BLOCK * (sequences + 1))
  scratch = ((rows,), np.dtype(np.float32))
  results = ((tuple(q_shape), np.dtype(dtype)), (tuple(k_shape), np.dtype(dtype)),
             (tuple(v_shape), np.dtype(dtype)), scratch, scratch)
  return Call(TARGETS[3] if packed else TARGETS[1], results,
              _attributes(softmax_scale, causal, window_size, max_seqlens))


def _ffi(call: Call, *operands):
  shapes = tuple(jax.ShapeDtypeStruct(s, d) for s, d in call.results)
  return jax.ffi.ffi_call(call.target, shapes)(*operands, **call.attributes)


def _forward(q, k, v, offsets, options):
  call = fwd_call(q.shape, k.shape, v.shape, q.dtype, **options._asdict())
  out, lse, _, _ = _ffi(call, q, k, v, *offsets)
  return out, lse


def _backward(d_out, q, k, v, out, lse, offsets, options):
  documents = offsets[0].shape[0] - 1 if offsets else None
  call = bwd_call(q.shape, k.shape, v.shape, q.dtype, documents=documents,
                  **options._asdict())
  dq, dk, dv, _, _ = _ffi(call, d_out, q, k, v, out, lse, *offsets)
  return dq, dk, dv


def _rows(lse, packed: bool):
  """lse (the kernel's layout) in out's row order with heads last: (batch, seq, heads) or
  (tokens, heads)."""
  return lse.T if packed else jnp.swapaxes(lse, 1, 2)


class _Options(NamedTuple):
  """The static options of one call (custom_vjp's hashable nondiff argument)."""
  causal: bool
  softmax_scale: float
  window_size: tuple
  max_seqlens: Optional[tuple] = None


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _attend(q, k, v, sink, offsets, options):
  return _attend_fwd(q, k, v, sink, offsets, options)[0]


def _attend_fwd(q, k, v, sink, offsets, options):
  out, lse = _forward(q, k, v, offsets, options)
  if sink is not None:
    # The sink joins each row's denominator: lse becomes log(e^lse + e^sink) and out scales by
    # e^lse / (e^lse + e^sink). The kernel's backward recomputes P from the lse it is given, so
    # with this lse and out it differentiates the sink softmax.
    sunk = jnp.logaddexp(lse, sink.astype(jnp.float32)[:, None])
    kept = jnp.exp(_rows(lse - sunk, bool(offsets)))[..., None]
    out = (out.astype(jnp.float32) * kept).astype(out.dtype)
    lse = sunk
  return out, (q, k, v, sink, offsets, out, lse)


def _attend_bwd(options, residuals, d_out):
  q, k, v, sink, offsets, out, lse = residuals
  dq, dk, dv = _backward(d_out, q, k, v, out, lse, offsets, options)
  d_sink = None
  if sink is not None:
    # Row r's output is -w_r out_r per unit of sink, w_r = e^sink / (e^lse + e^sink) the sink's
    # weight: d sink = -sum_r w_r (dO_r . out_r).
    weight = jnp.exp(sink.astype(jnp.float32) - _rows(lse, bool(offsets)))
    along = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    d_sink = -jnp.sum(weight * along, axis=tuple(range(along.ndim - 1))).astype(sink.dtype)
  d_offsets = tuple(np.zeros(o.shape, jax.dtypes.float0) for o in offsets)
  return dq, dk, dv, d_sink, d_offsets


_attend.defvjp(_attend_fwd, _attend_bwd)


def attention(q, k, v, *, causal: bool = False, softmax_scale: Optional[float] = None,
              window_size=(None, None), learnable_sink=None):
  """FA-3's attention of (batch, seq, heads, head_dim) operands with jaxflash.attention's
  meaning of causal, softmax_scale, window_size and learnable_sink; differentiable (forward
  and backward kernels, the sink's gradient in XLA). register() must have run."""
  scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
  options = _Options(bool(causal), scale, tuple(window_size))
  return _attend(q, k, v, learnable_sink, (), options)


def varlen_attention(q, k, v, cu_seqlens, max_seqlen: int, *, causal: bool = False,
                     softmax_scale: Optional[float] = None, window_size=(None, None)):
  """FA-3's attention within the documents packed in (tokens, heads, head_dim) operands:
  document i holds tokens [cu_seqlens[i], cu_seqlens[i + 1]) (int32, documents + 1), none
  longer than max_seqlen; queries and keys share the offsets. register() must have run."""
  scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
  offsets = jnp.asarray(cu_seqlens, jnp.int32)
  options = _Options(bool(causal), scale, tuple(window_size), (int(max_seqlen),) * 2)
  return _attend(q, k, v, None, (offsets, offsets), options)


def _values(fn, inputs, extra, cotangent) -> dict:
  """out and the gradients of sum(out * cotangent) by q, k, v, as float64 numpy arrays."""
  loss = lambda *a: jnp.sum(fn(*a, *extra).astype(jnp.float64) * cotangent)
  out, grads = jax.jit(lambda *a: (fn(*a, *extra), jax.grad(loss, argnums=(0, 1, 2))(*a)))(
      *inputs)
  return {name: np.asarray(x, np.float64) for name, x in zip(("out", "dq", "dk", "dv"),
                                                                (out,) + tuple(grads))}


def _relative_l2(a, want) -> float:
  return float(np.linalg.norm(a - want) / np.linalg.norm(want))


def check(seed: int = 0) -> list[tuple[str, str, float, float]]:
  """FA-3 through this binding and jaxflash (its kernels where they run) against a float64
  oracle (jaxflash's reference path in float64) on small shapes of each kind the benchmarks
  run: dense causal GQA, a window with sinks, packed documents, head_dim 256. Returns (case,
  output, FA-3 rel. L2, jaxflash rel. L2) for out, dq, dk and dv. Needs x64 enabled."""
  import jaxflash  # the oracle, and the kernels beside FA-3
  register()
  rng = np.random.default_rng(seed)
  rows = []

  def compare(name, fa3_fn, options, shapes, extra=()):
    arrays = [rng.standard_normal(s) for s in shapes]
    cotangent = rng.standard_normal(shapes[0][:-1] + (shapes[2][-1],))
    ours_fn = lambda q, k, v, *e: jaxflash.attention(q, k, v, **options, **_sink_kwarg(e))
    oracle_fn = lambda q, k, v, *e: jaxflash.attention(q, k, v, implementation="reference",
                                                       **options, **_sink_kwarg(e))
    low = [jnp.asarray(a, jnp.bfloat16) for a in arrays]
    want = _values(oracle_fn, [jnp.asarray(a, jnp.float64) for a in arrays], extra, cotangent)
    theirs = _values(fa3_fn, low, extra, cotangent)
    ours = _values(ours_fn, low, extra, cotangent)
    rows.extend((name, key, _relative_l2(theirs[key], w), _relative_l2(ours[key], w))
                for key, w in want.items())

  h, hk = 8, 2
  compare("d128 causal GQA 8/2, b2 x 1000", lambda q, k, v: attention(q, k, v, causal=True),
          dict(causal=True), [(2, 1000, h, 128), (2, 1000, hk, 128), (2, 1000, hk, 128)])
  sink = jnp.asarray(rng.standard_normal(h), jnp.float32)
  compare("d64 causal window 128 + sinks, 700",
          lambda q, k, v, sk: attention(q, k, v, causal=True, window_size=(128, 0),
                                        learnable_sink=sk),
          dict(causal=True, window_size=(128, 0)),
          [(1, 700, h, 64), (1, 700, hk, 64), (1, 700, hk, 64)], extra=(sink,))
  lengths = [300, 17, 700, 1]
  offsets = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
  ids = jnp.asarray([np.repeat(np.arange(len(lengths)), lengths)], jnp.int32)

  def packed(q, k, v):
    fold = lambda x: x.reshape(-1, *x.shape[2:])
    out = varlen_attention(fold(q), fold(k), fold(v), offsets, max(lengths), causal=True)
    return out.reshape(q.shape[:2] + out.shape[1:])
  compare("d128 packed 300 / 17 / 700 / 1, causal", packed,
          dict(causal=True, q_segment_ids=ids, kv_segment_ids=ids),
          [(1, sum(lengths), h, 128)] * 3)
  compare("d256 not causal, 513", lambda q, k, v: attention(q, k, v), {},
          [(1, 513, 4, 256)] * 3)
  return rows


def _sink_kwarg(extra) -> dict:
  return {"learnable_sink": extra[0]} if extra else {}


if __name__ == "__main__":
  import argparse
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--check", action="store_true",
                      help="FA-3 and jaxflash against a float64 oracle on small shapes")
  cli = parser.parse_args()
  ok, where = availability()
  print(f"FA-3: {where}")
  if cli.check and ok:
    jax.config.update("jax_enable_x64", True)
    print("| case | output | FA-3 rel. L2 | jaxflash rel. L2 |\n|---|---|---|---|")
    for case, output, theirs, ours_err in check():
      print(f"| {case} | {output} | {theirs:.2e} | {ours_err:.2e} |")
  sys.exit(0 if ok else 1)
