"""Using `loss_scaling` from a train step: the scaled loss, the state, metrics.

`loss_scaling` keeps the loss scale in the optimizer state; these read it
wherever it sits in a nested optax state.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from jmp_amp._src.scaling import LossScalingState


def scaled_value_and_grad(fun: Callable, opt_state: Any, *,
                          argnums: int | tuple[int, ...] = 0,
                          has_aux: bool = False) -> Callable:
  """`jax.value_and_grad` of `fun`, with the loss scaled as `opt_state` says.

  Returns a function of `fun`'s arguments that gives ``(value, grads)`` as
  `jax.value_and_grad` would, except that ``grads`` are the gradients of the
  *scaled* loss, which is what `loss_scaling`'s update expects; ``value`` is
  the loss itself, unscaled (with ``has_aux``, ``(value, aux)``). The scale is
  read from the `loss_scaling` state found anywhere in `opt_state`. This is
  torch's ``scaler.scale(loss).backward()`` in one call, and the way not to
  feed `loss_scaling` gradients that were never scaled or already unscaled
  (which would make every update ``scale`` times too small, silently).

  Example:
    >>> opt = jmp_amp.loss_scaling(optax.sgd(0.1),
    ...                            jmp_amp.DynamicLossScale(2.0 ** 10))
    >>> params = {"w": jnp.array([1.0, 2.0])}
    >>> state = opt.init(params)
    >>> loss_fn = lambda p, x: jnp.sum(p["w"] * x)
    >>> loss, grads = jmp_amp.scaled_value_and_grad(loss_fn, state)(
    ...     params, jnp.array([3.0, 4.0]))
    >>> float(loss), grads["w"].tolist()  # gradients times 2**10
    (11.0, [3072.0, 4096.0])
  """
  grad_fn = jax.grad(scaled_loss_fn(fun, opt_state, has_aux=has_aux),
                     argnums=argnums, has_aux=True)

  def value_and_grad(*args, **kwargs):
    grads, (loss, out) = grad_fn(*args, **kwargs)
    return ((loss, out[1]) if has_aux else loss), grads

  return value_and_grad


def scaled_loss_fn(fun: Callable, opt_state: Any, *,
                   has_aux: bool = False) -> Callable:
  """``fun`` with its loss scaled: returns ``(scaled loss, (loss, fun's out))``.

  The one place the loss is scaled, for `scaled_value_and_grad` and for
  steps that differentiate with another transform (`jmp_amp.flax`'s).
  """
  loss_scale = get_scaling_state(opt_state).loss_scale

  def scaled(*args, **kwargs):
    out = fun(*args, **kwargs)
    loss = out[0] if has_aux else out
    return loss_scale.scale(loss), (loss, out)

  return scaled


def get_scaling_state(opt_state: Any) -> LossScalingState:
  """Finds the (single) `LossScalingState` anywhere in a nested optax state.

  Works through `optax.chain`, `optax.MultiSteps`, `optax.inject_hyperparams`
  and user containers (`nnx.Optimizer.opt_state`, `TrainState.opt_state`).
  The current loss scale is its ``.loss_scale``.

  Example:
    >>> opt = optax.chain(optax.clip_by_global_norm(1.0), jmp_amp.loss_scaling(
    ...     optax.adam(1e-3), jmp_amp.DynamicLossScale(2.0 ** 15)))
    >>> opt_state = opt.init({"w": jnp.ones(3)})
    >>> float(jmp_amp.get_scaling_state(opt_state).loss_scale.loss_scale)
    32768.0

  Raises:
    ValueError: if there is no `loss_scaling` state, or more than one.
  """
  is_state = lambda x: isinstance(x, LossScalingState)
  found = [x for x in jax.tree.leaves(opt_state, is_leaf=is_state)
           if is_state(x)]
  if not found:
    raise ValueError(
        "No loss_scaling state found in the optimizer state (got "
        f"{type(opt_state).__name__}); build the optimizer with "
        "jmp_amp.loss_scaling(inner, loss_scale).")
  if len(found) > 1:
    raise ValueError(
        f"Found {len(found)} loss_scaling states in the optimizer state; "
        "wrap the optimizer in loss_scaling exactly once.")
  return found[0]


def scaling_metrics(opt_state: Any) -> dict[str, jax.Array]:
  """Logging values: current scale, last step finite, skipped and total steps."""
  state = get_scaling_state(opt_state)
  return {
      "loss_scale": jnp.asarray(state.loss_scale.loss_scale, jnp.float32),
      "grads_finite": state.grads_finite,
      "skipped_steps": state.skipped_steps,
      "steps": state.steps,
  }
