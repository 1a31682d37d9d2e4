"""Hybrid training's rendezvous store without sockets: the state (StoreTable) does what
torch.distributed's stores do, per generation, gives a generation up for good, frees what it
retires and stays under its size; the wire refuses what breaks its limits before allocating."""

from __future__ import annotations

import pytest

from paramserve.coordinator.dispatch.rendezvous_server import StoreFull, StoreTable
from paramserve.psserver.runtime.security import rendezvous_key
from paramserve.worker.dense.rendezvous_wire import (
    MAX_FIELDS,
    PREFIX,
    Kind,
    RendezvousAborted,
    WireError,
    decode_int,
    encode_int,
    frame,
    pack_fields,
    parse_prefix,
    unpack_fields,
)


def test_operations_are_torch_stores_and_each_generation_has_its_own_keys() -> None:
    table = StoreTable()
    table.set(1, b"0", b"address of rank 0")
    assert table.get(1, b"0") == b"address of rank 0" and table.get(2, b"0") is None
    assert table.add(1, b"count", 2) == 2 and table.add(1, b"count", -5) == -3
    assert table.check(1, [b"0", b"count"]) and not table.check(1, [b"0", b"1"])
    assert table.num_keys(1) == 2 and table.num_keys(2) == 0
    assert table.delete(1, b"0") and not table.delete(1, b"0")
    table.set(1, b"text", b"abc")
    with pytest.raises(ValueError, match="not a number"):
        table.add(1, b"text", 1)


def test_compare_set_is_torchs() -> None:
    table = StoreTable()
    assert table.compare_set(1, b"k", b"expected", b"new") == b"expected"  # missing, expecting a value
    assert table.get(1, b"k") is None
    assert table.compare_set(1, b"k", b"", b"first") == b"first"  # missing, expecting nothing: set
    assert table.compare_set(1, b"k", b"other", b"second") == b"first"  # a mismatch answers the value
    assert table.compare_set(1, b"k", b"first", b"second") == b"second"


def test_a_generation_given_up_refuses_everything_for_good_and_frees_its_keys() -> None:
    table = StoreTable()
    table.set(3, b"0", b"x" * 100)
    held = table.bytes_held
    table.abort(3, "worker a:1 was lost")
    assert table.bytes_held == 0 < held
    assert table.given_up(3) == "worker a:1 was lost"
    for operation in (lambda: table.set(3, b"1", b""), lambda: table.get(3, b"0"), lambda: table.check(3, [b"0"])):
        with pytest.raises(RendezvousAborted, match="dense group 3 was given up: worker a:1 was lost"):
            operation()
    table.abort(3, "a later reason")
    assert table.given_up(3) == "worker a:1 was lost"  # the first reason stays
    table.set(4, b"0", b"y")  # the next generation is open


def test_retiring_frees_older_generations_and_closing_gives_up_every_one() -> None:
    table = StoreTable()
    for generation in (1, 2, 3):
        table.set(generation, b"k", b"v")
    table.abort(2, "lost")
    table.retire_below(3, "dense group 3 replaced it")
    assert table.given_up(1) == table.given_up(2) == "dense group 3 replaced it"
    assert table.given_up(3) is None and table.get(3, b"k") == b"v"
    assert table.bytes_held == len(b"k") + len(b"v") + 64
    table.close("stopped")
    assert table.given_up(3) == table.given_up(10**9) == "stopped" and table.bytes_held == 0


def test_the_store_refuses_to_grow_past_its_size_and_changes_nothing() -> None:
    table = StoreTable(max_bytes=1000)
    table.set(1, b"a", b"x" * 800)
    with pytest.raises(StoreFull):
        table.set(1, b"b", b"x" * 200)
    assert table.get(1, b"b") is None
    table.set(1, b"a", b"x" * 900)  # replacing counts the difference
    assert table.bytes_held == 1 + 900 + 64


def test_frames_over_their_limit_or_not_ours_are_refused_from_the_prefix() -> None:
    assert parse_prefix(frame(Kind.HELLO, b"x" * 40)[: PREFIX.size], 40) == (Kind.HELLO, 40)
    with pytest.raises(WireError, match="over the limit"):
        parse_prefix(frame(Kind.REQUEST, b"")[:5] + (1 << 30).to_bytes(4, "big"), 1 << 20)
    with pytest.raises(WireError, match="not a rendezvous frame"):
        parse_prefix(b"GET / HTT", 1 << 20)
    with pytest.raises(WireError, match="unknown frame kind"):
        parse_prefix(b"PSR1\x63\x00\x00\x00\x00", 1 << 20)


def test_fields_round_trip_and_truncated_or_too_many_are_refused() -> None:
    fields = [b"", b"key", bytes(range(256))]
    assert unpack_fields(pack_fields(fields)) == fields
    assert decode_int(encode_int(-(2**63))) == -(2**63)
    with pytest.raises(WireError):
        unpack_fields(pack_fields([b"abc"])[:-1])
    with pytest.raises(WireError):
        unpack_fields(b"\x00\x00")
    with pytest.raises(WireError):
        unpack_fields(pack_fields([b""] * (MAX_FIELDS + 1)))


def test_the_stores_key_needs_both_the_token_and_the_session() -> None:
    session, other = bytes(32), bytes([1] * 32)
    key = rendezvous_key("token-0123456789abcdef", session)
    assert key == rendezvous_key("token-0123456789abcdef", session)
    assert key != rendezvous_key("token-0123456789abcdeX", session)
    assert key != rendezvous_key("token-0123456789abcdef", other)
    assert key != rendezvous_key(None, session) != rendezvous_key(None, other)
