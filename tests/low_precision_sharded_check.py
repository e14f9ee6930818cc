"""16-bit state and params with stochastic rounding, sharded on 8 devices.

Run as a script (tests/test_low_precision.py does, in a subprocess): the
simulated device count must be set before JAX initialises. Trains a few steps
of `compress_state(adamw)` + `low_precision_params("stochastic")` on bfloat16
params sharded FSDP-style over 8 CPU devices and on one device, and prints
one JSON line: whether the params and the whole optimizer state (moments,
keys) are bitwise equal.
"""

import json

import simulated_devices

simulated_devices.simulate(8)

# pylint: disable=g-import-not-at-top,wrong-import-position
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax

from jmp_amp import optim


def train(params, x, steps=4):
  opt = optax.chain(optim.compress_state(optax.adamw(1e-2)),
                    optim.low_precision_params("stochastic"))

  @jax.jit
  def run(params, x):
    state = opt.init(params)
    for _ in range(steps):
      # An elementwise loss: its gradients are bitwise the same on 8 devices
      # as on one, so any difference would come from the optimizer (XLA:CPU
      # may tile a sharded matmul differently, which is not under test).
      grads = jax.grad(lambda p: jnp.mean(
          jnp.tanh(x * p["w"].astype(jnp.float32) + p["b"]) ** 2))(params)
      updates, state = opt.update(grads, state, params)
      params = optax.apply_updates(params, updates)
    return params, state
  return run(params, x)


def main():
  k1, k2 = jax.random.split(jax.random.key(0))
  params = {"w": jax.random.normal(k1, (64, 128)).astype(jnp.bfloat16),
            "b": jnp.zeros(128, jnp.bfloat16)}
  x = jax.random.normal(k2, (64, 128))
  one = train(jax.device_put(params, jax.devices()[0]), x)
  mesh = Mesh(np.array(jax.devices()), ("d",))
  sharded_params = {
      # Sharded along the features: the bias gradient sums over rows, locally.
      "w": jax.device_put(params["w"], NamedSharding(mesh, P(None, "d"))),
      "b": jax.device_put(params["b"], NamedSharding(mesh, P("d")))}
  eight = train(sharded_params, jax.device_put(x, NamedSharding(mesh, P())))
  leaves1, leaves8 = jax.tree.leaves(one), jax.tree.leaves(eight)
  mu_w = eight[1][0].inner_state[0].mu["w"]
  print(json.dumps({
      "devices": jax.device_count(),
      "leaves": len(leaves1),
      "unequal_leaves": [
          i for i, (a, b) in enumerate(zip(leaves1, leaves8))
          if a.dtype != b.dtype or a.shape != b.shape
          or np.asarray(a).tobytes() != np.asarray(b).tobytes()],
      "state_sharded": len(mu_w.sharding.device_set) == 8
                       and not mu_w.sharding.is_fully_replicated,
      "params_moved": bool(jnp.any(eight[0]["w"] != params["w"])),
  }))


if __name__ == "__main__":
  main()
