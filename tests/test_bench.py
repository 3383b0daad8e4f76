"""The benchmark script's CPU-checkable parts: the clock spin-up and its argument."""

import pytest

from tests._scripts import load_script


@pytest.fixture(scope="module")
def bench():
  return load_script("benchmarks/bench_attention.py")


def test_spin_up_runs_matmuls_for_the_given_time(bench):
  assert bench.spin_up(0.0) == 0
  assert bench.spin_up(0.05, size=32) >= 1


@pytest.mark.parametrize("text", ["-1", "nan"])
def test_spin_up_argument_rejects_bad_seconds(bench, text, capsys):
  with pytest.raises(SystemExit):
    bench.main(["--spin-up", text])
  assert "--spin-up" in capsys.readouterr().err
