"""The step data plane: training steps over one long-lived TCP connection per client and server.

gRPC stays the control plane (creation, checkpoints, listing, health). A training step's
exchange with a server, the hot path, is one StepRequest out and one StepReply back, the very
bytes the ``Step`` RPC carries; in grpcio each such call costs the server about 2.5 ms of
Python machinery (a thread-pool hand-off, interceptors, the completion queue), several times
what applying the step costs. Here a connection's own thread reads a frame, hands the body to
the same ``ParameterServerServicer.step_exchange`` that serves ``Step``, and writes the reply:
a few system calls per step. A client sends its requests to every server before it reads any
reply, so one step's exchanges with all servers overlap without a thread each.

Frames, both ways: ``PREFIX`` (magic ``PSD1``, kind, body length), then the body.

- ``HELLO`` (client, first): the credential a gRPC call presents in ``authorization``
  (security.bearer_metadata), empty without a token. ``WELCOME`` (empty) admits the client;
  otherwise the server answers ``ERROR`` and closes. Nothing else is read before it.
- ``STEP``: a packed StepRequest; ``REPLY``: a packed StepReply, or ``ERROR``: a DataPlaneError
  naming the typed error, which the client raises as the gRPC path would.

What the gRPC path guarantees holds here: the same validation before apply, exactly-once
pushes by idempotency key (a client retries a broken connection's step with its key), no
pickle, bodies checked against ``--max-message-bytes`` before any allocation, TLS (mutual
when the server requires client certificates) with the gRPC server's certificates, and a
bounded number of connections. The client finds the port with the ``GetDataPlane`` RPC.
"""

from __future__ import annotations

import contextlib
import enum
import hmac
import logging
import secrets
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import NoReturn

import torch

from paramserve.psserver.errors import (
    ERROR_TYPES,
    AuthenticationError,
    InternalError,
    MessageTooLargeError,
    ParamServeError,
)
from paramserve.psserver.programs import ProgramNumbers, StepPrograms
from paramserve.psserver.security import ClientTls, TlsConfig, bearer_metadata
from paramserve.psserver.streams import byte_buffer
from paramserve.psserver.tensors import writable_byte_view
from paramserve.wire.v1 import parameter_server_pb2 as ps_pb2

__all__ = [
    "DataPlaneConnection",
    "DataPlaneLinks",
    "DataPlaneServer",
    "FrameKind",
    "TransportError",
]

log = logging.getLogger(__name__)

MAGIC = b"PSD1"
PREFIX = struct.Struct("!4sB3xIQ")
"""magic, kind, 3 bytes reserved, header length, payload length (network order)."""
FRAME_HEADER_ROOM = 1 << 20
"""Room a client leaves under the server's frame limit for a step's header (its plan)."""
MAX_HELLO_BYTES = 512
"""A HELLO header is a credential: anything longer is not one (read before authentication)."""
HANDSHAKE_TIMEOUT = 10.0
"""Seconds a new connection has to finish TLS and its HELLO before the server drops it."""
SOCKET_BUFFER_BYTES = 4 << 20
"""Kernel send/receive buffers: a typical step's body in one or two system calls."""
REUSED_BUFFER_LIMIT = 16 << 20
"""A connection keeps its payload buffers between frames up to this size: a step's bytes land in
memory already mapped (a fresh megabyte costs more in page faults than in copying), and a peer
holds at most this much of a server's memory between steps."""


class FrameKind(enum.IntEnum):
    HELLO = 1
    WELCOME = 2
    STEP = 3
    REPLY = 4
    ERROR = 5


class TransportError(ConnectionError):
    """The connection broke or timed out, or the peer broke the framing: the step's outcome is
    unknown. Safe to retry on a new connection with the same idempotency key."""


@dataclass(frozen=True)
class _Prefix:
    kind: FrameKind
    header_bytes: int
    payload_bytes: int


# ---------------------------------------------------------------- framing (both sides)


def _send_frame(sock: socket.socket, kind: FrameKind, header: bytes | memoryview = b"",
                payload: Sequence[bytes | memoryview] = ()) -> None:
    """Writes one frame; the pieces go out as they are (no join), except over TLS, which has no
    scatter-gather."""
    size = sum(len(p) for p in payload)
    views = [memoryview(PREFIX.pack(MAGIC, kind, len(header), size))]
    views += [memoryview(p).cast("B") for p in (header, *payload) if len(p)]
    if isinstance(sock, ssl.SSLSocket):
        for view in views:
            sock.sendall(view)
        return
    while views:
        sent = sock.sendmsg(views[:512])  # IOV_MAX is 1024 on Linux
        while sent:
            if sent >= len(views[0]):
                sent -= len(views[0])
                views.pop(0)
            else:
                views[0] = views[0][sent:]
                sent = 0


def _receive_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        count = sock.recv_into(view[got:])
        if not count:
            raise TransportError("the peer closed the connection")
        got += count


class _FrameReader:
    """Reads frames from one socket: the prefix, then the header into a buffer it reuses; the
    caller then reads the payload where it wants it (``read_into``)."""

    def __init__(self, sock: socket.socket):
        self._sock = sock
        self._prefix = bytearray(PREFIX.size)
        self._header = bytearray(256)
        self._payload = byte_buffer(0)

    def read_head(self, max_header: int, max_payload: int, allowed: Callable[[FrameKind], bool]) -> tuple[_Prefix, memoryview]:
        """The next frame's prefix and header (valid until the next call). Raises TransportError
        for a closed connection or broken framing and MessageTooLargeError for a frame over the
        limits (nothing allocated for it)."""
        _receive_exact(self._sock, memoryview(self._prefix))
        magic, kind, header_bytes, payload_bytes = PREFIX.unpack(self._prefix)
        if magic != MAGIC:
            raise TransportError(f"not a paramserve data-plane frame (starts with {bytes(magic)!r})")
        try:
            frame_kind = FrameKind(kind)
        except ValueError:
            raise TransportError(f"unknown data-plane frame kind {kind}") from None
        if not allowed(frame_kind):
            raise TransportError(f"unexpected {frame_kind.name} frame")
        if header_bytes > max_header or payload_bytes > max_payload:
            raise MessageTooLargeError(
                f"a {frame_kind.name} frame of {header_bytes} + {payload_bytes} bytes is over this data plane's "
                f"limits ({max_header} + {max_payload}, --max-message-bytes): send smaller steps, or raise the limit"
            )
        if header_bytes > len(self._header):
            self._header = bytearray(header_bytes)
        header = memoryview(self._header)[:header_bytes]
        _receive_exact(self._sock, header)
        return _Prefix(frame_kind, header_bytes, payload_bytes), header

    def read_payload(self, nbytes: int) -> torch.Tensor:
        """The frame's payload as a uint8 tensor: in this reader's buffer (valid until the next
        call) up to REUSED_BUFFER_LIMIT, else a new one."""
        if nbytes > self._payload.numel():
            buffer = byte_buffer(nbytes)
            if nbytes <= REUSED_BUFFER_LIMIT:
                self._payload = buffer
        else:
            buffer = self._payload
        payload = buffer[:nbytes]
        if nbytes:
            _receive_exact(self._sock, writable_byte_view(payload))
        return payload

    def read_into(self, views: Sequence[memoryview]) -> None:
        for view in views:
            _receive_exact(self._sock, view)


def _tune(sock: socket.socket) -> None:
    if sock.family != socket.AF_UNIX:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)


def _error_header(error: ParamServeError) -> bytes:
    return ps_pb2.DataPlaneError(
        error_type=type(error).__name__, message=error.message, variable=error.variable or ""
    ).SerializeToString()


def _raise_error_frame(header: memoryview) -> NoReturn:
    try:
        message = ps_pb2.DataPlaneError.FromString(bytes(header))
    except Exception:  # noqa: BLE001 - protobuf's DecodeError, or worse
        raise TransportError("the server sent an ERROR frame that does not parse") from None
    cls = ERROR_TYPES.get(message.error_type, InternalError)
    raise cls(message.message or message.error_type, variable=message.variable or None)


# ---------------------------------------------------------------- server


StepExchange = Callable[[memoryview, torch.Tensor, Callable[[int], torch.Tensor], StepPrograms], tuple[bytes, memoryview]]
"""(StepPlan bytes, the pushed bytes as a uint8 tensor, a reply-buffer allocator, the connection's
step programs) -> (StepOutcome bytes, the pulled bytes): ParameterServerServicer.step_frames.
Raises ParamServeError."""
ErrorFor = Callable[[Exception], ParamServeError]
"""The typed error an unexpected exception stands for (the gRPC boundary's rule)."""


class DataPlaneServer:
    """A parameter server's data-plane listener: one thread per admitted connection, at most
    ``max_connections`` at once (a thread per connected worker, which blocks on its socket)."""

    def __init__(
        self,
        exchange: StepExchange,
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
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._closed = False
        self._acceptors = [
            threading.Thread(target=self._accept, args=(listener,), name="paramserve-dataplane-accept", daemon=True)
            for listener in self._listeners
        ]

    def start(self) -> "DataPlaneServer":
        for acceptor in self._acceptors:
            acceptor.start()
        return self

    def stop(self) -> None:
        """Closes the listeners and every connection (their threads end on the closed socket)."""
        with self._lock:
            self._closed = True
            connections = list(self._connections)
        for listener in self._listeners:
            _close(listener)
        for sock in connections:
            _close(sock)

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
                log.warning("data plane: refused a connection from %s (%d open, --max-connections)",
                            peer, self._max_connections)
                _close(sock)
                continue
            threading.Thread(target=self._serve, args=(sock,), name="paramserve-dataplane", daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        try:
            _tune(sock)
            sock.settimeout(HANDSHAKE_TIMEOUT)
            if self._tls is not None:
                sock = self._wrap(sock)
            reader = _FrameReader(sock)
            if not self._admit(sock, reader):
                return
            sock.settimeout(None)
            replies = _ReusedBuffer()
            programs = StepPrograms()
            while True:
                prefix, plan = reader.read_head(self._max_body, self._max_body, lambda kind: kind is FrameKind.STEP)
                self._step(sock, plan, reader.read_payload(prefix.payload_bytes), replies, programs)
        except MessageTooLargeError as err:
            _try_send_error(sock, err)  # the frame was not read: the stream cannot go on
        except (OSError, TransportError):
            pass  # the client went away, or broke the framing: drop it
        except Exception:  # noqa: BLE001 - a bug here must not take the server down
            log.exception("data plane: connection failed")
        finally:
            _close(sock)
            with self._lock:
                self._connections.discard(sock)

    def _wrap(self, sock: socket.socket) -> socket.socket:
        assert self._tls is not None
        with self._lock:
            self._connections.discard(sock)
        wrapped = self._tls.wrap_socket(sock, server_side=True)
        with self._lock:
            self._connections.add(wrapped)
        return wrapped

    def _admit(self, sock: socket.socket, reader: _FrameReader) -> bool:
        prefix, credential = reader.read_head(MAX_HELLO_BYTES, 0, lambda kind: kind is FrameKind.HELLO)
        if hmac.compare_digest(bytes(credential), self._credential):
            _send_frame(sock, FrameKind.WELCOME)
            return True
        reason = "no credential" if not prefix.header_bytes else "a wrong credential"
        _try_send_error(sock, AuthenticationError(
            f"a data-plane connection carried {reason}: give the caller the cluster's shared token "
            "(paramserve --token-file, PARAMSERVE_TOKEN, or ClientConfig(token=...))"
        ))
        return False

    def _step(self, sock: socket.socket, plan: memoryview, payload: torch.Tensor, replies: "_ReusedBuffer",
              programs: StepPrograms) -> None:
        start = time.perf_counter()
        try:
            outcome, values = self._exchange(plan, payload, replies.get, programs)
        except Exception as exc:  # noqa: BLE001 - a typed error, as at the gRPC boundary
            error = exc if isinstance(exc, ParamServeError) else self._error_for(exc)
            self._finish(error, start, len(plan) + payload.numel(), 0)
            _send_frame(sock, FrameKind.ERROR, _error_header(error))
            return
        self._finish(None, start, len(plan) + payload.numel(), len(outcome) + len(values))
        _send_frame(sock, FrameKind.REPLY, outcome, (values,))

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
        _send_frame(sock, FrameKind.ERROR, _error_header(error))
    except OSError:
        pass


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


# ---------------------------------------------------------------- client


ReplyPlacement = Callable[[memoryview, int], Sequence[memoryview]]
"""(StepOutcome bytes, payload length) -> where the payload's bytes go, in order, adding up to
its length. Raises to refuse a reply that does not fit."""


class DataPlaneConnection:
    """One admitted connection to a server's data plane; one step in flight at a time.

    Every failure to talk (refused, reset, timed out, broken framing) raises TransportError,
    after which the connection is closed and must be replaced."""

    def __init__(self, host: str, port: int, *, token: str | None, tls: ClientTls | None, timeout: float,
                 max_body_bytes: int, local_socket: str = ""):
        self._max_body = max_body_bytes
        self.closed = False
        self.programs = ProgramNumbers()
        """This connection's step programs, on the client's side (psserver/programs.py)."""
        sock = _connect_local(local_socket, timeout) if local_socket and tls is None else None
        self.local = sock is not None
        """Whether this connection is on the server's abstract Unix socket (same host)."""
        try:
            if sock is None:
                sock = socket.create_connection((host, port), timeout=timeout)
            _tune(sock)
            if tls is not None:
                sock = _client_context(tls).wrap_socket(sock, server_hostname=tls.server_name or host)
        except (OSError, ssl.SSLError) as err:
            raise TransportError(f"cannot connect to the data plane at {host}:{port}: {err}") from None
        self._sock = sock
        self._reader = _FrameReader(sock)
        credential = bearer_metadata(token)[1].encode() if token else b""
        try:
            _send_frame(sock, FrameKind.HELLO, credential)
            prefix, header = self._head(lambda kind: kind in (FrameKind.WELCOME, FrameKind.ERROR))
        except OSError as err:  # ssl.SSLError too: e.g. a server that wants a client certificate
            self.close()
            raise TransportError(f"the data plane at {host}:{port} refused the connection: {err}") from None
        except BaseException:
            self.close()
            raise
        if prefix.kind is FrameKind.ERROR:
            self.close()
            _raise_error_frame(header)

    def fits(self, nbytes: int) -> bool:
        """Whether a step moving ``nbytes`` of tensors (both ways) is within the server's frame
        limit, with room for its header."""
        return nbytes <= self._max_body - FRAME_HEADER_ROOM

    def send_step(self, plan: bytes, payload: Sequence[bytes | memoryview]) -> None:
        """Sends one step: StepPlan bytes and the pushed parts' bytes, in plan order."""
        with self._closed_on_failure("sending a step"):
            _send_frame(self._sock, FrameKind.STEP, plan, payload)

    def receive_reply(self, place: ReplyPlacement) -> None:
        """Reads the reply to the step sent last, its payload straight where ``place`` says.
        Raises the typed error the server answered with (the connection stays usable), what
        ``place`` raises (the connection is closed), or TransportError."""
        prefix, header = self._head(lambda kind: kind in (FrameKind.REPLY, FrameKind.ERROR))
        if prefix.kind is FrameKind.ERROR:
            if prefix.payload_bytes:
                self.close()
                raise TransportError("the server sent an ERROR frame with a payload")
            _raise_error_frame(header)
        with self._closed_on_failure("reading the server's reply"):
            self._reader.read_into(place(header, prefix.payload_bytes))

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            _close(self._sock)

    def _head(self, allowed: Callable[[FrameKind], bool]) -> tuple[_Prefix, memoryview]:
        with self._closed_on_failure("reading the server's reply"):
            try:
                return self._reader.read_head(self._max_body, self._max_body, allowed)
            except MessageTooLargeError as err:
                raise TransportError(f"the server's reply is too large: {err}") from None

    @contextlib.contextmanager
    def _closed_on_failure(self, doing: str) -> Iterator[None]:
        """Any failure inside closes the connection (its framing is lost); an OSError (a reset,
        a timeout) becomes TransportError, which the client retries on a new connection."""
        try:
            yield
        except OSError as err:
            self.close()
            raise TransportError(f"{doing} failed: {err}") from None
        except BaseException:
            self.close()
            raise


def _connect_local(name: str, timeout: float) -> socket.socket | None:
    """A connection to the server's abstract Unix socket, or None when this process cannot reach
    it (another host, or another network namespace): then TCP."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(b"\0" + name.encode())
    except OSError:
        sock.close()
        return None
    return sock


def _client_context(tls: ClientTls) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(tls.root_certificates))
    if tls.cert_chain is not None and tls.private_key is not None:
        context.load_cert_chain(str(tls.cert_chain), str(tls.private_key))
    return context


class DataPlaneLinks:
    """A client's connections to its servers' data planes, by server index: each server's port
    is asked for once (``discover``), connections are opened on demand and kept for reuse, and
    a server whose connection breaks is forgotten, so the next step asks again (a restarted
    server listens on a new port). Thread-safe: concurrent steps take separate connections."""

    def __init__(self, hosts: Sequence[str], discover: Callable[[int], ps_pb2.DataPlaneInfo | None], *,
                 token: str | None, tls: ClientTls | None, timeout: float):
        self._hosts = list(hosts)
        self._discover = discover
        self._token = token
        self._tls = tls
        self._timeout = timeout
        self._lock = threading.Lock()
        self._endpoints: dict[int, ps_pb2.DataPlaneInfo | None] = {}
        self._idle: dict[int, list[DataPlaneConnection]] = {}
        self._closed = False

    def acquire(self, server: int) -> DataPlaneConnection | None:
        """An idle or new connection to ``server``'s data plane; None when it has none (use the
        Step RPC). Raises TransportError when it cannot connect, and what ``discover`` raises."""
        with self._lock:
            idle = self._idle.get(server)
            if idle:
                return idle.pop()
            known = server in self._endpoints
            info = self._endpoints.get(server)
        if not known:
            info = self._discover(server)
            with self._lock:
                self._endpoints[server] = info
        if info is None or not info.port:
            return None
        return DataPlaneConnection(self._hosts[server], info.port, token=self._token, tls=self._tls,
                                   timeout=self._timeout, max_body_bytes=info.max_frame_bytes or (64 << 20),
                                   local_socket=info.local_socket)

    def release(self, server: int, connection: DataPlaneConnection) -> None:
        """Gives back a connection whose last step ended with a whole reply."""
        with self._lock:
            if not connection.closed and not self._closed:
                self._idle.setdefault(server, []).append(connection)
                return
        connection.close()

    def forget(self, server: int, connection: DataPlaneConnection | None = None) -> None:
        """After a broken connection: closes it and ``server``'s idle ones, and forgets its port."""
        with self._lock:
            self._endpoints.pop(server, None)
            idle = self._idle.pop(server, [])
        for each in [*idle, *([connection] if connection is not None else [])]:
            each.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle = [c for connections in self._idle.values() for c in connections]
            self._idle.clear()
        for connection in idle:
            connection.close()
