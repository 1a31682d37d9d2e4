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
- kill_to_resume_sigkill_seconds / kill_to_resume_sigterm_seconds: from the kill (SIGKILL, or
  SIGTERM: a graceful stop that drains for --grace-seconds) to the first closure finished after,
  the replacement's start included, beside the manual restart measured from its own kill.
- new_address_resume_seconds: server 0 replaced at a new address under the same name (network
  namespaces; needs root), from the replacement serving to the first checkpoint after it,
  beside ps_recovery_seconds (the same at the same address).
- failover_seconds (ps_replicas=2: 2 groups of a primary and a backup on 4 servers, the same
  model, workers and checkpoint interval): from SIGKILLing group 1's primary mid-interval to the
  first of the closures scheduled right after the kill finished (its backup took over; the
  time includes noticing the failure), beside kill_to_resume_sigkill_seconds
  (checkpoint recovery, above); failover_max_seconds, the slowest round's; failover_sigterm_seconds
  the same for a graceful stop; steps_lost_replicated: the acknowledged steps missing from any
  shard afterwards (0: every shard's version is the closures run), beside steps_lost_at_interval_N
  of the first interval; rejoin_seconds: from the killed server restarted (serving) to its group
  whole again (the coordinator copied the primary into it), beside failover_seconds.
Medians over --rounds. ``--replicated-only`` measures the replicated figures alone.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _common
import torch
from _common import Result, print_report, worker_environment

from paramserve.coordinator import CheckpointManager, ClusterCoordinator
from paramserve.coordinator.demos.digits import MLP, train_step, worker_batches
from paramserve.coordinator.local_cluster import LocalCluster
from paramserve.coordinator.strategies.parameter_server import ParameterServerStrategy
from paramserve.psserver.protocol.partition import FixedShardsPartitioner

_common.one_torch_thread()
POLL = 0.002


def build(cluster: LocalCluster, seed: int = 0, replicas: int = 1):  # type: ignore[no-untyped-def]
    strategy = ParameterServerStrategy(
        cluster.spec, variable_partitioner=FixedShardsPartitioner(2), reuse_variables=True, ps_replicas=replicas
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


def one_round(interval: int, directory: Path, how: str = "sigkill") -> dict[str, float]:
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
            killed = time.monotonic()
            if how == "sigterm":
                cluster.terminate_ps(1)
            else:
                cluster.kill_ps(1)
            cluster.restart_ps(1)
            healthy = time.monotonic()
            pending = [v for v in values if not v.done()]
            # None pending: the coordinator recovered the server and ran them all before
            # restart_ps returned (a graceful stop's drain can take that long): resumed by then.
            resumed = wait_first_done(pending, healthy + 120) if pending else healthy
            coordinator.join()
            internal = coordinator.recovery.recoveries[-1].seconds if coordinator.recovery else float("nan")
            shards = {s.ref: s.version for states in strategy.client.export().values() for s in states}
        lost = max(shards.values()) - min(shards.values())
        strategy.close()

        # What TensorFlow leaves to the user: restart the job, restore the checkpoint everywhere.
        killed_manually = time.monotonic()
        cluster.kill_ps(1)
        cluster.restart_ps(1)
        healthy_manually = time.monotonic()
        strategy, model, optimizer = build(cluster, seed=1)
        CheckpointManager(strategy, directory / "auto").restore_or_initialize()
        with ClusterCoordinator(strategy) as coordinator:
            batches = iter(coordinator.create_per_worker_dataset(worker_batches))
            coordinator.schedule(train_step, args=(batches, model, optimizer)).fetch(timeout=120)
            done_manually = time.monotonic()
        strategy.close()
    return {
        "auto": resumed - healthy,
        "manual": done_manually - healthy_manually,
        "kill_to_resume": resumed - killed,
        "kill_to_manual": done_manually - killed_manually,
        "lost": float(lost),
        "internal": internal,
    }


def failover_round(interval: int, directory: Path, how: str = "sigkill") -> dict[str, float]:
    """One round with ps_replicas=2: group 1's primary stopped mid-interval (see the module)."""
    with LocalCluster(4, 2, env=worker_environment(), extra_worker_args=("--ps-retry-deadline", "10")) as cluster:
        strategy, model, optimizer = build(cluster, replicas=2)
        manager = CheckpointManager(strategy, directory / "replicated")
        with ClusterCoordinator(strategy) as coordinator:
            batches = iter(coordinator.create_per_worker_dataset(worker_batches))
            for _ in range(interval):
                coordinator.schedule(train_step, args=(batches, model, optimizer))
            coordinator.join()
            manager.save(step=interval)
            for _ in range(interval // 2):
                coordinator.schedule(train_step, args=(batches, model, optimizer))
            coordinator.join()
            primary = strategy.client.addresses[1]
            index = cluster.parameter_servers.index(primary)
            killed = time.monotonic()
            if how == "sigterm":
                cluster.terminate_ps(index)
            else:
                cluster.kill_ps(index)
            # Scheduled after the kill, so none of them can have finished on the old primary.
            after = [coordinator.schedule(train_step, args=(batches, model, optimizer)) for _ in range(interval // 2)]
            resumed = wait_first_done(after, killed + 120)
            coordinator.join()
            cluster.restart_ps(index)
            serving = time.monotonic()
            groups = strategy.servers.groups
            assert groups is not None
            while not all(len(state.in_sync) == 1 for state in groups.states()):
                if time.monotonic() > serving + 120:
                    raise TimeoutError("the restarted server did not rejoin")
                time.sleep(POLL)
            rejoined = time.monotonic()
            versions = [s.version for states in strategy.client.export().values() for s in states]
        strategy.close()
    acknowledged = interval + 2 * (interval // 2)
    return {"failover": resumed - killed, "lost": float(acknowledged - min(versions)), "rejoin": rejoined - serving}


def new_address_round(directory: Path) -> dict[str, float] | None:
    """Parameter server 0 replaced at a new address under its name, across network namespaces
    (tests/multihost's hosts; needs root and `ip netns`): seconds from the replacement serving to
    the first checkpoint written after it, which the demo writes every 48 steps (an upper bound
    of the first closure finished). None where namespaces cannot be made."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "multihost"))
    from network_hosts import NetworkHosts, missing_requirements

    if missing_requirements() is not None:
        return None
    hosts_of = {
        "ps0a": "10.254.215.11",
        "ps0b": "10.254.215.12",
        "ps1": "10.254.215.13",
        "w0": "10.254.215.21",
        "w1": "10.254.215.22",
        "coord": "10.254.215.31",
    }
    names = (("ps0.recovery.bench", "ps0a"), ("ps1.recovery.bench", "ps1"))
    token = directory / "token"
    directory.mkdir(parents=True, exist_ok=True)
    token.write_text("benchmark-secret\n")
    env = {**worker_environment(), "PARAMSERVE_PROCESSES_PER_HOST": "5"}
    cli = [sys.executable, "-m", "paramserve.coordinator.commands.cli"]

    def point(ps0_host: str) -> None:
        for client in ("coord", "w0", "w1"):
            hosts.hosts_file(client, [(hosts_of[ps0_host], names[0][0]), (hosts_of["ps1"], names[1][0])])

    def serve(host: str, role: str) -> Path:
        port_file = directory / f"{host}.port"
        own = ["--port", "5000"] if role == "ps" else ["--port", "6000", "--ps-retry-deadline", "10"]
        argv = [*cli, role, "--host", hosts_of[host], *own, "--token-file", str(token), "--port-file", str(port_file)]
        hosts.start(host, argv, log=(directory / f"{host}.log").open("wb"), env=env)
        return port_file

    def wait(condition, seconds: float) -> None:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + seconds
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError("the new-address round stalled")
            time.sleep(0.02)

    checkpoints = directory / "checkpoints"
    hosts = NetworkHosts("10.254.215.0/24", hosts_of, prefix=f"psbn{os.getpid()}")
    with hosts:
        point("ps0a")
        ready = [serve("ps0a", "ps"), serve("ps1", "ps"), serve("w0", "worker"), serve("w1", "worker")]
        wait(lambda: all(f.exists() for f in ready), 120)
        coordinator = hosts.start(
            "coord",
            [
                *cli,
                "demo",
                "--cluster-from-env",
                "--token-file",
                str(token),
                "--checkpoint-dir",
                str(checkpoints),
                "--steps",
                "2000",
                "--checkpoint-every",
                "48",
                "--quiet",
            ],
            log=(directory / "coordinator.log").open("wb"),
            env={
                **env,
                "PARAMSERVE_PS": ",".join(f"{name}:5000" for name, _ in names),
                "PARAMSERVE_WORKERS": f"{hosts_of['w0']}:6000,{hosts_of['w1']}:6000",
            },
        )
        wait(lambda: len(list(checkpoints.glob("ckpt-*"))) >= 3, 240)
        for process in hosts.processes_on("ps0a"):
            process.kill()
        hosts.set_link("ps0a", up=False)
        point("ps0b")
        replacement = serve("ps0b", "ps")
        wait(replacement.exists, 120)
        served = replacement.stat().st_mtime
        wait(lambda: any(p.stat().st_mtime > served for p in checkpoints.glob("ckpt-*")), 120)
        resumed = min(p.stat().st_mtime for p in checkpoints.glob("ckpt-*") if p.stat().st_mtime > served)
        coordinator.wait(300)
    return {"new_address": resumed - served}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--intervals", type=int, nargs="+", default=[50, 200])
    parser.add_argument("--replicated-only", action="store_true", help="only the ps_replicas=2 figures")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    results: list[Result] = []
    rounds: dict[int, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        replicated = [failover_round(args.intervals[0], Path(tmp) / f"r-{r}") for r in range(args.rounds)]
        replicated_sigterm = [
            failover_round(args.intervals[0], Path(tmp) / f"rt-{r}", "sigterm") for r in range(args.rounds)
        ]
        print(f"replicated: {replicated}; sigterm: {replicated_sigterm}", file=sys.stderr)
        if args.replicated_only:
            print_report("recovery", replicated_results(replicated, replicated_sigterm, None, None), args.json)
            return 0
        for interval in args.intervals:
            rounds[interval] = [one_round(interval, Path(tmp) / f"{interval}-{r}") for r in range(args.rounds)]
            print(f"interval {interval}: {rounds[interval]}", file=sys.stderr)
        graceful = [one_round(args.intervals[0], Path(tmp) / f"sigterm-{r}", "sigterm") for r in range(args.rounds)]
        print(f"sigterm: {graceful}", file=sys.stderr)
        moved = [new_address_round(Path(tmp) / f"new-address-{r}") for r in range(args.rounds)]
        print(f"new address: {moved}", file=sys.stderr)
    everything = [r for runs in rounds.values() for r in runs]
    results.append(
        Result(
            "kill_to_resume_sigkill_seconds",
            statistics.median(r["kill_to_resume"] for r in everything),
            "s",
            statistics.median(r["kill_to_manual"] for r in everything),
            "manual_restart_from_the_kill_seconds",
        )
    )
    results.append(
        Result(
            "kill_to_resume_sigterm_seconds",
            statistics.median(r["kill_to_resume"] for r in graceful),
            "s",
            statistics.median(r["kill_to_manual"] for r in graceful),
            "manual_restart_from_the_kill_seconds",
        )
    )
    if all(m is not None for m in moved):
        results.append(
            Result(
                "new_address_resume_seconds",
                statistics.median(m["new_address"] for m in moved if m is not None),
                "s",
                statistics.median(r["auto"] for r in everything),
                "ps_recovery_seconds (same address)",
            )
        )
    else:
        print("new_address_resume_seconds: not measured (needs root and `ip netns`)", file=sys.stderr)
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
    first = rounds[args.intervals[0]]
    results += replicated_results(
        replicated,
        replicated_sigterm,
        statistics.median(r["kill_to_resume"] for r in everything),
        (args.intervals[0], statistics.median(r["lost"] for r in first)),
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


def replicated_results(
    rounds: list[dict[str, float]],
    sigterm: list[dict[str, float]],
    checkpoint_resume: float | None,
    checkpoint_lost: tuple[int, float] | None,
) -> list[Result]:
    failover = statistics.median(r["failover"] for r in rounds)
    nan = float("nan")
    return [
        Result(
            "failover_seconds",
            failover,
            "s",
            nan if checkpoint_resume is None else checkpoint_resume,
            "kill_to_resume_sigkill_seconds (checkpoint recovery, replicas=1)",
        ),
        Result("failover_max_seconds", max(r["failover"] for r in rounds), "s", 2.0, "the bar"),
        Result(
            "failover_sigterm_seconds",
            statistics.median(r["failover"] for r in sigterm),
            "s",
            failover,
            "failover_seconds (SIGKILL)",
        ),
        Result(
            "steps_lost_replicated",
            max(r["lost"] for r in [*rounds, *sigterm]),
            "steps",
            nan if checkpoint_lost is None else checkpoint_lost[1],
            f"steps_lost_at_interval_{checkpoint_lost[0] if checkpoint_lost else 'N'} (checkpoint recovery)",
        ),
        Result("rejoin_seconds", statistics.median(r["rejoin"] for r in rounds), "s", failover, "failover_seconds"),
    ]


if __name__ == "__main__":
    raise SystemExit(main())
