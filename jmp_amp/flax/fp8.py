"""FP8 matmuls for Flax NNX models, applied from outside.

The front door is a rule value of `jmp_amp.flax.set_policies`: `FP8Policy`,
or its short form ``"float8"`` (``FP8Policy()``: current scaling), makes the
modules a rule decides run their matmuls in FP8, so one rules dict mixes
bfloat16, float32 and FP8 modules. ``FP8Policy(recipe)`` takes the scaling
recipe as data (a `jmp_amp.fp8.FP8Recipe`, e.g. ``FP8Recipe(scaling=
"delayed", history_len=16)``) and the other options (``keep_first_last``,
``param_dtype``); `jmp_amp.flax.get_policies` reports it for an FP8 module.
Plain functions get FP8 from ``jmp_amp.autocast(fn, "float8")``.

A module that can run in FP8 has a matmul knob: ``dot_general``
(`nnx.Linear`, `nnx.LinearGeneral`, your own module with that knob),
``einsum_op`` (`nnx.Einsum`) or ``conv_general_dilated`` (`nnx.Conv`). The
knob gets an FP8 op that runs the matmul with `float8_e4m3fn`
operands forward and `float8_e5m2` gradients backward (see `jmp_amp.fp8`),
and the module computes and returns the recipe's compute dtype (bfloat16).
Master weights keep their dtype (float32). The model's first and last such
modules in call order keep their matmul in bfloat16, as FP8 recipes
recommend: `set_policies` finds the order from ``example_args`` (one abstract
call), and raises without them unless list indices decide it (``layers/0``
... ``layers/N``); attribute names never do. Each FP8 matmul quantizes its
operands as its own, so matmuls that share an input (q/k/v, gate/up) stay
separate FP8 GEMMs on an H100, and runs under ``jax.named_scope("fp8[<module
path>]")``, which `jmp_amp.tools.GpuReport.fp8_fallbacks` reads to check
that every FP8 layer compiled to FP8 GEMMs.
Norms, softmax, embeddings, the loss and modules without a matmul knob
(nnx.Embed, nnx.ConvTranspose) are never FP8: an FP8 rule that names one
raises, and FP8 rules that convert no module at all warn, saying why.

Convolutions: compiled for an H100 (XLA:GPU, jax 0.10.2), an FP8
convolution's forward pass is one cuDNN graph convolution with ``f8e4m3fn``
operands and the scales folded in, but its two backward convolutions take
bfloat16 operands: XLA fuses FP8 only into forward convolutions. They
compute on FP8-rounded values, so the numerics are FP8's; only a third of a
convolution's FLOPs run on FP8 tensor cores. Einsums and dot_generals get
FP8 cuBLAS GEMMs forward and backward.

State: each FP8 op holds its amax histories as `FP8Meta` variables, part of
the model's state: they go through `nnx.split`/`nnx.merge`, `nnx.jit`,
sharding and `jmp_amp.checkpoint` like any other variable, and a resumed run
continues bitwise. `histories` reads them. The new histories are computed
inside the jitted step and arrive as the *gradients* of the `FP8Meta`
variables; `value_and_grad` (which `jmp_amp.flax.make_train_step` uses)
writes them back instead of handing them to the optimizer::

    loss, grads = jmp_amp.flax.fp8.value_and_grad(loss_fn)(model, batch)
    optimizer.update(model, grads)         # grads hold nnx.Param only

A step that differentiates only ``nnx.Param`` still trains under current
scaling (the default), whose scales need no history; delayed scaling needs
the update, without which it falls back to current scaling.

Loss scaling: E5M2 spans the float32-like range of the bfloat16 gradients and
each gradient tensor gets its own scale from its amax, so no loss scaling is
needed (``jmp_amp.NoOpLossScale``, or plain optax). It still composes with
`jmp_amp.loss_scaling`: infinities and NaN pass through the FP8 rounding, so
an overflow is still detected and the step skipped, and non-finite amaxes
never enter a history.

Example:
  >>> import jmp_amp.flax
  >>> from jmp_amp import models
  >>> model = models.MLP(16, 4, num_layers=4, width=32, rngs=nnx.Rngs(0))
  >>> rules = {"layers/3": "float32", "*": "float8"}
  >>> model = jmp_amp.flax.set_policies(model, rules)
  >>> sorted(jmp_amp.flax.fp8.histories(model))  # layers/0: first, bf16
  ['layers/1', 'layers/2']
  >>> policies = jmp_amp.flax.get_policies(model)
  >>> str(policies["layers/1"]), str(policies["layers/0"])
  ('float8', 'p=f32,c=bf16,o=bf16')
  >>> model(jnp.ones((2, 16))).dtype    # the float32 head
  dtype('float32')
"""

from __future__ import annotations

from jmp_amp.flax._fp8 import histories
from jmp_amp.flax._fp8 import value_and_grad
from jmp_amp.flax._fp8_op import FP8Meta
from jmp_amp.flax._fp8_op import FP8Policy

__all__ = (
    "FP8Meta",
    "FP8Policy",
    "histories",
    "value_and_grad",
)
