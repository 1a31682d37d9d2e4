"""Which checkpoints a coordinator wrote or restored, as the strategy, the status page and
recovery all read them.

The CheckpointManager appends a :class:`CheckpointRecord` per save and restore; parameter-server
recovery asks the log for the newest checkpoint to restore a server from, and telemetry shows its
age. It lives with checkpointing so that none of those readers depend on the façade.
"""

from __future__ import annotations

import os
import pathlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["CheckpointLog", "CheckpointRecord"]


@dataclass(frozen=True)
class CheckpointRecord:
    """A checkpoint a CheckpointManager wrote or restored: its step, path and write time (Unix)."""

    step: int
    path: str
    written_at: float


class CheckpointLog:
    """The checkpoints this program wrote or restored, newest last. Thread-safe.

    Recovery restores from ``latest``, or, when that one is gone or not whole, from an older
    checkpoint of the same directories (``candidates``): the directories are remembered for that.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._latest: CheckpointRecord | None = None
        self._directories: list[pathlib.Path] = []

    def record(self, step: int, path: str | os.PathLike[str], written_at: float) -> CheckpointRecord:
        """``path`` (a checkpoint directory such as ``root/ckpt-00000400``) is now the newest."""
        record = CheckpointRecord(int(step), str(path), float(written_at))
        root = pathlib.Path(path).parent
        with self._lock:
            self._latest = record
            if root not in self._directories:
                self._directories.append(root)
        return record

    @property
    def latest(self) -> CheckpointRecord | None:
        with self._lock:
            return self._latest

    def forget(self, directory: str | os.PathLike[str]) -> None:
        """The checkpoints under ``directory`` were deleted (e.g. BackupAndRestore at the end)."""
        root = pathlib.Path(directory)
        with self._lock:
            self._directories = [d for d in self._directories if d != root]
            if self._latest is not None and pathlib.Path(self._latest.path).parent == root:
                self._latest = None

    def candidates(self, list_checkpoints: Callable[[pathlib.Path], Sequence[pathlib.Path]]) -> list[pathlib.Path]:
        """Checkpoints to restore from, best first: the latest, then the others that
        ``list_checkpoints(directory)`` finds in the remembered directories, newest first."""
        with self._lock:
            latest = pathlib.Path(self._latest.path) if self._latest is not None else None
            directories = list(reversed(self._directories))
        ordered: list[pathlib.Path] = [latest] if latest is not None else []
        for directory in directories:
            for path in reversed(list_checkpoints(directory)):
                if path not in ordered:
                    ordered.append(path)
        return ordered
