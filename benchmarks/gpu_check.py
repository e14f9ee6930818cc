"""The device check: every precision mode on a real GPU, in one command.

    python benchmarks/gpu_check.py          # on a GPU: writes
                    # benchmarks/results/gpu_check_<device>.json
    python benchmarks/gpu_check.py --small  # tiny sizes (the tests' CPU run)

Three workloads, as users run them, compiled with XLA's default options:

* ``mlp``: the bench's MLP at its compute-bound sizes (width 8192, 3 layers,
  batch 4096, SGD) in the modes, named as the bench's: float32,
  mixed_bfloat16, mixed_float16 (dynamic loss scaling), float8 (current
  scaling with the first and last layer kept bf16), float8-all (all layers
  FP8), float8-delayed, float8-rowwise, autocast-float8,
  mixed_bfloat16-state16 (16-bit params and state) and
  mixed_bfloat16-telemetry (``numerics="**"``); torch float32 and autocast
  rows where torch is installed.
* ``gpt``: `jmp_amp.models.GPT` (d_model 2048, 16 heads, 4 blocks, T 1024,
  batch 8, vocab 32768, adamw; its default fused attention) in the same
  modes (but all-FP8 and autocast), with model FLOP/s as a share of the
  device's dense bf16 peak (`gpt_bench`); torch's GPT with SDPA under bf16
  autocast, eager and under ``torch.compile``, where torch is installed.
* ``llama`` (only with ``--workloads llama``): `jmp_amp.models.Llama`'s 1b
  preset (1.12B parameters, T 2048, batch 8, adamw; blocks scanned and
  rematerialised, `llama_bench`) in `LLAMA_MODES`, each mode in a process of
  its own (one mode's weights and optimizer state are 18 GB), so its compile
  seconds are a cold process's first call and its device peak its own; per
  mode also the largest batch (powers of two) whose compiled step fits the
  device's memory. Torch rows: the same Llama under ``torch.compile`` with
  bf16 autocast and with torchao's float8 (tensorwise, rowwise), where torch
  (and torchao) are installed.

Each workload runs in a process of its own (a hung compile loses that
workload only; with ``--small``, a workload's modes, llama's and
``SLOW_COMPILE``'s too, share one process): every mode is compiled (the
seconds it took are recorded), then timed in interleaved repeats of
``--steps`` steps, one device sync per repeat. Per mode the JSON records
the median ms/step over the repeats and their spread, the compile seconds,
the memory of the compiled program (arguments, outputs, temporaries; the
device's peak counter only grows, so it is recorded once per workload), the
final loss and the GEMM dtypes of the program the device compiled, with
`fp8_check`'s verdict for FP8 modes. The summary gives the ratios the issues
set targets for.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

SIZES = {
    "mlp": dict(width=8192, layers=3, batch_size=4096),
    "gpt": dict(vocab_size=32768, d_model=2048, num_heads=16, num_layers=4,
                max_len=1024, batch_size=8),
    "llama": dict(size="gpu", preset="1b", batch_size=8, max_batch=64),
}
SMALL = {
    "mlp": dict(width=64, layers=3, batch_size=16),
    "gpt": dict(vocab_size=256, d_model=64, num_heads=4, num_layers=2,
                max_len=64, batch_size=2),  # gpt_bench's "cpu" size
    "llama": dict(size="cpu", preset="small", batch_size=2, max_batch=4),
}
# Named as the bench's modes (`jmp-amp bench --policy`): the policy, then
# what is added to it.
MODES = {
    "float32": dict(),
    "mixed_bfloat16": dict(compute="bfloat16"),
    "mixed_float16": dict(compute="float16", scale="dynamic"),
    "float8": dict(fp8="current"),
    "float8-all": dict(fp8="current", keep_first_last=False, models=("mlp",)),
    "float8-delayed": dict(fp8="delayed"),
    "float8-rowwise": dict(fp8="rowwise"),
    "autocast-float8": dict(autocast="float8", models=("mlp",)),
    "mixed_bfloat16-state16": dict(compute="bfloat16", state16=True),
    "mixed_bfloat16-telemetry": dict(compute="bfloat16", numerics="**"),
}
# Modes whose compile may take minutes on a GPU (issue #33: rowwise FP8 had
# not compiled after 75 s on an H200): each runs in a process of its own,
# after the others, so a hang loses that mode alone.
SLOW_COMPILE = {("gpt", "float8-rowwise")}
# Issue #53's modes of the llama workload, each in a process of its own.
LLAMA_MODES = ("float32", "mixed_bfloat16", "float8", "float8-rowwise",
               "mixed_bfloat16-state16", "mixed_bfloat16-telemetry")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # gpt_bench.py: the GPT's FLOPs, peaks, torch rows


def modes_for(model, names=None):
  return [n for n in (names or MODES)
          if model in MODES[n].get("models", (model,))
          and (model != "llama" or n in LLAMA_MODES)]


# --------------------------------------------------------------------------
# One workload, in its own process.


def _rules(mode):
  import jax.numpy as jnp

  import jmp_amp
  import jmp_amp.flax as jflax
  if mode.get("fp8"):
    recipe = jmp_amp.fp8.FP8Recipe(
        scaling=mode["fp8"], history_len=16 if mode["fp8"] == "delayed" else 1)
    return jflax.mixed_rules() | {"*": jflax.fp8.FP8Policy(
        recipe, keep_first_last=mode.get("keep_first_last", True))}
  if mode.get("state16"):
    return jflax.mixed_rules(
        "bfloat16", param="bfloat16",
        norms="params=bfloat16,compute=float32,output=float32")
  if mode.get("compute"):
    return jflax.mixed_rules(jnp.dtype(mode["compute"]).name)
  return None


def build(model_name, mode, sizes, seed=0):
  """(jitted step, state, batches, model FLOPs per step, its compiler
  options) of one mode."""
  from flax import nnx
  import jax
  import jax.numpy as jnp
  from jmp_amp.models import data as data_lib
  from jmp_amp.models import gpt as gpt_lib
  from jmp_amp.models import mlp as mlp_lib
  import optax

  import jmp_amp
  from jmp_amp import optim
  import jmp_amp.flax as jflax
  from jmp_amp.tools.bench import workloads

  rngs = nnx.Rngs(seed)
  if model_name == "mlp":
    w, b = sizes["width"], sizes["batch_size"]
    model = mlp_lib.MLP(w, w, num_layers=sizes["layers"], rngs=rngs)
    xs, ys = data_lib.regression_batches(2, b, w, w, seed=seed)
    batches = [(jnp.asarray(x), jnp.asarray(y)) for x, y in zip(xs, ys)]
    loss = mlp_lib.mse_loss
    base = optax.sgd(0.01)
    flops = 6.0 * b * w * w * sizes["layers"]
  elif model_name == "llama":
    import llama_bench
    model = llama_bench.model(sizes["size"], seed=seed)
    batches = [(t, t) for t in (llama_bench.tokens(
        sizes["size"], sizes["batch_size"], seed=seed + i) for i in range(2))]
    loss = gpt_lib.lm_loss
    base = optax.adamw(1e-4)
    flops = float(llama_bench.model_flops_per_step(sizes["size"],
                                                   sizes["batch_size"]))
  else:
    cfg = {k: v for k, v in sizes.items() if k != "batch_size"}
    model = gpt_lib.GPT(**cfg, rngs=rngs)
    tokens = [jnp.asarray(data_lib.token_batch(
        sizes["batch_size"], cfg["max_len"], cfg["vocab_size"], seed=seed + i))
              for i in range(2)]
    batches = [(t, t) for t in tokens]
    loss = gpt_lib.lm_loss
    base = optax.adamw(1e-4)
    import gpt_bench
    flops = float(gpt_bench.model_flops_per_step(
        "gpu" if sizes == SIZES["gpt"] else "cpu"))
  rules = _rules(mode)
  if rules is not None:
    jflax.set_policies(model, rules, example_args=(batches[0][0][:1],))
  if mode.get("state16"):
    base = optax.chain(optim.compress_state(base, seed=seed),
                       optim.low_precision_params("stochastic", seed=seed))
  scale = (jmp_amp.DynamicLossScale(2.0**15) if mode.get("scale")
           else jmp_amp.NoOpLossScale())
  optimizer = nnx.Optimizer(model, jmp_amp.loss_scaling(base, scale),
                            wrt=nnx.Param)
  inner = jflax.make_train_step(
      lambda m, batch: loss(m(batch[0]), batch[1]), jit=False,
      autocast=mode.get("autocast"), numerics=mode.get("numerics"))
  graphdef, state = nnx.split((model, optimizer))

  def step(state, batch):
    model, optimizer = nnx.merge(graphdef, state)
    metrics = inner(model, optimizer, batch)
    return nnx.state((model, optimizer)), metrics["loss"]

  # As make_train_step's: Triton GEMMs off for FP8 GEMMs
  # (--compiler-option xla_gpu_enable_triton_gemm=true gives XLA's defaults).
  options = workloads.step_compiler_options(
      model, mode.get("autocast"), platform="cuda")
  return (jax.jit(step, donate_argnums=0, compiler_options=options), state,
          batches, flops, options)


def _memory(compiled):
  analysis = compiled.memory_analysis()
  if analysis is None:
    return None
  return int(analysis.temp_size_in_bytes + analysis.argument_size_in_bytes
             + analysis.output_size_in_bytes - analysis.alias_size_in_bytes)


def warm_up():
  """Compiles and runs one small GEMM first, so that the device's start-up
  (its runtime, cuBLAS, the autotuner) is not counted in any mode's compile
  seconds."""
  import jax
  import jax.numpy as jnp
  x = jnp.ones((256, 256), jnp.bfloat16)
  jax.block_until_ready(jax.jit(lambda a: a @ a)(x))


def _dump(dump_dir, model_name, name, compiled):
  """The device's compiled program, gzipped: what the audit read."""
  import gzip
  os.makedirs(dump_dir, exist_ok=True)
  with gzip.open(os.path.join(dump_dir, f"{model_name}_{name}.hlo.txt.gz"),
                 "wt") as f:
    f.write(compiled.as_text())


def run_workload(model_name, names, sizes, steps, repeats, out_path,
                 dump_dir=None, options=None, memory_limit=None):
  """Compiles and times every mode of one workload; appends JSON lines.

  Each mode is timed once as soon as it is compiled (so a later compile that
  hangs loses no earlier mode), then all of them in interleaved repeats.
  """
  import jax

  from jmp_amp.tools import audit
  from jmp_amp.tools.bench import timing

  def emit(record):
    with open(out_path, "a") as f:
      f.write(json.dumps(record, default=str) + "\n")

  def run(p):
    t0 = time.perf_counter()
    for i in range(steps):
      p["state"], loss = p["compiled"](p["state"], p["batches"][i % 2])
    p["loss"] = float(jax.block_until_ready(loss))
    p["times"].append((time.perf_counter() - t0) / steps)

  def emit_timed(name, p, peak):
    median = statistics.median(p["times"])
    emit(dict(workload=model_name, mode=name, event="timed",
              ms_per_step=median * 1e3,
              spread=(max(p["times"]) - min(p["times"])) / 2 / median,
              repeat_ms=[t * 1e3 for t in p["times"]], final_loss=p["loss"],
              model_tflops=p["flops"] / median / 1e12,
              bf16_peak_share=(p["flops"] / median / peak if peak else None)))

  warm_up()
  peak = None
  if model_name in ("gpt", "llama"):
    import gpt_bench
    peak = gpt_bench.peak_bf16_flops(jax.devices()[0].device_kind)
  prepared = {}
  for name in names:
    mode = MODES[name]
    try:
      t0 = time.perf_counter()
      step, state, batches, flops, jit_options = build(model_name, mode,
                                                       sizes)
      lowered = step.lower(state, batches[0])
      compiled = lowered.compile(compiler_options=options or None)
      compile_s = time.perf_counter() - t0
      device_report = audit.matmul_report(compiled)
      on_cpu = jax.default_backend() == "cpu"
      problem = None if on_cpu else timing.fp8_check(
          "autocast-float8" if mode.get("autocast") else
          ("float8" if mode.get("fp8") else "mixed_bfloat16"), device_report,
          audit.matmul_report(lowered))
      if dump_dir:
        _dump(dump_dir, model_name, name, compiled)
      emit(dict(workload=model_name, mode=name, event="compiled",
                compile_s=compile_s,
                compiler_options={**(jit_options or {}),
                                  **(options or {})} or "XLA defaults",
                memory_bytes=_memory(compiled),
                gemms=device_report.counts_by_signature(),
                gemm_stage="compiled", fp8_problem=problem))
      p = prepared[name] = dict(compiled=compiled, state=state,
                                batches=batches, times=[], flops=flops)
      p["state"], loss = compiled(p["state"], batches[0])  # warm-up, untimed
      jax.block_until_ready(loss)
      run(p)
      emit_timed(name, p, peak)
      if model_name == "llama":
        import llama_bench
        emit(llama_bench.memory_fit(name, step, p["state"], batches[0],
                                    sizes, memory_limit, options, _memory,
                                    compiled))
    except Exception as e:  # pylint: disable=broad-except
      prepared.pop(name, None)
      emit(dict(workload=model_name, mode=name, event="failed",
                error=f"{type(e).__name__}: {e}"[:2000]))
  for _ in range(repeats - 1):  # interleaved: drift spreads over every mode
    for p in prepared.values():
      run(p)
  for name, p in prepared.items():
    emit_timed(name, p, peak)
  stats = jax.devices()[0].memory_stats() or {}
  emit(dict(workload=model_name, event="memory",
            process_peak_bytes=stats.get("peak_bytes_in_use")))


def run_torch(workloads, sizes, steps, repeats, small, out_path):
  """The torch rows, in a process of their own (inductor can take minutes)."""
  rows = []
  if "mlp" in workloads:
    rows += _torch_mlp_rows(sizes["mlp"], steps, repeats)
  if "gpt" in workloads and not small:
    rows += _torch_gpt_rows(small, steps)
  if "llama" in workloads and not small:  # inductor: minutes on a CPU
    import llama_bench
    rows += llama_bench.torch_rows("gpu", steps=steps)[0]
  with open(out_path, "a") as f:
    for r in rows:
      f.write(json.dumps(dict(r, event="torch"), default=str) + "\n")


# --------------------------------------------------------------------------
# The parent: one process per workload, torch rows, the summary.


def _torch_mlp_rows(sizes, steps, repeats):
  """torch float32 and autocast(+GradScaler) on the same MLP, or []."""
  import importlib.util
  if importlib.util.find_spec("torch") is None:
    return []
  from jmp_amp.tools.bench import torch_runner
  from jmp_amp.tools.bench import workloads
  cfg = workloads.Config(model="mlp", width=sizes["width"],
                         layers=sizes["layers"],
                         batch_size=sizes["batch_size"], batches=2, epochs=1,
                         steps=steps + 2, warmup=2, lr=0.01, seed=0,
                         init_scale=2.0**15, repeats=repeats)
  rows = []
  for name in ("torch-float32", "torch-autocast+scaler"):
    try:
      r = torch_runner.run_torch_mode(name, cfg)
      rows.append(dict(workload="mlp", mode=name, ms_per_step=r[
          "median_step_s"] * 1e3, final_loss=r["final_loss"],
                       peak_bytes=r.get("peak_memory_bytes")))
    except Exception as e:  # pylint: disable=broad-except
      rows.append(dict(workload="mlp", mode=name,
                       error=f"{type(e).__name__}: {e}"))
  return rows


def _torch_gpt_rows(small, steps):
  """torch's GPT with SDPA under bf16 autocast, eager and compiled, or []
  (gpt_bench.torch_rows; on --small only eager: inductor takes minutes on a
  CPU)."""
  import gpt_bench
  modes = (("torch-eager-sdpa",) if small else gpt_bench.TORCH_MODES)
  try:
    rows, why = gpt_bench.torch_rows("cpu" if small else "gpu", modes,
                                     steps=steps)
  except Exception as e:  # pylint: disable=broad-except
    return [dict(workload="gpt", mode="torch", error=f"{type(e).__name__}: "
                 f"{e}")]
  if why:
    return []
  return [dict(workload="gpt", mode=r["mode"], ms_per_step=r["ms_per_step"],
               final_loss=r["loss"], peak_bytes=r["peak_bytes"],
               bf16_peak_share=r["peak_share"]) for r in rows]


def _ratio(rows, workload, a, b):
  ms = {r["mode"]: r.get("ms_per_step") for r in rows
        if r["workload"] == workload}
  return ms[b] / ms[a] if ms.get(a) and ms.get(b) else None


def summary(rows):
  """The figures the issues set targets for (speed = 1 / ms per step)."""
  base = "mixed_bfloat16"  # the ratios' denominator
  compile_s = {r["mode"]: r.get("compile_s") for r in rows
               if r["workload"] == "gpt"}
  return {
      "mlp float8-all speed vs mixed_bfloat16": _ratio(
          rows, "mlp", "float8-all", base),
      "gpt float8 speed vs mixed_bfloat16": _ratio(rows, "gpt", "float8",
                                                   base),
      "gpt float8-rowwise speed vs mixed_bfloat16": _ratio(
          rows, "gpt", "float8-rowwise", base),
      # Issue #33's pairs: each mode's first-call seconds against bf16's
      # (cold only with --isolate: a process keeps its GEMM autotuning).
      "gpt compile s vs mixed_bfloat16": {
          mode: seconds / compile_s[base] for mode, seconds in compile_s.items()
          if mode != base and seconds and compile_s.get(base)},
      "gpt mixed_float16 speed vs mixed_bfloat16": _ratio(
          rows, "gpt", "mixed_float16", base),
      "gpt mixed_bfloat16 share of the dense bf16 peak": next(
          (r.get("bf16_peak_share") for r in rows
           if (r["workload"], r["mode"]) == ("gpt", base)), None),
      "gpt mixed_bfloat16 speed vs torch.compile": _ratio(
          rows, "gpt", base, "torch-compile-sdpa"),
      **_llama_summary(rows),
      "fp8 modes whose device GEMMs are not all FP8": sorted(
          f"{r['workload']}/{r['mode']}" for r in rows
          if r.get("fp8_problem")),
  }


def _llama_summary(rows):
  import llama_bench
  return llama_bench.summary(rows)


def device_name():
  import jax
  d = jax.devices()[0]
  return re.sub(r"[^a-z0-9]+", "-", getattr(d, "device_kind",
                                            d.platform).lower()).strip("-")


def groups(workloads, names=None, isolate=False, small=False):
  """(workload, modes) per worker process, in the order they run: the modes
  the issues measure first, a mode whose compile may take minutes
  (``SLOW_COMPILE``) in a process of its own after them; with `isolate`,
  every mode in a process of its own.

  With `small` (the tiny sizes, on a CPU) and without `isolate`, one process
  per workload, its ``SLOW_COMPILE`` modes last: the separate processes are
  for a device's memory and a compile that may hang, and each costs a JAX
  start and the model's first build.
  """
  if small and not isolate:
    slow_last = lambda w: sorted(modes_for(w, names),
                                 key=lambda m: (w, m) in SLOW_COMPILE)
    return [(w, slow_last(w)) for w in workloads if modes_for(w, names)]
  out = []
  for model_name in workloads:
    modes = modes_for(model_name, names)
    fast = [m for m in modes if (model_name, m) not in SLOW_COMPILE]
    if isolate or model_name == "llama":
      out += [(model_name, [m]) for m in fast]
    elif fast:
      out.append((model_name, fast))
  for model_name in workloads:
    out += [(model_name, [m]) for m in modes_for(model_name, names)
            if (model_name, m) in SLOW_COMPILE]
  return out


def compiler_options(pairs):
  """``KEY=VALUE`` strings as `jax.stages.Lowered.compile`'s options."""
  options = {}
  for pair in pairs:
    key, sep, value = pair.partition("=")
    if not sep or not key:
      raise SystemExit(f"--compiler-option takes KEY=VALUE, got {pair!r}")
    lowered = value.lower()
    options[key] = (lowered == "true" if lowered in ("true", "false") else
                    int(value) if value.lstrip("-").isdigit() else value)
  return options


def versions():
  """The versions and compiler options the figures were measured with."""
  import importlib.metadata as md
  out = {}
  for name in ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin",
               "flax", "optax", "chex", "torch"):
    try:
      out[name] = md.version(name)
    except md.PackageNotFoundError:
      pass
  out["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "")
  return out


def _rows(records):
  rows, memory = {}, {}
  for r in records:
    if r["event"] == "memory":
      memory[r["workload"]] = max(
          (b for b in (memory.get(r["workload"]), r.get("process_peak_bytes"))
           if b is not None), default=None)
    elif r["event"] == "torch":
      rows[(r["workload"], r["mode"])] = {
          k: v for k, v in r.items() if k != "event"}
    elif "mode" in r:
      rows.setdefault((r["workload"], r["mode"]), {}).update(
          {k: v for k, v in r.items() if k != "event"})
  for r in records:  # a process that timed out: its modes never timed
    if r["event"] == "timeout":
      for name in r["modes"]:
        row = rows.setdefault((r["workload"], name),
                              dict(workload=r["workload"], mode=name))
        if "ms_per_step" not in row:
          row["error"] = r["error"]
  return list(rows.values()), memory


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--small", action="store_true",
                      help="tiny sizes, for a CPU (the tests); one process "
                      "per workload")
  parser.add_argument("--workloads", nargs="+", choices=list(SIZES),
                      # llama (1.1B, a process per mode) on request only.
                      default=[w for w in SIZES if w != "llama"])
  parser.add_argument("--modes", nargs="+", choices=list(MODES))
  parser.add_argument("--steps", type=int, default=None)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--timeout", type=float, default=240,
                      help="seconds each worker process may take")
  parser.add_argument("--slow-timeout", type=float, default=120,
                      help="seconds a SLOW_COMPILE mode's process may take")
  parser.add_argument("--llama-timeout", type=float, default=900,
                      help="seconds each llama process may take (its mode's "
                      "compile, timing and largest-batch compiles)")
  parser.add_argument("--budget", type=float, default=None,
                      help="seconds the whole check may take: a process "
                      "gets what is left, and none starts with under 30")
  parser.add_argument("--isolate", action="store_true",
                      help="every mode in a process of its own: cold compile "
                      "seconds (a process keeps XLA's GEMM autotuning, so a "
                      "mode compiled after another with the same GEMMs is "
                      "cheaper), timed without interleaving")
  parser.add_argument("--no-torch", action="store_true",
                      help="skip the torch rows")
  parser.add_argument("--dump", metavar="DIR",
                      help="write each compiled program (gzipped HLO) there")
  parser.add_argument("--compiler-option", action="append", default=[],
                      metavar="KEY=VALUE", help="an XLA option for every "
                      "mode's compile, over the step's own (none, but Triton "
                      "GEMMs off for FP8 modes, as make_train_step)")
  parser.add_argument("--out", help="the JSON file (default: "
                      "benchmarks/results/gpu_check_<device>.json)")
  parser.add_argument("--memory-limit", type=int, default=None,
                      help="bytes a llama step may take when searching its "
                      "largest batch (default: the device's limit; a CPU "
                      "has none, so the search is skipped there)")
  parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  sizes = SMALL if args.small else SIZES
  steps = args.steps or (2 if args.small else 10)
  options = compiler_options(args.compiler_option)
  if args.worker:
    model_name, names, out_path, reps = args.worker
    if model_name == "torch":
      run_torch(names.split(","), sizes, steps, int(reps), args.small,
                out_path)
    else:
      from jmp_amp.tools.bench import timing
      with timing.cold_compiles():  # compile_s: compiles, never cache reads
        run_workload(model_name, names.split(","), sizes[model_name], steps,
                     int(reps), out_path, args.dump, options,
                     args.memory_limit)
    return 0
  lines_path = (args.out or "gpu_check") + ".partial.jsonl"
  if os.path.exists(lines_path):
    os.remove(lines_path)
  started = time.perf_counter()
  if args.isolate and not args.small:
    # Untimed: the small GPT in a process of its own, so that the first
    # timed mode does not also pay a fresh machine's first loads (the CUDA
    # libraries from disk, the driver's caches).
    print("gpu_check: warming up the machine (small GPT, untimed)",
          flush=True)
    try:
      subprocess.run([sys.executable, os.path.abspath(__file__), "--worker",
                      "gpt", "mixed_bfloat16", lines_path + ".warm", "1",
                      "--small", "--steps", "2"], timeout=120, check=False)
    except subprocess.TimeoutExpired:
      pass
    if os.path.exists(lines_path + ".warm"):
      os.remove(lines_path + ".warm")
  plan = groups(args.workloads, args.modes, args.isolate, args.small)
  if not args.no_torch:
    plan.append(("torch", list(args.workloads)))

  def note(record):
    with open(lines_path, "a") as f:
      f.write(json.dumps(record) + "\n")

  for model_name, names in plan:
    # A SLOW_COMPILE mode's seconds come on top (--small runs it with the
    # workload's other modes).
    slow = sum((model_name, n) in SLOW_COMPILE for n in names)
    timeout = (args.timeout if slow < len(names) else 0) + (
        slow * args.slow_timeout)
    if model_name == "llama":  # 1.1B: compiles and a batch search
      timeout = max(timeout, args.llama_timeout)
    if args.budget is not None:
      timeout = min(timeout, args.budget - (time.perf_counter() - started))
    if timeout < 30:
      if model_name != "torch":
        note(dict(workload=model_name, event="timeout", modes=names,
                  error="skipped: the --budget was spent"))
      continue
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", model_name,
           ",".join(names), lines_path, str(args.repeats),
           "--steps", str(steps)] + (["--small"] if args.small else []) + (
               ["--dump", args.dump] if args.dump else []) + (
               [f"--memory-limit={args.memory_limit}"]
               if args.memory_limit else []) + [
                   f"--compiler-option={o}" for o in args.compiler_option]
    print(f"gpu_check: {model_name}: {', '.join(names)} "
          f"(at most {timeout:.0f} s)", flush=True)
    try:
      subprocess.run(cmd, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
      if model_name != "torch":
        note(dict(workload=model_name, event="timeout", modes=names,
                  error=f"not done within {timeout:.0f} s"))
  records = []
  if os.path.exists(lines_path):
    with open(lines_path) as f:
      records = [json.loads(line) for line in f]
    os.remove(lines_path)
  rows, memory = _rows(records)
  import jax
  result = dict(device=device_name(), platform=jax.default_backend(),
                jax=jax.__version__, versions=versions(), small=args.small,
                steps=steps, repeats=args.repeats,
                compiler_options="as make_train_step's: XLA's defaults, "
                "Triton GEMMs off for FP8 modes" + (
                    f"; for every mode {options}" if options else ""),
                sizes={k: sizes[k] for k in args.workloads},
                process_peak_bytes=memory,
                seconds=time.perf_counter() - started, rows=rows,
                summary=summary(rows))
  out = args.out or os.path.join(HERE, "results",
                                 f"gpu_check_{result['device']}.json")
  with open(out, "w") as f:
    json.dump(result, f, indent=1, sort_keys=True, default=str)
  for r in rows:
    print(f"{r['workload']:4} {r['mode']:24} "
          + (f"{r['ms_per_step']:9.3f} ms  "
             f"compile {r.get('compile_s') or 0:6.1f} s"
             if r.get("ms_per_step") else f"FAILED {r.get('error', '')[:80]}")
          + (f"  NOT FP8: {r['fp8_problem']}" if r.get("fp8_problem") else ""))
  print(json.dumps(result["summary"], indent=1))
  print(f"gpu_check: wrote {out} in {result['seconds']:.0f} s")
  failed = [r for r in rows if r.get("error") or r.get("fp8_problem")]
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
