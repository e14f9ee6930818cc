"""Checkpoint and resume mixed-precision training state with orbax.

A thin layer over `orbax.checkpoint` (no pickle): orbax writes the arrays,
sharded or not; this module adds what a resumed mixed-precision run needs to
be *the same run*:

* the loss scales' static hyper-parameters (``period``, ``factor``, ...), which
  are pytree aux data and so not in orbax's array checkpoint, are saved as JSON
  next to the arrays;
* restore checks the target against what was saved -- tree structure, shapes,
  dtypes and loss-scale hyper-parameters -- and raises `CheckpointMismatchError`
  naming every mismatch. Orbax alone would silently cast float32 params into a
  bfloat16 target, or restore a scale into a loss scale with a new period.

Example:
  >>> from jmp_amp import checkpoint
  >>> state = {"params": params, "opt_state": opt_state}
  >>> checkpoint.save("checkpoints/run", state, step=100)
  >>> state = checkpoint.restore("checkpoints/run", target=state)  # latest step

or, to keep the last few checkpoints of a run::

  >>> with checkpoint.CheckpointManager("checkpoints/run", max_to_keep=3) as mngr:
  ...   mngr.save(step, state)
  ...   state = mngr.restore(state)

`target` is a tree like the saved one: a freshly initialised state, or an
abstract one (`jax.ShapeDtypeStruct` leaves, e.g. from `jax.eval_shape`);
restored arrays take the target leaves' shardings. Flax NNX modules and
`nnx.Optimizer`s may appear in the tree as they are: their `nnx.state` is
saved, and restore updates the target's objects in place (and checks the
optimizer's loss-scale hyper-parameters, which `nnx.state` alone drops).

Not imported by `import jmp_amp`; needs ``pip install orbax-checkpoint``.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from jmp_amp._src import loss_scale as ls_lib

PathLike = Union[str, os.PathLike]

_STATE = "state"
_META = "jmp_amp"
_FORMAT = "jmp_amp.checkpoint/1"
_LOSS_SCALE_TYPES = (ls_lib.NoOpLossScale, ls_lib.StaticLossScale,
                     ls_lib.DynamicLossScale)
_MAX_LISTED = 10


class CheckpointMismatchError(ValueError):
  """The restore target does not match the checkpoint."""


# --------------------------------------------------------------------------
# What a state looks like: leaves and loss-scale hyper-parameters.


def _leaf_spec(x: Any) -> dict[str, Any]:
  if isinstance(x, jax.ShapeDtypeStruct) or hasattr(x, "dtype"):
    shape, dtype = tuple(x.shape), x.dtype
  else:
    shape, dtype = np.shape(x), jnp.result_type(x)
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


def describe(state: Any) -> dict[str, Any]:
  """The JSON-able description that `save` stores and `restore` checks.

  Args:
    state: a pytree of arrays (or `jax.ShapeDtypeStruct`s).

  Returns:
    ``{"leaves": {path: {"shape", "dtype"}}, "loss_scales": {path: {"type",
    hyper-parameters}}}``, paths as `jax.tree_util.keystr` gives them.
  """
  is_ls = lambda x: isinstance(x, _LOSS_SCALE_TYPES)
  leaves, scales = {}, {}
  for path, x in jax.tree_util.tree_flatten_with_path(
      _saveable(state), is_leaf=is_ls)[0]:
    name = jax.tree_util.keystr(path)
    if not is_ls(x):
      leaves[name] = _leaf_spec(x)
      continue
    # DynamicLossScale flattens without keys; name its leaves readably.
    if isinstance(x, ls_lib.DynamicLossScale):
      for field in ("loss_scale", "counter", "overflows"):
        leaves[f"{name}.{field}"] = _leaf_spec(getattr(x, field))
  # From `state` itself: nnx.state() keeps a loss scale's arrays but drops its
  # hyper-parameters, which an nnx.Optimizer still holds.
  for path, x in jax.tree_util.tree_flatten_with_path(state, is_leaf=is_ls)[0]:
    if is_ls(x):
      scales[jax.tree_util.keystr(path)] = _loss_scale_spec(x)
  return {"format": _FORMAT, "leaves": leaves, "loss_scales": scales}


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


def _nnx_pytree_type() -> Optional[type]:
  # Only if the caller uses Flax already: this module must not import it.
  nnx = sys.modules.get("flax.nnx")
  return getattr(nnx, "Pytree", None) if nnx is not None else None


def _saveable(tree: Any) -> Any:
  """`tree` with NNX modules/optimizers replaced by their `nnx.state`."""
  pytree_type = _nnx_pytree_type()
  if pytree_type is None:
    return tree
  nnx = sys.modules["flax.nnx"]
  is_obj = lambda x: isinstance(x, pytree_type)
  return jax.tree_util.tree_map(
      lambda x: nnx.state(x) if is_obj(x) else x, tree, is_leaf=is_obj)


def _update_nnx_objects(target: Any, restored: Any) -> Any:
  """Writes restored states into the target's NNX objects, in place."""
  pytree_type = _nnx_pytree_type()
  if pytree_type is None:
    return restored
  nnx = sys.modules["flax.nnx"]
  is_obj = lambda x: isinstance(x, pytree_type)

  def put(t, r):
    if not is_obj(t):
      return r
    nnx.update(t, r)
    return t
  return jax.tree_util.tree_map(put, target, restored, is_leaf=is_obj)


def _abstract(target: Any) -> Any:
  def leaf(x):
    if isinstance(x, jax.ShapeDtypeStruct):
      if x.sharding is None:
        # Orbax needs a sharding to place the restored array; the default
        # device is what an unsharded run would use.
        return x.update(sharding=jax.sharding.SingleDeviceSharding(
            jax.devices()[0]))
      return x
    return ocp.utils.to_shape_dtype_struct(x)
  return jax.tree_util.tree_map(leaf, target)


class CheckpointManager:
  """`ocp.CheckpointManager` that saves and checks loss-scale metadata.

  Args:
    directory: where step directories are written (created if missing).
    max_to_keep: keep only the newest this many checkpoints (None: all).
    save_interval_steps: `save` writes only on multiples of this.
    async_save: let `save` return while files are written in the background
      (the arrays are copied off the device first, so donating them to the
      next train step is safe); `wait_until_finished` blocks.
  """

  def __init__(self, directory: PathLike, *, max_to_keep: Optional[int] = None,
               save_interval_steps: int = 1, async_save: bool = False):
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, save_interval_steps=save_interval_steps,
        create=True, enable_async_checkpointing=async_save)
    self._manager = ocp.CheckpointManager(
        os.path.abspath(os.fspath(directory)), options=options)

  @property
  def directory(self):
    return self._manager.directory

  def save(self, step: int, state: Any, *, force: bool = False) -> bool:
    """Saves `state` as checkpoint `step`; returns whether it was written."""
    step = _check_step(step)
    meta = describe(state)
    meta["step"] = step
    return self._manager.save(
        step, args=ocp.args.Composite(**{
            _STATE: ocp.args.StandardSave(_saveable(state)),
            _META: ocp.args.JsonSave(meta)}), force=force)

  def metadata(self, step: Optional[int] = None) -> dict[str, Any]:
    """The description saved with checkpoint `step` (default: latest)."""
    step = self._resolve_step(step)
    try:
      restored = self._manager.restore(
          step, args=ocp.args.Composite(**{_META: ocp.args.JsonRestore()}))
    except (KeyError, ValueError, FileNotFoundError) as e:
      raise CheckpointMismatchError(
          f"checkpoint step {step} in {self.directory} has no jmp_amp "
          f"metadata (not written by jmp_amp.checkpoint?): {e}") from None
    meta = restored[_META]
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
      raise CheckpointMismatchError(
          f"checkpoint step {step} in {self.directory}: unknown metadata "
          f"format {meta.get('format') if isinstance(meta, dict) else meta!r}")
    return meta

  def restore(self, target: Any, step: Optional[int] = None, *,
              cast_dtypes: bool = False) -> Any:
    """Restores checkpoint `step` (default: latest) into the shape of `target`.

    Raises:
      FileNotFoundError: no checkpoint (at `step`).
      CheckpointMismatchError: `target` differs from what was saved.
    """
    step = self._resolve_step(step)
    check_compatible(self.metadata(step), target, cast_dtypes=cast_dtypes)
    saveable = _saveable(target)
    restored = self._manager.restore(step, args=ocp.args.Composite(**{
        _STATE: ocp.args.StandardRestore(_abstract(saveable))}))
    state = restored[_STATE]
    # Orbax rebuilds the target's containers; make sure none was normalised
    # (e.g. a custom node turned into a dict), which would reorder leaves.
    want_def = jax.tree_util.tree_structure(saveable)
    if jax.tree_util.tree_structure(state) != want_def:
      raise CheckpointMismatchError(
          f"orbax restored a tree of a different structure than the target:\n"
          f"  restored: {jax.tree_util.tree_structure(state)}\n"
          f"  target:   {want_def}")
    return _update_nnx_objects(target, state)

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
         force: bool = False) -> None:
  """Saves `state` as checkpoint `step` under `directory` and waits for it."""
  with CheckpointManager(directory) as mngr:
    mngr.save(step, state, force=force)
    mngr.wait_until_finished()


def restore(directory: PathLike, target: Any, step: Optional[int] = None, *,
            cast_dtypes: bool = False) -> Any:
  """Restores checkpoint `step` (default: latest) of `directory` into `target`.

  Raises:
    FileNotFoundError: no checkpoint there.
    CheckpointMismatchError: `target`'s structure, shapes, dtypes or loss-scale
      hyper-parameters differ from the checkpoint's (a ValueError).
  """
  if not os.path.isdir(directory):
    raise FileNotFoundError(f"no checkpoint directory {os.fspath(directory)!r}")
  with CheckpointManager(directory) as mngr:
    return mngr.restore(target, step, cast_dtypes=cast_dtypes)


def latest_step(directory: PathLike) -> Optional[int]:
  """The newest checkpoint step in `directory`, or None."""
  if not os.path.isdir(directory):
    return None
  with CheckpointManager(directory) as mngr:
    return mngr.latest_step()
