"""`jmp-amp bench --target h100`: the bench workloads as XLA compiles them for
an H100, on a machine without a GPU.

Each precision mode's train step is built as `jmp-amp bench` builds it, then
compiled for the target with `jmp_amp.gpu_report`; the table lists per
mode the GEMMs by dtype, the kernels, the GPU memory XLA assigns and an
estimate of the bytes the kernels move, with ratios to float32, and fits the
terminal like the timing table. Compiler figures, not timings: nothing runs.
`workload_reports` is the library entry for scripts
(benchmarks/h100_compiled.py).

Needs the ``gpu-audit`` extra (the CUDA plugin).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import traceback
from typing import Any, Callable, Optional, Sequence

import jax

from jmp_amp.tools import gpu_target
from jmp_amp.tools.bench import table as table_lib
from jmp_amp.tools.bench import timing
from jmp_amp.tools.bench import workloads

DEFAULT_MODES = ("float32", "mixed_bfloat16", "mixed_float16",
                 "autocast-mixed_bfloat16", "autocast-mixed_float16")


def use_compile_only_cpu() -> None:
  """Lets the CUDA plugin register its compile-only target without a GPU.

  Only when the user chose no platforms: JAX then runs on the CPU and the
  plugin skips looking for a GPU. Call it before JAX starts its backends.
  """
  if not os.environ.get("JAX_PLATFORMS"):
    jax.config.update("jax_platforms", "cpu")


nnx_step = workloads.nnx_step  # the bench's steps, with any optimizer


def row_from_report(name: str, report: gpu_target.GpuReport) -> dict[str, Any]:
  """A mode's JSON-friendly row: the report's summary and its GEMM shares."""
  summary = report.summary()
  flops = summary["gemm_flops_by_input_dtype"]
  total = sum(flops.values())
  half = sum(v for k, v in flops.items() if k in ("bf16", "f16"))
  # "float8_e4m3fn", or "float8_e5m2 x float8_e4m3fn" (backward GEMMs).
  fp8 = sum(v for k, v in flops.items()
            if all(part.startswith("float8") for part in k.split(" x ")))
  row = dict(mode=name, status="ok", half_gemm_flops=half / total if total
             else None, fp8_gemm_flops=fp8 / total if total else None,
             **summary)
  layers = report.fp8_layers()
  if layers:  # FP8 layers of a Flax model: did each compile to FP8 GEMMs?
    row.update(fp8_layers=len(layers), fp8_fallbacks=report.fp8_fallbacks())
  if name in workloads.FP8_MODES:
    row["fp8_problem"] = timing.fp8_check(name, report.matmuls,
                                          report.lowered)
  return row


def mode_report(name: str,
                build: Callable[[dict[str, Any]], tuple[Any, Any, Any]],
                target: str = "h100", gemm: str = "default") -> dict[str, Any]:
  """Compiles one mode's step for `target`; a JSON-friendly row.

  Args:
    name: a mode of `jmp_amp.tools.bench.workloads.JAX_MODES`.
    build: ``mode dict -> (jitted step, state, batch)``.
    target: the GPU target.
    gemm: the compiler options, see `jmp_amp.tools.gpu_target.GEMM_BACKENDS`.
  """
  try:
    with workloads.precision_context(name):
      step, state, batch = build(workloads.JAX_MODES[name])
      report = gpu_target.gpu_report(step, state, batch, target=target,
                                     gemm=gemm)
  except Exception as e:  # pylint: disable=broad-except
    # One failing mode must not lose the others.
    return dict(mode=name, status="failed", error=f"{type(e).__name__}: {e}",
                traceback=traceback.format_exc(limit=5))
  return row_from_report(name, report)


RATIO_KEYS = ("temp_bytes", "argument_bytes", "bytes_estimate", "kernels")


def add_ratios(rows: list[dict[str, Any]]) -> None:
  """``<key>_vs_float32`` for `RATIO_KEYS`, against the float32 row."""
  base = next((r for r in rows if r["mode"] == "float32"
               and r["status"] == "ok"), None)
  for r in rows:
    for key in RATIO_KEYS:
      ok = base and r["status"] == "ok" and base[key]
      r[f"{key}_vs_float32"] = r[key] / base[key] if ok else None


def workload_reports(model: str, cfg: workloads.Config,
                     modes: Sequence[str] = DEFAULT_MODES,
                     target: str = "h100",
                     progress: Callable[[str], None] = lambda text: None,
                     gemm: str = "default") -> list[dict[str, Any]]:
  """Rows of `mode_report` for one `jmp-amp bench` model, with ratios.

  `progress` is told when each mode starts and ends compiling.
  """
  cfg = dataclasses.replace(cfg, model=model, batches=1)

  def build(mode):
    work = workloads.BUILDERS[model](mode, cfg)
    return work.step, work.state, work.batches[0]

  rows = []
  for k, name in enumerate(modes, 1):
    progress(f"compiling {name} ({k}/{len(modes)}) for {target}")
    rows.append(mode_report(name, build, target, gemm))
    progress(f"{name}: " + ("compiled" if rows[-1]["status"] == "ok"
                            else "FAILED"))
  add_ratios(rows)
  return rows


def _mib(n: Optional[float]) -> str:
  return "-" if n is None else f"{n / 2**20:,.1f}"


def _ratio(x: Optional[float]) -> str:
  return "-" if x is None else f"{x:.2f}"


def _percent(x: Optional[float]) -> str:
  return "-" if x is None else f"{100 * x:.0f}%"


COLUMNS = ("mode", "GEMMs by dtype", "half FLOPs", "FP8 FLOPs", "kernels",
           "temp MiB", "temp ratio", "args MiB", "bytes est MiB",
           "bytes ratio")
# Lower stays longer at a narrow width; the GEMMs go under the table then.
_PRIORITIES = (0, 9, 3, 5, 4, 6, 1, 8, 7, 2)
_RIGHT = (False, False) + (True,) * (len(COLUMNS) - 2)
LEGEND = ("half, FP8 FLOPs: share of GEMM FLOPs on bf16/f16, FP8 operands; "
          "kernels: launches (a loop body once); temp, args: GPU memory; "
          "bytes est: what the kernels read and write; ratio: this row / "
          "float32's.")


def _gemms(r: dict[str, Any]) -> str:
  return ", ".join(f"{n} x {s}" for s, n in r["gemms_by_dtype"].items())


def table(rows: list[dict[str, Any]]) -> list[list[str]]:
  """Every column's cell (`COLUMNS`) for every row."""
  out = []
  for r in rows:
    if r["status"] != "ok":
      out.append([r["mode"], "FAILED"] + ["-"] * (len(COLUMNS) - 2))
      continue
    out.append([r["mode"], _gemms(r), _percent(r["half_gemm_flops"]),
                _percent(r.get("fp8_gemm_flops")),
                f"{r['kernels']}", _mib(r["temp_bytes"]),
                _ratio(r["temp_bytes_vs_float32"]), _mib(r["argument_bytes"]),
                _mib(r["bytes_estimate"]),
                _ratio(r["bytes_estimate_vs_float32"])])
  return out


def verdict(rows: list[dict[str, Any]]) -> str:
  """One line: which mode moves the fewest bytes, which GEMMs stay float32."""
  ok = [r for r in rows if r["status"] == "ok"]
  base = next((r for r in ok if r["mode"] == "float32"), None)
  others = [r for r in ok if r is not base]
  parts = []
  ranked = [r for r in others if r.get("bytes_estimate_vs_float32") is not None]
  if ranked:
    best = min(ranked, key=lambda r: r["bytes_estimate_vs_float32"])
    parts.append(f"{best['mode']} moves the fewest bytes, "
                 f"{best['bytes_estimate_vs_float32']:.2f}x float32's, with "
                 f"{_ratio(best['temp_bytes_vs_float32'])}x its temp memory")
  elif others:
    parts.append("no float32 row to compare with (add --policy float32)")
  low = lambda r: (r.get("half_gemm_flops") or 0) + (r.get("fp8_gemm_flops")
                                                     or 0)
  full = [r["mode"] for r in others if low(r) > 0.999]
  partly = [f"{r['mode']} ({_percent(low(r))} of GEMM FLOPs half or FP8)"
            for r in others if low(r) <= 0.999]
  if full:
    parts.append(f"every GEMM in half precision or FP8 in {', '.join(full)}")
  if partly:
    parts.append(f"float32 GEMMs left in {', '.join(partly)}")
  not_fp8 = [r["mode"] for r in others if r.get("fp8_problem")]
  if not_fp8:
    parts.append(f"FAILED: {', '.join(not_fp8)} compiled to GEMMs that are "
                 "not FP8 (" + "; ".join(
                     f"{r['mode']}: {r['fp8_problem']}" for r in others
                     if r.get("fp8_problem")) + ")")
  for r in others:
    if r.get("fp8_layers"):
      bad = r["fp8_fallbacks"]
      parts.append(
          f"{r['mode']}: {len(bad)} of {r['fp8_layers']} FP8 layers not all "
          f"in FP8 GEMMs ({', '.join(bad)})" if bad else
          f"{r['mode']}: every FP8 layer ({r['fp8_layers']}) runs FP8 GEMMs")
  failed = [r["mode"] for r in rows if r["status"] != "ok"]
  if failed:
    parts.append(f"{len(failed)} failed ({', '.join(failed)})")
  return "Verdict: " + "; ".join(parts or ["nothing compiled"]) + "."


def format_report(rows: list[dict[str, Any]], title: str,
                  width: Optional[int] = None) -> str:
  """The table within `width` columns, its legend, the verdict, errors."""
  width = width or table_lib.terminal_width()
  target = rows[0].get("target", "h100") if rows else "h100"
  gemm = rows[0].get("gemm", "default") if rows else "default"
  cells = table(rows)
  shown = table_lib.fit_columns(COLUMNS, cells, _PRIORITIES, width)
  for r, row in zip(rows, cells):
    if r["status"] != "ok":  # "FAILED" where it shows, the error below
      row[shown[1] if len(shown) > 1 else 0] = "FAILED"
  out = [table_lib.wrap(title, width),
         table_lib.wrap(f"({gpu_target.label(target, gemm)}; FP8 modes "
                        "with Triton GEMMs off, as make_train_step compiles "
                        f"them; jax {jax.__version__})", width)]
  out += table_lib.render(COLUMNS, cells, shown, _RIGHT)
  out.append("")
  out.append(table_lib.wrap(LEGEND, width, "  "))
  hidden = [COLUMNS[i] for i in range(len(COLUMNS))
            if i not in shown and COLUMNS[i] != "GEMMs by dtype"]
  if hidden:
    out.append(table_lib.wrap(
        f"Not shown at this width: {', '.join(hidden)} (widen the terminal, "
        "or see --json).", width, "  "))
  if COLUMNS.index("GEMMs by dtype") not in shown:
    out.append("GEMMs by dtype (count x operand dtypes -> result dtype):")
    out += [table_lib.wrap(f"  {r['mode']}: {_gemms(r)}", width, "    ")
            for r in rows if r["status"] == "ok"]
  out.append(table_lib.wrap(verdict(rows), width, "  "))
  out += [table_lib.wrap(f"FAILED {r['mode']}: {r['error']}", width, "  ")
          for r in rows if r["status"] != "ok"]
  return "\n".join(out)


def print_table(rows: list[dict[str, Any]], title: str, file=None,
                width: Optional[int] = None) -> None:
  print(format_report(rows, title, width), file=file or sys.stdout)


def run(args: argparse.Namespace, cfg: workloads.Config) -> int:
  """`jmp-amp bench --target ...`: compile each mode, print, write --json."""
  use_compile_only_cpu()
  try:
    gpu_target.target_device(args.target)
  except (ImportError, RuntimeError) as e:
    print(f"jmp-amp bench --target {args.target}: {e}", file=sys.stderr)
    return 2
  modes = list(dict.fromkeys(args.modes or DEFAULT_MODES))

  def progress(text):
    if not args.no_progress:
      print(f"jmp-amp bench: {text}", file=sys.stderr, flush=True)

  rows = workload_reports(cfg.model, cfg, modes, args.target, progress,
                          args.gemm)
  sizes = (f"width={cfg.width} layers={cfg.layers} " if cfg.model == "mlp"
           else "")
  print_table(rows, f"{cfg.model} {sizes}batch={cfg.batch_size}, train step "
              f"compiled for {args.target}")
  if args.json:
    with open(args.json, "w") as f:
      for r in rows:
        f.write(json.dumps(dict(r, config=dataclasses.asdict(cfg)),
                           sort_keys=True, default=str) + "\n")
  ok = all(r["status"] == "ok" and not r.get("fp8_problem") for r in rows)
  return 0 if ok else 1
