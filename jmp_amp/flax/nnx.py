"""Per-module precision policies for Flax NNX models, set through their knobs.

`set_policies(model, rules)` walks the module graph, gives each module the
policy its rules resolve to (see `jmp_amp.flax.rules`) and sets it the way
Flax itself offers, with plain attribute assignment on the modules:

* its own `nnx.Param`s are stored in the policy's param dtype (float32 master
  weights under the mixed policies); other variables, such as BatchNorm's
  running statistics (`nnx.BatchStat`), keep their dtype (float32);
* ``dtype`` (the compute dtype) and ``param_dtype``, where the module has
  them: a Flax layer then casts its inputs and params to the compute dtype
  and returns it;
* for a half compute dtype with a float32 output dtype (``"p=f32,c=bf16,
  o=f32"``), the matmul knobs ``dot_general`` / ``conv_general_dilated`` /
  ``einsum_op`` become `jmp_amp.dot_general` / `jmp_amp.conv_general_dilated`
  / a two-operand einsum on the same custom VJP: float32 results, backward
  dots in half. With a half output dtype the knobs keep Flax's defaults: a
  bf16 x bf16 -> bf16 dot accumulates in float32 inside the kernel, its
  backward stays in half, and no float32 activation is materialised. Knobs
  set to something other than the Flax default (a quantized dot) are left
  alone.

A module's output is what its knobs produce: the compute dtype, or float32 as
above. Modules without knobs (a container like a transformer block) pass on
what their children return; their children inherit their policy.

Modules that compute with their own Params without knobs (``x @
self.w[...]``) opt in to boundary casts explicitly, by decorating the method
with `cast_boundary`: the method then takes floating inputs in the compute
dtype, reads the module's own Params in the compute dtype and returns the
output dtype. `set_policies` warns about modules that need it and lack it.

The policy is a static attribute of each module, part of its graph
definition; the state tree (paths, structure) is the unpoliced model's, so
checkpoints move between the two, and `nnx.split`/`nnx.merge`, `nnx.jit`,
`nnx.clone`, `nnx.Optimizer`, `copy.deepcopy` and pickling keep the policies.

Limits: a Param read from *another* module's attribute (``x @
self.embed.embedding[...].T``) is not cast, call that module instead
(``self.embed.attend(x)``); `nnx.Embed.attend` returns the compute dtype
whatever the output dtype (it has no matmul knob); a module shared between
two places gets the policy of its first path; a `cast_boundary` method whose
module has Params to cast runs on a view of the module (`nnx.merge` of its
state, sharing its Variables), so plain attributes it assigns on ``self``
stay on the view.

Example:
  >>> import jmp_amp.flax
  >>> model = nnx.Sequential(nnx.Linear(4, 8, rngs=nnx.Rngs(0)),
  ...                        nnx.LayerNorm(8, rngs=nnx.Rngs(0)),
  ...                        nnx.Linear(8, 2, rngs=nnx.Rngs(0)))
  >>> _ = jmp_amp.flax.set_policies(model, jmp_amp.flax.mixed_rules())
  >>> model(jnp.ones((3, 4))).dtype
  dtype(bfloat16)
  >>> model.layers[0].kernel[...].dtype, model.layers[0].dtype
  (dtype('float32'), dtype(bfloat16))
  >>> str(jmp_amp.flax.get_policies(model)["layers/1"])
  'p=f32,c=f32,o=f32'
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional, TypeVar
import warnings

from flax import nnx
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from jmp_amp._src import dtypes as dtypes_lib
from jmp_amp._src import ops
from jmp_amp.flax import _common
from jmp_amp.flax import _fp8 as fp8_lib
from jmp_amp.flax import _fp8_op as fp8_op_lib
from jmp_amp.flax import _paths as owners_lib
from jmp_amp.flax import _scan
from jmp_amp.flax import rules as rules_lib

M = TypeVar("M", bound=nnx.Module)
F = TypeVar("F", bound=Callable[..., Any])

_ATTR = "_jmp_amp_policy"
_BOUNDARY_MARK = "__jmp_amp_cast_boundary__"
_MISSING = object()

# (knob, Flax's default values, float32-result replacement).
_MATMUL_KNOBS = (
    ("dot_general", (lax.dot_general, None), ops.dot_general),
    ("conv_general_dilated", (lax.conv_general_dilated, None),
     ops.conv_general_dilated),
    ("einsum_op", (jnp.einsum,), ops.einsum),
)


@dataclasses.dataclass(frozen=True)
class _Applied:
  """What `set_policies` did to one module (a static, hashable attribute).

  `policy` is an `FP8Policy` when the module's matmul was made FP8 (`fp8`),
  else the `Policy` its knobs follow.
  """
  policy: Any
  cast_output: bool
  originals: tuple[tuple[str, Any], ...]
  fp8: bool = False


# --------------------------------------------------------------------------
# Public API.


def set_policies(model: M, rules: Any, *, strict: bool = False,
                 example_args: Optional[tuple] = None) -> M:
  """Applies per-module policies to an NNX model in place.

  Calling it again replaces the previous policies (modules that no rule
  matches any more get their original knobs back).

  A rule whose value is ``"float8"`` or a `jmp_amp.flax.fp8.FP8Policy` runs
  the matmul modules it decides in FP8 (except the model's first and last)
  and everything else it decides in bfloat16; see `jmp_amp.flax.fp8`. If
  FP8 rules convert no module, a UserWarning says why.

  Example:
    >>> import jmp_amp.flax
    >>> model = nnx.Sequential(nnx.Linear(4, 8, rngs=nnx.Rngs(0)),
    ...                        nnx.Linear(8, 2, rngs=nnx.Rngs(0)))
    >>> model = jmp_amp.flax.set_policies(
    ...     model, {"layers/1": "float32", "*": "mixed_bfloat16"})
    >>> model(jnp.ones((3, 4))).dtype  # the float32 head decides the output
    dtype('float32')

  Args:
    model: the `nnx.Module` (the root of the graph).
    rules: a rules mapping ({module class or path pattern: policy}, the
      most specific match wins, ``"*"`` is the default; see
      `jmp_amp.flax.rules`), a `Policy`, a policy string or ``"float8"``
      (meaning ``{"*": policy}``).
    strict: raise ValueError, instead of warning, when a rule decides no
      module (optional rules, e.g. the norm rules of `mixed_rules`, never
      complain) or a module cannot follow its policy (no knobs, own Params
      and no `cast_boundary` method).
    example_args: inputs (arrays or `jax.ShapeDtypeStruct`) for one
      abstract call ``model(*example_args)`` that finds the call order of
      the matmul modules, for FP8 rules that keep the first and last in
      bfloat16. Without it, only list indices can decide that order
      (``layers/0`` ... ``layers/N``); otherwise such rules raise.

  Returns:
    `model`, for chaining.

  Raises:
    TypeError: `model` is not an nnx.Module or a rule key is not a module
      class or str.
    ValueError: a rule value is not a policy, a pattern is malformed, a
      module matches two rules of equal rank, an FP8 rule names a module
      without a matmul knob that computes with Params of its own
      (nnx.Embed, a norm, nnx.ConvTranspose), FP8 rules keep the first and
      last matmul modules but no `example_args` tell which they are, rules
      decide the blocks of a scanned stack differently (one program runs
      them all; see `jmp_amp.flax.rules`), or (if `strict`) a rule matched
      nothing or a module cannot follow its policy.
  """
  if not isinstance(model, nnx.Module):
    raise TypeError(f"set_policies expects an nnx.Module, got "
                    f"{type(model).__name__}; for linen modules use "
                    "jmp_amp.flax.apply_with_policies.")
  ruleset = rules_lib.validate_rules(rules)
  modules = _modules(model)
  resolved = _scan.resolve(ruleset, modules, strict=strict,
                           what=type(model).__name__)
  fp8_paths = fp8_lib.fp8_modules(model, ruleset, modules, resolved,
                                      example_args)
  problems = []
  for path, module in modules:
    res = resolved[path]
    _remove(module)
    if res.policy is not None:
      problem = _apply(module, res.policy,
                       cast_output=rules_lib.casts_output(owners_lib.path_str(path),
                                                          res),
                       explicit=res.source == "rule",
                       fp8=path in fp8_paths, path=path)
      if problem:
        problems.append(f"{owners_lib.path_str(path) or '<root>'!r} "
                        f"({type(module).__name__}) {problem}")
  _cast_params(model, {p: resolved[p].policy for p, _ in modules})
  if problems:
    msg = ("jmp_amp.flax: " + "; ".join(problems) + ". Decorate the module's "
           "method with @jmp_amp.flax.cast_boundary, give it dtype knobs, or "
           "cast in your code.")
    if strict:
      raise ValueError(msg)
    warnings.warn(msg, UserWarning, stacklevel=2)
  return model


def get_policies(model: nnx.Module) -> dict[str, Any]:
  """The policy `set_policies` gave each module, keyed by '/'-joined path.

  The root is ``""``, so ``get_policies(module)[""]`` is the policy of one
  module (also of a module inside a model). A module left as it is has
  None; one whose matmul runs in FP8 has its `jmp_amp.flax.fp8.FP8Policy`;
  the others have a `jmp_amp.Policy`.

  Example:
    >>> import jmp_amp.flax
    >>> model = nnx.Sequential(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
    >>> _ = jmp_amp.flax.set_policies(model, {"layers/0": "float16"})
    >>> {p: str(pol) for p, pol in jmp_amp.flax.get_policies(model).items()}
    {'': 'None', 'layers': 'None', 'layers/0': 'p=f16,c=f16,o=f16'}
    >>> str(jmp_amp.flax.get_policies(model.layers[0])[""])
    'p=f16,c=f16,o=f16'

  Raises:
    TypeError: `model` is not an nnx.Module.
  """
  if not isinstance(model, nnx.Module):
    raise TypeError(f"get_policies expects an nnx.Module, got "
                    f"{type(model).__name__}")
  return {owners_lib.path_str(p): _policy(m) for p, m in _modules(model)}


def clear_policies(model: M) -> M:
  """Undoes `set_policies`: original knobs (params keep their dtype).

  FP8 modules get their original matmul back, and their histories go.

  Example:
    >>> import jmp_amp.flax
    >>> layer = jmp_amp.flax.set_policies(nnx.Linear(2, 2, rngs=nnx.Rngs(0)),
    ...                                   "mixed_bfloat16")
    >>> layer = jmp_amp.flax.clear_policies(layer)
    >>> jmp_amp.flax.get_policies(layer)[""] is None, layer.dtype is None
    (True, True)
  """
  for _, module in _modules(model):
    _remove(module)
  return model


def cast_boundary(method: F) -> F:
  """Has a module method follow the module's policy at its boundary.

  For NNX modules that compute with their own Params without ``dtype``
  knobs. While the module has a policy (from `set_policies`), the decorated
  method takes its floating array arguments in the compute dtype, sees the
  module's own Params (not those of submodules, which follow their own
  policies) in the compute dtype, and returns floating arrays in the output
  dtype (except the root under the catch-all ``"*"``, see
  `jmp_amp.flax.rules`). Without a policy it runs unchanged. The stored
  Params keep their dtype; other variables (statistics, RNG counters) are
  updated in place as usual.

  To use it on a class you cannot edit, subclass it:
  ``class MyModel(Theirs): __call__ = cast_boundary(Theirs.__call__)``.

  Example:
    >>> import jmp_amp.flax
    >>> class Scale(nnx.Module):
    ...   def __init__(self):
    ...     self.w = nnx.Param(jnp.ones((4, 2)))
    ...   @jmp_amp.flax.cast_boundary
    ...   def __call__(self, x):
    ...     return x @ self.w[...]
    >>> model = jmp_amp.flax.set_policies(Scale(), {"": "p=f32,c=f16,o=f32"})
    >>> model(jnp.ones((3, 4))).dtype, model.w[...].dtype
    (dtype('float32'), dtype('float32'))
    >>> model = jmp_amp.flax.set_policies(Scale(), "p=f32,c=f16,o=f32")
    >>> model(jnp.ones((3, 4))).dtype  # "*" leaves the root's outputs alone
    dtype('float16')
    >>> jmp_amp.matmul_report(model, jnp.ones((3, 4))).input_dtypes()
    {'f16'}

  Args:
    method: a method of an `nnx.Module` subclass.

  Returns:
    The wrapped method.
  """
  if not callable(method):
    raise TypeError(f"cast_boundary decorates a module method, got {method!r}")

  @functools.wraps(method)
  def wrapped(self, *args, **kwargs):
    applied = vars(self).get(_ATTR) if isinstance(self, nnx.Module) else None
    if applied is None:
      return method(self, *args, **kwargs)
    policy = applied.policy
    args, kwargs = _cast_arrays((args, kwargs), policy.compute_dtype)
    out = method(_with_params_in(self, policy.compute_dtype), *args, **kwargs)
    if applied.cast_output:
      out = _cast_arrays(out, policy.output_dtype)
    return out

  setattr(wrapped, _BOUNDARY_MARK, True)
  return wrapped


# --------------------------------------------------------------------------
# Graph walking.


def _policy(module: nnx.Module) -> Any:
  applied = vars(module).get(_ATTR)
  return None if applied is None else applied.policy


def _modules(model: nnx.Module) -> list[tuple[tuple, nnx.Module]]:
  """(path, module) pairs, parents before children, each module once.

  FP8 ops (the values of FP8 modules' matmul knobs) are part of their
  module, not modules of their own.
  """
  pairs = [(tuple(p), m) for p, m in nnx.iter_modules(model)
           if not isinstance(m, fp8_op_lib.FP8Op)]
  return sorted(pairs, key=lambda pm: len(pm[0]))  # stable: keeps nnx order


def _cast_params(model: nnx.Module, policies: dict[tuple, Any]) -> None:
  """Stores every Param in its owner's param dtype."""
  owners = owners_lib.owning_paths(model)
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    policy = policies.get(owners_lib.owner(path, owners))
    value = var.get_value()
    if (policy is not None and _common.is_float_array(value)
        and value.dtype != policy.param_dtype):
      var.set_value(value.astype(policy.param_dtype))


# --------------------------------------------------------------------------
# Applying and removing one module's policy.


def _has_boundary(cls: type) -> bool:
  return any(getattr(value, _BOUNDARY_MARK, False)
             for c in cls.__mro__ for value in vars(c).values())


def _apply(module: nnx.Module, policy: Any, *, cast_output: bool,
           explicit: bool, fp8: bool = False,
           path: tuple = ()) -> Optional[str]:
  """Sets `module`'s knobs; says why it cannot follow `policy`, if so.

  An `FP8Policy` sets the knobs of its bfloat16 `Policy` and, if `fp8`,
  then makes the module's matmul FP8.

  Reported: a module computing with its own Params without knobs or boundary
  (they would promote the computation to the param dtype), and a module that
  a rule names directly for an output dtype it has no means to produce.
  """
  fp8_policy = policy if isinstance(policy, fp8_op_lib.FP8Policy) else None
  if fp8_policy is not None:
    policy = fp8_policy.policy
  attrs = vars(module)
  originals = {}

  def set_knob(name, value):
    originals[name] = attrs[name]
    setattr(module, name, value)

  has_dtype = _common.is_dtype_knob(attrs.get("dtype", _MISSING))
  if has_dtype:
    set_knob("dtype", np.dtype(policy.compute_dtype))
  if _common.is_dtype_knob(attrs.get("param_dtype", _MISSING)):
    set_knob("param_dtype", np.dtype(policy.param_dtype))
  if (policy.compute_dtype in dtypes_lib.HALF_DTYPES
      and policy.output_dtype == np.dtype(np.float32)):
    for name, defaults, replacement in _MATMUL_KNOBS:
      if (name in attrs and any(attrs[name] is d for d in defaults)
          and attrs.get(name + "_cls") is None):
        set_knob(name, replacement)
  if fp8:
    fp8_lib.convert(module, fp8_policy.recipe, path)
  setattr(module, _ATTR, _Applied(fp8_policy if fp8 else policy, cast_output,
                                  tuple(originals.items()), fp8))
  if (has_dtype or _has_boundary(type(module))
      or isinstance(module, owners_lib.CONTAINERS)):
    return None
  if any(_common.is_float_array(var.get_value())
         for _, var in owners_lib.own_params(module)):
    if policy.compute_dtype != policy.param_dtype:
      return ("computes with Params of its own but has no dtype knob: they "
              f"stay {np.dtype(policy.param_dtype).name}, not "
              f"{np.dtype(policy.compute_dtype).name}")
  if (explicit and cast_output
      and policy.output_dtype != policy.compute_dtype):
    return (f"has no knobs to return {np.dtype(policy.output_dtype).name}: "
            "it returns what its children compute")
  return None


def _remove(module: nnx.Module) -> None:
  applied = vars(module).get(_ATTR)
  if applied is None:
    return
  if applied.fp8:
    fp8_lib.restore(module)
  for name, value in applied.originals:
    setattr(module, name, value)
  delattr(module, _ATTR)


# --------------------------------------------------------------------------
# Boundary casts.


def _cast_arrays(tree: Any, dtype: np.dtype) -> Any:
  """Casts floating array leaves; graph nodes (modules, Rngs) pass through."""
  return _common.cast_arrays(tree, dtype, (nnx.Pytree, nnx.Variable))


def _with_params_in(module: M, dtype: np.dtype) -> M:
  """`module`, or a view of it whose own Params read in `dtype`.

  The view is `nnx.merge` of the module's split state with its own Params
  cast: a new module object whose other Variables are the original's (so
  statistics and RNG counters update the original), whose own Params are new
  Variables holding the cast values (gradients flow through the cast).
  """
  own = {path for path, var in owners_lib.own_params(module)
         if _common.is_float_array(var.get_value())
         and var.get_value().dtype != dtype}
  if not own:
    return module
  graphdef, params, rest = nnx.split(
      module, lambda path, _: tuple(path) in own, ...)
  params = jax.tree_util.tree_map(lambda x: x.astype(dtype), params)
  return nnx.merge(graphdef, params, rest)
