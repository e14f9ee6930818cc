"""`jmp-amp bench` on the command line: flags, checks, runs, output.

`cli` is the `jmp-amp` command and `main` its ``bench`` sub-command (also
``python -m jmp_amp.tools.bench``). Flags are parsed and every destination
and optional dependency checked before anything runs; `run` then compiles the
modes and times them in interleaved repeats (or each in a fresh process, for
its own peak memory), saying how far it is on stderr, and `main` prints the
report and writes the JSON lines and the plot.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import subprocess
import sys
import time
import traceback
from typing import Any, Callable, Optional, Sequence

import numpy as np

import jmp_amp
from jmp_amp.tools.bench import plot
from jmp_amp.tools.bench import table
from jmp_amp.tools.bench import timing
from jmp_amp.tools.bench import torch_runner
from jmp_amp.tools.bench import workloads

SCHEMA = "jmp_amp.bench/1"


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
  parser.add_argument("--model", choices=sorted(workloads.BUILDERS),
                      default="mlp")
  parser.add_argument("--recipe", choices=sorted(workloads.RECIPES),
                      default=None,
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
                      choices=list(workloads.JAX_MODES), metavar="MODE",
                      help="precision mode, repeatable; one of "
                      f"{', '.join(workloads.JAX_MODES)} (default: "
                      f"{', '.join(workloads.DEFAULT_MODES)}). A mode is named "
                      "after its policy (jmp_amp.get_policy): float16 modes "
                      "scale the loss dynamically unless -noscale, "
                      "autocast-* run jmp_amp.autocast; see the policy-name "
                      "table in README.md")
  parser.add_argument("--lr", type=_positive_float, default=0.1)
  parser.add_argument("--init-scale", type=_loss_scale_arg, default=2.0**15,
                      help="initial dynamic loss scale (default 2**15)")
  parser.add_argument("--seed", type=_seed_arg, default=0,
                      help="seed of the weights and the data (default 0)")
  parser.add_argument("--compare-torch", action="store_true",
                      help="also run PyTorch float32, autocast to float16 and "
                      "autocast + GradScaler from the same initial weights "
                      "on the same batches (needs torch: pip install "
                      "'jmp-amp[torch]'; on a machine without a GPU, PyTorch's "
                      "CPU build first, see README.md)")
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
  parser.add_argument("--gemm", choices=["default", "cublas"],
                      default="default",
                      help="with --target: compile with XLA's default options "
                      "(as a GPU does, the default) or with Triton GEMMs off "
                      "(cublas: every GEMM a cuBLAS call, labelled as such)")
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
    problem = plot.suffix_error(args.plot)
    if problem:
      parser.error(f"--plot {args.plot}: {problem}")
  if args.hlo_dir:
    _check_dir_destination(parser, "--hlo-dir", args.hlo_dir)
  if args.compare_torch and importlib.util.find_spec("torch") is None:
    parser.error("--compare-torch needs PyTorch, which is not installed: "
                 "pip install 'jmp-amp[torch]' (on a CPU-only machine, "
                 "install PyTorch's CPU build first, or pip fetches a "
                 "multi-GB CUDA build: pip install torch --index-url "
                 "https://download.pytorch.org/whl/cpu)")


def config_from_args(args: argparse.Namespace,
                     parser: argparse.ArgumentParser) -> workloads.Config:
  recipe = workloads.RECIPES[args.recipe or "small"]
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
  return workloads.Config(model=args.model, steps=steps, warmup=args.warmup,
                          lr=args.lr, seed=args.seed,
                          init_scale=args.init_scale, repeats=args.repeats,
                          **values)


class Progress:
  """How far the bench is, on stderr, so that stdout holds only the report.

  On a terminal: a rich progress bar that clears itself. Elsewhere (a log, a
  pipe, CI): one line per mode as it starts and ends, flushed at once. With
  ``enabled=False`` (``--no-progress``): nothing.
  """

  def __init__(self, enabled: bool, total: int):
    self._bar = self._task = None
    self._lines = False
    if not enabled:
      return
    if sys.stderr.isatty() and importlib.util.find_spec("rich") is not None:
      # pylint: disable=g-import-not-at-top
      from rich.console import Console
      from rich.progress import Progress as RichProgress
      self._bar = RichProgress(console=Console(stderr=True), transient=True)
      self._task = self._bar.add_task("bench", total=total)
    else:
      self._lines = True

  def __enter__(self) -> Progress:
    if self._bar:
      self._bar.start()
    return self

  def __exit__(self, *exc_info) -> None:
    if self._bar:
      self._bar.stop()

  def tick(self) -> None:
    """One training step done."""
    if self._bar:
      self._bar.advance(self._task)

  def status(self, text: str) -> None:
    """What runs now, on the bar only (too frequent for a log)."""
    if self._bar:
      self._bar.update(self._task, description=text)

  def say(self, text: str) -> None:
    """A mode started or ended: the bar's description, or a line."""
    self.status(text)
    if self._lines:
      print(f"jmp-amp bench: {text}", file=sys.stderr, flush=True)


_WORKER_TAG = "jmp_amp.bench worker result: "


def _failure(name: str, e: BaseException) -> dict[str, Any]:
  return dict(status="failed",
              framework="torch" if name in workloads.TORCH_MODES else "jax",
              error=f"{type(e).__name__}: {e}",
              traceback=traceback.format_exc(limit=5))


def _run_in_fresh_process(name: str, cfg: workloads.Config,
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
  cfg = workloads.Config(**spec["config"])
  try:
    result = timing.run_jax_mode(spec["mode"], cfg, spec["hlo_dir"],
                                 isolated=True)
  except Exception as e:  # pylint: disable=broad-except
    result = _failure(spec["mode"], e)
  print(_WORKER_TAG + json.dumps(result, default=str))
  return 0


def _outcome(result: dict[str, Any]) -> str:
  if result.get("status") != "ok":
    return f"FAILED ({result.get('error', '')[:60]})"
  return f"median step {result['median_step_s'] * 1e3:.2f} ms"


def run(args: argparse.Namespace, cfg: workloads.Config
        ) -> list[dict[str, Any]]:
  """Runs every requested mode; a failing mode is recorded, not raised."""
  env = timing.environment()
  modes = list(dict.fromkeys(args.modes or workloads.DEFAULT_MODES))
  torch_modes = list(workloads.TORCH_MODES) if args.compare_torch else []
  isolate = args.isolate == "yes" or (
      args.isolate == "auto" and timing.device_peak_bytes() is not None)
  if args.hlo_dir:
    os.makedirs(args.hlo_dir, exist_ok=True)
  per_mode = cfg.steps * cfg.repeats
  count = len(modes) + len(torch_modes)
  results: dict[str, dict[str, Any]] = {}
  with Progress(not args.no_progress, per_mode * count) as progress:
    if isolate:
      for k, name in enumerate(modes, 1):
        progress.say(f"running {name} ({k}/{count}) in a fresh process")
        results[name] = _run_in_fresh_process(name, cfg, args.hlo_dir)
        results[name]["isolated"] = True
        for _ in range(per_mode):
          progress.tick()
        progress.say(f"{name}: {_outcome(results[name])}")
    else:
      # Compile every mode, then time them in turn, repeat after repeat:
      # interleaving spreads a noisy machine's drift over all modes.
      prepared = {}
      for k, name in enumerate(modes, 1):
        progress.say(f"compiling {name} ({k}/{count})")
        start = time.perf_counter()
        try:
          prepared[name] = timing.prepare_jax_mode(name, cfg, args.hlo_dir)
        except Exception as e:  # pylint: disable=broad-except
          # One failing mode (e.g. out of memory) must not lose the others.
          results[name] = _failure(name, e)
        progress.say(f"{name}: " + (
            f"compiled in {time.perf_counter() - start:.1f} s"
            if name in prepared else _outcome(results[name])))
      for repeat in range(1, cfg.repeats + 1):
        progress.say(f"timing repeat {repeat}/{cfg.repeats} of "
                     f"{len(prepared)} mode(s), {cfg.steps} steps each")
        for name, prep in list(prepared.items()):
          progress.status(f"{name}: repeat {repeat}/{cfg.repeats}")
          try:
            timing.time_repeat(prep, cfg, progress.tick)
          except Exception as e:  # pylint: disable=broad-except
            results[name] = _failure(name, e)
            del prepared[name]
      for name, prep in prepared.items():
        results[name] = timing.finish_jax_mode(prep, isolated=False)
      for name in modes:
        results[name]["isolated"] = False
        progress.say(f"{name}: {_outcome(results[name])}")
    for k, name in enumerate(torch_modes, len(modes) + 1):
      progress.say(f"running {name} ({k}/{count})")
      try:
        results[name] = torch_runner.run_torch_mode(name, cfg, progress.tick)
      except Exception as e:  # pylint: disable=broad-except
        results[name] = _failure(name, e)
      results[name]["isolated"] = False
      progress.say(f"{name}: {_outcome(results[name])}")
  runs = []
  for name in modes + torch_modes:
    result = results[name]
    result.update(schema=SCHEMA, mode=name, config=dataclasses.asdict(cfg),
                  **env)
    runs.append(result)
  table.add_ratios(runs)
  return runs


def _bench(argv: list[str]) -> int:
  parser = build_parser()
  args = parser.parse_args(argv)
  with timing.cold_compiles():  # "compile s" are compiles, not disk reads
    return _run_bench(args, parser)


def _run_bench(args: argparse.Namespace,
               parser: argparse.ArgumentParser) -> int:
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
  table.print_table(runs, env, cfg)
  code = 0 if all(r["status"] == "ok" for r in runs) else 1
  if table.fp8_failures(runs):
    code = 1
  if args.json:
    with open(args.json, "w") as f:
      for r in runs:
        f.write(json.dumps(r, sort_keys=True, default=str) + "\n")
  if args.plot:
    try:
      plot.plot(runs, args.plot,
                f"jmp_amp bench: {cfg.model} on {env['device']}")
    except Exception as e:  # pylint: disable=broad-except
      print(f"jmp-amp bench: --plot {args.plot}: {type(e).__name__}: {e}",
            file=sys.stderr)
      code = 1
  return code


# The exit status of a program that wrote to a pipe its reader had closed.
BROKEN_PIPE_EXIT = 128 + 13


def main(argv: Optional[Sequence[str]] = None) -> int:
  """`jmp-amp bench` / `python -m jmp_amp.tools.bench`: the exit code."""
  argv = list(sys.argv[1:] if argv is None else argv)
  # `jmp-amp bench ...` and `python -m jmp_amp.tools.bench ...` both work.
  if argv and argv[0] == "bench":
    argv = argv[1:]
  try:
    code = _bench(argv)
    sys.stdout.flush()  # a closed pipe raises here, not at interpreter exit
  except BrokenPipeError:
    # The reader went away (`jmp-amp bench | head -1`): not the bench's
    # failure, and no traceback. Python flushes stdout and stderr again at
    # exit; pointing them at /dev/null keeps that flush quiet.
    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
      os.dup2(devnull, stream.fileno())
    return BROKEN_PIPE_EXIT
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
