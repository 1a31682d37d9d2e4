"""Synchronous data-parallel training steps per second, beside torch DistributedDataParallel.

    python benchmarks/mirrored_vs_ddp.py [--json] [--steps 300] [--repeats 3] [--rounds 3]

The same MLP 784-256-128-10, SGD with momentum, cross-entropy, global batch 128
(64 per replica), random MNIST-shaped data, 2 replicas on one machine:

- mirrored_steps: in-process ``MirroredStrategy`` with 2 CPU replicas (one thread
  each), 1 intra-op thread per replica (``torch.set_num_threads(1)`` for the
  measurement, restored after it).
- multi_worker_mirrored_steps: ``MultiWorkerMirroredStrategy``, 2 gloo processes
  on 127.0.0.1, 1 intra-op thread each.
- baseline: ``DistributedDataParallel``, 2 gloo processes on 127.0.0.1, 1
  intra-op thread each.

Fairness: every setup runs 2 replicas with 1 intra-op thread each, i.e. as many
compute threads as replicas. (Until this was made explicit, the in-process
strategy ran with torch's default intra-op thread count, the number of cores, in
*each* replica thread: 2 replicas x 2 OpenMP threads on a 2-core machine, an
oversubscription the DDP processes, pinned to 1 thread each, did not have.) The
same model, seed, optimizer, global batch (each replica 64 examples, the same
split) and warm-up (20 untimed steps per setup) are used throughout; the DDP
loss is the local mean, the strategies' is the sum over the global batch size:
the same gradients after the all-reduce.

Each figure is the median of ``--rounds`` x ``--repeats`` timed runs of
``--steps`` steps (after a warm-up); the three setups take turns, round after
round, so that the machine's changing load weighs on all of them alike.
"""

from __future__ import annotations

import argparse
import multiprocessing
import socket
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import Result, print_report
from torch import nn

GLOBAL_BATCH = 128
REPLICAS = 2
WARMUP_STEPS = 20
PROCESS_DEADLINE = 600.0
DDP_NAME = "DistributedDataParallel, 2 gloo processes"


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def global_batches(count: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A few fixed random batches, cycled (the benchmark measures the system, not learning)."""
    generator = torch.Generator().manual_seed(0)
    return [
        (
            torch.randn(GLOBAL_BATCH, 784, generator=generator),
            torch.randint(0, 10, (GLOBAL_BATCH,), generator=generator),
        )
        for _ in range(count)
    ]


def local_batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(x.tensor_split(REPLICAS)[rank], y.tensor_split(REPLICAS)[rank]) for x, y in global_batches()]


def timed_runs(step: Callable[[int], object], steps: int, repeats: int, barrier: Callable[[], None]) -> list[float]:
    """Steps per second of ``repeats`` runs of ``steps`` steps, after a warm-up."""
    for i in range(WARMUP_STEPS):
        step(i)
    rates = []
    for _ in range(repeats):
        barrier()
        start = time.perf_counter()
        for i in range(steps):
            step(i)
        barrier()
        rates.append(steps / (time.perf_counter() - start))
    return rates


# ------------------------------------------------------------------ in-process MirroredStrategy


def load_mirrored_strategy() -> type:
    """MirroredStrategy, or a fast, clear exit when coordinator/strategies/mirrored.py is not there."""
    try:
        from paramserve.coordinator.strategies.mirrored import MirroredStrategy
    except ImportError as e:
        sys.exit(
            f"mirrored_vs_ddp: MirroredStrategy is not available ({e}); this benchmark needs "
            "coordinator/strategies/mirrored.py"
        )
    return MirroredStrategy


def mirrored_rates(strategy_class: type, steps: int, repeats: int) -> list[float]:
    """In this process, with 1 intra-op thread per replica, like each DDP process (see the
    module docstring); the caller's setting is restored afterwards."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # replica threads inherit it
    try:
        return _mirrored_rates(strategy_class, steps, repeats)
    finally:
        torch.set_num_threads(previous)


def _mirrored_rates(strategy_class: type, steps: int, repeats: int) -> list[float]:
    strategy = strategy_class(devices=[f"cpu:{i}" for i in range(REPLICAS)])
    torch.manual_seed(0)
    with strategy.scope():
        model = MLP()
        optimizer = make_optimizer(model)
    batches = list(strategy.experimental_distribute_dataset(global_batches()))

    def replica_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y, reduction="sum") / GLOBAL_BATCH
        loss.backward()
        optimizer.step()
        return loss.detach()

    def step(i: int) -> object:
        return strategy.run(replica_step, batches[i % len(batches)])

    try:
        return timed_runs(step, steps, repeats, barrier=lambda: None)
    finally:
        close = getattr(strategy, "close", None)  # joins the replica threads (when it has them)
        if close is not None:
            close()


# ------------------------------------------------------------------ two gloo processes


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ddp_process(rank: int, port: int, steps: int, repeats: int, results: multiprocessing.Queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=REPLICAS)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(MLP())
    optimizer = make_optimizer(model)
    batches = local_batches(rank)

    def step(i: int) -> object:
        x, y = batches[i % len(batches)]
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)  # the local mean: DDP averages gradients across processes
        loss.backward()
        optimizer.step()
        return loss

    rates = timed_runs(step, steps, repeats, barrier=dist.barrier)
    if rank == 0:
        results.put(rates)
    dist.destroy_process_group()


def multi_worker_process(rank: int, port: int, steps: int, repeats: int, results: multiprocessing.Queue) -> None:
    from paramserve.coordinator.strategies.multi_worker import MultiWorkerMirroredStrategy
    from paramserve.coordinator.strategies.multi_worker_cluster import (
        CollectiveCommunication,
        CommunicationOptions,
        Rendezvous,
    )

    torch.set_num_threads(1)
    strategy = MultiWorkerMirroredStrategy(
        CommunicationOptions(CollectiveCommunication.RING), Rendezvous(rank, REPLICAS, "127.0.0.1", port)
    )
    torch.manual_seed(0)
    with strategy.scope():
        model = MLP()
        optimizer = make_optimizer(model)
    batches = list(strategy.experimental_distribute_dataset(global_batches()))

    def replica_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y, reduction="sum") / GLOBAL_BATCH
        loss.backward()
        optimizer.step()  # all-reduces the gradients first
        return loss.detach()

    def step(i: int) -> object:
        return strategy.run(replica_step, batches[i % len(batches)])

    rates = timed_runs(step, steps, repeats, barrier=strategy.barrier)
    if rank == 0:
        results.put(rates)
    strategy.shutdown()


def two_process_rates(target: Callable[..., None], steps: int, repeats: int) -> list[float]:
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [
        context.Process(target=target, args=(rank, port, steps, repeats, results), daemon=True)
        for rank in range(REPLICAS)
    ]
    for process in processes:
        process.start()
    try:
        rates = results.get(timeout=PROCESS_DEADLINE)
    finally:
        for process in processes:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()
    return rates


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--steps", type=int, default=300, help="steps per timed run")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; each runs all three setups in turn")
    args = parser.parse_args(argv)
    mirrored_class = load_mirrored_strategy()  # before anything slow: fail fast

    # The setups take turns, round after round, so that a change in the machine's load
    # during the run weighs on all of them alike; each figure is the median of its runs.
    rates: dict[str, list[float]] = {"ddp": [], "multi_worker": [], "mirrored": []}
    for _ in range(args.rounds):
        rates["ddp"] += two_process_rates(ddp_process, args.steps, args.repeats)
        rates["multi_worker"] += two_process_rates(multi_worker_process, args.steps, args.repeats)
        rates["mirrored"] += mirrored_rates(mirrored_class, args.steps, args.repeats)
    for name, runs in rates.items():
        print(
            f"{name:>12}: median {statistics.median(runs):7.1f} steps/s over {len(runs)} runs "
            f"(min {min(runs):.1f}, max {max(runs):.1f})"
        )
    ddp, multi_worker, mirrored = (statistics.median(rates[k]) for k in ("ddp", "multi_worker", "mirrored"))
    results = [
        Result("mirrored_steps", mirrored, "steps/s", ddp, DDP_NAME),
        Result("multi_worker_mirrored_steps", multi_worker, "steps/s", ddp, DDP_NAME),
    ]
    print_report("mirrored_vs_ddp", results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
