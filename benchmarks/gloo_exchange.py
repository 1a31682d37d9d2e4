"""One step's dense gradients exchanged among hybrid training's members on gloo: point-to-point
sends to every other member (each summing in rank order, worker/dense/group.py's pairwise
exchange) beside gloo's all-reduce, same processes, same run.

    python benchmarks/gloo_exchange.py [--json] [--members 2] [--floats 29721] [--steps 2000]

--members processes (spawned, one torch thread each) on 127.0.0.1 form a ProcessGroupGloo; each
runs --steps exchanges of --floats float32 (default: the DLRM-shaped model's MLPs, 29,713
parameters, plus two members' header slots) one way, then --steps the other, and reports rank
0's wall time and CPU (user + system, all its threads) per exchange.

- gloo_exchange_pairwise_ms: wall ms per pairwise exchange, beside the all-reduce's.
- gloo_exchange_pairwise_cpu_ms: CPU ms per pairwise exchange, beside the all-reduce's.
"""

from __future__ import annotations

import argparse
import multiprocessing
import resource
import sys
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from _common import Result, free_port, print_report

from paramserve.worker.dense.group import post_pairwise, sum_in_rank_order

WARMUP = 50


def exchange(group: dist.ProcessGroup, flat: torch.Tensor, rank: int, members: int, pairwise: bool) -> torch.Tensor:
    if not pairwise:
        group.allreduce([flat]).wait()
        return flat
    works, received = post_pairwise(lambda collective, *args: getattr(group, collective)(*args), flat, rank, members)
    for work in works:
        work.wait()
    return sum_in_rank_order([flat if part is None else part for part in received])


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def member(rank: int, members: int, port: int, floats: int, steps: int, out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, members, rank == 0)
    group = dist.ProcessGroupGloo(store, rank, members)
    flat = torch.full((floats,), float(rank + 1))
    timings = {}
    for pairwise in (False, True):
        for _ in range(WARMUP):
            exchange(group, flat.clone(), rank, members, pairwise)
        cpu, wall = cpu_seconds(), time.perf_counter()
        for _ in range(steps):
            total = exchange(group, flat.clone(), rank, members, pairwise)
        timings[pairwise] = ((time.perf_counter() - wall) / steps * 1000, (cpu_seconds() - cpu) / steps * 1000)
        expected = members * (members + 1) / 2
        assert float(total[0]) == expected, (pairwise, float(total[0]), expected)
    if rank == 0:
        out.put(timings)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--members", type=int, default=2)
    parser.add_argument("--floats", type=int, default=29_713 + 8)
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args(argv)
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    port = free_port()
    processes = [
        context.Process(target=member, args=(rank, args.members, port, args.floats, args.steps, out))
        for rank in range(args.members)
    ]
    for process in processes:
        process.start()
    timings = out.get(timeout=600)
    for process in processes:
        process.join(60)
    (ring_ms, ring_cpu), (pair_ms, pair_cpu) = timings[False], timings[True]
    what = f"gloo all-reduce, {args.members} members, {args.floats:,} float32"
    results = [
        Result("gloo_exchange_pairwise_ms", pair_ms, "ms", ring_ms, what),
        Result("gloo_exchange_pairwise_cpu_ms", pair_cpu, "CPU-ms", ring_cpu, what),
    ]
    print_report("dense exchange on gloo (hybrid training)", results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
