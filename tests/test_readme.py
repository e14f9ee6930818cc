"""README.md: short, its commands are the real ones, its policy table is true.

The README's code blocks and figures are checked with every docs page's, in
test_docs.py. Here: its size, the two set-up commands (which `.ci/run` runs
verbatim), the install hints, the links to every docs page and the
policy-name table, against `jmp_amp.get_policy` and the modes of
`jmp-amp bench`.
"""

import pathlib
import re

import pytest

import jmp_amp
from jmp_amp.tools.bench import workloads

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def section(title: str) -> str:
  """The text of the `## title` section, up to the next `## ` heading."""
  start = README.index(f"## {title}\n")
  end = README.find("\n## ", start + 1)
  return README[start:end if end > 0 else None]


def _commands(source: str) -> list[str]:
  lines = [text.split(" #")[0].strip() for text in source.splitlines()]
  return [text for text in lines if text and not text.startswith("#")]


def test_readme_is_short():
  assert len(README.encode()) <= 12 * 1024, len(README.encode())


def test_setup_has_two_commands_and_ci_runs_them_verbatim():
  setup = [_commands(m.group(2))
           for m in _FENCE.finditer(section("Set-up: the two commands"))]
  assert len(setup) == 2 and all(len(c) == 1 for c in setup), setup
  install, test = setup[0][0], setup[1][0]
  assert install == ("python3 -m venv .venv && .venv/bin/pip install -e "
                     "'.[test]' && .venv/bin/jmp-amp bench")
  assert test == ".venv/bin/python -m pytest -n 2 -q"
  ci = [line.strip() for line in
        (ROOT / ".ci" / "run").read_text().splitlines()]
  assert install in ci and test in ci, "ci must run the README's commands"


def test_extras_named_in_the_docs_exist_and_test_needs_no_torch():
  tomllib = pytest.importorskip("tomllib")
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  extras = project["optional-dependencies"]
  docs = README + "".join(p.read_text() for p in (ROOT / "docs").glob("*.md"))
  named = set(re.findall(r"(?:jmp-amp|\.)\[([\w-]+)\]", docs))
  assert {"test", "torch", "gpu-audit"} <= named, named
  assert named <= set(extras), named - set(extras)
  for name in ("test", "bench"):
    assert not [d for d in extras[name] if d.startswith("torch")], name
  assert not [d for d in project["dependencies"] if d.startswith("torch")]


def test_install_hints_are_complete():
  extras = section("Optional extras")
  # torch: the CPU build, and why (plain pip fetches the CUDA build).
  assert ("pip install torch --index-url "
          "https://download.pytorch.org/whl/cpu") in extras
  assert "CUDA build" in extras and "--compare-torch" in extras
  # gpu-audit: JAX_PLATFORMS=cpu in the hint itself, and why.
  lines = _commands(extras)
  audit = lines.index(".venv/bin/pip install -e '.[gpu-audit]'")
  assert lines[audit + 1].startswith("JAX_PLATFORMS=cpu "), lines
  assert "CUDA-plugin tracebacks" in extras, "say why JAX_PLATFORMS=cpu"


def test_every_docs_page_is_linked():
  pages = {p.name for p in (ROOT / "docs").glob("*.md")}
  linked = set(re.findall(r"\]\(docs/([\w-]+\.md)\)", README))
  assert pages == linked, (pages - linked, linked - pages)


def test_layout_names_every_notebook():
  notebooks = {p.name for p in (ROOT / "notebooks").glob("*.ipynb")}
  assert notebooks and notebooks <= set(
      re.findall(r"`([\w.]+\.ipynb)`", section("Layout"))), notebooks


def test_task_table_lists_the_one_api_per_task():
  table = section("Task -> the one API")
  rows = [r for r in table.splitlines() if r.startswith("| ")][2:]
  assert len(rows) >= 12, rows
  for row in rows:
    assert "`" in row.split("|")[2], f"no API named in {row!r}"


# --------------------------------------------------------------------------
# The policy-name table.


def policy_table() -> list[tuple[list[str], tuple[str, str, str], str]]:
  """(names, (params, compute, output), bench-mode cell) of each row."""
  rows = [r for r in section("Policy names").splitlines()
          if r.startswith("| `")]
  table = []
  for row in rows:
    cells = [c.strip() for c in row.strip("|").split("|")]
    table.append((re.findall(r"`([^`]+)`", cells[0]), tuple(cells[1:4]),
                  cells[4]))
  return table


def _dtypes(policy) -> tuple[str, str, str]:
  return tuple(str(policy).replace("p=", "").replace("c=", "").replace(
      "o=", "").split(","))


def test_policy_table_matches_get_policy():
  table = policy_table()
  assert len(table) >= 8
  for names, dtypes, _ in table:
    for name in names:
      if name == "float8":
        continue
      expected = dtypes
      if name == "half":  # jmp's half: bf16 on a TPU, f16 elsewhere.
        half = {"float16": "f16", "bfloat16": "bf16"}[
            jmp_amp.half_dtype().dtype.name]
        expected = (half,) * 3
      assert _dtypes(jmp_amp.get_policy(name)) == expected, name


def test_policy_table_names_every_bench_mode_with_its_policy():
  seen = {}
  for names, dtypes, cell in policy_table():
    for mode in re.findall(r"`([\w-]+)`", cell):
      seen[mode] = names
  assert set(seen) == set(workloads.JAX_MODES), (
      set(workloads.JAX_MODES) ^ set(seen))
  for mode, names in seen.items():
    spec = workloads.JAX_MODES[mode]
    assert (spec.get("policy") or spec.get("autocast")) in names, mode


def test_float8_row_names_what_rules_and_autocast_accept():
  flax_nnx = pytest.importorskip("flax.nnx")
  import jmp_amp.flax  # pylint: disable=g-import-not-at-top
  from jmp_amp.models import MLP  # pylint: disable=g-import-not-at-top
  (names, _, _), = [row for row in policy_table() if "float8" in row[0]]
  for name in names:
    model = MLP(8, 2, num_layers=3, width=8, rngs=flax_nnx.Rngs(0))
    jmp_amp.flax.set_policies(model, {"*": name})
    assert str(jmp_amp.flax.get_policies(model)["layers/1"]) == "float8"
