"""Models that are not Flax: an Equinox MLP trained and audited as its users
would, with `jmp_amp.autocast` or a jmp-style policy, and `loss_scaling`."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from helpers import tree_bytes_equal
import jmp_amp

eqx = pytest.importorskip("equinox")

POLICY = jmp_amp.get_policy("p=f32,c=f16,o=f32")
STEPS = 50
# Each step's fp16 loss is within 1% of the float32 run's (measured: 0.15%
# at most, the gap growing with the step).
RTOL = 0.01


def mse(model, x, y):
  return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def policy_mse(model, x, y):
  """jmp's recipe: cast params and inputs to compute, outputs back."""
  pred = jax.vmap(POLICY.cast_to_compute(model))(POLICY.cast_to_compute(x))
  return jnp.mean((POLICY.cast_to_output(pred) - y) ** 2)


LOSSES = {"autocast": jmp_amp.autocast(mse, POLICY), "policy": policy_mse}


def mlp():
  return eqx.nn.MLP(8, 2, 32, 2, key=jax.random.key(0))


def regression_batch(n=128):
  kx, kw = jax.random.split(jax.random.key(1))
  x = jax.random.normal(kx, (n, 8))
  return x, jnp.sin(x @ jax.random.normal(kw, (8, 2)))


def make_step(loss_fn, opt, scaled):
  """The train step an Equinox user writes: differentiate the float arrays,
  keep the rest (the activation function) static."""

  @eqx.filter_jit
  def step(model, opt_state, x, y):
    params, static = eqx.partition(model, eqx.is_inexact_array)
    loss_of = lambda p, x, y: loss_fn(eqx.combine(p, static), x, y)
    if scaled:
      loss, grads = jmp_amp.scaled_value_and_grad(loss_of)(opt_state, params,
                                                           x, y)
    else:
      loss, grads = jax.value_and_grad(loss_of)(params, x, y)
    updates, opt_state = opt.update(grads, opt_state, params)
    return eqx.apply_updates(model, updates), opt_state, loss

  return step


def train(loss_fn, opt, scaled, steps=STEPS):
  model, (x, y) = mlp(), regression_batch()
  opt_state = opt.init(eqx.filter(model, eqx.is_inexact_array))
  step, losses = make_step(loss_fn, opt, scaled), []
  for _ in range(steps):
    model, opt_state, loss = step(model, opt_state, x, y)
    losses.append(float(loss))
  return np.array(losses), opt_state


@pytest.fixture(scope="module")
def float32_losses():
  return train(mse, optax.adam(3e-3), scaled=False)[0]


@pytest.mark.parametrize("how", sorted(LOSSES))
def test_fp16_mlp_follows_the_float32_loss(how, float32_losses):
  opt = jmp_amp.loss_scaling(optax.adam(3e-3),
                             jmp_amp.DynamicLossScale(2.0**15))
  losses, opt_state = train(LOSSES[how], opt, scaled=True)
  np.testing.assert_allclose(losses, float32_losses, rtol=RTOL)
  assert losses[-1] < 0.6 * losses[0], losses  # it trains
  # float16 ran: the losses are not float32's bit for bit.
  assert not np.array_equal(losses, float32_losses)
  assert jmp_amp.get_scaling_state(opt_state).skipped_steps == 0


@pytest.mark.parametrize("how", sorted(LOSSES))
def test_every_matmul_of_the_step_is_float16(how):
  opt = jmp_amp.loss_scaling(optax.adam(3e-3),
                             jmp_amp.DynamicLossScale(2.0**15))
  model, (x, y) = mlp(), regression_batch()
  opt_state = opt.init(eqx.filter(model, eqx.is_inexact_array))
  step = make_step(LOSSES[how], opt, scaled=True)  # an equinox.filter_jit
  for fn, args in ((eqx.filter_grad(LOSSES[how]), (model, x, y)),
                   (step, (model, opt_state, x, y))):
    report = jmp_amp.matmul_report(fn, *args)
    # Three layers forward; backward three weight gradients and two input
    # gradients (the batch needs none).
    assert len(report) == 8, report
    assert report.all_inputs_in("f16"), report.counts_by_signature()


@pytest.mark.parametrize("how", sorted(LOSSES))
def test_an_overflow_step_is_skipped_exactly(how):
  # At 2**30 the scaled float16 cotangents overflow; the loss itself is finite.
  opt = jmp_amp.loss_scaling(optax.adam(3e-3),
                             jmp_amp.DynamicLossScale(2.0**30))
  step = make_step(LOSSES[how], opt, scaled=True)
  model, (x, y) = mlp(), regression_batch()
  opt_state = opt.init(eqx.filter(model, eqx.is_inexact_array))

  new_model, new_state, loss = step(model, opt_state, x, y)
  assert np.isfinite(loss)
  assert tree_bytes_equal(eqx.filter(new_model, eqx.is_array),
                          eqx.filter(model, eqx.is_array))
  before, after = (jmp_amp.get_scaling_state(s) for s in (opt_state, new_state))
  assert tree_bytes_equal(after.inner_state, before.inner_state)
  assert after.skipped_steps == 1 and not after.grads_finite
  assert after.loss_scale.loss_scale == 2.0**29

  # Backed off far enough, a step applies: then the params do change.
  while not jmp_amp.get_scaling_state(new_state).grads_finite:
    new_model, new_state, _ = step(new_model, new_state, x, y)
  state = jmp_amp.get_scaling_state(new_state)
  skipped = int(state.skipped_steps)
  assert 1 < skipped < 30
  assert state.loss_scale.loss_scale == 2.0**(30 - skipped)
  assert not tree_bytes_equal(eqx.filter(new_model, eqx.is_array),
                              eqx.filter(model, eqx.is_array))


def test_matmul_report_takes_the_module_as_argument_or_as_fn():
  half, (x, _) = POLICY.cast_to_compute(mlp()), regression_batch(3)
  x = x.astype(jnp.float16)
  as_argument = jmp_amp.matmul_report(lambda m, x: jax.vmap(m)(x), half, x)
  as_fn = jmp_amp.matmul_report(half, x[0])
  for report in (as_argument, as_fn):
    assert [r.lhs_shape for r in report] == [(32, 8), (32, 32), (2, 32)]
    assert report.counts_by_signature() == {"f16 x f16 -> f16": 3}
  assert [r.rhs_shape for r in as_argument] == [(3, 8), (3, 32), (3, 32)]
  assert [r.rhs_shape for r in as_fn] == [(8,), (32,), (32,)]


def _h100_or_skip():
  try:
    jmp_amp.gpu_report(lambda x: x, jnp.ones(1))
  except (ImportError, RuntimeError) as e:  # the gpu-audit extra is missing
    pytest.skip(f"no compile-only H100 ({e})")


def test_gpu_report_of_a_module_step_donates_the_module():
  _h100_or_skip()
  model, (x, _) = mlp(), regression_batch(64)
  param_bytes = sum(a.nbytes for a in jax.tree_util.tree_leaves(
      eqx.filter(model, eqx.is_array)))

  def sgd_step(model, x):
    grads = eqx.filter_grad(lambda m: jnp.mean(jax.vmap(m)(x) ** 2))(model)
    return eqx.apply_updates(
        model, jax.tree_util.tree_map(lambda g: -0.1 * g, grads))

  kept = jmp_amp.gpu_report(sgd_step, model, x)
  donated = jmp_amp.gpu_report(sgd_step, model, x, donate_argnums=0)
  assert kept.memory["argument_bytes"] == param_bytes + x.nbytes
  assert kept.memory["alias_bytes"] == 0
  assert donated.memory["alias_bytes"] == param_bytes
  assert len(kept.matmuls) >= 3 and kept.matmuls.all_inputs_in("f32")


def test_gpu_report_of_a_module_as_fn_takes_its_params_as_arguments():
  _h100_or_skip()
  layer = eqx.nn.Linear(3, 3, use_bias=False, key=jax.random.key(0))
  x = jnp.ones(3)
  report = jmp_amp.gpu_report(layer, x)
  # The weight is an argument (not a constant folded into the program) ...
  assert report.memory["argument_bytes"] == layer.weight.nbytes + x.nbytes
  # ... and donate_argnums count the call's own arguments: 0 is `x`, whose
  # buffer the (3,) output can reuse (the (3, 3) weight's cannot).
  donated = jmp_amp.gpu_report(layer, x, donate_argnums=0)
  assert donated.memory["alias_bytes"] == x.nbytes
