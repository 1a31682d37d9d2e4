"""Scale-out: the DLRM-shaped model trained by 1, 2, 4 and 8 workers, beside one process.

    python benchmarks/scale_out.py [--json] [--workers 1 2 4 8] [--rounds 3] [--cap 100000]

The model, data and cluster are benchmarks/dlrm.py's (26 tables capped at --cap rows, a
ShardedEmbeddingCollection, TF's tutorial partitioner MinSizePartitioner(256 KiB, one shard per
server at most), batch 256, Adagrad lr 0.05; every process on 127.0.0.1 at one torch thread).
For each worker count W the cluster has S servers, S = --servers if given, else
min(W, 4): one server per worker, as dlrm.py's 2 ps + 2 workers, because a server spends about
as much CPU per step as a worker does (BENCHMARKS.md, the sparse step's CPU: per global step
~2 CPU-ms in each of 2 servers, ~2.5 in each worker), so fewer servers than workers would make
the servers the bottleneck once cores are plentiful; capped at 4 so that 8 workers + 4 servers
(+ the coordinator) fit a 16-core machine with cores to spare for gRPC's threads.

Each worker trains --steps steps after --warmup steps of its own (W x --steps in the timed
window, closures of --steps-per-closure steps handed to whichever worker is idle); the baseline,
one local process at one torch thread (``nn.Embedding(sparse=True)`` + ``torch.optim.Adagrad``,
dlrm.py's ``local_run``), trains the same number of steps (W x --steps) after --warmup, in the
same round, just before or after the cluster (the order alternates per round, so a shared
machine's drift hits both sides). Table creation and process start-up are outside both timed
windows. Every figure is the median of --rounds rounds; the per-round lines (each with the
machine's 1-minute load average, to tell a round that other work crowded) and the summary's
[min-max] give the spread.

Per worker count W (``<n>w`` in the metric's name):

- scale_out_samples_<n>w: samples per second of the cluster (summed over workers), beside one
  process's samples/s measured in the same rounds; ratio: the speed-up.
- scale_out_efficiency_<n>w: efficiency per core = speed-up / min(S + W, os.cpu_count()), the
  speed-up per core the cluster can use: S + W processes at one torch thread each, counted as one
  core each, but never more cores than the machine has (the coordinator, which only schedules,
  is not counted as a core; its CPU is in the next figure). 1.0: every core the cluster
  occupies trains as fast as the one process does on its one core. The baseline column is 1.0.
- scale_out_cpu_us_per_sample_<n>w: CPU-µs per sample of the cluster, all processes (the
  coordinator, the S servers and the W workers: user + system time from /proc over the timed
  window), beside one process's (its own CPU over its timed window); ratio: the distribution's
  CPU cost relative to one process (1.0: none). The per-round lines split it by role.

On a machine with fewer cores than processes (this 2-core machine: every W), the speed-up can
only show the trend, and the efficiency per core divides by the machine's cores.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from _common import Result, one_torch_thread, print_report, process_cpu_seconds
from dlrm import BATCH, dlrm_cluster, local_run

from paramserve.coordinator import ClusterCoordinator
from paramserve.coordinator.demos.recommendation import WorkerClicks, criteo_rows, train_clicks

BATCHES_PER_WORKER = 32
"""Each trainer cycles through this many fixed batches (as dlrm.py): generating data costs nothing."""

MAX_DEFAULT_SERVERS = 4


def default_servers(workers: int) -> int:
    """The servers for ``workers`` workers when --servers is not given: one per worker, at most 4."""
    return max(1, min(workers, MAX_DEFAULT_SERVERS))


def cores_used(servers: int, workers: int) -> int:
    """The cores the cluster can occupy: one per server and worker (one torch thread each), at
    most the machine's."""
    return min(servers + workers, os.cpu_count() or 1)


@dataclass
class Side:
    samples_per_s: float
    cpu_us_per_sample: float
    startup_s: float
    cpu_split: dict[str, float]
    """CPU-µs per sample by role (coordinator, ps, worker); the one process: itself."""


def cluster_run(cap: int, servers: int, workers: int, steps: int, warmup: int, steps_per_closure: int) -> Side:
    """``workers`` x ``steps`` steps of dlrm.py's cluster, after ``warmup`` steps per worker."""
    with dlrm_cluster(cap, servers, workers) as (cluster, strategy, model, optimizer):
        start = time.perf_counter()
        with ClusterCoordinator(strategy) as coordinator:
            batches = iter(
                coordinator.create_per_worker_dataset(WorkerClicks(criteo_rows(cap), BATCH, BATCHES_PER_WORKER))
            )
            for _ in range(max(workers, warmup * workers // steps_per_closure)):
                coordinator.schedule(train_clicks, args=(batches, model, optimizer), steps=steps_per_closure)
            coordinator.join()
            startup = time.perf_counter() - start
            roles = [("coordinator", os.getpid()), *((p.role, p.pid) for p in cluster.processes)]
            before = [process_cpu_seconds(pid) for _, pid in roles]
            closures = max(1, steps * workers // steps_per_closure)
            start = time.perf_counter()
            for _ in range(closures):
                coordinator.schedule(train_clicks, args=(batches, model, optimizer), steps=steps_per_closure)
            coordinator.join()
            seconds = time.perf_counter() - start
            after = [process_cpu_seconds(pid) for _, pid in roles]
    samples = closures * steps_per_closure * BATCH
    split: dict[str, float] = {}
    for (role, _), b, a in zip(roles, before, after):
        split[role] = split.get(role, 0.0) + 1e6 * (a - b) / samples
    return Side(samples / seconds, sum(split.values()), startup, split)


def one_process_run(cap: int, steps: int, warmup: int) -> Side:
    """dlrm.py's one process at one torch thread, ``steps`` steps after ``warmup``."""
    run = local_run(cap, steps, warmup)
    cpu = 1000 * run.cpu_ms_per_step / BATCH
    return Side(run.samples_per_s, cpu, run.startup_s, {"one process": cpu})


@dataclass
class Row:
    workers: int
    servers: int
    cluster: list[Side]
    local: list[Side]

    def median(self, sides: list[Side], field: str) -> float:
        return statistics.median(getattr(s, field) for s in sides)

    @property
    def speedup(self) -> float:
        return self.median(self.cluster, "samples_per_s") / self.median(self.local, "samples_per_s")

    @property
    def efficiency(self) -> float:
        return self.speedup / cores_used(self.servers, self.workers)

    @property
    def cpu_ratio(self) -> float:
        return self.median(self.cluster, "cpu_us_per_sample") / self.median(self.local, "cpu_us_per_sample")

    def round_speedups(self) -> list[float]:
        return [c.samples_per_s / s.samples_per_s for c, s in zip(self.cluster, self.local)]


def _split(side: Side) -> str:
    return ", ".join(f"{role} {us:.1f}" for role, us in side.cpu_split.items())


def measure(args: argparse.Namespace) -> list[Row]:
    rows = [Row(w, args.servers or default_servers(w), [], []) for w in args.workers]
    for round_ in range(args.rounds):
        for row in rows:
            total = args.steps * row.workers

            def cluster_side(row: Row = row) -> None:
                row.cluster.append(
                    cluster_run(args.cap, row.servers, row.workers, args.steps, args.warmup, args.steps_per_closure)
                )

            def local_side(total: int = total, row: Row = row) -> None:
                row.local.append(one_process_run(args.cap, total, args.warmup))

            # The sides take turns going first, so a drift of the shared machine hits both.
            for side in (local_side, cluster_side) if round_ % 2 == 0 else (cluster_side, local_side):
                side()
            ours, one = row.cluster[-1], row.local[-1]
            print(
                f"  [scale-out {row.servers} ps + {row.workers} w, round {round_ + 1}/{args.rounds}] "
                f"paramserve {ours.samples_per_s:,.0f} samples/s ({ours.cpu_us_per_sample:.1f} CPU-µs/sample: "
                f"{_split(ours)}; start-up {ours.startup_s:.1f} s), one process {one.samples_per_s:,.0f} "
                f"samples/s ({one.cpu_us_per_sample:.1f} CPU-µs/sample): speed-up "
                f"{ours.samples_per_s / one.samples_per_s:.2f}; load average {os.getloadavg()[0]:.1f} "
                f"on {os.cpu_count()} cores",
                flush=True,
            )
    return rows


def summary(rows: list[Row], rounds: int) -> None:
    """The table the issue asks for, with each figure's per-round range."""
    cpus = os.cpu_count() or 1
    print(f"\nscale-out on {cpus} cores (medians of {rounds}; [min-max over rounds])")
    print(
        f"{'ps+w':>6}  {'cores':>5}  {'paramserve samples/s':>28}  {'one process samples/s':>28}  "
        f"{'speed-up':>18}  {'eff/core':>8}  {'CPU/sample vs one':>17}"
    )
    for row in rows:
        ours = [s.samples_per_s for s in row.cluster]
        one = [s.samples_per_s for s in row.local]
        speedups = row.round_speedups()
        print(
            f"{f'{row.servers}+{row.workers}':>6}  {cores_used(row.servers, row.workers):>5}  "
            f"{f'{statistics.median(ours):,.0f} [{min(ours):,.0f}-{max(ours):,.0f}]':>28}  "
            f"{f'{statistics.median(one):,.0f} [{min(one):,.0f}-{max(one):,.0f}]':>28}  "
            f"{f'{row.speedup:.2f} [{min(speedups):.2f}-{max(speedups):.2f}]':>18}  "
            f"{row.efficiency:8.2f}  {row.cpu_ratio:17.2f}"
        )


def results(rows: list[Row], rounds: int) -> list[Result]:
    found: list[Result] = []
    for row in rows:
        n, cores = row.workers, cores_used(row.servers, row.workers)
        found += [
            Result(
                f"scale_out_samples_{n}w",
                row.median(row.cluster, "samples_per_s"),
                "samples/s",
                row.median(row.local, "samples_per_s"),
                f"one process, nn.Embedding(sparse=True) + Adagrad, 1 thread; {row.servers} ps + {n} workers; "
                f"median of {rounds}",
            ),
            Result(
                f"scale_out_efficiency_{n}w",
                row.efficiency,
                "/core",
                1.0,
                f"speed-up {row.speedup:.2f} / {cores} cores (min(ps + workers, os.cpu_count()))",
            ),
            Result(
                f"scale_out_cpu_us_per_sample_{n}w",
                row.median(row.cluster, "cpu_us_per_sample"),
                "CPU-µs",
                row.median(row.local, "cpu_us_per_sample"),
                "one process's CPU-µs per sample; cluster: coordinator + servers + workers",
            ),
        ]
    return found


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument(
        "--servers",
        type=int,
        default=0,
        help=f"parameter servers for every worker count (default: min(workers, {MAX_DEFAULT_SERVERS}))",
    )
    parser.add_argument("--cap", type=int, default=100_000, help="rows per table at most")
    parser.add_argument(
        "--steps", type=int, default=400, help="timed steps per worker (the one process: workers x steps)"
    )
    parser.add_argument("--warmup", type=int, default=60, help="untimed steps per worker, and of the one process")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--steps-per-closure",
        type=int,
        default=1,
        help="steps each scheduled closure runs (schedule(..., steps=N), TF's steps_per_execution)",
    )
    args = parser.parse_args(argv)
    if min(args.workers) < 1 or args.servers < 0 or args.rounds < 1 or args.steps_per_closure < 1:
        parser.error("--workers and --rounds and --steps-per-closure must be >= 1, --servers >= 0")
    one_torch_thread()
    rows = measure(args)
    summary(rows, args.rounds)
    suffix = f" ({args.steps_per_closure} steps per closure)" if args.steps_per_closure > 1 else ""
    print_report(f"Scale-out, DLRM-shaped model, cap {args.cap:,}{suffix}", results(rows, args.rounds), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
