"""FP8 matmuls with per-tensor scaling: the hybrid E4M3 / E5M2 recipe.

A matmul in FP8 quantizes its operands to `float8_e4m3fn` (3 mantissa bits,
largest value 448) in the forward pass and the incoming gradient to
`float8_e5m2` (2 mantissa bits, largest value 57344) in the backward pass. Each
tensor gets a float32 *scale* so that its largest magnitude (its *amax*) lands
at the format's largest value: ``x ~= dequantize(quantize(x, s), s)`` with
``quantize(x, s) = saturate(x / s).astype(fp8)`` and ``s = amax / fp8_max``.

The matmul itself is written as quantize -> dequantize (to the compute dtype,
bfloat16 by default) -> `lax.dot_general`. On CPU that simply runs with the
rounded values, so its numerics can be tested anywhere; XLA:GPU on Hopper
recognises the pattern and emits cuBLASLt FP8 GEMMs (`f8e4m3fn x f8e4m3fn`
forward, `f8e5m2 x f8e4m3fn` backward), with the scales folded into the GEMM
and float32 accumulation.

Scaling recipes (`FP8Recipe`):

* ``"current"`` (default): the scale of a tensor is computed from that tensor's
  own amax, in the same step. Needs no state.
* ``"delayed"`` (TransformerEngine's recipe): the scale comes from the largest
  amax of the last ``history_len`` steps, and this step's amax is pushed into
  the history (an all-zero history, on the first step, uses this step's amax).
  The history (`FP8State`) is state the training loop carries.
* ``"rowwise"`` (torchao's rowwise recipe): like current scaling, but each
  GEMM operand gets one scale per row of the GEMM, i.e. per index of the
  dimensions it does not contract (per token of an activation, per output
  feature of a weight), so one outlier costs its row the precision, not the
  whole tensor. The three GEMMs of a matmul contract different dimensions,
  so each quantizes its operands afresh; the GEMMs take the FP8 tensors
  themselves and the scales multiply their float32 results. For
  `dot_general` (and the modules that call it: nnx.Linear,
  nnx.LinearGeneral) only; autocast keeps to current scaling.

How the histories are updated without leaving the jitted step: the gradient
amax is only known in the backward pass, so `dot_general` takes the
histories as an *input* and, through a custom VJP, returns each history's new
value as that input's "gradient". A training step that differentiates with
respect to the histories receives the updated histories among its gradients
and writes them back in place of an optimizer update (Flax's ``fp8_ops`` calls
this "overwrite with gradient"); `jmp_amp.flax.fp8` does that for NNX models.
A history used by more than one matmul in a step would receive the sum of the
new values, so each matmul must own its state.

Non-finite values: saturation clips finite values to the format's range, but
infinities and NaNs pass through (as NaN in E4M3, which has no infinity), so
an overflowing gradient still reaches `jmp_amp.loss_scaling`'s finite check; a
non-finite amax is never written into a history.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

from jmp_amp._src import dtypes as dtypes_lib

E4M3 = np.dtype(jnp.float8_e4m3fn)
E5M2 = np.dtype(jnp.float8_e5m2)
FP8_DTYPES: tuple[np.dtype, ...] = (E4M3, E5M2)
SCALINGS = ("current", "delayed", "rowwise")
# Names that mean "FP8 matmuls" where a dtype or policy name is expected
# (`jmp_amp.autocast`, Flax rules, `make_train_step(autocast=...)`).
FP8_NAMES = ("float8", "fp8", "f8")


def is_fp8_name(value: Any) -> bool:
  """Whether `value` is a str naming FP8 ("float8", "fp8", "f8", any case)."""
  return isinstance(value, str) and value.strip().lower() in FP8_NAMES


def fp8_max(dtype: Any) -> float:
  """The largest finite value of an FP8 dtype (448 for E4M3, 57344 for E5M2).

  Example:
    >>> from jmp_amp._src import fp8
    >>> fp8.fp8_max(jnp.float8_e4m3fn), fp8.fp8_max(jnp.float8_e5m2)
    (448.0, 57344.0)
  """
  dtype = _fp8_dtype(dtype, "dtype")
  return float(jnp.finfo(dtype).max)


def _fp8_dtype(dtype: Any, name: str) -> np.dtype:
  try:
    dt = np.dtype(dtype)
  except TypeError:
    dt = None
  if dt not in FP8_DTYPES:
    raise ValueError(f"{name} must be float8_e4m3fn or float8_e5m2, got "
                     f"{dtype!r}")
  return dt


# --------------------------------------------------------------------------
# Quantization and scales.


def compute_scale(amax: jax.Array, dtype: Any, margin: int = 0) -> jax.Array:
  """The float32 scale that maps `amax` to the format's largest value.

  ``scale = amax * 2**margin / fp8_max(dtype)``; a zero or non-finite `amax`
  gives scale 1 (so an all-zero tensor quantizes to zeros, not NaN).

  Args:
    amax: largest magnitude of the tensor (a float scalar array).
    dtype: the FP8 dtype.
    margin: headroom in powers of two (TransformerEngine's ``margin``).

  Returns:
    A float32 scalar: the value one FP8 unit stands for.
  """
  amax = jnp.asarray(amax, jnp.float32)
  scale = amax * np.float32(2.0 ** margin / fp8_max(dtype))
  ok = jnp.isfinite(amax) & (amax > 0)
  return jnp.where(ok, scale, jnp.ones_like(scale))


def amax(x: jax.Array, axis: Optional[tuple] = None) -> jax.Array:
  """float32 ``max(|x|)`` (the amax of an empty array is 0); inf if `x`
  holds a NaN. With `axis`, the max over those axes, keeping `x`'s rank.

  A NaN counts as inf before the reduction: a max over a sharded `x` combines
  partial maxima across devices, and XLA:CPU's cross-device max (in one
  process or over gloo between processes) drops a NaN, which would record
  the other shards' finite amax instead of the fallback `update_history`
  keeps for an overflowing step. Every max over an inf is inf.
  """
  x = jnp.asarray(x)
  if x.size == 0 and axis is None:
    return jnp.zeros((), jnp.float32)
  a = jnp.abs(x)
  return jnp.max(jnp.where(jnp.isnan(a), jnp.inf, a), axis=axis,
                 keepdims=axis is not None).astype(jnp.float32)


def _tied(x: jax.Array, tie: jax.Array) -> jax.Array:
  """`x` in float32 plus ``0 * tie``: zero for a finite `tie`, which XLA
  cannot fold (0 * inf is NaN), so the quantized operand is this matmul's
  own (see `_fp8_matmul`)."""
  return jnp.asarray(x, jnp.float32) + np.float32(0) * tie.astype(jnp.float32)


def quantize(x: jax.Array, dtype: Any, scale: jax.Array) -> jax.Array:
  """``x / scale`` saturated to the format's range and cast to `dtype`.

  Finite values beyond ``+-fp8_max`` are clipped to it (plain casting would
  give NaN for E4M3, infinity for E5M2); infinities and NaN pass through.

  Example:
    >>> from jmp_amp._src import fp8
    >>> q = fp8.quantize(jnp.array([1.0, 1000.0, -1e6]), jnp.float8_e4m3fn, 1.0)
    >>> q.astype(jnp.float32).tolist()
    [1.0, 448.0, -448.0]
  """
  dtype = _fp8_dtype(dtype, "dtype")
  limit = fp8_max(dtype)
  y = jnp.asarray(x, jnp.float32) / jnp.asarray(scale, jnp.float32)
  y = jnp.where(jnp.isfinite(y), jnp.clip(y, -limit, limit), y)
  return y.astype(dtype)


def dequantize(q: jax.Array, scale: jax.Array,
               dtype: Any = jnp.bfloat16) -> jax.Array:
  """``q * scale`` in `dtype` (the inverse of `quantize`, up to rounding)."""
  dtype = np.dtype(dtype)
  return q.astype(dtype) * jnp.asarray(scale, jnp.float32).astype(dtype)


def update_history(history: jax.Array, new_amax: jax.Array) -> jax.Array:
  """Pushes `new_amax` at index 0 and drops the oldest entry.

  A non-finite `new_amax` (an overflowing step) is recorded as the history's
  largest finite entry instead, so one bad step does not poison the scales.
  """
  new_amax = jnp.asarray(new_amax, history.dtype)
  fallback = jnp.max(jnp.where(jnp.isfinite(history), history, 0))
  new_amax = jnp.where(jnp.isfinite(new_amax), new_amax, fallback)
  return jnp.roll(history, 1).at[0].set(new_amax)


# --------------------------------------------------------------------------
# Recipe and state.


@dataclasses.dataclass(frozen=True)
class FP8Recipe:
  """How FP8 matmuls scale their tensors (static: hashable, not a pytree).

  Attributes:
    scaling: ``"current"`` (scale from this step's amax, the default),
      ``"delayed"`` (scale from the largest amax of the last `history_len`
      steps, TransformerEngine's recipe) or ``"rowwise"`` (current scaling
      with a scale per row of each GEMM operand; `dot_general` only).
    history_len: amax history length per tensor (for ``"current"`` and
      ``"rowwise"`` it only records the last steps' whole-tensor amax for
      monitoring; 1 is enough).
    margin: scales are multiplied by ``2**margin`` (headroom against growth).
    compute_dtype: dtype the quantized operands are dequantized to and the
      matmul returns (bfloat16: the FP8 GEMM's output dtype on GPU).
    fwd_dtype: FP8 dtype of the forward operands.
    bwd_dtype: FP8 dtype of the output gradient.
  """
  scaling: str = "current"
  history_len: int = 1
  margin: int = 0
  compute_dtype: Any = jnp.bfloat16
  fwd_dtype: Any = jnp.float8_e4m3fn
  bwd_dtype: Any = jnp.float8_e5m2

  def __post_init__(self):
    if self.scaling not in SCALINGS:
      raise ValueError(f"scaling must be one of {SCALINGS}, got "
                       f"{self.scaling!r}")
    if (isinstance(self.history_len, bool)
        or not isinstance(self.history_len, (int, np.integer))
        or self.history_len < 1):
      raise ValueError(f"history_len must be an int >= 1, got "
                       f"{self.history_len!r}")
    if (isinstance(self.margin, bool)
        or not isinstance(self.margin, (int, np.integer))):
      raise ValueError(f"margin must be an int, got {self.margin!r}")
    compute = self.compute_dtype
    if isinstance(compute, str):
      compute = dtypes_lib.parse_dtype(compute)
    compute = np.dtype(compute)
    if compute not in dtypes_lib.HALF_DTYPES + (np.dtype(np.float32),):
      raise ValueError(f"compute_dtype must be bfloat16, float16 or float32, "
                       f"got {self.compute_dtype!r}")
    object.__setattr__(self, "compute_dtype", compute)
    object.__setattr__(self, "fwd_dtype",
                       _fp8_dtype(self.fwd_dtype, "fwd_dtype"))
    object.__setattr__(self, "bwd_dtype",
                       _fp8_dtype(self.bwd_dtype, "bwd_dtype"))


def delayed_scaling(history_len: int = 16, margin: int = 0,
                    **kwargs) -> FP8Recipe:
  """TransformerEngine's delayed-scaling recipe with `history_len` steps.

  Example:
    >>> jmp_amp.fp8.delayed_scaling(history_len=4).scaling
    'delayed'
  """
  return FP8Recipe(scaling="delayed", history_len=history_len, margin=margin,
                   **kwargs)


class FP8State(NamedTuple):
  """amax histories of one matmul: operands and output gradient.

  Each is float32 ``[history_len]``, newest first.
  """
  lhs: jax.Array
  rhs: jax.Array
  grad: jax.Array


def init_state(recipe: FP8Recipe = FP8Recipe()) -> FP8State:
  """All-zero histories (the first delayed-scaling step scales currently)."""
  # Three distinct buffers, so that a step can donate all of them.
  return FP8State(*(jnp.zeros((recipe.history_len,), jnp.float32)
                    for _ in FP8State._fields))


def scale_of(x: jax.Array, history: jax.Array, dtype: Any,
             recipe: FP8Recipe) -> tuple[jax.Array, jax.Array]:
  """(scale used for `x`, the updated history) under `recipe`."""
  current = amax(x)
  if recipe.scaling == "current":
    basis = current
  else:
    # An empty (all-zero) history, on the first step, falls back to the
    # current amax rather than scale 1.
    past = jnp.max(history)
    basis = jnp.where(past > 0, past, current)
  return (compute_scale(basis, dtype, recipe.margin),
          update_history(history, current))


# --------------------------------------------------------------------------
# Quantize-dequantize with the history update as the history's "gradient".


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def qdq_operand(recipe: FP8Recipe, x: jax.Array, history: jax.Array,
                tie: jax.Array) -> jax.Array:
  """Forward operand `x` rounded through ``recipe.fwd_dtype``.

  Returns ``dequantize(quantize(x + 0 * tie))`` in ``recipe.compute_dtype``
  (`tie`: a finite float32 scalar of the matmul's other operand, see
  `_fp8_matmul`). The gradient with respect to `x` passes straight through;
  the "gradient" with respect to `history` is the updated history, with
  respect to `tie` zero.
  """
  return _qdq_operand_fwd(recipe, x, history, tie)[0]


def _qdq_operand_fwd(recipe, x, history, tie):
  scale, new_history = scale_of(x, history, recipe.fwd_dtype, recipe)
  q = quantize(_tied(x, tie), recipe.fwd_dtype, scale)
  # Zero-size arrays carry x's and tie's dtypes (residuals must be arrays).
  return (dequantize(q, scale, recipe.compute_dtype),
          (new_history, jnp.zeros((0,), x.dtype), jnp.zeros((0,), tie.dtype)))


def _qdq_operand_bwd(recipe, res, g):
  del recipe
  new_history, like_x, like_tie = res
  return (g.astype(like_x.dtype), new_history,
          jnp.zeros((), like_tie.dtype))


qdq_operand.defvjp(_qdq_operand_fwd, _qdq_operand_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def qdq_output_grad(recipe: FP8Recipe, y: jax.Array,
                    history: jax.Array) -> jax.Array:
  """Identity on `y`; rounds its cotangent through ``recipe.bwd_dtype``.

  The "gradient" with respect to `history` is the updated gradient history.
  """
  del recipe, history
  return y


def _qdq_output_grad_fwd(recipe, y, history):
  del recipe
  return y, history


def _qdq_output_grad_bwd(recipe, history, g):
  scale, new_history = scale_of(g, history, recipe.bwd_dtype, recipe)
  q = quantize(g, recipe.bwd_dtype, scale)
  return dequantize(q, scale, g.dtype), new_history


qdq_output_grad.defvjp(_qdq_output_grad_fwd, _qdq_output_grad_bwd)


def _check_operands(what: str, lhs, rhs) -> tuple[jax.Array, jax.Array]:
  lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
  for name, x in (("lhs", lhs), ("rhs", rhs)):
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"{what} needs floating operands, got {name} of dtype "
                      f"{x.dtype}")
  return lhs, rhs


def _check_state(what: str, state: Optional[FP8State],
                 recipe: FP8Recipe) -> FP8State:
  if not isinstance(recipe, FP8Recipe):
    raise TypeError(f"{what}: recipe must be an FP8Recipe, got {recipe!r}")
  if state is None:
    if recipe.scaling == "delayed":
      raise ValueError(f"{what} with delayed scaling needs state= (an "
                       f"FP8State carried between steps); got None")
    return init_state(recipe)
  for name, h in zip(FP8State._fields, state):
    if jnp.shape(h) != (recipe.history_len,):
      raise ValueError(f"state.{name} must have shape "
                       f"({recipe.history_len},) for history_len="
                       f"{recipe.history_len}, got {jnp.shape(h)}")
  return state


def _fp8_matmul(what: str, op, lhs, rhs, state, recipe,
                preferred_element_type):
  """``op(lhs, rhs)`` on FP8-rounded operands, with an FP8-rounded cotangent.

  `op` is a bilinear matmul (dot_general, a convolution, a two-operand
  einsum) that takes the dequantized operands. Its backward matmuls are
  JAX's transposes of `op`, fed the E5M2-rounded output cotangent.
  """
  lhs, rhs = _check_operands(what, lhs, rhs)
  state = _check_state(what, state, recipe)
  if recipe.scaling == "rowwise":
    raise ValueError(f"{what}: rowwise scaling is implemented for "
                     f"jmp_amp.fp8.dot_general only (nnx.Linear, "
                     f"nnx.LinearGeneral); use current or delayed scaling "
                     f"here")
  # Each operand is quantized with a zero term tied to the other operand's
  # scale. Without it, matmuls that share an operand (q/k/v projections of
  # one input, gate/up of a GLU) quantize it identically; XLA merges the
  # copies (CSE) and then the matmuls into one GEMM whose bf16 operands it
  # no longer recognises as FP8, forward and in the weight gradient.
  lhs_scale = lax.stop_gradient(
      scale_of(lhs, state.lhs, recipe.fwd_dtype, recipe)[0])
  rhs_scale = lax.stop_gradient(
      scale_of(rhs, state.rhs, recipe.fwd_dtype, recipe)[0])
  y = op(qdq_operand(recipe, lhs, state.lhs, rhs_scale),
         qdq_operand(recipe, rhs, state.rhs, lhs_scale))
  y = qdq_output_grad(recipe, y, state.grad)
  if preferred_element_type is not None:
    y = y.astype(preferred_element_type)
  return y


# --------------------------------------------------------------------------
# Rowwise scaling: a scale per row of each GEMM operand.


def _quantize_rows(x: jax.Array, axes: tuple, dtype: np.dtype,
                   tie: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(FP8 `x`, float32 scales) with one scale per index of the axes not in
  `axes` (the scales keep `x`'s rank, size 1 along `axes`); `x` is tied to
  the finite scalar `tie` as in `qdq_operand`."""
  scale = compute_scale(amax(x, axes), dtype)
  return quantize(_tied(x, tie), dtype, scale), scale


def _kept(ndim: int, *dims) -> list[int]:
  return [i for i in range(ndim) if not any(i in d for d in dims)]


def _row_scaled_dot(a, b, dims, dtype_a, dtype_b, **kwargs) -> jax.Array:
  """``dot_general(a, b, dims)`` (float32) on rowwise-quantized operands.

  Each operand is scaled per index of its uncontracted dimensions; the
  GEMM multiplies the FP8 tensors and the outer product of the scales,
  laid out as the result (batch, `a`'s kept, `b`'s kept), rescales it.
  Each operand's quantisation is tied to the other operand (see
  `_fp8_matmul`), so GEMMs sharing an operand stay apart.
  """
  (ac, bc), (ab, bb) = dims
  ak, bk = _kept(a.ndim, ac, ab), _kept(b.ndim, bc, bb)
  tie_a = lax.stop_gradient(compute_scale(amax(b), dtype_b))
  tie_b = lax.stop_gradient(compute_scale(amax(a), dtype_a))
  qa, sa = _quantize_rows(a, tuple(ac), dtype_a, tie_a)
  qb, sb = _quantize_rows(b, tuple(bc), dtype_b, tie_b)
  y = lax.dot_general(qa, qb, dims, preferred_element_type=jnp.float32,
                      **kwargs)
  batch = [a.shape[i] for i in ab]
  sa = jnp.transpose(sa, list(ab) + ak + list(ac)).reshape(
      batch + [a.shape[i] for i in ak] + [1] * len(bk))
  sb = jnp.transpose(sb, list(bb) + bk + list(bc)).reshape(
      batch + [1] * len(ak) + [b.shape[i] for i in bk])
  return y * sa * sb


def _transpose_lhs_dims(dims, lhs_ndim, rhs_ndim, swap_ans=False):
  """(dimension numbers, axes) of the lhs cotangent of ``dot_general(lhs,
  rhs, dims)``: ``transpose(dot_general(g, rhs, dimension numbers), axes)``
  (the transpose rule of `lax.dot_general`)."""
  (xc, yc), (xb, yb) = dims
  xk, yk = _kept(lhs_ndim, xc, xb), _kept(rhs_ndim, yc, yb)
  nb = len(xb)
  if swap_ans:
    ans_y = list(range(nb, nb + len(yk)))
  else:
    ans_y = list(range(nb + len(xk), nb + len(xk) + len(yk)))
  new_dims = ((tuple(ans_y), tuple(yk)), (tuple(range(nb)), tuple(yb)))
  xc_by_y = list(np.take(list(xc), np.argsort(list(yc))))
  axes = tuple(int(i) for i in np.argsort(list(xb) + xk + xc_by_y))
  return new_dims, axes


def _norm_dims(dims) -> tuple:
  (lc, rc), (lb, rb) = dims
  return ((tuple(map(int, lc)), tuple(map(int, rc))),
          (tuple(map(int, lb)), tuple(map(int, rb))))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _rowwise_dot_general(recipe, dims, precision, lhs, rhs, state):
  return _rowwise_fwd(recipe, dims, precision, lhs, rhs, state)[0]


def _rowwise_fwd(recipe, dims, precision, lhs, rhs, state):
  y = _row_scaled_dot(lhs, rhs, dims, recipe.fwd_dtype, recipe.fwd_dtype,
                      precision=precision)
  new = (update_history(state.lhs, amax(lhs)),
         update_history(state.rhs, amax(rhs)))
  return y.astype(recipe.compute_dtype), (lhs, rhs, new, state.grad)


def _rowwise_bwd(recipe, dims, precision, res, g):
  lhs, rhs, (new_lhs, new_rhs), grad_history = res
  fwd, bwd = recipe.fwd_dtype, recipe.bwd_dtype
  # Input gradient: g x rhs, contracting rhs's kept dimensions.
  ldims, laxes = _transpose_lhs_dims(dims, lhs.ndim, rhs.ndim)
  dlhs = jnp.transpose(
      _row_scaled_dot(g, rhs, ldims, bwd, fwd, precision=precision), laxes)
  # Weight gradient: g x lhs, contracting lhs's kept dimensions.
  (lc, rc), (lb, rb) = dims
  rdims, raxes = _transpose_lhs_dims(((rc, lc), (rb, lb)), rhs.ndim,
                                     lhs.ndim, swap_ans=True)
  drhs = jnp.transpose(
      _row_scaled_dot(g, lhs, rdims, bwd, fwd, precision=precision), raxes)
  new_grad = update_history(grad_history, amax(g))
  return (dlhs.astype(lhs.dtype), drhs.astype(rhs.dtype),
          FP8State(new_lhs, new_rhs, new_grad))


_rowwise_dot_general.defvjp(_rowwise_fwd, _rowwise_bwd)


def _sharding_kwargs(out_sharding) -> dict:
  return {} if out_sharding is None else {"out_sharding": out_sharding}


def dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers,
                    precision=None, preferred_element_type=None, *,
                    state: Optional[FP8State] = None,
                    recipe: FP8Recipe = FP8Recipe(),
                    out_sharding=None) -> jax.Array:
  """`lax.dot_general` with FP8 operands forward and FP8 gradients backward.

  Both operands are rounded through ``recipe.fwd_dtype`` (E4M3) with
  per-tensor scales, multiplied in ``recipe.compute_dtype`` (bfloat16) with
  float32 accumulation, and the output's cotangent is rounded through
  ``recipe.bwd_dtype`` (E5M2) before the backward matmuls. The result is
  ``preferred_element_type`` if given, else the compute dtype.

  Example:
    >>> x, w = jnp.ones((2, 3)), jnp.full((3, 4), 0.5)
    >>> y = jmp_amp.fp8.dot_general(x, w, (((1,), (0,)), ((), ())))
    >>> y.dtype, y.tolist()[0]
    (dtype(bfloat16), [1.5, 1.5, 1.5, 1.5])

  Args:
    lhs, rhs, dimension_numbers, precision, preferred_element_type,
      out_sharding: as for `lax.dot_general`.
    state: the amax histories (`FP8State`); its updated value arrives as its
      gradient. Required for delayed scaling; optional for current scaling.
    recipe: the `FP8Recipe`.

  Returns:
    The matmul result.

  Raises:
    ValueError: delayed scaling without a state, or a state whose histories
      do not have ``recipe.history_len`` entries.
    TypeError: non-floating operands.
  """
  if isinstance(recipe, FP8Recipe) and recipe.scaling == "rowwise":
    what = "jmp_amp.fp8.dot_general"
    lhs, rhs = _check_operands(what, lhs, rhs)
    state = _check_state(what, state, recipe)
    y = _rowwise_dot_general(recipe, _norm_dims(dimension_numbers),
                             precision, lhs, rhs, state)
    if out_sharding is not None:
      y = jax.lax.with_sharding_constraint(y, out_sharding)
    return y if preferred_element_type is None else y.astype(
        preferred_element_type)

  def op(a, b):
    return lax.dot_general(a, b, dimension_numbers, precision=precision,
                           **_sharding_kwargs(out_sharding))
  return _fp8_matmul("jmp_amp.fp8.dot_general", op, lhs, rhs, state, recipe,
                     preferred_element_type)


def conv_general_dilated(
    lhs: jax.Array, rhs: jax.Array, window_strides, padding,
    lhs_dilation=None, rhs_dilation=None, dimension_numbers=None,
    feature_group_count: int = 1, batch_group_count: int = 1,
    precision=None, preferred_element_type=None, *,
    state: Optional[FP8State] = None, recipe: FP8Recipe = FP8Recipe(),
    out_sharding=None) -> jax.Array:
  """`lax.conv_general_dilated` with FP8 operands and FP8 gradients.

  The FP8 recipe of `dot_general` applied to a convolution: input and
  kernel rounded through E4M3, the output cotangent through E5M2. Compiled
  for an H100 (XLA:GPU, jax 0.10.2), the forward convolution becomes one
  cuDNN graph convolution (``__cudnn$convForwardGraph``) with
  ``f8e4m3fn`` operands and the scales folded in; see
  ``benchmarks/fp8_h100.py`` for what the backward convolutions become.

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
    The convolution's result (``preferred_element_type`` if given, else the
    recipe's compute dtype).
  """
  def op(a, b):
    return lax.conv_general_dilated(
        a, b, window_strides, padding, lhs_dilation=lhs_dilation,
        rhs_dilation=rhs_dilation, dimension_numbers=dimension_numbers,
        feature_group_count=feature_group_count,
        batch_group_count=batch_group_count, precision=precision,
        **_sharding_kwargs(out_sharding))
  return _fp8_matmul("jmp_amp.fp8.conv_general_dilated", op, lhs, rhs,
                     state, recipe, preferred_element_type)


def einsum(subscripts: str, lhs: jax.Array, rhs: jax.Array, *,
               precision=None, preferred_element_type=None,
               state: Optional[FP8State] = None,
               recipe: FP8Recipe = FP8Recipe(),
               out_sharding=None) -> jax.Array:
  """Two-operand `jnp.einsum` with FP8 operands and FP8 gradients.

  Takes the arguments `nnx.Einsum` passes its ``einsum_op`` knob. The
  einsum's contraction lowers to ``dot_general`` (plus transposes), which
  XLA:GPU turns into FP8 GEMMs like those of `dot_general`.

  Example:
    >>> x, w = jnp.ones((2, 3)), jnp.full((3, 4), 0.5)
    >>> y = jmp_amp.fp8.einsum("ab,bc->ac", x, w)
    >>> y.dtype, y.tolist()[1]
    (dtype(bfloat16), [1.5, 1.5, 1.5, 1.5])

  Args:
    subscripts: the einsum string (two operands).
    lhs, rhs: the operands.
    precision, preferred_element_type, out_sharding: as for `jnp.einsum`.
    state, recipe: as for `dot_general`.

  Returns:
    The einsum's result (``preferred_element_type`` if given, else the
    recipe's compute dtype).

  Raises:
    ValueError: `subscripts` does not name exactly two operands.
  """
  if not isinstance(subscripts, str) or subscripts.split("->")[0].count(
      ",") != 1:
    raise ValueError(f"jmp_amp.fp8.einsum takes a two-operand einsum string "
                     f"such as 'ab,bc->ac', got {subscripts!r}")

  def op(a, b):
    return jnp.einsum(subscripts, a, b, precision=precision,
                      **_sharding_kwargs(out_sharding))
  return _fp8_matmul("jmp_amp.fp8.einsum", op, lhs, rhs, state, recipe,
                     preferred_element_type)


def autocast_dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers,
                         precision=None, preferred_element_type=None,
                         recipe: FP8Recipe = FP8Recipe(),
                         **kwargs) -> jax.Array:
  """Stateless FP8 `dot_general` (current scaling) for op-level autocast.

  Takes the parameters of a ``dot_general`` equation as an autocast pass sees
  them (``fp8.autocast_dot_general(lhs, rhs, **eqn.params)``) and returns the
  recipe's compute dtype (bfloat16), as autocast returns half matmuls: the
  traced ``preferred_element_type`` (float32 for float32 operands) is
  ignored. ``out_sharding`` is forwarded; other parameters are ignored.

  Example:
    >>> from jmp_amp._src import fp8
    >>> x, w = jnp.ones((4, 8)), jnp.ones((8, 3))
    >>> eqn = jax.make_jaxpr(lambda a, b: a @ b)(x, w).eqns[0]
    >>> fp8.autocast_dot_general(x, w, **eqn.params).dtype
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

  ``fp8.autocast_conv_general_dilated(lhs, rhs, **eqn.params)``, the
  convolution counterpart of `autocast_dot_general`: the result is the
  recipe's compute dtype.

  Example:
    >>> from jmp_amp._src import fp8
    >>> x, w = jnp.ones((1, 2, 4, 4)), jnp.ones((3, 2, 3, 3))
    >>> eqn = jax.make_jaxpr(lambda a, b: jax.lax.conv_general_dilated(
    ...     a, b, (1, 1), "SAME"))(x, w).eqns[0]
    >>> fp8.autocast_conv_general_dilated(x, w, **eqn.params).dtype
    dtype(bfloat16)
  """
  del preferred_element_type
  names = ("window_strides", "padding", "lhs_dilation", "rhs_dilation",
           "dimension_numbers", "feature_group_count", "batch_group_count",
           "precision", "out_sharding")
  return conv_general_dilated(
      lhs, rhs, recipe=recipe,
      **{k: params[k] for k in names if k in params})
