"""Timing the bench's JAX modes, and the facts every run record carries.

A mode is built and compiled once (`prepare_jax_mode`), then timed in repeats
(`time_repeat`): each repeat trains ``cfg.steps`` steps from a copy of the
initial state, every step synchronised with `block_until_ready`, and keeps
the median step time after ``cfg.warmup`` warm-up steps. `finish_jax_mode`
turns a timed mode into its JSON record (times, memory, final loss, skipped
steps, loss scale, matmul dtypes, TFLOP/s).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import platform
import statistics
import time
from typing import Any, Callable, Optional, Sequence

import jax
from jax.experimental.compilation_cache import compilation_cache
import jax.numpy as jnp
import optax

import jmp_amp
from jmp_amp.tools import audit
from jmp_amp.tools import fp8_layers
from jmp_amp.tools.bench import workloads


def device_peak_bytes() -> Optional[int]:
  """The device's peak memory counter, or None where it keeps none (CPU)."""
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get("peak_bytes_in_use")


def _compiled_memory(compiled) -> dict[str, Optional[int]]:
  try:
    analysis = compiled.memory_analysis()
  except Exception:  # pylint: disable=broad-except
    analysis = None
  if analysis is None:
    return {"temp_bytes": None, "argument_bytes": None, "output_bytes": None}
  return {"temp_bytes": int(analysis.temp_size_in_bytes),
          "argument_bytes": int(analysis.argument_size_in_bytes),
          "output_bytes": int(analysis.output_size_in_bytes)}


def fp8_check(name: str, compiled_report, asked_report) -> Optional[str]:
  """Why FP8 mode `name` did not run FP8 GEMMs in the compiled program, or
  None when it did (or `name` is not an FP8 mode).

  A mode with FP8 layers (Flax rules) must have each layer's GEMMs FP8 and
  none merged away (`MatmulReport.fp8_fallbacks` against the lowered
  program); an autocast FP8 mode, whose every matmul is FP8, must compile
  to FP8 GEMMs only.
  """
  if name not in workloads.FP8_MODES:
    return None
  if workloads.JAX_MODES[name].get("autocast"):
    # Fused attention calls are no GEMMs: autocast keeps attention half.
    bad = {s: n for s, n in compiled_report.counts_by_signature().items()
           if not s.startswith("attention ")
           and not fp8_layers.is_fp8_signature(s)}
    if bad or not len(compiled_report):
      return ("not every GEMM is FP8: " + (", ".join(
          f"{n} x {s}" for s, n in bad.items()) or "no GEMM"))
    return None
  if not compiled_report.fp8_layers():
    return "no FP8 layer in the compiled program"
  fallbacks = compiled_report.fp8_fallbacks(expected=asked_report)
  if fallbacks:
    return "; ".join(f"{layer}: {why}" for layer, why in fallbacks.items())
  return None


@contextlib.contextmanager
def cold_compiles():
  """Every compile inside is cold, and the timings say what a compile costs.

  With JAX's persistent compilation cache on (``JAX_COMPILATION_CACHE_DIR``,
  a cluster's default, a test run's), a program compiled before would be
  read from disk and timed as "compile s". JAX decides whether to use the
  cache once per process, at its first compile, so turning the option off
  takes a reset too; both are undone on exit.
  """
  was = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  compilation_cache.reset_cache()
  try:
    yield
  finally:
    jax.config.update("jax_enable_compilation_cache", was)
    compilation_cache.reset_cache()


@dataclasses.dataclass
class PreparedMode:
  """One JAX mode, compiled, with its initial state kept for every repeat."""
  name: str
  work: workloads.Workload
  compiled: Any
  compile_s: float
  report: Any
  memory: dict[str, Optional[int]]
  fp8_problem: Optional[str] = None
  repeat_medians: list[float] = dataclasses.field(default_factory=list)
  total_s: float = 0.0
  metrics: Any = None


def prepare_jax_mode(name: str, cfg: workloads.Config,
                     hlo_dir: Optional[str]) -> PreparedMode:
  """Builds and compiles one jmp_amp mode (and dumps its StableHLO)."""
  with workloads.precision_context(name):
    work = workloads.BUILDERS[cfg.model](workloads.JAX_MODES[name], cfg)
    t0 = time.perf_counter()
    lowered = work.step.lower(work.state, work.batches[0])
    compiled = lowered.compile()
    compile_s = time.perf_counter() - t0
    asked = audit.matmul_report(lowered)
    # On a GPU the table lists the GEMMs the device compiled; on a CPU,
    # whose compiled program upcasts half matmuls, those the step asks for.
    report = (asked if jax.default_backend() == "cpu"
              else audit.matmul_report(compiled))
    problem = (None if jax.default_backend() == "cpu"
               else fp8_check(name, report, asked))
  if hlo_dir:
    with open(os.path.join(hlo_dir, f"{cfg.model}-{name}.stablehlo.mlir"),
              "w") as f:
      f.write(lowered.as_text())
  return PreparedMode(name, work, compiled, compile_s, report,
                      _compiled_memory(compiled), problem)


def time_repeat(prep: PreparedMode, cfg: workloads.Config,
                progress: Callable[[], None]) -> None:
  """One repeat: ``cfg.steps`` steps from the initial state (a fresh copy)."""
  with workloads.precision_context(prep.name):
    # The step donates its state: each repeat trains a copy of the initial
    # state, so every repeat does the same work and ends with the same loss.
    state = jax.tree.map(jnp.copy, prep.work.state)
    times = []
    start = time.perf_counter()
    for i in range(cfg.steps):
      batch = prep.work.batches[i % len(prep.work.batches)]
      t = time.perf_counter()
      state, metrics = prep.compiled(state, batch)
      jax.block_until_ready(metrics)
      if i >= cfg.warmup:
        times.append(time.perf_counter() - t)
      progress()
    prep.total_s += time.perf_counter() - start
  prep.repeat_medians.append(statistics.median(times))
  prep.metrics = jax.device_get(metrics)
  del state


def timing_fields(repeat_medians: Sequence[float],
                  batch_size: int) -> dict[str, Any]:
  """The timing figures of a record, from each repeat's median step time."""
  median = statistics.median(repeat_medians)
  spread = ((max(repeat_medians) - min(repeat_medians)) / 2 / median
            if len(repeat_medians) > 1 else None)
  return dict(median_step_s=median, repeat_median_step_s=list(repeat_medians),
              step_spread=spread, steps_per_s=1.0 / median,
              samples_per_s=batch_size / median)


def finish_jax_mode(prep: PreparedMode, isolated: bool) -> dict[str, Any]:
  """The result record of a prepared and timed JAX mode."""
  memory, metrics = prep.memory, prep.metrics
  # A device's peak counter only grows: it belongs to one mode only when that
  # mode ran in a fresh process. Otherwise the compiled program's own memory
  # analysis is the per-mode figure.
  peak = device_peak_bytes() if isolated else None
  median = statistics.median(prep.repeat_medians)
  summary = dict(prep.report.summary(), stage=prep.report.stage,
                 input_dtypes=sorted(prep.report.input_dtypes()))
  if prep.name in workloads.FP8_MODES:
    # On a CPU the FP8-rounded operands are multiplied as XLA:CPU can; on a
    # GPU the compiled program says whether its GEMMs are FP8.
    if jax.default_backend() == "cpu":
      summary["fp8"] = "emulated"
    else:
      summary["fp8"] = "fp8 gemms" if prep.fp8_problem is None else "fallback"
      summary["fp8_problem"] = prep.fp8_problem
  return dict(
      status="ok", framework="jax", compile_s=prep.compile_s,
      total_s=prep.total_s,
      **timing_fields(prep.repeat_medians, prep.work.batch_size),
      peak_memory_bytes=peak if peak is not None else (
          (memory["temp_bytes"] or 0) + (memory["argument_bytes"] or 0)
          + (memory["output_bytes"] or 0)),
      memory_source="device" if peak is not None else "compiled",
      compiled_memory=memory, final_loss=float(metrics["loss"]),
      skipped_steps=int(metrics["skipped_steps"]),
      loss_scale=(float(metrics["loss_scale"])
                  if workloads.JAX_MODES[prep.name].get("scale") else None),
      matmuls=summary,
      tflops=(prep.work.flops_per_step / median / 1e12
              if prep.work.flops_per_step else None),
  )


def run_jax_mode(name: str, cfg: workloads.Config,
                 hlo_dir: Optional[str] = None,
                 progress: Callable[[], None] = lambda: None,
                 isolated: bool = False) -> dict[str, Any]:
  """Builds, compiles and times one jmp_amp mode, all repeats in a row."""
  prep = prepare_jax_mode(name, cfg, hlo_dir)
  for _ in range(cfg.repeats):
    time_repeat(prep, cfg, progress)
  return finish_jax_mode(prep, isolated)


def _version(dist: str) -> Optional[str]:
  from importlib import metadata  # pylint: disable=g-import-not-at-top
  try:
    return metadata.version(dist)
  except metadata.PackageNotFoundError:
    return None


def environment() -> dict[str, Any]:
  """The device and the library versions, as every run record holds them."""
  import flax  # pylint: disable=g-import-not-at-top
  dev = jax.devices()[0]
  versions = {"python": platform.python_version(), "jax": jax.__version__,
              "jaxlib": _version("jaxlib"),
              "flax": flax.__version__, "optax": optax.__version__,
              "jmp_amp": jmp_amp.__version__}
  versions["torch"] = _version("torch")
  return {"device": getattr(dev, "device_kind", str(dev)),
          "platform": dev.platform, "device_count": jax.device_count(),
          "versions": versions}
