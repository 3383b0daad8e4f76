"""Import-time environment for compiling FlashAttention-4's kernel modules on a torch-less host.

- `torch` and `tvm_ffi` are replaced by inert stub modules (attribute access returns dummy
  classes). Only host-side Python glue in FA-4 / quack touches them (dtype maps, FakeTensor
  isinstance checks, torch.library registration); the three kernel classes used here never call
  into torch while tracing.
- The packages `quack`, `flash_attn` and `flash_attn.cute` are registered with their source
  folders as __path__ but WITHOUT running their __init__.py files (those import interface.py /
  rmsnorm etc., which need real torch). `quack.dsl` is then imported explicitly, exactly as
  `import quack` would: it installs the CuTe tensor-indexing / constexpr-if patches FA-4 relies on.
- No FA-4 or quack source file is modified.
"""

import importlib
import importlib.abc
import importlib.machinery
import os
import pathlib
import sys
import types

HERE = pathlib.Path(__file__).resolve().parent
# FA-4 and quack sources (build.sh extracts them from git clones there).
SRC = pathlib.Path(os.environ.get("FA4_SRC", "/tmp/jaxflash_fa4_compare/src"))


def _stub_class(owner, name):
  """A dummy class for any non-dunder attribute `name` of a stub, cached on `owner`."""
  if name.startswith("__"):
    raise AttributeError(name)
  cls = _DummyMeta(name, (_Dummy,), {})
  setattr(owner, name, cls)
  return cls


class _DummyMeta(type):
  def __getattr__(cls, name):
    return _stub_class(cls, name)


class _Dummy(metaclass=_DummyMeta):
  def __init__(self, *a, **k):
    pass

  def __call__(self, *a, **k):
    return _Dummy()

  def __getattr__(self, name):
    return _Dummy()


class _StubModule(types.ModuleType):
  def __getattr__(self, name):
    return _stub_class(self, name)


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
  ROOTS = ("torch", "tvm_ffi", "torch_c_dlpack_ext", "einops")

  def find_spec(self, fullname, path, target=None):
    if fullname.split(".")[0] in self.ROOTS:
      return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
    return None

  def create_module(self, spec):
    m = _StubModule(spec.name)
    m.__path__ = []
    return m

  def exec_module(self, module):
    if module.__name__ == "torch":
      module.__version__ = "2.9.0"


def _bare_package(name: str, folder: pathlib.Path, **attrs):
  spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
  spec.submodule_search_locations = [str(folder)]
  mod = importlib.util.module_from_spec(spec)
  mod.__path__ = [str(folder)]
  for k, v in attrs.items():
    setattr(mod, k, v)
  sys.modules[name] = mod
  return mod


_done = False


def setup():
  global _done
  if _done:
    return
  os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
  sys.meta_path.insert(0, _StubFinder())
  import importlib.util  # noqa: F401

  _bare_package("quack", SRC / "quack", __version__="0.6.4")
  _bare_package("flash_attn", SRC / "flash_attn")
  _bare_package("flash_attn.cute", SRC / "flash_attn" / "cute", __version__="0.0.0")
  importlib.import_module("quack.dsl")  # what `import quack` does first
  _done = True
