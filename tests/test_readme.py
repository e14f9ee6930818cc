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

from jmp_amp._src import fp8 as fp8_lib
from jmp_amp._src import policy as policy_lib
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
  # And, in steps of their own, what command 2 leaves out, and the linter.
  for line in ('pytest -n 2 -q -m "slow or bench"', ".venv/bin/ruff check ."):
    assert any(line in c for c in ci), line


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
# The policy-name table: README.md and docs/policies-and-flax.md show the
# code's table (`POLICY_NAMES`), the FP8 names and the bench's modes.

TABLE_PAGES = ("README.md", "docs/policies-and-flax.md")
_TABLE_HEADER = "| name | params | compute | output | `jmp-amp bench` mode |"
_FP8_CELLS = ("f32", "FP8 matmuls, bf16 elsewhere", "bf16")


def _bench_modes_by_policy() -> dict[str, list[str]]:
  modes: dict[str, list[str]] = {}
  for mode, spec in workloads.JAX_MODES.items():
    modes.setdefault(spec.get("policy") or spec["autocast"], []).append(mode)
  return modes


def rendered_policy_table() -> list[str]:
  """The table as the code has it: a row per row of `POLICY_NAMES`, then the
  FP8 names, each with the bench modes that train with that policy."""
  modes = _bench_modes_by_policy()
  lines = [_TABLE_HEADER, "| --- | --- | --- | --- | --- |"]
  for names, cells in [*policy_lib.POLICY_NAMES.items(),
                       (fp8_lib.FP8_NAMES, _FP8_CELLS)]:
    bench = [m for n in names for m in modes.get(n, [])]
    lines.append(("| " + " | ".join([
        ", ".join(f"`{n}`" for n in names), *cells,
        ", ".join(f"`{m}`" for m in bench)])).rstrip() + " |")
  return lines


def shown_policy_table(page: str) -> list[str]:
  lines = (ROOT / page).read_text().splitlines()
  start = lines.index(_TABLE_HEADER)
  end = next(i for i in range(start, len(lines))
             if not lines[i].startswith("|"))
  return lines[start:end]


@pytest.mark.parametrize("page", TABLE_PAGES)
def test_the_docs_show_the_codes_policy_table(page):
  assert shown_policy_table(page) == rendered_policy_table()


def test_every_bench_mode_trains_with_a_policy_of_the_table():
  names = {n for row in policy_lib.POLICY_NAMES for n in row}
  names.update(fp8_lib.FP8_NAMES)
  assert set(_bench_modes_by_policy()) <= names


def test_float8_row_names_what_rules_and_autocast_accept():
  flax_nnx = pytest.importorskip("flax.nnx")
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jmp_amp.models import MLP  # pylint: disable=g-import-not-at-top

  import jmp_amp.flax  # pylint: disable=g-import-not-at-top
  (row,) = [r for r in shown_policy_table("README.md") if "`float8`" in r]
  names = re.findall(r"`([^`]+)`", row.split("|")[1])
  assert names == list(fp8_lib.FP8_NAMES)
  for name in names:
    model = MLP(8, 2, num_layers=3, width=8, rngs=flax_nnx.Rngs(0))
    jmp_amp.flax.set_policies(model, {"*": name})
    assert str(jmp_amp.flax.get_policies(model)["layers/1"]) == "float8"
    f = jmp_amp.autocast(lambda w, x: x @ w, name)
    report = jmp_amp.matmul_report(f, jnp.ones((4, 4)), jnp.ones((2, 4)))
    assert [s.split(" -> ")[0] for s in report.counts_by_signature()] == [
        "float8_e4m3fn x float8_e4m3fn"], name
