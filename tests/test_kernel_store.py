"""Where kernels come from (CPU): search order, the kernel wheel's checks, on-demand decisions.

The libraries here are placeholders: these tests check which folder is chosen and what is said,
not loading (GPU) or building (tests/test_build.py builds and packs real variants).
"""

import importlib
import json
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from jaxflash import _jax_internal, build, config, ffi, kernel_store
from jaxflash.config import HANDLER_LIBRARY, VARIANT_LIBRARY, VARIANT_MANIFEST


@pytest.fixture
def folders(monkeypatch, tmp_path):
  """An empty $JAXFLASH_CACHE_DIR, user cache and site folder (on sys.path) for a wheel."""
  env, home, site = tmp_path / "env", tmp_path / "home", tmp_path / "site"
  for path in (env, home, site):
    path.mkdir()
  monkeypatch.setenv(config.CACHE_DIR_ENV, str(env))
  monkeypatch.setenv("HOME", str(home))
  monkeypatch.syspath_prepend(str(site))
  monkeypatch.setattr(kernel_store, "_warned_wheels", set())
  monkeypatch.setattr(ffi, "_failed_builds", {})
  importlib.invalidate_caches()
  return {"env": env, "user": home / ".cache" / "jaxflash" / jaxflash.__version__, "site": site}


def _put_variant(folder, key, abi=None):
  (folder / key).mkdir(parents=True, exist_ok=True)
  (folder / key / VARIANT_LIBRARY).write_bytes(b"placeholder")
  manifest = {"key": key, "abi_version": kernel_store.abi_version() if abi is None else abi}
  (folder / key / VARIANT_MANIFEST).write_text(json.dumps(manifest))


def _install_wheel(site, arch="sm90a", version=None, abi=None, keys=()):
  """The installed layout of a kernel wheel (what `pip install` of build.write_wheel leaves)."""
  package = site / config.KERNEL_WHEEL_PACKAGE.format(arch=arch)
  package.mkdir()
  (package / "__init__.py").write_text('"""kernels"""\n')
  info = {"jaxflash_version": version or jaxflash.__version__, "arch": arch,
          "kernel_abi": kernel_store.abi_version() if abi is None else abi, "variants": keys}
  (package / config.KERNEL_WHEEL_INFO).write_text(json.dumps(info))
  for key in keys:
    _put_variant(package, key)
  importlib.invalidate_caches()
  return package


def _variant():
  return config.shipped_variants()[0]


def test_search_order_is_env_cache_then_wheel_then_user_cache(folders):
  key = _variant().key
  wheel = _install_wheel(folders["site"], keys=[key])
  assert kernel_store.search_path() == [
      kernel_store.KernelFolder("cache", folders["env"]),
      kernel_store.KernelFolder("wheel", wheel),
      kernel_store.KernelFolder("cache", folders["user"])]
  assert kernel_store.locate(key) == kernel_store.KernelFolder("wheel", wheel)
  _put_variant(folders["env"], key)
  assert kernel_store.locate(key) == kernel_store.KernelFolder("cache", folders["env"])


def test_without_env_the_wheel_comes_before_the_user_cache(folders, monkeypatch):
  monkeypatch.delenv(config.CACHE_DIR_ENV)
  key = _variant().key
  _put_variant(folders["user"], key)
  assert kernel_store.locate(key) == kernel_store.KernelFolder("cache", folders["user"])
  wheel = _install_wheel(folders["site"], keys=[key])
  assert kernel_store.locate(key).kind == "wheel" and kernel_store.locate(key).path == wheel
  assert kernel_store.build_dir() == folders["user"]  # builds never go into the wheel


def test_a_variant_needs_library_manifest_key_and_abi(folders):
  key, env = _variant().key, folders["env"]
  (env / key).mkdir()
  (env / key / VARIANT_LIBRARY).write_bytes(b"x")
  assert kernel_store.locate(key) is None  # no manifest
  _put_variant(env, key, abi=kernel_store.abi_version() - 1)
  assert kernel_store.locate(key) is None  # built for another kernel ABI
  (env / key / VARIANT_MANIFEST).write_text(json.dumps(
      {"key": "fwd-other", "abi_version": kernel_store.abi_version()}))
  assert kernel_store.locate(key) is None  # another variant's files
  _put_variant(env, key)
  assert kernel_store.locate(key).path == env


@pytest.mark.parametrize("field", ["version", "abi"])
def test_a_wheel_for_another_version_or_abi_is_ignored_with_one_warning(folders, field):
  key = _variant().key
  other = {"version": "0.0.1"} if field == "version" else {"abi": kernel_store.abi_version() + 1}
  wheel = _install_wheel(folders["site"], keys=[key], **other)
  with pytest.warns(RuntimeWarning, match="ignoring the kernel wheel jaxflash_kernels_sm90a") as w:
    assert kernel_store.locate(key) is None
  assert str(wheel) in str(w[0].message) and "--wheel OUTDIR" in str(w[0].message)
  assert w[0].filename == __file__  # the caller's line, not one of jaxflash's
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # a second look warns no more
    assert kernel_store.search_path() == [
        kernel_store.KernelFolder("cache", folders["env"]),
        kernel_store.KernelFolder("cache", folders["user"])]


def test_list_reports_wheel_cache_or_missing(folders, capsys):
  fwd = config.shipped_variants()
  _install_wheel(folders["site"], keys=[fwd[0].key])
  _put_variant(folders["user"], fwd[1].key)
  assert build.main(["--list", "--variants", fwd[0].key, fwd[1].key, fwd[2].key]) == 0
  lines = capsys.readouterr().out.splitlines()
  expected = "stale (cache)" if build.cutlass_version() else "ready (cache)"  # placeholder files
  assert lines == [f"{fwd[0].key}  ready (wheel)", f"{fwd[1].key}  {expected}",
                   f"{fwd[2].key}  missing"]


def _toolchain(monkeypatch, cutlass=True, toolchain=True):
  def fail(what):
    def raise_():
      raise build.BuildError(f"{what} is missing")
    return raise_
  monkeypatch.setattr(build, "require_cutlass", (lambda: "4.8") if cutlass else fail("cutlass"))
  monkeypatch.setattr(build, "find_toolchain", (lambda: None) if toolchain else fail("g++"))


def test_on_demand_needs_the_switch_cutlass_and_a_toolchain(folders, monkeypatch):
  _toolchain(monkeypatch)
  monkeypatch.delenv(config.BUILD_ON_DEMAND_ENV, raising=False)
  assert ffi.on_demand_blocker() == ""
  monkeypatch.setenv(config.BUILD_ON_DEMAND_ENV, "1")
  assert ffi.on_demand_blocker() == ""
  monkeypatch.setenv(config.BUILD_ON_DEMAND_ENV, "0")
  assert ffi.on_demand_blocker() == "on-demand builds are off (JAXFLASH_BUILD_ON_DEMAND=0)"
  monkeypatch.setenv(config.BUILD_ON_DEMAND_ENV, "yes")
  with pytest.raises(ValueError, match="JAXFLASH_BUILD_ON_DEMAND='yes': accepted values are '1'"):
    ffi.on_demand_blocker()
  monkeypatch.delenv(config.BUILD_ON_DEMAND_ENV)
  _toolchain(monkeypatch, cutlass=False)
  assert ffi.on_demand_blocker() == "cutlass is missing"
  _toolchain(monkeypatch, toolchain=False)
  assert ffi.on_demand_blocker() == "g++ is missing"


def test_variant_available_found_buildable_or_how_to_get_it(folders, monkeypatch):
  variant = _variant()
  _toolchain(monkeypatch, cutlass=False)
  ok, why = ffi.variant_available(variant)
  assert not ok
  assert f"kernel variant {variant.key} is in none of the kernel folders" in why
  assert str(folders["env"]) in why and str(folders["user"]) in why
  assert "cannot be built here at first use: cutlass is missing" in why
  assert "python -m jaxflash.build --wheel OUTDIR" in why and "jaxflash[build]" in why
  assert f"--variants {variant.key} --cache-dir {folders['env']}" in why
  _toolchain(monkeypatch)
  assert ffi.variant_available(variant) == (True, "")  # built at first use
  monkeypatch.setenv(config.BUILD_ON_DEMAND_ENV, "0")
  assert "on-demand builds are off" in ffi.variant_available(variant)[1]
  _install_wheel(folders["site"], keys=[variant.key])
  assert ffi.variant_available(variant) == (True, "")


@pytest.fixture
def no_loading(monkeypatch):
  """Records what ensure_variant would load (loading needs a GPU)."""
  loaded = []
  monkeypatch.setattr(ffi, "_variants", {})
  monkeypatch.setattr(ffi, "_register_variant", lambda key, library: loaded.append(library))
  return loaded


def test_ensure_variant_takes_the_wheel_without_building(folders, monkeypatch, no_loading):
  variant = _variant()
  wheel = _install_wheel(folders["site"], keys=[variant.key])
  monkeypatch.setattr(ffi, "_build_on_demand", lambda v: pytest.fail("built"))
  assert ffi.ensure_variant(variant) == wheel / variant.key / VARIANT_LIBRARY
  assert no_loading == [wheel / variant.key / VARIANT_LIBRARY]


def test_ensure_variant_builds_a_missing_variant_into_the_cache(folders, monkeypatch, no_loading):
  variant, built = _variant(), []

  def fake_build(v):
    built.append(v.key)
    _put_variant(folders["env"], v.key)
    return folders["env"]

  _toolchain(monkeypatch)
  monkeypatch.setattr(ffi, "_build_on_demand", fake_build)
  library = ffi.ensure_variant(variant)
  assert built == [variant.key] and library == folders["env"] / variant.key / VARIANT_LIBRARY


def test_ensure_variant_with_on_demand_off_says_how_to_get_it(folders, monkeypatch, no_loading):
  monkeypatch.setenv(config.BUILD_ON_DEMAND_ENV, "0")
  monkeypatch.setattr(ffi, "_build_on_demand", lambda v: pytest.fail("built"))
  with pytest.raises(RuntimeError, match="on-demand builds are off"):
    ffi.ensure_variant(_variant())
  assert not no_loading


def test_a_failed_on_demand_build_raises_with_its_output(folders, monkeypatch, no_loading):
  _toolchain(monkeypatch)
  variant = _variant()
  # The child cannot find the variant key it is given: a real failing child process.
  monkeypatch.setattr(variant.__class__, "key", property(lambda self: "fwd-no-such-variant"))
  with pytest.raises(RuntimeError, match="(?s)building kernel variant fwd-no-such-variant failed"
                                         ".*unknown variant key"):
    ffi.ensure_variant(variant)
  assert not no_loading


def test_a_failed_build_is_not_rerun_in_the_process(folders, monkeypatch, no_loading):
  """A variant whose on-demand build failed raises the build's error again, at once, on every
  later request in the process, and variant_available reports it."""
  _toolchain(monkeypatch)
  variant, built = _variant(), []
  monkeypatch.setattr(ffi, "_build_on_demand", _failing_build(built))
  assert ffi.variant_available(variant) == (True, "")  # buildable, not yet tried
  with pytest.raises(RuntimeError, match="ptxas error$"):
    ffi.ensure_variant(variant)
  again = "(?s)ptxas error.*failed earlier in this process and is not retried"
  with pytest.raises(RuntimeError, match=again):
    ffi.ensure_variant(variant)
  ok, why = ffi.variant_available(variant)
  assert not ok and re.search(again, why)
  assert built == [variant.key] and not no_loading


def test_auto_runs_the_reference_after_the_forward_build_failed(folders, monkeypatch,
                                                               no_loading):
  """On a (pretended) Hopper host whose forward build fails, the call that asked for it raises;
  a new trace in auto mode runs the reference with a warning that carries the build's error,
  and builds nothing. (A trace jax cached before the failure keeps the kernel and raises the
  remembered error at once.)"""
  monkeypatch.setattr(_jax_internal, "has_cuda_device", lambda: True)
  monkeypatch.setattr(_jax_internal, "has_hopper_device", lambda: True)
  _toolchain(monkeypatch)
  built = []
  monkeypatch.setattr(ffi, "_build_on_demand", _failing_build(built))
  q = jnp.asarray(np.random.default_rng(4).standard_normal((1, 128, 2, 64)), jnp.bfloat16)
  call = lambda q: jaxflash.attention(q, q, q, causal=True)
  lower = lambda: jax.jit(lambda q: call(q)).trace(q).lower(
      lowering_platforms=("cuda",)).as_text()
  with pytest.raises(RuntimeError, match="ptxas error"):
    lower()
  with pytest.warns(RuntimeWarning, match="(?s)ptxas error.*running the reference"):
    text = lower()
  assert config.FWD_TARGET not in text and len(built) == 1 and not no_loading


def test_handler_library_prefers_a_current_one_in_search_order(folders, monkeypatch):
  def no_toolchain():
    raise build.BuildError("no C++ compiler found")

  monkeypatch.setattr(build, "find_toolchain", no_toolchain)
  wheel = _install_wheel(folders["site"])
  stamp = build._handler_stamp()
  (wheel / HANDLER_LIBRARY).write_bytes(b"placeholder")
  (wheel / HANDLER_LIBRARY).with_suffix(".json").write_text(json.dumps(stamp))
  (folders["user"]).mkdir(parents=True)
  (folders["user"] / HANDLER_LIBRARY).write_bytes(b"old")  # no stamp: from other sources
  assert ffi._handler_library() == wheel / HANDLER_LIBRARY
  (wheel / HANDLER_LIBRARY).with_suffix(".json").write_text("{}")
  assert ffi._handler_library() == wheel / HANDLER_LIBRARY  # no toolchain: first existing one


def _hopper_call_variants(folders, monkeypatch):
  """A Hopper host (pretended) with a kernel wheel that holds the forward variant of a causal
  bfloat16 head_dim 64 call but not its backward one: (query, forward, backward)."""
  monkeypatch.setattr(_jax_internal, "has_cuda_device", lambda: True)
  monkeypatch.setattr(_jax_internal, "has_hopper_device", lambda: True)
  cfg = config.AttentionConfig(softmax_scale=64 ** -0.5, causal=True)
  fwd, bwd = (config.KernelVariant.for_call(d, "sm90a", "bfloat16", 64, 64, cfg)
              for d in ("fwd", "bwd"))
  _install_wheel(folders["site"], keys=[fwd.key])
  # 128 query rows: the prefill kernels' call, not a few-row one (jaxflash/few_rows.py).
  q = jnp.asarray(np.random.default_rng(3).standard_normal((1, 128, 2, 64)), jnp.bfloat16)
  return q, fwd, bwd


def _failing_build(built):
  def build_(variant):
    built.append(variant.key)
    raise RuntimeError(f"jaxflash: building kernel variant {variant.key} failed (exit 1) running\n"
                       f"  python -m jaxflash.build\nptxas error")
  return build_


@pytest.mark.parametrize("implementation", [None, "cute"], ids=["auto", "cute"])
@pytest.mark.parametrize("cause", ["build fails", "not buildable"])
def test_an_unavailable_backward_raises_when_the_gradient_lowers(folders, monkeypatch, no_loading,
                                                                implementation, cause):
  """The call lowers on the forward kernel without looking for its backward one; the gradient's
  lowering looks for it and raises, naming the variant, why it is unavailable (the build's
  output, or how to get the kernels) and the reference as the way around."""
  q, fwd, bwd = _hopper_call_variants(folders, monkeypatch)
  built = []
  if cause == "build fails":
    _toolchain(monkeypatch)
    monkeypatch.setattr(ffi, "_build_on_demand", _failing_build(built))
    why = f"building kernel variant {bwd.key} failed.*ptxas error"
  else:
    monkeypatch.setenv(config.BUILD_ON_DEMAND_ENV, "0")
    monkeypatch.setattr(ffi, "_build_on_demand", lambda v: pytest.fail("built"))
    why = f"kernel variant {bwd.key} is in none of the kernel folders.*on-demand builds are off"
  call = lambda q: jaxflash.attention(q, q, q, causal=True, implementation=implementation)
  text = jax.jit(call).trace(q).lower(lowering_platforms=("cuda",)).as_text()
  assert config.FWD_TARGET in text and not built
  assert [library.parent.name for library in no_loading] == [fwd.key]
  loss = lambda q: jnp.sum(call(q).astype(jnp.float32))
  with pytest.raises(RuntimeError, match=f"(?s)gradient of this attention call runs the backward "
                                         f"kernel variant {bwd.key}.*implementation='reference'"
                                         f".*{why}"):
    jax.jit(jax.grad(loss)).trace(q).lower(lowering_platforms=("cuda",))
  assert built == ([bwd.key] if cause == "build fails" else [])
