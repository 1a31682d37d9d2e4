"""Workers on a GPU (``paramserve worker --device cuda:0``) in real processes: the demo's
unchanged training code converges, every step is applied once, and results come back as host
tensors; hybrid training's dense all-reduce runs over NCCL when each worker has a GPU of its own
and over gloo when two share one. Skipped without CUDA; on a machine with one GPU both workers
share it."""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch

from paramserve.coordinator import ShardedEmbeddingCollection
from paramserve.coordinator.cluster_coordinator import ClusterCoordinator
from paramserve.coordinator.demos.digits import MLP, digits_split, train_step, worker_batches
from paramserve.coordinator.demos.recommendation import DLRM, ClickData, WorkerClicks, train_clicks
from paramserve.coordinator.strategies.parameter_server import ParameterServerStrategy
from paramserve.psserver.protocol.partition import FixedShardsPartitioner

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import test modules

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
STEPS = 200


def where_parameters_live(model) -> str:  # type: ignore[no-untyped-def]
    return str(next(model.parameters()).device)


def test_gpu_workers_train_the_demo_model_and_apply_every_step_once(start_cluster):
    cluster = start_cluster(num_ps=2, num_workers=2, extra_worker_args=["--device", "cuda:0"])
    strategy = ParameterServerStrategy(cluster.spec, variable_partitioner=FixedShardsPartitioner(2))
    torch.manual_seed(0)
    with strategy.scope():
        model = MLP(32)
    optimizer = strategy.optimizer(torch.optim.Adam, lr=5e-3)
    try:
        with ClusterCoordinator(strategy) as coordinator:
            batches = iter(coordinator.create_per_worker_dataset(worker_batches))  # CPU batches, moved by the worker
            results = [coordinator.schedule(train_step, args=(batches, model, optimizer)) for _ in range(STEPS)]
            where = coordinator.schedule(where_parameters_live, args=(model,))
            coordinator.join()
            losses = [r.fetch() for r in results]
            assert where.fetch() == "cuda:0"

        assert {loss.device for loss in losses} == {torch.device("cpu")}
        assert sum(float(v) for v in losses[-20:]) < 0.5 * sum(float(v) for v in losses[:20])
        versions = {info.version for infos in strategy.client.list_shards().values() for info in infos}
        assert versions == {STEPS}, "each step must be applied exactly once to every shard"
        _, _, x_test, y_test = digits_split()
        with torch.no_grad():
            assert float((model(x_test).argmax(dim=1) == y_test).float().mean()) > 0.85
    finally:
        strategy.close()


TABLE_ROWS = [1000, 500, 2000]


def dense_replica(model):  # type: ignore[no-untyped-def]
    return {name: p.detach().to("cpu").clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize(("workers", "backend"), [(1, "nccl"), (2, "gloo")])
def test_hybrid_training_all_reduces_over_nccl_when_each_worker_has_a_gpu_of_its_own(
    start_cluster, workers: int, backend: str
):
    # One GPU here: one worker has it to itself (a group of one on NCCL); two share it (gloo).
    cluster = start_cluster(num_ps=2, num_workers=workers, extra_worker_args=["--device", "cuda:0"])
    strategy = ParameterServerStrategy(cluster.spec, variable_partitioner=FixedShardsPartitioner(2), sync_dense=True)
    torch.manual_seed(0)
    with strategy.scope():
        model = DLRM(TABLE_ROWS, embeddings=ShardedEmbeddingCollection)
        optimizer = torch.optim.Adagrad(model.parameters(), lr=0.05)
    initial = dense_replica(model)
    try:
        with ClusterCoordinator(strategy) as coordinator:
            batches = iter(coordinator.create_per_worker_dataset(WorkerClicks(TABLE_ROWS, count=100)))
            losses = [coordinator.schedule(train_clicks, args=(batches, model, optimizer)) for _ in range(120)]
            coordinator.join()
            where = coordinator.schedule(where_parameters_live, args=(model,))
            replica = coordinator.schedule(dense_replica, args=(model,))
            coordinator.join()
            assert where.fetch() == "cuda:0"
            held_out = ClickData(TABLE_ROWS).batches(stream=999, count=1)[0]
            with torch.no_grad():
                model(held_out.dense, held_out.features())  # the coordinator reads the layers from a worker
            trained = dense_replica(model)
        first, last = (sum(float(v.fetch()) for v in part) / 20 for part in (losses[:20], losses[-20:]))
        assert last < first
        assert not torch.equal(trained["top.0.weight"], initial["top.0.weight"])
        for name, value in replica.fetch().items():
            assert torch.equal(value, trained[name]), name
        for worker in (p for p in cluster.processes if p.role == "worker"):
            assert f"steps all-reduced with {backend}" in worker.log_path.read_text(errors="replace")
    finally:
        strategy.close()
