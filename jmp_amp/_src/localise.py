"""The first equation that turned finite values into inf/NaN.

`find_nonfinite(fn, *args)` traces `fn` (and, with ``backward=True``, its
vector-Jacobian product with a cotangent of ones) to a jaxpr and evaluates it
equation by equation, eagerly, outside `jit`, checking every floating output.
Every inf/NaN is followed from where it came from (an op that made it, or
an argument or constant that held it) to the outputs; only one that reaches
them counts, so a ``-inf`` attention mask that a softmax turns into zeros is
no culprit. Of the sources that reach the outputs, an input NaN comes first
(a NaN in the batch or in a parameter: never meant), then the first op that
made an inf or NaN of finite values (an overflow), then an input inf (a mask
whose ``-inf`` reaches the outputs), then an op that made a NaN of an inf.
Sub-jaxprs (`jit`, `custom_jvp`, `checkpoint`, calls) are entered, so the
culprit is a primitive; so are the branch a `cond` takes and a `scan`'s body,
one iteration after the other; a `while` is evaluated as one equation.

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

from jmp_amp._src.autocast.casting import scan_counts

MODULE_MARK = "@"

# Sub-jaxpr params of the call-like primitives entered on the way down.
_CALL_PARAMS = {
    "pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr", "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr", "custom_vjp_call_jaxpr": "fun_jaxpr",
    "remat": "jaxpr", "checkpoint": "jaxpr", "remat2": "jaxpr",
    "custom_lin": None,
}
_WRAPPER = re.compile(r"(\w+)\(")
# Ops whose every output element depends on the same element of each
# operand: an inf/NaN there that no operand held is the op's own.
_ELEMENTWISE = frozenset(
    "abs acos acosh add add_any asin asinh atan atan2 atanh cbrt ceil clamp "
    "convert_element_type copy copy_p cos cosh div erf erf_inv erfc exp exp2 "
    "expm1 floor integer_pow is_finite lgamma digamma log log1p logistic max "
    "min mul neg nextafter pow reduce_precision rem round rsqrt select_n sign "
    "sin sinh sqrt square sub tan tanh".split())


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
      (None: not verified; False also when the rule could not be applied,
      see `reason`).
    reason: why `fixed` is False although the rule was not seen to fail:
      re-running with it raised (say, a float32 output changed the dtype
      of a scan's carry); else None.
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
  reason: Optional[str] = None

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
      if self.reason:
        verdict = "could not be applied"
      lines.append(f"  suggested rule: {self.suggested_rule} ({verdict})")
      if self.reason:
        lines.append(f"  {self.reason}")
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


_NONE, _NEW, _FROM_INF = 0, 1, 2


def _creates(primitive: str, invals: Sequence[Any], out: Any) -> int:
  """Whether `out` holds an inf/NaN that `invals` did not bring.

  `_NEW`: from finite operands, or, for an elementwise op, where every
  operand was finite (an overflow, a log of 0). `_FROM_INF`: a NaN from
  operands that held an inf but no NaN (``inf - inf``, ``0 * inf``).
  """
  o = np.asarray(out)
  bad = ~np.isfinite(o)
  if not bad.any():
    return _NONE
  ins = [np.asarray(x) for x in invals if _is_float(x)]
  if all(np.isfinite(x).all() for x in ins):
    return _NEW
  if primitive in _ELEMENTWISE and all(x.shape in ((), o.shape)
                                       for x in ins):
    brought = np.zeros(o.shape, bool)
    nan_brought = np.zeros(o.shape, bool)
    for x in ins:
      brought |= ~np.isfinite(x)
      nan_brought |= np.isnan(x)
    if (bad & ~brought).any():
      return _NEW
    if (np.isnan(o) & ~nan_brought).any():
      return _FROM_INF
    return _NONE
  if np.isnan(o).any() and not any(np.isnan(x).any() for x in ins):
    return _FROM_INF
  return _NONE


class _Walk:
  """Evaluates jaxprs eagerly, following where each inf/NaN came from.

  Every value carries its *origins*: the indices, in `sources`, of the ops
  that created an inf/NaN it holds (see `_creates`) and of the inputs or
  constants that held one. A value's origins are its operands' (those not
  finite) plus the op itself if it created one.
  """

  def __init__(self, backward: bool):
    self.backward = backward
    self.sources: list[NonFinite] = []
    self.from_inf: set[int] = set()  # ops that made a NaN of an inf

  def source(self, report: NonFinite) -> frozenset:
    self.sources.append(report)
    return frozenset([len(self.sources) - 1])

  def constant(self, x: Any) -> frozenset:
    if not _is_float(x) or _all_finite([x]):
      return frozenset()
    return self.source(input_report(x, "a constant captured by fn",
                                    keys=lambda path: ""))

  def eval(self, jaxpr, args: Sequence[Any], origins: Sequence[frozenset],
           prefix: str) -> tuple[list, list]:
    consts = ()
    if isinstance(jaxpr, jex_core.ClosedJaxpr):
      jaxpr, consts = jaxpr.jaxpr, jaxpr.consts
    env: dict[Any, tuple[Any, frozenset]] = {}

    def read(v):
      if isinstance(v, jex_core.Literal):
        x = np.asarray(v.val, dtype=v.aval.dtype)
        return x, self.constant(x)
      return env[v]

    env.update((v, (c, self.constant(c)))
               for v, c in zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, zip(args, origins)))
    for eqn in jaxpr.eqns:
      invals, inorig = zip(*map(read, eqn.invars)) if eqn.invars else ((), ())
      stack = "/".join(s for s in (prefix, str(eqn.source_info.name_stack))
                       if s)
      sub = _sub_jaxpr(eqn)
      if sub is not None:
        outs, outorig = self.eval(sub, invals, inorig, stack)
      elif eqn.primitive.name == "scan" and eqn.params["length"]:
        outs, outorig = self._scan(eqn, invals, inorig, stack)
      elif eqn.primitive.name == "cond":
        index = int(np.clip(np.asarray(invals[0]), 0,
                            len(eqn.params["branches"]) - 1))
        outs, outorig = self.eval(eqn.params["branches"][index], invals[1:],
                                  inorig[1:], stack)
      else:
        outs, outorig = self._eqn(eqn, list(invals), inorig, stack)
      env.update(zip(eqn.outvars, zip(outs, outorig)))
    return tuple(zip(*map(read, jaxpr.outvars))) or ((), ())

  def _scan(self, eqn, invals, inorig, stack) -> tuple[list, list]:
    """A `scan`, its body evaluated one iteration after the other."""
    params = eqn.params
    consts, n = scan_counts(params)
    split = consts + n
    carry, carry_orig = list(invals[consts:split]), list(inorig[consts:split])
    ys, ys_orig = [], None
    steps = range(params["length"])
    for i in reversed(steps) if params["reverse"] else steps:
      outs, outorig = self.eval(
          params["jaxpr"], [*invals[:consts], *carry,
                            *(x[i] for x in invals[split:])],
          [*inorig[:consts], *carry_orig, *inorig[split:]], stack)
      carry, carry_orig = list(outs[:n]), list(outorig[:n])
      ys.append(outs[n:])
      ys_orig = outorig[n:] if ys_orig is None else [
          a | b for a, b in zip(ys_orig, outorig[n:])]
    if params["reverse"]:
      ys.reverse()
    stacked = [jnp.stack(y) for y in zip(*ys)]
    return carry + stacked, carry_orig + list(ys_orig)

  def _eqn(self, eqn, invals, inorig, stack) -> tuple[list, list]:
    outs = eqn.primitive.bind(*invals, **eqn.params)
    if not eqn.primitive.multiple_results:
      outs = [outs]
    if _all_finite(outs):
      return outs, [frozenset()] * len(outs)
    brought = frozenset().union(*(o for x, o in zip(invals, inorig)
                                  if _is_float(x) and not _all_finite([x])))
    kinds = {_creates(eqn.primitive.name, invals, o) for o in outs
             if _is_float(o)} - {_NONE}
    own = frozenset()
    if kinds:
      own = self.source(_report(eqn, invals, outs, stack, self.backward))
      if _NEW not in kinds:
        self.from_inf |= own
    return outs, [brought | own if _is_float(o) and not _all_finite([o])
                  else frozenset() for o in outs]

  def culprit(self, origins: frozenset) -> Optional[NonFinite]:
    """The first source among `origins`: an input NaN (never meant), else
    the first op that made an inf/NaN of finite values (an overflow), else
    an input inf (a mask), else an op that made a NaN of an inf."""
    order = sorted(origins)
    is_input = lambda i: self.sources[i].direction == "input"
    for first in ([i for i in order
                   if is_input(i) and "nan" in self.sources[i].outputs[0]],
                  [i for i in order
                   if not is_input(i) and i not in self.from_inf],
                  [i for i in order if is_input(i)], order):
      if first:
        return self.sources[first[0]]
    return None


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
                   backward: bool = True,
                   inputs: Optional[NonFinite] = None) -> Optional[NonFinite]:
  """The first equation of `fn` (forward, then backward) making inf/NaN.

  Runs outside `jit`, one primitive at a time: roughly the cost of running
  `fn` and then ``jax.vjp(fn, *args)`` op by op without fusion (the first
  call also compiles each distinct primitive), plus one host check per
  equation. Meant for the rare step that went non-finite. The branch a
  `cond` takes and each iteration of a `scan` are entered (a `while` is one
  equation).

  Only an inf/NaN that reaches the outputs counts: one that a `where` or a
  softmax drops on the way (a ``-inf`` attention mask) is no culprit.

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
    inputs: the report to give when the culprit is an input (the caller
      names its inputs better); default: the argument's path.

  Returns:
    None if every output (and, with `backward`, every gradient) is finite.
    Else the source of an inf/NaN that reaches them: an argument (or an
    array `fn` captured) holding a NaN, with direction ``"input"`` and its
    path in ``argument`` (``"args[1]['x']"``); else the first op that made
    an inf or NaN of finite values (an overflow); else an argument holding
    an inf (a mask whose ``-inf`` reaches the outputs); else the first op
    that made a NaN of an inf (``inf - inf``, ``0 * inf``).
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
    walk = _Walk(is_backward)
    origins = []
    for path, x in jax.tree_util.tree_leaves_with_path(args):
      held = input_report(x, f"args{jax.tree_util.keystr(path)}",
                          keys=lambda _: "") if _is_float(x) else None
      origins.append(walk.source(held) if held else frozenset())
    outs, outorig = walk.eval(closed, leaves, origins, "")
    if _all_finite(outs):
      continue
    report = walk.culprit(frozenset().union(*outorig))
    if report is not None and report.direction == "input" and inputs:
      return inputs
    return report
  return None
