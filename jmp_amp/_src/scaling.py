"""Loss scaling as an optax `GradientTransformation`.

`loss_scaling` wraps an optimizer so that it sees unscaled gradients, skips
steps whose gradients are not finite and adjusts the loss scale, all as data
flow inside the train step: no value leaves the device.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_amp._src import loss_scale as ls_lib
from jmp_amp._src import replicas
from jmp_amp._src.tree import all_finite

SKIP_WITH = ("auto", "cond", "select")

# The finite check reduces each large gradient along its last axis and then
# checks `_GROUP` of these partial results (or small gradients) at a time in
# one reduction; benchmarks/results/overhead_h100.json and
# compile_time_cpu.json measure the choice.
_SMALL = 4096
_GROUP = 8


class LossScalingState(NamedTuple):
  """State of `loss_scaling`: arrays only, so it jits, shards and saves.

  Attributes:
    loss_scale: the current loss scale (a pytree of arrays).
    inner_state: the wrapped transformation's state.
    grads_finite: whether the last step's gradients (and loss, with
      ``check_loss=True``) were all finite.
    skipped_steps: how many steps were skipped because of inf/NaN.
    steps: how many updates were seen (applied or skipped).

  Example (`jmp_amp.get_scaling_state` finds it in any optimizer state):
    >>> opt = jmp_amp.loss_scaling(optax.adam(1e-3),
    ...                            jmp_amp.DynamicLossScale(2.0 ** 8))
    >>> params = {"w": jnp.ones(2)}
    >>> _, opt_state = opt.update({"w": jnp.array([jnp.inf, 1.0])},
    ...                           opt.init(params), params)
    >>> s = jmp_amp.get_scaling_state(opt_state)  # a LossScalingState
    >>> print(s.loss_scale.loss_scale, s.grads_finite, s.skipped_steps, s.steps)
    128.0 False 1 1
  """
  loss_scale: ls_lib.LossScale
  inner_state: optax.OptState
  grads_finite: jax.Array
  skipped_steps: jax.Array
  steps: jax.Array


def _unscale(loss_scale: ls_lib.LossScale, grads):
  """Divides each gradient by the scale in (at least) float32, in its dtype.

  Complex gradients are unscaled too (both parts, by the real scale). The
  factor ``1/scale`` is broadcast once per shape and dtype, not once per leaf:
  a model's repeated layers share shapes, and every broadcast is an HLO
  instruction for XLA to compile.
  """
  if isinstance(loss_scale, ls_lib.NoOpLossScale):
    return grads
  inv = functools.cache(lambda dtype: loss_scale.unscale(jnp.ones((), dtype)))
  inv_like = functools.cache(
      lambda shape, dtype: jax.lax.broadcast(inv(dtype), shape))

  def unscale(g):
    wide = jnp.promote_types(g.dtype, jnp.float32)
    return jax.lax.mul(g.astype(wide), inv_like(g.shape, wide)).astype(g.dtype)

  return jax.tree.map(unscale, grads)


def _all_finite(grads) -> jax.Array:
  """Whether every gradient is finite, in few reductions.

  A gradient of more than `_SMALL` elements is first checked row by row
  along its last axis, into a float32 vector of 0 (finite row) or NaN. These
  vectors and the small gradients are then checked `_GROUP` at a time, each
  group concatenated into one reduction. A gradient sharded in its type
  (over `Explicit` mesh axes) cannot be flattened without a gather: it is
  reduced over all its axes to one such flag, each device reading its own
  shard.
  """
  parts = {}
  for g in jax.tree.leaves(grads):
    if _typed_sharding(jax.typeof(g)) is not None:
      g = jnp.where(jnp.isfinite(g).all(), 0.0, jnp.nan)
    elif g.size > _SMALL:
      g = jnp.where(jnp.isfinite(g).all(axis=-1), 0.0, jnp.nan)
    if g.size:
      parts.setdefault(g.dtype, []).append(g.reshape(-1))
  return all_finite([jnp.concatenate(p[i:i + _GROUP])
                     for p in parts.values() for i in range(0, len(p), _GROUP)])


def _typed_sharding(aval):
  """`aval`'s sharding if its type shards it (over `Explicit` axes), or None.

  A value of that type cannot be flattened, nor mixed in a `select` or a
  `cond` with one of another sharding: what is built for it takes this one.
  """
  sharding = getattr(aval, "sharding", None)
  if any(p is not None for p in getattr(sharding, "spec", ())):
    return sharding
  return None


def _vma(aval) -> frozenset:
  """The `shard_map` mesh axes a value of `aval` varies over (none outside)."""
  manual = getattr(aval, "manual_axis_type", None)  # jax >= 0.10
  return frozenset(manual.varying if manual is not None
                   else getattr(aval, "vma", ()))


def _vary(x, axes: frozenset):
  """`x`, marked as varying over `axes` too (a no-op outside shard_map)."""
  missing = tuple(sorted(axes - _vma(jax.typeof(x))))
  if not missing:
    return x
  if hasattr(jax.lax, "pcast"):  # jax >= 0.10
    return jax.lax.pcast(x, missing, to="varying")
  return jax.lax.pvary(x, missing)  # jax < 0.10


def _skip(finite, run, out_avals, old_state, how: str):
  """Returns `run()`'s flat outputs if `finite`, else skipped-step values.

  `run` returns the flat updates followed by the flat new inner state, whose
  types are `out_avals`; a skipped step gives updates of ``-0.0`` (so
  `optax.apply_updates` leaves every param bit for bit, ``-0.0`` too) and
  `old_state` (flat) unchanged.

  ``"select"`` computes both and picks leaf by leaf: the selects fuse into the
  optimizer's update kernels, so on a GPU they cost nothing (a conditional
  there copies its predicate to the host and waits). ``"cond"`` runs the
  optimizer under `jax.lax.cond`: on CPU and TPU the branch is chosen on the
  device, and only one optimizer state is alive at a time.
  """
  n_updates = len(out_avals) - len(old_state)
  old_state = [jnp.asarray(o) for o in old_state]

  def take():  # the new state in the old one's dtypes: a step cannot retype it.
    new = run()
    return new[:n_updates] + optax.tree.cast_like(new[n_updates:], old_state)

  # The predicate and -0.0 are broadcast once per shape, dtype and sharding
  # in type (None but under `Explicit` mesh axes).
  key = lambda x: (x.shape, x.dtype, _typed_sharding(x))
  neg0 = functools.cache(lambda shape, dtype, sharding: jax.lax.full(
      shape, -0.0, dtype, sharding=sharding))
  if how == "select":
    new = take()
    pred = functools.cache(lambda shape, _, sharding: jax.lax.broadcast(
        finite, shape, out_sharding=sharding))
    select = lambda new, old: jax.lax.select(
        pred(*key(jax.typeof(new))), new, old)
    return ([select(u, neg0(*key(jax.typeof(u)))) for u in new[:n_updates]]
            + [select(n, o) for n, o in zip(new[n_updates:], old_state)])
  skipped = [neg0(*key(a)) for a in out_avals[:n_updates]] + old_state
  # Under shard_map both branches must vary over the same mesh axes: those of
  # the new value, the old one and the predicate, as a select's would.
  axes = [_vma(a) | _vma(jax.typeof(b)) | _vma(jax.typeof(finite))
          for a, b in zip(out_avals, skipped)]
  vary = lambda xs: [_vary(x, ax) for x, ax in zip(xs, axes)]
  return jax.lax.cond(finite, lambda: vary(take()), lambda: vary(skipped))


def _check_grads(grads, params) -> None:
  """Raises for gradients that cannot be the params' gradients."""
  for path, g in jax.tree_util.tree_leaves_with_path(grads):
    if not jnp.issubdtype(jnp.result_type(g), jnp.inexact):
      raise TypeError(
          f"loss_scaling: the gradient at {jax.tree_util.keystr(path)} has "
          f"dtype {jnp.result_type(g)}; gradients must be floating or complex "
          "(differentiate with respect to floating params only, e.g. "
          "nnx.Param, or filter integer leaves out before the update)")
  if params is None:
    return
  g_def, p_def = jax.tree.structure(grads), jax.tree.structure(params)
  if g_def != p_def:
    raise ValueError(
        "loss_scaling: the gradients and params have different tree "
        f"structures:\n  grads:  {g_def}\n  params: {p_def}")
  for (path, g), p in zip(jax.tree_util.tree_leaves_with_path(grads),
                          jax.tree.leaves(params)):
    if jnp.shape(g) != jnp.shape(p):
      raise ValueError(
          f"loss_scaling: the gradient at {jax.tree_util.keystr(path)} has "
          f"shape {jnp.shape(g)} but its param has shape {jnp.shape(p)}; "
          "pass the gradients of the loss with respect to these params")


def _check_flag(value: Any, name: str) -> None:
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"loss_scaling: {name} must be True or False, got "
                    f"{type(value).__name__}: {value!r}")


def loss_scaling(inner: optax.GradientTransformation,
                 loss_scale: ls_lib.LossScale,
                 *,
                 skip_nonfinite: bool = True,
                 axis_name: Optional[str] = None,
                 check_loss: bool = False,
                 skip_with: str = "auto",
                 ) -> optax.GradientTransformationExtraArgs:
  """Wraps `inner` so it receives unscaled gradients and skips inf/NaN steps.

  `update(grads, state, params)` takes the gradients of the *scaled* loss
  (`scaled_value_and_grad` computes them), checks that all of them are
  finite once unscaled, and then

  * finite: applies `inner` to the gradients divided by the scale in float32
    (the division fuses into `inner`'s own update kernels);
  * non-finite: returns updates of ``-0.0`` (so `optax.apply_updates` leaves
    every param bit for bit unchanged, ``-0.0`` included) and leaves the inner
    state bit for bit unchanged;

  and adjusts the loss scale either way. There is no host synchronisation.
  Because the transformations that need gradients in their true units
  (clipping, weight decay, Adam's moments) sit inside `inner`, they see
  unscaled gradients, as torch's ``unscale_`` recipe requires. Complex
  gradients are unscaled like real ones (both parts).

  Like torch's ``GradScaler``, the check looks at the gradients only: a loss
  that is inf or NaN while its gradients are finite does not skip the step.
  With ``check_loss=True`` it does: pass the loss as ``value=`` (optax's name
  for the objective's value).

  Example:
    >>> params = {"w": jnp.ones(3)}
    >>> opt = jmp_amp.loss_scaling(
    ...     optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)),
    ...     jmp_amp.DynamicLossScale(2.0 ** 15))
    >>> state = opt.init(params)
    >>> loss_fn = lambda p: jnp.sum(p["w"] ** 2)
    >>> loss, grads = jmp_amp.scaled_value_and_grad(loss_fn)(state, params)
    >>> updates, state = opt.update(grads, state, params)
    >>> params = optax.apply_updates(params, updates)
    >>> float(loss), int(state.skipped_steps), float(state.loss_scale.loss_scale)
    (3.0, 0, 32768.0)

  Args:
    inner: the optimizer to protect, e.g. `optax.adamw(...)`.
    loss_scale: `NoOpLossScale()` (bfloat16: nothing to scale),
      `StaticLossScale(s)` or `DynamicLossScale(s0, ...)`; its initial value.
    skip_nonfinite: whether to skip steps whose gradients are not finite
      (with NoOpLossScale too). If False, non-finite gradients reach `inner`.
    axis_name: under `shard_map`/`pmap` with per-device gradients, the mapped
      axis over which the finite flag is reduced, so that every device skips
      together. Not needed under `jit` with sharded arrays (the check is
      global there already).
    check_loss: also skip (and back off) when the loss is not finite. `update`
      must then be given the loss, scaled or not, as ``value=loss``.
    skip_with: how a skipped step leaves the inner state unchanged:
      ``"select"`` runs `inner` and selects old or new values inside its
      update kernels (free on a GPU; on a CPU old and new state are alive at
      once); ``"cond"`` runs `inner` under `jax.lax.cond` (one state alive;
      on a GPU the conditional waits for its predicate on the host).
      ``"auto"`` (default) picks ``"cond"`` on CPU and TPU and ``"select"``
      elsewhere, for the platform the step is compiled for.

  Returns:
    An `optax.GradientTransformationExtraArgs` whose state is a
    `LossScalingState`.
  """
  if not isinstance(inner, optax.GradientTransformation):
    raise TypeError(
        "inner must be an optax.GradientTransformation (e.g. optax.adam(1e-3)),"
        f" got {type(inner).__name__}")
  ls_lib.check_loss_scale(loss_scale)
  _check_flag(skip_nonfinite, "skip_nonfinite")
  _check_flag(check_loss, "check_loss")
  if not isinstance(skip_with, str) or skip_with not in SKIP_WITH:
    raise ValueError(f"loss_scaling: skip_with must be one of {SKIP_WITH}, "
                     f"got {skip_with!r}")
  inner_update = optax.with_extra_args_support(inner).update
  checked = [False]

  def init_fn(params):
    state = LossScalingState(
        # Copies: a step that donates the state must not delete the
        # caller's scale, which every later init starts from.
        loss_scale=jax.tree.map(jnp.array, loss_scale),
        inner_state=inner.init(params),
        grads_finite=jnp.array(True),
        skipped_steps=jnp.zeros([], jnp.int32),
        steps=jnp.zeros([], jnp.int32))
    # Once, outside jit (a traced init has no values to compare): processes
    # given different scales would each train on with their own copy of a
    # state that is replicated over them. A collective: every process calls
    # init.
    if (not checked[0] and jax.process_count() > 1
        and not isinstance(state.steps, jax.core.Tracer)):
      replicas.check_settings(
          _settings(loss_scale, skip_nonfinite=skip_nonfinite,
                    axis_name=axis_name, check_loss=check_loss,
                    skip_with=skip_with), "loss_scaling(...).init",
          "Each process would train apart with its own loss scale (a "
          "replicated value to JAX, and one copy per process). Build the "
          "optimizer with the same loss scale and settings in every process.")
      checked[0] = True
    return state

  def update_fn(updates, state, params=None, **extra_args):
    if not isinstance(state, LossScalingState):
      raise TypeError(
          "loss_scaling.update expected the LossScalingState made by this "
          f"transformation's init, got {type(state).__name__}")
    _check_grads(updates, params)
    if check_loss and "value" not in extra_args:
      raise TypeError(
          "loss_scaling(..., check_loss=True) needs the loss: call "
          "update(grads, state, params, value=loss)")
    loss_scale = state.loss_scale
    # The check reads the gradients as the optimizer gets them, so an unscale
    # that overflows (a scale below 1) counts as non-finite. The unscale fuses
    # into the check's reductions and, computed again inside `apply`, into the
    # optimizer's own kernels (one value, bit for bit, wherever it runs).
    finite = _all_finite(_unscale(loss_scale, updates))
    if check_loss:
      finite &= all_finite(extra_args["value"])
    if axis_name is not None:
      finite = jax.lax.pmin(finite.astype(jnp.int32), axis_name).astype(bool)

    def apply(grads, inner_state):
      return inner_update(_unscale(loss_scale, grads), inner_state, params,
                          **extra_args)

    if skip_nonfinite:
      new_updates, new_inner = _apply_or_skip(
          finite, apply, updates, state.inner_state, skip_with)
    else:
      new_updates, new_inner = apply(updates, state.inner_state)
    return new_updates, LossScalingState(
        loss_scale=loss_scale.adjust(finite),
        inner_state=new_inner,
        grads_finite=finite,
        skipped_steps=state.skipped_steps + (~finite).astype(jnp.int32),
        steps=state.steps + 1)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _settings(loss_scale: ls_lib.LossScale, **flags: Any
              ) -> list[tuple[str, Any]]:
  """``(name, value)`` of what every process must agree on: the loss scale's
  class, values and hyper-parameters, and `loss_scaling`'s flags."""
  out: list[tuple[str, Any]] = [("loss_scale type", type(loss_scale).__name__)]
  fields = {ls_lib.StaticLossScale: ("loss_scale",),
            ls_lib.DynamicLossScale: ("loss_scale", "counter", "overflows",
                                      "period", "factor", "min_loss_scale",
                                      "backoff_factor", "max_loss_scale",
                                      "hysteresis")}.get(type(loss_scale), ())
  for name in fields:
    value = getattr(loss_scale, name, None)
    if isinstance(value, jax.core.Tracer):
      return []  # built inside a trace: nothing to compare
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
      value = value.addressable_data(0)
    if value is not None and np.size(value) != 1:
      continue
    out.append((name, None if value is None else np.asarray(value).item()))
  return out + [(name, flag if isinstance(flag, str) or flag is None
                 else float(flag)) for name, flag in flags.items()]


def _apply_or_skip(finite, apply: Callable, grads, inner_state, skip_with):
  """`apply(grads, inner_state)` if `finite`, else a skipped step.

  `apply` (the inner optimizer) is traced once: as a jitted function, every
  later call (the shapes, each skip mechanism, each branch of the platform
  choice) reuses that trace and adds one call to it.
  """
  run = jax.jit(apply)
  closed, out_shapes = jax.make_jaxpr(run, return_shape=True)(
      grads, inner_state)
  skip = lambda how: functools.partial(
      _skip, finite, lambda: jax.tree.leaves(run(grads, inner_state)),
      closed.out_avals, jax.tree.leaves(inner_state), how)
  if skip_with == "auto" and not jax.tree.leaves(inner_state):
    flat = skip("select")()  # no state to keep: nothing for a cond to save.
  elif skip_with == "auto":
    cond = skip("cond")  # one branch for both platforms.
    flat = jax.lax.platform_dependent(cpu=cond, tpu=cond,
                                      default=skip("select"))
  else:
    flat = skip(skip_with)()
  return jax.tree.unflatten(jax.tree.structure(out_shapes), flat)
