"""Real data: mixed precision trains scikit-learn's digits to float32
accuracy."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import helpers
import jmp_amp


def _init(key, sizes=(64, 128, 128, 10)):
  params = []
  for k, (m, n) in zip(jax.random.split(key, len(sizes) - 1),
                       zip(sizes[:-1], sizes[1:])):
    params.append({"w": jax.random.normal(k, (m, n)) * np.sqrt(2.0 / m),
                   "b": jnp.zeros((n,))})
  return params


def _forward(params, x, policy):
  params, h = policy.cast_to_compute((params, x))
  for i, layer in enumerate(params):
    h = jmp_amp.dot_general(h, layer["w"], (((1,), (0,)), ((), ())))
    h = h + layer["b"]
    if i < len(params) - 1:
      h = policy.cast_to_compute(jax.nn.relu(h))
  return policy.cast_to_output(h)


def _train(policy_name, loss_scale, steps=300):
  policy = jmp_amp.get_policy(policy_name)
  (x, y), (xt, yt) = helpers.digits()
  params = _init(jax.random.key(0))
  opt = jmp_amp.loss_scaling(optax.adam(3e-3), loss_scale)
  state = opt.init(params)

  @jax.jit
  def step(params, state, xb, yb):
    def loss_fn(p):
      logits = _forward(p, xb, policy).astype(jnp.float32)
      loss = optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()
      return jmp_amp.get_scaling_state(state).loss_scale.scale(loss)
    grads = jax.grad(loss_fn)(params)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  rng = np.random.default_rng(1)
  for _ in range(steps):
    idx = rng.integers(0, len(x), 128)
    params, state = step(params, state, x[idx], y[idx])
  logits = _forward(params, xt, policy).astype(jnp.float32)
  accuracy = float((logits.argmax(-1) == yt).mean())
  return accuracy, params, state


@pytest.mark.slow
def test_bf16_and_fp16_match_float32_accuracy_on_digits():
  # Here, not at import: every pytest process collects this module.
  pytest.importorskip("sklearn.datasets")
  acc32, _, _ = _train("float32", jmp_amp.NoOpLossScale())
  acc_bf16, p_bf16, _ = _train("p=f32,c=bf16,o=f32", jmp_amp.NoOpLossScale())
  acc_fp16, p_fp16, state = _train("p=f32,c=f16,o=f32",
                                   jmp_amp.DynamicLossScale(2.0**15, period=50))
  assert acc32 > 0.95, acc32  # the task is learnable at all
  assert abs(acc_bf16 - acc32) <= 0.015, (acc32, acc_bf16)
  assert abs(acc_fp16 - acc32) <= 0.015, (acc32, acc_fp16)
  # Master weights stay float32 and finite.
  for p in (p_bf16, p_fp16):
    assert all(leaf.dtype == jnp.float32
               for leaf in jax.tree_util.tree_leaves(p))
    assert bool(jmp_amp.all_finite(p))
  assert float(jmp_amp.get_scaling_state(state).loss_scale.loss_scale) >= 1.0
