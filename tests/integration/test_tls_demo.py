"""The demo over mutual TLS: every process (coordinator, workers, parameter servers) presents
a certificate signed by the test's CA and requires one from its callers; `paramserve health`
reaches the servers over TLS too."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.certificates import make_certificates, needs_openssl


@needs_openssl
def test_the_demo_trains_over_mutual_tls(tmp_path):
    certs = make_certificates(tmp_path / "certs")
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    demo = subprocess.run(
        [
            sys.executable,
            "-m",
            "paramserve.coordinator.commands.cli",
            "demo",
            "--quiet",
            "--json",
            "--steps",
            "200",
            "--ps",
            "2",
            "--ps-replicas",  # a primary and its backup: the replication link speaks mutual TLS too
            "2",
            "--workers",
            "1",
            "--checkpoint-every",
            "100",
            "--checkpoint-dir",
            str(tmp_path / "ckpt"),
            "--tls-ca",
            str(certs.ca),
            "--tls-cert",
            str(certs.cert),
            "--tls-key",
            str(certs.key),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert demo.returncode == 0, demo.stderr[-3000:]
    summary = json.loads(demo.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 200 and summary["test_accuracy"] > 0.5 and summary["parameter_servers"] == 2
    assert (tmp_path / "ckpt" / "LATEST").exists()


@needs_openssl
def test_health_speaks_tls_to_a_mutual_tls_server(tmp_path):
    certs = make_certificates(tmp_path / "certs")
    port_file = tmp_path / "ps.port.json"
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "paramserve.coordinator.commands.cli",
            "ps",
            "--port",
            "0",
            "--port-file",
            str(port_file),
            "--tls-cert",
            str(certs.cert),
            "--tls-key",
            str(certs.key),
            "--tls-client-ca",
            str(certs.ca),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        address = f"127.0.0.1:{wait_for_port(port_file, server)}"
        health = [sys.executable, "-m", "paramserve.coordinator.commands.cli", "health", address, "--timeout", "10"]
        secure = subprocess.run(
            [*health, "--tls-ca", str(certs.ca), "--tls-cert", str(certs.cert), "--tls-key", str(certs.key)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert secure.returncode == 0 and "SERVING" in secure.stdout, secure.stderr
        plain = subprocess.run([*health, "--timeout", "2"], capture_output=True, text=True, timeout=120)
        assert plain.returncode == 1 and "UNREACHABLE" in plain.stdout
    finally:
        server.terminate()
        server.wait(timeout=60)


def wait_for_port(port_file, process, timeout: float = 120.0) -> int:
    """The port the server wrote once serving (it writes the file last); fails if it exits first."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if port_file.exists():
            return int(json.loads(port_file.read_text())["port"])
        if process.poll() is not None:
            raise AssertionError(f"the server exited: {process.stderr.read()}")
        time.sleep(0.05)  # polling a file the server writes atomically; bounded by the deadline
    raise AssertionError("the server did not report its port in time")
