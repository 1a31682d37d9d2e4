"""ClusterCoordinator overhead and training throughput, beside baselines from the same run.

    python benchmarks/coordinator.py [--json] [--rounds 3] [--only METRIC ...]

- closures: trivial closures per second through ClusterCoordinator.schedule/join on 2
  worker processes, beside bare gRPC unary round trips per second (one caller, raw bytes
  of the same size as a closure request, another process).
- closure_overhead_scale: the coordinator's CPU microseconds per trivial closure with 2, 16, 64
  and 256 workers (real worker gRPC servers, 32 to a process), beside 2 workers in the same run,
  with the default batching and with one closure per call (closure_overhead_unbatched); and the
  coordinator's OS threads and resident memory at 256 workers beside 2.
- closure_pickling: CPU microseconds schedule() spends serialising the training closure below
  when its code is importable on the workers (sent by reference, as these benchmarks run),
  beside the same closure with its code sent by value (a script's __main__ functions).
- train_steps_vs_rpc: training steps per second (summed over workers) of an MLP
  784-256-128-10, softmax cross-entropy, SGD lr 0.01 applied on the servers, one fixed
  random batch of 64 per worker reused every step: paramserve with 1 ps + 2 workers (the
  peer's topology: on a 0.94 MB model a second server only adds a round trip), 1 step per
  closure, beside a torch.distributed.rpc parameter
  server in its strong form (benchmarks/rpc_ps.py: 1 PS holding the model, 2 trainers, each
  step a local forward and backward, then one RPC that pushes the gradients, applies SGD under
  a lock and returns the updated parameters: one round trip, as paramserve's). Same model, batch
  and thread count (1) per process; start-up excluded; the two take turns, medians of
  --rounds. CPU-ms per step (all processes of a side) is printed beside steps/s: on a
  shared 2-core machine it varies less.
- train_steps_large_vs_rpc: the same on the MLP 784-4096-2048-10, paramserve with 2 ps + 2
  workers and FixedShardsPartitioner(2) (46.5 MB: two servers apply it in parallel).
- train_steps_overlapped: the small model as in train_steps_vs_rpc with
  ParameterServerStrategy(overlap_pushes=True), a step computing while the previous step's push
  is in flight, beside the same cluster awaiting each push (the default); the two take turns,
  medians of --rounds. train_steps_overlapped_1w: the same with 1 ps + 1 worker, where a
  2-core machine is bound by each step's round trip rather than by its CPU.
- train_steps_replicated, train_steps_large_replicated: the small model (1 shard group) and the
  large one (2 groups, FixedShardsPartitioner(2)) with ps_replicas=2 (each group a primary and
  a backup that applies every push before it is acknowledged: 2 and 4 server processes),
  beside the same cluster with ps_replicas=1 (1 and 2 servers); 2 workers, 1 step per
  closure; the two take turns, medians of --rounds.
- gpu_worker_steps (only where CUDA is available): the small model's steps/s with workers
  on the GPU (--device cuda:0), beside CPU workers in the same run.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

import _common
import cloudpickle
import torch
from _common import (
    LARGE,
    MLP,
    SMALL,
    EchoServer,
    Result,
    make_batch,
    noop,
    one_torch_thread,
    print_report,
    process_cpu_seconds,
    process_threads_and_rss_mb,
    serve_workers,
    train_step,
    worker_environment,
)
from rpc_ps import run_rpc_ps

from paramserve.coordinator import (
    ClusterCoordinator,
    ClusterSpec,
    CoordinatorConfig,
    FixedShardsPartitioner,
    LocalCluster,
    ParameterServerStrategy,
)
from paramserve.worker.closure_pickling import dumps_closure

LR = 0.01
METRICS = (
    "closures",
    "closure_overhead_scale",
    "closure_pickling",
    "train_steps_vs_rpc",
    "train_steps_large_vs_rpc",
    "train_steps_overlapped",
    "train_steps_replicated",
    "gpu_worker_steps",
)


def bare_round_trips_per_second(count: int, payload_bytes: int) -> float:
    echo = EchoServer()
    try:
        payload = b"x" * payload_bytes
        for _ in range(50):
            echo.unary(payload, timeout=30)
        start = time.perf_counter()
        for _ in range(count):
            echo.unary(payload, timeout=30)
        return count / (time.perf_counter() - start)
    finally:
        echo.close()


def closures_per_second(cluster: LocalCluster, count: int) -> float:
    strategy = ParameterServerStrategy(cluster.spec)
    with ClusterCoordinator(strategy) as coordinator:
        for _ in range(50):
            coordinator.schedule(noop)
        coordinator.join()
        start = time.perf_counter()
        for _ in range(count):
            coordinator.schedule(noop)
        coordinator.join()
        seconds = time.perf_counter() - start
    strategy.close()
    return count / seconds


@dataclass
class ScalePoint:
    workers: int
    max_batch: int
    cpu_us_per_closure: float
    closures_per_s: float
    threads: int
    rss_mb: float


def closure_overhead_at(ps_address: str, addresses: list[str], closures: int, max_batch: int) -> ScalePoint:
    """Trivial closures through a coordinator of ``addresses``: its CPU per closure, its OS
    threads and resident memory once every worker has run closures."""
    spec = ClusterSpec(parameter_servers=(ps_address,), workers=tuple(addresses))
    strategy = ParameterServerStrategy(spec)
    try:
        with ClusterCoordinator(strategy, CoordinatorConfig(max_batch=max_batch)) as coordinator:
            for _ in range(2 * len(addresses)):  # every worker connected and warm
                coordinator.schedule(noop)
            coordinator.join()
            cpu = time.process_time()
            start = time.perf_counter()
            for _ in range(closures):
                coordinator.schedule(noop)
            coordinator.join()
            seconds = time.perf_counter() - start
            cpu = time.process_time() - cpu
            threads, rss_mb = process_threads_and_rss_mb(os.getpid())
    finally:
        strategy.close()
    return ScalePoint(len(addresses), max_batch, 1e6 * cpu / closures, closures / seconds, threads, rss_mb)


def closure_overhead_scale(
    counts: tuple[int, ...], closures: int, per_process: int = 32
) -> dict[int, list[ScalePoint]]:
    """The coordinator's cost per closure as the cluster grows: real worker gRPC servers,
    ``per_process`` to a process (so 256 fit on a small machine), one coordinator. Each point
    runs at least ``closures`` closures and 40 per worker. Measured twice: with the default
    batching, and with one closure per call (max_batch=1), the dispatch cost without batching:
    batches form only while closures queue behind busy workers (coordinator.batching.BatchSizer),
    and a large cluster's workers are often idle when a closure arrives, so they get it alone.
    Returns the points by max_batch."""
    context = multiprocessing.get_context("spawn")
    largest = max(counts)
    stop = context.Event()
    queue = context.Queue()
    hosts = []
    for start in range(0, largest, per_process):
        host = context.Process(target=serve_workers, args=(min(per_process, largest - start), queue, stop), daemon=True)
        host.start()
        hosts.append(host)
    try:
        addresses = [address for _ in hosts for address in queue.get(timeout=120)]
        with LocalCluster(num_ps=1, num_workers=1, env=worker_environment()) as cluster:
            points: dict[int, list[ScalePoint]] = {CoordinatorConfig().max_batch: [], 1: []}
            for count in counts:
                for max_batch, curve in points.items():
                    total = max(closures, 40 * count)
                    curve.append(
                        closure_overhead_at(cluster.spec.parameter_servers[0], addresses[:count], total, max_batch)
                    )
                    p = curve[-1]
                    print(
                        f"  {p.workers:4d} workers, max_batch {max_batch}: {p.cpu_us_per_closure:6.0f} coordinator "
                        f"CPU-us per closure, {p.closures_per_s:6.0f} closures/s, {p.threads} threads, "
                        f"{p.rss_mb:.0f} MB resident",
                        flush=True,
                    )
            return points
    finally:
        stop.set()
        for host in hosts:
            host.join(timeout=30)
            if host.is_alive():
                host.kill()


def closure_pickling_us(count: int) -> tuple[float, float]:
    """CPU microseconds to serialise the training closure (train_step, per-worker batch, model,
    optimizer) at schedule(): code importable on the workers (sent by reference) vs code sent by
    value (what a function defined in a script's __main__ costs; cloudpickle scans sys.modules
    for each function and class it sends by value)."""
    with LocalCluster(num_ps=1, num_workers=1, env=worker_environment()) as cluster:
        strategy = ParameterServerStrategy(cluster.spec)
        try:
            with strategy.scope():
                model = MLP(SMALL)
            optimizer = strategy.optimizer(torch.optim.SGD, lr=LR)
            with ClusterCoordinator(strategy) as coordinator:
                batch = coordinator.create_per_worker_resource(make_batch(SMALL))
                closure = (train_step, (batch, model, optimizer), {})

                def cost() -> float:
                    for _ in range(20):
                        dumps_closure(closure)
                    start = time.process_time()
                    for _ in range(count):
                        dumps_closure(closure)
                    return 1e6 * (time.process_time() - start) / count

                by_reference = cost()
                cloudpickle.register_pickle_by_value(_common)
                try:
                    by_value = cost()
                finally:
                    cloudpickle.unregister_pickle_by_value(_common)
        finally:
            strategy.close()
    return by_reference, by_value


@dataclass
class TrainRun:
    steps_per_s: float
    cpu_ms_per_step: float
    cpu_ms_by_process: dict[str, float] = field(default_factory=dict)
    """CPU-ms per step of each process (paramserve's side: benchmarks/step_cpu.py prints it)."""


def paramserve_steps(
    sizes: tuple[int, ...],
    steps: int,
    warmup: int,
    device: str | None = None,
    steps_per_closure: int = 1,
    *,
    overlap_pushes: bool = False,
    servers: int = 2,
    workers: int = 2,
    replicas: int = 1,
) -> TrainRun:
    """2 ps + 2 workers on 127.0.0.1 (by default), one thread per process, 1 step per closure,
    variables in one shard per server (per group of ``replicas`` servers when replicated)."""
    worker_args = ["--torch-threads", "1"] + (["--device", device] if device else [])
    with LocalCluster(
        num_ps=servers * replicas,
        num_workers=workers,
        env=worker_environment(),
        extra_ps_args=["--torch-threads", "1"],
        extra_worker_args=worker_args,
    ) as cluster:
        strategy = ParameterServerStrategy(
            cluster.spec,
            variable_partitioner=FixedShardsPartitioner(servers),
            overlap_pushes=overlap_pushes,
            ps_replicas=replicas,
        )
        try:
            torch.manual_seed(0)
            with strategy.scope():
                model = MLP(sizes)
            optimizer = strategy.optimizer(torch.optim.SGD, lr=LR)
            with ClusterCoordinator(strategy) as coordinator:
                batch = coordinator.create_per_worker_resource(make_batch(sizes))
                for _ in range(warmup):
                    coordinator.schedule(train_step, args=(batch, model, optimizer))
                coordinator.join()
                names = [
                    "coordinator",
                    *(f"ps{i}" for i in range(servers * replicas)),
                    *(f"worker{i}" for i in range(workers)),
                ]
                pids = dict(zip(names, [os.getpid(), *(p.pid for p in cluster.processes)]))
                before = {name: process_cpu_seconds(pid) for name, pid in pids.items()}
                start = time.perf_counter()
                for _ in range(max(1, steps // steps_per_closure)):
                    coordinator.schedule(train_step, args=(batch, model, optimizer), steps=steps_per_closure)
                coordinator.join()
                seconds = time.perf_counter() - start
                spent = {name: process_cpu_seconds(pid) - before[name] for name, pid in pids.items()}
        finally:
            strategy.close()
    steps = max(1, steps // steps_per_closure) * steps_per_closure
    return TrainRun(
        steps / seconds, 1000 * sum(spent.values()) / steps, {name: 1000 * cpu / steps for name, cpu in spent.items()}
    )


def versus_rpc(
    name: str,
    sizes: tuple[int, ...],
    steps: int,
    warmup: int,
    rounds: int,
    steps_per_closure: int = 1,
    *,
    servers: int = 2,
) -> Result:
    ours: list[TrainRun] = []
    theirs: list[TrainRun] = []
    for round_ in range(rounds):  # the sides take turns, so drifts of a shared machine hit both
        theirs.append(TrainRun(**vars(run_rpc_ps(sizes, LR, steps, warmup))))
        ours.append(paramserve_steps(sizes, steps, warmup, steps_per_closure=steps_per_closure, servers=servers))
        print(
            f"  [{name} round {round_ + 1}/{rounds}] paramserve {ours[-1].steps_per_s:.1f} steps/s "
            f"({ours[-1].cpu_ms_per_step:.1f} CPU-ms/step), torch.distributed.rpc PS {theirs[-1].steps_per_s:.1f} "
            f"steps/s ({theirs[-1].cpu_ms_per_step:.1f} CPU-ms/step)",
            flush=True,
        )
    value = statistics.median(r.steps_per_s for r in ours)
    baseline = statistics.median(r.steps_per_s for r in theirs)
    cpu = statistics.median(r.cpu_ms_per_step for r in ours), statistics.median(r.cpu_ms_per_step for r in theirs)
    print(f"  {name}: CPU-ms per step {cpu[0]:.2f} (paramserve) vs {cpu[1]:.2f} (rpc PS)", flush=True)
    per_closure = f", paramserve {steps_per_closure} steps per closure" if steps_per_closure > 1 else ""
    return Result(
        name,
        value,
        "steps/s",
        baseline,
        f"torch.distributed.rpc PS (push returns the parameters), 1 PS + 2 trainers, median of {rounds}{per_closure}; "
        f"paramserve {servers} ps + 2 workers",
    )


def overlapped_versus_awaited(name: str, servers: int, workers: int, steps: int, warmup: int, rounds: int) -> Result:
    """The small model with overlap_pushes (a step computes while the previous push is in
    flight) beside the same cluster awaiting each push; the two take turns, medians."""
    sides: dict[bool, list[TrainRun]] = {False: [], True: []}
    for round_ in range(rounds):
        for overlap in (False, True):
            sides[overlap].append(
                paramserve_steps(SMALL, steps, warmup, overlap_pushes=overlap, servers=servers, workers=workers)
            )
        print(
            f"  [{name} round {round_ + 1}/{rounds}] overlapped {sides[True][-1].steps_per_s:.1f} steps/s "
            f"({sides[True][-1].cpu_ms_per_step:.2f} CPU-ms/step), awaited {sides[False][-1].steps_per_s:.1f} "
            f"steps/s ({sides[False][-1].cpu_ms_per_step:.2f} CPU-ms/step)",
            flush=True,
        )
    value, baseline = (statistics.median(r.steps_per_s for r in sides[o]) for o in (True, False))
    return Result(
        name,
        value,
        "steps/s",
        baseline,
        f"each push awaited, {servers} ps + {workers} worker{'s' if workers > 1 else ''}, median of {rounds}",
    )


def replicated_versus_single(name: str, sizes: tuple[int, ...], servers: int, steps: int, rounds: int) -> Result:
    """Steps/s with ps_replicas=2 beside ps_replicas=1, same model and workers; turns, medians."""
    sides: dict[int, list[TrainRun]] = {1: [], 2: []}
    for round_ in range(rounds):
        for replicas in (1, 2):
            sides[replicas].append(paramserve_steps(sizes, steps, 5, servers=servers, replicas=replicas))
        print(
            f"  [{name} round {round_ + 1}/{rounds}] replicas=2 {sides[2][-1].steps_per_s:.1f} steps/s "
            f"({sides[2][-1].cpu_ms_per_step:.1f} CPU-ms/step), replicas=1 {sides[1][-1].steps_per_s:.1f} steps/s "
            f"({sides[1][-1].cpu_ms_per_step:.1f} CPU-ms/step)",
            flush=True,
        )
    value, baseline = (statistics.median(r.steps_per_s for r in sides[n]) for n in (2, 1))
    return Result(
        name,
        value,
        "steps/s",
        baseline,
        f"ps_replicas=1 ({servers} ps) + 2 workers, same run, median of {rounds}; replicated: {2 * servers} ps",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--only", nargs="+", choices=METRICS, help="measure only these metrics")
    parser.add_argument("--closures", type=int, default=2000)
    parser.add_argument("--scale-closures", type=int, default=3000, help="closures per point of closure_overhead_scale")
    parser.add_argument("--steps", type=int, default=600, help="timed steps of the small model per side")
    parser.add_argument("--large-steps", type=int, default=60, help="timed steps of the large model per side")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each training comparison (medians)")
    parser.add_argument(
        "--steps-per-closure",
        type=int,
        default=1,
        help="paramserve's steps per closure in the training comparisons (the issue's bar: 1)",
    )
    args = parser.parse_args(argv)
    wanted = set(args.only or METRICS)
    one_torch_thread()
    results: list[Result] = []

    if "closures" in wanted:
        request_bytes = len(dumps_closure((noop, (), {})))
        bare = bare_round_trips_per_second(args.closures, request_bytes)
        with LocalCluster(num_ps=2, num_workers=2, env=worker_environment()) as cluster:
            closures = closures_per_second(cluster, args.closures)
        print(f"trivial closures: {closures:.0f}/s; bare gRPC round trips: {bare:.0f}/s ({request_bytes} B)")
        results.append(Result("closures", closures, "closures/s", bare, "bare gRPC unary round trips/s"))
    if "closure_overhead_scale" in wanted:
        curves = closure_overhead_scale((2, 16, 64, 256), args.scale_closures)
        for max_batch, points in curves.items():
            base, name = points[0], "closure_overhead_scale" if max_batch > 1 else "closure_overhead_unbatched"
            for point in points[1:]:
                results.append(
                    Result(
                        f"{name}_{point.workers}",
                        point.cpu_us_per_closure,
                        "CPU-us",
                        base.cpu_us_per_closure,
                        f"{base.workers} workers, same run",
                    )
                )
        points = curves[CoordinatorConfig().max_batch]
        results.append(
            Result(
                f"coordinator_threads_{points[-1].workers}",
                points[-1].threads,
                "threads",
                points[0].threads,
                f"{points[0].workers} workers, same run",
            )
        )
        results.append(
            Result(
                f"coordinator_rss_{points[-1].workers}",
                points[-1].rss_mb,
                "MB",
                points[0].rss_mb,
                f"{points[0].workers} workers, same run",
            )
        )
    if "closure_pickling" in wanted:
        by_reference, by_value = closure_pickling_us(500)
        print(f"closure pickling: {by_reference:.0f} us by reference, {by_value:.0f} us by value")
        results.append(
            Result("closure_pickling", by_reference, "us", by_value, "the same closure with its code sent by value")
        )
    if "train_steps_vs_rpc" in wanted:
        results.append(
            versus_rpc("train_steps_vs_rpc", SMALL, args.steps, 30, args.rounds, args.steps_per_closure, servers=1)
        )
    if "train_steps_large_vs_rpc" in wanted:
        results.append(
            versus_rpc("train_steps_large_vs_rpc", LARGE, args.large_steps, 5, args.rounds, args.steps_per_closure)
        )
    if "train_steps_overlapped" in wanted:
        results.append(overlapped_versus_awaited("train_steps_overlapped", 2, 2, args.steps, 30, args.rounds))
        results.append(overlapped_versus_awaited("train_steps_overlapped_1w", 1, 1, args.steps, 30, args.rounds))
    if "train_steps_replicated" in wanted:
        results.append(replicated_versus_single("train_steps_replicated", SMALL, 1, args.steps, args.rounds))
        results.append(
            replicated_versus_single("train_steps_large_replicated", LARGE, 2, args.large_steps, args.rounds)
        )
    if "gpu_worker_steps" in wanted and torch.cuda.is_available():
        cpu = paramserve_steps(SMALL, args.steps, 30)
        gpu = paramserve_steps(SMALL, args.steps, 30, device="cuda:0")
        results.append(Result("gpu_worker_steps", gpu.steps_per_s, "steps/s", cpu.steps_per_s, "CPU workers, same run"))
    print_report("coordinator", results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
