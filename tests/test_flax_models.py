"""Model builders for the jmp_amp.flax tests (plus their sanity checks).

The reference models of `models/` (MLP and ResNet in NNX and linen, GPT in
NNX) at tiny sizes, with weights drawn by numpy: Flax's truncated-normal
initialisers compile an XLA program per shape, seconds per model on a busy
CPU, while `nnx.eval_shape` + numpy compiles nothing.

Also `KnoblessGPT`, a decoder whose attention block is written with plain jnp
ops (no dtype/einsum knobs) and whose root owns a Param, to exercise the
boundary casts of modules without knobs (`jmp_amp.flax.cast_boundary`).
"""

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

import jmp_amp.flax
import models
from models import data

MLP_IN, MLP_OUT, MLP_WIDTH = 16, 4, 32
CLASSES = 4
VOCAB, SEQ, WIDTH = 32, 16, 32


def fill(tree, seed: int = 0):
  """Concrete values for an abstract variable tree, by variable name.

  Kernels and embeddings get LeCun-normal values, biases and means zeros,
  scales and variances ones.
  """
  rng = np.random.default_rng(seed)

  def leaf(path, x):
    name = str(getattr(path[-1], "key", path[-1]))
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"fill: {jax.tree_util.keystr(path)} is {x.dtype}; "
                      "build models without RNG state")
    if name in ("bias", "mean"):
      value = np.zeros(x.shape)
    elif name in ("scale", "var"):
      value = np.ones(x.shape)
    else:
      fan_in = int(np.prod(x.shape[:-1])) or 1
      value = rng.normal(0.0, fan_in ** -0.5, x.shape)
    return jnp.asarray(value, x.dtype)

  return jax.tree_util.tree_map_with_path(leaf, tree)


def build(ctor, seed: int = 0) -> nnx.Module:
  """`ctor()`'s NNX model, initialised by numpy (see `fill`)."""
  graphdef, state = nnx.split(nnx.eval_shape(ctor))
  nnx.replace_by_pure_dict(state, fill(nnx.to_pure_dict(state), seed))
  return nnx.merge(graphdef, state)


def linen_init(module, *args, seed: int = 0, **kwargs):
  """`module.init` variables, initialised by numpy (see `fill`)."""
  abstract = jax.eval_shape(
      lambda: module.init(jax.random.key(0), *args, **kwargs))
  return fill(abstract, seed)


# --------------------------------------------------------------------------
# Reference models at test size.


def mlp(seed: int = 0) -> models.MLP:
  return build(lambda: models.MLP(MLP_IN, MLP_OUT, 3, width=MLP_WIDTH,
                                  rngs=nnx.Rngs(0)), seed)


def linen_mlp() -> models.LinenMLP:
  return models.LinenMLP(MLP_IN, MLP_OUT, 3, width=MLP_WIDTH)


def resnet(seed: int = 0) -> models.ResNet:
  return build(lambda: models.ResNet((1, 1), 8, CLASSES, rngs=nnx.Rngs(0)),
               seed)


def linen_resnet() -> models.LinenResNet:
  return models.LinenResNet((1, 1), 8, CLASSES)


def gpt(seed: int = 0, num_layers: int = 1,
        attention: str = "einsum") -> models.GPT:
  # The attention written out by default: every matmul of it is a dot the
  # policies' knobs decide. (The fused one is XLA's implementation of
  # jax.nn.dot_product_attention on the CPU, which contracts the float32
  # gradient of its scores; tests/test_attention.py covers it.)
  return build(lambda: models.GPT(VOCAB, WIDTH, 2, num_layers, SEQ,
                                  attention=attention, rngs=nnx.Rngs(0)),
               seed)


def mlp_batch(n: int = 8, seed: int = 0):
  xs, ys = data.regression_batches(1, n, MLP_IN, MLP_OUT, seed=seed)
  return jnp.asarray(xs[0]), jnp.asarray(ys[0])


def image_batch(n: int = 8, seed: int = 0):
  x, y = data.image_batch(n, CLASSES, seed=seed)
  return jnp.asarray(x), jnp.asarray(y)


def token_batch(n: int = 4, seed: int = 0):
  return jnp.asarray(data.token_batch(n, SEQ, VOCAB, seed=seed))


# --------------------------------------------------------------------------
# A decoder without knobs.


class Attention(nnx.Module):
  """Causal self-attention written with jnp ops: no dtype knobs of its own."""

  def __init__(self, width: int, heads: int, rngs: nnx.Rngs):
    self.heads = heads
    self.qkv = nnx.Linear(width, 3 * width, rngs=rngs)
    self.proj = nnx.Linear(width, width, rngs=rngs)

  @jmp_amp.flax.cast_boundary
  def __call__(self, x):
    b, t, d = x.shape
    q, k, v = jnp.split(self.qkv(x), 3, axis=-1)
    split = lambda a: a.reshape(b, t, self.heads, d // self.heads)
    q, k, v = split(q), split(k), split(v)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // self.heads)
    mask = jnp.tril(jnp.ones((t, t), bool))
    logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
    weights = jax.nn.softmax(logits.astype(jnp.float32), -1).astype(q.dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, d)
    return self.proj(out)


class KnoblessBlock(nnx.Module):

  def __init__(self, width: int, rngs: nnx.Rngs):
    self.ln1 = nnx.LayerNorm(width, rngs=rngs)
    self.attn = Attention(width, 2, rngs)
    self.ln2 = nnx.LayerNorm(width, rngs=rngs)
    self.fc = nnx.Linear(width, 2 * width, rngs=rngs)
    self.out = nnx.Linear(2 * width, width, rngs=rngs)

  def __call__(self, x):
    x = x + self.attn(self.ln1(x))
    return x + self.out(jax.nn.gelu(self.fc(self.ln2(x))))


class KnoblessGPT(nnx.Module):
  """Token embedding, a position table Param of its own, tied head."""

  def __init__(self, rngs: nnx.Rngs, depth: int = 2):
    self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
    self.pos = nnx.Param(jnp.zeros((SEQ, WIDTH)))
    self.blocks = nnx.List([KnoblessBlock(WIDTH, rngs) for _ in range(depth)])
    self.ln_f = nnx.LayerNorm(WIDTH, rngs=rngs)

  @jmp_amp.flax.cast_boundary
  def __call__(self, tokens):
    x = self.embed(tokens) + self.pos[...][: tokens.shape[1]]
    for block in self.blocks:
      x = block(x)
    return self.embed.attend(self.ln_f(x))


def knobless_gpt(seed: int = 0, depth: int = 2) -> KnoblessGPT:
  return build(lambda: KnoblessGPT(nnx.Rngs(0), depth), seed)


# --------------------------------------------------------------------------
# Sanity of the builders.


def test_builders_give_float32_models_of_the_expected_shapes():
  def out(model, x):  # abstract evaluation: nothing compiles
    return nnx.eval_shape(lambda m, x: m(x), model, x)
  assert out(mlp(), mlp_batch(4)[0]).shape == (4, MLP_OUT)
  assert out(resnet(), image_batch(2)[0]).shape == (2, CLASSES)
  for model in (gpt(), knobless_gpt()):
    logits = out(model, token_batch(2))
    assert logits.shape == (2, SEQ, VOCAB) and logits.dtype == jnp.float32
  state = nnx.state(resnet())
  assert float(state["stem_bn"]["var"][...].min()) == 1.0
  assert float(jnp.abs(state["head"]["kernel"][...]).max()) > 0


def test_linen_mlp_holds_the_nnx_mlp_weights():
  model = mlp()
  x, _ = mlp_batch(4)
  variables = models.linen_params_from_nnx(model)
  np.testing.assert_allclose(linen_mlp().apply(variables, x), model(x),
                             rtol=1e-6, atol=1e-6)
