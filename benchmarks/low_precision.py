#!/usr/bin/env python3
"""16-bit optimizer state and master weights: memory, accuracy and cost.

Writes benchmarks/results/low_precision.json (each part updates its own key):

* ``--part memory`` (needs the ``gpu-audit`` extra, no GPU): GPT train steps
  compiled for an H100 with `jmp_amp.gpu_report`, bf16 compute in all rows:
  float32 master weights + float32 AdamW moments against bfloat16 params +
  bfloat16 moments (`jmp_amp.optim`), with stochastic rounding, Kahan
  compensation or round-to-nearest: argument + temp bytes, and the bytes the
  kernels move. Two shapes: state-dominated (batch 2 x 256 tokens, where the
  persistent state is most of the memory: large models, small micro-batches)
  and the GPT of benchmarks/h100_compiled.py (batch 16 x 1024 tokens, where
  activations dominate). Compiler figures, not timings, with XLA's default
  options (Triton GEMMs, untuned since no GPU autotunes here); ``--gemm
  cublas`` turns Triton GEMMs off (``xla_gpu_enable_triton_gemm=False``) and
  writes the key ``memory_cublas``, labelled so.
* ``--part accuracy`` (CPU): scikit-learn's digits (MLP, Adam with a cosine
  schedule, mean over seeds) and a small GPT on the arithmetic-progression
  tokens of `jmp_amp.models.data.token_batch`, each trained with float32
  master weights and moments, and with bfloat16 params and moments rounded
  stochastically, with Kahan compensation, or to nearest.
* ``--part cost`` (CPU): step time of the small GPT with stochastic rounding
  against round-to-nearest, interleaved in one process (median of rounds).

    # in the venv with the gpu-audit extra:
    JAX_PLATFORMS=cpu python benchmarks/low_precision.py --part memory
    python benchmarks/low_precision.py --part accuracy
    python benchmarks/low_precision.py --part cost
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

# pylint: disable=g-import-not-at-top,wrong-import-position
import jax
import jax.numpy as jnp
from jmp_amp.models import data as data_lib
import numpy as np
import optax

import jmp_amp
from jmp_amp import optim

os.environ.setdefault("JAX_PLATFORMS", "cpu")
HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "results", "low_precision.json")

# name -> (param dtype, optimizer factory of the base optimizer).
RECIPES = ("float32 master + float32 moments",
           "bf16 params + bf16 moments, stochastic",
           "bf16 params + bf16 moments, kahan",
           "bf16 params + bf16 moments, nearest")


def recipe(name: str, base: optax.GradientTransformation, seed: int = 0):
  """(param dtype, optimizer) of a recipe."""
  if name.startswith("float32"):
    return jnp.float32, base
  rounding = name.rsplit(", ", 1)[1]
  state_rounding = "nearest" if rounding == "nearest" else "stochastic"
  return jnp.bfloat16, optax.chain(
      optim.compress_state(base, rounding=state_rounding, seed=seed),
      optim.low_precision_params(rounding, seed=seed))


def bf16_rules(param_dtype):
  """Mixed bf16 compute (norms in float32) with params in `param_dtype`."""
  import jmp_amp.flax as jflax
  name = jnp.dtype(param_dtype).name
  return jflax.mixed_rules("bfloat16", param=name,
                           norms=f"params={name},compute=float32,"
                                 "output=float32")


# ---------------------------------------------------------------------------
# memory: compiled for an H100


SHAPES = {
    "state-dominated": dict(batch_size=2, max_len=256),
    "h100_compiled GPT": dict(batch_size=16, max_len=1024),
}
GPT = dict(vocab_size=8192, d_model=1024, num_heads=16, num_layers=4)


def memory_rows(shape, gemm="default"):
  from flax import nnx
  from jmp_amp.models import gpt as gpt_lib

  import jmp_amp.flax as jflax
  from jmp_amp.tools.bench import workloads
  tokens = jax.ShapeDtypeStruct((shape["batch_size"], shape["max_len"]),
                                jnp.int32)
  rows = []
  for name in RECIPES:
    model = gpt_lib.GPT(**GPT, max_len=shape["max_len"], rngs=nnx.Rngs(0))
    param_dtype, tx = recipe(name, optax.adamw(3e-4, weight_decay=0.1))
    jflax.set_policies(model, bf16_rules(param_dtype))
    step, state = workloads.nnx_step(model, gpt_lib.lm_loss, {"scale": None},
                                     tx)
    report = jmp_amp.gpu_report(step, state, (tokens, tokens), gemm=gemm)
    s = report.summary()
    rows.append(dict(recipe=name, argument_bytes=s["argument_bytes"],
                     temp_bytes=s["temp_bytes"],
                     argument_plus_temp=s["argument_bytes"] + s["temp_bytes"],
                     bytes_estimate=s["bytes_estimate"], kernels=s["kernels"]))
    print(f"  {name:<42} args {s['argument_bytes'] / 2**20:8.0f} MiB  temp "
          f"{s['temp_bytes'] / 2**20:8.0f} MiB  bytes "
          f"{s['bytes_estimate'] / 2**20:8.0f} MiB", flush=True)
  base = rows[0]
  nearest = rows[-1]
  for r in rows:
    for key in ("argument_bytes", "argument_plus_temp", "bytes_estimate"):
      r[f"{key}_vs_float32"] = r[key] / base[key]
      r[f"{key}_vs_nearest"] = r[key] / nearest[key]
  return rows


def part_memory(shapes, save, gemm="default"):
  from jmp_amp.tools import gpu_target
  out = {"label": gpu_target.label("h100", gemm), "gemm": gemm,
         "gemm_options": gpu_target.GEMM_BACKENDS[gemm], "model": GPT,
         "shapes": {}}
  for shape_name in shapes:
    shape = SHAPES[shape_name]
    print(f"{shape_name}: {shape}", flush=True)
    out["shapes"][shape_name] = dict(shape, rows=memory_rows(shape, gemm))
    save(out)
  from flax import nnx
  from jmp_amp.models import gpt as gpt_lib
  params = sum(x.size for x in jax.tree.leaves(nnx.state(jax.eval_shape(
      lambda: gpt_lib.GPT(**GPT, max_len=256, rngs=nnx.Rngs(0))), nnx.Param)))
  out["parameters"] = int(params)
  return out


# ---------------------------------------------------------------------------
# accuracy: digits and a small GPT, on the CPU


def train_curves(name, make_model, base_tx, seeds, batches_of, loss_fn,
                 eval_fn, chunks=10):
  """Per seed, `eval_fn` after each of `chunks` equal parts of the run.

  The model, optimizer and batches differ per seed; the stochastic-rounding
  seed is the recipe's own (0), so one compiled program serves every seed.
  """
  from flax import nnx
  graphdef = None
  curves = []
  for seed in range(seeds):
    param_dtype, tx = recipe(name, base_tx)
    model = make_model(param_dtype, seed)
    graphdef, state = nnx.split((model, nnx.Optimizer(model, tx,
                                                      wrt=nnx.Param)))
    if seed == 0:
      def chunk(state, batches, graphdef=graphdef):
        def one(state, batch):
          model, opt = nnx.merge(graphdef, state)
          grads = nnx.grad(lambda m: loss_fn(m, batch))(model)
          opt.update(model, grads)
          return nnx.state((model, opt)), None
        return jax.lax.scan(one, state, batches)[0]
      chunk = jax.jit(chunk, donate_argnums=0)
      evaluate = jax.jit(lambda state, graphdef=graphdef: eval_fn(
          nnx.merge(graphdef, state)[0]))
    batches = batches_of(seed)
    steps = jax.tree.leaves(batches)[0].shape[0]
    curve = []
    for c in range(chunks):
      part = jax.tree.map(
          lambda b: b[c * steps // chunks:(c + 1) * steps // chunks], batches)
      state = chunk(state, part)
      curve.append(float(evaluate(state)))
    curves.append(curve)
  return curves


def digits_curves(name, seeds, steps, lr):
  from flax import nnx
  from jmp_amp.models import mlp as mlp_lib

  import jmp_amp.flax as jflax
  (x, y), (xt, yt) = data_lib.digits()

  def make_model(param_dtype, seed):
    model = mlp_lib.MLP(64, 10, num_layers=3, width=128, rngs=nnx.Rngs(seed))
    jflax.set_policies(model, bf16_rules(param_dtype))
    return model

  def batches_of(seed):
    idx = np.random.default_rng(seed).integers(0, len(x), (steps, 64))
    return (x[idx], y[idx])

  def loss_fn(m, batch):
    logits = m(batch[0]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, batch[1]).mean()

  def accuracy(m):
    return 100 * jnp.mean(m(xt).astype(jnp.float32).argmax(-1) == yt)
  return train_curves(name, make_model,
                      optax.adam(optax.cosine_decay_schedule(lr, steps)),
                      seeds, batches_of, loss_fn, accuracy)


def gpt_model(param_dtype, seed):
  from flax import nnx
  from jmp_amp.models import gpt as gpt_lib

  import jmp_amp.flax as jflax
  model = gpt_lib.GPT(vocab_size=64, d_model=64, num_heads=4, num_layers=2,
                      max_len=32, rngs=nnx.Rngs(seed))
  jflax.set_policies(model, bf16_rules(param_dtype))
  return model


def gpt_curves(name, seeds, steps, lr):
  from jmp_amp.models import data as data_lib
  from jmp_amp.models import gpt as gpt_lib
  held_out = data_lib.token_batch(256, 32, 64, seed=999_999)

  def batches_of(seed):
    return data_lib.token_batch(16 * steps, 32, 64, seed=seed).reshape(
        steps, 16, 32)

  def loss_fn(m, tokens):
    return gpt_lib.lm_loss(m(tokens), tokens)
  return train_curves(
      name, gpt_model,
      optax.adamw(optax.cosine_decay_schedule(lr, steps), weight_decay=0.01),
      seeds, batches_of, loss_fn, lambda m: loss_fn(m, held_out))


def part_accuracy(seeds, digits_steps, gpt_steps, lr=3e-3):
  out = {"digits": {"steps": digits_steps, "seeds": seeds, "lr": lr,
                    "model": "MLP 64-128-128-10, Adam, cosine decay, batch "
                             "64, bf16 compute", "curves": {}},
         "gpt": {"steps": gpt_steps, "seeds": seeds, "lr": lr,
                 "model": "GPT vocab 64, d 64, 2 layers, T 32, batch 16, "
                          "AdamW, cosine decay, bf16 compute", "curves": {}}}
  for name in RECIPES:
    t0 = time.time()
    out["digits"]["curves"][name] = digits_curves(name, seeds, digits_steps,
                                                  lr)
    out["gpt"]["curves"][name] = gpt_curves(name, seeds, gpt_steps, lr)
    print(f"  {name:<42} digits "
          f"{np.mean([c[-1] for c in out['digits']['curves'][name]]):6.2f} %"
          f"  gpt loss "
          f"{np.mean([c[-1] for c in out['gpt']['curves'][name]]):.4f}"
          f"  ({time.time() - t0:.0f} s)", flush=True)
  base = RECIPES[0]
  for task, key in (("digits", "accuracy"), ("gpt", "loss")):
    finals = {n: float(np.mean([c[-1] for c in curves]))
              for n, curves in out[task]["curves"].items()}
    out[task][f"final_{key}"] = finals
    if key == "accuracy":
      out[task]["points_below_float32"] = {
          n: finals[base] - v for n, v in finals.items()}
    else:
      out[task]["loss_vs_float32"] = {n: v / finals[base]
                                      for n, v in finals.items()}
  return out


# ---------------------------------------------------------------------------
# cost: CPU step time, stochastic vs nearest


def rounding_costs(rounds, n=1 << 20):
  """Seconds to round n float32 values to bfloat16, three ways (median)."""
  x = jax.random.normal(jax.random.key(0), (n,))
  key = jax.random.key(1)

  def threefry(x, key):  # the same rounding with jax.random.bits
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    noise = jax.random.bits(key, x.shape, jnp.uint16).astype(jnp.uint32)
    return jax.lax.bitcast_convert_type(
        (bits + noise) & jnp.uint32(0xFFFF0000), jnp.float32).astype(
            jnp.bfloat16)
  fns = {"nearest": jax.jit(lambda x, key: x.astype(jnp.bfloat16)),
         "stochastic_round": jax.jit(optim.stochastic_round),
         "threefry bits": jax.jit(threefry)}
  times = {name: [] for name in fns}
  for _ in range(rounds):
    for name, fn in fns.items():
      jax.block_until_ready(fn(x, key))
      t0 = time.perf_counter()
      for _ in range(5):
        out = fn(x, key)
      jax.block_until_ready(out)
      times[name].append((time.perf_counter() - t0) / 5)
  med = {name: statistics.median(t) for name, t in times.items()}
  med["threefry_vs_stochastic_round"] = (med["threefry bits"]
                                         / med["stochastic_round"])
  return med


def part_cost(rounds, steps_per_round):
  from flax import nnx
  from jmp_amp.models import data as data_lib
  from jmp_amp.models import gpt as gpt_lib
  tokens = jnp.asarray(data_lib.token_batch(16, 32, 64))
  steps = {}
  for name in (RECIPES[1], RECIPES[3]):
    _, tx = recipe(name, optax.adamw(1e-3))
    model = gpt_model(jnp.bfloat16, 0)
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    graphdef, state = nnx.split((model, opt))

    def step(state, tokens, graphdef=graphdef):
      model, opt = nnx.merge(graphdef, state)
      grads = nnx.grad(lambda m: gpt_lib.lm_loss(m(tokens), tokens))(model)
      opt.update(model, grads)
      return nnx.state((model, opt))
    steps[name] = [jax.jit(step, donate_argnums=0), state]
  times = {name: [] for name in steps}
  for _ in range(rounds):  # interleaved: both see the same machine load
    for name, entry in steps.items():
      entry[1] = entry[0](entry[1], tokens)  # warm / compiled
      jax.block_until_ready(entry[1])
      t0 = time.perf_counter()
      for _ in range(steps_per_round):
        entry[1] = entry[0](entry[1], tokens)
      jax.block_until_ready(entry[1])
      times[name].append((time.perf_counter() - t0) / steps_per_round)
  med = {n: statistics.median(t) for n, t in times.items()}
  return {"rounding_1m_elements_s": rounding_costs(rounds),
          "model": "the accuracy part's small GPT, batch 16, AdamW",
          "rounds": rounds, "steps_per_round": steps_per_round,
          "median_step_s": med,
          "stochastic_vs_nearest": med[RECIPES[1]] / med[RECIPES[3]]}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--part", choices=("memory", "accuracy", "cost"),
                      required=True)
  parser.add_argument("--out", default=OUT)
  parser.add_argument("--seeds", type=int, default=3)
  parser.add_argument("--digits-steps", type=int, default=1500)
  parser.add_argument("--gpt-steps", type=int, default=600)
  parser.add_argument("--shapes", nargs="+", default=list(SHAPES),
                      choices=list(SHAPES), help="memory: the GPT shapes")
  parser.add_argument("--gemm", choices=("default", "cublas"),
                      default="default",
                      help="memory: XLA's default options (Triton GEMMs) or "
                           "cublas (Triton GEMMs off; key memory_cublas)")
  args = parser.parse_args(argv)
  key = (f"memory_{args.gemm}" if args.part == "memory"
         and args.gemm != "default" else args.part)
  results = {}
  if os.path.exists(args.out):
    with open(args.out) as f:
      results = json.load(f)
  t0 = time.time()

  def save(part):
    part.update(jax_version=jax.__version__,
                python=platform.python_version(),
                made=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                seconds=round(time.time() - t0))
    results[key] = part
    with open(args.out, "w") as f:
      json.dump(results, f, indent=1)

  if args.part == "memory":
    part = part_memory(args.shapes, save, args.gemm)
  elif args.part == "accuracy":
    part = part_accuracy(args.seeds, args.digits_steps, args.gpt_steps)
  else:
    part = part_cost(rounds=7, steps_per_round=20)
  save(part)
  print(f"wrote {args.out} [{key}]")


if __name__ == "__main__":
  main()
