"""Loss scaling as an optax `GradientTransformation`.

`loss_scaling` wraps an optimizer so that it sees unscaled gradients, skips
steps whose gradients are not finite and adjusts the loss scale, all as data
flow inside the train step. Its cost over the bare optimizer is one extra read
of the gradients (the finite check, one fused reduction each) and a few scalar
operations: the unscale is fused into the optimizer's own update kernels, and
the skip either runs the optimizer under `jax.lax.cond` (CPU, TPU: the branch
is chosen on the device) or selects inside its update kernels (GPU, where a
conditional would copy the predicate to the host and wait for it).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental.layout import Layout
from jax.experimental.layout import with_layout_constraint

from jmp_amp._src import loss_scale as ls_lib
from jmp_amp._src.tree import all_finite
from jmp_amp._src.tree import where_tree

SKIP_WITH = ("auto", "cond", "select")


class LossScalingState(NamedTuple):
  """State of `loss_scaling`: arrays only, so it jits, shards and saves.

  Attributes:
    loss_scale: the current loss scale (a pytree of arrays).
    inner_state: the wrapped transformation's state.
    grads_finite: whether the last step's gradients (and loss, with
      ``check_loss=True``) were all finite.
    skipped_steps: how many steps were skipped because of inf/NaN.
    steps: how many updates were seen (applied or skipped).
  """
  loss_scale: ls_lib.LossScale
  inner_state: optax.OptState
  grads_finite: jax.Array
  skipped_steps: jax.Array
  steps: jax.Array


def _is_inexact(x) -> bool:
  return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _unscale_leaf(loss_scale: ls_lib.LossScale, g):
  """Divides one gradient by the scale in (at least) float32, in g's dtype.

  Complex gradients are unscaled too (both parts, by the real scale).
  """
  if not _is_inexact(g):
    return g
  wide = jnp.promote_types(g.dtype, jnp.float32)
  return loss_scale.unscale(g.astype(wide)).astype(g.dtype)


def _unscale(loss_scale: ls_lib.LossScale, grads):
  return jax.tree_util.tree_map(lambda g: _unscale_leaf(loss_scale, g), grads)


# Gradients larger than this are reduced to rows of about this length first
# (one kernel each); XLA:GPU reduces a row of up to 16384 elements in one
# pass, so the row results of all leaves can be combined by one reduction.
_ROW = 2**14


def _sum_max(a, b):
  return a[0] + b[0], jnp.maximum(a[1], b[1])


def _real_parts(x: jax.Array) -> list[jax.Array]:
  if jnp.iscomplexobj(x):  # unscaled part by part: check both.
    return [jnp.real(x), jnp.imag(x)]
  return [x]


def _rows(x: jax.Array) -> jax.Array:
  """`x` as rows of about `_ROW` elements: ``(rows, k, *x.shape[1:])``.

  Only the leading axis is split (into ``x.shape[0] // k`` groups of ``k``),
  so a sharding of any axis of `x` is still one of the reshaped array.
  """
  inner = x.size // x.shape[0]
  k = max((d for d in range(1, max(1, _ROW // inner) + 1)
           if x.shape[0] % d == 0), default=1)
  return x.reshape((x.shape[0] // k, k) + x.shape[1:])


def _finite_by_rows(loss_scale: ls_lib.LossScale, tree) -> jax.Array:
  """Whether every leaf of ``_unscale(loss_scale, tree)`` is finite, on a GPU.

  The unscale can only overflow where ``|g| * inv`` does, and rounding is
  monotonic, so it is enough to unscale the largest magnitude. Each large
  leaf is read once by one row reduction that yields both ``sum(g * 0)`` (NaN
  if the leaf holds an inf or NaN, whatever order it adds in) and ``max |g|``;
  one more reduction per gradient dtype combines the rows of all leaves, and
  only its two scalars meet the scale. No full-size temporary is written, and
  the scalar work after the last reduction fuses with the scale update.
  """
  groups: dict[Any, tuple[list, list]] = {}
  for leaf in jax.tree_util.tree_leaves(tree):
    if not _is_inexact(leaf) or leaf.size == 0:
      continue
    for x in _real_parts(leaf):
      zero = jnp.zeros((), x.dtype)
      if x.size > _ROW:
        rows = _rows(x)
        sums, maxima = jax.lax.reduce(
            (rows * zero, jnp.abs(rows)), (zero, zero), _sum_max,
            tuple(range(1, rows.ndim)))
      else:
        sums, maxima = x.reshape(-1) * zero, jnp.abs(x.reshape(-1))
      group = groups.setdefault(x.dtype, ([], []))
      group[0].append(sums)
      group[1].append(maxima)
  finite = jnp.array(True)
  for dtype, (sums, maxima) in groups.items():
    zero = jnp.zeros((), dtype)
    total, largest = jax.lax.reduce(
        (jnp.concatenate(sums), jnp.concatenate(maxima)), (zero, zero),
        _sum_max, (0,))
    finite &= jnp.isfinite(total) & jnp.isfinite(
        _unscale_leaf(loss_scale, largest))
  return finite


def _row_major(tree):
  """`tree` with each leaf in row-major layout, on CPU (unchanged elsewhere).

  Gradients passed to `jax.lax.cond` are materialised. A weight's gradient
  comes out of its matmul transposed, and XLA:CPU then stored it as it came
  and copied it again inside the conditional, in the layout the optimizer
  uses: two full-size buffers where one does.
  """
  def constrain(leaf):
    if jnp.ndim(leaf) < 2:
      return leaf
    return with_layout_constraint(leaf, Layout(tuple(range(jnp.ndim(leaf)))))
  return jax.lax.platform_dependent(
      tree, cpu=lambda t: jax.tree_util.tree_map(constrain, t),
      default=lambda t: t)


def _largest_finite_unscaled(loss_scale: ls_lib.LossScale, dtype) -> jax.Array:
  """The largest ``t`` of `dtype` whose unscale is finite, else ``-inf``.

  Unscaling rounds monotonically in ``|x|``, so a finite ``x`` of `dtype`
  stays finite once unscaled exactly when ``|x| <= t``. Starts from
  ``max / |inv|`` (``inv = 1 / scale``), within an ulp or two of ``t``, and
  steps to ``t`` by checking candidates with `_unscale_leaf` itself: scalar
  work only. A scale whose unscale of 0 is not finite (NaN, 0) gives
  ``-inf``, so that no gradient passes.
  """
  top = jnp.asarray(jnp.finfo(dtype).max, dtype)
  ok = lambda x: jnp.isfinite(_unscale_leaf(loss_scale, x))
  if isinstance(loss_scale, ls_lib.NoOpLossScale):
    return top
  wide = jnp.promote_types(dtype, jnp.float32)
  inv = jnp.abs(loss_scale.unscale(jnp.ones((), wide)))
  t = jnp.where(inv > 1, (top.astype(wide) / inv).astype(dtype), top)
  t = jnp.where(jnp.isnan(t), jnp.zeros((), dtype), t)
  for _ in range(3):
    t = jnp.where(ok(t), t, jnp.nextafter(t, jnp.zeros((), dtype)))
  for _ in range(3):
    up = jnp.minimum(jnp.nextafter(t, jnp.asarray(jnp.inf, dtype)), top)
    t = jnp.where(ok(up), up, t)
  return jnp.where(ok(t), t, jnp.asarray(-jnp.inf, dtype))


def _finite_on_cpu(loss_scale: ls_lib.LossScale, grads,
                   materialized: bool = False) -> jax.Array:
  """Whether every leaf of ``_unscale(loss_scale, grads)`` is finite, on CPU.

  Compares ``|g|`` with ``t`` from `_largest_finite_unscaled`: inf exceeds
  ``t``, and so does a finite value whose unscale would overflow (a scale
  below 1); no unscale is needed (fused into the check, it ran several
  times slower). Two forms, by whether the gradients are `materialized`
  (a `jax.lax.cond` skip takes them as operands):

  * no: ``all(|g| <= t)``, one comparison per element (NaN compares false),
    fused into the read of the gradient, leaving a boolean array a quarter
    of its size. A 2-D leaf is read as ``g.T``: for a matmul in a half
    dtype, JAX builds the weight's gradient as the transpose of a dot's
    (converted) result, which XLA:CPU then reads across rows unless the
    check transposes it back (seed step: 1.28x bare optax's time read as
    ``g``, 0.98x as ``g.T``; the answer is the same either way);
  * yes: ``isfinite(sum(g - g))`` (``g - g`` is NaN exactly at an inf or
    NaN, 0 elsewhere) and ``max |g| <= t``: two vectorised reductions of
    the stored gradients, with no temporary at all. The vectorised max may
    drop a NaN; the sum cannot.
  """
  limits: dict[Any, jax.Array] = {}
  finite = jnp.array(True)
  for leaf in jax.tree_util.tree_leaves(grads):
    if not _is_inexact(leaf) or leaf.size == 0:
      continue
    for x in _real_parts(leaf):
      if x.dtype not in limits:
        limits[x.dtype] = _largest_finite_unscaled(loss_scale, x.dtype)
      if materialized:
        finite &= (jnp.isfinite(jnp.sum(x - x))
                   & (jnp.max(jnp.abs(x)) <= limits[x.dtype]))
      else:
        finite &= jnp.all(jnp.abs(x.T if x.ndim == 2 else x)
                          <= limits[x.dtype])
  return finite


def _unscaled_finite(loss_scale: ls_lib.LossScale, grads,
                     materialized_on_cpu: bool = False) -> jax.Array:
  """Whether every leaf of ``_unscale(loss_scale, grads)`` is finite.

  An unscale that overflows (a scale below 1) counts as non-finite, as it
  would reach the optimizer. On CPU the check is `_finite_on_cpu`; elsewhere
  it is `_finite_by_rows`, which compiles to fewer kernels on a GPU.
  """
  return jax.lax.platform_dependent(
      grads, cpu=lambda g: _finite_on_cpu(loss_scale, g, materialized_on_cpu),
      default=lambda g: _finite_by_rows(loss_scale, g))


def _check_loss_scale(loss_scale: Any) -> None:
  if not isinstance(loss_scale, (ls_lib.NoOpLossScale, ls_lib.StaticLossScale,
                                 ls_lib.DynamicLossScale)):
    raise TypeError(
        "loss_scale must be a jmp_amp NoOpLossScale, StaticLossScale or "
        f"DynamicLossScale, got {type(loss_scale).__name__}: {loss_scale!r}")


def _check_flag(value: Any, name: str) -> None:
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(
        f"loss_scaling: {name} must be True or False, got "
        f"{type(value).__name__}: {value!r}")


def _skip_by_select(finite, apply, grads, inner_state, params):
  """Runs `apply` and selects old or new leaf by leaf.

  The selects fuse into the inner optimizer's update kernels, so nothing
  extra is read or written on a GPU; both the old and the new state are alive
  at once, which costs memory where the compiler does not fuse them (CPU).
  """
  updates, new_inner = apply(grads, inner_state, params)
  updates = jax.tree_util.tree_map(
      lambda u: jnp.where(finite, u, jnp.full_like(u, -0.0)), updates)
  return updates, where_tree(finite, new_inner, inner_state)


def _vary_over(x, axes):
  """`x`, marked as varying over those mesh `axes` it does not vary over yet.

  Inside `shard_map` (`lax.pcast`, or `lax.pvary` before it); unchanged
  elsewhere, where nothing varies.
  """
  missing = tuple(sorted(frozenset(axes) - _vma(x)))
  if not missing:
    return x
  if hasattr(jax.lax, "pcast"):  # jax >= 0.10
    return jax.lax.pcast(x, missing, to="varying")
  return jax.lax.pvary(x, missing)


def _vma(x) -> frozenset:
  """The mesh axes `x` varies over inside `shard_map` (empty elsewhere)."""
  aval = x if isinstance(x, jax.core.ShapedArray) else jax.typeof(x)
  manual = getattr(aval, "manual_axis_type", None)  # jax >= 0.10
  if manual is not None:
    return frozenset(manual.varying)
  return frozenset(getattr(aval, "vma", ()) or ())


def _skip_by_cond(finite, apply, grads, inner_state, params, on_cpu=False):
  """Runs `apply` only if `finite`, under `jax.lax.cond`.

  On CPU and TPU the conditional runs on the device, so a skipped step costs
  nothing and a taken one holds one optimizer state, not two. A skipped step
  returns updates of ``-0.0``; `on_cpu` (gradients made row-major by
  `_row_major`), it returns the gradients themselves where an update has
  their shape and type, and the updates are selected by `finite` outside the
  conditional: so XLA:CPU writes the updates over the gradients (when both
  branches make new buffers it needs one more), and the select fuses into
  `optax.apply_updates`. (Compiled for an H100, that form held 3.6x to
  8.8x bare optax's temp memory, so other backends keep the plain one.)
  """
  operands = (grads, inner_state, params)

  def take_raw(ops):
    updates, new_inner = apply(*ops)
    # The same types as the state it replaces, as lax.cond requires.
    new_inner = jax.tree_util.tree_map(
        lambda new, old: jnp.asarray(new).astype(jnp.result_type(old)),
        new_inner, ops[1])
    return updates, new_inner

  jaxpr, (shapes, _) = jax.make_jaxpr(take_raw, return_shape=True)(operands)
  update_leaves, update_tree = jax.tree_util.tree_flatten(shapes)
  grad_leaves = jax.tree_util.tree_leaves(grads)
  same_tree = update_tree == jax.tree_util.tree_structure(grads)
  passed = [on_cpu and same_tree and jnp.shape(g) == u.shape
            and jnp.result_type(g) == u.dtype
            for g, u in zip(grad_leaves, update_leaves)]
  out_tree = jax.tree_util.tree_structure((shapes, inner_state))
  # Under shard_map both branches must vary over the same mesh axes: each
  # output varies over what the new value, the old one or the predicate
  # does, as a select's result would.
  old_leaves = ([g if p else None for g, p in zip(grad_leaves, passed)]
                + jax.tree_util.tree_leaves(inner_state))
  axes = [_vma(new) | (frozenset() if old is None else _vma(old))
          | _vma(finite) for new, old in zip(jaxpr.out_avals, old_leaves)]

  def vary(leaves):
    return jax.tree_util.tree_unflatten(
        out_tree, [_vary_over(x, want) for x, want in zip(leaves, axes)])

  def take(ops):
    return vary(jax.tree_util.tree_leaves(take_raw(ops)))

  def skip(ops):
    updates = [g if p else jnp.full(u.shape, -0.0, u.dtype) for g, u, p in
               zip(jax.tree_util.tree_leaves(ops[0]), update_leaves, passed)]
    return vary(updates + jax.tree_util.tree_leaves(ops[1]))

  updates, new_inner = jax.lax.cond(finite, take, skip, operands)
  if on_cpu:
    updates = jax.tree_util.tree_map(
        lambda u: jnp.where(finite, u, jnp.full_like(u, -0.0)), updates)
  return updates, new_inner


def _nbytes(x) -> int:
  return int(np.prod(jnp.shape(x))) * jnp.result_type(x).itemsize


def _outweighs(inner_state, grads) -> bool:
  """Whether `inner_state` is at least as large as the largest gradient.

  On CPU, selects hold a copy of what the optimizer updates in place (Adam:
  2.8x bare optax's temp memory), and `jax.lax.cond` about one gradient
  more (its operands are materialised): SGD's empty state skips by select,
  Adam's by cond.
  """
  state = sum(_nbytes(x) for x in jax.tree_util.tree_leaves(inner_state))
  largest = max((_nbytes(g) for g in jax.tree_util.tree_leaves(grads)),
                default=0)
  return state >= largest


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
  (``get_loss_scale(state).scale(loss)``), checks that all of them are finite
  once unscaled (one fused reduction per gradient), and then

  * finite: applies `inner` to the gradients divided by the scale in float32
    (the division is fused into `inner`'s own update kernels);
  * non-finite: returns updates of ``-0.0`` (so `optax.apply_updates` leaves
    every param bit-for-bit unchanged, ``-0.0`` included) and leaves the inner
    state bit-for-bit unchanged;

  and adjusts the loss scale either way. There is no host synchronisation on
  any backend. Because the transformations that need gradients in their true
  units (clipping, weight decay, Adam's moments) sit inside `inner`, they see
  unscaled gradients, as torch's ``unscale_`` recipe requires. Complex
  gradients are unscaled like real ones (both parts).

  Like torch's ``GradScaler``, the check looks at the gradients only: a loss
  that is inf or NaN while its gradients are finite (say, an inf in a term
  that does not depend on the params) does not skip the step. With
  ``check_loss=True`` it does: pass the loss as ``value=`` (optax's name for
  the objective's value, also read by e.g. `optax.contrib.reduce_on_plateau`).

  Example:
    >>> params = {"w": jnp.ones(3)}
    >>> opt = jmp_amp.loss_scaling(
    ...     optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)),
    ...     jmp_amp.DynamicLossScale(2.0 ** 15))
    >>> state = opt.init(params)
    >>> def scaled_loss(p, state):  # in the train step
    ...   return jmp_amp.get_loss_scale(state).scale(jnp.sum(p["w"] ** 2))
    >>> grads = jax.grad(scaled_loss)(params, state)
    >>> updates, state = opt.update(grads, state, params)
    >>> params = optax.apply_updates(params, updates)
    >>> int(state.skipped_steps), float(state.loss_scale.loss_scale)
    (0, 32768.0)

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
    check_loss: also skip (and back off) when the loss is not finite. `update`
      must then be given the loss, scaled or not, as ``value=loss``.
    skip_with: how a skipped step leaves the inner state unchanged:
      ``"cond"`` runs `inner` under `jax.lax.cond` (only one optimizer state
      alive; on a GPU the conditional copies its predicate to the host and
      waits for it), ``"select"`` runs it always and selects old or new
      values inside its update kernels (free on a GPU, where they fuse; on a
      CPU it holds old and new states at once). ``"auto"`` (default) picks
      per backend when the step is lowered: ``"cond"`` on TPU (whose
      conditionals run on the device) and on CPU when the inner state is at
      least as large as the largest gradient (Adam, momentum), ``"select"``
      on CPU for smaller states (plain SGD: nothing to hold twice, while a
      conditional holds one gradient more) and elsewhere (GPU).

  Returns:
    An `optax.GradientTransformationExtraArgs` whose state is a
    `LossScalingState`.
  """
  if not isinstance(inner, optax.GradientTransformation):
    raise TypeError(
        "inner must be an optax.GradientTransformation (e.g. optax.adam(1e-3)),"
        f" got {type(inner).__name__}")
  _check_loss_scale(loss_scale)
  _check_flag(skip_nonfinite, "skip_nonfinite")
  _check_flag(check_loss, "check_loss")
  if not isinstance(skip_with, str) or skip_with not in SKIP_WITH:
    raise ValueError(
        f"loss_scaling: skip_with must be one of {SKIP_WITH}, got "
        f"{skip_with!r}")
  inner_update = optax.with_extra_args_support(inner).update

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
    loss_scale = state.loss_scale
    if not skip_nonfinite:
      cpu_skip = None
    elif skip_with == "auto":
      cpu_skip = ("cond" if _outweighs(state.inner_state, updates)
                  else "select")
    else:
      cpu_skip = skip_with
    if cpu_skip == "cond":  # the check and the skip read the same buffers.
      updates = _row_major(updates)
    finite = _unscaled_finite(loss_scale, updates, cpu_skip == "cond")
    if check_loss:
      if "value" not in extra_args:
        raise TypeError(
            "loss_scaling(..., check_loss=True) needs the loss: call "
            "update(grads, state, params, value=loss)")
      finite = finite & all_finite(extra_args["value"])
    if axis_name is not None:
      finite = jax.lax.pmin(finite.astype(jnp.int32), axis_name).astype(bool)

    def apply(grads, inner_state, params):
      return inner_update(_unscale(loss_scale, grads), inner_state, params,
                          **extra_args)

    if not skip_nonfinite:
      new_updates, new_inner = apply(updates, state.inner_state, params)
    else:
      select = lambda *a: _skip_by_select(finite, apply, *a)
      cond = lambda *a: _skip_by_cond(finite, apply, *a)
      cpu_cond = lambda *a: _skip_by_cond(finite, apply, *a, on_cpu=True)
      elsewhere = {"auto": {"tpu": cond, "default": select},
                   "cond": {"default": cond},
                   "select": {"default": select}}[skip_with]
      new_updates, new_inner = jax.lax.platform_dependent(
          updates, state.inner_state, params,
          cpu=cpu_cond if cpu_skip == "cond" else select, **elsewhere)
    skipped_steps = state.skipped_steps + jnp.logical_not(finite).astype(
        jnp.int32)
    return new_updates, LossScalingState(
        loss_scale=loss_scale.adjust(finite),
        inner_state=new_inner,
        grads_finite=finite,
        skipped_steps=skipped_steps,
        # Applied steps (one more if this one is) plus skipped steps: the
        # same as steps + 1, written from the new skip count so that XLA
        # updates both counters in one GPU kernel.
        steps=(state.steps - state.skipped_steps + finite.astype(jnp.int32)
               + skipped_steps))

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
    >>> opt = optax.chain(optax.clip_by_global_norm(1.0), jmp_amp.loss_scaling(
    ...     optax.adam(1e-3), jmp_amp.DynamicLossScale(2.0 ** 15)))
    >>> opt_state = opt.init({"w": jnp.ones(3)})
    >>> float(jmp_amp.get_loss_scale(opt_state).scale(jnp.float32(0.5)))
    16384.0
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
