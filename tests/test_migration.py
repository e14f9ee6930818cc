"""The README's migration table: jmp_amp settings that reproduce the loss-scale
trajectories of jmp, Flax's DynamicScale, Keras's LossScaleOptimizer and
torch's GradScaler on the same fault sequences.

Flax runs live (it is a dependency). Keras, torch and jmp are compared against
trajectories recorded from them (tests/data/, written by
tests/data/record_reference_trajectories.py), and live as well when Keras or
torch is importable.
"""

import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_amp
from reference_scenarios import SCENARIOS

DATA = json.loads((pathlib.Path(__file__).parent / "data" /
                   "reference_trajectories.json").read_text())


def finite_steps(scenario):
  faults = set(scenario["faults"])
  return [i not in faults for i in range(scenario["steps"])]


def jmp_amp_scales(loss_scale, finite):
  """The scale after each step, from `DynamicLossScale.adjust` under jit."""
  def body(ls, ok):
    ls = ls.adjust(ok)
    return ls, ls.loss_scale
  _, scales = jax.jit(lambda ls, f: jax.lax.scan(body, ls, f))(
      loss_scale, jnp.asarray(finite))
  return [float(s) for s in scales]


# The README's table, one entry per library: settings -> jmp_amp equivalent.
# GradScaler(s, growth_factor=2, backoff_factor=.5, growth_interval=N)
def torch_equivalent(s):
  return jmp_amp.DynamicLossScale(s["init_scale"], period=s["interval"],
                                  factor=2, backoff_factor=0.5,
                                  min_loss_scale=0.0)


# LossScaleOptimizer(initial_scale=s, dynamic_growth_steps=N)
def keras_equivalent(s):
  return jmp_amp.DynamicLossScale(s["init_scale"], period=s["interval"],
                                  factor=2, backoff_factor=0.5,
                                  min_loss_scale=0.0)


def flax_equivalent(s):    # DynamicScale(growth_interval=N, scale=s)
  return jmp_amp.DynamicLossScale(s["init_scale"], period=s["interval"] + 1,
                                  factor=2, backoff_factor=0.5,
                                  min_loss_scale=0.0)


def jmp_equivalent(s):     # jmp.DynamicLossScale(s, period=N, factor=2)
  return jmp_amp.DynamicLossScale(jnp.float32(s["init_scale"]),
                                  period=s["interval"], factor=2)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
@pytest.mark.parametrize("library, equivalent", [
    ("torch", torch_equivalent), ("keras", keras_equivalent),
    ("jmp", jmp_equivalent)])
def test_recorded_trajectories_match(name, library, equivalent):
  scenario = SCENARIOS[name]
  assert DATA[name]["scenario"] == scenario, "re-record tests/data"
  recorded = DATA[name][library]["scales"]
  ours = jmp_amp_scales(equivalent(scenario), finite_steps(scenario))
  assert ours == recorded  # exact: powers of two
  changes = [b != a for a, b in zip(recorded, recorded[1:])]
  assert any(changes)


def test_scenarios_exercise_growth_backoff_and_the_floor():
  below = DATA["below_one"]
  assert min(below["torch"]["scales"]) < 1  # torch has no floor of 1 ...
  assert min(below["keras"]["scales"]) < 1  # ... nor has Keras
  assert min(below["jmp"]["scales"]) == 1   # jmp floors at 1
  default = DATA["torch_defaults"]["torch"]["scales"]
  assert any(b > a for a, b in zip(default, default[1:]))


def test_default_floor_differs_from_torch_only_below_one():
  scenario = SCENARIOS["below_one"]
  with_floor = jmp_amp.DynamicLossScale(scenario["init_scale"],
                                        period=scenario["interval"], factor=2,
                                        backoff_factor=0.5)
  ours = jmp_amp_scales(with_floor, finite_steps(scenario))
  torch_scales = DATA["below_one"]["torch"]["scales"]
  assert ours != torch_scales
  assert [max(t, 1.0) for t in torch_scales][:5] == ours[:5]


def flax_scales(scenario):
  from flax.training import dynamic_scale  # pylint: disable=g-import-not-at-top
  dyn = dynamic_scale.DynamicScale(growth_factor=2.0, backoff_factor=0.5,
                                   growth_interval=scenario["interval"],
                                   scale=scenario["init_scale"])

  def fun(p, fault):
    # The gradient is inf exactly on the faulty steps.
    return p * jnp.where(fault, jnp.inf, 1.0)

  def body(dyn, fault):
    dyn, _, _, _ = dyn.value_and_grad(fun)(jnp.float32(1.0), fault)
    return dyn, dyn.scale

  faults = ~jnp.asarray(finite_steps(scenario))
  _, scales = jax.jit(lambda d, f: jax.lax.scan(body, d, f))(dyn, faults)
  return [float(s) for s in scales]


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_flax_dynamic_scale_live(name):
  scenario = SCENARIOS[name]
  theirs = flax_scales(scenario)
  assert jmp_amp_scales(flax_equivalent(scenario),
                        finite_steps(scenario)) == theirs
  # The same numbers (period=N) would grow one step earlier than Flax.
  assert jmp_amp_scales(torch_equivalent(scenario),
                        finite_steps(scenario)) != theirs


def test_keras_live_when_installed():
  os.environ.setdefault("KERAS_BACKEND", "jax")
  keras = pytest.importorskip("keras")
  if keras.backend.backend() != "jax":
    pytest.skip(f"keras uses the {keras.backend.backend()} backend")
  scenario = SCENARIOS["below_one"]
  var = keras.Variable(np.zeros((2,), np.float32))
  opt = keras.optimizers.LossScaleOptimizer(
      keras.optimizers.SGD(0.0), initial_scale=scenario["init_scale"],
      dynamic_growth_steps=scenario["interval"])
  opt.build([var])
  opt_values, values = [v.value for v in opt.variables], [var.value]
  scales = []
  for finite in finite_steps(scenario):
    grad = np.ones((2,), np.float32) * (1.0 if finite else np.inf)
    values, opt_values = opt.stateless_apply(opt_values, [grad], values)
    for v, value in zip(opt.variables, opt_values):
      v.assign(value)
    scales.append(float(opt.dynamic_scale))
  assert scales == DATA["below_one"]["keras"]["scales"]
  assert jmp_amp_scales(keras_equivalent(scenario),
                        finite_steps(scenario)) == scales
