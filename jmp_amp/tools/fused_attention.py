"""Fused attention calls in a lowered or compiled GPU program.

cuDNN's flash attention is one custom call (``__cudnn$fmhaSoftmax``, and
``__cudnn$fmhaSoftmaxBackward`` in a train step), which JAX emits when it
lowers `jax.nn.dot_product_attention(..., implementation="cudnn")`: the
attention's contractions run inside it. `jmp_amp.tools.report` lists each
as a record of kind "attention" rather than as GEMMs.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from jax.extend.mlir import ir

from jmp_amp.tools import element_types

TARGETS = ("__cudnn$fmha",)


def is_target(target: Optional[str]) -> bool:
  return bool(target) and target.startswith(TARGETS)


def mlir_target(op) -> Optional[str]:
  """The target of a StableHLO fused attention custom call, else None."""
  if op.name != "stablehlo.custom_call":
    return None
  target = ir.StringAttr(op.attributes["call_target_name"]).value
  return target if is_target(target) else None


def mlir_config(op) -> dict[str, Any]:
  """The backend config of a StableHLO custom call, as a dict."""
  if "backend_config" not in op.attributes:
    return {}
  try:
    return json.loads(ir.StringAttr(op.attributes["backend_config"]).value)
  except (ValueError, TypeError):
    return {}


def flops(target: str, config: dict[str, Any], query_shape) -> Optional[int]:
  """Nominal FLOPs of a fused attention call.

  Its backend config names the scores' shape ``[batch, heads, T, S]``; with
  the head dim H (the query's last dim) the forward pass is two
  contractions, ``4 * B*N*T*S * H``, and the backward pass (``...Backward``)
  five, ``10 * B*N*T*S * H``. The whole T x S rectangle is counted, as for a
  dense matmul, even where a causal mask lets the kernel skip half of it.
  """
  shape = config.get("cudnn_fmha_backend_config", {}).get(
      "intermediate_tensor_shape", {}).get("dimensions")
  scores = element_types.prod(int(d) for d in shape) if shape else None
  if scores is None or not query_shape or query_shape[-1] is None:
    return None
  return (10 if "Backward" in target else 4) * scores * query_shape[-1]
