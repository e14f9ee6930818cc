"""Using `loss_scaling` from a train step: the scaled loss, and the state.

`loss_scaling` keeps the loss scale in the optimizer state; these read it
wherever it sits in a nested optax state.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jmp_amp._src.scaling import LossScalingState


def scaled_value_and_grad(fun: Callable, *args: Any,
                          argnums: int | tuple[int, ...] = 0,
                          has_aux: bool = False) -> Callable:
  """`jax.value_and_grad` of `fun`, with the loss scaled as the state says.

  Returns ``value_and_grad(opt_state, *fun_args, **fun_kwargs)``, which
  gives ``(value, grads)`` as ``jax.value_and_grad(fun)(*fun_args)`` would,
  except that ``grads`` are the gradients of the *scaled* loss, which is what
  `loss_scaling`'s update expects; ``value`` is the loss itself, unscaled
  (with ``has_aux``, ``(value, aux)``). The scale is read, at each call, from
  the `loss_scaling` state found anywhere in `opt_state`, so one function
  built outside the step serves every step, whatever the scale has become.
  This is torch's ``scaler.scale(loss).backward()`` in one call, and the way
  not to feed `loss_scaling` gradients that were never scaled or already
  unscaled (which would make every update ``scale`` times too small,
  silently).

  Example:
    >>> opt = jmp_amp.loss_scaling(optax.sgd(0.1),
    ...                            jmp_amp.DynamicLossScale(2.0 ** 10))
    >>> params = {"w": jnp.array([1.0, 2.0])}
    >>> state = opt.init(params)
    >>> loss_fn = lambda p, x: jnp.sum(p["w"] * x)
    >>> grad_fn = jmp_amp.scaled_value_and_grad(loss_fn)
    >>> loss, grads = grad_fn(state, params, jnp.array([3.0, 4.0]))
    >>> float(loss), grads["w"].tolist()  # gradients times 2**10
    (11.0, [3072.0, 4096.0])

  Args:
    fun: the loss function; returns a scalar loss, or ``(loss, aux)`` with
      `has_aux`.
    argnums: which of `fun`'s positional arguments to differentiate (the
      optimizer state, which the returned function takes first, is not
      counted).
    has_aux: whether `fun` returns ``(loss, aux)``.

  Returns:
    ``value_and_grad(opt_state, *fun_args, **fun_kwargs)``.

  Raises:
    TypeError: if an optimizer state is passed here, where the function is
      built (the old signature): it would be read once, and go stale when
      the scale changes.
  """
  if args:
    raise TypeError(
        "scaled_value_and_grad takes the optimizer state when the gradients "
        "are taken, not when the function is built (a state given here would "
        "go stale as soon as the loss scale changes); write "
        "jmp_amp.scaled_value_and_grad(fun)(opt_state, *fun_args) instead of "
        f"jmp_amp.scaled_value_and_grad(fun, {_given(args)})(*fun_args)")
  if not callable(fun):
    raise TypeError(f"scaled_value_and_grad takes a function, got {fun!r}")

  def value_and_grad(opt_state, *fun_args, **fun_kwargs):
    try:
      get_scaling_state(opt_state)
    except ValueError as e:
      raise ValueError(
          f"{e} (scaled_value_and_grad(fun) returns a function of "
          "(opt_state, *fun_args): pass the optimizer state first)") from None
    grad_fn = jax.grad(scaled_loss_fn(fun, opt_state, has_aux=has_aux),
                       argnums=argnums, has_aux=True)
    grads, (loss, out) = grad_fn(*fun_args, **fun_kwargs)
    return ((loss, out[1]) if has_aux else loss), grads

  return value_and_grad


def scaled_loss_fn(fun: Callable, opt_state: Any, *,
                   has_aux: bool = False) -> Callable:
  """``fun`` with its loss scaled: returns ``(scaled loss, (loss, fun's out))``.

  The one place the loss is scaled, for `scaled_value_and_grad` and for
  steps that differentiate with another transform (`jmp_amp.flax`'s). Build
  it inside the step: it reads the scale of `opt_state` as it is now.
  """
  loss_scale = get_scaling_state(opt_state).loss_scale

  def scaled(*args, **kwargs):
    out = fun(*args, **kwargs)
    if has_aux:
      if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise TypeError(
            "with has_aux=True the function must return (loss, aux), got "
            f"{_describe(out)}; pass has_aux=False for a function returning "
            "the loss alone")
      loss = out[0]
    else:
      if isinstance(out, (tuple, list)):
        raise TypeError(
            f"the function returned {_describe(out)}, not a scalar loss; "
            "pass has_aux=True for a function returning (loss, aux)")
      loss = out
    if jnp.shape(loss) != ():
      raise TypeError(f"the loss must be a scalar, got shape {jnp.shape(loss)}")
    return loss_scale.scale(loss), (loss, out)

  return scaled


def _given(args: tuple[Any, ...]) -> str:
  """The extra positional arguments of a call, named as a user wrote them."""
  return ", ".join(["opt_state"] + [f"<{type(a).__name__}>" for a in args[1:]])


def _describe(out: Any) -> str:
  if isinstance(out, (tuple, list)):
    return f"a {type(out).__name__} of {len(out)}"
  shape = getattr(out, "shape", None)
  return (f"a {type(out).__name__}" if shape is None
          else f"a {type(out).__name__} of shape {tuple(shape)}")


def _nnx() -> Any:
  """`flax.nnx` where the caller imported it (this module never does)."""
  return sys.modules.get("flax.nnx")


def get_scaling_state(opt_state: Any) -> LossScalingState:
  """Finds the (single) `LossScalingState` anywhere in a nested optax state.

  Works through `optax.chain`, `optax.MultiSteps`, `optax.inject_hyperparams`
  and user containers (`TrainState.opt_state`, an `nnx.Optimizer` or its
  ``opt_state``, whose Flax variables are read as plain arrays). The
  current loss scale is its ``.loss_scale``.

  Example:
    >>> opt = optax.chain(optax.clip_by_global_norm(1.0), jmp_amp.loss_scaling(
    ...     optax.adam(1e-3), jmp_amp.DynamicLossScale(2.0 ** 15)))
    >>> opt_state = opt.init({"w": jnp.ones(3)})
    >>> float(jmp_amp.get_scaling_state(opt_state).loss_scale.loss_scale)
    32768.0

  Raises:
    ValueError: if there is no `loss_scaling` state, or more than one.
  """
  nnx = _nnx()
  if (nnx is not None and isinstance(opt_state, nnx.Pytree)
      and hasattr(opt_state, "opt_state")):
    opt_state = opt_state.opt_state  # an nnx.Optimizer
  is_state = lambda x: isinstance(x, LossScalingState)
  found = [x for x in jax.tree.leaves(opt_state, is_leaf=is_state)
           if is_state(x)]
  if not found and nnx is not None and any(
      isinstance(x, nnx.State) for x in jax.tree.leaves(
          opt_state, is_leaf=lambda x: isinstance(x, nnx.State))):
    raise ValueError(
        "No loss_scaling state found in an nnx.State: nnx.state(optimizer) "
        "keeps the loss scale's arrays but not its class or "
        "hyper-parameters. Pass the nnx.Optimizer itself, or its opt_state: "
        "jmp_amp.get_scaling_state(optimizer).")
  if not found:
    raise ValueError(
        "No loss_scaling state found in the optimizer state (got "
        f"{type(opt_state).__name__}); build the optimizer with "
        "jmp_amp.loss_scaling(inner, loss_scale): "
        "jmp_amp.loss_scaling(inner, jmp_amp.NoOpLossScale()) for bfloat16, "
        "which needs no scaling but keeps the skip of non-finite steps and "
        "the step metrics.")
  if len(found) > 1:
    raise ValueError(
        f"Found {len(found)} loss_scaling states in the optimizer state; "
        "wrap the optimizer in loss_scaling exactly once.")
  if nnx is None:
    return found[0]
  is_var = lambda x: isinstance(x, nnx.Variable)
  return jax.tree.map(lambda x: x.get_value() if is_var(x) else x, found[0],
                      is_leaf=is_var)


def scaling_metrics(opt_state: Any) -> dict[str, jax.Array]:
  """The `get_scaling_state` values `jmp_amp.flax`'s train steps return:
  ``loss_scale`` (float32), ``grads_finite``, ``skipped_steps``, ``steps``."""
  state = get_scaling_state(opt_state)
  return {
      "loss_scale": jnp.asarray(state.loss_scale.loss_scale, jnp.float32),
      "grads_finite": state.grads_finite,
      "skipped_steps": state.skipped_steps,
      "steps": state.steps,
  }
