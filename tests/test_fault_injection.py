"""Fault injection: inf/NaN gradients and activations never corrupt a run.

A 1000-step scanned run of a bfloat16-compute MLP with 65 injected faults
(gradients and forward activations, NaN/+inf/-inf at random elements) must
skip exactly the faulty steps, keep every param and optimizer-state leaf
finite at every step, follow the dynamic loss-scale rule, and end bit-for-bit
where a clean run that leaves those steps out ends.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import tree_bytes_equal
import jmp_amp
from jmp_amp import testing as jt
import reliability_helpers as rh

NUM_STEPS = 1000
PERIOD = 10


def _max_abs_diff(a, b) -> float:
  return max(float(jnp.max(jnp.abs(x - y)))
             for x, y in zip(jax.tree_util.tree_leaves(a),
                             jax.tree_util.tree_leaves(b)))


def _long_run():
  """The faulty run and its clean reference, through one compiled program."""
  grad_faults = jt.random_fault_steps(jax.random.key(1), NUM_STEPS, 55)
  others = np.setdiff1d(np.arange(NUM_STEPS), grad_faults)
  act_faults = np.sort(np.random.default_rng(0).choice(
      others, 10, replace=False)).astype(np.int32)
  faults = np.union1d(grad_faults, act_faults)
  clean = np.setdiff1d(np.arange(NUM_STEPS), faults).astype(np.int32)

  opt = rh.make_optimizer(init_scale=2.0**15, period=PERIOD)
  state = rh.init_state(0, opt)
  xs, ys = rh.make_batches(2, NUM_STEPS)
  run = rh.make_scan_run(rh.make_train_step(opt, rh.BF16,
                                            fault_key=jax.random.key(3)))
  all_steps = jnp.arange(NUM_STEPS, dtype=jnp.int32)
  faulty = run(state, xs, ys, all_steps, jnp.ones(NUM_STEPS, bool),
               jnp.asarray(grad_faults), jnp.asarray(act_faults))

  # The clean run sees only the clean batches, padded at the end with
  # inactive steps, and fault schedules that never match.
  pad = NUM_STEPS - clean.size
  order = np.concatenate([clean, np.zeros(pad, np.int32)])
  active = np.arange(NUM_STEPS) < clean.size
  never = lambda a: jnp.full(a.shape, -1, jnp.int32)
  reference = run(state, xs[order], ys[order], jnp.asarray(order),
                  jnp.asarray(active), never(grad_faults), never(act_faults))
  return faults, faulty, reference, run._cache_size()


# One test, not one per property: a module fixture would be recomputed on
# each pytest-xdist worker that runs a piece of it.
@pytest.mark.slow
def test_long_run_with_injected_faults():
  faults, (state, ok, metrics), clean_run, compiles = _long_run()
  assert faults.size >= 50

  # No param or optimizer-state leaf ever became inf/NaN (checked each step).
  assert bool(ok), "some param or optimizer-state leaf became inf/NaN"

  # Skipped steps are exactly the injected faults.
  finite = np.asarray(metrics["grads_finite"])
  np.testing.assert_array_equal(np.flatnonzero(~finite), faults)
  scaling = jmp_amp.get_scaling_state(state["opt_state"])
  assert int(scaling.skipped_steps) == faults.size
  assert int(scaling.steps) == NUM_STEPS

  # The scale follows the rule: backs off on every fault, grows back.
  scale = np.asarray(metrics["loss_scale"])
  np.testing.assert_array_equal(
      scale, rh.simulate_dynamic_scale(finite, 2.0**15, PERIOD))
  prev = np.concatenate([[2.0**15], scale[:-1]])
  assert np.all(scale[~finite] == prev[~finite] / 2)
  assert np.sum(scale > prev) >= 20
  low = int(np.argmin(scale))
  assert scale[low:].max() >= 8 * scale[low]

  # Bit-for-bit the clean run that leaves the faulty steps out.
  clean_state, clean_ok, _ = clean_run
  assert bool(clean_ok)
  assert compiles == 1  # both runs: one program
  diff = _max_abs_diff(state["params"], clean_state["params"])
  print(f"\nfaults={faults.size} skipped={int(scaling.skipped_steps)} "
        f"max|param diff| vs clean={diff} scale range 2**"
        f"{np.log2(scale.min()):.0f}..2**{np.log2(scale.max()):.0f}")
  assert tree_bytes_equal(state["params"], clean_state["params"]), diff
  assert tree_bytes_equal(state["opt_state"].inner_state,
                          clean_state["opt_state"].inner_state)

  # And it trained.
  loss = np.asarray(metrics["loss"])
  assert loss[finite][-20:].mean() < 0.5 * loss[0]


def test_natural_fp16_overflow_backs_off_recovers_and_trains():
  # Scaled fp16 cotangents overflow (float16 max is 65504) until the scale
  # has come down from 2**40; then it trains and probes upwards again.
  steps = 300
  opt = rh.make_optimizer(init_scale=2.0**40, period=20)
  state = rh.init_state(0, opt)
  xs, ys = rh.make_batches(2, steps)
  run = rh.make_scan_run(rh.make_train_step(opt, rh.F16))
  state, ok, metrics = run(state, xs, ys, jnp.arange(steps, dtype=jnp.int32),
                           jnp.ones(steps, bool))
  finite = np.asarray(metrics["grads_finite"])
  scale = np.asarray(metrics["loss_scale"])
  loss = np.asarray(metrics["loss"])
  first_ok = int(np.argmax(finite))
  print(f"\nfp16 from 2**40: {first_ok} overflow steps, scale then "
        f"2**{np.log2(scale[first_ok]):.0f}, skipped {int((~finite).sum())}"
        f"/{steps}, final scale 2**{np.log2(scale[-1]):.0f}")
  assert bool(ok)
  assert not finite[0] and first_ok >= 10           # it did overflow, a lot
  assert np.all(~finite[:first_ok])
  assert scale[first_ok] <= 2.0**30                 # backed off
  assert np.any(np.diff(scale[first_ok:]) > 0)      # and grew back
  assert finite[first_ok:].mean() > 0.9             # then mostly trained
  np.testing.assert_array_equal(
      scale, rh.simulate_dynamic_scale(finite, 2.0**40, 20))
  assert loss[finite][-20:].mean() < 0.5 * loss[first_ok]


# --- the injection helpers themselves.


def test_inject_nonfinite_only_on_fault_steps(small_params):
  inject = jax.jit(jt.inject_nonfinite, static_argnames="kind")
  faults = jnp.array([3, 7])
  same = inject(small_params, 4, faults, jax.random.key(0))
  assert tree_bytes_equal(same, small_params)
  for step in (3, 7):
    bad = inject(small_params, step, faults, jax.random.key(step))
    n_bad = sum(int(jnp.sum(~jnp.isfinite(x)))
                for x in jax.tree_util.tree_leaves(bad))
    n_changed = sum(int(jnp.sum(x != y)) for x, y in zip(
        jax.tree_util.tree_leaves(bad),
        jax.tree_util.tree_leaves(small_params)))
    assert n_bad == 1 and n_changed == 1


@pytest.mark.parametrize("kind,check", [("nan", np.isnan),
                                        ("inf", np.isposinf),
                                        ("-inf", np.isneginf)])
def test_inject_nonfinite_kinds_without_key(kind, check):
  tree = {"a": jnp.ones((2, 2), jnp.float16), "i": jnp.arange(3)}
  out = jt.inject_nonfinite(tree, jnp.int32(0), jnp.array(True), kind=kind)
  assert check(np.asarray(out["a"], np.float32)[0, 0])
  assert out["a"].dtype == jnp.float16
  assert np.sum(~np.isfinite(np.asarray(out["a"], np.float32))) == 1
  np.testing.assert_array_equal(out["i"], tree["i"])


def test_random_kind_draws_all_three_values():
  inject = jax.jit(lambda seed: jt.inject_nonfinite(
      jnp.zeros(4), 0, jnp.array([0]), jax.random.key(seed)))
  out = np.stack([np.asarray(inject(seed)) for seed in range(30)])
  bad = out[~np.isfinite(out)]
  assert bad.size == 30  # one per draw
  assert np.isnan(bad).any() and np.isposinf(bad).any() and np.isneginf(
      bad).any()


def test_random_fault_steps_distinct_sorted_in_range():
  steps = jt.random_fault_steps(jax.random.key(0), 100, 40, start=10)
  assert steps.dtype == np.int32 and steps.size == 40
  assert np.all(np.diff(steps) > 0)
  assert steps.min() >= 10 and steps.max() < 100
