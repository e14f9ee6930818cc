"""jmp_amp builds on public APIs only: an AST scan of every module in the
package.

Flagged (issue 11): imports of or attribute access on ``jax._src``;
underscore-prefixed modules or attributes of jax/jaxlib/flax/optax/chex/orbax
(``optax._src``, ``nnx._x``, ``getattr(nnx, "_x")``) and name-mangled private
attributes of other classes (``obj._pytree__state``); any identifier, keyword
or looked-up name containing ``_unsafe``; assignment to ``__class__`` (also
through ``setattr``/``object.__setattr__``) and classes built at run time with
``type(name, bases, namespace)``; ``threading.local``; assignment to an
attribute of an imported module or of something imported from one
(monkey-patching); a module-level ``__getattr__``; ``__import__`` and
``importlib.import_module`` with a computed name.

`scan_source` is the checker; the tests below also feed it small bad snippets,
so a checker that flags nothing fails.

The public names are pinned too (issues 22 and 36: one way to do each
thing): the ``__all__`` of the nine public modules, and only they have one,
hold at most 56 names together (jmp's 11 among them), each public object has
one import path and an example that the suite runs as a doctest, and the
names removed before the first release are gone from every module.
"""

from __future__ import annotations

import ast
import dataclasses
import doctest
import importlib
import inspect
import pathlib
import re
import textwrap

import pytest

import jmp_amp

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "jmp_amp"
LIBRARIES = frozenset({"jax", "jaxlib", "flax", "optax", "chex", "orbax"})


@dataclasses.dataclass(frozen=True)
class Violation:
  path: str
  line: int
  rule: str
  detail: str

  def __str__(self):
    return f"{self.path}:{self.line}: [{self.rule}] {self.detail}"


def _is_private(name: str) -> bool:
  return name.startswith("_") and not (name.startswith("__")
                                       and name.endswith("__"))


def _is_mangled(name: str) -> bool:
  """`_Class__attr`: another class's name-mangled private attribute."""
  if not name.startswith("_") or name.startswith("__"):
    return False
  head, sep, tail = name[1:].partition("__")
  return bool(sep and head and tail and head.isidentifier())


def _dotted(node: ast.AST) -> list[str] | None:
  """`a.b.c` as ["a", "b", "c"], or None if not a plain Name/Attribute chain."""
  parts = []
  while isinstance(node, ast.Attribute):
    parts.append(node.attr)
    node = node.value
  if not isinstance(node, ast.Name):
    return None
  parts.append(node.id)
  return parts[::-1]


def _const_str(node: ast.AST | None) -> str | None:
  if isinstance(node, ast.Constant) and isinstance(node.value, str):
    return node.value
  return None


class _Scanner(ast.NodeVisitor):
  """Collects violations; `imported` maps local names to dotted origins."""

  def __init__(self, path: str, tree: ast.Module):
    self.path = path
    self.found: list[Violation] = []
    self.imported: dict[str, str] = {}
    for node in ast.walk(tree):  # Imports anywhere bind names for the file.
      if isinstance(node, ast.Import):
        for alias in node.names:
          if alias.asname:
            self.imported[alias.asname] = alias.name
          else:
            root = alias.name.split(".")[0]
            self.imported[root] = root
      elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        for alias in node.names:
          if alias.name != "*":
            self.imported[alias.asname or alias.name] = (
                f"{node.module}.{alias.name}")

  def flag(self, node: ast.AST, rule: str, detail: str) -> None:
    self.found.append(Violation(self.path, getattr(node, "lineno", 0), rule,
                                detail))

  def check_module_path(self, node: ast.AST, dotted: str) -> None:
    parts = dotted.split(".")
    if parts[:2] == ["jax", "_src"]:
      self.flag(node, "jax._src", dotted)
    elif parts[0] in LIBRARIES and any(_is_private(p) for p in parts[1:]):
      self.flag(node, "private-library-name", dotted)

  def resolve(self, node: ast.AST) -> str | None:
    """The dotted origin of a chain rooted at an imported name, else None."""
    parts = _dotted(node)
    if parts is None or parts[0] not in self.imported:
      return None
    return ".".join([self.imported[parts[0]], *parts[1:]])

  # --- imports
  def visit_Import(self, node: ast.Import):
    for alias in node.names:
      self.check_module_path(node, alias.name)
      self.check_identifier(node, alias.asname)
    self.generic_visit(node)

  def visit_ImportFrom(self, node: ast.ImportFrom):
    if node.level == 0 and node.module:
      self.check_module_path(node, node.module)
      for alias in node.names:
        self.check_module_path(node, f"{node.module}.{alias.name}")
        if (node.module, alias.name) == ("threading", "local"):
          self.flag(node, "thread-local", "from threading import local")
        self.check_identifier(node, alias.name)
        self.check_identifier(node, alias.asname)
    self.generic_visit(node)

  # --- names and attributes
  def check_identifier(self, node: ast.AST, name: str | None) -> None:
    if name and "_unsafe" in name:
      self.flag(node, "unsafe", name)

  def visit_Name(self, node: ast.Name):
    self.check_identifier(node, node.id)

  def visit_Attribute(self, node: ast.Attribute):
    self.check_identifier(node, node.attr)
    if _is_mangled(node.attr):
      self.flag(node, "private-library-name",
                f"name-mangled private attribute {node.attr}")
    origin = self.resolve(node)
    if origin is not None:
      self.check_module_path(node, origin)
      if origin == "threading.local":
        self.flag(node, "thread-local", "threading.local")
    self.generic_visit(node)

  def visit_keyword(self, node: ast.keyword):
    self.check_identifier(node.value, node.arg)
    self.generic_visit(node)

  def visit_FunctionDef(self, node):
    self.check_identifier(node, node.name)
    self.generic_visit(node)

  visit_AsyncFunctionDef = visit_FunctionDef

  # --- assignments
  def check_target(self, node: ast.AST, target: ast.AST) -> None:
    if isinstance(target, (ast.Tuple, ast.List)):
      for element in target.elts:
        self.check_target(node, element)
      return
    if isinstance(target, ast.Attribute):
      if target.attr == "__class__":
        self.flag(node, "class-assignment", "assignment to __class__")
      origin = self.resolve(target.value)
      if origin is not None:
        self.flag(node, "monkey-patch",
                  f"assignment to {origin}.{target.attr}")

  def visit_Assign(self, node: ast.Assign):
    for target in node.targets:
      self.check_target(node, target)
    self.generic_visit(node)

  def visit_AugAssign(self, node: ast.AugAssign):
    self.check_target(node, node.target)
    self.generic_visit(node)

  def visit_AnnAssign(self, node: ast.AnnAssign):
    self.check_target(node, node.target)
    self.generic_visit(node)

  # --- calls
  def visit_Call(self, node: ast.Call):
    func = node.func
    parts = _dotted(func) or []
    name = parts[-1] if parts else None
    args = node.args
    if name in ("getattr", "setattr", "hasattr", "delattr",
                "__setattr__", "__getattribute__") and len(args) >= 2:
      # object.__setattr__(x, "a", v) / setattr(x, "a", v) / getattr(x, "a").
      attr = _const_str(args[1])
      if attr is not None:
        self.check_identifier(node, attr)
        if attr == "__class__" and name in ("setattr", "__setattr__"):
          self.flag(node, "class-assignment", f"{name}(..., '__class__', ...)")
        if _is_mangled(attr):
          self.flag(node, "private-library-name",
                    f"{name}(..., {attr!r}): name-mangled private attribute")
        origin = self.resolve(args[0])
        if origin is not None:
          self.check_module_path(node, f"{origin}.{attr}")
          if name in ("setattr", "__setattr__", "delattr"):
            self.flag(node, "monkey-patch", f"{name}({origin}, {attr!r}, ...)")
    if parts == ["type"] and len(args) == 3:
      self.flag(node, "class-assignment",
                "class built at run time with type(name, bases, namespace)")
    origin = self.resolve(func) if parts else None
    if parts == ["__import__"] or origin in ("importlib.import_module",
                                             "builtins.__import__",
                                             "importlib.__import__"):
      target = _const_str(args[0]) if args else None
      if target is None:
        self.flag(node, "computed-import",
                  f"{'.'.join(parts)}() with a computed module name")
      else:
        self.check_module_path(node, target)
    self.generic_visit(node)


def scan_source(source: str, path: str = "<snippet>") -> list[Violation]:
  """Returns the violations in one module's source."""
  tree = ast.parse(source, filename=path)
  scanner = _Scanner(path, tree)
  scanner.visit(tree)
  for node in tree.body:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (
        node.name == "__getattr__"):
      scanner.flag(node, "module-getattr", "module-level __getattr__")
  # Module-level __getattr__ defined under an `if` at top level.
  for node in tree.body:
    if isinstance(node, (ast.If, ast.Try)):
      for inner in ast.walk(node):
        if isinstance(inner, ast.FunctionDef) and inner.name == "__getattr__":
          scanner.flag(inner, "module-getattr", "module-level __getattr__")
  # A chain such as jax._src.core is seen once per prefix: report it once.
  unique = {}
  for v in scanner.found:
    unique.setdefault((v.path, v.line, v.rule), v)
  return sorted(unique.values(), key=lambda v: (v.path, v.line, v.rule))


def _package_files() -> list[pathlib.Path]:
  files = sorted(PACKAGE.rglob("*.py"))
  assert files, f"no Python files under {PACKAGE}"
  return files


@pytest.mark.parametrize(
    "path", _package_files(),
    ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_package_uses_public_apis_only(path):
  rel = str(path.relative_to(PACKAGE.parent))
  found = scan_source(path.read_text(encoding="utf-8"), rel)
  assert not found, "private or unsafe API use:\n" + "\n".join(map(str, found))


BAD_SNIPPETS = [
    ("import jax._src.core", "jax._src"),
    ("from jax._src import core", "jax._src"),
    ("from jax._src.lax.lax import dot_general_p", "jax._src"),
    ("from jax import _src", "jax._src"),
    ("import jax\nx = jax._src.core.Tracer", "jax._src"),
    ("import jax as j\nx = j._src", "jax._src"),
    ("import optax._src.base", "private-library-name"),
    ("from optax._src import base", "private-library-name"),
    ("from flax import nnx\nnnx._graph_node", "private-library-name"),
    ("from flax.nnx import _private_helper", "private-library-name"),
    ("import orbax.checkpoint as ocp\nocp._src.x", "private-library-name"),
    ("import chex\nchex._pytypes", "private-library-name"),
    ("from flax import nnx\ngetattr(nnx, '_hidden')", "private-library-name"),
    ("def f(module):\n  return module._pytree__state", "private-library-name"),
    ("def f(m):\n  return getattr(m, '_object__state')",
     "private-library-name"),
    ("def f(v, x):\n  v.set_raw_value(x, _unsafe_bypass_check=True)", "unsafe"),
    ("def f(v):\n  return v._unsafe_get()", "unsafe"),
    ("from somewhere import thing_unsafe_mode", "unsafe"),
    ("def f(x, C):\n  x.__class__ = C", "class-assignment"),
    ("def f(x, C):\n  object.__setattr__(x, '__class__', C)",
     "class-assignment"),
    ("def f(x, C):\n  setattr(x, '__class__', C)", "class-assignment"),
    ("def f(x, C):\n  a, x.__class__ = 1, C", "class-assignment"),
    ("def f(C):\n  return type('Sub', (C,), {})", "class-assignment"),
    ("import threading\n_STACK = threading.local()", "thread-local"),
    ("from threading import local\n_STACK = local()", "thread-local"),
    ("import threading as th\nS = th.local()", "thread-local"),
    ("from flax.core.scope import Scope\nScope.param = lambda *a: None",
     "monkey-patch"),
    ("import flax.linen as nn\nnn.Module.param = None", "monkey-patch"),
    ("import jax\nsetattr(jax.numpy, 'dot', None)", "monkey-patch"),
    ("def __getattr__(name):\n  return name", "module-getattr"),
    ("import sys\nif sys:\n  def __getattr__(name):\n    return name",
     "module-getattr"),
    ("def f(name):\n  return __import__(name)", "computed-import"),
    ("import importlib\ndef f(h):\n  return importlib.import_module("
     "bytes.fromhex(h).decode())", "computed-import"),
    ("from importlib import import_module\ndef f(n):\n  return import_module("
     "'jmp_amp.' + n)", "computed-import"),
    ("import importlib\nimportlib.import_module('jax._src.core')", "jax._src"),
]


@pytest.mark.parametrize("source, rule", BAD_SNIPPETS,
                         ids=[s.replace("\n", "; ") for s, _ in BAD_SNIPPETS])
def test_scanner_flags_bad_snippets(source, rule):
  found = scan_source(textwrap.dedent(source))
  assert rule in {v.rule for v in found}, (source, found)


GOOD_SNIPPETS = [
    "import jax\nimport jax.numpy as jnp\nx = jnp.ones(2)",
    "from jax.extend import core\nimport jax\nv = jax.__version__",
    "from flax import nnx\nclass M(nnx.Module):\n  def __init__(self):\n"
    "    self._cache = None\n  def f(self):\n    return self._cache",
    "class A:\n  def __getattr__(self, name):\n    return name",
    "import importlib\nm = importlib.import_module('json')",
    "def f(x):\n  return x.__class__.__name__",
    "from jmp_amp._src import tree\nfrom . import _common",
    "import dataclasses\n@dataclasses.dataclass(frozen=True)\n"
    "class A:\n  x: int\n"
    "  def __post_init__(self):\n    object.__setattr__(self, 'x', 1)",
    "def f(obj):\n  obj.value = 3\n  return type(obj)",
    "import optax\nstate = optax.ScaleByAdamState\nx = optax.tree.zeros_like",
    "import contextlib\n@contextlib.contextmanager\ndef g():\n  yield",
]


@pytest.mark.parametrize("source", GOOD_SNIPPETS)
def test_scanner_accepts_public_use(source):
  assert scan_source(source) == []


def test_scanner_reports_file_and_line():
  found = scan_source("import jax\n\n\nx = jax._src.core\n", "jmp_amp/x.py")
  assert [str(v) for v in found] == [
      "jmp_amp/x.py:4: [jax._src] jax._src.core"]


# --------------------------------------------------------------------------
# The public names.

JMP_NAMES = ("DynamicLossScale", "LossScale", "NoOpLossScale", "Policy",
             "StaticLossScale", "all_finite", "cast_to_full", "cast_to_half",
             "get_policy", "half_dtype", "select_tree")
# The public modules and their __all__: the whole public API (CHANGELOG.md).
PUBLIC = {
    "jmp_amp": JMP_NAMES + (
        "LossScalingState", "get_scaling_state", "loss_scaling",
        "scaled_value_and_grad", "AutocastRules", "autocast",
        "conv_general_dilated", "dot_general", "gpu_report",
        "matmul_report"),
    "jmp_amp.flax": (
        "apply_with_policies", "cast_boundary", "clear_policies",
        "get_policies", "init_with_policies", "make_linen_train_step",
        "make_train_step", "mixed_rules", "set_policies"),
    "jmp_amp.fp8": ("FP8Recipe", "FP8State", "compiler_options",
                    "conv_general_dilated", "dot_general", "einsum"),
    "jmp_amp.flax.fp8": ("FP8Meta", "FP8Policy", "histories",
                         "value_and_grad"),
    "jmp_amp.numerics": ("find_nonfinite", "format_stats", "tensor_stats"),
    "jmp_amp.flax.numerics": ("grad_stats", "output_stats"),
    "jmp_amp.optim": ("compress_state", "low_precision_params",
                      "stochastic_round"),
    "jmp_amp.checkpoint": ("CheckpointError", "CheckpointManager",
                           "latest_step", "restore", "restore_latest",
                           "save"),
    "jmp_amp.tools": ("GpuReport", "MatmulReport"),
}
# issue 36: 75 before; issue 52: jmp_amp.fp8.compiler_options.
MAX_PUBLIC_NAMES = 56


def _flax():
  return pytest.importorskip("jmp_amp.flax")


def _module(name: str):
  if name.startswith("jmp_amp.flax"):
    _flax()
  if name == "jmp_amp.checkpoint":
    pytest.importorskip("orbax.checkpoint")
  return importlib.import_module(name)


@pytest.mark.parametrize("module_name", sorted(PUBLIC))
def test_public_names_are_pinned(module_name):
  module = _module(module_name)
  assert sorted(module.__all__) == sorted(PUBLIC[module_name])
  for name in module.__all__:
    assert getattr(module, name) is not None, (module_name, name)


def test_at_most_56_public_names_in_all_public_modules():
  counts = {name: len(_module(name).__all__) for name in PUBLIC}
  assert sum(counts.values()) <= MAX_PUBLIC_NAMES, counts
  assert set(JMP_NAMES) <= set(jmp_amp.__all__)  # the drop-in stays whole


def _defines_all(path: pathlib.Path) -> bool:
  tree = ast.parse(path.read_text(encoding="utf-8"))
  return any(isinstance(node, (ast.Assign, ast.AnnAssign)) and any(
      isinstance(t, ast.Name) and t.id == "__all__"
      for t in (node.targets if isinstance(node, ast.Assign)
                else [node.target])) for node in tree.body)


def test_only_the_public_modules_have_an_all():
  defining = set()
  for path in _package_files():
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    if _defines_all(path):
      defining.add(name)
  assert defining == set(PUBLIC)


def test_each_public_object_has_one_import_path():
  """No public module holds, under a public name, what another exports."""
  modules = {name: _module(name) for name in PUBLIC}
  home = {}
  for name, module in modules.items():
    for attr in module.__all__:
      home.setdefault(id(getattr(module, attr)), f"{name}.{attr}")
  for name, module in modules.items():
    for attr, value in vars(module).items():
      if attr.startswith("_") or inspect.ismodule(value):
        continue
      where = home.get(id(value))
      assert where is None or where == f"{name}.{attr}", (
          f"{name}.{attr} is {where}")


def _doctest_names(doc: str) -> set[str]:
  """The identifiers in the `>>>` examples of a docstring."""
  examples = doctest.DocTestParser().get_examples(doc or "")
  return {n for ex in examples for n in re.findall(r"\w+", ex.source)}


def _public_names():
  return [(m, n) for m in sorted(PUBLIC) for n in PUBLIC[m]]


@pytest.mark.parametrize("module_name,name", _public_names(),
                         ids=[f"{m}.{n}" for m, n in _public_names()])
def test_each_public_name_has_a_doctest(module_name, name):
  """A `>>>` example in its own docstring or, for a name without one of its
  own (a typing alias), one using it in its module's docstring. pytest's
  --doctest-modules runs them all (pyproject.toml)."""
  module = _module(module_name)
  obj = getattr(module, name)
  own = obj.__doc__ if (inspect.isclass(obj) or inspect.isroutine(obj)) else ""
  assert _doctest_names(own) or name in _doctest_names(module.__doc__), (
      f"{module_name}.{name} has no >>> example")


# Aliases removed before the first release (issue 36): module, names.
REMOVED = {
    "jmp_amp": (
        "FP8Recipe", "FP8State", "GpuReport", "MatmulRecord", "MatmulReport",
        "delayed_scaling", "fp8_conv_general_dilated", "fp8_dot_general",
        "fp8_einsum", "get_loss_scale", "scaling_metrics",
        "DEFAULT_AUTOCAST_RULES"),
    "jmp_amp.flax": (
        "FP8ConvGeneralDilated", "FP8DotGeneral", "FP8Einsum", "FP8Meta",
        "FP8Op", "FP8Policy", "NORM_CLASSES", "PolicyRules", "TrainState",
        "clear_fp8", "fp8_histories", "fp8_modules", "fp8_rules",
        "fp8_value_and_grad", "policied_apply", "policy_of", "set_fp8",
        "update_fp8_state"),
    "jmp_amp.fp8": ("delayed_scaling",),
    "jmp_amp.numerics": ("NonFinite",),
    "jmp_amp.flax.numerics": ("find_nonfinite",),
    "jmp_amp.tools": ("MatmulRecord", "gpu_report", "matmul_report"),
    "jmp_amp.optim": ("CompressedState", "LowPrecisionParamsState"),
    "jmp_amp.checkpoint": (
        "CheckpointCorruptedError", "CheckpointExistsError",
        "CheckpointFallbackWarning", "CheckpointMismatchError",
        "InvalidFP8StateError", "InvalidLossScaleError", "PathLike",
        "check_compatible", "check_loss_scales", "describe"),
    "jmp_amp.flax.fp8": (
        "FP8ConvGeneralDilated", "FP8DotGeneral", "FP8Einsum", "FP8Op",
        "FP8Recipe", "FP8State", "clear_fp8", "delayed_scaling",
        "fp8_histories", "fp8_modules", "fp8_value_and_grad", "set_fp8",
        "update_fp8_state"),
    "jmp_amp.flax.rules": ("fp8_rules",),
    "jmp_amp.flax.linen": ("policied_apply",),
    "jmp_amp.flax.nnx": ("policy_of",),
}


@pytest.mark.parametrize("module_name", sorted(REMOVED))
def test_removed_aliases_are_gone(module_name):
  module = _module(module_name)
  left = [n for n in REMOVED[module_name] if hasattr(module, n)]
  assert not left, f"{module_name} still has {left}"


def test_no_deprecation_helper_is_left():
  assert not (PACKAGE / "_src" / "deprecation.py").exists()
  for path in sorted(PACKAGE.rglob("*.py")):
    text = path.read_text()
    assert "DeprecationWarning" not in text, path
    assert "kept for one release" not in text, path
