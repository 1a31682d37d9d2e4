"""The worker's side of distributed variables: its local parameters and one closure's access.

``LocalVariables`` holds the worker-wide ``nn.Parameter`` of each distributed variable on the
worker's device and knows which are fresh; ``ClosureAccess`` is the ``VariableAccess``
(worker.layers) of one closure execution: it pulls what the closure uses, looks up
embedding rows and pushes gradients with keys derived from the closure id, so a retried closure
never updates a variable twice. ``VariableClient`` is what they need of the parameter servers.

Apart from worker.core, which decides what runs when: this is how values move between the
closure and the servers (the coordinator's counterpart is
coordinator.strategies.parameter_server_access).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from paramserve.psserver.protocol.errors import DtypeMismatchError, InvalidRequestError, ShapeMismatchError
from paramserve.psserver.protocol.types import (
    PendingExchange,
    PullResult,
    PushSummary,
    RowGradient,
    ShardRef,
    UniqueRows,
    VariableLayout,
)
from paramserve.worker.layers import mark_variable, variable_name
from paramserve.worker.pipeline import DeferredPush, PushPipeline
from paramserve.worker.results import ClosureCancelled
from paramserve.worker.row_cache import CacheUse, RowCache, cached_lookup
from paramserve.worker.transfers import HostTransfers, Transfers

# ---------------------------------------------------------------- the parameter servers


class VariableClient(Protocol):
    """What the worker needs of the parameter servers (ParameterServerClient; tests use a fake)."""

    def adopt_layouts(self, layouts: Mapping[str, VariableLayout]) -> None:
        """Uses these layouts (sent by the coordinator) instead of discovering them."""

    @property
    def layouts(self) -> Mapping[str, VariableLayout]:
        """Where each variable lives (what the row cache needs to date its rows by shard)."""

    def pull(self, names: Sequence[str] | None = None, *, out: Mapping[str, torch.Tensor] | None = None) -> PullResult:
        """Whole variables, with the version each shard was read at; read into ``out``'s host
        tensors where it names the variable (a GPU worker's pinned buffers)."""

    def pull_unique_rows(
        self, lookups: Mapping[str, torch.Tensor], *, dynamic: Mapping[str, tuple[int, torch.dtype]] | None = None
    ) -> tuple[dict[str, UniqueRows], dict[ShardRef, int]]:
        """The distinct rows of every lookup (table: indices) in one exchange per server, and
        the version each shard was read at; ``dynamic``: the dynamic tables among them (dim, dtype)."""

    def push_and_pull(
        self,
        gradients: Mapping[str, torch.Tensor | RowGradient],
        names: Sequence[str],
        *,
        key: str | None = None,
        base_versions: Mapping[ShardRef, int] | None = None,
        out: Mapping[str, torch.Tensor] | None = None,
    ) -> tuple[PushSummary, PullResult]:
        """Applies gradients (host tensors) on the servers (at most once per shard for ``key``),
        then reads ``names`` as the servers hold them once the push is applied (into ``out``)."""

    def start_push_and_pull(
        self,
        gradients: Mapping[str, torch.Tensor | RowGradient],
        names: Sequence[str],
        *,
        key: str | None = None,
        base_versions: Mapping[ShardRef, int] | None = None,
        out: Mapping[str, torch.Tensor] | None = None,
    ) -> PendingExchange:
        """``push_and_pull`` sent now, its replies read by the result's ``result()``."""

    def push_parts(
        self, gradients: Mapping[str, torch.Tensor | RowGradient], base_versions: Mapping[ShardRef, int] | None = None
    ) -> list[tuple[int, Any]]:
        """What ``gradients`` send to each server (checked now), for ``start_push_parts_and_read_rows``."""

    def start_push_parts_and_read_rows(
        self,
        parts: Sequence[tuple[int, Any]],
        names: Sequence[str],
        lookups: Mapping[str, torch.Tensor],
        *,
        key: str,
        dynamic: Mapping[str, tuple[int, torch.dtype]] | None = None,
    ) -> tuple[PendingExchange, dict[str, UniqueRows]]:
        """A push and the next lookups in one round trip per server (the rows read include the
        push); a bad lookup raises here, before anything is sent. The rows (by table) are
        filled once the exchange's ``result()`` returned."""

    def close(self) -> None: ...


ClientFactory = Callable[[tuple[str, ...], float], VariableClient]
"""Makes the client of the parameter servers at these addresses; a failover time > 0 (the
cluster context's ``failover_seconds``) bounds how long it retries an unreachable server."""


# ---------------------------------------------------------------- local parameters


class LocalVariables:
    """The worker-wide local copies of distributed variables, on the worker's device, and how
    fresh they are.

    Worker-wide (not per closure) so that modules kept in per-worker resources,
    and closures scheduled again and again, reuse one parameter per variable.
    """

    def __init__(self, transfers: Transfers | None = None) -> None:
        self.transfers = transfers or HostTransfers()
        self.parameters: dict[str, nn.Parameter] = {}
        self.versions: dict[ShardRef, int] = {}
        self._fresh: set[str] = set()
        self._returned: set[str] = set()
        """Variables whose values the current step's pushes returned (read right after those
        pushes were applied): the next step may start from them instead of pulling."""
        self._returned_at = float("-inf")
        self._returned_generation = -1
        """The read generation of the closure whose pushes returned those values."""
        self._awaited: set[str] = set()
        """Variables a deferred push will read back (worker.pipeline): not stale meanwhile, the
        values held being at most one of this worker's steps old."""
        self.read_generation = 0
        """The read generation of the closure running (see ``returned_within``)."""
        self.steps = 0
        """Steps this worker began (what the row cache counts staleness in)."""
        self.row_cache = RowCache()
        """Rows read by earlier steps, served again within ``max_row_staleness`` (worker.row_cache)."""

    def parameter(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
        existing = self.parameters.get(name)
        if existing is not None and tuple(existing.shape) == tuple(shape) and existing.dtype == dtype:
            return existing
        # New, or the variable was re-created with another shape or dtype.
        trainable = dtype.is_floating_point or dtype.is_complex
        parameter = nn.Parameter(torch.empty(shape, dtype=dtype, device=self.device), requires_grad=trainable)
        mark_variable(parameter, name)
        self.parameters[name] = parameter
        self._fresh.discard(name)
        return parameter

    @property
    def device(self) -> torch.device:
        return self.transfers.device

    def pull_destinations(self, names: Sequence[str]) -> dict[str, torch.Tensor] | None:
        """Where the client should pull ``names`` (see Transfers.pull_destinations)."""
        return self.transfers.pull_destinations({n: self.parameters[n] for n in names if n in self.parameters})

    def stale(self, names: Sequence[str]) -> list[str]:
        return [n for n in dict.fromkeys(names) if n not in self._fresh and n not in self._awaited]

    def await_values(self, names: Sequence[str]) -> None:
        """``names`` will be read back by a deferred push: used as held until then."""
        self._awaited.update(names)

    def stop_awaiting(self) -> None:
        """What a deferred push would have read back will not come (it was dropped): stale."""
        self._fresh.difference_update(self._awaited)
        self._awaited.clear()

    def mark_stale(self, names: Sequence[str] | None = None) -> None:
        if names is None:
            self._fresh.clear()
        else:
            self._fresh.difference_update(names)

    def begin_step(self, keep_returned: bool) -> None:
        """A step starts: what the previous step's pushes returned stays fresh when
        ``keep_returned`` (they were read as the previous step ended); all else is stale."""
        self._fresh = self._returned if keep_returned else set()
        self._returned = set()
        self.steps += 1

    def forget_returned(self) -> None:
        """Values read back by pushes are not to be reused (the variables were rewritten)."""
        self.stop_awaiting()
        self._returned = set()
        self._returned_at = float("-inf")
        self._returned_generation = -1

    def returned_within(self, seconds: float, now: float, generation: int = 0) -> bool:
        """Whether the last push returned values at most ``seconds`` ago, read by a closure of
        read generation ``generation`` or later. The coordinator starts a new generation at each
        join() and fetch(): values read before one must not stand in for a read after it."""
        return seconds > 0 and self._returned_generation >= generation and now - self._returned_at <= seconds

    def fill(self, pulled: PullResult, extra: Sequence[nn.Parameter] = (), *, returned_at: float | None = None) -> None:
        """Copies pulled values into the parameters in place (and into ``extra`` of the same names).
        ``returned_at``: the values came back from a push, at that (monotonic) time."""
        targets: dict[str, list[nn.Parameter]] = defaultdict(list)
        for parameter in [*self.parameters.values(), *extra]:
            name = variable_name(parameter)
            if name in pulled.tensors and all(parameter is not t for t in targets[name]):
                targets[name].append(parameter)
        copies = []
        for name, value in pulled.tensors.items():
            for parameter in targets[name]:
                _check_matches(name, parameter, value)
                copies.append((parameter, value))
        self.transfers.fill(copies)
        self.versions.update(pulled.versions)
        self._fresh.update(pulled.tensors)
        self._awaited.difference_update(pulled.tensors)
        if returned_at is not None:
            self._returned.update(pulled.tensors)
            self._returned_at = returned_at
            self._returned_generation = self.read_generation

    def clear_grads(self) -> None:
        for parameter in self.parameters.values():
            parameter.grad = None

    def base_versions(self, names: Sequence[str]) -> dict[ShardRef, int]:
        wanted = set(names)
        return {ref: v for ref, v in self.versions.items() if ref.variable in wanted}


def _check_matches(name: str, parameter: torch.Tensor, value: torch.Tensor) -> None:
    if tuple(parameter.shape) != tuple(value.shape):
        raise ShapeMismatchError(
            f"the closure was built for shape {tuple(parameter.shape)}, the servers hold {tuple(value.shape)}",
            variable=name,
        )
    if parameter.dtype != value.dtype:
        raise DtypeMismatchError(
            f"the closure was built for {parameter.dtype}, the servers hold {value.dtype}", variable=name
        )


# ---------------------------------------------------------------- one closure's access


@dataclass
class _RowLookup:
    """One lookup of a table: its distinct rows as a leaf the step's gradient flows into (the
    computation reads ``leaf[inverse]``, so the leaf's gradient is summed per distinct row)."""

    ids: torch.Tensor  # the distinct global rows
    leaf: torch.Tensor  # [len(ids), *row_shape]

    def row_gradient(self) -> torch.Tensor:
        return self.leaf.grad  # type: ignore[return-value]


class DenseExchange(Protocol):
    """Hybrid training's replicated dense variables (worker.dense_group.DenseReplicas)."""

    def holds(self, name: str) -> bool: ...

    def exchange(self, gradients: Mapping[str, torch.Tensor], key: str) -> None:
        """Averages one step's gradients over the workers; the update is applied by ``settle``."""

    def settle(self) -> None:
        """Applies the update of the step in flight, if any."""


class _NoDense:
    def holds(self, name: str) -> bool:
        return False

    def settle(self) -> None:
        return None

    def exchange(self, gradients: Mapping[str, torch.Tensor], key: str) -> None:
        raise AssertionError("no replicated variables")


class ClosureAccess:
    """The VariableAccess of one closure execution: pulls, lookups and keyed pushes.

    Push keys are ``f"{closure_id}/{n}"`` for the n-th push of this execution,
    so a retried closure sends the same keys and the servers apply each once. Under hybrid
    training (``dense``) the replicated variables are never pulled: a step sends their
    gradients to the all-reduce among the workers (key ``f"{closure_id}/dense/{n}"``) while its
    push of the tables' rows is on its way (worker.dense_group).
    """

    def __init__(
        self,
        variables: LocalVariables,
        client: VariableClient | None,
        closure_id: str,
        pipeline: PushPipeline | None = None,
        cancelled: Callable[[], bool] = lambda: False,
        dense: DenseExchange | None = None,
        max_row_staleness: int = 0,
        overlap_pushes: bool = False,
    ):
        self._variables = variables
        self._max_row_staleness = max_row_staleness
        """A row read at most this many of the worker's steps ago is served from its cache (0: none)."""
        self.cache_use = CacheUse()
        self._dense: DenseExchange = dense or _NoDense()
        self._dense_seq = 0
        self._cancelled = cancelled
        """Whether the coordinator cancelled this closure: checked before every push."""
        self._client = client
        self._closure_id = closure_id
        self._pipeline = pipeline
        """Where this closure's pushes stay in flight (overlap_pushes) or wait for the next lookup
        (max_row_staleness >= 1); None: each push waits for its reply."""
        self._overlaps = pipeline is not None and overlap_pushes
        """A push without rows stays in flight while the next step computes."""
        self._defers_pushes = pipeline is not None and (overlap_pushes or max_row_staleness > 0)
        """A push with rows waits for the next step's lookup (both consent to values one step old)."""
        self._used: dict[str, nn.Parameter] = {}
        self._placed: set[int] = set()
        self._lookups: dict[str, list[_RowLookup]] = defaultdict(list)
        self._row_versions: dict[ShardRef, int] = {}
        self._push_seq = 0
        self.pushes_applied = 0
        self.pushes_duplicate = 0

    def parameter(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
        parameter = self._variables.parameter(name, tuple(shape), dtype)
        self._used[name] = parameter
        return parameter

    def refresh(self, parameters: Sequence[nn.Parameter]) -> None:
        named = [p for p in parameters if variable_name(p) is not None and not self._dense.holds(str(variable_name(p)))]
        stale = self._variables.stale([str(variable_name(p)) for p in named])
        if stale:
            client = self._require_client()
            self._settle()  # a pull reads what the push in flight applies
            self._variables.fill(client.pull(stale, out=self._variables.pull_destinations(stale)), named)

    def place(self, module: nn.Module) -> None:
        """Moves ``module``'s other tensors (buffers, parameters that are not variables: they
        arrived in the closure as the coordinator held them) to the worker's device, once per
        module and closure; a no-op on a CPU worker."""
        device = self._variables.device
        if device.type == "cpu" or id(module) in self._placed:
            return
        module.to(device)
        self._placed.add(id(module))

    def refresh_used(self) -> None:
        """Makes every parameter this closure resolved current (one pull), so code that
        reads parameters directly, without a module's refresh hook, sees fresh values."""
        self.refresh(list(self._used.values()))

    def lookup(
        self, lookups: Mapping[str, torch.Tensor], dynamic: Mapping[str, tuple[int, torch.dtype]] | None = None
    ) -> dict[str, torch.Tensor]:
        """The rows the lookups name (indices on any device), on the worker's device, read in
        one exchange per server; only distinct rows travel, and their gradients are summed
        per row before the push. ``dynamic``: tables among them that are dynamic (dim, dtype),
        whose gradients push by id."""
        host = {name: indices.detach().to("cpu") for name, indices in lookups.items()}  # the client needs host ids
        client = self._require_client()
        deferred = self._pipeline.take_deferred(client) if self._pipeline is not None else None
        if deferred is None:
            self._settle()
        pull = _PullWithPush(client, deferred, self._pipeline)
        try:
            if self._max_row_staleness > 0:
                found, versions, use = cached_lookup(
                    pull,
                    self._variables.row_cache,
                    client.layouts,
                    host,
                    dynamic,
                    step=self._variables.steps,
                    max_staleness=self._max_row_staleness,
                    generation=self._variables.read_generation,
                )
                self.cache_use.add(use)
            else:
                found, versions = pull(host, dynamic)
                self.cache_use.rows_pulled += sum(unique.ids.numel() for unique in found.values())
        finally:
            if deferred is not None and not pull.sent and self._pipeline is not None:
                self._pipeline.defer(deferred)  # every row was cached, or a lookup was bad: later
        for ref, version in versions.items():
            self._row_versions.setdefault(ref, version)  # the oldest read is the gradient's base
        return {name: self._rows_of(name, host[name].shape, found[name]) for name in host}

    def lookup_dynamic(self, table: str, ids: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
        """A dynamic table's rows for ``ids`` (worker.dynamic_embedding), as ``lookup``."""
        return self.lookup({table: ids}, dynamic={table: (dim, dtype)})[table]

    def _rows_of(self, name: str, shape: torch.Size, unique: UniqueRows) -> torch.Tensor:
        leaf = self._variables.transfers.to_device(unique.rows)
        inverse = self._variables.transfers.to_device(unique.inverse)
        if leaf.dtype.is_floating_point:
            leaf.requires_grad_(True)
            self._lookups[name].append(_RowLookup(unique.ids, leaf))
        return leaf[inverse].reshape(*shape, *leaf.shape[1:])

    def apply_gradients(self, names: Sequence[str]) -> None:
        """Pushes the gradients of ``names`` and, in the same round trip, reads back the dense
        ones this worker holds: their values as the servers hold them right after this push.

        With a pipeline (``overlap_pushes``, worker.pipeline) the push is left in flight: the
        previous one is settled first, and this one when the next step pushes or pulls, or the
        batch ends. Its gradients then belong to the push (a retry may send them again): their
        parameters' ``.grad`` is set to None, so no later step writes into them."""
        if self._cancelled():
            raise ClosureCancelled(f"closure {self._closure_id} was cancelled by the coordinator before this push")
        replicated = [n for n in names if self._dense.holds(n)]
        names = [n for n in names if not self._dense.holds(n)]
        on_device = self._gradients(names)
        # The values these gradients came from: read before a settle replaces them.
        base = {**self._variables.base_versions(list(on_device)), **self._row_versions}
        if self._defers_pushes and not replicated and any(isinstance(g, RowGradient) for g in on_device.values()):
            self._defer_push(names, on_device, base)  # a step that looked rows up: the next one will
            return
        self._settle()  # raises EarlierPushFailed when that push failed
        gradients = self._variables.transfers.to_host(on_device)  # after the settle: a GPU's pinned buffers are free
        self._variables.mark_stale(list(names))
        pending: PendingExchange | None = None
        if gradients:
            client = self._require_client()
            key = f"{self._closure_id}/{self._push_seq}"
            self._push_seq += 1
            read_back = [n for n in dict.fromkeys(names) if n in self._used]
            out = self._variables.pull_destinations(read_back)
            used = list(self._used.values())
            overlap = self._pipeline if self._overlaps else None
            if overlap is None and replicated:  # in flight while the dense all-reduce runs
                pending = client.start_push_and_pull(gradients, read_back, key=key, base_versions=base, out=out)
            elif overlap is None:
                self._record(*client.push_and_pull(gradients, read_back, key=key, base_versions=base, out=out), used)
            else:
                exchange = client.start_push_and_pull(gradients, read_back, key=key, base_versions=base, out=out)
                for name in gradients:
                    parameter = self._variables.parameters.get(name)
                    if parameter is not None:
                        parameter.grad = None
                overlap.hold(self, exchange, lambda done: self._record(*done.result(), used))
        if replicated:
            try:
                self._exchange_dense(replicated)
            finally:
                done = pending.result() if pending is not None else None  # settled whatever the all-reduce did
            if done is not None:
                self._record(*done, used)
        self._forget_rows(names)

    def _defer_push(
        self, names: Sequence[str], on_device: Mapping[str, torch.Tensor | RowGradient], base: Mapping[ShardRef, int]
    ) -> None:
        """``apply_gradients`` of a step that looked rows up, with ``max_row_staleness`` >= 1 or
        ``overlap_pushes``: the push waits for the next lookup
        (worker.pipeline: one exchange per server serves this step's push and the next step's
        reads). This step's backward is done, so what the last exchange read back is installed
        now; a push no lookup took is sent first."""
        pipeline = self._pipeline
        assert pipeline is not None
        pipeline.install()
        self._settle()
        gradients = self._variables.transfers.to_host(on_device)
        if gradients:
            client = self._require_client()
            parts = client.push_parts(gradients, base)  # a bad gradient is this step's error, now
            key = f"{self._closure_id}/{self._push_seq}"
            self._push_seq += 1
            read_back = [n for n in dict.fromkeys(names) if n in self._used]
            used = list(self._used.values())
            self._variables.mark_stale([n for n in names if n not in read_back])
            self._variables.await_values(read_back)
            for name in gradients:  # they belong to the push now: no later step writes into them
                parameter = self._variables.parameters.get(name)
                if parameter is not None:
                    parameter.grad = None

            def flush() -> None:  # the parts cut above, without lookups
                pending, _ = client.start_push_parts_and_read_rows(parts, read_back, {}, key=key)
                self._record(*pending.result(), used)

            def received(summary: PushSummary, pulled: PullResult) -> None:
                self.pushes_applied += summary.applied
                self.pushes_duplicate += summary.duplicates
                arrived_at = time.monotonic()
                pipeline.arrive(lambda: self._variables.fill(pulled, used, returned_at=arrived_at))

            pipeline.defer(DeferredPush(self, client, parts, read_back, key, flush, received))
        self._forget_rows(names)

    def _exchange_dense(self, names: Sequence[str]) -> None:
        """The replicated variables' part of a step: their gradients go to the all-reduce that
        averages them over the workers (applied on each by ``settle``). The tables' push is in
        flight meanwhile: a step whose all-reduce fails runs again, and the servers drop its
        push as a duplicate (same key) while its dense part, never applied, counts then."""
        key = f"{self._closure_id}/dense/{self._dense_seq}"
        self._dense_seq += 1
        dense = {name: g for name, g in self._gradients(names).items() if isinstance(g, torch.Tensor)}
        self._dense.exchange(dense, key)  # (replicated variables have no row lookups)

    def begin_step(self) -> None:
        """A step of this closure starts (the previous one's backward is done): values that
        arrived with a deferred push's exchange are installed now (worker.pipeline)."""
        if self._pipeline is not None:
            self._pipeline.install()

    def settle_replicated(self) -> None:
        self._dense.settle()

    def _record(self, summary: PushSummary, pulled: PullResult, used: list[nn.Parameter]) -> None:
        """A push's outcome: the values it read back fill the parameters, and it is counted."""
        self._variables.fill(pulled, used, returned_at=time.monotonic())
        self.pushes_applied += summary.applied
        self.pushes_duplicate += summary.duplicates

    def _settle(self) -> None:
        if self._pipeline is not None:
            self._pipeline.settle()

    def zero_grad(self, names: Sequence[str], set_to_none: bool) -> None:
        for name in names:
            parameter = self._variables.parameters.get(name)
            if parameter is None or parameter.grad is None:
                continue
            if set_to_none:
                parameter.grad = None
            else:
                parameter.grad.zero_()
        self._forget_rows(names)

    def _gradients(self, names: Sequence[str]) -> dict[str, torch.Tensor | RowGradient]:
        gradients: dict[str, torch.Tensor | RowGradient] = {}
        for name in names:
            parameter = self._variables.parameters.get(name)
            if parameter is not None and parameter.grad is not None:
                gradients[name] = parameter.grad
            rows = self._row_gradient(name)
            if rows is not None:
                gradients[name] = rows
        return gradients

    def _row_gradient(self, name: str) -> RowGradient | None:
        done = [lookup for lookup in self._lookups.get(name, ()) if lookup.leaf.grad is not None]
        if not done:
            return None
        indices = torch.cat([lookup.ids for lookup in done])
        values = torch.cat([lookup.row_gradient() for lookup in done])
        return RowGradient(indices, values)

    def _forget_rows(self, names: Sequence[str]) -> None:
        for name in names:
            self._lookups.pop(name, None)
        forgotten = set(names)
        self._row_versions = {r: v for r, v in self._row_versions.items() if r.variable not in forgotten}

    def _require_client(self) -> VariableClient:
        if self._client is None:
            raise InvalidRequestError(
                "this closure uses distributed variables but was sent without parameter servers in its cluster context"
            )
        return self._client


class _PullWithPush:
    """The row cache's pull (``VariableClient.pull_unique_rows``) that also carries a deferred
    push when there is one (worker.pipeline): one exchange per server applies it, then reads the
    rows. Records the push's outcome on its owner; its failure is the owner's, and the lookup
    raises EarlierPushFailed from it. ``sent``: whether the push left (a bad lookup raises first)."""

    def __init__(self, client: VariableClient, deferred: DeferredPush | None, pipeline: PushPipeline | None):
        self._client = client
        self._deferred = deferred
        self._pipeline = pipeline
        self.sent = False

    def __call__(
        self, wanted: Mapping[str, torch.Tensor], dynamic: Mapping[str, tuple[int, torch.dtype]] | None
    ) -> tuple[dict[str, UniqueRows], dict[ShardRef, int]]:
        deferred, pipeline = self._deferred, self._pipeline
        if deferred is None or pipeline is None:
            return self._client.pull_unique_rows(wanted, dynamic=dynamic)
        pending, found = self._client.start_push_parts_and_read_rows(
            deferred.parts, deferred.read_back, wanted, key=deferred.key, dynamic=dynamic
        )  # a bad lookup raises here: nothing left, the push stays deferred
        self.sent = True
        try:
            summary, pulled = pending.result()
        except Exception as exc:
            raise pipeline.failed(deferred, exc) from exc
        deferred.received(summary, pulled)
        tables = set(wanted)  # the dense values' versions come with them, at install
        return found, {ref: v for ref, v in pulled.versions.items() if ref.variable in tables}
