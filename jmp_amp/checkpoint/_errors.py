"""The errors and warning `jmp_amp.checkpoint` raises: one class per outcome.

Every refusal is a `ValueError`, so that a caller who only asks "did it
restore?" catches one type; the classes say why, and the damaged ones carry
the step and the place (`where`) for a fallback or a report.
"""

from __future__ import annotations

from typing import Optional


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


class InvalidFP8StateError(CheckpointCorruptedError):
  """A restored FP8 amax history holds a value that is not finite and >= 0."""


class CheckpointFallbackWarning(UserWarning):
  """`restore(..., fallback=True)` skipped damaged steps."""
