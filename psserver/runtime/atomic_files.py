"""Crash-safe file writes: a reader sees the old file or the new one, never half of one.

Used by the parameter server's checkpoints, the port file every server writes,
and the coordinator's training checkpoints. The recipe is always the same: write
a temporary file in the target's directory, fsync it, ``os.replace`` it over the
target (atomic on POSIX), fsync the directory so the rename itself survives a
power cut.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch

__all__ = ["TEMPORARY_PREFIX", "atomic_torch_save", "atomic_write", "fsync_dir", "write_new_file"]

TEMPORARY_PREFIX = ".tmp-"
"""Temporary files and directories start with this; a sweep may delete them."""


def fsync_dir(path: Path) -> None:
    """Makes the directory entries of ``path`` (new names, renames) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_new_file(path: Path, write: Callable[[IO[bytes]], Any]) -> None:
    """Creates ``path`` (which must not exist), fills it with ``write`` and fsyncs it."""
    with open(path, "xb") as file:
        write(file)
        file.flush()
        os.fsync(file.fileno())


def atomic_write(path: str | os.PathLike[str], write: Callable[[IO[bytes]], Any]) -> Path:
    """Replaces ``path`` with what ``write(file)`` writes, atomically; creates parent directories."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f"{TEMPORARY_PREFIX}{target.name}.")
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(target.parent)
    return target


def atomic_torch_save(obj: Any, path: str | os.PathLike[str]) -> Path:
    """``torch.save(obj, path)`` through :func:`atomic_write`."""
    return atomic_write(path, lambda handle: torch.save(obj, handle))
