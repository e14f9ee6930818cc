"""The parts the NNX and linen train steps share.

What ``autocast=`` stands for, the loss that ``loss_fn`` returns, the mutable
state put back in its old types, and the metrics with their numerics; and
the host-side checks around the jitted steps: the optimizer argument's type,
the processes' copies of the loss-scaling state (first call, multi-process
runs), and the ``on_nonfinite`` localiser, which reads each step's
``grads_finite`` and reports the non-finite events.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional, Union

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

import jmp_amp
from jmp_amp import Policy
from jmp_amp._src import fp8 as fp8_lib
from jmp_amp._src import localise
from jmp_amp._src import replicas
from jmp_amp._src.scaling_state import scaling_metrics
from jmp_amp.flax import _fp8_op
from jmp_amp.flax import numerics as numerics_lib

AutocastSpec = Union[None, str, Policy, Any, Callable[[Callable], Callable]]


def is_fp8_autocast(autocast: AutocastSpec) -> bool:
  """Whether ``autocast=`` runs the matmuls in FP8."""
  return (isinstance(autocast, fp8_lib.FP8Recipe)
          or fp8_lib.is_fp8_name(autocast))


def has_fp8_gemms(model: Any, autocast: AutocastSpec = None) -> bool:
  """Whether a train step of `model` runs FP8 GEMMs: the model has FP8
  layers (it holds their `FP8Meta` histories) or ``autocast=`` is FP8. Such
  a step compiles with `jmp_amp.fp8.compiler_options()`."""
  return is_fp8_autocast(autocast) or bool(
      jax.tree.leaves(nnx.state(model, _fp8_op.FP8Meta)))


def autocast_hook(autocast: AutocastSpec) -> Optional[Callable]:
  """The function transformation the `autocast=` argument stands for."""
  if autocast is None:
    return None
  if is_fp8_autocast(autocast):
    return lambda fn: jmp_amp.autocast(fn, autocast)  # float32 outputs
  if isinstance(autocast, (str, Policy)):
    # The wrapped function returns the loss and model state, not
    # activations: keep those in float32 whatever the policy's output dtype.
    policy = jmp_amp.get_policy(autocast).with_output_dtype(np.float32)
    return lambda fn: jmp_amp.autocast(fn, policy)
  if callable(autocast) and not isinstance(autocast, type):
    return autocast
  try:
    np.dtype(autocast)
  except TypeError:
    raise TypeError(
        "autocast must be None, a policy (string or jmp_amp.Policy), a "
        "floating dtype or a callable fn -> fn, e.g. "
        f"functools.partial(jmp_amp.autocast, policy_or_dtype=...); got "
        f"{autocast!r}") from None
  return lambda fn: jmp_amp.autocast(fn, autocast)


def split_loss(out: Any, has_aux: bool):
  if has_aux:
    if not (isinstance(out, tuple) and len(out) == 2):
      raise TypeError("loss_fn with has_aux=True must return (loss, aux), got "
                      f"{type(out).__name__}")
    loss, aux = out
  else:
    loss, aux = out, None
  loss = jnp.asarray(loss)
  if loss.shape != ():
    raise TypeError(f"loss_fn must return a scalar loss, got shape {loss.shape}"
                    + ("; pass has_aux=True to return (loss, aux)"
                       if isinstance(out, tuple) else ""))
  return loss.astype(jnp.float32), aux


def like(new: Any, old: Any) -> Any:
  """`new` in the tree type and dtypes of `old`.

  `apply` may return dicts where the state held FrozenDicts, and autocast may
  have retyped floating leaves.
  """
  new_leaves = jax.tree_util.tree_leaves(new)
  old_leaves, treedef = jax.tree_util.tree_flatten(old)
  if len(new_leaves) != len(old_leaves):
    raise ValueError("the model changed the structure of its mutable state: "
                     f"{jax.tree_util.tree_structure(new)} vs {treedef}")

  def cast(n, o):
    if hasattr(o, "dtype") and jnp.issubdtype(o.dtype, jnp.floating):
      return jnp.asarray(n).astype(o.dtype)
    return n
  return jax.tree_util.tree_unflatten(
      treedef, [cast(n, o) for n, o in zip(new_leaves, old_leaves)])


def step_metrics(opt_state: Any, loss: jax.Array, aux: Any, has_aux: bool):
  metrics = {"loss": loss, **scaling_metrics(opt_state)}
  if has_aux:
    metrics["aux"] = aux
  return metrics

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
