"""A learning rate changed while a model with a DynamicEmbedding trains, on real processes: the
next update of a known row steps with the new rate, bad values raise what they raise for a
dense variable and change nothing, and a SIGKILLed parameter server restored from a checkpoint
saved before the change steps with the new rate (as do all servers rolled back by recovery; a
user's restore brings the checkpoint's rate back)."""

from __future__ import annotations

import sys
import time

import cloudpickle
import pytest
import torch

from paramserve.coordinator import CheckpointManager, ClusterCoordinator, ParameterServerStrategy
from paramserve.psserver.dynamic.dynamic_rows import owner_of
from paramserve.psserver.protocol.errors import InvalidRequestError
from paramserve.psserver.protocol.optimizer_spec import OptimizerSpec
from paramserve.psserver.protocol.types import RowGradient
from tests.integration.test_dynamic_embedding import HOT, Clicks, ClickStream, train_step

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import test modules

WORKER_ARGS = ("--ps-retry-deadline", "10")
FIRST_LR, NEW_LR = 0.1, 0.5
GRAD = torch.tensor([[1.0, -2.0, 0.25, 0.5, -1.0, 4.0, 0.0, 2.0]])


def build(spec):
    strategy = ParameterServerStrategy(spec)
    torch.manual_seed(0)
    with strategy.scope():
        model = Clicks()
    optimizer = strategy.optimizer(torch.optim.SGD, lr=FIRST_LR)
    return strategy, model, optimizer


def hot_id_on(server: int) -> int:
    hot = torch.arange(HOT)
    return int(hot[owner_of(hot, 2) == server][0])


def train(coordinator, batches, model, optimizer, steps: int) -> list[float]:
    values = [coordinator.schedule(train_step, args=(batches, model, optimizer)) for _ in range(steps)]
    coordinator.join(timeout=120)
    return [float(v.fetch()) for v in values]


def step_of_a_known_push(strategy: ParameterServerStrategy, row: int, key: str) -> torch.Tensor:
    """How much a push of GRAD moves row ``row`` (SGD: -lr x GRAD)."""
    client = strategy.client
    ids = {"ids": torch.tensor([row])}
    found, versions = client.pull_unique_rows(ids, dynamic={"ids": (8, torch.float32)})
    assert found["ids"].ids.tolist() == [row], "the hot row is held"
    client.push({"ids": RowGradient(found["ids"].ids, GRAD)}, key=key, base_versions=versions)
    after, _ = client.pull_unique_rows(ids, dynamic={"ids": (8, torch.float32)})
    return after["ids"].rows - found["ids"].rows


def moved_by(step: torch.Tensor, lr: float) -> bool:
    return torch.allclose(step, -lr * GRAD, rtol=0, atol=1e-6)  # (v - lr g) - v: rounding only


def table_optimizers(strategy: ParameterServerStrategy) -> list[OptimizerSpec | None]:
    return [s.config.optimizer for per in strategy.client.dynamic.export(["ids"]).values() for s in per]


def test_a_new_learning_rate_reaches_the_dynamic_table_and_bad_values_change_nothing(start_cluster):
    cluster = start_cluster(num_ps=2, num_workers=2)
    strategy, model, optimizer = build(cluster.spec)
    with ClusterCoordinator(strategy) as coordinator:
        batches = iter(coordinator.create_per_worker_dataset(ClickStream()))
        train(coordinator, batches, model, optimizer, 10)
        before = step_of_a_known_push(strategy, hot_id_on(0), "before")
        strategy.set_learning_rate(optimizer, NEW_LR)
        after = [step_of_a_known_push(strategy, hot_id_on(server), f"after{server}") for server in (0, 1)]
        errors = []
        for params in ([model.ids], [model.out.weight]):
            with pytest.raises(InvalidRequestError, match="Invalid learning rate") as raised:
                strategy.set_server_hyperparameters({"lr": -1.0}, params=params)
            errors.append(raised.value)
        with pytest.raises(InvalidRequestError, match="has no hyperparameter 'nope'"):
            strategy.set_server_hyperparameters({"nope": 1.0}, params=[model.ids])
        with pytest.raises(InvalidRequestError, match="changes its state"):
            strategy.set_server_hyperparameters({"momentum": 0.9}, params=[model.ids])
        unchanged = step_of_a_known_push(strategy, hot_id_on(1), "unchanged")
        losses = train(coordinator, batches, model, optimizer, 10)
        optimizers = table_optimizers(strategy)
    strategy.close()

    assert moved_by(before, FIRST_LR)
    assert all(moved_by(step, NEW_LR) for step in after), after
    assert [type(e) for e in errors] == [InvalidRequestError] * 2
    assert [e.variable for e in errors] == ["ids", "clicks.out.weight"]
    assert moved_by(unchanged, NEW_LR), "a refused change leaves the rate in force"
    assert optimizers == [OptimizerSpec("SGD", {"lr": NEW_LR})] * 2
    assert all(torch.isfinite(torch.tensor(losses)))


@pytest.mark.timeout(300)
def test_a_killed_server_restored_after_a_learning_rate_change_steps_with_the_new_rate(start_cluster, tmp_path):
    cluster = start_cluster(num_ps=2, num_workers=2, extra_worker_args=WORKER_ARGS)
    strategy, model, optimizer = build(cluster.spec)
    manager = CheckpointManager(strategy, tmp_path)
    with ClusterCoordinator(strategy) as coordinator:
        batches = iter(coordinator.create_per_worker_dataset(ClickStream()))
        train(coordinator, batches, model, optimizer, 20)
        path = manager.save(20)  # saved with lr FIRST_LR
        strategy.set_learning_rate(optimizer, NEW_LR)
        cluster.kill_ps(1)
        cluster.restart_ps(1)
        deadline = time.monotonic() + 120
        while not coordinator.recovery.recoveries and time.monotonic() < deadline:
            time.sleep(0.2)
        results = [r.result for r in coordinator.recovery.recoveries]
        optimizers = table_optimizers(strategy)
        restored = step_of_a_known_push(strategy, hot_id_on(1), "restored")
        losses = train(coordinator, batches, model, optimizer, 10)
        strategy.restore_checkpoint(path)  # recovery at RecoveryPoint.ALL: every server rolled back
        rolled_back = table_optimizers(strategy)
        manager.restore(path)  # a user's restore: the checkpoint's settings, recorded as in force
        as_saved = table_optimizers(strategy), strategy.live_optimizer("ids")
    strategy.close()

    assert results == ["restored"]
    assert optimizers == [OptimizerSpec("SGD", {"lr": NEW_LR})] * 2, "the rate in force, not the checkpoint's"
    assert moved_by(restored, NEW_LR)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert rolled_back == [OptimizerSpec("SGD", {"lr": NEW_LR})] * 2
    assert as_saved == ([OptimizerSpec("SGD", {"lr": FIRST_LR})] * 2, OptimizerSpec("SGD", {"lr": FIRST_LR}))
