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
reduces (``training/loops.py``), so it needs states that add up too.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import torch
import torchmetrics
from torch import Tensor

from paramserve.coordinator.strategies.base import get_strategy
from paramserve.coordinator.strategies.metric_states import (
    MetricState,
    sync_on_compute,
)

__all__ = [
    "AUC",
    "Accuracy",
    "Mean",
    "Metric",
    "SparseCategoricalAccuracy",
]


class Metric:
    """A distributed metric over a torchmetrics metric (Keras' ``tf.keras.metrics.Metric``).

    Args:
        metric: the torchmetrics metric whose state this one keeps (copied).
        name: the name in logs (default: the torchmetrics class name in snake case).
        strategy: default the current one (build the metric in ``strategy.scope()``).
    """

    def __init__(self, metric: torchmetrics.Metric, name: str | None = None, strategy: Any = None):
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


# ------------------------------------------------------------------ where states live


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
