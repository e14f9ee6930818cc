"""Loss scales: no-op, static and dynamic (jmp's API, with its bugs fixed).

A loss scale multiplies the loss before differentiation, so that small
gradients survive float16, and divides the gradients afterwards. All three
classes are pytrees whose leaves are arrays and whose hyper-parameters are
static aux data, so they pass through `jit`, sharding and checkpoints.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Optional, TypeVar, Union
import warnings

import jax
import jax.numpy as jnp
import numpy as np

T = TypeVar("T")

# float32's smallest normal number: the floor when min_loss_scale is 0, so
# that a scale can never reach zero (unscaling would then divide by zero).
_TINY = float(np.finfo(np.float32).tiny)


def _concrete_float(value: Any, name: str) -> Optional[float]:
  """Returns `value` as a Python float, or None if it is traced/abstract."""
  if isinstance(value, numbers.Real) and not isinstance(value, bool):
    return float(value)
  if isinstance(value, (np.ndarray, np.generic)) and np.ndim(value) == 0:
    return float(value)
  if isinstance(value, jax.Array) and not isinstance(value, jax.core.Tracer):
    if np.ndim(value) != 0:
      raise ValueError(f"{name} must be a scalar, got shape {np.shape(value)}")
    return float(value)
  return None


def _check_positive_scale(value: Any, name: str) -> None:
  v = _concrete_float(value, name)
  if v is not None and not (math.isfinite(v) and v > 0):
    raise ValueError(
        f"{name} must be a finite number > 0, got {v!r}. Typical values are "
        "2**15 (DynamicLossScale) or 1 (no scaling).")


def _warn_if_not_floating(x: Any, name: str) -> None:
  # jax passes object() placeholders when it rebuilds pytrees.
  if type(x) is object:  # pylint: disable=unidiomatic-typecheck
    return
  dtype = jax.eval_shape(lambda: x).dtype
  if not jnp.issubdtype(dtype, jnp.floating):
    warnings.warn(f"Expected floating type for {name}, got {dtype}")


class NoOpLossScale:
  """Does not scale: for float32 and bfloat16 training."""

  __slots__ = ()

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

  def __eq__(self, other):
    return type(other) is NoOpLossScale

  def __hash__(self):
    return hash(NoOpLossScale)

  def __repr__(self):
    return "NoOpLossScale()"


class StaticLossScale:
  """Scales the loss and unscales gradients by a fixed constant.

  The constant is static (a Python float), so this pytree has no leaves.

  Args:
    loss_scale: a finite number > 0.
  """

  __slots__ = ("_loss_scale",)

  def __init__(self, loss_scale: Any):
    if isinstance(loss_scale, jax.core.Tracer):
      raise ValueError(
          "StaticLossScale needs a concrete loss_scale (it is static data); "
          "use DynamicLossScale for a scale that is an array in your state.")
    _check_positive_scale(loss_scale, "StaticLossScale.loss_scale")
    self._loss_scale = float(np.asarray(loss_scale))

  @property
  def loss_scale(self) -> float:
    return self._loss_scale

  def scale(self, tree: T) -> T:
    return jax.tree_util.tree_map(lambda x: x * self._loss_scale, tree)

  def unscale(self, tree: T) -> T:
    inv = 1.0 / self._loss_scale
    return jax.tree_util.tree_map(lambda x: x * inv, tree)

  def adjust(self, grads_finite: jax.Array) -> StaticLossScale:
    del grads_finite
    return self

  def __eq__(self, other):
    return (type(other) is StaticLossScale
            and other._loss_scale == self._loss_scale)

  def __hash__(self):
    return hash((StaticLossScale, self._loss_scale))

  def __repr__(self):
    return f"StaticLossScale({self._loss_scale!r})"


class DynamicLossScale:
  """A loss scale that grows while gradients stay finite and backs off when not.

  Each call to `adjust(grads_finite)` returns the next state:

  * finite step: ``counter += 1``; when it reaches ``period`` the scale is
    multiplied by ``factor`` (if that is finite, and capped at
    ``max_loss_scale``) and the counter resets;
  * non-finite step: the counter resets, and after ``hysteresis`` consecutive
    non-finite steps the scale is multiplied by ``backoff_factor`` (default
    ``1 / factor``), floored at ``min_loss_scale``.

  With ``DynamicLossScale(2.**16, period=2000, factor=2, backoff_factor=.5)``
  this is `torch.amp.GradScaler`'s rule.

  Leaves are the arrays ``loss_scale``, ``counter`` and ``overflows`` (the run
  of consecutive non-finite steps, for hysteresis); all other fields are static
  aux data, so they survive `jit` (jmp lost ``min_loss_scale`` there).

  Example:
    >>> ls = DynamicLossScale(jnp.float32(2**15))
    >>> loss = ls.scale(loss)                  # before jax.grad
    >>> grads = ls.unscale(grads)
    >>> ls = ls.adjust(all_finite(grads))

  Args:
    loss_scale: initial scale, a finite float > 0 (array or Python number).
    counter: finite steps since the last change (int32 scalar).
    period: finite steps between growths, an integer >= 1.
    factor: growth factor, > 1.
    min_loss_scale: floor for back-off, >= 0 (0 floors at float32's tiny).
    backoff_factor: back-off multiplier in (0, 1); None means ``1 / factor``.
    max_loss_scale: cap for growth, or None for no cap; >= min_loss_scale.
    hysteresis: consecutive non-finite steps before backing off, >= 1.
    overflows: consecutive non-finite steps so far (int32 scalar).
  """

  __slots__ = ("loss_scale", "counter", "overflows", "period", "factor",
               "min_loss_scale", "backoff_factor", "max_loss_scale",
               "hysteresis")

  def __init__(self, loss_scale: Any, counter: Any = None, period: int = 2000,
               factor: float = 2, min_loss_scale: Any = 1.0,
               backoff_factor: Optional[float] = None,
               max_loss_scale: Optional[float] = None, hysteresis: int = 1,
               overflows: Any = None):
    _warn_if_not_floating(loss_scale, "loss_scale")
    _warn_if_not_floating(min_loss_scale, "min_loss_scale")
    _check_positive_scale(loss_scale, "loss_scale")

    period_f = _concrete_float(period, "period")
    if period_f is None or period_f != int(period_f) or period_f < 1:
      raise ValueError(f"period must be an integer >= 1, got {period!r}")
    factor_f = _concrete_float(factor, "factor")
    if factor_f is None or not (math.isfinite(factor_f) and factor_f > 1):
      raise ValueError(f"factor must be a finite number > 1, got {factor!r}")
    min_f = _concrete_float(min_loss_scale, "min_loss_scale")
    if min_f is None or not (math.isfinite(min_f) and min_f >= 0):
      raise ValueError(
          f"min_loss_scale must be a concrete finite number >= 0, got "
          f"{min_loss_scale!r}")
    if backoff_factor is not None:
      b = _concrete_float(backoff_factor, "backoff_factor")
      if b is None or not 0 < b < 1:
        raise ValueError(
            f"backoff_factor must be in (0, 1) (or None for 1/factor), got "
            f"{backoff_factor!r}")
      backoff_factor = b
    if max_loss_scale is not None:
      m = _concrete_float(max_loss_scale, "max_loss_scale")
      if m is None or not m > 0:
        raise ValueError(
            f"max_loss_scale must be a number > 0 or None, got {max_loss_scale!r}")
      if m < min_f:
        raise ValueError(
            f"min_loss_scale ({min_f}) must not exceed max_loss_scale ({m})")
      max_loss_scale = m
    hyst = _concrete_float(hysteresis, "hysteresis")
    if hyst is None or hyst != int(hyst) or hyst < 1:
      raise ValueError(f"hysteresis must be an integer >= 1, got {hysteresis!r}")
    # A scale outside [min, max] moves the wrong way: a back-off would raise
    # it to the floor, a growth step would cut it to the cap.
    init_f = _concrete_float(loss_scale, "loss_scale")
    if init_f is not None and init_f < min_f:
      raise ValueError(
          f"loss_scale ({init_f}) must not be below min_loss_scale ({min_f})")
    if (init_f is not None and max_loss_scale is not None
        and init_f > max_loss_scale):
      raise ValueError(
          f"loss_scale ({init_f}) must not exceed max_loss_scale "
          f"({max_loss_scale})")

    if isinstance(loss_scale, numbers.Real):
      # A Python number would make a weakly-typed leaf whose type changes after
      # the first adjust(), recompiling the train step.
      loss_scale = np.asarray(loss_scale, np.float32)
    self.loss_scale = loss_scale
    self.counter = (np.zeros([], np.int32) if counter is None else counter)
    self.overflows = (np.zeros([], np.int32) if overflows is None
                      else overflows)
    self.period = int(period_f)
    # Keep integer factors integers so that repr/equality match what was given.
    self.factor = int(factor_f) if factor_f == int(factor_f) else factor_f
    self.min_loss_scale = min_f
    self.backoff_factor = backoff_factor
    self.max_loss_scale = max_loss_scale
    self.hysteresis = int(hyst)

  def __setattr__(self, name, value):
    if hasattr(self, "hysteresis"):
      raise AttributeError("DynamicLossScale is immutable; use adjust() or "
                           "replace()")
    object.__setattr__(self, name, value)

  # --- pytree protocol: unflatten never validates (placeholders flow here).
  def _static(self):
    return (self.period, self.factor, self.min_loss_scale, self.backoff_factor,
            self.max_loss_scale, self.hysteresis)

  def tree_flatten(self):
    return (self.loss_scale, self.counter, self.overflows), self._static()

  @classmethod
  def tree_unflatten(cls, static, leaves):
    obj = object.__new__(cls)
    values = dict(zip(("loss_scale", "counter", "overflows"), leaves))
    values.update(zip(("period", "factor", "min_loss_scale", "backoff_factor",
                       "max_loss_scale", "hysteresis"), static))
    # Set hysteresis last: it marks the object as frozen.
    for name in cls.__slots__:
      object.__setattr__(obj, name, values[name])
    return obj

  def replace(self, **changes) -> DynamicLossScale:
    """Returns a copy with `changes` (validated like the constructor)."""
    kwargs = {name: getattr(self, name) for name in self.__slots__}
    kwargs.update(changes)
    return DynamicLossScale(**kwargs)

  def _with_leaves(self, loss_scale, counter, overflows) -> DynamicLossScale:
    return self.tree_unflatten(self._static(), (loss_scale, counter, overflows))

  def scale(self, tree: T) -> T:
    return jax.tree_util.tree_map(lambda x: x * self.loss_scale, tree)

  def unscale(self, tree: T) -> T:
    inv = 1 / self.loss_scale
    return jax.tree_util.tree_map(lambda x: x * inv, tree)

  def adjust(self, grads_finite: jax.Array) -> DynamicLossScale:
    """Returns the next state, given whether this step's grads were finite.

    Pure `jnp`/`lax` code: jit-safe, no host synchronisation.
    """
    grads_finite = jnp.asarray(grads_finite)
    if grads_finite.ndim != 0:
      raise ValueError(
          f"grads_finite must be a boolean scalar, got shape {grads_finite.shape}")
    scale = jnp.asarray(self.loss_scale)
    counter = jnp.asarray(self.counter)
    overflows = jnp.asarray(self.overflows)

    grown = scale * jnp.asarray(self.factor, scale.dtype)
    if self.max_loss_scale is not None:
      grown = jnp.minimum(grown, jnp.asarray(self.max_loss_scale, scale.dtype))
    grown = jnp.where(jnp.isfinite(grown), grown, scale)
    finite_scale = jnp.where(counter == self.period - 1, grown, scale)

    if self.backoff_factor is None:
      reduced = scale / jnp.asarray(self.factor, scale.dtype)  # jmp's rule.
    else:
      reduced = scale * jnp.asarray(self.backoff_factor, scale.dtype)
    floor = max(self.min_loss_scale, _TINY)
    reduced = jnp.maximum(jnp.asarray(floor, scale.dtype), reduced)
    new_overflows = jnp.where(grads_finite, 0, overflows + 1)
    back_off = new_overflows >= self.hysteresis
    nonfinite_scale = jnp.where(back_off, reduced, scale)

    new_scale = jnp.where(grads_finite, finite_scale, nonfinite_scale)
    new_counter = jnp.where(grads_finite, (counter + 1) % self.period, 0)
    new_overflows = jnp.where(back_off, 0, new_overflows)
    return self._with_leaves(new_scale.astype(scale.dtype), new_counter.astype(counter.dtype),
                             new_overflows.astype(overflows.dtype))

  def __eq__(self, other):
    if type(other) is not DynamicLossScale:
      return NotImplemented
    if self._static() != other._static():
      return False
    return all(bool(np.all(np.asarray(a) == np.asarray(b)))
               for a, b in zip(self.tree_flatten()[0], other.tree_flatten()[0]))

  __hash__ = None

  def __repr__(self):
    return (f"DynamicLossScale(loss_scale={self.loss_scale!r}, "
            f"counter={self.counter!r}, period={self.period}, "
            f"factor={self.factor}, min_loss_scale={self.min_loss_scale}, "
            f"backoff_factor={self.backoff_factor}, "
            f"max_loss_scale={self.max_loss_scale}, "
            f"hysteresis={self.hysteresis}, overflows={self.overflows!r})")


jax.tree_util.register_pytree_node(
    NoOpLossScale, lambda x: ((), None), lambda _, __: NoOpLossScale())
jax.tree_util.register_pytree_node(
    StaticLossScale, lambda x: ((), x._loss_scale),
    lambda aux, _: StaticLossScale(aux))
jax.tree_util.register_pytree_node_class(DynamicLossScale)

LossScale = Union[NoOpLossScale, StaticLossScale, DynamicLossScale]
