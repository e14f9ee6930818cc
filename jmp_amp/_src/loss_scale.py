"""Loss scales: no-op, static and dynamic (jmp's API, with its bugs fixed).

A loss scale multiplies the loss before differentiation, so that small
gradients survive float16, and divides the gradients afterwards. The three
classes are frozen dataclasses registered as pytrees: the values that change
(the scale and its counters) are leaves, the hyper-parameters are static aux
data, so they pass through `jit`, sharding and checkpoints, and
`dataclasses.replace` works as it did with jmp's.

Pytree registration is by hand rather than `jax.tree_util.register_dataclass`
for two reasons. jax, optax and orbax rebuild pytrees with placeholder leaves
(None, `jax.ShapeDtypeStruct`, tracers, zeros); `register_dataclass` rebuilds
through ``__init__``, which validates, so unflattening here sets the fields
directly and never validates. And the leaves flatten without key names in
jmp's order, ``[loss_scale, counter]``, so an orbax checkpoint of jmp's
`DynamicLossScale` restores into ours.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Optional, TypeVar, Union

import jax
import jax.numpy as jnp
import numpy as np

from jmp_amp._src import scale_checks as checks

T = TypeVar("T")

@dataclasses.dataclass(frozen=True)
class NoOpLossScale:
  """Does not scale: for float32 and bfloat16 training.

  Example:
    >>> import jmp_amp
    >>> jmp_amp.NoOpLossScale().scale(3.0)
    3.0
  """

  @property
  def loss_scale(self) -> int:
    return 1

  def scale(self, tree: T) -> T:
    return tree

  def unscale(self, tree: T) -> T:
    return tree

  def adjust(self, grads_finite: jax.Array) -> NoOpLossScale:
    del grads_finite
    return self

  def validate(self) -> NoOpLossScale:
    """Returns self: there is nothing to check."""
    return self


@dataclasses.dataclass(frozen=True, init=False)
class StaticLossScale:
  """Scales the loss and unscales gradients by a fixed constant.

  The constant is static (a Python float), so this pytree has no leaves.

  Example:
    >>> import jmp_amp
    >>> ls = jmp_amp.StaticLossScale(128)
    >>> ls.scale(2.0), ls.unscale(256.0)
    (256.0, 2.0)

  Args:
    loss_scale: a finite real number > 0 within float32's normal range.

  Raises:
    TypeError: for a bool, string, complex or other non-real `loss_scale`.
    ValueError: for a `loss_scale` that is not a scalar, not finite, not > 0
      or that float32 rounds to 0 or inf; for a traced one.
  """

  loss_scale: float

  def __init__(self, loss_scale: Any):
    if isinstance(loss_scale, jax.core.Tracer):
      raise ValueError(
          "StaticLossScale needs a concrete loss_scale (it is static data); "
          "use DynamicLossScale for a scale that is an array in your state.")
    checks.check_scale_value(loss_scale, "StaticLossScale.loss_scale",
                       allow_abstract=False)
    object.__setattr__(self, "loss_scale", float(np.asarray(loss_scale)))

  def scale(self, tree: T) -> T:
    return jax.tree_util.tree_map(lambda x: x * self.loss_scale, tree)

  def unscale(self, tree: T) -> T:
    inv = 1.0 / self.loss_scale
    return jax.tree_util.tree_map(lambda x: x * inv, tree)

  def adjust(self, grads_finite: jax.Array) -> StaticLossScale:
    del grads_finite
    return self

  def validate(self) -> StaticLossScale:
    """Returns self if its scale is valid (see the constructor), else raises."""
    checks.check_scale_value(self.loss_scale, "StaticLossScale.loss_scale",
                       allow_abstract=False)
    return self


_LEAF_FIELDS = ("loss_scale", "counter", "overflows")
_STATIC_FIELDS = ("period", "factor", "min_loss_scale", "backoff_factor",
                  "max_loss_scale", "hysteresis")


@dataclasses.dataclass(frozen=True, init=False, eq=False)
class DynamicLossScale:
  """A loss scale that grows while gradients stay finite and backs off when not.

  Each call to `adjust(grads_finite)` returns the next state:

  * finite step: ``counter += 1``; when it reaches ``period`` the scale is
    multiplied by ``factor`` (unless that exceeds what the scale's dtype can
    hold; capped at ``max_loss_scale``) and the counter resets;
  * non-finite step: the counter resets, and after ``hysteresis`` consecutive
    non-finite steps the scale is multiplied by ``backoff_factor`` (default
    ``1 / factor``), floored at ``min_loss_scale`` and at the smallest normal
    number of the scale's dtype (1 for integer scales), so it never reaches 0;
  * a scale that is not a finite number > 0 (NaN or inf built under `jit`, or
    restored from a damaged checkpoint) is reset to that floor and grows back
    from there; `validate()` rejects such a scale outright.

  With ``DynamicLossScale(2.**16, period=2000, factor=2, backoff_factor=.5)``
  this is `torch.amp.GradScaler`'s rule.

  Leaves are ``loss_scale`` and ``counter`` (as in jmp, in that order and
  without key names, so jmp checkpoints restore into it), and with
  ``hysteresis > 1`` also ``overflows``, the run of consecutive non-finite
  steps (None when ``hysteresis == 1``). The other fields are static aux data,
  so they survive `jit` (jmp lost ``min_loss_scale`` there).

  ``==`` compares the static fields and the leaf values and returns a Python
  bool (under `jit`, where values are unknown, it raises). Instances are frozen; `dataclasses.replace` (or `replace`) validates
  like the constructor.

  Example:
    >>> import jax, jax.numpy as jnp, jmp_amp
    >>> ls = jmp_amp.DynamicLossScale(jnp.float32(2 ** 15), period=2)
    >>> grads = jax.grad(lambda w: ls.scale(w * 3.0))(1.0)
    >>> float(ls.unscale(grads))
    3.0
    >>> for finite in (True, True, False):
    ...   ls = ls.adjust(jnp.bool_(finite))
    ...   print(float(ls.loss_scale), int(ls.counter))
    32768.0 1
    65536.0 0
    32768.0 0

  Args:
    loss_scale: initial scale: a real scalar (Python number, becoming a float32
      array, or a 0-d array of any float or int dtype), finite and > 0 within
      float32's normal range. A tracer is accepted unchecked (then `adjust`
      repairs a non-finite value as described above).
    counter: finite steps since the last change (int32 scalar), in
      ``[0, period)``.
    period: finite steps between growths, an integer >= 1.
    factor: growth factor, > 1.
    min_loss_scale: floor for back-off, >= 0 (0 floors at the dtype's smallest
      normal number).
    backoff_factor: back-off multiplier in (0, 1); None means ``1 / factor``.
    max_loss_scale: cap for growth, or None for no cap; >= min_loss_scale.
    hysteresis: consecutive non-finite steps before backing off, >= 1.
    overflows: consecutive non-finite steps so far (int32 scalar), in
      ``[0, hysteresis)``; ignored (stored as None) when ``hysteresis == 1``.

  Raises:
    TypeError: for a non-real `loss_scale` (bool, string, complex, ...).
    ValueError: naming the argument, for values outside the ranges above.
  """

  loss_scale: Any
  counter: Any
  period: int
  factor: float
  min_loss_scale: float
  backoff_factor: Optional[float]
  max_loss_scale: Optional[float]
  hysteresis: int
  overflows: Any

  def __init__(self, loss_scale: Any, counter: Any = None, period: int = 2000,
               factor: float = 2, min_loss_scale: Any = 1.0,
               backoff_factor: Optional[float] = None,
               max_loss_scale: Optional[float] = None, hysteresis: int = 1,
               overflows: Any = None):
    checks.check_scale_value(loss_scale, "DynamicLossScale.loss_scale",
                       allow_abstract=True)
    checks.warn_if_not_floating(loss_scale, "loss_scale")
    checks.warn_if_not_floating(min_loss_scale, "min_loss_scale")

    period_f = checks.concrete_number(period)
    if period_f is None or period_f != int(period_f) or period_f < 1:
      raise ValueError(f"period must be an integer >= 1, got {period!r}")
    factor_f = checks.concrete_number(factor)
    if factor_f is None or not (math.isfinite(factor_f) and factor_f > 1):
      raise ValueError(f"factor must be a finite number > 1, got {factor!r}")
    min_f = checks.concrete_number(min_loss_scale)
    if min_f is None or not (math.isfinite(min_f) and min_f >= 0):
      raise ValueError(
          f"min_loss_scale must be a concrete finite number >= 0, got "
          f"{min_loss_scale!r}")
    if backoff_factor is not None:
      b = checks.concrete_number(backoff_factor)
      if b is None or not 0 < b < 1:
        raise ValueError(
            f"backoff_factor must be in (0, 1) (or None for 1/factor), got "
            f"{backoff_factor!r}")
      backoff_factor = b
    if max_loss_scale is not None:
      m = checks.concrete_number(max_loss_scale)
      if m is None or not m > 0:
        raise ValueError(
            f"max_loss_scale must be a number > 0 or None, got {max_loss_scale!r}")
      if m < min_f:
        raise ValueError(
            f"min_loss_scale ({min_f}) must not exceed max_loss_scale ({m})")
      max_loss_scale = m
    hyst = checks.concrete_number(hysteresis)
    if hyst is None or hyst != int(hyst) or hyst < 1:
      raise ValueError(f"hysteresis must be an integer >= 1, got {hysteresis!r}")

    if isinstance(loss_scale, numbers.Real) and not isinstance(
        loss_scale, np.generic):
      # A Python number would make a weakly-typed leaf whose type changes after
      # the first adjust(), recompiling the train step.
      loss_scale = np.asarray(loss_scale, np.float32)
    # Python ints become int32 arrays, for the same reason.
    counter = 0 if counter is None else counter
    if isinstance(counter, int) and not isinstance(counter, bool):
      counter = np.asarray(counter, np.int32)
    if hyst == 1:
      overflows = None  # Always 0 after a step: jmp's two leaves suffice.
    else:
      overflows = 0 if overflows is None else overflows
      if isinstance(overflows, int) and not isinstance(overflows, bool):
        overflows = np.asarray(overflows, np.int32)
    fields = dict(
        loss_scale=loss_scale, counter=counter, period=int(period_f),
        # Integer factors stay integers, so repr/equality match what was given.
        factor=int(factor_f) if factor_f == int(factor_f) else factor_f,
        min_loss_scale=min_f, backoff_factor=backoff_factor,
        max_loss_scale=max_loss_scale, hysteresis=int(hyst),
        overflows=overflows)
    for name, value in fields.items():
      object.__setattr__(self, name, value)
    self._check_leaves(allow_abstract=True)

  def _check_leaves(self, allow_abstract: bool) -> None:
    """Range checks of the leaves against the static fields."""
    checks.check_scale_value(self.loss_scale, "DynamicLossScale.loss_scale",
                       allow_abstract=allow_abstract)
    for name, bound in (("counter", self.period),
                        ("overflows", self.hysteresis)):
      value = getattr(self, name)
      if name == "overflows" and self.hysteresis == 1:
        continue
      if checks.is_abstract(value) and allow_abstract:
        continue
      v = checks.concrete_number(value)
      dtype = getattr(value, "dtype", None)
      if (v is None or v != int(v) or not 0 <= v < bound
          or (dtype is not None and not jnp.issubdtype(dtype, jnp.integer))):
        raise ValueError(
            f"DynamicLossScale.{name} must be an integer scalar in "
            f"[0, {bound}), got {checks.describe(value)}")
    scale = checks.concrete_number(self.loss_scale)
    if scale is None:
      return
    if scale < self.min_loss_scale:
      raise ValueError(
          f"loss_scale ({scale}) must not be below min_loss_scale "
          f"({self.min_loss_scale})")
    if self.max_loss_scale is not None and scale > self.max_loss_scale:
      raise ValueError(
          f"loss_scale ({scale}) must not exceed max_loss_scale "
          f"({self.max_loss_scale})")

  def validate(self) -> DynamicLossScale:
    """Returns self if every leaf is a valid, concrete value, else raises.

    For states that did not come through the constructor, e.g. restored from a
    checkpoint: the scale must be a finite number > 0 in range (see the
    constructor), ``counter`` an integer in ``[0, period)`` and ``overflows``
    one in ``[0, hysteresis)``.

    Example:
      >>> import jax, jax.numpy as jnp, jmp_amp
      >>> ls = jmp_amp.DynamicLossScale(2.0 ** 15)
      >>> broken = jax.tree_util.tree_map(lambda x: x * jnp.nan, ls)
      >>> broken.validate()  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      ValueError: DynamicLossScale.loss_scale must be a finite number > 0, got nan; ...

    Raises:
      TypeError, ValueError: naming the field, its value and what is accepted.
    """
    self._check_leaves(allow_abstract=False)
    return self

  def replace(self, **changes) -> DynamicLossScale:
    """Returns a copy with `changes` (validated like the constructor)."""
    return dataclasses.replace(self, **changes)

  def scale(self, tree: T) -> T:
    return jax.tree_util.tree_map(lambda x: x * self.loss_scale, tree)

  def unscale(self, tree: T) -> T:
    inv = 1 / self.loss_scale
    return jax.tree_util.tree_map(lambda x: x * inv, tree)

  def adjust(self, grads_finite: jax.Array) -> DynamicLossScale:
    """Returns the next state, given whether this step's grads were finite.

    Pure `jnp` code: jit-safe, no host synchronisation. Computes in float32
    (or wider) and returns leaves in their own dtypes, within the bounds that
    dtype can hold.
    """
    grads_finite = jnp.asarray(grads_finite)
    if grads_finite.ndim != 0:
      raise ValueError(
          f"grads_finite must be a boolean scalar, got shape {grads_finite.shape}")
    scale = jnp.asarray(self.loss_scale)
    counter = jnp.asarray(self.counter)
    compute = jnp.promote_types(scale.dtype, jnp.float32)
    lo, hi = checks.bounds(scale.dtype)
    floor = min(max(self.min_loss_scale, lo), hi)
    cap = hi if self.max_loss_scale is None else min(self.max_loss_scale, hi)
    s = scale.astype(compute)

    grown = s * self.factor
    # Growth that the dtype cannot hold keeps the scale (as torch does).
    grown = jnp.minimum(jnp.where(grown <= hi, grown, s), cap)
    # A NaN, inf or non-positive scale cannot recover by the rules here: it
    # is reset to the floor (below) with the counter.
    broken = jnp.logical_not(jnp.isfinite(s) & (s > 0))
    new_counter = jnp.where(grads_finite & jnp.logical_not(broken),
                            (counter + 1) % self.period, 0)
    # A finite step wraps the counter to 0 exactly when it reaches the period
    # (counter == period - 1 for a counter in [0, period)). Reading that from
    # new_counter lets XLA compute both leaves in one GPU kernel.
    finite_scale = jnp.where(new_counter == 0, grown, s)

    if self.backoff_factor is None:
      reduced = s / self.factor  # jmp's rule.
    else:
      reduced = s * self.backoff_factor
    reduced = jnp.maximum(reduced, floor)
    if self.hysteresis == 1:
      back_off = jnp.logical_not(grads_finite)
      new_overflows = None
    else:
      overflows = jnp.asarray(self.overflows)
      run = jnp.where(grads_finite, 0, overflows + 1)
      back_off = run >= self.hysteresis
      new_overflows = jnp.where(back_off, 0, run).astype(overflows.dtype)
    nonfinite_scale = jnp.where(back_off, reduced, s)

    new_scale = jnp.where(grads_finite, finite_scale, nonfinite_scale)
    new_scale = jnp.where(broken, floor, new_scale)
    return _unflatten(self._static(), (new_scale.astype(scale.dtype),
                                       new_counter.astype(counter.dtype),
                                       new_overflows))

  def _static(self) -> tuple[Any, ...]:
    return tuple(getattr(self, name) for name in _STATIC_FIELDS)

  def _leaves(self) -> tuple[Any, ...]:
    return tuple(getattr(self, name) for name in _LEAF_FIELDS)

  def __eq__(self, other) -> bool:
    """Same static fields and the same leaf values: a Python bool.

    Raises:
      TypeError: under `jit`, where leaf values are not known (compare the
        ``loss_scale`` arrays themselves there).
    """
    if type(other) is not DynamicLossScale:
      return NotImplemented
    if self._static() != other._static():
      return False
    pairs = list(zip(self._leaves(), other._leaves()))
    if any(isinstance(x, jax.core.Tracer) for pair in pairs for x in pair):
      raise TypeError(
          "DynamicLossScale == needs concrete values; under jit compare the "
          "arrays, e.g. jnp.all(a.loss_scale == b.loss_scale)")
    return all((a is None) == (b is None) and (a is None or (
        np.shape(a) == np.shape(b) and bool(np.all(np.asarray(a) == np.asarray(b)))))
               for a, b in pairs)

  __hash__ = None  # Leaves are arrays.


def _flatten(ls: DynamicLossScale):
  # The structure follows the static hysteresis, never a leaf's value: a
  # placeholder None in `overflows` must not drop the leaf.
  leaves = (ls.loss_scale, ls.counter)
  if ls.hysteresis > 1:
    leaves += (ls.overflows,)
  return leaves, ls._static()  # pylint: disable=protected-access


def _unflatten_node(static, leaves):
  leaves = tuple(leaves)
  if len(leaves) == 2:
    leaves += (None,)
  return _unflatten(static, leaves)


def _unflatten(static, leaves) -> DynamicLossScale:
  # Never validates: placeholders (None, ShapeDtypeStruct, object()) flow here.
  obj = object.__new__(DynamicLossScale)
  for name, value in zip(_STATIC_FIELDS + _LEAF_FIELDS,
                         tuple(static) + tuple(leaves)):
    object.__setattr__(obj, name, value)
  return obj


jax.tree_util.register_pytree_node(
    NoOpLossScale, lambda x: ((), None), lambda _, __: NoOpLossScale())
jax.tree_util.register_pytree_node(
    StaticLossScale, lambda x: ((), x.loss_scale),
    # Rebuilt from its own (validated) aux data, never from leaves.
    lambda aux, _: StaticLossScale(aux))
jax.tree_util.register_pytree_node(DynamicLossScale, _flatten, _unflatten_node)

LossScale = Union[NoOpLossScale, StaticLossScale, DynamicLossScale]


def check_loss_scale(loss_scale: Any) -> None:
  """Raises unless `loss_scale` is one of the three loss scale classes."""
  if not isinstance(loss_scale, (NoOpLossScale, StaticLossScale,
                                 DynamicLossScale)):
    raise TypeError(
        "loss_scale must be a jmp_amp NoOpLossScale, StaticLossScale or "
        f"DynamicLossScale, got {type(loss_scale).__name__}: {loss_scale!r}")
