"""The state of one parameter server: shards of variables and their optimizers.

A :class:`ShardStore` holds shards keyed by :class:`ShardRef`. Every request
is validated completely before anything changes, so a bad request leaves the
store exactly as it was. Each shard has a lock; a push holds the locks of the
shards it updates (taken in sorted order), so pushes to disjoint shards run
concurrently. A separate lock guards only
the dictionary of shards (lookups, creation, deletion) and is never held
while tensors are copied or updated.

Exactly-once pushes: each shard remembers the idempotency keys of its recent
pushes (:class:`IdempotencyWindow`); a retried push whose key it has seen is
reported as not applied and changes nothing.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch
from torch import Tensor

from paramserve.psserver.dynamic.dynamic_types import ARENA_BLOCK_COLUMN_BYTES
from paramserve.psserver.protocol.errors import (
    DtypeMismatchError,
    InternalError,
    InvalidRequestError,
    ParamServeError,
    ShapeMismatchError,
    StalePushError,
    VariableExistsError,
    VariableNotFoundError,
)
from paramserve.psserver.protocol.optimizer_spec import OptimizerSpec
from paramserve.psserver.protocol.types import PushOutcome, ShardInfo, ShardRef, ShardState
from paramserve.psserver.runtime.memory import released
from paramserve.psserver.store.dynamic_table import DynamicTableConfig, DynamicTables, PushSettings
from paramserve.psserver.store.optimizer import GroupedSteps, ShardOptimizer, in_place_sgd_rate
from paramserve.psserver.store.shards import (
    Shard,
    about,
    all_finite,
    all_locked,
    build_shard,
    check_finite,
    check_replaceable,
    check_rows,
    check_variables_agree,
    is_int,
)

_R = TypeVar("_R")

__all__ = [
    "UNREPLICATED",
    "PreparedStep",
    "Pulled",
    "PushObserver",
    "ReplicationSink",
    "ShardPush",
    "ShardStore",
    "StoreConfig",
]


@dataclass(frozen=True)
class ShardPush:
    """A gradient for one shard: dense (``rows`` None) or for the given local rows.

    ``base_version`` is the shard version the gradient was computed from; a
    negative one means unknown (staleness then counts as 0 and is not bounded).
    """

    ref: ShardRef
    values: Tensor
    rows: Tensor | None = None
    base_version: int = -1


@dataclass(frozen=True, eq=False)
class PreparedStep:
    """A recurring step's shards, resolved and checked once (``ShardStore.prepare_step``): its
    dense pushes and its whole-shard reads, in the step's order and in lock order. Valid while
    the store's ``catalog_version`` is the one it was prepared at."""

    catalog_version: int
    pushes: tuple[Shard, ...]
    push_lock_order: tuple[Shard, ...]
    reads: tuple[Shard, ...]
    read_lock_order: tuple[Shard, ...]
    read_layout: tuple[tuple[torch.dtype, tuple[int, ...], int], ...]
    """Each read's dtype, shape and bytes, in the step's order."""


@dataclass(frozen=True)
class Pulled:
    value: Tensor
    version: int


@dataclass(frozen=True)
class StoreConfig:
    """Configuration of one store.

    ``idempotency_capacity``: pushes per shard whose keys are remembered.
    ``allow_nonfinite``: accept gradients holding NaN or Inf.
    ``max_staleness``: reject a push computed from a version more than this
    many updates behind the shard (None: no bound).
    """

    idempotency_capacity: int = 65536
    allow_nonfinite: bool = False
    max_staleness: int | None = None
    dynamic_block_bytes: int = ARENA_BLOCK_COLUMN_BYTES
    """A dynamic table's default arena block, in its widest column (dynamic_types.block_bytes_within)."""

    def __post_init__(self) -> None:
        if not is_int(self.idempotency_capacity) or self.idempotency_capacity < 1:
            raise ValueError(f"idempotency_capacity must be a positive int, got {self.idempotency_capacity!r}")
        if self.max_staleness is not None and (not is_int(self.max_staleness) or self.max_staleness < 0):
            raise ValueError(f"max_staleness must be None or an int >= 0, got {self.max_staleness!r}")


class PushObserver(Protocol):
    """Told about every push outcome and every rejected push (e.g. to count them in metrics)."""

    def on_push(self, outcome: PushOutcome) -> None: ...

    def on_rejected(self, error: ParamServeError) -> None: ...


# ---------------------------------------------------------------------------
# Validation of pushes


def _check_push_values(push: ShardPush, shard: Shard, allow_nonfinite: bool) -> None:
    values = push.values
    if not isinstance(values, Tensor):
        raise InvalidRequestError(f"push values must be a tensor, got {type(values).__name__}")
    if values.dtype != shard.value.dtype:
        raise DtypeMismatchError(f"gradient dtype {values.dtype} does not match the shard's {shard.value.dtype}")
    if push.rows is None:
        expected = tuple(shard.value.shape)
    else:
        check_rows(push.rows, shard)
        expected = (push.rows.shape[0], *shard.value.shape[1:])
    if tuple(values.shape) != expected:
        raise ShapeMismatchError(f"gradient shape {tuple(values.shape)} does not match the expected {expected}")
    if not allow_nonfinite:
        check_finite(shard, values)


def _staleness(version: int, base_version: int) -> int:
    """Updates applied since ``base_version``; 0 when it is unknown (negative)."""
    return max(0, version - base_version) if base_version >= 0 else 0


class ReplicationSink(Protocol):
    """Where the store reports each write it made, for a primary to forward to its backups
    (psserver/replication/replica.py: ``Replica``). ``pushed`` and ``hyperparameters_set`` are called
    still holding the written shards' locks, so backups see each shard's writes in order; each
    raises (a ParamServeError) when the write cannot be acknowledged."""

    def pushed(self, pushes: Sequence[ShardPush], key: str) -> Callable[[], None]:
        """Sends ``pushes`` on (under their shards' locks); what it returns waits, after the
        locks are released, until they were applied everywhere, and raises if they were not."""

    def shards_written(self, states: Callable[[], Sequence[ShardState]], replace: bool) -> None:
        """``states()`` copies the written shards: called only by a primary that forwards them."""

    def hyperparameters_set(self, variables: Sequence[str | None], values: Mapping[str, Any]) -> None: ...

    def variable_deleted(self, variable: str) -> None: ...

    def refuse_dynamic(self, variable: str) -> None: ...


def _applied() -> None:
    """Nothing to wait for: no backup."""


class _Unreplicated:
    """The sink of a server that is not replicated: nothing to forward."""

    def pushed(self, pushes: Sequence[ShardPush], key: str) -> Callable[[], None]:
        return _applied

    def shards_written(self, states: Callable[[], Sequence[ShardState]], replace: bool) -> None:
        pass

    def hyperparameters_set(self, variables: Sequence[str | None], values: Mapping[str, Any]) -> None:
        pass

    def variable_deleted(self, variable: str) -> None:
        pass

    def refuse_dynamic(self, variable: str) -> None:
        pass


UNREPLICATED: ReplicationSink = _Unreplicated()
"""The sink of a store no replicated server holds (a test's, a tool's): it forwards nothing."""


class ShardStore:
    """All shards of one parameter server. Thread-safe. ``replication`` is told of every write
    (psserver/replication/replica.py: a server's ``Replica``, whose backups apply it too when it
    is a primary); a store of no server is ``UNREPLICATED``."""

    def __init__(
        self,
        config: StoreConfig | None = None,
        observer: PushObserver | None = None,
        *,
        replication: ReplicationSink = UNREPLICATED,
    ):
        self._config = config or StoreConfig()
        self._observer = observer
        self._replication = replication
        self._shards: dict[ShardRef, Shard] = {}
        self._shards_lock = threading.Lock()
        self._grouped = GroupedSteps()
        self.dynamic = DynamicTables(
            self._config.idempotency_capacity,
            PushSettings(self._config.allow_nonfinite, self._config.max_staleness),
            block_bytes=self._config.dynamic_block_bytes,
        )
        """The dynamic embedding tables' shards (psserver/store/dynamic_table.py): read and pushed by
        id through ``pull_rows`` and ``push``, as row reads and row pushes of other shards."""
        self.catalog_version = 0
        """Bumped by every create, replace or delete of shards: a PreparedStep of another
        catalog version may hold shards that are gone (prepare it again). Not the cluster
        context's ``generation``, which counts restores across the cluster."""
        self.incarnation = uuid.uuid4().hex
        """Names this store: a server process that restarts holds a new, empty one, and the
        coordinator tells a restart (state lost) from a pause by this changing."""

    @property
    def config(self) -> StoreConfig:
        return self._config

    # -- creation and lookup ------------------------------------------------

    def create_shards(self, states: Sequence[ShardState], *, owned: bool = False) -> list[ShardInfo]:
        """Creates shards from ``states`` (copied, unless ``owned``: see shards.build_shard), all
        or none.

        A shard that exists already with the same variable shape, rows,
        shape, dtype and optimizer is left as it is (so a retried create is
        safe) and its info returned. Raises VariableExistsError for a
        different existing shard, and InvalidRequestError / ShapeMismatchError
        / DtypeMismatchError for a bad state, before anything is created.
        """
        built = [build_shard(state, self._config.idempotency_capacity, owned=owned) for state in states]
        check_variables_agree(built)
        with self._shards_lock:
            kept = [self._keep_or_conflict(shard) for shard in built]
            for shard, existing in zip(built, kept):
                if existing is None:
                    self._shards[shard.ref] = shard
                    self.catalog_version += 1
        self._replication.shards_written(
            lambda: [(existing or shard).export() for shard, existing in zip(built, kept)], False
        )
        return [(existing or shard).info() for shard, existing in zip(built, kept)]

    def replace_shards(self, states: Sequence[ShardState], *, owned: bool = False) -> list[ShardInfo]:
        """Makes the shards of ``states``' variables exactly ``states`` (a restore): values,
        optimizer state, versions and idempotency windows. All or nothing.

        A variable is replaced whole on this server, never mixed: every shard of it held
        here must be among ``states`` (InvalidRequestError otherwise), and a variable that
        exists keeps its shape and dtype (ShapeMismatchError / DtypeMismatchError naming
        both; delete the variable to restore another shape). Everything is checked before
        anything changes. Pushes must not run meanwhile: one holding a replaced shard
        would apply to the discarded copy (the coordinator pauses dispatch to restore).
        """
        built = [build_shard(state, self._config.idempotency_capacity, owned=owned) for state in states]
        check_variables_agree(built)
        restored: dict[str, list[Shard]] = {}
        for shard in built:
            restored.setdefault(shard.ref.variable, []).append(shard)
        with self._shards_lock:
            for variable, shards in restored.items():
                check_replaceable(variable, shards, [s for ref, s in self._shards.items() if ref.variable == variable])
            for shard in built:
                self._shards[shard.ref] = shard
            self.catalog_version += 1
        self._grouped.clear()  # groups hold the replaced shards' tensors
        self._replication.shards_written(lambda: [shard.export() for shard in built], True)
        return [shard.info() for shard in built]

    def _keep_or_conflict(self, shard: Shard) -> Shard | None:
        """The existing shard to keep instead of ``shard``, or None to insert ``shard``."""
        for other in self._shards.values():
            if other.ref.variable == shard.ref.variable and other.ref != shard.ref:
                if (other.variable_shape, other.value.dtype) != (shard.variable_shape, shard.value.dtype):
                    raise VariableExistsError(
                        f"the variable exists with shape {other.variable_shape} and dtype {other.value.dtype}; "
                        f"delete it first to create it as {shard.variable_shape} {shard.value.dtype}",
                        variable=shard.ref.variable,
                    )
        existing = self._shards.get(shard.ref)
        if existing is None:
            return None
        if existing.same_layout(shard):
            return existing
        raise VariableExistsError(
            f"shard {shard.ref.shard} exists with a different layout ({existing.info()}); delete the variable first",
            variable=shard.ref.variable,
        )

    def _get(self, ref: ShardRef) -> Shard:
        with self._shards_lock:
            shard = self._shards.get(ref)
        if shard is None:
            raise VariableNotFoundError(
                f"shard {ref.shard} of variable {ref.variable!r} is not on this server", variable=ref.variable
            )
        return shard

    def _select(self, variable: str | None) -> list[Shard]:
        """Shards of ``variable`` (every shard for None or ""), sorted by ref."""
        with self._shards_lock:
            shards = [s for ref, s in self._shards.items() if not variable or ref.variable == variable]
        return sorted(shards, key=lambda shard: shard.ref)

    def create_dynamic(self, ref: ShardRef, num_shards: int, config: DynamicTableConfig) -> None:
        """Creates this server's shard of a dynamic table (a retry of an identical create keeps
        it); VariableExistsError when a variable of that name, or other settings, exists."""
        self._replication.refuse_dynamic(ref.variable)
        with self._shards_lock:
            if any(existing.variable == ref.variable for existing in self._shards):
                raise VariableExistsError(
                    "a variable of this name exists; a dynamic table needs its own", variable=ref.variable
                )
        self.dynamic.create(ref, num_shards, config)

    def delete_variable(self, variable: str) -> int:
        """Removes every shard of ``variable``; returns how many (0 if none, so a retry is safe)."""
        dynamic = self.dynamic.delete(variable)
        if dynamic:
            return dynamic
        with self._shards_lock:
            refs = [ref for ref in self._shards if ref.variable == variable]
            for ref in refs:
                del self._shards[ref]
            self.catalog_version += 1
        self._grouped.clear()  # groups hold the deleted shards' tensors
        if refs:
            self._replication.variable_deleted(variable)
        return len(refs)

    def shards(self) -> list[Shard]:
        """Every shard, sorted by ref (what a primary copies into a joining backup)."""
        return self._select(None)

    def current(self, ref: ShardRef) -> Shard | None:
        """The shard held under ``ref`` now (None: none)."""
        with self._shards_lock:
            return self._shards.get(ref)

    def structure_sizes(self) -> dict[str, int]:
        """The sizes of what this store keeps per shard and per push (diagnostics and metrics; each
        is bounded: the windows by ``idempotency_capacity`` keys a shard, allocated whole when the
        shard is made (``idempotency_bytes``; store/idempotency.py), the optimizer groups by
        GroupedSteps' capacity, dynamic rows by their tables' capacities)."""
        shards = self._select(None)
        return {
            "shards": len(shards),
            "idempotency_keys": sum(len(shard.window) for shard in shards),
            "idempotency_capacity": sum(shard.window.capacity for shard in shards),
            "idempotency_bytes": sum(shard.window.allocated_bytes() for shard in shards),
            "optimizer_groups": len(self._grouped),
            "dynamic_rows": sum(stats.live_rows for stats in self.dynamic.stats()),
        }

    def list_shards(self) -> list[ShardInfo]:
        return [shard.info() for shard in self._select(None)]

    def info(self, ref: ShardRef) -> ShardInfo:
        """Raises VariableNotFoundError naming the variable and shard."""
        return self._get(ref).info()

    # -- reads ----------------------------------------------------------------

    def pull(self, ref: ShardRef) -> Pulled:
        """A copy of the whole shard and the version it was read at."""
        shard = self._get(ref)
        with shard.lock:
            return Pulled(shard.value.clone(), shard.version)

    def read(self, ref: ShardRef, reader: Callable[[Tensor, int], _R]) -> _R:
        """Runs ``reader(value, version)`` on the live shard under its lock and returns
        what it returns. For serialising a snapshot without an intermediate clone;
        the reader must copy what it keeps and must not modify the tensor."""
        shard = self._get(ref)
        with shard.lock:
            return reader(shard.value, shard.version)

    def check_reads(self, reads: Sequence[tuple[ShardRef, Tensor | None]]) -> None:
        """Raises what ``read_many`` / ``pull_rows`` of these (shard, rows or None) would raise,
        reading nothing: for requests that must fail before they change anything."""
        for ref, rows in reads:
            if rows is not None and self.dynamic.holds(ref):
                with about(ref.variable):
                    self.dynamic.get(ref).check_ids(rows)
                continue
            shard = self._get(ref)
            if rows is not None:
                with about(ref.variable):
                    check_rows(rows, shard)

    def read_many(self, refs: Sequence[ShardRef], reader: Callable[[dict[ShardRef, Pulled]], _R]) -> _R:
        """Runs ``reader`` on the live shards ``refs`` (value and version of each), all locked at
        once (in sorted order, as every multi-shard lock here is taken): one consistent cut of
        them, serialised without an intermediate clone. The reader must copy what it keeps and
        must not modify the tensors. Raises VariableNotFoundError before locking anything."""
        shards = [self._get(ref) for ref in sorted(set(refs))]
        with all_locked(shards):
            return reader({shard.ref: Pulled(shard.value, shard.version) for shard in shards})

    def pull_rows(self, ref: ShardRef, rows: Tensor) -> Pulled:
        """Copies of the given local rows, in request order (duplicates allowed); O(len(rows)).

        Raises InvalidRequestError unless ``rows`` is 1-d int64, and
        IndexOutOfRangeError naming the first index outside the shard. For a dynamic table's
        shard ``rows`` are ids: their rows, made or defaulted as its admission says.
        """
        if self.dynamic.holds(ref):
            table = self.dynamic.get(ref)
            with about(ref.variable):
                table.check_ids(rows)
            return Pulled(*table.lookup(rows, self.dynamic.clock()))
        shard = self._get(ref)
        with about(ref.variable):
            check_rows(rows, shard)
        with shard.lock:
            return Pulled(shard.value.index_select(0, rows), shard.version)

    def check_push_header(
        self, ref: ShardRef, dtype: torch.dtype, shape: Sequence[int], num_indices: int | None
    ) -> None:
        """Raises what ``push`` would for a gradient of this dtype and shape (``num_indices`` rows
        of a row-sparse push; None: dense), reading nothing: a server checks a push against its
        shard this way before it receives, or allocates room for, the push's bytes."""
        if self.dynamic.holds(ref):
            with about(ref.variable):
                return self.dynamic.get(ref).check_push_header(dtype, shape, num_indices)
        shard = self._get(ref)
        with about(ref.variable):
            if shard.optimizer is None:
                raise InvalidRequestError(f"variable {ref.variable} has no optimizer; create it with one")
            if dtype != shard.value.dtype:
                raise DtypeMismatchError(f"gradient dtype {dtype} does not match the shard's {shard.value.dtype}")
            if num_indices is None:
                expected = tuple(shard.value.shape)
            else:
                if shard.value.dim() == 0:
                    raise ShapeMismatchError("a 0-d variable has no rows; push it whole")
                expected = (num_indices, *shard.value.shape[1:])
            if tuple(shape) != expected:
                raise ShapeMismatchError(f"gradient shape {tuple(shape)} does not match the expected {expected}")

    def rows_nbytes(self, ref: ShardRef, rows: int | None) -> int:
        """Bytes a read of ``rows`` rows of the shard (None: all of it) returns; raises
        VariableNotFoundError for an unknown shard."""
        if self.dynamic.holds(ref):
            config = self.dynamic.get(ref).config
            return (rows or 0) * config.dim * config.dtype.itemsize
        value = self._get(ref).value
        if rows is None:
            return value.numel() * value.element_size()
        return rows * (value[0].numel() if value.dim() else 1) * value.element_size()

    # -- updates --------------------------------------------------------------

    def push(self, pushes: Sequence[ShardPush], idempotency_key: str) -> list[PushOutcome]:
        """Applies gradients: all pushes are validated before any is applied.

        A shard that has seen ``idempotency_key`` applies nothing and reports
        ``applied=False``. Raises (and tells the observer) InvalidRequestError,
        VariableNotFoundError, DtypeMismatchError, ShapeMismatchError,
        IndexOutOfRangeError, NonFiniteGradientError or StalePushError,
        changing nothing. The staleness bound is checked at validation.
        """
        if any(self.dynamic.holds(push.ref) for push in pushes):
            return self._push_with_dynamic(pushes, idempotency_key)
        try:
            plan = self._validate_pushes(pushes, idempotency_key)
        except ParamServeError as error:
            if self._observer is not None:
                self._observer.on_rejected(error)
            raise
        outcomes = self._apply_all(plan, idempotency_key)
        if self._observer is not None:
            for outcome in outcomes:
                self._observer.on_push(outcome)
        return outcomes

    def _push_with_dynamic(self, pushes: Sequence[ShardPush], key: str) -> list[PushOutcome]:
        """``push`` of parts some of which update dynamic tables: those are checked first, the
        others pushed as usual (checked, then applied), then the dynamic ones applied (their
        apply steps gathered copies and cannot fail halfway)."""
        dynamic = [push for push in pushes if self.dynamic.holds(push.ref)]
        try:
            self._check_key(key)
            for push in dynamic:
                if push.rows is None:
                    raise InvalidRequestError("a dynamic table takes row gradients by id, never a dense push")
                with about(push.ref.variable):
                    self.dynamic.get(push.ref).check_push(
                        push.rows, push.values, push.base_version, key, self.dynamic.settings
                    )
        except ParamServeError as error:
            if self._observer is not None:
                self._observer.on_rejected(error)
            raise
        others = self.push([push for push in pushes if not self.dynamic.holds(push.ref)], key)
        now = self.dynamic.clock()
        applied = {
            push.ref: self.dynamic.get(push.ref).push(push.rows, push.values, key, push.base_version, now)  # type: ignore[arg-type]
            for push in dynamic
        }
        if self._observer is not None:
            for outcome in applied.values():
                self._observer.on_push(outcome)
        applied.update({outcome.ref: outcome for outcome in others})
        return [applied[push.ref] for push in pushes]

    def prepare_step(
        self, pushes: Sequence[tuple[ShardRef, torch.dtype, tuple[int, ...]]], reads: Sequence[ShardRef]
    ) -> PreparedStep:
        """Resolves a recurring step's shards and checks its dense pushes (ref, dtype, shape) once,
        raising what ``check_push_header`` and ``read_many`` would: each later ``push_prepared`` /
        ``read_prepared`` of it skips the lookups and the checks that cannot change between steps.
        The per-step checks (finite values, staleness, the key) stay."""
        catalog_version = self.catalog_version
        seen: set[ShardRef] = set()
        for ref, dtype, shape in pushes:
            if ref in seen:
                raise InvalidRequestError(
                    f"shard {ref} appears twice in one push; sum the gradients", variable=ref.variable
                )
            seen.add(ref)
            self.check_push_header(ref, dtype, shape, None)
        push_shards = tuple(self._get(ref) for ref, _, _ in pushes)
        read_shards = tuple(self._get(ref) for ref in reads)
        return PreparedStep(
            catalog_version,
            push_shards,
            tuple(sorted(push_shards, key=lambda shard: shard.ref)),
            read_shards,
            tuple(sorted(set(read_shards), key=lambda shard: shard.ref)),
            tuple((s.value.dtype, tuple(s.value.shape), s.value.numel() * s.value.element_size()) for s in read_shards),
        )

    def push_prepared(
        self,
        step: PreparedStep,
        values: Sequence[Tensor],
        base_versions: Sequence[int],
        key: str,
        *,
        flat: Tensor | None = None,
        checked: bool = False,
    ) -> list[PushOutcome]:
        """``push`` of ``values`` (one per ``step.pushes``, of the checked dtype and shape) with
        their base versions (negative: unknown). ``flat``: the same values back to back as one
        tensor of their dtype, when they are, so that one scan checks them all for NaN and Inf.
        ``checked``: a write a replicated primary forwarded, whose values it scanned already (the
        same bytes pass or fail the same way: the scan is skipped)."""
        try:
            self._check_key(key)
            plan = [
                (shard, ShardPush(shard.ref, value, None, base))
                for shard, value, base in zip(step.pushes, values, base_versions)
            ]
            if not (self._config.allow_nonfinite or checked) and not (flat is not None and all_finite(flat)):
                for shard, push in plan:  # the exact scan, to name the culprit
                    with about(shard.ref.variable):
                        check_finite(shard, push.values)
            if self._config.max_staleness is not None:
                for shard, push in plan:
                    with about(shard.ref.variable):
                        self._check_staleness(shard, push, key)
        except ParamServeError as error:
            if self._observer is not None:
                self._observer.on_rejected(error)
            raise
        outcomes = self._apply_all(plan, key, step.push_lock_order)
        if self._observer is not None:
            for outcome in outcomes:
                self._observer.on_push(outcome)
        return outcomes

    def read_prepared(self, step: PreparedStep, reader: Callable[[list[Pulled]], _R]) -> _R:
        """``read_many`` of ``step.reads``: ``reader`` gets each live shard's value and version, in
        the step's order, under all their locks (the same rules as ``read_many``)."""
        with all_locked(step.read_lock_order):
            return reader([Pulled(shard.value, shard.version) for shard in step.reads])

    @staticmethod
    def _check_key(key: str) -> None:
        if not isinstance(key, str) or not key:
            raise InvalidRequestError(
                "a push needs a non-empty idempotency key, so that a retry is never applied twice"
            )

    def _validate_pushes(self, pushes: Sequence[ShardPush], key: str) -> list[tuple[Shard, ShardPush]]:
        self._check_key(key)
        plan: list[tuple[Shard, ShardPush]] = []
        seen: set[ShardRef] = set()
        for push in pushes:
            if push.ref in seen:
                raise InvalidRequestError(
                    f"shard {push.ref} appears twice in one push; sum the gradients", variable=push.ref.variable
                )
            seen.add(push.ref)
            shard = self._get(push.ref)
            with about(push.ref.variable):
                self._validate_push(shard, push, key)
            plan.append((shard, push))
        return plan

    def _validate_push(self, shard: Shard, push: ShardPush, key: str) -> None:
        if shard.optimizer is None:
            raise InvalidRequestError(
                f"variable {shard.ref.variable} has no optimizer; create it with one", variable=shard.ref.variable
            )
        if not is_int(push.base_version):
            raise InvalidRequestError(f"base_version must be an int (negative: unknown), got {push.base_version!r}")
        _check_push_values(push, shard, self._config.allow_nonfinite)
        self._check_staleness(shard, push, key)

    def _check_staleness(self, shard: Shard, push: ShardPush, key: str) -> None:
        bound = self._config.max_staleness
        if bound is None or push.base_version < 0:
            return
        with shard.lock:
            duplicate, version = key in shard.window, shard.version
        # A retry of an applied push is answered as a duplicate, however stale it now looks.
        if not duplicate and version - push.base_version > bound:
            raise StalePushError(
                f"the gradient for shard {shard.ref.shard} was computed from version {push.base_version}, "
                f"{version - push.base_version} updates behind the current {version} "
                f"(max_staleness={bound}); pull the variable again and recompute"
            )

    def _apply_all(
        self, plan: Sequence[tuple[Shard, ShardPush]], key: str, lock_order: Sequence[Shard] | None = None
    ) -> list[PushOutcome]:
        """Applies a validated push under all its shards' locks (taken in sorted order, as every
        multi-shard lock here is; ``lock_order`` when the caller has it): shards that saw ``key``
        change nothing; dense gradients of one optimizer spec are applied as one torch.optim
        step (psserver.optimizer.GroupedSteps)."""
        outcomes: dict[ShardRef, PushOutcome] = {}
        if lock_order is None:
            lock_order = [shard for shard, _ in sorted(plan, key=lambda entry: entry[0].ref)]
        with all_locked(lock_order):
            fresh = []
            for shard, push in plan:
                staleness = _staleness(shard.version, push.base_version)
                if key in shard.window:
                    outcomes[shard.ref] = PushOutcome(shard.ref, False, shard.version, staleness)
                else:
                    fresh.append((shard, push, staleness))
            self._step_all([(shard, push) for shard, push, _ in fresh])
            for shard, _, staleness in fresh:
                shard.version += 1
                shard.window.record(key)
                outcomes[shard.ref] = PushOutcome(shard.ref, True, shard.version, staleness)
            replicated = self._replication.pushed([push for _, push, _ in fresh], key)  # under the locks: in order
        replicated()  # acknowledged only once every backup applied it
        return [outcomes[shard.ref] for shard, _ in plan]

    def _step_all(self, fresh: Sequence[tuple[Shard, ShardPush]]) -> None:
        """Steps every shard's optimizer, or none: a step failing after validation (out of
        memory, a bug) puts back what the push's earlier steps changed, from copies taken
        first (one copy of the pushed shards, or of the touched rows of a sparse push).

        The order keeps those copies few. Stateful dense groups run first (copied: torch.optim
        changes them in place, and something after them may fail). Row-sparse groups run next:
        a row step computes on gathered copies and writes them back only once it succeeded, so
        the last of them needs no copy when writing back allocates nothing (its shards hold their
        slots already) and nothing fallible runs after it. Plain SGD's groups
        (optimizer.in_place_sgd_rate: an in-place add of checked shapes, which allocates nothing
        and cannot fail halfway) run last and are not copied either."""
        dense: dict[OptimizerSpec, list[tuple[ShardOptimizer, Tensor]]] = {}
        sparse: list[tuple[ShardOptimizer, ShardPush]] = []
        for shard, push in fresh:
            optimizer = shard.optimizer
            assert optimizer is not None  # checked by _validate_push
            if push.rows is not None:
                sparse.append((optimizer, push))
            else:
                dense.setdefault(optimizer.spec, []).append((optimizer, push.values))
        stateful = [group for spec, group in dense.items() if in_place_sgd_rate(spec) is None]
        in_place = [group for spec, group in dense.items() if in_place_sgd_rate(spec) is not None]
        row_groups = list(_by_spec(sparse).values())
        undo: list[Callable[[], None]] = [optimizer.snapshot(None) for group in stateful for optimizer, _ in group]
        last_writes_back_whole = bool(row_groups) and all(optimizer.holds_slots for optimizer, _ in row_groups[-1])
        copied = row_groups[:-1] if last_writes_back_whole else row_groups
        undo += [optimizer.snapshot(push.rows) for group in copied for optimizer, push in group]
        try:
            for group in stateful:
                self._grouped.apply_dense([o for o, _ in group], [g for _, g in group])
            for rows_group in row_groups:
                self._grouped.apply_rows(
                    [o for o, _ in rows_group],
                    [p.rows for _, p in rows_group],  # type: ignore[misc]  # sparse: rows set
                    [p.values for _, p in rows_group],
                )
            for group in in_place:
                self._grouped.apply_dense([o for o, _ in group], [g for _, g in group])
        except Exception as exc:  # validated already: anything here is our bug or out of memory
            for restore in reversed(undo):
                restore()
            raise InternalError(
                f"applying a push to {len(fresh)} shards failed and was undone: {type(exc).__name__}: {exc}",
                variable=fresh[0][0].ref.variable,
            ) from exc
        finally:
            # The gradients, their reply and the undo copies are freed now: a few times the
            # pushed bytes, which the trimmer returns to the system once they add up.
            released(_PUSH_TRANSIENTS * sum(push.values.numel() * push.values.element_size() for _, push in fresh))

    # -- export and hyperparameters -------------------------------------------

    def export(self, refs: Sequence[ShardRef] | None = None) -> list[ShardState]:
        """Consistent copies of the given shards (every shard for None), with slots and keys.

        Raises VariableNotFoundError, before copying anything, for an unknown ref.
        """
        shards = self._select(None) if refs is None else [self._get(ref) for ref in refs]
        return [shard.export() for shard in shards]

    def set_hyperparameters(self, variable: str | None, values: Mapping[str, Any]) -> int:
        """Changes optimizer hyperparameters (e.g. ``{"lr": 0.01}``) of ``variable``'s shards,
        dense or of a dynamic table, or of every shard with an optimizer for None; returns how
        many shards changed.

        All or nothing: raises VariableNotFoundError for an unknown variable and
        InvalidRequestError for a variable without optimizer or a bad value.
        """
        return self.set_hyperparameters_of([variable] if variable else [None], values)

    def set_hyperparameters_of(self, variables: Sequence[str | None], values: Mapping[str, Any]) -> int:
        """``set_hyperparameters`` of several variables at once (one request of a scheduler's
        rate for a whole model), all or nothing across them: every one is checked first."""
        changes = []
        for variable in dict.fromkeys(variables):
            shards = self._select(variable)
            tables = self.dynamic.hyperparameter_changes(variable, values)
            if variable and not shards and not tables:
                raise VariableNotFoundError("no shard of the variable is on this server", variable=variable)
            if variable and any(shard.optimizer is None for shard in shards):
                raise InvalidRequestError("the variable has no optimizer", variable=variable)
            changes.append((variable, [shard for shard in shards if shard.optimizer is not None], tables))
        targets = [shard for _, shards, _ in changes for shard in shards]
        with all_locked(sorted(targets, key=lambda shard: shard.ref)):  # sorted, as every multi-shard lock
            for shard in targets:
                with about(shard.ref.variable):
                    shard.optimizer.with_hyperparameters(values)  # type: ignore[union-attr]
            for shard in targets:
                shard.optimizer.set_hyperparameters(values)  # type: ignore[union-attr]
            changed = [variable for variable, shards, _ in changes if shards]
            if changed:  # one forward for all of them (None: every variable)
                self._replication.hyperparameters_set(changed, values)
        for _, _, tables in changes:  # validated above, so this cannot fail halfway
            for table, config in tables:
                table.reconfigure(config)
        return len(targets) + sum(len(tables) for _, _, tables in changes)


_PUSH_TRANSIENTS = 4
"""Bytes a push allocates and frees per pushed byte, about: the gradient, the reply, the undo copies."""


def _by_spec(
    sparse: Sequence[tuple[ShardOptimizer, ShardPush]],
) -> dict[OptimizerSpec, list[tuple[ShardOptimizer, ShardPush]]]:
    """Sparse pushes grouped by optimizer spec (one torch.optim step per group)."""
    groups: dict[OptimizerSpec, list[tuple[ShardOptimizer, ShardPush]]] = {}
    for optimizer, push in sparse:
        groups.setdefault(optimizer.spec, []).append((optimizer, push))
    return groups
