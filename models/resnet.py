"""A small CIFAR-style ResNet with BatchNorm, in NNX and linen.

stem conv3x3 -> BN -> relu, then stages of basic residual blocks (the first
block of every stage after the first halves the resolution and doubles the
width), global average pool, linear head. Inputs are NHWC images, 32x32x3 by
default (any size works: the pool is global).

BatchNorm is what makes this model interesting for mixed precision: its
statistics should stay float32 and a skipped (non-finite) step must not update
them. Every layer takes the standard Flax ``dtype``/``param_dtype`` knobs.

Train/eval mode:
  * NNX: ``model.train()`` / ``model.eval()`` set ``use_running_average`` on
    every `nnx.BatchNorm` (``nnx.view(model, use_running_average=True)`` gives
    an eval-mode view sharing the weights); ``model(x, train=...)`` overrides
    the stored mode for one call. A fresh model is in train mode.
  * linen: ``apply(variables, x, train=True, mutable=['batch_stats'])``
    updates the ``batch_stats`` collection; ``train=False`` reads it.

`ResNet` and `LinenResNet` name their variables alike (``stem``, ``stem_bn``,
``blocks_i/conv1`` ...), so `models.convert.linen_variables_from_nnx` copies
an NNX model's params and batch stats to linen.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from flax import nnx
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

Dtype = Any

# The usual CIFAR value; Flax's default (0.99) adapts too slowly for short runs.
BN_MOMENTUM = 0.9


def _block_specs(stage_sizes: Sequence[int],
                 base_width: int) -> list[tuple[int, int, int]]:
  """(in_channels, out_channels, stride) of every block, first to last."""
  specs = []
  channels = base_width
  for stage, num_blocks in enumerate(stage_sizes):
    out = base_width * 2 ** stage
    for b in range(num_blocks):
      stride = 2 if stage > 0 and b == 0 else 1
      specs.append((channels, out, stride))
      channels = out
  return specs


def _use_running_average(train: Optional[bool]) -> Optional[bool]:
  # None lets every BatchNorm fall back to its own attribute (train()/eval()).
  return None if train is None else not train


class BasicBlock(nnx.Module):
  """conv3x3-BN-relu-conv3x3-BN plus shortcut, then relu.

  Attributes:
    conv1, bn1, conv2, bn2: the residual branch.
    shortcut_conv, shortcut_bn: 1x1 conv + BN on the shortcut when the shape
      changes (stride or width), else None (identity).
  """

  def __init__(self, in_channels: int, out_channels: int, stride: int = 1, *,
               dtype: Optional[Dtype] = None,
               param_dtype: Dtype = jnp.float32, rngs: nnx.Rngs):
    knobs = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    bn = dict(momentum=BN_MOMENTUM, **knobs)
    self.conv1 = nnx.Conv(in_channels, out_channels, (3, 3), stride,
                          use_bias=False, **knobs)
    self.bn1 = nnx.BatchNorm(out_channels, **bn)
    self.conv2 = nnx.Conv(out_channels, out_channels, (3, 3), use_bias=False,
                          **knobs)
    self.bn2 = nnx.BatchNorm(out_channels, **bn)
    if stride != 1 or in_channels != out_channels:
      self.shortcut_conv = nnx.data(nnx.Conv(
          in_channels, out_channels, (1, 1), stride, use_bias=False, **knobs))
      self.shortcut_bn = nnx.data(nnx.BatchNorm(out_channels, **bn))
    else:
      # nnx.data: a None attribute would otherwise be static, and a module
      # could never be put there later.
      self.shortcut_conv = nnx.data(None)
      self.shortcut_bn = nnx.data(None)

  def __call__(self, x: jax.Array, train: Optional[bool] = None) -> jax.Array:
    ura = _use_running_average(train)
    y = jax.nn.relu(self.bn1(self.conv1(x), use_running_average=ura))
    y = self.bn2(self.conv2(y), use_running_average=ura)
    if self.shortcut_conv is not None:
      x = self.shortcut_bn(self.shortcut_conv(x), use_running_average=ura)
    return jax.nn.relu(x + y)


class ResNet(nnx.Module):
  """CIFAR-style ResNet.

  Attributes:
    stem: 3x3 `nnx.Conv`, ``in_channels -> base_width``.
    stem_bn: its `nnx.BatchNorm`.
    blocks: `nnx.List` of `BasicBlock`, all stages flattened in order.
    head: `nnx.Linear` from the last stage's width to ``num_classes``.
  """

  def __init__(self, stage_sizes: Sequence[int] = (1, 1, 1),
               base_width: int = 16, num_classes: int = 10,
               in_channels: int = 3, *, dtype: Optional[Dtype] = None,
               param_dtype: Dtype = jnp.float32, rngs: nnx.Rngs):
    """Builds the layers.

    Args:
      stage_sizes: number of basic blocks per stage.
      base_width: channels of the stem and first stage; stage ``i`` has
        ``base_width * 2**i``.
      num_classes: outputs of the head.
      in_channels: input image channels.
      dtype: compute dtype of every layer (None: follow the inputs).
      param_dtype: dtype the parameters are created in.
      rngs: parameter initialisation keys.
    """
    knobs = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.stem = nnx.Conv(in_channels, base_width, (3, 3), use_bias=False,
                         **knobs)
    self.stem_bn = nnx.BatchNorm(base_width, momentum=BN_MOMENTUM, **knobs)
    specs = _block_specs(stage_sizes, base_width)
    self.blocks = nnx.List([BasicBlock(i, o, s, **knobs)
                            for i, o, s in specs])
    last = specs[-1][1] if specs else base_width
    self.head = nnx.Linear(last, num_classes, **knobs)

  def __call__(self, x: jax.Array, train: Optional[bool] = None) -> jax.Array:
    """Logits of NHWC images.

    Args:
      x: images, ``[batch, height, width, in_channels]``.
      train: True to normalise with batch statistics and update the running
        ones, False to use the running ones; None (default) follows the mode
        set by ``train()``/``eval()``.

    Returns:
      ``[batch, num_classes]`` logits.
    """
    ura = _use_running_average(train)
    x = jax.nn.relu(self.stem_bn(self.stem(x), use_running_average=ura))
    for block in self.blocks:
      x = block(x, train)
    return self.head(jnp.mean(x, axis=(1, 2)))


class LinenBasicBlock(nn.Module):
  """`BasicBlock` in linen (same variable names)."""
  in_channels: int
  out_channels: int
  stride: int = 1
  dtype: Optional[Dtype] = None
  param_dtype: Dtype = jnp.float32

  def setup(self):
    knobs = dict(dtype=self.dtype, param_dtype=self.param_dtype)
    bn = dict(momentum=BN_MOMENTUM, **knobs)
    strides = (self.stride, self.stride)
    self.conv1 = nn.Conv(self.out_channels, (3, 3), strides, use_bias=False,
                         **knobs)
    self.bn1 = nn.BatchNorm(**bn)
    self.conv2 = nn.Conv(self.out_channels, (3, 3), use_bias=False, **knobs)
    self.bn2 = nn.BatchNorm(**bn)
    if self.stride != 1 or self.in_channels != self.out_channels:
      self.shortcut_conv = nn.Conv(self.out_channels, (1, 1), strides,
                                   use_bias=False, **knobs)
      self.shortcut_bn = nn.BatchNorm(**bn)
    else:
      self.shortcut_conv = None
      self.shortcut_bn = None

  def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
    ura = not train
    y = jax.nn.relu(self.bn1(self.conv1(x), use_running_average=ura))
    y = self.bn2(self.conv2(y), use_running_average=ura)
    if self.shortcut_conv is not None:
      x = self.shortcut_bn(self.shortcut_conv(x), use_running_average=ura)
    return jax.nn.relu(x + y)


class LinenResNet(nn.Module):
  """`ResNet` in linen; ``train`` is a call argument.

  Variables: ``params`` and ``batch_stats`` collections with sub-modules
  ``stem``, ``stem_bn``, ``blocks_0`` ... ``blocks_{n-1}``, ``head``.
  """
  stage_sizes: Sequence[int] = (1, 1, 1)
  base_width: int = 16
  num_classes: int = 10
  in_channels: int = 3
  dtype: Optional[Dtype] = None
  param_dtype: Dtype = jnp.float32

  def setup(self):
    knobs = dict(dtype=self.dtype, param_dtype=self.param_dtype)
    self.stem = nn.Conv(self.base_width, (3, 3), use_bias=False, **knobs)
    self.stem_bn = nn.BatchNorm(momentum=BN_MOMENTUM, **knobs)
    self.blocks = [LinenBasicBlock(i, o, s, **knobs)
                   for i, o, s in _block_specs(self.stage_sizes,
                                               self.base_width)]
    self.head = nn.Dense(self.num_classes, **knobs)

  def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
    """Logits; with ``train=True`` apply with ``mutable=['batch_stats']``."""
    x = self.stem(x)
    x = jax.nn.relu(self.stem_bn(x, use_running_average=not train))
    for block in self.blocks:
      x = block(x, train)
    return self.head(jnp.mean(x, axis=(1, 2)))


def cross_entropy_loss(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Mean softmax cross-entropy with integer labels, computed in float32.

  log-softmax in half precision loses the small probabilities the gradient
  is made of, so the logits are upcast first whatever their dtype.
  """
  logits = jnp.asarray(logits, jnp.float32)
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(
      logits, labels))
