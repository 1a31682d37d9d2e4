"""The coordinator's Prometheus metrics: what the user's program knows about its cluster.

The closure queue and the dispatchers report what happens through ``CoordinatorObserver``
(plain method calls; ``NO_OBSERVER`` ignores them); ``CoordinatorTelemetry`` is the
observer that counts it on a registry of its own and, when given a port, serves it over
HTTP (``psserver.metrics_http``: with ``paramserve_build_info``, without ``*_created``).
Queue depth, worker states and the checkpoint's age are read when Prometheus scrapes, so
nothing here polls. It also keeps ``run`` (``coordinator.cluster_status.RunLog``): each worker's
closures and state, the recoveries, what the program reports (``report``) and the timeline of
events, which the status page (``coordinator.status_page``) shows. Every metric's name starts
with ``paramserve_coordinator_``:

=============================================  ======================================================
closures_scheduled_total                       closures queued by ``schedule``
closures_finished_total{outcome}               succeeded / failed / cancelled
closures_retried_total{code}                   calls that failed at the RPC level and went back to
                                               the queue for another worker (gRPC status code)
steps_total                                    steps of succeeded closures (``rate()``: steps/s)
queued_closures, closures_in_flight            the queue's depth and what workers are running
workers{state}                                 workers by state: up, down (probed), stopped
worker_up{worker}                              1 up, 0 down or stopped; gone when a worker leaves
worker_membership_changes_total{change}        workers joined / left (discovery, add/remove)
checkpoint_age_seconds, checkpoint_step        the newest checkpoint written or restored (absent
                                               before the first)
ps_recoveries_total{server, result}            parameter servers restored after a restart, or
                                               replaced by a backup (result "failed-over")
ps_recovery_seconds                            how long each recovery or failover took (histogram)
ps_replicas_in_sync{group}                     replicas holding a shard group's state (replicas > 1)
ps_replica_rejoins_total                       servers copied into and made backups again
ps_replica_resync_bytes_total                  bytes piped from primaries into rejoining backups
ps_replica_resync_seconds                      how long each rejoin took (histogram)
=============================================  ======================================================
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from paramserve.coordinator.checkpointing.checkpoint_log import CheckpointRecord
from paramserve.coordinator.status.cluster_status import RunLog, check_report
from paramserve.psserver.runtime.metrics_http import MetricsEndpoint, register_build_info, serve_metrics
from paramserve.worker.row_cache import MAX_AGE_LABEL, age_label

if TYPE_CHECKING:
    from paramserve.coordinator.dispatch.closures import Closure

__all__ = [
    "WORKER_STATES",
    "CoordinatorTelemetry",
    "register_queue_gauges",
]

PREFIX = "paramserve_coordinator_"
WORKER_STATES = ("up", "down", "stopped")
"""``WorkerState`` values of coordinator.dispatcher, as labels."""


class _ClosureMetrics:
    """Closures scheduled, finished (by outcome), retried (by gRPC code), and their steps."""

    def __init__(self, registry: CollectorRegistry):
        self.scheduled = Counter(f"{PREFIX}closures_scheduled", "Closures queued by schedule().", registry=registry)
        self.finished = Counter(
            f"{PREFIX}closures_finished",
            "Closures that reached a final state, by outcome.",
            ["outcome"],
            registry=registry,
        )
        self.retried = Counter(
            f"{PREFIX}closures_retried",
            "Calls of closures that failed at the RPC level and went back to the queue, by gRPC code.",
            ["code"],
            registry=registry,
        )
        self.steps = Counter(
            f"{PREFIX}steps", "Steps of succeeded closures (rate(): steps per second).", registry=registry
        )
        for outcome in ("succeeded", "failed", "cancelled"):  # every series from the start: rate() needs it
            self.finished.labels(outcome)


class _RowMetrics:
    """The workers' embedding lookups: distinct rows pulled and served by their row caches, and the
    cached rows' ages (the workers' own series, summed over the cluster)."""

    def __init__(self, registry: CollectorRegistry):
        self.rows = Counter(
            f"{PREFIX}rows",
            "Distinct embedding rows the workers' lookups used, by where they came from: 'pulled' from the "
            "servers or 'cached' (row caches, max_row_staleness); hit rate = cached / (cached + pulled).",
            ["source"],
            registry=registry,
        )
        self.staleness = Counter(
            f"{PREFIX}row_cache_staleness_steps",
            "Rows the workers' row caches served, by how many of the worker's steps ago they were read "
            f"(a histogram: one series per age, ages over {MAX_AGE_LABEL} counted as '{MAX_AGE_LABEL}+').",
            ["age"],
            registry=registry,
        )
        for source in ("pulled", "cached"):
            self.rows.labels(source)


class _WorkerMetrics:
    """Workers by state (read at scrape time) and the membership changes."""

    def __init__(self, registry: CollectorRegistry):
        self.membership = Counter(
            f"{PREFIX}worker_membership_changes",
            "Workers that joined or left the cluster.",
            ["change"],
            registry=registry,
        )
        for change in ("joined", "left"):
            self.membership.labels(change)
        self.states = _WorkerStates()
        registry.register(self.states)

    def set(self, address: str, state: str | None) -> None:
        change = self.states.set(address, state)
        if change is not None:
            self.membership.labels(change).inc()


class _RecoveryMetrics:
    """Parameter-server recoveries and, with replicas, the groups in sync and the rejoins."""

    def __init__(self, registry: CollectorRegistry):
        self.recoveries = Counter(
            f"{PREFIX}ps_recoveries",
            "Parameter servers restored after a restart, by server and result.",
            ["server", "result"],
            registry=registry,
        )
        self.recovery_seconds = Histogram(
            f"{PREFIX}ps_recovery_seconds",
            "Seconds from noticing a restarted parameter server to its restore.",
            buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
            registry=registry,
        )
        self.replicas_in_sync = Gauge(
            f"{PREFIX}ps_replicas_in_sync",
            "Replicated parameter servers: replicas holding each shard group's state, its primary included.",
            ["group"],
            registry=registry,
        )
        self.rejoins = Counter(
            f"{PREFIX}ps_replica_rejoins", "Servers copied into and made backups again.", registry=registry
        )
        self.resync_bytes = Counter(
            f"{PREFIX}ps_replica_resync_bytes",
            "Bytes piped from primaries into rejoining backups.",
            registry=registry,
        )
        self.resync_seconds = Histogram(
            f"{PREFIX}ps_replica_resync_seconds",
            "Seconds each rejoin took (the primary copying its shards while it serves).",
            buckets=(0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 300),
            registry=registry,
        )


class _DenseMetrics:
    """Hybrid training's dense group: its generation, members, rounds and breaks."""

    def __init__(self, registry: CollectorRegistry):
        self.generation = Gauge(
            f"{PREFIX}dense_group_generation",
            "Hybrid training (sync_dense): formations of the workers' dense all-reduce group so far.",
            registry=registry,
        )
        self.members = Gauge(
            f"{PREFIX}dense_group_members", "Hybrid training: workers in the dense group now.", registry=registry
        )
        self.rounds = Counter(
            f"{PREFIX}dense_rounds",
            "Hybrid training: rounds finished (every worker's call answered).",
            registry=registry,
        )
        self.breaks = Counter(
            f"{PREFIX}dense_group_breaks",
            "Hybrid training: rounds in which the dense group broke (a worker lost or timed out).",
            registry=registry,
        )


def register_queue_gauges(
    registry: CollectorRegistry, *, queue_depth: Callable[[], int], in_flight: Callable[[], int]
) -> None:
    """``queued_closures`` and ``closures_in_flight`` on ``registry``, read at scrape time. Apart
    from CoordinatorTelemetry: the closure queue reports to the telemetry, so it is built after
    it, and its gauges join the registry both share once it exists."""
    Gauge(f"{PREFIX}queued_closures", "Closures waiting for a worker.", registry=registry).set_function(queue_depth)
    Gauge(f"{PREFIX}closures_in_flight", "Closures running on workers.", registry=registry).set_function(in_flight)


class CoordinatorTelemetry:
    """The coordinator's metrics on ``registry``, fed as its observer; ``build`` makes one.

    Parameter-server recovery reports through ``parameter_server_recovering`` and
    ``parameter_server_recovered``; the program through ``report``. ``run`` keeps all of it for
    the status page. ``serve(host, port)`` starts the HTTP endpoint; ``close()`` stops it.
    """

    def __init__(
        self,
        *,
        registry: CollectorRegistry,
        closures: _ClosureMetrics,
        workers: _WorkerMetrics,
        recovery: _RecoveryMetrics,
        dense: _DenseMetrics,
        run: RunLog,
        rows: _RowMetrics | None = None,
    ):
        self.registry = registry
        self._closures = closures
        self._workers = workers
        self._recovery = recovery
        self._dense = dense
        self._rows = rows or _RowMetrics(registry)
        self._endpoint: MetricsEndpoint | None = None
        self.run = run
        """What the status page shows: workers, recoveries, reports and the timeline."""

    @classmethod
    def build(
        cls,
        *,
        checkpoint: Callable[[], CheckpointRecord | None] = lambda: None,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.time,
    ) -> CoordinatorTelemetry:
        """Telemetry on ``registry`` (a new one by default), with ``paramserve_build_info``;
        ``checkpoint`` (the newest one) is read at scrape time. The queue's gauges are
        ``register_queue_gauges``'."""
        registry = registry or CollectorRegistry()
        register_build_info(registry, "coordinator")
        telemetry = cls(
            registry=registry,
            closures=_ClosureMetrics(registry),
            workers=_WorkerMetrics(registry),
            recovery=_RecoveryMetrics(registry),
            dense=_DenseMetrics(registry),
            run=RunLog(clock),
            rows=_RowMetrics(registry),
        )
        registry.register(_CheckpointAge(checkpoint, clock))
        return telemetry

    # ---------------------------------------------------------------- CoordinatorObserver

    def closure_scheduled(self, closure: Closure) -> None:
        self._closures.scheduled.inc()
        self.run.closure_scheduled(closure)

    def closure_finished(self, closure: Closure) -> None:
        outcome = closure.state.value
        self._closures.finished.labels(outcome).inc()
        if outcome == "succeeded":
            self._closures.steps.inc(closure.steps)
        self.run.closure_finished(closure)

    def closure_retried(self, closure: Closure, code: str) -> None:
        self._closures.retried.labels(code).inc()
        self.run.closure_retried(closure, code)

    def worker_state(self, address: str, state: str | None) -> None:
        self._workers.set(address, state)
        self.run.worker_state(address, state)

    def worker_device(self, address: str, device: str) -> None:
        self.run.worker_device(address, device)

    def rows_read(self, pulled: int, cached: int, cached_by_age: Mapping[int, int]) -> None:
        # What a worker says: a negative count (a broken or hostile worker) would make a counter
        # raise on the dispatch thread, a negative age a label per value. Dropped.
        pulled, cached = max(0, pulled), max(0, cached)
        cached_by_age = {age: count for age, count in cached_by_age.items() if age >= 0 and count > 0}
        self._rows.rows.labels("pulled").inc(pulled)
        self._rows.rows.labels("cached").inc(cached)
        for age, count in cached_by_age.items():
            self._rows.staleness.labels(age_label(age)).inc(count)
        self.run.rows_read(pulled, cached, cached_by_age)

    # ---------------------------------------------------------------- the program's own figures

    def report(self, step: object = None, *, loss: object = None, samples: object = None, **metrics: object) -> None:
        """See ``ClusterCoordinator.report``; raises ValueError for a value that is not a number."""
        self.run.report(*check_report(step, loss, samples, metrics))

    # ---------------------------------------------------------------- parameter-server recovery

    def parameter_server_recovering(self, server: str) -> None:
        """Recovery of the parameter server at ``server`` starts (training pauses meanwhile)."""
        self.run.parameter_server_recovering(server)

    def parameter_server_recovered(self, server: str, result: str, seconds: float) -> None:
        """A recovery of the parameter server at ``server`` ended with ``result`` (e.g. "restored",
        "failed") after ``seconds``: counts it and observes its duration."""
        self._recovery.recoveries.labels(server, result).inc()
        self._recovery.recovery_seconds.observe(seconds)
        self.run.parameter_server_recovered(server, result, seconds)

    def replica_rejoined(self, group: int, member: str, copied_bytes: int, seconds: float) -> None:
        """``member`` rejoined shard group ``group`` as a backup after ``copied_bytes`` were copied."""
        self._recovery.rejoins.inc()
        self._recovery.resync_bytes.inc(copied_bytes)
        self._recovery.resync_seconds.observe(seconds)
        self.run.replica_rejoined(group, member, copied_bytes, seconds)

    def replicas_in_sync(self, group: int, count: int) -> None:
        """Shard group ``group`` has ``count`` replicas holding its state."""
        self._recovery.replicas_in_sync.labels(str(group)).set(count)

    # ---------------------------------------------------------------- hybrid training's dense group

    def dense_group_formed(self, generation: int, members: Sequence[str]) -> None:
        """The dense group formed anew (generation ``generation``) with ``members``."""
        self._dense.generation.set(generation)
        self._dense.members.set(len(members))
        self.run.dense_group_formed(generation, members)

    def dense_round_finished(self, broke: bool) -> None:
        """A round ended; ``broke``: the group broke in it (its closures run again)."""
        self._dense.rounds.inc()
        if broke:
            self._dense.breaks.inc()
            self.run.dense_group_broke()

    # ---------------------------------------------------------------- the endpoint

    def serve(self, host: str, port: int) -> int:
        """Serves the metrics at ``http://host:port/metrics`` (port 0: a free one); returns the port."""
        if self._endpoint is None:
            self._endpoint = serve_metrics(self.registry, host, port)
        return self._endpoint.port

    @property
    def port(self) -> int | None:
        """The endpoint's port, None when not serving."""
        return self._endpoint.port if self._endpoint is not None else None

    def close(self) -> None:
        endpoint, self._endpoint = self._endpoint, None
        if endpoint is not None:
            endpoint.stop()


class _WorkerStates(Collector):
    """Each worker's last reported state: ``workers{state}`` and ``worker_up{worker}``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._states: dict[str, str] = {}

    def set(self, address: str, state: str | None) -> str | None:
        """Records the change; returns "joined" or "left" when membership changed."""
        with self._lock:
            known = address in self._states
            if state is None:
                self._states.pop(address, None)
                return "left" if known else None
            self._states[address] = state
            return None if known else "joined"

    def collect(self) -> Iterator[GaugeMetricFamily]:
        with self._lock:
            states = dict(self._states)
        counts = GaugeMetricFamily(f"{PREFIX}workers", "Workers of the cluster by state.", labels=["state"])
        for state in WORKER_STATES:
            counts.add_metric([state], sum(1 for s in states.values() if s == state))
        up = GaugeMetricFamily(
            f"{PREFIX}worker_up", "1 when the worker takes closures, 0 when down or stopped.", labels=["worker"]
        )
        for address, state in sorted(states.items()):
            up.add_metric([address], 1.0 if state == "up" else 0.0)
        yield counts
        yield up


class _CheckpointAge(Collector):
    """Seconds since the newest checkpoint was written, and its step (nothing before the first)."""

    def __init__(self, checkpoint: Callable[[], CheckpointRecord | None], clock: Callable[[], float]):
        self._checkpoint = checkpoint
        self._clock = clock

    def collect(self) -> Iterator[GaugeMetricFamily]:
        record = self._checkpoint()
        age = GaugeMetricFamily(f"{PREFIX}checkpoint_age_seconds", "Seconds since the newest checkpoint was written.")
        step = GaugeMetricFamily(f"{PREFIX}checkpoint_step", "The training step of the newest checkpoint.")
        if record is not None:
            age.add_metric([], max(0.0, self._clock() - record.written_at))
            step.add_metric([], record.step)
        yield age
        yield step
