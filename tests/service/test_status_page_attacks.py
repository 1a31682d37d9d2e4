"""The status page under attack, from anyone who can reach its port, key or no key (issue #43):
silent connections, trickling ones, a flood of connections (held, or reopened as fast as the page
drops them), and a coordinator short of descriptors. The page runs alone in a process of its own
(``status_page_process.py``, a soft descriptor limit of 256, requests due within REQUEST_SECONDS),
as it runs in the coordinator's; every attack comes from real sockets on 127.0.0.1, and a key
holder's GET of /status.json must still be answered."""

from __future__ import annotations

import http.client
import json
import math
import os
import pathlib
import queue
import resource
import selectors
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

from paramserve.coordinator.status.cluster_status import status_key
from paramserve.coordinator.status.page_server import (
    PageLimits,
    PageServer,
    defer_accept_seconds,
    descriptor_reserve,
)

HELPER = pathlib.Path(__file__).with_name("status_page_process.py")
TOKEN = "status-page-attack-token-0123456789"
KEY = status_key(TOKEN)
SOFT_LIMIT = 256
REQUEST_SECONDS = 2.0
SLACK_SECONDS = 1.5
"""How late past its deadline a connection may be seen dropped (a loaded 2-core machine)."""
ANSWER_SECONDS = 2.0
"""The longest a key holder may wait for the page, whatever the attack."""
FLOOD = 1500
FLOOD_SECONDS = 30.0
"""The most the flood is given to open its connections (it takes a fraction of a second)."""
RECONNECTING_REQUEST_SECONDS = 10.0
"""The request deadline of the page a reconnecting flood attacks: the default, as in the
coordinator (silent connections then wait 3 s in the kernel: ``defer_accept_seconds``)."""
RECONNECTING_SECONDS = 8.0
"""How long the reconnecting flood is kept up: past its silent connections' first hand-over."""
READ_EVERY = 0.25
"""Seconds between a key holder's reads while the flood is kept up."""
DROPS = ("evicted", "receiving_deadline")
"""The page's counts of connections it took and dropped while they sent no request."""

pytestmark = pytest.mark.skipif(not pathlib.Path("/proc/self/fd").is_dir(), reason="counts descriptors in /proc")


class PageProcess:
    """The page's process and its command line on stdin (see status_page_process.py)."""

    def __init__(self, request_seconds: float = REQUEST_SECONDS) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(HELPER), "--soft-limit", str(SOFT_LIMIT), "--request-seconds", str(request_seconds)]
            + ["--token", TOKEN],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        started = self._next(120)
        self.port: int = started["port"]
        self.address = ("127.0.0.1", self.port)

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._lines.put(line)

    def _next(self, timeout: float) -> dict[str, Any]:
        try:
            return dict(json.loads(self._lines.get(timeout=timeout)))
        except queue.Empty:
            raise AssertionError(f"the page's process said nothing within {timeout} s") from None

    def ask(self, command: str, timeout: float = 20) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return self._next(timeout)

    def cpu(self) -> float:
        return float(self.ask("cpu")["cpu"])

    def descriptors(self) -> int:
        return int(self.ask("descriptors")["open"])

    def stop(self) -> None:
        try:
            assert self.ask("quit")["stopped"], "the page's threads outlived stop()"
        finally:
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=20)


@pytest.fixture(scope="module")
def page_process():
    served = PageProcess()
    yield served
    served.stop()


def key_holder_seconds(port: int, within: float = ANSWER_SECONDS) -> float:
    """How long a key holder's GET of /status.json took to be answered (inf: not within ``within``)."""
    started = time.monotonic()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=within)
    try:
        connection.request("GET", f"/status.json?key={KEY}")
        reply = connection.getresponse()
        answered = reply.status == 200 and "workers" in json.loads(reply.read())
    except OSError:
        return math.inf
    finally:
        connection.close()
    took = time.monotonic() - started
    return took if answered and took <= within else math.inf


def connect(address: tuple[str, int]) -> tuple[socket.socket, float]:
    """A non-blocking connection to the page, and when it was made."""
    sock = socket.create_connection(address, timeout=10)
    sock.setblocking(False)
    return sock, time.monotonic()


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the page closed ``sock`` (a non-blocking socket that the page sends nothing)."""
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:  # reset
        return True


def seconds_until_closed(socks: list[socket.socket], opened: list[float], deadline: float) -> list[float]:
    """Waits until the page closed each of ``socks`` or ``deadline`` passed; when each was closed,
    in seconds since it was ``opened`` (inf: still open)."""
    closed = [math.inf] * len(socks)
    with selectors.DefaultSelector() as selector:
        for index, sock in enumerate(socks):
            selector.register(sock, selectors.EVENT_READ, index)
        while selector.get_map() and time.monotonic() < deadline:
            for key, _ in selector.select(deadline - time.monotonic()):
                if closed_by_peer(key.fileobj):  # type: ignore[arg-type]
                    closed[key.data] = time.monotonic() - opened[key.data]
                    selector.unregister(key.fileobj)
    return closed


def close_all(socks: list[socket.socket]) -> None:
    for sock in socks:
        sock.close()


def test_silent_connections_are_dropped_at_the_request_deadline(page_process):
    silent, opened = zip(*(connect(page_process.address) for _ in range(40)))
    try:
        closed = seconds_until_closed(
            list(silent), list(opened), time.monotonic() + REQUEST_SECONDS + 2 * SLACK_SECONDS
        )
    finally:
        close_all(list(silent))
    assert max(closed) <= REQUEST_SECONDS + SLACK_SECONDS, f"dropped after {sorted(closed)} s"
    assert min(closed) >= REQUEST_SECONDS / 2, "none is dropped long before its deadline"


def test_trickling_clients_do_not_keep_a_key_holder_from_the_page(page_process):
    """Ten connections each sending a byte of a request every second: the page cuts them at the
    request deadline (bytes do not extend it), and meanwhile a key holder is answered at once."""
    request = f"GET /status.json?key={KEY} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode()
    trickling = [connect(page_process.address)[0] for _ in range(10)]
    started = time.monotonic()
    cut = [math.inf] * len(trickling)
    first_bytes_sent, stop = threading.Event(), threading.Event()

    def trickle() -> None:
        for tick in range(int(REQUEST_SECONDS + 2 * SLACK_SECONDS) + 1):  # a byte a second, bounded
            for index, sock in enumerate(trickling):
                if cut[index] == math.inf and closed_by_peer(sock):
                    cut[index] = time.monotonic() - started
                elif cut[index] == math.inf:
                    try:
                        sock.send(request[tick : tick + 1])
                    except OSError:
                        cut[index] = time.monotonic() - started
            first_bytes_sent.set()
            if max(cut) < math.inf or stop.wait(1.0):
                return

    trickler = threading.Thread(target=trickle, daemon=True)
    trickler.start()
    try:
        assert first_bytes_sent.wait(10)
        waited = key_holder_seconds(page_process.port)
        trickler.join(REQUEST_SECONDS + 2 * SLACK_SECONDS + 10)
    finally:
        stop.set()
        trickler.join(10)
        close_all(trickling)
    assert waited <= ANSWER_SECONDS, "a key holder waited behind the trickling connections"
    assert max(cut) <= REQUEST_SECONDS + SLACK_SECONDS + 1.0, f"trickling connections cut after {cut} s"


def test_the_page_gives_way_when_the_coordinator_needs_its_descriptors(page_process):
    """With the process's descriptors at its soft limit less the reserve (the coordinator's own
    work), a reader's connection waits in the listen backlog, answered once they are free again."""
    line = SOFT_LIMIT - descriptor_reserve(SOFT_LIMIT)
    held = page_process.ask(f"hold {line - page_process.descriptors() + 1}")["held"]
    try:
        assert page_process.descriptors() > line
        reader = socket.create_connection(page_process.address, timeout=10)
        reader.sendall(f"GET /status.json?key={KEY} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
        reader.settimeout(1.0)
        with pytest.raises(TimeoutError):
            reader.recv(1)  # not accepted: the page keeps off the reserve
        assert page_process.descriptors() > line
    finally:
        page_process.ask("release")
    try:
        started = time.monotonic()
        reader.settimeout(ANSWER_SECONDS)
        status_line = b"".join(iter(lambda: reader.recv(4096), b""))[:12]
        assert status_line == b"HTTP/1.0 200", "answered once the descriptors are free"
        assert time.monotonic() - started <= ANSWER_SECONDS
        assert held > 0
    finally:
        reader.close()


def test_an_accept_out_of_descriptors_backs_off_instead_of_spinning():
    """The process at its descriptor limit (the page told it cannot count them, so it tries):
    each failed accept pauses accepting, for longer each time, and a waiting reader is answered
    once descriptors are free again."""
    spent, answered = [0.0], b"HTTP/1.0 200 OK\r\n\r\nok"
    server = PageServer(
        ("127.0.0.1", 0),
        lambda request, peer: answered,
        PageLimits(),
        thread_name="test-page-http",
        request_threads="test-page-request",
        on_cpu=lambda seconds: spent.__setitem__(0, spent[0] + seconds),
        descriptors=lambda: None,
    )
    server.start()
    reader = socket.socket()  # its descriptor before the limit; connecting needs none
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowest_free = os.open(os.devnull, os.O_RDONLY)
    os.close(lowest_free)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))  # a new descriptor: EMFILE
        try:
            reader.connect(("127.0.0.1", server.port))
            reader.sendall(b"GET / HTTP/1.0\r\n\r\n")
            before = spent[0]
            threading.Event().wait(1.5)  # a fixed window at the limit
            window_cpu = spent[0] - before
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        reader.settimeout(ANSWER_SECONDS)
        reply = b"".join(iter(lambda: reader.recv(4096), b""))
        failed = server.counts().get("accept_failed_EMFILE", 0)
    finally:
        reader.close()
        assert server.stop(10)
    assert reply == answered, "answered once descriptors were free"
    assert 1 <= failed <= 12, f"{failed} failed accepts in 1.5 s: a backoff, not a loop"
    assert window_cpu < 0.2, f"{window_cpu:.2f} CPU-s in 1.5 s at the limit"


@pytest.fixture
def many_descriptors():
    """This test process's soft descriptor limit raised to hold the flood (and put back)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = FLOOD + 512
    if hard != resource.RLIM_INFINITY and hard < needed:
        pytest.skip(f"the flood needs {needed} descriptors; this process may open {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, needed), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_connection_flood_leaves_the_coordinator_its_descriptors_and_the_page_answering(
    page_process, many_descriptors
):
    """1,500 connections opened and held, no key: the page's process keeps under its soft limit
    less the reserve and can open files, a key holder is answered during the flood and after it,
    and the accept loop does not spin (the process's CPU over the held flood stays small)."""
    flood: list[socket.socket] = []
    flooded = threading.Event()

    def open_flood() -> None:
        try:
            while len(flood) < FLOOD and time.monotonic() < started + FLOOD_SECONDS:
                flood.append(socket.create_connection(page_process.address, timeout=5))
        except OSError:
            pass  # refused or timed out: the page stopped accepting (asserted below)
        finally:
            flooded.set()

    cpu_before, started = page_process.cpu(), time.monotonic()
    flooder = threading.Thread(target=open_flood, daemon=True)
    flooder.start()
    during, descriptors = [], []
    try:
        while not flooded.is_set() and time.monotonic() < started + FLOOD_SECONDS:
            during.append(key_holder_seconds(page_process.port))
            descriptors.append(page_process.descriptors())
        flooder.join(FLOOD_SECONDS)
        flood_seconds = time.monotonic() - started
        flood_cpu = page_process.cpu() - cpu_before
        descriptors.append(page_process.descriptors())
        held_cpu = page_process.cpu()
        threading.Event().wait(2.0)  # a fixed window with the flood held open
        held_cpu = page_process.cpu() - held_cpu
        after = key_holder_seconds(page_process.port)
        opened_files = page_process.ask("open 32")["opened"]
        descriptors.append(page_process.descriptors())
    finally:
        close_all(flood)
    assert len(flood) == FLOOD, f"{len(flood)} of the flood's connections taken in {flood_seconds:.1f} s"
    assert max(descriptors) < SOFT_LIMIT - descriptor_reserve(SOFT_LIMIT), f"open descriptors: {descriptors}"
    assert opened_files == 32, "the coordinator's process could not open files during the flood"
    assert max(during, default=0.0) <= ANSWER_SECONDS and after <= ANSWER_SECONDS, (during, after)
    assert held_cpu < 0.3, f"{held_cpu:.2f} CPU-s in 2 s with the flood held: the accept loop spins"
    assert flood_cpu < 0.5 + 0.002 * FLOOD, f"{flood_cpu:.2f} CPU-s over the {flood_seconds:.1f} s flood"


class ReconnectingFlood:
    """``count`` silent connections to ``address``, each one the page drops opened again at once
    (as benchmarks/status_flood.py's attacker does), on a thread of its own until ``stop()``."""

    def __init__(self, address: tuple[str, int], count: int):
        self._address = address
        self._selector = selectors.DefaultSelector()
        self._stopping = threading.Event()
        self.opened = self.cut = 0
        self.first_opened = time.monotonic()
        for _ in range(count):
            self._open()
        self._thread = threading.Thread(target=self._keep_up, daemon=True)
        self._thread.start()

    def _open(self) -> None:
        sock = socket.socket()
        sock.setblocking(False)
        sock.connect_ex(self._address)
        self._selector.register(sock, selectors.EVENT_READ)
        self.opened += 1

    def _keep_up(self) -> None:
        while not self._stopping.is_set():
            for key, _ in self._selector.select(0.1):
                sock: socket.socket = key.fileobj  # type: ignore[assignment]
                if not closed_by_peer(sock):
                    continue
                self._selector.unregister(sock)
                sock.close()
                self.cut += 1
                self._open()

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(10)
        for key in list(self._selector.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        self._selector.close()


def test_a_reconnecting_flood_of_silent_connections_waits_in_the_kernel_and_never_delays_a_key_holder(
    many_descriptors,
):
    """1,500 silent connections, each one dropped opened again at once, at a page with the
    coordinator's request deadline: the kernel keeps each one back for a period
    (``defer_accept_seconds``, TCP_DEFER_ACCEPT) before the page accepts (and drops) it, so over
    the flood the page handles each at most once a period, not as fast as the flood reconnects;
    its accept queue never fills, and a key holder reading every READ_EVERY seconds is answered
    each time within ANSWER_SECONDS (its SYN never dropped and sent again a second later)."""
    deferred = defer_accept_seconds(RECONNECTING_REQUEST_SECONDS)
    assert deferred >= 1
    page = PageProcess(RECONNECTING_REQUEST_SECONDS)
    try:
        line = SOFT_LIMIT - descriptor_reserve(SOFT_LIMIT)
        flood = ReconnectingFlood(page.address, FLOOD)
        reads: list[float] = []
        descriptors = []
        try:
            started = time.monotonic()
            next_read = started
            while (now := time.monotonic()) < started + RECONNECTING_SECONDS:
                if now >= next_read:
                    reads.append(key_holder_seconds(page.port))
                    next_read += READ_EVERY
                    continue
                descriptors.append(page.descriptors())
            dropped = page.ask("dropped")["dropped"]
            handled = sum(count for reason, count in dropped.items() if reason in DROPS)
            seconds = time.monotonic() - flood.first_opened
        finally:
            flood.stop()
        after = key_holder_seconds(page.port)
    finally:
        page.stop()
    assert flood.cut >= FLOOD // 2, f"the page dropped {flood.cut} of the flood's connections: not attacked"
    most = FLOOD * (seconds / deferred) + 64
    assert handled <= most, (
        f"the page took and dropped {handled} connections in {seconds:.1f} s, over {most:.0f}: "
        f"silent ones were not kept back {deferred} s each in the kernel"
    )
    slow = [took for took in reads if took > ANSWER_SECONDS]
    assert not slow and after <= ANSWER_SECONDS, f"{len(slow)} of {len(reads)} reads over {ANSWER_SECONDS} s"
    assert max(descriptors) < line, f"open descriptors: {max(descriptors)}"
