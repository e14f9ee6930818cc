"""Which modules a telemetry `select` argument picks (`jmp_amp.flax.numerics`).

The glob dialect of `jmp_amp.flax.rules` (``"blocks/*/attn"``, ``"**"``), module
classes, or a list of them; a key that picks no module of the model warns.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence, Union
import warnings

from flax import linen as nn
from flax import nnx

from jmp_amp.flax import rules as rules_lib

Select = Union[None, str, type, Sequence[Union[str, type]]]


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
        key = "**" if key == rules_lib.DEFAULT_KEY else key
        self.patterns.append(rules_lib.compile_pattern(key))
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
      pattern = rules_lib.compile_pattern(
          "**" if key == rules_lib.DEFAULT_KEY else key)
      if not any(pattern.match(p) for p in candidates):
        paths = sorted(p for p in candidates if p)[:4]
        problems.append(
            f"select {key!r} matches no module path of {what} (paths are "
            f"like {', '.join(repr(p) for p in paths) or repr('')})")
    if problems:
      warnings.warn("jmp_amp.flax.numerics: " + "; ".join(problems)
                    + "; its statistics will be missing.", UserWarning,
                    stacklevel=stacklevel)
