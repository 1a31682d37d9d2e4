"""Giving freed memory back to the operating system, in every long-running server.

glibc's allocator keeps what a process frees in its arenas for reuse, so the resident memory of
a server only ever grows to its peak: a burst of connections (gRPC buffers an HTTP/2 header
block of up to about a megabyte per connection before the peer acknowledges its SETTINGS, and
holds it until the settings timeout drops the peer), a restore, a large step. ``malloc_trim(0)``
returns the free pages; a server calls it every TRIM_EVERY_SECONDS on a thread of its own
(``paramserve-memory-trim``), which costs a heap walk and nothing when there is nothing to give,
and sooner once the work it did since the last trim freed TRIM_AFTER_BYTES (``released``: a
step of a large model frees its gradient, reply and undo copies, several times the model, which
would otherwise stay resident until the next round). A no-op where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = [
    "resident_bytes",
    "SERVER_ARENAS",
    "TRIM_AFTER_BYTES",
    "TRIM_EVERY_SECONDS",
    "MemoryTrimmer",
    "limit_arenas",
    "malloc_trim",
    "released",
]

TRIM_EVERY_SECONDS = 10.0
TRIM_AFTER_BYTES = 64 << 20
"""Freed since the last trim, this much has the trimmer trim once the work pauses."""
QUIET_SECONDS = 0.5
"""How long no release must come before that trim: steps that follow each other reuse the memory
the previous one freed, and trimming between them made every step fault its buffers in again
(a third of a server's CPU on the MLP 784-4096-2048-10; BENCHMARKS.md, note 7)."""

_released_lock = threading.Lock()
_released_bytes = 0
_last_release = float("-inf")
_released_enough = threading.Event()


def released(nbytes: int) -> None:
    """Tells the trimmers of this process that about ``nbytes`` were allocated and freed (cheap:
    a counter; the trim runs on the trimmer's thread, never the caller's)."""
    global _released_bytes, _last_release
    with _released_lock:
        _last_release = time.monotonic()
        _released_bytes += nbytes
        if _released_bytes >= TRIM_AFTER_BYTES:
            _released_bytes = 0
            _released_enough.set()


def _glibc(name: str, argtypes: list[Any]) -> Callable[..., int] | None:
    """The C library's function ``name``, or None where it has none (not glibc: musl, macOS).

    Looked up among the symbols the process has loaded (``CDLL(None)``), not by
    ``ctypes.util.find_library``, which forks ``ldconfig``: a fork in a process that imported
    gRPC runs gRPC's fork handlers, and a server's start must not."""
    try:
        function = getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None
    function.argtypes = argtypes
    function.restype = ctypes.c_int
    return function


_TRIM = _glibc("malloc_trim", [ctypes.c_size_t])
_MALLOPT = _glibc("mallopt", [ctypes.c_int, ctypes.c_int])

SERVER_ARENAS = 2
"""glibc's malloc arenas for a parameter server (its default: 8 per core). A server's large
buffers come and go on many threads (gRPC's, the data plane's connections); with an arena per
thread each keeps its own freed memory, which a trim cannot return while a live allocation sits
above it. Two arenas hold about a third less resident memory after a model's steps, at no cost
in step time measured (BENCHMARKS.md, ps_memory.py)."""
_M_ARENA_MAX = -8  # glibc's mallopt parameter number


def resident_bytes() -> int:
    """This process's resident memory in bytes (Linux's /proc/self/statm); 0 where unknown."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def limit_arenas(count: int = SERVER_ARENAS) -> bool:
    """Caps glibc's malloc arenas for this process (call before it starts threads); False where
    the C library is not glibc or refuses. ``MALLOC_ARENA_MAX`` in the environment wins."""
    if "MALLOC_ARENA_MAX" in os.environ or _MALLOPT is None:
        return False
    return bool(_MALLOPT(_M_ARENA_MAX, count))


def malloc_trim() -> bool:
    """Returns the process's free heap pages to the system; False where that cannot be done."""
    return bool(_TRIM(0)) if _TRIM is not None else False


class MemoryTrimmer:
    """Calls ``malloc_trim`` every ``every`` seconds until ``stop()``, and once TRIM_AFTER_BYTES
    were released, as soon as releases pause for QUIET_SECONDS."""

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
        _released_enough.set()  # wakes the thread to see the stop
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        # stop() sets _stop before it wakes the thread, and the wake-up is cleared before _stop
        # is read: a stop is never swallowed by a trim that a release woke the thread for.
        last_trim = time.monotonic()
        while not self._stop.is_set():
            woken = _released_enough.wait(self._every)
            _released_enough.clear()
            if self._stop.is_set():
                return
            if woken:
                self._wait_for_quiet(last_trim + self._every)
            malloc_trim()
            last_trim = time.monotonic()

    def _wait_for_quiet(self, deadline: float) -> None:
        """Waits until no release came for QUIET_SECONDS, the period's ``deadline`` or a stop."""
        while not self._stop.is_set():
            now = time.monotonic()
            with _released_lock:
                quiet = now - _last_release
            if quiet >= QUIET_SECONDS or now >= deadline:
                return
            self._stop.wait(min(QUIET_SECONDS - quiet, deadline - now))
