"""Flax integration: per-module precision policies and mixed-precision steps.

* Rules (`jmp_amp.flax.rules`): ``{module class or path glob: policy}``,
  first match wins, ``"*"`` the default; `mixed_rules` pins norms to float32.
* NNX: `set_policies(model, rules)` in place, through the modules' dtype and
  matmul knobs; `cast_boundary` for module methods that compute without
  knobs; `policy_of`, `get_policies`, `clear_policies`.
* linen: `init_with_policies`, `apply_with_policies`, `policied_apply` (a
  TrainState ``apply_fn``).
* Train steps (`jmp_amp.flax.train`): `make_train_step` (NNX + nnx.Optimizer),
  `make_linen_train_step` (TrainState), with `jmp_amp.loss_scaling`.
* FP8 (`jmp_amp.flax.fp8`): ``"float8"`` as a rule value (`fp8_rules`, or
  `set_fp8(model)` alone) runs Linear, Einsum and Conv matmuls in FP8 (E4M3
  forward, E5M2 backward, per-tensor current or delayed scaling);
  `fp8_value_and_grad` updates the scaling state.

Example:
  >>> import jmp_amp.flax
  >>> model = nnx.Sequential(nnx.Linear(4, 8, rngs=nnx.Rngs(0)),
  ...                        nnx.LayerNorm(8, rngs=nnx.Rngs(0)),
  ...                        nnx.Linear(8, 2, rngs=nnx.Rngs(0)))
  >>> _ = jmp_amp.flax.set_policies(model, jmp_amp.flax.mixed_rules("float16"))
  >>> optimizer = nnx.Optimizer(model, jmp_amp.loss_scaling(
  ...     optax.sgd(0.1), jmp_amp.DynamicLossScale(2.0 ** 15)), wrt=nnx.Param)
  >>> step = jmp_amp.flax.make_train_step(
  ...     lambda m, b: jnp.mean((m(b[0]).astype(jnp.float32) - b[1]) ** 2))
  >>> metrics = step(model, optimizer, (jnp.ones((3, 4)), jnp.zeros((3, 2))))
  >>> bool(metrics["grads_finite"]), model(jnp.ones((1, 4))).dtype
  (True, dtype('float16'))

Not imported by `import jmp_amp`, so the core stays free of Flax.
"""

from jmp_amp.flax import fp8
from jmp_amp.flax.fp8 import clear_fp8
from jmp_amp.flax.fp8 import FP8ConvGeneralDilated
from jmp_amp.flax.fp8 import FP8DotGeneral
from jmp_amp.flax.fp8 import FP8Einsum
from jmp_amp.flax.fp8 import FP8Meta
from jmp_amp.flax.fp8 import FP8Op
from jmp_amp.flax.fp8 import FP8Policy
from jmp_amp.flax.fp8 import fp8_histories
from jmp_amp.flax.fp8 import fp8_modules
from jmp_amp.flax.fp8 import fp8_value_and_grad
from jmp_amp.flax.fp8 import set_fp8
from jmp_amp.flax.fp8 import update_fp8_state
from jmp_amp.flax.linen import apply_with_policies
from jmp_amp.flax.linen import init_with_policies
from jmp_amp.flax.linen import policied_apply
from jmp_amp.flax.nnx import cast_boundary
from jmp_amp.flax.nnx import clear_policies
from jmp_amp.flax.nnx import get_policies
from jmp_amp.flax.nnx import policy_of
from jmp_amp.flax.nnx import set_policies
from jmp_amp.flax.rules import fp8_rules
from jmp_amp.flax.rules import mixed_rules
from jmp_amp.flax.rules import NORM_CLASSES
from jmp_amp.flax.rules import PolicyRules
from jmp_amp.flax.train import make_linen_train_step
from jmp_amp.flax.train import make_train_step
from jmp_amp.flax.train import TrainState

__all__ = (
    "FP8ConvGeneralDilated",
    "FP8DotGeneral",
    "FP8Einsum",
    "FP8Meta",
    "FP8Op",
    "FP8Policy",
    "NORM_CLASSES",
    "PolicyRules",
    "TrainState",
    "apply_with_policies",
    "cast_boundary",
    "clear_fp8",
    "clear_policies",
    "fp8",
    "fp8_histories",
    "fp8_modules",
    "fp8_rules",
    "fp8_value_and_grad",
    "get_policies",
    "init_with_policies",
    "make_linen_train_step",
    "make_train_step",
    "mixed_rules",
    "policied_apply",
    "policy_of",
    "set_fp8",
    "set_policies",
    "update_fp8_state",
)
