"""Metrics on torchmetrics that aggregate under every strategy, in custom loops and in fit
(issue 11, items 3 and 10)."""

from __future__ import annotations

import pytest
import torch
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from paramserve.coordinator import metrics
from paramserve.coordinator.demos.digits import MLP, digits_split
from paramserve.coordinator.strategies import MirroredStrategy, OneDeviceStrategy, get_strategy, metric_states
from paramserve.coordinator.training.loops import evaluate, fit

LOSS = nn.CrossEntropyLoss(reduction="none")


def batches(rows=256, batch=64):
    x, y, _, _ = digits_split()
    return DataLoader(TensorDataset(x[:rows], y[:rows]), batch_size=batch)


def reference(model, data):
    """Accuracy and AUC (of 'is it a 0') over all of ``data`` on one device, with torchmetrics."""
    accuracy, auc = torchmetrics.MeanMetric(), torchmetrics.classification.BinaryAUROC(thresholds=200)
    with torch.no_grad():
        for x, y in data:
            outputs = model(x)
            accuracy.update((outputs.argmax(-1) == y).double())
            auc.update(outputs.softmax(-1)[:, 0], (y == 0).long())
    return float(accuracy.compute()), float(auc.compute())


@pytest.mark.parametrize(
    "make",
    [get_strategy, lambda: OneDeviceStrategy("cpu"), lambda: MirroredStrategy(["cpu:0", "cpu:1"])],
    ids=["default", "one_device", "mirrored"],
)
def test_metrics_updated_in_every_replica_count_when_read(make):
    strategy = make()
    try:
        torch.manual_seed(0)
        with strategy.scope():
            model = MLP(16)
            accuracy, auc, seen = metrics.Accuracy(), metrics.AUC(), metrics.Mean("seen")

        def step(x, y):  # the seed's custom loop: update_state inside strategy.run
            with torch.no_grad():
                outputs = model(x)
            accuracy.update_state(outputs, y)
            auc.update_state(outputs.softmax(-1)[:, 0], (y == 0).long())
            seen.update_state(torch.ones(len(y)))

        for batch in strategy.experimental_distribute_dataset(batches()):
            strategy.run(step, args=batch)
        expected_accuracy, expected_auc = reference(model, batches())
        assert float(accuracy.result()) == pytest.approx(expected_accuracy)
        assert float(auc.result()) == pytest.approx(expected_auc)
        assert float(seen.result()) == 1.0 and float(seen._state.merged().weight) == 256
        seen.reset_state()
        assert float(seen._state.merged().weight) == 0
    finally:
        strategy.close()


def test_a_mirrored_metric_keeps_a_copy_per_replica():
    strategy = MirroredStrategy(["cpu:0", "cpu:1"])
    try:
        with strategy.scope():
            mean = metrics.Mean()
        strategy.run(lambda: mean.update_state(torch.ones(3)))
        assert [float(copy.weight) for copy in mean._state.copies] == [3.0, 3.0]
        assert float(mean._state.merged().weight) == 6.0
    finally:
        strategy.close()


def test_fit_takes_metric_objects_torchmetrics_names_and_functions():
    torch.manual_seed(0)
    model = MLP(16)
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-3)
    x, y, _, _ = digits_split()
    f1 = torchmetrics.classification.MulticlassF1Score(10, average="micro")

    def correct(outputs, targets):
        return (outputs.argmax(-1) == targets).float()

    history = fit(
        model,
        optimizer,
        LOSS,
        batches(),
        epochs=2,
        verbose=False,
        validation_data=(x[:200], y[:200]),
        metrics=["accuracy", metrics.AUC(name="auc_of_0", from_logits=True), f1, correct],
    )
    for name in ("accuracy", "auc_of_0", "multiclass_f1_score", "correct"):
        assert name in history.history and f"val_{name}" in history.history
    assert history.history["val_accuracy"] == pytest.approx(history.history["val_correct"])
    assert history.history["val_accuracy"] == pytest.approx(history.history["val_multiclass_f1_score"])
    results = evaluate(model, LOSS, (x[:200], y[:200]), metrics=[metrics.Accuracy()], return_dict=True)
    assert results["accuracy"] == pytest.approx(history.history["val_accuracy"][-1])


def test_metrics_whose_state_does_not_add_up_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="thresholds=200"):
        fit(
            MLP(16),
            torch.optim.SGD(MLP(16).parameters(), lr=0.1),
            LOSS,
            batches(),
            verbose=False,
            metrics=[torchmetrics.classification.BinaryAUROC()],
        )


def test_torchmetrics_still_says_how_each_state_merges():
    """metric_states.additive_states reads torchmetrics' private ``_reductions`` (no public accessor):
    a release that drops or renames it must fail here, not as a wrong sum in training."""
    from torchmetrics.utilities.data import dim_zero_sum

    for metric in (torchmetrics.MeanMetric(), torchmetrics.classification.BinaryAUROC(thresholds=10)):
        assert set(metric._reductions) == set(metric.metric_state)
        assert all(metric._reductions[name] is dim_zero_sum for name in metric_states.additive_states(metric))


def test_keras_argument_order_gives_the_same_auc_and_accuracy():
    """The tutorial's update_state(labels, predictions) (issue 22, item 8): an AUC of 1.0 for a
    perfect classifier, not the 0.54 torchmetrics' order made of it."""
    labels = torch.tensor([0, 0, 1, 1, 0, 1])
    probabilities = torch.tensor([0.1, 0.3, 0.8, 0.9, 0.2, 0.7])
    scores = torch.tensor([[2.0, 0.0], [1.0, 0.5], [0.0, 3.0], [0.2, 0.1], [0.9, 0.1], [0.0, 1.0]])
    results = []
    for keras in (False, True):
        auc, accuracy = metrics.AUC(), metrics.SparseCategoricalAccuracy()
        auc.update_state(*((labels, probabilities) if keras else (probabilities, labels)))
        accuracy.update_state(*((labels, scores) if keras else (scores, labels)))
        results.append((float(auc.result()), float(accuracy.result())))
    assert results[0] == results[1]
    assert results[0][0] == pytest.approx(1.0) and results[0][1] == pytest.approx(5 / 6)


def test_the_order_is_left_alone_when_dtypes_cannot_tell():
    predictions, targets = torch.tensor([0.9, 0.2]), torch.tensor([1.0, 0.0])
    assert metrics.torch_order(predictions, targets) == (predictions, targets)
    assert metrics.torch_order(targets.long(), predictions)[0] is predictions


@pytest.fixture
def a_process_group_in_this_process():
    """A one-process gloo group, as a program that also uses torch.distributed has; its
    all_gather refuses to run, so a metric that gathers where it should not fails the test."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    real = dist.all_gather

    def refuse(*args, **kwargs):
        raise AssertionError("a metric of an in-process strategy gathered over the process group")

    dist.all_gather = refuse
    try:
        yield
    finally:
        dist.all_gather = real
        dist.destroy_process_group()


def test_in_process_metrics_never_gather_over_a_process_group_the_program_has(a_process_group_in_this_process):
    """torchmetrics reads its sync switch when the metric is built; setting the attribute later
    did nothing, so on a GPU machine's NCCL group these gathers failed (found on an H200)."""
    from paramserve.coordinator.training.step_metrics import resolve_metrics

    with OneDeviceStrategy("cpu").scope():
        mean = metrics.Mean()
    mean.update_state(torch.tensor([2.0, 4.0]))
    assert mean.result().item() == 3.0

    (accuracy,) = resolve_metrics(["accuracy"])
    flat = accuracy.stats(torch.tensor([[0.1, 0.9], [0.8, 0.2]]), torch.tensor([1, 1]))
    assert accuracy.value(flat) == 0.5


def test_an_nccl_group_carries_cpu_tensors_over_gloo():
    from paramserve.coordinator.strategies.multi_worker_cluster import chosen_backend, process_group_backend

    assert process_group_backend("nccl") == "cpu:gloo,cuda:nccl"
    assert process_group_backend("gloo") == "gloo"
    for backend in ("nccl", "gloo"):
        assert chosen_backend(process_group_backend(backend)) == backend
