"""The gRPC face of a worker: translates Worker RPCs to WorkerCore calls (through worker.messages).

Handlers take and return raw bytes (see psserver.serving.MetricsInterceptor) and
parse requests themselves, so garbage gets INVALID_ARGUMENT.
"""

from __future__ import annotations

import grpc

from paramserve.psserver.runtime.error_boundary import parse, unary_boundary
from paramserve.wire.v1 import worker_pb2
from paramserve.worker.core import WorkerCore
from paramserve.worker.messages import (
    batch_from_proto,
    batch_outcomes_to_proto,
    dense_round_from_proto,
    info_to_proto,
    round_outcome_to_proto,
)

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name


class WorkerServicer:
    """Serves one WorkerCore."""

    def __init__(self, core: WorkerCore):
        self._core = core

    @unary_boundary
    def RunClosures(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        message = parse(worker_pb2.RunClosuresRequest, raw)
        requests = batch_from_proto(message)
        if message.HasField("dense"):
            outcome = self._core.run_round(requests, dense_round_from_proto(message.dense))
            return round_outcome_to_proto(outcome).SerializeToString()
        return batch_outcomes_to_proto(self._core.run_closures(requests)).SerializeToString()

    @unary_boundary
    def CancelClosures(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        request = parse(worker_pb2.CancelClosuresRequest, raw)
        running = self._core.cancel(list(request.closure_ids))
        return worker_pb2.CancelClosuresResponse(running=running).SerializeToString()

    @unary_boundary
    def GetInfo(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        parse(worker_pb2.GetInfoRequest, raw)
        return info_to_proto(self._core.info()).SerializeToString()


def generic_handler(servicer: WorkerServicer) -> grpc.GenericRpcHandler:
    """Registers the servicer with raw-bytes (de)serialisers: it parses messages itself."""
    handlers = {
        "RunClosures": grpc.unary_unary_rpc_method_handler(servicer.RunClosures),
        "CancelClosures": grpc.unary_unary_rpc_method_handler(servicer.CancelClosures),
        "GetInfo": grpc.unary_unary_rpc_method_handler(servicer.GetInfo),
    }
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)
