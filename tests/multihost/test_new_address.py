"""A parameter server replaced at a new address under the same name, as a container or a pod
comes back: the coordinator and the workers reach the server by name, the name moves to the
replacement's address, and training finishes as if the server had restarted in place.

Every process runs on a host of its own (tests/multihost/network_hosts.py). The cluster names
its parameter servers ``ps0.paramserve.test`` and ``ps1.paramserve.test``, which each host's
/etc/hosts resolves. ps0 runs on host ps0a; it is SIGKILLed and its host's link cut (the old
address is gone, as a removed container's is), the name is pointed at host ps0b, and ps0 starts
there empty. The coordinator restores it from the newest checkpoint; training resumes within a
few seconds of the replacement serving, ends as well as a clean run, applies nothing twice, and
leaves only whole checkpoints. Runs as root with `ip netns` (as in .ci/run); skips elsewhere.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess

import pytest
import torch
from network_hosts import NetworkHosts, paramserve, wait_for

from paramserve.coordinator.demos.digits import MLP, digits_split
from paramserve.psserver.checkpoint import shard_files as checkpoint
from paramserve.psserver.protocol.types import ShardRef

pytestmark = pytest.mark.timeout(600)

SUBNET = "10.254.214.0/24"  # private; the test refuses to run if this machine routes it already
HOSTS = {
    "ps0a": "10.254.214.11",
    "ps0b": "10.254.214.12",
    "ps1": "10.254.214.13",
    "w0": "10.254.214.21",
    "w1": "10.254.214.22",
    "coord": "10.254.214.31",
}
NAMES = {"ps0": "ps0.paramserve.test", "ps1": "ps1.paramserve.test"}
STEPS, CHECKPOINT_EVERY = 1200, 48
CLIENTS = ("coord", "w0", "w1")
"""The hosts that reach the parameter servers by name."""


def point_names(hosts: NetworkHosts, ps0_host: str) -> None:
    """Every client's /etc/hosts: ps0's name at ``ps0_host``'s address, ps1's at ps1's."""
    for client in CLIENTS:
        hosts.hosts_file(client, [(HOSTS[ps0_host], NAMES["ps0"]), (HOSTS["ps1"], NAMES["ps1"])])


def start_server(
    hosts: NetworkHosts, host: str, role: str, name: str, tmp_path: pathlib.Path, env: dict
) -> pathlib.Path:  # type: ignore[type-arg]
    port_file = tmp_path / f"{name}-{host}.port"
    own = ("--port", "5000", "--data-port", "5001") if role == "ps" else ("--port", "6000", "--ps-retry-deadline", "10")
    argv = [
        role,
        "--host",
        HOSTS[host],
        *own,
        "--token-file",
        str(tmp_path / "token"),
        "--port-file",
        str(port_file),
        "--grace-seconds",
        "1",
    ]
    process = hosts.start(host, paramserve(*argv), log=(tmp_path / f"{name}-{host}.log").open("wb"), env=env)
    assert process.poll() is None
    return port_file


def test_a_parameter_server_replaced_at_a_new_address_is_reached_by_name(
    requirements: None, tmp_path: pathlib.Path
) -> None:
    clean = tmp_path / "clean"  # the same training on one host, nothing going wrong: the reference
    ran = subprocess.run(
        paramserve(
            "demo",
            "--checkpoint-dir",
            str(clean),
            "--steps",
            str(STEPS),
            "--checkpoint-every",
            str(CHECKPOINT_EVERY),
            "--quiet",
            "--json",
        ),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ran.returncode == 0, ran.stderr[-3000:]
    (tmp_path / "token").write_text("new-address-secret\n")
    checkpoints = tmp_path / "checkpoints"
    env = {**os.environ, "PARAMSERVE_PROCESSES_PER_HOST": str(len(HOSTS) - 1)}
    hosts = NetworkHosts(SUBNET, HOSTS, prefix=f"psna{os.getpid()}")
    try:
        with hosts:
            point_names(hosts, "ps0a")
            ready = [
                start_server(hosts, host, role, name, tmp_path, env)
                for host, role, name in (
                    ("ps0a", "ps", "ps0"),
                    ("ps1", "ps", "ps1"),
                    ("w0", "worker", "w0"),
                    ("w1", "worker", "w1"),
                )
            ]
            wait_for(lambda: all(f.exists() for f in ready), "servers up", 120)
            log = tmp_path / "coordinator.log"
            coordinator = hosts.start(
                "coord",
                paramserve(
                    "demo",
                    "--cluster-from-env",
                    "--token-file",
                    str(tmp_path / "token"),
                    "--checkpoint-dir",
                    str(checkpoints),
                    "--steps",
                    str(STEPS),
                    "--checkpoint-every",
                    str(CHECKPOINT_EVERY),
                    "--quiet",
                    "--json",
                ),
                log=log.open("wb"),
                env={
                    **env,
                    "PARAMSERVE_PS": f"{NAMES['ps0']}:5000,{NAMES['ps1']}:5000",
                    "PARAMSERVE_WORKERS": f"{HOSTS['w0']}:6000,{HOSTS['w1']}:6000",
                },
            )
            alive = lambda: None if coordinator.poll() is None else pytest.fail(log.read_text()[-3000:])  # noqa: E731
            wait_for(lambda: len(list(checkpoints.glob("ckpt-*"))) >= 3, "three checkpoints", 240, alive)

            for process in hosts.processes_on("ps0a"):
                process.kill()  # SIGKILL: nothing drains
            hosts.set_link("ps0a", up=False)  # and its address is gone, as a removed container's
            point_names(hosts, "ps0b")
            replacement = start_server(hosts, "ps0b", "ps", "ps0", tmp_path, env)
            wait_for(replacement.exists, "the replacement serving", 120, alive)
            served_at = replacement.stat().st_mtime
            wait_for(
                lambda: any(p.stat().st_mtime > served_at for p in checkpoints.glob("ckpt-*")),
                "a checkpoint after the replacement served",
                120,
                alive,
            )
            resumed_after = min(p.stat().st_mtime for p in checkpoints.glob("ckpt-*") if p.stat().st_mtime > served_at)

            assert coordinator.wait(300) == 0, log.read_text()[-3000:]
            summary = json.loads(log.read_text().strip().splitlines()[-1])
        assert not hosts.leftovers(), hosts.leftovers()
    finally:
        hosts.close()

    seconds = resumed_after - served_at
    print(
        f"\nnew address: training resumed {seconds:.2f} s after the replacement at {HOSTS['ps0b']} served "
        f"(a checkpoint every {CHECKPOINT_EVERY} steps bounds this from above)"
    )
    assert "restored from" in log.read_text(), "the replacement was restored from a checkpoint"
    assert summary["steps"] == STEPS and summary["test_accuracy"] >= 0.9, summary
    assert seconds <= 10, f"training resumed {seconds:.1f} s after the replacement served"
    final = checkpoint.latest_checkpoint(checkpoints)
    assert final is not None
    for path in checkpoints.glob("ckpt-*"):
        assert checkpoint.is_whole(path), path
    for name, entry in checkpoint.variables(final).items():
        for saved in entry.shards:
            contents = torch.load(final / saved.file, weights_only=True)
            keys = contents["applied_keys"]
            assert len(set(keys)) == len(keys) and saved.version == len(keys), f"{name}/{saved.shard} applied twice"
    clean_accuracy = accuracy_of(checkpoint.latest_checkpoint(clean))
    assert abs(accuracy_of(final) - clean_accuracy) <= 0.01 and clean_accuracy >= 0.9, (
        accuracy_of(final),
        clean_accuracy,
    )


def accuracy_of(path: pathlib.Path) -> float:
    """The checkpoint's model on all 1,797 digits."""
    model = MLP(128)
    state = {
        name: checkpoint.load_rows(path, name, 0, entry.num_rows, ShardRef(name, 0)).value
        for name, entry in checkpoint.variables(path).items()
    }
    model.load_state_dict(
        {
            name.removeprefix("mlp."): value.reshape(model.state_dict()[name.removeprefix("mlp.")].shape)
            for name, value in state.items()
        }
    )
    x_train, y_train, x_test, y_test = digits_split(0)
    with torch.no_grad():
        predicted = model(torch.cat([x_train, x_test])).argmax(dim=1)
    return float((predicted == torch.cat([y_train, y_test])).float().mean())
