"""Fixtures shared by every test tier. Servers bind 127.0.0.1 port 0 only."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import pytest

from paramserve.psserver.client.ps_client import ClientConfig, ParameterServerClient
from paramserve.psserver.server import ParameterServer, ServerConfig, build_server

if TYPE_CHECKING:
    from paramserve.coordinator.local_cluster import LocalCluster

SMALL_CHUNK = 4096
"""Tests stream with tiny chunks so that chunking is exercised on small tensors."""


@pytest.fixture
def start_ps() -> Iterator[Callable[..., ParameterServer]]:
    """Starts in-process parameter servers on free ports; stops them all afterwards."""
    started: list[ParameterServer] = []

    def start(**overrides: object) -> ParameterServer:
        options = {"host": "127.0.0.1", "port": 0, "chunk_bytes": SMALL_CHUNK, "max_workers": 8, **overrides}
        server = build_server(ServerConfig(**options))  # type: ignore[arg-type]
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop(grace=0)


@pytest.fixture
def make_client() -> Iterator[Callable[..., ParameterServerClient]]:
    clients: list[ParameterServerClient] = []

    def make(addresses: list[str], **overrides: object) -> ParameterServerClient:
        options = {"chunk_bytes": SMALL_CHUNK, "call_timeout": 10.0, "retry_deadline": 10.0, **overrides}
        client = ParameterServerClient(addresses, ClientConfig(**options))  # type: ignore[arg-type]
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


@pytest.fixture
def start_cluster() -> Iterator[Callable[..., LocalCluster]]:
    """Starts local clusters of real processes on 127.0.0.1; stops every one afterwards."""
    from paramserve.coordinator.local_cluster import LocalCluster

    clusters: list[LocalCluster] = []

    def start(num_ps: int = 2, num_workers: int = 2, **options: object) -> LocalCluster:
        cluster = LocalCluster(num_ps=num_ps, num_workers=num_workers, **options)  # type: ignore[arg-type]
        clusters.append(cluster)
        cluster.start()
        return cluster

    yield start
    for cluster in clusters:
        cluster.stop()


MAX_TEST_PROCESSES = 4
"""At most this many test processes with ``-n auto`` (pyproject.toml): one per core up to it. Each
test starts several servers and workers of its own, so more would only share the cores out
thinner, and make the tests' deadlines the machine's load rather than the code's speed."""


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """How many processes ``-n auto`` starts: PYTEST_XDIST_AUTO_NUM_WORKERS where set, else one per
    core this process may run on, at most MAX_TEST_PROCESSES."""
    import os

    chosen = os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS")
    if chosen:
        return int(chosen)
    return max(1, min(MAX_TEST_PROCESSES, len(os.sched_getaffinity(0))))
