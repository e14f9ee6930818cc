"""`CheckpointManager` and the one-call `save` / `restore` around it.

An `orbax.checkpoint.CheckpointManager` does the work: it writes each step
into a temporary directory and commits it (a rename and a commit time in the
step's metadata, so a killed save leaves no step), lists and deletes steps,
keeps the newest `max_to_keep`. This manager adds the refusals: no save over an
existing or later step without ``overwrite``, no restore that does not match,
is damaged, or brings back an unusable loss scale or FP8 history.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Union
import warnings

import jax
import numpy as np
import orbax.checkpoint as ocp

from jmp_amp.checkpoint import _compat
from jmp_amp.checkpoint import _errors
from jmp_amp.checkpoint import _fp8
from jmp_amp.checkpoint import _integrity
from jmp_amp.checkpoint import _layout
from jmp_amp.checkpoint import _nnx
from jmp_amp.checkpoint import _processes

PathLike = Union[str, os.PathLike]


class CheckpointManager:
  """An `ocp.CheckpointManager` that refuses what would not resume the run.

  Args:
    directory: where step directories are written (created if missing).
    max_to_keep: keep only the newest this many checkpoints (None: all).
    save_interval_steps: `save` writes only on multiples of this.
    async_save: let `save` return while files are written in the background
      (the arrays are copied off the device first, so donating them to the
      next train step is safe); `wait_until_finished` blocks.

  Attributes:
    restored_step: the step the last successful `restore` read (None before).

  Example:
    >>> import tempfile; from jmp_amp import checkpoint
    >>> with checkpoint.CheckpointManager(tempfile.mkdtemp(),
    ...                                   max_to_keep=2) as mngr:
    ...   for step in range(3):
    ...     _ = mngr.save(step, {"w": jnp.full(2, float(step))})
    ...   state = mngr.restore({"w": jnp.zeros(2)})
    >>> mngr.all_steps(), mngr.restored_step, state["w"].tolist()
    ([1, 2], 2, [2.0, 2.0])
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
    self._steps = _layout.CommittedSteps()
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, save_interval_steps=save_interval_steps,
        create=True, enable_async_checkpointing=async_save,
        step_name_format=self._steps)
    self._manager = ocp.CheckpointManager(
        directory, options=options, item_handlers=_layout.item_handlers())
    self.restored_step: Optional[int] = None

  @property
  def directory(self):
    return self._manager.directory

  def _step_dir(self, step: int) -> str:
    return os.path.join(os.fspath(self.directory),
                        self._steps.build_name(step))

  def save(self, step: int, state: Any, *, overwrite: bool = False,
           force: bool = False) -> bool:
    """Saves `state` as checkpoint `step`.

    Args:
      step: an integer >= 0, after every step saved so far.
      state: the pytree to save.
      overwrite: if `step` or later steps exist (a rerun into an old
        directory), delete them and write this one, so that the directory
        then ends at `step`. Without it, that raises `CheckpointError`.
      force: save even if `save_interval_steps` would skip this step.

    Returns:
      Whether the checkpoint was written (False only when
      `save_interval_steps` skips `step`).

    Raises:
      CheckpointError: `step` exists, or is below the latest step (reason
        ``"exists"``).
    """
    step = _check_step(step)
    overwrite = _check_bool(overwrite, "overwrite")
    force = _check_bool(force, "force")
    saveable = _nnx.saveable(state)
    _processes.check_save(saveable, step, self.directory)
    meta = _compat.describe(state)
    if not meta["leaves"]:
      raise ValueError(f"state has no arrays to save, got "
                       f"{type(state).__name__}: {state!r:.80}")
    meta["step"] = step
    meta["checksums"] = _integrity.checksums(saveable)
    # An async save in flight has no step directory yet; orbax waits here
    # before its next save anyway.
    self._manager.wait_until_finished()
    existing = [s for s in self.all_steps() if s >= step]
    if existing and not overwrite:
      what = (f"step {step} already exists" if step in existing else
              f"step {step} is below the latest step {max(existing)}")
      raise _errors.exists(
          f"cannot save checkpoint step {step} in {self.directory}: {what}. "
          f"Pass overwrite=True to delete steps {existing} and write step "
          f"{step}, or save to a new directory.", step)
    for s in existing:
      self._manager.delete(s)
    return self._manager.save(step, args=_layout.save_args(saveable, meta),
                              force=force)

  def _corrupted(self, step: int, error: BaseException
                 ) -> _errors.CheckpointError:
    where = _integrity.damaged_file(self._step_dir(step), error)
    where_text = f", file {where}" if where else ""
    return _errors.corrupted(
        f"checkpoint step {step} in {self.directory} is damaged or incomplete"
        f"{where_text}: {type(error).__name__}: "
        f"{_integrity.first_line(error)}", step=step, where=where)

  def _damaged(self, step: int, what: str, where: str
               ) -> _errors.CheckpointError:
    return _errors.corrupted(
        f"checkpoint step {step} in {self.directory}: {what}", step=step,
        where=where)

  def metadata(self, step: Optional[int] = None) -> dict[str, Any]:
    """The description saved with checkpoint `step` (default: latest).

    Raises:
      CheckpointError: the metadata is missing or unreadable ("corrupted").
    """
    step = self._resolve_step(step)
    if not os.path.isdir(os.path.join(self._step_dir(step), _layout.META)):
      raise _errors.corrupted(
          f"checkpoint step {step} in {self.directory} has no jmp_amp "
          "metadata: it is damaged, or was not written by "
          "jmp_amp.checkpoint. A plain orbax checkpoint (e.g. from a jmp run) "
          "restores with verify=False, without checks.", step=step,
          where=_layout.META)
    try:
      meta = self._manager.restore(
          step, args=_layout.meta_restore_args())[_layout.META]
    except Exception as e:  # pylint: disable=broad-except
      raise self._corrupted(step, e) from e
    problem = _integrity.metadata_problem(meta)
    if problem:
      raise self._damaged(
          step, f"damaged metadata (file {_layout.META_FILE}): {problem}",
          _layout.META_FILE)
    return meta

  def restore(self, target: Any, step: Optional[int] = None, *,
              cast_dtypes: bool = False, fallback: bool = False,
              verify: bool = True) -> Any:
    """Restores checkpoint `step` (default: latest) into the shape of `target`.

    Args:
      target: a tree like the saved one (arrays or `jax.ShapeDtypeStruct`s,
        Python numbers, NNX modules and optimizers).
      step: the step to restore; None for the latest.
      cast_dtypes: accept dtype differences and cast to the target's dtypes
        (after the checksums are verified in the saved dtypes).
      fallback: if the step is damaged, warn (a UserWarning naming the
        skipped steps) and try the next older step, down to the oldest. `restored_step` says
        which step was read.
      verify: check the target against the saved description and every array
        against its checksum. False restores a plain orbax checkpoint (one
        without jmp_amp's metadata, e.g. written by a jmp user) with orbax's
        own structure check only.

    Raises:
      FileNotFoundError: no checkpoint (at `step`).
      CheckpointError: `target` differs from what was saved (reason
        ``"mismatch"``), or the files are damaged (every candidate step,
        with `fallback`) or hold an invalid loss scale or FP8 amax history
        (``"corrupted"``).
    """
    cast_dtypes = _check_bool(cast_dtypes, "cast_dtypes")
    fallback = _check_bool(fallback, "fallback")
    verify = _check_bool(verify, "verify")
    first = self._resolve_step(step)
    candidates = [first]
    if fallback:
      candidates += sorted((s for s in self.all_steps() if s < first),
                           reverse=True)
    damaged: list[_errors.CheckpointError] = []
    for s in candidates:
      try:
        out = self._restore_step(target, s, cast_dtypes, verify)
      except _errors.CheckpointError as e:
        if not fallback or e.reason != _errors.CORRUPTED:
          raise
        damaged.append(e)
        continue
      if damaged:
        warnings.warn(
            f"restored checkpoint step {s} of {self.directory}, not step "
            f"{first}: skipped damaged steps "
            f"{[e.step for e in damaged]}; the first: {damaged[0]}",
            UserWarning, stacklevel=2)
      self.restored_step = s
      return out
    raise _errors.corrupted(
        f"no intact checkpoint in {self.directory}: steps {candidates} are all "
        f"damaged; step {first}: {damaged[0]}", step=first,
        where=damaged[0].where) from damaged[0]

  def _restore_step(self, target: Any, step: int, cast_dtypes: bool,
                    verify: bool) -> Any:
    saveable = _nnx.saveable(target)
    meta, read_as, rebuild = None, saveable, None
    if verify:
      meta = self.metadata(step)
      _compat.check_step(meta, step, self.directory)
      _compat.check_compatible(meta, target, cast_dtypes=cast_dtypes)
    if not verify or "state_types" not in meta:
      try:
        saved_tree = self._manager.metadata(step).item_metadata[
            _layout.STATE].tree
      except Exception as e:  # pylint: disable=broad-except
        raise self._corrupted(step, e) from e
      if verify:  # Saved before the types were: orbax keeps empty nodes.
        _layout.check_empty_nodes(saved_tree, saveable, step)
      else:
        read_as, rebuild = _layout.plain_layout(saved_tree, saveable)
    missing = _integrity.missing_index(
        os.path.join(self._step_dir(step), _layout.STATE))
    if missing is not None:
      where = f"{_layout.STATE}/{missing}"
      raise self._damaged(
          step, f"file {where} (the index of the array data) is missing", where)
    try:
      state = self._manager.restore(step, args=_layout.state_restore_args(
          read_as, meta and meta["leaves"]))[_layout.STATE]
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
      raise _errors.mismatch(
          f"orbax restored a tree of a different structure than the target:\n"
          f"  restored: {jax.tree_util.tree_structure(state)}\n"
          f"  target:   {want_def}", step)
    if meta is not None:
      self._verify_checksums(step, meta, state)
    if cast_dtypes:
      state = _layout.cast_like(state, saveable)
    try:
      # Checked before the target's NNX objects are updated in place.
      _compat.check_loss_scales(_nnx.copies(target, state))
      _fp8.check_histories(state)
    except _errors.CheckpointError as e:
      raise _errors.corrupted(f"checkpoint step {step} in {self.directory}: "
                              f"{e}", step, e.where) from None
    return _nnx.update_objects(target, state)

  def _verify_checksums(self, step: int, meta: dict[str, Any],
                        state: Any) -> None:
    try:
      mismatch = _integrity.first_mismatch(meta, state)
    except ValueError as e:
      raise self._damaged(step, str(e), _layout.META_FILE) from None
    if mismatch is not None:
      name, want, got = mismatch
      if (jax.process_count() > 1
          and name not in meta["checksums"].get("shards", {})):
        # One copy per process was saved; the checksum may be another's.
        raise self._damaged(
            step, f"array {name} does not match its checksum "
            f"({_integrity.CHECKSUM} saved {want}, read {got}). It is "
            "replicated over the processes: either the processes that saved "
            "it held different copies of it (a save before jmp_amp compared "
            "the copies; the file then holds one process's copy and the "
            "checksum another's), or its data files are damaged. Restore an "
            "earlier step, or restart every process from the same state",
            name)
      raise self._damaged(
          step, f"array {name} does not match its checksum "
          f"({_integrity.CHECKSUM} saved {want}, read {got}); its data files "
          "are damaged", name)

  def latest_step(self) -> Optional[int]:
    """The newest committed step, or None."""
    steps = self.all_steps()
    return steps[-1] if steps else None

  def all_steps(self) -> list[int]:
    """The committed steps, oldest first.

    Read from the directory: orbax's own list also holds a step whose
    asynchronous save is still being written.
    """
    return sorted(self._manager.all_steps(read=True))

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
          f"{self.all_steps()}")
    return step


def _check_step(step: Any) -> int:
  if isinstance(step, (bool, np.bool_)) or not isinstance(
      step, (int, np.integer)) or step < 0:
    raise ValueError(f"step must be an integer >= 0, got {step!r}")
  return int(step)


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


def _existing_directory(directory: Any) -> str:
  directory = _check_directory(directory)
  if not os.path.isdir(directory):
    raise FileNotFoundError(f"no checkpoint directory {directory!r}")
  return directory


def save(directory: PathLike, state: Any, step: int, *,
         overwrite: bool = False, force: bool = False) -> None:
  """Saves `state` as checkpoint `step` under `directory` and waits for it.

  Example (a state with a loss scale and NNX modules: `jmp_amp.checkpoint`):
    >>> import tempfile; from jmp_amp import checkpoint
    >>> run_dir = tempfile.mkdtemp()
    >>> checkpoint.save(run_dir, {"w": jnp.arange(3.0), "epoch": 2}, step=10)
    >>> checkpoint.latest_step(run_dir)
    10

  Raises:
    CheckpointError: `step` exists or is below the latest step, and
      `overwrite` is False (reason ``"exists"``).
  """
  with CheckpointManager(directory) as mngr:
    mngr.save(step, state, overwrite=overwrite, force=force)
    mngr.wait_until_finished()


def restore(directory: PathLike, target: Any, step: Optional[int] = None, *,
            cast_dtypes: bool = False, fallback: bool = False,
            verify: bool = True) -> Any:
  """Restores checkpoint `step` (default: latest) of `directory` into `target`.

  See `CheckpointManager.restore` for the arguments.

  Example:
    >>> import tempfile; from jmp_amp import checkpoint
    >>> run_dir = tempfile.mkdtemp()
    >>> for step in (1, 2):
    ...   checkpoint.save(run_dir, {"w": jnp.full(2, float(step))}, step)
    >>> checkpoint.restore(run_dir, {"w": jnp.zeros(2)}, step=1)["w"].tolist()
    [1.0, 1.0]

  Raises:
    FileNotFoundError: no checkpoint there.
    CheckpointError: `target`'s structure, shapes, dtypes, loss-scale
      hyper-parameters or FP8 recipes differ from the checkpoint's (reason
      ``"mismatch"``), or the checkpoint is damaged (``"corrupted"``).
  """
  with CheckpointManager(_existing_directory(directory)) as mngr:
    return mngr.restore(target, step, cast_dtypes=cast_dtypes,
                        fallback=fallback, verify=verify)


def restore_latest(directory: PathLike, target: Any, *,
                   cast_dtypes: bool = False, fallback: bool = True,
                   verify: bool = True) -> tuple[Any, int]:
  """Restores the newest intact checkpoint; returns ``(state, step)``.

  With `fallback` (the default), a damaged latest step is skipped with a
  UserWarning and the next older intact one is restored.

  Example (a resumed run: the state of the newest step, and that step):
    >>> import tempfile; from jmp_amp import checkpoint
    >>> run_dir = tempfile.mkdtemp()
    >>> for step in (100, 200):
    ...   checkpoint.save(run_dir, {"w": jnp.full(2, float(step))}, step)
    >>> state, step = checkpoint.restore_latest(run_dir, {"w": jnp.zeros(2)})
    >>> step, state["w"].tolist()
    (200, [200.0, 200.0])

  Raises:
    FileNotFoundError: no checkpoint there.
    CheckpointError: `target` differs from the checkpoint (reason
      ``"mismatch"``), no step is intact (with `fallback`), or the latest is
      damaged (without; ``"corrupted"``).
  """
  with CheckpointManager(_existing_directory(directory)) as mngr:
    state = mngr.restore(target, None, cast_dtypes=cast_dtypes,
                         fallback=fallback, verify=verify)
    return state, mngr.restored_step


def latest_step(directory: PathLike) -> Optional[int]:
  """The newest committed checkpoint step in `directory`, or None.

  Example (resume if there is something to resume):
    >>> import tempfile; from jmp_amp import checkpoint
    >>> run_dir = tempfile.mkdtemp()
    >>> print(checkpoint.latest_step(run_dir))
    None
    >>> checkpoint.save(run_dir, {"w": jnp.ones(2)}, step=7)
    >>> checkpoint.latest_step(run_dir)
    7
  """
  directory = _check_directory(directory)
  if not os.path.isdir(directory):
    return None
  with CheckpointManager(directory) as mngr:
    return mngr.latest_step()
