"""`MatmulRecord` and `MatmulReport`: a program's dots and convolutions.

A report is a sequence of records, one per dot or convolution of a program,
with summaries by dtype. It is read from the StableHLO module JAX emits, by
walking its ops with the MLIR bindings (``stage="lowered"``), or from the
optimized HLO text a backend runs (``stage="compiled"``).

Counting rules:
  * A nested function (``func.func private``, an HLO computation) contributes
    its ops once per call site, in program order.
  * Loops are counted statically: the body of a `lax.scan` / while loop
    contributes its ops once, not once per iteration. Every branch of a
    conditional is listed.
  * On GPU, compiled dots and convolutions are mostly library calls
    (``__cublas$gemm``, ``__cublas$lt$matmul``, ``__cudnn$conv...``), reported
    with their target in `MatmulRecord.target`.
  * A fused attention kernel (cuDNN's ``__cudnn$fmha...`` call, forward or
    backward, which JAX emits at the lowered stage already) is one record of
    kind "attention": its contractions run inside it, so they are no GEMMs
    of the program, and none are missing.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
from typing import Any, Iterator, Optional, Sequence, Union

import jax
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo

from jmp_amp.tools import element_types
from jmp_amp.tools import fp8_layers
from jmp_amp.tools import fused_attention
from jmp_amp.tools import hlo_text
from jmp_amp.tools import mlir_locations

Shape = tuple[Optional[int], ...]
# Frames of this package are not user code (see `_pick_frame`).
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_GEMM_TARGETS = ("__cublas$", "__hipblas", "__rocblas", "__onednn$matmul")
_CONV_TARGETS = ("__cudnn$conv", "__miopen$conv", "__onednn$convolution")
_FP8_SCOPE_RE = re.compile(r"\bfp8\[([^\]]*)\]")


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
    kind: "dot_general", "convolution" or "attention" (a fused attention
      call: lhs the query, rhs the key, see `jmp_amp.tools.fused_attention`).
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
    target: the custom-call target of a GPU library call
      ("__cublas$lt$matmul"), or the kind of the Triton fusion a GEMM was
      generated in ("__triton_gemm", "__triton_nested_gemm_fusion"), else
      None.
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
    """``"lhs x rhs -> result"``, e.g. ``"bf16 x bf16 -> f32"``; a fused
    attention call's starts with "attention " (``"attention bf16 x bf16 ->
    bf16"``)."""
    head = "attention " if self.kind == "attention" else ""
    return f"{head}{self.lhs_dtype} x {self.rhs_dtype} -> {self.result_dtype}"

  @property
  def fp8_layer(self) -> Optional[str]:
    """The layer whose FP8 matmul this op belongs to, else None.

    An FP8 matmul of a layer runs under ``jax.named_scope("fp8[<path>]")``
    (`jmp_amp.flax.set_policies` names each FP8 module's scope by its path;
    code calling `jmp_amp.fp8.dot_general` itself can do the same), and XLA
    keeps the scope in the op names of the program it compiles.
    """
    m = _FP8_SCOPE_RE.search(self.name or "")
    return m.group(1) if m else None

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
    return report_from_stablehlo(module)

  @classmethod
  def from_hlo(cls, text: str) -> MatmulReport:
    """Builds a report from optimized HLO text (``Compiled.as_text()``)."""
    return report_from_hlo(text)

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
  def attention(self) -> tuple[MatmulRecord, ...]:
    """The fused attention calls (cuDNN's flash attention, forward and
    backward)."""
    return tuple(r for r in self.records if r.kind == "attention")

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
    wanted = {element_types.normalize_dtype(d) for d in dtype}
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

  def fp8_layers(self) -> dict[str, dict[str, int]]:
    """The ops of each FP8 layer (`MatmulRecord.fp8_layer`), by signature.

    Layers in order of their first op; at the compiled stage the ops are
    the GEMMs and convolutions XLA made of the layer's matmul (forward, and
    the input and weight gradients in a train step).
    """
    layers: dict[str, list[MatmulRecord]] = {}
    for r in self.records:
      if r.fp8_layer is not None:
        layers.setdefault(r.fp8_layer, []).append(r)
    return {layer: MatmulReport(records, self.stage).counts_by_signature()
            for layer, records in layers.items()}

  def fp8_fallbacks(self, expected: Optional[MatmulReport] = None
                    ) -> dict[str, str]:
    """The FP8 layers that did not compile to FP8 GEMMs only, and why.

    A layer is flagged if one of its ops has an operand that is not FP8.
    Given `expected` (the report of the same program at the lowered stage:
    the matmuls it asks for), a layer with fewer ops here than there is
    flagged too, unless its GEMMs were merged into FP8 ones: XLA merges
    matmuls that share an operand (the q, k and v projections of one
    input) into one GEMM named after one of them, so the FLOPs the other
    layers miss reappear in that layer's FP8 GEMMs. A layer is cleared as
    merged only when the FP8 FLOPs the program gained beyond what each
    layer asked for cover all it lost. An empty dict means every FP8
    layer's GEMMs are FP8.

    Example:
      >>> import jmp_amp.tools
      >>> def f(x, w):
      ...   with jax.named_scope("fp8[proj]"):
      ...     return x @ w
      >>> x = w = jnp.ones((4, 4), jnp.bfloat16)
      >>> report = jmp_amp.matmul_report(f, x, w)
      >>> report.fp8_layers()
      {'proj': {'bf16 x bf16 -> bf16': 1}}
      >>> report.fp8_fallbacks()
      {'proj': '1 of 1 ops not FP8 (1 x bf16 x bf16 -> bf16)'}

    Args:
      expected: the lowered-stage report of the same program, to find
        layers whose GEMMs were merged into GEMMs that are not FP8, or
        removed.

    Returns:
      ``{layer path: reason}``.
    """
    return fp8_layers.fallbacks(
        self.fp8_layers(), self.records,
        None if expected is None else expected.fp8_layers(),
        None if expected is None else expected.records)

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


# --------------------------------------------------------------------------
# Shared by both stages.


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
# StableHLO, through the MLIR bindings.


def report_from_stablehlo(module: Union[ir.Module, str]) -> MatmulReport:
  """A report from a StableHLO module or its text (``Lowered.as_text()``)."""
  if isinstance(module, str):
    # Any lowering's context has the dialects JAX's StableHLO uses.
    context = jax.jit(lambda: 0).lower().compiler_ir("stablehlo").context
    module = ir.Module.parse(module, context=context)
  # `.operation`: an OpView's `.name` can be its symbol name, not the op's.
  ops = [op.operation for op in module.body.operations]
  funcs = {ir.StringAttr(op.attributes["sym_name"]).value: op
           for op in ops if op.name == "func.func"}
  records: list[MatmulRecord] = []

  # A callee's op names are relative to its call: joined to the call's, as
  # XLA names the ops it inlines (a jitted function called from several
  # layers keeps each call's scope, e.g. "fp8[<layer>]").
  def visit(block, func, stack, prefix):
    for op in block.operations:
      op = op.operation
      if op.name == "func.call":
        callee = ir.FlatSymbolRefAttr(op.attributes["callee"]).value
        if callee in funcs and callee not in stack:
          visit(funcs[callee].regions[0].blocks[0], callee, stack + (callee,),
                _join(prefix, mlir_locations.location(op.location)[0]))
      elif op.name in ("stablehlo.dot_general", "stablehlo.dot",
                       "stablehlo.convolution") or fused_attention.mlir_target(op):
        records.append(_mlir_record(op, func, prefix))
      for region in op.regions:
        for inner in region.blocks:
          visit(inner, func, stack, prefix)

  # JAX's entry is "main"; otherwise the first public function (MLIR's
  # default visibility).
  public = [n for n, f in funcs.items() if "sym_visibility" not in f.attributes
            or ir.StringAttr(f.attributes["sym_visibility"]).value == "public"]
  for name in (["main"] if "main" in funcs else public[:1]):
    visit(funcs[name].regions[0].blocks[0], name, (name,), None)
  return MatmulReport(records, stage="lowered")


def _mlir_array(value) -> tuple[tuple[Optional[int], ...], str]:
  t = ir.RankedTensorType(value.type)
  shape = tuple(None if t.is_dynamic_dim(i) else t.get_dim_size(i)
                for i in range(t.rank))
  return shape, _mlir_dtype(t.element_type)


def _mlir_dtype(t: ir.Type) -> str:
  # MLIR spells i8 / ui8 / i1, complex<f32>, f8E4M3FN: HLO's names, then ours.
  name = str(t)
  integer = re.fullmatch(r"(u|s)?i(\d+)", name)
  if integer:
    name = ("u" if integer.group(1) == "u" else "s") + integer.group(2)
  return element_types.hlo_dtype({"complex<f32>": "c64", "complex<f64>": "c128"}.get(
      name, name.lower()))


def _join(prefix: Optional[str], name: Optional[str]) -> Optional[str]:
  return "/".join(n for n in (prefix, name) if n) or None


def _mlir_record(op, func: str, prefix: Optional[str]) -> MatmulRecord:
  (lhs, lhs_dt), (rhs, rhs_dt) = (_mlir_array(v) for v in op.operands[:2])
  out, out_dt = _mlir_array(op.results[0])
  target = fused_attention.mlir_target(op)
  if target:
    kind = "attention"
    flops = fused_attention.flops(target, fused_attention.mlir_config(op), lhs)
  elif op.name == "stablehlo.convolution":
    kind = "convolution"
    dn = stablehlo.ConvDimensionNumbers(op.attributes["dimension_numbers"])
    flops = element_types.conv_flops(out, rhs, dn.kernel_output_feature_dimension)
  else:
    kind = "dot_general"
    if op.name == "stablehlo.dot":  # lhs contracts its last dim
      contracting = [len(lhs) - 1] if lhs else []
    else:
      dn = stablehlo.DotDimensionNumbers(op.attributes["dot_dimension_numbers"])
      contracting = list(dn.lhs_contracting_dimensions)
    flops = element_types.dot_flops(lhs, out, contracting)
  name, frames = mlir_locations.location(op.location)
  return MatmulRecord(kind, lhs_dt, rhs_dt, out_dt, lhs, rhs, out, flops,
                      function=func, name=_join(prefix, name),
                      location=_pick_frame(frames), target=target)


# --------------------------------------------------------------------------
# Optimized HLO text.


def report_from_hlo(text: str) -> MatmulReport:
  """A report from optimized HLO text (``Compiled.as_text()``)."""
  if not text:
    raise ValueError("this backend's Compiled object has no HLO text to audit")
  module = hlo_text.HloModule(text)
  triton = module.triton_computations()
  records = []
  for comp, instr in module.walk():
    rec = _hlo_record(module, comp, instr)
    if rec is not None:
      if comp in triton and rec.target is None:
        rec = dataclasses.replace(rec, target=triton[comp])
      records.append(rec)
  return MatmulReport(records, stage="compiled")


def _hlo_record(module: hlo_text.HloModule, comp: str,
                instr: hlo_text.Instr) -> Optional[MatmulRecord]:
  target = None
  kind = {"dot": "dot_general", "convolution": "convolution"}.get(instr.opcode)
  if instr.opcode == "custom-call":
    target = instr.attr("custom_call_target") or ""
    if target.startswith(_GEMM_TARGETS):
      kind = "dot_general"
    elif target.startswith(_CONV_TARGETS):
      kind = "convolution"
    elif fused_attention.is_target(target):
      kind = "attention"
  if kind is None or len(instr.operands) < 2:
    return None
  (lhs, lhs_dt), (rhs, rhs_dt) = (module.operand(comp, instr, i) for i in (0, 1))
  out, out_dt = hlo_text.array(instr.type)
  if lhs is None or rhs is None or out is None:
    return None
  if kind == "attention":
    flops = fused_attention.flops(target, instr.backend_config(), lhs)
  elif kind == "dot_general":
    dims = instr.attr("lhs_contracting_dims")
    if dims is not None:
      contracting = [int(d) for d in dims.strip("{}").split(",") if d]
    else:
      config = instr.backend_config().get("gemm_backend_config", {})
      contracting = config.get("dot_dimension_numbers", {}).get(
          "lhs_contracting_dimensions")
      contracting = None if contracting is None else [int(d) for d in contracting]
    flops = element_types.dot_flops(lhs, out, contracting)
  else:
    labels = (instr.attr("dim_labels") or "").split("_")[-1].split("->")[0]
    # cuDNN backward convs name the forward conv's layouts: find its output
    # and kernel among our operands and result.
    fwd_out, kernel = out, rhs
    if target and "BackwardInput" in target:
      fwd_out = lhs
    elif target and "BackwardFilter" in target:
      fwd_out, kernel = rhs, out
    flops = element_types.conv_flops(fwd_out, kernel,
                        labels.index("o") if "o" in labels else None)
  name, frames = module.location(instr)
  return MatmulRecord(kind, element_types.hlo_dtype(lhs_dt), element_types.hlo_dtype(rhs_dt), element_types.hlo_dtype(out_dt),
                      lhs, rhs, out, flops, function=comp, name=name,
                      location=_pick_frame(frames), target=target)
