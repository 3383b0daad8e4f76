"""The one tolerance rule of the test suite: compare against a float64 oracle by relative L2.

An implementation's error must be at most `factor` x the error of the same math done naively
in the input dtype, plus a small floor (FlashAttention's own rule; STYLE.md section 7).
"""

from __future__ import annotations

import numpy as np


def relative_l2(actual, expected) -> float:
  """||actual - expected|| / ||expected|| over the finite entries of `expected`, in float64."""
  a = np.asarray(actual, np.float64)
  e = np.asarray(expected, np.float64)
  finite = np.isfinite(e)
  num = np.linalg.norm(a[finite] - e[finite])
  den = np.linalg.norm(e[finite])
  return float(num / den) if den > 0 else float(num)


def assert_close_to_oracle(actual, expected64, naive, *, factor: float = 2.0,
                           floor: float = 1e-5, name: str = "output"):
  """Asserts `actual` is as close to the float64 `expected64` as the naive `naive` result is.

  NaN never passes. Infinite entries of the oracle (lse of rows that see no key) must be
  matched exactly. Returns the measured error for reporting.
  """
  a = np.asarray(actual, np.float64)
  e = np.asarray(expected64, np.float64)
  assert a.shape == e.shape, f"{name}: shape {a.shape} != oracle shape {e.shape}"
  assert not np.isnan(a).any(), f"{name}: {int(np.isnan(a).sum())} NaN entries"
  inf = ~np.isfinite(e)
  assert np.array_equal(a[inf], e[inf]), f"{name}: infinite oracle entries not matched"
  assert np.isfinite(a[~inf]).all(), f"{name}: non-finite entries where the oracle is finite"
  err = relative_l2(a, e)
  bound = factor * relative_l2(naive, e) + floor
  assert err <= bound, f"{name}: relative L2 error {err:.3e} > bound {bound:.3e}"
  return err
