"""The one translation between Worker wire messages and the worker core's types.

The worker's servicer reads requests and writes outcomes here; the coordinator's
dispatchers write requests and read outcomes here. The cluster context inside a
request goes through ``psserver.convert`` (the one form of "where variables live").
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

from paramserve.psserver.protocol import convert as ps_convert
from paramserve.psserver.protocol.errors import InvalidRequestError
from paramserve.wire.v1 import cluster_pb2, worker_pb2
from paramserve.worker.core import ClosureOutcome, ClosureRequest, ResourceSpec, RoundOutcome, WorkerInfo
from paramserve.worker.dense.group import DenseRound, GroupSpec
from paramserve.worker.results import ClosureFailure
from paramserve.worker.row_cache import CacheUse

__all__ = [
    "batch_to_proto",
    "dense_round_from_proto",
    "dense_round_to_proto",
    "round_outcome_to_proto",
    "failure_from_proto",
    "info_from_proto",
    "info_to_proto",
    "outcome_from_proto",
    "outcome_to_proto",
    "request_from_proto",
    "request_to_proto",
]


def request_to_proto(request: ClosureRequest) -> worker_pb2.RunClosureRequest:
    return worker_pb2.RunClosureRequest(
        closure_id=request.closure_id,
        attempt=request.attempt,
        function_name=request.function_name,
        payload=request.payload,
        resources=[worker_pb2.ResourceSpec(resource_id=r.resource_id, payload=r.payload) for r in request.resources],
        cluster=ps_convert.cluster_to_proto(request.cluster) if request.cluster is not None else None,
        steps=request.steps,
        worker_index=request.worker_index,
        num_workers=request.num_workers,
        cluster_fingerprint=request.cluster_fingerprint,
        max_value_age=request.max_value_age,
        read_generation=request.read_generation,
        overlap_pushes=request.overlap_pushes,
        max_row_staleness=request.max_row_staleness,
    )


def batch_to_proto(
    requests: Sequence[ClosureRequest], cluster: cluster_pb2.ClusterContext | None = None
) -> worker_pb2.RunClosuresRequest:
    """One RunClosures call carrying ``requests``. ``cluster``: a context already on the wire (the
    coordinator converts each context once, not once per call), sent with the first request."""
    messages = [request_to_proto(request) for request in requests]
    if cluster is not None and messages:
        messages[0].cluster.CopyFrom(cluster)
    return worker_pb2.RunClosuresRequest(closures=messages)


def request_from_proto(message: worker_pb2.RunClosureRequest) -> ClosureRequest:
    """Raises InvalidRequestError for a malformed cluster context."""
    return ClosureRequest(
        closure_id=message.closure_id,
        payload=message.payload,
        attempt=int(message.attempt),
        function_name=message.function_name,
        resources=tuple(ResourceSpec(r.resource_id, r.payload) for r in message.resources),
        cluster=ps_convert.cluster_from_proto(message.cluster) if message.HasField("cluster") else None,
        steps=int(message.steps),
        worker_index=int(message.worker_index),
        num_workers=int(message.num_workers),
        cluster_fingerprint=message.cluster_fingerprint,
        max_value_age=float(message.max_value_age),
        read_generation=int(message.read_generation),
        overlap_pushes=bool(message.overlap_pushes),
        max_row_staleness=int(message.max_row_staleness),
    )


def outcome_to_proto(outcome: ClosureOutcome) -> worker_pb2.RunClosureResponse:
    message = worker_pb2.RunClosureResponse(
        worker_incarnation=outcome.worker_incarnation,
        resources_held=list(outcome.resources_held),
        pushes_applied=outcome.pushes_applied,
        pushes_duplicate=outcome.pushes_duplicate,
        seconds=outcome.seconds,
        device=outcome.device,
        rows_pulled=outcome.cache_use.rows_pulled,
        rows_cached=outcome.cache_use.rows_cached,
        cached_by_age=dict(outcome.cache_use.ages),
    )
    if outcome.error is not None:
        error = outcome.error
        message.error.CopyFrom(
            worker_pb2.ClosureFailure(
                type=error.type,
                message=error.message,
                traceback=error.traceback,
                pickled=error.pickled,
                missing_resources=list(error.missing_resources),
                parameter_server=error.parameter_server,
                needs_cluster=error.needs_cluster,
                cancelled=error.cancelled,
                group_failed=error.group_failed,
            )
        )
    else:
        message.result = outcome.result or b""
    return message


def failure_from_proto(message: worker_pb2.ClosureFailure) -> ClosureFailure:
    return ClosureFailure(
        message.type,
        message.message,
        message.traceback,
        message.pickled,
        tuple(message.missing_resources),
        message.parameter_server,
        message.needs_cluster,
        message.cancelled,
        message.group_failed,
    )


def batch_from_proto(message: worker_pb2.RunClosuresRequest) -> list[ClosureRequest]:
    return [request_from_proto(closure) for closure in message.closures]


def dense_round_to_proto(round_: DenseRound) -> worker_pb2.DenseRound:
    group = round_.group
    return worker_pb2.DenseRound(
        group=worker_pb2.DenseGroup(
            generation=group.generation,
            rank=group.rank,
            world_size=group.world_size,
            store_address=group.store_address,
            host=group.host,
            timeout_seconds=group.timeout,
            store_secret=group.store_secret,
        ),
        variables=list(round_.variables),
        optimizer=round_.optimizer,
        state_epoch=round_.state_epoch,
        initial_state=round_.initial_state,
        read_state=round_.read_state,
    )


def dense_round_from_proto(message: worker_pb2.DenseRound) -> DenseRound:
    """Raises InvalidRequestError for a group no member could be (rank outside it, no timeout)."""
    group = message.group
    if not 0 <= group.rank < group.world_size or not group.timeout_seconds > 0 or not group.store_address:
        raise InvalidRequestError(
            f"a dense round needs 0 <= rank < world_size, a positive timeout and a store address; got rank "
            f"{group.rank} of {group.world_size}, timeout {group.timeout_seconds}, store {group.store_address!r}"
        )
    return DenseRound(
        group=GroupSpec(
            generation=int(group.generation),
            rank=int(group.rank),
            world_size=int(group.world_size),
            store_address=group.store_address,
            host=group.host,
            timeout=float(group.timeout_seconds),
            store_secret=group.store_secret,
        ),
        variables=tuple(message.variables),
        optimizer=message.optimizer,
        state_epoch=int(message.state_epoch),
        initial_state=message.initial_state,
        read_state=bool(message.read_state),
    )


def round_outcome_to_proto(outcome: RoundOutcome) -> worker_pb2.RunClosuresResponse:
    return worker_pb2.RunClosuresResponse(
        results=[outcome_to_proto(o) for o in outcome.outcomes],
        dense_state=outcome.dense_state,
        group_failed=outcome.group_failed,
    )


def batch_outcomes_to_proto(outcomes: Sequence[ClosureOutcome]) -> worker_pb2.RunClosuresResponse:
    return worker_pb2.RunClosuresResponse(results=[outcome_to_proto(o) for o in outcomes])


def outcome_from_proto(message: worker_pb2.RunClosureResponse) -> ClosureOutcome:
    error = failure_from_proto(message.error) if message.WhichOneof("outcome") == "error" else None
    return ClosureOutcome(
        result=message.result if error is None else None,
        error=error,
        worker_incarnation=message.worker_incarnation,
        resources_held=tuple(message.resources_held),
        pushes_applied=int(message.pushes_applied),
        pushes_duplicate=int(message.pushes_duplicate),
        seconds=float(message.seconds),
        device=message.device,
        cache_use=CacheUse(
            rows_cached=int(message.rows_cached),
            rows_pulled=int(message.rows_pulled),
            ages=collections.Counter({int(age): int(n) for age, n in message.cached_by_age.items()}),
        ),
    )


def info_to_proto(info: WorkerInfo) -> worker_pb2.WorkerInfo:
    return worker_pb2.WorkerInfo(
        incarnation=info.incarnation,
        pid=info.pid,
        resources_held=list(info.resources_held),
        closures_run=info.closures_run,
    )


def info_from_proto(message: worker_pb2.WorkerInfo) -> WorkerInfo:
    return WorkerInfo(message.incarnation, int(message.pid), tuple(message.resources_held), int(message.closures_run))
