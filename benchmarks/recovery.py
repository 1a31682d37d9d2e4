"""Parameter-server recovery: how long training stops and what it loses, beside restarting by hand.

    python benchmarks/recovery.py [--json] [--rounds 3] [--intervals 50 200]

The demo's model (MLP 64-32-10 on scikit-learn's digits, SGD with momentum, FixedShardsPartitioner(2))
trains on 2 ps + 2 workers with a checkpoint every INTERVAL steps. Mid-interval, parameter
server 1 is SIGKILLed and restarted empty at its address (LocalCluster.restart_ps returns once
the replacement serves):

- ps_recovery_seconds: from the replacement serving to the first closure finished after it
  (its pushes applied), with the coordinator's automatic recovery (lost shards restored from
  the latest checkpoint), beside manual_restart_seconds: what TensorFlow leaves to the user,
  measured in the same run from the same moment: a new strategy and coordinator in this process
  (no interpreter start-up counted) restore the latest checkpoint onto every server and run a step.
- steps_lost_at_interval_N: steps undone on the restored server's shards (its versions behind
  the surviving server's), beside N, the checkpoint interval (the bound); a manual restart loses
  the same steps on every server.
- recovery_internal_seconds: the coordinator's own part of ps_recovery_seconds (the replacement
  answering its probe -> dispatch resuming: drain, restore, generation bump).
Medians over --rounds.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _common
import torch
from _common import Result, print_report, worker_environment

from paramserve.coordinator import CheckpointManager, ClusterCoordinator
from paramserve.coordinator.commands.demo import MLP, train_step, worker_batches
from paramserve.coordinator.local_cluster import LocalCluster
from paramserve.coordinator.strategies.parameter_server import ParameterServerStrategy
from paramserve.psserver.partition import FixedShardsPartitioner

_common.one_torch_thread()
POLL = 0.002


def build(cluster: LocalCluster, seed: int = 0):  # type: ignore[no-untyped-def]
    strategy = ParameterServerStrategy(
        cluster.spec, variable_partitioner=FixedShardsPartitioner(2), reuse_variables=True
    )
    torch.manual_seed(seed)
    with strategy.scope():
        model = MLP(32)
    return strategy, model, strategy.optimizer(torch.optim.SGD, lr=0.05, momentum=0.9)


def wait_first_done(values: list, deadline: float) -> float:  # type: ignore[type-arg]
    """When the first of ``values`` finished (polled: RemoteValues have no callback)."""
    while time.monotonic() < deadline:
        if any(v.done() for v in values):
            return time.monotonic()
        time.sleep(POLL)
    raise TimeoutError("no closure finished")


def one_round(interval: int, directory: Path) -> dict[str, float]:
    with LocalCluster(2, 2, env=worker_environment(), extra_worker_args=("--ps-retry-deadline", "10")) as cluster:
        strategy, model, optimizer = build(cluster)
        manager = CheckpointManager(strategy, directory / "auto")
        with ClusterCoordinator(strategy) as coordinator:
            batches = iter(coordinator.create_per_worker_dataset(worker_batches))
            for _ in range(interval):
                coordinator.schedule(train_step, args=(batches, model, optimizer))
            coordinator.join()
            manager.save(step=interval)
            values = [coordinator.schedule(train_step, args=(batches, model, optimizer)) for _ in range(interval)]
            values[interval // 2].fetch(timeout=120)  # half an interval since the checkpoint
            cluster.kill_ps(1)
            cluster.restart_ps(1)
            healthy = time.monotonic()
            pending = [v for v in values if not v.done()]
            auto = wait_first_done(pending, healthy + 120) - healthy
            coordinator.join()
            internal = coordinator.recovery.recoveries[-1].seconds if coordinator.recovery else float("nan")
            shards = {s.ref: s.version for states in strategy.client.export().values() for s in states}
        lost = max(shards.values()) - min(shards.values())
        strategy.close()

        # What TensorFlow leaves to the user: restart the job, restore the checkpoint everywhere.
        cluster.kill_ps(1)
        cluster.restart_ps(1)
        healthy = time.monotonic()
        strategy, model, optimizer = build(cluster, seed=1)
        CheckpointManager(strategy, directory / "auto").restore_or_initialize()
        with ClusterCoordinator(strategy) as coordinator:
            batches = iter(coordinator.create_per_worker_dataset(worker_batches))
            coordinator.schedule(train_step, args=(batches, model, optimizer)).fetch(timeout=120)
            manual = time.monotonic() - healthy
        strategy.close()
    return {"auto": auto, "manual": manual, "lost": float(lost), "internal": internal}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--intervals", type=int, nargs="+", default=[50, 200])
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    results: list[Result] = []
    rounds: dict[int, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for interval in args.intervals:
            rounds[interval] = [one_round(interval, Path(tmp) / f"{interval}-{r}") for r in range(args.rounds)]
            print(f"interval {interval}: {rounds[interval]}", file=sys.stderr)
    everything = [r for runs in rounds.values() for r in runs]
    results.append(
        Result(
            "ps_recovery_seconds",
            statistics.median(r["auto"] for r in everything),
            "s",
            statistics.median(r["manual"] for r in everything),
            "manual_restart_seconds",
        )
    )
    results.append(
        Result(
            "recovery_internal_seconds",
            statistics.median(r["internal"] for r in everything),
            "s",
            statistics.median(r["auto"] for r in everything),
            "ps_recovery_seconds",
        )
    )
    for interval, runs in rounds.items():
        results.append(
            Result(
                f"steps_lost_at_interval_{interval}",
                statistics.median(r["lost"] for r in runs),
                "steps",
                float(interval),
                "checkpoint_interval",
            )
        )
    print_report("recovery", results, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
