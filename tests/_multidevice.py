"""Runs a test module's cases in a subprocess with 8 fake CPU devices, and reads compiled HLO.

The device count is fixed when jax initialises, so the rest of the suite keeps one device and
the sharding cases run in one child process (`python -m tests.<module>`), which prints a JSON
line of measurements that the parent's parametrized tests assert on.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import numpy as np

NUM_DEVICES = 8
COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "all-reduce", "reduce-scatter")
_MARK = "JAXFLASH_RESULTS "
_ROOT = pathlib.Path(__file__).resolve().parent.parent


def worker_results(tmp_path_factory, module: str, default_xla: bool = False) -> dict:
  """run_worker(module), once per test session (also across pytest-xdist workers)."""
  from tests import _session
  folder = _session.shared_folder(tmp_path_factory, "multidevice")
  return _session.computed_once(folder, module, lambda _: run_worker(module,
                                                                     default_xla=default_xla))


def run_worker(module: str, timeout: float = 900, default_xla: bool = False) -> dict:
  """Runs `python -m module` with 8 fake CPU devices; returns the JSON it printed.
  default_xla: without the suite's XLA flags (conftest.py), XLA's default optimisation."""
  env = dict(os.environ)
  flags = "" if default_xla else env.get("XLA_FLAGS", "")
  env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={NUM_DEVICES}".strip()
  env["JAX_PLATFORMS"] = "cpu"  # fake devices are CPU devices, also on a GPU host
  proc = subprocess.run([sys.executable, "-m", module], cwd=_ROOT, env=env, timeout=timeout,
                        capture_output=True, text=True)
  lines = [l for l in proc.stdout.splitlines() if l.startswith(_MARK)]
  if proc.returncode != 0 or not lines:
    raise AssertionError(f"{module} failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}\n"
                         f"{proc.stderr[-8000:]}")
  return json.loads(lines[-1][len(_MARK):])


def emit(results: dict) -> None:
  """Worker side: print the measurements for run_worker."""
  print(_MARK + json.dumps(results), flush=True)


def padded_spec(spec, ndim: int = 4) -> tuple:
  """A PartitionSpec as JSON gives it back: ndim entries, a multi-axis entry as a list."""
  entries = tuple(spec) + (None,) * (ndim - len(tuple(spec)))
  return tuple(list(e) if isinstance(e, tuple) else e for e in entries)


def collective_counts(hlo_text: str) -> dict:
  """Number of each collective in optimized HLO text (async -start ops count once)."""
  return {c: len(re.findall(rf"\s{c}(?:-start)?\(", hlo_text)) for c in COLLECTIVES}


def max_relative_l2(actual, expected) -> float:
  """Largest relative L2 error over paired arrays; non-finite entries must coincide (else inf)."""
  worst = 0.0
  for a, e in zip(actual, expected):
    a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
    if a.shape != e.shape or not np.array_equal(np.isfinite(a), np.isfinite(e)):
      return float("inf")
    if not np.array_equal(a[~np.isfinite(e)], e[~np.isfinite(e)]):
      return float("inf")
    f = np.isfinite(e)
    den = np.linalg.norm(e[f])
    num = np.linalg.norm(a[f] - e[f])
    worst = max(worst, float(num / den) if den > 0 else float(num))
  return worst
