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
import itertools
from typing import Any, Callable, Optional, Sequence
import warnings

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from jmp_amp._src import fp8 as fp8_core
from jmp_amp._src import tensor_stats as stats_lib
from jmp_amp.flax import _paths
from jmp_amp.flax import nnx as nnx_lib

# Trace order of the calls: which module completed first (localisation).
_ORDER = itertools.count()
UNSET = np.iinfo(np.int32).max


class Outputs(nnx.Intermediate):
  """A module's method outputs, as counts (`capture`), of the methods whose
  entries were made beforehand (``init``)."""

  def set_value(self, value, **kwargs):
    name = kwargs.get("index")
    if not (isinstance(name, str) and isinstance(value, tuple) and value):
      return super().set_value(value, **kwargs)
    # Module.sow: `value` is what was stored, plus this call's output.
    if not self.records(name):
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

  def records(self, name: str) -> bool:
    return name in self.get_value()


class _Every(Outputs):
  """`Outputs` of every method called (the abstract run, which finds them)."""

  def records(self, name: str) -> bool:
    del name
    return True


def _zeros(shape: tuple[int, ...]) -> dict[str, jax.Array]:
  counts = {"max_abs": jnp.zeros(shape, jnp.float32)}
  counts.update((k, jnp.zeros(shape, jnp.uint32))
                for k in ("underflow", "zeros", "nonfinite", "size"))
  counts["order"] = jnp.full(shape, UNSET, jnp.int32)
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
  kind = Outputs
  modules = {tuple(p): m for p, m in nnx.iter_modules(model)}
  graphdef, state = nnx.split(model)

  def abstract(kind, init):
    def run(state):
      return _run(fn, nnx.merge(graphdef, state), args, kind, init)[1]
    return {k: tuple(v["max_abs"].shape)
            for k, v in _flat(jax.eval_shape(run, state)).items()
            if k[1] in methods}

  try:
    shapes = abstract(_Every, None)
  except (TypeError, ValueError) as first:
    # A transform that needs its state's structure fixed (nnx.cond's
    # branches): every module's entries made beforehand, unstacked.
    every = {(p, m): () for p in modules for m in methods}
    try:
      abstract(kind, _init(every, kind))
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


# --------------------------------------------------------------------------
# The entries of a step's telemetry, ``{path: {kind: stats}}``.

Stats = dict[str, dict[str, dict[str, Any]]]


def candidates(captured: Captured) -> dict[str, Any]:
  """``{path: module}`` of the modules, and of their blocks in a stack."""
  out = {_paths.path_str(p): m for p, m in captured.modules.items()}
  out.update((_paths.path_str(b), m) for p, m in captured.modules.items()
             for _, b in captured.blocks(p))
  return out


def picked(captured: Captured, selector: _paths.Selector,
            path: tuple) -> list[tuple[Optional[tuple], str]]:
  """``(block index, key)`` of what `selector` picks of the module at
  `path`: the module, or in a stack the blocks it picks (all of them if it
  names the module's own path)."""
  module = captured.modules.get(path)
  whole = _paths.path_str(path) in selector.keys
  return [(idx, _paths.path_str(b)) for idx, b in captured.blocks(path)
          if whole or selector(_paths.path_str(b), module)]


def out_entries(captured: Captured, selector: _paths.Selector
                ) -> Stats:
  """``{key: {"out": stats}}`` of the selected modules that ran."""
  merged: dict[tuple, dict[str, Any]] = {}
  for (path, _), counts in sorted(captured.counts.items()):
    merged[path] = (counts if path not in merged else
                    stats_lib.add_counts(merged[path], counts))
  out = {}
  for path, counts in merged.items():
    for idx, key in picked(captured, selector, path):
      out[key] = {"out": stats(block_counts(counts, idx))}
  return out


def grad_entries(model: Optional[nnx.Module], grads: Any,
                 selector: _paths.Selector, captured: Captured,
                 warn: bool = True) -> Stats:
  """``{key: {"grad": stats}}``, per block in the stacks `captured` saw."""
  if model is not None:
    owners = _paths.owning_paths(model)
    policies = nnx_lib.get_policies(model)
    flat = [(tuple(p), v) for p, v in nnx.to_flat_state(grads)]
  else:
    owners, policies = None, {}
    flat = [(tuple(getattr(k, "key", getattr(k, "idx", k)) for k in p), v)
            for p, v in jax.tree_util.tree_flatten_with_path(grads)[0]]
  grouped: dict[tuple, list] = {}
  for path, value in flat:
    value = value.get_value() if isinstance(value, nnx.Variable) else value
    owner = (path[:-1] if owners is None
             else _paths.owner(path, owners))
    grouped.setdefault(owner, []).append(value)
  if warn:
    known = candidates(captured) or {
        _paths.path_str(p): None for p in grouped}
    selector.warn_unmatched(
        known, "the model" if model is None else type(model).__name__)
  out = {}
  for owner, values in sorted(grouped.items(), key=lambda kv: kv[0]):
    if model is None:
      chosen = ([(None, _paths.path_str(owner))]
                if selector(_paths.path_str(owner), None) else [])
    else:
      chosen = picked(captured, selector, owner)
    if not chosen:
      continue
    dtype = getattr(policies.get(_paths.path_str(owner)), "compute_dtype",
                    None)
    counts_of = lambda vs: stats_lib.tree_counts(vs, dtype)
    stack = captured.stack(owner)
    if chosen[0][0] is not None and stack is not None:
      shape = stack[1]
      if not all(tuple(np.shape(v))[:len(shape)] == shape for v in values):
        chosen = [(None, _paths.path_str(owner))]
      else:
        for _ in shape:  # one vmap per stacked axis
          counts_of = jax.vmap(counts_of)
    counts = counts_of(values)
    if counts is None:
      continue
    for idx, key in chosen:
      out[key] = {"grad": stats_lib.finish(
          block_counts(counts, idx))}
  return out


def fp8_entries(model: nnx.Module, selector: _paths.Selector,
                captured: Captured) -> Stats:
  """The selected FP8 modules' entries of kind ``"fp8"``.

  ``{"amax_lhs", "amax_rhs", "amax_grad"}``: the newest amax of the
  operands and of the output gradient (from the module's amax histories),
  and ``{"scale_lhs", "scale_rhs", "scale_grad"}``: the scale their whole
  history gives (what delayed scaling uses next; current scaling uses the
  tensor's own amax).
  """
  from jmp_amp.flax import fp8 as fp8_layers  # pylint: disable=g-import-not-at-top
  policies = nnx_lib.get_policies(model)
  paths = {_paths.path_str(p): p for p in captured.modules}
  out = {}
  for name, state in fp8_layers.histories(model).items():
    recipe = getattr(policies.get(name), "recipe", None)
    chosen = picked(captured, selector, paths.get(name, ()))
    if recipe is None or not chosen:
      continue
    fp8 = {}  # In a stack, of every block: the histories' leading axes.
    for kind, dtype in (("lhs", recipe.fwd_dtype), ("rhs", recipe.fwd_dtype),
                        ("grad", recipe.bwd_dtype)):
      history = getattr(state, kind)  # the newest amax first
      fp8[f"amax_{kind}"] = history[..., 0]
      fp8[f"scale_{kind}"] = fp8_core.compute_scale(
          jnp.max(history, axis=-1), dtype, recipe.margin)
    for idx, key in chosen:
      out[key] = {"fp8": block_counts(fp8, idx)}
  return out


def merge(*parts: Stats) -> Stats:
  """The entries of `parts` together, paths and kinds sorted."""
  out: dict[str, dict[str, Any]] = {}
  for part in parts:
    for path, kinds in part.items():
      out.setdefault(path, {}).update(kinds)
  return {p: dict(sorted(out[p].items())) for p in sorted(out)}


def step_stats(model: Optional[nnx.Module], grads: Any, select: _paths.Select,
               captured: Optional[Captured]) -> Stats:
  """A train step's ``metrics["numerics"]``: the outputs `captured` saw,
  the gradients' and the FP8 histories' statistics (linen, `model` None:
  the gradients')."""
  selector = _paths.Selector(select if select is not None else [])
  if model is None:
    with warnings.catch_warnings():  # `output_stats` has warned already.
      warnings.filterwarnings("ignore", "jmp_amp.flax.numerics: select")
      return grad_entries(None, grads, selector, Captured(
          {}, {}, {}))
  selector.warn_unmatched(candidates(captured), type(model).__name__)
  stats = merge(out_entries(captured, selector),
                grad_entries(model, grads, selector, captured, warn=False),
                fp8_entries(model, selector, captured))
  return stats
