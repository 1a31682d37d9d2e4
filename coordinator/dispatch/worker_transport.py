"""How the coordinator reaches one worker: the RunClosures call and the health probe.

``WorkerTransport`` is what a dispatcher (coordinator.dispatcher) needs of the connection, so tests
substitute a double; ``GrpcTransport`` is it over grpc.aio, with the token-derived credential,
signed replies and TLS. Apart from the dispatch logic because it is the only part that speaks
gRPC and holds the security of the call.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from paramserve.psserver.runtime.channels import channel_options, open_aio_channel
from paramserve.psserver.runtime.security import (
    REPLY_NONCE_METADATA_KEY,
    REPLY_SIGNATURE_METADATA_KEY,
    ClientTls,
    bearer_metadata,
    new_reply_nonce,
    reply_is_signed,
    reply_key,
)
from paramserve.wire.v1 import worker_pb2

__all__ = ["GrpcTransport", "RpcFailure", "WorkerTransport"]

RUN_CLOSURES_METHOD = "/paramserve.wire.v1.Worker/RunClosures"
CANCEL_CLOSURES_METHOD = "/paramserve.wire.v1.Worker/CancelClosures"
WORKER_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name


class RpcFailure(Exception):
    """A call to a worker ended with a gRPC status other than OK."""

    def __init__(self, code: str, details: str):
        super().__init__(f"{code}: {details}")
        self.code = code
        self.details = details


class WorkerTransport(Protocol):
    """How a dispatcher reaches its worker (tests substitute a double). Used on the loop."""

    async def run_closures(
        self, request: worker_pb2.RunClosuresRequest, timeout: float
    ) -> worker_pb2.RunClosuresResponse:
        """Raises RpcFailure when the call fails."""

    async def cancel_closures(self, closure_ids: Sequence[str], timeout: float) -> None:
        """Asks the worker to cancel these closures (CancelClosures); raises RpcFailure when the
        call fails."""

    async def is_serving(self, timeout: float) -> bool:
        """One health check."""

    async def reset(self) -> None:
        """Drops the connection: the next call dials afresh (the worker may have restarted)."""

    async def close(self) -> None:
        """Closes the connection for good."""


class GrpcTransport:
    """WorkerTransport over grpc.aio. Create it on the dispatch loop (aio channels belong to
    the loop that made them).

    With a token, a call presents the credential derived from it (never the token) and a
    fresh nonce, and the worker's reply is accepted only when its signature (HMAC under a key
    derived from the token, over the method, the nonce and the reply's bytes) holds: the
    coordinator unpickles results only from a holder of the token. With ``tls`` the channel
    is TLS (the worker's certificate is verified; a client certificate is presented when
    ``tls`` has one) and health probes go over TLS too.
    """

    def __init__(self, address: str, token: str | None, max_message_bytes: int, tls: ClientTls | None = None):
        self.address = address
        self._token = token
        self._reply_key = reply_key(token) if token else None
        self._tls = tls
        self._options = channel_options(max_message_bytes)
        self._channel: grpc.aio.Channel | None = None
        self._run_closures_rpc: Any = None

    def _open(self) -> grpc.aio.Channel:
        if self._channel is None:
            self._channel = open_aio_channel(self.address, self._tls, self._options)
            self._run_closures_rpc = self._channel.unary_unary(
                RUN_CLOSURES_METHOD,
                request_serializer=worker_pb2.RunClosuresRequest.SerializeToString,
                response_deserializer=None,  # raw bytes: the signature covers them
            )
        return self._channel

    async def run_closures(
        self, request: worker_pb2.RunClosuresRequest, timeout: float
    ) -> worker_pb2.RunClosuresResponse:
        self._open()
        nonce = new_reply_nonce()
        metadata = [(REPLY_NONCE_METADATA_KEY, nonce)]
        if self._token:
            metadata.append(bearer_metadata(self._token))
        try:
            call = self._run_closures_rpc(request, timeout=timeout, metadata=metadata)
            raw = await call
            trailers = dict(await call.trailing_metadata() or ())
        except grpc.aio.AioRpcError as err:
            raise RpcFailure(err.code().name, err.details() or "") from None
        if self._reply_key is not None and not reply_is_signed(
            self._reply_key, RUN_CLOSURES_METHOD, nonce, raw, trailers.get(REPLY_SIGNATURE_METADATA_KEY)
        ):
            # Not unpickled: whatever answered does not hold the cluster's token.
            raise RpcFailure(
                "UNAUTHENTICATED",
                f"the reply from {self.address} is not signed with the cluster's "
                "token; refusing it (is something else listening at that address, or does the worker "
                "have another token?)",
            )
        return worker_pb2.RunClosuresResponse.FromString(raw)

    async def cancel_closures(self, closure_ids: Sequence[str], timeout: float) -> None:
        # The reply carries only a count the coordinator does not act on: it is not signed.
        cancel = self._open().unary_unary(
            CANCEL_CLOSURES_METHOD,
            request_serializer=worker_pb2.CancelClosuresRequest.SerializeToString,
            response_deserializer=worker_pb2.CancelClosuresResponse.FromString,
        )
        metadata = [bearer_metadata(self._token)] if self._token else []
        try:
            await cancel(
                worker_pb2.CancelClosuresRequest(closure_ids=list(closure_ids)), timeout=timeout, metadata=metadata
            )
        except grpc.aio.AioRpcError as err:
            raise RpcFailure(err.code().name, err.details() or "") from None
        except asyncio.CancelledError:
            if _this_task_cancelled():
                raise
            # The call, not this task: the worker's run call failed meanwhile and its dispatcher
            # reset the channel (grpc.aio cancels the calls of a closed channel). Its closures are
            # put back all the same.
            raise RpcFailure("CANCELLED", "the connection was reset: the worker failed") from None

    async def is_serving(self, timeout: float) -> bool:
        # A fresh channel per probe: no reconnect backoff inherited from the dead connection.
        async with open_aio_channel(self.address, self._tls, self._options) as channel:
            try:
                reply = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=WORKER_SERVICE), timeout=timeout
                )
            except grpc.aio.AioRpcError:
                return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    async def reset(self) -> None:
        channel, self._channel = self._channel, None
        if channel is not None:
            await channel.close()

    async def close(self) -> None:
        await self.reset()


def _this_task_cancelled() -> bool:
    """Whether the running task is being cancelled (not merely an awaited call of it)."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)  # Python 3.11+; before, every cancellation is the task's
    return cancelling is None or cancelling() > 0
