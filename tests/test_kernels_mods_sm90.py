"""The forward kernel with score_mod / mask_mod compiled in (kernels/mod_codegen.py), for sm_90a
on a GPU-less host: each recipe's variant builds without local-memory spills, and an identity
score_mod emits no code. Needs nvidia-cutlass-dsl (marker `cutlass`)."""

import ctypes

import jax.numpy as jnp
import pytest

cutlass = pytest.importorskip("cutlass")

from jaxflash import build, config, mod_ir  # noqa: E402
from jaxflash.kernels import compile as kernel_compile  # noqa: E402
from jaxflash.kernels.fwd_sm90 import FlashAttentionForwardSm90  # noqa: E402
from tests import _mod_recipes as recipes  # noqa: E402
from tests import _sass  # noqa: E402

pytestmark = pytest.mark.cutlass

HEADS = 8
RECIPES = {
    "identity": lambda: (recipes.identity, None),
    "alibi": lambda: (recipes.alibi(jnp.asarray(recipes.alibi_slopes(HEADS))), None),
    "t5": lambda: (recipes.t5(jnp.zeros((32, HEADS), jnp.float32)), None),
    "document": lambda: (None, recipes.document(jnp.zeros((2, 256), jnp.int32))),
    "alibi_causal_mask": lambda: (recipes.alibi(jnp.asarray(recipes.alibi_slopes(HEADS))),
                                  recipes.causal),
}
# Two arrays read per score: with each score's score_mod and mask_mod code together this
# spilled 123 LDL / STL at head_dim 128 (a 400-key document array); apply_mods runs them in
# two passes, which leaves 0 at 240 registers per consumer thread (one IR for every extent of
# the arrays: the negative-index wrap reads the extent at run time).
KNOWN_SPILLS = {"alibi_document": lambda: (
    recipes.alibi(jnp.asarray(recipes.alibi_slopes(HEADS))),
    recipes.document(jnp.zeros((2, 256), jnp.int32)))}


# Backward: recipes whose score_mod has a constant derivative by the score (the backward kernel
# takes those): ALiBi, T5, a mask_mod, and a scaled score (factor 2 on dS).
BWD_RECIPES = {
    "identity": RECIPES["identity"],
    "alibi": RECIPES["alibi"],
    "t5": RECIPES["t5"],
    "document": RECIPES["document"],
    "alibi_causal_mask": RECIPES["alibi_causal_mask"],
    "doubled": lambda: (lambda s, b, h, q, k: 2.0 * s, None),
}


def mods_variant(name: str, head_dim: int = 128, dtype: str = "bfloat16",
                 direction: str = "fwd"):
  spec = mod_ir.trace_mods(*{**RECIPES, **KNOWN_SPILLS, **BWD_RECIPES}[name]()).spec
  cfg = config.AttentionConfig(softmax_scale=0.125, mods=spec.canonical())
  assert config.kernel_support(direction, dtype, head_dim, head_dim, cfg)[0]
  return config.KernelVariant.for_call(direction, "sm90a", dtype, head_dim, head_dim, cfg), spec


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  return _sass.exporter(tmp_path_factory)


def test_mods_variant_key_and_schedule():
  variant, spec = mods_variant("alibi")
  assert variant.masked and variant.mods == spec.canonical()
  assert variant.key.endswith(f"-masked-mods{spec.digest}-{variant.schedule.key}")
  # The bias variants' tiles, with the Q slots of the masked variants: no bias tiles take the
  # second slot's shared memory.
  bias = config.KernelVariant.for_call(
      "fwd", "sm90a", "bfloat16", 128, 128,
      config.AttentionConfig(softmax_scale=0.125, bias_dims=(True, True, True)))
  masked = config.KernelVariant.for_call(
      "fwd", "sm90a", "bfloat16", 128, 128,
      config.AttentionConfig(softmax_scale=0.125, window_left=4096))
  assert (variant.schedule.tile_m, variant.schedule.tile_n) == (bias.schedule.tile_m,
                                                                bias.schedule.tile_n)
  assert variant.schedule == masked.schedule
  assert (variant.schedule.q_stages, bias.schedule.q_stages) == (2, 1)
  assert all(v.mods is None for d in config.DIRECTIONS
             for v in config.shipped_variants("sm90a", d))


# The recipes whose registers could spill: ALiBi with a causal mask_mod holds ALiBi alone, and
# identity (test_identity_score_mod_emits_nothing) and ALiBi (test_alibi_adds_few_instructions)
# are compiled at head_dim 128 by the tests of their code.
SPILL_CHECKED = ("alibi_causal_mask", "document", "t5")


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("name", SPILL_CHECKED)
def test_mods_variant_compiles_without_spills(exported, name, head_dim, tmp_path):
  variant, _ = mods_variant(name, head_dim)
  e = exported(variant)
  ops = e.ops()
  _sass.assert_no_spills(ops, variant.key)
  _sass.assert_wgmma_not_serialized(e.sass["main"])
  (tmp_path / "k.cubin").write_bytes(e.exp.cubin)
  resources = build.cubin_resources(tmp_path / "k.cubin")
  assert resources["local_memory_instructions"] == 0
  assert all(k["local_bytes"] == 0 for k in resources["kernels"]), resources
  print(f"{variant.key}: {len(ops)} instructions, registers "
        f"{[k['registers'] for k in resources['kernels']]}")
  if name in ("alibi", "t5", "document", "alibi_document"):
    assert "LDG" in ops  # the closed-over arrays are read per score


@pytest.mark.parametrize("head_dim, most", [(64, 0), (128, 0)])
def test_two_arrays_per_score_spill_at_most_as_measured(exported, head_dim, most):
  """ALiBi with a document mask: the spills measured (KNOWN_SPILLS), which must not grow."""
  variant, _ = mods_variant("alibi_document", head_dim)
  ops = exported(variant).ops()
  assert ops.count("LDL") + ops.count("STL") <= most, variant.key


def test_identity_score_mod_emits_nothing(exported, tmp_path):
  """The identity's variant is the plain masked kernel without the fixed capped max (which
  every mods variant leaves off): the same instruction count."""
  variant, _ = mods_variant("identity")
  plain = config.KernelVariant.for_call(
      "fwd", "sm90a", "bfloat16", 128, 128,
      config.AttentionConfig(softmax_scale=0.125, window_left=4096))
  assert plain.schedule == variant.schedule
  kernel = FlashAttentionForwardSm90(plain)
  kernel.fixed_capped_max = False
  plain_sass = kernel_compile.disassemble(
      kernel_compile.export_variant(plain, tmp_path, kernel=kernel).cubin, tmp_path)
  assert len(exported(variant).ops()) == len(_sass.opcodes(plain_sass))


def test_alibi_adds_few_instructions(exported):
  """ALiBi's score step against the identity's: a bounded number of instructions per score
  (each thread holds 64 scores of a 128 x 128 tile; the masked and unmasked block paths and
  the first block each carry a copy)."""
  identity = len(exported(mods_variant("identity")[0]).ops())
  alibi = len(exported(mods_variant("alibi")[0]).ops())
  extra_per_score = (alibi - identity) / 64
  print(f"ALiBi: {alibi - identity} instructions over the identity ({extra_per_score:.1f} per "
        f"score of a thread)")
  assert 0 < extra_per_score < 40


class _ModsInfo(ctypes.Structure):
  """kernel_abi.h's JaxflashVariantInfo, through its mods fields."""
  _fields_ = [(name, ctypes.c_int32) for name in (
      "direction", "dtype", "head_dim", "head_dim_v", "causal", "deterministic", "tile_m",
      "max_dq_copies", "masked", "tile_n", "tile_counter", "kv_fp8", "bias", "mod_arrays")] + [
          ("mod_dtypes", ctypes.c_int32 * 4), ("mod_ranks", ctypes.c_int32 * 4)]


def test_linked_library_describes_its_arrays(exported, tmp_path):
  """The variant library's info lists the closed-over arrays' dtype codes and ranks, which the
  handler checks each call's operands against (T5: a float32 (buckets, heads) table; the
  document mask: int32 (batch, seq) ids)."""
  spec = mod_ir.trace_mods(RECIPES["t5"]()[0], RECIPES["document"]()[1]).spec
  cfg = config.AttentionConfig(softmax_scale=0.125, mods=spec.canonical())
  variant = config.KernelVariant.for_call("fwd", "sm90a", "bfloat16", 64, 64, cfg)
  lib_path = tmp_path / "lib.so"
  build.link_variant(exported(variant).exp, variant, lib_path)
  lib = ctypes.CDLL(str(lib_path))
  lib.jaxflash_variant_info.restype = ctypes.POINTER(_ModsInfo)
  info = lib.jaxflash_variant_info().contents
  codes = kernel_compile.MOD_DTYPE_CODES
  assert (info.masked, info.bias, info.mod_arrays) == (1, 0, 2)
  assert list(info.mod_dtypes) == [codes["float32"], codes["int32"], 0, 0]
  assert list(info.mod_ranks) == [2, 2, 0, 0]


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("name", SPILL_CHECKED + ("doubled",))
def test_mods_backward_variant_compiles_without_spills(exported, name, head_dim):
  """The backward kernel with score_mod / mask_mod on S^T (64 x 128 swapped tiles at both head
  dims: at 128 the 80 x 128 tile spilled 110 LDL / STL with the document mask)."""
  variant, _ = mods_variant(name, head_dim, direction="bwd")
  assert variant.schedule.tile_m == 64 and variant.schedule.swap_sdp
  e = exported(variant)
  _sass.assert_no_spills(e.ops(), variant.key)
  print(f"{variant.key}: {len(e.ops())} instructions")
  if name in ("alibi", "t5", "document"):
    assert "LDG" in e.ops()


@pytest.mark.parametrize("head_dim, most", [(64, 0), (128, 64)])
def test_two_arrays_per_score_in_the_backward_spill_at_most_as_measured(exported, head_dim,
                                                                         most):
  """ALiBi with a document mask in the backward: the spills measured (64 LDL / STL at head_dim
  128 with a 256-key document array), which must not grow."""
  variant, _ = mods_variant("alibi_document", head_dim, direction="bwd")
  ops = exported(variant).ops()
  assert ops.count("LDL") + ops.count("STL") <= most, variant.key


def test_backward_kernel_takes_constant_derivatives_only():
  """softcap as a score_mod (derivative 1 - tanh^2) keeps the reference backward; so do a
  softcap option and deterministic=True."""
  for fns, options in (((recipes.softcap(20.0), None), {}),
                       ((recipes.identity, None), dict(softcap=10.0)),
                       ((recipes.identity, None), dict(deterministic=True))):
    spec = mod_ir.trace_mods(*fns).spec
    cfg = config.AttentionConfig(softmax_scale=0.125, mods=spec.canonical(), **options)
    assert config.kernel_support("fwd", "bfloat16", 64, 64, cfg)[0]
    ok, reason = config.kernel_support("bwd", "bfloat16", 64, 64, cfg)
    assert not ok and "score_mod / mask_mod" in reason
