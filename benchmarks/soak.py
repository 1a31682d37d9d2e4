"""A long run: does a parameter server's memory stay flat once it is warm?

    python benchmarks/soak.py [--json] [--minutes 12] [--workers 4] [--warmup-steps 80000]

2 parameter servers and --workers workers (LocalCluster, one torch thread each) train the demo's
MLP (64-32-10, Adam) as fast as they can for --minutes. Every 15 s each server's resident memory
(VmRSS) is read beside the steps done. A server warms up until every shard's idempotency window is
full (65,536 pushes: --warmup-steps, past that); after that nothing it holds should grow.

- ps_rss_growth_per_100k_steps: the servers' resident memory growth after warm-up, per 100,000
  steps, as a percentage of their memory at the end of warm-up (the baseline, in MB), from a
  least-squares line through the samples (the larger of the two servers).
- The series itself (steps, MB per server) is printed to stderr and in the JSON's ``series``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import _common
import torch
from _common import Result, memory_mb, print_report, worker_environment

from paramserve.coordinator import ClusterCoordinator
from paramserve.coordinator.demos.digits import MLP, train_step, worker_batches
from paramserve.coordinator.local_cluster import LocalCluster
from paramserve.coordinator.strategies.parameter_server import ParameterServerStrategy

_common.one_torch_thread()
SAMPLE_EVERY = 15.0


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs."""
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    denominator = sum((x - mean_x) ** 2 for x in xs)
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / denominator if denominator else 0.0


def soak(minutes: float, workers: int) -> list[tuple[int, list[float]]]:
    """(steps done, each server's MB) every SAMPLE_EVERY seconds for ``minutes``."""
    series: list[tuple[int, list[float]]] = []
    with LocalCluster(2, workers, env=worker_environment()) as cluster:
        servers = [p.pid for p in cluster.processes if p.role == "ps"]
        strategy = ParameterServerStrategy(cluster.spec)
        with strategy.scope():
            model = MLP(32)
        optimizer = strategy.optimizer(torch.optim.Adam, lr=1e-3)
        with ClusterCoordinator(strategy) as coordinator:
            batches = iter(coordinator.create_per_worker_dataset(worker_batches))
            end, next_sample, steps = time.monotonic() + minutes * 60, 0.0, 0
            while time.monotonic() < end:
                values = [
                    coordinator.schedule(train_step, args=(batches, model, optimizer), steps=4) for _ in range(64)
                ]
                coordinator.join()
                assert all(torch.isfinite(v.fetch()) for v in values)
                steps += 4 * len(values)
                if time.monotonic() >= next_sample:
                    next_sample = time.monotonic() + SAMPLE_EVERY
                    series.append((steps, [round(memory_mb(pid, "VmRSS"), 1) for pid in servers]))
                    print(f"steps {steps:8d}  ps MB {series[-1][1]}", file=sys.stderr, flush=True)
        strategy.close()
    return series


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--minutes", type=float, default=12.0)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--warmup-steps", type=int, default=80_000)
    args = parser.parse_args(argv)
    series = soak(args.minutes, args.workers)
    warm = [(steps, mb) for steps, mb in series if steps >= args.warmup_steps]
    if len(warm) < 3:
        raise SystemExit(f"only {len(warm)} samples after {args.warmup_steps} warm-up steps: run longer (--minutes)")
    growth = []
    for server in range(len(warm[0][1])):
        per_step = slope([float(s) for s, _ in warm], [mb[server] for _, mb in warm])
        growth.append((100.0 * per_step * 100_000 / warm[0][1][server], warm[0][1][server]))
    percent, baseline = max(growth)
    result = Result("ps_rss_growth_per_100k_steps", percent, "%", baseline, "ps MB at the end of warm-up")
    print_report("soak", [result], args.json)
    if args.json:
        print(json.dumps({"series": series, "steps": series[-1][0], "minutes": args.minutes}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
