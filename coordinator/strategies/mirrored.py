"""In-process strategies: OneDeviceStrategy, MirroredStrategy, CentralStorageStrategy.

The user's training code stays plain PyTorch:

    strategy = MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        model = Net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(batch):
        x, y = batch
        optimizer.zero_grad()
        loss = compute_average_loss(loss_fn(model(x), y))   # loss_fn(..., reduction="none")
        loss.backward()
        optimizer.step()              # merge point: gradients summed across replicas
        return loss

    for batch in strategy.experimental_distribute_dataset(loader):
        losses = strategy.run(step, args=(batch,))
        print(strategy.reduce("SUM", losses))

How (MirroredStrategy):
- Modules built in ``scope()`` are captured (torch's module registration hooks);
  at scope exit replica 0 is the user's module on the first device and replicas
  1..N-1 are deep copies on the other devices ("mirrored variables").
- Optimizers built in ``scope()`` are captured (``Optimizer.__init__`` is
  reported while the scope is open); each replica gets its own copy (its own
  state) over its own parameters. An optimizer must be built inside a scope.
- ``run(fn)`` runs fn in one thread per replica (named ``MirroredStrategy-replica-<r>``,
  started by the first run and reused by the next; ``strategy.close()`` stops and
  joins them). Inside replica r, the user's
  module and every attribute of it (``model(x)``, ``model.fc.weight``,
  ``model.parameters()``) resolve to replica r's copy; call the module rather
  than ``model.forward``.
- Devices: a module built in ``scope()`` has its parameters and buffers placed on the
  device as they are registered (so an optimizer built next finds them there). Nothing
  else is placed: no default device is set, in the scope or in ``run``, so input functions
  and other code build their tensors where they always would (``torch.randperm`` with a
  CPU generator keeps working on a GPU machine). ``run`` moves plain-tensor arguments to
  each replica's device (as TensorFlow places a replica's inputs) and makes a GPU replica's
  device the thread's current CUDA device; tensors the step creates itself go where its
  code says (``device=x.device``), as in plain PyTorch.
- ``optimizer.step()`` inside a replica is a merge point: all replicas meet,
  gradients are summed by ``cross_device_ops`` and every replica applies the
  same update to its copy, so the copies stay identical. Learning-rate changes
  on the user's optimizer (schedulers) reach every replica at each step.
- Called outside the replicas, ``train()/eval()``, ``zero_grad()``,
  ``load_state_dict()`` and ``requires_grad_()`` of a distributed module, and
  ``zero_grad()``/``load_state_dict()`` of a distributed optimizer, apply to
  every replica. ``model.to(...)`` after the scope moves replica 0 only: don't.
- Buffers (batch-norm running statistics) are per replica: each replica
  updates its own from its share of the batch. ``sync_on_read_buffers(model)``
  gives them as SyncOnReadVariables (MEAN across replicas when read).
- ``copy.deepcopy(model)`` and pickling give a plain (not distributed) module.
- CPU replicas share the host's cores, and each replica thread runs torch ops with
  torch's intra-op thread count (by default, the number of cores): N replicas on C
  cores oversubscribe them. The strategy leaves that process-wide setting alone;
  ``torch.set_num_threads(max(1, C // N))`` before training is usually fastest.

CentralStorageStrategy keeps each parameter once, on the parameter device (the
user's module); every compute device runs a replica copy refreshed from it at
each run and after each step. At ``optimizer.step()`` the replicas' gradients
are summed into the central parameters and one optimizer step is taken.
"""

from __future__ import annotations

import contextlib
import copy
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
    SyncOnReadVariable,
    VariableAggregation,
    regroup,
)
from paramserve.coordinator.strategies.input import (
    DistributedDataset,
    DistributedDatasetsFromFunction,
    InputOptions,
)
from paramserve.psserver.devices import computing_on, cuda_device_count, resolve_device

# ------------------------------------------------------------------ devices


def _resolve_devices(specs: Sequence[str | torch.device], what: str) -> tuple[list[str], list[torch.device]]:
    if isinstance(specs, (str, torch.device)) or not specs:
        raise ValueError(f"{what} must be a non-empty list of devices, e.g. ['cpu:0', 'cpu:1'], got {specs!r}")
    resolved = [resolve_device(s) for s in specs]
    names = [name for name, _ in resolved]
    if len(set(names)) != len(names):
        raise ValueError(f"{what} lists a device twice ({names}): for several CPU replicas use 'cpu:0', 'cpu:1', ...")
    return names, [device for _, device in resolved]


def _local_devices() -> list[str]:
    """All GPUs when there are any, else one CPU replica."""
    count = cuda_device_count()
    return [f"cuda:{i}" for i in range(count)] or ["cpu:0"]


_LOCAL_SUM_OPS = (CrossDeviceOps, ReductionToOneDevice, HierarchicalCopyAllReduce)
"""Cross-device ops whose all-reduce of CPU tensors is a plain sum in replica order."""


def _default_cross_device_ops(devices: Sequence[torch.device]) -> CrossDeviceOps:
    gpus = {d for d in devices if d.type == "cuda"}
    if len(gpus) >= 2 and len(gpus) == len(devices):
        try:
            return NcclAllReduce()
        except RuntimeError:
            return HierarchicalCopyAllReduce()
    return ReductionToOneDevice()


def _reduce_plain(op: ReduceOp, value: Any, axis: int | None) -> Any:
    if axis is None or not isinstance(value, torch.Tensor):
        return value
    return value.sum(dim=axis) if op is ReduceOp.SUM else value.mean(dim=axis)


# ------------------------------------------------------------------ OneDeviceStrategy


class OneDeviceStrategy(Strategy):
    """Everything on one device: modules built in scope are placed there, ``run`` calls fn
    once with its tensor arguments moved there, and distributed input is prefetched there.

    Args:
        device: "cpu", "cuda:0", "/gpu:0", a torch.device...

    Raises:
        ValueError: the device does not exist on this machine or is not a device name.
    """

    def __init__(self, device: str | torch.device):
        self.device_name, self.device = resolve_device(device)

    @property
    def num_replicas_in_sync(self) -> int:
        return 1

    @property
    def replica_devices(self) -> tuple[torch.device, ...]:
        return (self.device,)

    @contextlib.contextmanager
    def _scope_hooks(self) -> Iterator[None]:
        with _capture.recording_modules(place_on=self.device) as record:
            yield
        for module in record.roots():
            module.to(self.device)  # what registration did not place (a lazy module's parameters)
        self._claim_models(record.roots())

    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None) -> Any:
        args = nest.to_device(tuple(args), self.device)
        kwargs = nest.to_device(dict(kwargs or {}), self.device)
        with self._in_replica(0), computing_on(self.device):
            return fn(*args, **kwargs)

    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: int | None = None) -> Any:
        op = ReduceOp(reduce_op)
        return detached(nest.map_structure(lambda v: _reduce_plain(op, _single(v), axis), value))

    def experimental_distribute_dataset(
        self, dataset: Iterable[Any], options: InputOptions | None = None
    ) -> DistributedDataset:
        return DistributedDataset(dataset, [self.device], options=options)

    def distribute_datasets_from_function(
        self, dataset_fn: Callable[[InputContext], Iterable[Any]], options: InputOptions | None = None
    ) -> DistributedDatasetsFromFunction:
        return DistributedDatasetsFromFunction(dataset_fn, [InputContext()], [self.device], options)

    def __repr__(self) -> str:
        return f"OneDeviceStrategy({self.device_name!r})"


def _single(value: Any) -> Any:
    return value.values[0] if isinstance(value, DistributedValue) and len(value.values) == 1 else value


# ------------------------------------------------------------------ shared by Mirrored and CentralStorage


class _ReplicatedStrategy(Strategy):
    """N replicas in this process, one thread each during ``run``; subclasses decide where
    variables live and what ``optimizer.step()`` does."""

    def __init__(self, names: list[str], devices: list[torch.device], cross_device_ops: CrossDeviceOps | None):
        self.device_names = tuple(names)
        self._devices = tuple(devices)
        self.cross_device_ops = cross_device_ops or _default_cross_device_ops(devices)
        self._cpu_only = all(d.type == "cpu" for d in devices)
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
        self._param_replicas: dict[int, tuple[nn.Parameter, ...]] = {}  # id(user's param) -> per replica
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
        for params in zip(original.parameters(), *(r.parameters() for r in replicas)):
            self._param_replicas[id(params[0])] = tuple(params[1:])
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
        if context is not None and context.strategy is self:
            raise RuntimeError(f"{type(self).__name__}.run was called inside its own run: call fn directly there")
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

    def _merge(self, replica: int, value: Any, combine: Callable[[list[Any]], Sequence[Any]]) -> Any:
        rendezvous = self._rendezvous
        if rendezvous is None:
            raise RuntimeError(f"merge points only exist inside {type(self).__name__}.run(...)")
        return rendezvous.exchange(replica, value, combine)

    def _replica_all_reduce(self, context: ReplicaContext, reduce_op: ReduceOp, value: Any) -> Any:
        return self._merge(
            context.replica_id_in_sync_group, value, lambda nests: self._all_reduce_nests(reduce_op, nests)
        )

    def _all_reduce_nests(self, op: ReduceOp, nests: list[Any]) -> list[Any]:
        flats = [[torch.as_tensor(leaf) for leaf in nest.flatten(n)] for n in nests]
        reduced = self.cross_device_ops.batch_all_reduce(op, [list(column) for column in zip(*flats)])
        per_replica = [[m.values[r] for m in reduced] for r in range(len(nests))]
        return [_rebuild_like(structure, leaves) for structure, leaves in zip(nests, per_replica)]

    def _sum_gradients(self, grads: list[list[torch.Tensor | None]]) -> list[list[torch.Tensor | None]]:
        """All-reduces (SUM) gradient i of every replica; None where no replica has one.
        A replica without a gradient that others have contributes zeros."""
        out: list[list[torch.Tensor | None]] = [[None] * len(grads[0]) for _ in grads]
        present = [i for i in range(len(grads[0])) if any(g[i] is not None for g in grads)]
        columns = [
            [_or_zeros(g[i], _first_present(grads, i), self._devices[r]) for r, g in enumerate(grads)] for i in present
        ]
        for i, mirrored in zip(present, self.cross_device_ops.batch_all_reduce(ReduceOp.SUM, columns)):
            for r in range(len(grads)):
                out[r][i] = mirrored.values[r]
        return out

    def _sums_locally(self) -> bool:
        """Whether gradients may be summed by each replica itself: every replica on the host
        CPU and one of the library's cross-device ops (they all add in replica order there)."""
        if not self._cpu_only or type(self.cross_device_ops) not in _LOCAL_SUM_OPS:
            return False
        where = getattr(self.cross_device_ops, "reduce_to_device", None)
        return where is None or where.type == "cpu"

    def _replica_id(self, what: str) -> int:
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
            return _reduce_plain(op, value, axis)
        parts = [torch.as_tensor(v) for v in value.values]
        if axis is None:
            return self.cross_device_ops.reduce(op, parts, "cpu")
        total = self.cross_device_ops.reduce(ReduceOp.SUM, [p.sum(dim=axis) for p in parts], "cpu")
        return total if op is ReduceOp.SUM else total / sum(p.shape[axis] for p in parts)

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        """Components of a distributed value; for a module or parameter built in scope,
        each replica's copy."""
        link = self._module_links.get(id(value)) if isinstance(value, nn.Module) else None
        if link is not None:
            return link.replicas
        if isinstance(value, torch.Tensor) and id(value) in self._param_replicas:
            return self._param_replicas[id(value)]
        return super().experimental_local_results(value)

    def metric_state(self, template: Any, name: str) -> Any:
        """A copy per replica, merged when read (metrics are SyncOnRead, as in tf.distribute)."""
        from paramserve.coordinator.metrics import PerReplicaMetricState

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


def _flat_params(optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    return [p for group in optimizer.param_groups for p in group["params"]]


# ------------------------------------------------------------------ MirroredStrategy


class MirroredStrategy(_ReplicatedStrategy):
    """Synchronous training on several local devices, one replica (a full model copy) each.

    Args:
        devices: replica devices; default all GPUs, or one CPU replica on a CPU-only
            machine. ``["cpu:0", "cpu:1"]`` gives two CPU replicas (useful for testing).
        cross_device_ops: how gradients are summed; default NcclAllReduce on 2+ GPUs,
            else ReductionToOneDevice.

    Raises:
        ValueError: a device that does not exist, a bad name, or a device listed twice.
    """

    def __init__(
        self, devices: Sequence[str | torch.device] | None = None, cross_device_ops: CrossDeviceOps | None = None
    ):
        names, resolved = _resolve_devices(devices if devices is not None else _local_devices(), "devices")
        super().__init__(names, resolved, cross_device_ops)

    def _adopt_module(self, root: nn.Module) -> None:
        root.to(self._devices[0])
        copies = [copy.deepcopy(root).to(device) for device in self._devices[1:]]
        self._link_tree(root, [root, *copies])

    def _adopt_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        replicas = [optimizer]
        for r in range(1, self.num_replicas_in_sync):
            memo: dict[int, Any] = {id(p): self._param_replicas[id(p)][r] for p in _flat_params(optimizer)}
            replica = copy.deepcopy(optimizer, memo)
            _move_state(replica, optimizer)
            replicas.append(replica)
        self._known_optimizers.update(id(o) for o in replicas)
        self._optimizers.append(optimizer)
        _capture.link_optimizer(optimizer, _MirroredOptimizer(self, optimizer, replicas))


def _sum_columns(
    grads: list[list[torch.Tensor | None]], replica: int, devices: Sequence[torch.device]
) -> list[torch.Tensor | None]:
    """Replica ``replica``'s share of ``_sum_gradients(grads)`` on CPU replicas: gradient i
    summed across replicas in replica order (a replica without it adds zeros), as new tensors."""
    out: list[torch.Tensor | None] = [None] * len(grads[0])
    present = [i for i in range(len(out)) if any(g[i] is not None for g in grads)]
    if not present:
        return out
    columns = [[_or_zeros(g[i], _first_present(grads, i), devices[r]) for i in present] for r, g in enumerate(grads)]
    totals: list[torch.Tensor]
    if all(t.layout is torch.strided for column in columns for t in column):
        if len(columns) == 1:
            totals = [t.clone() for t in columns[0]]
        else:
            totals = list(torch._foreach_add(columns[0], columns[1]))
            for column in columns[2:]:
                torch._foreach_add_(totals, column)
    else:  # sparse gradients: one at a time
        totals = []
        for j in range(len(present)):
            total = columns[0][j].clone()
            for column in columns[1:]:
                total.add_(column[j])
            totals.append(total)
    for i, total in zip(present, totals):
        out[i] = total
    return out


def _first_present(grads: list[list[torch.Tensor | None]], i: int) -> torch.Tensor:
    """Gradient ``i`` of the first replica that has one (some replica must)."""
    return next(t for g in grads if (t := g[i]) is not None)


def _or_zeros(grad: torch.Tensor | None, example: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``grad``, or zeros shaped like ``example`` on ``device`` for a replica without one."""
    return grad if grad is not None else torch.zeros_like(example, device=device)


def _move_state(replica: torch.optim.Optimizer, original: torch.optim.Optimizer) -> None:
    """Moves a copied optimizer's state tensors to its own parameters' devices."""
    for p_copy, p_orig in zip(_flat_params(replica), _flat_params(original)):
        state = replica.state.get(p_copy, {})
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.device == p_orig.device:
                state[key] = value.to(p_copy.device)


class _MirroredOptimizer:
    """``optimizer.step()`` under MirroredStrategy: sum gradients, same update everywhere."""

    def __init__(
        self, strategy: MirroredStrategy, optimizer: torch.optim.Optimizer, replicas: list[torch.optim.Optimizer]
    ):
        self.strategy = strategy
        self.optimizer = optimizer
        self.replicas = replicas
        self.base = _capture.base_class(optimizer)

    def step(self, closure: Callable[[], Any] | None) -> Any:
        replica = self.strategy._replica_id("optimizer.step()")
        if closure is not None:
            raise ValueError(
                "optimizer.step(closure) is not supported under MirroredStrategy: compute the loss and "
                "call backward() before optimizer.step()"
            )
        params = _flat_params(self.replicas[replica])
        if self.strategy._sums_locally():
            # All replicas on the host CPU: the merge only shares the gradients; then each
            # replica, in parallel, adds them up (in replica order, as the cross-device ops
            # would) into new tensors of its own: no serial sum, no copies back.
            every = self.strategy._merge(replica, [p.grad for p in params], self._share)
            grads = _sum_columns(every, replica, self.strategy._devices)
        else:
            grads = self.strategy._merge(replica, [p.grad for p in params], self._combine)
        for param, grad in zip(params, grads):
            if grad is not None:
                param.grad = grad
        return self.base.step(self.replicas[replica])

    def _sync_hyperparameters(self) -> None:
        # Runs once while every replica waits: the safe moment to copy hyperparameters
        # (an LR scheduler changes only the user's optimizer).
        for replica in self.replicas[1:]:
            for source, target in zip(self.optimizer.param_groups, replica.param_groups):
                target.update({k: v for k, v in source.items() if k != "params"})

    def _combine(self, grads: list[list[torch.Tensor | None]]) -> list[list[torch.Tensor | None]]:
        self._sync_hyperparameters()
        return self.strategy._sum_gradients(grads)

    def _share(self, grads: list[list[torch.Tensor | None]]) -> list[list[list[torch.Tensor | None]]]:
        self._sync_hyperparameters()
        return [grads] * len(grads)

    def zero_grad(self, set_to_none: bool) -> None:
        context = get_replica_context()
        if context is not None and context.strategy is self.strategy:
            self.base.zero_grad(self.replicas[context.replica_id_in_sync_group], set_to_none)
            return
        for replica in self.replicas:
            self.base.zero_grad(replica, set_to_none)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for replica in self.replicas:
            self.base.load_state_dict(replica, copy.deepcopy(state_dict))

    def pickled_as(self) -> None:
        return None  # a pickled (or deep-copied) optimizer is a plain one of the user's class


# ------------------------------------------------------------------ CentralStorageStrategy


class CentralStorageStrategy(_ReplicatedStrategy):
    """Synchronous training with each parameter stored once, on ``parameter_device``, and the
    computation replicated on ``compute_devices``.

    The user's module is the central one. Each compute device runs a replica copy whose
    parameters are refreshed from the central ones at each run and after each step; at
    ``optimizer.step()`` the replicas' gradients are summed into the central parameters'
    ``.grad`` and the user's optimizer takes one step. Buffers (batch-norm statistics) are
    per replica; after each step the central module's buffers are set to their MEAN
    (integer buffers: replica 0's).

    Args:
        compute_devices: default all GPUs, else one CPU replica; ``["cpu:0", "cpu:1"]``
            gives two CPU replicas.
        parameter_device: where the variables live (default the CPU).
        cross_device_ops: how gradients are summed onto the parameter device.
    """

    def __init__(
        self,
        compute_devices: Sequence[str | torch.device] | None = None,
        parameter_device: str | torch.device = "cpu",
        cross_device_ops: CrossDeviceOps | None = None,
    ):
        names, resolved = _resolve_devices(
            compute_devices if compute_devices is not None else _local_devices(), "compute_devices"
        )
        self.parameter_device_name, self.parameter_device = resolve_device(parameter_device)
        super().__init__(names, resolved, cross_device_ops or ReductionToOneDevice(self.parameter_device))

    @property
    def _home_device(self) -> torch.device:
        return self.parameter_device

    def _adopt_module(self, root: nn.Module) -> None:
        root.to(self.parameter_device)
        self._link_tree(root, [copy.deepcopy(root).to(device) for device in self._devices])

    def _adopt_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self._known_optimizers.add(id(optimizer))
        self._optimizers.append(optimizer)
        _capture.link_optimizer(optimizer, _CentralOptimizer(self, optimizer))

    def _before_run(self) -> None:
        self._refresh([p for root in self._roots for p in root.parameters()])

    @torch.no_grad()
    def _refresh(self, params: Iterable[nn.Parameter]) -> None:
        """Copies central parameter values into every replica's copy."""
        for param in params:
            for replica_param in self._param_replicas[id(param)]:
                replica_param.copy_(param)

    @torch.no_grad()
    def _gather_buffers(self) -> None:
        """Central buffers := MEAN of the replicas' (first replica's for integer buffers)."""
        with _capture.unredirected():
            for root in self._roots:
                self._gather_buffers_of(root)

    def _gather_buffers_of(self, root: nn.Module) -> None:
        per_replica = [dict(r.named_buffers()) for r in self._module_links[id(root)].replicas]
        for name, buffer in root.named_buffers():
            if buffer.is_floating_point():
                buffer.copy_(self.cross_device_ops.reduce(ReduceOp.MEAN, [b[name] for b in per_replica], buffer.device))
            else:
                buffer.copy_(per_replica[0][name])

    def __repr__(self) -> str:
        return (
            f"CentralStorageStrategy(compute_devices={list(self.device_names)}, "
            f"parameter_device={self.parameter_device_name!r})"
        )


class _CentralOptimizer:
    """``optimizer.step()`` under CentralStorageStrategy: one step on the central parameters."""

    def __init__(self, strategy: CentralStorageStrategy, optimizer: torch.optim.Optimizer):
        self.strategy = strategy
        self.optimizer = optimizer
        self.base = _capture.base_class(optimizer)
        self.params = _flat_params(optimizer)
        self.replica_params = [
            [strategy._param_replicas[id(p)][r] for p in self.params] for r in range(strategy.num_replicas_in_sync)
        ]

    def step(self, closure: Callable[[], Any] | None) -> Any:
        replica = self.strategy._replica_id("optimizer.step()")
        if closure is not None:
            raise ValueError(
                "optimizer.step(closure) is not supported under CentralStorageStrategy: compute the loss "
                "and call backward() before optimizer.step()"
            )
        self.strategy._merge(replica, [p.grad for p in self.replica_params[replica]], self._update)
        return None

    def _update(self, grads: list[list[torch.Tensor | None]]) -> list[None]:
        """Runs once, while every replica waits at the step."""
        ops = self.strategy.cross_device_ops
        for i, param in enumerate(self.params):
            column = [g[i] for g in grads]
            present = [g for g in column if g is not None]
            param.grad = ops.reduce(ReduceOp.SUM, present, param.device) if present else None
        self.base.step(self.optimizer)
        self.strategy._refresh(self.params)
        self.strategy._gather_buffers()
        return [None] * len(grads)

    def zero_grad(self, set_to_none: bool) -> None:
        context = get_replica_context()
        if context is not None and context.strategy is self.strategy:
            _zero(self.replica_params[context.replica_id_in_sync_group], set_to_none)
            return
        self.base.zero_grad(self.optimizer, set_to_none)
        for params in self.replica_params:
            _zero(params, set_to_none)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.base.load_state_dict(self.optimizer, state_dict)

    def pickled_as(self) -> None:
        return None  # a pickled (or deep-copied) optimizer is a plain one of the user's class


def _zero(params: Iterable[nn.Parameter], set_to_none: bool) -> None:
    for param in params:
        if param.grad is None:
            continue
        if set_to_none:
            param.grad = None
        else:
            param.grad.detach_()
            param.grad.zero_()


# ------------------------------------------------------------------ process-wide guards


def _replicated_strategy() -> _ReplicatedStrategy | None:
    if running_strategy() is None:  # the common case, every module call of the process: stay cheap
        return None
    context = get_replica_context()
    if context is None or not isinstance(context.strategy, _ReplicatedStrategy):
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
