"""Per-module numerics of Flax models: telemetry in the step, and the op that
made the first inf/NaN.

* `output_stats(fn, model, *args, select=...)`: runs ``fn(model, *args)``
  and returns, with its result, the range statistics of the selected
  modules' outputs (`jmp_amp.numerics.tensor_stats`: max ``|x|``, underflow
  and zero fractions, inf/NaN count), on device, as part of the traced
  computation. `grad_stats(model, grads, select)` does the same for the
  gradients of each module's params. ``make_train_step(..., numerics=select)``
  does both and returns them as ``metrics["numerics"]``, a plain nested dict
  ``{path: {"out": stats, "grad": stats}}`` of arrays (print it with
  `jmp_amp.numerics.format_stats`, log it with
  ``flax.traverse_util.flatten_dict``).
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
stacked by `nnx.vmap`, run by `nnx.scan` or a `jax.lax.scan` over their
split state) reports one entry per block, under its path in the unscanned
model (``blocks/0/attn``), which patterns match.

How module calls are seen: NNX through Flax's `nnx.capture`, whose
``method_outputs`` sows each module's ``__call__`` output (other methods on
request) into a Variable type of ours that keeps only its counts: they are
state, which `nnx.remat`, `nnx.cond`, `nnx.scan`, `nnx.vmap` and `nnx.jit`
carry (see `jmp_amp/flax/_capture.py`); linen through
`flax.linen.intercept_methods`. Flax's capture instruments the methods a
module's class defines itself: a class that inherits ``__call__`` from a
base class that no module of the model has as its own type is not seen
(telemetry warns, naming them), and a transform that drops a module's state
(a `jax.lax.scan` body that does not return its blocks' state) drops its
record too.

Example:
  >>> import jmp_amp.flax.numerics as numerics
  >>> model = nnx.Sequential(nnx.Linear(2, 3, rngs=nnx.Rngs(0)),
  ...                        nnx.Linear(3, 1, rngs=nnx.Rngs(0)))
  >>> x = jnp.full((1, 2), 1e4, jnp.float16)
  >>> y, stats = numerics.output_stats(lambda m, x: m(x), model, x,
  ...                                  select="layers/*")
  >>> sorted(stats), int(stats["layers/1"]["out"]["nonfinite"])
  (['layers/0', 'layers/1'], 0)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping, Optional, Sequence, Union
import warnings

from flax import linen as nn
from flax import nnx
import jax
import jax.extend.source_info_util as source_info_util
import jax.numpy as jnp
import numpy as np

from jmp_amp._src import localise
from jmp_amp._src import tensor_stats as stats_lib
from jmp_amp.flax import _capture
from jmp_amp.flax import _paths
from jmp_amp.flax import nnx as nnx_lib
from jmp_amp.flax import rules as rules_lib

__all__ = ("grad_stats", "output_stats")

Select = _paths.Select
Stats = dict[str, dict[str, dict[str, Any]]]


def _selector(select: Select) -> _paths.Selector:
  return _paths.Selector(select if select is not None else [])


def output_stats(fn: Callable[..., Any], model: Optional[nnx.Module],
                 *args: Any, select: Select = "**",
                 methods: Sequence[str] = ("__call__",)) -> tuple[Any, Stats]:
  """``fn(model, *args)`` and the statistics of its modules' outputs.

  Call it inside the traced function (a jitted step, `nnx.jit`, or eagerly);
  the statistics are arrays of that computation.

  Example:
    >>> import jmp_amp.flax.numerics as numerics
    >>> model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    >>> y, stats = numerics.output_stats(lambda m, x: m(x), model,
    ...                                  jnp.ones((1, 2)))
    >>> sorted(stats[""]["out"])  # "" is the root's path
    ['max_abs', 'nonfinite', 'underflow', 'zeros']

  Args:
    fn: ``fn(model, *args)``, the code that calls the model.
    model: the NNX model, or None for linen (every linen module called
      inside `fn`; a top-level ``apply`` starts the record afresh, so it
      holds the last one).
    *args: the other arguments of `fn`.
    select: the modules whose outputs are reported (see the module
      docstring).
    methods: the NNX methods whose outputs count (a module called through
      several of them reports them together); default ``__call__`` alone.

  Returns:
    ``(fn(model, *args), {path: {"out": stats}})``; a module called more
    than once reports its calls together.
  """
  selector = _selector(select)
  if model is None:
    return _linen_outputs(fn, args, selector)
  if not isinstance(model, nnx.Module):
    raise TypeError("output_stats takes an nnx.Module (or None for linen), "
                    f"got {type(model).__name__}")
  result, captured = _capture.capture(fn, model, args, methods)
  selector.warn_unmatched(_capture.candidates(captured),
                          type(model).__name__)
  return result, _capture.out_entries(captured, selector)


def _linen_outputs(fn: Callable[..., Any], args: Sequence[Any],
                   selector: _paths.Selector) -> tuple[Any, Stats]:
  depth = [0]
  called: dict[str, Any] = {}
  counts: dict[str, dict[str, Any]] = {}

  def interceptor(next_fun, args, kwargs, context):
    module = context.module
    if module.scope is None or context.method_name == "setup":
      return next_fun(*args, **kwargs)
    path = "/".join(module.path)
    called[path] = module
    if not path and not depth[0]:
      # A new top-level apply: `apply_with_policies` first runs the model
      # abstractly (`jax.eval_shape`), whose values must not be kept.
      counts.clear()
    depth[0] += 1
    try:
      with jax.named_scope(localise.encode_path(path)):
        out = next_fun(*args, **kwargs)
    finally:
      depth[0] -= 1
    new = stats_lib.tree_counts(out) if selector(path, module) else None
    if new is not None:
      counts[path] = (new if path not in counts
                      else stats_lib.add_counts(counts[path], new))
    return out

  with nn.intercept_methods(interceptor):
    result = fn(None, *args)
  selector.warn_unmatched(called, "the linen modules called")
  return result, {p: {"out": stats_lib.finish(c)}
                  for p, c in sorted(counts.items())}


def grad_stats(model: Optional[nnx.Module], grads: Any, select: Select
               ) -> dict[str, dict[str, jax.Array]]:
  """Range statistics of each selected module's param gradients.

  The underflow fraction is measured against the module's compute dtype
  (from `set_policies`; float32 without a policy): where these gradients
  lived before the cast to the param dtype. Gradients taken of a scaled
  loss are the scaled ones. A module of a scanned stack reports its
  gradients over every block, under its own path (``make_train_step``,
  which saw the stack run, reports them per block).

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
  selector = _selector(select)
  modules = ({} if model is None else
             {tuple(p): m for p, m in nnx.iter_modules(model)})
  captured = _capture.Captured({}, {}, modules)
  return {k: e["grad"] for k, e in _capture.grad_entries(
      model, grads, selector, captured).items()}


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
    return _scaled(loss_fn(m, batch), loss_scale)

  return f, params


def _blame(model: nnx.Module, loss_fn: Callable, batch: Any,
           loss_scale: Any, report: localise.NonFinite, f: Callable
           ) -> Optional[tuple[str, str, str]]:
  """``(module, rule key, own path)`` of the module where `report`'s op ran,
  from one jitted run under `nnx.capture`: of the modules whose code (or op
  knob) holds the op's source line (any module, if none does), the first to
  return a non-finite output (forward), or the last whose own params'
  gradients (else its submodules') are non-finite (backward). In a stack,
  ``module`` names the block and the rule key every block
  (``blocks/*/attn``)."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  seen = {}

  def f(params):
    m = nnx.merge(graphdef, params, rest, copy=True)
    loss, seen["captured"] = _capture.capture(
        lambda m, b: _scaled(loss_fn(m, b), loss_scale), m, (batch,))
    return loss, seen["captured"].counts

  # A forward culprit needs the outputs alone: a third of the program.
  backward = report.direction != "forward"
  if backward:
    (_, counts), grads = jax.jit(jax.value_and_grad(f, has_aux=True))(params)
  else:
    _, counts = jax.jit(f)(params)
  captured = dataclasses.replace(seen["captured"],
                                 counts=jax.device_get(counts))
  bad_grads = {key for key, e in _capture.grad_entries(
      model, grads, _selector("**"), captured, warn=False).items()
               if int(e["grad"]["nonfinite"])} if backward else set()
  starts = {}  # a stack's place in the call order: its first call's
  for (path, _), c in captured.counts.items():
    found = captured.stack(path)
    if found is not None:
      starts[found[0]] = min(starts.get(found[0], _capture.UNSET),
                             int(np.min(c["order"])))
  sites = _sites(f, params, {tuple(p): m for p, m in nnx.iter_modules(model)},
                 report.source)
  # Control flow (scan, cond, while) is one equation, at the line that runs
  # it: the op is in a module below.
  inside = report.primitive in _CONTROL_FLOW
  pool = []
  for (path, _), c in captured.counts.items():
    if sites and not any(path[:len(s)] == s if inside else path == s
                         for s in sites):
      continue
    found = captured.stack(path)
    for idx, block in captured.blocks(path):
      one = _capture.block_counts(c, idx)
      key = _paths.path_str(block)
      if report.direction == "forward":
        bad = 2 * (int(one["nonfinite"]) > 0)
      else:  # its own params' gradients (2), else those of its submodules
        bad = 2 if key in bad_grads else int(any(
            g.startswith(key + "/") or not key for g in bad_grads))
      if bad and int(one["order"]) != _capture.UNSET:
        start = starts[found[0]] if found else int(one["order"])
        pool.append((bad, (start, idx or (), int(one["order"])), path,
                     block))
  if not pool:
    return None
  best = max(p[0] for p in pool)
  pool = [p[1:] for p in pool if p[0] == best]
  pick = min(pool) if report.direction == "forward" else max(pool)
  _, path, block = pick
  found = captured.stack(path)
  rule = block if found is None else (
      found[0] + ("*",) * len(found[1]) + path[len(found[0]):])
  return (_paths.path_str(block), _paths.path_str(rule),
          _paths.path_str(path))


_CONTROL_FLOW = ("scan", "while", "cond")


def _sites(f: Callable, params: Any, modules: dict[tuple, Any],
           source: str) -> set[tuple]:
  """The paths of the modules whose code holds the op at `source`
  (``file:line[:column] (function)``): of the op's call stack, innermost
  first, the first frame in a module's code (its class's methods, or a
  function it holds, such as an op knob ``dot_general``)."""
  codes = [(path, fn) for path, m in modules.items() for fn in _functions(m)]
  for frames in _tracebacks(jax.make_jaxpr(f)(params).jaxpr, source):
    for frame in frames:
      found = {path for path, fn in codes
               if _holds_line(fn, frame.file_name, frame.line_num)}
      if found:
        return found
  return set()


def _tracebacks(jaxpr: Any, source: str):
  """The call stacks of the equations of `jaxpr` (sub-jaxprs too) whose
  source is `source`."""
  for eqn in jaxpr.eqns:
    if source_info_util.summarize(eqn.source_info) == source:
      yield eqn.source_info.traceback.frames
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          yield from _tracebacks(sub, source)


def _functions(module: Any) -> list[Any]:
  bases = set(nnx.Module.__mro__)
  own = [v for k in type(module).__mro__ if k not in bases
         for v in vars(k).values()]
  return own + [v for v in vars(module).values() if callable(v)]


def _holds_line(fn: Any, file: str, line: int) -> bool:
  while fn is not None:
    code = getattr(fn, "__code__", None)
    if code is not None and code.co_filename == file:
      lines = [n for _, _, n in code.co_lines() if n is not None]
      if lines and min(lines + [code.co_firstlineno]) <= line <= max(lines):
        return True
    fn = getattr(fn, "__wrapped__", getattr(fn, "func", None))
  return False


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

    return _linen_outputs(lambda _, b: _scaled(loss_fn(net, b), loss_scale),
                          (batch,), _selector([]))[0]

  return f, params


def _nonfinite_input(model: Any, variables: Any, batch: Any
                     ) -> Optional[localise.NonFinite]:
  """The first inf/NaN already in the model's variables, else in the batch."""
  if isinstance(model, nnx.Module):
    owners = _paths.owning_paths(model)
    flat = {}
    for path, value in nnx.to_flat_state(nnx.state(model)):
      kind = "params " if isinstance(value, nnx.Param) else "state "
      value = value.get_value() if isinstance(value, nnx.Variable) else value
      flat[(kind, tuple(str(p) for p in path))] = value
    owner = lambda key: _paths.path_str(_paths.owner(
        tuple(_to_key(k) for k in key[0].key[1]), owners))
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


def _to_key(part: str) -> Any:
  return int(part) if part.isdigit() else part


def _all_finite(tree: Any) -> bool:
  return all(bool(np.isfinite(np.asarray(x)).all())
             for x in jax.tree_util.tree_leaves(tree)
             if jnp.issubdtype(jnp.result_type(x), jnp.inexact))


def _fixed_rules(model: nnx.Module, rules: Any, key: str, path: str) -> Any:
  fix = {key: "float32"}
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
  if report is None or report.direction == "input":
    return report
  own = None
  if isinstance(model, nnx.Module):
    blamed = _blame(model, loss_fn, batch, loss_scale, report, f)
    if blamed is not None:
      module, key, own = blamed
      report = dataclasses.replace(report, module=module)
  if report.module is None:
    return report
  rule = {key if own is not None else report.module: "float32"}
  fixed = None
  if verify:
    if isinstance(model, nn.Module):
      g, p = build(rules_lib.PolicyRules(_as_mapping(rules)) | rule)
    else:
      clone = nnx.clone(model)
      with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nnx_lib.set_policies(clone,
                             _fixed_rules(model, rules, *rule,
                                          own or report.module))
      g, p = _nnx_loss(clone, loss_fn, batch, loss_scale)
    try:
      value, grads = jax.jit(jax.value_and_grad(g))(p)
    except Exception as e:  # pylint: disable=broad-except
      return dataclasses.replace(report, suggested_rule=rule, fixed=False,
                                 reason=_unapplied(e))
    fixed = _all_finite((value, grads)) if backward else _all_finite(value)
  return dataclasses.replace(report, suggested_rule=rule,
                                      fixed=fixed)


def _unapplied(error: Exception) -> str:
  """Why the model could not run with the suggested rule."""
  lines = [line.strip() for line in str(error).splitlines() if line.strip()]
  first = " ".join(lines[:2])
  why = f"re-running with it failed: {type(error).__name__}: {first}"
  if "carry" in first:
    why += (" (a float32 output changes the dtype of the scan's carry, the "
            "residual stream of a scanned stack: keep the carry in float32, "
            "or cast the block's output to the carry's dtype in the scanned "
            "function)")
  return why
