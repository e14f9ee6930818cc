"""The built distribution claims no generic top-level name.

The reference models ship as `jmp_amp.models` (jmp_amp/models links to the
repository's models/ folder); a project with its own `models` package or
models.py must never import ours by accident.
"""

import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory):
  pytest.importorskip("setuptools")
  src = tmp_path_factory.mktemp("src")
  for name in ("pyproject.toml", "README.md"):
    shutil.copy(ROOT / name, src / name)
  ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
  shutil.copytree(ROOT / "jmp_amp", src / "jmp_amp", symlinks=True,
                  ignore=ignore)
  shutil.copytree(ROOT / "models", src / "models", ignore=ignore)
  out = tmp_path_factory.mktemp("dist")
  result = subprocess.run(
      [sys.executable, "-c", "import sys; from setuptools import build_meta; "
       "print(build_meta.build_wheel(sys.argv[1]))", str(out)],
      cwd=src, capture_output=True, text=True, check=False, timeout=300)
  assert result.returncode == 0, result.stderr
  wheel = out / result.stdout.split()[-1]
  return zipfile.ZipFile(wheel).namelist()


def test_only_jmp_amp_is_top_level(wheel_names):
  top = {name.split("/")[0] for name in wheel_names
         if not name.split("/")[0].endswith(".dist-info")}
  assert top == {"jmp_amp"}, top


def test_models_ship_as_jmp_amp_models(wheel_names):
  for module in ("__init__", "mlp", "resnet", "gpt", "data", "convert"):
    assert f"jmp_amp/models/{module}.py" in wheel_names, module


def test_models_use_relative_imports():
  for path in (ROOT / "models").glob("*.py"):
    text = path.read_text()
    assert "from models" not in text and "import models" not in text, path
