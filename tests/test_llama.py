"""The Llama-style reference model: the model itself, and every feature on it.

`jmp_amp.models.Llama` knows nothing of jmp_amp; here each feature is applied
from outside (issue #53): through `jmp_amp.flax.make_train_step` and through
a step written by hand the way a user writes one (`nnx.jit`, `nnx.Optimizer`,
`jmp_amp.scaled_value_and_grad`). The model runs scanned and rematerialised,
as a Llama is trained; the tiny config keeps the CPU compiles short.
"""

import functools

from flax import nnx
import jax
import jax.numpy as jnp
from jmp_amp.models import Llama
from jmp_amp.models import llama as llama_lib
from jmp_amp.models import LlamaConfig
from jmp_amp.models import lm_loss
import numpy as np
import optax
import pytest

import helpers
import jmp_amp
import jmp_amp.flax
import jmp_amp.numerics

CONFIG = LlamaConfig.preset("tiny")
LAYERS = CONFIG.num_layers
REMAT = "dots_with_no_batch_dims_saveable"
FP8 = jmp_amp.flax.fp8.FP8Policy
RECIPE = jmp_amp.fp8.FP8Recipe


def sequences(seed, batch=8):
  """Arithmetic sequences mod the vocabulary, a stride of 1 to 3 each: the
  next token follows from the two before it."""
  rng = np.random.default_rng(seed)
  start = rng.integers(0, CONFIG.vocab_size, (batch, 1))
  stride = rng.integers(1, 4, (batch, 1))
  t = np.arange(CONFIG.max_len)[None]
  return jnp.asarray((start + stride * t) % CONFIG.vocab_size, jnp.int32)


BATCHES = [sequences(seed) for seed in range(8)]
TOKENS = BATCHES[0]


def loss_fn(model, tokens):
  return lm_loss(model(tokens), tokens)


def build(scan=True, remat=REMAT, seed=0, config=CONFIG):
  return Llama(config, scan_layers=scan, remat=remat, rngs=nnx.Rngs(seed))


# Two blocks, for the checks that build the unscanned model (its compiles
# and its op-by-op replay grow with the blocks) and need only a block
# before and after another.
TWO = LlamaConfig.preset("tiny", num_layers=2)


def copy_weights(src, dst):
  """Puts `src`'s weights into `dst` (stacking or unstacking the blocks)."""
  state = jax.tree.map(jnp.copy, nnx.state(src))
  layers = src.config.num_layers
  if src.scan_layers == dst.scan_layers:
    nnx.update(dst, state)
    return dst
  blocks = state.pop("blocks")
  if src.scan_layers:
    blocks = {i: jax.tree.map(lambda x, i=i: x[i], blocks)
              for i in range(layers)}
  else:
    blocks = jax.tree.map(lambda *xs: jnp.stack(xs),
                          *[blocks[i] for i in range(layers)])
  nnx.update(dst, state)
  nnx.update(dst.blocks, blocks)
  return dst


# --------------------------------------------------------------------------
# The model.


def test_the_1b_preset_has_a_billion_parameters_counted_without_allocating():
  config = LlamaConfig.preset("1b")
  model = nnx.eval_shape(lambda: Llama(config, scan_layers=True,
                                       rngs=nnx.Rngs(0)))
  params = nnx.state(model, nnx.Param)
  count = sum(x.size for x in jax.tree.leaves(params))
  assert count == config.num_params() == 1_123_117_056
  assert model.blocks.attn.q.kernel.shape == (22, 2048, 2048)
  assert model.blocks.attn.k.kernel.shape == (22, 2048, 512)  # 4 kv heads
  assert model.blocks.mlp.gate.kernel.shape == (22, 2048, 5632)
  assert model.head.kernel.shape == (2048, 32000)  # untied
  assert (config.num_heads, config.max_len) == (16, 2048)


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_heads=4, num_kv_heads=3), r"num_heads=4 is not divisible by "
     r"num_kv_heads=3"),
    (dict(d_model=30, num_heads=4), r"d_model=30 is not divisible by "
     r"num_heads=4"),
    (dict(d_model=12, num_heads=4, num_kv_heads=1), r"head dim 3 must be "
     r"even"),
])
def test_config_refuses_shapes_it_cannot_build(kwargs, match):
  with pytest.raises(ValueError, match=match):
    LlamaConfig(**kwargs)


def test_unknown_presets_and_remat_policies_are_named():
  with pytest.raises(ValueError, match=r"unknown preset '7b'; presets: "
                     r"\['1b', 'small', 'tiny'\]"):
    LlamaConfig.preset("7b")
  with pytest.raises(ValueError, match=r"remat must be None, a checkpoint "
                     r"policy or the name of one in jax.checkpoint_policies.*"
                     r"got 'dots'"):
    build(remat="dots")


@nnx.jit
def value_and_grad(model, tokens):
  return nnx.value_and_grad(loss_fn)(model, tokens)


@nnx.jit
def logits(model, tokens):
  return model(tokens)


def test_the_scanned_rematerialised_model_gives_the_same_logits():
  plain = build(scan=False, remat=None)
  scanned = copy_weights(plain, build(seed=1))
  assert scanned.blocks.attn.q.kernel.shape == (LAYERS, 32, 32)
  np.testing.assert_allclose(logits(scanned, TOKENS), logits(plain, TOKENS),
                             rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # two gradient compiles: ~10-50 s
def test_the_scanned_rematerialised_model_has_the_same_gradients():
  plain = build(scan=False, remat=None, config=TWO)
  scanned = copy_weights(plain, build(seed=1, config=TWO))
  assert scanned.blocks.attn.q.kernel.shape == (2, 32, 32)
  (loss, grads), (want, want_grads) = (value_and_grad(m, TOKENS)
                                       for m in (scanned, plain))
  np.testing.assert_allclose(loss, want, rtol=1e-5)
  grads, want_grads = (helpers.pure(g) for g in (grads, want_grads))
  blocks = want_grads.pop("blocks")
  want_grads["blocks"] = jax.tree.map(lambda *xs: jnp.stack(xs),
                                      *[blocks[i] for i in range(2)])
  jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-4,
                                 atol=1e-6), grads, want_grads)


def test_grouped_query_attention_shares_each_kv_head_with_its_group():
  attn = llama_lib.Attention(CONFIG, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (2, 16, 32))
  heads, kv_heads, dim = 4, 2, 8

  @nnx.jit
  def both(attn, x):
    q = llama_lib.rotary(attn.q(x).reshape(2, 16, heads, dim), 1e4)
    k = llama_lib.rotary(attn.k(x).reshape(2, 16, kv_heads, dim), 1e4)
    v = attn.v(x).reshape(2, 16, kv_heads, dim)
    # Query heads 0, 1 read kv head 0; 2, 3 read kv head 1.
    k, v = (jnp.repeat(a, heads // kv_heads, axis=2) for a in (k, v))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(dim)
    scores = jnp.where(jnp.tril(jnp.ones((16, 16), bool)), scores, -jnp.inf)
    out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores), v)
    return attn(x), attn.o(out.reshape(2, 16, 32))

  got, want = both(attn, x)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_rotary_embeddings_make_scores_depend_on_relative_position():
  q, k = jax.random.normal(jax.random.key(0), (2, 1, 1, 1, 8))
  rotated = jax.jit(lambda x: llama_lib.rotary(jnp.tile(x, (1, 12, 1, 1)),
                                               1e4)[0, :, 0])
  qs, ks = np.asarray(rotated(q)), np.asarray(rotated(k))
  score = lambda i, j: float(qs[i] @ ks[j])  # q at position i, k at j
  assert score(5, 2) == pytest.approx(score(9, 6), rel=1e-5)
  assert score(5, 2) != pytest.approx(score(5, 3), rel=1e-3)


def test_logits_at_a_position_depend_on_the_tokens_up_to_it():
  changed = TOKENS.at[:, 9].set((TOKENS[:, 9] + 1) % CONFIG.vocab_size)
  out = np.asarray(logits(build(), jnp.concatenate([TOKENS, changed])))
  a, b = out[:8], out[8:]
  np.testing.assert_array_equal(a[:, :9], b[:, :9])
  assert np.abs(a[:, 9:] - b[:, 9:]).min(axis=-1).max() > 0


# --------------------------------------------------------------------------
# FP8's default keeps the first and last matmul in bfloat16.


def test_fp8_default_keeps_the_first_and_last_matmul_bf16_unscanned():
  model = build(scan=False)
  jmp_amp.flax.set_policies(model, "float8", example_args=(TOKENS,))
  policies = {p: str(v) for p, v in jmp_amp.flax.get_policies(model).items()}
  kept = sorted(p for p, v in policies.items()
                if v != "float8" and p.split("/")[-1] in
                ("q", "k", "v", "o", "gate", "up", "down", "head"))
  assert kept == ["blocks/0/attn/q", "head"]
  assert policies["head"] == "p=f32,c=bf16,o=bf16"
  assert policies["blocks/0/attn/k"] == policies["blocks/2/mlp/down"] == (
      "float8")


def test_fp8_default_works_on_the_scanned_llama():
  model = build()
  jmp_amp.flax.set_policies(model, "float8", example_args=(TOKENS,))
  policies = {p: str(v) for p, v in jmp_amp.flax.get_policies(model).items()}
  assert policies["head"] == "p=f32,c=bf16,o=bf16"  # the last matmul
  assert any(v == "float8" for p, v in policies.items()
             if p.startswith("blocks"))
  out = logits(model, TOKENS)
  assert out.shape == (8, 16, 64) and bool(jnp.isfinite(out).all())


# --------------------------------------------------------------------------
# Training: every mode, through make_train_step and a hand-written step.

# mode: (rules, loss scale, 16-bit state). FP8 on the scanned stack keeps no
# block in bfloat16 (keep_first_last=False; see the xfail above).
MODES = {
    "float32": (None, jmp_amp.NoOpLossScale, False),
    "mixed_bfloat16": (jmp_amp.flax.mixed_rules("bfloat16"),
                       jmp_amp.NoOpLossScale, False),
    "mixed_float16": (jmp_amp.flax.mixed_rules("float16"),
                      functools.partial(jmp_amp.DynamicLossScale, 2.0 ** 15),
                      False),
    "float8-delayed": (jmp_amp.flax.mixed_rules() | {"*": FP8(
        RECIPE(scaling="delayed", history_len=4), keep_first_last=False)},
                       jmp_amp.NoOpLossScale, False),
    "float8-rowwise": (jmp_amp.flax.mixed_rules() | {"*": FP8(
        RECIPE(scaling="rowwise"), keep_first_last=False)},
                       jmp_amp.NoOpLossScale, False),
    "state16": (jmp_amp.flax.mixed_rules(
        "bfloat16", param="bfloat16", norms="p=bf16,c=f32,o=f32"),
                jmp_amp.NoOpLossScale, True),
}
LR = 3e-3
STEPS = 100


def setup(mode, scan=True, remat=REMAT, seed=0):
  """(model, optimizer) of a mode, the rules applied from outside."""
  rules, scale, state16 = MODES[mode]
  model = build(scan=scan, remat=remat, seed=seed)
  if rules is not None:
    jmp_amp.flax.set_policies(model, rules, example_args=(TOKENS,))
  tx = optax.adamw(LR)
  if state16:
    tx = optax.chain(jmp_amp.optim.compress_state(tx),
                     jmp_amp.optim.low_precision_params())
  opt = nnx.Optimizer(model, jmp_amp.loss_scaling(tx, scale()),
                      wrt=nnx.Param)
  # Committed to the device, as a restored checkpoint's arrays are: jit
  # keys its programs on that, and resumes_bitwise's steps reuse one.
  nnx.update((model, opt), jax.device_put(nnx.state((model, opt)),
                                          jax.devices()[0]))
  return model, opt


def trajectory(mode, steps=STEPS, numerics=None):
  model, opt = setup(mode)
  step = jmp_amp.flax.make_train_step(loss_fn, numerics=numerics)
  losses = []
  for i in range(steps):
    metrics = step(model, opt, BATCHES[i % len(BATCHES)])
    losses.append(metrics["loss"])
  return np.array([float(x) for x in losses]), metrics, (model, opt, step)


@pytest.fixture(scope="module")
def float32_losses():
  return trajectory("float32")[0]


def windows(losses):
  """Mean loss over the first 10 steps, the 20 around a third of the run
  (steps 23-43 of 100) and the last 20."""
  third = len(losses) // 3
  return np.array([losses[:10].mean(), losses[third - 10:third + 10].mean(),
                   losses[-20:].mean()])


# rtol per mode, with atol 0.02, derived from runs of STEPS = 100 steps on
# XLA:CPU, each mode against float32's run of the same length (windows 4.01,
# 1.64, 0.178). The largest deviation of a window from float32's: 0.090 for
# float16 (its first window: the first step is skipped), 0.078 for FP8's
# rowwise recipe (the middle window, 4.7 %), 0.023 for bfloat16, 0.021 for
# the delayed recipe, 0.013 for 16-bit state; what atol leaves needs an rtol
# of at most 0.035 (rowwise), 0.017 (float16), 0.002 (bfloat16), 0 (the
# others). 0.1 is about 3x the largest, and still fails a mode that learns
# a tenth slower (float32's run stretched by 10 % misses the middle and last
# windows by 0.20 and 0.068, beyond the 0.18 and 0.038 allowed).
TOLERANCE = {"mixed_bfloat16": 0.1, "mixed_float16": 0.1,
             "float8-delayed": 0.1, "float8-rowwise": 0.1, "state16": 0.1}
# Each mode trains once, against float32, through one of the two runners
# (a train-step compile is most of a run's time). make_train_step: a
# checkpoint of the trained model resumes bitwise with the same compiled step
# (the loss scale, FP8's delayed histories, 16-bit params and moments), and
# bfloat16's step computes the telemetry of every module. A hand-written
# step: jmp_amp.flax.fp8.value_and_grad (FP8's rowwise scaling); its
# jmp_amp.scaled_value_and_grad branch runs float16 in
# test_an_overflowing_float16_step_is_skipped_bitwise. FP8's current scaling
# trains against float32 in tests/test_fp8.py (digits), and a scanned GPT in
# tests/test_scanned_gpt.py.
MAKE_TRAIN_STEP_MODES = ("float8-delayed", "mixed_bfloat16", "mixed_float16",
                         "state16")
HAND_WRITTEN_MODES = ("float8-rowwise",)
assert sorted(MAKE_TRAIN_STEP_MODES + HAND_WRITTEN_MODES) == sorted(TOLERANCE)


def check_policies(mode, model):
  policies = jmp_amp.flax.get_policies(model)
  if mode.startswith("float8"):
    assert str(policies["blocks/mlp/gate"]).startswith("float8")
    assert str(policies["blocks/attn_norm"]) == "p=f32,c=f32,o=f32"
  elif mode == "state16":
    assert model.blocks.mlp.up.kernel[...].dtype == jnp.bfloat16
  else:
    half = {"mixed_bfloat16": "bf16", "mixed_float16": "f16"}[mode]
    assert str(policies["blocks/attn/q"]) == f"p=f32,c={half},o={half}"


@pytest.mark.slow  # a train-step compile and 100 steps per mode: ~10-30 s
@pytest.mark.parametrize("mode", MAKE_TRAIN_STEP_MODES)
def test_each_mode_trains_as_float32_does_and_resumes_bitwise(
    tmp_path, mode, float32_losses):
  telemetry = mode == "mixed_bfloat16"
  losses, metrics, (model, opt, step) = trajectory(
      mode, numerics="**" if telemetry else None)
  assert float32_losses[-20:].mean() < 0.3 * float32_losses[:10].mean()
  assert np.isfinite(losses).all()
  np.testing.assert_allclose(windows(losses), windows(float32_losses),
                             rtol=TOLERANCE[mode], atol=0.02)
  skipped = int(metrics["skipped_steps"])
  # float16 at 2**15 backs off in its first steps; the others never skip.
  assert (0 < skipped <= 5) if mode == "mixed_float16" else skipped == 0
  check_policies(mode, model)
  if telemetry:
    check_telemetry(jax.device_get(metrics["numerics"]))
  resumes_bitwise(tmp_path, mode, model, opt, step)
  if mode == "mixed_float16":
    # An overflowing step (an inf weight: every gradient NaN) changes
    # nothing but the scale, bit for bit (as a hand-written step's below).
    kernel = model.blocks.mlp.down.kernel
    kernel[...] = kernel[...].at[1, 0, 0].set(jnp.inf)
    skips_bitwise(model, opt, lambda: step(model, opt, BATCHES[0]))


def resumes_bitwise(tmp_path, mode, model, opt, step):
  """A checkpoint restored into a fresh model of the mode, and three more
  steps of the same compiled step on both: bit for bit the same."""
  checkpoint = pytest.importorskip("jmp_amp.checkpoint")
  checkpoint.save(tmp_path, {"model": model, "opt": opt}, step=STEPS)
  restored, fresh_opt = setup(mode, seed=1)
  # A fresh optimizer's state, under the trained optimizer's transformation:
  # the step's program holds it as static data, and a new one would be a
  # new program (a compile as long as training's).
  restored_opt = nnx.clone(opt)
  nnx.update(restored_opt, nnx.state(fresh_opt))
  checkpoint.restore(tmp_path, {"model": restored, "opt": restored_opt})
  state = lambda *xs: helpers.pure(nnx.state(xs))
  assert helpers.tree_bytes_equal(state(restored, restored_opt),
                                  state(model, opt))
  if mode == "float8-delayed":  # a full history per block
    lhs = np.asarray(jmp_amp.flax.fp8.histories(restored)["blocks/mlp/down"]
                     .lhs)
    assert lhs.shape == (LAYERS, 4) and np.all(lhs > 0)
  for i in range(3):
    assert helpers.tree_bytes_equal(step(restored, restored_opt, BATCHES[i]),
                                    step(model, opt, BATCHES[i]))
  assert helpers.tree_bytes_equal(state(restored, restored_opt),
                                  state(model, opt))


def hand_written_step(mode, loss=loss_fn):
  """A user's own step: nnx.jit, the optimizer's loss_scaling read by
  jmp_amp.scaled_value_and_grad; FP8's histories through
  jmp_amp.flax.fp8.value_and_grad."""
  if mode.startswith("float8"):
    @nnx.jit
    def step(model, optimizer, batch):
      value, grads = jmp_amp.flax.fp8.value_and_grad(
          lambda m: loss(m, batch))(model)
      optimizer.update(model, grads)
      return value
    return step

  @nnx.jit
  def step(model, optimizer, batch):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    def loss_of(params):
      return loss(nnx.merge(graphdef, params, rest), batch)
    value, grads = jmp_amp.scaled_value_and_grad(loss_of)(
        optimizer.opt_state, params)
    optimizer.update(model, grads)
    return value
  return step


@pytest.mark.slow  # a step compile and 100 steps per mode: ~10-25 s
@pytest.mark.parametrize("mode", HAND_WRITTEN_MODES)
def test_a_hand_written_nnx_jit_step_trains_each_mode(mode, float32_losses):
  model, opt = setup(mode)
  step = hand_written_step(mode)
  losses = np.array([float(step(model, opt, BATCHES[i % len(BATCHES)]))
                     for i in range(STEPS)])
  assert np.isfinite(losses).all()
  np.testing.assert_allclose(windows(losses), windows(float32_losses),
                             rtol=TOLERANCE[mode], atol=0.02)
  check_policies(mode, model)
  if mode.startswith("float8"):
    histories = jmp_amp.flax.fp8.histories(model)
    assert histories["blocks/mlp/down"].lhs.shape[0] == LAYERS
  else:
    state = jmp_amp.get_scaling_state(opt.opt_state)
    assert int(state.steps) == STEPS


# --------------------------------------------------------------------------
# float16: an overflowing step changes nothing but the scale.


def poisoned_loss(model, batch):
  tokens, factor = batch
  return loss_fn(model, tokens) * factor


@pytest.mark.slow  # a step compile: ~15-30 s
def test_an_overflowing_float16_step_is_skipped_bitwise():
  # make_train_step's: in test_each_mode_trains_as_float32_does_and_...
  model, opt = setup("mixed_float16")
  step = hand_written_step("mixed_float16", poisoned_loss)
  run = lambda factor: step(model, opt, (TOKENS, jnp.float32(factor)))
  for _ in range(6):  # past float16's first backoffs
    run(1.0)
  skips_bitwise(model, opt, lambda: run(np.inf))


def skips_bitwise(model, opt, run):
  """`run()`, a non-finite step, halves the scale and changes nothing else."""
  scaling = lambda: helpers.pure(jmp_amp.get_scaling_state(opt.opt_state))
  scale, steps = float(scaling().loss_scale.loss_scale), int(scaling().steps)
  copy = lambda: jax.tree.map(np.array, (helpers.pure(nnx.state(model)),
                                         scaling().inner_state))
  before = copy()
  run()
  state = scaling()
  assert not bool(state.grads_finite) and int(state.steps) == steps + 1
  assert float(state.loss_scale.loss_scale) == scale / 2
  # The params and Adam's moments and count, bit for bit.
  assert helpers.tree_bytes_equal(copy(), before)


# --------------------------------------------------------------------------
# Telemetry (of the bfloat16 training above) and find_nonfinite on the
# scanned, rematerialised model.

BLOCK_MODULES = ("attn", "attn/q", "attn/k", "attn/v", "attn/o", "attn_norm",
                 "mlp", "mlp/gate", "mlp/up", "mlp/down", "mlp_norm")


def check_telemetry(stats):
  """Every module of every block of the scanned stack has its entries."""
  for i in range(LAYERS):
    for module in BLOCK_MODULES:
      entry = stats.get(f"blocks/{i}/{module}")
      assert entry is not None, f"blocks/{i}/{module}"
      # Containers (attn, mlp) have no params of their own: no "grad".
      kinds = ["out"] if module in ("attn", "mlp") else ["grad", "out"]
      assert sorted(entry) == kinds, (f"blocks/{i}/{module}", entry)
      for kind in kinds:
        assert float(entry[kind]["max_abs"]) > 0
        assert int(entry[kind]["nonfinite"]) == 0
  for module in ("embed", "norm", "head"):
    assert sorted(stats[module]) == ["grad", "out"], module
  # One value per block, not one for the stack (float32 gradients: bfloat16
  # outputs of two blocks may round to the same maximum).
  assert len({float(stats[f"blocks/{i}/mlp/down"]["grad"]["max_abs"])
              for i in range(LAYERS)}) == LAYERS


def overflowing_block_1(scan, remat):
  """A float16 model whose block 1's SwiGLU product overflows (block 0's
  does not: the localiser must tell the blocks' one source line apart)."""
  model = build(scan=scan, remat=remat, config=TWO)
  for name in ("gate", "up"):
    if scan:
      kernel = getattr(model.blocks.mlp, name).kernel
      kernel[...] = kernel[...].at[1].multiply(400.0)
    else:
      kernel = getattr(model.blocks[1].mlp, name).kernel
      kernel[...] = kernel[...] * 400.0
  rules = jmp_amp.flax.mixed_rules("float16")
  jmp_amp.flax.set_policies(model, rules)
  return model, rules


# Without remat, the unscanned model's blocks are plain modules, as the
# models of tests/test_numerics.py are.
@pytest.mark.slow  # op by op, forward and backward: ~10-30 s
@pytest.mark.parametrize("scan,remat", [(False, REMAT), (True, REMAT)],
                         ids=["unscanned-remat", "scanned-remat"])
def test_find_nonfinite_names_the_block(scan, remat):
  model, rules = overflowing_block_1(scan, remat)
  report = jmp_amp.numerics.find_nonfinite(loss_fn, model, TOKENS,
                                           rules=rules)
  assert (report.primitive, report.direction, report.module) == (
      "mul", "forward", "blocks/1/mlp")
  if not scan:
    assert report.suggested_rule == {"blocks/1/mlp": "float32"}
    assert report.fixed and report.reason is None
    return
  # One program runs every block of a stack: the rule is for all of them.
  # Its float32 output turns the float16 residual, the scan's carry, into
  # float32, which nnx.scan refuses: the report says so, it does not raise.
  assert report.suggested_rule == {"blocks/*/mlp": "float32"}
  assert report.fixed is False
  assert "carry" in report.reason and "float32" in report.reason
  assert "could not be applied" in str(report)
