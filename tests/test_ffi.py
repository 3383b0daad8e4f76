"""jaxflash.ffi on a CPU host: attribute names agree with the C++ binding, cache paths, errors."""

import re
from pathlib import Path

import numpy as np
import pytest

from jaxflash import config, ffi
from jaxflash.config import AttentionConfig, KernelVariant

_HANDLERS_CC = Path(ffi.__file__).parent / "handlers.cc"


def _variant(causal=False):
  cfg = AttentionConfig(softmax_scale=0.125, causal=causal)
  return KernelVariant.for_call("fwd", "sm90a", "bfloat16", 128, 128, cfg)


def _bound_attributes(symbol: str) -> tuple[str, ...]:
  """Attribute names, in order, of the XLA_FFI_DEFINE_HANDLER_SYMBOL(symbol, ...) binding, with
  those that its call of BindAttentionAttrs (the attributes the forward and backward share)
  binds in the place of that call."""
  text = _HANDLERS_CC.read_text()
  start = re.search(rf"XLA_FFI_DEFINE_HANDLER_SYMBOL\(\s*{symbol},", text).end()
  binding = text[start:text.index(");\n", start)]  # the binding and its traits
  helper_start = text.index("auto BindAttentionAttrs(")
  helper = text[helper_start:text.index("\n}\n", helper_start)]
  binding = binding.replace("BindAttentionAttrs(", helper)
  return tuple(re.findall(r'\.(?:template )?Attr<[^>]+>\("(\w+)"\)', binding))


@pytest.mark.parametrize("symbol,names", [
    (ffi._FWD_HANDLER_SYMBOL, config.FWD_ATTRIBUTE_NAMES),
    (ffi._BWD_HANDLER_SYMBOL, config.BWD_ATTRIBUTE_NAMES),
    (ffi._DECODE_HANDLER_SYMBOL, config.DECODE_ATTRIBUTE_NAMES)], ids=["fwd", "bwd", "decode"])
def test_attribute_names_match_the_cpp_binding(symbol, names):
  assert _bound_attributes(symbol) == names


def test_target_and_symbol_names_match_the_cpp_source():
  text = _HANDLERS_CC.read_text()
  assert f'kFwdTarget = "{config.FWD_TARGET}"' in text
  assert f'kBwdTarget = "{config.BWD_TARGET}"' in text
  assert f'kDecodeTarget = "{config.DECODE_TARGET}"' in text
  assert [target for target, _, _ in ffi._TARGETS] == [config.FWD_TARGET, config.BWD_TARGET,
                                                       config.DECODE_TARGET]
  for _, instantiate, execute in ffi._TARGETS:
    for symbol in (instantiate, execute):
      assert re.search(rf"XLA_FFI_DEFINE_HANDLER_SYMBOL\(\s*{symbol},", text)


@pytest.mark.parametrize("symbol", [ffi._FWD_HANDLER_SYMBOL, ffi._BWD_HANDLER_SYMBOL,
                                    ffi._DECODE_HANDLER_SYMBOL])
def test_execute_handlers_declare_command_buffer_compatibility(symbol):
  """XLA records only handlers with this trait into command buffers; Python registers the
  targets with the same trait (ffi._load_handler)."""
  text = _HANDLERS_CC.read_text()
  start = re.search(rf"XLA_FFI_DEFINE_HANDLER_SYMBOL\(\s*{symbol},", text).end()
  assert "{ffi::Traits::kCmdBufferCompatible}" in text[start:text.index(");\n", start)]


def test_fwd_attributes_are_typed_and_complete():
  cfg = AttentionConfig(softmax_scale=0.3, causal=True, window_left=5, softcap=2.5)
  attrs = ffi.fwd_attributes(_variant(causal=True), cfg)
  assert tuple(attrs) == config.FWD_ATTRIBUTE_NAMES
  assert attrs["variant"] == _variant(causal=True).key
  assert attrs["softmax_scale"].dtype == np.float32 and attrs["softmax_scale"] == np.float32(0.3)
  assert attrs["causal"] is True
  assert attrs["window_left"].dtype == np.int32 and attrs["window_left"] == 5
  assert attrs["window_right"] == config.WINDOW_UNBOUNDED  # None means unbounded
  assert attrs["softcap"].dtype == np.float32 and attrs["softcap"] == np.float32(2.5)
  assert attrs["head_dim"] == 128 and attrs["head_dim_v"].dtype == np.int32


def test_fwd_attributes_carry_head_dim_v_of_the_variant():
  """handlers.cc checks these against the variant key's d<head_dim>/dv<head_dim_v> tokens and
  against the q/k and v/out extents."""
  cfg = AttentionConfig(softmax_scale=192 ** -0.5)
  variant = KernelVariant.for_call("fwd", "sm90a", "bfloat16", 192, 128, cfg)
  attrs = ffi.fwd_attributes(variant, cfg)
  assert attrs["head_dim"] == 192 and attrs["head_dim_v"] == 128
  assert "-d192-dv128-" in attrs["variant"]
  assert variant in config.shipped_variants()


def test_bwd_attributes_add_deterministic_to_the_forward_ones():
  cfg = AttentionConfig(softmax_scale=0.3, causal=True, deterministic=True)
  variant = KernelVariant.for_call("bwd", "sm90a", "float16", 64, 64, cfg)
  attrs = ffi.bwd_attributes(variant, cfg)
  assert tuple(attrs) == config.BWD_ATTRIBUTE_NAMES
  assert attrs["variant"] == variant.key and variant.key.startswith("bwd-")
  assert attrs["deterministic"] is True and attrs["causal"] is True
  assert attrs["head_dim"] == 64 and attrs["softmax_scale"] == np.float32(0.3)
  plain = cfg.replace(deterministic=False)
  attrs = ffi.bwd_attributes(KernelVariant.for_call("bwd", "sm90a", "float16", 64, 64, plain),
                             plain)
  assert attrs["deterministic"] is False


def test_decode_attributes_are_typed_and_complete():
  variant = config.decode_variant("float16", 192, 128)
  attrs = ffi.decode_attributes(variant, 0.25, seqlen_q=3, window_left=None, window_right=0,
                                softcap=None)
  assert tuple(attrs) == config.DECODE_ATTRIBUTE_NAMES
  assert attrs["variant"] == variant.key and variant.key.startswith("decode-")
  assert attrs["softmax_scale"].dtype == np.float32 and attrs["softmax_scale"] == np.float32(0.25)
  assert attrs["seqlen_q"].dtype == np.int32 and attrs["seqlen_q"] == 3
  assert attrs["window_left"] == config.WINDOW_UNBOUNDED and attrs["window_right"] == 0
  assert attrs["window_left"].dtype == attrs["window_right"].dtype == np.int32
  assert attrs["softcap"].dtype == np.float32 and attrs["softcap"] == 0.0
  assert (attrs["head_dim"], attrs["head_dim_v"]) == (192, 128)
  attrs = ffi.decode_attributes(variant, 1.0, 1, window_left=2 ** 40, window_right=None,
                                softcap=30.0)
  assert attrs["window_left"] == config.WINDOW_UNBOUNDED == attrs["window_right"]
  assert attrs["softcap"] == np.float32(30.0)
  with pytest.raises(ValueError, match="is a 'fwd' variant; the decode call takes a 'decode'"):
    ffi.decode_attributes(_variant(), 1.0, 1, None, None, None)


def test_unset_softcap_is_zero():
  attrs = ffi.fwd_attributes(_variant(), AttentionConfig(softmax_scale=1.0))
  assert attrs["softcap"] == 0.0 and attrs["window_left"] == config.WINDOW_UNBOUNDED


def test_window_attributes_clip_to_the_unbounded_value():
  cfg = AttentionConfig(softmax_scale=1.0, window_left=-2 ** 40, window_right=-7)
  attrs = ffi.fwd_attributes(_variant(), cfg)
  assert attrs["window_left"] == -config.WINDOW_UNBOUNDED and attrs["window_right"] == -7


def test_cache_dir_env_override(monkeypatch, tmp_path):
  monkeypatch.setenv(config.CACHE_DIR_ENV, str(tmp_path / "kc"))
  assert ffi.cache_dir() == tmp_path / "kc"


def test_cache_dir_default_is_versioned(monkeypatch):
  import jaxflash
  monkeypatch.delenv(config.CACHE_DIR_ENV, raising=False)
  assert ffi.cache_dir() == Path.home() / ".cache" / "jaxflash" / jaxflash.__version__


def test_build_command():
  assert ffi.build_command(["a", "b"], Path("/c")) == (
      "python -m jaxflash.build --variants a b --cache-dir /c")
  assert ffi.build_command(cache=Path("/c")) == "python -m jaxflash.build --all --cache-dir /c"


def test_register_without_cuda_device_and_without_libraries_is_a_no_op(monkeypatch, tmp_path):
  monkeypatch.setattr(ffi, "_cuda_device_present", lambda: False)
  monkeypatch.setenv(config.CACHE_DIR_ENV, str(tmp_path))
  monkeypatch.setenv("HOME", str(tmp_path.parent / f"{tmp_path.name}-home"))  # no user cache
  ffi.register()
  ffi.register()
  assert not list(tmp_path.iterdir())  # nothing built or written on a host that cannot run it


def test_missing_handler_library_without_toolchain_names_the_fixes(monkeypatch, tmp_path):
  from jaxflash import build

  def no_toolchain():
    raise build.BuildError("no C++ compiler found")

  monkeypatch.setattr(build, "find_toolchain", no_toolchain)
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  monkeypatch.setenv(config.CACHE_DIR_ENV, str(tmp_path))
  with pytest.raises(RuntimeError, match="(?s)cannot be built here: no C\\+\\+ compiler found"
                                         ".*--wheel OUTDIR.*python -m jaxflash.build --all"):
    ffi._handler_library()
