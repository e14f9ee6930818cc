"""Op-level autocast: `torch.autocast` semantics for any JAX function.

`autocast(fn, policy)` traces `fn` to a jaxpr and evaluates that jaxpr again,
equation by equation, under the current JAX trace (so the result composes with
`jit`, `grad`, `jvp`, `vmap` and `checkpoint`), choosing the dtype of each
primitive from `AutocastRules`:

* half list (`dot_general`, `conv_general_dilated`): floating inputs are cast
  to the policy's compute dtype and the result is that dtype, as torch's
  autocast returns half matmuls. Half GEMMs accumulate in float32 (cuBLAS,
  cuDNN, TPU and XLA:CPU all do), and as the result is half, the cotangents
  of the backward pass are half too: the backward GEMMs stay in half. A matmul
  whose operands were already half when traced runs as written (keeping its
  preferred_element_type): that makes autocast idempotent. With
  ``"float8"`` the float32 matmuls run in FP8 instead (E4M3 operands, E5M2
  gradients, bfloat16 results; see `autocast`).
* float32 list (exp, log, reductions, cumulative sums, rsqrt, pow, erf, ...):
  floating inputs are cast to float32 and the op runs and returns float32.
  Softmax, log-softmax, logsumexp, norm statistics and losses decompose into
  these, so they cannot overflow float16.
* keep-half list (`add`): when an input is a half value that autocast made
  (traced as float32, e.g. a matmul's result), float32 inputs are cast to the
  compute dtype and the op runs in half; otherwise it promotes. A bias or a
  residual added to a half matmul's result therefore stays half, like the
  bias of torch's half `addmm`, and so do the activations between layers.
  The cast saturates finite values at the half range (a `-1e9` or
  `finfo(float32).min` mask stays finite; inf and NaN stay as they are) and
  comes after broadcasting, so a bias gradient is summed in float32.
  Subtractions promote: softmax's `x - max(x)` and a norm's `x - mean(x)`
  stay float32.
* promote list (elementwise arithmetic, comparisons, data movement): floating
  inputs are cast to the widest floating dtype among them and the op runs in
  that dtype. Scalar literals and weakly typed inputs (Python scalars such as
  the `2.0` in `x * 2.0`) do not take part, as in JAX's own type promotion.

Primitives on none of the lists run "as traced": their inputs are cast back to
the dtypes they had when `fn` was traced. That is always valid, so primitives
this module does not know (Pallas kernels, callbacks, custom calls) keep
working. Explicit casts written in `fn` (`x.astype(jnp.float32)`) are honoured.

Choices where torch gives no direct answer: `integer_pow` and `square` are
float32 ops (torch's `pow`); `sqrt`, `div`, `tanh` and `logistic` promote
(torch lists only `rsqrt` and `reciprocal`); `argmax`/`argmin` are float32 ops
(harmless: same result). float64 values are never narrowed.

Known limitations:
  * Array constants built in `fn` (`jnp.full`, `jnp.finfo(x.dtype).min`
    broadcast) are float32 values; only scalar literals and weakly typed
    values do not widen a half operand of a promote op.
  * `jit` boundaries inside `fn` are inlined; the whole result can be jitted.
  * `fn` is retraced on every call: wrap the autocast function in `jax.jit`.
  * custom_jvp/custom_vjp functions with integer inputs or outputs, and
    primitives on no list, run in their traced dtypes.
  * As under `jax.grad(jax.jit(fn))`, a custom_vjp whose fwd or bwd closes
    over a value derived from the arguments of `fn` cannot be differentiated:
    pass such values to it as arguments, or use `jax.closure_convert`.

Example:
  >>> import jax, jax.numpy as jnp, jmp_amp
  >>> def loss_fn(params, x):
  ...   logits = x @ params["w"] + params["b"]
  ...   return -jax.nn.log_softmax(logits).mean()
  >>> params = {"w": jnp.ones((4, 3)), "b": jnp.zeros(3)}
  >>> x = jnp.ones((2, 4))
  >>> amp_loss = jmp_amp.autocast(loss_fn, "p=f32,c=bf16,o=f32")
  >>> grads = jax.jit(jax.grad(amp_loss))(params, x)  # bf16 dots, f32 grads
  >>> grads["w"].dtype, amp_loss(params, x).dtype
  (dtype('float32'), dtype('float32'))
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import jax
from jax import lax
from jax.lax import linalg as lax_linalg
import jax.extend.core as jex_core
from jax.extend.core import primitives as jex_primitives
import jax.extend.source_info_util as source_info_util
import jax.numpy as jnp
import numpy as np

from jmp_amp._src import dtypes
from jmp_amp._src import fp8 as fp8_lib
from jmp_amp._src.policy import get_policy
from jmp_amp._src.policy import Policy

_F32 = np.dtype(np.float32)
_HALF_DTYPES = dtypes.HALF_DTYPES

PrimitiveLike = Union[str, jex_core.Primitive]

# --------------------------------------------------------------------------
# Rules.
# --------------------------------------------------------------------------

_DEFAULT_HALF = ("dot_general", "conv_general_dilated")

_DEFAULT_FLOAT32 = (
    # Exponentials, logarithms and powers: overflow or lose accuracy in half.
    "exp", "exp2", "expm1", "log", "log1p", "pow", "integer_pow", "square",
    "rsqrt", "tan", "sinh", "cosh", "asin", "acos",
    # Special functions.
    "erf", "erfc", "erf_inv", "lgamma", "digamma", "polygamma", "igamma",
    "igammac", "igamma_grad_a", "zeta", "bessel_i0e", "bessel_i1e",
    "regularized_incomplete_beta",
    # Reductions and scans: long sums lose precision; max/min make the
    # `x - max(x)` of softmax float32.
    "reduce_sum", "reduce_prod", "reduce_max", "reduce_min", "argmax",
    "argmin", "cumsum", "cumprod", "cumlogsumexp",
    # Linear algebra and FFTs: no half kernels, ill-conditioned in half.
    "cholesky", "eigh", "eig", "qr", "svd", "lu", "triangular_solve",
    "householder_product", "hessenberg", "schur", "tridiagonal",
    "tridiagonal_solve", "geqrf", "geqp3", "ormqr", "fft",
)

# A bias or residual added to a half matmul's result stays half.
_DEFAULT_KEEP_HALF = ("add",)

_DEFAULT_PROMOTE = (
    # Elementwise arithmetic.
    "add_any", "sub", "mul", "div", "rem", "neg", "abs", "sign",
    "floor", "ceil", "round", "nextafter", "max", "min", "sqrt", "cbrt",
    "tanh", "logistic", "sin", "cos", "atan", "atan2", "asinh", "acosh",
    "atanh", "is_finite", "clamp", "select_n", "complex", "stop_gradient",
    "copy", "reduce_precision",
    # Comparisons.
    "eq", "ne", "lt", "le", "gt", "ge",
    # Data movement.
    "broadcast_in_dim", "reshape", "squeeze", "transpose", "rev", "slice",
    "dynamic_slice", "dynamic_update_slice", "gather", "scatter",
    "scatter-add", "scatter-sub", "scatter-mul", "scatter-min", "scatter-max",
    "concatenate", "pad", "split", "sort", "top_k",
    # Windowed reductions (pooling) and running extrema.
    "reduce_window_max", "reduce_window_min", "reduce_window_sum",
    "select_and_gather_add", "select_and_scatter_add", "cummax", "cummin",
)

# Evaluated by dedicated code below, never by a list's rule.
_STRUCTURAL = frozenset({
    "convert_element_type", "jit", "pjit", "closed_call", "core_call", "call",
    "remat2", "checkpoint", "custom_jvp_call", "custom_vjp_call", "scan",
    "while", "cond",
})
# Take each operand in any dtype and return it in that dtype; casting them to
# one common dtype would be wrong (e.g. `optimization_barrier(x_f16, y_f32)`).
_PASSTHROUGH = frozenset({
    "device_put", "optimization_barrier", "sharding_constraint", "name",
    "psum", "pmax", "pmin", "ppermute", "all_gather", "all_to_all",
    "reduce_scatter", "pbroadcast", "pvary", "reshard", "layout_constraint",
})
# Their params hold dtype-specific jaxprs or result types, so they can only
# run as traced.
_AS_TRACED_ONLY = frozenset({
    "reduce", "reduce_window", "select_and_scatter", "bitcast_convert_type",
    "custom_linear_solve", "linear_call", "shard_map", "pallas_call",
    "rng_uniform", "pure_callback", "io_callback", "debug_callback",
    "ffi_call", "custom_lin", "custom_transpose_call",
})
_NOT_LISTABLE = _STRUCTURAL | _PASSTHROUGH | _AS_TRACED_ONLY
# Names this module lists itself. Some exist only in some jax versions; a
# rule for a primitive that never occurs is harmless.
_OWN_NAMES = frozenset(_DEFAULT_HALF + _DEFAULT_FLOAT32 + _DEFAULT_KEEP_HALF
                       + _DEFAULT_PROMOTE)
_FIELDS = ("half", "float32", "keep_half", "promote")


@functools.cache
def _public_primitive_names() -> frozenset:
  """Names of the primitives jax exports publicly; built on first need."""
  names = set(_OWN_NAMES)
  for module in (jex_primitives, lax, lax_linalg):
    names.update(value.name for value in vars(module).values()
                 if isinstance(value, jex_core.Primitive))
  return frozenset(names)


def _primitive_name(prim: PrimitiveLike) -> str:
  """Validates and returns the name of a primitive given by name or object."""
  if isinstance(prim, jex_core.Primitive):
    name = prim.name  # Any Primitive object is accepted, JAX's or a user's.
  elif isinstance(prim, str):
    name = prim
  else:
    raise TypeError("primitives must be given as names (str) or "
                    f"jax.extend.core.Primitive objects, got {prim!r}")
  if name in _NOT_LISTABLE:
    why = ("is evaluated structurally (higher-order or explicit cast)"
           if name in _STRUCTURAL else
           "keeps each operand's dtype" if name in _PASSTHROUGH else
           "has dtype-specific parameters and always runs as traced")
    raise ValueError(f"Primitive {name!r} cannot be put on an autocast list: "
                     f"it {why}.")
  if isinstance(prim, str) and name not in _OWN_NAMES:
    known = _public_primitive_names()
    if name not in known:
      close = difflib.get_close_matches(name, sorted(known), n=3)
      hint = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
      raise ValueError(
          f"Unknown primitive name {name!r}.{hint} Names are JAX primitive "
          "names as printed in jaxprs (e.g. 'exp', 'dot_general', "
          "'reduce_sum'); pass the Primitive object itself for primitives "
          "jax does not export (Pallas, your own).")
  return name


@dataclasses.dataclass(frozen=True)
class AutocastRules:
  """Which primitives `autocast` runs in half, in float32, or promoted.

  Four disjoint frozensets of JAX primitive names (as printed in jaxprs).
  Primitives on no list run as traced. Rules are immutable and hashable; the
  `with_*` methods return edited copies.

  Example:
    >>> import jax, jax.numpy as jnp, jmp_amp
    >>> rules = jmp_amp.DEFAULT_AUTOCAST_RULES
    >>> rules.rule_for("dot_general"), rules.rule_for("add")
    ('half', 'keep_half')
    >>> rules = rules.with_float32("tanh").with_half(jax.lax.exp_p)
    >>> rules.rule_for("tanh"), rules.rule_for("exp")
    ('float32', 'half')
    >>> f = jmp_amp.autocast(lambda x: jnp.tanh(jnp.exp(x)), jnp.float16,
    ...                      rules=rules)
    >>> f(jnp.ones(2)).dtype  # exp in float16, tanh in float32
    dtype('float32')

  Attributes:
    half: run on inputs cast to the compute dtype; return the compute dtype
      (half GEMMs accumulate in float32).
    float32: run on inputs cast to float32; return float32.
    keep_half: run in the compute dtype when an input is a half value
      autocast made (traced as float32), with float32 inputs cast to it
      saturating at its largest finite value; promote otherwise. Default:
      `add`, so biases and residuals added to half matmuls stay half.
    promote: run on inputs cast to the widest floating dtype among them.
  """

  half: frozenset = frozenset()
  float32: frozenset = frozenset()
  promote: frozenset = frozenset()
  keep_half: frozenset = frozenset()

  def __post_init__(self):
    seen: dict[str, str] = {}
    for field in _FIELDS:
      value = getattr(self, field)
      if isinstance(value, (str, jex_core.Primitive)):
        value = (value,)  # A lone name would otherwise iterate as letters.
      names = frozenset(_primitive_name(p) for p in value)
      for name in names:
        if name in seen:
          raise ValueError(f"Primitive {name!r} is on both the {seen[name]!r} "
                           f"and the {field!r} autocast lists.")
        seen[name] = field
      object.__setattr__(self, field, names)

  def rule_for(self, prim: PrimitiveLike) -> Optional[str]:
    """'half', 'float32', 'keep_half', 'promote', or None (runs as traced)."""
    name = prim.name if isinstance(prim, jex_core.Primitive) else prim
    for field in _FIELDS:
      if name in getattr(self, field):
        return field
    return None

  def _move(self, field: Optional[str], prims: Sequence[PrimitiveLike]):
    names = frozenset(_primitive_name(p) for p in prims)
    lists = {f: getattr(self, f) - names for f in _FIELDS}
    if field is not None:
      lists[field] = lists[field] | names
    return AutocastRules(**lists)

  def with_half(self, *prims: PrimitiveLike) -> AutocastRules:
    """Returns rules with `prims` moved to the half list."""
    return self._move("half", prims)

  def with_float32(self, *prims: PrimitiveLike) -> AutocastRules:
    """Returns rules with `prims` moved to the float32 list."""
    return self._move("float32", prims)

  def with_keep_half(self, *prims: PrimitiveLike) -> AutocastRules:
    """Returns rules with `prims` moved to the keep-half list."""
    return self._move("keep_half", prims)

  def with_promote(self, *prims: PrimitiveLike) -> AutocastRules:
    """Returns rules with `prims` moved to the promote list."""
    return self._move("promote", prims)

  def without(self, *prims: PrimitiveLike) -> AutocastRules:
    """Returns rules with `prims` on no list, so they run as traced."""
    return self._move(None, prims)


DEFAULT_AUTOCAST_RULES = AutocastRules(
    half=frozenset(_DEFAULT_HALF), float32=frozenset(_DEFAULT_FLOAT32),
    keep_half=frozenset(_DEFAULT_KEEP_HALF),
    promote=frozenset(_DEFAULT_PROMOTE))

# --------------------------------------------------------------------------
# The interpreter.
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Context:
  compute_dtype: np.dtype
  rules: AutocastRules
  # Set in float8 mode: half-list matmuls of float32 operands run in FP8.
  fp8: Optional[fp8_lib.FP8Recipe] = None


# The matmul primitives float8 mode runs in FP8 (when on the half list).
_FP8_MATMULS = {
    "dot_general": fp8_lib.autocast_dot_general,
    "conv_general_dilated": fp8_lib.autocast_conv_general_dilated,
}


def _is_float(dtype) -> bool:
  return dtypes.is_float_dtype(dtype)


def _dtype(x) -> np.dtype:
  return np.dtype(jax.typeof(x).dtype) if not hasattr(x, "dtype") else x.dtype


def _cast(x, dtype):
  """Casts a floating `x` to `dtype`; anything else is returned as is."""
  if _is_float(_dtype(x)) and _dtype(x) != dtype:
    return lax.convert_element_type(x, dtype)
  return x


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _saturate(x, dtype):
  """`x` with finite values beyond the range of `dtype` at its extremes.

  Infinities and NaN stay as they are, so casting the result to `dtype`
  overflows nothing that was finite. The derivative is one (nothing is saved
  for the backward pass).
  """
  big = np.asarray(jnp.finfo(dtype).max, _dtype(x))
  return lax.select(lax.is_finite(x), lax.clamp(-big, x, big), x)


@_saturate.defjvp
def _saturate_jvp(dtype, primals, tangents):
  (x,), (t,) = primals, tangents
  return _saturate(x, dtype), t


def _narrow(x, dtype: np.dtype, shape: tuple[int, ...]):
  """Casts a floating `x` to `dtype`, saturating where that narrows it.

  A narrowed `x` is broadcast to `shape` (that of the op's result) before the
  cast, so that the backward pass sums its cotangent (a bias gradient) in
  float32.
  """
  if _is_float(_dtype(x)) and _dtype(x).itemsize > dtype.itemsize:
    x = jnp.broadcast_to(_saturate(x, dtype), shape)
  return _cast(x, dtype)


def _is_weak(v) -> bool:
  # jnp turns the Python scalar of `x * 2.0` into a literal of x's traced
  # dtype (float32), which must not widen a half x.
  return isinstance(v, jex_core.Literal) or v.aval.weak_type


def _made_half(ctx: _Context, x, v) -> bool:
  """Whether `x` is a half value autocast made from a traced wider one."""
  return (_dtype(x) == ctx.compute_dtype
          and np.dtype(v.aval.dtype).itemsize > ctx.compute_dtype.itemsize)


def _widest(dts: Iterable[np.dtype]) -> np.dtype:
  return functools.reduce(jnp.promote_types, dts)


def _struct(x) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(np.shape(x), _dtype(x))


def _aval_struct(aval) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(aval.shape, aval.dtype)


def _eval_closed(ctx: _Context, closed, args: Sequence[Any]) -> list:
  return _eval_jaxpr(ctx, closed.jaxpr, closed.consts, args)


def _eval_jaxpr(ctx: _Context, jaxpr, consts, args) -> list:
  env: dict[Any, Any] = {}

  def read(v):
    if isinstance(v, jex_core.Literal):
      return np.asarray(v.val, dtype=v.aval.dtype)
    return env[v]

  for var, val in zip(jaxpr.constvars, consts):
    env[var] = val
  for var, val in zip(jaxpr.invars, args):
    env[var] = val
  for eqn in jaxpr.eqns:
    # Keeping each equation's source location and name stack makes the
    # lowered HLO carry the original op names (e.g. Flax module paths); its
    # context (compute_on, threefry mode, mesh) is the traced one.
    name_stack = (source_info_util.current_name_stack()
                  + eqn.source_info.name_stack)
    eqn_ctx = getattr(eqn, "ctx", None)
    manager = getattr(eqn_ctx, "manager", None) or contextlib.nullcontext()
    with source_info_util.user_context(eqn.source_info.traceback,
                                       name_stack=name_stack), manager:
      outs = _eval_eqn(ctx, eqn, [read(v) for v in eqn.invars])
    # Dropped outputs (DropVar) are stored too: nothing ever reads them.
    env.update(zip(eqn.outvars, outs))
  return [read(v) for v in jaxpr.outvars]


def _bind(eqn, invals, params=None) -> list:
  prim = eqn.primitive
  params = eqn.params if params is None else params
  bind_params = prim.get_bind_params(params)
  subfuns = ()
  if isinstance(bind_params, tuple):  # jax < 0.9: (subfuns, params)
    subfuns, bind_params = bind_params
  out = prim.bind(*subfuns, *invals, **bind_params)
  return list(out) if prim.multiple_results else [out]


def _bind_as_traced(eqn, invals) -> list:
  """Runs `eqn` on its inputs cast back to the dtypes they were traced with."""
  return _bind(eqn, [_cast(x, v.aval.dtype) if _is_float(v.aval.dtype) else x
                     for x, v in zip(invals, eqn.invars)])


def _eval_eqn(ctx: _Context, eqn, invals) -> list:
  name = eqn.primitive.name
  if name in _HANDLERS:
    return _HANDLERS[name](ctx, eqn, invals)
  if name in _PASSTHROUGH:
    return _bind(eqn, invals)
  rule = ctx.rules.rule_for(name)
  floats = [(x, v) for x, v in zip(invals, eqn.invars) if _is_float(_dtype(x))]
  if rule is None or not floats:
    return _bind_as_traced(eqn, invals)
  widest = _widest(_dtype(x) for x, _ in floats)
  if widest == np.float64:
    # float64 values are never narrowed (as in torch.autocast), so a half or
    # float32 op with a float64 input is promoted instead.
    rule = "promote"
  if rule == "keep_half":
    if any(_made_half(ctx, x, v) for x, v in floats):
      shape = eqn.outvars[0].aval.shape
      invals = [x if _is_weak(v) else _narrow(x, ctx.compute_dtype, shape)
                for x, v in zip(invals, eqn.invars)]
      return _bind_in(eqn, invals, ctx.compute_dtype)
    rule = "promote"
  if rule == "promote":
    strong = [_dtype(x) for x, v in floats if not _is_weak(v)]
    target = _widest(strong) if strong else widest
  elif rule == "half":
    if ctx.fp8 is not None and _runs_in_fp8(ctx, eqn, invals):
      return [_FP8_MATMULS[name](*invals, recipe=ctx.fp8, **eqn.params)]
    target = ctx.compute_dtype
  else:
    target = _F32
  return _bind_in(eqn, invals, target)


def _runs_in_fp8(ctx: _Context, eqn, invals) -> bool:
  """Whether float8 mode runs this half-list equation as an FP8 matmul.

  Matmuls with two floating operands traced in float32 do; a matmul the
  function (or an inner autocast) already wrote in half or FP8 runs as
  written, as in the half modes.
  """
  del ctx
  preferred = eqn.params.get("preferred_element_type")
  return (eqn.primitive.name in _FP8_MATMULS and len(invals) == 2
          and all(_is_float(_dtype(x)) for x in invals)
          and all(np.dtype(v.aval.dtype).itemsize >= 4 for v in eqn.invars)
          and (preferred is None or _is_float(preferred)))


def _bind_in(eqn, invals, target: np.dtype) -> list:
  """Runs `eqn` with its floating inputs cast to `target`."""
  invals = [_cast(x, target) for x in invals]
  if all(_dtype(x) == v.aval.dtype for x, v in zip(invals, eqn.invars)):
    # Already in the traced dtypes: the op as written is valid and, for a
    # matmul, a half one the user (or an inner autocast) chose, whose
    # preferred_element_type is kept. This is what makes autocast idempotent.
    return _bind(eqn, invals)
  params = _retype_params(eqn, invals, target)
  if params is None:
    return _bind_as_traced(eqn, invals)
  return _bind(eqn, invals, params)


_SCATTER_COMBINERS = {"scatter-add": lax.add, "scatter-sub": lax.sub,
                      "scatter-mul": lax.mul, "scatter-min": lax.min,
                      "scatter-max": lax.max}


def _retype_params(eqn, invals, target: np.dtype) -> Optional[dict]:
  """Params for running `eqn` in `target`, or None if that is impossible."""
  params = dict(eqn.params)
  if "preferred_element_type" in params:
    # dot_general / conv_general_dilated: a floating result is `target`; a
    # half result still accumulates in float32 inside the GEMM.
    preferred = params["preferred_element_type"]
    if preferred is not None and not _is_float(preferred):
      return params
    if not all(_is_float(_dtype(x)) for x in invals):
      return None
    params["preferred_element_type"] = target
  if params.get("update_jaxpr") is not None:
    # Scatters carry a scalar combiner jaxpr typed with the operand dtype.
    combiner = _SCATTER_COMBINERS.get(eqn.primitive.name)
    if combiner is None:
      return None
    scalar = jax.ShapeDtypeStruct((), target)
    closed = jax.make_jaxpr(combiner)(scalar, scalar)
    params.update(update_jaxpr=closed.jaxpr, update_consts=tuple(closed.consts))
  return params


# ---- Structural handlers. -------------------------------------------------


def _convert_element_type(ctx, eqn, invals):
  del ctx
  (x,), (v,) = invals, eqn.invars
  if v.aval.dtype == eqn.params["new_dtype"] and _is_float(v.aval.dtype):
    # Only the weak type changed when traced: not a cast the user asked for,
    # so the value keeps its autocast dtype.
    return [x]
  # A real cast written in the function (x.astype(f32)) is honoured.
  return _bind(eqn, [x])


def _inline(ctx, eqn, invals):
  """jit / closed_call: evaluate the callee in place, under the same rules."""
  callee = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
  if isinstance(callee, jex_core.ClosedJaxpr):
    return _eval_closed(ctx, callee, invals)
  return _eval_jaxpr(ctx, callee, [], invals)


def _remat(ctx, eqn, invals):
  params = eqn.params
  fn = lambda *xs: _eval_jaxpr(ctx, params["jaxpr"], [], xs)
  return jax.checkpoint(fn, prevent_cse=params["prevent_cse"],
                        policy=params["policy"])(*invals)


def _join_dtypes(a: np.dtype, b: np.dtype) -> np.dtype:
  if a == b or not (_is_float(a) and _is_float(b)):
    return a
  return np.dtype(jnp.promote_types(a, b))


def _fixed_carry_dtypes(body: Callable[[list], list], init: list) -> list:
  """Carry dtypes that `body` maps to themselves, widening as needed.

  The carry starts in the dtypes of `init`; while the body returns a carry in
  a wider (or different half) dtype, the carry is widened and the body traced
  again. Dtypes only widen, so this stops after a few steps.
  """
  carry_dtypes = [_dtype(c) for c in init]
  for _ in range(8):
    structs = [jax.ShapeDtypeStruct(np.shape(c), d)
               for c, d in zip(init, carry_dtypes)]
    outs = jax.eval_shape(lambda *c: body(list(c)), *structs)
    new = [_join_dtypes(d, o.dtype) for d, o in zip(carry_dtypes, outs)]
    if new == carry_dtypes:
      return carry_dtypes
    carry_dtypes = new
  raise AssertionError(f"carry dtypes did not settle: {carry_dtypes}")


def _cast_all(xs, dts):
  return [lax.convert_element_type(x, d) if _is_float(d) else x
          for x, d in zip(xs, dts)]


def _scan(ctx, eqn, invals):
  params = eqn.params
  n_consts, n_carry = params["num_consts"], params["num_carry"]
  consts = invals[:n_consts]
  init = invals[n_consts:n_consts + n_carry]
  xs = invals[n_consts + n_carry:]
  body = params["jaxpr"]

  def step(carry, x):
    outs = _eval_closed(ctx, body, [*consts, *carry, *x])
    return outs[:n_carry], outs[n_carry:]

  x_slice = [jax.ShapeDtypeStruct(np.shape(x)[1:], _dtype(x)) for x in xs]

  def carry_out(carry):
    return jax.eval_shape(lambda *x: step(carry, list(x))[0], *x_slice)

  carry_dtypes = _fixed_carry_dtypes(carry_out, init)

  def fixed_step(carry, x):
    new_carry, ys = step(carry, x)
    return _cast_all(new_carry, carry_dtypes), ys

  carry, ys = lax.scan(fixed_step, _cast_all(init, carry_dtypes), xs,
                       length=params["length"], reverse=params["reverse"],
                       unroll=params["unroll"])
  return [*carry, *ys]


def _while(ctx, eqn, invals):
  params = eqn.params
  n_cond, n_body = params["cond_nconsts"], params["body_nconsts"]
  cond_consts = invals[:n_cond]
  body_consts = invals[n_cond:n_cond + n_body]
  init = invals[n_cond + n_body:]

  def body(carry):
    return _eval_closed(ctx, params["body_jaxpr"], [*body_consts, *carry])

  def cond(carry):
    return _eval_closed(ctx, params["cond_jaxpr"], [*cond_consts, *carry])[0]

  carry_dtypes = _fixed_carry_dtypes(body, init)
  out = lax.while_loop(cond, lambda c: _cast_all(body(c), carry_dtypes),
                       _cast_all(init, carry_dtypes))
  return list(out)


def _cond(ctx, eqn, invals):
  index, *operands = invals
  branches = eqn.params["branches"]

  def run(branch):
    return lambda *xs: _eval_closed(ctx, branch, xs)

  structs = [_struct(x) for x in operands]
  shapes = [jax.eval_shape(run(b), *structs) for b in branches]
  # Branches must agree on output dtypes: take the widest of each output.
  out_dtypes = [functools.reduce(_join_dtypes, [np.dtype(s[i].dtype)
                                                for s in shapes])
                for i in range(len(eqn.outvars))]
  fns = [lambda *xs, b=b: _cast_all(run(b)(*xs), out_dtypes) for b in branches]
  return list(lax.switch(index, fns, *operands))


def _named(fn, closed):
  """Names a wrapper after the original function, for readable jaxprs."""
  debug_info = getattr(closed.jaxpr, "debug_info", None)
  fn.__name__ = getattr(debug_info, "func_name", None) or fn.__name__
  return fn


def _split_consts(eqn, invals):
  """(consts, args, arg vars) of a custom_jvp/vjp call.

  The first `num_consts` operands are the values the function closes over.
  They stay closed over in the rebuilt function: JAX differentiates custom
  functions with respect to their explicit arguments only.
  """
  n = eqn.params.get("num_consts", 0)
  return invals[:n], invals[n:], eqn.invars[n:]


def _all_float(variables) -> bool:
  return all(_is_float(v.aval.dtype) for v in variables)


def _custom_jvp_call(ctx, eqn, invals):
  """Keeps the custom JVP rule; runs both the function and the rule autocast.

  The rule is traced at the original dtypes (by differentiating the original
  call with respect to its arguments) and that jaxpr is evaluated under the
  rules like any other.
  """
  consts, args, arg_vars = _split_consts(eqn, invals)
  if not _all_float([*arg_vars, *eqn.outvars]):
    return _bind_as_traced(eqn, invals)  # float0 tangents: keep it simple.
  call = eqn.params["call_jaxpr"]
  const_structs = [_aval_struct(v.aval) for v in eqn.invars[:len(consts)]]
  arg_structs = [_aval_struct(v.aval) for v in arg_vars]
  n_out = len(eqn.outvars)

  def replay_jvp(cs, primals, tangents):
    return jax.jvp(lambda *xs: _bind(eqn, [*cs, *xs]), primals, tangents)

  def primal(*xs):
    return tuple(_eval_closed(ctx, call, [*consts, *xs]))

  out_dtypes = [o.dtype for o in jax.eval_shape(primal, *map(_struct, args))]
  fn = jax.custom_jvp(_named(primal, call))

  def fn_jvp(primals, tangents):
    jvp_jaxpr = jax.make_jaxpr(replay_jvp)(const_structs, arg_structs,
                                           arg_structs)
    outs = _eval_closed(ctx, jvp_jaxpr, [*consts, *primals, *tangents])
    return (tuple(_cast_all(outs[:n_out], out_dtypes)),
            tuple(_cast_all(outs[n_out:], out_dtypes)))

  fn.defjvp(fn_jvp)
  return list(fn(*args))


def _custom_vjp_call(ctx, eqn, invals):
  """Keeps the custom VJP rule; runs function, fwd and bwd autocast.

  The original fwd and bwd are traced at the original dtypes (through
  `jax.vjp` of the original call with respect to its arguments, whose
  pullback is a pytree of residuals) and both jaxprs are evaluated under the
  rules. The user's bwd rule is what the pullback runs.
  """
  consts, args, arg_vars = _split_consts(eqn, invals)
  if not _all_float([*arg_vars, *eqn.outvars]):
    return _bind_as_traced(eqn, invals)
  call = eqn.params["call_jaxpr"]
  const_structs = [_aval_struct(v.aval) for v in eqn.invars[:len(consts)]]
  arg_structs = [_aval_struct(v.aval) for v in arg_vars]
  out_structs = [_aval_struct(v.aval) for v in eqn.outvars]
  arg_dtypes = [_dtype(x) for x in args]

  def replay_vjp(cs, xs):
    return jax.vjp(lambda *a: _bind(eqn, [*cs, *a]), *xs)

  def primal(*xs):
    return tuple(_eval_closed(ctx, call, [*consts, *xs]))

  out_dtypes = [o.dtype for o in jax.eval_shape(primal, *map(_struct, args))]

  @functools.cache
  def traced_fwd():
    return jax.make_jaxpr(replay_vjp, return_shape=True)(const_structs,
                                                         arg_structs)

  def fwd(*xs):
    closed, shape = traced_fwd()
    outs, pullback = jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(shape),
        _eval_closed(ctx, closed, [*consts, *xs]))
    return (tuple(_cast_all(outs, out_dtypes)),
            tuple(jax.tree_util.tree_leaves(pullback)))

  def bwd(residuals, cts):
    _, (_, pullback_shape) = traced_fwd()
    res_tree = jax.tree_util.tree_structure(pullback_shape)
    res_structs = jax.tree_util.tree_leaves(pullback_shape)

    def traced_bwd(res, cts):
      return jax.tree_util.tree_unflatten(res_tree, res)(list(cts))

    closed = jax.make_jaxpr(traced_bwd)(res_structs, out_structs)
    in_cts = _eval_closed(ctx, closed, [*residuals, *cts])
    return tuple(_cast_all(in_cts, arg_dtypes))

  fn = jax.custom_vjp(_named(primal, call))
  fn.defvjp(fwd, bwd)
  return list(fn(*args))


_HANDLERS: dict[str, Callable[[_Context, Any, list], list]] = {
    "convert_element_type": _convert_element_type,
    "jit": _inline, "pjit": _inline, "closed_call": _inline,
    "core_call": _inline, "call": _inline,
    "remat2": _remat, "checkpoint": _remat,
    "custom_jvp_call": _custom_jvp_call,
    "custom_vjp_call": _custom_vjp_call,
    "scan": _scan, "while": _while, "cond": _cond,
}

# --------------------------------------------------------------------------
# Public entry point.
# --------------------------------------------------------------------------


def _as_policy(policy_or_dtype: Any
               ) -> tuple[Policy, Optional[fp8_lib.FP8Recipe]]:
  """(policy, FP8 recipe or None) for `autocast`'s second argument."""
  recipe = None
  if isinstance(policy_or_dtype, fp8_lib.FP8Recipe):
    recipe = policy_or_dtype
  elif fp8_lib.is_fp8_name(policy_or_dtype):
    recipe = fp8_lib.FP8Recipe()
  if recipe is not None:
    if recipe.scaling != "current":
      raise ValueError(
          "autocast runs FP8 matmuls with current scaling (it keeps no state "
          f"between calls), got an FP8Recipe with scaling={recipe.scaling!r}."
          " For delayed scaling use jmp_amp.flax.fp8 (NNX) or "
          "jmp_amp.fp8_dot_general with an FP8State.")
    return Policy(_F32, recipe.compute_dtype, _F32), recipe
  if isinstance(policy_or_dtype, (Policy, str)):
    try:
      return get_policy(policy_or_dtype), None
    except ValueError as e:
      raise ValueError(f"{e} autocast also accepts 'float8' (FP8 matmuls, "
                       "see jmp_amp.FP8Recipe).") from None
  try:
    compute = dtypes.canonical_float_dtype(policy_or_dtype, "autocast dtype")
  except TypeError:
    raise TypeError(
        "autocast expects a Policy, a policy string (e.g. 'mixed_bfloat16', "
        "'p=f32,c=f16,o=f32'), a floating dtype (e.g. jnp.bfloat16), "
        "'float8' or an FP8Recipe, got "
        f"{policy_or_dtype!r}") from None
  return Policy(_F32, compute, _F32), None


def _is_array_leaf(x) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic))


def autocast(fn: Callable[..., Any], policy_or_dtype: Any, *,
             rules: Optional[AutocastRules] = None) -> Callable[..., Any]:
  """Returns `fn` with torch.autocast-style per-op precision.

  Each call traces `fn` on its array arguments and evaluates the jaxpr with
  matmuls/convolutions in the compute dtype (float32 accumulation, half
  backward), numerically fragile ops (exp, log, reductions, ...) in float32,
  biases and residuals added to half results in half, and other ops in the
  widest dtype of their inputs; see `AutocastRules`. Floating outputs are
  cast to the policy's output dtype. Inputs are not cast (float32 master
  weights stay float32; the casts happen inside), so the policy's param dtype
  is not used. Non-array arguments (Python scalars, strings, None) are passed
  to `fn` as static values.

  Higher-order primitives are evaluated recursively: jit and closed_call are
  inlined, checkpoint is rebuilt with `jax.checkpoint`, scan/while/cond with
  `lax.scan`/`lax.while_loop`/`lax.switch` (loop carries keep one dtype: the
  widest any iteration produces), and custom_jvp/custom_vjp functions keep
  their custom rules, which are autocast too; the arrays they close over stay
  closed over (not differentiated), as in JAX.

  With a compute dtype that is not half (e.g. "float32"), `fn` is called as
  is and only its floating outputs are cast to the output dtype.

  ``"float8"``: the float32 matmuls of the half list (dot_general and
  conv_general_dilated by default) run through `jmp_amp.fp8_dot_general` /
  `jmp_amp.fp8_conv_general_dilated` with current scaling (no state): both
  operands rounded through float8_e4m3fn with per-tensor scales, the output
  cotangent through float8_e5m2 in the backward pass, results in the
  recipe's compute dtype (bfloat16). Everything else follows the bfloat16
  rules, so softmax, norms and reductions stay float32. XLA:GPU on Hopper
  turns these into FP8 cuBLAS GEMMs and cuDNN convolutions; elsewhere the
  rounding is emulated in bfloat16. Matmuls already written in half run as
  written.

  >>> f8_loss = jmp_amp.autocast(lambda w, x: jnp.sum(jnp.tanh(x @ w)),
  ...                            "float8")
  >>> w, x = jnp.full((4, 3), 0.25), jnp.ones((2, 4))
  >>> round(float(f8_loss(w, x)), 2), jax.grad(f8_loss)(w, x).dtype
  (4.57, dtype('float32'))

  Example:
    >>> import jax, jax.numpy as jnp, jmp_amp
    >>> def apply_fn(w, images):
    ...   y = jax.lax.conv_general_dilated(images, w, (1, 1), "SAME")
    ...   return jax.nn.relu(y).mean(axis=(2, 3))
    >>> w, images = jnp.ones((4, 3, 3, 3)), jnp.ones((2, 3, 8, 8))
    >>> amp_apply = jmp_amp.autocast(apply_fn, "p=f32,c=bf16,o=f32")
    >>> jax.jit(amp_apply)(w, images).dtype  # bf16 convs, f32 outputs
    dtype('float32')
    >>> jmp_amp.autocast(apply_fn, "mixed_float16")(w, images).dtype
    dtype('float16')

  Args:
    fn: any function of pytrees of arrays, traceable by JAX.
    policy_or_dtype: a `Policy`; a policy string, parsed by
      `jmp_amp.get_policy` ("mixed_bfloat16" has bfloat16 outputs,
      "p=f32,c=bf16,o=f32" float32 ones); a floating dtype, meaning that
      compute dtype with float32 outputs; or ``"float8"`` (also "fp8",
      "f8") or a current-scaling `jmp_amp.FP8Recipe`: FP8 matmuls (see
      below) with float32 outputs.
    rules: the `AutocastRules`; default `DEFAULT_AUTOCAST_RULES`.

  Returns:
    A function with the signature of `fn`.

  Raises:
    TypeError: `fn` is not callable, `policy_or_dtype` is not a policy or a
      floating dtype, or `rules` is not an `AutocastRules`.
    ValueError: the policy string cannot be parsed.
  """
  if not callable(fn):
    raise TypeError(f"autocast expects a callable fn, got "
                    f"{type(fn).__name__}: {fn!r}")
  policy, fp8_recipe = _as_policy(policy_or_dtype)
  if rules is None:
    rules = DEFAULT_AUTOCAST_RULES
  elif not isinstance(rules, AutocastRules):
    raise TypeError(f"rules must be an AutocastRules, got {rules!r}")
  ctx = _Context(np.dtype(policy.compute_dtype), rules, fp8_recipe)

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    if fp8_recipe is None and policy.compute_dtype not in _HALF_DTYPES:
      return policy.cast_to_output(fn(*args, **kwargs))
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    dynamic = [i for i, leaf in enumerate(leaves) if _is_array_leaf(leaf)]

    def flat_fn(*dyn):
      filled = list(leaves)
      for i, value in zip(dynamic, dyn):
        filled[i] = value
      a, k = jax.tree_util.tree_unflatten(treedef, filled)
      return fn(*a, **k)

    dyn_args = [leaves[i] for i in dynamic]
    closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*dyn_args)
    outs = _eval_closed(ctx, closed, dyn_args)
    out = jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(out_shape), outs)
    return policy.cast_to_output(out)

  return wrapped
