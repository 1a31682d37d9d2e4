"""Giving freed memory back to the operating system, in every long-running server.

glibc's allocator keeps what a process frees in its arenas for reuse, so the resident memory of
a server only ever grows to its peak: a burst of connections (gRPC buffers an HTTP/2 header
block of up to about a megabyte per connection before the peer acknowledges its SETTINGS, and
holds it until the settings timeout drops the peer), a restore, a large step. ``malloc_trim(0)``
returns the free pages; a server calls it every TRIM_EVERY_SECONDS on a thread of its own
(``paramserve-memory-trim``), which costs a heap walk and nothing when there is nothing to give.
A no-op where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
from collections.abc import Callable

__all__ = ["MemoryTrimmer", "TRIM_EVERY_SECONDS", "malloc_trim"]

TRIM_EVERY_SECONDS = 10.0


def _glibc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


_TRIM = _glibc_trim()


def malloc_trim() -> bool:
    """Returns the process's free heap pages to the system; False where that cannot be done."""
    return bool(_TRIM(0)) if _TRIM is not None else False


class MemoryTrimmer:
    """Calls ``malloc_trim`` every ``every`` seconds until ``stop()``."""

    def __init__(self, every: float = TRIM_EVERY_SECONDS):
        self._every = every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="paramserve-memory-trim", daemon=True)

    def start(self) -> MemoryTrimmer:
        if _TRIM is not None:
            self._thread.start()
        return self

    def stop(self, timeout: float | None = None) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            malloc_trim()
