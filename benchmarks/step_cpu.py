"""Where a small-model training step's CPU goes, by process (not a comparison: a breakdown).

2 ps + 2 workers on 127.0.0.1 and this process as the coordinator, as in
``coordinator.py``'s ``train_steps_vs_rpc``; CPU time of each process from /proc over the
timed steps, divided by the steps. Usage: ``python benchmarks/step_cpu.py [--steps N]
[--steps-per-closure K]``.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from _common import MLP, make_batch, one_torch_thread, process_cpu_seconds, worker_environment

from coordinator import LR, SMALL, train_step
from paramserve.coordinator import ClusterCoordinator, FixedShardsPartitioner, LocalCluster, ParameterServerStrategy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--steps-per-closure", type=int, default=1)
    args = parser.parse_args()
    one_torch_thread()
    names = ["ps0", "ps1", "worker0", "worker1"]
    with LocalCluster(num_ps=2, num_workers=2, env=worker_environment(), extra_ps_args=["--torch-threads", "1"],
                      extra_worker_args=["--torch-threads", "1"]) as cluster:
        strategy = ParameterServerStrategy(cluster.spec, variable_partitioner=FixedShardsPartitioner(2))
        try:
            torch.manual_seed(0)
            with strategy.scope():
                model = MLP(SMALL)
            optimizer = strategy.optimizer(torch.optim.SGD, lr=LR)
            with ClusterCoordinator(strategy) as coordinator:
                batch = coordinator.create_per_worker_resource(make_batch(SMALL))
                for _ in range(50):
                    coordinator.schedule(train_step, args=(batch, model, optimizer))
                coordinator.join()
                pids = {"coordinator": os.getpid(), **{n: p.pid for n, p in zip(names, cluster.processes)}}
                before = {n: process_cpu_seconds(p) for n, p in pids.items()}
                start = time.perf_counter()
                closures = max(1, args.steps // args.steps_per_closure)
                for _ in range(closures):
                    coordinator.schedule(train_step, args=(batch, model, optimizer), steps=args.steps_per_closure)
                coordinator.join()
                seconds = time.perf_counter() - start
                steps = closures * args.steps_per_closure
                per_step = {n: 1000 * (process_cpu_seconds(p) - before[n]) / steps for n, p in pids.items()}
        finally:
            strategy.close()
    print(f"{steps / seconds:.1f} steps/s; CPU-ms per step: "
          + ", ".join(f"{n} {v:.2f}" for n, v in per_step.items()) + f"; total {sum(per_step.values()):.2f}")


if __name__ == "__main__":
    main()
