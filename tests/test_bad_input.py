"""Bad input to the public entry points fails early, with the right exception
type and a message that names the problem.

Covered: Policy / get_policy, the loss scales, loss_scaling and its state
helpers, casting (a decision, not an error: integer leaves pass through),
jmp_amp.checkpoint, jmp_amp.testing, the `jmp-amp bench` CLI and
jmp_amp.flax's policy rules and train steps (skipped if not installed).
"""

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_amp
from jmp_amp import testing as jt

INF = math.inf
Dyn = jmp_amp.DynamicLossScale


def _raises(fn, exc, match):
  with pytest.raises(exc, match=match):
    fn()


# --------------------------------------------------------------------------
# Policies.

POLICY_CASES = {
    "integer param dtype": (
        lambda: jmp_amp.Policy(jnp.int32, jnp.float32, jnp.float32),
        TypeError, r"param_dtype must be a floating-point dtype.*int32"),
    "non-dtype object": (
        lambda: jmp_amp.Policy(jnp.float32, jnp.float32, object()),
        TypeError, r"output_dtype must be a floating-point dtype"),
    "unknown dtype name in Policy": (
        lambda: jmp_amp.Policy("f32", "f33", "f32"),
        ValueError, r"compute_dtype: Unknown dtype 'f33'"),
    "unknown dtype in policy string": (
        lambda: jmp_amp.get_policy("p=f32,c=bf17"),
        ValueError, r"Unknown dtype 'bf17' in policy 'p=f32,c=bf17'"),
    "integer dtype in policy string": (
        lambda: jmp_amp.get_policy("params=int32"),
        ValueError, r"Unknown dtype 'int32'"),
    "unknown key": (
        lambda: jmp_amp.get_policy("q=f32"),
        ValueError, r"Unknown key 'q' in policy 'q=f32'; keys are 'params'"),
    "key given twice": (
        lambda: jmp_amp.get_policy("p=f32,p=f16"),
        ValueError, r"Key 'p' given twice"),
    "malformed separator": (
        lambda: jmp_amp.get_policy("p=f32;c=f16"),
        ValueError, r"Malformed part 'p=f32;c=f16'.*expected key=dtype"),
    "unknown single name": (
        lambda: jmp_amp.get_policy("quarter"),
        ValueError, r"Unknown dtype 'quarter'"),
    "policy of wrong type": (
        lambda: jmp_amp.get_policy(42),
        TypeError, r"policy must be a Policy or a str, got int"),
    "None dtypes (NumPy's float64)": (
        lambda: jmp_amp.Policy(None, None, None),
        TypeError, r"param_dtype must be a floating-point dtype .* got None"),
    "None compute dtype": (
        lambda: jmp_amp.Policy(jnp.float32, None, jnp.float32),
        TypeError, r"compute_dtype must be .* got None \(NumPy would read"),
    "bool dtype": (
        lambda: jmp_amp.Policy(jnp.float32, bool, jnp.float32),
        TypeError, r"compute_dtype must be a floating-point dtype \(bfloat16, "
        r"float16, float32 or float64\) or its name, got bool"),
    "integer dtype": (
        lambda: jmp_amp.Policy(jnp.float32, jnp.float32, np.int8),
        TypeError, r"output_dtype must be a floating-point dtype .* got int8"),
    "complex dtype": (
        lambda: jmp_amp.Policy(jnp.complex64, jnp.float32, jnp.float32),
        TypeError, r"param_dtype must be a floating-point dtype .* got "
        r"complex64"),
    "with_ method validates": (
        lambda: jmp_amp.get_policy("f32").with_compute_dtype(None),
        TypeError, r"compute_dtype must be .* got None"),
}


@pytest.mark.parametrize("case", list(POLICY_CASES))
def test_bad_policy(case):
  _raises(*POLICY_CASES[case])


# --------------------------------------------------------------------------
# Loss scales.

_F32_RANGE = r"float32's normal range \[1.175494e-38, 3.402823e\+38\]"
LOSS_SCALE_CASES = {
    "dynamic int64 beyond int32": (
        lambda: jmp_amp.DynamicLossScale(np.int64(2**40)), ValueError,
        r"DynamicLossScale.loss_scale 1099511627776 \(int64 scalar\) does not "
        r"fit int32, the dtype JAX stores a int64 in .*pass a float"),
    "static zero": (lambda: jmp_amp.StaticLossScale(0), ValueError,
                    r"StaticLossScale.loss_scale must be a finite number > 0, "
                    r"got 0.0; accepted: a real scalar .*" + _F32_RANGE),
    "static negative": (lambda: jmp_amp.StaticLossScale(-4.0), ValueError,
                        r"finite number > 0, got -4.0"),
    "static inf": (lambda: jmp_amp.StaticLossScale(INF), ValueError,
                   r"finite number > 0, got inf"),
    "static nan": (lambda: jmp_amp.StaticLossScale(float("nan")), ValueError,
                   r"finite number > 0, got nan"),
    "static inf in float32": (
        lambda: jmp_amp.StaticLossScale(1e39), ValueError,
        r"StaticLossScale.loss_scale must be a finite number > 0, got 1e\+39 "
        r"\(outside \[1.175494e-38, 3.402823e\+38\]: np.float32\(inf\) in "
        r"float32\)"),
    "static zero in float32": (
        lambda: jmp_amp.StaticLossScale(1e-50), ValueError,
        r"got 1e-50 \(outside .*np.float32\(0.0\) in float32\)"),
    "static subnormal in float32": (
        lambda: jmp_amp.StaticLossScale(1e-40), ValueError, r"got 1e-40"),
    "static bool": (lambda: jmp_amp.StaticLossScale(True), TypeError,
                    r"StaticLossScale.loss_scale must be a real number, got "
                    r"True \(bool\)"),
    "static numpy bool": (
        lambda: jmp_amp.StaticLossScale(np.bool_(True)), TypeError,
        r"must be a real number, got True \(bool scalar\)"),
    "static string": (lambda: jmp_amp.StaticLossScale("1024"), TypeError,
                      r"must be a real number, got '1024' \(str\)"),
    "static complex": (lambda: jmp_amp.StaticLossScale(2 + 0j), TypeError,
                       r"must be a real number, got \(2\+0j\) \(complex\)"),
    "static vector": (
        lambda: jmp_amp.StaticLossScale(np.array([2., 3.])), ValueError,
        r"StaticLossScale.loss_scale must be a scalar, got shape \(2,\): an "
        r"array of shape \(2,\) \(float64\)"),
    "static None": (lambda: jmp_amp.StaticLossScale(None), TypeError,
                    r"must be a real number, got None"),
    "static traced": (
        lambda: jax.jit(lambda s: jmp_amp.StaticLossScale(s).loss_scale)(2.0),
        ValueError, r"StaticLossScale needs a concrete loss_scale"),
    "dynamic zero": (lambda: Dyn(0.0), ValueError,
                     r"loss_scale must be a finite number > 0, got 0.0"),
    "dynamic negative": (lambda: Dyn(-2.0), ValueError,
                         r"loss_scale must be a finite number > 0, got -2.0"),
    "dynamic inf array": (lambda: Dyn(jnp.float32(INF)), ValueError,
                          r"loss_scale must be a finite number > 0, got inf"),
    "dynamic nan array": (lambda: Dyn(np.float32("nan")), ValueError,
                          r"loss_scale must be a finite number > 0, got nan"),
    "dynamic inf in float32": (
        lambda: Dyn(2.0**200), ValueError,
        r"DynamicLossScale.loss_scale must be a finite number > 0, got "
        r"1.6069380442589903e\+60 \(outside .*inf\) in float32\)"),
    "dynamic float64 array inf in float32": (
        lambda: Dyn(np.float64(1e39)), ValueError,
        r"got 1e\+39 \(outside \[1.175494e-38, 3.402823e\+38\]"),
    "dynamic zero in float32 (min 0)": (
        lambda: Dyn(1e-50, min_loss_scale=0), ValueError,
        r"got 1e-50 \(outside .*\(0.0\) in float32\)"),
    "dynamic huge int": (lambda: Dyn(10**400), ValueError,
                         r"must be a finite number > 0, got inf"),
    "dynamic non-scalar": (lambda: Dyn(jnp.ones(2)), ValueError,
                           r"loss_scale must be a scalar, got shape \(2,\)"),
    "dynamic numpy vector": (
        lambda: Dyn(np.full(3, 2.0**15)), ValueError,
        r"DynamicLossScale.loss_scale must be a scalar, got shape \(3,\)"),
    "dynamic shape (1,)": (lambda: Dyn(np.ones(1, np.float32)), ValueError,
                           r"must be a scalar, got shape \(1,\)"),
    "dynamic string": (
        lambda: Dyn("32768"), TypeError,
        r"DynamicLossScale.loss_scale must be a real number, got '32768' "
        r"\(str\); accepted: a real scalar"),
    "dynamic bool": (lambda: Dyn(True), TypeError,
                     r"must be a real number, got True \(bool\)"),
    "dynamic bool array": (
        lambda: Dyn(jnp.bool_(True)), TypeError,
        r"DynamicLossScale.loss_scale must have a real \(floating or integer\)"
        r" dtype, got True \(bool scalar\)"),
    "dynamic complex array": (
        lambda: Dyn(jnp.complex64(2.0)), TypeError,
        r"must have a real \(floating or integer\) dtype, got \(2\+0j\) "
        r"\(complex64 scalar\)"),
    "dynamic float16 inf": (lambda: Dyn(jnp.float16(INF)), ValueError,
                            r"must be a finite number > 0, got inf"),
    "dynamic counter out of range": (
        lambda: Dyn(2.0**15, jnp.int32(2000)), ValueError,
        r"DynamicLossScale.counter must be an integer scalar in \[0, 2000\), "
        r"got 2000 \(int32 scalar\)"),
    "dynamic float counter": (
        lambda: Dyn(2.0**15, jnp.float32(1.0)), ValueError,
        r"counter must be an integer scalar in \[0, 2000\), got 1.0 "
        r"\(float32 scalar\)"),
    "dynamic negative overflows": (
        lambda: Dyn(2.0**15, hysteresis=2, overflows=-1), ValueError,
        r"overflows must be an integer scalar in \[0, 2\), got -1"),
    "validate a restored NaN": (
        lambda: jax.tree_util.tree_map(lambda x: x * np.nan,
                                       Dyn(2.0**15)).validate(),
        ValueError, r"loss_scale must be a finite number > 0, got nan"),
    "period zero": (lambda: Dyn(2.0**15, period=0), ValueError,
                    r"period must be an integer >= 1, got 0"),
    "period fractional": (lambda: Dyn(2.0**15, period=1.5), ValueError,
                          r"period must be an integer >= 1, got 1.5"),
    "period bool": (lambda: Dyn(2.0**15, period=True), ValueError,
                    r"period must be an integer >= 1, got True"),
    "factor one": (lambda: Dyn(2.0**15, factor=1), ValueError,
                   r"factor must be a finite number > 1, got 1"),
    "factor below one": (lambda: Dyn(2.0**15, factor=0.5), ValueError,
                         r"factor must be a finite number > 1, got 0.5"),
    "factor inf": (lambda: Dyn(2.0**15, factor=INF), ValueError,
                   r"factor must be a finite number > 1, got inf"),
    "backoff one": (lambda: Dyn(2.0**15, backoff_factor=1.0), ValueError,
                    r"backoff_factor must be in \(0, 1\).*got 1.0"),
    "backoff zero": (lambda: Dyn(2.0**15, backoff_factor=0.0), ValueError,
                     r"backoff_factor must be in \(0, 1\).*got 0.0"),
    "backoff above one": (lambda: Dyn(2.0**15, backoff_factor=2.0),
                          ValueError, r"backoff_factor must be in \(0, 1\)"),
    "min above max": (
        lambda: Dyn(2.0**4, min_loss_scale=2.0**10, max_loss_scale=2.0**5),
        ValueError, r"min_loss_scale \(1024.0\) must not exceed "
        r"max_loss_scale \(32.0\)"),
    "min negative": (lambda: Dyn(2.0**15, min_loss_scale=-1.0), ValueError,
                     r"min_loss_scale must be a concrete finite number >= 0"),
    "min nan": (lambda: Dyn(2.0**15, min_loss_scale=np.nan), ValueError,
                r"min_loss_scale must be a concrete finite number >= 0, got nan"),
    "max non-positive": (lambda: Dyn(2.0**15, max_loss_scale=0.0), ValueError,
                         r"max_loss_scale must be a number > 0 or None"),
    "hysteresis zero": (lambda: Dyn(2.0**15, hysteresis=0), ValueError,
                        r"hysteresis must be an integer >= 1, got 0"),
    "initial scale above max": (
        lambda: Dyn(2.0**15, max_loss_scale=2.0**10), ValueError,
        r"loss_scale \(32768.0\) must not exceed max_loss_scale \(1024.0\)"),
    "initial scale below min": (
        lambda: Dyn(0.5), ValueError,
        r"loss_scale \(0.5\) must not be below min_loss_scale \(1.0\)"),
    "replace validates": (lambda: Dyn(2.0**15).replace(period=-1), ValueError,
                          r"period must be an integer >= 1, got -1"),
    "dataclasses.replace validates": (
        lambda: dataclasses.replace(Dyn(2.0**15), loss_scale=np.inf),
        ValueError, r"loss_scale must be a finite number > 0, got inf"),
    "immutable": (lambda: setattr(Dyn(2.0**15), "period", 5),
                  dataclasses.FrozenInstanceError,
                  r"cannot assign to field 'period'"),
    "adjust with a vector": (
        lambda: Dyn(2.0**15).adjust(jnp.array([True, False])), ValueError,
        r"grads_finite must be a boolean scalar, got shape \(2,\)"),
}


@pytest.mark.parametrize("case", list(LOSS_SCALE_CASES))
def test_bad_loss_scale(case):
  _raises(*LOSS_SCALE_CASES[case])


# --------------------------------------------------------------------------
# loss_scaling and the state helpers.

PARAMS = {"w": jnp.ones((2, 3)), "b": jnp.zeros((3,))}


def _scaled():
  return jmp_amp.loss_scaling(optax.sgd(0.1), Dyn(2.0**4))


LOSS_SCALING_CASES = {
    "inner not a transformation": (
        lambda: jmp_amp.loss_scaling("adam", jmp_amp.NoOpLossScale()),
        TypeError, r"inner must be an optax.GradientTransformation.*got str"),
    "inner is the factory": (
        lambda: jmp_amp.loss_scaling(optax.adam, jmp_amp.NoOpLossScale()),
        TypeError, r"inner must be an optax.GradientTransformation"),
    "scale is a number": (
        lambda: jmp_amp.loss_scaling(optax.sgd(0.1), 2.0**15), TypeError,
        r"loss_scale must be a jmp_amp NoOpLossScale, StaticLossScale or "
        r"DynamicLossScale, got float"),
    "grads and params differ": (
        lambda: _scaled().update({"w": PARAMS["w"]}, _scaled().init(PARAMS),
                                 PARAMS),
        ValueError, r"gradients and params have different tree structures"),
    "integer gradient leaf": (
        lambda: _scaled().update(
            {"w": PARAMS["w"], "n": jnp.arange(3)}, _scaled().init(
                {"w": PARAMS["w"], "n": jnp.arange(3)})),
        TypeError, r"gradient at \['n'\] has dtype int32; gradients must be "
        r"floating or complex"),
    "boolean gradient leaf": (
        lambda: _scaled().update(
            dict(PARAMS, w=PARAMS["w"] > 0), _scaled().init(PARAMS), PARAMS),
        TypeError, r"gradient at \['w'\] has dtype bool"),
    "gradient of another shape": (
        lambda: _scaled().update(
            dict(PARAMS, w=jnp.ones((1,) + PARAMS["w"].shape)),
            _scaled().init(PARAMS), PARAMS),
        ValueError, r"gradient at \['w'\] has shape \(1, .*but its param has "
        r"shape"),
    "state of another optimizer": (
        lambda: _scaled().update(PARAMS, optax.sgd(0.1).init(PARAMS), PARAMS),
        TypeError, r"expected the LossScalingState made by this "
        r"transformation's init"),
    "get_scaling_state without scaling": (
        lambda: jmp_amp.get_scaling_state(optax.adam(1e-3).init(PARAMS)),
        ValueError, r"No loss_scaling state found in the optimizer state"),
    "scaling wrapped twice": (
        lambda: jmp_amp.get_scaling_state(
            optax.chain(_scaled(), _scaled()).init(PARAMS)),
        ValueError, r"Found 2 loss_scaling states.*exactly once"),
}


@pytest.mark.parametrize("case", list(LOSS_SCALING_CASES))
def test_bad_loss_scaling_use(case):
  _raises(*LOSS_SCALING_CASES[case])


def test_casting_passes_non_float_leaves_through():
  # The decision: a half policy casts floating leaves only; integer, bool and
  # PRNG-key leaves (step counters, masks, RNG state) keep their dtype.
  tree = {"w": jnp.ones(2), "step": jnp.int32(3), "mask": jnp.array([True]),
          "key": jax.random.key(0), "name": "dense"}
  for cast in (jmp_amp.get_policy("p=f32,c=f16").cast_to_compute,
               jmp_amp.cast_to_half,
               jmp_amp.get_policy("bf16").cast_to_param):
    out = cast(tree)
    assert out["w"].dtype in (jnp.float16, jnp.bfloat16)
    assert out["step"].dtype == jnp.int32
    assert out["mask"].dtype == jnp.bool_
    assert out["key"].dtype == tree["key"].dtype
    assert out["name"] == "dense"


# --------------------------------------------------------------------------
# Checkpoints.


@pytest.fixture
def saved(tmp_path):
  checkpoint = pytest.importorskip("jmp_amp.checkpoint")
  opt = jmp_amp.loss_scaling(optax.adam(1e-3), Dyn(2.0**15, period=10))
  state = {"params": PARAMS, "opt_state": opt.init(PARAMS)}
  checkpoint.save(tmp_path, state, step=3)
  return checkpoint, tmp_path, state


def test_checkpoint_missing_directory(tmp_path):
  checkpoint = pytest.importorskip("jmp_amp.checkpoint")
  _raises(lambda: checkpoint.restore(tmp_path / "nope", PARAMS),
          FileNotFoundError, r"no checkpoint directory .*nope")


def test_checkpoint_missing_step(saved):
  checkpoint, path, state = saved
  _raises(lambda: checkpoint.restore(path, state, step=4), FileNotFoundError,
          r"no checkpoint for step 4 .*steps saved: \[3\]")


@pytest.mark.parametrize("step", [-1, 2.5, "3", True])
def test_checkpoint_bad_step(saved, step):
  checkpoint, path, state = saved
  _raises(lambda: checkpoint.save(path, state, step=step), ValueError,
          r"step must be an integer >= 0")


def test_checkpoint_other_policy(saved):
  checkpoint, path, state = saved
  target = {**state, "params": jmp_amp.get_policy("bf16").cast_to_param(PARAMS)}
  with pytest.raises(ValueError,  # a CheckpointError is a ValueError
                     match=r"dtype mismatch \(a different precision "
                     r"policy\?\)[\s\S]*\['params'\]\['w'\]: saved float32, "
                     r"target bfloat16"):
    checkpoint.restore(path, target)


def test_checkpoint_other_loss_scale_hyperparameters(saved):
  checkpoint, path, state = saved
  opt = jmp_amp.loss_scaling(optax.adam(1e-3),
                             Dyn(2.0**15, period=10, backoff_factor=0.25))
  target = {**state, "opt_state": opt.init(PARAMS)}
  _raises(lambda: checkpoint.restore(path, target),
          checkpoint.CheckpointError,
          r"loss scale hyper-parameters differ at \['opt_state'\]\.loss_scale "
          r"\(backoff_factor: saved None, target 0.25\)")


def test_checkpoint_other_optimizer(saved):
  checkpoint, path, state = saved
  target = {**state, "opt_state": optax.adam(1e-3).init(PARAMS)}
  _raises(lambda: checkpoint.restore(path, target),
          checkpoint.CheckpointError,
          r"tree structure differs[\s\S]*in the checkpoint, not in the "
          r"target: \['opt_state'\]")


def test_checkpoint_save_over_existing_step(saved):
  checkpoint, path, state = saved
  _raises(lambda: checkpoint.save(path, state, step=3),
          checkpoint.CheckpointError,
          r"cannot save checkpoint step 3 in .*: step 3 already exists\. "
          r"Pass overwrite=True")
  _raises(lambda: checkpoint.save(path, state, step=2),
          checkpoint.CheckpointError,
          r"step 2 is below the latest step 3")


def test_checkpoint_damaged_metadata(saved):
  checkpoint, path, state = saved
  meta = path / "3" / "jmp_amp" / "metadata"
  meta.write_bytes(meta.read_bytes()[:-20])  # truncated JSON
  _raises(lambda: checkpoint.restore(path, state),
          checkpoint.CheckpointError,
          r"checkpoint step 3 in .* is damaged or incomplete, file "
          r"jmp_amp/metadata: JSONDecodeError")


# --------------------------------------------------------------------------
# Fault-injection helpers.

TESTING_CASES = {
    "unknown fault kind": (
        lambda: jt.inject_nonfinite(jnp.ones(2), 0, jnp.array([0]),
                                    kind="zero"),
        ValueError, r"kind must be one of \('nan', 'inf', '-inf', 'random'\)"),
    "nothing to corrupt": (
        lambda: jt.inject_nonfinite({"i": jnp.arange(3)}, 0, jnp.array([0])),
        ValueError, r"no non-empty floating leaf to corrupt"),
    "vector of flags": (
        lambda: jt.inject_nonfinite(jnp.ones(2), 0, jnp.array([True, False])),
        ValueError, r"a boolean fault_steps must be a scalar"),
    "too many faults": (
        lambda: jt.random_fault_steps(jax.random.key(0), 10, 11),
        ValueError, r"cannot draw 11 distinct fault steps from 10 steps"),
    "start past the end": (
        lambda: jt.random_fault_steps(jax.random.key(0), 10, 1, start=11),
        ValueError, r"start must be in \[0, num_steps=10\], got 11"),
}


@pytest.mark.parametrize("case", list(TESTING_CASES))
def test_bad_fault_injection(case):
  _raises(*TESTING_CASES[case])


# --------------------------------------------------------------------------
# The `jmp-amp bench` CLI: argparse errors exit with status 2 and a message.

BENCH_CASES = [
    (["--model", "nope"], r"argument --model: invalid choice: 'nope'"),
    (["--policy", "bogus"], r"argument --policy: invalid choice: 'bogus'"),
    (["--batch-size", "0"], r"--batch-size: expected a positive integer, "
     r"got 0"),
    (["--steps", "many"], r"--steps: expected a positive integer, got 'many'"),
    (["--lr", "-1"], r"--lr: expected a positive number, got -1"),
    (["--init-scale", "inf"], r"--init-scale: expected a number from 1 to float32.s max .*, got inf"),
    (["--init-scale", "0.5"], r"--init-scale: expected a number from 1 to float32.s max .*, got 0.5"),
    (["--warmup", "-1"], r"--warmup: expected an integer >= 0, got -1"),
    (["--warmup", "5", "--steps", "3"], r"--warmup \(5\) must be smaller "
     r"than the number of steps \(3\)"),
    (["--frobnicate"], r"unrecognized arguments: --frobnicate"),
]


@pytest.mark.parametrize("argv,message", BENCH_CASES,
                         ids=[" ".join(a) for a, _ in BENCH_CASES])
def test_bad_bench_flags(argv, message, capsys):
  bench = pytest.importorskip("jmp_amp.tools.bench.cli")
  with pytest.raises(SystemExit) as exit_info:
    bench.main(["bench", *argv])
  assert exit_info.value.code == 2
  assert re.search(message, capsys.readouterr().err)


# --------------------------------------------------------------------------
# jmp_amp.flax: policy rules and train steps.


@pytest.fixture(scope="module")
def nnx_model():
  nnx = pytest.importorskip("flax.nnx")
  pytest.importorskip("jmp_amp.flax")
  return nnx.Sequential(nnx.Linear(
      2, 2, kernel_init=lambda k, s, d=jnp.float32: jnp.ones(s, d),
      rngs=nnx.Rngs(0)))


FLAX_RULE_CASES = {
    "invalid policy in a rule": (
        {"*": "f33"}, ValueError,
        r"Invalid policy 'f33' for rule '\*': Unknown dtype 'f33'"),
    "rule value of wrong type": (
        {"*": 3}, ValueError,
        r"Rule '\*' has value 3 of type int; expected a jmp_amp.Policy"),
    "rule key of wrong type": (
        {3: "f32"}, TypeError,
        r"Rule key 3 of type int is neither a module class"),
    "empty path segment": (
        {"a//b": "f32"}, ValueError,
        r"Invalid path pattern 'a//b': empty path segment"),
    "unbalanced bracket": (
        {"layers/[0": "f32"}, ValueError,
        r"Invalid path pattern 'layers/\[0': unbalanced '\['"),
    "rules of wrong type": (
        42, TypeError, r"rules must be a mapping .* got int: 42"),
}


@pytest.mark.parametrize("case", list(FLAX_RULE_CASES))
def test_bad_flax_rules(case, nnx_model):
  from jmp_amp import flax as jflax  # pylint: disable=g-import-not-at-top
  rules, exc, match = FLAX_RULE_CASES[case]
  _raises(lambda: jflax.set_policies(nnx_model, rules), exc, match)


def test_flax_strict_rule_that_matches_nothing(nnx_model):
  from jmp_amp import flax as jflax  # pylint: disable=g-import-not-at-top
  _raises(lambda: jflax.set_policies(nnx_model, {"nothing": "f32"},
                                     strict=True),
          ValueError, r"rule 'nothing' .* matched no module")


def test_flax_set_policies_on_a_non_module():
  jflax = pytest.importorskip("jmp_amp.flax")
  _raises(lambda: jflax.set_policies({"w": 1}, "f32"), TypeError,
          r"set_policies expects an nnx.Module, got dict")


@pytest.mark.parametrize("kwargs,exc,match", [
    ({"loss_fn": 3}, TypeError, r"loss_fn must be callable, got 3"),
    ({"loss_fn": lambda m, b: 0.0, "autocast": 3}, TypeError,
     r"autocast must be None, a policy .* got 3"),
])
def test_bad_flax_train_step(kwargs, exc, match):
  jflax = pytest.importorskip("jmp_amp.flax")
  loss_fn = kwargs.pop("loss_fn")
  _raises(lambda: jflax.make_train_step(loss_fn, **kwargs), exc, match)
  _raises(lambda: jflax.make_linen_train_step(loss_fn, **kwargs), exc, match)
