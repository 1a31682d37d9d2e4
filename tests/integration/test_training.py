"""Asynchronous training end to end on real processes: convergence, checkpoints, export."""

from __future__ import annotations

import subprocess
import sys

import cloudpickle
import torch

from paramserve.coordinator.checkpointing.checkpoint_manager import (
    CheckpointManager,
    export_state_dict,
    state_dict,
)
from paramserve.coordinator.cluster_coordinator import ClusterCoordinator
from paramserve.coordinator.demos.digits import MLP, digits_split, train_step, worker_batches
from paramserve.coordinator.strategies.parameter_server import ParameterServerStrategy
from paramserve.psserver.protocol.partition import FixedShardsPartitioner

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import test modules


def build(cluster, seed=0, partitioner=None):
    strategy = ParameterServerStrategy(cluster.spec, variable_partitioner=partitioner or FixedShardsPartitioner(2))
    torch.manual_seed(seed)
    with strategy.scope():
        model = MLP(32)
    optimizer = strategy.optimizer(torch.optim.Adam, lr=5e-3)
    return strategy, model, optimizer


def train(strategy, model, optimizer, steps):
    with ClusterCoordinator(strategy) as coordinator:
        batches = iter(coordinator.create_per_worker_dataset(worker_batches))
        values = [coordinator.schedule(train_step, args=(batches, model, optimizer)) for _ in range(steps)]
        coordinator.join()
        return [float(v.fetch()) for v in values]


def accuracy(model):
    _, _, x_test, y_test = digits_split()
    with torch.no_grad():
        return float((model(x_test).argmax(dim=1) == y_test).float().mean())


def shard_versions(strategy):
    return {info.ref: info.version for infos in strategy.client.list_shards().values() for info in infos}


def test_async_training_converges_and_every_step_is_applied_once(start_cluster):
    cluster = start_cluster(num_ps=2, num_workers=2)
    strategy, model, optimizer = build(cluster)

    losses = train(strategy, model, optimizer, steps=300)

    assert sum(losses[-20:]) / 20 < 0.5 * sum(losses[:20]) / 20
    assert accuracy(model) > 0.9
    versions = shard_versions(strategy)
    assert len(versions) == 8  # 4 parameters x 2 shards
    assert set(versions.values()) == {300}, "each step must be applied exactly once to every shard"
    strategy.close()


def test_checkpoint_from_two_servers_restores_onto_three_with_optimizer_slots(start_cluster, tmp_path):
    two = start_cluster(num_ps=2, num_workers=1)
    strategy, model, optimizer = build(two)
    train(strategy, model, optimizer, steps=40)
    CheckpointManager(strategy, tmp_path).save(step=40)
    saved = {s.ref.variable + f"/{s.row_start}": s for states in strategy.client.export().values() for s in states}
    before = state_dict(strategy, model)
    strategy.close()

    three = start_cluster(num_ps=3, num_workers=1)
    restored, restored_model, _ = build(three, seed=1, partitioner=FixedShardsPartitioner(3))
    step = CheckpointManager(restored, tmp_path).restore_or_initialize()

    assert step == 40
    after = state_dict(restored, restored_model)
    assert after.keys() == before.keys()
    for key in before:
        assert torch.equal(after[key], before[key]), key
    layout = restored.client.layout("mlp.hidden.weight")
    assert len(layout.shards) == 3 and {s.server for s in layout.shards} == {0, 1, 2}
    exported = {s.ref.variable: s for states in restored.client.export().values() for s in states if s.row_start == 0}
    old_first = saved["mlp.hidden.weight/0"]
    new_first = exported["mlp.hidden.weight"]
    rows = new_first.value.shape[0]
    assert torch.equal(new_first.slots["exp_avg"], old_first.slots["exp_avg"][:rows])
    assert torch.equal(new_first.slots["exp_avg_sq"], old_first.slots["exp_avg_sq"][:rows])
    restored.close()


def test_exported_state_dict_loads_into_a_plain_model_without_paramserve(start_cluster, tmp_path):
    cluster = start_cluster(num_ps=2, num_workers=1)
    strategy, model, optimizer = build(cluster)
    train(strategy, model, optimizer, steps=30)
    path = export_state_dict(strategy, tmp_path / "model.pt", model)
    _, _, x_test, _ = digits_split()
    with torch.no_grad():
        expected = model(x_test[:5])
    strategy.close()
    cluster.stop()

    script = (
        "import sys, torch\n"
        "from paramserve.coordinator.demos.digits import MLP\n"
        "model = MLP(32)\n"
        f"model.load_state_dict(torch.load({str(path)!r}, weights_only=True))\n"
        f"torch.save(model(torch.load({str(tmp_path / 'x.pt')!r})).detach(), {str(tmp_path / 'y.pt')!r})\n"
    )
    torch.save(x_test[:5], tmp_path / "x.pt")
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    torch.testing.assert_close(torch.load(tmp_path / "y.pt"), expected)


def replica_step(strategy, batches, model, optimizer):
    """A TF-style step: the scheduled function calls strategy.run on the worker."""

    def replica_fn(x, y):
        from paramserve.coordinator.strategies.base import get_replica_context

        context = get_replica_context()
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        return loss.detach(), context.replica_id_in_sync_group, context.num_replicas_in_sync

    x, y = next(batches)
    loss, replica, replicas = strategy.run(replica_fn, args=(x, y))
    return strategy.reduce("SUM", loss), replica, replicas


def test_scheduled_steps_may_call_strategy_run_and_reduce(start_cluster):
    from paramserve.coordinator.strategies.base import get_strategy

    cluster = start_cluster(num_ps=1, num_workers=1)
    strategy, model, optimizer = build(cluster)
    with strategy.scope():
        assert get_strategy() is strategy
    assert strategy.num_replicas_in_sync == 1
    with ClusterCoordinator(strategy) as coordinator:
        batches = iter(strategy.distribute_datasets_from_function(worker_batches))
        loss, replica, replicas = coordinator.schedule(replica_step, args=(strategy, batches, model, optimizer)).fetch(
            timeout=120
        )
    assert torch.isfinite(loss) and (replica, replicas) == (0, 1)
    assert {i.version for infos in strategy.client.list_shards().values() for i in infos} == {1}
    strategy.close()


def test_a_torch_optimizer_built_in_scope_runs_on_the_servers(start_cluster):
    cluster = start_cluster(num_ps=1, num_workers=1)
    strategy = ParameterServerStrategy(cluster.spec)
    with strategy.scope():
        model = MLP(16)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    assert isinstance(optimizer, torch.optim.SGD)
    specs = {v.optimizer for v in strategy.variables.values()}
    assert len(specs) == 1
    (spec,) = specs
    assert spec.name == "SGD" and spec.kwargs["momentum"] == 0.9 and spec.kwargs["lr"] == 0.1
    train(strategy, model, optimizer, steps=5)
    assert {i.version for infos in strategy.client.list_shards().values() for i in infos} == {5}
    strategy.close()
