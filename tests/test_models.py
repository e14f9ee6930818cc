"""Tests of the plain Flax reference models in `models/` (tiny sizes, CPU).

Cost on CPU is almost all XLA compilation, so: structure and dtypes are
checked on abstract models (`nnx.eval_shape`, no compilation); the concrete
models get numpy weights (Flax's initialisers compile one program per
parameter shape: tens of seconds on a loaded CPU), are built once per module
and cloned per test; forward passes are jitted whole.
"""

import functools

import chex
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import models
from models import data as data_lib

# Same ops on the same weights; the slack only covers XLA fusing differently.
TOL = dict(rtol=1e-5, atol=1e-5)

MLP_KW = dict(in_size=8, out_size=5, num_layers=3, width=16)
RESNET_KW = dict(stage_sizes=(1, 1), base_width=4, num_classes=10)
GPT_KW = dict(vocab_size=32, d_model=16, num_heads=2, num_layers=2,
              max_len=16)


def _build(make_model, seed: int = 0):
  """The model `make_model()` builds, with numpy-initialised weights.

  Kernels are normal / sqrt(fan_in), embeddings normal * 0.02 (as the GPT's
  own initialiser), norm scales and variances one, biases and means zero.
  """
  graphdef, state = nnx.split(nnx.eval_shape(make_model))
  rng = np.random.default_rng(seed)

  def init(path, leaf):
    # The path ends in the variable's name, then the Variable's `.value`.
    name = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)][-1]
    if name in ("scale", "var"):
      value = np.ones(leaf.shape)
    elif name in ("bias", "mean"):
      value = np.zeros(leaf.shape)
    else:
      std = 0.02 if name == "embedding" else 1 / np.sqrt(
          np.prod(leaf.shape[:-1]))
      value = std * rng.standard_normal(leaf.shape)
    # Host arrays: jnp.ones and friends would compile per shape too.
    return jnp.asarray(value.astype(leaf.dtype))

  return nnx.merge(graphdef,
                   jax.tree_util.tree_map_with_path(init, state))


def _num_params(model: nnx.Module) -> int:
  return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def _batch_stats(model: nnx.Module):
  return jax.tree.map(np.asarray, nnx.state(model, nnx.BatchStat))


def _all_changed(a, b) -> bool:
  return all(jax.tree.leaves(jax.tree.map(
      lambda x, y: not np.array_equal(x, y), a, b)))


@functools.partial(nnx.jit, static_argnames="train")
def _apply(model, x, train=None):
  """Jitted forward pass; nnx.jit writes BatchNorm updates back."""
  if train is None:
    return model(x)
  return model(x, train=train)


def _abstract_out(make_model, x):
  """Output shape and dtype of ``make_model()(x)``, without compiling."""
  # The model is built inside: an abstract model can't be called.
  return nnx.eval_shape(lambda x: make_model()(x), x)


def _train(model, loss_fn, batches, tx, **call_kwargs) -> list[float]:
  """The loss at each of one jitted optax step per batch."""
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, x, y):
    def loss_of(model):
      return loss_fn(model(x, **call_kwargs), y)
    loss, grads = nnx.value_and_grad(loss_of)(model)
    optimizer.update(model, grads)
    return loss

  return [float(step(model, optimizer, x, y)) for x, y in batches]


@pytest.fixture(scope="module")
def _mlp():
  return _build(lambda: models.MLP(**MLP_KW, rngs=nnx.Rngs(0)))


@pytest.fixture(scope="module")
def _resnet():
  return _build(lambda: models.ResNet(**RESNET_KW, rngs=nnx.Rngs(0)))


@pytest.fixture(scope="module")
def _gpts():
  return {tie: _build(lambda: models.GPT(**GPT_KW, tie_embeddings=tie,
                                         rngs=nnx.Rngs(0)))
          for tie in (True, False)}


@pytest.fixture
def mlp(_mlp):
  return nnx.clone(_mlp)


@pytest.fixture
def resnet(_resnet):
  return nnx.clone(_resnet)


@pytest.fixture
def gpt(_gpts):
  return nnx.clone(_gpts[True])


@pytest.fixture
def untied_gpt(_gpts):
  return nnx.clone(_gpts[False])


# --------------------------------------------------------------------------
# MLP.


def test_mlp_layers_follow_the_recipe():
  # make_model(in, out, num_layers): num_layers - 1 x Linear(in, in), then
  # Linear(in, out).
  default = nnx.eval_shape(lambda: models.MLP(rngs=nnx.Rngs(0)))
  assert [l.kernel.shape for l in default.layers] == [(4096, 4096)] * 3
  model = nnx.eval_shape(lambda: models.MLP(8, 5, num_layers=4,
                                            rngs=nnx.Rngs(0)))
  assert all(isinstance(l, nnx.Linear) for l in model.layers)
  assert [l.kernel.shape for l in model.layers] == [(8, 8)] * 3 + [(8, 5)]
  assert [l.bias.shape for l in model.layers] == [(8,)] * 3 + [(5,)]
  wide = nnx.eval_shape(lambda: models.MLP(8, 5, num_layers=2, width=16,
                                           rngs=nnx.Rngs(0)))
  assert [l.kernel.shape for l in wide.layers] == [(8, 16), (16, 5)]


def test_mlp_relu_between_layers_not_after_the_last(mlp):
  mlp.layers[-1].bias[...] = jnp.full((5,), -100.0)
  x = jax.random.normal(jax.random.key(1), (4, 8))
  expected = x
  for i, layer in enumerate(mlp.layers):
    expected = expected @ layer.kernel[...] + layer.bias[...]
    if i < len(mlp.layers) - 1:
      expected = jax.nn.relu(expected)
  out = _apply(mlp, x)
  assert out.shape == (4, 5) and out.dtype == jnp.float32
  assert (out < 0).all()  # No ReLU on the output.
  chex.assert_trees_all_close(out, expected, **TOL)


def test_linen_mlp_equals_nnx_mlp_on_the_same_weights(mlp):
  linen = models.LinenMLP(**MLP_KW)
  x = jax.random.normal(jax.random.key(1), (4, 8))
  variables = models.linen_params_from_nnx(mlp)
  # The same names, shapes and dtypes as linen's own initialisation.
  chex.assert_trees_all_equal_shapes_and_dtypes(
      variables, jax.eval_shape(linen.init, jax.random.key(0), x))
  chex.assert_trees_all_close(jax.jit(linen.apply)(variables, x),
                              _apply(mlp, x), **TOL)


def test_mlp_dtype_knobs_reach_every_layer():
  make = lambda: models.MLP(**MLP_KW, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  model = nnx.eval_shape(make)
  assert all(l.dtype == jnp.bfloat16 for l in model.layers)
  assert all(l.kernel.dtype == jnp.float32 for l in model.layers)
  assert _abstract_out(make, jnp.ones((2, 8))).dtype == jnp.bfloat16
  linen = models.LinenMLP(**MLP_KW, dtype=jnp.bfloat16)
  variables = models.linen_params_from_nnx(model)
  assert jax.eval_shape(linen.apply, variables, jnp.ones((2, 8))).dtype == (
      jnp.bfloat16)
  half_params = nnx.eval_shape(lambda: models.MLP(
      **MLP_KW, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
  assert {x.dtype for x in jax.tree.leaves(nnx.state(half_params))} == {
      jnp.dtype(jnp.bfloat16)}


def test_mlp_sgd_reduces_mse(mlp):
  xs, ys = data_lib.regression_batches(1, 32, 8, 5, seed=0)
  losses = _train(mlp, models.mse_loss, [(xs[0], ys[0])] * 20,
                  optax.sgd(0.05))
  # Random targets: the fit can only shrink the output towards them a little.
  assert losses[-1] < 0.95 * losses[0]


@jax.jit
def _half_losses():
  pred = jnp.full((4, 3), 300.0, jnp.float16)
  return (models.mse_loss(pred, jnp.zeros((4, 3), jnp.float16)),
          models.cross_entropy_loss(jnp.zeros((4, 10), jnp.bfloat16),
                                    jnp.arange(4)),
          models.lm_loss(jnp.zeros((2, 5, 7), jnp.float16),
                         jnp.zeros((2, 5), jnp.int32)))


def test_losses_are_float32_for_half_inputs():
  mse, ce, lm = _half_losses()
  assert mse.dtype == ce.dtype == lm.dtype == jnp.float32
  # 300**2 overflows float16 (max 65504); the float32 loss is exact.
  assert mse == 90000.0
  np.testing.assert_allclose(ce, np.log(10.0), rtol=1e-6)
  np.testing.assert_allclose(lm, np.log(7.0), rtol=1e-6)


# --------------------------------------------------------------------------
# ResNet.


def test_resnet_structure_and_output(resnet):
  default = nnx.eval_shape(lambda: models.ResNet(rngs=nnx.Rngs(0)))
  assert isinstance(default.stem, nnx.Conv)
  assert isinstance(default.stem_bn, nnx.BatchNorm)
  assert len(default.blocks) == 3
  # Identity shortcut where the shape is kept, 1x1 conv + BN where it changes.
  assert default.blocks[0].shortcut_conv is None
  assert isinstance(default.blocks[1].shortcut_conv, nnx.Conv)
  assert isinstance(default.blocks[1].shortcut_bn, nnx.BatchNorm)
  assert default.blocks[1].conv1.strides == 2
  assert [b.conv2.kernel.shape[-1] for b in default.blocks] == [16, 32, 64]
  assert default.head.kernel.shape == (64, 10)
  x, _ = data_lib.image_batch(4, 10, seed=0)
  out = _abstract_out(lambda: models.ResNet(rngs=nnx.Rngs(0)), x)
  assert out.shape == (4, 10) and out.dtype == jnp.float32
  logits = _apply(resnet, x)
  assert logits.shape == (4, 10) and logits.dtype == jnp.float32


def test_resnet_batchnorm_updates_stats_in_train_mode_only(resnet):
  x, _ = data_lib.image_batch(4, 10, seed=0)
  before = _batch_stats(resnet)
  assert not resnet.stem_bn.use_running_average  # Fresh models train.

  resnet.eval()
  assert all(bn.use_running_average for bn in (
      resnet.stem_bn, resnet.blocks[1].bn2, resnet.blocks[1].shortcut_bn))
  eval_out = _apply(resnet, x)
  chex.assert_trees_all_equal(_batch_stats(resnet), before)
  resnet.train()
  _apply(resnet, x, train=False)
  chex.assert_trees_all_equal(_batch_stats(resnet), before)

  train_out = _apply(resnet, x)
  after = _batch_stats(resnet)
  assert _all_changed(before, after)
  assert not np.allclose(train_out, eval_out)

  # The call flag overrides the stored mode for one call.
  resnet.eval()
  _apply(resnet, x, train=True)
  assert _all_changed(after, _batch_stats(resnet))


def test_linen_resnet_equals_nnx_resnet_and_updates_batch_stats(resnet):
  linen = models.LinenResNet(**RESNET_KW)
  x, _ = data_lib.image_batch(4, 10, seed=0)
  variables = models.linen_variables_from_nnx(resnet)
  chex.assert_trees_all_equal_shapes_and_dtypes(
      variables,
      jax.eval_shape(functools.partial(linen.init, train=False),
                     jax.random.key(0), x))

  eval_out = jax.jit(functools.partial(linen.apply, train=False))(
      variables, x)
  chex.assert_trees_all_close(eval_out, _apply(resnet, x, train=False), **TOL)

  train_out, updates = jax.jit(functools.partial(
      linen.apply, train=True, mutable=["batch_stats"]))(variables, x)
  chex.assert_trees_all_close(train_out, _apply(resnet, x, train=True), **TOL)
  assert _all_changed(variables["batch_stats"], updates["batch_stats"])
  # The same running statistics after one train step on each side.
  chex.assert_trees_all_close(
      updates["batch_stats"],
      models.linen_variables_from_nnx(resnet)["batch_stats"], **TOL)


def test_resnet_dtype_knob_keeps_batch_stats_float32():
  make = lambda: models.ResNet(**RESNET_KW, dtype=jnp.bfloat16,
                               rngs=nnx.Rngs(0))
  model = nnx.eval_shape(make)
  assert model.blocks[1].shortcut_bn.dtype == jnp.bfloat16
  assert model.stem.dtype == model.head.dtype == jnp.bfloat16
  x, _ = data_lib.image_batch(2, 10, seed=0)
  assert _abstract_out(make, x).dtype == jnp.bfloat16
  dtypes = {v.dtype for v in jax.tree.leaves(nnx.state(model))}
  assert dtypes == {jnp.dtype(jnp.float32)}


@pytest.mark.slow
def test_resnet_adam_reduces_cross_entropy(resnet):
  # Fitting one batch: a few steps are enough to see the loss fall.
  batch = data_lib.image_batch(16, 10, seed=0)
  losses = _train(resnet, models.cross_entropy_loss, [batch] * 25,
                  optax.adam(1e-2), train=True)
  assert losses[-1] < 0.75 * losses[0]  # About 0.55 on CPU.


# --------------------------------------------------------------------------
# GPT.


def test_gpt_structure_and_output(gpt):
  default = nnx.eval_shape(lambda: models.GPT(rngs=nnx.Rngs(0)))
  assert isinstance(default.embed, nnx.Embed)
  assert default.embed.embedding.shape == (256, 64)
  assert isinstance(default.pos_embed, nnx.Embed)
  assert default.pos_embed.embedding.shape == (64, 64)
  assert len(default.blocks) == 2 and default.head is None
  block = default.blocks[0]
  assert isinstance(block.ln1, nnx.LayerNorm)
  assert isinstance(block.ln2, nnx.LayerNorm)
  assert isinstance(block.attn, models.CausalSelfAttention)
  assert block.attn.num_heads == 4
  assert block.attn.qkv.kernel.shape == (64, 192)
  assert block.attn.proj.kernel.shape == (64, 64)
  assert block.mlp.fc.kernel.shape == (64, 256)
  assert block.mlp.out.kernel.shape == (256, 64)
  assert isinstance(default.ln_f, nnx.LayerNorm)
  tokens = data_lib.token_batch(2, 64, 256, seed=0)
  out = _abstract_out(lambda: models.GPT(rngs=nnx.Rngs(0)), tokens)
  assert out.shape == (2, 64, 256) and out.dtype == jnp.float32

  tokens = data_lib.token_batch(2, 16, 32, seed=0)
  logits = _apply(gpt, tokens)
  assert logits.shape == (2, 16, 32) and logits.dtype == jnp.float32
  # Near-uniform predictions at initialisation.
  assert abs(float(models.lm_loss(logits, tokens)) - np.log(32)) < 0.1


@pytest.mark.parametrize("tie", [True, False])
def test_gpt_is_causal(_gpts, tie):
  model = _gpts[tie]
  tokens = jnp.asarray(data_lib.token_batch(2, 16, 32, seed=0))
  changed = tokens.at[:, 9].set((tokens[:, 9] + 1) % 32)
  a, b = _apply(model, tokens), _apply(model, changed)
  chex.assert_trees_all_equal(a[:, :9], b[:, :9])
  assert not np.allclose(a[:, 9:], b[:, 9:])


def test_gpt_tied_and_untied_differ_by_the_head(gpt, untied_gpt):
  assert gpt.head is None and isinstance(untied_gpt.head, nnx.Linear)
  assert untied_gpt.head.kernel.shape == (16, 32)
  assert _num_params(untied_gpt) - _num_params(gpt) == 16 * 32
  tokens = data_lib.token_batch(2, 16, 32, seed=0)
  assert _apply(untied_gpt, tokens).shape == (2, 16, 32)


def test_gpt_rejects_sequences_longer_than_max_len(gpt):
  with pytest.raises(ValueError, match="max_len"):
    gpt(jnp.zeros((1, 17), jnp.int32))


def test_gpt_dtype_knob_reaches_attention():
  make = lambda: models.GPT(**GPT_KW, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  model = nnx.eval_shape(make)
  attn = model.blocks[0].attn
  assert attn.dtype == attn.qkv.dtype == attn.proj.dtype == jnp.bfloat16
  assert model.embed.dtype == model.ln_f.dtype == jnp.bfloat16
  tokens = data_lib.token_batch(2, 16, 32, seed=0)
  assert _abstract_out(make, tokens).dtype == jnp.bfloat16
  assert {p.dtype for p in jax.tree.leaves(nnx.state(model, nnx.Param))} == {
      jnp.dtype(jnp.float32)}


@pytest.mark.slow
def test_gpt_adam_reduces_lm_loss(gpt):
  batches = []
  for i in range(25):
    tokens = data_lib.token_batch(8, 16, 32, seed=i)
    batches.append((tokens, tokens))
  losses = _train(gpt, models.lm_loss, batches, optax.adam(1e-2))
  # Fresh batches each step: below log(32), the loss of uniform guessing.
  assert np.mean(losses[-2:]) < 0.85 * losses[0]  # About 0.7 on CPU.
  assert losses[0] > 0.97 * np.log(32)


def _optax_lm_loss(logits, tokens):
  """The reference: optax's cross-entropy on a float32 copy of the logits."""
  logits = jnp.asarray(logits[:, :-1], jnp.float32)
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(
      logits, tokens[:, 1:]))


@functools.partial(jax.jit, static_argnums=0)
def _loss_and_grad(loss_fn, logits, tokens):
  return jax.value_and_grad(loss_fn)(logits, tokens)


def _lm_logits(dtype, scale=3.0, seed=0):
  rng = np.random.default_rng(seed)
  logits = jnp.asarray(scale * rng.standard_normal((3, 9, 50)), dtype)
  tokens = jnp.asarray(rng.integers(0, 50, (3, 9)), jnp.int32)
  return logits, tokens


def test_lm_loss_matches_optax_cross_entropy_in_float32():
  logits, tokens = _lm_logits(jnp.float32)
  loss, grad = _loss_and_grad(models.lm_loss, logits, tokens)
  ref_loss, ref_grad = _loss_and_grad(_optax_lm_loss, logits, tokens)
  assert loss.dtype == grad.dtype == jnp.float32
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  np.testing.assert_allclose(grad, ref_grad, rtol=1e-6, atol=1e-8)
  # The last position has no target: no gradient reaches its logits.
  assert not np.any(grad[:, -1])


def test_lm_loss_of_bfloat16_logits_is_float32_with_a_bfloat16_gradient():
  # Large logits (losses near 200): a bfloat16 cross-entropy rounds them to
  # whole numbers (1e-4 relative off here); float32 is exact to 1e-6.
  logits, tokens = _lm_logits(jnp.bfloat16, scale=100.0)
  loss, grad = _loss_and_grad(models.lm_loss, logits, tokens)
  ref_loss, ref_grad = _loss_and_grad(_optax_lm_loss, logits, tokens)
  # Exact float32 reference on the same (bfloat16) inputs.
  exact_loss, exact_grad = _loss_and_grad(
      _optax_lm_loss, logits.astype(jnp.float32), tokens)
  assert loss.dtype == jnp.float32 and grad.dtype == jnp.bfloat16
  np.testing.assert_allclose(loss, exact_loss, rtol=1e-6)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  # The gradient is the float32 gradient rounded once to bfloat16: within
  # half a bfloat16 ulp (2**-9 relative) of it, as optax's reference is.
  np.testing.assert_allclose(grad.astype(jnp.float32), exact_grad,
                             rtol=2.0**-8, atol=1e-12)
  np.testing.assert_allclose(grad.astype(jnp.float32),
                             ref_grad.astype(jnp.float32),
                             rtol=2.0**-7, atol=1e-12)


# --------------------------------------------------------------------------
# Data.


def test_data_is_deterministic_with_expected_shapes():
  xs, ys = data_lib.regression_batches(3, 4, 5, 6, seed=1)
  assert xs.shape == (3, 4, 5) and ys.shape == (3, 4, 6)
  assert xs.dtype == ys.dtype == np.float32
  np.testing.assert_array_equal(
      xs, data_lib.regression_batches(3, 4, 5, 6, seed=1)[0])
  assert not np.array_equal(
      xs, data_lib.regression_batches(3, 4, 5, 6, seed=2)[0])

  images, labels = data_lib.image_batch(6, 3, seed=1)
  assert images.shape == (6, 32, 32, 3) and images.dtype == np.float32
  assert labels.dtype == np.int32 and set(labels) <= {0, 1, 2}
  np.testing.assert_array_equal(images, data_lib.image_batch(6, 3, seed=1)[0])
  # Noise-free images are exactly their class pattern, whatever the seed.
  clean, clean_labels = data_lib.image_batch(6, 3, seed=2, noise=0.0)
  np.testing.assert_array_equal(
      clean, data_lib.class_patterns(3)[clean_labels])

  tokens = data_lib.token_batch(4, 10, 7, seed=1)
  assert tokens.shape == (4, 10) and tokens.dtype == np.int32
  assert tokens.min() >= 0 and tokens.max() < 7
  # Arithmetic progressions: constant differences mod vocab.
  steps = np.diff(tokens, axis=1) % 7
  assert (steps == steps[:, :1]).all() and (steps > 0).all()
  np.testing.assert_array_equal(tokens, data_lib.token_batch(4, 10, 7, seed=1))
