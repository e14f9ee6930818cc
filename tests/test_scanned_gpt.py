"""The reference GPT with its blocks under nnx.scan (``scan_layers=True``).

Every feature must work on a scanned model (issue #33): precision policies,
loss scaling, 16-bit optimizer state, FP8 (per-layer amax histories stacked
like the params), telemetry and checkpoints.
"""


from flax import nnx
import jax
import jax.numpy as jnp
from jmp_amp.models import gpt
import numpy as np
import optax
import pytest

import helpers
import jmp_amp
import jmp_amp.flax
import jmp_amp.flax.numerics

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


# XLA:CPU's backend level 0 for the train steps (both models' alike): they
# compile in about half the time.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def train(model, tx, steps=4, **step_kwargs):
  opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
  step = jmp_amp.flax.make_train_step(loss_fn, compiler_options=FAST_COMPILE,
                                      **step_kwargs)
  return [step(model, opt, TOKENS) for _ in range(steps)], opt


def block_paths(path):
  """The unscanned model's paths of a scanned module: 'blocks/attn' ->
  ['blocks/0/attn', ...]; other paths stay as they are."""
  if path != "blocks" and not path.startswith("blocks/"):
    return [path]
  return [f"blocks/{i}{path[len('blocks'):]}" for i in range(LAYERS)]


# --------------------------------------------------------------------------
# Policies: rules written for the unscanned model's paths.


@pytest.mark.slow  # both models' forward passes op by op: ~30 s in all
@pytest.mark.parametrize("rules", [
    # (A scanned block must return the dtype it takes, the scan's carry:
    # float32 here, as the embeddings under "*".)
    {"blocks/*/attn": "mixed_bfloat16", "*": "float32"},
    {"blocks/attn": "mixed_bfloat16", "*": "float32"},  # the stack's own path
    {"blocks/[0-2]/mlp/fc": "float16", "blocks/*": "bfloat16",
     nnx.LayerNorm: "float32"},
    {"**/qkv": "p=f32,c=f16,o=f32", "blocks/0/attn": "bfloat16",
     "blocks/*/attn": "bfloat16", "*": "float32"},  # block 0: the same policy
], ids=["glob", "own-path", "class-and-range", "same-policy-for-block-0"])
def test_rules_deciding_every_block_alike_apply_to_the_stack(rules):
  plain, scanned = models()
  jmp_amp.flax.set_policies(scanned, rules)
  want = jmp_amp.flax.get_policies(jmp_amp.flax.set_policies(
      plain, {k: v for k, v in rules.items() if k != "blocks/attn"}
      | ({"blocks/*/attn": rules["blocks/attn"]} if "blocks/attn" in rules
         else {})))
  got = jmp_amp.flax.get_policies(scanned)
  assert set(got) >= {"blocks", "blocks/attn/qkv", "blocks/ln1"}
  for path, policy in got.items():
    for block in block_paths(path):
      assert str(want[block]) == str(policy), (path, block)
  # Each block computes in its policy's dtypes: the stacked forward pass
  # matches the unscanned one within the half dtypes' rounding (2**-8
  # relative for bfloat16, compounded through 3 blocks and a LayerNorm).
  np.testing.assert_allclose(np.asarray(scanned(TOKENS), np.float32),
                             np.asarray(plain(TOKENS), np.float32),
                             rtol=0.05, atol=0.05)


@pytest.mark.parametrize("rules,where,said", [
    ({"blocks/0/*": "float32", "*": "mixed_bfloat16"}, "blocks/attn",
     r"block 0 -> p=f32,c=f32,o=f32 \(rule 'blocks/0/\*'\); blocks 1, 2 -> "
     r"p=f32,c=bf16,o=bf16 \(rule '\*'\)"),
    ({"blocks/2": "float32", "*": "mixed_bfloat16"}, "blocks",
     r"blocks 0, 1 -> p=f32,c=bf16,o=bf16 \(rule '\*'\); block 2 -> "
     r"p=f32,c=f32,o=f32 \(rule 'blocks/2'\)"),
    ({"blocks/[01]/mlp/fc": "float16"}, "blocks/mlp/fc",
     r"blocks 0, 1 -> p=f16,c=f16,o=f16 \(rule 'blocks/\[01\]/mlp/fc'\); "
     r"block 2 -> None \(no rule\)"),
], ids=["first-block", "last-block", "some-blocks"])
def test_rules_deciding_some_blocks_of_the_stack_raise(rules, where, said):
  plain, scanned = models()
  jmp_amp.flax.set_policies(scanned, "float16")
  before = jmp_amp.flax.get_policies(scanned)
  with pytest.raises(
      ValueError, match=rf"the rules decide the blocks of the scanned stack "
      rf"'blocks' \(3 blocks stacked along leading axes \(3,\), run as one "
      rf"program by nnx.scan\) differently at '{where}': {said}\. One "
      rf"program runs every block of a stack, so its blocks take one policy: "
      rf"write the rule for every block \('.*', or '{where}'\), build the "
      rf"model with its blocks unstacked \(e.g. GPT\(..., "
      rf"scan_layers=False\)\), or split the stack"):
    jmp_amp.flax.set_policies(scanned, rules)
  # Nothing was applied: the model keeps its policies and its dtypes.
  assert {p: str(v) for p, v in jmp_amp.flax.get_policies(scanned).items()} \
      == {p: str(v) for p, v in before.items()}
  assert scanned.blocks.mlp.fc.kernel[...].dtype == jnp.float16
  # The unscanned model takes the same rules.
  jmp_amp.flax.set_policies(plain, rules)


# --------------------------------------------------------------------------
# Training.


def test_scanned_params_are_stacked_and_the_forward_pass_matches():
  plain, scanned = models()
  kernel = scanned.blocks.attn.qkv.kernel[...]
  assert kernel.shape == (LAYERS, 32, 96)
  np.testing.assert_allclose(scanned(TOKENS), plain(TOKENS), rtol=1e-5,
                             atol=1e-5)


STATE16 = jmp_amp.flax.mixed_rules("bfloat16", param="bfloat16",
                                   norms="p=bf16,c=f32,o=f32")


# One training per policy for the loss trajectory and the telemetry (of its
# first step): two train-step compiles, the unscanned and the scanned.
@pytest.mark.slow  # two train-step compiles: ~20-60 s each
@pytest.mark.parametrize("policy,rtol,stats_rtol,stats_atol", [
    # float32: the same computation; only XLA's reassociation differs. The
    # keys' bias has an analytically zero gradient (softmax is invariant to
    # a shift of a row's logits): its 32 elements of a qkv's 3168 are
    # rounding noise (|g| <= 1e-5, against 56 for the values' bias), and
    # the order of summation decides which of them land on exactly 0 (one,
    # in the scanned model, with XLA:CPU's elemental emitters).
    ("float32", 1e-5, 1e-5, 32 / 3168),
    # bfloat16 params, Adam's moments in bfloat16 and bfloat16 compute: the
    # scanned body is fused and rounded in another order (2**-8 relative),
    # and the stochastic roundings of a stacked leaf draw other bits than
    # those of the blocks' own leaves, so the params drift apart by a
    # rounding per step: 1.4 % in the loss at the 4th step at lr 1e-2. In
    # the telemetry (the first step: the same params), a maximum moves by a
    # few roundings, a fraction of zeros by a few elements of the thousands,
    # or by one of a LayerNorm's 64 params' scaled gradients rounding to
    # zero (1/64 = 0.016).
    ("state16", 3e-2, 0.04, 0.02)])
def test_loss_trajectory_and_telemetry_with_loss_scaling_match_unscanned(
    policy, rtol, stats_rtol, stats_atol):
  losses, stats = [], []
  for model in models():
    tx = optax.adamw(1e-2)
    if policy != "float32":
      jmp_amp.flax.set_policies(model, STATE16)
      tx = optax.chain(jmp_amp.optim.compress_state(tx),
                       jmp_amp.optim.low_precision_params())
    metrics, opt = train(model, jmp_amp.loss_scaling(
        tx, jmp_amp.DynamicLossScale(2.0 ** 15)), numerics="**")
    assert [int(m["skipped_steps"]) for m in metrics] == [0] * 4
    losses.append([float(m["loss"]) for m in metrics])
    stats.append(jax.device_get(metrics[0]["numerics"]))
  if policy != "float32":
    policies = jmp_amp.flax.get_policies(model)
    assert str(policies["blocks/ln1"]) == "p=bf16,c=f32,o=f32"
    assert str(policies["blocks/attn/qkv"]) == "p=bf16,c=bf16,o=bf16"
    assert model.blocks.mlp.fc.kernel[...].dtype == jnp.bfloat16
    assert model.blocks.mlp.fc.kernel[...].shape == (LAYERS, 32, 128)
    mu = opt.opt_state.inner_state[0].inner_state[0].mu["blocks"]["mlp"][
        "fc"]
    assert mu["kernel"][...].dtype == jnp.bfloat16
    assert mu["kernel"][...].shape == (LAYERS, 32, 128)
  np.testing.assert_allclose(losses[1], losses[0], rtol=rtol)
  assert losses[1][-1] < losses[1][0] - 0.05
  # Telemetry: one entry per block, under the unscanned model's paths.
  plain, scanned = stats
  assert sorted(scanned) == sorted(plain)
  assert {"blocks/2", "blocks/2/attn/qkv", "blocks/0/mlp/fc"} <= set(scanned)
  for path, kinds in plain.items():
    assert sorted(scanned[path]) == sorted(kinds), path
    for kind, s in kinds.items():
      for name, value in s.items():
        np.testing.assert_allclose(
            scanned[path][kind][name], value, err_msg=f"{path} {kind} {name}",
            rtol=stats_rtol if name == "max_abs" else 0,
            atol=0 if name == "max_abs" else stats_atol)
  # Per block, not one value for the stack.
  assert len({float(scanned[f"blocks/{i}/mlp/fc"][kind]["max_abs"])
              for i in range(LAYERS) for kind in ("out", "grad")}) == 2 * LAYERS


# FP8's current scaling (the default recipe): its stacked histories are
# checked in test_fp8_default_on_a_scanned_gpt_trains_in_a_hand_written_step.
@pytest.mark.slow  # a train-step compile: ~20-60 s
def test_fp8_histories_are_stacked_per_layer_and_train():
  recipe = jmp_amp.fp8.FP8Recipe(scaling="delayed", history_len=4)
  _, model = models()
  policy = jmp_amp.flax.fp8.FP8Policy(recipe, keep_first_last=False)
  jmp_amp.flax.set_policies(model, {"*": policy}, example_args=(TOKENS,))
  histories = jmp_amp.flax.fp8.histories(model)
  assert sorted(histories) == ["blocks/attn/proj", "blocks/attn/qkv",
                               "blocks/mlp/fc", "blocks/mlp/out"]
  length = recipe.history_len
  assert histories["blocks/mlp/fc"].lhs.shape == (LAYERS, length)
  metrics, _ = train(model, jmp_amp.loss_scaling(
      optax.adamw(1e-2), jmp_amp.NoOpLossScale()), numerics="**/mlp/fc")
  assert float(metrics[-1]["loss"]) < float(metrics[0]["loss"]) - 0.05
  lhs = np.asarray(jmp_amp.flax.fp8.histories(model)["blocks/mlp/fc"].lhs)
  # Each layer recorded the amax of its own input: positive, not all equal.
  assert np.all(lhs[:, 0] > 0) and len(set(lhs[:, 0].tolist())) == LAYERS
  # Telemetry gives each block its own newest amax.
  stats = metrics[-1]["numerics"]
  assert sorted(stats) == [f"blocks/{i}/mlp/fc" for i in range(LAYERS)]
  assert [float(stats[f"blocks/{i}/mlp/fc"]["fp8"]["amax_lhs"])
          for i in range(LAYERS)] == lhs[:, 0].tolist()


def test_fp8_default_keeps_the_first_and_last_outside_the_stack():
  # The first and last matmul modules (block 0's qkv, block 2's mlp/out)
  # lie in the stack, which runs every block: the stack runs in FP8; the
  # tied head (the embedding's attend, no FP8 module) stays bfloat16.
  plain, model = models()
  jmp_amp.flax.set_policies(model, {"*": "float8"}, example_args=(TOKENS,))
  assert sorted(jmp_amp.flax.fp8.histories(model)) == [
      "blocks/attn/proj", "blocks/attn/qkv", "blocks/mlp/fc",
      "blocks/mlp/out"]
  assert str(jmp_amp.flax.get_policies(model)["embed"]) == (
      "p=f32,c=bf16,o=bf16")
  # The unscanned model keeps its first and last in bfloat16.
  jmp_amp.flax.set_policies(plain, {"*": "float8"}, example_args=(TOKENS,))
  kept = {"blocks/0/attn/qkv", f"blocks/{LAYERS - 1}/mlp/out"}
  assert not kept & set(jmp_amp.flax.fp8.histories(plain))
  assert len(jmp_amp.flax.fp8.histories(plain)) == 4 * LAYERS - 2


@pytest.mark.slow  # a train-step compile: ~20-60 s
def test_fp8_default_on_a_scanned_gpt_trains_in_a_hand_written_step():
  _, model = models()
  jmp_amp.flax.set_policies(model, {"*": "float8"}, example_args=(TOKENS,))
  opt = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)

  @nnx.jit
  def step(model, opt, tokens):
    loss, grads = jmp_amp.flax.fp8.value_and_grad(
        lambda m: loss_fn(m, tokens))(model)
    opt.update(model, grads)
    return loss

  losses = [float(step(model, opt, TOKENS)) for _ in range(3)]
  assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
  # The default recipe's histories, stacked like the params: each layer
  # recorded the amax of its own input (positive, not all equal).
  histories = jmp_amp.flax.fp8.histories(model)
  length = jmp_amp.fp8.FP8Recipe().history_len
  lhs = np.asarray(histories["blocks/mlp/fc"].lhs)
  assert lhs.shape == (LAYERS, length)
  assert np.all(lhs[:, 0] > 0) and len(set(lhs[:, 0].tolist())) == LAYERS


# --------------------------------------------------------------------------
# Telemetry: one entry per block, under the unscanned model's paths.


# FP8 (its entries and the others'); a bfloat16 stack's entries, under the
# unscanned model's paths and per block, are
# test_loss_trajectory_and_telemetry_with_loss_scaling_match_unscanned's
# (16-bit state) and tests/test_llama.py's check_telemetry.
@pytest.mark.slow  # two traces of a telemetry step: ~15 s
@pytest.mark.parametrize("policy", [
    pytest.param(jmp_amp.flax.fp8.FP8Policy(jmp_amp.fp8.FP8Recipe(),
                                            keep_first_last=False))],
    ids=["fp8"])
def test_a_scanned_steps_telemetry_has_an_entry_per_block(policy):
  """Each block of a stack has its own entries, alike at any depth."""
  def numerics(layers):  # traced only
    model = gpt.GPT(**dict(CONFIG, num_layers=layers), scan_layers=True,
                    rngs=nnx.Rngs(0))
    jmp_amp.flax.set_policies(model, {"*": policy})
    opt = nnx.Optimizer(model, jmp_amp.loss_scaling(
        optax.adamw(1e-2), jmp_amp.NoOpLossScale()), wrt=nnx.Param)
    step = jmp_amp.flax.make_train_step(loss_fn, numerics="**", jit=False)
    graphdef, state = nnx.split((model, opt))

    def run(state):
      return step(*nnx.merge(graphdef, state), TOKENS)["numerics"]
    return jax.eval_shape(run, state)

  small, large = numerics(2), numerics(4)
  block = lambda table, i: sorted(
      p.removeprefix(f"blocks/{i}") for p in table
      if p == f"blocks/{i}" or p.startswith(f"blocks/{i}/"))
  assert block(large, 3) == block(large, 0) == block(small, 1)
  assert "/attn/qkv" in block(large, 3)
  assert len(large) - len(small) == 2 * len(block(small, 1))
  # A plain dict of scalars, an entry per block.
  assert {x.shape for x in jax.tree.leaves(large)} == {()}
  entry = large["blocks/3/mlp/fc"]
  fp8 = isinstance(policy, jmp_amp.flax.fp8.FP8Policy)
  assert sorted(entry) == ["fp8", "grad", "out"][not fp8:]
  assert {k: v.shape for k, v in entry["out"].items()} == {
      "max_abs": (), "underflow": (), "zeros": (), "nonfinite": ()}
  if fp8:
    assert {k: v.shape for k, v in entry["fp8"].items()} == {
        f"{s}_{x}": () for s in ("amax", "scale") for x in ("lhs", "rhs",
                                                            "grad")}


def test_output_stats_selects_blocks_of_the_stack_by_unscanned_paths():
  plain, scanned = models()
  graphdef = nnx.graphdef(scanned)

  def outputs(model, select):  # traced only: the entries and their shapes
    def run(model):
      return jmp_amp.flax.numerics.output_stats(
          lambda m, x: m(x), model, TOKENS, select=select)[1]
    return nnx.eval_shape(run, model)

  got = outputs(scanned, ["blocks/1/mlp", "blocks/attn/qkv", "ln_f"])
  want = outputs(plain, ["blocks/1/mlp", "blocks/*/attn/qkv", "ln_f"])
  assert sorted(got) == ["blocks/0/attn/qkv", "blocks/1/attn/qkv",
                         "blocks/1/mlp", "blocks/2/attn/qkv", "ln_f"]
  assert jax.tree.structure(got) == jax.tree.structure(want)
  assert {x.shape for x in jax.tree.leaves(got)} == {()}
  assert nnx.graphdef(scanned) == graphdef  # the captures are gone
  with pytest.warns(UserWarning, match=r"select 'blocks/3/mlp' matches no "
                    r"module path of GPT \(paths are like 'blocks', "
                    r"'blocks/0', "):
    outputs(scanned, "blocks/3/mlp")


# A scanned model's checkpoint (its stacked params, moments, loss scale and
# FP8's delayed histories), restored and resumed bitwise through the same
# compiled step: tests/test_llama.py's
# test_each_mode_trains_as_float32_does_and_resumes_bitwise, in every mode.


# --------------------------------------------------------------------------
# FP8 GEMMs compiled for an H100 (without one): the scanned program holds
# one block, in the while loops of the scan and of its transpose.


def _h100_fp8_report(model):
  jmp_amp.flax.set_policies(model, jmp_amp.flax.mixed_rules() | {
      "*": jmp_amp.flax.fp8.FP8Policy(keep_first_last=False)})
  opt = nnx.Optimizer(model, jmp_amp.loss_scaling(
      optax.adamw(1e-2), jmp_amp.NoOpLossScale()), wrt=nnx.Param)
  inner = jmp_amp.flax.make_train_step(loss_fn, jit=False)
  graphdef, state = nnx.split((model, opt))

  def step(state, tokens):
    model, opt = nnx.merge(graphdef, state)
    metrics = inner(model, opt, tokens)
    return nnx.state((model, opt)), metrics

  return jmp_amp.gpu_report(step, state, TOKENS)


@pytest.mark.slow  # two compiles for an H100: ~20-30 s each
def test_fp8_gemms_per_block_match_the_unscanned_model_on_h100():
  helpers.h100_target_or_skip()
  plain, scanned = (_h100_fp8_report(model) for model in models())
  assert plain.fp8_fallbacks() == {} and scanned.fp8_fallbacks() == {}
  fp8 = lambda counts: {kind: n for kind, n in helpers.fp8_gemm_kinds(
      counts).items() if kind in ("forward", "backward")}
  # Per body: the unscanned model's FP8 GEMMs divided by the blocks.
  assert fp8(scanned.gemms_by_dtype()) == {"forward": 4, "backward": 8}
  assert fp8(plain.gemms_by_dtype()) == {"forward": 4 * LAYERS,
                                         "backward": 8 * LAYERS}
  # Layer by layer: E4M3 x E4M3 forward; both gradients take the E5M2
  # output gradient; each block of the unscanned model the same.
  layers = scanned.fp8_layers()
  assert sorted(layers) == ["blocks/attn/proj", "blocks/attn/qkv",
                            "blocks/mlp/fc", "blocks/mlp/out"]
  for layer, counts in layers.items():
    assert fp8(counts) == {"forward": 1, "backward": 2}, layer
    for block in block_paths(layer):
      assert fp8(plain.fp8_layers()[block]) == fp8(counts), block
