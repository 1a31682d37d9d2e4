"""A replicated primary cut off from the coordinator but not from the worker: once its backup has
taken over it acknowledges no write, and when the link comes back it rejoins as a backup.

Every process runs on a host of its own (tests/multihost/network_hosts.py): the shard group's
primary on ``psa``, its backup on ``psb``, a worker on ``w0`` and the coordinator's program
(tests/multihost/partition_driver.py) on ``coord``. Once training runs, ``psa`` drops every
packet to and from the coordinator's host (iptables in its namespace); it still reaches ``psb``
and the worker. The coordinator's probes lose it and promote ``psb``; every closure completes.
Then a client on the worker's host, which still reaches ``psa``, pushes to it: the push is
refused, since ``psb`` refuses ``psa``'s forward of the old epoch, and appears nowhere. When the
link is restored, ``psa`` rejoins as ``psb``'s backup by a copy: the two end bit for bit equal,
every shard's version the steps acknowledged. Runs as root with `ip netns`; skips elsewhere.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

import pytest
from network_hosts import NetworkHosts, paramserve, wait_for

pytestmark = pytest.mark.timeout(600)

SUBNET = "10.254.215.0/24"  # private; the test refuses to run if this machine routes it already
HOSTS = {"psa": "10.254.215.11", "psb": "10.254.215.12", "w0": "10.254.215.21", "coord": "10.254.215.31"}
PS_A, PS_B, WORKER = f"{HOSTS['psa']}:5000", f"{HOSTS['psb']}:5000", f"{HOSTS['w0']}:6000"
DRIVER = pathlib.Path(__file__).with_name("partition_driver.py")

PROBE = """
import json, sys, torch
from paramserve.psserver.client.ps_client import ClientConfig, ParameterServerClient
from paramserve.psserver.protocol.errors import ParamServeError
from paramserve.psserver.runtime.security import read_token_file
import pathlib
token = read_token_file(pathlib.Path(sys.argv[2]))
client = ParameterServerClient([sys.argv[1]], ClientConfig(token=token, retry_deadline=1.0, call_timeout=5.0))
layouts = client.discover()
name = sorted(layouts)[0]
try:
    client.push({name: torch.zeros(layouts[name].shape)}, key="from-a-cut-off-worker")
    print(json.dumps({"acknowledged": True}))
except ParamServeError as err:
    print(json.dumps({"acknowledged": False, "error": type(err).__name__, "message": str(err)}))
"""


def cut(hosts: NetworkHosts, host: str, peer: str, on: bool) -> None:
    """``host`` drops (or stops dropping) every packet to and from ``peer``."""
    action = "-A" if on else "-D"
    hosts.exec(host, "iptables", action, "INPUT", "-s", HOSTS[peer], "-j", "DROP")
    hosts.exec(host, "iptables", action, "OUTPUT", "-d", HOSTS[peer], "-j", "DROP")


def test_a_primary_cut_off_from_the_coordinator_acknowledges_nothing_after_its_backup_took_over(
    requirements: None, tmp_path: pathlib.Path
) -> None:
    token = tmp_path / "token"
    token.write_text("partition-secret\n")
    control = tmp_path / "control"
    control.mkdir()
    env = {**os.environ, "PARAMSERVE_PROCESSES_PER_HOST": str(len(HOSTS))}
    hosts = NetworkHosts(SUBNET, HOSTS, prefix=f"pspt{os.getpid()}")
    try:
        with hosts:
            ready = []
            for host, role, port in (("psa", "ps", 5000), ("psb", "ps", 5000), ("w0", "worker", 6000)):
                port_file = tmp_path / f"{host}.port"
                own = ("--data-port", str(port + 1)) if role == "ps" else ("--ps-retry-deadline", "10")
                argv = [role, "--host", HOSTS[host], "--port", str(port), *own, "--token-file", str(token)]
                log = (tmp_path / f"{host}.log").open("wb")
                hosts.start(host, paramserve(*argv, "--port-file", str(port_file), "--grace-seconds", "1"), log, env)
                ready.append(port_file)
            wait_for(lambda: all(f.exists() for f in ready), "servers up", 120)
            driver_log = tmp_path / "driver.log"
            driver = hosts.start(
                "coord",
                [sys.executable, str(DRIVER), str(control), PS_A, PS_B, WORKER, str(token)],
                log=driver_log.open("wb"),
                env=env,
            )
            alive = lambda: None if driver.poll() is None else pytest.fail(driver_log.read_text()[-4000:])  # noqa: E731
            wait_for((control / "phase1.json").exists, "training running", 240, alive)
            assert json.loads((control / "phase1.json").read_text())["primary"] == PS_A

            cut(hosts, "psa", "coord", on=True)
            wait_for((control / "phase2.json").exists, "every closure done after the failover", 240, alive)
            phase2 = json.loads((control / "phase2.json").read_text())
            assert phase2["primary"] == PS_B, phase2
            assert [PS_A, "failed-over"] in phase2["recoveries"], phase2

            probe = hosts.exec("w0", sys.executable, "-c", PROBE, PS_A, str(token))
            pushed = json.loads(probe.strip().splitlines()[-1])
            assert pushed["acknowledged"] is False and pushed["error"] == "NotPrimaryError", pushed

            cut(hosts, "psa", "coord", on=False)
            (control / "healed").touch()
            assert driver.wait(240) == 0, driver_log.read_text()[-4000:]
            final = json.loads((control / "final.json").read_text())
        assert not hosts.leftovers(), hosts.leftovers()
    finally:
        hosts.close()

    members = final["members"]
    a, b = members[PS_A], members[PS_B]
    assert a == b, "the rejoined server holds exactly the primary's shards"
    for ref, shard in b.items():
        assert shard["version"] == final["steps"] == len(set(shard["keys"])), ref
        assert "from-a-cut-off-worker" not in shard["keys"], f"{ref}: the cut-off primary's write was kept"
