#!/usr/bin/env python3
"""GPT train step GPU temp memory, compiled for an H100 without a GPU.

Compiles the GPT train step of benchmarks/h100_compiled.py (d 1024, 16 heads,
4 layers, T 1024, batch 16, vocab 8192, adamw, state donated; the GPT's
default flash attention, `jax.nn.dot_product_attention`, which is cuDNN's
fused kernel in the half modes) in the bench's modes float32,
mixed_bfloat16 (`jmp_amp.flax.mixed_rules("bfloat16")`) and
autocast-mixed_bfloat16, with three losses: a user's standard loss
(`optax.softmax_cross_entropy_with_integer_labels` on
``logits.astype(float32)``), the GPT's loss before `models.lm_loss` (the
same on a float32 copy of ``logits[:, :-1]``) and `models.lm_loss` (float32
log-sum-exp fused into the reduction, gradient returned in the logits'
dtype). It prints GPU temp memory, its ratio to float32, and the kernels
that write a float32 array of the logits' size (``float32_logits_kernels``):
float32 copies of half logits or of their gradient. Compiler figures
(`memory_analysis()` of the optimized XLA:GPU program, XLA's default
options), not timings: nothing runs on a GPU.

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
from jmp_amp.models import gpt as gpt_lib
import numpy as np
import optax

import h100_compiled  # this script's directory: the same GPT step
from jmp_amp.tools import gpu_target
from jmp_amp.tools import hlo_text
from jmp_amp.tools.bench import gpu
from jmp_amp.tools.bench import workloads

GPT = h100_compiled.GPT
MODES = ("float32", "mixed_bfloat16", "autocast-mixed_bfloat16")
LABEL = gpu_target.label("h100", "default")


def standard_lm_loss(logits, tokens):
  """A user's standard loss: optax's cross-entropy on float32 logits."""
  labels = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])],
                           axis=1)
  weights = (jnp.arange(tokens.shape[1]) < tokens.shape[1] - 1)
  losses = optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), labels)
  return jnp.sum(losses * weights) / (tokens.shape[0] * (tokens.shape[1] - 1))


def previous_lm_loss(logits, tokens):
  """The loss before: a float32 copy of the logits into optax's
  cross-entropy."""
  logits = jnp.asarray(logits[:, :-1], jnp.float32)
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(
      logits, tokens[:, 1:]))


LOSSES = {"standard (optax on logits.astype(float32))": standard_lm_loss,
          "previous (optax on float32 logits)": previous_lm_loss,
          "models.lm_loss": gpt_lib.lm_loss}


def float32_logits_kernels(text: str) -> int:
  """Kernels of a compiled program that write float32 arrays of the
  logits' size (batch x T x vocab elements, or T - 1 positions)."""
  size = GPT["batch_size"] * (GPT["max_len"] - 1) * GPT["vocab_size"]
  module = hlo_text.HloModule(text)
  count = 0
  for _, instr in module.kernels():
    shape, dtype = hlo_text.array(instr.type)
    count += bool(dtype == "f32" and shape and np.prod(shape) >= size)
  return count


def row(mode, loss_fn):
  from flax import nnx  # pylint: disable=g-import-not-at-top
  c = GPT
  tokens = jax.ShapeDtypeStruct((c["batch_size"], c["max_len"]), jnp.int32)
  model = gpt_lib.GPT(c["vocab_size"], c["d_model"], c["num_heads"],
                      c["num_layers"], c["max_len"], rngs=nnx.Rngs(0))
  step, state = gpu.nnx_step(
      model, loss_fn, workloads.JAX_MODES[mode],
      optax.adamw(c["lr"], weight_decay=c["weight_decay"]),
      example_args=(tokens,))
  compiled = gpu_target.compile_for_gpu(step, state, (tokens, tokens),
                                        gemm="default")
  report = gpu_target.report_from_compiled(compiled, "h100")
  summary = report.summary()
  return dict(mode=mode, status="ok", temp_bytes=summary["temp_bytes"],
              argument_bytes=summary["argument_bytes"],
              kernels=summary["kernels"],
              gemms_by_dtype=summary["gemms_by_dtype"],
              attention_calls=summary["attention_calls"],
              float32_logits_kernels=float32_logits_kernels(
                  compiled.as_text()))


def rows_for(loss_fn):
  rows = [row(mode, loss_fn) for mode in MODES]
  base = rows[0]["temp_bytes"]
  for r in rows:
    r["temp_bytes_vs_float32"] = r["temp_bytes"] / base
  return rows


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", help="write the figures as JSON here")
  args = parser.parse_args(argv)
  out = {"label": LABEL, "gemm": "default", "jax_version": jax.__version__,
         "python": platform.python_version(),
         "made": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
         "workload": "GPT decoder: d 1024, 4 layers, 16 heads, T 1024, batch "
                     "16, vocab 8192, adamw, state donated, flash attention "
                     "(models.GPT's default)",
         "compiler_options": "XLA's defaults (gemm='default')",
         "config": GPT, "losses": {}}
  print(LABEL)
  for name, loss_fn in LOSSES.items():
    t0 = time.time()
    rows = rows_for(loss_fn)
    out["losses"][name] = rows
    print(f"\nloss: {name} ({time.time() - t0:.0f} s to compile)")
    print(f"{'mode':<25}{'temp MiB':>10}{'vs float32':>12}{'kernels':>9}"
          f"{'f32 logits-sized':>18}")
    for r in rows:
      if r["status"] != "ok":
        print(f"{r['mode']:<25} failed: {r.get('error')}")
        continue
      print(f"{r['mode']:<25}{r['temp_bytes'] / 2**20:>10,.0f}"
            f"{r['temp_bytes_vs_float32']:>12.3f}{r['kernels']:>9}"
            f"{r['float32_logits_kernels']:>18}")
  if args.out:
    with open(args.out, "w") as f:
      json.dump(out, f, indent=1)
      f.write("\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
  main()
