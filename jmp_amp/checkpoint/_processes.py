"""Saving from several processes: every array global, every copy the same.

Every process calls `save`; orbax writes each array's shards from the
processes that hold them. These checks run first, so that a state orbax
would refuse deep inside its writer, or one whose replicated arrays differ
between processes (one copy would be kept, the others silently dropped), is
refused with a named error.
"""

from __future__ import annotations

import os
from typing import Any

import jax

from jmp_amp._src import replicas
from jmp_amp.checkpoint import _compat
from jmp_amp.checkpoint import _errors


def check_save(saveable: Any, step: int, directory: os.PathLike) -> None:
  """Raises if `saveable` cannot be saved as one state of the whole run.

  Raises:
    ValueError: an array lives on this process's devices only.
    CheckpointError: the processes hold different copies of a replicated
      array (reason ``"mismatch"``), naming each and its values.
  """
  _check_global(saveable, step)
  try:
    replicas.check(
        _compat.named_leaves(saveable),
        f"cannot save checkpoint step {step} in {directory}",
        "The checkpoint would keep one process's copy and silently drop the "
        "others (or fail its checksums on restore). Start every process from "
        "the same state: the same loss scale, seeds and checkpoint.")
  except replicas.ReplicasDisagreeError as e:
    raise _errors.mismatch(str(e), step) from None


def _check_global(saveable: Any, step: int) -> None:
  """In a multi-process run, refuses arrays that live on one process only.

  Every process calls `save` and orbax writes each array's shards from the
  processes that hold them; an array on this process's devices alone (made
  outside `jit`, or by a `jit` that left a constant on one device) is not one
  array of the run but a copy per process, which orbax refuses deep inside its
  writer.
  """
  if jax.process_count() == 1:
    return
  local = [name for name, x in _compat.named_leaves(saveable)
           if isinstance(x, jax.Array) and x.is_fully_addressable]
  if local:
    raise ValueError(
        f"cannot save checkpoint step {step}: in a multi-process run "
        f"({jax.process_count()} processes) every array must be a global "
        f"array on the run's mesh, but {_compat.listing(local)} live(s) on "
        "this process's devices only. Create the state under jit with "
        "out_shardings on the global mesh (replicated: "
        "NamedSharding(mesh, PartitionSpec())), or build it with "
        "jax.make_array_from_callback / "
        "jax.make_array_from_process_local_data.")
