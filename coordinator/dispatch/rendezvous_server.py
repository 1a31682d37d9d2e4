"""The coordinator's side of hybrid training's rendezvous store (worker/dense/rendezvous_wire.py has the
wire, worker/dense/rendezvous_store.py the members' side).

Why not torch's TCPStore: its server listens on every interface whatever host it is given, and
answers anyone who reaches it (list, read, write, delete keys: join or break a formation of the
group). This one listens on the address the coordinator is told only (``bind_listener``; 127.0.0.1
for a local cluster), reads no request and shows no key before a member proved the store's key
(the data plane's mutual handshake, ``security.rendezvous_key``: the cluster's token and this
store's session secret; a stranger's HELLO gets a CHALLENGE, anything else nothing), and keeps
a namespace per generation of the group, which the coordinator can give up (``abort``): every
member waiting in it is answered ABORTED at once, so a member lost while the group forms costs
the others milliseconds, not the group's timeout.

``StoreTable`` is the state, plain Python; ``RendezvousServer`` serves it on one thread
(``paramserve-rendezvous``) running an asyncio loop, however many members connect. What a peer can
hold: unauthenticated, HANDSHAKE_SECONDS and one of MAX_PENDING_HANDSHAKES slots (the oldest is
dropped for a newcomer), a HELLO of 40 bytes and a PROOF of 32; authenticated, a frame of at most
MAX_BODY_BYTES within FRAME_SECONDS of its prefix, MAX_STORE_BYTES in all.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import ipaddress
import logging
import secrets
import socket
import threading
import time
from collections.abc import Sequence

from paramserve.psserver.runtime.rate_limited_log import RateLimitedLog
from paramserve.psserver.runtime.security import (
    RENDEZVOUS_SESSION_BYTES,
    new_handshake_nonce,
    proofs_match,
    rendezvous_key,
)
from paramserve.worker.dense.rendezvous_wire import (
    FRAME_SECONDS,
    HANDSHAKE_SECONDS,
    HELLO,
    MAX_BODY_BYTES,
    PREFIX,
    REPLY_HEAD,
    REQUEST_HEAD,
    Kind,
    Op,
    RendezvousAborted,
    RendezvousTimeout,
    Status,
    WireError,
    decode_int,
    encode_int,
    frame,
    pack_fields,
    parse_prefix,
    unpack_fields,
)

__all__ = ["RendezvousServer", "StoreFull", "StoreTable", "bind_listener"]

log = logging.getLogger(__name__)

THREAD_NAME = "paramserve-rendezvous"
MAX_STORE_BYTES = 64 << 20
"""Keys and values of every generation together (gloo's rendezvous of 1,000 members: ~100 KB)."""
MAX_CONNECTIONS = 4096
MAX_PENDING_HANDSHAKES = 64
LOG_EVERY_SECONDS = 10.0
_ENTRY_BYTES = 64
"""What a key costs beside its bytes, for MAX_STORE_BYTES."""
_PROOF_BYTES = 32
_ARITY = {Op.SET: 2, Op.GET: 1, Op.ADD: 2, Op.COMPARE_SET: 3, Op.DELETE_KEY: 1, Op.NUM_KEYS: 0}
"""Fields each operation takes (WAIT and CHECK: one or more keys)."""


class StoreFull(ValueError):
    """A set that would take the store past MAX_STORE_BYTES."""


# ---------------------------------------------------------------- the state


class StoreTable:
    """The keys of each generation of the dense group (a namespace each), and the generations given
    up. No I/O and no locks: the server's one thread owns it. Operations on a generation given up
    raise RendezvousAborted with the reason."""

    def __init__(self, max_bytes: int = MAX_STORE_BYTES):
        self._spaces: dict[int, dict[bytes, bytes]] = collections.defaultdict(dict)
        self._aborted: dict[int, str] = {}
        self._floor = 0
        self._floor_reason = ""
        self._bytes = 0
        self._max_bytes = max_bytes

    def given_up(self, generation: int) -> str | None:
        """Why ``generation`` was given up, or None while it is open."""
        if generation < self._floor:
            return self._floor_reason
        return self._aborted.get(generation)

    def set(self, generation: int, key: bytes, value: bytes) -> None:
        space = self._space(generation)
        old = space.get(key)
        grows = len(value) - (len(old) if old is not None else -len(key) - _ENTRY_BYTES)
        if self._bytes + grows > self._max_bytes:
            raise StoreFull(f"the rendezvous store holds {self._bytes} bytes; {self._max_bytes} at most")
        space[key] = value
        self._bytes += grows

    def get(self, generation: int, key: bytes) -> bytes | None:
        return self._space(generation).get(key)

    def add(self, generation: int, key: bytes, amount: int) -> int:
        current = self._space(generation).get(key, b"0")
        try:
            value = int(current) + amount
        except ValueError:
            raise ValueError(f"key {key!r} holds {current[:32]!r}, not a number to add to") from None
        self.set(generation, key, str(value).encode())
        return value

    def compare_set(self, generation: int, key: bytes, expected: bytes, desired: bytes) -> bytes:
        """torch.distributed.Store.compare_set: ``desired`` replaces ``expected`` (a missing key
        counts as b""); returns the key's value after, or ``expected`` when the key is missing."""
        current = self._space(generation).get(key)
        if current is None:
            if expected:
                return expected
            self.set(generation, key, desired)
            return desired
        if current == expected:
            self.set(generation, key, desired)
            return desired
        return current

    def check(self, generation: int, keys: Sequence[bytes]) -> bool:
        space = self._space(generation)
        return all(key in space for key in keys)

    def delete(self, generation: int, key: bytes) -> bool:
        value = self._space(generation).pop(key, None)
        if value is not None:
            self._bytes -= len(key) + len(value) + _ENTRY_BYTES
        return value is not None

    def num_keys(self, generation: int) -> int:
        return len(self._space(generation))

    def abort(self, generation: int, reason: str) -> None:
        """Gives ``generation`` up: its keys go, and every operation on it raises RendezvousAborted."""
        if self.given_up(generation) is None:
            self._aborted[generation] = reason
            self._drop(generation)

    def retire_below(self, generation: int, reason: str) -> None:
        """Gives up every generation before ``generation`` (a new one formed)."""
        if generation > self._floor:
            self._floor, self._floor_reason = generation, reason
            for old in [g for g in self._spaces if g < generation]:
                self._drop(old)
            self._aborted = {g: r for g, r in self._aborted.items() if g >= generation}

    def close(self, reason: str) -> None:
        """Gives up every generation, those to come too."""
        self.retire_below(2**63, reason)

    @property
    def bytes_held(self) -> int:
        return self._bytes

    def _space(self, generation: int) -> dict[bytes, bytes]:
        reason = self.given_up(generation)
        if reason is not None:
            raise RendezvousAborted(f"dense group {generation} was given up: {reason}")
        return self._spaces[generation]

    def _drop(self, generation: int) -> None:
        space = self._spaces.pop(generation, {})
        self._bytes -= sum(len(k) + len(v) + _ENTRY_BYTES for k, v in space.items())


# ---------------------------------------------------------------- the listener


def bind_listener(host: str, port: int = 0) -> socket.socket:
    """A listening TCP socket bound to ``host`` itself (a name: the first address it resolves to
    here), never to every interface. Raises ValueError for a wildcard address (it is not one
    workers could be told), OSError when it cannot be bound."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    if ipaddress.ip_address(str(address[0]).split("%")[0]).is_unspecified:
        raise ValueError(
            f"rendezvous_host {host!r} is every interface: give the address workers reach the coordinator at "
            "(127.0.0.1 for a local cluster)"
        )
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(address)
        sock.listen(128)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


# ---------------------------------------------------------------- the server


class RendezvousServer:
    """Hybrid training's rendezvous store, listening on ``host`` only (``port`` 0: a free one),
    open to the members that prove ``rendezvous_key(token, self.session)``. Starts serving at once
    on its thread; ``stop()`` ends it. ``abort``, ``retire_below`` and ``waiting`` are safe from any
    thread. Raises ValueError or OSError when ``host`` cannot be bound (``bind_listener``)."""

    def __init__(
        self,
        host: str,
        *,
        token: str | None,
        port: int = 0,
        handshake_seconds: float = HANDSHAKE_SECONDS,
        max_bytes: int = MAX_STORE_BYTES,
    ):
        self.session = secrets.token_bytes(RENDEZVOUS_SESSION_BYTES)
        """Sent to members with each round (GroupSpec.store_secret); with the token, the key."""
        self._key = rendezvous_key(token, self.session)
        self._handshake_seconds = handshake_seconds
        self._table = StoreTable(max_bytes)
        self._listener = bind_listener(host, port)
        self.host = host
        self.bound: tuple[str, int] = self._listener.getsockname()[:2]
        """The address the listening socket is bound to, as the kernel says."""
        self.port = self.bound[1]
        self._changed = asyncio.Event()  # replaced at each change: waiters hold the one they saw
        self._waiting: collections.Counter[int] = collections.Counter()
        self._handshaking: collections.OrderedDict[asyncio.StreamWriter, None] = collections.OrderedDict()
        self._connections: dict[asyncio.Task[None], asyncio.StreamWriter] = {}
        self._log = RateLimitedLog(log, LOG_EVERY_SECONDS)
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._thread = threading.Thread(target=self._serve, name=THREAD_NAME, daemon=True)
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(HANDSHAKE_SECONDS)
        except BaseException:
            self.stop()
            raise

    @property
    def address(self) -> str:
        """``host:port`` as workers are told it (``[v6]:port``)."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def abort(self, generation: int, reason: str) -> None:
        """Gives ``generation`` up: members waiting in it are answered ABORTED now, and every later
        request in it too."""
        self._call_soon(self._table.abort, generation, reason)

    def retire_below(self, generation: int) -> None:
        """Gives up the generations before ``generation`` (it formed): their keys are freed."""
        self._call_soon(self._table.retire_below, generation, f"dense group {generation} replaced it")

    def waiting(self, generation: int) -> int:
        """Requests blocked on keys of ``generation`` now (members in its rendezvous)."""
        return self._waiting[generation]

    def stop(self, timeout: float = 5.0) -> bool:
        """Closes the listener and every connection (a member waiting in the store gets
        RendezvousError) and joins the thread; returns whether it ended within ``timeout``."""
        if self._loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout)
            except (concurrent.futures.TimeoutError, RuntimeError):
                log.error("the dense group's rendezvous store did not close its connections within %ss", timeout)
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # ------------------------------------------------------------ the loop

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        finally:
            # Connections accepted while it stopped: ended here, not left to the garbage collector.
            left = asyncio.all_tasks(self._loop)
            for task in left:
                task.cancel()
            self._loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
            self._loop.close()

    async def _start(self) -> None:
        self._changed = asyncio.Event()
        self._server = await asyncio.start_server(self._accepted, sock=self._listener)

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        else:
            self._listener.close()  # never served
        self._table.close("the coordinator's store stopped")
        self._notify()
        tasks = list(self._connections.items())
        for task, writer in tasks:
            writer.transport.abort()  # its reads end, even where a cancellation would be swallowed
            task.cancel()
        await asyncio.gather(*(task for task, _ in tasks), return_exceptions=True)

    def _call_soon(self, change: object, *args: object) -> None:
        def apply() -> None:
            change(*args)  # type: ignore[operator]
            self._notify()

        try:
            self._loop.call_soon_threadsafe(apply)
        except RuntimeError:  # stopped: nothing waits any more
            pass

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    # ------------------------------------------------------------ one connection

    async def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        if len(self._connections) >= MAX_CONNECTIONS:
            self._refused("connection_limit", f"{MAX_CONNECTIONS} connections open")
            writer.transport.abort()
            return
        self._connections[task] = writer
        self._handshaking[writer] = None
        while len(self._handshaking) > MAX_PENDING_HANDSHAKES:
            oldest, _ = self._handshaking.popitem(last=False)
            self._refused("handshake_evicted", "dropped a connection still in its handshake for a new one")
            oldest.transport.abort()
        try:
            generation = await asyncio.wait_for(self._handshake(reader, writer), self._handshake_seconds)
            self._handshaking.pop(writer, None)
            if generation is not None:
                await self._serve_requests(reader, writer, generation)
        except (OSError, EOFError, asyncio.TimeoutError, WireError):
            pass  # the peer went away, broke the framing or ran out of time: dropped
        except asyncio.CancelledError:
            pass  # the store stops
        except Exception:  # a bug here must not take the store down: logged, the connection dropped
            log.exception("rendezvous store: connection failed")
        finally:
            self._handshaking.pop(writer, None)
            self._connections.pop(task, None)
            writer.transport.abort()

    async def _handshake(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> int | None:
        """HELLO, CHALLENGE, PROOF, then WELCOME: the generation the member joins. None (after a
        REFUSED) for a wrong proof; anything but a HELLO is answered with nothing."""
        kind, body = await _read(reader, HELLO.size)
        if kind is not Kind.HELLO or len(body) != HELLO.size:
            self._refused("not_a_member", "a connection that did not begin with a HELLO")
            return None
        client_nonce, generation = HELLO.unpack(body)
        server_nonce = new_handshake_nonce()
        writer.write(frame(Kind.CHALLENGE, server_nonce + self._key.server_proof(client_nonce, server_nonce)))
        kind, proof = await _read(reader, _PROOF_BYTES)
        if kind is not Kind.PROOF or not proofs_match(proof, self._key.client_proof(client_nonce, server_nonce)):
            self._refused("wrong_credential", "a member without the cluster's token (or of another coordinator)")
            writer.write(frame(Kind.REFUSED, b"a wrong credential: give the worker the cluster's token"))
            await writer.drain()
            return None
        writer.write(frame(Kind.WELCOME))
        await writer.drain()
        return int(generation)

    async def _serve_requests(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, generation: int
    ) -> None:
        while True:
            kind, body = await _read(reader, MAX_BODY_BYTES, idle=True)
            if kind is not Kind.REQUEST or len(body) < REQUEST_HEAD.size:
                raise WireError(f"a {kind.name} frame instead of a request")
            op, millis = REQUEST_HEAD.unpack_from(body)
            status, answer = await self._answer(generation, op, millis / 1000, unpack_fields(body[REQUEST_HEAD.size :]))
            writer.write(frame(Kind.REPLY, REPLY_HEAD.pack(status) + pack_fields(answer)))
            await writer.drain()

    async def _answer(
        self, generation: int, op: int, seconds: float, fields: list[bytes]
    ) -> tuple[Status, list[bytes]]:
        try:
            return Status.OK, await self._apply(generation, Op(op), seconds, fields)
        except RendezvousAborted as exc:
            return Status.ABORTED, [str(exc).encode()]
        except RendezvousTimeout as exc:
            return Status.TIMEOUT, [str(exc).encode()]
        except (ValueError, WireError) as exc:  # StoreFull, an unknown op, a wrong number of fields
            return Status.INVALID, [str(exc).encode()]

    async def _apply(self, generation: int, op: Op, seconds: float, fields: list[bytes]) -> list[bytes]:
        expected = _ARITY.get(op)
        if (expected is not None and len(fields) != expected) or (expected is None and not fields):
            raise WireError(f"{op.name} with {len(fields)} fields")
        table = self._table
        if op in (Op.GET, Op.WAIT):
            await self._wait_for(generation, fields, seconds)
        if op is Op.GET:
            value = table.get(generation, fields[0])
            assert value is not None
            return [value]
        if op is Op.WAIT:
            return []
        if op is Op.CHECK:
            return [b"\x01" if table.check(generation, fields) else b"\x00"]
        if op is Op.NUM_KEYS:
            return [encode_int(table.num_keys(generation))]
        if op is Op.DELETE_KEY:
            return [b"\x01" if table.delete(generation, fields[0]) else b"\x00"]
        if op is Op.SET:
            table.set(generation, fields[0], fields[1])
            answer: list[bytes] = []
        elif op is Op.ADD:
            answer = [encode_int(table.add(generation, fields[0], decode_int(fields[1])))]
        else:
            answer = [table.compare_set(generation, *fields)]
        self._notify()
        return answer

    async def _wait_for(self, generation: int, keys: Sequence[bytes], seconds: float) -> None:
        """Until every key is in ``generation``; RendezvousTimeout after ``seconds``,
        RendezvousAborted as soon as the generation is given up."""
        deadline = time.monotonic() + seconds
        self._waiting[generation] += 1
        try:
            while not self._table.check(generation, keys):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    shown = ", ".join(k.decode(errors="replace") for k in keys[:3])
                    raise RendezvousTimeout(f"dense group {generation}: {shown} did not come within {seconds:.0f}s")
                try:
                    await asyncio.wait_for(self._changed.wait(), remaining)
                except asyncio.TimeoutError:
                    pass
        finally:
            self._waiting[generation] -= 1
            if not self._waiting[generation]:
                del self._waiting[generation]

    def _refused(self, reason: str, what: str) -> None:
        self._log.warning(reason, "dense group's rendezvous store refused a connection: %s", what)


async def _read(reader: asyncio.StreamReader, max_body: int, idle: bool = False) -> tuple[Kind, bytes]:
    """The next frame; with ``idle`` its prefix may wait without limit (an authenticated member
    between requests), its body then within FRAME_SECONDS."""
    prefix = await reader.readexactly(PREFIX.size)
    kind, size = parse_prefix(prefix, max_body)
    body = await (asyncio.wait_for(reader.readexactly(size), FRAME_SECONDS) if idle else reader.readexactly(size))
    return kind, body
