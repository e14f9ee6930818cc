"""Checkpoint/resume with jmp_amp.checkpoint (orbax, no pickle).

A run interrupted at step k and resumed from its checkpoint ends bit-for-bit
where the uninterrupted run ends, with float16 compute, dynamic loss scaling
and skipped steps on both sides of k; restoring into a target that differs
(dtypes, tree structure, shapes, loss-scale hyper-parameters) raises an error
that names the difference.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_amp
from helpers import tree_bytes_equal
import reliability_helpers as rh

ocp = pytest.importorskip("orbax.checkpoint")
from jmp_amp import checkpoint  # pylint: disable=g-import-not-at-top

NUM_STEPS, RESUME_AT = 16, 8
# Faults before and after the interruption; 7 and 8 straddle it, so that the
# checkpoint holds a half-way hysteresis count (overflows == 1).
FAULTS = np.array([2, 5, 7, 8, 12], np.int32)


def _optimizer(**kwargs):
  kwargs = {"init_scale": 2.0**15, "period": 3, "hysteresis": 2, **kwargs}
  return rh.make_optimizer(**kwargs)


@pytest.fixture(scope="module")
def setup():
  opt = _optimizer()
  step = jax.jit(rh.make_train_step(opt, rh.F16, fault_key=jax.random.key(7)))
  xs, ys = rh.make_batches(2, NUM_STEPS)
  return opt, step, xs, ys


def _run(step, state, xs, ys, steps):
  metrics = []
  for i in steps:
    state, m = step(state, (xs[i], ys[i]), jnp.int32(i), jnp.asarray(FAULTS))
    metrics.append(m)
  return state, metrics


def test_resume_is_bit_identical(setup, tmp_path):
  opt, step, xs, ys = setup
  # Committed, like restored arrays (and any sharded state): jit keys its
  # cache on committedness, and the resumed steps should reuse the program.
  start = jax.device_put(rh.init_state(0, opt),
                         jax.devices()[0])
  full, metrics = _run(step, start, xs, ys, range(NUM_STEPS))

  first, _ = _run(step, start, xs, ys, range(RESUME_AT))
  checkpoint.save(tmp_path, first, step=RESUME_AT)
  del first
  # A fresh process would build its state from scratch: use other values.
  target = rh.init_state(99, opt)
  resumed = checkpoint.restore(tmp_path, target)
  scaling = jmp_amp.get_scaling_state(resumed["opt_state"])
  assert int(scaling.steps) == RESUME_AT
  assert int(scaling.loss_scale.overflows) == 1  # mid-hysteresis survives
  resumed, resumed_metrics = _run(step, resumed, xs, ys,
                                  range(RESUME_AT, NUM_STEPS))

  assert tree_bytes_equal(resumed, full)
  finite = np.array([bool(m["grads_finite"]) for m in metrics])
  np.testing.assert_array_equal(np.flatnonzero(~finite), FAULTS)
  scales = [float(m["loss_scale"]) for m in metrics]
  assert len(set(scales)) > 2  # it both grew and backed off
  assert [float(m["loss_scale"]) for m in resumed_metrics] == scales[RESUME_AT:]
  assert step._cache_size() == 1  # the resumed steps reused the program


def test_round_trip_keeps_every_leaf_and_hyperparameter(tmp_path):
  opt = _optimizer(period=5, factor=3, backoff_factor=0.25,
                   max_loss_scale=2.0**20, min_loss_scale=2.0)
  state = rh.init_state(0, opt)
  checkpoint.save(tmp_path, state, step=0)
  meta = checkpoint.CheckpointManager(tmp_path).metadata()
  (spec,) = meta["loss_scales"].values()
  assert spec == {"type": "DynamicLossScale", "period": 5, "factor": 3,
                  "min_loss_scale": 2.0, "backoff_factor": 0.25,
                  "max_loss_scale": 2.0**20, "hysteresis": 2}
  restored = checkpoint.restore(tmp_path, jax.eval_shape(lambda: state))
  assert tree_bytes_equal(restored, state)
  assert restored["opt_state"].loss_scale == state["opt_state"].loss_scale


def test_manager_keeps_steps_and_restores_latest_or_chosen(tmp_path):
  opt = _optimizer()
  states = [rh.init_state(i, opt) for i in range(3)]
  with checkpoint.CheckpointManager(tmp_path, max_to_keep=2) as mngr:
    for i, s in enumerate(states):
      mngr.save(10 * i, s)
    mngr.wait_until_finished()
    assert mngr.all_steps() == [10, 20]
    assert tree_bytes_equal(mngr.restore(states[0]), states[2])
    assert tree_bytes_equal(mngr.restore(states[0], step=10), states[1])
    with pytest.raises(FileNotFoundError, match="no checkpoint for step 0"):
      mngr.restore(states[0], step=0)
  assert checkpoint.latest_step(tmp_path) == 20
  assert checkpoint.latest_step(tmp_path / "nowhere") is None


def _saved(tmp_path, **opt_kwargs):
  opt = _optimizer(**opt_kwargs)
  state = rh.init_state(0, opt)
  checkpoint.save(tmp_path, state, step=1)
  return opt, state


def test_restore_into_bfloat16_params_names_the_dtype_mismatch(tmp_path):
  _, state = _saved(tmp_path)
  target = {"params": jmp_amp.get_policy("bf16").cast_to_param(state["params"]),
            "opt_state": state["opt_state"]}
  with pytest.raises(checkpoint.CheckpointMismatchError,
                     match=r"dtype mismatch[\s\S]*\['params'\]\['dense0'\]"
                     r"\['w'\]: saved float32, target bfloat16"):
    checkpoint.restore(tmp_path, target)
  # Asked for explicitly, the cast happens (orbax casts on restore).
  restored = checkpoint.restore(tmp_path, target, cast_dtypes=True)
  assert restored["params"]["dense0"]["w"].dtype == jnp.bfloat16


@pytest.mark.parametrize("change,match", [
    ({"period": 4}, r"period: saved 3, target 4"),
    ({"factor": 4}, r"factor: saved 2, target 4"),
    ({"hysteresis": 1}, r"hysteresis: saved 2, target 1"),
    ({"max_loss_scale": 2.0**24}, r"max_loss_scale: saved None, target"),
])
def test_changed_loss_scale_hyperparameters_raise(tmp_path, change, match):
  _saved(tmp_path)
  target = rh.init_state(0, _optimizer(**change))
  with pytest.raises(checkpoint.CheckpointMismatchError, match=match):
    checkpoint.restore(tmp_path, target)


def test_changed_tree_structure_or_shape_raises(tmp_path):
  _, state = _saved(tmp_path)
  extra = {**state, "params": {**state["params"], "new": jnp.zeros(3)}}
  with pytest.raises(checkpoint.CheckpointMismatchError,
                     match=r"in the target, not in the checkpoint: "
                     r"\['params'\]\['new'\]"):
    checkpoint.restore(tmp_path, extra)
  missing = {"params": state["params"]}
  with pytest.raises(checkpoint.CheckpointMismatchError,
                     match=r"in the checkpoint, not in the target: "
                     r"\['opt_state'\]"):
    checkpoint.restore(tmp_path, missing)
  wider = jax.tree_util.tree_map(lambda x: x, state)
  wider["params"]["dense0"]["b"] = jnp.zeros((33,))
  with pytest.raises(checkpoint.CheckpointMismatchError,
                     match=r"shape mismatch[\s\S]*\['dense0'\]\['b'\]: "
                     r"saved float32\[32\], target float32\[33\]"):
    checkpoint.restore(tmp_path, wider)


def test_other_loss_scale_type_raises(tmp_path):
  _saved(tmp_path)
  params = rh.init_mlp(0)
  opt = jmp_amp.loss_scaling(optax.adam(1e-2),
                             jmp_amp.StaticLossScale(2.0**15))
  target = {"params": params, "opt_state": opt.init(params)}
  with pytest.raises(checkpoint.CheckpointMismatchError,
                     match=r"saved DynamicLossScale\(.*\), target "
                     r"StaticLossScale\(loss_scale=32768.0\)"):
    checkpoint.restore(tmp_path, target)


def test_nnx_model_and_optimizer_resume_in_place(tmp_path):
  nnx = pytest.importorskip("flax.nnx")
  jflax = pytest.importorskip("jmp_amp.flax")

  def make(seed, period=3):
    init = {"kernel_init": rh.numpy_init}
    model = nnx.Sequential(nnx.Linear(4, 8, **init, rngs=nnx.Rngs(seed)),
                           nnx.relu,
                           nnx.Linear(8, 2, **init, rngs=nnx.Rngs(seed + 1)))
    jflax.set_policies(model, "p=f32,c=f16,o=f32")
    opt = nnx.Optimizer(model, _optimizer(period=period), wrt=nnx.Param)
    return model, opt

  step = jflax.make_train_step(
      lambda m, b: jnp.mean((m(b[0]).astype(jnp.float32) - b[1]) ** 2),
      donate=False)
  batch = (jnp.linspace(-1, 1, 20).reshape(5, 4), jnp.ones((5, 2)))
  model, opt = make(0)
  for _ in range(3):
    step(model, opt, batch)
  checkpoint.save(tmp_path, {"model": model, "optimizer": opt}, step=3)

  model2, opt2 = make(5)
  out = checkpoint.restore(tmp_path, {"model": model2, "optimizer": opt2})
  assert out["model"] is model2 and out["optimizer"] is opt2  # in place
  m1, m2 = step(model, opt, batch), step(model2, opt2, batch)
  assert tree_bytes_equal(m1, m2)
  assert tree_bytes_equal(nnx.state(model), nnx.state(model2))

  # nnx.state() drops the loss scale's hyper-parameters; the optimizer keeps
  # them, and the check sees them.
  model3, opt3 = make(5, period=4)
  with pytest.raises(checkpoint.CheckpointMismatchError,
                     match=r"\['optimizer'\]\.opt_state\.loss_scale "
                     r"\(period: saved 3, target 4\)"):
    checkpoint.restore(tmp_path, {"model": model3, "optimizer": opt3})
