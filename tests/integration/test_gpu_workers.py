"""Workers on a GPU (``paramserve worker --device cuda:0``) in real processes: the demo's
unchanged training code converges, every step is applied once, and results come back as host
tensors. Skipped without CUDA; on a machine with one GPU both workers share it."""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch

from paramserve.coordinator.cluster_coordinator import ClusterCoordinator
from paramserve.coordinator.commands.demo import MLP, digits_split, train_step, worker_batches
from paramserve.coordinator.strategies.parameter_server import ParameterServerStrategy
from paramserve.psserver.partition import FixedShardsPartitioner

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
