"""fit's loop and callbacks under the default strategy: resume, early stop, schedules, checkpoints."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from paramserve.coordinator.demos.digits import MLP, digits_split
from paramserve.coordinator.training.callbacks import (
    BackupAndRestore,
    Callback,
    EarlyStopping,
    LearningRateScheduler,
    ModelCheckpoint,
    ProgressBar,
    TensorBoard,
    improved,
)
from paramserve.coordinator.training.loops import evaluate, fit, predict
from paramserve.coordinator.training.step_metrics import resolve_metrics

LOSS = nn.CrossEntropyLoss(reduction="none")


@pytest.fixture(scope="module")
def digits():
    return digits_split()


def loader(digits, rows=512, batch_size=64):
    x, y, _, _ = digits
    return DataLoader(
        TensorDataset(x[:rows], y[:rows]),
        batch_size=batch_size,
        shuffle=True,
        drop_last=True,
        generator=torch.Generator().manual_seed(0),
    )


def model_and_optimizer(lr=5e-3, seed=0):
    torch.manual_seed(seed)
    model = MLP(32)
    return model, torch.optim.Adam(model.parameters(), lr=lr)


class RaiseAtEpoch(Callback):
    """Fault injection: raises from on_epoch_begin of ``epoch``."""

    def __init__(self, epoch: int):
        self.epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            raise RuntimeError(f"injected failure at epoch {epoch}")


class Record(Callback):
    """Records hooks; copies the weights at train begin and after each epoch."""

    def __init__(self):
        self.steps: list[int] = []
        self.begin_weights: dict | None = None
        self.epoch_weights: dict[int, dict] = {}

    def on_train_begin(self, logs=None):
        self.begin_weights = {k: v.clone() for k, v in self.state.model.state_dict().items()}

    def on_train_batch_end(self, step, logs=None):
        self.steps.append(step)

    def on_epoch_end(self, epoch, logs=None):
        self.epoch_weights[epoch] = {k: v.clone() for k, v in self.state.model.state_dict().items()}


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_fit_trains_and_validates_under_the_default_strategy(digits):
    _, _, x_test, y_test = digits
    model, optimizer = model_and_optimizer()

    history = fit(
        model, optimizer, LOSS, loader(digits, rows=1024), epochs=3, validation_data=(x_test, y_test), verbose=False
    )

    assert history.epoch == [0, 1, 2]
    assert set(history.history) == {"loss", "accuracy", "val_loss", "val_accuracy"}
    assert history.history["loss"][-1] < history.history["loss"][0]
    assert history.history["val_accuracy"][-1] >= 0.8
    assert evaluate(model, LOSS, (x_test, y_test), return_dict=True)["accuracy"] == pytest.approx(
        history.history["val_accuracy"][-1]
    )


def test_backup_and_restore_resumes_an_interrupted_fit_at_the_epoch_it_stopped(digits, tmp_path):
    backup = tmp_path / "backup"
    model, optimizer = model_and_optimizer()
    first = Record()
    with pytest.raises(RuntimeError, match="injected failure at epoch 2"):
        fit(
            model,
            optimizer,
            LOSS,
            loader(digits),
            epochs=4,
            callbacks=[BackupAndRestore(backup), first, RaiseAtEpoch(2)],
            verbose=False,
        )
    assert (backup / "backup.pt").exists(), "the backup must survive the failure"

    model, optimizer = model_and_optimizer(seed=1)  # a new process: fresh weights
    second = Record()
    history = fit(
        model, optimizer, LOSS, loader(digits), epochs=4, callbacks=[BackupAndRestore(backup), second], verbose=False
    )

    assert history.epoch == [2, 3]
    assert same_weights(second.begin_weights, first.epoch_weights[1]), "must resume from epoch 1's weights"
    assert optimizer.state_dict()["state"], "the optimizer's state must be restored too"
    assert second.steps[0] == 2 * len(loader(digits)) + 1, "the global step must carry on"
    assert not backup.exists(), "a completed fit deletes its backup"


def test_early_stopping_stops_when_val_loss_stops_improving(digits):
    _, _, x_test, y_test = digits
    model, _ = model_and_optimizer()
    frozen = torch.optim.SGD(model.parameters(), lr=0.0)  # val_loss never improves after epoch 0
    stopper = EarlyStopping(monitor="val_loss", patience=1)

    history = fit(
        model,
        frozen,
        LOSS,
        loader(digits, rows=128),
        epochs=10,
        validation_data=(x_test, y_test),
        callbacks=[stopper],
        verbose=False,
    )

    assert history.epoch == [0, 1, 2]
    assert (stopper.best_epoch, stopper.stopped_epoch) == (0, 2)


def test_early_stopping_restores_the_best_weights(digits):
    _, _, x_test, y_test = digits
    model, _ = model_and_optimizer()
    diverging = torch.optim.SGD(model.parameters(), lr=50.0)
    stopper = EarlyStopping(patience=0, restore_best_weights=True)
    record = Record()

    fit(
        model,
        diverging,
        LOSS,
        loader(digits, rows=128),
        epochs=6,
        validation_data=(x_test, y_test),
        callbacks=[record, stopper],
        verbose=False,
    )

    assert stopper.stopped_epoch is not None and stopper.best_epoch < stopper.stopped_epoch
    assert same_weights(model.state_dict(), record.epoch_weights[stopper.best_epoch])


def test_early_stopping_names_the_fix_when_the_monitored_value_is_missing(digits):
    model, optimizer = model_and_optimizer()
    with pytest.raises(KeyError, match="pass validation_data"):
        fit(model, optimizer, LOSS, loader(digits, rows=128), callbacks=[EarlyStopping()], verbose=False)


@pytest.mark.parametrize(
    ("value", "best", "maximize", "expected"),
    [(1.0, None, False, True), (0.9, 1.0, False, True), (0.95, 1.0, False, False), (1.1, 1.0, True, True)],
)
def test_improved_is_strict_by_min_delta(value, best, maximize, expected):
    assert improved(value, best, min_delta=0.05 if value == 0.95 else 0.0, maximize=maximize) is expected


def test_learning_rate_scheduler_sets_every_param_group_and_logs_the_rate(digits):
    model, optimizer = model_and_optimizer(lr=0.1)

    history = fit(
        model,
        optimizer,
        LOSS,
        loader(digits, rows=128),
        epochs=3,
        callbacks=[LearningRateScheduler(lambda epoch, lr: 0.1 * 0.5**epoch)],
        verbose=False,
    )

    assert history.history["lr"] == pytest.approx([0.1, 0.05, 0.025])
    assert [group["lr"] for group in optimizer.param_groups] == pytest.approx([0.025])


def test_model_checkpoint_writes_loadable_files_and_keeps_the_last_ones(digits, tmp_path):
    model, optimizer = model_and_optimizer()

    fit(
        model,
        optimizer,
        LOSS,
        loader(digits, rows=128),
        epochs=3,
        callbacks=[ModelCheckpoint(tmp_path / "epoch-{epoch:04d}.pt", keep=2)],
        verbose=False,
    )

    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint", "epoch-0002.pt", "epoch-0003.pt"]
    saved = torch.load(tmp_path / "epoch-0003.pt", weights_only=True)
    restored, restored_optimizer = model_and_optimizer(seed=7)
    restored.load_state_dict(saved["model"])
    restored_optimizer.load_state_dict(saved["optimizer"])
    assert same_weights(restored.state_dict(), model.state_dict())
    assert (saved["epoch"], saved["step"]) == (3, 6)


def test_steps_per_execution_calls_batch_callbacks_once_per_execution(digits):
    model, optimizer = model_and_optimizer()
    record = Record()

    fit(
        model,
        optimizer,
        LOSS,
        loader(digits, rows=448),
        epochs=2,
        steps_per_execution=3,
        callbacks=[record],
        verbose=False,
    )

    assert record.steps == [3, 6, 7, 10, 13, 14]  # 7 batches an epoch: 3 + 3 + 1


def test_steps_per_epoch_iterates_on_across_epochs_and_restarts_the_data(digits):
    model, optimizer = model_and_optimizer()
    record = Record()

    history = fit(
        model, optimizer, LOSS, loader(digits, rows=192), epochs=3, steps_per_epoch=2, callbacks=[record], verbose=False
    )  # 3 batches of data, 6 steps

    assert history.epoch == [0, 1, 2] and record.steps == [1, 2, 3, 4, 5, 6]


def test_metric_functions_are_averaged_over_examples(digits):
    _, _, x_test, y_test = digits
    model, _ = model_and_optimizer()

    def always_one(outputs, targets):
        return torch.ones(len(targets))

    results = evaluate(
        model,
        LOSS,
        DataLoader(TensorDataset(x_test, y_test), batch_size=50),
        metrics={"one": always_one, "acc": lambda o, t: (o.argmax(-1) == t).float()},
        return_dict=True,
    )

    assert results["one"] == 1.0
    assert results["acc"] == pytest.approx(evaluate(model, LOSS, (x_test, y_test), return_dict=True)["accuracy"])


def test_predict_concatenates_every_batch(digits):
    _, _, x_test, _ = digits
    model, _ = model_and_optimizer()
    with torch.no_grad():
        expected = model(x_test)
    assert torch.allclose(predict(model, DataLoader(TensorDataset(x_test), batch_size=100)), expected, atol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "error", "fix"),
    [
        ({"loss_fn": nn.CrossEntropyLoss()}, ValueError, "reduction='none'"),
        ({"loss_fn": lambda o, t: nn.functional.cross_entropy(o, t)}, ValueError, "one loss per example"),
        ({"epochs": 0}, ValueError, "epochs must be >= 1"),
        ({"steps_per_execution": 0}, ValueError, "steps_per_execution must be >= 1"),
    ],
)
def test_bad_arguments_name_the_fix(digits, kwargs, error, fix):
    model, optimizer = model_and_optimizer()
    arguments = {"loss_fn": LOSS, **kwargs}
    with pytest.raises(error, match=fix):
        fit(model, optimizer, arguments.pop("loss_fn"), loader(digits, rows=128), verbose=False, **arguments)


def test_a_pair_of_tensors_as_train_data_names_the_data_loader(digits):
    x, y, _, _ = digits
    model, optimizer = model_and_optimizer()
    with pytest.raises(TypeError, match="DataLoader"):
        fit(model, optimizer, LOSS, (x, y), verbose=False)


def test_unnamed_metric_functions_and_unknown_names_are_refused():
    with pytest.raises(ValueError, match="metrics=\\{'name': fn\\}"):
        resolve_metrics([lambda o, t: o])
    with pytest.raises(ValueError, match="accuracy"):
        resolve_metrics(["f1"])


def test_accuracy_refuses_regression_targets(digits):
    model, optimizer = model_and_optimizer()
    data = [(torch.randn(8, 64), torch.randn(8, 10))]
    with pytest.raises(TypeError, match="metrics=\\(\\)"):
        fit(model, optimizer, nn.MSELoss(reduction="none"), data, verbose=False)
    history = fit(model, optimizer, nn.MSELoss(reduction="none"), data, metrics=(), verbose=False)
    assert list(history.history) == ["loss"]


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is not None, reason="tensorboard is installed")
def test_tensorboard_without_the_package_names_the_install_command(tmp_path):
    with pytest.raises(ImportError, match="pip install tensorboard"):
        TensorBoard(tmp_path)


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="needs tensorboard")
def test_tensorboard_writes_event_files(digits, tmp_path):
    model, optimizer = model_and_optimizer()
    fit(model, optimizer, LOSS, loader(digits, rows=128), epochs=2, callbacks=[TensorBoard(tmp_path)], verbose=False)
    assert list((pathlib.Path(tmp_path) / "train").glob("events.out.tfevents.*"))


def test_a_server_optimizer_without_its_strategy_names_the_fix(digits):
    from paramserve.worker.layers import ServerOptimizer

    model, _ = model_and_optimizer()
    with pytest.raises(ValueError, match="strategy="):
        fit(model, ServerOptimizer([], "Adam", {"lr": 1e-3}), LOSS, loader(digits, rows=128), verbose=False)


@pytest.mark.parametrize(
    ("train_data", "steps_per_epoch", "error", "fix"),
    [
        (lambda ctx: iter(()), None, ValueError, "pass steps_per_epoch="),
        ([(torch.zeros(1, 64), torch.zeros(1).long())], 10, TypeError, "dataset function"),
    ],
)
def test_parameter_server_arguments_name_the_fix(train_data, steps_per_epoch, error, fix):
    from paramserve.coordinator import ClusterSpec, ParameterServerStrategy

    strategy = ParameterServerStrategy(ClusterSpec(("127.0.0.1:9",), ("127.0.0.1:10",)))  # nothing is dialled
    try:
        with pytest.raises(error, match=fix):
            strategy.step_runner(lambda batch, size: torch.zeros(2), train_data, steps_per_epoch=steps_per_epoch)
    finally:
        strategy.close()


def test_the_progress_bar_shows_each_epoch_with_its_logs(digits):
    import io

    out = io.StringIO()
    model, optimizer = model_and_optimizer()
    fit(model, optimizer, LOSS, loader(digits, rows=128), epochs=2, callbacks=[ProgressBar(file=out)])
    text = out.getvalue()
    assert "epoch 1/2" in text and "epoch 2/2" in text and "loss=" in text


def test_element_wise_losses_are_averaged_per_example():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    x, y = torch.randn(10, 4), torch.randn(10, 3)
    loss = evaluate(model, nn.MSELoss(reduction="none"), (x, y), metrics=())  # Keras: the loss alone
    with torch.no_grad():
        assert loss == pytest.approx(float(nn.functional.mse_loss(model(x), y)), rel=1e-6)


class ReportingRunner:
    """A StepRunner double: each step trains 10 examples at loss 0.5; records what fit reports."""

    def __init__(self) -> None:
        self.totals: torch.Tensor | None = None
        self.reports: list[tuple[int, dict[str, float], int]] = []

    def prepare(self) -> None: ...

    def epoch_length(self) -> None:
        return None

    def begin_epoch(self) -> None:
        self.totals = None

    def run(self, steps: int) -> int:
        step = torch.tensor([5.0, 10.0], dtype=torch.float64) * steps
        self.totals = step if self.totals is None else self.totals + step
        return steps

    def running_totals(self) -> torch.Tensor | None:
        return self.totals

    def end_epoch(self) -> torch.Tensor | None:
        return self.totals

    def report(self, step: int, logs, examples: int) -> None:
        self.reports.append((step, dict(logs), examples))

    def close(self) -> None: ...


def test_fit_reports_its_step_loss_and_examples_so_far_after_every_execution_and_epoch():
    from paramserve.coordinator.training.callbacks import TrainingState
    from paramserve.coordinator.training.loops import Loop, train

    runner = ReportingRunner()
    model = nn.Linear(2, 2)
    state = TrainingState(model, None, None, epochs=2, steps_per_epoch=4)
    train(runner, state, Loop(2, 4, 2, LOSS, (), None, None, (), False))  # type: ignore[arg-type]
    loss = {"loss": 0.5}
    assert runner.reports == [
        (2, loss, 20),
        (4, loss, 40),
        (4, loss, 40),  # the epoch's end
        (6, loss, 60),  # examples count across epochs
        (8, loss, 80),
        (8, loss, 80),
    ]
    assert state.examples == 80


class ScriptedCoordinator:
    """What ParameterServerStepRunner asks of a ClusterCoordinator; its closures finish when told."""

    def __init__(self) -> None:
        from paramserve.coordinator.remote_value import RemoteValue

        self.values: list = []
        self.reports: list = []
        self._make = lambda: RemoteValue(f"c{len(self.values)}", "steps")

    def create_per_worker_dataset(self, dataset_fn):
        return []

    def schedule(self, fn, args=(), steps=1):
        self.values.append(self._make())
        return self.values[-1]

    def join(self) -> None:
        for value in self.values:
            if not value.done():
                value.set_result(torch.tensor([1.0, 4.0], dtype=torch.float64))

    def report(self, step, **values):
        self.reports.append((step, values))


def test_parameter_server_running_totals_are_the_closures_finished_so_far_in_order():
    from paramserve.coordinator.errors import ClosureError
    from paramserve.coordinator.strategies.parameter_server_training import ParameterServerStepRunner

    coordinator = ScriptedCoordinator()
    runner = ParameterServerStepRunner(None, lambda batch, size: None, lambda ctx: [], coordinator)  # type: ignore[arg-type]
    runner.begin_epoch()
    for _ in range(4):
        runner.run(1)
    assert runner.running_totals() is None, "nothing finished: nothing waited for"
    coordinator.values[0].set_result(torch.tensor([2.0, 8.0], dtype=torch.float64))
    coordinator.values[2].set_result(torch.tensor([3.0, 8.0], dtype=torch.float64))
    assert runner.running_totals().tolist() == [2.0, 8.0]  # in order: the second has not finished
    coordinator.values[1].set_error(ClosureError(remote_type="ValueError", message="bad", function_name="steps"))
    assert runner.running_totals().tolist() == [2.0, 8.0], "a failed closure is left for the epoch's end"
    runner.report(3, {"loss": 0.25, "accuracy": 0.5}, 8)
    assert coordinator.reports == [(3, {"loss": 0.25, "samples": 8, "accuracy": 0.5})]
    with pytest.raises(ClosureError):
        runner.end_epoch()
