"""How a client's step reaches each parameter server: one transport per route, chosen in one place.

A server's share of a step (psserver/client/step_work.py: push parts, then reads) travels one of three
ways, which ``choose_route`` picks from its size and what the server offers:

- ``DATA_PLANE`` (``DataPlaneTransport``): a STEP frame on the server's data plane
  (psserver/dataplane/dataplane_client.py), as a step program of the connection when the step recurs, else
  as a whole plan; the reply's pulled bytes are received straight into their destinations.
- ``UNARY`` (``UnaryStepTransport``): one ``Step`` RPC each way, for a share under the unary limit.
- ``STREAMS`` (``StreamTransport``): a ``Push`` stream, then a ``Pull`` stream, for larger ones.

``StepRouter`` runs a step top-down: every share whose route is a data plane is sent first, all
requests written before any reply is read, so the servers work at once with no thread per
server; then the replies are read; then whatever was not sent that way, or whose connection
broke, runs with retries (psserver/client/calls.py) on the route chosen for it then, under the same
idempotency key, so a share is applied once however many times it travels.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, cast

import grpc
import torch
from google.protobuf.message import DecodeError

from paramserve.psserver.client.calls import CallOptions, ServerCalls, Stub
from paramserve.psserver.client.step_work import (
    Destination,
    ReadEntry,
    RowScatter,
    ServerWork,
    ShardWire,
    StepResult,
    destination_bytes,
)
from paramserve.psserver.dataplane.dataplane_client import DataPlaneConnection, DataPlaneLinks, ProgramNumbers
from paramserve.psserver.dataplane.frames import MAX_PROGRAM_PLAN_BYTES, MAX_STEP_HEADER_BYTES, TransportError
from paramserve.psserver.protocol import convert
from paramserve.psserver.protocol.errors import InvalidRequestError, ParamServeError
from paramserve.psserver.protocol.streams import (
    byte_buffer,
    decode_step_reply,
    encode_parts,
    encode_step_request,
    meta_nbytes,
    read_parts,
    tensor_from_bytes,
)
from paramserve.psserver.protocol.tensors import writable_byte_view
from paramserve.psserver.protocol.types import PushOutcome, ShardRef
from paramserve.wire.v1 import parameter_server_pb2 as ps_pb2
from paramserve.wire.v1 import tensor_pb2

__all__ = [
    "DataPlaneTransport",
    "Route",
    "StepRouter",
    "StepTransport",
    "StepsInFlight",
    "StreamTransport",
    "UnaryStepTransport",
    "choose_route",
    "fits_data_plane",
]


class Route(enum.Enum):
    DATA_PLANE = "data plane"
    UNARY = "Step RPC"
    STREAMS = "Push and Pull streams"


def fits_data_plane(nbytes: int, plan_bytes: int, step_limit: int | None) -> bool:
    """Whether a share moving ``nbytes`` of tensors, whose plan is about ``plan_bytes``, fits one
    STEP frame of a data plane that moves at most ``step_limit`` (None: the server has none). A
    plan over MAX_STEP_HEADER_BYTES would be refused by the server (a lookup of more than about
    130,000 distinct rows of one server: their ids travel in the plan), so such a share travels
    by gRPC, whose messages are limited by --max-message-bytes only."""
    return step_limit is not None and nbytes <= step_limit and plan_bytes <= MAX_STEP_HEADER_BYTES


def choose_route(nbytes: int, data_plane_available: bool, fits_frame: bool, unary_limit: int) -> Route:
    """How a server's share of a step moving ``nbytes`` of tensors (both ways) travels: on the
    server's data plane when it has one and the share fits one frame; else as one Step RPC when
    it is at most ``unary_limit``; else as streams (one huge unary message costs more CPU than
    streamed chunks: ~25 % more on a 46 MB model)."""
    if data_plane_available and fits_frame:
        return Route.DATA_PLANE
    return Route.UNARY if nbytes <= unary_limit else Route.STREAMS


class StepTransport(Protocol):
    def run(self, server: int, work: ServerWork, key: str) -> StepResult:
        """One attempt of ``server``'s share of a step under ``key``. Raises TransportError or a
        grpc.RpcError for a failure to talk (retried), a ParamServeError for a refusal."""
        ...


# ---------------------------------------------------------------- the data plane


@dataclass(slots=True, eq=False)
class SentStep:
    """A share sent on a data plane whose reply is not read yet."""

    server: int
    work: ServerWork
    connection: DataPlaneConnection
    program: tuple[Hashable, int] | None
    """The step program the frame defined or ran: (signature, number); None for a whole plan."""


class DataPlaneTransport:
    """Steps on the servers' data planes, one connection per step in flight (``DataPlaneLinks``)."""

    def __init__(self, links: DataPlaneLinks):
        self._links = links

    def step_limit(self, server: int) -> int | None:
        """The most tensor bytes one step may move on ``server``'s data plane; None: it has none."""
        return self._links.step_limit(server)

    def run(self, server: int, work: ServerWork, key: str) -> StepResult:
        return self.receive(self.send(server, work, key))

    def send(self, server: int, work: ServerWork, key: str) -> SentStep:
        """Writes ``work``'s frame on a connection to ``server``. Raises TransportError (the
        connection is forgotten) and what connecting raises."""
        connection = self._links.acquire(server)
        if connection is None:
            raise TransportError("the server no longer offers a data plane")
        plan, program = _frame(work, key, connection.programs)
        try:
            connection.send_step(plan, work.pushed_bytes())
        except TransportError:
            self._links.forget(server, connection)
            raise
        return SentStep(server, work, connection, program)

    def receive(self, sent: SentStep) -> StepResult:
        """Reads ``sent``'s reply, its pulled bytes straight into their places. The connection is
        kept for reuse after a whole reply (a typed error too) and forgotten when it broke."""
        try:
            result = _read_reply(sent)
        except TransportError:
            self._links.forget(sent.server, sent.connection)
            raise
        except ParamServeError:
            self._links.release(sent.server, sent.connection)
            raise
        self._links.release(sent.server, sent.connection)
        return result

    def abandon(self, sent: SentStep) -> None:
        """Drops ``sent``'s reply unread: its connection is closed (its framing is lost)."""
        self._links.forget(sent.server, sent.connection)

    def close(self) -> None:
        self._links.close()


def _frame(work: ServerWork, key: str, programs: ProgramNumbers) -> tuple[bytes, tuple[Hashable, int] | None]:
    """``work`` as a STEP frame's plan bytes, and the step program it defines or runs. A step of
    whole dense shards is a step program of the connection: defined the first time, then run by
    number with only its key, base versions and bytes."""
    signature = work.signature()
    if signature is None:
        return work.plan(key).SerializeToString(), None
    if not programs.knows(signature):
        whole = work.plan(key)
        if whole.ByteSize() > MAX_PROGRAM_PLAN_BYTES:  # too large to keep on the server: send it whole
            return whole.SerializeToString(), None
    number, defined = programs.number(signature)
    if defined:
        bases = [part.base_version for part in work.parts]
        plan = ps_pb2.StepPlan(
            run_program=number, idempotency_key=key, base_versions=bases if any(base >= 0 for base in bases) else ()
        )
    else:
        plan = work.plan(key)
        plan.define_program = number
    return plan.SerializeToString(), (signature, number)


def _read_reply(sent: SentStep) -> StepResult:
    """Reads a data-plane reply for ``sent``, its pulled bytes straight into their places.
    Raises InvalidRequestError for a reply that does not match the reads."""
    finished: list[Callable[[], StepResult]] = []

    def place(header: memoryview, payload_bytes: int) -> list[memoryview]:
        try:
            outcome = ps_pb2.StepOutcome.FromString(bytes(header))
        except DecodeError as err:
            raise InvalidRequestError(f"the server's StepOutcome does not parse: {err}") from None
        views, finish = (
            _placement(sent.work, outcome, payload_bytes)
            if sent.program is None
            else _program_placement(sent, outcome, payload_bytes)
        )
        finished.append(finish)
        return views

    sent.connection.receive_reply(place)
    return finished[0]()


def _program_placement(
    sent: SentStep, outcome: ps_pb2.StepOutcome, payload_bytes: int
) -> tuple[list[memoryview], Callable[[], StepResult]]:
    """``_placement`` for a step program's reply (``ProgramOutcome``: the results in the
    program's order). Marks the program defined on the connection once the server answered."""
    assert sent.program is not None
    work, (signature, number) = sent.work, sent.program
    result = outcome.program
    parts, reads = len(work.parts), len(work.reads)
    if not outcome.HasField("program") or (
        len(result.applied),
        len(result.versions),
        len(result.staleness),
        len(result.pulled_versions),
    ) != (parts, parts, parts, reads):
        raise InvalidRequestError(
            f"the server's reply does not answer step program {number} ({parts} pushes, {reads} reads)"
        )
    views = cast(list[memoryview], [read.view for read in work.reads])  # whole shards with a place (signature)
    expected = sum(len(view) for view in views)
    if payload_bytes != expected:
        raise InvalidRequestError(
            f"the server's reply holds {payload_bytes} bytes, step program {number} reads {expected}"
        )
    sent.connection.programs.defined(signature, number)

    def finish() -> StepResult:
        pushed = [
            PushOutcome(cast(ShardWire, part.wire).ref, applied, version, staleness)
            for part, applied, version, staleness in zip(work.parts, result.applied, result.versions, result.staleness)
        ]
        return pushed, {read.shard(): version for read, version in zip(work.reads, result.pulled_versions)}

    return [view for view in views if len(view)], finish


# ---------------------------------------------------------------- gRPC


class UnaryStepTransport:
    """One Step RPC: a packed StepRequest (the plan and the pushed bytes) out, a StepReply back."""

    def __init__(self, stubs: Sequence[Stub], options: CallOptions):
        self._stubs = stubs
        self._options = options

    def run(self, server: int, work: ServerWork, key: str) -> StepResult:
        request = encode_step_request(work.plan(key), work.pushed_bytes())
        outcome, payload = decode_step_reply(self._stubs[server].step(request, self._options))
        views, finish = _placement(work, outcome, len(payload))
        offset = 0
        for view in views:
            view[:] = payload[offset : offset + len(view)]
            offset += len(view)
        return finish()


class StreamTransport:
    """A Push stream of the parts, then a Pull stream of the reads, in chunks of ``chunk_bytes``."""

    def __init__(self, stubs: Sequence[Stub], options: CallOptions, chunk_bytes: int):
        self._stubs = stubs
        self._options = options
        self._chunk_bytes = chunk_bytes

    def run(self, server: int, work: ServerWork, key: str) -> StepResult:
        stub, chunk_bytes = self._stubs[server], self._chunk_bytes
        pushed: list[PushOutcome] = []
        if work.parts:
            headed = [(tensor_pb2.PartHeader(push=part.message()), part.pieces) for part in work.parts]
            pushed = _outcomes(stub.push(lambda: encode_parts(iter(headed), chunk_bytes), key, self._options).results)
        if not work.reads:
            return pushed, {}
        request = ps_pb2.PullRequest(items=work.items(), chunk_bytes=chunk_bytes)
        return pushed, _receive_pulled(stub.pull(request, self._options), work.reads)


def _receive_pulled(chunks: Iterable[bytes | memoryview], reads: Sequence[ReadEntry]) -> dict[ShardRef, int]:
    """Fills the reads' destinations from PulledPart chunks; returns the version each shard was
    read at. Whole-shard reads land straight in their destination."""
    versions: dict[ShardRef, int] = {}

    def allocate(header: tensor_pb2.PartHeader) -> torch.Tensor:
        if not 0 <= header.pulled.item < len(reads):
            raise InvalidRequestError(f"the server answered for item {header.pulled.item} of {len(reads)}")
        destination = reads[header.pulled.item].destination
        expected = destination_bytes(destination)
        if header.payload_bytes != expected:
            raise InvalidRequestError(f"the server sent {header.payload_bytes} bytes for a read of {expected}")
        if isinstance(destination, torch.Tensor) and destination.is_contiguous() and destination.numel():
            return destination.reshape(-1).view(torch.uint8)  # write straight into the result
        return byte_buffer(header.payload_bytes)

    for header, payload in read_parts(chunks, allocate):
        part = header.pulled
        read = reads[part.item]
        versions[read.shard()] = int(part.version)
        destination = read.destination
        if isinstance(destination, RowScatter):
            destination.target[destination.positions] = tensor_from_bytes(payload, part.meta)
        elif payload.data_ptr() != destination.data_ptr() or not destination.numel():
            destination.copy_(tensor_from_bytes(payload, part.meta).reshape(destination.shape))
    return versions


# ---------------------------------------------------------------- replies of whole plans


def _placement(
    work: ServerWork, outcome: ps_pb2.StepOutcome, payload_bytes: int
) -> tuple[list[memoryview], Callable[[], StepResult]]:
    """Where a step reply's pulled bytes go, in order (adding up to ``payload_bytes``), and
    what finishes the step once they are there. A read whose destination is a contiguous range
    (``ReadEntry.view``) or tensor takes its bytes in place, with no copy after the one out of
    the message; others go through a buffer, then into their destination. Raises
    InvalidRequestError for a reply that does not match the reads asked for."""
    views: list[memoryview] = []
    later: list[tuple[Destination, torch.Tensor, tensor_pb2.TensorMeta]] = []
    versions: dict[ShardRef, int] = {}
    total = 0
    for part in outcome.pulled:
        if not 0 <= part.item < len(work.reads):
            raise InvalidRequestError(f"the server answered for item {part.item} of {len(work.reads)}")
        read = work.reads[part.item]
        size, expected = meta_nbytes(part.meta), read.nbytes()
        if size != expected:
            raise InvalidRequestError(f"the server sent {size} bytes for a read of {expected}")
        total += size
        versions[read.shard()] = int(part.version)
        if not size:
            continue
        if read.view is not None:
            views.append(read.view)
        elif isinstance(read.destination, torch.Tensor) and read.destination.is_contiguous():
            views.append(writable_byte_view(read.destination))
        else:
            buffer = byte_buffer(size)
            views.append(writable_byte_view(buffer))
            later.append((read.destination, buffer, part.meta))
    if total != payload_bytes:
        raise InvalidRequestError(f"the server's reply holds {payload_bytes} bytes, its parts describe {total}")

    def finish() -> StepResult:
        for destination, buffer, meta in later:
            value = tensor_from_bytes(buffer, meta)
            if isinstance(destination, RowScatter):
                destination.target[destination.positions] = value
            else:
                destination.copy_(value.reshape(destination.shape))
        return _outcomes(outcome.pushed), versions

    return views, finish


def _outcomes(results: Iterable[ps_pb2.PushResult]) -> list[PushOutcome]:
    return [PushOutcome(convert.ref_from_proto(r.ref), r.applied, int(r.version), int(r.staleness)) for r in results]


# ---------------------------------------------------------------- a whole step


class StepRouter:
    """Runs each server's share of a step on the route chosen for it (``choose_route``)."""

    def __init__(
        self,
        data_plane: DataPlaneTransport | None,
        unary: StepTransport,
        streams: StepTransport,
        *,
        unary_limit: int,
        calls: ServerCalls,
    ):
        self._data_plane = data_plane
        self._transports: dict[Route, StepTransport] = {Route.UNARY: unary, Route.STREAMS: streams}
        if data_plane is not None:
            self._transports[Route.DATA_PLANE] = data_plane
        self._unary_limit = unary_limit
        self._calls = calls

    def start(self, works: Mapping[int, ServerWork], key: str, variable: str | None) -> StepsInFlight:
        """Sends every share whose route is its server's data plane, in the calling thread, and
        returns; ``StepsInFlight.result()`` does the rest. Leaves out servers whose data plane is
        unknown, absent or broken: the retrying path asks again, and says what is wrong."""
        sent: list[SentStep] = []
        if self._data_plane is not None:
            for server, work in works.items():
                try:
                    if self._route(server, work) is Route.DATA_PLANE:
                        sent.append(self._data_plane.send(server, work, key))
                except (TransportError, grpc.RpcError, ParamServeError):
                    continue
        return StepsInFlight(self, works, sent, key, variable)

    def finish(self, steps: StepsInFlight) -> StepResult:
        """Reads the replies of the shares sent, then runs every other share, and any whose
        connection broke, with retries; raises the first typed error once every share ended."""
        done, errors = self._receive(steps.sent, steps.variable)
        rest = {server: work for server, work in steps.works.items() if server not in done}
        try:
            done.update(
                self._calls.fan_out(
                    rest, lambda server, work: self._attempt(server, work, steps.key), variable=steps.variable
                )
            )
        except ParamServeError as err:
            errors.append(err)
        if errors:
            raise errors[0]
        outcomes: list[PushOutcome] = []
        versions: dict[ShardRef, int] = {}
        for result in done.values():
            if result is not None:
                outcomes += result[0]
                versions.update(result[1])
        return outcomes, versions

    def abandon(self, steps: StepsInFlight) -> None:
        if self._data_plane is not None:  # a step is sent only on a data plane
            for sent in steps.sent:
                self._data_plane.abandon(sent)

    def close(self) -> None:
        if self._data_plane is not None:
            self._data_plane.close()

    def _receive(
        self, sent: Sequence[SentStep], variable: str | None
    ) -> tuple[dict[int, StepResult | None], list[ParamServeError]]:
        """The replies of ``sent``: results by server (None for a typed error, which is in the
        list), leaving out servers whose connection broke (the retrying path runs those)."""
        done: dict[int, StepResult | None] = {}
        errors: list[ParamServeError] = []
        if self._data_plane is None:  # a step is sent only on a data plane
            return done, errors
        for step in sent:
            try:
                done[step.server] = self._data_plane.receive(step)
            except TransportError:
                continue
            except ParamServeError as err:
                err.server = err.server or self._calls.address(step.server)
                err.variable = err.variable or variable
                errors.append(err)
                done[step.server] = None
        return done, errors

    def _attempt(self, server: int, work: ServerWork, key: str) -> StepResult:
        """One try of one server's share, on the route chosen for it now (the retrying path's call)."""
        return self._transports[self._route(server, work)].run(server, work, key)

    def _route(self, server: int, work: ServerWork) -> Route:
        limit = self._data_plane.step_limit(server) if self._data_plane is not None else None
        nbytes = work.nbytes()
        return choose_route(
            nbytes, limit is not None, fits_data_plane(nbytes, work.plan_bytes(), limit), self._unary_limit
        )


@dataclass(slots=True, eq=False)
class StepsInFlight:
    """A step whose data-plane requests are written: exactly one of ``result()`` (reads the replies
    and runs the rest) and ``abandon()`` (drops the replies, closing their connections) ends it."""

    router: StepRouter
    works: Mapping[int, ServerWork]
    sent: list[SentStep]
    key: str
    variable: str | None

    def result(self) -> StepResult:
        return self.router.finish(self)

    def abandon(self) -> None:
        self.router.abandon(self)
