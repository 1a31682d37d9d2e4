"""Builds a worker process: core + servicer + gRPC server, from one config."""

from __future__ import annotations

import dataclasses
import pathlib
from dataclasses import dataclass

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from paramserve.psserver.client.ps_client import ClientConfig, ParameterServerClient
from paramserve.psserver.runtime.security import TlsConfig
from paramserve.psserver.runtime.serving import DEFAULT_MAX_CONNECTIONS, GrpcService, RunningService, ensure_descriptors
from paramserve.worker.closure_access import ClientFactory
from paramserve.worker.core import ClosureOutcome, ClosureRequest, WorkerCore
from paramserve.worker.row_cache import MAX_AGE_LABEL, age_label
from paramserve.worker.servicer import SERVICE_NAME, WorkerServicer, generic_handler


@dataclass(frozen=True)
class WorkerConfig:
    """Everything one worker process is configured with (built in __main__ only)."""

    host: str = "127.0.0.1"
    port: int = 0
    metrics_port: int | None = None
    max_workers: int = 16
    max_message_bytes: int = 64 << 20
    token: str | None = None
    """Required on incoming calls when set: a worker runs the code it is sent."""
    ps_token: str | None = None
    """What the worker presents to parameter servers; None: the same as ``token``, "": none."""
    tls: TlsConfig | None = None
    insecure: bool = False
    """Listen beyond loopback without authentication (``--insecure``); refused otherwise."""
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    """Connections accepted at once (``--max-connections``); bounds what header floods can hold."""
    ps_root_certificates: pathlib.Path | None = None
    """PEM roots to verify parameter servers that serve TLS; None: plaintext."""
    ps_cert_chain: pathlib.Path | None = None
    ps_private_key: pathlib.Path | None = None
    """The client certificate and key presented to parameter servers that require mutual TLS."""
    ps_call_timeout: float = 30.0
    ps_retry_deadline: float = 60.0
    torch_threads: int | None = None
    """torch.set_num_threads for this process; None leaves it (workers started in a test)."""
    device: torch.device = torch.device("cpu")
    """Where closures compute: the CPU or a CUDA GPU (``--device``; psserver.devices.worker_device)."""

    @property
    def effective_ps_token(self) -> str | None:
        """The token sent to parameter servers (clusters usually share one token)."""
        return self.token if self.ps_token is None else (self.ps_token or None)


class ClosureMetrics:
    """The core's ClosureObserver: closures by result, their duration, push counts, steps,
    retried closures and the cluster's size as the coordinator last said it."""

    def __init__(self, registry: CollectorRegistry):
        self.closures = Counter("paramserve_worker_closures", "Closures run, by result.", ["result"], registry=registry)
        self.seconds = Histogram(
            "paramserve_worker_closure_seconds",
            "Time to run a closure (all its steps).",
            registry=registry,
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 60, 300),
        )
        self.pushes = Counter(
            "paramserve_worker_pushes", "Shard pushes sent, by result.", ["result"], registry=registry
        )
        self.steps = Counter(
            "paramserve_worker_steps",
            "Steps of closures that succeeded (rate(): this worker's steps/s).",
            registry=registry,
        )
        self.retried = Counter(
            "paramserve_worker_retried_closures",
            "Closures received as a retry (attempt > 0: an RPC running them failed, often on another worker).",
            registry=registry,
        )
        self.cluster_workers = Gauge(
            "paramserve_worker_cluster_workers",
            "Workers in the cluster, as the last closure's coordinator said.",
            registry=registry,
        )
        self.worker_index = Gauge(
            "paramserve_worker_index",
            "This worker's index in the cluster, from the last closure (-1 before one).",
            registry=registry,
        )
        self.worker_index.set(-1)
        self.rows = Counter(
            "paramserve_worker_rows",
            "Distinct embedding rows a lookup used, by where they came from: 'pulled' from the servers "
            "or 'cached' (the row cache, max_row_staleness); hit rate = cached / (cached + pulled).",
            ["source"],
            registry=registry,
        )
        self.row_staleness = Counter(
            "paramserve_worker_row_cache_staleness_steps",
            "Rows served from the row cache, by how many of this worker's steps ago they were read "
            f"(a histogram: one series per age, ages over {MAX_AGE_LABEL} counted as '{MAX_AGE_LABEL}+').",
            ["age"],
            registry=registry,
        )
        for source in ("pulled", "cached"):
            self.rows.labels(source)
        for result in ("ok", "missing_resources", "parameter_server_error", "error"):  # series from the start
            self.closures.labels(result)
        for push in ("applied", "duplicate"):
            self.pushes.labels(push)

    def on_closure(self, request: ClosureRequest, outcome: ClosureOutcome) -> None:
        self.closures.labels(_result_label(outcome)).inc()
        if outcome.error is None:
            self.steps.inc(max(1, request.steps))
        if request.attempt > 0:
            self.retried.inc()
        self.cluster_workers.set(request.num_workers)
        self.worker_index.set(request.worker_index)
        self.seconds.observe(outcome.seconds)
        self.pushes.labels("applied").inc(outcome.pushes_applied)
        self.pushes.labels("duplicate").inc(outcome.pushes_duplicate)
        use = outcome.cache_use
        self.rows.labels("pulled").inc(use.rows_pulled)
        self.rows.labels("cached").inc(use.rows_cached)
        for age, count in use.ages.items():
            self.row_staleness.labels(age_label(age)).inc(count)


def _result_label(outcome: ClosureOutcome) -> str:
    if outcome.error is None:
        return "ok"
    if outcome.error.missing_resources:
        return "missing_resources"
    return "parameter_server_error" if outcome.error.parameter_server else "error"


@dataclass
class Worker(RunningService):
    """A running worker; ``port`` is the one it bound (useful with port 0)."""

    config: WorkerConfig
    core: WorkerCore
    service: GrpcService
    registry: CollectorRegistry

    def stop(self, grace: float | None = 5.0) -> None:
        """Stops serving (running closures get ``grace`` seconds), then closes the ps clients."""
        self.service.stop(grace)
        self.core.close()


def parameter_server_clients(config: WorkerConfig) -> ClientFactory:
    """How this worker reaches a cluster's parameter servers (its token, TLS roots, deadlines)."""
    client_config = ClientConfig(
        token=config.effective_ps_token,
        tls_root_certificates=config.ps_root_certificates,
        tls_cert_chain=config.ps_cert_chain,
        tls_private_key=config.ps_private_key,
        call_timeout=config.ps_call_timeout,
        retry_deadline=config.ps_retry_deadline,
        max_message_bytes=config.max_message_bytes,
    )

    def connect(addresses: tuple[str, ...], failover_seconds: float) -> ParameterServerClient:
        if failover_seconds > 0:  # a backup takes over: give up on an unreachable server soon
            deadline = min(client_config.retry_deadline, failover_seconds)
            return ParameterServerClient(addresses, dataclasses.replace(client_config, retry_deadline=deadline))
        return ParameterServerClient(addresses, client_config)

    return connect


def build_worker(config: WorkerConfig, registry: CollectorRegistry | None = None) -> Worker:
    """Creates and starts a worker. Tests pass port=0 and read ``.port``."""
    ensure_descriptors(config.max_connections, listeners=1)
    if config.torch_threads is not None:
        torch.set_num_threads(config.torch_threads)
    registry = registry or CollectorRegistry()
    core = WorkerCore(
        parameter_server_clients(config), observer=ClosureMetrics(registry), device=config.device, token=config.token
    )
    service = GrpcService.for_config(
        config,
        handlers=[generic_handler(WorkerServicer(core))],
        service_names=[SERVICE_NAME],
        registry=registry,
        role="worker",
    )
    return Worker(config, core, service.start(), registry)
