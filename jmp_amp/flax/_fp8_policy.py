"""`FP8Policy`, the rule value that asks `set_policies` for FP8 matmuls."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax.numpy as jnp

from jmp_amp._src import dtypes as dtypes_lib
from jmp_amp._src import fp8 as fp8_lib
from jmp_amp._src.policy import Policy


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
