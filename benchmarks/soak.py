"""A long run: does every process's memory stay flat once it is warm?

    python benchmarks/soak.py [--json] [--minutes 12] [--workers 4] [--warmup-minutes 1]
        [--warmup-steps 0] [--closure-steps 1] [--batch 200] [--diagnostics DIR [--tracemalloc 1]]

2 parameter servers and --workers workers (LocalCluster, one torch thread each) train the demo's
MLP (64-32-10, Adam) as fast as they can for --minutes: closures of --closure-steps steps,
scheduled --batch at a time and joined. Every 15 s the resident memory (VmRSS), threads and file
descriptors of each server, each worker and this process (the coordinator) are read beside the
steps done. Warm-up ends at the first sample past both --warmup-minutes and --warmup-steps; that
sample is the baseline.

- ps_rss_growth_pct: a server's resident memory at the last sample over its baseline, in percent
  (the larger of the two servers); ps_rss_slope_last_half: the least-squares slope of its memory
  over the last half of the time after warm-up, in percent of the baseline per 10 minutes (a
  window that fills and stops shows as growth with a slope near zero; a leak keeps its slope).
- worker_rss_growth_pct, coordinator_rss_growth_pct: the same growth for the largest-growing
  worker and for this process.
- threads_growth, descriptors_growth: the most any process gained over its baseline.
- With --diagnostics DIR each server and worker writes a JSON dump into DIR on SIGUSR1
  (psserver/runtime/diagnostics.py: malloc arenas, descriptors, per-worker and per-key structure
  sizes, and with --tracemalloc FRAMES the Python allocation sites that grew); this script asks
  the servers for one at the end of warm-up, every --diagnostics-every seconds and at the end.
- The series (steps, MB per server, ...) is printed to stderr and in the JSON's ``series``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path

import _common
import torch
from _common import Result, print_report, worker_environment

from paramserve.coordinator import ClusterCoordinator
from paramserve.coordinator.demos.digits import MLP, train_step, worker_batches
from paramserve.coordinator.local_cluster import LocalCluster
from paramserve.coordinator.strategies.parameter_server import ParameterServerStrategy
from paramserve.psserver.runtime.diagnostics import DIRECTORY_ENV, TRACEMALLOC_ENV

_common.one_torch_thread()
SAMPLE_EVERY = 15.0


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs."""
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    denominator = sum((x - mean_x) ** 2 for x in xs)
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / denominator if denominator else 0.0


def process_figures(pid: int) -> tuple[float, int, int]:
    """(resident MB, threads, file descriptors) of a live process, from /proc."""
    threads, rss_mb = _common.process_threads_and_rss_mb(pid)
    return round(rss_mb, 1), threads, len(os.listdir(f"/proc/{pid}/fd"))


Sample = dict[str, object]
"""One sample: seconds since the start, steps, and per process (name -> [MB, threads, fds])."""


class DiagnosticsRequests:
    """Asks each server for a diagnostics dump (SIGUSR1) and waits, with a deadline, for its file."""

    def __init__(self, directory: Path, pids: dict[str, int]):
        self.directory, self.pids, self.count = directory, pids, 0

    def request(self, label: str, deadline_seconds: float = 60.0) -> None:
        self.count += 1
        for pid in self.pids.values():
            os.kill(pid, signal.SIGUSR1)
        deadline = time.monotonic() + deadline_seconds
        for name, pid in self.pids.items():
            path = self.directory / f"{name.split()[0]}-{pid}-{self.count}.json"
            while not path.exists():
                if time.monotonic() > deadline:
                    raise SystemExit(f"{name} (pid {pid}) wrote no diagnostics to {path} within {deadline_seconds}s")
                time.sleep(0.2)  # polling a file another process writes, under a deadline
            print(f"diagnostics {label}: {path}", file=sys.stderr, flush=True)


def soak(args: argparse.Namespace) -> tuple[list[Sample], float | None]:
    """A sample every SAMPLE_EVERY seconds for ``args.minutes``, and when warm-up ended (seconds)."""
    series: list[Sample] = []
    env = worker_environment()
    if args.diagnostics:
        args.diagnostics.mkdir(parents=True, exist_ok=True)
        env[DIRECTORY_ENV] = str(args.diagnostics.resolve())
        if args.tracemalloc:
            env[TRACEMALLOC_ENV] = str(args.tracemalloc)
    warm_at: float | None = None
    with LocalCluster(2, args.workers, env=env) as cluster:
        pids = {f"{p.role} {p.index}": p.pid for p in cluster.processes if p.role in ("ps", "worker")}
        pids["coordinator"] = os.getpid()
        servers = {name: pid for name, pid in pids.items() if name.startswith("ps")}
        requests = DiagnosticsRequests(args.diagnostics, servers) if args.diagnostics else None
        strategy = ParameterServerStrategy(cluster.spec)
        with strategy.scope():
            model = MLP(32)
        optimizer = strategy.optimizer(torch.optim.Adam, lr=1e-3)
        with ClusterCoordinator(strategy) as coordinator:
            batches = iter(coordinator.create_per_worker_dataset(worker_batches))
            start = time.monotonic()
            end, next_sample, next_dump, steps = start + args.minutes * 60, 0.0, float("inf"), 0
            while time.monotonic() < end:
                values = [
                    coordinator.schedule(train_step, args=(batches, model, optimizer), steps=args.closure_steps)
                    for _ in range(args.batch)
                ]
                coordinator.join()
                assert all(torch.isfinite(v.fetch()) for v in values)
                steps += args.closure_steps * len(values)
                now = time.monotonic()
                if now >= next_sample:
                    next_sample = now + SAMPLE_EVERY
                    sample: Sample = {"seconds": round(now - start, 1), "steps": steps}
                    sample.update({name: list(process_figures(pid)) for name, pid in pids.items()})
                    series.append(sample)
                    shown = {name: figures[0] for name, figures in sample.items() if isinstance(figures, list)}
                    print(f"{now - start:7.0f}s steps {steps:8d}  MB {shown}", file=sys.stderr, flush=True)
                    if warm_at is None and now - start >= args.warmup_minutes * 60 and steps >= args.warmup_steps:
                        warm_at = now - start
                        if requests is not None:
                            requests.request("end of warm-up")
                            next_dump = time.monotonic() + args.diagnostics_every
                if requests is not None and time.monotonic() >= next_dump:
                    requests.request(f"at {time.monotonic() - start:.0f}s")
                    next_dump = time.monotonic() + args.diagnostics_every
            if requests is not None:
                requests.request("at the end")
        strategy.close()
    return series, warm_at


def summarize(series: list[Sample], warm_at: float) -> dict[str, dict[str, float]]:
    """Per process: its baseline MB, growth (% of it), last-half slope (% of it per 10 min), and
    its threads' and descriptors' gain over the baseline (the most seen)."""
    warm = [sample for sample in series if float(sample["seconds"]) >= warm_at]  # type: ignore[arg-type]
    if len(warm) < 3:
        raise SystemExit(f"only {len(warm)} samples after warm-up: run longer (--minutes)")
    first, last = float(warm[0]["seconds"]), float(warm[-1]["seconds"])  # type: ignore[arg-type]
    half = [sample for sample in warm if float(sample["seconds"]) >= (first + last) / 2]  # type: ignore[arg-type]
    summary = {}
    for name, base in warm[0].items():
        if not isinstance(base, list):
            continue
        base_mb = base[0]
        minutes = [float(sample["seconds"]) / 60 for sample in half]  # type: ignore[arg-type]
        per_minute = slope(minutes, [sample[name][0] for sample in half])  # type: ignore[index]
        summary[name] = {
            "baseline_mb": base_mb,
            "last_mb": warm[-1][name][0],  # type: ignore[index]
            "growth_pct": 100.0 * (warm[-1][name][0] - base_mb) / base_mb,  # type: ignore[index]
            "peak_growth_pct": 100.0 * (max(sample[name][0] for sample in warm) - base_mb) / base_mb,  # type: ignore[index]
            "slope_last_half_pct_per_10min": 100.0 * per_minute * 10 / base_mb,
            "slope_last_half_mb_per_min": per_minute,
            "threads_growth": max(sample[name][1] for sample in warm) - base[1],  # type: ignore[index]
            "descriptors_growth": max(sample[name][2] for sample in warm) - base[2],  # type: ignore[index]
        }
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--minutes", type=float, default=12.0)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--warmup-minutes", type=float, default=1.0)
    parser.add_argument("--warmup-steps", type=int, default=0)
    parser.add_argument("--closure-steps", type=int, default=1, help="training steps one closure runs")
    parser.add_argument("--batch", type=int, default=200, help="closures scheduled before each join")
    parser.add_argument("--diagnostics", type=Path, help="directory the servers write diagnostics dumps into")
    parser.add_argument("--diagnostics-every", type=float, default=120.0, help="seconds between dumps")
    parser.add_argument("--tracemalloc", type=int, default=0, help="trace Python allocations, this many frames")
    args = parser.parse_args(argv)
    series, warm_at = soak(args)
    if warm_at is None:
        raise SystemExit("the run ended before warm-up did: run longer (--minutes)")
    summary = summarize(series, warm_at)
    for name, figures in summary.items():
        shown = ", ".join(f"{key} {value:.4g}" for key, value in figures.items())
        print(f"{name}: {shown}", file=sys.stderr)

    def worst(prefix: str, key: str) -> tuple[float, float]:
        return max(
            (figures[key], figures["baseline_mb"]) for name, figures in summary.items() if name.startswith(prefix)
        )

    growth, baseline = worst("ps", "growth_pct")
    ps_slope = max((f["slope_last_half_pct_per_10min"] for n, f in summary.items() if n.startswith("ps")), key=abs)
    worker_growth, worker_base = worst("worker", "growth_pct")
    coordinator = summary["coordinator"]
    results = [
        Result("ps_rss_growth_pct", growth, "%", baseline, "ps MB at the end of warm-up"),
        Result("ps_rss_slope_last_half", ps_slope, "%/10min", baseline, "ps MB at the end of warm-up"),
        Result("worker_rss_growth_pct", worker_growth, "%", worker_base, "worker MB at the end of warm-up"),
        Result("coordinator_rss_growth_pct", coordinator["growth_pct"], "%", coordinator["baseline_mb"], "its MB then"),
        Result("threads_growth", max(f["threads_growth"] for f in summary.values()), "threads", 0, "-"),
        Result("descriptors_growth", max(f["descriptors_growth"] for f in summary.values()), "fds", 0, "-"),
    ]
    print_report("soak", results, args.json)
    if args.json:
        print(json.dumps({"series": series, "summary": summary, "steps": series[-1]["steps"], "minutes": args.minutes}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
