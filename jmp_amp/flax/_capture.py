"""Module outputs seen through Flax's own capture: `nnx.capture`.

`capture(fn, model, args, methods)` runs ``fn(model, *args)`` under
``nnx.capture(..., method_outputs=T)``, where ``T`` is an `nnx.Intermediate`
type of ours: each module method call sows its output there, and ``T``
keeps only the counts of `tensor_stats.tree_counts` (largest finite ``|x|``,
exact uint32 counts), added call by call, never the activations. The counts
are module state like any other: `nnx.remat`, `nnx.cond`, `nnx.scan`,
`nnx.vmap`, a `jax.lax.scan` over `nnx.split` state that returns its state,
and `nnx.jit` carry them, and a transform that stacks a module's state
(a scanned stack of blocks) stacks its counts, one row per block: how the
model declares its stacks is how they are found.

Transforms that need the state's structure fixed (`nnx.cond`'s branches, a
loop's carry) need every entry to exist before the call, with its shape, so
the model runs twice: once abstractly (`jax.eval_shape`, nothing compiled),
which finds the shapes, then for real from zero counts of those shapes.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import warnings
from typing import Any, Callable, Optional, Sequence

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from jmp_amp._src import tensor_stats as stats_lib
from jmp_amp.flax import _paths

# Trace order of the calls: which module completed first (localisation).
_ORDER = itertools.count()
_UNSET = np.iinfo(np.int32).max


class Outputs(nnx.Intermediate):
  """A module's method outputs, as counts (`capture`); ``methods`` are the
  method names recorded."""
  methods: tuple[str, ...] = ("__call__",)

  def set_value(self, value, **kwargs):
    name = kwargs.get("index")
    if not (isinstance(name, str) and isinstance(value, tuple) and value):
      return super().set_value(value, **kwargs)
    # Module.sow: `value` is what was stored, plus this call's output.
    if name not in self.methods:
      return None
    *stored, out = value
    new = stats_lib.tree_counts(out)
    if new is None:
      if stored:
        super().set_value(tuple(stored), **kwargs)
      return None
    new["order"] = jnp.asarray(next(_ORDER), jnp.int32)
    if stored:
      old = stored[0]
      new = {**stats_lib.add_counts(
          {k: v for k, v in old.items() if k != "order"},
          {k: v for k, v in new.items() if k != "order"}),
             "order": jnp.minimum(old["order"], new["order"])}
    return super().set_value((new,), **kwargs)


@functools.cache
def _outputs_type(methods: tuple[str, ...]) -> type:
  return type("Outputs", (Outputs,), {"methods": methods})


def _zeros(shape: tuple[int, ...]) -> dict[str, jax.Array]:
  counts = {"max_abs": jnp.zeros(shape, jnp.float32)}
  counts.update((k, jnp.zeros(shape, jnp.uint32))
                for k in ("underflow", "zeros", "nonfinite", "size"))
  counts["order"] = jnp.full(shape, _UNSET, jnp.int32)
  return counts


@dataclasses.dataclass
class Captured:
  """What `capture` recorded.

  Attributes:
    counts: ``{(module path, method): counts}``; a stacked module's counts
      have the stack's axes in front.
    roots: ``{root path: stack shape}`` of the model's scanned stacks (the
      outermost module of each whose counts carry the stack's axes).
    modules: ``{path: module}`` of the model.
  """
  counts: dict[tuple[tuple, str], dict[str, Any]]
  roots: dict[tuple, tuple[int, ...]]
  modules: dict[tuple, Any]

  def stack(self, path: tuple) -> Optional[tuple[tuple, tuple[int, ...]]]:
    """``(root, stack shape)`` of the stack `path` is in, or None."""
    root = next((r for r in self.roots if path[:len(r)] == r), None)
    return None if root is None else (root, self.roots[root])

  def blocks(self, path: tuple) -> list[tuple[Optional[tuple], tuple]]:
    """``(block index, block path)`` per block; ``[(None, path)]`` outside
    the stacks."""
    found = self.stack(path)
    if found is None:
      return [(None, path)]
    root, shape = found
    return [(idx, root + idx + path[len(root):]) for idx in np.ndindex(*shape)]


def _find_roots(shapes: dict[tuple, tuple[int, ...]],
                modules: dict[tuple, Any]) -> dict[tuple, tuple[int, ...]]:
  """The stacks: each stacked module's outermost ancestor stacked alike (or,
  not called itself, holding only Variables stacked alike), below any
  container."""
  roots = {}
  for path in sorted(shapes, key=len):
    shape = shapes[path]
    if not shape or any(path[:len(r)] == r for r in roots):
      continue
    root = path
    while root:
      parent = root[:-1]
      if parent in shapes:
        if shapes[parent] != shape:
          break
      elif not (parent and _stacked_alike(modules.get(parent), shape)):
        break
      root = parent
    roots[root] = shape
  return roots


def _stacked_alike(module: Any, shape: tuple[int, ...]) -> bool:
  if module is None or isinstance(module, _paths.CONTAINERS):
    return False
  values = [v for v in jax.tree.leaves(nnx.state(module))
            if hasattr(v, "shape")]
  return bool(values) and all(tuple(v.shape[:len(shape)]) == shape
                              for v in values)


def _flat(captured: Any) -> dict[tuple[tuple, str], dict[str, Any]]:
  out = {}
  for path, value in nnx.to_flat_state(captured):
    value = value.get_value() if isinstance(value, nnx.Variable) else value
    if isinstance(value, tuple) and value:
      out[(tuple(path[:-1]), path[-1])] = value[0]
  return out


def _init(entries: dict[tuple[tuple, str], tuple[int, ...]], kind: type):
  """The `nnx.capture` ``init`` State of zero counts of these shapes."""
  tree: dict = {}
  for (path, method), shape in entries.items():
    node = tree
    for part in path:
      node = node.setdefault(part, {})
    node[method] = kind((_zeros(shape),))
  return nnx.State(tree)


def _run(fn: Callable, model: nnx.Module, args: Sequence[Any], kind: type,
         init: Any):
  return nnx.capture(fn, kind, init=init, method_outputs=kind)(model, *args)


def capture(fn: Callable[..., Any], model: nnx.Module, args: Sequence[Any],
            methods: Sequence[str] = ("__call__",)) -> tuple[Any, Captured]:
  """``fn(model, *args)`` and the counts of its modules' outputs."""
  kind = _outputs_type(tuple(methods))
  modules = {tuple(p): m for p, m in nnx.iter_modules(model)}
  graphdef, state = nnx.split(model)

  def abstract(init):
    def run(state):
      return _run(fn, nnx.merge(graphdef, state), args, kind, init)[1]
    return {k: tuple(v["max_abs"].shape)
            for k, v in _flat(jax.eval_shape(run, state)).items()}

  try:
    shapes = abstract(None)
  except (TypeError, ValueError) as first:
    # A transform that needs its state's structure fixed (nnx.cond's
    # branches): every module's entries made beforehand, unstacked.
    every = {(p, m): () for p in modules for m in methods}
    try:
      abstract(_init(every, kind))
    except (TypeError, ValueError):
      raise first from None  # Not a question of structure: the model's.
    shapes = every
  _warn_uninstrumented(modules)
  result, captured = _run(fn, model, args, kind, _init(shapes, kind))
  counts = _flat(captured)
  by_path = {p: tuple(shapes[(p, m)]) for p, m in shapes}
  return result, Captured(counts, _find_roots(by_path, modules), modules)


def _warn_uninstrumented(modules: dict[tuple, Any]) -> None:
  """Warns about modules whose ``__call__`` `nnx.capture` does not see: it
  instruments the methods of each module's own class, so an inherited
  ``__call__`` is seen only if its class is some module's own."""
  own = {type(m) for m in modules.values()}
  unseen = []
  for path, m in modules.items():
    owner = next((k for k in type(m).__mro__ if "__call__" in vars(k)), None)
    if owner not in own and owner not in (None, object, nnx.Module):
      unseen.append(f"{_paths.path_str(path)!r} ({type(m).__name__}, "
                    f"__call__ of {owner.__name__})")
  if unseen:
    warnings.warn(
        "jmp_amp.flax.numerics: the outputs of modules "
        f"{', '.join(unseen[:6])} are not recorded: nnx.capture records the "
        "methods a module's own class defines, and their classes inherit "
        "__call__. Define __call__ in the class (def __call__(self, *a, "
        "**k): return super().__call__(*a, **k)).", UserWarning, stacklevel=4)


def block_counts(counts: dict[str, Any], idx: Optional[tuple]
                 ) -> dict[str, Any]:
  return counts if idx is None else {k: v[idx] for k, v in counts.items()}


def stats(counts: dict[str, Any]) -> dict[str, Any]:
  """The final statistics of a module's counts (`tensor_stats.finish`)."""
  return stats_lib.finish({k: v for k, v in counts.items() if k != "order"})
