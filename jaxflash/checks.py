"""Argument checks shared by the public entry points (attention, quantize_fp8): each error names
the argument, the value seen and what is accepted. Imports config only."""

from __future__ import annotations

import numpy as np

from jaxflash.config import REFERENCE_DTYPES

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
  dtypes = {np.dtype(x.dtype).name for x in (query, key, value)}
  if len(dtypes) != 1:
    raise TypeError(f"query/key/value: dtypes must match, got {query.dtype}, {key.dtype}, "
                    f"{value.dtype}")
  dtype = dtypes.pop()
  accepted = REFERENCE_DTYPES + ("float64",) + tuple(extra_dtypes)
  if dtype not in accepted:
    raise TypeError(f"query: dtype {dtype} not supported; accepted: {', '.join(accepted)}")
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
