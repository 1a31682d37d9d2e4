"""A torch optimizer built in ``strategy.scope()`` on real processes, written as one would train
locally: ``torch.optim.SGD(param_groups)`` over a model with an embedding table, and a torch LR
scheduler stepped on the coordinator. The servers train the table, apply each group's own rate,
and take the scheduler's rate from its next closure on."""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch
from torch import nn

from paramserve.coordinator import ClusterCoordinator, ParameterServerStrategy, ShardedEmbedding

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import test modules


class Ranker(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.items = ShardedEmbedding(50, 4)
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(self.items(ids)))).squeeze(-1)


def step(model: Ranker, optimizer: torch.optim.Optimizer, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 50, (32,), generator=generator)
    optimizer.zero_grad()
    loss = ((model(ids) - (ids % 2).float()) ** 2).mean()
    loss.backward()
    optimizer.step()
    return loss.detach()


def values(strategy: ParameterServerStrategy) -> dict[str, torch.Tensor]:
    return {s.ref.variable: s.value.clone() for shards in strategy.client.export().values() for s in shards}


def train(coordinator: ClusterCoordinator, model: Ranker, optimizer: torch.optim.Optimizer, steps: int) -> None:
    for seed in range(steps):
        coordinator.schedule(step, args=(model, optimizer, seed))
    coordinator.join(timeout=120)


@pytest.mark.filterwarnings("error::UserWarning")  # torch's "lr_scheduler.step() before optimizer.step()"
def test_the_table_trains_each_group_keeps_its_rate_and_a_scheduler_reaches_the_servers(start_cluster):
    cluster = start_cluster(num_ps=1, num_workers=1)
    strategy = ParameterServerStrategy(cluster.spec)
    torch.manual_seed(0)
    with strategy.scope():
        model = Ranker()
        optimizer = torch.optim.SGD(
            [{"params": model.body.parameters()}, {"params": model.head.parameters(), "lr": 0.0}], lr=0.1
        )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: 1.0 if epoch == 0 else 0.0)
    with ClusterCoordinator(strategy) as coordinator:
        train(coordinator, model, optimizer, 1)
        start = values(strategy)
        train(coordinator, model, optimizer, 10)
        trained = values(strategy)
        scheduler.step()  # every group's rate to 0 from the next closure on
        train(coordinator, model, optimizer, 10)
        frozen = values(strategy)
    rate = strategy.learning_rate(optimizer)
    strategy.close()

    table, body, head = "ranker.items", "ranker.body.weight", "ranker.head.weight"
    assert not torch.equal(start[table], trained[table]), "model.parameters() holds no table: it trains anyway"
    assert not torch.equal(start[body], trained[body])
    assert torch.equal(start[head], trained[head]), "the head's group has a rate of 0"
    assert rate == 0.0
    for name, value in trained.items():
        assert torch.equal(frozen[name], value), f"{name} moved after the scheduler set every rate to 0"
