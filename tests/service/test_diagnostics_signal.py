"""A ``paramserve ps`` process started with PARAMSERVE_DIAGNOSTICS writes a diagnostics dump on each
SIGUSR1 and keeps serving (psserver/runtime/diagnostics.py)."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from paramserve.psserver.runtime.diagnostics import DIRECTORY_ENV, TRACEMALLOC_ENV
from paramserve.psserver.runtime.memory import SERVER_ARENAS


def wait_for(path: pathlib.Path, process: subprocess.Popen[bytes], log: pathlib.Path, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert process.poll() is None, log.read_text()
        assert time.monotonic() < deadline, f"{path} did not appear within {seconds} s"
        time.sleep(0.05)


def test_sigusr1_writes_numbered_dumps_and_the_server_keeps_serving(tmp_path):
    port_file, dumps, log = tmp_path / "port.json", tmp_path / "dumps", tmp_path / "ps.log"
    env = {**os.environ, DIRECTORY_ENV: str(dumps), TRACEMALLOC_ENV: "1"}
    env.pop("MALLOC_ARENA_MAX", None)
    process = subprocess.Popen(
        [sys.executable, "-m", "paramserve.psserver", "--port", "0", "--port-file", str(port_file)],
        stdout=subprocess.DEVNULL,
        stderr=log.open("wb"),
        env=env,
    )
    try:
        wait_for(port_file, process, log)
        for number in (1, 2):
            process.send_signal(signal.SIGUSR1)
            wait_for(dumps / f"ps-{process.pid}-{number}.json", process, log)
        report = json.loads((dumps / f"ps-{process.pid}-2.json").read_text())
        assert report["role"] == "ps" and report["pid"] == process.pid and report["dump"] == 2
        assert report["structures"]["shards"] == 0 and report["structures"]["idempotency_keys"] == 0
        assert report["structures"]["dataplane_connections"] == 0
        assert report["process"]["VmRSS"] > 0 and report["process"]["descriptors_by_kind"]["socket"] >= 2
        if "malloc" in report:  # glibc: the server capped its arenas
            assert 1 <= report["malloc"]["arenas"] <= SERVER_ARENAS
        assert report["python_heap"]["traced_bytes"] > 0
        port = json.loads(port_file.read_text())["port"]
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        process.terminate()
        process.wait(30)
