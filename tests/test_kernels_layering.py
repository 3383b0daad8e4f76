"""jaxflash/kernels/ must never import jax or torch (STYLE.md section 2)."""

import ast
import pathlib

import pytest

KERNELS = pathlib.Path(__file__).resolve().parents[1] / "jaxflash" / "kernels"
_BANNED = ("jax", "jaxlib", "torch", "flax")


def _imported_roots(path):
  tree = ast.parse(path.read_text(), filename=str(path))
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for alias in node.names:
        yield node.lineno, alias.name
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      yield node.lineno, node.module


@pytest.mark.parametrize("path", sorted(KERNELS.glob("*.py")), ids=lambda p: p.name)
def test_kernel_module_imports_no_jax_or_torch(path):
  bad = [f"{path.name}:{line}: {name}" for line, name in _imported_roots(path)
         if name.split(".")[0] in _BANNED]
  assert not bad, bad


@pytest.mark.parametrize("path", sorted(KERNELS.glob("*.py")), ids=lambda p: p.name)
def test_kernel_module_imports_only_config_from_jaxflash(path):
  bad = [f"{path.name}:{line}: {name}" for line, name in _imported_roots(path)
         if name.split(".")[0] == "jaxflash" and name != "jaxflash"
         and not name.startswith(("jaxflash.kernels", "jaxflash.config"))]
  assert not bad, bad


def test_scan_sees_the_kernel_modules():
  assert (KERNELS / "fwd_sm90.py").exists()
