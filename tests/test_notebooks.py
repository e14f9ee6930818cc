"""Executes every notebook in notebooks/ top to bottom; each ends with a cell
of asserts.

The notebooks are stored executed (tests/execute_notebooks.py writes them);
this test runs them again in memory with the same code, in a kernel of the
interpreter running the tests with this checkout first on the path, and
never writes them back.
"""

import pathlib

import pytest

import execute_notebooks  # stores them executed

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))

MAX_BYTES = 400_000  # outputs are small plots and text, no embedded data


@pytest.fixture(scope="module")
def jupyter_path(tmp_path_factory):
  return execute_notebooks.kernel_env(tmp_path_factory.mktemp("jupyter"))


def test_there_are_notebooks():
  assert NOTEBOOKS, f"no notebooks in {NOTEBOOKS_DIR}"


def _outputs(nb, kind):
  return [out for cell in nb.cells if cell.cell_type == "code"
          for out in cell.get("outputs", []) if out.get("output_type") == kind]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_stored_executed_and_small(path):
  nb = nbformat.read(path, as_version=4)
  code = [cell for cell in nb.cells if cell.cell_type == "code"]
  assert all(cell.get("execution_count") for cell in code), (
      f"{path.name} has cells stored without running them; run "
      "tests/execute_notebooks.py")
  assert not _outputs(nb, "error"), path.name
  assert any("image/png" in out.get("data", {})
             for out in _outputs(nb, "display_data")), (
                 f"{path.name} stores no plot")
  assert path.stat().st_size < MAX_BYTES, (path.name, path.stat().st_size)


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, jupyter_path):
  before = path.read_bytes()
  nb = nbformat.read(path, as_version=4)
  try:
    execute_notebooks.execute(nb, jupyter_path, timeout=300)
  except Exception as e:  # pylint: disable=broad-except
    pytest.fail(f"{path.name} failed:\n{e}", pytrace=False)
  assert not _outputs(nb, "error"), [
      f"{e['ename']}: {e['evalue']}" for e in _outputs(nb, "error")]
  # The last code cell holds the notebook's asserts; it must have run to its
  # end.
  last = [cell for cell in nb.cells if cell.cell_type == "code"][-1]
  assert "assert" in last.source
  printed = "".join(out.get("text", "") for out in last.get("outputs", [])
                    if out.get("output_type") == "stream")
  assert "all checks passed" in printed, printed
  assert path.read_bytes() == before, f"the test rewrote {path.name}"
