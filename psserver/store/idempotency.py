"""A bounded memory of the idempotency keys a shard has applied.

A client retries a push whose answer it never got; the server must not apply
it twice (ps-lite's resender idea). Each shard remembers the keys of its last
``capacity`` pushes, so memory stays bounded and a retry within that window
is recognised. Not thread-safe: the owning shard's lock guards it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

__all__ = ["IdempotencyWindow"]


class IdempotencyWindow:
    """The last ``capacity`` keys recorded, oldest first; O(1) membership and insert."""

    def __init__(self, capacity: int):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(
                f"capacity must be a positive int, got {capacity!r}; "
                "it bounds how many recent pushes a retry is recognised within"
            )
        self.capacity = capacity
        self._keys: OrderedDict[str, None] = OrderedDict()

    @classmethod
    def from_keys(cls, keys: Iterable[str], capacity: int) -> IdempotencyWindow:
        """A window holding ``keys`` (oldest first); only the newest ``capacity`` are kept."""
        window = cls(capacity)
        for key in keys:
            window.record(key)
        return window

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def record(self, key: str) -> None:
        """Remembers ``key`` as the newest, evicting the oldest beyond capacity."""
        self._keys[key] = None
        self._keys.move_to_end(key)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def keys(self) -> list[str]:
        """The remembered keys, oldest first."""
        return list(self._keys)
