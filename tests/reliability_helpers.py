"""A small MLP and a plain-JAX mixed-precision train step for reliability tests.

Shared by the checkpoint, fault-injection, host-sync and sharding tests (and
the `sharded_check.py` subprocess script). Plain JAX on purpose: these tests
are about the loss-scaling machinery, not a Flax integration.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_amp
from jmp_amp import testing as jt

F16 = jmp_amp.get_policy("p=f32,c=f16,o=f32")
BF16 = jmp_amp.get_policy("p=f32,c=bf16,o=f32")
F32 = jmp_amp.get_policy("f32")

SIZES = (8, 32, 32, 4)
FAST_COMPILE = {"xla_backend_optimization_level": 0}
_DIMS = (((1,), (0,)), ((), ()))


def init_mlp(seed: int, sizes=SIZES) -> dict[str, Any]:
  """LeCun-normal float32 params, drawn by NumPy.

  NumPy, not jax.random: every eager jax.random call compiles a program,
  which costs seconds on a busy CPU.
  """
  rng = np.random.default_rng(seed)
  params = {}
  for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
    w = rng.normal(0.0, fan_in ** -0.5, (fan_in, fan_out))
    params[f"dense{i}"] = {"w": jnp.asarray(w, jnp.float32),
                           "b": jnp.zeros((fan_out,), jnp.float32)}
  return params


def numpy_init(key: jax.Array, shape, dtype=jnp.float32) -> jax.Array:
  """A Flax kernel initialiser (LeCun normal) that compiles nothing."""
  seed = np.asarray(jax.random.key_data(key)).astype(np.uint64)
  fan_in = int(np.prod(shape[:-1])) or 1
  return jnp.asarray(np.random.default_rng(seed).normal(
      0.0, fan_in ** -0.5, shape), dtype)


def mlp(params, x, policy=F16, *, step=None, act_faults=None, fault_key=None):
  """Forward pass: compute-dtype matmuls with float32 accumulation.

  With `act_faults`, the first hidden activation gets an inf/NaN on those
  steps (a forward-pass fault, as a half-precision overflow would make).
  """
  p = policy.cast_to_compute(params)
  h = policy.cast_to_compute(x)
  n = len(p)
  for i in range(n):
    layer = p[f"dense{i}"]
    h = jmp_amp.dot_general(h, layer["w"], _DIMS) + layer["b"]
    if i < n - 1:
      h = jax.nn.relu(h).astype(policy.compute_dtype)
      if i == 0 and act_faults is not None:
        h = jt.inject_nonfinite(h, step, act_faults, fault_key)
  return policy.cast_to_output(h)


def loss_fn(params, batch, policy=F16, **fault_kwargs):
  x, y = batch
  pred = mlp(params, x, policy, **fault_kwargs).astype(jnp.float32)
  return jnp.mean((pred - y) ** 2)


def make_batches(seed: int, num: int, batch_size: int = 16,
                 sizes=SIZES) -> tuple[jax.Array, jax.Array]:
  """`num` regression batches ``(x, sin(x @ teacher))``, stacked."""
  rng = np.random.default_rng(seed)
  teacher = rng.normal(size=(sizes[0], sizes[-1]))
  x = rng.normal(size=(num, batch_size, sizes[0]))
  y = np.sin(x @ teacher)
  return jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32)


def make_optimizer(init_scale: float = 2.0**15, period: int = 20,
                   lr: float = 1e-2, **scale_kwargs):
  return jmp_amp.loss_scaling(
      optax.adam(lr),
      jmp_amp.DynamicLossScale(init_scale, period=period, **scale_kwargs))


def init_state(seed: int, opt) -> dict[str, Any]:
  params = init_mlp(seed)
  return {"params": params, "opt_state": opt.init(params)}


def make_train_step(opt, policy=F16, *, fault_key: Optional[jax.Array] = None,
                    kind: str = "random"):
  """``train_step(state, batch, step, grad_faults, act_faults)``, not jitted.

  Returns ``(state, metrics)``. `step` is the global step index the fault
  schedules (int arrays, or None for no injection code) refer to; it is an
  argument, not the optimizer's counter, so that a clean reference run can
  replay the same batches with the faulty steps left out -- through the same
  compiled program when it passes schedules that never match (-1s).
  """
  def train_step(state, batch, step, grad_faults=None, act_faults=None):
    params, opt_state = state["params"], state["opt_state"]
    loss_scale = jmp_amp.get_scaling_state(opt_state).loss_scale
    key = None if fault_key is None else jax.random.fold_in(fault_key, step)
    act_key = None if key is None else jax.random.fold_in(key, 1)

    def scaled_loss(p):
      loss = loss_fn(p, batch, policy, step=step, act_faults=act_faults,
                     fault_key=act_key)
      return loss_scale.scale(loss), loss

    grads, loss = jax.grad(scaled_loss, has_aux=True)(params)
    if grad_faults is not None:
      grads = jt.inject_nonfinite(grads, step, grad_faults, key, kind=kind)
    updates, opt_state = opt.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    metrics = {"loss": loss, **scaling_metrics(opt_state)}
    return {"params": params, "opt_state": opt_state}, metrics

  return train_step


def make_scan_run(train_step):
  """Jitted ``run(state, xs, ys, steps, active, grad_faults, act_faults)``.

  Scans `train_step` over the batches ``(xs[i], ys[i])`` with global step
  indices ``steps[i]``; where ``active[i]`` is False the harness itself keeps
  the previous state (padding, so that a shorter clean run reuses the same
  compiled program: same shapes, same arithmetic).

  Returns ``(state, all_ok, metrics)``: `all_ok` is whether every param and
  optimizer-state leaf stayed finite after every step (checked inside the
  scan, not only at the end); `metrics` are stacked per step.
  """
  # Optimisation level 0 halves XLA:CPU's compile time of the scanned step;
  # runs that are compared share one compiled program, so equality holds.
  @functools.partial(jax.jit, compiler_options=FAST_COMPILE)
  def run(state, xs, ys, steps, active, grad_faults=None, act_faults=None):
    def body(carry, inp):
      state, ok = carry
      x, y, step, on = inp
      new_state, metrics = train_step(state, (x, y), step, grad_faults,
                                       act_faults)
      state = jmp_amp.select_tree(on, new_state, state)
      ok = ok & jmp_amp.all_finite(state["params"]) & jmp_amp.all_finite(
          state["opt_state"])
      return (state, ok), metrics
    (state, ok), metrics = jax.lax.scan(body, (state, jnp.array(True)),
                                        (xs, ys, steps, active))
    return state, ok, metrics
  return run


def simulate_dynamic_scale(finite: np.ndarray, init: float, period: int,
                           factor: float = 2.0) -> np.ndarray:
  """The scale after each step, by DynamicLossScale's rule, on the host.

  An independent reference (hysteresis 1, no cap, floor 1).
  """
  scale, counter, out = float(init), 0, []
  for ok in finite:
    if ok:
      counter += 1
      if counter == period:
        scale, counter = scale * factor, 0
    else:
      scale, counter = max(scale / factor, 1.0), 0
    out.append(scale)
  return np.asarray(out)


def scaling_metrics(opt_state: Any) -> dict[str, Any]:
  """The loss-scaling values of `jmp_amp.get_scaling_state`, as the metrics
  of `jmp_amp.flax.make_train_step` hold them."""
  state = jmp_amp.get_scaling_state(opt_state)
  return {"loss_scale": jnp.asarray(state.loss_scale.loss_scale, jnp.float32),
          "grads_finite": state.grads_finite,
          "skipped_steps": state.skipped_steps, "steps": state.steps}
