"""Dispatchers: one thread per worker that takes closures from the queue and runs them there.

A dispatcher sends ``RunClosure`` with a deadline, the cluster's token and the
current ClusterContext, attaching the specs of the per-worker resources this
worker incarnation is not known to hold. It acts on each failure through the
pure decisions of ``coordinator.failures``:

- RETRY_ELSEWHERE: the closure goes back to the front of the queue (another
  worker takes it), this worker is marked DOWN and probed with the standard
  gRPC health service until it serves again (then UP; its resources are
  re-sent because a DOWN worker is assumed to hold none);
- RESEND: run again on this worker with the missing resources or the cluster
  context (sent once per worker incarnation and context, otherwise only named
  by its fingerprint);
- RAISE: the closure fails; the queue keeps the first error for join().

A retried closure keeps its closure_id, so the parameter servers' idempotency
keys stop its gradients from being applied twice.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Protocol

import cloudpickle
import grpc
import tenacity
from grpc_health.v1 import health_pb2, health_pb2_grpc

from paramserve.coordinator.closures import Closure, ClosureQueue
from paramserve.coordinator.errors import (
    ClosureError,
    InvalidTransitionError,
    closure_error_from_remote,
)
from paramserve.coordinator.failures import (
    Action,
    Decision,
    FailurePolicy,
    decide_on_closure_error,
    decide_on_rpc_failure,
)
from paramserve.psserver.serving import AUTH_METADATA_KEY, channel_options
from paramserve.wire.v1 import cluster_pb2, worker_pb2
from paramserve.worker.core import ClosureFailure
from paramserve.worker.messages import failure_from_proto

__all__ = [
    "Dispatcher",
    "DispatcherPool",
    "GrpcTransport",
    "ResourceSpecs",
    "RpcFailure",
    "WorkerState",
    "WorkerTransport",
]

log = logging.getLogger(__name__)

THREAD_PREFIX = "paramserve-dispatch-"
RUN_CLOSURE_METHOD = "/paramserve.wire.v1.Worker/RunClosure"
WORKER_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name


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


# ---------------------------------------------------------------- transport


@dataclass(frozen=True)
class WireContext:
    """The cluster context as a dispatcher sends it: its fingerprint and its wire message."""

    fingerprint: str
    message: cluster_pb2.ClusterContext


class RpcFailure(Exception):
    """A call to a worker ended with a gRPC status other than OK."""

    def __init__(self, code: str, details: str):
        super().__init__(f"{code}: {details}")
        self.code = code
        self.details = details


class WorkerTransport(Protocol):
    """How a dispatcher reaches its worker (tests substitute a double)."""

    def run_closure(self, request: worker_pb2.RunClosureRequest, timeout: float) -> worker_pb2.RunClosureResponse:
        """Raises RpcFailure when the call fails."""

    def is_serving(self, timeout: float) -> bool:
        """One health check."""

    def reset(self) -> None:
        """Drops the connection: the next call dials afresh (the worker may have restarted)."""

    def close(self) -> None:
        """Cancels a call in progress; every later call fails with CANCELLED."""


class GrpcTransport:
    """WorkerTransport over gRPC, with ``authorization: Bearer <token>`` when a token is set."""

    def __init__(self, address: str, token: str | None, max_message_bytes: int):
        self.address = address
        self._metadata = ((AUTH_METADATA_KEY, f"Bearer {token}"),) if token else ()
        self._options = channel_options(max_message_bytes)
        self._lock = threading.Lock()
        self._channel: grpc.Channel | None = None
        self._future: grpc.Future | None = None
        self._closed = False

    def run_closure(self, request: worker_pb2.RunClosureRequest, timeout: float) -> worker_pb2.RunClosureResponse:
        future = self._start(request, timeout)
        try:
            return future.result()
        except grpc.FutureCancelledError:
            raise RpcFailure("CANCELLED", "the coordinator cancelled the call") from None
        except grpc.RpcError as err:
            raise RpcFailure(err.code().name, err.details() or "") from None
        finally:
            with self._lock:
                self._future = None

    def is_serving(self, timeout: float) -> bool:
        # A fresh channel per probe: no reconnect backoff inherited from the dead connection.
        with grpc.insecure_channel(self.address, options=self._options) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=WORKER_SERVICE), timeout=timeout)
            except grpc.RpcError:
                return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def reset(self) -> None:
        with self._lock:
            channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            future, channel, self._channel = self._future, self._channel, None
        if future is not None:
            future.cancel()
        if channel is not None:
            channel.close()

    def _start(self, request: worker_pb2.RunClosureRequest, timeout: float) -> grpc.Future:
        with self._lock:
            if self._closed:
                raise RpcFailure("CANCELLED", "the dispatcher is stopping")
            if self._channel is None:
                self._channel = grpc.insecure_channel(self.address, options=self._options)
            call = self._channel.unary_unary(
                RUN_CLOSURE_METHOD,
                request_serializer=worker_pb2.RunClosureRequest.SerializeToString,
                response_deserializer=worker_pb2.RunClosureResponse.FromString,
            )
            self._future = call.future(request, timeout=timeout, metadata=self._metadata)
            return self._future


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

    def specs(self, resource_ids: Collection[str]) -> list[worker_pb2.ResourceSpec]:
        """Specs of the known ids among ``resource_ids`` (sorted: resources may be created in any order)."""
        with self._lock:
            return [
                worker_pb2.ResourceSpec(resource_id=r, payload=self._payloads[r])
                for r in sorted(resource_ids)
                if r in self._payloads
            ]


# ---------------------------------------------------------------- one worker


class Dispatcher:
    """Runs closures on one worker. ``step()`` is one iteration of its loop (tests call it
    directly); ``start()`` runs the loop in a thread named ``paramserve-dispatch-<index>``."""

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
        poll_interval: float = 0.5,
        max_value_age: float = 0.0,
    ):
        self.address = address
        self.index = index
        self._queue = queue
        self._specs = specs
        self._transport = transport
        self._cluster_context = cluster_context
        self._num_workers = num_workers
        self._policy = policy
        self._poll_interval = poll_interval
        self._max_value_age = max_value_age
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._state = WorkerState.UP
        self._held: frozenset[str] = frozenset()
        self._cluster_held = ""  # fingerprint of the cluster context the worker is known to hold
        self._incarnation: str | None = None
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------- lifecycle

    @property
    def state(self) -> WorkerState:
        with self._lock:
            return self._state

    @property
    def incarnation(self) -> str | None:
        """The worker process last seen (None before its first reply)."""
        with self._lock:
            return self._incarnation

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=f"{THREAD_PREFIX}{self.index}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Asks the loop to end: a call in progress is cancelled and its closure put back."""
        self._stop.set()
        self._transport.close()
        self._queue.wake_all()

    def join(self, timeout: float | None) -> bool:
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self.step(self._poll_interval)
        except Exception:  # noqa: BLE001 - a bug here must be loud, not a silent dead thread
            log.exception("dispatcher of worker %s (%s) crashed", self.index, self.address)
            raise
        finally:
            self._set_state(WorkerState.STOPPED, "dispatcher stopped")
            self._transport.close()

    def step(self, timeout: float) -> bool:
        """Probes the worker if DOWN, else runs at most one closure; True if one ran."""
        if self.state is WorkerState.DOWN:
            self._probe()
            return False
        closure = self._queue.get(timeout, self.address, self._stop)
        if closure is None:
            return False
        self._run(closure)
        return True

    # ---------------------------------------------------------------- one closure

    def _run(self, closure: Closure) -> None:
        force: frozenset[str] = frozenset()
        while True:
            try:
                request = self._request(closure, force)
                response = self._transport.run_closure(request, self._policy.closure_timeout)
            except RpcFailure as failure:
                self._on_rpc_failure(closure, failure)
                return
            except Exception as exc:  # noqa: BLE001 - e.g. the cluster context could not be built
                self._queue.fail(closure, _local_error(closure, self.address, "could not send the closure", exc))
                return
            self._observe(response)
            if response.WhichOneof("outcome") != "error":
                self._cluster_held = request.cluster_fingerprint
                self._on_result(closure, response.result)
                return
            remote = failure_from_proto(response.error)
            decision = decide_on_closure_error(
                remote, resends=closure.resends, known_resources=self._specs.ids(), policy=self._policy
            )
            self._log_decision(closure, decision)
            if decision.action is not Action.RESEND:
                self._queue.fail(closure, self._remote_error(closure, decision, remote))
                return
            closure.resends += 1
            force = frozenset(remote.missing_resources)
            if remote.needs_cluster:
                self._cluster_held = ""

    def _request(self, closure: Closure, force: frozenset[str]) -> worker_pb2.RunClosureRequest:
        with self._lock:
            needed = (closure.resource_ids | force) - self._held
        context = self._cluster_context()
        request = worker_pb2.RunClosureRequest(
            closure_id=closure.closure_id,
            attempt=closure.attempt,
            function_name=closure.function_name,
            payload=closure.payload,
            resources=self._specs.specs(needed),
            steps=closure.steps,
            worker_index=self.index,
            num_workers=self._num_workers(),
            cluster_fingerprint=context.fingerprint,
            max_value_age=self._max_value_age,
        )
        if context.fingerprint != self._cluster_held:
            request.cluster.CopyFrom(context.message)
        return request

    def _observe(self, response: worker_pb2.RunClosureResponse) -> None:
        """Tracks which resources this worker incarnation holds."""
        with self._lock:
            previous = self._incarnation
            self._incarnation = response.worker_incarnation
            self._held = frozenset(response.resources_held)
        if previous is not None and previous != response.worker_incarnation:
            self._cluster_held = ""
            log.warning("worker %d (%s) restarted (incarnation %s -> %s): its resources are re-sent",
                        self.index, self.address, previous, response.worker_incarnation)

    def _on_result(self, closure: Closure, payload: bytes) -> None:
        try:
            value = cloudpickle.loads(payload)
        except Exception as exc:  # noqa: BLE001 - e.g. a class the coordinator cannot import
            self._queue.fail(closure, _local_error(closure, self.address, "its result could not be unpickled", exc))
            return
        self._queue.succeed(closure, value)

    def _on_rpc_failure(self, closure: Closure, failure: RpcFailure) -> None:
        if self._stop.is_set():
            self._queue.put_back(closure)  # cancelled by stop(): not the worker's fault
            return
        decision = decide_on_rpc_failure(failure.code, closure.attempt + 1, self._policy)
        self._log_decision(closure, decision, failure.details)
        if decision.action is Action.RETRY_ELSEWHERE:
            closure.attempt += 1
            self._mark_down(decision.reason)
            self._queue.put_back(closure)
            return
        assert decision.error_type is not None
        self._queue.fail(closure, decision.error_type(
            remote_type=f"grpc.StatusCode.{failure.code}",
            message=f"{failure.details} ({decision.reason})",
            function_name=closure.function_name,
            closure_id=closure.closure_id,
            worker=self.address,
        ))

    def _remote_error(self, closure: Closure, decision: Decision, data: ClosureFailure) -> ClosureError:
        assert decision.error_type is not None
        return closure_error_from_remote(
            decision.error_type, data, function_name=closure.function_name,
            closure_id=closure.closure_id, worker=self.address, server=data.parameter_server,
        )

    def _log_decision(self, closure: Closure, decision: Decision, details: str = "") -> None:
        level = logging.INFO if decision.action is Action.RESEND else logging.WARNING
        log.log(level, "%s on worker %d (%s): %s because %s%s", closure.name, self.index, self.address,
                decision.action.name, decision.reason, f" [{details}]" if details else "")

    # ---------------------------------------------------------------- membership

    def _mark_down(self, reason: str) -> None:
        with self._lock:
            self._held = frozenset()  # it may come back as a new process holding nothing
        self._cluster_held = ""
        self._transport.reset()
        self._set_state(WorkerState.DOWN, reason)

    def _probe(self) -> None:
        """Health-checks the DOWN worker with backoff until it serves (UP), or stop/give-up (STOPPED)."""
        policy = self._policy
        stop: tenacity.stop.stop_base = tenacity.stop_when_event_set(self._stop)
        if policy.probe_deadline is not None:
            stop = stop | tenacity.stop_after_delay(policy.probe_deadline)
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_result(lambda serving: not serving),
            wait=tenacity.wait_exponential(multiplier=policy.probe_initial_backoff, max=policy.probe_max_backoff)
            + tenacity.wait_random(0, policy.probe_jitter),
            stop=stop,
            sleep=self._sleep,  # interruptible by stop()
            retry_error_callback=lambda _state: False,
        )
        if retrying(self._transport.is_serving, policy.probe_timeout):
            self._set_state(WorkerState.UP, "it serves again")
        elif not self._stop.is_set():
            log.error("worker %d (%s) did not come back within %ss: giving it up",
                      self.index, self.address, policy.probe_deadline)
            self._stop.set()

    def _sleep(self, seconds: float) -> None:
        self._stop.wait(seconds)

    def _set_state(self, to: WorkerState, reason: str) -> None:
        with self._lock:
            if self._state is to:
                return
            previous = self._state
            self._state = InvalidTransitionError.check(TRANSITIONS, previous, to, f"worker {self.address}")
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


# ---------------------------------------------------------------- all workers


class DispatcherPool:
    """The dispatchers of a coordinator, one per worker address; workers may join and leave."""

    def __init__(
        self,
        *,
        queue: ClosureQueue,
        specs: ResourceSpecs,
        policy: FailurePolicy,
        transport_factory: Callable[[str], WorkerTransport],
        cluster_context: Callable[[], WireContext],
        poll_interval: float = 0.5,
        max_value_age: float = 0.0,
    ):
        self._queue = queue
        self._specs = specs
        self._policy = policy
        self._transport_factory = transport_factory
        self._cluster_context = cluster_context
        self._poll_interval = poll_interval
        self._max_value_age = max_value_age
        self._lock = threading.Lock()
        self._dispatchers: dict[str, Dispatcher] = {}
        self._stopped = False

    def add_worker(self, address: str) -> Dispatcher:
        """Starts a dispatcher for ``address`` with the smallest free worker index."""
        with self._lock:
            if self._stopped:
                raise RuntimeError("the coordinator is shut down; it cannot add workers")
            if address in self._dispatchers:
                raise ValueError(f"worker {address} is already part of the cluster")
            used = {d.index for d in self._dispatchers.values()}
            index = next(i for i in range(len(used) + 1) if i not in used)
            dispatcher = Dispatcher(
                address, index, queue=self._queue, specs=self._specs,
                transport=self._transport_factory(address), cluster_context=self._cluster_context,
                num_workers=self.num_workers, policy=self._policy, poll_interval=self._poll_interval,
                max_value_age=self._max_value_age,
            )
            self._dispatchers[address] = dispatcher
        dispatcher.start()
        log.info("worker %d (%s) joined", index, address)
        return dispatcher

    def remove_worker(self, address: str, timeout: float | None = None) -> None:
        """Stops the dispatcher of ``address``; a closure it was running is put back for others."""
        with self._lock:
            dispatcher = self._dispatchers.pop(address, None)
        if dispatcher is None:
            raise KeyError(f"worker {address} is not part of the cluster")
        dispatcher.stop()
        dispatcher.join(timeout)
        log.info("worker %d (%s) left", dispatcher.index, address)

    def stop(self, timeout: float | None = None) -> list[Dispatcher]:
        """Stops every dispatcher and waits for its thread; returns those still alive after ``timeout``."""
        with self._lock:
            self._stopped = True
            dispatchers = list(self._dispatchers.values())
        for dispatcher in dispatchers:
            dispatcher.stop()
        deadline = None if timeout is None else time.monotonic() + timeout
        return [d for d in dispatchers if not d.join(_remaining(deadline))]

    def num_workers(self) -> int:
        with self._lock:
            return len(self._dispatchers)

    def dispatchers(self) -> list[Dispatcher]:
        with self._lock:
            return sorted(self._dispatchers.values(), key=lambda d: d.index)


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())
