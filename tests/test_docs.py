"""The docs stay true: every Markdown file of the repo (README.md, docs/*.md,
benchmarks/README.md, CHANGELOG.md, ...), checked by one mechanism.

Code. Every ```python block runs, in a fresh namespace, unless the line
before it says ``<!-- docs: continue -->`` (it then runs after the page's
previous python block, in that block's namespace). A ```text block right after
a python block is that block's output, compared as a doctest compares (``...``
matches anything). A block that needs what the test machine may lack says so
on the line before it, with the reason: ``<!-- docs: requires torch: why -->``
(also ``equinox``, ``gpu``, ``gpu-audit``); it is skipped only where that is
missing.

Figures. A figure quoted in the prose carries, right after it, the place it
comes from: ``0.50x<!-- fig: h100_compiled.json workloads.mlp.rows[mode=float8]
.temp_bytes_vs_float32 -->`` (a file in benchmarks/results/, JSON or JSON
Lines, the latter read as a list of its records; a dotted path
where ``[i]`` indexes a list and ``[key=value]`` (or ``[k=v,k2=v2]``) picks
the list item with that field; optionally ``*k`` or ``/k`` to convert
units). The test reads the value and fails unless, rounded to the decimals
quoted, it is the number written before the marker. Ratios, percentages,
sizes and times in the prose without a marker fail too. Figures of the
tools' own output are ```text output blocks.

Also: every ``jmp_amp.name`` the prose mentions is public (in its module's
``__all__``), removed names appear nowhere, relative links resolve, every
`jmp-amp bench` line parses with the bench's own parser, and the docstring
examples of the package are in the default test run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import doctest
import importlib
import importlib.util
import inspect
import io
import json
import pathlib
import re
import shlex
import subprocess
from typing import Any, Optional
import warnings

import jax
import pytest

from jmp_amp.tools import gpu_target
from jmp_amp.tools.bench import cli as bench

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
_NOT_PAGES = (".venv", "build", "dist", "node_modules")


def _pages() -> list[str]:
  """Every Markdown file of the repo: git's list, else the tree's."""
  try:
    listed = subprocess.run(["git", "ls-files", "*.md"], cwd=ROOT, text=True,
                            capture_output=True, check=True).stdout.split()
  except (OSError, subprocess.CalledProcessError):
    listed = []
  if not listed:  # an unpacked sdist: no git
    listed = [p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*.md")
              if not any(part.startswith(".") or part in _NOT_PAGES
                         or part.endswith(".egg-info")
                         for part in p.relative_to(ROOT).parts)]
  return sorted(p for p in listed if (ROOT / p).is_file())


PAGES = _pages()


def _has_h100_target() -> bool:
  """Whether the CUDA plugin gives a compile-only H100 (on a machine without
  a GPU only under JAX_PLATFORMS=cpu, as the docs say)."""
  try:
    gpu_target.target_device("h100")
  except (ImportError, RuntimeError):
    return False
  return True


# What a `requires` marker may name, and how to tell it is there.
REQUIREMENTS = {
    "torch": lambda: importlib.util.find_spec("torch") is not None,
    "equinox": lambda: importlib.util.find_spec("equinox") is not None,
    "gpu": lambda: jax.default_backend() == "gpu",
    "gpu-audit": _has_h100_target,
}
# Names removed before the first release (issue 36): the docs teach what
# replaced them only. Old function names are banned anywhere; names that live
# on elsewhere (jmp_amp.fp8.FP8Recipe) only where they were (jmp_amp.FP8Recipe,
# `jmp.FP8Recipe` with `import jmp_amp as jmp`, or imported from there).
REMOVED = ("get_loss_scale", "set_fp8", "fp8_rules", "clear_fp8",
           "policy_of", "policied_apply", "fp8_value_and_grad",
           "update_fp8_state", "fp8_modules", "fp8_histories",
           "fp8_dot_general", "fp8_einsum", "fp8_conv_general_dilated",
           "delayed_scaling", "scaling_metrics", "DEFAULT_AUTOCAST_RULES",
           "CheckpointCorruptedError", "CheckpointExistsError",
           "CheckpointFallbackWarning", "CheckpointMismatchError",
           "InvalidFP8StateError", "InvalidLossScaleError", "check_compatible",
           "check_loss_scales")
REMOVED_FROM = {
    "jmp_amp": ("FP8Recipe", "FP8State", "GpuReport", "MatmulRecord",
                "MatmulReport"),
    "jmp_amp.flax": ("FP8ConvGeneralDilated", "FP8DotGeneral", "FP8Einsum",
                     "FP8Meta", "FP8Op", "FP8Policy", "NORM_CLASSES",
                     "PolicyRules", "TrainState"),
    "jmp_amp.flax.fp8": ("FP8Recipe", "FP8State", "FP8Op"),
    "jmp_amp.flax.numerics": ("find_nonfinite",),
    "jmp_amp.numerics": ("NonFinite",),
    "jmp_amp.tools": ("MatmulRecord", "gpu_report", "matmul_report"),
    "jmp_amp.optim": ("CompressedState", "LowPrecisionParamsState"),
    "jmp_amp.checkpoint": ("PathLike", "describe"),
}
# The bench's modes before they took their policies' names (issue 36): bf16,
# fp16 and fp8 are dtypes too, so those are caught where they name a mode.
REMOVED_MODES = ("fp16-noscale", "autocast-bf16", "autocast-fp16",
                 "autocast-fp8")
_OLD_MODE = re.compile(r"(?:--policy |--mode |\[mode=)(?:bf16|fp16|fp8)\b")
# Blocks of pages kept by others that do not run as written yet, by page and
# first line, with the reason. Strict: once such a block runs, its entry must
# go; once it is edited, it must run.
NOT_YET_RUNNABLE: dict = {}
# Pages whose prose quotes figures that no file in benchmarks/results holds
# (they come from test runs), with the reason.
UNCHECKED_FIGURES = {
    "benchmarks/results/h100_compiled.md": "a results file itself, the "
                                           "table benchmarks/h100_compiled.py "
                                           "writes from h100_compiled.json",
    "docs/reliability.md": "figures of tests/test_checkpoint.py's slow run "
                           "and of tests/test_adversarial.py, kept by the "
                           "checkpoint engineer",
}

_FENCE = re.compile(r"^( *)```([\w-]*)[ \t]*\n(.*?)^\1```[ \t]*$", re.S | re.M)
_DIRECTIVE = re.compile(r"<!--\s*docs:\s*(.*?)\s*-->")
_FIGURE = re.compile(r"<!--\s*fig:\s*(\S+)\s+(.*?)\s*-->", re.S)
_NUMBER_BEFORE = re.compile(
    r"(-?\d[\d,]*(?:\.\d+)?)\s?(?:x|×|%|GB|MB|GiB|MiB|kB|ms|s)?\)?\**\s*$")
# A figure in prose: a number with a unit, or with decimals (not a version).
_PROSE_FIGURE = re.compile(
    r"(?<![\w.\-/=*^])(?<!Python )(?P<num>\d[\d,]*(?:\.\d+)?)"
    r"(?P<unit>\s?(?:x|×|%|GB|MB|GiB|MiB|kB|ms|s)(?!\w))?(?!\w|\.\d)")


@dataclasses.dataclass(frozen=True)
class Block:
  page: str
  line: int
  lang: str
  source: str
  directives: tuple[str, ...]
  adjacent: bool  # only blank lines between this block and the one before

  @property
  def first_line(self) -> str:
    return next((s.strip() for s in self.source.splitlines() if s.strip()),
                "")


def read(page: str) -> str:
  return (ROOT / page).read_text()


def blocks(text: str, page: str) -> list[Block]:
  """The fenced blocks of `text`, with the directives on the lines before."""
  found, previous_end = [], None
  for m in _FENCE.finditer(text):
    before = text[:m.start()].rstrip("\n").splitlines()
    directives = []
    while before and _DIRECTIVE.fullmatch(before[-1].strip()):
      directives.insert(0, _DIRECTIVE.fullmatch(before.pop().strip()).group(1))
    indent = len(m.group(1))
    source = "\n".join(line[indent:] for line in m.group(3).splitlines())
    adjacent = (previous_end is not None
                and not text[previous_end:m.start()].strip())
    found.append(Block(page, text[:m.start()].count("\n") + 1, m.group(2),
                       source + "\n", tuple(directives), adjacent))
    previous_end = m.end()
  return found


def chains(page_blocks: list[Block]
           ) -> list[list[tuple[Block, Optional[Block]]]]:
  """Python blocks with their output blocks, grouped by `continue`."""
  groups = []
  for i, block in enumerate(page_blocks):
    if block.lang != "python":
      continue
    nxt = page_blocks[i + 1] if i + 1 < len(page_blocks) else None
    output = nxt if nxt and nxt.lang == "text" and nxt.adjacent else None
    if "continue" in block.directives:
      assert groups, f"{block.page}:{block.line}: nothing to continue"
      groups[-1].append((block, output))
    else:
      groups.append([(block, output)])
  return groups


def requirements(block: Block) -> list[str]:
  """The `requires` directives of `block`, checked for a name and a reason."""
  names = []
  for directive in block.directives:
    if directive == "continue" or is_slow(directive):
      continue
    m = re.fullmatch(r"requires ([\w-]+):\s*(\S.*)", directive)
    assert m and m.group(1) in REQUIREMENTS, (
        f"{block.page}:{block.line}: unknown directive {directive!r}; use "
        f"'continue', 'slow: why' or 'requires NAME: why' with NAME in "
        f"{list(REQUIREMENTS)}")
    names.append(m.group(1))
  return names


def is_slow(directive: str) -> bool:
  """A ``slow: why`` directive: the block's chain runs with the tests marked
  slow (`pytest -m slow`), not in the default run."""
  return re.fullmatch(r"slow:\s*\S.*", directive) is not None


def run_chain(chain: list[tuple[Block, Optional[Block]]]) -> None:
  """Runs the blocks of `chain` in one namespace; checks their outputs."""
  namespace: dict[str, Any] = {"__name__": "__docs__"}
  checker = doctest.OutputChecker()
  flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
  for block, output in chain:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), warnings.catch_warnings():
      # Should jmp_amp deprecate a name, the docs teach what replaces it.
      warnings.filterwarnings("error", "jmp_amp.* is deprecated",
                              DeprecationWarning)
      exec(compile(block.source, f"{block.page}:{block.line}", "exec"),  # pylint: disable=exec-used
           namespace)
    if output is not None:
      want, got = output.source, out.getvalue()
      assert checker.check_output(want, got, flags), (
          f"{block.page}:{block.line}: the output block at line "
          f"{output.line} says\n{want}but the code printed\n{got}")


# --------------------------------------------------------------------------
# Figures.


def _step(value: Any, key: str) -> Any:
  m = re.fullmatch(r"(.*?)(?:\[([^\]\"]+)\])?", key)
  name, selector = m.group(1).strip('"'), m.group(2)
  if name:
    value = value[name]
  if selector is None:
    return value
  if "=" in selector:  # [field=value] or [field=value,field=value]
    wants = [c.split("=", 1) for c in re.split(r",(?=\w+=)", selector)]
    matches = [item for item in value
               if all(str(item.get(f)) == want for f, want in wants)]
    assert len(matches) == 1, f"{len(matches)} items with {selector}"
    return matches[0]
  return value[int(selector)]


def _split_path(path: str) -> list[str]:
  """Splits on dots outside brackets and quotes ("a.b" is one key)."""
  parts, current, nesting, quoted = [], "", 0, False
  for ch in path:
    quoted ^= ch == '"'
    nesting += {"[": 1, "]": -1}.get(ch, 0) if not quoted else 0
    if ch == "." and not nesting and not quoted:
      parts.append(current)
      current = ""
    else:
      current += ch
  return parts + [current]


def _load_result(name: str) -> Any:
  """A results file: JSON, or JSON Lines (then a list of its records)."""
  text = (RESULTS / name).read_text()
  if name.endswith(".jsonl"):
    return [json.loads(line) for line in text.splitlines() if line.strip()]
  return json.loads(text)


def lookup(data: Any, spec: str) -> float:
  """The number `spec` ("path [*k|/k]") names in `data`."""
  m = re.fullmatch(r"(.*?)(?:\s+([*/])\s*([\d.e+\-*]+))?", spec.strip(), re.S)
  value = data
  for key in _split_path(m.group(1)):
    value = _step(value, key)
  if m.group(2):
    factor = float(eval(m.group(3), {"__builtins__": {}}))  # pylint: disable=eval-used
    value = value * factor if m.group(2) == "*" else value / factor
  return value


def check_figures(text: str, page: str, load=None) -> list[str]:
  """Every marked figure of `text` against its source; returns the problems."""
  load = load or _load_result
  problems = []
  for m in _FIGURE.finditer(text):
    where = f"{page}:{text[:m.start()].count(chr(10)) + 1}"
    line_start = text.rfind("\n", 0, m.start()) + 1
    quoted = _NUMBER_BEFORE.search(text[line_start:m.start()])
    if quoted is None:
      problems.append(f"{where}: no number right before {m.group(0)!r}")
      continue
    written = quoted.group(1).replace(",", "")
    try:
      value = lookup(load(m.group(1)), m.group(2))
    except (KeyError, IndexError, TypeError, AssertionError, OSError,
            ValueError) as e:
      problems.append(f"{where}: {m.group(1)} has no {m.group(2)!r} "
                      f"({type(e).__name__}: {e})")
      continue
    decimals = len(written.split(".")[1]) if "." in written else 0
    if f"{float(value):.{decimals}f}" != written:
      problems.append(f"{where}: the page says {written}, {m.group(1)} "
                      f"{m.group(2)} is {value!r}")
  return problems


def prose(text: str) -> str:
  """`text` without fenced blocks, inline code, HTML comments and URLs."""
  text = _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
  text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
  text = re.sub(r"`[^`\n]*`", "``", text)
  return re.sub(r"\]\([^)]*\)", "]()", text)


def unmarked_figures(text: str) -> list[str]:
  """Ratios, percentages, sizes, times and decimals quoted without a marker."""
  stripped = prose(_FIGURE.sub("\x00", text))
  found = []
  for m in _PROSE_FIGURE.finditer(stripped):
    if "." not in m.group("num") and not m.group("unit"):
      continue
    if not re.match(r"[\s)*]*\x00", stripped[m.end():]):
      line = stripped[:m.start()].count("\n") + 1
      found.append(f"line {line}: {m.group(0).strip()!r}")
  return found


# --------------------------------------------------------------------------
# Tests.

ALL_BLOCKS = {page: blocks(read(page), page) for page in PAGES}
CHAINS = [chain for page in PAGES for chain in chains(ALL_BLOCKS[page])]


def _chain_param(chain):
  block = chain[0][0]
  marks = []
  reason = NOT_YET_RUNNABLE.get((block.page, block.first_line))
  if reason:
    marks.append(pytest.mark.xfail(strict=True, reason=reason))
  if any(is_slow(d) for b, _ in chain for d in b.directives):
    marks.append(pytest.mark.slow)
  return pytest.param(chain, id=f"{block.page}:{block.line}", marks=marks)


def test_every_page_is_checked():
  for page in ("README.md", "CHANGELOG.md", "benchmarks/README.md",
               "docs/fp8.md"):
    assert page in PAGES, PAGES
  assert len(PAGES) >= 12, PAGES
  assert len(CHAINS) >= 20, "fewer runnable examples than expected"


@pytest.mark.parametrize("chain", [_chain_param(c) for c in CHAINS])
def test_python_blocks_run_and_print_what_the_page_says(chain):
  for block, _ in chain:
    for name in requirements(block):
      if not REQUIREMENTS[name]():
        pytest.skip(f"{block.page}:{block.line} needs {name}")
  run_chain(chain)


def test_outputs_continuations_and_requirements_are_read():
  page = "\n".join([
      "```python", "x = 2", "print(x)", "```", "", "```text", "2", "```",
      "Prose.", "<!-- docs: continue -->", "```python", "print(x + 1)", "```",
      "", "```text", "4", "```",
      "<!-- docs: requires torch: the other side -->", "```python",
      "import torch", "```", "", "Prose.", "```text", "not an output", "```"])
  found = blocks(page, "p")
  (first, second), (third,) = chains(found)
  assert [b.line for b, _ in (first, second, third)] == [1, 11, 19]
  assert third[1] is None and requirements(third[0]) == ["torch"]
  with pytest.raises(AssertionError, match="the output block at line 15"):
    run_chain([first, second])
  with pytest.raises(DeprecationWarning, match="jmp_amp.old"):
    run_chain(chains(blocks(
        "```python\nimport warnings\nwarnings.warn('jmp_amp.old is "
        "deprecated and will be removed', DeprecationWarning)\n```\n",
        "p"))[0])
  with pytest.raises(AssertionError, match="unknown directive"):
    requirements(blocks("<!-- docs: requires torch -->\n```python\n```\n",
                        "p")[0])
  # A slow block, with its reason, runs with the slow tests.
  slow = chains(blocks("<!-- docs: slow: trains a GPT -->\n"
                       "<!-- docs: requires torch: the other side -->\n"
                       "```python\nimport torch\n```\n", "p"))[0]
  assert requirements(slow[0][0]) == ["torch"]
  assert [m.name for m in _chain_param(slow).marks] == ["slow"]
  with pytest.raises(AssertionError, match="unknown directive"):
    requirements(blocks("<!-- docs: slow -->\n```python\n```\n", "p")[0])


@pytest.mark.parametrize("page", PAGES)
def test_no_untyped_python_block(page):
  """A block that is Python must say so, or it would escape these tests."""
  import ast  # pylint: disable=g-import-not-at-top
  for block in ALL_BLOCKS[page]:
    if block.lang:
      continue
    with contextlib.suppress(SyntaxError):
      ast.parse(block.source)
      pytest.fail(f"{page}:{block.line}: an untyped block that parses as "
                  "Python; mark it ```python (or ```text)")


@pytest.mark.parametrize("page", PAGES)
def test_quoted_figures_match_the_results(page):
  problems = check_figures(read(page), page)
  assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", [p for p in PAGES
                                  if p not in UNCHECKED_FIGURES])
def test_every_figure_has_a_source(page):
  found = unmarked_figures(read(page))
  assert not found, (f"{page}: figures without a <!-- fig: ... --> marker "
                     "(quote a figure of benchmarks/results, or leave it "
                     "out): " + "; ".join(found))


def test_a_stale_figure_fails():
  page = ("bf16 needs 0.55x<!-- fig: r.json w.rows[mode=bf16].temp --> the "
          "memory in 8<!-- fig: r.json w.rows[0].n --> GEMMs, "
          "55 %<!-- fig: r.json w.rows[mode=bf16].temp *100 -->")
  fresh = {"w": {"rows": [{"mode": "bf16", "temp": 0.5512, "n": 8}]}}
  stale = {"w": {"rows": [{"mode": "bf16", "temp": 0.5712, "n": 9}]}}
  assert not check_figures(page, "p", lambda _: fresh)
  problems = check_figures(page, "p", lambda _: stale)
  assert [p.split(",")[0] for p in problems] == [
      "p:1: the page says 0.55", "p:1: the page says 8",
      "p:1: the page says 55"], problems
  assert check_figures("3<!-- fig: r.json r[w=b,m=x].v -->", "p", lambda _: {
      "r": [dict(w="a", m="x", v=2), dict(w="b", m="x", v=3)]}) == []
  assert check_figures('2<!-- fig: r.json "a.b".c[1] -->', "p",
                       lambda _: {"a.b": {"c": [1, 2]}}) == []
  assert "has no 'w.rows[mode=fp16].temp'" in check_figures(
      "1.0x<!-- fig: r.json w.rows[mode=fp16].temp -->", "p",
      lambda _: fresh)[0]
  assert unmarked_figures("costs 1.09x the bytes, `2.5x` in code, jax "
                          "0.10.2, 0.5.") == ["line 1: '1.09x'",
                                              "line 1: '0.5'"]


@pytest.mark.parametrize("page", PAGES)
def test_relative_links_resolve(page):
  broken = []
  for target in re.findall(r"\]\(([^)\s]+)\)", read(page)):
    if re.match(r"[a-z]+:", target):
      continue
    path, _, anchor = target.partition("#")
    file = (ROOT / page).parent / path if path else ROOT / page
    if not file.exists():
      broken.append(target)
    elif anchor and file.suffix == ".md":
      slugs = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
               for h in re.findall(r"^#+ (.*)$", file.read_text(), re.M)}
      if anchor not in slugs:
        broken.append(target)
  assert not broken, f"{page}: broken links {broken}"


def removed_names(text: str) -> list[str]:
  """The removed names `text` mentions."""
  used = {n for n in REMOVED if re.search(rf"\b{n}\b", text)}
  used |= {n for n in REMOVED_MODES
           if re.search(rf"(?<![\w-]){n}(?![\w-])", text)}
  used |= set(_OLD_MODE.findall(text))
  for module, names in REMOVED_FROM.items():
    prefixes = [module] + (["jmp"] if module == "jmp_amp" else [])
    for name in names:
      if any(re.search(rf"(?<![\w.]){re.escape(p)}\.{name}\b", text)
             for p in prefixes):
        used.add(f"{module}.{name}")
    for imported in re.findall(
        rf"\bfrom\s+{re.escape(module)}\s+import\s+\(?([\w\s,]+)", text):
      used.update(f"{module}.{n}" for n in re.findall(r"\w+", imported)
                  if n in names)
  return sorted(used)


@pytest.mark.parametrize("page", PAGES)
def test_no_removed_names(page):
  used = removed_names(read(page))
  assert not used, f"{page} teaches removed names {used}"


def test_removed_names_are_found():
  text = ("jmp_amp.flax.fp8.set_fp8(m); jmp.FP8Recipe(); x = "
          "jmp_amp.flax.FP8Policy()\nfrom jmp_amp import (GpuReport,\n"
          "  loss_scaling)\nfrom jmp_amp.flax.fp8 import FP8Recipe")
  assert removed_names(text) == [
      "jmp_amp.FP8Recipe", "jmp_amp.GpuReport", "jmp_amp.flax.FP8Policy",
      "jmp_amp.flax.fp8.FP8Recipe", "set_fp8"]
  assert removed_names(
      "jmp-amp bench --policy bf16 --policy autocast-fp16; "
      "[mode=fp8].temp; --policy autocast-mixed_float16 --policy bf16x") == [
          "--policy bf16", "[mode=fp8", "autocast-fp16"]
  # Their current homes are fine.
  assert not removed_names(
      "jmp_amp.fp8.FP8Recipe, jmp_amp.tools.GpuReport, "
      "jmp_amp.flax.fp8.FP8Policy, jmp_amp.fp8.FP8Recipe(history_len=16), "
      "jmp_amp.flax.mixed_rules, from jmp_amp.fp8 import FP8Recipe, "
      "from jmp_amp.flax import fp8")


def public(name: str) -> Any:
  """The object a dotted `name` names, failing unless each step is public."""
  parts = name.split(".")
  obj = importlib.import_module(parts[0])
  for i, part in enumerate(parts[1:], 1):
    assert not part.startswith("_"), f"{name}: private"
    if inspect.ismodule(obj) and not hasattr(obj, part):
      obj = importlib.import_module(".".join(parts[:i + 1]))
      continue
    child = getattr(obj, part)
    if inspect.ismodule(obj) and not inspect.ismodule(child):
      # Only the public modules have an __all__ (tests/test_public_api.py).
      assert part in getattr(obj, "__all__", ()), (
          f"{name}: {part} is not in {obj.__name__}.__all__")
    obj = child
  return obj


@pytest.mark.parametrize("page", PAGES)
def test_names_in_the_prose_are_public(page):
  names = sorted(set(re.findall(r"\bjmp_amp(?:\.\w+)+",
                                _FENCE.sub("", read(page)))))
  bad = []
  for name in names:
    try:
      public(name)
    except (AssertionError, AttributeError, ImportError) as e:
      bad.append(f"{name} ({e})")
  assert not bad, f"{page}: " + "; ".join(bad)


_REPO_DIRS = (".ci", "benchmarks", "docs", "jmp_amp", "models", "notebooks",
              "tests")


@pytest.mark.parametrize("page", PAGES)
def test_files_named_in_the_prose_exist(page):
  # Folders (`models/`) and files (`tests/test_x.py`), not names inside
  # other trees (a checkpoint's `jmp_amp/metadata`).
  paths = {p for p in re.findall(r"`([\w.\-*/]+)`", _FENCE.sub("", read(page)))
           if p.split("/")[0] in _REPO_DIRS and "/" in p
           and (p.endswith("/") or "." in p.rsplit("/", 1)[1]
                or p.startswith(".ci/"))}
  missing = sorted(p for p in paths if not list(ROOT.glob(p.rstrip("/"))))
  assert not missing, f"{page} names files that do not exist: {missing}"


def _commands(source: str) -> list[str]:
  lines = [text.split(" #")[0].strip() for text in source.splitlines()]
  return [text for text in lines if text and not text.startswith("#")]


BENCH_LINES = [
    (f"{b.page}:{b.line}", c) for page in PAGES for b in ALL_BLOCKS[page]
    if b.lang == "bash" for c in _commands(b.source)
    if re.match(r"(\S+=\S+ )*(\S*/)?jmp-amp bench", c)]


def test_bench_lines_are_found():
  assert len(BENCH_LINES) >= 4, BENCH_LINES


@pytest.mark.parametrize("where, command", BENCH_LINES)
def test_bench_command_lines_parse(where, command):
  words = shlex.split(command)
  args = words[[i for i, w in enumerate(words)
                if w.endswith("jmp-amp")][0] + 2:]
  parser = bench.build_parser()
  cfg = bench.config_from_args(parser.parse_args(args), parser)
  assert cfg.steps > cfg.warmup, where


# --------------------------------------------------------------------------
# Docstring examples (`>>>`): run by pytest's --doctest-modules.


def test_doctests_are_in_the_default_run():
  tomllib = pytest.importorskip("tomllib")
  config = tomllib.loads((ROOT / "pyproject.toml").read_text())
  options = config["tool"]["pytest"]["ini_options"]
  assert "--doctest-modules" in options["addopts"].split()
  assert {"jmp_amp", "models"} <= set(options["testpaths"])


def test_no_example_is_skipped():
  sources = [*ROOT.joinpath("jmp_amp").rglob("*.py"),
             *ROOT.joinpath("models").rglob("*.py")]
  skipping = [str(p.relative_to(ROOT)) for p in sources
              if re.search(r"doctest:.*\+SKIP", p.read_text())]
  assert not skipping


def test_doctest_namespace_has_the_documented_names(doctest_namespace):
  import jmp_amp  # pylint: disable=g-import-not-at-top
  names = {"jax", "jnp", "np", "optax", "nnx", "nn", "jmp_amp"}
  assert names <= set(doctest_namespace)
  assert doctest_namespace["jmp_amp"] is jmp_amp
