"""The step data plane's protocol, shared by its server (dataplane_server.py) and its client
(dataplane_client.py): frames, their kinds and limits, the errors they carry, and how many step
programs a connection may hold.

gRPC stays the control plane (creation, checkpoints, listing, health). A training step's
exchange with a server, the hot path, travels instead on a second TCP port of the server, over
one long-lived connection per client: in grpcio each call costs the server about 2.5 ms of
Python machinery (a thread-pool hand-off, interceptors, the completion queue), several times
what applying the step costs. Here a connection's own thread reads a frame, hands it to the
server's step engine (psserver/steps/engine.py, which serves the ``Step`` RPC too), and writes the
reply: a few system calls per step. A client sends its requests to every server before it reads
any reply, so one step's exchanges with all servers overlap without a thread each.

Frames, both ways: ``PREFIX`` (magic ``PSD1``, kind, header length, payload length), then the
header (a protobuf message), then the payload (raw bytes).

- The handshake (security.DataPlaneKey), within HANDSHAKE_SECONDS in all: ``HELLO`` (client,
  first) carries a fresh 32-byte nonce, or nothing when the cluster has no token; ``CHALLENGE``
  (server) its own nonce and its proof over both, which the client checks before it answers
  ``PROOF`` with its own; ``WELCOME`` (empty) admits the client. A refusal is ``ERROR`` and a
  close. Nothing else is read before it, and a connection still in it counts against a small
  budget of its own (the oldest is dropped when a new one needs its slot), so connections that
  never authenticate cannot crowd out those that do.
- ``STEP``: a StepPlan header (whole, or defining or running a step program) and the pushed
  parts' bytes, back to back in plan order. ``REPLY``: a StepOutcome header and the pulled
  bytes in the outcome's order; or ``ERROR``: a DataPlaneError header naming the typed error,
  which the client raises as the gRPC path would, and no payload.

What the gRPC path guarantees holds here: the same validation before apply, exactly-once
pushes by idempotency key (a client retries a broken connection's step with its key), no
pickle, frames checked against ``--max-message-bytes`` before any allocation, TLS (mutual
when the server requires client certificates) with the gRPC server's certificates, and a
bounded number of connections. The client finds the port with the ``GetDataPlane`` RPC.
"""

from __future__ import annotations

import enum
import socket
import ssl
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NoReturn

import torch

from paramserve.psserver.protocol.errors import ERROR_TYPES, InternalError, MessageTooLargeError, ParamServeError
from paramserve.psserver.protocol.streams import byte_buffer
from paramserve.psserver.protocol.tensors import writable_byte_view
from paramserve.wire.v1 import parameter_server_pb2 as ps_pb2

__all__ = [
    "FRAME_HEADER_ROOM",
    "MAGIC",
    "FRAME_SECONDS",
    "HANDSHAKE_SECONDS",
    "MAX_PROGRAMS",
    "MAX_PROGRAM_ENTRIES",
    "MAX_PROGRAM_PLAN_BYTES",
    "MAX_STEP_HEADER_BYTES",
    "MIN_FRAME_BYTES_PER_SECOND",
    "PREFIX",
    "FrameKind",
    "FrameReader",
    "FramingError",
    "Prefix",
    "TransportError",
    "close_socket",
    "error_header",
    "fits_a_program",
    "raise_error_frame",
    "send_frame",
    "tune",
]

MAGIC = b"PSD1"
HANDSHAKE_SECONDS = 10.0
"""A new connection has this long, in all, to finish TLS and the handshake."""
FRAME_SECONDS = 10.0
"""Once its first byte arrives, a frame's prefix and header have this long to arrive, and its
payload this long plus a second per MIN_FRAME_BYTES_PER_SECOND: a stalled or trickled frame
never holds a connection's buffers for long."""
MIN_FRAME_BYTES_PER_SECOND = 1 << 20
MAX_STEP_HEADER_BYTES = 1 << 20
"""A STEP frame's header (its plan) at most: what a client leaves room for (FRAME_HEADER_ROOM)."""
PREFIX = struct.Struct("!4sB3xIQ")
"""magic, kind, 3 bytes reserved, header length, payload length (network order)."""
FRAME_HEADER_ROOM = 1 << 20
"""Room a client leaves under the server's frame limit for a step's header (its plan)."""
MAX_PROGRAM_PLAN_BYTES = 256 << 10
"""One step program's plan at most (serialized): with MAX_PROGRAMS, what bounds the plans a
connection's programs keep on the server (4 MiB); a larger step is sent as a plain plan."""
SOCKET_BUFFER_BYTES = 4 << 20
"""Kernel send/receive buffers: a typical step's body in one or two system calls."""
REUSED_BUFFER_LIMIT = 16 << 20
"""A connection keeps its payload buffers between frames up to this size: a step's bytes land in
memory already mapped (a fresh megabyte costs more in page faults than in copying), and a peer
holds at most this much of a server's memory between steps."""

MAX_PROGRAMS = 16
"""Step programs one connection may hold (a worker's steps need one or two), numbered
1..MAX_PROGRAMS by the client (psserver/dataplane/dataplane_client.py: ProgramNumbers)."""
MAX_PROGRAM_ENTRIES = 4096
"""Push parts plus reads one program may hold, so that a connection's programs stay within a
few MB of the server's memory; a larger step is sent as a plain plan."""


def fits_a_program(entries: int) -> bool:
    """Whether a step of ``entries`` push parts and reads may be a program."""
    return entries <= MAX_PROGRAM_ENTRIES


class FrameKind(enum.IntEnum):
    HELLO = 1
    WELCOME = 2
    STEP = 3
    REPLY = 4
    ERROR = 5
    CHALLENGE = 6
    PROOF = 7


class TransportError(ConnectionError):
    """The connection broke or timed out, or the peer broke the framing: the step's outcome is
    unknown. Safe to retry on a new connection with the same idempotency key."""


class FramingError(TransportError):
    """The peer broke the framing: bytes that are no frame (``malformed_frame``), or a frame of a
    kind not allowed there (``unexpected_frame``, e.g. a STEP before the handshake). ``reason``
    is that name, a server's refusal reason (``paramserve_dataplane_refused_total``)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Prefix:
    kind: FrameKind
    header_bytes: int
    payload_bytes: int


def send_frame(
    sock: socket.socket, kind: FrameKind, header: bytes | memoryview = b"", payload: Sequence[bytes | memoryview] = ()
) -> None:
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


def receive_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        count = sock.recv_into(view[got:])
        if not count:
            raise TransportError("the peer closed the connection")
        got += count


class FrameReader:
    """Reads frames from one socket: the prefix, then the header into a buffer it reuses; the
    caller then reads the payload where it wants it (``read_into``)."""

    def __init__(self, sock: socket.socket):
        self._sock = sock
        self._prefix = bytearray(PREFIX.size)
        self._header = bytearray(256)
        self._payload = byte_buffer(0)

    def read_head(
        self, max_header: int, max_payload: int, allowed: Callable[[FrameKind], bool]
    ) -> tuple[Prefix, memoryview]:
        """The next frame's prefix and header (valid until the next call). Raises TransportError
        for a closed connection, FramingError (a TransportError) for broken framing, and
        MessageTooLargeError for a frame over the limits (nothing allocated for it)."""
        receive_exact(self._sock, memoryview(self._prefix))
        magic, kind, header_bytes, payload_bytes = PREFIX.unpack(self._prefix)
        if magic != MAGIC:
            raise FramingError("malformed_frame", f"not a paramserve data-plane frame (starts with {bytes(magic)!r})")
        try:
            frame_kind = FrameKind(kind)
        except ValueError:
            raise FramingError("malformed_frame", f"unknown data-plane frame kind {kind}") from None
        if not allowed(frame_kind):
            raise FramingError("unexpected_frame", f"unexpected {frame_kind.name} frame")
        if header_bytes > max_header or payload_bytes > max_payload:
            raise MessageTooLargeError(
                f"a {frame_kind.name} frame of {header_bytes} + {payload_bytes} bytes is over this data plane's "
                f"limits ({max_header} + {max_payload}, --max-message-bytes): send smaller steps, or raise the limit"
            )
        if header_bytes > len(self._header):
            self._header = bytearray(header_bytes)
        header = memoryview(self._header)[:header_bytes]
        receive_exact(self._sock, header)
        return Prefix(frame_kind, header_bytes, payload_bytes), header

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
            receive_exact(self._sock, writable_byte_view(payload))
        return payload

    def read_into(self, views: Sequence[memoryview]) -> None:
        for view in views:
            receive_exact(self._sock, view)


DEAD_PEER_SECONDS = 5
"""A peer that vanished without closing its connection (a host or container gone, a cut link) is
noticed within about this long: by TCP keepalive probes while a step waits for its reply (the
kernel of a live peer answers them however busy the process is), and by TCP_USER_TIMEOUT while
sent bytes go unacknowledged. Without these a step would wait for the socket timeout."""


def tune(sock: socket.socket) -> None:
    """No Nagle delay, dead peers noticed within DEAD_PEER_SECONDS, and kernel buffers of
    SOCKET_BUFFER_BYTES."""
    if sock.family != socket.AF_UNIX:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        if hasattr(socket, "TCP_KEEPIDLE"):  # Linux
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 2)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, DEAD_PEER_SECONDS - 2)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, DEAD_PEER_SECONDS * 1000)
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)


def error_header(error: ParamServeError) -> bytes:
    """An ERROR frame's header for ``error``."""
    return ps_pb2.DataPlaneError(
        error_type=type(error).__name__, message=error.message, variable=error.variable or ""
    ).SerializeToString()


def raise_error_frame(header: memoryview) -> NoReturn:
    """Raises the typed error an ERROR frame's header names (TransportError when it does not parse)."""
    try:
        message = ps_pb2.DataPlaneError.FromString(bytes(header))
    except Exception:
        raise TransportError("the server sent an ERROR frame that does not parse") from None
    cls = ERROR_TYPES.get(message.error_type, InternalError)
    raise cls(message.message or message.error_type, variable=message.variable or None)


def close_socket(sock: socket.socket) -> None:
    """Shuts ``sock`` down both ways (waking a thread blocked on it) and closes it; never raises."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass
