"""Validation of loss-scale values: what a scale may be, and clear errors.

Shared by the loss-scale classes (`jmp_amp._src.loss_scale`): a scale is a
finite real scalar in float32's normal range; abstract values (tracers,
placeholders that jax, optax and orbax rebuild pytrees with) pass unchecked.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Optional
import warnings

import jax
import jax.numpy as jnp
import numpy as np

_F32 = np.finfo(np.float32)
SCALE_HELP = (
    "accepted: a real scalar (Python number or 0-d array) that is finite and "
    f"> 0 within float32's normal range [{_F32.tiny:.7g}, {_F32.max:.7g}]; "
    "typical values are 2**15 (DynamicLossScale) or 1 (no scaling)")


def describe(value: Any) -> str:
  """The value, its type and shape, for error messages."""
  if isinstance(value, jax.core.Tracer):
    return f"a traced {value.dtype}{list(value.shape)} array"
  if isinstance(value, (jax.Array, np.ndarray, np.generic)):
    if np.ndim(value) == 0:
      return f"{np.asarray(value).item()!r} ({value.dtype} scalar)"
    return f"an array of shape {tuple(np.shape(value))} ({value.dtype})"
  return f"{value!r} ({type(value).__name__})"


def is_abstract(value: Any) -> bool:
  """Tracers and shape placeholders: their value cannot be checked."""
  return isinstance(value, (jax.core.Tracer, jax.ShapeDtypeStruct))


def bounds(dtype: Any) -> tuple[float, float]:
  """The smallest and largest scale a `dtype` leaf may hold, as floats.

  For floats, the normal range (a subnormal scale loses precision, and its
  inverse overflows); for integers, 1 up to the largest value that survives a
  round trip through float32, in which `adjust` computes.
  """
  dtype = np.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.floating):
    info = jnp.finfo(dtype)
    return float(info.tiny), float(info.max)
  hi = np.float32(np.iinfo(dtype).max)
  if float(hi) > np.iinfo(dtype).max:
    hi = np.nextafter(hi, np.float32(0))
  return 1.0, float(hi)


def check_scale_value(value: Any, name: str, *, allow_abstract: bool) -> None:
  """Raises unless `value` is a finite positive real scalar in range.

  Args:
    value: a Python number or a scalar array (or, if `allow_abstract`, a tracer
      or `jax.ShapeDtypeStruct`, whose shape and dtype only are checked).
    name: how to name the value in messages ("DynamicLossScale.loss_scale").
    allow_abstract: whether tracers and shape placeholders are accepted.
  """
  if isinstance(value, (bool, np.bool_)) or not isinstance(
      value, (numbers.Real, np.ndarray, np.generic, jax.Array,
              jax.ShapeDtypeStruct)):
    raise TypeError(f"{name} must be a real number, got {describe(value)}; "
                    + SCALE_HELP)
  if isinstance(value, numbers.Real) and not isinstance(value, np.generic):
    try:
      v = float(value)
    except OverflowError:  # An int too large for a float.
      v = math.inf
    lo, hi = float(_F32.tiny), float(_F32.max)
  else:
    if np.shape(value) != ():
      raise ValueError(
          f"{name} must be a scalar, got shape {tuple(np.shape(value))}: "
          f"{describe(value)}; " + SCALE_HELP)
    dtype = value.dtype
    if not (jnp.issubdtype(dtype, jnp.floating)
            or jnp.issubdtype(dtype, jnp.integer)):
      raise TypeError(f"{name} must have a real (floating or integer) dtype, "
                      f"got {describe(value)}; " + SCALE_HELP)
    if is_abstract(value):
      if allow_abstract:
        return
      raise ValueError(f"{name} must be concrete here, got {describe(value)}")
    v = float(np.asarray(value))
    stored = jax.dtypes.canonicalize_dtype(dtype)
    if (jnp.issubdtype(dtype, jnp.integer) and stored != dtype
        and float(np.asarray(value).astype(stored)) != v):
      raise ValueError(
          f"{name} {describe(value)} does not fit {stored}, the dtype JAX "
          f"stores a {dtype} in (64-bit types are off); pass a float, e.g. "
          f"{v!r} or jnp.float32({v!r}); " + SCALE_HELP)
    lo, hi = bounds(stored if jnp.issubdtype(dtype, jnp.integer) else dtype)
    lo, hi = max(lo, float(_F32.tiny)), min(hi, float(_F32.max))
  if not (math.isfinite(v) and lo <= v <= hi):
    why = ""
    if math.isfinite(v) and v > 0:
      with np.errstate(over="ignore", under="ignore"):
        why = f" (outside [{lo:.7g}, {hi:.7g}]: {np.float32(v)!r} in float32)"
    raise ValueError(f"{name} must be a finite number > 0, got {v!r}{why}; "
                     + SCALE_HELP)


def concrete_number(value: Any) -> Optional[float]:
  """A Python float for real numbers and concrete real scalar arrays, else None."""
  if isinstance(value, (bool, np.bool_)) or is_abstract(value):
    return None
  if isinstance(value, numbers.Real):
    return float(value)
  if isinstance(value, (np.ndarray, np.generic, jax.Array)):
    if np.shape(value) == () and (jnp.issubdtype(value.dtype, jnp.floating)
                                  or jnp.issubdtype(value.dtype, jnp.integer)):
      return float(np.asarray(value))
  return None


def warn_if_not_floating(x: Any, name: str) -> None:
  # As jmp: an integer scale works (adjust keeps it integral), but warns.
  dtype = getattr(x, "dtype", None)
  if dtype is not None and not jnp.issubdtype(dtype, jnp.floating):
    warnings.warn(f"Expected floating type for {name}, got {dtype}")
