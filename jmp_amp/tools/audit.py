"""Matmul-dtype audit: which dtypes the dots and convolutions of a program see.

Mixed precision pays off only if the matmuls really run on half-precision
inputs, and a stray float32 operand silently promotes a dot (and, through
autodiff, its transposes). `matmul_report` stages a function (with `jax.jit`,
or `flax.nnx.jit` for NNX modules) and reads every dot_general / convolution
of the program with its dtypes, shapes and FLOPs into a `MatmulReport` (see
`jmp_amp.tools.report` for how the program is read and counted). Pytrees
with leaves jit cannot trace (an Equinox module's activation function) are
staged as `equinox.filter_jit` stages them: such leaves are static, closed
over, and the arrays are the program's arguments.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Optional, Sequence, Union

import jax
import numpy as np

from jmp_amp.tools.report import MatmulReport
from jmp_amp.tools.report import report_from_hlo
from jmp_amp.tools.report import report_from_stablehlo

STAGES = ("lowered", "compiled")
_NUMBERS = (bool, int, float, complex)


def matmul_report(fn: Any, *args: Any, stage: str = "lowered",
                  static_argnums: Union[int, Sequence[int]] = (),
                  static_argnames: Union[str, Sequence[str]] = (),
                  **kwargs: Any) -> MatmulReport:
  """Lists the dots and convolutions of `fn(*args, **kwargs)` with their dtypes.

  Nothing is executed: `fn` is traced and lowered (and, for
  ``stage="compiled"``, compiled) with `jax.jit`, or with `flax.nnx.jit` when
  an argument is a Flax NNX module or other graph object. Leaves of the
  arguments that are not arrays (an Equinox module's activation function,
  its flags and sizes) are static, as under `equinox.filter_jit`; numbers
  are traced, as by `jax.jit` (a train state's ``step``), except in a pytree
  that also holds such leaves. A callable pytree
  that holds arrays (an Equinox module) can be `fn` itself: its arrays are
  then arguments of the program, not constants.

  Example:
    >>> loss = lambda w, x: jnp.sum(jnp.tanh(x @ w) ** 2)
    >>> w, x = jnp.ones((4, 8), jnp.bfloat16), jnp.ones((3, 4), jnp.bfloat16)
    >>> report = jmp_amp.matmul_report(jax.grad(loss), w, x)
    >>> report.summary()["by_signature"]
    {'bf16 x bf16 -> bf16': 2}
    >>> [r.flops for r in report]
    [192, 192]

  Args:
    fn: a callable (a Flax NNX or Equinox module too), an already-jitted
      function (anything with ``.lower``: `jax.jit`'s, `equinox.filter_jit`'s),
      a `jax.stages.Lowered` or a `jax.stages.Compiled` (then no arguments; a
      Compiled object is always read at the compiled stage).
    *args: positional arguments to lower `fn` with: pytrees of arrays or
      `jax.ShapeDtypeStruct`, whose other leaves are static.
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
    TypeError: `fn` is not callable, arguments were given with a Lowered /
      Compiled object, or ``fn.lower`` gave no JAX stage.
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
    staged = fn.lower(*args, **kwargs)
    if not isinstance(staged, (jax.stages.Lowered, jax.stages.Compiled)):
      # `equinox.filter_jit`'s staged object holds JAX's as `.lowered`.
      staged = getattr(staged, "lowered", staged)
    if not isinstance(staged, (jax.stages.Lowered, jax.stages.Compiled)):
      raise TypeError(
          f"fn.lower(...) returned a {type(staged).__name__}, not a "
          "jax.stages.Lowered; pass the function before it was jitted")
    return staged
  if _is_module(fn):
    # A module is state as well as code: as an argument, jit traces its
    # arrays instead of baking them in as constants, and nnx.jit tracks its
    # variables.
    args, fn = (fn,) + args, _call_module
    static_argnums = _shifted(static_argnums)
    jit_kwargs = {k: _shifted(v) if k == "donate_argnums" else v
                  for k, v in (jit_kwargs or {}).items()}
  if _has_flax_graph_node(args, kwargs):
    from flax import nnx  # pylint: disable=g-import-not-at-top
    jit = nnx.jit
  else:
    jit = jax.jit
    fn, args, kwargs = _close_over_static(fn, args, kwargs, static_argnums,
                                          static_argnames)
  return jit(fn, static_argnums=static_argnums, static_argnames=static_argnames,
             **(jit_kwargs or {})).lower(*args, **kwargs)


def _is_module(fn: Any) -> bool:
  """A Flax NNX graph node, or a callable pytree holding arrays (an Equinox
  module)."""
  return _is_flax_graph_node(fn) or any(
      _is_array(x) for x in jax.tree_util.tree_leaves(fn))


def _shifted(argnums) -> tuple[int, ...]:
  """`argnums` once an argument is put before the others."""
  if isinstance(argnums, int):
    argnums = (argnums,)
  return tuple(i + 1 if i >= 0 else i for i in argnums or ())


def _is_array(x: Any) -> bool:
  """An array or an array spec: what `equinox.filter_jit` traces."""
  return (isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct))
          or hasattr(x, "__jax_array__"))


def _part(argument: Any, traced: bool) -> Any:
  """The traced (or the static) leaves of `argument`, None for the others.

  Numbers are traced, as by `jax.jit` (a train state's ``step``), except in
  a pytree that `jax.jit` could not take (an Equinox module holding its
  activation function): there a number is a flag or a size, static as under
  `equinox.filter_jit`.
  """
  if isinstance(argument, _NUMBERS):
    return argument if traced else None
  jittable = all(_is_array(x) or isinstance(x, _NUMBERS)
                 for x in jax.tree_util.tree_leaves(argument))
  dynamic = lambda x: _is_array(x) or (jittable and isinstance(x, _NUMBERS))
  return jax.tree_util.tree_map(
      lambda x: x if dynamic(x) == traced else None, argument)


def _close_over_static(fn, args: tuple, kwargs: dict, static_argnums,
                       static_argnames):
  """`fn`, `args`, `kwargs` with the static leaves of the arguments closed
  over (see `_part`).

  jit gets None in place of a static leaf and `fn` gets the leaf back, as
  with `equinox.partition` and `equinox.combine`; arguments named static
  stay as they are (jit hashes them). Leaves of the outputs that jit cannot
  return (a train step returns its module) are None in the program.
  """
  if isinstance(static_argnums, int):
    static_argnums = (static_argnums,)
  if isinstance(static_argnames, str):
    static_argnames = (static_argnames,)
  skip = {i % len(args) for i in static_argnums or ()} if args else set()
  split = ({i: a for i, a in enumerate(args) if i not in skip},
           {k: v for k, v in kwargs.items() if k not in (static_argnames or ())})
  static = tuple({k: _part(v, False) for k, v in part.items()} for part in split)
  positional, named = ({k: _part(v, True) for k, v in part.items()}
                       for part in split)

  @functools.wraps(fn)
  def with_static(*args, **kwargs):
    dynamic = ({i: args[i] for i in positional}, {k: kwargs[k] for k in named})
    positional_, named_ = jax.tree_util.tree_map(
        lambda d, s: s if d is None else d, dynamic, static,
        is_leaf=lambda x: x is None)
    args = [positional_.get(i, a) for i, a in enumerate(args)]
    return jax.tree_util.tree_map(
        lambda x: x if _is_array(x) or isinstance(x, _NUMBERS) else None,
        fn(*args, **{**kwargs, **named_}))

  return (with_static, tuple(positional.get(i, a) for i, a in enumerate(args)),
          {**kwargs, **named})


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
