"""Checkpoint/resume with jmp_amp.checkpoint (orbax, no pickle).

A run interrupted at step k and resumed from its checkpoint ends bit-for-bit
where the uninterrupted run ends, with float16 compute, dynamic loss scaling
and skipped steps on both sides of k; restoring into a target that differs
(dtypes, tree structure, shapes, loss-scale hyper-parameters) raises an error
that names the difference; damaged files give a named error or the saved
values, never changed ones; a save never replaces a step unasked, and a killed
one leaves the last committed step.

Most tests read one checkpoint saved once per module (`saved`), or a copy of
it; the exhaustive damage runs and the killed subprocess are marked slow.
"""

import collections
import dataclasses
import gc
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from helpers import tree_bytes_equal
import jmp_amp
import reliability_helpers as rh

ocp = pytest.importorskip("orbax.checkpoint")
from jmp_amp import checkpoint  # pylint: disable=g-import-not-at-top

# Orbax reads arrays in threads; after the first read fails, the others'
# errors are reported as unraisable. The restore itself raised a named error.
pytestmark = pytest.mark.filterwarnings(
    "ignore::pytest.PytestUnraisableExceptionWarning")

NUM_STEPS, RESUME_AT = 16, 8
# Faults before and after the interruption; 7 and 8 straddle it, so that the
# checkpoint holds a half-way hysteresis count (overflows == 1).
FAULTS = np.array([2, 5, 7, 8, 12], np.int32)
STEP = 4  # the step of the `saved` checkpoint
NAMED_ERRORS = checkpoint.CheckpointError


def _optimizer(**kwargs):
  kwargs = {"init_scale": 2.0**15, "period": 3, "hysteresis": 2, **kwargs}
  return rh.make_optimizer(**kwargs)


def _plus(state, k):
  """`state` with every floating leaf shifted by `k` (a distinguishable run)."""
  return jax.tree_util.tree_map(
      lambda x: x + k if jnp.issubdtype(x.dtype, jnp.floating) else x, state)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """A checkpoint (step 4) of a trained-looking state, the state, its files.

  Read-only: tests that damage or add steps work on `saved_copy`.
  """
  state = _plus(rh.init_state(3, _optimizer()), 0.5)
  directory = tmp_path_factory.mktemp("saved")
  checkpoint.save(directory, state, step=STEP)
  files = sorted(os.path.relpath(os.path.join(root, f), directory)
                 for root, _, fs in os.walk(directory) for f in fs)
  return directory, state, files


@pytest.fixture
def saved_copy(saved, tmp_path):
  """A copy of `saved` to damage. At teardown, the garbage collector closes
  the reads a failed restore left behind: their errors are reported in this
  test, which ignores them (pytestmark), not in whichever test runs next."""
  directory, state, files = saved
  copy = tmp_path / "ckpt"
  shutil.copytree(directory, copy)
  yield copy, state, files
  gc.collect()


# --------------------------------------------------------------------------
# Resume and round trip.


def _run(step, state, xs, ys, steps):
  metrics = []
  for i in steps:
    state, m = step(state, (xs[i], ys[i]), jnp.int32(i), jnp.asarray(FAULTS))
    metrics.append(m)
  return state, metrics


def test_resume_is_bit_identical(tmp_path):
  opt = _optimizer()
  # Optimisation level 0 compiles faster; both runs share the program.
  step = jax.jit(rh.make_train_step(opt, rh.F16, fault_key=jax.random.key(7)),
                 compiler_options=rh.FAST_COMPILE)
  xs, ys = rh.make_batches(2, NUM_STEPS)
  # Committed, like restored arrays (and any sharded state): jit keys its
  # cache on committedness, and the resumed steps should reuse the program.
  start = jax.device_put(rh.init_state(0, opt), jax.devices()[0])
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
  with checkpoint.CheckpointManager(tmp_path) as mngr:
    meta = mngr.metadata()
  (spec,) = meta["loss_scales"].values()
  assert spec == {"type": "DynamicLossScale", "period": 5, "factor": 3,
                  "min_loss_scale": 2.0, "backoff_factor": 0.25,
                  "max_loss_scale": 2.0**20, "hysteresis": 2}
  restored = checkpoint.restore(tmp_path, jax.eval_shape(lambda: state))
  assert tree_bytes_equal(restored, state)
  assert restored["opt_state"].loss_scale == state["opt_state"].loss_scale


@pytest.mark.parametrize("cast_dtypes", [False, True])
def test_python_and_numpy_numbers_restore_as_the_target_holds_them(
    tmp_path, cast_dtypes):
  state = {**rh.init_state(0, _optimizer()), "step": 1234, "lr": 3e-4,
           "warmup": True, "epoch": np.int32(7)}
  checkpoint.save(tmp_path, state, step=1)
  target = {**rh.init_state(5, _optimizer()), "step": 0, "lr": 0.0,
            "warmup": False, "epoch": np.int32(0)}
  restored = checkpoint.restore(tmp_path, target, cast_dtypes=cast_dtypes)
  assert type(restored["step"]) is int and restored["step"] == 1234
  assert type(restored["lr"]) is float and restored["lr"] == 3e-4
  assert restored["warmup"] is True
  assert restored["epoch"].dtype == np.int32 and int(restored["epoch"]) == 7
  assert tree_bytes_equal(
      {k: restored[k] for k in ("params", "opt_state")},
      {k: state[k] for k in ("params", "opt_state")})
  # An abstract target (jax.eval_shape) reads them as arrays.
  abstract = checkpoint.restore(tmp_path, jax.eval_shape(lambda: target))
  assert int(abstract["step"]) == 1234 and bool(abstract["warmup"])


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


# --------------------------------------------------------------------------
# Targets that do not match: named, before any array is read.


def _with_params(state, params):
  return {**state, "params": params}


def _wider_bias(state):
  params = jax.tree_util.tree_map(lambda x: x, state["params"])
  params["dense0"]["b"] = jnp.zeros((33,))
  return _with_params(state, params)


def _static_scale(state):
  opt = jmp_amp.loss_scaling(optax.adam(1e-2),
                             jmp_amp.StaticLossScale(2.0**15))
  return {**state, "opt_state": opt.init(state["params"])}


def _other_hyperparameters(**change):
  def target(state):
    return {**state, "opt_state": _optimizer(**change).init(state["params"])}
  return target


MISMATCHES = {
    "bfloat16 params": (
        lambda s: _with_params(s, jmp_amp.get_policy("bf16").cast_to_param(
            s["params"])),
        r"dtype mismatch[\s\S]*\['params'\]\['dense0'\]\['w'\]: saved "
        r"float32, target bfloat16"),
    "period": (_other_hyperparameters(period=4), r"period: saved 3, target 4"),
    "factor": (_other_hyperparameters(factor=4), r"factor: saved 2, target 4"),
    "hysteresis": (_other_hyperparameters(hysteresis=1),
                   r"hysteresis: saved 2, target 1"),
    "max_loss_scale": (_other_hyperparameters(max_loss_scale=2.0**24),
                       r"max_loss_scale: saved None, target"),
    "extra leaf": (
        lambda s: _with_params(s, {**s["params"], "new": jnp.zeros(3)}),
        r"in the target, not in the checkpoint: \['params'\]\['new'\]"),
    "missing subtree": (lambda s: {"params": s["params"]},
                        r"in the checkpoint, not in the target: "
                        r"\['opt_state'\]"),
    "wider bias": (_wider_bias, r"shape mismatch[\s\S]*\['dense0'\]\['b'\]: "
                   r"saved float32\[32\], target float32\[33\]"),
    "static loss scale": (_static_scale,
                          r"saved DynamicLossScale\(.*\), target "
                          r"StaticLossScale\(loss_scale=32768.0\)"),
}


@pytest.mark.parametrize("case", MISMATCHES)
def test_a_target_that_differs_is_named(saved, case):
  directory, state, _ = saved
  make_target, match = MISMATCHES[case]
  with pytest.raises(checkpoint.CheckpointError, match=match) as info:
    checkpoint.restore(directory, make_target(state))
  assert (info.value.reason, info.value.step) == ("mismatch", STEP)


def test_cast_dtypes_casts_on_purpose(saved):
  directory, state, _ = saved
  target = _with_params(state, jmp_amp.get_policy("bf16").cast_to_param(
      state["params"]))
  restored = checkpoint.restore(directory, target, cast_dtypes=True)
  assert restored["params"]["dense0"]["w"].dtype == jnp.bfloat16
  np.testing.assert_array_equal(
      restored["params"]["dense0"]["w"],
      state["params"]["dense0"]["w"].astype(jnp.bfloat16))


@pytest.mark.slow
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

  # A NaN scale is refused before the target objects are touched.
  bad = jax.tree_util.tree_map(lambda x: x, opt.opt_state)
  leaves, treedef = jax.tree_util.tree_flatten(bad.loss_scale)
  opt.opt_state = bad._replace(loss_scale=jax.tree_util.tree_unflatten(
      treedef, [jnp.float32(np.nan)] + leaves[1:]))
  checkpoint.save(tmp_path, {"model": model, "optimizer": opt}, step=4)
  before = nnx.state(opt2)
  with pytest.raises(checkpoint.CheckpointError,
                     match=r"step 4 .*\['optimizer'\]\.opt_state\.loss_scale: "
                     r"loss_scale is nan"):
    checkpoint.restore(tmp_path, {"model": model2, "optimizer": opt2})
  assert tree_bytes_equal(nnx.state(opt2), before)

  # nnx.state() drops the loss scale's hyper-parameters; the optimizer keeps
  # them, and the check sees them.
  model3, opt3 = make(5, period=4)
  with pytest.raises(checkpoint.CheckpointError,
                     match=r"\['optimizer'\]\.opt_state\.loss_scale "
                     r"\(period: saved 3, target 4\)"):
    checkpoint.restore(tmp_path, {"model": model3, "optimizer": opt3})


# --------------------------------------------------------------------------
# Saving over existing steps.


def test_save_over_an_existing_or_older_step_raises_unless_overwrite(
    saved_copy):
  directory, state, _ = saved_copy
  rerun = _plus(state, 1.0)
  with pytest.raises(checkpoint.CheckpointError,
                     match=r"cannot save checkpoint step 4 in .*: step 4 "
                     r"already exists\. Pass overwrite=True to delete steps "
                     r"\[4\]") as info:
    checkpoint.save(directory, rerun, step=STEP)
  assert isinstance(info.value, ValueError)
  assert (info.value.reason, info.value.step) == ("exists", STEP)
  with pytest.raises(checkpoint.CheckpointError,
                     match=r"step 3 is below the latest step 4"):
    checkpoint.save(directory, rerun, step=3)
  # A state that cannot be saved deletes nothing, even with overwrite.
  with pytest.raises(TypeError, match=r"state leaf \['name'\] is a str"):
    checkpoint.save(directory, {**rerun, "name": "run"}, step=STEP,
                    overwrite=True)
  # Nothing was written: the first run's state is still there.
  assert checkpoint.latest_step(directory) == STEP
  assert tree_bytes_equal(checkpoint.restore(directory, state), state)

  checkpoint.save(directory, rerun, step=STEP, overwrite=True)
  assert tree_bytes_equal(checkpoint.restore(directory, state), rerun)
  # Going back deletes the later steps: the directory ends at the new step.
  checkpoint.save(directory, state, step=7)
  older = _plus(state, 2.0)
  checkpoint.save(directory, older, step=3, overwrite=True)
  with checkpoint.CheckpointManager(directory) as mngr:
    assert mngr.all_steps() == [3]
  restored, step = checkpoint.restore_latest(directory, state)
  assert step == 3 and tree_bytes_equal(restored, older)


def test_manager_save_refuses_existing_step(tmp_path):
  state = rh.init_state(0, _optimizer())
  with checkpoint.CheckpointManager(tmp_path, max_to_keep=2) as mngr:
    assert mngr.save(1, state)
    mngr.save(2, state)
    with pytest.raises(checkpoint.CheckpointError,
                       match=r"step 2 already exists"):
      mngr.save(2, _plus(state, 1.0))
    assert mngr.save(2, _plus(state, 1.0), overwrite=True)
    assert tree_bytes_equal(mngr.restore(state), _plus(state, 1.0))
    assert mngr.restored_step == 2


# --------------------------------------------------------------------------
# Damaged checkpoints: a named error or a bit-identical restore, never
# changed values.


def _is_data_file(rel):
  return f"{os.sep}d{os.sep}" in rel


def _outcome(directory, state):
  """'identical' or the error's reason; fails on anything else."""
  try:
    out = checkpoint.restore(directory, state)
  except NAMED_ERRORS as e:
    assert len(str(e)) < 1000, f"error message too long: {len(str(e))} chars"
    assert e.reason in ("corrupted", "mismatch"), e.reason
    return e.reason + (":array" if str(e.where).startswith("[") else "")
  assert tree_bytes_equal(out, state), "restored CHANGED values silently"
  return "identical"


def _flip4(path, offset, mask):
  """XORs 4 bytes at `offset` with `mask` (twice: the file as it was)."""
  with open(path, "r+b") as f:
    f.seek(offset)
    data = f.read(4)
    f.seek(offset)
    f.write(bytes(b ^ m for b, m in zip(data, mask)))


@pytest.mark.parametrize("trials,min_flips", [
    (1, 0), pytest.param(8, 100, marks=pytest.mark.slow)])
def test_four_byte_flips_never_restore_changed_values(saved_copy, trials,
                                                      min_flips):
  # One flip per file (its middle bytes) in the quick run; in the slow one,
  # the middle, first and last bytes of every file, then seeded offsets, at
  # least 100 flips in all (orbax writes a varying number of data files).
  directory, state, files = saved_copy
  trials = max(trials, -(-min_flips // len(files)))
  outcomes = collections.Counter()
  for rel in files:
    path = directory / rel
    size = os.path.getsize(path)
    # Seeded by the file's role and size, not its random orbax file name.
    role = re.sub(r"[0-9a-f]{32}", "*", rel)
    rng = np.random.default_rng(zlib.crc32(f"{role}:{size}".encode()))
    offsets = [size // 2, 0, max(size - 4, 0)][:trials]
    offsets += [int(o) for o in rng.integers(0, max(size - 4, 1),
                                             trials - len(offsets))]
    for offset in offsets:
      mask = rng.integers(1, 256, 4, dtype=np.uint8)  # no zero: a real flip
      _flip4(path, offset, mask)
      kind = "data" if _is_data_file(rel) else "metadata"
      outcomes[(kind, _outcome(directory, state))] += 1
      _flip4(path, offset, mask)
  print(dict(outcomes))
  assert sum(outcomes.values()) == trials * len(files) >= min_flips
  # Some flips hit bytes that are read; whether orbax or the checksum
  # (":array") catches them depends on where they land.
  assert sum(v for (kind, o), v in outcomes.items()
             if kind == "data" and o != "identical") > 0
  assert outcomes[("metadata", "corrupted")] > 0
  assert _outcome(directory, state) == "identical"  # every flip undone


@pytest.mark.parametrize("keep", [0, pytest.param(0.5, marks=pytest.mark.slow)])
def test_truncated_files_never_restore_changed_values(saved_copy, keep):
  directory, state, files = saved_copy
  errors = 0
  for rel in files:
    original = (directory / rel).read_bytes()
    (directory / rel).write_bytes(original[:int(len(original) * keep)])
    errors += _outcome(directory, state) != "identical"
    (directory / rel).write_bytes(original)
  print(f"truncated to {keep:.0%}: {errors} of {len(files)} named errors")
  assert errors >= 3  # the data files and the JSON metadata at least


def test_truncated_metadata_names_the_file_and_keeps_the_cause(saved_copy):
  directory, state, _ = saved_copy
  meta = directory / str(STEP) / "state" / "_METADATA"
  meta.write_bytes(meta.read_bytes()[:100])
  with pytest.raises(checkpoint.CheckpointError,
                     match=r"checkpoint step 4 in .* is damaged or incomplete, "
                     r"file state/_METADATA: JSONDecodeError") as info:
    checkpoint.restore(directory, state)
  assert isinstance(info.value.__cause__, json.JSONDecodeError)
  assert info.value.step == STEP and info.value.where == "state/_METADATA"


def test_deleted_data_file_is_a_named_error(saved_copy):
  directory, state, files = saved_copy
  for rel in files:
    if _is_data_file(rel):
      os.remove(directory / rel)
  with pytest.raises(checkpoint.CheckpointError,
                     match=r"checkpoint step 4 in .* is damaged or incomplete, "
                     r"file state/") as info:
    checkpoint.restore(directory, state)
  assert len(str(info.value)) < 600  # not tensorstore's 2 kB
  assert info.value.__cause__ is not None


def test_deleted_metadata_item_is_a_named_error(saved_copy):
  directory, state, _ = saved_copy
  shutil.rmtree(directory / str(STEP) / "jmp_amp")
  with pytest.raises(checkpoint.CheckpointError,
                     match=r"step 4 .* has no jmp_amp metadata: it is damaged, "
                     r"or was not written by jmp_amp.checkpoint.*verify=False"):
    checkpoint.restore(directory, state)
  # The arrays are intact; asked for, they restore without the checks.
  assert tree_bytes_equal(checkpoint.restore(directory, state, verify=False),
                          state)


def _changed_values(directory, step, state, tmp_path):
  """Makes step `step`'s arrays read as other values without any read error
  (orbax's files are whole, only not the ones saved with that step's
  description), as a flip in an uncompressed chunk would; returns the
  changed array's path, which the checksum error names."""
  other = jax.tree_util.tree_map(lambda x: x, state)
  other["params"]["dense1"]["w"] = other["params"]["dense1"]["w"] * 2 + 1
  elsewhere = tmp_path / f"other{step}"
  checkpoint.save(elsewhere, other, step=step)
  shutil.rmtree(directory / str(step) / "state")
  shutil.copytree(elsewhere / str(step) / "state",
                  directory / str(step) / "state")
  return "['params']['dense1']['w']"


def test_latest_step_damaged_falls_back_to_newest_intact(tmp_path):
  opt = _optimizer()
  states = {s: _plus(rh.init_state(0, opt), float(s)) for s in (1, 2, 3)}
  directory = tmp_path / "run"
  for s, st in states.items():
    checkpoint.save(directory, st, step=s)
  where = _changed_values(directory, 3, states[3], tmp_path)
  with pytest.raises(checkpoint.CheckpointError,
                     match=rf"checkpoint step 3 in .*: array "
                     rf"{re.escape(where)} does not match its checksum") as e:
    checkpoint.restore(directory, states[1])
  assert e.value.step == 3 and e.value.where == where
  with pytest.warns(UserWarning,
                    match=r"restored checkpoint step 2 .*, not step 3: "
                    r"skipped damaged steps \[3\]"):
    restored, step = checkpoint.restore_latest(directory, states[1])
  assert step == 2 and tree_bytes_equal(restored, states[2])

  # A deleted step directory is simply not there: the latest is the one before.
  shutil.rmtree(directory / "3")
  restored, step = checkpoint.restore_latest(directory, states[1])
  assert step == 2 and tree_bytes_equal(restored, states[2])
  with pytest.raises(FileNotFoundError, match=r"no checkpoint for step 3"):
    checkpoint.restore(directory, states[1], step=3)

  # Nothing intact at all: one named error.
  _changed_values(directory, 2, states[2], tmp_path)
  _changed_values(directory, 1, states[1], tmp_path)
  with pytest.raises(
      checkpoint.CheckpointError,
      match=r"no intact checkpoint in .*: steps \[2, 1\] are all damaged"):
    checkpoint.restore_latest(directory, states[1])


def test_cast_dtypes_still_verifies_the_checksums(saved_copy, tmp_path):
  directory, state, _ = saved_copy
  _changed_values(directory, STEP, state, tmp_path)
  target = _with_params(state, jmp_amp.get_policy("bf16").cast_to_param(
      state["params"]))
  with pytest.raises(checkpoint.CheckpointError,
                     match=r"dense1'\]\['w'\] does not match its checksum"):
    checkpoint.restore(directory, target, cast_dtypes=True)


@pytest.mark.slow
def test_a_flip_orbax_reads_as_a_changed_value_is_caught_by_the_checksum(
    saved_copy):
  # Real damage, not a swapped file: flip bytes of the data files until orbax
  # reads a changed value without an error of its own.
  directory, state, files = saved_copy
  for rel in files:
    if not _is_data_file(rel):
      continue
    path = directory / rel
    for offset in range(os.path.getsize(path) - 4, 0, -97):
      _flip4(path, offset, b"\xff\xff\xff\xff")
      outcome = _outcome(directory, state)
      _flip4(path, offset, b"\xff\xff\xff\xff")
      if outcome == "corrupted:array":
        return
  raise AssertionError("no flip changed an array's values")


# --------------------------------------------------------------------------
# Restored loss scales.


def _with_scale(state, value):
  def put(ls):
    leaves, treedef = jax.tree_util.tree_flatten(ls)
    leaves[0] = jnp.asarray(value, jnp.float32)
    return jax.tree_util.tree_unflatten(treedef, leaves)
  opt_state = state["opt_state"]
  return {**state, "opt_state": opt_state._replace(
      loss_scale=put(opt_state.loss_scale))}


@pytest.mark.parametrize("value", [np.nan, np.inf, 0.0, -2.0])
def test_check_loss_scales_refuses_an_unusable_scale(value):
  state = rh.init_state(0, _optimizer())
  compat = pytest.importorskip("jmp_amp.checkpoint._compat")
  compat.check_loss_scales(state)  # no error
  with pytest.raises(checkpoint.CheckpointError,
                     match=r"loss scale \['opt_state'\]\.loss_scale: "
                     r"loss_scale is .*; it must be a finite number > 0"):
    compat.check_loss_scales(_with_scale(state, value))


def test_restored_invalid_loss_scale_is_refused(saved_copy):
  directory, state, _ = saved_copy
  checkpoint.save(directory, _with_scale(state, np.inf), step=STEP + 1)
  with pytest.raises(checkpoint.CheckpointError,
                     match=r"checkpoint step 5 in .*: loss scale "
                     r"\['opt_state'\]\.loss_scale: loss_scale is inf; it must "
                     r"be a finite number > 0") as info:
    checkpoint.restore(directory, state)
  assert info.value.step == STEP + 1
  with pytest.warns(UserWarning, match=r"skipped damaged steps \[5\]"):
    restored, step = checkpoint.restore_latest(directory, state)
  assert step == STEP and tree_bytes_equal(restored, state)


# --------------------------------------------------------------------------
# FP8 state: recipes are checked like loss-scale hyper-parameters, amax
# histories like loss scales.


def _fp8_model(recipe, seed=0):
  nnx = pytest.importorskip("flax.nnx")
  jflax = pytest.importorskip("jmp_amp.flax")
  init = {"kernel_init": rh.numpy_init}
  model = nnx.Sequential(
      *[nnx.Linear(4, 4, **init, rngs=nnx.Rngs(seed + i)) for i in range(3)])
  return jflax.set_policies(
      model, jflax.fp8.FP8Policy(recipe, keep_first_last=False))


def _fp8_ops(model):
  nnx = pytest.importorskip("flax.nnx")
  meta = pytest.importorskip("jmp_amp.flax").fp8.FP8Meta
  return [op for _, op in nnx.iter_graph(model)
          if isinstance(getattr(op, "lhs_amax_history", None), meta)]


DELAYED = jmp_amp.fp8.FP8Recipe(scaling="delayed", history_len=4, margin=0)


@pytest.fixture(scope="module")
def saved_fp8(tmp_path_factory):
  """Step 1: an FP8 model with finite histories."""
  model = _fp8_model(DELAYED)
  for i, op in enumerate(_fp8_ops(model)):
    op.lhs_amax_history[...] = jnp.array([1.5, 2.0, 0.0, 0.0]) * (i + 1)
  directory = tmp_path_factory.mktemp("fp8")
  checkpoint.save(directory, {"model": model}, step=1)
  return directory, model


@pytest.mark.parametrize("change,match", [
    ({"margin": 4}, r"margin: saved 0, target 4"),
    ({"scaling": "current"}, r"scaling: saved 'delayed', target 'current'"),
    ({"fwd_dtype": jnp.float8_e5m2},
     r"fwd_dtype: saved 'float8_e4m3fn', target 'float8_e5m2'"),
], ids=["margin", "scaling", "fwd_dtype"])
def test_a_changed_fp8_recipe_is_named(saved_fp8, change, match):
  nnx = pytest.importorskip("flax.nnx")
  directory, model = saved_fp8
  recipe = dataclasses.replace(DELAYED, **change)
  target = _fp8_model(recipe)
  before = nnx.state(target)
  with pytest.raises(checkpoint.CheckpointError,
                     match=r"FP8 recipes differ at "
                     + ", ".join(rf"\['model'\]\['layers'\]\[{i}\]"
                                 r"\['dot_general'\]" for i in range(3))
                     + r" \(" + match
                     + r"\); saved FP8Recipe\(scaling='delayed', "
                     r"history_len=4, margin=0"):
    checkpoint.restore(directory, {"model": target})
  assert tree_bytes_equal(nnx.state(target), before)  # untouched
  # The same recipe restores, histories included.
  same = checkpoint.restore(directory, {"model": _fp8_model(DELAYED, seed=9)})
  assert tree_bytes_equal(nnx.state(same["model"]), nnx.state(model))


@pytest.mark.parametrize("value", [np.inf, np.nan, -1.0])
def test_a_non_finite_fp8_amax_history_is_refused(saved_fp8, tmp_path, value):
  nnx = pytest.importorskip("flax.nnx")
  directory, model = saved_fp8
  shutil.copytree(directory, tmp_path / "run")
  bad = _fp8_model(DELAYED)
  nnx.update(bad, nnx.state(model))
  _fp8_ops(bad)[1].grad_amax_history[...] = jnp.array([0.5, value, 0.0, 0.0])
  checkpoint.save(tmp_path / "run", {"model": bad}, step=2)
  target = _fp8_model(DELAYED, seed=9)
  before = nnx.state(target)
  with pytest.raises(checkpoint.CheckpointError,
                     match=r"checkpoint step 2 in .*: FP8 amax history "
                     r"\['model'\]\['layers'\]\[1\]\['dot_general'\]"
                     r"\['grad_amax_history'\] "
                     r"holds .* \(index 1\); amaxes must be finite and >= 0"
                     ) as info:
    checkpoint.restore(tmp_path / "run", {"model": target})
  assert (info.value.reason, info.value.step) == ("corrupted", 2)
  assert info.value.where == (
      "['model']['layers'][1]['dot_general']['grad_amax_history']")
  assert tree_bytes_equal(nnx.state(target), before)  # untouched
  with pytest.warns(UserWarning,
                    match=r"skipped damaged steps \[2\]"):
    restored, step = checkpoint.restore_latest(tmp_path / "run",
                                               {"model": target})
  assert step == 1
  assert tree_bytes_equal(nnx.state(restored["model"]), nnx.state(model))


def test_fp8_state_in_a_plain_tree_is_checked(tmp_path):
  good = jmp_amp.fp8.FP8State(jnp.zeros(4), jnp.array([1.0, 2.0, 0.0, 0.0]),
                              jnp.zeros(4))
  state = {"w": jnp.ones(3), "fp8": good}
  checkpoint.save(tmp_path, state, step=1)
  assert tree_bytes_equal(checkpoint.restore(tmp_path, state), state)
  checkpoint.save(tmp_path, {**state, "fp8": good._replace(
      rhs=jnp.array([1.0, np.nan, 0.0, 0.0]))}, step=2)
  with pytest.raises(checkpoint.CheckpointError,
                     match=r"step 2 .*FP8 amax history \['fp8'\]\.rhs holds "
                     r"nan \(index 1\)") as info:
    checkpoint.restore(tmp_path, state)
  assert info.value.where == "['fp8'].rhs"


# --------------------------------------------------------------------------
# Checkpoints written without jmp_amp: plain orbax, and jmp's loss scale.


def test_plain_orbax_checkpoint_restores_with_verify_false(tmp_path):
  state = rh.init_state(0, _optimizer())
  with ocp.CheckpointManager(tmp_path) as mngr:
    mngr.save(7, args=ocp.args.Composite(state=ocp.args.StandardSave(state)))
    mngr.wait_until_finished()
  with pytest.raises(checkpoint.CheckpointError,
                     match=r"has no jmp_amp metadata"):
    checkpoint.restore(tmp_path, state)
  restored = checkpoint.restore(tmp_path, state, verify=False)
  assert tree_bytes_equal(restored, state)
  with pytest.raises(checkpoint.CheckpointError,
                     match=r"in the target, not in the checkpoint: "
                     r"params/extra"):
    checkpoint.restore(tmp_path, {**state, "params": {
        **state["params"], "extra": jnp.zeros(2)}}, verify=False)


def test_jmp_dynamic_loss_scale_checkpoint_restores_into_jmp_amp(tmp_path):
  jmp = pytest.importorskip("jmp", minversion="0.0.4")
  params = rh.init_mlp(0)
  jmp_scale = jmp.DynamicLossScale(jnp.float32(2.0**12), jnp.int32(7),
                                   period=10)
  # Orbax cannot save jmp's loss scale itself (its unflatten validates the
  # placeholders orbax passes), so a jmp run saved its leaves: orbax keys a
  # keyless node's leaves by index, exactly as it keys this tuple.
  jmp_state = {"params": params,
               "loss_scale": tuple(jax.tree_util.tree_leaves(jmp_scale))}
  assert [np.asarray(x).dtype for x in jmp_state["loss_scale"]] == [
      np.float32, np.int32]
  with ocp.CheckpointManager(tmp_path) as mngr:
    mngr.save(3, args=ocp.args.Composite(
        state=ocp.args.StandardSave(jmp_state)))
    mngr.wait_until_finished()
  target = {"params": params, "loss_scale": jmp_amp.DynamicLossScale(
      2.0**15, period=10)}
  restored = checkpoint.restore(tmp_path, target, verify=False)
  assert float(restored["loss_scale"].loss_scale) == 2.0**12
  assert int(restored["loss_scale"].counter) == 7
  assert restored["loss_scale"].period == 10
  assert restored["loss_scale"].overflows is None  # hysteresis 1: jmp's leaves
  assert tree_bytes_equal(restored["params"], params)
  # The restored scale trains on: a finite step counts, an overflow backs off.
  ls = restored["loss_scale"].adjust(jnp.array(False))
  assert float(ls.loss_scale) == 2.0**11 and int(ls.counter) == 0


def test_checkpoints_of_older_formats_still_restore(
    saved_copy):
  directory, state, _ = saved_copy
  path = directory / str(STEP) / "jmp_amp" / "metadata"
  meta = json.loads(path.read_text())
  assert meta["format"] == "jmp_amp.checkpoint/4"
  assert len(meta["checksums"]["arrays"]) == len(meta["leaves"])
  assert meta["fp8_recipes"] == {}
  assert "ScaleByAdamState" in meta["state_types"].values()
  # /3 had no state types, /2 no FP8 recipes, /1 no checksums either: all
  # still restore.
  old = {k: v for k, v in meta.items() if k != "state_types"}
  path.write_text(json.dumps({**old, "format": "jmp_amp.checkpoint/3"}))
  assert tree_bytes_equal(checkpoint.restore(directory, state), state)
  old = {k: v for k, v in old.items() if k != "fp8_recipes"}
  path.write_text(json.dumps({**old, "format": "jmp_amp.checkpoint/2"}))
  assert tree_bytes_equal(checkpoint.restore(directory, state), state)
  del old["checksums"]
  path.write_text(json.dumps({**old, "format": "jmp_amp.checkpoint/1"}))
  assert tree_bytes_equal(checkpoint.restore(directory, state), state)
  # A /4 checkpoint without its checksums, recipes or types is damaged, not
  # old.
  for table, name in [("checksums", "'checksums' table"),
                      ("fp8_recipes", "'leaves' / 'loss_scales' / "
                       "'fp8_recipes' tables"),
                      ("state_types", "'state_types' table")]:
    path.write_text(json.dumps({k: v for k, v in meta.items() if k != table}))
    with pytest.raises(checkpoint.CheckpointError,
                       match=r"damaged metadata \(file jmp_amp/metadata\): "
                       rf"no {name}"):
      checkpoint.restore(directory, state)


# --------------------------------------------------------------------------
# Killed saves.


def test_an_uncommitted_save_is_not_a_step(saved_copy):
  # What a save killed mid-write leaves: orbax's temporary directory, never
  # renamed to the step's name. The last committed step stays the latest.
  directory, state, _ = saved_copy
  shutil.copytree(directory / str(STEP),
                  directory / f"{STEP + 1}.orbax-checkpoint-tmp")
  assert checkpoint.latest_step(directory) == STEP
  restored, step = checkpoint.restore_latest(directory, state)
  assert step == STEP and tree_bytes_equal(restored, state)
  checkpoint.save(directory, _plus(state, 1.0), step=STEP + 1)
  assert tree_bytes_equal(checkpoint.restore(directory, state),
                          _plus(state, 1.0))


def _leave_uncommitted(directory, step, leftover):
  """A directory named like step `step` that orbax never committed."""
  path = directory / str(step)
  if leftover == "empty directory":
    path.mkdir()
    return
  shutil.copytree(directory / str(STEP), path)
  marker = path / "_CHECKPOINT_METADATA"  # orbax's step metadata
  if leftover == "no step metadata":
    marker.unlink()
  else:  # written when orbax starts a save, without the time it committed
    meta = json.loads(marker.read_text())
    del meta["commit_timestamp_nsecs"]
    marker.write_text(json.dumps(meta))


@pytest.mark.parametrize("leftover", [
    "empty directory", "no step metadata", "no commit time"])
def test_latest_step_reports_only_committed_steps(saved_copy, leftover):
  directory, state, _ = saved_copy
  late = STEP + 5
  _leave_uncommitted(directory, late, leftover)
  assert checkpoint.latest_step(directory) == STEP
  with checkpoint.CheckpointManager(directory) as mngr:
    assert mngr.all_steps() == [STEP]
    assert mngr.latest_step() == STEP
  restored, step = checkpoint.restore_latest(directory, state)
  assert step == STEP and tree_bytes_equal(restored, state)
  with pytest.raises(FileNotFoundError,
                     match=rf"no checkpoint for step {late} .*steps saved: "
                     rf"\[{STEP}\]"):
    checkpoint.restore(directory, state, step=late)
  # Saving that step replaces what was left there.
  checkpoint.save(directory, _plus(state, 1.0), step=late)
  assert checkpoint.latest_step(directory) == late
  assert tree_bytes_equal(checkpoint.restore(directory, state),
                          _plus(state, 1.0))


_SAVER = r"""
import os, signal, sys, time
import jax.numpy as jnp
import numpy as np
from jmp_amp import checkpoint

directory, size = sys.argv[1], int(sys.argv[2])
checkpoint.save(directory, {"w": jnp.arange(16, dtype=jnp.float32)}, step=1)
big = np.random.default_rng(0).normal(size=size).astype(np.float32)
mngr = checkpoint.CheckpointManager(directory, async_save=True)
# Returns once the arrays are on the host; orbax writes them in the background.
mngr.save(2, {"w": jnp.asarray(big[:16]), "big": jnp.asarray(big)})
# Kill once step 2's write has begun (its directory exists, under a temporary
# name until orbax commits it), so that the kill lands mid-write, not before.
for _ in range(2000):
  if set(os.listdir(directory)) - {"1"}:
    break
  time.sleep(0.005)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.slow
def test_killed_mid_save_leaves_the_last_good_checkpoint(tmp_path):
  # SIGKILL while step 2 is being written: orbax writes into a temporary
  # directory and renames it when complete, so step 1 stays the latest and
  # restores bit-identically (or, if the write won the race, step 2 is whole).
  size = 2**22
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  proc = subprocess.run(
      [sys.executable, "-c", _SAVER, str(tmp_path), str(size)],
      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=root,
      env={**os.environ, "PYTHONPATH": os.pathsep.join([root] + sys.path)},
      timeout=300, check=False)
  assert proc.returncode == -signal.SIGKILL
  target = {"w": jnp.zeros(16, jnp.float32)}
  restored, step = checkpoint.restore_latest(tmp_path, target)
  leftovers = [n for n in os.listdir(tmp_path) if "tmp" in n]
  print(f"restored step {step}; left behind: {leftovers}")
  if step == 1:
    assert leftovers  # the kill came mid-write
    np.testing.assert_array_equal(restored["w"],
                                  np.arange(16, dtype=np.float32))
  else:  # the save finished before the kill: step 2 must be whole
    assert step == 2
    restored = checkpoint.restore(tmp_path, {
        "w": target["w"], "big": jax.ShapeDtypeStruct((size,), jnp.float32)})
    big = np.random.default_rng(0).normal(size=size).astype(np.float32)
    np.testing.assert_array_equal(restored["big"], big)


def test_manager_lists_a_step_only_once_its_async_save_is_committed(tmp_path):
  # orbax's manager lists a step as soon as its asynchronous save starts; ours
  # reads the directory, so every step it lists is committed there.
  big = np.random.default_rng(0).normal(size=2**22).astype(np.float32)
  with checkpoint.CheckpointManager(tmp_path, async_save=True) as mngr:
    mngr.save(1, {"w": jnp.ones(4)})
    mngr.wait_until_finished()
    mngr.save(2, {"w": jnp.asarray(big)})
    listed, latest = mngr.all_steps(), mngr.latest_step()
    committed = {int(n) for n in os.listdir(tmp_path) if n.isdigit()}
    assert set(listed) <= committed | {2} and listed[0] == 1, listed
    assert 2 not in listed or 2 in committed, (listed, os.listdir(tmp_path))
    assert latest == listed[-1]
    mngr.wait_until_finished()
    assert mngr.all_steps() == [1, 2] and mngr.latest_step() == 2


def test_a_missing_data_index_is_named_before_any_read(tmp_path, capfd):
  # (#35) Without its index every array's read failed at once, and each
  # late completion printed "RuntimeError: Event loop is closed" (14 of
  # them); the fallback restore itself was right.
  opt = _optimizer()
  states = {s: _plus(rh.init_state(0, opt), float(s)) for s in (1, 2)}
  directory = tmp_path / "run"
  for s, st in states.items():
    checkpoint.save(directory, st, step=s)
  os.remove(directory / "2" / "state" / "manifest.ocdbt")
  with pytest.warns(UserWarning,
                    match=r"skipped damaged steps \[2\]; the first: "
                    r"checkpoint step 2 in .*: file state/manifest\.ocdbt "
                    r"\(the index of the array data\) is missing") as caught:
    restored, step = checkpoint.restore_latest(directory, states[1])
  assert step == 1 and tree_bytes_equal(restored, states[1])
  assert len(caught) == 1
  assert "Event loop is closed" not in capfd.readouterr().err
  with pytest.raises(checkpoint.CheckpointError,
                     match="state/manifest.ocdbt") as e:
    checkpoint.restore(directory, states[1], step=2)
  assert e.value.where == "state/manifest.ocdbt"
