"""How a strategy runs training steps for ``fit``: the StepRunner every strategy returns
from ``Strategy.step_runner``, and the one for strategies that run steps in this process.

``fit`` builds the step (``step(batch, global_batch_size) -> statistics``: forward,
loss, backward, optimizer step, and a 1-D float64 tensor of sums it adds up) and drives
the epochs and callbacks; the runner decides where steps run and how their statistics
come back. ParameterServerStrategy's runner schedules them on workers
(``strategies.parameter_server_training``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from torch import Tensor

from paramserve.coordinator.strategies.base import ReduceOp
from paramserve.coordinator.strategies.input import DatasetCreator

if TYPE_CHECKING:
    from paramserve.coordinator.strategies.base import Strategy

__all__ = ["InProcessStepRunner", "StepFn", "StepRunner", "distribute"]

StepFn = Callable[[Any, "int | None"], Tensor]
"""``step(batch, global_batch_size)`` -> the step's statistics (a 1-D tensor of sums)."""


class StepRunner(Protocol):
    """Runs ``fit``'s training steps under one strategy."""

    def prepare(self) -> None:
        """Called after on_train_begin (after a restore), before the first step."""

    def epoch_length(self) -> int | None:
        """Steps in one pass over the data, when known (None: unknown or endless)."""

    def begin_epoch(self) -> None: ...

    def run(self, steps: int) -> int:
        """Runs up to ``steps`` steps; returns how many ran (fewer when the data ran out)."""

    def running_totals(self) -> Tensor | None:
        """The epoch's statistics so far (None when none are known yet)."""

    def end_epoch(self) -> Tensor | None:
        """Waits for the epoch's steps; returns the epoch's statistics."""

    def report(self, step: int, logs: Mapping[str, float], examples: int) -> None:
        """Where training is, for whoever watches the run: ``step`` steps and ``examples``
        examples trained so far, and the running ``logs`` (loss, metrics). Never waits."""

    def close(self) -> None:
        """Releases what the runner started (called once, also after an error)."""


def distribute(strategy: Strategy, data: Any) -> Iterable[Any]:
    """An in-process strategy's distributed view of ``data`` (a dataset function, a
    DatasetCreator, distributed by its input options, or batches)."""
    if callable(data) and not isinstance(data, Iterable):
        options = data.input_options if isinstance(data, DatasetCreator) else None
        return strategy.distribute_datasets_from_function(data, options)
    return strategy.experimental_distribute_dataset(data)


class InProcessStepRunner:
    """Steps in this process: ``strategy.run(step, args=(batch, global_batch_size))`` on
    distributed batches. Under a multi-process strategy, statistics are reduced across
    processes once per ``running_totals`` / ``end_epoch`` (a collective: every process
    calls them at the same points)."""

    def __init__(self, strategy: Strategy, step: StepFn, train_data: Any, steps_per_epoch: int | None):
        self._strategy, self._step = strategy, step
        self._data = distribute(strategy, train_data)
        self._restart_each_epoch = steps_per_epoch is None
        self._iterator: Iterator[Any] | None = None
        self._totals: Tensor | None = None  # the epoch's statistics over every replica
        self._pending: Tensor | None = None  # this process's, not yet reduced across processes
        self._other_processes = False

    def prepare(self) -> None:
        """Nothing to prepare in this process."""

    def epoch_length(self) -> int | None:
        try:
            return len(self._data)  # type: ignore[arg-type]
        except TypeError:
            return None

    def begin_epoch(self) -> None:
        self._totals = self._pending = None
        if self._restart_each_epoch or self._iterator is None:
            self._iterator = iter(self._data)

    def run(self, steps: int) -> int:
        for ran in range(steps):
            batch = self._next_batch()
            if batch is None:
                return ran
            stats = self._strategy.run(self._step, args=(batch, _global_batch_size(self._strategy, batch)))
            parts = self._strategy.experimental_local_results(stats)
            self._other_processes = len(parts) != self._strategy.num_replicas_in_sync
            for part in parts:
                self._pending = add_statistics(self._pending, part)
        return steps

    def running_totals(self) -> Tensor | None:
        return self._reduce_pending()

    def end_epoch(self) -> Tensor | None:
        return self._reduce_pending()

    def report(self, step: int, logs: Mapping[str, float], examples: int) -> None:
        """Nobody watches an in-process run but its callbacks."""

    def close(self) -> None:
        """Nothing to release: the strategy's threads belong to the strategy."""

    def _reduce_pending(self) -> Tensor | None:
        pending, self._pending = self._pending, None
        if pending is not None and self._other_processes:
            pending = self._strategy.reduce(ReduceOp.SUM, pending, axis=None)
        if pending is not None:
            self._totals = add_statistics(self._totals, pending)
        return self._totals

    def _next_batch(self) -> Any:
        assert self._iterator is not None
        try:
            return next(self._iterator)
        except StopIteration:
            if self._restart_each_epoch:
                return None
        self._iterator = iter(self._data)  # steps_per_epoch outlasts the data: start a new pass
        try:
            return next(self._iterator)
        except StopIteration:
            raise ValueError("train_data yields no batches: give it at least one batch") from None


def add_statistics(total: Tensor | None, value: Tensor) -> Tensor:
    """``total + value`` on the CPU (``value`` when there is no total yet)."""
    value = value.detach().cpu()
    return value if total is None else total + value


def _global_batch_size(strategy: Strategy, batch: Any) -> int | None:
    """The examples in all replicas' parts of ``batch`` when this process holds every part
    (a short last batch splits unevenly); None, compute_average_loss's default, otherwise."""
    targets = batch[1] if isinstance(batch, (tuple, list)) and len(batch) >= 2 else batch
    parts = strategy.experimental_local_results(targets)  # a PerReplica, or a tensor
    if len(parts) != strategy.num_replicas_in_sync:
        return None  # other processes hold parts (MultiWorkerMirroredStrategy)
    return sum(len(part) for part in parts) or None
