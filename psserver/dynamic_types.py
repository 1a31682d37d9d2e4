"""Dynamic embedding tables as every process sees them: a table's settings, one server's shard
as exported and checkpointed, its statistics, and how a table's rows move to another number
of servers. Plain data (the server's side is psserver/dynamic_table.py; the wire's,
psserver/dynamic_wire.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from paramserve.psserver.dynamic_rows import owner_of
from paramserve.psserver.errors import DtypeMismatchError, InvalidRequestError
from paramserve.psserver.optimizer import OptimizerSpec
from paramserve.psserver.types import ShardRef

__all__ = [
    "DEFAULT_ROWS",
    "INITIALIZERS",
    "DynamicSaveMark",
    "DynamicShardState",
    "DynamicStats",
    "DynamicTableConfig",
    "rehash",
]

DEFAULT_ROWS = ("zeros", "shared")
INITIALIZERS = ("zeros", "constant", "normal", "uniform")
INDEX_BYTES_PER_ROW = 48
"""The most an IdIndex takes per live row (4 buckets of 12 bytes, just after a rebuild)."""


@dataclass(frozen=True)
class DynamicTableConfig:
    """How a dynamic table keeps its rows (the same on every server). None turns a bound off.

    ``admit_after``: the lookup that sees an id for the N-th time makes its row; before, a
    lookup reads ``default_row`` ("zeros", or "shared": one row from the initializer, never
    trained). ``ttl_steps`` / ``ttl_seconds``: rows not updated for longer are evicted.
    ``max_rows`` / ``max_bytes``: per server; the least recently used rows make room.
    ``admission_width``: counters per row of the sighting sketch (default: 4 per row of the cap,
    or 2^20). ``block_rows``: rows per arena block (default: about 8 MiB of rows)."""

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
        if self.ttl_seconds is not None and not (self.ttl_seconds > 0 and math.isfinite(self.ttl_seconds)):
            raise InvalidRequestError(f"ttl_seconds must be positive, got {self.ttl_seconds!r}")
        if self.optimizer is not None:
            self.optimizer.validate()

    def row_cap(self, row_bytes: int, fixed_bytes: int) -> int | None:
        """The rows one server may hold: ``max_rows``, and what ``max_bytes`` leaves room for
        after ``fixed_bytes`` (the sighting sketch), at ``row_bytes`` a row plus its index."""
        caps = [] if self.max_rows is None else [self.max_rows]
        if self.max_bytes is not None:
            rows = (self.max_bytes - fixed_bytes) // (row_bytes + 8 + INDEX_BYTES_PER_ROW)
            if rows < 1:
                raise InvalidRequestError(f"max_bytes={self.max_bytes} leaves no room for a row of {row_bytes} bytes")
            caps.append(rows)
        return min(caps) if caps else None


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
