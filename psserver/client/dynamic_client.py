"""The dynamic tables' control plane, as the client calls it: create a table on every server,
read each shard's statistics, export its live rows (whole, or the changes since a mark),
replace them (a restore), tell the servers a checkpoint was committed. Lookups and row
pushes are steps (psserver/client/ps_client.py: ``pull_unique_rows(dynamic=...)`` and pushes of a
RowGradient by id). ``ParameterServerClient.dynamic`` is one of these."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from paramserve.psserver.client.calls import CallOptions, ServerCalls, Stub
from paramserve.psserver.dynamic.dynamic_types import (
    DynamicSaveMark,
    DynamicShardState,
    DynamicStats,
    DynamicTableConfig,
)
from paramserve.psserver.dynamic.dynamic_wire import (
    config_to_proto,
    mark_to_proto,
    shard_from_part,
    shard_part,
    stats_from_proto,
)
from paramserve.psserver.protocol import convert
from paramserve.psserver.protocol.streams import DEFAULT_CHUNK_BYTES, byte_buffer, encode_parts, read_parts
from paramserve.psserver.protocol.types import ShardRef
from paramserve.wire.v1 import parameter_server_pb2 as ps_pb2

__all__ = ["DynamicTableCalls"]


class DynamicTableCalls:
    """Control-plane calls for dynamic tables over a client's stubs (with its retries and
    deadlines); ``learned`` tells the client which tables it may now read and push by id."""

    def __init__(
        self,
        addresses: Sequence[str],
        stubs: Sequence[Stub],
        calls: ServerCalls,
        options: CallOptions,
        learned: Callable[[Mapping[str, tuple[int, torch.dtype]]], None],
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ):
        self._servers = range(len(addresses))
        self._stubs = stubs
        self._calls = calls
        self._options = options
        self._learned = learned
        self._chunk_bytes = chunk_bytes

    def create(self, name: str, config: DynamicTableConfig) -> list[DynamicStats]:
        """Creates table ``name`` with one shard on every server (a retry keeps it); raises
        VariableExistsError where it exists with other settings. Returns each shard's stats."""
        config.validate()
        message = config_to_proto(config)
        created = self._calls.fan_out(
            {server: None for server in self._servers},
            lambda server, _: self._stubs[server].unary(
                "CreateDynamicTable",
                ps_pb2.CreateDynamicTableRequest(
                    ref=convert.ref_to_proto(ShardRef(name, server)), num_shards=len(self._servers), config=message
                ),
                ps_pb2.DynamicTablesResponse,
                self._options,
            ),
            variable=name,
        )
        self._learned({name: (config.dim, config.dtype)})
        return [stats_from_proto(t) for server in sorted(created) for t in created[server].tables]

    def stats(self, servers: Sequence[int] | None = None) -> dict[int, list[DynamicStats]]:
        """Every dynamic table shard each server (of ``servers``; all for None) holds: live rows,
        admissions, evictions, bytes."""
        replies = self._calls.fan_out(
            {server: None for server in (self._servers if servers is None else servers)},
            lambda server, _: self._stubs[server].unary(
                "ListDynamicTables", ps_pb2.ListDynamicTablesRequest(), ps_pb2.DynamicTablesResponse, self._options
            ),
        )
        return {server: [stats_from_proto(t) for t in reply.tables] for server, reply in replies.items()}

    def export(
        self,
        names: Sequence[str] | None = None,
        *,
        incremental: bool = False,
        since: Mapping[ShardRef, DynamicSaveMark] | None = None,
    ) -> dict[int, list[DynamicShardState]]:
        """Every live row of the tables ``names`` (all for None), by server. ``incremental``:
        the servers keep the ids they evict from now on, for later deltas; a shard with a mark
        in ``since`` that it can answer comes as a delta (only the changes after the mark)."""
        marks = since or {}

        def export(server: int) -> list[DynamicShardState]:
            refs = [convert.ref_to_proto(ShardRef(name, server)) for name in names or ()]
            request = ps_pb2.ExportDynamicTablesRequest(
                refs=refs,
                chunk_bytes=self._chunk_bytes,
                incremental=incremental,
                since=[mark_to_proto(mark) for ref, mark in marks.items() if ref.shard == server],
            )
            stream = self._stubs[server].unary_stream("ExportDynamicTables", request, self._options)
            return [
                shard_from_part(header.dynamic, payload)
                for header, payload in read_parts(stream, lambda h: byte_buffer(h.payload_bytes))
            ]

        return self._calls.fan_out({server: None for server in self._servers}, lambda server, _: export(server))

    def replace(self, states_by_server: Mapping[int, Sequence[DynamicShardState]]) -> None:
        """Makes the servers' shards of these tables exactly ``states_by_server`` (a restore)."""
        self._calls.fan_out(
            dict(states_by_server),
            lambda server, states: self._stubs[server].stream_unary(
                "ReplaceDynamicTables",
                lambda: encode_parts((shard_part(s) for s in states), self._chunk_bytes),
                ps_pb2.DynamicTablesResponse,
                self._options,
            ),
        )
        states = [s for per in states_by_server.values() for s in per]
        self._learned({s.ref.variable: (s.config.dim, s.config.dtype) for s in states})

    def mark_saved(self, marks: Sequence[DynamicSaveMark]) -> None:
        """A checkpoint holding each mark's shard up to it is committed (the servers forget the
        evictions before it: no delta will be asked for before a committed save)."""
        by_server: dict[int, list[DynamicSaveMark]] = {}
        for mark in marks:
            by_server.setdefault(mark.ref.shard, []).append(mark)
        self._calls.fan_out(
            by_server,
            lambda server, mine: self._stubs[server].unary(
                "MarkDynamicTablesSaved",
                ps_pb2.MarkDynamicTablesSavedRequest(marks=[mark_to_proto(m) for m in mine]),
                ps_pb2.DynamicTablesResponse,
                self._options,
            ),
        )
