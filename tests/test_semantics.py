"""Mask semantics against an independent, loop-by-loop NumPy statement of the API contract.

The vectorised oracle in jaxflash.reference shares `visible_mask` with the blocked path; this
file restates the rules (bottom-right causal, windows, segments, GQA, softcap) from the API
contract (README, "API") without any jaxflash code, so a wrong rule cannot hide in both.
"""

import jax
import numpy as np
import pytest

import jaxflash
from tests._cases import make_qkv, make_segments, x64


def _numpy_attention(q, k, v, *, causal=False, window=(None, None), softcap=None, scale=None,
                     q_seg=None, kv_seg=None):
  b, sq, h, d = q.shape
  sk, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
  scale = d ** -0.5 if scale is None else scale
  out = np.zeros((b, sq, h, dv))
  lse = np.full((b, h, sq), -np.inf)
  for bi in range(b):
    for hi in range(h):
      kh = hi // (h // hkv)  # query head hi reads kv head hi // group
      for i in range(sq):
        diag = i + sk - sq  # bottom-right: the last query sits on the last key
        keys = []
        for j in range(sk):
          if causal and j > diag:
            continue
          if window[0] is not None and j < diag - window[0]:
            continue
          if window[1] is not None and j > diag + window[1]:
            continue
          if q_seg is not None and q_seg[bi, i] != kv_seg[bi, j]:
            continue
          keys.append(j)
        if not keys:
          continue  # a row that sees no key: zeros, lse -inf
        s = np.array([q[bi, i, hi] @ k[bi, j, kh] * scale for j in keys])
        if softcap is not None:
          s = softcap * np.tanh(s / softcap)
        m = s.max()
        p = np.exp(s - m)
        out[bi, i, hi] = p @ v[bi, keys, kh] / p.sum()
        lse[bi, hi, i] = m + np.log(p.sum())
  return out, lse


CASES = {
    "causal_q_shorter": dict(sq=3, sk=5, causal=True),
    "causal_q_longer": dict(sq=6, sk=4, causal=True),
    "window_two_sided": dict(sq=7, sk=7, window=(2, 1)),
    "window_shifted": dict(sq=4, sk=9, window=(1, -1)),
    "causal_window_segments": dict(sq=8, sk=10, causal=True, window=(3, None), segments=True),
    "softcap_gqa": dict(sq=5, sk=6, softcap=0.7, heads=6, kv_heads=2),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_matches_the_contract_loop_by_loop(case):
  case = dict(case)
  sq, sk = case.pop("sq"), case.pop("sk")
  heads, kv_heads = case.pop("heads", 2), case.pop("kv_heads", 1)
  segments = case.pop("segments", False)
  with x64():
    q, k, v = make_qkv(11, 2, sq, sk, heads, kv_heads, 4, dtype=np.float64)
    segs = make_segments(12, 2, sq, sk, num_segments=2) if segments else (None, None)
    out, lse = jaxflash.attention(q, k, v, causal=case.get("causal", False),
                                  window_size=case.get("window", (None, None)),
                                  softcap=case.get("softcap"), q_segment_ids=segs[0],
                                  kv_segment_ids=segs[1], return_lse=True,
                                  implementation="reference")
    np_segs = [None if s is None else np.asarray(s) for s in segs]
    want, want_lse = _numpy_attention(*(np.asarray(x) for x in (q, k, v)), q_seg=np_segs[0],
                                      kv_seg=np_segs[1], **case)
  np.testing.assert_allclose(out, want, rtol=1e-10, atol=1e-12)
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
  np.testing.assert_allclose(np.where(np.isinf(lse), 0, lse), np.where(np.isinf(want_lse), 0,
                                                                       want_lse), rtol=1e-10)
