"""Adversarial inputs across the public API and the CLI (issue #13).

Each case is an input an adversarial (or hurried) user could give, with the
outcome the library must produce: a clear error -- the exception type and a
message fragment that names the argument and the value -- or, where the input
is legal, the correct behaviour. Never a silently wrong result, never a raw
crash from deep inside jax, orbax or argparse.

`docs/reliability.md` counts these cases by outcome. Cases whose validation
lives in another module than `jmp_amp.checkpoint` are marked
``xfail(strict=True, reason="needs <branch>")`` until that branch lands: the
strict mark makes a passing case fail, so the mark is removed on merge.
"""

import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_amp
from jmp_amp import testing as jt

ocp = pytest.importorskip("orbax.checkpoint")
from jmp_amp import checkpoint  # pylint: disable=g-import-not-at-top

Dyn = jmp_amp.DynamicLossScale
Static = jmp_amp.StaticLossScale
PARAMS = {"w": jnp.ones((2, 3)), "b": jnp.zeros((3,))}


def names(*fragments):
  """A regex matching a message that contains every fragment, in any order."""
  return "".join(f"(?=[\\s\\S]*{f})" for f in fragments)


def needs(branch):
  return pytest.mark.xfail(strict=True, reason=f"needs {branch}")


def _state(scale=None):
  opt = jmp_amp.loss_scaling(optax.adam(1e-3),
                             scale or Dyn(2.0**15, period=10))
  return {"params": PARAMS, "opt_state": opt.init(PARAMS)}


def _mkdir(path):
  os.makedirs(path, exist_ok=True)
  return path


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
  """A directory with checkpoints at steps 3 and 5 of `_state()`."""
  path = tmp_path_factory.mktemp("adversarial")
  checkpoint.save(path, _state(), step=3)
  checkpoint.save(path, _state(), step=5)
  return path


# --------------------------------------------------------------------------
# Clear errors: (call, exception type, message regex[, mark]).
# `call` takes the checkpoint directory fixture (unused by most).

S = _state()

ERROR_CASES = {
    # ---- jmp_amp.checkpoint --------------------------------------------------
    "save: directory None": (
        lambda d: checkpoint.save(None, S, step=1), TypeError,
        names("directory must be a str or os.PathLike", "NoneType")),
    "save: directory an int": (
        lambda d: checkpoint.save(3, S, step=1), TypeError,
        names("directory must be", "int: 3")),
    "save: negative step": (
        lambda d: checkpoint.save(d / "new", S, step=-1), ValueError,
        names("step must be an integer >= 0", "-1")),
    "save: fractional step": (
        lambda d: checkpoint.save(d / "new", S, step=2.5), ValueError,
        names("step must be an integer >= 0", "2.5")),
    "save: step as a string": (
        lambda d: checkpoint.save(d / "new", S, step="3"), ValueError,
        names("step must be an integer >= 0", "'3'")),
    "save: step True": (
        lambda d: checkpoint.save(d / "new", S, step=True), ValueError,
        names("step must be an integer >= 0", "True")),
    "save: negative numpy step": (
        lambda d: checkpoint.save(d / "new", S, step=np.int64(-2)), ValueError,
        names("step must be an integer >= 0", "-2")),
    "save: over an existing step": (
        lambda d: checkpoint.save(d, S, step=5), checkpoint.CheckpointError,
        names("step 5 already exists", "overwrite=True")),
    "save: below the latest step": (
        lambda d: checkpoint.save(d, S, step=4), checkpoint.CheckpointError,
        names("step 4 is below the latest step 5", "overwrite=True")),
    "save: overwrite='yes'": (
        lambda d: checkpoint.save(d, S, step=9, overwrite="yes"), TypeError,
        names("overwrite must be True or False", "str: 'yes'")),
    "save: a str leaf": (
        lambda d: checkpoint.save(d / "new", {"a": "text"}, step=1), TypeError,
        names(r"state leaf \['a'\] is a str", "'text'", "arrays")),
    "save: an object leaf": (
        lambda d: checkpoint.save(d / "new", {"a": object()}, step=1),
        TypeError, names(r"state leaf \['a'\] is a object")),
    "save: state None": (
        lambda d: checkpoint.save(d / "new", None, step=1), ValueError,
        names("state has no arrays to save", "NoneType")),
    "save: empty state": (
        lambda d: checkpoint.save(d / "new", {}, step=1), ValueError,
        names("state has no arrays to save", "dict")),
    "save: directory is a file": (
        lambda d: checkpoint.save(d / "5" / "_CHECKPOINT_METADATA", S, step=1),
        NotADirectoryError, names("_CHECKPOINT_METADATA", "is not a directory")),
    "manager: max_to_keep=0": (
        lambda d: checkpoint.CheckpointManager(d, max_to_keep=0), ValueError,
        names("max_to_keep must be an integer >= 1 or None", "got 0")),
    "manager: save_interval_steps=0": (
        lambda d: checkpoint.CheckpointManager(d, save_interval_steps=0),
        ValueError, names("save_interval_steps must be an integer >= 1",
                          "got 0")),
    "manager: async_save='no'": (
        lambda d: checkpoint.CheckpointManager(d, async_save="no"), TypeError,
        names("async_save must be True or False", "'no'")),
    "restore: missing directory": (
        lambda d: checkpoint.restore(d / "nope", S), FileNotFoundError,
        names("no checkpoint directory", "nope")),
    "restore: empty directory": (
        lambda d: checkpoint.restore(_mkdir(d / "empty"), S),
        FileNotFoundError, names("no checkpoint in", "empty")),
    "restore: missing step": (
        lambda d: checkpoint.restore(d, S, step=4), FileNotFoundError,
        names("no checkpoint for step 4", r"steps saved: \[3, 5\]")),
    "restore: directory None": (
        lambda d: checkpoint.restore(None, S), TypeError,
        names("directory must be a str or os.PathLike", "NoneType")),
    "restore: cast_dtypes=1": (
        lambda d: checkpoint.restore(d, S, cast_dtypes=1), TypeError,
        names("cast_dtypes must be True or False", "int: 1")),
    "restore: fallback='yes'": (
        lambda d: checkpoint.restore(d, S, fallback="yes"), TypeError,
        names("fallback must be True or False", "'yes'")),
    "restore: verify=None": (
        lambda d: checkpoint.restore(d, S, verify=None), TypeError,
        names("verify must be True or False", "None")),
    "restore: target None": (
        lambda d: checkpoint.restore(d, None), checkpoint.CheckpointError,
        names("tree structure differs", "in the checkpoint, not in the target")),
    "restore: target a str": (
        lambda d: checkpoint.restore(d, "state"), TypeError,
        names("state leaf <root> is a str", "'state'")),
    "restore: bfloat16 params": (
        lambda d: checkpoint.restore(d, {**S, "params": jmp_amp.get_policy("bf16").cast_to_param(
            PARAMS)}), checkpoint.CheckpointError,
        names("dtype mismatch", r"\['params'\]\['w'\]: saved float32, target "
              "bfloat16")),
    "restore: another optimizer": (
        lambda d: checkpoint.restore(d, {**S, "opt_state": optax.sgd(
            0.1).init(PARAMS)}), checkpoint.CheckpointError,
        names("tree structure differs", r"\['opt_state'\]")),
    "restore: another period": (
        lambda d: checkpoint.restore(d, _state(Dyn(2.0**15, period=11))),
        checkpoint.CheckpointError,
        names("loss scale hyper-parameters differ", "period: saved 10, "
              "target 11")),
    "restore: a static loss scale": (
        lambda d: checkpoint.restore(d, _state(Static(2.0**15))),
        checkpoint.CheckpointError,
        names(r"saved DynamicLossScale\(", r"target StaticLossScale")),
    "restore: wider params": (
        lambda d: checkpoint.restore(d, {**S, "params": {
            **PARAMS, "b": jnp.zeros(4)}}), checkpoint.CheckpointError,
        names("shape mismatch", r"saved float32\[3\], target float32\[4\]")),
    "restore_latest: directory an int": (
        lambda d: checkpoint.restore_latest(7, S), TypeError,
        names("directory must be", "int: 7")),
    "latest_step: directory a list": (
        lambda d: checkpoint.latest_step(["a"]), TypeError,
        names("directory must be", r"list: \['a'\]")),

    # ---- policies ------------------------------------------------------------
    "Policy(None, None, None)": (
        lambda d: jmp_amp.Policy(None, None, None), TypeError,
        names("param_dtype", "None")),
    "Policy with an integer dtype": (
        lambda d: jmp_amp.Policy(jnp.float32, jnp.int8, jnp.float32),
        TypeError, names("compute_dtype must be a floating-point dtype",
                         "int8")),
    "Policy with a complex dtype": (
        lambda d: jmp_amp.Policy(jnp.float32, jnp.float32, jnp.complex64),
        TypeError, names("output_dtype must be a floating-point dtype",
                         "complex64")),
    "Policy with an unknown name": (
        lambda d: jmp_amp.Policy("f32", "half-ish", "f32"), ValueError,
        names("compute_dtype", "half-ish")),
    "get_policy(None)": (
        lambda d: jmp_amp.get_policy(None), TypeError,
        names("policy must be a Policy or a str", "NoneType")),
    "get_policy of a dtype object": (
        lambda d: jmp_amp.get_policy(jnp.float16), TypeError,
        names("policy must be a Policy or a str")),
    "get_policy('')": (
        lambda d: jmp_amp.get_policy(""), ValueError,
        names("Unknown dtype ''", "Accepted")),
    "get_policy: unknown key": (
        lambda d: jmp_amp.get_policy("p=f32,x=f16"), ValueError,
        names("Unknown key 'x'", "keys are 'params'")),
    "get_policy: empty value": (
        lambda d: jmp_amp.get_policy("p="), ValueError,
        names("Unknown dtype ''", "'p='")),
    "get_policy: int4 is not a float dtype": (
        lambda d: jmp_amp.get_policy("c=int4"), ValueError,
        names("Unknown dtype 'int4'")),

    # ---- loss scales ---------------------------------------------------------
    "DynamicLossScale(2**200): inf in float32": (
        lambda d: Dyn(2.0**200), ValueError,
        names("loss_scale", "float32")),
    "StaticLossScale(1e39): inf in float32": (
        lambda d: Static(1e39), ValueError,
        names("loss_scale", "float32")),
    "DynamicLossScale(1e-50, min_loss_scale=0): 0 in float32": (
        lambda d: Dyn(1e-50, min_loss_scale=0), ValueError,
        names("loss_scale", "float32")),
    "StaticLossScale(True)": (
        lambda d: Static(True), TypeError,
        names("loss_scale", "bool")),
    "DynamicLossScale(True)": (
        lambda d: Dyn(True), TypeError,
        names("loss_scale", "bool")),
    "DynamicLossScale of a NumPy vector": (
        lambda d: Dyn(np.full(3, 2.0**15)), ValueError,
        names("loss_scale", "scalar", r"\(3,\)")),
    "StaticLossScale of a NumPy vector": (
        lambda d: Static(np.array([2.0, 3.0])), ValueError,
        names("loss_scale", "scalar", r"\(2,\)")),
    "DynamicLossScale('32768')": (
        lambda d: Dyn("32768"), TypeError,
        names("loss_scale", "str", "'32768'")),
    "StaticLossScale('2')": (
        lambda d: Static("2"), TypeError,
        names("loss_scale", "str")),
    "DynamicLossScale(nan)": (
        lambda d: Dyn(float("nan")), ValueError,
        names("loss_scale must be a finite number > 0", "nan")),
    "DynamicLossScale(-inf array)": (
        lambda d: Dyn(jnp.float32(-math.inf)), ValueError,
        names("loss_scale must be a finite number > 0", "-inf")),
    "StaticLossScale(0)": (
        lambda d: Static(0), ValueError,
        names("loss_scale must be a finite number > 0", "0.0")),
    "DynamicLossScale period=True": (
        lambda d: Dyn(2.0**15, period=True), ValueError,
        names("period must be an integer >= 1", "True")),
    "DynamicLossScale period='10'": (
        lambda d: Dyn(2.0**15, period="10"), ValueError,
        names("period must be an integer >= 1", "'10'")),
    "DynamicLossScale factor=nan": (
        lambda d: Dyn(2.0**15, factor=float("nan")), ValueError,
        names("factor must be a finite number > 1", "nan")),
    "DynamicLossScale hysteresis=2.5": (
        lambda d: Dyn(2.0**15, hysteresis=2.5), ValueError,
        names("hysteresis must be an integer >= 1", "2.5")),
    "DynamicLossScale max below min": (
        lambda d: Dyn(2.0, min_loss_scale=4.0, max_loss_scale=2.0), ValueError,
        names("min_loss_scale", "max_loss_scale")),

    # ---- loss_scaling and the state helpers ----------------------------------
    "loss_scaling(skip_nonfinite='no')": (
        lambda d: jmp_amp.loss_scaling(optax.sgd(0.1), Dyn(2.0**15),
                                       skip_nonfinite="no"), TypeError,
        names("skip_nonfinite", "'no'")),
    "loss_scaling(skip_nonfinite=None)": (
        lambda d: jmp_amp.loss_scaling(optax.sgd(0.1), Dyn(2.0**15),
                                       skip_nonfinite=None), TypeError,
        names("skip_nonfinite", "None")),
    "loss_scaling with a jmp-style float scale": (
        lambda d: jmp_amp.loss_scaling(optax.sgd(0.1), 32768.0), TypeError,
        names("loss_scale must be a jmp_amp", "float")),
    "loss_scaling with inner None": (
        lambda d: jmp_amp.loss_scaling(None, Dyn(2.0**15)), TypeError,
        names("inner must be an optax.GradientTransformation", "NoneType")),
    "update with a foreign state": (
        lambda d: jmp_amp.loss_scaling(optax.sgd(0.1), Dyn(2.0**4)).update(
            PARAMS, None, PARAMS), TypeError,
        names("expected the LossScalingState", "NoneType")),
    "get_scaling_state of a dict": (
        lambda d: jmp_amp.get_scaling_state({"a": 1}), ValueError,
        names("No loss_scaling state found", "dict")),

    # ---- fault-injection helpers ---------------------------------------------
    "inject_nonfinite kind='zero'": (
        lambda d: jt.inject_nonfinite(jnp.ones(2), 0, jnp.array([0]),
                                      kind="zero"), ValueError,
        names("kind must be one of", "'nan'")),
    "random_fault_steps: too many": (
        lambda d: jt.random_fault_steps(jax.random.key(0), 5, 6), ValueError,
        names("cannot draw 6 distinct fault steps from 5 steps")),
}


def _case_params(cases):
  out = []
  for name, case in cases.items():
    marks = case[3:] if len(case) > 3 else ()
    out.append(pytest.param(*case[:3], marks=marks, id=name))
  return out


@pytest.mark.parametrize("call,exc,match", _case_params(ERROR_CASES))
def test_clear_error(call, exc, match, ckpt_dir):
  with pytest.raises(exc, match=match):
    call(ckpt_dir)


# --------------------------------------------------------------------------
# The `jmp-amp bench` CLI: a bad flag exits with status 2 and names itself,
# before any benchmark runs.

CLI_CASES = {
    "--seed -3": (["--seed", "-3"], names("--seed", "-3")),
    "--seed abc": (["--seed", "abc"], names("--seed", "abc")),
    "--seed 1.5": (["--seed", "1.5"], names("--seed", "1.5")),
    "--json into a missing directory": (
        ["--json", "/missing/dir/x.jsonl"],
        names("--json", "/missing/dir")),
    "--plot into a missing directory": (
        ["--plot", "/missing/dir/x.png"],
        names("--plot", "/missing/dir")),
    "--init-scale 1e39 (inf in float32)": (
        ["--init-scale", "1e39"], names("--init-scale", "1e39")),
    "--init-scale nan": (["--init-scale", "nan"],
                         names("--init-scale", "nan")),
    "--init-scale 0": (["--init-scale", "0"], names("--init-scale", "got 0")),
    "--lr nan": (["--lr", "nan"], names("--lr", "nan")),
    "--lr 0": (["--lr", "0"], names("--lr", "positive")),
    "--steps 0": (["--steps", "0"], names("--steps", "positive integer")),
    "--steps -5": (["--steps", "-5"], names("--steps", "-5")),
    "--width 1.5": (["--width", "1.5"], names("--width", "1.5")),
    "--batch-size ''": (["--batch-size", ""], names("--batch-size", "''")),
    "--layers 0": (["--layers", "0"], names("--layers", "got 0")),
    "--warmup -1": (["--warmup", "-1"], names("--warmup", "-1")),
    "--warmup >= --steps": (["--warmup", "4", "--steps", "4"],
                            names("--warmup", "4")),
    "--policy float64": (["--policy", "float64"],
                         names("--policy", "invalid choice", "float64")),
    "--model nope": (["--model", "nope"], names("--model", "'nope'")),
    "--recipe nope": (["--recipe", "nope"], names("--recipe", "'nope'")),
    "unknown flag": (["--fast"], names("unrecognized arguments", "--fast")),
}


@pytest.mark.parametrize(
    "argv,match",
    [pytest.param(c[0], c[1], marks=c[2:], id=n) for n, c in CLI_CASES.items()])
def test_cli_rejects(argv, match, capsys, monkeypatch):
  bench = pytest.importorskip("jmp_amp.tools.bench.cli")

  def must_not_run(*args, **kwargs):
    raise AssertionError(f"bench ran with bad flags {argv}")
  monkeypatch.setattr(bench, "run", must_not_run, raising=False)
  with pytest.raises(SystemExit) as info:
    bench.main(["bench", *argv])
  assert info.value.code == 2
  assert re.search(match, capsys.readouterr().err)


# --------------------------------------------------------------------------
# jmp_amp.flax rules.

FLAX_CASES = {
    "rule value a float": ({"*": 1.5}, ValueError,
                           names("Rule '\\*' has value 1.5", "float")),
    "rule value an unknown dtype": ({"*": "f12"}, ValueError,
                                    names("Invalid policy 'f12'", "'\\*'")),
    "rule key None": ({None: "f32"}, TypeError,
                      names("Rule key None", "NoneType")),
    "pattern with an empty segment": ({"a//b": "f32"}, ValueError,
                                      names("'a//b'", "empty path segment")),
    "rules a list": (["f32"], TypeError, names("rules must be a mapping",
                                               "list")),
}


@pytest.mark.parametrize(
    "rules,exc,match",
    [pytest.param(*c, id=n) for n, c in FLAX_CASES.items()])
def test_flax_rules_reject(rules, exc, match):
  nnx = pytest.importorskip("flax.nnx")
  jflax = pytest.importorskip("jmp_amp.flax")
  model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
  with pytest.raises(exc, match=match):
    jflax.set_policies(model, rules)


def test_flax_set_policies_on_a_linen_module():
  nn = pytest.importorskip("flax.linen")
  jflax = pytest.importorskip("jmp_amp.flax")
  with pytest.raises(TypeError, match=names("expects an nnx.Module",
                                            "Dense", "linen")):
    jflax.set_policies(nn.Dense(2), "f32")


# --------------------------------------------------------------------------
# Correct behaviour: legal but unusual inputs.


def test_overwrite_true_replaces_the_step(tmp_path):
  checkpoint.save(tmp_path, S, step=2)
  new = {**S, "params": jax.tree_util.tree_map(lambda x: x + 1, PARAMS)}
  checkpoint.save(tmp_path, new, step=2, overwrite=True)
  restored = checkpoint.restore(tmp_path, S)
  np.testing.assert_array_equal(restored["params"]["w"], np.full((2, 3), 2.0))


def test_integer_scale_never_reaches_zero():
  # int32 scale, floor 0: two overflows must not make it 0 (unscale -> inf).
  with pytest.warns(UserWarning):
    ls = Dyn(jnp.int32(4), min_loss_scale=0, factor=4)
  for _ in range(3):
    ls = ls.adjust(jnp.array(False))
  assert int(ls.loss_scale) >= 1
  assert bool(jnp.all(jnp.isfinite(ls.unscale(jnp.ones(2)))))


def test_complex_gradients_are_unscaled_or_refused():
  params = {"z": jnp.ones(2, jnp.complex64)}
  opt = jmp_amp.loss_scaling(optax.sgd(1.0), Static(2.0**15))
  grads = {"z": jnp.full(2, 2.0**15 * (1 + 1j), jnp.complex64)}
  try:
    updates, _ = opt.update(grads, opt.init(params), params)
  except TypeError as e:
    assert "complex" in str(e)
    return
  np.testing.assert_allclose(updates["z"], np.full(2, -(1 + 1j)), rtol=1e-6)


def test_nonfinite_loss_with_finite_grads_is_applied_like_torch():
  # The documented decision: like torch.amp.GradScaler, only the gradients
  # decide whether a step is skipped.
  opt = jmp_amp.loss_scaling(optax.sgd(1.0), Static(1.0))
  updates, state = opt.update({"w": jnp.ones(2)}, opt.init({"w": jnp.ones(2)}))
  assert bool(state.grads_finite)
  np.testing.assert_array_equal(updates["w"], -np.ones(2))


def test_restored_nan_scale_is_refused(tmp_path):
  state = _state()
  bad = jax.tree_util.tree_map(lambda x: x, state)
  leaves, treedef = jax.tree_util.tree_flatten(bad["opt_state"].loss_scale)
  leaves[0] = jnp.float32(np.nan)
  bad["opt_state"] = bad["opt_state"]._replace(
      loss_scale=jax.tree_util.tree_unflatten(treedef, leaves))
  checkpoint.save(tmp_path, bad, step=1)
  with pytest.raises(checkpoint.CheckpointError,
                     match=names("step 1", "loss_scale is nan")):
    checkpoint.restore(tmp_path, state)


def test_nan_scale_built_under_jit_is_caught_on_restore(tmp_path):
  # A traced scale cannot be checked at construction; the checkpoint check
  # catches it before a resumed run would skip every step.
  make = jax.jit(lambda s: Dyn(s, period=10))
  state = _state(make(jnp.float32(np.nan)))
  checkpoint.save(tmp_path, state, step=1)
  with pytest.raises(checkpoint.CheckpointError, match="nan"):
    checkpoint.restore(tmp_path, _state())
