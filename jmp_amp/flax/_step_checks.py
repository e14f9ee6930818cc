"""Host-side checks around the jitted Flax train steps.

The optimizer argument's type, the processes' copies of the loss-scaling
state (first call, multi-process runs), and the ``on_nonfinite`` localiser,
which reads each step's ``grads_finite`` and reports the non-finite events.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

from flax import nnx
import jax
import jax.numpy as jnp

import jmp_amp
from jmp_amp._src import localise
from jmp_amp._src import replicas
from jmp_amp.flax import numerics as numerics_lib


def replica_check(opt_state_of: Callable[[Any], Any]) -> Callable[..., None]:
  """On the first call of a multi-process step: do the processes hold the
  same loss-scaling state? (Each would otherwise train on with its own.)"""
  return replicas.check_once(
      lambda *args: replicas.scaling_leaves(
          jmp_amp.get_scaling_state(opt_state_of(*args))),
      "the train step's first call",
      "Every process must start with the same loss scale (the same "
      "jmp_amp.loss_scaling(..., loss_scale) arguments) or restore the same "
      "checkpoint; otherwise each process's scale, moments and params drift "
      "apart without a word.")


def optax_state(optimizer: nnx.Optimizer) -> Any:
  """The optax state an `nnx.Optimizer` holds, its Variables unwrapped.

  (`nnx.as_pure` does this from Flax 0.12.7 on; this works on every version.)
  """
  return jax.tree.map(
      lambda x: x.get_value() if isinstance(x, nnx.Variable) else x,
      optimizer.opt_state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def check_optimizer(optimizer: Any) -> None:
  if not isinstance(optimizer, nnx.Optimizer):
    raise TypeError("make_train_step's step takes (model, optimizer, batch) "
                    f"with an nnx.Optimizer, got {type(optimizer).__name__}")


# A run of non-finite steps this long (and each doubling of it) is reported
# whatever its site: the loss-scale backoffs have not cured it.
PERSISTENT_RUN = 8


def with_localiser(run: Callable[..., Any], loss_fn: Callable[..., Any],
                    callback: Callable[[Any], Any], replay_note: str = ""
                    ) -> Callable[..., Any]:
  """`run`, which hands the non-finite steps' events to the localiser.

  An event is reported when its site (direction, module, op, source or
  input) was never reported before; an input or forward non-finite (which
  no backoff cures) when it starts a run of non-finite steps; and any site
  when the run reaches `PERSISTENT_RUN` steps and each doubling after. The
  localiser runs on the 1st, 2nd, 4th, 8th... step of a run.
  """
  reported: set[tuple] = set()
  run_length = [0]

  @functools.wraps(run)
  def checked(model: nnx.Module, optimizer: nnx.Optimizer, batch: Any):
    check_optimizer(optimizer)
    # A device copy: the step donates the optimizer state's buffers.
    scale = jax.tree.map(jnp.copy, jmp_amp.get_scaling_state(
        optax_state(optimizer)).loss_scale)
    metrics = run(model, optimizer, batch)
    if (bool(metrics["grads_finite"])
        and bool(jnp.isfinite(metrics["loss"]))):
      run_length[0] = 0
      return metrics
    run_length[0] += 1
    n = run_length[0]
    if n & (n - 1):  # Not a power of two: rate-limited.
      return metrics
    report = numerics_lib.localise_model(model, loss_fn, batch,
                                         loss_scale=scale)
    if report is None:
      report = localise.NonFinite(
          primitive="unknown", direction="unknown", module=None,
          source=", ".join(s for s in (
              "jmp_amp.numerics.find_nonfinite", replay_note) if s),
          name_stack="", in_dtypes=(), out_dtypes=(), max_finite=0.0,
          outputs=())
    report = dataclasses.replace(
        report, step=int(metrics["steps"]),
        loss_scale=float(jnp.asarray(scale.loss_scale)), repeats=n)
    site = (report.direction, report.module, report.primitive,
            report.source, report.argument)
    routine = report.direction == "backward"
    if (site not in reported or (n == 1 and not routine)
        or n >= PERSISTENT_RUN):
      reported.add(site)
      callback(report)
    return metrics

  if hasattr(run, "lower"):
    checked.lower = run.lower
  return checked
