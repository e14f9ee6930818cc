"""Casting values and re-binding equations, for the autocast interpreter.

The small pieces that the equation loop (interpreter.py) and the handlers of
higher-order primitives (structural.py) share: dtype tests and casts, the
saturating cast to half, and binding a traced equation's primitive again on
new inputs.
"""

from __future__ import annotations

import functools
from typing import Iterable, Sequence

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from jmp_amp._src import dtypes


def is_float(dtype) -> bool:
  return dtypes.is_float_dtype(dtype)


def dtype_of(x) -> np.dtype:
  return np.dtype(jax.typeof(x).dtype) if not hasattr(x, "dtype") else x.dtype


def _typed_sharding(aval):
  """`aval`'s sharding if its type shards it (`Explicit` mesh axes): a
  function traced again on a struct of it must see it, or its broadcasts
  and selects come out replicated, and mismatched."""
  sharding = getattr(aval, "sharding", None)
  if any(p is not None for p in getattr(sharding, "spec", ())):
    return sharding
  return None


def struct(x) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(np.shape(x), dtype_of(x),
                              sharding=_typed_sharding(jax.typeof(x)))


def aval_struct(aval) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(aval.shape, aval.dtype,
                              sharding=_typed_sharding(aval))


def widest(dts: Iterable[np.dtype]) -> np.dtype:
  return functools.reduce(jnp.promote_types, dts)


def join_dtypes(a: np.dtype, b: np.dtype) -> np.dtype:
  """The wider of two floating dtypes; `a` if either is not floating."""
  if a == b or not (is_float(a) and is_float(b)):
    return a
  return np.dtype(jnp.promote_types(a, b))


def cast(x, dtype):
  """Casts a floating `x` to `dtype`; anything else is returned as is."""
  if is_float(dtype_of(x)) and dtype_of(x) != dtype:
    return lax.convert_element_type(x, dtype)
  return x


def cast_all(xs: Sequence, dts: Sequence[np.dtype]) -> list:
  """Converts each `x` to its floating `dtype`; non-floating ones pass."""
  return [lax.convert_element_type(x, d) if is_float(d) else x
          for x, d in zip(xs, dts)]


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _saturate(x, dtype):
  """`x` with finite values beyond the range of `dtype` at its extremes.

  Infinities and NaN stay as they are, so casting the result to `dtype`
  overflows nothing that was finite. The derivative is one (nothing is saved
  for the backward pass).
  """
  big = np.asarray(jnp.finfo(dtype).max, dtype_of(x))
  return lax.select(lax.is_finite(x), lax.clamp(-big, x, big), x)


@_saturate.defjvp
def _saturate_jvp(dtype, primals, tangents):
  (x,), (t,) = primals, tangents
  return _saturate(x, dtype), t


def narrow(x, dtype: np.dtype, shape: tuple[int, ...]):
  """Casts a floating `x` to `dtype`, saturating where that narrows it.

  A narrowed `x` is broadcast to `shape` (that of the op's result) before the
  cast, so that the backward pass sums its cotangent (a bias gradient) in
  float32.
  """
  if is_float(dtype_of(x)) and dtype_of(x).itemsize > dtype.itemsize:
    x = jnp.broadcast_to(_saturate(x, dtype), shape)
  return cast(x, dtype)


def bind(eqn, invals, params=None) -> list:
  """Binds the primitive of `eqn` on `invals` (with `params`, or its own)."""
  prim = eqn.primitive
  params = eqn.params if params is None else params
  bind_params = prim.get_bind_params(params)
  subfuns = ()
  if isinstance(bind_params, tuple):  # jax < 0.9: (subfuns, params)
    subfuns, bind_params = bind_params
  out = prim.bind(*subfuns, *invals, **bind_params)
  return list(out) if prim.multiple_results else [out]


def bind_as_traced(eqn, invals) -> list:
  """Runs `eqn` on its inputs cast back to the dtypes they were traced with."""
  return bind(eqn, [cast(x, v.aval.dtype) if is_float(v.aval.dtype) else x
                    for x, v in zip(invals, eqn.invars)])


def scan_counts(params) -> tuple[int, int]:
  """(consts, carry) counts of a scan equation's inputs.

  jax < 0.11 names them ``num_consts`` and ``num_carry``; later versions hold
  the inputs' structure as ``ft_in`` = (consts, carry, xs), each iterating
  over its leaves.
  """
  if "num_carry" in params:
    return params["num_consts"], params["num_carry"]
  consts, carry, _ = params["ft_in"].unpack()
  return len(list(consts)), len(list(carry))
