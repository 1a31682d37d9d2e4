"""The gRPC face of a worker: translates Worker RPCs to WorkerCore calls (through worker.messages).

Handlers take and return raw bytes (see psserver.serving.MetricsInterceptor) and
parse requests themselves, so garbage gets INVALID_ARGUMENT.
"""

from __future__ import annotations

import grpc

from paramserve.psserver.serving import parse, unary_boundary
from paramserve.wire.v1 import worker_pb2
from paramserve.worker.core import WorkerCore
from paramserve.worker.messages import info_to_proto, outcome_to_proto, request_from_proto

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name


class WorkerServicer:
    """Serves one WorkerCore."""

    def __init__(self, core: WorkerCore):
        self._core = core

    @unary_boundary
    def RunClosure(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        request = request_from_proto(parse(worker_pb2.RunClosureRequest, raw))
        return outcome_to_proto(self._core.run_closure(request)).SerializeToString()

    @unary_boundary
    def GetInfo(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        parse(worker_pb2.GetInfoRequest, raw)
        return info_to_proto(self._core.info()).SerializeToString()


def generic_handler(servicer: WorkerServicer) -> grpc.GenericRpcHandler:
    """Registers the servicer with raw-bytes (de)serialisers: it parses messages itself."""
    handlers = {
        "RunClosure": grpc.unary_unary_rpc_method_handler(servicer.RunClosure),
        "GetInfo": grpc.unary_unary_rpc_method_handler(servicer.GetInfo),
    }
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)


