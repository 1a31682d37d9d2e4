"""A sidecar evaluator: TensorFlow's evaluator task, for paramserve checkpoints.

It runs beside training (another process, often another machine), watches a checkpoint
directory, loads each new checkpoint into its own plain copy of the model, evaluates it
and writes the results as TensorBoard summaries, so training never stops to evaluate::

    evaluator = SidecarEvaluator(MLP(), test_batches, checkpoint_dir="ckpts", log_dir="logs")
    evaluator.run()        # until max_evaluations, or stop.set() from another thread

or ``paramserve evaluator --checkpoint-dir ckpts --every 30 --log-dir logs``.

It reads every checkpoint form training writes: ModelCheckpoint's torch files (weights
only, or ``{"model": ...}`` training state), and parameter-server checkpoints
(CheckpointManager's ``ckpt-N`` directories, or ModelCheckpoint's directories of them),
whose variables it reads straight from the files (no server is needed), hybrid training's
dense layers (``sync_dense``) from the checkpoint's ``dense_state.pt``, checked against the
SHA-256 its manifest names. It needs no
strategy: evaluation runs in this process. Summaries go to ``log_dir/validation`` as
``epoch_<name>`` at the checkpoint's epoch (its step when it has no epoch), the run and
tags fit's TensorBoard callback uses for validation.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from paramserve.coordinator.checkpointing.dense_checkpoint import DENSE_EXTRA_KEY, read_checkpoint_state
from paramserve.coordinator.training.callbacks import summary_writer, write_epoch_logs
from paramserve.coordinator.training.loops import evaluate
from paramserve.psserver.checkpoint import shard_files as server_checkpoint
from paramserve.psserver.protocol.types import ShardRef

if TYPE_CHECKING:  # imported when first used: step_metrics brings torchmetrics (about a second)
    from paramserve.coordinator.training.step_metrics import Metrics

__all__ = ["Evaluation", "SidecarEvaluator", "find_checkpoints", "load_checkpoint_weights"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """One checkpoint evaluated: where it was, its epoch/step (None: unknown), the results."""

    checkpoint: pathlib.Path
    step: int
    results: dict[str, float]


class SidecarEvaluator:
    """Evaluates each new checkpoint in ``checkpoint_dir`` (TensorFlow's SidecarEvaluator).

    Args:
        model: a plain module of the trained model's class; each checkpoint is loaded into it.
        data: evaluation batches ``(inputs, targets)`` (iterated anew for every checkpoint).
        checkpoint_dir: where training writes checkpoints.
        loss_fn, metrics: as for ``evaluate`` (per-example loss; default accuracy).
        log_dir: TensorBoard summaries go to ``log_dir/validation`` (None: none written).
        steps: batches per evaluation (None: all of ``data``).
        max_evaluations: stop after this many (None: until stopped).
        every: seconds between looks for a new checkpoint.
        on_evaluation: called with each Evaluation (e.g. to print it).
    """

    def __init__(
        self,
        model: nn.Module,
        data: Iterable[Any],
        checkpoint_dir: str | os.PathLike[str],
        *,
        loss_fn: Any = None,
        metrics: Metrics = ("accuracy",),
        log_dir: str | os.PathLike[str] | None = None,
        steps: int | None = None,
        max_evaluations: int | None = None,
        every: float = 10.0,
        on_evaluation: Callable[[Evaluation], None] | None = None,
    ):
        if every <= 0:
            raise ValueError(f"every must be a positive number of seconds, got {every}")
        if max_evaluations is not None and max_evaluations < 1:
            raise ValueError(f"max_evaluations must be >= 1 or None, got {max_evaluations}")
        self.model, self.data = model, data
        self.checkpoint_dir = pathlib.Path(checkpoint_dir)
        self.loss_fn = loss_fn if loss_fn is not None else nn.CrossEntropyLoss(reduction="none")
        from paramserve.coordinator.training.step_metrics import resolve_metrics

        self.metrics = resolve_metrics(metrics)
        self.log_dir = pathlib.Path(log_dir) if log_dir is not None else None
        self.steps, self.max_evaluations, self.every = steps, max_evaluations, every
        self.on_evaluation = on_evaluation
        self.evaluations: list[Evaluation] = []
        self._seen: set[tuple[str, int]] = set()
        self._writer: Any = None

    def evaluate_latest(self) -> Evaluation | None:
        """Evaluates the newest checkpoint not evaluated yet (older unseen ones are skipped, as
        TensorFlow's evaluator does: it keeps up with training); None when there is none."""
        found = find_checkpoints(self.checkpoint_dir)
        fresh = [c for c in found if _identity(c) not in self._seen]
        if not fresh:
            return None
        path = fresh[-1]
        self._seen.update(_identity(c) for c in fresh)
        weights, step = load_checkpoint_weights(path, self.model)
        self.model.load_state_dict(weights, strict=False)
        results = evaluate(
            self.model,
            self.loss_fn,
            self.data,
            steps=self.steps,
            metrics=self.metrics,
            strategy=_default_strategy(),
            return_dict=True,
        )
        evaluation = Evaluation(path, step, results)
        self.evaluations.append(evaluation)
        self._write(evaluation)
        if self.on_evaluation is not None:
            self.on_evaluation(evaluation)
        log.info("evaluated %s (step %d): %s", path, step, results)
        return evaluation

    def run(self, stop: threading.Event | None = None) -> list[Evaluation]:
        """Evaluates new checkpoints as they appear until ``max_evaluations`` or ``stop`` is set;
        returns the evaluations made."""
        stop = stop or threading.Event()
        try:
            while not stop.is_set():
                self.evaluate_latest()
                if self.max_evaluations is not None and len(self.evaluations) >= self.max_evaluations:
                    break
                stop.wait(self.every)
        finally:
            self.close()
        return self.evaluations

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _write(self, evaluation: Evaluation) -> None:
        if self.log_dir is None:
            return
        if self._writer is None:
            self._writer = summary_writer(self.log_dir / "validation")
        logs = {f"val_{name}": value for name, value in evaluation.results.items()}
        write_epoch_logs({"validation": self._writer}, logs, evaluation.step)


def _default_strategy() -> Any:
    from paramserve.coordinator.strategies.base import DefaultStrategy

    return DefaultStrategy()


def _identity(path: pathlib.Path) -> tuple[str, int]:
    """A checkpoint rewritten at the same path (a fixed ModelCheckpoint filepath) is new again."""
    marker = path / server_checkpoint.LATEST if (path / server_checkpoint.LATEST).exists() else path
    try:
        return str(path), marker.stat().st_mtime_ns
    except OSError:
        return str(path), 0


def find_checkpoints(directory: pathlib.Path) -> list[pathlib.Path]:
    """The complete checkpoints in ``directory``, oldest first: torch files, parameter-server
    checkpoints (``ckpt-N``) and directories holding them."""
    if not directory.is_dir():
        return []
    found = []
    for path in directory.iterdir():
        if path.name.startswith(".") or path.name.endswith(".tmp"):
            continue
        if (
            (path.is_file() and path.suffix == ".pt")
            or (path / server_checkpoint.MANIFEST).is_file()
            or server_checkpoint.latest_checkpoint(path) is not None
        ):
            found.append(path)
    return sorted(found, key=lambda p: (_identity(p)[1], p.name))


def load_checkpoint_weights(path: pathlib.Path, model: nn.Module) -> tuple[dict[str, torch.Tensor], int]:
    """The model weights a checkpoint holds, keyed as ``model.state_dict()``, and its epoch
    (else its step, else 0). A hybrid checkpoint's dense layers come from its dense state file;
    ValueError when that file is missing or is not the one its manifest names (damaged)."""
    if path.is_file():
        saved: dict[str, Any] = torch.load(path, weights_only=True)
        if "model" in saved:
            return dict(saved["model"]), int(saved.get("epoch") or saved.get("step") or 0)
        return dict(saved), 0
    manifest = server_checkpoint.read_manifest(path)
    values = {
        name: server_checkpoint.load_rows(manifest.path, name, 0, entry.num_rows, ShardRef(name, 0)).value
        for name, entry in manifest.variables.items()
    }
    extra = manifest.extra
    if DENSE_EXTRA_KEY in extra:  # hybrid training: the replicated layers live beside the shards
        values.update(read_checkpoint_state(manifest.path, extra[DENSE_EXTRA_KEY])["values"])
    return _as_state_dict(values, model), int(extra.get("epoch", extra.get("step", 0)) or 0)


def _as_state_dict(values: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """Server variables (``<model>.<parameter>``; a table ``<model>.<table>``) as the model's keys.

    Raises ValueError naming the model's parameters the checkpoint lacks."""
    expected = set(model.state_dict())
    result = {}
    for name, value in values.items():
        key = name.split(".", 1)[1] if "." in name else name
        key = key if key in expected or f"{key}.weight" not in expected else f"{key}.weight"
        if key in expected:
            result[key] = value
    missing = sorted({name for name, _ in model.named_parameters()} - set(result))
    if missing:
        raise ValueError(
            f"the checkpoint holds no values for {missing} of {type(model).__name__}: evaluate it "
            "with a model of the class that trained it"
        )
    return result
