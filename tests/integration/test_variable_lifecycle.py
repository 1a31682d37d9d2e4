"""Variables of a ParameterServerStrategy on real servers: models built at any time (issue 11,
item 7) and runs that share servers without silently sharing variables (item 4)."""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch
from torch import nn

from paramserve.coordinator.checkpointing.checkpoint_manager import CheckpointManager, export_state_dict, state_dict
from paramserve.coordinator.cluster_coordinator import ClusterCoordinator
from paramserve.coordinator.demos.digits import MLP, train_step, worker_batches
from paramserve.coordinator.strategies.parameter_server import ParameterServerStrategy
from paramserve.psserver.protocol.errors import VariableExistsError

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import test modules

pytestmark = pytest.mark.timeout(180)


def nothing() -> int:
    return 1


def train(strategy, model, optimizer, steps=5) -> None:
    with ClusterCoordinator(strategy) as coordinator:
        batches = iter(coordinator.create_per_worker_dataset(worker_batches))
        for _ in range(steps):
            coordinator.schedule(train_step, args=(batches, model, optimizer))
        coordinator.join()


def build(strategy, seed=0, hidden=16):
    torch.manual_seed(seed)
    with strategy.scope():
        model = MLP(hidden)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, optimizer


def versions(strategy) -> dict[str, int]:
    return {info.ref.variable: info.version for infos in strategy.client.list_shards().values() for info in infos}


def test_a_model_built_after_training_started_gets_its_variables_with_the_next_closure(start_cluster, tmp_path):
    cluster = start_cluster(num_ps=1, num_workers=1)
    strategy = ParameterServerStrategy(cluster.spec)
    try:
        with ClusterCoordinator(strategy) as coordinator:
            coordinator.schedule(nothing)  # training started: the (no) variables exist
            coordinator.join()
            first_context = strategy.cluster_context()

            model, optimizer = build(strategy)  # refused before: "built after training started"

            batches = iter(coordinator.create_per_worker_dataset(worker_batches))
            for _ in range(3):
                coordinator.schedule(train_step, args=(batches, model, optimizer))
            coordinator.join()
        assert strategy.cluster_context().fingerprint != first_context.fingerprint, "workers learn the new layouts"
        assert set(versions(strategy).values()) == {3}
        export_state_dict(strategy, tmp_path / "model.pt")  # one model: no module= needed
    finally:
        strategy.close()


def test_a_failed_build_is_not_recorded(start_cluster, tmp_path):
    cluster = start_cluster(num_ps=1, num_workers=1)
    first = ParameterServerStrategy(cluster.spec)
    second = ParameterServerStrategy(cluster.spec)
    try:
        train(first, *build(first))  # the servers hold mlp.* now
        with second.scope():
            linear = nn.Linear(64, 10)
        with ClusterCoordinator(second) as coordinator:
            coordinator.schedule(nothing)
            coordinator.join()
        with pytest.raises(VariableExistsError, match="run_name"):
            build(second)  # its mlp.* variables exist: the build fails ...
        assert [root for _, root in second.roots] == [linear]  # ... and leaves nothing behind
        export_state_dict(second, tmp_path / "linear.pt")
    finally:
        first.close()
        second.close()


def test_runs_sharing_servers_keep_apart_and_reuse_is_explicit(start_cluster, tmp_path):
    cluster = start_cluster(num_ps=2, num_workers=1)
    first = ParameterServerStrategy(cluster.spec)
    model, optimizer = build(first)
    train(first, model, optimizer)
    trained = state_dict(first, model)

    again = ParameterServerStrategy(cluster.spec)  # a second program, same model class and shapes
    again_model, again_optimizer = build(again, seed=1)
    with pytest.raises(VariableExistsError, match=r"run_name=.*reuse_variables=True"):
        train(again, again_model, again_optimizer)  # used to start silently from the first run's values

    named = ParameterServerStrategy(cluster.spec, run_name="second")
    named_model, named_optimizer = build(named, seed=1)
    train(named, named_model, named_optimizer, steps=2)
    assert {name for name in versions(named) if name.startswith("second/")} == set(named.variables)
    assert all(version == 2 for name, version in versions(named).items() if name.startswith("second/"))
    assert all(torch.equal(state_dict(first, model)[k], v) for k, v in trained.items()), "first run untouched"

    CheckpointManager(named, tmp_path / "ckpt").save(step=2)  # names without the run name ...
    third = ParameterServerStrategy(cluster.spec, run_name="third")
    third_model, _ = build(third, seed=2)
    assert CheckpointManager(third, tmp_path / "ckpt").restore_or_initialize() == 2  # ... restore into any run
    assert all(torch.equal(state_dict(third, third_model)[k], v) for k, v in state_dict(named, named_model).items())

    reuse = ParameterServerStrategy(cluster.spec, reuse_variables=True)
    reuse_model, reuse_optimizer = build(reuse, seed=3)
    train(reuse, reuse_model, reuse_optimizer, steps=1)
    assert set(versions(reuse)[name] for name in reuse.variables) == {6}, "trained on from the first run's values"
    for strategy in (first, again, named, third, reuse):
        strategy.close()
