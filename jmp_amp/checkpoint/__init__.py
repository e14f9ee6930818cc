"""Checkpoint and resume mixed-precision training state with orbax."""

from jmp_amp.checkpoint._manager import check_compatible
from jmp_amp.checkpoint._manager import check_loss_scales
from jmp_amp.checkpoint._manager import CheckpointCorruptedError
from jmp_amp.checkpoint._manager import CheckpointExistsError
from jmp_amp.checkpoint._manager import CheckpointFallbackWarning
from jmp_amp.checkpoint._manager import CheckpointManager
from jmp_amp.checkpoint._manager import CheckpointMismatchError
from jmp_amp.checkpoint._manager import describe
from jmp_amp.checkpoint._manager import InvalidLossScaleError
from jmp_amp.checkpoint._manager import latest_step
from jmp_amp.checkpoint._manager import PathLike
from jmp_amp.checkpoint._manager import restore
from jmp_amp.checkpoint._manager import restore_latest
from jmp_amp.checkpoint._manager import save

__all__ = (
    "CheckpointCorruptedError",
    "CheckpointExistsError",
    "CheckpointFallbackWarning",
    "CheckpointManager",
    "CheckpointMismatchError",
    "InvalidLossScaleError",
    "PathLike",
    "check_compatible",
    "check_loss_scales",
    "describe",
    "latest_step",
    "restore",
    "restore_latest",
    "save",
)
