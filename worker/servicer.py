"""The gRPC face of a worker: translates Worker RPCs to WorkerCore calls.

Handlers take and return raw bytes (see psserver.rpc.MetricsInterceptor) and
parse requests themselves, so garbage gets INVALID_ARGUMENT. The conversions
are public: the coordinator builds requests and reads outcomes with them.
"""

from __future__ import annotations

import grpc
from paramserve.psserver import convert
from paramserve.psserver.serving import parse, unary_boundary
from paramserve.wire.v1 import worker_pb2
from paramserve.worker.core import (
    ClosureError,
    ClosureOutcome,
    ClosureRequest,
    ClusterContext,
    ResourceSpec,
    WorkerCore,
    WorkerInfoData,
)

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


# ---------------------------------------------------------------- conversions


def cluster_to_proto(cluster: ClusterContext) -> worker_pb2.ClusterContext:
    return worker_pb2.ClusterContext(
        parameter_servers=list(cluster.parameter_servers),
        shards=[convert.info_to_proto(i) for i in cluster.shards],
        shard_servers=list(cluster.shard_servers),
    )


def cluster_from_proto(message: worker_pb2.ClusterContext) -> ClusterContext:
    """Raises InvalidRequestError (or DtypeMismatchError) for a malformed shard list."""
    return ClusterContext(
        parameter_servers=tuple(message.parameter_servers),
        shards=tuple(convert.info_from_proto(i) for i in message.shards),
        shard_servers=tuple(int(s) for s in message.shard_servers),
    )


def request_to_proto(request: ClosureRequest) -> worker_pb2.RunClosureRequest:
    return worker_pb2.RunClosureRequest(
        closure_id=request.closure_id,
        attempt=request.attempt,
        function_name=request.function_name,
        payload=request.payload,
        resources=[worker_pb2.ResourceSpec(resource_id=r.resource_id, payload=r.payload) for r in request.resources],
        cluster=cluster_to_proto(request.cluster),
        steps=request.steps,
        worker_index=request.worker_index,
        num_workers=request.num_workers,
    )


def request_from_proto(message: worker_pb2.RunClosureRequest) -> ClosureRequest:
    return ClosureRequest(
        closure_id=message.closure_id,
        payload=message.payload,
        attempt=int(message.attempt),
        function_name=message.function_name,
        resources=tuple(ResourceSpec(r.resource_id, r.payload) for r in message.resources),
        cluster=cluster_from_proto(message.cluster),
        steps=int(message.steps),
        worker_index=int(message.worker_index),
        num_workers=int(message.num_workers),
    )


def outcome_to_proto(outcome: ClosureOutcome) -> worker_pb2.RunClosureResponse:
    message = worker_pb2.RunClosureResponse(
        worker_incarnation=outcome.worker_incarnation,
        resources_held=list(outcome.resources_held),
        pushes_applied=outcome.pushes_applied,
        pushes_duplicate=outcome.pushes_duplicate,
        seconds=outcome.seconds,
    )
    if outcome.error is not None:
        error = outcome.error
        message.error.CopyFrom(
            worker_pb2.ClosureError(
                type=error.type,
                message=error.message,
                traceback=error.traceback,
                pickled=error.pickled,
                missing_resources=list(error.missing_resources),
                parameter_server=error.parameter_server,
            )
        )
    else:
        message.result = outcome.result or b""
    return message


def outcome_from_proto(message: worker_pb2.RunClosureResponse) -> ClosureOutcome:
    error = None
    if message.WhichOneof("outcome") == "error":
        e = message.error
        error = ClosureError(e.type, e.message, e.traceback, e.pickled, tuple(e.missing_resources), e.parameter_server)
    return ClosureOutcome(
        result=message.result if error is None else None,
        error=error,
        worker_incarnation=message.worker_incarnation,
        resources_held=tuple(message.resources_held),
        pushes_applied=int(message.pushes_applied),
        pushes_duplicate=int(message.pushes_duplicate),
        seconds=float(message.seconds),
    )


def info_to_proto(info: WorkerInfoData) -> worker_pb2.WorkerInfo:
    return worker_pb2.WorkerInfo(
        incarnation=info.incarnation, pid=info.pid, resources_held=list(info.resources_held), closures_run=info.closures_run
    )


def info_from_proto(message: worker_pb2.WorkerInfo) -> WorkerInfoData:
    return WorkerInfoData(message.incarnation, int(message.pid), tuple(message.resources_held), int(message.closures_run))
