"""Which primitive `autocast` runs in which dtype: the rule lists.

`AutocastRules` holds four disjoint lists of JAX primitive names (half,
float32, keep-half, promote); its defaults, ``AutocastRules()``, follow
torch.autocast.
This module also names the primitives that no list may hold, because the
interpreter evaluates them structurally, passes their operands through, or can
only run them in their traced dtypes.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
from typing import Optional, Sequence, Union

from jax import lax
import jax.extend.core as jex_core
from jax.extend.core import primitives as jex_primitives
from jax.lax import linalg as lax_linalg

from jmp_amp._src.autocast import structural

PrimitiveLike = Union[str, jex_core.Primitive]

# Where torch gives no direct answer: `integer_pow` and `square` are float32
# ops (torch's `pow`); `sqrt`, `div`, `tanh` and `logistic` promote (torch
# lists only `rsqrt` and `reciprocal`); `argmax`/`argmin` are float32 ops
# (harmless: same result).

# "dot_product_attention" is no primitive but a jitted call of
# `jax.nn.dot_product_attention` (see attention.py): fused, on half inputs, as
# torch's autocast runs scaled_dot_product_attention.
_DEFAULT_HALF = ("dot_general", "conv_general_dilated", "dot_product_attention")

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

# Evaluated by the handlers of structural.py, never by a list's rule.
_STRUCTURAL = frozenset(structural.HANDLERS)
# Take each operand in any dtype and return it in that dtype; casting them to
# one common dtype would be wrong (e.g. `optimization_barrier(x_f16, y_f32)`).
PASSTHROUGH = frozenset({
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
_NOT_LISTABLE = _STRUCTURAL | PASSTHROUGH | _AS_TRACED_ONLY
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
           "keeps each operand's dtype" if name in PASSTHROUGH else
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

  Four disjoint frozensets of JAX primitive names (as printed in jaxprs);
  ``AutocastRules()`` holds the defaults, which follow torch.autocast, and a
  list not given keeps its default. Primitives on no list run "as traced": their inputs are cast back to the
  dtypes they had when the function was traced. That is always valid, so
  primitives autocast does not know (Pallas kernels, callbacks, custom calls)
  keep working. Rules are immutable and hashable; the `with_*` methods return
  edited copies.

  In the defaults, softmax, log-softmax, logsumexp, norm statistics and losses
  decompose into float32-list primitives (exp, log, reductions), so they
  cannot overflow float16; subtractions promote, so softmax's `x - max(x)`
  and a norm's `x - mean(x)` stay float32. float64 values are never narrowed:
  an op with a float64 input promotes whatever its list.

  One name is not a primitive: ``"dot_product_attention"``, a jitted call of
  `jax.nn.dot_product_attention` (``jax.jit(jax.nn.dot_product_attention,
  static_argnames=("is_causal", "implementation"))``, as `jmp_amp.models.GPT`
  calls it; the jaxpr then shows the call as one equation), causal or not,
  without mask or bias. On the half list (the default) it runs as one fused
  op on inputs cast to the compute dtype, as torch's autocast runs
  ``scaled_dot_product_attention``: cuDNN's flash kernel when compiled for a
  CUDA GPU that takes them, XLA's implementation elsewhere; the softmax stays
  float32 inside either, and it returns the compute dtype. On the float32
  list it runs as traced; on no list its ops follow their own rules.

  Example:
    >>> import jax, jax.numpy as jnp, jmp_amp
    >>> rules = jmp_amp.AutocastRules()  # the defaults
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
    half: run on inputs cast to the compute dtype; return the compute dtype,
      as torch's autocast returns half matmuls. Half GEMMs accumulate in
      float32 (cuBLAS, cuDNN, TPU and XLA:CPU all do) and, as the result is
      half, so are the cotangents: the backward GEMMs stay in half. A matmul
      whose operands were already half when traced runs as written (keeping
      its preferred_element_type), which makes autocast idempotent.
    float32: run on inputs cast to float32; return float32.
    keep_half: run in the compute dtype when an input is a half value
      autocast made (traced as float32, e.g. a matmul's result), with float32
      inputs cast to it; promote otherwise. Default: `add`, so a bias or a
      residual added to a half matmul's result stays half (like the bias of
      torch's half `addmm`), and so do the activations between layers. The
      cast saturates finite values at the half range (a `-1e9` mask stays
      finite; inf and NaN stay as they are) and comes after broadcasting, so
      a bias gradient is summed in float32.
    promote: run on inputs cast to the widest floating dtype among them.
      Scalar literals and weakly typed inputs (the `2.0` of `x * 2.0`) do not
      take part, as in JAX's own type promotion.
  """

  half: frozenset = frozenset(_DEFAULT_HALF)
  float32: frozenset = frozenset(_DEFAULT_FLOAT32)
  promote: frozenset = frozenset(_DEFAULT_PROMOTE)
  keep_half: frozenset = frozenset(_DEFAULT_KEEP_HALF)

  def __post_init__(self):
    seen: dict[str, str] = {}
    for field in _FIELDS:
      value = getattr(self, field)
      if isinstance(value, (str, jex_core.Primitive)):
        value = (value,)  # A lone name would otherwise iterate as letters.
      names = frozenset(_primitive_name(p) for p in value)
      for name in names:
        if name in seen:
          raise ValueError(
              f"Primitive {name!r} is on both the {seen[name]!r} and the "
              f"{field!r} autocast lists (a list not given keeps its "
              "default; AutocastRules().with_<list>(...) moves primitives).")
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

