"""The FP8 matmul ops of Flax NNX: the values FP8 gives a module's matmul knob.

An `FP8Op` (`FP8DotGeneral`, `FP8Einsum`, `FP8ConvGeneralDilated`) holds its
matmul's `FP8Meta` amax histories and runs it in FP8; `knob` says which knob
of a module it replaces, `fp8_op` which op a module holds, `stack_shape` the
layer axes its histories are stacked along.
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

from flax import nnx
import jax
import jax.numpy as jnp

from jmp_amp._src import fp8 as fp8_lib
from jmp_amp._src import fp8_ops

# The matmul knobs FP8 replaces, in the order they are looked for.
KNOBS = ("dot_general", "einsum_op", "conv_general_dilated")


class FP8Meta(nnx.Variable):
  """amax history of one tensor of an FP8 matmul (float32, newest first).

  Updated by overwriting it with its gradient (`value_and_grad`), never by
  an optimizer. As an NNX filter, it selects a model's FP8 state.

  Example:
    >>> import jmp_amp.flax
    >>> m = jmp_amp.flax.set_policies(nnx.Linear(2, 2, rngs=nnx.Rngs(0)),
    ...     jmp_amp.flax.fp8.FP8Policy(keep_first_last=False))
    >>> sorted(nnx.state(m, jmp_amp.flax.fp8.FP8Meta)["dot_general"])
    ['grad_amax_history', 'lhs_amax_history', 'rhs_amax_history']
  """


class FP8Op(nnx.Module):
  """A matmul knob value running its matmul in FP8 (one per module).

  Attributes:
    recipe: the `jmp_amp.fp8.FP8Recipe` (static).
    lhs_amax_history, rhs_amax_history, grad_amax_history: `FP8Meta`
      histories of the input, the kernel and the output gradient.
    original, original_dtype: the knob values it replaced (static),
      restored when FP8 is removed.
    name: the '/'-joined path of the module it belongs to (static). The
      matmul runs under ``jax.named_scope(f"fp8[{name}]")``, so the ops of
      the compiled program name their layer (see
      `jmp_amp.tools.MatmulReport.fp8_layers`).

  A module called more than once per step (shared weights) would receive the
  sum of its new histories; give each call its own module, or exclude it.
  """

  knob: str = ""  # The module attribute this op is the value of.

  def __init__(self, recipe: fp8_lib.FP8Recipe = fp8_lib.FP8Recipe(), *,
               original: Any = None, original_dtype: Any = None,
               name: str = "", stack_shape: tuple[int, ...] = ()):
    self.recipe = recipe
    self.original = original
    self.original_dtype = original_dtype
    self.name = name
    state = fp8_lib.init_state(recipe)
    # A module stacked by nnx.vmap (layers run under nnx.scan) gets one
    # history per layer, stacked as its params are.
    stack = lambda h: jnp.zeros(tuple(stack_shape) + h.shape, h.dtype)
    self.lhs_amax_history = FP8Meta(stack(state.lhs))
    self.rhs_amax_history = FP8Meta(stack(state.rhs))
    self.grad_amax_history = FP8Meta(stack(state.grad))

  def state(self) -> fp8_lib.FP8State:
    """The histories as an `FP8State` of arrays."""
    return fp8_lib.FP8State(self.lhs_amax_history[...],
                            self.rhs_amax_history[...],
                            self.grad_amax_history[...])

  def scope(self) -> contextlib.AbstractContextManager:
    """The named scope its matmul runs under: ``fp8[<module path>]``."""
    return jax.named_scope(f"fp8[{self.name}]")


class FP8DotGeneral(FP8Op):
  """The ``dot_general`` knob (nnx.Linear): `jmp_amp.fp8.dot_general`."""

  knob = "dot_general"

  def __call__(self, lhs, rhs, dimension_numbers, precision=None,
               preferred_element_type=None, out_sharding=None):
    with self.scope():
      return fp8_ops.dot_general(
          lhs, rhs, dimension_numbers, precision=precision,
          preferred_element_type=preferred_element_type, state=self.state(),
          recipe=self.recipe, out_sharding=out_sharding)


class FP8Einsum(FP8Op):
  """The ``einsum_op`` knob (nnx.Einsum): `jmp_amp.fp8.einsum`."""

  knob = "einsum_op"

  def __call__(self, subscripts, lhs, rhs, precision=None,
               preferred_element_type=None, out_sharding=None):
    with self.scope():
      return fp8_ops.einsum(
          subscripts, lhs, rhs, precision=precision,
          preferred_element_type=preferred_element_type, state=self.state(),
          recipe=self.recipe, out_sharding=out_sharding)


class FP8ConvGeneralDilated(FP8Op):
  """A ``conv_general_dilated`` knob value (nnx.Conv) in FP8.

  Calls `jmp_amp.fp8.conv_general_dilated`; on an H100 only the forward
  convolution runs on FP8 operands (see `jmp_amp.flax.fp8`).
  """

  knob = "conv_general_dilated"

  def __call__(self, lhs, rhs, window_strides, padding, lhs_dilation=None,
               rhs_dilation=None, dimension_numbers=None,
               feature_group_count=1, batch_group_count=1, precision=None,
               preferred_element_type=None, out_sharding=None):
    with self.scope():
      return fp8_ops.conv_general_dilated(
          lhs, rhs, window_strides, padding, lhs_dilation=lhs_dilation,
          rhs_dilation=rhs_dilation, dimension_numbers=dimension_numbers,
          feature_group_count=feature_group_count,
          batch_group_count=batch_group_count, precision=precision,
          preferred_element_type=preferred_element_type, state=self.state(),
          recipe=self.recipe, out_sharding=out_sharding)


OP_CLASSES = {cls.knob: cls for cls in (FP8DotGeneral, FP8Einsum,
                                         FP8ConvGeneralDilated)}


def knob(module: nnx.Module) -> Optional[str]:
  """The matmul knob FP8 can replace in `module`, or None.

  A knob is a module attribute named in `KNOBS` holding a callable (or
  None, Flax's "default"), without a ``<knob>_cls`` factory that would
  override it (nnx.LinearGeneral's ``dot_general_cls``). ``einsum_op``
  counts on `nnx.Einsum` only: elsewhere it is typically an attention
  contraction between activations, called several times per step, which
  one set of amax histories cannot serve.
  """
  attrs = vars(module)
  for name in KNOBS:
    if name == "einsum_op" and not isinstance(module, nnx.Einsum):
      continue
    if name in attrs:
      value = attrs[name]
      if ((value is None or callable(value))
          and getattr(module, name + "_cls", None) is None):
        return name
  return None


def fp8_op(module: nnx.Module) -> Optional[FP8Op]:
  """The FP8 op `module`'s matmul knob holds, or None."""
  name = knob(module)
  op = None if name is None else vars(module)[name]
  return op if isinstance(op, FP8Op) else None


def stack_shape(module: nnx.Module) -> tuple[int, ...]:
  """The leading axes `nnx.vmap` stacked `module`'s kernel along, or ().

  Known from the kernel's rank against the one the module's own attributes
  give (Linear: 2, Einsum: its kernel_shape's, Conv: its kernel_size's + 2);
  other modules count as unstacked.
  """
  kernel = vars(module).get("kernel")
  if kernel is None:
    return ()
  if isinstance(module, nnx.Einsum):
    rank = len(module.kernel_shape)
  elif isinstance(module, nnx.Conv):
    rank = len(module.kernel_size) + 2
  elif isinstance(module, nnx.Linear):
    rank = 2
  else:
    return ()
  # (.shape: the value may be abstract, a jax.ShapeDtypeStruct.)
  value = kernel.get_value() if isinstance(kernel, nnx.Variable) else kernel
  shape = tuple(value.shape)
  return tuple(shape[:len(shape) - rank])
