"""Matmul-dtype audit: which dtypes the dots and convolutions of a program see.

Mixed precision pays off only if the matmuls really run on half-precision
inputs, and a stray float32 operand silently promotes a dot (and, through
autodiff, its transposes). `matmul_report` lowers a function and lists every
dot_general / convolution with its operand and result dtypes, shapes and
FLOPs, read from the program text XLA is given (StableHLO, ``stage="lowered"``)
or runs (optimized HLO, ``stage="compiled"``).

Counting rules:
  * A nested function (``func.func private``, an HLO computation) contributes
    its ops once per call site, in program order, so a jitted helper called
    twice shows twice.
  * Loops are counted statically: the body of a `lax.scan` / while loop
    contributes its ops once, not once per iteration. Every branch of a
    conditional is listed.
  * FLOPs are nominal: ``2 * result elements * contracted size`` for dots (that
    is 2*M*N*K per batch) and ``2 * output elements * kernel elements / output
    features`` for convolutions (kernel spatial size times input features per
    group). Zeros inserted by lhs (transposed-conv) dilation are counted, as
    XLA would compute them. Dynamic dimensions give ``flops=None``.
  * On GPU, compiled dots and convolutions are mostly custom calls
    (``__cublas$gemm``, ``__cublas$lt$matmul``, ``__cudnn$conv...``); those are
    reported with the target in `MatmulRecord.target`. Fused attention kernels
    (``__cudnn$fmha...``) are not counted.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
import sys
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import jax
import ml_dtypes
import numpy as np

from jmp_amp._src import dtypes

STAGES = ("lowered", "compiled")
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

Shape = tuple[Optional[int], ...]


# --------------------------------------------------------------------------
# Records and reports.


@dataclasses.dataclass(frozen=True)
class MatmulRecord:
  """One dot_general or convolution of a lowered or compiled program.

  Example:
    >>> rec = matmul_report(lambda a, b: a @ b, x_bf16, w_bf16)[0]
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
    flops: nominal FLOPs (see the module docstring), None if a dimension is
      dynamic or the contraction could not be read.
    function: the func.func / HLO computation the op sits in.
    name: JAX's op name path, e.g. "jit(f)/transpose(jvp())/dot_general", when
      the program text carries it.
    location: "file.py:LINE" of the call that created the op, when known: the
      innermost frame of user code, so an op made by `jmp_amp.dot_general` or
      a Flax layer points at the line that called it.
    target: the custom-call target for GPU library calls ("__cublas$gemm"),
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
    >>> report = matmul_report(loss_fn, params, batch)
    >>> report.summary()["by_signature"]
    {'bf16 x bf16 -> f32': 3, 'bf16 x bf16 -> bf16': 5}
    >>> assert report.all_inputs_in("bf16"), report
  """

  def __init__(self, records: Sequence[MatmulRecord], stage: str = "lowered"):
    self.records: tuple[MatmulRecord, ...] = tuple(records)
    self.stage = stage

  @classmethod
  def from_stablehlo(cls, text: str) -> MatmulReport:
    """Builds a report from StableHLO text (``Lowered.as_text()``)."""
    return cls(_parse_stablehlo(text), stage="lowered")

  @classmethod
  def from_hlo(cls, text: str) -> MatmulReport:
    """Builds a report from HLO text (``Compiled.as_text()``)."""
    return cls(_parse_hlo(text), stage="compiled")

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
    wanted = {_normalize_dtype(d) for d in dtype}
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
    header = ("#", "kind", "lhs x rhs -> result", "lhs", "rhs", "result",
              "FLOPs", "where")
    rows = [header]
    for i, r in enumerate(self.records):
      where = " ".join(
          w for w in (_short_location(r.location), r.target or r.name) if w)
      rows.append((str(i), r.kind, r.signature, _fmt_shape(r.lhs_shape),
                   _fmt_shape(r.rhs_shape), _fmt_shape(r.result_shape),
                   "?" if r.flops is None else f"{r.flops:,}", where))
    widths = [max(len(row[c]) for row in rows) for c in range(len(header) - 1)]
    lines = [head]
    for row in rows:
      cells = [row[c].rjust(widths[c]) if c in (0, 6) else row[c].ljust(widths[c])
               for c in range(len(widths))]
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


def _short_location(location: Optional[str]) -> Optional[str]:
  return os.path.basename(location) if location else None


# --------------------------------------------------------------------------
# Entry point.


def matmul_report(fn: Any, *args: Any, stage: str = "lowered",
                  static_argnums: Union[int, Sequence[int]] = (),
                  static_argnames: Union[str, Sequence[str]] = (),
                  **kwargs: Any) -> MatmulReport:
  """Lists the dots and convolutions of `fn(*args, **kwargs)` with their dtypes.

  Nothing is executed: `fn` is traced and lowered (and, for
  ``stage="compiled"``, compiled) with `jax.jit`, or with `flax.nnx.jit` when
  an argument is a Flax NNX module or other graph object.

  Example:
    >>> report = matmul_report(jax.grad(loss), params, x)
    >>> print(report)              # one row per op
    >>> report.summary()["by_signature"]
    {'bf16 x bf16 -> bf16': 8}

  Args:
    fn: a callable (a Flax NNX module too), an already-jitted function
      (anything with ``.lower``), a `jax.stages.Lowered` or a
      `jax.stages.Compiled` (then no arguments; a Compiled object is always
      read at the compiled stage).
    *args: positional arguments to lower `fn` with (arrays or
      `jax.ShapeDtypeStruct`).
    stage: "lowered" reads the StableHLO JAX emits, i.e. the dtypes the program
      asks for. "compiled" reads the HLO after XLA's optimizations, i.e. what
      the backend runs (XLA:CPU, for instance, upcasts bf16 dots to f32).
    static_argnums: passed to `jax.jit` / `nnx.jit` when this function jits
      `fn`.
    static_argnames: likewise.
    **kwargs: keyword arguments of `fn` (bind any named `stage`,
      `static_argnums` or `static_argnames` with `functools.partial`).

  Returns:
    A `MatmulReport`.

  Raises:
    TypeError: `fn` is not callable, or arguments were given with a Lowered /
      Compiled object.
    ValueError: `stage` is not one of "lowered", "compiled".
  """
  if stage not in STAGES:
    raise ValueError(
        f"stage must be one of {', '.join(map(repr, STAGES))}; got {stage!r}")
  staged = isinstance(fn, (jax.stages.Lowered, jax.stages.Compiled))
  if staged and (args or kwargs):
    raise TypeError(
        f"matmul_report got arguments with an already {type(fn).__name__} "
        "object; pass the function instead, or no arguments")
  static = any(v is not None and v != () and v != [] and v != ""
               for v in (static_argnums, static_argnames))

  if not staged and _is_flax_graph_node(fn):
    # A module is state as well as code: pass it as an argument so that
    # nnx.jit tracks its variables instead of baking them in as constants.
    args, fn = (fn,) + args, _call_module
    if isinstance(static_argnums, int):
      static_argnums = (static_argnums,)
    static_argnums = tuple(i + 1 if i >= 0 else i for i in static_argnums or ())

  if isinstance(fn, jax.stages.Compiled):
    return MatmulReport.from_hlo(_compiled_text(fn))
  if isinstance(fn, jax.stages.Lowered):
    lowered = fn
  elif not callable(fn):
    raise TypeError(
        "matmul_report expects a callable, a jitted function, a "
        "jax.stages.Lowered or a jax.stages.Compiled; got "
        f"{type(fn).__name__}: {_brief(fn)}")
  elif hasattr(fn, "lower"):
    if static:
      raise TypeError(
          "static_argnums/static_argnames only apply when matmul_report jits "
          "fn; give them to the jit that made this function instead")
    lowered = fn.lower(*args, **kwargs)
  else:
    jit = _nnx_jit() if _has_flax_graph_node(args, kwargs) else jax.jit
    lowered = jit(fn, static_argnums=static_argnums,
                  static_argnames=static_argnames).lower(*args, **kwargs)

  if stage == "compiled":
    return MatmulReport.from_hlo(_compiled_text(lowered.compile()))
  return MatmulReport.from_stablehlo(lowered.as_text(debug_info=True))


def _brief(value: Any) -> str:
  text = repr(value)
  return text if len(text) <= 80 else text[:77] + "..."


def _compiled_text(compiled: Any) -> str:
  text = compiled.as_text()
  if not text:
    raise ValueError("this backend's Compiled object has no HLO text to audit")
  return text


def _from_flax(x: Any) -> bool:
  # User models subclass flax classes from their own modules: check the MRO.
  # Nothing can come from flax before flax is imported.
  return "flax" in sys.modules and any(
      c.__module__.split(".")[0] == "flax" for c in type(x).__mro__)


def _is_flax_graph_node(x: Any) -> bool:
  # flax is imported only when a value comes from it, so that
  # `import jmp_amp` stays free of flax.
  if not _from_flax(x):
    return False
  from flax import nnx  # pylint: disable=g-import-not-at-top
  return nnx.graph.is_graph_node(x)


def _has_flax_graph_node(args: tuple, kwargs: dict) -> bool:
  leaves = jax.tree_util.tree_leaves((args, kwargs), is_leaf=_from_flax)
  return any(_is_flax_graph_node(x) for x in leaves)


def _call_module(module, *args, **kwargs):
  return module(*args, **kwargs)


def _nnx_jit() -> Callable[..., Any]:
  from flax import nnx  # pylint: disable=g-import-not-at-top
  return nnx.jit


# --------------------------------------------------------------------------
# Dtypes.

_MLIR_DTYPES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32",
                "f64": "float64", "i1": "bool", "tf32": None,
                "complex<f32>": "complex64", "complex<f64>": "complex128"}
_HLO_DTYPES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32",
               "f64": "float64", "pred": "bool", "c64": "complex64",
               "c128": "complex128"}


def _numpy_name(name: str, hlo: bool) -> Optional[str]:
  table = _HLO_DTYPES if hlo else _MLIR_DTYPES
  if name in table:
    return table[name]
  m = re.fullmatch(r"(s|u)(\d+)" if hlo else r"(i|si|ui)(\d+)", name)
  if m:
    return ("uint" if m.group(1).startswith("u") else "int") + m.group(2)
  m = re.fullmatch(r"f(\d+)([eE]\w+)", name)
  if m:  # f8E4M3FN (MLIR) / f8e4m3fn (HLO) -> ml_dtypes.float8_e4m3fn
    return f"float{m.group(1)}_{m.group(2).lower()}"
  return None


def _dtype_short(name: str, hlo: bool) -> str:
  """Short name of an MLIR/HLO element type, via numpy: "bf16", "int8"."""
  np_name = _numpy_name(name, hlo)
  if np_name is None:
    return name
  try:
    dt = np.dtype(getattr(ml_dtypes, np_name, np_name))
  except TypeError:
    return name
  return _np_short(dt)


def _np_short(dt: np.dtype) -> str:
  try:
    return dtypes.dtype_name(dt)
  except KeyError:
    return dt.name


def _normalize_dtype(dtype: Any) -> str:
  if isinstance(dtype, str):
    try:
      return _np_short(dtypes.parse_dtype(dtype))
    except ValueError:
      pass
    try:
      return _np_short(np.dtype(getattr(ml_dtypes, dtype, dtype)))
    except TypeError:
      return dtype
  return _np_short(np.dtype(dtype))


# --------------------------------------------------------------------------
# Shared text helpers.


def _match_close(text: str, start: int) -> int:
  """Index just past the bracket closing the one at `text[start]`.

  Quote-aware, so names like "jit(f)" inside strings do not count.
  """
  opening = text[start]
  closing = {"(": ")", "[": "]", "{": "}", "<": ">"}[opening]
  depth, i, n = 0, start, len(text)
  while i < n:
    c = text[i]
    if c == '"':
      i += 1
      while i < n and text[i] != '"':
        i += 2 if text[i] == "\\" else 1
    elif c == opening:
      depth += 1
    elif c == closing:
      depth -= 1
      if depth == 0:
        return i + 1
    i += 1
  return n


def _split_top(text: str, sep: str = ",") -> list[str]:
  """Splits on `sep` outside brackets and quotes."""
  parts, depth, cur, i = [], 0, [], 0
  while i < len(text):
    c = text[i]
    if c == '"':
      j = _match_quote(text, i)
      cur.append(text[i:j])
      i = j
      continue
    if c in "([{<":
      depth += 1
    elif c in ")]}>":
      depth -= 1
    if c == sep and depth == 0:
      parts.append("".join(cur))
      cur = []
    else:
      cur.append(c)
    i += 1
  parts.append("".join(cur))
  return [p.strip() for p in parts if p.strip()]


def _match_quote(text: str, start: int) -> int:
  i = start + 1
  while i < len(text) and text[i] != '"':
    i += 2 if text[i] == "\\" else 1
  return i + 1


def _prod(values) -> Optional[int]:
  out = 1
  for v in values:
    if v is None:
      return None
    out *= v
  return out


def _dot_flops(lhs: Shape, result: Shape,
               contracting: Optional[Sequence[int]]) -> Optional[int]:
  if contracting is None:
    return None
  try:
    k = _prod(lhs[d] for d in contracting)
  except IndexError:
    return None
  numel = _prod(result)
  return None if k is None or numel is None else 2 * numel * k


def _conv_flops(out: Shape, kernel: Shape,
                kernel_out_dim: Optional[int]) -> Optional[int]:
  # Each output element reads kernel spatial size * input features per group
  # kernel entries: every kernel dim except the output-feature one.
  if kernel_out_dim is None or kernel_out_dim >= len(kernel):
    return None
  numel, k = _prod(out), _prod(kernel)
  if numel is None or k is None or not kernel[kernel_out_dim]:
    return None
  return 2 * numel * (k // kernel[kernel_out_dim])


def _pick_frame(frames: Sequence[tuple[str, int]]) -> Optional[str]:
  """The innermost frame of user code, i.e. outside jmp_amp and installed
  libraries (flax layers call `dot_general` for the user), else the innermost.
  """
  def library(file):
    path = os.path.abspath(file)
    return (path.startswith(_PACKAGE_DIR + os.sep) or
            any(d in path.split(os.sep) for d in ("site-packages", "dist-packages")))
  if not frames:
    return None
  file, line = next((f for f in frames if not library(f[0])), frames[0])
  return f"{file}:{line}"


# --------------------------------------------------------------------------
# StableHLO (MLIR text).

_FUNC_RE = re.compile(
    r'^\s*func\.func\s+(?:(?:public|private|nested)\s+)?@("[^"]*"|[\w.$\-]+)')
_SYMBOL_REF_RE = re.compile(r'@("[^"]*"|[\w.$\-]+)')
_MLIR_OP_RE = re.compile(r'(?:stablehlo|mhlo)\.(dot_general|convolution|dot)\b')
_LOC_DEF_RE = re.compile(r"^\s*(#loc\d*)\s*=\s*loc\((.*)\)\s*$")
_CONTRACT_PRETTY_RE = re.compile(r"contracting_dims\s*=\s*\[([\d,\s]*)\]\s*x")
_CONTRACT_GENERIC_RE = re.compile(r"lhs_contracting_dimensions\s*=\s*\[([\d,\s]*)\]")
_CONV_LABELS_RE = re.compile(r"\[([^\[\]]*)\]\s*x\s*\[([^\[\]]*)\]\s*->\s*\[")
_CONV_RAW_OUT_RE = re.compile(r"kernel_output_feature_dimension\s*=\s*(\d+)")


def _mlir_types(text: str) -> list[tuple[Shape, str]]:
  """The `tensor<...>` types in `text`, as (shape, short dtype name)."""
  out = []
  for m in re.finditer(r"tensor<", text):
    start = m.end() - 1
    body = text[start + 1:_match_close(text, start) - 1]
    body = _split_top(body)[0] if body else body  # drop any encoding
    dm = re.fullmatch(r"((?:(?:\d+|\?)x)*)(.+)", body.strip())
    if not dm:
      continue
    dims = tuple(None if d == "?" else int(d)
                 for d in dm.group(1).split("x") if d)
    out.append((dims, _dtype_short(dm.group(2).strip(), hlo=False)))
  return out


def _split_trailing_loc(line: str) -> tuple[str, Optional[str]]:
  """Splits `op ... loc(X)` into the op text and X."""
  for m in re.finditer(r"\sloc\(", line):
    end = _match_close(line, m.end() - 1)
    if not line[end:].strip():
      return line[:m.start()], line[m.end():end - 1]
  return line, None


class _LocResolver:
  """Resolves MLIR locations to (op name, frames innermost first)."""

  def __init__(self, definitions: dict[str, str]):
    self._defs = definitions
    self._cache: dict[str, tuple[Optional[str], list]] = {}

  def resolve(self, text: Optional[str]) -> tuple[Optional[str], Optional[str]]:
    if not text:
      return None, None
    try:
      name, frames = self._parse(text.strip(), depth=0)
    except (ValueError, IndexError, RecursionError):
      return None, None
    return name, _pick_frame(frames)

  def _alias(self, alias: str, depth: int):
    if alias not in self._cache:
      self._cache[alias] = (None, [])  # guards cycles
      body = self._defs.get(alias)
      self._cache[alias] = self._parse(body, depth + 1) if body else (None, [])
    return self._cache[alias]

  def _parse(self, text: str, depth: int):
    if depth > 200:
      raise ValueError("location nesting too deep")
    text = text.strip()
    if text.startswith("loc(") and text.endswith(")"):
      text = text[4:-1].strip()
    if text.startswith("#"):
      return self._alias(text, depth)
    if text.startswith("callsite("):
      inner = text[len("callsite("):_match_close(text, len("callsite")) - 1]
      callee, caller = _split_at(inner)
      _, f1 = self._parse(callee, depth + 1)
      _, f2 = self._parse(caller, depth + 1)
      return None, f1 + f2
    if text.startswith("fused"):
      start = text.index("[")
      name, frames = None, []
      for part in _split_top(text[start + 1:_match_close(text, start) - 1]):
        n, f = self._parse(part, depth + 1)
        name, frames = name or n, frames + f
      return name, frames
    if text.startswith('"'):
      end = _match_quote(text, 0)
      string, rest = text[1:end - 1], text[end:].strip()
      fm = re.match(r":(\d+)(?::\d+)?", rest)
      if fm:
        return None, [(string, int(fm.group(1)))]
      if rest.startswith("("):
        _, frames = self._parse(rest[1:_match_close(rest, 0) - 1], depth + 1)
        return string, frames
      return string, []
    return None, []


def _split_at(text: str) -> tuple[str, str]:
  """Splits ``A at B`` at the top-level " at "."""
  depth, i = 0, 0
  while i < len(text):
    c = text[i]
    if c == '"':
      i = _match_quote(text, i)
      continue
    if c in "([{<":
      depth += 1
    elif c in ")]}>":
      depth -= 1
    elif depth == 0 and text.startswith(" at ", i):
      return text[:i], text[i + 4:]
    i += 1
  raise ValueError(f"no 'at' in callsite {text!r}")


def _parse_stablehlo(text: str) -> list[MatmulRecord]:
  loc_defs: dict[str, str] = {}
  funcs: dict[str, list[str]] = {}
  public: list[str] = []
  current: Optional[str] = None
  for line in text.splitlines():
    m = _LOC_DEF_RE.match(line)
    if m:
      loc_defs[m.group(1)] = m.group(2)
      continue
    m = _FUNC_RE.match(line)
    if m:
      current = m.group(1).strip('"')
      funcs[current] = []
      if re.match(r"^\s*func\.func\s+public\b", line) or current == "main":
        public.append(current)
      continue
    if current is not None:
      funcs[current].append(line)

  resolver = _LocResolver(loc_defs)
  referenced = {ref.strip('"') for lines in funcs.values() for line in lines
                for ref in _SYMBOL_REF_RE.findall(line)}
  roots = list(dict.fromkeys(
      public + [f for f in funcs if f not in referenced]))
  records: list[MatmulRecord] = []

  def walk(func: str, stack: tuple[str, ...]):
    if func in stack:  # MLIR forbids recursion; never loop on bad input
      return
    for line in funcs[func]:
      op = _MLIR_OP_RE.search(line)
      if op:
        rec = _mlir_record(op.group(1), line, func, resolver)
        if rec is not None:
          records.append(rec)
        continue
      for ref in _SYMBOL_REF_RE.findall(line):
        ref = ref.strip('"')
        if ref in funcs:
          walk(ref, stack + (func,))

  for root in roots:
    walk(root, ())
  return records


def _mlir_record(op: str, line: str, func: str,
                 resolver: _LocResolver) -> Optional[MatmulRecord]:
  body, loc = _split_trailing_loc(line)
  arrow = body.rfind("->")
  if arrow < 0:
    return None
  operands, results = _mlir_types(body[:arrow]), _mlir_types(body[arrow:])
  if len(operands) < 2 or not results:
    return None
  (lhs, lhs_dt), (rhs, rhs_dt) = operands[-2:]
  out, out_dt = results[0]
  if op == "convolution":
    kind = "convolution"
    labels = _CONV_LABELS_RE.search(body)
    if labels:
      kernel = [s.strip() for s in labels.group(2).split(",")]
      o_dim = kernel.index("o") if "o" in kernel else None
    else:
      raw = _CONV_RAW_OUT_RE.search(body)
      o_dim = int(raw.group(1)) if raw else None
    flops = _conv_flops(out, rhs, o_dim)
  else:
    kind = "dot_general"
    if op == "dot":  # legacy dot: lhs contracts its last dim
      contracting = [len(lhs) - 1] if lhs else []
    else:
      cm = _CONTRACT_PRETTY_RE.search(body) or _CONTRACT_GENERIC_RE.search(body)
      contracting = ([int(d) for d in cm.group(1).replace(" ", "").split(",") if d]
                     if cm else [])
    flops = _dot_flops(lhs, out, contracting)
  name, location = resolver.resolve(loc)
  return MatmulRecord(kind, lhs_dt, rhs_dt, out_dt, lhs, rhs, out, flops,
                      function=func, name=name, location=location)


# --------------------------------------------------------------------------
# HLO text (compiled modules).

# `name = TYPE opcode(...)`, TYPE an array `f32[..]` or a tuple `(...)`; the
# type check keeps wrapped attribute lines (`window={...}`) from matching.
_HLO_INSTR_RE = re.compile(
    r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*((?:\(|[a-z][a-z0-9]*\[).*)$")
_HLO_COMP_RE = re.compile(
    r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\))?\s*(?:->.*)?\{\s*$")
_HLO_ARRAY_RE = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")
_HLO_CALLED_RE = re.compile(
    r"\b(?:calls|to_apply|body|condition|true_computation|false_computation|"
    r"branch_computations|called_computations)=(\{[^}]*\}|%?[\w.\-]+)")
_HLO_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")
_GEMM_PREFIXES = ("__cublas$", "__hipblas", "__rocblas", "__onednn$matmul")
_CONV_PREFIXES = ("__cudnn$conv", "__miopen$conv", "__onednn$convolution")


@dataclasses.dataclass
class _HloInstr:
  name: str
  type: str  # the result type text
  opcode: str
  operands: list[str]
  attrs: str


def _hlo_array(type_text: str) -> Optional[tuple[Shape, str]]:
  """First array type in `type_text` (the first element of a tuple)."""
  m = _HLO_ARRAY_RE.search(type_text)
  if not m:
    return None
  dims = tuple(int(d) if d.strip().isdigit() else None
               for d in m.group(2).split(",") if d.strip())
  return dims, _dtype_short(m.group(1), hlo=True)


def _parse_hlo_instr(name: str, rest: str) -> Optional[_HloInstr]:
  rest = rest.strip()
  if rest.startswith("("):
    end = _match_close(rest, 0)
  else:
    m = re.match(r"[\w]+\[[^\]]*\](?:\{[^}]*\})?", rest)
    if not m:
      return None
    end = m.end()
  type_text, tail = rest[:end], rest[end:].lstrip()
  m = re.match(r"([\w\-]+)\(", tail)
  if not m:
    return None
  close = _match_close(tail, m.end() - 1)
  return _HloInstr(name, type_text, m.group(1),
                   _split_top(tail[m.end():close - 1]), tail[close:])


def _logical_lines(text: str) -> list[str]:
  """Joins instructions whose attributes were wrapped over several lines.

  Printed modules hold one instruction a line; hand-written ones (tests, bug
  reports) often wrap `backend_config`.
  """
  out: list[str] = []
  pending = ""
  for line in text.splitlines():
    starts_new = bool(_HLO_INSTR_RE.match(line) or _HLO_COMP_RE.match(line) or
                      line.strip() == "}")
    if pending and not starts_new:
      pending = f"{pending} {line.strip()}"
    else:
      if pending:
        out.append(pending)
      pending = line
    if not _unbalanced_instr(pending):
      out.append(pending)
      pending = ""
  if pending:
    out.append(pending)
  return out


def _unbalanced_instr(line: str) -> bool:
  if not _HLO_INSTR_RE.match(line):
    return False
  unquoted = re.sub(r'"(?:[^"\\]|\\.)*"', '""', line)
  return (unquoted.count("(") > unquoted.count(")") or
          unquoted.count("{") > unquoted.count("}") or
          unquoted.rstrip().endswith(","))


def _parse_hlo(text: str) -> list[MatmulRecord]:
  tables: dict[str, dict[int, str]] = {t: {} for t in _HLO_TABLES}
  comps: dict[str, list[_HloInstr]] = {}
  entry: Optional[str] = None
  current: Optional[str] = None
  section: Optional[str] = None
  for line in _logical_lines(text):
    stripped = line.strip()
    if stripped in _HLO_TABLES:
      section = stripped
      continue
    if section is not None:
      m = re.match(r"^(\d+)\s+(.*)$", stripped)
      if m:
        tables[section][int(m.group(1))] = m.group(2)
        continue
      if not stripped:
        continue
      section = None
    m = _HLO_INSTR_RE.match(line)
    if m and current is not None:
      instr = _parse_hlo_instr(m.group(1), m.group(2))
      if instr is not None:
        comps[current].append(instr)
      continue
    m = _HLO_COMP_RE.match(line)
    if m and not stripped.startswith("HloModule"):
      current = m.group(2)
      comps[current] = []
      if m.group(1):
        entry = current
      continue
    if stripped == "}":
      current = None

  frames = _HloFrames(tables)
  types = {c: {i.name: i.type for i in instrs} for c, instrs in comps.items()}
  referenced = {n for instrs in comps.values() for i in instrs
                for n in _called(i, comps)}
  roots = [entry] if entry else []
  roots += [c for c in comps if c not in referenced and c not in roots]
  records: list[MatmulRecord] = []

  def walk(comp: str, stack: tuple[str, ...], context):
    if comp in stack:
      return
    for instr in comps[comp]:
      meta = _hlo_metadata(instr.attrs, frames) or context
      for callee in _called(instr, comps):
        walk(callee, stack + (comp,), meta)
      rec = _hlo_record(instr, comp, types[comp], meta)
      if rec is not None:
        records.append(rec)

  for root in roots:
    walk(root, (), (None, None))
  return records


def _called(instr: _HloInstr, comps: dict) -> list[str]:
  out = []
  for m in _HLO_CALLED_RE.finditer(instr.attrs):
    for name in re.findall(r"%?([\w.\-]+)", m.group(1)):
      if name in comps:
        out.append(name)
  return out


class _HloFrames:
  """Source locations from HLO's FileNames/FileLocations/StackFrames tables."""

  def __init__(self, tables: dict[str, dict[int, str]]):
    self._files = {k: v.strip('"') for k, v in tables["FileNames"].items()}
    self._locs = {k: _kv(v) for k, v in tables["FileLocations"].items()}
    self._frames = {k: _kv(v) for k, v in tables["StackFrames"].items()}

  def location(self, frame_id: int) -> Optional[str]:
    chain, seen = [], set()
    while frame_id in self._frames and frame_id not in seen:
      seen.add(frame_id)
      frame = self._frames[frame_id]
      loc = self._locs.get(frame.get("file_location_id", -1), {})
      file = self._files.get(loc.get("file_name_id", -1))
      if file is not None:
        chain.append((file, loc.get("line", 0)))
      # XLA prints parent ids one above the parent's own id (0 and 1: none).
      frame_id = frame.get("parent_frame_id", 0) - 1
    return _pick_frame(chain)


def _kv(text: str) -> dict[str, int]:
  return {k: int(v) for k, v in re.findall(r"(\w+)=(-?\d+)", text)}


def _hlo_metadata(attrs: str, frames: _HloFrames):
  m = re.search(r"metadata=\{", attrs)
  if not m:
    return None
  meta = attrs[m.end() - 1:_match_close(attrs, m.end() - 1)]
  name = re.search(r'op_name="((?:[^"\\]|\\.)*)"', meta)
  file = re.search(r'source_file="((?:[^"\\]|\\.)*)"', meta)
  line = re.search(r"source_line=(\d+)", meta)
  frame = re.search(r"stack_frame_id=(\d+)", meta)
  location = None
  if frame:
    location = frames.location(int(frame.group(1)))
  if location is None and file:
    location = f"{file.group(1)}:{line.group(1) if line else 0}"
  return (name.group(1) if name else None), location


def _operand_array(operand: str, types: dict[str, str]):
  parts = operand.rsplit(None, 1)
  if len(parts) == 2:  # "f32[2,3]{1,0} %x": the type is printed inline
    return _hlo_array(parts[0])
  type_text = types.get(operand.lstrip("%"))
  return _hlo_array(type_text) if type_text else None


def _hlo_record(instr: _HloInstr, comp: str, types: dict[str, str],
                meta) -> Optional[MatmulRecord]:
  target = None
  if instr.opcode == "dot":
    kind = "dot_general"
  elif instr.opcode == "convolution":
    kind = "convolution"
  elif instr.opcode == "custom-call":
    tm = re.search(r'custom_call_target="([^"]*)"', instr.attrs)
    target = tm.group(1) if tm else ""
    if target.startswith(_GEMM_PREFIXES):
      kind = "dot_general"
    elif target.startswith(_CONV_PREFIXES):
      kind = "convolution"
    else:
      return None
  else:
    return None
  if len(instr.operands) < 2:
    return None
  lhs_a = _operand_array(instr.operands[0], types)
  rhs_a = _operand_array(instr.operands[1], types)
  out_a = _hlo_array(instr.type)
  if lhs_a is None or rhs_a is None or out_a is None:
    return None
  (lhs, lhs_dt), (rhs, rhs_dt), (out, out_dt) = lhs_a, rhs_a, out_a

  if kind == "dot_general":
    cm = (re.search(r"lhs_contracting_dims=\{([\d,\s]*)\}", instr.attrs) or
          re.search(r'"lhs_contracting_dimensions":\s*\[([^\]]*)\]', instr.attrs))
    contracting = ([int(d) for d in re.findall(r"\d+", cm.group(1))]
                   if cm else None if target else [])
    flops = _dot_flops(lhs, out, contracting)
  else:
    lm = re.search(r"dim_labels=\w+_(\w+)->\w+", instr.attrs)
    labels = lm.group(1) if lm else ""
    o_dim = labels.index("o") if "o" in labels else None
    # cuDNN backward convs name the forward conv's layouts: find its output
    # and kernel among our operands and result.
    fwd_out, kernel = out, rhs
    if target and "BackwardInput" in target:
      fwd_out = lhs
    elif target and "BackwardFilter" in target:
      fwd_out, kernel = rhs, out
    flops = _conv_flops(fwd_out, kernel, o_dim)
  name, location = meta
  return MatmulRecord(kind, lhs_dt, rhs_dt, out_dt, lhs, rhs, out, flops,
                      function=comp, name=name, location=location,
                      target=target)
