"""Flax integration: per-module precision policies and mixed-precision steps.

Not imported by `import jmp_amp`, so the core stays free of Flax.
"""

from jmp_amp.flax.linen import apply_with_policies
from jmp_amp.flax.linen import init_with_policies
from jmp_amp.flax.linen import linen_policies
from jmp_amp.flax.linen import policied_apply
from jmp_amp.flax.nnx import clear_policies
from jmp_amp.flax.nnx import get_policies
from jmp_amp.flax.nnx import policy_of
from jmp_amp.flax.nnx import set_policies
from jmp_amp.flax.rules import mixed_rules
from jmp_amp.flax.rules import NORM_CLASSES
from jmp_amp.flax.rules import PolicyRules
from jmp_amp.flax.train import make_linen_train_step
from jmp_amp.flax.train import make_train_step
from jmp_amp.flax.train import TrainState

__all__ = (
    "NORM_CLASSES",
    "PolicyRules",
    "TrainState",
    "apply_with_policies",
    "clear_policies",
    "get_policies",
    "init_with_policies",
    "linen_policies",
    "make_linen_train_step",
    "make_train_step",
    "mixed_rules",
    "policied_apply",
    "policy_of",
    "set_policies",
)
