"""Per-module precision policies for Flax linen, without editing module code.

Linen modules are immutable definitions re-bound on every `apply`, so the
policies are applied at call time, by a method interceptor
(`flax.linen.intercept_methods`) active inside `linen_policies(rules)`. For
every ``__call__`` (and `nn.Embed.attend`) of a bound module, it resolves the
module's policy from its class and its scope path ('/'-joined, e.g.
``"Block_0/Dense_1"``; the root is ``""``; see `jmp_amp.flax.rules`) and:

* casts floating array arguments to the compute dtype and floating array
  outputs to the output dtype;
* reads the module's own params in the compute dtype: ``self.param(...)``
  returns the cast value (the stored params stay in their dtype, float32 at
  init under the mixed policies);
* sets, for the duration of the call, the knobs the module has: ``dtype``
  (compute), ``param_dtype`` (used at init), and for half compute dtypes
  ``dot_general`` / ``conv_general_dilated`` to `jmp_amp.dot_general` /
  `jmp_amp.conv_general_dilated` (float32 results, half backward) when they
  are unset. The module is a throw-away bound clone, and the attributes are
  restored when the call returns.

Variables of other collections (BatchNorm's ``batch_stats``) are neither cast
nor re-typed: they stay float32.

Limits: methods other than ``__call__``/``attend`` run without boundary casts
(they still see the knobs of an enclosing call); params read other than
through ``self.param`` (``self.variables``, ``self.get_variable``) are not
cast; with lifted transforms (`nn.scan`, `nn.remat`) the transformed module's
scope path is what the patterns see.

Example:
  >>> model = LinenMLP()
  >>> variables = init_with_policies(model, mixed_rules(), key, x)  # float32
  >>> logits = apply_with_policies(model, mixed_rules(), variables, x)
  >>> logits.dtype
  dtype(bfloat16)
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable, Optional

import flax.linen as nn
from jax import lax
import numpy as np

import jmp_amp
from jmp_amp import Policy
from jmp_amp.flax import _common
from jmp_amp.flax import rules as rules_lib

_EXTRA_METHODS: dict[type, tuple[str, ...]] = {nn.Embed: ("attend",)}
_MATMUL_KNOBS = (
    ("dot_general", jmp_amp.dot_general),
    ("conv_general_dilated", jmp_amp.conv_general_dilated),
)
_MISSING = object()


class _State(threading.local):
  def __init__(self):
    super().__init__()
    self.stack: list[_Policies] = []


_STATE = _State()


class _Policies:
  """One active `linen_policies` context: rules and what they matched."""

  def __init__(self, ruleset: rules_lib.RuleSet):
    self.ruleset = ruleset
    self.used: set = set()
    self.seen: dict[tuple[str, type], Any] = {}

  def resolve(self, module: nn.Module) -> rules_lib.Resolution:
    parent = module.parent
    parent_res = self.resolve(parent) if isinstance(parent, nn.Module) else None
    path = "/".join(module.path)
    res = rules_lib.resolve(self.ruleset, path, module, parent_res)
    self.seen.setdefault((path, type(module)), module)
    if res.source in ("rule", "default"):
      self.used.add(res.rule.key)
    return res

  def intercept(self, next_fun, args, kwargs, context):
    # Only the innermost context applies, so nesting does not cast twice.
    if not _STATE.stack or _STATE.stack[-1] is not self:
      return next_fun(*args, **kwargs)
    module = context.module
    if context.method_name not in _common.methods_to_wrap(type(module),
                                                          _EXTRA_METHODS):
      return next_fun(*args, **kwargs)
    policy = self.resolve(module).policy
    if policy is None:
      return next_fun(*args, **kwargs)
    args, kwargs = _cast_arrays((args, kwargs), policy.compute_dtype)
    with _knobs(module, policy), _params_in(module, policy.compute_dtype):
      out = next_fun(*args, **kwargs)
    return _cast_arrays(out, policy.output_dtype)


@contextlib.contextmanager
def _knobs(module: nn.Module, policy: Policy):
  fields = getattr(type(module), "__dataclass_fields__", {})
  changes = {}
  if "dtype" in fields and _common.is_dtype_knob(module.dtype):
    changes["dtype"] = policy.compute_dtype
  if "param_dtype" in fields and _common.is_dtype_knob(module.param_dtype):
    changes["param_dtype"] = policy.param_dtype
  if policy.compute_dtype in _common.HALF:
    for name, replacement in _MATMUL_KNOBS:
      if (name in fields and getattr(module, name) is None
          and getattr(module, name + "_cls", None) is None):
        changes[name] = replacement
  saved = {name: getattr(module, name) for name in changes}
  try:
    for name, value in changes.items():
      # Bound modules are frozen dataclasses; this one is the clone bound for
      # this apply, and gets its attributes back below.
      object.__setattr__(module, name, value)
    yield
  finally:
    for name, value in saved.items():
      object.__setattr__(module, name, value)


@contextlib.contextmanager
def _params_in(module: nn.Module, dtype: np.dtype):
  """Makes ``self.param(...)`` of `module` return values cast to `dtype`."""
  scope = module.scope
  if scope is None:
    yield
    return
  previous = vars(scope).get("param", _MISSING)
  original = scope.param

  def param(name, init_fn, *init_args, **init_kwargs):
    return _cast_arrays(original(name, init_fn, *init_args, **init_kwargs),
                        dtype)

  scope.param = param
  try:
    yield
  finally:
    if previous is _MISSING:
      del scope.param
    else:
      scope.param = previous


# --------------------------------------------------------------------------
# Public API.


@contextlib.contextmanager
def linen_policies(rules: Any, *, strict: bool = False):
  """Applies per-module policies to the linen modules run inside.

  Rules are validated on entry. On a clean exit, rules that decided no module
  of those called warn (or raise ValueError if `strict`).

  Example:
    >>> with linen_policies(mixed_rules("float16")):
    ...   logits = model.apply(variables, x)

  Args:
    rules: a rules mapping, `Policy` or policy string (see
      `jmp_amp.flax.rules`).
    strict: raise instead of warning about rules that matched nothing.

  Yields:
    None.
  """
  ruleset = rules_lib.validate_rules(rules)
  ctx = _Policies(ruleset)
  _STATE.stack.append(ctx)
  try:
    with nn.intercept_methods(ctx.intercept):
      yield
  finally:
    popped = _STATE.stack.pop()
    assert popped is ctx
  if ctx.seen:
    rules_lib.report_unmatched(
        ruleset, ctx.used, [(p, m) for (p, _), m in ctx.seen.items()],
        strict=strict, what="the linen model")


def init_with_policies(module: nn.Module, rules: Any, rngs: Any, *args: Any,
                       strict: bool = False, **kwargs: Any) -> Any:
  """`module.init(rngs, *args, **kwargs)` under `linen_policies(rules)`.

  Params are created in each policy's param dtype: float32 under the mixed
  policies.

  Example:
    >>> variables = init_with_policies(model, mixed_rules(), key, x)
  """
  with linen_policies(rules, strict=strict):
    return module.init(rngs, *args, **kwargs)


def apply_with_policies(module: nn.Module, rules: Any, variables: Any,
                        *args: Any, strict: bool = False, **kwargs: Any
                        ) -> Any:
  """`module.apply(variables, *args, **kwargs)` under `linen_policies(rules)`.

  Keyword arguments (``method=``, ``mutable=``, ``rngs=``) go to `apply`.

  Example:
    >>> logits, updates = apply_with_policies(
    ...     model, mixed_rules(), variables, x, mutable=["batch_stats"])
  """
  with linen_policies(rules, strict=strict):
    return module.apply(variables, *args, **kwargs)


def policied_apply(module: nn.Module, rules: Any, *, strict: bool = False
                   ) -> Callable[..., Any]:
  """An ``apply_fn(variables, *args, **kwargs)`` that applies the policies.

  For `flax.training.train_state.TrainState.create(apply_fn=...)`; the rules
  are validated now.

  Example:
    >>> state = TrainState.create(apply_fn=policied_apply(model, rules),
    ...                           params=variables["params"], tx=tx)
  """
  rules_lib.validate_rules(rules)

  @functools.wraps(module.apply)
  def apply_fn(variables, *args, **kwargs):
    return apply_with_policies(module, rules, variables, *args,
                               strict=strict, **kwargs)
  return apply_fn


def _cast_arrays(tree: Any, dtype: np.dtype) -> Any:
  return _common.cast_arrays(tree, dtype, (nn.Module,))
