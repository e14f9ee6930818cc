"""Mixed-precision train steps for Flax NNX and linen.

PyTorch's AMP recipe, per step::

    with torch.autocast(device_type="cuda", dtype=torch.float16):
      output = net(input)
      loss = loss_fn(output, target)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()

is, with Flax NNX (three lines of set-up, one per step)::

    jmp_amp.flax.set_policies(net, jmp_amp.flax.mixed_rules("float16"))
    opt = nnx.Optimizer(net, jmp_amp.loss_scaling(
        optax.sgd(1e-3), jmp_amp.DynamicLossScale(2.0 ** 15)), wrt=nnx.Param)
    step = jmp_amp.flax.make_train_step(lambda net, b: loss_fn(net(b[0]), b[1]))

    metrics = step(net, opt, (input, target))

`set_policies` plays the part of `torch.autocast` module by module (norms in
float32); ``make_train_step(..., autocast="float16")`` without it is
torch's op-level autocast instead. `loss_scaling` is the `GradScaler`. The
step is jitted and updates `net` and `opt` in place, donating their buffers.
With linen::

    state = jmp_amp.flax.train.TrainState.create(
        apply_fn=functools.partial(jmp_amp.flax.apply_with_policies, net,
                                   rules),
        params=params, tx=tx, batch_stats=batch_stats)
    step = jmp_amp.flax.make_linen_train_step(
        lambda net, b: loss_fn(net(b[0], train=True), b[1]))
    state, metrics = step(state, (input, target))

Each step scales the loss by the optimizer's current loss scale, takes the
gradients and lets `jmp_amp.loss_scaling` unscale them, skip the update if
any is inf/NaN and adjust the scale. A skipped step changes nothing in the
model: `loss_scaling` leaves the params and optimizer state alone, and the
step puts back the BatchNorm statistics (``revert_on_skip``) that the
overflowing forward pass computed; only the loss scale moves.

``loss_fn(net, batch)`` returns the loss (or ``(loss, aux)`` with
``has_aux=True``): `net` is the NNX module itself, or for linen a callable
``net(*args, **kwargs)`` that runs ``state.apply_fn`` on the current params
and mutable collections (``batch_stats``). Compute the loss from float32
logits (``logits.astype(jnp.float32)``, or ``mixed_rules(model_output=
"float32")``); the returned loss is cast to float32.

The metrics: ``loss`` (float32, unscaled), ``loss_scale`` (after this step's
adjustment), ``grads_finite``, ``skipped_steps``, ``steps`` and, with
``has_aux``, ``aux``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional, Sequence

from flax import nnx
from flax.training import train_state
import jax
import jax.numpy as jnp

import jmp_amp
from jmp_amp._src import fp8_compile
from jmp_amp._src.scaling_state import scaled_loss_fn
from jmp_amp._src.tree import where_tree
from jmp_amp.flax import _capture
from jmp_amp.flax import _fp8
from jmp_amp.flax import _fp8_op
from jmp_amp.flax import _step_parts
from jmp_amp.flax import numerics as numerics_lib
from jmp_amp.flax._step_parts import AutocastSpec


class TrainState(train_state.TrainState):
  """`flax.training.train_state.TrainState` with a ``batch_stats`` field.

  Example:
    >>> import functools
    >>> import jmp_amp.flax
    >>> model = nn.Sequential([nn.Dense(4), nn.BatchNorm(False)])
    >>> variables = model.init(jax.random.key(0), jnp.ones((2, 3)))
    >>> state = jmp_amp.flax.train.TrainState.create(
    ...     apply_fn=functools.partial(jmp_amp.flax.apply_with_policies,
    ...                                model, "mixed_bfloat16"),
    ...     params=variables["params"], tx=optax.sgd(0.1),
    ...     batch_stats=variables["batch_stats"])
    >>> sorted(state.batch_stats["layers_1"])
    ['mean', 'var']
  """
  batch_stats: Any = None


# --------------------------------------------------------------------------
# NNX.


def make_train_step(loss_fn: Callable[[nnx.Module, Any], Any], *,
                    has_aux: bool = False,
                    autocast: AutocastSpec = None,
                    wrt: Any = nnx.Param,
                    revert_on_skip: Any = nnx.BatchStat,
                    donate: bool = True,
                    jit: bool = True,
                    compiler_options: Optional[dict[str, Any]] = None,
                    numerics: Any = None,
                    on_nonfinite: Optional[Callable[[Any], Any]] = None,
                    ) -> Callable[..., dict[str, jax.Array]]:
  """Builds ``step(model, optimizer, batch) -> metrics`` for Flax NNX.

  The model and `nnx.Optimizer` are updated in place (their buffers are
  donated to the jitted step unless ``donate=False``). The optimizer's
  transformation must contain `jmp_amp.loss_scaling`.

  The jitted step splits ``(model, optimizer)`` into a graph definition
  (static: equal models share one compilation) and a state pytree, runs a
  `jax.jit`-compiled pure step on the state and writes the result back; it has
  a ``lower(model, optimizer, batch)`` method, for `jmp_amp.matmul_report`.

  Example:
    >>> import jmp_amp.flax
    >>> model = nnx.Linear(3, 4, rngs=nnx.Rngs(0))
    >>> _ = jmp_amp.flax.set_policies(model, "mixed_bfloat16")
    >>> optimizer = nnx.Optimizer(model, jmp_amp.loss_scaling(
    ...     optax.sgd(0.1), jmp_amp.NoOpLossScale()), wrt=nnx.Param)
    >>> def loss_fn(model, batch):
    ...   logits = model(batch["image"]).astype(jnp.float32)
    ...   return optax.softmax_cross_entropy_with_integer_labels(
    ...       logits, batch["label"]).mean()
    >>> step = jmp_amp.flax.make_train_step(loss_fn)
    >>> batch = {"image": jnp.ones((2, 3)), "label": jnp.array([0, 3])}
    >>> metrics = step(model, optimizer, batch)
    >>> int(metrics["steps"]), model.kernel[...].dtype
    (1, dtype('float32'))

  Args:
    loss_fn: ``loss_fn(model, batch)`` returning a scalar loss, or
      ``(loss, aux)`` with `has_aux`.
    has_aux: whether `loss_fn` returns ``(loss, aux)``; aux goes to
      ``metrics["aux"]``.
    autocast: None; a policy string / `Policy` / floating dtype, or
      ``"float8"`` / a `jmp_amp.fp8.FP8Recipe`, to run `loss_fn` under
      `jmp_amp.autocast` (op-level autocast, outputs kept float32); or any
      callable ``fn -> fn`` applied to the pure function
      ``(params, rest, batch) -> (loss, aux, rest)``.
    wrt: filter of the variables to differentiate, as given to
      `nnx.Optimizer`.
    revert_on_skip: filter of the non-differentiated variables restored to
      their previous values when the step is skipped (default BatchNorm
      statistics; `nnx.Not(nnx.RngState)` for all but the RNG counters,
      `nnx.Nothing` for none).
    donate: donate the model's and optimizer's buffers.
    jit: compile the step; False returns the plain function, to call inside
      your own `jax.jit` / `nnx.jit`.
    compiler_options: XLA options for `jax.jit`, e.g.
      ``{"xla_backend_optimization_level": 0}`` for faster compiles. A
      step whose traced program has FP8 GEMMs (FP8 layers, an FP8
      ``autocast=`` in any form) compiles with
      `jmp_amp.fp8.compiler_options()` (on a CUDA GPU, Triton GEMMs off)
      under these options, which win: XLA's GEMM autotuner otherwise spends
      a minute or more timing Triton kernels for the FP8 GEMMs, then picks
      cuBLAS's (see docs/fp8.md).
    numerics: None, or the modules (path globs such as ``"blocks/*/attn"``,
      ``"**"`` for all, module classes, or a list of them) whose output and
      param-gradient statistics the step computes on device and returns as
      ``metrics["numerics"]``, a nested dict of arrays
      ``{path: {"out": stats, "grad": stats}}`` (see
      `jmp_amp.flax.numerics`; print with `jmp_amp.numerics.format_stats`).
      None compiles exactly the step without it.
    on_nonfinite: None, or a callable given the report of
      `jmp_amp.numerics.find_nonfinite` (with ``step``, ``loss_scale`` and
      ``repeats`` filled in) for every distinct non-finite event (e.g.
      ``print``): a site (op and module, or input) not reported before; an
      inf/NaN in the inputs or the forward pass, each time it starts a run
      of non-finite steps; and a run of non-finite steps that persists for
      8 steps (then 16, 32, ...) in spite of the loss-scale backoffs. A
      routine backoff at a site already reported is not reported again. When the op-by-op replay finds no
      culprit, the report says so (``primitive="unknown"``); the callback
      never gets None. Costs one host read of ``grads_finite`` per step
      (the step waits for the device) and, on the 1st, 2nd, 4th, 8th...
      non-finite step of a run, an op-by-op run of the loss and its
      gradient outside `jit`. The compiled step is unchanged. The localiser
      runs the model after the step (a skipped step left the params as
      they were) with the loss scale the step used; it does not apply
      ``autocast``.

  Returns:
    The step function.
  """
  if not callable(loss_fn):
    raise TypeError(f"loss_fn must be callable, got {loss_fn!r}")
  if on_nonfinite is not None and not callable(on_nonfinite):
    raise TypeError(f"on_nonfinite must be None or a callable, got "
                    f"{on_nonfinite!r}")
  hook = _step_parts.autocast_hook(autocast)
  if numerics is not None:
    numerics_lib.grad_stats(None, {}, numerics)  # Checks `numerics` now.

  def step(model: nnx.Module, optimizer: nnx.Optimizer, batch: Any):
    _step_parts.check_optimizer(optimizer)
    # The FP8 amax histories are differentiated too: their "gradients" are
    # their new values, which value_and_grad writes into the model.
    diff = nnx.Any(wrt, _fp8_op.FP8Meta)
    graphdef, _, rest = nnx.split(model, diff, ...)
    opt_state = _step_parts.optax_state(optimizer)

    seen = {}  # what the capture saw (at trace time)

    def forward(params, rest, batch):
      # copy: fresh Variables of this trace, which the forward pass may update.
      m = nnx.merge(graphdef, params, rest, copy=True)
      if numerics is None:
        loss, aux = _step_parts.split_loss(loss_fn(m, batch), has_aux)
        return loss, aux, nnx.split(m, diff, ...)[2]
      (loss, aux), seen["captured"] = _capture.capture(
          lambda m, b: _step_parts.split_loss(loss_fn(m, b), has_aux), m,
          (batch,))
      return loss, (aux, seen["captured"].counts), nnx.split(m, diff, ...)[2]

    fn = hook(forward) if hook is not None else forward

    def loss_of(differentiated):
      _, params, inputs = nnx.split(differentiated, diff, ...)
      loss, aux, new_rest = fn(params, inputs, batch)
      return jnp.asarray(loss, jnp.float32), (aux, new_rest)

    # The loss is scaled as jmp_amp.scaled_value_and_grad scales it; the
    # FP8-aware value_and_grad differentiates it.
    (_, (loss, (_, (aux, new_rest)))), grads = _fp8.value_and_grad(
        scaled_loss_fn(loss_of, opt_state, has_aux=True), has_aux=True,
        wrt=wrt)(model)
    if numerics is not None:
      aux, counts = aux
      stats = _capture.step_stats(
          model, grads, numerics,
          dataclasses.replace(seen["captured"], counts=counts))
    optimizer.update(model, grads)
    metrics = _step_parts.step_metrics(_step_parts.optax_state(optimizer),
                                       loss, aux, has_aux)
    if numerics is not None:
      metrics["numerics"] = stats

    new_rest = _step_parts.like(new_rest, rest)
    reverted_new, kept = nnx.split_state(new_rest, revert_on_skip, ...)
    reverted_old = nnx.filter_state(rest, revert_on_skip)
    nnx.update(model, kept, where_tree(
        metrics["grads_finite"], reverted_new, reverted_old))
    return metrics

  run = step if not jit else _jit_nnx_step(
      step, donate=donate, compiler_options=compiler_options)
  if on_nonfinite is None:
    return run
  return _step_parts.with_localiser(run, loss_fn, on_nonfinite,
                         replay_note="" if autocast is None else
                         "which does not apply autocast=")


def _jit_nnx_step(step: Callable[..., Any], *, donate: bool,
                  compiler_options: Optional[dict[str, Any]]):
  """`step(model, optimizer, batch)` as a jax.jit over their split state,
  compiled with `jmp_amp.fp8.compiler_options()` under `compiler_options`
  when its traced program has FP8 GEMMs (once per model structure)."""

  def pure(graphdef, state, batch):
    model, optimizer = nnx.merge(graphdef, state)
    metrics = step(model, optimizer, batch)
    return nnx.state((model, optimizer)), metrics

  jitted = fp8_compile.step_jit(
      pure, options=compiler_options, key=lambda graphdef, *_: graphdef,
      static_argnums=0, donate_argnums=(1,) if donate else ())
  check_replicas = _step_parts.replica_check(_step_parts.optax_state)

  def split(model, optimizer):
    _step_parts.check_optimizer(optimizer)
    return nnx.split((model, optimizer))

  @functools.wraps(step)
  def run(model: nnx.Module, optimizer: nnx.Optimizer, batch: Any):
    graphdef, state = split(model, optimizer)
    check_replicas(optimizer)
    new_state, metrics = jitted(graphdef, state, batch)
    nnx.update((model, optimizer), new_state)
    return metrics

  def lower(model: nnx.Module, optimizer: nnx.Optimizer, batch: Any):
    graphdef, state = split(model, optimizer)
    return jitted.lower(graphdef, state, batch)

  run.lower = lower
  return run


# --------------------------------------------------------------------------
# linen.


def make_linen_train_step(loss_fn: Callable[[Callable[..., Any], Any], Any],
                          *,
                          has_aux: bool = False,
                          autocast: AutocastSpec = None,
                          mutable: Sequence[str] = ("batch_stats",),
                          revert_on_skip: bool = True,
                          donate: bool = True,
                          jit: bool = True,
                          compiler_options: Optional[dict[str, Any]] = None,
                          numerics: Any = None,
                          ) -> Callable[..., Any]:
  """Builds ``step(state, batch) -> (state, metrics)`` for a linen TrainState.

  `state` is a `flax.training.train_state.TrainState` (or subclass, e.g.
  `jmp_amp.flax.train.TrainState` with ``batch_stats``) whose `tx` contains
  `jmp_amp.loss_scaling`; make its ``apply_fn``
  ``functools.partial(jmp_amp.flax.apply_with_policies, module, rules)``
  for per-module policies.

  Example:
    >>> import functools
    >>> import jmp_amp.flax
    >>> module = nn.Sequential([nn.Dense(4), nn.BatchNorm(False)])
    >>> variables = module.init(jax.random.key(0), jnp.ones((2, 3)))
    >>> state = jmp_amp.flax.train.TrainState.create(
    ...     apply_fn=functools.partial(jmp_amp.flax.apply_with_policies,
    ...                                module, "mixed_float16"),
    ...     params=variables["params"], batch_stats=variables["batch_stats"],
    ...     tx=jmp_amp.loss_scaling(optax.sgd(0.1),
    ...                             jmp_amp.DynamicLossScale(2.0 ** 15)))
    >>> def loss_fn(model, batch):
    ...   logits = model(batch["image"]).astype(jnp.float32)
    ...   return optax.softmax_cross_entropy_with_integer_labels(
    ...       logits, batch["label"]).mean()
    >>> step = jmp_amp.flax.make_linen_train_step(loss_fn)
    >>> batch = {"image": jnp.ones((2, 3)), "label": jnp.array([0, 3])}
    >>> state, metrics = step(state, batch)
    >>> int(metrics["steps"]), state.batch_stats["layers_1"]["mean"].dtype
    (1, dtype('float32'))

  Args:
    loss_fn: ``loss_fn(model, batch)``, where ``model(*args, **kwargs)``
      calls ``state.apply_fn`` with the current params and mutable
      collections and returns the output.
    has_aux: whether `loss_fn` returns ``(loss, aux)``.
    autocast: as for `make_train_step`; the pure function transformed is
      ``(params, collections, batch) -> (loss, aux, collections)``.
    mutable: names of state fields holding mutable variable collections
      (fields that are missing or None are skipped).
    revert_on_skip: keep the previous collections on a skipped step.
    donate: donate the state's buffers.
    jit: wrap the step in `jax.jit`.
    compiler_options: XLA options for `jax.jit` (over
      `jmp_amp.fp8.compiler_options()` when the step has FP8 GEMMs, as in
      `make_train_step`).

    numerics: None, or the modules whose output and param-gradient
      statistics go to ``metrics["numerics"]``, as for `make_train_step`
      (paths as `apply_with_policies` sees them, e.g. ``"Dense_0"``).

  Returns:
    The step function.
  """
  if not callable(loss_fn):
    raise TypeError(f"loss_fn must be callable, got {loss_fn!r}")
  if numerics is not None:
    numerics_lib.grad_stats(None, {}, numerics)  # Checks `numerics` now.
  if isinstance(mutable, str):
    mutable = (mutable,)
  hook = _step_parts.autocast_hook(autocast)

  def step(state: train_state.TrainState, batch: Any):
    cols = {name: getattr(state, name) for name in mutable
            if getattr(state, name, None) is not None}
    def forward(params, cols, batch):
      box = dict(cols)

      def model(*args, **kwargs):
        variables = {"params": params, **box}
        if not box:
          return state.apply_fn(variables, *args, **kwargs)
        out, updates = state.apply_fn(variables, *args, mutable=list(box),
                                      **kwargs)
        box.update(updates)
        return out

      if numerics is None:
        loss, aux = _step_parts.split_loss(loss_fn(model, batch), has_aux)
        return loss, aux, box
      (loss, aux), outputs = numerics_lib.output_stats(
          lambda _, b: _step_parts.split_loss(loss_fn(model, b), has_aux),
          None, batch, select=numerics)
      return loss, (aux, outputs), box

    fn = hook(forward) if hook is not None else forward

    def loss_of(params):
      loss, aux, new_cols = fn(params, cols, batch)
      return jnp.asarray(loss, jnp.float32), (aux, new_cols)

    jmp_amp.get_scaling_state(state.opt_state)  # A clear error if missing.
    (loss, (aux, new_cols)), grads = jmp_amp.scaled_value_and_grad(
        loss_of, has_aux=True)(state.opt_state, state.params)
    if numerics is not None:
      aux, outputs = aux
      stats = _capture.merge(outputs, _capture.step_stats(
          None, grads, numerics, None))
    state = state.apply_gradients(grads=grads)
    metrics = _step_parts.step_metrics(state.opt_state, loss, aux, has_aux)
    if numerics is not None:
      metrics["numerics"] = stats
    new_cols = _step_parts.like(dict(new_cols), cols)
    if revert_on_skip:
      new_cols = where_tree(metrics["grads_finite"], new_cols, cols)
    return state.replace(**new_cols), metrics

  if not jit:
    return step
  jitted = fp8_compile.step_jit(step, options=compiler_options,
                            donate_argnums=(0,) if donate else ())
  if jax.process_count() == 1:
    return jitted
  check_replicas = _step_parts.replica_check(
      lambda state, batch: state.opt_state)

  @functools.wraps(step)
  def run(state: train_state.TrainState, batch: Any):
    check_replicas(state, batch)
    return jitted(state, batch)

  run.lower = jitted.lower
  return run
