"""What MirroredStrategy and CentralStorageStrategy share: ``ReplicatedStrategy``, the base of
the strategies that run N replicas of a model in this process, one thread each.

The base captures what ``scope()`` builds and links each module to its replica copies, runs
``fn`` in the replica threads and their merge points, reduces results, distributes input,
and closes; subclasses decide where variables live and what ``optimizer.step()`` does
(``_adopt_module``, ``_adopt_optimizer``, ``_home_device``, ``_before_run``); their optimizers
meet at the base's merge points (``exchange``, ``calling_replica``, ``replica_copies``,
``add_param_group_in_place``). Also here: how replica devices and the default cross-device ops
are chosen, and REPLICA_GUARDS, the process-wide module and optimizer pre-hooks that refuse,
inside a replica, a module or optimizer not built in the strategy's scope.
It is apart from ``mirrored`` and ``central_storage`` because both build on it.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as module_hooks
from torch.optim import optimizer as optimizer_hooks

from paramserve.coordinator import nest
from paramserve.coordinator.strategies import _capture
from paramserve.coordinator.strategies._process_hooks import Lease, SharedHook
from paramserve.coordinator.strategies._replicas import (
    Rendezvous,
    ReplicaThreads,
    run_replicas,
    running_strategy,
)
from paramserve.coordinator.strategies.base import (
    InputContext,
    ReduceOp,
    ReplicaContext,
    Strategy,
    adopt_global_scope,
    detached,
    get_replica_context,
)
from paramserve.coordinator.strategies.cross_device_ops import (
    CrossDeviceOps,
    HierarchicalCopyAllReduce,
    NcclAllReduce,
    ReductionToOneDevice,
)
from paramserve.coordinator.strategies.distributed_values import (
    DistributedValue,
    PerReplica,
    SyncOnReadVariable,
    ValueContext,
    VariableAggregation,
    regroup,
    select_replica,
)
from paramserve.coordinator.strategies.gathering import concatenate_replicas
from paramserve.coordinator.strategies.input import (
    DistributedDataset,
    DistributedDatasetsFromFunction,
    InputOptions,
)
from paramserve.psserver.runtime.devices import cuda_device_count, resolve_device

# ------------------------------------------------------------------ devices


def resolve_devices(specs: Sequence[str | torch.device], what: str) -> tuple[list[str], list[torch.device]]:
    """The replica devices ``specs`` names (argument ``what`` of a strategy): their names and
    torch devices, in order.

    Raises:
        ValueError: not a non-empty list, a bad name, a device that does not exist here, or one listed twice.
    """
    if isinstance(specs, (str, torch.device)) or not specs:
        raise ValueError(f"{what} must be a non-empty list of devices, e.g. ['cpu:0', 'cpu:1'], got {specs!r}")
    resolved = [resolve_device(s) for s in specs]
    names = [name for name, _ in resolved]
    if len(set(names)) != len(names):
        raise ValueError(f"{what} lists a device twice ({names}): for several CPU replicas use 'cpu:0', 'cpu:1', ...")
    return names, [device for _, device in resolved]


def local_devices() -> list[str]:
    """The default replica devices: all GPUs when there are any, else one CPU replica."""
    count = cuda_device_count()
    return [f"cuda:{i}" for i in range(count)] or ["cpu:0"]


def _default_cross_device_ops(devices: Sequence[torch.device]) -> CrossDeviceOps:
    gpus = {d for d in devices if d.type == "cuda"}
    if len(gpus) >= 2 and len(gpus) == len(devices):
        try:
            return NcclAllReduce()
        except RuntimeError:
            return HierarchicalCopyAllReduce()
    return ReductionToOneDevice()


def reduce_plain(op: ReduceOp, value: Any, axis: int | None) -> Any:
    """``reduce`` of a value that is one replica's (not distributed): itself, or with ``axis``
    its SUM or MEAN along that axis (a tensor's)."""
    if axis is None or not isinstance(value, torch.Tensor):
        return value
    return value.sum(dim=axis) if op is ReduceOp.SUM else value.mean(dim=axis)


# ------------------------------------------------------------------ shared by Mirrored and CentralStorage


class ReplicatedStrategy(Strategy):
    """N replicas in this process, one thread each during ``run``; subclasses decide where
    variables live and what ``optimizer.step()`` does. The base of MirroredStrategy and
    CentralStorageStrategy: its public methods beyond the Strategy API (``exchange``,
    ``calling_replica``, ``replica_copies``, ``add_param_group_in_place``) are for their
    optimizers, in the strategies package."""

    def __init__(self, names: list[str], devices: list[torch.device], cross_device_ops: CrossDeviceOps | None):
        self.device_names = tuple(names)
        self._devices = tuple(devices)
        self.cross_device_ops = cross_device_ops or _default_cross_device_ops(devices)
        self._lock = threading.Lock()  # one run at a time; guards the maps below
        self._rendezvous: Rendezvous | None = None
        self._threads = ReplicaThreads(type(self).__name__, len(devices))
        self._guards = REPLICA_GUARDS.acquire()
        self._closed = False
        # A strategy dropped without close(): its idle threads exit and its hold on the guards
        # ends (no __del__ involved; see _process_hooks for why the lease is only dropped).
        weakref.finalize(self, _abandon, self._threads, self._guards)
        self._linked: list[nn.Module | torch.optim.Optimizer] = []  # every object whose class was swapped
        self._module_links: dict[int, _capture.ModuleLink] = {}  # id(user's module) -> link
        self._roots: list[nn.Module] = []
        self._known_modules: set[int] = set()
        self._param_replicas: dict[int, tuple[torch.Tensor, ...]] = {}  # id(user's param or buffer) -> per replica
        self._containers: dict[int, nn.Module | torch.Tensor] = {}  # id(a replica's copy) -> the user's object
        self._known_optimizers: set[int] = set()
        self._optimizers: list[torch.optim.Optimizer] = []

    @property
    def num_replicas_in_sync(self) -> int:
        return len(self._devices)

    @property
    def replica_devices(self) -> tuple[torch.device, ...]:
        return self._devices

    @property
    def _home_device(self) -> torch.device:
        """Where the user's modules live."""
        return self._devices[0]

    # ------------------------------------------------------------------ scope

    @contextlib.contextmanager
    def _scope_hooks(self) -> Iterator[None]:
        if running_strategy() is self:
            raise RuntimeError(
                f"{type(self).__name__}.scope() was entered inside its own run(): build modules and "
                "optimizers in the scope before calling strategy.run"
            )
        built: list[torch.optim.Optimizer] = []

        def on_optimizer(optimizer: torch.optim.Optimizer) -> None:
            _capture.redirect_optimizer(optimizer)
            self._linked.append(optimizer)
            built.append(optimizer)

        with (
            _capture.recording_modules(place_on=self._home_device) as record,
            _capture.capturing_optimizers(on_optimizer),
        ):
            yield
        self._adopt(record.roots(), built)

    def _adopt(self, roots: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> None:
        """Distributes what one scope built: validate everything, then replicate."""
        with self._lock:
            roots = [r for r in roots if id(r) not in self._module_links]
            self._check_new_roots(roots)
            new_params = {id(p) for root in roots for p in root.parameters()}
            for optimizer in optimizers:
                self._check_optimizer_params(optimizer, new_params)
            for root in roots:
                self._adopt_module(root)
            for optimizer in optimizers:
                self._adopt_optimizer(optimizer)
        self._claim_models(roots)

    def _check_new_roots(self, roots: list[nn.Module]) -> None:
        for root in roots:
            for name, module in root.named_modules():
                if _capture.is_linked(module):
                    raise RuntimeError(
                        f"{type(root).__name__} contains {name or 'itself'}, already distributed by an earlier "
                        f"{type(self).__name__}.scope(): build the whole model inside one scope"
                    )

    def _check_optimizer_params(self, optimizer: torch.optim.Optimizer, new_params: set[int]) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        strangers = [p for p in params if id(p) not in self._param_replicas and id(p) not in new_params]
        if strangers:
            raise RuntimeError(
                f"{type(optimizer).__name__} optimizes {len(strangers)} parameter(s) of no module built in "
                f"{type(self).__name__}.scope(): build the model inside the scope too (before the optimizer)"
            )

    def add_param_group_in_place(self, optimizer: torch.optim.Optimizer, param_group: dict[str, Any]) -> dict[str, Any]:
        """``optimizer.add_param_group`` after the scope closed, on the user's optimizer itself:
        torch fills in and checks the group, then the group's parameters must be ones this
        strategy replicates. Returns the group as torch stored it, for the strategy's optimizer
        to mirror onto its replicas.

        Raises:
            RuntimeError: a parameter of no module built in the scope (the group is taken back).
            ValueError, TypeError: what torch's ``add_param_group`` raises.
        """
        _capture.base_class(optimizer).add_param_group(optimizer, param_group)
        group = optimizer.param_groups[-1]
        strangers = [p for p in group["params"] if id(p) not in self._param_replicas]
        if strangers:
            optimizer.param_groups.pop()
            raise RuntimeError(
                f"the param group added to {type(optimizer).__name__} holds {len(strangers)} parameter(s) of no "
                f"module built in {type(self).__name__}.scope(): they would not be replicated; build their "
                "module inside the scope"
            )
        return group

    def _link_tree(self, original: nn.Module, replicas: Sequence[nn.Module]) -> None:
        """Points every module of ``original``'s tree at its counterparts in ``replicas``."""
        trees = [list(r.modules()) for r in replicas]
        for position, module in enumerate(list(original.modules())):
            counterparts = tuple(tree[position] for tree in trees)
            self._known_modules.update(id(m) for m in counterparts)
            self._known_modules.add(id(module))
            link = _capture.ModuleLink(self, counterparts)
            _capture.link_module(module, link)
            self._linked.append(module)
            self._module_links[id(module)] = link
            self._containers.update((id(m), module) for m in counterparts if m is not module)
        for tensors in [
            *zip(original.parameters(), *(r.parameters() for r in replicas)),
            *zip(original.buffers(), *(r.buffers() for r in replicas)),
        ]:
            self._param_replicas[id(tensors[0])] = tuple(tensors[1:])
            self._containers.update((id(t), tensors[0]) for t in tensors[1:] if t is not tensors[0])
        self._roots.append(original)

    def _adopt_module(self, root: nn.Module) -> None:
        raise NotImplementedError

    def _adopt_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ running

    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None) -> Any:
        """Runs ``fn`` once per replica, each in its own thread, in replica context; PerReplica
        arguments give replica r its component r, and plain tensors among the arguments reach
        replica r on its device (as TensorFlow places a replica's inputs). Returns one value
        when every replica returned the same object, else PerReplica values (inside the
        returned structure).

        Raises whatever a replica raised (its replica id in the exception's notes)."""
        context = get_replica_context()
        if (context is not None and context.strategy is self) or running_strategy() is self:
            raise RuntimeError(
                f"{type(self).__name__}.run was called inside its own run (or a merge_call there): call fn directly"
            )
        adopt_global_scope(self)
        args, kwargs = tuple(args), dict(kwargs or {})
        self._check_distributed_args((args, kwargs))
        with self._lock:
            if self._closed:
                raise RuntimeError(f"this {type(self).__name__} was closed: create a new strategy to train again")
            self._before_run()
            self._rendezvous = Rendezvous(self.num_replicas_in_sync)
            try:
                results = run_replicas(
                    self,
                    self._devices,
                    lambda r: fn(*self._replica_inputs(args, r), **self._replica_inputs(kwargs, r)),
                    self._rendezvous,
                    self._threads,
                )
            finally:
                self._rendezvous = None
        return regroup(results)

    def close(self) -> None:
        """Ends the strategy: joins its replica threads, gives the modules and optimizers
        built in its scope their own classes back (replica 0's copy, the user's module,
        keeps its values; the other copies are dropped) and releases the process-wide
        guards. Idempotent. Call it when done; without it, idle replica threads still exit
        when the strategy is garbage-collected or the interpreter exits."""
        context = get_replica_context()
        if context is not None and context.strategy is self:
            raise RuntimeError(f"{type(self).__name__}.close() was called inside its own run")
        with self._lock:  # after a run in progress in another thread
            if self._closed:
                return
            self._closed = True
            self._threads.close()
            for obj in self._linked:
                _capture.unlink(obj)
            self._linked.clear()
            self._module_links.clear()
            self._containers.clear()
            self._guards.release()
        self._release_models()

    def _before_run(self) -> None:
        """Hook: bring replicas up to date before their threads start."""

    def _replica_inputs(self, structure: Any, replica: int) -> Any:
        """Replica ``replica``'s view of run's arguments: its component of each distributed value
        (where the input pipeline put it), every plain tensor moved to its device. Runs in the
        replica's thread, so the copies of several replicas overlap."""
        device = self._devices[replica]

        def pick(leaf: Any) -> Any:
            if isinstance(leaf, DistributedValue) and not isinstance(leaf, SyncOnReadVariable):
                return leaf.values[replica]
            return nest.to_device(leaf, device) if isinstance(leaf, torch.Tensor) else leaf

        return nest.map_structure(pick, structure)

    def _check_distributed_args(self, structure: Any) -> None:
        for leaf in nest.flatten(structure):
            if isinstance(leaf, DistributedValue) and not isinstance(leaf, SyncOnReadVariable):
                if len(leaf.values) != self.num_replicas_in_sync:
                    raise ValueError(
                        f"an argument has {len(leaf.values)} per-replica components for {self.num_replicas_in_sync} "
                        f"replicas: distribute it with this strategy (experimental_distribute_dataset)"
                    )

    def exchange(self, replica: int, value: Any, combine: Callable[[list[Any]], Sequence[Any]]) -> Any:
        """A merge point inside ``run``: replica ``replica`` brings ``value`` and waits for every
        other replica's; the last to arrive calls ``combine`` on all of them, in replica order, and
        each replica gets its element of the result. Every replica must call it, in the same order.

        Raises:
            RuntimeError: called outside ``run``.
            ReplicaDeparted: another replica finished or failed without reaching this point, or
                ``combine`` failed in another replica's thread (in the replica that ran it, its
                error itself).
        """
        rendezvous = self._rendezvous
        if rendezvous is None:
            raise RuntimeError(f"merge points only exist inside {type(self).__name__}.run(...)")
        return rendezvous.exchange(replica, value, combine)

    def replica_all_reduce(self, context: ReplicaContext, reduce_op: ReduceOp, value: Any) -> Any:
        return self.exchange(
            context.replica_id_in_sync_group, value, lambda nests: self._all_reduce_nests(reduce_op, nests)
        )

    def replica_all_gather(self, context: ReplicaContext, tensors: list[torch.Tensor], axis: int) -> list[torch.Tensor]:
        return self.exchange(context.replica_id_in_sync_group, tensors, lambda lists: concatenate_replicas(lists, axis))

    def replica_merge_call(
        self, context: ReplicaContext, merge_fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """A merge point: the last replica to arrive runs replica 0's ``merge_fn`` (as TensorFlow
        does: each replica's is its own closure) on the replicas' merged arguments, in
        cross-replica context (the user's modules are themselves there, not a replica's copy);
        each replica takes its component of the result."""

        def combine(per_replica: list[tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]]) -> list[Any]:
            merged = regroup([(a, k) for _, a, k in per_replica])
            if not (isinstance(merged, tuple) and isinstance(merged[0], tuple) and isinstance(merged[1], dict)):
                raise ValueError(
                    "merge_call got a different number of arguments (or other keyword names) from each replica: "
                    "every replica must pass the same structure"
                )
            with self.cross_replica_context(), _capture.unredirected():
                result = per_replica[0][0](self, *merged[0], **merged[1])
            return [select_replica(result, r) for r in range(len(per_replica))]

        return self.exchange(context.replica_id_in_sync_group, (merge_fn, args, kwargs), combine)

    def _all_reduce_nests(self, op: ReduceOp, nests: list[Any]) -> list[Any]:
        flats = [[torch.as_tensor(leaf) for leaf in nest.flatten(n)] for n in nests]
        reduced = self.cross_device_ops.batch_all_reduce(op, [list(column) for column in zip(*flats)])
        per_replica = [[m.values[r] for m in reduced] for r in range(len(nests))]
        return [_rebuild_like(structure, leaves) for structure, leaves in zip(nests, per_replica)]

    def calling_replica(self, what: str) -> int:
        """The id of the replica whose thread calls ``what`` (an optimizer's ``step()``), which
        must run inside this strategy's ``run``.

        Raises:
            RuntimeError: called elsewhere (the message says where ``what`` belongs).
        """
        context = get_replica_context()
        if context is None or context.strategy is not self:
            raise RuntimeError(
                f"{what} of an optimizer built in {type(self).__name__}.scope() must run inside strategy.run(...), "
                "where every replica reaches it and the gradients are summed: call it from the function you run "
                "(fit does, under the strategy its model was built in, or the one you pass as strategy=)"
            )
        return context.replica_id_in_sync_group

    # ------------------------------------------------------------------ results and input

    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: int | None = None) -> Any:
        """Combines per-replica values into one tensor on the host CPU (cross-replica context).
        With ``axis``, MEAN averages over every example along that axis (uneven shares weigh right)."""
        context = get_replica_context()
        if context is not None and context.strategy is self:
            raise RuntimeError(
                "strategy.reduce is for cross-replica context; inside run use get_replica_context().all_reduce"
            )
        op = ReduceOp(reduce_op)
        return detached(nest.map_structure(lambda v: self._reduce_one(op, v, axis), value))

    def _reduce_one(self, op: ReduceOp, value: Any, axis: int | None) -> Any:
        if not isinstance(value, DistributedValue):
            if op is ReduceOp.SUM and self.num_replicas_in_sync > 1 and value is not None:
                raise ValueError(
                    f"cannot SUM {type(value).__name__}, which is not a per-replica value (every replica returned "
                    "the same object): reduce the PerReplica values strategy.run returns"
                )
            return reduce_plain(op, value, axis)
        parts = [torch.as_tensor(v) for v in value.values]
        if axis is None:
            return self.cross_device_ops.reduce(op, parts, "cpu")
        total = self.cross_device_ops.reduce(ReduceOp.SUM, [p.sum(dim=axis) for p in parts], "cpu")
        return total if op is ReduceOp.SUM else total / sum(p.shape[axis] for p in parts)

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        """Components of a distributed value; for a module, parameter or buffer built in scope,
        each replica's copy."""
        adopt_global_scope(self)
        link = self._module_links.get(id(value)) if isinstance(value, nn.Module) else None
        if link is not None:
            return link.replicas
        if isinstance(value, torch.Tensor) and id(value) in self._param_replicas:
            return self._param_replicas[id(value)]
        return super().experimental_local_results(value)

    def replica_copies(self, tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each replica's copy of ``tensor``, a parameter or buffer of a module this strategy
        distributed, in replica order. Raises KeyError for any other tensor."""
        return self._param_replicas[id(tensor)]

    def experimental_distribute_values_from_function(self, value_fn: Callable[[ValueContext], Any]) -> PerReplica:
        """A PerReplica whose component r is ``value_fn(ValueContext(r, N))``, its tensors moved to
        replica r's device (as TensorFlow builds each under the replica's device)."""
        count = self.num_replicas_in_sync
        return PerReplica([nest.to_device(value_fn(ValueContext(r, count)), d) for r, d in enumerate(self._devices)])

    # ------------------------------------------------------------------ what StrategyExtended asks

    def worker_devices(self) -> tuple[str, ...]:
        return self.device_names

    def owns_variable(self, v: Any) -> bool:
        if isinstance(v, torch.Tensor) and (id(v) in self._param_replicas or id(v) in self._containers):
            return True
        return super().owns_variable(v)

    def value_container(self, value: Any) -> Any:
        return self._containers.get(id(value), value)

    def reduce_to_devices(self, reduce_op: ReduceOp, value: Any, devices: list[torch.device]) -> Any:
        """Through the cross-device ops, straight to ``devices``."""
        destination: torch.device | list[torch.device] = devices[0] if len(devices) == 1 else devices
        if isinstance(value, DistributedValue):
            return detached(self.cross_device_ops.reduce(reduce_op, value, destination))
        plain = torch.as_tensor(self._reduce_one(reduce_op, value, None))  # refuses to SUM a plain value
        return detached(self.cross_device_ops.broadcast(plain, destination))

    def metric_state(self, template: Any, name: str) -> Any:
        """A copy per replica, merged when read (metrics are SyncOnRead, as in tf.distribute)."""
        from paramserve.coordinator.strategies.metric_states import PerReplicaMetricState

        def replica_id() -> int | None:
            context = get_replica_context()
            return context.replica_id_in_sync_group if context is not None and context.strategy is self else None

        return PerReplicaMetricState(template, replica_id, self.num_replicas_in_sync)

    def sync_on_read_buffers(
        self, module: nn.Module, aggregation: VariableAggregation | str = VariableAggregation.MEAN
    ) -> dict[str, SyncOnReadVariable]:
        """Each buffer of ``module`` (e.g. batch-norm running mean/var) across the replicas, as a
        SyncOnReadVariable: ``read_value()`` outside the replicas aggregates them. Integer
        buffers (num_batches_tracked) use ONLY_FIRST_REPLICA."""
        replicas = self.experimental_local_results(module)
        if len(replicas) != self.num_replicas_in_sync:
            raise ValueError(f"{type(module).__name__} was not built in {type(self).__name__}.scope()")
        per_replica = [dict(r.named_buffers()) for r in replicas]
        variables = {}
        for name, buffer in per_replica[0].items():
            how = aggregation if buffer.is_floating_point() else VariableAggregation.ONLY_FIRST_REPLICA
            variables[name] = SyncOnReadVariable.from_local_values([b[name] for b in per_replica], how, self)
        return variables

    def experimental_distribute_dataset(
        self, dataset: Iterable[Any], options: InputOptions | None = None
    ) -> DistributedDataset:
        return DistributedDataset(dataset, self._devices, options=options)

    def distribute_datasets_from_function(
        self, dataset_fn: Callable[[InputContext], Iterable[Any]], options: InputOptions | None = None
    ) -> DistributedDatasetsFromFunction:
        context = InputContext(
            num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=self.num_replicas_in_sync
        )
        return DistributedDatasetsFromFunction(dataset_fn, [context], self._devices, options)

    # ------------------------------------------------------------------ guards

    def _check_module(self, module: nn.Module) -> None:
        if id(module) in self._known_modules:
            return
        owns_state = any(True for _ in module.parameters(recurse=False)) or any(
            True for _ in module.buffers(recurse=False)
        )
        if owns_state:
            raise RuntimeError(
                f"{type(module).__name__} was not built in {type(self).__name__}.scope(), so all replicas would share "
                "(and race on) its parameters: build it inside `with strategy.scope():`"
            )

    def _check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        if id(optimizer) not in self._known_optimizers:
            raise RuntimeError(
                f"{type(optimizer).__name__} was not built in {type(self).__name__}.scope(), so its step would not "
                "merge the replicas' gradients: build it inside `with strategy.scope():`"
            )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(devices={list(self.device_names)})"


def _rebuild_like(structure: Any, leaves: list[Any]) -> Any:
    it = iter(leaves)
    return nest.map_structure(lambda _: next(it), structure)


def flat_params(optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    """Every parameter ``optimizer`` steps, group after group."""
    return [p for group in optimizer.param_groups for p in group["params"]]


# ------------------------------------------------------------------ process-wide guards


def _replicated_strategy() -> ReplicatedStrategy | None:
    if running_strategy() is None:  # the common case, every module call of the process: stay cheap
        return None
    context = get_replica_context()
    if context is None or not isinstance(context.strategy, ReplicatedStrategy):
        return None
    return context.strategy


def _guard_module(module: nn.Module, args: Any) -> None:
    strategy = _replicated_strategy()
    if strategy is not None:
        strategy._check_module(module)


def _guard_optimizer(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    strategy = _replicated_strategy()
    if strategy is not None:
        strategy._check_optimizer(optimizer)


def _install_guards() -> Callable[[], None]:
    """Inside a replica, calling a module or stepping an optimizer that was not built in the
    strategy's scope raises instead of silently sharing state: torch's global forward
    pre-hook and optimizer step pre-hook, while any replicated strategy is open."""
    handles = [
        module_hooks.register_module_forward_pre_hook(_guard_module),
        optimizer_hooks.register_optimizer_step_pre_hook(_guard_optimizer),
    ]

    def remove() -> None:
        for handle in handles:
            handle.remove()

    return remove


REPLICA_GUARDS = SharedHook("replica guards (global module and optimizer pre-hooks)", _install_guards)


def _abandon(threads: ReplicaThreads, guards: Lease) -> None:
    """A replicated strategy was garbage-collected without close() (a GC callback: no locks)."""
    threads.stop_soon()
    guards.drop()
