"""Consistent cuts and export: the CheckpointManager (every shard read with dispatch paused, saved
whole or not at all), hybrid training's dense state beside it, and the log of checkpoints written.

May import: the coordinator's base.
"""

from paramserve.psserver.protocol.lazy import lazy_attributes

TYPE_CHECKING = False  # not typing's: a package's import stays free of it
if TYPE_CHECKING:
    from paramserve.coordinator.checkpointing.checkpoint_log import CheckpointLog, CheckpointRecord
    from paramserve.coordinator.checkpointing.checkpoint_manager import (
        CheckpointManager,
        export_state_dict,
        load_state_dict,
        state_dict,
    )
    from paramserve.coordinator.checkpointing.checkpointed_variables import CheckpointedVariables

__all__ = [
    "CheckpointLog",
    "CheckpointManager",
    "CheckpointRecord",
    "CheckpointedVariables",
    "export_state_dict",
    "load_state_dict",
    "state_dict",
]

_HOMES = {
    "CheckpointLog": "checkpoint_log",
    "CheckpointManager": "checkpoint_manager",
    "CheckpointRecord": "checkpoint_log",
    "CheckpointedVariables": "checkpointed_variables",
    "export_state_dict": "checkpoint_manager",
    "load_state_dict": "checkpoint_manager",
    "state_dict": "checkpoint_manager",
}

__getattr__ = lazy_attributes(__name__, _HOMES)
