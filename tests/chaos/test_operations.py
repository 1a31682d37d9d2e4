"""An operator's chaos suite: parameter servers and coordinators going away the ways real
operations make them go, with real processes on 127.0.0.1.

- a parameter server stopped gracefully (SIGTERM: a rolling update, a node drain, a
  ``compose up --force-recreate``) in the middle of training, and started again;
- a parameter server restarted five times while checkpoints are written every second, so
  restarts meet saves in progress;
- a learning-rate change between two kills of the same server;
- a coordinator killed before its first checkpoint, and run again.

(A replacement at a new address under the same name is tests/multihost's: it needs hosts
whose names resolve to changing addresses.) Each run must finish with no error in user code,
every closure completed, no push applied twice, accuracy within 1% of a clean run of the same
schedule, and every checkpoint on disk whole and loadable.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import cloudpickle
import pytest
import torch

from paramserve.coordinator.checkpointing.checkpoint_manager import CheckpointManager
from paramserve.coordinator.cluster_coordinator import ClusterCoordinator, CoordinatorConfig
from paramserve.coordinator.demos.digits import MLP, digits_split, train_step, worker_batches
from paramserve.coordinator.recovery.recovery_policy import RecoveryPolicy
from paramserve.coordinator.strategies.parameter_server import ParameterServerStrategy
from paramserve.psserver.checkpoint import shard_files as checkpoint
from paramserve.psserver.protocol.partition import FixedShardsPartitioner
from paramserve.psserver.protocol.types import ShardRef, ShardState

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import test modules

STEPS = 1800
CHUNK = 100
"""Steps scheduled before each join (and, unless saves run on their own thread, a checkpoint)."""
LR, FINE_TUNE_LR = 0.05, 0.005
FINE_TUNE_FROM_CHUNK = 16
"""The last two chunks go at a tenth of the rate: the final model then sits near a minimum, so
two asynchronous runs differ by what they learned, not by their last steps' noise. The failures
come in the first half: a restore loses the steps since the checkpoint, which the rest of the
run makes up for (as long training does)."""
WORKER_ARGS = ("--ps-retry-deadline", "10")
PS_ARGS = ("--grace-seconds", "2")


def build(cluster_spec):  # type: ignore[no-untyped-def]
    strategy = ParameterServerStrategy(cluster_spec, variable_partitioner=FixedShardsPartitioner(2))
    torch.manual_seed(0)
    with strategy.scope():
        model = MLP(32)
    return strategy, model, strategy.optimizer(torch.optim.SGD, lr=LR, momentum=0.9)


def accuracy(model: torch.nn.Module) -> float:
    """Over all 1,797 digits: on the 360 held out, 1% is within two asynchronous runs' noise."""
    x_train, y_train, x_test, y_test = digits_split(0)
    with torch.no_grad():
        predicted = model(torch.cat([x_train, x_test])).argmax(dim=1)
    return float((predicted == torch.cat([y_train, y_test])).float().mean())


@dataclass
class Chunk:
    """What an operation sees in the middle of a chunk: closures of it ran and more are queued."""

    index: int
    cluster: object
    strategy: ParameterServerStrategy
    optimizer: object


@dataclass
class Run:
    accuracy: float
    shards: dict[ShardRef, ShardState]
    recoveries: list[str] = field(default_factory=list)
    saves: int = 0


def train(
    cluster,
    directory: Path,
    operation: Callable[[Chunk], None] | None = None,
    *,  # type: ignore[no-untyped-def]
    save_every: float | None = None,
) -> Run:
    """STEPS steps in chunks of CHUNK; ``operation`` runs a quarter into every chunk. Checkpoints
    after each chunk, or every ``save_every`` seconds on a thread of their own."""
    strategy, model, optimizer = build(cluster.spec)
    manager = CheckpointManager(strategy, directory, max_to_keep=5)
    saves, stop = [0], threading.Event()

    failures: list[BaseException] = []

    def save_periodically() -> None:
        while not stop.wait(save_every):
            try:
                manager.save(step=saves[0])
            except BaseException as err:  # the test fails on it below, with the error
                failures.append(err)
                return
            saves[0] += 1

    config = CoordinatorConfig(recovery=RecoveryPolicy(probe_interval=0.5))
    with ClusterCoordinator(strategy, config) as coordinator:
        batches = iter(coordinator.create_per_worker_dataset(worker_batches))
        saver = threading.Thread(target=save_periodically, name="test-saver", daemon=True)
        if save_every is not None:
            manager.save(step=0)
            saver.start()
        try:
            for chunk in range(STEPS // CHUNK):
                if chunk == FINE_TUNE_FROM_CHUNK:
                    strategy.set_learning_rate(optimizer, FINE_TUNE_LR)
                values = [coordinator.schedule(train_step, args=(batches, model, optimizer)) for _ in range(CHUNK)]
                if operation is not None:
                    values[CHUNK // 4].fetch(timeout=120)
                    operation(Chunk(chunk, cluster, strategy, optimizer))
                coordinator.join(timeout=300)  # raises any error a closure met: there must be none
                assert all(torch.isfinite(value.fetch()) for value in values), "every closure completed"
                if save_every is None:
                    manager.save(step=(chunk + 1) * CHUNK)
                    saves[0] += 1
        finally:
            stop.set()
            if saver.is_alive():
                saver.join(60)
        assert not failures, f"a checkpoint failed: {failures[0]!r}"
        shards = {state.ref: state for states in strategy.client.export().values() for state in states}
        recoveries = [r.result for r in coordinator.recovery.recoveries] if coordinator.recovery else []
    result = Run(accuracy(model), shards, recoveries, saves[0])
    strategy.close()
    return result


def assert_nothing_applied_twice(shards: dict[ShardRef, ShardState]) -> None:
    for ref, state in shards.items():
        assert len(set(state.applied_keys)) == len(state.applied_keys), f"{ref}: a key recorded twice"
        assert state.version == len(state.applied_keys), (
            f"{ref}: {state.version} updates for {len(state.applied_keys)} distinct pushes"
        )


def assert_every_checkpoint_loads_whole(directory: Path) -> int:
    """Every ckpt-N on disk is whole and each of its variables loads in full; returns how many."""
    found = sorted(directory.glob("ckpt-*"))
    for path in found:
        assert checkpoint.is_whole(path), f"{path} is not whole"
        for name, entry in checkpoint.variables(path).items():
            state = checkpoint.load_rows(path, name, 0, entry.num_rows, ShardRef(name, 0))
            assert tuple(state.value.shape) == tuple(entry.variable_shape) or not entry.variable_shape
    assert found and checkpoint.latest_checkpoint(directory) == found[-1], "LATEST names the newest, whole"
    return len(found)


def assert_as_good_as_clean(run: Run, clean: Run) -> None:
    print(f"accuracy: clean {clean.accuracy:.4f}, this run {run.accuracy:.4f}")  # shown with pytest -rP
    assert clean.accuracy > 0.9, clean.accuracy
    assert abs(run.accuracy - clean.accuracy) <= 0.01, (run.accuracy, clean.accuracy)


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The same schedule with nothing going wrong: what every chaos run is compared to."""
    from paramserve.coordinator.local_cluster import LocalCluster

    with LocalCluster(2, 2, extra_worker_args=WORKER_ARGS, extra_ps_args=PS_ARGS) as cluster:
        run = train(cluster, tmp_path_factory.mktemp("clean"))
    assert {state.version for state in run.shards.values()} == {STEPS}
    return run


@pytest.mark.timeout(300)
def test_a_parameter_server_stopped_gracefully_mid_training_and_started_again(start_cluster, tmp_path, clean):
    cluster = start_cluster(2, 2, extra_worker_args=WORKER_ARGS, extra_ps_args=PS_ARGS)

    def stop_and_start(chunk: Chunk) -> None:
        if chunk.index in (2, 5):
            server = 1 if chunk.index == 2 else 0
            assert cluster.terminate_ps(server) == 0, "a graceful stop exits cleanly"
            cluster.restart_ps(server)

    run = train(cluster, tmp_path, stop_and_start)
    assert run.recoveries == ["restored", "restored"], run.recoveries
    assert_nothing_applied_twice(run.shards)
    assert_as_good_as_clean(run, clean)
    assert assert_every_checkpoint_loads_whole(tmp_path) >= 1


class KillDuringExport:
    """Wraps a strategy's export so that, when armed, the export's first step kills a parameter
    server and has it restarted meanwhile: a restart in the middle of a save, every time."""

    def __init__(self, cluster) -> None:  # type: ignore[no-untyped-def]
        self.cluster = cluster
        self.armed: int | None = None
        self.hits = 0
        self.restarters: list[threading.Thread] = []
        self.consumed = threading.Event()

    def arm(self, server: int, timeout: float = 60.0) -> None:
        """The next export kills ``server``; returns once an export has (the saver's thread
        exports every second on its own, so the training thread may wait for it)."""
        self.consumed.clear()
        self.armed = server
        assert self.consumed.wait(timeout), f"no export began within {timeout}s of arming"

    def wrap(self, strategy: ParameterServerStrategy) -> None:
        export = strategy.client.export

        def killing_export():  # type: ignore[no-untyped-def]
            server, self.armed = self.armed, None
            if server is not None:
                self.cluster.kill_ps(server)
                restarter = threading.Thread(target=self.cluster.restart_ps, args=(server,), daemon=True)
                restarter.start()
                self.restarters.append(restarter)
                self.hits += 1
                self.consumed.set()
            return export()

        strategy.client.export = killing_export  # type: ignore[method-assign]


@pytest.mark.timeout(420)
def test_restarts_while_checkpoints_are_written_every_second(start_cluster, tmp_path, clean, monkeypatch):
    cluster = start_cluster(2, 2, extra_worker_args=WORKER_ARGS, extra_ps_args=PS_ARGS)
    servers = random.Random(19)
    saboteur = KillDuringExport(cluster)
    monkeypatch.setattr(ParameterServerStrategy, "attach_coordinator", _wrapping_attach(saboteur))

    def restart(chunk: Chunk) -> None:
        if 1 <= chunk.index <= 6:
            server = servers.randrange(2)
            if chunk.index % 2:  # a save in progress meets it
                saboteur.arm(server)
            else:  # between saves, or wherever it falls
                cluster.kill_ps(server)
                cluster.restart_ps(server)

    run = train(cluster, tmp_path, restart, save_every=1.0)
    for restarter in saboteur.restarters:
        restarter.join(60)
    assert saboteur.hits == 3, "three restarts met a save in progress"
    # Six restarts; two that fall within one recovery (a server killed again before it was
    # restored) are recovered once.
    assert run.recoveries.count("restored") >= 5 and "failed" not in run.recoveries, run.recoveries
    assert run.saves >= saboteur.hits, "each save a restart met was written once the server was recovered"
    assert_nothing_applied_twice(run.shards)
    assert_as_good_as_clean(run, clean)
    assert assert_every_checkpoint_loads_whole(tmp_path) >= 4


def _wrapping_attach(saboteur: KillDuringExport):  # type: ignore[no-untyped-def]
    attach = ParameterServerStrategy.attach_coordinator

    def attach_and_wrap(strategy, coordinator):  # type: ignore[no-untyped-def]
        saboteur.wrap(strategy)
        return attach(strategy, coordinator)

    return attach_and_wrap


@pytest.mark.timeout(300)
def test_a_learning_rate_change_between_two_kills_reaches_the_restored_server(start_cluster, tmp_path, clean):
    cluster = start_cluster(2, 2, extra_worker_args=WORKER_ARGS, extra_ps_args=PS_ARGS)

    def kill(chunk: Chunk) -> None:
        if chunk.index in (3, FINE_TUNE_FROM_CHUNK):  # the rate changes at the start of the second
            cluster.kill_ps(1)
            cluster.restart_ps(1)

    run = train(cluster, tmp_path, kill)
    assert run.recoveries == ["restored", "restored"], run.recoveries
    rates = {ref: state.optimizer.kwargs["lr"] for ref, state in run.shards.items() if state.optimizer is not None}
    assert set(rates.values()) == {FINE_TUNE_LR}, f"the restored server runs the live rate: {rates}"
    assert_nothing_applied_twice(run.shards)
    assert_as_good_as_clean(run, clean)
    assert_every_checkpoint_loads_whole(tmp_path)  # saves after the second kill worked


COORDINATOR = """
import json, os, signal, sys
sys.path.insert(0, {tests!r})
import cloudpickle, torch
from test_operations import build, accuracy, CHUNK, STEPS, FINE_TUNE_FROM_CHUNK, FINE_TUNE_LR
from paramserve.coordinator import CheckpointManager, ClusterCoordinator, ClusterSpec
from paramserve.coordinator.demos.digits import train_step, worker_batches

spec = ClusterSpec(parameter_servers=tuple(sys.argv[1].split(",")), workers=tuple(sys.argv[2].split(",")))
strategy, model, optimizer = build(spec)
manager = CheckpointManager(strategy, sys.argv[3])
start = manager.restore_or_initialize() or 0
with ClusterCoordinator(strategy) as coordinator:
    batches = iter(coordinator.create_per_worker_dataset(worker_batches))
    for chunk in range(start // CHUNK, STEPS // CHUNK):
        if chunk >= FINE_TUNE_FROM_CHUNK:
            strategy.set_learning_rate(optimizer, FINE_TUNE_LR)
        for _ in range(CHUNK):
            coordinator.schedule(train_step, args=(batches, model, optimizer))
        coordinator.join()
        if os.environ.get("CRASH_BEFORE_FIRST_CHECKPOINT"):
            os.kill(os.getpid(), signal.SIGKILL)
        manager.save(step=(chunk + 1) * CHUNK)
print(json.dumps({{"started_at": start, "accuracy": accuracy(model)}}))
"""


@pytest.mark.timeout(300)
def test_a_coordinator_killed_before_its_first_checkpoint_runs_again(start_cluster, tmp_path, clean):
    cluster = start_cluster(2, 2, extra_worker_args=WORKER_ARGS, extra_ps_args=PS_ARGS)
    script = tmp_path / "coordinator.py"
    script.write_text(COORDINATOR.format(tests=str(Path(__file__).parent)))
    argv = [
        sys.executable,
        str(script),
        ",".join(cluster.spec.parameter_servers),
        ",".join(cluster.spec.workers),
        str(tmp_path / "checkpoints"),
    ]
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}

    crashed = subprocess.run(
        argv, env={**environment, "CRASH_BEFORE_FIRST_CHECKPOINT": "1"}, capture_output=True, text=True, timeout=240
    )
    assert crashed.returncode == -9, crashed.stderr[-3000:]
    assert checkpoint.latest_checkpoint(tmp_path / "checkpoints") is None, "it died before its first checkpoint"

    rerun = subprocess.run(argv, env=environment, capture_output=True, text=True, timeout=240)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    summary = json.loads(rerun.stdout.strip().splitlines()[-1])
    assert summary["started_at"] == 0
    print(f"accuracy: clean {clean.accuracy:.4f}, rerun {summary['accuracy']:.4f}")  # shown with pytest -rP
    assert "start again from their initial values" in rerun.stderr
    assert abs(summary["accuracy"] - clean.accuracy) <= 0.01, (summary, clean.accuracy)
    assert_every_checkpoint_loads_whole(tmp_path / "checkpoints")
