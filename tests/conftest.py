"""Test gating: `gpu` tests run only where a CUDA device exists (probed lazily, once); shared
fixtures."""

import atexit
import functools
import os
import shutil
import tempfile

import pytest

# The suite's XLA programs are tiny: compiling them dominates its time on a CPU, and LLVM's
# optimisation of the generated code is wasted there (test_reference.py's gradient tests: 22.0 s
# with it, 15.7 s without, on 2 cores). Where the caller sets XLA flags of its own
# (scripts/gpu_check.sh for the GPU suite) they are left alone. Subprocesses inherit these.
_CALLER_XLA_FLAGS = "XLA_FLAGS" in os.environ
if not _CALLER_XLA_FLAGS:
  os.environ["XLA_FLAGS"] = ("--xla_backend_optimization_level=0 "
                             "--xla_llvm_disable_expensive_passes=true")

# The suite compiles many identical XLA programs (the same oracle or reference call from
# different tests, workers and child processes; jit caches only per function object): one
# persistent compilation cache per session, shared by the workers (spawned with the parent's
# environment) and their subprocesses, compiles each program once. On 2 cores the whole suite
# took 1370 s of test time with it against 1587 s without (test_flax.py 34 s against 81 s).
# Measured on the CPU only: runs with XLA flags of the caller's (the GPU suite's) go without it.
# Workers see the parent's XLA_FLAGS (set above) and cache folder, so only the parent makes one.
if not (_CALLER_XLA_FLAGS or "JAX_COMPILATION_CACHE_DIR" in os.environ):
  _xla_cache = tempfile.mkdtemp(prefix="jaxflash-tests-xla-cache-")
  atexit.register(shutil.rmtree, _xla_cache, ignore_errors=True)
  os.environ.update(JAX_COMPILATION_CACHE_DIR=_xla_cache,
                    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")

if os.environ.get("PYTEST_XDIST_WORKER"):
  # Parallel workers share a GPU: each takes memory as it needs it instead of preallocating
  # most of it, which would leave every worker but the first unable to start a backend. Set
  # before jax initialises its backends (the first test that touches a device).
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


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


# A forward pair without a backward kernel: every forward pair has one now, so the tests of the
# forward-only path (forward kernel + reference backward) take 192 / 128's away.
FWD_ONLY_PAIR = (192, 128)


@pytest.fixture
def without_192_128_backward(monkeypatch):
  import jax
  from jaxflash import config
  monkeypatch.setitem(config.KERNEL_HEAD_DIM_PAIRS, "bwd", tuple(
      p for p in config.KERNEL_HEAD_DIM_PAIRS["bwd"] if p != FWD_ONLY_PAIR))
  jax.clear_caches()  # traces made with or without the backward kernel must not be reused
  yield
  jax.clear_caches()
