"""The data structures behind a dynamic embedding table, in torch and without locks.

Pure and shared by both sides: the client partitions ids with :func:`owner_of`; the server
keeps one shard's rows in a :class:`RowArena` (preallocated blocks of rows with a free list),
finds them through an :class:`IdIndex` (open addressing over two flat tensors), counts
sightings of ids not yet admitted in an :class:`AdmissionFilter` (a count-min sketch of fixed
size), makes a new row with :func:`initial_rows` (deterministic per id and seed), decides
what to evict with :func:`expired` and :func:`least_recently_used`, and remembers the ids it
evicted for an incremental checkpoint in a :class:`DeletionLog`. None of them locks: the
owning table's lock serialises every call (psserver/store/dynamic_table.py).

The hash is splitmix64 (Steele, Lea and Flood, 2014: the finaliser of Java's SplittableRandom),
computed on int64 tensors with wrapping arithmetic and logical shifts, so a batch of ids is
hashed in a handful of vector operations and every process, on any machine, agrees.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "MAX_ROWS",
    "AdmissionFilter",
    "DeletionLog",
    "IdIndex",
    "RowArena",
    "ascending",
    "expired",
    "initial_rows",
    "lazy_zeros",
    "least_recently_used",
    "owner_of",
    "splitmix64",
]

_MASK64 = (1 << 64) - 1


def _signed(value: int) -> int:
    """A 64-bit unsigned constant as the int64 with the same bits."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)
_INDEX_SALT = _signed(0x5851F42D4C957F2D)
"""Mixed into an id before it picks its index bucket: the bucket must not follow from the
owner (the same hash modulo the number of servers), or every id of a server would share a
residue and leave buckets unused."""
_FILTER_SALTS = (_signed(0x2545F4914F6CDD1D), _signed(0x9FB21C651E98DF25), _signed(0xD6E8FEB86659FD93))


def _shift_right(x: Tensor, bits: int) -> Tensor:
    """Logical (unsigned) right shift of int64 values: torch's ``>>`` is arithmetic."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def splitmix64(x: Tensor) -> Tensor:
    """splitmix64 of each int64 value (its bits as an unsigned 64-bit integer), as int64."""
    z = x.to(torch.int64) + _GOLDEN
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    return z ^ _shift_right(z, 31)


def owner_of(ids: Tensor, num_shards: int) -> Tensor:
    """The shard (one per parameter server) each id belongs to: the low 63 bits of
    ``splitmix64(id)`` modulo ``num_shards``. Stable across processes and versions: a
    checkpoint restored onto another number of servers moves each row by this rule."""
    if num_shards < 1:
        raise ValueError(f"a dynamic table needs at least one shard, got {num_shards}")
    return (splitmix64(ids) & ((1 << 63) - 1)) % num_shards


_INITIAL_CHUNK = 4096
"""Ids whose initial rows are drawn at once: the draws take 2 x dim x 8 bytes an id several
times over (a batch of 32k ids at dim 16: tens of MB), so a large admission is drawn in chunks."""


def _uniform(bits: Tensor) -> Tensor:
    """Doubles in [0, 1) from the top 53 bits of each hash."""
    return _shift_right(bits, 11).to(torch.float64) * (1.0 / (1 << 53))


def initial_rows(ids: Tensor, dim: int, kind: str, a: float, b: float, seed: int, dtype: torch.dtype) -> Tensor:
    """Each id's initial row: a function of (id, column, seed) only, so a row evicted and
    admitted again, or made on another server, is the same row. ``kind``: "zeros", "constant"
    (a), "normal" (mean a, std b; Box-Muller over two hashed uniforms) or "uniform" ([a, b))."""
    n = ids.numel()
    if kind == "zeros" or n == 0:
        return torch.zeros((n, dim), dtype=dtype)
    if kind == "constant":
        return torch.full((n, dim), a, dtype=dtype)
    if n > _INITIAL_CHUNK:  # a row at a time is a function of its id: chunks bound the temporaries
        flat = ids.reshape(-1)
        return torch.cat(
            [
                initial_rows(flat[i : i + _INITIAL_CHUNK], dim, kind, a, b, seed, dtype)
                for i in range(0, n, _INITIAL_CHUNK)
            ]
        )
    base = splitmix64(ids.reshape(-1).to(torch.int64) ^ splitmix64(torch.tensor([seed], dtype=torch.int64)))
    draws = 2 * dim if kind == "normal" else dim
    counters = torch.arange(1, draws + 1, dtype=torch.int64) * _GOLDEN
    uniform = _uniform(splitmix64(base[:, None] + counters[None, :]))
    if kind == "uniform":
        return (a + (b - a) * uniform).to(dtype)
    if kind == "normal":
        radius = torch.sqrt(-2.0 * torch.log1p(-uniform[:, :dim]))
        return (a + b * radius * torch.cos(2.0 * math.pi * uniform[:, dim:])).to(dtype)
    raise ValueError(f"unknown initializer {kind!r} for a dynamic table; use zeros, constant, normal or uniform")


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """Zeros in numpy's memory, for a shard's large structures. Two reasons. Its pages are
    committed on their first write: numpy's zeros is calloc, and calloc of a large block maps
    fresh pages without writing them (torch.zeros writes every byte), so an arena block costs
    memory for the rows written into it, not for its size. And numpy asks the kernel for huge
    pages (madvise, for arrays of 4 MiB or more): a batch's rows are random reads and writes all
    over the arena and the index, and with 4 KiB pages nearly each one walks the page table once
    they pass the TLB's reach (BENCHMARKS.md, ``dyn_us_per_row``)."""
    count = math.prod(shape)
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    raw = torch.from_numpy(np.zeros(count * dtype.itemsize, dtype=np.uint8))
    return raw.view(dtype).reshape(shape)


# ---------------------------------------------------------------- the index


class IdIndex:
    """id -> arena slot, by open addressing with linear probing over two flat tensors (keys
    int64, slots int32; -1 empty, -2 deleted): 12 bytes a bucket, 2 to 4 buckets a live id
    after a rebuild. Every call takes a batch of ids and probes them together, a widening window
    of buckets a vector step (``_probe``). A rebuild drops the old buckets before it makes the
    new ones, and rebuilds in place at the same size. ``max_capacity``: the most buckets it
    grows to (a byte-capped table's, which its cap counts); past that it is rebuilt in place."""

    EMPTY = -1
    DELETED = -2
    BUCKET_BYTES = 12
    KEY_BYTES = 8
    """A bucket's key: the largest of its two tensors is ``KEY_BYTES`` a bucket."""

    REBUILT_LOAD = 0.5

    @classmethod
    def buckets_for(cls, ids: int) -> int:
        """The buckets a rebuild for ``ids`` live ids makes: the most an index holding at most
        that many grows to (without ``max_capacity``)."""
        return _power_of_two(max(16, math.ceil(ids / cls.REBUILT_LOAD)))

    def __init__(self, capacity: int = 1024, max_load: float = 0.75, max_capacity: int | None = None):
        if not self.REBUILT_LOAD < max_load < 1.0:
            raise ValueError(f"max_load must be in ({self.REBUILT_LOAD}, 1), got {max_load}")
        self.max_load = max_load
        self.max_capacity = None if max_capacity is None else _power_of_two(max(16, max_capacity))
        capacity = capacity if self.max_capacity is None else min(capacity, self.max_capacity)
        self.live = 0
        self._used = 0  # live and deleted buckets: what probing walks over
        self._allocate(_power_of_two(max(16, capacity)))

    def _allocate(self, capacity: int) -> None:
        # numpy's memory (lazy_zeros): huge pages, so a probe into a large index walks fewer pages.
        self._keys = lazy_zeros((capacity,), torch.int64)
        self._slots = lazy_zeros((capacity,), torch.int32).fill_(self.EMPTY)
        self._mask = capacity - 1
        self._used = 0
        self.live = 0

    @property
    def capacity(self) -> int:
        return self._keys.numel()

    @property
    def nbytes(self) -> int:
        return self._keys.numel() * 8 + self._slots.numel() * 4

    def _start(self, ids: Tensor) -> Tensor:
        return splitmix64(ids ^ _INDEX_SALT) & self._mask

    def _windows(self, position: Tensor, width: int) -> tuple[Tensor, Tensor]:
        """(buckets, their slots) of the ``width`` buckets from each position on, one row per
        position (index_select: several times faster than indexing with a 2-d tensor)."""
        window = (position[:, None] + torch.arange(width)) & self._mask
        return window, self._slots.index_select(0, window.reshape(-1)).view(window.shape)

    def _in_bucket_order(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """(start bucket, position in ``ids``) of each id, in order of start bucket: a batch's
        reads then walk the table front to back, several times cheaper than in hash order once
        the table is past the caches."""
        return ascending(self._start(ids), self.capacity)

    def _probe(self, ids: Tensor, with_buckets: bool = False) -> tuple[Tensor | None, Tensor]:
        """(bucket, slot) of each id; slot -1 (and bucket meaningless) for an absent id; the
        buckets only ``with_buckets``. Each id's buckets are read a window at a time from its
        start (a few adjacent buckets share a cache line), the window widening each round, so the
        longest probe of a batch takes a handful of rounds (one a bucket took 20 to 50), ids in
        order of their start bucket (``_in_bucket_order``). Each round writes every id's answer,
        -1 where not found yet: no compaction of the ids that found theirs."""
        n = ids.numel()
        buckets = torch.full((n,), -1, dtype=torch.int64) if with_buckets else None
        slots = torch.full((n,), -1, dtype=torch.int64)
        position, active = self._in_bucket_order(ids)
        wanted = ids.index_select(0, active)
        width = _FIRST_WINDOW
        while active.numel():
            window, held = self._windows(position, width)
            keys = self._keys.index_select(0, window.reshape(-1)).view(window.shape)
            hit = (held >= 0) & (keys == wanted[:, None])
            stop = hit | (held == self.EMPTY)  # a linear probe ends at its id or at an empty bucket
            first = stop.to(torch.uint8).argmax(1, keepdim=True)  # argmax: the first of equal maxima
            found = hit.gather(1, first).reshape(-1)
            slots.index_copy_(0, active, torch.where(found, held.gather(1, first).reshape(-1).to(torch.int64), -1))
            if buckets is not None:
                buckets.index_copy_(0, active, torch.where(found, window.gather(1, first).reshape(-1), -1))
            going_on = ~stop.gather(1, first).reshape(-1)
            if not bool(going_on.any()):
                break
            active, wanted, position = active[going_on], wanted[going_on], position[going_on] + width
            width = min(4 * width, _WIDEST_WINDOW)
        return buckets, slots

    def find(self, ids: Tensor) -> Tensor:
        """The slot of each id (int64), -1 where the index does not hold it."""
        return self._probe(ids)[1]

    def insert(self, ids: Tensor, slots: Tensor) -> None:
        """Adds ``ids`` (distinct, none held already) with their slots."""
        self._reserve(ids.numel())
        self._place(ids, slots.to(torch.int32))

    def _place(self, ids: Tensor, slots: Tensor) -> None:
        """Puts each id in the first free bucket from its start, a window of buckets a round as
        ``_probe`` reads them. Several ids may claim one bucket: one write survives, and the
        others go on from the bucket after it."""
        position, active = self._in_bucket_order(ids)
        width = _FIRST_WINDOW
        while active.numel():
            window, held = self._windows(position, width)
            free = held < 0
            first = free.to(torch.uint8).argmax(1, keepdim=True)
            has = free.gather(1, first).reshape(-1)
            claim, at = active[has], window.gather(1, first).reshape(-1)[has]
            self._keys[at] = ids[claim]  # several may claim one bucket: one write survives
            won = self._keys[at] == ids[claim]
            self._used += int((held.gather(1, first).reshape(-1)[has][won] == self.EMPTY).sum())
            self._slots[at[won]] = slots[claim[won]]
            self.live += int(won.sum())
            going_on = torch.ones(active.numel(), dtype=torch.bool)
            going_on[has.nonzero().reshape(-1)[won]] = False
            # Past the window where it had no free bucket, past the bucket it lost where it had.
            position = position + torch.where(has, first.reshape(-1) + 1, width)
            active, position = active[going_on], position[going_on]
            width = min(4 * width, _WIDEST_WINDOW)

    def remove(self, ids: Tensor) -> Tensor:
        """Forgets ``ids``; returns the slots they held (ids not held are skipped)."""
        buckets, slots = self._probe(ids, with_buckets=True)
        assert buckets is not None
        held = slots >= 0
        self._slots[buckets[held]] = self.DELETED
        self.live -= int(held.sum())
        return slots[held]

    def items(self) -> tuple[Tensor, Tensor]:
        """Every live (id, slot), in bucket order."""
        live = self._slots >= 0
        return self._keys[live], self._slots[live].to(torch.int64)

    def _reserve(self, extra: int) -> None:
        """Rebuilds the index before probing would walk too far: when live and deleted buckets
        would pass ``max_load``, at the size that puts the live ids at ``REBUILT_LOAD`` or below
        (larger, or smaller after many deletions), so the next rebuild is at least a quarter of
        the buckets' inserts or deletions away: O(1) amortised per id."""
        if self._used + extra <= self.max_load * self.capacity:
            return
        live = self._slots >= 0
        ids, slots = self._keys[live], self._slots[live]
        del live
        capacity = self.buckets_for(self.live + extra)
        if self.max_capacity is not None and capacity > self.max_capacity:
            capacity = self.max_capacity
            if self.live + extra > self.max_load * capacity:
                raise MemoryError(f"an index of at most {capacity} buckets cannot hold {self.live + extra} ids")
        if capacity == self.capacity:  # in place: the table is never held twice
            self._slots.fill_(self.EMPTY)
            self._used = self.live = 0
        else:
            self._keys = self._slots = torch.empty(0)  # the old buckets go before the new ones come
            self._allocate(capacity)
        self._place(ids, slots)


_FIRST_WINDOW = 4
"""Buckets an id's first probe round reads: 32 bytes of keys, usually within one cache line."""
_WIDEST_WINDOW = 256


def ascending(values: Tensor, bound: int) -> tuple[Tensor, Tensor]:
    """(``values`` sorted, int64; their positions in ``values``) for int64 values in [0, ``bound``):
    sorted as int32 where the bound allows, which takes half the time of int64 (a batch's bucket
    numbers and arena slots are sorted on every lookup and push)."""
    if bound <= 2**31:
        ordered, order = torch.sort(values.to(torch.int32))
        return ordered.to(torch.int64), order
    return torch.sort(values)


def _power_of_two(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(n)))


# ---------------------------------------------------------------- the arena

MAX_ROWS = 1 << 31
"""The most rows one shard holds: its index keeps each row's arena slot as an int32."""


class RowArena:
    """Rows in blocks of ``block_rows`` (the last block of a capped arena is cut to the cap),
    one tensor per block and column, handed out in slot order with a list of freed slots that
    the next allocations take first: memory grows with the live rows' high-water mark
    (``capacity``: the slots handed out so far), never past ``max_rows``. A block is allocated
    whole but committed as its rows are written (``lazy_zeros``), so blocks can be large: a
    batch's gather and scatter loop over the blocks its slots fall in, and few large blocks keep
    that loop as short for ten million rows as for one. Slots passed in ascending order cost
    least: each block's are one slice, and the reads walk memory front to back (``_grouped``).
    ``columns``: name -> (row shape, dtype), e.g. ``{"value": ((16,), torch.float32), "ids":
    ((), torch.int64)}``; ``fill``: an integer column's value at a slot never written (stored
    XOR the fill, so a fresh block's zeros read as it)."""

    def __init__(
        self,
        columns: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
        block_rows: int,
        max_rows: int | None = None,
        fill: Mapping[str, int] | None = None,
    ):
        if block_rows < 1 or (max_rows is not None and max_rows < 1):
            raise ValueError(f"a row arena needs positive sizes, got block_rows={block_rows}, max_rows={max_rows}")
        self.columns = dict(columns)
        self.fill = {name: value for name, value in (fill or {}).items() if value}
        bad = [name for name in self.fill if self.columns[name][1].is_floating_point]
        if bad:
            raise ValueError(f"a fill is for integer columns only, got {bad}")
        self.block_rows = block_rows if max_rows is None else min(block_rows, max_rows)
        self.max_rows = max_rows
        self._blocks: dict[str, list[Tensor]] = {name: [] for name in self.columns}
        # A capped arena's list has room for every slot from the start: never regrown, so it
        # never exists twice, and committed only as far as slots are freed into it.
        self._freed = lazy_zeros((max_rows or 0,), torch.int64)
        self._freed_count = 0
        self.capacity = 0
        """Slots handed out so far: [0, capacity); a slot past it was never written."""

    @property
    def live(self) -> int:
        return self.capacity - self._freed_count

    @property
    def nbytes(self) -> int:
        """The bytes the rows written so far and the list of freed slots hold."""
        return self.capacity * self.row_bytes() + self._freed_count * self._freed.element_size()

    def row_bytes(self) -> int:
        """Bytes a row takes across every column."""
        return sum(math.prod(shape) * dtype.itemsize for shape, dtype in self.columns.values())

    def allocate(self, count: int) -> Tensor:
        """``count`` free slots (int64), freed ones first, then new ones in ascending order;
        raises MemoryError past ``max_rows`` (and allocates none)."""
        reused = min(count, self._freed_count)
        fresh = count - reused
        if self.max_rows is not None and self.capacity + fresh > self.max_rows:
            raise MemoryError(f"the row arena holds its cap of {self.max_rows} rows")
        self._freed_count -= reused
        taken = self._freed[self._freed_count : self._freed_count + reused].clone()
        if not fresh:
            return taken
        new = torch.arange(self.capacity, self.capacity + fresh, dtype=torch.int64)
        self.capacity += fresh
        while self.blocks * self.block_rows < self.capacity:
            self._add_block()
        return torch.cat([taken, new]) if reused else new

    def release(self, slots: Tensor) -> None:
        """Returns ``slots`` (distinct, allocated) to the free list."""
        n = slots.numel()
        if self._freed_count + n > self._freed.numel():
            grown = lazy_zeros((max(self._freed_count + n, min(self.capacity, 2 * self._freed.numel())),), torch.int64)
            grown[: self._freed_count] = self._freed[: self._freed_count]
            self._freed = grown
        self._freed[self._freed_count : self._freed_count + n] = slots
        self._freed_count += n

    def _add_block(self) -> None:
        rows = self.block_rows
        if self.max_rows is not None:
            rows = min(rows, self.max_rows - self.blocks * self.block_rows)
        for name, (shape, dtype) in self.columns.items():
            self._blocks[name].append(lazy_zeros((rows, *shape), dtype))

    def _grouped(self, slots: Tensor) -> Iterator[tuple[int, slice | Tensor, Tensor]]:
        """(block, where in ``slots``: a slice or positions, offsets in the block) per block touched.
        Slots in ascending order (as a shard passes them: ``DynamicShard`` sorts a batch's slots
        once) fall in runs, one per block, found by a binary search: every column's gather and
        scatter is then a copy of slices, with no permutation of the rows."""
        if slots.numel() == 0:
            return
        which = slots // self.block_rows
        low, high = (int(v) for v in torch.aminmax(which))
        if low == high:
            yield low, slice(None), slots - low * self.block_rows
            return
        if bool((slots[1:] >= slots[:-1]).all()):
            bounds = torch.tensor([b * self.block_rows for b in range(low, high + 2)], dtype=slots.dtype)
            cuts = torch.searchsorted(slots, bounds).tolist()
            for block, start, stop in zip(range(low, high + 1), cuts, cuts[1:]):
                if stop > start:
                    yield block, slice(start, stop), slots[start:stop] - block * self.block_rows
            return
        order = torch.argsort(which, stable=True)
        counts = torch.bincount(which, minlength=high + 1)
        for block, positions in zip(range(high + 1), order.split(counts.tolist())):
            if positions.numel():
                yield block, positions, slots[positions] - block * self.block_rows

    @property
    def blocks(self) -> int:
        return len(next(iter(self._blocks.values())))

    def column(self, name: str, block: int | None = None) -> Tensor:
        """A copy of column ``name`` at every slot handed out, in order (of block ``block``
        only: its slots from ``block * block_rows`` on), freed slots included."""
        blocks = self._blocks[name]
        if block is not None:
            return self._read(name, blocks[block][: self._handed_out_in(block)].clone())
        shape, dtype = self.columns[name]
        if not blocks:
            return torch.empty((0, *shape), dtype=dtype)
        return self._read(name, torch.cat([b[: self._handed_out_in(i)] for i, b in enumerate(blocks)]))

    def _handed_out_in(self, block: int) -> int:
        """How many of block ``block``'s slots were handed out (the rest were never written)."""
        return max(0, min(self.block_rows, self.capacity - block * self.block_rows))

    def gather(self, column: str, slots: Tensor) -> Tensor:
        """Copies of ``column`` at ``slots``, in their order."""
        shape, dtype = self.columns[column]
        blocks = self._blocks[column]
        out = torch.empty((slots.numel(), *shape), dtype=dtype)
        for block, where, offsets in self._grouped(slots):
            if isinstance(where, slice):
                torch.index_select(blocks[block], 0, offsets, out=out[where])
            else:
                out[where] = blocks[block].index_select(0, offsets)
        return self._read(column, out)

    def scatter(self, column: str, slots: Tensor, values: Tensor) -> None:
        """Writes ``values[i]`` (shape ``[len(slots), *row shape]``) to ``column`` at ``slots[i]``."""
        blocks = self._blocks[column]
        fill = self.fill.get(column)
        if fill is not None:
            values = values.to(self.columns[column][1]) ^ fill
        for block, where, offsets in self._grouped(slots):
            piece = values[where]
            blocks[block].index_copy_(0, offsets, piece.to(blocks[block].dtype))

    def _read(self, column: str, stored: Tensor) -> Tensor:
        """What ``stored`` (values as the blocks keep them) holds: the fill is XORed back."""
        fill = self.fill.get(column)
        return stored if fill is None else stored.bitwise_xor_(fill)


# ---------------------------------------------------------------- admission


class AdmissionFilter:
    """How often each id was seen, approximately and in fixed memory: a count-min sketch of
    ``depth`` rows of ``width`` int32 counters. An estimate is never below the true count
    (an id is never admitted late), and above it only when other ids share all its counters.
    Every ``10 * width`` sightings every counter is halved (TinyLFU's reset), so ids seen long
    ago stop crowding the sketch: an id must be seen N times within about that many sightings."""

    def __init__(self, width: int, depth: int = 2):
        if width < 1 or not 1 <= depth <= len(_FILTER_SALTS):
            raise ValueError(f"an admission filter needs width >= 1 and depth in 1..{len(_FILTER_SALTS)}")
        self.width = width
        self.depth = depth
        self._counts = lazy_zeros((depth, width), torch.int32)  # huge pages: its reads are random
        self._since_reset = 0

    @property
    def nbytes(self) -> int:
        return self._counts.nbytes

    def _cells(self, ids: Tensor) -> Tensor:
        rows = [(splitmix64(ids ^ salt) & ((1 << 63) - 1)) % self.width for salt in _FILTER_SALTS[: self.depth]]
        return torch.stack(rows)  # [depth, n]

    def add(self, ids: Tensor) -> Tensor:
        """Counts one sighting of each id (distinct); returns each one's estimated count since."""
        cells = self._cells(ids)
        ones = torch.ones(ids.numel(), dtype=torch.int32)
        for row in range(self.depth):
            self._counts[row].index_add_(0, cells[row], ones)
        estimate = self.estimate_cells(cells)
        self._since_reset += ids.numel()
        if self._since_reset >= 10 * self.width:
            self._counts //= 2
            self._since_reset = 0
        return estimate

    def estimate(self, ids: Tensor) -> Tensor:
        return self.estimate_cells(self._cells(ids))

    def estimate_cells(self, cells: Tensor) -> Tensor:
        return torch.stack([self._counts[row][cells[row]] for row in range(self.depth)]).amin(0)

    def forget(self, ids: Tensor) -> None:
        """Zeroes the counters of ``ids`` (evicted: they are admitted again from scratch; ids
        sharing a counter lose their count too, which only delays their admission)."""
        cells = self._cells(ids)
        for row in range(self.depth):
            self._counts[row][cells[row]] = 0


# ---------------------------------------------------------------- eviction decisions


def expired(
    updated_step: Tensor,
    updated_at: Tensor,
    step: int,
    now: float,
    ttl_steps: int | None,
    ttl_seconds: float | None,
) -> Tensor:
    """Which rows outlived their time to live: not updated for more than ``ttl_steps`` of the
    table's steps, or more than ``ttl_seconds`` (either one; None: that bound is off)."""
    old = torch.zeros(updated_step.numel(), dtype=torch.bool)
    if ttl_steps is not None:
        old |= (step - updated_step) > ttl_steps
    if ttl_seconds is not None:
        old |= (now - updated_at) > ttl_seconds
    return old


def least_recently_used(used: Tensor, count: int, protected_from: int) -> Tensor:
    """Positions of the ``count`` rows used longest ago, among those last used before tick
    ``protected_from`` (rows the current request uses are never evicted to make room)."""
    spared = used >= protected_from
    count = min(count, used.numel() - int(spared.sum()))
    if count <= 0:
        return torch.empty(0, dtype=torch.int64)
    # One copy with the spared rows last (not a list of candidates): 9 bytes a row at the peak.
    return torch.topk(used.masked_fill(spared, torch.iinfo(used.dtype).max), count, largest=False, sorted=False).indices


# ---------------------------------------------------------------- what incremental checkpoints need

DELETION_LOG_MIN_IDS = 65536
"""A deletion log may always hold this many ids (512 KiB), and more up to half the live rows."""


class DeletionLog:
    """The ids a shard evicted, by the epoch (exports so far) they were evicted in, since the
    oldest mark an incremental export may still be asked to answer after (``floor``): what a
    delta lists as deleted. Keeps nothing until ``start`` (a shard never saved incrementally pays
    nothing). Bounded: past ``max(DELETION_LOG_MIN_IDS, live rows / 2)`` ids it forgets them and
    raises its floor, so the next save of the shard is whole (about as small, with that many
    evictions)."""

    def __init__(self) -> None:
        self.floor: int | None = None
        self._entries: list[tuple[int, Tensor]] = []
        self._count = 0

    def start(self, epoch: int) -> None:
        """Keeps the evictions after epoch ``epoch`` (a no-op once started)."""
        if self.floor is None:
            self.floor = epoch

    def answers(self, since: int, epoch: int) -> bool:
        """Whether every id evicted after epoch ``since`` (up to ``epoch``, now) is here."""
        return self.floor is not None and self.floor <= since <= epoch

    def record(self, epoch: int, ids: Tensor, live_rows: int) -> None:
        if self.floor is None or ids.numel() == 0:
            return
        self._entries.append((epoch, ids.clone()))
        self._count += ids.numel()
        if self._count > max(DELETION_LOG_MIN_IDS, live_rows // 2):
            self._entries, self._count, self.floor = [], 0, epoch

    def since(self, epoch: int) -> Tensor:
        """The ids evicted after epoch ``epoch``, sorted and distinct."""
        kept = [ids for at, ids in self._entries if at > epoch]
        return torch.unique(torch.cat(kept)) if kept else torch.empty(0, dtype=torch.int64)

    def trim(self, epoch: int) -> None:
        """A delta will never again be asked for before ``epoch``: forgets what was evicted until then."""
        if self.floor is None or epoch <= self.floor:
            return
        self.floor = epoch
        self._entries = [(at, ids) for at, ids in self._entries if at > epoch]
        self._count = sum(ids.numel() for _, ids in self._entries)

    @property
    def nbytes(self) -> int:
        return 8 * self._count
