"""FP8 GEMMs: FP8 operands straight into `lax.dot_general`.

Each GEMM of an FP8 matmul, forward and backward, takes the quantized FP8
tensors themselves (``f8e4m3fn x f8e4m3fn`` forward, ``f8e5m2 x f8e4m3fn``
for the input gradient, ``f8e4m3fn x f8e5m2`` for the weight gradient) with
a float32 result that the operands' scales then multiply. That is the form
every XLA:GPU path keeps FP8: with XLA's default options (Triton GEMMs on)
the GEMM becomes a Triton fusion over the FP8 operands with the scaling in
its epilogue, and where cuBLAS is picked (by the autotuner on a GPU, or
with ``xla_gpu_enable_triton_gemm=false``) a ``__cublas$lt$matmul$f8``
call. The quantize -> dequantize -> bf16 dot pattern that only XLA's cuBLAS
FP8 rewriter recognises is lost under default options: the Triton GEMM
fusion claims the dot first and the dequantized bf16 operands are what it
multiplies.

Per-tensor recipes (current, delayed) quantize each operand once in the
forward pass and keep the FP8 tensors for the backward GEMMs. The rowwise
recipe scales each GEMM operand per index of its uncontracted dimensions,
so every GEMM quantizes its operands afresh.

The amax histories come in as an input and their updated values leave as
that input's "gradient" (see `jmp_amp._src.fp8`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from jmp_amp._src import dot_dims
from jmp_amp._src import fp8 as fp8_lib
from jmp_amp._src.fp8 import FP8Recipe
from jmp_amp._src.fp8 import FP8State


def _gemm(a, b, dims, precision, out_dtype=jnp.float32, out_sharding=None):
  """The FP8 GEMM: FP8 operands, float32 accumulation, an `out_dtype`
  result (laid out `out_sharding` under Explicit axes)."""
  kwargs = {} if out_sharding is None else {"out_sharding": out_sharding}
  return lax.dot_general(a, b, dims, precision=precision,
                         preferred_element_type=out_dtype, **kwargs)


def _scaled_gemm(a, b, dims, precision, scale_a, scale_b, dtype,
                 out_sharding):
  """``dot_general(a, b) * scale_a * scale_b`` as `dtype`.

  The GEMM writes bfloat16 for a bfloat16 result (float32's range, the
  scales fused in its epilogue), else float32: a float16 GEMM output would
  overflow on the scaled operands' products (up to 448 x 448 each), and a
  float32 result is accumulated, written and scaled in float32 (rounded
  once). The scales multiply one after the other in float32, so that two
  small scales do not flush to zero as their product would.
  """
  gemm_dtype = dtype if dtype == jnp.bfloat16 else np.dtype(np.float32)
  y = _gemm(a, b, dims, precision, gemm_dtype, out_sharding)
  return (y.astype(jnp.float32) * scale_a * scale_b).astype(dtype)


# --------------------------------------------------------------------------
# Per-tensor scaling (current, delayed).


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _tensor_scaled(recipe, dims, precision, out_sharding, out_dtype, lhs, rhs,
                   state):
  return _tensor_fwd(recipe, dims, precision, out_sharding, out_dtype, lhs,
                     rhs, state)[0]


def _tensor_fwd(recipe, dims, precision, out_sharding, out_dtype, lhs, rhs,
                state):
  fwd = recipe.fwd_dtype
  lhs_scale, new_lhs = fp8_lib.scale_of(lhs, state.lhs, fwd, recipe)
  rhs_scale, new_rhs = fp8_lib.scale_of(rhs, state.rhs, fwd, recipe)
  q_lhs = fp8_lib.quantize(lhs, fwd, lhs_scale)
  q_rhs = fp8_lib.quantize(rhs, fwd, rhs_scale)
  y = _scaled_gemm(q_lhs, q_rhs, dims, precision, lhs_scale, rhs_scale,
                   out_dtype, out_sharding)
  res = (q_lhs, lhs_scale, q_rhs, rhs_scale, new_lhs, new_rhs, state.grad,
         jnp.zeros((0,), lhs.dtype), jnp.zeros((0,), rhs.dtype))
  return y, res


def _tensor_bwd(recipe, dims, precision, out_sharding, out_dtype, res, g):
  del out_sharding, out_dtype
  (q_lhs, lhs_scale, q_rhs, rhs_scale, new_lhs, new_rhs, grad_history,
   like_lhs, like_rhs) = res
  g_scale, new_grad = fp8_lib.scale_of(g, grad_history, recipe.bwd_dtype,
                                       recipe)
  q_g = fp8_lib.quantize(g, recipe.bwd_dtype, g_scale)
  (ldims, laxes), (rdims, raxes) = dot_dims.grad_dims(dims, q_lhs.ndim,
                                                      q_rhs.ndim)
  dlhs = _scaled_gemm(q_g, q_rhs, ldims, precision, g_scale, rhs_scale,
                      like_lhs.dtype, dot_dims.grad_sharding(q_lhs, laxes))
  drhs = _scaled_gemm(q_lhs, q_g, rdims, precision, lhs_scale, g_scale,
                      like_rhs.dtype, dot_dims.grad_sharding(q_rhs, raxes))
  dlhs, drhs = jnp.transpose(dlhs, laxes), jnp.transpose(drhs, raxes)
  return dlhs, drhs, fp8_lib.FP8State(new_lhs, new_rhs, new_grad)


_tensor_scaled.defvjp(_tensor_fwd, _tensor_bwd)


# --------------------------------------------------------------------------
# Rowwise scaling: a scale per row of each GEMM operand.


def _row_scaled_dot(a, b, dims, dtype_a, dtype_b, margin, precision,
                    out_sharding=None):
  """``dot_general(a, b, dims)`` (float32) on rowwise-quantized operands,
  and the whole-tensor amax of `a` and `b`.

  Each operand gets one scale per index of the axes it does not contract
  (the scales keep its rank, size 1 along the contracted axes). The GEMM
  multiplies the FP8 tensors; the outer product of the scales, laid out as
  the result (batch, `a`'s kept, `b`'s kept), rescales it. The whole-tensor
  amaxes, for the histories, are the largest row amaxes.
  """
  (ac, bc), (ab, bb) = dims
  ak, bk = dot_dims.kept(a.ndim, ac, ab), dot_dims.kept(b.ndim, bc, bb)
  row_a, row_b = fp8_lib.amax(a, tuple(ac)), fp8_lib.amax(b, tuple(bc))
  amax_a, amax_b = jnp.max(row_a), jnp.max(row_b)
  sa = fp8_lib.compute_scale(row_a, dtype_a, margin)
  sb = fp8_lib.compute_scale(row_b, dtype_b, margin)
  qa = fp8_lib.quantize(a, dtype_a, sa)
  qb = fp8_lib.quantize(b, dtype_b, sb)
  y = _gemm(qa, qb, dims, precision, out_sharding=out_sharding)
  batch = [a.shape[i] for i in ab]
  sa = jnp.transpose(sa, list(ab) + ak + list(ac)).reshape(
      batch + [a.shape[i] for i in ak] + [1] * len(bk))
  sb = jnp.transpose(sb, list(bb) + bk + list(bc)).reshape(
      batch + [1] * len(ak) + [b.shape[i] for i in bk])
  return y * dot_dims.like(sa, y) * dot_dims.like(sb, y), amax_a, amax_b


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _row_scaled(recipe, dims, precision, out_sharding, out_dtype, lhs, rhs,
                state):
  return _row_fwd(recipe, dims, precision, out_sharding, out_dtype, lhs, rhs,
                  state)[0]


def _row_fwd(recipe, dims, precision, out_sharding, out_dtype, lhs, rhs,
             state):
  fwd = recipe.fwd_dtype
  y, lhs_amax, rhs_amax = _row_scaled_dot(lhs, rhs, dims, fwd, fwd,
                                          recipe.margin, precision,
                                          out_sharding)
  new = (fp8_lib.update_history(state.lhs, lhs_amax),
         fp8_lib.update_history(state.rhs, rhs_amax))
  return y.astype(out_dtype), (lhs, rhs, new, state.grad)


def _row_bwd(recipe, dims, precision, out_sharding, out_dtype, res, g):
  del out_sharding, out_dtype
  lhs, rhs, (new_lhs, new_rhs), grad_history = res
  fwd, bwd, margin = recipe.fwd_dtype, recipe.bwd_dtype, recipe.margin
  (ldims, laxes), (rdims, raxes) = dot_dims.grad_dims(dims, lhs.ndim, rhs.ndim)
  dlhs, g_amax, _ = _row_scaled_dot(g, rhs, ldims, bwd, fwd, margin,
                                     precision,
                                     dot_dims.grad_sharding(lhs, laxes))
  drhs = _row_scaled_dot(lhs, g, rdims, fwd, bwd, margin, precision,
                         dot_dims.grad_sharding(rhs, raxes))[0]
  dlhs, drhs = jnp.transpose(dlhs, laxes), jnp.transpose(drhs, raxes)
  new_grad = fp8_lib.update_history(grad_history, g_amax)
  return (dlhs.astype(lhs.dtype), drhs.astype(rhs.dtype),
          fp8_lib.FP8State(new_lhs, new_rhs, new_grad))


_row_scaled.defvjp(_row_fwd, _row_bwd)


# Each scaled matmul is one jitted call, traced once per signature: a model's
# repeated layers reuse the trace (side by side, a 16-block GPT's FP8 step
# traced and lowered in 0.5 s less, rowwise in 1 s less, on XLA:CPU). XLA
# inlines the calls, naming each op under its call's scope, so the audit
# still finds each FP8 GEMM's layer ("fp8[<path>]").
_once = functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4))
_tensor_once = _once(_tensor_scaled)
_row_once = _once(_row_scaled)


def _constrain(y, out_sharding):
  """`y` laid out as `out_sharding` under Auto axes (a sharding
  constraint); under Explicit axes the GEMM took it already."""
  if out_sharding is None or dot_dims.explicit_out(out_sharding):
    return y
  return lax.with_sharding_constraint(y, out_sharding)


def _out_dtype(what, preferred_element_type, recipe) -> np.dtype:
  if preferred_element_type is None:
    return recipe.compute_dtype
  dtype = np.dtype(preferred_element_type)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(f"{what}: preferred_element_type must be a floating "
                    f"dtype (the FP8 GEMMs accumulate in float32), got "
                    f"{preferred_element_type!r}")
  return dtype


def _scaled_dot(what, lhs, rhs, dims, precision, preferred_element_type,
                state, recipe, out_sharding):
  lhs, rhs = fp8_lib.check_operands(what, lhs, rhs)
  state = fp8_lib.check_state(what, state, recipe)
  out_dtype = _out_dtype(what, preferred_element_type, recipe)
  impl = _row_once if recipe.scaling == "rowwise" else _tensor_once
  gemm_sharding = out_sharding if dot_dims.explicit_out(out_sharding) else None
  y = impl(recipe, dot_dims.norm_dims(dims), precision, gemm_sharding,
           out_dtype, lhs, rhs, state)
  return _constrain(y, out_sharding)


# --------------------------------------------------------------------------
# The public ops.


def dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers,
                precision=None, preferred_element_type=None, *,
                state: Optional[FP8State] = None,
                recipe: FP8Recipe = FP8Recipe(),
                out_sharding=None) -> jax.Array:
  """`lax.dot_general` with FP8 operands forward and FP8 gradients backward.

  Both operands are quantized to ``recipe.fwd_dtype`` (E4M3) with their
  scales (per tensor, or per row for ``scaling="rowwise"``), the GEMM
  multiplies the FP8 tensors with float32 accumulation, and the output's
  cotangent is quantized to ``recipe.bwd_dtype`` (E5M2) for the backward
  GEMMs. The result is ``preferred_element_type`` if given, else the
  recipe's compute dtype (bfloat16). For a bfloat16 result the GEMM writes
  bfloat16 and the scales multiply that; for any other (float32, float16)
  it writes float32, the scales multiply in float32, and the product is
  rounded once to the result's dtype. The backward GEMMs are FP8 whatever
  the result's dtype; each gradient has its operand's dtype.

  Example:
    >>> x, w = jnp.ones((2, 3)), jnp.full((3, 4), 0.5)
    >>> y = jmp_amp.fp8.dot_general(x, w, (((1,), (0,)), ((), ())))
    >>> y.dtype, y.tolist()[0]
    (dtype(bfloat16), [1.5, 1.5, 1.5, 1.5])

  Args:
    lhs, rhs, dimension_numbers, precision, preferred_element_type,
      out_sharding: as for `lax.dot_general` (under Explicit mesh axes
      the GEMM writes `out_sharding`, and each gradient keeps its
      operand's sharding).
    state: the amax histories (`FP8State`); its updated value arrives as its
      gradient. Required for delayed scaling; optional otherwise.
    recipe: the `FP8Recipe`.

  Returns:
    The matmul result.

  Raises:
    ValueError: delayed scaling without a state, or a state whose histories
      do not have ``recipe.history_len`` entries.
    TypeError: non-floating operands or ``preferred_element_type``.
  """
  return _scaled_dot("jmp_amp.fp8.dot_general", lhs, rhs, dimension_numbers,
                     precision, preferred_element_type, state, recipe,
                     out_sharding)


def einsum(subscripts: str, lhs: jax.Array, rhs: jax.Array, *,
           precision=None, preferred_element_type=None,
           state: Optional[FP8State] = None,
           recipe: FP8Recipe = FP8Recipe(),
           out_sharding=None) -> jax.Array:
  """Two-operand `jnp.einsum` with FP8 operands and FP8 gradients.

  Takes the arguments `nnx.Einsum` passes its ``einsum_op`` knob. The
  einsum is one FP8 `dot_general` (indices in both operands and the output
  are batch dimensions, in both operands only contracted) followed by a
  transpose, under any recipe, rowwise included.

  Example:
    >>> x, w = jnp.ones((2, 3)), jnp.full((3, 4), 0.5)
    >>> y = jmp_amp.fp8.einsum("ab,bc->ac", x, w)
    >>> y.dtype, y.tolist()[1]
    (dtype(bfloat16), [1.5, 1.5, 1.5, 1.5])

  Args:
    subscripts: the einsum string (two operands; ``...`` allowed).
    lhs, rhs: the operands.
    precision, preferred_element_type, out_sharding: as for `jnp.einsum`.
    state, recipe: as for `dot_general`.

  Returns:
    The einsum's result (``preferred_element_type`` if given, else the
    recipe's compute dtype).

  Raises:
    ValueError: `subscripts` does not name exactly two operands of these
      ranks, or takes a diagonal.
  """
  if not isinstance(subscripts, str):
    raise ValueError(f"jmp_amp.fp8.einsum takes a two-operand einsum string "
                     f"such as 'ab,bc->ac', got {subscripts!r}")
  lhs, rhs = fp8_lib.check_operands("jmp_amp.fp8.einsum", lhs, rhs)
  lhs_sum, rhs_sum, dims, perm = dot_dims.einsum_as_dot_general(
      subscripts, lhs.shape, rhs.shape)
  if lhs_sum:
    lhs = jnp.sum(lhs, axis=lhs_sum)
  if rhs_sum:
    rhs = jnp.sum(rhs, axis=rhs_sum)
  gemm_sharding = None
  if dot_dims.explicit_out(out_sharding):
    gemm_sharding = dot_dims.permuted(out_sharding, perm)
  y = _scaled_dot("jmp_amp.fp8.einsum", lhs, rhs, dims, precision,
                  preferred_element_type, state, recipe, gemm_sharding)
  y = jnp.transpose(y, perm)
  return _constrain(y, out_sharding)


def conv_general_dilated(
    lhs: jax.Array, rhs: jax.Array, window_strides, padding,
    lhs_dilation=None, rhs_dilation=None, dimension_numbers=None,
    feature_group_count: int = 1, batch_group_count: int = 1,
    precision=None, preferred_element_type=None, *,
    state: Optional[FP8State] = None, recipe: FP8Recipe = FP8Recipe(),
    out_sharding=None) -> jax.Array:
  """`lax.conv_general_dilated` with FP8 operands and FP8 gradients.

  The FP8 recipe of `dot_general` applied to a convolution: input and
  kernel rounded through E4M3, the output cotangent through E5M2, written
  as quantize -> dequantize -> convolution. Compiled for an H100 (XLA:GPU),
  the forward convolution becomes one cuDNN graph convolution
  (``__cudnn$convForwardGraph``) with ``f8e4m3fn`` operands and the scales
  folded in; see ``benchmarks/fp8_h100.py`` for the backward convolutions.
  Per-tensor recipes only (current, delayed).

  Example:
    >>> x, w = jnp.ones((1, 2, 4, 4)), jnp.full((3, 2, 3, 3), 0.5)
    >>> y = jmp_amp.fp8.conv_general_dilated(x, w, (1, 1), "VALID")
    >>> y.dtype, y.shape, float(y[0, 0, 0, 0])
    (dtype(bfloat16), (1, 3, 2, 2), 9.0)

  Args:
    lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation,
      dimension_numbers, feature_group_count, batch_group_count, precision,
      preferred_element_type, out_sharding: as for
      `lax.conv_general_dilated`.
    state, recipe: as for `dot_general`.

  Returns:
    The convolution's result, computed in the recipe's compute dtype
    (bfloat16; so are the backward convolutions) and then cast to
    ``preferred_element_type`` if given: unlike `dot_general`, a float32
    ``preferred_element_type`` does not make the convolution accumulate
    and write float32 (its backward convolutions would then run in
    float32 too).

  Raises:
    ValueError: a rowwise recipe (convolutions scale per tensor).
  """
  what = "jmp_amp.fp8.conv_general_dilated"
  lhs, rhs = fp8_lib.check_operands(what, lhs, rhs)
  state = fp8_lib.check_state(what, state, recipe)
  if recipe.scaling == "rowwise":
    raise ValueError(f"{what}: rowwise scaling is for dot_general and "
                     f"einsum (nnx.Linear, nnx.LinearGeneral, nnx.Einsum); "
                     f"use FP8Recipe(scaling='current') or 'delayed' for a "
                     f"convolution")
  kwargs = {} if out_sharding is None else {"out_sharding": out_sharding}
  y = lax.conv_general_dilated(
      fp8_lib.qdq_operand(recipe, lhs, state.lhs),
      fp8_lib.qdq_operand(recipe, rhs, state.rhs),
      window_strides, padding, lhs_dilation=lhs_dilation,
      rhs_dilation=rhs_dilation, dimension_numbers=dimension_numbers,
      feature_group_count=feature_group_count,
      batch_group_count=batch_group_count, precision=precision, **kwargs)
  y = fp8_lib.qdq_output_grad(recipe, y, state.grad)
  return y.astype(_out_dtype(what, preferred_element_type, recipe))
def autocast_dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers,
                         precision=None, preferred_element_type=None,
                         recipe: FP8Recipe = FP8Recipe(),
                         **kwargs) -> jax.Array:
  """Stateless FP8 `dot_general` (current or rowwise) for op-level autocast.

  Takes the parameters of a ``dot_general`` equation as an autocast pass sees
  them (``fp8_ops.autocast_dot_general(lhs, rhs, **eqn.params)``) and returns the
  recipe's compute dtype (bfloat16), as autocast returns half matmuls: the
  traced ``preferred_element_type`` (float32 for float32 operands) is
  ignored. ``out_sharding`` is forwarded; other parameters are ignored.

  Example:
    >>> from jmp_amp._src import fp8_ops
    >>> x, w = jnp.ones((4, 8)), jnp.ones((8, 3))
    >>> eqn = jax.make_jaxpr(lambda a, b: a @ b)(x, w).eqns[0]
    >>> fp8_ops.autocast_dot_general(x, w, **eqn.params).dtype
    dtype(bfloat16)
  """
  del preferred_element_type
  return dot_general(lhs, rhs, dimension_numbers, precision=precision,
                     recipe=recipe, out_sharding=kwargs.get("out_sharding"))


def autocast_conv_general_dilated(lhs: jax.Array, rhs: jax.Array, *,
                                  recipe: FP8Recipe = FP8Recipe(),
                                  preferred_element_type=None,
                                  **params) -> jax.Array:
  """Stateless FP8 convolution from a ``conv_general_dilated`` equation.

  ``fp8_ops.autocast_conv_general_dilated(lhs, rhs, **eqn.params)``, the
  convolution counterpart of `autocast_dot_general`: the result is the
  recipe's compute dtype. Under a rowwise recipe the convolution scales per
  tensor (current scaling).

  Example:
    >>> from jmp_amp._src import fp8_ops
    >>> x, w = jnp.ones((1, 2, 4, 4)), jnp.ones((3, 2, 3, 3))
    >>> eqn = jax.make_jaxpr(lambda a, b: jax.lax.conv_general_dilated(
    ...     a, b, (1, 1), "SAME"))(x, w).eqns[0]
    >>> fp8_ops.autocast_conv_general_dilated(x, w, **eqn.params).dtype
    dtype(bfloat16)
  """
  del preferred_element_type
  if recipe.scaling == "rowwise":  # Convolutions scale per tensor.
    recipe = dataclasses.replace(recipe, scaling="current")
  names = ("window_strides", "padding", "lhs_dilation", "rhs_dilation",
           "dimension_numbers", "feature_group_count", "batch_group_count",
           "precision", "out_sharding")
  return conv_general_dilated(
      lhs, rhs, recipe=recipe,
      **{k: params[k] for k in names if k in params})
