"""`jmp-amp bench`: the PyTorch AMP recipe's benchmark, for jmp_amp.

The seeds' recipe trains an MLP (width 4096, 3 linear layers, batch 512, 50
batches x 3 epochs, SGD, MSE loss) in float32, with autocast, and with autocast
+ GradScaler. This command runs the same comparison for jmp_amp's precision
modes in one process, and optionally the PyTorch modes on the same device:

    jmp-amp bench                              # small CPU-sized default
    jmp-amp bench --recipe seed --compare-torch --json out.jsonl --plot out.png
    python -m jmp_amp.tools.bench --model resnet --policy bf16 --policy fp16

For every mode it reports the median step time after warm-up (each step
synchronised with `block_until_ready`; compile time separately) over
``--repeats`` interleaved repeats with their spread, samples/s, peak memory,
final loss, skipped steps, final loss scale, the matmul-dtype summary,
achieved TFLOP/s (MLP) and ratios against float32. The table fits the
terminal; a legend under it says what each ratio is relative to.

This module imports Flax and the reference models (`jmp_amp.models`, the
repository's models/ folder); `import jmp_amp` does not import it.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import importlib.util
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import textwrap
import time
import traceback
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_amp

SCHEMA = "jmp_amp.bench/1"

# name -> (policy string or None, loss scale maker or None, matmul precision,
#          autocast policy or None; "float8" = FP8 matmuls: the policy through
#          `jmp_amp.flax.fp8_rules`, autocast through `jmp_amp.autocast`)
JAX_MODES: dict[str, dict[str, Any]] = {
    "float32": dict(policy="float32", scale=None),
    "float32-highest": dict(policy="float32", scale=None, precision="highest"),
    "bf16": dict(policy="mixed_bfloat16", scale=None),
    "fp16": dict(policy="mixed_float16", scale="dynamic"),
    "fp16-noscale": dict(policy="mixed_float16", scale=None),
    "autocast-bf16": dict(autocast="p=f32,c=bf16,o=f32", scale=None),
    "autocast-fp16": dict(autocast="p=f32,c=f16,o=f32", scale="dynamic"),
    "fp8": dict(policy="float8", scale=None),
    "autocast-fp8": dict(autocast="float8", scale=None),
}
FP8_MODES = tuple(name for name, mode in JAX_MODES.items()
                  if "float8" in (mode.get("policy"), mode.get("autocast")))
DEFAULT_MODES = ("float32", "float32-highest", "bf16", "fp16", "fp16-noscale")
# The recipe's three PyTorch modes; both AMP rows autocast to float16, as the
# recipe does (the row's matmuls cell says the dtype autocast really used).
TORCH_MODES = ("torch-float32", "torch-autocast", "torch-autocast+scaler")

RECIPES: dict[str, dict[str, Any]] = {
    # Small enough for about a minute on a 2-core CPU, all modes included.
    "small": dict(width=512, layers=3, batch_size=128, batches=10, epochs=2),
    # The PyTorch AMP recipe exactly.
    "seed": dict(width=4096, layers=3, batch_size=512, batches=50, epochs=3),
    # Large matmuls: measures achieved TFLOP/s against the matmul peak.
    "compute-bound": dict(width=8192, layers=3, batch_size=4096, batches=10,
                          epochs=2),
}


@dataclasses.dataclass
class Config:
  model: str
  width: int
  layers: int
  batch_size: int
  batches: int
  epochs: int
  steps: int
  warmup: int
  lr: float
  seed: int
  init_scale: float
  repeats: int = 1


# --------------------------------------------------------------------------
# Workloads: build a jitted train step for one mode.


@dataclasses.dataclass
class Workload:
  """A jitted train step with its initial state and data."""
  step: Callable[..., Any]     # (state, batch) -> (state, metrics), jitted
  state: Any
  batches: list[Any]
  batch_size: int
  flops_per_step: Optional[float]  # model FLOPs (matmuls), None if unknown


def _loss_scale_for(mode: dict[str, Any], init_scale: float):
  if mode.get("scale") == "dynamic":
    return jmp_amp.DynamicLossScale(init_scale)
  return jmp_amp.NoOpLossScale()


def nnx_step(model, loss_of_output: Callable[..., Any], mode: dict[str, Any],
             tx: optax.GradientTransformation, init_scale: float = 2.0**15):
  """(jitted step, state): ``step(state, batch) -> (state, metrics)``.

  Policies come from `jmp_amp.flax.set_policies` (or op-level autocast), loss
  scaling wraps `tx`. The model and optimizer are split once into a graphdef
  and a state pytree, so each step is a plain `jax.jit` call with the state
  donated: no per-step Python graph traversal, which would dominate
  sub-millisecond GPU steps. `jmp_amp.tools.bench.gpu` compiles the same
  steps.
  """
  from flax import nnx  # pylint: disable=g-import-not-at-top
  import jmp_amp.flax as jflax  # pylint: disable=g-import-not-at-top

  if mode.get("policy") == "float8":
    # FP8 matmuls but the first and last, norms float32, the rest bf16.
    jflax.set_policies(model, jflax.fp8_rules())
  elif mode.get("policy") not in (None, "float32"):
    half = jmp_amp.get_policy(mode["policy"]).compute_dtype
    jflax.set_policies(model, jflax.mixed_rules(half))
  tx = jmp_amp.loss_scaling(tx, _loss_scale_for(mode, init_scale))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  inner = jflax.make_train_step(
      lambda m, batch: loss_of_output(m(batch[0]), batch[1]),
      autocast=mode.get("autocast"), jit=False)
  graphdef, state = nnx.split((model, optimizer))

  def step(state, batch):
    model, optimizer = nnx.merge(graphdef, state)
    metrics = inner(model, optimizer, batch)
    return nnx.state((model, optimizer)), metrics

  return jax.jit(step, donate_argnums=0), state


def _nnx_workload(model, loss_of_output, mode, cfg, batches, flops,
                  batch_size) -> Workload:
  """The bench's SGD step (`nnx_step`) for `model`, with its batches."""
  step, state = nnx_step(model, loss_of_output, mode, optax.sgd(cfg.lr),
                         cfg.init_scale)
  return Workload(step, state, batches, batch_size, flops)


def mlp_data(cfg: Config) -> tuple[np.ndarray, np.ndarray]:
  """The MLP's batches (numpy): the same for the JAX and the torch rows."""
  from jmp_amp.models import data as data_lib  # pylint: disable=g-import-not-at-top
  return data_lib.regression_batches(cfg.batches, cfg.batch_size, cfg.width,
                                     cfg.width, seed=cfg.seed)


def mlp_initial_weights(cfg: Config) -> list[tuple[np.ndarray, np.ndarray]]:
  """The MLP's initial ``(kernel [in, out], bias)`` per layer, as numpy.

  The torch rows start from these, so both frameworks train the same weights.
  """
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from jmp_amp.models import mlp as mlp_lib  # pylint: disable=g-import-not-at-top
  model = mlp_lib.MLP(cfg.width, cfg.width, num_layers=cfg.layers,
                      rngs=nnx.Rngs(cfg.seed))
  return [(np.asarray(layer.kernel[...]), np.asarray(layer.bias[...]))
          for layer in model.layers]


def build_mlp(mode: dict[str, Any], cfg: Config) -> Workload:
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from jmp_amp.models import mlp as mlp_lib  # pylint: disable=g-import-not-at-top

  model = mlp_lib.MLP(cfg.width, cfg.width, num_layers=cfg.layers,
                      rngs=nnx.Rngs(cfg.seed))
  xs, ys = mlp_data(cfg)
  batches = [(jnp.asarray(x), jnp.asarray(y)) for x, y in zip(xs, ys)]
  flops = 6.0 * cfg.batch_size * cfg.width * cfg.width * cfg.layers
  return _nnx_workload(model, mlp_lib.mse_loss, mode, cfg, batches, flops,
                       cfg.batch_size)


def build_resnet(mode: dict[str, Any], cfg: Config) -> Workload:
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from jmp_amp.models import data as data_lib  # pylint: disable=g-import-not-at-top
  from jmp_amp.models import resnet as resnet_lib  # pylint: disable=g-import-not-at-top

  model = resnet_lib.ResNet(rngs=nnx.Rngs(cfg.seed))
  batches = []
  for i in range(cfg.batches):
    x, y = data_lib.image_batch(cfg.batch_size, 10, seed=cfg.seed + i)
    batches.append((jnp.asarray(x), jnp.asarray(y)))
  return _nnx_workload(model, resnet_lib.cross_entropy_loss, mode, cfg,
                       batches, None, cfg.batch_size)


def build_gpt(mode: dict[str, Any], cfg: Config) -> Workload:
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from jmp_amp.models import data as data_lib  # pylint: disable=g-import-not-at-top
  from jmp_amp.models import gpt as gpt_lib  # pylint: disable=g-import-not-at-top

  model = gpt_lib.GPT(rngs=nnx.Rngs(cfg.seed))
  batches = []
  for i in range(cfg.batches):
    tokens = jnp.asarray(data_lib.token_batch(cfg.batch_size, 64, 256,
                                              seed=cfg.seed + i))
    batches.append((tokens, tokens))
  return _nnx_workload(model, gpt_lib.lm_loss, mode, cfg, batches, None,
                       cfg.batch_size)


BUILDERS = {"mlp": build_mlp, "resnet": build_resnet, "gpt": build_gpt}

# --------------------------------------------------------------------------
# Measurement.


def _device_peak_bytes() -> Optional[int]:
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


def _precision_context(name: str):
  precision = JAX_MODES[name].get("precision")
  return (jax.default_matmul_precision(precision) if precision
          else contextlib.nullcontext())


@dataclasses.dataclass
class _Prepared:
  """One JAX mode, compiled, with its initial state kept for every repeat."""
  name: str
  work: Workload
  compiled: Any
  compile_s: float
  report: Any
  memory: dict[str, Optional[int]]
  repeat_medians: list[float] = dataclasses.field(default_factory=list)
  total_s: float = 0.0
  metrics: Any = None


def prepare_jax_mode(name: str, cfg: Config,
                     hlo_dir: Optional[str]) -> _Prepared:
  """Builds and compiles one jmp_amp mode (and dumps its StableHLO)."""
  with _precision_context(name):
    work = BUILDERS[cfg.model](JAX_MODES[name], cfg)
    t0 = time.perf_counter()
    lowered = work.step.lower(work.state, work.batches[0])
    report = jmp_amp.matmul_report(lowered)
    compiled = lowered.compile()
    compile_s = time.perf_counter() - t0
  if hlo_dir:
    with open(os.path.join(hlo_dir, f"{cfg.model}-{name}.stablehlo.mlir"),
              "w") as f:
      f.write(lowered.as_text())
  return _Prepared(name, work, compiled, compile_s, report,
                   _compiled_memory(compiled))


def time_repeat(prep: _Prepared, cfg: Config,
                progress: Callable[[], None]) -> None:
  """One repeat: ``cfg.steps`` steps from the initial state (a fresh copy)."""
  with _precision_context(prep.name):
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


def _timing_fields(repeat_medians: Sequence[float],
                   batch_size: int) -> dict[str, Any]:
  median = statistics.median(repeat_medians)
  spread = ((max(repeat_medians) - min(repeat_medians)) / 2 / median
            if len(repeat_medians) > 1 else None)
  return dict(median_step_s=median, repeat_median_step_s=list(repeat_medians),
              step_spread=spread, steps_per_s=1.0 / median,
              samples_per_s=batch_size / median)


def finish_jax_mode(prep: _Prepared, isolated: bool) -> dict[str, Any]:
  """The result record of a prepared and timed JAX mode."""
  memory, metrics = prep.memory, prep.metrics
  # A device's peak counter only grows: it belongs to one mode only when that
  # mode ran in a fresh process. Otherwise the compiled program's own memory
  # analysis is the per-mode figure.
  peak = _device_peak_bytes() if isolated else None
  median = statistics.median(prep.repeat_medians)
  summary = dict(prep.report.summary(),
                 input_dtypes=sorted(prep.report.input_dtypes()))
  if prep.name in FP8_MODES:
    # The lowered program rounds operands to FP8 and multiplies them in
    # bfloat16; only XLA:GPU on Hopper fuses that into FP8 GEMMs.
    summary["fp8"] = ("emulated" if jax.default_backend() == "cpu"
                      else "qdq")
  return dict(
      status="ok", framework="jax", compile_s=prep.compile_s,
      total_s=prep.total_s,
      **_timing_fields(prep.repeat_medians, prep.work.batch_size),
      peak_memory_bytes=peak if peak is not None else (
          (memory["temp_bytes"] or 0) + (memory["argument_bytes"] or 0)
          + (memory["output_bytes"] or 0)),
      memory_source="device" if peak is not None else "compiled",
      compiled_memory=memory, final_loss=float(metrics["loss"]),
      skipped_steps=int(metrics["skipped_steps"]),
      loss_scale=(float(metrics["loss_scale"])
                  if JAX_MODES[prep.name].get("scale") else None),
      matmuls=summary,
      tflops=(prep.work.flops_per_step / median / 1e12
              if prep.work.flops_per_step else None),
  )


def run_jax_mode(name: str, cfg: Config, hlo_dir: Optional[str] = None,
                 progress: Callable[[], None] = lambda: None,
                 isolated: bool = False) -> dict[str, Any]:
  """Builds, compiles and times one jmp_amp mode, all repeats in a row."""
  prep = prepare_jax_mode(name, cfg, hlo_dir)
  for _ in range(cfg.repeats):
    time_repeat(prep, cfg, progress)
  return finish_jax_mode(prep, isolated)


def _torch_device():
  import torch  # pylint: disable=g-import-not-at-top
  return "cuda" if torch.cuda.is_available() else "cpu"


def run_torch_mode(name: str, cfg: Config,
                   progress: Callable[[], None] = lambda: None
                   ) -> dict[str, Any]:
  """The recipe in PyTorch: the same initial weights and batches as JAX's."""
  import torch  # pylint: disable=g-import-not-at-top

  if cfg.model != "mlp":
    raise ValueError("--compare-torch supports --model mlp only")
  device = _torch_device()
  layers = []
  for i, (kernel, bias) in enumerate(mlp_initial_weights(cfg)):
    linear = torch.nn.Linear(*kernel.shape)
    with torch.no_grad():
      linear.weight.copy_(torch.from_numpy(kernel.T.copy()))
      linear.bias.copy_(torch.from_numpy(bias.copy()))
    layers += [linear] if i == cfg.layers - 1 else [linear, torch.nn.ReLU()]
  initial = torch.nn.Sequential(*layers).to(device)
  xs, ys = mlp_data(cfg)
  data = [(torch.from_numpy(np.asarray(x)).to(device),
           torch.from_numpy(np.asarray(y)).to(device)) for x, y in zip(xs, ys)]
  use_amp = name != "torch-float32"
  half = torch.float16  # the recipe's dtype, on every device
  with torch.autocast(device_type=device, dtype=half, enabled=use_amp):
    used = str(initial[0](data[0][0][:1]).dtype).replace("torch.", "")
  sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
  if device == "cuda":
    torch.cuda.reset_peak_memory_stats()

  repeat_medians, total_s = [], 0.0
  for _ in range(cfg.repeats):
    net = copy.deepcopy(initial)  # every repeat from the same weights
    opt = torch.optim.SGD(net.parameters(), lr=cfg.lr)
    scaler = torch.amp.GradScaler(device, init_scale=cfg.init_scale,
                                  enabled=name == "torch-autocast+scaler")
    times, skipped = [], 0
    start = time.perf_counter()
    for i in range(cfg.steps):
      x, y = data[i % len(data)]
      t = time.perf_counter()
      before = scaler.get_scale() if scaler.is_enabled() else None
      with torch.autocast(device_type=device, dtype=half, enabled=use_amp):
        loss = torch.nn.functional.mse_loss(net(x).float(), y)
      scaler.scale(loss).backward()
      scaler.step(opt)
      scaler.update()
      opt.zero_grad(set_to_none=True)
      sync()
      if before is not None and scaler.get_scale() < before:
        skipped += 1
      if i >= cfg.warmup:
        times.append(time.perf_counter() - t)
      progress()
    total_s += time.perf_counter() - start
    repeat_medians.append(statistics.median(times))
  median = statistics.median(repeat_medians)
  flops = 6.0 * cfg.batch_size * cfg.width * cfg.width * cfg.layers
  peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
  return dict(
      status="ok", framework="torch", compile_s=0.0, total_s=total_s,
      **_timing_fields(repeat_medians, cfg.batch_size),
      peak_memory_bytes=peak, memory_source="device" if peak else None,
      compiled_memory=None, final_loss=float(loss.detach().float().cpu()),
      skipped_steps=skipped,
      loss_scale=float(scaler.get_scale()) if scaler.is_enabled() else None,
      matmuls={"autocast_dtype": used if use_amp else "float32"},
      tflops=flops / median / 1e12,
  )


# --------------------------------------------------------------------------
# Reporting.


def _version(dist: str) -> Optional[str]:
  from importlib import metadata  # pylint: disable=g-import-not-at-top
  try:
    return metadata.version(dist)
  except metadata.PackageNotFoundError:
    return None


def environment() -> dict[str, Any]:
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


def _baseline_name(framework: Optional[str]) -> str:
  return "torch-float32" if framework == "torch" else "float32"


def add_ratios(runs: list[dict[str, Any]]) -> None:
  """Speed-up and memory ratios of each run against its framework's float32.

  JAX rows are relative to the JAX ``float32`` row, torch rows to the
  ``torch-float32`` row; a ratio is None where that baseline did not run.
  """
  base = {r["framework"]: r for r in runs
          if r.get("status") == "ok" and r["mode"] in ("float32", "torch-float32")}
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
  if matmuls.get("fp8"):
    return f"FP8 as quantize-dequantize: {cell}"
  return cell


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
     True, 7),
    ("speed-up", lambda r: _fmt(r.get("speedup_vs_float32"), ".2f", "x"),
     True, 2),
    ("memory", lambda r: _memory_cell(r, r.get("memory_ratio_vs_float32"),
                                      ".2f"), True, 4),
    ("peak MiB", lambda r: _memory_cell(
        r, r["peak_memory_bytes"] / 2**20 if r.get("peak_memory_bytes")
        else None, ",.1f"), True, 8),
    ("final loss", lambda r: _fmt(r["final_loss"], ".4g"), True, 3),
    ("skipped", lambda r: str(r["skipped_steps"]), True, 5),
    ("scale", lambda r: _fmt(r.get("loss_scale"), ".0f"), True, 6),
    ("compile s", lambda r: _fmt(r.get("compile_s"), ".2f"), True, 10),
    ("samples/s", lambda r: _fmt(r.get("samples_per_s"), ",.0f"), True, 9),
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


def _fit_columns(rows: list[list[str]], width: int) -> list[int]:
  """Indices of the columns to show, most important first, within `width`."""
  widths = [max(len(COLUMNS[i]), *(len(row[i]) for row in rows))
            for i in range(len(COLUMNS))]
  shown, used = [], -2
  for i in sorted(range(len(COLUMNS)), key=lambda i: _COLUMN_SPECS[i][3]):
    if used + 2 + widths[i] <= width or not shown:
      shown.append(i)
      used += 2 + widths[i]
  return sorted(shown)


def _wrap(text: str, width: int, indent: str = "") -> str:
  # Long words (paths, dtype signatures) are never cut: no text is lost.
  return textwrap.fill(text, width=max(width, 20), subsequent_indent=indent,
                       break_long_words=False, break_on_hyphens=False)


def legend(runs: list[dict[str, Any]], cfg: Config, shown: Sequence[str]
           ) -> list[str]:
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
      "final loss: the last step's loss; skipped: steps skipped for inf/NaN "
      "gradients; scale: the final dynamic loss scale (- = no loss scaling).",
  ]
  hidden = [c for c in COLUMNS if c not in shown and c != "matmuls"]
  if hidden:
    lines.append(f"Not shown at this width: {', '.join(hidden)} (widen the "
                 "terminal, or see --json).")
  return lines


def verdict(runs: list[dict[str, Any]]) -> str:
  """One line: the fastest mode, and whether every mode trained."""
  ok = [r for r in runs if r.get("status") == "ok"]
  parts = []
  jax_rows = [r for r in ok if r["framework"] == "jax"
              and r.get("speedup_vs_float32") is not None]
  if jax_rows:
    best = max(jax_rows, key=lambda r: r["speedup_vs_float32"])
    parts.append(f"fastest JAX mode {best['mode']} at "
                 f"{best['speedup_vs_float32']:.2f}x float32's speed")
  bad = [r["mode"] for r in ok if not math.isfinite(r["final_loss"])]
  parts.append(f"non-finite final loss in {', '.join(bad)}" if bad
               else "every mode ended with a finite loss")
  base = next((r for r in ok if r["mode"] == "float32"), None)
  if base and not bad and math.isfinite(base["final_loss"]):
    dev = max(abs(r["final_loss"] - base["final_loss"])
              / max(abs(base["final_loss"]), 1e-12)
              for r in ok if r["framework"] == "jax")
    parts.append(f"final losses within {dev:.2%} of float32's")
  spreads = [r["step_spread"] for r in ok if r.get("step_spread") is not None]
  if spreads and max(spreads) > 0.2:
    parts.append(f"timings are noisy (spread up to {max(spreads):.0%}): "
                 "use more --repeats or an idle machine")
  failed = [r["mode"] for r in runs if r.get("status") != "ok"]
  if failed:
    parts.append(f"{len(failed)} failed ({', '.join(failed)})")
  return "Verdict: " + "; ".join(parts) + "."


CPU_NOTE = ("Note: this ran on a CPU, where XLA has no fast half-precision "
            "matmul, so half precision is not expected to be faster here; "
            "the speed-ups are for GPUs. The matmul dtypes and the memory "
            "column still show what each mode compiles to.")
FP8_NOTE = ("FP8 modes ({modes}) are emulated here: operands are rounded to "
            "FP8 (E4M3 forward, E5M2 gradients) and multiplied in bfloat16, "
            "so the numerics are FP8's but the speed is not; `--target h100` "
            "shows the FP8 GEMMs XLA emits for a Hopper GPU.")


def format_report(runs: list[dict[str, Any]], env: dict[str, Any],
                  cfg: Config, width: Optional[int] = None) -> str:
  """The table, its legend, the verdict, notes and full errors as text."""
  width = width or terminal_width()
  sizes = (f"width={cfg.width} layers={cfg.layers} " if cfg.model == "mlp"
           else "")
  title = (f"{cfg.model} {sizes}batch={cfg.batch_size} steps={cfg.steps} "
           f"repeats={cfg.repeats} on {env['device']}")
  rows = table_rows(runs)
  shown = _fit_columns(rows, width)
  widths = {i: max(len(COLUMNS[i]), *(len(row[i]) for row in rows))
            for i in shown}

  def line(cells: Sequence[str]) -> str:
    out = []
    for i in shown:
      right = _COLUMN_SPECS[i][2]
      out.append(cells[i].rjust(widths[i]) if right
                 else cells[i].ljust(widths[i]))
    return "  ".join(out).rstrip()

  out = [_wrap(title, width), line(COLUMNS),
         line(["-" * len(c) for c in COLUMNS])]
  out += [line(row) for row in rows]
  out.append("")
  out += [_wrap(text, width, "  ")
          for text in legend(runs, cfg, [COLUMNS[i] for i in shown])]
  matmul_col = COLUMNS.index("matmuls")
  if matmul_col not in shown:
    out.append("matmuls (count x operand dtypes -> result dtype):")
    out += [_wrap(f"  {r['mode']}: {_matmul_cell(r.get('matmuls'))}", width,
                  "    ") for r in runs if r.get("status") == "ok"]
  out.append(_wrap(verdict(runs), width, "  "))
  if env.get("platform") == "cpu":
    out.append(_wrap(CPU_NOTE, width, "  "))
    fp8_rows = [r["mode"] for r in runs if r.get("status") == "ok"
                and isinstance(r.get("matmuls"), dict)
                and r["matmuls"].get("fp8")]
    if fp8_rows:
      out.append(_wrap(FP8_NOTE.format(modes=", ".join(fp8_rows)), width,
                       "  "))
  for r in runs:
    if r.get("status") != "ok":
      out.append(_wrap(f"FAILED {r['mode']}: {r.get('error', '')}", width,
                       "  "))
  return "\n".join(out)


def print_table(runs: list[dict[str, Any]], env: dict[str, Any], cfg: Config,
                file=None, width: Optional[int] = None) -> None:
  print(format_report(runs, env, cfg, width), file=file or sys.stdout)


def plot(runs: list[dict[str, Any]], path: str, title: str) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  ok = [r for r in runs if r.get("status") == "ok"]
  names = [r["mode"] for r in ok]
  fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.3 * len(ok)), 4))
  colors = ["tab:orange" if r["framework"] == "torch" else "tab:blue"
            for r in ok]
  ms = [r["median_step_s"] * 1e3 for r in ok]
  err = [[(r["median_step_s"] - min(r["repeat_median_step_s"])) * 1e3
          for r in ok],
         [(max(r["repeat_median_step_s"]) - r["median_step_s"]) * 1e3
          for r in ok]]
  axes[0].bar(names, ms, color=colors, yerr=err, capsize=3)
  axes[0].set_ylabel("median step time (ms), range of repeats")
  mem = [(r.get("peak_memory_bytes") or 0) / 2**20 for r in ok]
  axes[1].bar(names, mem, color=colors)
  axes[1].set_ylabel("peak memory (MiB)")
  for ax in axes:
    ax.tick_params(axis="x", rotation=45)
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


# --------------------------------------------------------------------------
# CLI.


def _number(convert: Callable[[str], Any], ok: Callable[[Any], bool],
            expected: str) -> Callable[[str], Any]:
  """An argparse `type=` that converts and range-checks, naming `expected`."""
  def parse(text: str):
    try:
      value = convert(text)
    except ValueError:
      raise argparse.ArgumentTypeError(
          f"expected {expected}, got {text!r}") from None
    if not ok(value):
      raise argparse.ArgumentTypeError(f"expected {expected}, got {text}")
    return value
  return parse


_positive_int = _number(int, lambda v: v >= 1, "a positive integer")
_non_negative_int = _number(int, lambda v: v >= 0, "an integer >= 0")
_seed_arg = _number(int, lambda v: 0 <= v < 2**32,
                    "an integer from 0 to 2**32 - 1")
_positive_float = _number(float, lambda v: math.isfinite(v) and v > 0,
                          "a positive number")
# DynamicLossScale's floor (min_loss_scale) is 1; the scale lives in float32.
_F32_MAX = float(np.finfo(np.float32).max)
_loss_scale_arg = _number(float, lambda v: 1 <= v <= _F32_MAX,
                          f"a number from 1 to float32's max ({_F32_MAX:.6g})")


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="jmp-amp bench",
      description="Time float32 vs mixed precision training steps (the "
      "PyTorch AMP recipe) for jmp_amp, optionally next to PyTorch.")
  parser.add_argument("--model", choices=sorted(BUILDERS), default="mlp")
  parser.add_argument("--recipe", choices=sorted(RECIPES), default=None,
                      help="preset sizes: 'small' (default for mlp, CPU), "
                      "'seed' (the PyTorch recipe: width 4096, batch 512, 50 "
                      "batches x 3 epochs), 'compute-bound' (width 8192, "
                      "batch 4096)")
  parser.add_argument("--width", type=_positive_int)
  parser.add_argument("--layers", type=_positive_int,
                      help="number of linear layers (the recipe's num_layers)")
  parser.add_argument("--batch-size", type=_positive_int)
  parser.add_argument("--batches", type=_positive_int,
                      help="distinct batches per epoch")
  parser.add_argument("--epochs", type=_positive_int)
  parser.add_argument("--steps", type=_positive_int,
                      help="total steps (overrides --epochs x --batches)")
  parser.add_argument("--warmup", type=_non_negative_int, default=2,
                      help="steps excluded from the median (default 2)")
  parser.add_argument("--repeats", type=_positive_int, default=3,
                      help="time every mode this many times, interleaved; "
                      "the table shows the median and the spread (default 3)")
  parser.add_argument("--policy", action="append", dest="modes",
                      choices=list(JAX_MODES), metavar="MODE",
                      help="precision mode, repeatable; one of "
                      f"{', '.join(JAX_MODES)} (default: "
                      f"{', '.join(DEFAULT_MODES)})")
  parser.add_argument("--lr", type=_positive_float, default=0.1)
  parser.add_argument("--init-scale", type=_loss_scale_arg, default=2.0**15,
                      help="initial dynamic loss scale (default 2**15)")
  parser.add_argument("--seed", type=_seed_arg, default=0,
                      help="seed of the weights and the data (default 0)")
  parser.add_argument("--compare-torch", action="store_true",
                      help="also run PyTorch float32, autocast to float16 and "
                      "autocast + GradScaler from the same initial weights "
                      "on the same batches (needs torch: pip install "
                      "'jmp-amp[torch]')")
  parser.add_argument("--isolate", choices=("auto", "yes", "no"),
                      default="auto",
                      help="run each JAX mode in a fresh process so that its "
                      "peak memory is its own (auto: where the device reports "
                      "peak memory, i.e. on GPUs)")
  parser.add_argument("--json", metavar="PATH",
                      help="write one JSON object per run (JSON Lines)")
  parser.add_argument("--hlo-dir", metavar="DIR",
                      help="dump each mode's lowered StableHLO here")
  parser.add_argument("--plot", metavar="PNG",
                      help="bar charts of step time and memory per mode "
                      "(needs matplotlib)")
  parser.add_argument("--no-progress", action="store_true")
  parser.add_argument("--target", choices=["h100"],
                      help="compile each mode for this GPU without one and "
                      "report GEMM dtypes, kernels, memory and bytes "
                      "(compiler figures, not timings; needs the gpu-audit "
                      "extra)")
  parser.add_argument("--worker", help=argparse.SUPPRESS)
  return parser


def _check_file_destination(parser: argparse.ArgumentParser, flag: str,
                            path: str) -> None:
  """Fails now, naming `path`, if the results could not be written there."""
  parent = os.path.dirname(os.path.abspath(path))
  if os.path.isdir(path):
    parser.error(f"{flag} {path}: is a directory, expected a file path")
  if not os.path.isdir(parent):
    parser.error(f"{flag} {path}: the directory {parent} does not exist")
  if not os.access(parent, os.W_OK) or (
      os.path.exists(path) and not os.access(path, os.W_OK)):
    parser.error(f"{flag} {path}: not writable")


def _check_dir_destination(parser: argparse.ArgumentParser, flag: str,
                           path: str) -> None:
  parent = os.path.dirname(os.path.abspath(path))
  if os.path.exists(path) and not os.path.isdir(path):
    parser.error(f"{flag} {path}: exists and is not a directory")
  if not os.path.exists(path) and not os.path.isdir(parent):
    parser.error(f"{flag} {path}: the directory {parent} does not exist")
  if not os.access(path if os.path.exists(path) else parent, os.W_OK):
    parser.error(f"{flag} {path}: not writable")


def check_before_running(args: argparse.Namespace,
                         parser: argparse.ArgumentParser) -> None:
  """Destinations and optional dependencies, checked before any mode runs.

  A GPU run can take long: a bad path or a missing package must fail in
  seconds, naming what is wrong, not after the results exist.
  """
  if args.json:
    _check_file_destination(parser, "--json", args.json)
  if args.plot:
    _check_file_destination(parser, "--plot", args.plot)
    if importlib.util.find_spec("matplotlib") is None:
      parser.error("--plot needs matplotlib, which is not installed: "
                   "pip install 'jmp-amp[bench]'")
  if args.hlo_dir:
    _check_dir_destination(parser, "--hlo-dir", args.hlo_dir)
  if args.compare_torch and importlib.util.find_spec("torch") is None:
    parser.error("--compare-torch needs PyTorch, which is not installed: "
                 "pip install 'jmp-amp[torch]' (on a CPU-only machine, "
                 "install PyTorch's CPU build first, or pip fetches a "
                 "multi-GB CUDA build)")


def config_from_args(args: argparse.Namespace,
                     parser: argparse.ArgumentParser) -> Config:
  recipe = RECIPES[args.recipe or "small"]
  defaults = dict(recipe)
  if args.model != "mlp" and args.recipe is None:
    defaults.update(batch_size=32, batches=4, epochs=2)
  values = {k: getattr(args, k) if getattr(args, k) is not None else defaults[k]
            for k in ("width", "layers", "batch_size", "batches", "epochs")}
  steps = args.steps or values["epochs"] * values["batches"]
  if args.warmup >= steps:
    parser.error(f"--warmup ({args.warmup}) must be smaller than the number "
                 f"of steps ({steps})")
  if args.compare_torch and args.model != "mlp":
    parser.error("--compare-torch supports --model mlp only")
  return Config(model=args.model, steps=steps, warmup=args.warmup, lr=args.lr,
                seed=args.seed, init_scale=args.init_scale,
                repeats=args.repeats, **values)


def _progress_bar(enabled: bool):
  if not enabled or importlib.util.find_spec("rich") is None:
    return contextlib.nullcontext(None)
  from rich.progress import Progress  # pylint: disable=g-import-not-at-top
  return Progress(transient=True)


_WORKER_TAG = "jmp_amp.bench worker result: "


def _failure(name: str, e: BaseException) -> dict[str, Any]:
  return dict(status="failed",
              framework="torch" if name in TORCH_MODES else "jax",
              error=f"{type(e).__name__}: {e}",
              traceback=traceback.format_exc(limit=5))


def _run_in_fresh_process(name: str, cfg: Config,
                          hlo_dir: Optional[str]) -> dict[str, Any]:
  """`run_jax_mode` in a child interpreter: the device peak is this mode's."""
  request = json.dumps({"mode": name, "config": dataclasses.asdict(cfg),
                        "hlo_dir": hlo_dir})
  proc = subprocess.run(
      [sys.executable, "-m", "jmp_amp.tools.bench", "--worker", request],
      capture_output=True, text=True, check=False)
  for text in reversed(proc.stdout.splitlines()):
    if text.startswith(_WORKER_TAG):
      return json.loads(text[len(_WORKER_TAG):])
  return dict(status="failed", framework="jax", traceback=None,
              error=f"the worker process for {name} exited with code "
              f"{proc.returncode}: {proc.stderr.strip()}")


def _worker(request: str) -> int:
  spec = json.loads(request)
  cfg = Config(**spec["config"])
  try:
    result = run_jax_mode(spec["mode"], cfg, spec["hlo_dir"], isolated=True)
  except Exception as e:  # pylint: disable=broad-except
    result = _failure(spec["mode"], e)
  print(_WORKER_TAG + json.dumps(result, default=str))
  return 0


def run(args: argparse.Namespace, cfg: Config) -> list[dict[str, Any]]:
  """Runs every requested mode; a failing mode is recorded, not raised."""
  env = environment()
  modes = list(dict.fromkeys(args.modes or DEFAULT_MODES))
  torch_modes = list(TORCH_MODES) if args.compare_torch else []
  isolate = args.isolate == "yes" or (args.isolate == "auto"
                                      and _device_peak_bytes() is not None)
  if args.hlo_dir:
    os.makedirs(args.hlo_dir, exist_ok=True)
  show = sys.stdout.isatty() and not args.no_progress
  per_mode = cfg.steps * cfg.repeats
  results: dict[str, dict[str, Any]] = {}
  with _progress_bar(show) as bar:
    task = (bar.add_task("bench", total=per_mode * (len(modes)
                                                    + len(torch_modes)))
            if bar else None)
    tick = (lambda: bar.advance(task)) if bar else (lambda: None)

    def describe(text):
      if bar:
        bar.update(task, description=text)

    if isolate:
      for name in modes:
        describe(name)
        results[name] = _run_in_fresh_process(name, cfg, args.hlo_dir)
        results[name]["isolated"] = True
        for _ in range(per_mode):
          tick()
    else:
      # Compile every mode, then time them in turn, repeat after repeat:
      # interleaving spreads a noisy machine's drift over all modes.
      prepared = {}
      for name in modes:
        describe(f"compiling {name}")
        try:
          prepared[name] = prepare_jax_mode(name, cfg, args.hlo_dir)
        except Exception as e:  # pylint: disable=broad-except
          # One failing mode (e.g. out of memory) must not lose the others.
          results[name] = _failure(name, e)
      for _ in range(cfg.repeats):
        for name, prep in list(prepared.items()):
          describe(name)
          try:
            time_repeat(prep, cfg, tick)
          except Exception as e:  # pylint: disable=broad-except
            results[name] = _failure(name, e)
            del prepared[name]
      for name, prep in prepared.items():
        results[name] = finish_jax_mode(prep, isolated=False)
      for name in modes:
        results[name]["isolated"] = False
    for name in torch_modes:
      describe(name)
      try:
        results[name] = run_torch_mode(name, cfg, tick)
      except Exception as e:  # pylint: disable=broad-except
        results[name] = _failure(name, e)
      results[name]["isolated"] = False
  runs = []
  for name in modes + torch_modes:
    result = results[name]
    result.update(schema=SCHEMA, mode=name, config=dataclasses.asdict(cfg),
                  **env)
    runs.append(result)
  add_ratios(runs)
  return runs


def main(argv: Optional[Sequence[str]] = None) -> int:
  """`jmp-amp bench` / `python -m jmp_amp.tools.bench`: the exit code."""
  argv = list(sys.argv[1:] if argv is None else argv)
  # `jmp-amp bench ...` and `python -m jmp_amp.tools.bench ...` both work.
  if argv and argv[0] == "bench":
    argv = argv[1:]
  parser = build_parser()
  args = parser.parse_args(argv)
  if args.worker:
    return _worker(args.worker)
  cfg = config_from_args(args, parser)
  check_before_running(args, parser)
  if args.target:
    from jmp_amp.tools.bench import gpu  # pylint: disable=g-import-not-at-top
    return gpu.run(args, cfg)
  # On a GPU, JAX would otherwise reserve 75% of the memory in this process
  # and again in each fresh per-mode process (and leave none to torch); the
  # peak-memory figures count live buffers either way.
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  runs = run(args, cfg)
  env = {k: runs[0][k] for k in ("device", "platform", "versions")}
  print_table(runs, env, cfg)
  code = 0 if all(r["status"] == "ok" for r in runs) else 1
  if args.json:
    with open(args.json, "w") as f:
      for r in runs:
        f.write(json.dumps(r, sort_keys=True, default=str) + "\n")
  if args.plot:
    try:
      plot(runs, args.plot, f"jmp_amp bench: {cfg.model} on {env['device']}")
    except Exception as e:  # pylint: disable=broad-except
      print(f"jmp-amp bench: --plot {args.plot}: {type(e).__name__}: {e}",
            file=sys.stderr)
      code = 1
  return code


COMMANDS = {"bench": "time float32 vs mixed precision training steps "
                     "(the PyTorch AMP recipe), optionally next to PyTorch"}


def cli(argv: Optional[Sequence[str]] = None) -> int:
  """The `jmp-amp` command: dispatches to its sub-commands."""
  argv = list(sys.argv[1:] if argv is None else argv)
  parser = argparse.ArgumentParser(
      prog="jmp-amp",
      formatter_class=argparse.RawDescriptionHelpFormatter,
      description="jmp_amp: automatic mixed precision for JAX, Flax and "
      "optax.",
      epilog="commands:\n" + "\n".join(
          f"  {name:<8}{text}" for name, text in COMMANDS.items())
      + "\n\nRun 'jmp-amp COMMAND --help' for a command's options.")
  parser.add_argument("--version", action="version",
                      version=f"jmp-amp {jmp_amp.__version__}")
  if not argv:
    parser.print_help()
    return 0
  if argv[0].startswith("-"):
    parser.parse_args(argv)  # --help / --version exit here
    parser.error(f"unrecognized arguments: {' '.join(argv)} (give a command "
                 f"first: {', '.join(COMMANDS)})")
  if argv[0] not in COMMANDS:
    parser.error(f"unknown command {argv[0]!r} (the commands are: "
                 f"{', '.join(COMMANDS)})")
  return main(argv)

