"""In-process strategies: OneDeviceStrategy and MirroredStrategy.

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

CentralStorageStrategy (``central_storage``) runs its replicas the same way; what it and
MirroredStrategy share is ``replicated``'s ``ReplicatedStrategy``. How the replicas' gradients
are summed at a step is MirroredStrategy's alone, so it is here.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from paramserve.coordinator import nest
from paramserve.coordinator.strategies import _capture
from paramserve.coordinator.strategies.base import (
    InputContext,
    ReduceOp,
    Strategy,
    detached,
    get_replica_context,
)
from paramserve.coordinator.strategies.cross_device_ops import (
    CrossDeviceOps,
    HierarchicalCopyAllReduce,
    ReductionToOneDevice,
)
from paramserve.coordinator.strategies.distributed_values import DistributedValue
from paramserve.coordinator.strategies.input import (
    DistributedDataset,
    DistributedDatasetsFromFunction,
    InputOptions,
)
from paramserve.coordinator.strategies.replicated import (
    ReplicatedStrategy,
    flat_params,
    local_devices,
    reduce_plain,
    resolve_devices,
)
from paramserve.psserver.runtime.devices import computing_on, resolve_device

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
        return detached(nest.map_structure(lambda v: reduce_plain(op, _single(v), axis), value))

    def experimental_distribute_dataset(
        self, dataset: Iterable[Any], options: InputOptions | None = None
    ) -> DistributedDataset:
        return DistributedDataset(dataset, [self.device], options=options)

    def distribute_datasets_from_function(
        self, dataset_fn: Callable[[InputContext], Iterable[Any]], options: InputOptions | None = None
    ) -> DistributedDatasetsFromFunction:
        return DistributedDatasetsFromFunction(dataset_fn, [InputContext()], [self.device], options)

    def worker_devices(self) -> tuple[str, ...]:
        return (self.device_name,)

    def __repr__(self) -> str:
        return f"OneDeviceStrategy({self.device_name!r})"


def _single(value: Any) -> Any:
    return value.values[0] if isinstance(value, DistributedValue) and len(value.values) == 1 else value


# ------------------------------------------------------------------ MirroredStrategy


class MirroredStrategy(ReplicatedStrategy):
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
        names, resolved = resolve_devices(devices if devices is not None else local_devices(), "devices")
        super().__init__(names, resolved, cross_device_ops)
        self._cpu_only = all(d.type == "cpu" for d in resolved)

    def _adopt_module(self, root: nn.Module) -> None:
        root.to(self._devices[0])
        copies = [copy.deepcopy(root).to(device) for device in self._devices[1:]]
        self._link_tree(root, [root, *copies])

    def _adopt_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        replicas = [optimizer]
        for r in range(1, self.num_replicas_in_sync):
            memo: dict[int, Any] = {id(p): self._param_replicas[id(p)][r] for p in flat_params(optimizer)}
            replica = copy.deepcopy(optimizer, memo)
            _move_state(replica, optimizer)
            replicas.append(replica)
        self._known_optimizers.update(id(o) for o in replicas)
        self._optimizers.append(optimizer)
        _capture.link_optimizer(optimizer, _MirroredOptimizer(self, optimizer, replicas))

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


_LOCAL_SUM_OPS = (CrossDeviceOps, ReductionToOneDevice, HierarchicalCopyAllReduce)
"""Cross-device ops whose all-reduce of CPU tensors is a plain sum in replica order."""


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
    for p_copy, p_orig in zip(flat_params(replica), flat_params(original)):
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
        replica = self.strategy.calling_replica("optimizer.step()")
        if closure is not None:
            raise ValueError(
                "optimizer.step(closure) is not supported under MirroredStrategy: compute the loss and "
                "call backward() before optimizer.step()"
            )
        params = flat_params(self.replicas[replica])
        if self.strategy._sums_locally():
            # All replicas on the host CPU: the merge only shares the gradients; then each
            # replica, in parallel, adds them up (in replica order, as the cross-device ops
            # would) into new tensors of its own: no serial sum, no copies back.
            every = self.strategy.exchange(replica, [p.grad for p in params], self._share)
            grads = _sum_columns(every, replica, self.strategy.replica_devices)
        else:
            grads = self.strategy.exchange(replica, [p.grad for p in params], self._combine)
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

    def state_dict(self) -> dict[str, Any]:
        return self.base.state_dict(self.optimizer)  # replica 0's: the user's optimizer is replica 0

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """On every replica's optimizer, each with its own copies of the group's parameters."""
        group = self.strategy.add_param_group_in_place(self.optimizer, param_group)
        for r, replica in enumerate(self.replicas[1:], start=1):
            params = [self.strategy.replica_copies(p)[r] for p in group["params"]]
            self.base.add_param_group(replica, {**group, "params": params})

    def pickled_as(self) -> None:
        return None  # a pickled (or deep-copied) optimizer is a plain one of the user's class
