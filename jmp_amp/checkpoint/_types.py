"""The optimizer state's types: what tells one optimizer from another.

Two optimizers can hold the same leaves under the same paths: Adam's and
AdaBelief's states are both ``count / mu / nu``, yet AdaBelief's ``nu`` is
E[(g - m)^2] where Adam's is E[g^2]; and ``optax.adamw`` differs from
``optax.adam`` only by an empty state node, which holds no leaf at all. So
`state_types` records the class of every optax state node (optax states are
NamedTuples, ``EmptyState`` included) by its path, in tree order, and
`problems` compares two such records.

NNX objects (`nnx.Optimizer`) are walked through their graph, as `nnx.state`
drops the state's NamedTuples and its empty nodes.
"""

from __future__ import annotations

from typing import Any

import jax
import optax

import jmp_amp
from jmp_amp.checkpoint import _nnx

_MAX_LISTED = 10
_LOSS_SCALES = (jmp_amp.NoOpLossScale, jmp_amp.StaticLossScale,
                jmp_amp.DynamicLossScale)


def _is_state_node(x: Any) -> bool:
  """A NamedTuple node that is state, not an optax transformation (which an
  `nnx.Optimizer` keeps as its ``tx``)."""
  return (isinstance(x, tuple) and hasattr(type(x), "_fields")
          and not isinstance(x, optax.GradientTransformation))


def _walk(x: Any, path: str, out: dict[str, str], objects: tuple) -> None:
  if isinstance(x, _LOSS_SCALES):
    return  # compared with its hyper-parameters
  if isinstance(x, objects):
    nnx = _nnx.flax_nnx()
    for sub, node in sorted(nnx.iter_graph(x),
                            key=lambda pn: tuple(map(repr, pn[0]))):
      if _is_state_node(node):
        out[path + "".join(f"[{k!r}]" for k in sub)] = type(node).__name__
    return
  if _is_state_node(x):
    out[path] = type(x).__name__
  # One flatten down to the next state nodes (or loss scales, NNX objects):
  # the arrays in between are passed over at C++ speed.
  kinds = _LOSS_SCALES + objects
  stop = lambda y: y is not x and (isinstance(y, kinds) or _is_state_node(y))
  for key, child in jax.tree_util.tree_flatten_with_path(x, is_leaf=stop)[0]:
    if stop(child):
      _walk(child, path + jax.tree_util.keystr(key), out, objects)


def state_types(tree: Any) -> dict[str, str]:
  """``{path: class name}`` of the optax state nodes in `tree`, parents first.

  Example:
    >>> from jmp_amp.checkpoint import _types
    >>> state = optax.adamw(1e-3).init({"w": jnp.ones(2)})
    >>> _types.state_types({"opt_state": state})
    {"['opt_state'][0]": 'ScaleByAdamState', "['opt_state'][1]": \
'EmptyState', "['opt_state'][2]": 'EmptyState'}
  """
  out: dict[str, str] = {}
  nnx = _nnx.flax_nnx()
  _walk(tree, "", out, (nnx.Pytree,) if nnx is not None else ())
  return out


def _sequence(types: dict[str, str]) -> str:
  shown = ", ".join(types.values())
  return shown or "no optax state"


def problems(saved: dict[str, str], target: dict[str, str]) -> list[str]:
  """What differs between two `state_types` records, as one problem.

  A side with no optax state at all (a target of plain dicts, such as a
  bare `nnx.state`, or a checkpoint saved from one) has nothing to compare.
  """
  if saved == target or not saved or not target:
    return []
  lines = []
  for path in sorted(set(saved) | set(target)):
    s, t = saved.get(path), target.get(path)
    if s == t:
      continue
    if s is None:
      lines.append(f"{path}: only in the target: {t}")
    elif t is None:
      lines.append(f"{path}: only in the checkpoint: {s}")
    else:
      lines.append(f"{path}: saved {s}, target {t}")
  more = len(lines) - _MAX_LISTED
  return ["optimizer state differs (another optimizer?): saved "
          f"{_sequence(saved)}; target {_sequence(target)}:\n    "
          + "\n    ".join(lines[:_MAX_LISTED])
          + (f"\n    (and {more} more)" if more > 0 else "")]
