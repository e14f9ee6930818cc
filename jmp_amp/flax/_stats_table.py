"""The telemetry of a train step: ``{module path: {kind: stats}}``.

A module of a scanned stack reports one entry per block. Inside the step its
statistics stay stacked, one array per stack and kind whose rows are the
blocks, and a block's entry is read from its row when it is looked up.
Slicing every block's scalars out inside the step made them the program's
outputs one by one: on a 16-block scanned GPT with every module watched,
960 scalars, each a kernel of its own: about half of what telemetry added to
the step's compile time on XLA:CPU (issue #33).

A module called once keeps its leaves' counts (`tensor_stats.tree_counts`),
combined and normalised on lookup: in the step its statistics are its
leaves' reductions alone. Combining the leaves and turning counts into
fractions there made a few scalar kernels per module: on the 16-block GPT
unrolled, compiled for an H100, the telemetry step had 1912 kernels against
the bf16 step's 890, and has 1272.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
import functools
from typing import Any, Iterator, Optional, Sequence

import jax
import numpy as np

from jmp_amp._src import tensor_stats as stats_lib


# A stacked entry: (module path, kind, stack name, block index).
Ref = tuple[str, str, str, tuple[int, ...]]
# A stack's statistic names, one per column of its rows: (stack, names).
Names = tuple[str, tuple[str, ...]]
# An entry kept as `tree_counts`, normalised on lookup: ((path, kind), size).
Size = tuple[tuple[str, str], int]


@jax.tree_util.register_pytree_node_class
class StatsTable(Mapping):
  """A read-only mapping ``{module path: {kind: stats}}``, a pytree.

  ``kind`` is ``"out"``, ``"grad"`` or ``"fp8"``; ``stats`` a dict of
  scalars. Paths and kinds come sorted, as a jitted step returns a dict.
  The entries of a stack's blocks are read from its stacked statistics on
  lookup (an indexing op per statistic; on host values, after
  ``jax.device_get``, a NumPy index; under ``jax.eval_shape``, their shapes),
  and counted entries (`counted`) are combined and normalised on lookup.
  """

  def __init__(self, entries: Optional[dict[str, dict[str, Any]]] = None,
               stacks: Optional[dict[str, Any]] = None,
               refs: tuple[Ref, ...] = (), names: tuple[Names, ...] = (),
               sizes: tuple[Size, ...] = ()):
    self._entries = {} if entries is None else entries
    self._stacks = {} if stacks is None else stacks
    self._refs = tuple(refs)
    self._names = tuple(names)
    self._sizes = tuple(sizes)

  @classmethod
  def counted(cls, path: str, kind: str, counts: dict[str, Any], size: int
              ) -> "StatsTable":
    """The entry ``{path: {kind: normalise(counts, size)}}``, normalised on
    lookup (`tensor_stats.tree_counts`)."""
    return cls({path: {kind: counts}}, sizes=(((path, kind), size),))

  @classmethod
  def stacked(cls, kind: str, name: str, rows: Any, names: Sequence[str],
              picked: list[tuple[str, tuple[int, ...]]]) -> "StatsTable":
    """The entries ``(block path, block index)`` of `picked`, of `kind`,
    read from `rows` (``[*blocks, len(names)]``) of the stack `name`."""
    stack = f"{kind}:{name}"
    return cls({}, {stack: rows},
               tuple((path, kind, stack, idx) for path, idx in picked),
               ((stack, tuple(names)),))

  @staticmethod
  def union(tables: Iterable["StatsTable"]) -> "StatsTable":
    """All the entries of `tables`, in one pass (a module's kinds merged)."""
    entries, stacks, refs, names, sizes = {}, {}, [], [], []
    for table in tables:
      for path, kinds in table._entries.items():
        entries.setdefault(path, {}).update(kinds)
      stacks.update(table._stacks)
      refs += table._refs
      names += table._names
      sizes += table._sizes
    return StatsTable(entries, stacks, tuple(refs), tuple(names),
                      tuple(sizes))

  def __or__(self, other: "StatsTable") -> "StatsTable":
    return StatsTable.union((self, other))

  @functools.cached_property
  def _index(self) -> tuple[dict[str, list], dict[str, list]]:
    """path -> its counted ``(kind, size)`` and its stacked ``(kind, stack,
    block index, names)``: built once, so that reading every entry is
    linear in the table."""
    counted, stacked, names = {}, {}, dict(self._names)
    for (path, kind), size in self._sizes:
      counted.setdefault(path, []).append((kind, size))
    for path, kind, stack, idx in self._refs:
      stacked.setdefault(path, []).append((kind, stack, idx, names[stack]))
    return counted, stacked

  @functools.cached_property
  def _paths(self) -> list[str]:
    return sorted(set(self._entries) | {r[0] for r in self._refs})

  def __getitem__(self, path: str) -> dict[str, Any]:
    counted, stacked = self._index
    entry = dict(self._entries.get(path, {}))
    for kind, size in counted.get(path, ()):
      entry[kind] = _normalised(entry[kind], size)
    for kind, stack, idx, names in stacked.get(path, ()):
      entry[kind] = {name: _row(self._stacks[stack], idx + (i,))
                     for i, name in enumerate(names)}
    if not entry:
      raise KeyError(path)
    return {kind: entry[kind] for kind in sorted(entry)}

  def __iter__(self) -> Iterator[str]:
    return iter(self._paths)

  def __len__(self) -> int:
    return len(self._paths)

  def __repr__(self) -> str:
    return f"StatsTable({dict(self.items())!r})"

  def tree_flatten(self):
    return (self._entries, self._stacks), (self._refs, self._names,
                                           self._sizes)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(*children, *aux)


def _normalised(counts: dict[str, tuple[Any, ...]], size: int) -> Any:
  """`normalise(counts, size)`; of `jax.ShapeDtypeStruct` counts, scalars."""
  if isinstance(counts["max_abs"][0], jax.ShapeDtypeStruct):
    return {name: jax.ShapeDtypeStruct((), np.float32) for name in counts}
  return stats_lib.normalise(counts, size)


def _row(rows: Any, idx: tuple[int, ...]) -> Any:
  """``rows[idx]``; of a `jax.ShapeDtypeStruct` (`jax.eval_shape`'s
  output), its shape and dtype."""
  if isinstance(rows, jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct(rows.shape[len(idx):], rows.dtype)
  return rows[idx]
