"""Every `>>>` example in the package runs as a doctest in the default test run.

The doctests themselves are collected by pytest (``--doctest-modules`` over
jmp_amp/, see pyproject.toml; the names an example may use without importing
them come from conftest.py). These tests check that this stays so.
"""

import doctest
import importlib
import pathlib
import pkgutil
import re
import subprocess
import sys

import pytest

import jmp_amp

ROOT = pathlib.Path(__file__).resolve().parent.parent
NAMESPACE = {"jax", "jnp", "np", "optax", "nnx", "nn", "jmp_amp"}


def test_doctests_are_in_the_default_run():
  tomllib = pytest.importorskip("tomllib")
  config = tomllib.loads((ROOT / "pyproject.toml").read_text())
  options = config["tool"]["pytest"]["ini_options"]
  assert "--doctest-modules" in options["addopts"].split()
  assert "jmp_amp" in options["testpaths"]


def test_no_example_is_skipped():
  sources = [*ROOT.joinpath("jmp_amp").rglob("*.py"),
             *ROOT.joinpath("models").rglob("*.py")]
  skipping = [str(p.relative_to(ROOT)) for p in sources
              if re.search(r"doctest:.*\+SKIP", p.read_text())]
  assert not skipping


def test_doctest_namespace_has_the_documented_names(doctest_namespace):
  assert NAMESPACE <= set(doctest_namespace)
  assert doctest_namespace["jmp_amp"] is jmp_amp


def _modules_with_examples():
  names = []
  for info in pkgutil.walk_packages(jmp_amp.__path__, "jmp_amp."):
    module = importlib.import_module(info.name)
    tests = doctest.DocTestFinder().find(module)
    if any(t.examples for t in tests if t.name.startswith(module.__name__)):
      names.append(info.name)
  return names


def test_every_module_with_examples_is_collected():
  expected = _modules_with_examples()
  assert expected, "no >>> examples found"
  result = subprocess.run(
      [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p",
       "no:xdist", "-p", "no:cacheprovider", "jmp_amp"],
      cwd=ROOT, capture_output=True, text=True, check=False, timeout=300)
  assert result.returncode == 0, result.stdout + result.stderr
  collected = {line.split("::")[1].rsplit(".", 1)[0] if "." in
               line.split("::")[1] else line.split("::")[1]
               for line in result.stdout.splitlines() if "::" in line}
  collected |= {line.split("::")[1] for line in result.stdout.splitlines()
                if "::" in line}
  missing = [name for name in expected if name not in collected]
  assert not missing, (missing, result.stdout)
