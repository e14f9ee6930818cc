"""The parts the NNX and linen train steps share.

What ``autocast=`` stands for, the loss that ``loss_fn`` returns, the mutable
state put back in its old types, and the metrics with their numerics.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

import jmp_amp
from jmp_amp import Policy
from jmp_amp._src import fp8 as fp8_lib
from jmp_amp._src.scaling_state import scaling_metrics
from jmp_amp.flax import _fp8_op

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
