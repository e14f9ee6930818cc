"""The built distribution and the package's layout.

The reference models ship as `jmp_amp.models`, installed from the repository's
models/ folder (setuptools' ``package-dir``, no link): a project with its own
`models` package or models.py must never import ours by accident. The layers
import downwards only: no import cycles, `import jmp_amp` loads neither Flax
nor the models, and the tools' modules stay small.
"""

import ast
import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "jmp_amp"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
  pytest.importorskip("setuptools")
  src = tmp_path_factory.mktemp("src")
  for name in ("pyproject.toml", "README.md"):
    shutil.copy(ROOT / name, src / name)
  ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
  shutil.copytree(PACKAGE, src / "jmp_amp", ignore=ignore)
  shutil.copytree(ROOT / "models", src / "models", ignore=ignore)
  out = tmp_path_factory.mktemp("dist")
  result = subprocess.run(
      [sys.executable, "-c", "import sys; from setuptools import build_meta; "
       "print(build_meta.build_wheel(sys.argv[1]))", str(out)],
      cwd=src, capture_output=True, text=True, check=False, timeout=300)
  assert result.returncode == 0, result.stderr
  return out / result.stdout.split()[-1]


@pytest.fixture(scope="module")
def wheel_names(wheel):
  return zipfile.ZipFile(wheel).namelist()


def test_only_jmp_amp_is_top_level(wheel_names):
  top = {name.split("/")[0] for name in wheel_names
         if not name.split("/")[0].endswith(".dist-info")}
  assert top == {"jmp_amp"}, top


def test_models_ship_as_jmp_amp_models(wheel_names):
  for module in ("__init__", "mlp", "resnet", "gpt", "data", "convert"):
    assert f"jmp_amp/models/{module}.py" in wheel_names, module


def test_every_package_ships(wheel_names):
  # pyproject.toml lists the packages (models/ is mapped to jmp_amp.models):
  # a package missing from that list would be missing from the wheel.
  for init in PACKAGE.rglob("__init__.py"):
    name = init.relative_to(ROOT).as_posix()
    assert name in wheel_names, (
        f"{name} is not in the wheel: add its package to [tool.setuptools] "
        "packages in pyproject.toml")


def test_the_installed_wheel_has_jmp_amp_models(wheel, tmp_path):
  site = tmp_path / "site"
  zipfile.ZipFile(wheel).extractall(site)  # what pip does with a pure wheel
  code = ("import sys, jmp_amp, jmp_amp.models; "
          "print(jmp_amp.models.__file__); print(jmp_amp.models.MLP)")
  result = subprocess.run(
      [sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
      text=True, check=False, timeout=300,
      env={**os.environ, "PYTHONPATH": str(site)})
  assert result.returncode == 0, result.stderr
  assert result.stdout.startswith(str(site / "jmp_amp" / "models")), (
      result.stdout)


def test_installed_jmp_amp_has_jmp_amp_models(tmp_path):
  # The environment running the tests (`pip install -e .` in the README):
  # jmp_amp.models comes from models/, through the editable install.
  result = subprocess.run(
      [sys.executable, "-c", "import jmp_amp.models as m; print(m.__file__)"],
      cwd=tmp_path, capture_output=True, text=True, check=False, timeout=300)
  if "No module named 'jmp_amp'" in result.stderr:
    pytest.skip("jmp_amp is not installed in this environment")
  assert result.returncode == 0, result.stderr
  assert pathlib.Path(result.stdout.strip()).name == "__init__.py"


def test_import_jmp_amp_loads_neither_flax_nor_the_models():
  code = ("import sys, jmp_amp; "
          "print(sorted(m for m in sys.modules if m == 'flax' "
          "or m.startswith(('flax.', 'jmp_amp.models', 'jmp_amp.flax', "
          "'jmp_amp.tools.bench'))))")
  result = subprocess.run([sys.executable, "-c", code], cwd=ROOT,
                          capture_output=True, text=True, check=False,
                          timeout=300)
  assert result.returncode == 0, result.stderr
  assert result.stdout.strip() == "[]", result.stdout


def test_models_use_relative_imports():
  for path in (ROOT / "models").glob("*.py"):
    text = path.read_text()
    assert "from models" not in text and "import models" not in text, path


def _imports() -> dict[str, set[str]]:
  """Module -> the jmp_amp modules it imports (function-level imports too)."""
  modules = {}
  for path in PACKAGE.rglob("*.py"):
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
  graph = {}
  for name, (path, is_package) in modules.items():
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
      if isinstance(node, ast.Import):
        found |= {a.name for a in node.names if a.name in modules}
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
          up = package.split(".")[:len(package.split(".")) - node.level + 1]
          base = ".".join(up + ([node.module] if node.module else []))
        for a in node.names:
          target = f"{base}.{a.name}"
          if target in modules:
            found.add(target)
          elif base in modules:
            found.add(base)
    graph[name] = found - {name}
  return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components with more than one module."""
  index, low, stack, on_stack, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in graph[v]:
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        out.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return out


def test_no_import_cycles():
  graph = _imports()
  assert "jmp_amp.tools.audit" in graph["jmp_amp.tools.gpu_target"]
  assert _cycles(graph) == []
  # The checker finds a cycle when there is one.
  assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [
      ["a", "b", "c"]]


def test_the_core_and_flax_never_import_the_tools():
  for name, imported in _imports().items():
    if name.startswith(("jmp_amp._src", "jmp_amp.flax")):
      tools = sorted(m for m in imported if m.startswith("jmp_amp.tools"))
      assert not tools, (name, tools)


def test_no_module_is_over_500_lines():
  """Issue 36: a module that outgrows 500 lines is split by job."""
  sizes = {p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines())
           for p in PACKAGE.rglob("*.py")}
  assert len([p for p in sizes if p.startswith("jmp_amp/tools/")]) >= 10
  over = {p: n for p, n in sizes.items() if n > 500}
  assert not over, over


def test_collecting_the_suite_left_xla_flags_as_conftest_set_them():
  # The check scripts the tests run in subprocesses add 8 simulated devices
  # to XLA_FLAGS at import; collected (--doctest-modules) before JAX started
  # its backend, they gave this process, and every test in it, 8 devices.
  # conftest.py names the backend level once (or leaves the caller's).
  flags = os.environ.get("XLA_FLAGS", "")
  assert flags.count("--xla_backend_optimization_level") <= 1, flags


def test_the_slow_steps_longest_first_files_exist():
  # conftest.py orders the slow step's files by LONGEST_FIRST; a name that
  # no longer matches a file would silently fall to the end of the run.
  tree = ast.parse((ROOT / "conftest.py").read_text())
  names, = [ast.literal_eval(node.value) for node in tree.body
            if isinstance(node, ast.Assign)
            and ast.unparse(node.targets[0]) == "LONGEST_FIRST"]
  assert names
  missing = [name for name in names if not (ROOT / "tests" / name).is_file()]
  assert not missing, missing
