"""Per-module numerics of Flax models: telemetry in the step, and the op that
made the first inf/NaN.

* `watch(model, select)`: a context manager for the code that calls the
  model inside a traced function. Every module call runs under a
  `jax.named_scope` naming its path (``@blocks.0.attn`` for
  ``blocks/0/attn``), and the modules `select` picks have the range
  statistics of their outputs recorded (`jmp_amp.numerics.tensor_stats`:
  max ``|x|``, underflow and zero fractions, inf/NaN count), on device, as
  part of the traced computation. `grad_stats(model, grads, select)` does the
  same for the gradients of each module's params. ``make_train_step(...,
  numerics=select)`` does both and returns them as ``metrics["numerics"]``
  (``{path: {"out": stats, "grad": stats}}``); print them with
  `jmp_amp.numerics.format_stats`.
* `localise_model(model, loss_fn, batch)`: what
  ``jmp_amp.numerics.find_nonfinite(loss_fn, model, batch)`` runs for a Flax
  model: the first op making inf/NaN, its module path, a float32 rule for
  that module and whether it removes every inf/NaN. ``make_train_step(...,
  on_nonfinite=print)`` runs it on skipped steps and reports each distinct
  event (a new site, an inf/NaN in the inputs or the forward pass, a
  non-finite that persists after the loss-scale backoffs).

`select` uses the glob dialect of `jmp_amp.flax.rules`: a path pattern
(``"blocks/*/attn"``, ``"**"`` or ``"*"`` for every module), a module class
(``nnx.Linear``), or a sequence of them. A module of a scanned stack (blocks
stacked by `nnx.vmap`, run by `nnx.scan`) reports one entry per block, under
its path in the unscanned model (``blocks/0/attn``), which patterns match.

How module calls are seen: linen through `flax.linen.intercept_methods`;
NNX, which has no method interceptor, through the interpreter, only while
`watch` is active (at trace time), on calls of the public methods and
``__call__`` of the model's modules: `sys.monitoring` events on those
methods alone (Python 3.12+), or a `sys.setprofile` hook, after any Python
profile function there (a C-level one, cProfile before 3.12, keeps running
and the hook uses `sys.settrace`). See `jmp_amp/flax/_calls.py`.

Example:
  >>> import jmp_amp.flax.numerics as numerics
  >>> model = nnx.Sequential(nnx.Linear(2, 3, rngs=nnx.Rngs(0)),
  ...                        nnx.Linear(3, 1, rngs=nnx.Rngs(0)))
  >>> with numerics.watch(model, "layers/*") as seen:
  ...   y = model(jnp.full((1, 2), 1e4, jnp.float16))
  >>> sorted(seen.outputs), int(seen.outputs["layers/1"]["nonfinite"])
  (['layers/0', 'layers/1'], 0)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable, Iterator, Mapping, Optional, Union
import warnings

from flax import linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from jmp_amp._src import fp8 as fp8_core
from jmp_amp._src import localise
from jmp_amp._src import tensor_stats as stats_lib
from jmp_amp.flax import _calls as calls_lib
from jmp_amp.flax import _fp8 as fp8_layers
from jmp_amp.flax import _scan as scan_lib
from jmp_amp.flax import _select as select_lib
from jmp_amp.flax import _stats_table as table_lib
from jmp_amp.flax import nnx as nnx_lib
from jmp_amp.flax import rules as rules_lib

__all__ = ("grad_stats", "watch")

Select = select_lib.Select
_Selector = select_lib.Selector


def _selector(select: Select) -> Optional[_Selector]:
  return None if select is None else _Selector(select)


class Seen:
  """What `watch` recorded: ``outputs``, ``{path: stats}``."""

  def __init__(self, select: Optional[_Selector]):
    self.select = select
    # path -> the `tree_counts` of each call; the stacks' blocks (`watch`
    # fills them in when it ends).
    self.calls: dict[str, list[tuple[dict[str, jax.Array], int]]] = {}
    self.stacked = table_lib.StatsTable()

  @property
  def outputs(self) -> dict[str, dict[str, jax.Array]]:
    """``{path: stats}`` (each read is arrays of the trace)."""
    return {path: e["out"] for path, e in self.table().items()}

  def table(self) -> table_lib.StatsTable:
    """Everything recorded, ``{path: {"out": stats}}``: a module called
    once keeps its counts, normalised when its entry is read."""
    tables = [self.stacked]
    for path, calls in self.calls.items():
      if len(calls) == 1:
        tables.append(table_lib.StatsTable.counted(path, "out", *calls[0]))
      else:  # merged call by call, as the statistics are
        tables.append(table_lib.StatsTable({path: {"out": functools.reduce(
            stats_lib.merge_stats,
            [stats_lib.normalise(*call) for call in calls])}}))
    return table_lib.StatsTable.union(tables)

  def record(self, path: str, module: Any, out: Any) -> None:
    if scan_lib.StackWatch.path(module) is not None:
      return scan_lib.StackWatch.record(module, out)  # a block of a stack
    if self.select is None or not self.select(path, module):
      return
    counts = stats_lib.tree_counts(out)
    if counts is not None:
      self.calls.setdefault(path, []).append(counts)


def _nnx_hook(paths: dict[int, tuple[str, Any]], seen: Seen, stacked: bool):
  """A profile-style function: named scopes around the modules' method calls
  (the copies of a stack's modules inside a transform too, if `stacked`)."""
  open_scopes: dict[int, tuple[Any, str, Any]] = {}

  def hook(frame, event, arg):
    if event == "call":
      code = frame.f_code
      name = code.co_name
      if (code.co_argcount and code.co_varnames[0] == "self"
          and (name == "__call__" or not name.startswith("_"))):
        obj = frame.f_locals.get("self")
        entry = paths.get(id(obj))
        if entry is None and stacked and scan_lib.StackWatch.path(obj):
          entry = (scan_lib.StackWatch.path(obj), obj)
        if entry is not None:
          scope = jax.named_scope(localise.encode_path(entry[0]))
          scope.__enter__()
          open_scopes[id(frame)] = (scope, *entry)
    elif event == "return":
      entry = open_scopes.pop(id(frame), None)
      if entry is not None:
        scope, path, module = entry
        scope.__exit__(None, None, None)
        if arg is not None:
          seen.record(path, module, arg)

  return hook


@contextlib.contextmanager
def watch(model: Optional[nnx.Module] = None, select: Select = None
          ) -> Iterator[Seen]:
  """Module-path scopes (and output statistics) for the model's calls.

  Use it around the code that calls the model, inside the traced function
  (a jitted step, or a function given to `jax.make_jaxpr`); the statistics
  are arrays of that trace: return them from it.

  Args:
    model: the NNX model the calls go to (its modules, as they are when
      `watch` is entered; in a train step, the module the loss function
      gets), or None for linen (every linen module called inside; a
      top-level ``apply`` starts the record afresh, so it holds the last
      one).
    select: the modules whose outputs are recorded (see the module
      docstring); None records nothing and only names the scopes.

  Yields:
    A `Seen` whose ``outputs`` fill up as the modules are called.

  Example:
    >>> import jmp_amp.flax.numerics as numerics
    >>> model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    >>> with numerics.watch(model, "**") as seen:  # "" is the root's path
    ...   _ = model(jnp.ones((1, 2)))
    >>> sorted(seen.outputs[""])
    ['max_abs', 'nonfinite', 'underflow', 'zeros']
  """
  seen = Seen(_selector(select))
  if model is None:
    depth = [0]
    called: dict[str, Any] = {}

    def interceptor(next_fun, args, kwargs, context):
      module = context.module
      if module.scope is None or context.method_name == "setup":
        return next_fun(*args, **kwargs)
      path = "/".join(module.path)
      called[path] = module
      if not path and not depth[0]:
        # A new top-level apply: `apply_with_policies` first runs the model
        # abstractly (`jax.eval_shape`), whose values must not be kept.
        seen.calls.clear()
      depth[0] += 1
      try:
        with jax.named_scope(localise.encode_path(path)):
          out = next_fun(*args, **kwargs)
      finally:
        depth[0] -= 1
      seen.record(path, module, out)
      return out

    with nn.intercept_methods(interceptor):
      yield seen
    if seen.select is not None:
      seen.select.warn_unmatched(called, "the linen modules called")
    return
  if not isinstance(model, nnx.Module):
    raise TypeError("watch takes an nnx.Module (or None for linen), got "
                    f"{type(model).__name__}")
  paths = {id(m): ("/".join(str(p) for p in path), m)
           for path, m in nnx.iter_modules(model)}
  stacks = scan_lib.StackWatch(model, seen.select)
  if seen.select is not None:
    seen.select.warn_unmatched(stacks.candidates, type(model).__name__)
  restore = calls_lib.follow(
      _nnx_hook(paths, seen, bool(stacks.marked)),
      calls_lib.method_codes({type(m) for _, m in paths.values()}))
  try:
    yield seen
  finally:
    restore()
    seen.stacked = stacks.close()


def grad_stats(model: Optional[nnx.Module], grads: Any, select: Select
               ) -> dict[str, dict[str, jax.Array]]:
  """Range statistics of each selected module's param gradients.

  The underflow fraction is measured against the module's compute dtype
  (from `set_policies`; float32 without a policy): where these gradients
  lived before the cast to the param dtype. Gradients taken of a scaled
  loss are the scaled ones.

  Example:
    >>> import jmp_amp.flax.numerics as numerics
    >>> model = nnx.Sequential(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
    >>> grads = nnx.grad(lambda m: m(jnp.ones((1, 2))).sum())(model)
    >>> stats = numerics.grad_stats(model, grads, "**")
    >>> sorted(stats), float(stats["layers/0"]["max_abs"])
    (['layers/0'], 1.0)

  Args:
    model: the NNX model (None: `grads` is a linen params tree).
    grads: the gradients (an `nnx.State` or a nested dict), jit-safe.
    select: which modules (see the module docstring).

  Returns:
    ``{module path: stats}``.
  """
  return {path: e["grad"] for path, e in grad_table(model, grads,
                                                    select).items()}


def grad_table(model: Optional[nnx.Module], grads: Any, select: Select
               ) -> table_lib.StatsTable:
  """`grad_stats` as ``{path: {"grad": stats}}``, a stack's blocks stacked."""
  selector = _Selector(select if select is not None else [])
  if model is not None:
    pairs = [(tuple(p), m) for p, m in nnx.iter_modules(model)]
    modules = {scan_lib.path_str(p): m for p, m in pairs}
    policies = nnx_lib.get_policies(model)
    flat = [(tuple(p), v) for p, v in nnx.to_flat_state(grads)]
  else:
    pairs, modules, policies = [], {}, {}
    flat = list(jax.tree_util.tree_flatten_with_path(grads)[0])
    flat = [(tuple(getattr(k, "key", getattr(k, "idx", k)) for k in p), v)
            for p, v in flat]
  stacks = scan_lib.Stacks.find(pairs)  # a stacked module: stats per block
  grouped: dict[str, list] = {}
  candidates: dict[str, Any] = stacks.candidates(pairs)
  for path, value in flat:
    value = value.get_value() if isinstance(value, nnx.Variable) else value
    owner = _owner("/".join(str(p) for p in path[:-1]), modules)
    candidates.setdefault(owner, modules.get(owner))
    if stacks.select(selector, owner, modules.get(owner)):
      grouped.setdefault(owner, []).append(value)
  selector.warn_unmatched(
      candidates, "the model" if model is None else type(model).__name__)
  return table_lib.StatsTable.union(
      stacks.stats(selector, owner, modules.get(owner), values,
                   getattr(policies.get(owner), "compute_dtype", None), "grad")
      for owner, values in grouped.items())


def fp8_stats(model: nnx.Module, select: Select) -> table_lib.StatsTable:
  """The selected FP8 modules' entries of kind ``"fp8"``.

  ``{"amax_lhs", "amax_rhs", "amax_grad"}``: the newest amax of the
  operands and of the output gradient (from the module's amax histories),
  and ``{"scale_lhs", "scale_rhs", "scale_grad"}``: the scale their whole
  history gives (what delayed scaling uses next; current scaling uses the
  tensor's own amax).
  """
  selector = _Selector(select)
  pairs = [(tuple(p), m) for p, m in nnx.iter_modules(model)]
  modules = {scan_lib.path_str(p): m for p, m in pairs}
  stacks = scan_lib.Stacks.find(pairs)  # a stacked module: one per block
  policies = nnx_lib.get_policies(model)
  tables = []
  for path, state in fp8_layers.histories(model).items():
    recipe = getattr(policies.get(path), "recipe", None)
    picked = stacks.select(selector, path, modules.get(path))
    if recipe is None or not picked:
      continue
    fp8 = {}  # In a stack, of every block: the histories' leading axes.
    for name, dtype in (("lhs", recipe.fwd_dtype),
                        ("rhs", recipe.fwd_dtype),
                        ("grad", recipe.bwd_dtype)):
      history = getattr(state, name)  # the newest amax first
      fp8[f"amax_{name}"] = history[..., 0]
      fp8[f"scale_{name}"] = fp8_core.compute_scale(
          jnp.max(history, axis=-1), dtype, recipe.margin)
    tables.append(table_lib.StatsTable({path: {"fp8": fp8}})
                  if picked[0][1] is None else table_lib.StatsTable.stacked(
                      "fp8", path, jnp.stack(list(fp8.values()), -1),
                      list(fp8), picked))
  return table_lib.StatsTable.union(tables)


def _owner(path: str, modules: dict[str, Any]) -> str:
  """The longest prefix of `path` that is a module (NNX); else `path`."""
  if not modules:
    return path
  parts = path.split("/") if path else []
  for n in range(len(parts), -1, -1):
    candidate = "/".join(parts[:n])
    if candidate in modules:
      return candidate
  return ""


# --------------------------------------------------------------------------
# Localisation.


def _scaled(loss: Any, loss_scale: Any) -> jax.Array:
  if isinstance(loss, tuple):
    loss = loss[0]
  loss = jnp.asarray(loss, jnp.float32)
  if loss_scale is None:
    return loss
  if hasattr(loss_scale, "scale"):
    return loss_scale.scale(loss)
  return loss * jnp.asarray(loss_scale, jnp.float32)


def _nnx_loss(model: nnx.Module, loss_fn: Callable, batch: Any,
              loss_scale: Any):
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def f(params):
    m = nnx.merge(graphdef, params, rest, copy=True)
    with watch(m):
      return _scaled(loss_fn(m, batch), loss_scale)

  return f, params


def _as_mapping(rules: Any) -> Mapping:
  if rules is None:
    return {}
  return rules if isinstance(rules, Mapping) else {rules_lib.DEFAULT_KEY:
                                                   rules}


def _linen_loss(module: nn.Module, variables: Any, loss_fn: Callable,
                batch: Any, loss_scale: Any, rules: Any):
  from jmp_amp.flax import linen as linen_lib  # pylint: disable=g-import-not-at-top
  variables = dict(variables)
  params = variables.pop("params")
  rules = _as_mapping(rules)

  def f(params):
    def net(*args, **kwargs):
      v = {"params": params, **variables}
      if variables:
        kwargs["mutable"] = list(variables)
        return linen_lib.apply_with_policies(module, rules, v, *args,
                                             **kwargs)[0]
      return linen_lib.apply_with_policies(module, rules, v, *args, **kwargs)

    with watch(None):
      return _scaled(loss_fn(net, batch), loss_scale)

  return f, params


def _nonfinite_input(model: Any, variables: Any, batch: Any
                     ) -> Optional[localise.NonFinite]:
  """The first inf/NaN already in the model's variables, else in the batch."""
  if isinstance(model, nnx.Module):
    modules = {"/".join(str(p) for p in path)
               for path, _ in nnx.iter_modules(model)}
    flat = {}
    for path, value in nnx.to_flat_state(nnx.state(model)):
      kind = "params " if isinstance(value, nnx.Param) else "state "
      value = value.get_value() if isinstance(value, nnx.Variable) else value
      flat[(kind, tuple(str(p) for p in path))] = value
    owner = lambda key: _owner("/".join(key[0].key[1][:-1]),
                               dict.fromkeys(modules))
    report = localise.input_report(
        flat, "", module_of_path=owner,
        keys=lambda key: key[0].key[0] + "/".join(key[0].key[1]))
  elif variables is not None:
    names = lambda path: [str(getattr(k, "key", getattr(k, "idx", k)))
                          for k in path]
    report = localise.input_report(
        variables, "variables",
        module_of_path=lambda path: "/".join(names(path)[1:-1]))
  else:
    report = None
  return report or localise.input_report(batch, "batch")


def _all_finite(tree: Any) -> bool:
  return all(bool(np.isfinite(np.asarray(x)).all())
             for x in jax.tree_util.tree_leaves(tree)
             if jnp.issubdtype(jnp.result_type(x), jnp.inexact))


def _fixed_rules(model: nnx.Module, rules: Any, path: str) -> Any:
  fix = {path: "float32"}
  if rules is not None:
    if not isinstance(rules, Mapping):
      rules = {rules_lib.DEFAULT_KEY: rules}
    return rules_lib.PolicyRules(rules) | fix
  # One exact rule per module; the root's policy as the catch-all, which
  # (unlike an exact rule for "") leaves the model's outputs uncast.
  derived = {}
  for p, policy in nnx_lib.get_policies(model).items():
    key = p if p else rules_lib.DEFAULT_KEY
    inside = p == path or p.startswith(path + "/") or not path
    if inside:
      derived[key] = "float32"
    elif policy is not None:
      derived[key] = policy
  return derived


def localise_model(model: Union[nnx.Module, nn.Module],
                   loss_fn: Callable[[Any, Any], Any], batch: Any, *,
                   loss_scale: Any = None, rules: Any = None,
                   variables: Any = None, verify: bool = True,
                   backward: bool = True) -> Optional[localise.NonFinite]:
  """``jmp_amp.numerics.find_nonfinite(loss_fn, model, batch, ...)``.

  The first op of ``loss_fn(model, batch)`` (and its gradient) making
  inf/NaN, with its module path and a float32 rule for that module,
  verified on a copy of the model; its arguments are documented there.
  """
  inputs = None
  if isinstance(model, (nn.Module, nnx.Module)):
    inputs = _nonfinite_input(model, variables, batch)
  if isinstance(model, nn.Module):
    if variables is None:
      raise TypeError("find_nonfinite of a linen module needs its variables "
                      "(variables=...)")
    build = functools.partial(_linen_loss, model, variables, loss_fn, batch,
                              loss_scale)
    f, params = build(rules)
  elif isinstance(model, nnx.Module):
    f, params = _nnx_loss(model, loss_fn, batch, loss_scale)
  else:
    raise TypeError("find_nonfinite takes an nnx.Module or a linen Module, "
                    f"got {type(model).__name__}")
  report = localise.find_nonfinite(f, params, backward=backward,
                                  inputs=inputs)
  if report is None or report.module is None or report.direction == "input":
    return report
  rule = {report.module: "float32"}
  fixed = None
  if verify:
    if isinstance(model, nn.Module):
      g, p = build(rules_lib.PolicyRules(_as_mapping(rules)) | rule)
    else:
      clone = nnx.clone(model)
      with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nnx_lib.set_policies(clone,
                             _fixed_rules(model, rules, report.module))
      g, p = _nnx_loss(clone, loss_fn, batch, loss_scale)
    value, grads = jax.jit(jax.value_and_grad(g))(p)
    fixed = _all_finite((value, grads)) if backward else _all_finite(value)
  return dataclasses.replace(report, suggested_rule=rule,
                                      fixed=fixed)
