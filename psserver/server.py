"""Builds a parameter-server process from one config: the store, the step engine on it, the
gRPC servicer and server, and the step data plane beside them."""

from __future__ import annotations

import os
import pathlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import torch
from grpc_health.v1 import health_pb2
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from paramserve.psserver.dataplane.dataplane_server import DataPlaneServer
from paramserve.psserver.dynamic.dynamic_types import block_bytes_within
from paramserve.psserver.protocol.errors import ConfigurationError, ParamServeError
from paramserve.psserver.protocol.metadata import SERVICE_NAME
from paramserve.psserver.protocol.streams import DEFAULT_CHUNK_BYTES
from paramserve.psserver.protocol.types import PushOutcome
from paramserve.psserver.replication.replica import Replica
from paramserve.psserver.replication.replica_forwarder import ForwarderSettings, GrpcForwarder
from paramserve.psserver.runtime.error_boundary import boundary_error
from paramserve.psserver.runtime.security import ClientTls, TlsConfig
from paramserve.psserver.runtime.serving import DEFAULT_MAX_CONNECTIONS, GrpcService, RunningService, ensure_descriptors
from paramserve.psserver.servicer import DataPlaneListing, ParameterServerServicer, ServicerLimits, generic_handler
from paramserve.psserver.steps.engine import DEFAULT_MAX_PULL_BYTES, DEFAULT_MAX_PUSH_BYTES, StepEngine
from paramserve.psserver.steps.programs import StepPrograms
from paramserve.psserver.store.optimizer import warm_up
from paramserve.psserver.store.shard_store import ShardStore, StoreConfig
from paramserve.wire.v1 import parameter_server_pb2 as ps_pb2


@dataclass(frozen=True)
class ServerConfig:
    """Everything one parameter-server process is configured with (built in __main__ only)."""

    host: str = "127.0.0.1"
    port: int = 0
    metrics_port: int | None = None
    max_workers: int = 16
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    # Largest single message accepted; bulk data is chunked well below it.
    max_message_bytes: int = 64 << 20
    # Largest gradient part accepted in one push (across its chunks).
    max_push_bytes: int = DEFAULT_MAX_PUSH_BYTES
    max_pull_bytes: int = DEFAULT_MAX_PULL_BYTES
    """Most tensor bytes one read request may ask for."""
    max_shard_bytes: int | None = None
    """Largest shard CreateShards may declare; None: half this machine's memory."""
    checkpoint_root: pathlib.Path | None = None
    """Save and Restore stay under it; None: anywhere with a token, nowhere without."""
    token: str | None = None
    tls: TlsConfig | None = None
    insecure: bool = False
    """Listen beyond loopback without authentication (``--insecure``); refused otherwise."""
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    """Connections accepted at once (``--max-connections``); bounds what header floods can hold."""
    store: StoreConfig = field(default_factory=StoreConfig)
    torch_threads: int | None = None
    """torch.set_num_threads for this process; None leaves it (servers started in a test)."""
    replica_tls: ClientTls | None = None
    """How this server reaches its backups when it is a replicated primary and the servers serve
    TLS (``--replica-tls-ca``, with ``--replica-tls-cert``/``--replica-tls-key`` for mutual TLS)."""
    data_port: int | None = 0
    """The step data plane's TCP port (psserver/dataplane/frames.py; ``--data-port``): 0 picks a free
    one, which clients learn with GetDataPlane; None serves steps over gRPC only."""


class PushMetrics:
    """The store's PushObserver: applied / duplicate / rejected pushes and staleness."""

    def __init__(self, registry: CollectorRegistry):
        self.pushes = Counter(
            "paramserve_ps_pushes", "Gradient pushes per shard, by result.", ["result"], registry=registry
        )
        # Every series from the start (rate() needs it), each looked up once: a labels() lookup
        # per shard per step is a measurable part of a small step.
        self._applied, self._duplicate, self._rejected = (
            self.pushes.labels(result) for result in ("applied", "duplicate", "rejected")
        )
        self.staleness = Histogram(
            "paramserve_ps_push_staleness_versions",
            "Shard versions applied between a gradient's pull and its push.",
            registry=registry,
            buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 1024),
        )

    def on_push(self, outcome: PushOutcome) -> None:
        if outcome.applied:
            self._applied.inc()
            self.staleness.observe(outcome.staleness)
        else:
            self._duplicate.inc()

    def on_rejected(self, error: ParamServeError) -> None:
        self._rejected.inc()


class ShardVersions(Collector):
    """``paramserve_ps_shard_version{variable, shard}``: each shard's version (the pushes applied
    to it; a checkpoint keeps it), read from the store when Prometheus scrapes. A version that
    stops rising while training runs is a stuck shard; one that drops is a restore of an older
    checkpoint, or a server that came back empty."""

    def __init__(self, store: ShardStore):
        self._store = store

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "paramserve_ps_shard_version",
            "A shard's version: the pushes applied to it (kept by checkpoints).",
            labels=["variable", "shard"],
        )
        for info in self._store.list_shards():
            family.add_metric([info.ref.variable, str(info.ref.shard)], info.version)
        yield family


class StructureMetrics(Collector):
    """What a server keeps per push and per connection, read when Prometheus scrapes (each has a
    bound: docs in ShardStore.structure_sizes): ``paramserve_ps_idempotency_keys`` (keys the
    shards' windows remember), ``paramserve_ps_idempotency_bytes`` (what the windows allocate,
    from each shard's first push) and ``paramserve_ps_dataplane_connections``."""

    def __init__(self, server: Callable[[], dict[str, int]]):
        self._sizes = server

    def collect(self) -> Iterator[GaugeMetricFamily]:
        sizes = self._sizes()
        for name, text in (
            ("idempotency_keys", "Push keys this server's shards remember (at most their windows' capacity)."),
            ("idempotency_bytes", "Bytes this server's idempotency windows allocate."),
            ("dataplane_connections", "Data-plane connections admitted now."),
        ):
            if name in sizes:
                yield GaugeMetricFamily(f"paramserve_ps_{name}", text, value=sizes[name])


class DynamicTableMetrics(Collector):
    """The dynamic tables' shards on this server, read from the store when Prometheus scrapes:
    ``paramserve_ps_dynamic_rows{table}`` (live rows), ``paramserve_ps_dynamic_bytes{table}``
    (arena, index and sighting sketch), ``paramserve_ps_dynamic_admissions_total{table}`` and
    ``paramserve_ps_dynamic_evictions_total{table,reason=ttl|capacity}``."""

    def __init__(self, store: ShardStore):
        self._store = store

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        rows = GaugeMetricFamily("paramserve_ps_dynamic_rows", "Live rows of a dynamic table here.", labels=["table"])
        size = GaugeMetricFamily(
            "paramserve_ps_dynamic_bytes", "Bytes a dynamic table's rows and index take here.", labels=["table"]
        )
        admissions = CounterMetricFamily(
            "paramserve_ps_dynamic_admissions", "Rows a dynamic table made here.", labels=["table"]
        )
        evictions = CounterMetricFamily(
            "paramserve_ps_dynamic_evictions",
            "Rows a dynamic table evicted here, by reason.",
            labels=["table", "reason"],
        )
        for stats in self._store.dynamic.stats():
            table = stats.ref.variable
            rows.add_metric([table], stats.live_rows)
            size.add_metric([table], stats.bytes)
            admissions.add_metric([table], stats.admissions)
            evictions.add_metric([table, "ttl"], stats.evictions_ttl)
            evictions.add_metric([table, "capacity"], stats.evictions_capacity)
        yield from (rows, size, admissions, evictions)


@dataclass
class ParameterServer(RunningService):
    """A running parameter server; ``port`` is the one it bound (useful with port 0)."""

    config: ServerConfig
    store: ShardStore
    service: GrpcService
    registry: CollectorRegistry
    data_plane: DataPlaneServer[StepPrograms] | None = None

    @property
    def data_port(self) -> int | None:
        """The data plane's port; None without one."""
        return self.data_plane.port if self.data_plane is not None else None

    def structure_sizes(self) -> dict[str, int]:
        sizes = self.store.structure_sizes()
        if self.data_plane is not None:
            sizes.update(self.data_plane.structure_sizes())
        return sizes

    def stop(self, grace: float | None = 5.0) -> None:
        """Graceful: the data plane lets the steps being applied finish and answer (within
        ``grace``), then the gRPC server drains (health NOT_SERVING, new calls refused, running
        ones get ``grace`` seconds). Clients see the server going away as a server failure."""
        if self.data_plane is not None:
            self.data_plane.stop(grace or 0.0)
        self.service.stop(grace)


def build_server(config: ServerConfig, registry: CollectorRegistry | None = None) -> ParameterServer:
    """Creates and starts a parameter server. Tests pass port=0 and read ``.port``. Raises
    ConfigurationError for a setting it cannot serve with (e.g. more connections than descriptors)."""
    ensure_descriptors(config.max_connections, listeners=1 if config.data_port is None else 2)
    if config.torch_threads is not None:
        torch.set_num_threads(config.torch_threads)
    warm_up()
    registry = registry or CollectorRegistry()
    limits = ServicerLimits(
        max_push_bytes=config.max_push_bytes,
        max_pull_bytes=config.max_pull_bytes,
        max_shard_bytes=config.max_shard_bytes,
        max_reply_bytes=config.max_message_bytes,
        checkpoint_root=config.checkpoint_root,
        authenticated=bool(config.token),
    )
    store_config = replace(config.store, dynamic_block_bytes=block_bytes_within(limits.shard_limit()))
    replica = build_replica(config)
    store = ShardStore(store_config, observer=PushMetrics(registry), replication=replica)
    steps = StepEngine(store, replica, limits.step_limits())
    listing = DataPlaneListing()
    servicer = ParameterServerServicer(store, steps, config.chunk_bytes, limits, replica, listing)
    registry.register(ShardVersions(store))
    registry.register(DynamicTableMetrics(store))
    service = GrpcService.for_config(
        config, handlers=[generic_handler(servicer)], service_names=[SERVICE_NAME], registry=registry, role="ps"
    )
    data_plane = None if config.data_port is None else start_data_plane(config, steps, listing, service)
    try:
        server = ParameterServer(config, store, service.start(), registry, data_plane)
        registry.register(StructureMetrics(server.structure_sizes))
        return server
    except BaseException:
        if data_plane is not None:
            data_plane.stop()
        raise


def build_replica(config: ServerConfig) -> Replica:
    """This server's place in its shard group (standalone until the coordinator configures it),
    forwarding a primary's writes over gRPC as the config says to reach its backups."""
    settings = ForwarderSettings(config.token, config.replica_tls, max_message_bytes=config.max_message_bytes)
    cannot_forward = (
        "this server serves TLS but has no CA bundle to verify its backups with: start it with --replica-tls-ca "
        "(and --replica-tls-cert/--replica-tls-key where the servers require client certificates)"
        if config.tls is not None and config.replica_tls is None
        else None
    )
    return Replica(lambda address: GrpcForwarder(address, settings), cannot_forward)


DATA_PLANE_HEALTH = "paramserve.DataPlane"
"""The health service name of the data plane: NOT_SERVING while it cannot accept connections
(clients then take the Step RPC, which the server's own health covers)."""


def start_data_plane(
    config: ServerConfig, steps: StepEngine, listing: DataPlaneListing, service: GrpcService
) -> DataPlaneServer[StepPrograms]:
    """The step data plane beside the gRPC server: same host, token, TLS and message limit, the
    same step engine (each connection's state: its step programs); ``listing`` (the servicer's)
    then tells clients its port. Raises ConfigurationError when its port cannot be bound."""
    assert config.data_port is not None
    metrics = service.metrics
    refused = Counter(
        "paramserve_dataplane_refused",
        "Data-plane connections refused or dropped, by reason.",
        ["reason"],
        registry=metrics.registry,
    )
    service.health.set(DATA_PLANE_HEALTH, health_pb2.HealthCheckResponse.SERVING)
    try:
        data_plane = DataPlaneServer(
            steps.run_frames,
            steps.new_connection,
            lambda exc: boundary_error("Step", exc),
            host=config.host,
            port=config.data_port,
            max_body_bytes=config.max_message_bytes,
            max_connections=config.max_connections,
            token=config.token,
            tls=config.tls,
            on_step=lambda code, seconds, received, sent: metrics.record_call(
                "DataPlaneStep", code, seconds, received, sent
            ),
            on_refused=lambda reason: refused.labels(reason).inc(),
            on_health=lambda serving: service.health.set(
                DATA_PLANE_HEALTH,
                health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING,
            ),
        )
    except OSError as err:
        raise ConfigurationError(
            f"cannot serve the data plane on {config.host}:{config.data_port}: {err.strerror or err}; choose "
            "another --data-port (0 picks a free one)"
        ) from None
    listing.publish(
        ps_pb2.DataPlaneInfo(
            port=data_plane.port,
            max_frame_bytes=config.max_message_bytes,
            local_socket=data_plane.local_socket,
            server_pid=os.getpid(),
            server_uid=os.getuid(),
        )
    )
    return data_plane.start()
