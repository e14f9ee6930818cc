"""What dynamic loss scaling costs: jmp_amp against bare optax and the peers.

Side by side in one process, on the same model, data and optimizer:

* ``optax``: the bare optimizer (no scaling, no finite check);
* ``jmp_amp noop``: `jmp_amp.loss_scaling` with `NoOpLossScale` (the bfloat16
  path: finite check and skip only);
* ``jmp_amp dynamic``: `jmp_amp.loss_scaling` with `DynamicLossScale` (its
  default skip mechanism for the backend: ``lax.cond`` on CPU, selects on GPU),
  and on CPU also with the other mechanism (``select``), for comparison;
* ``jmp by hand``: jmp 0.0.4's README recipe (``unscale``, ``all_finite``,
  ``adjust``, ``select_tree`` over params and optimizer state);
* ``flax DynamicScale``: `flax.training.dynamic_scale.DynamicScale`, as in
  Flax's ImageNet example (``jnp.where`` over params and optimizer state);
* ``optax apply_if_finite``: `optax.apply_if_finite` (skips, does not scale);
* ``keras LossScaleOptimizer``: Keras 3 on the jax backend, through
  ``stateless_apply`` (its inner optimizer is Keras's own, so its time also
  differs from optax's for reasons that have nothing to do with scaling:
  ``keras bare`` is that inner optimizer alone);
* ``torch`` and ``torch GradScaler`` (timed targets): the same model in
  PyTorch (on a GPU under ``torch.autocast`` to float16).

Workloads: ``adam20m``, an MLP of five 2048x2048 layers (21 M params), batch
8, Adam; ``seed``, the PyTorch AMP recipe's MLP (3 x 4096x4096, batch 512,
SGD). Both compute in float16 with float32 master params. On the CPU the seed
step is far too slow at full size (float16 matmuls have no fast path in
XLA:CPU), so ``--target cpu`` times ``seed-cpu``: width 1024, batch 128.

Targets:

* ``--target cpu`` (the default): step time in interleaved rounds (every
  variant runs ``--steps`` steps per round, in an order that rotates; the
  ratio to ``optax`` is taken within each round, then the median and the
  quartiles over rounds), plus XLA:CPU's compiled temp memory and its
  estimate of bytes accessed.
* ``--target gpu``: the same timing on the local GPU (``adam20m`` and the
  full-size ``seed``); temp memory and bytes from XLA:GPU's compiled
  figures.
* ``--target h100``: no timing. Compiles each step for an H100 on this
  CPU-only machine (`jmp_amp.gpu_report`'s compile-only target, the
  ``gpu-audit`` extra) and reports kernels, GEMMs, temp memory and an
  estimate of the bytes the kernels move: compiler facts, not timings.
  XLA's default options (Triton GEMMs, untuned since no GPU autotunes
  here); ``--gemm cublas`` turns Triton GEMMs off
  (``xla_gpu_enable_triton_gemm=False``) and the JSON's ``env.target``
  says so.

Compile time, of one update and of whole train steps with and without each
feature, is measured by `compile_time.py`, beside this script.

Usage:
  python benchmarks/overhead.py --json benchmarks/results/overhead_cpu.json
  python benchmarks/overhead.py --target gpu --rounds 15 --steps 20 \
      --json benchmarks/results/overhead_gpu_h100.json
  JAX_PLATFORMS=cpu python benchmarks/overhead.py --target h100 \\
      --json benchmarks/results/overhead_h100.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable, NamedTuple

os.environ.setdefault("KERAS_BACKEND", "jax")

# pylint: disable=g-import-not-at-top,wrong-import-position
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_amp

INIT_SCALE = 2.0**15
PERIOD = 2000

WORKLOADS = {
    # name: (widths, batch, optimizer, learning rate)
    "adam20m": ((2048,) * 6, 8, "adam", 1e-4),
    "seed": ((4096,) * 4, 512, "sgd", 1e-3),
    "seed-cpu": ((1024,) * 4, 128, "sgd", 1e-3),
}


# --------------------------------------------------------------------------
# The model: a plain-JAX MLP, float32 params, float16 compute.


def init_params(widths, seed=0):
  rng = np.random.default_rng(seed)
  return [{"w": jnp.asarray(rng.normal(size=(i, o)) / np.sqrt(i), jnp.float32),
           "b": jnp.zeros((o,), jnp.float32)}
          for i, o in zip(widths[:-1], widths[1:])]


def loss_fn(params, batch, dtype=jnp.float16):
  x, y = batch
  h = x.astype(dtype)
  for n, p in enumerate(params):
    h = h @ p["w"].astype(dtype) + p["b"].astype(dtype)
    if n < len(params) - 1:
      h = jax.nn.relu(h)
  return jnp.mean((h.astype(jnp.float32) - y) ** 2)


def make_batch(widths, batch, seed=1):
  rng = np.random.default_rng(seed)
  return (jnp.asarray(rng.normal(size=(batch, widths[0])), jnp.float32),
          jnp.asarray(rng.normal(size=(batch, widths[-1])), jnp.float32))


def make_optax(name, lr):
  return optax.adam(lr) if name == "adam" else optax.sgd(lr)


# --------------------------------------------------------------------------
# Variants: each is (init(params) -> state, step(state, batch) -> state).
# Every step returns (state, skipped), `skipped` 1 if the step was skipped.


class Variant(NamedTuple):
  init: Callable[[Any], Any]
  step: Callable[[Any, Any], Any]


def v_optax(opt_name, lr):
  tx = make_optax(opt_name, lr)

  def step(state, batch):
    params, opt_state = state
    grads = jax.grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), jnp.int32(0)
  return Variant(lambda p: (p, tx.init(p)), step)


def v_jmp_amp(opt_name, lr, loss_scale, **kwargs):
  tx = jmp_amp.loss_scaling(make_optax(opt_name, lr), loss_scale, **kwargs)

  def step(state, batch):
    params, opt_state = state
    _, grads = jmp_amp.scaled_value_and_grad(loss_fn)(opt_state, params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return ((optax.apply_updates(params, updates), opt_state),
            jnp.logical_not(opt_state.grads_finite).astype(jnp.int32))
  return Variant(lambda p: (p, tx.init(p)), step)


def v_jmp(opt_name, lr):
  import jmp  # pylint: disable=import-outside-toplevel
  tx = make_optax(opt_name, lr)

  def init(params):
    return params, tx.init(params), jmp.DynamicLossScale(
        jnp.float32(INIT_SCALE), period=PERIOD)

  def step(state, batch):
    params, opt_state, loss_scale = state
    grads = jax.grad(lambda p: loss_scale.scale(loss_fn(p, batch)))(params)
    grads = loss_scale.unscale(grads)
    finite = jmp.all_finite(grads)
    loss_scale = loss_scale.adjust(finite)
    updates, new_opt_state = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    params, opt_state = jmp.select_tree(
        finite, (new_params, new_opt_state), (params, opt_state))
    return (params, opt_state, loss_scale), jnp.logical_not(finite).astype(
        jnp.int32)
  return Variant(init, step)


def v_flax(opt_name, lr):
  from flax.training import dynamic_scale  # pylint: disable=import-outside-toplevel
  tx = make_optax(opt_name, lr)

  def init(params):
    return params, tx.init(params), dynamic_scale.DynamicScale(
        growth_interval=PERIOD, scale=INIT_SCALE)

  def step(state, batch):
    params, opt_state, ds = state
    ds, finite, _, grads = ds.value_and_grad(loss_fn)(params, batch)
    updates, new_opt_state = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    select = functools.partial(jnp.where, finite)
    params = jax.tree_util.tree_map(select, new_params, params)
    opt_state = jax.tree_util.tree_map(select, new_opt_state, opt_state)
    return (params, opt_state, ds), jnp.logical_not(finite).astype(jnp.int32)
  return Variant(init, step)


def v_apply_if_finite(opt_name, lr):
  tx = optax.apply_if_finite(make_optax(opt_name, lr),
                             max_consecutive_errors=1_000_000)

  def step(state, batch):
    params, opt_state = state
    grads = jax.grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return ((optax.apply_updates(params, updates), opt_state),
            jnp.logical_not(opt_state.last_finite).astype(jnp.int32))
  return Variant(lambda p: (p, tx.init(p)), step)


def _keras_optimizer(opt_name, lr, scaled):
  import keras  # pylint: disable=import-outside-toplevel
  inner = (keras.optimizers.Adam(learning_rate=lr) if opt_name == "adam"
           else keras.optimizers.SGD(learning_rate=lr))
  if scaled:
    return keras.optimizers.LossScaleOptimizer(
        inner, initial_scale=INIT_SCALE, dynamic_growth_steps=PERIOD)
  return inner


def v_keras(opt_name, lr, scaled=True):
  """Keras 3 (jax backend): a stateless step over the same params pytree."""
  import keras  # pylint: disable=import-outside-toplevel
  holder = {}

  def init(params):
    leaves, treedef = jax.tree_util.tree_flatten(params)
    variables = [keras.Variable(np.asarray(x)) for x in leaves]
    opt = _keras_optimizer(opt_name, lr, scaled)
    opt.build(variables)
    holder.update(opt=opt, treedef=treedef)
    return leaves, [jnp.asarray(v.value) for v in opt.variables]

  def step(state, batch):
    leaves, opt_vars = state
    opt, treedef = holder["opt"], holder["treedef"]

    def scaled_loss(leaves):
      loss = loss_fn(jax.tree_util.tree_unflatten(treedef, leaves), batch)
      if not scaled:
        return loss
      mapping = list(zip(opt.variables, opt_vars))
      with keras.StatelessScope(state_mapping=mapping):
        return opt.scale_loss(loss)
    grads = jax.grad(scaled_loss)(leaves)
    new_leaves, new_vars = opt.stateless_apply(opt_vars, grads, leaves)
    skipped = jnp.int32(0)
    if scaled:
      skipped = jnp.all(jnp.stack([jnp.all(a == b) for a, b in zip(
          new_leaves, leaves)])).astype(jnp.int32)
    return (list(new_leaves), list(new_vars)), skipped
  return Variant(init, step)


def jax_variants(opt_name, lr, target):
  """name -> zero-argument builder of a Variant."""
  dyn = lambda: jmp_amp.DynamicLossScale(INIT_SCALE, period=PERIOD)
  variants = {
      "optax": lambda: v_optax(opt_name, lr),
      "jmp_amp noop": lambda: v_jmp_amp(opt_name, lr, jmp_amp.NoOpLossScale()),
      "jmp_amp dynamic": lambda: v_jmp_amp(opt_name, lr, dyn()),
  }
  # "auto" picks per backend (and on CPU by the optimizer state's size);
  # the forced mechanisms show what it chose between.
  for skip_with in ("cond", "select"):
    variants[f"jmp_amp dynamic ({skip_with})"] = (
        lambda skip_with=skip_with: v_jmp_amp(opt_name, lr, dyn(),
                                              skip_with=skip_with))
  variants.update({
      "jmp by hand": lambda: v_jmp(opt_name, lr),
      "flax DynamicScale": lambda: v_flax(opt_name, lr),
      "optax apply_if_finite": lambda: v_apply_if_finite(opt_name, lr),
      "keras bare": lambda: v_keras(opt_name, lr, scaled=False),
      "keras LossScaleOptimizer": lambda: v_keras(opt_name, lr),
  })
  return variants


# --------------------------------------------------------------------------
# torch (CPU).


def torch_steps(widths, batch, opt_name, lr, device="cpu"):
  """{"torch": step, "torch GradScaler": step}, each a zero-arg callable.

  On "cuda" both steps run under `torch.autocast` to float16, as the JAX
  variants compute in float16; on the CPU they stay float32 (PyTorch's CPU
  autocast to float16 has no fast kernels either).
  """
  import torch  # pylint: disable=import-outside-toplevel
  torch.manual_seed(0)
  torch.set_num_threads(max(1, os.cpu_count() or 1))
  x, y = (torch.from_numpy(np.asarray(a)).to(device)
          for a in make_batch(widths, batch))
  autocast = lambda: torch.autocast(device, dtype=torch.float16,
                                    enabled=device == "cuda")

  def model():
    layers = []
    for n, (i, o) in enumerate(zip(widths[:-1], widths[1:])):
      layers.append(torch.nn.Linear(i, o))
      if n < len(widths) - 2:
        layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers).to(device)

  def optimizer(net):
    if opt_name == "adam":
      return torch.optim.Adam(net.parameters(), lr=lr)
    return torch.optim.SGD(net.parameters(), lr=lr)

  def bare():
    net = model()
    opt = optimizer(net)

    def step():
      with autocast():
        loss = torch.nn.functional.mse_loss(net(x).float(), y)
      loss.backward()
      opt.step()
      opt.zero_grad(set_to_none=True)
    return step

  def scaled():
    net = model()
    opt = optimizer(net)
    scaler = torch.amp.GradScaler(device, init_scale=INIT_SCALE,
                                  growth_interval=PERIOD)

    def step():
      with autocast():
        loss = torch.nn.functional.mse_loss(net(x).float(), y)
      scaler.scale(loss).backward()
      scaler.step(opt)
      scaler.update()
      opt.zero_grad(set_to_none=True)
    return step

  return {"torch": bare(), "torch GradScaler": scaled()}


# --------------------------------------------------------------------------
# CPU timing.


def _flat_jit(variant, params):
  """The jitted step over the state's leaves, and those leaves.

  Flat, because jmp's DynamicLossScale cannot be rebuilt from the
  placeholders `jit(...).lower` flattens and unflattens.
  """
  state = variant.init(jax.tree_util.tree_map(jnp.copy, params))
  leaves, treedef = jax.tree_util.tree_flatten(state)

  def step(leaves, batch):
    new, skipped = variant.step(
        jax.tree_util.tree_unflatten(treedef, leaves), batch)
    return jax.tree_util.tree_leaves(new), skipped
  return leaves, jax.jit(step, donate_argnums=0)


def _cpu_compiled_figures(jitted, state, batch):
  compiled = jitted.lower(state, batch).compile()
  mem = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  if isinstance(cost, list):
    cost = cost[0] if cost else {}
  return {"temp_bytes": int(mem.temp_size_in_bytes),
          "bytes_accessed": float((cost or {}).get("bytes accessed", 0.0))}


def run_cpu(workload, rounds, steps, skip=(), device="cpu"):
  widths, batch_size, opt_name, lr = WORKLOADS[workload]
  batch = make_batch(widths, batch_size)
  params = init_params(widths)
  runners, figures, errors, skipped_total = {}, {}, {}, {}

  for name, build in jax_variants(opt_name, lr, "cpu").items():
    if name in skip:
      continue
    try:
      variant = build()
      state, jitted = _flat_jit(variant, params)
      figures[name] = _cpu_compiled_figures(jitted, state, batch)
    except Exception as e:  # pylint: disable=broad-except
      errors[name] = f"{type(e).__name__}: {e}"[:300]
      continue
    box = {"state": state, "skipped": 0}

    def run(n, box=box, jitted=jitted):
      skipped = []
      for _ in range(n):
        box["state"], s = jitted(box["state"], batch)
        skipped.append(s)
      jax.block_until_ready(box["state"])
      box["skipped"] += int(sum(int(s) for s in skipped))
    run(2)  # compile and warm up
    box["skipped"] = 0
    runners[name] = run
    skipped_total[name] = box

  if "torch" not in skip:
    try:
      import torch  # pylint: disable=import-outside-toplevel
      for name, step in torch_steps(widths, batch_size, opt_name, lr,
                                    device).items():
        def run(n, step=step):
          for _ in range(n):
            step()
          if device == "cuda":
            torch.cuda.synchronize()
        run(2)
        runners[name] = run
    except Exception as e:  # pylint: disable=broad-except
      errors["torch"] = f"{type(e).__name__}: {e}"[:300]

  names = list(runners)
  times = {name: [] for name in names}
  for r in range(rounds):
    order = names[r % len(names):] + names[:r % len(names)]
    for name in order:
      t0 = time.perf_counter()
      runners[name](steps)
      times[name].append((time.perf_counter() - t0) / steps)

  def ratios(name, base):
    return [a / b for a, b in zip(times[name], times[base])]

  results = {}
  for name in names:
    base = "torch" if name.startswith("torch") else "optax"
    rs = ratios(name, base)
    q = statistics.quantiles(rs, n=4) if len(rs) >= 2 else [rs[0]] * 3
    row = {
        "ms_per_step_median": 1e3 * statistics.median(times[name]),
        "ratio_vs": base,
        "time_ratio_median": statistics.median(rs),
        "time_ratio_q1": q[0],
        "time_ratio_q3": q[2],
    }
    if name.startswith("keras LossScale"):
      rk = ratios(name, "keras bare") if "keras bare" in times else None
      if rk:
        row["time_ratio_vs_keras_bare_median"] = statistics.median(rk)
    if name in figures:
      row.update(figures[name])
      row["temp_ratio"] = (figures[name]["temp_bytes"]
                           / max(1, figures["optax"]["temp_bytes"]))
      row["bytes_ratio"] = (figures[name]["bytes_accessed"]
                            / max(1.0, figures["optax"]["bytes_accessed"]))
    if name in skipped_total:
      row["skipped_steps"] = skipped_total[name]["skipped"]
    results[name] = row
  return {"workload": workload, "widths": list(widths), "batch": batch_size,
          "optimizer": opt_name, "params": int(sum(
              x.size for x in jax.tree_util.tree_leaves(params))),
          "rounds": rounds, "steps_per_round": steps, "results": results,
          "errors": errors}


# --------------------------------------------------------------------------
# H100, compiled on this CPU-only machine (no GPU, no timing).


def run_h100(workload, skip=(), dump=None, gemm="default"):
  from jmp_amp.tools import gpu_target  # pylint: disable=import-outside-toplevel
  widths, batch_size, opt_name, lr = WORKLOADS[workload]
  spec = lambda t: jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), t)
  params = init_params_shapes(widths)
  batch = spec(jax.eval_shape(lambda: (
      jnp.zeros((batch_size, widths[0])), jnp.zeros((batch_size, widths[-1])))))
  results, errors = {}, {}
  for name, build in jax_variants(opt_name, lr, "h100").items():
    if name in skip or name == "keras bare":
      continue
    try:
      variant = build()
      state = variant.init(params if not name.startswith("keras")
                           else init_params(widths))
      leaves, treedef = jax.tree_util.tree_flatten(state)

      def flat_step(leaves, batch, variant=variant, treedef=treedef):
        new, skipped = variant.step(
            jax.tree_util.tree_unflatten(treedef, leaves), batch)
        return jax.tree_util.tree_leaves(new), skipped
      compiled = gpu_target.compile_for_gpu(flat_step, spec(leaves), batch,
                                            donate_argnums=(0,), gemm=gemm)
      if dump:
        with open(os.path.join(dump, f"{workload}_{name.replace(' ', '_')}"
                               ".hlo.txt"), "w") as f:
          f.write(compiled.as_text())
      report = gpu_target.report_from_compiled(compiled, gemm=gemm)
    except Exception as e:  # pylint: disable=broad-except
      errors[name] = f"{type(e).__name__}: {e}"[:300]
      continue
    results[name] = {
        "kernels": report.kernels,
        "kernels_by_kind": dict(report.kernels_by_kind),
        "gemms": len(report.matmuls),
        "temp_bytes": report.memory["temp_bytes"],
        "bytes_estimate": report.bytes_estimate,
    }
  base = results.get("optax")
  if base:
    for row in results.values():
      row["kernels_added"] = row["kernels"] - base["kernels"]
      row["bytes_ratio"] = (row["bytes_estimate"]
                            / max(1, base["bytes_estimate"]))
      row["temp_ratio"] = row["temp_bytes"] / max(1, base["temp_bytes"])
  return {"workload": workload, "widths": list(widths), "batch": batch_size,
          "optimizer": opt_name, "results": results, "errors": errors}


def init_params_shapes(widths):
  return [{"w": jnp.zeros((i, o), jnp.float32),
           "b": jnp.zeros((o,), jnp.float32)}
          for i, o in zip(widths[:-1], widths[1:])]


# --------------------------------------------------------------------------


def environment(target, gemm="default"):
  env = {"jax": jax.__version__, "optax": optax.__version__,
         "backend": jax.default_backend(),
         "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, "
                    f"{platform.processor() or platform.platform()}",
         "python": platform.python_version()}
  for mod in ("flax", "jmp", "keras", "torch"):
    try:
      env[mod] = __import__(mod).__version__
    except Exception:  # pylint: disable=broad-except
      env[mod] = None
  if target == "gpu":
    env["device"] = jax.devices()[0].device_kind
  if target in ("h100", "compile-h100"):
    from jmp_amp.tools import gpu_target  # pylint: disable=import-outside-toplevel
    env["target"] = ("H100 SXM, " + gpu_target.label("h100", gemm)
                     if target == "h100" else
                     "H100 SXM, compiled on a CPU-only machine (no GPU), "
                     + gpu_target.label("h100", gemm).split(", ", 2)[2]
                     .split(":")[0] + ": CPU seconds to compile, no GPU "
                     "timings")
    env["gemm"] = gemm
    env["gemm_options"] = gpu_target.GEMM_BACKENDS[gemm]
  if target != "h100":
    try:
      with open("/proc/cpuinfo") as f:
        models = [l.split(":", 1)[1].strip() for l in f
                  if l.startswith("model name")]
      if models:
        env["cpu"] = models[0]
    except OSError:
      pass
  return env


def print_rows(report):
  for wl in report["workloads"]:
    print(f"\n== {wl['workload']} ({wl.get('params', '')} params, "
          f"batch {wl['batch']}, {wl['optimizer']})")
    for name, row in wl["results"].items():
      cells = [f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
               for k, v in row.items() if k != "kernels_by_kind"]
      print(f"  {name:28} " + " ".join(cells))
    for name, err in wl["errors"].items():
      print(f"  {name:28} ERROR {err}")


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--target",
                  choices=["cpu", "gpu", "h100"],
                  default="cpu")
  ap.add_argument("--workloads", default=None,
                  help="comma-separated; default adam20m,seed-cpu (cpu) or "
                       "adam20m,seed (h100)")
  ap.add_argument("--rounds", type=int, default=15)
  ap.add_argument("--steps", type=int, default=3)
  ap.add_argument("--skip", default="", help="comma-separated variant names")
  ap.add_argument("--json", default=None)
  ap.add_argument("--dump", default=None,
                  help="h100: directory for the optimized HLO of each step")
  ap.add_argument("--gemm", choices=("default", "cublas"), default="default",
                  help="h100: XLA's default options (Triton GEMMs) or cublas "
                       "(Triton GEMMs off, labelled)")
  a = ap.parse_args(argv)
  skip = tuple(s for s in a.skip.split(",") if s)
  default = "adam20m,seed-cpu" if a.target == "cpu" else "adam20m,seed"
  workloads = (a.workloads or default).split(",")
  report = {"env": environment(a.target, a.gemm), "target": a.target,
            "workloads": []}
  if a.target in ("cpu", "gpu"):
    report["method"] = (
        "interleaved rounds in one process; each round runs every variant for "
        f"{a.steps} steps (order rotating); ratios taken within a round, "
        "median and quartiles over rounds; temp/bytes from XLA:CPU's "
        "compiled memory_analysis/cost_analysis")
    for w in workloads:
      report["workloads"].append(run_cpu(
          w, a.rounds, a.steps, skip,
          device="cuda" if a.target == "gpu" else "cpu"))
      print_rows({"workloads": report["workloads"][-1:]})
  else:
    report["method"] = (
        "compiled for an H100 without a GPU (jmp_amp.tools.gpu_target, "
        + ("XLA's default options: Triton GEMMs, untuned" if a.gemm ==
           "default" else "Triton GEMMs off: cuBLAS GEMMs")
        + ", donated state); kernels = launches of the optimized HLO "
        "(fusions, library calls, unfused ops; a loop body once); "
        "bytes_estimate = every kernel reads its operands and writes its "
        "result once. Compiler figures, not timings.")
    for w in workloads:
      report["workloads"].append(run_h100(w, skip, a.dump, a.gemm))
      print_rows({"workloads": report["workloads"][-1:]})
  write(a.json, report)
  return 0


def write(path, report):
  """`report` as JSON at `path` (nothing without a path)."""
  if not path:
    return
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(report, f, indent=1, sort_keys=False)
    f.write("\n")


if __name__ == "__main__":
  sys.exit(main())
