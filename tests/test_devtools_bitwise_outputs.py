"""devtools/kernel_selftest/bitwise_outputs.py: the cases it runs and its bitwise compare."""
import numpy as np
import pytest

from jaxflash import config
from tests._scripts import load_script


@pytest.fixture(scope="module")
def bitwise():
  return load_script("devtools/kernel_selftest/bitwise_outputs.py")


def test_cases_reach_every_forward_head_dim_pair_and_mask_kind(bitwise):
  cases = list(bitwise.cases())
  pairs = {(d, dv) for _, d, dv, *_ in cases}
  assert pairs == set(config.KERNEL_HEAD_DIM_PAIRS["fwd"])
  kinds = {name.split("-", 2)[2] for name, *_ in cases}
  assert kinds == {"dense", "causal", "segments-window", "softcap"}
  assert any(seq_q != seq_k for _, _, _, seq_q, seq_k, _ in cases)


def test_compare_passes_equal_saves_and_fails_on_one_bit(bitwise, tmp_path, capsys):
  x = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
  x[1, 2] = np.nan
  np.savez(tmp_path / "a.npz", out=x, lse=x[0])
  np.savez(tmp_path / "b.npz", out=x.copy(), lse=x[0].copy())
  assert bitwise.compare(str(tmp_path / "a.npz"), str(tmp_path / "b.npz")) == 0
  y = x.copy()
  y.view(np.uint32)[0, 0] ^= 1
  np.savez(tmp_path / "c.npz", out=y, lse=x[0])
  assert bitwise.compare(str(tmp_path / "a.npz"), str(tmp_path / "c.npz")) == 1
  assert "DIFFERENT out" in capsys.readouterr().out
  np.savez(tmp_path / "d.npz", out=x)
  assert bitwise.compare(str(tmp_path / "a.npz"), str(tmp_path / "d.npz")) == 1
