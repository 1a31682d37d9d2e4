"""The Strategy API every paramserve strategy implements (tf.distribute's, in PyTorch idiom).

Contexts, as in tf.distribute:
- *cross-replica context*: inside ``strategy.scope()`` but not inside ``run``;
  ``get_replica_context()`` returns None there.
- *replica context*: inside ``strategy.run(fn)``, once per replica (for
  in-process strategies, each replica runs in its own thread);
  ``get_replica_context()`` returns that replica's ReplicaContext.
- outside any scope the *default strategy* is current and every code path is
  the default replica context.

Each thread keeps its own stack of active strategies/replica contexts.
"""

from __future__ import annotations

import abc
import contextlib
import copy
import enum
import os
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from paramserve.coordinator import nest
from paramserve.worker.resources import InputContext
from paramserve.worker.variables import steps_elsewhere

if TYPE_CHECKING:
    from paramserve.coordinator.strategies.step_runners import StepFn, StepRunner
    from paramserve.coordinator.strategies.training_state import TrainingCheckpoints


class ReduceOp(enum.Enum):
    SUM = "SUM"
    MEAN = "MEAN"


class ReplicaContext:
    """The context of one replica while ``strategy.run`` executes it."""

    def __init__(self, strategy: Strategy, replica_id_in_sync_group: int):
        self.strategy = strategy
        self.replica_id_in_sync_group = replica_id_in_sync_group

    @property
    def num_replicas_in_sync(self) -> int:
        return self.strategy.num_replicas_in_sync

    def all_reduce(self, reduce_op: ReduceOp | str, value: Any) -> Any:
        """Reduces ``value`` (a tensor or a nest of tensors) across all replicas;
        every replica gets the result. All replicas must call it."""
        return self.strategy._replica_all_reduce(
            self, ReduceOp(reduce_op) if isinstance(reduce_op, str) else reduce_op, value
        )

    def __repr__(self) -> str:
        return f"ReplicaContext({type(self.strategy).__name__}, replica {self.replica_id_in_sync_group})"


class Strategy(abc.ABC):
    """How to distribute computation: the same training code runs under any strategy."""

    # ------------------------------------------------------------------ scope and contexts

    @contextlib.contextmanager
    def scope(self) -> Iterator[Strategy]:
        """Modules and optimizers created inside become distributed by this strategy."""
        _stack().append(_Entry(self, None))
        try:
            with self._scope_hooks():
                yield self
        finally:
            _stack().pop()

    @contextlib.contextmanager
    def _scope_hooks(self) -> Iterator[None]:
        """What a strategy does while its scope is open (e.g. capture new modules)."""
        yield

    @property
    @abc.abstractmethod
    def num_replicas_in_sync(self) -> int: ...

    # ------------------------------------------------------------------ running

    @abc.abstractmethod
    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None) -> Any:
        """Runs ``fn`` once per replica (in replica context); arguments that are
        PerReplica values give each replica its own component. Returns per-replica results."""

    @abc.abstractmethod
    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: int | None = None) -> Any:
        """Combines a per-replica value into one tensor (cross-replica context).
        With ``axis``, each replica's tensor is first reduced along that axis."""

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        """The components of a distributed value held in this process (a plain value: itself)."""
        from paramserve.coordinator.strategies.distributed_values import DistributedValue

        if isinstance(value, DistributedValue):
            return tuple(value.values)
        return (value,)

    # ------------------------------------------------------------------ input

    @abc.abstractmethod
    def experimental_distribute_dataset(self, dataset: Iterable[Any]) -> Iterable[Any]:
        """Splits each global batch of ``dataset`` evenly across the replicas (and
        shards the dataset across workers); yields PerReplica batches."""

    @abc.abstractmethod
    def distribute_datasets_from_function(self, dataset_fn: Callable[[InputContext], Iterable[Any]]) -> Iterable[Any]:
        """Calls ``dataset_fn`` once per input pipeline with its InputContext; the
        function returns per-replica batches."""

    # ------------------------------------------------------------------ what fit and its callbacks ask

    @property
    def is_chief(self) -> bool:
        """Whether this process writes files (checkpoints, summaries): True, except on the
        non-chief processes of a multi-process strategy."""
        return True

    def step_runner(
        self, step: StepFn, train_data: Any, *, steps_per_epoch: int | None, coordinator: Any = None
    ) -> StepRunner:
        """How ``fit`` runs ``step`` over ``train_data`` under this strategy (here: in this
        process, with ``run`` on distributed batches). Raises TypeError/ValueError for data
        this strategy cannot train on."""
        from paramserve.coordinator.strategies.step_runners import InProcessStepRunner  # imports this module

        return InProcessStepRunner(self, step, train_data, steps_per_epoch)

    def evaluation_strategy(self) -> Strategy:
        """The strategy ``evaluate``/``predict`` run under in this process (this one)."""
        return self

    def training_checkpoints(self, directory: str | os.PathLike[str], keep: int) -> TrainingCheckpoints:
        """Where ModelCheckpoint and BackupAndRestore keep training state (here: torch files)."""
        from paramserve.coordinator.strategies.training_state import TorchFileCheckpoints

        return TorchFileCheckpoints(directory, keep)

    def check_optimizer(self, optimizer: Any) -> None:
        """Raises ValueError when ``optimizer`` updates another strategy's variables (``fit``
        asks before training): a parameter-server optimizer steps only under its strategy."""
        if steps_elsewhere(optimizer, self):
            raise ValueError(
                "the optimizer comes from ParameterServerStrategy.optimizer(): pass that strategy to "
                "fit as strategy= (or call fit inside its scope())"
            )

    def learning_rate(self, optimizer: Any) -> float:
        """The learning rate ``optimizer`` applies now."""
        return float(_param_groups(optimizer)[0]["lr"])

    def set_learning_rate(self, optimizer: Any, lr: float) -> None:
        """Makes ``optimizer`` apply ``lr`` from its next step (every parameter group)."""
        for group in _param_groups(optimizer):
            group["lr"] = lr

    def metric_state(self, template: Any, name: str) -> Any:
        """Where a metric built under this strategy keeps its state (a ``metrics.MetricState``
        over a copy of the torchmetrics metric ``template``): here one copy in this process."""
        from paramserve.coordinator.metrics import LocalMetricState

        return LocalMetricState(template)

    can_restore_model_weights: bool = True
    """Whether ``load_model_weights`` works (EarlyStopping's restore_best_weights needs it)."""

    def model_weights(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """A copy of ``model``'s state_dict, as it is now."""
        return copy.deepcopy(model.state_dict())

    def load_model_weights(self, model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
        model.load_state_dict(weights)

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Ends the strategy: stops what it started (threads, connections, process groups) and
        leaves the modules and optimizers built in its scope as plain torch objects, with no
        process-wide hook of its left behind. Idempotent; nothing to do by default."""
        return None

    # ------------------------------------------------------------------ which models are this strategy's

    def _claim_models(self, roots: Iterable[torch.nn.Module]) -> None:
        """Records ``roots`` as built in this strategy's scope, so that ``fit``/``evaluate``/``predict``
        called without ``strategy=`` use this strategy for them (as Keras' ``model.fit`` does).
        Strategies call it once a scope's models are distributed (never for a failed build)."""
        for root in roots:
            _models[root] = self

    def _release_models(self) -> None:
        """Forgets the models claimed by this strategy (``close()`` calls it)."""
        for model in [m for m, owner in list(_models.items()) if owner is self]:
            _models.pop(model, None)

    # ------------------------------------------------------------------ replica plumbing

    def _replica_all_reduce(self, context: ReplicaContext, reduce_op: ReduceOp, value: Any) -> Any:
        """Default (one replica): the value itself."""
        return value

    @property
    def _local_replicas(self) -> int:
        """How many of the replicas in sync this process holds (all of them, unless the
        strategy spans processes)."""
        return self.num_replicas_in_sync

    def _local_index(self, replica_id: int) -> int:
        """Where replica ``replica_id`` is among this process's replicas."""
        return replica_id

    def _sum_across_processes(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over the processes of the strategy (a collective where it spans
        several; here the tensor itself)."""
        return tensor

    @contextlib.contextmanager
    def _in_replica(self, replica_id: int) -> Iterator[ReplicaContext]:
        """Enters replica context for this thread (used by ``run`` implementations)."""
        context = ReplicaContext(self, replica_id)
        _stack().append(_Entry(self, context))
        try:
            yield context
        finally:
            _stack().pop()


class SingleReplicaStrategy(Strategy):
    """A strategy with one replica where it runs: ``run(fn)`` calls fn in replica context."""

    @property
    def num_replicas_in_sync(self) -> int:
        return 1

    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None) -> Any:
        with self._in_replica(0):
            return fn(*args, **(kwargs or {}))

    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: int | None = None) -> Any:
        op = ReduceOp(reduce_op) if isinstance(reduce_op, str) else reduce_op
        if axis is not None and isinstance(value, torch.Tensor):
            value = value.sum(dim=axis) if op is ReduceOp.SUM else value.mean(dim=axis)
        return detached(value)

    def experimental_distribute_dataset(self, dataset: Iterable[Any]) -> Iterable[Any]:
        return dataset

    def distribute_datasets_from_function(self, dataset_fn: Callable[[InputContext], Iterable[Any]]) -> Iterable[Any]:
        return dataset_fn(InputContext())


class DefaultStrategy(SingleReplicaStrategy):
    """The no-op strategy current when no other is in scope: ``run(fn)`` simply calls fn.
    A singleton: get it with ``get_strategy()``."""

    _instance: DefaultStrategy | None = None
    _lock = threading.Lock()

    def __new__(cls) -> DefaultStrategy:
        with cls._lock:
            if cls._instance is None:
                cls._instance = super().__new__(cls)
            return cls._instance


# ------------------------------------------------------------------ the per-thread stack


@dataclass(frozen=True)
class _Entry:
    strategy: Strategy
    replica: ReplicaContext | None


_local = threading.local()

_models: weakref.WeakKeyDictionary[torch.nn.Module, Strategy] = weakref.WeakKeyDictionary()
"""Each model built in a strategy's scope -> that strategy (until it is closed)."""


def strategy_of(model: torch.nn.Module) -> Strategy | None:
    """The strategy in whose scope ``model`` was built (None: none, or it was closed)."""
    return _models.get(model)


def detached(value: Any) -> Any:
    """``value`` with every tensor detached from autograd: what ``reduce`` returns, so that
    ``total += strategy.reduce(...)`` does not keep each step's graph alive (tf.distribute's
    reduced values are plain tensors too)."""
    return nest.map_structure(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, value)


def _stack() -> list[_Entry]:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def get_strategy() -> Strategy:
    """The strategy whose scope (or run) is current in this thread, else the default strategy."""
    stack = _stack()
    return stack[-1].strategy if stack else DefaultStrategy()


def has_strategy() -> bool:
    """True inside a non-default strategy's scope."""
    return not isinstance(get_strategy(), DefaultStrategy)


def get_replica_context() -> ReplicaContext | None:
    """The current ReplicaContext; None in cross-replica context (inside a scope, outside run);
    the default replica context outside every scope."""
    stack = _stack()
    if not stack:
        return ReplicaContext(DefaultStrategy(), 0)
    return stack[-1].replica


def in_cross_replica_context() -> bool:
    return get_replica_context() is None


@contextlib.contextmanager
def replica_thread_context(strategy: Strategy, replica_id: int) -> Iterator[ReplicaContext]:
    """For strategies that run replicas in new threads: enter the scope and the replica context there."""
    _stack().append(_Entry(strategy, None))
    try:
        with strategy._in_replica(replica_id) as context:
            yield context
    finally:
        _stack().pop()


def _param_groups(optimizer: Any) -> list[dict[str, Any]]:
    groups = getattr(optimizer, "param_groups", None)
    if not groups:
        raise TypeError(f"expected a torch.optim optimizer (with param_groups), got {type(optimizer).__name__}")
    return groups
