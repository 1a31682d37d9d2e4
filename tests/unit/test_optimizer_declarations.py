"""What a torch optimizer built in ``strategy.scope()`` declares to the parameter servers
(coordinator/strategies/scope_optimizers.py): the tables of a whole model, each param group's
options, a rate a scheduler sets later, and the workers' param groups under hybrid training.
No server is needed: the declarations are made before any call (the same on real processes:
tests/integration/test_scope_optimizers.py)."""

from __future__ import annotations

import cloudpickle
import pytest
import torch
from scope_models import CLUSTER, Net, undialled_strategy
from torch import nn

from paramserve.coordinator import ParameterServerStrategy, ShardedEmbedding
from paramserve.coordinator.strategies.scope_optimizers import RateWatchingGroup, declarations, tables_of_whole_models
from paramserve.coordinator.strategies.sync_dense import dense_groups
from paramserve.psserver.protocol.optimizer_spec import OptimizerSpec
from paramserve.worker.closure_pickling import dumps_closure


@pytest.fixture
def strategy():
    yield from undialled_strategy()


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


def test_hybrid_training_gives_the_workers_a_param_group_per_set_of_options():
    """The workers apply one optimizer to every replicated layer, with the groups' own options."""
    strategy = ParameterServerStrategy(CLUSTER, sync_dense=True)
    try:
        with strategy.scope():
            net = Net()
            torch.optim.SGD(
                [{"params": net.body[0].parameters(), "lr": 0.5}, {"params": net.body[2].parameters()}], lr=0.1
            )
        cls, groups = cloudpickle.loads(strategy.sync_dense.settings().optimizer)
    finally:
        strategy.close()

    assert cls is torch.optim.SGD
    assert [(names, kwargs["lr"]) for names, kwargs in groups] == [
        (("net.body.0.bias", "net.body.0.weight"), 0.5),
        (("net.body.2.bias", "net.body.2.weight"), 0.1),
    ]


def test_dense_groups_gather_variables_by_their_options():
    fast, slow = OptimizerSpec("SGD", {"lr": 0.5}), OptimizerSpec("SGD", {"lr": 0.1})

    assert dense_groups([("a", slow), ("b", fast), ("c", slow), ("d", None)]) == [(("a", "c"), slow), (("b",), fast)]


def test_a_param_group_added_after_the_scope_closed_is_refused_not_left_untrained(strategy):
    with strategy.scope():
        net = Net()
        optimizer = torch.optim.SGD(net.body[0].parameters(), lr=0.1)
        optimizer.add_param_group({"params": net.body[2].weight, "lr": 0.2})  # in scope: declared with the rest
    with pytest.raises(RuntimeError, match="would never train"):
        optimizer.add_param_group({"params": net.body[2].bias})

    assert stepped(optimizer) == {"net.body.0.weight", "net.body.0.bias", "net.body.2.weight"}
    assert strategy.variables["net.body.2.weight"].optimizer.kwargs["lr"] == 0.2


def test_the_state_dict_of_an_optimizer_whose_state_is_on_the_servers_is_refused_not_empty(strategy):
    """Saving the coordinator's local state would write a file with no momentum in it, and the
    loss would only show that after a restore: refused, naming the way that saves the slots."""
    with strategy.scope():
        net = Net()
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(RuntimeError, match=r"on the parameter servers.*CheckpointManager\(strategy, directory\)\.save"):
        optimizer.state_dict()
    with pytest.raises(RuntimeError, match=r"CheckpointManager\(strategy, directory\)\.restore"):
        optimizer.load_state_dict({"state": {}, "param_groups": []})


def test_an_optimizer_with_step_hooks_is_refused_where_it_steps_not_left_without_them(strategy):
    """torch runs an optimizer's step hooks inside its step(); under parameter servers the step is
    the ServerOptimizer's, made on the workers, so the hooks would silently never run."""
    with strategy.scope():
        net = Net()
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    cloudpickle.dumps(optimizer)  # no hooks: sent as its ServerOptimizer
    handle = optimizer.register_step_post_hook(lambda *_: None)
    with pytest.raises(RuntimeError, match=r"1 step hook\(s\).*would never run.*before or after optimizer.step\(\)"):
        cloudpickle.dumps(optimizer)  # as a closure that calls optimizer.step() takes it to a worker
    with pytest.raises(RuntimeError, match="would never run"):
        dumps_closure((lambda: optimizer.step(), (), {}))  # what ClusterCoordinator.schedule() sends
    with pytest.raises(RuntimeError, match="would never run"):
        optimizer.step()  # on the coordinator
    handle.remove()
    sent = cloudpickle.loads(cloudpickle.dumps(optimizer))
    assert sent.variables == optimizer._paramserve_link.server_optimizer.variables


def test_a_rate_the_strategy_sets_is_the_rate_every_group_shows(strategy):
    """``optimizer.param_groups[0]["lr"]`` reads the rate under every strategy (README's table)."""
    with strategy.scope():
        net = Net()
        optimizer = torch.optim.SGD(
            [{"params": net.body[0].parameters()}, {"params": net.body[2].parameters(), "lr": 0.2}], lr=0.1
        )
    strategy.set_learning_rate(optimizer, 0.01)

    assert [group["lr"] for group in optimizer.param_groups] == [0.01, 0.01]
    assert strategy.learning_rate(optimizer) == 0.01
    assert {v.optimizer.kwargs["lr"] for v in strategy.variables.values()} == {0.01}
