"""Parameter servers that fail while the workers cache rows and hold pushes for their next lookup
(``max_row_staleness``): a replicated group's primary stopped (SIGKILL or SIGTERM) and failed over
to its backup, and an unreplicated server killed and restored from a checkpoint. Every closure
completes and no push is applied twice; with replicas none is lost either. (Workers killed while
they hold a push: test_training_under_failure.py; no row from before a restore served after it:
tests/integration/test_row_cache_training.py.)"""

from __future__ import annotations

import time

import pytest
import torch

from paramserve.coordinator import CheckpointManager, ClusterCoordinator, ParameterServerStrategy
from paramserve.coordinator.demos.recommendation import DLRM, WorkerClicks, train_clicks
from paramserve.coordinator.remote_value import RemoteValueState
from paramserve.psserver.protocol.partition import FixedShardsPartitioner
from paramserve.worker.layers import ShardedEmbeddingCollection

TABLE_ROWS = [1000, 1000, 500, 2000, 1000, 300]
STEPS = 240


def build(cluster, **options):
    strategy = ParameterServerStrategy(
        cluster.spec, variable_partitioner=FixedShardsPartitioner(2), max_row_staleness=4, **options
    )
    torch.manual_seed(0)
    with strategy.scope():
        model = DLRM(TABLE_ROWS, embeddings=ShardedEmbeddingCollection)
    return strategy, model, strategy.optimizer(torch.optim.Adagrad, lr=0.05)


def wait_until(condition, what: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {seconds:g}s"
        time.sleep(0.05)


@pytest.mark.parametrize("graceful", [False, True], ids=["SIGKILL", "SIGTERM"])
def test_a_primary_stopped_while_workers_cache_rows_and_hold_pushes_fails_over_losing_and_repeating_nothing(
    start_cluster, graceful
):
    cluster = start_cluster(4, 2)
    strategy, model, optimizer = build(cluster, ps_replicas=2)
    with ClusterCoordinator(strategy) as coordinator:
        batches = iter(coordinator.create_per_worker_dataset(WorkerClicks(TABLE_ROWS, count=400)))
        values = [coordinator.schedule(train_clicks, args=(batches, model, optimizer)) for _ in range(STEPS)]
        values[STEPS // 4].fetch(timeout=120)  # training is under way on both workers
        primary = strategy.client.addresses[0]
        index = cluster.parameter_servers.index(primary)
        (cluster.terminate_ps if graceful else cluster.kill_ps)(index)
        cluster.restart_ps(index)
        coordinator.join(timeout=300)
        groups = strategy.servers.groups
        wait_until(lambda: all(len(s.in_sync) == 1 for s in groups.states()), "the group whole again", 120)
        failovers = [r for r in coordinator.recovery.recoveries if r.result == "failed-over"]
        states = groups.states()

    assert all(v.state is RemoteValueState.READY for v in values)
    assert [r.server for r in failovers] == [primary]
    assert all(set(state.members) == {state.primary, *state.in_sync} for state in states)
    shards = [shard for found in strategy.client.export().values() for shard in found]  # the primaries'
    assert len(shards) == sum(len(layout.shards) for layout in strategy.client.layouts.values())
    for shard in shards:
        assert shard.version == STEPS, f"{shard.ref}: {shard.version} pushes applied, {STEPS} acknowledged"
        assert len(set(shard.applied_keys)) == len(shard.applied_keys) == STEPS, f"{shard.ref}: a push applied twice"
    strategy.close()


def test_a_server_restored_from_a_checkpoint_while_workers_cache_rows_and_hold_pushes_applies_none_twice(
    start_cluster, tmp_path
):
    cluster = start_cluster(2, 2, extra_worker_args=["--ps-retry-deadline", "10"])
    strategy, model, optimizer = build(cluster)
    manager = CheckpointManager(strategy, tmp_path)
    chunk = STEPS // 4
    with ClusterCoordinator(strategy) as coordinator:
        batches = iter(coordinator.create_per_worker_dataset(WorkerClicks(TABLE_ROWS, count=400)))
        for number in range(4):
            values = [coordinator.schedule(train_clicks, args=(batches, model, optimizer)) for _ in range(chunk)]
            if number == 2:
                values[chunk // 4].fetch(timeout=120)  # mid-chunk: closures run and queue
                cluster.kill_ps(0)
                cluster.restart_ps(0)
            coordinator.join(timeout=300)
            assert all(v.state is RemoteValueState.READY for v in values)
            manager.save(step=(number + 1) * chunk)
        restored = [r for r in coordinator.recovery.recoveries if r.result == "restored"]
        shards = strategy.client.export()

    assert [r.server for r in restored] == [cluster.parameter_servers[0]]
    for shard in [shard for found in shards.values() for shard in found]:
        assert len(set(shard.applied_keys)) == len(shard.applied_keys), f"{shard.ref}: a key recorded twice"
        assert shard.version == len(shard.applied_keys), f"{shard.ref}: {shard.version} updates, some twice"
    assert {shard.version for shard in shards[1]} == {STEPS}, "the server that lived applied every push once"
    assert all(shard.version < STEPS for shard in shards[0]), "the restored one lost what followed its checkpoint"
    strategy.close()
