"""FP8 (float8_e4m3fn) attention inputs: the quantizer, the descale layouts, the FP8 call.

A quantized tensor x8 and its descale d stand for x = x8 * d. Two layouts of d (the same for
query, key and value in one call):
- per head: (batch, num_kv_heads), FlashAttention-3's convention; a query head uses the descale
  of its kv head;
- per block: query (batch, num_heads, ceil(seq_q / block)), key and value
  (batch, num_kv_heads, ceil(seq_k / block)): one descale per `block` consecutive tokens of one
  head, `block` a power of two (FlashAttention-3's block quantization).
`quantize_fp8` makes them, optionally after a random Hadamard rotation of query and key along
head_dim (incoherent processing: QK^T is unchanged, outliers are spread over the dimension);
with blocks, the value's blocks all take its head's descale (quantize_fp8's docstring says why),
and `quantize_tensor` quantizes any one tensor per block.
The attention of FP8 inputs runs the FP8 kernel (jaxflash/fp8_kernel.py: per-head descales or
blocks of KERNEL_MIN_BLOCK tokens or more; bfloat16 or float16 out) or, on the reference path,
dequantizes them and runs the float32 reference; it has no gradient. Imports jax and the
jaxflash layers below the public API.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxflash import checks, fp8_kernel, primitives, reference
from jaxflash.config import FP8_DESCALE_ROWS, FP8_DTYPE, FP8_HEAD_DIMS, AttentionConfig

FP8_MAX = 448.0  # the largest finite float8_e4m3fn
OUT_DTYPES = ("bfloat16", "float16")
_BLOCK_SIZES = tuple(2 ** i for i in range(4, 21))  # 16 ... 2^20
# The smallest block of block descales that the FP8 kernel takes (its descale chunk).
KERNEL_MIN_BLOCK = FP8_DESCALE_ROWS


@dataclasses.dataclass(frozen=True)
class Descales:
  """The checked descales of one FP8 call; block_size None means per head."""

  q: jax.Array
  k: jax.Array
  v: jax.Array
  block_size: Optional[int]


# ---------------------------------------------------------------------------------------------
# Quantizer

def hadamard_rotation(head_dim: int, seed: int) -> np.ndarray:
  """An orthogonal (head_dim, head_dim) float32 matrix: diag(random signs) @ H / sqrt(head_dim).

  H is the Sylvester Hadamard matrix, so head_dim must be a power of two; the signs come from
  `seed` (numpy's PCG64), so the same seed gives the same matrix on every host.
  """
  if head_dim < 1 or head_dim & (head_dim - 1):
    raise ValueError(f"hadamard=True: head_dim must be a power of two, got {head_dim}")
  h = np.ones((1, 1), np.float64)
  while h.shape[0] < head_dim:
    h = np.block([[h, h], [h, -h]])
  signs = np.random.default_rng(seed).choice((-1.0, 1.0), size=head_dim)
  return (signs[:, None] * h / np.sqrt(head_dim)).astype(np.float32)


def _check_block_size(block_size):
  if block_size is None:
    return
  if (not isinstance(block_size, int) or isinstance(block_size, bool)
      or block_size not in _BLOCK_SIZES):
    raise ValueError(f"block_size: expected None or a power of two from {_BLOCK_SIZES[0]} to "
                     f"{_BLOCK_SIZES[-1]}, got {block_size!r}")


def _descale_of(amax):
  """amax / FP8_MAX, and 1 where a group is all zeros (any descale then represents it)."""
  return jnp.where(amax > 0, amax / FP8_MAX, 1.0).astype(jnp.float32)


def _expand(descale, shape, block_size: Optional[int], group: int):
  """`descale` broadcast to a (batch, seq, heads, dim) tensor's `shape`, float32."""
  b, s, h, _ = shape
  if block_size is None:  # (b, h // group): one value per kv head
    per_head = jnp.repeat(descale, group, axis=1)  # (b, h)
    return per_head[:, None, :, None]
  per_token = jnp.repeat(descale, block_size, axis=2)[:, :, :s]  # (b, h, s)
  return jnp.transpose(per_token, (0, 2, 1))[..., None]


def quantize_tensor(x, block_size: Optional[int] = None, group: int = 1):
  """(x8, descale) of one (batch, seq, heads, dim) tensor in the layouts above: one descale per
  (batch, head) over `group` consecutive heads (a query's kv-head group), or per `block_size`
  tokens of each head; each descale is its group's max |x| / 448, 1 for an all-zero group."""
  _check_block_size(block_size)
  x = x.astype(jnp.float32)
  b, s, h, d = x.shape
  if block_size is None:
    amax = jnp.max(jnp.abs(x).reshape(b, s, h // group, group, d), axis=(1, 3, 4))
  else:
    blocks = -(-s // block_size)
    padded = jnp.pad(jnp.abs(x), ((0, 0), (0, blocks * block_size - s), (0, 0), (0, 0)))
    amax = jnp.max(padded.reshape(b, blocks, block_size, h, d), axis=(2, 4))
    amax = jnp.transpose(amax, (0, 2, 1))  # (b, h, blocks)
  descale = _descale_of(amax)
  scaled = x / _expand(descale, x.shape, block_size, group)
  return jnp.clip(scaled, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn), descale


def quantize_fp8(query, key, value, *, block_size: Optional[int] = None, hadamard: bool = False,
                 seed: int = 0):
  """Quantizes attention inputs to float8_e4m3fn with the descales `jaxflash.attention` takes.

  Args:
    query, key, value: (batch, seq, heads, head_dim) arrays as for `jaxflash.attention`
      (float16, bfloat16 or float32); num_heads a multiple of num_kv_heads.
    block_size: None: one descale per (batch, kv head) over the whole sequence (the query's
      over its kv head's group of query heads); else one per `block_size` consecutive tokens of
      each head, a power of two from 16 (FlashAttention-3's block quantization) for query and
      key, while the value's blocks all take its (batch, kv head)'s descale: e4m3 keeps 3
      mantissa bits at any scale, so a block's own scale buys the value little precision, and
      the kernel folds value descales that differ into P (each key's P times its v descale / the
      head's largest), which costs P e4m3 range (docs/perf-notes.md, "FP8 accuracy"). Value
      descales per block of its own are still accepted: `quantize_tensor(value, block_size)`.
    hadamard: first multiply query and key along head_dim by the same random orthogonal
      matrix (`hadamard_rotation`), which leaves QK^T unchanged and spreads outliers over the
      dimensions (incoherent processing). head_dim must then be a power of two.
    seed: picks the rotation's random signs (a static Python int).

  Returns:
    (q8, k8, v8, q_descale, k_descale, v_descale): each descale float32, (batch, num_kv_heads)
    or (batch, heads, ceil(seq / block_size)); x8 * descale approximates x (after the rotation,
    for query and key). Each descale is its group's max |x| / 448, so nothing saturates; an
    all-zero group gets 1. Jittable with the keyword arguments static.
  """
  checks.check_tensors(query, key, value)
  _check_block_size(block_size)
  if not isinstance(hadamard, (bool, np.bool_)):
    raise TypeError(f"hadamard: expected a Python bool, got {hadamard!r}")
  if not isinstance(seed, int) or isinstance(seed, bool):
    raise TypeError(f"seed: expected a Python int, got {seed!r}")
  if hadamard:
    rotation = jnp.asarray(hadamard_rotation(query.shape[-1], seed))
    query = jnp.einsum("bshd,de->bshe", query.astype(jnp.float32), rotation,
                       precision=jax.lax.Precision.HIGHEST)
    key = jnp.einsum("bshd,de->bshe", key.astype(jnp.float32), rotation,
                     precision=jax.lax.Precision.HIGHEST)
  group = query.shape[2] // key.shape[2]
  q8, q_descale = quantize_tensor(query, block_size, group)
  k8, k_descale = quantize_tensor(key, block_size)
  v8, v_descale = quantize_tensor(value)
  if block_size is not None:  # the head's descale in each block of the value
    v_descale = jnp.broadcast_to(v_descale[:, :, None], k_descale.shape)
  return q8, k8, v8, q_descale, k_descale, v_descale


def dequantize(x8, descale, block_size: Optional[int], group: int = 1):
  """x8 * descale in float32 (the layouts of the module docstring)."""
  return x8.astype(jnp.float32) * _expand(descale, x8.shape, block_size, group)


def dequantize_inputs(q8, k8, v8, q_descale, k_descale, v_descale, block_size: Optional[int]):
  """(q, k, v) in float32 from one FP8 call's inputs (a query head uses its kv head's descale
  in the per-head layout)."""
  group = q8.shape[2] // k8.shape[2]
  return (dequantize(q8, q_descale, block_size, group), dequantize(k8, k_descale, block_size),
          dequantize(v8, v_descale, block_size))


# ---------------------------------------------------------------------------------------------
# The attention call

def _infer_block_size(seq_q: int, seq_k: int, blocks_q: int, blocks_k: int) -> Optional[int]:
  """The power-of-two block that gives these block counts. It is unique when a count exceeds 1;
  when both are 1, every block that covers both sequences means one descale per head, and the
  smallest of them the kernel takes (KERNEL_MIN_BLOCK or more) is chosen."""
  fits = [block for block in _BLOCK_SIZES
          if -(-seq_q // block) == blocks_q and -(-seq_k // block) == blocks_k]
  for_kernel = [block for block in fits if block >= KERNEL_MIN_BLOCK]
  return (for_kernel or fits or [None])[0]


def check_descales(query, key, value, q_descale, k_descale, v_descale) -> Descales:
  """The descales of an FP8 call, checked; all None means 1 per (batch, kv head)."""
  b, seq_q, h, _ = query.shape
  seq_k, hk = key.shape[1], key.shape[2]
  given = {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale}
  if all(x is None for x in given.values()):
    ones = jnp.ones((b, hk), jnp.float32)
    return Descales(ones, ones, ones, None)
  missing = [n for n, x in given.items() if x is None]
  if missing:
    raise ValueError(f"{', '.join(missing)}: pass all three descales or none (none: 1)")
  per_head = f"(batch, num_kv_heads) = {(b, hk)}"
  per_block = (f"q_descale (batch, num_heads, ceil(seq_q / block)) = ({b}, {h}, ...) and "
               f"k_descale, v_descale (batch, num_kv_heads, ceil(seq_k / block)) = "
               f"({b}, {hk}, ...) for one power-of-two block")
  for name, x in given.items():
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise TypeError(f"{name}: expected a float32 array, got {type(x).__name__}")
    if np.dtype(x.dtype).name != "float32":
      raise TypeError(f"{name}: expected dtype float32, got {x.dtype}")
  shapes = {n: tuple(x.shape) for n, x in given.items()}
  if all(len(s) == 2 for s in shapes.values()):
    wrong = {n: s for n, s in shapes.items() if s != (b, hk)}
    if wrong:
      raise ValueError(f"{', '.join(wrong)}: per-head descales must be {per_head}, got "
                       f"{', '.join(f'{n} {s}' for n, s in shapes.items())}")
    return Descales(q_descale, k_descale, v_descale, None)
  if all(len(s) == 3 for s in shapes.values()):
    (qb, qh, nq), kshape, vshape = shapes.values()
    block = None
    if qb == b and qh == h and kshape == vshape and kshape[:2] == (b, hk):
      block = _infer_block_size(seq_q, seq_k, nq, kshape[2])
    if block is None:
      raise ValueError(f"q_descale, k_descale, v_descale: per-block descales must be "
                       f"{per_block}; got {', '.join(f'{n} {s}' for n, s in shapes.items())} "
                       f"for seq_q {seq_q}, seq_k {seq_k}")
    return Descales(q_descale, k_descale, v_descale, block)
  raise ValueError(f"q_descale, k_descale, v_descale: expected all per head {per_head} or all "
                   f"per block ({per_block}); got "
                   f"{', '.join(f'{n} {s}' for n, s in shapes.items())}")


def check_fp8_call(config: AttentionConfig, head_dim: int, head_dim_v: int, out_dtype) -> str:
  """Raises for what FP8 inputs do not support; returns the output dtype's name."""
  unsupported = [name for name, used in (
      ("window_size", config.has_window), ("softcap", config.softcap is not None),
      ("q_segment_ids/kv_segment_ids", config.has_segment_ids)) if used]
  if unsupported:
    raise ValueError(f"{', '.join(unsupported)}: not supported with float8_e4m3fn inputs; FP8 "
                     f"attention takes dense or causal masks, GQA/MQA, seq_q != seq_k, "
                     f"learnable sinks and head_dim {FP8_HEAD_DIMS} (= head_dim_v)")
  if head_dim not in FP8_HEAD_DIMS or head_dim_v != head_dim:
    raise ValueError(f"query/value: FP8 attention takes head_dim {FP8_HEAD_DIMS} with head_dim_v "
                     f"equal to it; got head_dim {head_dim}, head_dim_v {head_dim_v}")
  name = "bfloat16" if out_dtype is None else _dtype_name(out_dtype, "out_dtype")
  if name not in OUT_DTYPES:
    raise ValueError(f"out_dtype: expected one of {OUT_DTYPES} for float8_e4m3fn inputs, got "
                     f"{name}")
  return name


def _dtype_name(dtype, argument: str) -> str:
  try:
    return np.dtype(dtype).name
  except TypeError as e:
    raise TypeError(f"{argument}: expected a dtype, got {dtype!r}") from e


P_SCALE = 256.0  # P (<= 1 after the row max) times this before its e4m3 cast: no underflow


def naive_fp8_attention(q8, k8, v8, descales: Descales, config: AttentionConfig,
                        learnable_sink=None):
  """(out float32, lse) as an FP8 kernel computes them, all scores at once: S from the e4m3
  q8 k8^T in float32 times the descales, P = exp(S - row max) rounded to e4m3 after scaling
  by P_SCALE (FlashAttention-3's P) and by each key's v descale / v max (v max: the largest
  v descale of the (batch, kv head), so the ratio is 1 with per-head descales), O = P8 (v8 *
  v max) / (P_SCALE * row sum of the unrounded P). Dense or causal; a learnable sink
  (num_heads,) joins each row's sum (not its max, as in the kernel's epilogue). A kernel
  differs in the order of its sums and in rounding P against a running row max, so this bounds
  an FP8 kernel's error in tests (2x rule) and estimates it in benchmarks/fp8_accuracy.py.
  """
  b, seq_q, h, _ = q8.shape
  seq_k, hk = k8.shape[1], k8.shape[2]
  group = h // hk
  per_token = lambda d, x, g: jnp.broadcast_to(_expand(d, x.shape, descales.block_size, g),
                                               x.shape[:3] + (1,))
  qd = per_token(descales.q, q8, group)[..., 0]  # (b, seq_q, h)
  kd = per_token(descales.k, k8, 1)[..., 0]  # (b, seq_k, hk)
  vd = per_token(descales.v, v8, 1)  # (b, seq_k, hk, 1)
  qg = q8.astype(jnp.float32).reshape(b, seq_q, hk, group, -1)
  s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k8.astype(jnp.float32),
                 precision=jax.lax.Precision.HIGHEST)
  s = s * jnp.transpose(qd.reshape(b, seq_q, hk, group), (0, 2, 3, 1))[..., None]
  s = s * jnp.transpose(kd, (0, 2, 1))[:, :, None, None, :] * config.softmax_scale
  if config.causal:
    visible = reference.visible_mask(config, seq_q, seq_k, jnp.arange(seq_q), jnp.arange(seq_k))
    s = jnp.where(visible, s, -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.exp(s - m)
  row_sum = jnp.sum(p, axis=-1, keepdims=True)  # (b, hk, g, q, 1)
  if learnable_sink is not None:
    sink = jnp.asarray(learnable_sink, jnp.float32).reshape(1, hk, group, 1, 1)
    row_sum = row_sum + jnp.exp(sink - m)  # rows without keys: m = 0, so exp(sink)
  v_max = jnp.max(vd, axis=1, keepdims=True)  # (b, 1, hk, 1)
  ratio = fp8_kernel.value_ratio(vd, v_max)
  ratio = jnp.transpose(ratio[..., 0], (0, 2, 1))[:, :, None, None, :]  # (b, hk, 1, 1, k)
  p8 = (p * P_SCALE * ratio).astype(jnp.float8_e4m3fn).astype(jnp.float32)
  v = v8.astype(jnp.float32) * v_max
  out = jnp.einsum("bhgqk,bkhd->bqhgd", p8, v, precision=jax.lax.Precision.HIGHEST)
  denom = jnp.transpose(row_sum[..., 0] * P_SCALE, (0, 3, 1, 2))[..., None]  # (b, q, hk, g, 1)
  out = jnp.where(denom > 0, out / jnp.where(denom > 0, denom, 1.0), 0.0)
  lse = jnp.where(row_sum[..., 0] == 0, -jnp.inf, m[..., 0] + jnp.log(row_sum[..., 0]))
  if learnable_sink is not None:  # a row without keys: out 0, lse = its sink
    no_key = jnp.isneginf(jnp.max(s, axis=-1))
    lse = jnp.where(no_key, jnp.broadcast_to(sink[..., 0], lse.shape), lse)
  return out.reshape(b, seq_q, h, -1), lse.reshape(b, h, seq_q)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1, 2))
def fp8_attention(config: AttentionConfig, out_dtype: str, block_size: Optional[int], q8, k8, v8,
                  q_descale, k_descale, v_descale, learnable_sink=None):
  """(out in out_dtype, lse) of FP8 inputs: the FP8 kernel (implementation 'cute': per-head
  descales or blocks of KERNEL_MIN_BLOCK tokens or more), else dequantized and the float32
  reference."""
  config = config.replace(has_sink=learnable_sink is not None,
                          out_float16=out_dtype == "float16")
  if config.implementation == "cute":
    return fp8_kernel.fp8_forward(config, q8, k8, v8, q_descale, k_descale, v_descale,
                                  learnable_sink, block_size=block_size)
  q, k, v = dequantize_inputs(q8, k8, v8, q_descale, k_descale, v_descale, block_size)
  out, lse = primitives.attention_core(config.replace(implementation="reference"), q, k, v,
                                       None, None, learnable_sink)
  return out.astype(out_dtype), lse


@fp8_attention.defjvp
def _fp8_attention_jvp(config, out_dtype, block_size, primals, tangents):
  del config, out_dtype, block_size, primals, tangents
  raise ValueError("jaxflash.attention: differentiating through attention of float8_e4m3fn "
                   "inputs is not supported (FP8 attention has a forward only); differentiate "
                   "a bfloat16/float16 call, or wrap the FP8 inputs in jax.lax.stop_gradient")
