"""FP8 matmuls for Flax NNX models, applied from outside.

The front door is a rule value of `jmp_amp.flax.set_policies`: ``"float8"``
(current scaling) or a `jmp_amp.fp8.FP8Recipe` (the recipe as data, e.g.
``jmp_amp.fp8.delayed_scaling(16)``) makes the modules a rule decides run
their matmuls in FP8, so one rules dict mixes bfloat16, float32 and FP8
modules. `FP8Policy` is the same rule value with its other options
(``keep_first_last``, ``param_dtype``), and what `jmp_amp.flax.get_policies`
reports for an FP8 module. Plain functions get FP8 from
``jmp_amp.autocast(fn, "float8")``.

A module that can run in FP8 has a matmul knob: ``dot_general``
(`nnx.Linear`, `nnx.LinearGeneral`, your own module with that knob),
``einsum_op`` (`nnx.Einsum`) or ``conv_general_dilated`` (`nnx.Conv`). The
knob gets an `FP8Op` (``FP8DotGeneral``, ``FP8Einsum`` or
``FP8ConvGeneralDilated``) that runs the matmul with `float8_e4m3fn`
operands forward and `float8_e5m2` gradients backward (see `jmp_amp.fp8`),
and the module computes and returns the recipe's compute dtype (bfloat16).
Master weights keep their dtype (float32). The model's first and last such
modules in call order keep their matmul in bfloat16, as FP8 recipes
recommend: `set_policies` finds the order from ``example_args`` (one abstract
call), and raises without them unless list indices decide it (``layers/0``
... ``layers/N``); attribute names never do. Each FP8 matmul quantizes its
operands as its own, so matmuls that share an input (q/k/v, gate/up) stay
separate FP8 GEMMs on an H100, and runs under ``jax.named_scope("fp8[<module
path>]")``, which `jmp_amp.tools.GpuReport.fp8_fallbacks` reads to check
that every FP8 layer compiled to FP8 GEMMs.
Norms, softmax, embeddings, the loss and modules without a matmul knob
(nnx.Embed, nnx.ConvTranspose) are never FP8: an FP8 rule that names one
raises, and FP8 rules that convert no module at all warn, saying why.

Convolutions: compiled for an H100 (XLA:GPU, jax 0.10.2), an FP8
convolution's forward pass is one cuDNN graph convolution with ``f8e4m3fn``
operands and the scales folded in, but its two backward convolutions take
bfloat16 operands: XLA fuses FP8 only into forward convolutions. They
compute on FP8-rounded values, so the numerics are FP8's; only a third of a
convolution's FLOPs run on FP8 tensor cores. Einsums and dot_generals get
FP8 cuBLAS GEMMs forward and backward.

State: each `FP8Op` holds its amax histories as `FP8Meta` variables, part of
the model's state: they go through `nnx.split`/`nnx.merge`, `nnx.jit`,
sharding and `jmp_amp.checkpoint` like any other variable, and a resumed run
continues bitwise. `histories` reads them. The new histories are computed
inside the jitted step and arrive as the *gradients* of the `FP8Meta`
variables; `value_and_grad` (which `jmp_amp.flax.make_train_step` uses)
writes them back instead of handing them to the optimizer::

    loss, grads = jmp_amp.flax.fp8.value_and_grad(loss_fn)(model, batch)
    optimizer.update(model, grads)         # grads hold nnx.Param only

A step that differentiates only ``nnx.Param`` still trains under current
scaling (the default), whose scales need no history; delayed scaling needs
the update, without which it falls back to current scaling.

Loss scaling: E5M2 spans the float32-like range of the bfloat16 gradients and
each gradient tensor gets its own scale from its amax, so no loss scaling is
needed (``jmp_amp.NoOpLossScale``, or plain optax). It still composes with
`jmp_amp.loss_scaling`: infinities and NaN pass through the FP8 rounding, so
an overflow is still detected and the step skipped, and non-finite amaxes
never enter a history.

Example:
  >>> import jmp_amp.flax
  >>> from jmp_amp import models
  >>> model = models.MLP(16, 4, num_layers=4, width=32, rngs=nnx.Rngs(0))
  >>> rules = {"layers/3": "float32", "*": "float8"}
  >>> model = jmp_amp.flax.set_policies(model, rules)
  >>> sorted(jmp_amp.flax.fp8.histories(model))  # layers/0: first, bf16
  ['layers/1', 'layers/2']
  >>> policies = jmp_amp.flax.get_policies(model)
  >>> str(policies["layers/1"]), str(policies["layers/0"])
  ('float8', 'p=f32,c=bf16,o=bf16')
  >>> model(jnp.ones((2, 16))).dtype    # the float32 head
  dtype('float32')
"""

from __future__ import annotations

from typing import Any, Iterable, Optional, TypeVar, Union

from flax import nnx
import jax.numpy as jnp

from jmp_amp import fp8 as fp8_core
from jmp_amp._src import deprecation
from jmp_amp.flax import _common
from jmp_amp.flax import _fp8
from jmp_amp.flax import nnx as nnx_lib
from jmp_amp.flax import rules as rules_lib
# The three kinds of FP8Op, one per matmul knob (for isinstance checks).
from jmp_amp.flax._fp8 import FP8ConvGeneralDilated
from jmp_amp.flax._fp8 import FP8DotGeneral
from jmp_amp.flax._fp8 import FP8Einsum
from jmp_amp.flax._fp8 import FP8Meta
from jmp_amp.flax._fp8 import FP8Op
from jmp_amp.flax._fp8 import FP8Policy
from jmp_amp.flax._fp8 import histories
from jmp_amp.flax._fp8 import value_and_grad

__all__ = (
    "FP8Meta",
    "FP8Op",
    "FP8Policy",
    "histories",
    "value_and_grad",
)

M = TypeVar("M", bound=nnx.Module)
Selector = Union[str, type]


# --------------------------------------------------------------------------
# Deprecated aliases, kept for one release (not in __all__).


def _set_fp8(model: M,
             recipe: Union[fp8_core.FP8Recipe, str, None] = None, *,
             include: Optional[Iterable[Selector]] = None,
             exclude: Iterable[Selector] = (),
             keep_first_last: bool = True,
             example_args: Optional[tuple] = None) -> M:
  """`set_policies` with an FP8 rule for each selected matmul module only.

  Selects as the old `set_fp8` did (every module with a matmul knob but the
  first and last, or `include` minus `exclude`; patterns in the glob dialect
  of `jmp_amp.flax.rules`) and leaves every other module without a policy.
  """
  if not isinstance(model, nnx.Module):
    raise TypeError(f"set_fp8 expects an nnx.Module, got "
                    f"{type(model).__name__}")
  recipe = _fp8.as_recipe(recipe)
  include = None if include is None else _selectors(include, "include")
  exclude = _selectors(exclude, "exclude")
  modules = _fp8.ordered_modules(model)
  if include is None:
    candidates = [(p, m) for p, m in modules if _fp8.knob(m)]
    ends = (_fp8.end_paths(model, example_args)
            if keep_first_last and candidates else set())
    chosen = [(p, m) for p, m in candidates if p not in ends]
  else:
    chosen = _select(modules, include, "include")
    for path, module in chosen:
      _fp8.check_capable(path, module)
  excluded = {p for p, _ in _select(modules, exclude, "exclude")}
  chosen = [(p, m) for p, m in chosen if p not in excluded]
  if not chosen:
    if not any(_fp8.knob(m) for _, m in modules):
      why = ("it has no module with a matmul knob (nnx.Linear, "
             "nnx.LinearGeneral, nnx.Einsum, nnx.Conv)")
    elif include is None and keep_first_last and not exclude:
      why = ("its only matmul modules are its first and last, which "
             "keep_first_last=True leaves in their dtype")
    else:
      why = "exclude leaves out every selected module"
    _fp8.warn_nothing_converted(type(model).__name__, why, stacklevel=3)
  rules = {_literal(_fp8.path_str(p)): FP8Policy(
      recipe, keep_first_last=False, param_dtype=_param_dtype(m))
           for p, m in chosen}
  return nnx_lib.set_policies(model, rules)


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


def _select(modules, selectors, name):
  chosen = []
  for selector in selectors:
    if isinstance(selector, type):
      hits = [(p, m) for p, m in modules if isinstance(m, selector)]
    else:
      pattern = rules_lib.compile_pattern(selector)
      hits = [(p, m) for p, m in modules
              if pattern.match(_fp8.path_str(p))]
    if not hits:
      raise ValueError(f"{name} selector {selector!r} matches no module; "
                       f"module paths look like "
                       f"{[_fp8.path_str(p) for p, _ in modules[1:4]]}")
    chosen.extend(h for h in hits if h not in chosen)
  return chosen


def _literal(path: str) -> str:
  """A path pattern that matches `path` alone."""
  return "".join(f"[{c}]" if c in "*?[]" else c for c in path)


def _param_dtype(module: nnx.Module) -> Any:
  """The module's own param dtype (so that converting it casts nothing)."""
  value = vars(module).get("param_dtype")
  if value is not None and _common.is_dtype_knob(value):
    return value
  return jnp.float32


set_fp8 = deprecation.deprecated(
    _set_fp8, "jmp_amp.flax.fp8.set_fp8",
    "jmp_amp.flax.set_policies(model, rules) with 'float8' or a "
    "jmp_amp.fp8.FP8Recipe as a rule value, e.g. {'*': 'float8'}")
clear_fp8 = deprecation.deprecated(
    nnx_lib.clear_policies, "jmp_amp.flax.fp8.clear_fp8",
    "jmp_amp.flax.clear_policies")
fp8_modules = deprecation.deprecated(
    _fp8.ops, "jmp_amp.flax.fp8.fp8_modules",
    "jmp_amp.flax.fp8.histories (keyed by the FP8 modules' paths) or "
    "jmp_amp.flax.get_policies")
fp8_histories = deprecation.deprecated(
    histories, "jmp_amp.flax.fp8.fp8_histories", "jmp_amp.flax.fp8.histories")
fp8_value_and_grad = deprecation.deprecated(
    value_and_grad, "jmp_amp.flax.fp8.fp8_value_and_grad",
    "jmp_amp.flax.fp8.value_and_grad")
update_fp8_state = deprecation.deprecated(
    _fp8.write_histories, "jmp_amp.flax.fp8.update_fp8_state",
    "jmp_amp.flax.fp8.value_and_grad")
delayed_scaling = deprecation.deprecated(
    fp8_core.delayed_scaling, "jmp_amp.flax.fp8.delayed_scaling",
    "jmp_amp.fp8.delayed_scaling")
FP8Recipe = fp8_core.FP8Recipe  # Use jmp_amp.fp8.FP8Recipe.
FP8State = fp8_core.FP8State  # Use jmp_amp.fp8.FP8State.
