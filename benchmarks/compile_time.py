"""Compile time: of one update over many leaves, and of whole train steps.

What a user waits for before the first step, measured as CPU seconds (a real
GPU: wall seconds) to trace, lower and compile, with the caches cleared
before each compile and the variants interleaved in rounds:

* ``adam300``, ``sgd1000``: one update plus ``apply_updates`` over 300 / 1000
  8x8 float32 leaves, `jmp_amp.loss_scaling` and `optax.apply_if_finite`
  against bare optax (median ratio over rounds), beside the floor of a
  wrapper that only unscales; ``gpt24``: the whole train step of a GPT with
  24 unscanned blocks, the same variants.
* ``gpt16-features``: each feature's whole train step
  (`jmp_amp.flax.make_train_step` on a GPT of 16 unscanned blocks) against
  the step without it (`FEATURE_PAIRS`, issue #33's limits in
  `FEATURE_LIMITS`), best of ``--rounds``, and beside two of them their
  floors (`FEATURE_FLOORS`): loss scaling's finite check without the skip,
  16-bit state's storage rounded to nearest;
  ``gpt16-scanned-features``: the same with the blocks stacked under
  `nnx.scan`; ``gpt-scanned``: the bf16 step of the GPT with its blocks
  under `nnx.scan` or unrolled, at 4 and 24 blocks.

Targets:

* ``--target cpu`` (the default): compiled for this machine's CPU (XLA:CPU).
* ``--target h100``: compiled for an H100 on this CPU-only machine, through
  the CUDA plugin's compile-only target (`jmp_amp.tools.gpu_target`, the
  ``gpu-audit`` extra; start Python with ``JAX_PLATFORMS=cpu``), at XLA's
  default options (``--gemm cublas``: Triton GEMMs off, labelled so in the
  JSON's ``env.target``, for the update cases). CPU seconds of the compiler,
  not GPU timings.
* ``--target gpu`` (``gpt16-features`` or ``gpt16-scanned-features`` only):
  on the local GPU, wall seconds, each compile cold in a process of its own
  (XLA:GPU keeps its GEMM autotuning for the life of a process).

The JSON's ``target`` names what was compiled: ``compile`` (XLA:CPU),
``compile-h100`` or ``compile-gpu``.

Usage:
  python benchmarks/compile_time.py \\
      --json benchmarks/results/compile_time_cpu.json
  JAX_PLATFORMS=cpu python benchmarks/compile_time.py --target h100 \\
      --json benchmarks/results/compile_time_h100.json
  python benchmarks/compile_time.py --workloads gpt16-features --rounds 3 \\
      --json benchmarks/results/compile_time_features_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import optax

import jmp_amp
from jmp_amp.tools.bench import timing

# pylint: disable=g-import-not-at-top,wrong-import-position
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import overhead  # this script's directory: the optimizers, the environment

# Compile-time cases: an update over many 8x8 float32 leaves (optimizer,
# number of leaves), and the whole train step of the reference GPT with 24
# unscanned blocks (292 leaves, float16 compute, Adam): what a user waits for.
COMPILE_CASES = {"adam300": ("adam", 300), "sgd1000": ("sgd", 1000),
                 "gpt24": ("adam", None)}


def _cpu_seconds():
  """Process time of this process and its finished children (ptxas)."""
  return sum(os.times()[:4])


def _update_step(opt, leaves):
  """One update plus apply_updates over `leaves` 8x8 leaves, and its args."""
  params = {f"p{i}": jnp.ones((8, 8)) for i in range(leaves)}

  def step(grads, state, params):
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state
  return step, (params, opt.init(params), params)


def _gpt_step(opt):
  """The GPT's whole train step (loss scaled when `opt` is loss_scaling's)."""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from jmp_amp.models import gpt  # pylint: disable=import-outside-toplevel
  graphdef, params = nnx.split(
      gpt.GPT(num_layers=24, dtype=jnp.float16, rngs=nnx.Rngs(0)), nnx.Param)
  tokens = jnp.zeros((8, 64), jnp.int32)
  state = opt.init(params)
  loss_fn = lambda p, t: gpt.lm_loss(nnx.merge(graphdef, p)(t), t)
  scaled = isinstance(state, jmp_amp.LossScalingState)

  def step(params, state, tokens):
    if scaled:
      loss, grads = jmp_amp.scaled_value_and_grad(loss_fn)(
          state, params, tokens)
    else:
      loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss
  return step, (params, state, tokens)


def compile_seconds(opt, leaves, target="cpu", gemm="default"):
  """CPU seconds to trace, lower and compile one step (an update over
  `leaves` leaves, or the GPT's train step if None), for this machine's CPU or
  (``target="h100"``) for an H100 through the compile-only target."""
  step, args = _gpt_step(opt) if leaves is None else _update_step(opt, leaves)
  jax.clear_caches()
  start = _cpu_seconds()
  if target == "h100":
    from jmp_amp.tools import gpu_target  # pylint: disable=import-outside-toplevel
    gpu_target.compile_for_gpu(step, *args, gemm=gemm)
  else:
    jax.jit(step).trace(*args).lower().compile()
  return _cpu_seconds() - start


def unscale_only(inner, scale):
  """The least a loss-scaling wrapper adds: the unscale and a scale in the
  state, with no finite check, no skip and no scale update (a floor for
  compile time, not a usable transformation)."""
  def init(params):
    return inner.init(params), jnp.asarray(scale, jnp.float32)

  def update(grads, state, params=None):
    inner_state, s = state
    grads = jax.tree.map(lambda g: g * (1 / s), grads)
    updates, inner_state = inner.update(grads, inner_state, params)
    return updates, (inner_state, s)

  return optax.GradientTransformation(init, update)


# The whole-step feature pairs (issue #33): the reference GPT, 16 unscanned
# blocks, d_model 128, 4 heads, vocab 1024, T 64, batch 8, adamw, trained by
# jmp_amp.flax.make_train_step; each feature against the step without it.
FEATURE_GPT = dict(vocab_size=1024, d_model=128, num_heads=4, num_layers=16,
                   max_len=64)
# feature -> (variant, the variant it is measured against).
FEATURE_PAIRS = {
    "loss scaling": ("loss scaling", "by hand (plain adamw)"),
    "16-bit state and params": ("16-bit state and params", "bf16"),
    "telemetry": ("telemetry", "bf16"),
    "fp8 current": ("fp8 current", "bf16"),
    "fp8 delayed": ("fp8 delayed", "bf16"),
    "fp8 rowwise": ("fp8 rowwise", "bf16"),
}


# Issue #33's limits on each ratio.
FEATURE_LIMITS = {"loss scaling": 1.15, "16-bit state and params": 1.3,
                  "telemetry": 1.3, "fp8 current": 1.3, "fp8 delayed": 1.3,
                  "fp8 rowwise": 1.5}
# feature -> a variant measured beside it as its floor (against the
# feature's own baseline). Loss scaling's: the step that checks every
# gradient for inf/NaN (for its ``grads_finite``) but neither skips on it nor
# scales, the least an exact skip must compile (the check reads every
# gradient before any update). 16-bit state's: the same 16-bit storage
# rounded to nearest, so the pair's cost splits into storing in 16 bits and
# rounding stochastically.
FEATURE_FLOORS = {"loss scaling": "finite check only",
                  "16-bit state and params": "16-bit, round to nearest"}


def _feature_step(variant, scan_layers=False, num_layers=None):
  """(jitted step, args) of `variant`'s whole GPT train step, to lower."""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from jmp_amp.models import gpt  # pylint: disable=import-outside-toplevel

  import jmp_amp.flax  # pylint: disable=import-outside-toplevel
  config = dict(FEATURE_GPT, scan_layers=scan_layers)
  if num_layers is not None:
    config["num_layers"] = num_layers
  model = gpt.GPT(**config, rngs=nnx.Rngs(0))
  tokens = jnp.zeros((8, 64), jnp.int32)
  loss_fn = lambda m, t: gpt.lm_loss(m(t), t)
  rules = jmp_amp.flax.mixed_rules("bfloat16")
  tx = optax.adamw(1e-3)
  scale = jmp_amp.NoOpLossScale()
  numerics = None
  skip = variant != "finite check only"
  if variant in ("16-bit state and params", "16-bit, round to nearest"):
    rounding = "nearest" if variant.endswith("nearest") else "stochastic"
    rules = jmp_amp.flax.mixed_rules("bfloat16", param="bfloat16",
                                     norms="p=bf16,c=f32,o=f32")
    tx = optax.chain(jmp_amp.optim.compress_state(tx, rounding=rounding),
                     jmp_amp.optim.low_precision_params(rounding))
  elif variant == "loss scaling":
    scale = jmp_amp.DynamicLossScale(overhead.INIT_SCALE)
  elif variant == "telemetry":
    numerics = "**"
  elif variant.startswith("fp8"):
    scaling = variant.removeprefix("fp8 ")
    # A stack's first and last layers cannot stay bf16 alone: all FP8.
    rules = {"*": jmp_amp.flax.fp8.FP8Policy(jmp_amp.fp8.FP8Recipe(
        scaling=scaling, history_len=16 if scaling == "delayed" else 1),
        keep_first_last=not scan_layers)}
  elif variant not in ("bf16", "by hand (plain adamw)", "finite check only"):
    raise ValueError(f"unknown variant {variant!r}")
  jmp_amp.flax.set_policies(model, rules, example_args=(tokens,))
  if variant == "by hand (plain adamw)":
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    state = tx.init(params)

    @jax.jit
    def hand(params, state, rest, tokens):
      def loss(p):
        return loss_fn(nnx.merge(graphdef, p, rest), tokens)
      value, grads = jax.value_and_grad(loss)(params)
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state, value
    return hand, (params, state, rest, tokens)
  optimizer = nnx.Optimizer(
      model, jmp_amp.loss_scaling(tx, scale, skip_nonfinite=skip),
      wrt=nnx.Param)
  step = jmp_amp.flax.make_train_step(loss_fn, numerics=numerics, jit=False)

  def pure(graphdef, state, tokens):
    m, o = nnx.merge(graphdef, state)
    metrics = step(m, o, tokens)
    return nnx.state((m, o)), metrics
  graphdef, state = nnx.split((model, optimizer))
  # Compiled as make_train_step compiles it: Triton GEMMs off for FP8.
  from jmp_amp.tools.bench import workloads  # pylint: disable=import-outside-toplevel
  options = workloads.step_compiler_options(model, platform="cuda")
  return (jax.jit(pure, static_argnums=0, compiler_options=options),
          (graphdef, state, tokens))


def feature_compile_seconds(variant, target="cpu", **kwargs):
  """CPU seconds to trace, lower and compile `variant`'s GPT train step."""
  jitted, args = _feature_step(variant, **kwargs)
  jax.clear_caches()
  start = _cpu_seconds()
  if target == "h100":
    from jmp_amp.tools import gpu_target  # pylint: disable=import-outside-toplevel
    # XLA's default GPU options under the step's own (FP8: Triton GEMMs
    # off), as a real GPU compiles make_train_step's step.
    gpu_target.compile_for_gpu(jitted, *args, gemm="default")
  else:
    jitted.trace(*args).lower().compile()
  return _cpu_seconds() - start


def feature_worker(variant, scan_layers=False):
  """One variant's step compiled cold on the local GPU, in this fresh
  process: prints its wall and CPU seconds as one JSON line. A small GEMM is
  compiled and run first, so that the device's start-up (its runtime,
  cuBLAS, the autotuner) is not counted."""
  import gpu_check  # pylint: disable=import-outside-toplevel  # beside this script
  gpu_check.warm_up()
  jitted, args = _feature_step(variant, scan_layers=scan_layers)
  wall, cpu = time.perf_counter(), _cpu_seconds()
  jitted.trace(*args).lower().compile()
  print(json.dumps({"variant": variant, "wall": time.perf_counter() - wall,
                    "cpu": _cpu_seconds() - cpu}), flush=True)


def _feature_in_process(variant, scan_layers, timeout=600):
  """(wall, CPU) seconds of `feature_worker(variant)` in a process of its
  own: XLA:GPU keeps its GEMM autotuning for the life of a process, so only
  a fresh one compiles as a user's first run does."""
  import subprocess  # pylint: disable=import-outside-toplevel
  out = subprocess.run(
      [sys.executable, os.path.abspath(__file__), "--feature-worker",
       variant] + (["--scan-layers"] if scan_layers else []),
      capture_output=True, text=True, timeout=timeout, check=True)
  record = json.loads(out.stdout.strip().splitlines()[-1])
  return record["wall"], record["cpu"]


# The feature workloads: the GPT's 16 blocks unrolled, or stacked under
# nnx.scan (how large models are compiled).
FEATURE_WORKLOADS = {"gpt16-features": False, "gpt16-scanned-features": True}


def feature_variants():
  """Every variant the feature workloads compile: both sides of each pair
  and each floor."""
  return sorted({v for pair in FEATURE_PAIRS.values() for v in pair}
                | set(FEATURE_FLOORS.values()))


def run_features(rounds, target="cpu", partial=None,
                 workload="gpt16-features", variants=None):
  """Each feature's whole-step compile time against the step without it
  (``target="gpu"``: wall seconds on the local GPU, each compile cold in a
  process of its own, CPU seconds beside them), and each floor beside its
  feature. `partial`, if given, gets the workload's report so far after
  each compile, so that a run stopped part-way keeps what it measured.
  `variants`, if given, compiles only these (more rounds of one pair in
  the same time); the report has the pairs and floors they make up."""
  scan_layers = FEATURE_WORKLOADS[workload]
  variants = sorted(variants or feature_variants())
  seconds = {name: [] for name in variants}
  cpu = {name: [] for name in variants} if target == "gpu" else None
  report = lambda: _features_report(seconds, cpu, rounds, workload)
  for r in range(rounds):
    for name in variants[r % len(variants):] + variants[:r % len(variants)]:
      if target == "gpu":
        wall, cpu_s = _feature_in_process(name, scan_layers)
        seconds[name].append(wall)
        cpu[name].append(cpu_s)
      else:
        seconds[name].append(feature_compile_seconds(
            name, target, scan_layers=scan_layers))
      print(f"  {name:28s} {seconds[name][-1]:6.2f} s", flush=True)
      if partial is not None:
        partial(report())
  final = report()
  for feature, pair in final["pairs"].items():
    print(f"features {feature:26s} {pair['ratio_best']:5.2f}x", flush=True)
  for feature, floor in final["floors"].items():
    print(f"floor    {floor['variant']:26s} {floor['ratio_best']:5.2f}x",
          flush=True)
  return final


def _features_report(seconds, cpu, rounds, workload="gpt16-features"):
  """A feature workload's report from the seconds measured so far (a pair,
  or a floor, once both of its variants have been compiled)."""
  results = {name: {"seconds_best": min(t), "seconds_all": t}
             for name, t in seconds.items() if t}
  for name in results if cpu is not None else ():
    results[name]["cpu_seconds_all"] = cpu[name]
  ratio = lambda a, b: (results[a]["seconds_best"]
                        / results[b]["seconds_best"])
  pairs = {feature: {"with": with_, "without": without,
                     "ratio_best": ratio(with_, without),
                     "limit": FEATURE_LIMITS[feature]}
           for feature, (with_, without) in FEATURE_PAIRS.items()
           if with_ in results and without in results}
  floors = {}
  for feature, floor in FEATURE_FLOORS.items():
    without = FEATURE_PAIRS[feature][1]
    if floor in results and without in results:
      floors[feature] = {"variant": floor, "without": without,
                         "ratio_best": ratio(floor, without)}
  blocks = ("16 blocks stacked by nnx.vmap and run under nnx.scan (FP8: "
            "every layer, keep_first_last=False)"
            if FEATURE_WORKLOADS[workload] else "16 unscanned blocks")
  return {"workload": workload, "optimizer": "adamw",
          "step": f"GPT train step (jmp_amp.flax.make_train_step): {blocks}, "
                  "d_model 128, 4 heads, vocab 1024, batch 8 x 64 tokens, "
                  "mixed bfloat16",
          "rounds": rounds, "results": results, "pairs": pairs,
          "floors": floors}


def run_scanned(rounds, target="cpu", depths=(4, 24)):
  """The scanned GPT's bf16 train step at each depth, against unscanned."""
  results = {}
  for depth in depths:
    for scan in (True, False):
      name = f"{'scanned' if scan else 'unscanned'} {depth} blocks"
      times = [feature_compile_seconds("bf16", target, scan_layers=scan,
                                       num_layers=depth)
               for _ in range(rounds)]
      results[name] = {"seconds_best": min(times), "seconds_all": times}
      print(f"  {name:28s} {min(times):6.2f} s", flush=True)
  return {"workload": "gpt-scanned", "optimizer": "adamw",
          "step": "bf16 GPT train step, d_model 128, 4 heads, vocab 1024, "
                  "batch 8 x 64 tokens, blocks under nnx.scan or unrolled",
          "rounds": rounds, "results": results}


def run_compile(case, rounds, target="cpu", gemm="default"):
  """Compile time of each variant against bare optax, interleaved rounds."""
  opt_name, leaves = COMPILE_CASES[case]
  inner = lambda: overhead.make_optax(opt_name, 1e-3)
  variants = {
      "optax": inner,
      "jmp_amp dynamic": lambda: jmp_amp.loss_scaling(
          inner(), jmp_amp.DynamicLossScale(overhead.INIT_SCALE)),
      "optax apply_if_finite": lambda: optax.apply_if_finite(inner(), 10),
  }
  if leaves is not None:  # the floor takes the update's gradients as scaled.
    variants["unscale only (floor)"] = lambda: unscale_only(
        inner(), overhead.INIT_SCALE)
  seconds = {name: [] for name in variants}
  for r in range(rounds):
    names = list(variants)
    for name in names[r % len(names):] + names[:r % len(names)]:
      seconds[name].append(compile_seconds(variants[name](), leaves, target,
                                           gemm))
  results = {}
  for name, times in seconds.items():
    ratios = [t / b for t, b in zip(times, seconds["optax"])]
    results[name] = {"seconds_median": statistics.median(times),
                     "ratio_median": statistics.median(ratios)}
    print(f"{case:8s} {name:24s} {statistics.median(times):6.2f} s  "
          f"{statistics.median(ratios):5.2f}x", flush=True)
  shape = ({"leaves": leaves, "leaf_shape": [8, 8]} if leaves is not None else
           {"step": "GPT train step: 24 unscanned blocks, 292 leaves, "
                    "float16 compute, batch 8 x 64 tokens"})
  return {"workload": case, "optimizer": opt_name, **shape, "rounds": rounds,
          "results": results}


# --target -> the JSON's target, as the files written before this script
# split from overhead.py name it.
TARGETS = {"cpu": "compile", "h100": "compile-h100", "gpu": "compile-gpu"}


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--target", choices=sorted(TARGETS), default="cpu")
  ap.add_argument("--workloads", default=None,
                  help="comma-separated, of " + ", ".join(
                      [*COMPILE_CASES, *FEATURE_WORKLOADS, "gpt-scanned"])
                  + "; default the update and GPT cases")
  ap.add_argument("--variants", default=None,
                  help="feature workloads: comma-separated variants to "
                       "compile (default all)")
  ap.add_argument("--rounds", type=int, default=15)
  ap.add_argument("--json", default=None)
  ap.add_argument("--gemm", choices=("default", "cublas"), default="default",
                  help="h100: XLA's default options (Triton GEMMs) or cublas "
                       "(Triton GEMMs off, labelled)")
  ap.add_argument("--feature-worker", help=argparse.SUPPRESS)
  ap.add_argument("--scan-layers", action="store_true", help=argparse.SUPPRESS)
  a = ap.parse_args(argv)
  with timing.cold_compiles():  # a round's compile is never a disk read
    return _run(a)


def _run(a):
  if a.feature_worker:
    feature_worker(a.feature_worker, a.scan_layers)
    return 0
  device = a.target
  target = TARGETS[device]
  workloads = (a.workloads or ",".join(COMPILE_CASES)).split(",")
  for w in workloads:
    if w not in (*COMPILE_CASES, *FEATURE_WORKLOADS, "gpt-scanned"):
      raise SystemExit(f"unknown workload {w!r}: --workloads takes "
                       + ", ".join([*COMPILE_CASES, *FEATURE_WORKLOADS,
                                    "gpt-scanned"]))
  if device == "gpu" and a.workloads not in FEATURE_WORKLOADS:
    raise SystemExit("--target gpu measures --workloads "
                     + " or ".join(FEATURE_WORKLOADS) + " only")
  variants = a.variants.split(",") if a.variants else None
  if variants and a.workloads not in FEATURE_WORKLOADS:
    raise SystemExit("--variants needs --workloads "
                     + " or ".join(FEATURE_WORKLOADS))
  unknown = sorted(set(variants or ()) - set(feature_variants()))
  if unknown:
    raise SystemExit(f"unknown --variants {', '.join(map(repr, unknown))}: "
                     "it takes " + ", ".join(feature_variants()))
  report = {"env": overhead.environment(target, a.gemm), "target": target,
            "workloads": []}
  if device == "gpu":
    report["env"]["device"] = jax.devices()[0].device_kind
  whole_step = a.workloads in (*FEATURE_WORKLOADS, "gpt-scanned")
  if whole_step and device != "cpu":
    # FP8 variants compile as make_train_step compiles them on a CUDA GPU.
    report["env"]["target"] = report["env"]["target"].replace(
        "XLA's default options", "XLA's default options, FP8 variants with "
        "Triton GEMMs off (fp8_gemm_options, as make_train_step compiles "
        "them)")
    report["env"]["fp8_gemm_options"] = jmp_amp.fp8.compiler_options(
        platform="cuda")
  report["method"] = (
      "wall seconds of jax.jit(step).trace().lower().compile() of each "
      "variant's whole GPT train step on the local GPU at XLA's default "
      "options (FP8 variants with Triton GEMMs off, as make_train_step "
      "compiles them), each compile cold in a fresh process after one "
      "small GEMM (the device's start-up not counted), CPU seconds beside "
      "them; variants interleaved in rounds (order rotating); ratio of the "
      "best times of each pair" if device == "gpu" else
      "CPU time (process and children) of jax.jit(step).trace().lower()"
      + (".compile() of each variant's whole GPT train step, " if whole_step
         else ".compile() for one update plus apply_updates, ")
      + ("compiled for an H100 through the CUDA plugin's compile-only "
         "target on a machine without a GPU, " if device == "h100" else "")
      + ("FP8 variants with Triton GEMMs off, as make_train_step compiles "
         "them; " if whole_step else "")
      + "caches cleared before each; variants interleaved in rounds (order "
      + ("rotating); ratio of the best times of each pair" if whole_step
         else "rotating); ratio to bare optax taken within a round, median "
         "over rounds"))
  for w in workloads:
    if w in FEATURE_WORKLOADS:
      done = list(report["workloads"])
      report["workloads"].append(run_features(
          a.rounds, device, partial=lambda wl, done=done: overhead.write(
              a.json, dict(report, workloads=done + [wl])), workload=w,
          variants=variants))
    elif w == "gpt-scanned":
      report["workloads"].append(run_scanned(a.rounds, device))
    else:
      report["workloads"].append(run_compile(w, a.rounds, device, a.gemm))
  overhead.write(a.json, report)
  return 0


if __name__ == "__main__":
  sys.exit(main())
