"""FP8 state in a checkpoint: the recipes of a target's FP8 ops, and the
amax histories restored.

An FP8 op's recipe (`margin`, `history_len`, the FP8 dtypes, ...) is static,
like a loss scale's hyper-parameters, so orbax's array checkpoint does not hold
it: `recipes` describes the recipes of the FP8 ops (see `jmp_amp.flax.fp8`)
in a tree's NNX modules for the saved metadata, and restore compares them. The
histories are arrays; `check_histories` refuses any that is not finite and
>= 0 (an amax is an absolute value, and a non-finite one is never recorded),
whether it sits in an `FP8State` or in an NNX `FP8Meta` variable.

The one place this package looks up FP8 names (`jmp_amp.fp8.FP8Recipe`,
`jmp_amp.fp8.FP8State`, and the FP8Op and `jmp_amp.flax.fp8.FP8Meta` of
`jmp_amp.flax`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import numpy as np

import jmp_amp
from jmp_amp.checkpoint import _errors
from jmp_amp.checkpoint import _nnx


def _jmp_flax() -> Optional[Any]:
  """`jmp_amp.flax._fp8_op` (its FP8Op, FP8Meta) where Flax is in use: no FP8
  op exists otherwise, and this package must not import Flax."""
  if _nnx.flax_nnx() is None:
    return None
  from jmp_amp.flax import _fp8_op as jmp_flax  # pylint: disable=g-import-not-at-top
  return jmp_flax


def recipe_spec(recipe: jmp_amp.fp8.FP8Recipe) -> dict[str, Any]:
  """`recipe`'s fields as JSON values (dtypes by name)."""
  def jsonable(v):
    return v if isinstance(v, (bool, int, float, str, type(None))) else str(v)
  return {f.name: jsonable(getattr(recipe, f.name))
          for f in dataclasses.fields(recipe)}


def recipes(tree: Any) -> dict[str, dict[str, Any]]:
  """``{path of an FP8 op: recipe_spec}`` for the NNX objects in `tree`.

  Paths as `jax.tree_util.keystr` names the op's state in `nnx.state`, e.g.
  ``['model']['layers'][1]['dot_general']``.
  """
  jmp_flax = _jmp_flax()
  if jmp_flax is None:
    return {}
  out = {}
  for name, obj in _nnx.objects(tree):
    for path, node in _nnx.flax_nnx().iter_graph(obj):
      if isinstance(node, jmp_flax.FP8Op):
        out[name + "".join(f"[{k!r}]" for k in path)] = recipe_spec(
            node.recipe)
  return out


def _histories(tree: Any) -> list[tuple[str, Any]]:
  """``(path, history)`` of every amax history in `tree`."""
  jmp_flax = _jmp_flax()
  kinds = (jmp_amp.fp8.FP8State,) + (
      (jmp_flax.FP8Meta,) if jmp_flax is not None else ())
  out = []
  for path, x in jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=lambda x: isinstance(x, kinds))[0]:
    name = jax.tree_util.keystr(path) or "<root>"
    if isinstance(x, jmp_amp.fp8.FP8State):
      out += [(f"{name}.{field}", getattr(x, field)) for field in x._fields]
    elif isinstance(x, kinds):
      out.append((name, _nnx.value(x)))
  return out


def check_histories(tree: Any) -> None:
  """Raises `CheckpointError` ("corrupted") if an amax history in `tree`
  holds a value that is not finite and >= 0.

  Under delayed scaling a resumed run would scale its tensors by the largest
  amax of the history: an inf one quantizes them to zeros, a NaN one to NaN.
  """
  for name, history in _histories(tree):
    if isinstance(history, jax.ShapeDtypeStruct):
      continue
    h = _nnx.host_value(history).reshape(-1)
    bad = np.flatnonzero(~(np.isfinite(h) & (h >= 0)))
    if bad.size:
      raise _errors.corrupted(
          f"FP8 amax history {name} holds {float(h[bad[0]])!r} (index "
          f"{int(bad[0])}); amaxes must be finite and >= 0 (a damaged file, "
          "or a run whose amax overflowed was saved?)", where=name)
