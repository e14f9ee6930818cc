"""The one error `jmp_amp.checkpoint` raises: `CheckpointError`.

Every refusal is a `CheckpointError`, a `ValueError`, so that a caller who
only asks "did it restore?" catches one type; its `reason` says why, and
``step`` and ``where`` say which step and which array or file, for a
fallback or a report.
"""

from __future__ import annotations

from typing import Optional

MISMATCH, EXISTS, CORRUPTED = "mismatch", "exists", "corrupted"


class CheckpointError(ValueError):
  """A checkpoint that cannot be saved or restored as asked.

  Attributes:
    reason: why, one of
      ``"mismatch"``: the restore target differs from what was saved
      (structure, shapes, dtypes, the optimizer state's types, loss-scale
      hyper-parameters, FP8 recipes; the message names every difference),
      or the step directory holds a state saved as another step, or (at
      save) the processes hold different copies of a replicated array;
      ``"exists"``: a save would replace a saved step, or go back before
      the latest one (the message lists them; ``overwrite=True`` allows it);
      ``"corrupted"``: the files are damaged or incomplete, or hold a state
      a run cannot use (a loss scale that is not finite and > 0, an FP8 amax
      history that is not finite and >= 0). Restoring with
      ``fallback=True`` skips such steps; the others it raises at once.
    step: the checkpoint step, None if unknown.
    where: for ``"corrupted"``: the array path (as `jax.tree_util.keystr`
      writes it) or the file, relative to the step directory, that is
      damaged; None if unknown or for the other reasons.

  Example:
    >>> import tempfile
    >>> from jmp_amp import checkpoint
    >>> run_dir = tempfile.mkdtemp()
    >>> checkpoint.save(run_dir, {"w": jnp.ones(3)}, step=1)
    >>> try:
    ...   checkpoint.restore(run_dir, target={"w": jnp.ones(3, jnp.bfloat16)})
    ... except checkpoint.CheckpointError as e:
    ...   print(e.reason, e.step)
    ...   print(e)
    mismatch 1
    checkpoint does not match the restore target:
      - dtype mismatch (a different precision policy?):
        ['w']: saved float32, target bfloat16
    ...
  """

  def __init__(self, message: str, reason: str, step: Optional[int] = None,
               where: Optional[str] = None):
    super().__init__(message)
    self.reason = reason
    self.step = step
    self.where = where


def mismatch(message: str, step: Optional[int] = None) -> CheckpointError:
  return CheckpointError(message, MISMATCH, step)


def exists(message: str, step: int) -> CheckpointError:
  return CheckpointError(message, EXISTS, step)


def corrupted(message: str, step: Optional[int] = None,
              where: Optional[str] = None) -> CheckpointError:
  return CheckpointError(message, CORRUPTED, step, where)
