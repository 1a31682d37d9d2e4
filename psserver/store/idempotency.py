"""A bounded memory of the idempotency keys a shard has applied.

A client retries a push whose answer it never got; the server must not apply
it twice (ps-lite's resender idea). Each shard remembers the keys of its last
``capacity`` pushes, so memory stays bounded and a retry within that window
is recognised. Not thread-safe: the owning shard's lock guards it.

The window's memory is all allocated when it is made, and never grows: a ring of
``capacity`` slots of KEY_BYTES bytes (a key's UTF-8 bytes; the workers' keys take 34
to 48) with each key's hash and length, and an open-addressing index of int32 slot
numbers at most half full: ``window_bytes(capacity)``, 65 bytes a key (4.3 MB at the
default 65,536), allocated whole at the window's first key (a shard never pushed to costs
nothing; one pushed to has its whole window at once, not growing for minutes after). A window of Python objects
instead (an OrderedDict of key strings) grew by about 250 bytes a push until it was
full, which at 16 workers took a server's first five minutes and read as a leak
(issue 49). A key longer than KEY_BYTES is kept as a string beside the ring (one per
such key, still at most ``capacity``).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable

__all__ = ["IdempotencyWindow", "KEY_BYTES", "window_bytes"]

KEY_BYTES = 48
"""A ring slot's width: keys up to this many UTF-8 bytes are stored in the ring itself. The
workers' push keys are ``<closure id, 32 hex>/<n>`` and ``<closure id>/dense/<n>``
(worker/closure_access.py), 34 to 48 bytes."""
_LONG = 254
"""A slot's length for a key kept in ``_long`` (longer than KEY_BYTES)."""
_EMPTY = 255
"""A slot's length for a slot holding no key."""


def _index_size(capacity: int) -> int:
    """Positions of the index: a power of two at least twice ``capacity`` (at most half full)."""
    return 1 << max(3, (2 * capacity - 1).bit_length())


def window_bytes(capacity: int) -> int:
    """The bytes a window of ``capacity`` keys allocates (keys over KEY_BYTES not counted)."""
    return capacity * (KEY_BYTES + 8 + 1) + _index_size(capacity) * 4


class IdempotencyWindow:
    """The last ``capacity`` keys recorded, oldest first; O(1) membership and insert."""

    def __init__(self, capacity: int):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(
                f"capacity must be a positive int, got {capacity!r}; "
                "it bounds how many recent pushes a retry is recognised within"
            )
        self.capacity = capacity
        self._mask = _index_size(capacity) - 1
        self._index = array("i")
        """Slot of the key at each position; -1: free. Linear probing from ``hash & mask``.
        Empty until the first key (``_allocate``)."""
        self._ring = bytearray()
        self._lengths = array("B")
        self._hashes = array("q")
        self._long: dict[int, str] = {}
        self._next = 0
        """The slot the next key goes into: the oldest key's, once the ring has gone round."""
        self._count = 0

    @classmethod
    def from_keys(cls, keys: Iterable[str], capacity: int) -> IdempotencyWindow:
        """A window holding ``keys`` (oldest first); only the newest ``capacity`` are kept."""
        window = cls(capacity)
        for key in keys:
            window.record(key)
        return window

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self._count > 0 and self._find(key, key.encode(), hash(key)) >= 0

    def allocated_bytes(self) -> int:
        """What the window holds now: 0 before its first key, then ``window_bytes(capacity)``."""
        return window_bytes(self.capacity) if self._index else 0

    def _allocate(self) -> None:
        self._index = array("i", [-1]) * (self._mask + 1)
        self._ring = bytearray(self.capacity * KEY_BYTES)
        self._lengths = array("B", [_EMPTY]) * self.capacity
        self._hashes = array("q", [0]) * self.capacity

    def __len__(self) -> int:
        return self._count

    def record(self, key: str) -> None:
        """Remembers ``key`` as the newest, evicting the oldest beyond capacity. A key recorded
        again is moved to the newest by rebuilding the window (O(capacity); the store never
        does it: it records only keys the window does not hold)."""
        if not self._index:
            self._allocate()
        data, digest = key.encode(), hash(key)
        if self._find(key, data, digest) >= 0:
            rest = [kept for kept in self.keys() if kept != key]
            self.__init__(self.capacity)  # type: ignore[misc]
            for kept in rest:
                self.record(kept)
        slot = self._next
        if self._lengths[slot] != _EMPTY:
            self._forget(self._find_slot(slot))
        if len(data) <= KEY_BYTES:
            start = slot * KEY_BYTES
            self._ring[start : start + len(data)] = data
            self._lengths[slot] = len(data)
        else:
            self._long[slot] = key
            self._lengths[slot] = _LONG
        self._hashes[slot] = digest
        index, mask = self._index, self._mask
        position = digest & mask
        while index[position] >= 0:
            position = (position + 1) & mask
        index[position] = slot
        self._count += 1
        self._next = (slot + 1) % self.capacity

    def keys(self) -> list[str]:
        """The remembered keys, oldest first."""
        if not self._index:
            return []
        order = range(self._next, self._next + self.capacity)
        return [self._key(slot % self.capacity) for slot in order if self._lengths[slot % self.capacity] != _EMPTY]

    def _key(self, slot: int) -> str:
        length = self._lengths[slot]
        if length == _LONG:
            return self._long[slot]
        start = slot * KEY_BYTES
        return self._ring[start : start + length].decode()

    def _find(self, key: str, data: bytes, digest: int) -> int:
        """The index position of ``key``, or -1."""
        index, mask, hashes, lengths = self._index, self._mask, self._hashes, self._lengths
        position = digest & mask
        while True:
            slot = index[position]
            if slot < 0:
                return -1
            if hashes[slot] == digest:
                length = lengths[slot]
                if length == _LONG:
                    if self._long[slot] == key:
                        return position
                elif length == len(data):
                    start = slot * KEY_BYTES
                    if self._ring[start : start + length] == data:
                        return position
            position = (position + 1) & mask

    def _find_slot(self, slot: int) -> int:
        """The index position that holds ``slot`` (which holds a key)."""
        index, mask = self._index, self._mask
        position = self._hashes[slot] & mask
        while index[position] != slot:
            position = (position + 1) & mask
        return position

    def _forget(self, position: int) -> None:
        """Removes the key at index ``position``: its slot is emptied, and the keys probed past it
        are shifted back (linear probing's deletion without tombstones)."""
        index, mask, hashes = self._index, self._mask, self._hashes
        slot = index[position]
        self._lengths[slot] = _EMPTY
        self._long.pop(slot, None)
        self._count -= 1
        hole = probe = position
        while True:
            probe = (probe + 1) & mask
            moved = index[probe]
            if moved < 0:
                break
            home = hashes[moved] & mask
            if (probe - home) & mask >= (probe - hole) & mask:  # its home is not in (hole, probe]
                index[hole] = moved
                hole = probe
        index[hole] = -1
