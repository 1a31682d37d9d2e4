"""ParameterServerStrategy's side of ``fit``, ``evaluate`` and their callbacks.

What the strategy hands the training loop: the StepRunner that schedules ``fit``'s steps
as closures on the workers (ParameterServerStepRunner), the TrainingCheckpoints written
by the servers' data (ServerCheckpoints), and the state of a compiled metric kept as
variables on the servers (ServerMetricState). They are apart from ``parameter_server``
(the strategy and its variables) because they only adapt the strategy to the
``step_runners`` and ``training_state`` interfaces: they use its public methods and
are built by it, never the other way round.
"""

from __future__ import annotations

import collections
import copy
import os
import pathlib
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from paramserve.coordinator.checkpointing.checkpoint_manager import CheckpointManager
from paramserve.coordinator.cluster_coordinator import ClusterCoordinator
from paramserve.coordinator.remote_value import RemoteValue, RemoteValueState
from paramserve.coordinator.strategies.step_runners import StepFn, add_statistics
from paramserve.psserver.checkpoint import shard_files as checkpoint
from paramserve.psserver.protocol.optimizer_spec import OptimizerSpec
from paramserve.worker.layers import ServerOptimizer, VariableAccess, current_access, variable_name

if TYPE_CHECKING:
    from paramserve.coordinator.strategies.parameter_server import ParameterServerStrategy


METRIC_OPTIMIZER = OptimizerSpec("SGD", {"lr": 1.0})
"""How the servers apply a metric's pushes: ``state - 1.0 * (-increment)``, an exact sum."""


class ServerMetricState:
    """A metric's state under ParameterServerStrategy: each state tensor is a variable on the
    parameter servers, as TensorFlow keeps a metric's variables there.

    ``update`` (on a worker inside a closure, or on the coordinator) computes the batch's
    state with a fresh torchmetrics copy and pushes it as an increment: an idempotent push
    (the closure's key), so a retried closure counts once and every worker's updates count.
    ``merged`` pulls the servers' sums; ``reset`` pushes minus the values it read, so
    increments that arrive meanwhile are kept. Pickled into a closure, the variables travel
    as references (as a model's parameters do) and the pushes go through the worker.
    """

    def __init__(self, strategy: ParameterServerStrategy, template: Any, name: str, home: VariableAccess):
        """``home``: how the coordinator reaches ``strategy``'s variables (its CoordinatorAccess)."""
        from paramserve.coordinator.strategies.metric_states import additive_states

        self.template = template
        self.states = additive_states(template)
        self.parameters = strategy.register_metric(name, {n: getattr(template, n) for n in self.states})
        names = [variable_name(p) or "" for p in self.parameters.values()]
        self.optimizer = ServerOptimizer(
            names, METRIC_OPTIMIZER.name, dict(METRIC_OPTIMIZER.kwargs), home=home, owner=strategy
        )

    def update(self, *args: Any, **kwargs: Any) -> None:
        batch = copy.deepcopy(self.template)
        batch.update(*args, **kwargs)
        self._push({n: getattr(batch, n) for n in self.states}, sign=-1.0)

    def merged(self) -> Any:
        from paramserve.coordinator.strategies.metric_states import load_states

        self._refresh()
        metric = copy.deepcopy(self.template)
        load_states(metric, self.states, torch.cat([p.detach().reshape(-1) for p in self.parameters.values()]))
        return metric

    def reset(self) -> None:
        self._refresh()
        self._push({n: p.detach().clone() for n, p in self.parameters.items()}, sign=1.0)

    def _refresh(self) -> None:
        current_access(self.optimizer.home).refresh(list(self.parameters.values()))

    def _push(self, values: Mapping[str, torch.Tensor], sign: float) -> None:
        for state, parameter in self.parameters.items():
            parameter.grad = values[state].detach().to(torch.float64).reshape(parameter.shape) * sign
        self.optimizer.step()
        for parameter in self.parameters.values():
            parameter.grad = None


def check_training_data(train_data: Any, steps_per_epoch: int | None) -> None:
    """Returns when ``fit`` can train on ``train_data`` under ParameterServerStrategy.

    Raises:
        ValueError: no ``steps_per_epoch`` (the workers' datasets have no end).
        TypeError: ``train_data`` is not a dataset function run on each worker.
    """
    if steps_per_epoch is None:
        raise ValueError(
            "steps_per_epoch is required under ParameterServerStrategy (the workers' datasets "
            "have no end): pass steps_per_epoch="
        )
    if not callable(train_data):
        raise TypeError(
            f"under ParameterServerStrategy train_data must be a dataset function run on each worker, "
            f"dataset_fn(worker_context) -> endless batches; got {type(train_data).__name__}"
        )


class _WorkerSteps:
    """The closure ``fit`` schedules: ``steps`` times per closure, the next batch of the worker's
    dataset through the step; returns the sum of those steps' statistics. A fresh copy arrives
    with every closure, so the sum covers exactly that closure's steps (also when it is retried)."""

    def __init__(self, step: StepFn):
        self.step = step
        self.totals: torch.Tensor | None = None

    def __call__(self, iterator: Iterator[Any]) -> torch.Tensor:
        self.totals = add_statistics(self.totals, self.step(next(iterator), None))
        return self.totals


class ParameterServerStepRunner:
    """``fit``'s steps as closures a ClusterCoordinator schedules on the workers (the one given,
    or one of its own, shut down by ``close``). Running statistics are those of the closures
    finished so far (never waited for); the epoch's end waits for every one. ``report`` goes to
    the coordinator's status page (``ClusterCoordinator.report``)."""

    def __init__(
        self,
        strategy: ParameterServerStrategy,
        step: StepFn,
        dataset_fn: Callable[..., Any],
        coordinator: ClusterCoordinator | None,
    ):
        self._strategy = strategy
        self._owned = coordinator is None
        self._coordinator = coordinator if coordinator is not None else ClusterCoordinator(strategy)
        self._iterator = iter(self._coordinator.create_per_worker_dataset(dataset_fn))
        self._closure = _WorkerSteps(step)
        self._values: collections.deque[RemoteValue[Any]] = collections.deque()
        self._totals: torch.Tensor | None = None

    def prepare(self) -> None:
        self._strategy.materialize()  # after BackupAndRestore had its chance to restore instead

    def epoch_length(self) -> int | None:
        return None  # the workers' datasets are endless

    def begin_epoch(self) -> None:
        self._values.clear()
        self._totals = None

    def run(self, steps: int) -> int:
        self._values.append(self._coordinator.schedule(self._closure, args=(self._iterator,), steps=steps))
        return steps

    def running_totals(self) -> torch.Tensor | None:
        # In order, up to the first closure not finished: a failed one stays for end_epoch's join.
        while self._values and self._values[0].state is RemoteValueState.READY:
            self._totals = add_statistics(self._totals, self._values.popleft().fetch())
        return self._totals

    def end_epoch(self) -> torch.Tensor | None:
        self._coordinator.join()
        while self._values:
            self._totals = add_statistics(self._totals, self._values.popleft().fetch())
        return self._totals

    def report(self, step: int, logs: Mapping[str, float], examples: int) -> None:
        metrics = {name: value for name, value in logs.items() if name not in ("loss", "step", "samples")}
        self._coordinator.report(step, loss=logs.get("loss"), samples=examples, **metrics)

    def close(self) -> None:
        if self._owned:
            self._coordinator.shutdown()


class ServerCheckpoints:
    """Training checkpoints of a ParameterServerStrategy: checkpoints of every variable with its
    optimizer state, written by the servers' data (CheckpointManager: ``ckpt-N`` directories in
    ``directory``); ``extra`` is kept in the checkpoint's manifest."""

    def __init__(self, strategy: ParameterServerStrategy, directory: str | os.PathLike[str], keep: int):
        self.directory = pathlib.Path(directory)
        self._strategy = strategy
        self._manager = CheckpointManager(strategy, self.directory, max_to_keep=keep)

    def save(self, name: str, model: nn.Module, optimizer: Any, extra: Mapping[str, Any]) -> pathlib.Path:
        return self._manager.save(int(extra.get("step", 0)), extra={**extra, "name": name})

    def save_at(self, path: pathlib.Path, model: nn.Module, optimizer: Any, extra: Mapping[str, Any]) -> pathlib.Path:
        """A checkpoint directory at ``path`` (restore it with ``CheckpointManager(strategy, path)``)."""
        CheckpointManager(self._strategy, path, max_to_keep=1).save(int(extra.get("step", 0)), extra=dict(extra))
        return path

    def latest(self) -> pathlib.Path | None:
        return self._manager.latest

    def restore(self, path: pathlib.Path, model: nn.Module, optimizer: Any) -> dict[str, Any]:
        extra = dict(checkpoint.read_manifest(checkpoint.resolve(path)).extra)
        self._manager.restore(path)
        return extra

    def initialize(self) -> None:
        """No backup to resume from: the variables start from their initial values, replacing
        what an interrupted run of this program left on the servers."""
        self._strategy.initialize()

    def clear(self) -> None:
        self._strategy.checkpoints.forget(self.directory)
        checkpoint.delete_checkpoints(self.directory)
