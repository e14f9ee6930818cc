"""Helpers shared by the NNX and linen policy mechanisms.

`warn_half_norms` names a model's own norm classes left in half precision:
`mixed_rules` puts Flax's norm classes in float32; a model's own norm
(Gemma's ``layers.RMSNorm``) is none of them and falls under the catch-all
rule, so its statistics would be computed in half precision without a word.
"""

from __future__ import annotations

import re
from typing import Any, Iterable
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from jmp_amp import Policy
from jmp_amp._src import dtypes
from jmp_amp._src.tree import cast_floating
from jmp_amp.flax import rules


def is_dtype_knob(value: Any) -> bool:
  """Whether a module's `dtype`/`param_dtype` holds a value we may replace."""
  if value is None:
    return True
  try:
    return jnp.issubdtype(value, jnp.floating)
  except TypeError:
    return False


def is_float_array(x: Any) -> bool:
  return (isinstance(x, (jax.Array, np.ndarray))
          and jnp.issubdtype(x.dtype, jnp.floating))


def cast_arrays(tree: Any, dtype: np.dtype, opaque: tuple[type, ...]) -> Any:
  """Casts floating array leaves; instances of `opaque` pass through whole."""
  return cast_floating(tree, dtype, is_leaf=lambda x: isinstance(x, opaque))


def methods_to_wrap(cls: type,
                    extra_methods: dict[type, tuple[str, ...]]
                    ) -> tuple[str, ...]:
  """``__call__`` plus the extra methods registered for `cls`'s bases."""
  extra = tuple(m for base, ms in extra_methods.items()
                if issubclass(cls, base) for m in ms)
  return ("__call__",) + extra

# A class named like a norm (a model's own RMSNorm, T5LayerNorm,
# LayerNormalization), but not Flax's wrappers that normalise weights.
_NORM_NAME = re.compile(r"norm(alization)?$", re.IGNORECASE)
_NOT_NORMS = ("WeightNorm", "SpectralNorm")


def warn_half_norms(resolved: Iterable[tuple[str, Any, rules.Resolution]],
                    what: str) -> None:
  """Warns about modules named like norms that the rules leave in half.

  `mixed_rules` knows Flax's norm classes; a model's own (Gemma's
  ``layers.RMSNorm``) would compute its statistics in half precision under
  the catch-all rule. A rule naming the module or its class is a choice:
  no warning then.
  """
  found = []
  for path, module, res in resolved:
    name = type(module).__name__
    if (res.policy is None or isinstance(module, rules.NORM_CLASSES)
        or not _NORM_NAME.search(name) or name in _NOT_NORMS
        or (res.source == "rule" and res.rule.key != rules.DEFAULT_KEY)
        or not isinstance(res.policy, Policy)
        or np.dtype(res.policy.compute_dtype) not in dtypes.HALF_DTYPES):
      continue
    found.append((path or "<root>", name,
                  np.dtype(res.policy.compute_dtype).name))
  if not found:
    return
  listed = ", ".join(f"{p} ({n}, {d})" for p, n, d in found[:8])
  more = f" (and {len(found) - 8} more)" if len(found) > 8 else ""
  classes = ", ".join(dict.fromkeys(n for _, n, _ in found))
  warnings.warn(
      f"jmp_amp.flax: modules of {what} named like norms compute in half "
      f"precision under these rules: {listed}{more}. The rules know Flax's "
      "norm classes (nnx.RMSNorm, nnx.LayerNorm, ...), not these, and a "
      "norm's statistics lose their precision in half. Add a rule for the "
      f"class, e.g. rules | {{{classes.split(', ')[0]}: \"float32\"}}, "
      "or a rule of its own to keep it as it is.", UserWarning, stacklevel=4)
