"""examples/flax_transformer/generate.py: KV-cache decoding gives the logits of the full
forward pass, and the command line loads checkpoints or says how to make one."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

pytest.importorskip("flax")
pytest.importorskip("optax")
pytest.importorskip("orbax.checkpoint")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402

from examples.flax_transformer import configs, generate, model  # noqa: E402


def _fresh_model(kind):
  config = configs.get_config("tiny")
  transformer = model.Transformer(config, model.make_attention(kind),
                                  cache_attention=model.make_cache_attention(kind))
  prompt = np.random.default_rng(0).integers(0, 256, (2, 5)).astype(np.int32)
  params = nn.unbox(transformer.init(jax.random.PRNGKey(1), prompt)["params"])
  return transformer, params, prompt


@pytest.mark.parametrize("kind", ["jaxflash", "xla"])
def test_kv_cache_decoding_gives_the_logits_of_the_full_forward(kind):
  transformer, params, prompt = _fresh_model(kind)
  with warnings.catch_warnings():
    # The prefill and the loop donate the caches: each must use them (no copy of the caches).
    warnings.filterwarnings("error", message="Some donated buffers were not usable")
    tokens, logits, _ = generate.generate(transformer, params, prompt, 6)
  assert tokens.shape == (2, 6) and logits.shape == (2, 6, 256)
  # Logits at position p of the whole sequence predict token p + 1.
  sequence = np.concatenate([prompt, tokens], axis=1)
  full = np.asarray(transformer.apply({"params": params}, sequence[:, :-1]))[:, 4:]
  np.testing.assert_allclose(logits, full, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(tokens, full.argmax(-1))


def test_fp8_caches_decode_close_to_the_full_forward():
  """jaxflash-fp8: the model's keys and values stored as float8_e4m3fn page pools (a descale
  per page and kv head): the logits of the full forward pass up to e4m3's rounding, the same
  greedy tokens here; the 16-bit caches' logits are far closer."""
  config = configs.get_config("tiny")
  transformer = model.Transformer(config, model.make_attention("jaxflash"),
                                  cache_attention=model.make_cache_attention("jaxflash-fp8"))
  prompt = np.random.default_rng(0).integers(0, 256, (2, 5)).astype(np.int32)
  params = nn.unbox(transformer.init(jax.random.PRNGKey(1), prompt)["params"])
  cache = model.init_cache(config, 2, 10, "jaxflash-fp8")
  pool, descale = cache.keys[0]
  assert pool.dtype == np.dtype("float8_e4m3fn") and descale.shape == (2, config.num_kv_heads)
  assert pool.shape == (2, model.FP8_PAGE_SIZE, config.num_kv_heads, config.head_dim)
  tokens, logits, _ = generate.generate(transformer, params, prompt, 6, cache_kind="jaxflash-fp8")
  sequence = np.concatenate([prompt, tokens], axis=1)
  full = np.asarray(transformer.apply({"params": params}, sequence[:, :-1]))[:, 4:]
  error = np.linalg.norm(logits - full) / np.linalg.norm(full)
  assert 1e-4 < error < 0.06, error
  np.testing.assert_array_equal(tokens, full.argmax(-1))
  with pytest.raises(ValueError, match="attention: expected one of .*'jaxflash-fp8'"):
    model.init_cache(config, 2, 10, "fp8")


def test_one_token_is_the_prefill_alone():
  """num_tokens 1: the decode loop runs no step, and the token is the prompt's prediction."""
  transformer, params, prompt = _fresh_model("jaxflash")
  tokens, logits, _ = generate.generate(transformer, params, prompt, 1)
  assert tokens.shape == (2, 1) and logits.shape == (2, 1, 256)
  full = np.asarray(transformer.apply({"params": params}, prompt))[:, -1:]
  np.testing.assert_allclose(logits, full, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(tokens, full.argmax(-1))


def test_a_prompt_can_continue_a_filled_cache_with_jaxflash():
  """jaxflash's cache attention masks bottom-right, so a chunk may follow cached tokens."""
  transformer, params, prompt = _fresh_model("jaxflash")
  cache = model.init_cache(transformer.config, 2, 8)
  apply = jax.jit(lambda tokens, cache: transformer.apply({"params": params}, tokens,
                                                          cache=cache))
  _, cache = apply(prompt[:, :2], cache)
  logits, cache = apply(prompt[:, 2:], cache)
  assert cache.lengths.tolist() == [5, 5]
  full = jax.jit(transformer.apply)({"params": params}, prompt)
  np.testing.assert_allclose(logits, full[:, 2:], rtol=1e-5, atol=1e-5)


def test_sampling_depends_on_the_seed():
  transformer, params, prompt = _fresh_model("xla")
  sample = lambda seed: generate.generate(transformer, params, prompt, 4, temperature=1.0,
                                          seed=seed)[0]
  first, second = sample(0), sample(1)
  assert first.shape == (2, 4) and (first != second).any()


def test_without_a_checkpoint_the_command_says_how_to_make_one(tmp_path):
  with pytest.raises(SystemExit, match=r"no checkpoint in .*checkpoints: train one first, "
                                       r"e\.g\. python -m examples\.flax_transformer\.main"):
    generate.main(["--workdir", str(tmp_path / "empty"), "--tokens", "2"])
  assert not (tmp_path / "empty").exists()


def test_cudnn_needs_a_gpu(tmp_path):
  if jax.default_backend() == "gpu":
    pytest.skip("a GPU is present")
  with pytest.raises(SystemExit, match="cuDNN attention needs an NVIDIA GPU"):
    generate.main(["--workdir", str(tmp_path), "--attention", "cudnn"])


def test_generates_from_a_trained_checkpoint(tmp_path, capsys):
  from examples.flax_transformer import train
  overrides = ["seq_len=32", "batch_size=2", "steps=1", "eval_batches=1"]
  config = configs.apply_overrides(configs.get_config("tiny"), overrides)
  train.train(config, tmp_path, progress=False)
  set_flags = [flag for item in overrides for flag in ("--set", item)]
  generate.main(["--workdir", str(tmp_path), "--prompt", "KING:", "--tokens", "5",
                 "--batch", "2", "--attention", "xla", *set_flags])
  out = capsys.readouterr().out
  assert "--- checkpoint step 1, sequence 1 ---\nKING:" in out
  assert "decode: 4 tokens x batch 2 in" in out and "(attention=xla)" in out
