"""The online softmax's building blocks (kernels/softmax.py), checked on the CPU: the row max's
chains and the FMA-pipe exp2, against numpy models of what they compute. Needs
nvidia-cutlass-dsl (marker `cutlass`, skipped elsewhere)."""

import numpy as np
import pytest

pytest.importorskip("cutlass")

import cutlass.cute as cute  # noqa: E402

from jaxflash.kernels import softmax  # noqa: E402

pytestmark = pytest.mark.cutlass


class _Traced:
  """A value with the length of the FMNMX chain that produced it."""

  def __init__(self, value, depth=0):
    self.value, self.depth = value, depth


@pytest.mark.parametrize("chains", [1, 4])
@pytest.mark.parametrize("ncols", [1, 3, 4, 5, 16, 32, 48, 64, 96])
def test_row_max_is_exact_in_short_independent_chains(monkeypatch, ncols, chains):
  """row_max returns max(init, row), and with four chains no result waits on more than
  ncols / 4 + 3 FMNMX (one chain is ncols long)."""
  monkeypatch.setattr(cute.arch, "fmax", lambda a, b: _Traced(
      max(a.value, b.value), max(a.depth, b.depth) + 1))
  monkeypatch.setattr(cute, "size", lambda t, mode: t.shape[mode[0]])
  rng = np.random.default_rng(ncols)
  for init in (-np.inf, 0.5, 10.0):
    values = rng.standard_normal((2, ncols))
    row = np.array([[_Traced(x) for x in r] for r in values], dtype=object)
    for i in range(2):
      got = softmax.row_max(row, i, _Traced(init), chains)
      assert got.value == max(init, values[i].max())
      assert got.depth <= (ncols if chains == 1 else -(-ncols // 4) + 3)


def _exp2_fma_model(x):
  """softmax.exp2_fma's PTX steps in float32."""
  f32 = np.float32
  c0, c1, c2, c3 = (f32(c) for c in softmax._EXP2_POLY)
  magic = f32(1.5 * 2**23)
  xc = np.where(np.isnan(x), x, np.maximum(x, f32(-127)))
  t = (xc + magic).astype(f32)
  f = (xc - (t - magic)).astype(f32)
  p = ((c3 * f + c2) * f + c1) * f + c0
  scale = ((t.view(np.uint32) << np.uint32(23)) + np.uint32(127 << 23)).view(f32)
  return (p * scale).astype(f32)


def test_exp2_fma_matches_exp2_within_the_polynomial_bound():
  """Relative error <= 7.6e-5 where 2^x is a normal float (up to 2^8, the FP8 kernel's P
  offset, and beyond), +0 at and below -127 and for -inf (masked scores), NaN for NaN."""
  x = np.concatenate([np.linspace(-140.0, 9.0, 400_001), np.random.default_rng(0).uniform(
      -30.0, 8.0, 100_000)]).astype(np.float32)
  want = np.exp2(x.astype(np.float64))
  got = _exp2_fma_model(x).astype(np.float64)
  normal = want >= 2.0**-126
  assert np.max(np.abs(got[normal] / want[normal] - 1.0)) <= 7.6e-5
  assert np.all(got[x <= -127] == 0.0)
  special = _exp2_fma_model(np.array([-np.inf, np.nan, 0.0], np.float32))
  assert special[0] == 0.0 and np.isnan(special[1]) and abs(special[2] - 1.0) <= 7.6e-5
