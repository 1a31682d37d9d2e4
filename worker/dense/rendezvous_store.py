"""A member's side of hybrid training's rendezvous store: a ``torch.distributed.Store`` whose
every operation is a request to the coordinator's store (coordinator/dispatch/rendezvous_server.py)
over one authenticated connection (worker/dense/rendezvous_wire.py), so gloo's and NCCL's rendezvous run
on it as on a TCPStore.

The connection opens with the mutual handshake under ``rendezvous_key(token, session)``: the
store proves it holds the key before this member sends its proof, so a process squatting the
coordinator's address learns nothing reusable and cannot feed the group addresses. Every key is
the generation's (the store keeps one namespace per formation of the group). Failures raise
RendezvousError (a RuntimeError): RendezvousAborted when the coordinator gave the generation up,
RendezvousTimeout when a key did not come within the timeout. One request at a time per
connection; ``clone()`` (which torch may ask for) opens another.
"""

from __future__ import annotations

import datetime
import socket
import threading
import time
from collections.abc import Sequence

import torch.distributed as dist

from paramserve.psserver.runtime.security import DataPlaneKey, new_handshake_nonce, proofs_match
from paramserve.worker.dense.rendezvous_wire import (
    HANDSHAKE_SECONDS,
    HELLO,
    MAX_BODY_BYTES,
    REPLY_HEAD,
    REQUEST_HEAD,
    Kind,
    Op,
    RendezvousAborted,
    RendezvousError,
    RendezvousTimeout,
    Status,
    WireError,
    decode_int,
    encode_int,
    frame,
    pack_fields,
    read_frame,
    unpack_fields,
)

__all__ = ["RendezvousStore"]

REPLY_GRACE_SECONDS = 5.0
"""How much longer than a blocking operation's timeout its reply may take: the store answers
TIMEOUT itself; past this the connection is taken for lost."""


class RendezvousStore(dist.Store):
    """One member's connection to the rendezvous store of dense group ``generation``.

    Raises RendezvousError when the store cannot be reached or refuses the key (the coordinator's
    store is not there, or this worker's token differs from the coordinator's)."""

    def __init__(self, host: str, port: int, *, key: DataPlaneKey, generation: int, timeout: float):
        super().__init__()
        self._host, self._port, self._key, self._generation = host, port, key, generation
        self.set_timeout(datetime.timedelta(seconds=timeout))
        self._lock = threading.Lock()
        self._clones: list[RendezvousStore] = []
        """Kept alive with this one: torch holds a clone through C++ only, and a Python subclass
        whose Python object is gone cannot be called."""
        self._sock: socket.socket | None = _connect(host, port, key, generation, timeout)

    # ------------------------------------------------------------ torch.distributed.Store

    def set(self, key: str, value: str | bytes) -> None:
        self._call(Op.SET, [_encode(key), _encode(value)])

    def get(self, key: str) -> bytes:
        return self._call(Op.GET, [_encode(key)], self._seconds(None))[0]

    def add(self, key: str, value: int) -> int:
        return decode_int(self._call(Op.ADD, [_encode(key), encode_int(int(value))])[0])

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        return self._call(Op.COMPARE_SET, [_encode(key), _encode(expected_value), _encode(desired_value)])[0]

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self._call(Op.WAIT, [_encode(k) for k in keys], self._seconds(timeout))

    def check(self, keys: list[str]) -> bool:
        return self._call(Op.CHECK, [_encode(k) for k in keys])[0] == b"\x01"

    def delete_key(self, key: str) -> bool:
        return self._call(Op.DELETE_KEY, [_encode(key)])[0] == b"\x01"

    def num_keys(self) -> int:
        return decode_int(self._call(Op.NUM_KEYS, [])[0])

    # torch's C++ side calls a Python store's methods by their C++ names.
    deleteKey = delete_key
    getNumKeys = num_keys

    def clone(self) -> RendezvousStore:
        clone = RendezvousStore(
            self._host, self._port, key=self._key, generation=self._generation, timeout=self._seconds(None)
        )
        with self._lock:
            self._clones.append(clone)
        return clone

    def close(self) -> None:
        """Closes this connection and its clones' (operations then raise RendezvousError)."""
        with self._lock:
            sock, self._sock = self._sock, None
            clones, self._clones = self._clones, []
        if sock is not None:
            sock.close()
        for clone in clones:
            clone.close()

    # ------------------------------------------------------------ requests

    def _seconds(self, timeout: datetime.timedelta | None) -> float:
        default: datetime.timedelta = self.timeout  # type: ignore[attr-defined]  # torch's stubs lack it
        return (timeout if timeout is not None else default).total_seconds()

    def _call(self, op: Op, fields: Sequence[bytes], wait_seconds: float = 0.0) -> list[bytes]:
        millis = max(0, min(int(wait_seconds * 1000), 2**32 - 1))
        with self._lock:
            if self._sock is None:
                raise RendezvousError(f"the connection to dense group {self._generation}'s store is closed")
            try:
                self._sock.sendall(frame(Kind.REQUEST, REQUEST_HEAD.pack(op, millis) + pack_fields(fields)))
                deadline = time.monotonic() + wait_seconds + REPLY_GRACE_SECONDS
                kind, body = read_frame(self._sock, MAX_BODY_BYTES, deadline)
                if kind is not Kind.REPLY or len(body) < REPLY_HEAD.size:
                    raise WireError(f"a {kind.name} frame instead of a reply")
                (status,) = REPLY_HEAD.unpack_from(body)
                answer = unpack_fields(memoryview(body)[REPLY_HEAD.size :])
            except (OSError, WireError) as exc:
                self._sock.close()
                self._sock = None
                raise RendezvousError(
                    f"dense group {self._generation}'s store at {self._where} failed: {exc}"
                ) from None
        if status == Status.OK:
            return answer
        reason = answer[0].decode(errors="replace") if answer else "no reason given"
        error = {Status.TIMEOUT: RendezvousTimeout, Status.ABORTED: RendezvousAborted}.get(status, RendezvousError)
        raise error(reason)

    @property
    def _where(self) -> str:
        return f"[{self._host}]:{self._port}" if ":" in self._host else f"{self._host}:{self._port}"


def _encode(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _connect(host: str, port: int, key: DataPlaneKey, generation: int, timeout: float) -> socket.socket:
    """A connection to the store, both sides proven. Raises RendezvousError."""
    where = f"{host}:{port}"
    deadline = time.monotonic() + min(timeout, HANDSHAKE_SECONDS)
    try:
        sock = socket.create_connection((host, port), timeout=min(timeout, HANDSHAKE_SECONDS))
    except OSError as exc:
        raise RendezvousError(f"cannot reach the dense group's store at {where}: {exc}") from None
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        client_nonce = new_handshake_nonce()
        sock.sendall(frame(Kind.HELLO, HELLO.pack(client_nonce, generation)))
        kind, body = read_frame(sock, MAX_BODY_BYTES, deadline)
        server_nonce, proof = body[:32], body[32:]
        if kind is not Kind.CHALLENGE or not proofs_match(proof, key.server_proof(client_nonce, server_nonce)):
            raise RendezvousError(
                f"the dense group's store at {where} could not prove it holds the cluster's token: it is not the "
                "coordinator's store, or the tokens differ (nothing reusable was sent to it)"
            )
        sock.sendall(frame(Kind.PROOF, key.client_proof(client_nonce, server_nonce)))
        kind, body = read_frame(sock, MAX_BODY_BYTES, deadline)
        if kind is not Kind.WELCOME:
            raise RendezvousError(
                f"the dense group's store at {where} refused this member: {body.decode(errors='replace')}"
            )
    except (OSError, WireError) as exc:
        sock.close()
        raise RendezvousError(f"the handshake with the dense group's store at {where} failed: {exc}") from None
    except BaseException:
        sock.close()
        raise
    return sock
