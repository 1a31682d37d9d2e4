"""Metrics that aggregate under every strategy: Keras' metric objects, built on torchmetrics.

A metric built in ``strategy.scope()`` (or given ``strategy=``) keeps its state where
the strategy says (``Strategy.metric_state``), so that every replica's, process's and
worker's updates count, as TensorFlow's metrics do::

    with strategy.scope():
        train_accuracy = metrics.Accuracy()
    def step(x, y):                      # in strategy.run, or a closure on a worker
        ...
        train_accuracy.update_state(outputs, y)
    print(train_accuracy.result())       # the aggregate, in cross-replica context

Where the state lives:

- default and OneDeviceStrategy: one torchmetrics metric;
- MirroredStrategy / CentralStorageStrategy: one copy per replica, updated by its
  replica without locks, merged when read (torchmetrics' ``merge_state``);
- MultiWorkerMirroredStrategy: one copy per process, gathered across processes when
  read by torchmetrics' own synchronisation over the strategy's process group
  (``result()`` is then a collective: every process calls it);
- ParameterServerStrategy: each state tensor is a variable on the parameter servers;
  an update pushes its increment (an exactly-once push, so a retried closure counts
  once) and ``result()`` reads the servers' sum. Such states must add up
  (torchmetrics' ``dist_reduce_fx="sum"``).

``fit`` takes the same objects (or torchmetrics metrics, names, functions) in
``metrics=``; it sums their states through the step statistics it already
reduces (``training/fit.py``), so it needs states that add up too.
"""

from __future__ import annotations

import copy
import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torchmetrics
from torch import Tensor
from torchmetrics.utilities.data import dim_zero_sum

__all__ = [
    "AUC",
    "Accuracy",
    "Mean",
    "Metric",
    "MetricState",
    "SparseCategoricalAccuracy",
    "LocalMetricState",
    "PerReplicaMetricState",
    "additive_states",
]


class MetricState(Protocol):
    """Where a metric's state lives under one strategy (``Strategy.metric_state`` returns one)."""

    def update(self, *args: Any, **kwargs: Any) -> None:
        """Adds a batch to the state of the current replica, process or worker."""

    def merged(self) -> torchmetrics.Metric:
        """A torchmetrics metric holding the aggregate state (to ``compute()``)."""

    def reset(self) -> None:
        """Back to the empty state everywhere."""


class Metric:
    """A distributed metric over a torchmetrics metric (Keras' ``tf.keras.metrics.Metric``).

    Args:
        metric: the torchmetrics metric whose state this one keeps (copied).
        name: the name in logs (default: the torchmetrics class name in snake case).
        strategy: default the current one (build the metric in ``strategy.scope()``).
    """

    def __init__(self, metric: torchmetrics.Metric, name: str | None = None, strategy: Any = None):
        from paramserve.coordinator.strategies.base import get_strategy

        if not isinstance(metric, torchmetrics.Metric):
            raise TypeError(f"Metric wraps a torchmetrics.Metric, got {type(metric).__name__}")
        self.template = copy.deepcopy(metric)
        self.template.reset()
        sync_on_compute(self.template, False)  # a strategy decides how copies meet
        self.name = name or _snake(type(metric).__name__)
        self.strategy = strategy if strategy is not None else get_strategy()
        self._state: MetricState = self.strategy.metric_state(self.template, self.name)

    # Keras' names
    def update_state(self, *args: Any, **kwargs: Any) -> None:
        """Adds a batch (torchmetrics' ``update`` arguments, e.g. ``(outputs, targets)``)."""
        self._state.update(*self.prepare(*_detached(args)), **_detached(kwargs))

    @property
    def prepare(self) -> Callable[..., tuple[Any, ...]]:
        """Turns ``update_state``'s arguments into the torchmetrics ``update``'s (a function that
        pickles without the metric: ``fit`` sends it to workers)."""
        return _same

    def result(self) -> Tensor:
        """The metric over every update so far, on every replica, process and worker."""
        return self._state.merged().compute()

    def reset_state(self) -> None:
        self._state.reset()

    reset_states = reset_state  # TensorFlow 2's older name

    # torchmetrics' names
    update, compute, reset = update_state, result, reset_state

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        self.update_state(*args, **kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {type(self.template).__name__})"


class Mean(Metric):
    """The (weighted) mean of the values given (Keras' ``Mean``; torchmetrics' MeanMetric)."""

    def __init__(self, name: str = "mean", strategy: Any = None):
        super().__init__(torchmetrics.MeanMetric().set_dtype(torch.float64), name, strategy)


class ArgmaxMatches(torchmetrics.MeanMetric):
    """The fraction of examples whose argmax over the last axis equals the integer target
    (a binary output of one column: > 0.5 against 0/1 targets), in float64: the torchmetrics
    metric behind ``Accuracy`` and ``fit``'s "accuracy". ``update(outputs, targets)`` raises
    TypeError for floating-point targets of a multi-class output (see ``correct``)."""

    def __init__(self) -> None:
        super().__init__()
        self.set_dtype(torch.float64)

    def update(self, outputs: Tensor, targets: Tensor) -> None:  # type: ignore[override]
        super().update(correct(outputs, targets))


def correct(outputs: Tensor, targets: Tensor) -> Tensor:
    """1.0 per example whose predicted class is its target (Keras' sparse categorical accuracy).

    Raises TypeError for floating-point targets of a multi-class output (a regression)."""
    if outputs.dim() > 1 and outputs.shape[-1] > 1:
        if targets.is_floating_point():
            raise TypeError(
                "accuracy needs integer class targets, got floating-point ones: for a regression pass "
                "metrics=() or your own metric functions"
            )
        return (outputs.argmax(dim=-1) == targets).to(torch.float64)
    return ((outputs.reshape(targets.shape) > 0.5) == (targets > 0.5)).to(torch.float64)


class Accuracy(Metric):
    """Classification accuracy: the predicted class (argmax of the outputs) against integer
    targets; a single output column is a binary prediction thresholded at 0.5.

    ``update_state(outputs, targets)`` (torchmetrics' order), or Keras' ``(y_true, y_pred)``
    when the targets are integers and the outputs floating point (see ``torch_order``)."""

    def __init__(self, name: str = "accuracy", strategy: Any = None):
        super().__init__(ArgmaxMatches(), name, strategy)

    @property
    def prepare(self) -> Callable[..., tuple[Any, ...]]:
        return torch_order


SparseCategoricalAccuracy = Accuracy
"""Keras' name for the same metric."""


class AUC(Metric):
    """Area under the ROC curve of binary predictions (Keras' ``AUC``): torchmetrics'
    BinaryAUROC over ``num_thresholds`` fixed thresholds, so its state adds up.

    ``update_state(predictions, targets)``: probabilities (or logits, with ``from_logits``)
    and 0/1 targets; or class scores ``[batch, classes]`` and class ids, taken one-vs-rest
    over every (example, class) pair (Keras' AUC of one-hot labels). Keras' order
    ``(y_true, y_pred)`` is taken too when the targets are integers (or booleans) and the
    predictions floating point (``torch_order``); with floating-point targets the order is
    torchmetrics'."""

    def __init__(self, num_thresholds: int = 200, name: str = "auc", from_logits: bool = False, strategy: Any = None):
        self.from_logits = from_logits
        super().__init__(torchmetrics.classification.BinaryAUROC(thresholds=num_thresholds), name, strategy)

    @property
    def prepare(self) -> Callable[..., tuple[Any, ...]]:
        return functools.partial(_auc_inputs, from_logits=self.from_logits)


def torch_order(*args: Any) -> tuple[Any, ...]:
    """A classification metric's arguments as torchmetrics takes them, ``(predictions, targets,
    ...)``: Keras' ``(y_true, y_pred, ...)`` is recognised when the first is an integer or boolean
    tensor and the second a floating-point one (class ids and scores can be told apart only so),
    and swapped; anything else is left as given. Without this, Keras' order silently computed
    another number (an AUC of 0.54 for a perfect classifier)."""
    if (
        len(args) >= 2
        and isinstance(args[0], Tensor)
        and isinstance(args[1], Tensor)
        and not args[0].is_floating_point()
        and args[1].is_floating_point()
    ):
        return (args[1], args[0], *args[2:])
    return args


def _auc_inputs(*args: Any, from_logits: bool) -> tuple[Any, ...]:
    predictions, targets, *rest = torch_order(*args)
    if predictions.dim() > 1 and predictions.shape[-1] > 1 and predictions.numel() != targets.numel():
        # Class scores and class ids: one-vs-rest over every (example, class), as Keras'
        # AUC flattens one-hot labels (multi_label=False).
        classes = predictions.shape[-1]
        probabilities = predictions.softmax(-1) if from_logits else predictions
        return (probabilities.reshape(-1), torch.nn.functional.one_hot(targets.long(), classes).reshape(-1))
    predictions = predictions.reshape(targets.shape)
    if from_logits:
        predictions = predictions.sigmoid()
    return (predictions, targets.long(), *rest)


def _same(*args: Any) -> tuple[Any, ...]:
    return args


# ------------------------------------------------------------------ states as tensors that add up


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


# ------------------------------------------------------------------ where states live


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


def _snake(name: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() and i else c.lower() for i, c in enumerate(name))


def _detached(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach()
    if isinstance(value, tuple):
        return tuple(_detached(v) for v in value)
    if isinstance(value, dict):
        return {k: _detached(v) for k, v in value.items()}
    return value
