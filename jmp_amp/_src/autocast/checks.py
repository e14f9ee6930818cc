"""What autocast refuses or warns about in the function it is given.

autocast traces a function and interprets it; some functions trace fine
and still give a wrong answer: one that updates Flax NNX objects in place
(autocast hands it copies), a train step whose float32 state a half output
dtype would round, a gradient whose backward matmuls float8 mode would
quantize as forward ones.
"""

from __future__ import annotations

import sys
from typing import Any
import warnings

import jax
import jax.extend.core as jex_core
import numpy as np

from jmp_amp._src import dtypes
from jmp_amp._src.autocast.casting import dtype_of
from jmp_amp._src.policy import Policy


def _backward_matmuls(jaxpr, matmuls) -> int:
  """How many FP8-list matmuls of `jaxpr` (sub-jaxprs included) a transpose
  made: the backward pass of a gradient computed inside the function."""
  if isinstance(jaxpr, jex_core.ClosedJaxpr):
    jaxpr = jaxpr.jaxpr
  count = 0
  for eqn in jaxpr.eqns:
    if (eqn.primitive.name in matmuls
        and "transpose(" in str(eqn.source_info.name_stack)):
      count += 1
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(sub, (jex_core.ClosedJaxpr, jex_core.Jaxpr)):
          count += _backward_matmuls(sub, matmuls)
  return count


def warn_fp8_backward(closed, matmuls) -> None:
  """Warns if float8 mode would round backward matmuls as forward ones."""
  count = _backward_matmuls(closed, matmuls)
  if count:
    warnings.warn(
        f"autocast(fn, \"float8\") of a function that computes gradients "
        f"({count} matmul(s) of its backward pass, e.g. fn = jax.grad(loss)) "
        "quantizes them as forward matmuls, both operands in float8_e4m3fn; "
        "jax.grad(jmp_amp.autocast(loss, \"float8\")) quantizes the "
        "gradient in float8_e5m2, as FP8 training does. Autocast the loss, "
        "then differentiate it.", UserWarning, stacklevel=3)


def _float32_like(out: Any, arg: Any) -> bool:
  """Whether `out` has `arg`'s structure and shapes, with float32 leaves
  where `arg` has them (a step returning its params or optimizer state)."""
  treedef = jax.tree.structure(arg)
  if treedef.num_nodes == 1 or jax.tree.structure(out) != treedef:
    return False  # a bare array: an activation shaped like the input
  pairs = list(zip(jax.tree.leaves(out), jax.tree.leaves(arg)))
  f32 = [(o, a) for o, a in pairs if dtype_of(a) == np.float32]
  return bool(f32) and all(
      dtype_of(o) == np.float32 and np.shape(o) == np.shape(a)
      for o, a in f32)


def warn_state_to_half(out: Any, args: tuple, output_dtype: np.dtype,
                        policy: Policy) -> None:
  """Warns if the output cast would turn float32 state into half: outputs
  shaped like a float32 argument (the params and optimizer state a train
  step returns) lose their float32 master copies."""
  if output_dtype not in dtypes.HALF_DTYPES:
    return
  parts = (list(enumerate(out)) if isinstance(out, (tuple, list))
           else list(out.items()) if isinstance(out, dict) else [])
  parts = [("", out)] + [(f"[{k!r}]", o) for k, o in parts]
  found = [(where, i) for where, o in parts for i, a in enumerate(args)
           if _float32_like(o, a)]
  if not found:
    return
  listed = ", ".join(f"output{where or ''} (like args[{i}])"
                     for where, i in found)
  warnings.warn(
      f"autocast with output dtype {output_dtype.name} ({policy}) casts "
      f"float32 state to {output_dtype.name}: {listed}. A train step "
      "returning its params or optimizer state would lose their float32 "
      "master copies (and Adam's moments). Give the step float32 outputs, "
      "e.g. autocast(step, \"p=f32,c=bf16,o=f32\"), or autocast the loss "
      "inside the step.", UserWarning, stacklevel=3)


def check_nnx_unchanged(args: tuple, kwargs: dict, treedef: Any,
                         leaves: list) -> None:
  """Raises if `fn` changed, in place, an NNX object it was given.

  autocast hands `fn` copies of its arguments (rebuilt from their leaves,
  as `jax.jit` does), so what `fn` writes into a Flax NNX module or
  optimizer (an update, BatchNorm statistics, an RNG count) would be lost.
  """
  nnx = sys.modules.get("flax.nnx")
  if nnx is None:
    return
  is_obj = lambda x: isinstance(x, nnx.Pytree)
  objs = [(jax.tree_util.keystr(path), type(x).__name__) for path, x in
          jax.tree_util.tree_flatten_with_path(
              (args, kwargs), is_leaf=is_obj)[0] if is_obj(x)]
  if not objs:
    return
  now, now_def = jax.tree.flatten((args, kwargs))
  if now_def == treedef and all(x is y for x, y in zip(now, leaves)):
    return
  names = ", ".join(f"{('args', 'kwargs')[int(path[1])]}{path[3:]} "
                    f"({kind})" for path, kind in objs)
  raise TypeError(
      "autocast takes pure functions: fn changed the Flax NNX state it was "
      f"given ({names}) in place, and autocast hands fn copies, so those "
      "updates (optimizer.update, BatchNorm statistics, RNG counts) would "
      "be lost. Autocast the loss and update outside it: "
      "`loss, grads = nnx.value_and_grad(jmp_amp.autocast(loss_fn, policy))"
      "(model, batch); optimizer.update(model, grads)` (a loss that only "
      "reads the model), or give the model its policies with "
      "jmp_amp.flax.set_policies(model, rules) and keep the step as it is.")
