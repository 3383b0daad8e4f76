"""Work done once per test session, also across pytest-xdist workers (the README runs the
suite on every core): the first worker to need a result computes it under a file lock and
pickles it into a folder the session's workers share; the others wait and load it."""

from __future__ import annotations

import fcntl
import os
import pathlib
import pickle
from typing import Callable, TypeVar

T = TypeVar("T")


def shared_folder(tmp_path_factory, name: str) -> pathlib.Path:
  """Folder `name` of this test session, the same for every xdist worker of it."""
  base = tmp_path_factory.getbasetemp()
  # Under xdist each worker's basetemp is a child of the session's; alone, it is the session's.
  shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
  folder = shared / name
  folder.mkdir(exist_ok=True)
  return folder


def computed_once(folder: pathlib.Path, name: str, compute: Callable[[pathlib.Path], T]) -> T:
  """compute(work folder) once per session for `name` in `folder` (a shared_folder); its
  result must pickle."""
  work = folder / name
  with open(folder / f"{name}.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    done = work / "result.pickle"
    if done.exists():
      return pickle.loads(done.read_bytes())
    work.mkdir(exist_ok=True)
    result = compute(work)
    done.write_bytes(pickle.dumps(result))
    return result
