"""Module paths in `jmp_amp.flax`: strings, globs, selections and owners.

A module's path is its `nnx.iter_modules` path joined with '/' (`path_str`;
the root's is ""). `compile_pattern` compiles the one glob dialect
(``"blocks/*/attn"``, ``"**"``; see `jmp_amp.flax.rules`) that policy rules
and telemetry share; `Selector` is a telemetry `select` argument (path
globs, module classes, or a list of them), and a key that picks no module
of the model warns. A Variable belongs to the nearest module on its path
that is not a container (`CONTAINERS`: `nnx.List`, `nnx.Dict`), its *owner*:
what a container holds belongs to its owner, whose policy decides its dtype.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence, Union
import warnings

from flax import linen as nn
from flax import nnx

Select = Union[None, str, type, Sequence[Union[str, type]]]
DEFAULT_KEY = "*"  # as in rules: every module

# Modules that only hold others: what they hold belongs to their owner.
CONTAINERS = (nnx.List, nnx.Dict)


def path_str(path: tuple) -> str:
  """The '/'-joined path of an `nnx.iter_modules` path tuple."""
  return "/".join(str(p) for p in path)


def owner(path: tuple, owners: set[tuple]) -> tuple:
  """The longest proper prefix of a variable's path that is in `owners`
  (`owning_paths`): the module it belongs to."""
  for n in range(len(path) - 1, -1, -1):
    if path[:n] in owners:
      return path[:n]
  return ()


def owning_paths(module: nnx.Module) -> set[tuple]:
  """The paths of `module`'s modules that own Variables: not containers
  (the root always)."""
  return {tuple(p) for p, m in nnx.iter_modules(module)
          if not isinstance(m, CONTAINERS) or not p}


def own_params(module: nnx.Module) -> list[tuple[tuple, nnx.Param]]:
  """(relative path, Param) of the Params `module` holds itself."""
  owners = owning_paths(module)
  return [(path, var) for path, var in nnx.to_flat_state(
      nnx.state(module, nnx.Param)) if owner(path, owners) == ()]


def compile_pattern(pattern: str) -> re.Pattern:
  """Compiles a path glob (see `jmp_amp.flax.rules`) to an anchored regex.

  Example:
    >>> from jmp_amp.flax.rules import compile_pattern
    >>> bool(compile_pattern("blocks/*/attn").match("blocks/3/attn"))
    True

  Raises:
    ValueError: unbalanced ``[``/``]``, an empty or invalid character class,
      a '/' inside a class, a leading/trailing '/' or an empty segment.
  """
  def fail(why: str) -> ValueError:
    return ValueError(f"Invalid path pattern {pattern!r}: {why}. Patterns "
                      "are '/'-separated globs like 'blocks/*/attn', "
                      "'**/mlp' or 'layers_[0-3]'.")

  if pattern.startswith("/") or (pattern.endswith("/") and pattern):
    raise fail("module paths have no leading or trailing '/'")
  if "//" in pattern:
    raise fail("empty path segment '//'")
  out, i, n = [], 0, len(pattern)
  while i < n:
    c = pattern[i]
    if pattern.startswith("**", i):
      i += 2
      if pattern.startswith("/", i):
        out.append("(?:.*/)?")
        i += 1
      else:
        out.append(".*")
    elif c == "*":
      out.append("[^/]*")
      i += 1
    elif c == "?":
      out.append("[^/]")
      i += 1
    elif c == "[":
      j = i + 1
      negate = j < n and pattern[j] in "!^"
      if negate:
        j += 1
      start = j
      if j < n and pattern[j] == "]":  # a leading ']' is literal, as in glob
        j += 1
      while j < n and pattern[j] != "]":
        j += 1
      if j >= n:
        raise fail(f"unbalanced '[' at position {i}")
      body = pattern[start:j]
      if "/" in body:
        raise fail("'/' inside a character class can never match")
      body = body.replace("\\", "\\\\").replace("^", "\\^")
      out.append(("[^/" if negate else "[") + body + "]")
      i = j + 1
    elif c == "]":
      raise fail(f"unbalanced ']' at position {i}")
    else:
      out.append(re.escape(c))
      i += 1
  try:
    return re.compile("".join(out) + r"\Z")
  except re.error as e:
    raise fail(str(e)) from None


class Selector:
  """Which modules a `select` argument picks."""

  def __init__(self, select: Select):
    if isinstance(select, (str, type)):
      select = [select]
    if not isinstance(select, (list, tuple)):
      raise TypeError(
          "select must be a path pattern ('blocks/*/attn', '**' for every "
          "module), a Flax module class, or a list of them; got "
          f"{select!r}")
    self.patterns, self.classes, self.keys = [], [], list(select)
    for key in select:
      if isinstance(key, type):
        if not issubclass(key, (nnx.Module, nn.Module)):
          raise TypeError(f"select: {key!r} is not a Flax module class")
        self.classes.append(key)
      elif isinstance(key, str):
        key = "**" if key == DEFAULT_KEY else key
        self.patterns.append(compile_pattern(key))
      else:
        raise TypeError(f"select: {key!r} is neither a path pattern str nor "
                        "a Flax module class")

  def __call__(self, path: str, module: Any) -> bool:
    return (any(p.match(path) for p in self.patterns)
            or isinstance(module, tuple(self.classes)))

  def warn_unmatched(self, candidates: Mapping[str, Any], what: str,
                     stacklevel: int = 3) -> None:
    """Warns about each key of `select` that picks none of `candidates`.

    Args:
      candidates: ``{module path: module}`` (the module may be None).
      what: how to name the model in the message.
      stacklevel: as for `warnings.warn`.
    """
    if not candidates:
      return
    problems = []
    for key in self.keys:
      if isinstance(key, type):
        if not any(isinstance(m, key) for m in candidates.values()):
          problems.append(f"select {key.__name__} matches no module of "
                          f"{what}: no module is an instance of it")
        continue
      pattern = compile_pattern(
          "**" if key == DEFAULT_KEY else key)
      if not any(pattern.match(p) for p in candidates):
        paths = sorted(p for p in candidates if p)[:4]
        problems.append(
            f"select {key!r} matches no module path of {what} (paths are "
            f"like {', '.join(repr(p) for p in paths) or repr('')})")
    if problems:
      warnings.warn("jmp_amp.flax.numerics: " + "; ".join(problems)
                    + "; its statistics will be missing.", UserWarning,
                    stacklevel=stacklevel)
