"""The Strategy API every paramserve strategy implements (tf.distribute's, in PyTorch idiom).

Contexts, as in tf.distribute:
- *cross-replica context*: inside ``strategy.scope()`` but not inside ``run``;
  ``get_replica_context()`` returns None there.
- *replica context*: inside ``strategy.run(fn)``, once per replica (for
  in-process strategies, each replica runs in its own thread);
  ``get_replica_context()`` returns that replica's ReplicaContext.
- outside any scope the *default strategy* is current and every code path is
  the default replica context.

Each thread keeps its own stack of active strategies/replica contexts;
``experimental_set_strategy`` makes one strategy current for every thread without a scope of
its own (as TensorFlow's does, for notebooks).
"""

from __future__ import annotations

import abc
import contextlib
import copy
import enum
import os
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from paramserve.coordinator import nest
from paramserve.worker.layers import steps_elsewhere
from paramserve.worker.resources import InputContext

if TYPE_CHECKING:
    from paramserve.coordinator.cluster_resolver import ClusterResolver
    from paramserve.coordinator.strategies.distributed_values import ValueContext
    from paramserve.coordinator.strategies.extended import StrategyExtended
    from paramserve.coordinator.strategies.input import InputOptions
    from paramserve.coordinator.strategies.step_runners import StepFn, StepRunner
    from paramserve.coordinator.strategies.training_state import TrainingCheckpoints


class ReduceOp(enum.Enum):
    SUM = "SUM"
    MEAN = "MEAN"


class ReplicaContext:
    """The context of one replica while ``strategy.run`` executes it (tf.distribute.ReplicaContext);
    outside every scope, ``get_replica_context()`` gives the default one: replica 0 of 1."""

    def __init__(self, strategy: Strategy, replica_id_in_sync_group: int):
        self._strategy = strategy
        self._replica_id = replica_id_in_sync_group

    @property
    def strategy(self) -> Strategy:
        """The strategy running this replica."""
        return self._strategy

    @property
    def replica_id_in_sync_group(self) -> int:
        """This replica's id, 0 to ``num_replicas_in_sync - 1``, across every process of the strategy."""
        return self._replica_id

    @property
    def num_replicas_in_sync(self) -> int:
        return self.strategy.num_replicas_in_sync

    def all_reduce(self, reduce_op: ReduceOp | str, value: Any) -> Any:
        """Reduces ``value`` (a tensor or a nest of tensors) across all replicas;
        every replica gets the result. All replicas must call it."""
        return self.strategy.replica_all_reduce(
            self, ReduceOp(reduce_op) if isinstance(reduce_op, str) else reduce_op, value
        )

    def all_gather(self, value: Any, axis: int) -> Any:
        """Concatenates ``value`` (a tensor or a nest of tensors) of every replica along ``axis``, in
        replica order; every replica gets the result, on its own device. All replicas must call it,
        in the same order. Shapes may differ along ``axis`` only (across processes, not at all).
        Gradients flow back as in TensorFlow: replica r's input gets its slice of the sum of every
        replica's gradient, so each replica must then call ``backward`` through it too.

        Raises:
            ValueError: a scalar value or ``axis`` out of range (gather along an existing axis),
                or shapes that differ elsewhere than along ``axis``.
        """
        from paramserve.coordinator.strategies.gathering import AllGather, normalized_axis

        tensors = [torch.as_tensor(leaf) for leaf in nest.flatten(value)]
        if not tensors:
            return value
        axes = {normalized_axis(tensor, axis, "all_gather") for tensor in tensors}
        if len(axes) > 1:
            raise ValueError(
                f"all_gather: axis {axis} names different axes of tensors of different ranks: use axis >= 0"
            )
        gathered = AllGather.apply(self, axes.pop(), *tensors)
        leaves = iter(gathered)
        return nest.map_structure(lambda _: next(leaves), value)

    def merge_call(
        self, merge_fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        """Runs ``merge_fn(strategy, *args, **kwargs)`` once, in cross-replica context, with the
        arguments of every replica merged: a value that differs between replicas becomes a
        PerReplica (component r: replica r's), one every replica passed as the same object stays
        itself. Every replica gets the result, each distributed value in it (a PerReplica or
        Mirrored, not a SyncOnReadVariable) replaced by its own component. A merge point, like
        ``optimizer.step()``: every replica must call it, the same number of times.

        Raises whatever ``merge_fn`` raises (the other replicas then stop with ReplicaDeparted).
        """
        return self.strategy.replica_merge_call(self, merge_fn, tuple(args), dict(kwargs or {}))

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

    cluster_resolver: ClusterResolver | None = None
    """Where the strategy's cluster comes from (tf.distribute.Strategy.cluster_resolver): None for the
    strategies that live in one process; MultiWorkerMirroredStrategy sets its own."""

    @property
    def extended(self) -> StrategyExtended:
        """The API for distribution-aware algorithms (tf.distribute.StrategyExtended): devices,
        ``reduce_to``, ``update``... One object per strategy."""
        from paramserve.coordinator.strategies.extended import extended_of  # imports this module

        return extended_of(self)

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

        adopt_global_scope(self)
        if isinstance(value, DistributedValue):
            return tuple(value.values)
        return (value,)

    def gather(self, value: Any, axis: int) -> Any:
        """Concatenates the components of a distributed value (what ``run`` returned) along
        ``axis``, in replica order (tf.distribute.Strategy.gather): a detached tensor, on the host
        CPU when it joins several components (one component stays where it is); a structure of
        values gives a structure of tensors. Cross-replica context only. Under a strategy that
        spans processes every process must call it (a collective) and gets the whole result.

        Raises:
            RuntimeError: called inside ``run`` (use ``get_replica_context().all_gather`` there).
            ValueError: not a per-replica value of this strategy's replicas, a scalar, or ``axis``
                out of range.
        """
        self.require_cross_replica("strategy.gather", "get_replica_context().all_gather(value, axis)")
        if self.local_replicas < self.num_replicas_in_sync:  # the other components are in other processes
            result = self.run(lambda v: _current_context().all_gather(v, axis), args=(value,))
            return detached(nest.map_structure(lambda v: self.experimental_local_results(v)[0], result))
        return detached(nest.map_structure(lambda v: self._gather_local(v, axis), value))

    def _gather_local(self, value: Any, axis: int) -> torch.Tensor:
        from paramserve.coordinator.strategies.gathering import normalized_axis

        parts = [torch.as_tensor(part) for part in self.experimental_local_results(value)]
        if len(parts) != self.local_replicas:
            raise ValueError(
                f"cannot gather a {type(value).__name__}: it is not a per-replica value of this strategy's "
                f"{self.local_replicas} replicas (every replica returned the same object): gather what run returns"
            )
        for part in parts:
            axis = normalized_axis(part, axis, "gather")
        if len(parts) == 1:
            return parts[0]
        return torch.cat([part.to("cpu") for part in parts], dim=axis)

    def experimental_distribute_values_from_function(self, value_fn: Callable[[ValueContext], Any]) -> Any:
        """Distributed values for ``run``, ``reduce`` and the rest when the input is not a dataset
        (tf.distribute's method): ``value_fn(ValueContext)`` is called once for each replica this
        process holds, in replica order. With one replica here: its value itself; with several, a
        PerReplica."""
        from paramserve.coordinator.strategies.distributed_values import PerReplica, ValueContext

        values = [value_fn(ValueContext(r, self.num_replicas_in_sync)) for r in self._local_replica_ids()]
        return values[0] if len(values) == 1 else PerReplica(values)

    # ------------------------------------------------------------------ input

    @abc.abstractmethod
    def experimental_distribute_dataset(
        self, dataset: Iterable[Any], options: InputOptions | None = None
    ) -> Iterable[Any]:
        """Splits each global batch of ``dataset`` evenly across the replicas (and
        shards the dataset across workers); yields PerReplica batches. ``options``:
        TF's InputOptions (device placement, short last batches)."""

    @abc.abstractmethod
    def distribute_datasets_from_function(
        self, dataset_fn: Callable[[InputContext], Iterable[Any]], options: InputOptions | None = None
    ) -> Iterable[Any]:
        """Calls ``dataset_fn`` once per input pipeline (or per replica, with
        ``InputReplicationMode.PER_REPLICA``) with its InputContext; the function returns
        per-replica batches."""

    # ------------------------------------------------------------------ TensorFlow's deprecated spellings

    def experimental_run_v2(
        self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        """``run``'s name before TensorFlow 2.2; warns (DeprecationWarning, once) naming ``run``."""
        _warn_renamed("experimental_run_v2", "run")
        return self.run(fn, args, kwargs)

    def experimental_distribute_datasets_from_function(
        self, dataset_fn: Callable[[InputContext], Iterable[Any]], options: InputOptions | None = None
    ) -> Iterable[Any]:
        """``distribute_datasets_from_function``'s name before TensorFlow 2.4; warns
        (DeprecationWarning, once) naming it."""
        _warn_renamed("experimental_distribute_datasets_from_function", "distribute_datasets_from_function")
        return self.distribute_datasets_from_function(dataset_fn, options)

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
        """Where a metric built under this strategy keeps its state (a ``metric_states.MetricState``
        over a copy of the torchmetrics metric ``template``): here one copy in this process."""
        from paramserve.coordinator.strategies.metric_states import LocalMetricState

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

    # ------------------------------------------------------------------ what replicas and values ask
    # The strategies package's side of the Strategy API: ReplicaContext, SyncOnReadVariable,
    # gathering and StrategyExtended call these, and each strategy overrides what differs.
    # Users call ReplicaContext's and ``strategy.extended``'s methods instead.

    def replica_all_reduce(self, context: ReplicaContext, reduce_op: ReduceOp, value: Any) -> Any:
        """``ReplicaContext.all_reduce`` for replica ``context``: ``value`` (a nest of tensors)
        reduced across every replica, as this replica receives it. Default (one replica): the
        value itself."""
        return value

    @property
    def local_replicas(self) -> int:
        """How many of the replicas in sync this process holds (all of them, unless the
        strategy spans processes)."""
        return self.num_replicas_in_sync

    def local_index(self, replica_id: int) -> int:
        """Where replica ``replica_id`` is among this process's replicas (its component's index
        in a distributed value this process holds)."""
        return replica_id

    def sum_across_processes(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over the processes of the strategy (a collective where it spans
        several: every process must call it; here the tensor itself)."""
        return tensor

    def replica_merge_call(
        self, context: ReplicaContext, merge_fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """``ReplicaContext.merge_call`` for replica ``context`` (its promise is that method's).
        Default, where this process holds one replica: ``merge_fn`` on its own arguments (under
        a multi-process strategy it may reduce across processes itself)."""
        from paramserve.coordinator.strategies.distributed_values import select_replica

        with self.cross_replica_context():
            result = merge_fn(self, *args, **kwargs)
        return select_replica(result, self.local_index(context.replica_id_in_sync_group))

    def replica_all_gather(self, context: ReplicaContext, tensors: list[torch.Tensor], axis: int) -> list[torch.Tensor]:
        """``ReplicaContext.all_gather`` of ``tensors`` for replica ``context``, without its
        gradient (``gathering.AllGather`` adds it): tensor i of every replica concatenated along
        ``axis`` in replica order. Default, where this process holds one replica: each tensor goes
        in its replica's place of a zero tensor N times longer along ``axis`` and these are summed
        over the processes (``sum_across_processes``), which leaves the concatenation.

        Raises:
            ValueError: shapes that differ between the processes.
        """
        from paramserve.coordinator.strategies.gathering import gather_by_sum

        return gather_by_sum(self, context.replica_id_in_sync_group, tensors, axis)

    def _local_replica_ids(self) -> list[int]:
        """The ids of the replicas this process holds, as its ``run`` numbers them."""
        if self.local_replicas == self.num_replicas_in_sync:
            return list(range(self.num_replicas_in_sync))
        ids = self.run(lambda: _current_context().replica_id_in_sync_group)  # asked of run: it alone knows
        return [int(i) for i in self.experimental_local_results(ids)]

    def current_replica(self) -> ReplicaContext | None:
        """This thread's ReplicaContext when it runs one of this strategy's replicas (in ``run``);
        None elsewhere, in a merge_call's ``merge_fn`` too."""
        stack = _stack()
        if stack and stack[-1].replica is not None and stack[-1].replica.strategy is self:
            return stack[-1].replica
        return None

    def require_cross_replica(self, what: str, instead: str) -> None:
        """Returns when this thread is not in one of this strategy's replicas.

        Raises:
            RuntimeError: it is (inside ``run``): the message says ``what`` is for cross-replica
                context and to use ``instead`` there.
        """
        if self.current_replica() is not None:
            raise RuntimeError(f"{what} is for cross-replica context (outside run); inside run use {instead}")

    @contextlib.contextmanager
    def cross_replica_context(self) -> Iterator[None]:
        """This strategy's cross-replica context in this thread, even inside one of its replicas
        (a merge_call's merge_fn, an update's fn): ``get_replica_context()`` is None there."""
        _stack().append(_Entry(self, None))
        try:
            yield
        finally:
            _stack().pop()

    # ------------------------------------------------------------------ what StrategyExtended asks
    # ``strategy.extended`` answers through these (see extended.py); each strategy overrides
    # what differs. For the strategies package: users call ``strategy.extended``'s methods.

    def worker_devices(self) -> tuple[str, ...]:
        """The names of the devices this process's replicas compute on
        (``extended.worker_devices``).

        Raises:
            RuntimeError: the strategy has none here (the default strategy, as in TensorFlow).
        """
        raise RuntimeError(
            f"{type(self).__name__} does not compute on devices it chooses in this process (TensorFlow's default "
            "strategy has no worker devices either): use a strategy with devices, e.g. OneDeviceStrategy('cpu')"
        )

    def parameter_devices(self) -> tuple[str, ...]:
        """The names of the devices this process keeps variables on (``extended.parameter_devices``;
        by default: where it computes). Raises RuntimeError where ``worker_devices`` does."""
        return self.worker_devices()

    def colocation_refusal(self) -> str | None:
        """Why ``extended.colocate_vars_with`` cannot hold under this strategy, as the message of
        its NotImplementedError (None: it holds)."""
        return None

    def variable_copies(self, var: Any) -> tuple[Any, ...]:
        """Every copy of ``var`` that ``extended.update`` must change, in replica order (by
        default its local results: ``var`` itself for a plain value)."""
        return self.experimental_local_results(var)

    def after_update(self, var: Any) -> None:
        """What the strategy does once ``extended.update`` has changed every copy of ``var``
        (nothing by default)."""
        return None

    def owns_variable(self, v: Any) -> bool:
        """Whether ``v`` is a parameter or buffer of a module built in this strategy's scope, or a
        SyncOnReadVariable of this strategy (``extended.variable_created_in_scope``)."""
        from paramserve.coordinator.strategies.distributed_values import SyncOnReadVariable

        if isinstance(v, SyncOnReadVariable):
            return v.strategy is self
        if not isinstance(v, torch.Tensor):
            return False
        models = [model for model, owner in list(_models.items()) if owner is self]
        return any(t is v for model in models for t in (*model.parameters(), *model.buffers()))

    def value_container(self, value: Any) -> Any:
        """The variable that ``value``, one replica's copy of it, belongs to (itself when none;
        ``extended.value_container``)."""
        return value

    def reduce_to_devices(self, reduce_op: ReduceOp, value: Any, devices: list[torch.device]) -> Any:
        """``extended.reduce_to`` once its destinations are devices: ``reduce``, then the result on
        each of ``devices`` (a tensor for one device, a Mirrored of copies for several). Raises
        what ``reduce`` raises (ValueError: SUM of a value that is not per-replica)."""
        from paramserve.coordinator.strategies.distributed_values import Mirrored

        reduced = torch.as_tensor(self.reduce(reduce_op, value))
        if len(devices) == 1:
            return reduced.to(devices[0])
        return Mirrored([reduced.to(device, copy=True) for device in devices])

    @contextlib.contextmanager
    def _in_replica(self, replica_id: int) -> Iterator[ReplicaContext]:
        """Enters replica context for this thread (used by ``run`` implementations)."""
        adopt_global_scope(self)
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

    def experimental_distribute_dataset(
        self, dataset: Iterable[Any], options: InputOptions | None = None
    ) -> Iterable[Any]:
        return dataset  # one replica on this process's device: nothing to split or place

    def distribute_datasets_from_function(
        self, dataset_fn: Callable[[InputContext], Iterable[Any]], options: InputOptions | None = None
    ) -> Iterable[Any]:
        return dataset_fn(InputContext())


class DefaultStrategy(SingleReplicaStrategy):
    """The no-op strategy current when no other is in scope: ``run(fn)`` simply calls fn.
    A singleton: get it with ``get_strategy()``."""

    def owns_variable(self, v: Any) -> bool:
        """As TensorFlow's default strategy: a variable that no other strategy created."""
        from paramserve.coordinator.strategies.distributed_values import SyncOnReadVariable

        if isinstance(v, SyncOnReadVariable):
            return v.strategy is self
        owners = {id(owner): owner for owner in list(_models.values())}.values()
        return isinstance(v, torch.Tensor) and not any(owner.owns_variable(v) for owner in owners)

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
    """The strategy whose scope (or run) is current in this thread, else the one
    ``experimental_set_strategy`` made current, else the default strategy."""
    stack = _stack()
    if stack:
        return stack[-1].strategy
    current = _global
    return current.strategy if current is not None else DefaultStrategy()


def has_strategy() -> bool:
    """True inside a non-default strategy's scope (or while one is set)."""
    return not isinstance(get_strategy(), DefaultStrategy)


def get_replica_context() -> ReplicaContext | None:
    """The current ReplicaContext; None in cross-replica context (inside a scope, outside run,
    or while ``experimental_set_strategy`` has set one); the default replica context outside
    every scope."""
    stack = _stack()
    if stack:
        return stack[-1].replica
    return None if _global is not None else ReplicaContext(DefaultStrategy(), 0)


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


@dataclass
class _GlobalScope:
    """The scope ``experimental_set_strategy`` holds open, and the thread it is open in."""

    strategy: Strategy
    scope: contextlib.AbstractContextManager[Strategy]
    thread: int


_global_lock = threading.Lock()
_global: _GlobalScope | None = None


def experimental_set_strategy(strategy: Strategy | None) -> None:
    """Makes ``strategy`` current without ``with strategy.scope():`` (tf.distribute's function, for
    notebooks where each cell would need the block); None makes the default strategy current again.
    Setting another strategy first leaves the previous one's scope.

    The scope is open in the calling thread, where it captures the modules and optimizers built,
    as ``with strategy.scope():`` does; in other threads without a scope of their own the strategy
    is current too (cross-replica context). A scope distributes what it built when it exits, and
    this one stays open: the strategy's ``run``, ``experimental_local_results`` and ``extended``
    first close and reopen it, so a model built in one cell is distributed when the next uses it.
    Unset it (None) before closing the strategy.

    Raises:
        RuntimeError: called inside ``with strategy.scope():`` or ``run`` (leave it first), or
            from another thread than the one that set the current strategy.
    """
    global _global
    with _global_lock:
        current, thread = _global, threading.get_ident()
        if current is not None and current.thread != thread:
            raise RuntimeError(
                f"experimental_set_strategy: {type(current.strategy).__name__} was set by another thread, "
                "where its scope is open: call experimental_set_strategy from that thread"
            )
        if len(_stack()) != (current is not None):
            raise RuntimeError(
                "experimental_set_strategy must not be called inside a strategy's scope or run: "
                "leave the `with strategy.scope():` block first"
            )
        if current is not None:
            _global = None
            current.scope.__exit__(None, None, None)  # distributes what the scope built
        if strategy is not None:
            scope = strategy.scope()
            scope.__enter__()
            _global = _GlobalScope(strategy, scope, thread)


def adopt_global_scope(strategy: Strategy) -> None:
    """When ``experimental_set_strategy(strategy)`` holds this thread's only scope, closes and
    reopens it, so that the strategy distributes what was built in it so far."""
    current = _global
    if current is None or current.strategy is not strategy or current.thread != threading.get_ident():
        return
    if len(_stack()) != 1:  # inside a nested scope or run: they end first
        return
    try:
        current.scope.__exit__(None, None, None)
    finally:  # even when distributing failed, the strategy stays set with an open scope
        scope = strategy.scope()
        scope.__enter__()
        current.scope = scope


_renamed_warned: set[str] = set()


def _warn_renamed(old: str, new: str) -> None:
    """One DeprecationWarning per process for each of TensorFlow's old names."""
    if old in _renamed_warned:
        return
    _renamed_warned.add(old)
    warnings.warn(
        f"Strategy.{old} is TensorFlow's deprecated name: call strategy.{new} (same arguments)",
        DeprecationWarning,
        stacklevel=3,
    )


def _current_context() -> ReplicaContext:
    context = get_replica_context()
    if context is None:
        raise RuntimeError("expected to run in replica context (inside strategy.run)")
    return context


def _param_groups(optimizer: Any) -> list[dict[str, Any]]:
    groups = getattr(optimizer, "param_groups", None)
    if not groups:
        raise TypeError(f"expected a torch.optim optimizer (with param_groups), got {type(optimizer).__name__}")
    return groups
