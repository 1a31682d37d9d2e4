"""Training survives a worker killed with SIGKILL, and applies every step exactly once, with
each push awaited, with pushes left in flight while the next step computes (overlap_pushes),
and with pushes held for the next step's lookup (max_row_staleness: a worker killed, by SIGKILL
or SIGTERM, while it holds one). (Parameter servers that die: test_ps_recovery.py.)"""

from __future__ import annotations

import os
import signal

import pytest
import torch

from paramserve.coordinator.cluster_coordinator import ClusterCoordinator
from paramserve.coordinator.demos.digits import MLP, train_step, worker_batches
from paramserve.coordinator.demos.recommendation import DLRM, WorkerClicks, train_clicks
from paramserve.coordinator.remote_value import RemoteValueState
from paramserve.coordinator.strategies.parameter_server import ParameterServerStrategy
from paramserve.psserver.protocol.partition import FixedShardsPartitioner
from paramserve.worker.layers import ShardedEmbeddingCollection

STEPS = 240


def build(cluster, overlap_pushes: bool = False):
    strategy = ParameterServerStrategy(
        cluster.spec, variable_partitioner=FixedShardsPartitioner(2), overlap_pushes=overlap_pushes
    )
    with strategy.scope():
        model = MLP(32)
    return strategy, model, strategy.optimizer(torch.optim.SGD, lr=0.05, momentum=0.9)


@pytest.mark.parametrize("overlap_pushes", [False, True], ids=["awaited", "overlapped"])
def test_sigkill_of_a_worker_mid_training_loses_no_step_and_applies_none_twice(start_cluster, overlap_pushes):
    cluster = start_cluster(num_ps=2, num_workers=2)
    strategy, model, optimizer = build(cluster, overlap_pushes)
    with ClusterCoordinator(strategy) as coordinator:
        batches = iter(coordinator.create_per_worker_dataset(worker_batches))
        values = [coordinator.schedule(train_step, args=(batches, model, optimizer)) for _ in range(STEPS)]
        values[STEPS // 4].fetch(timeout=120)  # training is under way on both workers
        cluster.kill_worker(0)
        coordinator.join(timeout=300)

    assert all(v.state is RemoteValueState.READY for v in values)
    assert all(torch.isfinite(v.fetch()) for v in values)
    versions = {info.ref: info.version for infos in strategy.client.list_shards().values() for info in infos}
    assert len(versions) == 8
    assert set(versions.values()) == {STEPS}, f"applied pushes per shard differ from the {STEPS} steps: {versions}"
    strategy.close()


TABLE_ROWS = [1000, 1000, 500, 2000, 1000, 300]


@pytest.mark.parametrize("signal_name", ["SIGKILL", "SIGTERM"])
def test_a_worker_holding_a_deferred_push_killed_mid_training_loses_no_step_and_applies_none_twice(
    start_cluster, signal_name
):
    """With max_row_staleness a worker always holds the last step's push until its next lookup
    (or the end of its batch): whatever the signal interrupts, each step's push applies once."""
    cluster = start_cluster(num_ps=2, num_workers=2)
    strategy = ParameterServerStrategy(
        cluster.spec, variable_partitioner=FixedShardsPartitioner(2), max_row_staleness=4
    )
    torch.manual_seed(0)
    with strategy.scope():
        model = DLRM(TABLE_ROWS, embeddings=ShardedEmbeddingCollection)
    optimizer = strategy.optimizer(torch.optim.Adagrad, lr=0.05)
    with ClusterCoordinator(strategy) as coordinator:
        batches = iter(coordinator.create_per_worker_dataset(WorkerClicks(TABLE_ROWS, count=400)))
        values = [coordinator.schedule(train_clicks, args=(batches, model, optimizer)) for _ in range(STEPS)]
        values[STEPS // 4].fetch(timeout=120)  # training is under way on both workers
        worker = next(p for p in cluster.processes if p.role == "worker")
        os.kill(worker.pid, getattr(signal, signal_name))
        coordinator.join(timeout=300)

    assert all(v.state is RemoteValueState.READY for v in values)
    versions = {info.ref: info.version for infos in strategy.client.list_shards().values() for info in infos}
    assert set(versions.values()) == {STEPS}, f"applied pushes per shard differ from the {STEPS} steps: {versions}"
    strategy.close()
