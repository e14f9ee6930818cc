"""Copying weights from NNX reference models to their linen twins."""

from __future__ import annotations

from typing import Any

from flax import nnx


def linen_variables_from_nnx(model: nnx.Module) -> dict[str, Any]:
  """The linen variables holding an NNX model's weights.

  Works for any NNX model whose linen twin names sub-modules like the NNX
  attributes, with list items ``name_i`` (linen's naming of lists assigned in
  ``setup``): `MLP`/`LinenMLP` and `models.resnet.ResNet`/`LinenResNet`.

  Args:
    model: the NNX model.

  Returns:
    ``{'params': ...}``, plus ``'batch_stats'`` if the model has
    `nnx.BatchStat` variables, as nested dicts of arrays (the same arrays, not
    copies).
  """
  collections = ((nnx.Param, "params"), (nnx.BatchStat, "batch_stats"))
  out: dict[str, Any] = {}
  for path, var in nnx.to_flat_state(nnx.state(model)):
    collection = next((c for t, c in collections if isinstance(var, t)), None)
    if collection is None:
      continue  # RNG state and the like have no linen counterpart here.
    names: list[str] = []
    for key in path:
      # A list index belongs to the attribute before it: layers/0 -> layers_0.
      if isinstance(key, int) and names:
        names[-1] = f"{names[-1]}_{key}"
      else:
        names.append(str(key))
    node = out.setdefault(collection, {})
    for name in names[:-1]:
      node = node.setdefault(name, {})
    # get_value, not [...]: also works on abstract (nnx.eval_shape) models.
    node[names[-1]] = var.get_value()
  return out
