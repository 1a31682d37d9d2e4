"""Where a small-model training step's CPU goes, by process (a breakdown, not a comparison).

The run of ``coordinator.py``'s ``train_steps_vs_rpc`` (2 ps + 2 workers on 127.0.0.1, this
process as the coordinator), with each process's CPU time from /proc over the timed steps
divided by the steps. Usage: ``python benchmarks/step_cpu.py [--steps N] [--steps-per-closure K]``.
"""

from __future__ import annotations

import argparse

from _common import one_torch_thread

from coordinator import SMALL, paramserve_steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--steps-per-closure", type=int, default=1)
    args = parser.parse_args()
    one_torch_thread()
    run = paramserve_steps(SMALL, args.steps, 50, steps_per_closure=args.steps_per_closure)
    print(
        f"{run.steps_per_s:.1f} steps/s; CPU-ms per step: "
        + ", ".join(f"{name} {ms:.2f}" for name, ms in run.cpu_ms_by_process.items())
        + f"; total {run.cpu_ms_per_step:.2f}"
    )


if __name__ == "__main__":
    main()
