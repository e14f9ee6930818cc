"""Executes every notebook in notebooks/ top to bottom; each ends with a cell of asserts.

The notebooks run in a Jupyter kernel of the interpreter running the tests (a "python3" kernelspec
pointing at `sys.executable` is put first on JUPYTER_PATH), so they see the same environment.
"""

import json
import pathlib
import sys

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

NOTEBOOKS_DIR = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))


@pytest.fixture(scope="module")
def this_interpreter_kernel(tmp_path_factory):
  """JUPYTER_PATH with a "python3" kernelspec that runs this very interpreter."""
  root = tmp_path_factory.mktemp("jupyter")
  spec = root / "kernels" / "python3"
  spec.mkdir(parents=True)
  (spec / "kernel.json").write_text(json.dumps({
      "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
      "display_name": "Python 3 (tests)", "language": "python"}))
  return str(root)


def test_there_are_notebooks():
  assert NOTEBOOKS, f"no notebooks in {NOTEBOOKS_DIR}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, this_interpreter_kernel, monkeypatch):
  monkeypatch.setenv("JUPYTER_PATH", this_interpreter_kernel)
  nb = nbformat.read(path, as_version=4)
  client = nbclient.NotebookClient(
      nb, timeout=300, kernel_name="python3",
      resources={"metadata": {"path": str(NOTEBOOKS_DIR)}})
  try:
    client.execute()
  except nbclient.exceptions.CellExecutionError as e:
    pytest.fail(f"{path.name} failed:\n{e}", pytrace=False)
  errors = [out for cell in nb.cells if cell.cell_type == "code"
            for out in cell.get("outputs", []) if out.get("output_type") == "error"]
  assert not errors, [f"{e['ename']}: {e['evalue']}" for e in errors]
  # The last code cell holds the notebook's asserts; it must have run to its end.
  last = [cell for cell in nb.cells if cell.cell_type == "code"][-1]
  assert "assert" in last.source
  printed = "".join(out.get("text", "") for out in last.get("outputs", [])
                    if out.get("output_type") == "stream")
  assert "all checks passed" in printed, printed
