"""Hosts on a private network, made of Linux network namespaces, for tests/multihost.

Every host is a namespace with one veth link to a bridge that lives in a namespace of its
own, so the root namespace gets no interface and no address, and no two hosts share a
loopback. Before anything exists, the root namespace gets ``unreachable <subnet>``: a
connection to a host's address from outside the namespaces fails at once instead of
following the default route out of the machine. The hosts have no default route either, so
nothing in them reaches any address but the subnet's. ``close()`` removes every process,
namespace, link, file and route made here, whatever failed before.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

NETNS_ETC = Path("/etc/netns")  # `ip netns exec NS` mounts /etc/netns/NS/* over /etc/*


class NetworkError(RuntimeError):
    pass


def missing_requirements() -> str | None:
    """Why these tests cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None:
            return f"needs `{tool}`"
    probe = f"psmh-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    try:
        rule = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                probe,
                "iptables",
                "-A",
                "OUTPUT",
                "-m",
                "statistic",
                "--mode",
                "random",
                "--probability",
                "0.5",
                "-j",
                "DROP",
            ],
            capture_output=True,
            text=True,
        )
        if rule.returncode != 0:
            return f"iptables' statistic match does not work here: {rule.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def paramserve(*args: str) -> list[str]:
    """The ``paramserve`` command line with this interpreter (what a host runs)."""
    return [sys.executable, "-m", "paramserve.coordinator.commands.cli", *args]


def run(*argv: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise NetworkError(f"{' '.join(argv)}: rc {done.returncode}: {done.stderr.strip()}")
    return done.stdout


class NetworkHosts:
    """Hosts ``name -> address`` on ``subnet``, joined by a bridge. Use as a context manager."""

    def __init__(self, subnet: str, hosts: dict[str, str], prefix: str):
        self.subnet = ipaddress.ip_network(subnet)
        for name, address in hosts.items():
            if ipaddress.ip_address(address) not in self.subnet:
                raise ValueError(f"{name}: {address} is not in {subnet}")
        self.addresses = dict(hosts)
        self._prefix = prefix
        self._bridge = f"{prefix}-br"
        self._processes: list[subprocess.Popen[bytes]] = []
        self._started_on: dict[str, list[subprocess.Popen[bytes]]] = {}
        self._namespaces: list[str] = []
        self._etc_dirs: list[Path] = []
        self._guarded = False

    def namespace(self, host: str) -> str:
        return f"{self._prefix}-{host}"

    # ---------------------------------------------------------------- making it

    def __enter__(self) -> NetworkHosts:
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _make(self) -> None:
        existing = run("ip", "route", "show", "match", str(self.subnet))
        if any(not line.startswith("default") for line in existing.splitlines() if line.strip()):
            raise NetworkError(f"{self.subnet} is routed on this machine already: {existing.strip()}")
        run("ip", "route", "add", "unreachable", str(self.subnet))  # first: nothing can leak to a real network
        self._guarded = True
        self._add_namespace(self._bridge)
        run("ip", "-n", self._bridge, "link", "add", "br0", "type", "bridge")
        run("ip", "-n", self._bridge, "link", "set", "br0", "up")
        for index, (host, address) in enumerate(self.addresses.items()):
            namespace = self.namespace(host)
            self._add_namespace(namespace)
            inside, outside = f"eth{index}", f"port{index}"
            # The pair is made straight between the two namespaces: nothing appears in the root one.
            run(
                "ip",
                "link",
                "add",
                inside,
                "netns",
                namespace,
                "type",
                "veth",
                "peer",
                "name",
                outside,
                "netns",
                self._bridge,
            )
            run("ip", "-n", self._bridge, "link", "set", outside, "master", "br0")
            run("ip", "-n", self._bridge, "link", "set", outside, "up")
            run("ip", "-n", namespace, "addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", inside)
            run("ip", "-n", namespace, "link", "set", inside, "up")
            run("ip", "-n", namespace, "link", "set", "lo", "up")
            routes = run("ip", "-n", namespace, "route", "show").split("\n")
            if any(line.startswith("default") for line in routes):
                raise NetworkError(f"{namespace} has a default route: {routes}")

    def _add_namespace(self, name: str) -> None:
        run("ip", "netns", "add", name)
        self._namespaces.append(name)

    def hosts_file(self, host: str, entries: Sequence[tuple[str, str]]) -> None:
        """``/etc/hosts`` as processes on ``host`` see it: localhost plus ``(address, name)``."""
        directory = NETNS_ETC / self.namespace(host)
        directory.mkdir(parents=True, exist_ok=True)
        self._etc_dirs.append(directory)
        lines = ["127.0.0.1 localhost"] + [f"{address} {name}" for address, name in entries]
        (directory / "hosts").write_text("\n".join(lines) + "\n")

    # ---------------------------------------------------------------- using it

    def start(
        self, host: str, argv: Sequence[str], log: IO[bytes], env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        """Starts ``argv`` on ``host`` (``ip netns exec`` execs it: the pid is the program's)."""
        process = subprocess.Popen(
            ["ip", "netns", "exec", self.namespace(host), *argv],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        self._processes.append(process)
        self._started_on.setdefault(host, []).append(process)
        return process

    def processes_on(self, host: str) -> list[subprocess.Popen[bytes]]:
        """The processes ``start`` started on ``host`` that still run."""
        return [process for process in self._started_on.get(host, []) if process.poll() is None]

    def exec(self, host: str, *argv: str) -> str:
        return run("ip", "netns", "exec", self.namespace(host), *argv)

    def drop_outgoing(self, probability: float) -> None:
        """Every host drops this share of the packets it sends to the subnet, at random."""
        for host in self.addresses:
            self.exec(
                host,
                "iptables",
                "-A",
                "OUTPUT",
                "-d",
                str(self.subnet),
                "-m",
                "statistic",
                "--mode",
                "random",
                "--probability",
                f"{probability:.4f}",
                "-j",
                "DROP",
            )

    def dropped_packets(self) -> int:
        total = 0
        for host in self.addresses:
            for line in self.exec(host, "iptables", "-L", "OUTPUT", "-v", "-x", "-n").splitlines():
                fields = line.split()
                if len(fields) > 2 and fields[2] == "DROP":
                    total += int(fields[0])
        return total

    def tcp_retransmissions(self) -> int:
        """Segments TCP sent again, over every host (each namespace counts its own)."""
        total = 0
        for host in self.addresses:
            lines = [
                line.split()
                for line in self.exec(host, "cat", "/proc/net/snmp").splitlines()
                if line.startswith("Tcp:")
            ]
            total += int(lines[1][lines[0].index("RetransSegs")])
        return total

    def set_link(self, host: str, up: bool) -> None:
        """Cuts or restores ``host``'s link, at the bridge's end."""
        index = list(self.addresses).index(host)
        run("ip", "-n", self._bridge, "link", "set", f"port{index}", "up" if up else "down")

    # ---------------------------------------------------------------- removing it

    def close(self) -> None:
        for process in self._processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for process in self._processes:
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)
        for namespace in reversed(self._namespaces):
            # Anything still inside a namespace made here was started here (a child's child).
            for pid in subprocess.run(
                ["ip", "netns", "pids", namespace], capture_output=True, text=True
            ).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
        self._namespaces.clear()
        for directory in self._etc_dirs:
            shutil.rmtree(directory, ignore_errors=True)
        if self._guarded:
            subprocess.run(["ip", "route", "del", "unreachable", str(self.subnet)], capture_output=True)
            self._guarded = False

    def leftovers(self) -> list[str]:
        """What close() should have removed and did not."""
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        left = [line.split()[0] for line in names.splitlines() if line.startswith(f"{self._prefix}-")]
        routes = run("ip", "route", "show", "match", str(self.subnet)).splitlines()
        left += [route for route in routes if route.startswith("unreachable")]
        left += [str(p) for p in self._etc_dirs if p.exists()]
        left += [f"pid {p.pid}" for p in self._processes if p.poll() is None]
        return left


def wait_for(condition, what: str, seconds: float, check=lambda: None) -> None:  # type: ignore[no-untyped-def]
    """Polls ``condition`` until it holds; ``check`` runs between polls (e.g. fails the test when
    a process it waits on died); fails naming ``what`` after ``seconds``."""
    deadline = time.monotonic() + seconds
    while not condition():
        check()
        assert time.monotonic() < deadline, f"{what}: not within {seconds:g}s"
        time.sleep(0.05)
