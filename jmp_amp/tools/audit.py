"""Matmul-dtype audit: which dtypes the dots and convolutions of a program see.

Mixed precision pays off only if the matmuls really run on half-precision
inputs, and a stray float32 operand silently promotes a dot (and, through
autodiff, its transposes). `matmul_report` stages a function (with `jax.jit`,
or `flax.nnx.jit` for NNX modules) and reads every dot_general / convolution
of the program with its dtypes, shapes and FLOPs into a `MatmulReport` (see
`jmp_amp.tools.report` for how the program is read and counted).
"""

from __future__ import annotations

import sys
from typing import Any, Optional, Sequence, Union

import jax

from jmp_amp.tools.report import MatmulReport
from jmp_amp.tools.report import report_from_hlo
from jmp_amp.tools.report import report_from_stablehlo

STAGES = ("lowered", "compiled")


def matmul_report(fn: Any, *args: Any, stage: str = "lowered",
                  static_argnums: Union[int, Sequence[int]] = (),
                  static_argnames: Union[str, Sequence[str]] = (),
                  **kwargs: Any) -> MatmulReport:
  """Lists the dots and convolutions of `fn(*args, **kwargs)` with their dtypes.

  Nothing is executed: `fn` is traced and lowered (and, for
  ``stage="compiled"``, compiled) with `jax.jit`, or with `flax.nnx.jit` when
  an argument is a Flax NNX module or other graph object.

  Example:
    >>> loss = lambda w, x: jnp.sum(jnp.tanh(x @ w) ** 2)
    >>> w, x = jnp.ones((4, 8), jnp.bfloat16), jnp.ones((3, 4), jnp.bfloat16)
    >>> report = jmp_amp.matmul_report(jax.grad(loss), w, x)
    >>> report.summary()["by_signature"]
    {'bf16 x bf16 -> bf16': 2}
    >>> [r.flops for r in report]
    [192, 192]

  Args:
    fn: a callable (a Flax NNX module too), an already-jitted function
      (anything with ``.lower``), a `jax.stages.Lowered` or a
      `jax.stages.Compiled` (then no arguments; a Compiled object is always
      read at the compiled stage).
    *args: positional arguments to lower `fn` with (arrays or
      `jax.ShapeDtypeStruct`).
    stage: "lowered" reads the StableHLO JAX emits, i.e. the dtypes the program
      asks for. "compiled" reads the HLO after XLA's optimizations, i.e. what
      the backend runs (XLA:CPU, for instance, upcasts bf16 dots to f32).
    static_argnums: passed to `jax.jit` / `nnx.jit` when this function jits
      `fn`.
    static_argnames: likewise.
    **kwargs: keyword arguments of `fn` (bind any named `stage`,
      `static_argnums` or `static_argnames` with `functools.partial`).

  Returns:
    A `MatmulReport`.

  Raises:
    TypeError: `fn` is not callable, or arguments were given with a Lowered /
      Compiled object.
    ValueError: `stage` is not one of "lowered", "compiled".
  """
  if stage not in STAGES:
    raise ValueError(
        f"stage must be one of {', '.join(map(repr, STAGES))}; got {stage!r}")
  staged = lower(fn, *args, static_argnums=static_argnums,
                 static_argnames=static_argnames, **kwargs)
  if isinstance(staged, jax.stages.Compiled):
    return report_from_hlo(staged.as_text())
  if stage == "compiled":
    return report_from_hlo(staged.compile().as_text())
  return report_from_stablehlo(staged.compiler_ir("stablehlo"))


def lower(fn: Any, *args: Any, static_argnums=(), static_argnames=(),
          jit_kwargs: Optional[dict[str, Any]] = None, **kwargs: Any):
  """`fn` lowered for `args` (a Compiled `fn` is returned as it is).

  `jit_kwargs` go to the `jax.jit` / `nnx.jit` this function applies.
  """
  staged = isinstance(fn, (jax.stages.Lowered, jax.stages.Compiled))
  if staged and (args or kwargs):
    raise TypeError(
        f"got arguments with an already {type(fn).__name__} object; pass the "
        "function instead, or no arguments")
  if staged:
    return fn
  if not callable(fn):
    text = repr(fn)
    raise TypeError(
        "fn must be a callable, a jitted function, a jax.stages.Lowered or a "
        f"jax.stages.Compiled; got {type(fn).__name__}: "
        f"{text if len(text) <= 80 else text[:77] + '...'}")
  if hasattr(fn, "lower"):
    if static_argnums not in ((), None) or static_argnames not in ((), None, ""):
      raise TypeError(
          "static_argnums/static_argnames only apply when fn is not jitted "
          "yet; give them to the jit that made this function instead")
    return fn.lower(*args, **kwargs)
  if _is_flax_graph_node(fn):
    # A module is state as well as code: pass it as an argument so that
    # nnx.jit tracks its variables instead of baking them in as constants.
    args, fn = (fn,) + args, _call_module
    if isinstance(static_argnums, int):
      static_argnums = (static_argnums,)
    static_argnums = tuple(i + 1 if i >= 0 else i for i in static_argnums or ())
  if _has_flax_graph_node(args, kwargs):
    from flax import nnx  # pylint: disable=g-import-not-at-top
    jit = nnx.jit
  else:
    jit = jax.jit
  return jit(fn, static_argnums=static_argnums, static_argnames=static_argnames,
             **(jit_kwargs or {})).lower(*args, **kwargs)


def _from_flax(x: Any) -> bool:
  # User models subclass flax classes from their own modules: check the MRO.
  # Nothing can come from flax before flax is imported.
  return "flax" in sys.modules and any(
      c.__module__.split(".")[0] == "flax" for c in type(x).__mro__)


def _is_flax_graph_node(x: Any) -> bool:
  # flax is imported only when a value comes from it, so that
  # `import jmp_amp` stays free of flax.
  if not _from_flax(x):
    return False
  from flax import nnx  # pylint: disable=g-import-not-at-top
  return nnx.graph.is_graph_node(x)


def _has_flax_graph_node(args: tuple, kwargs: dict) -> bool:
  leaves = jax.tree_util.tree_leaves((args, kwargs), is_leaf=_from_flax)
  return any(_is_flax_graph_node(x) for x in leaves)


def _call_module(module, *args, **kwargs):
  return module(*args, **kwargs)
