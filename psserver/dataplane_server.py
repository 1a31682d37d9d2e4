"""The step data plane's server: a parameter server's listener and one thread per connection.

It knows frames (psserver/dataplane.py), credentials and TLS, and nothing of what a step means:
``build_server`` (psserver/server.py) hands it the step engine's ``run_frames`` as the exchange
and ``new_connection`` as the factory of each connection's state (its step programs), so the
transport carries bytes and the application keeps its state on its own side of that line.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

import torch

from paramserve.psserver.dataplane import (
    REUSED_BUFFER_LIMIT,
    FrameKind,
    FrameReader,
    TransportError,
    close_socket,
    error_header,
    send_frame,
    tune,
)
from paramserve.psserver.errors import AuthenticationError, MessageTooLargeError, ParamServeError
from paramserve.psserver.security import TlsConfig, bearer_metadata
from paramserve.psserver.streams import byte_buffer

__all__ = ["HANDSHAKE_TIMEOUT", "DataPlaneServer", "ErrorFor", "StepExchange"]

log = logging.getLogger(__name__)

MAX_HELLO_BYTES = 512
"""A HELLO header is a credential: anything longer is not one (read before authentication)."""
HANDSHAKE_TIMEOUT = 10.0
"""Seconds a new connection has to finish TLS and its HELLO before the server drops it."""

_State = TypeVar("_State")

StepExchange = Callable[[memoryview, torch.Tensor, Callable[[int], torch.Tensor], _State], tuple[bytes, memoryview]]
"""(StepPlan bytes, the pushed bytes as a uint8 tensor, a reply-buffer allocator, the connection's
state) -> (StepOutcome bytes, the pulled bytes): psserver/steps.py's StepEngine.run_frames.
Raises ParamServeError."""
ErrorFor = Callable[[Exception], ParamServeError]
"""The typed error an unexpected exception stands for (the gRPC boundary's rule)."""


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
    ):
        self._exchange = exchange
        self._new_connection_state = new_connection_state
        self._error_for = error_for
        self._max_body = max_body_bytes
        self._max_connections = max_connections
        self._credential = bearer_metadata(token)[1].encode() if token else b""
        self._tls = _server_context(tls) if tls is not None else None
        self._on_step = on_step
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
        self._connections: set[socket.socket] = set()
        self._stepping: set[socket.socket] = set()
        """Connections whose step is being applied: a graceful stop lets it finish and answer."""
        self._closed = False
        self._acceptors = [
            threading.Thread(target=self._accept, args=(listener,), name="paramserve-dataplane-accept", daemon=True)
            for listener in self._listeners
        ]

    def start(self) -> DataPlaneServer[_State]:
        for acceptor in self._acceptors:
            acceptor.start()
        return self

    def stop(self, grace: float = 0.0) -> None:
        """Closes the listeners and the connections between steps at once; a connection whose
        step is being applied gets up to ``grace`` seconds to finish it and send the reply (a
        graceful stop: the step is then applied and acknowledged, not left unknown), then is
        closed too. Connection threads end on their closed sockets."""
        with self._lock:
            self._closed = True
            idle = self._connections - self._stepping
        for listener in self._listeners:
            close_socket(listener)
        for sock in idle:
            close_socket(sock)
        with self._lock:
            self._lock.wait_for(lambda: not self._stepping, timeout=grace)
            remaining = list(self._connections)
        for sock in remaining:
            close_socket(sock)

    @property
    def connections(self) -> int:
        with self._lock:
            return len(self._connections)

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                sock, peer = listener.accept()
            except OSError:
                return  # closed by stop()
            with self._lock:
                refused = self._closed or len(self._connections) >= self._max_connections
                if not refused:
                    self._connections.add(sock)
            if refused:
                log.warning(
                    "data plane: refused a connection from %s (%d open, --max-connections)", peer, self._max_connections
                )
                close_socket(sock)
                continue
            threading.Thread(target=self._serve, args=(sock,), name="paramserve-dataplane", daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        try:
            tune(sock)
            sock.settimeout(HANDSHAKE_TIMEOUT)
            if self._tls is not None:
                sock = self._wrap(sock)
            reader = FrameReader(sock)
            if not self._admit(sock, reader):
                return
            sock.settimeout(None)
            replies = _ReusedBuffer()
            state = self._new_connection_state()
            while True:
                prefix, plan = reader.read_head(self._max_body, self._max_body, lambda kind: kind is FrameKind.STEP)
                if not self._begin_step(sock):
                    return  # stopping: this step is not applied (the client retries it elsewhere or later)
                try:
                    self._step(sock, plan, reader.read_payload(prefix.payload_bytes), replies, state)
                finally:
                    self._end_step(sock)
        except MessageTooLargeError as err:
            _try_send_error(sock, err)  # the frame was not read: the stream cannot go on
        except (OSError, TransportError):
            pass  # the client went away, or broke the framing: drop it
        except Exception:  # a bug here must not take the server down: logged, and the connection dropped
            log.exception("data plane: connection failed")
        finally:
            close_socket(sock)
            with self._lock:
                self._connections.discard(sock)
                self._lock.notify_all()

    def _begin_step(self, sock: socket.socket) -> bool:
        with self._lock:
            if self._closed:
                return False
            self._stepping.add(sock)
            return True

    def _end_step(self, sock: socket.socket) -> None:
        with self._lock:
            self._stepping.discard(sock)
            self._lock.notify_all()

    def _wrap(self, sock: socket.socket) -> socket.socket:
        assert self._tls is not None
        with self._lock:
            self._connections.discard(sock)
        wrapped = self._tls.wrap_socket(sock, server_side=True)
        with self._lock:
            self._connections.add(wrapped)
        return wrapped

    def _admit(self, sock: socket.socket, reader: FrameReader) -> bool:
        prefix, credential = reader.read_head(MAX_HELLO_BYTES, 0, lambda kind: kind is FrameKind.HELLO)
        if hmac.compare_digest(bytes(credential), self._credential):
            send_frame(sock, FrameKind.WELCOME)
            return True
        reason = "no credential" if not prefix.header_bytes else "a wrong credential"
        _try_send_error(
            sock,
            AuthenticationError(
                f"a data-plane connection carried {reason}: give the caller the cluster's shared token "
                "(paramserve --token-file, PARAMSERVE_TOKEN, or ClientConfig(token=...))"
            ),
        )
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


def _local_listener() -> socket.socket | None:
    """A listener on a random abstract Unix socket, or None where there are none (not Linux).

    A step over a Unix socket costs about a third of the CPU of one over TCP on loopback
    (measured: 189 vs 600 us for 470 KB each way). Abstract names belong to a network
    namespace, so only a client on this host and in this namespace reaches it, and the random
    name means a client never reaches another server by mistake (two namespaces may hold
    servers on the same port). Nothing else changes: the same HELLO authenticates each
    connection. Not offered with TLS: mutual TLS may be what authenticates clients."""
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
