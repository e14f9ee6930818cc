"""Fused attention (issue #34): the GPT's `attention="fused"`, autocast's
"dot_product_attention" rule, and the audit's fused attention records.

The CPU runs XLA's implementation of `jax.nn.dot_product_attention`; the
tests compiled for an H100 (the ``gpu-audit`` extra, with cuDNN installed)
check that the same programs carry cuDNN's flash attention call there. The
fixture test reads a recorded XLA:GPU program and always runs.
"""

import functools
import os

from flax import nnx
import jax
import jax.numpy as jnp
from jmp_amp.models import data as data_lib
from jmp_amp.models import gpt as gpt_lib
import numpy as np
import optax
import pytest

import helpers
import jmp_amp
import jmp_amp.flax
from jmp_amp.tools import gpu_target
from jmp_amp.tools.bench import workloads

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
KW = dict(vocab_size=64, d_model=64, num_heads=4, num_layers=2, max_len=32)
TOKENS = data_lib.token_batch(2, 32, 64, seed=0)
dpa = jax.jit(jax.nn.dot_product_attention,
              static_argnames=("is_causal", "implementation"))


def _qkv(dtype=jnp.float32, shape=(2, 32, 4, 16)):
  keys = jax.random.split(jax.random.key(0), 3)
  return [jax.random.normal(k, shape, dtype) for k in keys]


def _logits(attention, rules=None):
  model = gpt_lib.GPT(**KW, attention=attention, rngs=nnx.Rngs(0))
  if rules is not None:
    jmp_amp.flax.set_policies(model, rules)
  out = nnx.jit(lambda m, t: m(t))(model, TOKENS)
  return np.asarray(out.astype(jnp.float32))


# ---- The model's knob. ------------------------------------------------------


def test_fused_gpt_matches_einsum_gpt_in_float32():
  fused, einsum = _logits("fused"), _logits("einsum")
  # Same math, other contraction order: float32 rounding only.
  np.testing.assert_allclose(fused, einsum, atol=2e-6, rtol=0)


@pytest.mark.slow  # two GPTs' compiles per dtype: ~10 s
@pytest.mark.parametrize("half", ["bfloat16", "float16"])
def test_fused_gpt_under_a_policy_matches_float32_within_half_tolerance(half):
  ref = _logits("einsum")
  rules = jmp_amp.flax.mixed_rules(half)
  fused, einsum = _logits("fused", rules), _logits("einsum", rules)
  scale = np.abs(ref).max()  # about 0.6
  # bf16 keeps 8 bits (2**-8 = 0.004 relative), f16 11; a few roundings deep.
  tol = {"bfloat16": 0.03, "float16": 0.004}[half] * scale
  assert np.abs(fused - ref).max() < tol
  assert np.abs(einsum - ref).max() < tol
  # The fused softmax runs in float32: no further than the einsum one.
  assert np.abs(fused - ref).max() <= 1.5 * np.abs(einsum - ref).max()


def test_bad_attention_knob_names_the_choices():
  with pytest.raises(ValueError, match=r"attention must be one of \('fused', "
                     r"'einsum'\), got 'flash'"):
    gpt_lib.GPT(**KW, attention="flash", rngs=nnx.Rngs(0))


def test_fused_attention_is_one_jitted_call_in_the_jaxpr():
  q, k, v = _qkv()
  jaxpr = jax.make_jaxpr(gpt_lib.fused_causal_attention)(q, k, v)
  calls = [e for e in jaxpr.eqns if e.params.get("name") ==
           "dot_product_attention"]
  assert len(calls) == 1 and len(jaxpr.eqns) == 1


@functools.lru_cache(maxsize=None)
def _train_losses(mode, attention, steps=4):
  """Adam on one batch: the losses of `steps` steps."""
  model = gpt_lib.GPT(**KW, attention=attention, rngs=nnx.Rngs(0))
  step, state = workloads.nnx_step(
      model, gpt_lib.lm_loss, workloads.JAX_MODES[mode], optax.adam(1e-2),
      example_args=(TOKENS,))
  losses = []
  for _ in range(steps):
    state, metrics = step(state, (TOKENS, TOKENS))
    losses.append(float(metrics["loss"]))
  return np.array(losses)


# The fused GPT under each way its attention runs in half precision, trained
# against the float32 einsum GPT: bfloat16 and float16 (with loss scaling) by
# a policy, and autocast's "dot_product_attention" rule. (Autocast to float16
# is the same rule at the other half: its forward pass is checked in the
# autocast tests below. FP8 models keep attention in bfloat16; the FP8 GPT,
# fused by default, trains against the bfloat16 one in tests/test_fp8.py.)
@pytest.mark.slow  # About 25 s a mode on two CPU cores.
@pytest.mark.parametrize("mode", ["mixed_bfloat16", "mixed_float16",
                                  "autocast-mixed_bfloat16"])
def test_fused_gpt_trains_like_the_einsum_gpt(mode):
  fused = _train_losses(mode, "fused")
  ref = _train_losses("float32", "einsum")
  assert np.all(np.isfinite(fused)) and fused[-1] < fused[0] - 0.2
  # Loss about 4.2: bf16/FP8 rounding moves it in the second decimal.
  tol = 0.02 if "mixed_float16" in mode else 0.05
  np.testing.assert_allclose(fused, ref, atol=tol, rtol=0)


# ---- Autocast's rule. -------------------------------------------------------


@pytest.mark.parametrize("is_causal", [True, False])
@pytest.mark.parametrize("half", [jnp.bfloat16, jnp.float16])
def test_autocast_runs_jitted_attention_on_half_inputs(is_causal, half):
  q, k, v = _qkv()
  f = functools.partial(dpa, is_causal=is_causal)
  ref = f(q, k, v)
  out = jmp_amp.autocast(f, jmp_amp.Policy(jnp.float32, half, half))(q, k, v)
  assert out.dtype == half
  # What the fused op does: half inputs, float32 softmax, half result (on
  # the CPU, float16 through float32 copies: XLA:CPU has no f16 x f16 -> f32
  # dot).
  halves = [a.astype(half) for a in (q, k, v)]
  want = (f(*halves) if half == jnp.bfloat16 else
          f(*(a.astype(jnp.float32) for a in halves)).astype(half))
  np.testing.assert_array_equal(np.asarray(out, np.float32),
                                np.asarray(want, np.float32))
  tol = {jnp.bfloat16: 0.03, jnp.float16: 0.004}[half]
  np.testing.assert_allclose(np.asarray(out, np.float32), ref, atol=tol)


def test_autocast_attention_rule_float32_and_none():
  q, k, v = _qkv()
  f = functools.partial(dpa, is_causal=True)
  rules = jmp_amp.AutocastRules()
  policy = jmp_amp.Policy(jnp.float32, jnp.bfloat16, jnp.bfloat16)
  as_f32 = jmp_amp.autocast(f, "p=f32,c=bf16,o=f32",
                            rules=rules.with_float32("dot_product_attention"))
  np.testing.assert_array_equal(as_f32(q, k, v), f(q, k, v))
  # On no list: the ops inside follow their own rules, as for any jit (the
  # scores' dot in bf16, the softmax in float32).
  per_op = jmp_amp.autocast(f, policy,
                            rules=rules.without("dot_product_attention"))
  text = str(jax.make_jaxpr(per_op)(q, k, v))
  assert "dot_general" in text and "bf16" in text
  assert per_op(q, k, v).dtype == jnp.bfloat16


def test_autocast_leaves_other_attention_calls_to_the_per_op_rules():
  q, k, v = _qkv()
  mask = jnp.tril(jnp.ones((32, 32), bool))
  masked = lambda q, k, v: dpa(q, k, v, mask=mask)
  policy = jmp_amp.Policy(jnp.float32, jnp.bfloat16, jnp.float32)
  out = jmp_amp.autocast(masked, policy)(q, k, v)
  # Not JAX's call of (q, k, v) alone: not taken as the fused op, yet right.
  np.testing.assert_allclose(out, masked(q, k, v), atol=0.03)


@pytest.mark.slow
def test_autocast_gpt_gradients_match_float32():
  model = gpt_lib.GPT(**KW, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  loss = lambda s, t: gpt_lib.lm_loss(nnx.merge(graphdef, s)(t), t)
  want = jax.jit(jax.grad(loss))(state, TOKENS)
  got = jax.jit(jax.grad(jmp_amp.autocast(loss, jnp.bfloat16)))(state, TOKENS)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.dtype == jnp.float32
    assert np.abs(g - w).max() <= 0.03 * np.abs(w).max() + 1e-6


# ---- The audit. -------------------------------------------------------------


def test_audit_reads_cudnn_attention_as_fused_calls_not_gemms():
  with open(os.path.join(FIXTURES, "h100_bf16_attention_grad.hlo.txt")) as f:
    report = gpu_target.report_from_hlo(f.read())
  # Causal attention of q, k, v [2, 128, 2, 64] in bf16, and its gradient.
  assert report.gemms_by_dtype() == {"attention bf16 x bf16 -> bf16": 2}
  fwd, bwd = report.matmuls.attention
  assert (fwd.target, bwd.target) == ("__cudnn$fmhaSoftmax",
                                      "__cudnn$fmhaSoftmaxBackward")
  assert fwd.lhs_shape == (2, 128, 2, 64)
  scores = 2 * 2 * 128 * 128  # batch x heads x T x S
  assert (fwd.flops, bwd.flops) == (4 * scores * 64, 10 * scores * 64)
  summary = report.summary()
  assert summary["gemms"] == 0 and summary["attention_calls"] == 2
  assert summary["gemm_flops_by_input_dtype"] == {"bf16": 14 * scores * 64}
  assert "fused attention calls: 2" in str(report)


# ---- Compiled for an H100 (needs the CUDA plugin and cuDNN). ----------------


def _h100_or_skip():
  helpers.h100_target_or_skip()
  bf16 = jax.ShapeDtypeStruct((2, 32, 4, 64), jnp.bfloat16)
  try:
    jax.eval_shape(functools.partial(dpa, implementation="cudnn"),
                   bf16, bf16, bf16)
  except RuntimeError as e:
    pytest.skip(f"cuDNN is not installed (nvidia-cudnn-cu12): {e}")


def _gpt_step_report(mode, **kw):
  # Head dim 64: one cuDNN takes.
  model = gpt_lib.GPT(**{**KW, "d_model": 128, "num_heads": 2},
                      rngs=nnx.Rngs(0), **kw)
  step, state = workloads.nnx_step(
      model, gpt_lib.lm_loss, workloads.JAX_MODES[mode], optax.adam(1e-3),
      example_args=(TOKENS,))
  return gpu_target.gpu_report(step, state, (TOKENS, TOKENS), gemm="default")


@pytest.mark.parametrize("mode", [
    "mixed_bfloat16", pytest.param("mixed_float16", marks=pytest.mark.slow),
    pytest.param("autocast-mixed_bfloat16", marks=pytest.mark.slow),
    pytest.param("float8", marks=pytest.mark.slow)])
def test_h100_gpt_step_runs_cudnn_flash_attention(mode):
  _h100_or_skip()
  report = _gpt_step_report(mode)
  kinds = report.kernels_by_kind
  # Two blocks: one forward and one backward call each.
  assert kinds["__cudnn$fmhaSoftmax"] == 2
  assert kinds["__cudnn$fmhaSoftmaxBackward"] == 2
  half = "f16" if "mixed_float16" in mode else "bf16"
  assert report.gemms_by_dtype()[f"attention {half} x {half} -> {half}"] == 4
  # The lowered program asked for them too: no GEMM went missing.
  assert len(report.lowered.attention) == 4


def test_h100_float32_gpt_step_keeps_xla_attention():
  _h100_or_skip()
  report = _gpt_step_report("float32")
  assert not report.matmuls.attention
  assert not any("fmha" in k for k in report.kernels_by_kind)
