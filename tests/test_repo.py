"""Repository contracts: CI runs the README's test command; kernels never import jax."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _readme_commands():
  text = (ROOT / "README.md").read_text()
  setup = text.split("## Set up on a fresh machine", 1)[1].split("\n## ", 1)[0]
  return re.findall(r"```bash\n(.+?)\n```", setup)


def test_readme_has_exactly_two_setup_commands():
  commands = _readme_commands()
  assert len(commands) == 2, commands
  assert all("python3 -m venv" in c for c in commands)


def test_ci_runs_the_readme_test_command():
  test_command = next(c for c in _readme_commands() if "pytest" in c)
  ci = (ROOT / ".ci" / "run").read_text().splitlines()
  assert test_command in ci, f"{test_command!r} not a line of .ci/run"
