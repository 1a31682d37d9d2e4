"""fit/evaluate/predict without strategy= use the strategy the model was built in (as Keras'
model.fit does), and reduce() returns plain (detached) tensors (issue 11, items 1 and 5)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from paramserve.coordinator.demos.digits import MLP, digits_split
from paramserve.coordinator.strategies import (
    MirroredStrategy,
    MultiWorkerMirroredStrategy,
    OneDeviceStrategy,
    get_strategy,
)
from paramserve.coordinator.strategies.multi_worker_cluster import Rendezvous
from paramserve.coordinator.training.callbacks import Callback
from paramserve.coordinator.training.loops import evaluate, fit, predict

LOSS = nn.CrossEntropyLoss(reduction="none")


class SeeStrategy(Callback):
    def on_train_begin(self, logs=None):
        self.strategy = self.state.strategy


def build(strategy):
    torch.manual_seed(0)
    with strategy.scope():
        model = MLP(16)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, optimizer


def global_batches():
    x, y, _, _ = digits_split()
    return DataLoader(TensorDataset(x[:128], y[:128]), batch_size=32)


def make_multi_worker():
    return MultiWorkerMirroredStrategy(cluster_resolver=Rendezvous(0, 1))


@pytest.mark.parametrize(
    "make",
    [lambda: MirroredStrategy(["cpu:0", "cpu:1"]), make_multi_worker, lambda: OneDeviceStrategy("cpu")],
    ids=["mirrored", "multi_worker", "one_device"],
)
def test_fit_outside_the_scope_without_strategy_uses_the_models_strategy(make):
    strategy = make()
    try:
        model, optimizer = build(strategy)
        seen = SeeStrategy()
        fit(model, optimizer, LOSS, global_batches(), epochs=1, callbacks=[seen], verbose=False)  # no strategy=
        assert seen.strategy is strategy
        x, y, _, _ = digits_split()
        assert set(evaluate(model, LOSS, (x[:64], y[:64]), return_dict=True)) == {"loss", "accuracy"}
        assert predict(model, x[:64]).shape == (64, 10)
    finally:
        strategy.close()


def test_a_strategy_that_did_not_build_the_model_is_refused_and_strategy_is_named():
    strategy = MirroredStrategy(["cpu:0", "cpu:1"])
    try:
        model, optimizer = build(strategy)
        with pytest.raises(ValueError, match=r"built in MirroredStrategy.scope\(\).*pass strategy="):
            fit(model, optimizer, LOSS, global_batches(), epochs=1, strategy=get_strategy(), verbose=False)
    finally:
        strategy.close()


def test_a_closed_strategy_lets_its_models_go():
    strategy = MirroredStrategy(["cpu:0", "cpu:1"])
    model, optimizer = build(strategy)
    strategy.close()
    seen = SeeStrategy()
    fit(model, optimizer, LOSS, global_batches(), epochs=1, callbacks=[seen], verbose=False)
    assert seen.strategy is get_strategy()


def test_the_replica_step_error_names_strategy_equals():
    strategy = MirroredStrategy(["cpu:0", "cpu:1"])
    try:
        model, optimizer = build(strategy)
        with pytest.raises(RuntimeError, match="strategy="):
            optimizer.step()
    finally:
        strategy.close()


@pytest.mark.parametrize(
    "make",
    [get_strategy, lambda: OneDeviceStrategy("cpu"), lambda: MirroredStrategy(["cpu:0", "cpu:1"]), make_multi_worker],
    ids=["default", "one_device", "mirrored", "multi_worker"],
)
def test_reduced_values_are_detached_so_a_running_total_keeps_no_graph(make):
    strategy = make()
    try:
        weight = torch.ones(3, requires_grad=True)
        per_replica = strategy.run(lambda: (weight * 2).sum())
        total = 0.0
        for op in ("SUM", "MEAN"):
            reduced = strategy.reduce(op, per_replica, axis=None)
            assert not reduced.requires_grad and reduced.grad_fn is None
            total += reduced
        assert not total.requires_grad
    finally:
        strategy.close()
