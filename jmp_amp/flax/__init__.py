"""Flax integration: per-module precision policies and mixed-precision steps.

* Rules (`jmp_amp.flax.rules`): ``{module class or path glob: policy}``,
  the most specific match wins, ``"*"`` the default; `mixed_rules` pins
  norms to float32. A policy is a `jmp_amp.Policy` or its string, or FP8:
  ``"float8"`` or a `jmp_amp.flax.fp8.FP8Policy` (see `jmp_amp.flax.fp8`).
* NNX: `set_policies(model, rules)` in place, through the modules' dtype and
  matmul knobs; `cast_boundary` for module methods that compute without
  knobs; `get_policies`, `clear_policies`.
* linen: `init_with_policies`, `apply_with_policies`.
* Train steps (`jmp_amp.flax.train`): `make_train_step` (NNX + nnx.Optimizer),
  `make_linen_train_step` (a TrainState), with `jmp_amp.loss_scaling`.

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
from jmp_amp.flax import rules
from jmp_amp.flax import train
from jmp_amp.flax.linen import apply_with_policies
from jmp_amp.flax.linen import init_with_policies
from jmp_amp.flax.nnx import cast_boundary
from jmp_amp.flax.nnx import clear_policies
from jmp_amp.flax.nnx import get_policies
from jmp_amp.flax.nnx import set_policies
from jmp_amp.flax.rules import mixed_rules
from jmp_amp.flax.train import make_linen_train_step
from jmp_amp.flax.train import make_train_step

__all__ = (
    "apply_with_policies",
    "cast_boundary",
    "clear_policies",
    "get_policies",
    "init_with_policies",
    "make_linen_train_step",
    "make_train_step",
    "mixed_rules",
    "set_policies",
)
