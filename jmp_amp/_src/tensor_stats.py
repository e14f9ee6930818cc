"""Range statistics of one tensor, computed on device (jit-safe, no sync).

One pass over the tensor: the four statistics are one variadic reduction,
so a statistic costs one read of the tensor and one kernel.
"""

from __future__ import annotations

import functools
import operator
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

STAT_NAMES = ("max_abs", "underflow", "zeros", "nonfinite")


def tensor_stats(x: jax.Array, dtype: Optional[Any] = None
                 ) -> dict[str, jax.Array]:
  """Range statistics of a floating array.

  Example:
    >>> s = tensor_stats(jnp.array([0.0, 1e-6, 3.0, jnp.inf], jnp.float32),
    ...                  dtype=jnp.float16)
    >>> {k: v.item() for k, v in s.items()}
    {'max_abs': 3.0, 'underflow': 0.25, 'zeros': 0.25, 'nonfinite': 1}

  Args:
    x: the array (any floating dtype; not floating: a TypeError).
    dtype: the dtype whose range `underflow` is measured against, e.g. the
      module's compute dtype; default ``x.dtype``.

  Returns:
    A dict of scalars: ``max_abs`` (float32, the largest finite ``|x|``),
    ``underflow`` (the fraction of non-zero finite values below `dtype`'s
    smallest normal: subnormal there, or flushed to zero by a kernel that
    flushes), ``zeros`` (the fraction of exact zeros: flushed or underflowed
    values end here), both float32, and ``nonfinite`` (the count of inf/NaN,
    an exact uint32).
  """
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"tensor_stats takes a floating array, got {x.dtype}")
  _check_size(x.size)
  if not x.size:
    return finish({"max_abs": jnp.zeros((), jnp.float32),
                   **{k: jnp.zeros((), jnp.uint32)
                      for k in STAT_NAMES[1:] + ("size",)}})
  return tree_stats(x, dtype)


# The counts are uint32, exact to 2**32 - 1 elements. (float32 counts stop
# at 2**24: XLA:CPU reported a quarter of a 2**26-element zero tensor as
# zeros.)
_MAX_SIZE = 2**32 - 1


def _check_size(size: int) -> None:
  if size > _MAX_SIZE:
    raise ValueError(f"tensor statistics count at most 2**32 - 1 elements; "
                     f"got a tensor of {size}: take them of its parts")


def _counts(x: jax.Array, dtype: Optional[Any]) -> tuple[jax.Array, ...]:
  """(largest finite |x|, #underflowing, #zeros, #inf/NaN) of `x`, the
  counts exact uint32: one variadic reduction, so one kernel per tensor
  (four reductions and their scalar tails made per-module telemetry double
  a train step's compile time; issue #33)."""
  tiny = float(jnp.finfo(x.dtype if dtype is None else dtype).tiny)
  a = jnp.abs(x).astype(jnp.float32)
  finite = jnp.isfinite(a)
  flag = lambda b: b.astype(jnp.uint32)
  # lax.select, not jnp.where: no nested jit per tensor (compile time).
  operands = (jax.lax.select(finite, a, jnp.zeros_like(a)),
              flag((a > 0) & (a < tiny)),
              flag(a == 0), flag(~finite))
  inits = (jnp.zeros((), jnp.float32),) + (jnp.zeros((), jnp.uint32),) * 3
  return tuple(jax.lax.reduce(
      operands, inits,
      lambda p, q: (jnp.maximum(p[0], q[0]), p[1] + q[1], p[2] + q[2],
                    p[3] + q[3]),
      tuple(range(x.ndim))))


def tree_counts(tree: Any, dtype: Optional[Any] = None
                ) -> Optional[dict[str, jax.Array]]:
  """The counts behind `tree_stats`, of the floating leaves of `tree`
  together: ``max_abs`` (float32) and the exact uint32 counts
  ``underflow``, ``zeros``, ``nonfinite`` and ``size``; None if there are
  no floating leaves. Counts of several calls add up (`add_counts`), and
  `finish` turns them into statistics."""
  leaves = _floating_leaves(tree)
  if not leaves:
    return None
  size = sum(int(np.size(leaf)) for leaf in leaves)
  _check_size(size)
  per_leaf = _leaves_counts(leaves, dtype)
  total = {name: functools.reduce(
      jnp.maximum if name == "max_abs" else operator.add, per_leaf[name])
           for name in STAT_NAMES}
  total["size"] = jnp.asarray(size, jnp.uint32)
  return total


def add_counts(a: dict[str, jax.Array], b: dict[str, jax.Array]
               ) -> dict[str, jax.Array]:
  """The counts of two calls taken together."""
  return {k: jnp.maximum(a[k], b[k]) if k == "max_abs" else a[k] + b[k]
          for k in a}


def finish(counts: dict[str, Any]) -> dict[str, Any]:
  """The statistics of `tree_counts` (device or host values): fractions of
  all the elements counted (0 of none), ``nonfinite`` an exact uint32."""
  xp = jnp if isinstance(counts["size"], jax.Array) else np
  size = xp.maximum(counts["size"], 1).astype(np.float32)
  return {"max_abs": counts["max_abs"],
          "underflow": counts["underflow"].astype(np.float32) / size,
          "zeros": counts["zeros"].astype(np.float32) / size,
          "nonfinite": counts["nonfinite"]}


def tree_stats(tree: Any, dtype: Optional[Any] = None
               ) -> Optional[dict[str, jax.Array]]:
  """`tensor_stats` of the floating leaves of a pytree taken together (the
  fractions are of all their elements), or None if there are none."""
  counts = tree_counts(tree, dtype)
  return None if counts is None else finish(counts)


def _floating_leaves(tree: Any) -> tuple[jax.Array, ...]:
  return tuple(
      jnp.asarray(leaf) for leaf in jax.tree_util.tree_leaves(tree)
      if (hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.floating)
          and np.size(leaf)))


@functools.partial(jax.jit, static_argnums=1)
def _leaves_counts(leaves: tuple[jax.Array, ...], dtype: Optional[Any]
                   ) -> dict[str, tuple[jax.Array, ...]]:
  """Each leaf's counts (per statistic, a tuple over `leaves`), traced once
  per shapes and dtypes: a model's repeated blocks reuse one trace (tracing
  every tensor's reduction and tail again cost a 16-block GPT's telemetry
  step about two thirds of a second of tracing and lowering; issue #33).
  Inside a step the call is inlined: the program is the same.
  """
  per_leaf = [_counts(jax.lax.stop_gradient(leaf), dtype) for leaf in leaves]
  return dict(zip(STAT_NAMES, zip(*per_leaf)))


def format_stats(stats: dict[str, dict[str, Any]], *, top: int = 0) -> str:
  """A compact text table of ``{name: {kind: stats}}`` (host values).

  Rows with a non-finite count come first, then by ``max_abs``; ``top`` > 0
  keeps that many rows.

  Example (a float16 output: 1e-8 underflows, inf is counted):
    >>> import jmp_amp.numerics
    >>> x = jnp.array([1e-8, 0.0, 3.0, jnp.inf])
    >>> stats = {"head": {"out": jmp_amp.numerics.tensor_stats(x, jnp.float16)}}
    >>> print(jmp_amp.numerics.format_stats(stats))
    module of       max|x|  underfl   zeros inf/nan
    head   out           3   25.00%  25.00%       1
  """
  rows = []
  for name, kinds in stats.items():
    for kind, s in kinds.items():
      if not set(STAT_NAMES) <= set(s):
        continue  # e.g. the FP8 amax and scales
      s = {k: float(np.asarray(s[k])) for k in STAT_NAMES}
      rows.append((name or "<root>", kind, s))
  rows.sort(key=lambda r: (-r[2]["nonfinite"], -r[2]["max_abs"]))
  if top:
    rows = rows[:top]
  width = max([len(r[0]) for r in rows] + [6])
  lines = [f"{'module':<{width}} {'of':<4} {'max|x|':>10} {'underfl':>8} "
           f"{'zeros':>7} {'inf/nan':>7}"]
  for name, kind, s in rows:
    lines.append(f"{name:<{width}} {kind:<4} {s['max_abs']:>10.4g} "
                 f"{s['underflow']:>8.2%} {s['zeros']:>7.2%} "
                 f"{int(s['nonfinite']):>7d}")
  return "\n".join(lines)
