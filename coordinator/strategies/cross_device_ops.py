"""How per-replica tensors are combined across local devices (tf.distribute.CrossDeviceOps).

Every implementation gives the same numbers; they differ in how tensors move:
- ``ReductionToOneDevice``: copy everything to one device, add there, copy back.
  Works on any device mix, including CPU-only; the default there.
- ``HierarchicalCopyAllReduce``: on several GPUs, add within halves of the
  GPU set first, then across the halves (fewer transfers through one GPU).
- ``NcclAllReduce``: ``torch.cuda.nccl`` all-reduce; needs two or more GPUs.

Results are always new tensors, one per destination, so replicas that later
modify their copy in place never alias each other. ``num_packs`` (HierarchicalCopyAllReduce,
NcclAllReduce, as in TensorFlow) packs the values of one ``batch_all_reduce`` into that many
flat tensors per replica: fewer, larger transfers, the same sums.

Destinations are torch devices or device names; names, TensorFlow's ('/gpu:1',
'/job:worker/replica:0/task:0/device:CPU:0') included, go through ``as_device``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from paramserve.coordinator.strategies.base import ReduceOp
from paramserve.coordinator.strategies.distributed_values import DistributedValue, Mirrored
from paramserve.psserver.runtime.devices import resolve_device

Destinations = torch.device | str | Sequence[torch.device | str]


class CrossDeviceOps:
    """Base: reduce and broadcast tensors held one per replica. Subclasses override
    ``_sum_to_all`` (and may override ``all_reduce``) to change how data moves."""

    num_packs: int = 0
    """How many flat tensors ``batch_all_reduce`` packs its values into per replica (0: none)."""

    def reduce(self, reduce_op: ReduceOp | str, per_replica_value: Any, destinations: Destinations) -> Any:
        """Reduces the components of ``per_replica_value`` (a PerReplica/Mirrored or a sequence
        of tensors). Returns a tensor on ``destinations`` when it is one device, else a Mirrored
        with one copy per destination device."""
        tensors = _components(per_replica_value)
        targets = _destination_list(destinations)
        total = self._sum_to_one(tensors, targets[0])
        result = _finish(ReduceOp(reduce_op), total, len(tensors))
        if _is_single(destinations):
            return result
        return self.broadcast(result, targets)

    def batch_reduce(
        self, reduce_op: ReduceOp | str, value_destination_pairs: Sequence[tuple[Any, Destinations]]
    ) -> list[Any]:
        """``reduce`` for several values at once (implementations may fuse them)."""
        return [self.reduce(reduce_op, value, destinations) for value, destinations in value_destination_pairs]

    def broadcast(self, tensor: torch.Tensor, destinations: Destinations) -> Any:
        """Copies ``tensor`` to each destination device: a Mirrored (a tensor for one device)."""
        if _is_single(destinations):
            return tensor.to(_destination_list(destinations)[0], copy=True)
        return Mirrored([tensor.to(device, copy=True) for device in _destination_list(destinations)])

    def all_reduce(self, reduce_op: ReduceOp | str, per_replica_value: Any) -> Mirrored:
        """Reduces the components and gives each replica the result on its own component's device."""
        tensors = _components(per_replica_value)
        devices = [t.device for t in tensors]
        totals = self._sum_to_all(tensors)
        op = ReduceOp(reduce_op)
        return Mirrored([_finish(op, total, len(tensors)).to(device) for total, device in zip(totals, devices)])

    def batch_all_reduce(self, reduce_op: ReduceOp | str, per_replica_values: Sequence[Any]) -> list[Mirrored]:
        """``all_reduce`` of several values (e.g. every gradient of a step). With ``num_packs``,
        dense values of one dtype (on the same devices) travel packed: per replica concatenated
        into one flat tensor split in ``num_packs`` chunks, each all-reduced; each result is then
        a view of its replica's reduced flat tensor."""
        if self.num_packs == 0 or len(per_replica_values) < 2:
            return [self.all_reduce(reduce_op, value) for value in per_replica_values]
        columns = [_components(value) for value in per_replica_values]
        results: list[Mirrored | None] = [None] * len(columns)
        for group in _pack_groups(columns):
            packed = [columns[i] for i in group]
            reduced = (
                self._packed_all_reduce(reduce_op, packed)
                if len(group) > 1
                else [self.all_reduce(reduce_op, packed[0])]
            )
            for i, mirrored in zip(group, reduced):
                results[i] = mirrored
        return [r if r is not None else self.all_reduce(reduce_op, c) for r, c in zip(results, columns)]

    def _packed_all_reduce(self, reduce_op: ReduceOp | str, columns: list[list[torch.Tensor]]) -> list[Mirrored]:
        replicas = len(columns[0])
        flats = [torch.cat([column[r].reshape(-1) for column in columns]) for r in range(replicas)]
        packs = max(1, min(self.num_packs, flats[0].numel()))
        chunks = [torch.tensor_split(flat, packs) for flat in flats]
        reduced = [self.all_reduce(reduce_op, [chunks[r][p] for r in range(replicas)]) for p in range(packs)]
        wholes = [torch.cat([m.values[r] for m in reduced]) for r in range(replicas)]
        sizes = [column[0].numel() for column in columns]
        pieces = [torch.split(whole, sizes) for whole in wholes]
        return [
            Mirrored([pieces[r][i].view(column[r].shape) for r in range(replicas)]) for i, column in enumerate(columns)
        ]

    # ------------------------------------------------------------------ data movement

    def _sum_to_one(self, tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
        """The sum of ``tensors`` as a new tensor on ``device``, added in replica order."""
        total = tensors[0].to(device, copy=True)
        for tensor in tensors[1:]:
            total.add_(tensor.to(device))
        return total

    def _sum_to_all(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The sum, as one new tensor on each input's device."""
        total = self._sum_to_one(tensors, tensors[0].device)
        return [total.to(t.device, copy=True) for t in tensors]

    def __repr__(self) -> str:
        packs = f"num_packs={self.num_packs}" if self.num_packs else ""
        return f"{type(self).__name__}({packs})"


class ReductionToOneDevice(CrossDeviceOps):
    """Copies every component to one device, reduces there, copies the result back.

    Args:
        reduce_to_device: where the sum is computed; default the first destination
            (for an all-reduce: replica 0's device).
    """

    def __init__(self, reduce_to_device: torch.device | str | None = None):
        self.reduce_to_device = as_device(reduce_to_device) if reduce_to_device is not None else None

    def _sum_to_one(self, tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
        where = self.reduce_to_device or device
        return super()._sum_to_one(tensors, where).to(device)

    def _sum_to_all(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        total = self._sum_to_one(tensors, self.reduce_to_device or tensors[0].device)
        return [total.to(t.device, copy=True) for t in tensors]

    def __repr__(self) -> str:
        return f"ReductionToOneDevice(reduce_to_device={self.reduce_to_device})"


class HierarchicalCopyAllReduce(CrossDeviceOps):
    """On two or more GPUs: sums within each half of the GPUs, then across the halves'
    leaders, then copies back down. Elsewhere (CPU, one GPU) it is ReductionToOneDevice.

    Args:
        num_packs: how many flat tensors a ``batch_all_reduce`` packs its values into (0: no
            packing; default 1, as in TensorFlow).

    Raises:
        ValueError: ``num_packs`` is not a non-negative integer.
    """

    def __init__(self, num_packs: int = 1):
        self.num_packs = _checked_num_packs(num_packs)

    def _sum_to_all(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if len({t.device for t in tensors if t.is_cuda}) < 2 or not all(t.is_cuda for t in tensors):
            return super()._sum_to_all(tensors)
        half = (len(tensors) + 1) // 2
        groups = [list(range(half)), list(range(half, len(tensors)))]
        groups = [g for g in groups if g]
        leaders = [tensors[g[0]].device for g in groups]
        partials = [self._sum_to_one([tensors[i] for i in g], leader) for g, leader in zip(groups, leaders)]
        total = partials[0]
        for partial in partials[1:]:
            total.add_(partial.to(total.device))
        results: list[torch.Tensor] = [torch.empty(0)] * len(tensors)
        for group, leader in zip(groups, leaders):
            at_leader = total.to(leader, copy=True)  # one copy per half, then fan out inside it
            for i in group:
                results[i] = at_leader if i == group[0] else at_leader.to(tensors[i].device, copy=True)
        return results


class NcclAllReduce(CrossDeviceOps):
    """All-reduce with NVIDIA NCCL (``torch.cuda.nccl``) across two or more local GPUs.

    Args:
        num_packs: how many flat tensors a ``batch_all_reduce`` packs its values into, so that
            one NCCL call carries many gradients (0: one call per value; default 1, as in TensorFlow).

    Raises:
        ValueError: ``num_packs`` is not a non-negative integer.
        RuntimeError: at construction when fewer than two CUDA devices exist.
    """

    def __init__(self, num_packs: int = 1) -> None:
        self.num_packs = _checked_num_packs(num_packs)
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count < 2:
            raise RuntimeError(
                f"NcclAllReduce needs at least two CUDA GPUs and this machine has {count}: use "
                "cross_device_ops=ReductionToOneDevice() (it works on CPU and on any number of GPUs)"
            )

    def _sum_to_all(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        devices = [t.device for t in tensors]
        if not all(t.is_cuda for t in tensors) or len(set(devices)) != len(devices):
            raise ValueError(
                f"NcclAllReduce reduces one tensor per distinct GPU, got tensors on {[str(d) for d in devices]}: "
                "use ReductionToOneDevice for CPU replicas or several replicas per device"
            )
        from torch.cuda import nccl

        outputs = [t.detach().clone().contiguous() for t in tensors]
        nccl.all_reduce(outputs)
        return outputs

    def broadcast(self, tensor: torch.Tensor, destinations: Destinations) -> Any:
        targets = _destination_list(destinations)
        if _is_single(destinations) or not all(d.type == "cuda" for d in targets) or len(set(targets)) != len(targets):
            return super().broadcast(tensor, destinations)
        from torch.cuda import nccl

        copies = [tensor.to(targets[0], copy=True).contiguous()] + [
            torch.empty_like(tensor, device=d) for d in targets[1:]
        ]
        nccl.broadcast(copies, root=0)
        return Mirrored(copies)


# ------------------------------------------------------------------ helpers


def as_device(spec: torch.device | str) -> torch.device:
    """The torch device a destination names. A name goes through ``psserver.devices.resolve_device``,
    the one parser of device names ("cpu", "cuda:1", and TensorFlow's "/gpu:1", "/device:GPU:0",
    "/job:worker/replica:0/task:0/device:CPU:0"); a torch.device is itself.

    Raises:
        ValueError: not a device name, or a GPU this machine does not have.
    """
    return spec if isinstance(spec, torch.device) else resolve_device(spec)[1]


def _checked_num_packs(num_packs: int) -> int:
    if isinstance(num_packs, bool) or not isinstance(num_packs, int) or num_packs < 0:
        raise ValueError(f"num_packs must be a non-negative integer (0: no packing), got {num_packs!r}")
    return num_packs


def _pack_groups(columns: list[list[torch.Tensor]]) -> list[list[int]]:
    """Which values may share a pack: dense ones whose dtype and device agree, replica by replica."""
    groups: dict[tuple[tuple[torch.dtype, torch.device], ...], list[int]] = {}
    for i, column in enumerate(columns):
        if all(t.layout is torch.strided for t in column):
            groups.setdefault(tuple((t.dtype, t.device) for t in column), []).append(i)
    return list(groups.values())


def _components(value: Any) -> list[torch.Tensor]:
    """The tensors of a per-replica value, checked to be reducible together."""
    tensors = list(value.values) if isinstance(value, DistributedValue) else list(value)
    if not tensors:
        raise ValueError("nothing to reduce: pass one tensor per replica")
    tensors = [torch.as_tensor(t) for t in tensors]
    shapes = {tuple(t.shape) for t in tensors}
    if len(shapes) > 1:
        raise ValueError(
            f"per-replica tensors have different shapes {sorted(shapes)} and cannot be added: "
            "reduce each along its batch dimension first (strategy.reduce(op, value, axis=0))"
        )
    return tensors


def _finish(op: ReduceOp, total: torch.Tensor, count: int) -> torch.Tensor:
    """MEAN divides exactly, integers included (1 and 98 average to 49.5, as in TensorFlow and
    as MultiWorkerMirroredStrategy's all-reduce computes): an integer mean is a float."""
    if op is ReduceOp.SUM:
        return total
    return total / count


def _is_single(destinations: Destinations) -> bool:
    return isinstance(destinations, (torch.device, str))


def _destination_list(destinations: Destinations) -> list[torch.device]:
    if _is_single(destinations):
        return [as_device(destinations)]  # type: ignore[arg-type]
    targets = [as_device(d) for d in destinations]  # type: ignore[union-attr]
    if not targets:
        raise ValueError("no destination devices given: pass a device or a non-empty list of devices")
    return targets
