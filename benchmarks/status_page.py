"""What the coordinator's status page costs, with 256 workers (closure_overhead_scale's harness:
real worker gRPC servers, 32 to a process, one parameter server, one coordinator in this process).

    python benchmarks/status_page.py [--json] [--workers 256] [--seconds 20] [--rounds 2]

- status_first_paint_256: the page's first contentful paint in headless Chromium (the browser's own
  Paint Timing), median of 5 loads while every worker has run closures, beside the issue's bound of
  1000 ms.
- status_page_cpu_256: the coordinator process's CPU-seconds over a run with the page served and
  one browser polling it, beside the same run without the page (alternating, medians of
  --rounds); the run schedules trivial closures for --seconds as fast as the coordinator takes them
  (the closure_overhead_scale load: the coordinator's own CPU is the bound).
  status_page_cpu_256_paced: the same with closures of 0.5 s (each worker busy, the coordinator
  mostly idle: the page's share is largest there). CPU per closure is compared, so a run that
  got through more closures is not charged for them.
- status_page_share_256 / _paced: the CPU the page itself spent in the page runs (its request
  threads and its sampler, timed per thread), as a share of the coordinator's CPU, beside the
  issue's bound of 2%.

Needs Chromium (Debian: apt-get install chromium) for the browser; without it the runs poll
/status.json once a second from this process instead, and say so.
"""

from __future__ import annotations

import argparse
import multiprocessing
import pathlib
import statistics
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass

from _common import Result, noop, one_torch_thread, print_report, serve_workers, worker_environment

from paramserve.coordinator import ClusterCoordinator, ClusterSpec, LocalCluster, ParameterServerStrategy

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from tests.browser import Browser, find_chromium

PAUSE = 0.5
"""Seconds one closure of the paced run takes on its worker."""
FIRST_PAINT = (
    "new Promise(done => { const look = () => { const p = performance.getEntriesByName('first-contentful-paint')[0];"
    " if (p) done(p.startTime); else setTimeout(look, 20); }; look(); })"
)


@dataclass
class Run:
    cpu: float
    closures: int
    page_cpu: float

    @property
    def cpu_us_per_closure(self) -> float:
        return 1e6 * self.cpu / self.closures


class Poller:
    """One browser on the page, or, without Chromium, this process fetching /status.json each second."""

    def __init__(self, chromium: str | None):
        self.browser = Browser(chromium) if chromium else None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, url: str) -> None:
        if self.browser is not None:
            self.browser.open(url)
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._poll, args=(url.replace("/?", "/status.json?"),), daemon=True)
        self._thread.start()

    def leave(self) -> None:
        if self.browser is not None:
            self.browser.open("about:blank")
        elif self._thread is not None:
            self._stop.set()
            self._thread.join()

    def _poll(self, url: str) -> None:
        while not self._stop.wait(1.0):
            urllib.request.urlopen(url, timeout=10).read()

    def close(self) -> None:
        if self.browser is not None:
            self.browser.close()


def one_run(spec: ClusterSpec, seconds: float, paced: bool, poller: Poller | None) -> Run:
    strategy = ParameterServerStrategy(spec)
    try:
        with ClusterCoordinator(strategy, status_port=0 if poller is not None else None) as coordinator:
            for _ in range(2 * len(spec.workers)):  # every worker connected and warm
                coordinator.schedule(noop)
            coordinator.join()
            if poller is not None:
                assert coordinator.status_url is not None
                poller.watch(coordinator.status_url)
            page_before = sum(coordinator._status.cpu_seconds) if coordinator._status is not None else 0.0
            cpu, closures, end = time.process_time(), 0, time.monotonic() + seconds
            while time.monotonic() < end:
                if paced:
                    coordinator.schedule(time.sleep, args=(PAUSE,))
                else:
                    coordinator.schedule(noop)
                closures += 1
            coordinator.join()
            cpu = time.process_time() - cpu
            page = sum(coordinator._status.cpu_seconds) - page_before if coordinator._status is not None else 0.0
            if poller is not None:
                poller.leave()
    finally:
        strategy.close()
    return Run(cpu, closures, page)


def first_paint_ms(spec: ClusterSpec, chromium: str, loads: int = 5) -> float:
    strategy = ParameterServerStrategy(spec)
    try:
        with ClusterCoordinator(strategy, status_port=0) as coordinator, Browser(chromium) as browser:
            for _ in range(2 * len(spec.workers)):
                coordinator.schedule(noop)
            coordinator.join()
            assert coordinator.status_url is not None
            paints = []
            for _ in range(loads + 1):  # the first load warms the browser's cache of fonts
                browser.open(coordinator.status_url)
                paints.append(float(browser.evaluate(FIRST_PAINT)))
                rows = browser.evaluate("document.querySelectorAll('#workers-body tr').length")
                assert rows == len(spec.workers), f"the page listed {rows} workers"
            browser.open("about:blank")
    finally:
        strategy.close()
    return statistics.median(paints[1:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--workers", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=20.0, help="length of one run")
    parser.add_argument("--rounds", type=int, default=2, help="runs with and without the page, alternating")
    args = parser.parse_args(argv)
    one_torch_thread()
    chromium = find_chromium()
    if chromium is None:
        print("no Chromium: the page runs are polled from this process, and first paint is not measured")
    context = multiprocessing.get_context("spawn")
    stop, queue = context.Event(), context.Queue()
    hosts = [
        context.Process(target=serve_workers, args=(min(32, args.workers - start), queue, stop), daemon=True)
        for start in range(0, args.workers, 32)
    ]
    for host in hosts:
        host.start()
    results: list[Result] = []
    n = args.workers
    try:
        addresses = tuple(address for _ in hosts for address in queue.get(timeout=120))
        with LocalCluster(num_ps=1, num_workers=1, env=worker_environment()) as cluster:
            spec = ClusterSpec(parameter_servers=cluster.spec.parameter_servers, workers=addresses)
            if chromium is not None:
                paint = first_paint_ms(spec, chromium)
                print(f"first contentful paint with {n} workers: {paint:.0f} ms")
                results.append(Result(f"status_first_paint_{n}", paint, "ms", 1000.0, "the issue's bound"))
            poller = Poller(chromium)
            try:
                for paced, suffix in ((False, ""), (True, "_paced")):
                    without, with_page = [], []
                    for _ in range(args.rounds):
                        without.append(one_run(spec, args.seconds, paced, None))
                        with_page.append(one_run(spec, args.seconds, paced, poller))
                        print(
                            f"  {'paced' if paced else 'saturated'}: without the page "
                            f"{without[-1].cpu:.2f} CPU-s / {without[-1].closures} closures, with it "
                            f"{with_page[-1].cpu:.2f} CPU-s / {with_page[-1].closures} (the page's own "
                            f"{with_page[-1].page_cpu:.3f} CPU-s)",
                            flush=True,
                        )
                    base = statistics.median(r.cpu_us_per_closure for r in without)
                    value = statistics.median(r.cpu_us_per_closure for r in with_page)
                    share = statistics.median(100 * r.page_cpu / r.cpu for r in with_page)
                    results.append(Result(f"status_page_cpu_{n}{suffix}", value, "CPU-us", base, "no page, same load"))
                    results.append(Result(f"status_page_share_{n}{suffix}", share, "%", 2.0, "the issue's bound (2%)"))
            finally:
                poller.close()
    finally:
        stop.set()
        for host in hosts:
            host.join(timeout=30)
            if host.is_alive():
                host.kill()
    print_report("status_page", results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
