"""Memory diagnostics a server writes when asked: off unless its environment opts in.

``PARAMSERVE_DIAGNOSTICS=<directory>`` makes a server (``paramserve ps`` or ``paramserve
worker``) write ``<directory>/<role>-<pid>-<n>.json`` each time it receives SIGUSR1 (n counts
from 1), for finding what makes a long-running server's memory grow (benchmarks/soak.py
``--diagnostics``). One file holds:

- ``process``: resident memory (VmRSS, VmHWM), threads, descriptors by kind (``socket``,
  ``pipe``, ``anon_inode``, ``file``), Python's allocated blocks and gc counts;
- ``malloc``: glibc's ``malloc_info`` summed: arenas, bytes the arenas hold from the system,
  bytes free in them (kept, not returned), mmapped chunks; absent where the C library is not glibc;
- ``structures``: the sizes of what the server keeps per worker, per key and per connection
  (``RunningService.structure_sizes``: a parameter server's idempotency windows, optimizer
  groups, data-plane connections and step programs, ...);
- ``python_heap``, with ``PARAMSERVE_DIAGNOSTICS_TRACEMALLOC=<frames>`` also set (tracemalloc
  from when the server starts serving, ``frames`` deep; it slows allocation-heavy code): the
  traced total and the allocation sites that grew most since the first dump and since the
  previous one.

The dump runs on a thread of its own, never in the signal handler. Without the variable, SIGUSR1
keeps its default action (it ends the process) and nothing here runs.
"""

from __future__ import annotations

import ctypes
import gc
import json
import logging
import os
import re
import signal
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from paramserve.psserver.runtime.atomic_files import atomic_write

__all__ = [
    "DIRECTORY_ENV",
    "TRACEMALLOC_ENV",
    "Diagnostics",
    "from_environment",
    "malloc_summary",
    "top_growth",
]

DIRECTORY_ENV = "PARAMSERVE_DIAGNOSTICS"
TRACEMALLOC_ENV = "PARAMSERVE_DIAGNOSTICS_TRACEMALLOC"
TOP_SITES = 15

log = logging.getLogger(__name__)

Sites = dict[str, tuple[int, int]]
"""Allocation site (``file:line``, frames joined by `` <- ``) -> (bytes, blocks)."""


def top_growth(before: Sites, after: Sites, limit: int = TOP_SITES) -> list[dict[str, Any]]:
    """The ``limit`` sites whose traced bytes grew most from ``before`` to ``after``, largest first
    (sites that shrank or stayed are left out)."""
    grown: list[dict[str, Any]] = []
    for site, (size, count) in after.items():
        old_size, old_count = before.get(site, (0, 0))
        if size > old_size:
            grown.append({"site": site, "grew_bytes": size - old_size, "grew_blocks": count - old_count, "bytes": size})
    grown.sort(key=lambda entry: entry["grew_bytes"], reverse=True)
    return grown[:limit]


_TAG = re.compile(r"<(/?heap|total|system|aspace)\b([^>]*)>")
_ATTRIBUTE = re.compile(r'(\w+)="([^"]*)"')


def malloc_summary(xml: str) -> dict[str, int]:
    """The figures of glibc's ``malloc_info`` XML summed over its arenas: ``arenas``,
    ``system_bytes`` (what the arenas hold from the system now), ``free_bytes`` (free chunks
    kept in them: fast bins and the rest), ``in_use_bytes`` (the difference), ``mmap_chunks``
    and ``mmap_bytes`` (large allocations mapped on their own)."""
    arenas = system = free = mmap_count = mmap_size = 0
    in_heap = False
    for match in _TAG.finditer(xml):
        tag, attributes = match.group(1), dict(_ATTRIBUTE.findall(match.group(2)))
        if tag == "heap":
            arenas += 1
            in_heap = True
            continue
        if tag == "/heap":
            in_heap = False  # what follows the last heap are the process's totals
            continue
        size = int(attributes.get("size", 0) or 0)
        kind = attributes.get("type")
        if in_heap:
            if tag == "total" and kind in ("fast", "rest"):
                free += size
            elif tag == "system" and kind == "current":
                system += size
        elif tag == "total" and kind == "mmap":
            mmap_count, mmap_size = int(attributes.get("count", 0) or 0), size
    return {
        "arenas": arenas,
        "system_bytes": system,
        "free_bytes": free,
        "in_use_bytes": system - free,
        "mmap_chunks": mmap_count,
        "mmap_bytes": mmap_size,
    }


def malloc_info() -> str | None:
    """glibc's ``malloc_info(0, ...)`` XML, or None where the C library has none."""
    try:
        libc = ctypes.CDLL(None)
        open_memstream, info, fclose, free = libc.open_memstream, libc.malloc_info, libc.fclose, libc.free
    except (OSError, AttributeError):
        return None
    open_memstream.restype = ctypes.c_void_p
    open_memstream.argtypes = [ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_size_t)]
    info.argtypes, fclose.argtypes, free.argtypes = (
        [ctypes.c_int, ctypes.c_void_p],
        [ctypes.c_void_p],
        [ctypes.c_void_p],
    )
    buffer, length = ctypes.c_char_p(), ctypes.c_size_t()
    stream = open_memstream(ctypes.byref(buffer), ctypes.byref(length))
    if not stream:
        return None
    info(0, stream)
    fclose(stream)
    try:
        return ctypes.string_at(buffer, length.value).decode("ascii", "replace")
    finally:
        free(ctypes.cast(buffer, ctypes.c_void_p))


def process_counts() -> dict[str, Any]:
    """Resident memory, threads, descriptors by kind, Python's blocks: from /proc/self."""
    counts: dict[str, Any] = {}
    try:
        with open("/proc/self/status") as status:
            for line in status:
                name, _, value = line.partition(":")
                if name in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "Threads"):
                    counts[name] = int(value.split()[0]) * (1024 if value.strip().endswith("kB") else 1)
    except OSError:
        pass
    kinds: dict[str, int] = {}
    try:
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            kind = target.split(":", 1)[0] if ":" in target and not target.startswith("/") else "file"
            kinds[kind] = kinds.get(kind, 0) + 1
    except OSError:
        pass
    counts["descriptors"] = sum(kinds.values())
    counts["descriptors_by_kind"] = kinds
    counts["python_threads"] = threading.active_count()
    counts["python_blocks"] = sys.getallocatedblocks()
    counts["gc_counts"] = list(gc.get_count())
    return counts


class Diagnostics:
    """Writes a dump into ``directory`` on each ``dump()`` (or SIGUSR1, once ``install``ed)."""

    def __init__(
        self, directory: Path, role: str, structures: Callable[[], Mapping[str, Any]], trace_frames: int = 0
    ) -> None:
        self._directory = directory
        self._role = role
        self._structures = structures
        self._trace_frames = trace_frames
        self._lock = threading.Lock()
        self._count = 0
        self._first: Sites | None = None
        self._previous: Sites | None = None
        if trace_frames > 0 and not tracemalloc.is_tracing():
            tracemalloc.start(trace_frames)

    def collect(self) -> dict[str, Any]:
        """One dump's content (see the module's docstring)."""
        report: dict[str, Any] = {"role": self._role, "pid": os.getpid(), "time": time.time()}
        report["process"] = process_counts()
        xml = malloc_info()
        if xml is not None:
            report["malloc"] = malloc_summary(xml)
        try:
            report["structures"] = dict(self._structures())
        except Exception as exc:  # a dump must not take the server down
            report["structures"] = {"error": repr(exc)}
        if tracemalloc.is_tracing():
            report["python_heap"] = self._heap()
        return report

    def dump(self) -> Path:
        """Writes the next ``<role>-<pid>-<n>.json``; returns its path."""
        with self._lock:
            self._count += 1
            path = self._directory / f"{self._role}-{os.getpid()}-{self._count}.json"
            report = self.collect()
            report["dump"] = self._count
            atomic_write(path, lambda file: file.write(json.dumps(report, indent=1).encode()))
            return path

    def install(self) -> None:
        """SIGUSR1 starts a dump on a thread of its own (call from the main thread)."""

        def requested(*_: object) -> None:
            threading.Thread(target=self._dump_logging, name="paramserve-diagnostics", daemon=True).start()

        signal.signal(signal.SIGUSR1, requested)

    def _dump_logging(self) -> None:
        try:
            log.info("diagnostics written to %s", self.dump())
        except Exception:
            log.exception("could not write diagnostics")

    def _heap(self) -> dict[str, Any]:
        snapshot = tracemalloc.take_snapshot().filter_traces(
            [tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, __file__)]
        )
        sites: Sites = {}
        for statistic in snapshot.statistics("traceback"):
            site = " <- ".join(f"{frame.filename}:{frame.lineno}" for frame in statistic.traceback)
            sites[site] = (statistic.size, statistic.count)
        first, previous = self._first, self._previous
        if first is None:
            self._first = first = sites
        self._previous = sites
        return {
            "traced_bytes": sum(size for size, _ in sites.values()),
            "traced_blocks": sum(count for _, count in sites.values()),
            "tracemalloc_overhead_bytes": tracemalloc.get_tracemalloc_memory(),
            "grew_since_first": top_growth(first, sites),
            "grew_since_previous": top_growth(previous or sites, sites),
        }


def from_environment(
    role: str, structures: Callable[[], Mapping[str, Any]], environ: Mapping[str, str] = os.environ
) -> Diagnostics | None:
    """The Diagnostics ``environ`` asks for (``PARAMSERVE_DIAGNOSTICS``), or None: off."""
    directory = environ.get(DIRECTORY_ENV)
    if not directory:
        return None
    frames = environ.get(TRACEMALLOC_ENV, "0")
    return Diagnostics(Path(directory), role, structures, int(frames) if frames.isdigit() else 0)
