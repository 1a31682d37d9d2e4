"""An in-memory stand-in for the parameter servers, for unit tests of the worker core.

``FakeParameterServers`` is a ``worker.closure_access.VariableClient`` over one real ``ShardStore``
(so pushes are validated, applied by torch.optim and de-duplicated by idempotency key
exactly as on a server), with every variable in a single shard and no gRPC. It records
what a worker asked of it, so tests can check what travelled.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from paramserve.psserver.protocol.errors import IndexOutOfRangeError, ServerUnavailableError
from paramserve.psserver.protocol.optimizer_spec import OptimizerSpec
from paramserve.psserver.protocol.types import (
    ClusterContext,
    PendingExchange,
    PullResult,
    PushSummary,
    RowGradient,
    ShardPlacement,
    ShardRef,
    ShardState,
    UniqueRows,
    VariableLayout,
)
from paramserve.psserver.store.shard_store import ShardPush, ShardStore
from paramserve.worker.layers import RefreshBeforeForward, ServerOptimizer, mark_variable

ADDRESS = "fake-ps:1"


def linear_servers(lr: float) -> FakeParameterServers:
    """Servers holding a Linear(3 -> 2) as variables 'w' and 'b' (SGD at ``lr``; torch seed 0)."""
    servers = FakeParameterServers()
    torch.manual_seed(0)
    servers.create("w", torch.randn(2, 3), OptimizerSpec("SGD", {"lr": lr}))
    servers.create("b", torch.randn(2), OptimizerSpec("SGD", {"lr": lr}))
    return servers


def distributed_linear(lr: float, *, refresh_hook: bool = False) -> tuple[nn.Linear, ServerOptimizer]:
    """A model as the coordinator holds it: its parameters stand for variables 'w' and 'b';
    with ``refresh_hook``, its forward pulls them first (RefreshBeforeForward)."""
    model = nn.Linear(3, 2)
    mark_variable(model.weight, "w")
    mark_variable(model.bias, "b")
    if refresh_hook:
        model.register_forward_pre_hook(RefreshBeforeForward())
    return model, ServerOptimizer(["w", "b"], "SGD", {"lr": lr})


@dataclass
class Traffic:
    """What workers asked for: variables pulled whole, rows pulled, push keys, variables
    read back by pushes (in the same round trip), the destinations they gave for reads (by
    name, whether pinned), and the devices of the gradients they pushed."""

    pulled: list[str] = field(default_factory=list)
    read_back: list[str] = field(default_factory=list)
    rows_pulled: list[int] = field(default_factory=list)
    row_exchanges: int = 0
    """Row reads, each of any number of tables (the real client makes one exchange per server)."""
    push_keys: list[str] = field(default_factory=list)
    destinations: list[tuple[str, bool]] = field(default_factory=list)
    pushed_from: list[torch.device] = field(default_factory=list)
    started: int = 0
    """Pushes started to stay in flight (start_push_and_pull)."""
    merged: int = 0
    """Pushes sent with the next step's lookup (start_push_parts_and_read_rows with lookups)."""


class FakeParameterServers:
    """One ShardStore behind the VariableClient interface; ``down`` makes every call fail
    as an unreachable server does."""

    def __init__(self) -> None:
        self.store = ShardStore()
        self.layouts: dict[str, VariableLayout] = {}
        self.traffic = Traffic()
        self.down = False
        self.closed = False
        self.opened_for: list[tuple[str, ...]] = []

    # ---------------------------------------------------------------- set-up (as a coordinator would)

    def create(self, name: str, value: torch.Tensor, optimizer: OptimizerSpec | None) -> None:
        shape = tuple(value.shape)
        rows = shape[0] if shape else 0
        self.store.create_shards([ShardState(ShardRef(name, 0), shape, 0, value.clone(), optimizer)])
        self.layouts[name] = VariableLayout(name, shape, value.dtype, (ShardPlacement(0, 0, 0, rows),))

    @property
    def cluster(self) -> ClusterContext:
        return ClusterContext((ADDRESS,), self.layouts)

    def factory(self, addresses: tuple[str, ...], failover_seconds: float = 0.0) -> FakeParameterServers:
        """The worker core's client factory."""
        self.opened_for.append(addresses)
        return self

    def value(self, name: str) -> torch.Tensor:
        return self.store.pull(ShardRef(name, 0)).value

    def local_linear(self) -> nn.Linear:
        """A plain ``nn.Linear(3, 2)`` holding the current 'w' and 'b' (a test's reference)."""
        local = nn.Linear(3, 2)
        with torch.no_grad():
            local.weight.copy_(self.value("w"))
            local.bias.copy_(self.value("b"))
        return local

    def version(self, name: str) -> int:
        return self.store.pull(ShardRef(name, 0)).version

    # ---------------------------------------------------------------- VariableClient

    def adopt_layouts(self, layouts: Mapping[str, VariableLayout]) -> None:
        assert dict(layouts) == self.layouts, "the worker must use the layouts the coordinator sent"

    def pull(self, names: Sequence[str] | None = None, *, out: Mapping[str, torch.Tensor] | None = None) -> PullResult:
        self._check_up()
        names = list(self.layouts) if names is None else list(names)
        self.traffic.pulled.extend(names)
        return self._read(names, out)

    def _read(self, names: Sequence[str], out: Mapping[str, torch.Tensor] | None) -> PullResult:
        pulled = {name: self.store.pull(ShardRef(name, 0)) for name in names}
        values = {}
        for name, shard in pulled.items():
            if out is not None and name in out:  # as the real client: checked, then written in place
                assert out[name].device.type == "cpu" and out[name].shape == shard.value.shape, name
                self.traffic.destinations.append((name, out[name].is_pinned()))
                values[name] = out[name].copy_(shard.value)
            else:
                values[name] = shard.value
        return PullResult(values, {ShardRef(n, 0): p.version for n, p in pulled.items()})

    def pull_unique_rows(
        self, lookups: Mapping[str, torch.Tensor], *, dynamic: Mapping[str, tuple[int, torch.dtype]] | None = None
    ) -> tuple[dict[str, UniqueRows], dict[ShardRef, int]]:
        if dynamic:
            raise NotImplementedError("the in-memory fake has no dynamic tables: test them on real servers")
        self._check_up()
        self.traffic.row_exchanges += 1
        found: dict[str, UniqueRows] = {}
        versions: dict[ShardRef, int] = {}
        for name, indices in lookups.items():
            unique, inverse = torch.unique(indices.reshape(-1).to(torch.int64), return_inverse=True)
            self.traffic.rows_pulled.extend(unique.tolist())
            pulled = self.store.pull_rows(ShardRef(name, 0), unique)
            found[name] = UniqueRows(unique, inverse, pulled.value)
            versions[ShardRef(name, 0)] = pulled.version
        return found, versions

    def push_and_pull(
        self,
        gradients: Mapping[str, torch.Tensor | RowGradient],
        names: Sequence[str],
        *,
        key: str | None = None,
        base_versions: Mapping[ShardRef, int] | None = None,
        out: Mapping[str, torch.Tensor] | None = None,
    ) -> tuple[PushSummary, PullResult]:
        summary = self.push(gradients, key=key, base_versions=base_versions)
        self.traffic.read_back.extend(names)
        return summary, self._read(names, out)

    def start_push_and_pull(
        self,
        gradients: Mapping[str, torch.Tensor | RowGradient],
        names: Sequence[str],
        *,
        key: str | None = None,
        base_versions: Mapping[ShardRef, int] | None = None,
        out: Mapping[str, torch.Tensor] | None = None,
    ) -> PendingExchange:
        """Applies nothing until ``result()``: the push is in flight until then, as far as the
        caller can tell (a real server applies it meanwhile)."""
        self.traffic.started += 1
        return PendingExchange(
            lambda: self.push_and_pull(gradients, names, key=key, base_versions=base_versions, out=out),
            lambda: None,
            keep=gradients,
        )

    def push_parts(
        self, gradients: Mapping[str, torch.Tensor | RowGradient], base_versions: Mapping[ShardRef, int] | None = None
    ) -> list[tuple[int, Any]]:
        """One 'part' holding the whole push: this fake has one server."""
        return [(0, (dict(gradients), dict(base_versions or {})))]

    def start_push_parts_and_read_rows(
        self,
        parts: Sequence[tuple[int, Any]],
        names: Sequence[str],
        lookups: Mapping[str, torch.Tensor],
        *,
        key: str,
        dynamic: Mapping[str, tuple[int, torch.dtype]] | None = None,
    ) -> tuple[PendingExchange, dict[str, UniqueRows]]:
        """As the real client: a bad lookup raises before anything is sent; the push is applied,
        then the values and rows read, when ``result()`` runs."""
        for name, indices in lookups.items():
            rows = self.layouts[name].shape[0]
            if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= rows):
                raise IndexOutOfRangeError(f"row index outside [0, {rows})", variable=name)
        if lookups:  # else a push on its own, sent from parts already cut
            self.traffic.merged += 1

        found = {
            name: UniqueRows(*torch.unique(ids.reshape(-1).to(torch.int64), return_inverse=True), torch.empty(0))
            for name, ids in lookups.items()
        }

        def result() -> tuple[PushSummary, PullResult]:
            (_, (gradients, base)), *_ = parts
            summary = self.push(gradients, key=key, base_versions=base)
            self.traffic.read_back.extend(names)
            pulled = self._read(names, None)
            rows, versions = self.pull_unique_rows(lookups) if lookups else ({}, {})
            for name, unique in rows.items():  # filled in place, as the real client's reads land
                found[name].rows.set_(unique.rows)
            return summary, PullResult(pulled.tensors, {**pulled.versions, **versions})

        return PendingExchange(result, lambda: None, keep=parts), found

    def push(
        self,
        gradients: Mapping[str, torch.Tensor | RowGradient],
        *,
        key: str | None = None,
        base_versions: Mapping[ShardRef, int] | None = None,
    ) -> PushSummary:
        self._check_up()
        assert key, "a worker's pushes always carry an idempotency key"
        self.traffic.push_keys.append(key)
        base = base_versions or {}
        pushes = []
        for name, gradient in gradients.items():
            ref = ShardRef(name, 0)
            self.traffic.pushed_from.append((gradient.values if isinstance(gradient, RowGradient) else gradient).device)
            if isinstance(gradient, RowGradient):
                pushes.append(ShardPush(ref, gradient.values, gradient.indices.to(torch.int64), base.get(ref, -1)))
            else:
                pushes.append(ShardPush(ref, gradient.detach(), None, base.get(ref, -1)))
        return PushSummary(tuple(self.store.push(pushes, key)))

    def close(self) -> None:
        self.closed = True

    def _check_up(self) -> None:
        if self.down:
            raise ServerUnavailableError("parameter server unreachable (UNAVAILABLE)", server=ADDRESS)
