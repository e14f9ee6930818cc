"""Pytree utilities: casting floating leaves, finiteness checks, selection."""

from __future__ import annotations

import functools
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

T = TypeVar("T")


def _cast_leaf(x: Any, dtype: np.dtype) -> Any:
  if isinstance(x, (np.ndarray, jax.Array)):
    if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype:
      return x.astype(dtype)
  elif isinstance(x, jax.ShapeDtypeStruct):
    # Abstract trees (for eval_shape or checkpoint restore targets) cast too.
    if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype:
      return x.update(dtype=dtype)
  return x


def cast_floating(tree: T, dtype: Any, is_leaf=None) -> T:
  """Casts the floating-point array leaves of `tree` to `dtype`.

  Integer, boolean and PRNG-key arrays, and leaves that are not arrays
  (Python scalars, strings, objects), are returned untouched. `is_leaf` is
  passed to `jax.tree_util.tree_map`: subtrees it marks pass through whole
  unless they are themselves floating arrays.
  """
  return jax.tree_util.tree_map(functools.partial(_cast_leaf, dtype=dtype),
                                tree, is_leaf=is_leaf)


def all_finite(tree: Any) -> jax.Array:
  """Returns a scalar bool array: whether every inexact leaf is finite.

  One fused reduction per leaf, combined on the device: no value leaves it.
  Non-inexact leaves (integers, booleans, keys) are ignored. This is the
  cheapest exact check we measured: on a GPU a ``sum(x * 0)`` or ``max |x|``
  reduction compiles to the same kernels and bytes, and on XLA:CPU the former
  writes ``x * 0`` to a temporary while the vectorised max can drop NaNs.

  Example:
    >>> bool(jmp_amp.all_finite({"w": jnp.ones(3), "n": jnp.arange(2)}))
    True
    >>> bool(jmp_amp.all_finite([jnp.ones(2), jnp.array([1.0, jnp.nan])]))
    False
  """
  leaves = [x for x in jax.tree_util.tree_leaves(tree)
            if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
  if not leaves:
    return jnp.array(True)
  return jnp.stack([jnp.isfinite(x).all() for x in leaves]).all()


def select_tree(pred: jax.Array, a: T, b: T) -> T:
  """Selects `a` where the scalar bool `pred` is true, else `b`, leaf by leaf.

  Example:
    >>> new, old = {"w": jnp.ones(2)}, {"w": jnp.zeros(2)}
    >>> jmp_amp.select_tree(jnp.bool_(False), new, old)["w"].tolist()
    [0.0, 0.0]
  """
  assert jnp.ndim(pred) == 0 and jnp.result_type(pred) == jnp.bool_, (
      "expected boolean scalar")
  return jax.tree_util.tree_map(functools.partial(jax.lax.select, pred), a, b)


def where_tree(pred: jax.Array, on_true: T, on_false: T) -> T:
  """`jnp.where(pred, a, b)` leaf by leaf, in the dtypes of `on_false`.

  Unlike `select_tree`, leaves may be Python scalars or differ in dtype (a
  freshly computed state against the one it replaces); the result keeps the
  dtypes of `on_false`, so a skipped step cannot retype state.
  """
  def select(a, b):
    b = jnp.asarray(b)
    return jnp.where(pred, a, b).astype(b.dtype)
  return jax.tree_util.tree_map(select, on_true, on_false)

