"""ParameterServerStrategy: the user's model, made of variables that live on parameter servers.

Modules built inside ``strategy.scope()`` keep their ordinary torch code; their parameters
become variables partitioned across the parameter servers (created there lazily, when the next
closure is scheduled, so that the optimizer declared after the model can be created with them).
Models may be built at any time, also after training started: their variables are created with
the next closure, and the cluster context workers receive changes with them.
``strategy.optimizer()`` declares the torch.optim class the servers apply.

Variables are named ``[<run_name>/]<model>.<parameter>``. Creating one that the servers hold
already (an earlier run with the same names) is refused unless the strategy was built with
``reuse_variables=True``: a run never silently starts from another run's trained values.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from paramserve.coordinator.checkpointing.checkpoint_log import CheckpointLog
from paramserve.coordinator.checkpointing.checkpoint_manager import CheckpointManager
from paramserve.coordinator.cluster import ClusterSpec
from paramserve.coordinator.cluster_resolver import ClusterResolver
from paramserve.coordinator.contracts import DispatchControl
from paramserve.coordinator.recovery.ps_recovery import RecoverableVariables
from paramserve.coordinator.recovery.replica_groups import ParameterServers, replica_count
from paramserve.coordinator.strategies import _capture, scope_optimizers
from paramserve.coordinator.strategies.base import DefaultStrategy, SingleReplicaStrategy, Strategy
from paramserve.coordinator.strategies.input import InputOptions, check_per_worker
from paramserve.coordinator.strategies.parameter_server_access import (
    ClosureStrategy,
    CoordinatorAccess,
    ServerOptimizerLink,
    server_optimizer_of,
)
from paramserve.coordinator.strategies.parameter_server_training import (
    METRIC_OPTIMIZER,
    ParameterServerStepRunner,
    ServerCheckpoints,
    ServerMetricState,
    check_training_data,
)
from paramserve.coordinator.strategies.parameter_server_variables import (
    Variable,
    check_run_name,
    create_on_servers,
    held_by_servers,
    variables_exist_error,
)
from paramserve.coordinator.strategies.step_runners import StepFn, StepRunner
from paramserve.coordinator.strategies.sync_dense import SyncDense
from paramserve.coordinator.strategies.table_fusion import check_whole_groups, fused_variables, unfused
from paramserve.coordinator.strategies.training_state import TrainingCheckpoints
from paramserve.psserver.client.ps_client import ClientConfig, ParameterServerClient
from paramserve.psserver.dynamic.dynamic_types import DynamicShardState
from paramserve.psserver.protocol.optimizer_spec import OptimizerSpec
from paramserve.psserver.protocol.partition import Partitioner
from paramserve.psserver.protocol.types import ClusterContext, ShardPlacement, ShardState, VariableLayout
from paramserve.psserver.runtime.security import TOKEN_ENV, check_token
from paramserve.worker.dynamic_embedding import DynamicEmbedding
from paramserve.worker.layers import (
    RefreshBeforeForward,
    ServerOptimizer,
    ShardedEmbedding,
    mark_variable,
    registering_tables,
    unmark_variable,
    variable_name,
)

log = logging.getLogger(__name__)


class ParameterServerStrategy(SingleReplicaStrategy):
    """Asynchronous training against variables on parameter servers (see ClusterCoordinator).

    As in tf.distribute, ``run`` executes a replica function once, where it is
    called: inside a closure scheduled on a worker (one replica per worker),
    or on the coordinator; ``num_replicas_in_sync`` is 1 and ``reduce`` of a
    single replica's value is that value. Input comes from dataset
    *functions* run on each worker (``distribute_datasets_from_function`` or
    ``ClusterCoordinator.create_per_worker_dataset``).

    Args:
        cluster_resolver: the cluster: a ``ClusterResolver`` with "ps", "worker" and optionally
            "chief" jobs (e.g. ``TFConfigClusterResolver()``, as TensorFlow takes it), a
            ``ClusterSpec``, or None: ``ClusterSpec.from_env()``.
        variable_partitioner: splits large variables into shards along the first
            axis (FixedShardsPartitioner, MinSizePartitioner, MaxSizePartitioner, or any
            callable ``(shape, dtype)`` returning TF's ``[shards, 1, ...]`` or a number of
            shards; ``partition.shard_count`` reads it); default: one shard per variable.
        token: the cluster's shared token (servers and workers reject calls without it);
            default ``PARAMSERVE_TOKEN`` from ``environ`` (``paramserve launch`` sets it).
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
        overlap_pushes: a worker's step computes while its previous step's push is still on
            its way (the servers apply it meanwhile), instead of waiting for the push's round
            trip: a step's gradients then come from values that miss the worker's own previous
            update, one step staler than without (the servers' ``--max-staleness`` counts
            it; 0 there rejects such pushes). At most one push is in flight per worker and
            never past the end of a RunClosures call: a closure's result is returned once its
            pushes are applied, and a push that fails is its closure's error. After
            ``optimizer.step()`` the pushed parameters' ``.grad`` is None (the push holds the
            gradients until it is applied). A step that looked up embedding rows instead holds
            its push until the next step's lookup, which carries it: one exchange per server
            serves both (the servers apply the push, then read the rows), with the same
            staleness (worker.pipeline). Default False.
        max_row_staleness: a worker serves the embedding rows it read at most this many of its
            own steps ago from its row cache instead of reading them again (worker.row_cache):
            on click data, where a few rows take most lookups, most rows then stop travelling.
            Every row's gradient is still pushed every step, once, naming the version it was
            read at (so the servers' ``--max-staleness`` counts the cache's staleness too). A
            cache never serves a row read before the last ``join()`` or ``fetch()``, or before a
            restore or a failover. Dynamic tables are not cached. A bound of 1 or more also
            lets a step's push travel with the next step's lookup, as ``overlap_pushes`` does
            (dense values then miss the worker's own previous push). Default 0: no cache, every
            lookup reads every row, every push waits for its reply.
        environ: where ``cluster`` and ``token`` are read from when not given; default ``os.environ``.
        run_name: namespaces this run's variables on the servers (``<run_name>/<model>.<param>``),
            so that runs sharing parameter servers keep apart. Checkpoints store names
            without it: a checkpoint restores into a run of any name.
        reuse_variables: variables that exist on the servers already (from an earlier run of
            the same names) are trained on from their current values and optimizer state;
            without it (the default) creating them raises VariableExistsError.
        sync_dense: hybrid training: the dense parameters are replicated on the workers and
            averaged every step by an all-reduce among them (synchronous, as MultiWorkerMirrored
            trains), the embedding tables stay on the servers (asynchronous). See
            ARCHITECTURE.md, "Hybrid training".
        dense_group_timeout, rendezvous_host: sync_dense's collective timeout (seconds) and the
            coordinator's host as workers reach it (default: 127.0.0.1 for loopback workers).
        ps_replicas: each shard on this many servers (default ``PARAMSERVE_PS_REPLICAS``, else 1):
            a primary and backups that apply every push before it is acknowledged, one of which
            takes over when the primary fails (ARCHITECTURE.md, "Replicated parameter servers").
        fuse_tables: a model's ShardedEmbeddings of one layout, named by their place in it, are
            stored as one variable, ``<model>.fused_tables.<k>``, each a row range of it
            (strategies.table_fusion): one table per feature then costs a step what one
            ShardedEmbeddingCollection does. False: a variable per table (the layout of
            checkpoints written before tables were fused). Default True.
    """

    def __init__(
        self,
        cluster_resolver: ClusterSpec | ClusterResolver | None = None,
        variable_partitioner: Partitioner | None = None,
        *,
        token: str | None = None,
        client_config: ClientConfig | None = None,
        max_value_age: float = 0.1,
        overlap_pushes: bool = False,
        max_row_staleness: int = 0,
        environ: Mapping[str, str] | None = None,
        run_name: str | None = None,
        reuse_variables: bool = False,
        sync_dense: bool = False,
        dense_group_timeout: float = 60.0,
        rendezvous_host: str | None = None,
        ps_replicas: int | None = None,
        fuse_tables: bool = True,
    ):
        env = os.environ if environ is None else environ
        self.cluster = ClusterSpec.resolve(cluster_resolver, env)
        self.cluster_resolver = cluster_resolver if isinstance(cluster_resolver, ClusterResolver) else None
        if not self.cluster.workers and self.cluster.worker_service is None:
            raise ValueError("ParameterServerStrategy needs at least one worker (or a worker service) in the cluster")
        self.variable_partitioner = variable_partitioner
        self.token = check_token(token, "token=") if token is not None else check_token(env.get(TOKEN_ENV), TOKEN_ENV)
        if not max_value_age >= 0:
            raise ValueError(f"max_value_age must be >= 0 seconds, got {max_value_age!r}")
        self.max_value_age = float(max_value_age)
        self.overlap_pushes = bool(overlap_pushes)
        if isinstance(max_row_staleness, bool) or not isinstance(max_row_staleness, int) or max_row_staleness < 0:
            raise ValueError(
                f"max_row_staleness must be a whole number of steps >= 0 (0: no row cache), got {max_row_staleness!r}"
            )
        self.max_row_staleness = max_row_staleness
        self.run_name = check_run_name(run_name)
        self.reuse_variables = bool(reuse_variables)
        self.fuse_tables = bool(fuse_tables)
        self._namespace = f"{self.run_name}/" if self.run_name else ""
        config = client_config or ClientConfig()
        if self.token and not config.token:
            config = ClientConfig(**{**config.__dict__, "token": self.token})
        self.tls = config.client_tls()
        """How the coordinator reaches workers too: the parameter servers' TLS settings (ClientConfig)."""
        self.servers = ParameterServers(self.cluster.parameter_servers, replica_count(ps_replicas, env), config)
        self._lock = threading.RLock()
        self._variables: dict[str, Variable] = {}
        self._roots: list[tuple[str, nn.Module]] = []
        self._materialized = False
        self._created: set[str] = set()  # variables that exist on the servers (for this strategy)
        self._pending_tables: list[ShardedEmbedding | DynamicEmbedding] = []
        self._tables_taken: dict[str, ServerOptimizer] = {}  # by an in-scope optimizer (scope_optimizers)
        self._context: ClusterContext | None = None
        self._coordinator_ref: Callable[[], DispatchControl | None] = lambda: None  # weak: a dropped one is collected
        self._generation = 0  # restores so far (ClusterContext.generation)
        self._state_change = threading.RLock()
        self.checkpoints = CheckpointLog()
        """The checkpoints CheckpointManagers wrote or restored: a restarted parameter server is
        restored from the newest whole one (coordinator.ps_recovery); telemetry reports its age."""
        self._access = CoordinatorAccess(self)
        self._hook_handles: list[torch.utils.hooks.RemovableHandle] = []
        self._linked_optimizers: list[torch.optim.Optimizer] = []
        self._closed = False
        self.sync_dense = SyncDense(self, dense_group_timeout, rendezvous_host) if sync_dense else None

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

        with (
            _capture.recording_modules() as record,
            _capture.capturing_optimizers(on_optimizer),
            registering_tables(self),
        ):
            yield
        with self._lock, self._rolled_back_on_error():
            self._adopt(record.roots())
            for optimizer in built:
                self._adopt_optimizer(optimizer)
            if self._materialized:  # training started: a clash with the servers' variables fails the build now
                self._existing_on_servers(
                    [n for n, v in self._variables.items() if n not in self._created and not v.replicated]
                )
        self._claim_models(record.roots())

    @contextlib.contextmanager
    def _rolled_back_on_error(self) -> Iterator[None]:
        """What one scope adds (models, tables, variables, optimizers) is all recorded or, when
        adopting it fails, none of it: a failed build leaves the strategy as it was."""
        variables, roots = dict(self._variables), list(self._roots)
        handles, optimizers = len(self._hook_handles), len(self._linked_optimizers)
        try:
            yield
        except BaseException:
            for name, variable in self._variables.items():
                if name not in variables and variable.parameter is not None:
                    unmark_variable(variable.parameter)
                table = variable.table or variable.dynamic
                if name not in variables and table is not None:
                    table.variable, table.home = table.requested_name or "", None
                for member in variable.fused if name not in variables else ():
                    member.table.variable, member.table.home = "", None
                    member.table.fused = None
            self._variables, self._roots = variables, roots
            for handle in self._hook_handles[handles:]:
                handle.remove()
            for optimizer in self._linked_optimizers[optimizers:]:
                _capture.unlink(optimizer)
            del self._hook_handles[handles:], self._linked_optimizers[optimizers:]
            self._pending_tables.clear()
            raise

    def _adopt(self, roots: list[nn.Module]) -> None:
        for root in roots:
            if any(r is root for _, r in self._roots):
                continue
            prefix = self._unique_prefix(type(root).__name__.lower())
            self._roots.append((prefix, root))
            self._adopt_module(prefix, root)
        for table in self._pending_tables:  # tables built on their own, outside any module
            if not table.adopted():
                self.register_table(table, self._table_name(table, self._unique_prefix("embedding")))
                self._roots.append((table.variable, table))
        self._pending_tables.clear()

    def _unique_prefix(self, base: str) -> str:
        """``[<run_name>/]<base>[_n]``, not taken by another model of this strategy."""
        taken = {p for p, _ in self._roots}
        prefix, n = f"{self._namespace}{base}", 1
        while prefix in taken:
            prefix, n = f"{self._namespace}{base}_{n}", n + 1
        return prefix

    def _adopt_module(self, prefix: str, root: nn.Module) -> None:
        for qualified, param in root.named_parameters():
            if variable_name(param) is not None:
                continue
            name = f"{prefix}.{qualified}"
            mark_variable(param, name)
            replicated = self.sync_dense is not None  # hybrid training: the layer lives on the workers
            self._variables[name] = Variable(name, tuple(param.shape), param.dtype, param, replicated=replicated)
        tables = [(q, t) for q, t in root.named_modules() if isinstance(t, (ShardedEmbedding, DynamicEmbedding))]
        fused = fused_variables(prefix, tables, self._access, self._variables) if self.fuse_tables else []
        self._variables.update((variable.name, variable) for variable in fused)
        for qualified, table in unfused(tables, fused):
            if not table.adopted():
                self.register_table(table, self._table_name(table, f"{prefix}.{qualified}"))
        self._hook_handles.append(root.register_forward_pre_hook(RefreshBeforeForward(self._access)))
        if self.sync_dense is not None:
            self._hook_handles += self.sync_dense.settle_hooks(root)

    def _table_name(self, table: ShardedEmbedding | DynamicEmbedding, default: str) -> str:
        """The variable a table becomes: the name its user gave (under the run name), else
        ``default`` (its place in the model). Raises ValueError when another variable of this
        strategy has that name."""
        if table.requested_name is None:
            return default
        name = f"{self._namespace}{table.requested_name}"
        if name in self._variables:
            raise ValueError(
                f"two variables are named {name!r}: give each ShardedEmbedding its own name= (or none, "
                "to name it by its place in the model)"
            )
        return name

    def metric_state(self, template: Any, name: str) -> Any:
        """The metric's state tensors as variables on the servers (see ServerMetricState)."""
        return ServerMetricState(self, template, name, self._access)

    def register_metric(self, name: str, states: Mapping[str, torch.Tensor]) -> dict[str, nn.Parameter]:
        """For ServerMetricState: a metric's states as variables ``[<run>/]metric.<name>[_n].<state>``
        (zeros, float64, summed by an SGD step of rate 1, never checkpointed), by state name;
        created on the servers with the next closure. Raises RuntimeError once the strategy is
        closed; once training started, VariableExistsError where creating variables would."""
        with self._lock:
            self._check_open()
            base, n = f"{self._namespace}metric.{name}", 1
            prefix = base
            while any(v.startswith(prefix + ".") for v in self._variables):
                prefix, n = f"{base}_{n}", n + 1
            parameters = {}
            for state, value in states.items():
                variable = f"{prefix}.{state}"
                parameter = nn.Parameter(torch.zeros(tuple(value.shape), dtype=torch.float64))
                mark_variable(parameter, variable)
                self._variables[variable] = Variable(
                    variable,
                    tuple(value.shape),
                    torch.float64,
                    parameter=parameter,
                    optimizer=METRIC_OPTIMIZER,
                    checkpointed=False,
                )
                parameters[state] = parameter
            if self._materialized:
                self._existing_on_servers([variable_name(p) or "" for p in parameters.values()])
            return parameters

    def register_table(self, table: ShardedEmbedding | DynamicEmbedding, name: str | None = None) -> None:
        """Called by ShardedEmbedding and DynamicEmbedding built in scope; named later by its root module."""
        with self._lock:
            if name is None:
                self._pending_tables.append(table)  # named when the scope closes
                return
            table.variable = name
            table.home = self._access
            if isinstance(table, DynamicEmbedding):
                self._variables[name] = Variable(name, (0, table.embedding_dim), table.dtype, dynamic=table)
            else:
                self._variables[name] = Variable(name, table.shape, table.dtype, table=table)

    # ------------------------------------------------------------------ the Strategy API (input)

    def experimental_distribute_dataset(self, dataset: Any, options: InputOptions | None = None) -> Any:
        raise TypeError(
            "ParameterServerStrategy reads input on the workers: pass a dataset function to "
            "distribute_datasets_from_function(fn) or ClusterCoordinator.create_per_worker_dataset(fn)"
        )

    def distribute_datasets_from_function(self, dataset_fn: Any, options: InputOptions | None = None) -> Any:
        """A per-worker dataset: ``dataset_fn(ctx)`` runs on every worker (needs a ClusterCoordinator).
        Raises NotImplementedError for PER_REPLICA options: each worker reads its own input."""
        check_per_worker(options, "ParameterServerStrategy.distribute_datasets_from_function")
        coordinator = self.coordinator
        if coordinator is None:
            raise RuntimeError(
                "create a ClusterCoordinator(strategy) first: it runs the dataset function on the workers"
            )
        return coordinator.create_per_worker_dataset(dataset_fn)

    @property
    def coordinator(self) -> DispatchControl | None:
        """The live ClusterCoordinator of this strategy (the last one created), or None."""
        coordinator = self._coordinator_ref()
        return None if coordinator is None or coordinator.closed else coordinator

    def quiesced(self, timeout: float | None = None) -> contextlib.AbstractContextManager[None]:
        """Inside, no closure of this strategy runs: its coordinator's dispatch is paused and
        drained (ClusterCoordinator.paused); without a coordinator nothing runs anyway."""
        coordinator = self.coordinator
        return coordinator.paused(timeout) if coordinator is not None else contextlib.nullcontext()

    def attach_coordinator(self, coordinator: DispatchControl) -> RecoverableVariables:
        """Called by a new ClusterCoordinator; its recovery restores this strategy's variables.
        Variables are created (or a clash with those the servers hold refused) at its first
        ``schedule``, on the caller's thread, so that a restarted program may restore its
        checkpoint onto the live servers in between."""
        self._coordinator_ref = weakref.ref(coordinator)
        return self

    @contextlib.contextmanager
    def state_change(self) -> Iterator[None]:
        """Held while a checkpoint is taken or a parameter server restored (re-entrant): a
        checkpoint never sees a server half restored, and a recovery never runs under an export."""
        with self._state_change:
            yield

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        # A step that calls strategy.run() is sent to workers with the strategy in it:
        # there it becomes the single-replica strategy of a closure, without clients or locks.
        return ClosureStrategy, ()

    # ------------------------------------------------------------------ optimizer

    def optimizer(
        self, optimizer_cls: type[torch.optim.Optimizer] | str, params: Iterable[Any] | None = None, **kwargs: Any
    ) -> ServerOptimizer:
        """Declares the optimizer the parameter servers run for ``params``
        (default: every variable without one). Returns the object a step calls."""
        name = optimizer_cls if isinstance(optimizer_cls, str) else optimizer_cls.__name__
        spec = OptimizerSpec(name, kwargs)
        spec.validate()
        with self._lock:
            names = self._variable_names(params)
            created = [name for name in names if name in self._created]
            if created or not names:
                raise RuntimeError(
                    f"declare the optimizer before the variables are created on the servers (they are at the "
                    f"first schedule() after the model is built): {created or 'no new variable'} exist already"
                )
            for variable in names:
                self._variables[variable].optimizer = spec
            scope_optimizers.hand_over(self._tables_taken, names)
        return ServerOptimizer(names, spec.name, dict(spec.kwargs), home=self._access, owner=self)

    def _adopt_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """A torch.optim optimizer built in scope becomes the servers' optimizer for its
        parameters; its step pushes gradients, so the same training code runs under every
        strategy, and on the wire it is the ServerOptimizer it stands for (strategies.scope_optimizers)."""
        server_optimizer, tables = scope_optimizers.adopt(
            optimizer,
            lambda params, options: self.optimizer(_capture.base_class(optimizer), params=params, **options),
            self._roots,
            {n for n, v in self._variables.items() if not v.optimizer},
            lambda names, lr: self.set_server_hyperparameters({"lr": lr}, params=names),
        )
        self._tables_taken.update(dict.fromkeys(tables, server_optimizer))
        _capture.link_optimizer(optimizer, ServerOptimizerLink(server_optimizer, optimizer))

    def _variable_names(self, params: Iterable[Any] | None) -> list[str]:
        if params is None:
            untrained = [n for n, v in self._variables.items() if v.optimizer is None or n in self._tables_taken]
            return [n for n in untrained if n not in self._created]
        names: list[str] = []
        given = list(params)
        for item in given:
            item = item.variable if isinstance(item, (ShardedEmbedding, DynamicEmbedding)) else item
            name = item if isinstance(item, str) else variable_name(item)
            if name is None or name not in self._variables:
                raise ValueError(
                    "strategy.optimizer() got a parameter that is not a distributed variable: build "
                    "the module inside strategy.scope()"
                )
            if name not in names:
                names.append(name)
        check_whole_groups(given, self._variables)
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
        """Where this strategy's variables live (creating those not yet on the servers)."""
        self.materialize()
        layouts = self.client.layouts
        return {name: layouts[name] for name, v in self.variables.items() if v.dynamic is None and not v.replicated}

    def plan_layouts(self) -> dict[str, VariableLayout]:
        """Where each variable's shards go with the current partitioner and servers."""
        with self._lock:
            return {
                name: self.client.plan_layout(name, v.shape, v.dtype, self.variable_partitioner)
                for name, v in self._variables.items()
                if v.dynamic is None and not v.replicated
            }

    def materialize(
        self,
        states_by_server: dict[int, list[ShardState]] | None = None,
        layouts: dict[str, VariableLayout] | None = None,
    ) -> None:
        """Creates the variables not yet on the servers: from initial values, or (before training
        starts) from restored shard states (a checkpoint) laid out by ``layouts``. Cheap when
        there is nothing new; models built after training started get their variables here.

        Raises VariableExistsError when a variable to create exists on the servers already and
        the strategy was not built with ``reuse_variables=True``.
        """
        with self._lock:
            if states_by_server is not None and layouts is not None and not self._materialized:
                self.restore_states(states_by_server, layouts)
            new = [v for n, v in self._variables.items() if n not in self._created and not v.replicated]
            if new:
                self._create_all(new)
            self._materialized = True

    def restore_states(
        self, states_by_server: Mapping[int, Sequence[ShardState]], layouts: Mapping[str, VariableLayout]
    ) -> None:
        """Makes the variables of ``layouts`` exactly ``states_by_server`` on the servers (values,
        optimizer slots, versions, idempotency windows), live or fresh; other variables are left
        alone. Workers then drop the values they hold (a new generation of the cluster context).
        Closures must not run meanwhile: call it inside ``quiesced()``."""
        with self._lock:
            self.client.load_states(states_by_server, replace=True)
            self.client.adopt_layouts(dict(layouts))
            self._created.update(layouts)
            for state in (state for states in states_by_server.values() for state in states):
                variable = self._variables.get(state.ref.variable)
                if variable is not None:  # the servers apply the restored settings from now on
                    variable.optimizer = state.optimizer
            self._generation += 1
            self._context = None

    @property
    def client(self) -> ParameterServerClient:
        """The client of the servers that serve: each group's primary when replicated."""
        return self.servers.client

    def servers_moved(self) -> None:
        """A backup took over (``servers.move``): workers get the new primaries with the context."""
        with self._lock:
            self.servers.move()
            self._generation += 1
            self._context = None

    def dynamic_tables(self) -> dict[str, DynamicEmbedding]:
        """This strategy's dynamic tables by variable name."""
        with self._lock:
            return {name: v.dynamic for name, v in self._variables.items() if v.dynamic is not None}

    def created_dynamic_tables(self) -> list[str]:
        """The dynamic tables that exist on the servers (recovery restores those a server lost)."""
        with self._lock:
            return [name for name, v in self._variables.items() if v.dynamic is not None and name in self._created]

    def restore_dynamic(self, states_by_server: Mapping[int, Sequence[DynamicShardState]]) -> None:
        """Makes the dynamic tables of ``states_by_server`` exactly those rows on the servers (a
        restore: each table replaced whole on every server). Call it inside ``quiesced()``."""
        with self._lock:
            self.client.dynamic.replace(states_by_server)
            for state in (state for states in states_by_server.values() for state in states):
                self._created.add(state.ref.variable)
                variable = self._variables.get(state.ref.variable)
                if variable is not None:  # the servers apply the restored settings from now on
                    variable.optimizer = state.config.optimizer
            self._generation += 1
            self._context = None

    def _create_all(self, variables: list[Variable]) -> None:
        existing = self._existing_on_servers([v.name for v in variables])
        for variable in variables:
            if variable.name not in existing:
                create_on_servers(self.client, variable, self.variable_partitioner)
            self._created.add(variable.name)
        self._context = None  # workers must learn the new layouts
        log.info(
            "%d variables on %d parameter servers (%d created, %d reused)",
            len(self._created),
            self.cluster.num_ps(),
            len(variables) - len(existing),
            len(existing),
        )

    def _existing_on_servers(self, names: list[str]) -> set[str]:
        """Which of ``names`` the servers hold already; they are reused (their layouts adopted)
        when the strategy allows it, else VariableExistsError says how to keep runs apart."""
        layouts = self._held_by_servers(names)
        if layouts and not self.reuse_variables:
            raise variables_exist_error(layouts)
        self.client.adopt_layouts(layouts)
        return set(layouts)

    def _held_by_servers(self, names: Sequence[str]) -> dict[str, VariableLayout]:
        """The layouts of those of ``names`` the servers hold (VariableExistsError for another model's)."""
        return held_by_servers(self.client, {name: (v.shape, v.dtype) for name, v in self._variables.items()}, names)

    def initialize(self) -> None:
        """Creates the variables from their initial values, replacing those that an earlier run
        of this program left on the servers: a coordinator restarted before it wrote its first
        checkpoint starts afresh, as a program that restores-or-initializes asks for. (The dead
        run's values come from closures whose results no one saw and no checkpoint holds; to
        train on from them instead, build the strategy with ``reuse_variables=True``.)
        Raises VariableExistsError for a variable the servers hold with another shape or dtype."""
        if self.reuse_variables:
            return self.materialize()
        with self._lock:
            new = [n for n, v in self._variables.items() if n not in self._created and not v.replicated]
            stale = self._held_by_servers(new)
            if stale:
                self.client.adopt_layouts(stale)
                log.warning(
                    "%d variables of this program exist on the parameter servers from an earlier run "
                    "that left no checkpoint: they start again from their initial values",
                    len(stale),
                )
            for name in stale:
                self.client.delete_variable(name)
            self.materialize()

    @property
    def materialized(self) -> bool:
        """Whether training started: the variables were created (or restored) on the servers."""
        return self._materialized

    def is_created(self, name: str) -> bool:
        """Whether variable ``name`` exists on the servers (models built after training started
        have theirs created with the next closure)."""
        return name in self._created

    def created_layouts(self) -> dict[str, VariableLayout]:
        """Where each variable that exists on the servers lives."""
        with self._lock:
            created = set(self._created)
        return {name: layout for name, layout in self.client.layouts.items() if name in created}

    def checkpoint_key(self, name: str) -> str | None:
        """Variable ``name`` as checkpoints store it (without the run name); None for one that
        checkpoints do not hold (a metric's state)."""
        variable = self._variables.get(name)
        if variable is not None and not variable.checkpointed:
            return None
        return name[len(self._namespace) :] if self._namespace and name.startswith(self._namespace) else name

    def initial_state(self, name: str, layout: VariableLayout, shard: ShardPlacement) -> ShardState:
        """Shard ``shard`` of dense variable ``name`` at its initial value (a metric's state, which
        no checkpoint holds, starts again from there when its server is lost)."""
        variable = self._variables[name]
        if variable.parameter is None:
            raise ValueError(f"{name!r} is a table: its initial rows are made on the servers")
        value = variable.parameter.detach()
        if layout.shape:
            value = value[shard.row_start : shard.row_start + shard.num_rows]
        return ShardState(layout.ref(shard), layout.shape, shard.row_start, value.clone(), variable.optimizer)

    def live_optimizer(self, name: str) -> OptimizerSpec | None:
        """The optimizer and hyperparameters the servers apply to ``name`` now: as declared,
        then as ``set_server_hyperparameters`` (a learning-rate schedule) and restores changed them."""
        with self._lock:
            variable = self._variables.get(name)
            return variable.optimizer if variable is not None else None

    def restore_checkpoint(self, path: pathlib.Path) -> None:
        """Rolls every variable back to checkpoint ``path``, keeping the optimizer settings in
        force now (recovery at RecoveryPoint.ALL)."""
        CheckpointManager(self, path.parent).restore(path, keep_live_settings=True)

    def cluster_context(self) -> ClusterContext:
        """What every closure carries so a (restarted) worker can reach the variables (creates
        the variables not yet on the servers first). Cached; built again when variables are
        added, so its fingerprint tells the workers (and their dispatchers) that it changed."""
        with self._lock:
            self.materialize()
            if self._context is None:
                layouts = self.client.layouts
                self._context = ClusterContext(
                    self.client.addresses,
                    {name: layouts[name] for name in self._created if name in layouts},
                    self._generation,
                    self.servers.failover_seconds,
                )
            return self._context

    def set_server_hyperparameters(self, values: Mapping[str, float], params: Iterable[Any] | None = None) -> None:
        """Changes optimizer hyperparameters (e.g. ``{"lr": 0.01}``) the servers apply, for
        ``params`` (variables, parameters or tables) or every variable of the models by default
        (not the metrics' states, whose sums need their rate of 1). Recorded, so that a
        parameter server restored from an older checkpoint gets them too."""
        with self._lock:
            names = (
                [n for n, v in self._variables.items() if v.checkpointed and v.optimizer is not None]
                if params is None
                else self._variable_names(params)
            )
        # One call per server for all of them (replicated: the next round carries them).
        self.client.set_hyperparameters_of(
            values, [n for n in names if n in self._created and not self._variables[n].replicated]
        )
        for name in names:
            with self._lock:
                variable = self._variables[name]
                if variable.optimizer is not None:
                    variable.optimizer = variable.optimizer.with_kwargs(values)

    # ------------------------------------------------------------------ what fit and its callbacks ask

    def step_runner(
        self, step: StepFn, train_data: Any, *, steps_per_epoch: int | None, coordinator: Any = None
    ) -> StepRunner:
        """Steps run on the workers: ``train_data`` is a dataset function each worker runs
        (``dataset_fn(ctx)`` yielding endless batches); K steps make one closure."""
        check_training_data(train_data, steps_per_epoch)
        return ParameterServerStepRunner(self, step, train_data, coordinator)

    def evaluation_strategy(self) -> Strategy:
        """Evaluation runs on the coordinator, whose modules read the variables' current values."""
        return DefaultStrategy()

    def training_checkpoints(self, directory: str | os.PathLike[str], keep: int) -> TrainingCheckpoints:
        return ServerCheckpoints(self, directory, keep)

    def learning_rate(self, optimizer: Any) -> float:
        return float(server_optimizer_of(optimizer).spec_kwargs.get("lr", 0.0))

    def set_learning_rate(self, optimizer: Any, lr: float) -> None:
        """The servers apply ``lr`` to ``optimizer``'s variables from their next push."""
        server_optimizer = server_optimizer_of(optimizer)
        self.set_server_hyperparameters({"lr": lr}, params=server_optimizer.variables)
        scope_optimizers.show_rate(optimizer, server_optimizer, lr)

    can_restore_model_weights = False  # variables are only assigned by a checkpoint restore

    def model_weights(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The variables' current values (pulled from the servers) as ``model``'s state_dict."""
        from paramserve.coordinator.checkpointing.checkpoint_manager import state_dict

        return state_dict(self, model)

    # ------------------------------------------------------------------ what StrategyExtended asks

    def worker_devices(self) -> tuple[str, ...]:
        """The workers closures run on (their addresses; each computes on its own device)."""
        return tuple(self.cluster.workers)

    def parameter_devices(self) -> tuple[str, ...]:
        """The parameter servers the variables are partitioned over (their addresses)."""
        return tuple(self.cluster.parameter_servers)

    def colocation_refusal(self) -> str | None:
        return (
            "ParameterServerStrategy places each variable's shards with its variable_partitioner, not next to "
            "another variable: pass variable_partitioner=FixedShardsPartitioner(1) to keep every variable whole "
            "on one server (optimizer slots always live with their variable's shards)"
        )

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
        self._release_models()
        self._access.close()
        self.servers.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this ParameterServerStrategy was closed: create a new one")
