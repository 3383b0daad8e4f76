"""kernels/mod_codegen.py: every IR op and every recipe compiles to sm_90a device code (a
one-thread-per-point harness kernel around mod_codegen.emit), with the guards XLA's semantics
need visible in the SASS. Running that code needs a GPU (tests/test_gpu_mods.py)."""

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

cutlass = pytest.importorskip("cutlass")
import cuda.bindings.driver as cuda  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import Float32, Int32  # noqa: E402
from cutlass.cute.runtime import make_fake_stream, make_fake_tensor  # noqa: E402

from jaxflash import mod_ir  # noqa: E402
from jaxflash.kernels import compile as kernel_compile  # noqa: E402
from jaxflash.kernels import mod_codegen  # noqa: E402
from tests import _mod_recipes as recipes  # noqa: E402
from tests import _sass  # noqa: E402

pytestmark = pytest.mark.cutlass


def _harness(program, which: str):
  """A kernel: out[t] = IR(score[t], idx[t, 0..3]) for one thread per point."""

  @cute.kernel
  def kernel(out: cute.Tensor, score: cute.Tensor, idx: cute.Tensor, arrays: tuple):
    t, _, _ = cute.arch.thread_idx()
    inputs = {"score": score[t], "batch": idx[t, 0], "head": idx[t, 1], "q_idx": idx[t, 2],
              "kv_idx": idx[t, 3]}
    value = mod_codegen.emit(program[which], inputs, arrays)
    if cutlass.const_expr(which == "mask"):
      out[t] = mod_codegen._select(value, Float32(1.0), Float32(0.0))
    else:
      out[t] = value

  @cute.jit
  def host(out: cute.Tensor, score: cute.Tensor, idx: cute.Tensor, a0: Optional[cute.Tensor],
           a1: Optional[cute.Tensor], stream: cuda.CUstream):
    arrays = tuple(a for a in (a0, a1) if cutlass.const_expr(a is not None))
    kernel(out, score, idx, arrays).launch(grid=[1, 1, 1], block=[128, 1, 1], stream=stream)

  return host


def _fake_array(dtype: str, rank: int):
  shape = tuple(cute.sym_int32() for _ in range(max(rank, 1)))
  strides = tuple(cute.sym_int64() for _ in range(max(rank, 1) - 1)) + (1,)
  return make_fake_tensor(mod_codegen.storage_type(dtype), shape, strides, assumed_align=1)


def _compile_sass(traced: mod_ir.TracedMods, which: str, tmp_path) -> str:
  kernel_compile.load_dsl_runtime()
  program = mod_codegen.parse(traced.spec.canonical())
  n = cute.sym_int32()
  out = make_fake_tensor(Float32, (n,), (1,), assumed_align=4)
  score = make_fake_tensor(Float32, (n,), (1,), assumed_align=4)
  idx = make_fake_tensor(Int32, (n, 4), (4, 1), assumed_align=16)
  arrays = [_fake_array(d, r) for d, r in program["arrays"]] + [None, None]
  compiled = cute.compile(_harness(program, which), out, score, idx, arrays[0], arrays[1],
                          make_fake_stream(), options="--gpu-arch sm_90a")
  tmp_path.mkdir(parents=True, exist_ok=True)
  compiled.export_to_c(str(tmp_path), "harness", "harness")
  cubin = kernel_compile.extract_cubin(tmp_path / "harness.o")
  return kernel_compile.disassemble(cubin, tmp_path)


def _every_op(s, b, h, q, k):
  f = s * 0.5 - 1.0
  x = (jnp.exp(f) + jnp.exp2(f) + jnp.log(jnp.abs(f) + 1) + jnp.log1p(jnp.abs(f))
       + jnp.expm1(f) + jnp.tanh(f) + jnp.sqrt(jnp.abs(f)) + lax.rsqrt(jnp.abs(f) + 1)
       + jnp.floor(f) + jnp.ceil(f) + jnp.round(f) + lax.round(f) + jax_nn_sigmoid(f)
       + jnp.sign(f) + f ** 2 + f ** -3 + jnp.square(f) + jnp.maximum(f, 0.0)
       + jnp.minimum(f, 1.0) + lax.rem(f, 3.0) + f / 7.0 + lax.clamp(-1.0, f, 1.0))
  d = q - k
  i = (lax.div(d, 7) + lax.rem(d, 5) + d // 3 + d % 4 + (d >> 2) + (q << 3)
       + lax.shift_right_logical(d, b) + jnp.abs(d) + jnp.sign(d) + (~d) + (d ^ h) + (d & 3)
       + (d | 1) + jnp.clip(d, -3, 3) + (f * 1e3).astype(jnp.int32)
       + (f * 10).astype(jnp.int8).astype(jnp.int32) + (d.astype(jnp.int8) * 3).astype(
           jnp.int32) + (f.astype(jnp.uint32) >> 2).astype(jnp.int32))
  keep = (~(q > k) | (h == 2)) & jnp.isfinite(f) & (d != 0)
  y = jnp.where(keep, x, -x) + i.astype(jnp.float32) + f.astype(jnp.bfloat16).astype(
      jnp.float32) + (f.astype(jnp.float16) * 3).astype(jnp.float32)
  return lax.select_n(jnp.clip(d, 0, 2), y, 2 * y, 3 * y)


def jax_nn_sigmoid(x):
  import jax
  return jax.nn.sigmoid(x)


def test_every_op_compiles(tmp_path):
  traced = mod_ir.trace_mods(_every_op, None)
  ops = {e[0] for e in traced.spec.score.eqns} | {e[0] for e in traced.spec.dscore.eqns}
  missing = {"exp", "exp2", "log", "log1p", "expm1", "tanh", "sqrt", "rsqrt", "floor", "ceil",
             "round", "logistic", "sign", "integer_pow", "max", "min", "rem", "div", "clamp",
             "shift_left", "shift_right_arithmetic", "shift_right_logical", "not", "xor", "and",
             "or", "convert", "select_n", "abs", "is_finite"} - ops
  assert not missing
  sass = _compile_sass(traced, "score", tmp_path / "f")
  assert "MUFU" in sass
  _compile_sass(traced, "dscore", tmp_path / "d")


@pytest.mark.parametrize("name", ["alibi", "t5", "document", "prefix_lm", "chunked", "fill",
                                  "constant_mask", "constant_select"])
def test_recipes_compile(name, tmp_path):
  table = jnp.ones((32, 8), jnp.float32)
  fns = {
      "alibi": (recipes.alibi(jnp.ones((8,), jnp.bfloat16)), None),
      "t5": (recipes.t5(table), None),
      "document": (None, recipes.document(jnp.zeros((2, 64), jnp.int32))),
      "prefix_lm": (None, recipes.prefix_lm(jnp.zeros((2,), jnp.int32))),
      "chunked": (None, recipes.chunked(128)),
      "fill": (lambda s, b, h, q, k: s + table.at[q, k].get(mode="fill", fill_value=-1.0), None),
      # Literal predicates: a mask_mod that folds to False, a select on a literal.
      "constant_mask": (None, lambda b, h, q, k: jnp.zeros((), jnp.bool_)),
      "constant_select": (lambda s, b, h, q, k: jax.lax.select(True, s, s * 2.0), None),
  }
  traced = mod_ir.trace_mods(*fns[name])
  which = "score" if fns[name][0] is not None else "mask"
  sass = _compile_sass(traced, which, tmp_path)
  assert _sass.opcodes(sass)
  if traced.spec.arrays:
    assert "LDG" in sass
