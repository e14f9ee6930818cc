"""Numerics debugging: where precision breaks.

* `find_nonfinite(fn, *args)`: the first equation, forward or backward, that
  turned finite values into inf/NaN: its primitive, dtypes, source line,
  module path (`jax.named_scope` scopes; Flax module paths through
  `jmp_amp.flax.numerics`) and the largest finite operand it saw.
* `tensor_stats(x, dtype)`: on-device range statistics (max ``|x|``, the
  fraction below the dtype's smallest normal, exact zeros, inf/NaN count),
  jit-safe; `format_stats` prints a table of them.

Per-module telemetry inside a jitted Flax train step and the localiser for a
Flax model and loss (with a suggested float32 rule, verified) live in
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

from jmp_amp._src.localise import find_nonfinite
from jmp_amp._src.localise import NonFinite
from jmp_amp._src.tensor_stats import format_stats
from jmp_amp._src.tensor_stats import tensor_stats

__all__ = ("NonFinite", "find_nonfinite", "format_stats", "tensor_stats")
