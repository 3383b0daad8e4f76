"""devtools for score_mod / mask_mod variants: devtools/prebuild_mods.py's specs written under one
JAX and read back under another, and devtools/sanitize/calls.py's families that run only when
named."""

import json
import sys

import pytest

from tests._scripts import load_script


def test_prebuild_specs_round_trip(tmp_path, monkeypatch, capsys):
  """--write-specs writes one spec per variant (no build, no cache folder); --from-specs
  --list reads the same variants back, each missing from an empty cache."""
  monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts its tree first
  prebuild = load_script("devtools/prebuild_mods.py")
  specs = tmp_path / "specs"
  monkeypatch.setattr("sys.argv", ["prebuild_mods.py", "--write-specs", str(specs)])
  assert prebuild.main() == 0
  files = sorted(specs.glob("*.json"))
  assert files and all(json.loads(f.read_text())["direction"] in ("fwd", "bwd") for f in files)
  assert any("-mods" in f.stem for f in files)
  capsys.readouterr()
  monkeypatch.setattr("sys.argv", ["prebuild_mods.py", "--from-specs", str(specs), "--list",
                                   "--cache-dir", str(tmp_path / "cache")])
  assert prebuild.main() == 0
  listed = dict(line.split() for line in capsys.readouterr().out.splitlines())
  assert sorted(listed) == [f.stem for f in files]
  assert set(listed.values()) == {"missing"}


def test_prebuild_errors_name_the_argument(tmp_path, monkeypatch, capsys):
  """No cache folder to build into, a folder without specs, a file that is not a spec."""
  monkeypatch.setattr(sys, "path", list(sys.path))
  prebuild = load_script("devtools/prebuild_mods.py")
  run = lambda *argv: monkeypatch.setattr("sys.argv", ["prebuild_mods.py", *argv]) or (
      prebuild.main())
  with pytest.raises(SystemExit):
    run("--from-specs", str(tmp_path))
  assert "--cache-dir is required" in capsys.readouterr().err
  cache = str(tmp_path / "cache")
  with pytest.raises(SystemExit, match=r"no \*\.json spec"):
    run("--from-specs", str(tmp_path), "--cache-dir", cache)
  (tmp_path / "x.json").write_text("{}")
  with pytest.raises(SystemExit, match=r"x\.json: spec: not a kernel variant spec"):
    run("--from-specs", str(tmp_path), "--cache-dir", cache)


def test_the_mods_sanitizer_family_runs_only_when_named(capsys):
  calls = load_script("devtools/sanitize/calls.py")
  assert "mods" in calls.FAMILIES
  assert calls.main(["list"]) == 0
  listed = capsys.readouterr().out.split()
  assert "mods" not in listed and "bias" in listed
  assert set(listed) == set(calls.FAMILIES) - set(calls.NAMED_ONLY)
