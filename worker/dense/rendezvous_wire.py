"""The wire of hybrid training's rendezvous store, both halves' vocabulary: the coordinator serves
the store (coordinator/dispatch/rendezvous_server.py), each member of the dense group is a client
(worker/dense/rendezvous_store.py) through which torch.distributed's gloo (and NCCL) rendezvous.

A frame is a 9-byte prefix (magic ``PSR1``, kind, body length) and its body, at most
MAX_BODY_BYTES, checked from the prefix before anything is allocated. A connection begins with
the data plane's mutual handshake (psserver.runtime.security.DataPlaneKey) under the store's key
(``rendezvous_key``): HELLO (the client's nonce and the generation it joins), CHALLENGE (the
server's nonce and its proof), PROOF, then WELCOME or REFUSED; the server reads nothing else
before, and answers a stranger nothing but a CHALLENGE. Then REQUESTs (an operation, a timeout,
fields), each answered by one REPLY (a status, fields). A field is a 4-byte length and its bytes.

Operations are torch.distributed.Store's that gloo's and NCCL's rendezvous use, on the keys of the
connection's generation only: a namespace per formation of the group, which the coordinator can
give up (ABORTED, at once, to every member waiting in it) when a member is known to be lost.
"""

from __future__ import annotations

import enum
import socket
import struct
import time
from collections.abc import Sequence

__all__ = [
    "FRAME_SECONDS",
    "HANDSHAKE_SECONDS",
    "HELLO",
    "MAX_BODY_BYTES",
    "MAX_FIELDS",
    "MAGIC",
    "PREFIX",
    "REPLY_HEAD",
    "REQUEST_HEAD",
    "Kind",
    "Op",
    "RendezvousAborted",
    "RendezvousError",
    "RendezvousTimeout",
    "Status",
    "WireError",
    "decode_int",
    "encode_int",
    "frame",
    "pack_fields",
    "parse_prefix",
    "read_frame",
    "unpack_fields",
]

MAGIC = b"PSR1"
PREFIX = struct.Struct("!4sBI")
"""magic, kind, body length."""
HELLO = struct.Struct("!32sQ")
"""The client's nonce, the generation it joins."""
REQUEST_HEAD = struct.Struct("!BI")
"""operation, timeout in milliseconds (blocking operations), then fields."""
REPLY_HEAD = struct.Struct("!B")
"""status, then fields."""
_FIELD = struct.Struct("!I")
_INT = struct.Struct("!q")

MAX_BODY_BYTES = 1 << 20
"""A frame's body: gloo's and NCCL's rendezvous values are addresses and ids, a few hundred bytes."""
MAX_FIELDS = 1024
HANDSHAKE_SECONDS = 10.0
"""The whole handshake, from the connection on: a peer that does not authenticate is dropped."""
FRAME_SECONDS = 10.0
"""A frame's bytes, from its first: an authenticated connection may idle between frames."""


class Kind(enum.IntEnum):
    HELLO = 1
    CHALLENGE = 2
    PROOF = 3
    WELCOME = 4
    REFUSED = 5
    REQUEST = 6
    REPLY = 7


class Op(enum.IntEnum):
    SET = 1
    GET = 2
    ADD = 3
    COMPARE_SET = 4
    WAIT = 5
    CHECK = 6
    DELETE_KEY = 7
    NUM_KEYS = 8


class Status(enum.IntEnum):
    OK = 0
    TIMEOUT = 1
    ABORTED = 2
    INVALID = 3


class WireError(Exception):
    """A frame that breaks the protocol (bad magic, a body over its limit, a truncated field)."""


class RendezvousError(RuntimeError):
    """The store could not do what a member asked (a RuntimeError: torch.distributed and
    worker.dense_group treat it as a failed rendezvous)."""


class RendezvousTimeout(RendezvousError):
    """A key did not appear within the timeout."""


class RendezvousAborted(RendezvousError):
    """The coordinator gave up this generation of the group (a member was lost while it formed)."""


# ---------------------------------------------------------------- frames and fields


def frame(kind: Kind, body: bytes = b"") -> bytes:
    return PREFIX.pack(MAGIC, kind, len(body)) + body


def pack_fields(fields: Sequence[bytes]) -> bytes:
    return b"".join(_FIELD.pack(len(field)) + field for field in fields)


def unpack_fields(body: bytes | memoryview) -> list[bytes]:
    """The fields of a body; WireError for a truncated one or more than MAX_FIELDS."""
    view, offset = memoryview(body), 0
    fields: list[bytes] = []
    while offset < len(view):
        if len(fields) >= MAX_FIELDS or offset + _FIELD.size > len(view):
            raise WireError("too many fields, or a truncated field length")
        (size,) = _FIELD.unpack_from(view, offset)
        offset += _FIELD.size
        if offset + size > len(view):
            raise WireError("a field longer than its frame")
        fields.append(bytes(view[offset : offset + size]))
        offset += size
    return fields


def encode_int(value: int) -> bytes:
    return _INT.pack(value)


def decode_int(field: bytes) -> int:
    if len(field) != _INT.size:
        raise WireError("an integer field is 8 bytes")
    return int(_INT.unpack(field)[0])


def parse_prefix(prefix: bytes, max_body: int) -> tuple[Kind, int]:
    """(kind, body length) of a frame's prefix; WireError before any body is read or allocated."""
    magic, kind, size = PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise WireError("not a rendezvous frame")
    if size > max_body:
        raise WireError(f"a frame of {size} bytes, over the limit of {max_body}")
    try:
        return Kind(kind), size
    except ValueError:
        raise WireError(f"unknown frame kind {kind}") from None


# ---------------------------------------------------------------- a blocking socket's frames


def read_frame(sock: socket.socket, max_body: int, deadline: float | None) -> tuple[Kind, bytes]:
    """The next frame on a blocking socket, whole by ``deadline`` (monotonic; None: no limit).
    Raises WireError, TimeoutError, or ConnectionError when the peer closed."""
    kind, size = parse_prefix(_read_exactly(sock, PREFIX.size, deadline), max_body)
    return kind, _read_exactly(sock, size, deadline)


def _read_exactly(sock: socket.socket, size: int, deadline: float | None) -> bytes:
    buffer = bytearray(size)
    view, received = memoryview(buffer), 0
    while received < size:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("the peer was too slow")
            sock.settimeout(remaining)
        else:
            sock.settimeout(None)
        got = sock.recv_into(view[received:])
        if not got:
            raise ConnectionError("the peer closed the connection")
        received += got
    return bytes(buffer)
