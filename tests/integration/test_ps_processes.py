"""Two parameter-server processes started by hand, the way a user would, driven by the client."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from paramserve.psserver.client.ps_client import ClientConfig, ParameterServerClient
from paramserve.psserver.protocol.optimizer_spec import OptimizerSpec
from paramserve.psserver.protocol.partition import FixedShardsPartitioner
from paramserve.psserver.protocol.types import RowGradient

START_DEADLINE = 60.0


def wait_for_port_file(path, process, deadline):
    while time.monotonic() < deadline:
        if path.exists():
            return json.loads(path.read_text())
        if process.poll() is not None:
            raise AssertionError(f"server exited with {process.returncode}: {process.stderr.read()}")
        time.sleep(0.05)  # polling a file the child writes; bounded by the deadline
    raise AssertionError(f"no port file at {path} within the deadline")


@pytest.fixture
def two_servers(tmp_path):
    processes, infos = [], []
    deadline = time.monotonic() + START_DEADLINE
    for index in range(2):
        port_file = tmp_path / f"ps-{index}.json"
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "paramserve.coordinator.commands.cli",
                "ps",
                "--port",
                "0",
                "--port-file",
                str(port_file),
                "--metrics-port",
                "0",
                "--chunk-bytes",
                "65536",
            ],
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        processes.append(process)
        infos.append(wait_for_port_file(port_file, process, deadline))
    yield processes, infos
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)
        process.stderr.close()


def test_partitioned_variable_served_by_two_processes(two_servers):
    processes, infos = two_servers
    addresses = [f"127.0.0.1:{info['port']}" for info in infos]
    embedding = torch.randn(1000, 16)
    with ParameterServerClient(addresses, ClientConfig(chunk_bytes=65536)) as client:
        client.create_variable(
            "emb", embedding, optimizer=OptimizerSpec("Adagrad", {"lr": 0.1}), partitioner=FixedShardsPartitioner(4)
        )
        client.create_variable("bias", torch.zeros(16), optimizer=OptimizerSpec("Adam", {"lr": 0.01}))
        pulled = client.pull(["emb", "bias"])
        assert torch.equal(pulled.tensors["emb"], embedding)
        client.push(
            {"emb": RowGradient(torch.tensor([1, 999]), torch.ones(2, 16)), "bias": torch.ones(16)},
            base_versions=pulled.versions,
        )
        after = client.pull(["emb", "bias"]).tensors
    changed = (after["emb"] != embedding).any(dim=1).nonzero().reshape(-1).tolist()
    assert changed == [1, 999]
    torch.testing.assert_close(after["bias"], torch.full((16,), -0.01))
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{infos[0]['metrics_port']}/metrics", timeout=10).read().decode()
    assert 'paramserve_rpcs_total{code="OK",method="DataPlaneStep",role="ps"}' in metrics  # small: one frame each way
    assert "paramserve_rpc_duration_seconds_bucket" in metrics
    assert "paramserve_received_bytes_total" in metrics


def test_a_lookup_of_more_distinct_rows_than_a_data_plane_plan_holds_travels_by_grpc_and_applies_once(two_servers):
    processes, infos = two_servers
    table = torch.randn(400_000, 2)
    ids = torch.randperm(400_000)[:300_000]  # 2.4 MB of row ids for one server: over a STEP frame's 1 MiB plan
    with ParameterServerClient([f"127.0.0.1:{infos[0]['port']}"], ClientConfig()) as client:
        client.create_variable("emb", table, optimizer=OptimizerSpec("SGD", {"lr": 1.0}))
        found, versions = client.pull_unique_rows({"emb": ids})
        rows = found["emb"]
        assert torch.equal(rows.rows[rows.inverse], table[ids])
        client.push({"emb": RowGradient(rows.ids, torch.ones(rows.ids.numel(), 2))}, base_versions=versions)
        after = client.pull(["emb"]).tensors["emb"]
    assert torch.equal(after[ids], table[ids] - 1.0), "every row the push named moved once"
    untouched = torch.ones(400_000, dtype=torch.bool)
    untouched[ids] = False
    assert torch.equal(after[untouched], table[untouched])


def test_sigterm_drains_health_then_exits_cleanly(two_servers):
    processes, infos = two_servers
    with grpc.insecure_channel(f"127.0.0.1:{infos[0]['port']}") as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=30)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        processes[0].send_signal(signal.SIGTERM)
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert processes[0].wait(timeout=30) == 0
    assert processes[1].poll() is None
