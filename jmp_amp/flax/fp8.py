"""FP8 matmuls for Flax NNX models, applied from outside.

`set_fp8(model)` gives every module with a ``dot_general`` knob (`nnx.Linear`,
`nnx.LinearGeneral`, or your own module with that knob) an `FP8DotGeneral`:
an NNX module, set as the knob, that runs the matmul with `float8_e4m3fn`
operands forward and `float8_e5m2` gradients backward (see
`jmp_amp._src.fp8`), and sets the module's ``dtype`` knob to the recipe's
compute dtype (bfloat16), so the layer returns bfloat16. Master weights keep
their dtype (float32). By default the first and last such modules keep
their matmul, as FP8 recipes recommend (in call order when `set_fp8` is given
example inputs, otherwise in path order); norms, softmax, embeddings, the
loss and anything without a ``dot_general`` knob are never touched.

Each `FP8DotGeneral` holds its amax histories as `FP8Meta` variables, so they
are part of the model's state: they go through `nnx.split`/`nnx.merge`,
`nnx.jit`, sharding and `jmp_amp.checkpoint` like any other variable, and a
resumed run continues bitwise.

Updating the histories: the new histories are computed inside the jitted
step and arrive as the *gradients* of the `FP8Meta` variables, which the step
writes back instead of handing them to the optimizer (never into optax: the
"gradient" is the new value). `fp8_value_and_grad` does this::

    grad_fn = fp8.fp8_value_and_grad(loss_fn)
    loss, grads = grad_fn(model, batch)    # histories already updated
    optimizer.update(model, grads)         # grads hold nnx.Param only

An optimizer built with ``nnx.Optimizer(model, tx, wrt=nnx.Param)`` never sees
the histories. A step that differentiates only ``nnx.Param`` still trains
under current scaling (the default), whose scales need no history; only the
monitoring histories then stay at zero. Delayed scaling needs the update:
without it its history stays empty and it falls back to current scaling.

Loss scaling: E5M2 spans the float32-like range of the bfloat16 gradients and
each gradient tensor gets its own scale from its amax, so no loss scaling is
needed (``jmp_amp.NoOpLossScale``, or plain optax). It still composes with
`jmp_amp.loss_scaling`: the gradient amax is then that of the scaled
gradient, and its scale follows; infinities and NaN pass through the FP8
rounding, so an overflow is still detected and the step skipped, and
non-finite amaxes never enter a history.

Example:
  >>> import models
  >>> from jmp_amp.flax import fp8
  >>> model = models.MLP(16, 4, num_layers=4, width=32, rngs=nnx.Rngs(0))
  >>> model = fp8.set_fp8(model)          # or fp8.delayed_scaling(16)
  >>> sorted(fp8.fp8_modules(model))
  ['layers/1', 'layers/2']
  >>> model(jnp.ones((2, 16))).dtype
  dtype('float32')
"""

from __future__ import annotations

import fnmatch
from typing import Any, Callable, Iterable, Optional, TypeVar, Union

from flax import nnx
import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

from jmp_amp._src import fp8 as fp8_lib

# The recipe types, so that this module alone is the FP8 entry point.
FP8Recipe = fp8_lib.FP8Recipe
FP8State = fp8_lib.FP8State
delayed_scaling = fp8_lib.delayed_scaling

M = TypeVar("M", bound=nnx.Module)
Selector = Union[str, type]

_KNOB = "dot_general"


class FP8Meta(nnx.Variable):
  """amax history of one tensor of an FP8 matmul (float32, newest first).

  Updated by overwriting it with its gradient (`update_fp8_state`), never by
  an optimizer.
  """


class FP8DotGeneral(nnx.Module):
  """A ``dot_general`` knob value running the matmul in FP8.

  Attributes:
    recipe: the `jmp_amp._src.fp8.FP8Recipe` (static).
    lhs_amax_history, rhs_amax_history, grad_amax_history: `FP8Meta`
      histories of the input, the kernel and the output gradient.
    original_dot_general, original_dtype: the knobs it replaced (static),
      restored by `clear_fp8`.

  A module called more than once per step (shared weights) would receive the
  sum of its new histories; give each call its own module, or exclude it.
  """

  def __init__(self, recipe: fp8_lib.FP8Recipe = fp8_lib.FP8Recipe(), *,
               original_dot_general: Any = lax.dot_general,
               original_dtype: Any = None):
    self.recipe = recipe
    self.original_dot_general = original_dot_general
    self.original_dtype = original_dtype
    state = fp8_lib.init_state(recipe)
    self.lhs_amax_history = FP8Meta(state.lhs)
    self.rhs_amax_history = FP8Meta(state.rhs)
    self.grad_amax_history = FP8Meta(state.grad)

  def state(self) -> fp8_lib.FP8State:
    """The histories as an `FP8State` of arrays."""
    return fp8_lib.FP8State(self.lhs_amax_history[...],
                            self.rhs_amax_history[...],
                            self.grad_amax_history[...])

  def __call__(self, lhs, rhs, dimension_numbers, precision=None,
               preferred_element_type=None, out_sharding=None):
    return fp8_lib.fp8_dot_general(
        lhs, rhs, dimension_numbers, precision=precision,
        preferred_element_type=preferred_element_type, state=self.state(),
        recipe=self.recipe, out_sharding=out_sharding)


# --------------------------------------------------------------------------
# Applying FP8.


def set_fp8(model: M,
            recipe: Union[fp8_lib.FP8Recipe, str, None] = None, *,
            include: Optional[Iterable[Selector]] = None,
            exclude: Iterable[Selector] = (),
            keep_first_last: bool = True,
            example_args: Optional[tuple] = None) -> M:
  """Runs the matmuls of `model`'s ``dot_general`` modules in FP8, in place.

  Calling it again replaces the previous FP8 set-up (with fresh histories).

  Example:
    >>> import models
    >>> from jmp_amp.flax import fp8
    >>> model = models.GPT(vocab_size=32, d_model=16, num_heads=2,
    ...                    num_layers=1, max_len=8, rngs=nnx.Rngs(0))
    >>> _ = fp8.set_fp8(model, "delayed")  # path order: attn/proj sorts first
    >>> sorted(fp8.fp8_modules(model))
    ['blocks/0/attn/qkv', 'blocks/0/mlp/fc']
    >>> tokens = jax.ShapeDtypeStruct((2, 8), jnp.int32)
    >>> _ = fp8.set_fp8(model, "delayed", example_args=(tokens,))  # call order
    >>> sorted(fp8.fp8_modules(model))
    ['blocks/0/attn/proj', 'blocks/0/mlp/fc']

  Args:
    model: the `nnx.Module`.
    recipe: an `FP8Recipe`, ``"current"`` (the default) or ``"delayed"``
      (history of 16 steps).
    include: path glob patterns (``"blocks/*/mlp/*"``) or module classes
      selecting the modules to convert; None selects every module with a
      ``dot_general`` knob. A selected module without that knob raises.
    exclude: patterns or classes of modules to leave alone (applied after
      `include`).
    keep_first_last: when `include` is None, leave the first and the last
      candidate module alone: in call order if `example_args` is given,
      otherwise in path order (list indices numerically), which for models
      whose attribute names do not sort in call order (the GPT's
      ``attn/proj`` sorts before ``attn/qkv``) is not the call order.
    example_args: inputs (arrays or `jax.ShapeDtypeStruct`) for one abstract
      call ``model(*example_args)`` (nothing is computed) that finds the call
      order for `keep_first_last`.

  Returns:
    `model`, for chaining.

  Raises:
    TypeError: `model` is not an nnx.Module, a selector is neither a str nor
      a class, or `recipe` is not a recipe.
    ValueError: a selector matches no module, or `include` selects a module
      FP8 cannot handle (no ``dot_general`` knob, e.g. nnx.Conv, nnx.Einsum,
      nnx.Embed, a norm).
  """
  if not isinstance(model, nnx.Module):
    raise TypeError(f"set_fp8 expects an nnx.Module, got "
                    f"{type(model).__name__}")
  recipe = _recipe(recipe)
  include = None if include is None else _selectors(include, "include")
  exclude = _selectors(exclude, "exclude")
  modules = _ordered_modules(model)
  if include is None:
    chosen = [(p, m) for p, m in modules if _capable(m)]
    if keep_first_last:
      if example_args is not None:
        chosen = _call_order(model, chosen, tuple(example_args))
      chosen = chosen[1:-1]
  else:
    chosen = _select(modules, include, "include")
    for path, module in chosen:
      _check_capable(path, module)
  excluded = {p for p, _ in _select(modules, exclude, "exclude")}
  chosen_paths = {p for p, _ in chosen if p not in excluded}
  for path, module in modules:
    if path in chosen_paths:
      _convert(module, recipe)
    elif isinstance(getattr(module, _KNOB, None), FP8DotGeneral):
      _restore(module)
  return model


def clear_fp8(model: M) -> M:
  """Undoes `set_fp8`: the original ``dot_general`` and ``dtype`` knobs."""
  for _, module in _ordered_modules(model):
    if isinstance(getattr(module, _KNOB, None), FP8DotGeneral):
      _restore(module)
  return model


def fp8_modules(model: nnx.Module) -> dict[str, FP8DotGeneral]:
  """The `FP8DotGeneral` of each FP8 module, keyed by '/'-joined path."""
  return {_path_str(p): getattr(m, _KNOB)
          for p, m in _ordered_modules(model)
          if isinstance(getattr(m, _KNOB, None), FP8DotGeneral)}


def fp8_histories(model: nnx.Module) -> dict[str, fp8_lib.FP8State]:
  """The amax histories (`FP8State` of arrays) of each FP8 module.

  For monitoring; also inside a jitted step. The scale a tensor gets from a
  history is ``jmp_amp._src.fp8.compute_scale(max(history), fp8_dtype)``.
  """
  return {path: op.state() for path, op in fp8_modules(model).items()}


# --------------------------------------------------------------------------
# Train-step helpers.


def update_fp8_state(model: nnx.Module, grads: nnx.State) -> nnx.State:
  """Writes the `FP8Meta` "gradients" (the new histories) into `model`.

  Args:
    model: the model the gradients were taken of.
    grads: gradients with respect to a filter that includes `FP8Meta`.

  Returns:
    `grads` without the `FP8Meta` entries, for the optimizer.
  """
  histories, rest = nnx.split_state(grads, FP8Meta, ...)
  nnx.update(model, histories)
  return rest


def fp8_value_and_grad(loss_fn: Callable[..., Any], *, has_aux: bool = False,
                       wrt: Any = nnx.Param) -> Callable[..., Any]:
  """`nnx.value_and_grad` of ``loss_fn(model, *args)`` that updates FP8 state.

  The returned function differentiates with respect to `wrt` and the
  `FP8Meta` histories, writes the new histories into the model
  (`update_fp8_state`) and returns ``(value, grads)`` with the `wrt`
  gradients only. Call it inside `nnx.jit` (or a `jax.jit` over split state).

  Example:
    >>> import models
    >>> from jmp_amp.flax import fp8
    >>> model = fp8.set_fp8(
    ...     models.MLP(8, 2, num_layers=3, width=16, rngs=nnx.Rngs(0)),
    ...     fp8.delayed_scaling(history_len=4), keep_first_last=False)
    >>> opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    >>> @nnx.jit
    ... def step(model, opt, x, y):
    ...   grad_fn = fp8.fp8_value_and_grad(lambda m: models.mse_loss(m(x), y))
    ...   loss, grads = grad_fn(model)
    ...   opt.update(model, grads)
    ...   return loss
    >>> loss = step(model, opt, jnp.ones((4, 8)), jnp.zeros((4, 2)))
    >>> float(fp8.fp8_histories(model)["layers/0"].lhs[0])
    1.0
  """
  if not callable(loss_fn):
    raise TypeError(f"loss_fn must be callable, got {loss_fn!r}")
  argnums = nnx.DiffState(0, nnx.Any(wrt, FP8Meta))
  grad_fn = nnx.value_and_grad(loss_fn, argnums=argnums, has_aux=has_aux)

  def value_and_grad(model: nnx.Module, *args, **kwargs):
    value, grads = grad_fn(model, *args, **kwargs)
    return value, update_fp8_state(model, grads)

  return value_and_grad


# --------------------------------------------------------------------------
# Internals.


def _recipe(recipe: Any) -> fp8_lib.FP8Recipe:
  if recipe is None or recipe == "current":
    return fp8_lib.FP8Recipe()
  if recipe == "delayed":
    return fp8_lib.delayed_scaling()
  if isinstance(recipe, fp8_lib.FP8Recipe):
    return recipe
  raise TypeError(f"recipe must be an FP8Recipe, 'current' or 'delayed', "
                  f"got {recipe!r}")


def _selectors(selectors: Any, name: str) -> tuple[Selector, ...]:
  if isinstance(selectors, (str, type)):
    selectors = (selectors,)
  try:
    selectors = tuple(selectors)
  except TypeError:
    raise TypeError(f"{name} must be an iterable of path patterns (str) or "
                    f"module classes, got {selectors!r}") from None
  for s in selectors:
    if not isinstance(s, (str, type)):
      raise TypeError(f"{name} entries must be path patterns (str) or module "
                      f"classes, got {s!r}")
  return selectors


def _matches(selector: Selector, path: str, module: nnx.Module) -> bool:
  if isinstance(selector, type):
    return isinstance(module, selector)
  return fnmatch.fnmatchcase(path, selector)


def _select(modules, selectors, name):
  chosen = []
  for selector in selectors:
    hits = [(p, m) for p, m in modules
            if _matches(selector, _path_str(p), m)]
    if not hits:
      raise ValueError(f"{name} selector {selector!r} matches no module; "
                       f"module paths look like "
                       f"{[_path_str(p) for p, _ in modules[1:4]]}")
    chosen.extend(h for h in hits if h not in chosen)
  return chosen


def _capable(module: nnx.Module) -> bool:
  knob = getattr(module, _KNOB, None)
  return (_KNOB in vars(module)
          and (knob is None or callable(knob))
          and getattr(module, "dot_general_cls", None) is None)


def _check_capable(path: tuple, module: nnx.Module) -> None:
  if not _capable(module):
    raise ValueError(
        f"FP8 cannot handle module {_path_str(path)!r} of type "
        f"{type(module).__name__}: set_fp8 converts modules with a "
        f"'dot_general' knob (nnx.Linear, nnx.LinearGeneral) and no "
        f"'dot_general_cls'; convolutions, einsums, embeddings and norms "
        f"stay in their policy's dtype. Exclude it or narrow `include`.")


def _convert(module: nnx.Module, recipe: fp8_lib.FP8Recipe) -> None:
  current = getattr(module, _KNOB)
  if isinstance(current, FP8DotGeneral):
    original, dtype = current.original_dot_general, current.original_dtype
  else:
    original, dtype = current, getattr(module, "dtype", None)
  op = FP8DotGeneral(recipe, original_dot_general=original,
                     original_dtype=dtype)
  setattr(module, _KNOB, nnx.data(op))
  if "dtype" in vars(module):
    setattr(module, "dtype", recipe.compute_dtype)


def _restore(module: nnx.Module) -> None:
  op = getattr(module, _KNOB)
  # nnx.static: the attribute became data when it held the FP8 module.
  setattr(module, _KNOB, nnx.static(op.original_dot_general))
  if "dtype" in vars(module):
    setattr(module, "dtype", op.original_dtype)


def _path_str(path: tuple) -> str:
  return "/".join(str(p) for p in path)


def _path_key(path: tuple) -> tuple:
  """Sort key: list indices numerically (layers/2 before layers/10)."""
  return tuple((0, k, "") if isinstance(k, int) else (1, 0, str(k))
               for k in path)


def _ordered_modules(model: nnx.Module) -> list[tuple[tuple, nnx.Module]]:
  """(path, module) pairs of `nnx.iter_modules`, in path order.

  Path order, not attribute-assignment order: it is the same after
  `nnx.split`/`nnx.merge`, `nnx.eval_shape` or a restore.
  `FP8DotGeneral` modules themselves are left out.
  """
  pairs = [(tuple(p), m) for p, m in nnx.iter_modules(model)
           if not isinstance(m, FP8DotGeneral)]
  return sorted(pairs, key=lambda pm: _path_key(pm[0]))


def _call_order(model: nnx.Module, candidates: list, example_args: tuple
                ) -> list:
  """`candidates` in the order an abstract ``model(*example_args)`` calls them.

  Each candidate's ``dot_general`` knob is swapped, for the duration of one
  `nnx.eval_shape` pass, for a wrapper that records the module's path.
  Candidates the pass does not call go last, in path order.
  """
  calls: list[tuple] = []

  def recorder(path, original):
    original = lax.dot_general if original is None else original

    def dot_general(*args, **kwargs):
      if path not in calls:
        calls.append(path)
      return original(*args, **kwargs)
    return dot_general

  saved = [(m, getattr(m, _KNOB)) for _, m in candidates]
  try:
    for path, module in candidates:
      current = getattr(module, _KNOB)
      if isinstance(current, FP8DotGeneral):
        current = current.original_dot_general
      setattr(module, _KNOB, nnx.static(recorder(path, current)))
    nnx.eval_shape(lambda m, *a: m(*a), model, *example_args)
  finally:
    for module, knob in saved:
      setattr(module, _KNOB,
              nnx.data(knob) if isinstance(knob, FP8DotGeneral) else knob)
  rank = {p: i for i, p in enumerate(calls)}
  return sorted(candidates, key=lambda pm: (rank.get(pm[0], len(rank)),
                                            _path_key(pm[0])))
