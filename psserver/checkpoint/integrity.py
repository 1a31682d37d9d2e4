"""What a restore trusts of a checkpoint's files: each one a regular file directly in its
checkpoint's directory, holding the bytes whose SHA-256 its manifest names.

A manifest names its files; a name is taken only when it is one plain path component (no ``/``,
no ``..``, not absolute) of a regular file, not a symbolic link (a save never writes one), whose
real path lies in the checkpoint directory's real path. A file is opened without following links
(``O_NOFOLLOW``), hashed as it is read (streamed), and loaded through the same open descriptor,
so the file checked is the file loaded. Every refusal is a CheckpointError naming the file and the
problem; nothing a file holds is unpickled but tensors and plain containers (``weights_only``).

Checkpoints written before files were hashed (a manifest without ``integrity``) are read with a
logged warning, once per checkpoint: their files are still confined and their tensors checked,
but damage to them cannot be told (docs/decisions.md, "Checkpoint files hashed and confined").
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import torch

from paramserve.psserver.protocol.errors import CheckpointError
from paramserve.psserver.runtime.atomic_files import write_new_file

__all__ = [
    "HASH_KEY",
    "INTEGRITY",
    "INTEGRITY_KEY",
    "file_hash",
    "file_problem",
    "load_file",
    "open_file",
    "read_bytes",
    "warn_unhashed",
    "write_hashed",
]

logger = logging.getLogger(__name__)

HASH_KEY = "sha256"
"""A file's entry in a manifest: the SHA-256 of its bytes (hex)."""
INTEGRITY_KEY = "integrity"
"""A manifest's top-level entry saying every file it names carries a hash."""
INTEGRITY = "sha256"
_CHUNK = 1 << 20
_REWRITE = "a save never writes such a name: the manifest was edited, or comes from elsewhere"


class _Hashing:
    """A file being written that hashes what goes through it (torch.save needs write and flush)."""

    def __init__(self, file: IO[bytes], digest: Any):
        self._file = file
        self.digest = digest

    def write(self, data: bytes) -> int:
        self.digest.update(data)
        return self._file.write(data)

    def flush(self) -> None:
        self._file.flush()


def write_hashed(path: Path, write: Callable[[Any], Any]) -> str:
    """Creates ``path`` with what ``write(file)`` writes (write_new_file: fsynced); returns the
    SHA-256 of those bytes, hashed as they were written."""
    digest = hashlib.sha256()
    write_new_file(path, lambda file: write(_Hashing(file, digest)))
    return digest.hexdigest()


def file_hash(directory: Path, name: str, what: str) -> str:
    """The SHA-256 of file ``name`` of checkpoint ``directory`` (confined as ``open_file``
    confines it), read in chunks."""
    with open_file(directory, name, None, what) as file:
        return _stream_hash(file)


def read_bytes(directory: Path, name: str, what: str) -> bytes:
    """The bytes of file ``name`` of checkpoint ``directory``, confined as ``open_file`` confines it."""
    with open_file(directory, name, None, what) as file:
        return file.read()


def _stream_hash(file: IO[bytes]) -> str:
    digest = hashlib.sha256()
    while chunk := file.read(_CHUNK):
        digest.update(chunk)
    return digest.hexdigest()


def _name_problem(name: object) -> str | None:
    if not isinstance(name, str) or not name:
        return f"a file name must be a non-empty string, got {name!r}"
    if "\0" in name or "/" in name or os.sep in name or name in (".", ".."):
        return f"file name {name!r} is not a plain name in the checkpoint's directory; {_REWRITE}"
    return None


def file_problem(directory: Path, name: object) -> str | None:
    """Why ``directory / name`` is not a file a restore may read (None: it may): a name that is
    not one plain path component, a file missing, a symbolic link, not a regular file, or one
    whose real path leaves the directory. Changes nothing and reads no content."""
    problem = _name_problem(name)
    if problem is not None:
        return f"{directory}: {problem}"
    path = directory / str(name)
    try:
        mode = os.lstat(path).st_mode
    except OSError as err:
        return f"{path} cannot be read ({err.strerror or err}): the checkpoint is not whole"
    if stat.S_ISLNK(mode):
        return f"{path} is a symbolic link (to {os.readlink(path)!r}); a save writes regular files only"
    if not stat.S_ISREG(mode):
        return f"{path} is not a regular file"
    if Path(os.path.realpath(path)).parent != Path(os.path.realpath(directory)):
        return f"{path} leaves its checkpoint directory {os.path.realpath(directory)}"
    return None


@contextlib.contextmanager
def open_file(directory: Path, name: object, digest: object, what: str) -> Iterator[IO[bytes]]:
    """File ``name`` of checkpoint ``directory``, open for reading at its start, once it is
    confined (``file_problem``) and, when ``digest`` is not None, its bytes hash to it. ``what``
    names the file in errors ("shard file"). Raises CheckpointError naming the file otherwise."""
    problem = file_problem(directory, name)
    if problem is not None:
        raise CheckpointError(f"{what} refused: {problem}")
    path = directory / str(name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as err:  # ELOOP: it became a link since the check
        raise CheckpointError(f"{what} {path} cannot be opened ({err.strerror or err})") from None
    with os.fdopen(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CheckpointError(f"{what} {path} is not a regular file")
        if digest is not None:
            actual = _stream_hash(file)
            if not isinstance(digest, str) or actual != digest:
                raise CheckpointError(
                    f"{what} {path} does not match its manifest (SHA-256 {actual[:16]}…, the manifest names "
                    f"{str(digest)[:16]}…): it was damaged or replaced since the save; restore another checkpoint"
                )
            file.seek(0)
        yield file


def load_file(directory: Path, name: object, digest: object, what: str) -> Any:
    """``torch.load`` (weights only, on the CPU) of file ``name`` of checkpoint ``directory``,
    opened as ``open_file`` does; any failure to load is a CheckpointError naming the file.
    Memory-mapped through the open descriptor where the system names it (``/proc/self/fd``: the
    file hashed, not whatever the name means now), so a restore of a few rows reads only those."""
    with open_file(directory, name, digest, what) as file:
        by_descriptor = f"/proc/self/fd/{file.fileno()}"
        try:
            if os.path.exists(by_descriptor):
                return torch.load(by_descriptor, map_location="cpu", weights_only=True, mmap=True)
            return torch.load(file, map_location="cpu", weights_only=True)
        except Exception as exc:  # torch raises many types for a damaged or foreign file
            raise CheckpointError(
                f"{what} {directory / str(name)} cannot be read: {type(exc).__name__}: {_short(exc)}"
            ) from None


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else ""


_warned: set[Path] = set()
_warned_lock = threading.Lock()


def warn_unhashed(directory: Path) -> None:
    """Logs, once per checkpoint, that ``directory`` was written before files were hashed."""
    with _warned_lock:
        if directory in _warned:
            return
        if len(_warned) >= 1024:  # bounded: a long-lived server restoring many old checkpoints
            _warned.clear()
        _warned.add(directory)
    logger.warning(
        "checkpoint %s was written before paramserve hashed checkpoint files: its files are confined and "
        "their tensors checked, but damage to them cannot be detected; the next save is hashed",
        directory,
    )
