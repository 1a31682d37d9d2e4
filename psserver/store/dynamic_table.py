"""Dynamic embedding tables on one parameter server: rows keyed by any int64 id, made on
first touch, admitted after N sightings, evicted by age or under a memory cap.

A table has one shard per parameter server; an id belongs to shard ``owner_of(id, n)``
(psserver/dynamic/dynamic_rows.py: splitmix64). A :class:`DynamicShard` is one server's shard: its
rows live in a :class:`RowArena` (value, row-shaped optimizer slots, and per row its id, the
table step and time of its last update and the tick of its last use), found through an
:class:`IdIndex`. Its lifecycle per id:

* **unseen / counted**: a lookup counts a sighting in the :class:`AdmissionFilter` and reads
  the table's default row (zeros, or one shared row from the initializer); a push for it is
  dropped (no gradient is stored for an id without a row).
* **admitted**: at the ``admit_after``-th sighting the lookup makes the row from the
  initializer (``initial_rows``: a function of id and seed, so a row made again is the same
  row) with torch's initial optimizer state, and reads it. Pushes update it with one
  torch.optim step over the gathered rows of the push (``optimizer.step_gathered``).
* **evicted**: a sweep, run inline by the first lookup or push that finds it due (every
  ``ttl_steps / 10`` table steps or ``ttl_seconds / 10`` seconds), evicts rows not updated
  within the TTL; an admission that would pass ``max_rows`` first evicts the least recently
  used rows (a batch of at least 1/32 of the cap, so the O(rows) selection is amortised).
  Eviction frees the row and its slots and zeroes the id's sighting count: the id starts
  again from unseen.

**Incremental checkpoints.** Every export ends an *epoch* of the shard: its mark is (lineage,
the epoch it ended), and each row remembers the epoch of its admission or last update
(``changed``, 4 bytes), so the rows changed since a mark E are exactly those with
``changed > E``. An export ``incremental`` starts a :class:`DeletionLog` of the ids evicted from
then on (by epoch); an export with a mark ``since`` that the shard can answer (same lineage: not
replaced since; its log reaches back to it) is a delta: those rows, and the ids evicted since
that have no row now. ``mark_saved`` (a checkpoint holding the shard up to a mark was
committed) trims the log. A shard made or replaced gets a new lineage, so no delta ever spans a
restore.

Every call is validated before it changes anything; the shard's lock serialises them.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from paramserve.psserver.dynamic.dynamic_rows import (
    AdmissionFilter,
    DeletionLog,
    IdIndex,
    RowArena,
    ascending,
    expired,
    initial_rows,
    least_recently_used,
    owner_of,
)
from paramserve.psserver.dynamic.dynamic_types import (
    ARENA_BLOCK_COLUMN_BYTES,
    DynamicSaveMark,
    DynamicShardState,
    DynamicStats,
    DynamicTableConfig,
)
from paramserve.psserver.protocol.errors import (
    DtypeMismatchError,
    InvalidRequestError,
    NonFiniteGradientError,
    ShapeMismatchError,
    StalePushError,
    VariableExistsError,
    VariableNotFoundError,
)
from paramserve.psserver.protocol.types import PushOutcome, ShardRef
from paramserve.psserver.store.idempotency import IdempotencyWindow
from paramserve.psserver.store.optimizer import row_state, same_state_layout, step_gathered, updated_spec
from paramserve.psserver.store.shards import about, all_finite

__all__ = ["DynamicShard", "DynamicTables", "PushSettings", "check_restorable"]

_SHARED_DEFAULT_ID = -(1 << 63)
"""The id whose initial row is a table's shared default row ("shared")."""
_FREE = torch.iinfo(torch.int64).max
"""The last use of a free arena slot: never among the least recently used, never swept."""
_LRU_BATCH = 32
"""An eviction for room frees at least max_rows / this many rows (amortising its O(rows) pick)."""
_METADATA = {
    "ids": torch.int64,
    "updated": torch.int64,
    "updated_at": torch.float64,
    "used": torch.int64,
    "changed": torch.int32,
}


class DynamicShard:
    """One server's shard of a dynamic table (see the module docstring). Thread-safe."""

    def __init__(
        self,
        ref: ShardRef,
        num_shards: int,
        config: DynamicTableConfig,
        idempotency_capacity: int,
        block_bytes: int = ARENA_BLOCK_COLUMN_BYTES,
    ):
        config.validate()
        if isinstance(num_shards, bool) or not isinstance(num_shards, int) or not 0 <= ref.shard < num_shards:
            raise InvalidRequestError(f"shard {ref.shard} of {num_shards} is not a shard of a dynamic table")
        self.ref, self.num_shards, self.config = ref, num_shards, config
        self.lock = threading.Lock()
        self.version = 0
        self.window = IdempotencyWindow(idempotency_capacity)
        self.lineage = uuid.uuid4().hex
        self._epoch = 0  # exports so far: a row's "changed" is the epoch of its last change
        self._deleted = DeletionLog()
        self._tick = 0
        self.admissions = self.evictions_ttl = self.evictions_capacity = 0
        dim, dtype = config.dim, config.dtype
        self._state = row_state(config.optimizer, dim, dtype) if config.optimizer is not None else {}
        self.shared = {key: initial.clone() for key, (rows, initial) in self._state.items() if not rows}
        columns: dict[str, tuple[tuple[int, ...], torch.dtype]] = {"value": ((dim,), dtype)}
        for key, (rows, initial) in self._state.items():
            if rows:
                columns[f"slot.{key}"] = ((dim,), initial.dtype)
        columns.update({name: ((), kind) for name, kind in _METADATA.items()})
        width = config.admission_width or (4 * config.max_rows if config.max_rows else 1 << 20)
        self._filter = AdmissionFilter(width) if config.admit_after > 1 else None
        probe = RowArena(columns, 1)
        self.max_rows, buckets = config.capacity(probe.row_bytes(), self._filter.nbytes if self._filter else 0)
        widest = max(math.prod(shape) * kind.itemsize for shape, kind in columns.values())
        block = config.arena_block_rows(widest, block_bytes)
        self._arena = RowArena(columns, block, self.max_rows, fill={"used": _FREE})
        # Under max_bytes, the index grows up to the buckets the cap counts, never past them.
        self._index = IdIndex(capacity=min(1024, 2 * (self.max_rows or 1024)), max_capacity=buckets)
        self._default = (
            initial_rows(
                torch.tensor([_SHARED_DEFAULT_ID]),
                dim,
                config.initializer,
                config.init_a,
                config.init_b,
                config.seed,
                dtype,
            )[0]
            if config.default_row == "shared"
            else torch.zeros(dim, dtype=dtype)
        )
        self._sweep_every = (
            max(1, config.ttl_steps // 10) if config.ttl_steps else None,
            config.ttl_seconds / 10 if config.ttl_seconds else None,
        )
        self._last_sweep: tuple[int, float] | None = None

    # -- checks (change nothing)

    def check_ids(self, ids: Tensor) -> None:
        """Raises unless ``ids`` is 1-d int64 and every id belongs to this shard."""
        if not isinstance(ids, Tensor) or ids.dtype != torch.int64 or ids.dim() != 1:
            raise DtypeMismatchError(
                f"ids of a dynamic table must be a 1-d int64 tensor, got {getattr(ids, 'dtype', type(ids).__name__)}"
            )
        if ids.numel():
            wrong = owner_of(ids, self.num_shards) != self.ref.shard
            if bool(wrong.any()):
                raise InvalidRequestError(
                    f"id {int(ids[wrong][0])} belongs to shard {int(owner_of(ids[wrong][:1], self.num_shards))} of "
                    f"{self.num_shards}, not to shard {self.ref.shard}: partition ids with owner_of (splitmix64)"
                )

    def check_push_header(self, dtype: torch.dtype, shape: Sequence[int], num_indices: int | None) -> None:
        """Raises what ``push`` would for gradients of this dtype and shape, before any byte arrives."""
        if self.config.optimizer is None:
            raise InvalidRequestError(f"dynamic table {self.ref.variable} has no optimizer; create it with one")
        if num_indices is None:
            raise InvalidRequestError("a dynamic table takes row gradients by id (sparse), never a dense push")
        if dtype != self.config.dtype:
            raise DtypeMismatchError(f"gradient dtype {dtype} does not match the table's {self.config.dtype}")
        if tuple(shape) != (num_indices, self.config.dim):
            raise ShapeMismatchError(
                f"gradient shape {tuple(shape)} does not match ({num_indices}, {self.config.dim}): "
                f"the table's rows have dim {self.config.dim}"
            )

    def check_push(self, ids: Tensor, values: Tensor, base_version: int, key: str, settings: PushSettings) -> None:
        self.check_push_header(values.dtype, tuple(values.shape), ids.numel() if isinstance(ids, Tensor) else None)
        self.check_ids(ids)
        if not settings.allow_nonfinite and not all_finite(values):
            raise NonFiniteGradientError(f"gradient for dynamic table shard {self.ref.shard} holds NaN or Inf")
        bound = settings.max_staleness
        if bound is not None and base_version >= 0:
            with self.lock:
                duplicate, version = key in self.window, self.version
            if not duplicate and version - base_version > bound:
                raise StalePushError(
                    f"the gradient was computed from version {base_version}, {version - base_version} updates "
                    f"behind the current {version} (max_staleness={bound})"
                )

    # -- lookups and pushes

    def lookup(self, ids: Tensor, now: float) -> tuple[Tensor, int]:
        """The rows of ``ids`` (checked: ``check_ids``) and the version read: admitted ids' own
        rows (admitting those seen for the ``admit_after``-th time), the default row for others."""
        with self.lock:
            self._maybe_sweep(now)
            self._tick += 1
            slots = self._index.find(ids)
            held, ordered = self._held_in_slot_order(slots)
            self._arena.scatter("used", ordered, torch.full((ordered.numel(),), self._tick))
            missing = (slots < 0).nonzero().reshape(-1)
            if missing.numel():
                wanted = ids[missing]
                if self._filter is not None:
                    seen = self._filter.add(wanted)
                    ready = seen >= self.config.admit_after
                    missing, wanted = missing[ready], wanted[ready]
                admitted = self._admit(wanted, now)
                if admitted.numel():
                    slots[missing[: admitted.numel()]] = admitted
                    held, ordered = self._held_in_slot_order(slots)
            rows = self._default.expand(ids.numel(), -1).clone()
            rows[held] = self._arena.gather("value", ordered)
            return rows, self.version

    def push(self, ids: Tensor, values: Tensor, key: str, base_version: int, now: float) -> PushOutcome:
        """Applies row gradients (checked: ``check_push``) once per ``key``: one torch.optim step
        over the rows the table holds; gradients of ids without a row are dropped."""
        with self.lock:
            staleness = max(0, self.version - base_version) if base_version >= 0 else 0
            if key in self.window:
                return PushOutcome(self.ref, False, self.version, staleness)
            self._tick += 1
            unique, inverse = torch.unique(ids, sorted=True, return_inverse=True)
            summed = torch.zeros((unique.numel(), self.config.dim), dtype=values.dtype)
            summed.index_add_(0, inverse, values)
            held, ordered = self._held_in_slot_order(self._index.find(unique))
            if ordered.numel():
                self._step(ordered, summed.index_select(0, held))
                self.version += 1
                count = ordered.numel()
                self._arena.scatter("updated", ordered, torch.full((count,), self.version))
                self._arena.scatter("updated_at", ordered, torch.full((count,), now, dtype=torch.float64))
                self._arena.scatter("used", ordered, torch.full((count,), self._tick))
                self._arena.scatter("changed", ordered, self._stamp(count))
            else:
                self.version += 1
            self.window.record(key)
            self._maybe_sweep(now)
            return PushOutcome(self.ref, True, self.version, staleness)

    def _step(self, slots: Tensor, grads: Tensor) -> None:
        """One torch.optim step over the gathered rows; written back only once it succeeded."""
        spec = self.config.optimizer
        assert spec is not None  # checked by check_push
        param = torch.nn.Parameter(self._arena.gather("value", slots))
        param.grad = grads
        state: dict[str, Any] = {}
        for key, (rows, _) in self._state.items():
            state[key] = self._arena.gather(f"slot.{key}", slots) if rows else self.shared[key].clone()
        stepped = step_gathered(spec, param, state)
        self._arena.scatter("value", slots, param.detach())
        for key, (rows, _) in self._state.items():
            if rows:
                self._arena.scatter(f"slot.{key}", slots, stepped[key])
            else:
                self.shared[key] = stepped[key]

    def with_hyperparameters(self, values: Mapping[str, Any]) -> DynamicTableConfig:
        """The table's settings after optimizer hyperparameters ``values`` apply, validated as a
        dense variable's are (its row slots cannot change: they are the arena's columns);
        changes nothing. Raises InvalidRequestError."""
        spec = self.config.optimizer
        if spec is None:
            raise InvalidRequestError("the variable has no optimizer", variable=self.ref.variable)
        with about(self.ref.variable):
            updated = updated_spec(spec, values)
            dim, dtype = self.config.dim, self.config.dtype
            same_state_layout(spec, row_state(spec, dim, dtype), row_state(updated, dim, dtype))
        return dataclasses.replace(self.config, optimizer=updated)

    def reconfigure(self, config: DynamicTableConfig) -> None:
        """Steps with ``config`` (from ``with_hyperparameters``) from the next push on."""
        with self.lock:
            self.config = config

    # -- admission and eviction

    def _admit(self, ids: Tensor, now: float) -> Tensor:
        """Makes rows for ``ids`` (in order; as many as the cap allows, evicting the least
        recently used first); returns their slots."""
        if ids.numel() == 0:
            return torch.empty(0, dtype=torch.int64)
        if self.max_rows is not None:
            over = self._arena.live + ids.numel() - self.max_rows
            if over > 0:
                self._evict_for_room(max(over, self.max_rows // _LRU_BATCH))
            ids = ids[: max(0, self.max_rows - self._arena.live)]
        slots = self._arena.allocate(ids.numel())
        ordered, order = self._ascending(slots)  # freed slots come in any order: see RowArena._grouped
        ids, count, cfg = ids[order], ids.numel(), self.config
        self._arena.scatter(
            "value", ordered, initial_rows(ids, cfg.dim, cfg.initializer, cfg.init_a, cfg.init_b, cfg.seed, cfg.dtype)
        )
        for key, (rows, initial) in self._state.items():
            if rows:
                self._arena.scatter(f"slot.{key}", ordered, initial.expand(count, -1))
        self._arena.scatter("ids", ordered, ids)
        self._arena.scatter("updated", ordered, torch.full((count,), self.version))
        self._arena.scatter("updated_at", ordered, torch.full((count,), now, dtype=torch.float64))
        self._arena.scatter("used", ordered, torch.full((count,), self._tick))
        self._arena.scatter("changed", ordered, self._stamp(count))
        self._index.insert(ids, ordered)
        self.admissions += ids.numel()
        return slots

    def _evict_for_room(self, count: int) -> None:
        # Over the arena's slots, not the index's items: a free slot's last use is _FREE, never
        # picked, and the scan copies one column (8 bytes a row), not every id and slot.
        victims = least_recently_used(self._arena.column("used"), count, protected_from=self._tick)
        self._evict(self._arena.gather("ids", victims), victims)
        self.evictions_capacity += victims.numel()

    def _held_in_slot_order(self, slots: Tensor) -> tuple[Tensor, Tensor]:
        """(positions in ``slots`` of the ids with a row, their slots), both in slot order: a
        batch's arena reads and writes go in slot order (see RowArena._grouped)."""
        positions = (slots >= 0).nonzero().reshape(-1)
        ordered, order = self._ascending(slots[positions])
        return positions[order], ordered

    def _ascending(self, slots: Tensor) -> tuple[Tensor, Tensor]:
        """``slots`` in ascending order and their positions: a batch's arena reads and writes go
        in slot order (see RowArena._grouped)."""
        return ascending(slots, self._arena.capacity)

    def _stamp(self, count: int) -> Tensor:
        return torch.full((count,), self._epoch, dtype=torch.int32)

    def _evict(self, ids: Tensor, slots: Tensor) -> None:
        self._index.remove(ids)
        self._arena.scatter("used", slots, torch.full((slots.numel(),), _FREE))
        self._arena.release(slots)
        self._deleted.record(self._epoch, ids, self._arena.live)
        if self._filter is not None:
            self._filter.forget(ids)

    def _maybe_sweep(self, now: float) -> None:
        steps, seconds = self._sweep_every
        if steps is None and seconds is None:
            return
        if self._last_sweep is None:
            self._last_sweep = (self.version, now)
        last_step, last_at = self._last_sweep
        if (steps is not None and self.version - last_step >= steps) or (
            seconds is not None and now - last_at >= seconds
        ):
            self.sweep(now)

    def sweep(self, now: float) -> int:
        """Evicts every row past its TTL now; returns how many (callers hold the lock)."""
        self._last_sweep = (self.version, now)
        count = 0
        for block in range(self._arena.blocks):  # a block at a time: the scan's copies stay small
            old = expired(
                self._arena.column("updated", block),
                self._arena.column("updated_at", block),
                self.version,
                now,
                self.config.ttl_steps,
                self.config.ttl_seconds,
            )
            old &= self._arena.column("used", block) != _FREE
            slots = old.nonzero().reshape(-1) + block * self._arena.block_rows
            if slots.numel():
                self._evict(self._arena.gather("ids", slots), slots)
                count += slots.numel()
        self.evictions_ttl += count
        return count

    # -- state

    def stats(self) -> DynamicStats:
        with self.lock:
            nbytes = self._arena.nbytes + self._index.nbytes + (self._filter.nbytes if self._filter else 0)
            nbytes += self._deleted.nbytes
            return DynamicStats(
                self.ref,
                self.num_shards,
                self.config,
                self.version,
                self._arena.live,
                self.admissions,
                self.evictions_ttl,
                self.evictions_capacity,
                nbytes,
            )

    def export(self, since: DynamicSaveMark | None = None, incremental: bool = False) -> DynamicShardState:
        """A copy of every live row (sorted by id) with its slots and last-update step, with the
        shard's mark now. ``incremental``: evictions are logged from now on (for later deltas).
        ``since``: when the shard can answer it (same lineage, log reaching back), only the rows
        changed since, and the ids evicted since that have no row now (a delta)."""
        with self.lock:
            epoch, self._epoch = self._epoch, self._epoch + 1  # changes from now on are the next epoch's
            if incremental:
                self._deleted.start(epoch)
            ids, slots = self._index.items()
            delta = since is not None and since.lineage == self.lineage and self._deleted.answers(since.through, epoch)
            deleted = torch.empty(0, dtype=torch.int64)
            if since is not None and delta:
                changed = self._arena.gather("changed", slots) > since.through
                ids, slots = ids[changed], slots[changed]
                deleted = self._deleted.since(since.through)
                deleted = deleted[self._index.find(deleted) < 0]
            order = torch.argsort(ids)
            ids, slots = ids[order], slots[order]
            return DynamicShardState(
                self.ref,
                self.num_shards,
                self.config,
                ids,
                self._arena.gather("value", slots),
                self._arena.gather("updated", slots),
                {key: self._arena.gather(f"slot.{key}", slots) for key, (rows, _) in self._state.items() if rows},
                {key: value.clone() for key, value in self.shared.items()},
                self.version,
                self.window.keys(),
                delta=delta,
                deleted=deleted,
                lineage=self.lineage,
                through=epoch,
            )

    def mark_saved(self, mark: DynamicSaveMark) -> bool:
        """A checkpoint holding this shard up to ``mark`` is committed: no delta will be asked
        for before it, so the evictions before it are forgotten. False for another lineage's."""
        with self.lock:
            if mark.lineage != self.lineage or mark.through >= self._epoch:
                return False
            self._deleted.trim(mark.through)
            return True

    @classmethod
    def from_state(
        cls,
        state: DynamicShardState,
        idempotency_capacity: int,
        now: float,
        block_bytes: int = ARENA_BLOCK_COLUMN_BYTES,
    ) -> DynamicShard:
        """The shard ``state`` describes, exactly (rows, slots, steps, version, window); its rows
        count as updated at ``now`` for ``ttl_seconds``; ``block_bytes`` as for a new shard (the
        server's, which its limit on one allocation counted). Raises before building anything."""
        shard = cls._checked(state, idempotency_capacity, block_bytes)
        n = state.ids.numel()
        slots = shard._arena.allocate(n)
        shard._arena.scatter("value", slots, state.values)
        for key, value in state.slots.items():
            shard._arena.scatter(f"slot.{key}", slots, value)
        shard._arena.scatter("ids", slots, state.ids)
        shard._arena.scatter("updated", slots, state.updated)
        shard._arena.scatter("updated_at", slots, torch.full((n,), now, dtype=torch.float64))
        shard._arena.scatter("used", slots, torch.zeros(n, dtype=torch.int64))
        shard._arena.scatter("changed", slots, torch.zeros(n, dtype=torch.int32))
        shard._index.insert(state.ids, slots)
        shard.shared = {key: value.clone() for key, value in state.shared.items()} or shard.shared
        shard.version = int(state.version)
        shard.window = IdempotencyWindow.from_keys(state.applied_keys, idempotency_capacity)
        return shard

    @classmethod
    def _checked(
        cls, state: DynamicShardState, idempotency_capacity: int, block_bytes: int = ARENA_BLOCK_COLUMN_BYTES
    ) -> DynamicShard:
        """An empty shard for ``state`` once ``state`` fits it (raises otherwise): no rows stored."""
        if state.delta:
            raise InvalidRequestError(
                "a delta holds only the rows changed since an earlier export: apply it to its base first",
                variable=state.ref.variable,
            )
        shard = cls(state.ref, state.num_shards, state.config, idempotency_capacity, block_bytes)
        shard._check_state(state)
        n = state.ids.numel()
        if shard.max_rows is not None and n > shard.max_rows:
            raise InvalidRequestError(f"{n} rows do not fit the table's cap of {shard.max_rows} rows on a server")
        return shard

    def _check_state(self, state: DynamicShardState) -> None:
        n = state.ids.numel()
        self.check_ids(state.ids)
        if n > 1 and not bool((state.ids[1:] > state.ids[:-1]).all()):
            raise InvalidRequestError("a dynamic shard's ids must be sorted and distinct")
        expected = {key for key, (rows, _) in self._state.items() if rows}
        if set(state.slots) != expected or set(state.shared) - set(self.shared):
            raise InvalidRequestError(
                f"the table's optimizer keeps row slots {sorted(expected)}, got {sorted(state.slots)}"
            )
        for name, tensor, dtype in [
            ("values", state.values, self.config.dtype),
            *((f"slot {k}", v, self._state[k][1].dtype) for k, v in state.slots.items()),
        ]:
            if tensor.dtype != dtype or tuple(tensor.shape) != (n, self.config.dim):
                raise ShapeMismatchError(
                    f"{name} is {tuple(tensor.shape)} {tensor.dtype}; expected {(n, self.config.dim)} {dtype}"
                )
        if state.updated.dtype != torch.int64 or tuple(state.updated.shape) != (n,):
            raise ShapeMismatchError(f"updated must be ({n},) int64, got {tuple(state.updated.shape)}")


def check_restorable(state: DynamicShardState) -> None:
    """Raises as ``DynamicTables.replace`` would for ``state``, storing none of its rows: a
    restore checks every shard this way before any server takes one."""
    DynamicShard._checked(state, 1)


@dataclass(frozen=True)
class PushSettings:
    """The store's settings a dynamic push is checked against."""

    allow_nonfinite: bool = False
    max_staleness: int | None = None


class DynamicTables:
    """Every dynamic table shard on one server, by ShardRef. ``clock``: the time rows are
    stamped with (seconds; injected in tests)."""

    def __init__(
        self,
        idempotency_capacity: int = 65536,
        settings: PushSettings | None = None,
        clock: Callable[[], float] = time.monotonic,
        block_bytes: int = ARENA_BLOCK_COLUMN_BYTES,
    ):
        self._capacity = idempotency_capacity
        self._block_bytes = block_bytes  # the default arena block (dynamic_types.block_bytes_within)
        self.settings = settings or PushSettings()
        self.clock = clock
        self._shards: dict[ShardRef, DynamicShard] = {}
        self._lock = threading.Lock()

    def holds(self, ref: ShardRef) -> bool:
        return ref in self._shards

    def names(self) -> set[str]:
        with self._lock:
            return {ref.variable for ref in self._shards}

    def get(self, ref: ShardRef) -> DynamicShard:
        with self._lock:
            shard = self._shards.get(ref)
        if shard is None:
            raise VariableNotFoundError(
                f"shard {ref.shard} of dynamic table {ref.variable!r} is not on this server", variable=ref.variable
            )
        return shard

    def create(self, ref: ShardRef, num_shards: int, config: DynamicTableConfig) -> DynamicStats:
        """Creates the shard, or keeps an identical one (a retried create); raises
        VariableExistsError for one with other settings."""
        built = DynamicShard(ref, num_shards, config, self._capacity, self._block_bytes)
        with self._lock:
            existing = self._shards.get(ref)
            if existing is None:
                self._check_clash(ref.variable, num_shards, config)
                self._shards[ref] = built
                existing = built
        if (existing.num_shards, existing.config) != (num_shards, config):
            raise VariableExistsError(
                f"dynamic table shard {ref.shard} exists with other settings ({existing.num_shards} shards, "
                f"{existing.config}); delete the table first",
                variable=ref.variable,
            )
        return existing.stats()

    def _check_clash(self, variable: str, num_shards: int, config: DynamicTableConfig) -> None:
        for ref, shard in self._shards.items():
            if ref.variable == variable and (shard.num_shards, shard.config) != (num_shards, config):
                raise VariableExistsError(
                    "the dynamic table exists here with other settings; delete it first", variable=variable
                )

    def replace(self, states: Sequence[DynamicShardState]) -> list[DynamicStats]:
        """Makes the shards of ``states`` exactly those (a restore), all or nothing."""
        now = self.clock()
        built = [DynamicShard.from_state(state, self._capacity, now, self._block_bytes) for state in states]
        with self._lock:
            for variable in {shard.ref.variable for shard in built}:
                for ref in [ref for ref in self._shards if ref.variable == variable]:
                    del self._shards[ref]
            for shard in built:
                self._shards[shard.ref] = shard
        return [shard.stats() for shard in built]

    def hyperparameter_changes(
        self, variable: str | None, values: Mapping[str, Any]
    ) -> list[tuple[DynamicShard, DynamicTableConfig]]:
        """Each shard of ``variable`` (of every table with an optimizer for None) with its
        settings after ``values`` apply (``DynamicShard.with_hyperparameters``); changes nothing."""
        shards = [s for s in self._all() if s.ref.variable == variable or (variable is None and s.config.optimizer)]
        return [(shard, shard.with_hyperparameters(values)) for shard in shards]

    def delete(self, variable: str) -> int:
        with self._lock:
            refs = [ref for ref in self._shards if ref.variable == variable]
            for ref in refs:
                del self._shards[ref]
        return len(refs)

    def export(
        self,
        refs: Sequence[ShardRef] | None = None,
        since: Mapping[ShardRef, DynamicSaveMark] | None = None,
        incremental: bool = False,
    ) -> list[DynamicShardState]:
        """The shards of ``refs`` (every one for None); see ``DynamicShard.export``."""
        shards = self._all() if refs is None else [self.get(ref) for ref in refs]
        marks = since or {}
        return [shard.export(marks.get(shard.ref), incremental) for shard in shards]

    def mark_saved(self, marks: Sequence[DynamicSaveMark]) -> list[DynamicStats]:
        """Tells each shard named that a checkpoint holding it up to its mark is committed; the
        stats of those it applied to (a shard replaced or deleted since is skipped)."""
        with self._lock:
            found = [(self._shards[m.ref], m) for m in marks if m.ref in self._shards]
        return [shard.stats() for shard, mark in found if shard.mark_saved(mark)]

    def stats(self) -> list[DynamicStats]:
        return [shard.stats() for shard in self._all()]

    def sweep(self) -> int:
        """Sweeps every shard now (e.g. a periodic task); returns the rows evicted."""
        now, total = self.clock(), 0
        for shard in self._all():
            with shard.lock:
                total += shard.sweep(now)
        return total

    def _all(self) -> list[DynamicShard]:
        with self._lock:
            return [self._shards[ref] for ref in sorted(self._shards)]
