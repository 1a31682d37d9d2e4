"""Metrics as ``fit``'s steps compute them: one float64 vector per step that strategies add up.

Every step returns ``[sum of losses, examples, *metric states]``. Each metric's part is
the state of a torchmetrics metric updated with that step's batch alone; states add up
(torchmetrics' sum-reduced states), so the sum over replicas, processes and closures,
made by the strategy's step runner exactly as for the loss, is the state of the metric
over the whole epoch, read at its end. Under ParameterServerStrategy these vectors come
back with the closures and are added on the coordinator once per closure that
succeeded: a retried closure counts once, and no step pushes metric state.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torchmetrics
from torch import Tensor

from paramserve.coordinator.metrics import ArgmaxMatches, Metric
from paramserve.coordinator.strategies.metric_states import (
    additive_states,
    flatten_states,
    load_states,
    state_size,
    sync_on_compute,
)

__all__ = ["MetricFn", "Metrics", "StepMetric", "resolve_metrics"]

MetricFn = Callable[[Tensor, Tensor], Tensor]
MetricLike = str | MetricFn | Metric | torchmetrics.Metric
Metrics = Sequence[MetricLike] | Mapping[str, MetricFn | Metric | torchmetrics.Metric]


class StepMetric:
    """One metric of ``fit``: its name, the torchmetrics metric it keeps, and how a batch's
    ``(outputs, targets)`` become that metric's ``update`` arguments."""

    def __init__(self, name: str, template: torchmetrics.Metric, prepare: Callable[..., tuple[Any, ...]]):
        self.name = name
        self.template = copy.deepcopy(template)
        self.template.reset()
        sync_on_compute(self.template, False)  # the strategy sums the states itself
        self.states = additive_states(self.template)
        self.size = state_size(self.template, self.states)
        self._prepare = prepare
        self._copies: dict[tuple[int, torch.device], torchmetrics.Metric] = {}
        self._lock = threading.Lock()

    def stats(self, outputs: Tensor, targets: Tensor) -> Tensor:
        """The state of this metric over one batch, as a float64 vector."""
        metric = self._copy(outputs.device)
        metric.reset()
        with torch.no_grad():
            metric.update(*self._prepare(outputs.detach(), targets))
        return flatten_states(metric, self.states)

    def value(self, flat: Tensor) -> float:
        """The metric over the batches whose summed ``stats`` ``flat`` is."""
        metric = copy.deepcopy(self.template)
        load_states(metric, self.states, flat)
        result = metric.compute()
        if result.numel() != 1:
            raise ValueError(
                f"metric {self.name!r} computes {tuple(result.shape)} values: fit logs one number per "
                "metric; configure it to average (e.g. average='micro')"
            )
        return float(result)

    def _copy(self, device: torch.device) -> torchmetrics.Metric:
        # Replicas call steps from their own threads: each thread updates its own copy.
        key = (threading.get_ident(), device)
        with self._lock:
            if key not in self._copies:
                self._copies[key] = copy.deepcopy(self.template).to(device)
            return self._copies[key]

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("_copies", "_lock")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._copies, self._lock = {}, threading.Lock()


def _mean_of(fn: MetricFn) -> Callable[..., tuple[Any, ...]]:
    """A per-example metric function (or one giving the batch mean) as MeanMetric arguments."""

    def prepare(outputs: Tensor, targets: Tensor) -> tuple[Any, ...]:
        values = fn(outputs, targets).double()
        if values.dim() == 0:  # a batch mean: weigh it by the batch
            return values, float(targets.shape[0]) if targets.dim() else 1.0
        return (values.reshape(-1),)

    return prepare


def _same(*args: Any) -> tuple[Any, ...]:
    return args


def _one(name: str | None, metric: Any) -> StepMetric:
    if isinstance(metric, str):
        if metric not in ("accuracy", "acc"):
            raise ValueError(
                f"unknown metric {metric!r}: use 'accuracy', a paramserve.coordinator.metrics "
                "metric, a torchmetrics metric or a function"
            )
        return StepMetric(name or "accuracy", ArgmaxMatches(), _same)
    if isinstance(metric, Metric):
        return StepMetric(name or metric.name, metric.template, metric.prepare)
    if isinstance(metric, torchmetrics.Metric):
        return StepMetric(name or _snake(type(metric).__name__), metric, _same)
    if callable(metric):
        label = name or getattr(metric, "__name__", "")
        if not label or label == "<lambda>":
            raise ValueError("a metric function needs a name: pass metrics={'name': fn}")
        return StepMetric(label, torchmetrics.MeanMetric().set_dtype(torch.float64), _mean_of(metric))
    raise TypeError(f"cannot use {type(metric).__name__} as a metric: pass a name, a metric object or a function")


def resolve_metrics(metrics: Metrics | Sequence[StepMetric]) -> tuple[StepMetric, ...]:
    """``metrics`` as StepMetrics: names (``"accuracy"``), paramserve or torchmetrics metric
    objects, per-example functions ``fn(outputs, targets)`` (reported as their mean), or a
    mapping naming any of those. Raises ValueError for an unknown name, an unnamed lambda or
    a metric whose state does not add up."""
    if isinstance(metrics, Mapping):
        return tuple(_one(str(name), metric) for name, metric in metrics.items())
    return tuple(m if isinstance(m, StepMetric) else _one(None, m) for m in metrics)


def _snake(name: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() and i else c.lower() for i, c in enumerate(name))
