"""The step data plane's server: a parameter server's listener and one thread per connection.

It knows frames (psserver/dataplane/frames.py), the handshake and TLS, and nothing of what a step means:
``build_server`` (psserver/server.py) hands it the step engine's ``run_frames`` as the exchange
and ``new_connection`` as the factory of each connection's state (its step programs), so the
transport carries bytes and the application keeps its state on its own side of that line.

What no client can do to it, authenticated or not (ARCHITECTURE.md, "Trust model"):

- **stop the listener**: an ``accept`` that fails (out of descriptors, memory or threads) is
  logged, counted and retried with backoff; out of descriptors, a reserved one is given up to
  accept and shed the waiting connection, so the backlog drains. Only ``stop()`` ends it. While
  it keeps failing, ``on_health(False)`` says so.
- **hold a slot without authenticating**: the handshake has HANDSHAKE_SECONDS in all from
  ``accept``, TLS included (its handshake runs under a socket timeout of what is left, and the
  object the reaper shuts down is always the one that owns the descriptor), and connections in it
  have a budget of their own (``max_pending``): when a new one needs a slot, the oldest still in
  its handshake is dropped.
- **hold buffers with a stalled frame**: a frame must arrive within FRAME_SECONDS (plus a
  second per MIN_FRAME_BYTES_PER_SECOND of payload); a STEP header is at most
  MAX_STEP_HEADER_BYTES; a connection keeps at most two reused buffers of REUSED_BUFFER_LIMIT.

One thread, ``paramserve-dataplane-reaper``, enforces the deadlines by shutting down the
sockets whose time is up (each connection's own thread closes its socket: a descriptor is never
closed under a thread that may still use its number). Every refusal (a deadline, an eviction,
a failed TLS handshake, a refused credential, a frame that is none or not allowed there, an
oversized one, a full server) is counted once by reason (``on_refused``) and logged at most
once per reason every LOG_EVERY_SECONDS, with the count of those left out since.
"""

from __future__ import annotations

import collections
import enum
import errno
import logging
import os
import secrets
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from paramserve.psserver.dataplane.frames import (
    FRAME_SECONDS,
    HANDSHAKE_SECONDS,
    MAX_STEP_HEADER_BYTES,
    MIN_FRAME_BYTES_PER_SECOND,
    REUSED_BUFFER_LIMIT,
    FrameKind,
    FrameReader,
    FramingError,
    TransportError,
    close_socket,
    error_header,
    send_frame,
    tune,
)
from paramserve.psserver.protocol.errors import AuthenticationError, MessageTooLargeError, ParamServeError
from paramserve.psserver.protocol.streams import byte_buffer
from paramserve.psserver.runtime.rate_limited_log import RateLimitedLog
from paramserve.psserver.runtime.security import (
    HANDSHAKE_NONCE_BYTES,
    DataPlaneKey,
    TlsConfig,
    new_handshake_nonce,
    proofs_match,
)

__all__ = ["DataPlaneServer", "ErrorFor", "StepExchange", "max_pending_handshakes"]

log = logging.getLogger(__name__)

MAX_HELLO_BYTES = 512
"""A HELLO or PROOF longer than this is not one (read before anything is known of the peer)."""
REAP_EVERY_SECONDS = 0.25
LOG_EVERY_SECONDS = 10.0
UNHEALTHY_AFTER_FAILURES = 20
"""Consecutive failed accepts after which the data plane reports itself not serving."""

_State = TypeVar("_State")

StepExchange = Callable[[memoryview, torch.Tensor, Callable[[int], torch.Tensor], _State], tuple[bytes, memoryview]]
"""(StepPlan bytes, the pushed bytes as a uint8 tensor, a reply-buffer allocator, the connection's
state) -> (StepOutcome bytes, the pulled bytes): psserver/steps/engine.py's StepEngine.run_frames.
Raises ParamServeError."""
ErrorFor = Callable[[Exception], ParamServeError]
"""The typed error an unexpected exception stands for (the gRPC boundary's rule)."""


def max_pending_handshakes(max_connections: int) -> int:
    """Connections that may be in their handshake at once: a quarter of the connections, at
    least 2 and at most 64. A real client's handshake takes milliseconds; a slot is held longer
    only by a peer that does not authenticate."""
    return max(2, min(64, max_connections // 4))


class _Phase(enum.Enum):
    HANDSHAKE = "handshake"
    IDLE = "idle"
    RECEIVING = "receiving"
    STEPPING = "stepping"


@dataclass(eq=False)
class _Connection:
    sock: socket.socket
    """The object that owns the descriptor (the SSLSocket once TLS wraps it): replaced, and
    shut down by other threads, only under the server's lock; closed only by its own thread."""
    peer: str
    phase: _Phase
    deadline: float | None
    """When the reaper closes it (monotonic seconds); None: no deadline (idle or stepping)."""
    refused: bool = False
    """Refused by the server, and counted (once: when this was set)."""


class DataPlaneServer(Generic[_State]):
    """A parameter server's data-plane listener: one thread per admitted connection, at most
    ``max_connections`` at once (a thread per connected worker, which blocks on its socket).
    ``exchange`` serves each STEP frame with the state ``new_connection_state()`` made for its
    connection when it was admitted (state that ends with the connection)."""

    def __init__(
        self,
        exchange: StepExchange[_State],
        new_connection_state: Callable[[], _State],
        error_for: ErrorFor,
        *,
        host: str,
        port: int,
        max_body_bytes: int,
        max_connections: int,
        token: str | None = None,
        tls: TlsConfig | None = None,
        on_step: Callable[[str, float, int, int], None] | None = None,
        on_refused: Callable[[str], None] | None = None,
        on_health: Callable[[bool], None] | None = None,
    ):
        self._exchange = exchange
        self._new_connection_state = new_connection_state
        self._error_for = error_for
        self._max_body = max_body_bytes
        self._max_connections = max_connections
        self._max_pending = max_pending_handshakes(max_connections)
        self._key = DataPlaneKey.of(token) if token else None
        self._tls = _server_context(tls) if tls is not None else None
        self._on_step = on_step
        self._on_refused = on_refused
        self._on_health = on_health
        self._listeners = [socket.create_server((host, port), family=_family(host), backlog=128)]
        self.port: int = self._listeners[0].getsockname()[1]
        self.local_socket = ""
        """The abstract Unix socket's name (no leading NUL), "" for none (see _local_listener)."""
        if tls is None:
            local = _local_listener()
            if local is not None:
                self._listeners.append(local)
                self.local_socket = local.getsockname()[1:].decode()
        self._lock = threading.Condition()
        self._connections: set[_Connection] = set()
        self._handshaking: collections.OrderedDict[_Connection, None] = collections.OrderedDict()
        self._closed = False
        self._closing = threading.Event()
        self._healthy = True
        self._reserve = _reserve_descriptor()
        self._shedding = threading.Lock()
        self._log = RateLimitedLog(log, LOG_EVERY_SECONDS)
        self._threads = [
            threading.Thread(target=self._accept, args=(listener,), name="paramserve-dataplane-accept", daemon=True)
            for listener in self._listeners
        ]
        self._threads.append(threading.Thread(target=self._reap, name="paramserve-dataplane-reaper", daemon=True))

    def structure_sizes(self) -> dict[str, int]:
        """Connections admitted and still handshaking (diagnostics; at most ``max_connections``)."""
        with self._lock:
            return {"dataplane_connections": len(self._connections), "dataplane_handshaking": len(self._handshaking)}

    def start(self) -> DataPlaneServer[_State]:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self, grace: float = 0.0) -> None:
        """Closes the listeners and the connections not applying a step at once; a connection
        whose step is being applied gets up to ``grace`` seconds to finish it and send the reply
        (a graceful stop: the step is then applied and acknowledged, not left unknown), then is
        closed too. Connection threads end on their shut-down sockets and close them."""
        with self._lock:
            self._closed = True
            idle = [c for c in self._connections if c.phase is not _Phase.STEPPING]
        self._closing.set()
        for listener in self._listeners:
            close_socket(listener)
        for connection in idle:
            self._close(connection)
        with self._lock:
            self._lock.wait_for(lambda: not any(c.phase is _Phase.STEPPING for c in self._connections), timeout=grace)
            remaining = list(self._connections)
        for connection in remaining:
            self._close(connection)
        if self._reserve is not None:
            os.close(self._reserve)
            self._reserve = None

    @property
    def connections(self) -> int:
        with self._lock:
            return len(self._connections)

    @property
    def handshaking(self) -> int:
        """Connections in their handshake now."""
        with self._lock:
            return len(self._handshaking)

    # ---------------------------------------------------------------- accepting

    def _accept(self, listener: socket.socket) -> None:
        failures = 0
        while not self._closed:
            try:
                sock, peer = listener.accept()
            except OSError as err:
                if self._closed:
                    return
                failures += 1
                self._refused("accept_failed", f"accept() failed ({errno.errorcode.get(err.errno or 0, err)}): {err}")
                if err.errno in (errno.EMFILE, errno.ENFILE):
                    self._shed(listener)
                self._set_health(failures < UNHEALTHY_AFTER_FAILURES)
                self._closing.wait(min(1.0, 0.005 * 2 ** min(failures, 8)))
                continue
            failures = 0
            self._set_health(True)
            self._admit_socket(sock, str(peer) if peer else "local")

    def _shed(self, listener: socket.socket) -> None:
        """Out of descriptors: gives up the reserved one to accept the waiting connection and
        close it at once, so the backlog drains and the listener stays responsive."""
        with self._shedding:
            if self._reserve is None:
                return
            os.close(self._reserve)
            self._reserve = None
            try:
                listener.settimeout(0)
                sock, _ = listener.accept()
                close_socket(sock)
            except OSError:
                pass
            finally:
                listener.settimeout(None)
                self._reserve = _reserve_descriptor()

    def _admit_socket(self, sock: socket.socket, peer: str) -> None:
        connection = _Connection(sock, peer, _Phase.HANDSHAKE, time.monotonic() + HANDSHAKE_SECONDS)
        evicted: _Connection | None = None
        with self._lock:
            full = len(self._connections) >= self._max_connections
            if (full or len(self._handshaking) >= self._max_pending) and self._handshaking:
                evicted, _ = self._handshaking.popitem(last=False)  # the oldest unauthenticated one
                full = False
            if not self._closed and not full:
                self._connections.add(connection)
                self._handshaking[connection] = None
        if evicted is not None:
            self._drop(
                evicted, "handshake_evicted", f"dropped {evicted.peer}, still in its handshake, for a new connection"
            )
        if connection not in self._connections:
            if not self._closed:
                self._refused(
                    "connection_limit", f"refused {peer}: {self._max_connections} connections open (--max-connections)"
                )
            close_socket(sock)
            return
        try:
            threading.Thread(target=self._serve, args=(connection,), name="paramserve-dataplane", daemon=True).start()
        except RuntimeError as err:  # out of threads: this connection is dropped, the listener goes on
            self._refused("thread_start_failed", f"cannot start a thread for {peer}: {err}")
            self._forget(connection)
            self._closing.wait(0.05)

    # ---------------------------------------------------------------- one connection

    def _serve(self, connection: _Connection) -> None:
        sock = connection.sock
        try:
            tune(sock)
            if self._tls is not None:
                wrapped = self._wrap(connection)
                if wrapped is None:
                    return
                sock = wrapped
            reader = FrameReader(sock)
            if not self._handshake(connection, sock, reader):
                return
            replies, state = _ReusedBuffer(), self._new_connection_state()
            poller = select.poll()
            poller.register(sock, select.POLLIN)
            while True:
                if not (isinstance(sock, ssl.SSLSocket) and sock.pending()):
                    poller.poll()  # idle until the next frame begins: no deadline between steps
                self._enter(connection, _Phase.RECEIVING, time.monotonic() + FRAME_SECONDS)
                prefix, plan = reader.read_head(MAX_STEP_HEADER_BYTES, self._max_body, _step_only)
                self._extend(connection, prefix.payload_bytes / MIN_FRAME_BYTES_PER_SECOND)
                payload = reader.read_payload(prefix.payload_bytes)
                if not self._enter(connection, _Phase.STEPPING, None):
                    return  # stopping: this step is not applied (the client retries it elsewhere or later)
                try:
                    self._step(sock, plan, payload, replies, state)
                finally:
                    self._enter(connection, _Phase.IDLE, None)
        except MessageTooLargeError as err:
            self._count_once(connection, "oversized_frame", f"{connection.peer}: {err.message}")
            _try_send_error(sock, err)  # the frame was not read: the stream cannot go on
        except FramingError as err:  # no reply: a peer that sends no frames would not read one
            self._drop(connection, err.reason, f"dropped {connection.peer}: {err}")
        except (OSError, TransportError):
            pass  # the client went away, or the reaper closed it (and counted why): drop it
        except Exception:  # a bug here must not take the server down: logged, and the connection dropped
            log.exception("data plane: connection failed")
        finally:
            self._forget(connection)

    def _wrap(self, connection: _Connection) -> ssl.SSLSocket | None:
        """The connection's TLS handshake, within what is left of its deadline; None (and the
        connection dropped, and counted unless the peer just went away) when it fails."""
        assert self._tls is not None
        with self._lock:
            if connection.refused:
                return None
            # wrap_socket moves the descriptor to the SSLSocket and detaches the plain socket:
            # swapped under the lock, so whoever closes the connection closes the owner.
            wrapped = self._tls.wrap_socket(connection.sock, server_side=True, do_handshake_on_connect=False)
            connection.sock = wrapped
            left = connection.deadline - time.monotonic() if connection.deadline is not None else 0.0
        try:
            if left <= 0:
                raise TimeoutError("no time left")
            wrapped.settimeout(left)  # one deadline for the whole handshake, however it trickles in
            wrapped.do_handshake()
            wrapped.settimeout(None)
            return wrapped
        except TimeoutError:
            self._drop(
                connection, "handshake_timeout", f"dropped {connection.peer}: its TLS handshake ran past its deadline"
            )
        except (ssl.SSLEOFError, ConnectionError):
            pass  # the peer went away (or was dropped, and counted, by another thread)
        except ssl.SSLError as err:
            self._drop(
                connection, "tls_failed", f"refused {connection.peer}: its TLS handshake failed: {err.reason or err}"
            )
        except OSError:
            pass  # closed by another thread, which counted why
        return None

    def _handshake(self, connection: _Connection, sock: socket.socket, reader: FrameReader) -> bool:
        """HELLO, CHALLENGE, PROOF, WELCOME (security.DataPlaneKey); without a token, an empty HELLO
        and WELCOME. Refuses with ERROR and returns False."""
        _, hello = reader.read_head(MAX_HELLO_BYTES, 0, lambda kind: kind is FrameKind.HELLO)
        fix = "give the caller the cluster's shared token (--token-file, PARAMSERVE_TOKEN or ClientConfig(token=))"
        if self._key is None:
            if len(hello):
                return self._refuse_handshake(
                    sock,
                    connection,
                    "unexpected_credential",
                    "a credential, which this server without a token does not take",
                )
        elif len(hello) != HANDSHAKE_NONCE_BYTES:
            reason = "no_credential" if not len(hello) else "wrong_credential"
            return self._refuse_handshake(sock, connection, reason, f"{reason.replace('_', ' ')}: {fix}")
        else:
            client_nonce, server_nonce = bytes(hello), new_handshake_nonce()
            send_frame(sock, FrameKind.CHALLENGE, server_nonce + self._key.server_proof(client_nonce, server_nonce))
            _, proof = reader.read_head(MAX_HELLO_BYTES, 0, lambda kind: kind is FrameKind.PROOF)
            if not proofs_match(proof, self._key.client_proof(client_nonce, server_nonce)):
                return self._refuse_handshake(sock, connection, "wrong_credential", f"a wrong credential: {fix}")
        # Out of the handshake before the WELCOME leaves: a client that has its WELCOME is admitted,
        # never evicted as "still in its handshake" by a connection it opens right after.
        self._enter(connection, _Phase.IDLE, None)
        send_frame(sock, FrameKind.WELCOME)
        return True

    def _refuse_handshake(self, sock: socket.socket, connection: _Connection, reason: str, what: str) -> bool:
        self._count_once(connection, reason, f"refused {connection.peer}: {what}")
        _try_send_error(sock, AuthenticationError(f"a data-plane connection carried {what}"))
        return False

    def _step(
        self, sock: socket.socket, plan: memoryview, payload: torch.Tensor, replies: _ReusedBuffer, state: _State
    ) -> None:
        start = time.perf_counter()
        try:
            outcome, values = self._exchange(plan, payload, replies.get, state)
        except Exception as exc:
            error = exc if isinstance(exc, ParamServeError) else self._error_for(exc)
            self._finish(error, start, len(plan) + payload.numel(), 0)
            send_frame(sock, FrameKind.ERROR, error_header(error))
            return
        self._finish(None, start, len(plan) + payload.numel(), len(outcome) + len(values))
        send_frame(sock, FrameKind.REPLY, outcome, (values,))

    def _finish(self, error: ParamServeError | None, start: float, received: int, sent: int) -> None:
        if self._on_step is not None:
            code = "OK" if error is None else error.code.value
            self._on_step(code, time.perf_counter() - start, received, sent)

    # ---------------------------------------------------------------- bookkeeping

    def _enter(self, connection: _Connection, phase: _Phase, deadline: float | None) -> bool:
        """Moves ``connection`` to ``phase``; False (and nothing changed) when a step would begin
        while the server stops."""
        with self._lock:
            if phase is _Phase.STEPPING and self._closed:
                return False
            connection.phase, connection.deadline = phase, deadline
            self._handshaking.pop(connection, None)
            self._lock.notify_all()
            return True

    def _extend(self, connection: _Connection, seconds: float) -> None:
        with self._lock:
            if connection.deadline is not None:
                connection.deadline += seconds

    def _forget(self, connection: _Connection) -> None:
        with self._lock:
            close_socket(connection.sock)
            self._connections.discard(connection)
            self._handshaking.pop(connection, None)
            self._lock.notify_all()

    def _close(self, connection: _Connection) -> None:
        """Shuts ``connection``'s socket down both ways, which wakes its thread (a blocked read
        sees the end, a blocked write fails) and tells the peer at once; its own thread closes
        it (``_forget``). Never closed from here: a descriptor closed under a thread still in
        OpenSSL's handshake, whose BIO keeps the number, is read from after the number is
        reused (a CA file a client was opening was read by a server's handshake). Under the
        lock, on the object that owns the descriptor (``_wrap`` swaps it); never blocks."""
        with self._lock:
            try:
                socket.socket.shutdown(connection.sock, socket.SHUT_RDWR)  # not SSLSocket's: keeps its state
            except OSError:
                pass  # not connected any more, or already closed by its thread

    def _drop(self, connection: _Connection, reason: str, message: str) -> None:
        """Closes ``connection`` for a refusal, counted and logged once however many threads
        find a reason (the reaper, an evicting accept, its own thread), before the peer can see
        the close."""
        self._count_once(connection, reason, message)
        self._close(connection)

    def _count_once(self, connection: _Connection, reason: str, message: str) -> None:
        """Counts and logs ``connection``'s refusal unless another thread did. Its deadline
        stays: a refusal blocked sending its ERROR frame is still closed by the reaper."""
        with self._lock:
            first = not connection.refused
            connection.refused = True
            self._handshaking.pop(connection, None)  # no longer the evictor's to drop
        if first:
            self._refused(reason, message)

    def _reap(self) -> None:
        """Closes the connections whose handshake or frame is past its deadline; counts each
        once (one already refused for another reason is closed, not counted again)."""
        while not self._closing.wait(REAP_EVERY_SECONDS):
            now = time.monotonic()
            with self._lock:
                late = [
                    (c, c.phase, c.refused) for c in self._connections if c.deadline is not None and c.deadline <= now
                ]
                for connection, _, _ in late:
                    connection.refused = True
                    self._handshaking.pop(connection, None)
            for connection, phase, refused in late:
                if not refused:
                    reason = "handshake_timeout" if phase is _Phase.HANDSHAKE else "frame_timeout"
                    self._refused(reason, f"dropped {connection.peer}: its {phase.value} ran past its deadline")
                self._close(connection)

    def _refused(self, reason: str, message: str) -> None:
        if self._on_refused is not None:
            self._on_refused(reason)
        self._log.warning(reason, "data plane: %s [%s]", message, reason)

    def _set_health(self, healthy: bool) -> None:
        if healthy != self._healthy:
            self._healthy = healthy
            log.log(
                logging.INFO if healthy else logging.ERROR,
                "data plane: %s",
                "accepting again" if healthy else "cannot accept connections: reported NOT_SERVING",
            )
            if self._on_health is not None:
                self._on_health(healthy)


def _step_only(kind: FrameKind) -> bool:
    return kind is FrameKind.STEP


class _ReusedBuffer:
    """A connection's reply buffer: kept between steps up to REUSED_BUFFER_LIMIT."""

    def __init__(self) -> None:
        self._buffer = byte_buffer(0)

    def get(self, nbytes: int) -> torch.Tensor:
        if nbytes <= self._buffer.numel():
            return self._buffer[:nbytes]
        buffer = byte_buffer(nbytes)
        if nbytes <= REUSED_BUFFER_LIMIT:
            self._buffer = buffer
        return buffer


def _reserve_descriptor() -> int | None:
    """A descriptor held back for when the process runs out (see DataPlaneServer._shed)."""
    try:
        return os.open(os.devnull, os.O_RDONLY)
    except OSError:
        return None


def _local_listener() -> socket.socket | None:
    """A listener on a random abstract Unix socket, or None where there are none (not Linux).

    A step over a Unix socket costs about a third of the CPU of one over TCP on loopback.
    Abstract names belong to a network namespace, so only a client on this host and in this
    namespace reaches it, and the random name means a client never reaches another server by
    mistake (two namespaces may hold servers on the same port). A client connects to it only when
    the socket's peer credentials name this process (DataPlaneInfo.server_pid, server_uid), and
    the same handshake authenticates both sides. Not offered with TLS: mutual TLS may be what
    authenticates clients."""
    if not hasattr(socket, "AF_UNIX"):
        return None
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(b"\0paramserve-dataplane-" + secrets.token_hex(16).encode())
        listener.listen(128)
    except OSError:  # abstract names are Linux's
        listener.close()
        return None
    return listener


def _server_context(tls: TlsConfig) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(str(tls.cert_file), str(tls.key_file))
    if tls.client_ca_file is not None:
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(cafile=str(tls.client_ca_file))
    return context


def _try_send_error(sock: socket.socket, error: ParamServeError) -> None:
    try:
        send_frame(sock, FrameKind.ERROR, error_header(error))
    except OSError:
        pass


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET
