#!/usr/bin/env python3
"""GPT train step GPU temp memory, compiled for an H100 without a GPU.

Compiles the GPT train step of benchmarks/h100_compiled.py (d 1024, 16 heads,
4 layers, T 1024, batch 16, vocab 8192, adamw, state donated) in float32,
under the bf16 policy (`jmp_amp.flax.mixed_rules("bfloat16")`) and under
autocast-bf16, once with the loss as it was (float32 copy of the logits,
`optax.softmax_cross_entropy_with_integer_labels`) and once with
`models.lm_loss` (float32 log-sum-exp fused into the reduction, gradient
returned in the logits' dtype), and prints GPU temp memory and its ratio to
float32. Compiler figures (`memory_analysis()` of the optimized XLA:GPU
program, XLA's default options: Triton GEMMs, untuned since no GPU autotunes
here), not timings: nothing runs on a GPU. ``--gemm cublas`` compiles with
Triton GEMMs off (``xla_gpu_enable_triton_gemm=False``) and says so in its
label.

Run in a venv with the ``gpu-audit`` extra (``pip install -e ".[gpu-audit]"``)::

    JAX_PLATFORMS=cpu python benchmarks/gpt_memory_h100.py \\
        [--out benchmarks/results/gpt_memory_h100.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# pylint: disable=g-import-not-at-top,wrong-import-position
import jax
import jax.numpy as jnp
import optax

import h100_compiled  # this script's directory: the same GPT step
from jmp_amp.models import gpt as gpt_lib
from jmp_amp.tools import gpu_target

GPT = h100_compiled.GPT
MODES = ("float32", "bf16", "autocast-bf16")


def previous_lm_loss(logits, tokens):
  """The loss before: a float32 copy of the logits into optax's cross-entropy."""
  logits = jnp.asarray(logits[:, :-1], jnp.float32)
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(
      logits, tokens[:, 1:]))


LOSSES = {"previous (optax on float32 logits)": previous_lm_loss,
          "models.lm_loss": gpt_lib.lm_loss}


def rows_for(loss_fn, gemm="default"):
  rows = h100_compiled.gpt_rows(MODES, loss_fn, gemm)
  keep = ("mode", "status", "error", "temp_bytes", "temp_bytes_vs_float32",
          "argument_bytes", "kernels", "gemms_by_dtype", "half_gemm_flops")
  return [{k: r[k] for k in keep if k in r} for r in rows]


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", help="write the figures as JSON here")
  parser.add_argument("--gemm", choices=list(gpu_target.GEMM_BACKENDS),
                      default="default",
                      help="compiler options: XLA's default (Triton GEMMs) "
                           "or cublas (Triton GEMMs off, labelled)")
  args = parser.parse_args(argv)
  label = gpu_target.label("h100", args.gemm)
  out = {"label": label, "gemm": args.gemm,
         "gemm_options": gpu_target.GEMM_BACKENDS[args.gemm],
         "jax_version": jax.__version__,
         "python": platform.python_version(),
         "made": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
         "workload": "GPT decoder: d 1024, 4 layers, 16 heads, T 1024, batch "
                     "16, vocab 8192, adamw, state donated",
         "config": GPT, "losses": {}}
  print(label)
  for name, loss_fn in LOSSES.items():
    t0 = time.time()
    rows = rows_for(loss_fn, args.gemm)
    out["losses"][name] = rows
    print(f"\nloss: {name} ({time.time() - t0:.0f} s to compile)")
    print(f"{'mode':<15}{'temp MiB':>10}{'vs float32':>12}{'kernels':>9}"
          f"{'half GEMM FLOPs':>17}")
    for r in rows:
      if r["status"] != "ok":
        print(f"{r['mode']:<15} failed: {r.get('error')}")
        continue
      half = r.get("half_gemm_flops")
      print(f"{r['mode']:<15}{r['temp_bytes'] / 2**20:>10,.0f}"
            f"{r['temp_bytes_vs_float32']:>12.3f}{r['kernels']:>9}"
            f"{'' if half is None else f'{100 * half:.0f} %':>17}")
  if args.out:
    with open(args.out, "w") as f:
      json.dump(out, f, indent=1)
      f.write("\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
  main()
