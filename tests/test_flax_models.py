"""Tiny NNX and linen models for the jmp_amp.flax tests (plus their sanity).

An MLP (NNX and linen, same parameter names and shapes, so weights can be
copied across), a ResNet-style conv net with BatchNorm (NNX and linen) and a
GPT-style decoder (NNX) whose attention block is a custom module without
dtype knobs and whose root holds a Param of its own (the position table).
"""

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

IN, HIDDEN, CLASSES = 6, 16, 4
VOCAB, SEQ, WIDTH = 16, 8, 16


def fast_init(key, shape, dtype=jnp.float32):
  """LeCun-normal weights drawn by numpy from the key's bits.

  Flax's default truncated-normal initialisers compile an XLA program per
  shape, which costs seconds per model on a busy CPU; this compiles nothing.
  """
  if isinstance(key, jax.core.Tracer):  # linen's shape check, under eval_shape
    return jnp.zeros(shape, dtype)
  seed = np.asarray(jax.random.key_data(key)).astype(np.uint64)
  fan_in = int(np.prod(shape[:-1])) or 1
  values = np.random.default_rng(seed).normal(0.0, fan_in ** -0.5, shape)
  return jnp.asarray(values, dtype)


K = {"kernel_init": fast_init}


class MLP(nnx.Module):
  """Linear-relu-Linear-relu-Linear; the last layer is `head`."""

  def __init__(self, rngs: nnx.Rngs):
    self.l1 = nnx.Linear(IN, HIDDEN, **K, rngs=rngs)
    self.l2 = nnx.Linear(HIDDEN, HIDDEN, **K, rngs=rngs)
    self.head = nnx.Linear(HIDDEN, CLASSES, **K, rngs=rngs)

  def __call__(self, x):
    x = jax.nn.relu(self.l1(x))
    x = jax.nn.relu(self.l2(x))
    return self.head(x)


class LinenMLP(nn.Module):
  """`MLP` in linen, with the same parameter names."""

  @nn.compact
  def __call__(self, x):
    x = jax.nn.relu(nn.Dense(HIDDEN, **K, name="l1")(x))
    x = jax.nn.relu(nn.Dense(HIDDEN, **K, name="l2")(x))
    return nn.Dense(CLASSES, **K, name="head")(x)


def nnx_mlp_params_as_linen(model: MLP) -> dict:
  return {name: {"kernel": getattr(model, name).kernel[...],
                 "bias": getattr(model, name).bias[...]}
          for name in ("l1", "l2", "head")}


class Block(nnx.Module):
  """conv-BN-relu-conv-BN plus the identity."""

  def __init__(self, ch: int, rngs: nnx.Rngs):
    self.conv1 = nnx.Conv(ch, ch, (3, 3), use_bias=False, **K, rngs=rngs)
    self.bn1 = nnx.BatchNorm(ch, rngs=rngs)
    self.conv2 = nnx.Conv(ch, ch, (3, 3), use_bias=False, **K, rngs=rngs)
    self.bn2 = nnx.BatchNorm(ch, rngs=rngs)

  def __call__(self, x, train: bool = True):
    y = jax.nn.relu(self.bn1(self.conv1(x), use_running_average=not train))
    y = self.bn2(self.conv2(y), use_running_average=not train)
    return jax.nn.relu(x + y)


class ResNet(nnx.Module):
  """stem conv-BN, two residual blocks, global average pool, linear head."""

  def __init__(self, rngs: nnx.Rngs, ch: int = 8, depth: int = 2):
    self.stem = nnx.Conv(3, ch, (3, 3), use_bias=False, **K, rngs=rngs)
    self.bn = nnx.BatchNorm(ch, rngs=rngs)
    self.blocks = nnx.List([Block(ch, rngs) for _ in range(depth)])
    self.head = nnx.Linear(ch, CLASSES, **K, rngs=rngs)

  def __call__(self, x, train: bool = True):
    x = jax.nn.relu(self.bn(self.stem(x), use_running_average=not train))
    for block in self.blocks:
      x = block(x, train)
    return self.head(x.mean(axis=(1, 2)))


class LinenBlock(nn.Module):
  ch: int

  @nn.compact
  def __call__(self, x, train: bool = True):
    y = nn.Conv(self.ch, (3, 3), use_bias=False, **K)(x)
    y = jax.nn.relu(nn.BatchNorm(use_running_average=not train)(y))
    y = nn.Conv(self.ch, (3, 3), use_bias=False, **K)(y)
    y = nn.BatchNorm(use_running_average=not train)(y)
    return jax.nn.relu(x + y)


class LinenResNet(nn.Module):
  ch: int = 8
  depth: int = 2

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Conv(self.ch, (3, 3), use_bias=False, **K, name="stem")(x)
    x = jax.nn.relu(nn.BatchNorm(use_running_average=not train, name="bn")(x))
    for i in range(self.depth):
      x = LinenBlock(self.ch, name=f"blocks_{i}")(x, train)
    return nn.Dense(CLASSES, **K, name="head")(x.mean(axis=(1, 2)))


class Attention(nnx.Module):
  """Causal self-attention written with jnp ops: no dtype knobs of its own."""

  def __init__(self, width: int, heads: int, rngs: nnx.Rngs):
    self.heads = heads
    self.qkv = nnx.Linear(width, 3 * width, **K, rngs=rngs)
    self.proj = nnx.Linear(width, width, **K, rngs=rngs)

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


class DecoderBlock(nnx.Module):

  def __init__(self, width: int, rngs: nnx.Rngs):
    self.ln1 = nnx.LayerNorm(width, rngs=rngs)
    self.attn = Attention(width, 2, rngs)
    self.ln2 = nnx.LayerNorm(width, rngs=rngs)
    self.fc = nnx.Linear(width, 2 * width, **K, rngs=rngs)
    self.out = nnx.Linear(2 * width, width, **K, rngs=rngs)

  def __call__(self, x):
    x = x + self.attn(self.ln1(x))
    return x + self.out(jax.nn.gelu(self.fc(self.ln2(x))))


class GPT(nnx.Module):
  """Token + learned position embeddings, 2 blocks, final norm, tied head."""

  def __init__(self, rngs: nnx.Rngs, depth: int = 2):
    self.embed = nnx.Embed(VOCAB, WIDTH, embedding_init=fast_init, rngs=rngs)
    self.pos = nnx.Param(0.1 * fast_init(rngs.params(), (SEQ, WIDTH)))
    self.blocks = nnx.List([DecoderBlock(WIDTH, rngs) for _ in range(depth)])
    self.ln_f = nnx.LayerNorm(WIDTH, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens) + self.pos[...][: tokens.shape[1]]
    for block in self.blocks:
      x = block(x)
    return self.embed.attend(self.ln_f(x))


# Batches come from numpy: jax.random would compile a program per shape.


def mlp_batch(n: int = 32, seed: int = 0):
  x = np.random.default_rng(seed).normal(size=(n, IN)).astype(np.float32)
  y = (x[:, 0] > 0).astype(np.int32) + 2 * (x[:, 1] > 0).astype(np.int32)
  return jnp.asarray(x), jnp.asarray(y)


def image_batch(n: int = 8, seed: int = 0):
  x = np.random.default_rng(seed).normal(size=(n, 8, 8, 3)).astype(np.float32)
  y = (x[..., 0].mean(axis=(1, 2)) > 0).astype(np.int32)
  return jnp.asarray(x), jnp.asarray(y)


def token_batch(n: int = 4, seed: int = 0):
  # A learnable sequence: each token is the previous one plus one.
  start = np.random.default_rng(seed).integers(0, VOCAB, (n, 1))
  tokens = ((start + np.arange(SEQ + 1)) % VOCAB).astype(np.int32)
  return jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, 1:])


# --------------------------------------------------------------------------
# Sanity of the models themselves.


def test_models_run_in_float32_with_expected_shapes():
  def out(model, x):  # abstract evaluation: no op-by-op compilation
    return nnx.eval_shape(lambda m, x: m(x), model, x)
  assert out(MLP(nnx.Rngs(0)), mlp_batch(4)[0]).shape == (4, CLASSES)
  assert out(ResNet(nnx.Rngs(0)), image_batch(2)[0]).shape == (2, CLASSES)
  logits = out(GPT(nnx.Rngs(0)), token_batch(2)[0])
  assert logits.shape == (2, SEQ, VOCAB) and logits.dtype == jnp.float32


def test_linen_mlp_matches_nnx_mlp_in_float32():
  model = MLP(nnx.Rngs(0))
  x, _ = mlp_batch(4)
  params = nnx_mlp_params_as_linen(model)
  np.testing.assert_allclose(LinenMLP().apply({"params": params}, x),
                             model(x), rtol=1e-6, atol=1e-6)
