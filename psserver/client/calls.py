"""A client's gRPC calls to the parameter servers: raw-bytes stubs, deadlines, retries and typed
errors, in one place.

Every call has a deadline; only retryable status codes (and a broken data-plane connection) are
retried, with jitter, within an overall deadline (tenacity); a failure surfaces as the typed
error of psserver.errors the server named, with the server and the variable.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from concurrent import futures
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import tenacity

from paramserve.psserver.dataplane.frames import TransportError
from paramserve.psserver.protocol import convert
from paramserve.psserver.protocol.errors import (
    ERROR_METADATA_KEY,
    ERROR_TYPES,
    ERROR_VARIABLE_METADATA_KEY,
    AuthenticationError,
    DeadlineExceededError,
    InternalError,
    InvalidRequestError,
    MessageTooLargeError,
    ParamServeError,
    PermissionDeniedError,
    ServerUnavailableError,
    VariableNotFoundError,
)
from paramserve.psserver.protocol.metadata import (
    IDEMPOTENCY_METADATA_KEY,
    REPLICA_EPOCH_METADATA_KEY,
    SERVICE_NAME,
    metadata_text,
)
from paramserve.psserver.protocol.streams import byte_buffer, read_parts
from paramserve.psserver.protocol.types import ShardState
from paramserve.psserver.runtime.security import bearer_metadata
from paramserve.wire.v1 import parameter_server_pb2 as ps_pb2

__all__ = [
    "RETRYABLE_CODES",
    "SERVER_GOING_AWAY",
    "CallOptions",
    "EpochCallOptions",
    "ServerCalls",
    "Stub",
    "typed_error",
]

log = logging.getLogger(__name__)
_T = TypeVar("_T")
_R = TypeVar("_R")

SERVER_GOING_AWAY = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.ABORTED})
"""What a call gets from a server that is not there or is going away: nothing listens, or it
drains after SIGTERM (new calls UNAVAILABLE, calls still running at the end of its grace period
CANCELLED), or it stopped mid-call (ABORTED). A server failure, never the caller's error: the
closure waits for the server to be recovered, as for SIGKILL."""
RETRYABLE_CODES = SERVER_GOING_AWAY | {grpc.StatusCode.DEADLINE_EXCEEDED}
"""Safe to retry: every paramserve RPC is idempotent (pushes carry idempotency keys)."""

MAX_RETRY_WAIT_SECONDS = 0.5
"""The longest pause between two attempts of a call (jittered, growing from 50 ms): a server that
comes back (restarted, or replaced) is reached within about this long, which is most of what a
recovery's pause costs after the replacement serves; a connection attempt is cheap."""

_CODE_ERRORS: dict[grpc.StatusCode, type[ParamServeError]] = {
    **dict.fromkeys(SERVER_GOING_AWAY, ServerUnavailableError),
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.UNAUTHENTICATED: AuthenticationError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: MessageTooLargeError,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequestError,
    grpc.StatusCode.NOT_FOUND: VariableNotFoundError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
}


@dataclass(frozen=True)
class CallOptions:
    token: str | None
    timeout: float
    retry_deadline: float

    def metadata(self, *extra: tuple[str, str]) -> list[tuple[str, str]]:
        metadata = list(extra)
        if self.token:
            metadata.append(bearer_metadata(self.token))
        return metadata


@dataclass(frozen=True)
class EpochCallOptions(CallOptions):
    """CallOptions of a replication call: the coordinator's or a primary's write to a replica,
    tagged with the group's epoch (a server refuses an older one: psserver/replication/replica.py)."""

    epoch: int = 0

    def metadata(self, *extra: tuple[str, str]) -> list[tuple[str, str]]:
        return super().metadata(*extra, (REPLICA_EPOCH_METADATA_KEY, str(self.epoch)))


class Stub:
    """Raw-bytes multicallables for one server (the hot path skips protobuf for tensor data)."""

    def __init__(self, channel: grpc.Channel):
        prefix = f"/{SERVICE_NAME}/"
        self._channel = channel
        self._prefix = prefix
        self._create = channel.stream_unary(
            prefix + "CreateShards", response_deserializer=ps_pb2.CreateShardsResponse.FromString
        )
        self._replace = channel.stream_unary(
            prefix + "ReplaceShards", response_deserializer=ps_pb2.CreateShardsResponse.FromString
        )
        self._pull = channel.unary_stream(prefix + "Pull", request_serializer=ps_pb2.PullRequest.SerializeToString)
        self._push = channel.stream_unary(prefix + "Push", response_deserializer=ps_pb2.PushResponse.FromString)
        self._step = channel.unary_unary(prefix + "Step")
        self._export = channel.unary_stream(
            prefix + "ExportShards", request_serializer=ps_pb2.ExportShardsRequest.SerializeToString
        )
        self._unary: dict[str, grpc.UnaryUnaryMultiCallable] = {}

    def create_shards(
        self, make_chunks: Callable[[], Iterator[bytes]], options: CallOptions, *, replace: bool = False
    ) -> ps_pb2.CreateShardsResponse:
        call = self._replace if replace else self._create
        return call(make_chunks(), timeout=options.timeout, metadata=options.metadata())

    def push(self, make_chunks: Callable[[], Iterator[bytes]], key: str, options: CallOptions) -> ps_pb2.PushResponse:
        return self._push(
            make_chunks(), timeout=options.timeout, metadata=options.metadata((IDEMPOTENCY_METADATA_KEY, key))
        )

    def pull(self, request: ps_pb2.PullRequest, options: CallOptions) -> Iterator[bytes]:
        """The Pull stream's chunks."""
        return self._pull(request, timeout=options.timeout, metadata=options.metadata())

    def step(self, request: bytes, options: CallOptions) -> bytes:
        """One Step RPC: a packed StepRequest out, the packed StepReply back."""
        return self._step(request, timeout=options.timeout, metadata=options.metadata())

    def export(self, chunk_bytes: int, options: CallOptions) -> list[ShardState]:
        request = ps_pb2.ExportShardsRequest(chunk_bytes=chunk_bytes)
        stream = self._export(request, timeout=options.timeout, metadata=options.metadata())
        return [
            convert.shard_state_from_part(header.shard, payload)
            for header, payload in read_parts(stream, lambda h: byte_buffer(h.payload_bytes))
        ]

    def list_shards(self, options: CallOptions) -> ps_pb2.ListShardsResponse:
        return self.unary("ListShards", ps_pb2.ListShardsRequest(), ps_pb2.ListShardsResponse, options)

    def data_plane_info(self, options: CallOptions) -> ps_pb2.DataPlaneInfo | None:
        """What the server says of its data plane; None for a server without the RPC."""
        try:
            return self.unary("GetDataPlane", ps_pb2.GetDataPlaneRequest(), ps_pb2.DataPlaneInfo, options)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                return None
            raise

    def unary_stream(self, method: str, request: Any, options: CallOptions) -> Iterator[bytes]:
        """A server-streaming call's raw chunks (the dynamic tables' export)."""
        call = self._channel.unary_stream(self._prefix + method, request_serializer=type(request).SerializeToString)
        return call(request, timeout=options.timeout, metadata=options.metadata())

    def stream_unary(
        self, method: str, make_chunks: Callable[[], Iterator[bytes]], response_cls: Any, options: CallOptions
    ) -> Any:
        """A client-streaming call of raw chunks (the dynamic tables' replace)."""
        call = self._channel.stream_unary(self._prefix + method, response_deserializer=response_cls.FromString)
        return call(make_chunks(), timeout=options.timeout, metadata=options.metadata())

    def unary(self, method: str, request, response_cls, options: CallOptions):  # type: ignore[no-untyped-def]
        callable_ = self._unary.get(method)
        if callable_ is None:
            callable_ = self._channel.unary_unary(
                self._prefix + method,
                request_serializer=type(request).SerializeToString,
                response_deserializer=response_cls.FromString,
            )
            self._unary[method] = callable_
        return callable_(request, timeout=options.timeout, metadata=options.metadata())


class ServerCalls:
    """Runs a call on many servers at once, each with retries (the client's one retry policy)."""

    def __init__(self, addresses: tuple[str, ...], pool: futures.Executor, retry_deadline: float):
        self._addresses = addresses
        self._pool = pool
        self._retry_deadline = retry_deadline

    def address(self, server: int) -> str:
        return self._addresses[server]

    def fan_out(
        self, work: Mapping[int, _T], call: Callable[[int, _T], _R], *, variable: str | None = None
    ) -> dict[int, _R]:
        """Runs call(server, work) for every server concurrently (the calling thread takes one
        share itself: one thread hand-off less); raises the first typed error."""
        shares = list(work.items())
        if not shares:
            return {}
        pending = {server: self._pool.submit(self.run, server, item, call, variable) for server, item in shares[:-1]}
        results: dict[int, _R] = {}
        errors: list[ParamServeError] = []
        last_server, last_item = shares[-1]
        try:
            results[last_server] = self.run(last_server, last_item, call, variable)
        except ParamServeError as err:
            errors.append(err)
        for server, future in pending.items():
            try:
                results[server] = future.result()
            except ParamServeError as err:
                errors.append(err)
        if errors:
            raise errors[0]
        return results

    def run(self, server: int, item: _T, call: Callable[[int, _T], _R], variable: str | None) -> _R:
        """call(server, item) with retries; its failure as the typed error naming the server."""
        address = self._addresses[server]
        try:
            return _with_retries(lambda: call(server, item), self._retry_deadline, address)
        except grpc.RpcError as err:
            raise typed_error(err, address, variable) from None
        except TransportError as err:
            raise ServerUnavailableError(
                f"parameter server unreachable (data plane: {err}); check that it runs and the address is right",
                server=address,
                variable=variable,
            ) from None
        except ParamServeError as err:
            err.server = err.server or address
            err.variable = err.variable or variable
            raise


def _with_retries(fn: Callable[[], _T], deadline: float, address: str) -> _T:
    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception(_is_retryable),
        wait=tenacity.wait_random_exponential(multiplier=0.05, max=MAX_RETRY_WAIT_SECONDS),
        stop=tenacity.stop_after_delay(deadline),
        reraise=True,
        before_sleep=lambda state: log.warning(
            "retrying call to %s after %s (attempt %d)",
            address,
            _describe(state.outcome.exception() if state.outcome else None),
            state.attempt_number,
        ),
    )
    return retrying(fn)


def _is_retryable(exc: BaseException) -> bool:
    return isinstance(exc, TransportError) or (isinstance(exc, grpc.RpcError) and exc.code() in RETRYABLE_CODES)


def _describe(exc: BaseException | None) -> str:
    if isinstance(exc, grpc.RpcError):
        return f"{exc.code().name}: {exc.details()}"
    return repr(exc)


def typed_error(err: grpc.RpcError, server: str, variable: str | None) -> ParamServeError:
    """The paramserve error a failed RPC stands for (by the server's trailing metadata, else its code)."""
    trailers: dict[str, Any] = dict(err.trailing_metadata() or ())
    code = err.code()
    cls = ERROR_TYPES.get(str(trailers.get(ERROR_METADATA_KEY, ""))) or _CODE_ERRORS.get(code, InternalError)
    details = err.details() or code.name
    if cls is ServerUnavailableError:
        details = (
            f"parameter server unreachable or going away ({code.name}: {details}); check that it runs and the "
            "address is right (the coordinator recovers a restarted one)"
        )
    escaped = trailers.get(ERROR_VARIABLE_METADATA_KEY)
    return cls(details, variable=metadata_text(str(escaped)) if escaped else variable, server=server)
