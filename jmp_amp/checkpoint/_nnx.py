"""Flax NNX modules and optimizers, and array values, in a checkpointed tree.

An NNX object in the tree is saved as its `nnx.state`, restored into a copy
first (where its loss scales can be checked) and then written into the
target object in place. Only if the caller uses Flax already: this package
never imports it (`flax_nnx` finds it in `sys.modules`).
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional

import jax
import numpy as np

_NOTHING = object()  # no `restored` tree given


def flax_nnx() -> Optional[Any]:
  """`flax.nnx` if this process imported it, else None."""
  return sys.modules.get("flax.nnx")


def _object_type() -> Optional[type]:
  """The base class of NNX objects (modules, optimizers), or None."""
  nnx = flax_nnx()
  return getattr(nnx, "Pytree", None) if nnx is not None else None


def objects(tree: Any) -> list[tuple[str, Any]]:
  """``(path, object)`` of the NNX objects in `tree`, paths by `keystr`."""
  object_type = _object_type()
  if object_type is None:
    return []
  is_obj = lambda x: isinstance(x, object_type)
  return [(jax.tree_util.keystr(path), x) for path, x in
          jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_obj)[0]
          if is_obj(x)]


def _map_objects(fn: Callable[..., Any], tree: Any,
                 restored: Any = _NOTHING) -> Any:
  """Applies ``fn(nnx, obj[, restored_part])`` to the NNX objects in `tree`.

  Other leaves are kept (or, given `restored`, taken from it).
  """
  object_type = _object_type()
  if object_type is None:
    return tree if restored is _NOTHING else restored
  is_obj = lambda x: isinstance(x, object_type)
  nnx = flax_nnx()
  if restored is _NOTHING:
    return jax.tree_util.tree_map(
        lambda x: fn(nnx, x) if is_obj(x) else x, tree, is_leaf=is_obj)
  return jax.tree_util.tree_map(
      lambda t, r: fn(nnx, t, r) if is_obj(t) else r, tree, restored,
      is_leaf=is_obj)


def saveable(tree: Any) -> Any:
  """`tree` with NNX modules/optimizers replaced by their `nnx.state`, and
  NumPy scalars by 0-d arrays (orbax 0.11 refuses to save a NumPy scalar)."""
  return jax.tree.map(
      lambda x: np.asarray(x) if isinstance(x, np.generic) else x,
      _map_objects(lambda nnx, obj: nnx.state(obj), tree))


def update_objects(target: Any, restored: Any) -> Any:
  """Writes restored states into the target's NNX objects, in place."""
  def put(nnx, obj, state):
    nnx.update(obj, state)
    return obj
  return _map_objects(put, target, restored)


def copies(target: Any, restored: Any) -> Any:
  """`restored` with NNX states merged into new objects (the target's
  untouched), where the loss scales can be found and checked."""
  return _map_objects(
      lambda nnx, obj, state: nnx.merge(nnx.split(obj)[0], state), target,
      restored)


def value(x: Any) -> Any:
  """The array an NNX Variable holds, or `x` itself."""
  get_value = getattr(x, "get_value", None)
  return get_value() if callable(get_value) else x


def host_value(x: Any) -> np.ndarray:
  """`x`'s whole value as NumPy, in every process of a multi-process run.

  An array sharded over several processes cannot be read by one: a
  replicated one is read from this process's copy; a split one is gathered
  (a collective: every process restores, so every process calls it, in the
  same order).
  """
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    if x.is_fully_replicated:
      return np.asarray(x.addressable_data(0))
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(x)
