"""Silent wrong answers and raw crashes a user met (issue 49), each refused
with a clear error or answered right.

Checkpoints that know their optimizer and step, a localiser that tells a
mask from an overflow, the multi-process loss-scale check at `init`, and the
traps met porting Flax code.
"""

import json
import os
import warnings

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_amp

ocp = pytest.importorskip("orbax.checkpoint")
from jmp_amp import checkpoint  # pylint: disable=g-import-not-at-top

pytestmark = pytest.mark.filterwarnings(
    "ignore::pytest.PytestUnraisableExceptionWarning")


# --------------------------------------------------------------------------
# Checkpoints know their optimizer (items 1 and 4).


def _train_state(tx):
  opt = jmp_amp.loss_scaling(tx, jmp_amp.DynamicLossScale(2.0**15))
  params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
  return {"params": params, "opt_state": opt.init(params)}


def _clipped(tx):
  return optax.chain(optax.clip_by_global_norm(1.0), tx)


OPTIMIZER_CHANGES = {
    # Same leaf paths (count / mu / nu), another algorithm.
    "adam-adabelief": (optax.adam, optax.adabelief, [
        "saved LossScalingState, ScaleByAdamState, EmptyState; target "
        "LossScalingState, ScaleByBeliefState, EmptyState",
        "['opt_state'].inner_state[0]: saved ScaleByAdamState, target "
        "ScaleByBeliefState"]),
    # One more empty node, no leaf more.
    "adam-adamw": (optax.adam, optax.adamw, [
        "saved LossScalingState, ScaleByAdamState, EmptyState; target "
        "LossScalingState, ScaleByAdamState, EmptyState, EmptyState",
        "['opt_state'].inner_state[2]: only in the target: EmptyState"]),
    "clip-adam-adabelief": (
        lambda lr: _clipped(optax.adam(lr)),
        lambda lr: _clipped(optax.adabelief(lr)),
        ["['opt_state'].inner_state[1][0]: saved ScaleByAdamState, target "
         "ScaleByBeliefState"]),
    "clip-adam-adamw": (
        lambda lr: _clipped(optax.adam(lr)),
        lambda lr: _clipped(optax.adamw(lr)),
        ["['opt_state'].inner_state[1][2]: only in the target: EmptyState"]),
}


@pytest.mark.parametrize("change", sorted(OPTIMIZER_CHANGES))
def test_another_optimizer_is_a_mismatch_naming_both(tmp_path, change):
  saved_tx, target_tx, fragments = OPTIMIZER_CHANGES[change]
  for step in (1, 2):
    checkpoint.save(tmp_path, _train_state(saved_tx(1e-3)), step=step)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # no fallback to older steps
    with pytest.raises(checkpoint.CheckpointError) as e:
      checkpoint.restore_latest(tmp_path, _train_state(target_tx(1e-3)))
  assert e.value.reason == "mismatch", str(e.value)
  assert e.value.step == 2
  message = str(e.value)
  assert "optimizer state differs (another optimizer?)" in message
  for fragment in fragments:
    assert fragment in message
  # The same optimizer restores.
  state, step = checkpoint.restore_latest(tmp_path,
                                          _train_state(saved_tx(1e-3)))
  assert step == 2 and state["opt_state"].inner_state is not None


def test_nnx_optimizer_of_another_optimizer_is_a_mismatch(tmp_path):
  # nnx.state(optimizer) keeps neither the NamedTuples nor adamw's empty
  # node: the types come from the optimizer itself.
  def make(tx):
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(
        model, jmp_amp.loss_scaling(tx, jmp_amp.DynamicLossScale(2.0**15)),
        wrt=nnx.Param)
    return {"model": model, "optimizer": optimizer}
  checkpoint.save(tmp_path, make(optax.adam(1e-3)), step=3)
  for tx, fragment in [
      (optax.adamw(1e-3),
       "['optimizer']['opt_state']['inner_state'][2]: only in the target: "
       "EmptyState"),
      (optax.adabelief(1e-3),
       "['optimizer']['opt_state']['inner_state'][0]: saved "
       "ScaleByAdamState, target ScaleByBeliefState")]:
    target = make(tx)
    kernel = np.asarray(target["model"].kernel[...])
    with pytest.raises(checkpoint.CheckpointError, match=r"(?s)optimizer "
                       r"state differs.*" + fragment.replace("[", r"\[")):
      checkpoint.restore(tmp_path, target)
    # Refused before anything was written into the target.
    np.testing.assert_array_equal(target["model"].kernel[...], kernel)
  checkpoint.restore(tmp_path, make(optax.adam(1e-3)))


def test_a_checkpoint_from_before_the_types_refuses_an_empty_node_change(
    tmp_path):
  # A /3 checkpoint records no types; adamw's extra empty node is still a
  # mismatch (from orbax's tree), never damaged files.
  checkpoint.save(tmp_path, _train_state(optax.adam(1e-3)), step=1)
  path = tmp_path / "1" / "jmp_amp" / "metadata"
  meta = json.loads(path.read_text())
  del meta["state_types"]
  path.write_text(json.dumps({**meta, "format": "jmp_amp.checkpoint/3"}))
  with pytest.raises(checkpoint.CheckpointError,
                     match=r"empty \(leafless\) state nodes differ") as e:
    checkpoint.restore_latest(tmp_path, _train_state(optax.adamw(1e-3)))
  assert e.value.reason == "mismatch"
  assert "opt_state/inner_state/2" in str(e.value)
  checkpoint.restore(tmp_path, _train_state(optax.adam(1e-3)))


# --------------------------------------------------------------------------
# A renamed step directory (item 2).


def test_a_renamed_step_directory_is_a_mismatch_naming_both_steps(tmp_path):
  state = _train_state(optax.adam(1e-3))
  checkpoint.save(tmp_path, state, step=5)
  os.rename(tmp_path / "5", tmp_path / "7")
  assert checkpoint.latest_step(tmp_path) == 7
  for restore in (lambda: checkpoint.restore_latest(tmp_path, state),
                  lambda: checkpoint.restore(tmp_path, state, step=7)):
    with pytest.raises(checkpoint.CheckpointError) as e:
      restore()
    assert e.value.reason == "mismatch" and e.value.step == 7
    assert str(e.value).startswith(
        f"checkpoint step 7 in {tmp_path} holds the state saved as step 5")
    assert "2 steps off. Rename the directory back to 5" in str(e.value)
  os.rename(tmp_path / "7", tmp_path / "5")
  assert checkpoint.restore_latest(tmp_path, state)[1] == 5


# --------------------------------------------------------------------------
# find_nonfinite tells a mask from an overflow (item 3).


def _attention(x, mask):
  with jax.named_scope("scores"):
    scores = (x @ x.T) * 1000
  return jnp.sum(jax.nn.softmax(scores + mask))


CAUSAL_MASK = jnp.where(jnp.tril(jnp.ones((3, 3), bool)), 0,
                        -jnp.inf).astype(jnp.float16)


def test_find_nonfinite_is_none_for_a_finite_loss_with_a_minus_inf_mask():
  from jmp_amp import numerics  # pylint: disable=import-outside-toplevel
  x = jnp.full((3, 4), 0.01, jnp.float16)
  assert float(_attention(x, CAUSAL_MASK)) == 3.0
  assert numerics.find_nonfinite(_attention, x, CAUSAL_MASK) is None
  assert numerics.find_nonfinite(_attention, x, CAUSAL_MASK,
                                 backward=False) is None


def test_find_nonfinite_names_the_scores_overflow_not_the_mask():
  from jmp_amp import numerics  # pylint: disable=import-outside-toplevel
  x = jnp.full((3, 4), 6.0, jnp.float16)  # 144 * 1000 > 65504
  assert np.isnan(float(_attention(x, CAUSAL_MASK)))
  r = numerics.find_nonfinite(_attention, x, CAUSAL_MASK)
  assert (r.direction, r.primitive, r.module, r.outputs, r.argument) == (
      "forward", "mul", "scores", ("inf",), None)
  assert r.max_finite == 1000.0  # 144 (x @ x.T) and the 1000


def test_find_nonfinite_names_an_input_inf_that_reaches_the_output():
  from jmp_amp import numerics  # pylint: disable=import-outside-toplevel
  x = jnp.full((3, 3), 0.5, jnp.float16)
  r = numerics.find_nonfinite(lambda x, m: jnp.sum(x + m), x, CAUSAL_MASK)
  assert (r.direction, r.argument, r.outputs) == ("input", "args[1]",
                                                  ("inf",))
  # A NaN in the input comes first, before the mask.
  x = x.at[0, 0].set(jnp.nan)
  r = numerics.find_nonfinite(lambda x, m: jnp.sum(x * 1000 + m), x,
                              CAUSAL_MASK)
  assert (r.direction, r.argument, r.outputs) == ("input", "args[0]",
                                                  ("nan",))


# --------------------------------------------------------------------------
# get_scaling_state of an nnx.Optimizer (item 13).


def test_get_scaling_state_of_an_nnx_optimizer_gives_plain_arrays():
  model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(
      model, jmp_amp.loss_scaling(optax.adam(1e-3),
                                  jmp_amp.DynamicLossScale(2.0**15)),
      wrt=nnx.Param)

  @nnx.jit
  def train_step(model, optimizer, x):
    loss_fn = lambda m: jnp.mean(m(x) ** 2)
    state = jmp_amp.get_scaling_state(optimizer.opt_state)
    loss, grads = nnx.value_and_grad(
        lambda m: state.loss_scale.scale(loss_fn(m)))(model)
    optimizer.update(model, grads)
    return loss

  train_step(model, optimizer, jnp.full((4, 3), jnp.inf))  # skipped
  for where in (optimizer.opt_state, optimizer):
    state = jmp_amp.get_scaling_state(where)
    assert bool(state.grads_finite) is False
    assert int(state.skipped_steps) == 1 and int(state.steps) == 1
    assert float(state.loss_scale.loss_scale) == 2.0**14
    assert all(type(x) is type(jnp.zeros(())) for x in jax.tree.leaves(state))
  with pytest.raises(ValueError, match=r"nnx.state\(optimizer\) keeps the "
                     r"loss scale's arrays but not its class.*Pass the "
                     r"nnx.Optimizer itself"):
    jmp_amp.get_scaling_state(nnx.state(optimizer))


# --------------------------------------------------------------------------
# Small ones (items 5 and 6).


def test_scaled_value_and_grad_in_the_old_call_style_shows_both_calls():
  opt = jmp_amp.loss_scaling(optax.sgd(0.1), jmp_amp.DynamicLossScale(2.0))
  params = {"w": jnp.ones(2)}
  with pytest.raises(TypeError) as e:
    jmp_amp.scaled_value_and_grad(lambda p: jnp.sum(p["w"]),
                                  opt.init(params))
  assert str(e.value).endswith(
      "write jmp_amp.scaled_value_and_grad(fun)(opt_state, *fun_args) "
      "instead of jmp_amp.scaled_value_and_grad(fun, opt_state)(*fun_args)")


def test_low_precision_params_on_float64_params_names_their_dtype():
  with jax.enable_x64(True):
    params = {"w": jnp.ones(3, jnp.float64), "b": jnp.ones(2, jnp.float64)}
    opt = jmp_amp.optim.low_precision_params("kahan")
    with pytest.warns(UserWarning, match=r"every param is float64 \(2 "
                      r"arrays\), so it changes nothing") as record:
      state = opt.init(params)
    assert "float32" not in str(record[0].message).split(";")[0]
    updates, _ = opt.update({"w": jnp.full(3, 0.5), "b": jnp.zeros(2)},
                            state, params)
    assert updates["w"].dtype == jnp.float64  # passed through
    np.testing.assert_array_equal(updates["w"], 0.5)


# --------------------------------------------------------------------------
# autocast of an in-place NNX step (item 8).


def _nnx_step_setup():
  model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
  return model, optimizer, jnp.ones((3, 4)), jnp.zeros((3, 2))


def _loss_fn(model, x, y):
  return jnp.mean((model(x) - y) ** 2)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "nnx.jit"])
def test_autocast_of_an_in_place_nnx_step_is_refused(jit):
  model, optimizer, x, y = _nnx_step_setup()

  def train_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(_loss_fn)(model, x, y)
    optimizer.update(model, grads)
    return loss

  step = jmp_amp.autocast(train_step, "mixed_bfloat16")
  if jit:
    step = nnx.jit(step)
  kernel = np.asarray(model.kernel[...])
  with pytest.raises(TypeError, match=(
      r"autocast takes pure functions: fn changed the Flax NNX state it "
      r"was given \(args\[0\] \(Linear\), args\[1\] \(Optimizer\)\) in "
      r"place.*nnx.value_and_grad\(jmp_amp.autocast\(loss_fn, policy\)\)")):
    step(model, optimizer, x, y)
  np.testing.assert_array_equal(model.kernel[...], kernel)


def test_autocast_of_the_loss_inside_an_nnx_step_updates_the_model():
  model, optimizer, x, y = _nnx_step_setup()

  @nnx.jit
  def train_step(model, optimizer, x, y):
    amp_loss = jmp_amp.autocast(_loss_fn, "p=f32,c=bf16,o=f32")
    loss, grads = nnx.value_and_grad(amp_loss)(model, x, y)
    optimizer.update(model, grads)
    return loss

  kernel = np.asarray(model.kernel[...])
  first = float(train_step(model, optimizer, x, y))
  assert model.kernel[...].dtype == jnp.float32
  assert not np.array_equal(model.kernel[...], kernel)
  assert float(train_step(model, optimizer, x, y)) < first


# --------------------------------------------------------------------------
# autocast of a whole train step with half outputs (item 10).


def _adam_step():
  opt = optax.adam(1e-3)

  def train_step(params, opt_state, x):
    loss, grads = jax.value_and_grad(
        lambda p: jnp.mean(jnp.tanh(x @ p["w"] + p["b"])))(params)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  params = {"w": jnp.ones((4, 2)), "b": jnp.zeros(2)}
  return train_step, params, opt.init(params), jnp.ones((3, 4))


def test_autocast_of_a_step_with_half_outputs_warns_about_master_weights():
  train_step, params, opt_state, x = _adam_step()
  with pytest.warns(UserWarning, match=(
      r"autocast with output dtype bfloat16 \(p=f32,c=bf16,o=bf16\) casts "
      r"float32 state to bfloat16: output\[0\] \(like args\[0\]\), "
      r"output\[1\] \(like args\[1\]\)\. .*master copies.*"
      r'"p=f32,c=bf16,o=f32"')):
    params16, state16, _ = jax.jit(
        jmp_amp.autocast(train_step, "mixed_bfloat16"))(params, opt_state, x)
  assert params16["w"].dtype == jnp.bfloat16  # what the rule does
  assert state16[0].mu["w"].dtype == jnp.bfloat16
  # The step policy of the warning keeps them float32, without a word.
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    new, state, loss = jmp_amp.autocast(train_step, "p=f32,c=bf16,o=f32")(
        params, opt_state, x)
    # An activation shaped like its input is no state.
    act = jmp_amp.autocast(lambda h: h + jnp.tanh(h), "mixed_bfloat16")(x)
  assert new["w"].dtype == state[0].nu["w"].dtype == jnp.float32
  assert loss.dtype == jnp.float32 and act.dtype == jnp.bfloat16


# --------------------------------------------------------------------------
# A linen layer with an explicit dtype under a policy (item 9).


def test_linen_layer_with_an_explicit_dtype_is_named_in_a_warning():
  import flax.linen as nn  # pylint: disable=import-outside-toplevel

  import jmp_amp.flax  # pylint: disable=import-outside-toplevel

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.Dense(8, dtype=jnp.float32)(x)
      x = nn.LayerNorm(dtype=jnp.float32)(x)  # its policy computes float32
      return nn.Dense(2)(x)

  x = jnp.ones((2, 4))
  variables = Net().init(jax.random.key(0), x)
  rules = jmp_amp.flax.mixed_rules("bfloat16")
  with pytest.warns(UserWarning, match=(
      r"linen modules with an explicit dtype override the policy's compute "
      r"dtype: Dense_0 \(Dense, dtype=float32, policy compute bfloat16\)\. "
      r"Their inputs and params are still cast")) as record:
    jax.jit(lambda v, x: jmp_amp.flax.apply_with_policies(
        Net(), rules, v, x))(variables, x)
  assert len(record) == 1
  assert "LayerNorm" not in str(record[0].message)
  assert "Dense_1" not in str(record[0].message)
  # The rule the warning suggests silences it.
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    jmp_amp.flax.apply_with_policies(
        Net(), rules | {"Dense_0": "float32"}, variables, x)


# --------------------------------------------------------------------------
# A model's own norm class under mixed_rules (item 12).


class GemmaRMSNorm(nnx.Module):
  """Written as Gemma's `layers.RMSNorm`: a scale and no dtype knob."""

  def __init__(self, dim):
    self.scale = nnx.Param(jnp.zeros(dim))

  def __call__(self, x):
    var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(var + 1e-6) * (1 + self.scale[...])


class _NormBlock(nnx.Module):

  def __init__(self, rngs):
    self.pre_attention_norm = GemmaRMSNorm(8)
    self.proj = nnx.Linear(8, 8, rngs=rngs)
    self.final_norm = nnx.RMSNorm(8, rngs=rngs)

  def __call__(self, x):
    return self.final_norm(self.proj(self.pre_attention_norm(x)))


@pytest.mark.filterwarnings("ignore:.*has no dtype knob")
def test_mixed_rules_name_a_models_own_norm_left_in_half():
  import jmp_amp.flax  # pylint: disable=import-outside-toplevel
  rules = jmp_amp.flax.mixed_rules("float16")
  with pytest.warns(UserWarning, match=(
      r"modules of _NormBlock named like norms compute in half precision "
      r"under these rules: pre_attention_norm \(GemmaRMSNorm, float16\)\. "
      r".*rules \| \{GemmaRMSNorm: \"float32\"\}")) as record:
    jmp_amp.flax.set_policies(_NormBlock(nnx.Rngs(0)), rules)
  assert not any("final_norm" in str(r.message) for r in record)
  # The rule it suggests puts the norm in float32, without a word.
  model = _NormBlock(nnx.Rngs(0))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    jmp_amp.flax.set_policies(model, rules | {GemmaRMSNorm: "float32"})
  policies = jmp_amp.flax.get_policies(model)
  assert jnp.dtype(policies["pre_attention_norm"].compute_dtype) == jnp.float32
  assert jnp.dtype(policies["proj"].compute_dtype) == jnp.float16


# --------------------------------------------------------------------------
# matmul_report of a step on a fresh flax TrainState (item 14).


def test_matmul_report_traces_a_train_states_python_step_as_jit_does():
  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  from flax.training import train_state  # pylint: disable=g-import-not-at-top

  def rsqrt_schedule(step):  # lm1b's shape: Python's 0 ** -0.5 raises
    return 0.1 * jnp.minimum(1.0, (step + 1) / 10) * step ** -0.5

  model = nn.Dense(4)
  x = jnp.ones((2, 8), jnp.bfloat16)
  state = train_state.TrainState.create(
      apply_fn=model.apply, params=model.init(jax.random.key(0), x)["params"],
      tx=optax.sgd(rsqrt_schedule))
  assert state.step == 0 and isinstance(state.step, int)

  def train_step(state, x):
    lr = rsqrt_schedule(state.step)
    grads = jax.grad(lambda p: jnp.mean(state.apply_fn({"params": p}, x)))(
        state.params)
    return state.apply_gradients(grads=grads), lr

  jax.jit(train_step).lower(state, x)  # jit traces the step
  report = jmp_amp.matmul_report(train_step, state, x)
  assert report.summary()["by_signature"] == jmp_amp.matmul_report(
      jax.jit(train_step), state, x).summary()["by_signature"]
  assert len(list(report)) == 1  # the kernel's gradient (mean is linear)


# --------------------------------------------------------------------------
# autocast(jax.grad(loss), "float8") against jax.grad(autocast(...)) (11).


def test_autocast_float8_of_a_gradient_warns_that_it_rounds_it_as_e4m3():
  loss = lambda w, x: jnp.sum(jnp.tanh(x @ w))
  w, x = jnp.full((4, 3), 0.25), jnp.ones((2, 4))
  with pytest.warns(UserWarning, match=(
      r"autocast\(fn, \"float8\"\) of a function that computes gradients "
      r"\(1 matmul\(s\) of its backward pass.*float8_e4m3fn.*"
      r"jax.grad\(jmp_amp.autocast\(loss, \"float8\"\)\) quantizes the "
      r"gradient in float8_e5m2")):
    inside = jmp_amp.autocast(jax.grad(loss), "float8")(w, x)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    outside = jax.grad(jmp_amp.autocast(loss, "float8"))(w, x)
    # A forward-only function, and a half policy, say nothing.
    jmp_amp.autocast(loss, "float8")(w, x)
    jmp_amp.autocast(jax.grad(loss), "p=f32,c=bf16,o=f32")(w, x)
  assert inside.shape == outside.shape == w.shape
