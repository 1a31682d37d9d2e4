"""Parameter-server dataset functions see TensorFlow's input context (1, 0, 1), whichever way
they reach the workers, and still learn which worker they run on (issue 11, item 2)."""

from __future__ import annotations

import pytest

from paramserve.coordinator.cluster import ClusterSpec
from paramserve.coordinator.cluster_coordinator import ClusterCoordinator, PerWorkerDataset
from paramserve.coordinator.strategies import InputContext, ParameterServerStrategy
from paramserve.worker.resources import WorkerContext


@pytest.mark.parametrize("num_workers", [1, 2, 3, 4])
def test_every_worker_reads_one_pipeline_of_one_replica(num_workers):
    for index in range(num_workers):
        context = WorkerContext.for_worker(index, num_workers, "incarnation")
        assert isinstance(context, InputContext)
        assert (context.num_input_pipelines, context.input_pipeline_id, context.num_replicas_in_sync) == (1, 0, 1)
        assert context.get_per_replica_batch_size(64) == 64, "the seed's per-replica batch: the whole batch"
        assert (context.worker_index, context.num_workers) == (index, num_workers)


def test_distribute_datasets_from_function_and_create_per_worker_dataset_are_one_path():
    strategy = ParameterServerStrategy(ClusterSpec(("127.0.0.1:9",), ("127.0.0.1:10",)))  # nothing is dialled
    coordinator = ClusterCoordinator(strategy)
    try:
        dataset = strategy.distribute_datasets_from_function(lambda ctx: iter([ctx]))
        assert isinstance(dataset, PerWorkerDataset)
    finally:
        coordinator.shutdown()
        strategy.close()
