"""The tiny Llama under `jax.set_mesh` with an Explicit fsdp x tensor mesh.

Run as a script on 8 simulated CPU devices (tests/test_llama_mesh.py does,
in a subprocess: the device count must be set before JAX initialises).
Prints one JSON object of named results on the last line of stdout; a check
that raises records ``"error: ..."`` under its name.

The mesh is built as a user builds it: ``jax.make_mesh((2, 4), ("fsdp",
"tensor"), axis_types=(Explicit,) * 2)`` and ``with jax.set_mesh(mesh):``;
the batch is split over "fsdp" with `jax.sharding.reshard`, and so are the
params, by a layout (below). `models/llama.py` is the model as it is: no
``out_sharding`` in its calls. ``layouts/<name>`` records which layouts run
a training step on it and the error of those that do not. Every feature is
compared with the same run on one device, without a mesh.
"""

import inspect
import json
import os
import sys
import tempfile
import traceback

import simulated_devices

NUM_DEVICES = 8
simulated_devices.simulate(NUM_DEVICES)

# pylint: disable=g-import-not-at-top,wrong-import-position
from flax import nnx
import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))
from jmp_amp.models import Llama
from jmp_amp.models import LlamaConfig
from jmp_amp.models import lm_loss

import jmp_amp
from jmp_amp import checkpoint
import jmp_amp.flax

CONFIG = LlamaConfig.preset("tiny")
REMAT = "dots_with_no_batch_dims_saveable"
STEPS = 3
RESULTS = {}


def error(e) -> str:
  return "error: " + "".join(
      traceback.format_exception_only(type(e), e))[-1500:]


def sequences(seed, batch=8):
  """Arithmetic sequences mod the vocabulary (as tests/test_llama.py)."""
  rng = np.random.default_rng(seed)
  start = rng.integers(0, CONFIG.vocab_size, (batch, 1))
  stride = rng.integers(1, 4, (batch, 1))
  t = np.arange(CONFIG.max_len)[None]
  return np.asarray((start + stride * t) % CONFIG.vocab_size, np.int32)


BATCHES = [sequences(seed) for seed in range(STEPS + 3)]


def loss_fn(model, tokens):
  return lm_loss(model(tokens), tokens)


def make_mesh():
  return jax.make_mesh((2, 4), ("fsdp", "tensor"),
                       axis_types=(AxisType.Explicit,) * 2)


def path_str(path) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def _kernel(spec_in, spec_out):
  """A kernel's spec; the scanned blocks' kernels have a leading layer
  axis."""
  def spec(path, ndim):
    del path
    return P(*(None,) * (ndim - 2), spec_in, spec_out)
  return spec


# Layouts: param path, ndim -> spec. "replicated"; "fsdp_x_tensor": the
# blocks' kernels fsdp (their input dimension) x tensor, the head's
# vocabulary columns and the embedding's features over "tensor";
# "megatron": the blocks' column/row split, the head's vocabulary over
# "tensor".
def layout_spec(layout: str, path: str, ndim: int) -> P:
  assert layout in ("replicated", "fsdp_x_tensor", "megatron"), layout
  kernel = path.endswith("kernel")
  if layout == "replicated" or not kernel and "embedding" not in path:
    return P()
  if path.startswith("head"):
    return P(None, "tensor") if layout == "megatron" else P("fsdp", "tensor")
  if path.startswith("embed"):
    return P(None, "tensor") if layout == "fsdp_x_tensor" else P()
  if layout == "megatron":
    rows = path.split("/")[-2] in ("o", "down")
    return _kernel(*(("tensor", None) if rows else (None, "tensor")))(
        path, ndim)
  return _kernel("fsdp", "tensor")(path, ndim)


# The features train on the most sharded, fsdp_x_tensor (a case that cannot
# run on it records the error); `probe_layouts` runs the one whose split
# none of them uses, Megatron's rows. (Replicated, fsdp alone, and fsdp with
# only the head's vocabulary or the embedding's features over "tensor" ran
# too when this was written: each a part of fsdp_x_tensor's or Megatron's
# split.)
LAYOUT = "fsdp_x_tensor"
LAYOUTS = ["megatron"]


def shard_params(model, layout):
  state = nnx.state(model, nnx.Param)
  nnx.update(model, jax.tree_util.tree_map_with_path(
      lambda path, x: jax.sharding.reshard(
          x, layout_spec(layout, path_str(path), x.ndim)), state))


def put(tokens, mesh):
  tokens = jnp.asarray(tokens)
  return tokens if mesh is None else jax.sharding.reshard(tokens, P("fsdp"))


def max_diff(a, b) -> float:
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(la) == len(lb), (len(la), len(lb))
  return max([float(np.max(np.abs(np.asarray(x, np.float64)
                                  - np.asarray(y, np.float64))))
              for x, y in zip(la, lb) if np.size(x)] or [0.0])


def shard_bytes(tree):
  return [(s.device.id, str(s.index), np.asarray(s.data).tobytes())
          for x in jax.tree.leaves(tree) for s in x.addressable_shards]


def replicated_everywhere(x) -> bool:
  values = [np.asarray(s.data).tobytes() for s in x.addressable_shards]
  return all(v == values[0] for v in values)


def kept_layout(model, layout) -> bool:
  pad = lambda spec, n: tuple(spec) + (None,) * (n - len(spec))
  return all(
      pad(x.sharding.spec, x.ndim) == pad(
          layout_spec(layout, path_str(path), x.ndim), x.ndim)
      for path, x in jax.tree_util.tree_leaves_with_path(
          nnx.state(model, nnx.Param)))


# FP8 under Explicit axes is tests/fp8_sharding_check.py's (its ops, and
# FP8 layers set by `set_policies`), and 16-bit optimizer state's
# tests/explicit_sharding_check.py's: the Llama trains the two runners.
MODES = {
    # name: (rules, loss scale)
    "bf16": ("mixed_bfloat16", jmp_amp.NoOpLossScale),
    "fp16": ("mixed_float16", lambda: jmp_amp.DynamicLossScale(2.0 ** 15)),
}


# flax 0.12.3 (the declared minimum): nnx.Embed takes no out_sharding.
EMBED_SHARDS = "out_sharding" in inspect.signature(
    nnx.Embed.__call__).parameters


class RowsEmbed(nnx.Embed):
  """The user's embedding: `nnx.Embed` whose lookup says its output keeps
  the tokens' batch sharding, as Explicit axes ask of a gather of
  batch-split ids (the Llama's own ``self.embed(tokens)`` does not)."""

  def __call__(self, inputs):
    spec = tuple(jax.typeof(inputs).sharding.spec)
    if not spec or spec[0] is None:
      return super().__call__(inputs)
    return super().__call__(inputs, out_sharding=P(
        spec[0], *(None,) * inputs.ndim))


def llama(seed, rows_embed=True):
  """The tiny Llama, scanned and rematerialised; with ``rows_embed`` its
  embedding swapped for a `RowsEmbed` holding the same table (the param
  keeps its path, embed/embedding)."""
  model = Llama(CONFIG, scan_layers=True, remat=REMAT, rngs=nnx.Rngs(seed))
  if rows_embed:
    embed = RowsEmbed(CONFIG.vocab_size, CONFIG.d_model, rngs=nnx.Rngs(0))
    embed.embedding = model.embed.embedding
    model.embed = embed
  return model


def setup(mode, mesh, layout, seed=0, rows_embed=True):
  rules, scale = MODES[mode]
  model = llama(seed, rows_embed)
  if mesh is not None:
    shard_params(model, layout)
  jmp_amp.flax.set_policies(model, rules,
                            example_args=(put(BATCHES[0], mesh),))
  # SGD: a param's difference from one device is lr times its gradient's
  # (Adam divides each by its own size: a gradient near 0 that rounds
  # differently moves its param by up to lr either way).
  tx = optax.sgd(0.1, momentum=0.9)
  return model, nnx.Optimizer(model, jmp_amp.loss_scaling(tx, scale()),
                              wrt=nnx.Param)


def probe_layouts():
  """The forward and backward pass of mixed_bfloat16 per layout, traced
  (Explicit axes type every array's sharding: a layout the model's calls
  cannot run fails there); first the model as it is, replicated."""
  mesh = make_mesh()
  for layout in ["as_is/replicated"] + LAYOUTS:
    with jax.set_mesh(mesh):
      try:
        model, _ = setup("bf16", mesh, layout.split("/")[-1],
                         rows_embed=not layout.startswith("as_is"))
        graphdef, state = nnx.split(model)
        loss, _ = jax.eval_shape(
            lambda s, t: nnx.value_and_grad(loss_fn)(
                nnx.merge(graphdef, s), t), state, put(BATCHES[0], mesh))
        RESULTS[f"layouts/{layout}"] = (
            "ok" if loss.shape == () else f"error: loss of shape {loss.shape}")
      except Exception as e:  # pylint: disable=broad-except
        RESULTS[f"layouts/{layout}"] = error(e)


def hand_written_step():
  """A user's nnx.jit step reading the optimizer's loss scale; ``factor``
  injects an inf into the loss."""
  @nnx.jit
  def step(model, optimizer, tokens, factor):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    def loss_of(params):
      return loss_fn(nnx.merge(graphdef, params, rest), tokens) * factor
    loss, grads = jmp_amp.scaled_value_and_grad(loss_of)(
        optimizer.opt_state, params)
    optimizer.update(model, grads)
    state = jmp_amp.get_scaling_state(optimizer.opt_state)
    return {"loss": loss, "grads_finite": state.grads_finite[...]}
  return step


def train(mode, mesh, layout, hand_written=False, numerics=None):
  model, optimizer = setup(mode, mesh, layout)
  if hand_written:
    step = hand_written_step()
    run = lambda t: step(model, optimizer, put(t, mesh), jnp.float32(1))
  else:
    kwargs = {} if numerics is None else {"numerics": numerics}
    step = jmp_amp.flax.make_train_step(loss_fn, **kwargs)
    run = lambda t: step(model, optimizer, put(t, mesh))
  metrics = [run(t) for t in BATCHES[:STEPS]]
  return model, optimizer, metrics, step


def params(model):
  return jax.tree.map(np.asarray, nnx.state(model, nnx.Param))


def case(name, mode, layout, hand_written=False, numerics=None):
  """The trajectory under the mesh against one device; returns the mesh,
  the trained model, optimizer and step, and both runs' metrics."""
  try:
    ref, _, ref_metrics, _ = train(mode, None, layout, hand_written,
                                   numerics)
    mesh = make_mesh()
    with jax.set_mesh(mesh):
      model, optimizer, metrics, step = train(mode, mesh, layout,
                                              hand_written, numerics)
    losses = lambda ms: [float(m["loss"]) for m in ms]
    finite = lambda ms: [bool(m["grads_finite"]) for m in ms]
    scale = jmp_amp.get_scaling_state(optimizer.opt_state).loss_scale
    got, want = params(model), params(ref)
    diffs = jax.tree.map(lambda a, b: float(np.max(np.abs(
        a.astype(np.float64) - b.astype(np.float64)))), got, want)
    worst = max(jax.tree_util.tree_leaves_with_path(diffs),
                key=lambda pv: pv[1])
    RESULTS[name] = {
        "max_diff": max_diff(got, want),
        "worst_param": path_str(worst[0]),
        "loss_diff": float(np.max(np.abs(np.subtract(
            losses(metrics), losses(ref_metrics))))),
        "finite": finite(metrics) == finite(ref_metrics),
        "sharded": kept_layout(model, layout),
        "scale_replicated": all(replicated_everywhere(x)
                                for x in jax.tree.leaves(scale))}
    return mesh, model, optimizer, step, metrics, ref_metrics
  except Exception as e:  # pylint: disable=broad-except
    RESULTS[name] = error(e)
    return None


def inner_state_bytes(optimizer):
  return shard_bytes(
      jmp_amp.get_scaling_state(optimizer.opt_state).inner_state)


def skip(trained):
  """An inf in the hand-written step's loss: skipped on every shard."""
  mesh, model, optimizer, step, _, _ = trained
  with jax.set_mesh(mesh):
    before = (shard_bytes(nnx.state(model, nnx.Param)),
              inner_state_bytes(optimizer))
    scale = float(jmp_amp.get_scaling_state(
        optimizer.opt_state).loss_scale.loss_scale)
    m = step(model, optimizer, put(BATCHES[STEPS], mesh), jnp.float32(np.inf))
    state = jmp_amp.get_scaling_state(optimizer.opt_state)
    RESULTS["fp16_skip"] = {
        "skipped": not bool(m["grads_finite"]),
        "params_bitwise": shard_bytes(nnx.state(model, nnx.Param))
                          == before[0],
        "state_bitwise": inner_state_bytes(optimizer) == before[1],
        "scale_halved": float(state.loss_scale.loss_scale) == scale / 2,
        "scale_replicated": replicated_everywhere(
            state.loss_scale.loss_scale)}


def telemetry(trained):
  """numerics="**" statistics under the mesh against one device (the bf16
  case's runs)."""
  try:
    *_, got, ref = trained
    # The first step's statistics: the same params on both.
    ref, got = (jax.tree.map(np.asarray, dict(m[0]["numerics"]))
                for m in (ref, got))
    # "zeros", a fraction of the elements, within 0.5 %: bfloat16 sums in
    # another order round a few more or fewer of them to exactly 0.
    def near(path, a, b):
      atol = 5e-3 if path_str(path).endswith("zeros") else 1e-6
      return bool(np.allclose(a, b, rtol=2e-2, atol=atol))
    pairs = list(zip(jax.tree_util.tree_leaves_with_path(got),
                     jax.tree.leaves(ref)))
    far = [(path_str(p), float(a), float(b)) for (p, a), b in pairs
           if not near(p, a, b)]
    RESULTS["telemetry"] = {
        "paths": sorted(got) == sorted(ref) and len(got) > 10,
        "stats_close": not far, "far": far[:5],
        "blocks": sorted(p for p in got if p.startswith("blocks/"))[:3]}
  except Exception as e:  # pylint: disable=broad-except
    RESULTS["telemetry"] = error(e)


def resume(trained, layout):
  """fp16 trained under the mesh (the hand-written case's run, its inf step
  skipped), saved, restored into a fresh sharded model and resumed: bit for
  bit, shard by shard."""
  try:
    mesh, model, optimizer, step, _, _ = trained
    with tempfile.TemporaryDirectory() as tmp:
      # Outside set_mesh, as tests/explicit_sharding_check.py saves (orbax
      # 0.11.20 copies shards to the host with a jit the mesh refuses).
      checkpoint.save(tmp, {"model": model, "opt": optimizer}, step=STEPS)
      with jax.set_mesh(mesh):
        # The target: a copy of the trained state, zeroed (its shardings
        # kept), rather than a fresh model (whose policies trace it).
        model2, optimizer2 = nnx.clone((model, optimizer))
        nnx.update((model2, optimizer2), jax.tree.map(
            jnp.zeros_like, nnx.state((model2, optimizer2))))
        checkpoint.restore(tmp, {"model": model2, "opt": optimizer2})
        equal = (shard_bytes(nnx.state((model, optimizer)))
                 == shard_bytes(nnx.state((model2, optimizer2))))
        for t in BATCHES[STEPS + 1:]:
          step(model, optimizer, put(t, mesh), jnp.float32(1))
          step(model2, optimizer2, put(t, mesh), jnp.float32(1))
        RESULTS["checkpoint"] = {
            "restored_bitwise": equal,
            "resumed_bitwise": shard_bytes(nnx.state((model, optimizer)))
                               == shard_bytes(nnx.state((model2,
                                                         optimizer2))),
            "sharded": kept_layout(model2, layout)}
  except Exception as e:  # pylint: disable=broad-except
    RESULTS["checkpoint"] = error(e)


def main():
  RESULTS["devices"] = jax.device_count()
  if not EMBED_SHARDS:
    RESULTS["skipped"] = "nnx.Embed takes no out_sharding"
  if jax.device_count() != NUM_DEVICES or not EMBED_SHARDS:
    print(json.dumps(RESULTS))
    return 1
  only = sys.argv[sys.argv.index("--only") + 1].split(",") \
      if "--only" in sys.argv else None
  want = lambda name: only is None or name in only
  probe_layouts()
  layout = RESULTS["layout"] = LAYOUT
  # One run serves two checks: bf16's trajectory and its telemetry;
  # fp16's trajectory, its inf step, then its checkpoint.
  if want("bf16") or want("telemetry"):
    trained = case("bf16/make_train_step", "bf16", layout, numerics="**")
    if trained is not None:
      telemetry(trained)
  if want("fp16") or want("checkpoint"):
    trained = case("fp16/hand_written", "fp16", layout, hand_written=True)
    if trained is not None:
      try:
        skip(trained)
      except Exception as e:  # pylint: disable=broad-except
        RESULTS["fp16_skip"] = error(e)
      resume(trained, layout)
  print(json.dumps(RESULTS))
  return 0


if __name__ == "__main__":
  sys.exit(main())
