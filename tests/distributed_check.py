"""One process of a multi-process training run (JAX's distributed runtime).

`tests/test_distributed.py` starts this script as N processes on localhost
(``--num-processes N``), each with ``--local-devices`` simulated CPU devices,
CPU collectives over gloo, and one global mesh; or as one process holding all
N x L devices (``--num-processes 1``), the single-process reference run on the
same devices. Every process writes ``OUT/<case>.p<pid>.json`` (per-step metrics
as this process reads them) and ``OUT/<case>.p<pid>.npz`` (the final state,
gathered whole); the test compares them across processes and with the
reference. Run as a script only: the device count must be set before JAX
initialises.

Cases (``--cases``, comma-separated) are ``<model>-<layout>-<precision>``:
model ``mlp`` or ``gpt`` (`jmp_amp.models`, small sizes), layout ``dp`` (params
replicated, batch split) or ``fsdp`` (params and Adam moments split along
their first dimension divisible by the device count, batch split), precision
``fp16`` (float16 compute, dynamic loss scaling) or ``bf16`` (bfloat16
compute, `NoOpLossScale`: no scaling, non-finite steps still skipped). The
case ``mlp-fsdp-fp8`` trains an MLP whose matmuls run in FP8 under delayed
scaling and records its amax histories. A case ending in ``-explicit``
(``mlp-dp-fp16-explicit``) runs on the same mesh with its axis `Explicit`,
under `jax.set_mesh`. A case ending in ``@N`` (``mlp-dp-fp16@2``) runs on
the first N devices only: the reference run, holding 4 devices, of a launch
on 2. One reference run thus serves launches of several shapes.

Faults: on steps `FAULT_STEPS` the last process puts a NaN in the per-example
weight of the first example it holds (its own shard of the global batch, built
with `jax.make_array_from_process_local_data`); the reference run puts it in
the same global row: that of the last of DISTRIBUTED_CHECK_AS_PROCESSES
processes, or of a case ending in ``%P`` (``mlp-fsdp-fp16%4``), of P.

Checkpoints (``--ckpt DIR``): ``--save-at K`` saves the state after K steps
with `jmp_amp.checkpoint.save` from every process; ``--resume`` starts from
the latest step in DIR instead of from initialisation. ``--then kill``
(after the cases) saves step 1 of another state in ``DIR/kill``, then starts
an asynchronous save of step 2, and process ``--kill-process`` SIGKILLs
itself once step 2's temporary directory exists; ``--then after-kill`` (in a
fresh run) reads what is left. ``--then disagree`` starts process 0 with a
loss scale of 2**15 and the others with 2**10, and records what a save, a
linen train step and an NNX train step on that state say, and what the
optimizer's `init` says outside jit. ``--then`` may be given more than
once: its scenarios run in that order.
"""

import argparse
import json
import os
import shutil
import signal
import sys
import time

import simulated_devices


def parse_args(argv):
  p = argparse.ArgumentParser()
  p.add_argument("--process-id", type=int, default=0)
  p.add_argument("--num-processes", type=int, default=1)
  p.add_argument("--local-devices", type=int, required=True)
  p.add_argument("--out", required=True)
  p.add_argument("--then", action="append", default=[],
                 choices=("kill", "after-kill", "disagree"))
  p.add_argument("--cases", default="")
  p.add_argument("--steps", type=int, default=6)
  p.add_argument("--ckpt", default=None)
  p.add_argument("--save-at", type=int, default=None)
  p.add_argument("--resume", action="store_true")
  p.add_argument("--kill-process", type=int, default=1)
  return p.parse_args(argv)


ARGS = parse_args(sys.argv[1:])
# Every program at XLA:CPU's backend level 0 (FAST_COMPILE's, below): the
# inits, gathers and checkpoints' copies too, in every process alike.
simulated_devices.simulate(ARGS.local_devices)

# pylint: disable=g-import-not-at-top,wrong-import-position
import jax

if ARGS.num_processes > 1:
  # As docs/multi-host.md says: the launcher sets JAX_COORDINATOR_ADDRESS
  # and JAX_CPU_COLLECTIVES_IMPLEMENTATION=gloo in every process's
  # environment; the process count and index are passed.
  assert jax.config.jax_cpu_collectives_implementation == "gloo"
  jax.distributed.initialize(num_processes=ARGS.num_processes,
                             process_id=ARGS.process_id,
                             initialization_timeout=120)

from flax import nnx
from jax.experimental import multihost_utils
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax

import jmp_amp
from jmp_amp import models
import jmp_amp.flax

FAULT_STEPS = (1, 4)
PER_DEVICE_BATCH = 2
SEQ_LEN = 8
VOCAB = 64
MLP_IN, MLP_OUT = 16, 8
FAST_COMPILE = {"xla_backend_optimization_level": 0}


# --------------------------------------------------------------------------
# Global arrays.


def parse_case(case):
  """(case without its suffixes, devices or None, processes or None)."""
  base, _, procs = case.partition("%")
  base, _, devices = base.partition("@")
  return base, int(devices) if devices else None, int(procs) if procs else None


def simulated_processes(case) -> int:
  """How many processes the run has, or stands for (the reference run)."""
  procs = parse_case(case)[2]
  if ARGS.num_processes > 1:
    assert procs in (None, ARGS.num_processes), case
    return ARGS.num_processes
  return procs or int(os.environ.get("DISTRIBUTED_CHECK_AS_PROCESSES", "1"))


def make_mesh(explicit=False, num_devices=None):
  types = (jax.sharding.AxisType.Explicit,) if explicit else None
  mesh = Mesh(np.array(jax.devices()[:num_devices]), ("data",),
              axis_types=types)
  owners = [d.process_index for d in mesh.devices.flat]
  # The batch rows of process p are a contiguous block: the reference run
  # puts its fault into the same global rows.
  assert owners == sorted(owners), owners
  return mesh


def global_batch(mesh, host_array):
  """`host_array` (the global batch, known to all) split over processes:
  each process passes only the rows its devices hold."""
  sharding = NamedSharding(mesh, P("data"))
  n, pid = jax.process_count(), jax.process_index()
  rows = host_array.shape[0] // n
  local = host_array[pid * rows:(pid + 1) * rows]
  return jax.make_array_from_process_local_data(sharding, local,
                                                host_array.shape)


def global_value(x, sharding):
  """A value every process knows (an initial param) as a global array."""
  x = np.asarray(x)
  return jax.make_array_from_callback(x.shape, sharding, lambda i: x[i])


def fsdp_spec(shape, n) -> P:
  for dim, size in enumerate(shape):
    if size % n == 0:
      return P(*([None] * dim), "data")
  return P()


def shardings(mesh, tree, layout, explicit=False):
  def one(x):
    # Explicit: a bias split like the batch cannot be added to it.
    split = layout == "fsdp" and (np.ndim(x) > 1 or not explicit)
    spec = fsdp_spec(np.shape(x), mesh.size) if split else P()
    return NamedSharding(mesh, spec)
  return jax.tree.map(one, tree)


def local_value(x):
  """A replicated array's value as this process holds it; checks that every
  local device holds the same bytes."""
  shards = [np.asarray(s.data) for s in x.addressable_shards]
  assert all(s.tobytes() == shards[0].tobytes() for s in shards), shards
  return shards[0]


def gather(tree):
  """Every leaf of a tree of global arrays, whole, as NumPy (a collective)."""
  leaves = jax.tree.leaves(tree)
  return [np.asarray(x) for x in multihost_utils.process_allgather(
      leaves, tiled=True)]


# --------------------------------------------------------------------------
# Models, data and the train step.


def build(case):
  model_name, layout, precision = parse_case(case)[0].split("-")[:3]
  rngs = nnx.Rngs(0)
  if model_name == "mlp":
    model = models.MLP(MLP_IN, MLP_OUT, num_layers=3, width=32, rngs=rngs)
  else:
    model = models.GPT(vocab_size=VOCAB, d_model=32, num_heads=2,
                       num_layers=1, max_len=SEQ_LEN, rngs=rngs)
  if precision == "fp8":
    jmp_amp.flax.set_policies(model, jmp_amp.flax.fp8.FP8Policy(
        jmp_amp.fp8.FP8Recipe(scaling="delayed", history_len=4),
        keep_first_last=False))
    scale = jmp_amp.NoOpLossScale()
  elif precision == "fp16":
    jmp_amp.flax.set_policies(model, jmp_amp.flax.mixed_rules("float16"))
    scale = jmp_amp.DynamicLossScale(2.0**15, period=2)
  else:
    jmp_amp.flax.set_policies(model, jmp_amp.flax.mixed_rules("bfloat16"))
    scale = jmp_amp.NoOpLossScale()
  opt = jmp_amp.loss_scaling(optax.adam(1e-2), scale)
  return model_name, layout, precision, model, opt


def batches(model_name, num_steps, batch_size, processes):
  """The global batches of every step, the same in every process."""
  rng = np.random.default_rng(1)
  weights = np.ones((num_steps, batch_size), np.float32)
  fault_row = (processes - 1) * (batch_size // processes)
  for s in FAULT_STEPS:
    if s < num_steps:
      weights[s, fault_row] = np.nan
  if model_name == "mlp":
    x = rng.normal(size=(num_steps, batch_size, MLP_IN)).astype(np.float32)
    # The last process's examples are the largest (the FP8 amax lives there).
    x[:, fault_row:] *= 4.0
    y = np.sin(x[..., :MLP_OUT]).astype(np.float32)
    return x, y, weights, fault_row
  tokens = rng.integers(0, VOCAB, size=(num_steps, batch_size, SEQ_LEN),
                        dtype=np.int32)
  return tokens, tokens, weights, fault_row


def per_example_loss(model_name, model, inputs, targets):
  out = model(inputs).astype(jnp.float32)
  if model_name == "mlp":
    return jnp.mean((out - targets) ** 2, axis=-1)
  ce = optax.softmax_cross_entropy_with_integer_labels(
      out[:, :-1], targets[:, 1:])
  return jnp.mean(ce, axis=-1)


def make_step(model_name, precision, graphdef, opt):
  def loss_fn(model, batch):
    inputs, targets, weights = batch
    losses = per_example_loss(model_name, model, inputs, targets)
    return jnp.sum(weights * losses) / weights.shape[0]

  def step(state, opt_state, batch):
    if precision == "fp8":
      model = nnx.merge(graphdef, state)
      loss, grads = jmp_amp.flax.fp8.value_and_grad(loss_fn)(model, batch)
      params = nnx.state(model, nnx.Param)
      updates, opt_state = opt.update(grads, opt_state, params)
      nnx.update(model, optax.apply_updates(params, updates))
      state = nnx.state(model)
    else:
      loss, grads = jmp_amp.scaled_value_and_grad(
          lambda p: loss_fn(nnx.merge(graphdef, p), batch))(opt_state, state)
      updates, opt_state = opt.update(grads, opt_state, state)
      state = optax.apply_updates(state, updates)
    scaling = jmp_amp.get_scaling_state(opt_state)
    return state, opt_state, {
        "loss": loss, "loss_scale": scaling.loss_scale.loss_scale,
        "grads_finite": scaling.grads_finite,
        "skipped_steps": scaling.skipped_steps, "steps": scaling.steps}
  return step


def fp8_histories(graphdef, state):
  """Every FP8 op's amax histories, whole (split ones gathered)."""
  model = nnx.merge(graphdef, state)
  return {name: {f: a.tolist() for f, a in zip(h._fields, gather(h))}
          for name, h in jmp_amp.flax.fp8.histories(model).items()}


def run_case(case):
  from jmp_amp import checkpoint  # pylint: disable=import-outside-toplevel
  model_name, layout, precision, model, opt = build(case)
  base, num_devices, _ = parse_case(case)
  explicit = base.endswith("-explicit")
  mesh = make_mesh(explicit, num_devices)
  graphdef, state = nnx.split(model)
  state_sh = shardings(mesh, state, layout, explicit)
  # The optimizer sees the params only (FP8 histories are written back).
  opt_init = lambda s: opt.init(nnx.filter_state(s, nnx.Param))
  opt_shape = jax.eval_shape(opt_init, state)
  opt_sh = shardings(mesh, opt_shape, layout, explicit)
  batch_size = PER_DEVICE_BATCH * mesh.size
  processes = simulated_processes(case)
  xs, ys, ws, fault_row = batches(model_name, ARGS.steps, batch_size,
                                  processes)
  step = jax.jit(make_step(model_name, precision, graphdef, opt),
                 out_shardings=(state_sh, opt_sh, None),
                 compiler_options=FAST_COMPILE)
  ckpt_dir = ARGS.ckpt and os.path.join(ARGS.ckpt, case)

  first = 0
  if ARGS.resume:
    target = {"state": jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        state, state_sh),
              "opt_state": jax.tree.map(
                  lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                    sharding=s),
                  opt_shape, opt_sh)}
    restored, first = checkpoint.restore_latest(ckpt_dir, target)
    state, opt_state = restored["state"], restored["opt_state"]
  else:
    state = jax.tree.map(global_value, state, state_sh)
    opt_state = jax.jit(opt_init, out_shardings=opt_sh)(state)

  fault_on_me = [
      s.index[0].start <= fault_row < s.index[0].stop
      for s in global_batch(mesh, xs[0]).addressable_shards]
  record = {"process": jax.process_index(), "processes": jax.process_count(),
            "devices": mesh.size, "fault_row": fault_row,
            "fault_rows_here": any(fault_on_me), "first_step": first,
            "steps": []}
  for i in range(first, ARGS.steps):
    batch = tuple(global_batch(mesh, a[i]) for a in (xs, ys, ws))
    with jax.set_mesh(mesh):  # not the save: orbax 0.11 cannot save there
      state, opt_state, metrics = step(state, opt_state, batch)
    record["steps"].append({k: local_value(v).item()
                            for k, v in metrics.items()})
    if ckpt_dir and ARGS.save_at == i + 1:
      checkpoint.save(ckpt_dir, {"state": state, "opt_state": opt_state},
                      step=i + 1)
  leaves = jax.tree.leaves(state)
  record["state_sharded"] = [not x.sharding.is_fully_replicated
                             for x in leaves]
  record["compiles"] = step._cache_size()  # pylint: disable=protected-access
  if precision == "fp8":
    record["fp8_histories"] = fp8_histories(graphdef, state)
    record["fp8_histories_split"] = [
        not h.lhs.sharding.is_fully_replicated for h in
        jmp_amp.flax.fp8.histories(nnx.merge(graphdef, state)).values()]
    record["fp8_global_input_amax"] = float(np.max(np.abs(xs[ARGS.steps - 1])))
    pid_rows = batch_size // processes
    record["fp8_process_input_amax"] = [
        float(np.max(np.abs(xs[ARGS.steps - 1][p * pid_rows:
                                                (p + 1) * pid_rows])))
        for p in range(processes)]
  arrays = gather(state) + gather(opt_state)
  write(case, record, arrays)


def write(name, record, arrays=None):
  path = os.path.join(ARGS.out, f"{name}.p{jax.process_index()}")
  if arrays is not None:
    np.savez(path + ".npz", *arrays)
  with open(path + ".json", "w") as f:
    json.dump(record, f)


# --------------------------------------------------------------------------
# A process killed mid-save.

KILL_WIDTH = 512  # a state of ~2 MB per step: the write takes a while


def kill_state(mesh, step):
  opt = jmp_amp.loss_scaling(optax.adam(1e-3),
                             jmp_amp.DynamicLossScale(2.0**15))
  sh = NamedSharding(mesh, P("data"))
  rng = np.random.default_rng(step)
  params = {"w": global_value(
      rng.normal(size=(KILL_WIDTH, KILL_WIDTH)).astype(np.float32), sh)}
  # The loss scale replicated on the global mesh, the moments like `w`.
  return {"params": params, "opt_state": jax.jit(
      opt.init, out_shardings=shardings(mesh, opt.init(params), "fsdp"))(
          params)}


def kill_scenario(mesh):
  from jmp_amp import checkpoint  # pylint: disable=import-outside-toplevel
  ckpt = os.path.join(ARGS.ckpt, "kill")
  # A state on this process's devices only is refused with a clear error.
  opt = jmp_amp.loss_scaling(optax.sgd(0.1), jmp_amp.DynamicLossScale(2.0))
  try:
    checkpoint.save(os.path.join(ARGS.ckpt, "local"),
                    opt.init({"w": jnp.ones(3)}), step=0)
    local_error = None
  except ValueError as e:
    local_error = str(e)
  write("local-save", {"error": local_error})
  checkpoint.save(ckpt, kill_state(mesh, 1), step=1)
  mngr = checkpoint.CheckpointManager(ckpt, async_save=True)
  mngr.save(2, kill_state(mesh, 2))
  if jax.process_index() == ARGS.kill_process:
    names = lambda: [n for n in os.listdir(ckpt) if n.startswith("2.")]
    deadline = time.monotonic() + 60
    while not names() and time.monotonic() < deadline:
      time.sleep(0.001)
    write("kill", {"saw": names()})
    os.kill(os.getpid(), signal.SIGKILL)
  mngr.wait_until_finished()  # blocks: a peer never finishes its part
  write("kill", {"finished": True})


def after_kill_scenario(mesh):
  from jmp_amp import checkpoint  # pylint: disable=import-outside-toplevel
  ckpt = os.path.join(ARGS.ckpt, "kill")
  want = kill_state(mesh, 1)
  target = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
      want)
  restored, step = checkpoint.restore_latest(ckpt, target)
  same = [bool(np.array_equal(a, b)) for a, b in
          zip(gather(restored), gather(want))]
  # A target without shardings: every process restores its own whole copy.
  unsharded = checkpoint.restore(ckpt, jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), want))
  whole = [bool(x.is_fully_addressable and np.array_equal(np.asarray(x), b))
           for x, b in zip(jax.tree.leaves(unsharded), gather(want))]
  with checkpoint.CheckpointManager(ckpt) as mngr:
    sums = mngr.metadata(1)["checksums"]
  write("after-kill", {"latest_step": checkpoint.latest_step(ckpt),
                       "restored_step": step, "restored_equal": same,
                       "unsharded_equal": whole,
                       "checksummed": sorted(sums["arrays"]),
                       "shards_checksummed": {
                           k: sorted(v) for k, v in sums["shards"].items()},
                       "listing": sorted(os.listdir(ckpt))})
  swapped_arrays(mesh, target)


def swapped_arrays(mesh, target):
  """Another save's array files in place of step 1's: the split params'
  shard checksums catch it in every process."""
  from jmp_amp import checkpoint  # pylint: disable=import-outside-toplevel
  base = os.path.join(ARGS.ckpt, "swap")
  checkpoint.save(os.path.join(base, "a"), kill_state(mesh, 1), step=1)
  checkpoint.save(os.path.join(base, "b"), kill_state(mesh, 3), step=1)
  multihost_utils.sync_global_devices("saved")
  if jax.process_index() == 0:
    shutil.rmtree(os.path.join(base, "a", "1", "state"))
    shutil.copytree(os.path.join(base, "b", "1", "state"),
                    os.path.join(base, "a", "1", "state"))
  multihost_utils.sync_global_devices("swapped")
  errors = []
  # Into the saved shardings (each process checks its shards), and whole
  # into each process (each checks every saved shard).
  for t in (target, jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), target)):
    try:
      checkpoint.restore(os.path.join(base, "a"), t)
      errors.append(None)
    except checkpoint.CheckpointError as e:
      errors.append({"message": str(e), "where": e.where, "step": e.step})
  write("swapped", {"errors": errors})


# --------------------------------------------------------------------------
# Processes that disagree on replicated state.


def disagree_scenario(mesh):
  from jmp_amp import checkpoint  # pylint: disable=import-outside-toplevel
  from jmp_amp.flax import train  # pylint: disable=import-outside-toplevel
  scale = 2.0**15 if jax.process_index() == 0 else 2.0**10
  tx = jmp_amp.loss_scaling(optax.adam(1e-3), jmp_amp.DynamicLossScale(scale))
  replicated = NamedSharding(mesh, P())
  module = models.LinenMLP(MLP_IN, MLP_OUT, 2, width=8)
  params = module.init(jax.random.key(0), np.ones((1, MLP_IN), np.float32))
  params = jax.tree.map(lambda x: global_value(x, replicated),
                        params["params"])
  state = jax.jit(lambda p: train.TrainState.create(
      apply_fn=module.apply, params=p, tx=tx),
                  out_shardings=replicated)(params)
  record = {}
  try:
    checkpoint.save(os.path.join(ARGS.ckpt, "disagree"),
                    {"params": state.params, "opt_state": state.opt_state},
                    step=0)
    record["save"] = None
  except ValueError as e:
    record["save"] = {"type": type(e).__name__, "message": str(e),
                      "reason": getattr(e, "reason", None)}
  # A hand-written step's init, outside jit: refused before any step.
  try:
    tx.init(params)
    record["init"] = None
  except ValueError as e:
    record["init"] = str(e)
  step = jmp_amp.flax.make_linen_train_step(
      lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2), donate=False,
      mutable=())
  batch = tuple(global_batch(mesh, np.ones((PER_DEVICE_BATCH
                                            * jax.device_count(), n),
                                           np.float32))
                for n in (MLP_IN, MLP_OUT))
  try:
    step(state, batch)
    record["linen_step"] = None
  except ValueError as e:
    record["linen_step"] = str(e)
  # The same processes with the same scale: both go through.
  same = jax.jit(lambda p: train.TrainState.create(
      apply_fn=module.apply, params=p, tx=jmp_amp.loss_scaling(
          optax.adam(1e-3), jmp_amp.DynamicLossScale(2.0**15))),
                 out_shardings=replicated)(params)
  checkpoint.save(os.path.join(ARGS.ckpt, "agree"),
                  {"params": same.params, "opt_state": same.opt_state},
                  step=0)
  _, metrics = step(same, batch)
  record["agree_steps"] = int(local_value(metrics["steps"]))
  agree = jmp_amp.loss_scaling(optax.adam(1e-3),
                               jmp_amp.DynamicLossScale(2.0**15))
  record["agree_init"] = int(local_value(agree.init(params).steps))
  write("disagree", record)


def main():
  os.makedirs(ARGS.out, exist_ok=True)
  mesh = make_mesh()
  for case in filter(None, ARGS.cases.split(",")):
    run_case(case)
  scenarios = {"after-kill": after_kill_scenario,
               "disagree": disagree_scenario,
               # Does not return in process --kill-process.
               "kill": kill_scenario}
  for then in ARGS.then:
    scenarios[then](mesh)
  if ARGS.num_processes > 1:
    jax.distributed.shutdown()
  return 0


if __name__ == "__main__":
  sys.exit(main())
