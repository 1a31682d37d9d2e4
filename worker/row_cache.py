"""Hot rows a worker read, served again for a bounded number of its own steps (``max_row_staleness``).

In click logs a few rows take most lookups (about 1 % of the rows, 92 % of the lookups, in the
logs Bagpipe studied), so a worker reads the same rows step after step. With
``ParameterServerStrategy(max_row_staleness=s)`` a row a worker read at its step k is served from
its cache at its steps k..k+s instead of being read again; only the others travel. Asynchronous
training reads rows that miss the other workers' concurrent pushes anyway; the bound says by
how many of this worker's steps at most (HET, VLDB'22, bounds a worker cache the same way).

What does not change: every step pushes the gradient of every row it used, under its key, once;
a cached row's push names the version it was read at (the oldest read of its shard), so the
servers' staleness bound and metric count the cache's staleness too. ``s = 0`` (the default)
uses no cache at all: every lookup reads every row, as without this module.

What is never served: a row read before the coordinator's last ``join()`` or ``fetch()`` (the
closure's read generation: what finished before them is what later closures read), nor one read
under another cluster context (a restore, a failover, new layouts: ``clear``).

The cache is direct-mapped, per table: a row lives in slot ``id % slots`` (``slots``: the table's
rows, at most ``slots_per_table``), so finding and keeping rows are a few tensor operations for a
whole lookup and its memory is bounded: ``slots_per_table x (dim x element size + 32)`` bytes per
table at most. Two hot rows of one slot take turns; a table with fewer rows than slots never
collides.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from paramserve.psserver.protocol.types import ShardRef, UniqueRows, VariableLayout

__all__ = ["DEFAULT_SLOTS_PER_TABLE", "CacheUse", "Found", "RowCache", "cached_lookup", "slot_count"]

DEFAULT_SLOTS_PER_TABLE = 1 << 16
"""Slots per table: 65,536 rows (4 MiB of a 16-wide float32 table, with its bookkeeping 5.6 MiB)."""
EMPTY = -1


def slot_count(table_rows: int, slots_per_table: int) -> int:
    """The slots a table of ``table_rows`` gets: one per row up to ``slots_per_table``."""
    return max(1, min(table_rows, slots_per_table))


@dataclass(frozen=True)
class Found:
    """What the cache holds of a lookup's distinct ids: ``hit[i]`` for ``ids[i]``; for the hits
    (in order), their rows, the shard versions they were read at and their age in steps."""

    hit: torch.Tensor
    rows: torch.Tensor
    versions: torch.Tensor
    ages: torch.Tensor


class _Table:
    """One table's slots."""

    def __init__(self, slots: int, row_shape: tuple[int, ...], dtype: torch.dtype):
        self.ids = torch.full((slots,), EMPTY, dtype=torch.int64)
        self.rows = torch.zeros((slots, *row_shape), dtype=dtype)
        self.step = torch.zeros(slots, dtype=torch.int64)
        self.generation = torch.zeros(slots, dtype=torch.int64)
        self.version = torch.zeros(slots, dtype=torch.int64)


class RowCache:
    """The rows of every table a worker read, by slot (module docstring). Not thread-safe: a
    worker runs one closure at a time."""

    def __init__(self, slots_per_table: int = DEFAULT_SLOTS_PER_TABLE):
        if slots_per_table < 1:
            raise ValueError(f"slots_per_table must be >= 1, got {slots_per_table}")
        self.slots_per_table = slots_per_table
        self._tables: dict[str, _Table] = {}

    def find(self, table: str, ids: torch.Tensor, *, step: int, max_staleness: int, generation: int) -> Found:
        """Which of ``ids`` (distinct, int64) the cache serves at this worker's ``step``: rows read
        at most ``max_staleness`` steps before it, by a closure of read generation ``generation``
        or later."""
        held = self._tables.get(table)
        if held is None or max_staleness <= 0:
            none = torch.zeros(ids.numel(), dtype=torch.bool)
            return Found(none, torch.empty(0), torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64))
        slot = ids % held.ids.numel()
        ages = step - held.step[slot]
        hit = (held.ids[slot] == ids) & (ages <= max_staleness) & (held.generation[slot] >= generation)
        hits = slot[hit]
        return Found(hit, held.rows[hits], held.version[hits], ages[hit])

    def keep(
        self,
        table: str,
        table_rows: int,
        ids: torch.Tensor,
        rows: torch.Tensor,
        versions: torch.Tensor,
        *,
        step: int,
        generation: int,
    ) -> None:
        """Keeps ``rows`` (of ``ids``, distinct, read at shard ``versions``) as read at ``step`` in
        read generation ``generation``; each takes its slot (of two ids of one slot, the last)."""
        if ids.numel() == 0:
            return
        held = self._tables.get(table)
        if held is None or held.rows.shape[1:] != rows.shape[1:] or held.rows.dtype != rows.dtype:
            held = _Table(slot_count(table_rows, self.slots_per_table), tuple(rows.shape[1:]), rows.dtype)
            self._tables[table] = held
        slot = ids % held.ids.numel()
        taken, inverse = torch.unique(slot, return_inverse=True)
        if taken.numel() < slot.numel():  # one write per slot, all from the same id
            last = torch.zeros(taken.numel(), dtype=torch.int64)
            last.scatter_reduce_(0, inverse, torch.arange(slot.numel()), reduce="amax", include_self=False)
            ids, rows, versions, slot = ids[last], rows[last], versions[last], taken
        held.ids[slot] = ids
        held.rows[slot] = rows.detach().to(held.rows.dtype)
        held.step[slot] = step
        held.generation[slot] = generation
        held.version[slot] = versions

    def clear(self) -> None:
        """Forgets every row (the variables were rewritten, or live elsewhere now)."""
        self._tables.clear()

    def held_bytes(self) -> int:
        """The memory the slots take."""
        return sum(
            t.rows.numel() * t.rows.element_size() + 4 * t.ids.numel() * t.ids.element_size()
            for t in self._tables.values()
        )


Pull = Callable[
    [Mapping[str, torch.Tensor], Mapping[str, tuple[int, torch.dtype]] | None],
    tuple[dict[str, UniqueRows], dict[ShardRef, int]],
]
"""``VariableClient.pull_unique_rows`` (lookups, dynamic tables) -> (rows by table, shard versions)."""


@dataclass
class CacheUse:
    """What a worker's lookups took from the cache and from the servers (its metrics)."""

    rows_cached: int = 0
    rows_pulled: int = 0
    ages: Counter[int] = field(default_factory=Counter)
    """Rows served from the cache, by their age in steps."""

    def add(self, other: CacheUse) -> None:
        self.rows_cached += other.rows_cached
        self.rows_pulled += other.rows_pulled
        self.ages.update(other.ages)


def cached_lookup(
    pull: Pull,
    cache: RowCache,
    layouts: Mapping[str, VariableLayout],
    lookups: Mapping[str, torch.Tensor],
    dynamic: Mapping[str, tuple[int, torch.dtype]] | None,
    *,
    step: int,
    max_staleness: int,
    generation: int,
) -> tuple[dict[str, UniqueRows], dict[ShardRef, int], CacheUse]:
    """``pull(lookups, dynamic)`` with the rows the cache serves left out of it: one pull of the
    rest (dynamic tables are not cached), whose rows the cache keeps. The versions name, for each
    shard, the oldest read of its rows, cached or pulled (what a push counts staleness from)."""
    use = CacheUse()
    dynamic = dynamic or {}
    distinct: dict[str, tuple[torch.Tensor, torch.Tensor, Found]] = {}
    wanted: dict[str, torch.Tensor] = {n: ids for n, ids in lookups.items() if n in dynamic}
    for name, indices in lookups.items():
        if name in dynamic:
            continue
        ids, inverse = torch.unique(indices.reshape(-1).to(torch.int64), sorted=True, return_inverse=True)
        found = cache.find(name, ids, step=step, max_staleness=max_staleness, generation=generation)
        distinct[name] = (ids, inverse, found)
        if not bool(found.hit.all()):
            wanted[name] = ids[~found.hit]
    pulled, versions = pull(wanted, dynamic) if wanted else ({}, {})
    versions = dict(versions)
    rows_by_table = {name: pulled[name] for name in lookups if name in dynamic}
    for name, (ids, inverse, found) in distinct.items():
        layout = layouts[name]
        rows = torch.empty((ids.numel(), *layout.shape[1:]), dtype=layout.dtype)
        if name in pulled:
            fresh = pulled[name]
            shard_versions = torch.tensor([versions.get(layout.ref(s), 0) for s in layout.shards], dtype=torch.int64)
            read_at = shard_versions[_shard_positions(layout, fresh.ids)]
            cache.keep(name, layout.shape[0], fresh.ids, fresh.rows, read_at, step=step, generation=generation)
            rows[~found.hit] = fresh.rows.to(rows.dtype)
            use.rows_pulled += fresh.ids.numel()
        if bool(found.hit.any()):
            rows[found.hit] = found.rows
            _oldest_reads(versions, layout, ids[found.hit], found.versions)
            use.rows_cached += int(found.hit.sum())
            use.ages.update(found.ages.tolist())
        rows_by_table[name] = UniqueRows(ids, inverse, rows)
    for name in dynamic:
        if name in pulled:
            use.rows_pulled += pulled[name].ids.numel()
    return rows_by_table, versions, use


def _shard_positions(layout: VariableLayout, ids: torch.Tensor) -> torch.Tensor:
    """The position in ``layout.shards`` of each row id's shard."""
    return torch.bucketize(ids, layout.row_starts, right=True) - 1


def _oldest_reads(
    versions: dict[ShardRef, int], layout: VariableLayout, ids: torch.Tensor, read_at: torch.Tensor
) -> None:
    """Lowers each shard's version in ``versions`` to the oldest of its rows ``ids`` read at ``read_at``."""
    positions = _shard_positions(layout, ids)
    for position in torch.unique(positions).tolist():
        ref = layout.ref(layout.shards[position])
        oldest = int(read_at[positions == position].min())
        versions[ref] = min(versions.get(ref, oldest), oldest)
