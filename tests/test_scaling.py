"""Tests for the loss_scaling optax transformation."""

import functools

import chex
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from helpers import assert_trees_within_ulps
from helpers import tree_bytes_equal
import jmp_amp

OPTIMIZERS = {
    "adam": lambda: optax.adam(1e-2),
    "chain(clip, adamw)": lambda: optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=1e-2)),
    "inject_hyperparams(sgd+momentum)": lambda: optax.inject_hyperparams(
        optax.sgd)(learning_rate=0.1, momentum=0.9),
}


def _grads_like(params, value):
  return jax.tree_util.tree_map(lambda p: jnp.full_like(p, value), params)


def _warm_state(opt, params, steps=3):
  """A state that has taken some finite steps (non-trivial moments)."""
  state = opt.init(params)
  for i in range(steps):
    scale = jmp_amp.get_scaling_state(state).loss_scale.loss_scale
    grads = _grads_like(params, (i + 1) * 0.1 * scale)
    _, state = opt.update(grads, state, params)
  return state


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("bad", [jnp.inf, -jnp.inf, jnp.nan])
def test_skipped_step_is_exact_noop(name, bad, small_params):
  opt = jmp_amp.loss_scaling(OPTIMIZERS[name](),
                             jmp_amp.DynamicLossScale(2.0**8))
  state = _warm_state(opt, small_params)
  grads = _grads_like(small_params, 1.0)
  grads["dense"]["w"] = grads["dense"]["w"].at[1, 2].set(bad)

  updates, new_state = jax.jit(opt.update)(grads, state, small_params)
  new_params = optax.apply_updates(small_params, updates)

  assert tree_bytes_equal(new_params, small_params)
  assert tree_bytes_equal(new_state.inner_state, state.inner_state)
  assert not bool(new_state.grads_finite)
  assert int(new_state.skipped_steps) == int(state.skipped_steps) + 1
  assert float(new_state.loss_scale.loss_scale) == 2.0**7


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_finite_step_equals_inner_on_unscaled_grads(name, small_params):
  scale = 2.0**12
  opt = jmp_amp.loss_scaling(OPTIMIZERS[name](),
                             jmp_amp.DynamicLossScale(scale))
  inner = OPTIMIZERS[name]()
  grads = jax.tree_util.tree_map(lambda p: 3.0 * p + 0.5, small_params)
  scaled = jax.tree_util.tree_map(lambda g: g * scale, grads)
  updates, state = opt.update(scaled, opt.init(small_params), small_params)
  expected, expected_inner = inner.update(grads, inner.init(small_params),
                                          small_params)
  chex.assert_trees_all_close(updates, expected, rtol=1e-6)
  chex.assert_trees_all_close(state.inner_state, expected_inner, rtol=1e-6)
  assert bool(state.grads_finite) and int(state.skipped_steps) == 0


def test_clipping_sees_unscaled_gradients(small_params):
  # With scaled gradients the clip would see a norm 2**15 times too large.
  tx = jmp_amp.loss_scaling(
      optax.chain(optax.clip_by_global_norm(10.0), optax.sgd(1.0)),
      jmp_amp.StaticLossScale(2.0**15))
  grads = _grads_like(small_params, 0.01)  # norm well below 10
  scaled = jax.tree_util.tree_map(lambda g: g * 2.0**15, grads)
  updates, _ = tx.update(scaled, tx.init(small_params), small_params)
  chex.assert_trees_all_close(
      updates, jax.tree_util.tree_map(lambda g: -g, grads), rtol=1e-6)


@functools.cache
def _scaled_update(name):
  """`name`'s optimizer under loss scaling and alone, with their updates
  jitted: one compile each serves every example of the property below."""
  opt = jmp_amp.loss_scaling(OPTIMIZERS[name](),
                             jmp_amp.DynamicLossScale(2.0**4, period=2))
  inner = OPTIMIZERS[name]()
  return opt, jax.jit(opt.update), inner, jax.jit(inner.update)


@pytest.mark.slow
@settings(max_examples=25, deadline=None)
@given(st.lists(st.sampled_from(["finite", "inf", "nan"]), min_size=1,
                max_size=8),
       st.sampled_from(list(OPTIMIZERS)))
def test_trajectory_equals_inner_run_that_omits_bad_steps(kinds, name):
  params = {"w": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)}
  opt, update, inner, inner_update = _scaled_update(name)
  p, state = params, opt.init(params)
  q, inner_state = params, inner.init(params)
  for i, kind in enumerate(kinds):
    g = {"w": jnp.full((2, 3), 0.1 * (i + 1)) * q["w"]}
    scale = jmp_amp.get_scaling_state(state).loss_scale.loss_scale
    scaled = {"w": g["w"] * scale}
    if kind != "finite":
      bad = jnp.inf if kind == "inf" else jnp.nan
      scaled = {"w": scaled["w"].at[0, 0].set(bad)}
    else:
      u, inner_state = inner_update(g, inner_state, q)
      q = optax.apply_updates(q, u)
    u, state = update(scaled, state, p)
    p = optax.apply_updates(p, u)
  chex.assert_trees_all_close(p, q, rtol=1e-5, atol=1e-7)
  assert int(state.skipped_steps) == sum(k != "finite" for k in kinds)
  assert jmp_amp.all_finite(p)


def test_get_loss_scale_inside_multisteps_and_chain(small_params):
  scaled = jmp_amp.loss_scaling(optax.adam(1e-3),
                                jmp_amp.DynamicLossScale(2.0**9))
  for wrapped in (optax.MultiSteps(scaled, every_k_schedule=2),
                  optax.chain(optax.identity(), scaled),
                  optax.chain(optax.scale(1.0), optax.MultiSteps(scaled, 2))):
    state = wrapped.init(small_params)
    scale = jmp_amp.get_scaling_state(state).loss_scale.loss_scale
    assert float(scale) == 2.0**9
    state = jax.jit(lambda s: s)(state)
    scale = jmp_amp.get_scaling_state(state).loss_scale.loss_scale
    assert float(scale) == 2.0**9


def test_multisteps_accumulates_then_applies_and_skips(small_params):
  opt = optax.MultiSteps(
      jmp_amp.loss_scaling(optax.sgd(1.0), jmp_amp.DynamicLossScale(4.0)), 2)
  state = opt.init(small_params)
  grads = _grads_like(small_params, 4.0)  # scaled; unscaled = 1
  u1, state = opt.update(grads, state, small_params)
  u2, state = opt.update(grads, state, small_params)
  chex.assert_trees_all_close(u1, jax.tree_util.tree_map(jnp.zeros_like, u1))
  chex.assert_trees_all_close(u2, _grads_like(small_params, -1.0))
  bad = _grads_like(small_params, jnp.nan)
  _, state = opt.update(bad, state, small_params)
  u4, state = opt.update(grads, state, small_params)
  chex.assert_trees_all_close(u4, jax.tree_util.tree_map(jnp.zeros_like, u4))
  assert int(jmp_amp.get_scaling_state(state).skipped_steps) == 1
  assert float(jmp_amp.get_scaling_state(state).loss_scale.loss_scale) == 2.0


def test_noop_scale_still_skips_nonfinite(small_params):
  opt = jmp_amp.loss_scaling(optax.adam(1e-2), jmp_amp.NoOpLossScale())
  state = opt.init(small_params)
  updates, new_state = opt.update(_grads_like(small_params, jnp.nan), state,
                                  small_params)
  assert tree_bytes_equal(new_state.inner_state, state.inner_state)
  chex.assert_trees_all_equal(
      updates, jax.tree_util.tree_map(jnp.zeros_like, updates))
  no_skip = jmp_amp.loss_scaling(optax.sgd(1.0), jmp_amp.NoOpLossScale(),
                                 skip_nonfinite=False)
  updates, _ = no_skip.update(_grads_like(small_params, jnp.nan),
                              no_skip.init(small_params), small_params)
  assert not jmp_amp.all_finite(updates)



def test_init_again_after_a_step_that_donated_the_state(small_params):
  # The user's scale holds a device array; their step donates the state (as
  # make_train_step does). Initialising again, to resume or to start a
  # second run, starts from that scale, not from a deleted buffer.
  scale = jmp_amp.DynamicLossScale(jnp.asarray(2.0**15))
  tx = jmp_amp.loss_scaling(optax.sgd(0.1), scale)

  @functools.partial(jax.jit, donate_argnums=1)
  def step(params, state):
    grads = jax.tree.map(jnp.ones_like, params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  step(small_params, tx.init(small_params))
  assert float(tx.init(small_params).loss_scale.loss_scale) == 2.0**15
  assert float(scale.loss_scale) == 2.0**15

def test_half_gradients_are_unscaled_in_float32():
  # Unscaling a float16 gradient happens in float32 and rounds once, back to
  # the gradient's own dtype (2**-20 is a float16 subnormal).
  opt = jmp_amp.loss_scaling(optax.sgd(1.0), jmp_amp.StaticLossScale(2.0**15))
  params = {"w": jnp.ones(2, jnp.float16)}
  grads = {"w": jnp.full(2, 2.0**-5, jnp.float16)}
  updates, _ = opt.update(grads, opt.init(params), params)
  assert updates["w"].dtype == jnp.float16
  np.testing.assert_array_equal(np.asarray(updates["w"], np.float32),
                                np.float32(np.float16(-(2.0**-20))))


def test_scaling_state_counts_and_compiles_once(small_params):
  opt = jmp_amp.loss_scaling(optax.adam(1e-2),
                             jmp_amp.DynamicLossScale(2.0**4, period=2))
  state = opt.init(small_params)
  traces = []

  @jax.jit
  def step(params, state, value):
    traces.append(None)
    updates, state = opt.update(_grads_like(params, value), state, params)
    return (optax.apply_updates(params, updates), state,
            jmp_amp.get_scaling_state(state))

  params = small_params
  for value in [1.0, jnp.inf, 1.0, 1.0, 1.0, jnp.nan, 1.0]:
    params, state, scaling = step(params, state, value)
  assert len(traces) == 1
  assert int(scaling.skipped_steps) == 2 and int(scaling.steps) == 7
  assert bool(scaling.grads_finite)
  assert scaling.loss_scale.loss_scale.dtype == jnp.float32


def test_bad_arguments_raise_clear_errors(small_params):
  with pytest.raises(TypeError, match="optax.GradientTransformation"):
    jmp_amp.loss_scaling(lambda g: g, jmp_amp.NoOpLossScale())
  with pytest.raises(TypeError, match="loss_scale must be a jmp_amp"):
    jmp_amp.loss_scaling(optax.sgd(1.0), 2.0**15)
  opt = jmp_amp.loss_scaling(optax.sgd(1.0), jmp_amp.NoOpLossScale())
  with pytest.raises(TypeError, match="expected the LossScalingState"):
    opt.update(small_params, optax.sgd(1.0).init(small_params), small_params)
  with pytest.raises(ValueError, match="different tree structures"):
    opt.update({"w": jnp.ones(2)}, opt.init(small_params), small_params)
  with pytest.raises(ValueError, match="No loss_scaling state"):
    jmp_amp.get_scaling_state(optax.adam(1e-3).init(small_params))
  twice = optax.chain(opt, opt)
  with pytest.raises(ValueError, match="Found 2 loss_scaling states"):
    jmp_amp.get_scaling_state(twice.init(small_params))


@pytest.mark.parametrize("skip_with", ["cond", "select"])
def test_a_step_keeps_the_dtypes_of_the_inner_state(skip_with):
  # inject_hyperparams' float32 momentum would widen a float16 trace; the
  # state keeps its dtypes whether the step is taken or skipped.
  opt = jmp_amp.loss_scaling(
      optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.9),
      jmp_amp.DynamicLossScale(2.0), skip_with=skip_with)
  params = {"w": jnp.ones(2, jnp.float16)}
  state = opt.init(params)
  update = jax.jit(opt.update)
  _, taken = update({"w": jnp.full(2, 2.0, jnp.float16)}, state, params)
  _, kept = update({"w": jnp.array([1.0, jnp.nan], jnp.float16)}, state,
                   params)
  dtypes = lambda t: [jnp.result_type(x) for x in jax.tree.leaves(t)]
  assert dtypes(taken.inner_state) == dtypes(state.inner_state)
  assert tree_bytes_equal(kept.inner_state, state.inner_state)
  assert bool(taken.grads_finite) and not bool(kept.grads_finite)


# --- The skip mechanisms, against a straightforward reference.


def _reference_update(inner, loss_scale_state, grads, inner_state, params):
  """The plain recipe: unscale each leaf in float32, check, update, select."""
  def unscale(g):
    wide = jnp.promote_types(g.dtype, jnp.float32)
    return loss_scale_state.unscale(g.astype(wide)).astype(g.dtype)
  grads = jax.tree_util.tree_map(unscale, grads)
  finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g))
                              for g in jax.tree_util.tree_leaves(grads)]))
  updates, new_inner = inner.update(grads, inner_state, params)
  updates = jax.tree_util.tree_map(
      lambda u: jnp.where(finite, u, jnp.full_like(u, -0.0)), updates)
  new_inner = jax.tree.map(
      lambda n, o: jnp.where(finite, n, o).astype(o.dtype), new_inner,
      inner_state)
  return updates, new_inner, loss_scale_state.adjust(finite), finite


# Each optimizer with auto and each mechanism with adam in the default run;
# the other pairs with the slow tests.
@pytest.mark.parametrize("name, skip_with", [
    (name, how) if how == "auto" or name == "adam"
    else pytest.param(name, how, marks=pytest.mark.slow)
    for name in OPTIMIZERS for how in ("auto", "cond", "select")])
def test_agrees_with_reference_over_random_faulty_steps(name, skip_with):
  # Each step, the library and the reference start from the same state.
  # A taken step is two programs computing one formula: within 4 ulps (XLA
  # contracts and vectorizes each its own way, per CPU and per version). A
  # skipped step is the promise: params and inner state bit for bit. The
  # scale is a power of two halved or doubled: exact in any program.
  rng = np.random.default_rng(sum(map(ord, name + skip_with)))
  params = {"w": jnp.asarray(rng.normal(size=(5, 7)), jnp.float32),
            "b": jnp.asarray(rng.normal(size=(7,)), jnp.float16)}
  opt = jmp_amp.loss_scaling(OPTIMIZERS[name](),
                             jmp_amp.DynamicLossScale(2.0**6, period=3),
                             skip_with=skip_with)
  inner = OPTIMIZERS[name]()
  state = opt.init(params)
  update = jax.jit(opt.update)
  reference = jax.jit(lambda g, s, ls, p: _reference_update(inner, ls, g, s, p))
  p = params
  faults = 0
  for step in range(40):
    grads = jax.tree_util.tree_map(
        lambda x: jnp.asarray(rng.normal(size=x.shape) * 2.0**6, x.dtype), p)
    if rng.random() < 0.3:
      faults += 1
      bad = rng.choice([np.inf, -np.inf, np.nan])
      grads["w"] = grads["w"].at[tuple(rng.integers(0, 5, 2))].set(bad)
    ref_updates, ref_inner, ref_scale, finite = reference(
        grads, state.inner_state, state.loss_scale, p)
    updates, new_state = update(grads, state, p)
    assert bool(new_state.grads_finite) == bool(finite), step
    assert tree_bytes_equal(new_state.loss_scale, ref_scale), step
    new_p = optax.apply_updates(p, updates)
    if bool(finite):
      assert_trees_within_ulps(updates, ref_updates)
      assert_trees_within_ulps(new_state.inner_state, ref_inner)
    else:
      assert tree_bytes_equal(new_p, p), step
      assert tree_bytes_equal(new_state.inner_state, state.inner_state), step
    p, state = new_p, new_state
  assert faults >= 5 and int(state.skipped_steps) == faults


def _compiled_text(opt, params):
  grads = jax.tree_util.tree_map(jnp.ones_like, params)
  return jax.jit(opt.update).lower(grads, opt.init(params),
                                   params).compile().as_text()


def test_auto_skips_with_cond_on_cpu_and_select_keeps_no_conditional(
    small_params):
  if jax.default_backend() != "cpu":
    pytest.skip("the backend choice checked here is CPU's")
  make = lambda how: jmp_amp.loss_scaling(
      optax.adam(1e-3), jmp_amp.DynamicLossScale(2.0**4), skip_with=how)
  count = lambda how: _compiled_text(make(how), small_params).count(
      "conditional(")
  assert count("auto") == count("cond") == 1
  assert count("select") == 0
  # SGD has no state to keep: auto selects.
  sgd = jmp_amp.loss_scaling(optax.sgd(1e-3), jmp_amp.DynamicLossScale(2.0**4))
  assert _compiled_text(sgd, small_params).count("conditional(") == 0


@pytest.mark.parametrize("skip_with", ["cond", "select"])
def test_skip_leaves_negative_zero_params_bit_for_bit(skip_with):
  opt = jmp_amp.loss_scaling(optax.sgd(1.0), jmp_amp.DynamicLossScale(4.0),
                             skip_with=skip_with)
  params = {"w": jnp.array([-0.0, 0.0, 1.0, -2.0])}
  grads = {"w": jnp.array([1.0, jnp.nan, 1.0, 1.0])}
  updates, _ = jax.jit(opt.update)(grads, opt.init(params), params)
  assert tree_bytes_equal(optax.apply_updates(params, updates), params)


# --- Complex gradients, the loss in the check, flags.


@pytest.mark.parametrize("skip_with", ["cond", "select"])
def test_complex_gradients_are_unscaled(skip_with):
  scale = 2.0**15
  opt = jmp_amp.loss_scaling(optax.sgd(0.5), jmp_amp.StaticLossScale(scale),
                             skip_with=skip_with)
  params = {"z": jnp.array([1 + 2j, -3 + 0.5j], jnp.complex64),
            "r": jnp.ones(2)}
  grads = {"z": jnp.array([0.25 - 1j, 2 + 4j], jnp.complex64),
           "r": jnp.full(2, 0.5)}
  scaled = jax.tree_util.tree_map(lambda g: g * scale, grads)
  updates, state = opt.update(scaled, opt.init(params), params)
  assert updates["z"].dtype == jnp.complex64
  np.testing.assert_array_equal(np.asarray(updates["z"]),
                                np.asarray(-0.5 * grads["z"]))
  np.testing.assert_array_equal(np.asarray(updates["r"]), [-0.25, -0.25])
  assert bool(state.grads_finite)
  # An inf in either part of a complex gradient skips the step.
  for bad in (complex(np.inf, 0), complex(0, np.nan)):
    poisoned = dict(scaled, z=scaled["z"].at[1].set(bad))
    updates, state = opt.update(poisoned, opt.init(params), params)
    assert not bool(state.grads_finite)
    assert tree_bytes_equal(optax.apply_updates(params, updates), params)


@pytest.mark.parametrize("flag", ["skip_nonfinite", "check_loss"])
@pytest.mark.parametrize("value", ["no", 1, None, np.array([True])])
def test_flags_must_be_bools(flag, value):
  with pytest.raises(TypeError, match=f"{flag} must be True or False.*"
                                      f"{type(value).__name__}"):
    jmp_amp.loss_scaling(optax.sgd(1.0), jmp_amp.NoOpLossScale(),
                         **{flag: value})


@pytest.mark.parametrize("value", ["fast", "Cond", None, 1])
def test_skip_with_must_be_a_known_mechanism(value):
  with pytest.raises(ValueError, match="skip_with must be one of.*auto.*cond"
                                       ".*select"):
    jmp_amp.loss_scaling(optax.sgd(1.0), jmp_amp.NoOpLossScale(),
                         skip_with=value)


@pytest.mark.parametrize("skip_with", ["cond", "select"])
def test_nonfinite_loss_with_finite_grads(skip_with, small_params):
  grads = _grads_like(small_params, 4.0)
  loss = jnp.float32(jnp.inf)
  # Default, like torch's GradScaler: only the gradients decide.
  opt = jmp_amp.loss_scaling(optax.sgd(1.0), jmp_amp.DynamicLossScale(4.0),
                             skip_with=skip_with)
  updates, state = opt.update(grads, opt.init(small_params), small_params,
                              value=loss)
  assert bool(state.grads_finite)
  chex.assert_trees_all_close(updates, _grads_like(small_params, -1.0))
  # check_loss=True: the loss is part of the check.
  opt = jmp_amp.loss_scaling(optax.sgd(1.0), jmp_amp.DynamicLossScale(4.0),
                             check_loss=True, skip_with=skip_with)
  state = opt.init(small_params)
  updates, new_state = jax.jit(opt.update)(grads, state, small_params,
                                           value=loss)
  assert not bool(new_state.grads_finite)
  assert int(new_state.skipped_steps) == 1
  assert float(new_state.loss_scale.loss_scale) == 2.0
  assert tree_bytes_equal(optax.apply_updates(small_params, updates),
                          small_params)
  updates, new_state = opt.update(grads, state, small_params,
                                  value=jnp.float32(3.0))
  assert bool(new_state.grads_finite)
  chex.assert_trees_all_close(updates, _grads_like(small_params, -1.0))
  with pytest.raises(TypeError, match=r"check_loss=True\) needs the loss.*"
                                      r"value=loss"):
    opt.update(grads, state, small_params)


def _grads_finite(loss_scale, tree, cache=None) -> bool:
  """What loss_scaling decides for the gradients `tree` (public API only);
  `cache`, a dict, keeps the jitted update for the next tree of the same
  loss scale (a compile per tree structure, not per call)."""
  cache = {} if cache is None else cache
  if not cache:
    cache["opt"] = opt = jmp_amp.loss_scaling(optax.identity(), loss_scale)
    cache["update"] = jax.jit(opt.update)
  _, state = cache["update"](tree, cache["opt"].init(tree))
  return bool(state.grads_finite)


def _reference_finite(loss_scale, tree) -> bool:
  """all_finite of what the optimizer receives: each leaf unscaled in f32."""
  def unscale(g):
    wide = jnp.promote_types(g.dtype, jnp.float32)
    return loss_scale.unscale(g.astype(wide)).astype(g.dtype)
  return bool(jmp_amp.all_finite(jax.tree.map(unscale, tree)))


_slow = functools.partial(pytest.param, marks=pytest.mark.slow)


# Each four compiles (a dtype layout of the leaves per clean, non-finite and
# large-finite trial; 10-20 s on 2 busy cores): with the slow tests.
@pytest.mark.parametrize("loss_scale", [
    _slow(jmp_amp.NoOpLossScale()), _slow(jmp_amp.StaticLossScale(2.0**15)),
    _slow(jmp_amp.StaticLossScale(2.0**-12)),
    _slow(jmp_amp.DynamicLossScale(2.0**-20, min_loss_scale=2.0**-30)),
    _slow(jmp_amp.DynamicLossScale(3.0))], ids=str)
def test_finite_check_agrees_with_all_finite_of_the_unscaled_grads(
    loss_scale):
  # Over leaves of many kinds (large ones checked alone, small ones in
  # groups), against all_finite of the unscaled gradients. Scales below 1
  # make the unscale overflow for large finite values; those must count.
  rng = np.random.default_rng(0)
  shapes = [(), (3,), (2**15,), (0, 4), (5, 7), (3, 4, 6), (4, 2**14),
            (3, 2**14 + 1)] + [(17,)] * 11
  dtypes = [jnp.float32, jnp.float16, jnp.bfloat16, jnp.complex64]
  scale = float(jnp.asarray(getattr(loss_scale, "loss_scale", 1.0)))
  magnitude = 1e3 * min(1.0, scale)  # clean trials stay finite unscaled.
  overflows = 0
  layouts = [rng.permutation(dtypes * 5)[:len(shapes)] for _ in range(4)]
  cache = {}
  for trial in range(12):
    tree = {f"{i}": jnp.asarray(rng.normal(size=s) * magnitude, d)
            for i, (s, d) in enumerate(zip(shapes, layouts[trial // 3]))}
    key = str(rng.choice([k for k in tree if tree[k].size]))
    flat = np.array(tree[key]).reshape(-1)
    if trial % 3 == 1:
      bad = rng.choice([np.inf, -np.inf, np.nan])
      if np.iscomplexobj(flat) and trial % 2:
        bad = complex(1.0, bad)
      flat[rng.integers(flat.size)] = bad
    elif trial % 3 == 2:  # finite, but near the top of the leaf's range.
      big = float(jnp.finfo(flat.dtype).max) * rng.choice([0.5, 1e-3, 1e-6])
      flat[rng.integers(flat.size)] = -big if trial % 2 else big
    tree[key] = jnp.asarray(flat.reshape(tree[key].shape), tree[key].dtype)
    expected = _reference_finite(loss_scale, tree)
    assert _grads_finite(loss_scale, tree, cache) == expected, trial
    if trial % 3 == 1:
      assert not expected, trial
    if trial % 3 == 0:
      assert expected, trial
    overflows += trial % 3 == 2 and not expected
  # Only the scales below 1 overflow the large finite values.
  assert (overflows > 0) == (scale < 1), overflows


@pytest.mark.parametrize("bad_scale", [np.nan, np.inf, 0.0, -1.0])
def test_finite_check_with_a_broken_scale(bad_scale):
  # A scale restored from a damaged checkpoint (or built under jit): the
  # unscaled gradients are NaN/inf/sign-flipped; the check must agree with
  # all_finite of what the optimizer would receive.
  ls = jax.tree.map(
      lambda x: jnp.asarray(bad_scale, x.dtype) if x.dtype == jnp.float32
      else x, jmp_amp.DynamicLossScale(2.0**15))
  tree = {"w": jnp.full((4, 2**13), 0.5, jnp.float16), "b": jnp.ones(3)}
  assert _grads_finite(ls, tree) == _reference_finite(ls, tree)


@pytest.mark.parametrize("skip_with", ["auto", "cond", "select"])
def test_skip_when_updates_change_shape_or_dtype(skip_with):
  # The CPU cond passes a skipped step's gradients through as its updates
  # where they match; an update of another dtype or shape gets -0.0 instead.
  widen = optax.stateless(lambda g, p: {
      "h": g["h"].astype(jnp.float32), "w": g["w"],
      "v": jnp.concatenate([g["v"], g["v"]])})
  opt = jmp_amp.loss_scaling(widen, jmp_amp.DynamicLossScale(4.0),
                             skip_with=skip_with)
  params = {"h": jnp.ones(3, jnp.float16), "w": jnp.ones(2),
            "v": jnp.ones(2)}
  state = opt.init(params)
  update = jax.jit(opt.update)
  good = {"h": jnp.full(3, 8.0, jnp.float16), "w": jnp.full(2, 4.0),
          "v": jnp.array([4.0, 8.0])}
  updates, state = update(good, state, params)
  assert updates["h"].dtype == jnp.float32
  np.testing.assert_array_equal(updates["h"], np.full(3, 2.0))
  np.testing.assert_array_equal(updates["w"], np.full(2, 1.0))
  np.testing.assert_array_equal(updates["v"], [1.0, 2.0, 1.0, 2.0])
  bad = dict(good, w=jnp.array([jnp.nan, 1.0]))
  updates, state = update(bad, state, params)
  assert not bool(state.grads_finite)
  for leaf in jax.tree_util.tree_leaves(updates):
    assert np.all(np.asarray(leaf) == 0) and np.all(np.signbit(leaf))


@pytest.mark.parametrize("has_aux", [False, True])
def test_scaled_value_and_grad_gives_the_loss_and_scaled_grads(has_aux):
  scale = 2.0**10
  opt = jmp_amp.loss_scaling(optax.sgd(1.0), jmp_amp.DynamicLossScale(scale))
  params = {"w": jnp.array([1.0, -2.0])}
  state = opt.init(params)
  def loss_fn(p, x):
    loss = jnp.sum(p["w"] * x)
    return (loss, {"x": x}) if has_aux else loss
  x = jnp.array([3.0, 0.5])
  value, grads = jax.jit(jmp_amp.scaled_value_and_grad(
      loss_fn, has_aux=has_aux))(state, params, x)
  want_value, want_grads = jax.value_and_grad(loss_fn, has_aux=has_aux)(
      params, x)
  chex.assert_trees_all_equal(value, want_value)
  chex.assert_trees_all_equal(grads, jax.tree.map(lambda g: g * scale,
                                                  want_grads))
  # And the update they make is the unscaled one: -lr * dL/dw.
  updates, _ = opt.update(grads, state, params)
  chex.assert_trees_all_equal(updates, jax.tree.map(jnp.negative, want_grads))



def test_scaled_value_and_grad_built_once_reads_the_current_scale():
  # (#35) Built outside the step and reused: the scale is read at each call,
  # so after a backoff (2**10 -> 2**9) the update is still -lr * dL/dw.
  opt = jmp_amp.loss_scaling(optax.sgd(1.0), jmp_amp.DynamicLossScale(2.0**10))
  params = {"w": jnp.array([1.0, 2.0])}
  state = opt.init(params)
  grad_fn = jmp_amp.scaled_value_and_grad(lambda p, x: jnp.sum(p["w"] * x))

  @jax.jit
  def step(params, state, x):
    _, grads = grad_fn(state, params, x)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, updates

  params, state, _ = step(params, state, jnp.array([jnp.inf, 1.0]))  # skip
  assert float(state.loss_scale.loss_scale) == 2.0**9
  params, state, updates = step(params, state, jnp.array([1.0, 1.0]))
  assert bool(state.grads_finite)
  assert updates["w"].tolist() == [-1.0, -1.0]
  assert params["w"].tolist() == [0.0, 1.0]


def test_scaled_value_and_grad_refuses_a_state_where_it_is_built():
  opt = jmp_amp.loss_scaling(optax.sgd(1.0), jmp_amp.DynamicLossScale(8.0))
  state = opt.init({"w": jnp.ones(2)})
  with pytest.raises(TypeError, match=r"scaled_value_and_grad\(fun\)\("
                     r"opt_state, \*fun_args\) instead"):
    jmp_amp.scaled_value_and_grad(lambda p: jnp.sum(p["w"]), state)


def test_scaled_value_and_grad_without_the_state_names_it():
  grad_fn = jmp_amp.scaled_value_and_grad(lambda p: jnp.sum(p["w"]))
  with pytest.raises(ValueError, match="pass the optimizer state first"):
    grad_fn({"w": jnp.ones(2)})


def test_scaled_value_and_grad_has_aux_mismatch_names_has_aux():
  # (#35) A plain scalar with has_aux=True gave JAX's "Too many indices".
  opt = jmp_amp.loss_scaling(optax.sgd(1.0), jmp_amp.DynamicLossScale(8.0))
  params = {"w": jnp.ones(2)}
  state = opt.init(params)
  scalar = lambda p: jnp.sum(p["w"])
  with pytest.raises(TypeError, match=r"with has_aux=True the function must "
                     r"return \(loss, aux\), got a .*pass has_aux=False"):
    jmp_amp.scaled_value_and_grad(scalar, has_aux=True)(state, params)
  pair = lambda p: (jnp.sum(p["w"]), p)
  with pytest.raises(TypeError, match=r"not a scalar loss; pass has_aux=True"):
    jmp_amp.scaled_value_and_grad(pair)(state, params)
