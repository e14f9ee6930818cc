"""FP8 train steps compiled for an H100 without a GPU: which GEMMs run in FP8.

Compiles the train steps of the reference MLP (PyTorch AMP recipe sizes) and
GPT for an H100 without a GPU (`jmp_amp.gpu_report`: the CUDA plugin's
compile-only target, XLA's default options: GEMMs as Triton GEMM fusions or
cuBLAS calls as XLA picks them, untuned since no GPU autotunes here), three
ways, and lists the GEMMs of the optimized program with their operand dtypes
(spelled as XLA does: ``f8e4m3fn``) and what each compiled to (``target``):

* ``mlp``, ``gpt``: ``set_policies(model, {"*": "float8"}, example_args=...)``
  on the bf16 model (the first and last matmul layers, in call order,
  excluded);
* ``*-rules``: ``set_policies(model, mixed_rules() | {"*": "float8"},
  example_args=...)`` on the float32 model (the same FP8 layers; norms
  float32, the rest bf16);
* ``*-autocast``: ``make_train_step(..., autocast="float8")`` on the float32
  model: every float32 matmul, attention contractions and the head included.

Every FP8 layer of the first two should contribute three FP8 GEMMs: the
forward ``f8e4m3fn x f8e4m3fn``, and in the backward pass the input gradient
and the weight gradient, each with one ``f8e5m2`` operand (the gradient) and
one ``f8e4m3fn``. Their role is told by shape, not by operand order: the
weight gradient is the one whose result has the layer's kernel shape (XLA may
swap a GEMM's operands: under the default options the weight gradient is
spelled ``f8e5m2 x f8e4m3fn``, with cuBLAS ``f8e4m3fn x f8e5m2``;
``wgrad_order`` records which). Under autocast every GEMM should have FP8
operands.

These are compiler facts (what XLA emits for an H100), not timings.

Run in a venv with the ``gpu-audit`` extra (``pip install -e ".[gpu-audit]"``)::

    JAX_PLATFORMS=cpu python benchmarks/fp8_h100.py \\
        [--out benchmarks/results/fp8_h100.json]

``--gemm cublas`` compiles with Triton GEMMs off
(``xla_gpu_enable_triton_gemm=False``, every GEMM a cuBLAS call: a
configuration no GPU has unless asked for) and writes, labelled so,
fp8_h100_cublas.json unless ``--out`` says otherwise.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import pathlib
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# pylint: disable=g-import-not-at-top,wrong-import-position
from flax import nnx
import jax
import jax.numpy as jnp
import optax

import jmp_amp
from jmp_amp import models
import jmp_amp.flax
from jmp_amp.flax import fp8 as flax_fp8
from jmp_amp.tools import gpu_target

ROOT = pathlib.Path(__file__).resolve().parents[1]
F8 = ("f8e4m3fn", "f8e5m2")


def _hlo_dtype(name: str) -> str:
  """XLA's spelling of a record's dtype: "float8_e4m3fn" -> "f8e4m3fn"."""
  return "f8" + name[len("float8_"):] if name.startswith("float8_") else name


def _gemm(record) -> dict:
  out = list(record.result_shape)
  return dict(lhs=_hlo_dtype(record.lhs_dtype),
              rhs=_hlo_dtype(record.rhs_dtype),
              out=_hlo_dtype(record.result_dtype), out_shape=out,
              k=(None if record.flops is None
                 else record.flops // (2 * math.prod(out))),
              target=record.target, layer=record.fp8_layer)


def _role(g, kernel_shapes) -> str | None:
  """"fwd", "dgrad" or "wgrad" of an FP8 layer's GEMM, None otherwise.

  fwd: both operands f8e4m3fn. Backward: one f8e5m2 operand (the gradient)
  and one f8e4m3fn, in either order; the weight gradient's result has the
  layer's kernel shape (its dimensions in any order; a split-K GEMM adds a
  leading dimension of partial sums), the input gradient's does not.
  """
  pair = sorted((g["lhs"], g["rhs"]))
  if g["layer"] is None or any(d not in F8 for d in pair):
    return None
  if pair == ["f8e4m3fn", "f8e4m3fn"]:
    return "fwd"
  if pair != ["f8e4m3fn", "f8e5m2"]:
    return None
  kernel = kernel_shapes.get(g["layer"])
  out = g["out_shape"]
  if kernel is not None and len(out) == len(kernel) + 1:
    out = out[1:]  # split-K: [splits, *kernel dims] partial sums
  if kernel is not None and sorted(out) == sorted(kernel):
    return "wgrad"
  return "dgrad"


def _kernel_shapes(model) -> dict:
  """{layer path: its kernel's shape} of an abstract model."""
  return {"/".join(map(str, path[:-1])): list(v.get_value().shape)
          for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
          if path[-1] == "kernel"}


def _train_step(loss_fn):
  """Pure ``step(graphdef, state, batch) -> state`` with FP8 state updates."""

  def step(graphdef, state, batch):
    model, opt = nnx.merge(graphdef, state)
    grad_fn = flax_fp8.value_and_grad(lambda m: loss_fn(m, batch))
    _, grads = grad_fn(model)
    opt.update(model, grads)
    return nnx.state((model, opt))

  return step


def _autocast_train_step(loss_fn):
  """The same step under ``make_train_step(autocast="float8")``."""
  inner = jmp_amp.flax.make_train_step(loss_fn, autocast="float8", jit=False)

  def step(graphdef, state, batch):
    model, opt = nnx.merge(graphdef, state)
    inner(model, opt, batch)
    return nnx.state((model, opt))

  return step


def _abstract(build, tx):
  """(graphdef, abstract state) of ``(model, optimizer)`` without allocating."""
  def init():
    model = build()
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)
  graphdef, state = nnx.split(nnx.eval_shape(init))
  return graphdef, state


def _apply(how, model, example_args):
  if how == "float8":
    return jmp_amp.flax.set_policies(model, {"*": "float8"},
                                     example_args=example_args)
  if how == "rules":
    return jmp_amp.flax.set_policies(
        model, jmp_amp.flax.mixed_rules() | {"*": "float8"},
        example_args=example_args)
  return model  # autocast: the float32 model, FP8 inside the step


def _mlp_case(how):
  batch = (jax.ShapeDtypeStruct((512, 4096), jnp.float32),
           jax.ShapeDtypeStruct((512, 4096), jnp.float32))

  def build():
    model = models.MLP(4096, 4096, num_layers=3, rngs=nnx.Rngs(0),
                       dtype=jnp.bfloat16 if how == "float8" else None)
    return _apply(how, model, batch[:1])
  loss = lambda m, b: models.mse_loss(m(b[0]), b[1])
  return build, batch, loss


def _gpt_case(how):
  batch = jax.ShapeDtypeStruct((8, 1024), jnp.int32)

  def build():
    model = models.GPT(vocab_size=8192, d_model=1024, num_heads=16,
                       num_layers=4, max_len=1024, rngs=nnx.Rngs(0),
                       dtype=jnp.bfloat16 if how == "float8" else None)
    return _apply(how, model, (batch,))
  loss = lambda m, b: models.lm_loss(m(b), b)
  return build, batch, loss


CASES = {"mlp": (_mlp_case, "float8"), "gpt": (_gpt_case, "float8"),
         "mlp-rules": (_mlp_case, "rules"), "gpt-rules": (_gpt_case, "rules"),
         "mlp-autocast": (_mlp_case, "autocast"),
         "gpt-autocast": (_gpt_case, "autocast")}


def run_case(name: str, gemm: str = "default") -> dict:
  case, how = CASES[name]
  build, batch, loss = case(how)
  # The paths of the FP8 layers: their policies (abstract histories have no
  # values to read).
  abstract_model = nnx.eval_shape(build)
  fp8_layers = sorted(
      p for p, pol in jmp_amp.flax.get_policies(abstract_model).items()
      if isinstance(pol, flax_fp8.FP8Policy))
  kernel_shapes = _kernel_shapes(abstract_model)
  tx = optax.sgd(1e-3)
  if how == "autocast":
    # make_train_step needs loss_scaling; FP8 needs no loss scale.
    tx = jmp_amp.loss_scaling(tx, jmp_amp.NoOpLossScale())
  graphdef, state = _abstract(build, tx)
  make_step = _autocast_train_step if how == "autocast" else _train_step
  report = jmp_amp.gpu_report(make_step(loss), graphdef, state, batch,
                              static_argnums=0, donate_argnums=1, gemm=gemm)
  # Fused attention calls (cuDNN) are no GEMMs: the attention stays half.
  gemms = [_gemm(r) for r in report.matmuls if r.kind != "attention"]
  sig = collections.Counter(f"{g['lhs']} x {g['rhs']} -> {g['out']}"
                            for g in gemms)
  n = len(fp8_layers)
  roles = collections.Counter(_role(g, kernel_shapes) for g in gemms)
  fwd, dgrad, wgrad = roles["fwd"], roles["dgrad"], roles["wgrad"]
  wgrad_order = collections.Counter(
      f"{g['lhs']} x {g['rhs']}" for g in gemms
      if _role(g, kernel_shapes) == "wgrad")
  if how == "autocast":
    # No FP8 modules: every GEMM of the step should be FP8.
    n = None
    ok = bool(gemms) and all(g["lhs"] in F8 and g["rhs"] in F8
                             for g in gemms)
  else:
    # Each FP8 layer: exactly one GEMM of each role, all in that layer.
    per_layer = collections.Counter(
        (g["layer"], _role(g, kernel_shapes)) for g in gemms
        if _role(g, kernel_shapes))
    ok = (fwd == dgrad == wgrad == n and all(
        per_layer[(layer, role)] == 1 for layer in fp8_layers
        for role in ("fwd", "dgrad", "wgrad")))
  # The matmul audit's own spelling of the same GEMMs.
  audit = {"by_signature": report.matmuls.counts_by_signature()}
  return dict(
      applied_with={"float8": "jmp_amp.flax.set_policies({'*': 'float8'})",
                    "rules": "jmp_amp.flax.set_policies(mixed_rules() | "
                             "{'*': 'float8'})",
                    "autocast": "make_train_step(autocast='float8')"}[how],
      fp8_layers=fp8_layers,
      gemm_signatures=dict(sig),
      expected=(dict(every_gemm="f8 x f8") if n is None else
                dict(fwd=n, dgrad=n, wgrad=n)),
      found=dict(fwd=fwd, dgrad=dgrad, wgrad=wgrad),
      roles=("fwd: f8e4m3fn x f8e4m3fn; dgrad, wgrad: one f8e5m2 and one "
             "f8e4m3fn operand in either order, wgrad the one whose result "
             "has the layer's kernel shape"),
      wgrad_order=dict(wgrad_order),
      every_fp8_layer_has_fp8_gemms=ok,
      fp8_gemm_targets=sorted({g["target"] for g in gemms
                               if g["lhs"] in F8}),
      matmul_report=audit,
      temp_bytes=report.memory["temp_bytes"],
      gemms=gemms)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--cases", nargs="*", default=list(CASES))
  parser.add_argument("--gemm", choices=list(gpu_target.GEMM_BACKENDS),
                      default="default",
                      help="compiler options: XLA's default (Triton GEMMs) "
                           "or cublas (Triton GEMMs off, labelled)")
  parser.add_argument("--out", default=None,
                      help="default benchmarks/results/fp8_h100.json "
                           "(fp8_h100_cublas.json with --gemm cublas)")
  args = parser.parse_args(argv)
  if args.out is None:
    args.out = str(ROOT / "benchmarks" / "results" / (
        "fp8_h100.json" if args.gemm == "default" else
        f"fp8_h100_{args.gemm}.json"))
  results = {"label": gpu_target.label("h100", args.gemm),
             "gemm": args.gemm,
             "gemm_options": gpu_target.GEMM_BACKENDS[args.gemm],
             "what": "GEMMs in the optimized XLA:GPU program of FP8 "
                     "train steps, compiled for an H100 SXM without a GPU "
                     "(jmp_amp.gpu_report, "
                     + ("XLA's default options: Triton GEMM fusions or "
                        "cuBLAS calls as XLA picks them, untuned since no "
                        "GPU autotunes here" if args.gemm == "default" else
                        "Triton GEMMs off: xla_gpu_enable_triton_gemm=False")
                     + "); compiler facts, not timings",
             "jax": jax.__version__}
  for name in args.cases:
    r = run_case(name, args.gemm)
    results[name] = r
    print(f"== {name} ({r['applied_with']}): FP8 layers {r['fp8_layers']}")
    for s, c in sorted(r["gemm_signatures"].items()):
      print(f"   {c:3d} x  {s}")
    if CASES[name][1] == "autocast":
      print(f"   expected: every GEMM f8 x f8 -> "
            f"{'OK' if r['every_fp8_layer_has_fp8_gemms'] else 'MISSING'}")
    else:
      print(f"   expected per FP8 layer: 1 fwd e4m3xe4m3, 1 dgrad and 1 wgrad"
            f" e5m2/e4m3 -> found {r['found']} for "
            f"{len(r['fp8_layers'])} layers (wgrad spelled "
            f"{r['wgrad_order']}): "
            f"{'OK' if r['every_fp8_layer_has_fp8_gemms'] else 'MISSING'}")
    print(f"   targets {r['fp8_gemm_targets']}; matmul_report "
          f"{r['matmul_report']}")
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(results, indent=1) + "\n")
  print(f"wrote {out}")
  ok = all(results[n]["every_fp8_layer_has_fp8_gemms"] for n in args.cases)
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
