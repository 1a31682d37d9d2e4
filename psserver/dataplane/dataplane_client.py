"""The step data plane's client: connections to the servers' data planes, and the step programs
each connection has defined (psserver/dataplane/frames.py has the frames both sides speak).

A client keeps one long-lived connection per server and concurrent step (``DataPlaneLinks``),
so a step costs a few system calls instead of a gRPC call, and numbers the recurring steps it
sends on each connection (``ProgramNumbers``) so that a later step names its program instead
of sending its plan again. Nothing here knows what a step carries: psserver/client/step_transport.py
builds the frames and reads the replies.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Sequence

from paramserve.psserver.dataplane.frames import (
    FRAME_HEADER_ROOM,
    HANDSHAKE_SECONDS,
    MAX_PROGRAMS,
    FrameKind,
    FrameReader,
    Prefix,
    TransportError,
    close_socket,
    raise_error_frame,
    send_frame,
    tune,
)
from paramserve.psserver.protocol.errors import AuthenticationError, MessageTooLargeError
from paramserve.psserver.runtime.security import (
    HANDSHAKE_NONCE_BYTES,
    ClientTls,
    DataPlaneKey,
    new_handshake_nonce,
    proofs_match,
)
from paramserve.wire.v1 import parameter_server_pb2 as ps_pb2

__all__ = ["DataPlaneConnection", "DataPlaneLinks", "ProgramNumbers", "ReplyPlacement"]

log = logging.getLogger(__name__)

DEFAULT_FRAME_BYTES = 64 << 20
"""The frame limit of a server that does not say its own (``--max-message-bytes``' default)."""
SUSPEND_SECONDS = 5.0
"""A data plane that refused or dropped a new connection (full, a stalled handshake, a server
restarting) is left alone this long: meanwhile steps take the gRPC ``Step`` RPC, then the data
plane is tried again."""


ReplyPlacement = Callable[[memoryview, int], Sequence[memoryview]]
"""(StepOutcome bytes, payload length) -> where the payload's bytes go, in order, adding up to
its length. Raises to refuse a reply that does not fit."""


class ProgramNumbers:
    """A client's side of one connection's programs: which number each recurring step has, and
    whether the server has it yet. Numbers are reused least recently used first, so the server
    never holds more than MAX_PROGRAMS for the connection."""

    def __init__(self) -> None:
        self._numbers: OrderedDict[Hashable, tuple[int, bool]] = OrderedDict()

    def knows(self, signature: Hashable) -> bool:
        """Whether ``signature`` has a number on this connection already."""
        return signature in self._numbers

    def number(self, signature: Hashable) -> tuple[int, bool]:
        """The step's number and whether it is defined on the server (else: define it now)."""
        entry = self._numbers.get(signature)
        if entry is not None:
            self._numbers.move_to_end(signature)
            return entry
        if len(self._numbers) < MAX_PROGRAMS:
            number = len(self._numbers) + 1
        else:
            _, (number, _) = self._numbers.popitem(last=False)
        self._numbers[signature] = (number, False)
        return number, False

    def defined(self, signature: Hashable, number: int) -> None:
        """The server answered a step that defined or ran ``number`` for ``signature``."""
        if self._numbers.get(signature, (0, False))[0] == number:
            self._numbers[signature] = (number, True)


class DataPlaneConnection:
    """One admitted connection to a server's data plane; one step in flight at a time.

    Every failure to talk (refused, reset, timed out, broken framing) raises TransportError,
    after which the connection is closed and must be replaced."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        token: str | None,
        tls: ClientTls | None,
        timeout: float,
        max_body_bytes: int,
        local_socket: str = "",
        local_owner: tuple[int, int] | None = None,
    ):
        self._max_body = max_body_bytes
        self.closed = False
        self.programs = ProgramNumbers()
        """The step programs this connection has defined (the server keeps them per connection)."""
        sock = _connect_local(local_socket, local_owner, timeout) if local_socket and tls is None else None
        self.local = sock is not None
        """Whether this connection is on the server's abstract Unix socket (same host)."""
        try:
            if sock is None:
                sock = socket.create_connection((host, port), timeout=timeout)
            tune(sock)
            if tls is not None:
                sock = _client_context(tls).wrap_socket(sock, server_hostname=tls.server_name or host)
        except (OSError, ssl.SSLError) as err:
            raise TransportError(f"cannot connect to the data plane at {host}:{port}: {err}") from None
        self._sock = sock
        self._reader = FrameReader(sock)
        try:
            sock.settimeout(min(timeout, HANDSHAKE_SECONDS))  # a stalled handshake: the Step RPC instead
            self._handshake(DataPlaneKey.of(token) if token else None, f"{host}:{port}")
            sock.settimeout(timeout)
        except OSError as err:  # ssl.SSLError too: e.g. a server that wants a client certificate
            self.close()
            raise TransportError(f"the data plane at {host}:{port} refused the connection: {err}") from None
        except BaseException:
            self.close()
            raise

    def _handshake(self, key: DataPlaneKey | None, where: str) -> None:
        """HELLO, CHALLENGE, PROOF, WELCOME (security.DataPlaneKey): the server proves it holds
        the token before this side proves it does. Raises the typed error the server refused
        with, or AuthenticationError for a server that cannot prove it (nothing reusable sent)."""
        client_nonce = new_handshake_nonce() if key is not None else b""
        send_frame(self._sock, FrameKind.HELLO, client_nonce)
        expected = (FrameKind.CHALLENGE, FrameKind.ERROR) if key is not None else (FrameKind.WELCOME, FrameKind.ERROR)
        prefix, header = self._head(lambda kind: kind in expected)
        if prefix.kind is FrameKind.ERROR:
            raise_error_frame(header)
        if key is None:
            return
        server_nonce, proof = bytes(header[:HANDSHAKE_NONCE_BYTES]), bytes(header[HANDSHAKE_NONCE_BYTES:])
        if len(server_nonce) != HANDSHAKE_NONCE_BYTES or not proofs_match(
            proof, key.server_proof(client_nonce, server_nonce)
        ):
            raise AuthenticationError(
                f"the data plane at {where} could not prove it holds the cluster's token: it is not the parameter "
                "server, or its token differs (nothing reusable was sent to it)"
            )
        send_frame(self._sock, FrameKind.PROOF, key.client_proof(client_nonce, server_nonce))
        prefix, header = self._head(lambda kind: kind in (FrameKind.WELCOME, FrameKind.ERROR))
        if prefix.kind is FrameKind.ERROR:
            raise_error_frame(header)

    def send_step(self, plan: bytes, payload: Sequence[bytes | memoryview]) -> None:
        """Sends one step: StepPlan bytes and the pushed parts' bytes, in plan order."""
        with self._closed_on_failure("sending a step"):
            send_frame(self._sock, FrameKind.STEP, plan, payload)

    def receive_reply(self, place: ReplyPlacement) -> None:
        """Reads the reply to the step sent last, its payload straight where ``place`` says.
        Raises the typed error the server answered with (the connection stays usable), what
        ``place`` raises (the connection is closed), or TransportError."""
        prefix, header = self._head(lambda kind: kind in (FrameKind.REPLY, FrameKind.ERROR))
        if prefix.kind is FrameKind.ERROR:
            if prefix.payload_bytes:
                self.close()
                raise TransportError("the server sent an ERROR frame with a payload")
            raise_error_frame(header)
        with self._closed_on_failure("reading the server's reply"):
            self._reader.read_into(place(header, prefix.payload_bytes))

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            close_socket(self._sock)

    def _head(self, allowed: Callable[[FrameKind], bool]) -> tuple[Prefix, memoryview]:
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


def _host_of(address: str) -> str:
    """The host of ``host:port`` (``[v6]:port`` too): where a server's data plane is reached."""
    host = address.rpartition(":")[0] or address
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def _connect_local(name: str, owner: tuple[int, int] | None, timeout: float) -> socket.socket | None:
    """A connection to the server's abstract Unix socket, or None when this process cannot reach
    it (another host, or another network namespace) or when whoever listens there is not the
    server (``owner``: its pid and uid, as GetDataPlane said; SO_PEERCRED tells who listens, and
    a process cannot forge it): then TCP."""
    if owner is None or not hasattr(socket, "SO_PEERCRED"):
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(b"\0" + name.encode())
        pid, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    except OSError:
        sock.close()
        return None
    if (pid, uid) != owner:
        log.warning(
            "data plane: the local socket %s is held by pid %d (uid %d), not the server (pid %d, uid %d): using TCP",
            name,
            pid,
            uid,
            *owner,
        )
        sock.close()
        return None
    return sock


def _client_context(tls: ClientTls) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(tls.root_certificates))
    if tls.cert_chain is not None and tls.private_key is not None:
        context.load_cert_chain(str(tls.cert_chain), str(tls.private_key))
    return context


class DataPlaneLinks:
    """A client's connections to its servers' data planes, by server index (in ``addresses``, the
    servers' gRPC ``host:port``s: a data plane listens on the same host): each server's port
    is asked for once (``discover``), connections are opened on demand and kept for reuse, and
    a server whose connection breaks is forgotten, so the next step asks again (a restarted
    server listens on a new port). Thread-safe: concurrent steps take separate connections."""

    def __init__(
        self,
        addresses: Sequence[str],
        discover: Callable[[int], ps_pb2.DataPlaneInfo | None],
        *,
        token: str | None,
        tls: ClientTls | None,
        timeout: float,
    ):
        self._hosts = [_host_of(address) for address in addresses]
        self._discover = discover
        self._token = token
        self._tls = tls
        self._timeout = timeout
        self._lock = threading.Lock()
        self._endpoints: dict[int, ps_pb2.DataPlaneInfo | None] = {}
        self._idle: dict[int, list[DataPlaneConnection]] = {}
        self._suspended_until: dict[int, float] = {}
        self._closed = False

    def step_limit(self, server: int) -> int | None:
        """The most tensor bytes (both ways) one step may move on ``server``'s data plane, with
        room left for its header; None when it has none or is suspended (its steps go over gRPC).
        Asks for the port the first time, raising what ``discover`` raises."""
        with self._lock:
            if self._suspended_until.get(server, 0.0) > time.monotonic():
                return None
            known, info = server in self._endpoints, self._endpoints.get(server)
        if not known:
            info = self._endpoint(server)
        if info is None or not info.port:
            return None
        return (info.max_frame_bytes or DEFAULT_FRAME_BYTES) - FRAME_HEADER_ROOM

    def acquire(self, server: int) -> DataPlaneConnection | None:
        """An idle or new connection to ``server``'s data plane; None when it has none (use the
        Step RPC). Raises TransportError when it cannot connect, and what ``discover`` raises."""
        with self._lock:
            idle = self._idle.get(server)
            if idle:
                return idle.pop()
        info = self._endpoint(server)
        if info is None or not info.port:
            return None
        try:
            return self._connect(server, info)
        except TransportError:
            self.suspend(server)
            raise

    def suspend(self, server: int, seconds: float = SUSPEND_SECONDS) -> None:
        """Leaves ``server``'s data plane alone for ``seconds``: its steps go over gRPC meanwhile."""
        with self._lock:
            self._suspended_until[server] = time.monotonic() + seconds
            self._endpoints.pop(server, None)  # asked again afterwards: a restarted server has a new port
        log.warning("data plane of server %d: no new connection; steps take the Step RPC for %.0fs", server, seconds)

    def _connect(self, server: int, info: ps_pb2.DataPlaneInfo) -> DataPlaneConnection:
        return DataPlaneConnection(
            self._hosts[server],
            info.port,
            token=self._token,
            tls=self._tls,
            timeout=self._timeout,
            max_body_bytes=info.max_frame_bytes or DEFAULT_FRAME_BYTES,
            local_socket=info.local_socket,
            local_owner=(info.server_pid, info.server_uid) if info.server_pid else None,
        )

    def _endpoint(self, server: int) -> ps_pb2.DataPlaneInfo | None:
        with self._lock:
            if server in self._endpoints:
                return self._endpoints[server]
        info = self._discover(server)
        with self._lock:
            self._endpoints[server] = info
        return info

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
