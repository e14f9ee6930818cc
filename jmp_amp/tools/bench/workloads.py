"""The bench's workloads: precision modes, recipes and jitted train steps.

A mode (`JAX_MODES`) is named after its precision policy, which rules or
autocast apply, and sets its loss scaling; a recipe (`RECIPES`) the sizes of
the PyTorch AMP recipe's MLP.
`BUILDERS` turn a mode and a `Config` into a `Workload`: the jitted SGD step of
a reference model (`jmp_amp.models`: MLP, ResNet, GPT) with its state and
batches. The timing (`timing`), the H100 compile (`gpu`) and the torch rows
(`torch_runner`) all start from these.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_amp

# A mode's name is the policy it trains with (`jmp_amp.get_policy`'s name, or
# "float8": FP8 matmuls), so that one name means one thing in the bench and in
# the library: "autocast-" in front when `jmp_amp.autocast` applies it to the
# loss function (outputs kept float32) instead of `set_policies` to the model;
# "-noscale" behind a float16 mode that runs without the dynamic loss scaling
# float16 modes otherwise have (as Keras's mixed_float16 and torch's
# GradScaler); "-highest" behind float32 for float32 matmuls at full precision
# (no TF32 on GPUs). "float8" rules are `mixed_rules() | {"*": "float8"}`.
JAX_MODES: dict[str, dict[str, Any]] = {
    "float32": dict(policy="float32", scale=None),
    "float32-highest": dict(policy="float32", scale=None, precision="highest"),
    "mixed_bfloat16": dict(policy="mixed_bfloat16", scale=None),
    "mixed_float16": dict(policy="mixed_float16", scale="dynamic"),
    "mixed_float16-noscale": dict(policy="mixed_float16", scale=None),
    "autocast-mixed_bfloat16": dict(autocast="mixed_bfloat16", scale=None),
    "autocast-mixed_float16": dict(autocast="mixed_float16", scale="dynamic"),
    "float8": dict(policy="float8", scale=None),
    "autocast-float8": dict(autocast="float8", scale=None),
}
FP8_MODES = tuple(name for name, mode in JAX_MODES.items()
                  if "float8" in (mode.get("policy"), mode.get("autocast")))
DEFAULT_MODES = ("float32", "float32-highest", "mixed_bfloat16",
                 "mixed_float16", "mixed_float16-noscale")
# The recipe's three PyTorch modes; both AMP rows autocast to float16, as the
# recipe does (the row's matmuls cell says the dtype autocast really used).
TORCH_MODES = ("torch-float32", "torch-autocast", "torch-autocast+scaler")

RECIPES: dict[str, dict[str, Any]] = {
    # Small enough for about a minute on a 2-core CPU, all modes included.
    "small": dict(width=512, layers=3, batch_size=128, batches=10, epochs=2),
    # The PyTorch AMP recipe exactly.
    "seed": dict(width=4096, layers=3, batch_size=512, batches=50, epochs=3),
    # Large matmuls: measures achieved TFLOP/s against the matmul peak.
    "compute-bound": dict(width=8192, layers=3, batch_size=4096, batches=10,
                          epochs=2),
}


@dataclasses.dataclass
class Config:
  model: str
  width: int
  layers: int
  batch_size: int
  batches: int
  epochs: int
  steps: int
  warmup: int
  lr: float
  seed: int
  init_scale: float
  repeats: int = 1


@dataclasses.dataclass
class Workload:
  """A jitted train step with its initial state and data."""
  step: Callable[..., Any]     # (state, batch) -> (state, metrics), jitted
  state: Any
  batches: list[Any]
  batch_size: int
  flops_per_step: Optional[float]  # model FLOPs (matmuls), None if unknown


def _loss_scale_for(mode: dict[str, Any], init_scale: float):
  if mode.get("scale") == "dynamic":
    return jmp_amp.DynamicLossScale(init_scale)
  return jmp_amp.NoOpLossScale()


# The XLA options `jmp_amp.flax.make_train_step` compiles a step that runs
# FP8 GEMMs with (docs/benchmarks.md says why: on an H200 XLA's autotuner
# timed Triton kernels for minutes, then chose cuBLAS for every FP8 GEMM).
# The bench jits its steps itself, and compiles them as make_train_step
# would (tests/test_bench.py holds the two to the same options).
def step_compiler_options(model, autocast: Any = None,
                          platform: Optional[str] = None
                          ) -> Optional[dict[str, Any]]:
  """The XLA options `make_train_step` compiles `model`'s step with on
  `platform` (None: JAX's default backend): `jmp_amp.fp8.compiler_options`
  when the step runs FP8 GEMMs (the model has FP8 layers, which hold an
  `FP8Meta`, or `autocast` names FP8), else None."""
  from flax import nnx  # pylint: disable=g-import-not-at-top

  import jmp_amp.flax.fp8  # pylint: disable=g-import-not-at-top
  fp8 = (isinstance(autocast, str)
         and autocast.strip().lower() in ("float8", "fp8", "f8"))
  if fp8 or jax.tree.leaves(nnx.state(model, jmp_amp.flax.fp8.FP8Meta)):
    return jmp_amp.fp8.compiler_options(platform=platform) or None
  return None


def nnx_step(model, loss_of_output: Callable[..., Any], mode: dict[str, Any],
             tx: optax.GradientTransformation, init_scale: float = 2.0**15,
             example_args: Optional[tuple] = None):
  """(jitted step, state): ``step(state, batch) -> (state, metrics)``.

  Policies come from `jmp_amp.flax.set_policies` (or op-level autocast;
  `example_args`, the model's inputs, tell FP8 rules the call order), loss
  scaling wraps `tx`. The model and optimizer are split once into a graphdef
  and a state pytree, so each step is a plain `jax.jit` call with the state
  donated: no per-step Python graph traversal, which would dominate
  sub-millisecond GPU steps. `jmp_amp.tools.bench.gpu` compiles the same
  steps.
  """
  from flax import nnx  # pylint: disable=g-import-not-at-top

  import jmp_amp.flax as jflax  # pylint: disable=g-import-not-at-top

  if mode.get("policy") == "float8":
    # FP8 matmuls but the first and last, norms float32, the rest bf16.
    jflax.set_policies(model, jflax.mixed_rules() | {"*": "float8"},
                       example_args=example_args)
  elif mode.get("policy") not in (None, "float32"):
    half = jmp_amp.get_policy(mode["policy"]).compute_dtype
    jflax.set_policies(model, jflax.mixed_rules(half))
  tx = jmp_amp.loss_scaling(tx, _loss_scale_for(mode, init_scale))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  inner = jflax.make_train_step(
      lambda m, batch: loss_of_output(m(batch[0]), batch[1]),
      autocast=mode.get("autocast"), jit=False)
  graphdef, state = nnx.split((model, optimizer))

  def step(state, batch):
    model, optimizer = nnx.merge(graphdef, state)
    metrics = inner(model, optimizer, batch)
    return nnx.state((model, optimizer)), metrics

  # As make_train_step compiles it: Triton GEMMs off for FP8 GEMMs.
  options = step_compiler_options(model, mode.get("autocast"))
  return jax.jit(step, donate_argnums=0, compiler_options=options), state


def _nnx_workload(model, loss_of_output, mode, cfg, batches, flops,
                  batch_size) -> Workload:
  """The bench's SGD step (`nnx_step`) for `model`, with its batches."""
  step, state = nnx_step(model, loss_of_output, mode, optax.sgd(cfg.lr),
                         cfg.init_scale, example_args=batches[0][:1])
  return Workload(step, state, batches, batch_size, flops)


def mlp_data(cfg: Config) -> tuple[np.ndarray, np.ndarray]:
  """The MLP's batches (numpy): the same for the JAX and the torch rows."""
  from jmp_amp.models import data as data_lib  # pylint: disable=g-import-not-at-top
  return data_lib.regression_batches(cfg.batches, cfg.batch_size, cfg.width,
                                     cfg.width, seed=cfg.seed)


def mlp_initial_weights(cfg: Config) -> list[tuple[np.ndarray, np.ndarray]]:
  """The MLP's initial ``(kernel [in, out], bias)`` per layer, as numpy.

  The torch rows start from these, so both frameworks train the same weights.
  """
  from flax import nnx  # pylint: disable=g-import-not-at-top

  from jmp_amp.models import mlp as mlp_lib  # pylint: disable=g-import-not-at-top
  model = mlp_lib.MLP(cfg.width, cfg.width, num_layers=cfg.layers,
                      rngs=nnx.Rngs(cfg.seed))
  return [(np.asarray(layer.kernel[...]), np.asarray(layer.bias[...]))
          for layer in model.layers]


def build_mlp(mode: dict[str, Any], cfg: Config) -> Workload:
  from flax import nnx  # pylint: disable=g-import-not-at-top

  from jmp_amp.models import mlp as mlp_lib  # pylint: disable=g-import-not-at-top

  model = mlp_lib.MLP(cfg.width, cfg.width, num_layers=cfg.layers,
                      rngs=nnx.Rngs(cfg.seed))
  xs, ys = mlp_data(cfg)
  batches = [(jnp.asarray(x), jnp.asarray(y)) for x, y in zip(xs, ys)]
  flops = 6.0 * cfg.batch_size * cfg.width * cfg.width * cfg.layers
  return _nnx_workload(model, mlp_lib.mse_loss, mode, cfg, batches, flops,
                       cfg.batch_size)


def build_resnet(mode: dict[str, Any], cfg: Config) -> Workload:
  from flax import nnx  # pylint: disable=g-import-not-at-top

  from jmp_amp.models import data as data_lib  # pylint: disable=g-import-not-at-top
  from jmp_amp.models import resnet as resnet_lib  # pylint: disable=g-import-not-at-top

  model = resnet_lib.ResNet(rngs=nnx.Rngs(cfg.seed))
  batches = []
  for i in range(cfg.batches):
    x, y = data_lib.image_batch(cfg.batch_size, 10, seed=cfg.seed + i)
    batches.append((jnp.asarray(x), jnp.asarray(y)))
  return _nnx_workload(model, resnet_lib.cross_entropy_loss, mode, cfg,
                       batches, None, cfg.batch_size)


def build_gpt(mode: dict[str, Any], cfg: Config) -> Workload:
  from flax import nnx  # pylint: disable=g-import-not-at-top

  from jmp_amp.models import data as data_lib  # pylint: disable=g-import-not-at-top
  from jmp_amp.models import gpt as gpt_lib  # pylint: disable=g-import-not-at-top

  model = gpt_lib.GPT(rngs=nnx.Rngs(cfg.seed))
  batches = []
  for i in range(cfg.batches):
    tokens = jnp.asarray(data_lib.token_batch(cfg.batch_size, 64, 256,
                                              seed=cfg.seed + i))
    batches.append((tokens, tokens))
  return _nnx_workload(model, gpt_lib.lm_loss, mode, cfg, batches, None,
                       cfg.batch_size)


BUILDERS = {"mlp": build_mlp, "resnet": build_resnet, "gpt": build_gpt}


def precision_context(name: str):
  """The matmul precision mode `name` runs under (a no-op for most modes)."""
  precision = JAX_MODES[name].get("precision")
  return (jax.default_matmul_precision(precision) if precision
          else contextlib.nullcontext())
