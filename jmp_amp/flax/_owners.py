"""Which module of an NNX graph owns a Variable: the one holding it.

A Variable belongs to the nearest module on its path that is not a container
(`nnx.List`, `nnx.Dict`): what a container holds belongs to its owner. Its
policy decides the Variable's dtype.
"""

from __future__ import annotations

from flax import nnx

# Modules that only hold others: what they hold belongs to their owner.
CONTAINERS = (nnx.List, nnx.Dict)


def owner(path: tuple, owners: set[tuple]) -> tuple:
  """The longest prefix of a variable's path that is an owning module."""
  for n in range(len(path) - 1, -1, -1):
    if path[:n] in owners:
      return path[:n]
  return ()


def owning_paths(module: nnx.Module) -> set[tuple]:
  return {p for p, m in nnx.iter_modules(module)
          if not isinstance(m, CONTAINERS) or not p}


def own_params(module: nnx.Module) -> list[tuple[tuple, nnx.Param]]:
  """(relative path, Param) of the Params `module` holds itself."""
  owners = owning_paths(module)
  return [(path, var) for path, var in nnx.to_flat_state(
      nnx.state(module, nnx.Param)) if owner(path, owners) == ()]
