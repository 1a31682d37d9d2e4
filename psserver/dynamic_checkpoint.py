"""Dynamic tables in a checkpoint directory: only their live rows, one file per saved shard.

Written into the checkpoint's staging directory before it is committed (so a dynamic table is
in a checkpoint whole or the checkpoint does not exist), and listed in the manifest's ``extra``
under ``dynamic_tables``: per table, its settings (the DynamicTableConfig message as JSON), the
number of shards it was saved from and its files. Each file is ``torch.save`` of the shard's
ids (sorted), values, row-shaped slots, shared optimizer state, last-update steps, version and
idempotency keys. A restore reads every file of a table and moves rows to the servers they
belong to now (``dynamic_types.rehash``), so 2 servers' tables restore onto 3.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

import torch
from google.protobuf import json_format

from paramserve.psserver.atomic_files import write_new_file
from paramserve.psserver.dynamic_types import DynamicShardState
from paramserve.psserver.dynamic_wire import config_from_proto, config_to_proto
from paramserve.psserver.errors import CheckpointError
from paramserve.psserver.types import ShardRef
from paramserve.wire.v1 import tensor_pb2

__all__ = ["EXTRA_KEY", "read_tables", "write_tables"]

EXTRA_KEY = "dynamic_tables"


def _file_name(index: int, table: str, shard: int) -> str:
    return f"dynamic-{index:04d}-{quote(table, safe='')}.shard-{shard}.pt"


def _save(payload: dict[str, Any], file: Any) -> None:
    torch.save(payload, file)


def write_tables(directory: Path, states: Sequence[DynamicShardState]) -> dict[str, Any]:
    """Writes each shard's live rows under ``directory``; returns the manifest entry (JSON)."""
    tables: dict[str, Any] = {}
    for state in sorted(states, key=lambda s: s.ref):
        entry = tables.get(state.ref.variable)
        if entry is None:
            entry = tables[state.ref.variable] = {
                "num_shards": state.num_shards,
                "config": json_format.MessageToDict(config_to_proto(state.config)),
                "files": [],
            }
        name = _file_name(len(tables) - 1, state.ref.variable, state.ref.shard)
        payload = {
            "ids": state.ids.clone(),
            "values": state.values.clone(),
            "updated": state.updated.clone(),
            "slots": {key: value.clone() for key, value in state.slots.items()},
            "shared": {key: value.clone() for key, value in state.shared.items()},
            "version": int(state.version),
            "applied_keys": list(state.applied_keys),
        }
        write_new_file(directory / name, functools.partial(_save, payload))
        entry["files"].append({"shard": state.ref.shard, "file": name})
    for table, entry in tables.items():
        if sorted(f["shard"] for f in entry["files"]) != list(range(entry["num_shards"])):
            raise CheckpointError(f"dynamic table {table!r} is missing shards: a checkpoint holds every one")
    return tables


def read_tables(path: Path, extra: Mapping[str, Any]) -> dict[str, list[DynamicShardState]]:
    """The dynamic tables a checkpoint holds, as saved (one state per saved shard)."""
    tables: dict[str, list[DynamicShardState]] = {}
    for table, entry in dict(extra.get(EXTRA_KEY) or {}).items():
        try:
            config = config_from_proto(json_format.ParseDict(entry["config"], tensor_pb2.DynamicTableConfig()))
            states = []
            for item in entry["files"]:
                saved = torch.load(path / item["file"], weights_only=True)
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
                    )
                )
        except (KeyError, TypeError, ValueError, OSError, RuntimeError, json_format.ParseError) as err:
            raise CheckpointError(f"dynamic table {table!r} in {path} cannot be read: {err}") from err
        tables[table] = states
    return tables
