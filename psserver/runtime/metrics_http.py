"""What every paramserve process exposes to Prometheus, besides its own metrics.

- ``paramserve_build_info{role, version, python, torch, grpcio}``: 1, so a dashboard shows
  which build each process runs (and counts processes by role);
- ``serve_metrics``: the HTTP endpoint, which leaves out the ``*_created`` series that
  prometheus_client adds to every counter and histogram (one extra series each, noise for
  a dashboard). prometheus_client's own switch for that, ``disable_created_metrics()``,
  is process-wide: the coordinator's endpoint runs inside the user's program, whose own
  metrics it must not change, so every endpoint filters its own registry instead.
"""

from __future__ import annotations

import platform
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.exposition import start_http_server
from prometheus_client.metrics_core import Metric

__all__ = ["MetricsEndpoint", "WithoutCreated", "register_build_info", "serve_metrics"]

_CREATED_KINDS = frozenset({"counter", "histogram", "summary", "gaugehistogram"})


def register_build_info(registry: CollectorRegistry, role: str) -> Gauge:
    """Adds ``paramserve_build_info`` (value 1) for a process of ``role`` (ps, worker, coordinator)."""
    info = Gauge(
        "paramserve_build_info",
        "The paramserve build a process runs (always 1).",
        ["role", "version", "python", "torch", "grpcio"],
        registry=registry,
    )
    info.labels(role, _version("paramserve"), platform.python_version(), _version("torch"), _version("grpcio")).set(1)
    return info


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "unknown"


class WithoutCreated:
    """``registry`` as a collector whose counters, histograms and summaries carry no
    ``<name>_created`` sample (what an endpoint serves)."""

    def __init__(self, registry: CollectorRegistry):
        self._registry = registry

    def collect(self) -> Iterable[Metric]:
        for family in self._registry.collect():
            if family.type in _CREATED_KINDS:
                created = f"{family.name}_created"
                family.samples = [sample for sample in family.samples if sample.name != created]
            yield family


@dataclass
class MetricsEndpoint:
    """A running metrics HTTP server (``port``: the one it bound; 0 asked for a free one)."""

    host: str
    port: int
    _server: Any

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> MetricsEndpoint:
    """Serves ``registry`` (without ``*_created``) at ``http://host:port/metrics`` from a daemon
    thread of prometheus_client's; ``stop()`` ends it."""
    server, _thread = start_http_server(port, addr=host, registry=WithoutCreated(registry))
    return MetricsEndpoint(host, int(server.server_port), server)
