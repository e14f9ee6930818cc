"""Flax integration: per-module precision policies and mixed-precision steps.

* Rules (`jmp_amp.flax.rules`): ``{module class or path glob: policy}``,
  first match wins, ``"*"`` the default; `mixed_rules` pins norms to float32.
* NNX: `set_policies(model, rules)` in place; `policy_of`, `get_policies`,
  `clear_policies`.
* linen: `linen_policies(rules)` context, `init_with_policies`,
  `apply_with_policies`, `policied_apply` (a TrainState ``apply_fn``).
* Train steps (`jmp_amp.flax.train`): `make_train_step` (NNX + nnx.Optimizer),
  `make_linen_train_step` (TrainState), with `jmp_amp.loss_scaling`.

Example:
  >>> jmp_amp.flax.set_policies(model, jmp_amp.flax.mixed_rules("float16"))
  >>> step = jmp_amp.flax.make_train_step(lambda m, b: loss_fn(m(b[0]), b[1]))
  >>> metrics = step(model, optimizer, (x, y))

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
