"""The bounded window of applied idempotency keys."""

from __future__ import annotations

import pytest

from paramserve.psserver.store.idempotency import IdempotencyWindow


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
