"""Shared fixtures and helpers for the jmp_amp test suite."""

import jax
import jax.numpy as jnp
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
