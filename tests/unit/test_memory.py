"""Returning freed memory: the trimmer's cadence, its wake-up after large releases, arena limits."""

from __future__ import annotations

import threading

import pytest

from paramserve.psserver import memory


@pytest.fixture
def counted_trims(monkeypatch):
    """malloc_trim replaced by a counter that signals each call."""
    calls = []
    called = threading.Event()

    def trim(pad: int) -> int:
        calls.append(pad)
        called.set()
        return 1

    monkeypatch.setattr(memory, "_TRIM", trim)
    monkeypatch.setattr(memory, "_released_bytes", 0)
    memory._released_enough.clear()
    return calls, called


def test_large_releases_wake_the_trimmer_before_its_interval(counted_trims):
    calls, called = counted_trims
    trimmer = memory.MemoryTrimmer(every=3600.0).start()  # the interval alone would never trim here
    try:
        memory.released(memory.TRIM_AFTER_BYTES // 2)
        assert not memory._released_enough.is_set(), "half the threshold does not wake it"
        memory.released(memory.TRIM_AFTER_BYTES // 2)
        assert called.wait(10), "the threshold wakes the trimmer"
        assert calls == [0]
    finally:
        trimmer.stop(timeout=10)
    assert not trimmer._thread.is_alive(), "stop() ends the trimmer's thread"


def test_releases_that_keep_coming_hold_the_trim_until_they_pause(counted_trims, monkeypatch):
    # Steps that follow each other reuse what the previous one freed: trimming between them
    # would make every step fault its buffers in again.
    calls, called = counted_trims
    monkeypatch.setattr(memory, "QUIET_SECONDS", 0.3)
    trimmer = memory.MemoryTrimmer(every=3600.0).start()
    try:
        memory.released(memory.TRIM_AFTER_BYTES)
        for _ in range(10):  # a step every 0.1 s: never 0.3 s quiet
            assert not called.wait(0.1), "no trim while releases keep coming"
            memory.released(1 << 20)
        assert called.wait(10), "the trim comes once they pause"
        assert calls == [0]
    finally:
        trimmer.stop(timeout=10)


def test_the_trimmer_trims_on_its_interval_without_releases(counted_trims):
    calls, called = counted_trims
    trimmer = memory.MemoryTrimmer(every=0.01).start()
    try:
        assert called.wait(10)
    finally:
        trimmer.stop(timeout=10)
    assert calls and not trimmer._thread.is_alive()


def test_the_environment_overrides_the_arena_limit(monkeypatch):
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert memory.limit_arenas() is False
