"""What a checkpointed state looks like, and whether a restore target matches.

`describe` writes down what orbax's array checkpoint leaves out: every leaf's
path, shape and dtype, the loss scales' static hyper-parameters and the FP8
ops' recipes. `check_compatible` compares a target with that description and
names every difference; `check_loss_scales` refuses restored loss scales a run
cannot use. Restore runs both checks; none of these is public.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

import jmp_amp
from jmp_amp.checkpoint import _errors
from jmp_amp.checkpoint import _fp8
from jmp_amp.checkpoint import _nnx
from jmp_amp.checkpoint import _types

# /2 added per-array checksums, /3 the FP8 recipes, /4 the optimizer state's
# types; older ones still restore, checked for what they record.
FORMAT = "jmp_amp.checkpoint/4"
READABLE_FORMATS = ("jmp_amp.checkpoint/1", "jmp_amp.checkpoint/2",
                    "jmp_amp.checkpoint/3", FORMAT)
# DynamicLossScale's leaves when it flattens without keys.
_DYNAMIC_FIELDS = ("loss_scale", "counter", "overflows")
_LOSS_SCALE_TYPES = (jmp_amp.NoOpLossScale, jmp_amp.StaticLossScale,
                     jmp_amp.DynamicLossScale)
_DYNAMIC_HYPERPARAMETERS = ("period", "factor", "min_loss_scale",
                            "backoff_factor", "max_loss_scale", "hysteresis")
_PYTHON_SCALARS = (bool, int, float, complex)
_MAX_LISTED = 10


def is_python_scalar(x: Any) -> bool:
  return isinstance(x, _PYTHON_SCALARS)


def _leaf_spec(x: Any, name: str) -> dict[str, Any]:
  if isinstance(x, jax.ShapeDtypeStruct) or (
      hasattr(x, "dtype") and hasattr(x, "shape")):
    shape, dtype = tuple(x.shape), x.dtype
  elif is_python_scalar(x):
    shape, dtype = (), jnp.result_type(x)
  else:
    text = repr(x)
    raise TypeError(
        f"state leaf {name or '<root>'} is a {type(x).__name__} "
        f"({text[:60] + '...' if len(text) > 60 else text}); a checkpoint "
        "holds arrays, jax.ShapeDtypeStruct and Python numbers only")
  # str(), not np.dtype(): PRNG key arrays have extended dtypes.
  return {"shape": [int(d) for d in shape], "dtype": str(dtype)}


def _loss_scale_spec(ls: Any) -> dict[str, Any]:
  spec: dict[str, Any] = {"type": type(ls).__name__}
  if isinstance(ls, jmp_amp.StaticLossScale):
    spec["loss_scale"] = ls.loss_scale
  elif isinstance(ls, jmp_amp.DynamicLossScale):
    for name in _DYNAMIC_HYPERPARAMETERS:
      spec[name] = getattr(ls, name)
  return spec


def is_loss_scale(x: Any) -> bool:
  return isinstance(x, _LOSS_SCALE_TYPES)


def named_leaves(tree: Any) -> list[tuple[str, Any]]:
  """`(path, leaf)` in `jax.tree_util.tree_leaves` order; readable paths.

  A loss scale's leaves are named by field (``....loss_scale.counter``) even
  when its class flattens without keys.
  """
  out = []
  for path, x in jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=is_loss_scale)[0]:
    name = jax.tree_util.keystr(path)
    if not is_loss_scale(x):
      out.append((name, x))
      continue
    for sub, leaf in jax.tree_util.tree_flatten_with_path(x)[0]:
      if (isinstance(x, jmp_amp.DynamicLossScale) and len(sub) == 1
          and isinstance(sub[0], jax.tree_util.FlattenedIndexKey)
          and sub[0].key < len(_DYNAMIC_FIELDS)):
        out.append((f"{name}.{_DYNAMIC_FIELDS[sub[0].key]}", leaf))
      else:
        out.append((name + jax.tree_util.keystr(sub), leaf))
  return out


def describe(state: Any) -> dict[str, Any]:
  """The JSON-able description that `save` stores and `restore` checks.

  Args:
    state: a pytree of arrays (or `jax.ShapeDtypeStruct`s, Python numbers,
      NNX modules and optimizers).

  Returns:
    ``{"format", "leaves": {path: {"shape", "dtype"}}, "loss_scales": {path:
    {"type", hyper-parameters}}, "fp8_recipes": {path: recipe fields},
    "state_types": {path: optax state class name}}``, paths as
    `jax.tree_util.keystr` gives them.

  Example:
    >>> from jmp_amp.checkpoint import _compat
    >>> ls = jmp_amp.DynamicLossScale(2.0 ** 15, period=100)
    >>> desc = _compat.describe({"w": jnp.ones(3), "loss_scale": ls})
    >>> desc["leaves"]["['w']"]
    {'shape': [3], 'dtype': 'float32'}
    >>> desc["loss_scales"]["['loss_scale']"]["period"]
    100
  """
  leaves = {name: _leaf_spec(x, name)
            for name, x in named_leaves(_nnx.saveable(state))}
  # From `state` itself: nnx.state() keeps a loss scale's arrays but drops its
  # hyper-parameters, which an nnx.Optimizer still holds (and an NNX module
  # its FP8 recipes).
  scales = {}
  for path, x in jax.tree_util.tree_flatten_with_path(
      state, is_leaf=is_loss_scale)[0]:
    if is_loss_scale(x):
      scales[jax.tree_util.keystr(path)] = _loss_scale_spec(x)
  return {"format": FORMAT, "leaves": leaves, "loss_scales": scales,
          "fp8_recipes": _fp8.recipes(state),
          "state_types": _types.state_types(state)}


def listing(paths: list[str]) -> str:
  shown = ", ".join(paths[:_MAX_LISTED])
  more = len(paths) - _MAX_LISTED
  return shown + (f" (and {more} more)" if more > 0 else "")


def _fmt_spec(spec: dict[str, Any]) -> str:
  return f"{spec['dtype']}{list(spec['shape'])}"


def _fmt_fields(kind: str, spec: dict[str, Any]) -> str:
  args = ", ".join(f"{k}={v!r}" for k, v in spec.items() if k != "type")
  return f"{kind}({args})"


def _diff(saved: dict[str, Any], target: dict[str, Any]) -> str:
  return "; ".join(f"{k}: saved {saved.get(k)!r}, target {target.get(k)!r}"
                   for k in sorted(set(saved) | set(target))
                   if saved.get(k) != target.get(k))


def _leaf_problems(saved: dict[str, Any], target: dict[str, Any],
                   cast_dtypes: bool) -> list[str]:
  problems = []
  missing = [p for p in saved if p not in target]
  extra = [p for p in target if p not in saved]
  if missing or extra:
    msg = "tree structure differs:"
    if missing:
      msg += f"\n    in the checkpoint, not in the target: {listing(missing)}"
    if extra:
      msg += f"\n    in the target, not in the checkpoint: {listing(extra)}"
    problems.append(msg)
  common = [p for p in saved if p in target]
  shapes = [f"{p}: saved {_fmt_spec(saved[p])}, target {_fmt_spec(target[p])}"
            for p in common if saved[p]["shape"] != target[p]["shape"]]
  if shapes:
    problems.append("shape mismatch:\n    " + "\n    ".join(
        shapes[:_MAX_LISTED]))
  dtypes = [f"{p}: saved {saved[p]['dtype']}, target {target[p]['dtype']}"
            for p in common if saved[p]["dtype"] != target[p]["dtype"]
            and saved[p]["shape"] == target[p]["shape"]]
  if dtypes and not cast_dtypes:
    problems.append(
        "dtype mismatch (a different precision policy?):\n    "
        + "\n    ".join(dtypes[:_MAX_LISTED])
        + (f"\n    (and {len(dtypes) - _MAX_LISTED} more)"
           if len(dtypes) > _MAX_LISTED else "")
        + "\n  Restore into the saved dtypes and cast (e.g. "
        "policy.cast_to_param), or pass cast_dtypes=True.")
  return problems


def _loss_scale_problems(saved: dict[str, Any],
                         target: dict[str, Any]) -> list[str]:
  problems = []
  for path in sorted(set(saved) | set(target)):
    s, t = saved.get(path), target.get(path)
    where = path or "<root>"
    if s is None or t is None:
      side = "target" if s is None else "checkpoint"
      spec = t if s is None else s
      problems.append(f"loss scale {where} is only in the {side}: "
                      f"{_fmt_fields(spec['type'], spec)}")
    elif s["type"] != t["type"]:
      problems.append(f"loss scale {where}: saved "
                      f"{_fmt_fields(s['type'], s)}, target "
                      f"{_fmt_fields(t['type'], t)}")
    elif s != t:
      problems.append(f"loss scale hyper-parameters differ at {where} "
                      f"({_diff(s, t)}); saved {_fmt_fields(s['type'], s)}")
  return problems


def _fp8_recipe_problems(saved: dict[str, Any],
                         target: dict[str, Any]) -> list[str]:
  # Only where both sides have an FP8 op: an op on one side only has
  # histories on one side only, which the tree structure check names (and a
  # checkpoint of a bare `nnx.state` holds no recipes to compare).
  by_diff: dict[str, list[str]] = {}
  for path in sorted(set(saved) & set(target)):
    if saved[path] != target[path]:
      by_diff.setdefault(_diff(saved[path], target[path]), []).append(path)
  return [f"FP8 recipes differ at {listing(paths)} ({diff}); saved "
          f"{_fmt_fields('FP8Recipe', saved[paths[0]])}"
          for diff, paths in by_diff.items()]


def check_compatible(saved: dict[str, Any], target: Any, *,
                     cast_dtypes: bool = False) -> None:
  """Raises `CheckpointError` ("mismatch") if `target` differs from `saved`.

  Args:
    saved: the description stored with a checkpoint (see `describe`).
    target: the tree to restore into.
    cast_dtypes: accept dtype differences (orbax then casts, e.g. to resume
      float32 params under a bfloat16 policy on purpose).
  """
  want = describe(target)
  # Checkpoints before /4 did not record the types: nothing to compare.
  problems = (
      _types.problems(saved.get("state_types", want["state_types"]),
                      want["state_types"])
      + _leaf_problems(saved["leaves"], want["leaves"], cast_dtypes)
      + _loss_scale_problems(saved.get("loss_scales", {}),
                             want["loss_scales"])
      + _fp8_recipe_problems(saved.get("fp8_recipes", {}),
                             want["fp8_recipes"]))
  if problems:
    raise _errors.mismatch(
        "checkpoint does not match the restore target:\n  - "
        + "\n  - ".join(problems), saved.get("step"))


def check_step(saved: dict[str, Any], step: int, directory: Any) -> None:
  """Raises `CheckpointError` ("mismatch") if the step directory `step` holds
  a state saved as another step (a renamed or copied directory): resumed
  under the directory's step, a run's schedule and data order would be off.
  """
  recorded = saved.get("step")
  if recorded is None or recorded == step:
    return
  raise _errors.mismatch(
      f"checkpoint step {step} in {directory} holds the state saved as step "
      f"{recorded} (its directory was renamed or copied?): resumed as step "
      f"{step}, the learning-rate schedule and data order would be "
      f"{abs(step - recorded)} steps off. Rename the directory back to "
      f"{recorded}, or restore another step.", step)


def _loss_scale_problem(x: Any) -> Optional[str]:
  """Why a restored loss scale cannot be used, or None."""
  if (not isinstance(x, jmp_amp.DynamicLossScale)
      or isinstance(x.loss_scale, jax.ShapeDtypeStruct)):
    return None  # No-op and static scales have no array leaves.
  scale = _nnx.host_value(_nnx.value(x.loss_scale))
  if scale.shape != () or not (jnp.issubdtype(scale.dtype, jnp.floating) or
                               jnp.issubdtype(scale.dtype, jnp.integer)):
    return (f"loss_scale is {scale.dtype}{list(scale.shape)}, not a real "
            "scalar")
  if not (np.isfinite(scale) and scale > 0):
    return (f"loss_scale is {scale.item()!r}; it must be a finite number > 0 "
            "(a run whose scale went non-finite was saved?)")
  for field in ("counter", "overflows"):
    v = getattr(x, field, None)
    value = None if v is None else _nnx.host_value(_nnx.value(v))
    if value is not None and np.any(value < 0):
      return f"{field} is {value!r}; it must be >= 0"
  return None


def check_loss_scales(tree: Any) -> None:
  """Raises `CheckpointError` ("corrupted") if a loss scale in `tree` is
  unusable.

  A dynamic loss scale must be a finite float scalar > 0 with non-negative
  counters; a NaN or infinite scale would skip every step of the resumed run.
  Restore calls this on what it read.
  """
  for path, x in jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=is_loss_scale)[0]:
    problem = _loss_scale_problem(x) if is_loss_scale(x) else None
    if problem:
      name = jax.tree_util.keystr(path) or "<root>"
      raise _errors.corrupted(f"loss scale {name}: {problem}", where=name)
