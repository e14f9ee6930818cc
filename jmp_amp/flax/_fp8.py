"""FP8 matmul modules for Flax NNX: the mechanism behind ``"float8"`` rules.

`jmp_amp.flax.set_policies` gives a module that an FP8 rule decides, and that
has a matmul knob, an `FP8Op` as that knob's value; this module holds those
ops, their `FP8Meta` histories, the rule value `FP8Policy`, how modules are
found, converted and restored, and `value_and_grad`, which writes the new
histories back. What users see is in `jmp_amp.flax.fp8`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Optional
import warnings

from flax import nnx
import jax
import jax.numpy as jnp
from jax import lax

from jmp_amp._src import dtypes as dtypes_lib
from jmp_amp._src import fp8 as fp8_lib
from jmp_amp._src import fp8_ops
from jmp_amp._src.policy import Policy

# The matmul knobs FP8 replaces, in the order they are looked for.
_KNOBS = ("dot_general", "einsum_op", "conv_general_dilated")


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


_OP_CLASSES = {cls.knob: cls for cls in (FP8DotGeneral, FP8Einsum,
                                         FP8ConvGeneralDilated)}


@dataclasses.dataclass(frozen=True)
class FP8Policy:
  """A rule value for `jmp_amp.flax.set_policies`: FP8 matmuls.

  The modules it decides that have a matmul knob run it in FP8 under
  `recipe`; every module it decides (those too) follows the policy
  ``p=param_dtype, c=recipe.compute_dtype, o=recipe.compute_dtype`` for its
  other knobs, so norms and embeddings that inherit it compute in bfloat16.
  With `keep_first_last`, the model's first and last matmul modules in call
  order get only that bfloat16 policy: `set_policies` needs
  ``example_args`` to find the order, unless list indices decide it
  (``layers/0`` ... ``layers/N``), and raises without them. It is the one
  FP8 rule value: the string ``"float8"`` is its short form,
  ``FP8Policy()``; a bare `jmp_amp.fp8.FP8Recipe` is refused (write
  ``FP8Policy(recipe)``). `jmp_amp.flax.get_policies` gives it for the
  modules whose matmul runs in FP8.

  Example:
    >>> from jmp_amp.flax import fp8
    >>> recipe = jmp_amp.fp8.FP8Recipe(scaling="delayed", history_len=8)
    >>> str(fp8.FP8Policy()), str(fp8.FP8Policy(recipe))
    ('float8', 'float8(delayed, history_len=8)')
    >>> str(fp8.FP8Policy().policy)
    'p=f32,c=bf16,o=bf16'

  Attributes:
    recipe: the `jmp_amp.fp8.FP8Recipe` (default: current scaling).
    keep_first_last: leave the model's first and last matmul modules out.
    param_dtype: storage dtype of the decided modules' parameters.
  """
  recipe: fp8_lib.FP8Recipe = fp8_lib.FP8Recipe()
  keep_first_last: bool = True
  param_dtype: Any = jnp.float32

  def __post_init__(self):
    if not isinstance(self.recipe, fp8_lib.FP8Recipe):
      raise TypeError(f"recipe must be a jmp_amp.fp8.FP8Recipe, got "
                      f"{self.recipe!r}")
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


def as_fp8_policy(value: Any, rule: str = "") -> Optional[FP8Policy]:
  """`value` as an `FP8Policy` if it is one or ``"float8"``, else None.

  Raises:
    TypeError: `value` is a bare `FP8Recipe` (of the rule `rule`).
  """
  if isinstance(value, FP8Policy):
    return value
  if isinstance(value, fp8_lib.FP8Recipe):
    raise TypeError(
        f"Rule {rule + ' ' if rule else ''}has a jmp_amp.fp8.FP8Recipe as its "
        "value; a rule value is a policy: write "
        "jmp_amp.flax.fp8.FP8Policy(recipe), or 'float8' for the default "
        "recipe.")
  if fp8_lib.is_fp8_name(value):
    return FP8Policy()
  return None


# --------------------------------------------------------------------------
# Reading and updating the FP8 state.


def ops(model: nnx.Module) -> dict[str, FP8Op]:
  """The FP8 op (`FP8DotGeneral`, ...) of each FP8 module, by '/'-joined path.
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


def warn_nothing_converted(what: str, why: str, stacklevel: int) -> None:
  """Warns that FP8 was asked for but no module of `what` runs in FP8."""
  warnings.warn(f"jmp_amp.flax: FP8 converted no layer of {what}: {why}.",
                UserWarning, stacklevel=stacklevel + 1)


def knob(module: nnx.Module) -> Optional[str]:
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


def fp8_op(module: nnx.Module) -> Optional[FP8Op]:
  """The FP8 op `module`'s matmul knob holds, or None."""
  name = knob(module)
  op = None if name is None else vars(module)[name]
  return op if isinstance(op, FP8Op) else None


def check_capable(path: tuple, module: nnx.Module) -> None:
  """Raises ValueError, naming the module, if FP8 cannot convert it."""
  if not knob(module):
    raise ValueError(
        f"FP8 cannot handle module {path_str(path) or '<root>'!r} of type "
        f"{type(module).__name__}: FP8 converts modules with a matmul knob "
        f"({', '.join(map(repr, _KNOBS))}: nnx.Linear, nnx.LinearGeneral, "
        f"nnx.Einsum, nnx.Conv) and no '<knob>_cls' factory; embeddings, "
        f"norms and nnx.ConvTranspose stay in their policy's dtype. Exclude "
        f"it, narrow the selection, or give it a non-FP8 policy.")


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
  op = _OP_CLASSES[name](recipe, original=original, original_dtype=dtype,
                         name=path_str(path), stack_shape=stack_shape(module))
  setattr(module, name, nnx.data(op))
  if "dtype" in vars(module):
    setattr(module, "dtype", recipe.compute_dtype)


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


def restore(module: nnx.Module) -> None:
  """Puts back the knobs an FP8 op replaced (no-op without one)."""
  op = fp8_op(module)
  if op is None:
    return
  # nnx.static: the attribute became data when it held the FP8 module.
  setattr(module, op.knob, nnx.static(op.original))
  if "dtype" in vars(module):
    setattr(module, "dtype", op.original_dtype)


def end_paths(model: nnx.Module, example_args: Optional[tuple],
              decided: Optional[set[tuple]] = None) -> set[tuple]:
  """Paths of the first and last modules with a matmul knob, in call order.

  The order is the one an abstract ``model(*example_args)`` calls them in.
  Without `example_args`, list indices are all that is known of it
  (``layers/0`` is called before ``layers/1``; attribute names say
  nothing): that is enough if it singles out the first and the last module,
  or if none of the modules that could be first or last is in `decided`
  (then they are all returned, excluding nothing that was asked for).

  Raises:
    ValueError: no `example_args`, and the modules of `decided` that keep
      their dtype depend on an order list indices do not decide.
  """
  candidates = [(p, m) for p, m in ordered_modules(model) if knob(m)]
  if example_args is not None:
    candidates = _call_order(model, candidates, tuple(example_args))
    return {p for p, _ in candidates[:1] + candidates[-1:]}
  paths = [p for p, _ in candidates]
  firsts = [p for p in paths if not any(_before(q, p) for q in paths)]
  lasts = [p for p in paths if not any(_before(p, q) for q in paths)]
  ends = set(firsts) | set(lasts)
  if len(firsts) <= 1 and len(lasts) <= 1:
    return ends
  if decided is not None and not ends & set(decided):
    return ends
  raise ValueError(
      f"FP8 rules keep a model's first and last matmul modules in bfloat16 "
      f"(keep_first_last), and which of {[path_str(p) for p in paths]} "
      f"those are depends on the order {type(model).__name__} calls them, "
      f"which its attribute names do not tell: pass example_args=(inputs...) "
      f"(arrays or jax.ShapeDtypeStruct) to jmp_amp.flax.set_policies, for "
      f"one abstract call that finds the order, or use the rule value "
      f"jmp_amp.flax.fp8.FP8Policy(keep_first_last=False) and choose the "
      f"modules with rules.")


def _before(a: tuple, b: tuple) -> bool:
  """Whether list indices put path `a` before path `b` (they first differ
  at a list index, smaller in `a`)."""
  n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
  return (n is not None and isinstance(a[n], int) and isinstance(b[n], int)
          and a[n] < b[n])


def path_str(path: tuple) -> str:
  return "/".join(str(p) for p in path)


def _path_key(path: tuple) -> tuple:
  """Sort key: list indices numerically (layers/2 before layers/10)."""
  return tuple((0, k, "") if isinstance(k, int) else (1, 0, str(k))
               for k in path)


def ordered_modules(model: nnx.Module) -> list[tuple[tuple, nnx.Module]]:
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

  saved = [(m, knob(m), vars(m)[knob(m)]) for _, m in candidates]
  try:
    for (path, module), (_, name, current) in zip(candidates, saved):
      if isinstance(current, FP8Op):
        current = current.original
      if current is None:
        current = defaults[name]
      setattr(module, name, nnx.static(recorder(path, current)))
    nnx.eval_shape(lambda m, *a: m(*a), model, *example_args)
  finally:
    for module, name, value in saved:
      setattr(module, name,
              nnx.data(value) if isinstance(value, FP8Op) else value)
  rank = {p: i for i, p in enumerate(calls)}
  return sorted(candidates, key=lambda pm: (rank.get(pm[0], len(rank)),
                                            _path_key(pm[0])))
