"""Returning freed memory: the trimmer's cadence, its wake-up after large releases, arena limits."""

from __future__ import annotations

import threading

import pytest

from paramserve.psserver.runtime import memory


class CountedTrims:
    """malloc_trim replaced by a counter of the trims made by the trimmers this test starts.
    Another trimmer may be alive in this process (an in-process server's, from an earlier test of
    the same worker): it calls the same function and must not count (once it did: two trims
    where the test's trimmer made one)."""

    def __init__(self) -> None:
        self.calls: list[int] = []
        self.called = threading.Event()
        self._threads: set[threading.Thread] = set()

    def trim(self, pad: int) -> int:
        if threading.current_thread() in self._threads:
            self.calls.append(pad)
            self.called.set()
        return 1

    def start(self, every: float) -> memory.MemoryTrimmer:
        trimmer = memory.MemoryTrimmer(every=every)
        self._threads.add(trimmer._thread)  # made in the constructor, before it can trim
        return trimmer.start()


@pytest.fixture
def counted_trims(monkeypatch):
    counted = CountedTrims()
    monkeypatch.setattr(memory, "_TRIM", counted.trim)
    monkeypatch.setattr(memory, "_released_bytes", 0)
    memory._released_enough.clear()
    return counted


def test_large_releases_wake_the_trimmer_before_its_interval(counted_trims):
    trimmer = counted_trims.start(every=3600.0)  # the interval alone would never trim here
    try:
        memory.released(memory.TRIM_AFTER_BYTES // 2)
        assert not memory._released_enough.is_set(), "half the threshold does not wake it"
        memory.released(memory.TRIM_AFTER_BYTES // 2)
        assert counted_trims.called.wait(10), "the threshold wakes the trimmer"
        assert counted_trims.calls == [0]
    finally:
        trimmer.stop(timeout=10)
    assert not trimmer._thread.is_alive(), "stop() ends the trimmer's thread"


def test_releases_that_keep_coming_hold_the_trim_until_they_pause(counted_trims, monkeypatch):
    # Steps that follow each other reuse what the previous one freed: trimming between them
    # would make every step fault its buffers in again.
    monkeypatch.setattr(memory, "QUIET_SECONDS", 0.3)
    trimmer = counted_trims.start(every=3600.0)
    try:
        memory.released(memory.TRIM_AFTER_BYTES)
        for _ in range(10):  # a step every 0.1 s: never 0.3 s quiet
            assert not counted_trims.called.wait(0.1), "no trim while releases keep coming"
            memory.released(1 << 20)
        assert counted_trims.called.wait(10), "the trim comes once they pause"
        assert counted_trims.calls == [0]
    finally:
        trimmer.stop(timeout=10)


def test_the_trimmer_trims_on_its_interval_without_releases(counted_trims):
    trimmer = counted_trims.start(every=0.01)
    try:
        assert counted_trims.called.wait(10)
    finally:
        trimmer.stop(timeout=10)
    assert counted_trims.calls and not trimmer._thread.is_alive()


def test_the_environment_overrides_the_arena_limit(monkeypatch):
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert memory.limit_arenas() is False
