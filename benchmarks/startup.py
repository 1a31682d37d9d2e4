"""How fast a LocalCluster's processes start: forked from the zygote (the default) against fresh
interpreters (``LocalCluster(preload=False)``: ``python -m`` each, as a user would start them by
hand), in the same run, taking turns.

- cluster_start_seconds: 2 ps + 2 workers, from ``start()`` to every process ready (the zygote
  already running: it starts once per program; the first cluster's start, which includes it,
  is printed);
- child_cpu_seconds: the CPU those 4 processes had used when ready, summed (/proc);
- ps_restart_seconds: a SIGKILLed server restarted on its port, until ready again.

Medians of --rounds.

    python benchmarks/startup.py --json --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from _common import Result, print_report, process_cpu_seconds, worker_environment

from paramserve.coordinator.local_cluster import LocalCluster


def one_round(preload: bool) -> tuple[float, float, float]:
    """(start seconds, children's CPU seconds at ready, restart seconds) of one cluster."""
    started = time.perf_counter()
    with LocalCluster(num_ps=2, num_workers=2, env=worker_environment(), preload=preload) as cluster:
        start = time.perf_counter() - started
        cpu = sum(process_cpu_seconds(process.pid) for process in cluster.processes)
        cluster.kill_ps(0)
        restarted = time.perf_counter()
        cluster.restart_ps(0)
        restart = time.perf_counter() - restarted
    return start, cpu, restart


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    first = one_round(True)  # starts the zygote, once per program
    print(f"  first cluster, the zygote's start included: {first[0]:.2f}s", flush=True)

    sides: dict[bool, list[tuple[float, float, float]]] = {True: [], False: []}
    for round_ in range(args.rounds):
        for preload in (True, False):
            sides[preload].append(one_round(preload))
        forked, fresh = sides[True][-1], sides[False][-1]
        print(
            f"  [round {round_ + 1}/{args.rounds}] start {forked[0]:.2f}s vs {fresh[0]:.2f}s, "
            f"CPU {forked[1]:.2f}s vs {fresh[1]:.2f}s, restart {forked[2]:.2f}s vs {fresh[2]:.2f}s",
            flush=True,
        )
    baseline_name = f"fresh interpreters (preload=False), same run, median of {args.rounds}"
    results = [
        Result(
            name,
            statistics.median(run[index] for run in sides[True]),
            "s",
            statistics.median(run[index] for run in sides[False]),
            baseline_name,
        )
        for index, name in enumerate(("cluster_start_seconds", "child_cpu_seconds", "ps_restart_seconds"))
    ]
    print_report("startup", results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
