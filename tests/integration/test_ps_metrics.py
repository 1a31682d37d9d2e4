"""A metric built in a ParameterServerStrategy's scope and updated inside scheduled steps on the
workers counts on the coordinator: its state lives on the parameter servers (issue 11, item 3)."""

from __future__ import annotations

import functools
import sys

import cloudpickle
import pytest
import torch
from torch import nn

from paramserve.coordinator import metrics
from paramserve.coordinator.checkpointing.checkpoint_manager import CheckpointManager
from paramserve.coordinator.cluster_coordinator import ClusterCoordinator
from paramserve.coordinator.demos.digits import MLP, digits_split, worker_batches
from paramserve.coordinator.strategies.parameter_server import ParameterServerStrategy
from paramserve.coordinator.training.loops import fit

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import test modules

pytestmark = pytest.mark.timeout(180)


def step(batches, model, optimizer, accuracy, seen):
    x, y = next(batches)
    optimizer.zero_grad()
    outputs = model(x)
    nn.functional.cross_entropy(outputs, y).backward()
    optimizer.step()
    accuracy.update_state(outputs, y)
    seen.update_state(torch.ones(len(y)))
    return (outputs.argmax(-1) == y).sum(), len(y)


def test_metrics_updated_on_workers_count_on_the_coordinator(start_cluster, tmp_path):
    cluster = start_cluster(num_ps=2, num_workers=2)
    strategy = ParameterServerStrategy(cluster.spec)
    torch.manual_seed(0)
    with strategy.scope():
        model = MLP(32)
        optimizer = torch.optim.Adam(model.parameters(), lr=5e-3)
        accuracy, seen = metrics.Accuracy(), metrics.Mean("seen")
    try:
        with ClusterCoordinator(strategy) as coordinator:
            batches = iter(coordinator.create_per_worker_dataset(functools.partial(worker_batches, batch_size=16)))
            results = [
                coordinator.schedule(step, args=(batches, model, optimizer, accuracy, seen), steps=2) for _ in range(10)
            ]
            coordinator.join()
        assert float(seen._state.merged().weight) == 10 * 2 * 16, "every step of every worker counted once"
        correct = sum(int(r.fetch()[0]) for r in results)  # the last step of each closure
        assert 0.0 < float(accuracy.result()) <= 1.0
        assert float(accuracy._state.merged().weight) == 320
        assert correct <= float(accuracy._state.merged().mean_value)  # + the first steps' hits

        accuracy.reset_state()  # on the coordinator: the servers' sums go back to zero
        assert float(accuracy._state.merged().weight) == 0
        CheckpointManager(strategy, tmp_path).save(step=20)  # checkpoints hold the model, not metric state
        assert not any(name.startswith("metric.") for name in _saved_variables(tmp_path))
    finally:
        strategy.close()


def _saved_variables(directory):
    from paramserve.psserver.checkpoint import shard_files as checkpoint

    return set(checkpoint.read_manifest(checkpoint.resolve(directory)).variables)


def test_fit_reports_metric_objects_under_parameter_servers(start_cluster):
    cluster = start_cluster(num_ps=1, num_workers=2)
    strategy = ParameterServerStrategy(cluster.spec)
    torch.manual_seed(0)
    with strategy.scope():
        model = MLP(32)
        optimizer = torch.optim.Adam(model.parameters(), lr=5e-3)
    _, _, x_test, y_test = digits_split()
    try:
        history = fit(
            model,
            optimizer,
            nn.CrossEntropyLoss(reduction="none"),
            functools.partial(worker_batches, batch_size=32),
            epochs=2,
            steps_per_epoch=20,
            steps_per_execution=4,
            validation_data=(x_test, y_test),
            verbose=False,
            metrics=[metrics.Accuracy(), metrics.AUC(from_logits=True)],
        )
        assert history.history["val_accuracy"][-1] > 0.7
        assert history.history["auc"][-1] > 0.9 and history.history["val_auc"][-1] > 0.9
    finally:
        strategy.close()
