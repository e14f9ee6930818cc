"""`MatmulRecord` and `MatmulReport`: the matmul audit's results.

A report is a sequence of records, one per dot or convolution of a program,
with summaries by dtype. `jmp_amp.matmul_report` builds them; this module only
holds and prints them.
"""

from __future__ import annotations

import collections
import dataclasses
import os
from typing import Any, Iterator, Optional, Sequence

import ml_dtypes
import numpy as np

from jmp_amp._src import dtypes

Shape = tuple[Optional[int], ...]


@dataclasses.dataclass(frozen=True)
class MatmulRecord:
  """One dot_general or convolution of a lowered or compiled program.

  Example:
    >>> x = jnp.ones((3, 4), jnp.bfloat16)
    >>> w = jnp.ones((4, 8), jnp.bfloat16)
    >>> rec = jmp_amp.matmul_report(lambda a, b: a @ b, x, w)[0]
    >>> rec.signature, rec.flops
    ('bf16 x bf16 -> bf16', 192)

  Attributes:
    kind: "dot_general" or "convolution".
    lhs_dtype: short dtype name of the left operand ("bf16", "f32", "int8").
    rhs_dtype: short dtype name of the right operand (the kernel of a conv).
    result_dtype: dtype the op returns, i.e. its accumulation/output type.
    lhs_shape: shape of the left operand; None marks a dynamic dimension.
    rhs_shape: shape of the right operand.
    result_shape: shape of the result.
    flops: nominal FLOPs: ``2 * result elements * contracted size`` for dots,
      ``2 * output elements * kernel elements / output features`` for
      convolutions; None if a dimension is dynamic or unknown.
    function: the func.func / HLO computation the op sits in.
    name: JAX's op name path, e.g. "jit(f)/transpose(jvp())/dot_general", when
      the program carries it.
    location: "file.py:LINE" of the innermost call from user code (not from
      jmp_amp or an installed library such as Flax), when known.
    target: the custom-call target of a GPU library call ("__cublas$gemm"),
      else None.
  """

  kind: str
  lhs_dtype: str
  rhs_dtype: str
  result_dtype: str
  lhs_shape: Shape
  rhs_shape: Shape
  result_shape: Shape
  flops: Optional[int]
  function: str = ""
  name: Optional[str] = None
  location: Optional[str] = None
  target: Optional[str] = None

  @property
  def signature(self) -> str:
    """``"lhs x rhs -> result"``, e.g. ``"bf16 x bf16 -> f32"``."""
    return f"{self.lhs_dtype} x {self.rhs_dtype} -> {self.result_dtype}"

  @property
  def input_dtype(self) -> str:
    """The operand dtype, or ``"lhs x rhs"`` when the operands differ."""
    if self.lhs_dtype == self.rhs_dtype:
      return self.lhs_dtype
    return f"{self.lhs_dtype} x {self.rhs_dtype}"


class MatmulReport(Sequence[MatmulRecord]):
  """The dots and convolutions of a program, as a sequence of `MatmulRecord`.

  Example:
    >>> w = jnp.ones((4, 8), jnp.bfloat16)
    >>> loss = lambda w, x: jnp.sum(jnp.tanh(x @ w))
    >>> report = jmp_amp.matmul_report(jax.grad(loss), w,
    ...                                jnp.ones((3, 4), jnp.bfloat16))
    >>> report.summary()["by_signature"]
    {'bf16 x bf16 -> bf16': 2}
    >>> report.all_inputs_in("bf16")
    True
  """

  def __init__(self, records: Sequence[MatmulRecord], stage: str = "lowered"):
    self.records: tuple[MatmulRecord, ...] = tuple(records)
    self.stage = stage

  @classmethod
  def from_stablehlo(cls, module: Any) -> MatmulReport:
    """Builds a report from a StableHLO module (``Lowered.compiler_ir()``)
    or its text (``Lowered.as_text()``, a saved ``.mlir`` file)."""
    from jmp_amp.tools import audit  # pylint: disable=g-import-not-at-top
    return audit.report_from_stablehlo(module)

  @classmethod
  def from_hlo(cls, text: str) -> MatmulReport:
    """Builds a report from optimized HLO text (``Compiled.as_text()``)."""
    from jmp_amp.tools import audit  # pylint: disable=g-import-not-at-top
    return audit.report_from_hlo(text)

  def __len__(self) -> int:
    return len(self.records)

  def __getitem__(self, index):
    return self.records[index]

  def __iter__(self) -> Iterator[MatmulRecord]:
    return iter(self.records)

  def __repr__(self) -> str:
    return f"MatmulReport(stage={self.stage!r}, records={len(self.records)})"

  @property
  def dots(self) -> tuple[MatmulRecord, ...]:
    return tuple(r for r in self.records if r.kind == "dot_general")

  @property
  def convolutions(self) -> tuple[MatmulRecord, ...]:
    return tuple(r for r in self.records if r.kind == "convolution")

  @property
  def total_flops(self) -> int:
    """Sum of the known FLOPs (records with ``flops=None`` add nothing)."""
    return sum(r.flops or 0 for r in self.records)

  def input_dtypes(self) -> set[str]:
    """Names of every dtype that enters a dot or convolution as an operand."""
    return {d for r in self.records for d in (r.lhs_dtype, r.rhs_dtype)}

  def result_dtypes(self) -> set[str]:
    return {r.result_dtype for r in self.records}

  def all_inputs_in(self, *dtype: Any) -> bool:
    """Whether every operand of every op has one of the given dtypes.

    Accepts names ("bf16", "bfloat16", "int8") or dtypes. An empty report
    passes vacuously, so check `len(report)` too when that matters.
    """
    wanted = {normalize_dtype(d) for d in dtype}
    return self.input_dtypes() <= wanted

  def counts_by_signature(self) -> dict[str, int]:
    """Number of records per ``"lhs x rhs -> result"``, most common first."""
    return dict(collections.Counter(r.signature for r in self.records).most_common())

  def flops_by_input_dtype(self) -> dict[str, int]:
    """FLOPs per operand dtype ("bf16", or "bf16 x f32" for mixed operands)."""
    out: dict[str, int] = collections.defaultdict(int)
    for r in self.records:
      out[r.input_dtype] += r.flops or 0
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))

  def summary(self) -> dict[str, Any]:
    """Counts and FLOPs at a glance.

    Returns:
      A dict with "records" (number of ops), "total_flops", "by_signature"
      (`counts_by_signature`) and "flops_by_input_dtype".
    """
    return {
        "records": len(self.records),
        "total_flops": self.total_flops,
        "by_signature": self.counts_by_signature(),
        "flops_by_input_dtype": self.flops_by_input_dtype(),
    }

  def __str__(self) -> str:
    head = (f"MatmulReport(stage={self.stage}): {len(self.records)} ops, "
            f"{self.total_flops:,} FLOPs")
    if not self.records:
      return head
    rows = [("#", "kind", "lhs x rhs -> result", "lhs", "rhs", "result",
             "FLOPs", "where")]
    for i, r in enumerate(self.records):
      location = os.path.basename(r.location) if r.location else None
      where = " ".join(w for w in (location, r.target or r.name) if w)
      rows.append((str(i), r.kind, r.signature, _fmt_shape(r.lhs_shape),
                   _fmt_shape(r.rhs_shape), _fmt_shape(r.result_shape),
                   "?" if r.flops is None else f"{r.flops:,}", where))
    widths = [max(len(row[c]) for row in rows) for c in range(7)]
    lines = [head]
    for row in rows:
      cells = [row[c].rjust(widths[c]) if c in (0, 6) else row[c].ljust(widths[c])
               for c in range(7)]
      lines.append(("  " + "  ".join(cells) + "  " + row[-1]).rstrip())
    lines.append("by signature: " + ", ".join(
        f"{k}: {v}" for k, v in self.counts_by_signature().items()))
    total = self.total_flops or 1
    lines.append("FLOPs by input dtype: " + ", ".join(
        f"{k}: {v:,} ({100 * v / total:.1f}%)"
        for k, v in self.flops_by_input_dtype().items()))
    return "\n".join(lines)


def _fmt_shape(shape: Shape) -> str:
  if not shape:
    return "scalar"
  return "x".join("?" if d is None else str(d) for d in shape)


def short_dtype_name(numpy_name: str) -> str:
  """"bfloat16" -> "bf16", "float32" -> "f32"; other names ("int8") as numpy's."""
  try:
    dt = np.dtype(getattr(ml_dtypes, numpy_name, numpy_name))
  except TypeError:
    return numpy_name
  try:
    return dtypes.dtype_name(dt)
  except KeyError:
    return dt.name


def normalize_dtype(dtype: Any) -> str:
  """The short name of a dtype or dtype name, as records spell it."""
  if isinstance(dtype, str):
    try:
      return dtypes.dtype_name(dtypes.parse_dtype(dtype))
    except ValueError:
      return short_dtype_name(dtype)
  return short_dtype_name(np.dtype(dtype).name)
