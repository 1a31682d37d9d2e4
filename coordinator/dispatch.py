"""Dispatch: how scheduled closures reach the workers.

One thread, ``paramserve-dispatch``, runs an asyncio event loop that holds a
``Dispatcher`` per worker and talks to the workers with grpc.aio: however many
workers there are, the coordinator has one dispatch thread (threads do not grow
with the workers). When closures are queued and a worker is free, the loop hands
that worker a batch of them: one ``RunClosures`` call carries them, the worker runs
them in order and stops at the first that does not succeed. Each closure keeps its
own id, attempts and RemoteValue; batching only saves round trips. A batch forms
only from short closures under a backlog (``BatchSizer``): closures of one batch run
one after another on one worker, so a long closure is never held behind another
while a worker could start it.

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
keys stop its gradients from being applied twice.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import enum
import logging
import random
import threading
import time
from collections.abc import Callable, Collection, Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import cloudpickle
import grpc
import tenacity
from grpc_health.v1 import health_pb2, health_pb2_grpc

from paramserve.coordinator.closures import Closure, ClosureQueue
from paramserve.coordinator.errors import ClosureError, InvalidTransitionError, closure_error_from_remote
from paramserve.coordinator.failures import (
    RETRYABLE_CODES,
    Action,
    Decision,
    FailurePolicy,
    decide_on_closure_error,
    decide_on_rpc_failure,
    probe_delay,
)
from paramserve.coordinator.telemetry import NO_OBSERVER, CoordinatorObserver
from paramserve.psserver.channels import channel_options, open_aio_channel
from paramserve.psserver.security import (
    REPLY_NONCE_METADATA_KEY,
    REPLY_SIGNATURE_METADATA_KEY,
    ClientTls,
    bearer_metadata,
    new_reply_nonce,
    reply_is_signed,
    reply_key,
)
from paramserve.wire.v1 import cluster_pb2, worker_pb2
from paramserve.worker.core import ClosureFailure, ClosureRequest, ResourceSpec
from paramserve.worker.messages import batch_to_proto, failure_from_proto

__all__ = [
    "DispatchLoop",
    "Dispatcher",
    "GrpcTransport",
    "ResourceSpecs",
    "RpcFailure",
    "THREAD_NAME",
    "WireContext",
    "WorkerState",
    "WorkerTransport",
]

log = logging.getLogger(__name__)
_T = TypeVar("_T")

THREAD_NAME = "paramserve-dispatch"
RUN_CLOSURES_METHOD = "/paramserve.wire.v1.Worker/RunClosures"
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


@dataclass(frozen=True)
class WireContext:
    """The cluster context as a dispatcher sends it: its fingerprint and its wire message."""

    fingerprint: str
    message: cluster_pb2.ClusterContext


# ---------------------------------------------------------------- transport


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
        self._call: Any = None

    async def run_closures(
        self, request: worker_pb2.RunClosuresRequest, timeout: float
    ) -> worker_pb2.RunClosuresResponse:
        if self._channel is None:
            self._channel = open_aio_channel(self.address, self._tls, self._options)
            self._call = self._channel.unary_unary(
                RUN_CLOSURES_METHOD,
                request_serializer=worker_pb2.RunClosuresRequest.SerializeToString,
                response_deserializer=None,  # raw bytes: the signature covers them
            )
        nonce = new_reply_nonce()
        metadata = [(REPLY_NONCE_METADATA_KEY, nonce)]
        if self._token:
            metadata.append(bearer_metadata(self._token))
        try:
            call = self._call(request, timeout=timeout, metadata=metadata)
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


BATCH_SECONDS = 0.1
"""How long a batch of closures lasts on a worker by default (CoordinatorConfig.batch_seconds).
Each RunClosures call costs a millisecond or two of coordinator and worker CPU and a gap in the
worker's work; at 0.1 s a batch of 4 ms training steps carries 16 (max_batch) of them, which
on 2 cores took the small-model benchmark from ~180 to ~250-300 steps/s. A closure keeps its id
in a batch, so one retried after its worker died mid-batch still applies its pushes once."""


class BatchSizer:
    """How many queued closures one RunClosures call carries.

    A batch saves a round trip per closure (about a millisecond of coordinator and worker
    time), which matters only for closures of a few milliseconds; and its closures run one
    after another on one worker. So a batch is sized to last about ``target_seconds`` at the
    recent closure duration (an exponential average of what workers report), never more than
    ``max_batch``, and is 1 until a duration is known.

    Within that, a batch takes no more than one worker's share of the queue, counting every
    worker of the cluster (a closure another worker could start now, or once it is back up,
    is not held back), with one exception: closures that together run in less time than a
    call costs beyond its closures (its overhead: round trip, (un)marshalling, the
    coordinator's and the worker's handling, measured on every call) are batched even while
    other workers are free. Sending each of them alone would cost more than running them one
    after another, so holding one behind the others at most doubles its wait, and a large
    cluster of idle workers does not turn a backlog of short closures into one call each.
    """

    def __init__(self, max_batch: int = 16, target_seconds: float = BATCH_SECONDS, smoothing: float = 0.2):
        if target_seconds <= 0:
            raise ValueError(f"target_seconds must be > 0, got {target_seconds}")
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.max_batch = max_batch
        self.target_seconds = target_seconds
        self._smoothing = smoothing
        self._seconds: float | None = None
        self._call_overhead: float | None = None

    def observe(self, seconds: float) -> None:
        """A closure ran for ``seconds`` on a worker."""
        if seconds >= 0:
            self._seconds = self._averaged(self._seconds, seconds)

    def observe_call(self, seconds: float, closure_seconds: float) -> None:
        """A call took ``seconds`` from send to reply, ``closure_seconds`` of which its
        closures ran on the worker."""
        if seconds >= 0 and closure_seconds >= 0:
            self._call_overhead = self._averaged(self._call_overhead, max(0.0, seconds - closure_seconds))

    @property
    def call_overhead(self) -> float:
        """The recent seconds a call costs beyond its closures (0 until a call is seen)."""
        return self._call_overhead or 0.0

    def _averaged(self, average: float | None, sample: float) -> float:
        return sample if average is None else average + self._smoothing * (sample - average)

    def size(self, queued: int, workers: int) -> int:
        if self._seconds is None or queued <= 1:
            return 1
        seconds = max(self._seconds, 1e-6)
        share = max(1, queued // max(1, workers))
        cheaper_than_a_call = int(self.call_overhead / seconds)
        lasting = max(1, int(self.target_seconds / seconds))
        return min(self.max_batch, queued, lasting, max(share, cheaper_than_a_call))


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
        # probe_first: a worker found by name may not serve yet (a container still starting); it
        # starts DOWN, so the health probe, not a closure's attempt, finds out when it serves.
        self._state = WorkerState.DOWN if probe_first else WorkerState.UP
        self._joining = probe_first  # until it first serves: probed often, not with backoff
        self._held: frozenset[str] = frozenset()
        self._cluster_held = ""  # fingerprint of the cluster context the worker is known to hold
        self._incarnation: str | None = None
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
        finally:
            if pending:  # cancelled mid-call
                self._queue.put_back(pending)

    def _request(self, batch: Sequence[Closure], force: frozenset[str]) -> worker_pb2.RunClosuresRequest:
        context = self._cluster_context()
        needed = set(force) | set().union(*(c.resource_ids for c in batch))
        # The worker creates what the batch needs before its first closure.
        resources = self._specs.specs(needed - self._held)
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
                overlap_pushes=self._overlap_pushes,
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
            )
            self._log_decision(closure, decision)
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
        self._held = frozenset(result.resources_held)
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
        self._held = frozenset()  # it may come back as a new process holding nothing
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


# ---------------------------------------------------------------- all workers, one loop


class DispatchLoop:
    """Every worker's dispatcher on one event loop in one thread (``paramserve-dispatch``).

    Free workers wait in a FIFO; each put to the queue wakes the loop, which gives the free
    workers batches (O(1) work per closure, whatever the number of workers). Workers may join
    and leave while closures run. Methods other than ``dispatchers`` are thread-safe.
    """

    def __init__(
        self,
        *,
        queue: ClosureQueue,
        specs: ResourceSpecs,
        policy: FailurePolicy,
        transport_factory: Callable[[str], WorkerTransport],
        cluster_context: Callable[[], WireContext],
        max_value_age: float = 0.0,
        overlap_pushes: bool = False,
        max_batch: int = 16,
        batch_seconds: float = BATCH_SECONDS,
        on_server_failure: Callable[[str], None] | None = None,
        observer: CoordinatorObserver = NO_OBSERVER,
    ):
        self._sizer = BatchSizer(max_batch, batch_seconds)
        self._observer = observer
        self._on_server_failure = on_server_failure
        self._server_hold = False  # dispatch held since a closure saw a parameter server fail
        self._queue = queue
        self._specs = specs
        self._policy = policy
        self._transport_factory = transport_factory
        self._cluster_context = cluster_context
        self._max_value_age = max_value_age
        self._overlap_pushes = overlap_pushes
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name=THREAD_NAME, daemon=True)
        self._dispatchers: dict[str, Dispatcher] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._free: collections.deque[Dispatcher] = collections.deque()
        self._running: set[asyncio.Task[Any]] = set()  # calls carrying closures (not probes)
        self._drained: asyncio.Event | None = None  # set while none runs; made on the loop
        self._holds = 0
        self._stopped = False
        self._thread.start()
        queue.set_waker(self._wake)

    # ---------------------------------------------------------------- from any thread

    def add_worker(self, address: str, *, probe_first: bool = False) -> Dispatcher:
        """Starts dispatching to ``address`` with the smallest free worker index; with
        ``probe_first``, once its health check says it serves."""
        return self._call(self._add(address, probe_first))

    def remove_worker(self, address: str, timeout: float | None = None) -> None:
        """Stops dispatching to ``address``; the closures it was running go back to the queue."""
        self._call(self._remove(address), timeout)

    def num_workers(self) -> int:
        return len(self._dispatchers)

    def dispatchers(self) -> list[Dispatcher]:
        return sorted(self._dispatchers.values(), key=lambda d: d.index)

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def stop(self, timeout: float | None = None) -> bool:
        """Cancels every call in progress (its closures go back to the queue, which the
        coordinator has closed by then), closes the connections and joins the thread.
        Returns whether the thread ended within ``timeout``."""
        if not self._stopped:
            self._stopped = True
            try:
                self._call(self._stop_all(), timeout)
            except (concurrent.futures.TimeoutError, RuntimeError):
                log.error("the dispatch loop did not stop its workers within %ss", timeout)
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def release_server_hold(self) -> None:
        """Ends the hold a parameter server's failure put on dispatch (the recovery is over)."""
        self._call(self._release_server_hold())

    @contextlib.contextmanager
    def paused(self, timeout: float | None = None) -> Iterator[None]:
        """No closure starts while inside, and entering waits until none is running: a point
        between closures, where every closure that finished has all its pushes applied and
        none is half done (checkpoints and restores are taken there). Closures queue up
        meanwhile. Raises TimeoutError (and resumes) when closures still run after
        ``timeout`` seconds. Nests; safe from any thread but the dispatch thread."""
        self._call(self._hold())
        try:
            self._call(self._wait_drained(), timeout)
        except BaseException:
            self._call(self._release())
            raise
        try:
            yield
        finally:
            self._call(self._release())

    def _wake(self) -> None:
        if not self._stopped and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._assign)
            except RuntimeError:  # the loop closed meanwhile
                pass

    def _call(self, coroutine: Coroutine[Any, Any, _T], timeout: float | None = None) -> _T:
        if threading.current_thread() is self._thread:
            raise RuntimeError("a DispatchLoop method was called from its own thread")
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise

    # ---------------------------------------------------------------- on the loop

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        finally:
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.close()

    async def _add(self, address: str, probe_first: bool = False) -> Dispatcher:
        if self._stopped:
            raise RuntimeError("the coordinator is shut down; it cannot add workers")
        if address in self._dispatchers:
            raise ValueError(f"worker {address} is already part of the cluster")
        used = {d.index for d in self._dispatchers.values()}
        index = next(i for i in range(len(used) + 1) if i not in used)
        dispatcher = Dispatcher(
            address,
            index,
            queue=self._queue,
            specs=self._specs,
            transport=self._transport_factory(address),
            cluster_context=self._cluster_context,
            num_workers=self.num_workers,
            policy=self._policy,
            max_value_age=self._max_value_age,
            overlap_pushes=self._overlap_pushes,
            sizer=self._sizer,
            observer=self._observer,
            server_failed=self._server_failed if self._on_server_failure is not None else None,
            probe_first=probe_first,
        )
        self._dispatchers[address] = dispatcher
        log.info("worker %d (%s) joined%s", index, address, " (probed first)" if probe_first else "")
        if dispatcher.state is WorkerState.DOWN:
            self._start(dispatcher, self._probe(dispatcher))
        else:
            self._free.append(dispatcher)
            self._assign()
        return dispatcher

    async def _remove(self, address: str) -> None:
        dispatcher = self._dispatchers.pop(address, None)
        if dispatcher is None:
            raise KeyError(f"worker {address} is not part of the cluster")
        await self._retire(dispatcher, "removed from the cluster")
        self._observer.worker_state(address, None)
        log.info("worker %d (%s) left", dispatcher.index, address)
        self._assign()

    async def _retire(self, dispatcher: Dispatcher, reason: str) -> None:
        if dispatcher in self._free:
            self._free.remove(dispatcher)
        task = self._tasks.pop(dispatcher.address, None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        dispatcher.stop(reason)
        await dispatcher._transport.close()

    async def _stop_all(self) -> None:
        for dispatcher in list(self._dispatchers.values()):
            await self._retire(dispatcher, "the coordinator stops")

    async def _hold(self) -> None:
        self._holds += 1

    def _server_failed(self, server: str) -> None:
        """A closure saw parameter server ``server`` fail (on the loop): no batch starts until
        its recovery releases the hold, so closures put back do not spend their waits on a
        server that is still down."""
        if not self._server_hold:
            self._server_hold = True
            self._holds += 1
        assert self._on_server_failure is not None
        self._on_server_failure(server)

    async def _release_server_hold(self) -> None:
        if self._server_hold:
            self._server_hold = False
            await self._release()

    async def _release(self) -> None:
        self._holds -= 1
        self._assign()

    async def _wait_drained(self) -> None:
        if self._drained is None:
            self._drained = asyncio.Event()
        if not self._running:
            self._drained.set()
        await self._drained.wait()

    def _assign(self) -> None:
        """Gives free workers batches while closures are queued (unless paused)."""
        while self._free and not self._stopped and not self._holds:
            queued = self._queue.num_queued
            if queued == 0:
                return
            dispatcher = self._free.popleft()
            batch = self._queue.take(dispatcher.address, self._sizer.size(queued, len(self._dispatchers)))
            if not batch:
                self._free.appendleft(dispatcher)
                return
            self._start(dispatcher, dispatcher.run(batch), carries_closures=True)

    def _start(self, dispatcher: Dispatcher, work: Coroutine[Any, Any, Any], *, carries_closures: bool = False) -> None:
        task = self._loop.create_task(work)
        self._tasks[dispatcher.address] = task
        if carries_closures:
            self._running.add(task)
            if self._drained is not None:
                self._drained.clear()
        task.add_done_callback(lambda done: self._finished(dispatcher, done))

    def _finished(self, dispatcher: Dispatcher, task: asyncio.Task[Any]) -> None:
        if self._tasks.get(dispatcher.address) is task:
            del self._tasks[dispatcher.address]
        self._running.discard(task)
        if not self._running and self._drained is not None:
            self._drained.set()
        if task.cancelled() or self._stopped or dispatcher.address not in self._dispatchers:
            return
        if task.exception() is not None:
            log.error(
                "dispatcher of worker %d (%s) crashed", dispatcher.index, dispatcher.address, exc_info=task.exception()
            )
            return
        if dispatcher.state is WorkerState.DOWN:
            self._start(dispatcher, self._probe(dispatcher))
            return
        if dispatcher.state is WorkerState.UP:
            self._free.append(dispatcher)
            self._assign()

    async def _probe(self, dispatcher: Dispatcher) -> None:
        if not await dispatcher.probe():
            dispatcher.stop("it did not come back")
