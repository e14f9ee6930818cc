"""Matmul and convolution with float32 results whose backward stays in half.

`lax.dot_general(..., preferred_element_type=jnp.float32)` on bfloat16 or
float16 operands accumulates and returns float32, but JAX's autodiff then
feeds the float32 cotangent into the transposed dots, which promotes the other
operand and runs the whole backward pass in float32: two thirds of the FLOPs.
The ops here return float32 in the forward pass and, through a custom VJP, run
the backward dots/convolutions on half-precision cotangents. The kernels still
accumulate in float32 (as cuBLAS/cuDNN and XLA:CPU do for half inputs).

`dot_general` and `conv_general_dilated` take the arguments of their `jax.lax`
namesakes (``out_sharding`` included), and `einsum` those of `jnp.einsum` for
two operands, so they can be passed as the `dot_general=` /
`conv_general_dilated=` / `einsum_op=` knobs of Flax layers.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from jmp_amp._src.dtypes import HALF_DTYPES


def _freeze(value: Any) -> Any:
  """Lists (e.g. padding pairs) to tuples, so they can be static arguments."""
  if isinstance(value, (list, tuple)):
    return tuple(_freeze(v) for v in value)
  return value


def _half_operands(lhs: jax.Array, rhs: jax.Array) -> bool:
  return lhs.dtype == rhs.dtype and np.dtype(lhs.dtype) in HALF_DTYPES


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _mixed(op, static, acc_dtype, lhs, rhs):
  return op(lhs, rhs, **dict(static), preferred_element_type=acc_dtype)


def _mixed_fwd(op, static, acc_dtype, lhs, rhs):
  return _mixed(op, static, acc_dtype, lhs, rhs), (lhs, rhs)


def _mixed_bwd(op, static, acc_dtype, residuals, g):
  del acc_dtype
  lhs, rhs = residuals
  # Differentiate the half -> half op, so the transposed dots/convs see half
  # operands only.
  _, vjp = jax.vjp(lambda a, b: op(a, b, **dict(static)), lhs, rhs)
  return vjp(g.astype(lhs.dtype))


_mixed.defvjp(_mixed_fwd, _mixed_bwd)


def dot_general(lhs, rhs, dimension_numbers, precision=None,
                preferred_element_type=None, out_sharding=None):
  """`lax.dot_general` that returns float32 for half operands.

  For bfloat16/float16 operands of one dtype, the result is
  `preferred_element_type` (default float32) and the gradient dots run in the
  operand dtype. Other operands go to `lax.dot_general` unchanged.
  ``out_sharding`` goes to the forward and the gradient dots alike.

  Example:
    >>> from flax import nnx
    >>> layer = nnx.Linear(4, 8, dtype=jnp.bfloat16,
    ...                    dot_general=jmp_amp.dot_general, rngs=nnx.Rngs(0))
    >>> layer(jnp.ones((2, 4))).dtype
    dtype('float32')
  """
  lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
  if not _half_operands(lhs, rhs):
    return lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                           preferred_element_type=preferred_element_type,
                           out_sharding=out_sharding)
  acc = jnp.float32 if preferred_element_type is None else preferred_element_type
  static = (("dimension_numbers", _freeze(dimension_numbers)),
            ("precision", _freeze(precision)),
            ("out_sharding", out_sharding))
  return _mixed(lax.dot_general, static, np.dtype(acc), lhs, rhs)


def _einsum2(lhs, rhs, *, subscripts, **kwargs):
  return jnp.einsum(subscripts, lhs, rhs, **kwargs)


def einsum(subscripts, *operands, precision=None, preferred_element_type=None,
           out_sharding=None, **kwargs):
  """`jnp.einsum` that returns float32 for two half operands.

  Same contract as `dot_general`, for a two-operand einsum (other operand
  counts go to `jnp.einsum` unchanged).

  Example:
    >>> from jmp_amp._src.ops import einsum
    >>> a = jnp.ones((2, 3), jnp.bfloat16)
    >>> einsum("ij,jk->ik", a, a.T).dtype
    dtype('float32')
  """
  arrays = [jnp.asarray(o) for o in operands]
  if len(arrays) != 2 or not _half_operands(*arrays):
    return jnp.einsum(subscripts, *operands, precision=precision,
                      preferred_element_type=preferred_element_type,
                      out_sharding=out_sharding, **kwargs)
  acc = jnp.float32 if preferred_element_type is None else preferred_element_type
  static = (("subscripts", subscripts), ("precision", _freeze(precision)),
            ("out_sharding", out_sharding),
            *((k, _freeze(v)) for k, v in sorted(kwargs.items())))
  return _mixed(_einsum2, static, np.dtype(acc), *arrays)


def conv_general_dilated(lhs, rhs, window_strides, padding, lhs_dilation=None,
                         rhs_dilation=None, dimension_numbers=None,
                         feature_group_count=1, batch_group_count=1,
                         precision=None, preferred_element_type=None,
                         out_sharding=None):
  """`lax.conv_general_dilated` that returns float32 for half operands.

  Same contract as `dot_general` above, for convolutions.

  Example:
    >>> x = jnp.ones((1, 8, 3), jnp.float16)
    >>> w = jnp.ones((3, 3, 4), jnp.float16)
    >>> jmp_amp.conv_general_dilated(x, w, (1,), "SAME",
    ...     dimension_numbers=("NWC", "WIO", "NWC")).dtype
    dtype('float32')
  """
  lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
  static = (("window_strides", _freeze(window_strides)),
            ("padding", _freeze(padding)),
            ("lhs_dilation", _freeze(lhs_dilation)),
            ("rhs_dilation", _freeze(rhs_dilation)),
            ("dimension_numbers", dimension_numbers),
            ("feature_group_count", feature_group_count),
            ("batch_group_count", batch_group_count),
            ("precision", _freeze(precision)),
            ("out_sharding", out_sharding))
  if not _half_operands(lhs, rhs):
    return lax.conv_general_dilated(
        lhs, rhs, **dict(static), preferred_element_type=preferred_element_type)
  acc = jnp.float32 if preferred_element_type is None else preferred_element_type
  return _mixed(lax.conv_general_dilated, static, np.dtype(acc), lhs, rhs)
