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

__all__ = [
    "DEFAULT_SLOTS_PER_TABLE",
    "MAX_AGE_LABEL",
    "CacheUse",
    "Found",
    "RowCache",
    "age_label",
    "cached_lookup",
    "slot_count",
]

DEFAULT_SLOTS_PER_TABLE = 1 << 16
"""Slots per table: 65,536 rows (4 MiB of a 16-wide float32 table, with its bookkeeping 5.6 MiB)."""
EMPTY = -1
MAX_AGE_LABEL = 32
"""Ages of cached rows above this share one metric series (a label per age up to it: bounded)."""
ID, STEP, GENERATION, VERSION = range(4)
"""The columns of a group's ``meta``."""


def age_label(age: int) -> str:
    """The ``age`` label of a cached row read ``age`` steps ago."""
    return str(age) if age <= MAX_AGE_LABEL else f"{MAX_AGE_LABEL}+"


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


class _Group:
    """The slots of every table whose rows share a shape and dtype, in one set of tensors (each
    table a range of them), so that a lookup of many tables finds and keeps rows with a few
    tensor operations in all, not a few per table: per table, that was 7 of the 8 CPU-ms a
    26-table lookup cost."""

    def __init__(self, row_shape: tuple[int, ...], dtype: torch.dtype):
        self.rows = torch.empty((0, *row_shape), dtype=dtype)
        self.meta = torch.empty((0, 4), dtype=torch.int64)
        """Per slot, side by side so that one gather reads them: the (table-local) row id it holds
        (or EMPTY), the step and read generation it was read at, its shard's version then."""

    @property
    def ids(self) -> torch.Tensor:
        return self.meta[:, ID]

    @property
    def step(self) -> torch.Tensor:
        return self.meta[:, STEP]

    @property
    def generation(self) -> torch.Tensor:
        return self.meta[:, GENERATION]

    @property
    def version(self) -> torch.Tensor:
        return self.meta[:, VERSION]

    def add(self, slots: int) -> int:
        """``slots`` new empty slots (a table's); their first's position."""
        start = self.meta.shape[0]
        empty = torch.zeros((slots, 4), dtype=torch.int64)
        empty[:, ID] = EMPTY
        self.meta = torch.cat([self.meta, empty])
        self.rows = torch.cat([self.rows, torch.zeros((slots, *self.rows.shape[1:]), dtype=self.rows.dtype)])
        return start

    def held_bytes(self) -> int:
        return self.rows.numel() * self.rows.element_size() + self.meta.numel() * self.meta.element_size()


class _Table:
    """One table's slots: a range of its group's."""

    def __init__(self, group: _Group, slots: int):
        self.group = group
        self.offset = group.add(slots)
        self.slots = slots

    def _range(self, values: torch.Tensor) -> torch.Tensor:
        return values[self.offset : self.offset + self.slots]

    @property
    def ids(self) -> torch.Tensor:
        return self._range(self.group.ids)

    @property
    def rows(self) -> torch.Tensor:
        return self._range(self.group.rows)

    @property
    def step(self) -> torch.Tensor:
        return self._range(self.group.step)

    @property
    def generation(self) -> torch.Tensor:
        return self._range(self.group.generation)

    @property
    def version(self) -> torch.Tensor:
        return self._range(self.group.version)


class RowCache:
    """The rows of every table a worker read, by slot (module docstring). Not thread-safe: a
    worker runs one closure at a time."""

    def __init__(self, slots_per_table: int = DEFAULT_SLOTS_PER_TABLE):
        if slots_per_table < 1:
            raise ValueError(f"slots_per_table must be >= 1, got {slots_per_table}")
        self.slots_per_table = slots_per_table
        self._tables: dict[str, _Table] = {}
        self._groups: dict[tuple[tuple[int, ...], torch.dtype], _Group] = {}

    def table(self, name: str, table_rows: int, row_shape: tuple[int, ...], dtype: torch.dtype) -> _Table:
        """``name``'s slots, made empty on first use (or when its rows changed shape or dtype)."""
        held = self._tables.get(name)
        if held is None or held.group.rows.shape[1:] != row_shape or held.group.rows.dtype != dtype:
            group = self._groups.get((row_shape, dtype))
            if group is None:
                group = self._groups[(row_shape, dtype)] = _Group(row_shape, dtype)
            held = self._tables[name] = _Table(group, slot_count(table_rows, self.slots_per_table))
        return held

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
        held = self.table(table, table_rows, tuple(rows.shape[1:]), rows.dtype)
        _write(held.group, held.offset + ids % held.slots, ids, rows.detach(), versions, step, generation)

    def clear(self) -> None:
        """Forgets every row (the variables were rewritten, or live elsewhere now)."""
        self._tables.clear()
        self._groups.clear()

    def held_bytes(self) -> int:
        """The memory the slots take."""
        return sum(group.held_bytes() for group in self._groups.values())


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
    shard, the oldest read of its rows, cached or pulled (what a push counts staleness from).
    The tables of one group (rows of one shape and dtype) are found and kept together."""
    use = CacheUse()
    dynamic = dynamic or {}
    wanted: dict[str, torch.Tensor] = {n: ids for n, ids in lookups.items() if n in dynamic}
    by_group: dict[int, dict[str, _Table]] = {}
    for name in lookups:
        if name not in dynamic:
            layout = layouts[name]
            table = cache.table(name, layout.shape[0], tuple(layout.shape[1:]), layout.dtype)
            by_group.setdefault(id(table.group), {})[name] = table
    plans = [
        _GroupLookup(tables, layouts, lookups, step, max_staleness, generation, wanted) for tables in by_group.values()
    ]
    pulled, versions = pull(wanted, dynamic) if wanted else ({}, {})
    versions = dict(versions)
    rows_by_table = {name: pulled[name] for name in lookups if name in dynamic}
    for plan in plans:
        rows_by_table.update(plan.finish(pulled, versions, use))
    for name in dynamic:
        if name in pulled:
            use.rows_pulled += pulled[name].ids.numel()
    return {name: rows_by_table[name] for name in lookups}, versions, use


class _GroupLookup:
    """One group's part of a cached lookup: its tables' ids made keys of one space (a table's id
    plus the rows of the tables before it in the lookup), so that one ``unique`` and one gather
    find every table's rows; ``wanted`` gets each table's misses for the pull; ``finish`` keeps
    what was pulled and assembles every table's rows."""

    def __init__(
        self,
        tables_by_name: Mapping[str, _Table],
        layouts: Mapping[str, VariableLayout],
        lookups: Mapping[str, torch.Tensor],
        step: int,
        max_staleness: int,
        generation: int,
        wanted: dict[str, torch.Tensor],
    ):
        names, tables = list(tables_by_name), list(tables_by_name.values())
        group = tables[0].group
        self.group, self.names, self.layouts = group, names, layouts
        self.step, self.generation = step, generation
        self.bases = [0]
        for name in names[:-1]:
            self.bases.append(self.bases[-1] + layouts[name].shape[0])
        flats = [lookups[n].reshape(-1).to(torch.int64) for n in names]
        self.sizes = [f.numel() for f in flats]
        bases = torch.tensor(self.bases, dtype=torch.int64)
        keys = torch.cat(flats) + torch.repeat_interleave(bases, torch.tensor(self.sizes))
        self.keys, inverse = torch.unique(keys, sorted=True, return_inverse=True)
        position = torch.searchsorted(bases, self.keys, right=True) - 1  # each key's table, in ``names``
        self.local = self.keys - bases[position]
        slots = torch.tensor([t.slots for t in tables], dtype=torch.int64)[position]
        self.slot = torch.tensor([t.offset for t in tables], dtype=torch.int64)[position] + self.local % slots
        if max_staleness > 0:
            meta = group.meta.index_select(0, self.slot)
            ages = step - meta[:, STEP]
            hit = (meta[:, ID] == self.local) & (ages <= max_staleness) & (meta[:, GENERATION] >= generation)
        else:
            meta, ages = torch.empty((0, 4), dtype=torch.int64), torch.empty(0, dtype=torch.int64)
            hit = torch.zeros(self.keys.numel(), dtype=torch.bool)
        self.counts = torch.bincount(position, minlength=len(names)).tolist()
        firsts = torch.tensor([0, *self.counts[:-1]], dtype=torch.int64).cumsum(0)
        self.inverse = inverse - torch.repeat_interleave(firsts, torch.tensor(self.sizes))
        self.hit, self.miss = hit.nonzero().squeeze(1), (~hit).nonzero().squeeze(1)
        misses = torch.bincount(position.index_select(0, self.miss), minlength=len(names)).tolist()
        for name, ids in zip(names, torch.split(self.local.index_select(0, self.miss), misses)):
            if ids.numel():
                wanted[name] = ids
        # What the cache serves, read now: keeping the pulled rows may take their slots.
        self.hit_rows = group.rows.index_select(0, self.slot.index_select(0, self.hit))
        self.hit_versions = meta[:, VERSION].index_select(0, self.hit) if self.hit.numel() else self.hit
        self.hit_ages = ages.index_select(0, self.hit) if self.hit.numel() else self.hit

    def finish(
        self, pulled: Mapping[str, UniqueRows], versions: dict[ShardRef, int], use: CacheUse
    ) -> dict[str, UniqueRows]:
        group = self.group
        rows = torch.empty((self.keys.numel(), *group.rows.shape[1:]), dtype=group.rows.dtype)
        fresh = [pulled[n].rows for n in self.names if n in pulled]
        starts, shard_versions, refs = self._shards(versions)
        if fresh:
            fresh_rows = torch.cat(fresh).to(rows.dtype)
            rows.index_copy_(0, self.miss, fresh_rows)
            keys = self.keys.index_select(0, self.miss)
            read_at = shard_versions[torch.searchsorted(starts, keys, right=True) - 1]
            slot, local = self.slot.index_select(0, self.miss), self.local.index_select(0, self.miss)
            _write(group, slot, local, fresh_rows, read_at, self.step, self.generation)
            use.rows_pulled += self.miss.numel()
        if self.hit.numel():
            rows.index_copy_(0, self.hit, self.hit_rows)
            shard = torch.searchsorted(starts, self.keys.index_select(0, self.hit), right=True) - 1
            oldest = torch.full((len(refs),), torch.iinfo(torch.int64).max, dtype=torch.int64)
            oldest.scatter_reduce_(0, shard, self.hit_versions, reduce="amin")
            for ref, version in zip(refs, oldest.tolist()):
                if version != torch.iinfo(torch.int64).max:
                    versions[ref] = min(versions.get(ref, version), version)
            use.rows_cached += self.hit.numel()
            use.ages.update({age: n for age, n in enumerate(torch.bincount(self.hit_ages).tolist()) if n})
        ids = torch.split(self.local, self.counts)
        table_rows = torch.split(rows, self.counts)
        inverses = torch.split(self.inverse, self.sizes)
        return {name: UniqueRows(ids[i], inverses[i], table_rows[i].clone()) for i, name in enumerate(self.names)}

    def _shards(self, versions: Mapping[ShardRef, int]) -> tuple[torch.Tensor, torch.Tensor, list[ShardRef]]:
        """Every shard of the group's tables: its first key, its version as just read, its ref."""
        starts: list[int] = []
        read: list[int] = []
        refs: list[ShardRef] = []
        for name, base in zip(self.names, self.bases):
            layout = self.layouts[name]
            for shard in layout.shards:
                ref = layout.ref(shard)
                starts.append(base + shard.row_start)
                read.append(versions.get(ref, 0))
                refs.append(ref)
        return torch.tensor(starts, dtype=torch.int64), torch.tensor(read, dtype=torch.int64), refs


def _write(
    group: _Group,
    slot: torch.Tensor,
    ids: torch.Tensor,
    rows: torch.Tensor,
    read_at: torch.Tensor,
    step: int,
    generation: int,
) -> None:
    """Rows (of table-local ``ids``, read at shard versions ``read_at``) into their group ``slot``s,
    as read at ``step`` in read generation ``generation``; of two ids of one slot, the last."""
    taken, inverse = torch.unique(slot, return_inverse=True)
    if taken.numel() < slot.numel():  # one write per slot, all from the same id
        last = torch.zeros(taken.numel(), dtype=torch.int64)
        last.scatter_reduce_(0, inverse, torch.arange(slot.numel()), reduce="amax", include_self=False)
        ids, rows, read_at, slot = ids[last], rows[last], read_at[last], taken
    meta = torch.stack([ids, torch.full_like(ids, step), torch.full_like(ids, generation), read_at.to(ids.dtype)], 1)
    group.meta.index_copy_(0, slot, meta)
    group.rows.index_copy_(0, slot, rows.to(group.rows.dtype))
