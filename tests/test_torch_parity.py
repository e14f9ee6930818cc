"""loss_scaling + DynamicLossScale follow torch.amp.GradScaler step for step.

The same Linear(5, 2), SGD and data (inf/NaN inputs on the faulty steps) as
torch; compared with the trajectory recorded from torch 2.13
(tests/data/reference_trajectories.json, written by
tests/data/record_reference_trajectories.py), so the test needs no torch, and
with live torch as well when it is installed.
"""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_amp
from reference_scenarios import regression_data
from reference_scenarios import SCENARIOS
from reference_scenarios import torch_run

DATA = json.loads((pathlib.Path(__file__).parent / "data" /
                   "reference_trajectories.json").read_text())


def run_jax(scenario):
  xs, ys, w0, b0 = regression_data(scenario)
  opt = jmp_amp.loss_scaling(
      optax.sgd(scenario["lr"]),
      jmp_amp.DynamicLossScale(scenario["init_scale"],
                               period=scenario["interval"], factor=2,
                               backoff_factor=0.5, min_loss_scale=0.0))

  def step(carry, batch):
    params, state = carry
    x, y = batch
    loss_scale = jmp_amp.get_scaling_state(state).loss_scale

    def loss_fn(p):
      return loss_scale.scale(jnp.mean((x @ p["w"] + p["b"] - y) ** 2))

    updates, state = opt.update(jax.grad(loss_fn)(params), state, params)
    params = optax.apply_updates(params, updates)
    scaling = jmp_amp.get_scaling_state(state)
    return (params, state), (scaling.loss_scale.loss_scale,
                             jnp.logical_not(scaling.grads_finite))

  params = {"w": jnp.asarray(w0), "b": jnp.asarray(b0)}
  (params, _), (scales, skipped) = jax.jit(
      lambda c, d: jax.lax.scan(step, c, d))((params, opt.init(params)),
                                             (jnp.asarray(xs), jnp.asarray(ys)))
  return {"scales": [float(s) for s in scales],
          "skipped": [bool(s) for s in skipped],
          "w": np.asarray(params["w"]), "b": np.asarray(params["b"])}


def run_torch(scenario):
  pytest.importorskip("torch")
  return torch_run(scenario)


def assert_same_run(ours, theirs, scenario):
  assert ours["scales"] == theirs["scales"]  # exact: powers of two
  assert ours["skipped"] == theirs["skipped"]
  assert [i for i, s in enumerate(ours["skipped"]) if s] == scenario["faults"]
  # The runs exercise both directions: back-off and growth.
  scales = ours["scales"]
  assert any(b > a for a, b in zip(scales, scales[1:]))
  assert any(b < a for a, b in zip(scales, scales[1:]))
  np.testing.assert_allclose(ours["w"], np.asarray(theirs["w"]), rtol=1e-4,
                             atol=1e-6)
  np.testing.assert_allclose(ours["b"], np.asarray(theirs["b"]), rtol=1e-4,
                             atol=1e-6)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_matches_recorded_grad_scaler_step_for_step(name):
  scenario = SCENARIOS[name]
  assert DATA[name]["scenario"] == scenario, "re-record tests/data"
  assert_same_run(run_jax(scenario), DATA[name]["torch"], scenario)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_matches_live_grad_scaler_step_for_step(name):
  scenario = SCENARIOS[name]
  assert_same_run(run_jax(scenario), run_torch(scenario), scenario)
