"""Scanned stacks as policy rules see them: one module object standing for
the blocks of a stack.

A model that stacks its blocks with `nnx.vmap` and runs them under `nnx.scan`
(``jmp_amp.models.GPT(..., scan_layers=True)``) holds one module per layer of
a block, its variables stacked along leading axes: ``blocks/attn/qkv``, with a
kernel ``[num_blocks, d, 3 d]``, stands for the ``blocks/0/attn/qkv`` ...
``blocks/N-1/attn/qkv`` of the unscanned model. The *root* of a stack is the
outermost module (not an `nnx.List` / `nnx.Dict`) whose Flax layers (Linear,
LinearGeneral, Einsum, Conv, Embed, the norms) all have the same leading axes
in front of the rank their own attributes give; each module inside it has one
*block path* per block, the block's index put after the root's path.

Rule patterns match a stacked module's block paths, as they match the
unscanned model's paths; its own path counts when written out exactly. Rules
must decide every block of a stack alike (`resolve`). (Rules are resolved
before the model runs, so from its Variables' shapes; telemetry knows its
stacks from the run itself, see `jmp_amp.flax._capture`.)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

from flax import nnx
import numpy as np

from jmp_amp.flax import _common
from jmp_amp.flax import _fp8_op as fp8_op_lib
from jmp_amp.flax import rules as rules_lib
from jmp_amp.flax._paths import CONTAINERS as _CONTAINERS
from jmp_amp.flax._paths import path_str

_NORMS = tuple(c for c in rules_lib.NORM_CLASSES if issubclass(c, nnx.Module))


def _leading_axes(module: Any) -> Optional[tuple[int, ...]]:
  """The axes stacked in front of a Flax layer's params; None for others."""
  if isinstance(module, (nnx.Linear, nnx.Einsum, nnx.Conv)):
    return fp8_op_lib.stack_shape(module)
  attrs = vars(module)
  if isinstance(module, nnx.LinearGeneral):
    name, rank = "kernel", (len(module.batch_axis) + len(module.in_features)
                            + len(module.out_features))
  elif isinstance(module, nnx.Embed):
    name, rank = "embedding", 2
  elif isinstance(module, _NORMS):
    name = next((n for n in ("scale", "bias", "mean") if isinstance(
        attrs.get(n), nnx.Variable)), None)
    rank = 1
  else:
    return None
  var = attrs.get(name)
  if not isinstance(var, nnx.Variable):
    return None
  shape = tuple(var.get_value().shape)
  return shape[:len(shape) - rank]


@dataclasses.dataclass(frozen=True)
class Stacks:
  """The scanned stacks of a model.

  Attributes:
    roots: ``{root path: stack shape}``.
    paths: ``{'/'-joined path: path}`` of the model's modules.
  """
  roots: dict[tuple, tuple[int, ...]]
  paths: dict[str, tuple]

  @classmethod
  def find(cls, modules: Sequence[tuple[tuple, Any]]) -> Stacks:
    """The stacks among ``(path, module)`` pairs (see the module docstring)."""
    axes: dict[tuple, set] = {}
    for path, module in modules:
      own = _leading_axes(module)
      if own is not None:
        for n in range(len(path) + 1):
          axes.setdefault(path[:n], set()).add(own)
    roots = {}
    for path, module in sorted(modules, key=lambda pm: len(pm[0])):
      found = axes.get(path, set())
      if (len(found) == 1 and () not in found
          and not isinstance(module, _CONTAINERS)
          and not any(path[:n] in roots for n in range(len(path)))):
        roots[path] = next(iter(found))
    return cls(roots, {path_str(p): p for p, _ in modules})

  def root(self, path: tuple) -> Optional[tuple]:
    """The root of the stack `path` is in, or None."""
    return next((r for r in self.roots if path[:len(r)] == r), None)

  def blocks(self, path: tuple) -> list[tuple[tuple, tuple]]:
    """``(block index, block path)`` per block; [] outside the stacks."""
    root = self.root(path)
    if root is None:
      return []
    return [(idx, root + idx + path[len(root):])
            for idx in np.ndindex(*self.roots[root])]

  def candidates(self, modules: Sequence[tuple[tuple, Any]]
                 ) -> dict[str, Any]:
    """``{path: module}`` of `modules` and of their block paths."""
    out = {path_str(p): m for p, m in modules}
    for p, m in modules:
      out.update((path_str(b), m) for _, b in self.blocks(p))
    return out


# --------------------------------------------------------------------------
# Policies.


def resolve(ruleset: rules_lib.RuleSet, modules: Sequence[tuple[tuple, Any]],
            *, strict: bool, what: str) -> dict[tuple, rules_lib.Resolution]:
  """Each module's resolution (parents first in `modules`); for a module of
  a stack, that of its blocks, which must agree.

  Raises:
    ValueError: a module matches two rules of equal rank, rules decide the
      blocks of a stack differently, or (if `strict`) a rule decides nothing.
  """
  stacks = Stacks.find(modules)
  resolved, by_block, used = {}, {}, set()
  for path, module in modules:
    name, blocks = path_str(path), stacks.blocks(path)
    if not blocks:
      results = [rules_lib.resolve(ruleset, name, module,
                                   resolved.get(path[:-1]) if path else None)]
    else:
      results = []
      for _, block in blocks:
        parent = (resolved.get(path[:-1]) if path in stacks.roots
                  else by_block.get(block[:-1]))
        by_block[block] = rules_lib.resolve(ruleset, path_str(block), module,
                                            parent, aliases=(name,))
        results.append(by_block[block])
      if any(r.policy != results[0].policy for r in results):
        raise ValueError(_mixed_blocks(stacks, path, blocks, results))
    used.update(r.rule.key for r in results if r.source in ("rule",
                                                             "default"))
    resolved[path] = next((r for r in results if r.source == "rule"),
                          results[0])
  rules_lib.report_unmatched(ruleset, used,
                             list(stacks.candidates(modules).items()),
                             strict=strict, what=what)
  _common.warn_half_norms(
      [(path_str(p), m, resolved[p]) for p, m in modules], what)
  return resolved


def _mixed_blocks(stacks: Stacks, path: tuple, blocks: list,
                  results: list) -> str:
  """Why the blocks of a stack cannot take the policies the rules give."""
  root = stacks.root(path)
  groups: dict[str, list[str]] = {}
  for (idx, _), res in zip(blocks, results):
    rule = ("no rule" if res.rule is None else
            f"rule {rules_lib.describe_key(res.rule.key)}"
            + (" inherited" if res.source == "inherited" else ""))
    groups.setdefault(f"{res.policy} ({rule})", []).append(path_str(idx))
  every = path_str(root + ("*",) * len(stacks.roots[root]) + path[len(root):])
  said = "; ".join(f"block{'s' if len(i) > 1 else ''} {', '.join(i)} -> {p}"
                   for p, i in groups.items())
  return (
      f"jmp_amp.flax: the rules decide the blocks of the scanned stack "
      f"{path_str(root) or '<root>'!r} ({len(blocks)} blocks stacked along "
      f"leading axes {stacks.roots[root]}, run as one program by nnx.scan) "
      f"differently at {path_str(path) or '<root>'!r}: {said}. One program "
      f"runs every block of a stack, so its blocks take one policy: write "
      f"the rule for every block ({every!r}, or {path_str(path)!r}), build "
      f"the model with its blocks unstacked (e.g. GPT(..., "
      f"scan_layers=False)), or split the stack into stacks whose blocks "
      f"share a policy.")
