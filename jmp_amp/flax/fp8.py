"""FP8 matmuls for Flax NNX models, applied from outside.

Two ways in, one mechanism:

* In a rules dict for `jmp_amp.flax.set_policies`, the value ``"float8"``
  (or an `FP8Policy`, or an `FP8Recipe`) makes the modules a rule decides
  run their matmuls in FP8, so one dict mixes bfloat16, float32 and FP8
  modules; `jmp_amp.flax.fp8_rules` is `mixed_rules` with FP8 as the
  default.
* `set_fp8(model)` converts the matmul modules alone, leaving every other
  knob as it is.

A module that can run in FP8 has a matmul knob: ``dot_general``
(`nnx.Linear`, `nnx.LinearGeneral`, your own module with that knob),
``einsum_op`` (`nnx.Einsum`) or ``conv_general_dilated`` (`nnx.Conv`). The
knob gets an NNX module (`FP8DotGeneral`, `FP8Einsum`,
`FP8ConvGeneralDilated`) that runs the matmul with `float8_e4m3fn` operands
forward and `float8_e5m2` gradients backward (see `jmp_amp._src.fp8`), and
the module's ``dtype`` knob becomes the recipe's compute dtype (bfloat16),
so the layer returns bfloat16. Master weights keep their dtype (float32).
By default the first and last such modules keep their matmul, as FP8
recipes recommend (in call order when given example inputs, otherwise in
path order). Norms, softmax, embeddings, the loss and modules without a
matmul knob (nnx.Embed, nnx.ConvTranspose) are never FP8: naming one
explicitly raises. (``einsum_op`` counts on nnx.Einsum only: elsewhere, as in
an attention module, it multiplies activations several times per step.)

Convolutions: compiled for an H100 (XLA:GPU, jax 0.10.2), an FP8
convolution's forward pass is one cuDNN graph convolution
(``__cudnn$convForwardGraph``) with ``f8e4m3fn`` operands and the scales
folded in, but its two backward convolutions (``__cudnn$convForward`` for
the input gradient, ``__cudnn$convBackwardFilter`` for the kernel's) take
bfloat16 operands: XLA fuses FP8 only into forward convolutions. They
compute on FP8-rounded values, so the numerics are FP8's; only a third of a
convolution's FLOPs run on FP8 tensor cores. Einsums and dot_generals get
FP8 cuBLAS GEMMs forward and backward.

Each FP8 op (`FP8DotGeneral`, ...) holds its amax histories as `FP8Meta`
variables, so they are part of the model's state: they go through
`nnx.split`/`nnx.merge`, `nnx.jit`, sharding and `jmp_amp.checkpoint` like
any other variable, and a resumed run continues bitwise.

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
  >>> import jmp_amp.flax
  >>> from jmp_amp import models
  >>> from jmp_amp.flax import fp8
  >>> model = models.MLP(16, 4, num_layers=4, width=32, rngs=nnx.Rngs(0))
  >>> model = fp8.set_fp8(model)          # or fp8.delayed_scaling(16)
  >>> sorted(fp8.fp8_modules(model))
  ['layers/1', 'layers/2']
  >>> model(jnp.ones((2, 16))).dtype
  dtype('float32')

  The same through rules, with the last layer pinned to float32:

  >>> model = models.MLP(16, 4, num_layers=4, width=32, rngs=nnx.Rngs(0))
  >>> rules = {"layers/3": "float32", "*": "float8"}
  >>> model = jmp_amp.flax.set_policies(model, rules)
  >>> sorted(fp8.fp8_modules(model))   # layers/0: first, kept bfloat16
  ['layers/1', 'layers/2']
  >>> str(jmp_amp.flax.policy_of(model.layers[0]))
  'p=f32,c=bf16,o=bf16'
  >>> model(jnp.ones((2, 16))).dtype
  dtype('float32')
"""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Any, Callable, Iterable, Optional, TypeVar, Union

from flax import nnx
import jax.numpy as jnp
from jax import lax

from jmp_amp._src import dtypes as dtypes_lib
from jmp_amp._src import fp8 as fp8_lib
from jmp_amp._src.policy import Policy

# The recipe types, so that this module alone is the FP8 entry point.
FP8Recipe = fp8_lib.FP8Recipe
FP8State = fp8_lib.FP8State
delayed_scaling = fp8_lib.delayed_scaling

M = TypeVar("M", bound=nnx.Module)
Selector = Union[str, type]

# The matmul knobs FP8 replaces, in the order they are looked for.
_KNOBS = ("dot_general", "einsum_op", "conv_general_dilated")


class FP8Meta(nnx.Variable):
  """amax history of one tensor of an FP8 matmul (float32, newest first).

  Updated by overwriting it with its gradient (`update_fp8_state`), never by
  an optimizer.
  """


class FP8Op(nnx.Module):
  """A matmul knob value running its matmul in FP8 (one per module).

  Attributes:
    recipe: the `jmp_amp.FP8Recipe` (static).
    lhs_amax_history, rhs_amax_history, grad_amax_history: `FP8Meta`
      histories of the input, the kernel and the output gradient.
    original, original_dtype: the knob values it replaced (static),
      restored when FP8 is removed.

  A module called more than once per step (shared weights) would receive the
  sum of its new histories; give each call its own module, or exclude it.
  """

  knob: str = ""  # The module attribute this op is the value of.

  def __init__(self, recipe: fp8_lib.FP8Recipe = fp8_lib.FP8Recipe(), *,
               original: Any = None, original_dtype: Any = None):
    self.recipe = recipe
    self.original = original
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


class FP8DotGeneral(FP8Op):
  """A ``dot_general`` knob value (nnx.Linear, nnx.LinearGeneral) in FP8.

  See `FP8Op` for its attributes; calls `jmp_amp.fp8_dot_general`.
  """

  knob = "dot_general"

  def __call__(self, lhs, rhs, dimension_numbers, precision=None,
               preferred_element_type=None, out_sharding=None):
    return fp8_lib.fp8_dot_general(
        lhs, rhs, dimension_numbers, precision=precision,
        preferred_element_type=preferred_element_type, state=self.state(),
        recipe=self.recipe, out_sharding=out_sharding)


class FP8Einsum(FP8Op):
  """An ``einsum_op`` knob value (nnx.Einsum) in FP8.

  Calls `jmp_amp.fp8_einsum` with the two operands nnx.Einsum passes.
  """

  knob = "einsum_op"

  def __call__(self, subscripts, lhs, rhs, precision=None,
               preferred_element_type=None, out_sharding=None):
    return fp8_lib.fp8_einsum(
        subscripts, lhs, rhs, precision=precision,
        preferred_element_type=preferred_element_type, state=self.state(),
        recipe=self.recipe, out_sharding=out_sharding)


class FP8ConvGeneralDilated(FP8Op):
  """A ``conv_general_dilated`` knob value (nnx.Conv) in FP8.

  Calls `jmp_amp.fp8_conv_general_dilated`; on an H100 only the forward
  convolution runs on FP8 operands (see the module docstring).
  """

  knob = "conv_general_dilated"

  def __call__(self, lhs, rhs, window_strides, padding, lhs_dilation=None,
               rhs_dilation=None, dimension_numbers=None,
               feature_group_count=1, batch_group_count=1, precision=None,
               preferred_element_type=None, out_sharding=None):
    return fp8_lib.fp8_conv_general_dilated(
        lhs, rhs, window_strides, padding, lhs_dilation=lhs_dilation,
        rhs_dilation=rhs_dilation, dimension_numbers=dimension_numbers,
        feature_group_count=feature_group_count,
        batch_group_count=batch_group_count, precision=precision,
        preferred_element_type=preferred_element_type, state=self.state(),
        recipe=self.recipe, out_sharding=out_sharding)


_OP_CLASSES = {cls.knob: cls for cls in (FP8DotGeneral, FP8Einsum,
                                         FP8ConvGeneralDilated)}


@dataclasses.dataclass(frozen=True)
class FP8Policy:
  """A rule value for `jmp_amp.flax.set_policies`: FP8 matmuls.

  The modules it decides that have a matmul knob run it in FP8 under
  `recipe`; every module it decides (those too) follows the policy
  ``p=param_dtype, c=recipe.compute_dtype, o=recipe.compute_dtype`` for its
  other knobs, so norms and embeddings that inherit it compute in bfloat16.
  With `keep_first_last`, the model's first and last matmul modules (in call
  order when `set_policies` gets ``example_args``, else path order) get only
  that bfloat16 policy. The string ``"float8"`` in a rule means
  ``FP8Policy()``, an `FP8Recipe` means ``FP8Policy(recipe)``.

  Example:
    >>> from jmp_amp.flax import fp8
    >>> str(fp8.FP8Policy()), str(fp8.FP8Policy(fp8.delayed_scaling(8)))
    ('float8', 'float8(delayed, history_len=8)')
    >>> str(fp8.FP8Policy().policy)
    'p=f32,c=bf16,o=bf16'

  Attributes:
    recipe: the `jmp_amp.FP8Recipe` (default: current scaling).
    keep_first_last: leave the model's first and last matmul modules out.
    param_dtype: storage dtype of the decided modules' parameters.
  """
  recipe: fp8_lib.FP8Recipe = fp8_lib.FP8Recipe()
  keep_first_last: bool = True
  param_dtype: Any = jnp.float32

  def __post_init__(self):
    # Not a pytree node (a static rule value), so normalising here is safe.
    object.__setattr__(self, "recipe", _recipe(self.recipe))
    if not isinstance(self.keep_first_last, bool):
      raise TypeError(f"keep_first_last must be a bool, got "
                      f"{self.keep_first_last!r}")
    object.__setattr__(self, "param_dtype", dtypes_lib.scalar_type(
        self.param_dtype, "FP8Policy param_dtype"))

  @property
  def policy(self) -> Policy:
    """The `jmp_amp.Policy` for the knobs other than the matmul."""
    compute = self.recipe.compute_dtype
    return Policy(self.param_dtype, compute, compute)

  @property
  def compute_dtype(self) -> Any:
    return self.policy.compute_dtype

  @property
  def output_dtype(self) -> Any:
    return self.policy.output_dtype

  def __str__(self) -> str:
    parts = []
    if self.recipe != fp8_lib.FP8Recipe():
      parts.append(self.recipe.scaling)
      parts += [f"{f.name}={getattr(self.recipe, f.name)}"
                for f in dataclasses.fields(self.recipe)
                if f.name != "scaling" and getattr(self.recipe, f.name)
                != getattr(fp8_lib.FP8Recipe(), f.name)]
    if not self.keep_first_last:
      parts.append("keep_first_last=False")
    if self.param_dtype != jnp.float32:
      parts.append(f"param_dtype={dtypes_lib.dtype_name(self.param_dtype)}")
    return "float8" + (f"({', '.join(parts)})" if parts else "")


def as_fp8_policy(value: Any) -> Optional[FP8Policy]:
  """`value` as an `FP8Policy` if it names FP8 ("float8", a recipe), else None.
  """
  if isinstance(value, FP8Policy):
    return value
  if isinstance(value, fp8_lib.FP8Recipe):
    return FP8Policy(value)
  if fp8_lib.is_fp8_name(value):
    return FP8Policy()
  return None


# --------------------------------------------------------------------------
# Applying FP8.


def set_fp8(model: M,
            recipe: Union[fp8_lib.FP8Recipe, str, None] = None, *,
            include: Optional[Iterable[Selector]] = None,
            exclude: Iterable[Selector] = (),
            keep_first_last: bool = True,
            example_args: Optional[tuple] = None) -> M:
  """Runs the matmuls of `model`'s matmul modules in FP8, in place.

  Converts modules with a ``dot_general``, ``einsum_op`` or
  ``conv_general_dilated`` knob and changes no other module. Calling it
  again replaces the previous FP8 set-up (with fresh histories). To mix FP8
  with other policies in one rules dict, use ``"float8"`` rules with
  `jmp_amp.flax.set_policies` instead (the same conversion).

  Example:
    >>> from jmp_amp import models
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
      matmul knob. A selected module without one raises.
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
      FP8 cannot handle (no matmul knob: nnx.Embed, a norm,
      nnx.ConvTranspose).
  """
  if not isinstance(model, nnx.Module):
    raise TypeError(f"set_fp8 expects an nnx.Module, got "
                    f"{type(model).__name__}")
  recipe = _recipe(recipe)
  include = None if include is None else _selectors(include, "include")
  exclude = _selectors(exclude, "exclude")
  modules = _ordered_modules(model)
  if include is None:
    ends = _end_paths(model, example_args) if keep_first_last else set()
    chosen = [(p, m) for p, m in modules if _knob(m) and p not in ends]
  else:
    chosen = _select(modules, include, "include")
    for path, module in chosen:
      _check_capable(path, module)
  excluded = {p for p, _ in _select(modules, exclude, "exclude")}
  chosen_paths = {p for p, _ in chosen if p not in excluded}
  for path, module in modules:
    if path in chosen_paths:
      _convert(module, recipe)
    else:
      _restore(module)
  return model


def clear_fp8(model: M) -> M:
  """Undoes `set_fp8`: the original matmul and ``dtype`` knobs.

  Modules converted by ``"float8"`` rules lose their FP8 op too; their
  policies stay (`jmp_amp.flax.clear_policies` removes those).
  """
  for _, module in _ordered_modules(model):
    _restore(module)
  return model


def fp8_modules(model: nnx.Module) -> dict[str, FP8Op]:
  """The FP8 op (`FP8DotGeneral`, ...) of each FP8 module, by '/'-joined path.
  """
  return {_path_str(p): _fp8_op(m) for p, m in _ordered_modules(model)
          if _fp8_op(m) is not None}


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
    >>> from jmp_amp import models
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


def _knob(module: nnx.Module) -> Optional[str]:
  """The matmul knob FP8 can replace in `module`, or None.

  A knob is a module attribute named in `_KNOBS` holding a callable (or
  None, Flax's "default"), without a ``<knob>_cls`` factory that would
  override it (nnx.LinearGeneral's ``dot_general_cls``). ``einsum_op``
  counts on `nnx.Einsum` only: elsewhere it is typically an attention
  contraction between activations, called several times per step, which
  one set of amax histories cannot serve.
  """
  attrs = vars(module)
  for name in _KNOBS:
    if name == "einsum_op" and not isinstance(module, nnx.Einsum):
      continue
    if name in attrs:
      value = attrs[name]
      if ((value is None or callable(value))
          and getattr(module, name + "_cls", None) is None):
        return name
  return None


def _fp8_op(module: nnx.Module) -> Optional[FP8Op]:
  name = _knob(module)
  op = None if name is None else vars(module)[name]
  return op if isinstance(op, FP8Op) else None


def _check_capable(path: tuple, module: nnx.Module) -> None:
  if not _knob(module):
    raise ValueError(
        f"FP8 cannot handle module {_path_str(path) or '<root>'!r} of type "
        f"{type(module).__name__}: FP8 converts modules with a matmul knob "
        f"({', '.join(map(repr, _KNOBS))}: nnx.Linear, nnx.LinearGeneral, "
        f"nnx.Einsum, nnx.Conv) and no '<knob>_cls' factory; embeddings, "
        f"norms and nnx.ConvTranspose stay in their policy's dtype. Exclude "
        f"it, narrow the selection, or give it a non-FP8 policy.")


def _convert(module: nnx.Module, recipe: fp8_lib.FP8Recipe) -> None:
  """Sets `module`'s matmul knob to a fresh FP8 op and its dtype knob."""
  name = _knob(module)
  current = vars(module)[name]
  if isinstance(current, FP8Op):
    original, dtype = current.original, current.original_dtype
  else:
    original, dtype = current, getattr(module, "dtype", None)
  op = _OP_CLASSES[name](recipe, original=original, original_dtype=dtype)
  setattr(module, name, nnx.data(op))
  if "dtype" in vars(module):
    setattr(module, "dtype", recipe.compute_dtype)


def _restore(module: nnx.Module) -> None:
  """Puts back the knobs an FP8 op replaced (no-op without one)."""
  op = _fp8_op(module)
  if op is None:
    return
  # nnx.static: the attribute became data when it held the FP8 module.
  setattr(module, op.knob, nnx.static(op.original))
  if "dtype" in vars(module):
    setattr(module, "dtype", op.original_dtype)


def _end_paths(model: nnx.Module, example_args: Optional[tuple]
               ) -> set[tuple]:
  """Paths of the first and last modules with a matmul knob.

  In the order one abstract ``model(*example_args)`` calls them if
  `example_args` is given, otherwise in path order.
  """
  candidates = [(p, m) for p, m in _ordered_modules(model) if _knob(m)]
  if example_args is not None:
    candidates = _call_order(model, candidates, tuple(example_args))
  return {p for p, _ in candidates[:1] + candidates[-1:]}


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
  FP8 ops themselves are left out.
  """
  pairs = [(tuple(p), m) for p, m in nnx.iter_modules(model)
           if not isinstance(m, FP8Op)]
  return sorted(pairs, key=lambda pm: _path_key(pm[0]))


def _call_order(model: nnx.Module, candidates: list, example_args: tuple
                ) -> list:
  """`candidates` in the order an abstract ``model(*example_args)`` calls them.

  Each candidate's matmul knob is swapped, for the duration of one
  `nnx.eval_shape` pass, for a wrapper that records the module's path.
  Candidates the pass does not call go last, in path order.
  """
  calls: list[tuple] = []
  defaults = {"dot_general": lax.dot_general, "einsum_op": jnp.einsum,
              "conv_general_dilated": lax.conv_general_dilated}

  def recorder(path, original):
    def record(*args, **kwargs):
      if path not in calls:
        calls.append(path)
      return original(*args, **kwargs)
    return record

  saved = [(m, _knob(m), vars(m)[_knob(m)]) for _, m in candidates]
  try:
    for (path, module), (_, name, current) in zip(candidates, saved):
      if isinstance(current, FP8Op):
        current = current.original
      if current is None:
        current = defaults[name]
      setattr(module, name, nnx.static(recorder(path, current)))
    nnx.eval_shape(lambda m, *a: m(*a), model, *example_args)
  finally:
    for module, name, knob in saved:
      setattr(module, name,
              nnx.data(knob) if isinstance(knob, FP8Op) else knob)
  rank = {p: i for i, p in enumerate(calls)}
  return sorted(candidates, key=lambda pm: (rank.get(pm[0], len(rank)),
                                            _path_key(pm[0])))
