"""FP8 matmuls with per-tensor scaling: the hybrid E4M3 / E5M2 recipe.

A matmul in FP8 quantizes its operands to `float8_e4m3fn` (3 mantissa bits,
largest value 448) in the forward pass and the incoming gradient to
`float8_e5m2` (2 mantissa bits, largest value 57344) in the backward pass. Each
tensor gets a float32 *scale* so that its largest magnitude (its *amax*) lands
at the format's largest value: ``x ~= dequantize(quantize(x, s), s)`` with
``quantize(x, s) = saturate(x / s).astype(fp8)`` and ``s = amax / fp8_max``.

The GEMMs take the FP8 tensors themselves (`jmp_amp._src.fp8_ops`):
``lax.dot_general`` of FP8 operands with a float32 result that the scales
multiply. XLA:GPU on Hopper keeps that an FP8 GEMM, a Triton GEMM over the
FP8 operands or cuBLAS's (``__cublas$lt$matmul$f8``): ``f8e4m3fn x f8e4m3fn``
forward, ``f8e5m2 x f8e4m3fn`` and ``f8e4m3fn x f8e5m2`` backward, with
float32 accumulation. On a real H200 under XLA's default options the
autotuner chose cuBLAS for every FP8 GEMM of the benchmarks, after timing
Triton configurations for a minute or two per step;
`jmp_amp._src.fp8_compile.compiler_options` gives the options that skip
that. On CPU the
same program runs with the rounded values, so its numerics can be tested
anywhere.
Convolutions keep the quantize -> dequantize pattern that cuDNN's graph
convolution recognises.

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
from jax import lax
import jax.numpy as jnp
import numpy as np

from jmp_amp._src import dtypes as dtypes_lib

E4M3 = np.dtype(jnp.float8_e4m3fn)
E5M2 = np.dtype(jnp.float8_e5m2)
FP8_DTYPES: tuple[np.dtype, ...] = (E4M3, E5M2)
SCALINGS = ("current", "delayed", "rowwise")
MAX_MARGIN = 16
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

  ``scale = amax * 2**margin / fp8_max(dtype)``, at least float32's
  smallest normal number (a smaller scale would be subnormal, which XLA:CPU
  flushes to zero, and the tensor would quantize to NaN); a zero or
  non-finite `amax` gives scale 1 (so an all-zero tensor quantizes to
  zeros, not NaN).

  Args:
    amax: largest magnitude of the tensor (a float scalar array).
    dtype: the FP8 dtype.
    margin: headroom in powers of two (TransformerEngine's ``margin``).

  Returns:
    A float32 scalar: the value one FP8 unit stands for.
  """
  amax = jnp.asarray(amax, jnp.float32)
  scale = lax.max(amax * np.float32(2.0 ** margin / fp8_max(dtype)),
                  np.float32(np.finfo(np.float32).tiny))
  ok = lax.is_finite(amax) & (amax > 0)
  # lax.select, not jnp.where: no nested jit per call (compile time).
  return lax.select(ok, scale, jnp.ones_like(scale))


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
  a = lax.select(jnp.isnan(a), jnp.full_like(a, jnp.inf), a)
  return jnp.max(a, axis=axis, keepdims=axis is not None).astype(jnp.float32)


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
  clipped = lax.clamp(np.float32(-limit), y, np.float32(limit))
  return lax.select(lax.is_finite(y), clipped, y).astype(dtype)


def dequantize(q: jax.Array, scale: jax.Array,
               dtype: Any = jnp.bfloat16) -> jax.Array:
  """``q * scale`` in `dtype` (the inverse of `quantize`, up to rounding).

  Multiplied in bfloat16 for bfloat16 (the pattern cuDNN's FP8 convolution
  recognises), else in float32: a small scale is zero in float16.
  """
  dtype = np.dtype(dtype)
  scale = jnp.asarray(scale, jnp.float32)
  if dtype == jnp.bfloat16:
    return q.astype(dtype) * scale.astype(dtype)
  return (q.astype(jnp.float32) * scale).astype(dtype)


def update_history(history: jax.Array, new_amax: jax.Array) -> jax.Array:
  """Pushes `new_amax` at index 0 and drops the oldest entry.

  A non-finite `new_amax` (an overflowing step) is recorded as the history's
  largest finite entry instead, so one bad step does not poison the scales.
  """
  new_amax = jnp.asarray(new_amax, history.dtype)
  finite = lax.select(lax.is_finite(history), history,
                      jnp.zeros_like(history))
  new_amax = lax.select(lax.is_finite(new_amax), new_amax, jnp.max(finite))
  return jnp.concatenate([new_amax[None], history[:-1]])


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
    compute_dtype: dtype the matmul returns (bfloat16, the FP8 GEMM's
      output dtype on GPU; for float16 or float32 the GEMM writes float32
      and the scaled result is rounded once) and the convolutions compute
      in.
    fwd_dtype: FP8 dtype of the forward operands.
    bwd_dtype: FP8 dtype of the output gradient.

  Example (TransformerEngine's delayed scaling over the last 16 steps):
    >>> recipe = jmp_amp.fp8.FP8Recipe(scaling="delayed", history_len=16)
    >>> recipe.scaling, recipe.history_len, recipe.compute_dtype
    ('delayed', 16, dtype(bfloat16))
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
        or not isinstance(self.margin, (int, np.integer))
        or not 0 <= self.margin <= MAX_MARGIN):
      # A negative margin saturates the largest values on purpose; past
      # ~16 the values sink into E4M3's subnormals, past 127 2**margin is
      # not a float32.
      raise ValueError(f"margin must be an int from 0 to {MAX_MARGIN} "
                       f"(headroom in powers of two), got {self.margin!r}")
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


class FP8State(NamedTuple):
  """amax histories of one matmul: operands and output gradient.

  Each is float32 ``[history_len]``, newest first; all zeros to start (the
  first delayed-scaling step then scales from the current amax).

  Example:
    >>> x, w = jnp.ones((2, 3)), jnp.full((3, 4), 0.5)
    >>> state = jmp_amp.fp8.FP8State(*(jnp.zeros(4) for _ in range(3)))
    >>> recipe = jmp_amp.fp8.FP8Recipe(scaling="delayed", history_len=4)
    >>> grad_fn = jax.grad(lambda s: jmp_amp.fp8.dot_general(
    ...     x, w, (((1,), (0,)), ((), ())), state=s, recipe=recipe).sum())
    >>> grad_fn(state).rhs.tolist()  # the new history: the "gradient"
    [0.5, 0.0, 0.0, 0.0]
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
    basis = lax.select(past > 0, past, current)
  return (compute_scale(basis, dtype, recipe.margin),
          update_history(history, current))


# --------------------------------------------------------------------------
# Quantize-dequantize with the history update as the history's "gradient".


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def qdq_operand(recipe: FP8Recipe, x: jax.Array,
                history: jax.Array) -> jax.Array:
  """Forward operand `x` rounded through ``recipe.fwd_dtype``.

  Returns ``dequantize(quantize(x))`` in ``recipe.compute_dtype``. The
  gradient with respect to `x` passes straight through; the "gradient"
  with respect to `history` is the updated history. Used by the FP8
  convolution, whose quantize -> dequantize pattern cuDNN's graph
  convolution recognises.
  """
  return _qdq_operand_fwd(recipe, x, history)[0]


def _qdq_operand_fwd(recipe, x, history):
  scale, new_history = scale_of(x, history, recipe.fwd_dtype, recipe)
  q = quantize(x, recipe.fwd_dtype, scale)
  # A zero-size array carries x's dtype (residuals must be arrays).
  return (dequantize(q, scale, recipe.compute_dtype),
          (new_history, jnp.zeros((0,), x.dtype)))


def _qdq_operand_bwd(recipe, res, g):
  del recipe
  new_history, like_x = res
  return g.astype(like_x.dtype), new_history


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


def check_operands(what: str, lhs, rhs) -> tuple[jax.Array, jax.Array]:
  lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
  for name, x in (("lhs", lhs), ("rhs", rhs)):
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"{what} needs floating operands, got {name} of dtype "
                      f"{x.dtype}")
  return lhs, rhs


def check_state(what: str, state: Optional[FP8State],
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
