"""Bad input to the strategy and checkpoint manager: clear errors, nothing changed.
No server is needed: every check here happens before any call."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from paramserve.coordinator import (
    CheckpointManager,
    ClusterSpec,
    ParameterServerStrategy,
    ShardedEmbedding,
    load_state_dict,
)
from paramserve.coordinator.strategies.scope_optimizers import RateWatchingGroup, declarations, tables_of_whole_models
from paramserve.psserver.errors import CheckpointError

CLUSTER = ClusterSpec(parameter_servers=("127.0.0.1:1",), workers=("127.0.0.1:2",))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
        self.table = ShardedEmbedding(100, 4)


@pytest.fixture
def strategy():
    strategy = ParameterServerStrategy(CLUSTER)
    yield strategy
    strategy.close()


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


def stepped(optimizer):
    """The variables an optimizer built in scope pushes (the ServerOptimizer it stands for)."""
    return set(optimizer._paramserve_link.server_optimizer.variables)


def test_an_optimizer_over_a_whole_model_trains_its_tables_too(strategy):
    """model.parameters() leaves the tables out (they are not Parameters): without this the
    table would compute gradients every step and never change."""
    with strategy.scope():
        net = Net()
        optimizer = torch.optim.Adagrad(net.parameters(), lr=0.1)
    assert "net.table" in stepped(optimizer)
    assert strategy.variables["net.table"].optimizer.name == "Adagrad"


def test_an_optimizer_over_part_of_a_model_trains_only_what_it_holds(strategy):
    with strategy.scope():
        net = Net()
        ShardedEmbedding(10, 2)  # a table on its own: no model holds it
        optimizer = torch.optim.SGD(net.body[0].parameters(), lr=0.1)
    assert stepped(optimizer) == {"net.body.0.weight", "net.body.0.bias"}
    assert strategy.variables["net.table"].optimizer is None


def test_a_table_declared_with_its_own_optimizer_is_stepped_by_that_one_only(strategy):
    with strategy.scope():
        net = Net()
        dense = torch.optim.Adam(net.parameters(), lr=0.01)
    sparse = strategy.optimizer(torch.optim.Adagrad, params=[net.table], lr=0.1)
    assert "net.table" not in stepped(dense), "one table, one optimizer: never pushed twice"
    assert sparse.variables == ("net.table",)
    assert strategy.variables["net.table"].optimizer.name == "Adagrad"


def test_an_optimizer_for_every_other_variable_takes_the_tables_over(strategy):
    """Adam for the layers in scope, then Adagrad for "every variable without one": the tables."""
    with strategy.scope():
        net = Net()
        dense = torch.optim.Adam(net.parameters(), lr=0.01)
    sparse = strategy.optimizer(torch.optim.Adagrad, lr=0.1)
    assert sparse.variables == ("net.table",)
    assert "net.table" not in stepped(dense)


def test_each_param_group_keeps_its_own_options_on_the_servers(strategy):
    """A rate and a weight decay per group (biases without decay, a faster head) are what the
    servers apply, not only the optimizer's defaults; a scheduler's initial_lr is not an option."""
    with strategy.scope():
        net = Net()
        optimizer = torch.optim.SGD(
            [
                {"params": net.body[0].parameters(), "lr": 0.5},
                {"params": net.body[2].parameters(), "weight_decay": 0.1},
            ],
            lr=0.01,
            momentum=0.9,
        )
        torch.optim.lr_scheduler.StepLR(optimizer, step_size=10)
    options = {name: dict(v.optimizer.kwargs) for name, v in strategy.variables.items() if v.optimizer}
    assert options["net.body.0.weight"]["lr"] == options["net.body.0.bias"]["lr"] == 0.5
    assert options["net.body.0.weight"]["weight_decay"] == 0
    assert options["net.body.2.weight"]["lr"] == 0.01 and options["net.body.2.weight"]["weight_decay"] == 0.1
    assert all(o["momentum"] == 0.9 and "initial_lr" not in o for o in options.values())
    assert options["net.table"] == options["net.body.0.weight"], "the table: the first group's options"
    assert strategy.learning_rate(optimizer) == 0.5, "the first group's, as under every strategy"


@pytest.mark.filterwarnings("ignore:Detected call of")  # a scheduler stepped before any closure ran
def test_a_rate_set_on_a_group_becomes_its_variables_rate_but_not_a_handed_over_tables(strategy):
    with strategy.scope():
        net = Net()
        optimizer = torch.optim.SGD(
            [{"params": net.body[0].parameters()}, {"params": net.body[2].parameters(), "lr": 0.2}], lr=0.1
        )
    strategy.optimizer(torch.optim.Adagrad, params=[net.table], lr=0.05)  # the table has its own now
    scheduler = torch.optim.lr_scheduler.MultiplicativeLR(optimizer, lambda epoch: 0.5)
    scheduler.step()

    rate = {name: v.optimizer.kwargs["lr"] for name, v in strategy.variables.items()}
    assert rate["net.body.0.weight"] == rate["net.body.0.bias"] == 0.05
    assert rate["net.body.2.weight"] == 0.1
    assert rate["net.table"] == 0.05 and strategy.variables["net.table"].optimizer.name == "Adagrad"
    assert strategy.learning_rate(optimizer) == 0.05, "the first group's"


def test_a_rate_watching_group_tells_only_of_a_new_rate():
    told = []
    group = RateWatchingGroup({"params": [], "lr": 0.1, "momentum": 0.9}, told.append)
    group["lr"] = 0.1
    group["momentum"] = 0.5
    group["lr"] = 0.01

    assert told == [0.01]
    assert group == {"params": [], "lr": 0.01, "momentum": 0.5}


def test_declarations_keep_each_groups_constructor_options_only():
    weight, bias = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(1))
    defaults = {"lr": 0.1, "foreach": None, "fused": True, "eps": 1e-8}
    groups = [
        {"params": [weight], "lr": 0.5, "foreach": None, "fused": True, "eps": 1e-8, "initial_lr": 0.5},
        {"params": [], "lr": 0.1, "foreach": None, "fused": True, "eps": 1e-8},
        {"params": [bias], "lr": 0.1, "foreach": None, "fused": True, "eps": 1e-6},
    ]

    declared, tables = declarations(groups, defaults, [], set())

    assert [(d.params, d.options) for d in declared] == [
        ([weight], {"lr": 0.5, "eps": 1e-8}),
        ([bias], {"lr": 0.1, "eps": 1e-6}),
    ]
    assert tables == [] and declared[1].group is groups[2]


def test_tables_of_whole_models_is_a_pure_choice():
    with_table, other = Net(), Net()
    with_table.table.variable, other.table.variable = "a.table", "b.table"
    models = [("a", with_table), ("b", other)]

    assert tables_of_whole_models(with_table.parameters(), models, {"a.table", "b.table"}) == ["a.table"]
    assert tables_of_whole_models(with_table.parameters(), models, {"b.table"}) == [], "trained already"
    assert tables_of_whole_models(list(with_table.body[0].parameters()), models, {"a.table"}) == []
    assert tables_of_whole_models([], [("t", ShardedEmbedding(3, 2))], {"t"}) == [], "a lone table has no parameters"


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
    from paramserve.psserver.optimizer import OptimizerSpec

    with strategy.scope():
        model = nn.Linear(2, 2)
        # What reading a checkpoint or a shard list does on the coordinator: build a scratch
        # torch optimizer to check a spec. Only an optimizer the user builds is captured.
        OptimizerSpec("Adam", {"lr": 0.1}).validate()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)

    assert {v.optimizer.name for v in strategy.variables.values()} == {"SGD"}
    assert type(optimizer).__name__ == "SGD" and type(optimizer) is not torch.optim.SGD  # linked to the servers


def test_hybrid_training_refuses_param_groups_with_options_of_their_own():
    """The workers apply one optimizer to every replicated layer: a group's own rate would be
    lost there, so it is refused before the first round, naming why."""
    strategy = ParameterServerStrategy(CLUSTER, sync_dense=True)
    try:
        with strategy.scope():
            net = Net()
            torch.optim.SGD(
                [{"params": net.body[0].parameters(), "lr": 0.5}, {"params": net.body[2].parameters()}], lr=0.1
            )
        with pytest.raises(RuntimeError, match="param groups with options of their own"):
            strategy.sync_dense.settings()
    finally:
        strategy.close()
