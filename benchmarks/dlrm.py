"""The recommendation workload: a DLRM-shaped model trained on the servers, beside one process.

    python benchmarks/dlrm.py [--json] [--rounds 3] [--sweep 100000 1000000 10000000]

The model and data are paramserve.coordinator.demos.recommendation's: 26 categorical features, each
with its own table (Criteo Kaggle's cardinalities, each capped at the sweep's size), ids drawn
from a Zipf law, 13 dense features, bottom MLP 13-64-16, the 27 vectors concatenated, top MLP
432-64-1, binary cross-entropy, batch 256, Adagrad (lr 0.05) for every parameter.

- dlrm_samples_<cap>: samples per second (summed over workers) of paramserve with 2 ps + 2
  workers on 127.0.0.1 (one torch thread per process; TF's tutorial partitioner,
  MinSizePartitioner(256 KiB, 2 shards): the tables, a ShardedEmbeddingCollection, in 2 shards,
  each small layer whole on one server; 1 step per closure, or --steps-per-closure N: a
  closure runs N steps, as TF's steps_per_execution), beside the same model in one
  local process at one thread (``nn.Embedding(sparse=True)`` + ``torch.optim.Adagrad``), on the
  same batches, same run; the two take turns, medians of --rounds. Start-up (table creation)
  is excluded from both and printed apart. --overlap-pushes: the workers' overlap_pushes (a
  step's push travels with the next step's lookup), metrics suffixed _overlap.
- dlrm_per_feature_samples_<cap> (--per-feature): the same model written with one ShardedEmbedding
  per feature (PerFeatureEmbeddings: 26 layers, each called on its own), beside the collection's
  samples/s in the same run; their lookups travel together (worker.deferred_rows).
- dlrm_cache_samples_<cap>_s<S> / dlrm_cache_rows_pulled_<cap>_s<S> /
  dlrm_cache_held_out_loss_<cap>_s<S> (--max-row-staleness S ...): 2 ps + 2 workers with the
  workers' row cache at bound S, beside the same training without it (S = 0), on fresh batches
  (none repeats: a cache must not look good by serving a cycled batch): samples/s, distinct rows
  the workers pulled per sample (their paramserve_worker_rows_total), and the held-out log-loss
  after training (16 batches of another draw stream, the model read from the servers).
- dlrm_sweep_flatness: the slowest cap's samples/s over the fastest's, over the sweep
  (1.0: the table's size costs nothing per step).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from _common import Result, one_torch_thread, print_report, process_cpu_seconds, worker_environment

from paramserve.coordinator import (
    ClusterCoordinator,
    LocalCluster,
    MinSizePartitioner,
    ParameterServerStrategy,
    ShardedEmbeddingCollection,
)
from paramserve.coordinator.demos.recommendation import (
    DLRM,
    ClickData,
    PerFeatureEmbeddings,
    WorkerClicks,
    click_loss,
    criteo_rows,
    train_clicks,
)

BATCH = 256
LR = 0.05
BATCHES_PER_WORKER = 32
"""Each side cycles through this many fixed batches per trainer: generating data costs nothing."""


@dataclass
class Run:
    samples_per_s: float
    startup_s: float
    cpu_ms_per_step: float
    cpu_ms_by_role: dict[str, float] = field(default_factory=dict)
    """The cluster's CPU-ms per step by role (coordinator, ps, worker: each role's processes
    summed): benchmarks/step_cpu.py --model dlrm prints it."""


def local_run(cap: int, steps: int, warmup: int) -> Run:
    """One process at one thread: the same model with local sparse tables and torch's Adagrad."""
    start = time.perf_counter()
    torch.manual_seed(0)
    model = DLRM(criteo_rows(cap))
    optimizer = torch.optim.Adagrad(model.parameters(), lr=LR)
    batches = ClickData(criteo_rows(cap), BATCH).cycle(0, BATCHES_PER_WORKER)
    startup = time.perf_counter() - start
    for _ in range(warmup):
        train_clicks(batches, model, optimizer)
    cpu, start = time.process_time(), time.perf_counter()
    for _ in range(steps):
        train_clicks(batches, model, optimizer)
    seconds = time.perf_counter() - start
    return Run(steps * BATCH / seconds, startup, 1000 * (time.process_time() - cpu) / steps)


@contextlib.contextmanager
def dlrm_cluster(
    cap: int,
    servers: int = 2,
    workers: int = 2,
    sync_dense: bool = False,
    per_feature: bool = False,
    max_row_staleness: int = 0,
    overlap_pushes: bool = False,
) -> Iterator[tuple[LocalCluster, ParameterServerStrategy, DLRM, Any]]:
    """``servers`` ps + ``workers`` workers on 127.0.0.1 (one torch thread each), the strategy
    (TF's tutorial partitioner; ``sync_dense``: hybrid training, the layers replicated on the
    workers and all-reduced every step), the DLRM built in its scope and its Adagrad.
    ``per_feature``: the tables as one ShardedEmbedding per feature (PerFeatureEmbeddings), not
    one ShardedEmbeddingCollection. ``max_row_staleness``: the workers' row cache (0: none);
    ``overlap_pushes``: a step computes while the previous one's push is in flight. The workers
    serve /metrics (rows pulled and cached: ``worker_rows``)."""
    with LocalCluster(
        num_ps=servers,
        num_workers=workers,
        env=worker_environment(),
        extra_ps_args=["--torch-threads", "1"],
        extra_worker_args=["--torch-threads", "1", "--metrics-port", "0"],
    ) as cluster:
        strategy = ParameterServerStrategy(
            cluster.spec,
            variable_partitioner=MinSizePartitioner(min_shard_bytes=256 << 10, max_shards=servers),
            sync_dense=sync_dense,
            max_row_staleness=max_row_staleness,
            overlap_pushes=overlap_pushes,
        )
        try:
            torch.manual_seed(0)
            with strategy.scope():
                model = DLRM(
                    criteo_rows(cap), embeddings=PerFeatureEmbeddings if per_feature else ShardedEmbeddingCollection
                )
            yield cluster, strategy, model, strategy.optimizer(torch.optim.Adagrad, lr=LR)
        finally:
            strategy.close()


def paramserve_run(
    cap: int,
    steps: int,
    warmup: int,
    servers: int = 2,
    workers: int = 2,
    steps_per_closure: int = 1,
    sync_dense: bool = False,
    per_feature: bool = False,
    overlap_pushes: bool = False,
) -> Run:
    """``sync_dense``, ``per_feature``, ``overlap_pushes``: see ``dlrm_cluster``."""
    with dlrm_cluster(cap, servers, workers, sync_dense, per_feature, overlap_pushes=overlap_pushes) as (
        cluster,
        strategy,
        model,
        optimizer,
    ):
        start = time.perf_counter()
        with ClusterCoordinator(strategy) as coordinator:
            batches = iter(
                coordinator.create_per_worker_dataset(WorkerClicks(criteo_rows(cap), BATCH, BATCHES_PER_WORKER))
            )
            for _ in range(max(1, warmup // steps_per_closure)):
                coordinator.schedule(train_clicks, args=(batches, model, optimizer), steps=steps_per_closure)
            coordinator.join()
            startup = time.perf_counter() - start
            roles = {os.getpid(): "coordinator", **{p.pid: p.role for p in cluster.processes}}
            before = {pid: process_cpu_seconds(pid) for pid in roles}
            start = time.perf_counter()
            steps = steps // steps_per_closure * steps_per_closure
            for _ in range(steps // steps_per_closure):
                coordinator.schedule(train_clicks, args=(batches, model, optimizer), steps=steps_per_closure)
            coordinator.join()
            seconds = time.perf_counter() - start
            by_role: dict[str, float] = {}
            for pid, role in roles.items():
                by_role[role] = by_role.get(role, 0.0) + 1000 * (process_cpu_seconds(pid) - before[pid]) / steps
    return Run(steps * BATCH / seconds, startup, sum(by_role.values()), by_role)


def compare(
    cap: int,
    steps: int,
    warmup: int,
    rounds: int,
    steps_per_closure: int = 1,
    per_feature: bool = False,
    overlap_pushes: bool = False,
) -> tuple[list[Result], float]:
    ours: list[Run] = []
    local: list[Run] = []
    separate: list[Run] = []
    for round_ in range(rounds):  # the sides take turns, so drifts of a shared machine hit both
        local.append(local_run(cap, steps // 2, warmup))
        ours.append(
            paramserve_run(cap, steps, warmup, steps_per_closure=steps_per_closure, overlap_pushes=overlap_pushes)
        )
        if per_feature:
            separate.append(
                paramserve_run(
                    cap,
                    steps,
                    warmup,
                    steps_per_closure=steps_per_closure,
                    per_feature=True,
                    overlap_pushes=overlap_pushes,
                )
            )
            print(
                f"  [dlrm cap {cap:,} round {round_ + 1}/{rounds}] one ShardedEmbedding per feature "
                f"{separate[-1].samples_per_s:,.0f} samples/s ({separate[-1].cpu_ms_per_step:.2f} CPU-ms/step)",
                flush=True,
            )
        print(
            f"  [dlrm cap {cap:,} round {round_ + 1}/{rounds}] paramserve {ours[-1].samples_per_s:,.0f} samples/s "
            f"({ours[-1].cpu_ms_per_step:.2f} CPU-ms/step, start-up {ours[-1].startup_s:.1f} s), one process "
            f"{local[-1].samples_per_s:,.0f} samples/s ({local[-1].cpu_ms_per_step:.2f} CPU-ms/step, "
            f"start-up {local[-1].startup_s:.1f} s)",
            flush=True,
        )
    value = statistics.median(r.samples_per_s for r in ours)
    baseline = statistics.median(r.samples_per_s for r in local)
    suffix = (f"_x{steps_per_closure}" if steps_per_closure > 1 else "") + ("_overlap" if overlap_pushes else "")
    results = [
        Result(
            f"dlrm_samples_{cap}{suffix}",
            value,
            "samples/s",
            baseline,
            f"one process, nn.Embedding(sparse=True) + Adagrad, 1 thread, median of {rounds}",
        )
    ]
    if separate:
        results.append(
            Result(
                f"dlrm_per_feature_samples_{cap}{suffix}",
                statistics.median(r.samples_per_s for r in separate),
                "samples/s",
                value,
                f"the same cluster with one ShardedEmbeddingCollection, same run, median of {rounds}",
            )
        )
    return results, value


def worker_rows(cluster: LocalCluster) -> dict[str, float]:
    """Distinct rows the workers' lookups pulled and took from their row caches, so far."""
    totals = {"pulled": 0.0, "cached": 0.0}
    for process in cluster.processes:
        if process.role != "worker" or process.metrics_port is None:
            continue
        with urllib.request.urlopen(f"http://127.0.0.1:{process.metrics_port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        for line in text.splitlines():
            for source in totals:
                if line.startswith(f'paramserve_worker_rows_total{{source="{source}"}}'):
                    totals[source] += float(line.rsplit(" ", 1)[1])
    return totals


@dataclass
class CacheRun:
    samples_per_s: float
    rows_pulled_per_sample: float
    held_out_loss: float


def cache_run(cap: int, steps: int, warmup: int, max_row_staleness: int) -> CacheRun:
    """2 ps + 2 workers training on fresh batches (none repeats, so a cache cannot serve a batch
    it saw before), then the held-out log-loss of the model, read from the servers."""
    batches_per_worker = (steps + warmup) // 2 + 8
    with dlrm_cluster(cap, max_row_staleness=max_row_staleness) as (cluster, strategy, model, optimizer):
        with ClusterCoordinator(strategy) as coordinator:
            data = WorkerClicks(criteo_rows(cap), BATCH, batches_per_worker)
            batches = iter(coordinator.create_per_worker_dataset(data))
            for _ in range(warmup):
                coordinator.schedule(train_clicks, args=(batches, model, optimizer))
            coordinator.join()
            rows = worker_rows(cluster)
            start = time.perf_counter()
            for _ in range(steps):
                coordinator.schedule(train_clicks, args=(batches, model, optimizer))
            coordinator.join()
            seconds = time.perf_counter() - start
            after = worker_rows(cluster)
        with torch.no_grad():
            held_out = ClickData(criteo_rows(cap), BATCH).batches(stream=999, count=16)
            loss = statistics.fmean(float(click_loss(model, batch)) for batch in held_out)
    return CacheRun(steps * BATCH / seconds, (after["pulled"] - rows["pulled"]) / (steps * BATCH), loss)


def compare_cache(cap: int, steps: int, warmup: int, rounds: int, staleness: int) -> list[Result]:
    """The row cache at ``staleness`` beside none (max_row_staleness=0), alternating, medians."""
    cached: list[CacheRun] = []
    plain: list[CacheRun] = []
    for round_ in range(rounds):
        plain.append(cache_run(cap, steps, warmup, 0))
        cached.append(cache_run(cap, steps, warmup, staleness))
        print(
            f"  [dlrm cache cap {cap:,} s={staleness} round {round_ + 1}/{rounds}] "
            f"{cached[-1].samples_per_s:,.0f} samples/s, {cached[-1].rows_pulled_per_sample:.2f} rows "
            f"pulled/sample, held-out loss {cached[-1].held_out_loss:.5f}; without: {plain[-1].samples_per_s:,.0f}, "
            f"{plain[-1].rows_pulled_per_sample:.2f}, {plain[-1].held_out_loss:.5f}",
            flush=True,
        )

    def median(runs: list[CacheRun], field: str) -> float:
        return statistics.median(getattr(run, field) for run in runs)

    what = f"the same training with max_row_staleness=0, median of {rounds}"
    tag = f"{cap}_s{staleness}"
    return [
        Result(
            f"dlrm_cache_samples_{tag}",
            median(cached, "samples_per_s"),
            "samples/s",
            median(plain, "samples_per_s"),
            what,
        ),
        Result(
            f"dlrm_cache_rows_pulled_{tag}",
            median(cached, "rows_pulled_per_sample"),
            "rows/sample",
            median(plain, "rows_pulled_per_sample"),
            what,
        ),
        Result(
            f"dlrm_cache_held_out_loss_{tag}",
            median(cached, "held_out_loss"),
            "log-loss",
            median(plain, "held_out_loss"),
            what,
        ),
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=1200, help="paramserve steps per run (summed over workers)")
    parser.add_argument("--warmup", type=int, default=60)
    parser.add_argument("--sweep", type=int, nargs="+", default=[100_000, 1_000_000, 10_000_000])
    parser.add_argument(
        "--steps-per-closure",
        type=int,
        default=1,
        help="steps each scheduled closure runs (schedule(..., steps=N), TF's steps_per_execution); "
        "metrics get the suffix _xN",
    )
    parser.add_argument(
        "--overlap-pushes",
        action="store_true",
        help="the workers' overlap_pushes: a step's push travels with the next step's lookup "
        "(one exchange per server per step; dense values one step old); metrics get the suffix _overlap",
    )
    parser.add_argument(
        "--per-feature",
        action="store_true",
        help="also train the model written with one ShardedEmbedding per feature "
        "(dlrm_per_feature_samples_<cap>, beside the collection's samples/s)",
    )
    parser.add_argument(
        "--max-row-staleness",
        type=int,
        nargs="*",
        default=[],
        help="also train with the workers' row cache at each of these bounds beside none, on fresh "
        "batches (dlrm_cache_*: samples/s, distinct rows pulled per sample, held-out log-loss)",
    )
    args = parser.parse_args(argv)
    one_torch_thread()
    results: list[Result] = []
    speeds: list[float] = []
    for cap in args.sweep:
        found, speed = compare(
            cap, args.steps, args.warmup, args.rounds, args.steps_per_closure, args.per_feature, args.overlap_pushes
        )
        results.extend(found)
        for staleness in args.max_row_staleness:
            results.extend(compare_cache(cap, args.steps, args.warmup, args.rounds, staleness))
        speeds.append(speed)
    if len(speeds) > 1:
        results.append(
            Result(
                "dlrm_sweep_flatness",
                min(speeds),
                "samples/s",
                max(speeds),
                f"the fastest of caps {', '.join(f'{c:,}' for c in args.sweep)}",
            )
        )
    print_report("DLRM-shaped recommendation model", results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
