"""jmp_amp.optim: stochastic rounding, 16-bit optimizer state and params."""

import functools
import json
import os
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_amp
from jmp_amp import optim

BF16_ULP_AT_1 = 2.0 ** -7


def bits(x):
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    return np.asarray(x)
  return np.asarray(jax.lax.bitcast_convert_type(
      x, jnp.uint16 if x.dtype == jnp.bfloat16 else jnp.uint32))


def assert_bitwise_equal(a, b):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(la) == len(lb)
  for x, y in zip(la, lb):
    assert jnp.asarray(x).dtype == jnp.asarray(y).dtype
    np.testing.assert_array_equal(bits(x), bits(y))


# ---------------------------------------------------------------------------
# stochastic_round


def test_representable_values_and_specials_are_exact():
  x = jax.random.normal(jax.random.key(1), (4096,)) * 100
  x = x.astype(jnp.bfloat16)
  x = jnp.concatenate([x, jnp.array([0.0, -0.0, jnp.inf, -jnp.inf, 3e38,
                                     2.0 ** -133], jnp.bfloat16)])
  y = optim.stochastic_round(x.astype(jnp.float32), jax.random.key(2))
  assert y.dtype == jnp.bfloat16
  np.testing.assert_array_equal(bits(y), bits(x))
  assert bool(jnp.isnan(optim.stochastic_round(jnp.float32(jnp.nan),
                                               jax.random.key(0))))


def test_rounds_to_one_of_the_two_neighbours():
  x = jax.random.normal(jax.random.key(3), (100_000,)) * 10.0 ** jax.random.randint(
      jax.random.key(4), (100_000,), -30, 30)
  y = optim.stochastic_round(x, jax.random.key(5))
  down = (bits(x) >> 16).astype(np.uint16)  # truncation toward zero
  yb = bits(y)
  assert np.all((yb == down) | (yb == down + 1))
  # Both neighbours occur (the rounding is not truncation nor nearest).
  inexact = bits(x) & 0xFFFF != 0
  assert 0.3 < np.mean(yb[inexact] == down[inexact]) < 0.7


def test_float32_subnormals_and_low_payload_nans_are_kept():
  # The rounding is integer arithmetic on the bits (#33): subnormals round to
  # a neighbour, not to zero (float ops may flush them on CPU), and a NaN
  # whose payload is only in the low 16 bits stays NaN, not inf.
  sub = np.array([1, 0x7FFF, 0x12345, 0x7FFFFF], np.uint32)
  x = np.concatenate([sub, sub | 0x80000000]).view(np.float32)
  y = bits(optim.stochastic_round(jnp.asarray(x), jax.random.key(3)))
  down = (x.view(np.uint32) >> 16).astype(np.uint16)
  assert np.all((y == down) | (y == down + 1))
  # NaNs whose payload fills the high bits too: a GPU's canonical NaN is
  # 0x7FFFFFFF, x86's 0xFFC00000. Adding the random bits to these carries
  # out of the magnitude (into the sign, or wrapping to +0) unless NaN is
  # kept apart, as the rounding does.
  nans = np.array([0x7F800001, 0xFF80FFFF, 0x7FFFFFFF, 0xFFFFFFFF,
                   0x7FFF0001, 0x7FC00000, 0xFFC00000],
                  np.uint32).view(np.float32)
  for seed in range(4):
    assert np.isnan(np.asarray(optim.stochastic_round(
        jnp.asarray(nans), jax.random.key(seed)), np.float32)).all()


@pytest.mark.parametrize("frac", [1 / 1024, 0.1, 0.5, 0.77])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_unbiased(frac, sign):
  n = 200_000
  x = jnp.float32(sign * (1.0 + frac * BF16_ULP_AT_1))
  y = optim.stochastic_round(jnp.full(n, x), jax.random.key(7))
  mean = float(jnp.mean(y.astype(jnp.float32)))
  # The mean of n rounded values has standard deviation
  # ulp * sqrt(p (1 - p) / n); allow 5 of them (a false failure ~ 1e-6).
  tol = 5 * BF16_ULP_AT_1 * np.sqrt(frac * (1 - frac) / n)
  assert abs(mean - float(x)) <= tol, (mean, float(x), tol)
  # Round-to-nearest is biased by frac * ulp (or 1 - frac): far outside.
  nearest = float(x.astype(jnp.bfloat16).astype(jnp.float32))
  assert abs(nearest - float(x)) > 2 * tol


def test_same_key_same_bits_other_key_other_bits():
  x = jax.random.uniform(jax.random.key(0), (1000,))
  a = optim.stochastic_round(x, jax.random.key(1))
  np.testing.assert_array_equal(
      bits(a), bits(optim.stochastic_round(x, jax.random.key(1))))
  np.testing.assert_array_equal(  # raw uint32[2] keys work too
      bits(a), bits(optim.stochastic_round(
          x, jax.random.key_data(jax.random.key(1)))))
  assert np.any(bits(a) != bits(optim.stochastic_round(x, jax.random.key(2))))


def test_non_float_input_raises():
  with pytest.raises(TypeError, match="real floating array.*int32"):
    optim.stochastic_round(jnp.arange(3), jax.random.key(0))


# ---------------------------------------------------------------------------
# compress_state


def quadratic_grads(params, target):
  return jax.tree.map(lambda p, t: p.astype(jnp.float32) - t, params, target)


def run(opt, params, target, steps):
  """`steps` of gradient descent on 0.5 |p - target|^2; (params, state)."""
  state = opt.init(params)

  def step(carry, _):
    params, state = carry
    updates, state = opt.update(quadratic_grads(params, target), state,
                                params)
    return (optax.apply_updates(params, updates), state), None

  (params, state), _ = jax.lax.scan(step, (params, state), None, steps)
  return params, state


def problem(n=256, dtype=jnp.float32):
  k1, k2 = jax.random.split(jax.random.key(0))
  params = {"w": jax.random.normal(k1, (n // 16, 16)).astype(dtype),
            "b": jnp.zeros(16, dtype)}
  target = {"w": jax.random.normal(k2, (n // 16, 16)), "b": jnp.ones(16)}
  return params, target


OPTIMIZERS = {
    "adam": lambda: optax.adam(0.05),
    "adamw": lambda: optax.adamw(0.05, weight_decay=0.01),
    "lion": lambda: optax.lion(0.03),
    "sgd_momentum": lambda: optax.sgd(0.05, momentum=0.9),
    "chain": lambda: optax.chain(optax.clip_by_global_norm(1.0),
                                 optax.adam(0.05)),
    "multisteps": lambda: optax.MultiSteps(
        optax.adam(0.05), every_k_schedule=2).gradient_transformation(),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adam)(
        learning_rate=0.05),
}


@pytest.mark.parametrize("name,rounding", [
    (name, "stochastic") for name in sorted(OPTIMIZERS) if name != "adamw"] + [
        pytest.param("adamw", "stochastic", marks=pytest.mark.slow)] + [
        pytest.param(name, "nearest", marks=pytest.mark.slow)
        for name in sorted(OPTIMIZERS)])
def test_compress_state_tracks_the_float32_optimizer(name, rounding):
  params, target = problem()
  ref, ref_state = jax.jit(functools.partial(
      run, OPTIMIZERS[name](), steps=30))(params, target)
  got, state = jax.jit(functools.partial(
      run, optim.compress_state(OPTIMIZERS[name](), rounding=rounding),
      steps=30))(params, target)
  # Same tree, floating arrays in bfloat16, everything else as the reference.
  for new, old in zip(jax.tree.leaves(state.inner_state),
                      jax.tree.leaves(ref_state)):
    assert new.shape == old.shape
    expected = (jnp.bfloat16 if jnp.issubdtype(old.dtype, jnp.floating)
                and old.ndim else old.dtype)
    assert new.dtype == expected, (new.dtype, old.dtype)
  # The bfloat16 state moves the params by its relative error (~2**-8) of
  # each step's update, not more.
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
    assert a.dtype == jnp.float32
    # (Lion's steps are +-lr: near the optimum a sign may flip, 2 lr apart.)
    np.testing.assert_allclose(a, b, atol=0.065 if name == "lion" else 0.03,
                               rtol=0)
  # And both converge (the check above is not two copies of a failure).
  assert float(jnp.max(jnp.abs(got["b"] - 1.0))) < 0.3


def test_one_step_state_is_the_float32_state_rounded_to_nearest():
  params, target = problem()
  grads = quadratic_grads(params, target)
  opt = optax.adam(0.1)
  _, ref = opt.update(grads, opt.init(params), params)
  copt = optim.compress_state(optax.adam(0.1), rounding="nearest")
  _, got = copt.update(grads, copt.init(params), params)
  assert_bitwise_equal(got.inner_state, jax.tree.map(
      lambda x: x.astype(jnp.bfloat16) if x.ndim else x, ref))


def test_hyperparameters_stay_float32_and_unrounded():
  opt = optim.compress_state(
      optax.inject_hyperparams(optax.adam)(learning_rate=1e-3 + 1e-7))
  params, target = problem()
  state = opt.init(params)
  for _ in range(2):
    updates, state = opt.update(quadratic_grads(params, target), state,
                                params)
  lr = state.inner_state.hyperparams["learning_rate"]
  assert lr.dtype == jnp.float32 and float(lr) == np.float32(1e-3 + 1e-7)
  assert state.inner_state.inner_state[0].count.dtype == jnp.int32
  assert int(state.inner_state.inner_state[0].count) == 2
  assert updates["w"].dtype == jnp.float32


def _params_copy():
  """A transformation whose state starts as a float32 copy of the params."""
  return optax.GradientTransformation(lambda params: params,
                                      lambda updates, state, params=None:
                                      (updates, state))


def test_init_rounds_once_per_leaf_shape_and_as_under_jit(caplog):
  """Outside a jit, init rounds each leaf with one compiled program per leaf
  shape: op by op, each of a rounding's ~20 operations was compiled per shape
  (seconds for a GPT's Adam state; issue #33). The bits are those of the same
  init traced under jit; every value is one of its two bfloat16 neighbours."""
  rng = np.random.default_rng(0)
  shapes = [(3, 5), (7,), (2, 3, 4)]
  params = {f"p{i}_{j}": jnp.asarray(rng.standard_normal(shape), jnp.float32)
            for i, shape in enumerate(shapes) for j in range(4)}
  opt = optim.compress_state(_params_copy(), seed=3)
  with jax.log_compiles(True), caplog.at_level("WARNING"):
    state = opt.init(params)
  compiles = [r for r in caplog.records
              if r.getMessage().startswith("Compiling")]
  assert len(compiles) <= len(shapes) + 4, [r.getMessage()[:60]
                                           for r in compiles]
  assert_bitwise_equal(state, jax.jit(opt.init)(params))
  for name, x in params.items():
    got = np.asarray(state.inner_state[name].astype(jnp.float32))
    bits = np.asarray(x).view(np.uint32) & np.uint32(0xFFFF0000)
    toward_zero, away = bits.view(np.float32), (bits + 0x10000).view(
        np.float32)
    assert np.all((got == toward_zero) | (got == away)), name


def _calls(jaxpr, name):
  """The jitted calls of function `name` at the top of `jaxpr`."""
  return [e for e in jaxpr.eqns if e.params.get("name") == name]


@pytest.mark.parametrize("chain", ["state", "params"])
def test_leaves_of_one_shape_share_one_rounding_trace(chain):
  """A step rounds each leaf through one jitted call per leaf shape, traced
  once: a model's repeated blocks reuse the trace (tracing every leaf's
  rounding again took a 16-block GPT's step half a second; issue #33)."""
  shapes = [(4, 3), (4, 3), (4, 3), (5,), (5,)]
  params = {f"p{i}": jnp.ones(shape, jnp.float32 if chain == "state"
                              else jnp.bfloat16)
            for i, shape in enumerate(shapes)}
  opt = (optim.compress_state(optax.adam(1e-3)) if chain == "state" else
         optim.low_precision_params())
  state = opt.init(params)
  jaxpr = jax.make_jaxpr(lambda g, s: opt.update(g, s, params))(
      jax.tree.map(lambda p: p.astype(jnp.float32), params), state).jaxpr
  calls = _calls(jaxpr, "_round_like")
  per_leaf = 2 if chain == "state" else 1  # Adam's mu and nu; the param
  assert len(calls) == per_leaf * len(shapes)
  assert len({id(e.params["jaxpr"]) for e in calls}) == len(set(shapes))


def ema_of_constant(rounding, steps=3000, beta=0.999):
  """nu of `steps` Adam updates with a constant gradient g: -> g**2."""
  opt = optim.compress_state(optax.scale_by_adam(b2=beta), rounding=rounding)
  g = {"x": jnp.full(4096, 0.5)}
  state = opt.init(g)

  def step(state, _):
    return opt.update(g, state)[1], None
  state, _ = jax.lax.scan(step, state, None, steps)
  return state.inner_state.nu["x"].astype(jnp.float32)


def test_stochastic_rounding_keeps_small_increments_that_nearest_loses():
  expected = 0.25 * (1 - 0.999 ** 3000)  # float32 reference, analytically
  sr = jax.jit(ema_of_constant, static_argnums=0)("stochastic")
  nearest = jax.jit(ema_of_constant, static_argnums=0)("nearest")
  assert abs(float(jnp.mean(sr)) - expected) / expected < 0.01
  assert abs(float(nearest[0]) - expected) / expected > 0.05


def test_key_advances_once_per_update_and_is_reproducible():
  params, target = problem()
  opt = optim.compress_state(optax.adam(0.1), seed=3)
  s0 = opt.init(params)
  _, s1 = opt.update(quadratic_grads(params, target), s0, params)
  _, s1_again = opt.update(quadratic_grads(params, target), s0, params)
  assert_bitwise_equal(s1, s1_again)
  assert s1.key.dtype == jnp.uint32 and np.any(bits(s1.key) != bits(s0.key))
  other = optim.compress_state(optax.adam(0.1), seed=4)
  _, t1 = other.update(quadratic_grads(params, target), other.init(params),
                       params)
  assert np.any(bits(t1.inner_state[0].nu["w"]) != bits(s1.inner_state[0].nu["w"]))



@pytest.mark.parametrize("rounding", ["stochastic", "kahan"])
def test_init_again_after_a_step_that_donated_the_state(rounding):
  # A user's step donates the optimizer state (as make_train_step does);
  # initialising the same transformation again, to resume or to start a
  # second run, gives the first init's state, not a deleted buffer.
  params, target = problem()
  params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
  make = lambda: optax.chain(optim.compress_state(optax.adam(0.1), seed=3),
                            optim.low_precision_params(rounding, seed=5))
  opt = make()
  first = opt.init(params)
  want = make().init(params)  # (a host copy of `first` would hide the bug)

  @functools.partial(jax.jit, donate_argnums=1)
  def step(params, state):
    grads = quadratic_grads(jax.tree.map(lambda p: p.astype(jnp.float32),
                                         params), target)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  step(params, first)
  assert_bitwise_equal(opt.init(params), want)


# ---------------------------------------------------------------------------
# loss_scaling: a skipped step changes nothing


def low_precision_opt(param_rounding, inner=None):
  return optax.chain(optim.compress_state(inner or optax.adamw(1e-2)),
                     optim.low_precision_params(param_rounding))


@pytest.mark.parametrize("skip_with", ["cond", "select"])
@pytest.mark.parametrize("param_rounding", ["stochastic", "kahan"])
def test_skipped_step_leaves_16bit_state_and_key_unchanged(skip_with,
                                                           param_rounding):
  params, target = problem(dtype=jnp.bfloat16)
  opt = jmp_amp.loss_scaling(low_precision_opt(param_rounding),
                             jmp_amp.DynamicLossScale(2.0 ** 4),
                             skip_with=skip_with)
  update = jax.jit(opt.update)
  state = opt.init(params)
  for _ in range(3):  # non-trivial state: moments, keys, compensation
    updates, state = update(quadratic_grads(params, target), state, params)
    params = optax.apply_updates(params, updates)
  bad = quadratic_grads(params, target)
  bad["w"] = bad["w"].at[0, 0].set(jnp.inf)
  updates, new_state = update(bad, state, params)
  assert not bool(new_state.grads_finite)
  assert_bitwise_equal(new_state.inner_state, state.inner_state)
  assert_bitwise_equal(optax.apply_updates(params, updates), params)
  # The next finite step then moves the state and the keys.
  _, after = update(quadratic_grads(params, target), new_state, params)
  assert np.any(bits(after.inner_state[0].key) != bits(state.inner_state[0].key))


# ---------------------------------------------------------------------------
# low_precision_params


@pytest.mark.parametrize("rounding", ["stochastic", "kahan", "nearest"])
def test_apply_updates_lands_exactly_on_the_rounded_result(rounding):
  """p + u (optax.apply_updates, in the param dtype) is the rounded value.

  The transformation returns u = p_new - p in float32; the sum is exact iff
  apply_updates(p, u) - p == u.
  """
  k1, k2, k3 = jax.random.split(jax.random.key(11), 3)
  n = 20_000
  p = (jax.random.normal(k1, (n,)) * 10.0 ** jax.random.randint(
      k2, (n,), -4, 4)).astype(jnp.bfloat16)
  # Updates from 1e-8 to 10x the param: far below and far above its ulp.
  u = p.astype(jnp.float32) * jax.random.normal(k3, (n,)) * 10.0 ** (
      jax.random.randint(k3, (n,), -8, 2))
  opt = optim.low_precision_params(rounding)
  out, _ = opt.update({"p": u}, opt.init({"p": p}), {"p": p})
  new = optax.apply_updates({"p": p}, out)["p"]
  assert new.dtype == jnp.bfloat16
  np.testing.assert_array_equal(
      np.asarray(new.astype(jnp.float32) - p.astype(jnp.float32)),
      np.asarray(out["p"]))
  exact = p.astype(jnp.float32) + u
  down = jax.lax.bitcast_convert_type(
      jax.lax.bitcast_convert_type(exact, jnp.uint32) & jnp.uint32(0xFFFF0000),
      jnp.float32)
  if rounding == "stochastic":  # one of the two neighbours of p + u
    nb = bits(new).astype(np.uint32)
    assert np.all((nb == bits(down) >> 16) | (nb == (bits(down) >> 16) + 1))
  else:  # first step: no compensation yet, so both are nearest
    np.testing.assert_array_equal(bits(new), bits(exact.astype(jnp.bfloat16)))


@pytest.mark.parametrize("rounding,tolerance", [
    ("stochastic", 4e-4), ("kahan", BF16_ULP_AT_1 / 2)])
def test_updates_below_resolution_add_up(rounding, tolerance):
  """1000 steps of +1e-4 on bfloat16 ones: float32 gives 1.1.

  Stochastic rounding moves each element by one ulp (2**-7 above 1) with
  probability ~1e-4 / ulp per step: after 1000 steps an element's standard
  deviation is ~0.028, the mean's over 2**16 elements ~1.1e-4, so the
  tolerance is 3.5 of those.
  """
  opt = optax.chain(optax.sgd(1e-4), optim.low_precision_params(rounding))
  n = 2 ** 16
  params = {"w": jnp.ones(n, jnp.bfloat16)}

  @jax.jit
  def go(params):
    state = opt.init(params)

    def step(carry, _):
      params, state = carry
      updates, state = opt.update({"w": -jnp.ones(n)}, state, params)
      return (optax.apply_updates(params, updates), state), None
    return jax.lax.scan(step, (params, state), None, 1000)[0][0]

  w = go(params)["w"].astype(jnp.float32)
  assert abs(float(jnp.mean(w)) - 1.1) <= tolerance, float(jnp.mean(w))
  # Plain bfloat16 params (round to nearest) never move: 1e-4 < ulp / 2.
  nearest = optax.chain(optax.sgd(1e-4), optim.low_precision_params("nearest"))
  updates, _ = nearest.update({"w": -jnp.ones(n)}, nearest.init(params),
                              params)
  assert float(jnp.max(optax.apply_updates(params, updates)["w"])) == 1.0


@pytest.mark.parametrize("rounding", ["stochastic", "kahan"])
def test_bf16_params_track_float32_master_weights(rounding):
  params, target = problem()
  ref, _ = jax.jit(functools.partial(run, optax.adam(0.02), steps=60))(
      params, target)
  got, _ = jax.jit(functools.partial(
      run, low_precision_opt(rounding, optax.adam(0.02)), steps=60))(
          jax.tree.map(lambda p: p.astype(jnp.bfloat16), params), target)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
    assert a.dtype == jnp.bfloat16
    # Adam's steps are ~lr whatever the gradient: rounding noise can put a
    # coordinate a few steps off (max), but on average they agree closely.
    diff = np.abs(np.asarray(a.astype(jnp.float32)) - np.asarray(b))
    assert diff.max() <= 0.1 and diff.mean() <= 0.01, (diff.max(), diff.mean())


def test_float32_params_pass_through_and_kahan_is_deterministic():
  params = {"a": jnp.ones(3), "b": jnp.ones(3, jnp.bfloat16)}
  grads = {"a": jnp.full(3, 0.1), "b": jnp.full(3, 1e-3)}
  opt = optim.low_precision_params("kahan")
  state = opt.init(params)
  assert state.compensation["a"].shape == ()
  assert state.compensation["b"].dtype == jnp.bfloat16
  out, state = opt.update(grads, state, params)
  np.testing.assert_array_equal(out["a"], grads["a"])
  assert float(out["b"][0]) == 0.0  # 1 + 1e-3 rounds back to 1 ...
  np.testing.assert_allclose(state.compensation["b"].astype(jnp.float32),
                             1e-3, rtol=2 ** -8)  # ... and 1e-3 is kept
  out2, state2 = opt.update(grads, opt.init(params), params)
  assert_bitwise_equal((out, state), (out2, state2))


def test_bad_input_raises():
  with pytest.raises(ValueError, match="rounding must be one of.*'kahan'"):
    optim.low_precision_params("truncate")
  with pytest.raises(ValueError, match="rounding must be one of.*'nearest'"):
    optim.compress_state(optax.adam(1e-3), rounding="kahan")
  with pytest.raises(TypeError, match="seed must be an int"):
    optim.compress_state(optax.adam(1e-3), seed=1.5)
  with pytest.raises(TypeError, match="GradientTransformation.*MultiSteps"):
    optim.compress_state(optax.MultiSteps(optax.adam(1e-3), 2))
  with pytest.raises(TypeError, match=r"\['n'\] must be a real floating.*int"):
    optim.low_precision_params().init({"n": jnp.arange(3)})
  with pytest.raises(TypeError, match="targets bfloat16.*float16.*kahan"):
    optim.low_precision_params().init({"w": jnp.ones(3, jnp.float16)})
  opt = optim.low_precision_params()
  state = opt.init({"w": jnp.ones(3, jnp.bfloat16)})
  with pytest.raises(ValueError, match="needs the params"):
    opt.update({"w": jnp.ones(3)}, state)
  with pytest.raises(TypeError, match="LowPrecisionParamsState"):
    opt.update({"w": jnp.ones(3)}, optax.EmptyState(),
               {"w": jnp.ones(3, jnp.bfloat16)})


def test_float16_params_with_kahan():
  opt = optax.chain(optax.sgd(1e-4), optim.low_precision_params("kahan"))
  params = {"w": jnp.ones(4, jnp.float16)}
  state = opt.init(params)
  for _ in range(100):
    updates, state = opt.update({"w": -jnp.ones(4)}, state, params)
    params = optax.apply_updates(params, updates)
  assert params["w"].dtype == jnp.float16
  np.testing.assert_allclose(params["w"].astype(jnp.float32), 1.01,
                             atol=2.0 ** -11)


# ---------------------------------------------------------------------------
# Checkpoint: a resumed run is bitwise the unbroken one


def test_checkpoint_resume_is_bitwise(tmp_path):
  checkpoint = pytest.importorskip("jmp_amp.checkpoint")
  params, target = problem(dtype=jnp.bfloat16)
  opt = jmp_amp.loss_scaling(low_precision_opt("stochastic"),
                             jmp_amp.NoOpLossScale())
  update = jax.jit(opt.update)

  def steps(params, state, n):
    for _ in range(n):
      updates, state = update(quadratic_grads(params, target), state, params)
      params = optax.apply_updates(params, updates)
    return params, state

  unbroken = steps(params, opt.init(params), 6)
  half = steps(params, opt.init(params), 3)
  checkpoint.save(tmp_path, {"params": half[0], "opt_state": half[1]}, step=3)
  fresh = {"params": params, "opt_state": opt.init(params)}
  restored = checkpoint.restore(tmp_path, fresh)
  assert_bitwise_equal(restored, {"params": half[0], "opt_state": half[1]})
  resumed = steps(restored["params"], restored["opt_state"], 3)
  assert_bitwise_equal(resumed, unbroken)


# ---------------------------------------------------------------------------
# Sharding: 8 simulated devices give the bits of one


@pytest.mark.slow  # a subprocess that compiles for 8 devices: ~20 s
def test_eight_devices_bitwise_equal_one():
  script = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                        "low_precision_sharded_check.py")
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = os.pathsep.join(
      [os.path.dirname(os.path.dirname(script))]
      + [p for p in [env.get("PYTHONPATH")] if p])
  proc = subprocess.run([sys.executable, script], capture_output=True,
                        text=True, env=env, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads(proc.stdout.strip().splitlines()[-1])
  assert result["devices"] == 8 and result["leaves"] == 9
  assert result["state_sharded"] and result["params_moved"]
  assert result["unequal_leaves"] == []


# ---------------------------------------------------------------------------
# Flax: nnx.Optimizer and linen TrainState apply the rounded params exactly


def test_nnx_optimizer_with_bfloat16_params():
  nnx = pytest.importorskip("flax.nnx")
  model = nnx.Linear(8, 4, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  opt = nnx.Optimizer(model, low_precision_opt("stochastic"), wrt=nnx.Param)
  x = jax.random.normal(jax.random.key(1), (16, 8))

  @nnx.jit
  def step(model, opt):
    loss, grads = nnx.value_and_grad(
        lambda m: jnp.mean(m(x).astype(jnp.float32) ** 2))(model)
    opt.update(model, grads)  # optax.apply_updates: exact, tested above
    return loss

  losses = []
  for _ in range(5):
    before = model.kernel[...]
    losses.append(float(step(model, opt)))
    assert model.kernel[...].dtype == jnp.bfloat16
    assert bool(jnp.any(model.kernel[...] != before))
  assert losses[-1] < losses[0]
  assert opt.opt_state[0].inner_state[0].mu["kernel"].dtype == jnp.bfloat16


def test_linen_train_state_with_bfloat16_params():
  pytest.importorskip("flax")
  from flax import linen as nn  # pylint: disable=g-import-not-at-top
  from flax.training import train_state  # pylint: disable=g-import-not-at-top
  model = nn.Dense(4, param_dtype=jnp.bfloat16)
  x = jax.random.normal(jax.random.key(1), (16, 8))
  params = model.init(jax.random.key(0), x)["params"]
  state = train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=low_precision_opt("kahan"))

  @jax.jit
  def step(state):
    grads = jax.grad(lambda p: jnp.mean(state.apply_fn(
        {"params": p}, x).astype(jnp.float32) ** 2))(state.params)
    return state.apply_gradients(grads=grads)

  for _ in range(3):
    new = step(state)
    assert new.params["kernel"].dtype == jnp.bfloat16
    comp = new.opt_state[1].compensation["kernel"]
    assert comp.dtype == jnp.bfloat16 and bool(jnp.any(comp != 0))
    state = new
  assert bool(jnp.any(state.params["kernel"] != params["kernel"]))


# ---------------------------------------------------------------------------
# The committed results (benchmarks/low_precision.py) hold what the docs say


def test_committed_results_meet_the_stated_targets():
  path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(
      __file__))), "benchmarks", "results", "low_precision.json")
  with open(path) as f:
    results = json.load(f)
  sr, kahan, nearest, f32 = (
      "bf16 params + bf16 moments, stochastic",
      "bf16 params + bf16 moments, kahan",
      "bf16 params + bf16 moments, nearest",
      "float32 master + float32 moments")
  rows = {r["recipe"]: r for r in
          results["memory"]["shapes"]["state-dominated"]["rows"]}
  assert rows[sr]["argument_plus_temp_vs_float32"] <= 0.55
  assert rows[sr]["bytes_estimate_vs_nearest"] <= 1.10
  assert rows[kahan]["argument_bytes"] > rows[sr]["argument_bytes"]
  digits = results["accuracy"]["digits"]
  assert digits["seeds"] >= 3
  assert digits["final_accuracy"][f32] - digits["final_accuracy"][sr] <= 0.5
  gpt = results["accuracy"]["gpt"]["loss_vs_float32"]
  assert abs(gpt[sr] - 1) <= 0.01 and abs(gpt[kahan] - 1) <= 0.01
  assert gpt[nearest] >= 1.05  # visibly behind
  assert results["cost"]["stochastic_vs_nearest"] <= 1.10


@pytest.mark.parametrize("key", [0, jnp.array([0.25, 0.75]), np.int32(3),
                                 jnp.array([0, 1], jnp.int32)])
def test_stochastic_round_requires_a_prng_key(key):
  # (#35) A float key was truncated: [0.25, 0.75] rounded as [0, 0].
  with pytest.raises(TypeError, match=r"stochastic_round: key must be a JAX "
                     r"PRNG key: jax\.random\.key\(seed\), or its raw uint32 "
                     r"key data, jax\.random\.PRNGKey\(seed\); got "):
    optim.stochastic_round(jnp.ones(4), key)


def test_stochastic_round_accepts_typed_and_raw_keys_alike():
  x = jnp.full(64, 1.0 + 2.0 ** -10)
  typed = optim.stochastic_round(x, jax.random.key(5))
  raw = optim.stochastic_round(x, jax.random.key_data(jax.random.key(5)))
  np.testing.assert_array_equal(typed, raw)
  with pytest.raises(ValueError, match="must be one key"):
    optim.stochastic_round(x, jax.random.split(jax.random.key(0), 2))


def test_stochastic_round_saturates_beyond_the_bfloat16_maximum():
  # (#35) About 3.5 % of these became inf; nearest gives the finite maximum.
  largest = float(jnp.finfo(jnp.bfloat16).max)
  x = jnp.full(100_000, 3.3961e38, jnp.float32)  # > largest, < f32 max
  assert float(x.astype(jnp.bfloat16)[0]) == largest
  for sign in (1.0, -1.0):
    y = optim.stochastic_round(sign * x, jax.random.key(0))
    assert np.asarray(y.astype(jnp.float32) == sign * largest).all()
  top = jnp.float32(np.finfo(np.float32).max)
  assert float(optim.stochastic_round(top, jax.random.key(1))) == largest
  inf = optim.stochastic_round(jnp.array([jnp.inf, -jnp.inf]),
                               jax.random.key(1))
  assert inf.tolist() == [float("inf"), float("-inf")]


def test_low_precision_params_on_float32_params_warns():
  # (#35) A policy without param="bfloat16" made it do nothing, silently.
  tx = optim.low_precision_params("kahan")
  with pytest.warns(UserWarning, match=r"low_precision_params: every param "
                    r"is float32 \(2 arrays\), so it changes nothing; store "
                    r"the params in bfloat16"):
    tx.init({"w": jnp.ones(3), "b": jnp.zeros(2)})
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    tx.init({"w": jnp.ones(3, jnp.bfloat16), "b": jnp.zeros(2)})
