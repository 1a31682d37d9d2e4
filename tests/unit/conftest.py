"""Fixtures of the worker-core unit tests: in-memory parameter servers and a worker core on them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fake_parameter_servers import FakeParameterServers, linear_servers

from paramserve.worker.core import WorkerCore


@pytest.fixture
def servers(request: pytest.FixtureRequest) -> FakeParameterServers:
    """Parameter servers holding a Linear(3 -> 2) as variables 'w' and 'b', SGD at the test
    module's ``LR``."""
    return linear_servers(request.module.LR)


@pytest.fixture
def core(servers: FakeParameterServers) -> Iterator[WorkerCore]:
    worker = WorkerCore(servers.factory)
    yield worker
    worker.close()
