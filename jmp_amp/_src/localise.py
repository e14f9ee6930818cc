"""The first equation that turned finite values into inf/NaN.

`find_nonfinite(fn, *args)` traces `fn` (and, with ``backward=True``, its
vector-Jacobian product with a cotangent of ones) to a jaxpr and evaluates it
equation by equation, eagerly, outside `jit`, checking every floating output.
The first equation whose floating inputs are all finite and one of whose
outputs is not is the culprit. Sub-jaxprs (`jit`, `custom_jvp`, `checkpoint`,
calls) are entered, so the culprit is a primitive; control flow (`cond`,
`while`, `scan`) is evaluated as one equation.

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
    primitive: the JAX primitive, e.g. ``"dot_general"``, ``"mul"``.
    direction: ``"forward"`` (the function's own computation) or
      ``"backward"`` (only the gradient computation went non-finite).
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

  def __str__(self) -> str:
    where = repr(self.module) if self.module is not None else "<no module>"
    lines = [
        f"first non-finite value: {self.direction} {self.primitive} in "
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
    A `NonFinite` report, or None if every value stayed finite (or the
    inputs already held inf/NaN and nothing became non-finite from finite).
  """
  if not callable(fn):
    raise TypeError(f"find_nonfinite takes a function, got {fn!r}")
  leaves = jax.tree_util.tree_leaves(args)
  # The forward pass alone first: whatever goes non-finite only in the
  # gradient computation (its transposed equations, and the derivative
  # coefficients the linearisation computes next to the primal values) is
  # then "backward".
  targets = [(fn, False)] + ([(_with_vjp(fn), True)] if backward else [])
  for target, is_backward in targets:
    closed = jax.make_jaxpr(target)(*args)
    try:
      _eval(closed, leaves, "", is_backward)
    except _Found as found:
      return found.report
  return None
