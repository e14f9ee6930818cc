"""jmp_amp: automatic mixed precision for JAX, Flax and optax.

A drop-in for jmp (``import jmp_amp as jmp``) plus dynamic loss scaling as an
optax transformation, op-level autocast and a matmul-dtype audit. Flax
integration lives in `jmp_amp.flax`, which this module does not import.
"""

from jmp_amp._src.autocast import autocast
from jmp_amp._src.autocast import AutocastRules
from jmp_amp._src.autocast import DEFAULT_AUTOCAST_RULES
from jmp_amp._src.dtypes import half_dtype
from jmp_amp._src.fp8 import delayed_scaling
from jmp_amp._src.fp8 import fp8_conv_general_dilated
from jmp_amp._src.fp8 import fp8_dot_general
from jmp_amp._src.fp8 import fp8_einsum
from jmp_amp._src.fp8 import FP8Recipe
from jmp_amp._src.fp8 import FP8State
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
from jmp_amp._src.scaling import get_loss_scale
from jmp_amp._src.scaling import get_scaling_state
from jmp_amp._src.scaling import loss_scaling
from jmp_amp._src.scaling import LossScalingState
from jmp_amp._src.scaling import scaled_value_and_grad
from jmp_amp._src.scaling import scaling_metrics
from jmp_amp._src.tree import all_finite
from jmp_amp._src.tree import select_tree
from jmp_amp.tools import gpu_report
from jmp_amp.tools import GpuReport
from jmp_amp.tools import matmul_report
from jmp_amp.tools import MatmulRecord
from jmp_amp.tools import MatmulReport

__version__ = "0.1.0"

__all__ = (
    "FP8Recipe",
    "FP8State",
    "AutocastRules",
    "DEFAULT_AUTOCAST_RULES",
    "DynamicLossScale",
    "GpuReport",
    "LossScale",
    "LossScalingState",
    "MatmulRecord",
    "MatmulReport",
    "NoOpLossScale",
    "Policy",
    "StaticLossScale",
    "all_finite",
    "autocast",
    "cast_to_full",
    "cast_to_half",
    "conv_general_dilated",
    "delayed_scaling",
    "dot_general",
    "fp8_conv_general_dilated",
    "fp8_dot_general",
    "fp8_einsum",
    "get_policy",
    "get_scaling_state",
    "gpu_report",
    "half_dtype",
    "loss_scaling",
    "matmul_report",
    "scaled_value_and_grad",
    "scaling_metrics",
    "select_tree",
)
