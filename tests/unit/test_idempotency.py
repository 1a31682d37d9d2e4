"""The bounded window of applied idempotency keys."""

from __future__ import annotations

import pytest

from paramserve.psserver.store.idempotency import KEY_BYTES, IdempotencyWindow, window_bytes


def test_remembers_recorded_keys() -> None:
    window = IdempotencyWindow(3)
    window.record("a")
    assert "a" in window
    assert "b" not in window


def test_evicts_oldest_beyond_capacity() -> None:
    window = IdempotencyWindow(2)
    for key in ("a", "b", "c"):
        window.record(key)
    assert "a" not in window
    assert window.keys() == ["b", "c"]
    assert len(window) == 2


def test_rerecord_makes_key_newest() -> None:
    window = IdempotencyWindow(2)
    for key in ("a", "b", "a", "c"):
        window.record(key)
    assert window.keys() == ["a", "c"]


def test_from_keys_keeps_newest() -> None:
    window = IdempotencyWindow.from_keys(["k1", "k2", "k3", "k4"], capacity=2)
    assert window.keys() == ["k3", "k4"]
    assert window.capacity == 2


def test_memory_is_bounded() -> None:
    window = IdempotencyWindow(100)
    for index in range(10_000):
        window.record(f"key-{index}")
    assert len(window) == 100
    assert window.keys()[0] == "key-9900"


@pytest.mark.parametrize("bad", [0, -5, 2.0, True])
def test_rejects_bad_capacity(bad: object) -> None:
    with pytest.raises(ValueError, match="capacity"):
        IdempotencyWindow(bad)  # type: ignore[arg-type]


def test_a_window_allocates_its_memory_when_made_and_keeps_no_object_per_worker_key() -> None:
    """Issue 49: a window that grew by a few hundred bytes a push read, for its first 65,536
    pushes, as a leak. Workers' keys (``<closure id>/<n>``, ``<closure id>/dense/<n>``) fit a slot."""
    import tracemalloc
    import uuid

    window = IdempotencyWindow(4096)
    assert window.allocated_bytes() == 0 and window.keys() == [] and "a" not in window, "nothing before a key"
    window.record("first")  # the whole window, at once
    assert window.allocated_bytes() == window_bytes(4096)
    keys = [f"{uuid.uuid4().hex}/{n % 7}" for n in range(6000)] + [f"{uuid.uuid4().hex}/dense/{n}" for n in range(200)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for key in keys:
            window.record(key)
        grew = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grew < 4096, f"recording {len(keys)} keys kept {grew} bytes"
    assert len(window) == 4096 and window.keys()[-1] == keys[-1] and keys[-4096] in window
    assert window_bytes(65536) == 65536 * 65


def test_a_long_key_is_remembered_exactly_beside_the_ring() -> None:
    long_key, other = "x" * (KEY_BYTES + 1), "y" * (KEY_BYTES + 1)
    window = IdempotencyWindow(2)
    window.record(long_key)
    assert long_key in window and other not in window and window.keys() == [long_key]
    window.record("a")
    window.record("b")
    assert long_key not in window and window.keys() == ["a", "b"]
