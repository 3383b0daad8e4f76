"""The benchmark script's CPU-checkable parts: the clock spin-up and its argument."""

import json

import pytest

from tests._scripts import load_script


@pytest.fixture(scope="module")
def bench():
  return load_script("benchmarks/bench_attention.py")


def test_spin_up_runs_matmuls_for_the_given_time(bench):
  assert bench.spin_up(0.0) == 0
  assert bench.spin_up(0.05, size=32) >= 1


@pytest.mark.parametrize("text", ["-1", "nan"])
def test_spin_up_argument_rejects_bad_seconds(bench, text, capsys):
  with pytest.raises(SystemExit):
    bench.main(["--spin-up", text])
  assert "--spin-up" in capsys.readouterr().err


@pytest.fixture(scope="module")
def masked():
  return load_script("benchmarks/bench_masked.py")


def test_masked_benchmark_counts_the_pairs_its_masks_keep(masked):
  """The effective TFLOP/s rest on these counts: against the brute-force mask."""
  import numpy as np
  i, j = np.arange(40)[:, None], np.arange(40)[None, :]
  for left, right in ((7, 0), (5, 3), (100, 0)):
    assert masked.window_pairs(40, left, right) == int(((j >= i - left) & (j <= i + right)).sum())
  ids = np.repeat(np.arange(3), [5, 1, 34])
  causal_docs = (j <= i) & (ids[:, None] == ids[None, :])
  assert masked.causal_pairs([5, 1, 34]) == int(causal_docs.sum())
  lengths = masked.packed_lengths("packed11")
  assert sum(lengths) == 16384 and min(lengths) >= 1
  assert masked.packed_lengths("packed8") == [2048] * 8


def test_masked_benchmark_cases_pass_their_ids_as_arguments(masked):
  """Segment ids are run-time data of every timed call (so the block-range preparation is
  timed, as in a training step), and the cases are the ones the CLI accepts."""
  cases = masked.cases()
  assert set(cases) == set(masked.CASES)
  for name in ("packed8", "packed11", "padded"):
    q_ids, kv_ids = cases[name].data[:2]
    assert q_ids.shape == kv_ids.shape == cases[name].shape and q_ids.dtype == "int32"


def test_prep_timing_runs_a_chain_of_whole_preparations(masked):
  """`--prep` divides the time of a chain of PREP_CHAIN preparations by its length: each link
  must stay a preparation of its own in the compiled program (the backward's: its own tile-order
  sort, neither merged with the others nor hoisted; the forward's order is a constant, so it
  sorts nothing), and the chain must compute one call's operands."""
  import re

  import numpy as np

  from jaxflash import block_ranges
  from jaxflash.config import AttentionConfig, KernelVariant
  q_ids, kv_ids = masked.cases()["packed11"].data[:2]
  (b, s) = q_ids.shape
  config = AttentionConfig(softmax_scale=masked.HEAD_DIM ** -0.5, causal=True,
                           has_segment_ids=True)
  for direction, operands in (("fwd", block_ranges.forward_operands),
                              ("bwd", block_ranges.backward_operands)):
    chain = masked.prep_chain(direction, b, s)
    compiled = chain.lower(q_ids, kv_ids).compile().as_text()
    sorts = masked.PREP_CHAIN if direction == "bwd" else 0
    assert len(re.findall(r"\bsort\(", compiled)) == sorts
    variant = KernelVariant.for_call(direction, "sm90a", "bfloat16", masked.HEAD_DIM,
                                     masked.HEAD_DIM, config)
    heads = () if direction == "fwd" else (masked.HEADS, masked.HEADS)  # backward: heads, kv heads
    want = operands(variant, config, b, s, s, *heads, (q_ids, kv_ids))
    got = chain(q_ids, kv_ids)
    assert len(got) == len(want) == 4
    for g, w in zip(got, want):
      np.testing.assert_array_equal(g, w)


def test_modifier_benchmark_columns_are_the_calls_they_name():
  import jax.numpy as jnp
  import numpy as np

  import jaxflash
  modifiers = load_script("benchmarks/bench_modifiers.py")
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.standard_normal((1, 16, 2, 8)), jnp.float32) for _ in range(3))
  sink = jnp.asarray([0.5, -1.0], jnp.float32)
  run = lambda impl: modifiers.attend_fn(impl, True, "reference")(q, k, v, sink)
  one_document = jnp.zeros((1, 16), jnp.int32)
  want = {"jaxflash": {}, "softcap": {"softcap": modifiers.SOFTCAP},
          "sink": {"learnable_sink": sink},
          "masked": {"q_segment_ids": one_document, "kv_segment_ids": one_document}}
  for impl, options in want.items():
    np.testing.assert_array_equal(run(impl), jaxflash.attention(
        q, k, v, causal=True, implementation="reference", **options))
  assert not np.array_equal(run("sink"), run("jaxflash"))
  np.testing.assert_allclose(run("masked"), run("jaxflash"), rtol=1e-6, atol=1e-6)
  capped_half = modifiers.attend_fn("softcap", True, "reference", softcap=0.5)(q, k, v, sink)
  np.testing.assert_array_equal(capped_half, jaxflash.attention(
      q, k, v, causal=True, implementation="reference", softcap=0.5))
  assert not np.array_equal(capped_half, run("softcap"))
  grads = modifiers.fwd_bwd_fn(modifiers.attend_fn("sink", True, "reference"), q)(q, k, v, sink)
  assert len(grads) == 4 and np.any(np.asarray(grads[3]) != 0)


def test_gpt_oss_columns_are_the_calls_they_name():
  import jax
  import jax.numpy as jnp
  import numpy as np

  import jaxflash
  modifiers = load_script("benchmarks/bench_modifiers.py")
  rng = np.random.default_rng(1)
  q = jnp.asarray(rng.standard_normal((1, 200, 8, 16)), jnp.float32)
  k, v = (jnp.asarray(rng.standard_normal((1, 200, 1, 16)), jnp.float32) for _ in range(2))
  sink = jnp.asarray(rng.standard_normal(8), jnp.float32)
  run = lambda impl: modifiers.gpt_oss_fn(impl, "reference")(q, k, v, sink)
  window = (modifiers.GPT_OSS["window"], 0)
  want = {"causal": {}, "window": {"window_size": window},
          "window+sink": {"window_size": window, "learnable_sink": sink}}
  for impl, options in want.items():
    np.testing.assert_array_equal(run(impl), jaxflash.attention(
        q, k, v, causal=True, implementation="reference", **options))
  assert not np.array_equal(run("window"), run("causal"))  # 200 keys: the window of 128 bites
  # FA-3's column is its binding with the same window and sinks (lowered for CUDA: no GPU).
  lowered = jax.jit(modifiers.gpt_oss_fn(modifiers.GPT_OSS_FA3)).trace(
      q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), sink).lower(
          lowering_platforms=("cuda",)).as_text()
  assert "custom_call @dew_flash3_mha_fwd" in lowered
  assert "window_size_left = 128" in lowered and "window_size_right = 0" in lowered


@pytest.mark.parametrize("seq,window", [(1, None), (5, None), (1, 128), (100, 128), (300, 128),
                                        (129, 128)])
def test_gpt_oss_pair_count_is_the_mask_population(seq, window):
  import numpy as np
  modifiers = load_script("benchmarks/bench_modifiers.py")
  i, j = np.meshgrid(np.arange(seq), np.arange(seq), indexing="ij")
  keep = j <= i
  if window is not None:
    keep &= j >= i - window
  assert modifiers.kept_pairs(seq, window) == int(keep.sum())


def test_modifier_cells_record_time_or_the_failure(capsys):
  import jax.numpy as jnp
  modifiers = load_script("benchmarks/bench_modifiers.py")
  ok = modifiers.timed_record(lambda x: x * 2, (jnp.ones(4),), 1e9, impl="double", seq=4)
  assert ok["impl"] == "double" and ok["ms"] > 0
  assert abs(ok["tflops"] - 1e9 / (ok["ms"] * 1e-3) / 1e12) < 1e-9 and "note" not in ok
  bad = modifiers.timed_record(lambda x: x.reshape(3), (jnp.ones(4),), 1e9, impl="broken")
  assert bad["ms"] is None and bad["tflops"] is None and bad["note"].startswith("failed: ")
  assert '"impl": "broken"' in capsys.readouterr().out  # printed as soon as measured


def test_chain_benchmark_feeds_each_output_to_the_next_call():
  import jax.numpy as jnp
  import numpy as np

  import jaxflash
  chain = load_script("benchmarks/bench_chain.py")
  q, k, v = chain.inputs(jnp.float32)
  assert q.shape == (chain.SHAPE["batch"], chain.SHAPE["seq"], chain.SHAPE["heads"],
                     chain.SHAPE["head_dim"])
  q, k, v = q[:, :32], k[:, :32], v[:, :32]
  attend = chain.attend_fn("jaxflash", "reference")
  want = q
  for _ in range(3):
    want = jaxflash.attention(want, k, v, causal=True, implementation="reference")
  np.testing.assert_array_equal(chain.chain_fn(attend, 3)(q, k, v), want)


def test_fp8_accuracy_baseline_is_one_descale_per_tensor():
  import jax.numpy as jnp
  import numpy as np
  acc = load_script("benchmarks/fp8_accuracy.py")
  q, k, v = acc.outlier_inputs((2, 64, 4, 64), seed=0)
  assert q.dtype == jnp.bfloat16 and float(jnp.max(jnp.abs(q))) > 6  # the outliers are there
  x8, descale = acc.per_tensor(q, num_kv_heads=2)
  assert descale.shape == (2, 2) and np.unique(np.asarray(descale)).size == 1
  np.testing.assert_allclose(float(descale[0, 0]),
                             float(jnp.max(jnp.abs(q.astype(jnp.float32)))) / 448.0, rtol=1e-6)
  assert float(jnp.max(jnp.abs(x8.astype(jnp.float32)))) == 448.0
  schemes = acc.schemes(q, k, v, 32)
  assert list(schemes) == ["fp8 per-tensor", "fp8 per-head", "fp8 block 32",
                           "fp8 block 32 + Hadamard", "fp8 block 32 + Hadamard, value blocks"]
  rotated, value_blocks = schemes["fp8 block 32 + Hadamard"], schemes[
      "fp8 block 32 + Hadamard, value blocks"]
  for i in (0, 1, 3, 4):  # query and key as quantize_fp8 rotates and quantizes them
    np.testing.assert_array_equal(np.asarray(rotated[i], np.float32),
                                  np.asarray(value_blocks[i], np.float32))
  assert np.unique(np.asarray(rotated[5][0, 0])).size == 1  # one value descale per head
  assert np.unique(np.asarray(value_blocks[5][0, 0])).size == 2  # one per block of 32


def test_fp8_accuracy_sink_like_key_leads_every_row_by_the_score():
  import jax.numpy as jnp
  import numpy as np
  acc = load_script("benchmarks/fp8_accuracy.py")
  q, k, _ = acc.outlier_inputs((1, 256, 2, 64), seed=1)
  q, k = acc.with_sink_like_key(q, k, 12.0)
  s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k.astype(jnp.float32)) / 8.0
  lead = np.asarray(s[..., 0] - jnp.mean(s[..., 1:], axis=-1))
  assert np.all(lead > 6.0) and 9.0 < np.median(lead) < 15.0


def test_fp8_accuracy_score_sums_measure_the_one_key_lse(tmp_path, capsys):
  """On the CPU the reference's float32 sums: errors at float32 rounding, not e4m3's 2^-13."""
  acc = load_script("benchmarks/fp8_accuracy.py")
  assert acc.main(["--score-sums", "--out", str(tmp_path)]) == 0
  rows = json.loads((tmp_path / "fp8_score_sums.json").read_text())
  assert list(rows) == ["64", "128", "256"]
  for value in rows.values():
    assert 0 < value["max error / sum |terms|"] < 1e-6 and 0 < value["relative RMS"] < 1e-6
  assert "head_dim 256: max error / sum |terms|" in capsys.readouterr().out


@pytest.mark.parametrize("script", ["benchmarks/bench_masked.py", "benchmarks/bench_modifiers.py",
                                    "benchmarks/bench_fp8.py"])
def test_every_benchmark_takes_the_checked_spin_up(script, capsys):
  with pytest.raises(SystemExit):
    load_script(script).main(["--spin-up", "-1"])
  assert "--spin-up" in capsys.readouterr().err


def test_cudnn_fp8_column_passes_every_fp8_parameter_cudnn_checks():
  """The cuDNN FP8 cell gives jax's cuDNN attention all of its fp8_params keys (unit scales)
  and the call's mask; building it needs no GPU."""
  from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention
  bench = load_script("benchmarks/bench_fp8.py")
  attend = bench.cudnn_fp8_fn(True, 0.125)
  params = dict(zip(attend.__code__.co_freevars,
                    (c.cell_contents for c in attend.__closure__)))
  assert set(params["params"]) == set(cudnn_attention.fp8_params_keys)
  cudnn_attention.check_fp8_params(params["params"])
  assert params["mask"] == cudnn_attention.MaskType.CAUSAL


def test_bench_fp8_times_only_the_columns_asked_for(tmp_path, capsys, monkeypatch):
  """--impls fp8 times the fp8 cell alone (here it fails: no GPU) and the table has that column
  only; --out-dtype is recorded."""
  bench = load_script("benchmarks/bench_fp8.py")
  monkeypatch.setattr(bench, "TOKENS", 256)
  monkeypatch.setattr(bench, "WIDTH", 128)
  assert bench.main(["--impls", "fp8", "--hdim", "64", "--seq", "128", "--spin-up", "0",
                     "--out-dtype", "float16", "--out", str(tmp_path)]) == 0
  records = json.loads((tmp_path / "bench_fp8.json").read_text())
  assert [r["impl"] for r in records] == ["fp8"] and records[0]["fp8_out_dtype"] == "float16"
  assert records[0]["tflops"] is None and "failed" in records[0]["note"]
  out = capsys.readouterr().out
  assert "| head_dim | seq | fp8 | fp8 / bf16 | fp8 / cudnn-fp8 |" in out
  assert "| 64 | 128 | - | - | - |" in out


@pytest.mark.parametrize("backend,block_size,want", [
    ("gpu", 128, "cute"), ("gpu", 64, "cute"), ("gpu", 32, None), ("gpu", None, "cute"),
    ("cpu", 128, None), ("cpu", None, None)])
def test_fp8_accuracy_calls_the_kernels_on_a_gpu(backend, block_size, want, monkeypatch):
  """On a GPU the "call" column names the kernels (a missing one is an error, not a quiet
  reference run); blocks under 64 tokens and CPUs run auto."""
  acc = load_script("benchmarks/fp8_accuracy.py")
  monkeypatch.setattr(acc.jax, "default_backend", lambda: backend)
  assert acc.call_implementation(block_size) == want


@pytest.fixture(scope="module")
def decode():
  return load_script("benchmarks/bench_decode.py")


def test_decode_benchmark_columns_compute_the_same_attention(decode):
  """Every column of a decode case attends over the same valid keys (here on the CPU, at a
  small shape): contiguous and paged caches, and jax.nn's XLA path with key lengths."""
  import jax.numpy as jnp
  import numpy as np
  case = decode.Case(3, 1, 300, 8, 2, head_dim=16, ragged=True)
  lengths = decode.lengths_of(case)
  assert lengths.min() >= 1 and lengths.max() <= 300 and len(set(lengths)) > 1
  assert decode.kv_bytes(case, jnp.bfloat16) == int(lengths.sum()) * 2 * 2 * 16 * 2
  runs = decode.calls(case, jnp.float32, decode.IMPLS, splits=(1, 3))
  # attention / prefill take whole caches: not ragged ones; jax.nn has no cuDNN on a CPU.
  assert set(runs) == {"jaxflash", "paged64", "paged256", "fp8", "fp8-paged64", "fp8-paged256",
                       "nn", "cudnn", "xla", "split1", "split3"}
  full_runs = decode.calls(case._replace(ragged=False), jnp.float32, ("read",))
  k, v = full_runs["read"][1]
  np.testing.assert_allclose(full_runs["read"][0](k, v), (k.sum(), v.sum()), rtol=1e-5)
  want = np.asarray(runs["xla"][0](*runs["xla"][1]))
  for name in ("jaxflash", "paged64", "paged256", "nn", "split1", "split3"):
    fn, args = runs[name]
    np.testing.assert_allclose(fn(*args), want, rtol=2e-5, atol=2e-5, err_msg=name)
  # FP8 caches: the same attention up to e4m3's rounding of the keys and values, each scaled
  # per sequence or page and kv head.
  for name in decode.FP8_IMPLS:
    fn, args = runs[name]
    assert args[1].dtype == jnp.float8_e4m3fn and args[5].shape == args[1].shape[::2]
    got = np.asarray(fn(*args))
    assert np.linalg.norm(got - want) < 0.08 * np.linalg.norm(want), name
  full = decode.calls(case._replace(ragged=False), jnp.float32, decode.IMPLS)
  want = np.asarray(full["xla"][0](*full["xla"][1]))
  for name in ("attention", "prefill"):
    fn, args = full[name]
    np.testing.assert_allclose(fn(*args), want, rtol=2e-5, atol=2e-5, err_msg=name)
  # jax.nn has no per-sequence causal alignment: no jax.nn column for several new tokens.
  assert "xla" not in decode.calls(case._replace(seq_q=2), jnp.float32, ("jaxflash", "xla"))


def test_decode_benchmark_layers_make_one_program_of_distinct_calls(decode):
  """--layers L: each column is one program of L calls, each with its own query and its own
  copy of the caches (lengths shared), returning every output (a model's decoding step of L
  layers); the columns get the same layers' inputs."""
  import jax.numpy as jnp
  import numpy as np
  case = decode.Case(2, 1, 40, 4, 2, head_dim=16, ragged=True)
  runs = decode.calls(case, jnp.float32, ("jaxflash", "fp8", "xla"), layers=3)
  # FP8 caches: each layer its own copy of the e4m3 caches and their descales.
  _, (fp8_layers,) = runs["fp8"]
  assert fp8_layers[1][1] is not fp8_layers[0][1] and fp8_layers[1][5] is not fp8_layers[0][5]
  assert fp8_layers[1][4] is None  # contiguous caches: no page table
  fn, (layer_args,) = runs["jaxflash"]
  outs = fn(layer_args)
  assert len(layer_args) == len(outs) == 3
  single = decode.calls(case, jnp.float32, ("xla",))["xla"][0]
  for (q, k, v, lengths), out in zip(layer_args, outs):
    np.testing.assert_allclose(out, single(q, k, v, lengths), rtol=2e-5, atol=2e-5)
  (_, k0, v0, n0), (_, k1, v1, n1) = layer_args[:2]
  assert n1 is n0 and k1 is not k0 and v1 is not v0
  assert k1.unsafe_buffer_pointer() != k0.unsafe_buffer_pointer()
  assert not np.allclose(outs[0], outs[1])
  xla_fn, (xla_args,) = runs["xla"]
  assert all(a is b for la, lb in zip(xla_args, layer_args) for a, b in zip(la, lb))
  for got, want in zip(xla_fn(xla_args), outs):
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_decode_benchmark_table_reports_bandwidth_and_errors(decode):
  records = [{"case": "c", "impl": "jaxflash", "us": 130.0, "tb_per_s": 4.13,
              "hbm_limit_us": 112.0},
             {"case": "c", "impl": "cudnn", "error": "XlaRuntimeError: no"}]
  table = decode.markdown(records, ("jaxflash", "cudnn", "xla"))
  assert table.splitlines()[2] == "| c | 112 us | 130 us (4.13 TB/s) | error |  |"


def test_decode_benchmark_reports_a_column_that_fails_while_timed(decode, monkeypatch):
  """A column that fails after its warm-ups (a device error, memory) is reported as an error
  and the other columns keep their times."""
  import jax.numpy as jnp
  calls_made = []

  def flaky():
    calls_made.append(1)
    if len(calls_made) > decode.bench_attention.WARMUPS:
      raise RuntimeError("device lost")
    return jnp.zeros(())

  monkeypatch.setattr(decode, "calls", lambda *a: {"flaky": (flaky, ()),
                                                    "steady": (lambda: jnp.zeros(()), ())})
  records = decode._run_case("b8_q1_32k_gqa8", jnp.bfloat16, (), (), num_calls=2)
  by_impl = {r["impl"]: r for r in records}
  assert by_impl["flaky"]["error"] == "RuntimeError: device lost"
  assert by_impl["steady"]["us"] > 0 and "error" not in by_impl["steady"]


def test_decode_benchmark_main_writes_out_each_case_as_it_finishes(decode, monkeypatch,
                                                                  tmp_path, capsys):
  """The JSON is rewritten and the case's row printed to stderr after each case: a run cut
  short (a device call's time limit) keeps the cases it finished."""
  import json
  import jax.numpy as jnp
  monkeypatch.setattr(decode, "calls", lambda *a: {"xla": (lambda: jnp.zeros(()), ())})
  written = []
  real_run = decode._run_case

  def run_case(name, *args):
    if written:  # the previous case is already on disk
      assert [r["case"] for r in json.loads((tmp_path / "bench_decode.json").read_text())] == \
          written
    written.append(name)
    return real_run(name, *args)

  monkeypatch.setattr(decode, "_run_case", run_case)
  cases = ["b8_q1_32k_gqa8", "b1_q1_128k_gqa4"]
  assert decode.main(["--cases", *cases, "--impls", "xla", "--calls", "1", "--spin-up", "0",
                      "--out", str(tmp_path)]) == 0
  err = capsys.readouterr().err.splitlines()
  assert [line.split(" |")[0] for line in err if line.startswith("| b")] == [
      f"| {c}" for c in cases]
  assert len(json.loads((tmp_path / "bench_decode.json").read_text())) == 2


@pytest.fixture(scope="module")
def prefill():
  return load_script("benchmarks/bench_prefill.py")


def _lowered_fwd_calls(fn, args):
  """(variant, softcap, causal, window_left) of each jaxflash forward custom call in fn's
  lowering for CUDA (no GPU needed)."""
  import re

  import jax
  text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  calls = re.findall(r"custom_call @jaxflash_attention_fwd\(.*?\{(.*?)\}", text)
  field = lambda name, attrs: re.search(rf"\b{name} = ([^,]+?)(?: : \w+)?(?:,|$)", attrs).group(1)
  return [(field("variant", a).strip('"'), float(field("softcap", a)), field("causal", a),
           int(field("window_left", a))) for a in calls]


@pytest.mark.parametrize("row,want_ours,want_other", [
    ("d64-1k-causal", ("-d64-dv64-causal-", 0.0, "true"), "cuDNN"),
    ("packed8-vs-batch", ("-d128-dv128-masked-", 0.0, "true"),
     ("-d128-dv128-causal-", 0.0, "true")),
    ("gpt-oss", ("-d64-dv64-masked-", 0.0, "true"), "cuDNN"),
    ("softcap-d128", ("-d128-dv128-masked-", 30.0, "false"), ("-d128-dv128-m", 0.0, "false")),
    ("fp8-4k-d128", ("-e4m3-d128-", 0.0, "false"), "cuDNN"),
])
def test_prefill_rows_time_the_calls_they_name(prefill, monkeypatch, row, want_ours, want_other):
  """Each row's first call is one jaxflash forward kernel of the named kind (lowered for CUDA on
  this CPU host), and its other call is cuDNN (which refuses to trace without a GPU) or the
  jaxflash call the row names."""
  import numpy as np
  for module in (prefill, prefill.bench_modifiers, prefill.bench_fp8):
    monkeypatch.setattr(module, "TOKENS", 4096)  # a batch of one at the 4k rows
  (ours, ours_args), (other, other_args) = prefill.ROWS[row].make(np.random.default_rng(0))

  def check(calls, want):
    assert len(calls) == 1, calls
    variant, softcap, causal, window_left = calls[0]
    assert want[0] in variant and (softcap, causal) == want[1:], calls[0]
    return window_left

  window_left = check(_lowered_fwd_calls(ours, ours_args), want_ours)
  assert (window_left == 128) == (row == "gpt-oss")
  if want_other == "cuDNN":
    with pytest.raises(RuntimeError, match="cuDNN"):
      _lowered_fwd_calls(other, other_args)
  else:
    check(_lowered_fwd_calls(other, other_args), want_other)


def test_prefill_table_reports_each_round_the_median_and_the_bar(prefill):
  records = [dict(row="packed8", ratio=x) for x in (0.9, 1.1, 1.2)]
  records += [dict(row="softcap-d64", ratio=x) for x in (0.7, None, 0.74)]
  text = prefill.table(records, ["packed8", "softcap-d64"], 3)
  assert "| packed8 | cuDNN packed | 0.900 | 1.100 | 1.200 | 1.100 | 1.0 | yes |" in text
  assert "| softcap-d64 | jaxflash plain | 0.700 | - | 0.740 | 0.720 | 0.75 | no |" in text


def test_prefill_benchmark_reports_rows_that_fail(prefill, monkeypatch, tmp_path, capsys):
  """A row whose calls fail (no GPU here) is a record with the failure in every round and '-'
  in the table; --rounds must be positive."""
  monkeypatch.setattr(prefill, "TOKENS", 2048)
  assert prefill.main(["--rows", "d128-1k", "--rounds", "2", "--spin-up", "0",
                       "--out", str(tmp_path)]) == 0
  records = json.loads((tmp_path / "bench_prefill.json").read_text())
  assert [(r["row"], r["round"], r["ratio"]) for r in records] == [("d128-1k", 1, None),
                                                                    ("d128-1k", 2, None)]
  assert all(r["note"].startswith("failed: ") for r in records)
  assert "| d128-1k | cuDNN | - | - | - | 1.05 | - |" in capsys.readouterr().out
  with pytest.raises(SystemExit):
    prefill.main(["--rounds", "0", "--spin-up", "0", "--out", str(tmp_path)])
  assert "--rounds" in capsys.readouterr().err


def test_failure_note_names_the_exception_even_without_a_message(bench):
  assert bench.failure_note(RuntimeError("no GPU\ndetails")) == "failed: RuntimeError: no GPU"
  assert bench.failure_note(ValueError()) == "failed: ValueError: "
  assert bench.failure_note(ValueError("x" * 300)) == "failed: ValueError: " + "x" * 200


def test_generate_benchmark_times_each_cache_kind_on_the_same_model():
  """bench_generate on the tiny config (CPU): each kind decodes the same random model (the
  same greedy tokens from jaxflash's caches as from XLA's), a kind this host cannot run is
  reported as an error cell, and the table has a row per batch."""
  pytest.importorskip("flax")
  import jax
  generate = load_script("benchmarks/bench_generate.py")
  kinds = ("jaxflash", "xla", "cudnn")
  records = generate.run("tiny", kinds, (1, 3), prompt_len=6, num_tokens=3, runs=2)
  ok = {(r["kind"], r["batch"]): r for r in records if "error" not in r}
  assert {k for k, _ in ok} == ({"jaxflash", "xla"} if jax.default_backend() != "gpu"
                                else set(kinds))
  for batch in (1, 3):
    assert ok["jaxflash", batch]["first_tokens"] == ok["xla", batch]["first_tokens"]
    assert ok["jaxflash", batch]["tokens_per_s"] == pytest.approx(
        batch * 2 / ok["jaxflash", batch]["seconds"])
  table = generate.markdown(records, kinds, (1, 3)).splitlines()
  assert table[0] == "| batch | jaxflash | xla | cudnn |" and len(table) == 4
  assert table[2].startswith("| 1 | ") and " tok/s (" in table[2]


def test_bias_columns_are_the_calls_they_name():
  """bench_modifiers --bias: the jaxflash columns are attention with and without the bias (the
  plain one ignores it); forward + backward differentiates the bias too."""
  import jax.numpy as jnp
  import numpy as np

  import jaxflash
  modifiers = load_script("benchmarks/bench_modifiers.py")
  rng = np.random.default_rng(2)
  q, k, v = (jnp.asarray(rng.standard_normal((2, 16, 2, 8)), jnp.float32) for _ in range(3))
  bias = jnp.asarray(rng.standard_normal((1, 2, 16, 16)), jnp.float32)
  run = lambda impl: modifiers.bias_fn(impl, True, "reference")(q, k, v, bias)
  np.testing.assert_array_equal(run("jaxflash"), jaxflash.attention(
      q, k, v, causal=True, implementation="reference"))
  np.testing.assert_array_equal(run("jaxflash bias"), jaxflash.attention(
      q, k, v, causal=True, bias=bias, implementation="reference"))
  assert not np.array_equal(run("jaxflash bias"), run("jaxflash"))
  grads = modifiers.bias_fwd_bwd_fn(modifiers.bias_fn("jaxflash bias", True, "reference"), q)(
      q, k, v, bias)
  assert len(grads) == 4 and grads[3].shape == bias.shape and np.any(np.asarray(grads[3]) != 0)
  assert modifiers.BIAS_SHAPE == dict(batch=4, heads=16, head_dim=128)


def test_tokamax_bias_columns_call_its_mosaic_attention(monkeypatch):
  """bench_modifiers --bias: where tokamax imports, its columns are
  tokamax.dot_product_attention(implementation="mosaic") without and with the bias (a stand-in
  module records the calls; the real one is a GPU host's)."""
  import sys
  import types
  modifiers = load_script("benchmarks/bench_modifiers.py")
  calls = []
  fake = types.ModuleType("tokamax")
  fake.dot_product_attention = lambda *args, **kwargs: calls.append((args, kwargs))
  monkeypatch.setitem(sys.modules, "tokamax", fake)
  assert modifiers.tokamax_found()
  for impl in modifiers.TOKAMAX_BIAS_IMPLS:
    modifiers.bias_fn(impl, True)("q", "k", "v", "bias")
  assert calls == [(("q", "k", "v", None), dict(is_causal=True, implementation="mosaic")),
                   (("q", "k", "v", "bias"), dict(is_causal=True, implementation="mosaic"))]
  monkeypatch.setitem(sys.modules, "tokamax", None)  # import tokamax raises ImportError
  assert not modifiers.tokamax_found()


def test_mods_columns_are_the_calls_they_name():
  """bench_modifiers --mods: each mask_mod column equals its built-in twin, the identity the
  plain call, ALiBi the materialised bias that cuDNN's column takes (on the reference)."""
  import jax.numpy as jnp
  import numpy as np

  import jaxflash
  modifiers = load_script("benchmarks/bench_modifiers.py")
  rng = np.random.default_rng(3)
  q, k, v = (jnp.asarray(rng.standard_normal((1, 40, 2, 8)), jnp.float32) for _ in range(3))
  slopes = jnp.asarray([0.5, 0.25], jnp.float32)
  table = jnp.asarray(rng.standard_normal((modifiers.T5_BUCKETS, 2)), jnp.float32)
  run = lambda impl: np.asarray(modifiers.mods_fn(impl, slopes, table, "reference")(q, k, v))
  np.testing.assert_allclose(run("identity"), run("jaxflash"), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(run("causal mask_mod"), run("causal"), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(run("window mask_mod"), run("window"), rtol=1e-6, atol=1e-6)
  pos = jnp.arange(40)
  bias = (slopes[:, None, None] * (pos[None, :] - pos[:, None])[None])[None]
  np.testing.assert_allclose(run("alibi"), np.asarray(jaxflash.attention(
      q, k, v, bias=bias, implementation="reference")), rtol=1e-5, atol=1e-5)
  assert not np.allclose(run("t5"), run("jaxflash"))
  np.testing.assert_allclose(run("t5 by distance"), run("t5"), rtol=1e-6, atol=1e-6)
