"""`jmp-amp bench`: the PyTorch AMP recipe's benchmark, for jmp_amp.

The seeds' recipe trains an MLP (width 4096, 3 linear layers, batch 512, 50
batches x 3 epochs, SGD, MSE loss) in float32, with autocast, and with autocast
+ GradScaler. This command runs the same comparison for jmp_amp's precision
modes in one process, and optionally the PyTorch modes on the same device:

    jmp-amp bench                              # small CPU-sized default
    jmp-amp bench --recipe seed --compare-torch --json out.jsonl --plot out.png
    python -m jmp_amp.bench --model resnet --policy bf16 --policy fp16

For every mode it reports the median step time after warm-up (each step
synchronised with `block_until_ready`; compile time separately), steps/s,
samples/s, peak memory, final loss, skipped steps, final loss scale, the
matmul-dtype summary, achieved TFLOP/s (MLP) and ratios against float32.

This module imports Flax and the reference models; `import jmp_amp` does not
import it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import platform
import statistics
import sys
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
#          autocast policy or None)
JAX_MODES: dict[str, dict[str, Any]] = {
    "float32": dict(policy="float32", scale=None),
    "float32-highest": dict(policy="float32", scale=None, precision="highest"),
    "bf16": dict(policy="mixed_bfloat16", scale=None),
    "fp16": dict(policy="mixed_float16", scale="dynamic"),
    "fp16-noscale": dict(policy="mixed_float16", scale=None),
    "autocast-bf16": dict(autocast="p=f32,c=bf16,o=f32", scale=None),
    "autocast-fp16": dict(autocast="p=f32,c=f16,o=f32", scale="dynamic"),
}
DEFAULT_MODES = ("float32", "float32-highest", "bf16", "fp16", "fp16-noscale")
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


def _nnx_workload(model, loss_of_output, mode, cfg, batches, flops,
                  batch_size) -> Workload:
  """A jitted pure step around `jmp_amp.flax.make_train_step` for `model`.

  Policies come from `jmp_amp.flax.set_policies` (or op-level autocast). The
  model and optimizer are split once into a graphdef and a state pytree, so
  each step is a plain `jax.jit` call with the state donated: no per-step
  Python graph traversal, which would dominate sub-millisecond GPU steps.
  """
  from flax import nnx  # pylint: disable=g-import-not-at-top
  import jmp_amp.flax as jflax  # pylint: disable=g-import-not-at-top

  if mode.get("policy") not in (None, "float32"):
    half = jmp_amp.get_policy(mode["policy"]).compute_dtype
    jflax.set_policies(model, jflax.mixed_rules(half))
  tx = jmp_amp.loss_scaling(optax.sgd(cfg.lr),
                            _loss_scale_for(mode, cfg.init_scale))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  inner = jflax.make_train_step(
      lambda m, batch: loss_of_output(m(batch[0]), batch[1]),
      autocast=mode.get("autocast"), jit=False)
  graphdef, state = nnx.split((model, optimizer))

  def step(state, batch):
    model, optimizer = nnx.merge(graphdef, state)
    metrics = inner(model, optimizer, batch)
    return nnx.state((model, optimizer)), metrics

  return Workload(jax.jit(step, donate_argnums=0), state, batches, batch_size,
                  flops)


def build_mlp(mode: dict[str, Any], cfg: Config) -> Workload:
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from models import data as data_lib  # pylint: disable=g-import-not-at-top
  from models import mlp as mlp_lib  # pylint: disable=g-import-not-at-top

  model = mlp_lib.MLP(cfg.width, cfg.width, num_layers=cfg.layers,
                      rngs=nnx.Rngs(cfg.seed))
  xs, ys = data_lib.regression_batches(cfg.batches, cfg.batch_size, cfg.width,
                                       cfg.width, seed=cfg.seed)
  batches = [(jnp.asarray(x), jnp.asarray(y)) for x, y in zip(xs, ys)]
  flops = 6.0 * cfg.batch_size * cfg.width * cfg.width * cfg.layers
  return _nnx_workload(model, mlp_lib.mse_loss, mode, cfg, batches, flops,
                       cfg.batch_size)


def build_resnet(mode: dict[str, Any], cfg: Config) -> Workload:
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from models import data as data_lib  # pylint: disable=g-import-not-at-top
  from models import resnet as resnet_lib  # pylint: disable=g-import-not-at-top

  model = resnet_lib.ResNet(rngs=nnx.Rngs(cfg.seed))
  batches = []
  for i in range(cfg.batches):
    x, y = data_lib.image_batch(cfg.batch_size, 10, seed=cfg.seed + i)
    batches.append((jnp.asarray(x), jnp.asarray(y)))
  return _nnx_workload(model, resnet_lib.cross_entropy_loss, mode, cfg,
                       batches, None, cfg.batch_size)


def build_gpt(mode: dict[str, Any], cfg: Config) -> Workload:
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from models import data as data_lib  # pylint: disable=g-import-not-at-top
  from models import gpt as gpt_lib  # pylint: disable=g-import-not-at-top

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


def run_jax_mode(name: str, cfg: Config, hlo_dir: Optional[str],
                 progress: Callable[[], None]) -> dict[str, Any]:
  """Builds, compiles and times one jmp_amp mode."""
  mode = JAX_MODES[name]
  precision = mode.get("precision")
  ctx = (jax.default_matmul_precision(precision) if precision
         else contextlib.nullcontext())
  with ctx:
    work = BUILDERS[cfg.model](mode, cfg)
    t0 = time.perf_counter()
    lowered = work.step.lower(work.state, work.batches[0])
    report = jmp_amp.matmul_report(lowered)
    compiled = lowered.compile()
    compile_s = time.perf_counter() - t0
    if hlo_dir:
      os.makedirs(hlo_dir, exist_ok=True)
      with open(os.path.join(hlo_dir, f"{cfg.model}-{name}.stablehlo.mlir"),
                "w") as f:
        f.write(lowered.as_text())
    memory = _compiled_memory(compiled)

    state = work.state
    times = []
    total_start = time.perf_counter()
    for i in range(cfg.steps):
      batch = work.batches[i % len(work.batches)]
      t = time.perf_counter()
      state, metrics = compiled(state, batch)
      jax.block_until_ready(metrics)
      if i >= cfg.warmup:
        times.append(time.perf_counter() - t)
      progress()
    total_s = time.perf_counter() - total_start
  metrics = jax.device_get(metrics)
  median = statistics.median(times) if times else float("nan")
  peak = _device_peak_bytes()
  summary = dict(report.summary(), input_dtypes=sorted(report.input_dtypes()))
  return dict(
      status="ok",
      framework="jax",
      compile_s=compile_s,
      median_step_s=median,
      total_s=total_s,
      steps_per_s=1.0 / median,
      samples_per_s=work.batch_size / median,
      peak_memory_bytes=peak if peak is not None else (
          (memory["temp_bytes"] or 0) + (memory["argument_bytes"] or 0)
          + (memory["output_bytes"] or 0)),
      memory_source="device" if peak is not None else "compiled",
      compiled_memory=memory,
      final_loss=float(metrics["loss"]),
      skipped_steps=int(metrics["skipped_steps"]),
      loss_scale=float(metrics["loss_scale"]),
      matmuls=summary,
      tflops=(work.flops_per_step / median / 1e12
              if work.flops_per_step else None),
  )


def run_torch_mode(name: str, cfg: Config,
                   progress: Callable[[], None]) -> dict[str, Any]:
  """The recipe in PyTorch on the same device kind: default/autocast/scaler."""
  import torch  # pylint: disable=g-import-not-at-top
  from models import data as data_lib  # pylint: disable=g-import-not-at-top

  if cfg.model != "mlp":
    raise ValueError("--compare-torch supports --model mlp only")
  device = "cuda" if torch.cuda.is_available() else "cpu"
  half = torch.float16 if device == "cuda" else torch.bfloat16
  torch.manual_seed(cfg.seed)
  layers = []
  for _ in range(cfg.layers - 1):
    layers += [torch.nn.Linear(cfg.width, cfg.width), torch.nn.ReLU()]
  layers.append(torch.nn.Linear(cfg.width, cfg.width))
  net = torch.nn.Sequential(*layers).to(device)
  opt = torch.optim.SGD(net.parameters(), lr=cfg.lr)
  xs, ys = data_lib.regression_batches(cfg.batches, cfg.batch_size, cfg.width,
                                       cfg.width, seed=cfg.seed)
  data = [(torch.from_numpy(np.asarray(x)).to(device),
           torch.from_numpy(np.asarray(y)).to(device)) for x, y in zip(xs, ys)]
  use_amp = name != "torch-float32"
  scaler = torch.amp.GradScaler(device, init_scale=cfg.init_scale,
                                enabled=name == "torch-autocast+scaler")
  sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
  if device == "cuda":
    torch.cuda.reset_peak_memory_stats()

  def step(x, y):
    with torch.autocast(device_type=device, dtype=half, enabled=use_amp):
      loss = torch.nn.functional.mse_loss(net(x).float(), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
    return loss

  times = []
  skipped = 0
  total_start = time.perf_counter()
  for i in range(cfg.steps):
    x, y = data[i % len(data)]
    t = time.perf_counter()
    before = scaler.get_scale() if scaler.is_enabled() else None
    loss = step(x, y)
    sync()
    if before is not None and scaler.get_scale() < before:
      skipped += 1
    if i >= cfg.warmup:
      times.append(time.perf_counter() - t)
    progress()
  total_s = time.perf_counter() - total_start
  median = statistics.median(times) if times else float("nan")
  flops = 6.0 * cfg.batch_size * cfg.width * cfg.width * cfg.layers
  peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
  return dict(
      status="ok", framework="torch", compile_s=0.0, median_step_s=median,
      total_s=total_s, steps_per_s=1.0 / median,
      samples_per_s=cfg.batch_size / median,
      peak_memory_bytes=peak, memory_source="device" if peak else None,
      compiled_memory=None, final_loss=float(loss.detach().float().cpu()),
      skipped_steps=skipped,
      loss_scale=float(scaler.get_scale()) if scaler.is_enabled() else 1.0,
      matmuls={"autocast_dtype": str(half).replace("torch.", "") if use_amp
               else "float32"},
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


def add_ratios(runs: list[dict[str, Any]]) -> None:
  """Speed-up and memory ratio of each run relative to its float32 baseline."""
  base = {r["framework"]: r for r in runs
          if r.get("status") == "ok" and r["mode"] in ("float32", "torch-float32")}
  for r in runs:
    b = base.get(r.get("framework"))
    ok = r.get("status") == "ok" and b is not None
    r["speedup_vs_float32"] = (b["median_step_s"] / r["median_step_s"]
                               if ok else None)
    mem, bmem = r.get("peak_memory_bytes"), b and b.get("peak_memory_bytes")
    r["memory_ratio_vs_float32"] = (mem / bmem if ok and mem and bmem
                                    else None)
    tb = b and (b.get("compiled_memory") or {}).get("temp_bytes")
    t = (r.get("compiled_memory") or {}).get("temp_bytes")
    r["compiled_temp_ratio_vs_float32"] = t / tb if ok and t and tb else None


def _fmt(value, spec):
  return "-" if value is None else format(value, spec)


def _matmul_cell(matmuls: Any) -> str:
  if not isinstance(matmuls, dict):
    return "-"
  if "autocast_dtype" in matmuls:
    return f"torch {matmuls['autocast_dtype']}"
  return ", ".join(f"{v} x {k}"
                   for k, v in matmuls.get("by_signature", {}).items())


COLUMNS = ("mode", "step ms", "compile s", "samples/s", "TFLOP/s", "speed-up",
           "peak MiB", "mem ratio", "final loss", "skipped", "scale",
           "matmuls")


def table_rows(runs: list[dict[str, Any]]) -> list[list[str]]:
  rows = []
  for r in runs:
    if r.get("status") != "ok":
      rows.append([r["mode"], f"FAILED: {r.get('error', '')[:60]}"]
                  + [""] * (len(COLUMNS) - 2))
      continue
    peak = r.get("peak_memory_bytes")
    rows.append([
        r["mode"], _fmt(r["median_step_s"] * 1e3, ".2f"),
        _fmt(r["compile_s"], ".2f"), _fmt(r["samples_per_s"], ",.0f"),
        _fmt(r.get("tflops"), ".2f"), _fmt(r.get("speedup_vs_float32"), ".2f"),
        _fmt(peak / 2**20 if peak else None, ",.1f")
        + ("*" if r.get("memory_source") == "compiled" else ""),
        _fmt(r.get("memory_ratio_vs_float32"), ".2f"),
        _fmt(r["final_loss"], ".4g"), str(r["skipped_steps"]),
        _fmt(r["loss_scale"], ".0f"), _matmul_cell(r.get("matmuls")),
    ])
  return rows


def print_table(runs: list[dict[str, Any]], env: dict[str, Any], cfg: Config,
                file=None) -> None:
  file = file or sys.stdout
  sizes = (f"width={cfg.width} layers={cfg.layers} " if cfg.model == "mlp"
           else "")
  title = (f"{cfg.model} {sizes}batch={cfg.batch_size} steps={cfg.steps} "
           f"on {env['device']}")
  note = "* peak memory from the compiled program's memory analysis"
  rows = table_rows(runs)
  try:
    from rich.console import Console  # pylint: disable=g-import-not-at-top
    from rich.table import Table  # pylint: disable=g-import-not-at-top
  except ImportError:
    print(title, file=file)
    print(" | ".join(COLUMNS), file=file)
    for row in rows:
      print(" | ".join(row), file=file)
    print(note, file=file)
    return
  table = Table(title=title, caption=note)
  for col in COLUMNS:
    table.add_column(col, justify="left" if col in ("mode", "matmuls")
                     else "right")
  for row in rows:
    table.add_row(*row)
  Console(file=file, width=200).print(table)


def plot(runs: list[dict[str, Any]], path: str, title: str) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  ok = [r for r in runs if r.get("status") == "ok"]
  names = [r["mode"] for r in ok]
  fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.3 * len(ok)), 4))
  colors = ["tab:orange" if r["framework"] == "torch" else "tab:blue"
            for r in ok]
  axes[0].bar(names, [r["median_step_s"] * 1e3 for r in ok], color=colors)
  axes[0].set_ylabel("median step time (ms)")
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
_positive_float = _number(float, lambda v: math.isfinite(v) and v > 0,
                          "a positive number")
# DynamicLossScale's floor (min_loss_scale) is 1.
_loss_scale_arg = _number(float, lambda v: math.isfinite(v) and v >= 1,
                          "a finite number >= 1")


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
  parser.add_argument("--policy", action="append", dest="modes",
                      choices=list(JAX_MODES), metavar="MODE",
                      help="precision mode, repeatable; one of "
                      f"{', '.join(JAX_MODES)} (default: "
                      f"{', '.join(DEFAULT_MODES)})")
  parser.add_argument("--lr", type=_positive_float, default=0.1)
  parser.add_argument("--init-scale", type=_loss_scale_arg, default=2.0**15,
                      help="initial dynamic loss scale (default 2**15)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--compare-torch", action="store_true",
                      help="also run PyTorch default, autocast and "
                      "autocast+GradScaler on the same MLP and data")
  parser.add_argument("--json", metavar="PATH",
                      help="write one JSON object per run (JSON Lines)")
  parser.add_argument("--hlo-dir", metavar="DIR",
                      help="dump each mode's lowered StableHLO here")
  parser.add_argument("--plot", metavar="PNG",
                      help="bar charts of step time and memory per mode")
  parser.add_argument("--no-progress", action="store_true")
  parser.add_argument("--target", choices=["h100"],
                      help="compile each mode for this GPU without one and "
                      "report GEMM dtypes, kernels, memory and bytes "
                      "(compiler figures, not timings; needs the gpu-audit "
                      "extra)")
  return parser


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
                seed=args.seed, init_scale=args.init_scale, **values)


def _progress_bar(total: int, enabled: bool):
  if not enabled:
    return contextlib.nullcontext(None)
  from rich.progress import Progress  # pylint: disable=g-import-not-at-top
  return Progress(transient=True)


def run(args: argparse.Namespace, cfg: Config) -> list[dict[str, Any]]:
  env = environment()
  modes = list(dict.fromkeys(args.modes or DEFAULT_MODES))
  names = modes + (list(TORCH_MODES) if args.compare_torch else [])
  show = sys.stdout.isatty() and not args.no_progress
  runs = []
  with _progress_bar(cfg.steps * len(names), show) as bar:
    task = bar.add_task("bench", total=cfg.steps * len(names)) if bar else None
    for name in names:
      if bar:
        bar.update(task, description=name)
      tick = (lambda: bar.advance(task)) if bar else (lambda: None)
      try:
        if name in TORCH_MODES:
          result = run_torch_mode(name, cfg, tick)
        else:
          result = run_jax_mode(name, cfg, args.hlo_dir, tick)
      except Exception as e:  # pylint: disable=broad-except
        # One failing mode (e.g. out of memory) must not lose the others.
        result = dict(status="failed", framework="torch" if name in TORCH_MODES
                      else "jax", error=f"{type(e).__name__}: {e}",
                      traceback=traceback.format_exc(limit=5))
      result.update(schema=SCHEMA, mode=name, config=dataclasses.asdict(cfg),
                    **env)
      runs.append(result)
  add_ratios(runs)
  return runs


def main(argv: Optional[Sequence[str]] = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  # `jmp-amp bench ...` and `python -m jmp_amp.bench ...` both work.
  if argv and argv[0] == "bench":
    argv = argv[1:]
  parser = build_parser()
  args = parser.parse_args(argv)
  cfg = config_from_args(args, parser)
  if args.target:
    from jmp_amp import gpu_bench  # pylint: disable=g-import-not-at-top
    return gpu_bench.run(args, cfg)
  runs = run(args, cfg)
  env = {k: runs[0][k] for k in ("device", "platform", "versions")}
  print_table(runs, env, cfg)
  if args.json:
    with open(args.json, "w") as f:
      for r in runs:
        f.write(json.dumps(r, sort_keys=True, default=str) + "\n")
  if args.plot:
    plot(runs, args.plot, f"jmp_amp bench: {cfg.model} on {env['device']}")
  return 0 if all(r["status"] == "ok" for r in runs) else 1


if __name__ == "__main__":
  sys.exit(main())
