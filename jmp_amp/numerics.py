"""Numerics debugging: where precision breaks.

* `find_nonfinite(fn, *args)`: the first equation, forward or backward, that
  turned finite values into inf/NaN: its primitive, dtypes, source line,
  module path and the largest finite operand it saw. Given a Flax model
  among its arguments, it reports Flax module paths and suggests a float32
  rule for the module, verified; ``jmp_amp.flax.make_train_step(...,
  on_nonfinite=print)`` runs it on the steps that went non-finite.
* `tensor_stats(x, dtype)`: on-device range statistics (max ``|x|``, the
  fraction below the dtype's smallest normal, exact zeros, inf/NaN count),
  jit-safe; `format_stats` prints a table of them.

Per-module telemetry inside a jitted Flax train step lives in
`jmp_amp.flax.numerics`. See docs/numerics.md.

Example:
  >>> import jmp_amp.numerics
  >>> def f(x):
  ...   with jax.named_scope("attn"):
  ...     scores = (x * 300.0) * x
  ...   return jnp.sum(jax.nn.softmax(scores))
  >>> r = jmp_amp.numerics.find_nonfinite(f, jnp.full((4,), 20.0, jnp.float16))
  >>> r.primitive, r.direction, r.module
  ('mul', 'forward', 'attn')

Not imported by `import jmp_amp`; import `jmp_amp.numerics` explicitly.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional

from jmp_amp._src import localise
from jmp_amp._src.tensor_stats import format_stats
from jmp_amp._src.tensor_stats import tensor_stats

__all__ = ("find_nonfinite", "format_stats", "tensor_stats")


def _is_flax_module(x: Any) -> bool:
  # A Flax model was built with Flax imported: look it up, never import it.
  nnx, linen = sys.modules.get("flax.nnx"), sys.modules.get("flax.linen")
  return ((nnx is not None and isinstance(x, nnx.Module))
          or (linen is not None and isinstance(x, linen.Module)))


def find_nonfinite(fn: Callable[..., Any], *args: Any, backward: bool = True,
                   loss_scale: Any = None, rules: Any = None,
                   variables: Any = None,
                   verify: bool = True) -> Optional[localise.NonFinite]:
  """The first op of ``fn(*args)`` (and its gradient) making inf/NaN.

  Runs outside `jit`, one primitive at a time: roughly the cost of running
  `fn` and its VJP op by op without fusion (the first call also compiles
  each distinct primitive), plus one host check per equation. Meant for the
  rare step that went non-finite. Sub-jaxprs (`jit`, `custom_jvp`, remat),
  the branch a `cond` takes and each iteration of a `scan` are entered; a
  `while` is one equation. Module paths come from `jax.named_scope` scopes;
  for an NNX model, from one jitted run under Flax's `nnx.capture`, which
  also names the module inside an `nnx.remat` or `nnx.cond` and the block of
  a scanned stack (``blocks/1/attn``). One program runs every block of a
  stack, so the rule suggested there is for every block (``{"blocks/*/attn":
  "float32"}``); if the model cannot run with it (its float32 output changes
  the dtype of the scan's carry, a float16 residual stream), the report has
  ``fixed=False`` and says why in ``reason``.

  A Flax model: ``find_nonfinite(loss_fn, model, batch)``, with an NNX
  model or a linen module (and its `variables`) as the first argument
  after ``loss_fn``, as `jmp_amp.flax.make_train_step` calls
  ``loss_fn(model, batch)``, differentiates the model's params, reports the
  Flax module path of the culprit, suggests the rule ``{path: "float32"}``
  and, with `verify`, re-runs a copy of the model with it (one compile).
  The model is not changed.

  Example:
    >>> import jmp_amp.flax
    >>> model = nnx.Sequential(nnx.Linear(16, 4, rngs=nnx.Rngs(0)),
    ...                        nnx.LayerNorm(4, rngs=nnx.Rngs(0)))
    >>> rules = jmp_amp.flax.mixed_rules("float16")
    >>> _ = jmp_amp.flax.set_policies(model, rules)
    >>> x = jnp.full((2, 16), 6e4)  # finite in float16; x @ kernel is not
    >>> r = jmp_amp.numerics.find_nonfinite(
    ...     lambda m, x: jnp.mean(m(x)), model, x, rules=rules)
    >>> r.primitive, r.module, r.suggested_rule, r.fixed
    ('dot_general', 'layers/0', {'layers/0': 'float32'}, True)
    >>> print(r)  # doctest: +ELLIPSIS
    first non-finite value: forward dot_general in module 'layers/0'
    ...
      suggested rule: {'layers/0': 'float32'} (removes every inf/NaN)

  Args:
    fn: the function; for a Flax model ``loss_fn(model, batch)`` returning a
      scalar loss (or ``(loss, aux)``); for linen, `model` is then a
      callable ``model(*args, **kwargs)``, as for
      `jmp_amp.flax.make_linen_train_step` (mutable collections are updated
      inside and their updates dropped).
    *args: its arguments (arrays or pytrees of arrays, their float leaves
      differentiated), or ``(model, batch)``.
    backward: also evaluate the gradient (the VJP of a cotangent of ones
      for every floating output; for a loss, its gradient).
    loss_scale: Flax models only: the loss scale of that step (a
      `jmp_amp.LossScale` or a number): backward overflows often happen
      only at that scale.
    rules: Flax models only: the rules the model's policies came from, for
      the verification (the suggested rule is added to them); default: the
      policies `get_policies` reports, one exact rule per module. For
      linen, the rules to apply the module with (default: none).
    variables: the linen module's variables (``params`` and any other
      collection).
    verify: Flax models only: re-run on a copy of the model with the
      suggested rule.

  Returns:
    None if every value stayed finite, else a report with the fields
    ``primitive`` (``"dot_general"``; ``"input"``), ``direction``
    (``"forward"``, ``"backward"`` or ``"input"``), ``module`` (the module
    path, or None), ``source`` (``file:line (function)``), ``name_stack``,
    ``in_dtypes``, ``out_dtypes``, ``max_finite`` (the largest finite
    ``|x|`` among the operands), ``outputs`` (per output ``"inf"``,
    ``"nan"``, ``"inf+nan"`` or ``"finite"``), ``suggested_rule`` and
    ``fixed`` (Flax models: the rule and whether it removed every inf/NaN;
    None: not verified), ``reason`` (why the model could not run with the
    rule, else None), ``argument`` and, from ``on_nonfinite``, ``step``,
    ``loss_scale`` and ``repeats`` (how many steps in a row went
    non-finite); ``str(report)`` says it in words. An inf/NaN already in
    the arguments (a batch, a parameter, a BatchNorm statistic, an array
    `fn` captured) is reported first, with direction ``"input"`` and its
    path in ``argument`` (``"args[1]['x']"``, ``"batch['image']"``,
    ``"params layers/0/kernel"``).
  """
  if args and _is_flax_module(args[0]):
    if len(args) != 2:
      raise TypeError("find_nonfinite(loss_fn, model, batch) takes one batch "
                      f"after the Flax model, got {len(args) - 1}")
    from jmp_amp.flax import numerics  # pylint: disable=g-import-not-at-top
    return numerics.localise_model(
        args[0], fn, args[1], loss_scale=loss_scale, rules=rules,
        variables=variables, verify=verify, backward=backward)
  given = [name for name, value in (("loss_scale", loss_scale),
                                    ("rules", rules), ("variables", variables))
           if value is not None]
  if given:
    raise TypeError(f"find_nonfinite: {', '.join(given)} apply to a Flax "
                    "model, find_nonfinite(loss_fn, model, batch); the "
                    "arguments hold none")
  return localise.find_nonfinite(fn, *args, backward=backward)
