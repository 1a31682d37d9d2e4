"""The Compose deployment on a real Docker engine: the image built, the cluster brought up, the
workers scaled, a parameter server stopped gracefully (SIGTERM, restarted by its policy) and one
killed and started by hand, while the demo trains; the run must finish with every checkpoint whole.

Skipped, saying why, where no Docker engine answers (``docker info``) or no base image is at hand.
Where Docker Hub cannot be reached, ``PARAMSERVE_BASE_IMAGE`` names a local base image with Python
3.10+ and pip (the Dockerfile's ``PYTHON_IMAGE``), and ``PARAMSERVE_TORCH_WHEELS`` a directory
holding the torch wheel, which this test serves to the build as its ``TORCH_INDEX_URL``.
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import pathlib
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator

import pytest

pytestmark = pytest.mark.timeout(1800)

ROOT = pathlib.Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "deploy" / "compose" / "docker-compose.yml"
TOKEN = COMPOSE.parent / "paramserve_token.txt"
PROJECT = "paramserve-engine-test"
IMAGE = "paramserve:local"


def run(*argv: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
    # The classic builder unless told otherwise: BuildKit fetches the Dockerfile's syntax image
    # from Docker Hub, which a machine without a registry cannot reach.
    env = {**os.environ, "DOCKER_BUILDKIT": os.environ.get("DOCKER_BUILDKIT", "0")}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    if check and done.returncode != 0:
        raise AssertionError(f"{' '.join(argv)}: rc {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return done


def compose(*args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
    tool = ["docker", "compose"] if shutil.which("docker-compose") is None else ["docker-compose"]
    return run(*tool, "-p", PROJECT, "-f", str(COMPOSE), *args, timeout=timeout, check=check)


def why_not() -> str | None:
    if shutil.which("docker") is None:
        return "no docker command"
    if run("docker", "info", check=False, timeout=30).returncode != 0:
        return "no Docker engine answers `docker info` (start dockerd)"
    base = os.environ.get("PARAMSERVE_BASE_IMAGE", "python:3.11-slim")
    if (
        run("docker", "image", "inspect", base, check=False, timeout=30).returncode != 0
        and run("docker", "pull", base, check=False, timeout=300).returncode != 0
    ):
        return f"the base image {base} is neither here nor pullable (set PARAMSERVE_BASE_IMAGE to a local one)"
    return None


@pytest.fixture(scope="module")
def engine() -> None:
    reason = why_not()
    if reason is not None:
        pytest.skip(f"Compose on a real engine: {reason}")


@pytest.fixture(scope="module")
def torch_index() -> Iterator[str | None]:
    """A PEP 503 index of the torch wheel in PARAMSERVE_TORCH_WHEELS, on the host's loopback (the
    build runs with the host's network); None: the build uses PyTorch's own index."""
    wheels = os.environ.get("PARAMSERVE_TORCH_WHEELS")
    if not wheels:
        yield None
        return
    root = pathlib.Path(os.environ.get("TMPDIR", "/tmp")) / f"paramserve-index-{os.getpid()}"
    (root / "torch").mkdir(parents=True, exist_ok=True)
    for wheel in pathlib.Path(wheels).glob("torch-*.whl"):
        target = root / "torch" / wheel.name.replace("+", "%2B")
        if not target.exists():
            target.symlink_to(wheel)
    handler = functools.partial(_QuietHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    shutil.rmtree(root, ignore_errors=True)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass  # pip asks this index for every dependency; PyPI has them


def coordinator_log() -> str:
    return compose("logs", "--no-color", "--timestamps", "coordinator", check=False).stdout


def checkpoints() -> list[str]:
    listing = compose("exec", "-T", "coordinator", "ls", "/checkpoints", check=False)
    return sorted(name for name in listing.stdout.split() if name.startswith("ckpt-"))


def wait_for(condition, what: str, seconds: float) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {seconds:g}s\n{coordinator_log()[-3000:]}"
        time.sleep(1.0)


def test_the_compose_deployment_trains_through_a_graceful_stop_a_kill_and_a_scale_up(
    engine: None, torch_index: str | None, tmp_path: pathlib.Path
) -> None:
    build = ["docker", "build", "--network", "host", "-f", str(ROOT / "deploy" / "Dockerfile"), "-t", IMAGE]
    if os.environ.get("PARAMSERVE_BASE_IMAGE"):
        build += ["--build-arg", f"PYTHON_IMAGE={os.environ['PARAMSERVE_BASE_IMAGE']}"]
    if torch_index is not None:  # torch from the local index, its dependencies from PyPI
        build += [
            "--build-arg",
            f"TORCH_INDEX_URL={torch_index}",
            "--build-arg",
            "PIP_EXTRA_INDEX_URL=https://pypi.org/simple",
        ]
    started = time.monotonic()
    run(*build, str(ROOT), timeout=1200)
    built = time.monotonic() - started
    created_token = not TOKEN.exists()
    if created_token:
        TOKEN.write_text(os.urandom(16).hex() + "\n")
    try:
        compose("up", "-d", "--no-build", "--scale", "worker=2", timeout=600)
        wait_for(lambda: len(checkpoints()) >= 1, "a first checkpoint", 600)
        compose("up", "-d", "--no-build", "--no-recreate", "--scale", "worker=3", "worker")
        assert len(compose("ps", "-q", "worker").stdout.split()) == 3

        stopped_at = time.time()
        compose("exec", "-T", "ps0", "sh", "-c", "kill -TERM 1")  # a graceful stop from inside: the policy restarts it
        wait_for(lambda: coordinator_log().count("recovered (restored)") >= 1, "the recovery of ps0", 300)
        before_kill = len(checkpoints())
        compose("kill", "-s", "SIGKILL", "ps1")  # a crash; an API kill counts as manual: start it by hand
        compose("start", "ps1")
        wait_for(lambda: coordinator_log().count("recovered (restored)") >= 2, "the recovery of ps1", 300)
        wait_for(
            lambda: len(checkpoints()) > before_kill or "test accuracy" in coordinator_log(),
            "a checkpoint after the kill",
            600,
        )

        container = compose("ps", "-a", "-q", "coordinator").stdout.split()[0]
        assert run("docker", "wait", container, timeout=1200).stdout.strip() == "0", coordinator_log()[-3000:]
        log = coordinator_log()
        last = log.strip().splitlines()[-1]
        summary = json.loads(last[last.index("{") :])
        for name in checkpoints():
            ok = compose(
                "run",
                "--rm",
                "--no-deps",
                "--entrypoint",
                "python",
                "coordinator",
                "-c",
                f"from paramserve.psserver import checkpoint; import sys; "
                f"sys.exit(0 if checkpoint.is_whole(__import__('pathlib').Path('/checkpoints/{name}')) else 1)",
                check=False,
            )
            assert ok.returncode == 0, f"{name} is not whole: {ok.stderr[-500:]}"
        timeline = [
            line[:230] for line in log.splitlines() if re.search(r"suspect|recovering|answers \(|recovered", line)
        ]
        (tmp_path / "coordinator.log").write_text(log)
        print(
            f"\ncompose on a real engine: image built in {built:.0f} s; SIGTERM of ps0 at {stopped_at:.3f} (Unix); "
            f"{summary}\n" + "\n".join(timeline)
        )
        assert summary["steps"] == 4000 and summary["test_accuracy"] >= 0.9, summary
    finally:
        compose("down", "-v", "--timeout", "20", check=False, timeout=300)
        if created_token:
            TOKEN.unlink(missing_ok=True)
