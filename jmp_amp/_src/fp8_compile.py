"""How programs with FP8 GEMMs compile: `compiler_options`, and the jit of
jmp_amp's train steps that applies them when the traced step has FP8 GEMMs.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.extend.core as jex_core
import numpy as np

from jmp_amp._src.fp8 import FP8_DTYPES

# The XLA options of a program with FP8 GEMMs. On a real H200 under XLA's
# defaults (jax 0.11.2) the GEMM autotuner spent 50 to 120 s on the first
# FP8 step it compiled, timing Triton configurations for every new FP8 GEMM,
# then chose cuBLAS for every one; with Triton GEMMs off the same step
# compiled in 5 s to the same cuBLAS FP8 GEMMs and ran as fast
# (benchmarks/results/gpu_check_nvidia-h200*.json, docs/fp8.md).
FP8_COMPILER_OPTIONS = {"xla_gpu_enable_triton_gemm": False}


def compiler_options(program: Any = None, *,
                     platform: Optional[str] = None) -> dict[str, Any]:
  """The XLA compiler options that a program with FP8 GEMMs compiles with.

  For a CUDA GPU: ``{"xla_gpu_enable_triton_gemm": False}``. Under XLA's
  default options the GEMM autotuner times Triton kernels for every new FP8
  GEMM (one to two minutes per step on an H200) and then picks cuBLAS's
  FP8 GEMM anyway; with Triton GEMMs off it compiles the same cuBLAS GEMMs
  in seconds. For any other platform: ``{}``, nothing to set.

  Give the result to ``jax.jit(f, compiler_options=...)``, or to
  ``jitted.lower(...).compile(...)`` (the route for ``nnx.jit``, which
  takes no options). `jmp_amp.flax.make_train_step` applies it itself.

  Example:
    >>> jmp_amp.fp8.compiler_options(platform="cuda")
    {'xla_gpu_enable_triton_gemm': False}
    >>> jmp_amp.fp8.compiler_options(platform="cpu")
    {}
    >>> f = jmp_amp.autocast(lambda x, w: x @ w, "float8")
    >>> traced = jax.jit(f).trace(jnp.ones((2, 3)), jnp.ones((3, 4)))
    >>> jmp_amp.fp8.compiler_options(traced, platform="cuda")
    {'xla_gpu_enable_triton_gemm': False}
    >>> traced = jax.jit(jnp.matmul).trace(jnp.ones((2, 3)), jnp.ones((3, 4)))
    >>> jmp_amp.fp8.compiler_options(traced, platform="cuda")
    {}

  Args:
    program: None (the options of a program that has FP8 GEMMs), or a
      traced program: a `jax.stages.Traced` (``jax.jit(f).trace(...)``)
      or a jaxpr. Its options are ``{}`` unless it has FP8 GEMMs
      (a ``dot_general`` of FP8 operands, in any nested jaxpr).
    platform: the platform the program compiles for: ``"cuda"``,
      ``"rocm"``, ``"gpu"`` (whichever of the two JAX has), ``"cpu"``,
      ``"tpu"``; None for JAX's default backend.

  Returns:
    A new dict of XLA options.

  Raises:
    TypeError: `program` is neither a traced program nor a jaxpr.
  """
  if _platform(platform) != "cuda":
    return {}
  if program is not None and not has_fp8_gemms(program):
    return {}
  return dict(FP8_COMPILER_OPTIONS)


def _platform(platform: Optional[str]) -> str:
  name = (jax.default_backend() if platform is None else platform).lower()
  if name != "gpu":
    return name
  try:
    jax.devices("cuda")
  except RuntimeError:
    return "rocm"
  return "cuda"


def has_fp8_gemms(program: Any) -> bool:
  """Whether a traced program (a `jax.stages.Traced` or a jaxpr) has a
  ``dot_general`` of FP8 operands, in any nested jaxpr."""
  jaxpr = getattr(program, "jaxpr", program)
  if isinstance(jaxpr, jex_core.ClosedJaxpr):
    jaxpr = jaxpr.jaxpr
  if not isinstance(jaxpr, jex_core.Jaxpr):
    raise TypeError(f"compiler_options takes a traced program "
                    f"(jax.jit(f).trace(...)) or a jaxpr, got {program!r}")
  todo = [jaxpr]
  while todo:
    for eqn in todo.pop().eqns:
      if eqn.primitive.name == "dot_general" and any(
          np.dtype(v.aval.dtype) in FP8_DTYPES for v in eqn.invars):
        return True
      for value in eqn.params.values():
        for sub in value if isinstance(value, (tuple, list)) else (value,):
          if isinstance(sub, jex_core.ClosedJaxpr):
            todo.append(sub.jaxpr)
          elif isinstance(sub, jex_core.Jaxpr):
            todo.append(sub)
  return False


def step_jit(fun, *, options: Optional[dict[str, Any]] = None, key=None,
             **jit_kwargs):
  """`jax.jit(fun, compiler_options=options, ...)`, compiled with
  `compiler_options()` under `options` (which win) when its traced program
  has FP8 GEMMs and compiles for CUDA, decided once per ``key(*args)``.

  Off CUDA it is that plain `jax.jit` (the options would be ``{}``). The
  returned function has ``lower(*args)`` and ``trace(*args)`` as a jitted
  function does.
  """
  plain = jax.jit(fun, compiler_options=options, **jit_kwargs)
  extra = compiler_options()
  if not extra:
    return plain
  fp8 = []  # The jitted step with `extra`, once a program needs it.
  decided = {}

  def pick(*args):
    k = None if key is None else key(*args)
    if k not in decided:
      # The trace is jax.jit's own, cached: a step without FP8 GEMMs is
      # not traced again when it runs.
      decided[k] = has_fp8_gemms(plain.trace(*args))
    if not decided[k]:
      return plain
    if not fp8:
      fp8.append(jax.jit(fun, compiler_options={**extra, **(options or {})},
                         **jit_kwargs))
    return fp8[0]

  @functools.wraps(fun)
  def run(*args):
    return pick(*args)(*args)

  run.lower = lambda *args: pick(*args).lower(*args)
  run.trace = lambda *args: pick(*args).trace(*args)
  return run
