"""jaxflash.build on a CPU host: one variant end to end, the handler library, tool errors."""

import ctypes
import hashlib
import json
import os
import re
import subprocess
import sys
import zipfile

import jax
import jax.numpy as jnp
import pytest

from jaxflash import build, config, ffi
from jaxflash.config import HANDLER_LIBRARY, VARIANT_LIBRARY, VARIANT_MANIFEST


def _require_toolchain():
  try:
    build.find_toolchain()
  except build.BuildError as e:
    pytest.skip(str(e))


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
  _require_toolchain()
  return tmp_path_factory.mktemp("kcache")


@pytest.fixture(scope="module")
def built(cache):
  """The smallest shipped variant, built once for the module: (variant, manifest, log lines)."""
  pytest.importorskip("cutlass")
  variant = config.shipped_variants()[0]
  lines = []
  (manifest,) = build.build([variant], cache, log=lines.append)
  return variant, manifest, lines


def test_handler_library_builds_once_and_hides_the_cuda_runtime(cache):
  lib, _ = build.build_handler_library(cache)
  assert lib == cache / HANDLER_LIBRARY
  symbols = build.exported_symbols(lib)
  assert {"JaxflashAttentionFwd", "JaxflashAttentionBwd", "JaxflashKvCacheAttention",
          "jaxflash_ffi_register_variant", "jaxflash_ffi_last_error",
          "jaxflash_ffi_prepare"} <= symbols
  assert {symbol for _, instantiate, execute in ffi._TARGETS
          for symbol in (instantiate, execute)} <= symbols
  assert not [s for s in symbols if s.startswith("cuda")]  # --exclude-libs kept cudart private
  mtime = lib.stat().st_mtime_ns
  assert build.build_handler_library(cache) == (lib, False)
  assert lib.stat().st_mtime_ns == mtime


def test_instantiate_errors_name_the_target(cache, tmp_path):
  """A call whose variant is in no kernel folder fails when XLA instantiates it, with an error
  that names the call's target, as execute's errors do. XLA's CPU runtime runs the instantiate
  stage too: CPU copies of the three targets show it on this host."""
  build.build_handler_library(cache)
  lib = ctypes.CDLL(str(cache / HANDLER_LIBRARY))
  lib.jaxflash_ffi_set_kernel_folders.argtypes = [ctypes.POINTER(ctypes.c_char_p), ctypes.c_int32]
  assert lib.jaxflash_ffi_set_kernel_folders((ctypes.c_char_p * 1)(str(tmp_path).encode()), 1) == 0
  x = jnp.zeros((1, 4), jnp.float32)
  for target, instantiate, execute in ffi._TARGETS:
    name = f"{target}_instantiate_on_cpu"
    jax.ffi.register_ffi_target(name, {"instantiate": jax.ffi.pycapsule(getattr(lib, instantiate)),
                                       "execute": jax.ffi.pycapsule(getattr(lib, execute))},
                                platform="cpu")
    call = jax.ffi.ffi_call(name, jax.ShapeDtypeStruct(x.shape, x.dtype))
    with pytest.raises(Exception, match=re.escape(
        f"{target}[variant=fwd-missing]: kernel variant 'fwd-missing' is in none of the kernel "
        f"folders ({tmp_path}). Build it with `python -m jaxflash.build --variants fwd-missing`")):
      jax.jit(lambda x: call(x, variant="fwd-missing"))(x)


@pytest.mark.cutlass
def test_variant_build_writes_library_cubin_and_manifest(built, cache):
  variant, manifest, lines = built
  folder = cache / variant.key
  assert (folder / VARIANT_LIBRARY).is_file()
  assert manifest["up_to_date"] is False
  assert any(f"[1/1] {variant.key}: built in" in line for line in lines), lines
  stored = json.loads((folder / VARIANT_MANIFEST).read_text())
  assert stored["key"] == variant.key
  assert stored["spec"] == build.variant_spec(variant)
  assert stored["abi_version"] == build.abi_version() == 17
  assert stored["cutlass_version"] == build.cutlass_version()
  import jaxflash
  assert stored["jaxflash_version"] == jaxflash.__version__
  cubin = (folder / stored["cubin"]).read_bytes()
  assert cubin[:4] == b"\x7fELF"
  assert stored["cubin_sha256"] == hashlib.sha256(cubin).hexdigest()
  kernels = stored["resources"]["kernels"]
  assert kernels and all(0 < k["registers"] <= 255 for k in kernels), kernels
  assert stored["resources"]["local_memory_instructions"] >= 0
  assert stored["build_seconds"] > 0


@pytest.mark.cutlass
def test_variant_library_exports_exactly_the_kernel_abi(built, cache):
  variant, _, _ = built
  assert build.exported_symbols(cache / variant.key / VARIANT_LIBRARY) == set(
      build.VARIANT_ABI_SYMBOLS)


@pytest.mark.cutlass
def test_variant_library_binds_its_own_entry_points(built, cache):
  """No relocation of the library names a kernel_abi.h function: its entry points reach its
  own jaxflash_variant_load directly, never another variant's loaded with RTLD_GLOBAL."""
  import shutil
  import subprocess
  variant, _, _ = built
  relocations = subprocess.run([shutil.which("readelf"), "-r", "-W",
                                cache / variant.key / VARIANT_LIBRARY],
                               capture_output=True, text=True, check=True).stdout
  assert "jaxflash_variant_" not in relocations


@pytest.mark.cutlass
def test_second_build_is_a_no_op(built, cache):
  variant, _, _ = built
  lib = cache / variant.key / VARIANT_LIBRARY
  mtime = lib.stat().st_mtime_ns
  lines = []
  (manifest,) = build.build([variant], cache, log=lines.append)
  assert manifest["up_to_date"] is True
  assert lib.stat().st_mtime_ns == mtime
  assert any(line.endswith(f"{variant.key}: up to date") for line in lines), lines


@pytest.mark.cutlass
def test_manifest_from_other_sources_is_stale(built, cache):
  variant, _, _ = built
  path = cache / variant.key / VARIANT_MANIFEST
  original = path.read_text()
  try:
    path.write_text(json.dumps(dict(json.loads(original), source_sha256="0" * 64)))
    assert not build.manifest_is_current(variant, cache)
  finally:
    path.write_text(original)
  assert build.manifest_is_current(variant, cache)


@pytest.mark.cutlass
def test_handler_registry_checks_the_variant_library(built, cache):
  """dlopen, ABI version and key checks run on a CPU host; only the cubin load needs a GPU."""
  if ffi._cuda_device_present():
    pytest.skip("a CUDA device is present: loading succeeds here")
  variant, _, _ = built
  lib = ctypes.CDLL(str(cache / HANDLER_LIBRARY))
  lib.jaxflash_ffi_register_variant.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
  lib.jaxflash_ffi_last_error.restype = ctypes.c_char_p
  path = str(cache / variant.key / VARIANT_LIBRARY).encode()

  def register(key, where=path):
    assert lib.jaxflash_ffi_register_variant(key.encode(), where) == 1
    return lib.jaxflash_ffi_last_error().decode()

  assert f"was built for variant '{variant.key}'" in register("fwd-other")
  assert "loading the kernel module failed" in register(variant.key)
  assert "does not export the jaxflash kernel ABI" in register(
      variant.key, str(cache / HANDLER_LIBRARY).encode())
  assert lib.jaxflash_ffi_is_registered(variant.key.encode()) == 0


@pytest.mark.cutlass
def test_cli_rejects_unknown_keys(built, cache):
  with pytest.raises(SystemExit, match="unknown variant key"):
    build.main(["--variants", "fwd-nope", "--cache-dir", str(cache)])


@pytest.fixture(scope="module")
def built_bwd(cache):
  """The first shipped backward variant (three kernels, variant_bwd.cc glue), built once."""
  pytest.importorskip("cutlass")
  variant = config.shipped_variants(direction="bwd")[0]
  (manifest,) = build.build([variant], cache, log=lambda line: None)
  return variant, manifest


@pytest.mark.cutlass
def test_bwd_variant_builds_and_exports_the_backward_abi(built_bwd, cache):
  variant, manifest = built_bwd
  folder = cache / variant.key
  assert variant.key.startswith("bwd-") and manifest["key"] == variant.key
  assert build.exported_symbols(folder / VARIANT_LIBRARY) == set(build.BWD_VARIANT_ABI_SYMBOLS)
  assert "jaxflash_variant_bwd" in build.BWD_VARIANT_ABI_SYMBOLS
  # main kernel + preprocess + postprocess cubins, all described in the manifest
  assert sorted(manifest["extra_cubins"]) == ["kernel-post.cubin", "kernel-pre.cubin"]
  for name, digest in manifest["extra_cubins"].items():
    assert hashlib.sha256((folder / name).read_bytes()).hexdigest() == digest
  assert len(manifest["resources"]["kernels"]) >= 3, manifest["resources"]
  assert build.manifest_is_current(variant, cache)


@pytest.fixture(scope="module")
def built_decode(cache):
  """The first shipped decode variant (variant_decode.cc glue), built once."""
  pytest.importorskip("cutlass")
  variant = config.shipped_variants(direction="decode")[0]
  (manifest,) = build.build([variant], cache, log=lambda line: None)
  return variant, manifest


@pytest.mark.cutlass
def test_decode_variant_builds_and_exports_the_decode_abi(built_decode, cache):
  variant, manifest = built_decode
  folder = cache / variant.key
  assert variant.key.startswith("decode-") and manifest["key"] == variant.key
  assert manifest["spec"]["schedule"] == {"tile_m": 64, "tile_n": variant.schedule.tile_n,
                                          "num_stages": variant.schedule.num_stages,
                                          "fp8_stages": 0, "chunked": False}
  assert manifest["spec"]["kv_dtype"] is None
  assert build.exported_symbols(folder / VARIANT_LIBRARY) == set(
      build.DECODE_VARIANT_ABI_SYMBOLS)
  assert manifest["extra_cubins"] == {} and (folder / "kernel.cubin").is_file()
  assert build.manifest_is_current(variant, cache)


@pytest.mark.cutlass
@pytest.mark.parametrize("built", ["built_bwd", "built_decode"])
def test_handler_registry_accepts_backward_and_decode_libraries(built, cache, request):
  if ffi._cuda_device_present():
    pytest.skip("a CUDA device is present: loading succeeds here")
  variant, _ = request.getfixturevalue(built)
  build.build_handler_library(cache)
  lib = ctypes.CDLL(str(cache / HANDLER_LIBRARY))
  lib.jaxflash_ffi_register_variant.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
  lib.jaxflash_ffi_last_error.restype = ctypes.c_char_p
  path = str(cache / variant.key / VARIANT_LIBRARY).encode()
  # The ABI check passes (the library's bwd or decode entry instead of the fwd one); only the
  # cubin load needs a GPU.
  assert lib.jaxflash_ffi_register_variant(variant.key.encode(), path) == 1
  assert "loading the kernel module failed" in lib.jaxflash_ffi_last_error().decode()


def test_cli_selects_forward_backward_and_decode_variants(tmp_path, capsys):
  assert build.main(["--list", "--cache-dir", str(tmp_path)]) == 0
  keys = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
  want = (config.shipped_variants() + config.shipped_variants(direction="bwd")
          + config.shipped_variants(direction="decode"))
  assert keys == [v.key for v in want]
  # 12 split-KV over 16-bit caches, 3 over FP8 caches, 6 chunked prefill (m128).
  assert sum(key.startswith("decode-") for key in keys) == 21
  # Over FP8 caches only float16 ones: bfloat16 queries run them (config.decode_launched).
  assert sum("-kve4m3-" in key for key in keys) == 3
  assert not any("-kve4m3-" in key and "-bf16-" in key for key in keys)
  assert sum(key.startswith("decode-") and key.endswith("-m128n128s2") for key in keys) == 6


def test_every_direction_has_its_glue_and_abi_entry():
  """Each direction's variant library exports the common functions and its own entry, built
  from its own glue source, which the manifest's source hash covers."""
  entries = {"fwd": "jaxflash_variant_fwd", "bwd": "jaxflash_variant_bwd",
             "decode": "jaxflash_variant_decode"}
  assert set(entries) == set(config.DIRECTIONS)
  for direction, entry in entries.items():
    symbols = build.variant_abi_symbols(direction)
    assert entry in symbols and len(symbols) == 5
    assert not (set(entries.values()) - {entry}) & set(symbols)
  assert "variant_decode.cc" in build._VARIANT_SOURCES
  with pytest.raises(ValueError, match="direction: 'sideways' unknown"):
    build.variant_abi_symbols("sideways")


def test_missing_compiler_is_named(monkeypatch):
  monkeypatch.setenv("CXX", "/nonexistent/g++")
  with pytest.raises(build.BuildError, match="no C\\+\\+ compiler found.*apt-get install g\\+\\+"):
    build.find_toolchain()


def test_missing_cuda_headers_are_named(monkeypatch, tmp_path):
  monkeypatch.setattr(build, "_cuda_roots", lambda: [tmp_path])
  with pytest.raises(build.BuildError, match="cuda_runtime_api.h.*CUDA_HOME"):
    build.find_toolchain()


def test_missing_static_cudart_is_named(monkeypatch, tmp_path):
  (tmp_path / "include").mkdir()
  (tmp_path / "include" / "cuda_runtime_api.h").touch()
  monkeypatch.setattr(build, "_cuda_roots", lambda: [tmp_path])
  with pytest.raises(build.BuildError, match="libcudart_static.a"):
    build.find_toolchain()


def test_variant_build_without_cutlass_names_the_package(monkeypatch, tmp_path):
  monkeypatch.setattr(build, "cutlass_version", lambda: None)
  with pytest.raises(build.BuildError, match="nvidia-cutlass-dsl.*jaxflash\\[build\\]"):
    build.build_variant(config.shipped_variants()[0], tmp_path)
  assert not (tmp_path / config.shipped_variants()[0].key / VARIANT_LIBRARY).exists()


def test_import_jaxflash_does_not_import_build_or_kernels():
  code = ("import sys, jaxflash; bad = [m for m in ('jaxflash.build', 'jaxflash.kernels', "
          "'cutlass') if m in sys.modules]; assert not bad, bad")
  subprocess.run([sys.executable, "-c", code], check=True, env=dict(os.environ))


def test_prune_removes_only_stale_variant_folders(tmp_path):
  current = config.shipped_variants()[0].key
  stale = current.replace("-m", "-mstale", 1)
  for key, files in ((current, (config.VARIANT_MANIFEST,)), (stale, (config.VARIANT_MANIFEST,)),
                     ("notes", ())):
    (tmp_path / key).mkdir()
    for name in files:
      (tmp_path / key / name).write_text("{}")
  (tmp_path / config.HANDLER_LIBRARY).write_bytes(b"")
  assert build.prune_cache(tmp_path) == [stale]
  assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
      [current, "notes", config.HANDLER_LIBRARY])
  assert build.prune_cache(tmp_path / "absent") == []


def test_cli_prune_flag_keeps_current_variants(built, cache, capsys):
  variant = built[0]
  stale = cache / variant.key.replace("-m", "-mold", 1)
  stale.mkdir()
  (stale / config.VARIANT_MANIFEST).write_text("{}")
  assert build.main(["--variants", variant.key, "--cache-dir", str(cache), "--prune"]) == 0
  assert f"pruned stale variant {stale.name}" in capsys.readouterr().out
  assert not stale.exists() and build.manifest_is_current(variant, cache)


@pytest.mark.cutlass
def test_cli_list_reports_the_cache(built, cache, capsys):
  variant, _, _ = built
  assert build.main(["--list", "--cache-dir", str(cache), "--variants", variant.key]) == 0
  assert capsys.readouterr().out == f"{variant.key}  ready (cache)\n"


def _run_list(keys, env):
  return subprocess.run([sys.executable, "-m", "jaxflash.build", "--list", "--variants", *keys],
                        env=env, capture_output=True, text=True, check=True, timeout=300)


@pytest.mark.cutlass
def test_kernel_wheel_installs_and_is_found_with_an_empty_cache(built, cache, tmp_path):
  variant, _, _ = built
  out = tmp_path / "dist"
  assert build.main(["--wheel", str(out), "--cache-dir", str(cache), "--variants",
                     variant.key]) == 0
  (wheel,) = out.glob("jaxflash_kernels_sm90a-*-py3-none-*.whl")
  package = "jaxflash_kernels_sm90a"
  with zipfile.ZipFile(wheel) as zf:
    names = set(zf.namelist())
    info = json.loads(zf.read(f"{package}/kernels.json"))
  folder = f"{package}/{variant.key}"
  assert {f"{folder}/{VARIANT_LIBRARY}", f"{folder}/{VARIANT_MANIFEST}",
          f"{package}/{HANDLER_LIBRARY}", f"{package}/libjaxflash_ffi.json"} <= names
  assert not [n for n in names if n.endswith(".cubin")]  # the libraries embed them
  assert info["variants"] == [variant.key] and info["kernel_abi"] == build.abi_version()
  first = wheel.read_bytes()
  build.write_wheel([variant], cache, out)
  assert wheel.read_bytes() == first  # reproducible

  site = tmp_path / "site"
  subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                  "--target", str(site), str(wheel)], check=True, capture_output=True, timeout=300)
  env = {k: v for k, v in os.environ.items() if k != config.CACHE_DIR_ENV}
  env.update(PYTHONPATH=str(site), HOME=str(tmp_path / "home"))  # no user cache
  other = config.shipped_variants()[1].key
  proc = _run_list([variant.key, other], env)
  assert proc.stdout == f"{variant.key}  ready (wheel)\n{other}  missing\n"
  assert "kernel wheel" not in proc.stderr

  # A wheel of another jaxflash version: ignored, with one warning.
  info_path = site / package / "kernels.json"
  info_path.write_text(json.dumps(dict(info, jaxflash_version="0.0.1")))
  proc = _run_list([variant.key, other], env)
  assert proc.stdout == f"{variant.key}  missing\n{other}  missing\n"
  assert proc.stderr.count("ignoring the kernel wheel jaxflash_kernels_sm90a") == 1, proc.stderr


@pytest.mark.cutlass
def test_two_processes_build_a_variant_once(tmp_path):
  _require_toolchain()
  key = config.shipped_variants()[0].key
  cmd = [sys.executable, "-m", "jaxflash.build", "--variants", key, "--cache-dir", str(tmp_path)]
  procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for _ in range(2)]
  outs = [p.communicate(timeout=900)[0] for p in procs]
  assert [p.returncode for p in procs] == [0, 0], outs
  built = [o for o in outs if f"{key}: built in" in o]
  waited = [o for o in outs if f"{key}: up to date" in o]
  assert len(built) == 1 and len(waited) == 1, outs
  assert build.manifest_is_current(config.shipped_variants()[0], tmp_path)
  assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == [".locks"]


@pytest.mark.cutlass
def test_on_demand_build_of_a_missing_variant(tmp_path, monkeypatch, capfd):
  """ensure_variant builds what no kernel folder holds (the loading itself needs a GPU)."""
  _require_toolchain()
  variant = config.shipped_variants()[0]
  monkeypatch.setenv(config.CACHE_DIR_ENV, str(tmp_path / "kc"))
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  monkeypatch.delenv(config.BUILD_ON_DEMAND_ENV, raising=False)
  loaded = []
  monkeypatch.setattr(ffi, "_variants", {})
  monkeypatch.setattr(ffi, "_register_variant", lambda key, library: loaded.append(library))
  library = ffi.ensure_variant(variant)
  assert loaded == [library] == [tmp_path / "kc" / variant.key / VARIANT_LIBRARY]
  assert build.manifest_is_current(variant, tmp_path / "kc")
  err = capfd.readouterr().err
  assert re.fullmatch(rf"jaxflash: building kernel variant {variant.key} into {tmp_path / 'kc'} "
                      rf"\(first use on this host\) \.\.\. ready in \d+ s\n", err), err


@pytest.mark.cutlass
def test_handler_loads_a_variant_from_the_kernel_folders(built, cache, tmp_path):
  """What a handler does on a variant's first call: the first folder holding the library (the
  cubin load itself needs a GPU, so on a CPU host that is where it stops)."""
  if ffi._cuda_device_present():
    pytest.skip("a CUDA device is present: loading succeeds here")
  variant, _, _ = built
  lib = ctypes.CDLL(str(cache / HANDLER_LIBRARY))
  lib.jaxflash_ffi_set_kernel_folders.argtypes = [ctypes.POINTER(ctypes.c_char_p), ctypes.c_int32]
  lib.jaxflash_ffi_register_from_folders.argtypes = [ctypes.c_char_p]
  lib.jaxflash_ffi_last_error.restype = ctypes.c_char_p

  def load(*folders):
    array = (ctypes.c_char_p * len(folders))(*(str(f).encode() for f in folders))
    assert lib.jaxflash_ffi_set_kernel_folders(array, len(folders)) == 0
    assert lib.jaxflash_ffi_register_from_folders(variant.key.encode()) == 1
    return lib.jaxflash_ffi_last_error().decode()

  empty, broken = tmp_path / "empty", tmp_path / "broken"
  (broken / variant.key).mkdir(parents=True)
  (broken / variant.key / VARIANT_LIBRARY).write_bytes(b"not a library")
  assert load() == f"kernel variant '{variant.key}' is in none of the kernel folders (none set)"
  assert load(empty) == f"kernel variant '{variant.key}' is in none of the kernel folders ({empty})"
  error = load(empty, broken, cache)  # the broken library is reported, the next folder tried
  assert error.startswith(f"kernel variant '{variant.key}' did not load from the kernel folders:")
  assert f"cannot open kernel variant '{variant.key}' ({broken / variant.key}" in error
  assert "loading the kernel module failed" in error  # found in `cache`: only the GPU is missing
  assert lib.jaxflash_ffi_is_registered(variant.key.encode()) == 0
