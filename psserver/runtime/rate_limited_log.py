"""A log that says each kind of thing at most once every so often: what a server under attack
logs about the peers it refuses (the data plane, the status page, the dense group's store), so
that a flood costs a line every few seconds and not a line per connection."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

__all__ = ["RateLimitedLog"]


class RateLimitedLog:
    """At most one line per key every ``every`` seconds on ``logger``; the next line says how
    many were left out since. ``clock``: monotonic seconds (injected in tests)."""

    def __init__(self, logger: logging.Logger, every: float, clock: Callable[[], float] = time.monotonic):
        self._logger = logger
        self._every = every
        self._clock = clock
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._skipped: dict[str, int] = {}

    def log(self, key: str, level: int, message: str, *args: object) -> bool:
        """Logs ``message % args`` unless a line of ``key`` was logged within ``every`` seconds
        (then counts it as left out). Returns whether it logged."""
        now = self._clock()
        with self._lock:
            if now - self._last.get(key, -self._every) < self._every:
                self._skipped[key] = self._skipped.get(key, 0) + 1
                return False
            self._last[key] = now
            skipped = self._skipped.pop(key, 0)
        self._logger.log(level, message + (f" (and {skipped} more like it)" if skipped else ""), *args)
        return True

    def warning(self, key: str, message: str, *args: object) -> bool:
        return self.log(key, logging.WARNING, message, *args)
