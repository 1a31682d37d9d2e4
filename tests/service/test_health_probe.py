"""``paramserve-health``: grpc.health.v1 over a bare HTTP/2 connection, against a real server."""

from __future__ import annotations

import socket
import subprocess
import sys

from grpc_health.v1 import health_pb2

from paramserve.psserver.protocol.metadata import SERVICE_NAME
from paramserve.psserver.runtime.health_probe import UNREACHABLE, check, main


def test_a_serving_server_and_its_service_are_serving(start_ps) -> None:
    ps = start_ps(token="secret")  # health is exempt from the token
    assert check(ps.address, 2.0) == "SERVING"
    assert check(ps.address, 2.0, SERVICE_NAME) == "SERVING"
    assert check(f"localhost:{ps.port}", 2.0) == "SERVING"


def test_an_unknown_service_is_not_found_and_not_serving_is_reported(start_ps) -> None:
    ps = start_ps()
    assert check(ps.address, 2.0, "no.such.Service") == "NOT_FOUND"
    ps.service.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)  # as during a graceful shutdown
    assert check(ps.address, 2.0) == "NOT_SERVING"
    assert main(["--quiet", ps.address]) == 1


def test_nothing_listening_or_nothing_answering_is_unreachable() -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    assert check(f"127.0.0.1:{port}", 1.0) == UNREACHABLE
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, never answers
        assert check(f"127.0.0.1:{silent.getsockname()[1]}", 0.5) == UNREACHABLE


def test_the_command_exits_0_when_serving_and_prints_the_status(start_ps) -> None:
    ps = start_ps()
    done = subprocess.run(
        [sys.executable, "-m", "paramserve.psserver.runtime.health_probe", ps.address],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert (done.returncode, done.stdout.strip()) == (0, f"{ps.address}: SERVING")
    bad = subprocess.run(
        [sys.executable, "-m", "paramserve.psserver.runtime.health_probe", "no-port"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert bad.returncode == 2 and "not host:port" in bad.stderr


def test_the_probe_imports_neither_torch_nor_grpc() -> None:
    code = (
        "import sys, paramserve.psserver.runtime.health_probe; "
        "print(sorted(m for m in ('torch', 'grpc', 'google.protobuf', 'numpy') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=True)
    assert done.stdout.strip() == "[]"
