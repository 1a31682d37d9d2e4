"""The types every part of a cluster shares: shards, variable layouts, the cluster context.

These are plain data (no grpc, no protobuf). The parameter server's core keeps
shards as ``ShardState``; the client and the worker talk about variables through
``VariableLayout`` (where each shard of a variable lives) and ``ClusterContext``
(every layout plus the servers' addresses: all a worker needs to reach the
variables). ``psserver.convert`` is the one place that turns them into wire
messages and back.
"""

from __future__ import annotations

import functools
import hashlib
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import NamedTuple

import torch
from torch import Tensor

from paramserve.psserver.protocol.optimizer_spec import OptimizerSpec

__all__ = [
    "ClusterContext",
    "PendingExchange",
    "PullResult",
    "PushOutcome",
    "PushSummary",
    "RowGradient",
    "ShardInfo",
    "ShardPlacement",
    "ShardRef",
    "ShardState",
    "VariableLayout",
]


class ShardRef(NamedTuple):
    """Shard ``shard`` of variable ``variable``. A named tuple, not a dataclass: refs key the
    store's dicts and every step hashes dozens of them, which a tuple does in C."""

    variable: str
    shard: int

    def __str__(self) -> str:
        return f"{self.variable}/{self.shard}"


@dataclass
class ShardState:
    """Everything that makes up a shard: what is created, exported and checkpointed.

    The shard holds rows ``[row_start, row_start + value.shape[0])`` of a
    variable of shape ``variable_shape`` (a 0-d variable is one shard with
    ``row_start`` 0). ``slots`` is the torch optimizer state by state key;
    ``applied_keys`` the idempotency keys of recent pushes, oldest first.
    """

    ref: ShardRef
    variable_shape: tuple[int, ...]
    row_start: int
    value: Tensor
    optimizer: OptimizerSpec | None = None
    slots: dict[str, Tensor] = field(default_factory=dict)
    version: int = 0
    applied_keys: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ShardInfo:
    """A shard's metadata, without its tensors (what a server reports holding)."""

    ref: ShardRef
    variable_shape: tuple[int, ...]
    row_start: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    optimizer: OptimizerSpec | None
    version: int


@dataclass(frozen=True)
class PushOutcome:
    """``applied`` False: the idempotency key was seen before and nothing changed."""

    ref: ShardRef
    applied: bool
    version: int
    staleness: int


@dataclass(frozen=True)
class ShardPlacement:
    """Shard ``index`` of a variable: rows ``[row_start, row_start + num_rows)`` on server ``server``
    (an index into the cluster's parameter-server addresses)."""

    index: int
    server: int
    row_start: int
    num_rows: int


@dataclass(frozen=True)
class VariableLayout:
    """Where a variable's shards live: the one description of a variable's placement."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    shards: tuple[ShardPlacement, ...]

    def ref(self, shard: ShardPlacement) -> ShardRef:
        return ShardRef(self.name, shard.index)

    def shard_shape(self, shard: ShardPlacement) -> tuple[int, ...]:
        return (shard.num_rows, *self.shape[1:]) if self.shape else ()

    @functools.cached_property
    def row_starts(self) -> Tensor:
        """Each shard's first row, as the tensor searchsorted and bucketize take (built once per
        layout: every lookup and push of a sharded table groups its rows by it). Read-only."""
        return torch.tensor([s.row_start for s in self.shards], dtype=torch.int64)


@dataclass(frozen=True)
class ClusterContext:
    """Where every variable lives: the servers' addresses and each variable's layout.

    The coordinator builds it once the variables exist and sends it to workers, so
    a worker restarted a second ago needs nothing else. ``fingerprint`` names its
    content: equal contexts have equal fingerprints.
    """

    parameter_servers: tuple[str, ...] = ()
    layouts: Mapping[str, VariableLayout] = field(default_factory=dict)
    # Counts the coordinator's rewrites of the variables' values (restores): a worker drops
    # values it holds from an older generation instead of reusing them.
    generation: int = 0
    failover_seconds: float = 0.0
    """> 0 when the servers are replicated: a worker gives up on an unreachable server after
    this long, so that its closure is re-routed to the backup that took over (0: the worker's
    own retry deadline)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "parameter_servers", tuple(self.parameter_servers))
        object.__setattr__(self, "layouts", MappingProxyType(dict(self.layouts)))

    @property
    def fingerprint(self) -> str:
        digest = hashlib.sha256(repr((self.parameter_servers, self.generation, self.failover_seconds)).encode())
        for name in sorted(self.layouts):
            layout = self.layouts[name]
            digest.update(repr((name, layout.shape, str(layout.dtype), layout.shards)).encode())
        return digest.hexdigest()[:32]

    def __reduce__(
        self,
    ) -> tuple[type[ClusterContext], tuple[tuple[str, ...], dict[str, VariableLayout], int, float]]:
        return ClusterContext, (self.parameter_servers, dict(self.layouts), self.generation, self.failover_seconds)


@dataclass(frozen=True)
class RowGradient:
    """A row-sparse gradient: ``values[i]`` is the gradient of row ``indices[i]`` (global rows)."""

    indices: Tensor
    values: Tensor


@dataclass(frozen=True)
class UniqueRows:
    """The distinct rows one lookup touches: ``rows[i]`` is global row ``ids[i]``, and the
    lookup's j-th index (flattened) names ``ids[inverse[j]]``. A worker computes with
    ``rows[inverse]``, so the gradient of ``rows`` is already summed per distinct id."""

    ids: Tensor
    inverse: Tensor
    rows: Tensor

    def gathered(self, shape: Sequence[int]) -> Tensor:
        """The lookup's result: a row per index, for indices of ``shape``."""
        return self.rows[self.inverse].reshape(*shape, *self.rows.shape[1:])


@dataclass(frozen=True)
class PullResult:
    """Pulled variables by name, and the version each shard was read at."""

    tensors: dict[str, Tensor]
    versions: dict[ShardRef, int]


@dataclass(frozen=True)
class PushSummary:
    outcomes: tuple[PushOutcome, ...]

    @property
    def applied(self) -> int:
        return sum(o.applied for o in self.outcomes)

    @property
    def duplicates(self) -> int:
        return sum(not o.applied for o in self.outcomes)


class PendingExchange:
    """A ``push_and_pull`` whose requests are on their way (``start_push_and_pull``): exactly one
    of ``result()`` and ``abandon()`` ends it."""

    def __init__(
        self, finish: Callable[[], tuple[PushSummary, PullResult]], abandon: Callable[[], None], *, keep: object = None
    ):
        self._finish: Callable[[], tuple[PushSummary, PullResult]] | None = finish
        self._abandon = abandon
        self._keep = keep  # the gradients the requests were made of: a retry sends them again

    @property
    def done(self) -> bool:
        return self._finish is None

    def result(self) -> tuple[PushSummary, PullResult]:
        """Waits for the replies; raises what ``push_and_pull`` raises."""
        finish, self._finish = self._finish, None
        if finish is None:
            raise RuntimeError("this exchange has ended already")
        try:
            return finish()
        finally:
            self._keep = None

    def abandon(self) -> None:
        """Drops the replies unread (closing their connections); a no-op once ended."""
        if self._finish is not None:
            self._finish = None
            self._keep = None
            self._abandon()


def layouts_from_infos(infos_by_server: Mapping[int, Sequence[ShardInfo]]) -> dict[str, VariableLayout]:
    """Reconstructs variable layouts from what each server reports holding."""
    found: dict[str, list[tuple[ShardInfo, int]]] = defaultdict(list)
    for server, infos in infos_by_server.items():
        for info in infos:
            found[info.ref.variable].append((info, server))
    layouts = {}
    for name, entries in found.items():
        entries.sort(key=lambda e: e[0].ref.shard)
        first = entries[0][0]
        shards = tuple(
            ShardPlacement(info.ref.shard, server, info.row_start, info.shape[0] if info.shape else 0)
            for info, server in entries
        )
        layouts[name] = VariableLayout(name, first.variable_shape, first.dtype, shards)
    return layouts
