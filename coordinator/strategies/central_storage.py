"""CentralStorageStrategy: each parameter stored once, the computation replicated.

CentralStorageStrategy keeps each parameter once, on the parameter device (the
user's module); every compute device runs a replica copy refreshed from it at
each run and after each step. At ``optimizer.step()`` the replicas' gradients
are summed into the central parameters and one optimizer step is taken.

It runs its replicas as MirroredStrategy does (both build on ``replicated``) and is apart
from ``mirrored`` because where the variables live and what a step does differ: here one
optimizer (``_CentralOptimizer``) steps the central parameters, there every replica's copy
of the optimizer steps its own.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from paramserve.coordinator.strategies import _capture
from paramserve.coordinator.strategies.base import ReduceOp, get_replica_context
from paramserve.coordinator.strategies.cross_device_ops import CrossDeviceOps, ReductionToOneDevice
from paramserve.coordinator.strategies.replicated import (
    ReplicatedStrategy,
    flat_params,
    local_devices,
    resolve_devices,
)
from paramserve.psserver.runtime.devices import cuda_device_count, resolve_device


def default_parameter_device(compute_devices: Sequence[str], cuda_devices: int) -> str:
    """TensorFlow's choice of the parameter device when none is given: on a machine with exactly
    one GPU, the first compute device (the variables stay where the computation is); else the
    CPU, which every compute device reaches alike."""
    return compute_devices[0] if cuda_devices == 1 else "cpu"


class CentralStorageStrategy(ReplicatedStrategy):
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
            gives two CPU replicas. TensorFlow's names ("/gpu:0") work too.
        parameter_device: where the variables live; default as TensorFlow chooses: the GPU when
            the machine has exactly one (the first compute device), else the CPU.
        cross_device_ops: how gradients are summed onto the parameter device.
    """

    def __init__(
        self,
        compute_devices: Sequence[str | torch.device] | None = None,
        parameter_device: str | torch.device | None = None,
        cross_device_ops: CrossDeviceOps | None = None,
    ):
        names, resolved = resolve_devices(
            compute_devices if compute_devices is not None else local_devices(), "compute_devices"
        )
        if parameter_device is None:
            parameter_device = default_parameter_device(names, cuda_device_count())
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

    def parameter_devices(self) -> tuple[str, ...]:
        return (self.parameter_device_name,)

    def variable_copies(self, var: Any) -> tuple[Any, ...]:
        """A parameter is stored once, centrally: an update changes that one (and ``after_update``
        refreshes the replicas' copies from it)."""
        if isinstance(var, nn.Parameter) and id(var) in self._param_replicas:
            return (var,)
        return super().variable_copies(var)

    def after_update(self, var: Any) -> None:
        if isinstance(var, nn.Parameter) and id(var) in self._param_replicas:
            self._refresh([var])

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
        self._map_replicas()

    def _map_replicas(self) -> None:
        """Each central parameter the optimizer steps, and its copy on each replica."""
        self.params = flat_params(self.optimizer)
        self.replica_params = [
            [self.strategy.replica_copies(p)[r] for p in self.params] for r in range(self.strategy.num_replicas_in_sync)
        ]

    def step(self, closure: Callable[[], Any] | None) -> Any:
        replica = self.strategy.calling_replica("optimizer.step()")
        if closure is not None:
            raise ValueError(
                "optimizer.step(closure) is not supported under CentralStorageStrategy: compute the loss "
                "and call backward() before optimizer.step()"
            )
        self.strategy.exchange(replica, [p.grad for p in self.replica_params[replica]], self._update)
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

    def state_dict(self) -> dict[str, Any]:
        return self.base.state_dict(self.optimizer)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """On the central optimizer; its parameters' replica gradients are gathered from then on."""
        self.strategy.add_param_group_in_place(self.optimizer, param_group)
        self._map_replicas()

    def pickled_as(self) -> None:
        return None  # a pickled (or deep-copied) optimizer is a plain one of the user's class


def _zero(params: Iterable[torch.Tensor], set_to_none: bool) -> None:
    for param in params:
        if param.grad is None:
            continue
        if set_to_none:
            param.grad = None
        else:
            param.grad.detach_()
            param.grad.zero_()
