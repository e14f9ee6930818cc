"""The FP8 matmul ops of Flax NNX: the values FP8 gives a module's matmul knob.

An `FP8Op` holds its matmul's `FP8Meta` amax histories and runs it in FP8,
whichever knob it replaces (the knob's name is its data); `knob` says which
knob of a module it replaces, `fp8_op` which op a module holds,
`stack_shape` the layer axes its histories are stacked along. `FP8Policy`
is the rule value that asks `set_policies` for them.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Optional

from flax import nnx
import jax
import jax.numpy as jnp

from jmp_amp._src import dtypes as dtypes_lib
from jmp_amp._src import fp8 as fp8_lib
from jmp_amp._src import fp8_ops
from jmp_amp._src.policy import Policy

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


# The FP8 op of each knob: it takes the knob's arguments plus the op's
# state= and recipe=.
OPS = {"dot_general": fp8_ops.dot_general, "einsum_op": fp8_ops.einsum,
       "conv_general_dilated": fp8_ops.conv_general_dilated}


class FP8Op(nnx.Module):
  """A matmul knob value running its matmul in FP8 (one per module).

  Called as the knob it replaces is (`nnx.Linear`'s ``dot_general``,
  `nnx.Einsum`'s ``einsum_op``, `nnx.Conv`'s ``conv_general_dilated``), it
  runs `jmp_amp.fp8`'s op of that name with its histories and recipe.

  Attributes:
    knob: the module attribute it is the value of (static), one of `KNOBS`.
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

  def __init__(self, recipe: fp8_lib.FP8Recipe = fp8_lib.FP8Recipe(), *,
               knob: str = "dot_general",  # pylint: disable=redefined-outer-name
               original: Any = None, original_dtype: Any = None,
               name: str = "", stack_shape: tuple[int, ...] = ()):  # pylint: disable=redefined-outer-name
    if knob not in OPS:
      raise ValueError(f"knob must be one of {KNOBS}, got {knob!r}")
    self.knob = knob
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

  def __call__(self, *args, **kwargs):
    with self.scope():
      return OPS[self.knob](*args, state=self.state(), recipe=self.recipe,
                            **kwargs)


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
    keep_first_last: leave the model's first and last matmul modules out
      (those outside scanned stacks: a stack's module runs every layer, so
      a first or last layer inside one runs in FP8 with its stack).
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
