"""A variable larger than protobuf's 2 GiB ceiling streams through in chunks (opt-in: slow, ~10 GB RAM).

Run with PARAMSERVE_SLOW_TESTS=1. CI exercises the same chunking with small
chunks on small tensors (tests/service).
"""

from __future__ import annotations

import os

import pytest
import torch

from paramserve.psserver.client.ps_client import ClientConfig, ParameterServerClient
from paramserve.psserver.protocol.optimizer_spec import OptimizerSpec

pytestmark = pytest.mark.skipif(
    os.environ.get("PARAMSERVE_SLOW_TESTS") != "1",
    reason="opt-in: set PARAMSERVE_SLOW_TESTS=1 (needs ~10 GB of memory)",
)


@pytest.mark.timeout(900)
def test_a_2_point_1_gib_variable_round_trips_through_one_server(start_cluster):
    cluster = start_cluster(num_ps=1, num_workers=0)
    rows = (2 * 1024**3 + 100 * 1024**2) // (4 * 1024)  # 2.1 GiB of float32, 1024 per row
    value = torch.arange(rows, dtype=torch.float32).unsqueeze(1).expand(rows, 1024).contiguous()
    with ParameterServerClient(cluster.parameter_servers, ClientConfig(call_timeout=600, retry_deadline=600)) as client:
        client.create_variable("huge", value, optimizer=OptimizerSpec("SGD", {"lr": 1.0}))
        client.push({"huge": torch.ones_like(value)})
        pulled = client.pull(["huge"]).tensors["huge"]
    assert pulled.shape == value.shape
    assert value.numel() * 4 > 2**31
    assert torch.equal(pulled[:, 0], value[:, 0] - 1) and torch.equal(pulled[-1], value[-1] - 1)
