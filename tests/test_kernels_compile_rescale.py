"""AOT compile of the forward kernel with FA-4's softmax options on (sm_90a, no GPU).

The shipped kernel rescales O conditionally (rescale_threshold_log2 = 8, FA-4's choice);
exp2_emulation_every > 0 (some exp2 on the FMA pipe) is not shipped (docs/perf-notes.md). These
tests keep both option-on builds spill-free, the rescale skips warp-uniform branches, and the
shipped build equal to the threshold-8 build.
"""

import re

import pytest

pytest.importorskip("cutlass")

from jaxflash import config  # noqa: E402
from jaxflash.kernels import compile as kernel_compile  # noqa: E402
from jaxflash.kernels import softmax  # noqa: E402
from jaxflash.kernels.fwd_sm90 import DTYPES, FlashAttentionForwardSm90  # noqa: E402
from tests import _fwd_options  # noqa: E402

pytestmark = pytest.mark.cutlass

def _variant(dtype, head_dim, causal):
  cfg = config.AttentionConfig(softmax_scale=1.0, causal=causal)
  return config.KernelVariant.for_call("fwd", "sm90a", dtype, head_dim, head_dim, cfg)


# One per O-rescale placement and register budget: 3 consumer warpgroups at 160 registers
# (hdim 64), O rescaled after the PV GEMM (hdim 128), O rescaled before it (hdim 256).
VARIANTS = [_variant("bfloat16", 64, True), _variant("bfloat16", 128, False),
            _variant("float16", 256, True)]


@pytest.fixture(scope="module")
def cubin(tmp_path_factory):
  """Compiles lazily, once per (variant, threshold, emulation) and session: the cubin bytes."""
  out_dir = tmp_path_factory.mktemp("rescale")
  cache = {}

  def get(variant, threshold, exp2_emulation_every=0):
    key = (variant.key, threshold, exp2_emulation_every)
    if key not in cache:
      kernel_compile.build_kernel(variant)  # the shipped path's validation
      cache[key] = _fwd_options.compile_cubin(
          variant, out_dir, f"{variant.key}-t{threshold:g}-e{exp2_emulation_every}",
          rescale_threshold_log2=threshold, exp2_emulation_every=exp2_emulation_every)
    return cache[key]

  return get


_opcodes = _fwd_options.opcodes


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.key)
def test_the_shipped_kernel_rescales_conditionally(cubin, variant, tmp_path):
  shipped = kernel_compile.export_variant(variant, tmp_path)
  assert cubin(variant, 8.0) == shipped.cubin
  assert cubin(variant, 0.0) != shipped.cubin


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.key)
def test_rescale_on_has_no_spills_and_no_extra_wgmma_waits(cubin, variant, tmp_path):
  on, off = _opcodes(cubin(variant, 8.0), tmp_path), _opcodes(cubin(variant, 0.0), tmp_path)
  names = ("HGMMA.64", "WARPGROUP.ARRIVE", "WARPGROUP.DEPBAR", "LDL", "STL")

  def count(ops):
    return {n: sum(op.startswith(n) for op in ops) for n in names}

  c_on, c_off = count(on), count(off)
  assert c_on["LDL"] == 0 and c_on["STL"] == 0, f"local-memory spills: {c_on}"
  # A branch that ptxas could not prove safe around the accumulators would serialise the
  # WGMMAs: one more wait/arrive per GEMM.
  assert c_on == c_off, (c_on, c_off)
  res = kernel_compile.resource_usage(cubin(variant, 8.0), tmp_path)
  assert re.search(r"STACK:0\b", res), res


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.key)
def test_rescale_skip_is_a_warp_uniform_branch(cubin, variant, tmp_path):
  """Each skip (softmax scale exps and row sums, O multiply) branches on a VOTE.ANY predicate,
  equal on every lane of the warp; ptxas adds no reconvergence barrier (BSSY) for them."""
  sass_on = kernel_compile.disassemble(cubin(variant, 8.0), tmp_path)
  sass_off = kernel_compile.disassemble(cubin(variant, 0.0), tmp_path)
  assert "VOTE.ANY" not in sass_off
  lines = sass_on.splitlines()
  votes = 0
  for i, line in enumerate(lines):
    m = re.search(r"VOTE\.ANY (U?P\d), ", line)
    if not m:
      continue
    votes += 1
    pred = m.group(1)
    # The vote's predicate is next read (or overwritten) by the branch that skips the work.
    next_use = next((l for l in lines[i + 1:] if re.search(rf"\b{pred}\b", l)), "")
    assert re.search(rf"@!?{pred}\s+BRA\b", next_use), (line, next_use)
  # First block's softmax, then per steady step (masked and not) a softmax and an O vote.
  assert votes >= 3, votes
  assert sass_on.count("BSSY") == sass_off.count("BSSY")


@pytest.mark.parametrize("value,error", [(-1.0, ValueError), (16.0, ValueError),
                                         (float("nan"), ValueError), ("8", TypeError),
                                         (True, TypeError)])
def test_threshold_is_validated(value, error):
  tile = config.TileConfig(128, 128, 2)
  with pytest.raises(error, match="rescale_threshold_log2"):
    FlashAttentionForwardSm90(DTYPES["bfloat16"], 128, 128, tile, False,
                              rescale_threshold_log2=value)


def test_threshold_limit_keeps_fp16_p_finite():
  # P reaches 2^threshold: it must stay below the fp16 maximum.
  assert 2.0 ** softmax.MAX_RESCALE_THRESHOLD_LOG2 < 65504.0


@pytest.mark.parametrize("variant", VARIANTS[:2], ids=lambda v: v.key)
def test_exp2_emulation_moves_every_nth_exp_off_mufu(cubin, variant, tmp_path):
  on = _opcodes(cubin(variant, 8.0, 8), tmp_path)
  off = _opcodes(cubin(variant, 8.0), tmp_path)
  assert "LDL" not in on and "STL" not in on
  # Rounding down (add.rm) is how the emulation splits x into exponent and fraction.
  assert on.count("FADD.FTZ.RM") > 0 and off.count("FADD.FTZ.RM") == 0
  # tile_n 128: 32 columns per row and thread, 1 in 8 emulated; per softmax copy 2 x 4.
  mufu_on, mufu_off = on.count("MUFU.EX2"), off.count("MUFU.EX2")
  assert mufu_off - mufu_on == on.count("FADD.FTZ.RM"), (mufu_on, mufu_off)
  assert sum(op.startswith("HGMMA") for op in on) == sum(op.startswith("HGMMA") for op in off)


@pytest.mark.parametrize("value,error", [(-1, ValueError), (2.0, TypeError), (True, TypeError)])
def test_exp2_emulation_is_validated(value, error):
  tile = config.TileConfig(128, 128, 2)
  with pytest.raises(error, match="exp2_emulation_every"):
    FlashAttentionForwardSm90(DTYPES["bfloat16"], 128, 128, tile, False,
                              exp2_emulation_every=value)
