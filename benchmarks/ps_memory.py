"""A parameter server's memory against the state it must hold.

    python benchmarks/ps_memory.py [--json] [--steps 5] [--table-rows 10000000]

One ``paramserve ps`` process (one torch thread) and one worker; the coordinator builds a model
in ``ParameterServerStrategy.scope()`` (one server, so every variable is one shard there) and
trains a few steps. The server's resident memory (VmRSS) is read once it serves (before any
variable), after the steps, and again once the server has returned freed memory (its trimmer
runs every 10 s); its peak (VmHWM) over the run too.

- ps_rss_growth_mlp_adam: the resident growth after the steps of the MLP 784-4096-2048-10 with
  Adam (values + exp_avg + exp_avg_sq), beside those bytes (the baseline): 1.0 means the server
  holds nothing but its state. ps_peak_growth_mlp_adam: the peak growth, beside the same bytes.
- ps_rss_growth_table_adagrad: the same for a table of --table-rows x 16 float32 rows with
  Adagrad (values + sum), trained by lookups of 4,096 random rows per step;
  ps_peak_growth_table_adagrad its peak.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from _common import (
    LARGE,
    MLP,
    Result,
    fixed_batch,
    memory_mb,
    one_torch_thread,
    print_report,
    train_step,
    worker_environment,
)

from paramserve.coordinator import ClusterCoordinator, LocalCluster, ParameterServerStrategy, ShardedEmbedding

TRIM_WAIT_SECONDS = 12.0
"""Longer than the server's trimming interval (psserver/runtime/memory.py), so freed memory is back."""


@dataclass
class Memory:
    state_mb: float
    before_mb: float
    after_steps_mb: float
    settled_mb: float
    peak_mb: float


def measure(
    build: Callable[[], tuple[torch.nn.Module, float]], optimizer_class: type, step: Callable, steps: int
) -> Memory:
    with LocalCluster(
        num_ps=1,
        num_workers=1,
        env=worker_environment(),
        extra_ps_args=["--torch-threads", "1"],
        extra_worker_args=["--torch-threads", "1"],
    ) as cluster:
        pid = cluster.processes[0].pid
        strategy = ParameterServerStrategy(cluster.spec)
        try:
            before = memory_mb(pid, "VmRSS")
            with strategy.scope():
                model, state_mb = build()
            optimizer = strategy.optimizer(optimizer_class, lr=0.01)
            with ClusterCoordinator(strategy) as coordinator:
                for _ in range(steps):
                    coordinator.schedule(step, args=(model, optimizer))
                coordinator.join()
                after = memory_mb(pid, "VmRSS")
                time.sleep(TRIM_WAIT_SECONDS)
                settled = memory_mb(pid, "VmRSS")
                peak = memory_mb(pid, "VmHWM")
        finally:
            strategy.close()
    return Memory(state_mb, before, after, settled, peak)


def build_mlp() -> tuple[torch.nn.Module, float]:
    torch.manual_seed(0)
    model = MLP(LARGE)
    values = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    return model, 3 * values  # Adam: the values, exp_avg and exp_avg_sq


def mlp_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    return train_step(fixed_batch(0, LARGE), model, optimizer)


class Table(torch.nn.Module):
    def __init__(self, rows: int):
        super().__init__()
        self.table = ShardedEmbedding(rows, 16)


def table_step(model: Table, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    ids = torch.randint(0, model.table.num_embeddings, (4096,))
    optimizer.zero_grad()
    loss = model.table(ids).pow(2).sum()
    loss.backward()
    optimizer.step()
    return loss.detach()


def report(name: str, memory: Memory) -> list[Result]:
    print(
        f"  [{name}] state {memory.state_mb:.1f} MB; server RSS {memory.before_mb:.1f} MB before, "
        f"{memory.after_steps_mb:.1f} after the steps, {memory.settled_mb:.1f} {TRIM_WAIT_SECONDS:.0f} s later; "
        f"peak {memory.peak_mb:.1f}",
        flush=True,
    )
    state = f"params + slots ({memory.state_mb:.1f} MB)"
    return [
        Result(f"ps_rss_growth_{name}", memory.after_steps_mb - memory.before_mb, "MB", memory.state_mb, state),
        Result(f"ps_settled_growth_{name}", memory.settled_mb - memory.before_mb, "MB", memory.state_mb, state),
        Result(f"ps_peak_growth_{name}", memory.peak_mb - memory.before_mb, "MB", memory.state_mb, state),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--table-rows", type=int, default=10_000_000)
    args = parser.parse_args(argv)
    one_torch_thread()
    results = report("mlp_adam", measure(build_mlp, torch.optim.Adam, mlp_step, args.steps))

    def build_table() -> tuple[torch.nn.Module, float]:
        return Table(args.table_rows), 2 * args.table_rows * 16 * 4 / 2**20  # Adagrad: the values and sum

    results += report("table_adagrad", measure(build_table, torch.optim.Adagrad, table_step, args.steps))
    print_report("parameter-server memory", results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
