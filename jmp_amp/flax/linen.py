"""Per-module precision policies for Flax linen, without editing module code.

Linen modules are immutable definitions re-bound on every `apply`, so the
policies are applied around `apply`, with public Flax tools only:

1. A first, abstract pass (`jax.eval_shape`, nothing runs) of the same
   `apply` under a method interceptor (`flax.linen.intercept_methods`)
   records the bound modules the call reaches, with their class and scope
   path ('/'-joined, e.g. ``"Block_0/Dense_1"``; the root is ``""``), and
   resolves each one's policy (see `jmp_amp.flax.rules`).
2. The params are cast, inside the traced function so gradients flow back to
   the stored dtype, to the compute dtype of the module that owns them.
3. The real `apply` runs under an interceptor that casts each module's
   ``__call__`` (and `nn.Embed.attend`) floating array arguments to the
   compute dtype and its floating array outputs to the output dtype (not the
   root's under the catch-all ``"*"``: the model returns what its last layers
   compute).

Flax layers whose ``dtype`` is None (the default) compute in the dtype of
their inputs and params, so they follow the policy; a layer given an explicit
``dtype`` keeps it, on inputs and params rounded to the policy's compute
dtype, and `apply_with_policies` warns, naming it. Variables of other
collections (BatchNorm's ``batch_stats``) are neither cast nor re-typed: they
stay float32.
`init_with_policies` creates the params in each policy's param dtype.

Limits: methods other than ``__call__``/``attend`` run without boundary
casts; with lifted transforms (`nn.scan`, `nn.remat`) the transformed
module's scope path is what the patterns see; the first pass traces the
model abstractly, so it must be traceable as under `jax.jit` (no Python
branching on array values), and it doubles the tracing time (not the run
time) of a step.

Example:
  >>> import jmp_amp.flax
  >>> class MLP(nn.Module):
  ...   @nn.compact
  ...   def __call__(self, x):
  ...     x = nn.LayerNorm()(nn.relu(nn.Dense(8)(x)))
  ...     return nn.Dense(2, name="head")(x)
  >>> x = jnp.ones((3, 4))
  >>> rules = jmp_amp.flax.mixed_rules()
  >>> variables = jmp_amp.flax.init_with_policies(MLP(), rules,
  ...                                             jax.random.key(0), x)
  >>> jmp_amp.flax.apply_with_policies(MLP(), rules, variables, x).dtype
  dtype(bfloat16)
  >>> jmp_amp.flax.apply_with_policies(
  ...     MLP(), rules | {"head": "float32"}, variables, x).dtype
  dtype('float32')
"""

from __future__ import annotations

from typing import Any, Callable, Optional
import warnings

from flax import traverse_util
import flax.linen as nn
import jax
import numpy as np

from jmp_amp.flax import _common
from jmp_amp.flax import rules as rules_lib

_EXTRA_METHODS: dict[type, tuple[str, ...]] = {nn.Embed: ("attend",)}

Path = tuple[str, ...]


def _path(module: nn.Module) -> Optional[Path]:
  return None if module.scope is None else tuple(module.path)


def _record(modules: dict[Path, nn.Module]):
  """An interceptor recording the bound modules it sees, by scope path."""
  def interceptor(next_fun, args, kwargs, context):
    path = _path(context.module)
    if path is not None:
      modules.setdefault(path, context.module)
    return next_fun(*args, **kwargs)
  return interceptor


def _nearest(path: Path, table: dict[Path, Any]) -> Optional[Path]:
  """The longest prefix of `path` (itself included) that is in `table`."""
  for n in range(len(path), -1, -1):
    if path[:n] in table:
      return path[:n]
  return None


class _Plan:
  """The policies of one call's modules, from the recorded modules."""

  def __init__(self, ruleset: rules_lib.RuleSet,
               modules: dict[Path, nn.Module], *, strict: bool):
    self.resolved: dict[Path, rules_lib.Resolution] = {}
    self.modules = modules
    used = set()
    for path in sorted(modules, key=len):
      parent = _nearest(path[:-1], self.resolved) if path else None
      res = rules_lib.resolve(
          ruleset, "/".join(path), modules[path],
          None if parent is None else self.resolved[parent])
      self.resolved[path] = res
      if res.source in ("rule", "default"):
        used.add(res.rule.key)
    if modules:
      rules_lib.report_unmatched(
          ruleset, used, [("/".join(p), m) for p, m in modules.items()],
          strict=strict, what="the linen model")
      _common.warn_half_norms(
          [("/".join(p), modules[p], r) for p, r in self.resolved.items()],
          "the linen model")

  def warn_explicit_dtypes(self, modules: dict[Path, nn.Module]) -> None:
    """Warns about modules whose explicit ``dtype`` overrides the compute
    dtype: their inputs and params are still cast to it at the boundary,
    so they compute rounded values at the cost of their own dtype."""
    found = []
    for path, module in modules.items():
      res, dtype = self.resolved.get(path), getattr(module, "dtype", None)
      if res is None or res.policy is None or dtype is None:
        continue
      try:
        dtype = np.dtype(dtype)
      except TypeError:
        continue
      compute = np.dtype(res.policy.compute_dtype)
      if dtype != compute and np.issubdtype(dtype, np.floating):
        found.append(f"{'/'.join(path) or '<root>'} "
                     f"({type(module).__name__}, dtype={dtype.name}, "
                     f"policy compute {compute.name})")
    if found:
      more = f" (and {len(found) - 8} more)" if len(found) > 8 else ""
      warnings.warn(
          f"linen modules with an explicit dtype override the policy's "
          f"compute dtype: {', '.join(found[:8])}{more}. Their inputs and "
          "params are still cast to the policy's compute dtype, so they "
          "compute the rounded values in their own dtype: its cost, the "
          "policy's precision. Leave their dtype None (the default follows "
          "the policy), or give them a rule in their dtype, e.g. "
          "{path: \"float32\"}.", UserWarning, stacklevel=3)

  def owner_policy(self, path: Path):
    owner = _nearest(path, self.resolved)
    return None if owner is None else self.resolved[owner].policy

  def cast_params(self, variables: Any, which: str) -> Any:
    """`variables` with each param in its owner's `which` dtype."""
    if "params" not in variables:
      return variables
    flat = traverse_util.flatten_dict(variables["params"])
    cast = {}
    for path, value in flat.items():
      policy = self.owner_policy(tuple(path[:-1]))
      if policy is not None:
        value = _common.cast_arrays(value, getattr(policy, which), ())
      cast[path] = value
    return {**variables, "params": traverse_util.unflatten_dict(cast)}

  def intercept(self, next_fun, args, kwargs, context):
    module = context.module
    if context.method_name not in _common.methods_to_wrap(type(module),
                                                          _EXTRA_METHODS):
      return next_fun(*args, **kwargs)
    path = _path(module)
    res = self.resolved.get(path) if path is not None else None
    if res is None or res.policy is None:
      return next_fun(*args, **kwargs)
    policy = res.policy
    args, kwargs = _cast_arrays((args, kwargs), policy.compute_dtype)
    out = next_fun(*args, **kwargs)
    if rules_lib.casts_output("/".join(path), res):
      out = _cast_arrays(out, policy.output_dtype)
    return out


def _plan_for(call: Callable[[], Any], rules: Any, *, strict: bool,
              abstract: bool = True) -> tuple[_Plan, Any]:
  """Runs `call` (abstractly if `abstract`) recording its modules."""
  ruleset = rules_lib.validate_rules(rules, fp8=False)
  modules: dict[Path, nn.Module] = {}
  with nn.intercept_methods(_record(modules)):
    out = jax.eval_shape(call) if abstract else call()
  return _Plan(ruleset, modules, strict=strict), out


# --------------------------------------------------------------------------
# Public API.


def init_with_policies(module: nn.Module, rules: Any, rngs: Any, *args: Any,
                       strict: bool = False, **kwargs: Any) -> Any:
  """`module.init(rngs, *args, **kwargs)`, params in the policies' dtypes.

  Each param is stored in the param dtype of the policy of the module that
  owns it: float32 under the mixed policies. Other collections are as
  `init` makes them.

  Example:
    >>> import jmp_amp.flax
    >>> model = nn.Dense(2)
    >>> variables = jmp_amp.flax.init_with_policies(
    ...     model, "bfloat16", jax.random.key(0), jnp.ones((1, 3)))
    >>> variables["params"]["kernel"].dtype
    dtype(bfloat16)

  Args:
    module: the linen module.
    rules: a rules mapping, `Policy` or policy string (see
      `jmp_amp.flax.rules`).
    rngs: as for `init`.
    *args: as for `init`.
    strict: raise ValueError instead of warning about rules that decided no
      module.
    **kwargs: as for `init`.

  Returns:
    The variables.
  """
  plan, variables = _plan_for(lambda: module.init(rngs, *args, **kwargs),
                              rules, strict=strict, abstract=False)
  return plan.cast_params(variables, "param_dtype")


def apply_with_policies(module: nn.Module, rules: Any, variables: Any,
                        *args: Any, strict: bool = False, **kwargs: Any
                        ) -> Any:
  """`module.apply(variables, *args, **kwargs)` with per-module policies.

  Keyword arguments (``method=``, ``mutable=``, ``rngs=``) go to `apply`.
  Call it inside the differentiated function: the param casts are part of
  the traced program, so gradients come back in the stored dtypes. As the
  ``apply_fn`` of a `flax.training.train_state.TrainState`:
  ``functools.partial(jmp_amp.flax.apply_with_policies, module, rules)``.

  Example:
    >>> import jmp_amp.flax
    >>> model = nn.Sequential([nn.Dense(4), nn.BatchNorm(False)])
    >>> x = jnp.ones((2, 3))
    >>> variables = model.init(jax.random.key(0), x)
    >>> out, updates = jmp_amp.flax.apply_with_policies(
    ...     model, jmp_amp.flax.mixed_rules(), variables, x,
    ...     mutable=["batch_stats"])
    >>> out.dtype, updates["batch_stats"]["layers_1"]["mean"].dtype
    (dtype('float32'), dtype('float32'))

  Args:
    module: the linen module.
    rules: a rules mapping, `Policy` or policy string (see
      `jmp_amp.flax.rules`).
    variables: as for `apply`.
    *args: as for `apply`.
    strict: raise ValueError instead of warning about rules that decided no
      module.
    **kwargs: as for `apply`.

  Returns:
    What `apply` returns.
  """
  plan, _ = _plan_for(lambda: module.apply(variables, *args, **kwargs),
                      rules, strict=strict)
  plan.warn_explicit_dtypes(plan.modules)
  variables = plan.cast_params(variables, "compute_dtype")
  with nn.intercept_methods(plan.intercept):
    return module.apply(variables, *args, **kwargs)


def _cast_arrays(tree: Any, dtype: np.dtype) -> Any:
  return _common.cast_arrays(tree, dtype, (nn.Module,))
