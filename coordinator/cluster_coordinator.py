"""ClusterCoordinator: schedules closures on the workers of a parameter-server cluster.

Behaves like TF's ``tf.distribute.experimental.coordinator.ClusterCoordinator``:
``schedule`` returns a RemoteValue at once; closures run asynchronously on
whichever worker is free; a closure whose worker fails is retried on another
one; an error of the user's code is raised by the next ``schedule``,
``join`` or ``done`` (and by that closure's ``fetch``), after the queued
closures are cancelled. Threads: one, ``paramserve-dispatch``, running every
worker's dispatcher on an event loop (``coordinator.dispatch_loop``), however many
workers there are; with a worker service in the cluster, ``paramserve-discovery``
resolving it (``coordinator.discovery``). Metrics: ``coordinator.telemetry``, served over
HTTP with ``metrics_port``; with ``status_port``, a status page (``coordinator.status_page``)
and its threads.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

from paramserve.coordinator import nest
from paramserve.coordinator.checkpointing.checkpoint_log import CheckpointRecord
from paramserve.coordinator.cluster_resolver import Resolver, resolve_dns
from paramserve.coordinator.contracts import CoordinatedStrategy
from paramserve.coordinator.dispatch.batching import BATCH_SECONDS
from paramserve.coordinator.dispatch.closures import Closure, ClosureQueue, find_resource_ids
from paramserve.coordinator.dispatch.dense_rounds import DenseRounds, default_rendezvous_host
from paramserve.coordinator.dispatch.discovery import DiscoveryPolicy, WorkerDiscovery
from paramserve.coordinator.dispatch.dispatch_loop import DispatchLoop
from paramserve.coordinator.dispatch.dispatcher import ResourceSpecs, WireContext
from paramserve.coordinator.dispatch.failures import FailurePolicy
from paramserve.coordinator.dispatch.worker_transport import GrpcTransport, WorkerTransport
from paramserve.coordinator.errors import CoordinatorClosedError
from paramserve.coordinator.recovery.ps_recovery import ParameterServerRecovery, RecoverableVariables
from paramserve.coordinator.recovery.recovery_policy import RecoveryPolicy
from paramserve.coordinator.remote_value import RemoteValue, fetch_structure
from paramserve.coordinator.status.cluster_status import status_key
from paramserve.coordinator.status.status_page import ServerProber, StatusPage, StatusSources, check_status_exposure
from paramserve.coordinator.status.telemetry import CoordinatorTelemetry, register_queue_gauges
from paramserve.psserver.protocol import convert
from paramserve.psserver.protocol.errors import ConfigurationError
from paramserve.psserver.protocol.types import ClusterContext
from paramserve.psserver.runtime.security import ClientTls, unauthenticated_workers
from paramserve.worker.closure_pickling import dumps_closure
from paramserve.worker.resources import PerWorkerResource, WorkerContext

__all__ = [
    "ClusterCoordinator",
    "CoordinatorConfig",
    "PerWorkerDataset",
    "PerWorkerDatasetIterator",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CoordinatorConfig:
    """How a ClusterCoordinator behaves (times in seconds)."""

    policy: FailurePolicy = field(default_factory=FailurePolicy)
    max_queued: int = 4096
    """Closures waiting for a worker; schedule() blocks beyond that."""
    schedule_timeout: float | None = 600.0
    """How long schedule() waits for room in a full queue before TimeoutError; None: forever."""
    log_interval: float = 30.0
    """join() logs what it waits for this often."""
    max_message_bytes: int = 64 << 20
    shutdown_timeout: float = 10.0
    max_batch: int = 16
    """Queued closures one RunClosures call may carry to a worker (each keeps its own id,
    retries and RemoteValue; batching saves round trips when closures queue up)."""
    batch_seconds: float = BATCH_SECONDS
    """A batch lasts about this long at the closures' recent duration (batching.BatchSizer):
    short closures travel several to a call, long ones one by one."""
    insecure: bool = False
    """Accept pickled results from workers beyond loopback that nothing authenticates (no token
    to sign replies, no TLS to verify the worker): refused unless set."""
    recovery: RecoveryPolicy = field(default_factory=RecoveryPolicy)
    """How failed parameter servers are recovered (coordinator.ps_recovery)."""
    discovery: DiscoveryPolicy = field(default_factory=DiscoveryPolicy)
    """How often a worker service is resolved, and how long a worker missing from it stays."""


def _check_workers_authenticate(
    workers: Sequence[str], *, token: str | None, tls: ClientTls | None, insecure: bool
) -> None:
    """Raises ConfigurationError when a worker's replies, which the coordinator unpickles,
    would come from a process nothing authenticates (unless ``insecure``)."""
    exposed = unauthenticated_workers(workers, token=token, tls=tls)
    if exposed and not insecure:
        raise ConfigurationError(
            f"workers {', '.join(exposed)} are beyond this machine, and with neither a token nor TLS nothing "
            "shows that a reply comes from them (the coordinator unpickles replies): set the cluster's token "
            "(PARAMSERVE_TOKEN or token=), or TLS (ClientConfig(tls_root_certificates=...)), or "
            "CoordinatorConfig(insecure=True) to accept the risk"
        )
    if exposed:
        log.warning("WARNING: accepting unauthenticated pickled replies from %s (insecure=True)", ", ".join(exposed))


def _latest_checkpoint_of(recoverable: RecoverableVariables | None) -> Callable[[], CheckpointRecord | None]:
    """What telemetry reads as the newest checkpoint (nothing without recoverable variables)."""
    if recoverable is None:
        return lambda: None
    checkpoints = recoverable.checkpoints
    return lambda: checkpoints.latest


def _status_page(
    queue: ClosureQueue,
    telemetry: CoordinatorTelemetry,
    recoverable: RecoverableVariables | None,
    strategy: CoordinatedStrategy,
) -> StatusPage:
    """The coordinator's status page, reading the queue, the telemetry and the servers (never
    the coordinator itself: see the finalizer)."""
    client = recoverable.client if recoverable is not None else None
    sources = StatusSources(
        run=telemetry.run,
        queued=lambda: queue.num_queued,
        running=queue.in_flight_by_worker,
        in_flight=lambda: queue.num_in_flight,
        checkpoint=_latest_checkpoint_of(recoverable),
        parameter_servers=tuple(strategy.cluster.parameter_servers),
        probe_servers=(
            ServerProber(client, addresses=strategy.cluster.parameter_servers) if client is not None else None
        ),
    )
    return StatusPage(sources, key=status_key(strategy.token) if strategy.token else None)


def _stop_dispatch(runtime: _Runtime, timeout: float) -> int:
    """Stops the status page, recovering servers and discovering workers, closes the queue
    (cancelling what waits), stops the dispatch thread and the metrics endpoint; returns how
    many queued closures were cancelled."""
    if runtime.status is not None and not runtime.status.stop(timeout):
        log.error("the status page's threads still run after %ss", timeout)
    if runtime.recovery is not None:
        runtime.recovery.stop(timeout)
    if runtime.discovery is not None and not runtime.discovery.stop(timeout):
        log.error("the discovery thread still runs after %ss", timeout)
    cancelled = runtime.queue.close(CoordinatorClosedError("the ClusterCoordinator was shut down"))
    if not runtime.dispatch_loop.stop(timeout):
        log.error("the dispatch thread still runs after %ss", timeout)
    runtime.telemetry.close()
    return cancelled


def _dense_rounds(strategy: CoordinatedStrategy, telemetry: CoordinatorTelemetry) -> DenseRounds | None:
    """Hybrid training's rounds, when the strategy replicates its dense variables (sync_dense)."""
    sync_dense = strategy.sync_dense
    if sync_dense is None:
        return None
    host = sync_dense.rendezvous_host or default_rendezvous_host(strategy.cluster.workers)
    return DenseRounds(
        sync_dense.settings,
        sync_dense.initial_state,
        rendezvous_host=host,
        timeout=sync_dense.timeout,
        observer=telemetry,
        token=strategy.token,
    )


@dataclass(frozen=True)
class _Runtime:
    """What a ClusterCoordinator runs on, each part given the others it needs when it is built
    (``build``). It holds the queue, the loop and the strategy's parts, never the coordinator,
    so the coordinator's finalizer may hold it."""

    telemetry: CoordinatorTelemetry
    queue: ClosureQueue
    specs: ResourceSpecs
    context: _ContextSource
    recovery: ParameterServerRecovery | None
    """Recovers failed parameter servers (None: recovery is off, or the strategy has none)."""
    dense: DenseRounds | None
    dispatch_loop: DispatchLoop
    discovery: WorkerDiscovery | None
    status: StatusPage | None

    @classmethod
    def build(
        cls,
        strategy: CoordinatedStrategy,
        config: CoordinatorConfig,
        recoverable: RecoverableVariables | None,
        *,
        transport_factory: Callable[[str], WorkerTransport] | None,
        resolver: Resolver,
        status_page: bool,
    ) -> _Runtime:
        """The runtime of a coordinator for ``strategy``; starts the dispatch thread (its loop
        waits for workers: ``ClusterCoordinator`` adds them), nothing else."""
        telemetry = CoordinatorTelemetry.build(checkpoint=_latest_checkpoint_of(recoverable))
        queue = ClosureQueue(config.max_queued, observer=telemetry)
        register_queue_gauges(
            telemetry.registry, queue_depth=lambda: queue.num_queued, in_flight=lambda: queue.num_in_flight
        )
        recovery = None
        if config.recovery.enabled and recoverable is not None:
            recovery = ParameterServerRecovery(recoverable, queue=queue, policy=config.recovery, observer=telemetry)
        dense = _dense_rounds(strategy, telemetry)
        specs, context = ResourceSpecs(), _ContextSource(strategy.cluster_context)
        token, tls, max_bytes = strategy.token, strategy.tls, config.max_message_bytes
        dispatch_loop = DispatchLoop(
            queue=queue,
            specs=specs,
            policy=config.policy,
            transport_factory=transport_factory or (lambda address: GrpcTransport(address, token, max_bytes, tls)),
            cluster_context=context,
            max_value_age=strategy.max_value_age,
            overlap_pushes=strategy.overlap_pushes,
            max_row_staleness=strategy.max_row_staleness,
            max_batch=config.max_batch,
            batch_seconds=config.batch_seconds,
            on_server_failure=recovery.report if recovery is not None else None,
            observer=telemetry,
            dense=dense,
        )
        service = strategy.cluster.worker_service
        discovery = None
        if service is not None:
            static = frozenset(strategy.cluster.workers)
            discovery = WorkerDiscovery(
                service, dispatch_loop, resolver=resolver, policy=config.discovery, static=static
            )
        status = _status_page(queue, telemetry, recoverable, strategy) if status_page else None
        return cls(telemetry, queue, specs, context, recovery, dense, dispatch_loop, discovery, status)


class ClusterCoordinator:
    """Schedules functions to run on the workers of ``strategy.cluster``.

    ``config`` tunes queue size, deadlines and the failure policy;
    ``transport_factory`` (address -> WorkerTransport) replaces gRPC in tests, and
    ``resolver`` (``"name:port"`` -> addresses) the DNS lookup of ``strategy.cluster.worker_service``.
    ``metrics_port`` serves ``telemetry`` (Prometheus) at ``http://metrics_host:port/metrics``
    (0: a free port, then ``metrics_port`` says which); ``metrics_host`` is loopback by default:
    pass ``"0.0.0.0"`` for a Prometheus on another machine (metrics carry addresses, not secrets).
    ``status_port`` serves the status page (``coordinator.status_page``: workers, parameter
    servers, live charts of the training and its events; 0: a free port) at ``status_url``, on
    ``status_host``: loopback by default; beyond it only with the cluster's token, whose derived
    key the page then asks for (ConfigurationError otherwise, naming the fix).
    Starts the dispatch thread; call ``shutdown()`` (or use it as a context manager) to stop it.
    """

    def __init__(
        self,
        strategy: CoordinatedStrategy,
        config: CoordinatorConfig | None = None,
        *,
        transport_factory: Callable[[str], WorkerTransport] | None = None,
        metrics_port: int | None = None,
        metrics_host: str = "127.0.0.1",
        resolver: Resolver = resolve_dns,
        status_port: int | None = None,
        status_host: str = "127.0.0.1",
    ):
        self.strategy = strategy
        self.config = config = config or CoordinatorConfig()
        self._closed = False
        self._lock = threading.Lock()
        _check_workers_authenticate(
            strategy.cluster.workers, token=strategy.token, tls=strategy.tls, insecure=config.insecure
        )
        if status_port is not None:
            check_status_exposure(status_host, strategy.token)
        recoverable = strategy.attach_coordinator(self)
        runtime = _Runtime.build(
            strategy,
            config,
            recoverable,
            transport_factory=transport_factory,
            resolver=resolver,
            status_page=status_port is not None,
        )
        self.telemetry = runtime.telemetry
        self.recovery = runtime.recovery
        """Recovers failed parameter servers (None: recovery is off, or the strategy has none)."""
        self._queue, self._specs, self._context = runtime.queue, runtime.specs, runtime.context
        self._dispatch_loop, self._discovery, self._status = runtime.dispatch_loop, runtime.discovery, runtime.status
        # Dropped without shutdown() (or alive at interpreter exit): the dispatch thread stops.
        # The callback holds the runtime, never the coordinator itself.
        self._runtime = runtime
        self._finalizer = weakref.finalize(self, _stop_dispatch, runtime, config.shutdown_timeout)
        self._start(metrics_host, metrics_port, status_host, status_port)

    def _start(self, metrics_host: str, metrics_port: int | None, status_host: str, status_port: int | None) -> None:
        """Connects the strategy's dense variables to the rounds, starts recovery, adds the
        workers (those of a worker service before the first schedule()), then serves the
        metrics and the status page."""
        runtime, sync_dense = self._runtime, self.strategy.sync_dense
        if runtime.dense is not None and sync_dense is not None:
            sync_dense.rounds.connect(runtime.dense, runtime.dispatch_loop.read_dense_state)
        if runtime.recovery is not None:
            runtime.recovery.start(runtime.dispatch_loop)
        for address in self.strategy.cluster.workers:
            runtime.dispatch_loop.add_worker(address)
        if runtime.discovery is not None:
            runtime.discovery.step()  # the workers running now join before the first schedule()
            runtime.discovery.start()
        if metrics_port is not None:
            runtime.telemetry.serve(metrics_host, metrics_port)
        if runtime.status is not None:
            try:
                runtime.status.start(status_host, status_port or 0)
            except BaseException:
                self.shutdown()
                raise

    # ---------------------------------------------------------------- scheduling

    def schedule(
        self,
        fn: Callable[..., Any],
        args: Iterable[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        *,
        steps: int = 1,
    ) -> RemoteValue[Any]:
        """Queues ``fn(*args, **kwargs)`` (run ``steps`` times) for some worker; returns at once.

        Raises TypeError when ``fn`` is not callable or something cannot be
        sent to a worker, ValueError for a bad ``steps`` or an unknown per-worker
        resource, the pending ClosureError of an earlier closure (TF semantics),
        TimeoutError when the queue stays full, CoordinatorClosedError after shutdown(),
        and at the first schedule the errors of creating the variables on the servers
        (VariableExistsError when they hold them from an earlier run).
        """
        closure = self._closure(fn, tuple(args), dict(kwargs or {}), steps)
        self._check_open()
        self._raise_pending_error()
        self._context()  # the variables exist (created now, on this thread, if new) or this raises
        if not self._queue.put(closure, self.config.schedule_timeout):
            # An earlier closure failed between the check above and the put: its error, never this
            # closure's own (which may fail the moment it is queued, and is then join()'s to raise).
            self._raise_pending_error()
        return closure.remote_value

    def join(self, timeout: float | None = None) -> None:
        """Waits until every scheduled closure finished.

        Raises the first error of a failed closure once nothing else runs, as TensorFlow
        does: the queued closures are cancelled when it happens, and the closures running on
        other workers are cancelled before it is raised (each stops before its next push or
        step; one that finishes first keeps its value), so no closure scheduled before the
        error pushes after it is raised. The error is raised once and forgotten, so training
        can go on. Raises TimeoutError after ``timeout`` seconds. Logs progress every
        ``log_interval``. On return every worker's next closure reads the variables afresh:
        what finished before join() is what closures scheduled after it see.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._queue.wait_idle(self._wait_slice(deadline)):
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(
                    f"join() timed out after {timeout:g}s: {self._queue.num_queued} closures queued, "
                    f"{self._queue.num_in_flight} in flight"
                )
            self._log_progress()
        self._raise_pending_error(deadline)
        self._queue.read_barrier()

    def done(self) -> bool:
        """True when nothing is queued or running; raises the pending error like join()."""
        self._raise_pending_error()
        return self._queue.idle()

    def fetch(self, structure: Any, timeout: float | None = None) -> Any:
        """``structure`` with each RemoteValue (and PerWorkerValues) replaced by its value. Like
        join(), a barrier for reads: closures scheduled after it see what finished before."""
        values = fetch_structure(structure, timeout)
        self._queue.read_barrier()
        return values

    # ---------------------------------------------------------------- per-worker resources

    def create_per_worker_resource(self, fn: Callable[..., Any]) -> PerWorkerResource:
        """A reference that resolves, inside closures on each worker, to that worker's ``fn(ctx)``.

        ``fn`` takes a WorkerContext (worker_index, num_workers, incarnation) or
        nothing. It runs on a worker when a closure first needs it there, and
        again after that worker restarts. Raises TypeError if fn cannot be sent.
        """
        return self._register(_call_with_context(fn), PerWorkerResource)

    def create_per_worker_dataset(self, dataset_fn: Callable[..., Iterable[Any]]) -> PerWorkerDataset:
        """A dataset created on each worker by ``dataset_fn(ctx)`` (shard it by
        ``ctx.worker_index`` / ``ctx.num_workers``); iterate it to get the iterator
        that closures take as an argument and call ``next()`` on. On a GPU worker the
        batches (tensors, in any nest of tuples, lists and dicts) reach the closures on its
        device, ``ctx.device``; ``dataset_fn`` builds them on the CPU as it would anywhere."""
        if not callable(dataset_fn):
            raise TypeError(f"create_per_worker_dataset needs a function, got {type(dataset_fn).__name__}")
        return PerWorkerDataset(self, dataset_fn)

    def _register(self, fn: Callable[[WorkerContext], Any], kind: type[PerWorkerResource]) -> Any:
        self._check_open()
        resource_id = uuid.uuid4().hex
        self._specs.add(resource_id, dumps_closure(fn))
        return kind(resource_id)

    # ---------------------------------------------------------------- membership

    def add_worker(self, address: str) -> None:
        """Adds the worker at ``address`` ("host:port") while training runs: it gets closures as
        soon as its health check says it serves (probed every ``FailurePolicy.join_probe_interval``
        until then). Raises ValueError for a worker that is part of the cluster already. Workers
        of a worker service (``ClusterSpec.worker_service``) join and leave by themselves."""
        self._check_open()
        _check_workers_authenticate(
            [address], token=self.strategy.token, tls=self.strategy.tls, insecure=self.config.insecure
        )
        self._dispatch_loop.add_worker(address, probe_first=True)

    def remove_worker(self, address: str, timeout: float | None = None) -> None:
        """Stops giving the worker at ``address`` closures; the ones it runs go back to the front
        of the queue under their ids (their pushes are applied once). Raises KeyError for a worker
        that is not part of the cluster."""
        self._check_open()
        self._dispatch_loop.remove_worker(address, timeout)

    # ---------------------------------------------------------------- lifecycle

    @property
    def num_workers(self) -> int:
        """Workers in the cluster now (listed ones, and those a worker service gave)."""
        return self._dispatch_loop.num_workers()

    @property
    def metrics_port(self) -> int | None:
        """The port of the metrics endpoint, None without one."""
        return self.telemetry.port

    @property
    def status_url(self) -> str | None:
        """The status page's address (with ``?key=`` when the cluster has a token), None without one."""
        return self._status.url if self._status is not None else None

    def report(self, step: int | None = None, *, loss: Any = None, samples: Any = None, **metrics: Any) -> None:
        """Tells the status page where training is: ``step`` (steps so far), ``loss``, ``samples``
        (examples trained so far: the page charts their rate) and any other ``metrics`` by name
        (at most 32). Each is a number (an int, a float, a one-element tensor); one left out
        keeps its last value. Cheap (no I/O): call it whenever a value is at hand, e.g. after
        fetching a closure's loss. ``fit`` calls it for you. Raises ValueError for a value that is
        not a number."""
        self.telemetry.report(step, loss=loss, samples=samples, **metrics)

    @property
    def closed(self) -> bool:
        """True after shutdown()."""
        return self._closed

    def shutdown(self) -> None:
        """Stops dispatching and waits for the dispatch thread; queued and running closures are
        cancelled. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._finalizer.detach()
        cancelled = _stop_dispatch(self._runtime, self.config.shutdown_timeout)
        log.info("coordinator shut down (%d queued closures cancelled)", cancelled)

    def paused(self, timeout: float | None = None) -> contextlib.AbstractContextManager[None]:
        """Inside, no closure runs on any worker: dispatch pauses and entering waits for the
        closures running to finish (see DispatchLoop.paused). For checkpoints and restores,
        which then see every finished closure's pushes whole."""
        return self._dispatch_loop.paused(timeout)

    def parameter_servers_settled(self, timeout: float | None = None) -> bool:
        """Waits until no parameter server is suspected or being recovered (at once without
        recovery); False when one still is after ``timeout`` seconds."""
        return self.recovery.settled(timeout) if self.recovery is not None else True

    def report_parameter_server(self, address: str) -> None:
        """Has the parameter server at ``address`` checked, and recovered if it was lost."""
        if self.recovery is not None:
            self.recovery.report(address)

    def __enter__(self) -> ClusterCoordinator:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    # ---------------------------------------------------------------- internals

    def _closure(self, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], steps: int) -> Closure:
        if not callable(fn):
            raise TypeError(
                f"schedule() needs a function, got {type(fn).__name__} {fn!r}: pass the function "
                "itself and its arguments separately, e.g. schedule(step, args=(iterator,))"
            )
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
        resource_ids = find_resource_ids(fn, args, kwargs)
        unknown = resource_ids - self._specs.ids()
        if unknown:
            raise ValueError(
                f"{_function_name(fn)} refers to per-worker resources {sorted(unknown)} that this "
                "coordinator did not create; create them with this coordinator's create_per_worker_*()"
            )
        payload = dumps_closure((fn, args, kwargs))  # once: retries resend these bytes
        return Closure(_function_name(fn), payload, resource_ids, steps)

    def _check_open(self) -> None:
        if self._closed:
            raise CoordinatorClosedError("the ClusterCoordinator was shut down; create a new one")

    def _raise_pending_error(self, deadline: float | None = None) -> None:
        """Raises the pending error of a failed closure, if any, once the closures in flight are
        cancelled and settled (until ``deadline``; then it is raised with them still running)."""
        if self._queue.pending_error() is None:
            return
        self._stop_closures_in_flight(deadline)
        error = self._queue.take_error()
        if error is not None:
            self._queue.cancel_all(error)
            raise error

    def _stop_closures_in_flight(self, deadline: float | None) -> None:
        """Cancels the closures running on workers and waits until each settled: they are put
        back (and so cancelled: the error is still pending) or finished first."""
        if self._queue.num_in_flight == 0:
            return
        asked = self._dispatch_loop.cancel_running(self.config.policy.probe_timeout)
        log.info("a closure failed: cancelling the %d closures running before raising its error", asked)
        while not self._queue.wait_settled(self._wait_slice(deadline)):
            if deadline is not None and time.monotonic() >= deadline:
                log.warning(
                    "raising a closure's error with %d closures still running (the deadline passed)",
                    self._queue.num_in_flight,
                )
                return
            self._log_progress()

    def _wait_slice(self, deadline: float | None) -> float:
        if deadline is None:
            return self.config.log_interval
        return max(0.0, min(self.config.log_interval, deadline - time.monotonic()))

    def _log_progress(self) -> None:
        flights = self._queue.in_flight()
        running = ", ".join(f"{f.function_name}[{f.closure_id[:8]}] on {f.worker}" for f in flights)
        log.info(
            "join: waiting for %d closures in flight (%s) and %d queued",
            len(flights),
            running or "none",
            self._queue.num_queued,
        )


class _ContextSource:
    """The strategy's cluster context as dispatchers send it, built once per context (the
    strategy's ``cluster_context()`` may create the variables first, so one caller at a time)."""

    def __init__(self, make: Callable[[], ClusterContext]):
        self._make = make
        self._lock = threading.Lock()
        self._context: ClusterContext | None = None
        self._wire: WireContext | None = None

    def __call__(self) -> WireContext:
        with self._lock:
            context = self._make()
            if context is not self._context or self._wire is None:
                self._context = context
                self._wire = WireContext(context.fingerprint, convert.cluster_to_proto(context))
            return self._wire


# -------------------------------------------------------------------- per-worker datasets


@dataclass(frozen=True)
class PerWorkerDatasetIterator(PerWorkerResource):
    """Pass it to scheduled functions: on each worker it is that worker's iterator,
    so ``next(iterator)`` inside the function yields the worker's next element."""

    def __next__(self) -> NoReturn:
        raise TypeError(
            "a per-worker iterator has no elements on the coordinator: pass it to "
            "ClusterCoordinator.schedule() and call next() on it inside the scheduled function"
        )


class PerWorkerDataset:
    """A dataset created on every worker (TF's ``PerWorkerDataset``); ``iter()`` gives a
    PerWorkerDatasetIterator (each call a new one, starting from the beginning)."""

    def __init__(self, coordinator: ClusterCoordinator, dataset_fn: Callable[..., Iterable[Any]]):
        self._coordinator = coordinator
        self._make_iterator = _iterator_factory(_call_with_context(dataset_fn))

    def __iter__(self) -> PerWorkerDatasetIterator:
        return self._coordinator._register(self._make_iterator, PerWorkerDatasetIterator)

    def __reduce__(self) -> NoReturn:
        raise TypeError("a PerWorkerDataset cannot be sent to a worker: pass iter(dataset) instead")


def _iterator_factory(dataset_fn: Callable[[WorkerContext], Iterable[Any]]) -> Callable[[WorkerContext], Any]:
    """The per-worker iterator over ``dataset_fn(ctx)``: on a GPU worker its batches reach the
    closures on the worker's device (``ctx.device``; from pinned memory, e.g. a DataLoader with
    ``pin_memory=True``, the copies are asynchronous), as TensorFlow places a worker's input.
    On a CPU worker it is the dataset's own iterator: nothing in between."""

    # A nested function pickles by value: the worker needs only coordinator.nest from this package.
    def make_iterator(ctx: WorkerContext) -> Any:
        batches = iter(dataset_fn(ctx))
        if ctx.device.type == "cpu":
            return batches
        return (nest.to_device(batch, ctx.device) for batch in batches)

    return make_iterator


def _call_with_context(fn: Callable[..., Any]) -> Callable[[WorkerContext], Any]:
    """``fn`` as a function of the WorkerContext, whether it takes one or takes nothing."""
    if _takes_an_argument(fn):
        return fn

    def without_context(ctx: WorkerContext) -> Any:
        return fn()

    return without_context


def _takes_an_argument(fn: Callable[..., Any]) -> bool:
    try:
        inspect.signature(fn).bind(None)
    except TypeError:
        return False
    except ValueError:  # no signature (some builtins): assume the documented form
        return True
    return True


def _function_name(fn: Any) -> str:
    if isinstance(fn, functools.partial):
        return f"partial({_function_name(fn.func)})"
    try:
        return str(fn.__qualname__)
    except AttributeError:  # a callable object
        return type(fn).__qualname__
