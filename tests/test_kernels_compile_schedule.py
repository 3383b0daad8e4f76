"""AOT compile of the forward kernel's tile-order option l2_sections (sm_90a, no GPU).

None (the shipped default) means LPT sections for causal and m-block-fastest order otherwise;
True on a non-causal variant is the A/B build of docs/perf-notes.md (measured slower, not
shipped). These tests keep the option wired (it changes the SASS), spill-free, and the default
equal to the explicit choice.
"""

import pytest

pytest.importorskip("cutlass")

from jaxflash import config  # noqa: E402
from jaxflash.kernels import compile as kernel_compile  # noqa: E402
from jaxflash.kernels.fwd_sm90 import DTYPES, FlashAttentionForwardSm90  # noqa: E402
from tests import _fwd_options  # noqa: E402

pytestmark = pytest.mark.cutlass


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
      cubin = _fwd_options.compile_cubin(variant, out_dir, f"{variant.key}-l2s{l2_sections}",
                                         l2_sections=l2_sections)
      cache[key] = kernel_compile.disassemble(cubin, out_dir)
    return cache[key]

  return get


def test_default_is_lpt_for_causal_only(sass):
  assert sass(False, None) == sass(False, False)
  assert sass(True, None) == sass(True, True)


def test_sections_on_non_causal_compiles_spill_free_and_differs(sass):
  on, off = (_fwd_options.sass_opcodes(sass(False, l2)) for l2 in (True, None))
  assert on != off  # the option reaches the scheduler
  assert "LDL" not in on and "STL" not in on
  assert sum(op.startswith("HGMMA") for op in on) == sum(op.startswith("HGMMA") for op in off)


@pytest.mark.parametrize("value", [1, "yes", 0.0])
def test_l2_sections_is_validated(value):
  with pytest.raises(TypeError, match="l2_sections"):
    FlashAttentionForwardSm90(DTYPES["bfloat16"], 128, 128, config.TileConfig(128, 128, 2),
                              False, l2_sections=value)
