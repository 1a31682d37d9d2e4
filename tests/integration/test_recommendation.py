"""A recommendation model (embedding tables and dense layers) trained on real processes."""

from __future__ import annotations

import sys
import urllib.request

import cloudpickle
import pytest
import torch
from torch import nn

from paramserve.coordinator import (
    ClusterCoordinator,
    FixedShardsPartitioner,
    ParameterServerStrategy,
    ShardedEmbedding,
    ShardedEmbeddingCollection,
    state_dict,
)
from paramserve.coordinator.checkpointing.checkpoint_manager import CheckpointManager
from paramserve.coordinator.demos.recommendation import (
    DLRM,
    ClickData,
    PerFeatureEmbeddings,
    WorkerClicks,
    auc,
    train_clicks,
)
from paramserve.psserver.protocol.errors import CheckpointError

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import test modules

TABLE_ROWS = [1000, 1000, 500, 2000, 1000, 300]


def held_out_auc(model):
    batches = ClickData(TABLE_ROWS).batches(stream=999, count=8)
    with torch.no_grad():
        scores = torch.cat([model(b.dense, b.features()) for b in batches])
    return auc(scores, torch.cat([b.clicked for b in batches]))


def shard_versions(strategy, variable):
    return {
        info.ref: info.version
        for infos in strategy.client.list_shards().values()
        for info in infos
        if info.ref.variable == variable
    }


def test_a_dlrm_with_an_embedding_collection_learns_and_applies_every_step_once(start_cluster):
    cluster = start_cluster(num_ps=2, num_workers=2)
    strategy = ParameterServerStrategy(cluster.spec, variable_partitioner=FixedShardsPartitioner(2))
    torch.manual_seed(0)
    with strategy.scope():
        model = DLRM(TABLE_ROWS, embeddings=ShardedEmbeddingCollection)
    optimizer = strategy.optimizer(torch.optim.Adagrad, lr=0.05)
    table = model.embeddings.table.variable
    with ClusterCoordinator(strategy) as coordinator:
        before = held_out_auc(model)  # the coordinator reads the table's rows from the servers
        batches = iter(coordinator.create_per_worker_dataset(WorkerClicks(TABLE_ROWS, count=100)))
        losses = [coordinator.schedule(train_clicks, args=(batches, model, optimizer)) for _ in range(300)]
        coordinator.join()
    after = held_out_auc(model)

    assert after > 0.68 and after > before + 0.15, (before, after)
    first, last = (sum(float(v.fetch()) for v in part) / 20 for part in (losses[:20], losses[-20:]))
    assert last < first
    versions = shard_versions(strategy, table)
    assert len(versions) == 2, "one table variable for all six features, in two shards"
    assert set(versions.values()) == {300}, "every step pushes the table's rows once, applied once"
    strategy.close()


class TwoTables(nn.Module):
    def __init__(self):
        super().__init__()
        self.users = ShardedEmbedding(50, 4, name="users")
        self.items = ShardedEmbedding(80, 4, name="items")
        self.out = nn.Linear(8, 1)

    def forward(self, users, items):
        return self.out(torch.cat([self.users(users), self.items(items)], dim=1)).squeeze(1)


def named_step(model, optimizer):
    optimizer.zero_grad()
    loss = (model(torch.tensor([1, 2, 2]), torch.tensor([0, 79, 5])) - 1.0).pow(2).mean()
    loss.backward()
    optimizer.step()
    return loss.detach()


def test_tables_named_inside_a_module_are_variables_under_those_names(start_cluster):
    cluster = start_cluster(num_ps=2, num_workers=1)
    strategy = ParameterServerStrategy(cluster.spec, run_name="rec")
    with strategy.scope():
        model = TwoTables()
    optimizer = strategy.optimizer(torch.optim.SGD, lr=0.1)
    with ClusterCoordinator(strategy) as coordinator:
        before = model.users(torch.tensor([1, 3])).clone()
        losses = [coordinator.schedule(named_step, args=(model, optimizer)) for _ in range(20)]
        coordinator.join()
    after = model.users(torch.tensor([1, 3]))

    assert {"rec/users", "rec/items"} <= set(strategy.client.layouts)
    assert float(losses[-1].fetch()) < float(losses[0].fetch())
    assert not torch.equal(before[0], after[0]), "a looked-up row is trained"
    assert torch.equal(before[1], after[1]), "a row no step looked up is untouched"
    strategy.close()


def test_two_tables_given_one_name_are_refused_when_the_scope_closes(start_cluster):
    cluster = start_cluster(num_ps=1, num_workers=1)
    strategy = ParameterServerStrategy(cluster.spec)
    with pytest.raises(ValueError, match="two variables are named 'ids'"):
        with strategy.scope():
            nn.ModuleList([ShardedEmbedding(10, 2, name="ids"), ShardedEmbedding(10, 2, name="ids")])
    with strategy.scope():  # the failed scope left nothing behind
        table = ShardedEmbedding(10, 2, name="ids")
    assert table.variable == "ids" and set(strategy.variables) == {"ids"}
    strategy.close()


def data_plane_steps(cluster) -> dict[int, float]:
    """Each parameter server's data-plane steps so far (one per exchange a worker makes with it)."""
    steps = {}
    for process in cluster.processes:
        if process.role != "ps":
            continue
        text = urllib.request.urlopen(f"http://127.0.0.1:{process.metrics_port}/metrics", timeout=10).read().decode()
        steps[process.index] = sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("paramserve_rpcs_total{") and 'method="DataPlaneStep"' in line
        )
    return steps


@pytest.mark.parametrize("fuse_tables", [True, False], ids=["fused", "a-variable-per-table"])
def test_a_dlrm_of_separate_tables_reads_them_all_in_one_exchange_per_server_a_step_and_learns(
    start_cluster, fuse_tables
):
    """Issue 42: the six tables' lookups travel together either way; fused (the default), the
    servers store them as one variable, as a ShardedEmbeddingCollection's."""
    steps = 60
    cluster = start_cluster(num_ps=2, num_workers=1, extra_ps_args=["--metrics-port", "0"])
    strategy = ParameterServerStrategy(
        cluster.spec, variable_partitioner=FixedShardsPartitioner(2), fuse_tables=fuse_tables
    )
    torch.manual_seed(0)
    with strategy.scope():
        model = DLRM(TABLE_ROWS, embeddings=PerFeatureEmbeddings)
    variables = {t.variable for t in model.embeddings.tables.values()}
    assert variables == {"dlrm.fused_tables.0"} if fuse_tables else len(variables) == len(TABLE_ROWS)
    optimizer = strategy.optimizer(torch.optim.Adagrad, lr=0.05)
    with ClusterCoordinator(strategy) as coordinator:
        before_auc = held_out_auc(model)
        batches = iter(coordinator.create_per_worker_dataset(WorkerClicks(TABLE_ROWS, count=100)))
        coordinator.schedule(train_clicks, args=(batches, model, optimizer))  # the first closure pulls everything
        coordinator.join()
        before = data_plane_steps(cluster)
        for _ in range(steps):
            coordinator.schedule(train_clicks, args=(batches, model, optimizer))
        coordinator.join()
        after = data_plane_steps(cluster)
        for _ in range(240):
            coordinator.schedule(train_clicks, args=(batches, model, optimizer))
        coordinator.join()
    made = {server: after[server] - before[server] for server in after}
    # A step is a lookup of all six tables and a push: two exchanges with each server, not seven
    # (and a closure's first step may pull the dense values it holds, once their age ran out).
    assert set(made) == {0, 1} and all(2 * steps <= n <= 2 * steps + 2 for n in made.values()), made
    after_auc = held_out_auc(model)
    assert after_auc > 0.68 and after_auc > before_auc + 0.15, (before_auc, after_auc)
    exported = state_dict(strategy, model)
    for name, table in model.embeddings.tables.items():  # each table its own weight, as its lookups read it
        weight = exported[f"embeddings.tables.{name}.weight"]
        assert weight.shape == table.shape
        with torch.no_grad():
            assert torch.equal(weight, table(torch.arange(table.num_embeddings)).resolve())
    strategy.close()


def train_per_feature(cluster, steps: int, **options):  # type: ignore[no-untyped-def]
    strategy = ParameterServerStrategy(cluster.spec, variable_partitioner=FixedShardsPartitioner(2), **options)
    torch.manual_seed(0)
    with strategy.scope():
        model = DLRM(TABLE_ROWS, embeddings=PerFeatureEmbeddings)
    optimizer = strategy.optimizer(torch.optim.Adagrad, lr=0.05)
    with ClusterCoordinator(strategy) as coordinator:
        batches = iter(coordinator.create_per_worker_dataset(WorkerClicks(TABLE_ROWS, count=20)))
        for _ in range(steps):
            coordinator.schedule(train_clicks, args=(batches, model, optimizer))
        coordinator.join()
    return strategy, model


def test_fused_tables_checkpoint_and_restore_exactly_and_a_checkpoint_of_the_other_layout_names_the_setting(
    start_cluster, tmp_path
):
    """Issue 42: fused tables are one variable in a checkpoint; a checkpoint written with a
    variable per table is refused by a fused model, naming fuse_tables=False, before anything
    changes, and restores exactly with that setting."""
    cluster = start_cluster(num_ps=2, num_workers=1)
    fused, fused_model = train_per_feature(cluster, 4, run_name="fused")
    CheckpointManager(fused, tmp_path / "fused").save(step=4)
    separate, separate_model = train_per_feature(cluster, 4, run_name="separate", fuse_tables=False)
    CheckpointManager(separate, tmp_path / "separate").save(step=4)

    again, again_model = train_per_feature(cluster, 1, run_name="again")  # fused, trained on its own
    untouched = state_dict(again, again_model)
    with pytest.raises(CheckpointError, match=r"variable per embedding table.*fuse_tables=False to restore it"):
        CheckpointManager(again, tmp_path / "separate").restore_or_initialize()
    assert all(torch.equal(state_dict(again, again_model)[k], v) for k, v in untouched.items()), "nothing changed"
    assert CheckpointManager(again, tmp_path / "fused").restore_or_initialize() == 4
    expected = state_dict(fused, fused_model)
    assert all(torch.equal(state_dict(again, again_model)[k], v) for k, v in expected.items()), "an exact restore"

    unfused, unfused_model = train_per_feature(cluster, 1, run_name="unfused", fuse_tables=False)
    with pytest.raises(CheckpointError, match=r"tables fused into one variable.*fuse_tables=True"):
        CheckpointManager(unfused, tmp_path / "fused").restore_or_initialize()
    assert CheckpointManager(unfused, tmp_path / "separate").restore_or_initialize() == 4
    expected = state_dict(separate, separate_model)
    assert all(torch.equal(state_dict(unfused, unfused_model)[k], v) for k, v in expected.items())
    for strategy in (fused, separate, again, unfused):
        strategy.close()
