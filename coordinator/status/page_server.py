"""The status page's HTTP transport: bounded connections, a deadline per request, descriptors kept
for the coordinator.

The page lives in the coordinator, the one process that must never be starved, and anyone who can
reach its port may connect (the key is asked only of a whole request). So what a peer can hold
here is bounded whether or not it has the key (ARCHITECTURE.md, "Trust model"):

- **Connections**: at most ``PageLimits.max_connections``, each one descriptor. A new connection
  when all are taken drops the oldest one still sending its request (``admit``): a flood of silent
  or trickling connections then churns through its own slots, while a reader's request (which
  arrives whole within milliseconds of the connection, often before it is accepted) is read at
  once and answered. Refusing new connections instead would let the oldest silent ones deny the
  page to everyone until their deadline, so the newcomer wins.
- **Time**: a request (its line, headers and declared body, at most ``max_request_bytes``) must
  arrive within ``request_seconds`` of the accept (of the connect, for a connection the kernel
  kept back silent: below), and its reply be taken within ``reply_seconds``. These are
  deadlines, not per-read timeouts: trickled bytes do not extend them.
- **Silent connections stay in the kernel** (Linux): the listener asks for ``TCP_DEFER_ACCEPT``
  (``defer_accept_seconds``: the longest of the kernel's SYN-ACK periods, 1, 3, 7... s, within
  half of ``request_seconds``), so the kernel hands a connection over when its first bytes arrive
  and keeps a silent one among its half-open connections (no descriptor, no accept queue slot, no
  CPU of the process) until that period ends, when it hands it over still silent. A flood of
  silent connections, which a peer may open and reopen as fast as the page drops them, then
  costs the page one accept and one drop per connection per period instead of per round trip,
  and never fills the accept queue, so a reader's connection (which sends its request at once)
  always finds room there instead of having its SYN dropped and sent again a second later. A
  connection handed over silent has been so for that period already: its request deadline is
  ``request_seconds`` from its connect (``request_deadline``: ``request_seconds`` less the period
  from its accept, which is later when the kernel hands it over a period late, as it now and then
  does under a flood). The kernel keeps as many half-open connections as the backlog (BACKLOG);
  beyond them it answers with SYN cookies, which it hands over at once, silent or not: a flood
  larger than the backlog reaches the page, beyond it, as without the option.
- **CPU**: at most ``accepts_per_second`` accepts, after a burst of ``accept_burst`` (a token
  bucket): a flood that reconnects as fast as it is dropped costs the coordinator a bounded share
  of a core (an accept and a drop take tens of microseconds of Python, under the GIL the
  coordinator's own threads need), and the connections beyond it wait in the listen backlog, or
  are refused by the kernel when it is full. A connection dropped for its deadline, or evicted,
  is reset (``SO_LINGER`` 0): no FIN exchange, no TIME_WAIT left behind.
- **Threads**: one thread (``paramserve-status-http``) does every socket's I/O, non-blocking,
  over a selector; the ``answer_threads`` request threads only turn a complete request's bytes
  into a reply's (``answer``), so no peer can occupy one by being slow.
- **Descriptors**: the page accepts only while the process keeps ``descriptor_reserve`` of its
  soft limit (RLIMIT_NOFILE) free for the coordinator's own work (checkpoints, channels, recovery);
  otherwise connections wait in the kernel's listen backlog, costing the process nothing. They
  are counted once per batch of accepts (``count_descriptors``). The soft limit is not raised:
  the coordinator is the user's program (which may rely on select()'s 1,024), and the page,
  capped, needs few. An ``accept`` that fails for want of descriptors or
  memory (EMFILE, ENFILE, ENOBUFS, ENOMEM) pauses accepting with a backoff, never a busy loop.

Each drop and pause is counted by reason (``PageServer.counts``) and logged at most once per
reason every LOG_EVERY_SECONDS.
"""

from __future__ import annotations

import collections
import enum
import errno
import logging
import os
import resource
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

from paramserve.psserver.runtime.rate_limited_log import RateLimitedLog

__all__ = [
    "Admission",
    "Descriptors",
    "PageLimits",
    "PageServer",
    "RequestTooLarge",
    "admit",
    "count_descriptors",
    "defer_accept_seconds",
    "descriptor_reserve",
    "measure_descriptors",
    "refill",
    "request_deadline",
    "request_end",
]

log = logging.getLogger(__name__)

MIN_RESERVE = 64
"""The fewest descriptors the page leaves free for the coordinator, whatever the limit."""
BACKLOG = 4096
"""The listen backlog: connections the kernel completes before the page accepts them, which cost
the process no descriptor, and (Linux) the silent connections it keeps half-open under
``TCP_DEFER_ACCEPT``. Deep, so that a flood of silent connections stays in the kernel (beyond it
the kernel answers with SYN cookies, and hands those connections over at once), and so that
under a flood that does send bytes a reader's connection waits its turn behind the flood's
rather than having its SYN dropped and sent again a second later. The kernel caps it at
net.core.somaxconn (4,096 by default since Linux 5.4)."""
DEFER_SHARE = 0.5
"""The most of ``request_seconds`` a silent connection may spend in the kernel before the page
accepts it (``defer_accept_seconds``): the rest, at least half, is the page's deadline for it
(``request_deadline``), so that one the kernel hands over a period late (2 * period + 1 s after
its connect: it does, now and then, under a flood) still gets one."""
DEFER_PERIODS = 7
"""The kernel's SYN-ACK periods considered: 1, 3, 7, ... 127 s (2**n - 1, its first retransmission
after 1 s, each next one twice as late)."""
ACCEPT_BATCH = 16
"""Connections accepted per readiness of the listener, with one descriptor count for them all. Well
under ``max_connections``, and the listener is served after the connections in each round: a
connection just accepted is read in the next round or two, before a flood's newer connections
could make it the oldest one still sending its request."""
BACKOFF_SECONDS = (0.01, 1.0)
"""First and longest pause of accepting after a failed accept or when descriptors run short."""
MIN_RATE_PAUSE = 0.005
"""The shortest pause for ``accepts_per_second``: accepts then come in batches, not one a wake."""
RECEIVE_BYTES = 4096
_RESET = struct.pack("ii", 1, 0)
"""SO_LINGER on, 0 seconds: close() resets the connection."""
LOG_EVERY_SECONDS = 10.0
_FD_DIRECTORY = next((path for path in ("/proc/self/fd", "/dev/fd") if os.path.isdir(path)), None)
_TOO_LARGE = (
    b"HTTP/1.0 413 Content Too Large\r\nContent-Type: text/plain; charset=utf-8\r\nConnection: close\r\n\r\n"
    b"the request is too large: the page is read with GET and no body\n"
)


@dataclass(frozen=True)
class PageLimits:
    """What one peer, and all of them together, can hold of the page."""

    max_connections: int = 64
    request_seconds: float = 10.0
    """From the accept to the end of the request (line, headers, body)."""
    reply_seconds: float = 10.0
    """From the reply being ready to the peer having taken all of it."""
    max_request_bytes: int = 16384
    answer_threads: int = 4
    accepts_per_second: float = 2000.0
    accept_burst: int = 1024


# ---------------------------------------------------------------- pure decisions


class RequestTooLarge(ValueError):
    """A request over ``PageLimits.max_request_bytes`` (raised before it is read further)."""


@dataclass(frozen=True)
class Descriptors:
    """The process's open descriptors and its soft limit (RLIMIT_NOFILE)."""

    open: int
    soft_limit: int


class Admission(enum.Enum):
    ACCEPT = "accept"
    EVICT_OLDEST = "evict_oldest"
    """Accept, dropping the oldest connection still sending its request."""
    WAIT_FOR_SLOT = "wait_for_slot"
    """Every connection is being answered: accept when one ends."""
    WAIT_FOR_DESCRIPTORS = "wait_for_descriptors"
    """The coordinator's reserve of descriptors is reached: accept after a backoff."""
    WAIT_FOR_RATE = "wait_for_rate"
    """``accepts_per_second`` is spent: accept when the bucket has a token again."""


def descriptor_reserve(soft_limit: int) -> int:
    """Descriptors the page leaves free: a quarter of the soft limit, at least MIN_RESERVE."""
    return max(MIN_RESERVE, soft_limit // 4)


def admit(
    connections: int, receiving: int, descriptors: Descriptors | None, tokens: float, limits: PageLimits
) -> Admission:
    """Whether one more connection may be accepted, with ``connections`` open, ``receiving`` of
    them still sending their request, the process's ``descriptors`` (None: not limited, or not
    known on this platform) and ``tokens`` left in the bucket of accepts (``refill``)."""
    if descriptors is not None and descriptors.open + 1 > descriptors.soft_limit - descriptor_reserve(
        descriptors.soft_limit
    ):
        return Admission.WAIT_FOR_DESCRIPTORS
    if tokens < 1:
        return Admission.WAIT_FOR_RATE
    if connections < limits.max_connections:
        return Admission.ACCEPT
    return Admission.EVICT_OLDEST if receiving else Admission.WAIT_FOR_SLOT


def refill(tokens: float, seconds: float, limits: PageLimits) -> float:
    """The accepts allowed ``seconds`` after ``tokens`` were: ``accepts_per_second`` more a second,
    never over ``accept_burst``."""
    return min(float(limits.accept_burst), tokens + max(0.0, seconds) * limits.accepts_per_second)


def defer_accept_seconds(request_seconds: float) -> int:
    """The ``TCP_DEFER_ACCEPT`` seconds for a request deadline of ``request_seconds``: the longest
    period of the kernel's SYN-ACK retransmissions (2**n - 1 s: it rounds any value up to one)
    within DEFER_SHARE of the deadline; 0 (hand every connection over at once) when none is."""
    periods = [2**n - 1 for n in range(1, DEFER_PERIODS + 1)]
    return max((period for period in periods if period <= request_seconds * DEFER_SHARE), default=0)


def request_deadline(accepted_at: float, silent: bool, deferred_seconds: int, limits: PageLimits) -> float:
    """When a connection accepted at ``accepted_at`` must have sent its whole request. One the kernel
    handed over ``silent`` under ``TCP_DEFER_ACCEPT`` of ``deferred_seconds`` has been connected
    (and silent) that long already: its deadline counts from its connect, not before the accept."""
    waited = deferred_seconds if silent else 0
    return accepted_at + max(0.0, limits.request_seconds - waited)


def request_end(received: bytes | bytearray, max_bytes: int) -> int | None:
    """Where the request at the start of ``received`` ends (its head, then the body its
    Content-Length declares), or None while it is incomplete. Raises RequestTooLarge when it is
    or would be over ``max_bytes``."""
    ends = [at + len(mark) for mark in (b"\r\n\r\n", b"\n\n") if (at := received.find(mark)) >= 0]
    if not ends:
        if len(received) > max_bytes:
            raise RequestTooLarge(f"no end of the request's headers in {len(received)} bytes")
        return None
    head = min(ends)
    total = head + _content_length(bytes(received[:head]))
    if total > max_bytes:
        raise RequestTooLarge(f"a request of {total} bytes, over {max_bytes}")
    return total if len(received) >= total else None


def _content_length(head: bytes) -> int:
    for line in head.split(b"\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            digits = value.strip()
            if not digits.isdigit():
                return 0  # not a length: the request is answered (400) without a body read
            if len(digits) > 12:
                raise RequestTooLarge(f"a declared body of {len(digits)} digits")
            return int(digits)
    return 0


def measure_descriptors() -> Descriptors | None:
    """This process's descriptors now (None where the limit is infinite or they cannot be
    counted). Out of descriptors even to count them, they are all taken."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY or _FD_DIRECTORY is None:
        return None
    try:
        return Descriptors(count_descriptors(_FD_DIRECTORY), soft)
    except OSError:
        return Descriptors(soft, soft)


def count_descriptors(directory: str) -> int:
    """The open descriptors listed in ``directory`` (/proc/self/fd): its size where Linux gives
    their number so (6.2 and later: one ``stat``, no descriptor, a few microseconds), else (a size
    of 0) a listing of it, which costs one descriptor and tens of microseconds."""
    size = os.stat(directory).st_size
    if size > 0 and directory.startswith("/proc/"):
        return size
    return len(os.listdir(directory)) - 1  # less the listing's own


# ---------------------------------------------------------------- the server


class _Phase(enum.Enum):
    RECEIVING = "receiving"
    ANSWERING = "answering"
    SENDING = "sending"


@dataclass(eq=False)
class _Connection:
    sock: socket.socket
    peer: Any
    deadline: float
    """Monotonic seconds; unused while answering."""
    phase: _Phase = _Phase.RECEIVING
    received: bytearray = field(default_factory=bytearray)
    reply: memoryview = memoryview(b"")
    events: int = 0
    """What the selector watches it for (0: not registered)."""


Answer = Callable[[bytes, Any], bytes]
"""(one whole request's bytes, the peer's address) -> the reply's bytes (b"": close without one)."""


class PageServer:
    """Listens on ``address`` and answers each connection's one request with ``answer``, run on a
    request thread; ``on_cpu`` is told the CPU seconds its threads spent. ``start()``, then
    ``stop()``."""

    def __init__(
        self,
        address: tuple[str, int],
        answer: Answer,
        limits: PageLimits,
        *,
        thread_name: str,
        request_threads: str,
        on_cpu: Callable[[float], None] = lambda seconds: None,
        clock: Callable[[], float] = time.monotonic,
        descriptors: Callable[[], Descriptors | None] = measure_descriptors,
    ):
        host = address[0]
        if ":" in host:
            self._listener = socket.create_server(
                address, family=socket.AF_INET6, backlog=BACKLOG, dualstack_ipv6=socket.has_dualstack_ipv6()
            )
        else:
            self._listener = socket.create_server(address, backlog=BACKLOG)
        self._deferred_seconds = 0
        """TCP_DEFER_ACCEPT's seconds on the listener (0: every connection is handed over at once)."""
        defer = defer_accept_seconds(limits.request_seconds)
        if defer and hasattr(socket, "TCP_DEFER_ACCEPT"):
            try:
                self._listener.setsockopt(socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT, defer)
                self._deferred_seconds = defer
            except OSError:
                log.debug("status page: TCP_DEFER_ACCEPT not taken", exc_info=True)
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self._answer = answer
        self._limits = limits
        self._on_cpu = on_cpu
        self._clock = clock
        self._descriptors = descriptors
        self._selector = selectors.DefaultSelector()
        self._wake_reader, self._wake_writer = socket.socketpair()
        for end in (self._wake_reader, self._wake_writer):
            end.setblocking(False)
        self._selector.register(self._wake_reader, selectors.EVENT_READ, None)
        self._listening = False
        self._resume_at: float | None = 0.0  # None: when a connection ends
        self._failures = 0
        self._tokens, self._refilled_at = float(limits.accept_burst), clock()
        self._connections: set[_Connection] = set()
        self._receiving: collections.OrderedDict[_Connection, None] = collections.OrderedDict()
        self._replies: collections.deque[tuple[_Connection, bytes]] = collections.deque()
        self._stopping = threading.Event()
        self._counts: collections.Counter[str] = collections.Counter()
        self._count_lock = threading.Lock()
        self._log = RateLimitedLog(log, LOG_EVERY_SECONDS)
        self._pool = futures.ThreadPoolExecutor(limits.answer_threads, thread_name_prefix=request_threads)
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float | None = None) -> bool:
        """Closes the listener and every connection, and ends the threads; True when none is left.
        The request threads end first (a reply being made is made, and dropped), so none wakes the
        I/O thread after it closed its sockets."""
        self._stopping.set()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._wake()
        if self._thread.ident is not None:
            self._thread.join(timeout)
        else:
            self._close_all()
        return not self._thread.is_alive()

    def counts(self) -> dict[str, int]:
        """Connections dropped and accepts paused so far, by reason."""
        with self._count_lock:
            return dict(self._counts)

    # ---------------------------------------------------------------- the I/O thread

    def _run(self) -> None:
        spent = time.thread_time()
        try:
            while not self._stopping.is_set():
                accepting = False
                for key, mask in self._selector.select(self._wait_seconds()):
                    if key.fileobj is self._listener:
                        accepting = True  # after the connections (ACCEPT_BATCH)
                    elif key.data is None:
                        self._drain_wakes()
                    elif mask & selectors.EVENT_READ:
                        self._receive(key.data)
                    else:
                        self._send(key.data)
                if accepting:
                    self._accept_some()
                self._send_replies()
                self._expire()
                self._listen_again()
                now_spent = time.thread_time()
                self._on_cpu(now_spent - spent)
                spent = now_spent
        except Exception:  # a bug here must not take the coordinator down: the page stops
            log.exception("the status page stopped serving")
        finally:
            self._close_all()

    def _wait_seconds(self) -> float:
        now = self._clock()
        wake = [c.deadline for c in self._connections if c.phase is not _Phase.ANSWERING]
        if not self._listening and self._resume_at is not None:
            wake.append(self._resume_at)
        return min(1.0, max(0.0, min(wake, default=now + 1.0) - now))

    # ---------------------------------------------------------------- accepting

    def _accept_some(self) -> None:
        now = self._clock()
        self._tokens, self._refilled_at = refill(self._tokens, now - self._refilled_at, self._limits), now
        measured, added = self._descriptors(), 0  # one count for the batch, and what it added
        for _ in range(ACCEPT_BATCH):
            descriptors = None if measured is None else Descriptors(measured.open + added, measured.soft_limit)
            decision = admit(len(self._connections), len(self._receiving), descriptors, self._tokens, self._limits)
            if decision is Admission.WAIT_FOR_DESCRIPTORS:
                self._pause("descriptor_reserve", self._backoff(), descriptors)
                return
            if decision is Admission.WAIT_FOR_RATE:
                wait = max(MIN_RATE_PAUSE, (1 - self._tokens) / self._limits.accepts_per_second)
                self._pause("accept_rate", wait, descriptors, logging.INFO)
                return
            if decision is Admission.WAIT_FOR_SLOT:
                self._pause("connection_limit", None, descriptors)
                return
            try:
                sock, peer = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as err:
                if err.errno == errno.ECONNABORTED:
                    continue
                reason = f"accept_failed_{errno.errorcode.get(err.errno or 0, 'unknown')}"
                self._pause(reason, self._backoff(), descriptors)
                return
            self._failures, self._tokens = 0, self._tokens - 1
            if decision is Admission.EVICT_OLDEST:
                oldest = next(iter(self._receiving))
                self._drop(oldest, "evicted", f"dropped {oldest.peer}, still sending its request, for a new one")
            else:
                added += 1
            self._admit(sock, peer)

    def _backoff(self) -> float:
        self._failures += 1
        first, longest = BACKOFF_SECONDS
        return float(min(longest, first * 2 ** min(self._failures - 1, 16)))

    def _pause(
        self, reason: str, seconds: float | None, descriptors: Descriptors | None, level: int = logging.WARNING
    ) -> None:
        """Stops watching the listener for ``seconds`` (None: until a connection ends)."""
        if self._listening:
            self._selector.unregister(self._listener)
            self._listening = False
        self._resume_at = None if seconds is None else self._clock() + seconds
        where = "" if descriptors is None else f" ({descriptors.open} of {descriptors.soft_limit} descriptors open)"
        self._note(reason, f"status page: not accepting connections for now: {reason}{where}", level)

    def _listen_again(self) -> None:
        if self._listening or self._stopping.is_set():
            return
        if self._resume_at is not None and self._clock() >= self._resume_at:
            self._selector.register(self._listener, selectors.EVENT_READ, None)
            self._listening = True

    def _admit(self, sock: socket.socket, peer: Any) -> None:
        """Takes a connection just accepted: its request is read at once (a reader's is often here
        already, and under TCP_DEFER_ACCEPT any but a silent connection's first bytes are)."""
        sock.setblocking(False)
        now = self._clock()
        try:
            first = sock.recv(RECEIVE_BYTES)
        except (BlockingIOError, InterruptedError):
            first = None
        except OSError:
            first = b""
        deadline = request_deadline(now, first is None, self._deferred_seconds, self._limits)
        connection = _Connection(sock, peer, deadline)
        self._connections.add(connection)
        self._receiving[connection] = None
        if first is None:
            self._watch(connection, selectors.EVENT_READ)
        else:
            self._received(connection, first)

    # ---------------------------------------------------------------- one connection

    def _receive(self, connection: _Connection) -> None:
        try:
            data = connection.sock.recv(RECEIVE_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        self._received(connection, data)

    def _received(self, connection: _Connection, data: bytes) -> None:
        """``data`` read from a connection still sending its request (b"": it closed)."""
        if not data:
            self._close(connection)
            return
        connection.received += data
        try:
            end = request_end(connection.received, self._limits.max_request_bytes)
        except RequestTooLarge as err:
            self._note("too_large", f"status page: refused {connection.peer}: {err}")
            self._begin_reply(connection, _TOO_LARGE)
            return
        if end is None:
            self._watch(connection, selectors.EVENT_READ)
            return
        request = bytes(connection.received[:end])
        self._receiving.pop(connection, None)
        self._watch(connection, 0)
        connection.phase, connection.received = _Phase.ANSWERING, bytearray()
        try:
            self._pool.submit(self._answer_one, connection, request)
        except RuntimeError:  # stopping: the request threads are gone
            self._close(connection)

    def _answer_one(self, connection: _Connection, request: bytes) -> None:
        """On a request thread: the reply, handed back to the I/O thread."""
        started = time.thread_time()
        try:
            reply = self._answer(request, connection.peer)
        except Exception:
            log.debug("status page: answering %s failed", connection.peer, exc_info=True)
            reply = b""
        self._replies.append((connection, reply))
        self._wake()
        self._on_cpu(time.thread_time() - started)

    def _send_replies(self) -> None:
        while self._replies:
            connection, reply = self._replies.popleft()
            if connection in self._connections:
                self._begin_reply(connection, reply)

    def _begin_reply(self, connection: _Connection, reply: bytes) -> None:
        self._receiving.pop(connection, None)
        connection.phase, connection.reply = _Phase.SENDING, memoryview(reply)
        connection.deadline = self._clock() + self._limits.reply_seconds
        self._send(connection)

    def _send(self, connection: _Connection) -> None:
        try:
            sent = connection.sock.send(connection.reply) if connection.reply else 0
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self._close(connection)
            return
        connection.reply = connection.reply[sent:]
        if connection.reply:
            self._watch(connection, selectors.EVENT_WRITE)
        else:
            self._close(connection)

    def _expire(self) -> None:
        now = self._clock()
        for connection in [c for c in self._connections if c.phase is not _Phase.ANSWERING and c.deadline <= now]:
            what = "its request" if connection.phase is _Phase.RECEIVING else "its reply"
            self._drop(
                connection, f"{connection.phase.value}_deadline", f"dropped {connection.peer}: out of time for {what}"
            )

    def _watch(self, connection: _Connection, events: int) -> None:
        if connection.events == events:
            return
        if connection.events and events:
            self._selector.modify(connection.sock, events, connection)
        elif events:
            self._selector.register(connection.sock, events, connection)
        else:
            self._selector.unregister(connection.sock)
        connection.events = events

    def _drop(self, connection: _Connection, reason: str, message: str) -> None:
        # info, not warning: a browser's spare connection, opened and never used, ends so too
        self._note(reason, f"status page: {message}", logging.INFO)
        self._close(connection, reset=True)

    def _close(self, connection: _Connection, reset: bool = False) -> None:
        """Closes ``connection``; ``reset``: with a reset (a drop: nothing of it is owed to the
        peer, and neither end keeps a TIME_WAIT), else with a FIN after what was sent."""
        self._watch(connection, 0)
        self._connections.discard(connection)
        self._receiving.pop(connection, None)
        if reset:
            try:
                connection.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
            except OSError:  # already reset by the peer
                pass
        connection.sock.close()
        if not self._listening and self._resume_at is None:
            self._resume_at = self._clock()  # a slot is free

    def _close_all(self) -> None:
        for connection in list(self._connections):
            self._close(connection)
        self._selector.close()
        self._listener.close()
        self._wake_reader.close()
        self._wake_writer.close()

    # ---------------------------------------------------------------- waking, counting

    def _wake(self) -> None:
        try:
            self._wake_writer.send(b"\0")
        except OSError:  # full (a wake is pending anyway) or closed (stopped)
            pass

    def _drain_wakes(self) -> None:
        try:
            while self._wake_reader.recv(4096):
                pass
        except OSError:
            pass

    def _note(self, reason: str, message: str, level: int = logging.WARNING) -> None:
        """Counts ``reason``; logs ``message`` at most once per reason every LOG_EVERY_SECONDS."""
        with self._count_lock:
            self._counts[reason] += 1
            count = self._counts[reason]
        self._log.log(reason, level, "%s (%d so far)", message, count)
