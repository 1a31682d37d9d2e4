"""Atomic checkpoints of shards on a filesystem, restorable onto any partitioning.

Layout of a checkpoint root::

    root/
      LATEST                  name of the newest complete checkpoint
      ckpt-00000001/
        manifest.json         variables, their shards' row ranges, files (with their SHA-256),
                              versions; `extra`
        0000-layers.0.weight.shard-0.pt   torch.save({"value", "slots", "applied_keys"})
        ...

A save writes everything into ``root/.tmp-<uuid>/`` (each file fsynced),
renames that directory to ``ckpt-<N>`` (the commit: a rename is atomic), and
then replaces ``LATEST`` through a fsynced temporary file. A crash at any
point leaves the previous checkpoint and ``LATEST`` intact; ``.tmp-*``
directories are never taken for checkpoints. Saves and sweeps of one root hold
an exclusive lock on ``root/.lock`` (flock), so the next save or restore can
delete what an interrupted save left (``.tmp-*``, ``.trash-*``) without
touching a save in progress.

Restores are by rows, not by saved shard: :func:`load_rows` assembles any row
range of a variable from whichever saved shards overlap it, so a checkpoint
written by two servers restores onto three. It reads only files that integrity.py
lets it (confined, hashed) and checks every tensor as a server would, raising
CheckpointError before its caller changes anything.

A checkpoint may *need* older ones of its root (the manifest's ``needs``: an incremental
checkpoint of dynamic tables holds only what changed since them). It is whole only while they
are, a save refuses to name one that is gone (CheckpointBaseMissingError), and pruning keeps
every checkpoint a kept one needs.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import torch
from torch import Tensor

from paramserve.psserver.checkpoint import integrity
from paramserve.psserver.protocol.errors import (
    CheckpointBaseMissingError,
    CheckpointError,
    InvalidRequestError,
    ParamServeError,
)
from paramserve.psserver.protocol.optimizer_spec import OptimizerSpec
from paramserve.psserver.protocol.tensors import dtype_from_name, dtype_name
from paramserve.psserver.protocol.types import ShardRef, ShardState
from paramserve.psserver.runtime.atomic_files import (
    TEMPORARY_PREFIX,
    atomic_write,
    fsync_dir,
    write_new_file,
)
from paramserve.psserver.store.shards import check_restorable, check_state

__all__ = [
    "FORMAT_VERSION",
    "SavedShard",
    "VariableEntry",
    "Manifest",
    "save_checkpoint",
    "delete_checkpoints",
    "sweep_leftovers",
    "gaps",
    "is_base",
    "is_whole",
    "missing_bases",
    "latest_checkpoint",
    "list_checkpoints",
    "resolve",
    "why_not_whole",
    "read_manifest",
    "variables",
    "load_rows",
]

logger = logging.getLogger(__name__)

FORMAT = "paramserve-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LATEST = "LATEST"
_CHECKPOINT_NAME = re.compile(r"^ckpt-(\d{8,})$")
_WHAT_A_CHECKPOINT_IS = (
    "a checkpoint is a directory ckpt-NNNNNNNN/ holding manifest.json and one .pt file per shard; "
    "its parent (the checkpoint root) names the newest in a LATEST file"
)


@dataclass(frozen=True)
class SavedShard:
    """One saved shard: rows ``[row_start, row_start + num_rows)`` of its variable."""

    shard: int
    row_start: int
    num_rows: int
    file: str
    version: int
    sha256: str | None = None
    """The file's SHA-256 (None: a checkpoint written before files were hashed)."""

    @property
    def row_stop(self) -> int:
        return self.row_start + self.num_rows


@dataclass(frozen=True)
class VariableEntry:
    """A saved variable. A 0-d variable counts as one row."""

    variable_shape: tuple[int, ...]
    dtype: torch.dtype
    optimizer: OptimizerSpec | None
    shards: tuple[SavedShard, ...]

    @property
    def num_rows(self) -> int:
        return self.variable_shape[0] if self.variable_shape else 1


@dataclass(frozen=True)
class Manifest:
    path: Path
    format_version: int
    variables: Mapping[str, VariableEntry]
    extra: Mapping[str, Any]
    needs: tuple[str, ...] = ()
    """Older checkpoints of the same root (names) this one cannot be restored without."""
    hashed: bool = False
    """Whether every file it names carries its SHA-256 (False: written before files were hashed)."""


# ---------------------------------------------------------------------------
# Saving


def _rows_of(state: ShardState) -> int:
    return int(state.value.shape[0]) if state.value.dim() else 1


def _group_by_variable(states: Sequence[ShardState]) -> dict[str, list[ShardState]]:
    """States by variable (sorted), checked to agree on the variable's shape, dtype and optimizer."""
    groups: dict[str, list[ShardState]] = {}
    refs: set[ShardRef] = set()
    for state in states:
        try:
            check_state(state)
        except ParamServeError as error:
            raise CheckpointError(f"cannot save an invalid shard: {error}", variable=error.variable) from None
        if state.ref in refs:
            raise CheckpointError(f"shard {state.ref.shard} is given twice", variable=state.ref.variable)
        refs.add(state.ref)
        groups.setdefault(state.ref.variable, []).append(state)
    for name, group in groups.items():
        first = group[0]
        for state in group[1:]:
            if (tuple(state.variable_shape), state.value.dtype, state.optimizer) != (
                tuple(first.variable_shape),
                first.value.dtype,
                first.optimizer,
            ):
                raise CheckpointError("shards of one variable disagree on its shape, dtype or optimizer", variable=name)
    return {name: sorted(groups[name], key=lambda state: state.ref.shard) for name in sorted(groups)}


def _check_whole(groups: Mapping[str, list[ShardState]]) -> None:
    """Raises CheckpointError for a variable whose shards leave rows out or hold some twice."""
    for name, group in groups.items():
        first = group[0]
        shards = tuple(
            sorted(
                (SavedShard(s.ref.shard, int(s.row_start), _rows_of(s), "", 0) for s in group),
                key=lambda saved: saved.row_start,
            )
        )
        missing = gaps(VariableEntry(tuple(first.variable_shape), first.value.dtype, first.optimizer, shards))
        if missing:
            raise CheckpointError(
                f"the shards to save do not cover the variable exactly (rows {missing} are missing or doubled): "
                "a parameter server lost or duplicated shards during the export; nothing was written",
                variable=name,
            )


def _file_name(index: int, variable: str, shard: int) -> str:
    # The index makes names unique (even on case-insensitive filesystems);
    # the escaped variable name is only there for people reading the directory.
    return f"{index:04d}-{quote(variable, safe='')[:100]}.shard-{shard}.pt"


def _variable_manifest(group: list[ShardState], files: list[tuple[str, str]]) -> dict[str, Any]:
    first = group[0]
    optimizer = first.optimizer
    return {
        "variable_shape": [int(dim) for dim in first.variable_shape],
        "dtype": dtype_name(first.value.dtype),
        "optimizer": None if optimizer is None else {"name": optimizer.name, "kwargs": json.loads(optimizer.to_json())},
        "shards": [
            {
                "shard": state.ref.shard,
                "row_start": int(state.row_start),
                "num_rows": _rows_of(state),
                "file": file,
                "version": int(state.version),
                integrity.HASH_KEY: digest,
            }
            for state, (file, digest) in zip(group, files)
        ],
    }


def _extra_json(extra: Mapping[str, Any] | None) -> dict[str, Any]:
    if extra is None:
        return {}
    if not isinstance(extra, Mapping):
        raise InvalidRequestError(f"checkpoint extra must be a JSON object, got {type(extra).__name__}")
    try:
        return json.loads(json.dumps(dict(extra), allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(f"checkpoint extra must be JSON-serialisable: {exc}") from None


def _compact(tensor: Tensor) -> Tensor:
    """``tensor`` alone in its storage: torch.save writes a view's whole storage otherwise."""
    tensor = tensor.detach()
    if tensor.is_contiguous() and tensor.untyped_storage().nbytes() == tensor.nbytes:
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


def _write_shard(path: Path, state: ShardState) -> str:
    """Writes one shard's file; returns its SHA-256."""
    payload = {
        "value": _compact(state.value),
        "slots": {name: _compact(slot) for name, slot in state.slots.items()},
        "applied_keys": [str(key) for key in state.applied_keys],
    }
    return integrity.write_hashed(path, lambda file: torch.save(payload, file))


def _write_contents(
    directory: Path, groups: dict[str, list[ShardState]], extra: dict[str, Any], needs: Sequence[str]
) -> None:
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        integrity.INTEGRITY_KEY: integrity.INTEGRITY,
        "extra": extra,
        "variables": {},
    }
    if needs:
        manifest["needs"] = list(needs)
    for index, (name, group) in enumerate(groups.items()):
        names = [_file_name(index, name, state.ref.shard) for state in group]
        files = [(file, _write_shard(directory / file, state)) for state, file in zip(group, names)]
        manifest["variables"][name] = _variable_manifest(group, files)
    text = json.dumps(manifest, indent=1, sort_keys=True).encode()
    write_new_file(directory / MANIFEST, lambda file: file.write(text))
    fsync_dir(directory)


def _checkpoint_numbers(root: Path) -> dict[int, Path]:
    numbers: dict[int, Path] = {}
    for child in root.iterdir() if root.is_dir() else ():
        match = _CHECKPOINT_NAME.match(child.name)
        if match and child.is_dir() and not child.is_symlink():  # a save renames a real directory
            numbers[int(match.group(1))] = child
    return numbers


def _commit(root: Path, staged: Path) -> Path:
    """Renames ``staged`` to the next free ``ckpt-<N>``: the moment the checkpoint exists."""
    number = max(_checkpoint_numbers(root), default=0) + 1
    while True:
        final = root / f"ckpt-{number:08d}"
        try:
            os.rename(staged, final)
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            number += 1  # another saver took this number first
            continue
        fsync_dir(root)
        return final


def _write_latest(root: Path, name: str) -> None:
    atomic_write(root / LATEST, lambda file: file.write(f"{name}\n".encode()))


def _needed(paths: Sequence[Path]) -> set[str]:
    """The names of the checkpoints that ``paths`` need (unreadable manifests need nothing)."""
    names: set[str] = set()
    for path in paths:
        try:
            names.update(read_manifest(path).needs)
        except CheckpointError:
            continue
    return names


def _prune(root: Path, keep: int, current: Path) -> None:
    """Deletes all but the newest ``keep`` checkpoints and those they need (best effort: the
    save has committed)."""
    if keep == 0:
        return
    numbers = sorted(_checkpoint_numbers(root).items())
    needed = _needed([path for _, path in numbers[-keep:]])
    for _, path in numbers[:-keep]:
        if path == current or path.name in needed:
            continue
        trash = root / f".trash-{uuid.uuid4().hex}"
        try:
            os.rename(path, trash)  # atomic: no half-deleted ckpt-N is ever visible
            shutil.rmtree(trash, ignore_errors=True)
        except OSError as exc:
            logger.warning("could not prune checkpoint %s: %s", path, exc)


LOCK = ".lock"
_LEFTOVER_PREFIXES = (TEMPORARY_PREFIX, ".trash-")


@contextlib.contextmanager
def _exclusive(root: Path) -> Iterator[None]:
    """Holds ``root/.lock`` exclusively: one saver or sweeper of ``root`` at a time (across processes)."""
    with open(root / LOCK, "a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _sweep_locked(root: Path) -> int:
    removed = 0
    for child in root.iterdir():
        if child.name.startswith(_LEFTOVER_PREFIXES):
            shutil.rmtree(child, ignore_errors=True) if child.is_dir() and not child.is_symlink() else child.unlink(
                missing_ok=True
            )
            removed += 1
    if removed:
        logger.info("removed %d leftovers of interrupted checkpoint saves under %s", removed, root)
    return removed


def sweep_leftovers(root: Path) -> int:
    """Deletes what interrupted saves left under ``root`` (staging directories, temporary files,
    half-pruned checkpoints); returns how many entries. Saves in progress are waited for."""
    root = Path(root)
    if not root.is_dir():
        return 0
    try:
        with _exclusive(root):
            return _sweep_locked(root)
    except OSError as exc:  # e.g. a read-only mount: restoring from it still works
        logger.info("did not sweep %s: %s", root, exc)
        return 0


def save_checkpoint(
    root: Path,
    states: Sequence[ShardState],
    *,
    extra: Mapping[str, Any] | None = None,
    keep: int = 0,
    before_commit: Callable[[], None] | None = None,
    require_whole: bool = False,
    add_files: Callable[[Path], Mapping[str, Any]] | None = None,
    needs: Sequence[str] = (),
) -> Path:
    """Writes ``states`` as a new checkpoint under ``root`` and returns its directory.

    ``extra`` is a JSON object stored in the manifest (e.g. the training
    step). ``keep`` > 0 deletes all but the newest ``keep`` checkpoints after
    the commit; 0 keeps all. ``before_commit`` runs after every file is
    written and before the commit (tests raise from it to simulate a crash).
    Raises InvalidRequestError for bad arguments and CheckpointError for
    states that do not fit together or a filesystem failure; on any error
    the previous checkpoint and LATEST are untouched and nothing is left behind.
    ``require_whole``: every variable's shards must cover all its rows (a coordinator's
    checkpoint of the whole model; a server's own save holds only its shards).
    ``add_files(staged)`` writes more files into the checkpoint before it is committed (the
    dynamic tables: psserver/checkpoint/dynamic_checkpoint.py) and returns entries for ``extra``.
    ``needs``: older checkpoints of ``root`` (names) the new one cannot be restored without;
    CheckpointBaseMissingError, before anything is written, when one of them is not whole.
    """
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
        raise InvalidRequestError(f"keep must be an int >= 0 (0 keeps every checkpoint), got {keep!r}")
    groups = _group_by_variable(states)
    if require_whole:
        _check_whole(groups)
    extra_json = _extra_json(extra)
    root = Path(root)
    try:
        root.mkdir(parents=True, exist_ok=True)
        with _exclusive(root):
            _sweep_locked(root)  # what an interrupted save left
            missing = [name for name in needs if not (_CHECKPOINT_NAME.match(name) and _whole_alone(root / name))]
            if missing:
                raise CheckpointBaseMissingError(
                    f"cannot write a checkpoint that needs {missing[0]} under {root}: it is gone or not whole"
                )
            staged = root / f"{TEMPORARY_PREFIX}{uuid.uuid4().hex}"
            staged.mkdir()
            try:
                added = dict(add_files(staged)) if add_files is not None else {}
                _write_contents(staged, groups, {**extra_json, **_extra_json(added)}, needs)
                if before_commit is not None:
                    before_commit()
                final = _commit(root, staged)
            except BaseException:
                shutil.rmtree(staged, ignore_errors=True)
                raise
            _write_latest(root, final.name)
            _prune(root, keep, final)
    except OSError as exc:
        raise CheckpointError(f"cannot write a checkpoint under {root}: {exc}") from exc
    return final


# ---------------------------------------------------------------------------
# Finding and reading


def delete_checkpoints(root: Path) -> None:
    """Deletes every checkpoint under ``root``, its LATEST and leftovers of interrupted saves,
    then ``root`` itself if nothing else is in it."""
    root = Path(root)
    if not root.is_dir():
        return
    for child in root.iterdir():
        if _CHECKPOINT_NAME.match(child.name) or child.name.startswith(_LEFTOVER_PREFIXES):
            shutil.rmtree(child, ignore_errors=True) if child.is_dir() else child.unlink(missing_ok=True)
    (root / LATEST).unlink(missing_ok=True)
    (root / LOCK).unlink(missing_ok=True)
    try:
        root.rmdir()
    except OSError:
        pass  # something else lives there


def list_checkpoints(root: Path) -> list[Path]:
    """The whole checkpoints under ``root`` (see ``is_whole``), oldest first."""
    return [path for _, path in sorted(_checkpoint_numbers(Path(root)).items()) if is_whole(path)]


def latest_checkpoint(root: Path) -> Path | None:
    """The checkpoint LATEST names when it is whole, else the newest whole one, else None.

    A checkpoint that LATEST names may still not be whole: one written by a version that did
    not check its shards, or damaged on disk since. Restores skip it for the one before."""
    root = Path(root)
    try:
        name = (root / LATEST).read_text().strip()
    except OSError:
        name = ""
    if _CHECKPOINT_NAME.match(name) and not (root / name).is_symlink() and is_whole(root / name):
        return root / name
    whole = list_checkpoints(root)
    return whole[-1] if whole else None


def is_whole(path: Path) -> bool:
    """Whether the checkpoint at ``path`` can be restored whole: its manifest reads, every
    variable's saved shards cover each of its rows exactly once, every shard file exists, and so
    do the checkpoints it needs."""
    return _whole_alone(Path(path)) and not missing_bases(Path(path))


def missing_bases(path: Path) -> list[str]:
    """The checkpoints that the checkpoint at ``path`` needs and that are gone or not whole
    (each must be an older sibling: ``ckpt-<N>`` with a smaller N)."""
    try:
        manifest = read_manifest(Path(path))
    except CheckpointError:
        return []
    return [name for name in manifest.needs if not is_base(manifest.path, name)]


def is_base(path: Path, name: str) -> bool:
    """Whether ``name`` names a whole checkpoint that the checkpoint at ``path`` may need: an
    older sibling ``ckpt-<N>`` (a real directory beside it, not a symbolic link)."""
    own, match = _CHECKPOINT_NAME.match(path.name), _CHECKPOINT_NAME.match(name)
    base = path.parent / name
    return bool(
        own and match and int(match.group(1)) < int(own.group(1)) and not base.is_symlink() and _whole_alone(base)
    )


def why_not_whole(path: Path) -> str | None:
    """Why the checkpoint at ``path`` cannot be restored whole (None: it can), naming the file
    or the rows: ``is_whole``'s checks, with the reason of the first that fails."""
    problem = _problem_alone(Path(path))
    if problem is None and (missing := missing_bases(Path(path))):
        problem = f"it needs {', '.join(missing)}, gone or not whole"
    return problem


def _whole_alone(path: Path) -> bool:
    return _problem_alone(path) is None


def _problem_alone(path: Path) -> str | None:
    try:
        manifest = read_manifest(path)
    except CheckpointError as error:
        return str(error)
    if manifest.path != path:
        return f"{path} holds no {MANIFEST}"
    for name, entry in manifest.variables.items():
        if gaps(entry):
            return f"variable {name!r}: rows {gaps(entry)} are missing or doubled"
        for saved in entry.shards:
            if (problem := integrity.file_problem(manifest.path, saved.file)) is not None:
                return problem
    return None


def gaps(entry: VariableEntry) -> list[tuple[int, int]]:
    """The row ranges ``[start, stop)`` of ``entry`` that no saved shard holds, or that two hold
    (a shard lost from a save, or one saved twice); empty for a whole variable."""
    problems: list[tuple[int, int]] = []
    cursor = 0
    for saved in entry.shards:  # sorted by row_start
        if saved.row_start != cursor:
            problems.append((min(cursor, saved.row_start), max(cursor, saved.row_start)))
        cursor = max(cursor, saved.row_stop)
    if cursor != entry.num_rows:
        problems.append((min(cursor, entry.num_rows), max(cursor, entry.num_rows)))
    return problems


def resolve(path: Path) -> Path:
    """``path`` if it is a checkpoint, else the latest checkpoint of the root ``path``.

    Raises CheckpointError saying what is missing when it is neither.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint path {path} does not exist; {_WHAT_A_CHECKPOINT_IS}")
    if (path / MANIFEST).is_file():
        return path
    found = latest_checkpoint(path) if path.is_dir() else None
    if found is None:
        newest = max(_checkpoint_numbers(path).items(), default=None)
        why = f" (the newest, {newest[1].name}, is not whole: {why_not_whole(newest[1])})" if newest else ""
        raise CheckpointError(
            f"{path} is not a checkpoint: it has no {MANIFEST} and no complete ckpt-NNNNNNNN/ directory{why}; "
            f"{_WHAT_A_CHECKPOINT_IS}"
        )
    return found


def _parse_shard(raw: Mapping[str, Any], hashed: bool) -> SavedShard:
    digest = raw.get(integrity.HASH_KEY)
    if hashed and not isinstance(digest, str):
        raise ValueError(f"shard file {raw.get('file')!r} has no SHA-256, though the manifest hashes its files")
    return SavedShard(
        shard=int(raw["shard"]),
        row_start=int(raw["row_start"]),
        num_rows=int(raw["num_rows"]),
        file=raw["file"],  # checked where it is read (integrity.file_problem)
        version=int(raw["version"]),
        sha256=digest if hashed else None,
    )


def _parse_variable(raw: Mapping[str, Any], hashed: bool) -> VariableEntry:
    optimizer = raw["optimizer"]
    return VariableEntry(
        variable_shape=tuple(int(dim) for dim in raw["variable_shape"]),
        dtype=dtype_from_name(raw["dtype"]),
        optimizer=None if optimizer is None else OptimizerSpec(optimizer["name"], optimizer["kwargs"]),
        shards=tuple(sorted((_parse_shard(shard, hashed) for shard in raw["shards"]), key=lambda s: s.row_start)),
    )


def read_manifest(path: Path) -> Manifest:
    """The manifest of the checkpoint at ``path`` (or of the latest one under the root ``path``)."""
    path = resolve(path)
    try:
        raw = json.loads(integrity.read_bytes(path, MANIFEST, "manifest"))
        if raw.get("format") != FORMAT or raw.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(
                f"{path / MANIFEST} has format {raw.get('format')!r} version {raw.get('format_version')!r}; "
                f"this version of paramserve reads {FORMAT!r} version {FORMAT_VERSION}"
            )
        hashed = raw.get(integrity.INTEGRITY_KEY) is not None
        if hashed and raw[integrity.INTEGRITY_KEY] != integrity.INTEGRITY:
            raise CheckpointError(
                f"{path / MANIFEST} hashes its files with {raw[integrity.INTEGRITY_KEY]!r}, not sha256"
            )
        entries = {str(name): _parse_variable(entry, hashed) for name, entry in raw["variables"].items()}
        needs = tuple(str(name) for name in raw.get("needs") or ())
        return Manifest(path, FORMAT_VERSION, entries, dict(raw.get("extra") or {}), needs, hashed)
    except CheckpointError:
        raise
    except RecursionError:  # a hostile manifest nested too deeply for the JSON reader
        raise CheckpointError(
            f"{path / MANIFEST} nests too deeply to be a manifest; it is not a paramserve checkpoint"
        ) from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError, ParamServeError) as exc:
        raise CheckpointError(f"{path / MANIFEST} is unreadable or malformed: {exc!r}") from None


def variables(path: Path) -> dict[str, VariableEntry]:
    """The variables saved in the checkpoint at ``path`` (or the latest under it)."""
    return dict(read_manifest(path).variables)


# ---------------------------------------------------------------------------
# Restoring by rows


@dataclass(frozen=True)
class _Piece:
    """Local rows ``[lo, hi)`` of one saved shard, as loaded."""

    saved: SavedShard
    lo: int
    hi: int
    contents: Mapping[str, Any]


def _cover(entry: VariableEntry, start: int, stop: int, variable: str) -> list[tuple[SavedShard, int, int]]:
    """Saved shards and their local row slices that together hold rows ``[start, stop)``."""
    pieces: list[tuple[SavedShard, int, int]] = []
    cursor = start
    while cursor < stop:
        holder = next((saved for saved in entry.shards if saved.row_start <= cursor < saved.row_stop), None)
        if holder is None:
            held = ", ".join(f"[{saved.row_start}, {saved.row_stop})" for saved in entry.shards) or "none"
            raise CheckpointError(
                f"row {cursor} is not in the checkpoint (it holds rows {held}); restore from a checkpoint "
                "saved by every server that held the variable",
                variable=variable,
            )
        hi = min(stop, holder.row_stop)
        pieces.append((holder, cursor - holder.row_start, hi - holder.row_start))
        cursor = hi
    return pieces


def _expected_shape(entry: VariableEntry, saved: SavedShard) -> tuple[int, ...]:
    return (saved.num_rows, *entry.variable_shape[1:]) if entry.variable_shape else ()


def _load_shard_file(manifest: Manifest, entry: VariableEntry, saved: SavedShard) -> Mapping[str, Any]:
    """A saved shard's file once it is confined, matches its hash and holds what the manifest says."""
    path = manifest.path / str(saved.file)
    if saved.sha256 is None:
        integrity.warn_unhashed(manifest.path)
    contents = integrity.load_file(manifest.path, saved.file, saved.sha256, "shard file")
    contents = contents if isinstance(contents, dict) else {}
    value, slots, keys = contents.get("value"), contents.get("slots"), contents.get("applied_keys", [])
    if not (
        isinstance(value, Tensor)
        and isinstance(slots, dict)
        and all(isinstance(k, str) and isinstance(v, Tensor) for k, v in slots.items())
        and isinstance(keys, list)
        and all(isinstance(key, str) for key in keys)
    ):
        raise CheckpointError(f"shard file {path} holds no value, slots and keys; it is not a paramserve shard file")
    if value.dtype != entry.dtype or tuple(value.shape) != _expected_shape(entry, saved):
        raise CheckpointError(
            f"shard file {path} holds a {value.dtype} tensor of shape {tuple(value.shape)}; the manifest says "
            f"{entry.dtype} {_expected_shape(entry, saved)}"
        )
    return contents


def _is_row_slot(slot: Tensor, value: Tensor) -> bool:
    return value.dim() >= 1 and slot.shape == value.shape


def _slice(tensor: Tensor, piece: _Piece) -> Tensor:
    return tensor[piece.lo : piece.hi] if tensor.dim() else tensor


def _row_slot(name: str, pieces: list[_Piece]) -> Tensor:
    """Slot ``name`` for the new rows; rows from a shard that had none yet get zeros (lazy init)."""
    template = next(p.contents["slots"][name] for p in pieces if name in p.contents["slots"])
    parts = [
        _slice(p.contents["slots"][name], p)
        if name in p.contents["slots"]
        else torch.zeros((p.hi - p.lo, *template.shape[1:]), dtype=template.dtype)
        for p in pieces
    ]
    return torch.cat(parts)


def _merge_slots(pieces: list[_Piece]) -> dict[str, Tensor]:
    """Row slots sliced and concatenated; shared slots from the piece holding the first row."""
    slots: dict[str, Tensor] = {}
    for piece in pieces:
        for name, slot in piece.contents["slots"].items():
            if name in slots:
                continue
            if _is_row_slot(slot, piece.contents["value"]):
                slots[name] = _row_slot(name, pieces)
            else:
                slots[name] = slot.clone()
    return slots


def _merge_keys(pieces: list[_Piece]) -> list[str]:
    """The union of the pieces' windows, the newest shard's keys last, each key once."""
    merged: dict[str, None] = {}
    for piece in sorted(pieces, key=lambda p: p.saved.version):
        for key in piece.contents.get("applied_keys", []):
            merged.pop(key, None)
            merged[key] = None
    return list(merged)


def _merge_values(entry: VariableEntry, pieces: list[_Piece]) -> Tensor:
    if not entry.variable_shape:
        return pieces[0].contents["value"].clone()
    if not pieces:
        return torch.empty((0, *entry.variable_shape[1:]), dtype=entry.dtype)
    return torch.cat([_slice(p.contents["value"], p) for p in pieces])


def _check_range(entry: VariableEntry, row_start: int, num_rows: int, variable: str) -> None:
    if row_start < 0 or num_rows < 0 or row_start + num_rows > entry.num_rows:
        raise CheckpointError(
            f"rows [{row_start}, {row_start + num_rows}) are outside the saved variable's {entry.num_rows} rows",
            variable=variable,
        )
    if not entry.variable_shape and (row_start, num_rows) != (0, 1):
        raise CheckpointError("a 0-d variable is restored whole: row_start=0, num_rows=1", variable=variable)


def load_rows(path: Path, variable: str, row_start: int, num_rows: int, ref: ShardRef) -> ShardState:
    """The state of a new shard ``ref`` holding rows ``[row_start, row_start + num_rows)``.

    Values and row-shaped slots come from the saved shards overlapping the
    rows; shared slots (e.g. Adam's ``step``) from the saved shard holding
    ``row_start``; the version is the largest among them and the applied
    keys their union. Raises CheckpointError when the variable or any row is
    not in the checkpoint.
    """
    manifest = read_manifest(path)
    entry = manifest.variables.get(variable)
    if entry is None:
        raise CheckpointError(
            f"the variable is not in checkpoint {manifest.path}; it holds {sorted(manifest.variables)}",
            variable=variable,
        )
    _check_range(entry, row_start, num_rows, variable)
    pieces = [
        _Piece(saved, lo, hi, _load_shard_file(manifest, entry, saved))
        for saved, lo, hi in _cover(entry, row_start, row_start + num_rows, variable)
    ]
    state = ShardState(
        ref=ref,
        variable_shape=entry.variable_shape,
        row_start=row_start,
        value=_merge_values(entry, pieces),
        optimizer=entry.optimizer,
        slots=_merge_slots(pieces),
        version=max((p.saved.version for p in pieces), default=0),
        applied_keys=_merge_keys(pieces),
    )
    try:  # what a server checks before it takes a shard: a restore then fails on none of them
        check_restorable(state)
    except ParamServeError as error:
        raise CheckpointError(
            f"checkpoint {manifest.path} cannot be restored: {error.message}", variable=variable
        ) from None
    return state
