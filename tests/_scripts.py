"""Loading the repository's scripts (benchmarks/, devtools/), which are not packages, in tests."""
import importlib.util
import pathlib
import types

REPO = pathlib.Path(__file__).resolve().parents[1]


def load_script(relative_path: str) -> types.ModuleType:
  """The module of REPO / relative_path, executed once per call (its main() not run)."""
  path = REPO / relative_path
  spec = importlib.util.spec_from_file_location(path.stem, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module
