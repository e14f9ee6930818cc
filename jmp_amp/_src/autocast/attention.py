"""Autocast of attention: `jax.nn.dot_product_attention` as one half op.

Attention is no JAX primitive: XLA's implementation of
`jax.nn.dot_product_attention` traces into dot_generals, a mask and a softmax,
which the per-op rules would run as separate half matmuls around a float32
softmax, with the T x T scores in memory. When the function jits the call
(``jax.jit(jax.nn.dot_product_attention, static_argnames=...)``, as
`jmp_amp.models.GPT` does), the jaxpr shows it as one ``jit`` equation named
``dot_product_attention``. `match` recognises it, by tracing
`jax.nn.dot_product_attention` itself at the same shapes and comparing the
jaxprs, so only a call JAX's function made (query, key, value, causal or not,
default scale, no mask or bias) is taken; `fused` then runs it on half inputs
as torch's autocast runs ``scaled_dot_product_attention``: cuDNN's fused
flash kernel when the program is compiled for a CUDA GPU and cuDNN takes the
inputs, XLA's implementation elsewhere. Both keep the softmax in float32
inside; the result is half.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from jmp_amp._src.autocast.casting import aval_struct
from jmp_amp._src.autocast.casting import is_float

NAME = "dot_product_attention"
_CALLS = ("jit", "pjit")
_dpa = jax.jit(jax.nn.dot_product_attention,
               static_argnames=("is_causal", "implementation"))


def match(eqn) -> Optional[dict[str, Any]]:
  """The keyword arguments of the `jax.nn.dot_product_attention` call that
  `eqn` is, or None when it is not one autocast can run fused."""
  if (eqn.primitive.name not in _CALLS or eqn.params.get("name") != NAME
      or len(eqn.invars) != 3 or len(eqn.outvars) != 1
      or not all(is_float(v.aval.dtype) for v in eqn.invars)):
    return None
  structs = tuple(aval_struct(v.aval) for v in eqn.invars)
  return _match(structs, str(eqn.params["jaxpr"].jaxpr))


@functools.lru_cache(maxsize=64)
def _match(structs, traced: str) -> Optional[dict[str, Any]]:
  for is_causal in (True, False):
    fn = functools.partial(jax.nn.dot_product_attention, is_causal=is_causal)
    try:
      candidate = jax.make_jaxpr(fn)(*structs)
    except (TypeError, ValueError):  # Not query/key/value shapes.
      return None
    if str(candidate.jaxpr) == traced:
      return {"is_causal": is_causal}
  return None


@functools.lru_cache(maxsize=None)
def _cudnn_takes(shapes, dtype, is_causal: bool) -> bool:
  """Whether cuDNN's fused attention accepts these inputs (asked by tracing
  it abstractly: it raises without cuDNN, on float32, on head dims or
  sequence lengths it does not support)."""
  structs = [jax.ShapeDtypeStruct(s, dtype) for s in shapes]
  try:
    jax.eval_shape(functools.partial(_dpa, is_causal=is_causal,
                                     implementation="cudnn"), *structs)
  except (RuntimeError, NotImplementedError, ValueError, TypeError):
    return False
  return True


def fused(q, k, v, *, dtype: np.dtype, is_causal: bool):
  """`jax.nn.dot_product_attention` of `q`, `k`, `v` cast to half `dtype`.

  cuDNN's kernel for a CUDA GPU where it takes them, XLA's implementation
  for other platforms (`jax.lax.platform_dependent`); float16 on the CPU,
  whose dot does not take float16 into float32, runs XLA's implementation
  on float32 copies.
  """
  q, k, v = (jnp.asarray(a).astype(dtype) for a in (q, k, v))
  xla = functools.partial(_dpa, is_causal=is_causal, implementation="xla")
  default = xla
  if dtype == np.float16:
    default = lambda *qkv: lax.platform_dependent(
        *qkv, default=xla, cpu=lambda *a: xla(
            *(x.astype(np.float32) for x in a)).astype(dtype))
  shapes = tuple(tuple(a.shape) for a in (q, k, v))
  if not _cudnn_takes(shapes, np.dtype(dtype), is_causal):
    return default(q, k, v)
  cudnn = functools.partial(_dpa, is_causal=is_causal, implementation="cudnn")
  return lax.platform_dependent(q, k, v, cuda=cudnn, default=default)
