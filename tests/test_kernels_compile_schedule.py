"""AOT compile of the forward kernel's tile-order option l2_sections (sm_90a, no GPU).

None (the shipped default) means LPT sections for causal and m-block-fastest order otherwise;
True on a non-causal variant is the A/B build of docs/perf-notes.md (measured slower, not
shipped). These tests keep the option wired (it changes the SASS), spill-free, and the default
equal to the explicit choice.
"""

import re

import pytest

pytest.importorskip("cutlass")

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass.cute.runtime import make_fake_stream  # noqa: E402

from jaxflash import config  # noqa: E402
from jaxflash.kernels import compile as kernel_compile  # noqa: E402
from jaxflash.kernels.fwd_sm90 import DTYPES, FlashAttentionForwardSm90  # noqa: E402

pytestmark = pytest.mark.cutlass

_SASS_OP = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)", re.M)


def _variant(causal):
  cfg = config.AttentionConfig(softmax_scale=1.0, causal=causal)
  return config.KernelVariant.for_call("fwd", "sm90a", "bfloat16", 128, 128, cfg)


@pytest.fixture(scope="module")
def sass(tmp_path_factory):
  """SASS text per (causal, l2_sections), compiled once per session."""
  out_dir = tmp_path_factory.mktemp("schedule")
  cache = {}

  def get(causal, l2_sections):
    key = (causal, l2_sections)
    if key not in cache:
      variant = _variant(causal)
      kernel = FlashAttentionForwardSm90(DTYPES[variant.dtype], variant.head_dim,
                                         variant.head_dim_v, variant.tile, variant.causal,
                                         l2_sections=l2_sections)
      kernel_compile.load_dsl_runtime()
      compiled = cute.compile(kernel, *kernel_compile.fwd_signature(variant),
                              cutlass.Float32(1.0), make_fake_stream(),
                              options="--gpu-arch sm_90a")
      name = f"{variant.key}-l2s{l2_sections}"
      compiled.export_to_c(str(out_dir), name, kernel_compile.function_prefix(variant))
      cubin = kernel_compile.extract_cubin(out_dir / f"{name}.o")
      cache[key] = kernel_compile.disassemble(cubin, out_dir)
    return cache[key]

  return get


def _ops(text):
  return [m.group(1) for m in _SASS_OP.finditer(text)]


def test_default_is_lpt_for_causal_only(sass):
  assert sass(False, None) == sass(False, False)
  assert sass(True, None) == sass(True, True)


def test_sections_on_non_causal_compiles_spill_free_and_differs(sass):
  on, off = _ops(sass(False, True)), _ops(sass(False, None))
  assert on != off  # the option reaches the scheduler
  assert "LDL" not in on and "STL" not in on
  assert sum(op.startswith("HGMMA") for op in on) == sum(op.startswith("HGMMA") for op in off)


@pytest.mark.parametrize("value", [1, "yes", 0.0])
def test_l2_sections_is_validated(value):
  with pytest.raises(TypeError, match="l2_sections"):
    FlashAttentionForwardSm90(DTYPES["bfloat16"], 128, 128, config.TileConfig(128, 128, 2),
                              False, l2_sections=value)
