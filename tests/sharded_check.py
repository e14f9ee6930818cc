"""Loss scaling under SPMD sharding, on 8 simulated CPU devices.

Run as a script (tests/test_sharding.py does, in a subprocess): the device
count must be set before JAX initialises, which a pytest process that has
imported JAX already cannot do. Prints one JSON object of named results on
the last line of stdout; exits non-zero only if a check could not run.

Checks:
  * `jit` with NamedShardings, data parallel (params replicated, batch
    sharded) and FSDP-style (params and optimizer state sharded): the same
    results as one device, to float tolerance; loss-scale leaves replicated.
  * one shard with a NaN (in a sharded gradient, or in one device's part of
    the batch) makes the whole step skip: every shard of every param and of
    the optimizer state unchanged, the scale backed off identically on all
    devices.
  * `shard_map` with per-device gradients: ``loss_scaling(...,
    axis_name="data")`` skips on every device when one device's gradients are
    not finite; without `axis_name` the devices diverge.
  * a sharded state checkpoints and restores (jmp_amp.checkpoint) with its
    shardings, or into other shardings.
  * the finite check compiled for GPUs (run here on the CPU devices) on
    gradients sharded along either axis: right answer, including a NaN on
    one shard, and no gather of the gradients (only small reductions).
  * FP8 (an NNX MLP, delayed scaling) under `jit` over a batch split over
    the devices, params replicated or split (FSDP): the same amax histories
    as one device, bit for bit (each amax is the whole batch's), and the
    same params to float tolerance.
"""

import json
import os
import re
import sys
import tempfile

import simulated_devices

NUM_DEVICES = 8
# Every program at backend level 0 (the one-device references, the FP8
# runs and the checkpoints' copies too, not only the jits given
# FAST_COMPILE): each run and its reference compile alike.
simulated_devices.simulate(NUM_DEVICES)

# pylint: disable=g-import-not-at-top,wrong-import-position
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jmp_amp
import reliability_helpers as rh

STEPS = 6
BATCH = 32  # 4 examples per device
POISON_AT = (29, 3)  # dense1.w rows 28-31 live on the last device under FSDP


def max_diff(a, b) -> float:
  return max(float(np.max(np.abs(np.asarray(x, np.float64)
                                 - np.asarray(y, np.float64))))
             for x, y in zip(jax.tree_util.tree_leaves(a),
                             jax.tree_util.tree_leaves(b)))


def shards_identical(x) -> bool:
  """Whether every device holds the same value of a replicated array."""
  values = [np.asarray(s.data) for s in x.addressable_shards]
  return len(values) == NUM_DEVICES and all(
      v.tobytes() == values[0].tobytes() for v in values)


def tree_bytes_equal(a, b) -> bool:
  la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
  return len(la) == len(lb) and all(
      np.asarray(x).tobytes() == np.asarray(y).tobytes() for x, y in zip(la, lb))


def fsdp_spec(x) -> P:
  """Shards the first dimension divisible by the device count, if any."""
  for dim, size in enumerate(np.shape(x)):
    if size % NUM_DEVICES == 0:
      return P(*([None] * dim), "data")
  return P()


def make_step(opt, policy):
  """A train step whose sharded gradient can be poisoned on one device."""
  def step(state, batch, poison):
    params, opt_state = state["params"], state["opt_state"]
    loss_scale = jmp_amp.get_scaling_state(opt_state).loss_scale

    def scaled_loss(p):
      loss = rh.loss_fn(p, batch, policy)
      return loss_scale.scale(loss), loss

    grads, loss = jax.grad(scaled_loss, has_aux=True)(params)
    w = grads["dense1"]["w"]
    grads["dense1"]["w"] = w.at[POISON_AT].set(
        jnp.where(poison, jnp.nan, w[POISON_AT]))
    updates, opt_state = opt.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return {"params": params, "opt_state": opt_state}, {
        "loss": loss, **rh.scaling_metrics(opt_state)}
  return step


def run(step_fn, state, xs, ys, poison_step=-1):
  for i in range(STEPS):
    state, metrics = step_fn(state, (xs[i], ys[i]), jnp.bool_(i == poison_step))
  return state, metrics


def check_jit(results):
  mesh = Mesh(np.array(jax.devices()), ("data",))
  repl = NamedSharding(mesh, P())
  batch_sh = NamedSharding(mesh, P("data"))
  opt = rh.make_optimizer(init_scale=2.0**15, period=2)
  policy = rh.BF16
  state = rh.init_state(0, opt)
  xs, ys = rh.make_batches(1, STEPS, batch_size=BATCH)
  step = make_step(opt, policy)

  # Reference: one device.
  single = jax.jit(step, compiler_options=rh.FAST_COMPILE)
  ref, _ = run(single, state, xs, ys)

  # Data parallel: params/state replicated, batch split over devices.
  dp_state = jax.device_put(state, repl)
  dp = jax.jit(step, in_shardings=(repl, batch_sh, repl),
               out_shardings=(repl, repl), compiler_options=rh.FAST_COMPILE)
  dp_out, _ = run(dp, dp_state, xs, ys)
  results["dp_max_diff"] = max_diff(dp_out["params"], ref["params"])
  results["dp_state_max_diff"] = max_diff(dp_out["opt_state"],
                                          ref["opt_state"])

  # FSDP: every param and optimizer-state leaf with a dimension divisible by
  # the device count is split along it; scalars (the loss scale) replicated.
  state_sh = jax.tree_util.tree_map(
      lambda x: NamedSharding(mesh, fsdp_spec(x)), state)
  fsdp_state = jax.device_put(state, state_sh)
  fsdp = jax.jit(step, in_shardings=(state_sh, batch_sh, repl),
                 out_shardings=(state_sh, repl),
                 compiler_options=rh.FAST_COMPILE)
  fsdp_out, metrics = run(fsdp, fsdp_state, xs, ys)
  results["fsdp_max_diff"] = max_diff(fsdp_out["params"], ref["params"])
  results["fsdp_state_max_diff"] = max_diff(fsdp_out["opt_state"],
                                            ref["opt_state"])
  w = fsdp_out["params"]["dense1"]["w"]
  results["fsdp_params_sharded"] = (
      not w.sharding.is_fully_replicated
      and w.addressable_shards[0].data.shape == (32 // NUM_DEVICES, 32))
  mu = fsdp_out["opt_state"].inner_state[0].mu["dense1"]["w"]
  results["fsdp_opt_state_sharded"] = not mu.sharding.is_fully_replicated
  ls = fsdp_out["opt_state"].loss_scale
  results["loss_scale_replicated"] = all(
      x.sharding.is_fully_replicated and shards_identical(x)
      for x in jax.tree_util.tree_leaves(ls))
  results["loss_scale_grew"] = float(ls.loss_scale) > 2.0**15
  results["fsdp_compiles"] = fsdp._cache_size()

  # One shard's gradient is NaN: the finite check is global under jit.
  before = fsdp_out
  after, m = fsdp(before, (xs[0], ys[0]), jnp.bool_(True))
  poisoned_shard = [s.device.id for s in
                    before["params"]["dense1"]["w"].addressable_shards
                    if s.index[0].start <= POISON_AT[0] < s.index[0].stop]
  results["nan_shard_devices"] = poisoned_shard
  results["nan_shard_skipped"] = not bool(m["grads_finite"])
  results["nan_shard_params_unchanged"] = tree_bytes_equal(
      [s.data for x in jax.tree_util.tree_leaves(after["params"])
       for s in x.addressable_shards],
      [s.data for x in jax.tree_util.tree_leaves(before["params"])
       for s in x.addressable_shards])
  results["nan_shard_inner_state_unchanged"] = tree_bytes_equal(
      after["opt_state"].inner_state, before["opt_state"].inner_state)
  new_ls = after["opt_state"].loss_scale
  results["nan_shard_scale_halved"] = (
      float(new_ls.loss_scale) == float(ls.loss_scale) / 2)
  results["nan_shard_scale_replicated"] = all(
      x.sharding.is_fully_replicated and shards_identical(x)
      for x in jax.tree_util.tree_leaves(new_ls))

  # One device's part of the batch is NaN (data parallel).
  bad_x = xs[0].at[5].set(jnp.nan)  # example 5 lives on device 1
  after_dp, m_dp = dp(dp_out, (bad_x, ys[0]), jnp.bool_(False))
  results["nan_batch_skipped"] = not bool(m_dp["grads_finite"])
  results["nan_batch_params_unchanged"] = tree_bytes_equal(
      after_dp["params"], dp_out["params"])
  results["nan_batch_scale_replicated"] = shards_identical(
      after_dp["opt_state"].loss_scale.loss_scale)
  results["compiles_after_skips"] = [fsdp._cache_size(), dp._cache_size()]

  # The sharded programs really communicate (they are not one device's).
  def collectives(fn, *args):
    hlo = fn.lower(*args).compile().as_text()
    return sorted(op for op in ("all-reduce", "all-gather", "reduce-scatter")
                  if op in hlo)
  results["dp_collectives"] = collectives(dp, dp_state, (xs[0], ys[0]),
                                          jnp.bool_(False))
  results["fsdp_collectives"] = collectives(fsdp, fsdp_state, (xs[0], ys[0]),
                                            jnp.bool_(False))

  return mesh, state_sh, fsdp_out


def check_shard_map(results, mesh):
  """Per-device gradients: each device trains its own row (no all-reduce)."""
  width, per_device = 16, 4
  rng = np.random.default_rng(0)
  w0 = jnp.asarray(rng.normal(size=(NUM_DEVICES, width)), jnp.float32)
  x = jnp.asarray(rng.normal(size=(NUM_DEVICES * per_device, width)),
                  jnp.float32)
  y = jnp.asarray(rng.normal(size=(NUM_DEVICES * per_device,)), jnp.float32)
  bad_device = 3

  def make(axis_name):
    opt = jmp_amp.loss_scaling(optax.adam(1e-2),
                               jmp_amp.DynamicLossScale(2.0**10, period=100),
                               axis_name=axis_name)

    def per_device(w, x, y):
      state = opt.init(w)
      scale = jmp_amp.get_scaling_state(state).loss_scale
      loss = lambda w: scale.scale(jnp.mean((x @ w[0] - y) ** 2))
      g = jax.grad(loss)(w)
      bad = jax.lax.axis_index("data") == bad_device
      g = g.at[0, 0].set(jnp.where(bad, jnp.inf, g[0, 0]))
      updates, state = opt.update(g, state, w)
      return (optax.apply_updates(w, updates),
              jnp.reshape(state.loss_scale.loss_scale, (1,)),
              jnp.reshape(state.grads_finite, (1,)))

    return jax.jit(jax.shard_map(
        per_device, mesh=mesh, in_specs=(P("data"), P("data"), P("data")),
        out_specs=(P("data"), P("data"), P("data"))),
        compiler_options=rh.FAST_COMPILE)

  w, scales, finite = make("data")(w0, x, y)
  results["shard_map_axis_all_skip"] = not bool(np.any(finite))
  results["shard_map_axis_params_unchanged"] = tree_bytes_equal(w, w0)
  results["shard_map_axis_scales"] = np.asarray(scales).tolist()

  w, scales, finite = make(None)(w0, x, y)
  finite = np.asarray(finite)
  changed = np.any(np.asarray(w) != np.asarray(w0), axis=1)
  results["shard_map_no_axis_finite"] = finite.tolist()
  results["shard_map_no_axis_rows_changed"] = changed.tolist()
  results["shard_map_no_axis_scales"] = np.asarray(scales).tolist()


def check_checkpoint(results, mesh, state_sh, state):
  from jmp_amp import checkpoint
  with tempfile.TemporaryDirectory() as tmp:
    checkpoint.save(tmp, state, step=STEPS)
    target = jax.tree_util.tree_map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        state, state_sh)
    restored = checkpoint.restore(tmp, target)
    results["ckpt_sharded_equal"] = tree_bytes_equal(restored, state)
    results["ckpt_sharded_keeps_shardings"] = all(
        a.sharding == b.sharding for a, b in zip(
            jax.tree_util.tree_leaves(restored),
            jax.tree_util.tree_leaves(state)))
    repl = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                       sharding=NamedSharding(mesh, P())),
        state)
    restored = checkpoint.restore(tmp, repl)
    results["ckpt_resharded_equal"] = tree_bytes_equal(restored, state)
    results["ckpt_resharded_replicated"] = all(
        x.sharding.is_fully_replicated
        for x in jax.tree_util.tree_leaves(restored))


def check_finite_check(results, mesh):
  """The finite check on sharded gradients: no gathers, right answer."""
  rng = np.random.default_rng(0)
  shapes_specs = [((64, 2048), P(None, "data")), ((2048, 64), P("data")),
                  ((32, 8, 1024), P(None, None, "data")), ((2**17,), P("data"))]
  tree = [jax.device_put(jnp.asarray(rng.normal(size=s), jnp.float16),
                         NamedSharding(mesh, spec)) for s, spec in shapes_specs]
  opt = jmp_amp.loss_scaling(optax.identity(), jmp_amp.DynamicLossScale(2.0**15))
  check = jax.jit(lambda t: opt.update(t, opt.init(t))[1].grads_finite)
  hlo = check.lower(tree).compile().as_text()
  # The number of elements each collective produces (the partial results
  # the devices exchange): far below a gradient's 2**17 if nothing is
  # gathered.
  sizes = [sum(int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
               for dims in re.findall(r"\w+\[([\d,]*)\]", result))
           for result in re.findall(
               r"= (\([^)]*\)|\w+\[[\d,]*\])\S* (?:all-gather|all-to-all|"
               r"collective-permute|all-reduce|reduce-scatter)\(", hlo)]
  results["finite_check_collective_sizes"] = sizes
  results["finite_check_clean"] = bool(check(tree))
  bad = np.array(tree[0])
  bad[5, 2047] = np.nan  # on the last device's shard
  tree[0] = jax.device_put(jnp.asarray(bad), tree[0].sharding)
  results["finite_check_nan_shard"] = bool(check(tree))


def check_fp8(results, mesh):
  from flax import nnx  # pylint: disable=g-import-not-at-top

  from jmp_amp import models  # pylint: disable=g-import-not-at-top
  import jmp_amp.flax  # pylint: disable=g-import-not-at-top

  model = models.MLP(16, 4, num_layers=3, width=32, rngs=nnx.Rngs(0))
  jmp_amp.flax.set_policies(model, jmp_amp.flax.fp8.FP8Policy(
      jmp_amp.fp8.FP8Recipe(scaling="delayed", history_len=4),
      keep_first_last=False))
  opt = nnx.Optimizer(model, optax.sgd(0.05), wrt=nnx.Param)
  graphdef, state = nnx.split((model, opt))

  def step(state, batch):
    model, opt = nnx.merge(graphdef, state)
    _, grads = jmp_amp.flax.fp8.value_and_grad(
        lambda m: models.mse_loss(m(batch[0]), batch[1]))(model)
    opt.update(model, grads)
    return nnx.state((model, opt))

  rng = np.random.default_rng(0)
  # Rows of growing size: each device's part of the batch has its own amax.
  batches = [(jnp.asarray(rng.normal(size=(BATCH, 16))
                          * np.linspace(0.5, 4, BATCH)[:, None], jnp.float32),
              jnp.asarray(rng.normal(size=(BATCH, 4)), jnp.float32))
             for _ in range(3)]

  def train(fn, state):
    for batch in batches:
      state = fn(state, batch)
    return state

  def histories(state):
    return nnx.to_pure_dict(nnx.state(state, jmp_amp.flax.fp8.FP8Meta))

  ref = train(jax.jit(step), state)
  repl = NamedSharding(mesh, P())
  batch_sh = NamedSharding(mesh, P("data"))
  state_sh = jax.tree_util.tree_map(
      lambda x: NamedSharding(mesh, fsdp_spec(x)), state)
  for name, sh in (("dp", repl), ("fsdp", state_sh)):
    out = train(jax.jit(step, in_shardings=(sh, batch_sh), out_shardings=sh),
                jax.device_put(state, sh))
    results[f"fp8_{name}_histories_equal"] = tree_bytes_equal(
        histories(out), histories(ref))
    results[f"fp8_{name}_max_diff"] = max_diff(
        nnx.state(out, nnx.Param), nnx.state(ref, nnx.Param))
  results["fp8_newest_input_amax"] = float(
      histories(ref)[0]["layers"][0]["dot_general"]["lhs_amax_history"][0])
  results["fp8_global_input_amax"] = float(jnp.max(jnp.abs(batches[-1][0])))
  results["fp8_device0_input_amax"] = float(
      jnp.max(jnp.abs(batches[-1][0][:BATCH // NUM_DEVICES])))


def main():
  results = {"devices": jax.device_count()}
  if jax.device_count() != NUM_DEVICES:
    print(json.dumps(results))
    return 1
  mesh, state_sh, fsdp_state = check_jit(results)
  check_shard_map(results, mesh)
  check_finite_check(results, mesh)
  check_fp8(results, mesh)
  if "--no-checkpoint" not in sys.argv:
    check_checkpoint(results, mesh, state_sh, fsdp_state)
  print(json.dumps(results))
  return 0


if __name__ == "__main__":
  sys.exit(main())
