"""`jmp-amp bench --target h100`: the bench workloads as XLA compiles them for
an H100, on a machine without a GPU.

Each precision mode's train step is built as `jmp-amp bench` builds it, then
compiled for the target with `jmp_amp.tools.gpu_report`; the table lists per
mode the GEMMs by dtype, the kernels, the GPU memory XLA assigns and an
estimate of the bytes the kernels move, with ratios to float32. Compiler
figures, not timings: nothing runs. `workload_reports` is the library entry
for scripts (benchmarks/h100_compiled.py).

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
from jmp_amp.tools.bench import workloads

DEFAULT_MODES = ("float32", "bf16", "fp16", "autocast-bf16", "autocast-fp16")


def use_compile_only_cpu() -> None:
  """Lets the CUDA plugin register its compile-only target without a GPU.

  Only when the user chose no platforms: JAX then runs on the CPU and the
  plugin skips looking for a GPU. Call it before JAX starts its backends.
  """
  if not os.environ.get("JAX_PLATFORMS"):
    jax.config.update("jax_platforms", "cpu")


nnx_step = workloads.nnx_step  # the bench's steps, with any optimizer


def mode_report(name: str, build: Callable[[dict[str, Any]], tuple[Any, Any, Any]],
                target: str = "h100") -> dict[str, Any]:
  """Compiles one mode's step for `target`; a JSON-friendly row.

  Args:
    name: a mode of `jmp_amp.tools.bench.workloads.JAX_MODES`.
    build: ``mode dict -> (jitted step, state, batch)``.
    target: the GPU target.
  """
  try:
    with workloads.precision_context(name):
      step, state, batch = build(workloads.JAX_MODES[name])
      report = gpu_target.gpu_report(step, state, batch, target=target)
  except Exception as e:  # pylint: disable=broad-except
    # One failing mode must not lose the others.
    return dict(mode=name, status="failed", error=f"{type(e).__name__}: {e}",
                traceback=traceback.format_exc(limit=5))
  summary = report.summary()
  flops = summary["gemm_flops_by_input_dtype"]
  total = sum(flops.values())
  half = sum(v for k, v in flops.items() if k in ("bf16", "f16"))
  # "float8_e4m3fn", or "float8_e5m2 x float8_e4m3fn" (backward GEMMs).
  fp8 = sum(v for k, v in flops.items()
            if all(part.startswith("float8") for part in k.split(" x ")))
  return dict(mode=name, status="ok", half_gemm_flops=half / total if total
              else None, fp8_gemm_flops=fp8 / total if total else None,
              **summary)


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
                     target: str = "h100") -> list[dict[str, Any]]:
  """Rows of `mode_report` for one `jmp-amp bench` model, with ratios."""
  cfg = dataclasses.replace(cfg, model=model, batches=1)

  def build(mode):
    work = workloads.BUILDERS[model](mode, cfg)
    return work.step, work.state, work.batches[0]

  rows = [mode_report(name, build, target) for name in modes]
  add_ratios(rows)
  return rows


def _mib(n: Optional[float]) -> str:
  return "-" if n is None else f"{n / 2**20:,.1f}"


def _ratio(x: Optional[float]) -> str:
  return "-" if x is None else f"{x:.2f}"


COLUMNS = ("mode", "GEMMs by dtype", "half FLOPs", "FP8 FLOPs", "kernels",
           "temp MiB", "temp ratio", "args MiB", "bytes est MiB",
           "bytes ratio")


def _percent(x: Optional[float]) -> str:
  return "-" if x is None else f"{100 * x:.0f}%"


def table(rows: list[dict[str, Any]]) -> list[list[str]]:
  out = []
  for r in rows:
    if r["status"] != "ok":
      out.append([r["mode"], f"FAILED: {r['error'][:80]}"]
                 + [""] * (len(COLUMNS) - 2))
      continue
    gemms = ", ".join(f"{n} x {s}" for s, n in r["gemms_by_dtype"].items())
    out.append([r["mode"], gemms, _percent(r["half_gemm_flops"]),
                _percent(r.get("fp8_gemm_flops")),
                f"{r['kernels']}", _mib(r["temp_bytes"]),
                _ratio(r["temp_bytes_vs_float32"]), _mib(r["argument_bytes"]),
                _mib(r["bytes_estimate"]), _ratio(r["bytes_estimate_vs_float32"])])
  return out


def print_table(rows: list[dict[str, Any]], title: str, file=None) -> None:
  file = file or sys.stdout
  cells = [list(COLUMNS)] + table(rows)
  widths = [max(len(row[c]) for row in cells) for c in range(len(COLUMNS))]
  print(title, file=file)
  print(f"({gpu_target.label(rows[0].get('target', 'h100') if rows else 'h100')}"
        f"; jax {jax.__version__})", file=file)
  for row in cells:
    print("  ".join(c.ljust(w) if i < 2 else c.rjust(w)
                    for i, (c, w) in enumerate(zip(row, widths))), file=file)


def run(args: argparse.Namespace, cfg: workloads.Config) -> int:
  """`jmp-amp bench --target ...`: compile each mode, print, write --json."""
  use_compile_only_cpu()
  try:
    gpu_target.target_device(args.target)
  except (ImportError, RuntimeError) as e:
    print(f"jmp-amp bench --target {args.target}: {e}", file=sys.stderr)
    return 2
  modes = list(dict.fromkeys(args.modes or DEFAULT_MODES))
  rows = workload_reports(cfg.model, cfg, modes, args.target)
  sizes = (f"width={cfg.width} layers={cfg.layers} " if cfg.model == "mlp"
           else "")
  print_table(rows, f"{cfg.model} {sizes}batch={cfg.batch_size}, train step "
              f"compiled for {args.target}")
  if args.json:
    with open(args.json, "w") as f:
      for r in rows:
        f.write(json.dumps(dict(r, config=dataclasses.asdict(cfg)),
                           sort_keys=True, default=str) + "\n")
  return 0 if all(r["status"] == "ok" for r in rows) else 1
