"""Test gating: `gpu` tests run only where a CUDA device exists (probed lazily, once)."""

import functools

import pytest


@functools.lru_cache(maxsize=None)
def _has_cuda() -> bool:
  import jax
  try:
    return len(jax.devices("cuda")) > 0
  except RuntimeError:
    return False


def pytest_collection_modifyitems(config, items):
  del config
  for item in items:
    if "gpu" in item.keywords and not _has_cuda():
      item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
