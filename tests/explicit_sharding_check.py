"""jmp_amp under `jax.set_mesh` with Explicit (and Auto, mixed) mesh axes.

Run as a script on 8 simulated CPU devices (tests/test_explicit_sharding.py
does, in a subprocess: the device count must be set before JAX initialises).
Prints one JSON object of named results on the last line of stdout. A check
that raises records ``"error: ..."`` under its name instead of stopping the
others, so the test names what broke.

Meshes are built as users build them: ``jax.make_mesh(shape, names,
axis_types=...)`` and ``with jax.set_mesh(mesh):``; params are sharded with
`jax.sharding.reshard` (or Flax's ``sharding_names`` metadata) and batches
with `reshard` along ``"fsdp"``. Every trajectory is compared with the same
run on one device, without a mesh.

Usage: explicit_sharding_check.py [--save DIR] [--only A,B]
(every check by default; --only: these checks).
"""

import json
import os
import sys
import tempfile
import traceback

import simulated_devices

NUM_DEVICES = 8
simulated_devices.simulate(NUM_DEVICES)

# pylint: disable=g-import-not-at-top,wrong-import-position
import functools
import inspect

from flax import nnx
import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))
import jmp_amp
from jmp_amp import checkpoint
from jmp_amp import models
import jmp_amp.flax
import jmp_amp.numerics

reshard = jax.sharding.reshard
EXPLICIT, AUTO = AxisType.Explicit, AxisType.Auto
STEPS = 4
BATCH = 16
RESULTS = {}
STATS = {}  # feature: its first step's telemetry under the mesh, on one


def check(fn):
  """Runs `fn(results)`; an exception is recorded under its name."""
  @functools.wraps(fn)
  def run(*args):
    try:
      fn(RESULTS, *args)
    except Exception as e:  # pylint: disable=broad-except
      RESULTS[fn.__name__] = "error: " + "".join(
          traceback.format_exception_only(type(e), e))[-1500:]
  return run


def make_mesh(shape, types=EXPLICIT):
  names = ("fsdp", "tensor")[:len(shape)]
  types = types if isinstance(types, tuple) else (types,) * len(shape)
  return jax.make_mesh(shape, names, axis_types=types)


def max_diff(a, b) -> float:
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(la) == len(lb), (len(la), len(lb))
  return max([float(np.max(np.abs(np.asarray(x, np.float64)
                                  - np.asarray(y, np.float64))))
              for x, y in zip(la, lb) if np.size(x)] or [0.0])


def shard_bytes(tree):
  """Every shard of every leaf, as (device id, index, bytes)."""
  return [(s.device.id, str(s.index), np.asarray(s.data).tobytes())
          for x in jax.tree.leaves(tree) for s in x.addressable_shards]


def replicated_everywhere(x) -> bool:
  values = [np.asarray(s.data).tobytes() for s in x.addressable_shards]
  return all(v == values[0] for v in values)


# Layouts: which mesh axis shards each dimension of a param. A plain Flax
# layer (no `out_sharding` in its calls) runs under Explicit axes when no
# contraction has both operands split (or split over different axes):
# "dp": params replicated; "fsdp": the input dimension of every kernel over
# "fsdp" (the batch's axis); "tp": every projection split by its output
# columns over "tensor" (biases alike). Row-parallel layers need the
# model's calls to say their `out_sharding`: see `MegatronMLP`.
def layout_spec(layout: str, path: str, shape, axes) -> P:
  if layout == "dp" or "embed" in path:
    return P()
  if layout == "fsdp":
    return P("fsdp", None) if len(shape) == 2 else P()
  tensor = "tensor" if "tensor" in axes else None
  return P(None, tensor) if len(shape) == 2 else P(tensor)


def put(x, spec: P, mesh):
  """`x` laid out as `spec`: `reshard` over Explicit axes (its sharding is
  then in its type), `device_put` where an Auto axis is named."""
  explicit = dict(zip(mesh.axis_names, mesh.axis_types))
  if all(explicit[a] == EXPLICIT for a in spec if a is not None):
    return reshard(jnp.asarray(x), spec)
  return jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))


def path_str(path) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def shard_params(model, layout: str, mesh):
  state = nnx.state(model, nnx.Param)
  sharded = jax.tree_util.tree_map_with_path(
      lambda path, x: put(x, layout_spec(layout, path_str(path), x.shape,
                                         mesh.axis_names), mesh), state)
  nnx.update(model, sharded)


def mlp():
  return models.MLP(16, 8, num_layers=4, width=32, rngs=nnx.Rngs(0))


def gpt():
  return models.GPT(vocab_size=64, d_model=32, num_heads=4, num_layers=1,
                    max_len=16, attention="einsum", rngs=nnx.Rngs(0))


def mlp_batches(n=STEPS):
  rng = np.random.default_rng(1)
  return [(np.asarray(rng.normal(size=(BATCH, 16)), np.float32),
           np.asarray(rng.normal(size=(BATCH, 8)), np.float32))
          for _ in range(n)]


def gpt_batches(n=STEPS):
  rng = np.random.default_rng(2)
  return [np.asarray(rng.integers(0, 64, size=(BATCH, 16)), np.int32)
          for _ in range(n)]


def mlp_loss(model, batch):
  return models.mse_loss(model(batch[0]).astype(jnp.float32), batch[1])


def gpt_loss(model, tokens):
  return models.lm_loss(model(tokens), tokens)


def put_batch(batch, mesh):
  if mesh is None:
    return jax.tree.map(jnp.asarray, batch)
  return jax.tree.map(lambda x: put(x, P("fsdp"), mesh), batch)


FEATURES = {
    # name: (model, loss, batches, rules, loss scale, inner optimizer)
    "bf16": (mlp, mlp_loss, mlp_batches, "mixed_bfloat16",
             lambda: jmp_amp.NoOpLossScale(), lambda: optax.sgd(0.05)),
    "fp16_dynamic": (mlp, mlp_loss, mlp_batches,
                     jmp_amp.flax.mixed_rules("float16"),
                     lambda: jmp_amp.DynamicLossScale(2.0 ** 10, period=2),
                     lambda: optax.sgd(0.05)),
    "fp16_static": (mlp, mlp_loss, mlp_batches, "mixed_float16",
                    lambda: jmp_amp.StaticLossScale(2.0 ** 8),
                    lambda: optax.sgd(0.05, momentum=0.9)),
    "gpt_fp16": (gpt, gpt_loss, gpt_batches,
                 jmp_amp.flax.mixed_rules("float16"),
                 lambda: jmp_amp.DynamicLossScale(2.0 ** 12),
                 lambda: optax.sgd(0.5, momentum=0.9)),
    "bf16_state": (mlp, mlp_loss, mlp_batches,
                   jmp_amp.flax.mixed_rules("bfloat16", param="bfloat16"),
                   lambda: jmp_amp.NoOpLossScale(),
                   lambda: optax.chain(
                       jmp_amp.optim.compress_state(
                           optax.sgd(0.05, momentum=0.9)),
                       jmp_amp.optim.low_precision_params("stochastic"))),
}


def build(feature, mesh, layout):
  make_model, _, _, rules, loss_scale, inner = FEATURES[feature]
  model = make_model()
  jmp_amp.flax.set_policies(model, rules)
  if mesh is not None:
    shard_params(model, layout, mesh)
  optimizer = nnx.Optimizer(
      model, jmp_amp.loss_scaling(inner(), loss_scale()), wrt=nnx.Param)
  return model, optimizer


# The features whose make_train_step runs compute telemetry: float16's
# tensor-parallel trajectory on 2x4 gives `telemetry` its statistics, and
# its step is the one `skips` and `checkpoints` train with.
NUMERICS = {"fp16_dynamic": "**"}


@functools.cache
def train_step(loss, numerics=None):
  """One make_train_step step per loss and telemetry: the runs of a shape
  and layout (a trajectory, `skips`, `checkpoints`) compile it once."""
  kwargs = {} if numerics is None else {"numerics": numerics}
  return jmp_amp.flax.make_train_step(loss, **kwargs)


def train_with_make_train_step(feature, mesh, layout):
  _, loss, batches, *_ = FEATURES[feature]
  model, optimizer = build(feature, mesh, layout)
  step = train_step(loss, NUMERICS.get(feature))
  metrics = [step(model, optimizer, put_batch(b, mesh)) for b in batches()]
  return model, optimizer, metrics


def train_by_hand(feature, mesh, layout):
  """A user's own `nnx.jit` step, with `jmp_amp.scaled_value_and_grad`."""
  _, loss_fn, batches, *_ = FEATURES[feature]
  model, optimizer = build(feature, mesh, layout)

  @nnx.jit
  def step(model, optimizer, batch):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    loss, grads = jmp_amp.scaled_value_and_grad(
        lambda p: loss_fn(nnx.merge(graphdef, p, rest), batch))(
            optimizer.opt_state, params)
    optimizer.update(model, grads)
    state = jmp_amp.get_scaling_state(optimizer.opt_state)
    return {"loss": loss, "grads_finite": state.grads_finite[...]}

  metrics = [step(model, optimizer, put_batch(b, mesh)) for b in batches()]
  return model, optimizer, metrics


def params_of(model):
  return nnx.state(model, nnx.Param)


def kept_layout(model, layout, mesh) -> bool:
  """Whether the params kept the layout `shard_params` gave them, over the
  Explicit axes (over Auto ones, a jit without out_shardings may pick
  another)."""
  auto = {a for a, t in zip(mesh.axis_names, mesh.axis_types) if t == AUTO}
  pad = lambda spec, ndim: tuple(None if a in auto else a for a in spec) + (
      None,) * (ndim - len(spec))
  return all(
      pad(x.sharding.spec, x.ndim) == pad(layout_spec(
          layout, path_str(path), x.shape, mesh.axis_names), x.ndim)
      for path, x in jax.tree_util.tree_leaves_with_path(params_of(model)))


MESHES = {
    "8": ((8,), EXPLICIT),
    "2x4": ((2, 4), EXPLICIT),
    "1x1": ((1, 1), EXPLICIT),
    "2x4_auto": ((2, 4), AUTO),
    "2x4_mixed": ((2, 4), (EXPLICIT, AUTO)),
}


def trajectory(feature, runner, mesh_name, layout, refs):
  """Trains `feature` under the mesh; the max param difference with the
  one-device run, and whether each step's finite flag matched it."""
  key = (feature, runner.__name__)
  if key not in refs:
    model, _, metrics = runner(feature, None, layout)
    refs[key] = (params_of(model), metrics)
  shape, types = MESHES[mesh_name]
  mesh = make_mesh(shape, types)
  with jax.set_mesh(mesh):
    model, optimizer, metrics = runner(feature, mesh, layout)
  ref_params, ref_metrics = refs[key]
  finite = lambda ms: [bool(m["grads_finite"]) for m in ms]
  if "numerics" in metrics[0]:  # the first step's (the same params): both
    STATS[feature] = [jax.tree.map(np.asarray, dict(m[0]["numerics"]))
                      for m in (metrics, ref_metrics)]
  return {"max_diff": max_diff(params_of(model), ref_params),
          "finite": finite(metrics) == finite(ref_metrics),
          "sharded": kept_layout(model, layout, mesh),
          "scale_replicated": all(
              replicated_everywhere(x) for x in jax.tree.leaves(
                  jmp_amp.get_scaling_state(
                      optimizer.opt_state).loss_scale))}


# The trajectories: (feature, runner, mesh, layout). Every feature, runner,
# mesh and layout at least once, each feature's one-device reference trained
# once (by one runner): the 1x1 mesh; tensor parallel on Explicit,
# Auto and mixed axes (float16's on 2x4 with telemetry, in the step `skips`
# and `checkpoints` train with); FSDP and data parallel on 8 devices (the
# GPT's embedding lookup of batch-split ids). A hand-written step on 2x4 is
# `skips`'s.
RUNS = [
    ("bf16", train_with_make_train_step, "1x1", "tp"),
    ("bf16", train_with_make_train_step, "2x4_mixed", "tp"),
    ("fp16_dynamic", train_with_make_train_step, "2x4", "tp"),
    ("fp16_static", train_with_make_train_step, "2x4_auto", "tp"),
    ("bf16_state", train_by_hand, "8", "fsdp"),
    ("gpt_fp16", train_by_hand, "8", "dp"),
]


# flax 0.12.3 (the declared minimum): nnx.Embed takes no out_sharding, which
# a lookup of batch-split ids needs under Explicit axes.
EMBED_SHARDS = "out_sharding" in inspect.signature(
    nnx.Embed.__call__).parameters


def run_trajectories(runs):
  refs = {}
  for feature, runner, mesh_name, layout in runs:
    if feature.startswith("gpt") and not EMBED_SHARDS:
      RESULTS["gpt_skipped"] = "nnx.Embed takes no out_sharding"
      continue
    name = f"traj/{feature}/{runner.__name__}/{mesh_name}/{layout}"
    try:
      RESULTS[name] = trajectory(feature, runner, mesh_name, layout, refs)
    except Exception as e:  # pylint: disable=broad-except
      RESULTS[name] = "error: " + "".join(
          traceback.format_exception_only(type(e), e))[-1500:]


class MegatronMLP(nnx.Module):
  """A user's tensor-parallel MLP, sharded by Flax's own metadata: the first
  projection split by columns, the second by rows, whose call says its
  output sharding (rows of the batch, features whole) as Explicit axes
  require."""

  def __init__(self, rngs):
    init = nnx.initializers.lecun_normal()
    self.up = nnx.Linear(
        16, 64, kernel_init=nnx.with_partitioning(init, (None, "tensor")),
        bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(),
                                        ("tensor",)), rngs=rngs)
    self.down = nnx.Linear(
        64, 8, kernel_init=nnx.with_partitioning(init, ("tensor", None)),
        rngs=rngs)

  def __call__(self, x):
    spec = jax.typeof(x).sharding.spec
    out = None if all(a is None for a in spec) else P(spec[0], None)
    return self.down(jax.nn.relu(self.up(x)), out_sharding=out)


def train_megatron(rules, loss_scale, mesh, **step_kwargs):
  model = MegatronMLP(nnx.Rngs(0))
  if rules is not None:
    jmp_amp.flax.set_policies(model, rules)
  optimizer = nnx.Optimizer(model, jmp_amp.loss_scaling(
      optax.sgd(0.05), loss_scale), wrt=nnx.Param)
  step = jmp_amp.flax.make_train_step(mlp_loss, **step_kwargs)
  metrics = [step(model, optimizer, put_batch(b, mesh))
             for b in mlp_batches()]
  return model, metrics


@check
def megatron(results):
  """Row- and column-parallel layers (out_sharding through the policies'
  matmul knobs, and through autocast)."""
  for name, rules, scale, kwargs in (
      ("fp16_policy", "mixed_float16", jmp_amp.DynamicLossScale(2.0 ** 10),
       {}),
      # (autocast to float16 takes the same path, another dtype.)
      ("bf16_autocast", None, jmp_amp.NoOpLossScale(),
       {"autocast": "bfloat16"})):
    # The reference: one device (Flax's sharding metadata needs a mesh).
    one = make_mesh((1, 1))
    with jax.set_mesh(one):
      ref, _ = train_megatron(rules, scale, one, **kwargs)
    mesh = make_mesh((2, 4))
    with jax.set_mesh(mesh):
      model, metrics = train_megatron(rules, scale, mesh, **kwargs)
    results[f"megatron/{name}"] = {
        "max_diff": max_diff(params_of(model), params_of(ref)),
        "finite": all(bool(m["grads_finite"]) for m in metrics),
        "down_spec": list(
            jax.typeof(model.down.kernel[...]).sharding.spec)}


def overflow_batch(batch, row):
  """`batch` with example `row` scaled into float16 overflow."""
  x, y = batch
  x = x.copy()
  x[row] = 6e4
  return x, y


def inner_state_bytes(optimizer):
  """Every shard of the optimizer state but the loss-scaling counters."""
  state = jmp_amp.get_scaling_state(optimizer.opt_state)
  return shard_bytes(state.inner_state)


def fp16_tp_step():
  """The make_train_step step that the float16 trajectory on 2x4, `skips`
  and `checkpoints` train the MLP with, tensor parallel: compiled once."""
  return train_step(mlp_loss, NUMERICS["fp16_dynamic"])


@check
def skips(results):
  """An overflow in one device's part of the batch, and an inf in one shard
  of one gradient: the whole step skips, every shard bit for bit kept."""
  mesh = make_mesh((2, 4))
  batches = mlp_batches(3)
  with jax.set_mesh(mesh):
    model, optimizer = build("fp16_dynamic", mesh, "tp")
    step = fp16_tp_step()
    for b in batches[:2]:
      step(model, optimizer, put_batch(b, mesh))
    before = (shard_bytes(params_of(model)), inner_state_bytes(optimizer))
    scale = float(jmp_amp.get_scaling_state(
        optimizer.opt_state).loss_scale.loss_scale)
    bad = put_batch(overflow_batch(batches[2], BATCH - 1), mesh)
    rows = [s.device.id for s in bad[0].addressable_shards
            if s.index[0].start <= BATCH - 1 < s.index[0].stop]
    m = step(model, optimizer, bad)
    state = jmp_amp.get_scaling_state(optimizer.opt_state)
    results["skip_batch"] = {
        "overflow_devices": rows,
        "skipped": not bool(m["grads_finite"]),
        "params_bitwise": shard_bytes(params_of(model)) == before[0],
        "state_bitwise": inner_state_bytes(optimizer) == before[1],
        "scale_halved": float(state.loss_scale.loss_scale) == scale / 2,
        "scale_replicated": replicated_everywhere(
            state.loss_scale.loss_scale)}

    # A user's nnx.jit step: an inf in the gradient's last column, which
    # lives on the devices of tensor index 3 only.
    @nnx.jit
    def poisoned_step(model, optimizer, batch):
      graphdef, params, rest = nnx.split(model, nnx.Param, ...)
      _, grads = jmp_amp.scaled_value_and_grad(
          lambda p: mlp_loss(nnx.merge(graphdef, p, rest), batch))(
              optimizer.opt_state, params)
      g = grads["layers"][0]["kernel"]
      column = jax.lax.broadcasted_iota(jnp.int32, g.shape, 1)
      g[...] = jnp.where(column == g.shape[1] - 1, jnp.inf, g[...])
      optimizer.update(model, grads)
      return jmp_amp.get_scaling_state(optimizer.opt_state).grads_finite

    before = (shard_bytes(params_of(model)), inner_state_bytes(optimizer))
    finite = poisoned_step(model, optimizer, put_batch(batches[0], mesh))
    kernel = model.layers[0].kernel[...]
    results["skip_grad_shard"] = {
        "inf_devices": sorted(
            s.device.id for s in kernel.addressable_shards
            if s.index[1].start <= kernel.shape[1] - 1 < s.index[1].stop),
        "skipped": not bool(finite[...]),
        "params_bitwise": shard_bytes(params_of(model)) == before[0],
        "state_bitwise": inner_state_bytes(optimizer) == before[1]}


def restore_into(directory, mesh, layout):
  model, optimizer = build("fp16_dynamic", mesh, layout)
  checkpoint.restore(directory, {"model": model, "optimizer": optimizer})
  return model, optimizer


@check
def checkpoints(results, save_to=None):
  """Saved under a 2x4 mesh; restored under it (and resumed: bit for bit),
  under an 8-device FSDP mesh and under a 1x1 mesh."""
  batches = mlp_batches(4)
  mesh = make_mesh((2, 4))
  with tempfile.TemporaryDirectory() as tmp:
    directory = save_to or tmp
    with jax.set_mesh(mesh):
      model, optimizer = build("fp16_dynamic", mesh, "tp")
      step = fp16_tp_step()
      for b in batches[:2]:
        step(model, optimizer, put_batch(b, mesh))
    # Outside `set_mesh`: orbax-checkpoint 0.11.20 (the declared minimum)
    # copies shards to the host with a jit that the context mesh refuses.
    checkpoint.save(directory, {"model": model, "optimizer": optimizer},
                    step=2)
    saved = jax.tree.map(np.asarray, nnx.state((model, optimizer)))
    with jax.set_mesh(mesh):
      model2, optimizer2 = restore_into(directory, mesh, "tp")
      for b in batches[2:]:
        step(model, optimizer, put_batch(b, mesh))
        step(model2, optimizer2, put_batch(b, mesh))
      results["ckpt_resume_bitwise"] = (
          shard_bytes(nnx.state((model, optimizer)))
          == shard_bytes(nnx.state((model2, optimizer2))))
    for name, shape, layout in (("8_fsdp", (8,), "fsdp"),
                                ("1x1", (1, 1), "tp")):
      other = make_mesh(shape)
      with jax.set_mesh(other):
        model3, optimizer3 = restore_into(directory, other, layout)
      state3 = nnx.state((model3, optimizer3))
      kernel = model3.layers[0].kernel[...]
      results[f"ckpt_restore_{name}"] = {
          "equal": max_diff(jax.tree.map(np.asarray, state3), saved) == 0,
          "mesh": dict(kernel.sharding.mesh.shape),
          "spec": list(kernel.sharding.spec)}
    if save_to:
      np.savez(os.path.join(save_to, "expected.npz"), *jax.tree.leaves(saved))


@check
def linen(results):
  """make_linen_train_step, params column-parallel over "tensor"."""
  module = models.LinenMLP(16, 8, num_layers=4, width=32)

  def train(mesh):
    variables = jmp_amp.flax.init_with_policies(
        module, "mixed_float16", jax.random.key(0), jnp.ones((1, 16)))
    params = variables["params"]
    if mesh is not None:
      params = jax.tree.map(lambda x: put(x, P(*(None,) * (x.ndim - 1),
                                               "tensor"), mesh), params)
    state = jmp_amp.flax.train.TrainState.create(
        apply_fn=functools.partial(jmp_amp.flax.apply_with_policies, module,
                                   "mixed_float16"),
        params=params, tx=jmp_amp.loss_scaling(
            optax.sgd(0.05), jmp_amp.DynamicLossScale(2.0 ** 10)))
    step = jmp_amp.flax.make_linen_train_step(
        lambda model, b: models.mse_loss(
            model(b[0]).astype(jnp.float32), b[1]))
    for b in mlp_batches():
      state, metrics = step(state, put_batch(b, mesh))
    return state, metrics

  ref, _ = train(None)
  mesh = make_mesh((2, 4))
  with jax.set_mesh(mesh):
    state, metrics = train(mesh)
  results["linen"] = {
      "max_diff": max_diff(state.params, ref.params),
      "finite": bool(metrics["grads_finite"]),
      "spec": list(jax.typeof(
          state.params["layers_0"]["kernel"]).sharding.spec)}


@check
def telemetry(results):
  """numerics= statistics (the float16 trajectory's first step, tensor
  parallel on 2x4) and find_nonfinite under the 2x4 mesh."""
  if "fp16_dynamic" not in STATS:
    run_trajectories([r for r in RUNS if r[0] == "fp16_dynamic"])
  got, ref = STATS["fp16_dynamic"]

  def localise(mesh):
    model, _ = build("fp16_dynamic", mesh, "tp")
    return jmp_amp.numerics.find_nonfinite(
        mlp_loss, model, put_batch(overflow_batch(mlp_batches(1)[0], 3),
                                   mesh))

  ref_report = localise(None)
  mesh = make_mesh((2, 4))
  with jax.set_mesh(mesh):
    report = localise(mesh)
  close = jax.tree.map(lambda a, b: bool(np.allclose(a, b, rtol=2e-2,
                                                     atol=1e-6)), got, ref)
  results["telemetry"] = {
      "stats_close": all(jax.tree.leaves(close)),
      "paths": sorted(got) == sorted(ref),
      "report_same": (report is not None and ref_report is not None and
                      (report.primitive, report.module, report.direction)
                      == (ref_report.primitive, ref_report.module,
                          ref_report.direction)),
      "report": None if report is None else [report.primitive, report.module]}


def main():
  RESULTS["devices"] = jax.device_count()
  if jax.device_count() != NUM_DEVICES:
    print(json.dumps(RESULTS))
    return 1
  save_to = sys.argv[sys.argv.index("--save") + 1] if "--save" in sys.argv \
      else None
  only = sys.argv[sys.argv.index("--only") + 1].split(",") \
      if "--only" in sys.argv else None
  checks = {"trajectories": lambda: run_trajectories(RUNS),
            "megatron": megatron, "skips": skips,
            "checkpoints": lambda: checkpoints(save_to), "linen": linen,
            "telemetry": telemetry}
  for name, fn in checks.items():
    if only is None or name in only:
      fn()
  print(json.dumps(RESULTS))
  return 0


if __name__ == "__main__":
  sys.exit(main())
