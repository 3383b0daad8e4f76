"""implementation.resolve: which implementation a call runs, by what is asked, what the kernels
cover, which GPU is visible and whether the kernel is at hand (CPU only: the devices are
pretended)."""

import logging
import sys
import warnings

import pytest

from jaxflash import _jax_internal, implementation

COVERED, NOT_COVERED = (True, ""), (False, "dtype float32 has no kernel")


def _devices(monkeypatch, cuda: bool, hopper: bool):
  monkeypatch.setattr(_jax_internal, "has_cuda_device", lambda: cuda)
  monkeypatch.setattr(_jax_internal, "has_hopper_device", lambda: hopper)


def _never_asked():
  raise AssertionError("missing() asked where no kernel can run")


@pytest.mark.parametrize("cuda,hopper", [(False, False), (True, True)])
def test_reference_is_taken_as_asked(monkeypatch, cuda, hopper):
  _devices(monkeypatch, cuda, hopper)
  assert implementation.resolve("reference", COVERED, _never_asked) == "reference"


def test_auto_takes_the_reference_off_a_hopper_gpu_and_where_no_kernel_covers(monkeypatch,
                                                                             caplog):
  _devices(monkeypatch, cuda=True, hopper=False)
  assert implementation.resolve(None, COVERED, _never_asked) == "reference"
  _devices(monkeypatch, cuda=True, hopper=True)
  with caplog.at_level(logging.INFO, logger="jaxflash"), warnings.catch_warnings():
    warnings.simplefilter("error")
    assert implementation.resolve(None, NOT_COVERED, _never_asked) == "reference"
  assert "dtype float32 has no kernel" in caplog.text


def test_auto_takes_the_kernel_at_hand_and_warns_where_it_is_missing(monkeypatch):
  _devices(monkeypatch, cuda=True, hopper=True)
  assert implementation.resolve(None, COVERED, lambda: "") == "cute"
  with pytest.warns(RuntimeWarning, match="(?s)not built: run the build.*reference") as seen:
    line = sys._getframe().f_lineno + 1
    got = implementation.resolve(None, COVERED, lambda: "not built: run the build")
  assert got == "reference"
  # Attributed to the first frame outside jaxflash (through jaxflash.attention's frames too:
  # tests/test_attention_api.py).
  assert (seen[0].filename, seen[0].lineno) == (__file__, line)


def test_cute_raises_where_auto_would_take_the_reference(monkeypatch):
  _devices(monkeypatch, cuda=True, hopper=True)
  with pytest.raises(ValueError, match="implementation='cute': dtype float32 has no kernel"):
    implementation.resolve("cute", NOT_COVERED, _never_asked)
  with pytest.raises(ValueError, match="(?s)implementation='cute': not built.*reference"):
    implementation.resolve("cute", COVERED, lambda: "not built")
  assert implementation.resolve("cute", COVERED, lambda: "") == "cute"


def test_cute_without_a_cuda_device_lowers_for_one_elsewhere(monkeypatch):
  _devices(monkeypatch, cuda=False, hopper=False)
  assert implementation.resolve("cute", COVERED, _never_asked) == "cute"
