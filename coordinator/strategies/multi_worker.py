"""MultiWorkerMirroredStrategy: synchronous data-parallel training across processes.

Every process (a *worker*, in tf.distribute's words) holds one replica of the
model; ``num_replicas_in_sync`` is the number of processes. The engine is
``torch.distributed``: this module decides *what* to communicate (the initial
parameters, the gradients, reduced values) and leaves every collective to it.

One training step, on every process at once::

    with strategy.scope():              # modules built here are mirrored:
        model = MLP()                   # at scope exit rank 0's parameters and
        optimizer = SGD(model.parameters(), lr=0.1)   # buffers are broadcast

    for x, y in strategy.experimental_distribute_dataset(loader):  # rank's slice
        def step(x, y):
            loss = compute_average_loss(per_example_loss(model(x), y), global_batch_size=128)
            loss.backward()
            optimizer.step()            # gradients are all-reduced (SUM) first
            return loss
        loss = strategy.reduce("SUM", strategy.run(step, (x, y)))

Gradients are *summed* across processes: each replica's loss is already divided
by the GLOBAL batch size (``compute_average_loss``), so the sum of the replicas'
gradients is the gradient of the mean loss over the global batch, the same as
one process training on the whole batch.

Which optimizers all-reduce: every ``torch.optim`` optimizer whose parameters
include mirrored ones (parameters of modules built in ``scope()``), wherever the
optimizer was built; a global optimizer step pre-hook does it, so user code
keeps calling ``optimizer.step()``. Gradients are bucketed into one flat tensor
per dtype (up to ``BUCKET_BYTES``) and reduced when ``step()`` is called, after
backward: unlike DistributedDataParallel nothing overlaps backward, and in
exchange gradient accumulation over several backward passes needs no
``no_sync()``.

Where the cluster comes from and how the processes communicate: ``multi_worker_cluster``
(``Rendezvous``, from a ``ClusterResolver`` or the environment; ``CommunicationOptions``). A
process group that already exists is
adopted with ``MultiWorkerMirroredStrategy.from_process_group()``.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import logging
import socket
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import optimizer as optimizer_hooks

from paramserve.coordinator import nest
from paramserve.coordinator.cluster import ClusterSpecError
from paramserve.coordinator.cluster_resolver import ClusterResolver
from paramserve.coordinator.strategies._capture import recording_modules
from paramserve.coordinator.strategies.base import (
    InputContext,
    ReduceOp,
    ReplicaContext,
    Strategy,
)
from paramserve.coordinator.strategies.distributed_values import DistributedValue
from paramserve.coordinator.strategies.input import InputOptions, check_per_worker, prefetch_depth, split_batch
from paramserve.coordinator.strategies.iterators import DistributedIterator
from paramserve.coordinator.strategies.multi_worker_cluster import (
    CollectiveCommunication,
    CommunicationOptions,
    Rendezvous,
    chosen_backend,
    process_group_backend,
    strategy_arguments,
)
from paramserve.psserver.runtime.devices import computing_on, cuda_device_count

if TYPE_CHECKING:
    from paramserve.coordinator.strategies.metric_states import LocalMetricState

__all__ = ["MultiWorkerMirroredStrategy"]

log = logging.getLogger(__name__)

BUCKET_BYTES = 64 << 20
"""Largest flat tensor built for one broadcast or all-reduce: bounds the extra memory of bucketing."""


# --------------------------------------------------------------------------- the strategy


class MultiWorkerMirroredStrategy(Strategy):
    """Synchronous data-parallel training, one replica per process, over torch.distributed.

    Args, in TensorFlow's order (paramserve's earlier order, communication options first, is
    accepted too: they are told apart by type):
        cluster_resolver: the cluster and this process's task, a ``ClusterResolver`` (e.g.
            ``TFConfigClusterResolver()``; ``strategy.cluster_resolver`` returns it), or a
            ``Rendezvous`` (rank, size, meeting point); default ``Rendezvous.from_env(environ)``
            (TF_CONFIG, else torchrun's variables, else one process alone).
        communication_options: the collective implementation and timeout; default AUTO.
        environ: the environment read when ``cluster_resolver`` is None; default ``os.environ``.
        communication: TF's experimental form, an implementation (``CollectiveCommunication``).

    Construction joins the group (it blocks until every process has joined or the
    timeout expires). The processes first tell each other which GPU each would drive
    (``LOCAL_RANK``'s, where the machine has that many), then all pick the same backend:
    NCCL when every process has a GPU of its own, else gloo (``select_backend``). So two
    processes on a one-GPU machine train with gloo instead of failing in NCCL. Under NCCL
    the replica's device (``self.device``) is the process's GPU, under gloo the CPU: modules
    built in ``scope()`` are placed there and ``run`` moves plain-tensor arguments there.

    Raises ``CommunicationOptionsError`` (NCCL without GPUs, before any connection; NCCL
    for processes that share a GPU, once they have met, on every process alike),
    ``ClusterSpecError`` (malformed TF_CONFIG or torchrun environment, a resolver without
    a task, task not in the cluster), ``TypeError`` for a cluster_resolver of another type,
    ``RuntimeError`` if a default process group already exists (use ``from_process_group``).
    """

    def __init__(
        self,
        cluster_resolver: ClusterResolver | Rendezvous | CommunicationOptions | None = None,
        communication_options: CommunicationOptions | ClusterResolver | Rendezvous | None = None,
        *,
        environ: Mapping[str, str] | None = None,
        communication: CollectiveCommunication | str | None = None,
    ):
        cluster, options = strategy_arguments(cluster_resolver, communication_options, communication)
        options.backend()  # what this process alone can tell (NCCL without GPUs) fails before connecting
        resolver = Rendezvous.resolve(cluster, environ)
        if dist.is_initialized():
            raise RuntimeError(
                "a torch.distributed process group is already initialised in this process: "
                "adopt it with MultiWorkerMirroredStrategy.from_process_group()"
            )
        _import_dynamo_before_the_group()
        store = _meeting_store(resolver, options.timeout())
        gpu = _own_gpu(resolver.local_rank)
        backend = options.backend(_exchange_gpus(store, resolver.rank, resolver.world_size, _gpu_identity(gpu)))
        if backend == "nccl" and gpu is not None:
            torch.cuda.set_device(gpu)
        log.info(
            "joining a group of %d (cluster from %s) as rank %d with %s",
            resolver.world_size,
            resolver.source,
            resolver.rank,
            backend,
        )
        dist.init_process_group(
            process_group_backend(backend),
            store=store,
            rank=resolver.rank,
            world_size=resolver.world_size,
            timeout=options.timeout(),
        )
        self._setup(options, resolver, backend, _world(), owns_group=True)
        if isinstance(cluster, ClusterResolver):
            self.cluster_resolver = cluster
        self._store: dist.Store | None = store

    @classmethod
    def from_process_group(
        cls, group: dist.ProcessGroup | None = None, communication_options: CommunicationOptions | None = None
    ) -> MultiWorkerMirroredStrategy:
        """A strategy over a process group the caller already initialised (default: the world group).

        The caller keeps ownership: ``shutdown()`` does not destroy it. The
        implementation in ``communication_options`` is ignored; the group's own
        backend is used. Raises ``RuntimeError`` if torch.distributed is not initialised.
        Import ``torch._dynamo`` before initialising the group, or its threads outlive
        ``destroy_process_group()`` (see ``_import_dynamo_before_the_group``).
        """
        if not dist.is_initialized():
            raise RuntimeError(
                "MultiWorkerMirroredStrategy.from_process_group(): torch.distributed is not initialised: "
                "call dist.init_process_group() first, or construct MultiWorkerMirroredStrategy() directly"
            )
        group = _world() if group is None else group
        backend = chosen_backend(str(dist.get_backend(group)))
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        local_rank = torch.cuda.current_device() if backend == "nccl" else 0
        resolver = Rendezvous(rank, world_size, None, None, local_rank, source="existing process group")
        strategy = cls.__new__(cls)
        strategy._setup(communication_options or CommunicationOptions(), resolver, backend, group, owns_group=False)
        strategy._store = None
        return strategy

    def _setup(
        self,
        options: CommunicationOptions,
        resolver: Rendezvous,
        backend: str,
        group: dist.ProcessGroup,
        owns_group: bool,
    ) -> None:
        self.communication_options = options
        self.rendezvous = resolver
        self.cluster_resolver = resolver.cluster_resolver()
        self.backend = backend
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self._group: dist.ProcessGroup | None = group
        self._owns_group = owns_group
        self._metric_states: weakref.WeakSet[LocalMetricState] = weakref.WeakSet()
        self._src = dist.get_global_rank(group, 0) if group is not dist.group.WORLD else 0
        self._rank = dist.get_rank(group)
        self._world_size = dist.get_world_size(group)
        self._mirrored: dict[int, weakref.ReferenceType[torch.Tensor]] = {}
        self._scope_depth = 0
        self._step_hook: torch.utils.hooks.RemovableHandle | None = optimizer_hooks.register_optimizer_step_pre_hook(
            self._before_optimizer_step
        )
        log.info(
            "MultiWorkerMirroredStrategy: rank %d of %d (cluster from %s), backend %s, meeting at %s",
            self._rank,
            self._world_size,
            resolver.source,
            backend,
            resolver.init_method() or "in memory",
        )

    # ------------------------------------------------------------------ properties

    @property
    def num_replicas_in_sync(self) -> int:
        """The number of processes: each process holds exactly one replica."""
        return self._world_size

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def is_chief(self) -> bool:
        return self._rank == 0

    # ------------------------------------------------------------------ scope: mirror new modules

    @contextlib.contextmanager
    def _scope_hooks(self) -> Iterator[None]:
        outermost = self._scope_depth == 0  # an inner scope leaves the broadcast to the outermost one
        self._scope_depth += 1
        try:
            with recording_modules(place_on=self.device) if outermost else contextlib.nullcontext() as record:
                yield
        finally:
            self._scope_depth -= 1
        # Reached only when the scope body succeeded: on an error no process broadcasts.
        if record is not None:
            self._mirror(record.roots())

    def _mirror(self, roots: Sequence[nn.Module]) -> None:
        """Gives every process rank 0's parameters and buffers of ``roots`` (one broadcast per dtype)."""
        tensors: dict[int, torch.Tensor] = {}  # by id: a tensor shared by two modules is sent once
        for root in roots:
            for name, tensor in [*root.named_parameters(), *root.named_buffers()]:
                if nn.parameter.is_lazy(tensor):
                    raise ValueError(
                        f"{type(root).__name__}.{name} is lazy (uninitialised): processes would initialise it "
                        "differently; run one forward pass inside strategy.scope() to materialise it"
                    )
                if not self._is_mirrored(tensor):
                    tensors.setdefault(id(tensor), tensor)
        for bucket in _buckets(list(tensors.values())):
            self._broadcast(bucket)
        for key, tensor in tensors.items():
            self._mirrored[key] = weakref.ref(tensor, self._forgetter(key))
        self._claim_models(roots)
        log.info("mirrored %d tensors of %d modules from rank 0", len(tensors), len(roots))

    def _forgetter(self, key: int) -> Callable[[Any], None]:
        """Drops ``key`` from the mirrored tensors when its tensor is garbage-collected."""

        def forget(_: Any) -> None:
            self._mirrored.pop(key, None)

        return forget

    def _broadcast(self, tensors: Sequence[torch.Tensor]) -> None:
        wire_dtype = torch.uint8 if tensors[0].dtype is torch.bool else tensors[0].dtype  # gloo has no bool
        flat = torch.cat([t.detach().reshape(-1).to(self.device, wire_dtype) for t in tensors])
        dist.broadcast(flat, src=self._src, group=self._live_group)
        with torch.no_grad():
            for tensor, part in zip(tensors, _split_like(flat, tensors)):
                tensor.copy_(part)

    def _is_mirrored(self, tensor: torch.Tensor) -> bool:
        ref = self._mirrored.get(id(tensor))
        return ref is not None and ref() is tensor

    # ------------------------------------------------------------------ gradients

    def _before_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Every optimizer over mirrored parameters all-reduces their gradients before it steps."""
        params = {
            id(param): param
            for group in optimizer.param_groups
            for param in group["params"]
            if param.requires_grad and self._is_mirrored(param)
        }
        if params and self._world_size > 1:  # alone, the local gradient is already the sum
            self.all_reduce_gradients(params.values())

    def all_reduce_gradients(self, params: Iterable[torch.Tensor]) -> None:
        """Replaces each ``param.grad`` by the SUM over processes: one all-reduce per dtype
        (per ``CommunicationOptions.bytes_per_pack``, default ``BUCKET_BYTES``, of gradients of
        that dtype). The new gradients are views
        of the reduced bucket.

        A parameter without a gradient here counts as zeros; it gets the sum when
        some process had a gradient for it and stays None when none had. Every
        process must call this with the same parameters in the same order.
        Raises ``TypeError`` on sparse gradients.
        """
        pack = self.communication_options.bytes_per_pack or BUCKET_BYTES
        for bucket in _buckets(list(params), pack):
            self._all_reduce_bucket(bucket)

    def _all_reduce_bucket(self, params: Sequence[torch.Tensor]) -> None:
        for param in params:
            if param.grad is not None and param.grad.is_sparse:
                raise TypeError("MultiWorkerMirroredStrategy does not all-reduce sparse gradients: use dense ones")
        dtype = params[0].dtype
        parts = [
            (p.grad.detach() if p.grad is not None else torch.zeros_like(p)).reshape(-1).to(self.device, dtype)
            for p in params
        ]
        # One presence flag per parameter rides in the same bucket, so "had a gradient
        # somewhere" costs no second collective.
        present = torch.tensor([p.grad is not None for p in params], dtype=dtype, device=self.device)
        flat = torch.cat([*parts, present])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self._live_group)
        reduced = _split_like(flat[: -len(params)], params)
        for param, grad, flag in zip(params, reduced, flat[-len(params) :].tolist()):
            if flag > 0:  # the new gradient is a view of the bucket: no copy back
                param.grad = grad if grad.device == param.device else grad.to(param.device)

    # ------------------------------------------------------------------ running

    def worker_devices(self) -> tuple[str, ...]:
        return (str(self.device),)  # this process's replica

    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None) -> Any:
        """Runs ``fn`` once, in this process's replica context (replica id = rank); returns its result.

        Distributed values among the arguments are replaced by this process's component, and
        plain tensors moved to ``self.device``.
        """
        args = nest.to_device(tuple(_local_component(a) for a in args), self.device)
        kwargs = nest.to_device({k: _local_component(v) for k, v in (kwargs or {}).items()}, self.device)
        with self._in_replica(self._rank), computing_on(self.device):
            return fn(*args, **kwargs)

    def replica_all_reduce(self, context: ReplicaContext, reduce_op: ReduceOp, value: Any) -> Any:
        return _map_tensors(lambda t: self._all_reduce_tensor(reduce_op, t), value)

    @property
    def local_replicas(self) -> int:
        return 1  # this process's replica; the others are other processes'

    def local_index(self, replica_id: int) -> int:
        return 0

    def sum_across_processes(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._all_reduce_tensor(ReduceOp.SUM, tensor)

    @property
    def replica_devices(self) -> tuple[torch.device, ...]:
        """The device of this process's replica (SyncOnReadVariable keeps its copy there)."""
        return (self.device,)

    def _all_reduce_tensor(self, reduce_op: ReduceOp, tensor: torch.Tensor) -> torch.Tensor:
        result = tensor.detach().to(self.device, copy=True)
        dist.all_reduce(result, op=dist.ReduceOp.SUM, group=self._live_group)
        result = result.to(tensor.device)
        return result / self._world_size if reduce_op is ReduceOp.MEAN else result

    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: int | None = None) -> Any:
        """Combines every process's value into one; every process gets the result.

        ``value`` is this process's tensor (a number, or a structure of tensors; a
        distributed value's local components are summed first). With ``axis``, the
        tensors are reduced along it first; MEAN then divides by the global count
        along that axis (the mean over the global batch). Collective: every process must call it.
        """
        op = ReduceOp(reduce_op) if isinstance(reduce_op, str) else reduce_op
        local = _sum_local(self.experimental_local_results(value))
        if axis is None:
            return _map_tensors(lambda t: self._all_reduce_tensor(op, t), local)
        return _map_tensors(lambda t: self._reduce_along(op, t, axis), local)

    def _reduce_along(self, op: ReduceOp, tensor: torch.Tensor, axis: int) -> torch.Tensor:
        total = self._all_reduce_tensor(ReduceOp.SUM, tensor.sum(dim=axis))
        if op is ReduceOp.SUM:
            return total
        count = self._all_reduce_tensor(ReduceOp.SUM, torch.tensor(float(tensor.shape[axis])))
        return total / count

    # ------------------------------------------------------------------ input

    def experimental_distribute_dataset(
        self, dataset: Iterable[Any], options: InputOptions | None = None
    ) -> Iterable[Any]:
        """This process's part of every global batch of ``dataset``.

        ``dataset`` yields global batches (a ``DataLoader`` with the global batch
        size, or any iterable of tensors / nests of tensors). Every process reads
        the whole input (tf.data's AutoShardPolicy.DATA); each batch is split along
        dim 0 into ``world_size`` parts (``input.split_batch``) and rank r keeps
        part r, so the element is a plain structure, not a PerReplica. ``options``
        decides short batches (every process decides the same way) and whether
        parts move to ``self.device``. A shuffling DataLoader must shuffle the same
        way on every process (give it a ``generator`` seeded alike), or the
        processes slice different global batches. Raises ``TypeError`` for a
        map-style Dataset, which yields examples, not batches, and NotImplementedError for
        PER_REPLICA options.
        """
        check_per_worker(options, "MultiWorkerMirroredStrategy.experimental_distribute_dataset")
        if isinstance(dataset, torch.utils.data.Dataset) and not isinstance(dataset, torch.utils.data.IterableDataset):
            raise TypeError(
                f"{type(dataset).__name__} yields single examples: wrap it in "
                "DataLoader(dataset, batch_size=GLOBAL_BATCH_SIZE) so it yields global batches"
            )
        return _ShardedBatches(dataset, self._rank, self._world_size, options or InputOptions(), self.device)

    def distribute_datasets_from_function(
        self, dataset_fn: Callable[[InputContext], Iterable[Any]], options: InputOptions | None = None
    ) -> Iterable[Any]:
        """Calls ``dataset_fn`` once, with this process's InputContext (one input pipeline per
        process: ``input_pipeline_id`` = rank); it returns this replica's batches. Raises
        NotImplementedError for PER_REPLICA options (TensorFlow supports them in MirroredStrategy only)."""
        check_per_worker(options, "MultiWorkerMirroredStrategy.distribute_datasets_from_function")
        context = InputContext(
            num_input_pipelines=self._world_size,
            input_pipeline_id=self._rank,
            num_replicas_in_sync=self._world_size,
        )
        return dataset_fn(context)

    def metric_state(self, template: Any, name: str) -> Any:
        """A copy in this process; reading it gathers every process's copy over this strategy's
        group (torchmetrics' own synchronisation: a collective, every process reads it)."""
        from paramserve.coordinator.strategies.metric_states import LocalMetricState

        state = LocalMetricState(template, process_group=self._live_group)
        self._metric_states.add(state)
        return state

    # ------------------------------------------------------------------ lifecycle

    def barrier(self) -> None:
        """Waits until every process reaches this point."""
        dist.barrier(group=self._live_group)

    def close(self) -> None:
        """Stops all-reducing gradients (removes its global optimizer step pre-hook) and
        destroys the process group if this strategy created it. Idempotent."""
        self.shutdown()

    def shutdown(self) -> None:
        """The same as ``close()``.

        It also drops every reference this strategy and its metrics hold to the group, so
        that destroying the group joins gloo's worker threads now. ``destroy_process_group()``
        leaves them running for as long as a Python reference to the group lives; a group
        left to the interpreter's exit is torn down mid-finalisation, where a worker thread
        that needs the GIL aborts the process ("terminate called without an active
        exception"). Metrics read after this read their own process's copy."""
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None
        if self._owns_group and dist.is_initialized() and self._group is not None:
            _leave_together(self._store, self._group, self._rank, self._world_size)
        self._owns_group = False
        self._store = None
        for state in list(self._metric_states):
            state.leave_process_group()
        self._group = None
        gc.collect()  # a metric already dropped may still hold the group from a reference cycle
        self._release_models()

    @property
    def _live_group(self) -> dist.ProcessGroup:
        if self._group is None:
            raise RuntimeError("this MultiWorkerMirroredStrategy was shut down: create a new one to communicate again")
        return self._group

    def __repr__(self) -> str:
        return (
            f"MultiWorkerMirroredStrategy(rank={self._rank}, world_size={self._world_size}, backend={self.backend!r})"
        )


# --------------------------------------------------------------------------- helpers


def _world() -> dist.ProcessGroup:
    group = dist.group.WORLD
    if group is None:
        raise RuntimeError("torch.distributed has no world group: initialise the process group first")
    return group


def _import_dynamo_before_the_group() -> None:
    """Imports ``torch._dynamo`` now, before the process group exists.

    ``torch.optim`` imports it lazily, at the first optimizer built. In torch 2.13, an
    import of it while a process group exists keeps that group alive for good: after
    ``destroy_process_group()`` gloo's threads go on running into the interpreter's exit,
    where a process has been seen to abort ("terminate called without an active
    exception"). Imported first, it leaves the group to be destroyed, and its threads
    joined, at ``shutdown()``. The cost (about a second) is the one the first optimizer
    would have paid."""
    import torch._dynamo  # noqa: F401


def _meeting_store(resolver: Rendezvous, timeout: datetime.timedelta) -> dist.Store:
    """Where the processes meet: rank 0's TCP store at the master address (the others connect,
    retrying until ``timeout``), or an in-memory store for a group of one (no port to find or
    leak). Raises ``ClusterSpecError`` for a group of several without a master address."""
    if resolver.world_size == 1:
        return dist.HashStore()
    if resolver.master_addr is None or resolver.master_port is None:
        raise ClusterSpecError(
            f"a group of {resolver.world_size} processes needs a master address and port (from {resolver.source})"
        )
    log.info("meeting %d processes at %s as rank %d", resolver.world_size, resolver.init_method(), resolver.rank)
    return dist.TCPStore(
        resolver.master_addr, resolver.master_port, resolver.world_size, is_master=resolver.rank == 0, timeout=timeout
    )


_LEFT_KEY = "paramserve/left/{rank}"


def _leave_together(store: dist.Store | None, group: dist.ProcessGroup, rank: int, world_size: int) -> None:
    """Destroys the process group in step with the others: a barrier first (no process tears
    down gloo while a peer is still in a collective), and rank 0, whose process hosts the TCP
    store, returns only once every process has destroyed its group. A store host that exits
    first leaves a peer's gloo threads without their store, and the peer aborts
    ("terminate called without an active exception")."""
    if world_size > 1:
        dist.barrier(group=group)
    dist.destroy_process_group()
    if store is None or world_size == 1:
        return
    store.set(_LEFT_KEY.format(rank=rank), "1")
    if rank == 0:
        store.wait([_LEFT_KEY.format(rank=r) for r in range(world_size)])


def _own_gpu(local_rank: int, cuda_devices: int | None = None) -> int | None:
    """The GPU index a process of this ``local_rank`` drives: its LOCAL_RANK where the machine
    has that many GPUs, else None (no GPU of its own)."""
    count = cuda_device_count() if cuda_devices is None else cuda_devices
    return local_rank if local_rank < count else None


def _gpu_identity(index: int | None) -> str | None:
    """What tells GPUs apart across processes: the device's UUID (processes with different
    CUDA_VISIBLE_DEVICES may both call theirs cuda:0), else the host and index."""
    if index is None:
        return None
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return str(uuid) if uuid is not None else f"{socket.gethostname()}/cuda:{index}"


_GPU_KEY = "paramserve/gpu/{rank}"
_READ_KEY = "paramserve/gpu-read/{rank}"
_NO_GPU = "-"


def _exchange_gpus(store: dist.Store, rank: int, world_size: int, mine: str | None) -> list[str | None]:
    """Tells the group which GPU this process would drive and returns every process's, by rank
    (None: none), waiting for each up to the store's timeout. Rank 0, whose process hosts the
    store, returns only once every process has read the list: when they all refuse the same
    choice (NCCL on a shared GPU), none loses the store before it has decided."""
    store.set(_GPU_KEY.format(rank=rank), mine if mine is not None else _NO_GPU)
    theirs = [store.get(_GPU_KEY.format(rank=r)).decode() for r in range(world_size)]
    store.set(_READ_KEY.format(rank=rank), "1")
    if rank == 0:
        store.wait([_READ_KEY.format(rank=r) for r in range(world_size)])
    return [None if gpu == _NO_GPU else gpu for gpu in theirs]


def _buckets(tensors: Sequence[torch.Tensor], max_bytes: int = BUCKET_BYTES) -> list[list[torch.Tensor]]:
    """Tensors grouped by dtype, in order, each group cut into runs of at most ``max_bytes``
    (a single larger tensor makes a bucket of its own)."""
    runs: dict[torch.dtype, list[list[torch.Tensor]]] = {}
    filled: dict[torch.dtype, int] = {}
    for tensor in tensors:
        size = tensor.numel() * tensor.element_size()
        dtype_runs = runs.setdefault(tensor.dtype, [[]])
        if dtype_runs[-1] and filled[tensor.dtype] + size > max_bytes:
            dtype_runs.append([])
            filled[tensor.dtype] = 0
        dtype_runs[-1].append(tensor)
        filled[tensor.dtype] = filled.get(tensor.dtype, 0) + size
    return [run for dtype_runs in runs.values() for run in dtype_runs]


def _split_like(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    parts = torch.split(flat, [t.numel() for t in tensors])
    return [part.view(t.shape) for part, t in zip(parts, tensors)]


def _map_tensors(fn: Callable[[torch.Tensor], Any], value: Any) -> Any:
    """``fn`` on every tensor (or number, as a tensor) of a structure of lists, tuples and dicts."""

    def leaf(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return fn(x)
        if isinstance(x, (int, float)) and not isinstance(x, bool):
            return fn(torch.tensor(x))
        raise TypeError(f"cannot reduce a {type(x).__name__}: pass tensors, numbers, or lists/tuples/dicts of them")

    return nest.map_structure(leaf, value)


def _sum_local(components: Sequence[Any]) -> Any:
    if len(components) == 1:
        return components[0]
    total = components[0]
    for component in components[1:]:
        total = total + component
    return total


def _local_component(value: Any) -> Any:
    """This process's component of a distributed value (one replica per process); other values as they are."""
    if not isinstance(value, DistributedValue):
        return value
    components = tuple(value.values)
    if len(components) != 1:
        raise ValueError(
            f"a distributed value with {len(components)} components reached MultiWorkerMirroredStrategy.run, "
            "which holds one replica per process: pass this process's value"
        )
    return components[0]


class _ShardedBatches:
    """Re-iterable: rank's part of every global batch of ``dataset``."""

    def __init__(self, dataset: Iterable[Any], rank: int, world_size: int, options: InputOptions, device: torch.device):
        self._dataset, self._rank, self._world_size = dataset, rank, world_size
        self._options, self._device = options, device

    def __iter__(self) -> DistributedIterator:
        return DistributedIterator(self._elements(), prefetch_depth(self._options, [self._device]))

    def _elements(self) -> Iterator[Any]:
        for index, batch in enumerate(self._dataset):
            parts = split_batch(batch, self._world_size, self._options.partial_batch, index)
            if parts is None:  # a short batch dropped: every process drops it
                continue
            part = parts[self._rank]
            yield nest.to_device(part, self._device) if self._options.move_to_device else part

    def __len__(self) -> int:
        """Global batches of the dataset (counted before dropping any short batch)."""
        return len(self._dataset)  # type: ignore[arg-type]
