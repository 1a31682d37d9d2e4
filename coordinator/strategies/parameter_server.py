"""ParameterServerStrategy: the user's model, made of variables that live on parameter servers.

Modules built inside ``strategy.scope()`` keep their ordinary torch code; their
parameters become variables partitioned across the parameter servers (created
there lazily, when the first closure is scheduled, so that the optimizer
declared after the model can be created with them). ``strategy.optimizer()``
declares the torch.optim class the servers apply.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from paramserve.coordinator.checkpoint_manager import CheckpointManager
from paramserve.coordinator.cluster import ClusterSpec
from paramserve.coordinator.cluster_coordinator import ClusterCoordinator
from paramserve.coordinator.strategies import _capture
from paramserve.coordinator.strategies.base import DefaultStrategy, SingleReplicaStrategy, Strategy
from paramserve.coordinator.strategies.step_runners import StepFn, StepRunner, add_statistics
from paramserve.coordinator.strategies.training_state import TrainingCheckpoints
from paramserve.psserver import checkpoint
from paramserve.psserver.client import ClientConfig, ParameterServerClient
from paramserve.psserver.optimizer import OptimizerSpec
from paramserve.psserver.partition import Partitioner
from paramserve.psserver.types import ClusterContext, ShardState, VariableLayout
from paramserve.wire.v1 import tensor_pb2
from paramserve.worker.variables import (
    RefreshBeforeForward,
    ServerOptimizer,
    ShardedEmbedding,
    mark_variable,
    registering_tables,
    variable_name,
)

log = logging.getLogger(__name__)


@dataclass
class Variable:
    """One distributed variable as the coordinator knows it."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    parameter: nn.Parameter | None = None  # dense: the coordinator's own parameter
    table: ShardedEmbedding | None = None  # row variable: never materialised locally
    optimizer: OptimizerSpec | None = None




class ParameterServerStrategy(SingleReplicaStrategy):
    """Asynchronous training against variables on parameter servers (see ClusterCoordinator).

    As in tf.distribute, ``run`` executes a replica function once, where it is
    called: inside a closure scheduled on a worker (one replica per worker),
    or on the coordinator; ``num_replicas_in_sync`` is 1 and ``reduce`` of a
    single replica's value is that value. Input comes from dataset
    *functions* run on each worker (``distribute_datasets_from_function`` or
    ``ClusterCoordinator.create_per_worker_dataset``).

    Args:
        cluster: the cluster; default ``ClusterSpec.from_env()``.
        variable_partitioner: splits large variables into shards along the first
            axis (FixedShardsPartitioner, MinSizePartitioner, MaxSizePartitioner);
            default: one shard per variable.
        token: the cluster's shared token (servers and workers reject calls without it).
        client_config: deadlines and retries of parameter-server calls.
        max_value_age: a worker's step starts from the variables' values as its previous
            step's push returned them (read on the server right after that push was
            applied), instead of pulling them again: within a closure always, and at a
            closure's first step when those values are at most this many seconds old.
            Default 0.1 s: in steady training the next closure follows within
            milliseconds, so the values are as fresh as a pull would have been when the
            push ended (asynchronous training misses the other workers' concurrent pushes
            either way), and a round trip per closure is saved; after a pause (an
            evaluation, a slow input) the step pulls. 0: every closure's first step pulls.
            A restore of the variables always makes workers pull.
    """

    def __init__(
        self,
        cluster: ClusterSpec | None = None,
        variable_partitioner: Partitioner | None = None,
        *,
        token: str | None = None,
        client_config: ClientConfig | None = None,
        max_value_age: float = 0.1,
    ):
        self.cluster = cluster or ClusterSpec.from_env()
        if not self.cluster.workers:
            raise ValueError("ParameterServerStrategy needs at least one worker in the cluster")
        self.variable_partitioner = variable_partitioner
        self.token = token
        if not max_value_age >= 0:
            raise ValueError(f"max_value_age must be >= 0 seconds, got {max_value_age!r}")
        self.max_value_age = float(max_value_age)
        config = client_config or ClientConfig()
        if token and not config.token:
            config = ClientConfig(**{**config.__dict__, "token": token})
        self.client = ParameterServerClient(self.cluster.parameter_servers, config)
        self._lock = threading.RLock()
        self._variables: dict[str, Variable] = {}
        self._roots: list[tuple[str, nn.Module]] = []
        self._materialized = False
        self._pending_tables: list[ShardedEmbedding] = []
        self._context: ClusterContext | None = None
        self._coordinator: Any = None
        self._access = CoordinatorAccess(self)
        self._hook_handles: list[torch.utils.hooks.RemovableHandle] = []
        self._linked_optimizers: list[torch.optim.Optimizer] = []
        self._closed = False

    # ------------------------------------------------------------------ scope

    @contextlib.contextmanager
    def _scope_hooks(self) -> Iterator[None]:
        """Inside scope(), modules (and ShardedEmbedding tables) built become distributed, and a
        torch optimizer built becomes the servers' optimizer for its parameters."""
        self._check_open()
        built: list[torch.optim.Optimizer] = []

        def on_optimizer(optimizer: torch.optim.Optimizer) -> None:
            _capture.redirect_optimizer(optimizer)
            self._linked_optimizers.append(optimizer)
            built.append(optimizer)

        with _capture.recording_modules() as record, _capture.capturing_optimizers(on_optimizer), \
                registering_tables(self):
            yield
        self._adopt(record.roots())
        for optimizer in built:
            self._adopt_optimizer(optimizer)

    def _adopt(self, roots: list[nn.Module]) -> None:
        with self._lock:
            for root in roots:
                if any(r is root for _, r in self._roots):
                    continue
                prefix = self._unique_prefix(type(root).__name__.lower())
                self._roots.append((prefix, root))
                self._adopt_module(prefix, root)
            for table in self._pending_tables:  # tables built on their own, outside any module
                if not table.variable:
                    self.register_table(table, self._unique_prefix("embedding"))
                    self._roots.append((table.variable, table))
            self._pending_tables.clear()

    def _unique_prefix(self, base: str) -> str:
        taken = {p for p, _ in self._roots}
        prefix, n = base, 1
        while prefix in taken:
            prefix, n = f"{base}_{n}", n + 1
        return prefix

    def _adopt_module(self, prefix: str, root: nn.Module) -> None:
        if self._materialized:
            raise RuntimeError(
                f"{type(root).__name__} was built after training started; build every model "
                "inside strategy.scope() before the first schedule()"
            )
        for qualified, param in root.named_parameters():
            if variable_name(param) is not None:
                continue
            name = f"{prefix}.{qualified}"
            mark_variable(param, name)
            self._variables[name] = Variable(name, tuple(param.shape), param.dtype, parameter=param)
        for qualified, table in root.named_modules():
            if isinstance(table, ShardedEmbedding) and not table.variable:
                self.register_table(table, f"{prefix}.{qualified}")
        self._hook_handles.append(root.register_forward_pre_hook(RefreshBeforeForward(self._access)))

    def register_table(self, table: ShardedEmbedding, name: str | None = None) -> None:
        """Called by ShardedEmbedding built in scope; named later by its root module."""
        with self._lock:
            if name is None:
                self._pending_tables.append(table)  # named when the scope closes
                return
            table.variable = name
            table.home = self._access
            self._variables[name] = Variable(name, table.shape, table.dtype, table=table)

    # ------------------------------------------------------------------ the Strategy API (input)

    def experimental_distribute_dataset(self, dataset: Any) -> Any:
        raise TypeError(
            "ParameterServerStrategy reads input on the workers: pass a dataset function to "
            "distribute_datasets_from_function(fn) or ClusterCoordinator.create_per_worker_dataset(fn)"
        )

    def distribute_datasets_from_function(self, dataset_fn: Any) -> Any:
        """A per-worker dataset: ``dataset_fn(ctx)`` runs on every worker (needs a ClusterCoordinator)."""
        if self._coordinator is None:
            raise RuntimeError("create a ClusterCoordinator(strategy) first: it runs the dataset function on the workers")
        return self._coordinator.create_per_worker_dataset(dataset_fn)

    def _attach_coordinator(self, coordinator: Any) -> None:
        self._coordinator = coordinator

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        # A step that calls strategy.run() is sent to workers with the strategy in it:
        # there it becomes the single-replica strategy of a closure, without clients or locks.
        return _ClosureStrategy, ()

    # ------------------------------------------------------------------ optimizer

    def optimizer(self, optimizer_cls: type[torch.optim.Optimizer] | str, params: Iterable[Any] | None = None, **kwargs: Any) -> ServerOptimizer:
        """Declares the optimizer the parameter servers run for ``params``
        (default: every variable without one). Returns the object a step calls."""
        name = optimizer_cls if isinstance(optimizer_cls, str) else optimizer_cls.__name__
        spec = OptimizerSpec(name, kwargs)
        spec.validate()
        with self._lock:
            names = self._variable_names(params)
            if self._materialized:
                raise RuntimeError("declare the optimizer before the first schedule(): the variables exist already")
            for variable in names:
                self._variables[variable].optimizer = spec
        return ServerOptimizer(names, spec.name, dict(spec.kwargs), home=self._access)

    def _adopt_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """A torch.optim optimizer built in scope becomes the servers' optimizer for its
        parameters; its step pushes gradients, so the same training code runs under every
        strategy, and on the wire it is the ServerOptimizer it stands for."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        kwargs = {k: v for k, v in optimizer.defaults.items() if k not in _LOCAL_ONLY_OPTIONS and v is not None}
        server_optimizer = self.optimizer(_capture.base_class(optimizer), params=params, **kwargs)
        _capture.link_optimizer(optimizer, _ServerOptimizerLink(server_optimizer))

    def _variable_names(self, params: Iterable[Any] | None) -> list[str]:
        if params is None:
            return [n for n, v in self._variables.items() if v.optimizer is None]
        names = []
        for item in params:
            item = item.variable if isinstance(item, ShardedEmbedding) else item
            name = item if isinstance(item, str) else variable_name(item)
            if name is None or name not in self._variables:
                raise ValueError(
                    "strategy.optimizer() got a parameter that is not a distributed variable: build "
                    "the module inside strategy.scope()"
                )
            names.append(name)
        return names

    # ------------------------------------------------------------------ variables on the servers

    @property
    def variables(self) -> dict[str, Variable]:
        with self._lock:
            return dict(self._variables)

    @property
    def roots(self) -> list[tuple[str, nn.Module]]:
        with self._lock:
            return list(self._roots)

    def layouts(self) -> dict[str, VariableLayout]:
        self.materialize()
        return self.client.layouts

    def plan_layouts(self) -> dict[str, VariableLayout]:
        """Where each variable's shards go with the current partitioner and servers."""
        with self._lock:
            return {
                name: self.client.plan_layout(name, v.shape, v.dtype, self.variable_partitioner)
                for name, v in self._variables.items()
            }

    def materialize(self, states_by_server: dict[int, list[ShardState]] | None = None, layouts: dict[str, VariableLayout] | None = None) -> None:
        """Creates every variable on the servers (once): from initial values, or from
        restored shard states (a checkpoint) laid out by ``layouts``."""
        with self._lock:
            if self._materialized:
                return
            if states_by_server is not None and layouts is not None:
                self.client.load_states(states_by_server)
                self.client.adopt_layouts(layouts)
            else:
                for variable in self._variables.values():
                    self._create(variable)
            self._materialized = True
            log.info("%d variables on %d parameter servers", len(self._variables), self.cluster.num_ps())

    @property
    def materialized(self) -> bool:
        return self._materialized

    def _create(self, variable: Variable) -> None:
        if variable.table is not None:
            table = variable.table
            kind = table.initializer
            a, b = (0.0, table.init_std) if kind == "normal" else (-table.init_std, table.init_std)
            init = tensor_pb2.Initializer(kind=kind, a=a, b=b, seed=table.seed)
            self.client.create_variable(variable.name, shape=variable.shape, dtype=variable.dtype, initializer=init,
                                        optimizer=variable.optimizer, partitioner=self.variable_partitioner)
            return
        assert variable.parameter is not None
        self.client.create_variable(variable.name, variable.parameter.detach(), optimizer=variable.optimizer,
                                    partitioner=self.variable_partitioner)

    def cluster_context(self) -> ClusterContext:
        """What every closure carries so a (restarted) worker can reach the variables
        (creates the variables first). Built once: layouts do not change after the variables exist."""
        with self._lock:
            if self._context is None:
                self._context = ClusterContext(self.cluster.parameter_servers, self.layouts())
            return self._context

    def set_server_hyperparameters(self, values: Mapping[str, float], params: Iterable[Any] | None = None) -> None:
        """Changes optimizer hyperparameters (e.g. ``{"lr": 0.01}``) the servers apply, for
        ``params`` (variables, parameters or tables) or every variable by default."""
        names = None if params is None else self._variable_names(params)
        if names is None:
            self.client.set_hyperparameters(dict(values))
            return
        for name in names:
            self.client.set_hyperparameters(dict(values), variable=name)

    # ------------------------------------------------------------------ what fit and its callbacks ask

    def step_runner(self, step: StepFn, train_data: Any, *, steps_per_epoch: int | None,
                    coordinator: Any = None) -> StepRunner:
        """Steps run on the workers: ``train_data`` is a dataset function each worker runs
        (``dataset_fn(ctx)`` yielding endless batches); K steps make one closure."""
        _check_training_data(train_data, steps_per_epoch)
        return ParameterServerStepRunner(self, step, train_data, coordinator)

    def evaluation_strategy(self) -> Strategy:
        """Evaluation runs on the coordinator, whose modules read the variables' current values."""
        return DefaultStrategy()

    def training_checkpoints(self, directory: str | os.PathLike[str], keep: int) -> TrainingCheckpoints:
        return ServerCheckpoints(self, directory, keep)

    def learning_rate(self, optimizer: Any) -> float:
        return float(_server_optimizer(optimizer).spec_kwargs.get("lr", 0.0))

    def set_learning_rate(self, optimizer: Any, lr: float) -> None:
        """The servers apply ``lr`` to ``optimizer``'s variables from their next push."""
        server_optimizer = _server_optimizer(optimizer)
        self.set_server_hyperparameters({"lr": lr}, params=server_optimizer.variables)
        server_optimizer.spec_kwargs["lr"] = lr

    can_restore_model_weights = False  # variables are only assigned by a checkpoint restore

    def close(self) -> None:
        """Ends the strategy: removes the refresh hooks from its modules, gives the optimizers
        built in its scope their own classes back, and closes the parameter-server client.
        The variables stay on the servers. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            handles, self._hook_handles = self._hook_handles, []
            optimizers, self._linked_optimizers = self._linked_optimizers, []
        for handle in handles:
            handle.remove()
        for optimizer in optimizers:
            _capture.unlink(optimizer)
        self._access.close()
        self.client.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this ParameterServerStrategy was closed: create a new one")


_LOCAL_ONLY_OPTIONS = frozenset({"foreach", "fused", "capturable", "differentiable"})
"""torch.optim options about how a step runs locally; the servers choose their own."""


class _ServerOptimizerLink:
    """What a torch optimizer built in scope does: the ServerOptimizer's step, on the wire itself."""

    def __init__(self, server_optimizer: ServerOptimizer):
        self.server_optimizer = server_optimizer

    def step(self, closure: Any = None) -> Any:
        return self.server_optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.server_optimizer.zero_grad(set_to_none)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise RuntimeError(
            "an optimizer of a ParameterServerStrategy keeps its state on the parameter servers: restore it "
            "with CheckpointManager(strategy, directory).restore(...), not load_state_dict"
        )

    def pickled_as(self) -> ServerOptimizer:
        return self.server_optimizer


def _server_optimizer(optimizer: Any) -> ServerOptimizer:
    """The ServerOptimizer behind ``optimizer`` (itself, or a torch optimizer built in scope)."""
    if isinstance(optimizer, ServerOptimizer):
        return optimizer
    link = vars(optimizer).get(_capture.LINK)
    if isinstance(link, _ServerOptimizerLink):
        return link.server_optimizer
    raise TypeError(
        f"{type(optimizer).__name__} does not update this strategy's variables: use the optimizer "
        "strategy.optimizer(...) returns, or a torch optimizer built inside strategy.scope()"
    )


def _check_training_data(train_data: Any, steps_per_epoch: int | None) -> None:
    if steps_per_epoch is None:
        raise ValueError("steps_per_epoch is required under ParameterServerStrategy (the workers' datasets "
                         "have no end): pass steps_per_epoch=")
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
    or one of its own, shut down by ``close``). Statistics come back at the epoch's end."""

    def __init__(self, strategy: ParameterServerStrategy, step: StepFn, dataset_fn: Callable[..., Any],
                 coordinator: ClusterCoordinator | None):
        self._strategy = strategy
        self._owned = coordinator is None
        self._coordinator = coordinator if coordinator is not None else ClusterCoordinator(strategy)
        self._iterator = iter(self._coordinator.create_per_worker_dataset(dataset_fn))
        self._closure = _WorkerSteps(step)
        self._values: list[Any] = []

    def prepare(self) -> None:
        self._strategy.materialize()  # after BackupAndRestore had its chance to restore instead

    def epoch_length(self) -> int | None:
        return None  # the workers' datasets are endless

    def begin_epoch(self) -> None:
        self._values = []

    def run(self, steps: int) -> int:
        self._values.append(self._coordinator.schedule(self._closure, args=(self._iterator,), steps=steps))
        return steps

    def running_totals(self) -> torch.Tensor | None:
        return None  # results are fetched at the epoch's end

    def end_epoch(self) -> torch.Tensor | None:
        self._coordinator.join()
        totals = None
        for value in self._values:
            totals = add_statistics(totals, value.fetch())
        return totals

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

    def latest(self) -> pathlib.Path | None:
        return self._manager.latest

    def restore(self, path: pathlib.Path, model: nn.Module, optimizer: Any) -> dict[str, Any]:
        extra = dict(checkpoint.read_manifest(checkpoint.resolve(path)).extra)
        if self._strategy.materialized:
            log.warning("the variables exist already: resuming at epoch %s with their current values, "
                        "not the checkpoint's (restore happens only before training starts)", extra.get("epoch"))
        else:
            self._manager.restore(path)
        return extra

    def clear(self) -> None:
        checkpoint.delete_checkpoints(self.directory)


class _ClosureStrategy(SingleReplicaStrategy):
    """What a ParameterServerStrategy is inside a closure on a worker: one replica,
    no clients, no locks."""


class CoordinatorAccess:
    """VariableAccess of the coordinator: its own modules read the servers' current values."""

    def __init__(self, strategy: ParameterServerStrategy):
        self._strategy: ParameterServerStrategy | None = strategy

    def close(self) -> None:
        self._strategy = None

    @property
    def owner(self) -> ParameterServerStrategy | None:
        """The strategy, None once it was closed."""
        return self._strategy

    @property
    def strategy(self) -> ParameterServerStrategy:
        if self._strategy is None:
            raise RuntimeError("the ParameterServerStrategy these variables belong to was closed")
        return self._strategy

    def parameter(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
        variable = self.strategy.variables.get(name)
        if variable is None or variable.parameter is None:
            raise KeyError(f"no dense variable {name!r} in this strategy")
        return variable.parameter

    def refresh(self, parameters: Sequence[nn.Parameter]) -> None:
        if not self.strategy.materialized or not parameters:
            return  # before training, the local values are the variables' values
        names = [variable_name(p) for p in parameters]
        pulled = self.strategy.client.pull([n for n in names if n])
        with torch.no_grad():
            for param, name in zip(parameters, names):
                if name:
                    param.copy_(pulled.tensors[name])

    def place(self, module: nn.Module) -> None:
        return None  # the coordinator computes where the user put the module

    def lookup_rows(self, name: str, indices: torch.Tensor) -> torch.Tensor:
        self.strategy.materialize()
        return self.strategy.client.pull_rows(name, indices).tensors[name]

    def apply_gradients(self, names: Sequence[str]) -> None:
        self.strategy.materialize()
        gradients = {}
        for name in names:
            variable = self.strategy.variables[name]
            if variable.parameter is not None and variable.parameter.grad is not None:
                gradients[name] = variable.parameter.grad
        if gradients:
            self.strategy.client.push(gradients)

    def zero_grad(self, names: Sequence[str], set_to_none: bool) -> None:
        for name in names:
            param = self.strategy.variables[name].parameter
            if param is not None and param.grad is not None:
                if set_to_none:
                    param.grad = None
                else:
                    param.grad.zero_()
