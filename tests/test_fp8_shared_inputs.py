"""FP8 layers that share an input still run FP8 GEMMs on an H100 (#24, #48).

The q/k/v projections of self-attention and the gate/up projections of a GLU
read one activation. Under current scaling each quantises it the same way:
XLA quantises it once and merges the GEMMs into one, an FP8 GEMM named after
one of the layers. (With the old dequantised pattern the merged GEMM ran in
bfloat16, and until #48 each matmul added a zero XLA could not fold to keep
them apart.) These tests compile train steps for an H100 without a GPU
(skipped without the CUDA plugin) and check through the audit
(`GpuReport.fp8_fallbacks`) that every FP8 layer's GEMMs are FP8, merged or
not -- and that the audit flags a layer whose GEMM is merged into a bfloat16
one or is not FP8. The CPU tests check that the layers are named in the
program and that the numerics are the plain FP8 rounding's.
"""


import dataclasses

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
import jmp_amp
from jmp_amp._src import fp8 as fp8_lib
import jmp_amp.flax
from jmp_amp.flax import fp8 as flax_fp8
import jmp_amp.tools

D = 64
FP8_LAYERS = ["attn/query", "attn/key", "attn/value", "attn/out", "gate",
              "up", "down", "mix"]
RECIPES = {"current": jmp_amp.fp8.FP8Recipe(),
           "delayed": jmp_amp.fp8.FP8Recipe(scaling="delayed", history_len=4),
           "rowwise": jmp_amp.fp8.FP8Recipe(scaling="rowwise")}


class Block(nnx.Module):
  """Self-attention (q/k/v read one input) and a GLU MLP (gate/up do too)."""

  def __init__(self, rngs):
    self.embed = nnx.Linear(D, D, rngs=rngs)  # first matmul: stays bf16
    self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=D,
                                       decode=False, rngs=rngs)
    self.gate = nnx.Linear(D, 2 * D, rngs=rngs)
    self.up = nnx.Linear(D, 2 * D, rngs=rngs)
    self.down = nnx.Linear(2 * D, D, rngs=rngs)
    self.mix = nnx.Einsum("btd,de->bte", (D, D), rngs=rngs)
    self.head = nnx.Linear(D, 8, rngs=rngs)  # last matmul: stays bf16

  def __call__(self, x):
    x = self.embed(x)
    x = x + self.attn(x)
    x = x + self.down(jax.nn.silu(self.gate(x)) * self.up(x))
    return self.head(self.mix(x))


def _x():
  return jax.ShapeDtypeStruct((4, 16, D), jnp.float32)


def _model(recipe):
  model = Block(nnx.Rngs(0))
  rules = {"*": flax_fp8.FP8Policy(recipe)}
  if recipe.scaling == "rowwise":  # dot_general only: not nnx.Einsum
    rules["mix"] = "bfloat16"
  return jmp_amp.flax.set_policies(model, rules, example_args=(_x(),))


def _fp8_layers(scaling):
  return [p for p in FP8_LAYERS if scaling != "rowwise" or p != "mix"]


def _train_step(model):
  graphdef, state = nnx.split(model)

  def step(state, x):
    m = nnx.merge(graphdef, state)
    loss, grads = flax_fp8.value_and_grad(
        lambda m: jnp.mean(m(x).astype(jnp.float32) ** 2))(m)
    return loss, grads, nnx.state(m)

  return step, state


# --------------------------------------------------------------------------
# CPU: the layers are named, the numerics are FP8's.


def test_fp8_layers_are_named_in_the_lowered_program():
  model = _model(RECIPES["current"])
  assert sorted(flax_fp8.histories(model)) == sorted(FP8_LAYERS)
  step, state = _train_step(model)
  report = jmp_amp.matmul_report(step, state, _x())
  layers = report.fp8_layers()
  assert sorted(layers) == sorted(FP8_LAYERS)
  # Forward, input gradient and weight gradient of each layer, each a dot
  # of FP8 operands.
  for layer in FP8_LAYERS:
    assert sum(layers[layer].values()) == 3, (layer, layers[layer])
  # Not FP8: the first layer (forward and weight gradient: the input needs
  # no gradient), the last (three) and the two attention contractions
  # (three each).
  assert sum(r.fp8_layer is None for r in report) == 2 + 3 + 2 * 3


@pytest.mark.parametrize("scaling", ["current", "rowwise"])
def test_fp8_matmuls_of_one_signature_share_one_trace(scaling):
  """Each FP8 matmul is one jitted call per signature, traced once: a
  model's repeated layers reuse the trace (tracing each layer's again took a
  16-block GPT's step half a second to a second; issue #33), and the
  lowered program still names each call's layer."""
  recipe = RECIPES[scaling]
  # The first layer reads f32, the next two bf16 (the previous output), the
  # last has another shape: three signatures.
  ws = [jnp.ones((8, 8))] * 3 + [jnp.ones((8, 4))]

  def loss(ws, x):
    for i, w in enumerate(ws):
      with jax.named_scope(f"fp8[l{i}]"):
        x = jmp_amp.fp8.dot_general(x, w, (((1,), (0,)), ((), ())),
                                    recipe=recipe)
    return jnp.sum(x.astype(jnp.float32))
  x = jnp.ones((2, 8))
  calls = [e for e in jax.make_jaxpr(loss)(ws, x).jaxpr.eqns
           if "jaxpr" in e.params]
  assert len(calls) == len(ws)
  assert len({id(e.params["jaxpr"]) for e in calls}) == 3
  layers = jmp_amp.matmul_report(jax.grad(loss), ws, x).fp8_layers()
  assert sorted(layers) == ["l0", "l1", "l2", "l3"], layers
  # The middle layers: forward, input and weight gradients.
  assert all(sum(layers[l].values()) == 3 for l in ("l1", "l2")), layers


def _qdq(x, dtype=jnp.bfloat16):
  """The plain FP8 rounding, quantize then dequantize (current scaling)."""
  scale = fp8_lib.compute_scale(fp8_lib.amax(x), fp8_lib.E4M3)
  return fp8_lib.dequantize(fp8_lib.quantize(x, fp8_lib.E4M3, scale), scale,
                            dtype)


@pytest.mark.parametrize("scaling", ["current", "delayed"])
def test_fp8_matmul_is_the_product_of_the_rounded_operands(scaling):
  recipe = RECIPES[scaling]
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(8, 32)) * 3, jnp.float32)
  w = jnp.asarray(rng.normal(size=(32, 16)), jnp.float32)
  # A non-finite value in one operand does not change the other's
  # rounding.
  w_bad = w.at[0, 0].set(jnp.inf)
  state = fp8_lib.init_state(recipe)
  dn = (((1,), (0,)), ((), ()))
  for rhs in (w, w_bad):
    got = jmp_amp.fp8.dot_general(x, rhs, dn, state=state, recipe=recipe)
    # The rounded operands, multiplied exactly; the bf16 result is within
    # one bf16 rounding of the GEMM's bf16 output (2**-8 relative each).
    want = jax.lax.dot_general(_qdq(x, jnp.float32),
                               _qdq(rhs, jnp.float32), dn,
                               precision="highest")
    np.testing.assert_allclose(np.asarray(got, np.float32), want,
                               rtol=2.0**-7, atol=1e-6)


def _fp8_ops(layers, width=1, lhs="float8_e4m3fn"):
  """A report of one FP8 matmul per layer, `width` times the usual size
  (a merged GEMM does the FLOPs of the layers merged into it)."""
  def f(x, w):
    outs = []
    for name in layers:
      with jax.named_scope(f"fp8[{name}]"):
        outs.append(jax.lax.dot_general(
            x, jnp.tile(w, (1, width)), (((1,), (0,)), ((), ())),
            preferred_element_type=jnp.bfloat16))
    return outs
  f8 = jax.ShapeDtypeStruct((8, 16), jnp.float8_e4m3fn)
  report = jmp_amp.matmul_report(f, f8, jax.ShapeDtypeStruct(
      (16, 4), jnp.float8_e4m3fn))
  return jmp_amp.tools.MatmulReport(
      [dataclasses.replace(r, lhs_dtype=lhs, rhs_dtype=lhs) for r in report],
      "compiled")


def test_audit_clears_layers_merged_into_an_fp8_gemm_only():
  asked = _fp8_ops(["q", "k", "v"])
  asked = jmp_amp.tools.MatmulReport(asked.records, "lowered")
  # Merged into one FP8 GEMM named after v: three layers' FLOPs in one.
  assert _fp8_ops(["v"], width=3).fp8_fallbacks(asked) == {}
  # Each its own GEMM: nothing to clear.
  assert _fp8_ops(["q", "k", "v"]).fp8_fallbacks(asked) == {}
  why = ("1 matmuls asked for, 0 compiled (merged into a GEMM that is not "
         "FP8, or removed)")
  # Merged into a bfloat16 GEMM: v's is not FP8, q's and k's are gone.
  merged_bf16 = _fp8_ops(["v"], width=3, lhs="bf16").fp8_fallbacks(asked)
  assert sorted(merged_bf16) == ["k", "q", "v"]
  assert merged_bf16["q"] == merged_bf16["k"] == why
  # k removed: no FP8 GEMM did its FLOPs.
  assert _fp8_ops(["q", "v"]).fp8_fallbacks(asked) == {"k": why}
  # k merged into v's GEMM, q removed: what v gained does not cover both.
  assert sorted(_fp8_ops(["v"], width=2).fp8_fallbacks(asked)) == ["k", "q"]


# --------------------------------------------------------------------------
# H100, compiled without a GPU.


@pytest.mark.parametrize("scaling", ["current", "delayed", "rowwise"])
def test_every_fp8_layer_compiles_to_fp8_gemms(scaling):
  helpers.h100_target_or_skip()
  step, state = _train_step(_model(RECIPES[scaling]))
  report = jmp_amp.gpu_report(step, state, _x())
  assert report.fp8_fallbacks() == {}
  expected = _fp8_layers(scaling)
  # Forward, input and weight gradient of each layer asked for; the
  # compiled GEMMs (some merged: fewer, larger) are all FP8 and do the
  # same FLOPs.
  assert sorted(report.lowered.fp8_layers()) == sorted(expected)
  assert all(sum(ops.values()) == 3
             for ops in report.lowered.fp8_layers().values())
  assert set(report.fp8_layers()) <= set(expected)
  fp8_flops = lambda rep: sum(r.flops for r in rep if r.fp8_layer)
  assert fp8_flops(report.matmuls) == fp8_flops(report.lowered)
  # Forward E4M3 x E4M3; both gradients take the E5M2 output gradient.
  kinds = helpers.fp8_gemm_kinds(report.gemms_by_dtype())
  assert 0 < kinds["forward"] <= len(expected)
  assert 0 < kinds["backward"] <= 2 * len(expected)


def _assert_fp8_gemms_only(report, asked):
  """Every GEMM of `report` is FP8 (E4M3 forward, an E5M2 gradient
  backward), `asked` matmuls were lowered, and the GEMMs (fewer if XLA
  merged some) do their FLOPs."""
  kinds = helpers.fp8_gemm_kinds(report.gemms_by_dtype())
  assert set(kinds) == {"forward", "backward"}, kinds
  assert len(report.lowered) == asked
  assert report.matmuls.total_flops == report.lowered.total_flops


def test_autocast_fp8_matmuls_sharing_an_input_stay_fp8():
  helpers.h100_target_or_skip()

  def loss(ws, x):
    q, k, v = (x @ w for w in ws)
    return jnp.sum(jnp.tanh(jax.nn.silu(q) * k + v))

  w = jax.ShapeDtypeStruct((D, D), jnp.float32)
  x = jax.ShapeDtypeStruct((32, D), jnp.float32)
  grad = jax.grad(jmp_amp.autocast(loss, "float8"))
  report = jmp_amp.gpu_report(grad, (w, w, w), x)
  # Forward and weight gradient of each of the three (x needs no gradient),
  # merged or not: FP8 GEMMs only, doing every FLOP asked for.
  _assert_fp8_gemms_only(report, asked=6)


def test_linen_under_autocast_fp8_keeps_shared_input_gemms_fp8():
  # Linen rules have no FP8 modules; linen models get FP8 from autocast.
  helpers.h100_target_or_skip()
  import flax.linen as nn  # pylint: disable=g-import-not-at-top

  class GLU(nn.Module):

    @nn.compact
    def __call__(self, x):
      h = jax.nn.silu(nn.Dense(2 * D, name="gate")(x)) * nn.Dense(
          2 * D, name="up")(x)
      return nn.Dense(D, name="down")(h)

  x = jax.ShapeDtypeStruct((32, D), jnp.float32)
  params = jax.eval_shape(GLU().init, jax.random.key(0), x)
  loss = lambda p, x: jnp.sum(jnp.tanh(GLU().apply(p, x)))
  report = jmp_amp.gpu_report(
      jax.grad(jmp_amp.autocast(loss, "float8")), params, x)
  # gate, up, down forward and weight gradients; down's input gradient.
  _assert_fp8_gemms_only(report, asked=7)


def _dequantized_layers(x, ws):
  outs = []
  for name, w in ws.items():
    with jax.named_scope(f"fp8[{name}]"):
      outs.append(_qdq(x) @ _qdq(w))
  return sum(jnp.tanh(o.astype(jnp.float32)) for o in outs)


def test_audit_flags_fp8_gemms_merged_into_a_bf16_gemm():
  helpers.h100_target_or_skip()
  w = jax.ShapeDtypeStruct((D, D), jnp.float32)
  x = jax.ShapeDtypeStruct((32, D), jnp.float32)
  report = jmp_amp.gpu_report(_dequantized_layers, x, {"q": w, "k": w, "v": w})
  # XLA merges the three into one bf16 GEMM named after one of them.
  assert report.gemms_by_dtype() == {"bf16 x bf16 -> bf16": 1}
  flagged = report.fp8_fallbacks()
  assert sorted(flagged) == ["k", "q", "v"]
  merged = ("1 matmuls asked for, 0 compiled (merged into a GEMM that is "
            "not FP8, or removed)")
  assert sorted(flagged.values()) == sorted(
      ["1 of 1 ops not FP8 (1 x bf16 x bf16 -> bf16)", merged, merged])
  # Without the lowered program, only the bf16 GEMM itself is seen.
  assert len(report.matmuls.fp8_fallbacks()) == 1


def test_audit_flags_a_layer_left_in_bf16():
  helpers.h100_target_or_skip()

  def f(x, w, v):
    with jax.named_scope("fp8[proj]"):
      y = jmp_amp.fp8.dot_general(x, w, (((1,), (0,)), ((), ())))
    with jax.named_scope("fp8[other]"):
      return jnp.tanh(y) @ v.astype(jnp.bfloat16)

  w = jax.ShapeDtypeStruct((D, D), jnp.float32)
  x = jax.ShapeDtypeStruct((32, D), jnp.float32)
  report = jmp_amp.gpu_report(f, x, w, w)
  layers = report.fp8_layers()
  assert helpers.fp8_gemm_kinds(layers["proj"]) == {"forward": 1}
  assert layers["other"] == {"bf16 x bf16 -> bf16": 1}
  assert report.fp8_fallbacks() == {
      "other": "1 of 1 ops not FP8 (1 x bf16 x bf16 -> bf16)"}
