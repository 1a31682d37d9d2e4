"""Callbacks of ``fit``: Keras' callbacks, in PyTorch idiom.

A callback sees the training through a :class:`TrainingState` (its
``state`` attribute, set by ``fit`` before ``on_train_begin``): the model, the
optimizer, the strategy, the epoch and the global step; ``self.model`` is the model,
as in Keras. It stops training by setting ``state.stop_training``. Hooks, in the
order ``fit`` calls them::

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
import inspect
import json
import logging
import math
import os
import pathlib
import shutil
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from paramserve.psserver.checkpoint import shard_files as server_checkpoints
from paramserve.psserver.runtime.atomic_files import atomic_torch_save, atomic_write

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
    "latest_checkpoint",
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
    examples: int = 0
    """Examples trained in the epochs finished so far (in this call of fit)."""
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

    @property
    def model(self) -> nn.Module:
        """The model ``fit`` trains (Keras' ``callback.model``)."""
        return self.state.model

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
                raise TypeError(
                    f"callbacks must be Callback instances, got {type(callback).__name__}: subclass Callback"
                )
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
            except Exception:
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
        self._bar = tqdm(
            total=self.state.steps_per_epoch,
            unit="step",
            desc=f"epoch {epoch + 1}/{self.state.epochs}",
            file=self._file or sys.stderr,
            leave=True,
        )

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
    """Saves the model (and optimizer) at each epoch's end, or every ``save_freq`` steps,
    as Keras' ModelCheckpoint does.

    Args:
        filepath: where to write, formatted with ``epoch`` (from 1, as in Keras) and the
            epoch's logs, e.g. ``"ckpts/ckpt-{epoch:02d}.pt"`` or
            ``"best-{epoch:02d}-{val_loss:.2f}.pt"``.
        monitor, mode, save_best_only: with ``save_best_only`` a checkpoint is written only
            when ``monitor`` improves (``mode`` "min", "max", or "auto": max for names with
            "acc" or "auc", else min); a fixed ``filepath`` then always holds the best model.
        save_weights_only: write the model's weights only, a plain ``state_dict`` that
            ``model.load_state_dict(torch.load(path))`` loads under any strategy or none
            (under ParameterServerStrategy: the variables' current values). Otherwise the
            training state, where the strategy keeps it (``strategy.training_checkpoints``):
            a torch file ``{"model", "optimizer", "epoch", "step"}``, or for
            ParameterServerStrategy a CheckpointManager checkpoint of every variable with
            its optimizer state, in a directory at ``filepath``.
        save_freq: "epoch", or a number of steps (checked at each batch callback).
        keep: how many checkpoints written by this callback to keep (None: all).

    ``latest_checkpoint(directory)`` names the newest one (an index file ``checkpoint``
    beside them says which, as TensorFlow's does). Under a multi-process strategy only the
    chief writes.
    """

    def __init__(
        self,
        filepath: str | os.PathLike[str],
        monitor: str = "val_loss",
        verbose: int = 0,
        save_best_only: bool = False,
        save_weights_only: bool = False,
        mode: str = "auto",
        save_freq: str | int = "epoch",
        keep: int | None = None,
    ):
        if mode not in ("auto", "min", "max"):
            raise ValueError(f"mode must be 'auto', 'min' or 'max', got {mode!r}")
        if save_freq != "epoch" and not (isinstance(save_freq, int) and save_freq >= 1):
            raise ValueError(f"save_freq must be 'epoch' or a number of steps >= 1, got {save_freq!r}")
        if keep is not None and keep < 1:
            raise ValueError(f"keep must be >= 1 or None, got {keep}")
        self.filepath = os.fspath(filepath)
        self.monitor, self.verbose = monitor, verbose
        self.save_best_only, self.save_weights_only = save_best_only, save_weights_only
        self.maximize = _maximize(monitor, mode)
        self.save_freq, self.keep = save_freq, keep
        self.best: float | None = None
        self._last_saved_step = 0

    def on_train_batch_end(self, step: int, logs: Logs | None = None) -> None:
        if isinstance(self.save_freq, int) and step - self._last_saved_step >= self.save_freq:
            self._last_saved_step = step
            self._save(self.state.epoch, logs or {})

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if self.save_freq == "epoch":
            self._save(epoch, logs or {})

    def _save(self, epoch: int, logs: Logs) -> None:
        if self.save_best_only:
            if self.monitor not in logs:
                log.warning(
                    "ModelCheckpoint(save_best_only=True) monitors %r, which is not in the logs %s: "
                    "skipping the checkpoint",
                    self.monitor,
                    sorted(logs),
                )
                return
            if not improved(float(logs[self.monitor]), self.best, 0.0, self.maximize):
                return
            self.best = float(logs[self.monitor])
        if not self.state.is_chief:
            return
        path = self._path(epoch, logs)
        if self.save_weights_only:
            atomic_torch_save(self.state.strategy.model_weights(self.state.model), path)
        else:
            checkpoints = self.state.strategy.training_checkpoints(path.parent, keep=0)
            checkpoints.save_at(path, self.state.model, self.state.optimizer, _progress(self.state, epoch + 1))
        _record_checkpoint(path, self.keep)
        if self.verbose:
            print(f"\nEpoch {epoch + 1}: saving model to {path}", file=sys.stderr)
        log.info("checkpoint of epoch %d written to %s", epoch + 1, path)

    def _path(self, epoch: int, logs: Logs) -> pathlib.Path:
        try:
            return pathlib.Path(self.filepath.format(epoch=epoch + 1, **logs))
        except (KeyError, IndexError) as err:
            raise KeyError(
                f"ModelCheckpoint filepath {self.filepath!r} names {err}, which is not in the logs "
                f"{sorted(logs)}: use epoch or one of those"
            ) from None


CHECKPOINT_INDEX = "checkpoint"
"""The file beside ModelCheckpoint's checkpoints that names them, newest last (TF's ``checkpoint``)."""


def _record_checkpoint(path: pathlib.Path, keep: int | None) -> None:
    """Names ``path`` the newest checkpoint in its directory's index; deletes the ones beyond ``keep``."""
    index = path.parent / CHECKPOINT_INDEX
    names = [n for n in _read_index(index) if n != path.name] + [path.name]
    if keep is not None:
        for old in names[:-keep]:
            _delete(path.parent / old)
        names = names[-keep:]
    atomic_write(index, lambda file: file.write(json.dumps({"latest": path.name, "all": names}).encode()))


def _read_index(index: pathlib.Path) -> list[str]:
    try:
        return list(json.loads(index.read_text())["all"])
    except (OSError, ValueError, KeyError, TypeError):
        return []


def _delete(path: pathlib.Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def latest_checkpoint(directory: str | os.PathLike[str]) -> str | None:
    """The newest checkpoint ModelCheckpoint wrote in ``directory`` (TensorFlow's
    ``tf.train.latest_checkpoint``), None when there is none. A CheckpointManager's (or
    BackupAndRestore's) directory: its newest whole ``ckpt-N``. Without an index (files written
    otherwise) the newest ``*.pt`` file or checkpoint directory, by modification time."""
    root = pathlib.Path(directory)
    if (root / server_checkpoints.LATEST).is_file():
        found = server_checkpoints.latest_checkpoint(root)
        return str(found) if found is not None else None
    names = _read_index(root / CHECKPOINT_INDEX)
    existing = [root / n for n in names if (root / n).exists()]
    if existing:
        return str(existing[-1])
    if not root.is_dir():
        return None
    candidates = [p for p in root.iterdir() if (p.suffix == ".pt" and p.is_file()) or (p / "LATEST").is_file()]
    return str(max(candidates, key=lambda p: p.stat().st_mtime_ns)) if candidates else None


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
            checkpoints.initialize()  # what a run that died before its first backup left is replaced
            return
        extra = checkpoints.restore(latest, self.state.model, self.state.optimizer)
        self.state.initial_epoch, self.state.step = int(extra.get("epoch", 0)), int(extra.get("step", 0))
        log.info(
            "resuming at epoch %d (step %d) from the backup in %s",
            self.state.initial_epoch,
            self.state.step,
            self.backup_dir,
        )

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if self.state.is_chief:
            self._checkpoints().save(
                self._NAME, self.state.model, self.state.optimizer, _progress(self.state, epoch + 1)
            )

    def on_train_end(self, logs: Logs | None = None) -> None:
        if self.state.is_chief:
            self._checkpoints().clear()

    def _checkpoints(self) -> Any:
        return self.state.strategy.training_checkpoints(self.backup_dir, keep=1)


def _progress(state: TrainingState, epochs_completed: int) -> dict[str, int]:
    return {"epoch": epochs_completed, "step": state.step}


# ------------------------------------------------------------------ learning rate and stopping


class LearningRateScheduler(Callback):
    """Sets the learning rate to ``schedule(epoch)`` or ``schedule(epoch, lr)`` at each epoch's
    begin (epoch from 0, ``lr`` the current rate), as Keras' does, and logs it as ``lr``. The
    strategy applies it (``strategy.set_learning_rate``): every ``param_groups`` entry of a
    torch optimizer, or the parameter servers' optimizer for its variables.
    """

    def __init__(self, schedule: Callable[[int, float], float] | Callable[[int], float], verbose: int = 0):
        self.schedule = schedule
        self.verbose = verbose
        self._with_lr = _takes_two_arguments(schedule)

    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None:
        lr = float(self.schedule(epoch, self.current_lr()) if self._with_lr else self.schedule(epoch))  # type: ignore[call-arg]
        if self.verbose:
            print(f"\nEpoch {epoch + 1}: LearningRateScheduler setting learning rate to {lr}.", file=sys.stderr)
        if not math.isfinite(lr) or lr < 0:
            raise ValueError(f"the schedule returned learning rate {lr} for epoch {epoch}: return a finite rate >= 0")
        self.state.strategy.set_learning_rate(self.state.optimizer, lr)

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if logs is not None:
            logs["lr"] = self.current_lr()

    def current_lr(self) -> float:
        return self.state.strategy.learning_rate(self.state.optimizer)


def _takes_two_arguments(schedule: Callable[..., float]) -> bool:
    """Whether ``schedule`` takes ``(epoch, lr)`` rather than ``(epoch)`` (decided by its
    signature, not by calling it: a TypeError inside the schedule must not be hidden)."""
    try:
        inspect.signature(schedule).bind(0, 0.0)
    except TypeError:
        return False
    except ValueError:  # no signature: Keras' two-argument form
        return True
    return True


class EarlyStopping(Callback):
    """Stops training when ``monitor`` has not improved by more than ``min_delta`` for ``patience`` epochs.

    ``mode``: "min", "max", or "auto" (max for names with "acc", else min).
    ``restore_best_weights``: at the stop (or the end), load the best epoch's
    model weights (in-process strategies only).
    Raises KeyError at the first epoch end when the logs have no ``monitor``.
    """

    def __init__(
        self,
        monitor: str = "val_loss",
        patience: int = 0,
        min_delta: float = 0.0,
        mode: str = "auto",
        restore_best_weights: bool = False,
    ):
        if patience < 0:
            raise ValueError(f"patience must be >= 0, got {patience}")
        if mode not in ("auto", "min", "max"):
            raise ValueError(f"mode must be 'auto', 'min' or 'max', got {mode!r}")
        self.monitor = monitor
        self.patience = patience
        self.min_delta = abs(min_delta)
        self.maximize = _maximize(monitor, mode)
        self.restore_best_weights = restore_best_weights
        self.best: float | None = None
        self.best_epoch: int | None = None
        self.stopped_epoch: int | None = None
        self._wait = 0
        self._best_weights: dict[str, torch.Tensor] | None = None

    def on_train_begin(self, logs: Logs | None = None) -> None:
        if self.restore_best_weights and not self.state.strategy.can_restore_model_weights:
            raise ValueError(
                "EarlyStopping(restore_best_weights=True) is not supported under "
                f"{type(self.state.strategy).__name__}: use ModelCheckpoint and restore the checkpoint you want"
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


def _maximize(monitor: str, mode: str) -> bool:
    """Whether larger is better for ``monitor`` (mode "auto": accuracies and AUCs)."""
    return mode == "max" or (mode == "auto" and ("acc" in monitor or "auc" in monitor))


def improved(value: float, best: float | None, min_delta: float, maximize: bool) -> bool:
    """Whether ``value`` beats ``best`` by more than ``min_delta`` (any value beats None)."""
    if best is None:
        return True
    return value > best + min_delta if maximize else value < best - min_delta


def _monitored(name: str, logs: Mapping[str, float]) -> float:
    if name not in logs:
        hint = " (pass validation_data to fit)" if name.startswith("val_") else ""
        raise KeyError(
            f"EarlyStopping monitors {name!r}, which is not in the logs {sorted(logs)}{hint}: monitor one of those"
        )
    return float(logs[name])


# ------------------------------------------------------------------ TensorBoard


class TensorBoard(Callback):
    """Writes the logs for TensorBoard as Keras does: ``log_dir/train`` holds the training
    logs and ``log_dir/validation`` the ``val_*`` ones (without the prefix), as scalars
    ``epoch_<name>`` (``epoch_loss``, ``epoch_accuracy``, ...) at step ``epoch``; with
    ``update_freq="batch"`` (or N: every N steps) also ``batch_<name>`` at the global step.
    torch.utils.tensorboard writes them; only the chief of a multi-process strategy does.

    Raises ImportError at construction when the ``tensorboard`` package is missing.
    """

    def __init__(self, log_dir: str | os.PathLike[str] = "logs", update_freq: str | int = "epoch"):
        if importlib.util.find_spec("tensorboard") is None:
            raise ImportError("the TensorBoard callback needs the tensorboard package: pip install tensorboard")
        if update_freq not in ("epoch", "batch") and not (isinstance(update_freq, int) and update_freq >= 1):
            raise ValueError(f"update_freq must be 'epoch', 'batch' or a number of steps >= 1, got {update_freq!r}")
        self.log_dir = pathlib.Path(log_dir)
        self.update_freq = 1 if update_freq == "batch" else update_freq
        self._writers: dict[str, Any] = {}
        self._last_batch_step = 0

    def on_train_begin(self, logs: Logs | None = None) -> None:
        if self.state.is_chief and not self._writers:
            self._writers = {run: summary_writer(self.log_dir / run) for run in ("train", "validation")}

    def on_train_batch_end(self, step: int, logs: Logs | None = None) -> None:
        if (
            not self._writers
            or not isinstance(self.update_freq, int)
            or step - self._last_batch_step < self.update_freq
        ):
            return
        self._last_batch_step = step
        for key, value in (logs or {}).items():
            self._writers["train"].add_scalar(f"batch_{key}", value, global_step=step)

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if not self._writers:
            return
        write_epoch_logs(self._writers, logs or {}, epoch)

    def close(self) -> None:
        for writer in self._writers.values():
            writer.close()
        self._writers = {}


def summary_writer(log_dir: pathlib.Path) -> Any:
    """A torch.utils.tensorboard SummaryWriter for ``log_dir``."""
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=str(log_dir))


def write_epoch_logs(writers: Mapping[str, Any], logs: Mapping[str, float], step: int) -> None:
    """Keras' layout: ``val_<name>`` as ``epoch_<name>`` in the ``validation`` run, the others in ``train``."""
    for key, value in logs.items():
        run, name = ("validation", key[4:]) if key.startswith("val_") else ("train", key)
        if run in writers:
            writers[run].add_scalar(f"epoch_{name}", value, global_step=step)
    for writer in writers.values():
        writer.flush()


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
