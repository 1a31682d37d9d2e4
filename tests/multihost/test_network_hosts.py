"""Training across network hosts: every parameter server, worker and the coordinator in its own
network namespace, with its own address on a bridge this test makes (tests/multihost/network_hosts.py).

The demo trains to its accuracy while every host drops 1 % of the packets it sends (iptables'
statistic match: this kernel has no netem, so no added latency) and one worker's link is cut for
a few seconds and restored. The coordinator finds the workers by name (the worker service
resolves, through the coordinator host's /etc/hosts, to both workers' addresses). Nothing is applied
twice: in the final checkpoint every shard's version (pushes applied to it) equals the steps run.
Runs as root with `ip netns` (as in .ci/run); skips with the reason elsewhere.
"""

from __future__ import annotations

import json
import os
import pathlib
import time

import pytest
from network_hosts import NetworkHosts, paramserve

from paramserve.psserver.checkpoint import shard_files as checkpoint

pytestmark = pytest.mark.timeout(420)

SUBNET = "10.254.213.0/24"  # private; the test refuses to run if this machine routes it already
HOSTS = {
    "ps0": "10.254.213.11",
    "ps1": "10.254.213.12",
    "w0": "10.254.213.21",
    "w1": "10.254.213.22",
    "coord": "10.254.213.31",
}
WORKER_SERVICE = "workers.multihost.test"
STEPS = 400
LOSS = 0.01
CUT_SECONDS = 3.0


def wait_for_port_files(files: dict[str, pathlib.Path], processes: dict, deadline: float) -> None:  # type: ignore[type-arg]
    while not all(f.exists() for f in files.values()):
        for name, process in processes.items():
            if process.poll() is not None:
                raise AssertionError(f"{name} exited with {process.returncode} before serving")
        if time.monotonic() > deadline:
            raise AssertionError(f"not serving in time: {[n for n, f in files.items() if not f.exists()]}")
        time.sleep(0.1)


def test_the_demo_trains_across_hosts_through_loss_and_a_cut_link(requirements: None, tmp_path: pathlib.Path) -> None:
    token = tmp_path / "token"
    token.write_text("multihost-secret\n")
    checkpoints = tmp_path / "checkpoints"
    env = {**os.environ, "PARAMSERVE_PROCESSES_PER_HOST": str(len(HOSTS))}  # 5 processes share this machine's CPUs
    hosts = NetworkHosts(SUBNET, HOSTS, prefix=f"psmh{os.getpid()}")
    try:
        with hosts:
            hosts.hosts_file("coord", [(HOSTS["w0"], WORKER_SERVICE), (HOSTS["w1"], WORKER_SERVICE)])
            servers, port_files = {}, {}
            for host in ("ps0", "ps1", "w0", "w1"):
                role, port = ("ps", "5000") if host.startswith("ps") else ("worker", "6000")
                port_files[host] = tmp_path / f"{host}.port"
                servers[host] = hosts.start(
                    host,
                    paramserve(
                        role,
                        "--host",
                        HOSTS[host],
                        "--port",
                        port,
                        "--metrics-port",
                        "9100",
                        "--token-file",
                        str(token),
                        "--port-file",
                        str(port_files[host]),
                        "--grace-seconds",
                        "1",
                    ),
                    log=(tmp_path / f"{host}.log").open("wb"),
                    env=env,
                )
            wait_for_port_files(port_files, servers, time.monotonic() + 120)

            hosts.drop_outgoing(LOSS)
            retransmitted_before = hosts.tcp_retransmissions()
            started = time.monotonic()
            coordinator_log = tmp_path / "coordinator.log"
            coordinator = hosts.start(
                "coord",
                paramserve(
                    "demo",
                    "--cluster-from-env",
                    "--token-file",
                    str(token),
                    "--checkpoint-dir",
                    str(checkpoints),
                    "--steps",
                    str(STEPS),
                    "--checkpoint-every",
                    "100",
                    "--quiet",
                    "--json",
                ),
                log=coordinator_log.open("wb"),
                env={
                    **env,
                    "PARAMSERVE_PS": f"{HOSTS['ps0']}:5000,{HOSTS['ps1']}:5000",
                    "PARAMSERVE_WORKER_SERVICE": f"{WORKER_SERVICE}:6000",
                },
            )

            # Once the first checkpoint exists training runs: cut a worker's link, then restore it.
            while checkpoint.latest_checkpoint(checkpoints) is None if checkpoints.exists() else True:
                assert coordinator.poll() is None, coordinator_log.read_text()[-3000:]
                assert time.monotonic() - started < 240, "no checkpoint within 240 s"
                time.sleep(0.1)
            hosts.set_link("w1", up=False)
            time.sleep(CUT_SECONDS)
            hosts.set_link("w1", up=True)

            assert coordinator.wait(300) == 0, coordinator_log.read_text()[-3000:]
            seconds = time.monotonic() - started
            summary = json.loads(coordinator_log.read_text().strip().splitlines()[-1])
            dropped, retransmitted = hosts.dropped_packets(), hosts.tcp_retransmissions() - retransmitted_before
            print(
                f"\nmultihost: {STEPS} steps in {seconds:.1f} s across 5 hosts, {LOSS:.0%} of packets dropped "
                f"({dropped} packets, {retransmitted} TCP segments sent again), w1 cut for {CUT_SECONDS:g} s; "
                f"test accuracy {summary['test_accuracy']:.4f}"
            )
        assert not hosts.leftovers(), hosts.leftovers()
    finally:
        hosts.close()

    assert summary["steps"] == STEPS and summary["workers"] == 2 and summary["parameter_servers"] == 2
    assert summary["test_accuracy"] >= 0.9
    assert dropped > 0, "the loss rule dropped nothing: it was not exercised"
    manifest = checkpoint.read_manifest(checkpoint.latest_checkpoint(checkpoints))
    versions = {name: [shard.version for shard in entry.shards] for name, entry in manifest.variables.items()}
    assert versions and all(v == STEPS for shard_versions in versions.values() for v in shard_versions), versions
