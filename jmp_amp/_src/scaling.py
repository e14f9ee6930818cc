"""Loss scaling as an optax `GradientTransformation`."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_amp._src import loss_scale as ls_lib
from jmp_amp._src.tree import all_finite
from jmp_amp._src.tree import where_tree


class LossScalingState(NamedTuple):
  """State of `loss_scaling`: arrays only, so it jits, shards and saves.

  Attributes:
    loss_scale: the current loss scale (a pytree of arrays).
    inner_state: the wrapped transformation's state.
    grads_finite: whether the last step's gradients were all finite.
    skipped_steps: how many steps were skipped because of inf/NaN.
    steps: how many updates were seen (applied or skipped).
  """
  loss_scale: ls_lib.LossScale
  inner_state: optax.OptState
  grads_finite: jax.Array
  skipped_steps: jax.Array
  steps: jax.Array


def _unscale_in_float32(loss_scale: ls_lib.LossScale, grads):
  """Divides by the scale in float32, returning each leaf in its own dtype."""
  def unscale_leaf(g):
    if not jnp.issubdtype(g.dtype, jnp.floating):
      return g
    return loss_scale.unscale(g.astype(jnp.promote_types(g.dtype, jnp.float32))
                              ).astype(g.dtype)
  return jax.tree_util.tree_map(unscale_leaf, grads)


def _check_loss_scale(loss_scale: Any) -> None:
  if not isinstance(loss_scale, (ls_lib.NoOpLossScale, ls_lib.StaticLossScale,
                                 ls_lib.DynamicLossScale)):
    raise TypeError(
        "loss_scale must be a jmp_amp NoOpLossScale, StaticLossScale or "
        f"DynamicLossScale, got {type(loss_scale).__name__}: {loss_scale!r}")


def loss_scaling(inner: optax.GradientTransformation,
                 loss_scale: ls_lib.LossScale,
                 *,
                 skip_nonfinite: bool = True,
                 axis_name: Optional[str] = None,
                 ) -> optax.GradientTransformation:
  """Wraps `inner` so it receives unscaled gradients and skips inf/NaN steps.

  `update(grads, state, params)` takes the gradients of the *scaled* loss
  (``get_loss_scale(state).scale(loss)``), divides them by the scale in
  float32, checks that all are finite with one fused reduction, and then

  * finite: applies `inner` to the unscaled gradients;
  * non-finite: returns zero updates and leaves the inner state bit-for-bit
    unchanged (params are then untouched by `optax.apply_updates`);

  and adjusts the loss scale either way. Everything is `jnp.where` data flow:
  jit-safe, with no host synchronisation. Because the transformations that
  need gradients in their true units (clipping, weight decay, Adam's moments)
  sit inside `inner`, they see unscaled gradients, as torch's ``unscale_``
  recipe requires.

  Example:
    >>> opt = jmp_amp.loss_scaling(
    ...     optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)),
    ...     jmp_amp.DynamicLossScale(2.0 ** 15))
    >>> state = opt.init(params)
    >>> def loss_fn(p, x):  # in the train step
    ...   return jmp_amp.get_loss_scale(state).scale(model_loss(p, x))
    >>> updates, state = opt.update(jax.grad(loss_fn)(params, x), state, params)

  Args:
    inner: the optimizer to protect, e.g. `optax.adamw(...)`.
    loss_scale: `NoOpLossScale()` (bfloat16: nothing to scale),
      `StaticLossScale(s)` or `DynamicLossScale(s0, ...)`; its initial value.
    skip_nonfinite: whether to skip steps whose gradients are not finite
      (with NoOpLossScale too). If False, non-finite gradients reach `inner`.
    axis_name: under `shard_map`/`pmap` with per-device gradients, the mapped
      axis over which the finite flag is reduced, so that every device skips
      together. Not needed under `jit` with sharded arrays (the check is global
      there already).

  Returns:
    An `optax.GradientTransformation` whose state is a `LossScalingState`.
  """
  if not isinstance(inner, optax.GradientTransformation):
    raise TypeError(
        "inner must be an optax.GradientTransformation (e.g. optax.adam(1e-3)),"
        f" got {type(inner).__name__}")
  _check_loss_scale(loss_scale)

  def init_fn(params):
    return LossScalingState(
        loss_scale=jax.tree_util.tree_map(_strong_array, loss_scale),
        inner_state=inner.init(params),
        grads_finite=jnp.array(True),
        skipped_steps=jnp.zeros([], jnp.int32),
        steps=jnp.zeros([], jnp.int32))

  def update_fn(updates, state, params=None, **extra_args):
    if not isinstance(state, LossScalingState):
      raise TypeError(
          "loss_scaling.update expected the LossScalingState made by this "
          f"transformation's init, got {type(state).__name__}")
    if params is not None:
      _check_same_structure(updates, params)
    grads = _unscale_in_float32(state.loss_scale, updates)
    finite = all_finite(grads)
    if axis_name is not None:
      finite = jax.lax.pmin(finite.astype(jnp.int32), axis_name).astype(bool)

    new_updates, new_inner = optax.with_extra_args_support(inner).update(
        grads, state.inner_state, params, **extra_args)
    if skip_nonfinite:
      # Select, not lax.cond: XLA fuses the select into the update kernels, and
      # the discarded branch's NaNs never reach the returned state.
      new_updates = jax.tree_util.tree_map(
          lambda u: jnp.where(finite, u, jnp.zeros_like(u)), new_updates)
      new_inner = where_tree(finite, new_inner, state.inner_state)
    return new_updates, LossScalingState(
        loss_scale=state.loss_scale.adjust(finite),
        inner_state=new_inner,
        grads_finite=finite,
        skipped_steps=state.skipped_steps + jnp.logical_not(finite).astype(
            jnp.int32),
        steps=state.steps + 1)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _strong_array(x):
  # Weakly-typed leaves would change type after the first update and force a
  # recompile of the train step.
  x = jnp.asarray(x)
  return jnp.asarray(x, dtype=x.dtype)


def _check_same_structure(grads, params) -> None:
  g_def = jax.tree_util.tree_structure(grads)
  p_def = jax.tree_util.tree_structure(params)
  if g_def != p_def:
    raise ValueError(
        "loss_scaling: the gradients and params have different tree "
        f"structures:\n  grads:  {g_def}\n  params: {p_def}")


def _find_states(opt_state: Any) -> list[LossScalingState]:
  is_state = lambda x: isinstance(x, LossScalingState)
  return [x for x in jax.tree_util.tree_leaves(opt_state, is_leaf=is_state)
          if is_state(x)]


def get_scaling_state(opt_state: Any) -> LossScalingState:
  """Finds the (single) `LossScalingState` anywhere in a nested optax state.

  Works through `optax.chain`, `optax.MultiSteps`, `optax.inject_hyperparams`
  and user containers (`nnx.Optimizer.opt_state`, `TrainState.opt_state`).

  Raises:
    ValueError: if there is no `loss_scaling` state, or more than one.
  """
  found = _find_states(opt_state)
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


def get_loss_scale(opt_state: Any) -> ls_lib.LossScale:
  """The current loss scale held in a (nested) optax state.

  Example:
    >>> scaled_loss = jmp_amp.get_loss_scale(opt_state).scale(loss)
  """
  return get_scaling_state(opt_state).loss_scale


def scaling_metrics(opt_state: Any) -> dict[str, jax.Array]:
  """Logging values: current scale, last step finite, skipped and total steps."""
  state = get_scaling_state(opt_state)
  return {
      "loss_scale": jnp.asarray(state.loss_scale.loss_scale, jnp.float32),
      "grads_finite": state.grads_finite,
      "skipped_steps": state.skipped_steps,
      "steps": state.steps,
  }
