"""How a primary sends its writes to a backup: the backup's own RPCs, tagged with the epoch.

A forwarded write is what a client would send for it, tagged with the primary's epoch: a push
is a step without reads on the backup's data plane (``StepPlan.replica_epoch``; a ``Step`` RPC
when the backup has no data plane, a ``Push`` stream when it is larger than a frame), as cheap
as a worker's step; shards go as ``CreateShards`` / ``ReplaceShards``, and
``SetHyperparameters`` and ``DeleteVariable`` as themselves, with the
``paramserve-replica-epoch`` metadata. So the backup applies it through the same checks and the
same engine as any write (admitted by ``Replica.admit_forwarded``), and nothing new parses
tensors.
Pushes on the data plane are pipelined (``_Pipeline``: sent under the shard locks, their replies
awaited after them); a write sent over gRPC first waits until every push sent before it was
answered (``drain``), so that the backup applies each shard's writes in the primary's order (a
learning rate changed between two pushes applies to the second on both). One attempt each: a
write the backup did not confirm holds the primary for the coordinator's decision
(psserver/replication/replica.py), so a retry here would only delay that decision.
"""

from __future__ import annotations

import collections
import json
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import torch

from paramserve.psserver.client.calls import CallOptions, EpochCallOptions, Stub, typed_error
from paramserve.psserver.dataplane.dataplane_client import DataPlaneConnection, DataPlaneLinks, ProgramNumbers
from paramserve.psserver.dataplane.frames import MAX_PROGRAM_PLAN_BYTES, TransportError
from paramserve.psserver.protocol import convert
from paramserve.psserver.protocol.errors import ParamServeError, ServerUnavailableError, VariableNotFoundError
from paramserve.psserver.protocol.streams import (
    DEFAULT_CHUNK_BYTES,
    encode_parts,
    encode_step_request,
    meta_of,
    tensor_payload,
)
from paramserve.psserver.protocol.types import ShardState
from paramserve.psserver.runtime.channels import channel_options, open_channel
from paramserve.psserver.runtime.security import ClientTls
from paramserve.psserver.store.shard_store import ShardPush
from paramserve.wire.v1 import parameter_server_pb2 as ps_pb2
from paramserve.wire.v1 import tensor_pb2

__all__ = ["GrpcForwarder", "ForwarderSettings", "UNARY_FORWARD_BYTES"]

UNARY_FORWARD_BYTES = 16 << 20
"""A push of at most this many bytes is forwarded as one Step message, a larger one as a Push
stream of chunks (one message must stay under the backup's message limit)."""


@dataclass(frozen=True)
class ForwarderSettings:
    """How this server reaches its backups: the cluster's token, TLS roots when the servers serve
    TLS, the deadline of one forwarded write and the message limit."""

    token: str | None = None
    tls: ClientTls | None = None
    timeout: float = 10.0
    max_message_bytes: int = 64 << 20


class GrpcForwarder:
    """Forwards one primary's writes to the backup at ``address`` (psserver.replication.Forwarder)."""

    def __init__(self, address: str, settings: ForwarderSettings):
        self.address = address
        self._settings = settings
        self._channel = open_channel(address, settings.tls, channel_options(settings.max_message_bytes))
        self._stub = Stub(self._channel)
        plain = CallOptions(settings.token, settings.timeout, settings.timeout)
        self._links = DataPlaneLinks(
            [address],
            lambda _: self._stub.data_plane_info(plain),
            token=settings.token,
            tls=settings.tls,
            timeout=settings.timeout,
        )
        self._send_lock = threading.Lock()
        self._pipeline: _Pipeline | None = None

    def _options(self, epoch: int) -> EpochCallOptions:
        return EpochCallOptions(self._settings.token, self._settings.timeout, self._settings.timeout, epoch)

    def push(self, pushes: Sequence[ShardPush], key: str, epoch: int) -> Callable[[], None]:
        """Sends the push (under the primary's shard locks, so in their order) and returns what
        waits for the backup to have applied it (called once the locks are released: the next
        push of those shards is sent meanwhile, behind it on the same connection)."""
        forward = _Forward(pushes, key, epoch)
        waiter = self._on_data_plane(forward)
        if waiter is not None:
            return waiter
        self._drain()
        parts, payload = forward.parts(), forward.payload()
        plan = forward.plan()
        if forward.size() <= UNARY_FORWARD_BYTES:
            request = encode_step_request(plan, payload)
            self._call(lambda: self._stub.step(request, self._options(epoch)))
            return _done
        headed = [(tensor_pb2.PartHeader(push=part), pieces) for part, pieces in parts]
        options = self._options(epoch)
        self._call(lambda: self._stub.push(lambda: encode_parts(iter(headed), DEFAULT_CHUNK_BYTES), key, options))
        return _done

    def _on_data_plane(self, forward: _Forward) -> Callable[[], None] | None:
        """Sends the step on the pipeline to the backup's data plane; None when it has none or
        the step is larger than its frames (the caller takes gRPC)."""
        try:
            limit = self._links.step_limit(0)
            if limit is None or forward.size() > limit:
                return None
            with self._send_lock:
                if self._pipeline is None or self._pipeline.broken is not None:
                    connection = self._links.acquire(0)
                    if connection is None:
                        return None
                    self._pipeline = _Pipeline(connection)
                pipeline = self._pipeline
                ticket = pipeline.send(forward.frame_plan(pipeline.connection.programs), forward.payload())
        except grpc.RpcError as err:  # asking for the data plane's port
            raise typed_error(err, self.address, None) from None
        except TransportError as err:
            self._links.forget(0)
            raise ServerUnavailableError(f"backup's data plane: {err}", server=self.address) from None

        def wait() -> None:
            try:
                pipeline.wait(ticket)
            except TransportError as err:
                self._links.forget(0)
                raise ServerUnavailableError(f"backup's data plane: {err}", server=self.address) from None

        return wait

    def _drain(self) -> None:
        """Every push on the pipeline answered: a write sent over gRPC must not overtake them."""
        with self._send_lock:
            pipeline = self._pipeline
        if pipeline is not None:
            pipeline.drain()

    def shards(self, states: Sequence[ShardState], replace: bool, epoch: int) -> None:
        self._drain()
        parts = [convert.shard_part(state) for state in states]
        options = self._options(epoch)
        self._call(
            lambda: self._stub.create_shards(
                lambda: encode_parts(iter(parts), DEFAULT_CHUNK_BYTES), options, replace=replace
            )
        )

    def hyperparameters(self, variables: Sequence[str | None], values: Mapping[str, Any], epoch: int) -> None:
        """One call for all of ``variables`` (None: every variable). A joining backup may hold some
        of them only (all or nothing, the call is refused): then one call each."""
        self._drain()
        names = [name or "" for name in variables] or [""]
        try:
            self._set_hyperparameters(names, values, epoch)
        except VariableNotFoundError:
            for name in names if len(names) > 1 else ():
                try:
                    self._set_hyperparameters([name], values, epoch)
                except VariableNotFoundError:
                    pass  # a joining backup without its shards yet: they arrive with the new values

    def _set_hyperparameters(self, names: Sequence[str], values: Mapping[str, Any], epoch: int) -> None:
        request = ps_pb2.SetHyperparametersRequest(
            variable=names[0], variables=names[1:], values_json=json.dumps(dict(values))
        )
        options = self._options(epoch)
        self._call(lambda: self._stub.unary("SetHyperparameters", request, ps_pb2.SetHyperparametersResponse, options))

    def delete(self, variable: str, epoch: int) -> None:
        self._drain()
        request = ps_pb2.DeleteVariableRequest(variable=variable)
        options = self._options(epoch)
        try:
            self._call(lambda: self._stub.unary("DeleteVariable", request, ps_pb2.DeleteVariableResponse, options))
        except VariableNotFoundError:
            pass  # the backup holds none of it either

    def close(self) -> None:
        with self._send_lock:
            if self._pipeline is not None:
                self._pipeline.connection.close()
        self._links.close()
        self._channel.close()

    def _call(self, call: Any) -> None:
        try:
            call()
        except grpc.RpcError as err:
            raise typed_error(err, self.address, None) from None


class _Ticket:
    __slots__ = ("done", "error")

    def __init__(self) -> None:
        self.done = False
        self.error: BaseException | None = None


class _Pipeline:
    """One data-plane connection to a backup carrying forwarded pushes back to back: sent in the
    order the primary applied them (the backup's connection applies its steps one after another,
    in that order), their replies read in the same order by whichever waiter needs one next."""

    def __init__(self, connection: DataPlaneConnection):
        self.connection = connection
        self.broken: BaseException | None = None
        self._read_lock = threading.Lock()
        self._lock = threading.Lock()
        self._pending: collections.deque[_Ticket] = collections.deque()

    def send(self, plan: bytes, payload: Sequence[memoryview]) -> _Ticket:
        """(Called under the forwarder's send lock.)"""
        if self.broken is not None:
            raise TransportError(f"the connection broke: {self.broken}")
        ticket = _Ticket()
        with self._lock:
            self._pending.append(ticket)
        try:
            self.connection.send_step(plan, payload)
        except BaseException as exc:
            self._break(exc)
            raise
        return ticket

    def wait(self, ticket: _Ticket) -> None:
        """Until ``ticket``'s reply is read; raises its error (a refusal, or TransportError)."""
        while not ticket.done:
            with self._read_lock:
                if ticket.done:
                    break
                with self._lock:
                    head = self._pending[0]
                try:
                    self.connection.receive_reply(_no_payload)
                except TransportError as exc:
                    self._break(exc)
                    break
                except BaseException as exc:  # the backup's refusal: the primary stops; no reuse
                    head.error = exc
                    self.connection.close()
                    self.broken = exc
                with self._lock:
                    self._pending.popleft()
                head.done = True
        if ticket.error is not None:
            raise ticket.error

    def drain(self) -> None:
        """Until every push sent so far was answered: what a write sent another way (a gRPC
        call) waits for first, so that the backup applies the writes of a shard in order. Their
        outcomes are their own waiters' to report."""
        with self._lock:
            last = self._pending[-1] if self._pending else None
        if last is not None:
            try:
                self.wait(last)
            except (ParamServeError, TransportError):
                pass

    def _break(self, exc: BaseException) -> None:
        """Every push still waiting fails with ``exc``: its reply will never be read."""
        with self._lock:
            self.broken = exc
            pending, self._pending = list(self._pending), collections.deque()
        for ticket in pending:
            ticket.error, ticket.done = (exc if isinstance(exc, TransportError) else TransportError(str(exc))), True
        self.connection.close()


class _Forward:
    """One push to forward: its parts, payload and plan, each built only if asked for (a dense
    model's steady push is a step program run by number: no parts, no plan)."""

    def __init__(self, pushes: Sequence[ShardPush], key: str, epoch: int):
        self._pushes = pushes
        self._key = key
        self._epoch = epoch
        self._payload: list[memoryview] | None = None
        self._parts: list[tuple[tensor_pb2.PushPart, list[memoryview]]] | None = None
        self._size: int | None = None

    def parts(self) -> list[tuple[tensor_pb2.PushPart, list[memoryview]]]:
        if self._parts is None:
            self._parts = [_push_part(push) for push in self._pushes]
        return self._parts

    def payload(self) -> list[memoryview]:
        if self._payload is None:
            if all(push.rows is None for push in self._pushes):
                self._payload = [tensor_payload(push.values.contiguous()) for push in self._pushes]
            else:
                self._payload = [piece for _, pieces in self.parts() for piece in pieces]
        return self._payload

    def size(self) -> int:
        """The payload's bytes (asked when choosing the transport, and again on gRPC)."""
        if self._size is None:
            self._size = sum(len(piece) for piece in self.payload())
        return self._size

    def plan(self) -> ps_pb2.StepPlan:
        return ps_pb2.StepPlan(
            push=[part for part, _ in self.parts()], idempotency_key=self._key, replica_epoch=self._epoch
        )

    def frame_plan(self, programs: ProgramNumbers) -> bytes:
        """The plan as its connection's step program when the push is of whole dense shards (as
        a dense model's every push is): defined the first time, then run by number with its key,
        base versions and epoch, so the backup skips the checks that cannot change between steps.
        The program counts as defined at once: the backup runs this connection's steps in order,
        and any failure closes the connection, and its programs with it."""
        if any(push.rows is not None for push in self._pushes):
            return self.plan().SerializeToString()
        signature = tuple((push.ref, push.values.dtype, tuple(push.values.shape)) for push in self._pushes)
        if programs.knows(signature):
            number, defined = programs.number(signature)
            if defined:
                bases = [push.base_version for push in self._pushes]
                return ps_pb2.StepPlan(
                    run_program=number,
                    idempotency_key=self._key,
                    base_versions=bases if any(base >= 0 for base in bases) else (),
                    replica_epoch=self._epoch,
                ).SerializeToString()
        plan = self.plan()
        if plan.ByteSize() > MAX_PROGRAM_PLAN_BYTES:
            return plan.SerializeToString()
        number, _ = programs.number(signature)
        plan.define_program = number
        programs.defined(signature, number)
        return plan.SerializeToString()


def _done() -> None:
    """A forward that was applied before ``push`` returned."""


def _no_payload(outcome: memoryview, payload_bytes: int) -> list[memoryview]:
    """A forwarded push reads nothing back."""
    if payload_bytes:
        raise TransportError(f"the backup answered a forwarded push with {payload_bytes} bytes of reads")
    return []


def _push_part(push: ShardPush) -> tuple[tensor_pb2.PushPart, list[memoryview]]:
    """A store's ShardPush as the PushPart and payload a client would have sent for it."""
    values = push.values.contiguous()
    part = tensor_pb2.PushPart(
        ref=convert.ref_to_proto(push.ref), values=meta_of(values), base_version=push.base_version
    )
    if push.rows is None:
        return part, [tensor_payload(values)]
    rows = push.rows.to(torch.int64).contiguous()
    part.sparse, part.num_indices = True, rows.numel()
    return part, [tensor_payload(rows), tensor_payload(values)]
