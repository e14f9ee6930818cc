"""The FP8 state of a Flax NNX model: converting modules, reading histories.

`convert` sets a module's matmul knob to a fresh FP8 op, `restore` puts the
original back; `histories` reads the amax histories of a converted model and
`value_and_grad` differentiates a loss and writes the new histories back.
What users see is in `jmp_amp.flax.fp8`.
"""

from __future__ import annotations

from typing import Any, Callable

from flax import nnx

from jmp_amp._src import fp8 as fp8_lib
from jmp_amp.flax._fp8_op import FP8Meta
from jmp_amp.flax._fp8_op import FP8Op
from jmp_amp.flax._fp8_op import fp8_op
from jmp_amp.flax._fp8_op import knob
from jmp_amp.flax._fp8_op import stack_shape
from jmp_amp.flax._fp8_select import ordered_modules
from jmp_amp.flax._fp8_select import path_str


def ops(model: nnx.Module) -> dict[str, FP8Op]:
  """The FP8 op (`FP8Op`) of each FP8 module, by '/'-joined path.
  """
  return {path_str(p): fp8_op(m) for p, m in ordered_modules(model)
          if fp8_op(m) is not None}


def histories(model: nnx.Module) -> dict[str, fp8_lib.FP8State]:
  """The amax histories of each FP8 module, by '/'-joined path.

  Its keys are the modules whose matmul runs in FP8; each value is a
  `jmp_amp.fp8.FP8State` of float32 arrays (newest first). For monitoring,
  also inside a jitted step.

  Example:
    >>> import jmp_amp.flax
    >>> from jmp_amp import models
    >>> model = models.MLP(8, 2, num_layers=3, width=16, rngs=nnx.Rngs(0))
    >>> _ = jmp_amp.flax.set_policies(model, {"*": "float8"})
    >>> h = jmp_amp.flax.fp8.histories(model)
    >>> list(h), h["layers/1"].lhs.shape   # layers/0 and 2: first and last
    (['layers/1'], (1,))
  """
  return {path: op.state() for path, op in ops(model).items()}


def write_histories(model: nnx.Module, grads: nnx.State) -> nnx.State:
  """Writes the `FP8Meta` "gradients" (the new histories) into `model`.

  Returns `grads` without the `FP8Meta` entries, for the optimizer.
  """
  new, rest = nnx.split_state(grads, FP8Meta, ...)
  nnx.update(model, new)
  return rest


def value_and_grad(loss_fn: Callable[..., Any], *, has_aux: bool = False,
                   wrt: Any = nnx.Param) -> Callable[..., Any]:
  """`nnx.value_and_grad` of ``loss_fn(model, *args)`` that updates FP8 state.

  The returned function differentiates with respect to `wrt` and the
  `FP8Meta` histories, writes the new histories into the model and returns
  ``(value, grads)`` with the `wrt` gradients only, for the optimizer. Call
  it inside `nnx.jit` (or a `jax.jit` over split state);
  `jmp_amp.flax.make_train_step` uses it.

  Example:
    >>> import jmp_amp.flax
    >>> from jmp_amp import models
    >>> model = jmp_amp.flax.set_policies(
    ...     models.MLP(8, 2, num_layers=3, width=16, rngs=nnx.Rngs(0)),
    ...     jmp_amp.flax.fp8.FP8Policy(jmp_amp.fp8.FP8Recipe(
    ...         scaling="delayed", history_len=4), keep_first_last=False))
    >>> opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    >>> @nnx.jit
    ... def step(model, opt, x, y):
    ...   grad_fn = jmp_amp.flax.fp8.value_and_grad(
    ...       lambda m: models.mse_loss(m(x), y))
    ...   loss, grads = grad_fn(model)
    ...   opt.update(model, grads)
    ...   return loss
    >>> loss = step(model, opt, jnp.ones((4, 8)), jnp.zeros((4, 2)))
    >>> float(jmp_amp.flax.fp8.histories(model)["layers/0"].lhs[0])
    1.0

  Args:
    loss_fn: ``loss_fn(model, *args, **kwargs)`` returning the loss, or
      ``(loss, aux)`` with `has_aux`.
    has_aux: as for `nnx.value_and_grad`.
    wrt: filter of the variables to differentiate (`nnx.Param`), as given
      to `nnx.Optimizer`.

  Returns:
    ``fn(model, *args, **kwargs) -> (value, grads)``.
  """
  if not callable(loss_fn):
    raise TypeError(f"loss_fn must be callable, got {loss_fn!r}")
  argnums = nnx.DiffState(0, nnx.Any(wrt, FP8Meta))
  grad_fn = nnx.value_and_grad(loss_fn, argnums=argnums, has_aux=has_aux)

  def fn(model: nnx.Module, *args, **kwargs):
    value, grads = grad_fn(model, *args, **kwargs)
    return value, write_histories(model, grads)

  return fn


# --------------------------------------------------------------------------
# Converting modules.


def convert(module: nnx.Module, recipe: fp8_lib.FP8Recipe,
            path: tuple = ()) -> None:
  """Sets `module`'s matmul knob to a fresh FP8 op and its dtype knob.

  `path`, the module's path in the model, names the op's scope.
  """
  name = knob(module)
  current = vars(module)[name]
  if isinstance(current, FP8Op):
    original, dtype = current.original, current.original_dtype
  else:
    original, dtype = current, getattr(module, "dtype", None)
  op = FP8Op(recipe, knob=name, original=original, original_dtype=dtype,
             name=path_str(path), stack_shape=stack_shape(module))
  setattr(module, name, nnx.data(op))
  if "dtype" in vars(module):
    setattr(module, "dtype", recipe.compute_dtype)


def restore(module: nnx.Module) -> None:
  """Puts back the knobs an FP8 op replaced (no-op without one)."""
  op = fp8_op(module)
  if op is None:
    return
  # nnx.static: the attribute became data when it held the FP8 module.
  setattr(module, op.knob, nnx.static(op.original))
  if "dtype" in vars(module):
    setattr(module, "dtype", op.original_dtype)
