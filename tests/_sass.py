"""SASS helpers of the kernel compile tests: export once per variant, opcodes, structure checks.

Import only after pytest.importorskip("cutlass"): the exporter needs the DSL.
"""

from __future__ import annotations

import ctypes
import hashlib
import pathlib
import re

from jaxflash.kernels import compile as kernel_compile
from tests import _session

_SASS_OP = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)", re.M)
KERNEL_ABI_H = pathlib.Path(kernel_compile.__file__).parents[1] / "ffi" / "kernel_abi.h"


def opcodes(sass: str, modifiers: bool = False) -> list[str]:
  """The opcodes of a disassembly, in order; predicates dropped, modifiers (STS.128) kept only
  with `modifiers`."""
  return [m.group(1) if modifiers else m.group(1).split(".")[0] for m in _SASS_OP.finditer(sass)]


def abi_version() -> int:
  return int(re.search(r"#define JAXFLASH_KERNEL_ABI_VERSION (\d+)",
                       KERNEL_ABI_H.read_text()).group(1))


def compiled_variants(variants):
  """The variants whose kernels the compile tests build: every bfloat16 variant and one float16
  variant, the head_dim 128 one with the fewest options (not masked, causal or
  deterministic). A float16 variant is its bfloat16 twin's code with the other element type:
  every shipped pair compiles to the same registers and shared memory and neither spills (the
  wheel build reports both), their SASS differing in the conversions. The wheel build compiles
  every variant and the GPU suite runs both dtypes; compiling each twin here too would double
  the suite's largest cost."""
  chosen = [v for v in variants if v.dtype != "float16"]
  twins = [v for v in variants if v.dtype == "float16" and (v.head_dim, v.head_dim_v) == (128, 128)]
  if twins:
    chosen.append(min(twins, key=lambda v: (v.masked, v.causal, v.deterministic)))
  return chosen


class Exported:
  """One variant exported for sm_90a: the ExportedKernel and the SASS of each of its parts
  ("main", and the backward's "pre" / "post")."""

  def __init__(self, exported: kernel_compile.ExportedKernel, work_dir):
    self.exp = exported
    parts = ("main", "pre", "post")[:1 + len(exported.extra_cubins)]
    self.sass = {part: kernel_compile.disassemble(cubin, work_dir)
                 for part, cubin in zip(parts, (exported.cubin, *exported.extra_cubins))}

  def ops(self, part: str = "main", modifiers: bool = False) -> list[str]:
    return opcodes(self.sass[part], modifiers)


def exporter(tmp_path_factory):
  """A function variant -> Exported that compiles each variant once per test session, also
  across pytest-xdist workers (tests/_session.py)."""
  shared = _session.shared_folder(tmp_path_factory, "exported-variants")
  cache = {}

  def get(variant):
    if variant not in cache:
      # The key does not name every schedule field (tests compile variants with changed
      # ones): the folder is named by the whole variant.
      name = f"{variant.key}-{hashlib.sha256(repr(variant).encode()).hexdigest()[:12]}"
      cache[variant] = _session.computed_once(
          shared, name, lambda folder: Exported(kernel_compile.export_variant(variant, folder),
                                                folder))
    return cache[variant]

  return get


def assert_no_spills(ops: list[str], where: str = ""):
  spills = ops.count("LDL") + ops.count("STL")
  assert spills == 0, f"{where}: {spills} local-memory instructions (LDL/STL)"


def assert_wgmma_not_serialized(sass: str):
  """ptxas serializes WGMMAs it cannot prove safe (one arrive and wait per HGMMA instead of
  one per GEMM group of several k steps): a kernel keeps fewer arrives than half its HGMMAs."""
  ops = opcodes(sass, modifiers=True)
  hgmma = sum(op.startswith("HGMMA") for op in ops)
  assert 0 < ops.count("WARPGROUP.ARRIVE") <= hgmma // 2, (ops.count("WARPGROUP.ARRIVE"), hgmma)


def assert_operand_descriptors_uniform(sass: str, window: int = 8):
  """GEMM operand descriptors stay on the uniform datapath: no R2UR among the `window`
  instructions before any HGMMA (per-thread operand slices move 88-204 there)."""
  ops = opcodes(sass)
  for i, op in enumerate(ops):
    if op == "HGMMA":
      assert "R2UR" not in ops[max(0, i - window):i], f"R2UR right before HGMMA #{i}"


def wgmma_shapes(sass: str) -> set[str]:
  return set(re.findall(r"\bHGMMA\.(\d+x\d+x\d+)\.", sass))


def pingpong_turns(sass: str) -> list[str]:
  """The ping-pong GEMM turns: each consumer warpgroup waits on named barrier 2 + w and hands
  the turn on with an arrive (256 threads); empty when the warpgroups issue freely."""
  return re.findall(r"BAR\.(SYNC\S*|ARV) (?:R\d+|0x[23]), 0x100", sass)


class _VariantInfo(ctypes.Structure):
  """kernel_abi.h's JaxflashVariantInfo."""
  _fields_ = [(name, ctypes.c_int32) for name in (
      "direction", "dtype", "head_dim", "head_dim_v", "causal", "deterministic", "tile_m",
      "max_dq_copies", "masked", "tile_n", "tile_counter", "kv_fp8")]


def library_info(path):
  """(ctypes library, JaxflashVariantInfo as a dict) of a linked variant library."""
  lib = ctypes.CDLL(str(path))
  lib.jaxflash_variant_info.restype = ctypes.POINTER(_VariantInfo)
  lib.jaxflash_variant_key.restype = ctypes.c_char_p
  info = lib.jaxflash_variant_info().contents
  return lib, {name: getattr(info, name) for name, _ in _VariantInfo._fields_}
