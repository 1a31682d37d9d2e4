"""Bad input to the strategy and checkpoint manager: clear errors, nothing changed.
No server is needed: every check here happens before any call."""

from __future__ import annotations

import pytest
import torch
from scope_models import Net, undialled_strategy
from torch import nn

from paramserve.coordinator import (
    CheckpointManager,
    ShardedEmbedding,
    load_state_dict,
)
from paramserve.psserver.protocol.errors import CheckpointError


@pytest.fixture
def strategy():
    yield from undialled_strategy()


def test_scope_names_variables_after_the_model_and_its_tables(strategy):
    with strategy.scope():
        Net()
        lonely = ShardedEmbedding(10, 2)
    assert list(strategy.variables) == [
        "net.body.0.weight",
        "net.body.0.bias",
        "net.body.2.weight",
        "net.body.2.bias",
        "net.table",
        "embedding",
    ]
    assert lonely.variable == "embedding"
    assert strategy.variables["net.table"].shape == (100, 4)


def test_optimizer_for_a_parameter_built_outside_the_scope_is_refused(strategy):
    with strategy.scope():
        Net()
    outsider = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="strategy.scope"):
        strategy.optimizer(torch.optim.SGD, params=outsider.parameters(), lr=0.1)


def test_a_directory_that_is_not_a_checkpoint_is_named(strategy, tmp_path):
    with strategy.scope():
        Net()
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(CheckpointError) as caught:
        CheckpointManager(strategy, tmp_path).restore(tmp_path)
    assert str(tmp_path) in str(caught.value)
    assert not strategy.materialized


def test_a_state_dict_that_does_not_match_changes_nothing(strategy):
    with strategy.scope():
        model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    wrong = {**{k: torch.zeros_like(v) for k, v in before.items()}, "0.weight": torch.zeros(5, 4)}
    del wrong["1.bias"]
    wrong["extra"] = torch.zeros(1)
    with pytest.raises(ValueError) as caught:
        load_state_dict(strategy, wrong, model)
    message = str(caught.value)
    assert "missing keys ['1.bias']" in message and "unexpected keys ['extra']" in message and "0.weight" in message
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_the_servers_own_optimizers_are_not_taken_for_the_users(strategy):
    from paramserve.psserver.protocol.optimizer_spec import OptimizerSpec

    with strategy.scope():
        model = nn.Linear(2, 2)
        # What reading a checkpoint or a shard list does on the coordinator: build a scratch
        # torch optimizer to check a spec. Only an optimizer the user builds is captured.
        OptimizerSpec("Adam", {"lr": 0.1}).validate()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)

    assert {v.optimizer.name for v in strategy.variables.values()} == {"SGD"}
    assert type(optimizer).__name__ == "SGD" and type(optimizer) is not torch.optim.SGD  # linked to the servers
