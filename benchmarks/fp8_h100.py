"""FP8 train steps compiled for an H100 without a GPU: which GEMMs run in FP8.

Compiles the train steps of the reference MLP (PyTorch AMP recipe sizes) and
GPT for an H100 with XLA:GPU's deviceless AOT compiler
(``../shared/tools/aot_h100.py``), three ways, and lists the cuBLAS GEMMs of
the optimized program with their operand dtypes:

* ``mlp``, ``gpt``: `jmp_amp.flax.set_fp8` on the bf16 model (the first and
  last matmul layers, in call order, excluded);
* ``*-rules``: ``set_policies(model, fp8_rules(), example_args=...)`` on the
  float32 model (the same FP8 layers; norms float32, the rest bf16);
* ``*-autocast``: ``make_train_step(..., autocast="float8")`` on the float32
  model: every float32 matmul, attention contractions and the head included.

Every FP8 layer of the first two should contribute three FP8 GEMMs: the
forward ``f8e4m3fn x f8e4m3fn``, and in the backward pass the input gradient
``f8e5m2 x f8e4m3fn`` and the weight gradient ``f8e4m3fn x f8e5m2``. Under
autocast every GEMM should have FP8 operands.

These are compiler facts (what XLA emits for an H100), not timings.

Run (a venv with the jax CUDA plugin, see ../shared/tools/README.md)::

    JAX_PLATFORMS=cpu PYTHONPATH=. .venv-aot/bin/python \\
        benchmarks/fp8_h100.py [--out benchmarks/results/fp8_h100.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TOOLS = pathlib.Path(os.environ.get("AOT_H100_TOOLS",
                                    ROOT.parent / "shared" / "tools"))
sys.path.insert(0, str(TOOLS))

from flax import nnx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import aot_h100  # noqa: E402
import jmp_amp  # noqa: E402
import jmp_amp.flax  # noqa: E402
from jmp_amp.flax import fp8 as flax_fp8  # noqa: E402
import models  # noqa: E402

F8 = ("f8e4m3fn", "f8e5m2")


def _train_step(loss_fn):
  """Pure ``step(graphdef, state, batch) -> state`` with FP8 state updates."""

  def step(graphdef, state, batch):
    model, opt = nnx.merge(graphdef, state)
    grad_fn = flax_fp8.fp8_value_and_grad(lambda m: loss_fn(m, batch))
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
  if how == "set_fp8":
    return flax_fp8.set_fp8(model, example_args=example_args)
  if how == "rules":
    return jmp_amp.flax.set_policies(model, jmp_amp.flax.fp8_rules(),
                                     example_args=example_args)
  return model  # autocast: the float32 model, FP8 inside the step


def _mlp_case(how):
  batch = (jax.ShapeDtypeStruct((512, 4096), jnp.float32),
           jax.ShapeDtypeStruct((512, 4096), jnp.float32))

  def build():
    model = models.MLP(4096, 4096, num_layers=3, rngs=nnx.Rngs(0),
                       dtype=jnp.bfloat16 if how == "set_fp8" else None)
    return _apply(how, model, batch[:1])
  loss = lambda m, b: models.mse_loss(m(b[0]), b[1])
  return build, batch, loss


def _gpt_case(how):
  batch = jax.ShapeDtypeStruct((8, 1024), jnp.int32)

  def build():
    model = models.GPT(vocab_size=8192, d_model=1024, num_heads=16,
                       num_layers=4, max_len=1024, rngs=nnx.Rngs(0),
                       dtype=jnp.bfloat16 if how == "set_fp8" else None)
    return _apply(how, model, (batch,))
  loss = lambda m, b: models.lm_loss(m(b), b)
  return build, batch, loss


CASES = {"mlp": (_mlp_case, "set_fp8"), "gpt": (_gpt_case, "set_fp8"),
         "mlp-rules": (_mlp_case, "rules"), "gpt-rules": (_gpt_case, "rules"),
         "mlp-autocast": (_mlp_case, "autocast"),
         "gpt-autocast": (_gpt_case, "autocast")}


def run_case(name: str) -> dict:
  case, how = CASES[name]
  build, batch, loss = case(how)
  fp8_layers = sorted(flax_fp8.fp8_modules(nnx.eval_shape(build)))
  tx = optax.sgd(1e-3)
  if how == "autocast":
    # make_train_step needs loss_scaling; FP8 needs no loss scale.
    tx = jmp_amp.loss_scaling(tx, jmp_amp.NoOpLossScale())
  graphdef, state = _abstract(build, tx)
  mesh = aot_h100.h100_mesh(1)
  repl = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  state, batch = jax.tree_util.tree_map(
      lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=repl),
      (state, batch))
  make_step = _autocast_train_step if how == "autocast" else _train_step
  jitted = jax.jit(make_step(loss), static_argnums=0, donate_argnums=1)
  compiled = jitted.lower(graphdef, state, batch).compile(
      compiler_options=dict(aot_h100.GEMM_MODES["cublas"]))
  info = aot_h100.analyze_hlo(compiled.as_text())
  gemms = [dict(lhs=g["lhs"], rhs=g["rhs"], out=g["out"],
                out_shape=list(g["out_shape"]), k=g["k"], target=g["where"])
           for g in info["gemms"]]
  sig = collections.Counter(f"{g['lhs']} x {g['rhs']} -> {g['out']}"
                            for g in gemms)
  n = len(fp8_layers)
  fwd = sig_count(gemms, "f8e4m3fn", "f8e4m3fn")
  dgrad = sig_count(gemms, "f8e5m2", "f8e4m3fn")
  wgrad = sig_count(gemms, "f8e4m3fn", "f8e5m2")
  if how == "autocast":
    # No FP8 modules: every GEMM of the step should be FP8.
    n = None
    ok = bool(gemms) and all(g["lhs"] in F8 and g["rhs"] in F8
                             for g in gemms)
  else:
    ok = fwd == dgrad == wgrad == n
  try:
    audit = jmp_amp.matmul_report(compiled).summary()
    audit = {k: v for k, v in audit.items() if k == "by_signature"}
  except Exception as e:  # the audit's view is a bonus, not the evidence
    audit = {"error": f"{type(e).__name__}: {e}"}
  mem = compiled.memory_analysis()
  return dict(
      applied_with={"set_fp8": "jmp_amp.flax.set_fp8",
                    "rules": "jmp_amp.flax.set_policies(fp8_rules())",
                    "autocast": "make_train_step(autocast='float8')"}[how],
      fp8_layers=fp8_layers,
      gemm_signatures=dict(sig),
      expected=(dict(every_gemm="f8 x f8") if n is None else
                dict(fwd_e4m3_x_e4m3=n, dgrad_e5m2_x_e4m3=n,
                     wgrad_e4m3_x_e5m2=n)),
      found=dict(fwd_e4m3_x_e4m3=fwd, dgrad_e5m2_x_e4m3=dgrad,
                 wgrad_e4m3_x_e5m2=wgrad),
      every_fp8_layer_has_fp8_gemms=ok,
      fp8_gemm_targets=sorted({g["target"] for g in gemms
                               if g["lhs"] in F8}),
      matmul_report=audit,
      temp_bytes=int(mem.temp_size_in_bytes),
      gemms=gemms)


def sig_count(gemms, lhs, rhs):
  return sum(g["lhs"] == lhs and g["rhs"] == rhs for g in gemms)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--cases", nargs="*", default=list(CASES))
  parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" /
                                           "fp8_h100.json"))
  args = parser.parse_args(argv)
  results = {"what": "cuBLAS GEMMs in the optimized XLA:GPU program of FP8 "
                     "train steps, compiled for an H100 SXM without a GPU "
                     "(deviceless AOT, xla_gpu_enable_triton_gemm=False); "
                     "compiler facts, not timings",
             "jax": jax.__version__}
  for name in args.cases:
    r = run_case(name)
    results[name] = r
    print(f"== {name} ({r['applied_with']}): FP8 layers {r['fp8_layers']}")
    for s, c in sorted(r["gemm_signatures"].items()):
      print(f"   {c:3d} x  {s}")
    if CASES[name][1] == "autocast":
      print(f"   expected: every GEMM f8 x f8 -> "
            f"{'OK' if r['every_fp8_layer_has_fp8_gemms'] else 'MISSING'}")
    else:
      print(f"   expected per FP8 layer: 1 fwd e4m3xe4m3, 1 dgrad e5m2xe4m3,"
            f" 1 wgrad e4m3xe5m2 -> found {r['found']} for "
            f"{len(r['fp8_layers'])} layers: "
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
