"""The autocast interpreter: evaluates a jaxpr again with per-op dtypes.

`autocast(fn, policy)` traces `fn` to a jaxpr once per call and evaluates
that jaxpr equation by equation under the current JAX trace, so the result
composes with `jit`, `grad`, `jvp`, `vmap` and `checkpoint`. Each equation
runs in the dtype its `AutocastRules` list gives it; higher-order primitives
go to the handlers of structural.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable, Optional, Sequence

import jax
from jax import lax
import jax.extend.core as jex_core
import jax.extend.source_info_util as source_info_util
import numpy as np

from jmp_amp._src import dtypes
from jmp_amp._src import fp8 as fp8_lib
from jmp_amp._src import fp8_ops
from jmp_amp._src.autocast import attention
from jmp_amp._src.autocast import checks
from jmp_amp._src.autocast import structural
from jmp_amp._src.autocast.casting import bind
from jmp_amp._src.autocast.casting import bind_as_traced
from jmp_amp._src.autocast.casting import cast
from jmp_amp._src.autocast.casting import dtype_of
from jmp_amp._src.autocast.casting import is_float
from jmp_amp._src.autocast.casting import narrow
from jmp_amp._src.autocast.casting import widest
from jmp_amp._src.autocast.rules import AutocastRules
from jmp_amp._src.autocast.rules import PASSTHROUGH
from jmp_amp._src.policy import get_policy
from jmp_amp._src.policy import Policy

_F32 = np.dtype(np.float32)

# The matmul primitives float8 mode runs in FP8 (when on the half list).
_FP8_MATMULS = {
    "dot_general": fp8_ops.autocast_dot_general,
    "conv_general_dilated": fp8_ops.autocast_conv_general_dilated,
}


@dataclasses.dataclass(frozen=True)
class _Context:
  compute_dtype: np.dtype
  rules: AutocastRules
  # Set in float8 mode: half-list matmuls of float32 operands run in FP8.
  fp8: Optional[fp8_lib.FP8Recipe] = None


def eval_jaxpr(jaxpr, args: Sequence[Any],
               eval_eqn: Callable[[Any, list], Sequence[Any]]) -> list:
  """Evaluates a Jaxpr or ClosedJaxpr on `args`, one equation at a time.

  ``eval_eqn(eqn, invals)`` returns each equation's outputs; the localiser
  (`jmp_amp._src.localise`) walks jaxprs with it too.
  """
  consts = ()
  if isinstance(jaxpr, jex_core.ClosedJaxpr):
    jaxpr, consts = jaxpr.jaxpr, jaxpr.consts
  env: dict[Any, Any] = {}

  def read(v):
    if isinstance(v, jex_core.Literal):
      return np.asarray(v.val, dtype=v.aval.dtype)
    return env[v]

  env.update(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))
  for eqn in jaxpr.eqns:
    # Dropped outputs (DropVar) are stored too: nothing ever reads them.
    env.update(zip(eqn.outvars, eval_eqn(eqn, [read(v) for v in eqn.invars])))
  return [read(v) for v in jaxpr.outvars]


def _eval_jaxpr(ctx: _Context, jaxpr, args: Sequence[Any]) -> list:
  """Evaluates a Jaxpr or ClosedJaxpr on `args` under the rules of `ctx`."""

  def eval_eqn(eqn, invals):
    # Keeping each equation's source location and name stack makes the
    # lowered HLO carry the original op names (e.g. Flax module paths); its
    # context (compute_on, threefry mode, mesh) is the traced one.
    name_stack = (source_info_util.current_name_stack()
                  + eqn.source_info.name_stack)
    eqn_ctx = getattr(eqn, "ctx", None)
    manager = getattr(eqn_ctx, "manager", None) or contextlib.nullcontext()
    with source_info_util.user_context(eqn.source_info.traceback,
                                       name_stack=name_stack), manager:
      return _eval_eqn(ctx, eqn, invals)

  return eval_jaxpr(jaxpr, args, eval_eqn)


def _is_weak(v) -> bool:
  # jnp turns the Python scalar of `x * 2.0` into a literal of x's traced
  # dtype (float32), which must not widen a half x.
  return isinstance(v, jex_core.Literal) or v.aval.weak_type


def _made_half(ctx: _Context, x, v) -> bool:
  """Whether `x` is a half value autocast made from a traced wider one."""
  return (dtype_of(x) == ctx.compute_dtype
          and np.dtype(v.aval.dtype).itemsize > ctx.compute_dtype.itemsize)


def _eval_eqn(ctx: _Context, eqn, invals) -> list:
  """Runs one equation in the dtype its rule gives it."""
  name = eqn.primitive.name
  if eqn.params.get("name") == attention.NAME:
    rule = ctx.rules.rule_for(attention.NAME)
    kwargs = attention.match(eqn) if rule in ("half", "float32") else None
    if kwargs is not None and rule == "half":
      return [attention.fused(*invals, dtype=ctx.compute_dtype, **kwargs)]
    if kwargs is not None:
      return bind_as_traced(eqn, invals)
  if name in structural.HANDLERS:
    evaluate = functools.partial(_eval_jaxpr, ctx)
    return structural.HANDLERS[name](evaluate, eqn, invals)
  if name in PASSTHROUGH:
    return bind(eqn, invals)
  rule = ctx.rules.rule_for(name)
  floats = [(x, v) for x, v in zip(invals, eqn.invars) if is_float(dtype_of(x))]
  if rule is None or not floats:
    return bind_as_traced(eqn, invals)
  wide = widest(dtype_of(x) for x, _ in floats)
  if wide == np.float64:
    # float64 values are never narrowed (as in torch.autocast), so a half or
    # float32 op with a float64 input is promoted instead.
    rule = "promote"
  if rule == "keep_half":
    if any(_made_half(ctx, x, v) for x, v in floats):
      shape = eqn.outvars[0].aval.shape
      invals = [x if _is_weak(v) else narrow(x, ctx.compute_dtype, shape)
                for x, v in zip(invals, eqn.invars)]
      return _bind_in(eqn, invals, ctx.compute_dtype)
    rule = "promote"
  if rule == "promote":
    strong = [dtype_of(x) for x, v in floats if not _is_weak(v)]
    target = widest(strong) if strong else wide
  elif rule == "half":
    if ctx.fp8 is not None and _runs_in_fp8(eqn, invals):
      return [_FP8_MATMULS[name](*invals, recipe=ctx.fp8, **eqn.params)]
    target = ctx.compute_dtype
  else:
    target = _F32
  return _bind_in(eqn, invals, target)


def _runs_in_fp8(eqn, invals) -> bool:
  """Whether float8 mode runs this half-list equation as an FP8 matmul.

  Matmuls with two floating operands traced in float32 do; a matmul the
  function (or an inner autocast) already wrote in half or FP8 runs as
  written, as in the half modes.
  """
  preferred = eqn.params.get("preferred_element_type")
  return (eqn.primitive.name in _FP8_MATMULS and len(invals) == 2
          and all(is_float(dtype_of(x)) for x in invals)
          and all(np.dtype(v.aval.dtype).itemsize >= 4 for v in eqn.invars)
          and (preferred is None or is_float(preferred)))


def _bind_in(eqn, invals, target: np.dtype) -> list:
  """Runs `eqn` with its floating inputs cast to `target`."""
  invals = [cast(x, target) for x in invals]
  if all(dtype_of(x) == v.aval.dtype for x, v in zip(invals, eqn.invars)):
    # Already in the traced dtypes: the op as written is valid and, for a
    # matmul, a half one the user (or an inner autocast) chose, whose
    # preferred_element_type is kept. This is what makes autocast idempotent.
    return bind(eqn, invals)
  params = _retype_params(eqn, invals, target)
  if params is None:
    return bind_as_traced(eqn, invals)
  return bind(eqn, invals, params)


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
    if preferred is not None and not is_float(preferred):
      return params
    if not all(is_float(dtype_of(x)) for x in invals):
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


# ---- Public entry point. ----------------------------------------------------


def _as_policy(policy_or_dtype: Any
               ) -> tuple[Policy, Optional[fp8_lib.FP8Recipe]]:
  """(policy, FP8 recipe or None) for `autocast`'s second argument."""
  recipe = None
  if isinstance(policy_or_dtype, fp8_lib.FP8Recipe):
    recipe = policy_or_dtype
  elif fp8_lib.is_fp8_name(policy_or_dtype):
    recipe = fp8_lib.FP8Recipe()
  if recipe is not None:
    if recipe.scaling == "delayed":
      raise ValueError(
          "autocast runs FP8 matmuls with current or rowwise scaling (it "
          "keeps no state between calls), got an FP8Recipe with "
          "scaling='delayed'. For delayed scaling use an FP8Policy rule of "
          "jmp_amp.flax.set_policies (NNX) or jmp_amp.fp8.dot_general with "
          "an FP8State.")
    return Policy(_F32, recipe.compute_dtype, _F32), recipe
  if isinstance(policy_or_dtype, (Policy, str)):
    try:
      return get_policy(policy_or_dtype), None
    except ValueError as e:
      raise ValueError(f"{e} autocast also accepts 'float8' (FP8 matmuls, "
                       "see jmp_amp.fp8).") from None
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
  to `fn` as static values. Explicit casts written in `fn`
  (`x.astype(jnp.float32)`) are honoured.

  Higher-order primitives are evaluated recursively: jit and closed_call are
  inlined, checkpoint is rebuilt with `jax.checkpoint`, scan/while/cond with
  `lax.scan`/`lax.while_loop`/`lax.switch` (loop carries keep one dtype: the
  widest any iteration produces), and custom_jvp/custom_vjp functions keep
  their custom rules, which are autocast too; the arrays they close over stay
  closed over (not differentiated), as in JAX.

  Limitations:
    * `fn` is traced on every call: wrap the autocast function in `jax.jit`.
      `jit` boundaries inside `fn` are inlined; the whole result can be
      jitted.
    * Array constants built in `fn` (`jnp.full`, `jnp.finfo(x.dtype).min`
      broadcast) are float32 values; only scalar literals and weakly typed
      values do not widen a half operand of a promote op.
    * custom_jvp/custom_vjp functions with integer inputs or outputs, and
      primitives on no list, run in their traced dtypes.
    * `fn` must be pure, as for `jax.jit`: it gets copies of its arguments.
      A Flax NNX step that updates its model or optimizer in place is
      refused with a `TypeError` (its updates would be lost): autocast the
      loss inside the step, ``nnx.value_and_grad(autocast(loss_fn, ...))``,
      or use `jmp_amp.flax.set_policies`.
    * As under `jax.grad(jax.jit(fn))`, a custom_vjp whose fwd or bwd closes
      over a value derived from the arguments of `fn` cannot be
      differentiated: pass such values to it as arguments, or use
      `jax.closure_convert`.

  With a compute dtype that is not half (e.g. "float32"), `fn` is called as
  is and only its floating outputs are cast to the output dtype.

  ``"float8"``: the float32 matmuls of the half list (dot_general and
  conv_general_dilated by default) run through `jmp_amp.fp8.dot_general` /
  `jmp_amp.fp8.conv_general_dilated` with current scaling (no state): both
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
    >>> def loss_fn(params, x):
    ...   logits = x @ params["w"] + params["b"]
    ...   return -jax.nn.log_softmax(logits).mean()
    >>> params = {"w": jnp.ones((4, 3)), "b": jnp.zeros(3)}
    >>> x = jnp.ones((2, 4))
    >>> amp_loss = jmp_amp.autocast(loss_fn, "p=f32,c=bf16,o=f32")
    >>> grads = jax.jit(jax.grad(amp_loss))(params, x)  # bf16 dots, f32 grads
    >>> grads["w"].dtype, amp_loss(params, x).dtype
    (dtype('float32'), dtype('float32'))
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
      "f8") or a current- or rowwise-scaling `jmp_amp.fp8.FP8Recipe`: FP8
      matmuls (see above; convolutions scale per tensor) with float32
      outputs.
    rules: the `AutocastRules`; default ``AutocastRules()``, torch's.

  Returns:
    A function with the signature of `fn`.

  Raises:
    TypeError: `fn` is not callable, `policy_or_dtype` is not a policy or a
      floating dtype, or `rules` is not an `AutocastRules`; when called:
      `fn` changed a Flax NNX object it was given in place.
    ValueError: the policy string cannot be parsed.
  """
  if not callable(fn):
    raise TypeError(f"autocast expects a callable fn, got "
                    f"{type(fn).__name__}: {fn!r}")
  policy, fp8_recipe = _as_policy(policy_or_dtype)
  if rules is None:
    rules = AutocastRules()
  elif not isinstance(rules, AutocastRules):
    raise TypeError(f"rules must be an AutocastRules, got {rules!r}")
  ctx = _Context(np.dtype(policy.compute_dtype), rules, fp8_recipe)

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    if fp8_recipe is None and policy.compute_dtype not in dtypes.HALF_DTYPES:
      return policy.cast_to_output(fn(*args, **kwargs))
    leaves, treedef = jax.tree.flatten((args, kwargs))
    dynamic = [i for i, leaf in enumerate(leaves) if _is_array_leaf(leaf)]

    def flat_fn(*dyn):
      filled = list(leaves)
      for i, value in zip(dynamic, dyn):
        filled[i] = value
      a, k = jax.tree.unflatten(treedef, filled)
      out = fn(*a, **k)
      checks.check_nnx_unchanged(a, k, treedef, filled)
      return out

    dyn_args = [leaves[i] for i in dynamic]
    closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*dyn_args)
    if fp8_recipe is not None:
      checks.warn_fp8_backward(closed, _FP8_MATMULS)
    outs = _eval_jaxpr(ctx, closed, dyn_args)
    out = jax.tree.unflatten(
        jax.tree.structure(out_shape), outs)
    checks.warn_state_to_half(out, args, np.dtype(policy.output_dtype),
                              policy)
    return policy.cast_to_output(out)

  return wrapped
