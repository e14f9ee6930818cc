"""FP8 ops under `jax.set_mesh` with Explicit axes, on 8 simulated CPU devices.

Run as a script (tests/test_fp8_sharding.py does, in a subprocess): the
device count must be set before JAX initialises. Prints one JSON object of
named results on the last line of stdout. JAX is imported in `main` only, so
that collecting this file (pytest's doctest collection) initialises nothing.

Checks, each against the same computation on one device without a mesh:
  * Gemma's kv projection, ``einsum("BTD,CKDH->CBTKH")`` with the input
    sharded on D by "tensor" and the kernel on D by "fsdp", under
    ``out_sharding``: `jmp_amp.fp8.einsum` (current, delayed, rowwise) and
    ``jmp_amp.autocast(..., "float8")`` of `jnp.einsum`; the result's
    sharding, the gradients' (their operands'), the values and histories.
  * an MLP's projections through `jmp_amp.fp8.dot_general` trained for a
    few SGD steps on meshes (2, 4), (8,) and (1, 1): FSDP x tensor
    parallel (the down projection contracts a sharded axis and names its
    ``out_sharding``) for every recipe, data parallel and the 1x1 mesh for
    one each (`MLP_LAYOUTS`); the amax histories are replicated, the same
    on every device, and equal to one device's.
  * `jmp_amp.fp8.conv_general_dilated`, batch-sharded.
  * an NNX MLP with FP8 layers (`jmp_amp.flax.set_policies`), params
    sharded, trained by a hand-written `nnx.jit` step.
"""

import json
import sys

import simulated_devices

NUM_DEVICES = 8
STEPS = 3
SPEC = "BTD,CKDH->CBTKH"
RECIPES = ("current", "delayed", "rowwise")
# The MLP's layouts per recipe: FSDP x tensor parallel (the down projection
# names its out_sharding) for each; data parallel and the 1x1 mesh once.
MLP_LAYOUTS = {"current": ("fsdp_tp2x4", "1x1"),
               "delayed": ("fsdp_tp2x4", "dp8"),
               "rowwise": ("fsdp_tp2x4",)}


def max_diff(a, b) -> float:
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(la) == len(lb)
  return max(float(np.max(np.abs(np.asarray(x, np.float64)
                                 - np.asarray(y, np.float64))))
             for x, y in zip(la, lb))


def spec_of(x) -> str:
  return str(tuple(jax.typeof(x).sharding.spec))


def shards_identical(x) -> bool:
  values = [np.asarray(s.data).tobytes() for s in x.addressable_shards]
  return len(values) == NUM_DEVICES and len(set(values)) == 1


def explicit_mesh(shape, names):
  return jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(
      shape), devices=jax.devices()[:int(np.prod(shape))])


def zero_state():
  return jmp_amp.fp8.FP8State(*(jnp.zeros(2) for _ in range(3)))


# --------------------------------------------------------------------------
# Gemma's kv projection.


def check_kv_projection(results):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(8, 4, 16)).astype(np.float32)
  k = rng.normal(size=(2, 2, 16, 8)).astype(np.float32)
  out = P(None, "fsdp", None, None, None)

  def loss_of(recipe, sharded):
    kwargs = {"out_sharding": out} if sharded else {}

    def loss(x, k, state):
      y = jmp_amp.fp8.einsum(SPEC, x, k, state=state, recipe=recipe,
                             **kwargs)
      return jnp.sum(y.astype(jnp.float32) ** 2), y
    return jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)

  mesh = explicit_mesh((2, 4), ("fsdp", "tensor"))
  for name in RECIPES:
    recipe = jmp_amp.fp8.FP8Recipe(scaling=name, history_len=2)
    (_, y_ref), g_ref = jax.jit(loss_of(recipe, False))(x, k, zero_state())
    with jax.set_mesh(mesh):
      xs = jax.device_put(x, P(None, None, "tensor"))
      ks = jax.device_put(k, P(None, None, "fsdp", None))
      (_, y), g = jax.jit(loss_of(recipe, True))(xs, ks, zero_state())
      results[f"kv_{name}_out_spec"] = spec_of(y)
      results[f"kv_{name}_grad_specs"] = [spec_of(g[0]), spec_of(g[1])]
      results[f"kv_{name}_histories_replicated"] = all(
          shards_identical(h) for h in g[2])
    results[f"kv_{name}_max_diff"] = max_diff(y, y_ref)
    results[f"kv_{name}_grad_rel_diff"] = max(
        float(np.linalg.norm(np.asarray(a) - np.asarray(b))
              / np.linalg.norm(np.asarray(b)))
        for a, b in zip(g[:2], g_ref[:2]))
    # Operand amaxes are exact maxima: bit for bit one device's.
    results[f"kv_{name}_operand_histories_equal"] = all(
        np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(g[2][:2], g_ref[2][:2]))

  def autocast(sharded):
    kwargs = {"out_sharding": out} if sharded else {}
    f = jmp_amp.autocast(lambda x, k: jnp.einsum(SPEC, x, k, **kwargs),
                         "float8")
    return jax.value_and_grad(
        lambda x, k: jnp.sum(f(x, k).astype(jnp.float32) ** 2),
        argnums=(0, 1))

  v_ref, g_ref = jax.jit(autocast(False))(x, k)
  with jax.set_mesh(mesh):
    xs = jax.device_put(x, P(None, None, "tensor"))
    ks = jax.device_put(k, P(None, None, "fsdp", None))
    v, g = jax.jit(autocast(True))(xs, ks)
    y = jax.jit(jmp_amp.autocast(
        lambda x, k: jnp.einsum(SPEC, x, k, out_sharding=out),
        "float8"))(xs, ks)
    results["kv_autocast_out_spec"] = spec_of(y)
    results["kv_autocast_grad_specs"] = [spec_of(g[0]), spec_of(g[1])]
  results["kv_autocast_loss_rel_diff"] = abs(float(v) - float(v_ref)) / abs(
      float(v_ref))


# --------------------------------------------------------------------------
# An MLP's projections through dot_general, trained.


MATMUL = (((1,), (0,)), ((), ()))


def mlp_step(recipe, shardings):
  """One SGD step of a two-projection MLP; `shardings`: None (one device)
  or (hidden's out_sharding, output's out_sharding)."""
  up_out, down_out = shardings or (None, None)

  def loss(params, states, x, y):
    h = jmp_amp.fp8.dot_general(x, params["up"], MATMUL, recipe=recipe,
                                state=states[0], out_sharding=up_out)
    h = jax.nn.relu(h.astype(jnp.float32))
    o = jmp_amp.fp8.dot_general(h, params["down"], MATMUL, recipe=recipe,
                                state=states[1], out_sharding=down_out)
    return jnp.mean((o.astype(jnp.float32) - y) ** 2)

  def step(params, states, x, y):
    l, (g, new_states) = jax.value_and_grad(loss, argnums=(0, 1))(
        params, states, x, y)
    params = jax.tree.map(lambda p, d: p - 0.1 * d, params, g)
    return params, new_states, l
  return jax.jit(step)


def train_mlp(recipe, batches, params, layout=None):
  """`layout`: None (one device), or (mesh, specs of x, up, down, and the
  two projections' out_shardings)."""
  states = (zero_state(), zero_state())
  if layout is None:
    step = mlp_step(recipe, None)
    for x, y in batches:
      params, states, loss = step(params, states, x, y)
    return params, states, loss
  mesh, x_spec, up_spec, down_spec, outs = layout
  with jax.set_mesh(mesh):
    params = {"up": jax.device_put(params["up"], up_spec),
              "down": jax.device_put(params["down"], down_spec)}
    step = mlp_step(recipe, outs)
    for x, y in batches:
      params, states, loss = step(params, states,
                                  jax.device_put(x, x_spec),
                                  jax.device_put(y, P(x_spec[0], None)))
    return params, states, loss


def check_mlp(results):
  rng = np.random.default_rng(1)
  batches = [(rng.normal(size=(16, 32)).astype(np.float32),
              rng.normal(size=(16, 8)).astype(np.float32))
             for _ in range(STEPS)]
  params = {"up": (rng.normal(size=(32, 64)) / 6).astype(np.float32),
            "down": (rng.normal(size=(64, 8)) / 8).astype(np.float32)}
  layouts = {
      "dp8": (explicit_mesh((8,), ("data",)), P("data", None), P(), P(),
              None),
      "fsdp_tp2x4": (explicit_mesh((2, 4), ("fsdp", "tensor")),
                     P("fsdp", None), P(None, "tensor"), P("tensor", None),
                     (None, P("fsdp", None))),
      "1x1": (explicit_mesh((1, 1), ("fsdp", "tensor")), P("fsdp", None),
              P(None, "tensor"), P("tensor", None), (None, P("fsdp", None))),
  }
  for name in RECIPES:
    recipe = jmp_amp.fp8.FP8Recipe(scaling=name, history_len=2)
    ref_params, ref_states, _ = train_mlp(recipe, batches, params)
    for lname in MLP_LAYOUTS[name]:
      layout = layouts[lname]
      key = f"mlp_{name}_{lname}"
      p, states, _ = train_mlp(recipe, batches, params, layout)
      results[f"{key}_max_diff"] = max_diff(p, ref_params)
      results[f"{key}_param_specs"] = [spec_of(p["up"]), spec_of(p["down"])]
      # The batch's amax is exact: bit for bit one device's (the hidden
      # layer's input differs by the reduction order of the gradients).
      results[f"{key}_input_histories_equal"] = np.array_equal(
          np.asarray(states[0].lhs), np.asarray(ref_states[0].lhs))
      if lname != "1x1":
        results[f"{key}_histories_replicated"] = all(
            shards_identical(h) for s in states for h in s)


# --------------------------------------------------------------------------
# Convolution, and FP8 layers of an NNX model.


def check_conv(results):
  rng = np.random.default_rng(2)
  x = rng.normal(size=(8, 2, 6, 6)).astype(np.float32)
  w = rng.normal(size=(3, 2, 3, 3)).astype(np.float32)

  def loss(x, w):
    y = jmp_amp.fp8.conv_general_dilated(x, w, (1, 1), "SAME")
    return jnp.sum(y.astype(jnp.float32) ** 2)

  grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  v_ref, g_ref = grad(x, w)
  with jax.set_mesh(explicit_mesh((8,), ("data",))):
    v, g = grad(jax.device_put(x, P("data")), w)
    results["conv_grad_specs"] = [spec_of(g[0]), spec_of(g[1])]
  results["conv_loss_rel_diff"] = abs(float(v) - float(v_ref)) / float(v_ref)


def check_nnx_layers(results):
  def make():
    model = jmp_amp.models.MLP(32, 8, num_layers=3, width=64,
                               rngs=nnx.Rngs(0))
    return jmp_amp.flax.set_policies(
        model, jmp_amp.flax.fp8.FP8Policy(keep_first_last=False))

  @nnx.jit
  def step(model, x, y):
    loss_fn = lambda m: jnp.mean((m(x).astype(jnp.float32) - y) ** 2)
    loss, grads = jmp_amp.flax.fp8.value_and_grad(loss_fn)(model)
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads))
    return loss

  rng = np.random.default_rng(3)
  batches = [(rng.normal(size=(16, 32)).astype(np.float32),
              rng.normal(size=(16, 8)).astype(np.float32))
             for _ in range(STEPS)]
  ref = make()
  ref_losses = [float(step(ref, x, y)) for x, y in batches]
  model = make()
  with jax.set_mesh(explicit_mesh((8,), ("data",))):
    # Data parallel: params replicated, the batch split.
    losses = [float(step(model, jax.device_put(x, P("data", None)),
                         jax.device_put(y, P("data", None))))
              for x, y in batches]
  results["nnx_losses"] = losses
  results["nnx_ref_losses"] = ref_losses
  results["nnx_params_max_diff"] = max_diff(nnx.state(model, nnx.Param),
                                            nnx.state(ref, nnx.Param))


def main():
  simulated_devices.simulate(NUM_DEVICES)
  # pylint: disable=g-import-not-at-top,global-statement
  global jax, jnp, np, nnx, P, AxisType, jmp_amp
  from flax import nnx
  import jax
  import jax.numpy as jnp
  from jax.sharding import AxisType
  from jax.sharding import PartitionSpec as P
  import jmp_amp.models
  import numpy as np

  import jmp_amp
  import jmp_amp.flax
  results = {"devices": jax.device_count()}
  if jax.device_count() != NUM_DEVICES:
    print(json.dumps(results))
    return 1
  checks = [check_kv_projection, check_mlp, check_conv, check_nnx_layers]
  only = sys.argv[1:]
  for check in checks:
    if not only or check.__name__ in only:
      check(results)
  print(json.dumps(results))
  return 0


if __name__ == "__main__":
  sys.exit(main())
