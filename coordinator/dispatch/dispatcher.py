"""One worker's dispatcher: runs batches of closures on it and acts on every failure.

A dispatcher attaches to a call the specs of the per-worker resources that worker
is not known to hold and, once per worker incarnation and change, the cluster
context (otherwise only its fingerprint). It acts on each failure through the pure
decisions of ``coordinator.failures``:

- RETRY_ELSEWHERE: the batch goes back to the front of the queue (other workers
  take it), this worker is marked DOWN and probed with the standard gRPC health
  service until it serves again (then UP; its resources are re-sent because a DOWN
  worker is assumed to hold none);
- RESEND: run again on this worker with the missing resources or the cluster context;
- RAISE: the closure fails; the queue keeps the first error for join(), and the
  closures of the batch that did not run are put back (and so cancelled).

A retried closure keeps its closure_id, so the parameter servers' idempotency
keys stop its gradients from being applied twice. Apart from coordinator.dispatch_loop, which
runs every worker's dispatcher on one event loop and hands them batches: this is what
happens to one worker's batch and to the worker's state.
"""

from __future__ import annotations

import enum
import logging
import random
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

import cloudpickle
import tenacity

from paramserve.coordinator.dispatch.batching import BatchSizer
from paramserve.coordinator.dispatch.closures import Closure, ClosureQueue
from paramserve.coordinator.dispatch.failures import (
    RETRYABLE_CODES,
    Action,
    Decision,
    FailurePolicy,
    decide_on_closure_error,
    decide_on_rpc_failure,
    probe_delay,
)
from paramserve.coordinator.dispatch.observer import NO_OBSERVER, CoordinatorObserver
from paramserve.coordinator.dispatch.worker_transport import RpcFailure, WorkerTransport
from paramserve.coordinator.errors import ClosureError, InvalidTransitionError, closure_error_from_remote
from paramserve.wire.v1 import cluster_pb2, worker_pb2
from paramserve.worker.core import ClosureRequest, ResourceSpec
from paramserve.worker.dense.group import DenseRound
from paramserve.worker.messages import batch_to_proto, dense_round_to_proto, failure_from_proto
from paramserve.worker.results import ClosureFailure

__all__ = ["Dispatcher", "ResourceSpecs", "WireContext", "WorkerState"]

log = logging.getLogger(__name__)


class WorkerState(enum.Enum):
    UP = "up"
    DOWN = "down"
    """Its last call failed; it is probed and takes no closures until it serves again."""
    STOPPED = "stopped"


TRANSITIONS: Mapping[WorkerState, frozenset[WorkerState]] = {
    WorkerState.UP: frozenset({WorkerState.DOWN, WorkerState.STOPPED}),
    WorkerState.DOWN: frozenset({WorkerState.UP, WorkerState.STOPPED}),
    WorkerState.STOPPED: frozenset(),
}


@dataclass(frozen=True)
class WireContext:
    """The cluster context as a dispatcher sends it: its fingerprint and its wire message."""

    fingerprint: str
    message: cluster_pb2.ClusterContext


# ---------------------------------------------------------------- resources


class ResourceSpecs:
    """The per-worker resources the coordinator created: id -> pickled ``fn(ctx) -> resource``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._payloads: dict[str, bytes] = {}

    def add(self, resource_id: str, payload: bytes) -> None:
        with self._lock:
            self._payloads[resource_id] = payload

    def ids(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._payloads)

    def specs(self, resource_ids: Collection[str]) -> tuple[ResourceSpec, ...]:
        """Specs of the known ids among ``resource_ids`` (sorted: resources may be created in any order)."""
        with self._lock:
            return tuple(ResourceSpec(r, self._payloads[r]) for r in sorted(resource_ids) if r in self._payloads)


# ---------------------------------------------------------------- one worker


class Dispatcher:
    """Runs batches of closures on one worker and probes it when it is down. ``run`` is one
    call of its worker (tests await it directly); the DispatchLoop drives it otherwise."""

    def __init__(
        self,
        address: str,
        index: int,
        *,
        queue: ClosureQueue,
        specs: ResourceSpecs,
        transport: WorkerTransport,
        cluster_context: Callable[[], WireContext],
        num_workers: Callable[[], int],
        policy: FailurePolicy,
        max_value_age: float = 0.0,
        overlap_pushes: bool = False,
        max_row_staleness: int = 0,
        sizer: BatchSizer | None = None,
        server_failed: Callable[[str], None] | None = None,
        observer: CoordinatorObserver = NO_OBSERVER,
        probe_first: bool = False,
    ):
        self.address = address
        self._server_failed = server_failed
        self._observer = observer
        self.index = index
        self._sizer = sizer or BatchSizer()
        self._queue = queue
        self._specs = specs
        self._transport = transport
        self._cluster_context = cluster_context
        self._num_workers = num_workers
        self._policy = policy
        self._max_value_age = max_value_age
        self._overlap_pushes = overlap_pushes
        self._max_row_staleness = max_row_staleness
        # probe_first: a worker found by name may not serve yet (a container still starting); it
        # starts DOWN, so the health probe, not a closure's attempt, finds out when it serves.
        self._state = WorkerState.DOWN if probe_first else WorkerState.UP
        self._joining = probe_first  # until it first serves: probed often, not with backoff
        self._resources_held: frozenset[str] = frozenset()
        self._closures_in_call: list[Closure] = []  # the closures of the call in progress, not settled yet
        self._cluster_held = ""  # fingerprint of the cluster context the worker is known to hold
        self._incarnation: str | None = None
        self._device = ""  # where the worker computes, as its last reply said
        self._force: frozenset[str] = frozenset()  # resources the next round's call must carry
        observer.worker_state(address, self._state.value)

    @property
    def state(self) -> WorkerState:
        return self._state

    @property
    def incarnation(self) -> str | None:
        """The worker process last seen (None before its first reply)."""
        return self._incarnation

    # ---------------------------------------------------------------- a batch

    async def run(self, batch: Sequence[Closure]) -> None:
        """Runs ``batch`` (closures the queue gave this worker) until each succeeded, failed or
        went back to the queue. If cancelled (the worker is removed or the coordinator stops),
        the closures not finished go back to the queue: not the worker's fault."""
        pending = list(batch)
        self._closures_in_call = pending
        force: frozenset[str] = frozenset()
        try:
            while pending:
                try:
                    request = self._request(pending, force)
                    sent = time.perf_counter()
                    response = await self._transport.run_closures(request, self._policy.closure_timeout * len(pending))
                    self._sizer.observe_call(time.perf_counter() - sent, sum(r.seconds for r in response.results))
                except RpcFailure as failure:
                    self._on_rpc_failure(pending, failure)
                    pending = []
                    await self._after_failure()
                    return
                except Exception as exc:
                    for closure in pending:
                        self._queue.fail(
                            closure, _local_error(closure, self.address, "could not send the closure", exc)
                        )
                    pending = []
                    return
                pending, force = self._on_results(pending, request, response)
                self._closures_in_call = pending
        finally:
            self._closures_in_call = []
            if pending:  # cancelled mid-call
                self._queue.put_back(pending)

    async def run_round(self, batch: Sequence[Closure], member_round: DenseRound, longest: int) -> bool:
        """This worker's call in a hybrid-training round (coordinator.dense_rounds): one call,
        sent even without closures (the member takes part in the others' steps). Closures that
        need something resent, or that the group's breaking stopped, go back to the queue for a
        later round (a lone resend would wait for members that are done). Returns whether the
        group broke (a member failed mid-round): the next round forms it anew. ``longest``: the
        most closures any member got (the call lasts as long as the slowest member)."""
        pending = list(batch)
        self._closures_in_call = pending
        try:
            request = self._request(pending, self._force)
            request.dense.CopyFrom(dense_round_to_proto(member_round))
            deadline = self._policy.closure_timeout * max(1, longest)
            sent = time.perf_counter()
            try:
                response = await self._transport.run_closures(request, deadline)
            except RpcFailure as failure:
                self._on_rpc_failure(pending, failure)
                pending = []
                await self._after_failure()
                return True
            except Exception as exc:
                for closure in pending:
                    self._queue.fail(closure, _local_error(closure, self.address, "could not send the closure", exc))
                pending = []
                return True
            self._sizer.observe_call(time.perf_counter() - sent, sum(r.seconds for r in response.results))
            pending, self._force = self._on_results(pending, request, response)
            return response.group_failed
        finally:
            self._closures_in_call = []
            if pending:  # to resend, not answered, or cancelled mid-call: a later round runs them
                self._queue.put_back(pending)

    async def read_dense_state(self, request: DenseRound, timeout: float) -> bytes:
        """The dense variables' state as this worker holds it (empty: it holds none of the
        request's epoch). Raises RpcFailure."""
        message = worker_pb2.RunClosuresRequest(dense=dense_round_to_proto(request))
        response = await self._transport.run_closures(message, timeout)
        return bytes(response.dense_state)

    async def cancel_running(self, timeout: float) -> int:
        """Asks the worker to cancel the closures of the batch it runs (each stops before its
        next push or step; the call answers them as cancelled, and ``run`` puts them back to a
        queue that cancels them). Returns how many it was asked to cancel. A worker that does
        not answer is left alone: its call fails and its closures are put back all the same."""
        ids = [closure.closure_id for closure in self._closures_in_call]
        if not ids:
            return 0
        try:
            await self._transport.cancel_closures(ids, timeout)
        except RpcFailure as failure:
            log.warning(
                "worker %d (%s) did not take the cancellation of %d closures: %s %s",
                self.index,
                self.address,
                len(ids),
                failure.code,
                failure.details,
            )
        return len(ids)

    def _request(self, batch: Sequence[Closure], force: frozenset[str]) -> worker_pb2.RunClosuresRequest:
        context = self._cluster_context()
        needed = set(force) | set().union(*(c.resource_ids for c in batch))
        # The worker creates what the batch needs before its first closure.
        resources = self._specs.specs(needed - self._resources_held)
        requests = [
            ClosureRequest(
                closure_id=closure.closure_id,
                payload=closure.payload,
                attempt=closure.attempt,
                function_name=closure.function_name,
                resources=resources if position == 0 else (),
                steps=closure.steps,
                worker_index=self.index,
                num_workers=self._num_workers(),
                cluster_fingerprint=context.fingerprint,
                max_value_age=self._max_value_age,
                read_generation=closure.read_generation,
                overlap_pushes=self._overlap_pushes,
                max_row_staleness=self._max_row_staleness,
            )
            for position, closure in enumerate(batch)
        ]
        return batch_to_proto(requests, context.message if context.fingerprint != self._cluster_held else None)

    def _on_results(
        self, pending: list[Closure], request: worker_pb2.RunClosuresRequest, response: worker_pb2.RunClosuresResponse
    ) -> tuple[list[Closure], frozenset[str]]:
        """Settles the closures the worker answered for; returns those to send again and the
        resources to force. Closures after a failed one did not run: they go back to the queue."""
        for position, (closure, result) in enumerate(zip(pending, response.results)):
            self._observe(result)
            self._sizer.observe(result.seconds)
            if result.WhichOneof("outcome") != "error":
                self._cluster_held = request.closures[0].cluster_fingerprint
                self._on_result(closure, result.result)
                continue
            remote = failure_from_proto(result.error)
            decision = decide_on_closure_error(
                remote,
                resends=closure.resends,
                known_resources=self._specs.ids(),
                policy=self._policy,
                server_waits=closure.server_waits,
                servers_recover=self._server_failed is not None,
                restored_since_sent=request.closures[0].cluster_fingerprint != self._cluster_context().fingerprint,
                attempt=closure.attempt + 1,
            )
            self._log_decision(closure, decision)
            if decision.action is Action.CANCEL:
                self._queue.put_back(pending[position:])  # cancelled there: the error is still pending
                return [], frozenset()
            if decision.action is Action.REQUEUE:
                closure.attempt += 1
                self._queue.put_back(pending[position:])
                return [], frozenset()
            if decision.action is Action.AWAIT_SERVER and self._server_failed is not None:
                closure.server_waits += 1
                self._queue.put_back(pending[position:])
                self._server_failed(remote.parameter_server)
                return [], frozenset()
            if decision.action is Action.RESEND:
                closure.resends += 1
                if remote.needs_cluster:
                    self._cluster_held = ""
                return pending[position:], frozenset(remote.missing_resources)
            self._queue.fail(closure, self._remote_error(closure, decision, remote), not_run=pending[position + 1 :])
            return [], frozenset()
        answered = len(response.results)
        if answered < len(pending):  # a worker that stops without saying why: send the rest again
            log.warning("worker %s answered %d of %d closures without an error", self.address, answered, len(pending))
        return pending[answered:], frozenset()

    def _observe(self, result: worker_pb2.RunClosureResponse) -> None:
        """Tracks which resources this worker incarnation holds."""
        previous = self._incarnation
        self._incarnation = result.worker_incarnation
        self._resources_held = frozenset(result.resources_held)
        if result.device and result.device != self._device:
            self._device = result.device
            self._observer.worker_device(self.address, result.device)
        if result.rows_pulled or result.rows_cached:
            self._observer.rows_read(int(result.rows_pulled), int(result.rows_cached), dict(result.cached_by_age))
        if previous is not None and previous != result.worker_incarnation:
            self._cluster_held = ""
            log.warning(
                "worker %d (%s) restarted (incarnation %s -> %s): its resources are re-sent",
                self.index,
                self.address,
                previous,
                result.worker_incarnation,
            )

    def _on_result(self, closure: Closure, payload: bytes) -> None:
        try:
            value = cloudpickle.loads(payload)
        except Exception as exc:
            self._queue.fail(closure, _local_error(closure, self.address, "its result could not be unpickled", exc))
            return
        self._queue.succeed(closure, value)

    def _on_rpc_failure(self, batch: Sequence[Closure], failure: RpcFailure) -> None:
        retry: list[Closure] = []
        for closure in batch:
            decision = decide_on_rpc_failure(failure.code, closure.attempt + 1, self._policy)
            self._log_decision(closure, decision, failure.details)
            if decision.action is Action.RETRY_ELSEWHERE:
                closure.attempt += 1
                retry.append(closure)
                self._observer.closure_retried(closure, failure.code)
                continue
            assert decision.error_type is not None
            self._queue.fail(
                closure,
                decision.error_type(
                    remote_type=f"grpc.StatusCode.{failure.code}",
                    message=f"{failure.details} ({decision.reason})",
                    function_name=closure.function_name,
                    closure_id=closure.closure_id,
                    worker=self.address,
                ),
            )
        self._queue.put_back(retry)
        if failure.code in RETRYABLE_CODES:  # the worker failed, not the request: probe it
            self._mark_down(f"{failure.code} calling it")

    async def _after_failure(self) -> None:
        if self._state is WorkerState.DOWN:
            await self._transport.reset()

    def _remote_error(self, closure: Closure, decision: Decision, data: ClosureFailure) -> ClosureError:
        assert decision.error_type is not None
        return closure_error_from_remote(
            decision.error_type,
            data,
            function_name=closure.function_name,
            closure_id=closure.closure_id,
            worker=self.address,
            server=data.parameter_server,
        )

    def _log_decision(self, closure: Closure, decision: Decision, details: str = "") -> None:
        level = logging.INFO if decision.action is Action.RESEND else logging.WARNING
        log.log(
            level,
            "%s on worker %d (%s): %s because %s%s",
            closure.name,
            self.index,
            self.address,
            decision.action.name,
            decision.reason,
            f" [{details}]" if details else "",
        )

    # ---------------------------------------------------------------- membership

    def _mark_down(self, reason: str) -> None:
        self._resources_held = frozenset()  # it may come back as a new process holding nothing
        self._cluster_held = ""
        self._set_state(WorkerState.DOWN, reason)

    async def probe(self) -> bool:
        """Health-checks the DOWN worker with backoff until it serves (UP, True) or the probe
        deadline passes (False: the caller gives it up). Cancellable."""
        policy = self._policy
        stop: tenacity.stop.stop_base = tenacity.stop_never
        if policy.probe_deadline is not None:
            stop = tenacity.stop_after_delay(policy.probe_deadline)
        joining = self._joining
        retrying = tenacity.AsyncRetrying(
            retry=tenacity.retry_if_result(lambda serving: not serving),
            wait=lambda state: (
                probe_delay(policy, joining=joining, attempt=state.attempt_number)
                + random.uniform(0, policy.probe_jitter)
            ),
            stop=stop,
            retry_error_callback=lambda _state: False,
        )
        if await retrying(self._transport.is_serving, policy.probe_timeout):
            self._set_state(WorkerState.UP, "it serves" if self._joining else "it serves again")
            self._joining = False
            return True
        log.error(
            "worker %d (%s) did not come back within %ss: giving it up", self.index, self.address, policy.probe_deadline
        )
        return False

    def stop(self, reason: str) -> None:
        self._set_state(WorkerState.STOPPED, reason)

    async def close(self) -> None:
        """Closes this dispatcher's transport, its connection to the worker (once it is stopped:
        nothing may be sent through it afterwards)."""
        await self._transport.close()

    def _set_state(self, to: WorkerState, reason: str) -> None:
        if self._state is to:
            return
        previous = self._state
        self._state = InvalidTransitionError.check(TRANSITIONS, previous, to, f"worker {self.address}")
        self._observer.worker_state(self.address, to.value)
        log.info("worker %d (%s): %s -> %s (%s)", self.index, self.address, previous.name, to.name, reason)


def _local_error(closure: Closure, worker: str, what: str, exc: Exception) -> ClosureError:
    """A closure that failed on the coordinator's side of the call."""
    return ClosureError(
        remote_type=f"{type(exc).__module__}.{type(exc).__qualname__}",
        message=f"{what}: {exc}",
        function_name=closure.function_name,
        closure_id=closure.closure_id,
        worker=worker,
        remote_exception=exc,
    )
