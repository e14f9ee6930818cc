"""Matmul-dtype audit: which dtypes the dots and convolutions of a program see.

Mixed precision pays off only if the matmuls really run on half-precision
inputs, and a stray float32 operand silently promotes a dot (and, through
autodiff, its transposes). `matmul_report` lowers a function and lists every
dot_general / convolution with its operand and result dtypes, shapes and
FLOPs: by walking the ops of the StableHLO module JAX emits (MLIR bindings,
``stage="lowered"``), or from the optimized HLO the backend runs
(``stage="compiled"``).

Counting rules:
  * A nested function (``func.func private``, an HLO computation) contributes
    its ops once per call site, in program order.
  * Loops are counted statically: the body of a `lax.scan` / while loop
    contributes its ops once, not once per iteration. Every branch of a
    conditional is listed.
  * On GPU, compiled dots and convolutions are mostly library calls
    (``__cublas$gemm``, ``__cublas$lt$matmul``, ``__cudnn$conv...``), reported
    with their target in `MatmulRecord.target`. Fused attention kernels
    (``__cudnn$fmha...``) are not counted.
"""

from __future__ import annotations

import math
import os
import re
import sys
from typing import Any, Optional, Sequence, Union

import jax
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo

from jmp_amp.tools import hlo_text
from jmp_amp.tools.report import MatmulRecord
from jmp_amp.tools.report import MatmulReport
from jmp_amp.tools.report import short_dtype_name

STAGES = ("lowered", "compiled")
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_GEMM_TARGETS = ("__cublas$", "__hipblas", "__rocblas", "__onednn$matmul")
_CONV_TARGETS = ("__cudnn$conv", "__miopen$conv", "__onednn$convolution")
_NUMPY_NAMES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32",
                "f64": "float64", "c64": "complex64", "c128": "complex128"}


def matmul_report(fn: Any, *args: Any, stage: str = "lowered",
                  static_argnums: Union[int, Sequence[int]] = (),
                  static_argnames: Union[str, Sequence[str]] = (),
                  **kwargs: Any) -> MatmulReport:
  """Lists the dots and convolutions of `fn(*args, **kwargs)` with their dtypes.

  Nothing is executed: `fn` is traced and lowered (and, for
  ``stage="compiled"``, compiled) with `jax.jit`, or with `flax.nnx.jit` when
  an argument is a Flax NNX module or other graph object.

  Example:
    >>> loss = lambda w, x: jnp.sum(jnp.tanh(x @ w) ** 2)
    >>> w, x = jnp.ones((4, 8), jnp.bfloat16), jnp.ones((3, 4), jnp.bfloat16)
    >>> report = jmp_amp.matmul_report(jax.grad(loss), w, x)
    >>> report.summary()["by_signature"]
    {'bf16 x bf16 -> bf16': 2}
    >>> [r.flops for r in report]
    [192, 192]

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
  staged = lower(fn, *args, static_argnums=static_argnums,
                 static_argnames=static_argnames, **kwargs)
  if isinstance(staged, jax.stages.Compiled):
    return report_from_hlo(staged.as_text())
  if stage == "compiled":
    return report_from_hlo(staged.compile().as_text())
  return report_from_stablehlo(staged.compiler_ir("stablehlo"))


def lower(fn: Any, *args: Any, static_argnums=(), static_argnames=(),
          jit_kwargs: Optional[dict[str, Any]] = None, **kwargs: Any):
  """`fn` lowered for `args` (a Compiled `fn` is returned as it is).

  `jit_kwargs` go to the `jax.jit` / `nnx.jit` this function applies.
  """
  staged = isinstance(fn, (jax.stages.Lowered, jax.stages.Compiled))
  if staged and (args or kwargs):
    raise TypeError(
        f"got arguments with an already {type(fn).__name__} object; pass the "
        "function instead, or no arguments")
  if staged:
    return fn
  if not callable(fn):
    text = repr(fn)
    raise TypeError(
        "fn must be a callable, a jitted function, a jax.stages.Lowered or a "
        f"jax.stages.Compiled; got {type(fn).__name__}: "
        f"{text if len(text) <= 80 else text[:77] + '...'}")
  if hasattr(fn, "lower"):
    if static_argnums not in ((), None) or static_argnames not in ((), None, ""):
      raise TypeError(
          "static_argnums/static_argnames only apply when fn is not jitted "
          "yet; give them to the jit that made this function instead")
    return fn.lower(*args, **kwargs)
  if _is_flax_graph_node(fn):
    # A module is state as well as code: pass it as an argument so that
    # nnx.jit tracks its variables instead of baking them in as constants.
    args, fn = (fn,) + args, _call_module
    if isinstance(static_argnums, int):
      static_argnums = (static_argnums,)
    static_argnums = tuple(i + 1 if i >= 0 else i for i in static_argnums or ())
  if _has_flax_graph_node(args, kwargs):
    from flax import nnx  # pylint: disable=g-import-not-at-top
    jit = nnx.jit
  else:
    jit = jax.jit
  return jit(fn, static_argnums=static_argnums, static_argnames=static_argnames,
             **(jit_kwargs or {})).lower(*args, **kwargs)


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


def _dtype(name: Optional[str]) -> str:
  """Records' name of an HLO element type: "bf16", "f32", "int8", "bool"."""
  if name is None:
    return "?"
  if name in ("pred", "s1", "u1"):
    return "bool"
  if name[0] in "su" and name[1:].isdigit():
    return ("uint" if name[0] == "u" else "int") + name[1:]
  if name[:2] in ("f8", "f6", "f4"):
    return short_dtype_name(f"float{name[1]}_{name[2:]}")
  return short_dtype_name(_NUMPY_NAMES.get(name, name))


def _prod(dims) -> Optional[int]:
  dims = list(dims)
  return None if any(d is None for d in dims) else math.prod(dims)


def _dot_flops(lhs, result, contracting) -> Optional[int]:
  if contracting is None:
    return None
  k, n = _prod(lhs[d] for d in contracting), _prod(result)
  return None if k is None or n is None else 2 * n * k


def _conv_flops(out, kernel, kernel_out_dim) -> Optional[int]:
  # Each output element reads kernel spatial size * input features per group
  # kernel entries: every kernel dim except the output-feature one.
  n, k = _prod(out), _prod(kernel)
  if None in (n, k, kernel_out_dim) or not kernel[kernel_out_dim]:
    return None
  return 2 * n * (k // kernel[kernel_out_dim])


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

  def visit(block, func, stack):
    for op in block.operations:
      op = op.operation
      if op.name == "func.call":
        callee = ir.FlatSymbolRefAttr(op.attributes["callee"]).value
        if callee in funcs and callee not in stack:
          visit(funcs[callee].regions[0].blocks[0], callee, stack + (callee,))
      elif op.name in ("stablehlo.dot_general", "stablehlo.dot",
                       "stablehlo.convolution"):
        records.append(_mlir_record(op, func))
      for region in op.regions:
        for inner in region.blocks:
          visit(inner, func, stack)

  # JAX's entry is "main"; otherwise the first public function (MLIR's
  # default visibility).
  public = [n for n, f in funcs.items() if "sym_visibility" not in f.attributes
            or ir.StringAttr(f.attributes["sym_visibility"]).value == "public"]
  for name in (["main"] if "main" in funcs else public[:1]):
    visit(funcs[name].regions[0].blocks[0], name, (name,))
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
  return _dtype({"complex<f32>": "c64", "complex<f64>": "c128"}.get(
      name, name.lower()))


def _mlir_record(op, func: str) -> MatmulRecord:
  (lhs, lhs_dt), (rhs, rhs_dt) = (_mlir_array(v) for v in op.operands[:2])
  out, out_dt = _mlir_array(op.results[0])
  if op.name == "stablehlo.convolution":
    kind = "convolution"
    dn = stablehlo.ConvDimensionNumbers(op.attributes["dimension_numbers"])
    flops = _conv_flops(out, rhs, dn.kernel_output_feature_dimension)
  else:
    kind = "dot_general"
    if op.name == "stablehlo.dot":  # lhs contracts its last dim
      contracting = [len(lhs) - 1] if lhs else []
    else:
      dn = stablehlo.DotDimensionNumbers(op.attributes["dot_dimension_numbers"])
      contracting = list(dn.lhs_contracting_dimensions)
    flops = _dot_flops(lhs, out, contracting)
  name, frames = _mlir_location(op.location)
  return MatmulRecord(kind, lhs_dt, rhs_dt, out_dt, lhs, rhs, out, flops,
                      function=func, name=name, location=_pick_frame(frames))


if hasattr(ir, "NameLoc"):
  _LOCATION_KINDS = (("name", ir.NameLoc), ("callsite", ir.CallSiteLoc),
                     ("fused", ir.FusedLoc), ("file", ir.FileLineColLoc))

  def _location_kind(loc):
    for kind, cls in _LOCATION_KINDS:
      if loc.typeid == cls.static_typeid:
        return kind, cls(loc)
    return None, loc
else:  # MLIR bindings of jaxlib < 0.9: Location.is_a_*(), same accessors.

  def _location_kind(loc):
    for kind, test in (("name", loc.is_a_name), ("callsite", loc.is_a_callsite),
                       ("fused", loc.is_a_fused), ("file", loc.is_a_file)):
      if test():
        return kind, loc
    return None, loc


def _mlir_location(loc, depth: int = 0) -> tuple[Optional[str], list]:
  """(op name, [(file, line)] innermost first) of an MLIR location."""
  kind, loc = _location_kind(loc) if depth <= 100 else (None, loc)
  if kind == "name":
    return loc.name_str, _mlir_location(loc.child_loc, depth + 1)[1]
  if kind == "callsite":
    return None, (_mlir_location(loc.callee, depth + 1)[1] +
                  _mlir_location(loc.caller, depth + 1)[1])
  if kind == "fused":
    name, frames = None, []
    for part in loc.locations:
      n, f = _mlir_location(part, depth + 1)
      name, frames = name or n, frames + f
    return name, frames
  if kind == "file":
    return None, [(loc.filename, loc.start_line)]
  return None, []


# --------------------------------------------------------------------------
# Optimized HLO text.


def report_from_hlo(text: str) -> MatmulReport:
  """A report from optimized HLO text (``Compiled.as_text()``)."""
  if not text:
    raise ValueError("this backend's Compiled object has no HLO text to audit")
  module = hlo_text.HloModule(text)
  records = []
  for comp, instr in module.walk():
    rec = _hlo_record(module, comp, instr)
    if rec is not None:
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
  if kind is None or len(instr.operands) < 2:
    return None
  (lhs, lhs_dt), (rhs, rhs_dt) = (module.operand(comp, instr, i) for i in (0, 1))
  out, out_dt = hlo_text.array(instr.type)
  if lhs is None or rhs is None or out is None:
    return None
  if kind == "dot_general":
    dims = instr.attr("lhs_contracting_dims")
    if dims is not None:
      contracting = [int(d) for d in dims.strip("{}").split(",") if d]
    else:
      config = instr.backend_config().get("gemm_backend_config", {})
      contracting = config.get("dot_dimension_numbers", {}).get(
          "lhs_contracting_dimensions")
      contracting = None if contracting is None else [int(d) for d in contracting]
    flops = _dot_flops(lhs, out, contracting)
  else:
    labels = (instr.attr("dim_labels") or "").split("_")[-1].split("->")[0]
    # cuDNN backward convs name the forward conv's layouts: find its output
    # and kernel among our operands and result.
    fwd_out, kernel = out, rhs
    if target and "BackwardInput" in target:
      fwd_out = lhs
    elif target and "BackwardFilter" in target:
      fwd_out, kernel = rhs, out
    flops = _conv_flops(fwd_out, kernel,
                        labels.index("o") if "o" in labels else None)
  name, frames = module.location(instr)
  return MatmulRecord(kind, _dtype(lhs_dt), _dtype(rhs_dt), _dtype(out_dt),
                      lhs, rhs, out, flops, function=comp, name=name,
                      location=_pick_frame(frames), target=target)
