"""Training while the status page is attacked (issue #43): a LocalCluster job quiet, then under a
flood of connections and slow clients at its page, in the same run.

    python benchmarks/status_flood.py [--json] [--seconds 15] [--connections 2000] [--slow 10]

The coordinator (this process, with the cluster's token, so the page asks for its key) trains the
small MLP (benchmarks/_common.py: 784-256-128-10, SGD on the server, one step per closure) on 1
parameter server and 2 workers, for --seconds quiet and then for --seconds while another process
attacks the page without the key: it keeps --connections connections open (each one the page
drops is opened again at once) and --slow clients sending a request a byte a second (opened again
when cut). In each phase a key holder reads /status.json twice a second, and a checkpoint is saved
(CheckpointManager) halfway through.

Results, each during the attack beside the quiet phase:

- status_flood_closures_per_s: training closures per second.
- status_flood_page_cpu: the page's own CPU (its I/O and request threads and its sampler,
  ``StatusPage.cpu_seconds``) in % of one core.
- status_flood_coordinator_cpu: the coordinator process's CPU in % of one core.
- status_flood_key_holder_ms: the slowest of the key holder's reads (its median is printed).
- status_flood_checkpoint_s: seconds the save took (inf: it did not return within 120 s).

Also printed: the coordinator's most open descriptors, the attacker's connections opened and cut,
and the page's drops and pauses by reason.
"""

from __future__ import annotations

import argparse
import errno
import math
import multiprocessing
import os
import resource
import selectors
import socket
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import torch
from _common import MLP, SMALL, Result, make_batch, one_torch_thread, print_report, train_step, worker_environment

from paramserve.coordinator import CheckpointManager, ClusterCoordinator, LocalCluster, ParameterServerStrategy

TOKEN = "status-flood-benchmark-token-0123456789"
READ_EVERY = 0.5
"""Seconds between the key holder's reads."""
SAVE_SECONDS = 120.0
"""How long a checkpoint save is waited for before it counts as never returning."""
SLOW_REQUEST = b"GET /status.json HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"s" * 64 + b"\r\n\r\n"


# ---------------------------------------------------------------- the attacker (another process)


def attack(port: int, connections: int, slow: int, ready: Any, stop: Any, results: Any) -> None:
    """Keeps ``connections`` silent connections and ``slow`` trickling ones open at the page,
    opening each one it drops again, until ``stop``; puts what it did in ``results``."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = connections + slow + 256
    resource.setrlimit(resource.RLIMIT_NOFILE, (needed if hard == resource.RLIM_INFINITY else min(needed, hard), hard))
    selector = selectors.DefaultSelector()
    counts = {"opened": 0, "cut": 0, "failed": 0}
    trickling: dict[socket.socket, int] = {}

    def open_one(trickles: bool) -> None:
        sock = socket.socket()
        sock.setblocking(False)
        if sock.connect_ex(("127.0.0.1", port)) not in (0, errno.EINPROGRESS):
            counts["failed"] += 1
            sock.close()
            return
        selector.register(sock, selectors.EVENT_READ, trickles)
        counts["opened"] += 1
        if trickles:
            trickling[sock] = 0

    try:
        for index in range(connections + slow):
            open_one(index >= connections)
        ready.set()
        next_byte = time.monotonic() + 1.0
        while not stop.is_set():
            for key, _ in selector.select(max(0.0, min(0.1, next_byte - time.monotonic()))):
                sock: socket.socket = key.fileobj  # type: ignore[assignment]
                try:
                    if sock.recv(4096):
                        continue  # a reply (a slow request completed): read and ignored
                except BlockingIOError:
                    continue
                except OSError:
                    pass
                selector.unregister(sock)
                trickling.pop(sock, None)
                sock.close()
                counts["cut"] += 1
                open_one(key.data)
            if time.monotonic() >= next_byte:
                next_byte += 1.0
                for sock, sent in list(trickling.items()):
                    try:
                        sock.send(SLOW_REQUEST[sent : sent + 1])
                        trickling[sock] = (sent + 1) % len(SLOW_REQUEST)
                    except OSError:
                        pass  # not connected yet, or cut: the selector says which
    finally:
        results.put(counts)
        selector.close()


# ---------------------------------------------------------------- one phase of training


@dataclass
class Phase:
    closures: int = 0
    seconds: float = 0.0
    cpu: float = 0.0
    page_cpu: float = 0.0
    reads_ms: list[float] = field(default_factory=list)
    checkpoint_s: float = math.inf
    descriptors: int = 0
    attacker: dict[str, int] = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=dict)


class KeyHolder:
    """Reads /status.json every READ_EVERY seconds, timing each read, and counts this process's
    open descriptors."""

    def __init__(self, url: str):
        self._url = url
        self._stop = threading.Event()
        self.reads_ms: list[float] = []
        self.descriptors = 0
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.wait(READ_EVERY):
            started = time.perf_counter()
            try:
                urllib.request.urlopen(self._url, timeout=30).read()
                self.reads_ms.append(1e3 * (time.perf_counter() - started))
            except OSError:
                self.reads_ms.append(math.inf)
            self.descriptors = max(self.descriptors, len(os.listdir("/proc/self/fd")))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)


def timed_save(manager: CheckpointManager, step: int) -> float:
    """Seconds ``manager.save(step)`` took, inf when it did not return within SAVE_SECONDS."""
    took = [math.inf]

    def save() -> None:
        started = time.perf_counter()
        manager.save(step)
        took[0] = time.perf_counter() - started

    saver = threading.Thread(target=save, daemon=True)
    saver.start()
    saver.join(SAVE_SECONDS)
    return took[0]


def train(coordinator: ClusterCoordinator, step: Any, manager: CheckpointManager, seconds: float) -> Phase:
    page = coordinator._status  # the benchmark reads the page's own CPU, as benchmarks/status_page.py does
    assert page is not None and coordinator.status_url is not None
    phase = Phase()
    holder = KeyHolder(coordinator.status_url.replace("/?", "/status.json?"))
    page_before, cpu, started = sum(page.cpu_seconds), time.process_time(), time.perf_counter()
    saved = False
    while (elapsed := time.perf_counter() - started) < seconds:
        for _ in range(16):
            coordinator.schedule(train_step, args=step)
        coordinator.join()
        phase.closures += 16
        if not saved and elapsed >= seconds / 2:
            phase.checkpoint_s, saved = timed_save(manager, phase.closures), True
    phase.seconds = time.perf_counter() - started
    phase.cpu = time.process_time() - cpu
    phase.page_cpu = sum(page.cpu_seconds) - page_before
    holder.stop()
    phase.reads_ms, phase.descriptors = holder.reads_ms, holder.descriptors
    phase.dropped = page.dropped()
    return phase


def report(name: str, phase: Phase) -> None:
    reads = phase.reads_ms or [math.inf]
    print(
        f"{name}: {phase.closures / phase.seconds:.1f} closures/s, coordinator CPU "
        f"{100 * phase.cpu / phase.seconds:.0f}% (page {100 * phase.page_cpu / phase.seconds:.1f}%), key holder "
        f"median {statistics.median(reads):.1f} ms / max {max(reads):.1f} ms over {len(phase.reads_ms)} reads, "
        f"checkpoint {phase.checkpoint_s:.2f} s, most descriptors {phase.descriptors}"
        + (f", attacker {phase.attacker}" if phase.attacker else "")
        + (f", page dropped {phase.dropped}" if phase.dropped else ""),
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--seconds", type=float, default=15.0, help="length of each phase")
    parser.add_argument("--connections", type=int, default=2000, help="the flood's silent connections")
    parser.add_argument("--slow", type=int, default=10, help="the flood's slow clients")
    args = parser.parse_args(argv)
    one_torch_thread()
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as directory:
        root = os.path.join(directory, "checkpoints")
        os.makedirs(root)
        with LocalCluster(
            num_ps=1, num_workers=2, token=TOKEN, env=worker_environment(), extra_ps_args=["--checkpoint-root", root]
        ) as cluster:
            strategy = ParameterServerStrategy(cluster.spec, token=TOKEN)
            try:
                with strategy.scope():
                    model = MLP(SMALL)
                optimizer = strategy.optimizer(torch.optim.SGD, lr=0.01)
                manager = CheckpointManager(strategy, root)
                with ClusterCoordinator(strategy, status_port=0) as coordinator:
                    batch = coordinator.create_per_worker_resource(make_batch(SMALL))
                    step = (batch, model, optimizer)
                    for _ in range(32):  # warm: every worker connected, the step's program sent
                        coordinator.schedule(train_step, args=step)
                    coordinator.join()
                    quiet = train(coordinator, step, manager, args.seconds)
                    report("quiet", quiet)
                    assert coordinator._status is not None
                    ready, stop, results = context.Event(), context.Event(), context.Queue()
                    attacker = context.Process(
                        target=attack,
                        args=(coordinator._status.port, args.connections, args.slow, ready, stop, results),
                        daemon=True,
                    )
                    attacker.start()
                    try:
                        if not ready.wait(60):
                            raise RuntimeError("the attacker did not open its connections within 60 s")
                        attacked = train(coordinator, step, manager, args.seconds)
                    finally:
                        stop.set()
                        attacked_counts = results.get(timeout=60)
                        attacker.join(30)
                        if attacker.is_alive():
                            attacker.kill()
                    attacked.attacker = attacked_counts
                    report("attacked", attacked)
            finally:
                strategy.close()
    results_list = [
        Result(
            "status_flood_closures_per_s",
            attacked.closures / attacked.seconds,
            "1/s",
            quiet.closures / quiet.seconds,
            "quiet",
        ),
        Result(
            "status_flood_page_cpu",
            100 * attacked.page_cpu / attacked.seconds,
            "%",
            100 * quiet.page_cpu / quiet.seconds,
            "quiet",
        ),
        Result(
            "status_flood_coordinator_cpu",
            100 * attacked.cpu / attacked.seconds,
            "%",
            100 * quiet.cpu / quiet.seconds,
            "quiet",
        ),
        Result(
            "status_flood_key_holder_ms",
            max(attacked.reads_ms or [math.inf]),
            "ms",
            max(quiet.reads_ms or [math.inf]),
            "quiet",
        ),
        Result("status_flood_checkpoint_s", attacked.checkpoint_s, "s", quiet.checkpoint_s, "quiet"),
    ]
    print_report("status_flood", results_list, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
