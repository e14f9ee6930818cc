#!/usr/bin/env python3
"""What per-module numerics telemetry costs: train steps compiled for an H100.

Each workload's float16 train step (``mixed_rules("float16")``, dynamic loss
scaling) is compiled with `jmp_amp.gpu_report` (the compile-only H100 target
of the CUDA plugin, no GPU) twice: without telemetry, and with
``make_train_step(..., numerics="**")`` (output and param-gradient stats of
every module). Written to benchmarks/results/numerics_bytes_h100.json: the
compiler's estimate of bytes moved, kernels and temp memory of both, and
their ratios (target: bytes <= 1.10x). Compiler figures, not timings,
compiled with XLA's default options (Triton GEMMs, untuned since no GPU
autotunes here); ``--gemm cublas`` turns Triton GEMMs off
(``xla_gpu_enable_triton_gemm=False``) and says so in the label.

    JAX_PLATFORMS=cpu python benchmarks/numerics_bytes.py
    python3 benchmarks/numerics_bytes.py --out $OUT/x.json    # on a GPU
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

from flax import nnx
import jax
import jax.numpy as jnp
import optax

import jmp_amp
from jmp_amp import models
import jmp_amp.flax
from jmp_amp.tools import gpu_target

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "results", "numerics_bytes_h100.json")
TARGET = 1.10


def _workloads():
  """name -> (description, model factory, loss_fn, batch structs)."""
  gpt = dict(vocab_size=8192, d_model=1024, num_heads=16, num_layers=4,
             max_len=1024)
  tokens = jax.ShapeDtypeStruct((16, 1024), jnp.int32)
  images = jax.ShapeDtypeStruct((128, 32, 32, 3), jnp.float32)
  labels = jax.ShapeDtypeStruct((128,), jnp.int32)
  x = jax.ShapeDtypeStruct((512, 4096), jnp.float32)
  return {
      "mlp": ("seed MLP: width 4096, 3 layers, batch 512, MSE",
              lambda: models.MLP(4096, 4096, 3, rngs=nnx.Rngs(0)),
              lambda m, b: jnp.mean((m(b[0]).astype(jnp.float32) - b[1])
                                    ** 2), (x, x)),
      "resnet": ("ResNet (models/resnet.py defaults), 32x32x3, batch 128",
                 lambda: models.ResNet(rngs=nnx.Rngs(0)),
                 lambda m, b: models.cross_entropy_loss(
                     m(b[0]).astype(jnp.float32), b[1]), (images, labels)),
      "gpt": ("GPT decoder: d 1024, 4 layers, 16 heads, T 1024, batch 16, "
              "vocab 8192", lambda: models.GPT(**gpt, rngs=nnx.Rngs(0)),
              lambda m, t: models.lm_loss(m(t), t), tokens),
  }


def _report(factory, loss_fn, batch, numerics, compile_fn):
  model = factory()
  jmp_amp.flax.set_policies(model, jmp_amp.flax.mixed_rules("float16"))
  opt = nnx.Optimizer(model, jmp_amp.loss_scaling(
      optax.sgd(0.1), jmp_amp.DynamicLossScale(2.0 ** 15)), wrt=nnx.Param)
  step = jmp_amp.flax.make_train_step(loss_fn, jit=False, numerics=numerics)
  graphdef, state = nnx.split((model, opt))

  def pure(state, batch):
    m, o = nnx.merge(graphdef, state)
    metrics = step(m, o, batch)
    return nnx.state((m, o)), metrics

  abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                          state)
  return compile_fn(pure, abstract, batch)


def _h100(pure, state, batch, gemm="default"):
  s = jmp_amp.gpu_report(pure, state, batch, donate_argnums=0,
                         gemm=gemm).summary()
  return {k: s[k] for k in ("bytes_estimate", "kernels", "temp_bytes")}


def _on_device(pure, state, batch):
  """On a real GPU: the compiler's cost analysis of the compiled step."""
  compiled = jax.jit(pure, donate_argnums=0).lower(state, batch).compile()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  memory = compiled.memory_analysis()
  return {"bytes_accessed": float(cost.get("bytes accessed", 0.0)),
          "temp_bytes": int(memory.temp_size_in_bytes)}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=None)
  parser.add_argument("--workloads", default="mlp,resnet,gpt")
  parser.add_argument("--gemm", choices=list(gpu_target.GEMM_BACKENDS),
                      default="default",
                      help="compile-only H100: XLA's default options "
                           "(Triton GEMMs) or cublas (Triton GEMMs off, "
                           "labelled; written to numerics_bytes_h100_cublas"
                           ".json unless --out)")
  args = parser.parse_args()
  on_gpu = jax.default_backend() == "gpu"
  compile_fn = (_on_device if on_gpu else
                lambda *a: _h100(*a, gemm=args.gemm))
  key = "bytes_accessed" if on_gpu else "bytes_estimate"
  out = {"label": (str(jax.devices()[0].device_kind) if on_gpu
                   else gpu_target.label("h100", args.gemm)),
         **({} if on_gpu else {"gemm": args.gemm, "gemm_options":
                               gpu_target.GEMM_BACKENDS[args.gemm]}),
         "jax_version": jax.__version__, "python": platform.python_version(),
         "made": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
         "note": ("float16 train steps (mixed_rules('float16'), dynamic loss "
                  "scaling, SGD) without and with numerics='**'. "
                  + ("Cost analysis of the compiled step on this GPU." if on_gpu
                     else "Compile-only H100 target: bytes_estimate has every "
                     "kernel read its operands and write its result once.")),
         "target_bytes_ratio": TARGET, "workloads": {}}
  workloads = _workloads()
  for name in args.workloads.split(","):
    description, factory, loss_fn, batch = workloads[name]
    t0 = time.time()
    off = _report(factory, loss_fn, batch, None, compile_fn)
    on = _report(factory, loss_fn, batch, "**", compile_fn)
    row = {"description": description, "off": off, "on": on,
           "bytes_ratio": on[key] / off[key],
           "temp_ratio": (on["temp_bytes"] / off["temp_bytes"]
                          if off["temp_bytes"] else None)}
    out["workloads"][name] = row
    print(f"{name}: bytes {row['bytes_ratio']:.3f}x, temp "
          f"{row['temp_ratio']}, ({time.time() - t0:.0f} s)", flush=True)
  out["max_bytes_ratio"] = max(r["bytes_ratio"]
                               for r in out["workloads"].values())
  path = args.out or (OUT if on_gpu or args.gemm == "default" else
                      OUT.replace(".json", f"_{args.gemm}.json"))
  with open(path, "w") as f:
    json.dump(out, f, indent=1)
    f.write("\n")
  print(f"wrote {path}: max bytes ratio {out['max_bytes_ratio']:.3f}")


if __name__ == "__main__":
  main()
