"""Tests for jmp_amp.flax.train: mixed-precision train steps, NNX and linen."""

import functools

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from helpers import pure
from helpers import tree_bytes_equal
import jmp_amp
import jmp_amp.flax as jf
from jmp_amp.flax.train import TrainState
import models
import test_flax_models as tm

F32 = np.dtype(np.float32)


TRACES = []  # one entry per trace of model_loss


def model_loss(model, batch):
  """The reference models' own float32 losses; `model` is NNX or linen."""
  TRACES.append(None)
  if isinstance(model, (models.GPT, tm.KnoblessGPT)):
    return models.lm_loss(model(batch), batch)
  x, y = batch
  if y.dtype == jnp.int32:
    return models.cross_entropy_loss(model(x), y)
  return models.mse_loss(model(x), y)


def scaled_adam(lr=1e-2, scale=2.0 ** 15):
  loss_scale = (jmp_amp.NoOpLossScale() if scale is None
                else jmp_amp.DynamicLossScale(scale))
  return jmp_amp.loss_scaling(optax.adam(lr), loss_scale)


# XLA:CPU's optimising backend takes seconds per tiny train step; the tests
# check what the program computes, not how fast.
FAST_COMPILE = {"xla_backend_optimization_level": 0}
# Shared by the tests, so that the jit cache serves equal models (the
# optimizer's transformation is part of the static graph definition).
NNX_STEP = jf.make_train_step(model_loss, compiler_options=FAST_COMPILE)
TX_F16 = scaled_adam()
TX_BF16 = scaled_adam(scale=None)


def leaves_dtypes(tree):
  return {np.dtype(x.dtype) for x in jax.tree_util.tree_leaves(tree)}


def host(tree):
  # Copies: a zero-copy view of a CPU buffer would keep it from being donated.
  return jax.tree_util.tree_map(lambda x: np.array(x, copy=True), tree)


NNX_CASES = {
    "mlp": (tm.mlp, tm.mlp_batch),
    "resnet": (tm.resnet, tm.image_batch),
    "gpt": (tm.gpt, tm.token_batch),
    "knobless_gpt": (lambda: tm.knobless_gpt(depth=1), tm.token_batch),
}


@pytest.mark.slow
@pytest.mark.parametrize("name,compute", [
    ("mlp", "bfloat16"), ("mlp", "float16"), ("resnet", "float16"),
    ("gpt", "float16"), ("knobless_gpt", "bfloat16")])
def test_nnx_models_train_under_mixed_precision(name, compute):
  build, make_batch = NNX_CASES[name]
  model = jf.set_policies(build(), jf.mixed_rules(compute))
  optimizer = nnx.Optimizer(
      model, TX_BF16 if compute == "bfloat16" else TX_F16, wrt=nnx.Param)
  step = NNX_STEP
  batch = make_batch()
  losses, traces = [], len(TRACES)
  for _ in range(8):
    param = jax.tree_util.tree_leaves(nnx.state(model, nnx.Param))[0]
    metrics = step(model, optimizer, batch)
    assert param.is_deleted()  # the model and optimizer are donated
    losses.append(float(metrics["loss"]))
  assert len(TRACES) - traces <= 1  # traced (and compiled) at most once
  assert np.all(np.isfinite(losses)) and losses[-1] < 0.9 * losses[0], losses
  assert metrics["loss"].dtype == F32
  assert bool(metrics["grads_finite"]) and int(metrics["skipped_steps"]) == 0
  assert int(metrics["steps"]) == 8
  assert leaves_dtypes(nnx.state(model, nnx.Param)) == {F32}
  assert leaves_dtypes(nnx.state(model, nnx.BatchStat)) <= {F32}
  # The scale lives on inside nnx.Optimizer's Variable-wrapped state.
  scaling = jmp_amp.get_scaling_state(pure(optimizer.opt_state))
  assert isinstance(scaling, jmp_amp.LossScalingState)
  assert float(metrics["loss_scale"]) == float(scaling.loss_scale.loss_scale)


def test_nnx_skipped_step_changes_nothing_but_the_scale():
  model = jf.set_policies(tm.resnet(), jf.mixed_rules("float16"))
  optimizer = nnx.Optimizer(model, TX_F16, wrt=nnx.Param)
  step = NNX_STEP
  x, y = tm.image_batch()
  step(model, optimizer, (x, y))
  before = host((nnx.state(model), nnx.state(optimizer)))

  # An inf input overflows the forward pass: the gradients and the batch
  # statistics of this step are NaN.
  metrics = step(model, optimizer, (x.at[0, 0, 0, 0].set(jnp.inf), y))
  assert not bool(metrics["grads_finite"])
  assert int(metrics["skipped_steps"]) == 1 and int(metrics["steps"]) == 2
  assert float(metrics["loss_scale"]) == 2.0 ** 14
  after_model = host(nnx.state(model))
  assert tree_bytes_equal(after_model, before[0])  # params AND batch stats
  inner = lambda s: pure(s)["opt_state"].inner_state
  assert tree_bytes_equal(inner(host(nnx.state(optimizer))),
                          inner(before[1]))

  metrics = step(model, optimizer, (x, y))
  assert bool(metrics["grads_finite"])
  stats = nnx.state(model, nnx.BatchStat)
  assert all(np.isfinite(s).all() for s in jax.tree_util.tree_leaves(stats))


def test_nnx_autocast_instead_of_module_policies():
  x, y = tm.mlp_batch()
  model = tm.mlp()  # no set_policies: op-level autocast
  optimizer = nnx.Optimizer(model, scaled_adam(), wrt=nnx.Param)
  step = jf.make_train_step(model_loss, autocast="float16",
                            compiler_options=FAST_COMPILE)
  report = jmp_amp.matmul_report(step, model, optimizer, (x, y))
  assert len(report) >= 8 and report.all_inputs_in("f16"), str(report)
  first = float(step(model, optimizer, (x, y))["loss"])
  for _ in range(5):
    metrics = step(model, optimizer, (x, y))
  assert float(metrics["loss"]) < first
  assert leaves_dtypes(nnx.state(model, nnx.Param)) == {F32}


def test_nnx_autocast_callable_hook_and_aux():
  calls = []

  def hook(fn):  # any fn -> fn transformation of the pure loss function
    calls.append(fn)
    return fn

  def loss_fn(model, batch):
    out = model(batch[0])
    return models.mse_loss(out, batch[1]), {"out_half": jnp.array(
        out.dtype == jnp.bfloat16)}

  model = jf.set_policies(tm.mlp(), "mixed_bfloat16")
  optimizer = nnx.Optimizer(model, TX_BF16, wrt=nnx.Param)
  step = jf.make_train_step(loss_fn, has_aux=True, autocast=hook,
                            compiler_options=FAST_COMPILE)
  metrics = step(model, optimizer, tm.mlp_batch())
  assert len(calls) == 1
  assert bool(metrics["aux"]["out_half"])
  assert set(metrics) == {"loss", "loss_scale", "grads_finite",
                          "skipped_steps", "steps", "aux"}


def test_nnx_step_errors():
  model = tm.mlp()
  step = jf.make_train_step(model_loss, jit=False)
  with pytest.raises(ValueError, match="loss_scaling"):
    step(model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param),
         tm.mlp_batch(4))
  with pytest.raises(TypeError, match="nnx.Optimizer"):
    step(model, scaled_adam(), tm.mlp_batch(4))
  with pytest.raises(TypeError, match="autocast"):
    jf.make_train_step(model_loss, autocast=42)
  bad = jf.make_train_step(lambda m, b: m(b[0]))  # fails while tracing
  with pytest.raises(TypeError, match="scalar"):
    bad(model, nnx.Optimizer(model, scaled_adam(), wrt=nnx.Param),
        tm.mlp_batch(4))


def test_bf16_with_a_plain_optax_optimizer_says_use_noop_loss_scale():
  # (#35) docs/loss-scaling.md said bf16 needs no wrapper; the step needs
  # one, and the error names it.
  model = tm.mlp()
  jf.set_policies(model, "mixed_bfloat16")
  step = jf.make_train_step(model_loss, jit=False)
  with pytest.raises(ValueError, match=r"jmp_amp\.loss_scaling\(inner, "
                     r"jmp_amp\.NoOpLossScale\(\)\) for bfloat16"):
    step(model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param),
         tm.mlp_batch(4))
  params = models.linen_params_from_nnx(tm.mlp())["params"]
  state = TrainState.create(
      apply_fn=functools.partial(jf.apply_with_policies, tm.linen_mlp(),
                                 "mixed_bfloat16"),
      params=params, tx=optax.sgd(0.1))
  with pytest.raises(ValueError, match=r"NoOpLossScale\(\)\) for bfloat16"
                     r"[^(]*$"):
    jf.make_linen_train_step(model_loss, jit=False)(state, tm.mlp_batch(4))


# --------------------------------------------------------------------------
# linen.


def test_linen_mlp_trains_like_the_nnx_mlp():
  rules = jf.mixed_rules("float16")  # as the NNX MLP case above: cache hit
  batch = tm.mlp_batch()
  nnx_model = tm.mlp()
  # Copies: the linen step donates its state's buffers.
  params = jax.tree_util.tree_map(
      jnp.copy, models.linen_params_from_nnx(nnx_model)["params"])
  jf.set_policies(nnx_model, rules)
  optimizer = nnx.Optimizer(nnx_model, TX_F16, wrt=nnx.Param)
  nnx_step = NNX_STEP

  state = TrainState.create(
      apply_fn=functools.partial(jf.apply_with_policies, tm.linen_mlp(),
                                 rules),
      params=params, tx=scaled_adam())
  linen_step = jf.make_linen_train_step(model_loss,
                                        compiler_options=FAST_COMPILE)

  nnx_losses, linen_losses = [], []
  for _ in range(8):
    nnx_losses.append(float(nnx_step(nnx_model, optimizer, batch)["loss"]))
    state, metrics = linen_step(state, batch)
    linen_losses.append(float(metrics["loss"]))
  assert nnx_losses[0] == linen_losses[0]  # same weights, same policy
  np.testing.assert_allclose(linen_losses, nnx_losses, rtol=2e-3)
  assert linen_losses[-1] < 0.9 * linen_losses[0]
  assert leaves_dtypes(state.params) == {F32}
  assert int(metrics["steps"]) == 8 and int(metrics["skipped_steps"]) == 0


@pytest.mark.slow
def test_linen_resnet_trains_and_skipped_steps_keep_batch_stats():
  rules = jf.mixed_rules("float16")
  module = tm.linen_resnet()
  x, y = tm.image_batch()
  variables = tm.linen_init(module, x)
  initial_stats = host(variables["batch_stats"])
  state = TrainState.create(
      apply_fn=functools.partial(jf.apply_with_policies, module, rules),
      params=variables["params"], tx=scaled_adam(),
      batch_stats=variables["batch_stats"])
  step = jf.make_linen_train_step(model_loss, compiler_options=FAST_COMPILE)

  losses = []
  for _ in range(8):
    old_stats = state.batch_stats
    state, metrics = step(state, (x, y))
    losses.append(float(metrics["loss"]))
    assert old_stats["stem_bn"]["mean"].is_deleted()  # donated
  assert losses[-1] < 0.9 * losses[0], losses
  assert leaves_dtypes(state.params) == leaves_dtypes(state.batch_stats) == {
      F32}
  assert not tree_bytes_equal(host(state.batch_stats), initial_stats)

  before = host((state.params, state.batch_stats))
  state, metrics = step(state, (x.at[0, 0, 0, 0].set(jnp.nan), y))
  assert not bool(metrics["grads_finite"])
  assert int(metrics["skipped_steps"]) == 1
  assert float(metrics["loss_scale"]) == 2.0 ** 14
  assert tree_bytes_equal(host((state.params, state.batch_stats)), before)


def test_linen_step_without_mutable_collections_and_with_autocast():
  module = tm.linen_mlp()
  x, y = tm.mlp_batch()
  params = tm.linen_init(module, x)["params"]
  state = TrainState.create(apply_fn=module.apply, params=params,
                            tx=scaled_adam())
  step = jf.make_linen_train_step(model_loss, autocast="bfloat16",
                                  donate=False, compiler_options=FAST_COMPILE)
  report = jmp_amp.matmul_report(step, state, (x, y))
  assert len(report) >= 8 and report.all_inputs_in("bf16"), str(report)
  first = None
  for _ in range(5):
    state, metrics = step(state, (x, y))
    first = first or float(metrics["loss"])
  assert float(metrics["loss"]) < first
  assert state.batch_stats is None


def test_donated_step_equals_undonated():
  # Donating the state must not change what a step computes (jax 0.8.1's
  # XLA:CPU got this wrong for this step, which set the version floor).
  inputs, targets = models.data.regression_batches(1, 128, 256, 256, seed=0)
  batch = (jnp.asarray(inputs[0]), jnp.asarray(targets[0]))
  losses, params = {}, {}
  for donate in (True, False):
    model = models.MLP(256, 256, 3, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, jmp_amp.loss_scaling(
        optax.sgd(0.1), jmp_amp.DynamicLossScale(2.0**15)), wrt=nnx.Param)
    step = jf.make_train_step(lambda m, b: models.mse_loss(m(b[0]), b[1]),
                              donate=donate)
    losses[donate] = [float(step(model, opt, batch)["loss"]) for _ in range(4)]
    params[donate] = pure(nnx.state(model, nnx.Param))
  assert losses[True][3] < losses[True][0] * 0.97  # the updates are applied
  assert losses[True] == losses[False]
  assert tree_bytes_equal(params[True], params[False])
