"""Dynamic embedding tables as every process sees them: a table's settings, one server's shard
as exported and checkpointed, its statistics, and how a table's rows move to another number
of servers. Plain data (the server's side is psserver/store/dynamic_table.py; the wire's,
psserver/dynamic/dynamic_wire.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from paramserve.psserver.dynamic.dynamic_rows import DELETION_LOG_MIN_IDS, MAX_ROWS, IdIndex, owner_of
from paramserve.psserver.protocol.errors import DtypeMismatchError, InvalidRequestError
from paramserve.psserver.protocol.optimizer_spec import OptimizerSpec
from paramserve.psserver.protocol.types import ShardRef

__all__ = [
    "DEFAULT_ROWS",
    "INITIALIZERS",
    "DynamicSaveMark",
    "DynamicShardState",
    "DynamicStats",
    "DynamicTableConfig",
    "block_bytes_within",
    "rehash",
]

DEFAULT_ROWS = ("zeros", "shared")
INITIALIZERS = ("zeros", "constant", "normal", "uniform")
FREE_LIST_BYTES_PER_ROW = 8
"""A row's entry in its arena's free list (int64)."""
DELETION_LOG_BYTES_PER_ROW = 4
"""What a deletion log may hold per live row: the ids of up to half the live rows, 8 bytes each."""
ARENA_BLOCK_COLUMN_BYTES = 64 << 20
"""The default arena block: as many rows as fill this in its widest column (a million rows of 16
float32). Large, because a batch's gather and scatter loop over the blocks its rows fall in (few
blocks: as short a loop at ten million rows as at one million); cheap, because a block's pages are
committed as its rows are written (dynamic_rows.lazy_zeros), not when it is made."""


def block_bytes_within(shard_limit: int) -> int:
    """A server's default arena block (bytes in its widest column): ARENA_BLOCK_COLUMN_BYTES, or
    its limit on one allocation (--max-shard-bytes) where that is smaller, so a table with the
    default blocks is never refused for them."""
    return min(ARENA_BLOCK_COLUMN_BYTES, shard_limit)


WORKING_BYTES_PER_ROW = 17
"""The temporaries of the largest operation over every row, per row: a least-recently-used pick
(each slot's last use copied, a flag, and a masked copy: 8 + 1 + 8); an in-place rebuild of the
index takes less (each live id and slot, 12, and a flag a bucket, at most 4 buckets a row)."""
LEAST_BYTES_PER_ROW = FREE_LIST_BYTES_PER_ROW + DELETION_LOG_BYTES_PER_ROW + WORKING_BYTES_PER_ROW
"""What ``max_bytes`` counts for a row at the least, whatever its columns (``capacity``)."""


@dataclass(frozen=True)
class DynamicTableConfig:
    """How a dynamic table keeps its rows (the same on every server). None turns a bound off.

    ``admit_after``: the lookup that sees an id for the N-th time makes its row; before, a
    lookup reads ``default_row`` ("zeros", or "shared": one row from the initializer, never
    trained). ``ttl_steps`` / ``ttl_seconds``: rows not updated for longer are evicted.
    ``max_rows`` / ``max_bytes``: per server; the least recently used rows make room.
    ``admission_width``: counters per row of the sighting sketch (default: 4 per row of the cap,
    or 2^20). ``block_rows``: rows per arena block (default: ARENA_BLOCK_COLUMN_BYTES in the
    widest column)."""

    dim: int
    dtype: torch.dtype = torch.float32
    optimizer: OptimizerSpec | None = None
    initializer: str = "normal"
    init_a: float = 0.0
    init_b: float = 1.0
    seed: int = 0
    admit_after: int = 1
    default_row: str = "zeros"
    ttl_steps: int | None = None
    ttl_seconds: float | None = None
    max_rows: int | None = None
    max_bytes: int | None = None
    admission_width: int | None = None
    block_rows: int | None = None

    def validate(self) -> None:
        """Raises InvalidRequestError (or DtypeMismatchError) naming the first bad setting."""
        if isinstance(self.dim, bool) or not isinstance(self.dim, int) or self.dim < 1:
            raise InvalidRequestError(f"a dynamic table needs dim >= 1, got {self.dim!r}")
        if not self.dtype.is_floating_point:
            raise DtypeMismatchError(f"a dynamic table holds floating-point rows, not {self.dtype}")
        if self.initializer not in INITIALIZERS:
            raise InvalidRequestError(f"initializer must be one of {INITIALIZERS}, got {self.initializer!r}")
        if self.default_row not in DEFAULT_ROWS:
            raise InvalidRequestError(f"default_row must be one of {DEFAULT_ROWS}, got {self.default_row!r}")
        for name in ("admit_after", "ttl_steps", "max_rows", "max_bytes", "admission_width", "block_rows"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise InvalidRequestError(f"{name} must be a positive int or None, got {value!r}")
        if self.max_rows is not None and self.max_rows > MAX_ROWS:
            raise InvalidRequestError(
                f"max_rows={self.max_rows} is more rows than a server's shard can index (at most {MAX_ROWS}, 2^31: "
                "a row's slot is an int32); max_rows counts one server's rows: cap it at most that, and spread a "
                "larger table over more servers"
            )
        if self.ttl_seconds is not None and not (self.ttl_seconds > 0 and math.isfinite(self.ttl_seconds)):
            raise InvalidRequestError(f"ttl_seconds must be positive, got {self.ttl_seconds!r}")
        if self.optimizer is not None:
            self.optimizer.validate()

    def largest_allocation(self, block_bytes: int = ARENA_BLOCK_COLUMN_BYTES) -> int:
        """About the most bytes one allocation of a shard of this table takes, known before any
        is made: a server refuses a table whose allocation would pass its shard limit. An upper
        bound over a column of an arena block (8 bytes a value), the sighting sketch, and what
        grows with the rows up to the cap (``row_cap``): the arena's list of freed slots (made
        whole with the shard) and the id index's keys at the most buckets it grows to.
        ``block_bytes``: the server's default block (``block_bytes_within``)."""
        row = self.dim * 8
        cap = self.row_cap()
        block = self.arena_block_rows(row, block_bytes)
        if cap is not None:
            block = min(block, cap)
        sketch = 0
        if self.admit_after > 1:
            sketch = 8 * (self.admission_width or (4 * self.max_rows if self.max_rows else 1 << 20))
        per_row = 0
        if cap is not None:
            per_row = max(FREE_LIST_BYTES_PER_ROW * cap, IdIndex.KEY_BYTES * IdIndex.buckets_for(cap))
        return max(row * block, sketch, per_row)

    def row_cap(self) -> int | None:
        """At most the rows a shard of this table holds, from its settings alone: ``max_rows``,
        and what ``max_bytes`` leaves room for at the least a row may count (``capacity`` tells
        the exact number once the row's columns are known); None: no bound."""
        if self.max_bytes is None:
            return self.max_rows
        return min(self.max_rows or MAX_ROWS, self.max_bytes // LEAST_BYTES_PER_ROW)

    def arena_block_rows(self, widest_row_bytes: int, block_bytes: int = ARENA_BLOCK_COLUMN_BYTES) -> int:
        """Rows per arena block: ``block_rows``, else as many as fill ``block_bytes`` (the
        server's default, ``block_bytes_within``) in the widest column (``widest_row_bytes`` a
        row)."""
        return self.block_rows or max(1024, block_bytes // widest_row_bytes)

    def capacity(self, row_bytes: int, sketch_bytes: int) -> tuple[int | None, int | None]:
        """(rows, index buckets) of one server's shard: ``max_rows``, and what ``max_bytes``
        leaves room for when everything the shard holds counts: per row its ``row_bytes``, its
        free-list entry, its share of the deletion log and of the temporaries of an operation
        over every row (so the cap holds while one runs, not only between); once, the sighting sketch
        (``sketch_bytes``), the deletion log's floor and the id index at the most buckets it
        may grow to (the power of two that leaves room for the most rows, at most
        ``IdIndex.REBUILT_LOAD`` of them full). Index buckets None: no bound (no ``max_bytes``).
        Raises InvalidRequestError when ``max_bytes`` leaves no room."""
        if self.max_bytes is None:
            return self.max_rows, None
        per_row = row_bytes + FREE_LIST_BYTES_PER_ROW + DELETION_LOG_BYTES_PER_ROW + WORKING_BYTES_PER_ROW
        fixed = sketch_bytes + 8 * DELETION_LOG_MIN_IDS
        best: tuple[int, int] = (0, 0)
        buckets = 16
        while IdIndex.BUCKET_BYTES * buckets < self.max_bytes:
            room = (self.max_bytes - fixed - IdIndex.BUCKET_BYTES * buckets) // per_row
            rows = min(room, int(buckets * IdIndex.REBUILT_LOAD), self.max_rows or MAX_ROWS)
            if rows > best[0]:
                best = (rows, buckets)
            buckets *= 2
        if best[0] < 1:
            raise InvalidRequestError(f"max_bytes={self.max_bytes} leaves no room for a row of {row_bytes} bytes")
        return best


@dataclass(frozen=True)
class DynamicSaveMark:
    """A shard's state as of one export: its ``lineage`` (new whenever the shard is created or
    replaced) and ``through``, the count of its changes then. An incremental export asks for the
    changes after a mark; a committed checkpoint tells the server its mark (nothing before it
    need be kept)."""

    ref: ShardRef
    lineage: str
    through: int


@dataclass
class DynamicShardState:
    """One server's shard of a dynamic table: what is exported and checkpointed. Whole, or with
    ``delta`` only the rows changed after an earlier mark, with ``deleted`` the ids evicted since
    then that have no row now (the shard's version, shared state and window are always whole).
    ``ids`` sorted; ``updated``: the table step of each row's last update; ``slots``: row-shaped
    optimizer state; ``shared``: the shard's other optimizer state (Adam's step); ``lineage``
    and ``through``: its mark at the export."""

    ref: ShardRef
    num_shards: int
    config: DynamicTableConfig
    ids: Tensor
    values: Tensor
    updated: Tensor
    slots: dict[str, Tensor] = field(default_factory=dict)
    shared: dict[str, Tensor] = field(default_factory=dict)
    version: int = 0
    applied_keys: list[str] = field(default_factory=list)
    delta: bool = False
    deleted: Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    lineage: str = ""
    through: int = 0

    @property
    def mark(self) -> DynamicSaveMark:
        return DynamicSaveMark(self.ref, self.lineage, self.through)

    def with_optimizer(self, spec: OptimizerSpec | None) -> DynamicShardState:
        """This shard stepping with ``spec`` (the settings in force now, e.g. a learning rate
        changed since the save) instead of its own; itself for None."""
        if spec is None:
            return self
        return dataclasses.replace(self, config=dataclasses.replace(self.config, optimizer=spec))


@dataclass(frozen=True)
class DynamicStats:
    """What a shard reports (metrics, ListDynamicTables)."""

    ref: ShardRef
    num_shards: int
    config: DynamicTableConfig
    version: int
    live_rows: int
    admissions: int
    evictions_ttl: int
    evictions_capacity: int
    bytes: int


def rehash(states: Sequence[DynamicShardState], num_shards: int) -> list[DynamicShardState]:
    """The shards of one table (all of them, from a checkpoint) laid out for ``num_shards``
    servers: each row moves to ``owner_of(id, num_shards)`` with its value, slots and age in
    steps. Each new shard's version is the largest saved one and a row's last-update step keeps
    its distance from its old shard's version; windows are merged; shared state (a step count)
    is the largest saved. Same shard count: the states themselves. Whole states only
    (``dynamic_chain.apply_delta`` makes a delta whole first)."""
    if any(s.delta for s in states):
        raise InvalidRequestError("rehash takes whole shards, not deltas: apply each delta to its base first")
    if len(states) == num_shards and sorted(s.ref.shard for s in states) == list(range(num_shards)):
        return list(states)
    first = states[0]
    version = max(s.version for s in states)
    ids = torch.cat([s.ids for s in states])
    values = torch.cat([s.values for s in states])
    updated = torch.cat([s.updated - s.version + version for s in states])
    slots = {key: torch.cat([s.slots[key] for s in states]) for key in first.slots}
    shared = {key: torch.stack([s.shared[key] for s in states]).amax(0) for key in first.shared}
    keys = list(dict.fromkeys(key for s in states for key in s.applied_keys))
    owners = owner_of(ids, num_shards)
    result = []
    for shard in range(num_shards):
        mine = (owners == shard).nonzero().reshape(-1)
        mine = mine[torch.argsort(ids[mine])]
        result.append(
            dataclasses.replace(
                first,
                ref=ShardRef(first.ref.variable, shard),
                num_shards=num_shards,
                ids=ids[mine],
                values=values[mine],
                updated=updated[mine],
                slots={key: value[mine] for key, value in slots.items()},
                shared={key: value.clone() for key, value in shared.items()},
                version=version,
                applied_keys=keys,
                lineage="",
                through=0,
            )
        )
    return result
