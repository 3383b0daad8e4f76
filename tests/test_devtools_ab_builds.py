"""devtools/ab_builds.sh: one command against kernel builds in alternation (run here with a
stand-in command that prints the kernel folder it was given)."""
import os
import pathlib
import subprocess

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "devtools" / "ab_builds.sh"
SHOW = ["sh", "-c", 'echo "| ${JAXFLASH_CACHE_DIR:-installed} |"; echo not a table line']


def _run(tmp_path, *args, env_cache="/elsewhere"):
  env = dict(os.environ, OUT=str(tmp_path / "out"), JAXFLASH_CACHE_DIR=env_cache)
  return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env,
                        timeout=60)


def test_rounds_alternate_the_builds_and_keep_each_log(tmp_path):
  cand = tmp_path / "cand"
  cand.mkdir()
  got = _run(tmp_path, "2", "base=-", f"cand={cand}", "--", *SHOW)
  assert got.returncode == 0, got.stderr
  assert got.stdout.splitlines() == [
      "base r1 | installed |", f"cand r1 | {cand} |",
      f"cand r2 | {cand} |", "base r2 | installed |"]
  logs = sorted(p.name for p in (tmp_path / "out").iterdir())
  assert logs == ["ab_base_r1.log", "ab_base_r2.log", "ab_cand_r1.log", "ab_cand_r2.log"]
  assert "not a table line" in (tmp_path / "out" / "ab_cand_r2.log").read_text()


def test_a_failing_run_is_reported_and_the_rest_still_run(tmp_path):
  got = _run(tmp_path, "1", "a=-", "b=-", "--", "sh", "-c", "echo '| t |'; exit 3")
  assert got.returncode == 1
  assert got.stdout.count("exit 3 (log: ") == 2 and got.stdout.count("| t |") == 2


def test_bad_arguments_name_what_is_accepted(tmp_path):
  for args, words in [(("0", "a=-", "--", "true"), "ROUNDS: '0'"),
                      (("1", "a", "--", "true"), "build 'a' is not NAME=DIR"),
                      (("1", f"a={tmp_path / 'missing'}", "--", "true"), "is not a folder"),
                      (("1", "a=-", "--"), "usage:"),
                      (("1", "--", "true"), "usage:")]:
    got = _run(tmp_path, *args)
    assert got.returncode == 2 and words in got.stderr, (args, got.stderr)
