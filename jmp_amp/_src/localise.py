"""The first equation that turned finite values into inf/NaN.

`find_nonfinite(fn, *args)` traces `fn` (and, with ``backward=True``, its
vector-Jacobian product with a cotangent of ones) to a jaxpr and evaluates it
equation by equation, eagerly, outside `jit`, checking every floating output.
The first equation whose floating inputs are all finite and one of whose
outputs is not is the culprit. Sub-jaxprs (`jit`, `custom_jvp`, `checkpoint`,
calls) are entered, so the culprit is a primitive; control flow (`cond`,
`while`, `scan`) is evaluated as one equation. Before any equation, the
arguments and the constants `fn` captured are checked: an inf/NaN already
there (a NaN in the batch or in a parameter) is the first non-finite value,
reported with direction ``"input"`` and its argument path.

Module paths come from the name stack: `jax.named_scope` scopes, which
`jmp_amp.flax.numerics` puts around every Flax module call as ``@a.b.c``
(the module ``a/b/c``); transformation wrappers (``jvp(...)``,
``transpose(...)``) are dropped. The forward pass is evaluated alone first,
so a culprit found only with the gradient is reported as backward.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Optional, Sequence

import jax
import jax.extend.core as jex_core
import jax.extend.source_info_util as source_info_util
import jax.numpy as jnp
import numpy as np

from jmp_amp._src.autocast import interpreter

MODULE_MARK = "@"

# Sub-jaxpr params of the call-like primitives entered on the way down.
_CALL_PARAMS = {
    "pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr", "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr", "custom_vjp_call_jaxpr": "fun_jaxpr",
    "remat": "jaxpr", "checkpoint": "jaxpr", "custom_lin": None,
}
_WRAPPER = re.compile(r"(\w+)\(")


@dataclasses.dataclass(frozen=True)
class NonFinite:
  """Where the first inf/NaN came from.

  Attributes:
    primitive: the JAX primitive, e.g. ``"dot_general"``, ``"mul"``;
      ``"input"`` for a value that was non-finite before any op ran.
    direction: ``"forward"`` (the function's own computation),
      ``"backward"`` (only the gradient computation went non-finite) or
      ``"input"`` (an argument, or a constant the function captured, already
      held inf/NaN: see ``argument``).
    module: the module path (Flax models: the '/'-joined path rules use;
      plain functions: the `jax.named_scope` scopes), or None.
    source: ``file:line (function)`` of the Python code that emitted it.
    name_stack: the equation's full name stack.
    in_dtypes, out_dtypes: dtypes of its operands and results.
    max_finite: the largest finite ``|x|`` among its operands.
    outputs: per output, ``"inf"``, ``"nan"``, ``"inf+nan"`` or ``"finite"``.
    suggested_rule: a policy rule ``{module path: "float32"}`` keeping the
      module in float32 (None without a module path).
    fixed: whether re-running with `suggested_rule` removed every inf/NaN
      (None: not verified).
    argument: for an ``"input"``: where the value sits, e.g.
      ``"args[1]['x']"``, ``"batch['image']"``, ``"params layers/0/kernel"``
      or ``"a constant captured by fn"``; else None.
    step, loss_scale: the train step's count and the loss scale it used,
      when `jmp_amp.flax.make_train_step`'s ``on_nonfinite`` reports it;
      else None.
    repeats: for ``on_nonfinite``: how many steps in a row, this one
      included, went non-finite; else None.
  """
  primitive: str
  direction: str
  module: Optional[str]
  source: str
  name_stack: str
  in_dtypes: tuple[str, ...]
  out_dtypes: tuple[str, ...]
  max_finite: float
  outputs: tuple[str, ...]
  suggested_rule: Optional[dict[str, str]] = None
  fixed: Optional[bool] = None
  argument: Optional[str] = None
  step: Optional[int] = None
  loss_scale: Optional[float] = None
  repeats: Optional[int] = None

  def __str__(self) -> str:
    where = repr(self.module) if self.module is not None else "<no module>"
    when = ""
    if self.step is not None:
      when = f"step {self.step} (loss scale {self.loss_scale:g}"
      if self.repeats is not None and self.repeats > 1:
        when += f", {self.repeats} non-finite steps in a row"
      when += "): "
    if self.direction == "input":
      return (f"{when}first non-finite value: input {self.argument} "
              f"({', '.join(self.out_dtypes)}: {', '.join(self.outputs)})"
              + (f" in module {where}" if self.module is not None else "")
              + ", non-finite before any op ran; largest "
              f"finite |x| in it = {self.max_finite:.6g}")
    if self.primitive == "unknown":
      return (f"{when}the step's loss or gradients were not finite, but an "
              f"op-by-op replay ({self.source}) found no op making inf/NaN")
    lines = [
        f"{when}first non-finite value: {self.direction} {self.primitive} in "
        f"module {where}",
        f"  source: {self.source}",
        f"  operands {', '.join(self.in_dtypes)} -> results "
        f"{', '.join(self.out_dtypes)} ({', '.join(self.outputs)}); "
        f"largest finite operand |x| = {self.max_finite:.6g}"]
    if self.suggested_rule is not None:
      verdict = {None: "not verified", True: "removes every inf/NaN",
                 False: "does NOT remove the inf/NaN"}[self.fixed]
      lines.append(f"  suggested rule: {self.suggested_rule} ({verdict})")
    return "\n".join(lines)


def strip_transforms(name_stack: str) -> str:
  """The name stack without transformation wrappers (``jvp(...)``)."""
  return _WRAPPER.sub("", name_stack).replace(")", "")


def module_of(name_stack: str) -> Optional[str]:
  """The module path of a name stack: its innermost ``@`` scope, else the
  user's scopes ('/'-joined), else None."""
  stripped = strip_transforms(name_stack)
  segments = [s for s in stripped.split("/") if s]
  marked = [s for s in segments if s.startswith(MODULE_MARK)]
  if marked:
    return decode_path(marked[-1])
  return "/".join(segments) or None


def encode_path(path: str) -> str:
  """The `jax.named_scope` name of module path ``a/b`` (``@a.b``)."""
  return MODULE_MARK + path.replace("/", ".")


def decode_path(scope: str) -> str:
  return scope[len(MODULE_MARK):].replace(".", "/")


def _status(x) -> str:
  a = np.asarray(x)
  nan, inf = bool(np.isnan(a).any()), bool(np.isinf(a).any())
  return {(False, False): "finite", (False, True): "inf",
          (True, False): "nan", (True, True): "inf+nan"}[(nan, inf)]


def _is_float(x) -> bool:
  return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)


def _all_finite(xs) -> bool:
  return all(bool(np.isfinite(np.asarray(x)).all()) for x in xs
             if _is_float(x))


class _Found(Exception):

  def __init__(self, report: NonFinite):
    super().__init__(str(report))
    self.report = report


def _report(eqn, invals, outvals, name_stack: str, backward: bool
            ) -> NonFinite:
  floats = [np.abs(np.asarray(x, np.float32)) for x in invals if _is_float(x)]
  finite = [a[np.isfinite(a)] for a in floats]
  largest = max([float(a.max()) for a in finite if a.size] + [0.0])
  return NonFinite(
      primitive=eqn.primitive.name,
      direction="backward" if backward else "forward",
      module=module_of(name_stack),
      source=source_info_util.summarize(eqn.source_info),
      name_stack=name_stack,
      in_dtypes=tuple(str(np.dtype(getattr(x, "dtype", np.float32)))
                      for x in invals),
      out_dtypes=tuple(str(x.dtype) for x in outvals),
      max_finite=largest,
      outputs=tuple(_status(x) if _is_float(x) else "finite"
                    for x in outvals))


def input_report(tree: Any, name: str,
                 module_of_path: Optional[Callable[[str], Optional[str]]]
                 = None, keys: Optional[Callable[[Any], str]] = None
                 ) -> Optional[NonFinite]:
  """The first floating leaf of `tree` holding inf/NaN, as an input report.

  Args:
    tree: the pytree (arguments, a batch, params).
    name: how to name it (``"args"``, ``"batch"``, ``"params "``).
    module_of_path: maps the leaf's key path to its module path.
    keys: formats a key path (default `jax.tree_util.keystr`).

  Returns:
    A `NonFinite` with direction ``"input"``, or None if all are finite.
  """
  keys = keys or jax.tree_util.keystr
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    if not _is_float(leaf) or _all_finite([leaf]):
      continue
    where = keys(path)
    a = np.abs(np.asarray(leaf, np.float32))
    finite = a[np.isfinite(a)]
    dtype = f"{np.dtype(leaf.dtype)}{list(np.shape(leaf))}"
    return NonFinite(
        primitive="input", direction="input",
        module=module_of_path(path) if module_of_path else None,
        source="", name_stack="", in_dtypes=(), out_dtypes=(dtype,),
        max_finite=float(finite.max()) if finite.size else 0.0,
        outputs=(_status(leaf),), argument=f"{name}{where}")
  return None


def _sub_jaxpr(eqn):
  name = _CALL_PARAMS.get(eqn.primitive.name)
  if name is None:
    return None
  sub = eqn.params.get(name)
  return sub if isinstance(sub, (jex_core.ClosedJaxpr, jex_core.Jaxpr)) \
      else None


def _eval(jaxpr, args: Sequence[Any], prefix: str, backward: bool) -> list:
  """Evaluates `jaxpr` eagerly; raises _Found at the first culprit."""

  def eval_eqn(eqn, invals):
    stack = "/".join(s for s in (prefix, str(eqn.source_info.name_stack))
                     if s)
    sub = _sub_jaxpr(eqn)
    if sub is not None:
      return _eval(sub, invals, stack, backward)
    outs = eqn.primitive.bind(*invals, **eqn.params)
    if not eqn.primitive.multiple_results:
      outs = [outs]
    if not _all_finite(outs) and _all_finite(invals):
      raise _Found(_report(eqn, invals, outs, stack, backward))
    return outs

  return interpreter.eval_jaxpr(jaxpr, args, eval_eqn)


def _with_vjp(fn: Callable[..., Any]) -> Callable[..., Any]:
  """``fn``'s outputs and the VJP of a cotangent of ones, in one function."""

  def both(*args):
    out, pullback = jax.vjp(fn, *args)
    ones = jax.tree.map(
        lambda o: jnp.ones(o.shape, o.dtype) if _is_float(o)
        else np.zeros(o.shape, jax.dtypes.float0), out)
    return out, pullback(ones)

  return both


def find_nonfinite(fn: Callable[..., Any], *args: Any,
                   backward: bool = True) -> Optional[NonFinite]:
  """The first equation of `fn` (forward, then backward) making inf/NaN.

  Runs outside `jit`, one primitive at a time: roughly the cost of running
  `fn` and then ``jax.vjp(fn, *args)`` op by op without fusion (the first
  call also compiles each distinct primitive), plus one host check per
  equation. Meant for the rare step that went non-finite.

  Example:
    >>> def f(x):
    ...   with jax.named_scope("scores"):
    ...     s = x * x * 300.0
    ...   return jnp.sum(s / 300.0)
    >>> r = find_nonfinite(f, jnp.array([1.0, 30.0], jnp.float16))
    >>> r.primitive, r.direction, r.module, r.max_finite
    ('mul', 'forward', 'scores', 900.0)

  Args:
    fn: the function (its float arguments are differentiated).
    *args: its arguments (arrays or pytrees of arrays).
    backward: also evaluate the gradient (the VJP of a cotangent of ones
      for every floating output; for a loss, its gradient).

  Returns:
    A `NonFinite` report, or None if every value stayed finite. An inf/NaN
    already in the arguments (or in an array `fn` captured) is reported
    first, with direction ``"input"`` and its path in ``argument``
    (``"args[1]['x']"``).
  """
  if not callable(fn):
    raise TypeError(f"find_nonfinite takes a function, got {fn!r}")
  report = input_report(args, "args")
  if report is not None:
    return report
  leaves = jax.tree_util.tree_leaves(args)
  # The forward pass alone first: whatever goes non-finite only in the
  # gradient computation (its transposed equations, and the derivative
  # coefficients the linearisation computes next to the primal values) is
  # then "backward".
  targets = [(fn, False)] + ([(_with_vjp(fn), True)] if backward else [])
  for target, is_backward in targets:
    closed = jax.make_jaxpr(target)(*args)
    if not is_backward:
      consts = [c for c in closed.consts if _is_float(c)]
      report = input_report(consts, "a constant captured by fn",
                            keys=lambda path: "")
      if report is not None:
        return report
    try:
      _eval(closed, leaves, "", is_backward)
    except _Found as found:
      return found.report
  return None
