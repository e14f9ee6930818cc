"""Shared fixtures and helpers for the jmp_amp test suite."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

HALF_DTYPES = (jnp.bfloat16, jnp.float16)


@pytest.fixture
def small_params():
  """A small mixed pytree of float32 parameters."""
  k1, k2 = jax.random.split(jax.random.key(0))
  return {
      "dense": {"w": jax.random.normal(k1, (4, 3)), "b": jnp.zeros((3,))},
      "scale": jax.random.normal(k2, (3,)),
  }


def tree_bytes_equal(a, b) -> bool:
  """Bit-for-bit equality of two pytrees (NaNs included)."""
  la, ta = jax.tree_util.tree_flatten(a)
  lb, tb = jax.tree_util.tree_flatten(b)
  if ta != tb:
    return False
  return all(np.asarray(x).dtype == np.asarray(y).dtype
             and np.asarray(x).tobytes() == np.asarray(y).tobytes()
             for x, y in zip(la, lb))
