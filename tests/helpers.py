"""Assertion helpers shared by the tests (importable: tests/ is on pythonpath)."""

import jax
import numpy as np


def tree_bytes_equal(a, b) -> bool:
  """Bit-for-bit equality of two pytrees (NaNs included)."""
  la, ta = jax.tree_util.tree_flatten(a)
  lb, tb = jax.tree_util.tree_flatten(b)
  if ta != tb:
    return False
  return all(np.asarray(x).dtype == np.asarray(y).dtype
             and np.asarray(x).tobytes() == np.asarray(y).tobytes()
             for x, y in zip(la, lb))
