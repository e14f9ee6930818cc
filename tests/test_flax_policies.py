"""Tests for jmp_amp.flax per-module policies (rules, NNX, linen).

Dtype checks read the lowered program (`jmp_amp.matmul_report`), so most
tests trace and lower without compiling.
"""

import copy
import functools
import pickle
import subprocess
import sys
import warnings

from flax import nnx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import assert_trees_within_ulps
from helpers import tree_bytes_equal
import jmp_amp
import jmp_amp.flax as jf
from jmp_amp.flax import rules as rules_lib
from jmp_amp.flax.rules import PolicyRules
import models
import test_flax_models as tm

F32 = np.dtype(np.float32)
HALF = {"bfloat16": np.dtype(jnp.bfloat16), "float16": np.dtype(np.float16)}
# XLA:CPU's optimising backend takes seconds per program; the tests check what
# programs compute, not how fast.
FAST_COMPILE = {"xla_backend_optimization_level": 0}
SHORT = {np.dtype(jnp.bfloat16): "bf16", np.dtype(np.float16): "f16",
         F32: "f32"}

NNX_MODELS = {
    "mlp": (tm.mlp, lambda: tm.mlp_batch(4)[0]),
    "resnet": (tm.resnet, lambda: tm.image_batch(2)[0]),
    "gpt": (tm.gpt, lambda: tm.token_batch(2)),
    "knobless_gpt": (lambda: tm.knobless_gpt(depth=1),
                     lambda: tm.token_batch(2)),
}


def policy(module):
  """The policy of one module: its own entry in `get_policies`."""
  return jf.get_policies(module)[""]


def nnx_forward_backward(model, x):
  """(pure fn, args): value_and_grad of sum(model(x)) w.r.t. the Params.

  The aux output carries the model output and the updated non-param state
  (BatchNorm statistics), so forward *and* backward ops stay in the program.
  """
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss(params, rest, x):
    m = nnx.merge(graphdef, params, rest, copy=True)
    out = m(x)
    return out.astype(jnp.float32).sum(), (out, nnx.split(m, nnx.Param,
                                                          ...)[2])

  return jax.value_and_grad(loss, has_aux=True), (params, rest, x)


def param_dtypes(tree):
  return {np.dtype(l.dtype) for l in jax.tree_util.tree_leaves(tree)}


def matmul_inputs(report):
  return {(r.lhs_dtype, r.rhs_dtype) for r in report}


# --------------------------------------------------------------------------
# Rules.


def test_import_jmp_amp_does_not_import_flax():
  code = ("import sys, jmp_amp; "
          "assert not any(m == 'flax' or m.startswith('flax.') "
          "for m in sys.modules), 'flax imported'")
  result = subprocess.run([sys.executable, "-c", code], capture_output=True,
                          text=True, timeout=120)
  assert result.returncode == 0, result.stderr


def test_mixed_rules_pins_norms_to_float32_and_defaults_to_compute():
  rules = jf.mixed_rules("float16")
  for cls in (nnx.BatchNorm, nnx.LayerNorm, nnx.RMSNorm, nnx.GroupNorm,
              nn.BatchNorm, nn.LayerNorm):
    assert rules[cls] == jmp_amp.get_policy("float32")
    assert cls in rules.optional
  assert list(rules)[-1] == "*"
  assert str(rules["*"]) == "p=f32,c=f16,o=f16"
  assert str(jf.mixed_rules()["*"]) == "p=f32,c=bf16,o=bf16"
  assert str(jf.mixed_rules("bf16", output="f32")["*"]) == "p=f32,c=bf16,o=f32"


@pytest.mark.parametrize("pattern,path,match", [
    ("head", "head", True),
    ("head", "heads", False),
    ("blocks/*/attn", "blocks/0/attn", True),
    ("blocks/*/attn", "blocks/0/x/attn", False),
    ("blocks/**", "blocks/0/x/attn", True),
    ("**/attn", "attn", True),
    ("**/attn", "blocks/1/attn", True),
    ("blocks/[01]", "blocks/1", True),
    ("blocks/[!01]", "blocks/2", True),
    ("blocks/[!01]", "blocks/1", False),
    ("layer_?", "layer_3", True),
    ("", "", True),
])
def test_path_patterns_are_segment_globs(pattern, path, match):
  assert bool(rules_lib.compile_pattern(pattern).match(path)) is match


@pytest.mark.parametrize("rules,error,fragment", [
    ({3: "float32"}, TypeError, "neither a module class"),
    ({int: "float32"}, TypeError, "not a Flax module class"),
    ({"head": 32}, ValueError, "'head'"),
    ({"head": "p=f32,c=f8"}, ValueError, "f8"),
    ({nnx.Linear: "fp17"}, ValueError, "nnx.Linear"),
    ({"blocks/[0": "float32"}, ValueError, "unbalanced '['"),
    ({"blocks/0]": "float32"}, ValueError, "unbalanced ']'"),
    ({"blocks/[z-a]": "float32"}, ValueError, "Invalid path pattern"),
    ({"/head": "float32"}, ValueError, "leading"),
    (["float32"], TypeError, "mapping"),
])
def test_bad_rules_raise_clear_errors(rules, error, fragment):
  with pytest.raises(error, match=None) as info:
    jf.set_policies(tm.mlp(), rules)
  assert fragment in str(info.value)
  # linen validates the same way, before running anything.
  with pytest.raises(error):
    jf.apply_with_policies(tm.linen_mlp(), rules, {}, tm.mlp_batch(2)[0])


def test_unmatched_rule_warns_naming_it_and_strict_raises():
  rules = {"encoder/*": "float32", nnx.Conv: "float32", "*": "mixed_bfloat16"}
  with pytest.warns(UserWarning) as record:
    jf.set_policies(tm.mlp(), rules)
  message = " ".join(str(w.message) for w in record)
  assert "'encoder/*'" in message and "nnx.Conv" in message
  with pytest.raises(ValueError, match="encoder"):
    jf.set_policies(tm.mlp(), rules, strict=True)


def test_shadowed_rule_warns_and_optional_rules_stay_quiet():
  with pytest.warns(UserWarning, match=r"rule nnx.Linear -> p=f32,c=bf16,"
                    r"o=bf16 matched no module of MLP: every module it matches "
                    r"\(e.g. 'layers/0'\) is decided by a more specific rule"):
    jf.set_policies(tm.mlp(),
                    {nnx.Linear: "mixed_bfloat16", "layers/*": "float32"})
  # The MLP has no norms: mixed_rules' optional norm rules say nothing, also
  # after extending the rule set with |.
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    rules = jf.mixed_rules() | {"layers/2": "float32"}
    assert isinstance(rules, PolicyRules) and nnx.LayerNorm in rules.optional
    model = jf.set_policies(tm.mlp(), rules)
  assert str(policy(model.layers[2])) == "p=f32,c=f32,o=f32"


# --------------------------------------------------------------------------
# NNX.


@pytest.mark.parametrize("compute", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", list(NNX_MODELS))
def test_nnx_default_mixed_rules(name, compute):
  build, make_input = NNX_MODELS[name]
  half = HALF[compute]
  model = jf.set_policies(build(), jf.mixed_rules(compute))

  assert param_dtypes(nnx.state(model, nnx.Param)) == {F32}
  fn, args = nnx_forward_backward(model, make_input())
  report = jmp_amp.matmul_report(fn, *args)
  # Every dot/conv, forward and backward, takes half operands; the forward
  # ones (jmp_amp.dot_general) accumulate and return float32.
  assert len(report) > 0 and report.all_inputs_in(SHORT[half]), str(report)
  backward = [r for r in report if r.name and "transpose" in r.name]
  assert len(backward) >= len(report) // 2
  # A half output dtype keeps Flax's default dots: half in, half out (the
  # kernels accumulate in float32), so no float32 activation is stored.
  assert {r.result_dtype for r in report} == {SHORT[half]}, str(report)

  (_, (out, rest)), grads = jax.eval_shape(fn, *args)
  assert out.dtype == half
  assert param_dtypes(grads) == {F32}
  stats = nnx.filter_state(rest, nnx.BatchStat)
  assert param_dtypes(stats) <= {F32}
  policies = jf.get_policies(model)
  for path, module in nnx.iter_modules(model):
    path = "/".join(map(str, path))
    if isinstance(module, (nnx.LayerNorm, nnx.BatchNorm)):
      assert policies[path] == jmp_amp.get_policy("float32"), path
    else:
      assert policies[path].compute_dtype == half, path


def test_norms_take_half_inputs_and_compute_and_return_float32():
  resnet = jf.set_policies(tm.resnet(), jf.mixed_rules("float16"))
  gpt = jf.set_policies(tm.gpt(), jf.mixed_rules("float16"))
  apply = lambda m, x: (m(x), nnx.state(m, nnx.BatchStat))
  out, stats = nnx.eval_shape(apply, resnet.stem_bn,
                              jnp.ones((2, 4, 4, 8), jnp.float16))
  assert out.dtype == F32 and param_dtypes(stats) == {F32}
  assert resnet.stem_bn.dtype == F32 and resnet.stem_bn.promote_dtype
  out, _ = nnx.eval_shape(apply, gpt.blocks[0].ln1,
                          jnp.ones((2, 3, tm.WIDTH), jnp.float16))
  assert out.dtype == F32
  # ... and the next layer takes float16 again.
  out, _ = nnx.eval_shape(apply, gpt.blocks[0].attn.qkv,
                          jnp.ones((2, 3, tm.WIDTH), F32))
  assert out.dtype == HALF["float16"]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(NNX_MODELS))
def test_nnx_float32_policy_matches_unpoliced_bit_for_bit(name):
  build, make_input = NNX_MODELS[name]
  x = make_input()
  results = []
  for rules in (None, "float32"):
    model = build()
    if rules:
      jf.set_policies(model, rules)
    fn, args = nnx_forward_backward(model, x)
    results.append(jax.jit(fn, compiler_options=FAST_COMPILE)(*args))
  assert tree_bytes_equal(results[0], results[1])


def test_path_rule_before_class_rule_wins_and_pins_dots():
  model = jf.set_policies(tm.mlp(), {"layers/2": "float32",
                                     nnx.Linear: "mixed_bfloat16"})
  assert policy(model.layers[2]) == jmp_amp.get_policy("float32")
  assert policy(model.layers[0]).compute_dtype == HALF["bfloat16"]
  # A batch of 3, so that only the last layer's dots have a dimension of 4.
  x = tm.mlp_batch(3)[0]
  report = jmp_amp.matmul_report(*_flat(nnx_forward_backward(model, x)))
  assert len(report) == 8  # 3 forward, 5 backward (no input gradient)
  for r in report:
    involves_head = tm.MLP_OUT in r.lhs_shape + r.rhs_shape
    assert r.lhs_dtype == r.rhs_dtype == ("f32" if involves_head else "bf16"), r


def _flat(fn_args):
  fn, args = fn_args
  return (fn, *args)


def test_most_specific_rule_wins_and_star_is_the_default_wherever_it_is():
  model = tm.gpt(num_layers=2)
  rules = {"*": "mixed_float16", nnx.Linear: "mixed_bfloat16",
           "blocks/*/mlp/fc": "bfloat16", "blocks/0/mlp/fc": "float32"}
  for ordered in (rules, dict(reversed(rules.items()))):  # order is moot
    jf.set_policies(model, ordered)
    policies = {p: str(v) for p, v in jf.get_policies(model).items()}
    assert policies["blocks/0/mlp/fc"] == "p=f32,c=f32,o=f32"  # exact path
    assert policies["blocks/1/mlp/fc"] == "p=bf16,c=bf16,o=bf16"  # glob
    assert policies["blocks/1/mlp/out"] == "p=f32,c=bf16,o=bf16"  # class
    assert policies["blocks/0/ln1"] == "p=f32,c=f16,o=f16"  # "*": last resort
    assert policies[""] == "p=f32,c=f16,o=f16"


class WideLinear(nnx.Linear):
  pass


class Marked(nnx.Module):
  """A mixin: modules of this class are matched by two unrelated classes."""


class MarkedLayerNorm(nnx.LayerNorm, Marked):
  pass


def test_a_subclass_rule_outranks_its_base_class_rule():
  model = nnx.Sequential(nnx.Linear(2, 3, rngs=nnx.Rngs(0)),
                         WideLinear(3, 4, rngs=nnx.Rngs(0)))
  rules = {WideLinear: "float16", nnx.Linear: "bfloat16"}
  for ordered in (rules, dict(reversed(rules.items()))):
    jf.set_policies(model, ordered)
    assert str(policy(model.layers[0])) == "p=bf16,c=bf16,o=bf16"
    assert str(policy(model.layers[1])) == "p=f16,c=f16,o=f16"


@pytest.mark.parametrize("rules,path,first,second", [
    ({"blocks/*/attn": "float32", "blocks/0/*": "bfloat16"},
     "blocks/0/attn", "'blocks/*/attn' -> p=f32,c=f32,o=f32",
     "'blocks/0/*' -> p=bf16,c=bf16,o=bf16"),
    ({"**/fc": "float32", "blocks/1/**": "float16"},
     "blocks/1/mlp/fc", "'**/fc' -> p=f32,c=f32,o=f32",
     "'blocks/1/**' -> p=f16,c=f16,o=f16"),
    ({nnx.LayerNorm: "float32", Marked: "bfloat16"},
     "blocks/0/ln1", "nnx.LayerNorm -> p=f32,c=f32,o=f32",
     "test_flax_policies.Marked -> p=bf16,c=bf16,o=bf16"),
])
def test_two_matching_rules_of_equal_rank_raise(rules, path, first, second):
  model = tm.gpt(num_layers=2)
  model.blocks[0].ln1 = MarkedLayerNorm(tm.WIDTH, rngs=nnx.Rngs(0))
  before = nnx.graphdef(model)
  message = (f"jmp_amp.flax: module '{path}' matches two rules of equal "
             f"rank, {first} and {second}, and neither is more specific "
             "(an exact path outranks a glob, a glob a module class, a class "
             "its bases).")
  with pytest.raises(ValueError) as info:
    jf.set_policies(model, rules | {"*": "mixed_bfloat16"})
  assert str(info.value).startswith(message), str(info.value)
  assert nnx.graphdef(model) == before  # raised before changing anything


def test_linen_rules_of_equal_rank_raise_too():
  x = tm.mlp_batch(2)[0]
  module = nn.Sequential([nn.Dense(4), nn.Dense(2)])
  variables = module.init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="module 'layers_0' matches two rules "
                     "of equal rank, 'layers_\\*' -> p=f32,c=f32,o=f32 and "
                     "'\\*_0' -> p=bf16,c=bf16,o=bf16"):
    jf.apply_with_policies(module, {"layers_*": "float32", "*_0": "bfloat16"},
                           variables, x)
  # An exact path outranks both (and leaves '*_0' nothing to decide).
  with pytest.warns(UserWarning, match="rule '\\*_0' -> p=bf16,c=bf16,o=bf16 "
                    "matched no module of the linen model: every module it "
                    "matches .e.g. 'layers_0'. is decided by a more specific "
                    "rule"):
    out = jf.apply_with_policies(
        module, {"layers_*": "float16", "*_0": "bfloat16", "layers_0": None},
        variables, x)
  assert out.dtype == HALF["float16"]


def test_get_policies_of_one_module_is_under_the_root_path():
  model = jf.set_policies(tm.mlp(), {"layers/1": "float16",
                                     "*": "mixed_bfloat16"})
  layer = model.layers[1]
  assert jf.get_policies(layer) == {"": jmp_amp.get_policy("float16")}
  assert jf.get_policies(model)["layers/1"] is jf.get_policies(layer)[""]
  with pytest.raises(TypeError, match="get_policies expects an nnx.Module, "
                     "got dict"):
    jf.get_policies({"layer": layer})


def test_container_rules_are_inherited_unless_a_rule_matches():
  model = tm.gpt(num_layers=2)
  jf.set_policies(model, {"blocks/*/attn": "float32"} | jf.mixed_rules())
  policies = jf.get_policies(model)
  f32 = jmp_amp.get_policy("float32")
  assert policies["blocks/1/attn"] == f32
  assert policies["blocks/1/attn/qkv"] == f32  # inherited from attn
  assert policies["blocks/1/mlp/fc"].compute_dtype == HALF["bfloat16"]
  assert model.blocks[1].attn.einsum_op is jnp.einsum  # f32: knob untouched
  report = jmp_amp.matmul_report(
      *_flat(nnx_forward_backward(model, tm.token_batch(2))))
  assert ("f32", "f32") in matmul_inputs(report)
  assert ("bf16", "bf16") in matmul_inputs(report)
  assert all(r.lhs_dtype == r.rhs_dtype for r in report), str(report)


class BoundaryMLP(models.MLP):
  """models.MLP whose __call__ casts at its boundary (models stay plain)."""
  __call__ = jf.cast_boundary(models.MLP.__call__)


def boundary_mlp():
  return tm.build(lambda: BoundaryMLP(tm.MLP_IN, tm.MLP_OUT, 3,
                                      width=tm.MLP_WIDTH, rngs=nnx.Rngs(0)))


def test_root_rule_sets_the_model_output_and_is_not_inherited():
  rules = jf.mixed_rules(model_output="float32")
  assert list(rules)[0] == ""
  model = jf.set_policies(boundary_mlp(), rules)
  policies = {p: str(v) for p, v in jf.get_policies(model).items()}
  assert policies[""] == "p=f32,c=bf16,o=f32"
  assert policies["layers"] == policies["layers/2"] == "p=f32,c=bf16,o=bf16"
  out = nnx.eval_shape(lambda m, x: m(x), model, tm.mlp_batch(2)[0])
  assert out.dtype == F32


def test_none_leaves_a_module_untouched():
  model = jf.set_policies(tm.mlp(), {"layers/2": None, "*": "mixed_bfloat16"})
  last = model.layers[2]
  assert policy(last) is None and type(last) is nnx.Linear
  assert last.dot_general is jax.lax.dot_general
  # Unpoliced, it promotes bf16 inputs to its float32 params.
  assert last(jnp.ones((2, tm.MLP_WIDTH), jnp.bfloat16)).dtype == F32
  assert model.layers[1](jnp.ones((2, tm.MLP_WIDTH))).dtype == HALF["bfloat16"]


class PlainScale(nnx.Module):
  """A custom module with its own Param and no dtype knobs."""

  def __init__(self, rngs):
    del rngs
    self.w = nnx.Param(jnp.asarray(
        np.random.default_rng(0).normal(size=(tm.MLP_IN, 5)), jnp.float32))
    self.count = nnx.BatchStat(jnp.zeros((), jnp.int32))

  def __call__(self, x):
    self.count[...] += 1
    return jnp.tanh(x @ self.w[...])


class ScaleModule(PlainScale):
  """The same, opting in to boundary casts for a class one cannot edit."""
  __call__ = jf.cast_boundary(PlainScale.__call__)


def test_custom_module_casts_at_its_boundary_and_reads_params_in_compute():
  model = jf.set_policies(ScaleModule(nnx.Rngs(0)), {"": "p=f32,c=f16,o=f32"})
  x = tm.mlp_batch(4)[0]
  fn, args = nnx_forward_backward(model, x)
  report = jmp_amp.matmul_report(fn, *args)
  assert len(report) == 2 and report.all_inputs_in("f16"), str(report)
  (_, (out, rest)), grads = jax.eval_shape(fn, *args)
  assert out.dtype == F32 and param_dtypes(grads) == {F32}
  assert model(x).dtype == F32
  assert model.w[...].dtype == F32  # the stored param keeps its dtype
  assert int(model.count[...]) == 1  # other variables update the module
  np.testing.assert_allclose(  # the gradient flows through the cast
      nnx.grad(lambda m: m(x).astype(jnp.float32).sum())(model).w[...],
      jax.grad(lambda w: jnp.tanh(x.astype(jnp.float16) @ w.astype(
          jnp.float16)).astype(jnp.float32).sum())(model.w[...]),
      rtol=2e-3, atol=2e-3)
  # Under the catch-all "*", the root's outputs are what it computes.
  jf.set_policies(model, "p=f32,c=f16,o=f32")
  assert model(x).dtype == HALF["float16"]


def test_module_without_knobs_or_boundary_warns_and_strict_raises():
  with pytest.warns(UserWarning, match="cast_boundary"):
    jf.set_policies(PlainScale(nnx.Rngs(0)), "mixed_bfloat16")
  with pytest.raises(ValueError, match="PlainScale"):
    jf.set_policies(PlainScale(nnx.Rngs(0)), "mixed_bfloat16", strict=True)
  # A knobless root asked for float32 outputs it cannot cast.
  with pytest.warns(UserWarning, match="has no knobs to return float32"):
    jf.set_policies(tm.mlp(), jf.mixed_rules(model_output="float32"))
  # Knobless containers whose children have knobs need nothing.
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    jf.set_policies(tm.mlp(), jf.mixed_rules())


class Zoo(nnx.Module):
  """Flax layers with assorted knobs, in one model."""

  def __init__(self, rngs):
    self.ein = nnx.Einsum("btd,dh->bth", (8, 12), (12,), rngs=rngs)
    self.general = nnx.LinearGeneral(12, (2, 6), rngs=rngs)
    self.mha = nnx.MultiHeadAttention(2, 12, 12, decode=False,
                                      keep_rngs=False, rngs=rngs)
    self.rms = nnx.RMSNorm(12, rngs=rngs)
    self.gn = nnx.GroupNorm(12, num_groups=3, rngs=rngs)
    self.convt = nnx.ConvTranspose(12, 12, (3,), rngs=rngs)
    self.seq = nnx.Sequential(nnx.Linear(12, 12, rngs=rngs), jax.nn.relu)
    self.drop = nnx.Dropout(0.1, deterministic=True)
    self.emb = nnx.Embed(10, 12, rngs=rngs)

  def __call__(self, x):
    x = self.ein(x)
    x = self.general(x).reshape(x.shape)
    x = self.gn(self.rms(self.mha(x)))
    x = self.drop(self.seq(self.convt(x)))
    return self.emb.attend(x)  # the tied-embedding head


def test_flax_layer_knobs_einsum_general_attention_convtranspose_norms():
  model = jf.set_policies(tm.build(lambda: Zoo(nnx.Rngs(0))),
                          jf.mixed_rules("bfloat16"))
  policies = {p: str(v) for p, v in jf.get_policies(model).items()}
  assert policies["rms"] == policies["gn"] == "p=f32,c=f32,o=f32"
  assert policies["mha/query"] == policies["seq/layers/0"] == (
      "p=f32,c=bf16,o=bf16")
  fn, args = nnx_forward_backward(model, jnp.ones((2, 5, 8)))
  report = jmp_amp.matmul_report(fn, *args)
  # jax.nn.dot_product_attention (inside MultiHeadAttention) returns float32
  # logits, so two of its backward dots see a float32 cotangent: that is
  # JAX's attention, not a module boundary. Everything else is bf16.
  flops = report.flops_by_input_dtype()
  assert flops["bf16"] >= 0.95 * report.total_flops, str(report)
  assert "f32" not in flops, str(report)
  assert jax.eval_shape(fn, *args)[0][1][0].dtype == HALF["bfloat16"]


def test_params_are_stored_in_the_policy_param_dtype():
  model = jf.set_policies(tm.mlp(), {"layers/2": "bfloat16",
                                     "*": "mixed_float16"})
  assert model.layers[2].kernel[...].dtype == HALF["bfloat16"]
  assert model.layers[0].kernel[...].dtype == F32


def test_nnx_graph_operations_keep_policies():
  model = jf.set_policies(tm.mlp(), jf.mixed_rules())
  x = tm.mlp_batch(3)[0]
  expected = model(x)
  graphdef, state = nnx.split(model)
  copies = [nnx.merge(graphdef, state), nnx.clone(model), copy.deepcopy(model),
            pickle.loads(pickle.dumps(model))]
  for other in copies:
    assert isinstance(other.layers[2], nnx.Linear)
    assert policy(other.layers[2]) == policy(model.layers[2])
    np.testing.assert_array_equal(other(x), expected)
  out = nnx.jit(lambda m, x: m(x))(model, x)
  assert out.dtype == HALF["bfloat16"]
  np.testing.assert_array_equal(out, expected)


def test_set_policies_again_replaces_and_clear_restores():
  model = tm.mlp()
  x = tm.mlp_batch(3)[0]
  reference = model(x)
  jf.set_policies(model, "mixed_float16")
  assert model(x).dtype == HALF["float16"]
  jf.set_policies(model, {"layers/2": "float32"})  # others: no rule any more
  first = model.layers[0]
  assert policy(first) is None and type(first) is nnx.Linear
  assert first.dot_general is jax.lax.dot_general
  jf.clear_policies(model)
  assert all(p is None for p in jf.get_policies(model).values())
  assert type(model.layers[2]) is nnx.Linear
  np.testing.assert_array_equal(model(x), reference)


# --------------------------------------------------------------------------
# linen.


def linen_forward_backward(module, rules, variables, x):
  def loss(params, x):
    out, updates = jf.apply_with_policies(
        module, rules, {**variables, "params": params}, x,
        mutable=[k for k in variables if k != "params"])
    return out.astype(jnp.float32).sum(), (out, updates)
  return jax.value_and_grad(loss, has_aux=True), (variables["params"], x)


LINEN_MODELS = {
    "mlp": (tm.linen_mlp, lambda: tm.mlp_batch(4)[0]),
    "resnet": (tm.linen_resnet, lambda: tm.image_batch(2)[0]),
}


@pytest.mark.parametrize("compute", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", list(LINEN_MODELS))
def test_linen_default_mixed_rules(name, compute):
  cls, make_input = LINEN_MODELS[name]
  half, x, rules = HALF[compute], make_input(), jf.mixed_rules(compute)
  abstract = jax.eval_shape(
      lambda: jf.init_with_policies(cls(), rules, jax.random.key(0), x))
  assert param_dtypes(abstract) == {F32}  # params and batch_stats
  variables = tm.linen_init(cls(), x)

  fn, args = linen_forward_backward(cls(), rules, variables, x)
  report = jmp_amp.matmul_report(fn, *args)
  assert len(report) > 0 and report.all_inputs_in(SHORT[half]), str(report)
  # Half outputs: Flax's default dots, half in and out, as in NNX.
  assert {r.result_dtype for r in report} == {SHORT[half]}, str(report)
  (_, (out, updates)), grads = jax.eval_shape(fn, *args)
  assert out.dtype == half
  assert param_dtypes(grads) == {F32}
  assert param_dtypes(updates) <= {F32}


@pytest.mark.parametrize("name", list(LINEN_MODELS))
def test_linen_float32_policy_matches_unpoliced_bit_for_bit(name):
  cls, make_input = LINEN_MODELS[name]
  x = make_input()
  variables = tm.linen_init(cls(), x)
  mutable = [k for k in variables if k != "params"]
  plain = jax.jit(lambda v, x: cls().apply(v, x, mutable=mutable),
                  compiler_options=FAST_COMPILE)(variables, x)
  policied = jax.jit(lambda v, x: jf.apply_with_policies(
      cls(), "float32", v, x, mutable=mutable),
                     compiler_options=FAST_COMPILE)(variables, x)
  assert tree_bytes_equal(plain, policied)


def test_linen_path_rules_inheritance_and_warnings():
  x = tm.image_batch(2)[0]
  module = tm.linen_resnet()
  rules = {"blocks_1": "float32"} | jf.mixed_rules()
  variables = tm.linen_init(module, x)
  fn, args = linen_forward_backward(module, rules, variables, x)
  report = jmp_amp.matmul_report(fn, *args)
  by_scope = {}
  for r in report:
    scope = "blocks_1" if "blocks_1" in (r.name or "") else "other"
    by_scope.setdefault(scope, set()).add((r.lhs_dtype, r.rhs_dtype))
  assert by_scope == {"blocks_1": {("f32", "f32")},
                      "other": {("bf16", "bf16")}}, str(report)
  with pytest.warns(UserWarning, match="'decoder'"):
    jf.apply_with_policies(module, {"decoder": "float32"}, variables, x,
                           mutable=["batch_stats"])


@pytest.mark.slow
def test_linen_policies_stay_inside_their_apply():
  x = tm.mlp_batch(2)[0]
  module = tm.linen_mlp()
  variables = tm.linen_init(module, x)
  apply16 = functools.partial(jf.apply_with_policies, module, "mixed_float16")
  assert apply16(variables, x).dtype == HALF["float16"]
  assert module.apply(variables, x).dtype == F32
  variables16 = jf.init_with_policies(module, "float16", jax.random.key(0), x)
  assert param_dtypes(variables16) == {HALF["float16"]}


def test_linen_and_nnx_mlp_give_the_same_loss_under_a_policy():
  nnx_model = tm.mlp()
  variables = models.linen_params_from_nnx(nnx_model)
  x, y = tm.mlp_batch(16)
  # The last layer is layers/2 in NNX and layers_2 in linen: one rule each,
  # optional, so that neither warns in the model that lacks its path.
  head = "float32"
  rules = PolicyRules({"layers/2": head, "layers_2": head},
                         optional=["layers/2", "layers_2"]) | jf.mixed_rules()
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    linen_out = jf.apply_with_policies(tm.linen_mlp(), rules, variables, x)
    nnx_out = jf.set_policies(nnx_model, rules)(x)
  assert nnx_out.dtype == linen_out.dtype == F32
  # Two differently written models: the same loss within 4 ulps.
  assert_trees_within_ulps(models.mse_loss(nnx_out, y),
                           models.mse_loss(linen_out, y))


def test_matmul_report_on_a_user_module_follows_its_policies():
  # A model class defined outside flax (models.MLP) is still lowered through
  # nnx.jit, so a report after set_policies is neither stale nor an error.
  import models
  model = models.MLP(8, 4, width=16,
                     rngs=nnx.Rngs(jax.random.key(0, impl="rbg")))
  x = jnp.ones((2, 8))
  before = jmp_amp.matmul_report(model, x)
  assert before.input_dtypes() == {"f32"}
  jmp_amp.flax.set_policies(model, jmp_amp.flax.mixed_rules("bfloat16"))
  after = jmp_amp.matmul_report(model, x)
  assert after.input_dtypes() == {"bf16"} and len(after) == 3


# --------------------------------------------------------------------------
# Issue 12: a pinned float32 head gives float32 model outputs.

HEAD_RULES_NNX = {nnx.BatchNorm: "float32", nnx.LayerNorm: "float32",
                  "head": "float32", "*": "mixed_bfloat16"}
HEAD_RULES_LINEN = {nn.BatchNorm: "float32", nn.LayerNorm: "float32",
                    "head": "float32", "*": "mixed_bfloat16"}


class SmallConvNet(nnx.Module):
  """conv + BatchNorm + LayerNorm + linear head."""

  def __init__(self, rngs):
    self.conv = nnx.Conv(3, 8, (3, 3), rngs=rngs)
    self.bn = nnx.BatchNorm(8, use_running_average=False, rngs=rngs)
    self.ln = nnx.LayerNorm(8, rngs=rngs)
    self.head = nnx.Linear(8, tm.CLASSES, rngs=rngs)

  def __call__(self, x):
    x = jax.nn.relu(self.bn(self.conv(x)))
    return self.head(self.ln(x.mean(axis=(1, 2))))


class LinenSmallConvNet(nn.Module):

  @nn.compact
  def __call__(self, x):
    x = jax.nn.relu(nn.BatchNorm(use_running_average=False)(
        nn.Conv(8, (3, 3))(x)))
    return nn.Dense(tm.CLASSES, name="head")(nn.LayerNorm()(
        x.mean(axis=(1, 2))))


def test_pinned_float32_head_gives_float32_outputs_nnx():
  model = jf.set_policies(tm.build(lambda: SmallConvNet(nnx.Rngs(0))),
                          HEAD_RULES_NNX, strict=True)
  x = tm.image_batch(2)[0]
  fn, args = nnx_forward_backward(model, x)
  (_, (out, rest)), grads = jax.eval_shape(fn, *args)
  assert out.dtype == F32
  assert param_dtypes(grads) == {F32}
  assert param_dtypes(nnx.filter_state(rest, nnx.BatchStat)) == {F32}
  assert model(x).dtype == F32
  report = jmp_amp.matmul_report(fn, *args)
  convs = [r for r in report if r.kind == "convolution"]
  assert convs and all(r.lhs_dtype == r.rhs_dtype == "bf16" for r in convs)
  heads = [r for r in report if tm.CLASSES in r.lhs_shape + r.rhs_shape]
  assert heads and all(r.lhs_dtype == r.rhs_dtype == "f32" for r in heads)
  # The catch-all alone leaves a bfloat16 head, hence bfloat16 outputs; an
  # explicit root rule casts the outputs whatever the head computes.
  plain = tm.build(lambda: SmallConvNet(nnx.Rngs(0)))
  assert jf.set_policies(plain, jf.mixed_rules())(x).dtype == HALF["bfloat16"]


def test_pinned_float32_head_gives_float32_outputs_linen():
  module = LinenSmallConvNet()
  x = tm.image_batch(2)[0]
  variables = tm.linen_init(module, x)
  out, updates = jf.apply_with_policies(module, HEAD_RULES_LINEN, variables,
                                        x, mutable=["batch_stats"],
                                        strict=True)
  assert out.dtype == F32 and param_dtypes(updates) == {F32}
  out = jf.apply_with_policies(module, jf.mixed_rules(), variables, x,
                               mutable=["batch_stats"])[0]
  assert out.dtype == HALF["bfloat16"]
  out = jf.apply_with_policies(module, jf.mixed_rules(model_output="f32"),
                               variables, x, mutable=["batch_stats"])[0]
  assert out.dtype == F32


def test_policied_state_tree_equals_the_unpoliced_one():
  for build in (tm.mlp, tm.resnet, tm.gpt, tm.knobless_gpt):
    plain, policied = build(), jf.set_policies(build(), jf.mixed_rules())
    flat = lambda m: [(p, type(v)) for p, v in nnx.to_flat_state(nnx.state(m))]
    assert flat(plain) == flat(policied)
    jf.set_policies(policied, {nnx.Linear: "float16", "*": "float32"})
    jf.clear_policies(policied)
    assert flat(plain) == flat(policied)
    assert nnx.graphdef(plain) == nnx.graphdef(policied)


@pytest.mark.parametrize("layer", ["conv", "linear"])
def test_out_sharding_goes_through_the_jmp_amp_ops_with_half_backward(layer):
  from jax.sharding import AxisType
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P
  rngs = nnx.Rngs(0)
  module = (nnx.Conv(3, 4, (3,), rngs=rngs) if layer == "conv"
            else nnx.Linear(3, 4, rngs=rngs))
  jf.set_policies(module, {"": "p=f32,c=f16,o=f32"})
  knob = module.conv_general_dilated if layer == "conv" else module.dot_general
  assert knob in (jmp_amp.conv_general_dilated, jmp_amp.dot_general)
  graphdef, params = nnx.split(module)
  mesh = jax.make_mesh((1,), ("x",), axis_types=(AxisType.Explicit,))

  def loss(params, x):
    out = nnx.merge(graphdef, params)(x, out_sharding=P("x"))
    return out.sum(), out

  plain_def, plain_params = nnx.split(nnx.Linear(3, 4, rngs=nnx.Rngs(0)))

  def plain_grad_error(x):
    """What JAX itself raises differentiating the unpolicied float32 layer."""
    plain_loss = lambda p, x: nnx.merge(plain_def, p)(
        x, out_sharding=P("x")).sum()
    try:
      jax.jit(jax.grad(plain_loss)).lower(plain_params, x)
    except Exception as e:  # pylint: disable=broad-except
      return e
    return None

  # JAX cannot yet transpose a convolution with an explicit out_sharding (not
  # even in float32, without policies): convolutions are checked forward.
  # Nor can JAX 0.8 a dot whose contracting dimension is sharded (the kernel's
  # gradient here): there the policied layer must fail as the plain one does,
  # and is checked forward.
  forward = lambda p, x: (loss(p, x), None)
  backward = jax.value_and_grad(loss, has_aux=True)
  with jax.set_mesh(mesh):
    x = jax.device_put(jnp.ones((2, 8, 3)), NamedSharding(mesh, P("x")))
    jax_error = plain_grad_error(x) if layer == "linear" else None
    if jax_error is not None:
      with pytest.raises(type(jax_error)):
        jax.jit(backward).lower(params, x)
    check_backward = layer == "linear" and jax_error is None
    fn = backward if check_backward else forward
    report = jmp_amp.matmul_report(fn, params, x)
    (_, out), _ = jax.eval_shape(fn, params, x)
  assert out.dtype == F32
  assert len(report) >= 1 and report.all_inputs_in("f16"), str(report)
  if check_backward:  # forward, and the kernel's gradient in half
    assert len(report) == 2
