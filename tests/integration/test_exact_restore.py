"""Restores are exact, onto live or restarted servers: every value, optimizer slot, version and
idempotency window equals the checkpoint's, and training goes on from there."""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch

from paramserve.coordinator.checkpointing.checkpoint_manager import CheckpointManager
from paramserve.coordinator.cluster_coordinator import ClusterCoordinator
from paramserve.coordinator.demos.digits import MLP, train_step, worker_batches
from paramserve.coordinator.strategies.parameter_server import ParameterServerStrategy
from paramserve.psserver.checkpoint import shard_files as checkpoint
from paramserve.psserver.protocol.errors import CheckpointError
from paramserve.psserver.protocol.partition import FixedShardsPartitioner

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import test modules


def build(cluster, hidden=32):
    strategy = ParameterServerStrategy(
        cluster.spec, variable_partitioner=FixedShardsPartitioner(2), reuse_variables=True
    )
    torch.manual_seed(0)
    with strategy.scope():
        model = MLP(hidden)
    return strategy, model, strategy.optimizer(torch.optim.Adam, lr=5e-3)


def train(coordinator, batches, model, optimizer, steps):
    for _ in range(steps):
        coordinator.schedule(train_step, args=(batches, model, optimizer))
    coordinator.join()


def live_shards(strategy):
    return {state.ref: state for states in strategy.client.export().values() for state in states}


def assert_equal_to_checkpoint(strategy, path):
    """Every shard on the servers is the checkpoint's, bit for bit (rows cut from the saved files)."""
    live = live_shards(strategy)
    assert live, "the servers hold the model"
    for ref, state in live.items():
        rows = state.value.shape[0] if state.value.dim() else 1
        saved = checkpoint.load_rows(path, ref.variable, state.row_start, rows, ref)
        assert torch.equal(state.value, saved.value), f"{ref}: value"
        assert state.version == saved.version, f"{ref}: version {state.version} != {saved.version}"
        assert list(state.applied_keys) == list(saved.applied_keys), f"{ref}: idempotency window"
        assert state.slots.keys() == saved.slots.keys() and state.slots, f"{ref}: Adam's slots"
        for key, slot in saved.slots.items():
            assert torch.equal(state.slots[key], slot), f"{ref}: slot {key}"


def test_a_restore_onto_live_servers_rolls_every_shard_back_exactly(start_cluster, tmp_path):
    cluster = start_cluster(num_ps=2, num_workers=2)
    strategy, model, optimizer = build(cluster)
    manager = CheckpointManager(strategy, tmp_path)
    with ClusterCoordinator(strategy) as coordinator:
        batches = iter(coordinator.create_per_worker_dataset(worker_batches))
        train(coordinator, batches, model, optimizer, 12)
        path = manager.save(step=12)
        train(coordinator, batches, model, optimizer, 9)
        assert all(s.version == 21 for s in live_shards(strategy).values()), "9 more steps applied everywhere"

        assert manager.restore(path) == 12

        assert_equal_to_checkpoint(strategy, path)
        train(coordinator, batches, model, optimizer, 5)  # workers drop their held values and pull
        assert all(s.version == 17 for s in live_shards(strategy).values())
    strategy.close()


def test_a_restore_after_a_server_was_lost_makes_both_servers_the_checkpoint(start_cluster, tmp_path):
    cluster = start_cluster(num_ps=2, num_workers=1)
    strategy, model, optimizer = build(cluster)
    manager = CheckpointManager(strategy, tmp_path)
    with ClusterCoordinator(strategy) as coordinator:
        batches = iter(coordinator.create_per_worker_dataset(worker_batches))
        train(coordinator, batches, model, optimizer, 8)
        path = manager.save(step=8)
        train(coordinator, batches, model, optimizer, 6)
    cluster.kill_ps(1)
    cluster.restart_ps(1)  # back empty, at the same address

    manager.restore(path)

    assert_equal_to_checkpoint(strategy, path)
    strategy.close()


def test_a_checkpoint_of_another_shape_is_refused_and_changes_nothing(start_cluster, tmp_path):
    cluster, elsewhere = start_cluster(num_ps=2, num_workers=1), start_cluster(num_ps=1, num_workers=1)
    other, _, _ = build(elsewhere, hidden=16)  # the same variable names, another hidden size
    CheckpointManager(other, tmp_path).save(step=0)
    other.close()
    strategy, model, optimizer = build(cluster)
    with ClusterCoordinator(strategy) as coordinator:
        batches = iter(coordinator.create_per_worker_dataset(worker_batches))
        train(coordinator, batches, model, optimizer, 3)
        before = live_shards(strategy)

        with pytest.raises(CheckpointError, match=r"\(16, 64\) .* in the checkpoint but \(32, 64\)"):
            CheckpointManager(strategy, tmp_path).restore(tmp_path)

        after = live_shards(strategy)
        for ref, state in before.items():
            assert torch.equal(after[ref].value, state.value) and after[ref].version == state.version == 3
    strategy.close()
