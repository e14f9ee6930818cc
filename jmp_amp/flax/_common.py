"""Helpers shared by the NNX and linen policy mechanisms."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_amp._src.dtypes import HALF_DTYPES as HALF
from jmp_amp._src.tree import cast_floating


def is_dtype_knob(value: Any) -> bool:
  """Whether a module's `dtype`/`param_dtype` holds a value we may replace."""
  if value is None:
    return True
  try:
    return jnp.issubdtype(value, jnp.floating)
  except TypeError:
    return False


def is_float_array(x: Any) -> bool:
  return (isinstance(x, (jax.Array, np.ndarray))
          and jnp.issubdtype(x.dtype, jnp.floating))


def cast_arrays(tree: Any, dtype: np.dtype, opaque: tuple[type, ...]) -> Any:
  """Casts floating array leaves; instances of `opaque` pass through whole."""
  return cast_floating(tree, dtype, is_leaf=lambda x: isinstance(x, opaque))


def methods_to_wrap(cls: type,
                    extra_methods: dict[type, tuple[str, ...]]
                    ) -> tuple[str, ...]:
  """``__call__`` plus the extra methods registered for `cls`'s bases."""
  extra = tuple(m for base, ms in extra_methods.items()
                if issubclass(cls, base) for m in ms)
  return ("__call__",) + extra
