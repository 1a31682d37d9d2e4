"""``fit``, ``evaluate`` and ``predict``: Keras' ``Model.fit`` for PyTorch, under any strategy.

The same call trains under the default strategy, the in-process strategies
(OneDeviceStrategy, MirroredStrategy, CentralStorageStrategy),
MultiWorkerMirroredStrategy (one call per process) and ParameterServerStrategy;
only the strategy differs::

    history = fit(model, optimizer, nn.CrossEntropyLoss(reduction="none"), loader,
                  epochs=5, validation_data=(x_val, y_val), strategy=strategy)

Losses: ``loss_fn(outputs, targets)`` returns one loss per example (a torch
loss built with ``reduction="none"``, or any function returning a 1-D tensor;
element-wise losses of shape [batch, ...] are averaged per example). A loss
that reduces (``reduction="mean"``, a scalar) is refused with the fix.
``fit`` averages it with ``compute_average_loss`` (over the *global* batch), so N
replicas apply the same update as one device with the whole batch.

Data:
- in-process strategies: ``train_data`` is an iterable of ``(inputs, targets)``
  global batches (a DataLoader; ``experimental_distribute_dataset`` splits
  each one across the replicas), or a dataset function ``fn(InputContext)``
  returning per-replica batches (``distribute_datasets_from_function``).
  Without ``steps_per_epoch`` an epoch is one pass over the data; with it the
  data is iterated on across epochs and restarted when it runs out.
  ``steps_per_execution=K``: batch callbacks (and, under
  MultiWorkerMirroredStrategy, the cross-process reduction of the logs) once per K steps.
- ParameterServerStrategy: ``train_data`` is a dataset function
  ``fn(worker_context)`` run on every worker (``create_per_worker_dataset``)
  that yields batches without end; ``steps_per_epoch`` is required, as in TF.
  ``steps_per_execution=K`` packs K steps into one closure. Validation,
  ``evaluate`` and ``predict`` run on the coordinator, whose model pulls the
  variables' current values at each forward.

``validation_data`` and the ``data`` of ``evaluate`` are iterables of
``(inputs, targets)`` batches or one ``(inputs, targets)`` pair of tensors (one batch).

Metrics (default ``("accuracy",)``; ``metrics=()`` for none): names (``"accuracy"``) or
functions ``metric(outputs, targets) -> Tensor`` of per-example values (or a batch mean), reported as their mean
over all examples; pass a mapping to name functions. Logs hold ``loss``, each
metric, and ``val_``-prefixed ones after validation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from paramserve.coordinator.strategies.base import (
    ReduceOp,
    Strategy,
    get_strategy,
    strategy_of,
)
from paramserve.coordinator.strategies.step_runners import StepRunner, add_statistics
from paramserve.coordinator.training.arrays import ArrayData, as_tensor, split_validation
from paramserve.coordinator.training.callbacks import (
    Callback,
    CallbackList,
    History,
    Logs,
    TrainingState,
    with_defaults,
)

if TYPE_CHECKING:  # imported when first used: step_metrics brings torchmetrics (about a second)
    from paramserve.coordinator.training.step_metrics import Metrics, StepMetric

    _Named = tuple[StepMetric, ...]

__all__ = ["evaluate", "fit", "predict", "resolve_strategy"]

LossFn = Callable[[Tensor, Tensor], Tensor]


# ------------------------------------------------------------------ per-batch statistics


def _split(batch: Any) -> tuple[Tensor, Tensor]:
    if not isinstance(batch, (tuple, list)) or len(batch) < 2:
        raise TypeError(f"expected (inputs, targets) batches, got {type(batch).__name__}: yield (x, y) pairs")
    return batch[0], batch[1]


def _per_example_loss(loss_fn: LossFn, outputs: Tensor, targets: Tensor) -> Tensor:
    """``loss_fn``'s losses, one per example: element-wise losses (``MSELoss(reduction="none")``
    gives [batch, ...]) are averaged over all but the batch dimension, as Keras losses are."""
    losses = loss_fn(outputs, targets)
    if losses.dim() == 0:
        raise ValueError(
            "loss_fn returned a scalar; it must return one loss per example: build torch losses with "
            "reduction='none', e.g. nn.CrossEntropyLoss(reduction='none')"
        )
    return losses.flatten(1).mean(dim=1) if losses.dim() > 1 else losses


def _batch_stats(losses: Tensor, outputs: Tensor, targets: Tensor, metrics: _Named) -> Tensor:
    """[sum of losses, examples, each metric's state] of one batch, detached, in float64."""
    count = torch.tensor([float(losses.shape[0])], dtype=torch.float64, device=losses.device)
    parts = [losses.detach().double().sum().reshape(1), count]
    parts += [metric.stats(outputs, targets).to(losses.device) for metric in metrics]
    return torch.cat(parts)


def _logs(totals: Tensor | None, metrics: _Named, prefix: str = "") -> Logs:
    if totals is None or float(totals[1]) == 0:
        return {}
    logs = {f"{prefix}loss": float(totals[0]) / float(totals[1])}
    offset = 2
    for metric in metrics:
        logs[f"{prefix}{metric.name}"] = metric.value(totals[offset : offset + metric.size])
        offset += metric.size
    return logs


class TrainStep:
    """One training step of ``fit``: forward, per-example loss averaged over the global batch,
    backward, optimizer step; returns the batch's statistics (see ``_batch_stats``). Strategies
    run it where their steps run: in replica threads, or pickled onto parameter-server workers."""

    def __init__(self, model: nn.Module, optimizer: Any, loss_fn: LossFn, metrics: _Named):
        self.model, self.optimizer, self.loss_fn, self.metrics = model, optimizer, loss_fn, metrics

    def __call__(self, batch: Any, global_batch_size: int | None) -> Tensor:
        from paramserve.coordinator.strategies.losses import compute_average_loss

        inputs, targets = _split(batch)
        self.optimizer.zero_grad()
        outputs = self.model(inputs)
        losses = _per_example_loss(self.loss_fn, outputs, targets)
        compute_average_loss(losses, global_batch_size=global_batch_size).backward()
        self.optimizer.step()
        return _batch_stats(losses, outputs, targets, self.metrics)


# ------------------------------------------------------------------ fit


def fit(
    model: nn.Module,
    optimizer: Any,
    loss_fn: LossFn,
    train_data: Any,
    y: Any = None,
    *,
    batch_size: int | None = None,
    validation_split: float = 0.0,
    shuffle: bool = True,
    epochs: int = 1,
    steps_per_epoch: int | None = None,
    validation_data: Any = None,
    validation_steps: int | None = None,
    callbacks: Sequence[Callback] = (),
    strategy: Any = None,
    steps_per_execution: int = 1,
    metrics: Metrics = ("accuracy",),
    coordinator: Any = None,
    verbose: bool = True,
) -> History:
    """Trains ``model`` for ``epochs`` epochs (see the module docstring for data and losses).

    Args:
        optimizer: a torch.optim optimizer (in-process strategies) or the
            ServerOptimizer of ``strategy.optimizer(...)`` (ParameterServerStrategy).
        loss_fn: ``loss_fn(outputs, targets)`` -> per-example losses.
        train_data, y: batches or a dataset function (see above); or, as Keras'
            ``fit(x, y)``, the inputs and targets themselves (tensors or NumPy arrays),
            cut into ``batch_size`` batches (default 32), reshuffled every epoch when
            ``shuffle``; ``validation_split`` then holds out the last fraction of them
            as validation data (before shuffling, as Keras does).
        steps_per_epoch: steps per epoch; required under ParameterServerStrategy for
            dataset functions (in-memory ``x, y``: one pass over them).
        validation_data, validation_steps: evaluated after each epoch (``val_*`` logs).
        callbacks: Callback instances; a History is added (and returned), and a
            ProgressBar when ``verbose``.
        strategy: default: the strategy in whose scope ``model`` was built, else the
            strategy of the current scope (see :func:`resolve_strategy`).
        steps_per_execution: steps between batch callbacks (one closure under
            ParameterServerStrategy).
        metrics: see :func:`resolve_metrics`.
        coordinator: under ParameterServerStrategy, a ClusterCoordinator to use
            (default: one created, and shut down, by this call).

    Returns the History of the epochs run. Raises ValueError for bad arguments
    (naming the fix) and whatever a step or a callback raises; on an error the
    callbacks' ``on_train_end`` is skipped (a BackupAndRestore keeps its backup).
    """
    strategy = resolve_strategy(model, strategy)
    if y is not None:
        train_data, held_out = _in_memory(train_data, y, batch_size, validation_split, shuffle)
        validation_data = held_out if held_out is not None else validation_data
        steps_per_epoch = steps_per_epoch or len(train_data)
    elif batch_size is not None or validation_split:
        raise ValueError(
            "batch_size and validation_split cut in-memory inputs: pass fit(model, optimizer, loss, x, y, "
            "batch_size=...), or batch train_data yourself"
        )
    _check_fit_arguments(optimizer, loss_fn, train_data, epochs, steps_per_epoch, steps_per_execution)
    strategy.check_optimizer(optimizer)
    from paramserve.coordinator.training.step_metrics import resolve_metrics

    loop = Loop(
        epochs,
        steps_per_epoch,
        steps_per_execution,
        loss_fn,
        resolve_metrics(metrics),
        validation_data,
        validation_steps,
        tuple(callbacks),
        verbose,
    )
    runner = strategy.step_runner(
        TrainStep(model, optimizer, loss_fn, loop.metrics),
        train_data,
        steps_per_epoch=steps_per_epoch,
        coordinator=coordinator,
    )
    try:
        with strategy.scope():
            state = TrainingState(model, optimizer, strategy, epochs, steps_per_epoch or runner.epoch_length())
            return train(runner, state, loop)
    finally:
        runner.close()


def _in_memory(
    x: Any, y: Any, batch_size: int | None, validation_split: float, shuffle: bool
) -> tuple[ArrayData, ArrayData | None]:
    """Keras' ``fit(x, y, batch_size, validation_split)``: batches of the arrays, and the held-out part."""
    size = batch_size or 32
    (x_train, y_train), held = split_validation(as_tensor(x, "x"), as_tensor(y, "y"), validation_split)
    validation = ArrayData(*held, size, shuffle=False) if held is not None else None
    return ArrayData(x_train, y_train, size, shuffle=shuffle), validation


@dataclass(frozen=True)
class Loop:
    """What the training loop needs besides the runner: fit's settings."""

    epochs: int
    steps_per_epoch: int | None
    steps_per_execution: int
    loss_fn: LossFn
    metrics: _Named
    validation_data: Any
    validation_steps: int | None
    callbacks: tuple[Callback, ...]
    verbose: bool


def train(runner: StepRunner, state: TrainingState, loop: Loop) -> History:
    """The loop, the same for every strategy: epochs of executions, validation, and the callbacks."""
    callbacks, history = with_defaults(loop.callbacks, loop.verbose)
    hooks = CallbackList(callbacks, state)
    try:
        hooks.on_train_begin({})
        runner.prepare()
        for epoch in range(state.initial_epoch, state.epochs):
            state.epoch = epoch
            hooks.on_epoch_begin(epoch, {})
            logs = _run_epoch(runner, hooks, state, loop)
            if loop.validation_data is not None:
                logs.update(_validate(state, loop))
            hooks.on_epoch_end(epoch, logs)
            if state.stop_training:
                break
        hooks.on_train_end(_history_last(history))
    finally:
        hooks.close()
    return history


def _run_epoch(runner: StepRunner, hooks: CallbackList, state: TrainingState, loop: Loop) -> Logs:
    runner.begin_epoch()
    done = 0
    while loop.steps_per_epoch is None or done < loop.steps_per_epoch:
        wanted = _execution_size(done, loop.steps_per_epoch, loop.steps_per_execution)
        ran = runner.run(wanted)
        done += ran
        state.step += ran
        if ran:
            totals = runner.running_totals()
            logs = _logs(totals, loop.metrics)
            hooks.on_train_batch_end(state.step, logs)
            runner.report(state.step, logs, state.examples + _examples(totals))
        if ran < wanted:
            break
    if done == 0:
        raise ValueError(f"epoch {state.epoch} ran no step: train_data yielded no batch")
    totals = runner.end_epoch()
    state.examples += _examples(totals)
    logs = _logs(totals, loop.metrics)
    runner.report(state.step, logs, state.examples)
    return logs


def _examples(totals: Tensor | None) -> int:
    """The examples counted in ``totals`` (see ``_batch_stats``)."""
    return 0 if totals is None else int(totals[1])


def _execution_size(done: int, steps_per_epoch: int | None, steps_per_execution: int) -> int:
    """Steps in the next execution: K, or what is left of the epoch."""
    if steps_per_epoch is None:
        return steps_per_execution
    return min(steps_per_execution, steps_per_epoch - done)


def _validate(state: TrainingState, loop: Loop) -> Logs:
    results = evaluate(
        state.model,
        loop.loss_fn,
        loop.validation_data,
        steps=loop.validation_steps,
        metrics=loop.metrics,
        strategy=state.strategy,
        return_dict=True,
    )
    return {f"val_{key}": value for key, value in results.items()}


def _history_last(history: History) -> Logs:
    """The last epoch's logs in ``history`` (empty before any epoch)."""
    return {key: values[-1] for key, values in history.history.items() if values}


def resolve_strategy(model: nn.Module, strategy: Strategy | None) -> Strategy:
    """The strategy ``fit``/``evaluate``/``predict`` run ``model`` under: ``strategy`` when
    given, else the one whose scope built ``model`` (Keras' ``model.fit`` needs no strategy
    either), else the current scope's, else the default strategy.

    Raises ValueError when ``strategy`` (or the current scope's) is not the one that built
    ``model``: its replicas, mirrors or variables would be bypassed, silently or with an
    error deep in the step.
    """
    owner = strategy_of(model)
    chosen = strategy if strategy is not None else owner if owner is not None else get_strategy()
    if owner is not None and chosen is not owner:
        where = "passed as strategy=" if strategy is not None else "of the current scope"
        raise ValueError(
            f"{type(model).__name__} was built in {type(owner).__name__}.scope(), but the strategy {where} is "
            f"{type(chosen).__name__}: pass strategy=<the {type(owner).__name__}> (or leave strategy= out and "
            "call outside other strategies' scopes)"
        )
    return chosen


def _check_fit_arguments(
    optimizer: Any, loss_fn: LossFn, train_data: Any, epochs: int, steps_per_epoch: int | None, steps_per_execution: int
) -> None:
    if epochs < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    if steps_per_epoch is not None and steps_per_epoch < 1:
        raise ValueError(f"steps_per_epoch must be >= 1 or None, got {steps_per_epoch}")
    if steps_per_execution < 1:
        raise ValueError(f"steps_per_execution must be >= 1, got {steps_per_execution}")
    reduction = getattr(loss_fn, "reduction", "none")
    if reduction != "none":
        raise ValueError(
            f"loss_fn reduces with reduction={reduction!r}; fit needs per-example losses: build it with "
            f"reduction='none', e.g. {type(loss_fn).__name__}(reduction='none')"
        )
    if _is_pair_of_tensors(train_data):
        raise TypeError(
            "train_data is an (inputs, targets) pair of tensors: pass them as fit(model, optimizer, "
            "loss_fn, x, y, batch_size=64), or batch them, e.g. DataLoader(TensorDataset(x, y), "
            "batch_size=64, shuffle=True)"
        )


def _is_pair_of_tensors(data: Any) -> bool:
    return isinstance(data, (tuple, list)) and len(data) == 2 and all(isinstance(t, Tensor) for t in data)


# ------------------------------------------------------------------ evaluate and predict


def _batches(data: Any, steps: int | None) -> Iterator[Any]:
    if _is_pair_of_tensors(data) or isinstance(data, Tensor):
        data = [data]
    for index, batch in enumerate(data):
        if steps is not None and index >= steps:
            return
        yield batch


def evaluate(
    model: nn.Module,
    loss_fn: LossFn,
    data: Any,
    y: Any = None,
    *,
    batch_size: int | None = None,
    steps: int | None = None,
    metrics: Metrics | Sequence[StepMetric] = ("accuracy",),
    strategy: Any = None,
    return_dict: bool = False,
) -> Any:
    """The mean loss and metrics of ``model`` over ``data`` (at most ``steps`` batches).

    ``data``: an iterable of ``(inputs, targets)`` batches or one such pair of tensors; or,
    with ``y``, the inputs themselves (tensors or arrays, in ``batch_size`` batches).
    Returns, as Keras does, the loss alone when there are no metrics, else
    ``[loss, *metrics]`` in order; with ``return_dict``, ``{"loss": ..., <metric>: ...}``.
    Raises ValueError when ``data`` is empty.
    """
    if y is not None:
        data = ArrayData(as_tensor(data, "x"), as_tensor(y, "y"), batch_size or 32, shuffle=False)
    local = resolve_strategy(model, strategy).evaluation_strategy()
    from paramserve.coordinator.training.step_metrics import resolve_metrics

    named = resolve_metrics(metrics)

    def step(batch: Any) -> Tensor:
        inputs, targets = _split(batch)
        with torch.no_grad():  # per replica thread: no_grad is thread-local
            outputs = model(inputs)
            return _batch_stats(_per_example_loss(loss_fn, outputs, targets), outputs, targets, named)

    totals = None
    with local.scope(), _eval_mode(model):
        for batch in local.experimental_distribute_dataset(_Batches(data, steps)):
            totals = add_statistics(totals, local.reduce(ReduceOp.SUM, local.run(step, args=(batch,)), axis=None))
    if totals is None:
        raise ValueError("evaluate got no batch: give it data (and steps >= 1)")
    results = _logs(totals, named)
    if return_dict:
        return results
    return results["loss"] if len(results) == 1 else list(results.values())


def predict(
    model: nn.Module, data: Any, *, batch_size: int | None = None, steps: int | None = None, strategy: Any = None
) -> Tensor:
    """``model``'s outputs for every example of ``data``, concatenated along the batch axis.

    ``data``: an iterable of batches (a tensor of inputs, or a tuple whose first
    element is the inputs) or one tensor (or array; with ``batch_size``, cut into batches).
    Raises ValueError when ``data`` is empty.
    """
    if batch_size is not None:
        inputs = as_tensor(data, "x")
        data = [inputs[start : start + batch_size] for start in range(0, len(inputs), batch_size)]
    local = resolve_strategy(model, strategy).evaluation_strategy()

    def step(batch: Any) -> Tensor:
        inputs = batch[0] if isinstance(batch, (tuple, list)) else batch
        with torch.no_grad():
            return model(inputs)

    outputs: list[Tensor] = []
    with local.scope(), _eval_mode(model):
        for batch in local.experimental_distribute_dataset(_Batches(data, steps)):
            outputs.extend(t.cpu() for t in local.experimental_local_results(local.run(step, args=(batch,))))
    if not outputs:
        raise ValueError("predict got no batch: give it data (and steps >= 1)")
    return torch.cat(outputs)


class _Batches:
    """Re-iterable: ``data``'s batches (one pair or tensor is one batch), at most ``steps``."""

    def __init__(self, data: Any, steps: int | None):
        if steps is not None and steps < 1:
            raise ValueError(f"steps must be >= 1 or None, got {steps}")
        self._data, self._steps = data, steps

    def __iter__(self) -> Iterator[Any]:
        return _batches(self._data, self._steps)


class _eval_mode:
    """model.eval() inside, then the model's previous mode."""

    def __init__(self, model: nn.Module):
        self._model, self._was_training = model, model.training

    def __enter__(self) -> None:
        self._model.eval()

    def __exit__(self, *exc_info: object) -> None:
        self._model.train(self._was_training)
