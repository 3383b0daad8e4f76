"""Argument checks shared by the public entry points (attention, kv_cache_attention,
quantize_fp8): each error names the argument, the value seen and what is accepted. Imports
config only."""

from __future__ import annotations

import numbers

import numpy as np

from jaxflash.config import IMPLEMENTATIONS, REFERENCE_DTYPES, AttentionConfig

RANK4 = "(batch, seq, heads, head_dim)"


def check_array(name: str, x, rank: int, layout: str) -> None:
  """TypeError unless x is an array, ValueError unless it has `rank` dimensions."""
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"{name}: expected an array {layout}, got {type(x).__name__}")
  if x.ndim != rank:
    raise ValueError(f"{name}: expected rank {rank} {layout}, got shape {tuple(x.shape)}")


def check_tensors(query, key, value, extra_dtypes: tuple[str, ...] = ()) -> str:
  """Checks query / key / value of one call and returns their common dtype's name.

  Accepted dtypes: the reference's (float16, bfloat16, float32), float64 (x64 oracle runs) and
  `extra_dtypes` (the FP8 input dtype where the caller takes it). Shapes: rank 4, one batch,
  one head_dim for query and key, value's (seq_k, num_kv_heads) equal to key's, and num_heads a
  multiple of num_kv_heads (MQA/GQA).
  """
  for name, x in (("query", query), ("key", key), ("value", value)):
    check_array(name, x, 4, RANK4)
  dtype = common_dtype({"query": query, "key": key, "value": value}, extra_dtypes)
  b, _, h, d = query.shape
  if key.shape[0] != b or value.shape[0] != b:
    raise ValueError(f"key/value: batch must equal query's {b}, got key {tuple(key.shape)}, "
                     f"value {tuple(value.shape)}")
  if key.shape[3] != d:
    raise ValueError(f"key: head_dim must equal query's {d}, got key {tuple(key.shape)}")
  if value.shape[1] != key.shape[1] or value.shape[2] != key.shape[2]:
    raise ValueError(f"value: (seq_k, num_kv_heads) must equal key's {tuple(key.shape[1:3])}, "
                     f"got value {tuple(value.shape)}")
  h_kv = key.shape[2]
  if h_kv == 0 or h % h_kv:
    raise ValueError(f"key: num_heads {h} must be a multiple of num_kv_heads {h_kv} (MQA/GQA)")
  return dtype


def common_dtype(arrays: dict, extra_dtypes: tuple[str, ...] = ()) -> str:
  """The one dtype name of `arrays` ({name: array}, the first named in errors): the
  reference's dtypes, float64 (x64 oracle runs) or `extra_dtypes`."""
  dtypes = {np.dtype(x.dtype).name for x in arrays.values()}
  if len(dtypes) != 1:
    raise TypeError(f"{'/'.join(arrays)}: dtypes must match, got "
                    f"{', '.join(str(x.dtype) for x in arrays.values())}")
  dtype = dtypes.pop()
  accepted = REFERENCE_DTYPES + ("float64",) + tuple(extra_dtypes)
  if dtype not in accepted:
    raise TypeError(f"{next(iter(arrays))}: dtype {dtype} not supported; accepted: "
                    f"{', '.join(accepted)}")
  return dtype


def _is_int(x) -> bool:
  return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def check_options(causal, softmax_scale, window_size, softcap, deterministic, return_lse,
                  implementation, head_dim) -> AttentionConfig:
  """The static options of an attention call, checked, as an AttentionConfig (defaults
  resolved: softmax_scale = head_dim ** -0.5)."""
  for name, flag in (("causal", causal), ("deterministic", deterministic),
                     ("return_lse", return_lse)):
    if not isinstance(flag, (bool, np.bool_)):
      raise TypeError(f"{name}: expected a Python bool, got {flag!r}")
  if softmax_scale is None:
    softmax_scale = head_dim ** -0.5
  elif not isinstance(softmax_scale, numbers.Real) or isinstance(softmax_scale, bool):
    raise TypeError(f"softmax_scale: expected a static positive float or None, got "
                    f"{softmax_scale!r}")
  elif not np.isfinite(softmax_scale) or softmax_scale <= 0:
    raise ValueError(f"softmax_scale: expected a finite float > 0, got {softmax_scale!r}")
  if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
      or not all(w is None or _is_int(w) for w in window_size)):
    raise ValueError(f"window_size: expected (left, right), each None or an int, got "
                     f"{window_size!r}")
  if softcap is not None:
    if not isinstance(softcap, numbers.Real) or isinstance(softcap, bool):
      raise TypeError(f"softcap: expected a static float > 0 or None, got {softcap!r}")
    if not np.isfinite(softcap) or softcap <= 0:
      raise ValueError(f"softcap: expected a finite float > 0 or None, got {softcap!r}")
  if implementation not in (None,) + IMPLEMENTATIONS:
    raise ValueError(f"implementation: expected None, 'cute' or 'reference', got "
                     f"{implementation!r}")
  left, right = (None if w is None else int(w) for w in window_size)
  return AttentionConfig(
      softmax_scale=float(softmax_scale), causal=bool(causal), window_left=left,
      window_right=right, softcap=None if softcap is None else float(softcap),
      deterministic=bool(deterministic))
