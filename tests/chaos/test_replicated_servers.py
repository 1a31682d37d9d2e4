"""Replicated parameter servers under chaos: 2 shard groups x 2 replicas on 4 server processes,
2 workers; for over a minute a random group's primary is stopped every ~10 s (SIGKILL, or
SIGTERM: a graceful stop) and started again at its address. A backup takes over each time, the
restarted server rejoins as a backup by a copy from the primary, and the learning rate changes
between two failures. Every closure completes, every shard's version is exactly the pushes
acknowledged (none lost, none applied twice), the replicas end bit for bit equal, the last
learning rate is on every server, and the model ends within 1% of the accuracy of a clean run of
the same schedule (on servers without replicas, as training without failures would run; it
trains at the same time, chunk by chunk behind the chaos run)."""

from __future__ import annotations

import random
import sys
import threading
import time

import cloudpickle
import pytest
import torch

from paramserve.coordinator.cluster_coordinator import ClusterCoordinator
from paramserve.coordinator.demos.digits import MLP, digits_split, train_step, worker_batches
from paramserve.coordinator.strategies.parameter_server import ParameterServerStrategy
from paramserve.psserver.client.calls import CallOptions, Stub
from paramserve.psserver.protocol.partition import FixedShardsPartitioner
from paramserve.psserver.runtime.channels import channel_options, open_channel

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import test modules

CHUNK = 100
SAVE_CHUNK = 60
CHAOS_SECONDS, KILL_EVERY, MIN_KILLS = 60.0, 10.0, 5
LR, MID_LR, FINE_TUNE_LR = 0.05, 0.03, 0.005
FINE_TUNE_CHUNKS = 2


def build(cluster, replicas: int):  # type: ignore[no-untyped-def]
    strategy = ParameterServerStrategy(
        cluster.spec, variable_partitioner=FixedShardsPartitioner(2), ps_replicas=replicas
    )
    torch.manual_seed(0)
    with strategy.scope():
        model = MLP(32)
    return strategy, model, strategy.optimizer(torch.optim.SGD, lr=LR, momentum=0.9)


def accuracy(model) -> float:  # type: ignore[no-untyped-def]
    """Over all 1,797 digits (see tests/chaos/test_ps_recovery.py: why not the 360 held out)."""
    x_train, y_train, x_test, y_test = digits_split(0)
    with torch.no_grad():
        predicted = model(torch.cat([x_train, x_test])).argmax(dim=1)
    return float((predicted == torch.cat([y_train, y_test])).float().mean())


def whole(strategy) -> bool:  # type: ignore[no-untyped-def]
    """Every group has its backup in sync (a cluster without replicas: always)."""
    groups = strategy.servers.groups
    return groups is None or all(len(state.in_sync) == 1 for state in groups.states())


def wait_until(condition, what: str, seconds: float) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {seconds:g}s"
        time.sleep(0.05)


def stop_a_primary(cluster, strategy, rng: random.Random, graceful: bool) -> str:  # type: ignore[no-untyped-def]
    """Stops a random group's primary and starts it again at its address (empty)."""
    primary = rng.choice(strategy.client.addresses)
    index = cluster.parameter_servers.index(primary)
    if graceful:
        cluster.terminate_ps(index)
    else:
        cluster.kill_ps(index)
    cluster.restart_ps(index)
    return primary


class Schedule:
    """The chaos run's chunks as it trains them (each one's learning rate), for the clean run to
    follow chunk by chunk at the same time, on servers of its own."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._rates: list[float] = []
        self._finished = False

    def chunk(self, lr: float) -> None:
        with self._cond:
            self._rates.append(lr)
            self._cond.notify_all()

    def finish(self) -> None:
        with self._cond:
            self._finished = True
            self._cond.notify_all()

    def follow(self, index: int, seconds: float) -> float | None:
        """Chunk ``index``'s learning rate once the chaos run started it; None after its last."""
        with self._cond:
            if not self._cond.wait_for(lambda: len(self._rates) > index or self._finished, seconds):
                raise TimeoutError(f"the chaos run did not start chunk {index} within {seconds:g}s")
            return self._rates[index] if len(self._rates) > index else None


def train_with_chaos(cluster, schedule: Schedule, seed: int = 0):  # type: ignore[no-untyped-def]
    """Trains in chunks of CHUNK closures, stopping primaries every KILL_EVERY seconds for
    CHAOS_SECONDS (at least MIN_KILLS times). The learning rate drops to MID_LR between the
    second and third failure and to FINE_TUNE_LR for the last FINE_TUNE_CHUNKS; ``schedule``
    hears of every chunk."""
    strategy, model, optimizer = build(cluster, 2)
    rng = random.Random(seed)
    stopped: list[str] = []
    lr = LR
    with ClusterCoordinator(strategy) as coordinator:
        batches = iter(coordinator.create_per_worker_dataset(worker_batches))
        start, done = time.monotonic(), 0
        while not (time.monotonic() - start >= CHAOS_SECONDS and len(stopped) >= MIN_KILLS):
            if len(stopped) == 2 and lr == LR:
                lr = MID_LR
                strategy.set_learning_rate(optimizer, lr)  # a setting changed between two failures
            schedule.chunk(lr)
            values = [coordinator.schedule(train_step, args=(batches, model, optimizer)) for _ in range(CHUNK)]
            if time.monotonic() >= start + KILL_EVERY * (len(stopped) + 0.3):
                wait_until(lambda: whole(strategy), "the groups whole again before the next failure", 60)
                values[CHUNK // 5].fetch(timeout=60)  # closures run and queue
                stopped.append(stop_a_primary(cluster, strategy, rng, graceful=len(stopped) % 3 == 1))
            coordinator.join(timeout=120)  # raises any error a closure met: there must be none
            assert all(torch.isfinite(v.fetch()) for v in values)
            done += 1
        strategy.set_learning_rate(optimizer, FINE_TUNE_LR)
        for _ in range(FINE_TUNE_CHUNKS):
            schedule.chunk(FINE_TUNE_LR)
            for _ in range(CHUNK):
                coordinator.schedule(train_step, args=(batches, model, optimizer))
            coordinator.join(timeout=120)
            done += 1
        schedule.finish()
        wait_until(lambda: whole(strategy), "every group whole at the end", 60)
        recoveries = list(coordinator.recovery.recoveries) if coordinator.recovery else []
        states = strategy.servers.groups.states()
        events = [(e.kind, e.subject) for e in coordinator.telemetry.run.view().events]
    exports = {address: export_of(address) for address in cluster.parameter_servers}
    result = accuracy(model)
    strategy.close()
    return result, done * CHUNK, stopped, recoveries, states, exports, events


def train_following(cluster, schedule: Schedule) -> tuple[float, int]:  # type: ignore[no-untyped-def]
    """The clean run: the chaos run's chunks and learning rates, on servers without replicas
    (as training without failures runs). Returns its accuracy and steps."""
    strategy, model, optimizer = build(cluster, 1)
    lr, done = LR, 0
    with ClusterCoordinator(strategy) as coordinator:
        batches = iter(coordinator.create_per_worker_dataset(worker_batches))
        while (rate := schedule.follow(done, 300)) is not None:
            if rate != lr:
                lr = rate
                strategy.set_learning_rate(optimizer, lr)
            for _ in range(CHUNK):
                coordinator.schedule(train_step, args=(batches, model, optimizer))
            coordinator.join(timeout=120)
            done += 1
    result = accuracy(model)
    strategy.close()
    return result, done * CHUNK


def export_of(address: str) -> dict:  # type: ignore[type-arg]
    stub = Stub(open_channel(address, None, channel_options(64 << 20)))
    return {state.ref: state for state in stub.export(1 << 20, CallOptions(None, 30, 30))}


@pytest.mark.timeout(600)
def test_primaries_stopped_every_ten_seconds_lose_nothing_and_train_as_well_as_a_clean_run(start_cluster) -> None:
    """The clean run trains beside the chaos run, chunk by chunk behind it (a thread of its own)."""
    schedule, clean = Schedule(), {}
    clean_cluster = start_cluster(2, 2)

    def follow() -> None:
        try:
            clean["result"] = train_following(clean_cluster, schedule)
        except BaseException as exc:  # raised in the test below
            clean["error"] = exc

    follower = threading.Thread(target=follow, name="clean-run")
    follower.start()
    try:
        chaos = train_with_chaos(start_cluster(4, 2), schedule)
    finally:
        schedule.finish()
        follower.join(300)
    accuracy_chaos, steps, stopped, recoveries, states, exports, events = chaos

    assert len(stopped) >= MIN_KILLS
    failovers = [r for r in recoveries if r.result == "failed-over"]
    assert [r.server for r in failovers] == stopped, (stopped, recoveries)
    assert not [r for r in recoveries if r.result in ("restored", "failed")], "no checkpoint was needed"
    assert ("ps-rejoined", stopped[0]) in events
    for state in states:
        primary = exports[state.primary]
        assert set(state.members) == {state.primary, *state.in_sync}
        assert primary, f"group of {state.members} holds no shard"
        for ref, shard in primary.items():
            assert shard.version == steps, f"{ref}: {shard.version} pushes applied, {steps} acknowledged"
            assert len(set(shard.applied_keys)) == len(shard.applied_keys) == steps, f"{ref}: a push applied twice"
            assert shard.optimizer is not None and shard.optimizer.kwargs["lr"] == FINE_TUNE_LR
        for backup in state.in_sync:  # bit for bit: values, optimizer slots, versions, windows
            copy = exports[backup]
            assert copy.keys() == primary.keys()
            for ref, shard in primary.items():
                assert torch.equal(copy[ref].value, shard.value), f"{ref} differs on {backup}"
                assert copy[ref].slots.keys() == shard.slots.keys()
                assert all(torch.equal(copy[ref].slots[k], shard.slots[k]) for k in shard.slots), ref
                assert (copy[ref].version, list(copy[ref].applied_keys)) == (shard.version, list(shard.applied_keys))
                assert copy[ref].optimizer == shard.optimizer

    assert "error" not in clean, clean.get("error")
    accuracy_clean, clean_steps = clean["result"]
    assert clean_steps == steps
    assert accuracy_clean > 0.9
    print(f"\nchaos: {len(stopped)} stopped, {steps} steps, accuracy {accuracy_chaos:.4f}; clean {accuracy_clean:.4f}")
    assert abs(accuracy_chaos - accuracy_clean) <= 0.01, (accuracy_chaos, accuracy_clean)


class KillDuringExport:
    """When armed, the next export of the servers (a checkpoint's save) first SIGKILLs group 1's
    primary and has it started again meanwhile: a failure in the middle of a save, every time.
    Patched on the client class: a failover gives the strategy a new client."""

    def __init__(self, cluster, strategy):  # type: ignore[no-untyped-def]
        self.cluster, self.strategy = cluster, strategy
        self.armed = False
        self.killed: list[str] = []
        self.restarters: list[threading.Thread] = []

    def __call__(self, export):  # type: ignore[no-untyped-def]
        def killing_export(client, *args, **kwargs):  # type: ignore[no-untyped-def]
            if self.armed:
                self.armed = False
                primary = self.strategy.client.addresses[1]
                index = self.cluster.parameter_servers.index(primary)
                self.cluster.kill_ps(index)
                restarter = threading.Thread(target=self.cluster.restart_ps, args=(index,), daemon=True)
                restarter.start()
                self.restarters.append(restarter)
                self.killed.append(primary)
            return export(client, *args, **kwargs)

        return killing_export


@pytest.mark.timeout(300)
def test_a_primary_killed_during_a_save_and_a_restarted_coordinator_lose_nothing(
    start_cluster, tmp_path, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    from paramserve.coordinator.checkpointing.checkpoint_manager import CheckpointManager
    from paramserve.psserver.checkpoint import shard_files as checkpoint
    from paramserve.psserver.client.ps_client import ParameterServerClient

    cluster = start_cluster(4, 2)
    strategy, model, optimizer = build(cluster, 2)
    saboteur = KillDuringExport(cluster, strategy)
    monkeypatch.setattr(ParameterServerClient, "export", saboteur(ParameterServerClient.export))
    manager = CheckpointManager(strategy, tmp_path)
    with ClusterCoordinator(strategy) as coordinator:
        batches = iter(coordinator.create_per_worker_dataset(worker_batches))
        for chunk in range(3):
            for _ in range(SAVE_CHUNK):
                coordinator.schedule(train_step, args=(batches, model, optimizer))
            coordinator.join(timeout=120)
            saboteur.armed = chunk == 1
            manager.save(step=(chunk + 1) * SAVE_CHUNK)
        recoveries = [r.result for r in coordinator.recovery.recoveries] if coordinator.recovery else []
    strategy.close()
    for restarter in saboteur.restarters:
        restarter.join(60)
    assert len(saboteur.killed) == 1 and recoveries.count("failed-over") == 1, recoveries
    saves = sorted(tmp_path.glob("ckpt-*"))
    assert len(saves) == 3 and all(checkpoint.is_whole(path) for path in saves), saves
    saved = {
        (name, s.shard): s.version for name, entry in checkpoint.variables(saves[-1]).items() for s in entry.shards
    }
    assert set(saved.values()) == {3 * SAVE_CHUNK}, "the save the failure met holds every acknowledged push"

    # A new program (a restarted coordinator): it finds the groups as the last one left them,
    # restores the latest checkpoint onto the replicated servers and trains on.
    strategy, model, optimizer = build(cluster, 2)
    assert CheckpointManager(strategy, tmp_path).restore_or_initialize() == 3 * SAVE_CHUNK
    with ClusterCoordinator(strategy) as coordinator:
        batches = iter(coordinator.create_per_worker_dataset(worker_batches))
        for _ in range(SAVE_CHUNK):
            coordinator.schedule(train_step, args=(batches, model, optimizer))
        coordinator.join(timeout=120)
        wait_until(lambda: whole(strategy), "every group whole", 60)
        states = strategy.servers.groups.states()
    strategy.close()
    for state in states:
        primary = export_of(state.primary)
        [backup] = [export_of(member) for member in state.in_sync]
        assert primary.keys() == backup.keys() and primary
        for ref, shard in primary.items():
            assert shard.version == 4 * SAVE_CHUNK == len(set(shard.applied_keys)), ref
            assert torch.equal(shard.value, backup[ref].value) and shard.version == backup[ref].version, ref
            assert all(torch.equal(shard.slots[k], backup[ref].slots[k]) for k in shard.slots), ref
