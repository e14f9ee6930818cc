"""The bench's report: ratios, the table, its legend and the verdict.

`add_ratios` sets each run's ratios against its framework's float32 row;
`format_report` lays the runs out as a table that fits the terminal (the
columns that do not fit are named under it), with a legend saying what each
ratio is relative to, a one-line verdict and notes. `fit_columns` and
`render` are the layout, shared with the ``--target`` table (`gpu`).
"""

from __future__ import annotations

import math
import shutil
import sys
import textwrap
from typing import Any, Callable, Optional, Sequence

from jmp_amp.tools.bench import workloads


def _baseline_name(framework: Optional[str]) -> str:
  return "torch-float32" if framework == "torch" else "float32"


def add_ratios(runs: list[dict[str, Any]]) -> None:
  """Speed-up and memory ratios of each run against its framework's float32.

  JAX rows are relative to the JAX ``float32`` row, torch rows to the
  ``torch-float32`` row; a ratio is None where that baseline did not run.
  """
  base = {r["framework"]: r for r in runs
          if r.get("status") == "ok"
          and r["mode"] in ("float32", "torch-float32")}
  for r in runs:
    b = base.get(r.get("framework"))
    ok = r.get("status") == "ok" and b is not None
    r["baseline"] = _baseline_name(r.get("framework"))
    r["speedup_vs_float32"] = (b["median_step_s"] / r["median_step_s"]
                               if ok else None)
    mem, bmem = r.get("peak_memory_bytes"), b and b.get("peak_memory_bytes")
    r["memory_ratio_vs_float32"] = (mem / bmem if ok and mem and bmem
                                    else None)
    tb = b and (b.get("compiled_memory") or {}).get("temp_bytes")
    t = (r.get("compiled_memory") or {}).get("temp_bytes")
    r["compiled_temp_ratio_vs_float32"] = t / tb if ok and t and tb else None


def _fmt(value, spec, suffix=""):
  return "-" if value is None else format(value, spec) + suffix


def _matmul_cell(matmuls: Any) -> str:
  if not isinstance(matmuls, dict):
    return "-"
  if "autocast_dtype" in matmuls:
    used = matmuls["autocast_dtype"]
    return ("torch float32, no autocast" if used == "float32"
            else f"torch autocast, really ran {used}")
  cell = ", ".join(f"{v} x {k}"
                   for k, v in matmuls.get("by_signature", {}).items())
  if matmuls.get("fp8") == "emulated":
    return f"FP8 emulated (E4M3/E5M2-rounded operands): {cell}"
  if matmuls.get("fp8") == "fallback":
    return f"NOT FP8 on this device ({matmuls.get('fp8_problem')}): {cell}"
  if matmuls.get("fp8"):
    return f"FP8 GEMMs as compiled: {cell}"
  return cell


def fp8_failures(runs: list[dict[str, Any]]) -> list[str]:
  """The FP8 modes whose compiled GEMMs were not FP8."""
  return [r["mode"] for r in runs if r.get("status") == "ok"
          and isinstance(r.get("matmuls"), dict)
          and r["matmuls"].get("fp8") == "fallback"]


def _memory_cell(r: dict[str, Any], value: Optional[float], spec: str) -> str:
  star = "*" if r.get("memory_source") == "compiled" else ""
  return _fmt(value, spec, star)


# (header, cell of an ok run, right-aligned, priority: lower stays longer)
_COLUMN_SPECS: tuple[tuple[str, Callable[[dict[str, Any]], str], bool, int],
                     ...] = (
    ("mode", lambda r: r["mode"], False, 0),
    ("step ms", lambda r: _fmt(r["median_step_s"] * 1e3, ".2f"), True, 1),
    ("spread", lambda r: _fmt(None if r.get("step_spread") is None
                              else r["step_spread"] * 100, ".0f", "%"),
     True, 8),
    ("speed-up", lambda r: _fmt(r.get("speedup_vs_float32"), ".2f", "x"),
     True, 2),
    ("memory", lambda r: _memory_cell(r, r.get("memory_ratio_vs_float32"),
                                      ".2f"), True, 4),
    ("peak MiB", lambda r: _memory_cell(
        r, r["peak_memory_bytes"] / 2**20 if r.get("peak_memory_bytes")
        else None, ",.1f"), True, 9),
    ("loss", lambda r: _fmt(r["final_loss"], ".4g"), True, 3),
    ("skipped", lambda r: str(r["skipped_steps"]), True, 5),
    ("scale", lambda r: _fmt(r.get("loss_scale"),
                             ".0f" if (r.get("loss_scale") or 0) < 1e9
                             else ".3g"), True, 6),
    ("compile s", lambda r: _fmt(r.get("compile_s"), ".2f"), True, 7),
    ("samples/s", lambda r: _fmt(r.get("samples_per_s"), ",.0f"), True, 10),
    ("TFLOP/s", lambda r: _fmt(r.get("tflops"), ".2f"), True, 11),
    ("matmuls", lambda r: _matmul_cell(r.get("matmuls")), False, 12),
)
COLUMNS = tuple(spec[0] for spec in _COLUMN_SPECS)


def table_rows(runs: list[dict[str, Any]]) -> list[list[str]]:
  """Every column's cell for every run (failed runs: "FAILED", then "-")."""
  rows = []
  for r in runs:
    if r.get("status") != "ok":
      rows.append([r["mode"], "FAILED"] + ["-"] * (len(COLUMNS) - 2))
    else:
      rows.append([cell(r) for _, cell, _, _ in _COLUMN_SPECS])
  return rows


def terminal_width() -> int:
  """The terminal's width (``COLUMNS`` wins; 100 when not a terminal)."""
  return shutil.get_terminal_size((100, 24)).columns


def fit_columns(header: Sequence[str], rows: Sequence[Sequence[str]],
                priorities: Sequence[int], width: int) -> list[int]:
  """Indices of the columns to show within `width`, in table order.

  Columns are taken by priority (lower first) while they fit, two spaces
  apart; the most important one always shows.
  """
  widths = [max([len(header[i])] + [len(row[i]) for row in rows])
            for i in range(len(header))]
  shown, used = [], -2
  for i in sorted(range(len(header)), key=lambda i: priorities[i]):
    if used + 2 + widths[i] <= width or not shown:
      shown.append(i)
      used += 2 + widths[i]
  return sorted(shown)


def render(header: Sequence[str], rows: Sequence[Sequence[str]],
           shown: Sequence[int], right: Sequence[bool]) -> list[str]:
  """The header, a rule under it and the rows, in the `shown` columns."""
  widths = {i: max([len(header[i])] + [len(row[i]) for row in rows])
            for i in shown}

  def line(cells: Sequence[str]) -> str:
    return "  ".join(cells[i].rjust(widths[i]) if right[i]
                     else cells[i].ljust(widths[i]) for i in shown).rstrip()

  return ([line(header), line(["-" * len(c) for c in header])]
          + [line(row) for row in rows])


def wrap(text: str, width: int, indent: str = "") -> str:
  """`text` wrapped to `width`; long words (paths, dtype signatures) are
  never cut, so no text is lost."""
  return textwrap.fill(text, width=max(width, 20), subsequent_indent=indent,
                       break_long_words=False, break_on_hyphens=False)


def legend(runs: list[dict[str, Any]], cfg: workloads.Config,
           shown: Sequence[str]) -> list[str]:
  """What each column is, and what each ratio is relative to."""
  torch_rows = any(r.get("framework") == "torch" for r in runs)
  vs_torch = " (torch rows: torch-float32's)" if torch_rows else ""
  lines = [
      f"step ms: median step time after {cfg.warmup} warm-up steps, the "
      f"median over {cfg.repeats} repeat(s); spread: +/- half the range of "
      "the repeats' medians, in % of the median.",
      f"speed-up: the float32 row's step time / this row's{vs_torch}; above "
      "1x is faster than float32.",
      f"memory: this row's peak memory / the float32 row's{vs_torch}; * = "
      "from the compiled program's memory analysis (arguments, outputs and "
      "temporaries), used where the device reports no peak of its own.",
      "loss: the last step's loss; skipped: steps skipped for inf/NaN "
      "gradients; scale: the final dynamic loss scale (- = no loss scaling); "
      "compile s: seconds to trace, lower and compile the step.",
  ]
  hidden = [c for c in COLUMNS if c not in shown and c != "matmuls"]
  if hidden:
    lines.append(f"Not shown at this width: {', '.join(hidden)} (widen the "
                 "terminal, or see --json).")
  return lines


def _steps(r: dict[str, Any]) -> Optional[int]:
  return (r.get("config") or {}).get("steps")


def _noise(r: dict[str, Any]) -> float:
  return r.get("step_spread") or 0.0


def _beyond(fast: dict[str, Any], slow: dict[str, Any]) -> bool:
  """Whether `fast` beats `slow` by more than their spreads together."""
  ratio = fast["speedup_vs_float32"] / slow["speedup_vs_float32"]
  return ratio - 1.0 > _noise(fast) + _noise(slow)


def _fastest(rows: list[dict[str, Any]]) -> str:
  """The fastest JAX mode, named only if it is faster beyond the spread."""
  best = max(rows, key=lambda r: r["speedup_vs_float32"])
  base = next((r for r in rows if r["mode"] == "float32"), None)
  spread = f"spread ±{_noise(best):.0%}"
  if base is not None and base is not best and not _beyond(best, base):
    return (f"no JAX mode is faster than float32 beyond the timing spread "
            f"(the best, {best['mode']}, at {best['speedup_vs_float32']:.2f}x"
            f" with {spread}, float32's ±{_noise(base):.0%})")
  if base is best:
    return "no JAX mode is faster than float32"
  close = [r["mode"] for r in rows
           if r is not best and r is not base and not _beyond(best, r)]
  return (f"fastest JAX mode {best['mode']} at "
          f"{best['speedup_vs_float32']:.2f}x float32's speed ({spread}"
          + (f"; {', '.join(close)} within the spread" if close else "")
          + ")")


def verdict(runs: list[dict[str, Any]]) -> str:
  """One line: the fastest mode, and whether every mode trained."""
  ok = [r for r in runs if r.get("status") == "ok"]
  # A mode that skipped every step never updated its weights: its loss is
  # the initial one and its speed is that of skipping, not of training.
  frozen = [r for r in ok if _steps(r) and r["skipped_steps"] >= _steps(r)]
  trained = [r for r in ok if r not in frozen]
  parts = []
  jax_rows = [r for r in trained if r["framework"] == "jax"
              and r.get("speedup_vs_float32") is not None]
  if jax_rows:
    parts.append(_fastest(jax_rows))
  bad = [r["mode"] for r in ok if not math.isfinite(r["final_loss"])]
  if bad:
    parts.append(f"non-finite final loss in {', '.join(bad)}")
  if frozen:
    names = ", ".join(r["mode"] for r in frozen)
    its = "their" if len(frozen) > 1 else "its"
    parts.append(f"{names} skipped every step (non-finite gradients), so "
                 f"{its} weights never changed and {its} final loss is that "
                 "of the initial weights")
  partly = [f"{r['mode']} skipped {r['skipped_steps']} of {_steps(r)} steps"
            for r in trained if r["skipped_steps"] and _steps(r)]
  parts += partly
  if trained and not bad and not frozen:
    parts.append("every mode ended with a finite loss")
  base = next((r for r in trained if r["mode"] == "float32"), None)
  compared = [r for r in trained if r["framework"] == "jax" and r is not base]
  if base and compared and not bad and math.isfinite(base["final_loss"]):
    dev = max(abs(r["final_loss"] - base["final_loss"])
              / max(abs(base["final_loss"]), 1e-12) for r in compared)
    parts.append(f"final losses within {dev:.2%} of float32's"
                 + (" (of the modes that trained)" if frozen else ""))
  spreads = [r["step_spread"] for r in ok if r.get("step_spread") is not None]
  if spreads and max(spreads) > 0.2:
    parts.append(f"timings are noisy (spread up to {max(spreads):.0%}): "
                 "use more --repeats or an idle machine")
  not_fp8 = fp8_failures(runs)
  if not_fp8:
    parts.append(f"FAILED: {', '.join(not_fp8)} did not run FP8 GEMMs on "
                 "this device (see the matmuls lines)")
  failed = [r["mode"] for r in runs if r.get("status") != "ok"]
  if failed:
    parts.append(f"{len(failed)} failed ({', '.join(failed)})")
  return "Verdict: " + "; ".join(parts) + "."


CPU_NOTE = ("Note: this ran on a CPU, where XLA has no fast half-precision "
            "matmul, so half precision is not expected to be faster here; "
            "the speed-ups are for GPUs. The matmul dtypes and the memory "
            "column still show what each mode compiles to.")
FP8_NOTE = ("FP8 modes ({modes}) are emulated here: the GEMMs take FP8 "
            "operands (E4M3 forward, E5M2 gradients), which the CPU multiplies "
            "in wider types, so the numerics are FP8's but the speed is not; "
            "`--target h100` shows the FP8 GEMMs XLA emits for a Hopper GPU.")


def format_report(runs: list[dict[str, Any]], env: dict[str, Any],
                  cfg: workloads.Config, width: Optional[int] = None) -> str:
  """The table, its legend, the verdict, notes and full errors as text."""
  width = width or terminal_width()
  sizes = (f"width={cfg.width} layers={cfg.layers} " if cfg.model == "mlp"
           else "")
  title = (f"{cfg.model} {sizes}batch={cfg.batch_size} steps={cfg.steps} "
           f"repeats={cfg.repeats} on {env['device']}")
  rows = table_rows(runs)
  shown = fit_columns(COLUMNS, rows, [s[3] for s in _COLUMN_SPECS], width)
  out = [wrap(title, width)]
  out += render(COLUMNS, rows, shown, [s[2] for s in _COLUMN_SPECS])
  out.append("")
  out += [wrap(text, width, "  ")
          for text in legend(runs, cfg, [COLUMNS[i] for i in shown])]
  if COLUMNS.index("matmuls") not in shown:
    out.append("matmuls (count x operand dtypes -> result dtype):")
    out += [wrap(f"  {r['mode']}: {_matmul_cell(r.get('matmuls'))}", width,
                 "    ") for r in runs if r.get("status") == "ok"]
  out.append(wrap(verdict(runs), width, "  "))
  if env.get("platform") == "cpu":
    out.append(wrap(CPU_NOTE, width, "  "))
    fp8_rows = [r["mode"] for r in runs if r.get("status") == "ok"
                and isinstance(r.get("matmuls"), dict)
                and r["matmuls"].get("fp8")]
    if fp8_rows:
      out.append(wrap(FP8_NOTE.format(modes=", ".join(fp8_rows)), width,
                      "  "))
  for r in runs:
    if r.get("status") != "ok":
      out.append(wrap(f"FAILED {r['mode']}: {r.get('error', '')}", width,
                      "  "))
  return "\n".join(out)


def print_table(runs: list[dict[str, Any]], env: dict[str, Any],
                cfg: workloads.Config, file=None,
                width: Optional[int] = None) -> None:
  print(format_report(runs, env, cfg, width), file=file or sys.stdout)
