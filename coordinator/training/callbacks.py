"""Callbacks of ``fit``: Keras' callbacks, in PyTorch idiom.

A callback sees the training through a :class:`TrainingState` (its
``state`` attribute, set by ``fit`` before ``on_train_begin``): the model, the
optimizer, the strategy, the epoch and the global step. It stops training by
setting ``state.stop_training``. Hooks, in the order ``fit`` calls them::

    on_train_begin(logs)
      on_epoch_begin(epoch, logs)
        on_train_batch_end(step, logs)    # once per execution of steps_per_execution steps
      on_epoch_end(epoch, logs)           # logs: loss, metrics, val_* after validation
    on_train_end(logs)                    # only when training completed (not on an error)
    close()                               # always: release files, bars, writers

Epochs count from 0; ``step`` is the global step count (steps run so far, in
all epochs). Under ParameterServerStrategy ``step`` counts steps *scheduled*
and batch ``logs`` are empty (the closures' results are fetched at the epoch's
end, after ``join``, so epoch-end callbacks see every step applied).

Every file a callback writes is written atomically (temporary file, fsync,
``os.replace``): a crash leaves the previous file or the new one, never half of one.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import pathlib
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "BackupAndRestore",
    "Callback",
    "CallbackList",
    "EarlyStopping",
    "History",
    "LearningRateScheduler",
    "ModelCheckpoint",
    "ProgressBar",
    "TensorBoard",
    "TrainingState",
]

log = logging.getLogger(__name__)

Logs = dict[str, float]


@dataclass
class TrainingState:
    """What callbacks see of a running ``fit`` (Keras' ``callback.model``)."""

    model: nn.Module
    optimizer: Any
    strategy: Any
    epochs: int
    steps_per_epoch: int | None = None
    epoch: int = 0
    """The current epoch (from 0)."""
    step: int = 0
    """Steps run so far in all epochs."""
    initial_epoch: int = 0
    """The epoch training starts at; BackupAndRestore raises it when it resumes."""
    stop_training: bool = False
    """Set it to end training after the current epoch."""

    @property
    def is_chief(self) -> bool:
        """Whether this process writes files: always, except on the non-chief
        processes of a multi-process strategy (``strategy.is_chief``)."""
        return bool(self.strategy.is_chief)


class Callback:
    """Base class: override the hooks you need; ``self.state`` is set by ``fit``."""

    state: TrainingState

    def bind(self, state: TrainingState) -> None:
        self.state = state

    def on_train_begin(self, logs: Logs | None = None) -> None: ...

    def on_train_end(self, logs: Logs | None = None) -> None: ...

    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None: ...

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None: ...

    def on_train_batch_end(self, step: int, logs: Logs | None = None) -> None: ...

    def close(self) -> None:
        """Releases what the callback holds; called once at the end of fit, also after an error."""


class CallbackList:
    """Calls each hook on every callback, in order."""

    def __init__(self, callbacks: Iterable[Callback], state: TrainingState):
        self.callbacks = list(callbacks)
        for callback in self.callbacks:
            if not isinstance(callback, Callback):
                raise TypeError(f"callbacks must be Callback instances, got {type(callback).__name__}: subclass Callback")
            callback.bind(state)

    def on_train_begin(self, logs: Logs) -> None:
        for callback in self.callbacks:
            callback.on_train_begin(logs)

    def on_train_end(self, logs: Logs) -> None:
        for callback in self.callbacks:
            callback.on_train_end(logs)

    def on_epoch_begin(self, epoch: int, logs: Logs) -> None:
        for callback in self.callbacks:
            callback.on_epoch_begin(epoch, logs)

    def on_epoch_end(self, epoch: int, logs: Logs) -> None:
        for callback in self.callbacks:
            callback.on_epoch_end(epoch, logs)

    def on_train_batch_end(self, step: int, logs: Logs) -> None:
        for callback in self.callbacks:
            callback.on_train_batch_end(step, logs)

    def close(self) -> None:
        for callback in self.callbacks:
            try:
                callback.close()
            except Exception:  # noqa: BLE001 - one failing close must not skip the others
                log.exception("closing %s failed", type(callback).__name__)


# ------------------------------------------------------------------ History and progress


class History(Callback):
    """Records each epoch's logs: ``history["loss"][i]`` is the loss of epoch ``epoch[i]``.
    ``fit`` adds one (last) and returns it."""

    def __init__(self) -> None:
        self.epoch: list[int] = []
        self.history: dict[str, list[float]] = {}

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        self.epoch.append(epoch)
        for key, value in (logs or {}).items():
            self.history.setdefault(key, []).append(value)


class ProgressBar(Callback):
    """A tqdm bar per epoch (on stderr) with the running loss and metrics; ``fit(verbose=True)`` adds one."""

    def __init__(self, file: Any = None):
        self._file = file
        self._bar: Any = None
        self._last_step = 0

    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None:
        from tqdm import tqdm

        self.close()
        self._last_step = self.state.step
        self._bar = tqdm(total=self.state.steps_per_epoch, unit="step", desc=f"epoch {epoch + 1}/{self.state.epochs}",
                         file=self._file or sys.stderr, leave=True)

    def on_train_batch_end(self, step: int, logs: Logs | None = None) -> None:
        if self._bar is None:
            return
        self._bar.update(step - self._last_step)
        self._last_step = step
        if logs:
            self._bar.set_postfix(_format(logs), refresh=False)

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if self._bar is not None and logs:
            self._bar.set_postfix(_format(logs))
        self.close()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _format(logs: Mapping[str, float]) -> dict[str, str]:
    return {key: f"{value:.4g}" for key, value in logs.items()}


# ------------------------------------------------------------------ checkpoints


class ModelCheckpoint(Callback):
    """Saves the model and optimizer every ``save_every_epochs`` epochs, keeping the last ``keep``.

    Where and how is the strategy's (``strategy.training_checkpoints``): in-process
    strategies write ``directory/epoch-<NNNN>.pt`` (NNNN: epochs completed) atomically with
    torch.save, ``torch.load(path)`` giving ``{"model": state_dict, "optimizer": state_dict,
    "epoch": int, "step": int}``; ParameterServerStrategy writes CheckpointManager checkpoints
    in ``directory`` (``extra["epoch"]`` holds the epochs completed), restored with
    ``CheckpointManager(strategy, directory).restore_or_initialize()``.
    Under a multi-process strategy only the chief writes.
    """

    def __init__(self, directory: str | os.PathLike[str], save_every_epochs: int = 1, keep: int = 3):
        if save_every_epochs < 1:
            raise ValueError(f"save_every_epochs must be >= 1, got {save_every_epochs}")
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.directory = pathlib.Path(directory)
        self.save_every_epochs = save_every_epochs
        self.keep = keep

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        completed = epoch + 1
        if completed % self.save_every_epochs or not self.state.is_chief:
            return
        checkpoints = self.state.strategy.training_checkpoints(self.directory, self.keep)
        path = checkpoints.save(f"epoch-{completed:04d}", self.state.model, self.state.optimizer,
                                _progress(self.state, completed))
        log.info("checkpoint of epoch %d written to %s", completed, path)


class BackupAndRestore(Callback):
    """Makes an interrupted ``fit`` resume where it stopped (Keras' BackupAndRestore).

    At each epoch's end it backs up the model, the optimizer, the epochs
    completed and the global step into ``backup_dir`` (atomically, in the strategy's
    format: ``backup.pt`` for in-process strategies, a checkpoint of every variable
    for ParameterServerStrategy); at train begin it restores the backup, if there is
    one, and training resumes at the epoch after the last one backed up. When training
    completes the backup is deleted.

    Under ParameterServerStrategy the backup can only be restored before the variables
    exist (a new coordinator process). Restarted in a process whose variables already
    exist, training resumes at the backed-up epoch with the variables' current values.
    Under a multi-process strategy the chief writes the backup and every process
    restores it (``backup_dir`` must be on a filesystem they share).
    """

    _NAME = "backup"

    def __init__(self, backup_dir: str | os.PathLike[str]):
        self.backup_dir = pathlib.Path(backup_dir)

    def on_train_begin(self, logs: Logs | None = None) -> None:
        checkpoints = self._checkpoints()
        latest = checkpoints.latest()
        if latest is None:
            return
        extra = checkpoints.restore(latest, self.state.model, self.state.optimizer)
        self.state.initial_epoch, self.state.step = int(extra.get("epoch", 0)), int(extra.get("step", 0))
        log.info("resuming at epoch %d (step %d) from the backup in %s", self.state.initial_epoch, self.state.step,
                 self.backup_dir)

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if self.state.is_chief:
            self._checkpoints().save(self._NAME, self.state.model, self.state.optimizer, _progress(self.state, epoch + 1))

    def on_train_end(self, logs: Logs | None = None) -> None:
        if self.state.is_chief:
            self._checkpoints().clear()

    def _checkpoints(self) -> Any:
        return self.state.strategy.training_checkpoints(self.backup_dir, keep=1)


def _progress(state: TrainingState, epochs_completed: int) -> dict[str, int]:
    return {"epoch": epochs_completed, "step": state.step}


# ------------------------------------------------------------------ learning rate and stopping


class LearningRateScheduler(Callback):
    """Sets the learning rate to ``schedule(epoch, lr)`` at each epoch's begin (epoch from 0,
    ``lr`` the current rate) and logs it as ``lr``. The strategy applies it
    (``strategy.set_learning_rate``): every ``param_groups`` entry of a torch optimizer, or
    the parameter servers' optimizer for its variables.
    """

    def __init__(self, schedule: Callable[[int, float], float]):
        self.schedule = schedule

    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None:
        lr = float(self.schedule(epoch, self.current_lr()))
        if not math.isfinite(lr) or lr < 0:
            raise ValueError(f"the schedule returned learning rate {lr} for epoch {epoch}: return a finite rate >= 0")
        self.state.strategy.set_learning_rate(self.state.optimizer, lr)

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if logs is not None:
            logs["lr"] = self.current_lr()

    def current_lr(self) -> float:
        return self.state.strategy.learning_rate(self.state.optimizer)


class EarlyStopping(Callback):
    """Stops training when ``monitor`` has not improved by more than ``min_delta`` for ``patience`` epochs.

    ``mode``: "min", "max", or "auto" (max for names with "acc", else min).
    ``restore_best_weights``: at the stop (or the end), load the best epoch's
    model weights (in-process strategies only).
    Raises KeyError at the first epoch end when the logs have no ``monitor``.
    """

    def __init__(self, monitor: str = "val_loss", patience: int = 0, min_delta: float = 0.0, mode: str = "auto",
                 restore_best_weights: bool = False):
        if patience < 0:
            raise ValueError(f"patience must be >= 0, got {patience}")
        if mode not in ("auto", "min", "max"):
            raise ValueError(f"mode must be 'auto', 'min' or 'max', got {mode!r}")
        self.monitor = monitor
        self.patience = patience
        self.min_delta = abs(min_delta)
        self.maximize = mode == "max" or (mode == "auto" and "acc" in monitor)
        self.restore_best_weights = restore_best_weights
        self.best: float | None = None
        self.best_epoch: int | None = None
        self.stopped_epoch: int | None = None
        self._wait = 0
        self._best_weights: dict[str, torch.Tensor] | None = None

    def on_train_begin(self, logs: Logs | None = None) -> None:
        if self.restore_best_weights and not self.state.strategy.can_restore_model_weights:
            raise ValueError(
                f"EarlyStopping(restore_best_weights=True) is not supported under {type(self.state.strategy).__name__}: "
                "use ModelCheckpoint and restore the checkpoint you want"
            )
        self.best, self.best_epoch, self.stopped_epoch, self._wait = None, None, None, 0

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        value = _monitored(self.monitor, logs or {})
        if improved(value, self.best, self.min_delta, self.maximize):
            self.best, self.best_epoch, self._wait = value, epoch, 0
            if self.restore_best_weights:
                self._best_weights = self.state.strategy.model_weights(self.state.model)
            return
        self._wait += 1
        if self._wait > self.patience:
            self.stopped_epoch = epoch
            self.state.stop_training = True
            self._restore_best()

    def on_train_end(self, logs: Logs | None = None) -> None:
        if self.stopped_epoch is None:
            self._restore_best()

    def _restore_best(self) -> None:
        if self.restore_best_weights and self._best_weights is not None:
            self.state.strategy.load_model_weights(self.state.model, self._best_weights)
            log.info("restored the weights of epoch %s (%s %.4g)", self.best_epoch, self.monitor, self.best)


def improved(value: float, best: float | None, min_delta: float, maximize: bool) -> bool:
    """Whether ``value`` beats ``best`` by more than ``min_delta`` (any value beats None)."""
    if best is None:
        return True
    return value > best + min_delta if maximize else value < best - min_delta


def _monitored(name: str, logs: Mapping[str, float]) -> float:
    if name not in logs:
        hint = " (pass validation_data to fit)" if name.startswith("val_") else ""
        raise KeyError(f"EarlyStopping monitors {name!r}, which is not in the logs {sorted(logs)}{hint}: "
                       "monitor one of those")
    return float(logs[name])


# ------------------------------------------------------------------ TensorBoard


class TensorBoard(Callback):
    """Writes each epoch's logs as scalars ``epoch/<name>`` to ``log_dir``
    (torch.utils.tensorboard.SummaryWriter; only the chief of a multi-process strategy writes).

    Raises ImportError at construction when the ``tensorboard`` package is missing.
    """

    def __init__(self, log_dir: str | os.PathLike[str]):
        if importlib.util.find_spec("tensorboard") is None:
            raise ImportError("the TensorBoard callback needs the tensorboard package: pip install tensorboard")
        self.log_dir = pathlib.Path(log_dir)
        self._writer: Any = None

    def on_train_begin(self, logs: Logs | None = None) -> None:
        if self.state.is_chief and self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.log_dir))

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if self._writer is None:
            return
        for key, value in (logs or {}).items():
            self._writer.add_scalar(f"epoch/{key}", value, global_step=epoch)
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def with_defaults(callbacks: Sequence[Callback], verbose: bool) -> tuple[list[Callback], History]:
    """The user's callbacks with a ProgressBar first (when verbose and there is none) and
    a History last (unless the user passed one): returns them and the History."""
    result = list(callbacks)
    if verbose and not any(isinstance(c, ProgressBar) for c in result):
        result.insert(0, ProgressBar())
    history = next((c for c in result if isinstance(c, History)), None)
    if history is None:
        history = History()
        result.append(history)
    return result, history

