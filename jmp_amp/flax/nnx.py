"""Per-module precision policies for Flax NNX models, applied in place.

`set_policies(model, rules)` walks the module graph, gives each module the
policy its rules resolve to (see `jmp_amp.flax.rules`) and then, per module:

* stores its own `nnx.Param`s in the policy's param dtype (float32 master
  weights under the mixed policies); other variables, such as BatchNorm's
  running statistics (`nnx.BatchStat`), keep their dtype (float32);
* sets the knobs it has: ``dtype`` (compute dtype), ``param_dtype``, and, for
  half compute dtypes, ``dot_general`` / ``conv_general_dilated`` /
  ``einsum_op`` to `jmp_amp.dot_general` / `jmp_amp.conv_general_dilated` /
  an einsum on it, so matmuls and convolutions accumulate and return float32
  while their backward pass stays in half precision. Knobs set to something
  other than the Flax default (a quantized dot, say) are left alone;
* casts at its boundary, which is what makes modules without knobs (a custom
  attention block) follow the policy: its instance's class is swapped for a
  cached subclass whose ``__call__`` (and ``attend`` for `nnx.Embed`) casts
  floating array arguments to the compute dtype, reads the module's own
  Params in the compute dtype for the duration of the call, and casts
  floating array outputs to the output dtype.

The subclass keeps the original's name and is a subclass of it, so
`isinstance` checks, `nnx.split`/`nnx.merge`, `nnx.jit`, `nnx.grad`,
`nnx.clone`, `nnx.Optimizer`, `copy.deepcopy` and pickling work as before;
the policy is a static attribute, part of the graphdef.

Limits: only ``__call__`` (and `nnx.Embed.attend`) is wrapped, so other
methods run without boundary casts; a Param read from *another* module's
attribute (``x @ self.embed.embedding[...].T``) is not cast, call that module
instead (``self.embed.attend(x)``); a module shared between two places gets
the policy of its first path.

Example:
  >>> model = models.ResNet(rngs=nnx.Rngs(0))
  >>> set_policies(model, jmp_amp.flax.mixed_rules("bfloat16"))
  >>> model(x).dtype
  dtype(bfloat16)
  >>> str(get_policies(model)["stem_bn"]), model.stem.kernel[...].dtype
  ('p=f32,c=f32,o=f32', dtype('float32'))
"""

from __future__ import annotations

import contextlib
import functools
import sys
import types
from typing import Any, Iterator, Optional, TypeVar

from flax import nnx
from jax import lax
import jax.numpy as jnp
import numpy as np

import jmp_amp
from jmp_amp import Policy
from jmp_amp.flax import _common
from jmp_amp.flax import rules as rules_lib

M = TypeVar("M", bound=nnx.Module)

_POLICY_ATTR = "_jmp_amp_policy"
_KNOBS_ATTR = "_jmp_amp_knobs"

# Methods wrapped besides __call__: Embed.attend is the tied output head.
_EXTRA_METHODS: dict[type, tuple[str, ...]] = {nnx.Embed: ("attend",)}


def _einsum(*operands, **kwargs):
  """`jnp.einsum` whose contractions go through `jmp_amp.dot_general`."""
  kwargs.setdefault("_dot_general", jmp_amp.dot_general)
  return jnp.einsum(*operands, **kwargs)


def _conv_general_dilated(lhs, rhs, *args, out_sharding=None, **kwargs):
  """`jmp_amp.conv_general_dilated` taking the `out_sharding` nnx.Conv passes."""
  if out_sharding is None:
    return jmp_amp.conv_general_dilated(lhs, rhs, *args, **kwargs)
  # Explicit output sharding: lax keeps it, at the price of a float32
  # backward pass.
  kwargs.setdefault("preferred_element_type", jnp.float32)
  return lax.conv_general_dilated(lhs, rhs, *args, out_sharding=out_sharding,
                                  **kwargs)


# (knob, Flax's default values, replacement for half compute dtypes).
_MATMUL_KNOBS = (
    ("dot_general", (lax.dot_general, None), jmp_amp.dot_general),
    ("conv_general_dilated", (lax.conv_general_dilated, None),
     _conv_general_dilated),
    ("einsum_op", (jnp.einsum,), _einsum),
)


# --------------------------------------------------------------------------
# Public API.


def set_policies(model: M, rules: Any, *, strict: bool = False) -> M:
  """Applies per-module policies to an NNX model in place.

  Calling it again replaces the previous policies (modules that no rule
  matches any more are restored to their original class and knobs).

  Example:
    >>> model = set_policies(model, {"head": "p=f32,c=bf16,o=f32",
    ...                              nnx.LayerNorm: "float32",
    ...                              "*": "mixed_bfloat16"})

  Args:
    model: the `nnx.Module` (the root of the graph).
    rules: a rules mapping ({module class or path pattern: policy}, first
      match wins, ``"*"`` is the default; see `jmp_amp.flax.rules`), a
      `Policy` or a policy string (meaning ``{"*": policy}``).
    strict: raise ValueError, instead of warning, when a rule decides no
      module (optional rules, e.g. the norm rules of `mixed_rules`, never
      complain).

  Returns:
    `model`, for chaining.

  Raises:
    TypeError: `model` is not an nnx.Module or a rule key is not a module
      class or str.
    ValueError: a rule value is not a policy, a pattern is malformed, or (if
      `strict`) a rule matched nothing.
  """
  if not isinstance(model, nnx.Module):
    raise TypeError(f"set_policies expects an nnx.Module, got "
                    f"{type(model).__name__}; for linen modules use "
                    "jmp_amp.flax.apply_with_policies / linen_policies.")
  ruleset = rules_lib.validate_rules(rules)
  modules = _modules(model)
  resolved: dict[tuple, rules_lib.Resolution] = {}
  used = set()
  for path, module in modules:
    parent = resolved.get(path[:-1]) if path else None
    res = rules_lib.resolve(ruleset, _path_str(path), module, parent)
    resolved[path] = res
    if res.source in ("rule", "default"):
      used.add(res.rule.key)
  rules_lib.report_unmatched(
      ruleset, used, [(_path_str(p), m) for p, m in modules], strict=strict,
      what=type(model).__name__)
  for path, module in modules:
    _apply(module, resolved[path].policy)
  return model


def policy_of(module: nnx.Module) -> Optional[Policy]:
  """The policy `set_policies` gave `module`, or None.

  Example:
    >>> str(policy_of(model.stem_bn))
    'p=f32,c=f32,o=f32'
  """
  if not isinstance(module, nnx.Module):
    raise TypeError(f"policy_of expects an nnx.Module, got "
                    f"{type(module).__name__}")
  return vars(module).get(_POLICY_ATTR)


def get_policies(model: nnx.Module) -> dict[str, Optional[Policy]]:
  """Every module's policy, keyed by '/'-joined path (the root is "").

  Example:
    >>> {p: str(pol) for p, pol in get_policies(model).items()}
    {'': 'p=f32,c=bf16,o=bf16', 'stem_bn': 'p=f32,c=f32,o=f32', ...}
  """
  return {_path_str(p): policy_of(m) for p, m in _modules(model)}


def clear_policies(model: M) -> M:
  """Undoes `set_policies`: original classes and knobs (params keep dtype).

  Example:
    >>> clear_policies(model); type(model.head) is nnx.Linear
    True
  """
  for _, module in _modules(model):
    _remove(module)
  return model


# --------------------------------------------------------------------------
# Graph walking.


def _path_str(path: tuple) -> str:
  return "/".join(str(p) for p in path)


def _modules(model: nnx.Module) -> list[tuple[tuple, nnx.Module]]:
  """(path, module) pairs, parents before children, each module once."""
  pairs = list(nnx.iter_modules(model))
  return sorted(pairs, key=lambda pm: len(pm[0]))  # stable: keeps nnx order


def _own_variables(module: nnx.Module) -> Iterator[nnx.Variable]:
  """Variables held by `module` itself, not by its submodules.

  nnx.List / nnx.Dict are Modules, but a list of Params inside one belongs
  to the module that holds the list.
  """
  def walk(x):
    if isinstance(x, nnx.Variable):
      yield x
    elif isinstance(x, (nnx.List, nnx.Dict)):
      for v in (x.values() if isinstance(x, nnx.Dict) else x):
        yield from walk(v)
    elif isinstance(x, nnx.Module):
      return
    elif isinstance(x, (list, tuple)):
      for v in x:
        yield from walk(v)
    elif isinstance(x, dict):
      for v in x.values():
        yield from walk(v)

  for name, value in vars(module).items():
    if not name.startswith("_pytree__"):
      yield from walk(value)


def _own_params(module: nnx.Module) -> list[nnx.Param]:
  seen, out = set(), []
  for var in _own_variables(module):
    if isinstance(var, nnx.Param) and id(var) not in seen:
      seen.add(id(var))
      out.append(var)
  return out


# --------------------------------------------------------------------------
# Applying and removing one module's policy.


def _apply(module: nnx.Module, policy: Optional[Policy]) -> None:
  _remove(module)
  if policy is None:
    return
  attrs = vars(module)
  originals = {}

  def set_knob(name, value):
    originals[name] = attrs[name]
    setattr(module, name, value)

  if _common.is_dtype_knob(attrs.get("dtype", 0)):
    set_knob("dtype", policy.compute_dtype)
  if _common.is_dtype_knob(attrs.get("param_dtype", 0)):
    set_knob("param_dtype", policy.param_dtype)
  if policy.compute_dtype in _common.HALF:
    for name, defaults, replacement in _MATMUL_KNOBS:
      if (name in attrs and any(attrs[name] is d for d in defaults)
          and attrs.get(name + "_cls") is None):
        set_knob(name, replacement)

  for param in _own_params(module):
    value = param.get_value()
    if _common.is_float_array(value) and value.dtype != policy.param_dtype:
      param.set_value(value.astype(policy.param_dtype))

  setattr(module, _POLICY_ATTR, policy)
  setattr(module, _KNOBS_ATTR, tuple(originals.items()))
  if _has_wrappable_method(type(module)):
    object.__setattr__(module, "__class__", _policied_class(type(module)))


def _remove(module: nnx.Module) -> None:
  attrs = vars(module)
  if _POLICY_ATTR not in attrs:
    return
  for name, value in attrs[_KNOBS_ATTR]:
    setattr(module, name, value)
  delattr(module, _KNOBS_ATTR)
  delattr(module, _POLICY_ATTR)
  base = getattr(type(module), "_jmp_amp_base", None)
  if base is not None:
    object.__setattr__(module, "__class__", base)


# --------------------------------------------------------------------------
# The boundary-casting subclasses.

_SUBCLASSES: dict[type, type] = {}


def _methods_to_wrap(cls: type) -> tuple[str, ...]:
  return _common.methods_to_wrap(cls, _EXTRA_METHODS)


def _defines(cls: type, method: str) -> bool:
  return any(method in vars(c) for c in cls.__mro__ if c is not object)


def _has_wrappable_method(cls: type) -> bool:
  # nnx.List / nnx.Dict have no __call__: they only hold a policy, which
  # their children inherit.
  return any(_defines(cls, m) for m in _methods_to_wrap(cls))


def _cast_arrays(tree: Any, dtype: np.dtype) -> Any:
  """Casts floating array leaves; graph nodes (modules, Rngs) pass through."""
  return _common.cast_arrays(tree, dtype, (nnx.Pytree, nnx.Variable))


@contextlib.contextmanager
def _params_in(module: nnx.Module, dtype: np.dtype):
  """Has the module's own Params read in `dtype` for the duration."""
  saved = []
  try:
    for param in _own_params(module):
      raw = param.get_raw_value()
      value = param.get_value()
      if _common.is_float_array(value) and value.dtype != dtype:
        saved.append((param, raw))
        # Restored below, so bypassing the trace-level check leaks nothing.
        param.set_raw_value(value.astype(dtype), _unsafe_bypass_check=True)
    yield
  finally:
    for param, raw in reversed(saved):
      param.set_raw_value(raw, _unsafe_bypass_check=True)


def _wrap_method(method):
  @functools.wraps(method)
  def wrapped(self, *args, **kwargs):
    policy = vars(self).get(_POLICY_ATTR)
    if policy is None:  # e.g. an instance built from the subclass directly
      return method(self, *args, **kwargs)
    args, kwargs = _cast_arrays((args, kwargs), policy.compute_dtype)
    with _params_in(self, policy.compute_dtype):
      out = method(self, *args, **kwargs)
    return _cast_arrays(out, policy.output_dtype)
  return wrapped


def _subclass_name(base: type) -> str:
  # A reversible, identifier-safe name, so pickle finds the class by name
  # (see __getattr__ below) even in a process that has not created it yet.
  return "_policied_" + f"{base.__module__}:{base.__qualname__}".encode(
      ).hex()


def _policied_class(base: type) -> type:
  """The cached boundary-casting subclass of `base`."""
  if getattr(base, "_jmp_amp_base", None) is not None:
    return base
  if base in _SUBCLASSES:
    return _SUBCLASSES[base]
  body = {name: _wrap_method(getattr(base, name))
          for name in _methods_to_wrap(base) if _defines(base, name)}
  body["_jmp_amp_base"] = base
  body["__module__"] = __name__
  body["__doc__"] = base.__doc__
  name = _subclass_name(base)
  kwds = {}
  if hasattr(base, "_pytree__is_pytree"):
    kwds["pytree"] = base._pytree__is_pytree
  sub = types.new_class(base.__name__, (base,), kwds,
                        lambda ns: ns.update(body))
  sub.__qualname__ = name
  _SUBCLASSES[base] = sub
  setattr(sys.modules[__name__], name, sub)
  return sub


def __getattr__(name: str) -> Any:
  if name.startswith("_policied_"):
    try:
      module_name, qualname = bytes.fromhex(
          name[len("_policied_"):]).decode().split(":", 1)
    except ValueError:
      raise AttributeError(name) from None
    __import__(module_name)
    base = sys.modules[module_name]
    for part in qualname.split("."):
      base = getattr(base, part)
    return _policied_class(base)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
