"""jaxflash.mod_ir: score_mod / mask_mod -> IR. The IR's evaluation matches JAX's evaluation of
the function on random scalars (forward, derivative by the score, gradients of closed-over
arrays); the spec's digest ignores array values and sees literals; unsupported code is named."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jaxflash import mod_ir
from tests import _mod_recipes as recipes
from tests._cases import x64

N = 4096  # random (score, batch, head, q_idx, kv_idx) points per check
B, H, S = 3, 8, 700


def _points(seed: int = 0):
  rng = np.random.default_rng(seed)
  score = jnp.asarray(rng.normal(scale=4.0, size=N), jnp.float32)
  idx = [jnp.asarray(rng.integers(0, n, size=N), jnp.int32) for n in (B, H, S, S)]
  return score, idx


def _arrays():
  rng = np.random.default_rng(1)
  return {
      "slopes": jnp.asarray(recipes.alibi_slopes(H)),
      "table": jnp.asarray(rng.normal(size=(32, H)), jnp.float32),
      "prefix": jnp.asarray(rng.integers(0, S, size=B), jnp.int32),
      "docs": jnp.asarray(np.sort(rng.integers(0, 9, size=(B, S)), axis=1), jnp.int32),
  }


def _score_recipes(a):
  return {"alibi": recipes.alibi(a["slopes"]), "t5": recipes.t5(a["table"]),
          "softcap": recipes.softcap(30.0), "identity": recipes.identity}


def _mask_recipes(a):
  return {"prefix_lm": recipes.prefix_lm(a["prefix"]), "document": recipes.document(a["docs"]),
          "window": recipes.sliding_window(96), "chunked": recipes.chunked(128),
          "causal": recipes.causal}


def _eval_ir(ir, arrays, score, idx):
  names = mod_ir.SCORE_INPUTS if score is not None else mod_ir.MASK_INPUTS
  args = ((score,) if score is not None else ()) + tuple(idx)
  return jax.vmap(lambda *xs: mod_ir.evaluate(ir, dict(zip(names, xs)), arrays))(*args)


@pytest.mark.parametrize("name", ["alibi", "t5", "softcap", "identity"])
def test_score_mod_ir_matches_jax(name):
  a = _arrays()
  fn = _score_recipes(a)[name]
  traced = mod_ir.trace_mods(fn, None)
  score, idx = _points()
  want = jax.vmap(fn)(score, *idx)
  got = _eval_ir(traced.spec.score, traced.arrays, score, idx)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  dwant = jax.vmap(jax.grad(fn))(score, *idx)
  dgot = _eval_ir(traced.spec.dscore, traced.arrays, score, idx)
  np.testing.assert_allclose(dgot, dwant, rtol=1e-6, atol=1e-6)
  assert traced.spec.mask is None


@pytest.mark.parametrize("name", ["prefix_lm", "document", "window", "chunked", "causal"])
def test_mask_mod_ir_matches_jax(name):
  a = _arrays()
  fn = _mask_recipes(a)[name]
  traced = mod_ir.trace_mods(None, fn)
  _, idx = _points(2)
  want = jax.vmap(fn)(*idx)
  got = _eval_ir(traced.spec.mask, traced.arrays, None, idx)
  assert got.dtype == jnp.bool_
  np.testing.assert_array_equal(got, want)
  assert 0 < int(want.sum()) < N or name == "prefix_lm"  # the points cover both outcomes


def test_recipes_close_over_arrays_as_operands():
  a = _arrays()
  assert mod_ir.trace_mods(_score_recipes(a)["alibi"], None).spec.arrays == (("float32", 1),)
  t = mod_ir.trace_mods(_score_recipes(a)["t5"], _mask_recipes(a)["document"])
  assert t.spec.arrays == (("float32", 2), ("int32", 2))
  assert t.arrays[0] is a["table"] and t.arrays[1] is a["docs"]
  assert mod_ir.trace_mods(recipes.softcap(30.0), recipes.causal).spec.arrays == ()


def test_array_gradients_through_the_ir_match_jax():
  """The IR as a function of the closed-over arrays: JAX differentiates it into the arrays'
  cotangents (the path of the slopes' and the table's gradients)."""
  a = _arrays()
  score, idx = _points(3)
  ct = jnp.asarray(np.random.default_rng(4).normal(size=N), jnp.float32)
  for make, key in ((recipes.alibi, "slopes"), (recipes.t5, "table")):
    traced = mod_ir.trace_mods(make(a[key]), None)
    ir = traced.spec.score
    got = jax.grad(lambda arr: jnp.vdot(_eval_ir(ir, (arr,), score, idx), ct))(a[key])
    want = jax.grad(lambda arr: jnp.vdot(jax.vmap(make(arr))(score, *idx), ct))(a[key])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_gather_modes():
  """Reads by gather: mode fill gives the fill value outside the array, clip clamps."""
  table = jnp.arange(12.0, dtype=jnp.float32).reshape(3, 4)
  fns = {"fill": lambda s, b, h, q, k: s + table.at[q, k].get(mode="fill", fill_value=-7.0),
         "fill_default": lambda s, b, h, q, k: s + table.at[q, k].get(mode="fill"),
         "clip": lambda s, b, h, q, k: s + jnp.take(table[:, 0], q, mode="clip")}
  q = jnp.arange(-5, 8, dtype=jnp.int32)
  k = jnp.flip(q)
  zero = jnp.zeros_like(q)
  s = jnp.zeros(q.shape, jnp.float32)
  for name, fn in fns.items():
    if name == "clip":  # table[:, 0] is computed from the array: a read of it is unsupported
      with pytest.raises(mod_ir.UnsupportedModError, match="gather"):
        mod_ir.trace_mods(fn, None)
      continue
    traced = mod_ir.trace_mods(fn, None)
    got = _eval_ir(traced.spec.score, traced.arrays, s, (zero, zero, q, k))
    np.testing.assert_array_equal(got, jax.vmap(fn)(s, zero, zero, q, k))
  col = table[:, 0]
  clip = lambda s_, b, h, q_, k_: s_ + jnp.take(col, q_, mode="clip")
  traced = mod_ir.trace_mods(clip, None)
  got = _eval_ir(traced.spec.score, traced.arrays, s, (zero, zero, q, k))
  np.testing.assert_array_equal(got, jax.vmap(clip)(s, zero, zero, q, k))


def test_negative_indices_wrap_by_the_run_time_extent():
  """JAX wraps a negative index by the array's extent: the IR takes that extent from the array
  it reads (a ("dim", k, axis) ref, no literal), so evaluating one IR on arrays of other
  extents matches JAX's own function of each."""
  def make(table):
    return lambda s, b, h, q, k: s + table[q, k - 3]
  small = jnp.arange(12.0, dtype=jnp.float32).reshape(3, 4)
  ir = mod_ir.trace_mods(make(small), None).spec.score
  assert not any(r[:2] == ("lit", 3) or r[:2] == ("lit", 4) for e in ir.eqns for r in e[1]
                 if e[0] == "add")
  q = jnp.arange(-9, 9, dtype=jnp.int32)
  k = jnp.flip(q)
  zero = jnp.zeros_like(q)
  s = jnp.zeros(q.shape, jnp.float32)
  for table in (small, jnp.arange(35.0, dtype=jnp.float32).reshape(5, 7)):
    got = _eval_ir(ir, (table,), s, (zero, zero, q, k))
    np.testing.assert_array_equal(got, jax.vmap(make(table))(s, zero, zero, q, k))


def test_integer_semantics_match_xla():
  """Integer div / rem toward zero, floor division and modulo by jnp, shifts, casts."""
  def fn(s, b, h, q, k):
    d = q - k
    x = (lax.div(d, 7) + lax.rem(d, 5) + d // 3 + d % 4 + (d >> 2) + (q << 3)
         + lax.shift_right_logical(d, 28))
    return s * x.astype(jnp.float32) + jnp.round(s) + jnp.floor(s) + jnp.ceil(s) + (
        (s * 1e9).astype(jnp.int32).astype(jnp.float32))
  traced = mod_ir.trace_mods(fn, None)
  score, idx = _points(5)
  np.testing.assert_allclose(_eval_ir(traced.spec.score, traced.arrays, score, idx),
                             jax.vmap(fn)(score, *idx), rtol=1e-6)


def test_spec_round_trips_through_json():
  a = _arrays()
  spec = mod_ir.trace_mods(_score_recipes(a)["t5"], _mask_recipes(a)["document"]).spec
  again = mod_ir.ModSpec.from_json(json.loads(spec.canonical()))
  assert again == spec and again.digest == spec.digest
  nan = mod_ir.trace_mods(lambda s, b, h, q, k: jnp.where(q > k, jnp.nan, s), None).spec
  assert mod_ir.ModSpec.from_json(json.loads(nan.canonical())) == nan


def test_digest_ignores_array_values_and_sees_literals():
  a = _arrays()
  one = mod_ir.trace_mods(recipes.alibi(a["slopes"]), None).spec
  other = mod_ir.trace_mods(recipes.alibi(a["slopes"] * 3.0 + 1.0), None).spec
  assert one.digest == other.digest
  # Another length of the same dtype and rank: the same kernel (shapes are run-time operands).
  longer = mod_ir.trace_mods(recipes.alibi(jnp.ones((2 * H,), jnp.float32)), None).spec
  assert longer.arrays == one.arrays and longer.digest == one.digest
  docs = lambda s: mod_ir.trace_mods(None, recipes.document(jnp.zeros((B, s), jnp.int32))).spec
  assert docs(S).digest == docs(2 * S + 1).digest
  assert mod_ir.trace_mods(recipes.softcap(30.0), None).spec.digest != (
      mod_ir.trace_mods(recipes.softcap(20.0), None).spec.digest)
  assert mod_ir.trace_mods(None, recipes.sliding_window(96)).spec.digest != (
      mod_ir.trace_mods(None, recipes.sliding_window(97)).spec.digest)
  # The dtype of a closed-over array is part of it.
  assert mod_ir.trace_mods(recipes.alibi(a["slopes"].astype(jnp.bfloat16)), None).spec.digest \
      != one.digest


_TABLE = jnp.arange(8.0, dtype=jnp.float32)


@pytest.mark.parametrize("fn, primitive", [
    (lambda s, b, h, q, k: s + jnp.sort(_TABLE)[h], "sort"),
    (lambda s, b, h, q, k: lax.cond(q > k, lambda x: x * 2.0, lambda x: x, s), "cond"),
    (lambda s, b, h, q, k: s + lax.erf(s), "erf"),
], ids=["sort", "cond", "erf"])
def test_unsupported_primitive_is_named(fn, primitive):
  with pytest.raises(mod_ir.UnsupportedModError, match=rf"score_mod: .*{primitive}") as e:
    mod_ir.trace_mods(fn, None)
  assert "select_n" in str(e.value) and "reference" in str(e.value)


def test_float64_array_is_rejected_by_name():
  with x64():
    table = jnp.ones((4,), jnp.float64)
    with pytest.raises(mod_ir.UnsupportedModError, match="float64"):
      mod_ir.trace_mods(lambda s, b, h, q, k: s + table[h].astype(jnp.float32), None)


def test_python_branch_fails_at_trace_time():
  def branchy(b, h, q_idx, kv_idx):
    if q_idx > kv_idx:
      return True
    return False
  with pytest.raises(jax.errors.TracerBoolConversionError):
    mod_ir.trace_mods(None, branchy)


def test_non_scalar_results_are_rejected():
  with pytest.raises(mod_ir.UnsupportedModError, match="not a scalar|scalar"):
    mod_ir.trace_mods(None, lambda b, h, q, k: jnp.arange(3) == q)


def test_ir_is_pruned_to_the_output():
  """jax.grad's jaxpr computes the primal too; the derivative IR keeps only what it needs."""
  a = _arrays()
  spec = mod_ir.trace_mods(recipes.alibi(a["slopes"]), None).spec
  assert spec.dscore.eqns == () and spec.dscore.output[0] == "lit"
  assert mod_ir.trace_mods(recipes.identity, None).spec.score == mod_ir.ModIR(
      mod_ir.SCORE_INPUTS, (), ("in", "score"))


def test_equations_of_literals_fold():
  """jax.grad of a scaled score gives `mul 2.0 1.0`: folded to the constant 2.0 (the backward
  kernel takes constant derivatives); T5's log(max_distance / exact) is a constant too."""
  spec = mod_ir.trace_mods(lambda s, b, h, q, k: 2.0 * s, None).spec
  assert spec.dscore.eqns == () and spec.dscore.output == ("lit", (2.0).hex(), "float32")
  t5 = mod_ir.trace_mods(recipes.t5(jnp.ones((32, H), jnp.float32)), None).spec.score
  assert [e[0] for e in t5.eqns].count("log") == 1  # only the per-score log remains


def test_folding_works_under_an_outer_jit_trace():
  """trace_mods runs inside jaxflash.attention, often under jit: folded literals stay
  concrete there."""
  def inside(x):
    spec = mod_ir.trace_mods(lambda s, b, h, q, k: 3.0 * s * x, None).spec
    assert spec.dscore.output[0] == "v"  # depends on the closed-over x: not a constant
    folded = mod_ir.trace_mods(lambda s, b, h, q, k: 2.0 * s, None).spec
    assert folded.dscore.output == ("lit", (2.0).hex(), "float32")
    return x
  jax.jit(inside)(jnp.float32(1.0))


def test_one_minus_square_evaluates_as_jax_computes_it():
  """jax.grad of tanh emits one_minus_square (JAX 0.11): (1 + x) (1 - x) in the IR's dtype."""
  x = jnp.asarray([0.0, 0.5, -0.75, 1.0, 3.0], jnp.float32)
  np.testing.assert_array_equal(mod_ir._apply("one_minus_square", [x], {}, "float32"),
                                (1 + x) * (1 - x))
  half = x.astype(jnp.bfloat16)
  assert mod_ir._apply("one_minus_square", [half], {}, "bfloat16").dtype == jnp.bfloat16
