"""Distributed values: one logical value made of one component per replica.

- ``PerReplica``: a different component on each replica (a split batch, each
  replica's loss). ``strategy.run`` gives replica ``r`` its component ``r``.
- ``Mirrored``: components known to be identical (a broadcast, an all-reduce).
- ``SyncOnReadVariable``: a variable (metric, batch-norm statistic) that each
  replica updates locally without synchronisation; reading it in
  cross-replica context aggregates the copies.

``ValueContext`` is what ``experimental_distribute_values_from_function`` tells the function
that builds each replica's value; ``regroup`` and ``select_replica`` turn one structure per
replica into one with distributed leaves and back.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from paramserve.coordinator import nest
from paramserve.coordinator.strategies.base import (
    Strategy,
    get_replica_context,
    get_strategy,
)


class DistributedValue:
    """Base of every distributed value: ``values`` holds one component per replica, in replica order."""

    def __init__(self, values: Sequence[Any]):
        if len(values) == 0:
            raise ValueError(f"{type(self).__name__} needs at least one component (one per replica)")
        self.values: tuple[Any, ...] = tuple(values)

    @property
    def num_replicas(self) -> int:
        return len(self.values)

    def __repr__(self) -> str:
        inner = ", ".join(f"{i}: {v!r}" for i, v in enumerate(self.values))
        return f"{type(self).__name__}({{{inner}}})"


DistributedValues = DistributedValue
"""TensorFlow's name (``tf.distribute.DistributedValues``)."""


class PerReplica(DistributedValue):
    """One (possibly different) component per replica."""


class Mirrored(DistributedValue):
    """Components that are identical across replicas; ``primary`` is replica 0's."""

    @property
    def primary(self) -> Any:
        return self.values[0]


class VariableAggregation(enum.Enum):
    """How the copies of a SyncOnReadVariable combine when read in cross-replica context."""

    NONE = "NONE"
    SUM = "SUM"
    MEAN = "MEAN"
    ONLY_FIRST_REPLICA = "ONLY_FIRST_REPLICA"


class SyncOnReadVariable(DistributedValue):
    """A tensor variable with one local copy per replica, aggregated when read across replicas.

    In replica context (inside ``strategy.run`` of the owning strategy) reads and
    writes touch only that replica's copy, with no synchronisation: that is why
    metrics and batch-norm statistics use it. Read in cross-replica context (or
    outside the strategy) the copies are combined by ``aggregation``, across every
    process of a multi-process strategy too (MultiWorkerMirroredStrategy: each process
    holds its replica's copy, and reading the aggregate is a collective that every
    process makes).

    Args:
        initial_value: the value every copy starts from.
        aggregation: NONE (the default, as in TensorFlow: reading across replicas raises, so
            the choice is explicit), SUM, MEAN or ONLY_FIRST_REPLICA.
        strategy: the owning strategy; default the current one (create it in ``strategy.scope()``).
    """

    def __init__(
        self,
        initial_value: torch.Tensor | float,
        aggregation: VariableAggregation | str = VariableAggregation.NONE,
        strategy: Strategy | None = None,
    ):
        strategy = strategy or get_strategy()
        value = torch.as_tensor(initial_value)
        devices = _replica_devices(strategy, value.device)
        super().__init__([value.detach().to(device, copy=True) for device in devices])
        self.aggregation = VariableAggregation(aggregation)
        self.strategy = strategy

    @classmethod
    def from_local_values(
        cls,
        local_values: Sequence[torch.Tensor],
        aggregation: VariableAggregation | str,
        strategy: Strategy | None = None,
    ) -> SyncOnReadVariable:
        """Wraps existing per-replica tensors (e.g. each replica's batch-norm running mean)
        without copying them: writes through the variable change those tensors."""
        variable = cls.__new__(cls)
        DistributedValue.__init__(variable, list(local_values))
        variable.aggregation = VariableAggregation(aggregation)
        variable.strategy = strategy or get_strategy()
        if len(variable.values) != variable.strategy.local_replicas:
            raise ValueError(
                f"got {len(variable.values)} local values for {variable.strategy.local_replicas} replicas in this "
                "process: pass one tensor per replica (strategy.experimental_local_results gives them)"
            )
        return variable

    # ------------------------------------------------------------------ reading

    def read_value(self) -> torch.Tensor:
        """The local copy in the owner's replica context; else the aggregate of all copies."""
        replica = self._local_replica()
        if replica is not None:
            return self.values[replica]
        return self.aggregate()

    value = read_value

    def aggregate(self) -> torch.Tensor:
        """The copies of every replica, in this process and the others, combined by
        ``aggregation``, on this process's first copy's device (a new tensor). Under a
        multi-process strategy a collective: every process must call it."""
        if self.aggregation is VariableAggregation.NONE:
            raise ValueError(
                "a SyncOnReadVariable with aggregation NONE has no cross-replica value: read each "
                "replica's copy with strategy.experimental_local_results(variable), or choose SUM/MEAN"
            )
        first = self.values[0]
        if self.aggregation is VariableAggregation.ONLY_FIRST_REPLICA:
            # Replica 0's copy, wherever it lives: the other processes add zeros.
            local = first.detach().clone() if self._holds_replica_zero() else torch.zeros_like(first)
            return self.strategy.sum_across_processes(local).to(first.dtype)
        total = first.detach().clone()
        for copy in self.values[1:]:
            total.add_(copy.detach().to(first.device))
        total = self.strategy.sum_across_processes(total).to(first.dtype)
        replicas = self.strategy.num_replicas_in_sync
        if self.aggregation is VariableAggregation.MEAN:
            return total / replicas if total.is_floating_point() else total // replicas
        return total

    def _holds_replica_zero(self) -> bool:
        """Whether this process holds replica 0 (in a single-process strategy, always)."""
        if self.strategy.local_replicas == self.strategy.num_replicas_in_sync:
            return True
        return self.strategy.is_chief  # rank 0 holds replica 0

    # ------------------------------------------------------------------ writing

    @torch.no_grad()
    def assign(self, value: torch.Tensor | float) -> None:
        """In replica context: sets the local copy. In cross-replica context: sets every copy
        so that the aggregate reads ``value`` (with SUM, each copy gets value / replicas)."""
        replica = self._local_replica()
        if replica is not None:
            self.values[replica].copy_(torch.as_tensor(value))
            return
        value = torch.as_tensor(value)
        if self.aggregation is VariableAggregation.SUM:
            value = value / self.strategy.num_replicas_in_sync
        for copy in self.values:
            copy.copy_(value)

    @torch.no_grad()
    def assign_add(self, delta: torch.Tensor | float) -> None:
        """Adds to the local copy (replica context only: each replica accumulates its own)."""
        replica = self._local_replica()
        if replica is None:
            raise RuntimeError(
                "SyncOnReadVariable.assign_add() outside replica context would not know whose copy "
                "to update: call it inside strategy.run(...), or use assign() to set the aggregate"
            )
        local = self.values[replica]
        local.add_(torch.as_tensor(delta).to(local.device))

    def _local_replica(self) -> int | None:
        context = get_replica_context()
        if context is None or context.strategy is not self.strategy:
            return None
        return self.strategy.local_index(context.replica_id_in_sync_group)


def _replica_devices(strategy: Strategy, fallback: torch.device) -> tuple[torch.device, ...]:
    """Where each of this process's replicas keeps its copy: the strategy's replica devices
    when it has them."""
    devices = getattr(strategy, "replica_devices", None)
    if devices is not None:
        return tuple(devices)
    return (fallback,) * strategy.local_replicas


def regroup(per_replica: Sequence[Any], wrap: type[DistributedValue] = PerReplica) -> Any:
    """Turns one structure per replica into one structure whose differing leaves are ``wrap``
    values (PerReplica; Mirrored for the results of an update, which agree by construction).

    Leaves that are the same object on every replica stay plain (as TF merges them);
    with one replica the structure itself is returned."""
    if len(per_replica) == 1:
        return per_replica[0]
    first = per_replica[0]
    if all(v is first for v in per_replica):
        return first
    same_type = all(type(v) is type(first) for v in per_replica)
    if same_type and isinstance(first, (tuple, list)) and all(len(v) == len(first) for v in per_replica):
        columns = [regroup([v[i] for v in per_replica], wrap) for i in range(len(first))]
        if isinstance(first, tuple) and hasattr(first, "_fields"):
            return type(first)(*columns)
        return type(first)(columns)
    if same_type and isinstance(first, dict) and all(v.keys() == first.keys() for v in per_replica):
        return type(first)((k, regroup([v[k] for v in per_replica], wrap)) for k in first)
    return wrap(list(per_replica))


def select_replica(structure: Any, replica: int) -> Any:
    """Replica ``replica``'s view of ``structure``: each PerReplica or Mirrored leaf replaced by
    its component (a SyncOnReadVariable stays whole: each replica reads its own copy of it)."""

    def pick(leaf: Any) -> Any:
        if not isinstance(leaf, DistributedValue) or isinstance(leaf, SyncOnReadVariable):
            return leaf
        if len(leaf.values) == 1:
            return leaf.values[0]
        if replica >= len(leaf.values):
            raise ValueError(
                f"a {type(leaf).__name__} with {len(leaf.values)} components has none for replica {replica}: "
                "return one component per replica (or a plain value every replica shares)"
            )
        return leaf.values[replica]

    return nest.map_structure(pick, structure)


@dataclass(frozen=True)
class ValueContext:
    """What ``experimental_distribute_values_from_function`` tells ``value_fn`` about the replica
    it builds a value for (tf.distribute.ValueContext).

    Raises:
        ValueError: no replicas, or an id outside 0 .. num_replicas_in_sync - 1.
    """

    replica_id_in_sync_group: int = 0
    num_replicas_in_sync: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.replica_id_in_sync_group < self.num_replicas_in_sync:
            raise ValueError(
                f"ValueContext: replica id {self.replica_id_in_sync_group} is not one of "
                f"{self.num_replicas_in_sync} replicas (ids 0 to num_replicas_in_sync - 1)"
            )
