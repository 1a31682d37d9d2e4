"""Hybrid training's rendezvous store (coordinator/dispatch/rendezvous_server.py) on 127.0.0.1, as
an attacker and as a member see it: it listens on the address it is told and nowhere else, answers
nothing to a client without the cluster's token (torch's own TCPStore client, raw bytes, a wrong
token), drops a connection that does not authenticate, gives a generation up to every member
waiting in it at once, carries a gloo rendezvous, and leaves no thread when stopped."""

from __future__ import annotations

import datetime
import pathlib
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist

from paramserve.coordinator.dispatch.dense_rounds import DenseRounds, DenseSettings
from paramserve.coordinator.dispatch.rendezvous_server import THREAD_NAME, RendezvousServer
from paramserve.psserver.runtime.security import new_handshake_nonce, rendezvous_key
from paramserve.worker.dense.rendezvous_store import RendezvousStore
from paramserve.worker.dense.rendezvous_wire import (
    HELLO,
    MAX_BODY_BYTES,
    REQUEST_HEAD,
    Kind,
    Op,
    RendezvousAborted,
    RendezvousError,
    frame,
    pack_fields,
    read_frame,
)

TOKEN = "rendezvous-test-token-0123456789"


def no_settings() -> DenseSettings:
    return DenseSettings((), b"", 0)


@pytest.fixture
def server() -> Iterator[RendezvousServer]:
    started = RendezvousServer("127.0.0.1", token=TOKEN)
    yield started
    assert started.stop()


def member(server: RendezvousServer, generation: int = 1, token: str = TOKEN, timeout: float = 10.0) -> RendezvousStore:
    key = rendezvous_key(token, server.session)
    return RendezvousStore("127.0.0.1", server.port, key=key, generation=generation, timeout=timeout)


def listening(port: int) -> set[str]:
    """The local addresses with a socket listening on ``port``, as the kernel lists them."""
    found = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        path = pathlib.Path("/proc/net") / table
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, port_hex = local.split(":")
            if state == "0A" and int(port_hex, 16) == port:  # 0A: LISTEN
                raw = bytes.fromhex(address)
                words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))  # each word in host order
                found.add(socket.inet_ntop(family, words))
    return found


def received_nothing(sock: socket.socket) -> bool:
    """Whether the peer closed ``sock`` without sending a byte (within 15 s)."""
    sock.settimeout(15)
    return sock.recv(1024) == b""


@pytest.mark.skipif(not pathlib.Path("/proc/net/tcp").exists(), reason="reads the kernel's /proc/net/tcp")
def test_the_store_listens_on_the_address_it_is_told_and_nowhere_else() -> None:
    rounds = DenseRounds(no_settings, bytes, rendezvous_host="127.0.0.1", timeout=10.0, token=TOKEN)
    try:
        port = int(rounds.store_address().rpartition(":")[2])
        assert listening(port) == {"127.0.0.1"}  # not "0.0.0.0", not "::"
    finally:
        rounds.close()


@pytest.mark.skipif(not pathlib.Path("/proc/net/tcp6").exists(), reason="reads the kernel's /proc/net/tcp6")
def test_an_ipv6_loopback_store_listens_on_it_alone() -> None:
    try:
        server = RendezvousServer("::1", token=TOKEN)
    except OSError:
        pytest.skip("no IPv6 loopback here")
    try:
        assert server.address == f"[::1]:{server.port}"
        assert listening(server.port) == {"::1"}
    finally:
        server.stop()


def test_a_wildcard_address_is_refused() -> None:
    with pytest.raises(ValueError, match="every interface"):
        RendezvousServer("0.0.0.0", token=TOKEN)


def test_a_client_without_the_token_gets_nothing_and_changes_nothing(server: RendezvousServer) -> None:
    owner = member(server)
    owner.set("0", b"the member's address")
    # torch's own TCPStore client: refused before any operation.
    with pytest.raises(dist.DistError):
        dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=3))
    # Raw bytes, a request frame without the handshake: closed, nothing sent back.
    raw = socket.create_connection(("127.0.0.1", server.port))
    raw.sendall(frame(Kind.REQUEST, REQUEST_HEAD.pack(Op.SET, 0) + pack_fields([b"0", b"an attacker's"])))
    assert received_nothing(raw)
    # A client of another token: the store's proof does not verify, nothing reusable is sent.
    with pytest.raises(RendezvousError, match="could not prove"):
        member(server, token="another-token-0123456789abcdef")
    # A handshake with a wrong proof: refused, then nothing answered.
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(frame(Kind.HELLO, HELLO.pack(new_handshake_nonce(), 1)))
    kind, _ = read_frame(sock, MAX_BODY_BYTES, time.monotonic() + 10)
    assert kind is Kind.CHALLENGE
    sock.sendall(frame(Kind.PROOF, bytes(32)))
    kind, reason = read_frame(sock, MAX_BODY_BYTES, time.monotonic() + 10)
    assert kind is Kind.REFUSED and b"wrong credential" in reason
    sock.sendall(frame(Kind.REQUEST, REQUEST_HEAD.pack(Op.GET, 0) + pack_fields([b"0"])))
    assert received_nothing(sock)
    # The member's view is as it was.
    assert owner.get("0") == b"the member's address"
    assert owner.num_keys() == 1
    owner.close()


def test_a_connection_that_does_not_authenticate_is_dropped_in_time() -> None:
    server = RendezvousServer("127.0.0.1", token=TOKEN, handshake_seconds=0.5)
    try:
        silent = socket.create_connection(("127.0.0.1", server.port))
        started = time.monotonic()
        assert received_nothing(silent)
        assert time.monotonic() - started < 5.0
    finally:
        server.stop()


def test_a_flood_of_silent_and_trickling_connections_leaves_members_served(server: RendezvousServer) -> None:
    """More connections that never authenticate than the store keeps handshake slots for (64),
    some trickling a byte now and then: the oldest are dropped for newcomers, and a member that
    does authenticate sets and reads a key within its deadline meanwhile."""
    flood = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(150)]
    try:
        for sock in flood[::10]:
            sock.sendall(b"\0")  # trickling: a byte of a prefix that never completes
        store = member(server, timeout=5.0)
        started = time.monotonic()
        store.set("rank0", b"address")
        assert store.get("rank0") == b"address"
        assert time.monotonic() - started < 2.0
        dropped = 0
        for sock in flood[:80]:  # the oldest: dropped for the newcomers, without a byte
            sock.settimeout(15)
            try:
                dropped += sock.recv(1024) == b""
            except ConnectionResetError:  # dropped with a trickled byte unread: the kernel resets it
                dropped += 1
        assert dropped == 80
    finally:
        for sock in flood:
            sock.close()


def test_members_waiting_in_a_generation_given_up_are_answered_at_once(server: RendezvousServer) -> None:
    waiting = member(server, generation=3, timeout=60.0)
    outcome: list[BaseException] = []

    def wait_for_a_member_that_never_comes() -> None:
        try:
            waiting.get("2")
        except RendezvousError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=wait_for_a_member_that_never_comes, name="test-rendezvous-waiter")
    thread.start()
    wait_until(lambda: server.waiting(3) == 1, 30)
    given_up = time.monotonic()
    server.abort(3, "worker 127.0.0.1:9 was lost")
    thread.join(30)
    assert not thread.is_alive() and time.monotonic() - given_up < 5.0
    assert isinstance(outcome[0], RendezvousAborted) and "127.0.0.1:9 was lost" in str(outcome[0])
    with pytest.raises(RendezvousAborted):
        waiting.set("late", b"1")  # the generation stays given up
    other = member(server, generation=4)
    other.set("k", b"v")  # the next one is open
    server.retire_below(5)
    with pytest.raises(RendezvousAborted, match="dense group 5 replaced it"):
        other.get("k")
    waiting.close()
    other.close()


def test_a_broken_round_gives_its_generation_up_and_a_new_one_retires_it() -> None:
    """The coordinator's side (DenseRounds): each round tells members the store's address and
    session; a member's failed call (``broke``) gives the generation up for the members still in
    its rendezvous; the next generation's formation frees the old one."""
    rounds = DenseRounds(no_settings, bytes, rendezvous_host="127.0.0.1", timeout=30.0, token=TOKEN)
    try:
        first = rounds.member_rounds(["127.0.0.1:1", "127.0.0.1:2"])
        spec = first[0].group
        assert spec.store_address == rounds.store_address() and spec.store_secret == rounds.store().session
        assert "store_secret" not in repr(spec)  # never logged
        key = rendezvous_key(TOKEN, spec.store_secret)
        host, _, port = spec.store_address.rpartition(":")
        waiting = RendezvousStore(host, int(port), key=key, generation=spec.generation, timeout=30.0)
        outcome: list[BaseException] = []
        thread = threading.Thread(target=lambda: outcome.append(_error_of(lambda: waiting.get("1"))), name="test-w")
        thread.start()
        wait_until(lambda: rounds.store().waiting(spec.generation) == 1, 30)
        rounds.broke("the round broke at worker 127.0.0.1:2")
        thread.join(10)
        assert isinstance(outcome[0], RendezvousAborted) and "127.0.0.1:2" in str(outcome[0])
        second = rounds.member_rounds(["127.0.0.1:1"])[0].group
        assert second.generation == spec.generation + 1 and second.store_secret == spec.store_secret
        waiting.close()
    finally:
        rounds.close()


def test_a_gloo_group_forms_on_the_store_and_its_stores_answer_as_torch_expects(server: RendezvousServer) -> None:
    stores = [member(server, generation=7) for _ in range(2)]
    groups: list[dist.ProcessGroup | None] = [None, None]

    def form(rank: int) -> None:
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._timeout = datetime.timedelta(seconds=20)
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        groups[rank] = dist.ProcessGroupGloo(stores[rank], rank, 2, options)

    threads = [threading.Thread(target=form, args=(rank,), name=f"test-gloo-{rank}") for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    values = [torch.full((3,), float(rank + 1)) for rank in range(2)]
    works = [group.allreduce([value]) for group, value in zip(groups, values) if group is not None]
    for work in works:
        work.wait()
    assert all(torch.equal(value, torch.full((3,), 3.0)) for value in values)
    # What torch's C++ side asks of a store, through a PrefixStore.
    prefixed = dist.PrefixStore("nccl/", stores[0])
    prefixed.set("id", "x")
    assert prefixed.add("count", 2) == 2 and prefixed.add("count", 3) == 5
    assert prefixed.compare_set("cas", "", "first") == b"first"
    assert prefixed.compare_set("cas", "wrong", "second") == b"first"
    assert prefixed.check(["id", "count"]) and not prefixed.check(["absent"])
    assert prefixed.delete_key("id") and not prefixed.delete_key("id")
    prefixed.wait(["count"], datetime.timedelta(seconds=5))
    assert stores[1].num_keys() == prefixed.num_keys()
    groups.clear()
    for store in stores:
        store.close()


def test_stopping_ends_waiting_members_requests_and_leaves_no_thread() -> None:
    server = RendezvousServer("127.0.0.1", token=TOKEN)
    waiting = member(server, timeout=60.0)
    outcome: list[BaseException] = []
    thread = threading.Thread(target=lambda: outcome.append(_error_of(lambda: waiting.get("never"))), name="test-w")
    thread.start()
    wait_until(lambda: server.waiting(1) == 1, 30)
    assert server.stop(timeout=10)
    thread.join(30)
    assert isinstance(outcome[0], RendezvousError)
    assert not [t for t in threading.enumerate() if t.name == THREAD_NAME]
    waiting.close()


def _error_of(call: Callable[[], object]) -> BaseException:
    try:
        call()
    except BaseException as exc:  # the test inspects whatever it was
        return exc
    raise AssertionError("no error")


def wait_until(condition: Callable[[], bool], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    pause = threading.Event()
    while not condition():
        assert time.monotonic() < deadline, f"not within {seconds}s"
        pause.wait(0.01)
