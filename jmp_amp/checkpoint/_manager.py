"""Checkpoint and resume mixed-precision training state with orbax.

A thin layer over `orbax.checkpoint` (no pickle): orbax writes the arrays,
sharded or not; this module adds what a resumed mixed-precision run needs to
be *the same run*, and refuses anything else:

* the loss scales' static hyper-parameters (``period``, ``factor``, ...), which
  are pytree aux data and so not in orbax's array checkpoint, are saved as JSON
  next to the arrays, with a CRC-32 checksum of every array's bytes;
* restore checks the target against what was saved -- tree structure, shapes,
  dtypes and loss-scale hyper-parameters -- and raises `CheckpointMismatchError`
  naming every mismatch. Orbax alone would silently cast float32 params into
  a bfloat16 target, or restore a scale into a loss scale with a new period;
* restore verifies every array against its checksum and the restored loss
  scales (finite, > 0); damaged files raise `CheckpointCorruptedError` naming
  the step and the array or file, never changed values. `restore_latest` can
  fall back to the newest intact step;
* saving over an existing step, or below the latest one, raises
  `CheckpointExistsError` unless ``overwrite=True``.

Example (a checkpoint in a temporary directory):
  >>> import tempfile
  >>> from jmp_amp import checkpoint
  >>> opt = jmp_amp.loss_scaling(optax.sgd(0.1),
  ...                            jmp_amp.DynamicLossScale(2.0 ** 15))
  >>> params = {"w": jnp.ones(3)}
  >>> state = {"params": params, "opt_state": opt.init(params)}
  >>> run_dir = tempfile.mkdtemp()
  >>> checkpoint.save(run_dir, state, step=100)
  >>> state, step = checkpoint.restore_latest(run_dir, target=state)
  >>> step
  100

or, to keep the last few checkpoints of a run::

  with checkpoint.CheckpointManager(run_dir, max_to_keep=3) as mngr:
    mngr.save(step, state)
    state = mngr.restore(state, fallback=True)  # mngr.restored_step says which

`target` is a tree like the saved one: a freshly initialised state, or an
abstract one (`jax.ShapeDtypeStruct` leaves, e.g. from `jax.eval_shape`);
restored arrays take the target leaves' shardings. Flax NNX modules and
`nnx.Optimizer`s may appear in the tree as they are: their `nnx.state` is
saved, and restore updates the target's objects in place (and checks the
optimizer's loss-scale hyper-parameters, which `nnx.state` alone drops).

Not imported by `import jmp_amp`; needs ``pip install orbax-checkpoint``.
"""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Any, Callable, Optional, Union
import warnings
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from jmp_amp._src import loss_scale as ls_lib

PathLike = Union[str, os.PathLike]

_STATE = "state"
_META = "jmp_amp"
# /2 adds per-array checksums; /1 checkpoints (without them) still restore.
_FORMAT = "jmp_amp.checkpoint/2"
_READABLE_FORMATS = ("jmp_amp.checkpoint/1", _FORMAT)
# CRC-32 is made for accidental damage: it catches every burst of up to 32
# flipped bits (so any 4 damaged bytes), runs ~3x faster than blake2b here,
# and is in the standard library. It is no defence against tampering.
_CHECKSUM = "crc32"
# DynamicLossScale's leaves when it flattens without keys.
_DYNAMIC_FIELDS = ("loss_scale", "counter", "overflows")
# orbax's JSON metadata files, checked to name the damaged one in errors.
_JSON_FILES = ("_METADATA", "_CHECKPOINT_METADATA", "_sharding", "metadata")
_LOSS_SCALE_TYPES = (ls_lib.NoOpLossScale, ls_lib.StaticLossScale,
                     ls_lib.DynamicLossScale)
_MAX_LISTED = 10


class CheckpointMismatchError(ValueError):
  """The restore target does not match the checkpoint."""


class CheckpointExistsError(ValueError, FileExistsError):
  """A save would replace an existing step, or go back before the latest one.

  Attributes:
    step: the step that was to be saved.
    existing: the saved steps at or after `step`.
  """

  def __init__(self, message: str, step: int, existing: list[int]):
    super().__init__(message)
    self.step = step
    self.existing = existing


class CheckpointCorruptedError(ValueError):
  """A checkpoint's files are damaged, incomplete or hold an invalid state.

  Attributes:
    step: the checkpoint step.
    where: the array path (as `jax.tree_util.keystr` writes it) or the file,
      relative to the step directory, that is damaged; None if unknown.
  """

  def __init__(self, message: str, step: Optional[int] = None,
               where: Optional[str] = None):
    super().__init__(message)
    self.step = step
    self.where = where


class InvalidLossScaleError(CheckpointCorruptedError):
  """A restored loss scale is not finite and > 0 (or its counters < 0)."""


class CheckpointFallbackWarning(UserWarning):
  """`restore(..., fallback=True)` skipped damaged steps."""


# --------------------------------------------------------------------------
# What a state looks like: leaves and loss-scale hyper-parameters.


def _leaf_spec(x: Any, name: str) -> dict[str, Any]:
  if isinstance(x, jax.ShapeDtypeStruct) or (
      hasattr(x, "dtype") and hasattr(x, "shape")):
    shape, dtype = tuple(x.shape), x.dtype
  elif isinstance(x, (bool, int, float, complex)):
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
  if isinstance(ls, ls_lib.StaticLossScale):
    spec["loss_scale"] = ls.loss_scale
  elif isinstance(ls, ls_lib.DynamicLossScale):
    for name in ("period", "factor", "min_loss_scale", "backoff_factor",
                 "max_loss_scale", "hysteresis"):
      spec[name] = getattr(ls, name)
  return spec


def _is_ls(x: Any) -> bool:
  return isinstance(x, _LOSS_SCALE_TYPES)


def _named_leaves(tree: Any) -> list[tuple[str, Any]]:
  """`(path, leaf)` in `jax.tree_util.tree_leaves` order; readable paths.

  A loss scale's leaves are named by field (``....loss_scale.counter``) even
  when its class flattens without keys.
  """
  out = []
  for path, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_ls)[0]:
    name = jax.tree_util.keystr(path)
    if not _is_ls(x):
      out.append((name, x))
      continue
    for sub, leaf in jax.tree_util.tree_flatten_with_path(x)[0]:
      if (isinstance(x, ls_lib.DynamicLossScale) and len(sub) == 1
          and isinstance(sub[0], jax.tree_util.FlattenedIndexKey)
          and sub[0].key < len(_DYNAMIC_FIELDS)):
        out.append((f"{name}.{_DYNAMIC_FIELDS[sub[0].key]}", leaf))
      else:
        out.append((name + jax.tree_util.keystr(sub), leaf))
  return out


def describe(state: Any) -> dict[str, Any]:
  """The JSON-able description that `save` stores and `restore` checks.

  Args:
    state: a pytree of arrays (or `jax.ShapeDtypeStruct`s).

  Returns:
    ``{"leaves": {path: {"shape", "dtype"}}, "loss_scales": {path: {"type",
    hyper-parameters}}}``, paths as `jax.tree_util.keystr` gives them.
  """
  leaves = {name: _leaf_spec(x, name)
            for name, x in _named_leaves(_saveable(state))}
  # From `state` itself: nnx.state() keeps a loss scale's arrays but drops its
  # hyper-parameters, which an nnx.Optimizer still holds.
  scales = {}
  for path, x in jax.tree_util.tree_flatten_with_path(state, is_leaf=_is_ls)[0]:
    if _is_ls(x):
      scales[jax.tree_util.keystr(path)] = _loss_scale_spec(x)
  return {"format": _FORMAT, "leaves": leaves, "loss_scales": scales}


def _checksum(x: Any) -> Optional[str]:
  """CRC-32 of an array's bytes (C order), or None where none is taken.

  None for abstract leaves, Python scalars and arrays this process cannot
  read whole (multi-process sharding).
  """
  if isinstance(x, jax.Array):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      x = jax.random.key_data(x)
    if not x.is_fully_addressable:
      return None
  elif not isinstance(x, (np.ndarray, np.generic)):
    return None
  data = np.ascontiguousarray(np.asarray(x)).reshape(-1).view(np.uint8)
  return f"{zlib.crc32(data):08x}"


def _listing(paths: list[str]) -> str:
  shown = ", ".join(paths[:_MAX_LISTED])
  more = len(paths) - _MAX_LISTED
  return shown + (f" (and {more} more)" if more > 0 else "")


def _fmt_spec(spec: dict[str, Any]) -> str:
  return f"{spec['dtype']}{list(spec['shape'])}"


def _fmt_scale(spec: dict[str, Any]) -> str:
  args = ", ".join(f"{k}={v!r}" for k, v in spec.items() if k != "type")
  return f"{spec['type']}({args})"


def check_compatible(saved: dict[str, Any], target: Any, *,
                     cast_dtypes: bool = False) -> None:
  """Raises `CheckpointMismatchError` if `target` differs from `saved`.

  Args:
    saved: the description stored with a checkpoint (see `describe`).
    target: the tree to restore into.
    cast_dtypes: accept dtype differences (orbax then casts, e.g. to resume
      float32 params under a bfloat16 policy on purpose).
  """
  want = describe(target)
  problems = []
  saved_leaves, target_leaves = saved["leaves"], want["leaves"]
  missing = [p for p in saved_leaves if p not in target_leaves]
  extra = [p for p in target_leaves if p not in saved_leaves]
  if missing or extra:
    msg = "tree structure differs:"
    if missing:
      msg += f"\n    in the checkpoint, not in the target: {_listing(missing)}"
    if extra:
      msg += f"\n    in the target, not in the checkpoint: {_listing(extra)}"
    problems.append(msg)
  common = [p for p in saved_leaves if p in target_leaves]
  shapes = [f"{p}: saved {_fmt_spec(saved_leaves[p])}, target "
            f"{_fmt_spec(target_leaves[p])}" for p in common
            if saved_leaves[p]["shape"] != target_leaves[p]["shape"]]
  if shapes:
    problems.append("shape mismatch:\n    " + "\n    ".join(
        shapes[:_MAX_LISTED]))
  if not cast_dtypes:
    dtypes = [f"{p}: saved {saved_leaves[p]['dtype']}, target "
              f"{target_leaves[p]['dtype']}" for p in common
              if saved_leaves[p]["dtype"] != target_leaves[p]["dtype"]
              and saved_leaves[p]["shape"] == target_leaves[p]["shape"]]
    if dtypes:
      problems.append(
          "dtype mismatch (a different precision policy?):\n    "
          + "\n    ".join(dtypes[:_MAX_LISTED])
          + (f"\n    (and {len(dtypes) - _MAX_LISTED} more)"
             if len(dtypes) > _MAX_LISTED else "")
          + "\n  Restore into the saved dtypes and cast (e.g. "
          "policy.cast_to_param), or pass cast_dtypes=True.")

  saved_scales, target_scales = saved.get("loss_scales", {}), want[
      "loss_scales"]
  for path in sorted(set(saved_scales) | set(target_scales)):
    s, t = saved_scales.get(path), target_scales.get(path)
    if s is None or t is None:
      where = "target" if s is None else "checkpoint"
      problems.append(f"loss scale {path or '<root>'} is only in the {where}: "
                      f"{_fmt_scale(t if s is None else s)}")
    elif s["type"] != t["type"]:
      problems.append(f"loss scale {path or '<root>'}: saved {_fmt_scale(s)}, "
                      f"target {_fmt_scale(t)}")
    elif s != t:
      diff = [f"{k}: saved {s.get(k)!r}, target {t.get(k)!r}"
              for k in sorted(set(s) | set(t)) if s.get(k) != t.get(k)]
      problems.append(f"loss scale hyper-parameters differ at "
                      f"{path or '<root>'} ({'; '.join(diff)}); saved "
                      f"{_fmt_scale(s)}")
  if problems:
    raise CheckpointMismatchError(
        "checkpoint does not match the restore target:\n  - "
        + "\n  - ".join(problems))


# --------------------------------------------------------------------------
# Save / restore.


_NOTHING = object()  # no `restored` tree given


def _map_nnx_objects(fn: Callable[..., Any], tree: Any,
                     restored: Any = _NOTHING) -> Any:
  """Applies ``fn(nnx, obj[, restored_part])`` to the NNX objects in `tree`.

  Other leaves are kept (or, given `restored`, taken from it). Only if the
  caller uses Flax already: this module must not import it.
  """
  nnx = sys.modules.get("flax.nnx")
  pytree_type = getattr(nnx, "Pytree", None) if nnx is not None else None
  if pytree_type is None:
    return tree if restored is _NOTHING else restored
  is_obj = lambda x: isinstance(x, pytree_type)
  if restored is _NOTHING:
    return jax.tree_util.tree_map(
        lambda x: fn(nnx, x) if is_obj(x) else x, tree, is_leaf=is_obj)
  return jax.tree_util.tree_map(
      lambda t, r: fn(nnx, t, r) if is_obj(t) else r, tree, restored,
      is_leaf=is_obj)


def _saveable(tree: Any) -> Any:
  """`tree` with NNX modules/optimizers replaced by their `nnx.state`."""
  return _map_nnx_objects(lambda nnx, obj: nnx.state(obj), tree)


def _update_nnx_objects(target: Any, restored: Any) -> Any:
  """Writes restored states into the target's NNX objects, in place."""
  def put(nnx, obj, state):
    nnx.update(obj, state)
    return obj
  return _map_nnx_objects(put, target, restored)


def _nnx_copies(target: Any, restored: Any) -> Any:
  """`restored` with NNX states merged into new objects (the target's
  untouched), where the loss scales can be found and checked."""
  return _map_nnx_objects(
      lambda nnx, obj, state: nnx.merge(nnx.split(obj)[0], state), target,
      restored)


def _abstract(target: Any, saved_leaves: Optional[dict[str, Any]]) -> Any:
  """Orbax's restore target: the target's shapes and shardings, and the
  *saved* dtypes (so that checksums are verified before any cast)."""
  leaves, treedef = jax.tree_util.tree_flatten(target)
  names = [name for name, _ in _named_leaves(target)]

  def leaf(name, x):
    if not isinstance(x, jax.ShapeDtypeStruct):
      x = ocp.utils.to_shape_dtype_struct(x)
    if x.sharding is None:
      # Orbax needs a sharding to place the restored array; the default
      # device is what an unsharded run would use.
      x = x.update(sharding=jax.sharding.SingleDeviceSharding(
          jax.devices()[0]))
    saved = (saved_leaves or {}).get(name)
    if saved is not None and saved["dtype"] != str(x.dtype):
      try:
        x = x.update(dtype=jnp.dtype(saved["dtype"]))
      except TypeError:  # an extended dtype (PRNG keys): keep the target's
        pass
    return x
  return jax.tree_util.tree_unflatten(
      treedef, [leaf(n, x) for n, x in zip(names, leaves)])


def _cast_like(restored: Any, target: Any) -> Any:
  def cast(r, t):
    dtype = t.dtype if hasattr(t, "dtype") else jnp.result_type(t)
    return r if r.dtype == dtype else r.astype(dtype)
  return jax.tree_util.tree_map(cast, restored, target)


def _value(x: Any) -> np.ndarray:
  # NNX objects hold arrays in Variables.
  get_value = getattr(x, "get_value", None)
  return np.asarray(get_value() if callable(get_value) else x)


def _loss_scale_problem(x: Any) -> Optional[str]:
  """Why a restored loss scale cannot be used, or None."""
  if (not isinstance(x, ls_lib.DynamicLossScale)
      or isinstance(x.loss_scale, jax.ShapeDtypeStruct)):
    return None  # No-op and static scales have no array leaves.
  scale = _value(x.loss_scale)
  if scale.shape != () or not (jnp.issubdtype(scale.dtype, jnp.floating) or
                               jnp.issubdtype(scale.dtype, jnp.integer)):
    return (f"loss_scale is {scale.dtype}{list(scale.shape)}, not a real "
            "scalar")
  if not (np.isfinite(scale) and scale > 0):
    return (f"loss_scale is {scale.item()!r}; it must be a finite number > 0 "
            "(a run whose scale went non-finite was saved?)")
  for field in ("counter", "overflows"):
    v = getattr(x, field, None)
    if v is not None and np.any(_value(v) < 0):
      return f"{field} is {_value(v)!r}; it must be >= 0"
  return None


def check_loss_scales(tree: Any) -> None:
  """Raises `InvalidLossScaleError` if a loss scale in `tree` is unusable.

  A dynamic loss scale must be a finite float scalar > 0 with non-negative
  counters; a NaN or infinite scale would skip every step of the resumed run.
  Restore calls this on what it read.
  """
  for path, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_ls)[0]:
    problem = _loss_scale_problem(x) if _is_ls(x) else None
    if problem:
      name = jax.tree_util.keystr(path) or "<root>"
      raise InvalidLossScaleError(f"loss scale {name}: {problem}", where=name)


def _orbax_paths(tree: Any) -> set[tuple[str, ...]]:
  """Leaf paths as orbax stores them: every key as a string."""
  def part(k):
    for attr in ("key", "idx", "name"):
      if hasattr(k, attr):
        return str(getattr(k, attr))
    return str(k)
  return {tuple(part(k) for k in path)
          for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _check_bool(value: Any, name: str) -> bool:
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name} must be True or False, got "
                    f"{type(value).__name__}: {value!r}")
  return bool(value)


def _check_directory(directory: Any) -> str:
  if not isinstance(directory, (str, os.PathLike)):
    raise TypeError(f"directory must be a str or os.PathLike path, got "
                    f"{type(directory).__name__}: {directory!r}")
  return os.path.abspath(os.fspath(directory))


def _first_line(e: BaseException, limit: int = 200) -> str:
  text = (str(e).strip().splitlines() or [""])[0]
  return text if len(text) <= limit else text[:limit] + " ..."


def _unreadable_json(step_dir: str) -> Optional[str]:
  """The first of orbax's JSON metadata files under `step_dir` that does not
  parse (relative path), or None."""
  for root, _, files in sorted(os.walk(step_dir)):
    for name in sorted(files):
      if name in _JSON_FILES or os.path.basename(root) == "array_metadatas":
        path = os.path.join(root, name)
        try:
          with open(path, "rb") as f:
            json.loads(f.read().decode("utf-8"))
        except (ValueError, OSError):
          return os.path.relpath(path, step_dir)
  return None


def _metadata_problem(meta: Any) -> Optional[str]:
  """What is wrong with a metadata JSON read back (bytes flipped in a way
  that still parses), or None."""
  if not isinstance(meta, dict):
    return f"expected a JSON object, got {type(meta).__name__}"
  if meta.get("format") not in _READABLE_FORMATS:
    return f"unknown format {meta.get('format')!r}"
  leaves, scales = meta.get("leaves"), meta.get("loss_scales")
  if not isinstance(leaves, dict) or not isinstance(scales, dict):
    return "no 'leaves' / 'loss_scales' tables"
  for name, spec in leaves.items():
    if not (isinstance(spec, dict) and isinstance(spec.get("dtype"), str)
            and isinstance(spec.get("shape"), list)
            and all(isinstance(d, int) and d >= 0 for d in spec["shape"])):
      return f"bad leaf entry {name}: {spec!r}"
  for name, spec in scales.items():
    if not (isinstance(spec, dict) and isinstance(spec.get("type"), str)):
      return f"bad loss scale entry {name}: {spec!r}"
  sums = meta.get("checksums")
  if sums is not None and not (
      isinstance(sums, dict) and isinstance(sums.get("arrays"), dict)
      and all(isinstance(v, str) for v in sums["arrays"].values())):
    return "bad 'checksums' table"
  if meta["format"] == _FORMAT and sums is None:
    return "no 'checksums' table"
  return None


class CheckpointManager:
  """`ocp.CheckpointManager` that saves and checks loss-scale metadata.

  Args:
    directory: where step directories are written (created if missing).
    max_to_keep: keep only the newest this many checkpoints (None: all).
    save_interval_steps: `save` writes only on multiples of this.
    async_save: let `save` return while files are written in the background
      (the arrays are copied off the device first, so donating them to the
      next train step is safe); `wait_until_finished` blocks.

  Attributes:
    restored_step: the step the last successful `restore` read (None before).
  """

  def __init__(self, directory: PathLike, *, max_to_keep: Optional[int] = None,
               save_interval_steps: int = 1, async_save: bool = False):
    directory = _check_directory(directory)
    if os.path.exists(directory) and not os.path.isdir(directory):
      raise NotADirectoryError(
          f"checkpoint directory {directory!r} exists and is not a directory")
    if max_to_keep is not None and (
        isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int)
        or max_to_keep < 1):
      raise ValueError(f"max_to_keep must be an integer >= 1 or None, got "
                       f"{max_to_keep!r}")
    if (isinstance(save_interval_steps, bool)
        or not isinstance(save_interval_steps, int) or save_interval_steps < 1):
      raise ValueError(f"save_interval_steps must be an integer >= 1, got "
                       f"{save_interval_steps!r}")
    _check_bool(async_save, "async_save")
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, save_interval_steps=save_interval_steps,
        create=True, enable_async_checkpointing=async_save)
    # Registered up front so that `item_metadata` can read plain orbax
    # checkpoints too (verify=False).
    self._manager = ocp.CheckpointManager(
        directory, options=options, item_handlers={
            _STATE: ocp.StandardCheckpointHandler(),
            _META: ocp.JsonCheckpointHandler()})
    self.restored_step: Optional[int] = None

  @property
  def directory(self):
    return self._manager.directory

  def _step_dir(self, step: int) -> str:
    return os.path.join(os.fspath(self.directory), str(step))

  def save(self, step: int, state: Any, *, overwrite: bool = False,
           force: bool = False) -> bool:
    """Saves `state` as checkpoint `step`.

    Args:
      step: an integer >= 0, after every step saved so far.
      state: the pytree to save.
      overwrite: if `step` or later steps exist (a rerun into an old
        directory), delete them and write this one, so that the directory
        then ends at `step`. Without it, that raises `CheckpointExistsError`.
      force: save even if `save_interval_steps` would skip this step.

    Returns:
      Whether the checkpoint was written (False only when
      `save_interval_steps` skips `step`).

    Raises:
      CheckpointExistsError: `step` exists, or is below the latest step.
    """
    step = _check_step(step)
    overwrite = _check_bool(overwrite, "overwrite")
    force = _check_bool(force, "force")
    saveable = _saveable(state)
    meta = describe(state)
    if not meta["leaves"]:
      raise ValueError(f"state has no arrays to save, got "
                       f"{type(state).__name__}: {state!r:.80}")
    meta["step"] = step
    sums = {name: _checksum(x) for name, x in _named_leaves(saveable)}
    meta["checksums"] = {"algorithm": _CHECKSUM, "arrays": {
        k: v for k, v in sums.items() if v is not None}}
    # An async save in flight has no step directory yet; orbax waits here
    # before its next save anyway.
    self._manager.wait_until_finished()
    existing = [s for s in self.all_steps() if s >= step]
    if existing and not overwrite:
      what = (f"step {step} already exists" if step in existing else
              f"step {step} is below the latest step {max(existing)}")
      raise CheckpointExistsError(
          f"cannot save checkpoint step {step} in {self.directory}: {what}. "
          f"Pass overwrite=True to delete steps {existing} and write step "
          f"{step}, or save to a new directory.", step, existing)
    for s in existing:
      self._manager.delete(s)
    return self._manager.save(
        step, args=ocp.args.Composite(**{
            _STATE: ocp.args.StandardSave(saveable),
            _META: ocp.args.JsonSave(meta)}), force=force)

  def _corrupted(self, step: int, error: BaseException,
                 where: Optional[str] = None) -> CheckpointCorruptedError:
    step_dir = self._step_dir(step)
    if where is None:
      # tensorstore names the step's directory and then the file it read.
      found = re.findall(re.escape(step_dir + os.sep) + r"[^\s\"']+",
                         str(error))
      if found:
        where = os.path.relpath(max(found, key=len), step_dir)
      else:
        where = _unreadable_json(step_dir)
    where_text = f", file {where}" if where else ""
    return CheckpointCorruptedError(
        f"checkpoint step {step} in {self.directory} is damaged or incomplete"
        f"{where_text}: {type(error).__name__}: {_first_line(error)}",
        step=step, where=where)

  def metadata(self, step: Optional[int] = None) -> dict[str, Any]:
    """The description saved with checkpoint `step` (default: latest).

    Raises:
      CheckpointCorruptedError: the metadata is missing or unreadable.
    """
    step = self._resolve_step(step)
    if not os.path.isdir(os.path.join(self._step_dir(step), _META)):
      raise CheckpointCorruptedError(
          f"checkpoint step {step} in {self.directory} has no jmp_amp "
          "metadata: it is damaged, or was not written by "
          "jmp_amp.checkpoint. A plain orbax checkpoint (e.g. from a jmp run) "
          "restores with verify=False, without checks.", step=step,
          where=_META)
    try:
      restored = self._manager.restore(
          step, args=ocp.args.Composite(**{_META: ocp.args.JsonRestore()}))
      meta = restored[_META]
    except Exception as e:  # pylint: disable=broad-except
      raise self._corrupted(step, e) from e
    problem = _metadata_problem(meta)
    if problem:
      raise CheckpointCorruptedError(
          f"checkpoint step {step} in {self.directory}: damaged metadata "
          f"(file {_META}/metadata): {problem}", step=step,
          where=f"{_META}/metadata")
    return meta

  def restore(self, target: Any, step: Optional[int] = None, *,
              cast_dtypes: bool = False, fallback: bool = False,
              verify: bool = True) -> Any:
    """Restores checkpoint `step` (default: latest) into the shape of `target`.

    Args:
      target: a tree like the saved one (arrays or `jax.ShapeDtypeStruct`s).
      step: the step to restore; None for the latest.
      cast_dtypes: accept dtype differences and cast to the target's dtypes
        (after the checksums are verified in the saved dtypes).
      fallback: if the step is damaged, warn (`CheckpointFallbackWarning`)
        and try the next older step, down to the oldest. `restored_step` says
        which step was read.
      verify: check the target against the saved description and every array
        against its checksum. False restores a plain orbax checkpoint (one
        without jmp_amp's metadata, e.g. written by a jmp user) with orbax's
        own structure check only.

    Raises:
      FileNotFoundError: no checkpoint (at `step`).
      CheckpointMismatchError: `target` differs from what was saved.
      CheckpointCorruptedError: the files are damaged (every candidate step,
        with `fallback`), or a restored loss scale is invalid
        (`InvalidLossScaleError`).
    """
    cast_dtypes = _check_bool(cast_dtypes, "cast_dtypes")
    fallback = _check_bool(fallback, "fallback")
    verify = _check_bool(verify, "verify")
    first = self._resolve_step(step)
    candidates = [first]
    if fallback:
      candidates += sorted((s for s in self.all_steps() if s < first),
                           reverse=True)
    damaged: list[CheckpointCorruptedError] = []
    for s in candidates:
      try:
        out = self._restore_step(target, s, cast_dtypes, verify)
      except CheckpointCorruptedError as e:
        if not fallback:
          raise
        damaged.append(e)
        continue
      if damaged:
        warnings.warn(
            f"restored checkpoint step {s} of {self.directory}, not step "
            f"{first}: skipped damaged steps "
            f"{[e.step for e in damaged]}; the first: {damaged[0]}",
            CheckpointFallbackWarning, stacklevel=2)
      self.restored_step = s
      return out
    raise CheckpointCorruptedError(
        f"no intact checkpoint in {self.directory}: steps {candidates} are all "
        f"damaged; step {first}: {damaged[0]}", step=first,
        where=damaged[0].where) from damaged[0]

  def _restore_step(self, target: Any, step: int, cast_dtypes: bool,
                    verify: bool) -> Any:
    saveable = _saveable(target)
    meta = None
    if verify:
      meta = self.metadata(step)
      check_compatible(meta, target, cast_dtypes=cast_dtypes)
    read_as, rebuild = saveable, None
    if not verify:
      read_as, rebuild = self._plain_orbax_layout(step, saveable)
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(**{
          _STATE: ocp.args.StandardRestore(
              _abstract(read_as, meta and meta["leaves"]))}))
      state = restored[_STATE]
    except Exception as e:  # pylint: disable=broad-except
      # tensorstore (NOT_FOUND, OUT_OF_RANGE, DATA_LOSS), JSON and file
      # errors: all mean the files are not what was written.
      raise self._corrupted(step, e) from e
    if rebuild is not None:
      state = rebuild(state)
    # Orbax rebuilds the target's containers; make sure none was normalised
    # (e.g. a custom node turned into a dict), which would reorder leaves.
    want_def = jax.tree_util.tree_structure(saveable)
    if jax.tree_util.tree_structure(state) != want_def:
      raise CheckpointMismatchError(
          f"orbax restored a tree of a different structure than the target:\n"
          f"  restored: {jax.tree_util.tree_structure(state)}\n"
          f"  target:   {want_def}")
    if meta is not None:
      self._verify_checksums(step, meta, state)
    if cast_dtypes:
      state = _cast_like(state, saveable)
    try:
      # Checked before the target's NNX objects are updated in place.
      check_loss_scales(_nnx_copies(target, state))
    except InvalidLossScaleError as e:
      raise InvalidLossScaleError(
          f"checkpoint step {step} in {self.directory}: {e}", step=step,
          where=e.where) from None
    return _update_nnx_objects(target, state)

  def _verify_checksums(self, step: int, meta: dict[str, Any],
                        state: Any) -> None:
    sums = meta.get("checksums")
    if sums is None:  # A jmp_amp.checkpoint/1 checkpoint.
      return
    if sums.get("algorithm") != _CHECKSUM:
      raise CheckpointCorruptedError(
          f"checkpoint step {step} in {self.directory}: unknown checksum "
          f"algorithm {sums.get('algorithm')!r}", step=step,
          where=f"{_META}/metadata")
    saved = sums["arrays"]
    for name, x in _named_leaves(state):
      want = saved.get(name)
      if want is None:
        continue
      got = _checksum(x)
      if got is not None and got != want:
        raise CheckpointCorruptedError(
            f"checkpoint step {step} in {self.directory}: array {name} does "
            f"not match its checksum ({_CHECKSUM} saved {want}, read {got}); "
            "its data files are damaged", step=step, where=name)

  def _plain_orbax_layout(self, step: int, saveable: Any):
    """Without jmp_amp metadata: how to read the checkpoint into `saveable`.

    Returns ``(tree to restore into, None)`` when orbax's paths match the
    target's, or ``(tree, rebuild)`` for jmp's layout: a jmp 0.0.4
    `DynamicLossScale` is stored as its leaves ``[loss_scale, counter]`` by
    index, read here into jmp_amp's `DynamicLossScale` (``overflows``, which
    jmp lacks, starts at 0).

    Raises:
      CheckpointMismatchError: neither layout matches, naming the paths.
    """
    try:
      tree = self._manager.metadata(step).item_metadata[_STATE].tree
    except Exception as e:  # pylint: disable=broad-except
      raise self._corrupted(step, e) from e
    saved, want = _orbax_paths(tree), _orbax_paths(saveable)
    if saved == want:
      return saveable, None

    def jmp_leaves(x):
      if not isinstance(x, ls_lib.DynamicLossScale):
        return x
      return tuple(leaf for name, leaf in _named_leaves(x)
                   if not name.endswith(".overflows"))
    jmp_like = jax.tree_util.tree_map(jmp_leaves, saveable, is_leaf=_is_ls)
    if _orbax_paths(jmp_like) == saved:
      def rebuild(restored):
        def put(target, value):
          if not isinstance(target, ls_lib.DynamicLossScale):
            return value
          values = iter(value)
          leaves = [jnp.zeros(np.shape(leaf), leaf.dtype)
                    if name.endswith(".overflows") else next(values)
                    for name, leaf in _named_leaves(target)]
          return jax.tree_util.tree_unflatten(
              jax.tree_util.tree_structure(target), leaves)
        return jax.tree_util.tree_map(put, saveable, restored, is_leaf=_is_ls)
      return jmp_like, rebuild

    fmt = lambda ks: _listing(["/".join(k) for k in sorted(ks)])
    msg = "checkpoint does not match the restore target (orbax paths):"
    if saved - want:
      msg += f"\n    in the checkpoint, not in the target: {fmt(saved - want)}"
    if want - saved:
      msg += f"\n    in the target, not in the checkpoint: {fmt(want - saved)}"
    raise CheckpointMismatchError(msg)

  def latest_step(self) -> Optional[int]:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def wait_until_finished(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.close()

  def __enter__(self) -> CheckpointManager:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def _resolve_step(self, step: Optional[int]) -> int:
    if step is None:
      step = self._manager.latest_step()
      if step is None:
        raise FileNotFoundError(f"no checkpoint in {self.directory}")
      return step
    step = _check_step(step)
    if step not in self._manager.all_steps():
      raise FileNotFoundError(
          f"no checkpoint for step {step} in {self.directory}; steps saved: "
          f"{sorted(self._manager.all_steps())}")
    return step


def _check_step(step: Any) -> int:
  if isinstance(step, (bool, np.bool_)) or not isinstance(
      step, (int, np.integer)) or step < 0:
    raise ValueError(f"step must be an integer >= 0, got {step!r}")
  return int(step)


def save(directory: PathLike, state: Any, step: int, *,
         overwrite: bool = False, force: bool = False) -> None:
  """Saves `state` as checkpoint `step` under `directory` and waits for it.

  Raises:
    CheckpointExistsError: `step` exists or is below the latest step, and
      `overwrite` is False (see `CheckpointManager.save`).
  """
  with CheckpointManager(directory) as mngr:
    mngr.save(step, state, overwrite=overwrite, force=force)
    mngr.wait_until_finished()


def _existing_directory(directory: Any) -> str:
  directory = _check_directory(directory)
  if not os.path.isdir(directory):
    raise FileNotFoundError(f"no checkpoint directory {directory!r}")
  return directory


def restore(directory: PathLike, target: Any, step: Optional[int] = None, *,
            cast_dtypes: bool = False, fallback: bool = False,
            verify: bool = True) -> Any:
  """Restores checkpoint `step` (default: latest) of `directory` into `target`.

  See `CheckpointManager.restore` for the arguments.

  Raises:
    FileNotFoundError: no checkpoint there.
    CheckpointMismatchError: `target`'s structure, shapes, dtypes or loss-scale
      hyper-parameters differ from the checkpoint's (a ValueError).
    CheckpointCorruptedError: the checkpoint's files are damaged (a
      ValueError).
  """
  with CheckpointManager(_existing_directory(directory)) as mngr:
    return mngr.restore(target, step, cast_dtypes=cast_dtypes,
                        fallback=fallback, verify=verify)


def restore_latest(directory: PathLike, target: Any, *,
                   cast_dtypes: bool = False, fallback: bool = True,
                   verify: bool = True) -> tuple[Any, int]:
  """Restores the newest intact checkpoint; returns ``(state, step)``.

  With `fallback` (the default), a damaged latest step is skipped with a
  `CheckpointFallbackWarning` and the next older intact one is restored.

  Raises:
    FileNotFoundError: no checkpoint there.
    CheckpointMismatchError: `target` differs from the checkpoint.
    CheckpointCorruptedError: no intact step (with `fallback`), or the latest
      step is damaged (without).
  """
  with CheckpointManager(_existing_directory(directory)) as mngr:
    state = mngr.restore(target, None, cast_dtypes=cast_dtypes,
                         fallback=fallback, verify=verify)
    return state, mngr.restored_step


def latest_step(directory: PathLike) -> Optional[int]:
  """The newest checkpoint step in `directory`, or None."""
  directory = _check_directory(directory)
  if not os.path.isdir(directory):
    return None
  with CheckpointManager(directory) as mngr:
    return mngr.latest_step()
