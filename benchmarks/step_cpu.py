"""Where a training step's CPU goes, by process (a breakdown, not a comparison).

``--model mlp`` (the default): the run of ``coordinator.py``'s ``train_steps_vs_rpc`` (2 ps + 2
workers on 127.0.0.1, this process as the coordinator), each process's CPU time from /proc over
the timed steps divided by the steps.

``--model dlrm``: the DLRM-shaped recommendation model of ``dlrm.py`` (2 ps + 2 workers, 26
tables capped at ``--cap`` rows; ``--per-feature``: one ShardedEmbedding per feature;
``--overlap-pushes``), its CPU-ms per step by role (coordinator, the servers summed, the workers
summed), beside one local process's CPU-ms per step on the same model in the same run: the
distribution tax, and where it is paid.

Usage: ``python benchmarks/step_cpu.py [--model mlp|dlrm] [--steps N] [--steps-per-closure K]``.
"""

from __future__ import annotations

import argparse

from _common import one_torch_thread


def mlp(args: argparse.Namespace) -> None:
    from coordinator import SMALL, paramserve_steps

    run = paramserve_steps(SMALL, args.steps, 50, steps_per_closure=args.steps_per_closure)
    print(
        f"{run.steps_per_s:.1f} steps/s; CPU-ms per step: "
        + ", ".join(f"{name} {ms:.2f}" for name, ms in run.cpu_ms_by_process.items())
        + f"; total {run.cpu_ms_per_step:.2f}"
    )


def dlrm(args: argparse.Namespace) -> None:
    from dlrm import local_run, paramserve_run

    run = paramserve_run(
        args.cap,
        args.steps,
        args.warmup,
        steps_per_closure=args.steps_per_closure,
        per_feature=args.per_feature,
        overlap_pushes=args.overlap_pushes,
    )
    local = local_run(args.cap, args.steps, args.warmup)
    print(
        f"DLRM cap {args.cap:,}: {run.samples_per_s:,.0f} samples/s; CPU-ms per step: "
        + ", ".join(f"{role} {ms:.2f}" for role, ms in sorted(run.cpu_ms_by_role.items()))
        + f"; total {run.cpu_ms_per_step:.2f} ({run.cpu_ms_per_step / local.cpu_ms_per_step:.2f}x one process's "
        f"{local.cpu_ms_per_step:.2f}, which trains {local.samples_per_s:,.0f} samples/s)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["mlp", "dlrm"], default="mlp")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=200, help="dlrm: steps before the timed ones")
    parser.add_argument("--steps-per-closure", type=int, default=1)
    parser.add_argument("--cap", type=int, default=100_000, help="dlrm: rows per table at most")
    parser.add_argument("--per-feature", action="store_true", help="dlrm: one ShardedEmbedding per feature")
    parser.add_argument("--overlap-pushes", action="store_true", help="dlrm: the workers' overlap_pushes")
    args = parser.parse_args()
    one_torch_thread()
    (dlrm if args.model == "dlrm" else mlp)(args)


if __name__ == "__main__":
    main()
