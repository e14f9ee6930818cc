"""Small deterministic synthetic data for the reference models.

Everything is numpy, generated from ``seed`` alone, so a batch is the same on
every run and every backend (and can be handed to PyTorch as well as JAX).
"""

from __future__ import annotations

import numpy as np

IMAGE_SHAPE = (32, 32, 3)

# The class patterns are drawn from this fixed seed rather than the batch's,
# so batches made with different seeds share one learnable task.
_PATTERN_SEED = 20240611


def regression_batches(num_batches: int, batch_size: int, in_size: int,
                       out_size: int, seed: int = 0
                       ) -> tuple[np.ndarray, np.ndarray]:
  """Random-normal inputs and targets, as PyTorch's AMP recipe makes them.

  Args:
    num_batches: number of batches.
    batch_size: rows per batch.
    in_size: input features.
    out_size: target features.
    seed: random seed.

  Example:
    >>> xs, ys = regression_batches(2, 4, 3, 1)
    >>> xs.shape, ys.shape
    ((2, 4, 3), (2, 4, 1))

  Returns:
    ``(inputs, targets)``: float32 arrays ``[num_batches, batch_size,
    in_size]`` and ``[num_batches, batch_size, out_size]``; iterating over
    (or zipping) them yields the batches.
  """
  rng = np.random.default_rng(seed)
  inputs = rng.standard_normal((num_batches, batch_size, in_size),
                               dtype=np.float32)
  targets = rng.standard_normal((num_batches, batch_size, out_size),
                                dtype=np.float32)
  return inputs, targets


def class_patterns(num_classes: int,
                   shape: tuple[int, int, int] = IMAGE_SHAPE) -> np.ndarray:
  """One fixed smooth float32 mean image per class, ``[num_classes, *shape]``.

  Smooth (low-frequency) patterns survive a conv net's downsampling, so a
  small ResNet learns them in a few steps.
  """
  rng = np.random.default_rng(_PATTERN_SEED + num_classes)
  height, width, channels = shape
  coarse = rng.standard_normal((num_classes, 4, 4, channels)).astype(np.float32)
  # Nearest-neighbour upsampling of a 4x4 grid.
  rows = np.arange(height) * 4 // height
  cols = np.arange(width) * 4 // width
  return coarse[:, rows][:, :, cols]


def image_batch(batch_size: int, num_classes: int = 10, seed: int = 0,
                noise: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
  """NHWC 32x32x3 images of ``class pattern + noise`` and their labels.

  Args:
    batch_size: number of images.
    num_classes: number of classes.
    seed: random seed for labels and noise (the patterns are fixed).
    noise: standard deviation of the Gaussian noise.

  Returns:
    ``(images, labels)``: float32 ``[batch_size, 32, 32, 3]`` and int32
    ``[batch_size]`` in ``[0, num_classes)``.
  """
  rng = np.random.default_rng(seed)
  labels = rng.integers(0, num_classes, size=batch_size).astype(np.int32)
  images = class_patterns(num_classes)[labels]
  images = images + noise * rng.standard_normal(images.shape,
                                                dtype=np.float32)
  return images.astype(np.float32), labels


def token_batch(batch_size: int, seq_len: int = 64, vocab: int = 256,
                seed: int = 0, max_step: int = 3) -> np.ndarray:
  """Token sequences that are arithmetic progressions modulo ``vocab``.

  Row ``i`` is ``start_i + step_i * t (mod vocab)`` with a random start and a
  random step in ``[1, max_step]``: from the second token on, the next token
  is determined by the previous two, so a small causal model learns it.

  Args:
    batch_size: number of sequences.
    seq_len: tokens per sequence.
    vocab: vocabulary size.
    seed: random seed.
    max_step: largest step of a progression.

  Returns:
    int32 ``[batch_size, seq_len]`` tokens in ``[0, vocab)``.
  """
  rng = np.random.default_rng(seed)
  start = rng.integers(0, vocab, size=(batch_size, 1))
  step = rng.integers(1, max_step + 1, size=(batch_size, 1))
  return ((start + step * np.arange(seq_len)) % vocab).astype(np.int32)


def digits(seed: int = 0) -> tuple[tuple[np.ndarray, np.ndarray],
                                   tuple[np.ndarray, np.ndarray]]:
  """scikit-learn's handwritten digits (8x8), scaled to [0, 1], shuffled.

  Needs scikit-learn (the ``test`` extra installs it).

  Returns:
    ``((x, y), (x_test, y_test))``: 80 % / 20 % of the 1797 images, float32
    ``[n, 64]`` inputs and int32 labels, shuffled with `seed`.
  """
  from sklearn import datasets  # pylint: disable=g-import-not-at-top
  data = datasets.load_digits()
  x = (data.data / 16.0).astype(np.float32)
  y = data.target.astype(np.int32)
  order = np.random.default_rng(seed).permutation(len(x))
  x, y = x[order], y[order]
  split = int(0.8 * len(x))
  return (x[:split], y[:split]), (x[split:], y[split:])
