"""Whether the processes of a multi-process run hold the same replicated state.

A global array replicated over the processes (the loss scale, its counters,
data-parallel params and moments) is one value to JAX, but each process
holds its own copy and nothing compares them: processes started with
different loss scales or seeds train on, each with its own copy, and a
checkpoint then mixes them. `check` compares the copies: a CRC-32 of each
process's copy, gathered (one small collective), and the values of the small
ones, to name what differs.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence
import zlib

import jax
import numpy as np

# Arrays up to this many elements have their values shown in the error.
_SHOWN = 4


class ReplicasDisagreeError(ValueError):
  """Processes hold different copies of an array replicated over them.

  Attributes:
    disagreements: ``[(path, [[process, ...], ...])]``: each array that
      differs, with the processes grouped by the copy they hold.
  """

  def __init__(self, message: str, disagreements: list):
    super().__init__(message)
    self.disagreements = disagreements


def _replicated_over_processes(x: Any) -> bool:
  return (isinstance(x, jax.Array) and not x.is_fully_addressable
          and x.is_fully_replicated)


def _local_copy(x: jax.Array) -> np.ndarray:
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  return np.asarray(x.addressable_data(0))


def _gather(local: np.ndarray) -> np.ndarray:
  """Every process's `local`, stacked on a new first axis: a collective."""
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  return np.asarray(multihost_utils.process_allgather(local)).reshape(
      jax.process_count(), *local.shape)


def _show(values: np.ndarray, size: int) -> str:
  if size > _SHOWN:
    return ""
  shown = values[:size].tolist()
  return f" = {shown[0]:g}" if size == 1 else f" = {shown}"


def check(named: Sequence[tuple[str, Any]], what: str, advice: str) -> None:
  """Raises if the processes hold different copies of a replicated array.

  Every process must call it with the same arrays (it gathers); in a
  one-process run it returns at once. Split arrays, host values and
  abstract leaves are not compared.

  Args:
    named: ``(path, leaf)`` pairs, in the same order on every process.
    what: what was being done, starting the message (``"cannot save
      checkpoint step 3"``).
    advice: the sentence ending the message (what to do).

  Raises:
    ReplicasDisagreeError: naming each array that differs, the processes
      grouped by the copy they hold, and the values of small arrays.
  """
  if jax.process_count() == 1:
    return
  arrays = [(name, x) for name, x in named if _replicated_over_processes(x)]
  if not arrays:
    return
  copies = [_local_copy(x) for _, x in arrays]
  local = np.zeros((len(arrays), 1 + _SHOWN), np.float64)
  for i, copy in enumerate(copies):
    flat = np.ascontiguousarray(copy).reshape(-1)
    local[i, 0] = zlib.crc32(flat.view(np.uint8))
    if flat.size <= _SHOWN and np.issubdtype(flat.dtype, np.number):
      local[i, 1:1 + flat.size] = flat.astype(np.float64)
  everyone = _gather(local)
  problems, disagreements = [], []
  for i, (name, _) in enumerate(arrays):
    sums = everyone[:, i, 0]
    if np.all(sums == sums[0]):
      continue
    groups: dict[float, list[int]] = {}
    for p, s in enumerate(sums):
      groups.setdefault(float(s), []).append(p)
    disagreements.append((name, list(groups.values())))
    size = copies[i].size
    numeric = np.issubdtype(copies[i].dtype, np.number)
    parts = []
    for procs in groups.values():
      who = (f"process {procs[0]}" if len(procs) == 1
             else f"processes {procs}")
      parts.append(who + (_show(everyone[procs[0], i, 1:], size)
                          if numeric else ""))
    problems.append(f"{name}: {' vs '.join(parts)}")
  if problems:
    raise ReplicasDisagreeError(
        f"{what}: the processes hold different copies of state that is "
        f"replicated over them (one value to JAX): {'; '.join(problems)}. "
        f"{advice}", disagreements)


def check_settings(settings: Sequence[tuple[str, Any]], what: str,
                   advice: str) -> None:
  """Raises if the processes were given different settings.

  Like `check`, for host values (numbers, None, strings) that each process
  holds for itself: one small gather of every process's values. Every
  process must call it with the same names; in a one-process run it returns
  at once.

  Raises:
    ReplicasDisagreeError: naming each setting that differs, with the
      processes grouped by the value they hold.
  """
  if jax.process_count() == 1 or not settings:
    return
  def number(v):
    if v is None:
      return np.nan
    if isinstance(v, str):
      return float(zlib.crc32(v.encode()))
    return float(np.asarray(v, np.float64))
  everyone = _gather(np.array([number(v) for _, v in settings], np.float64))
  problems, disagreements = [], []
  for i, (name, value) in enumerate(settings):
    col = everyone[:, i]
    groups: dict[str, list[int]] = {}
    for p, v in enumerate(col):
      groups.setdefault(repr(float(v)), []).append(p)
    if len(groups) == 1:
      continue
    disagreements.append((name, list(groups.values())))
    parts = []
    for procs in groups.values():
      who = (f"process {procs[0]}" if len(procs) == 1
             else f"processes {procs}")
      v = col[procs[0]]
      shown = ("" if isinstance(value, str)
               else " = None" if np.isnan(v) else f" = {v:g}")
      parts.append(who + shown)
    problems.append(f"{name}: {' vs '.join(parts)}")
  if problems:
    raise ReplicasDisagreeError(
        f"{what}: the processes were given different settings: "
        f"{'; '.join(problems)}. {advice}", disagreements)


def scaling_leaves(state: Any) -> list[tuple[str, Any]]:
  """``(name, leaf)`` of a `LossScalingState`'s own arrays: the loss scale's
  fields by name (``.loss_scale.counter``) and the step counters."""
  scale = state.loss_scale
  named = [(f".loss_scale.{field}", getattr(scale, field, None))
           for field in ("loss_scale", "counter", "overflows")]
  named += [(f".{field}", getattr(state, field))
            for field in ("grads_finite", "skipped_steps", "steps")]
  return [(name, x) for name, x in named if isinstance(x, jax.Array)]


def check_once(get_named: Callable[..., Sequence[tuple[str, Any]]],
               what: str, advice: str) -> Callable[..., None]:
  """A function of the step's arguments that checks, on its first call,
  the replicated arrays ``get_named(*args)`` lists; later calls do
  nothing (nor any call in a one-process run)."""
  done = [jax.process_count() == 1]

  def checker(*args: Any) -> None:
    if done[0]:
      return
    check(get_named(*args), what, advice)
    done[0] = True

  return checker
