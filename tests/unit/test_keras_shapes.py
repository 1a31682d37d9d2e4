"""fit, evaluate and callbacks take the shapes a Keras user writes (issue 11, items 9, 10 and 11)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from paramserve.coordinator.demos.digits import MLP, digits_split
from paramserve.coordinator.strategies import get_strategy
from paramserve.coordinator.training.callbacks import (
    Callback,
    LearningRateScheduler,
    ModelCheckpoint,
    TensorBoard,
    TrainingState,
    latest_checkpoint,
)
from paramserve.coordinator.training.loops import evaluate, fit

LOSS = nn.CrossEntropyLoss(reduction="none")


@pytest.fixture(scope="module")
def arrays():
    x, y, x_test, y_test = digits_split()
    return x.numpy()[:320], y.numpy()[:320], x_test, y_test


def build(lr=1e-3):
    torch.manual_seed(0)
    model = MLP(16)
    return model, torch.optim.Adam(model.parameters(), lr=lr)


def decay(epoch):  # the seed's schedule: epoch only
    if epoch < 1:
        return 1e-3
    if epoch < 2:
        return 1e-4
    return 1e-5


def test_a_schedule_of_the_epoch_alone_or_of_epoch_and_rate(arrays):
    x, y, _, _ = arrays
    model, optimizer = build()
    history = fit(model, optimizer, LOSS, x, y, epochs=3, verbose=False, callbacks=[LearningRateScheduler(decay)])
    assert history.history["lr"] == pytest.approx([1e-3, 1e-4, 1e-5])
    history = fit(
        model,
        optimizer,
        LOSS,
        x,
        y,
        epochs=2,
        verbose=False,
        callbacks=[LearningRateScheduler(lambda epoch, lr: lr * 0.5)],
    )
    assert history.history["lr"] == pytest.approx([5e-6, 2.5e-6])


def test_a_type_error_inside_the_schedule_is_not_hidden(arrays):
    x, y, _, _ = arrays

    def broken(epoch):
        return "0.1" + epoch  # a TypeError of the schedule itself

    model, optimizer = build()
    with pytest.raises(TypeError, match="str"):
        fit(model, optimizer, LOSS, x, y, verbose=False, callbacks=[LearningRateScheduler(broken)])


def test_fit_on_arrays_with_batch_size_and_validation_split(arrays):
    x, y, _, _ = arrays
    model, optimizer = build(lr=5e-3)
    seen = Seen()
    history = fit(
        model, optimizer, LOSS, x, y, batch_size=64, validation_split=0.25, epochs=2, verbose=False, callbacks=[seen]
    )
    assert seen.steps == [math.ceil(240 / 64) * (epoch + 1) for epoch in range(2)]
    assert {"loss", "accuracy", "val_loss", "val_accuracy"} <= set(history.history)
    assert seen.model is model, "callback.model, as in Keras"


class Seen(Callback):
    def __init__(self):
        self.steps = []

    def on_epoch_end(self, epoch, logs=None):
        self.steps.append(self.state.step)


def test_evaluate_returns_what_keras_returns(arrays):
    x, y, x_test, y_test = arrays
    model, _ = build()
    loss = evaluate(model, LOSS, x_test, y_test, metrics=())
    loss_and_accuracy = evaluate(model, LOSS, x_test.numpy(), y_test.numpy(), batch_size=50)
    as_dict = evaluate(model, LOSS, (x_test, y_test), return_dict=True)
    assert isinstance(loss, float) and loss == pytest.approx(as_dict["loss"])
    assert loss_and_accuracy == pytest.approx([as_dict["loss"], as_dict["accuracy"]])


def test_model_checkpoint_formats_the_filepath_and_latest_checkpoint_finds_the_newest(arrays, tmp_path):
    x, y, _, _ = arrays
    model, optimizer = build()
    assert latest_checkpoint(tmp_path) is None
    fit(
        model,
        optimizer,
        LOSS,
        x,
        y,
        epochs=3,
        verbose=False,
        callbacks=[ModelCheckpoint(tmp_path / "ckpt-{epoch:02d}.pt", save_weights_only=True)],
    )
    assert sorted(p.name for p in tmp_path.glob("*.pt")) == ["ckpt-01.pt", "ckpt-02.pt", "ckpt-03.pt"]
    assert latest_checkpoint(tmp_path) == str(tmp_path / "ckpt-03.pt")
    fresh = MLP(16)
    fresh.load_state_dict(torch.load(latest_checkpoint(tmp_path), weights_only=True))  # weights only: a state_dict
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))


def test_save_best_only_writes_when_the_monitored_value_improves(tmp_path):
    model, optimizer = build()
    callback = ModelCheckpoint(tmp_path / "best-{epoch}.pt", monitor="val_accuracy", save_best_only=True)
    callback.bind(TrainingState(model, optimizer, get_strategy(), epochs=4))
    for epoch, accuracy in enumerate([0.5, 0.7, 0.6, 0.9]):
        callback.on_epoch_end(epoch, {"val_accuracy": accuracy, "val_loss": 1.0})
    assert sorted(p.name for p in tmp_path.glob("*.pt")) == ["best-1.pt", "best-2.pt", "best-4.pt"]
    saved = torch.load(tmp_path / "best-4.pt", weights_only=True)
    assert set(saved) == {"model", "optimizer", "epoch", "step"}, "not weights only: the training state"


@pytest.mark.parametrize("keep", [1])
def test_keep_bounds_the_checkpoints_kept(arrays, tmp_path, keep):
    x, y, _, _ = arrays
    model, optimizer = build()
    fit(
        model,
        optimizer,
        LOSS,
        x,
        y,
        epochs=3,
        verbose=False,
        callbacks=[ModelCheckpoint(tmp_path / "ckpt-{epoch}.pt", keep=keep)],
    )
    assert [p.name for p in tmp_path.glob("*.pt")] == ["ckpt-3.pt"]


def test_tensorboard_writes_keras_runs_and_tags(arrays, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    x, y, _, _ = arrays
    model, optimizer = build()
    fit(
        model,
        optimizer,
        LOSS,
        np.asarray(x),
        np.asarray(y),
        epochs=2,
        validation_split=0.2,
        verbose=False,
        callbacks=[TensorBoard(tmp_path)],
    )
    tags = {}
    for run in ("train", "validation"):
        events = EventAccumulator(str(tmp_path / run))
        events.Reload()
        tags[run] = set(events.Tags()["scalars"])
        assert [e.step for e in events.Scalars("epoch_loss")] == [0, 1]
    assert tags == {"train": {"epoch_loss", "epoch_accuracy"}, "validation": {"epoch_loss", "epoch_accuracy"}}
