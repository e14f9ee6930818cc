"""jmp_amp: automatic mixed precision for JAX, Flax and optax.

A drop-in for jmp (``import jmp_amp as jmp``) plus dynamic loss scaling as an
optax transformation, op-level autocast and a matmul-dtype audit. FP8
matmuls live in `jmp_amp.fp8`, 16-bit optimizer state and master weights in
`jmp_amp.optim`, the report types in `jmp_amp.tools`. Flax
integration lives in `jmp_amp.flax`, which this module does not import.

Example (jmp's own names, as jmp code uses them):
  >>> import jmp_amp as jmp
  >>> params = {"w": jnp.ones(2), "step": jnp.int32(0)}
  >>> half = jmp.cast_to_half(params)  # the floating leaves only
  >>> half["w"].dtype == jmp.half_dtype(), half["step"].dtype
  (True, dtype('int32'))
  >>> jmp.cast_to_full(half)["w"].dtype
  dtype('float32')
  >>> loss_scale: jmp.LossScale = jmp.DynamicLossScale(jnp.float32(2 ** 15))
  >>> isinstance(loss_scale, jmp.LossScale)  # one of the three classes
  True
"""

from jmp_amp import fp8
from jmp_amp import optim
from jmp_amp._src.autocast import autocast
from jmp_amp._src.autocast import AutocastRules
from jmp_amp._src.dtypes import half_dtype
from jmp_amp._src.loss_scale import DynamicLossScale
from jmp_amp._src.loss_scale import LossScale
from jmp_amp._src.loss_scale import NoOpLossScale
from jmp_amp._src.loss_scale import StaticLossScale
from jmp_amp._src.ops import conv_general_dilated
from jmp_amp._src.ops import dot_general
from jmp_amp._src.policy import cast_to_full
from jmp_amp._src.policy import cast_to_half
from jmp_amp._src.policy import get_policy
from jmp_amp._src.policy import Policy
from jmp_amp._src.scaling import loss_scaling
from jmp_amp._src.scaling import LossScalingState
from jmp_amp._src.scaling_state import get_scaling_state
from jmp_amp._src.scaling_state import scaled_value_and_grad
from jmp_amp._src.tree import all_finite
from jmp_amp._src.tree import select_tree
from jmp_amp.tools.audit import matmul_report
from jmp_amp.tools.gpu_target import gpu_report

__version__ = "0.1.0"

__all__ = (
    # jmp's own names.
    "DynamicLossScale",
    "LossScale",
    "NoOpLossScale",
    "Policy",
    "StaticLossScale",
    "all_finite",
    "cast_to_full",
    "cast_to_half",
    "get_policy",
    "half_dtype",
    "select_tree",
    # Loss scaling as an optax transformation.
    "LossScalingState",
    "get_scaling_state",
    "loss_scaling",
    "scaled_value_and_grad",
    # Op-level autocast and half-precision matmuls with float32 results.
    "AutocastRules",
    "autocast",
    "conv_general_dilated",
    "dot_general",
    # What the compiler makes of a program.
    "gpu_report",
    "matmul_report",
)
