"""Forward kernel builds with non-default constructor options, for the CPU compile tests.

Import only after pytest.importorskip("cutlass"): this module needs the DSL.
"""

import re

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_stream

from jaxflash.kernels import compile as kernel_compile
from jaxflash.kernels.fwd_sm90 import DTYPES, FlashAttentionForwardSm90

_SASS_OP = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)", re.M)


def compile_cubin(variant, out_dir, name: str, **kernel_options) -> bytes:
  """The cubin of `variant`'s forward kernel built with `kernel_options` (as the shipped path
  builds it otherwise: same signature, arch and function prefix)."""
  kernel = FlashAttentionForwardSm90(DTYPES[variant.dtype], variant.head_dim,
                                     variant.head_dim_v, variant.tile, variant.causal,
                                     **kernel_options)
  kernel_compile.load_dsl_runtime()
  compiled = cute.compile(kernel, *kernel_compile.fwd_signature(variant), cutlass.Float32(1.0),
                          make_fake_stream(), options="--gpu-arch sm_90a")
  compiled.export_to_c(str(out_dir), name, kernel_compile.function_prefix(variant))
  return kernel_compile.extract_cubin(out_dir / f"{name}.o")


def sass_opcodes(sass: str) -> list[str]:
  """SASS opcodes (with modifiers) of disassembly text, in order."""
  return [m.group(1) for m in _SASS_OP.finditer(sass)]


def opcodes(cubin: bytes, work_dir) -> list[str]:
  """SASS opcodes (with modifiers) of a cubin, in order."""
  return sass_opcodes(kernel_compile.disassemble(cubin, work_dir))
