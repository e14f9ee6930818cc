"""The reference GPT with its blocks under nnx.scan (``scan_layers=True``).

Every feature must work on a scanned model (issue #33): precision policies,
loss scaling, 16-bit optimizer state, FP8 (per-layer amax histories stacked
like the params), telemetry and checkpoints.
"""

import functools

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_amp
import jmp_amp.flax
from jmp_amp.models import gpt

LAYERS = 3
CONFIG = dict(vocab_size=64, d_model=32, num_heads=2, num_layers=LAYERS,
              max_len=16)
TOKENS = (jnp.arange(64, dtype=jnp.int32).reshape(4, 16) * 7) % 64


def models():
  """(unscanned, scanned) GPTs with the same weights."""
  plain = gpt.GPT(**CONFIG, rngs=nnx.Rngs(0))
  scanned = gpt.GPT(**CONFIG, scan_layers=True, rngs=nnx.Rngs(1))
  blocks = nnx.state(plain.blocks)
  stacked = jax.tree.map(lambda *xs: jnp.stack(xs),
                         *[blocks[i] for i in range(LAYERS)])
  nnx.update(scanned.blocks, stacked)
  for name in ("embed", "pos_embed", "ln_f"):
    # Copies: the train step donates each model's buffers.
    nnx.update(getattr(scanned, name), jax.tree.map(
        jnp.copy, nnx.state(getattr(plain, name))))
  return plain, scanned


def loss_fn(model, tokens):
  return gpt.lm_loss(model(tokens), tokens)


def train(model, tx, steps=4, **step_kwargs):
  opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
  step = jmp_amp.flax.make_train_step(loss_fn, **step_kwargs)
  return [step(model, opt, TOKENS) for _ in range(steps)], opt


def test_scanned_params_are_stacked_and_the_forward_pass_matches():
  plain, scanned = models()
  kernel = scanned.blocks.attn.qkv.kernel[...]
  assert kernel.shape == (LAYERS, 32, 96)
  np.testing.assert_allclose(scanned(TOKENS), plain(TOKENS), rtol=1e-5,
                             atol=1e-5)


@pytest.mark.slow  # a few train-step compiles: ~20-60 s each
@pytest.mark.parametrize("rules,rtol", [
    # float32: the same computation; only XLA's reassociation differs.
    (None, 1e-5),
    # bfloat16: the scanned body is fused and rounded in another order; the
    # roundings (2**-8 relative) compound through 4 Adam steps at lr 1e-2.
    ("mixed", 2e-2)])
def test_loss_trajectory_with_loss_scaling_matches_unscanned(rules, rtol):
  losses = []
  for model in models():
    if rules:
      jmp_amp.flax.set_policies(model, jmp_amp.flax.mixed_rules("bfloat16"))
    metrics, _ = train(model, jmp_amp.loss_scaling(
        optax.adamw(1e-2), jmp_amp.DynamicLossScale(2.0 ** 15)))
    assert [int(m["skipped_steps"]) for m in metrics] == [0] * 4
    losses.append([float(m["loss"]) for m in metrics])
  if rules:
    policies = jmp_amp.flax.get_policies(model)
    assert str(policies["blocks/ln1"]) == "p=f32,c=f32,o=f32"
    assert str(policies["blocks/attn/qkv"]) == "p=f32,c=bf16,o=bf16"
  np.testing.assert_allclose(losses[1], losses[0], rtol=rtol)
  assert losses[1][-1] < losses[1][0] - 0.05


@pytest.mark.slow  # a few train-step compiles: ~20-60 s each
def test_16bit_state_and_params_train_on_the_scanned_model():
  _, model = models()
  jmp_amp.flax.set_policies(model, jmp_amp.flax.mixed_rules(
      "bfloat16", param="bfloat16", norms="p=bf16,c=f32,o=f32"))
  tx = optax.chain(jmp_amp.optim.compress_state(optax.adamw(1e-2)),
                   jmp_amp.optim.low_precision_params())
  metrics, opt = train(model, jmp_amp.loss_scaling(tx, jmp_amp.NoOpLossScale()))
  assert model.blocks.mlp.fc.kernel[...].dtype == jnp.bfloat16
  assert model.blocks.mlp.fc.kernel[...].shape == (LAYERS, 32, 128)
  mu = opt.opt_state.inner_state[0].inner_state[0].mu["blocks"]["mlp"]["fc"]
  assert mu["kernel"][...].dtype == jnp.bfloat16
  assert float(metrics[-1]["loss"]) < float(metrics[0]["loss"]) - 0.05


@pytest.mark.slow  # a few train-step compiles: ~20-60 s each
@pytest.mark.parametrize("recipe", [
    jmp_amp.fp8.FP8Recipe(),
    jmp_amp.fp8.FP8Recipe(scaling="delayed", history_len=4)])
def test_fp8_histories_are_stacked_per_layer_and_train(recipe):
  _, model = models()
  policy = jmp_amp.flax.fp8.FP8Policy(recipe, keep_first_last=False)
  jmp_amp.flax.set_policies(model, {"*": policy}, example_args=(TOKENS,))
  histories = jmp_amp.flax.fp8.histories(model)
  assert sorted(histories) == ["blocks/attn/proj", "blocks/attn/qkv",
                               "blocks/mlp/fc", "blocks/mlp/out"]
  length = recipe.history_len
  assert histories["blocks/mlp/fc"].lhs.shape == (LAYERS, length)
  metrics, _ = train(model, jmp_amp.loss_scaling(optax.adamw(1e-2),
                                                 jmp_amp.NoOpLossScale()))
  assert float(metrics[-1]["loss"]) < float(metrics[0]["loss"]) - 0.05
  lhs = np.asarray(jmp_amp.flax.fp8.histories(model)["blocks/mlp/fc"].lhs)
  # Each layer recorded the amax of its own input: positive, not all equal.
  assert np.all(lhs[:, 0] > 0) and len(set(lhs[:, 0].tolist())) == LAYERS


def test_fp8_first_last_of_a_scanned_stack_raises():
  _, model = models()
  with pytest.raises(ValueError, match=r"'blocks/attn/qkv' is stacked .*"
                     r"keep_first_last=False"):
    jmp_amp.flax.set_policies(model, {"*": "float8"}, example_args=(TOKENS,))


@pytest.mark.slow  # a few train-step compiles: ~20-60 s each
def test_telemetry_reports_the_scanned_block_modules():
  _, model = models()
  jmp_amp.flax.set_policies(model, "mixed_bfloat16")
  metrics, _ = train(model, jmp_amp.loss_scaling(
      optax.adamw(1e-2), jmp_amp.NoOpLossScale()), steps=1, numerics="**")
  stats = metrics[0]["numerics"]
  assert {"blocks/attn/qkv", "blocks/mlp/fc"} <= set(stats)
  assert stats["blocks/mlp/fc"]["grad"]


@pytest.mark.slow  # a few train-step compiles: ~20-60 s each
def test_checkpoint_round_trip_of_a_scanned_model(tmp_path):
  checkpoint = pytest.importorskip("jmp_amp.checkpoint")
  _, model = models()
  jmp_amp.flax.set_policies(model, "mixed_bfloat16")
  _, opt = train(model, jmp_amp.loss_scaling(
      optax.adamw(1e-2), jmp_amp.DynamicLossScale(2.0 ** 15)), steps=2)
  checkpoint.save(str(tmp_path), {"model": model, "opt": opt}, step=2)
  _, fresh = models()
  jmp_amp.flax.set_policies(fresh, "mixed_bfloat16")
  fresh_opt = nnx.Optimizer(fresh, jmp_amp.loss_scaling(
      optax.adamw(1e-2), jmp_amp.DynamicLossScale(2.0 ** 15)), wrt=nnx.Param)
  _, step = checkpoint.restore_latest(str(tmp_path),
                                      target={"model": fresh, "opt": fresh_opt})
  assert step == 2
  for a, b in zip(jax.tree.leaves(nnx.state(fresh)),
                  jax.tree.leaves(nnx.state(model))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
