"""FP8 matmuls: E4M3 operands forward, E5M2 gradients backward, per tensor.

The building blocks, for code that calls matmuls itself: `dot_general`,
`einsum` and `conv_general_dilated` take the arguments of their `jax.lax` /
`jax.numpy` namesakes plus an `FP8Recipe` (current scaling by default,
``FP8Recipe(scaling="delayed", history_len=16)``, or
``FP8Recipe(scaling="rowwise")`` for `dot_general`) and, for delayed
scaling, the amax histories (`FP8State`) the training loop carries. Their
GEMMs take the FP8 tensors themselves, so that XLA:GPU on Hopper runs FP8
GEMMs under its default options (Triton) and with cuBLAS, and cuDNN FP8
convolutions; elsewhere they compute with the FP8-rounded values, so the
numerics are FP8's on every backend.

`compiler_options` gives the XLA options a program with FP8 GEMMs compiles
with on a CUDA GPU (``{}`` elsewhere).

Flax models get FP8 through a rule value of `jmp_amp.flax.set_policies`
(``"float8"``, or ``jmp_amp.flax.fp8.FP8Policy(recipe)``), plain functions
through ``jmp_amp.autocast(fn, "float8")``.

Example:
  >>> x, w = jnp.ones((2, 3)), jnp.full((3, 4), 0.5)
  >>> jmp_amp.fp8.dot_general(x, w, (((1,), (0,)), ((), ()))).dtype
  dtype(bfloat16)
  >>> recipe = jmp_amp.fp8.FP8Recipe(scaling="delayed", history_len=4)
  >>> state = jmp_amp.fp8.FP8State(*(jnp.zeros(4) for _ in range(3)))
  >>> y = jmp_amp.fp8.einsum("ab,bc->ac", x, w, state=state, recipe=recipe)
  >>> y.tolist()[0]
  [1.5, 1.5, 1.5, 1.5]
"""

from jmp_amp._src.fp8 import FP8Recipe
from jmp_amp._src.fp8 import FP8State
from jmp_amp._src.fp8_compile import compiler_options
from jmp_amp._src.fp8_ops import conv_general_dilated
from jmp_amp._src.fp8_ops import dot_general
from jmp_amp._src.fp8_ops import einsum

__all__ = (
    "FP8Recipe",
    "FP8State",
    "compiler_options",
    "conv_general_dilated",
    "dot_general",
    "einsum",
)
