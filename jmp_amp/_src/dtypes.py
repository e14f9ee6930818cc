"""Dtype names, parsing and validation shared by policies and loss scales.

Policies hold dtypes as JAX's scalar types (``jnp.float32``, ``jnp.bfloat16``),
as jmp does: they are callable (``half_dtype()(2 ** 15)`` makes an array),
compare equal to the matching `np.dtype` and are accepted wherever JAX, NumPy
or Flax take a dtype.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# The first name of each entry is the one `str(Policy)` prints.
_DTYPE_NAMES: dict[np.dtype, tuple[str, ...]] = {
    np.dtype(jnp.bfloat16): ("bf16", "bfloat16"),
    np.dtype(np.float16): ("f16", "float16", "fp16"),
    np.dtype(np.float32): ("f32", "float32", "fp32", "full", "single"),
    np.dtype(np.float64): ("f64", "float64", "fp64", "double"),
}
_SCALAR_TYPES = {
    np.dtype(jnp.bfloat16): jnp.bfloat16,
    np.dtype(np.float16): jnp.float16,
    np.dtype(np.float32): jnp.float32,
    np.dtype(np.float64): jnp.float64,
}
_NAME_TO_DTYPE = {n: dt for dt, names in _DTYPE_NAMES.items() for n in names}
ACCEPTED_DTYPE_NAMES = tuple(_NAME_TO_DTYPE) + ("half",)
# The half-precision dtypes whose matmuls accumulate in float32 (the one table).
HALF_DTYPES: tuple[np.dtype, ...] = (np.dtype(jnp.bfloat16), np.dtype(np.float16))
_ACCEPTED = "bfloat16, float16, float32 or float64"


def half_dtype() -> Any:
  """Returns the half-precision dtype for the default backend.

  ``jnp.bfloat16`` on TPU, ``jnp.float16`` elsewhere (as in jmp). Like jmp's,
  the result is JAX's scalar type: callable, and equal to the `np.dtype`.

  Example:
    >>> import jmp_amp
    >>> jmp_amp.half_dtype()(2 ** 15).dtype == jmp_amp.half_dtype()
    True
  """
  on_tpu = jax.local_devices()[0].platform == "tpu"
  return jnp.bfloat16 if on_tpu else jnp.float16


def parse_dtype(name: str) -> np.dtype:
  """Parses a dtype name such as "bf16", "float32", "full" or "half"."""
  if not isinstance(name, str):
    raise TypeError(f"dtype name must be a str, got {type(name).__name__}: {name!r}")
  key = name.strip().lower()
  if key == "half":
    return np.dtype(half_dtype())
  try:
    return _NAME_TO_DTYPE[key]
  except KeyError:
    raise ValueError(
        f"Unknown dtype {name!r}; accepted names: {', '.join(ACCEPTED_DTYPE_NAMES)}"
    ) from None


def dtype_name(dtype: Any) -> str:
  """The short name of a supported floating dtype ("f32", "bf16", ...)."""
  return _DTYPE_NAMES[np.dtype(dtype)][0]


def canonical_float_dtype(dtype: Any, what: str = "dtype") -> np.dtype:
  """Returns `dtype` as an `np.dtype`, raising unless it is a supported float.

  Args:
    dtype: a dtype, scalar type (``jnp.bfloat16``, ``np.float32``) or name.
    what: how to name the value in error messages (e.g. "compute_dtype").

  Raises:
    TypeError: for None (which NumPy would read as float64), bool, integer,
      complex and non-dtype values.
    ValueError: for an unknown dtype name.
  """
  if isinstance(dtype, str):
    try:
      return parse_dtype(dtype)
    except ValueError as e:
      raise ValueError(f"{what}: {e}") from None
  if dtype is None:
    raise TypeError(
        f"{what} must be a floating-point dtype ({_ACCEPTED}) or its name, "
        "got None (NumPy would read None as float64)")
  try:
    dt = np.dtype(dtype)
  except TypeError:
    raise TypeError(
        f"{what} must be a floating-point dtype ({_ACCEPTED}) or its name, "
        f"got {dtype!r}") from None
  if dt not in _DTYPE_NAMES:
    raise TypeError(
        f"{what} must be a floating-point dtype ({_ACCEPTED}) or its name, "
        f"got {dt.name}")
  return dt


def scalar_type(dtype: Any, what: str = "dtype") -> Any:
  """Like `canonical_float_dtype`, but returns JAX's scalar type (jnp.float32)."""
  return _SCALAR_TYPES[canonical_float_dtype(dtype, what)]


def is_float_dtype(dtype: Any) -> bool:
  return jnp.issubdtype(dtype, jnp.floating)
