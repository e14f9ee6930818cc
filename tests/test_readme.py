"""README.md's code blocks run as written, and its commands are the real ones.

Every ```python block is executed in a fresh namespace (the torch one needs
torch). Every `jmp-amp bench` line in a ```bash block parses with the bench's
own argument parser. The two set-up commands name extras that exist, and
`.ci/run` runs the README's test command verbatim.
"""

import contextlib
import io
import pathlib
import re
import shlex

import pytest

from jmp_amp.tools.bench import cli as bench

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def blocks(language):
  """(line number, source) of every fenced block in `language`."""
  return [(README[:m.start()].count("\n") + 1, m.group(2))
          for m in _FENCE.finditer(README) if m.group(1) == language]


PYTHON = blocks("python")
BASH = blocks("bash")


def test_readme_has_code_blocks_and_no_untyped_ones():
  assert len(PYTHON) >= 4 and len(BASH) >= 3
  untyped = [README[:m.start()].count("\n") + 1
             for m in _FENCE.finditer(README) if not m.group(1)]
  assert not untyped, f"code blocks without a language at lines {untyped}"


@pytest.mark.parametrize("line, source", PYTHON,
                         ids=[f"line{line}" for line, _ in PYTHON])
def test_python_block_runs(line, source):
  if re.search(r"^import torch", source, re.M):
    pytest.importorskip("torch")
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    exec(compile(source, f"README.md:{line}", "exec"), {"__name__": "readme"})  # pylint: disable=exec-used


def test_quick_start_trains_and_reports_metrics():
  line, source = next(b for b in PYTHON if "train_step" in b[1])
  namespace = {}
  with contextlib.redirect_stdout(io.StringIO()):
    exec(compile(source, f"README.md:{line}", "exec"), namespace)  # pylint: disable=exec-used
  metrics = namespace["jmp_amp"].scaling_metrics(namespace["opt_state"])
  assert int(metrics["steps"]) == 3 and int(metrics["skipped_steps"]) == 0
  assert float(abs(namespace["params"]["w"]).sum()) > 0  # updates applied


def test_migration_block_prints_the_backed_off_scales():
  line, source = next(b for b in PYTHON if "torch_like" in b[1])
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    exec(compile(source, f"README.md:{line}", "exec"), {})  # pylint: disable=exec-used
  assert out.getvalue().split() == ["32768.0", "16384.0", "32768.0"]


def _commands(source):
  lines = [text.split(" #")[0].strip() for text in source.splitlines()]
  return [text for text in lines if text and not text.startswith("#")]


def test_setup_has_two_commands_and_ci_runs_the_test_command():
  section = README[README.index("## Set-up"):README.index("## Quick start")]
  setup = [_commands(m.group(2)) for m in _FENCE.finditer(section)]
  assert len(setup) == 2 and all(len(c) == 1 for c in setup), setup
  install, test = setup[0][0], setup[1][0]
  assert "pip install -e '.[test]'" in install and "jmp-amp bench" in install
  assert test == ".venv/bin/python -m pytest -n 2 -q"
  ci = (ROOT / ".ci" / "run").read_text().splitlines()
  assert test in [text.strip() for text in ci], "ci must run the README's test command"
  assert any("pip install -e '.[test]'" in text for text in ci)


def test_extras_named_in_the_readme_exist_and_test_needs_no_torch():
  tomllib = pytest.importorskip("tomllib")
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  extras = project["optional-dependencies"]
  for name in set(re.findall(r"jmp-amp\[(\w+)\]", README)) | {"test"}:
    assert name in extras, name
  for name in ("test", "bench"):
    assert not [d for d in extras[name] if d.startswith("torch")], name
  assert not [d for d in project["dependencies"] if d.startswith("torch")]
  assert [d for d in extras["torch"] if d.startswith("torch")]


BENCH_LINES = [c for _, source in BASH for c in _commands(source)
               if c.startswith("jmp-amp bench")]


@pytest.mark.parametrize("command", BENCH_LINES)
def test_bench_command_lines_parse(command):
  parser = bench.build_parser()
  args = parser.parse_args(shlex.split(command)[2:])
  cfg = bench.config_from_args(args, parser)
  assert cfg.steps > cfg.warmup
