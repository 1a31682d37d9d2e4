"""Training checkpoints as a strategy keeps them: what ModelCheckpoint and BackupAndRestore ask for.

``Strategy.training_checkpoints(directory, keep)`` returns a :class:`TrainingCheckpoints`.
For strategies whose variables live in this process it is :class:`TorchFileCheckpoints`:
one ``torch.save`` file per checkpoint, ``{"model": state_dict, "optimizer": state_dict,
**extra}``, written atomically. ParameterServerStrategy keeps its checkpoints on the
parameter servers' side (``strategies.parameter_server_training``).
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Mapping
from typing import Any, Protocol

import torch
from torch import nn

from paramserve.psserver.runtime.atomic_files import atomic_torch_save

__all__ = ["TorchFileCheckpoints", "TrainingCheckpoints"]


class TrainingCheckpoints(Protocol):
    """A directory of training checkpoints (model, optimizer, and ``extra`` such as the epoch)."""

    directory: pathlib.Path

    def save(self, name: str, model: nn.Module, optimizer: Any, extra: Mapping[str, Any]) -> pathlib.Path:
        """Writes a checkpoint (``name`` names it where the format allows); keeps the newest ``keep``."""

    def save_at(self, path: pathlib.Path, model: nn.Module, optimizer: Any, extra: Mapping[str, Any]) -> pathlib.Path:
        """Writes one checkpoint at exactly ``path`` (ModelCheckpoint's formatted filepath)."""

    def latest(self) -> pathlib.Path | None:
        """The newest checkpoint, None when there is none."""

    def restore(self, path: pathlib.Path, model: nn.Module, optimizer: Any) -> dict[str, Any]:
        """Loads ``path`` into the model and optimizer; returns its ``extra``."""

    def initialize(self) -> None:
        """There is nothing to restore: training starts from the initial values, replacing any
        state that a run which died before its first checkpoint left outside this process."""

    def clear(self) -> None:
        """Deletes every checkpoint this object manages (and the directory, if that leaves it empty)."""


class TorchFileCheckpoints:
    """``directory/<name>.pt`` files; the newest ``keep`` (by name) are kept (0: all)."""

    SUFFIX = ".pt"

    def __init__(self, directory: str | os.PathLike[str], keep: int):
        self.directory = pathlib.Path(directory)
        self.keep = keep

    def save_at(self, path: pathlib.Path, model: nn.Module, optimizer: Any, extra: Mapping[str, Any]) -> pathlib.Path:
        return atomic_torch_save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), **extra}, path)

    def initialize(self) -> None:
        pass  # the model and optimizer live in this process: they start as built

    def save(self, name: str, model: nn.Module, optimizer: Any, extra: Mapping[str, Any]) -> pathlib.Path:
        path = self.save_at(self.directory / f"{name}{self.SUFFIX}", model, optimizer, extra)
        if self.keep:
            for old in self._files()[: -self.keep]:
                old.unlink(missing_ok=True)
        return path

    def latest(self) -> pathlib.Path | None:
        files = self._files()
        return files[-1] if files else None

    def restore(self, path: pathlib.Path, model: nn.Module, optimizer: Any) -> dict[str, Any]:
        saved = dict(torch.load(path, weights_only=True))
        model.load_state_dict(saved.pop("model"))
        optimizer.load_state_dict(saved.pop("optimizer"))
        return saved

    def clear(self) -> None:
        for path in self._files():
            path.unlink(missing_ok=True)
        try:
            self.directory.rmdir()  # only when nothing else is in it
        except OSError:
            pass

    def _files(self) -> list[pathlib.Path]:
        if not self.directory.is_dir():
            return []
        return sorted(p for p in self.directory.iterdir() if p.suffix == self.SUFFIX and p.is_file())
