#!/usr/bin/env python3
"""Train steps of every workload and precision mode, compiled for an H100.

No GPU needed: each step is compiled with `jmp_amp.gpu_report` (the CUDA
plugin's compile-only H100 target, the ``gpu-audit`` extra) and the
compiler's figures are written to benchmarks/results/h100_compiled.json:
GEMMs by dtype (the share of GEMM FLOPs in a half dtype and in FP8),
kernels, GPU temp/argument memory, an estimate of bytes moved, and their
ratios to float32, for every mode of `jmp-amp bench` but float32-highest
(FP8: ``float8`` is ``mixed_rules() | {"*": "float8"}``, ``autocast-float8``
is ``jmp_amp.autocast(..., "float8")``). Compiler figures, not timings.

It compiles with XLA's default options, as a GPU does: GEMMs are Triton GEMM
fusions or cuBLAS calls as XLA picks them, untuned since no GPU autotunes
here; the FP8 modes' steps turn Triton GEMMs off, as `make_train_step`
does. ``--gemm cublas`` turns Triton GEMMs off
(``xla_gpu_enable_triton_gemm=False``, a configuration no GPU has unless
asked for) and writes h100_compiled_cublas.{json,md,png}, labelled so.

    JAX_PLATFORMS=cpu python benchmarks/h100_compiled.py  # all, + plot
    python benchmarks/h100_compiled.py --plot-only  # plot + .md from JSON

Workloads: the seed MLP (width 4096, 3 layers, batch 512, SGD), the ResNet
of `jmp-amp bench --model resnet` (CIFAR-sized, batch 128, SGD) and a GPT
decoder (d 1024, 4 layers, 16 heads, T 1024, batch 16, vocab 8192, adamw).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import jax
import jax.numpy as jnp
import optax

from jmp_amp.tools import gpu_target
from jmp_amp.tools.bench import gpu
from jmp_amp.tools.bench import workloads

HERE = os.path.dirname(os.path.abspath(__file__))

MODES = tuple(m for m in workloads.JAX_MODES if m != "float32-highest")
RESULTS = os.path.join(HERE, "results")
GPT = dict(vocab_size=8192, d_model=1024, num_heads=16, num_layers=4,
           max_len=1024, batch_size=16, lr=3e-4, weight_decay=0.1)


def bench_config(**sizes) -> workloads.Config:
  base = dict(model="mlp", width=4096, layers=3, batch_size=512, batches=1,
              epochs=1, steps=1, warmup=0, lr=0.1, seed=0, init_scale=2.0**15)
  return workloads.Config(**{**base, **sizes})


def gpt_rows(modes, loss_fn=None, gemm="default"):
  """The GPT step's rows, with `models.lm_loss` or another ``loss_fn``,
  compiled with the options `gemm` names (`gpu_target.GEMM_BACKENDS`)."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from jmp_amp.models import gpt as gpt_lib  # pylint: disable=g-import-not-at-top
  c = GPT
  tokens = jax.ShapeDtypeStruct((c["batch_size"], c["max_len"]), jnp.int32)

  def build(mode):
    model = gpt_lib.GPT(c["vocab_size"], c["d_model"], c["num_heads"],
                        c["num_layers"], c["max_len"], rngs=nnx.Rngs(0))
    step, state = gpu.nnx_step(
        model, loss_fn or gpt_lib.lm_loss, mode,
        optax.adamw(c["lr"], weight_decay=c["weight_decay"]),
        example_args=(tokens,))
    return step, state, (tokens, tokens)

  rows = [gpu.mode_report(name, build, gemm=gemm) for name in modes]
  gpu.add_ratios(rows)
  return rows


def compile_all(workloads, modes, gemm="default"):
  out = {"label": gpu_target.label("h100", gemm), "gemm": gemm,
         "gemm_options": gpu_target.GEMM_BACKENDS[gemm],
         "jax_version": jax.__version__,
         "python": platform.python_version(),
         "made": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
         "note": "Compiler figures for an H100 SXM target, no GPU, no "
                 "timings. bytes_estimate: every kernel reads its operands "
                 "and writes its result once (loop bodies once). "
                 + ("XLA's default options: GEMMs are Triton GEMM fusions or "
                    "cuBLAS calls as XLA picks them, untuned (no GPU "
                    "autotunes here); the FP8 modes' steps with Triton GEMMs "
                    "off, as make_train_step compiles them." if gemm ==
                    "default" else
                    "Triton GEMMs off (xla_gpu_enable_triton_gemm=False): "
                    "every GEMM a cuBLAS call, a configuration no GPU has "
                    "unless asked for."),
         "workloads": {}}
  configs = {
      "mlp": ("seed MLP: width 4096, 3 layers, batch 512, MSE, SGD",
              bench_config()),
      "resnet": ("ResNet (models/resnet.py defaults), CIFAR 32x32x3, batch "
                 "128, SGD", bench_config(model="resnet", batch_size=128)),
  }
  for name in workloads:
    t0 = time.time()
    if name == "gpt":
      description = ("GPT decoder: d 1024, 4 layers, 16 heads, T 1024, batch "
                     "16, vocab 8192, adamw")
      rows, config = gpt_rows(modes, gemm=gemm), GPT
    else:
      description, cfg = configs[name]
      rows = gpu.workload_reports(name, cfg, modes, gemm=gemm)
      config = {k: v for k, v in vars(cfg).items()
                if k in ("width", "layers", "batch_size", "lr")}
    out["workloads"][name] = {"description": description, "config": config,
                              "rows": rows}
    gpu.print_table(rows, f"{name}: {description} "
                          f"({time.time() - t0:.0f} s to compile)")
    print(flush=True)
  return out


def _ordered(results):
  order = ("mlp", "resnet", "gpt")
  return sorted(results["workloads"],
                key=lambda n: order.index(n) if n in order else len(order))


def plot(results, path):
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  names = _ordered(results)
  metrics = (("temp_bytes_vs_float32", "GPU temp memory"),
             ("bytes_estimate_vs_float32", "bytes moved (est.)"),
             ("kernels_vs_float32", "kernels"))
  fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4.2),
                           squeeze=False)
  for ax, name in zip(axes[0], names):
    rows = [r for r in results["workloads"][name]["rows"]
            if r["status"] == "ok"]
    width = 0.8 / len(metrics)
    for i, (key, label) in enumerate(metrics):
      ax.bar([j + i * width for j in range(len(rows))],
             [r[key] or 0 for r in rows], width, label=label)
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_xticks([j + width for j in range(len(rows))])
    ax.set_xticklabels([r["mode"] for r in rows], rotation=40, ha="right")
    ax.set_title(name)
    ax.set_ylabel("ratio to float32")
  axes[0][0].legend(fontsize=8, loc="lower left")
  first, second = results["label"].split(": ", 1)
  fig.suptitle(f"Train steps {first}\n{second} (jax {results['jax_version']})",
               fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


# gpu.table's columns shown in the Markdown, and their headers there.
_MD_COLUMNS = ("mode", "GEMMs by dtype", "half FLOPs", "FP8 FLOPs", "kernels",
               "temp MiB", "temp ratio", "bytes est MiB", "bytes ratio")
_MD_HEADERS = ("mode", "GEMMs by dtype", "half GEMM FLOPs", "FP8 GEMM FLOPs",
               "kernels", "GPU temp MiB", "temp / f32", "bytes est. MiB",
               "bytes / f32")


def markdown(results) -> str:
  """The results as Markdown tables, one per workload, labelled."""
  lines = [f"Train steps {results['label']} (jax {results['jax_version']}, "
           f"{results['made']}).", ""]
  for name in _ordered(results):
    w = results["workloads"][name]
    lines += [f"**{name}**: {w['description']}", "",
              "| " + " | ".join(_MD_HEADERS) + " |",
              "| " + " | ".join(["---"] * len(_MD_HEADERS)) + " |"]
    for r in w["rows"]:
      if r["status"] != "ok":
        lines.append(f"| {r['mode']} | failed: {r['error'][:60]} |"
                     + " |" * (len(_MD_HEADERS) - 2))
        continue
      cells = dict(zip(gpu.COLUMNS, gpu.table([r])[0]))
      lines.append("| " + " | ".join(cells[c] for c in _MD_COLUMNS) + " |")
    lines.append("")
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--workload", action="append",
                      choices=("mlp", "resnet", "gpt"))
  parser.add_argument("--mode", action="append",
                      choices=list(workloads.JAX_MODES))
  parser.add_argument("--plot-only", action="store_true")
  parser.add_argument("--gemm", choices=list(gpu_target.GEMM_BACKENDS),
                      default="default",
                      help="compiler options: XLA's default (Triton GEMMs) "
                           "or cublas (Triton GEMMs off; files *_cublas.*)")
  parser.add_argument("--out", default=RESULTS)
  args = parser.parse_args(argv)
  stem = "h100_compiled" + ("" if args.gemm == "default" else f"_{args.gemm}")
  path = os.path.join(args.out, f"{stem}.json")
  if args.plot_only:
    with open(path) as f:
      results = json.load(f)
  else:
    gpu.use_compile_only_cpu()
    results = compile_all(args.workload or ("mlp", "resnet", "gpt"),
                          args.mode or MODES, args.gemm)
    os.makedirs(args.out, exist_ok=True)
    with open(path, "w") as f:
      json.dump(results, f, indent=1, sort_keys=True, default=str)
    print("wrote", path)
  with open(os.path.join(args.out, f"{stem}.md"), "w") as f:
    f.write(markdown(results))
  try:
    plot(results, os.path.join(args.out, f"{stem}.png"))
    print("wrote", os.path.join(args.out, f"{stem}.png"))
  except ImportError:
    print("matplotlib is not installed: run again with --plot-only where it is")


if __name__ == "__main__":
  main()
