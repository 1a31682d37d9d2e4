"""The user's layers over distributed variables, and how they reach the variables: the
distributed parameters, ``ShardedEmbedding``, ``ShardedEmbeddingCollection`` and
``ServerOptimizer``, on a worker and on the coordinator.

Parameters created inside ``ParameterServerStrategy.scope()`` are marked with
the name of their variable on the parameter servers (``mark_variable``). When a closure
is sent to a worker (worker.closure_pickling), such a parameter travels as a reference;
the worker resolves it to a local ``nn.Parameter`` that it fills from the servers before
the step runs, and again after every ``optimizer.step()`` (lazily, before the next forward
of a module that uses it: ``RefreshBeforeForward``).

``ServerOptimizer.step()`` pushes the gradients of those parameters, and the
row gradients of ``ShardedEmbedding`` lookups, to the servers, where the real
optimizer runs. Everything here talks to the servers through a
``VariableAccess``: on a worker, the one of the closure running in this thread
(``using_access``); on the coordinator, the one of the strategy that built the
object (its ``home`` access: the refresh hook, the table and the optimizer carry
it, and drop it when pickled, so on a worker the closure's access applies).
There is no process-wide default.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from paramserve.worker.deferred_rows import FusedRange, close_open_batch, pending_rows

VARIABLE_ATTRIBUTE = "_paramserve_variable"


class VariableAccess(Protocol):
    """How distributed variables are read and updated in the current context."""

    def parameter(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
        """The local parameter standing for variable ``name`` (one object per name)."""

    def refresh(self, parameters: Sequence[nn.Parameter]) -> None:
        """Makes the given parameters hold the servers' current values, if they are stale."""

    def place(self, module: nn.Module) -> None:
        """Puts ``module``'s tensors that are not variables (buffers) where its variables live:
        a GPU worker's device; a no-op where that is where the module already is."""

    def lookup(self, lookups: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Rows of embedding tables (table: indices of any shape), read in one exchange per
        server however many tables there are; each result has shape ``indices.shape + (dim,)``.
        On a worker, step() pushes their gradients, summed per distinct row."""

    def lookup_dynamic(self, table: str, ids: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows of dynamic table ``table`` (worker.dynamic_embedding) for integer ``ids`` of any
        shape: ``ids.shape + (dim,)``; on a worker step() pushes their gradients by id."""

    def apply_gradients(self, names: Sequence[str]) -> None:
        """Pushes the gradients of these variables to the servers."""

    def zero_grad(self, names: Sequence[str], set_to_none: bool) -> None:
        """Forgets gradients of these variables (dense and row gradients)."""

    def settle_replicated(self) -> None:
        """Hybrid training (sync_dense): makes the replicated dense variables hold the update
        of the step in flight (a worker applies it lazily, when a layer holding them runs)."""


class NoAccess:
    """Outside any worker closure and any strategy: distributed variables are plain tensors."""

    def parameter(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
        raise RuntimeError(
            f"variable {name!r} was sent outside a paramserve closure; run it through ClusterCoordinator.schedule()"
        )

    def refresh(self, parameters: Sequence[nn.Parameter]) -> None:
        return None

    def place(self, module: nn.Module) -> None:
        return None

    def lookup(self, lookups: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        raise RuntimeError(
            f"embedding table {next(iter(lookups), '')!r} lives on parameter servers: use it inside "
            "strategy.scope() code run by a ClusterCoordinator, or after the strategy has created it"
        )

    def lookup_dynamic(self, table: str, ids: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
        return self.lookup({table: ids})[table]

    def apply_gradients(self, names: Sequence[str]) -> None:
        raise RuntimeError("ServerOptimizer.step() needs a ParameterServerStrategy; none is active")

    def zero_grad(self, names: Sequence[str], set_to_none: bool) -> None:
        return None

    def settle_replicated(self) -> None:
        return None


_state = threading.local()
_NO_ACCESS = NoAccess()


def current_access(home: VariableAccess | None = None) -> VariableAccess:
    """The access of the closure this thread runs, else ``home`` (the coordinator's strategy,
    for objects it built), else one that explains the object is used out of place."""
    return getattr(_state, "access", None) or home or _NO_ACCESS


@contextlib.contextmanager
def using_access(access: VariableAccess) -> Iterator[VariableAccess]:
    """Makes ``access`` current for this thread (a worker running one closure)."""
    previous = getattr(_state, "access", None)
    _state.access = access
    try:
        yield access
    finally:
        _state.access = previous


class TableRegistry(Protocol):
    """What a strategy scope provides so that tables created in it become variables."""

    def register_table(self, table: Any) -> None:
        """``table``: a ShardedEmbedding or a DynamicEmbedding (worker.dynamic_embedding)."""


def active_registry() -> TableRegistry | None:
    """The registry of the scope open in this thread, if any."""
    registries: list[TableRegistry] = getattr(_state, "registries", [])
    return registries[-1] if registries else None


@contextlib.contextmanager
def registering_tables(registry: TableRegistry) -> Iterator[None]:
    """Inside this block, new ShardedEmbedding tables built in this thread register with ``registry``."""
    registries = getattr(_state, "registries", None)
    if registries is None:
        registries = _state.registries = []
    registries.append(registry)
    try:
        yield
    finally:
        registries.remove(registry)


def variable_name(parameter: torch.Tensor) -> str | None:
    return getattr(parameter, VARIABLE_ATTRIBUTE, None)


def mark_variable(parameter: nn.Parameter, name: str) -> None:
    setattr(parameter, VARIABLE_ATTRIBUTE, name)


def unmark_variable(parameter: nn.Parameter) -> None:
    """Undoes ``mark_variable``: the parameter is a plain one again."""
    if hasattr(parameter, VARIABLE_ATTRIBUTE):
        delattr(parameter, VARIABLE_ATTRIBUTE)


def distributed_parameters(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters() if variable_name(p) is not None]


# ------------------------------------------------------------------ modules


class RefreshBeforeForward:
    """Forward pre-hook installed on modules built in a strategy scope: puts the module's
    buffers where its variables live (a GPU worker's device) and makes its distributed
    parameters current before they are used (each a no-op when already so)."""

    def __init__(self, home: VariableAccess | None = None):
        self.home = home

    def __call__(self, module: nn.Module, args: Any) -> None:
        access = current_access(self.home)
        access.place(module)
        access.refresh(distributed_parameters(module))

    def __reduce__(self) -> tuple[type[RefreshBeforeForward], tuple[()]]:
        return RefreshBeforeForward, ()  # on a worker the closure's access applies


class SettleBeforeForward:
    """Forward pre-hook of each layer holding replicated dense variables (hybrid training): the
    update of the step in flight is applied before the layer runs. Applied there, not before the
    whole model runs, the all-reduce of a step goes on while the next step reads its embedding
    rows from the servers."""

    def __call__(self, module: nn.Module, args: Any) -> None:
        current_access().settle_replicated()


class ShardedEmbedding(nn.Module):
    """An embedding table that lives only on the parameter servers.

    A lookup pulls just the distinct rows it touches; ``optimizer.step()`` pushes just their
    gradients, summed per row. The table is never materialised locally, so it may be far
    larger than any machine's memory or any message. Create it inside ``strategy.scope()``;
    ``initializer`` is filled on the servers. ``name``: the variable's name on the servers
    (under the strategy's ``run_name``), in a module or on its own; by default the module
    path (``dlrm.tables.user``) or ``embedding[_n]``. Lookups of several tables travel
    together (worker.deferred_rows), and ParameterServerStrategy stores a model's unnamed tables
    of one layout as one variable (``fuse_tables``): a table per feature costs a step what a
    ShardedEmbeddingCollection does.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        name: str | None = None,
        dtype: torch.dtype = torch.float32,
        initializer: str = "normal",
        init_std: float = 1.0,
        seed: int = 0,
    ):
        super().__init__()
        if num_embeddings <= 0 or embedding_dim <= 0:
            raise ValueError(f"ShardedEmbedding needs positive sizes, got {num_embeddings} x {embedding_dim}")
        if name is not None and (not isinstance(name, str) or not name.strip() or name != name.strip()):
            raise ValueError(
                f"ShardedEmbedding name must be a non-empty string without surrounding spaces, got {name!r}; "
                "leave it out to name the table by its place in the model"
            )
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.dtype = dtype
        self.initializer = initializer
        self.init_std = init_std
        self.seed = seed
        self.requested_name = name
        """The name the user asked for (a strategy that adopts the table prefixes its run name)."""
        self.variable = name or ""
        """The variable's name on the servers: as asked, until a strategy adopts the table and
        names it (its ``home`` is then set)."""
        self.home: VariableAccess | None = None
        """The coordinator's access (set by its strategy); not pickled."""
        self.fused: FusedRange | None = None
        """Where its strategy stores it in a variable it shares with the model's other tables of
        its layout (coordinator.strategies.table_fusion); None: a variable of its own."""
        registry = active_registry()
        if registry is not None:
            registry.register_table(self)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        return {**state, "home": None}

    @property
    def row_offset(self) -> int:
        """Its first row in the variable it is stored in."""
        return self.fused.offset if self.fused else 0

    @property
    def place(self) -> str:
        """A fused table's place in its model (``<model>.<module path>``); else empty."""
        return self.fused.name if self.fused else ""

    @property
    def shape(self) -> tuple[int, int]:
        return (self.num_embeddings, self.embedding_dim)

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        """The rows of ``indices`` (any integer shape): ``indices.shape + (embedding_dim,)``. They
        are read when first used, with every other lookup of the step noted by then, in one
        exchange per server (worker.deferred_rows): separate tables cost one round trip, not one each."""
        self._check_created()
        if indices.dtype.is_floating_point or indices.dtype.is_complex or indices.dtype == torch.bool:
            raise TypeError(
                f"ShardedEmbedding {self.variable!r} takes integer row ids, got a {indices.dtype} tensor: "
                "convert them with .long()"
            )
        access = current_access(self.home)
        if isinstance(access, NoAccess):  # raises at once: used out of place
            return access.lookup({self.variable: indices})[self.variable]
        return pending_rows(access.lookup, access, self.variable, indices, self.embedding_dim, self.dtype, self.fused)

    def adopted(self) -> bool:
        """Whether a strategy on this process has made the table its variable."""
        return self.home is not None

    def _check_created(self) -> None:
        if not self.variable:
            raise RuntimeError("this ShardedEmbedding was not created inside strategy.scope()")

    def extra_repr(self) -> str:
        where = f" (rows {self.row_offset}+ of the fused variable)" if self.fused else ""
        return f"{self.variable!r}{where}, {self.num_embeddings}, {self.embedding_dim}"


class ShardedEmbeddingCollection(nn.Module):
    """Embedding tables read together, stored as one: ``forward({feature: ids})`` returns
    ``{feature: rows}``.

    The tables (``tables``: rows per feature, all of dimension ``embedding_dim``) are row ranges
    of a single ShardedEmbedding (``self.table``; feature f's row i is its row
    ``self.offsets[f] + i``), as TorchRec batches tables: a step's lookups of every feature
    are one lookup, one exchange per parameter server and one coalesced push, and a server
    updates them as one sparse step however many tables the model has. The signature
    ``(rows_by_feature, embedding_dim)`` matches a factory of local tables, so a model can take
    either. ``name`` and the other arguments are ShardedEmbedding's, for the whole collection.
    Raises IndexError in forward for an id outside its feature's table."""

    def __init__(
        self,
        tables: Mapping[str, int],
        embedding_dim: int,
        *,
        name: str | None = None,
        dtype: torch.dtype = torch.float32,
        initializer: str = "normal",
        init_std: float = 1.0,
        seed: int = 0,
    ):
        super().__init__()
        if not tables:
            raise ValueError("ShardedEmbeddingCollection needs at least one table")
        bad = {feature: rows for feature, rows in tables.items() if not isinstance(rows, int) or rows <= 0}
        if bad:
            raise ValueError(f"every table needs a positive number of rows, got {bad}")
        self.rows = dict(tables)
        """Rows per feature."""
        self.offsets: dict[str, int] = {}
        """Where each feature's table starts in ``self.table``."""
        total = 0
        for feature, rows in tables.items():
            self.offsets[feature] = total
            total += rows
        self.table = ShardedEmbedding(
            total, embedding_dim, name=name, dtype=dtype, initializer=initializer, init_std=init_std, seed=seed
        )

    def forward(self, ids: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        features = tuple(ids)
        flat = [ids[feature].reshape(-1) for feature in features]
        counts = [piece.numel() for piece in flat]
        # On the host: the servers are sent host ids anyway, and the checks need no device sync.
        rows = self.table(self._global_rows(features, torch.cat(flat).to("cpu", torch.int64), counts))
        pieces = rows.split(counts)
        return {f: piece.reshape(*ids[f].shape, -1) for f, piece in zip(features, pieces)}

    def _global_rows(self, features: tuple[str, ...], flat: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Each feature's ids (``flat``: concatenated, ``counts`` per feature) as rows of the one
        table: checked against their own table's size and moved by its offset, in a few tensor
        operations for every feature at once (a model has tens of them)."""
        unknown = [feature for feature in features if feature not in self.offsets]
        if unknown:
            raise KeyError(f"no table for feature {unknown[0]!r}; the tables are {sorted(self.offsets)}")
        sizes = torch.tensor(counts)
        offsets = torch.tensor([self.offsets[f] for f in features]).repeat_interleave(sizes)
        limits = torch.tensor([self.rows[f] for f in features]).repeat_interleave(sizes)
        outside = (flat < 0) | (flat >= limits)
        if bool(outside.any()):
            position = int(outside.nonzero()[0, 0])
            feature = features[int(torch.searchsorted(sizes.cumsum(0), position, right=True))]
            raise IndexError(
                f"id {int(flat[position])} of feature {feature!r} is outside its table's [0, {self.rows[feature]})"
            )
        return flat + offsets


# ------------------------------------------------------------------ optimizer


class ServerOptimizer:
    """The optimizer a closure calls: ``step()`` pushes gradients; the parameter
    servers apply the real torch.optim update (``spec``) to their shards."""

    def __init__(
        self,
        variables: Sequence[str],
        spec_name: str,
        spec_kwargs: Mapping[str, Any],
        home: VariableAccess | None = None,
        owner: object | None = None,
    ):
        self.variables = tuple(variables)
        self.spec_name = spec_name
        self.spec_kwargs = dict(spec_kwargs)
        self.home = home
        """The coordinator's access; not pickled."""
        self.owner = owner
        """The strategy that made it, on the coordinator; not pickled."""

    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        close_open_batch()  # the next step's lookups are read apart from this one's
        current_access(self.home).apply_gradients(self.variables)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        close_open_batch()
        current_access(self.home).zero_grad(self.variables, set_to_none)

    def release(self, variable: str) -> None:
        """Stops stepping ``variable``: another optimizer was declared for it (on the coordinator,
        before any closure carried this one to a worker)."""
        self.variables = tuple(name for name in self.variables if name != variable)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "home": None, "owner": None}

    def __repr__(self) -> str:
        return f"ServerOptimizer({self.spec_name}, {self.spec_kwargs}, {len(self.variables)} variables)"


def steps_elsewhere(optimizer: object, strategy: object) -> bool:
    """Whether ``optimizer`` updates the variables of a strategy other than ``strategy``: a
    parameter-server optimizer that ``strategy`` did not make (other optimizers update the
    parameters they hold, wherever they run)."""
    return isinstance(optimizer, ServerOptimizer) and optimizer.owner is not strategy
