"""All-gather: every replica's tensors concatenated along an axis (``ReplicaContext.all_gather``,
``Strategy.gather``), and its gradient.

Two ways, one per kind of strategy: replicas in one process meet at a merge point and the last to
arrive concatenates (``concatenate_replicas``); where each process holds one replica, each puts its
tensor in its place of a zero tensor and the processes sum those (``gather_by_sum``), which needs
nothing of a strategy but its cross-process sum. ``AllGather`` gives either TensorFlow's gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from paramserve.coordinator.strategies.base import ReduceOp, ReplicaContext


def normalized_axis(tensor: torch.Tensor, axis: int, what: str) -> int:
    """``axis`` as a non-negative dimension of ``tensor`` (negative axes count from the end).

    Raises:
        ValueError: a scalar (nothing to concatenate along) or an axis ``tensor`` lacks.
    """
    if tensor.dim() == 0:
        raise ValueError(f"{what} concatenates along an axis and got a scalar: reshape it to [1] first")
    if not -tensor.dim() <= axis < tensor.dim():
        raise ValueError(f"{what}: axis {axis} is out of range for a tensor of shape {list(tensor.shape)}")
    return axis % tensor.dim()


class AllGather(torch.autograd.Function):
    """``all_gather`` with TensorFlow's gradient: the gradients of every replica's result summed
    (an all-reduce, so every replica must call ``backward``), and this replica's slice taken."""

    @staticmethod
    def forward(ctx: Any, context: ReplicaContext, axis: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.context, ctx.axis, ctx.sizes = context, axis, [t.shape[axis] for t in tensors]
        return tuple(context.strategy.replica_all_gather(context, list(tensors), axis))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        context: ReplicaContext = ctx.context
        summed = context.all_reduce(ReduceOp.SUM, list(grads))
        sizes = context.all_gather(torch.tensor([ctx.sizes]), 0)  # [replicas, tensors]: shares may differ
        starts = sizes[: context.replica_id_in_sync_group].sum(dim=0).tolist()
        sliced = [g.narrow(ctx.axis, start, size) for g, start, size in zip(summed, starts, ctx.sizes)]
        return (None, None, *sliced)


def concatenate_replicas(per_replica: list[list[torch.Tensor]], axis: int) -> list[list[torch.Tensor]]:
    """Tensor i of every replica concatenated along ``axis``, in replica order; replica r gets its
    own copy of each on the device of its own tensor i.

    Raises:
        ValueError: the replicas passed different numbers of tensors, or shapes that differ
            elsewhere than along ``axis``.
    """
    if len({len(tensors) for tensors in per_replica}) != 1:
        raise ValueError("all_gather got a different number of tensors from each replica: pass the same structure")
    out: list[list[torch.Tensor]] = [[] for _ in per_replica]
    for column in zip(*per_replica):
        _check_concatenable(column, axis)
        joined = torch.cat([t.detach().to(column[0].device) for t in column], dim=axis)
        for r, tensor in enumerate(column):
            out[r].append(joined if r == 0 else joined.to(tensor.device, copy=True))
    return out


def _check_concatenable(tensors: Sequence[torch.Tensor], axis: int) -> None:
    others = {(t.dim(), *t.shape[:axis], *t.shape[axis + 1 :]) for t in tensors}
    if len(others) > 1:
        shapes = [list(t.shape) for t in tensors]
        raise ValueError(f"all_gather along axis {axis} needs the same shape on every replica elsewhere, got {shapes}")


class ProcessSum(Protocol):
    """What ``gather_by_sum`` needs of a strategy: how many replicas there are, here and in all,
    and a tensor summed over its processes (every Strategy has them)."""

    @property
    def num_replicas_in_sync(self) -> int: ...

    @property
    def local_replicas(self) -> int: ...

    def sum_across_processes(self, tensor: torch.Tensor) -> torch.Tensor: ...


def gather_by_sum(strategy: ProcessSum, replica: int, tensors: list[torch.Tensor], axis: int) -> list[torch.Tensor]:
    """All-gather where every process holds one replica: each tensor goes in place ``replica`` of
    a zero tensor N times longer along ``axis``, and the processes sum those. Every process's
    tensors must have the same shapes (checked first when there are several processes)."""
    count = strategy.num_replicas_in_sync
    processes = count // strategy.local_replicas
    if processes > 1:
        _check_same_shapes(strategy, tensors, processes)
    return [_restored(strategy.sum_across_processes(_in_slot(t, axis, replica, count)), t.dtype) for t in tensors]


def _in_slot(tensor: torch.Tensor, axis: int, slot: int, slots: int) -> torch.Tensor:
    """Zeros ``slots`` times as long along ``axis``, with ``tensor`` at place ``slot`` (booleans as
    bytes: they are summed)."""
    work = tensor.detach().to(torch.uint8) if tensor.dtype == torch.bool else tensor.detach()
    shape = list(work.shape)
    size, shape[axis] = shape[axis], shape[axis] * slots
    full = work.new_zeros(shape)
    full.narrow(axis, slot * size, size).copy_(work)
    return full


def _restored(total: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return total.to(dtype) if total.dtype != dtype else total


def _check_same_shapes(strategy: ProcessSum, tensors: Sequence[torch.Tensor], processes: int) -> None:
    """Raises ValueError on every process alike when their shapes differ, instead of a hang or a
    garbled sum: one small all-reduce of x and x^2, x a hash of the process's shapes;
    N * sum(x^2) == sum(x)^2 only when every x is equal."""
    x = float(hash(tuple(tuple(t.shape) for t in tensors)) % 1_000_003)
    sums = strategy.sum_across_processes(torch.tensor([x, x * x], dtype=torch.float64)).tolist()
    if processes * sums[1] != sums[0] ** 2:
        raise ValueError(
            "all_gather across processes needs the same shapes on every process: pad each process's "
            "tensor to one size along the axis first"
        )
