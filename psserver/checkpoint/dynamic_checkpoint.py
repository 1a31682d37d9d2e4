"""Dynamic tables in a checkpoint directory: only their live rows, one file per saved shard,
whole or as a delta of an older checkpoint (incremental checkpoints: psserver/checkpoint/dynamic_chain.py).

Written into the checkpoint's staging directory before it is committed (so a dynamic table is
in a checkpoint whole or the checkpoint does not exist), and listed in the manifest's ``extra``
under ``dynamic_tables``: per table, its settings (the DynamicTableConfig message as JSON), the
number of shards it was saved from, its files (each with ``delta``, and the shard's lineage and
mark at the export) and, when a file is a delta, its ``parent`` (the checkpoint it is a delta
of; the manifest's ``needs`` lists every checkpoint the chain goes through). Each file is
``torch.save`` of the shard's ids (sorted), values, row-shaped slots, shared optimizer state,
last-update steps, version and idempotency keys, and for a delta the ids deleted since its
parent. A restore reads the table's chain (the last whole save, then each delta in order), then
moves rows to the servers they belong to now (``dynamic_types.rehash``), so 2 servers' tables
restore onto 3.

Each file's SHA-256 is in the manifest, and a table saved as deltas names its parent by the
SHA-256 of the parent's manifest (``parent_sha256``); a delta of a shard names the shard's
lineage, which its base's must share. A restore checks every file it reads
(psserver/checkpoint/integrity.py: confined, hashed), every link of the chain, and every tensor
(dtypes, shapes, ids sorted, distinct and the shard's), and raises CheckpointError naming the
file before its caller changes anything.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import torch
from google.protobuf import json_format

from paramserve.psserver.checkpoint import integrity
from paramserve.psserver.checkpoint import shard_files as checkpoint
from paramserve.psserver.checkpoint.dynamic_chain import SavedTable, apply_delta, restore_chain
from paramserve.psserver.dynamic.dynamic_rows import owner_of
from paramserve.psserver.dynamic.dynamic_types import DynamicShardState
from paramserve.psserver.dynamic.dynamic_wire import config_from_proto, config_to_proto
from paramserve.psserver.protocol.errors import CheckpointError, ParamServeError
from paramserve.psserver.protocol.types import ShardRef
from paramserve.psserver.store import dynamic_table
from paramserve.wire.v1 import tensor_pb2

__all__ = ["EXTRA_KEY", "check_restorable", "read_tables", "table_names", "write_tables"]

EXTRA_KEY = "dynamic_tables"
PARENT_HASH_KEY = "parent_sha256"
"""A table entry's link to its parent: the SHA-256 of the parent checkpoint's manifest."""


def _file_name(index: int, table: str, shard: int) -> str:
    return f"dynamic-{index:04d}-{quote(table, safe='')}.shard-{shard}.pt"


def _save(payload: dict[str, Any], file: Any) -> None:
    torch.save(payload, file)


def _payload(state: DynamicShardState) -> dict[str, Any]:
    payload = {
        "ids": state.ids.clone(),
        "values": state.values.clone(),
        "updated": state.updated.clone(),
        "slots": {key: value.clone() for key, value in state.slots.items()},
        "shared": {key: value.clone() for key, value in state.shared.items()},
        "version": int(state.version),
        "applied_keys": list(state.applied_keys),
    }
    if state.delta:
        payload["deleted"] = state.deleted.clone()
    return payload


def write_tables(directory: Path, states: Sequence[DynamicShardState], parent: str | None = None) -> dict[str, Any]:
    """Writes each shard's rows (whole, or a delta of checkpoint ``parent``, a sibling of
    ``directory``) under ``directory``; returns the manifest entry (JSON)."""
    tables: dict[str, Any] = {}
    parent_hash = None
    for state in sorted(states, key=lambda s: s.ref):
        entry = tables.get(state.ref.variable)
        if entry is None:
            entry = tables[state.ref.variable] = {
                "num_shards": state.num_shards,
                "config": json_format.MessageToDict(config_to_proto(state.config)),
                "files": [],
            }
        if state.delta:
            if parent is None:
                raise CheckpointError(f"a delta of dynamic table {state.ref.variable!r} needs the checkpoint it is of")
            if parent_hash is None:  # the parent as it is on disk: a delta extends that one only
                parent_hash = integrity.file_hash(directory.parent / parent, checkpoint.MANIFEST, "manifest")
            entry["parent"], entry[PARENT_HASH_KEY] = parent, parent_hash
        name = _file_name(len(tables) - 1, state.ref.variable, state.ref.shard)
        digest = integrity.write_hashed(directory / name, functools.partial(_save, _payload(state)))
        entry["files"].append(
            {
                "shard": state.ref.shard,
                "file": name,
                "delta": state.delta,
                "lineage": state.lineage,
                "through": int(state.through),
                integrity.HASH_KEY: digest,
            }
        )
    for table, entry in tables.items():
        if sorted(f["shard"] for f in entry["files"]) != list(range(entry["num_shards"])):
            raise CheckpointError(f"dynamic table {table!r} is missing shards: a checkpoint holds every one")
    return tables


def table_names(extra: Mapping[str, Any]) -> list[str]:
    """The dynamic tables a checkpoint's manifest ``extra`` lists."""
    tables = extra.get(EXTRA_KEY) or {}
    return sorted(tables) if isinstance(tables, Mapping) else []


def read_tables(
    path: Path, extra: Mapping[str, Any], names: Collection[str] | None = None
) -> dict[str, list[DynamicShardState]]:
    """The dynamic tables (of ``names``; all for None) that checkpoint ``path`` holds, whole
    (one state per saved shard): its deltas applied to the checkpoints they need. Raises
    CheckpointBaseMissingError when one of those is gone, CheckpointError for a file that is
    not confined, damaged, of another chain, or holds tensors that do not fit the table."""
    tables: dict[str, list[DynamicShardState]] = {}
    for table in table_names(extra):
        if names is not None and table not in names:
            continue
        try:
            entries = _chain_entries(path, extra, table)
            saved = {name: None if link is None else _saved_table(link.entry) for name, link in entries.items()}
            states: list[DynamicShardState] = []
            for name in restore_chain(table, path.name, saved):
                link = entries[name]
                assert link is not None  # restore_chain checked it
                loaded = _load(path.parent / name, table, link)
                states = [_applied(base, state) for base, state in zip(states, loaded)] if states else loaded
            _check_table(table, path, states)
        except CheckpointError:
            raise
        except (KeyError, TypeError, ValueError, OSError, RuntimeError, json_format.ParseError, ParamServeError) as err:
            raise CheckpointError(f"dynamic table {table!r} in {path} cannot be read: {err!r}") from err
        tables[table] = states
    return tables


@dataclass(frozen=True)
class _Link:
    """A table as one checkpoint of its chain lists it, and whether that manifest hashes its files."""

    entry: Mapping[str, Any]
    hashed: bool


def _chain_entries(path: Path, extra: Mapping[str, Any], table: str) -> dict[str, _Link | None]:
    """The table's manifest entry in ``path`` and in each checkpoint its deltas go back through
    (None: that checkpoint lacks the table; a checkpoint gone, unreadable, or not a whole older
    sibling is left out). Raises CheckpointError for a parent that is not the one the delta
    extends (its manifest's SHA-256 differs: a delta of another run or chain)."""
    entries: dict[str, _Link | None] = {}
    name, directory, listing = path.name, path, extra
    hashed = checkpoint.read_manifest(path).hashed
    while name not in entries:
        entry = (listing.get(EXTRA_KEY) or {}).get(table)
        entries[name] = None if entry is None else _Link(entry, hashed)
        parent = entry.get("parent") if entry is not None else None
        if entry is None or parent is None:
            break
        if not checkpoint.is_base(directory, str(parent)):
            break  # restore_chain says it is gone
        _check_parent(table, directory, entry, hashed)
        directory = directory.parent / str(parent)
        manifest = checkpoint.read_manifest(directory)
        name, listing, hashed = str(parent), manifest.extra, manifest.hashed
    return entries


def _check_parent(table: str, directory: Path, entry: Mapping[str, Any], hashed: bool) -> None:
    parent = directory.parent / str(entry["parent"])
    expected = entry.get(PARENT_HASH_KEY)
    if expected is None and not hashed:
        integrity.warn_unhashed(directory)  # written before deltas named their parent's hash
        return
    if not isinstance(expected, str):
        raise CheckpointError(f"dynamic table {table!r} in {directory} names its parent {parent.name} without a hash")
    actual = integrity.file_hash(parent, checkpoint.MANIFEST, "manifest")
    if actual != expected:
        raise CheckpointError(
            f"dynamic table {table!r} in {directory} is a delta of another {parent.name} than {parent} "
            f"(its manifest's SHA-256 is {actual[:16]}…, the delta extends {str(expected)[:16]}…): a delta of "
            "another run or chain; restore a checkpoint whose chain is all of this directory"
        )


def _saved_table(entry: Mapping[str, Any]) -> SavedTable:
    files = entry["files"]
    return SavedTable(
        num_shards=int(entry["num_shards"]),
        shards=frozenset(int(item["shard"]) for item in files),
        delta_shards=frozenset(int(item["shard"]) for item in files if item.get("delta")),
        parent=None if entry.get("parent") is None else str(entry["parent"]),
    )


def _load(directory: Path, table: str, link: _Link) -> list[DynamicShardState]:
    """One checkpoint's files of a table, by shard (deltas as deltas), each checked."""
    entry = link.entry
    config = config_from_proto(json_format.ParseDict(entry["config"], tensor_pb2.DynamicTableConfig()))
    states = []
    for item in sorted(entry["files"], key=lambda item: int(item["shard"])):
        digest = item.get(integrity.HASH_KEY)
        if digest is None and link.hashed:
            raise CheckpointError(f"dynamic table {table!r}: {item['file']!r} in {directory} has no SHA-256")
        if digest is None:
            integrity.warn_unhashed(directory)
        file = f"dynamic table {table!r} file"
        saved = integrity.load_file(directory, item["file"], digest, file)
        if not isinstance(saved, dict):
            raise CheckpointError(f"{file} {directory / item['file']} holds no rows; it is not a paramserve file")
        delta = bool(item.get("delta"))
        state = DynamicShardState(
            ref=ShardRef(table, int(item["shard"])),
            num_shards=int(entry["num_shards"]),
            config=config,
            ids=saved["ids"],
            values=saved["values"],
            updated=saved["updated"],
            slots=dict(saved["slots"]),
            shared=dict(saved["shared"]),
            version=int(saved["version"]),
            applied_keys=list(saved["applied_keys"]),
            delta=delta,
            deleted=saved["deleted"] if delta else torch.empty(0, dtype=torch.int64),
            lineage=str(item.get("lineage", "")),
            through=int(item.get("through", 0)),
        )
        problem = _file_problem(state)
        if problem is not None:
            raise CheckpointError(f"{file} {directory / item['file']} {problem}; restore another checkpoint")
        states.append(state)
    return states


def _file_problem(state: DynamicShardState) -> str | None:
    """What in one saved shard does not fit its table (None: nothing): tensors of other dtypes or
    shapes, ids not sorted, repeated, or of another shard."""
    ids, n, dim = state.ids, _rows(state.ids), state.config.dim
    tensors = {"values": state.values, "updated": state.updated, "deleted": state.deleted, **state.shared}
    tensors.update({f"slot {key}": value for key, value in state.slots.items()})
    if n is None or ids.dtype != torch.int64 or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
        return "does not hold 1-d int64 ids and tensors"
    if not all(isinstance(key, str) for key in [*state.slots, *state.shared, *state.applied_keys]):
        return "holds keys that are not strings"
    expected = {"values": ((n, dim), state.config.dtype), "updated": ((n,), torch.int64)}
    expected.update({f"slot {key}": ((n, dim), value.dtype) for key, value in state.slots.items()})
    for what, (shape, dtype) in expected.items():
        if tuple(tensors[what].shape) != shape or tensors[what].dtype != dtype:
            return f"holds {what} of {tuple(tensors[what].shape)} {tensors[what].dtype}; {shape} {dtype} expected"
    if n > 1 and not bool((ids[1:] > ids[:-1]).all()):
        repeated = int(n - torch.unique(ids).numel())
        return f"holds ids that are not sorted and distinct ({repeated} repeated)" if repeated else "holds unsorted ids"
    if n and bool((owner_of(ids, state.num_shards) != state.ref.shard).any()):
        return f"holds ids of other shards than shard {state.ref.shard} of {state.num_shards}"
    if state.delta and (_rows(state.deleted) is None or state.deleted.dtype != torch.int64):
        return "holds deleted ids that are not 1-d int64"
    return None


def _rows(tensor: object) -> int | None:
    return int(tensor.shape[0]) if isinstance(tensor, torch.Tensor) and tensor.dim() == 1 else None


def _applied(base: DynamicShardState, delta: DynamicShardState) -> DynamicShardState:
    """``delta`` applied to ``base`` once it extends it: the same shard's lineage, a later export."""
    if delta.delta and (delta.lineage != base.lineage or delta.through <= base.through):
        raise CheckpointError(
            f"dynamic table {delta.ref.variable!r}: the delta of shard {delta.ref.shard} (lineage "
            f"{delta.lineage[:12] or '?'}, export {delta.through}) does not extend its base (lineage "
            f"{base.lineage[:12] or '?'}, export {base.through}): a delta of another run or chain"
        )
    return apply_delta(base, delta)


def _check_table(table: str, path: Path, states: Sequence[DynamicShardState]) -> None:
    """The shards of one table agree on what every row holds (rehash merges them)."""
    kinds = {(frozenset(s.slots), frozenset(s.shared), s.config) for s in states}
    if len(kinds) > 1:
        raise CheckpointError(f"dynamic table {table!r} in {path}: its shards disagree on their settings or slots")


def check_restorable(state: DynamicShardState, path: Path) -> None:
    """Raises CheckpointError unless a server would take ``state``: a whole shard of a table
    read from checkpoint ``path`` and laid out for the servers there are now (``rehash``)."""
    try:
        dynamic_table.check_restorable(state)
    except (ParamServeError, RuntimeError, ValueError, TypeError) as error:
        raise CheckpointError(
            f"dynamic table {state.ref.variable!r} from {path} cannot be restored as shard {state.ref.shard} of "
            f"{state.num_shards}: {getattr(error, 'message', error)}",
            variable=state.ref.variable,
        ) from None
