"""The worker's core: runs closures sent by the coordinator. Imports no grpc itself.

One closure runs at a time (a worker is one device). A closure's distributed
parameters are worker-wide ``nn.Parameter`` objects on the worker's device, filled
from the parameter servers before each step and lazily after each ``optimizer.step()``;
its gradients are pushed with idempotency keys derived from the closure id,
so a retried closure never updates a variable twice (``worker.closure_access``). How
values cross between the client's host tensors and a GPU is ``worker.transfers``; how
a closure's result or error travels back is ``worker.results``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import cloudpickle
import torch

from paramserve.psserver.protocol.errors import InvalidRequestError
from paramserve.psserver.protocol.types import ClusterContext
from paramserve.psserver.runtime.devices import CPU, computing_on
from paramserve.worker.closure_access import ClientFactory, ClosureAccess, LocalVariables, VariableClient
from paramserve.worker.closure_pickling import loads_closure
from paramserve.worker.dense.group import DenseReplicas, DenseRound
from paramserve.worker.layers import using_access
from paramserve.worker.pipeline import PushPipeline
from paramserve.worker.resources import (
    ResourceMissingError,
    WorkerContext,
    collecting_missing,
    using_resources,
    using_worker_context,
)
from paramserve.worker.results import ClosureCancelled, ClosureFailure, GroupFailed, closure_failure, dumps_value
from paramserve.worker.row_cache import CacheUse
from paramserve.worker.transfers import transfers_for

log = logging.getLogger(__name__)

_MAX_CANCELLED_IDS = 4096
"""Cancelled closure ids remembered (a cancel may arrive before its closure: the closure is
then refused when it comes). Older ids are forgotten: the coordinator never resends a closure
it cancelled, so only one still in transit matters."""

_MAX_PS_CLIENTS = 4
"""Clients kept for distinct parameter-server address lists (a cluster whose servers
moved gets a new list; the oldest client is closed)."""


# ---------------------------------------------------------------- requests and outcomes


@dataclass(frozen=True)
class ResourceSpec:
    resource_id: str
    payload: bytes
    """cloudpickle of ``fn(ctx: WorkerContext) -> object``."""


@dataclass(frozen=True)
class ClosureRequest:
    closure_id: str
    payload: bytes
    """cloudpickle (closure_pickling.dumps_closure) of (function, args, kwargs)."""
    attempt: int = 0
    function_name: str = ""
    resources: tuple[ResourceSpec, ...] = ()
    cluster: ClusterContext | None = None
    """Where the variables live; None: not sent, the worker uses the one it holds under
    ``cluster_fingerprint`` (the coordinator sends a context once per worker and change)."""
    steps: int = 1
    """0 means 1."""
    worker_index: int = 0
    num_workers: int = 1
    cluster_fingerprint: str = ""
    max_value_age: float = 0.0
    """The first step may start from the values this worker's last push returned if they are at
    most this many seconds old (within a closure, each step starts from the previous step's)."""
    read_generation: int = 0
    """Values read back by an earlier closure of a lower generation are not reused (the
    coordinator's join() and fetch() start a new one: reads after them see what finished)."""
    overlap_pushes: bool = False
    """A step's push stays in flight while the next step of this batch computes (worker.pipeline)."""
    max_row_staleness: int = 0
    """Rows read at most this many of the worker's steps ago are served from its row cache."""


@dataclass(frozen=True)
class ClosureOutcome:
    """Exactly one of ``result`` (cloudpickle of the last return value) and ``error`` is set."""

    result: bytes | None
    error: ClosureFailure | None
    worker_incarnation: str
    resources_held: tuple[str, ...]
    pushes_applied: int
    pushes_duplicate: int
    seconds: float
    device: str = ""
    """Where the closure computed ("cpu", "cuda:0")."""
    cache_use: CacheUse = field(default_factory=CacheUse)
    """Rows its lookups took from the worker's row cache and from the servers."""


@dataclass(frozen=True)
class RoundOutcome:
    """A worker's part of a hybrid-training round (``WorkerCore.run_round``)."""

    outcomes: list[ClosureOutcome]
    dense_state: bytes = b""
    """The dense state, when the round asked to read it."""
    group_failed: bool = False
    """The dense group broke during the round: the coordinator forms it anew."""


@dataclass(frozen=True)
class WorkerInfo:
    incarnation: str
    pid: int
    resources_held: tuple[str, ...]
    closures_run: int
    """RunClosure requests handled, whatever their outcome."""


class ClosureObserver(Protocol):
    """Told about every closure run (the server's metrics implement it)."""

    def on_closure(self, request: ClosureRequest, outcome: ClosureOutcome) -> None: ...


# ---------------------------------------------------------------- the core


class WorkerCore:
    """Runs closures one at a time and keeps this worker's resources and parameters.

    ``client_factory`` makes the client of a cluster's parameter servers (the server
    passes one building ParameterServerClient; unit tests pass an in-memory fake).
    ``device``: where closures compute (the CPU, or a CUDA GPU: ``paramserve worker --device``).
    ``token``: the cluster's, which hybrid training's rendezvous store asks members to prove.
    Raises ValueError for another kind of device.
    """

    def __init__(
        self,
        client_factory: ClientFactory,
        observer: ClosureObserver | None = None,
        device: torch.device = CPU,
        token: str | None = None,
    ):
        self._client_factory = client_factory
        self.incarnation = uuid.uuid4().hex
        self._observer = observer
        # One closure at a time (a worker is one device); bookkeeping has its own lock
        # so that GetInfo answers while a long closure runs.
        self._run_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._resources: dict[str, object] = {}
        self._variables = LocalVariables(transfers_for(device))
        self._dense = DenseReplicas(self._variables, token)
        self._clients: OrderedDict[tuple[tuple[str, ...], float], VariableClient] = OrderedDict()
        self._closures_run = 0
        self._cluster = ClusterContext()
        self._cluster_fingerprint = ""
        self._cancelled: OrderedDict[str, None] = OrderedDict()  # under _state_lock
        self._batch: frozenset[str] = frozenset()  # ids of the batch running (under _state_lock)
        self._group_broken = False  # the dense group broke in the round that ran last

    def cancel(self, closure_ids: Sequence[str]) -> int:
        """Cancels closures: each stops before its next push or step (and one not started yet
        does not start), and is answered as cancelled. Returns how many of them the batch
        running now holds. Does not wait for the run lock: it is called while closures run."""
        with self._state_lock:
            for closure_id in closure_ids:
                self._cancelled[closure_id] = None
                self._cancelled.move_to_end(closure_id)
            while len(self._cancelled) > _MAX_CANCELLED_IDS:
                self._cancelled.popitem(last=False)
            running = sum(1 for closure_id in closure_ids if closure_id in self._batch)
        log.info("cancelled %d closures (%d in the batch running)", len(closure_ids), running)
        return running

    def _is_cancelled(self, closure_id: str) -> bool:
        with self._state_lock:
            return closure_id in self._cancelled

    def run_closures(self, requests: Sequence[ClosureRequest]) -> list[ClosureOutcome]:
        """Runs closures in order; stops after the first that does not succeed (the rest are not
        run: a user error cancels what was queued after it, and a closure that needs something
        resent is retried with it). Raises InvalidRequestError, before running any, for a
        malformed request.

        Closures that ask for ``overlap_pushes`` leave each push in flight while the next step
        computes, and closures with ``max_row_staleness`` >= 1 hold it for the next step's lookup
        (worker.pipeline); the last is settled before this returns, and a push that failed is
        its closure's error (the closures after it are not run)."""
        for request in requests:
            _validate(request)
        with self._run_lock:
            return self._run_batch(requests, None)

    def run_round(self, requests: Sequence[ClosureRequest], dense: DenseRound) -> RoundOutcome:
        """This worker's part of a hybrid-training round (worker.dense_group): joins the round's
        group (forming it when new), runs ``requests`` as ``run_closures`` does, their steps'
        dense gradients averaged with the other members', then takes part in the others' steps
        until every member is done. Every member of the group gets a call each round, with
        closures or none. A broken group fails the closures not done with ``group_failed`` (they
        run again). ``dense.read_state``: answers with the dense state, runs nothing."""
        for request in requests:
            _validate(request)
        with self._run_lock:
            if dense.read_state:
                return RoundOutcome([], dense_state=self._dense.state_of_epoch(dense.state_epoch))
            try:
                self._dense.begin_round(dense)
            except GroupFailed as exc:
                log.warning("dense round not started: %s", exc)
                failed = [self._group_failure(requests[0], exc)] if requests else []
                return RoundOutcome(failed, group_failed=True)
            outcomes = self._run_batch(requests, self._dense)
            return RoundOutcome(outcomes, group_failed=self._group_broken)

    def _group_failure(self, request: ClosureRequest, exc: GroupFailed) -> ClosureOutcome:
        return ClosureOutcome(
            result=None,
            error=closure_failure(exc),
            worker_incarnation=self.incarnation,
            resources_held=self._held(),
            pushes_applied=0,
            pushes_duplicate=0,
            seconds=0.0,
            device=str(self._variables.device),
        )

    def _run_batch(self, requests: Sequence[ClosureRequest], dense: DenseReplicas | None) -> list[ClosureOutcome]:
        """run_closures' work, under the run lock; with ``dense``, a round's (ending with
        DenseReplicas.finish_round, whatever happened before)."""
        pipeline = PushPipeline()
        runs: list[tuple[ClosureRequest, ClosureOutcome, ClosureAccess | None]] = []
        owner: int | None = None  # the run whose last dense step is still in flight
        with self._state_lock:
            self._batch = frozenset(request.closure_id for request in requests)
        try:
            for request in requests:
                uses_pipeline = request.overlap_pushes or request.max_row_staleness > 0
                outcome, access = self._run(request, pipeline if uses_pipeline else None, dense)
                if owner is not None and outcome.error is not None and outcome.error.group_failed:
                    runs = _fail_in_flight(runs, owner, outcome.error)  # its step may be what failed
                    break
                runs.append((request, outcome, access))
                if outcome.error is not None or pipeline.failure is not None:
                    break
                owner = len(runs) - 1 if dense is not None and dense.pending else None
            pipeline.settle_quietly()
        finally:
            pipeline.abandon()  # only where something above raised
            self._variables.stop_awaiting()  # a deferred push's values that never came are stale
            with self._state_lock:
                self._batch = frozenset()
            if dense is not None:
                runs = self._finish_round(dense, runs, owner)
        if pipeline.failure is not None:
            runs = blame_failed_push(runs, pipeline.failure)
        outcomes = [_counted(outcome, access) for _, outcome, access in runs]
        for (request, _, access), outcome in zip(runs, outcomes):
            if access is not None:  # not a request answered with needs_cluster (logged already)
                self._finished(request, outcome)
        return outcomes

    def _finish_round(
        self,
        dense: DenseReplicas,
        runs: list[tuple[ClosureRequest, ClosureOutcome, ClosureAccess | None]],
        owner: int | None,
    ) -> list[tuple[ClosureRequest, ClosureOutcome, ClosureAccess | None]]:
        """Takes part in the round until every member is done (DenseReplicas.finish_round); when
        the group breaks there, the closure whose dense step was in flight runs again."""
        self._group_broken = False
        try:
            dense.finish_round()
        except GroupFailed as exc:
            log.warning("dense round not finished: %s", exc)
            self._group_broken = True
            if owner is not None and owner < len(runs) and runs[owner][1].error is None:
                return _fail_in_flight(runs, owner, closure_failure(exc))
        return runs

    def run_closure(self, request: ClosureRequest) -> ClosureOutcome:
        """Runs ``request``'s function ``steps`` times and returns the last result or the error.

        Errors of the user's code (and of the parameter servers it reaches) come
        back in the outcome; only a malformed request raises (InvalidRequestError).
        """
        return self.run_closures([request])[0]

    def _run(
        self, request: ClosureRequest, pipeline: PushPipeline | None, dense: DenseReplicas | None = None
    ) -> tuple[ClosureOutcome, ClosureAccess | None]:
        """One closure, under the run lock; its last push may still be in ``pipeline``."""
        start = time.perf_counter()
        cluster = self._cluster_for(request)
        if cluster is None:
            return self._needs_cluster(request), None
        cancelled = functools.partial(self._is_cancelled, request.closure_id)
        access = ClosureAccess(
            self._variables,
            self._client_for(cluster),
            request.closure_id,
            pipeline,
            cancelled,
            dense,
            max_row_staleness=request.max_row_staleness,
            overlap_pushes=request.overlap_pushes,
        )
        result, error = self._execute(request, access, cancelled)
        outcome = ClosureOutcome(
            result=result,
            error=error,
            worker_incarnation=self.incarnation,
            resources_held=self._held(),
            pushes_applied=access.pushes_applied,
            pushes_duplicate=access.pushes_duplicate,
            seconds=time.perf_counter() - start,
            device=str(self._variables.device),
            cache_use=access.cache_use,
        )
        return outcome, access

    def _finished(self, request: ClosureRequest, outcome: ClosureOutcome) -> None:
        with self._state_lock:
            self._closures_run += 1
        _log_outcome(request, outcome)
        if self._observer is not None:
            self._observer.on_closure(request, outcome)

    def info(self) -> WorkerInfo:
        held = self._held()
        with self._state_lock:
            return WorkerInfo(self.incarnation, os.getpid(), held, self._closures_run)

    def close(self) -> None:
        """Closes the parameter-server clients (and their threads)."""
        with self._run_lock:
            clients, self._clients = list(self._clients.values()), OrderedDict()
            self._dense.close()
        for client in clients:
            client.close()

    def _execute(
        self, request: ClosureRequest, access: ClosureAccess, cancelled: Callable[[], bool]
    ) -> tuple[bytes | None, ClosureFailure | None]:
        context = WorkerContext.for_worker(
            request.worker_index, request.num_workers, self.incarnation, device=self._variables.device
        )
        # Gradients left by an earlier (perhaps failed) closure must not leak into this one.
        self._variables.clear_grads()
        try:
            with (
                using_access(access),
                using_resources(self._resources),
                using_worker_context(context),
                computing_on(self._variables.device),
            ):
                self._create_resources(request.resources, context)
                fn, args, kwargs = _load(request.payload, access)
                result = None
                reuse_first = self._variables.returned_within(
                    request.max_value_age, time.monotonic(), request.read_generation
                )
                self._variables.read_generation = request.read_generation
                for step in range(max(1, request.steps)):
                    if cancelled():
                        raise ClosureCancelled(
                            f"closure {request.closure_id} was cancelled by the coordinator before step {step + 1}"
                        )
                    # A step starts from what the previous step's pushes returned (read as it
                    # ended), and pulls everything else it uses.
                    access.begin_step()  # what a deferred push read back is installed first
                    self._variables.begin_step(keep_returned=step > 0 or reuse_first)
                    access.refresh_used()
                    result = fn(*args, **kwargs)
            return dumps_value(result), None
        # SystemExit too: a closure calling sys.exit() must not take the RPC thread down with it.
        except (Exception, SystemExit) as exc:
            return None, closure_failure(exc)

    def _create_resources(self, specs: Sequence[ResourceSpec], context: WorkerContext) -> None:
        for spec in specs:
            if spec.resource_id in self._resources:
                continue
            create = _load_resource_function(spec)
            resource = create(context)
            with self._state_lock:
                self._resources[spec.resource_id] = resource
            log.info("created resource %s", spec.resource_id)

    def _cluster_for(self, request: ClosureRequest) -> ClusterContext | None:
        """The context a request runs in: the one it carries (kept for later requests), the one
        held under its fingerprint, or None when this worker does not hold it."""
        if request.cluster is not None:
            fingerprint = request.cluster_fingerprint or request.cluster.fingerprint
            if fingerprint != self._cluster_fingerprint:
                self._variables.forget_returned()  # values of another layout or generation
                self._variables.row_cache.clear()
            self._cluster, self._cluster_fingerprint = request.cluster, fingerprint
            return request.cluster
        if not request.cluster_fingerprint:
            return ClusterContext()  # a closure that uses no variables
        return self._cluster if request.cluster_fingerprint == self._cluster_fingerprint else None

    def _needs_cluster(self, request: ClosureRequest) -> ClosureOutcome:
        failure = ClosureFailure(
            type="ClusterContextMissing",
            message=f"this worker does not hold cluster context {request.cluster_fingerprint}: resend it",
            needs_cluster=True,
        )
        outcome = ClosureOutcome(None, failure, self.incarnation, self._held(), 0, 0, 0.0)
        _log_outcome(request, outcome)
        return outcome

    def _client_for(self, cluster: ClusterContext) -> VariableClient | None:
        addresses = tuple(cluster.parameter_servers)
        if not addresses:
            return None
        key = (addresses, cluster.failover_seconds)
        client = self._clients.get(key)
        if client is None:
            client = self._client_factory(addresses, cluster.failover_seconds)
            self._clients[key] = client
            while len(self._clients) > _MAX_PS_CLIENTS:
                _, oldest = self._clients.popitem(last=False)
                oldest.close()
        self._clients.move_to_end(key)
        client.adopt_layouts(cluster.layouts)
        return client

    def _held(self) -> tuple[str, ...]:
        with self._state_lock:
            return tuple(sorted(self._resources))


def _fail_in_flight(
    runs: list[tuple[ClosureRequest, ClosureOutcome, ClosureAccess | None]], owner: int, failure: ClosureFailure
) -> list[tuple[ClosureRequest, ClosureOutcome, ClosureAccess | None]]:
    """The runs up to ``owner``, whose dense step was in flight when the group broke: it failed
    with the group (its step may not be applied; run again, it is applied once), and the runs
    after it go back to the queue with it."""
    request, outcome, access = runs[owner]
    message = f"its last dense step was in flight when the group broke: {failure.message}"
    failed = ClosureFailure(type=failure.type, message=message, group_failed=True)
    return [*runs[:owner], (request, dataclasses.replace(outcome, result=None, error=failed), access)]


def blame_failed_push(
    runs: list[tuple[ClosureRequest, ClosureOutcome, ClosureAccess | None]], failure: tuple[object, BaseException]
) -> list[tuple[ClosureRequest, ClosureOutcome, ClosureAccess | None]]:
    """The runs up to the closure whose push failed, that closure with the push's error (or
    its own, when it failed already): the closures after it did not run as far as the
    coordinator knows (one stopped at its own push). A pure decision, unit-tested."""
    owner, error = failure
    for position, (request, outcome, access) in enumerate(runs):
        if access is owner:
            failed = (
                outcome
                if outcome.error is not None
                else dataclasses.replace(outcome, result=None, error=closure_failure(error))
            )
            return [*runs[:position], (request, failed, access)]
    return runs  # its closure went back to the queue already (a dense group broke before it)


def _counted(outcome: ClosureOutcome, access: ClosureAccess | None) -> ClosureOutcome:
    """``outcome`` with its closure's pushes counted once all of them are settled."""
    if access is None or (outcome.pushes_applied, outcome.pushes_duplicate) == (
        access.pushes_applied,
        access.pushes_duplicate,
    ):
        return outcome
    return dataclasses.replace(outcome, pushes_applied=access.pushes_applied, pushes_duplicate=access.pushes_duplicate)


def _validate(request: ClosureRequest) -> None:
    if not request.closure_id:
        # Push keys derive from it: without one, two closures' pushes would collide.
        raise InvalidRequestError("RunClosure needs a closure_id (it keys the closure's pushes)")
    if not request.payload:
        raise InvalidRequestError(f"closure {request.closure_id!r} has an empty payload")
    if request.steps < 0:
        raise InvalidRequestError(f"steps must be >= 0 (0 means 1), got {request.steps}")
    if request.read_generation < 0:
        raise InvalidRequestError(f"read_generation must be >= 0, got {request.read_generation}")
    if request.max_row_staleness < 0:
        raise InvalidRequestError(f"max_row_staleness must be >= 0 steps, got {request.max_row_staleness}")
    if not request.max_value_age >= 0:  # NaN too
        raise InvalidRequestError(f"max_value_age must be >= 0 seconds, got {request.max_value_age}")
    if request.worker_index < 0 or request.num_workers < 0:
        raise InvalidRequestError(
            f"worker_index and num_workers must be >= 0, got {request.worker_index} and {request.num_workers}"
        )
    for spec in request.resources:
        if not spec.resource_id or not spec.payload:
            raise InvalidRequestError("every resource needs a resource_id and a payload")


def _load(payload: bytes, access: ClosureAccess) -> tuple[Any, tuple, dict]:
    """Unpickles (fn, args, kwargs); raises ResourceMissingError naming every missing resource."""
    with collecting_missing() as missing:
        try:
            fn, args, kwargs = loads_closure(payload, access)
        except Exception:
            if missing:  # the failure may just be a placeholder meeting code that expected the resource
                raise ResourceMissingError(*missing) from None
            raise
    if missing:
        raise ResourceMissingError(*missing)
    return fn, tuple(args), dict(kwargs)


def _load_resource_function(spec: ResourceSpec) -> Any:
    with collecting_missing() as missing:
        create = cloudpickle.loads(spec.payload)
    if missing:
        raise ResourceMissingError(*missing)
    return create


def _log_outcome(request: ClosureRequest, outcome: ClosureOutcome) -> None:
    name = request.function_name or "closure"
    if outcome.error is None:
        log.debug(
            "closure %s (%s, attempt %d) done in %.3fs", request.closure_id, name, request.attempt, outcome.seconds
        )
    elif outcome.error.missing_resources:
        log.info(
            "closure %s (%s): missing resources %s", request.closure_id, name, list(outcome.error.missing_resources)
        )
    elif outcome.error.needs_cluster:
        log.info("closure %s (%s): asks for the cluster context", request.closure_id, name)
    else:
        log.info(
            "closure %s (%s, attempt %d) failed: %s: %s",
            request.closure_id,
            name,
            request.attempt,
            outcome.error.type,
            outcome.error.message,
        )
