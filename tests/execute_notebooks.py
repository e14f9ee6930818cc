"""Executes the notebooks in notebooks/ and stores them with their outputs.

The repository keeps its notebooks executed, so that a reader sees the plots
and numbers without running them. After changing a notebook or an API it
uses, run from the repository root:

  .venv/bin/python tests/execute_notebooks.py              # all of them
  .venv/bin/python tests/execute_notebooks.py notebooks/02_loss_scaling.ipynb

Each notebook runs top to bottom in a kernel of this interpreter, with this
checkout first on the path, on whatever backend JAX finds (run it on a CPU:
the notebooks pick small sizes there). Execution counts and outputs are
stored; timing metadata and widget state are dropped to keep the files small
and the diffs readable. tests/test_notebooks.py executes the same notebooks
again with `execute` below, in memory, and never rewrites them.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS_DIR = ROOT / "notebooks"


def kernel_env(root: pathlib.Path) -> pathlib.Path:
  """A JUPYTER_PATH folder whose "python3" kernel runs this very interpreter."""
  spec = root / "kernels" / "python3"
  spec.mkdir(parents=True, exist_ok=True)
  (spec / "kernel.json").write_text(json.dumps({
      "argv": [sys.executable, "-m", "ipykernel_launcher", "-f",
               "{connection_file}"],
      "display_name": "Python 3 (jmp_amp)", "language": "python",
      "env": {"PYTHONPATH": os.pathsep.join(
          [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(
              os.pathsep) if p])}}))
  return root


def execute(nb, jupyter_path: pathlib.Path, timeout: int = 600):
  """Runs notebook `nb` (an nbformat node) in place; raises on a failing
  cell."""
  import nbclient  # pylint: disable=g-import-not-at-top
  old = os.environ.get("JUPYTER_PATH")
  os.environ["JUPYTER_PATH"] = str(jupyter_path)
  try:
    client = nbclient.NotebookClient(
        nb, timeout=timeout, kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOKS_DIR)}})
    client.execute()
  finally:
    if old is None:
      os.environ.pop("JUPYTER_PATH", None)
    else:
      os.environ["JUPYTER_PATH"] = old
  return nb


def strip_volatile(nb) -> None:
  """Drops per-run metadata (timings, widget state) that only bloats diffs."""
  nb.metadata.pop("widgets", None)
  for cell in nb.cells:
    cell.metadata.pop("execution", None)
    cell.metadata.pop("ExecuteTime", None)


def main(argv: list[str]) -> int:
  import nbformat  # pylint: disable=g-import-not-at-top
  paths = ([pathlib.Path(p) for p in argv]
           or sorted(NOTEBOOKS_DIR.glob("*.ipynb")))
  with tempfile.TemporaryDirectory() as tmp:
    jupyter_path = kernel_env(pathlib.Path(tmp))
    for path in paths:
      nb = nbformat.read(path, as_version=4)
      execute(nb, jupyter_path)
      strip_volatile(nb)
      nb.metadata["kernelspec"] = {"display_name": "Python 3",
                                   "language": "python", "name": "python3"}
      nbformat.write(nb, path)
      print(f"{path}: executed, {path.stat().st_size:,} bytes")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
