"""The MLP from PyTorch's automatic-mixed-precision recipe, in NNX and linen.

The recipe (https://pytorch.org/tutorials/recipes/recipes/amp_recipe.html)
builds ``num_layers - 1`` blocks of ``Linear(in, in)`` + ``ReLU`` followed by a
final ``Linear(in, out)``, with ``in = out = 4096``, and trains it with a mean
squared error on random data. `MLP` and `LinenMLP` are that network; an
optional ``width`` decouples the hidden width from ``in_size``.

Both know nothing of mixed precision beyond the standard Flax knobs: every
layer takes ``dtype`` (compute dtype, None to follow the inputs) and
``param_dtype``, so a policy can be applied from outside by setting those (and
``dot_general``) on the layers in ``layers``.
"""

from __future__ import annotations

from typing import Any, Optional

from flax import nnx
import flax.linen as nn
import jax
import jax.numpy as jnp

from .convert import linen_variables_from_nnx

Dtype = Any


def _widths(in_size: int, out_size: int, num_layers: int,
            width: Optional[int]) -> list[tuple[int, int]]:
  """(in_features, out_features) of each Linear layer, first to last."""
  if num_layers < 1:
    raise ValueError(f"num_layers must be >= 1, got {num_layers}")
  width = in_size if width is None else width
  sizes = [in_size] + [width] * (num_layers - 1) + [out_size]
  return list(zip(sizes[:-1], sizes[1:]))


class MLP(nnx.Module):
  """``num_layers`` Linear layers with ReLU between them (none after the last).

  Attributes:
    layers: `nnx.List` of the `nnx.Linear` layers, in order; the last one is
      the output layer (no activation after it).
  """

  def __init__(self, in_size: int = 4096, out_size: int = 4096,
               num_layers: int = 3, *, width: Optional[int] = None,
               dtype: Optional[Dtype] = None,
               param_dtype: Dtype = jnp.float32, rngs: nnx.Rngs):
    """Builds the layers.

    Args:
      in_size: input features.
      out_size: output features.
      num_layers: number of Linear layers in total (the recipe's
        ``num_layers``): ``num_layers - 1`` hidden Linear+ReLU, then the
        output Linear.
      width: hidden width; defaults to ``in_size`` as in the recipe.
      dtype: compute dtype of every layer (None: follow the inputs).
      param_dtype: dtype the parameters are created in.
      rngs: parameter initialisation keys.
    """
    self.layers = nnx.List([
        nnx.Linear(i, o, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        for i, o in _widths(in_size, out_size, num_layers, width)])

  def __call__(self, x: jax.Array) -> jax.Array:
    for layer in self.layers[:-1]:
      x = jax.nn.relu(layer(x))
    return self.layers[-1](x)


class LinenMLP(nn.Module):
  """`MLP` in linen: parameters ``layers_0`` ... ``layers_{n-1}``.

  The parameter tree has the same names (``layers_i/{kernel,bias}``), shapes
  and order as `MLP`'s state with the list index folded into the name, so
  `linen_params_from_nnx` copies weights across.

  Attributes:
    in_size: input features (checked against the input; Dense infers it).
    out_size: output features.
    num_layers: number of Dense layers in total.
    width: hidden width; None means ``in_size``.
    dtype: compute dtype of every layer (None: follow the inputs).
    param_dtype: dtype the parameters are created in.
  """
  in_size: int = 4096
  out_size: int = 4096
  num_layers: int = 3
  width: Optional[int] = None
  dtype: Optional[Dtype] = None
  param_dtype: Dtype = jnp.float32

  def setup(self):
    # A list assigned in setup names its items layers_0, layers_1, ...
    self.layers = [
        nn.Dense(o, dtype=self.dtype, param_dtype=self.param_dtype)
        for _, o in _widths(self.in_size, self.out_size, self.num_layers,
                            self.width)]

  def __call__(self, x: jax.Array) -> jax.Array:
    if x.shape[-1] != self.in_size:
      raise ValueError(f"expected {self.in_size} input features, got "
                       f"{x.shape[-1]}")
    for layer in self.layers[:-1]:
      x = jax.nn.relu(layer(x))
    return self.layers[-1](x)


def linen_params_from_nnx(model: MLP) -> dict[str, Any]:
  """``{'params': ...}`` for `LinenMLP` holding ``model``'s weights.

  The arrays are the model's own (not copies); abstract models
  (`nnx.eval_shape`) give `jax.ShapeDtypeStruct` leaves.
  """
  return {"params": linen_variables_from_nnx(model)["params"]}


def mse_loss(pred: jax.Array, target: jax.Array) -> jax.Array:
  """Mean squared error computed in float32 whatever the inputs' dtypes.

  The recipe computes its loss on float32 outputs (``mse_loss(out.float(),
  target)``): squaring and summing thousands of half values loses precision
  and overflows float16.
  """
  pred = jnp.asarray(pred, jnp.float32)
  target = jnp.asarray(target, jnp.float32)
  return jnp.mean(jnp.square(pred - target))
