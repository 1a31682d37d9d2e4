"""Incremental checkpoints of a DynamicEmbedding, and its recovery, on real processes: a full
save and its deltas restore bit for bit onto the same servers and onto 3 from 2; a save that
fails leaves its changes to the next delta; a delta whose base is gone refuses to restore; a
SIGKILLed parameter server gets its dynamic rows back from the last full save and its deltas,
and training goes on."""

from __future__ import annotations

import sys
import time

import cloudpickle
import pytest
import torch

from paramserve.coordinator import CheckpointManager, ClusterCoordinator, DynamicEmbedding, ParameterServerStrategy
from paramserve.psserver.checkpoint import dynamic_checkpoint
from paramserve.psserver.checkpoint import shard_files as checkpoint
from paramserve.psserver.dynamic.dynamic_types import DynamicShardState
from paramserve.psserver.protocol.errors import CheckpointBaseMissingError, CheckpointError
from paramserve.psserver.protocol.types import RowGradient
from tests.integration.test_dynamic_embedding import ClickStream, build, train_step

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import test modules

WORKER_ARGS = ("--ps-retry-deadline", "10")


def shards(strategy: ParameterServerStrategy, table: str = "ids") -> dict[int, DynamicShardState]:
    return {server: per[0] for server, per in strategy.client.dynamic.export([table]).items()}


def exactly(a: DynamicShardState, b: DynamicShardState) -> bool:
    """Rows, slots, last-update steps, version and window all equal, bit for bit."""
    return (
        torch.equal(a.ids, b.ids)
        and torch.equal(a.values, b.values)
        and torch.equal(a.updated, b.updated)
        and a.slots.keys() == b.slots.keys()
        and all(torch.equal(a.slots[key], b.slots[key]) for key in a.slots)
        and a.version == b.version
        and a.applied_keys == b.applied_keys
    )


def table_rows(states) -> list[torch.Tensor]:
    """Ids, values and Adagrad sums of a table's shards, sorted by id (any number of shards)."""
    ids = torch.cat([s.ids for s in states])
    order = torch.argsort(ids)
    return [
        ids[order],
        torch.cat([s.values for s in states])[order],
        torch.cat([s.slots["sum"] for s in states])[order],
    ]


def dynamic_files(path) -> dict[int, bool]:
    """Shard -> whether its file in checkpoint ``path`` is a delta."""
    entry = checkpoint.read_manifest(path).extra[dynamic_checkpoint.EXTRA_KEY]["ids"]
    return {int(item["shard"]): bool(item["delta"]) for item in entry["files"]}


def train(coordinator, batches, model, optimizer, steps: int) -> list[float]:
    values = [coordinator.schedule(train_step, args=(batches, model, optimizer)) for _ in range(steps)]
    coordinator.join(timeout=120)
    return [float(v.fetch()) for v in values]


def test_a_full_save_and_its_deltas_restore_bit_identically_also_onto_three_servers(start_cluster, tmp_path):
    cluster = start_cluster(num_ps=2, num_workers=2)
    strategy, model, optimizer = build(cluster.spec)
    manager = CheckpointManager(strategy, tmp_path, full_every=3, max_to_keep=1)
    with ClusterCoordinator(strategy) as coordinator:
        batches = iter(coordinator.create_per_worker_dataset(ClickStream()))
        paths = []
        for step in (50, 100, 150):  # a full save, then two deltas
            train(coordinator, batches, model, optimizer, 50)
            paths.append(manager.save(step))
        live = shards(strategy)
        dense = strategy.client.pull(["clicks.out.weight", "clicks.out.bias"]).tensors
    stats = [s for per in strategy.client.dynamic.stats().values() for s in per]
    strategy.close()

    assert sum(s.evictions_ttl for s in stats) > 0, "the warm ids were evicted: the deltas delete them"
    assert [dynamic_files(p) for p in paths] == [{0: False, 1: False}, {0: True, 1: True}, {0: True, 1: True}]
    assert checkpoint.read_manifest(paths[2]).needs == (paths[0].name, paths[1].name)
    assert checkpoint.list_checkpoints(tmp_path) == paths, "max_to_keep=1 keeps what the newest needs"

    again, _, _ = build(cluster.spec)  # the same servers, the rows of the newest save
    assert CheckpointManager(again, tmp_path).restore(tmp_path) == 150
    restored = shards(again)
    assert all(exactly(live[server], restored[server]) for server in live)
    again.close()

    three = start_cluster(num_ps=3, num_workers=1)
    moved, _, _ = build(three.spec)
    CheckpointManager(moved, tmp_path).restore(paths[2])
    after = shards(moved)
    assert sorted(after) == [0, 1, 2]
    assert all(torch.equal(a, b) for a, b in zip(table_rows(live.values()), table_rows(after.values())))
    for name, value in moved.client.pull(list(dense)).tensors.items():
        assert torch.equal(value, dense[name])
    moved.close()

    for path in paths[:2]:  # the bases go: the newest refuses to restore, saying why
        (path / checkpoint.MANIFEST).unlink()
    lost, _, _ = build(three.spec)
    with pytest.raises(CheckpointBaseMissingError, match="changes since ckpt-00000001"):
        CheckpointManager(lost, tmp_path).restore(paths[2])
    with pytest.raises(CheckpointError):
        CheckpointManager(lost, tmp_path).restore(tmp_path)  # no whole checkpoint is left
    lost.close()


class FailingWrites:
    """Fault injection: the ``fail_at``-th dynamic file written raises, as a full disk would."""

    def __init__(self, write, fail_at: int):
        self.write, self.fail_at, self.calls = write, fail_at, 0

    def __call__(self, payload, file):
        self.calls += 1
        if self.calls == self.fail_at:
            raise OSError(28, "No space left on device")
        self.write(payload, file)


def test_a_failed_save_leaves_its_changes_to_the_next_delta(start_cluster, tmp_path, monkeypatch):
    cluster = start_cluster(num_ps=2, num_workers=1)
    strategy = ParameterServerStrategy(cluster.spec)
    with strategy.scope():
        DynamicEmbedding(4, name="users", ttl_steps=30, seed=5)
    strategy.optimizer(torch.optim.Adagrad, lr=0.1)
    strategy.materialize()
    client = strategy.client

    def step(ids, key):
        found, versions = client.pull_unique_rows({"users": torch.tensor(ids)}, dynamic={"users": (4, torch.float32)})
        grad = torch.full((found["users"].ids.numel(), 4), 0.5)
        client.push({"users": RowGradient(found["users"].ids, grad)}, key=key, base_versions=versions)

    manager = CheckpointManager(strategy, tmp_path, full_every=10)
    step(list(range(100)), "a")
    first = manager.save(1)
    for n in range(40):  # new rows 100..149 and updates of 0..9; 10..99 go past their TTL
        step(list(range(10)) + list(range(100, 150)), f"b{n}")
    monkeypatch.setattr(dynamic_checkpoint, "_save", FailingWrites(dynamic_checkpoint._save, fail_at=2))
    with pytest.raises(CheckpointError, match="No space left"):
        manager.save(2)  # one shard's file written, the other's failed: no checkpoint
    monkeypatch.undo()
    step(list(range(200, 220)), "c")
    last = manager.save(3)
    live = shards(strategy, "users")
    strategy.close()

    assert checkpoint.list_checkpoints(tmp_path) == [first, last]
    assert checkpoint.read_manifest(last).needs == (first.name,), "a delta of the last committed save"
    restored = ParameterServerStrategy(cluster.spec)
    with restored.scope():
        DynamicEmbedding(4, name="users", ttl_steps=30, seed=5)
    restored.optimizer(torch.optim.Adagrad, lr=0.1)
    CheckpointManager(restored, tmp_path).restore(last)
    after = shards(restored, "users")
    assert all(exactly(live[server], after[server]) for server in live)
    ids = set(torch.cat([s.ids for s in after.values()]).tolist())
    assert ids == set(range(10)) | set(range(100, 150)) | set(range(200, 220)), "evicted rows stay gone"
    restored.close()


@pytest.mark.timeout(300)
def test_a_killed_server_gets_its_dynamic_rows_back_from_the_full_save_and_its_deltas(start_cluster, tmp_path):
    cluster = start_cluster(num_ps=2, num_workers=2, extra_worker_args=WORKER_ARGS)
    strategy, model, optimizer = build(cluster.spec)
    manager = CheckpointManager(strategy, tmp_path, full_every=4)
    with ClusterCoordinator(strategy) as coordinator:
        batches = iter(coordinator.create_per_worker_dataset(ClickStream()))
        for step in (30, 60, 90):  # a full save, then two deltas
            train(coordinator, batches, model, optimizer, 30)
            last = manager.save(step)
        before = shards(strategy)
        cluster.kill_ps(1)
        cluster.restart_ps(1)
        deadline = time.monotonic() + 120
        while not coordinator.recovery.recoveries and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [r.result for r in coordinator.recovery.recoveries] == ["restored"]
        recovered = shards(strategy)
        saved = dynamic_checkpoint.read_tables(last, checkpoint.read_manifest(last).extra)["ids"]
        losses = train(coordinator, batches, model, optimizer, 30)
        after = shards(strategy)
        following = manager.save(120)
        live = shards(strategy)
    strategy.close()

    assert dynamic_files(last) == {0: True, 1: True}
    assert exactly(recovered[1], before[1]) and exactly(recovered[1], saved[1]), "bit for bit the checkpoint's"
    assert exactly(recovered[0], before[0]), "the surviving server was left alone"
    assert all(torch.isfinite(torch.tensor(losses)))
    assert after[1].version > recovered[1].version and not torch.equal(after[1].values, recovered[1].values)
    assert dynamic_files(following) == {0: True, 1: False}, "the restored shard is new: saved whole once"

    again, _, _ = build(cluster.spec)
    CheckpointManager(again, tmp_path).restore(following)
    restored = shards(again)
    assert all(exactly(live[server], restored[server]) for server in live)
    again.close()
