"""Where a metric's state lives under each strategy, as tensors that add up.

A strategy answers ``Strategy.metric_state`` with one of these: one torchmetrics copy in this
process (gathered across processes by torchmetrics' own synchronisation under a process group),
or one copy per replica merged when read. The helpers flatten a metric's summed states into one
vector and back, which ``fit`` and the parameter-server strategy sum. The user's metric objects
(``coordinator/metrics.py``) sit above the strategies and build on these.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torchmetrics
from torch import Tensor
from torchmetrics.utilities.data import dim_zero_sum

__all__ = [
    "LocalMetricState",
    "MetricState",
    "PerReplicaMetricState",
    "additive_states",
    "flatten_states",
    "load_states",
    "state_size",
    "sync_on_compute",
]


class MetricState(Protocol):
    """Where a metric's state lives under one strategy (``Strategy.metric_state`` returns one)."""

    def update(self, *args: Any, **kwargs: Any) -> None:
        """Adds a batch to the state of the current replica, process or worker."""

    def merged(self) -> torchmetrics.Metric:
        """A torchmetrics metric holding the aggregate state (to ``compute()``)."""

    def reset(self) -> None:
        """Back to the empty state everywhere."""


def additive_states(metric: torchmetrics.Metric) -> list[str]:
    """The names of ``metric``'s states, all of which must add up across copies (sum-reduced
    tensors). Raises ValueError naming the fix otherwise (e.g. AUROC without thresholds
    keeps every prediction in a list)."""
    names = list(metric.metric_state)
    # How a state merges has no public accessor: ``_reductions`` is read here only, and
    # pyproject.toml bounds torchmetrics below 2 (tests/unit/test_metrics.py checks it still holds).
    reductions = metric._reductions
    other = [n for n in names if reductions.get(n) is not dim_zero_sum or not isinstance(getattr(metric, n), Tensor)]
    if other:
        raise ValueError(
            f"{type(metric).__name__} keeps states {other} that do not add up across replicas and workers "
            "(lists, or min/max/cat reductions): use a metric with summed states, e.g. AUROC with "
            "thresholds=200 (paramserve's AUC)"
        )
    return names


def flatten_states(metric: torchmetrics.Metric, names: Sequence[str]) -> Tensor:
    """The states, flattened into one float64 vector (what steps return and strategies sum)."""
    return (
        torch.cat([getattr(metric, n).detach().reshape(-1).to(torch.float64) for n in names])
        if names
        else torch.zeros(0, dtype=torch.float64)
    )


def load_states(metric: torchmetrics.Metric, names: Sequence[str], flat: Tensor) -> None:
    """Sets ``metric``'s states from a vector ``flatten_states`` made (summed), in their dtypes."""
    offset = 0
    for name in names:
        state = getattr(metric, name)
        part = flat[offset : offset + state.numel()].reshape(state.shape)
        setattr(metric, name, part.round().to(state.dtype) if not state.is_floating_point() else part.to(state.dtype))
        offset += state.numel()
    metric._update_count = max(metric._update_count, 1)  # computed as a metric that saw data


def sync_on_compute(metric: torchmetrics.Metric, on: bool) -> None:
    """Whether ``metric.compute()`` gathers the copies of every process of its group.

    torchmetrics reads the choice from ``_to_sync``, which it copies from ``sync_on_compute``
    only when the metric is built (and after each ``forward``): assigning ``sync_on_compute``
    alone changes nothing, and a metric built with the default would still gather over
    whatever group the process has (on a GPU machine's NCCL group, from CPU tensors, it fails).
    """
    metric.sync_on_compute = on
    metric._to_sync = on


def state_size(metric: torchmetrics.Metric, names: Sequence[str]) -> int:
    return sum(getattr(metric, n).numel() for n in names)


class LocalMetricState:
    """One torchmetrics copy in this process (default and one-device strategies). With a
    process group, reading it gathers every process's copy (torchmetrics' own synchronisation)."""

    def __init__(self, template: torchmetrics.Metric, process_group: Any = None):
        self.metric = copy.deepcopy(template)
        if process_group is not None:
            sync_on_compute(self.metric, True)
            self.metric.process_group = process_group
        self._lock = threading.Lock()

    def update(self, *args: Any, **kwargs: Any) -> None:
        with self._lock:
            self.metric.update(*args, **kwargs)

    def merged(self) -> torchmetrics.Metric:
        return self.metric

    def reset(self) -> None:
        self.metric.reset()

    def leave_process_group(self) -> None:
        """Reads this process's copy alone from now on, and lets go of the group (its
        strategy has shut down; a reference kept would keep the group's threads alive)."""
        sync_on_compute(self.metric, False)
        self.metric.process_group = None

    def __getstate__(self) -> dict[str, Any]:
        return {"metric": self.metric}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.metric, self._lock = state["metric"], threading.Lock()


class PerReplicaMetricState:
    """One copy per replica of an in-process strategy (SyncOnRead): replica r updates copy r
    without locks; reading merges the copies. Updates outside the replicas go to copy 0."""

    def __init__(self, template: torchmetrics.Metric, replica_id: Callable[[], int | None], replicas: int):
        self.copies = [copy.deepcopy(template) for _ in range(replicas)]
        self._replica_id = replica_id

    def update(self, *args: Any, **kwargs: Any) -> None:
        self.copies[self._replica_id() or 0].update(*args, **kwargs)

    def merged(self) -> torchmetrics.Metric:
        total = copy.deepcopy(self.copies[0])
        for other in self.copies[1:]:
            if other.update_called:
                total.merge_state(other)
        return total

    def reset(self) -> None:
        for metric in self.copies:
            metric.reset()
