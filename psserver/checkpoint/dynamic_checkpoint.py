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
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

import torch
from google.protobuf import json_format

from paramserve.psserver.checkpoint import shard_files as checkpoint
from paramserve.psserver.checkpoint.dynamic_chain import SavedTable, apply_delta, restore_chain
from paramserve.psserver.dynamic.dynamic_types import DynamicShardState
from paramserve.psserver.dynamic.dynamic_wire import config_from_proto, config_to_proto
from paramserve.psserver.protocol.errors import CheckpointError
from paramserve.psserver.protocol.types import ShardRef
from paramserve.psserver.runtime.atomic_files import write_new_file
from paramserve.wire.v1 import tensor_pb2

__all__ = ["EXTRA_KEY", "read_tables", "table_names", "write_tables"]

EXTRA_KEY = "dynamic_tables"


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
    """Writes each shard's rows (whole, or a delta of checkpoint ``parent``) under ``directory``;
    returns the manifest entry (JSON)."""
    tables: dict[str, Any] = {}
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
            entry["parent"] = parent
        name = _file_name(len(tables) - 1, state.ref.variable, state.ref.shard)
        write_new_file(directory / name, functools.partial(_save, _payload(state)))
        entry["files"].append(
            {
                "shard": state.ref.shard,
                "file": name,
                "delta": state.delta,
                "lineage": state.lineage,
                "through": int(state.through),
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
    CheckpointBaseMissingError when one of those is gone, CheckpointError for unreadable files."""
    tables: dict[str, list[DynamicShardState]] = {}
    for table in table_names(extra):
        if names is not None and table not in names:
            continue
        try:
            entries = _chain_entries(path, extra, table)
            saved = {name: None if entry is None else _saved_table(entry) for name, entry in entries.items()}
            states: list[DynamicShardState] = []
            for name in restore_chain(table, path.name, saved):
                entry = entries[name]
                assert entry is not None  # restore_chain checked it
                loaded = _load(path.parent / name, table, entry)
                states = [apply_delta(base, state) for base, state in zip(states, loaded)] if states else loaded
        except (KeyError, TypeError, ValueError, OSError, RuntimeError, json_format.ParseError) as err:
            raise CheckpointError(f"dynamic table {table!r} in {path} cannot be read: {err}") from err
        tables[table] = states
    return tables


def _chain_entries(path: Path, extra: Mapping[str, Any], table: str) -> dict[str, Mapping[str, Any] | None]:
    """The table's manifest entry in ``path`` and in each checkpoint its deltas go back through
    (None: that checkpoint lacks the table; a checkpoint missing or unreadable is left out)."""
    entries: dict[str, Mapping[str, Any] | None] = {}
    name, listing = path.name, extra
    while name not in entries:
        entry = (listing.get(EXTRA_KEY) or {}).get(table)
        entries[name] = entry
        parent = entry.get("parent") if entry is not None else None
        if parent is None:
            break
        try:
            listing = checkpoint.read_manifest(path.parent / str(parent)).extra
        except CheckpointError:
            break
        name = str(parent)
    return entries


def _saved_table(entry: Mapping[str, Any]) -> SavedTable:
    files = entry["files"]
    return SavedTable(
        num_shards=int(entry["num_shards"]),
        shards=frozenset(int(item["shard"]) for item in files),
        delta_shards=frozenset(int(item["shard"]) for item in files if item.get("delta")),
        parent=None if entry.get("parent") is None else str(entry["parent"]),
    )


def _load(path: Path, table: str, entry: Mapping[str, Any]) -> list[DynamicShardState]:
    """One checkpoint's files of a table, by shard (deltas as deltas)."""
    config = config_from_proto(json_format.ParseDict(entry["config"], tensor_pb2.DynamicTableConfig()))
    states = []
    for item in sorted(entry["files"], key=lambda item: int(item["shard"])):
        saved = torch.load(path / item["file"], weights_only=True)
        delta = bool(item.get("delta"))
        states.append(
            DynamicShardState(
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
        )
    return states
