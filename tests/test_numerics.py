"""Numerics telemetry and the localiser of the first inf/NaN (issue 26).

The fault suite: float16-only faults (`jmp_amp.testing.precision_fault`:
inf in a `mul`, NaN in a `div`, in the forward value or in the gradient)
put into one module of the MLP, ResNet and GPT through its op knob; the
localiser must name that module, that op and that direction, and the float32
rule it suggests must remove every inf/NaN. The fast subset covers each
kind and direction once; the rest is marked slow.
"""

from __future__ import annotations

import functools
import re
import warnings

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_amp
from jmp_amp import models
import jmp_amp.flax
import jmp_amp.flax.numerics as fnum
import jmp_amp.numerics
import jmp_amp.testing

F16_RULES = jmp_amp.flax.mixed_rules("float16")
OP = {"overflow": "mul", "nan": "div"}


# --------------------------------------------------------------------------
# The models and where a fault goes.


def _mlp():
  model = models.MLP(8, 4, 3, width=16, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (4, 8))
  y = jax.random.normal(jax.random.key(2), (4, 4))
  loss = lambda m, b: jnp.mean((m(b[0]).astype(jnp.float32) - b[1]) ** 2)
  return model, loss, (x, y)


def _gpt():
  # The attention written out: faults go through its einsum_op knob.
  model = models.GPT(vocab_size=16, d_model=8, num_heads=2, num_layers=2,
                     max_len=6, attention="einsum", rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 6), 0, 16)
  return model, lambda m, t: models.lm_loss(m(t), t), tokens


def _resnet():
  # Two blocks of one stage, one width: fewer distinct shapes than two
  # stages, so fewer ops for the localiser's replay to compile (a case
  # took a third less).
  model = models.ResNet((2,), base_width=4, num_classes=3, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (2, 8, 8, 3))
  labels = jnp.array([0, 2])
  return model, (lambda m, b: models.cross_entropy_loss(
      m(b[0]).astype(jnp.float32), b[1])), (x, labels)


MODELS = {"mlp": _mlp, "gpt": _gpt, "resnet": _resnet}
# (model, module path, knob the fault goes through).
SITES = [
    ("mlp", "layers/0", "dot_general"),
    ("mlp", "layers/1", "dot_general"),
    ("mlp", "layers/2", "dot_general"),
    ("gpt", "blocks/0/attn", "einsum_op"),
    ("gpt", "blocks/1/attn/qkv", "dot_general"),
    ("gpt", "blocks/0/mlp/fc", "dot_general"),
    ("resnet", "stem", "conv_general_dilated"),
    ("resnet", "blocks/1/conv2", "conv_general_dilated"),
    ("resnet", "head", "dot_general"),
]
KNOB_DEFAULT = {"dot_general": jax.lax.dot_general,
                "conv_general_dilated": jax.lax.conv_general_dilated,
                "einsum_op": jnp.einsum}
FAULTS = [(kind, backward) for kind in ("overflow", "nan")
          for backward in (False, True)]
FAST = {("mlp", "layers/1", "overflow", False), ("mlp", "layers/2", "nan",
                                                   True)}
# The fault each GPT and ResNet site goes without: a case of theirs compiles
# the model twice (the localiser's capture run, the re-run with the rule),
# seconds each; an MLP's compiles take a fraction of one. Each site keeps
# both kinds and both directions, and each model, its sites together, all
# four faults: 3 x 4 + 6 x 3 = 30 faults.
LEFT_OUT = {("gpt", "blocks/0/attn"): ("overflow", True),
            ("gpt", "blocks/1/attn/qkv"): ("nan", False),
            ("gpt", "blocks/0/mlp/fc"): ("nan", True),
            ("resnet", "stem"): ("nan", True),
            ("resnet", "blocks/1/conv2"): ("overflow", True),
            ("resnet", "head"): ("nan", False)}


def _module(model, path):
  for p, m in nnx.iter_modules(model):
    if "/".join(str(x) for x in p) == path:
      return m
  raise KeyError(path)


def _cases():
  for name, path, knob in SITES:
    for kind, backward in FAULTS:
      if LEFT_OUT.get((name, path)) == (kind, backward):
        continue
      marks = () if (name, path, kind, backward) in FAST else (
          pytest.mark.slow,)
      yield pytest.param(name, path, knob, kind, backward, marks=marks,
                         id=f"{name}-{path}-{kind}-"
                         f"{'bwd' if backward else 'fwd'}")


def test_the_fault_suite_has_at_least_30_faults():
  cases = [c.values for c in _cases()]
  assert len(cases) >= 30
  for name, path, _ in SITES:  # both kinds, both directions at every site
    faults = {(k, b) for n, p, _, k, b in cases if (n, p) == (name, path)}
    assert {k for k, _ in faults} == set(OP), (name, path)
    assert {b for _, b in faults} == {False, True}, (name, path)
  for name in MODELS:  # and every fault in every model
    assert {(k, b) for n, _, _, k, b in cases if n == name} == set(FAULTS)


@pytest.mark.parametrize("name,path,knob,kind,backward", list(_cases()))
def test_localiser_names_module_op_and_the_rule_fixes_it(
    name, path, knob, kind, backward):
  model, loss_fn, batch = MODELS[name]()
  setattr(_module(model, path), knob, jmp_amp.testing.precision_fault(
      KNOB_DEFAULT[knob], kind, backward=backward))
  jmp_amp.flax.set_policies(model, F16_RULES)
  report = jmp_amp.numerics.find_nonfinite(
      loss_fn, model, batch, rules=F16_RULES, loss_scale=2.0 ** 4)
  assert report is not None
  assert (report.module, report.primitive, report.direction) == (
      path, OP[kind], "backward" if backward else "forward"), str(report)
  assert "float16" in report.in_dtypes
  assert report.suggested_rule == {path: "float32"}
  assert report.fixed is True, str(report)
  assert "jmp_amp/testing.py" in report.source or backward


@pytest.mark.slow
def test_a_clean_model_has_no_report_and_a_fault_in_float32_fires_not():
  model, loss_fn, batch = _mlp()
  model.layers[1].dot_general = jmp_amp.testing.precision_fault(
      jax.lax.dot_general, "overflow")
  # float32: the fault does not fire.
  assert jmp_amp.numerics.find_nonfinite(loss_fn, model, batch) is None
  clean, loss_fn, batch = _mlp()
  jmp_amp.flax.set_policies(clean, F16_RULES)
  assert jmp_amp.numerics.find_nonfinite(loss_fn, clean, batch) is None


@pytest.mark.slow
def test_fixed_says_whether_the_rule_removed_every_inf_nan():
  model, loss_fn, (x, y) = _mlp()
  jmp_amp.flax.set_policies(model, F16_RULES)
  batch = (x.at[0, 0].set(1e5), y)  # inf once cast to float16 in layers/0.
  report = jmp_amp.numerics.find_nonfinite(loss_fn, model, batch,
                                           rules=F16_RULES)
  assert (report.module, report.primitive) == ("layers/0",
                                               "convert_element_type")
  assert report.max_finite == pytest.approx(1e5)
  # What the rule does, checked independently: layers/0 in float32 passes
  # values beyond float16's range on to layers/1, still float16.
  fixed = nnx.clone(model)
  jmp_amp.flax.set_policies(fixed, F16_RULES | report.suggested_rule)
  loss, grads = nnx.value_and_grad(loss_fn)(fixed, batch)
  expected = bool(jnp.isfinite(loss)) and all(
      bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))
  assert report.fixed is expected
  assert str(report).count("does NOT remove" if not expected else
                           "removes every") == 1


def test_linen_model_localised_and_verified():
  module = models.LinenMLP(16, 4, 2, width=8)
  x = jnp.full((2, 16), 6e4)  # finite in float16; the first layer's product not
  variables = module.init(jax.random.key(0), x)
  loss_fn = lambda net, x: jnp.mean(net(x).astype(jnp.float32))
  report = jmp_amp.numerics.find_nonfinite(
      loss_fn, module, x, variables=variables, rules="mixed_float16")
  first = sorted(variables["params"])[0]
  assert (report.module, report.primitive, report.direction) == (
      first, "dot_general", "forward"), str(report)
  assert report.suggested_rule == {first: "float32"}
  y = jmp_amp.flax.apply_with_policies(
      module, {"*": "mixed_float16", first: "float32"}, variables, x)
  assert report.fixed is bool(jnp.isfinite(y).all())
  with pytest.raises(TypeError, match="variables"):
    jmp_amp.numerics.find_nonfinite(loss_fn, module, x)


# --------------------------------------------------------------------------
# The localiser on plain functions.


def test_plain_function_forward_and_backward():
  def f(x):
    with jax.named_scope("scores"):
      s = x * 300.0
    with jax.named_scope("out"):
      return jnp.sum(jnp.sqrt(s))

  fwd = jmp_amp.numerics.find_nonfinite(
      f, jnp.array([1.0, 300.0], jnp.float16))
  assert (fwd.primitive, fwd.direction, fwd.module) == ("mul", "forward",
                                                        "scores")
  assert fwd.max_finite == 300.0 and fwd.outputs == ("inf",)
  # sqrt'(0) is inf: only the gradient goes non-finite.
  bwd = jmp_amp.numerics.find_nonfinite(f, jnp.array([0.0, 1.0]))
  assert (bwd.direction, bwd.module) == ("backward", "out"), str(bwd)
  assert jmp_amp.numerics.find_nonfinite(
      f, jnp.array([0.0, 1.0]), backward=False) is None
  assert "test_numerics.py" in bwd.source


def test_nonfinite_inputs_are_reported_as_inputs_not_blamed_on_an_op():
  # (#35) A NaN already in an argument was "nothing went non-finite".
  f = lambda p, b: jnp.sum(p["w"] * b["x"])
  r = jmp_amp.numerics.find_nonfinite(
      f, {"w": jnp.ones(2)}, {"x": jnp.array([3.0, jnp.nan], jnp.float16)})
  assert (r.direction, r.primitive, r.argument, r.module) == (
      "input", "input", "args[1]['x']", None)
  assert r.outputs == ("nan",) and r.out_dtypes == ("float16[2]",)
  assert r.max_finite == 3.0
  assert str(r) == ("first non-finite value: input args[1]['x'] "
                    "(float16[2]: nan), non-finite before any op ran; "
                    "largest finite |x| in it = 3")


def test_a_nonfinite_constant_the_function_captured_is_an_input():
  w = jnp.array([1.0, jnp.inf])
  r = jmp_amp.numerics.find_nonfinite(lambda x: jnp.sum(w * x), jnp.ones(2))
  assert (r.direction, r.argument, r.outputs) == (
      "input", "a constant captured by fn", ("inf",))


def test_flax_find_nonfinite_reports_a_nan_param_with_its_module_path():
  model, loss_fn, batch = _mlp()
  assert jmp_amp.numerics.find_nonfinite(loss_fn, model, batch) is None
  kernel = model.layers[1].kernel
  kernel[...] = kernel[...].at[0, 0].set(jnp.nan)
  r = jmp_amp.numerics.find_nonfinite(loss_fn, model, batch)
  assert (r.direction, r.module, r.argument, r.outputs) == (
      "input", "layers/1", "params layers/1/kernel", ("nan",))
  assert r.suggested_rule is None and r.fixed is None


def test_flax_find_nonfinite_reports_a_nan_batch():
  model, loss_fn, (x, y) = _mlp()
  r = jmp_amp.numerics.find_nonfinite(loss_fn, model,
                                      (x.at[1, 2].set(jnp.inf), y))
  assert (r.direction, r.module, r.argument) == ("input", None, "batch[0]")


def test_flax_find_nonfinite_linen_variables():
  module = models.LinenMLP(8, 4, 2, width=16)
  x = jnp.ones((2, 8))
  variables = module.init(jax.random.key(0), x)
  params = jax.tree.map(lambda a: a, dict(variables["params"]))
  name = sorted(params)[-1]
  params[name] = dict(params[name], bias=params[name]["bias"].at[0].set(
      jnp.nan))
  r = jmp_amp.numerics.find_nonfinite(
      lambda m, b: jnp.mean(m(b)), module, x, variables={"params": params})
  assert (r.direction, r.module, r.argument) == (
      "input", name, f"variables['params']['{name}']['bias']")


def test_enters_jit_and_custom_jvp():
  inner = jax.jit(lambda x: jnp.exp(x) * 2)
  r = jmp_amp.numerics.find_nonfinite(
      lambda x: jnp.sum(jax.nn.relu(inner(x))), jnp.float16(12.0))
  assert (r.primitive, r.direction) == ("exp", "forward")


def test_enters_checkpoint_the_cond_branch_taken_and_each_scan_step():
  # A user's rematerialised block, run by a scan and under a cond; the
  # third step's product overflows float16.
  @jax.checkpoint
  def block(c, x):
    with jax.named_scope("block"):
      y = c * x
    return y / 2, y

  def f(xs, which):
    run = lambda xs: jax.lax.scan(block, jnp.float16(1.0), xs)[1]
    return jnp.sum(jax.lax.cond(which, run, lambda xs: xs, xs))

  xs = jnp.array([300.0, 200.0, 400.0], jnp.float16)
  r = jmp_amp.numerics.find_nonfinite(f, xs, True)
  assert (r.primitive, r.direction, r.module) == ("mul", "forward", "block")
  assert r.max_finite == 15000.0  # the carry at the third step
  assert jmp_amp.numerics.find_nonfinite(f, xs, False) is None


def test_find_nonfinite_rejects_non_callables():
  with pytest.raises(TypeError, match="takes a function"):
    jmp_amp.numerics.find_nonfinite(3.0, 1.0)
  with pytest.raises(TypeError, match="loss_scale, rules apply to a Flax "
                     "model, find_nonfinite"):
    jmp_amp.numerics.find_nonfinite(jnp.sum, jnp.ones(2), loss_scale=2.0,
                                    rules="float32")
  model, loss_fn, (x, y) = _mlp()
  with pytest.raises(TypeError, match="takes one batch after the Flax model"):
    jmp_amp.numerics.find_nonfinite(loss_fn, model, x, y)


# --------------------------------------------------------------------------
# Telemetry.


def test_tensor_stats_against_numpy():
  x = np.array([0.0, 1e-6, -3.0, 7e-5, np.inf, np.nan, 2.0, 0.0], np.float32)
  s = jax.jit(jmp_amp.numerics.tensor_stats, static_argnums=1)(
      x, jnp.float16)
  assert float(s["max_abs"]) == 3.0
  assert float(s["underflow"]) == pytest.approx(1 / 8)  # 1e-6 < 6.1e-5
  assert float(s["zeros"]) == pytest.approx(2 / 8)
  assert float(s["nonfinite"]) == 2
  with pytest.raises(TypeError, match="floating"):
    jmp_amp.numerics.tensor_stats(jnp.arange(3))


def test_tensor_stats_of_an_empty_tensor_are_zeros():
  """No elements: no largest value, and fractions of 0 (not 0 / 0)."""
  s = jmp_amp.numerics.tensor_stats(jnp.zeros((0, 3), jnp.bfloat16))
  assert {k: v.item() for k, v in s.items()} == {
      "max_abs": 0.0, "underflow": 0.0, "zeros": 0.0, "nonfinite": 0}


@pytest.mark.parametrize("shapes", [((7, 3),), ((5, 11), (11,)), ((0,), (13,))])
def test_counts_finished_on_the_host_are_the_devices_statistics(shapes):
  """`finish` of counts brought to the host (NumPy) gives the bits the
  device gives. Sizes that are not powers of two (a division there is not a
  multiply by an exact reciprocal)."""
  from jmp_amp._src import tensor_stats as stats_lib  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(0)
  tree = [jnp.asarray(rng.choice([0.0, 1e-6, 2.0, np.inf, -3.0], size=s),
                      jnp.float32) for s in shapes]
  counts = stats_lib.tree_counts(tree, jnp.float16)
  host = stats_lib.finish(jax.device_get(counts))
  device = stats_lib.tree_stats(tree, jnp.float16)
  assert list(host) == list(device) == list(stats_lib.STAT_NAMES)
  for name in host:
    assert np.asarray(host[name]).dtype == (
        np.uint32 if name == "nonfinite" else np.float32), name
    assert np.asarray(host[name]).tobytes() == np.asarray(
        device[name]).tobytes(), (name, host[name], device[name])
  assert float(host["underflow"]) > 0 and int(host["nonfinite"]) > 0


def test_tree_stats_of_tensors_alike_share_one_trace():
  """Statistics of trees with the same shapes and dtypes are one jitted
  call each, traced once: a model's repeated blocks reuse the trace (issue
  #33)."""
  from jmp_amp._src import tensor_stats as stats_lib  # pylint: disable=import-outside-toplevel
  block = lambda v: (jnp.full((4, 3), v), jnp.full((3,), v))
  tree = {"a": block(1.0), "b": block(2.0), "c": (jnp.ones((2, 2)),)}
  jaxpr = jax.make_jaxpr(lambda t: {k: stats_lib.tree_stats(v)
                                    for k, v in t.items()})(tree).jaxpr
  calls = [e for e in jaxpr.eqns if e.params.get("name") == "_leaves_counts"]
  assert len(calls) == 3
  assert len({id(e.params["jaxpr"]) for e in calls}) == 2
  s = jax.jit(lambda t: stats_lib.tree_stats(t["b"]))(tree)
  assert float(s["max_abs"]) == 2.0 and float(s["zeros"]) == 0.0


def test_tree_stats_fractions_are_of_all_the_elements():
  # A kernel of 99 zeros and 1 underflow, a bias of 3 normal values: the
  # fractions are of the 103 elements, whatever the leaves' order or count
  # (averaging the leaves' fractions would say 49.5% zeros).
  from jmp_amp._src import tensor_stats as stats_lib
  kernel = np.zeros(100, np.float32)
  kernel[0] = 1e-6
  bias = np.array([1.0, -2.0, np.inf], np.float32)
  for tree in ({"k": kernel, "b": bias}, [bias, kernel[:50], kernel[50:]]):
    s = jax.jit(lambda t: stats_lib.tree_stats(t, jnp.float16))(tree)
    assert float(s["zeros"]) == pytest.approx(99 / 103)
    assert float(s["underflow"]) == pytest.approx(1 / 103)
    assert float(s["max_abs"]) == 2.0 and float(s["nonfinite"]) == 1
  assert stats_lib.tree_stats({"i": jnp.arange(3)}) is None


def test_tensor_stats_count_exactly_past_2_to_the_24():
  # float32 counts stop at 2**24: summed as float32 flags, XLA:CPU said a
  # quarter of this all-zero tensor of 2**26 elements was zeros.
  from jmp_amp._src import tensor_stats as stats_lib
  zeros = jnp.zeros((2**13, 2**13), jnp.bfloat16)
  s = jax.jit(jmp_amp.numerics.tensor_stats)(zeros)
  assert float(s["zeros"]) == 1.0 and float(s["underflow"]) == 0.0
  mixed = jnp.zeros(2**25 + 3, jnp.float32).at[:2**24 + 2].set(jnp.inf)
  s = jax.jit(lambda t: stats_lib.tree_stats(t))({"a": mixed, "b": mixed})
  assert int(s["nonfinite"]) == 2**25 + 4 and s["nonfinite"].dtype == (
      jnp.uint32)
  assert float(s["zeros"]) == pytest.approx((2**25 + 3 - 2**24 - 2)
                                            / (2**25 + 3), rel=1e-6)
  with pytest.raises(ValueError, match=r"at most 2\*\*32 - 1 elements"):
    jax.eval_shape(jmp_amp.numerics.tensor_stats,
                   jax.ShapeDtypeStruct((2**16, 2**16), jnp.bfloat16))


def test_output_stats_records_selected_module_outputs():
  model, _, (x, _) = _mlp()
  y, stats = fnum.output_stats(lambda m, x: m(x), model, x,
                               select=["layers/1", nnx.Linear])
  assert list(stats) == ["layers/0", "layers/1", "layers/2"]
  h = jax.nn.relu(model.layers[0](x))
  expected = float(jnp.max(jnp.abs(model.layers[1](h))))
  assert float(stats["layers/1"]["out"]["max_abs"]) == pytest.approx(
      expected, rel=1e-6)
  assert float(stats["layers/2"]["out"]["max_abs"]) == pytest.approx(
      float(jnp.max(jnp.abs(y))), rel=1e-6)
  _, stats = fnum.output_stats(lambda m, x: m(x), model, x,
                               select="layers/0")
  assert list(stats) == ["layers/0"]


def test_output_stats_of_a_module_called_twice_counts_both_calls():
  layer = nnx.Linear(2, 2, use_bias=False, rngs=nnx.Rngs(0))
  layer.kernel[...] = jnp.eye(2)
  twice = lambda m, x: (m(x), m(jnp.array([[0.0, 1e-6], [1e-6, 8.0]])))
  _, stats = nnx.jit(lambda m, x: fnum.output_stats(twice, m, x))(
      layer, jnp.array([[1.0, 0.0]]))
  out = stats[""]["out"]
  assert float(out["max_abs"]) == 8.0
  assert float(out["zeros"]) == pytest.approx(2 / 6)  # of all 6 elements
  assert float(out["underflow"]) == 0.0  # float32 outputs


def test_no_profile_or_trace_hook_is_left_in_the_package():
  import pathlib  # pylint: disable=import-outside-toplevel
  root = pathlib.Path(jmp_amp.__file__).parent
  for path in root.rglob("*.py"):
    text = path.read_text()
    for hook in ("sys.monitoring", "sys.setprofile", "sys.settrace"):
      assert hook not in text, (path, hook)


def test_an_inherited_call_that_capture_cannot_see_warns():
  class Base(nnx.Module):

    def __init__(self):
      self.dense = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

    def __call__(self, x):
      return self.dense(x)

  class Child(Base):
    pass

  with pytest.warns(UserWarning, match=r"modules '' \(Child, __call__ of "
                    r"Base\) are not recorded"):
    _, stats = fnum.output_stats(lambda m, x: m(x), Child(), jnp.ones((1, 2)))
  assert list(stats) == ["dense"]


def test_output_stats_linen_records_and_scopes():
  module = models.LinenMLP(8, 4, 2, width=16)
  x = jnp.ones((2, 8))
  variables = module.init(jax.random.key(0), x)

  def f(v):
    return fnum.output_stats(lambda _, x: module.apply(v, x), None, x)

  y, outputs = jax.jit(f)(variables)
  assert "" in outputs and len(outputs) == 3
  assert float(outputs[""]["out"]["max_abs"]) == pytest.approx(
      float(jnp.max(jnp.abs(y))))
  from jmp_amp._src import localise  # pylint: disable=g-import-not-at-top
  eqns = jax.make_jaxpr(f)(variables).jaxpr.eqns
  scoped = {localise.module_of(str(e.source_info.name_stack)) for e in eqns}
  assert set(outputs) - {""} <= scoped, (scoped, set(outputs))


def test_bad_select_is_refused():
  with pytest.raises(TypeError, match="path pattern"):
    jmp_amp.flax.make_train_step(lambda m, b: 0.0, numerics=3)
  with pytest.raises(ValueError, match="Invalid path pattern"):
    jmp_amp.flax.make_train_step(lambda m, b: 0.0, numerics="a/[")
  with pytest.raises(TypeError, match="not a Flax module class"):
    jmp_amp.flax.make_train_step(lambda m, b: 0.0, numerics=[int])
  with pytest.raises(TypeError, match="on_nonfinite"):
    jmp_amp.flax.make_train_step(lambda m, b: 0.0, on_nonfinite=3)


def _gpt_training():
  model, loss_fn, tokens = _gpt()
  jmp_amp.flax.set_policies(model, F16_RULES)
  opt = nnx.Optimizer(model, jmp_amp.loss_scaling(
      optax.sgd(0.01), jmp_amp.DynamicLossScale(2.0 ** 4)), wrt=nnx.Param)
  return model, opt, loss_fn, tokens


def test_train_step_off_compiles_the_same_program_and_on_differs():
  model, loss_fn, batch = _mlp()
  jmp_amp.flax.set_policies(model, F16_RULES)
  opt = nnx.Optimizer(model, jmp_amp.loss_scaling(
      optax.sgd(0.01), jmp_amp.DynamicLossScale(2.0 ** 4)), wrt=nnx.Param)

  def text(step):  # The compiled HLO, without source locations.
    hlo = step.lower(model, opt, batch).compile().as_text()
    return re.sub(r",? metadata=\{[^}]*\}", "", hlo.split("\nFileNames")[0])

  plain = text(jmp_amp.flax.make_train_step(loss_fn))
  assert text(jmp_amp.flax.make_train_step(
      loss_fn, numerics=None, on_nonfinite=print)) == plain
  assert text(jmp_amp.flax.make_train_step(loss_fn, numerics="**")) != plain


@pytest.mark.slow
def test_train_step_telemetry_and_the_hook_report_once_gpt():
  model, opt, loss_fn, tokens = _gpt_training()
  reports = []
  step = jmp_amp.flax.make_train_step(
      loss_fn, numerics=["blocks/*/attn", nnx.LayerNorm],
      on_nonfinite=reports.append)
  metrics = step(model, opt, tokens)
  numerics = jax.device_get(metrics["numerics"])
  assert set(numerics) == {"blocks/0/attn", "blocks/1/attn", "blocks/0/ln1",
                           "blocks/0/ln2", "blocks/1/ln1", "blocks/1/ln2",
                           "ln_f"}
  assert set(numerics["blocks/0/ln1"]) == {"out", "grad"}
  assert set(numerics["blocks/0/attn"]) == {"out"}  # Its params are below.
  assert all(s["nonfinite"] == 0 for k in numerics.values()
             for s in k.values())
  assert not reports
  kernel = model.blocks[1].attn.qkv.kernel
  kernel[...] = kernel[...] * 3000.0  # The scores overflow float16.
  for _ in range(2):
    metrics = step(model, opt, tokens)
    assert not bool(metrics["grads_finite"])
  numerics = jax.device_get(metrics["numerics"])
  assert numerics["blocks/0/attn"]["out"]["nonfinite"] == 0
  assert numerics["blocks/1/attn"]["out"]["nonfinite"] > 0
  assert len(reports) == 1
  assert (reports[0].module, reports[0].primitive) == ("blocks/1/attn",
                                                       "dot_general")
  assert reports[0].fixed is True
  text = jmp_amp.numerics.format_stats(numerics, top=3)
  assert text.splitlines()[1].startswith("blocks/1/attn")


def test_train_step_telemetry_and_the_hook_report_once_mlp():
  model, loss_fn, batch = _mlp()
  jmp_amp.flax.set_policies(model, F16_RULES)
  opt = nnx.Optimizer(model, jmp_amp.loss_scaling(
      optax.sgd(0.01), jmp_amp.DynamicLossScale(2.0 ** 4)), wrt=nnx.Param)
  reports = []
  step = jmp_amp.flax.make_train_step(loss_fn, numerics="layers/*",
                                      on_nonfinite=reports.append)
  numerics = jax.device_get(step(model, opt, batch)["numerics"])
  assert list(numerics) == ["layers/0", "layers/1", "layers/2"]
  assert set(numerics["layers/0"]) == {"out", "grad"}
  assert numerics["layers/2"]["grad"]["max_abs"] > 0 and not reports
  kernel = model.layers[1].kernel
  kernel[...] = kernel[...] * 1e5  # layers/1's float16 matmul overflows.
  for _ in range(2):
    metrics = step(model, opt, batch)
  numerics = jax.device_get(metrics["numerics"])
  assert numerics["layers/0"]["out"]["nonfinite"] == 0
  assert numerics["layers/1"]["out"]["nonfinite"] > 0
  assert len(reports) == 1, reports
  assert (reports[0].module, reports[0].primitive) == ("layers/1",
                                                       "dot_general")
  text = jmp_amp.numerics.format_stats(numerics, top=2)
  assert len(text.splitlines()) == 3 and "layers/" in text.splitlines()[1]


def test_grad_stats_of_linen_params():
  grads = {"Dense_0": {"kernel": jnp.array([1e-6, 0.0, jnp.inf]),
                       "bias": jnp.array([2.0])}}
  s = fnum.grad_stats(None, grads, "**")["Dense_0"]
  assert float(s["max_abs"]) == 2.0 and float(s["nonfinite"]) == 1


def test_linen_train_step_telemetry():
  module = models.LinenMLP(8, 4, 2, width=16)
  x, y = jnp.ones((2, 8)), jnp.zeros((2, 4))
  rules = "mixed_float16"
  variables = module.init(jax.random.key(0), x)
  state = jmp_amp.flax.train.TrainState.create(
      apply_fn=functools.partial(jmp_amp.flax.apply_with_policies, module,
                                 rules),
      params=variables["params"], tx=jmp_amp.loss_scaling(
          optax.sgd(0.1), jmp_amp.NoOpLossScale()))
  loss_fn = lambda m, b: jnp.mean((m(b[0]).astype(jnp.float32) - b[1]) ** 2)
  step = jmp_amp.flax.make_linen_train_step(loss_fn, numerics="**",
                                           donate=False)
  _, metrics = step(state, (x, y))
  numerics = jax.device_get(metrics["numerics"])
  layers = sorted(variables["params"])
  assert set(numerics) == {""} | set(layers)
  assert all(set(numerics[p]) == {"out", "grad"} for p in layers)
  out = jmp_amp.flax.apply_with_policies(module, rules, variables, x)
  assert float(numerics[""]["out"]["max_abs"]) == pytest.approx(
      float(jnp.max(jnp.abs(out.astype(jnp.float32)))), rel=1e-3)


def test_fp8_layers_report_amax_and_scale():
  model, loss_fn, (x, y) = _mlp()
  jmp_amp.flax.set_policies(model, {"*": "float8"})
  h = jax.nn.relu(model.layers[0](x))  # layers/1's input (layers/0: bf16)
  opt = nnx.Optimizer(model, jmp_amp.loss_scaling(
      optax.sgd(0.01), jmp_amp.NoOpLossScale()), wrt=nnx.Param)
  step = jmp_amp.flax.make_train_step(loss_fn, numerics="layers/*")
  numerics = jax.device_get(step(model, opt, (x, y))["numerics"])
  fp8 = numerics["layers/1"]["fp8"]
  assert set(numerics["layers/1"]) == {"out", "grad", "fp8"}
  assert "fp8" not in numerics["layers/0"]  # the first layer stays bf16
  assert float(fp8["amax_lhs"]) == pytest.approx(
      float(jnp.max(jnp.abs(h.astype(jnp.float32)))), rel=1e-2)
  assert float(fp8["scale_lhs"]) == pytest.approx(
      float(fp8["amax_lhs"]) / float(jnp.finfo(jnp.float8_e4m3fn).max))
  assert "fp8" not in jmp_amp.numerics.format_stats(numerics)


def test_telemetry_step_never_syncs_with_the_host():
  from test_no_host_sync import no_host_sync  # pylint: disable=g-import-not-at-top
  model, loss_fn, batch = _mlp()
  jmp_amp.flax.set_policies(model, F16_RULES)
  opt = nnx.Optimizer(model, jmp_amp.loss_scaling(
      optax.sgd(0.01), jmp_amp.DynamicLossScale(2.0 ** 4)), wrt=nnx.Param)
  step = jmp_amp.flax.make_train_step(loss_fn, numerics="**")
  batch = jax.device_put(batch)
  step(model, opt, batch)  # compiles
  with no_host_sync():
    for _ in range(2):
      metrics = step(model, opt, batch)
  assert float(metrics["numerics"]["layers/0"]["out"]["max_abs"]) > 0


def _reporting_step(init_scale):
  model, loss_fn, batch = _mlp()
  jmp_amp.flax.set_policies(model, F16_RULES)
  opt = nnx.Optimizer(model, jmp_amp.loss_scaling(
      optax.sgd(0.01), jmp_amp.DynamicLossScale(init_scale)), wrt=nnx.Param)
  reports = []
  step = jmp_amp.flax.make_train_step(loss_fn, on_nonfinite=reports.append)
  return model, opt, step, batch, reports


def test_on_nonfinite_reports_every_distinct_event_not_only_the_first():
  # (#35) A NaN batch used the one report up; a later overflow went unsaid.
  model, opt, step, (x, y), reports = _reporting_step(2.0 ** 4)
  step(model, opt, (x.at[0, 0].set(jnp.nan), y))
  step(model, opt, (x, y))
  assert [(r.direction, r.argument) for r in reports] == [
      ("input", "batch[0]")]
  assert (reports[0].step, reports[0].loss_scale, reports[0].repeats) == (
      1, 16.0, 1)
  kernel = model.layers[1].kernel
  kernel[...] = kernel[...] * 1e5  # layers/1's float16 matmul overflows.
  for _ in range(3):
    step(model, opt, (x, y))
  assert all(r is not None for r in reports)
  assert [(r.direction, r.module, r.primitive) for r in reports[1:]] == [
      ("forward", "layers/1", "dot_general")]
  # A second NaN batch starts a new run: reported again.
  kernel[...] = kernel[...] / 1e5
  step(model, opt, (x, y))
  step(model, opt, (x.at[1, 1].set(jnp.inf), y))
  assert [(r.direction, r.argument) for r in reports[2:]] == [
      ("input", "batch[0]")]


def test_on_nonfinite_reports_a_run_that_persists_after_backoffs():
  model, opt, step, batch, reports = _reporting_step(2.0 ** 4)
  kernel = model.layers[1].kernel
  kernel[...] = kernel[...].at[0, 0].set(jnp.nan)
  for _ in range(9):
    step(model, opt, batch)
  # Run steps 1 and 8: the input site, then its persistence.
  assert [(r.repeats, r.argument) for r in reports] == [
      (1, "params layers/1/kernel"), (8, "params layers/1/kernel")]
  assert "8 non-finite steps in a row" in str(reports[1])


def test_on_nonfinite_never_passes_none():
  # The replay does not apply autocast=: the float16 overflow is not found
  # op by op, and the callback is told so rather than given None.
  model, loss_fn, batch = _mlp()
  opt = nnx.Optimizer(model, jmp_amp.loss_scaling(
      optax.sgd(0.01), jmp_amp.DynamicLossScale(2.0 ** 4)), wrt=nnx.Param)
  reports = []
  step = jmp_amp.flax.make_train_step(loss_fn, autocast="float16",
                                      on_nonfinite=reports.append)
  kernel = model.layers[1].kernel
  kernel[...] = kernel[...] * 1e5
  assert not bool(step(model, opt, batch)["grads_finite"])
  assert len(reports) == 1 and reports[0].primitive == "unknown"
  assert str(reports[0]) == (
      "step 1 (loss scale 16): the step's loss or gradients were not finite, "
      "but an op-by-op replay (jmp_amp.numerics.find_nonfinite, which "
      "does not apply autocast=) found no op making inf/NaN")


def test_telemetry_select_that_matches_nothing_warns():
  # (#35) numerics="layer/*" (for "layers/*") silently gave {}.
  model, loss_fn, batch = _mlp()
  opt = nnx.Optimizer(model, jmp_amp.loss_scaling(
      optax.sgd(0.01), jmp_amp.NoOpLossScale()), wrt=nnx.Param)
  step = jmp_amp.flax.make_train_step(loss_fn, numerics=["layer/*",
                                                         "layers/0"])
  with pytest.warns(UserWarning) as caught:
    metrics = step(model, opt, batch)
  messages = [str(w.message) for w in caught
              if "jmp_amp.flax.numerics" in str(w.message)]
  assert messages == [
      "jmp_amp.flax.numerics: select 'layer/*' matches no module path of "
      "MLP (paths are like 'layers', 'layers/0', 'layers/1', 'layers/2'); "
      "its statistics will be missing."]
  assert list(metrics["numerics"]) == ["layers/0"]
  grads = nnx.state(model, nnx.Param)
  with pytest.warns(UserWarning, match=r"select 'nothing/\*\*' matches no "
                    r"module path of MLP"):
    assert fnum.grad_stats(model, grads, "nothing/**") == {}
  with pytest.warns(UserWarning, match="select LayerNorm matches no module "
                    "of MLP: no module is an instance of it"):
    fnum.output_stats(lambda m: None, model, select=nnx.LayerNorm)


def test_telemetry_select_that_matches_nothing_warns_for_linen():
  grads = {"Dense_0": {"kernel": jnp.ones(2)}}
  with pytest.warns(UserWarning, match=r"select 'Dense_1' matches no module "
                    r"path of the model \(paths are like 'Dense_0'\)"):
    assert fnum.grad_stats(None, grads, "Dense_1") == {}
  module = models.LinenMLP(8, 4, 2, width=16)
  variables = module.init(jax.random.key(0), jnp.ones((2, 8)))
  with pytest.warns(UserWarning, match=r"select 'blocks/\*' matches no "
                    r"module path of the linen modules called"):
    fnum.output_stats(lambda _, x: module.apply(variables, x), None,
                      jnp.ones((2, 8)), select="blocks/*")
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    _, stats = fnum.output_stats(lambda _, x: module.apply(variables, x),
                                 None, jnp.ones((2, 8)))
  assert stats
