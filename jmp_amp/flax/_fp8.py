"""The FP8 state of a Flax NNX model: converting modules, reading histories.

`convert` sets a module's matmul knob to a fresh FP8 op, `restore` puts the
original back; `histories` reads the amax histories of a converted model and
`value_and_grad` differentiates a loss and writes the new histories back.
`fp8_modules` says which matmul modules FP8 rules convert: those a rule
decides that have a matmul knob, except, with ``keep_first_last``, the
model's first and last in call order (`end_paths`: one abstract call with
``example_args``, or list indices) unless they are layers of a scanned
stack. `ordered_modules` lists a model's modules in path order, without FP8
ops. What users see is in `jmp_amp.flax.fp8`.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, TYPE_CHECKING
import warnings

from flax import nnx
from jax import lax
import jax.numpy as jnp

from jmp_amp._src import fp8 as fp8_lib
from jmp_amp.flax import _paths
from jmp_amp.flax._fp8_op import fp8_op
from jmp_amp.flax._fp8_op import FP8Meta
from jmp_amp.flax._fp8_op import FP8Op
from jmp_amp.flax._fp8_op import FP8Policy
from jmp_amp.flax._fp8_op import knob
from jmp_amp.flax._fp8_op import KNOBS
from jmp_amp.flax._fp8_op import stack_shape
from jmp_amp.flax._paths import path_str

if TYPE_CHECKING:
  from jmp_amp.flax import rules as rules_lib


def ops(model: nnx.Module) -> dict[str, FP8Op]:
  """The FP8 op (`FP8Op`) of each FP8 module, by '/'-joined path.
  """
  return {path_str(p): fp8_op(m) for p, m in ordered_modules(model)
          if fp8_op(m) is not None}


def histories(model: nnx.Module) -> dict[str, fp8_lib.FP8State]:
  """The amax histories of each FP8 module, by '/'-joined path.

  Its keys are the modules whose matmul runs in FP8; each value is a
  `jmp_amp.fp8.FP8State` of float32 arrays (newest first). For monitoring,
  also inside a jitted step.

  Example:
    >>> import jmp_amp.flax
    >>> from jmp_amp import models
    >>> model = models.MLP(8, 2, num_layers=3, width=16, rngs=nnx.Rngs(0))
    >>> _ = jmp_amp.flax.set_policies(model, {"*": "float8"})
    >>> h = jmp_amp.flax.fp8.histories(model)
    >>> list(h), h["layers/1"].lhs.shape   # layers/0 and 2: first and last
    (['layers/1'], (1,))
  """
  return {path: op.state() for path, op in ops(model).items()}


def write_histories(model: nnx.Module, grads: nnx.State) -> nnx.State:
  """Writes the `FP8Meta` "gradients" (the new histories) into `model`.

  Returns `grads` without the `FP8Meta` entries, for the optimizer.
  """
  new, rest = nnx.split_state(grads, FP8Meta, ...)
  nnx.update(model, new)
  return rest


def value_and_grad(loss_fn: Callable[..., Any], *, has_aux: bool = False,
                   wrt: Any = nnx.Param) -> Callable[..., Any]:
  """`nnx.value_and_grad` of ``loss_fn(model, *args)`` that updates FP8 state.

  The returned function differentiates with respect to `wrt` and the
  `FP8Meta` histories, writes the new histories into the model and returns
  ``(value, grads)`` with the `wrt` gradients only, for the optimizer. Call
  it inside `nnx.jit` (or a `jax.jit` over split state);
  `jmp_amp.flax.make_train_step` uses it.

  Example:
    >>> import jmp_amp.flax
    >>> from jmp_amp import models
    >>> model = jmp_amp.flax.set_policies(
    ...     models.MLP(8, 2, num_layers=3, width=16, rngs=nnx.Rngs(0)),
    ...     jmp_amp.flax.fp8.FP8Policy(jmp_amp.fp8.FP8Recipe(
    ...         scaling="delayed", history_len=4), keep_first_last=False))
    >>> opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    >>> @nnx.jit
    ... def step(model, opt, x, y):
    ...   grad_fn = jmp_amp.flax.fp8.value_and_grad(
    ...       lambda m: models.mse_loss(m(x), y))
    ...   loss, grads = grad_fn(model)
    ...   opt.update(model, grads)
    ...   return loss
    >>> loss = step(model, opt, jnp.ones((4, 8)), jnp.zeros((4, 2)))
    >>> float(jmp_amp.flax.fp8.histories(model)["layers/0"].lhs[0])
    1.0

  Args:
    loss_fn: ``loss_fn(model, *args, **kwargs)`` returning the loss, or
      ``(loss, aux)`` with `has_aux`.
    has_aux: as for `nnx.value_and_grad`.
    wrt: filter of the variables to differentiate (`nnx.Param`), as given
      to `nnx.Optimizer`.

  Returns:
    ``fn(model, *args, **kwargs) -> (value, grads)``.
  """
  if not callable(loss_fn):
    raise TypeError(f"loss_fn must be callable, got {loss_fn!r}")
  argnums = nnx.DiffState(0, nnx.Any(wrt, FP8Meta))
  grad_fn = nnx.value_and_grad(loss_fn, argnums=argnums, has_aux=has_aux)

  def fn(model: nnx.Module, *args, **kwargs):
    value, grads = grad_fn(model, *args, **kwargs)
    return value, write_histories(model, grads)

  return fn


# --------------------------------------------------------------------------
# Converting modules.


def convert(module: nnx.Module, recipe: fp8_lib.FP8Recipe,
            path: tuple = ()) -> None:
  """Sets `module`'s matmul knob to a fresh FP8 op and its dtype knob.

  `path`, the module's path in the model, names the op's scope.
  """
  name = knob(module)
  current = vars(module)[name]
  if isinstance(current, FP8Op):
    original, dtype = current.original, current.original_dtype
  else:
    original, dtype = current, getattr(module, "dtype", None)
  op = FP8Op(recipe, knob=name, original=original, original_dtype=dtype,
             name=path_str(path), stack_shape=stack_shape(module))
  setattr(module, name, nnx.data(op))
  if "dtype" in vars(module):
    setattr(module, "dtype", recipe.compute_dtype)


def restore(module: nnx.Module) -> None:
  """Puts back the knobs an FP8 op replaced (no-op without one)."""
  op = fp8_op(module)
  if op is None:
    return
  # nnx.static: the attribute became data when it held the FP8 module.
  setattr(module, op.knob, nnx.static(op.original))
  if "dtype" in vars(module):
    setattr(module, "dtype", op.original_dtype)

def fp8_modules(model: nnx.Module, ruleset: rules_lib.RuleSet,
                modules: list, resolved: dict,
                example_args: Optional[tuple]) -> set[tuple]:
  """Paths of the modules whose FP8 rule makes their matmul FP8.

  Checks, before anything changes, that no FP8 rule names a module that
  cannot run in FP8 and holds Params of its own (containers are fine: what
  they hold inherits the rule). Warns, saying why, if FP8 rules convert no
  module.
  """
  decided = [(p, m, resolved[p].policy) for p, m in modules
             if isinstance(resolved[p].policy, FP8Policy)]
  for path, module, _ in decided:
    if (resolved[path].source == "rule" and not knob(module)
        and _paths.own_params(module)):
      check_capable(path, module)
  capable = [(p, pol) for p, m, pol in decided if knob(m)]
  if any(pol.keep_first_last for _, pol in capable):
    ends = end_paths(model, example_args, {
        p for p, pol in capable if pol.keep_first_last})
  else:
    ends = set()
  # One module stands for every layer of a scanned stack: keeping it in
  # bfloat16 would keep all its layers, not the first or last. A first or
  # last matmul inside a stack runs in FP8 with its stack; the ends outside
  # stacks (a head, an input projection) stay kept.
  mods = dict(modules)
  ends = {p for p in ends if not stack_shape(mods[p])}
  chosen = {p for p, pol in capable if not (pol.keep_first_last and p in ends)}
  by_path = {p: m for p, m, _ in decided}
  for path, pol in capable:
    if (path in chosen and pol.recipe.scaling == "rowwise"
        and knob(by_path[path]) == "conv_general_dilated"):
      raise ValueError(
          f"rowwise FP8 scaling is for dot_general and einsum (nnx.Linear, "
          f"nnx.LinearGeneral, nnx.Einsum); module "
          f"{path_str(path)!r} is a convolution. Give it "
          f"'float8' (current scaling), or a non-FP8 policy.")
  if not chosen and any(isinstance(rule.policy, FP8Policy)
                        for rule in ruleset.all_rules):
    if not any(knob(m) for _, m in modules):
      why = ("it has no module with a matmul knob (nnx.Linear, "
             "nnx.LinearGeneral, nnx.Einsum, nnx.Conv)")
    elif not capable:
      why = ("the FP8 rules decide none of its matmul modules (other rules "
             "decide them)")
    else:
      paths = ", ".join(repr(path_str(p) or "<root>") for p, _ in capable)
      why = (f"the only matmul modules the FP8 rules decide ({paths}) are "
             "the model's first and last, which FP8 keeps in bfloat16 "
             "(keep_first_last); to convert them too, give them the rule "
             "value jmp_amp.flax.fp8.FP8Policy(keep_first_last=False)")
    warn_nothing_converted(type(model).__name__, why, stacklevel=3)
  return chosen


def warn_nothing_converted(what: str, why: str, stacklevel: int) -> None:
  """Warns that FP8 was asked for but no module of `what` runs in FP8."""
  warnings.warn(f"jmp_amp.flax: FP8 converted no layer of {what}: {why}.",
                UserWarning, stacklevel=stacklevel + 1)


def check_capable(path: tuple, module: nnx.Module) -> None:
  """Raises ValueError, naming the module, if FP8 cannot convert it."""
  if not knob(module):
    raise ValueError(
        f"FP8 cannot handle module {path_str(path) or '<root>'!r} of type "
        f"{type(module).__name__}: FP8 converts modules with a matmul knob "
        f"({', '.join(map(repr, KNOBS))}: nnx.Linear, nnx.LinearGeneral, "
        f"nnx.Einsum, nnx.Conv) and no '<knob>_cls' factory; embeddings, "
        f"norms and nnx.ConvTranspose stay in their policy's dtype. Exclude "
        f"it, narrow the selection, or give it a non-FP8 policy.")


def end_paths(model: nnx.Module, example_args: Optional[tuple],
              decided: Optional[set[tuple]] = None) -> set[tuple]:
  """Paths of the first and last modules with a matmul knob, in call order.

  The order is the one an abstract ``model(*example_args)`` calls them in.
  Without `example_args`, list indices are all that is known of it
  (``layers/0`` is called before ``layers/1``; attribute names say
  nothing): that is enough if it singles out the first and the last module,
  or if none of the modules that could be first or last is in `decided`
  (then they are all returned, excluding nothing that was asked for).

  Raises:
    ValueError: no `example_args`, and the modules of `decided` that keep
      their dtype depend on an order list indices do not decide.
  """
  candidates = [(p, m) for p, m in ordered_modules(model) if knob(m)]
  if example_args is not None:
    candidates = _call_order(model, candidates, tuple(example_args))
    return {p for p, _ in candidates[:1] + candidates[-1:]}
  paths = [p for p, _ in candidates]
  firsts = [p for p in paths if not any(_before(q, p) for q in paths)]
  lasts = [p for p in paths if not any(_before(p, q) for q in paths)]
  ends = set(firsts) | set(lasts)
  if len(firsts) <= 1 and len(lasts) <= 1:
    return ends
  if decided is not None and not ends & set(decided):
    return ends
  raise ValueError(
      f"FP8 rules keep a model's first and last matmul modules in bfloat16 "
      f"(keep_first_last), and which of {[path_str(p) for p in paths]} "
      f"those are depends on the order {type(model).__name__} calls them, "
      f"which its attribute names do not tell: pass example_args=(inputs...) "
      f"(arrays or jax.ShapeDtypeStruct) to jmp_amp.flax.set_policies, for "
      f"one abstract call that finds the order, or use the rule value "
      f"jmp_amp.flax.fp8.FP8Policy(keep_first_last=False) and choose the "
      f"modules with rules.")


def _before(a: tuple, b: tuple) -> bool:
  """Whether list indices put path `a` before path `b` (they first differ
  at a list index, smaller in `a`)."""
  n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
  return (n is not None and isinstance(a[n], int) and isinstance(b[n], int)
          and a[n] < b[n])


def _path_key(path: tuple) -> tuple:
  """Sort key: list indices numerically (layers/2 before layers/10)."""
  return tuple((0, k, "") if isinstance(k, int) else (1, 0, str(k))
               for k in path)


def ordered_modules(model: nnx.Module) -> list[tuple[tuple, nnx.Module]]:
  """(path, module) pairs of `nnx.iter_modules`, in path order.

  Path order, not attribute-assignment order: it is the same after
  `nnx.split`/`nnx.merge`, `nnx.eval_shape` or a restore.
  FP8 ops themselves are left out.
  """
  pairs = [(tuple(p), m) for p, m in nnx.iter_modules(model)
           if not isinstance(m, FP8Op)]
  return sorted(pairs, key=lambda pm: _path_key(pm[0]))


def _call_order(model: nnx.Module, candidates: list, example_args: tuple
                ) -> list:
  """`candidates` in the order an abstract ``model(*example_args)`` calls them.

  Each candidate's matmul knob is swapped, for the duration of one
  `nnx.eval_shape` pass, for a wrapper that records the module's path.
  Candidates the pass does not call go last, in path order.
  """
  calls: list[tuple] = []
  defaults = {"dot_general": lax.dot_general, "einsum_op": jnp.einsum,
              "conv_general_dilated": lax.conv_general_dilated}

  def recorder(path, original):
    def record(*args, **kwargs):
      if path not in calls:
        calls.append(path)
      return original(*args, **kwargs)
    return record

  saved = [(m, knob(m), vars(m)[knob(m)]) for _, m in candidates]
  try:
    for (path, module), (_, name, current) in zip(candidates, saved):
      if isinstance(current, FP8Op):
        current = current.original
      if current is None:
        current = defaults[name]
      setattr(module, name, nnx.static(recorder(path, current)))
    nnx.eval_shape(lambda m, *a: m(*a), model, *example_args)
  finally:
    for module, name, value in saved:
      setattr(module, name,
              nnx.data(value) if isinstance(value, FP8Op) else value)
  rank = {p: i for i, p in enumerate(calls)}
  return sorted(candidates, key=lambda pm: (rank.get(pm[0], len(rank)),
                                            _path_key(pm[0])))
