"""Test doubles shared by the coordinator's integration and chaos tests: a strategy
exposing only what ClusterCoordinator needs, and a gate that closures on workers check
in at and wait behind, so a test knows a closure is running without sleeping."""

from __future__ import annotations

import itertools
import socket
import struct
import sys
import threading
from collections.abc import Callable, Iterator

import cloudpickle

from paramserve.coordinator.contracts import DispatchControl
from paramserve.coordinator.local_cluster import LocalCluster
from paramserve.psserver.protocol.types import ClusterContext

# check_in runs on workers, which cannot import the tests: send it by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


class FakeStrategy:
    """The three things ClusterCoordinator needs from a ParameterServerStrategy."""

    def __init__(self, cluster: LocalCluster, token: str | None):
        self.cluster = cluster.spec
        self.token = token
        self.tls = None
        self.max_value_age = 0.0
        self.overlap_pushes = False
        self.max_row_staleness = 0
        self.sync_dense = None
        self.attached: list[DispatchControl] = []

    def cluster_context(self) -> ClusterContext:
        return ClusterContext(self.cluster.parameter_servers)

    def attach_coordinator(self, coordinator: DispatchControl) -> None:
        self.attached.append(coordinator)  # no variables on parameter servers: nothing to recover


class Gate:
    """Closures check in (sending their worker index) and block until released."""

    def __init__(self, deadline: float = 60.0) -> None:
        self._deadline = deadline
        self._server = socket.create_server(("127.0.0.1", 0))
        self.address = self._server.getsockname()[:2]
        self._cond = threading.Condition()
        self._arrivals: list[int] = []
        self._held: list[socket.socket] = []
        self._open = False
        self._thread = threading.Thread(target=self._serve, name="test-gate", daemon=True)
        self._thread.start()

    def wait_for(self, predicate: Callable[[list[int]], bool], timeout: float | None = None) -> list[int]:
        """Blocks until ``predicate(arrivals)`` holds; returns the worker indices that arrived."""
        with self._cond:
            assert self._cond.wait_for(lambda: predicate(self._arrivals), timeout or self._deadline), (
                f"arrivals: {self._arrivals}"
            )
            return list(self._arrivals)

    def release_one(self) -> None:
        with self._cond:
            self._held.pop(0).close()  # EOF: the closure goes on

    def release(self) -> None:
        """Releases everyone, now and later."""
        with self._cond:
            self._open = True
            held, self._held = self._held, []
        for conn in held:
            conn.close()

    def close(self) -> None:
        self.release()
        self._server.shutdown(socket.SHUT_RDWR)
        self._server.close()
        self._thread.join(self._deadline)

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            conn.settimeout(self._deadline)
            data = conn.recv(4, socket.MSG_WAITALL)
            if len(data) < 4:  # the worker died while checking in
                conn.close()
                continue
            with self._cond:
                self._arrivals.append(struct.unpack("!i", data)[0])
                if self._open:
                    conn.close()
                else:
                    self._held.append(conn)
                self._cond.notify_all()


def check_in(gate_address: tuple[str, int], worker_index: int) -> None:
    """Runs on a worker: report to the gate and block until released."""
    with socket.create_connection(gate_address, timeout=120) as conn:
        conn.sendall(struct.pack("!i", worker_index))
        conn.recv(1)


Item = tuple[int, str, int]
"""(worker index, worker incarnation, position in that worker's stream)."""


def tagged_items(ctx) -> Iterator[Item]:  # type: ignore[no-untyped-def]
    """A per-worker dataset whose items say which worker process made them, and in what order."""
    return ((ctx.worker_index, ctx.incarnation, i) for i in itertools.count())


def item_at_gate(iterator: Iterator[Item], gate_address: tuple[str, int]) -> Item:
    """Takes the next item, then checks in at the Gate (so the test knows which worker runs)."""
    item = next(iterator)
    check_in(gate_address, item[0])
    return item
