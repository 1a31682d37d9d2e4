"""ClusterCoordinator overhead and training throughput, beside baselines from the same run.

    python benchmarks/coordinator.py [--json] [--closures 2000] [--steps 400]

- closures: trivial closures per second through ClusterCoordinator.schedule/join
  on 2 worker processes, beside bare gRPC unary round trips per second (one
  caller, raw bytes of the same size as a closure request, another process).
- train_steps: training steps per second of an MLP 784-256-128-10, batch 64,
  with 2 parameter servers + 2 workers on 127.0.0.1 (asynchronous), beside the
  same model trained in one process with torch.optim.Adam.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F
from _common import EchoServer, Result, print_report
from torch import nn

from paramserve.coordinator import (
    ClusterCoordinator,
    LocalCluster,
    MinSizePartitioner,
    ParameterServerStrategy,
)
from paramserve.worker.variables import dumps_closure

BATCH = 64


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def noop() -> int:
    return 1


def synthetic_batches(context=None):  # type: ignore[no-untyped-def]
    """Endless random MNIST-shaped batches (the benchmark measures the system, not learning)."""
    generator = torch.Generator().manual_seed(getattr(context, "worker_index", 0))
    while True:
        yield torch.randn(BATCH, 784, generator=generator), torch.randint(0, 10, (BATCH,), generator=generator)


def step(batches, model, optimizer):  # type: ignore[no-untyped-def]
    x, y = next(batches)
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    return loss.detach()


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


def distributed_steps_per_second(cluster: LocalCluster, steps: int) -> float:
    strategy = ParameterServerStrategy(cluster.spec, variable_partitioner=MinSizePartitioner(max_shards=2))
    with strategy.scope():
        model = MLP()
    optimizer = strategy.optimizer(torch.optim.Adam, lr=1e-3)
    with ClusterCoordinator(strategy) as coordinator:
        batches = iter(coordinator.create_per_worker_dataset(synthetic_batches))
        for _ in range(20):
            coordinator.schedule(step, args=(batches, model, optimizer))
        coordinator.join()
        start = time.perf_counter()
        for _ in range(steps):
            coordinator.schedule(step, args=(batches, model, optimizer))
        coordinator.join()
        seconds = time.perf_counter() - start
    strategy.close()
    return steps / seconds


def local_steps_per_second(steps: int) -> float:
    model = MLP()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    batches = synthetic_batches()
    for _ in range(20):
        step(batches, model, optimizer)
    start = time.perf_counter()
    for _ in range(steps):
        step(batches, model, optimizer)
    return steps / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--closures", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args(argv)

    request_bytes = len(dumps_closure((noop, (), {})))
    bare = bare_round_trips_per_second(args.closures, request_bytes)
    print(f"bare gRPC round trips: {bare:.0f}/s ({request_bytes} B payload)")
    local = local_steps_per_second(args.steps)
    print(f"one-process training: {local:.1f} steps/s")
    with LocalCluster(num_ps=2, num_workers=2) as cluster:
        closures = closures_per_second(cluster, args.closures)
        print(f"trivial closures: {closures:.0f}/s")
        distributed = distributed_steps_per_second(cluster, args.steps)
        print(f"2 ps + 2 workers training: {distributed:.1f} steps/s")
    print_report("coordinator", [
        Result("closures", closures, "closures/s", bare, "bare gRPC unary round trips/s"),
        Result("train_steps", distributed, "steps/s", local, "same model trained in one process"),
    ], args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
